"""safeloop's Trainer against pytorch-lightning's, bit for bit: what hooks see of an epoch or plateau schedule and of
the gradients (at a pass's last step, in ``training_step``, after a validation), ``on_fit_start`` and the epoch hooks
of a resumed run, Lightning's documented ``optimizer_step`` warm-up, a OneCycleLR over ``estimated_stepping_batches``,
``GradientAccumulationScheduler``, ``EMAWeightAveraging`` and ``limit_train_batches`` ported, the less common shapes of
``configure_optimizers`` and schedulers, ``on_train_batch_start``'s -1, ``batch_idx`` under accumulation, iterable
data read a batch ahead, and Lightning's own examples and tutorials ported (DQN, autoencoder, mnist-hello-world).

As in ``test_parity.py``: each test trains the same tiny seeded model with ``pytorch_lightning.Trainer`` and with
its port to ``safeloop.Trainer``; ``..._matches`` tests compare what a user relies on, ``..._differs_as_documented``
tests assert a difference the docs state, exactly. A difference the docs do not state is a test asserting
Lightning's behaviour, marked ``xfail(strict=True)`` with the reason, until it is fixed or documented.
"""
import collections
import itertools
import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

pl = pytest.importorskip("pytorch_lightning")
torchmetrics = pytest.importorskip("torchmetrics")

import safeloop  # noqa: E402

from .common import (Lit, Port, assert_same, close, dataset, lightning, loader, max_diff, mse, net,  # noqa: E402
                     saved_and_resumed, settings, sgd)

EPOCHS, STEPS = 2, 7  # passes of 7 batches by default
pytestmark = pytest.mark.filterwarnings("ignore::Warning:pytorch_lightning", "ignore::Warning:lightning_fabric")


def lr_of(optimizer) -> float:
    return optimizer.param_groups[0]["lr"]


def step_lr(model):
    """SGD with momentum and a StepLR (gamma 0.5) given alone: stepped at each epoch's end in both."""
    opt = sgd(model.parameters())
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


# -- an epoch schedule, as the hooks of a pass's last step see it


class LitLastStep(Lit):
    """The learning rate ``on_train_batch_end`` and ``validation_step`` see."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(lr_of(self.optimizers()))

    def validation_step(self, batch, batch_idx):
        self.val_lrs.append(lr_of(self.optimizers()))
        super().validation_step(batch, batch_idx)


class PortLastStep(Port):
    lrs: list
    val_lrs: list
    configure = staticmethod(step_lr)

    def on_step_end(self, losses):
        self.lrs.append(lr_of(self.optimizers["optimizer"]))

    def validation_step(self, batch):
        self.val_lrs.append(lr_of(self.optimizers["optimizer"]))
        return super().validation_step(batch)


def test_epoch_scheduler_seen_by_the_hooks_of_a_pass_last_step_differs_as_documented():
    """docs/trainer.md, "Also different": "The pass's last ``on_step_end``, and a validation at the pass's end, see the
    pass's learning rate. Lightning steps it at the pass's last batch, before that batch's ``on_train_batch_end`` and
    the epoch's validation: they see the next pass's." A StepLR given alone (halving each epoch), validation at each
    epoch's end (safeloop: ``val_every`` = one pass's steps), 2 epochs: the learning rate ``on_train_batch_end`` /
    ``on_step_end`` sees at each step, and ``validation_step`` at each validation (safeloop's before training aside).
    The other steps see the same, and the parameters are the same."""
    lit = LitLastStep(configure=step_lr)
    lit.lrs, lit.val_lrs = [], []
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=2, seed=2))
    port = PortLastStep(model=net(), train_data=loader(), val_data=loader(n=2, seed=2),
                        **settings(max_epochs=EPOCHS, val_every=STEPS))
    port.lrs, port.val_lrs = [], []
    port.fit()
    assert_same(lit.model, port.model)
    last = [STEPS - 1, EPOCHS * STEPS - 1]  # each pass's last step
    assert [lit.lrs[i] for i in last] == lit.val_lrs == [0.025, 0.0125]  # the next pass's
    assert [port.lrs[i] for i in last] == port.val_lrs[1:] == [0.05, 0.025]  # the pass's own
    assert len(lit.lrs) == len(port.lrs) == EPOCHS * STEPS
    assert all(a == b for i, (a, b) in enumerate(zip(lit.lrs, port.lrs)) if i not in last)


# -- on_fit_start in a resumed run


class LitFitStart(Lit):
    """``on_fit_start`` notes the counters and the learning rate, then sets the learning rate to 0.01 (a fine-tuning
    script's override); ``on_train_start`` notes them too."""

    def on_fit_start(self):
        opt = self.trainer.optimizers[0]
        self.seen.append(("fit_start", self.global_step, self.current_epoch, lr_of(opt)))
        for group in opt.param_groups:
            group["lr"] = 0.01

    def on_train_start(self):
        self.seen.append(("train_start", self.global_step, self.current_epoch, lr_of(self.trainer.optimizers[0])))


class PortFitStart(Port):
    seen: list
    configure = staticmethod(step_lr)

    def on_fit_start(self):
        opt = self.optimizers["optimizer"]
        self.seen.append(("fit_start", self.state.step, self.state.epoch, lr_of(opt)))
        for group in opt.param_groups:
            group["lr"] = 0.01


class PortFitStartNewRun(PortFitStart):
    """The port docs/trainer.md gives: the learning rate set for a new run only."""

    def on_fit_start(self):
        if self.state.step == 0:
            super().on_fit_start()


def fit_start_runs(tmp_path, port_class=PortFitStart):
    def lit_run(ckpt_path=None, **kwargs):
        lit = LitFitStart(configure=step_lr)
        lit.seen = []
        lightning(**{"max_epochs": 3, **kwargs}).fit(lit, train_dataloaders=loader(), ckpt_path=ckpt_path)
        return lit

    def port_run(**kwargs):
        port = port_class(model=net(), train_data=loader(), **settings(**{"max_epochs": 3, **kwargs}))
        port.seen = []
        port.fit()
        return port

    return saved_and_resumed(tmp_path, STEPS, lit_run, port_run)


def test_on_fit_start_of_a_new_run_matches(tmp_path):
    """A run that starts afresh: ``on_fit_start`` sees step 0, epoch 0 and the configured learning rate in both, and
    the learning rate it sets is trained with (then halved each epoch by the StepLR)."""
    lit, ours = fit_start_runs(tmp_path)
    for key in ("whole", "first"):
        assert lit[key].seen[0] == ours[key].seen[0] == ("fit_start", 0, 0, 0.05)
        assert_same(lit[key].model, ours[key].model)
    assert lr_of(lit["whole"].optimizers()) == lr_of(ours["whole"].optimizers["optimizer"]) == 0.01 / 8


def test_on_fit_start_of_a_resumed_run_differs_as_documented(tmp_path):
    """docs/trainer.md, "Also different": "on_fit_start of a resumed run runs after the checkpoint is loaded: it sees
    the checkpoint's step, epoch and learning rate, and a learning rate it sets is trained with. Lightning's runs
    before the restore (step 0, epoch 0, the configured learning rate), and the checkpoint's optimizer state replaces
    what it set (its on_train_start sees the restored state). A port that sets the learning rate there for a new run
    only checks self.state.step == 0." Saved at the end of the first pass (step 7) and resumed by a new Trainer to 3
    epochs: what ``on_fit_start`` sees, the learning rate trained on; the port that checks, bit for bit."""
    lit, ours = fit_start_runs(tmp_path)
    assert lit["resumed"].seen == [("fit_start", 0, 0, 0.05), ("train_start", STEPS, 1, 0.005)]
    assert ours["resumed"].seen == [("fit_start", STEPS, 1, 0.005)]
    assert lr_of(lit["resumed"].optimizers()) == 0.005 / 4  # the checkpoint's lr, trained on
    assert lr_of(ours["resumed"].optimizers["optimizer"]) == 0.01 / 4  # on_fit_start's
    assert max_diff(lit["resumed"].model, ours["resumed"].model) > 0
    _, checked = fit_start_runs(tmp_path / "checked", PortFitStartNewRun)
    assert checked["resumed"].seen == []
    assert lr_of(checked["resumed"].optimizers["optimizer"]) == 0.005 / 4
    for key in ("whole", "resumed"):
        assert_same(lit[key].model, checked[key].model)


# -- Lightning's documented warm-up in optimizer_step, and a OneCycleLR over estimated_stepping_batches


class LitWarmUp(Lit):
    """Lightning's docs (``optimizer_step``, "learning rate warm-up"): the step, then the learning rate of the next
    update set from ``self.trainer.global_step``, which counts the updates before this one there."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        if self.trainer.global_step < 5:
            scale = min(1.0, float(self.trainer.global_step + 1) / 5)
            for group in optimizer.param_groups:
                group["lr"] = scale * 0.05

    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(lr_of(optimizer))


class PortWarmUp(Port):
    """The same, after each update: ``optimizer_step`` is refused and ``on_step_end`` runs after the update, where
    ``state.step`` counts it too (Lightning's ``global_step + 1`` there)."""

    lrs: list

    def on_step_end(self, losses):
        if self.state.step - 1 < 5:
            scale = min(1.0, float(self.state.step) / 5)
            for group in self.optimizers["optimizer"].param_groups:
                group["lr"] = scale * 0.05

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(lr_of(optimizer))


@pytest.mark.parametrize("accum", [1, 3])
def test_lightnings_optimizer_step_warm_up_ported_to_on_step_end_matches(accum):
    """Lightning's documented warm-up written in ``optimizer_step`` and its port to ``on_step_end``, with and without
    accumulation (3: a last window of one in each pass): the learning rate of every update, the parameters."""
    lit = LitWarmUp(configure=lambda model: sgd(model.parameters()))
    lit.lrs = []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=accum).fit(lit, train_dataloaders=loader())
    port = PortWarmUp(model=net(), train_data=loader(), optimizer=sgd,
                      **settings(max_epochs=EPOCHS, grad_accum=accum))
    port.lrs = []
    port.fit()
    assert lit.lrs == port.lrs and lit.lrs[:3] == [0.05, 0.2 * 0.05, 0.4 * 0.05]
    assert len(port.lrs) == port.state.step == EPOCHS * (STEPS if accum == 1 else 3)
    assert_same(lit.model, port.model)


def one_cycle(optimizer, total_steps):
    return {"optimizer": optimizer, "lr_scheduler": {
        "scheduler": torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total_steps),
        "interval": "step"}}


class LitOneCycle(Lit):
    def configure_optimizers(self):
        self.total = self.trainer.estimated_stepping_batches
        return one_cycle(sgd(self.model.parameters()), self.total)


class PortOneCycle(Port):
    """Lightning's ``estimated_stepping_batches`` from the settings, as docs/trainer.md's map gives it: the updates of
    ``max_epochs`` passes (a pass's last window may be short), at most ``max_steps``."""

    def configure_optimizers(self):
        total = self.max_epochs * math.ceil(len(self.train_data) / self.grad_accum)
        self.total = total if self.max_steps is None else min(total, self.max_steps)
        return one_cycle(sgd(self.model.parameters()), self.total)


@pytest.mark.parametrize("accum, limit, total", [(1, {}, 14), (3, {}, 6), (3, {"max_steps": 5}, 5)],
                         ids=["max_epochs", "accumulating", "max_steps first"])
def test_one_cycle_over_estimated_stepping_batches_matches(accum, limit, total):
    """A OneCycleLR whose ``total_steps`` is ``self.trainer.estimated_stepping_batches`` (stepped each update, to its
    last): the total, the scheduler's count at the end, the parameters."""
    lit = LitOneCycle()
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=accum, **limit).fit(lit, train_dataloaders=loader())
    port = PortOneCycle(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS, grad_accum=accum, **limit))
    port.fit()
    assert lit.total == port.total == total
    assert lit.lr_schedulers().last_epoch == port.schedulers["optimizer"].last_epoch == total
    assert_same(lit.model, port.model)


class FirstBatches:
    """``limit_train_batches=n`` ported as docs/trainer.md's map gives it: the first ``n`` batches of each pass, with a
    length."""

    def __init__(self, data, n: int):
        self.data, self.n = data, n

    def __len__(self):
        return self.n

    def __iter__(self):
        return itertools.islice(self.data, self.n)


@pytest.mark.parametrize("limit", [3, 0.5], ids=["batches", "fraction"])
def test_limit_train_batches_ported_matches(limit):
    """``limit_train_batches`` (3 batches, or half of 7: ``int(0.5 * 7)``) over a shuffled DataLoader, 3 epochs, and
    its port: the updates, the parameters (each pass shuffles anew in both)."""
    torch.manual_seed(5)
    lit = Lit(configure=lambda model: sgd(model.parameters()))
    trainer = lightning(max_epochs=3, limit_train_batches=limit)
    shuffled = DataLoader(dataset(), batch_size=2, shuffle=True)
    trainer.fit(lit, train_dataloaders=shuffled)
    torch.manual_seed(5)
    n = limit if isinstance(limit, int) else int(limit * len(shuffled))
    port = Port(model=net(), train_data=FirstBatches(DataLoader(dataset(), batch_size=2, shuffle=True), n),
                optimizer=sgd, **settings(max_epochs=3))
    port.fit()
    assert trainer.global_step == port.state.step == 3 * 3
    assert_same(lit.model, port.model)


# -- the less common shapes of configure_optimizers


def named_step_lr(model):
    """Lightning's scheduler dict with ``"name"`` (the name ``LearningRateMonitor`` logs it under)."""
    opt = sgd(model.parameters())
    return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
                                               "interval": "epoch", "name": "lr-sgd"}}


def test_scheduler_dict_with_a_name_differs_as_documented():
    """docs/trainer.md: "Lightning's frequency, strict and name keys are not supported (an error at start-up)".
    Lightning trains with ``"name"``; safeloop raises a ConfigError naming the key before its first step. The same
    dict without it trains as Lightning's, bit for bit."""
    lit = Lit(configure=named_step_lr)
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(lit, train_dataloaders=loader())
    assert trainer.global_step == EPOCHS * STEPS and lr_of(lit.optimizers()) == 0.05 / 4
    port = Port(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS))
    port.configure = staticmethod(named_step_lr)
    with pytest.raises(safeloop.ConfigError, match="keys .*'name'"):
        port.fit()
    assert port.state.step == 0
    assert_same(net(), port.model)

    def unnamed(model):
        config = named_step_lr(model)
        del config["lr_scheduler"]["name"]
        return config

    port = Port(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS))
    port.configure = staticmethod(unnamed)
    port.fit()
    assert_same(lit.model, port.model)


def lists(model):
    """Lightning's ``[optimizers], [schedulers]``."""
    opt = sgd(model.parameters())
    return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)]


def two_on_one(model):
    """Lightning's list of two schedulers on one optimizer, each stepped at each epoch's end, in order."""
    opt = sgd(model.parameters())
    return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]


def chained(model):
    """The port docs/trainer.md's map gives: one ``ChainedScheduler`` of the two."""
    opt = sgd(model.parameters())
    both = [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]
    return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ChainedScheduler(both)}


def test_two_schedulers_on_one_optimizer_chained_matches(tmp_path):
    """Two schedulers on one optimizer, 3 epochs: Lightning's ``[opt], [s1, s2]`` and a ``ChainedScheduler([s1, s2])``,
    saved every pass and resumed from step 14: the learning rate, the parameters."""
    lit = Lit(configure=two_on_one)
    lightning(max_epochs=3).fit(lit, train_dataloaders=loader())
    port = Port(model=net(), train_data=loader(), checkpoint={"dir": str(tmp_path), "every": STEPS},
                **settings(max_epochs=3))
    port.configure = staticmethod(chained)
    port.fit()
    resumed = Port(model=net(), train_data=loader(), resume=str(tmp_path / f"step-{2 * STEPS:09d}.pt"),
                   **settings(max_epochs=3))
    resumed.configure = staticmethod(chained)
    resumed.fit()
    assert lr_of(lit.optimizers()) == lr_of(port.optimizers["optimizer"]) == lr_of(resumed.optimizers["optimizer"])
    assert math.isclose(lr_of(lit.optimizers()), 0.05 * (0.5 * 0.9) ** 3)
    assert_same(lit.model, port.model)
    assert_same(lit.model, resumed.model)


def test_a_tuple_of_lists_differs_loudly():
    """docs/trainer.md: ``configure_optimizers`` returns "an optimizer, {name: optimizer}, or Lightning's dict ...
    (not a list)": Lightning trains ``[opt], [sched]``; safeloop stops at start-up saying what to return."""
    lit = Lit(configure=lists)
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader())
    assert lr_of(lit.optimizers()) == 0.05 / 4
    port = Port(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS))
    port.configure = staticmethod(lists)
    with pytest.raises(safeloop.ConfigError, match="'lr_scheduler': scheduler"):
        port.fit()
    assert port.state.step == 0


# -- iterable data, which Lightning reads a batch ahead


class NoisyStream(IterableDataset):
    """``dataset()``'s samples, each with a random augmentation drawn from the global generator as it is read (in
    the main process: no workers), as a synthetic or streamed dataset draws; ``reads`` counts the samples read."""

    reads = 0

    def __iter__(self):
        for x, y in dataset():
            self.reads += 1
            yield x + 0.1 * torch.rand(x.shape), y


class Replay(IterableDataset):
    """A replay buffer's samples, one batch of 2 drawn at each read (pl_bolts' and many DQN's ``ExperienceSource``),
    7 a pass; ``training_step`` appends to the buffer. ``reads`` counts the batches read, ``sizes`` notes the
    buffer's size at each."""

    def __init__(self, buffer: list):
        self.buffer, self.reads, self.sizes = buffer, 0, []

    def __iter__(self):
        for _ in range(STEPS):
            self.reads += 1
            self.sizes.append(len(self.buffer))
            picks = torch.randint(len(self.buffer), (2,))
            yield torch.stack([self.buffer[i][0] for i in picks]), torch.stack([self.buffer[i][1] for i in picks])


class SizedStream(NoisyStream):
    def __len__(self):
        return 2 * STEPS


class SizedReplay(Replay):
    def __len__(self):
        return STEPS


class LitFed(Lit):
    """Notes each batch and how much of ``self.data`` was read before it; ``self.buffer`` (when set) gets the
    batch's first sample, moved, after each step."""

    buffer = None

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[0].clone())
        self.read.append(self.data.reads)
        if self.buffer is not None:
            self.buffer.append((batch[0][0] + 0.5, batch[1][0]))
        return super().training_step(batch, batch_idx)


class PortFed(Port):
    seen: list
    read: list
    buffer = None

    def training_step(self, batch):
        self.seen.append(batch[0].clone())
        self.read.append(self.data.reads)
        if self.buffer is not None:
            self.buffer.append((batch[0][0] + 0.5, batch[1][0]))
        return super().training_step(batch)


def fed_runs(replay: bool, sized: bool = False):
    """``seed_everything(7)``, dropout 0.5, 2 passes of ``NoisyStream`` (batches of 2) or of ``Replay`` over a buffer
    of ``dataset(4)``'s samples; ``sized``: the dataset has a length (7 batches)."""
    runs = []
    for framework in (Lit, Port):
        buffer = list(dataset(n=4)) if replay else None
        if replay:
            data = (SizedReplay if sized else Replay)(buffer)
            batches = DataLoader(data, batch_size=None)
        else:
            data = SizedStream() if sized else NoisyStream()
            batches = DataLoader(data, batch_size=2)
        pl.seed_everything(7, verbose=False)
        if framework is Lit:
            run = LitFed(net(dropout=0.5), configure=lambda model: sgd(model.parameters()))
            run.seen, run.read, run.buffer, run.data = [], [], buffer, data
            lightning(max_epochs=EPOCHS).fit(run, train_dataloaders=batches)
        else:
            run = PortFed(model=net(dropout=0.5), train_data=batches, optimizer=sgd, **settings(max_epochs=EPOCHS))
            run.seen, run.read, run.buffer, run.data = [], [], buffer, data
            run.fit()
        runs.append(run)
    return runs


def read_before_each_step(per_batch: int, ahead: int) -> list:
    """How much of the data is read before each ``training_step``: its own batch and ``ahead`` more, in each pass."""
    return [per_batch * (epoch * STEPS + min(k + 1 + ahead, STEPS)) for epoch in range(EPOCHS) for k in range(STEPS)]


def test_an_iterable_stream_drawing_random_augmentations_differs_as_documented():
    """docs/trainer.md, "Also different": "Data without a length ... is read when a step asks for its batch. Lightning
    reads it one batch ahead, before training_step ... So data that draws from the global random generators as it is
    read (augmentations in the main process) interleaves its draws with dropout's otherwise". An IterableDataset
    drawing a random augmentation per sample in the main process, a model with dropout: the samples read before each
    ``training_step``, the batches it sees (the first, drawn before any dropout in both, is the same), the
    parameters."""
    lit, port = fed_runs(replay=False)
    assert lit.read == read_before_each_step(2, ahead=1)
    assert port.read == read_before_each_step(2, ahead=0)
    assert len(lit.seen) == len(port.seen) == EPOCHS * STEPS
    assert torch.equal(lit.seen[0], port.seen[0]) and not torch.equal(lit.seen[1], port.seen[1])
    assert max_diff(lit.model, port.model) > 0


def test_a_replay_buffer_filled_by_training_step_differs_as_documented():
    """docs/trainer.md, "Also different": "a batch sampled from a replay buffer that training_step fills holds the
    last step's experience here, not there". Batches sampled from a replay buffer at each read (an IterableDataset),
    each ``training_step`` appending to it (DQN): the batches read before each ``training_step``, the buffer's size
    at each read (4 samples, and one more after each step), the first batch (the same), the parameters."""
    lit, port = fed_runs(replay=True)
    assert lit.read == read_before_each_step(1, ahead=1)
    assert port.read == read_before_each_step(1, ahead=0)
    assert port.data.sizes == [4 + i for i in range(EPOCHS * STEPS)]  # each step's experience, from the next on
    assert lit.data.sizes == [4 + i - (i % STEPS > 0) for i in range(EPOCHS * STEPS)]  # one step later in a pass
    assert len(lit.seen) == len(port.seen) == EPOCHS * STEPS
    assert torch.equal(lit.seen[0], port.seen[0])
    assert max_diff(lit.model, port.model) > 0


@pytest.mark.parametrize("replay", [False, True], ids=["stream", "replay buffer"])
def test_iterable_data_with_a_length_matches(replay):
    """docs/trainer.md, "Also different": "From data with a length Lightning reads none ahead, as here". The same two
    datasets with a ``__len__`` (7 batches): the data read before each step, the batches, the parameters."""
    lit, port = fed_runs(replay=replay, sized=True)
    per_batch = 1 if replay else 2
    assert lit.read == port.read == read_before_each_step(per_batch, ahead=0)
    assert len(lit.seen) == len(port.seen) == EPOCHS * STEPS
    assert all(torch.equal(a, b) for a, b in zip(lit.seen, port.seen))
    assert_same(lit.model, port.model)


# -- on_train_batch_start returning -1


class LitSkipRest(Lit):
    """Lightning's ``on_train_batch_start``: "If you return -1 here, you will skip training for the rest of the
    current epoch." Asked at the first pass's 4th batch."""

    def on_train_batch_start(self, batch, batch_idx):
        self.steps.append((self.current_epoch, batch_idx))
        return -1 if (self.current_epoch, batch_idx) == (0, 3) else None


class PortSkipRest(Port):
    steps: list
    configure = staticmethod(step_lr)

    def on_step_start(self):
        self.steps.append((self.state.epoch, self.state.batch_in_epoch - 1))
        return -1 if (self.state.epoch, self.state.batch_in_epoch - 1) == (0, 3) else None


def test_on_train_batch_start_returning_minus_one_is_refused():
    """-1 at the first pass's 4th batch ends Lightning's pass there (3 + 7 updates over 2 epochs); safeloop's hooks
    return nothing, and on_step_start returning a value is refused there, the step not trained."""
    lit = LitSkipRest(configure=step_lr)
    lit.steps = []
    trainer = lightning(max_epochs=EPOCHS)
    trainer.fit(lit, train_dataloaders=loader())
    assert trainer.global_step == 3 + STEPS and lr_of(lit.optimizers()) == 0.05 / 4
    port = PortSkipRest(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS))
    port.steps = []
    with pytest.raises(safeloop.ConfigError, match=r"on_step_start returned a value: Lightning's on_train_batch_start "
                                                   r"returns -1 to end the epoch there; safeloop's hooks return nothing"):
        port.fit()
    assert port.steps == lit.steps[:4] and port.state.step == 3


# -- Lightning's examples/pytorch/domain_templates/reinforce_learn_Qnet.py, on a small environment of its own


class Chain:
    """A gym-like environment (the example's old 4-tuple ``step``): a position on a line of 6, 2 actions (left,
    right), reward 1 at the right end, which ends the episode; ``action_space.sample()`` draws from ``random``."""

    class Space:
        n = 2

        @staticmethod
        def sample():
            return random.randrange(2)

    action_space = Space()

    def __init__(self):
        self.position = 0

    def observe(self):
        return [float(self.position == i) for i in range(6)]

    def reset(self):
        self.position = 0
        return self.observe()

    def step(self, action):
        self.position = max(0, min(5, self.position + (1 if action else -1)))
        done = self.position == 5
        return self.observe(), float(done), done, {}


class ReplayBuffer:
    """The example's, as written."""

    def __init__(self, capacity):
        self.buffer = collections.deque(maxlen=capacity)

    def __len__(self):
        return len(self.buffer)

    def append(self, experience):
        self.buffer.append(experience)

    def sample(self, batch_size):
        indices = random.sample(range(len(self.buffer)), batch_size)
        states, actions, rewards, dones, next_states = zip(*(self.buffer[idx] for idx in indices))
        return (torch.tensor(states), torch.tensor(actions), torch.tensor(rewards, dtype=torch.float32),
                torch.tensor(dones, dtype=torch.bool), torch.tensor(next_states))


class RLDataset(IterableDataset):
    """The example's: the pass's samples drawn from the buffer when the pass starts."""

    def __init__(self, buffer, sample_size=200):
        self.buffer, self.sample_size = buffer, sample_size

    def __iter__(self):
        states, actions, rewards, dones, new_states = self.buffer.sample(self.sample_size)
        for i in range(len(dones)):
            yield states[i], actions[i], rewards[i], dones[i], new_states[i]


class Player:
    """The example's epsilon-greedy player (the device argument left out: the CPU)."""

    def __init__(self, env, replay_buffer):
        self.env, self.replay_buffer = env, replay_buffer
        self.state = self.env.reset()

    def get_action(self, net, epsilon):
        if random.random() < epsilon:
            return self.env.action_space.sample()
        _, action = torch.max(net(torch.tensor([self.state])), dim=1)
        return int(action.item())

    @torch.no_grad()
    def play_step(self, net, epsilon=0.0):
        action = self.get_action(net, epsilon)
        new_state, reward, done, _ = self.env.step(action)
        self.replay_buffer.append((self.state, action, reward, done, new_state))
        self.state = new_state
        if done:
            self.state = self.env.reset()
        return reward, done


def q_net():
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


class DQNParts:
    """The example's ``DQNLightning`` but its hooks, shared by both sides: small sizes, the buffer filled at random
    when made."""

    gamma, eps_start, eps_end, eps_last_frame, sync_rate, episode_length, batch_size = 0.99, 1.0, 0.01, 20, 4, 12, 4

    def make(self):
        self.env = Chain()
        self.buffer = ReplayBuffer(60)
        self.player = Player(self.env, self.buffer)
        self.rewards = []
        for _ in range(30):  # populate(warm_start_steps)
            self.player.play_step(self.net, epsilon=1.0)

    def dqn_mse_loss(self, batch):
        states, actions, rewards, dones, next_states = batch
        state_action_values = self.net(states).gather(1, actions.unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            next_state_values = self.target_net(next_states).max(1)[0]
            next_state_values[dones] = 0.0
            next_state_values = next_state_values.detach()
        return torch.nn.MSELoss()(state_action_values, next_state_values * self.gamma + rewards)

    def dqn_step(self, batch, global_step):
        epsilon = max(self.eps_end, self.eps_start - (global_step + 1) / self.eps_last_frame)
        reward, done = self.player.play_step(self.net, epsilon)
        self.rewards.append(reward)
        loss = self.dqn_mse_loss(batch)
        if global_step % self.sync_rate == 0:
            self.target_net.load_state_dict(self.net.state_dict())
        return loss

    def data(self):
        return DataLoader(RLDataset(self.buffer, self.episode_length), batch_size=self.batch_size)


class DQNLightning(DQNParts, pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.target_net = q_net(), q_net()
        self.make()

    def training_step(self, batch, nb_batch):
        loss = self.dqn_step(batch, self.global_step)
        log = {"reward": torch.tensor(self.rewards[-1]), "steps": torch.tensor(self.global_step)}
        return collections.OrderedDict({"loss": loss, "log": log, "progress_bar": log})  # the example's

    def configure_optimizers(self):
        return [torch.optim.Adam(self.net.parameters(), lr=1e-2)]


class DQNPort(DQNParts, safeloop.Trainer):
    """The port: ``self.net`` is the model; the target network a module beside it, saved with it (``modules``); the
    loss returned alone (a dict with ``"loss"`` and other keys is refused: docs/trainer.md)."""

    def training_step(self, batch):
        return self.dqn_step(batch, self.state.step)

    def modules(self):
        return {**super().modules(), "target_net": self.target_net}

    @property
    def net(self):
        return self.model


def test_lightning_example_dqn_matches():
    """The DQN example (replay buffer, epsilon-greedy player taking a step in each ``training_step``, target network
    synced every 4 steps from ``global_step``; ``random`` drawn by the player and the buffer), 3 passes of 3 batches
    (12 samples in 4s) from ``seed_everything(3)``: the rewards, the buffer, both networks. Lightning reads its
    iterable data a batch ahead, but this dataset draws a pass's samples when the pass starts, before its first step
    in both."""
    pl.seed_everything(3, verbose=False)
    lit = DQNLightning()
    lightning(max_epochs=3).fit(lit, train_dataloaders=lit.data())
    safeloop.seed_everything(3)
    net_, target = q_net(), q_net()
    port = DQNPort(model=net_, train_data=[None], optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                   **settings(max_epochs=3))
    port.target_net = target
    port.make()
    port.train_data = port.data()
    port.fit()
    assert len(lit.rewards) == len(port.rewards) == 9
    assert lit.rewards == port.rewards and list(lit.buffer.buffer) == list(port.buffer.buffer)
    assert_same(lit.net, port.model)
    assert_same(lit.target_net, port.target_net)


# -- the epoch hooks of a run resumed from a checkpoint saved at a pass's last step, during the run


class LitEpochs(Lit):
    """``(hook, global_step, current_epoch, lr)`` at each epoch's start and end."""

    def note(self, hook):
        self.calls.append((hook, self.global_step, self.current_epoch, lr_of(self.trainer.optimizers[0])))

    def on_train_epoch_start(self):
        self.note("epoch_start")

    def on_train_epoch_end(self):
        self.note("epoch_end")


class PortEpochs(Port):
    calls: list
    configure = staticmethod(step_lr)

    def note(self, hook):
        self.calls.append((hook, self.state.step, self.state.epoch, lr_of(self.optimizers["optimizer"])))

    def on_epoch_start(self):
        self.note("epoch_start")

    def on_epoch_end(self):
        self.note("epoch_end")


def fit_saving_each_pass(lit, tmp_path, ckpt_path=None, **loaders):
    """Lightning's 3 epochs of ``lit``, a checkpoint every 7 steps (each pass's last) in ``tmp_path / "lit"``."""
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_train_steps=STEPS, save_top_k=-1,
                                         filename="{step}")
    lightning(max_epochs=3, enable_checkpointing=True, callbacks=[saver]).fit(
        lit, train_dataloaders=loader(), ckpt_path=ckpt_path, **loaders)
    return lit


def runs_whole_and_resumed_at_step_7(tmp_path, lit_run, port_run):
    """Each framework's run that never stopped, and its run resumed from the checkpoint of step 7 (a pass's end)."""
    whole = lit_run(), port_run()
    resumed = lit_run(ckpt_path=tmp_path / "lit" / f"step={STEPS}.ckpt"), \
        port_run(resume=str(tmp_path / "sl" / f"step-{STEPS:09d}.pt"))
    return whole, resumed


def epoch_hook_runs(tmp_path):
    """3 epochs, a StepLR each epoch, a checkpoint every 7 steps (each pass's last); resumed from step 7's."""
    def lit_run(ckpt_path=None):
        lit = LitEpochs(configure=step_lr)
        lit.calls = []
        return fit_saving_each_pass(lit, tmp_path, ckpt_path)

    def port_run(**kwargs):
        port = PortEpochs(model=net(), train_data=loader(), checkpoint={"dir": str(tmp_path / "sl"), "every": STEPS},
                          **settings(max_epochs=3, **kwargs))
        port.calls = []
        port.fit()
        return port

    return runs_whole_and_resumed_at_step_7(tmp_path, lit_run, port_run)


def test_epoch_hooks_of_a_run_resumed_at_a_pass_end_follow_the_run_that_never_stopped(tmp_path):
    """docs/trainer.md: "Epoch boundaries follow the run that never stopped". The checkpoint of step 7 was saved
    before the first pass's end ran, so safeloop's resumed run ends that pass (its StepLR step, ``on_epoch_end``),
    then starts the next with ``on_epoch_start``, as the run that never stopped did; the parameters of all four
    runs are the same."""
    (lit, port), (lit_resumed, port_resumed) = epoch_hook_runs(tmp_path)
    assert lit.calls == port.calls and len(port.calls) == 6
    assert port_resumed.calls == port.calls[1:]
    for run in (port, lit_resumed, port_resumed):
        assert_same(lit.model, run.model)


def test_epoch_hooks_of_a_run_resumed_at_a_pass_end_differ_as_documented(tmp_path):
    """docs/trainer.md, "Also different": the resumed run "ends that pass (its epoch schedulers step, on_epoch_end) and
    starts the next (on_epoch_start)"; "Lightning's resumed run calls neither that pass's on_train_epoch_end nor the
    next pass's on_train_epoch_start". From the second pass's end on, both call the same hooks with the same
    counters and learning rates, and the parameters are the same."""
    (lit, port), (lit_resumed, port_resumed) = epoch_hook_runs(tmp_path)
    assert lit_resumed.calls == lit.calls[3:]  # from the second pass's end on
    assert port_resumed.calls[:2] == [("epoch_end", STEPS, 0, 0.025), ("epoch_start", STEPS, 1, 0.025)]
    assert port_resumed.calls[2:] == lit_resumed.calls
    assert_same(lit_resumed.model, port_resumed.model)


# -- Lightning's mnist-hello-world tutorial: a torchmetrics Accuracy logged in validation_step


def classes(n=14, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)),
                      batch_size=4)


def classifier():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


class LitMnist(Lit):
    """The tutorial's ``LitMNIST`` (its model a small MLP): cross entropy, and in ``validation_step``
    ``self.val_accuracy.update(preds, y)`` then ``self.log("val_acc", self.val_accuracy)``; the accuracy of each
    validation noted."""

    def __init__(self):
        super().__init__(classifier())
        self.val_accuracy = torchmetrics.Accuracy(task="multiclass", num_classes=3)
        self.accuracies = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.val_accuracy.update(torch.argmax(logits, dim=1), y)
        self.log("val_acc", self.val_accuracy)

    def on_validation_epoch_end(self):
        self.accuracies.append(float(self.val_accuracy.compute()))


class PortMnist(Port):
    """The port, logging the Metric as the tutorial does (``metric=True``), or each batch's accuracy (a tensor:
    the pass's mean over the samples is the accuracy)."""

    metric = True

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def validation_step(self, batch):
        x, y = batch
        logits = self.model(x)
        preds = torch.argmax(logits, dim=1)
        if self.metric:
            self.val_accuracy.update(preds, y)
            self.log("acc", self.val_accuracy)
        else:
            self.log("acc", (preds == y).float().mean())
        return F.cross_entropy(logits, y)


def mnist_runs(metric: bool):
    lit = LitMnist()
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=classes(), val_dataloaders=classes(n=10, seed=2))
    port = PortMnist(model=classifier(), train_data=classes(), val_data=classes(n=10, seed=2),
                     optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), **settings(max_epochs=EPOCHS, val_every=4))
    port.metric, port.val_accuracy = metric, torchmetrics.Accuracy(task="multiclass", num_classes=3)
    port.fit()
    return lit, port


def test_lightning_tutorial_mnist_accuracy_logged_per_batch_matches():
    """The accuracy logged per batch as a tensor: each validation's ``acc`` is Lightning's ``val_acc`` (the mean over
    the samples, summed in float64 here: ``close``), and the parameters are the same."""
    lit, port = mnist_runs(metric=False)
    ours = [metrics["acc"] for _, metrics in port.state.val_history[1:]]  # safeloop's before training aside
    assert len(ours) == len(lit.accuracies) == EPOCHS
    assert all(close(a, b) for a, b in zip(lit.accuracies, ours))
    assert_same(lit.model, port.model)


def test_lightning_tutorial_mnist_accuracy_logged_as_a_metric_is_refused_saying_what_to_log():
    """``self.log(name, metric)`` with a torchmetrics ``Metric`` (the mnist-hello-world tutorial's way): a
    ``ConfigError`` at the first validation, saying to log the batch's value (the test above: it matches)."""
    with pytest.raises(safeloop.ConfigError, match=r"self.log\('acc', <MulticlassAccuracy>\): safeloop logs a number "
                                                   r"or a one-element tensor. For a torchmetrics Metric"):
        mnist_runs(metric=True)


# -- GradientAccumulationScheduler


class PortAccumScheduled(Port):
    """``GradientAccumulationScheduler({1: 2})`` ported: ``grad_accum`` set at each pass's start."""

    def on_epoch_start(self):
        self.grad_accum = 2 if self.state.epoch >= 1 else 1


def test_gradient_accumulation_scheduler_ported_to_on_epoch_start_matches():
    """Lightning's ``GradientAccumulationScheduler({1: 2})`` (no accumulation in the first pass, 2 from the second:
    7 + 4 updates) and the port setting ``self.grad_accum`` in ``on_epoch_start``: the updates, the parameters."""
    lit = Lit(configure=lambda model: sgd(model.parameters()))
    trainer = lightning(max_epochs=EPOCHS, callbacks=[pl.callbacks.GradientAccumulationScheduler({1: 2})])
    trainer.fit(lit, train_dataloaders=loader())
    assert trainer.global_step == STEPS + 4
    port = PortAccumScheduled(model=net(), train_data=loader(), optimizer=sgd, **settings(max_epochs=EPOCHS))
    port.fit()
    assert port.state.step == trainer.global_step
    assert_same(lit.model, port.model)


# -- EMAWeightAveraging


class LitVal(Lit):
    """Notes each validation's loss."""

    def on_validation_epoch_end(self):
        self.val_losses.append(self.trainer.callback_metrics["val_loss"].item())


class PortEma(Port):
    """Lightning's ``EMAWeightAveraging(decay=0.9)`` ported: an ``AveragedModel`` made when the fit starts and
    updated after each update (``on_step_end``), validated in place of the model, copied into it at the end."""

    def on_fit_start(self):
        self.ema = torch.optim.swa_utils.AveragedModel(self.model, use_buffers=True,
                                                       avg_fn=torch.optim.swa_utils.get_ema_avg_fn(0.9))

    def on_step_end(self, losses):
        self.ema.update_parameters(self.model)

    def validation_step(self, batch):  # (the validation before training: before on_fit_start, the model itself)
        return mse(self.ema.module if hasattr(self, "ema") else self.model, batch)

    def on_fit_end(self):
        for average, current in zip(self.ema.module.parameters(), self.model.parameters()):
            current.data.copy_(average.data)

    def modules(self):
        return {**super().modules(), **({"ema": self.ema} if hasattr(self, "ema") else {})}


@pytest.mark.parametrize("accum", [1, 3])
def test_ema_weight_averaging_ported_matches(accum):
    """``EMAWeightAveraging(decay=0.9)``, with and without accumulation (3: its update once per optimizer step),
    validation each epoch (of the averaged weights): each validation's loss (Lightning's float32 mean of batch means
    over equal batches: ``close``), the parameters after the fit (the average, copied in)."""
    lit = LitVal(configure=lambda model: sgd(model.parameters()))
    lit.val_losses = []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=accum,
              callbacks=[pl.callbacks.EMAWeightAveraging(decay=0.9)]).fit(
        lit, train_dataloaders=loader(), val_dataloaders=loader(n=4, seed=2))
    port = PortEma(model=net(), train_data=loader(), val_data=loader(n=4, seed=2), optimizer=sgd,
                   **settings(max_epochs=EPOCHS, grad_accum=accum, val_every=STEPS if accum == 1 else 3))
    port.fit()
    ours = [metrics["val_loss"] for _, metrics in port.state.val_history[1:]]
    assert len(ours) == len(lit.val_losses) == EPOCHS
    assert all(close(a, b) for a, b in zip(lit.val_losses, ours))
    assert int(port.ema.n_averaged) == port.state.step
    assert_same(lit.model, port.model)


# -- Lightning's examples/pytorch/basics/autoencoder.py, on 4x4 random images


def images(n=12, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.rand(n, 1, 4, 4, generator=gen), torch.zeros(n)), batch_size=4)


class AutoEncoder(torch.nn.Module):
    def __init__(self, hidden_dim=8):
        super().__init__()
        torch.manual_seed(0)
        nn = torch.nn
        self.encoder = nn.Sequential(nn.Linear(16, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 3))
        self.decoder = nn.Sequential(nn.Linear(3, hidden_dim), nn.ReLU(), nn.Linear(hidden_dim, 16))

    def forward(self, x):
        return self.decoder(self.encoder(x))


class LitAutoEncoder(pl.LightningModule):
    """The example's module (``on_step=True`` kept), its encoder and decoder in ``self.model``; the example's
    ``ImageSampler`` at each epoch's end reduced to what it does to a run: a DataLoader iterated and the model run
    in eval mode, then put back in train mode."""

    def __init__(self, learning_rate=10e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = AutoEncoder()
        self.val_losses, self.samples = [], []

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        return self._common_step(batch, batch_idx, "train")

    def validation_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "val")

    def test_step(self, batch, batch_idx):
        self._common_step(batch, batch_idx, "test")

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self(self._prepare_batch(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch, batch_idx, stage):
        x = self._prepare_batch(batch)
        loss = F.mse_loss(x, self(x))
        self.log(f"{stage}_loss", loss, on_step=True)
        return loss

    def on_validation_epoch_end(self):
        self.val_losses.append(self.trainer.callback_metrics["val_loss_epoch"].item())


class ImageSampler(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        x, _ = next(iter(DataLoader(images(n=4, seed=3).dataset, batch_size=2)))
        with torch.no_grad():
            pl_module.eval()
            pl_module.samples.append(pl_module(x.view(x.size(0), -1)))
            pl_module.train()


class PortAutoEncoder(safeloop.Trainer):
    """The port: ``self.log(..., on_step=True)`` dropped (refused: docs/trainer.md), validation and test returning
    their loss."""

    samples: list

    def training_step(self, batch):
        return self._common_step(batch)

    def validation_step(self, batch):
        return self._common_step(batch)

    def predict_step(self, batch):
        return self.model(self._prepare_batch(batch))

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=10e-3)

    def _prepare_batch(self, batch):
        x, _ = batch
        return x.view(x.size(0), -1)

    def _common_step(self, batch):
        x = self._prepare_batch(batch)
        return F.mse_loss(x, self.model(x))


class PortImageSampler(safeloop.Callback):
    def on_epoch_end(self, trainer):
        x, _ = next(iter(DataLoader(images(n=4, seed=3).dataset, batch_size=2)))
        with torch.no_grad():
            trainer.model.eval()
            trainer.samples.append(trainer.model(x.view(x.size(0), -1)))
            trainer.model.train()


def test_lightning_example_autoencoder_matches():
    """3 epochs of 3 batches, validation each epoch, then ``test`` and ``predict``: each validation's and the test's
    loss (float32 means against float64: ``close``), the images sampled at each epoch's end, the predictions, the
    parameters."""
    torch.manual_seed(11)
    lit = LitAutoEncoder()
    trainer = lightning(max_epochs=3, callbacks=[ImageSampler()])
    trainer.fit(lit, train_dataloaders=images(), val_dataloaders=images(n=8, seed=2))
    tested = trainer.test(lit, dataloaders=images(n=8, seed=2), verbose=False)[0]["test_loss_epoch"]
    predicted = trainer.predict(lit, dataloaders=images(n=8, seed=2))
    torch.manual_seed(11)
    port = PortAutoEncoder(model=AutoEncoder(), train_data=images(), val_data=images(n=8, seed=2),
                           callbacks=[PortImageSampler()], **settings(max_epochs=3, val_every=3))
    port.samples = []
    port.fit()
    ours = [metrics["val_loss"] for _, metrics in port.state.val_history[1:]]
    assert len(ours) == len(lit.val_losses) == 3 and all(close(a, b) for a, b in zip(lit.val_losses, ours))
    assert all(torch.equal(a, b) for a, b in zip(lit.samples, port.samples)) and len(port.samples) == 3
    assert close(tested, port.test(images(n=8, seed=2))["test_loss"])
    assert all(torch.equal(a, b) for a, b in zip(predicted, port.predict(images(n=8, seed=2))))
    assert_same(lit.model, port.model)


# -- batch_idx in training_step under accumulation


class LitBatchIdx(Lit):
    """Trains the even batches of a pass only (a loss chosen by ``batch_idx``, as alternating objectives do)."""

    def training_step(self, batch, batch_idx):
        self.seen.append(batch_idx)
        loss = super().training_step(batch, batch_idx)
        return loss if batch_idx % 2 == 0 else loss * 0


class PortBatchIdx(Port):
    """The port, with the index the refusal of ``training_step(batch, batch_idx)`` points to:
    ``self.state.batch_in_epoch`` ("counts the batches of the pass") less one."""

    seen: list

    def training_step(self, batch):
        batch_idx = self.state.batch_in_epoch - 1
        self.seen.append(batch_idx)
        loss = super().training_step(batch)
        return loss if batch_idx % 2 == 0 else loss * 0


def test_batch_idx_from_batch_in_epoch_without_accumulation_matches():
    lit = LitBatchIdx(configure=lambda model: sgd(model.parameters()))
    lit.seen = []
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader())
    port = PortBatchIdx(model=net(), train_data=loader(), optimizer=sgd, **settings(max_epochs=EPOCHS))
    port.seen = []
    port.fit()
    assert lit.seen == port.seen == list(range(STEPS)) * EPOCHS
    assert_same(lit.model, port.model)


def test_batch_idx_from_batch_in_epoch_under_accumulation_matches():
    """``accumulate_grad_batches=3`` (windows of 3, 3 and 1 a pass): each micro-batch's index, the parameters."""
    lit = LitBatchIdx(configure=lambda model: sgd(model.parameters()))
    lit.seen = []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=3).fit(lit, train_dataloaders=loader())
    port = PortBatchIdx(model=net(), train_data=loader(), optimizer=sgd, **settings(max_epochs=EPOCHS, grad_accum=3))
    port.seen = []
    port.fit()
    assert lit.seen == port.seen
    assert_same(lit.model, port.model)


# -- the gradients training_step sees


def first_grad_norm(model):
    grad = next(model.parameters()).grad
    return None if grad is None else float(grad.norm())


class LitGradSeen(Lit):
    """The first parameter's gradient norm ``on_train_batch_start`` and ``training_step`` see (the last update's,
    as a step logging it reads it)."""

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(("batch_start", first_grad_norm(self.model)))

    def training_step(self, batch, batch_idx):
        self.seen.append(("training_step", first_grad_norm(self.model)))
        return super().training_step(batch, batch_idx)


class PortGradSeen(Port):
    seen: list

    def on_step_start(self):
        self.seen.append(("batch_start", first_grad_norm(self.model)))

    def training_step(self, batch):
        self.seen.append(("training_step", first_grad_norm(self.model)))
        return super().training_step(batch)


def test_gradients_training_step_sees_differ_as_documented():
    """docs/trainer.md, "Also different": "Gradients are cleared after on_step_start: training_step sees None.
    Lightning clears them after the first micro-batch's training_step, before its backward, so its training_step
    sees the last update's." 3 steps: ``on_train_batch_start`` / ``on_step_start`` see the last update's gradients
    in both (none at the first); the parameters are the same."""
    lit = LitGradSeen(configure=lambda model: sgd(model.parameters()))
    lit.seen = []
    lightning(max_steps=3).fit(lit, train_dataloaders=loader())
    port = PortGradSeen(model=net(), train_data=loader(), optimizer=sgd, **settings(max_steps=3))
    port.seen = []
    port.fit()
    assert_same(lit.model, port.model)
    started = [norm for _, norm in port.seen[0::2]]
    assert lit.seen[0::2] == port.seen[0::2] and started[0] is None and None not in started[1:]
    assert lit.seen[1::2] == [("training_step", norm) for norm in started]  # the last update's
    assert port.seen[1::2] == [("training_step", None)] * 3


# -- a plateau scheduler, as on_train_epoch_end sees it


def plateau(model):
    """ReduceLROnPlateau on val_loss, halving the learning rate at every validation that does not improve."""
    opt = sgd(model.parameters())
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "monitor": "val_loss"}}


class LitPlateauSeen(Lit):
    def on_train_epoch_start(self):
        self.seen.append(("epoch_start", lr_of(self.trainer.optimizers[0])))

    def on_train_epoch_end(self):
        self.seen.append(("epoch_end", lr_of(self.trainer.optimizers[0])))


class PortPlateauSeen(Port):
    seen: list
    configure = staticmethod(plateau)

    def on_epoch_start(self):
        self.seen.append(("epoch_start", lr_of(self.optimizers["optimizer"])))

    def on_epoch_end(self):
        self.seen.append(("epoch_end", lr_of(self.optimizers["optimizer"])))


def test_plateau_seen_by_on_epoch_end_differs_as_documented():
    """docs/trainer.md, "Also different": "After a validation at a pass's end, on_epoch_end sees the learning rate
    it set. Lightning steps it after on_train_epoch_end, which sees the one before. The next pass's start sees the
    same in both." 3 epochs, validation at each epoch's end, the second not improving: the learning rate each
    epoch's start and end hooks see, the final one, the parameters."""
    lit = LitPlateauSeen(configure=plateau)
    lit.seen = []
    lightning(max_epochs=3).fit(lit, train_dataloaders=loader(), val_dataloaders=loader(n=4, seed=2))
    port = PortPlateauSeen(model=net(), train_data=loader(), val_data=loader(n=4, seed=2),
                           **settings(max_epochs=3, val_every=STEPS))
    port.seen = []
    port.fit()
    assert_same(lit.model, port.model)
    final = lr_of(port.optimizers["optimizer"])
    assert lr_of(lit.optimizers()) == final == 0.0125
    assert lit.seen[::2] == port.seen[::2] == [("epoch_start", 0.05), ("epoch_start", 0.05), ("epoch_start", 0.025)]
    starts = [lr for _, lr in port.seen[::2]]
    assert [lr for _, lr in lit.seen[1::2]] == starts  # the one before the plateau's step
    assert [lr for _, lr in port.seen[1::2]] == starts[1:] + [final]  # the one it set


# -- the gradients validation and the epoch's end see


class LitGradsAfter(Lit):
    """The first parameter's gradient norm ``validation_step`` (first batch), ``on_train_epoch_end`` and
    ``on_fit_end`` see."""

    def validation_step(self, batch, batch_idx):
        if batch_idx == 0:
            self.seen.append(("validation", first_grad_norm(self.model)))
        return super().validation_step(batch, batch_idx)

    def on_train_epoch_end(self):
        self.seen.append(("epoch_end", first_grad_norm(self.model)))

    def on_fit_end(self):
        self.seen.append(("fit_end", first_grad_norm(self.model)))


class PortGradsAfter(Port):
    seen: list

    def validation_step(self, batch):
        if self.state.step > 0 and self.state.val_history[-1][0] != self.state.step and not self.noted:
            self.seen.append(("validation", first_grad_norm(self.model)))  # (the first batch, during training)
            self.noted = True
        return super().validation_step(batch)

    def on_validation_end(self, metrics):
        self.noted = False

    def on_epoch_end(self):
        self.seen.append(("epoch_end", first_grad_norm(self.model)))

    def on_fit_end(self):
        self.seen.append(("fit_end", first_grad_norm(self.model)))


def grads_after_runs(validate: bool):
    """2 passes of 2 batches, validation at each pass's end or none."""
    val = loader(n=4, seed=2) if validate else None
    lit = LitGradsAfter(configure=lambda model: sgd(model.parameters()))
    lit.seen = []
    lightning(max_epochs=EPOCHS).fit(lit, train_dataloaders=loader(n=4), val_dataloaders=val)
    port = PortGradsAfter(model=net(), train_data=loader(n=4), val_data=val, optimizer=sgd,
                          **settings(max_epochs=EPOCHS, val_every=2 if validate else None))
    port.seen, port.noted = [], False
    port.fit()
    assert_same(lit.model, port.model)
    return lit, port


def test_gradients_at_an_epoch_end_without_validation_match():
    """docs/trainer.md: "An update's gradients stay until the next step begins ...: on_step_end, on_epoch_end,
    validation, the end of fit() and the next on_step_start see them"; "Without a validation they see the same in
    both". Each epoch's end and the fit's end see the last update's gradients in both."""
    lit, port = grads_after_runs(validate=False)
    assert lit.seen == port.seen and len(port.seen) == 3 and all(norm is not None for _, norm in port.seen)


def test_gradients_after_a_validation_differ_as_documented():
    """docs/trainer.md, "Also different": "Gradients are kept through validation: validation_step, and on_epoch_end or
    the end of fit() after a validation, see the last update's. Lightning clears them before each validation during
    training (on_validation_model_zero_grad): there they see None." Validation at each pass's end (Lightning's
    default when given validation data): what validation, each epoch's end and the fit's end see, against the
    gradients the same runs leave without validation."""
    lit, port = grads_after_runs(validate=True)
    _, plain = grads_after_runs(validate=False)
    first, second, _ = [norm for _, norm in plain.seen]
    hooks = ["validation", "epoch_end", "validation", "epoch_end", "fit_end"]
    assert [hook for hook, _ in lit.seen] == [hook for hook, _ in port.seen] == hooks
    assert all(norm is None for _, norm in lit.seen)
    assert [norm for _, norm in port.seen] == [first, first, second, second, second] and None not in (first, second)


# -- a scheduler whose step() needs the epoch (timm's)


class TimmLike:
    """``timm.scheduler.Scheduler``'s interface: ``step(epoch, metric=None)``, ``step_update(num_updates)``,
    ``state_dict`` and ``load_state_dict``; the learning rate halved each epoch."""

    def __init__(self, optimizer):
        self.optimizer, self.base = optimizer, [group["lr"] for group in optimizer.param_groups]

    def step(self, epoch, metric=None):
        for group, base in zip(self.optimizer.param_groups, self.base):
            group["lr"] = base * 0.5 ** epoch

    def step_update(self, num_updates, metric=None):
        pass

    def state_dict(self):
        return {"base": self.base}

    def load_state_dict(self, state):
        self.base = state["base"]


def timm_like(model):
    opt = sgd(model.parameters())
    return {"optimizer": opt, "lr_scheduler": {"scheduler": TimmLike(opt), "interval": "epoch"}}


def test_a_scheduler_needing_the_epoch_is_refused_before_training():
    with pytest.raises(pl.utilities.exceptions.MisconfigurationException, match="lr_scheduler_step"):
        lightning(max_epochs=EPOCHS).fit(Lit(configure=timm_like), train_dataloaders=loader())
    port = Port(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS))
    port.configure = staticmethod(timm_like)
    with pytest.raises(safeloop.ConfigError, match=r"is a TimmLike, whose step\(\) needs epoch"):
        port.fit()
    assert port.state.step == 0


# -- SequentialLR: a linear warm-up, then a cosine decay


def warm_then_cosine(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=3)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    scheduler = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[3])
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LitLrSeen(Lit):
    def on_before_optimizer_step(self, optimizer):
        self.lrs.append(lr_of(optimizer))


class PortLrSeen(Port):
    lrs: list
    configure = staticmethod(warm_then_cosine)

    def on_before_optimizer_step(self, name, optimizer):
        self.lrs.append(lr_of(optimizer))


@pytest.mark.parametrize("accum", [1, 3])
def test_sequential_warm_up_then_cosine_matches(accum):
    """A SequentialLR (LinearLR for 3 updates, then CosineAnnealingLR) each update, with clipping, with and without
    accumulation: the learning rate of every update, the parameters."""
    lit = LitLrSeen(configure=warm_then_cosine)
    lit.lrs = []
    lightning(max_epochs=EPOCHS, accumulate_grad_batches=accum, gradient_clip_val=0.1).fit(
        lit, train_dataloaders=loader())
    port = PortLrSeen(model=net(), train_data=loader(), **settings(max_epochs=EPOCHS, grad_accum=accum, grad_clip=0.1))
    port.lrs = []
    port.fit()
    assert lit.lrs == port.lrs and len(port.lrs) == port.state.step
    assert_same(lit.model, port.model)


# -- Lightning's default sanity check


def test_lightnings_default_sanity_check_against_the_validation_before_training_matches():
    """Lightning's default ``num_sanity_val_steps=2`` (validation batches before training, its random state put back
    after) against safeloop's validation before training: ``seed_everything(7)``, the model built after it, dropout,
    a shuffled DataLoader, a pass, validated after it: the batches ``training_step`` sees, the parameters."""
    from .test_parity import LitSeen, PortSeen, shuffled, unseeded_net

    pl.seed_everything(7, verbose=False)
    lit = LitSeen(unseeded_net())
    lit.seen = []
    lightning(max_epochs=1, num_sanity_val_steps=2).fit(lit, train_dataloaders=shuffled(),
                                                       val_dataloaders=loader(n=6, seed=2))
    safeloop.seed_everything(7)
    port = PortSeen(model=unseeded_net(), train_data=shuffled(), val_data=loader(n=6, seed=2),
                    optimizer=lambda p: torch.optim.Adam(p, lr=1e-2), **settings(max_epochs=1, val_every=STEPS))
    port.seen = []
    port.fit()
    assert len(lit.seen) == len(port.seen) == STEPS
    assert all(torch.equal(a, b) for a, b in zip(lit.seen, port.seen))
    assert_same(lit.model, port.model)


# -- a plateau scheduler resumed from a checkpoint saved at a pass's last step, during the run


class LitPlateauResumed(Lit):
    def on_validation_epoch_end(self):
        self.validated.append(self.global_step)


def plateau_resumed_runs(tmp_path):
    """3 epochs, validation at each epoch's end and a ReduceLROnPlateau on it, a checkpoint every 7 steps (each
    pass's last); resumed from step 7's by a new Trainer."""
    def lit_run(ckpt_path=None):
        lit = LitPlateauResumed(configure=plateau)
        lit.validated = []
        return fit_saving_each_pass(lit, tmp_path, ckpt_path, val_dataloaders=loader(n=4, seed=2))

    def port_run(**kwargs):
        port = Port(model=net(), train_data=loader(), val_data=loader(n=4, seed=2),
                    checkpoint={"dir": str(tmp_path / "sl"), "every": STEPS, "keep": 3},
                    **settings(max_epochs=3, val_every=STEPS, **kwargs))
        port.configure = staticmethod(plateau)
        port.fit()
        return port

    return runs_whole_and_resumed_at_step_7(tmp_path, lit_run, port_run)


def test_plateau_resumed_at_a_pass_end_follows_the_run_that_never_stopped(tmp_path):
    """safeloop's checkpoint of step 7 is saved after that step's validation and the plateau's step on it: the
    resumed run validates at steps 14 and 21 and ends as the run that never stopped (parameters, learning rate),
    which Lightning's that never stopped matches."""
    (lit, port), (_, port_resumed) = plateau_resumed_runs(tmp_path)
    assert lit.validated == [7, 14, 21]
    assert [step for step, _ in port_resumed.state.val_history] == [0, 7, 14, 21]
    assert lr_of(lit.optimizers()) == lr_of(port.optimizers["optimizer"]) == 0.0125
    assert lr_of(port_resumed.optimizers["optimizer"]) == 0.0125
    assert_same(lit.model, port.model)
    assert_same(port.model, port_resumed.model)


def test_plateau_resumed_at_a_pass_end_differs_as_documented(tmp_path):
    """docs/trainer.md, "Also different": "A validation at that step, and a plateau's step on it, came before the save"
    (safeloop); "It skips that pass's validation and a plateau scheduler's step on it, so it trains otherwise than its
    run that never stopped" (Lightning's resumed run). safeloop's resumed run ends as Lightning's that never
    stopped."""
    (lit, port), (lit_resumed, port_resumed) = plateau_resumed_runs(tmp_path)
    assert lit.validated == [7, 14, 21] and lit_resumed.validated == [14, 21]
    assert [step for step, _ in port_resumed.state.val_history] == [0, 7, 14, 21]
    assert lr_of(lit_resumed.optimizers()) == 0.05
    assert lr_of(port_resumed.optimizers["optimizer"]) == lr_of(lit.optimizers()) == 0.0125
    assert max_diff(lit.model, lit_resumed.model) > 0
    assert_same(lit.model, port_resumed.model)
