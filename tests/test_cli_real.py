"""Hydra configurations as public Hydra and Lightning projects write them, run the way the command runs them.

``command`` calls ``safeloop.__main__.main`` in this process, with ``sys.argv`` as ``python -m safeloop ARGS`` sets
it: the same checks, the same ``@hydra.main``, the same run directories, without a new interpreter's start-up.
Cases that need no run directory call ``safeloop.config.compose`` (``hydra.compose``) directly. Every config file
is a real file in the test's directory, as a user's project holds it.
"""
import csv
import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate

from safeloop import ConfigError
from safeloop.__main__ import main
from safeloop.config import build, compose, train

SMALL = ("trainer.max_steps=2", "trainer.val_every=null", "data.n_train=64", "data.n_val=32", "trainer.progress=false")


@pytest.fixture
def command(monkeypatch, capsys):
    """``python -m safeloop ARGS`` in this process and the test's directory: (exit code, stdout, stderr). What a run
    changes for the whole process (Hydra's logging and its global state, ``sys.path``, torch's thread count) is put
    back after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    root = logging.getLogger()
    handlers, level, threads = list(root.handlers), root.level, torch.get_num_threads()

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["safeloop", *args])
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
        out = capsys.readouterr()
        return code, out.out, out.err

    yield run
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    torch.set_num_threads(threads)
    HydraConfig.instance().cfg = None  # a later build() must not take this run's output directory for its own
    GlobalHydra.instance().clear()


def project(root: Path, files: dict[str, str]) -> Path:
    """A user's directory: their modules and ``configs/``."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def rows(path: Path, metric: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r["value"])) for r in csv.DictReader(open(path)) if r["metric"] == metric]


# -- config groups of your own ----------------------------------------------------------------------------------
WRAPPER = ("import torch\n\n\nclass Wrapper(torch.nn.Module):\n"
           "    def __init__(self, net: torch.nn.Module, scale: float = 1.0):\n"
           "        super().__init__()\n        self.net, self.scale = net, scale\n\n"
           "    def forward(self, x):\n        return self.net(x) * self.scale\n")


def test_an_experiment_of_your_own_overrides_groups_and_a_model_with_a_nested_target(tmp_path, monkeypatch):
    """ashleve/lightning-hydra-template, configs/experiment/example.yaml (``# @package _global_``, ``override
    /model:``, ``seed``, trainer and optimizer keys) and configs/model/mnist.yaml (a ``net:`` with its own
    ``_target_`` inside the model's config)."""
    project(tmp_path, {
        "wrap.py": WRAPPER,
        "configs/model/wrapped.yaml": "_target_: wrap.Wrapper\nscale: 2.0\nnet:\n  _target_: torch.nn.Linear\n"
                                      "  in_features: 16\n  out_features: 1\n",
        "configs/experiment/small.yaml": "# @package _global_\ndefaults:\n  - override /model: wrapped\n"
                                         "  - override /optimizer: sgd\n\nseed: 7\ntrainer:\n  max_steps: 3\n"
                                         "optimizer:\n  lr: 0.02\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose(["experiment=small", "device=cpu", "data.n_train=64", "data.n_val=32"])
    assert (cfg.seed, cfg.trainer.max_steps, cfg.trainer.val_every) == (7, 3, 250)
    trainer = build(cfg)
    assert type(trainer.model).__name__ == "Wrapper" and trainer.model.scale == 2.0
    assert isinstance(trainer.model.net, torch.nn.Linear) and trainer.model.net.in_features == 16
    [group] = trainer.configure_optimizers().param_groups
    assert type(trainer.configure_optimizers()).__name__ == "SGD" and (group["lr"], group["momentum"]) == (0.02, 0.9)


def test_cfg_job_prints_an_experiment_of_your_own_and_makes_no_run_directory(tmp_path, command):
    """facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/5_debugging.md (``--cfg job``), with
    the experiment of ashleve/lightning-hydra-template, configs/experiment/example.yaml."""
    project(tmp_path, {"configs/experiment/quick.yaml": "# @package _global_\ndefaults:\n  - override /optimizer: sgd"
                                                        "\n\nseed: 12345\ntrainer:\n  max_steps: 10\n"})
    code, out, err = command("--cfg", "job", "experiment=quick", "optimizer.lr=0.002")
    assert code == 0, err
    assert "seed: 12345\n" in out and "  max_steps: 10\n" in out
    assert "  _target_: torch.optim.SGD\n  _partial_: true\n  lr: 0.002\n" in out
    assert not (tmp_path / "outputs").exists()


def test_a_trainer_option_of_your_own_that_extends_default_is_typed_by_the_schema(tmp_path):
    """ashleve/lightning-hydra-template, configs/trainer/cpu.yaml (``defaults: [default]``, then the keys it
    changes)."""
    project(tmp_path, {"configs/trainer/short.yaml": "defaults:\n  - default\n\nmax_steps: 3\nval_every: null\n",
                       "configs/trainer/typo.yaml": "defaults:\n  - default\n\nmax_stepz: 3\n"})
    cfg = compose(["trainer=short"])
    assert (cfg.trainer._target_, cfg.trainer.max_steps, cfg.trainer.val_every) == ("safeloop.Trainer", 3, None)
    with pytest.raises(Exception, match="max_stepz"):
        compose(["trainer=typo"])


def test_a_trainer_option_of_your_own_without_the_schema_is_one_message_saying_what_to_add(tmp_path):
    """ashleve/lightning-hydra-template, configs/trainer/gpu.yaml, written without its ``defaults: [default]``
    line: the Trainer class, the schema and its defaults are then missing."""
    project(tmp_path, {"configs/trainer/bare.yaml": "max_steps: 3\nval_every: null\n"})
    with pytest.raises(ConfigError, match=re.escape("has no _target_: begin the file with 'defaults: [default]' "
                                                    "(safeloop's trainer options, their schema and defaults)")):
        compose(["trainer=bare"])


def test_a_scheduler_option_of_your_own_is_added_with_plus_and_follows_max_steps(tmp_path, command):
    """ashleve/lightning-hydra-template, configs/model/mnist.yaml (a ``_partial_: true`` scheduler config), as a
    file of its own appended with ``+`` (facebookresearch/hydra, website/docs/advanced/override_grammar/basic.md),
    ``T_max: ${trainer.max_steps}`` interpolated from the trainer's settings."""
    project(tmp_path, {"configs/scheduler/cosine.yaml": "_target_: torch.optim.lr_scheduler.CosineAnnealingLR\n"
                                                         "_partial_: true\nT_max: ${trainer.max_steps}\n"})
    # scheduler is a key of train.yaml, not a group of its defaults list: + appends the option
    code, _, err = command("+scheduler=cosine", *SMALL[1:], "trainer.max_steps=4", "trainer.log_every=1",
                           "hydra.run.dir=run")
    assert code == 0, err
    rates = [rate for _, rate in rows(tmp_path / "run" / "metrics.csv", "lr")]
    assert rates == pytest.approx([0.01, 0.00853553, 0.005, 0.00146447], rel=1e-5)  # the rate each update used


def test_reduce_on_plateau_in_lightnings_dict_steps_on_the_validation_loss(tmp_path):
    """ashleve/lightning-hydra-template, configs/model/mnist.yaml (ReduceLROnPlateau, ``_partial_: true``) and
    src/models/mnist_module.py's configure_optimizers (``"monitor": "val/loss"``, ``"interval": "epoch"``)."""
    plateau = "{_target_:torch.optim.lr_scheduler.ReduceLROnPlateau,_partial_:true,mode:min,factor:0.1,patience:0}"
    small = ["trainer.max_steps=4", "trainer.val_every=2", "data.n_train=64", "data.n_val=32", "device=cpu",
             "trainer.progress=false", "+run_dir=run"]
    with pytest.raises(ConfigError, match=re.escape("is ReduceLROnPlateau, which steps on a metric: give "
                                                    "{'scheduler': ..., 'monitor': 'val_loss'}")):
        train(compose([f"scheduler={plateau}", *small]))  # alone, as the template's config holds it
    trainer = train(compose([f"scheduler={{scheduler:{plateau},monitor:val_loss}}", *small]))
    losses = [metrics["val_loss"] for _, metrics in trainer.state.val_history]
    assert losses[2] > losses[1]  # worse at step 4 than at step 2, the first validation during training: cut
    assert trainer.optimizers["optimizer"].param_groups[0]["lr"] == pytest.approx(0.001)


def test_your_own_callbacks_beside_early_stopping_run_under_hydra_job_chdir(tmp_path, command):
    """ashleve/lightning-hydra-template, configs/callbacks/default.yaml (several callbacks, each under its own key)
    and facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/3_working_directory.md
    (``hydra.job.chdir=True``: the job runs in its output directory, where a relative path then points)."""
    project(tmp_path, {
        "mycb.py": "import safeloop\n\n\nclass Count(safeloop.Callback):\n"
                   "    def __init__(self, path: str):\n        self.path, self.n = path, 0\n\n"
                   "    def on_step_end(self, trainer, losses):\n        self.n += 1\n"
                   "        open(self.path, 'w').write(str(self.n))\n",
        "configs/callbacks/count.yaml": "count:\n  _target_: mycb.Count\n  path: counted.txt\n",
    })
    code, out, err = command("callbacks=[early_stopping,count]", "callbacks.early_stopping.patience=7",
                             "trainer.max_steps=4", "trainer.val_every=2", *SMALL[2:], "hydra.run.dir=run",
                             "hydra.job.chdir=True")
    assert code == 0, err
    assert (tmp_path / "run" / "counted.txt").read_text() == "4" and not (tmp_path / "counted.txt").exists()
    assert (tmp_path / "run" / "checkpoints" / "step-000000004.pt").exists()
    assert f"outputs: {tmp_path / 'run'}" in out


def test_a_search_path_given_on_the_command_line_offers_its_options(tmp_path, command):
    """facebookresearch/hydra, website/docs/advanced/search_path.md (``hydra.searchpath`` overridden from the
    command line, to use configs kept in another directory or package)."""
    project(tmp_path, {"shared/model/narrow.yaml": "_target_: safeloop.models.MLP\nhidden: 4\n"})
    code, _, err = command(f"hydra.searchpath=[file://{tmp_path / 'shared'}]", "model=narrow", *SMALL,
                           "hydra.run.dir=run")
    assert code == 0, err
    assert "hidden: 4" in (tmp_path / "run" / ".hydra" / "config.yaml").read_text()


def test_plus_experiment_as_hydras_docs_write_it_says_to_drop_the_plus():
    """facebookresearch/hydra, website/docs/patterns/configuring_experiments.md (``python my_app.py
    +experiment=aplite``: there the experiment group is not in the primary config's defaults list)."""
    with pytest.raises(ConfigError) as info:
        compose(["+experiment=gan"])
    assert "+experiment=gan: experiment has an option chosen already (train.yaml's defaults list): write " \
        "experiment=gan, without the +" in str(info.value), str(info.value)
    assert "override experiment: gan" not in str(info.value)


# -- run directories and data -----------------------------------------------------------------------------------
def test_a_run_directory_given_by_an_interpolation_that_another_run_holds_is_left_as_it_was(tmp_path, command,
                                                                                           monkeypatch):
    """ashleve/lightning-hydra-template, configs/hydra/default.yaml (``run: dir:`` built from interpolations), here
    from the environment as a SLURM job script names it (``${oc.env:...}``)."""
    from safeloop.checkpoint import lock, release

    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "config.yaml").write_text("the first run's config\n")
    monkeypatch.setenv("SAFELOOP_RUN_DIR", str(run_dir))
    held = lock(run_dir, RuntimeError)  # this process is the run that holds it
    try:
        code, _, err = command(*SMALL, "hydra.run.dir=${oc.env:SAFELOOP_RUN_DIR}")
    finally:
        release(held)
    assert code == 1 and "is in use by another run" in err, err
    assert (run_dir / ".hydra" / "config.yaml").read_text() == "the first run's config\n"


@pytest.mark.parametrize("checkpoints", [True, False], ids=["checkpoints_there", "checkpoints_elsewhere"])
def test_a_new_run_in_a_fixed_run_directory_is_refused_and_leaves_the_first_runs_files(tmp_path, command,
                                                                                       checkpoints):
    """facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/3_working_directory.md (a fixed
    ``hydra.run.dir``), as safeloop's configs/checkpoint/default.yaml suggests one (``hydra.run.dir=runs/exp1``), run
    again with another learning rate and without ``trainer.resume``: its metrics would be appended to the first
    run's, its checkpoints pruned as older than the first run's."""
    elsewhere = () if checkpoints else ("checkpoint.dir=ckpt/first",)
    code, _, err = command(*SMALL, "optimizer.lr=0.01", "hydra.run.dir=runs/exp1", *elsewhere)
    assert code == 0, err
    metrics = tmp_path / "runs" / "exp1" / "metrics.csv"
    first = metrics.read_text()
    elsewhere = () if checkpoints else ("checkpoint.dir=ckpt/second",)
    code, _, err = command(*SMALL, "optimizer.lr=0.5", "hydra.run.dir=runs/exp1", *elsewhere)
    assert code == 1 and "this run starts from scratch" in err and "set resume=auto" in err, err
    assert metrics.read_text() == first


DATAMODULE = ("import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
              "class DataModule:  # LightningDataModule's methods, without Lightning\n"
              "    def __init__(self, batch_size: int = 32):\n        x = torch.randn(128, 16)\n"
              "        self.data, self.batch_size = TensorDataset(x, x.sum(1, keepdim=True)), batch_size\n\n"
              "    def setup(self, stage=None):\n        pass\n\n"
              "    def train_dataloader(self):\n"
              "        return DataLoader(self.data, batch_size=self.batch_size, shuffle=True)\n\n"
              "    def val_dataloader(self):\n        return DataLoader(self.data, batch_size=64)\n")


def test_a_lightning_datamodule_as_the_data_target_is_refused_naming_the_group_and_the_contract(tmp_path,
                                                                                               monkeypatch):
    """ashleve/lightning-hydra-template, configs/data/mnist.yaml (``_target_:`` a LightningDataModule) and
    src/data/mnist_datamodule.py (``train_dataloader()``/``val_dataloader()``), as configs/data/dm.yaml."""
    project(tmp_path, {"dm.py": DATAMODULE, "configs/data/dm.yaml": "_target_: dm.DataModule\nbatch_size: 32\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        build(compose(["data=dm", "device=cpu"]))
    message = str(info.value)
    assert message.startswith("invalid configuration: data: dm.DataModule made a DataModule with "
                              "train_dataloader() (a Lightning DataModule); the data group's target returns an "
                              "object with .train"), message
    assert " object at 0x" not in message, message


# -- overrides: +, ++, ~, interpolations ------------------------------------------------------------------------
def test_append_force_add_and_delete_overrides_do_what_hydras_grammar_says():
    """facebookresearch/hydra, website/docs/advanced/override_grammar/basic.md: ``+key`` appends (refused where the
    key exists), ``++key`` adds or overrides, ``~key`` deletes (the target's default applies)."""
    cfg = compose(["~model.depth", "++trainer.max_steps=3", "++optimizer.weight_decay=0.1"])
    assert "depth" not in cfg.model and cfg.trainer.max_steps == 3 and cfg.optimizer.weight_decay == 0.1
    assert len([m for m in instantiate(cfg.model) if isinstance(m, torch.nn.Linear)]) == 2  # MLP's own default depth
    with pytest.raises(ConfigError, match=re.escape("+trainer.max_steps=3: Could not append to config. An item is "
                                                    "already at 'trainer.max_steps'")):
        compose(["+trainer.max_steps=3"])
    with pytest.raises(ConfigError, match=re.escape("trainer.foo is not a setting of safeloop.Trainer (+trainer.foo "
                                                    "added it)")):
        compose(["+trainer.foo=1"])


@pytest.mark.parametrize("override, here", [("+trainer.accelerator=gpu", "device ('cpu', 'cuda', 'auto')"),
                                            ("++trainer.gradient_clip_val=0.5", "grad_clip (the norm)"),
                                            ("+trainer.min_epochs=1", "no minimum")])
def test_a_lightning_setting_added_with_plus_gets_safeloops_name_for_it(override, here):
    """ashleve/lightning-hydra-template, configs/trainer/default.yaml (``accelerator``, ``devices``, ``min_epochs``) and
    configs/experiment/example.yaml (``gradient_clip_val``), given with ``+``/``++`` as Hydra's "To append to your
    config use +key=value" says for a key the config does not have."""
    with pytest.raises(ConfigError) as info:
        compose([override])
    assert f"that is Lightning's; here: {here}" in str(info.value), str(info.value)


def test_a_lightning_experiment_file_ported_as_it_is_gets_safeloops_name_for_each_key(tmp_path):
    """ashleve/lightning-hydra-template, configs/experiment/example.yaml (``trainer: gradient_clip_val: 0.5``),
    copied into configs/experiment/ of the directory the command runs from."""
    project(tmp_path, {"configs/experiment/port.yaml": "# @package _global_\nseed: 12345\ntrainer:\n"
                                                      "  max_epochs: 10\n  gradient_clip_val: 0.5\n"})
    with pytest.raises(ConfigError) as info:
        compose(["experiment=port"])
    assert "trainer.gradient_clip_val" in str(info.value) and "here: grad_clip (the norm)" in str(info.value), \
        str(info.value)


def test_an_environment_variable_with_a_default_sets_a_value(monkeypatch):
    """ashleve/lightning-hydra-template, configs/paths/default.yaml's first form (``${oc.env:PROJECT_ROOT}``), with
    OmegaConf's default for a variable not set (``${oc.env:VAR,default}``)."""
    monkeypatch.delenv("SAFELOOP_STEPS", raising=False)
    assert compose(["trainer.max_steps=${oc.env:SAFELOOP_STEPS,3}"]).trainer.max_steps == 3
    monkeypatch.setenv("SAFELOOP_STEPS", "5")
    assert compose(["trainer.max_steps=${oc.env:SAFELOOP_STEPS,3}"]).trainer.max_steps == 5


def test_a_checkpoint_dir_inside_the_run_directory_by_hydras_resolver(tmp_path, command):
    """ashleve/lightning-hydra-template, configs/paths/default.yaml (``output_dir: ${hydra:runtime.output_dir}``) and
    configs/callbacks/model_checkpoint.yaml (``dirpath: ${paths.output_dir}/checkpoints``)."""
    code, _, err = command(*SMALL, "checkpoint.dir=${hydra:runtime.output_dir}/ckpt", "hydra.run.dir=run")
    assert code == 0, err
    assert (tmp_path / "run" / "ckpt" / "step-000000002.pt").exists()


# -- seeds ------------------------------------------------------------------------------------------------------
def test_the_same_seed_trains_the_same_run_and_another_seed_another(tmp_path):
    """ashleve/lightning-hydra-template, configs/train.yaml (``seed: 12345``) and src/train.py (seeded before the
    data and the model are made)."""
    small = ["trainer.max_steps=3", "trainer.val_every=null", "data.n_train=64", "data.n_val=32", "device=cpu",
             "trainer.progress=false"]

    cfg = compose([*small, "seed=12345", "+run_dir=a"])

    def final(seed: int, name: str) -> dict:
        cfg.seed, cfg.run_dir = seed, name  # data.seed follows: ${seed}
        return train(cfg).state.val_history[-1][1]

    first = final(12345, "a")
    torch.rand(5)  # whatever ran in between
    assert final(12345, "b") == first and final(54321, "c") != first


def test_seed_null_trains_without_seeding(tmp_path):
    """ashleve/lightning-hydra-template, configs/train.yaml (``seed: null``: "seed for random number generators in
    pytorch, numpy and python.random", left unseeded by default)."""
    cfg = compose(["seed=null", "trainer.max_steps=2", "trainer.val_every=null", "data.n_train=64", "data.n_val=32",
                   "device=cpu", "trainer.progress=false", "+run_dir=run"])
    assert cfg.seed is None and train(cfg).state.step == 2


# -- sweeps -----------------------------------------------------------------------------------------------------
def test_a_sweep_with_resume_auto_gives_each_job_its_own_checkpoints(tmp_path, command):
    """facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/2_multirun.md (``-m`` over several
    values), with the restartable command of safeloop's configs/checkpoint/default.yaml (``trainer.resume=auto``)."""
    code, out, err = command("-m", "optimizer.lr=0.01,0.001", *SMALL, "trainer.resume=auto", "+tags=[mnist,simple]",
                             "hydra.sweep.dir=sweep")
    assert code == 0, err
    for job in ("0", "1"):
        assert [p.name for p in (tmp_path / "sweep" / job / "checkpoints").glob("*.pt")] == ["step-000000002.pt"]
        assert "starting from scratch" in (tmp_path / "sweep" / job / "safeloop.log").read_text()
    summary = (tmp_path / "sweep" / "summary.md").read_text().splitlines()
    assert summary[2].split("|")[3:] != summary[3].split("|")[3:]  # two learning rates, two results


def test_a_sweep_given_one_checkpoint_dir_never_resumes_one_job_from_anothers(tmp_path, command):
    """facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/2_multirun.md (``-m``), with the
    restartable command safeloop's own configs/checkpoint/default.yaml advises (``checkpoint.dir=ckpt/exp1
    trainer.resume=auto``)."""
    code, _, err = command("-m", "optimizer.lr=0.01,0.001", *SMALL, "checkpoint.dir=ckpt/exp1", "trainer.resume=auto",
                           "hydra.sweep.dir=sweep")
    assert code == 2 and not (tmp_path / "sweep" / "0").exists()  # refused before the first job
    assert err.startswith("safeloop: invalid configuration: checkpoint.dir=ckpt/exp1 is one directory for every job "
                          "of the sweep: each job "
                          "would resume the one before it"), err
    assert err.rstrip().endswith("checkpoint.dir=ckpt/exp1/${hydra:job.num}"), err


HPARAMS = "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n    params:\n      trainer.log_every: {}\n"


def test_a_sweep_declared_in_a_config_is_refused_before_its_first_job_for_a_bad_value(tmp_path, command):
    """facebookresearch/hydra, website/docs/tutorials/basic/running_your_app/2_multirun.md ("Sweeping via
    hydra.sweeper.params") and ashleve/lightning-hydra-template, configs/hparams_search/mnist_optuna.yaml (a
    ``# @package _global_`` file setting ``hydra.mode: MULTIRUN`` and the swept keys)."""
    project(tmp_path, {"configs/hparams_search/logs.yaml": HPARAMS.format("1,0")})
    code, _, err = command("+hparams_search=logs", *SMALL, "hydra.sweep.dir=sweep")
    assert code == 2
    assert err.startswith("safeloop: invalid configuration: trainer.log_every must be a positive integer, got 0"), err
    assert not (tmp_path / "sweep" / "0").exists()  # nothing trained


def test_a_job_that_fails_at_run_time_leaves_the_other_jobs_of_the_sweep_to_run(tmp_path, command):
    """facebookresearch/hydra, hydra/core/utils.py (run_job keeps a job's exception as a FAILED JobReturn) and
    hydra/_internal/core_plugins/basic_sweeper.py (the batch's jobs all run; the failure is raised after them), with
    a learning rate swept up to where the loss overflows (``trainer.on_nonfinite=error``)."""
    code, _, err = command("-m", "optimizer.lr=1e12,0.01", "trainer.on_nonfinite=error", *SMALL[1:],
                           "trainer.max_steps=3", "hydra.sweep.dir=sweep")
    assert "NonFiniteError" in err
    assert (tmp_path / "sweep" / "1" / "metrics.csv").exists()  # lr=0.01 trained
    summary = (tmp_path / "sweep" / "summary.md").read_text()
    assert code == 1 and re.search(r"\| 0 \| optimizer.lr=(1e\+?12|1000000000000.0) \| failed", summary), summary
    assert "the sweep's other jobs ran" in err, err
