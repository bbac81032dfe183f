"""Manual mode (``automatic = False``: ``self.backward``, ``self.step``, closures) against the hand-written loops it
replaces, bit for bit: parameters, optimizer state, each scheduler's ``last_epoch`` and learning rate.

The cases follow Lightning's manual optimization guide (Lightning-AI/pytorch-lightning,
``docs/source-pytorch/model/manual_optimization.rst``: gradient accumulation stepping every N batches, schedulers
stepped by hand, several optimizers, ``toggle_optimizer``, an L-BFGS closure, ``clip_gradients``), the GAN loops of
pytorch/examples (``dcgan/main.py``), martinarjovsky/WassersteinGAN (``main.py``: ``Diters`` critic updates per
generator update, weight clipping) and caogang/wgan-gp (``gan_toy.py``: the gradient penalty), PyTorch's AMP
accumulation recipe, and what README.md, docs/trainer.md and docs/checkpoints.md promise for manual mode: a
``self.save_checkpoint()`` asked from a hook and the run resumed from it, a step that raises (or whose loss is NaN)
and the fit tried again, a scheduler whose optimizer did not step, the learning rate written to ``metrics.csv``,
and the errors a mistake gets. Cases that fail today are strict xfails whose ``reason`` says what goes wrong.
"""
from __future__ import annotations

import copy
import csv
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import ConfigError, ConfigWarning, StepError, Trainer

QUIET = dict(device="cpu", progress=False, loggers=())


def batches(n: int = 8, size: int = 4, seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, generator=gen), torch.randn(size, 1, generator=gen)) for _ in range(n)]


def mlp(seed: int = 0, hidden: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 1))


class GAN(nn.Module):
    """A generator from 2 noise features to 3 data features, and a critic of 3 features."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.g = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 3))
        self.d = nn.Sequential(nn.Linear(3, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1))


def gan_batches(n: int = 8, size: int = 4, seed: int = 0) -> list:
    """(real samples, noise): the noise is part of the batch, so a failed step draws nothing a retry would miss."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 3, generator=gen) + 1.0, torch.randn(size, 2, generator=gen)) for _ in range(n)]


def everything(model: nn.Module, optimizers: dict, schedulers: dict) -> dict:
    return copy.deepcopy({"model": model.state_dict(),
                          "optimizers": {k: o.state_dict() for k, o in optimizers.items()},
                          "schedulers": {k: s.state_dict() for k, s in schedulers.items()}})


def differences(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ, bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
        return [] if same else [where or "tensor"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def logged(run_dir, metric: str) -> dict[int, float]:
    with open(run_dir / "metrics.csv", newline="") as f:
        return {int(row["step"]): float(row["value"]) for row in csv.DictReader(f) if row["metric"] == metric}


def decay(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)


def halving(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 0.5 ** k)


# -- Lightning's manual gradient accumulation: step every N batches ------------------------------------------------
class AccumulateEveryN(Trainer):
    """manual_optimization.rst, "Gradient Accumulation": ``loss = loss / N``, ``self.manual_backward(loss)``,
    ``if (batch_idx + 1) % N == 0: opt.step(); opt.zero_grad()``. ``state.batch_in_epoch`` is ``batch_idx + 1``."""

    automatic = False
    every = 2

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss / self.every)
        if self.state.batch_in_epoch % self.every == 0:
            self.step()
        return loss


def test_accumulation_every_n_batches_with_a_step_scheduler_and_its_logged_rate(tmp_path):
    """Lightning's manual accumulation (N=2) over two passes of 7 batches, the leftover gradient of each pass's last
    batch carried into the next (the guide zeroes only after a step), Adam and a per-update LambdaLR given in
    ``configure_optimizers``. The hand loop: pytorch/examples' shape with ``sch.step()`` after ``opt.step()``.
    The ``lr`` written to ``metrics.csv`` each step is the rate the optimizer held as the step ran (Lightning's
    ``LearningRateMonitor``), which an accumulating step does not move."""
    data = batches(7)

    class Port(AccumulateEveryN):
        def configure_optimizers(self):
            opt = torch.optim.Adam(self.model.parameters(), lr=0.05)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step"}}

    t = Port(model=mlp(), train_data=data, max_epochs=2, device="cpu", progress=False, loggers=("csv",),
             run_dir=tmp_path, log_every=1, checkpoint=False)
    t.fit()

    net = mlp()
    opt = torch.optim.Adam(net.parameters(), lr=0.05)
    sch = halving(opt)
    rates, step = {}, 0
    for _ in range(2):
        for i, (x, y) in enumerate(data):
            step += 1
            rates[step] = opt.param_groups[0]["lr"]
            (F.mse_loss(net(x), y) / 2).backward()
            if (i + 1) % 2 == 0:
                opt.step()
                opt.zero_grad()
                sch.step()
    assert differences(everything(net, {"optimizer": opt}, {"optimizer": sch}),
                       everything(t.model, t.optimizers, t.schedulers)) == []
    assert t.schedulers["optimizer"].last_epoch == sch.last_epoch == 6
    assert logged(tmp_path, "lr") == pytest.approx(rates, rel=1e-9)


# -- martinarjovsky/WassersteinGAN: several critic updates per generator update -------------------------------------
class WGAN(Trainer):
    """WassersteinGAN ``main.py``: the critic (RMSprop, weights clamped to [-c, c] after each update) steps on every
    batch, the generator on every ``n_critic``-th. One batch per step, as Lightning's manual WGAN ports have it."""

    automatic = False
    n_critic = 3
    clamp = 0.05

    def configure_optimizers(self):
        out = {}
        for name in ("d", "g"):
            opt = torch.optim.RMSprop(getattr(self.model, name).parameters(), lr=5e-3)
            out[name] = {"optimizer": opt, "lr_scheduler": {"scheduler": decay(opt), "interval": "step"}}
        return out

    def training_step(self, batch):
        real, z = batch
        g, d = self.model.g, self.model.d
        loss_d = d(g(z).detach()).mean() - d(real).mean()
        self.backward(loss_d, optimizer="d")
        self.step("d")
        for p in d.parameters():
            p.data.clamp_(-self.clamp, self.clamp)
        if self.state.batch_in_epoch % self.n_critic == 0:
            loss_g = -d(g(z)).mean()
            self.backward(loss_g, optimizer="g")
            self.step("g")
        return loss_d


def wgan_by_hand(data, steps: int, n_critic: int = 3, clamp: float = 0.05, skip: tuple = ()):
    """The hand loop: ``optimizerD.zero_grad()``, backward, ``step()``, clamp; every ``n_critic`` batches the
    generator's turn. Each optimizer's scheduler steps after its own ``step()``. ``skip``: indices of batches
    consumed without training (a failed step)."""
    model = GAN()
    opts = {name: torch.optim.RMSprop(getattr(model, name).parameters(), lr=5e-3) for name in ("d", "g")}
    schs = {name: decay(opt) for name, opt in opts.items()}
    rates = {}
    for i, (real, z) in enumerate(data[:steps]):
        if i in skip:
            continue
        rates[i + 1] = (opts["d"].param_groups[0]["lr"], opts["g"].param_groups[0]["lr"])
        opts["d"].zero_grad()
        (model.d(model.g(z).detach()).mean() - model.d(real).mean()).backward()
        opts["d"].step()
        schs["d"].step()
        for p in model.d.parameters():
            p.data.clamp_(-clamp, clamp)
        if (i + 1) % n_critic == 0:
            opts["g"].zero_grad()
            (-model.d(model.g(z)).mean()).backward()
            opts["g"].step()
            schs["g"].step()
    return model, opts, schs, rates


def test_wgan_critic_iterations_step_only_the_schedulers_of_the_optimizers_that_stepped(tmp_path):
    """The generator's scheduler steps once per generator update (3 in 9 steps), the critic's once per step; both
    rates are logged as ``lr_d`` and ``lr_g``, each the one its optimizer held as the step began."""
    data = gan_batches(9)
    t = WGAN(model=GAN(), train_data=data, max_steps=9, device="cpu", progress=False, loggers=("csv",),
             run_dir=tmp_path, log_every=1, checkpoint=False)
    t.fit()
    model, opts, schs, rates = wgan_by_hand(data, 9)
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []
    assert (t.schedulers["d"].last_epoch, t.schedulers["g"].last_epoch) == (9, 3)
    assert logged(tmp_path, "lr_d") == pytest.approx({k: v[0] for k, v in rates.items()}, rel=1e-9)
    assert logged(tmp_path, "lr_g") == pytest.approx({k: v[1] for k, v in rates.items()}, rel=1e-9)


# -- self.save_checkpoint() from a hook in manual mode, and the run resumed from it ---------------------------------
class SavesAt(AccumulateEveryN):
    """Lightning's manual accumulation with N=3 over passes of 5 batches (an update spans two passes), Adam, and an
    epoch scheduler; ``on_step_end`` asks for a checkpoint at step ``at`` (nanoGPT's ``if iter_num % eval_interval ==
    0: ... torch.save(checkpoint, ...)``, ported with ``self.save_checkpoint()``)."""

    every = 3
    at = 0
    saved = None

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.model.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

    def on_step_end(self, losses):
        if self.state.step == self.at:
            self.saved = self.save_checkpoint()


@pytest.mark.parametrize("at", [4, 5, 6])
def test_a_checkpoint_asked_from_on_step_end_resumes_as_the_run_that_never_stopped(tmp_path, at):
    """Saved mid-accumulation mid-pass (4), at a pass's last step with a gradient waiting for the next update (5),
    and right after an update at the next pass's first step (6); the run resumed from that file by a new Trainer
    trains to step 12 bit-identical with the run that never stopped (docs/checkpoints.md: the save waits for the
    pass's end, and a checkpoint holds the gradients accumulated for a later update)."""
    data = batches(5)
    straight = SavesAt(model=mlp(), train_data=data, max_steps=12, checkpoint={"dir": str(tmp_path / "a")}, **QUIET)
    straight.at = at
    straight.fit()
    assert straight.saved is not None and straight.saved.exists()
    resumed = SavesAt(model=mlp(), train_data=data, max_steps=12, checkpoint={"dir": str(tmp_path / "b")},
                      resume=str(straight.saved), **QUIET)
    resumed.fit()
    assert resumed.state.step == 12
    assert differences(everything(straight.model, straight.optimizers, straight.schedulers),
                       everything(resumed.model, resumed.optimizers, resumed.schedulers)) == []
    assert straight.schedulers["optimizer"].last_epoch == 2


# -- a manual step that raises, and the fit tried again ---------------------------------------------------------
class DCGAN(Trainer):
    """pytorch/examples ``dcgan/main.py``: ``errD_real`` and ``errD_fake`` back-propagated in turn, ``optimizerD``
    steps, then ``errG`` through the updated discriminator and ``optimizerG`` steps. Both Adam, each with a
    per-update StepLR. ``fail_at``: the generator's part of that step raises once (a bad batch, a bug hit once)."""

    automatic = False
    fail_at = 0

    def configure_optimizers(self):
        out = {}
        for name in ("d", "g"):
            opt = torch.optim.Adam(getattr(self.model, name).parameters(), lr=0.02, betas=(0.5, 0.999))
            out[name] = {"optimizer": opt, "lr_scheduler": {"scheduler": decay(opt), "interval": "step"}}
        return out

    def training_step(self, batch):
        real, z = batch
        g, d = self.model.g, self.model.d
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        err_real = F.binary_cross_entropy_with_logits(d(real), ones)
        self.backward(err_real, optimizer="d")
        fake = g(z)
        err_fake = F.binary_cross_entropy_with_logits(d(fake.detach()), zeros)
        self.backward(err_fake, optimizer="d")
        self.step("d")
        if self.state.step + 1 == self.fail_at:
            self.fail_at = 0
            raise RuntimeError("a bad batch")
        err_g = F.binary_cross_entropy_with_logits(d(fake), ones)
        self.backward(err_g, optimizer="g")
        self.step("g")
        return {"d": err_real + err_fake, "g": err_g}


def dcgan_by_hand(data, clip: float | None = None, bf16: bool = False, epochs: int = 1, skip: tuple = ()):
    """pytorch/examples ``dcgan/main.py``'s loop, each optimizer's scheduler stepped after it (``epochs`` > 1: the
    schedulers are StepLR(1, 0.5) stepped once a pass instead). ``clip``: Lightning's ``self.clip_gradients(opt,
    gradient_clip_val=clip)`` before each step, as ``clip_grad_norm_`` over that model's parameters. ``bf16``: each
    forward under ``torch.autocast("cpu", torch.bfloat16)``. ``skip``: (pass, batch index) pairs not trained."""
    model = GAN()
    opts = {name: torch.optim.Adam(getattr(model, name).parameters(), lr=0.02, betas=(0.5, 0.999))
            for name in ("d", "g")}
    schs = {name: decay(opt) if epochs == 1 else torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
            for name, opt in opts.items()}

    def autocast():
        return torch.autocast("cpu", torch.bfloat16, enabled=bf16)

    for epoch in range(epochs):
        for i, (real, z) in enumerate(data):
            if (epoch, i) in skip:
                continue
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            model.d.zero_grad()
            with autocast():
                err_real = F.binary_cross_entropy_with_logits(model.d(real), ones)
            err_real.backward()
            with autocast():
                fake = model.g(z)
                err_fake = F.binary_cross_entropy_with_logits(model.d(fake.detach()), zeros)
            err_fake.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.d.parameters(), clip)
            opts["d"].step()
            model.g.zero_grad()
            with autocast():
                err_g = F.binary_cross_entropy_with_logits(model.d(fake), ones)
            err_g.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.g.parameters(), clip)
            opts["g"].step()
            if epochs == 1:
                for sch in schs.values():
                    sch.step()
        if epochs > 1:
            for sch in schs.values():
                sch.step()
    return model, opts, schs


@pytest.mark.parametrize("settings", [dict(grad_clip=0.1), dict(precision="bf16")])
def test_dcgan_with_clipping_or_bf16_matches_the_hand_loop(settings):
    """Lightning's ``self.clip_gradients`` per optimizer ported as ``grad_clip`` (each optimizer's own parameters),
    and ``precision="bf16"``, where the generator's forward through the discriminator after its update must see
    the updated weights (docs/trainer.md: autocast's cache is cleared after every update)."""
    data = gan_batches(6)
    t = DCGAN(model=GAN(), train_data=data, max_steps=6, **settings, **QUIET)
    t.fit()
    model, opts, schs = dcgan_by_hand(data, clip=settings.get("grad_clip"), bf16="precision" in settings)
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


def test_a_dcgan_step_failing_at_a_passs_last_batch_then_the_pass_ends_on_the_retry():
    """Step 4 is the last batch of a pass of 4 and fails: the pass's end (the epoch schedulers' step,
    ``on_epoch_end``) comes with the retry's first step, once, and three passes end as the hand loop without
    that batch."""
    class EpochSchedules(DCGAN):
        ends = 0

        def configure_optimizers(self):
            out = {}
            for name in ("d", "g"):
                opt = torch.optim.Adam(getattr(self.model, name).parameters(), lr=0.02, betas=(0.5, 0.999))
                out[name] = {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}
            return out

        def on_epoch_end(self):
            self.ends += 1

    data = gan_batches(4)
    t = EpochSchedules(model=GAN(), train_data=data, max_epochs=3, **QUIET)
    t.fail_at = 4
    with pytest.raises(StepError, match="step 4 failed and was abandoned"):
        t.fit()
    assert (t.ends, t.schedulers["d"].last_epoch) == (0, 0)
    t.fit()
    assert (t.state.step, t.ends, t.schedulers["d"].last_epoch, t.schedulers["g"].last_epoch) == (11, 3, 3, 3)
    model, opts, schs = dcgan_by_hand(data, epochs=3, skip=((0, 3),))
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


@pytest.mark.parametrize("undo", ["auto", "full"])
def test_a_dcgan_step_failing_after_the_discriminators_update_is_undone_and_the_retry_trains_on(undo):
    """docs/checkpoints.md "A failed step": the discriminator's update of step 3 (followed by the generator's in
    every earlier step, so ``auto`` snapshots it) is undone with its scheduler; ``fit()`` again goes on with the
    batch after the failed one, as the hand loop that skipped that batch."""
    data = gan_batches(7)
    t = DCGAN(model=GAN(), train_data=data, max_steps=2, undo=undo, **QUIET)
    t.fit()
    before = everything(t.model, t.optimizers, t.schedulers)
    t.fail_at, t.max_steps = 3, 6
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): RuntimeError: a bad batch")):
        t.fit()
    assert differences(before, everything(t.model, t.optimizers, t.schedulers)) == []
    assert all(p.grad is None for p in t.model.parameters())
    t.fit()
    model, opts, schs = dcgan_by_hand(data[:2] + data[3:])
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


@pytest.mark.filterwarnings("ignore:optimizer 'g' has not updated anything in the 2 steps")
def test_a_wgan_generator_turn_failing_after_critic_only_steps_says_what_auto_leaves_and_full_undoes_it():
    """WassersteinGAN's loop: steps 1 and 2 update the critic alone, step 3 the critic then the generator. ``auto``
    learned that the critic always stepped last and took no snapshot of it: the error says so. Under ``full`` the
    failed step leaves everything as before it, and the retry trains as the hand loop without that batch."""
    class Failing(WGAN):
        fail_at = 0

        def on_before_optimizer_step(self, name, optimizer):
            if name == "g" and self.state.step + 1 == self.fail_at:
                self.fail_at = 0
                raise RuntimeError("a bad batch")

    data = gan_batches(9)
    for undo in ("auto", "full"):
        t = Failing(model=GAN(), train_data=data, max_steps=2, undo=undo, **QUIET)
        t.fit()
        before = everything(t.model, t.optimizers, t.schedulers)
        t.fail_at, t.max_steps = 3, 6
        if undo == "auto":
            with pytest.raises(StepError, match=re.escape("optimizer 'd' had already updated its parameters or "
                                                          "begun to, and is not undone")):
                t.fit()
            continue
        with pytest.raises(StepError, match=re.escape("(parameters and optimizer state are unchanged)")):
            t.fit()
        assert differences(before, everything(t.model, t.optimizers, t.schedulers)) == []
        t.fit()
        # the retry's batches: 1, 2, then 4...; the generator's turn comes at every third batch of the pass
        model, opts, schs, _ = wgan_by_hand(data, 7, skip=(2,))
        assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


# -- the learning rate written to metrics.csv in manual mode ----------------------------------------------------
def test_the_rate_logged_for_a_step_does_not_depend_on_log_every(tmp_path):
    """Lightning's manual accumulation (N=2, updates at even steps) with a per-update LambdaLR; the ``lr`` written
    at steps 3, 6, 9 and 12 by ``log_every=3`` is the one ``log_every=1`` writes there: the rate the optimizer held
    as that step ran (Lightning's ``LearningRateMonitor`` reads ``param_group["lr"]`` at the batch's start)."""
    class Port(AccumulateEveryN):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": halving(opt), "interval": "step"}}

    written = {}
    for every in (1, 3):
        run_dir = tmp_path / str(every)
        Port(model=mlp(), train_data=batches(12), max_steps=12, device="cpu", progress=False, loggers=("csv",),
             run_dir=run_dir, log_every=every, checkpoint=False).fit()
        written[every] = logged(run_dir, "lr")
    assert written[1][3] == 0.05
    assert written[3] == {k: v for k, v in written[1].items() if k % 3 == 0}


# -- L-BFGS with a closure, Lightning's manual way --------------------------------------------------------------
class LBFGSPort(Trainer):
    """manual_optimization.rst, "Use closure for LBFGS-like optimizers": ``def closure(): loss = ...;
    opt.zero_grad(); self.manual_backward(loss); return loss`` then ``opt.step(closure=closure)``; ported with
    ``self.step(closure=closure)``. A per-update StepLR, and ``grad_clip`` (the hand loop clips in its closure)."""

    automatic = False

    def configure_optimizers(self):
        opt = torch.optim.LBFGS(self.model.parameters(), lr=0.5, max_iter=4, history_size=3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay(opt), "interval": "step"}}

    def training_step(self, batch):
        x, y = batch

        def closure():
            loss = F.mse_loss(self.model(x), y)
            self.optimizers["optimizer"].zero_grad()
            self.backward(loss)
            return loss

        self.step(closure=closure)
        return F.mse_loss(self.model(x), y).detach()


def test_lbfgs_closure_with_a_scheduler_and_clipping_matches_the_hand_loop():
    data = batches(5)
    t = LBFGSPort(model=mlp(), train_data=data, max_steps=5, grad_clip=0.5, **QUIET)
    t.fit()
    assert differences(everything(*lbfgs_by_hand(data)), everything(t.model, t.optimizers, t.schedulers)) == []
    assert t.schedulers["optimizer"].last_epoch == 5


# -- grad_accum with a manual step -----------------------------------------------------------------------------
def test_grad_accum_with_a_manual_step_is_refused_at_start_up():
    """A Lightning port keeping ``Trainer(accumulate_grad_batches=2)`` as ``grad_accum=2`` beside the guide's
    minimal manual step (``opt.zero_grad()``, ``self.manual_backward(loss)``, ``opt.step()``): Lightning stops with
    "Automatic gradient accumulation is not supported for manual optimization"
    (``trainer/configuration_validator.py``). Here the run makes 8 updates of undivided losses in 4 steps."""
    class Minimal(Trainer):
        automatic = False

        def training_step(self, batch):
            x, y = batch
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            self.step()
            return loss

    net = mlp()
    with pytest.raises(ConfigError, match="grad_accum"):
        Minimal(model=net, train_data=batches(8), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), max_steps=4,
                grad_accum=2, **QUIET).fit()


# -- WassersteinGAN's inner critic loop: several updates of one optimizer in one step ---------------------------------
def wgan_loop_batches(n: int = 5, critic: int = 3, size: int = 4, seed: int = 1) -> list:
    """Per step: ``critic`` real batches with their noise, and the generator's noise."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(critic, size, 3, generator=gen) + 1.0, torch.randn(critic, size, 2, generator=gen),
             torch.randn(size, 2, generator=gen)) for _ in range(n)]


class WGANInnerLoop(Trainer):
    """martinarjovsky/WassersteinGAN ``main.py``: ``for p in netD.parameters(): p.requires_grad = True``; ``Diters``
    times: clamp, ``netD.zero_grad()``, ``errD_real.backward(one)``, ``errD_fake.backward(mone)`` on
    ``netG(noise).data``, ``optimizerD.step()``; then ``requires_grad = False`` for the critic and the generator's
    update through it. Each optimizer has a per-update ExponentialLR. ``fail``: (step, critic iteration) whose
    update raises in ``on_before_optimizer_step``, once."""

    automatic = False
    fail: tuple[int, int] | None = None

    def configure_optimizers(self):
        out = {}
        for name in ("d", "g"):
            opt = torch.optim.RMSprop(getattr(self.model, name).parameters(), lr=5e-3)
            out[name] = {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, 0.9), "interval": "step"}}
        return out

    def on_before_optimizer_step(self, name, optimizer):
        if name == "d" and self.fail == (self.state.step + 1, self.iteration):
            self.fail = None
            raise RuntimeError("a bad batch")

    def training_step(self, batch):
        reals, noises, z = batch
        g, d = self.model.g, self.model.d
        for p in d.parameters():
            p.requires_grad = True
        for j, (real, noise) in enumerate(zip(reals, noises)):
            self.iteration = j
            with torch.no_grad():  # the source's p.data.clamp_, which version counters do not see
                for p in d.parameters():
                    p.clamp_(-0.05, 0.05)
            self.backward(d(real).mean(), optimizer="d")
            with torch.no_grad():
                fake = g(noise)
            self.backward(-d(fake).mean(), optimizer="d")
            self.step("d")
        for p in d.parameters():
            p.requires_grad = False
        err_g = d(g(z)).mean()
        self.backward(err_g, optimizer="g")
        self.step("g")
        return err_g


def wgan_inner_loop_by_hand(data):
    model = GAN()
    opts = {name: torch.optim.RMSprop(getattr(model, name).parameters(), lr=5e-3) for name in ("d", "g")}
    schs = {name: torch.optim.lr_scheduler.ExponentialLR(opt, 0.9) for name, opt in opts.items()}
    one, mone = torch.tensor(1.0), torch.tensor(-1.0)
    for reals, noises, z in data:
        for p in model.d.parameters():
            p.requires_grad = True
        for real, noise in zip(reals, noises):
            for p in model.d.parameters():
                p.data.clamp_(-0.05, 0.05)
            model.d.zero_grad()
            model.d(real).mean().backward(one)
            with torch.no_grad():
                fake = model.g(noise)
            model.d(fake).mean().backward(mone)
            opts["d"].step()
            schs["d"].step()
        for p in model.d.parameters():
            p.requires_grad = False
        model.g.zero_grad()
        model.d(model.g(z)).mean().backward(one)
        opts["g"].step()
        schs["g"].step()
    for p in model.d.parameters():
        p.requires_grad = True
    return model, opts, schs


def test_wgan_inner_critic_loop_with_requires_grad_toggled_matches_the_hand_loop():
    data = wgan_loop_batches()
    t = WGANInnerLoop(model=GAN(), train_data=data, max_steps=5, **QUIET)
    t.fit()
    for p in t.model.d.parameters():
        p.requires_grad = True
    model, opts, schs = wgan_inner_loop_by_hand(data)
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []
    assert (t.schedulers["d"].last_epoch, t.schedulers["g"].last_epoch) == (15, 5)


def test_a_failure_in_the_second_critic_update_undoes_the_first_and_the_retry_trains_on():
    """Step 2 fails in its second critic update: both critic updates of the step and the critic's scheduler are put
    back (the critic is snapshotted at its first update of the step, since the generator followed it in step 1).
    The clamp before that first update is not the Trainer's: the error names the critic's weights as changed, and
    they stay clamped (docs/checkpoints.md). Clamped again by the next step, the retry trains as the hand loop that
    skipped the batch."""
    data = wgan_loop_batches()
    t = WGANInnerLoop(model=GAN(), train_data=data, max_steps=1, **QUIET)
    t.fit()
    before = everything(t.model, t.optimizers, t.schedulers)
    t.fail, t.max_steps = (2, 1), 4
    with pytest.raises(StepError, match=re.escape("step 2 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged; but `model.d.0.weight`, `model.d.0.bias`, "
                                                  "`model.d.2.weight` and 1 more changed in this step other than "
                                                  "by self.step")):
        t.fit()
    for p in t.model.d.parameters():
        p.requires_grad = True
    for key, value in before["model"].items():
        if key.startswith("d."):
            value.clamp_(-0.05, 0.05)
    assert differences(before, everything(t.model, t.optimizers, t.schedulers)) == []
    t.fit()
    for p in t.model.d.parameters():
        p.requires_grad = True
    model, opts, schs = wgan_inner_loop_by_hand(data[:1] + data[2:])
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


def lbfgs_by_hand(data, clip: float = 0.5, each_gradient=None):
    """L-BFGS with a closure that clips its gradients (``each_gradient(p)`` first, for every parameter), and a
    scheduler stepped after each update."""
    net = mlp()
    opt = torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=4, history_size=3)
    sch = decay(opt)
    for x, y in data:
        def closure():
            opt.zero_grad()
            loss = F.mse_loss(net(x), y)
            loss.backward()
            for p in net.parameters() if each_gradient is not None else ():
                each_gradient(p)
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
            return loss

        opt.step(closure)
        sch.step()
    return net, {"optimizer": opt}, {"optimizer": sch}


def test_a_closure_failing_on_its_second_evaluation_is_undone_and_the_retry_trains_on():
    """docs/trainer.md: in manual mode an update with a closure is snapshotted whatever ``undo=auto`` learned (the
    optimizer has stepped last in every earlier step), so L-BFGS's first inner iterations, already applied to the
    weights when its second evaluation raises, are undone with its history and its scheduler."""
    class Failing(LBFGSPort):
        fail_at = 0

        def training_step(self, batch):
            x, y = batch
            calls = []

            def closure():
                calls.append(1)
                if self.state.step + 1 == self.fail_at and len(calls) == 2:
                    self.fail_at = 0
                    raise RuntimeError("a bad evaluation")
                loss = F.mse_loss(self.model(x), y)
                self.optimizers["optimizer"].zero_grad()
                self.backward(loss)
                return loss

            self.step(closure=closure)
            return F.mse_loss(self.model(x), y).detach()

    data = batches(6)
    t = Failing(model=mlp(), train_data=data, max_steps=2, grad_clip=0.5, **QUIET)
    t.fit()
    before = everything(t.model, t.optimizers, t.schedulers)
    t.fail_at, t.max_steps = 3, 5
    with pytest.raises(StepError, match=re.escape("step 3 failed and was abandoned (parameters and optimizer state "
                                                  "are unchanged): RuntimeError: a bad evaluation")):
        t.fit()
    assert differences(before, everything(t.model, t.optimizers, t.schedulers)) == []
    t.fit()
    assert differences(everything(*lbfgs_by_hand(data[:2] + data[3:])),
                       everything(t.model, t.optimizers, t.schedulers)) == []


# -- on_nonfinite="skip" in a manual GAN step --------------------------------------------------------------------
def test_a_nan_generator_loss_skips_the_whole_dcgan_step_with_the_discriminators_update():
    """docs/checkpoints.md: ``skip`` skips the whole step, undoing what it already updated. The generator's loss of
    step 3 is NaN (a batch whose scale is NaN), found at ``self.step("g")`` after the discriminator stepped: the
    step counts as skipped, and the run trains as the hand loop that drops that batch (the usual
    ``if not torch.isfinite(loss): continue`` before anything steps)."""
    class Scaled(DCGAN):
        def training_step(self, batch):
            real, z, scale = batch
            self.scale = scale
            return super().training_step((real, z))

        def backward(self, loss, optimizer=None, retain_graph=False, create_graph=False):
            if optimizer == "g":
                loss = loss * self.scale
            super().backward(loss, optimizer, retain_graph, create_graph)

    data = gan_batches(6)
    scales = [torch.tensor(float("nan")) if i == 2 else torch.tensor(1.0) for i in range(6)]
    t = Scaled(model=GAN(), train_data=[(r, z, s) for (r, z), s in zip(data, scales)], max_steps=6,
               on_nonfinite="skip", **QUIET)
    t.fit()
    assert (t.state.step, t.state.skipped) == (6, 1)
    model, opts, schs = dcgan_by_hand(data[:2] + data[3:])
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []


# -- self.save_checkpoint() asked before the step's update ----------------------------------------------------------
class SavesEarly(AccumulateEveryN):
    """``self.save_checkpoint()`` asked in ``on_step_start`` (karpathy/nanoGPT ``train.py`` saves at the top of its
    iteration, ``if iter_num % eval_interval == 0``, before the forward) or inside the manual ``training_step`` after
    ``self.step()``, at step ``at``; the path it returns is kept."""

    every = 2
    at = 3
    where = "on_step_start"
    returned = None

    def on_step_start(self):
        if self.where == "on_step_start" and self.state.step + 1 == self.at:
            self.returned = self.save_checkpoint()

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.where == "training_step" and self.state.step + 1 == self.at:
            self.returned = self.save_checkpoint()
        return loss


@pytest.mark.parametrize("where", ["on_step_start", "training_step"])
def test_the_path_save_checkpoint_returns_during_a_step_is_the_file_written(tmp_path, where):
    """docs/checkpoints.md: asked from a hook while a step's work is under way (``on_step_start`` to
    ``on_step_end``), the file is written once that work is done, and ``save_checkpoint()`` returns the file's
    path. The run resumed from that path trains on as the run that never stopped."""
    data = batches(5)
    straight = SavesEarly(model=mlp(), train_data=data, optimizer=lambda p: torch.optim.Adam(p, lr=0.05),
                          max_steps=8, checkpoint={"dir": str(tmp_path / "a"), "keep": 20}, **QUIET)
    straight.where = where
    straight.fit()
    assert straight.returned is not None
    assert straight.returned.exists(), sorted(p.name for p in straight.returned.parent.glob("*.pt"))
    resumed = SavesEarly(model=mlp(), train_data=data, optimizer=lambda p: torch.optim.Adam(p, lr=0.05),
                         max_steps=8, checkpoint={"dir": str(tmp_path / "b")}, resume=str(straight.returned), **QUIET)
    resumed.where = "nowhere"
    resumed.fit()
    assert differences(everything(straight.model, straight.optimizers, {}),
                       everything(resumed.model, resumed.optimizers, {})) == []


# -- precision 16 with Lightning's manual accumulation ------------------------------------------------------------
def test_manual_accumulation_under_precision_16_matches_pytorchs_amp_accumulation_recipe():
    """PyTorch's AMP examples ("Gradient accumulation"): ``scaler.scale(loss / iters_to_accumulate).backward()``
    every batch, ``scaler.step(optimizer); scaler.update(); optimizer.zero_grad()`` every N; a per-update StepLR.
    The GradScaler updates only on the steps that update (docs/trainer.md: once per step with an update)."""
    class Port(AccumulateEveryN):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": decay(opt), "interval": "step"}}

    data = batches(7)
    t = Port(model=mlp(), train_data=data, max_steps=7, precision="16", **QUIET)
    t.fit()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    sch, scaler = decay(opt), torch.amp.GradScaler("cpu")
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", torch.float16):
            loss = F.mse_loss(net(x), y)
        scaler.scale(loss / 2).backward()
        if (i + 1) % 2 == 0:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            sch.step()
    assert differences(everything(net, {"optimizer": opt}, {"optimizer": sch}),
                       everything(t.model, t.optimizers, t.schedulers)) == []
    assert t.scaler.state_dict() == scaler.state_dict()
    assert [p.grad is None for p in t.model.parameters()] == [p.grad is None for p in net.parameters()]


# -- Lightning's optimizers stepping at different frequencies ---------------------------------------------------
def test_optimizers_stepping_at_different_frequencies_with_zero_grad_before_each_backward():
    """manual_optimization.rst, "Optimizer Steps at Different Frequencies": ``d_opt.zero_grad()`` before every
    ``manual_backward(errD)`` and ``d_opt.step()`` every 2nd batch; the generator likewise every 4th. The gradient
    a step leaves without an update is dropped by the next ``zero_grad()`` (kept: docs/trainer.md), so each update
    uses its own batch's gradient only; each per-update scheduler steps with its optimizer."""
    class Frequencies(DCGAN):
        def training_step(self, batch):
            real, z = batch
            g, d = self.model.g, self.model.d
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            fake = g(z)
            err_d = (F.binary_cross_entropy_with_logits(d(real), ones)
                     + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
            self.optimizers["d"].zero_grad()
            self.backward(err_d, optimizer="d")
            if self.state.batch_in_epoch % 2 == 0:
                self.step("d")
            err_g = F.binary_cross_entropy_with_logits(d(fake), ones)
            self.optimizers["g"].zero_grad()
            self.backward(err_g, optimizer="g")
            if self.state.batch_in_epoch % 4 == 0:
                self.step("g")
            return {"d": err_d, "g": err_g}

    data = gan_batches(8)
    t = Frequencies(model=GAN(), train_data=data, max_steps=8, **QUIET)
    t.fit()
    model = GAN()
    opts = {name: torch.optim.Adam(getattr(model, name).parameters(), lr=0.02, betas=(0.5, 0.999))
            for name in ("d", "g")}
    schs = {name: decay(opt) for name, opt in opts.items()}
    for i, (real, z) in enumerate(data):
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        fake = model.g(z)
        err_d = (F.binary_cross_entropy_with_logits(model.d(real), ones)
                 + F.binary_cross_entropy_with_logits(model.d(fake.detach()), zeros))
        opts["d"].zero_grad()
        err_d.backward()
        if (i + 1) % 2 == 0:
            opts["d"].step()
            schs["d"].step()
        err_g = F.binary_cross_entropy_with_logits(model.d(fake), ones)
        opts["g"].zero_grad()
        err_g.backward(inputs=list(model.g.parameters()))
        if (i + 1) % 4 == 0:
            opts["g"].step()
            schs["g"].step()
    assert differences(everything(model, opts, schs), everything(t.model, t.optimizers, t.schedulers)) == []
    assert (t.schedulers["d"].last_epoch, t.schedulers["g"].last_epoch) == (4, 2)


def test_a_gradient_hook_with_an_lbfgs_closure_sees_each_evaluations_gradients_only():
    """Gradient centralization (Yonghongwei/Gradient-Centralization, algorithm-GC/algorithm/Centralization.py:
    ``x.add_(-x.mean(dim=tuple(range(1, x.dim())), keepdim=True))`` for every gradient of more than one dimension)
    in ``on_before_optimizer_step``, where docs/trainer.md has gradients changed, with Lightning's L-BFGS closure.
    docs/trainer.md: after each closure call the gradients go through ``on_before_optimizer_step`` and clipping.
    The hand loop centralizes and clips inside its closure, after ``backward``."""
    def centralize(p):
        if p.grad is not None and p.dim() > 1:
            p.grad.add_(-p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))

    class Centralized(LBFGSPort):
        seen = []

        def on_before_optimizer_step(self, name, optimizer):
            self.seen.append(all(p.grad is not None for p in self.model.parameters()))
            for p in self.model.parameters():
                if p.dim() > 1:
                    p.grad.add_(-p.grad.mean(dim=tuple(range(1, p.dim())), keepdim=True))

    data = batches(4)
    t = Centralized(model=mlp(), train_data=data, max_steps=4, grad_clip=0.5, **QUIET)
    t.fit()
    assert all(t.seen)
    by_hand = lbfgs_by_hand(data, each_gradient=centralize)
    assert differences(everything(*by_hand), everything(t.model, t.optimizers, t.schedulers)) == []


# -- Lightning's opt.step() kept in a port ------------------------------------------------------------------------
def test_an_optimizer_stepped_outside_self_step_with_grad_clip_and_a_scheduler_is_reported():
    """The guide's minimal example (``opt.zero_grad()``, ``self.manual_backward(loss)``, ``opt.step()``) ported
    with ``self.backward`` but ``opt.step()`` kept, with ``grad_clip`` and a per-update scheduler given to the
    Trainer: docs/trainer.md maps ``optimizer.step()`` to ``self.step(name)``, which clips and steps the scheduler;
    the run must say that neither happens (a ``StepError`` or a ``ConfigWarning`` naming ``self.step``)."""
    class KeptStep(Trainer):
        automatic = False

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": decay(opt), "interval": "step"}}

        def training_step(self, batch):
            x, y = batch
            opt = self.optimizers["optimizer"]
            opt.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            self.backward(loss)
            opt.step()
            return loss

    t = KeptStep(model=mlp(), train_data=batches(6), max_steps=6, grad_clip=1e-3, **QUIET)
    said = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t.fit()
        except StepError as err:
            said.append(str(err))
    said += [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any("self.step" in message for message in said), said


# -- README: D(fake) computed before D's step, back-propagated after it ----------------------------------------------
@pytest.mark.parametrize("check", ["auto", "off"])
def test_reusing_d_fake_after_ds_step_on_a_later_step_is_named_and_the_step_undone(check):
    """README "Manual mode: a GAN": re-using the ``D(fake)`` computed before D's step raises
    ``InplaceModificationError`` naming the optimizer, and the step is undone. The mistake comes at step 4 only
    (a branch taken on some batches), after the guard's first checks, and with the guard's checks off (then from
    backward's own error): D's update of that step and its scheduler are put back."""
    from safeloop import InplaceModificationError

    class Reuses(DCGAN):
        def training_step(self, batch):
            if self.state.step + 1 != 4:
                return super().training_step(batch)
            real, z = batch
            g, d = self.model.g, self.model.d
            ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
            fake = g(z)
            d_fake = d(fake)
            err = (F.binary_cross_entropy_with_logits(d(real), ones)
                   + F.binary_cross_entropy_with_logits(d(fake.detach()), zeros))
            self.backward(err, optimizer="d")
            self.step("d")
            self.backward(F.binary_cross_entropy_with_logits(d_fake, ones), optimizer="g")
            self.step("g")
            return err

    t = Reuses(model=GAN(), train_data=gan_batches(6), max_steps=3, guard={"check": check}, **QUIET)
    t.fit()
    before = everything(t.model, t.optimizers, t.schedulers)
    t.max_steps = 6
    with pytest.raises(InplaceModificationError, match="'d'"):
        t.fit()
    assert differences(before, everything(t.model, t.optimizers, t.schedulers)) == []
    assert t.state.step == 3


# -- one forward, two optimizers' backwards, retain_graph forgotten ----------------------------------------------
@pytest.mark.parametrize("check", ["auto", "off"])
def test_two_backwards_through_one_graph_without_retain_graph_say_what_to_fix(check):
    """Simultaneous gradient descent-ascent on one value (a GAN's minimax written as in Lightning's manual
    ``self.manual_backward(loss, retain_graph=True)``, here with ``retain_graph`` forgotten): ``loss`` from one
    forward, ``self.backward(loss, optimizer="d")`` then ``self.backward(-loss, optimizer="g")``. The error must
    say to pass ``retain_graph=True`` to the first, and not send the reader after a tensor made outside the step."""
    from safeloop import DoubleBackwardError

    class Minimax(Trainer):
        automatic = False

        def configure_optimizers(self):
            return {name: torch.optim.SGD(getattr(self.model, name).parameters(), lr=0.05) for name in ("d", "g")}

        def training_step(self, batch):
            real, z = batch
            d, g = self.model.d, self.model.g
            loss = F.softplus(-d(real)).mean() + F.softplus(d(g(z))).mean()
            self.backward(loss, optimizer="d")
            self.backward(-loss, optimizer="g")
            self.step("d")
            self.step("g")
            return loss

    t = Minimax(model=GAN(), train_data=gan_batches(3), max_steps=3, guard={"check": check}, **QUIET)
    with pytest.raises(DoubleBackwardError) as info:
        t.fit()
    message = str(info.value)
    assert "retain_graph=True" in message, message
    assert "outside the step" not in message, message


# -- WGAN-GP: the gradient penalty's double backward inside the critic loop -----------------------------------------
def gradient_penalty(d, real, fake, alpha):
    """igul222/improved_wgan_training via caogang/wgan-gp ``gan_toy.py`` ``calc_gradient_penalty``: the critic's
    input gradient at interpolates, ``autograd.grad(..., create_graph=True, retain_graph=True, only_inputs=True)``,
    ``((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA``."""
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    out = d(interpolates)
    grads = torch.autograd.grad(outputs=out, inputs=interpolates, grad_outputs=torch.ones_like(out),
                                create_graph=True, retain_graph=True, only_inputs=True)[0]
    return ((grads.norm(2, dim=1) - 1) ** 2).mean() * 10


@pytest.mark.filterwarnings("error")
def test_wgan_gp_critic_loop_matches_the_hand_loop_under_the_guards_checks():
    """caogang/wgan-gp ``gan_toy.py``: per generator update, ``CRITIC_ITERS`` critic updates of ``D_real.backward(
    mone)``, ``D_fake.backward(one)`` and ``gradient_penalty.backward()``, the critic's ``requires_grad`` off for
    the generator's turn; Adam(lr=1e-4 there, betas=(0.5, 0.9)). Every step checked by the guard, no warning."""
    class WGANGP(Trainer):
        automatic = False

        def configure_optimizers(self):
            return {name: torch.optim.Adam(getattr(self.model, name).parameters(), lr=1e-3, betas=(0.5, 0.9))
                    for name in ("d", "g")}

        def training_step(self, batch):
            reals, noises, z = batch
            d, g = self.model.d, self.model.g
            for real, noise in zip(reals, noises):
                self.backward(-d(real).mean(), optimizer="d")
                with torch.no_grad():
                    fake = g(noise)
                self.backward(d(fake).mean(), optimizer="d")
                self.backward(gradient_penalty(d, real, fake, torch.rand(len(real), 1)), optimizer="d")
                self.step("d")
            d.requires_grad_(False)
            err_g = -d(g(z)).mean()
            self.backward(err_g, optimizer="g")
            self.step("g")
            d.requires_grad_(True)
            return err_g

    data = wgan_loop_batches(4)
    torch.manual_seed(3)
    t = WGANGP(model=GAN(), train_data=data, max_steps=4, guard={"check": "always"}, **QUIET)
    t.fit()
    torch.manual_seed(3)
    model = GAN()
    opts = {name: torch.optim.Adam(getattr(model, name).parameters(), lr=1e-3, betas=(0.5, 0.9))
            for name in ("d", "g")}
    one, mone = torch.tensor(1.0), torch.tensor(-1.0)
    for reals, noises, z in data:
        for real, noise in zip(reals, noises):
            model.d.zero_grad()
            model.d(real).mean().backward(mone)
            with torch.no_grad():
                fake = model.g(noise)
            model.d(fake).mean().backward(one)
            gradient_penalty(model.d, real, fake, torch.rand(len(real), 1)).backward()
            opts["d"].step()
        model.d.requires_grad_(False)
        model.g.zero_grad()
        model.d(model.g(z)).mean().backward(mone)
        opts["g"].step()
        model.d.requires_grad_(True)
    assert differences(everything(model, opts, {}), everything(t.model, t.optimizers, {})) == []


# -- self.save_checkpoint() in on_fit_start of a resumed run ------------------------------------------------------
class SavesAtFitStart(AccumulateEveryN):
    """Lightning's manual accumulation (N=2) over a model with dropout, so that the random state matters; a
    checkpoint asked in ``on_fit_start`` (docs/checkpoints.md: written at once there)."""

    at_start = False

    def on_fit_start(self):
        if self.at_start:
            self.save_checkpoint()


def dropout_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 1))


def test_a_checkpoint_saved_in_on_fit_start_of_a_resumed_run_resumes_as_the_run_that_never_stopped(tmp_path):
    """A run stopped at step 4 is resumed in a new process (other random state) with ``resume="auto"``; its
    ``on_fit_start`` saves, which writes step 4's file again. Resumed from that file once more, the run trains to
    step 8 as the run that never stopped."""
    data = batches(8)

    def run(directory, steps, at_start=False, **settings):
        t = SavesAtFitStart(model=dropout_mlp(), train_data=data, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            max_steps=steps, seed=1, checkpoint={"dir": str(tmp_path / directory), "keep": 20},
                            **settings, **QUIET)
        t.at_start = at_start
        t.fit()
        return t

    straight = run("straight", 8)
    run("stopped", 4)
    torch.manual_seed(123)  # a new process
    resumed = run("stopped", 8, at_start=True, resume="auto")
    assert differences(everything(straight.model, {}, {}), everything(resumed.model, {}, {})) == []
    torch.manual_seed(456)
    again = run("again", 8, resume=str(tmp_path / "stopped" / "step-000000004.pt"))
    assert differences(everything(straight.model, {}, {}), everything(again.model, {}, {})) == []
