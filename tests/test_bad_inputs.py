"""Bad input, every kind a user can give, and what each gets: a safeloop error that names the key (or
the thing) at fault and says what to do, never a traceback from deep inside torch or Hydra, and
nothing lost. The count of each outcome is what docs/checkpoints.md's Bad input section reports."""
import functools
import re
import shutil
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from safeloop import CheckpointError, ConfigError, GraphGuard, NonFiniteError, NoGraphError, StepError, Trainer
from safeloop.checkpoint import Checkpointer
from safeloop.config import build, compose

BASE = ["trainer.max_steps=2", "trainer.val_every=null", "trainer.progress=false", "device=cpu"]
ADVICE = re.compile(r"give|must|choose|options|did you mean|drop|fix|is not|needs|asks for|no such|takes|lists every")

# command-line overrides -> the error they get (each message names the key and says what to do)
OVERRIDES = [
    ('trainer.max_steps=abc', ConfigError),
    ('trainer.max_steps=-5', ConfigError),
    ('trainer.max_steps=0', ConfigError),
    ('trainer.max_steps=1.5', ConfigError),
    ('trainer.max_epochs=-1', ConfigError),
    ('trainer.val_every=0', ConfigError),
    ('trainer.val_every=-3', ConfigError),
    ('trainer.val_every=abc', ConfigError),
    ('trainer.grad_accum=0', ConfigError),
    ('trainer.grad_accum=-2', ConfigError),
    ('trainer.grad_accum=x', ConfigError),
    ('trainer.grad_clip=-1', ConfigError),
    ('trainer.grad_clip=abc', ConfigError),
    ('trainer.grad_clip=0', ConfigError),
    ('trainer.precision=64', ConfigError),
    ('trainer.precision=fp16', ConfigError),
    ('trainer.device=tpu', ConfigError),
    ('trainer.device=cuda:99', ConfigError),  # no such GPU, with or without CUDA
    ('trainer.log_every=0', ConfigError),
    ('trainer.log_every=-1', ConfigError),
    ('trainer.multi_loss=mean', ConfigError),
    ('trainer.loss_weights=5', ConfigError),
    ('trainer.loss_weights={loss:abc}', ConfigError),
    ('trainer.loggers=[neptune]', ConfigError),
    ('trainer.loggers=csv', ConfigError),
    ('trainer.progress=maybe', ConfigError),
    ('trainer.resume=/nonexistent/ckpt.pt', ConfigError),
    ('trainer.on_nonfinite=ignore', ConfigError),
    ('trainer.max_skipped=-1', ConfigError),
    ('trainer.max_skipped=abc', ConfigError),
    ('trainer.find_unused_parameters=perhaps', ConfigError),
    ('trainer.undo=partial', ConfigError),
    ('trainer.undo=null', ConfigError),
    ('trainer.maxsteps=5', ConfigError),
    ('trainer._target_=nothere.Trainer', ConfigError),
    ('trainer._target_=torch.nn.Linear', ConfigError),
    ('trainer.precision=null', ConfigError),
    ('trainer.on_nonfinite=null', ConfigError),
    ('guard.check=sometimes', ConfigError),
    ('guard.check=null', ConfigError),
    ('guard.on_reuse=ignore', ConfigError),
    ('guard.warmup=-1', ConfigError),
    ('guard.warmup=abc', ConfigError),
    ('guard.budget=0', ConfigError),
    ('guard.budget=2', ConfigError),
    ('guard.budget=abc', ConfigError),
    ('guard.ignore=[carry]', ConfigError),
    ('guard.ignore=reuse', ConfigError),
    ('guard.chek=always', ConfigError),
    ('checkpoint.every=0', ConfigError),
    ('checkpoint.every=-1', ConfigError),
    ('checkpoint.every=abc', ConfigError),
    ('checkpoint.keep=0', ConfigError),
    ('checkpoint.keep=-2', ConfigError),
    ('checkpoint.dir=/proc/forbidden', CheckpointError),
    ('checkpoint.evry=5', ConfigError),
    ('optimizer.lr=abc', ConfigError),
    ('optimizer.lr=-1', ConfigError),
    ('optimizer.lr=null', ConfigError),
    ('optimizer.betas=[0.9]', ConfigError),
    ('optimizer.betas=abc', ConfigError),
    ('optimizer.weight_decay=-0.1', ConfigError),
    ('optimizer.momentum=0.9', ConfigError),
    ('optimizer._target_=torch.optim.Nothere', ConfigError),
    ('optimizer=adamm', ConfigError),
    ('optimizer=null', ConfigError),
    ('model.hidden=abc', ConfigError),
    ('model.hidden=0', ConfigError),
    ('model.hidden=-4', ConfigError),
    ('model.depth=0', ConfigError),
    ('model.in_dim=0', ConfigError),
    ('model.hiden=64', ConfigError),
    ('model._target_=nothere.Model', ConfigError),
    ('model=mlpp', ConfigError),
    ('data.batch_size=0', ConfigError),
    ('data.batch_size=-1', ConfigError),
    ('data.batch_size=abc', ConfigError),
    ('data.n_train=0', ConfigError),
    ('data.n_train=-10', ConfigError),
    ('data.n_val=-1', ConfigError),
    ('data.n_val=0', ConfigError),
    ('data.seed=abc', ConfigError),
    ('data=regresion', ConfigError),
    ('scheduler=abc', ConfigError),
    ('scheduler._target_=torch.optim.lr_scheduler.StepLR', ConfigError),
    ('seed=abc', ConfigError),
    ('seed=1.5', ConfigError),
    ('device=tpu', ConfigError),
    ('device=cuda:99', ConfigError),
    ('experiment=gann', ConfigError),
    ('debug=defualt', ConfigError),
    ('logger=neptune', ConfigError),
    ('recipe.nothere=1', ConfigError),
    ('+trainer.foo=1', ConfigError),
    ('trainer.max_steps=', ConfigError),
    # a recipe's own arguments, model and data: "experiment=NAME override"
    ('experiment=gan recipe.samples=0', ConfigError),
    ('experiment=gan recipe.samples=-1', ConfigError),
    ('experiment=gan recipe.std=-1', ConfigError),
    ('experiment=gan model.noise_dim=0', ConfigError),
    ('experiment=gan model.hidden=0', ConfigError),
    ('experiment=gan data.batch_size=0', ConfigError),
    ('experiment=multi_loss data.batch_size=0', ConfigError),
    ('experiment=tbptt data.chunk=0', ConfigError),
]
# accepted on purpose: a valid value of the right type, whatever it looks like
ACCEPTED = [
    "trainer.loss_weights={loss:-1}",  # a negative weight is gradient ascent on that loss (adversarial terms)
    "trainer.resume=auto",  # nothing to resume yet: the run starts, as documented
    "guard.trace=yes",  # YAML's yes is true: anomaly mode on (PyTorch warns that it is slow)
    "checkpoint.dir=123",  # on the command line 123 is a directory name
    "seed=-1",  # any integer seeds torch
    "trainer.precision=16",  # on the CPU too: autocast to float16 and a GradScaler
]


def key_of(override: str) -> str:
    """What the message must name: the key's last part (``max_steps``), or the group (``optimizer``)."""
    return override.split()[-1].split("=", 1)[0].lstrip("+~").rsplit(".", 1)[-1]


# The overrides of OVERRIDES that Hydra itself refuses while composing (a value of the wrong type, a key the config
# does not have). compose then tries each override alone on the config of those that compose: 2 + n compositions for
# n overrides. Composed together, each is tried on the same config as when composed alone and gets the same problem,
# in a fraction of the time; the others (found by check, build or fit, or before composing) are composed one by one.
REFUSED_BY_HYDRA = [
    'trainer.max_steps=abc', 'trainer.max_steps=1.5', 'trainer.val_every=abc', 'trainer.grad_accum=x',
    'trainer.grad_clip=abc', 'trainer.loss_weights=5', 'trainer.loss_weights={loss:abc}', 'trainer.loggers=csv',
    'trainer.progress=maybe', 'trainer.max_skipped=abc', 'trainer.find_unused_parameters=perhaps', 'trainer.undo=null',
    'trainer.maxsteps=5', 'trainer.precision=null', 'trainer.on_nonfinite=null', 'guard.check=null',
    'guard.warmup=abc', 'guard.budget=abc', 'guard.ignore=reuse', 'guard.chek=always', 'checkpoint.every=abc',
    'checkpoint.evry=5', 'optimizer.betas=[0.9]', 'optimizer.betas=abc', 'optimizer.weight_decay=-0.1',
    'optimizer.momentum=0.9', 'model.hiden=64', 'scheduler._target_=torch.optim.lr_scheduler.StepLR',
    'recipe.nothere=1', 'trainer.max_steps=',
]


@pytest.fixture(scope="module")
def refused_together(tmp_path_factory) -> dict[str, str]:
    """Each override of REFUSED_BY_HYDRA -> the message of the ConfigError it gets alone: its problem, one of those
    that composing them all at once finds."""
    tmp_path = tmp_path_factory.mktemp("refused")
    with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(ConfigError) as info:
        monkeypatch.chdir(tmp_path)
        compose([*BASE, f"checkpoint.dir={tmp_path / 'ckpt'}", *REFUSED_BY_HYDRA])
    assert not (tmp_path / "ckpt").exists()  # nothing written
    problems = info.value.problems
    assert len(problems) == len(REFUSED_BY_HYDRA), problems  # one each, none for the others
    messages = {}
    for override in REFUSED_BY_HYDRA:
        its = [p for p in problems if p.startswith(f"{override}: ")]
        assert len(its) == 1, (override, problems)
        messages[override] = str(ConfigError(its))
    return messages


@pytest.mark.parametrize("override, error", OVERRIDES, ids=[o for o, _ in OVERRIDES])
def test_a_bad_override_is_one_clear_error_naming_its_key(tmp_path, monkeypatch, refused_together, override, error):
    monkeypatch.chdir(tmp_path)
    if override in refused_together:
        assert error is ConfigError
        message = refused_together[override]
    else:
        with pytest.raises(error) as info:
            build(compose([*BASE, f"checkpoint.dir={tmp_path / 'ckpt'}", *override.split()])).fit()
        message = str(info.value)
    assert re.search(re.escape(key_of(override)), message), message
    assert ADVICE.search(message), message
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").glob("step-*.pt"))  # nothing written


@pytest.mark.parametrize("override", ACCEPTED)
def test_a_valid_but_unusual_override_trains(tmp_path, monkeypatch, override):
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        assert build(compose([*BASE, f"checkpoint.dir={tmp_path / 'ckpt'}", override])).fit().step == 2


def test_data_that_does_not_fit_the_model_is_named_at_the_first_validation_with_nothing_trained(tmp_path,
                                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = build(compose([*BASE, "data.in_dim=3"]))  # the model still takes model.in_dim=16 inputs
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(StepError, match=re.escape("validation at step 0 failed on batch 1 of val_data (training is "
                                                  "unchanged): RuntimeError: mat1 and mat2 shapes cannot be "
                                                  "multiplied (64x3 and 16x64)")):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def small(cls=Trainer, data=None, **kwargs) -> Trainer:
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = data if data is not None else DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    settings = dict(model=torch.nn.Linear(4, 1), max_steps=2, device="cpu", progress=False, loggers=(),
                    optimizer=lambda p: torch.optim.Adam(p))
    settings.update(kwargs)
    return cls(train_data=data, **settings)


class Unplain:
    pass


LOADER = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 5), torch.ones(4, 1)), batch_size=2)


# Trainer arguments -> the error's text, raised before anything is trained or written (test below)
ARGUMENTS = [
    (dict(callbacks="cb"), r"callbacks='cb' is a str; give an Iterable\[Callback\]"),
    (dict(model=None), r"model is None, and the default training_step and configure_optimizers use self.model: "
                       r"pass model=\.\.\."),
    (dict(data="data.csv"), r"train_data='data.csv' is a str; give an Iterable"),
    (dict(data={"x": torch.ones(2)}), r"train_data=\{'x': .* is a dict; give an Iterable"),
    (dict(data=torch.ones(8, 5)), r"train_data is a Tensor: iterated, it gives one unbatched row per step. Pass "
                                  r"batches: DataLoader\(TensorDataset\(x, y\)"),
    (dict(loss_fn=torch.nn.MSELoss), r"loss_fn=MSELoss is a class, not a loss: give an instance, loss_fn=MSELoss\(\)"),
    (dict(optimizer=functools.partial(torch.optim.Adam, lr="0.01")), r"optimizer.lr='0.01' is a str; give a number"),
    (dict(optimizer=lambda p: torch.optim.Adam(p, lr="0.01")), r"optimizer: making it over the parameters failed: "
                                                                r"TypeError: .*a learning rate is a number"),
    (dict(model=torch.nn.ReLU()), r"optimizer: there are no parameters to optimize \(a model without parameters\?\)"),
    (dict(optimizer=torch.optim.Adam(torch.nn.Linear(4, 1).parameters())),
     r"no optimizer holds any of the model's 2 trainable parameters, so training would not change the model"),
    (dict(loss_weights={"loss": float("nan")}), r"loss_weights\['loss'\]=nan is not a finite number"),
    (dict(config={"act": lambda x: x}), r"config\['act'\]=<function .* is a function: checkpoints store config, and "
                                        r"one holding this could not be loaded"),
    (dict(config={"a": [Unplain()]}), r"config\['a'\]\[0\]=.* is an Unplain: checkpoints store config"),
    (dict(scheduler=functools.partial(torch.optim.lr_scheduler.StepLR)),
     r"scheduler: StepLR cannot be called with the optimizer alone \(missing a required argument: 'step_size'\)"),
    (dict(val_data=[]), r"val_data yielded no batches"),
    (dict(val_data=[LOADER, LOADER]), re.escape(
        "val_data is a list of 2 DataLoaders: safeloop reads one iterable of batches. For one loader over them all: "
        "DataLoader(ConcatDataset([...]), ...) (torch.utils.data); for a metric of each (Lightning's dataloader_idx): "
        "val_data=the first, and in on_validation_end(metrics), metrics['val_other'] = self.test(other)['test_loss']")),
    (dict(data=(LOADER, LOADER)), re.escape("train_data is a tuple of 2 DataLoaders: safeloop reads one iterable of "
                                            "batches. For one loader over them all: DataLoader(ConcatDataset([...]), "
                                            "...) (torch.utils.data)") + "$"),
]


@pytest.mark.parametrize("arguments, message", ARGUMENTS, ids=[f"{k}-{type(v).__name__}" for (k, v), in
                                                               (tuple(a.items()) for a, _ in ARGUMENTS)])
def test_a_bad_argument_is_one_clear_error_naming_it_before_anything_is_trained_or_written(tmp_path, arguments,
                                                                                            message):
    with pytest.raises(ConfigError, match=message):
        small(checkpoint={"dir": str(tmp_path)}, **arguments).fit()
    assert not list(tmp_path.glob("step-*.pt"))


@pytest.mark.parametrize("call, error, message", [
    (lambda: GraphGuard(optimizers=42), ConfigError, r"optimizers=42 is of type int: give a torch.optim.Optimizer, "
                                                     r"a list or a dict of them"),
    (lambda: GraphGuard(out_dir=123), ConfigError, r"out_dir=123 is of type int: give a directory path"),
    (lambda: GraphGuard(ignore="carried"), ConfigError, r"^invalid configuration: guard.ignore='carried' is a str; "
                                                        r"give a list\[str\]$"),
    (lambda: GraphGuard().backward(None), StepError, r"guard.backward\(\) takes the loss, got NoneType"),
    (lambda: GraphGuard().backward(3.0), StepError, r"guard.backward\(\) takes the loss, got float"),
    (lambda: GraphGuard().check([torch.ones(1, requires_grad=True).sum()]), StepError,
     r"guard.check\(\) takes the loss \(a tensor, or a dict of named loss tensors\), got list"),
])
def test_a_bad_graph_guard_argument_is_one_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def returning(value):
    class Returns(Trainer):
        def training_step(self, batch):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            return value(loss) if callable(value) else value
    return Returns


# what training_step returns -> the error, its text
RETURNS = [
    (None, StepError, r"step 1: training_step returned None; training_step must return the loss tensor"),
    (3, StepError, r"step 1: training_step returned a int; training_step must return the loss tensor"),
    ("loss", StepError, r"step 1: training_step returned a str"),
    ({}, StepError, r"step 1: training_step returned an empty dict"),
    (lambda loss: {"loss": 1.0}, StepError, r"'loss' = float, not a tensor"),
    (lambda loss: loss * torch.ones(3), StepError, r"loss 'loss' has shape \(3,\); a loss must be a scalar"),
    (lambda loss: loss.detach(), NoGraphError, r"\(step 1, loss 'loss'\): it was built from detached tensors "
                                               r"\(.detach\(\)\).*To fix: remove .detach\(\)"),
    (lambda loss: torch.tensor(1.0, requires_grad=True), NoGraphError, r"loss 'loss'"),
]


@pytest.mark.parametrize("value, error, message", RETURNS)
def test_a_bad_training_step_return_is_named_and_nothing_is_trained(value, error, message):
    trainer = small(returning(value))
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(error, match=message):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert all(not s for s in trainer.optimizers["optimizer"].state.values()) and trainer.state.step == 0


@pytest.mark.parametrize("check", ["auto", "off"])
def test_a_loss_without_a_graph_given_to_self_backward_is_named_on_a_step_the_guard_does_not_check(check):
    """Manual mode, step 14: past the guard's warm-up (check=auto) or with no checks at all. As in automatic
    mode, the error says what cut the graph."""
    class Manual(Trainer):
        automatic = False

        def training_step(self, batch):
            x, y = batch
            x = x + 0.01 * torch.randn_like(x)  # draws from the RNG
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            self.backward(loss.detach() if self.state.step == 13 else loss)
            self.step()
            return loss

    trainer = small(Manual, max_steps=14, guard={"check": check})
    trainer.max_steps = 13
    trainer.fit()
    before = [p.clone() for p in trainer.model.parameters()]
    trainer.max_steps = 14
    rng = torch.get_rng_state()
    with pytest.raises(NoGraphError, match=r"loss has no autograd graph \(step 14, loss 'loss'\): it was built from "
                                           r"detached tensors \(.detach\(\)\)"):
        trainer.fit()  # training_step ran again to see how the graph was cut, leaving the RNG as it was:
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    torch.randn(8, 4)  # the step's own draw, the only one
    assert torch.equal(after, torch.get_rng_state())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())) and trainer.state.step == 13


def test_with_several_optimizers_a_detached_loss_given_to_self_backward_is_named_and_the_step_undone():
    """Manual mode, two optimizers: G's loss detached after D stepped. The error says what cut the graph (the
    step re-run on its batch), and D's update is undone."""
    class TwoParts(Trainer):
        automatic = False

        def configure_optimizers(self):
            return {"d": torch.optim.Adam(self.model[0].parameters()),
                    "g": torch.optim.Adam(self.model[1].parameters())}

        def training_step(self, batch):
            x, y = batch
            d_loss = self.model[0](x).pow(2).mean()
            self.backward(d_loss, optimizer="d")
            self.step("d")
            g_loss = torch.nn.functional.mse_loss(self.model[1](x), y)
            self.backward(g_loss.detach() if self.state.step == 2 else g_loss, optimizer="g")
            self.step("g")
            return {"d": d_loss, "g": g_loss}

    torch.manual_seed(0)
    x = torch.randn(32, 4)
    trainer = TwoParts(model=torch.nn.ModuleList([torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)]), max_steps=2,
                       train_data=DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8), device="cpu",
                       progress=False, loggers=())
    trainer.fit()
    before = [p.clone() for p in trainer.model.parameters()]
    trainer.max_steps = 3
    with pytest.raises(NoGraphError, match=r"\(step 3, loss 'g'\): it was built from detached tensors"):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())) and trainer.state.step == 2


def test_an_error_in_on_step_end_says_the_update_was_applied_and_leaves_it():
    seen = {}

    class FailsAtStep3(Trainer):
        def on_step_end(self, losses):
            if self.state.step == 3:
                seen["after update"] = [p.detach().clone() for p in self.model.parameters()]
                raise ValueError("logging server unreachable")

    trainer = small(FailsAtStep3, max_steps=5)
    with pytest.raises(StepError, match=re.escape("step 3's update was applied; the error came after it, in "
                                                  "on_step_end: ValueError: logging server unreachable")):
        trainer.fit()
    assert trainer.state.step == 3
    assert all(torch.equal(a, b) for a, b in zip(seen["after update"], trainer.model.parameters()))


def test_a_nan_loss_is_named_or_skipped_as_on_nonfinite_says():
    nan = returning(lambda loss: loss * float("nan"))
    trainer = small(nan, on_nonfinite="error")
    before = [p.clone() for p in trainer.model.parameters()]
    with pytest.raises(NonFiniteError, match=r"step 1: .*loss 'loss'.*The step was abandoned"):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    with pytest.raises(NonFiniteError, match=r"trainer.max_skipped=1\): training diverged"):
        small(nan, on_nonfinite="skip", max_skipped=1).fit()


@pytest.mark.parametrize("optimizers, message", [
    (None, r"configure_optimizers returned None"),
    ("adam", r"configure_optimizers returned str for 'optimizer', not a torch.optim.Optimizer"),
    ([1, 2], r"configure_optimizers returned a list: Lightning's lists"),
])
def test_a_bad_configure_optimizers_is_named(optimizers, message):
    class Configures(Trainer):
        def configure_optimizers(self):
            return optimizers

    with pytest.raises(ConfigError, match=message):
        small(Configures, optimizer=None).fit()


def test_data_that_gives_no_batches_or_only_once_is_named():
    with pytest.raises(ConfigError, match=r"train_data yielded no batches: check the dataset and batch size"):
        small(data=[]).fit()
    x = torch.randn(16, 4)
    with pytest.raises(ConfigError, match=r"train_data is a generator, an iterator that one pass uses up"):
        small(data=(b for b in DataLoader(TensorDataset(x, x[:, :1]), batch_size=8)), max_steps=None, max_epochs=2).fit()
    with pytest.raises(ConfigError, match=r"train_data is a TensorDataset, a Dataset of single samples"):
        small(data=TensorDataset(x, x))


def damaged(path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped byte":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    elif how == "random bytes":
        path.write_bytes(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0))
                         .to(torch.uint8).numpy().tobytes())
    elif how == "text":
        path.write_text("not a checkpoint\n")


@pytest.mark.parametrize("how", ["truncated", "flipped byte", "random bytes", "text"])
def test_a_damaged_checkpoint_is_named_and_nothing_is_changed(tmp_path, how):
    small(checkpoint={"dir": str(tmp_path)}).fit()
    path = Checkpointer(tmp_path).saved()[-1]
    damaged(path, how)
    trainer = small(max_steps=4, checkpoint={"dir": str(tmp_path)}, resume=str(path))
    before = [p.clone() for p in trainer.model.parameters()]
    kept = path.read_bytes()
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        trainer.fit()
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())) and trainer.state.step == 0
    assert path.read_bytes() == kept


STEP_LR = {"scheduler": functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1)}


@pytest.mark.parametrize("saved, change, message", [
    ({}, {"optimizer": lambda p: torch.optim.SGD(p, lr=0.1)}, r"optimizer 'optimizer' was saved from torch.optim.Adam "
                                                              r"and this run's is torch.optim.SGD"),
    ({}, {"model": torch.nn.Linear(4, 2)}, r"size mismatch|shape"),
    ({}, {"optimizer": lambda p: torch.optim.Adam(p[::-1])}, re.escape(
        "optimizer 'optimizer' saved state of shape (1, 4) for its parameter 0, and this run's parameter 0 "
        "(model.bias) has shape (1,): its parameters are in another order, or are others")),
    (STEP_LR, {"scheduler": functools.partial(torch.optim.lr_scheduler.ExponentialLR, gamma=0.9)}, re.escape(
        "scheduler 'optimizer' was saved from another class of scheduler (with step_size; this run's ExponentialLR "
        "has no others): a scheduler's state does not carry over to another class")),
], ids=["optimizer class", "model", "parameter order", "scheduler class"])
def test_a_checkpoint_of_another_run_shape_is_refused_by_name(tmp_path, saved, change, message):
    small(checkpoint={"dir": str(tmp_path)}, **saved).fit()
    args = dict(max_steps=4, checkpoint={"dir": str(tmp_path)}, resume="auto")
    model = change.pop("model", None)
    trainer = small(**args, **change)
    if model is not None:
        trainer.model = model
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(CheckpointError, match=message):
        trainer.fit()
    assert trainer.state.step == 0
    # refused before anything was loaded: the model as it was, no optimizer state
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert all(not opt.state for opt in trainer.optimizers.values())


def test_a_checkpoint_directory_another_live_run_holds_is_refused(tmp_path):
    holder = Checkpointer(tmp_path)
    holder.open()
    try:
        with pytest.raises(CheckpointError, match=rf"checkpoint directory {re.escape(str(tmp_path))} is in use by "
                                                  r"another run"):
            small(checkpoint={"dir": str(tmp_path)}).fit()
    finally:
        holder.close()
    shutil.rmtree(tmp_path)
