"""Real training code stopped at a step, its checkpoint written, and resumed by a new Trainer (``resume="auto"``),
against the same port run straight through: every parameter and buffer bit for bit, as docs/checkpoints.md promises
("A run resumed at step N is bit-identical to one that never stopped").

Each case began as a problem found on such code; the fixed ones are plain tests now (L-BFGS and Adafactor states,
DataLoader workers and the directory's lock, the validation a fit ends with and EarlyStopping, an EMA kept by a
callback, one generator for both loaders, resume on a Trainer fitted twice, a restart from an older checkpoint of
the directory, ``save_checkpoint()`` from hooks, a module made in ``on_fit_start``). Cases that fail today are strict
xfails naming the cause:

- random generators kept by the dataset (MONAI's ``Randomizable`` transforms) or by a batch sampler are neither saved
  nor put back: a run resumed after its first pass draws other augmentations or another order, without a word;
- ``persistent_workers=True`` (timm's ``create_loader`` default): the workers' random state after a pass is in no
  checkpoint, so a resumed run's workers draw other augmentations (said in the log).
"""
import copy
import logging
import random
import re

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from safeloop import Callback, ConfigWarning, EarlyStopping, Trainer
from safeloop.errors import CheckpointError, ConfigError

from . import test_resume_ports as ports
from .harness import assert_same, bn_classifier, fixed, labelled


def straight_and_resumed(tmp_path, make_model, make_data, steps, stop, trainer=Trainer, **kwargs):
    """``test_resume_ports.straight_and_resumed`` with data made without the model."""
    return ports.straight_and_resumed(tmp_path, make_model, trainer, lambda model: make_data(), steps, stop, **kwargs)


# -- pytorch/examples, time_sequence_prediction: L-BFGS ------------------------------------------------------------
class Sequence(nn.Module):
    """time_sequence_prediction/train.py's two stacked ``LSTMCell``s and a linear head, in float64 (51 units there)."""

    def __init__(self, hidden=4):
        super().__init__()
        self.hidden = hidden
        self.lstm1 = nn.LSTMCell(1, hidden)
        self.lstm2 = nn.LSTMCell(hidden, hidden)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, input):
        outputs = []
        h_t = c_t = h_t2 = c_t2 = torch.zeros(input.size(0), self.hidden, dtype=torch.double)
        for input_t in input.split(1, dim=1):
            h_t, c_t = self.lstm1(input_t, (h_t, c_t))
            h_t2, c_t2 = self.lstm2(h_t, (h_t2, c_t2))
            outputs += [self.linear(h_t2)]
        return torch.cat(outputs, dim=1)


def sine_waves():
    """generate_sine_wave.py's shifted sines (T=20), 4 of 10 points; the whole set is every step's batch."""
    rng = np.random.RandomState(2)
    x = np.arange(10) + rng.randint(-80, 80, 4).reshape(4, 1)
    data = torch.from_numpy(np.sin(x / 20.0))
    return [(data[:, :-1], data[:, 1:])]


def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.8, max_iter=3)


@pytest.mark.filterwarnings("error")
def test_lbfgs_time_sequence_prediction_resumed_midway(tmp_path):
    """pytorch/examples, time_sequence_prediction/train.py: ``optim.LBFGS(seq.parameters(), lr=0.8)`` stepped with a
    closure over the whole set (here the Trainer's closure, automatic mode), stopped after 1 of 3 steps."""
    straight, resumed = straight_and_resumed(tmp_path, lambda: Sequence().double(), sine_waves, 3, 1,
                                             optimizer=lbfgs, loss_fn=nn.MSELoss())
    assert_same(resumed.model, straight.model)


# -- Adafactor: factored second moments ---------------------------------------------------------------------------
def adafactor(params):
    """``torch.optim.Adafactor`` (pytorch/pytorch, torch/optim/_adafactor.py): a 2-D weight's second moment kept as
    ``row_var`` (rows, 1) and ``col_var`` (1, cols), as transformers' and timm's Adafactor keep ``exp_avg_sq_row``
    and ``exp_avg_sq_col`` (the optimizer T5 fine-tuning recommends)."""
    return torch.optim.Adafactor(params, lr=1e-2)


def mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def regression():
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(4)]


@pytest.mark.filterwarnings("error")
def test_adafactor_resumed_midway(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, mlp, regression, 6, 3, optimizer=adafactor)
    assert_same(resumed.model, straight.model)


# -- random generators kept by the data pipeline ------------------------------------------------------------------
class RandShift:
    """A random intensity shift as MONAI writes its random transforms (Project-MONAI/MONAI,
    monai/transforms/transform.py, ``Randomizable``: ``self.R``, an ``np.random.RandomState`` of the transform's own,
    seeded by ``set_random_state(seed)``; monai/transforms/intensity/array.py, ``RandShiftIntensity``)."""

    def __init__(self, seed):
        self.R = np.random.RandomState(seed)

    def __call__(self, x):
        return x + float(self.R.uniform(-0.5, 0.5))


class TorchShift:
    """The same with a ``torch.Generator`` of its own."""

    def __init__(self, seed):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, x):
        return x + torch.rand((), generator=self.generator) - 0.5


class PythonShift:
    """The same with a ``random.Random`` of its own."""

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def __call__(self, x):
        return x + self.rng.uniform(-0.5, 0.5)


class Transformed(Dataset):
    """A map-style dataset applying its random transform to each sample (MONAI's ``Dataset(data, transform)``)."""

    def __init__(self, x, y, transform):
        self.x, self.y, self.transform = x, y, transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


class Buckets(Sampler):
    """A batch sampler shuffling batches of neighbours with a generator of its own, as bucketing samplers do."""

    def __init__(self, n, size, seed):
        self.batches = [list(range(i, i + size)) for i in range(0, n, size)]
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self):
        for j in torch.randperm(len(self.batches), generator=self.generator).tolist():
            yield self.batches[j]

    def __len__(self):
        return len(self.batches)


def pipeline(kind):
    """24 samples in 6 batches a pass (num_workers=0: the transforms run in the training process)."""
    def make():
        gen = torch.Generator().manual_seed(1)
        x, y = torch.randn(24, 4, generator=gen), torch.randn(24, 1, generator=gen)
        shuffled = dict(batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))
        if kind == "batch_sampler":
            return DataLoader(TensorDataset(x, y), batch_sampler=Buckets(24, 4, 5))
        transform = {"monai_random_state": RandShift, "torch_generator": TorchShift, "python_random": PythonShift}[kind]
        return DataLoader(Transformed(x, y, transform(5)), **shuffled)
    return make


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


KINDS = ["monai_random_state", "torch_generator", "python_random", "batch_sampler"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error")
def test_a_data_pipeline_with_its_own_generator_resumed_in_its_first_pass(tmp_path, kind):
    """Within the first pass the re-drawn epoch replays the consumed batches from the generators' first state,
    which a new process has too: bit-identical."""
    straight, resumed = straight_and_resumed(tmp_path, mlp, pipeline(kind), 12, 3, optimizer=sgd)
    assert_same(resumed.model, straight.model)


@pytest.mark.parametrize("stop", [6, 8], ids=["at_the_first_pass_end", "in_the_second_pass"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.filterwarnings("error")
def test_a_data_pipeline_with_its_own_generator_resumed_after_its_first_pass(tmp_path, kind, stop):
    """A generator the dataset's transform or a batch sampler keeps is in the checkpoint with the pass's start and
    put back: the resumed run draws the augmentations (the batches) of the run that never stopped."""
    straight, resumed = straight_and_resumed(tmp_path, mlp, pipeline(kind), 12, stop, optimizer=sgd)
    assert_same(resumed.model, straight.model)


# -- timm's loader: persistent workers -----------------------------------------------------------------------------
class Jitter(Dataset):
    """Random noise added in ``__getitem__`` from torch's generator: in a worker, the worker's own (seeded by torch
    from the loader's base seed and the worker's id), as timm's transforms draw theirs."""

    def __init__(self):
        gen = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


def workers(persistent):
    """huggingface/pytorch-image-models, timm/data/loader.py, ``create_loader(..., persistent_workers=True)``: a
    shuffling DataLoader with workers kept alive from epoch to epoch. 4 batches a pass."""
    return lambda: DataLoader(Jitter(), batch_size=4, shuffle=True, num_workers=1, persistent_workers=persistent,
                              generator=torch.Generator().manual_seed(2))


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "persistent workers keep their random state from pass to pass; no checkpoint holds it, so the resumed run's "
    "fresh workers draw the second pass's augmentations from their first state (without persistent_workers the same "
    "resume is bit-identical: each pass's workers are seeded anew from the loader's generator)"))
def test_timm_style_loader_with_persistent_workers_resumed_in_the_second_pass(tmp_path):
    straight, resumed = straight_and_resumed(tmp_path, mlp, workers(True), 8, 6, optimizer=sgd)
    assert_same(resumed.model, straight.model)


SAYS_WORKERS = r"resume: train_data's DataLoader keeps its 1 workers from pass to pass \(persistent_workers=True\)" \
    r".*from pass 1 on, random augmentations drawn in the workers differ"


def test_a_resume_in_the_second_pass_says_when_persistent_workers_draw_other_augmentations(tmp_path, caplog):
    """docs/checkpoints.md: a resume past the first pass with persistent workers is said in the log (the run is
    not bit-identical: the test above); without them it is quiet and bit-identical."""
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        straight_and_resumed(tmp_path / "persistent", mlp, workers(True), 8, 6, optimizer=sgd)
    assert re.search(SAYS_WORKERS, caplog.text), caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="safeloop"):
        straight, resumed = straight_and_resumed(tmp_path / "fresh", mlp, workers(False), 8, 6, optimizer=sgd)
    assert "persistent_workers" not in caplog.text
    assert_same(resumed.model, straight.model)


# -- the checkpoint directory's lock and DataLoader workers --------------------------------------------------------
@pytest.mark.parametrize("held", ["checkpoint_dir", "run_dir"])
def test_a_second_fit_with_dataloader_workers_and_a_locked_directory(tmp_path, held):
    """docs/checkpoints.md: 'A run trained in several fit() calls of one Trainer reads nothing again ... A
    DataLoader's iterator, and its worker processes, stay alive in between.' The checkpoint directory's lock, and
    the run directory's (metrics.csv; no checkpoints)."""
    where = dict(checkpoint={"dir": str(tmp_path)}, loggers=()) if held == "checkpoint_dir" else \
        dict(run_dir=str(tmp_path), checkpoint=False)
    torch.manual_seed(0)
    trainer = Trainer(model=mlp(), train_data=workers(True)(), optimizer=sgd, max_steps=2, device="cpu",
                      progress=False, **where)
    try:
        trainer.fit()
        trainer.max_steps = 4
        trainer.fit()
        assert trainer.state.step == 4
    finally:
        trainer.train_data._iterator._shutdown_workers()


# -- the end of a run, resumed with a larger max_steps: EarlyStopping ----------------------------------------------
VAL_LOSS = {4: 1.0, 6: 2.0, 8: 1.5, 12: 0.5, 16: 0.4, 20: 0.3}  # the validation loss at each step that validates


class ValidatedByStep(Trainer):
    """docs/trainer.md's early stopping (``val_every``, ``EarlyStopping(monitor="val_loss", mode="min",
    patience=...)``), with the validation loss each step gives scripted (``VAL_LOSS``)."""

    def validation_step(self, batch):
        return torch.tensor(VAL_LOSS.get(self.state.step, 100.0))


class TimeLimit(Callback):
    """Lightning's ``Timer(duration=...)`` callback (src/lightning/pytorch/callbacks/timer.py: ``should_stop`` once
    the time is up, checked after each batch) as docs/trainer.md ports a stop: ``trainer.request_stop(reason)``. The
    time is up after step ``at`` here; the job is then submitted again with ``resume="auto"``."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, trainer, losses):
        if trainer.state.step == self.at:
            trainer.request_stop("time limit")


def early_stopped(directory, max_steps, resume=None, time_limit=None):
    torch.manual_seed(0)
    data = regression()
    callbacks = [EarlyStopping("val_loss", "min", patience=2)] + ([TimeLimit(time_limit)] if time_limit else [])
    trainer = ValidatedByStep(model=mlp(), train_data=data, val_data=data[:1], val_every=4, max_steps=max_steps,
                              optimizer=sgd, device="cpu", progress=False, loggers=(),
                              checkpoint={"dir": str(directory)}, resume=resume, callbacks=callbacks)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("ended_by", ["max_steps", "time_limit"])
def test_a_run_ended_at_step_6_and_resumed_stops_early_as_the_run_that_never_stopped(tmp_path, ended_by):
    """docs/checkpoints.md: the last checkpoint is written 'at the end, after the final validation ... so a resumed
    run goes on as one that never stopped'; the Resume section's second command resumes a run with a larger
    max_steps; a time limit stops a job that is submitted again with resume=auto. Validations every 4 steps,
    patience 2: the run that never stopped validates at 4 (best), 8, 12 (better) and trains to step 20; stopped at
    step 6 (validated there, worse), then resumed to step 20."""
    straight = early_stopped(tmp_path / "straight", 20)
    if ended_by == "max_steps":
        early_stopped(tmp_path / "stopped", 6)
    else:
        assert early_stopped(tmp_path / "stopped", 20, time_limit=6).state.step == 6
    resumed = early_stopped(tmp_path / "stopped", 20, resume="auto")
    assert resumed.state.step == straight.state.step == 20
    assert_same(resumed.model, straight.model)


# -- pytorch/pytorch, docs/source/optim.rst: SWA ---------------------------------------------------------------------
@pytest.mark.parametrize("stop", [4, 6, 7, 9], ids=["mid_cosine", "at_the_hand_over", "mid_swa", "at_a_swa_pass_end"])
@pytest.mark.filterwarnings("error")
def test_stochastic_weight_averaging_resumed(tmp_path, stop):
    """test_swa's port (an ``AveragedModel`` returned from ``modules()``, ``CosineAnnealingLR`` and ``SWALR`` on one
    optimizer stepped by the port in ``on_epoch_end`` and saved by hand) stopped within the cosine phase, at the pass
    end where SWALR takes over, within and at the end of an SWA pass: the model, the averaged model (``n_averaged``
    included) and the learning rate go on as in the run that never stopped."""
    from .test_resume_ports import straight_and_resumed as resumed_from_disk
    from .test_swa import EPOCHS, SWA
    straight, resumed = resumed_from_disk(tmp_path, bn_classifier, SWA, fixed(labelled(3)), EPOCHS * 3, stop,
                                          max_epochs=EPOCHS)
    assert_same(resumed.model, straight.model)
    assert_same(resumed.swa_model, straight.swa_model)
    lrs = [run.optimizers["optimizer"].param_groups[0]["lr"] for run in (resumed, straight)]
    assert lrs[0] == lrs[1]


# -- an EMA kept by a callback ----------------------------------------------------------------------------------------
class ModelEma(Callback):
    """huggingface/pytorch-image-models, timm/utils/model_ema.py (``ModelEmaV2``: a deep copy of the model,
    ``ema_v.copy_(decay * ema_v + (1 - decay) * model_v)`` over the state dict's values), kept by a callback as
    Lightning users keep theirs (Lightning's ``StochasticWeightAveraging`` callback keeps its ``_average_model``)."""

    def __init__(self, model, decay=0.9):
        self.module, self.decay = copy.deepcopy(model).eval().requires_grad_(False), decay

    def on_step_end(self, trainer, losses):
        with torch.no_grad():
            for ema_v, model_v in zip(self.module.state_dict().values(), trainer.model.state_dict().values()):
                ema_v.copy_(self.decay * ema_v + (1. - self.decay) * model_v)


class SavedModelEma(ModelEma):
    """The same, saved and put back through the callback's checkpoint hooks (docs/checkpoints.md: 'Callbacks get
    (trainer, checkpoint)')."""

    def on_save_checkpoint(self, trainer, checkpoint):
        checkpoint["model_ema"] = self.module.state_dict()

    def on_load_checkpoint(self, trainer, checkpoint):
        self.module.load_state_dict(checkpoint["model_ema"])


def with_ema(directory, max_steps, callback, resume=None):
    torch.manual_seed(0)
    model = mlp()
    ema = callback(model)
    trainer = Trainer(model=model, train_data=regression(), optimizer=sgd, max_steps=max_steps, device="cpu",
                      progress=False, loggers=(), checkpoint={"dir": str(directory)}, resume=resume, callbacks=[ema])
    trainer.fit()
    return ema


@pytest.mark.filterwarnings("error")
def test_an_ema_a_callback_saves_through_its_checkpoint_hooks_resumes_bit_identical(tmp_path):
    straight = with_ema(tmp_path / "straight", 6, SavedModelEma)
    with_ema(tmp_path / "stopped", 3, SavedModelEma)
    assert_same(with_ema(tmp_path / "stopped", 6, SavedModelEma, resume="auto").module, straight.module)


def test_an_ema_a_callback_keeps_and_no_checkpoint_holds_is_named(tmp_path):
    with pytest.warns(ConfigWarning, match="changed during this fit, and checkpoints do not hold it"):
        with_ema(tmp_path, 3, ModelEma)


# -- an EMA made in on_fit_start ---------------------------------------------------------------------------------------
class EmaMadeAtFitStart(Trainer):
    """timm's train.py makes ``ModelEmaV3(model)`` once the model exists; a port makes its copy in ``on_fit_start``
    (Lightning ports make it in ``on_fit_start`` or ``setup``) and returns it from ``modules()``, as
    docs/checkpoints.md says to save an EMA copy. A resumed run loads ``modules()`` before ``on_fit_start``."""

    def on_fit_start(self):
        self.ema = copy.deepcopy(self.model).requires_grad_(False)

    def modules(self):
        return {**super().modules(), "ema": self.ema}

    def on_step_end(self, losses):
        with torch.no_grad():
            for ema_v, model_v in zip(self.ema.parameters(), self.model.parameters()):
                ema_v.lerp_(model_v, 0.1)


def test_a_module_made_in_on_fit_start_and_returned_from_modules_is_explained(tmp_path):
    """``modules()`` is read as ``fit()`` sets up, and a resume loads the checkpoint into it, both before
    ``on_fit_start``: the port's AttributeError is explained, at the first fit, before anything is trained."""
    model = mlp()
    before = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=re.escape(
            "Trainer.modules() raised AttributeError: 'EmaMadeAtFitStart' object has no attribute 'ema'. It is read "
            "before on_fit_start (as fit() sets up, and to load a checkpoint with resume=): make the modules it "
            "returns in __init__, not in on_fit_start")):
        EmaMadeAtFitStart(model=model, train_data=regression(), optimizer=sgd, max_steps=2, device="cpu",
                          progress=False, loggers=(), checkpoint={"dir": str(tmp_path)}).fit()
    assert_same(model, before)


# -- one generator for the training and the validation loader --------------------------------------------------------
def shared_generator_loaders():
    """pytorch/pytorch, docs/source/notes/randomness.rst ('DataLoader'): ``g = torch.Generator(); g.manual_seed(0)``
    given as ``generator=g`` to the loaders, here the training loader (shuffled, 6 batches a pass) and the validation
    loader both. Each ``iter()`` of a DataLoader draws its base seed from its generator: validation moves ``g``."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 4, generator=gen), torch.randn(32, 1, generator=gen)
    g = torch.Generator()
    g.manual_seed(0)
    train = DataLoader(TensorDataset(x[:24], y[:24]), batch_size=4, shuffle=True, generator=g)
    return train, DataLoader(TensorDataset(x[24:], y[24:]), batch_size=4, generator=g)


def shared_generator_run(directory, max_steps, validate=True, resume=None):
    torch.manual_seed(0)
    train, val = shared_generator_loaders()
    trainer = Trainer(model=mlp(), train_data=train, val_data=val if validate else None,
                      val_every=4 if validate else None, optimizer=sgd, max_steps=max_steps, device="cpu",
                      progress=False, loggers=(), checkpoint={"dir": str(directory)}, resume=resume)
    trainer.fit()
    return trainer


def test_with_one_generator_for_both_loaders_a_run_with_val_data_trains_as_the_run_without(tmp_path):
    """docs/trainer.md, Validation: 'a run with val_data trains exactly as the same run without it: the same data
    order, the same dropout masks'."""
    with_val = shared_generator_run(tmp_path / "with", 14)
    without = shared_generator_run(tmp_path / "without", 14, validate=False)
    assert_same(with_val.model, without.model)


@pytest.mark.parametrize("stop", [
    3,
    5,
    7,
], ids=["before_a_validation", "after_a_validation_in_the_same_pass", "in_the_next_pass"])
def test_with_one_generator_for_both_loaders_resumed(tmp_path, stop):
    straight = shared_generator_run(tmp_path / "straight", 14)
    shared_generator_run(tmp_path / "stopped", stop)
    assert_same(shared_generator_run(tmp_path / "stopped", 14, resume="auto").model, straight.model)


# -- resume set on a Trainer fitted twice ----------------------------------------------------------------------------
def fitted_twice(resume, directory):
    """docs/trainer.md's table maps Lightning's ``fit(ckpt_path=path)`` to ``Trainer(resume=path)`` (or ``"auto"``),
    and its settings to attributes a later ``fit()`` reads: the run is resumed, trained to step 6, then, at a lower
    learning rate set on the optimizer between the fits, to step 9."""
    torch.manual_seed(0)
    trainer = Trainer(model=mlp(), train_data=regression(), optimizer=sgd, max_steps=6, device="cpu", progress=False,
                      loggers=(), checkpoint={"dir": str(directory)}, resume=resume)
    trainer.fit()
    trainer.optimizers["optimizer"].param_groups[0]["lr"] = 0.01
    trainer.max_steps = 9
    trainer.fit()
    return trainer


@pytest.mark.parametrize("resume", ["path", "auto"])
def test_a_resumed_trainer_fitted_again_goes_on_from_its_first_fit(tmp_path, resume):
    torch.manual_seed(0)
    Trainer(model=mlp(), train_data=regression(), optimizer=sgd, max_steps=3, device="cpu", progress=False,
            loggers=(), checkpoint={"dir": str(tmp_path / "first")}).fit()
    never_resumed = fitted_twice(None, tmp_path / "never")  # the same steps 1-3: deterministic data and model
    name = str(tmp_path / "first" / "step-000000003.pt") if resume == "path" else "auto"
    resumed = fitted_twice(name, tmp_path / ("other" if resume == "path" else "first"))
    assert resumed.optimizers["optimizer"].param_groups[0]["lr"] == 0.01
    assert_same(resumed.model, never_resumed.model)


# -- a restart from an older checkpoint in the same directory ------------------------------------------------------
def in_one_directory(directory, max_steps, best, resume=None):
    """Checkpoints every 3 steps, the newest 2 kept; or (``best``) a validation every 3 steps (``VAL_LOSS``: step 6
    is the best) and the best one kept beside the newest (``monitor``, keep=1)."""
    torch.manual_seed(0)
    data = regression()
    where = dict(val_data=data[:1], val_every=3, checkpoint={"dir": str(directory), "monitor": "val_loss", "keep": 1}) \
        if best else dict(checkpoint={"dir": str(directory), "every": 3, "keep": 2})
    trainer = ValidatedByStep(model=mlp(), train_data=data, optimizer=sgd, max_steps=max_steps, device="cpu",
                              progress=False, loggers=(), resume=resume, **where)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("best", [False, True], ids=["newest_kept", "best_kept"])
def test_a_run_restarted_from_an_older_checkpoint_in_its_directory_resumes_from_its_own(tmp_path, best):
    """docs/checkpoints.md: 'To start from it [the best], give resume= that file', and ``resume=auto`` after a crash
    (the same ``checkpoint.dir``). A first run to step 9; a new run from its step 6 (the best, where ranked) stopped
    at step 7, as a crash would stop it, then resumed with ``resume="auto"``."""
    in_one_directory(tmp_path, 9, best)
    assert (tmp_path / "step-000000006.pt").exists()
    in_one_directory(tmp_path, 7, best, resume=str(tmp_path / "step-000000006.pt"))
    assert (tmp_path / "step-000000007.pt").exists(), sorted(p.name for p in tmp_path.glob("step-*.pt"))
    assert [p.name for p in tmp_path.glob("superseded-*/step-*.pt")] == ["step-000000009.pt"]  # kept, set aside
    assert in_one_directory(tmp_path, 7, best, resume="auto").state.step == 7


def test_a_run_from_scratch_in_a_directory_holding_another_runs_checkpoints_is_refused(tmp_path):
    """The same command run again without ``resume=auto`` (after a crash, a SLURM requeue): its checkpoints, of lower
    steps than the first run's, would be pruned as soon as written, and ``resume=auto`` would take the first run's."""
    in_one_directory(tmp_path, 9, False)
    with pytest.raises(CheckpointError, match=r"holds the checkpoints of another run \(step-000000006.pt to "
                       r"step-000000009.pt\), and this run starts from scratch.*To go on from them, set resume=auto"):
        in_one_directory(tmp_path, 4, False)
    assert sorted(p.name for p in tmp_path.glob("step-*.pt")) == ["step-000000006.pt", "step-000000009.pt"]


# -- checkpoints saved from a hook: every epoch, at the best validation -------------------------------------------
class Crash(Callback):
    """The machine goes down as step ``at`` starts: no checkpoint of the Trainer's own after the last one saved."""

    def __init__(self, at):
        self.at = at

    def on_step_start(self, trainer):
        if trainer.state.step + 1 == self.at:
            raise RuntimeError("node failure")


HOOK_VAL_LOSS = {4: 1.0, 8: 1.5, 12: 1.2, 16: 0.4, 20: 0.3}  # the run that never stopped: EarlyStopping at step 12


class EverySavePort(Trainer):
    """pytorch/examples, imagenet/main.py: ``save_checkpoint({'epoch': epoch + 1, ...})`` after every epoch (after its
    ``scheduler.step()``); karpathy/nanoGPT, train.py: after ``estimate_loss()``, ``if losses['val'] < best_val_loss
    or always_save_checkpoint:`` ``torch.save(checkpoint, ...)``. Ported with ``self.save_checkpoint()`` (docs: 'Save
    a checkpoint now') in ``on_epoch_end`` or ``on_validation_end``, the Trainer's own saves off but at the end."""

    save_in = "on_epoch_end"

    def validation_step(self, batch):
        return torch.tensor(HOOK_VAL_LOSS.get(self.state.step, 100.0))

    def on_epoch_end(self):
        if self.save_in == "on_epoch_end":
            self.save_checkpoint()

    def on_validation_end(self, metrics):
        if self.save_in == "on_validation_end" and self.state.step:
            self.save_checkpoint()

    def on_step_end(self, losses):
        if self.save_in == "on_step_end" and self.state.step % 4 == 0:
            assert self.save_checkpoint() == self.checkpointer.path(self.state.step)  # written after the validation


def saved_from_a_hook(directory, save_in, schedule, crash=None, resume=None):
    """4 batches a pass, to step 20; validation every 4 steps (``HOOK_VAL_LOSS``); a StepLR once a pass, a plateau on
    ``val_loss`` (patience 0), or EarlyStopping (patience 2)."""
    torch.manual_seed(0)
    data = regression()
    extra = dict(callbacks=[Crash(crash)] if crash else [])
    if schedule == "step_lr":
        extra["scheduler"] = {"scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                              "interval": "epoch"}
    elif schedule == "plateau":
        extra["scheduler"] = {"scheduler": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
                              "monitor": "val_loss"}
    else:
        extra["callbacks"].append(EarlyStopping("val_loss", patience=2))
    trainer = type("Port", (EverySavePort,), {"save_in": save_in})(
        model=mlp(), train_data=data, val_data=data[:1], val_every=4, optimizer=sgd, max_steps=20, device="cpu",
        progress=False, loggers=(), checkpoint={"dir": str(directory), "keep": 10}, resume=resume, **extra)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("save_in, schedule, crash", [
    ("on_epoch_end", "step_lr", 11),
    ("on_validation_end", "plateau", 11),
    ("on_validation_end", "early_stopping", 11),
    ("on_step_end", "plateau", 11),
], ids=["imagenet_every_epoch_step_lr", "nanogpt_at_validation_plateau", "nanogpt_at_validation_early_stopping",
        "every_4_steps_before_that_step_validates"])
def test_a_checkpoint_saved_from_a_hook_resumes_as_the_run_that_never_stopped(tmp_path, save_in, schedule, crash):
    straight = saved_from_a_hook(tmp_path / "straight", save_in, schedule)
    with pytest.raises(Exception, match="node failure"):
        saved_from_a_hook(tmp_path / "crashed", save_in, schedule, crash=crash)
    resumed = saved_from_a_hook(tmp_path / "crashed", save_in, schedule, resume="auto")
    assert resumed.state.step == straight.state.step
    lrs = [run.optimizers["optimizer"].param_groups[0]["lr"] for run in (resumed, straight)]
    assert lrs[0] == lrs[1]
    assert_same(resumed.model, straight.model)
