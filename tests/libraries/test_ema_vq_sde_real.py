"""Four libraries whose state moves outside the optimizer, or whose loop is not the user's, run from the same seeds:

- poutyne 1.19.0's ``Model(network, optimizer, loss_function, batch_metrics=[...])``: ``model.fit`` and
  ``model.fit_generator`` run poutyne's loop (``_fit_batch``: ``zero_grad``, forward, the loss, ``backward``,
  ``step``; ``batches_per_step`` accumulates gradients over batches), with a validation under ``no_grad`` each epoch
  and a callback keeping a torch-ema average (updated at ``on_train_batch_end``, evaluated at ``on_epoch_end``);
- torch-ema 0.3's ``ExponentialMovingAverage`` (``update()`` after ``optimizer.step()``, shadow parameters moved in
  place under ``no_grad``; ``with ema.average_parameters():`` to evaluate, and to make a mean teacher's prediction
  between the student's forward and its backward) and ema-pytorch 0.8.3's ``EMA`` (a deep
  copy whose parameters are detached, lerped in place; ``ema(x)`` to evaluate, as its README);
- vector-quantize-pytorch 1.32.0's ``VectorQuantize`` in a VQ-VAE (the EMA codebook moved in place, through
  ``.data``, inside the forward; the commitment loss; the straight-through estimator or the rotation trick; k-means
  initialization and dead codes replaced from the batch), ``ResidualVQ``, ``FSQ``, and a learnable codebook with the
  library's in-place codebook optimizer (a ``loss.backward()`` and an optimizer step inside ``VectorQuantize``'s
  forward);
- torchsde 0.2.6: a small latent SDE (``logqp=True``: the KL to an Ornstein-Uhlenbeck prior) fitted through
  ``sdeint`` (Euler, Ito) and ``sdeint_adjoint`` (reversible Heun, Stratonovich; the adjoint SDE solved in backward,
  ``torch.autograd.grad`` at each of its steps).

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script)
and with a ``safeloop.GraphGuard`` where a user of the library would put one (poutyne: a ``Callback`` opening a step at
``on_train_batch_begin`` and closing it at ``on_train_batch_end``, ``guard.check(loss)`` in the loss function; or only
the loss function's check, with ``GraphGuard(network, optimizer)`` ending a step at each update; the hand loops: ``with
guard.step()``), in every ``check`` mode; the hand loops also as ``safeloop.Trainer``s. Every parameter and buffer
(the EMA shadows, the codebooks), the optimizers' state and what the library records (poutyne's history) must come out
bit for bit the same, with no warning the bare run does not emit.

Then the mistakes users of these libraries make: an EMA's evaluation outputs kept with their graphs, a torch-ema
teacher's prediction made with its graph (stopped under ``check=always`` only), ``ema.update()``
before ``optimizer.step()``, ``with ema.average_parameters():`` left around the training step, ``ema(x)`` trained in
place of the model, a VQ codebook's statistics kept as buffers with their graphs (vector-quantize-pytorch before its
PR #57), an SDE solved once before the loop. Those the guard sees are stopped naming the tensor and the advised fix
trains quiet; those it cannot see (no autograd graph records them) are strict xfails saying why.
"""
import contextlib
import functools
import warnings
from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import GraphGuard, Trainer
from safeloop.errors import (CarriedGraphError, GraphLeakWarning, GraphReuseError, InplaceModificationError,
                             NoGraphError)
from safeloop.watch import Watch
from tests.libraries import compare
from tests.libraries.compare import same
from tests.realworld.harness import checks, strict

try:
    from poutyne import Callback as PoutyneCallback, Model as PoutyneModel
except ImportError:
    PoutyneModel = None
try:
    from torch_ema import ExponentialMovingAverage
except ImportError:
    ExponentialMovingAverage = None
try:
    from ema_pytorch import EMA
except ImportError:
    EMA = None
try:
    from vector_quantize_pytorch import FSQ, ResidualVQ, VectorQuantize
    from vector_quantize_pytorch.vector_quantize_pytorch import Codebook
except ImportError:
    VectorQuantize = None
try:
    import torchsde
except ImportError:
    torchsde = None

needs_poutyne = pytest.mark.skipif(PoutyneModel is None or ExponentialMovingAverage is None,
                                   reason="poutyne and torch-ema are not installed")
needs_torch_ema = pytest.mark.skipif(ExponentialMovingAverage is None, reason="torch-ema is not installed")
needs_ema_pytorch = pytest.mark.skipif(EMA is None, reason="ema-pytorch is not installed")
needs_vq = pytest.mark.skipif(VectorQuantize is None, reason="vector-quantize-pytorch is not installed")
needs_torchsde = pytest.mark.skipif(torchsde is None, reason="torchsde is not installed")


# -- what every case runs -----------------------------------------------------------------------------------------
seed = compare.seed_all
seeded = functools.partial(compare.seeded, seed=seed)
three_runs = functools.partial(compare.three_runs, seed=seed)


def hooks(guard):
    """(step, backward) of a loop: the guard's, or a null context and ``Tensor.backward``."""
    if guard is None:
        return contextlib.nullcontext, torch.Tensor.backward
    return guard.step, guard.backward


def named_guard(check, model, *_):
    """The guard a user makes for a hand loop: ``GraphGuard(model)``, so messages name the model's attributes."""
    return GraphGuard(model, check=check)


def watched(train, *args, check="always", **kwargs):
    """``train(*args, **kwargs)`` under ``Watch`` (this file as the script)."""
    with Watch(GraphGuard(check=check), __file__):
        return train(*args, **kwargs)


def ported(build, hand, make, check, steps):
    """The hand loop ``hand(*build())`` bare, then the ``safeloop.Trainer`` ``make(built, check, steps)`` from the same
    seeds: every parameter and buffer, the optimizer's state and what both record (the hand loop's dict past its
    first two values against the trainer's ``recorded()``) bit for bit the same, with no warning but the hand loop's
    own."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        built = seeded(build)
        start = deepcopy(built[0])
        ref = hand(*built)
    with strict(own):
        trainer = make(seeded(build), check, steps)
        trainer.fit()
    assert trainer.state.step == steps
    model, optimizer = list(ref.values())[:2]
    same(trainer.model, model)
    same(trainer.optimizers["optimizer"].state_dict(), optimizer)
    same(trainer.recorded(), dict(list(ref.items())[2:]))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())), "nothing trained"
    return ref


def classifier():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def labelled(n=48, seed_=3):
    gen = torch.Generator().manual_seed(seed_)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def batches(n=8, size=8):
    x, y = labelled(n * size)
    return list(zip(x.split(size), y.split(size)))


# == poutyne =========================================================================================================
if PoutyneModel is not None:
    class GuardSteps(PoutyneCallback):
        """A ``GraphGuard``'s steps as poutyne's training batches: opened at ``on_train_batch_begin``, closed at
        ``on_train_batch_end`` (validation batches have hooks of their own)."""

        def __init__(self, guard):
            super().__init__()
            self.guard, self.open = guard, contextlib.ExitStack()

        def on_train_batch_begin(self, batch_number, logs):
            self.open.enter_context(self.guard.step())

        def on_train_batch_end(self, batch_number, logs):
            self.open.close()

    class EMAEval(PoutyneCallback):
        """A torch-ema average kept by a callback: updated after each training batch (poutyne's ``_fit_batch`` has
        stepped the optimizer by then), the validation set evaluated with the averaged weights at each epoch's end
        (``model.evaluate`` runs under ``no_grad``)."""

        def __init__(self, network, valid):
            super().__init__()
            self.ema, self.valid, self.evals = ExponentialMovingAverage(network.parameters(), decay=0.9), valid, []

        def on_train_batch_end(self, batch_number, logs):
            self.ema.update()

        def on_epoch_end(self, epoch_number, logs):
            with self.ema.average_parameters():
                self.evals.append(self.model.evaluate(*self.valid, batch_size=16, verbose=False))


def checked_loss(guard, fn=F.cross_entropy):
    """The loss function handed to poutyne, with ``guard.check(loss)`` on training losses (poutyne calls it under
    ``no_grad`` for validation)."""
    def loss_function(y_pred, y_true):
        loss = fn(y_pred, y_true)
        if guard is not None and torch.is_grad_enabled():
            guard.check(loss)
        return loss
    return loss_function


def poutyne_build():
    network = classifier()
    return network, torch.optim.Adam(network.parameters(), lr=0.01)


def poutyne_fit(network, optimizer, guard=None, place="callback", generator=False, batches_per_step=1):
    """``Model(network, optimizer, loss, batch_metrics=["accuracy"])`` fitted for two epochs with a validation set, and
    the ``EMAEval`` callback; ``generator``: ``fit_generator`` over a list of batches (``batches_per_step`` of them
    per update) in place of ``fit``'s shuffling loader. ``place``: ``"callback"`` (``GuardSteps`` and the loss's
    check) or ``"loss"`` (the loss's check only: a guard given the optimizer, ``poutyne_guard``)."""
    model = PoutyneModel(network, optimizer, checked_loss(guard), batch_metrics=["accuracy"])
    x, y = labelled(48)
    valid = labelled(16, seed_=4)
    ema = EMAEval(network, valid)
    callbacks = [ema] + ([GuardSteps(guard)] if guard is not None and place == "callback" else [])
    if generator:
        logs = model.fit_generator(list(zip(x.split(8), y.split(8))), [valid], epochs=2, callbacks=callbacks,
                                   batches_per_step=batches_per_step, verbose=False)
    else:
        logs = model.fit(x, y, validation_data=valid, epochs=2, batch_size=8, callbacks=callbacks, verbose=False)
    history = [{k: v for k, v in row.items() if k != "time"} for row in logs]  # wall time
    return {"network": network, "optimizer": optimizer.state_dict(), "history": history, "shadow": ema.ema.shadow_params,
            "evals": ema.evals}


def poutyne_guard(place):
    """``guard_for`` of ``three_runs``: ``GraphGuard(network, optimizer)`` for the loss's check alone (a step ends at
    each update), ``GraphGuard(network)`` for ``GuardSteps``."""
    def make(check, network, optimizer):
        return GraphGuard(network, optimizer, check=check) if place == "loss" else GraphGuard(network, check=check)
    return make


@needs_poutyne
@pytest.mark.parametrize("place", ["callback", "loss"])
@pytest.mark.parametrize("check", checks())
def test_poutyne_fit_with_an_ema_callback(check, place):
    """``model.fit(x, y, validation_data=..., epochs=2, batch_size=8)``: poutyne's loader shuffles, ``_fit_batch``
    steps Adam every batch, the validation runs under ``no_grad``; the ``EMAEval`` callback's shadow parameters and
    its evaluations with the averaged weights, and poutyne's logged history, bit for bit."""
    ref = three_runs(poutyne_build, lambda *a, guard=None: poutyne_fit(*a, guard=guard, place=place), check,
                     guard_for=poutyne_guard(place))
    assert [row["epoch"] for row in ref["history"]] == [1, 2] and len(ref["evals"]) == 2
    assert all("val_acc" in row for row in ref["history"])


@needs_poutyne
@pytest.mark.parametrize("place", ["callback", "loss"])
@pytest.mark.parametrize("check", checks())
def test_poutyne_fit_generator_accumulating_two_batches_per_step(check, place):
    """``model.fit_generator(batches, valid, batches_per_step=2)``: poutyne zeroes the gradients every other batch,
    back-propagates ``loss * batch_size`` every batch and steps (after dividing the gradients by the examples seen)
    every other one; with ``GuardSteps`` a guarded step is a batch, with the loss's check alone an update."""
    ref = three_runs(poutyne_build, lambda *a, guard=None: poutyne_fit(*a, guard=guard, place=place, generator=True,
                                                                       batches_per_step=2), check,
                     guard_for=poutyne_guard(place))
    assert ref["optimizer"]["state"][0]["step"] == 6  # 6 batches an epoch, 3 updates, 2 epochs


# == torch-ema and ema-pytorch =======================================================================================
def ema_build():
    model = classifier()
    return model, torch.optim.Adam(model.parameters(), lr=0.01), batches(), labelled(16, seed_=4)


def torch_ema_loop(model, optimizer, data, valid, guard=None):
    """torch-ema's README loop: ``ema.update()`` after each ``optimizer.step()``; every third step the validation
    loss under ``with ema.average_parameters():`` and ``torch.no_grad()``."""
    step, backward = hooks(guard)
    ema = ExponentialMovingAverage(model.parameters(), decay=0.9)
    evals = []
    for i, (x, y) in enumerate(data):
        with step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            ema.update()
        if i % 3 == 2:
            model.eval()
            with ema.average_parameters(), torch.no_grad():
                evals.append(F.cross_entropy(model(valid[0]), valid[1]).item())
            model.train()
    return {"model": model, "optimizer": optimizer.state_dict(), "shadow": ema.shadow_params,
            "num_updates": ema.num_updates, "evals": evals}


@needs_torch_ema
@pytest.mark.parametrize("check", checks())
def test_torch_ema_loop(check):
    """The shadow parameters (moved in place under ``no_grad`` by every ``update``), the model (its weights swapped
    for the averages and back through ``.data`` at each evaluation) and the evaluations, bit for bit."""
    ref = three_runs(ema_build, torch_ema_loop, check, guard_for=named_guard)
    assert ref["num_updates"] == 8 and len(ref["evals"]) == 2
    assert not all(torch.equal(s, p) for s, p in zip(ref["shadow"], ref["model"].parameters()))


def ema_pytorch_loop(model, optimizer, data, valid, guard=None, hooked=False):
    """ema-pytorch's README: ``EMA(net, beta, update_after_step, update_every)``, ``ema.update()`` after each update
    (``hooked``: registered as the optimizer's post-step hook, ``ema.add_to_optimizer_post_step_hook``), the
    average evaluated as ``ema(x)`` (its copy's parameters detached: no graph without ``no_grad``)."""
    step, backward = hooks(guard)
    ema = EMA(model, beta=0.9, update_after_step=2, update_every=2)
    if hooked:
        ema.add_to_optimizer_post_step_hook(optimizer)
    evals = []
    for i, (x, y) in enumerate(data):
        with step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            if not hooked:
                ema.update()
        if i % 3 == 2:
            ema.ema_model.eval()
            ema_output = ema(valid[0])
            evals.append(F.cross_entropy(ema_output, valid[1]).item())
            ema.ema_model.train()
    return {"model": model, "optimizer": optimizer.state_dict(), "ema": ema, "evals": evals}


@needs_ema_pytorch
@pytest.mark.parametrize("hooked", [False, True], ids=["update", "post_step_hook"])
@pytest.mark.parametrize("check", checks())
def test_ema_pytorch_loop(check, hooked):
    """The EMA module (its copy's parameters and buffers, BatchNorm's statistics lerped too, its ``step`` and
    ``initted`` buffers) and the evaluations through ``ema(x)``, bit for bit."""
    ref = three_runs(ema_build, lambda *a, guard=None: ema_pytorch_loop(*a, guard=guard, hooked=hooked), check,
                     guard_for=named_guard)
    assert int(ref["ema"].step) == 8 and len(ref["evals"]) == 2
    assert not torch.equal(ref["ema"].ema_model[0].weight, ref["model"][0].weight)


def mean_teacher_loop(model, optimizer, data, valid, guard=None, no_grad=True):
    """A mean teacher with torch-ema (no second model: the teacher's prediction is the student with the averages
    swapped in by ``with ema.average_parameters():``, which writes them through ``.data`` after the student's forward
    saved the weights, and back before the backward), its prediction on a noisy view a consistency target;
    ``no_grad=False``: the mistake, the teacher's forward with its graph."""
    step, backward = hooks(guard)
    ema = ExponentialMovingAverage(model.parameters(), decay=0.9)
    for x, y in data:
        with step():
            optimizer.zero_grad()
            logits = model(x)
            with ema.average_parameters(), torch.no_grad() if no_grad else contextlib.nullcontext():
                teacher = model(x + 0.1 * torch.randn_like(x)).softmax(-1)
            loss = F.cross_entropy(logits, y) + F.kl_div(logits.log_softmax(-1), teacher, reduction="batchmean")
            backward(loss)
            optimizer.step()
            ema.update()
    return {"model": model, "optimizer": optimizer.state_dict(), "shadow": ema.shadow_params}


@needs_torch_ema
@pytest.mark.parametrize("check", checks())
def test_torch_ema_mean_teacher(check):
    """The weights written through ``.data`` and back between the student's forward and its backward (the student's
    graph saved them; their values at the backward are the forward's): quiet in every mode, bit for bit."""
    three_runs(ema_build, mean_teacher_loop, check, guard_for=named_guard)


class EMATrainer(Trainer):
    """torch-ema's loop as a Trainer: ``ema.update()`` at ``on_step_end`` (after the optimizer's step), the
    evaluation every third step there too."""

    @classmethod
    def make(cls, built, check, steps):
        model, _, data, valid = built
        trainer = cls(model=model, train_data=data, max_steps=steps, device="cpu", progress=False, loggers=(),
                      guard={"check": check})
        trainer.valid = valid
        return trainer

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)

    def on_fit_start(self):
        self.ema, self.evals = ExponentialMovingAverage(self.model.parameters(), decay=0.9), []

    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def on_step_end(self, losses):
        self.ema.update()
        if self.state.step % 3 == 0:
            self.model.eval()
            with self.ema.average_parameters(), torch.no_grad():
                self.evals.append(F.cross_entropy(self.model(self.valid[0]), self.valid[1]).item())
            self.model.train()

    def recorded(self):
        return {"shadow": self.ema.shadow_params, "num_updates": self.ema.num_updates, "evals": self.evals}


@needs_torch_ema
@pytest.mark.parametrize("check", checks())
def test_torch_ema_loop_as_a_trainer(check):
    """The torch-ema loop ported: the same model, optimizer state, shadow parameters and evaluations."""
    ported(ema_build, torch_ema_loop, EMATrainer.make, check, steps=8)


# == vector-quantize-pytorch =========================================================================================
VQ_KINDS = {
    "straight_through": lambda: VectorQuantize(dim=4, codebook_size=8, decay=0.8, commitment_weight=0.25,
                                               rotation_trick=False),
    "rotation_kmeans_dead_codes": lambda: VectorQuantize(dim=4, codebook_size=8, decay=0.8, commitment_weight=0.25,
                                                         kmeans_init=True, kmeans_iters=3, threshold_ema_dead_code=2),
    "cosine_heads": lambda: VectorQuantize(dim=4, codebook_size=8, heads=2, separate_codebook_per_head=True,
                                           codebook_dim=3, use_cosine_sim=True, commitment_weight=0.25),
    "residual": lambda: ResidualVQ(dim=4, num_quantizers=2, codebook_size=8, decay=0.8, commitment_weight=0.25),
    "fsq": lambda: FSQ(levels=[5, 3], dim=4),
    "affine_learnable": lambda: VectorQuantize(dim=4, codebook_size=8, affine_param=True, learnable_codebook=True,
                                               ema_update=False),
    "inplace_optimizer": lambda: VectorQuantize(
        dim=4, codebook_size=8, learnable_codebook=True, ema_update=False,
        in_place_codebook_optimizer=lambda params: torch.optim.SGD(params, lr=1.0)),
}


class VQVAE(nn.Module):
    """A VQ-VAE on sequences: an encoder, the quantizer, a decoder; ``forward`` returns the reconstruction and the
    quantizer's auxiliary loss (the commitment loss; zero for ``FSQ``, which has none)."""

    def __init__(self, kind):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
        self.vq = VQ_KINDS[kind]()
        self.dec = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, x):
        out = self.vq(self.enc(x))
        quantized, aux = (out[0], out[2].sum()) if len(out) == 3 else (out[0], x.new_zeros(()))
        return self.dec(quantized), aux


def sequences(n=6):
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(4, 5, 6, generator=gen) for _ in range(n)]


def vq_build(kind="straight_through"):
    model = VQVAE(kind)
    return model, torch.optim.Adam(model.parameters(), lr=0.01), sequences()


def vq_loop(model, optimizer, data, guard=None):
    """The VQ-VAE loop of vector-quantize-pytorch's README: the quantizer's loss added to the reconstruction's."""
    step, backward = hooks(guard)
    losses = []
    for x in data:
        with step():
            optimizer.zero_grad()
            recon, aux = model(x)
            loss = F.mse_loss(recon, x) + aux
            backward(loss)
            optimizer.step()
            losses.append(loss.item())
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses}


@needs_vq
@pytest.mark.parametrize("kind", list(VQ_KINDS))
@pytest.mark.parametrize("check", checks())
def test_vq_vae_loop(check, kind):
    """Every parameter and buffer (the codebook, ``embed_avg`` and ``cluster_size`` moved in place through ``.data``
    inside the forward, after the forward's graph saved the codebook; the affine statistics re-registered as buffers
    every step; the in-place optimizer's codebook, updated by a backward and a step inside the forward), the
    optimizer's state and the losses, bit for bit."""
    start = seeded(lambda: vq_build(kind))[0]
    ref = three_runs(lambda: vq_build(kind), vq_loop, check, guard_for=named_guard)
    if kind != "fsq":
        before = dict(start.named_buffers())  # the affine statistics start as None
        moved = [name for name, b in ref["model"].named_buffers()
                 if before.get(name) is None or not torch.equal(b, before[name])]
        moved += [name for name, p in ref["model"].vq.named_parameters()
                  if not torch.equal(p, start.get_parameter("vq." + name))]
        assert moved, "the codebook did not move"


class VQTrainer(Trainer):
    """The VQ-VAE loop as a Trainer: ``training_step`` returns the reconstruction loss plus the quantizer's."""

    @classmethod
    def make(cls, built, check, steps):
        return cls(model=built[0], train_data=built[2], max_steps=steps, device="cpu", progress=False, loggers=(),
                   guard={"check": check})

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)

    def on_fit_start(self):
        self.losses = []

    def training_step(self, x):
        recon, aux = self.model(x)
        return F.mse_loss(recon, x) + aux

    def on_step_end(self, losses):
        self.losses.append(losses["loss"].item())

    def recorded(self):
        return {"losses": self.losses}


@needs_vq
@pytest.mark.parametrize("kind", ["straight_through", "rotation_kmeans_dead_codes", "residual", "inplace_optimizer"])
@pytest.mark.parametrize("check", checks())
def test_vq_vae_loop_as_a_trainer(check, kind):
    """The VQ-VAE loop ported: the same codebooks, model, optimizer state and losses."""
    ported(lambda: vq_build(kind), vq_loop, VQTrainer.make, check, steps=6)


# == torchsde ========================================================================================================
BATCH, STATE = 8, 2


class LatentSDE(nn.Module):
    """A latent SDE in the way of torchsde's examples/latent_sde.py: a learned posterior drift ``f``, a prior drift
    ``h`` (Ornstein-Uhlenbeck, learned rate), a learned diagonal diffusion ``g``; ``logqp=True`` integrates the KL
    between them along the path."""
    noise_type = "diagonal"

    def __init__(self, sde_type="ito"):
        super().__init__()
        self.sde_type = sde_type
        self.drift = nn.Sequential(nn.Linear(STATE + 1, 16), nn.Tanh(), nn.Linear(16, STATE))
        self.theta = nn.Parameter(torch.tensor(0.5))
        self.diffusion = nn.Sequential(nn.Linear(STATE, STATE), nn.Sigmoid())

    def f(self, t, y):
        return self.drift(torch.cat([y, t.expand(y.shape[0], 1)], dim=1))

    def h(self, t, y):
        return -self.theta * y

    def g(self, t, y):
        return 0.2 * self.diffusion(y)


def sde_build(sde_type="ito"):
    sde = LatentSDE(sde_type)
    return sde, torch.optim.Adam(sde.parameters(), lr=0.01)


TS = torch.linspace(0., 1., 6)
TARGET = torch.stack([torch.exp(-TS) * 1.5, torch.sin(3 * TS)], dim=1)  # (T, STATE): the means to fit


def solve(sde, y0, adjoint):
    """``sdeint`` (Euler) or ``sdeint_adjoint`` (reversible Heun and its adjoint), ``logqp=True``; the Brownian motion
    torchsde makes (its entropy drawn from NumPy's global generator)."""
    if adjoint:
        return torchsde.sdeint_adjoint(sde, y0, TS, dt=0.1, method="reversible_heun",
                                       adjoint_method="adjoint_reversible_heun", logqp=True)
    return torchsde.sdeint(sde, y0, TS, dt=0.1, method="euler", logqp=True)


def sde_loop(sde, optimizer, guard=None, adjoint=False, niters=4):
    """Fit the path's mean to ``TARGET``, the KL to the prior weighted in (an ELBO's two terms)."""
    step, backward = hooks(guard)
    losses = []
    y0 = torch.full((BATCH, STATE), 0.5)
    for _ in range(niters):
        with step():
            optimizer.zero_grad()
            ys, log_ratio = solve(sde, y0, adjoint)
            loss = F.mse_loss(ys.mean(1), TARGET) + 0.1 * log_ratio.sum(0).mean()
            backward(loss)
            optimizer.step()
            losses.append(loss.item())
    return {"sde": sde, "optimizer": optimizer.state_dict(), "losses": losses}


@needs_torchsde
@pytest.mark.parametrize("adjoint", [False, True], ids=["sdeint", "sdeint_adjoint"])
@pytest.mark.parametrize("check", checks())
def test_latent_sde(check, adjoint):
    """A latent SDE fitted through ``sdeint`` (back-propagated through Euler's steps) or ``sdeint_adjoint`` (the
    adjoint SDE solved backwards in the guarded backward): the parameters, Adam's state and the losses, bit for
    bit."""
    build = functools.partial(sde_build, "stratonovich" if adjoint else "ito")
    three_runs(build, lambda *a, guard=None: sde_loop(*a, guard=guard, adjoint=adjoint), check, guard_for=named_guard)


class SDETrainer(Trainer):
    """The latent SDE's loop as a Trainer (a batch is the initial state)."""
    adjoint = False

    @classmethod
    def make(cls, built, check, steps):
        return cls(model=built[0], train_data=[torch.full((BATCH, STATE), 0.5)] * steps, max_steps=steps,
                   device="cpu", progress=False, loggers=(), guard={"check": check})

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=0.01)

    def on_fit_start(self):
        self.losses = []

    def training_step(self, y0):
        ys, log_ratio = solve(self.model, y0, self.adjoint)
        return F.mse_loss(ys.mean(1), TARGET) + 0.1 * log_ratio.sum(0).mean()

    def on_step_end(self, losses):
        self.losses.append(losses["loss"].item())

    def recorded(self):
        return {"losses": self.losses}


class SDEAdjointTrainer(SDETrainer):
    adjoint = True


@needs_torchsde
@pytest.mark.parametrize("port", [SDETrainer, SDEAdjointTrainer], ids=["sdeint", "sdeint_adjoint"])
@pytest.mark.parametrize("check", checks())
def test_latent_sde_as_a_trainer(check, port):
    """The latent SDE's loop ported: the same parameters, optimizer state and losses."""
    build = functools.partial(sde_build, "stratonovich" if port.adjoint else "ito")
    ported(build, functools.partial(sde_loop, adjoint=port.adjoint), port.make, check, steps=4)


# -- the mistakes ----------------------------------------------------------------------------------------------------
class PriorNet(nn.Module):
    """A classifier adding a label prior computed once in ``__init__`` from its own layers (the mistake that shows
    whether a guard placement sees poutyne's steps at all); ``fix``: the prior made under ``torch.no_grad()``."""

    def __init__(self, fix=False):
        super().__init__()
        self.net = classifier()
        with torch.no_grad() if fix else contextlib.nullcontext():
            self.prior = self.net(torch.randn(5, 6)).log_softmax(-1).mean(0)

    def forward(self, x):
        return self.net(x) + self.prior


def prior_build(fix=False):
    network = PriorNet(fix)
    return network, torch.optim.Adam(network.parameters(), lr=0.01)


@needs_poutyne
@pytest.mark.parametrize("place", ["callback", "loss", "watch"])
def test_poutyne_network_prior_built_in_init_is_stopped_at_the_first_step(place):
    """A graph built in the network's ``__init__`` and reached by every batch's loss: stopped at poutyne's first
    batch, before any update, naming ``network.prior`` (``model.prior`` with a ``GraphGuard(network)``), from either placement of the guard and under ``watch``; built
    under ``torch.no_grad()``, as advised, poutyne's fit is quiet and bit for bit alike."""
    network, optimizer = seeded(prior_build)
    start = deepcopy(dict(network.named_parameters()))
    pattern = r"step 1, .*held by `(model|network)\.prior`.*`\1\.prior\.detach\(\)` instead, or compute it " \
              r"under `torch\.no_grad\(\)`"
    with pytest.raises(GraphReuseError, match=pattern):
        if place == "watch":
            watched(poutyne_fit, network, optimizer)
        else:
            poutyne_fit(network, optimizer, guard=poutyne_guard(place)("always", network, optimizer), place=place)
    same(dict(network.named_parameters()), start)  # BatchNorm's statistics moved in the forward
    three_runs(functools.partial(prior_build, True), lambda *a, guard=None: poutyne_fit(*a, guard=guard), "always",
               guard_for=poutyne_guard("callback"))


def ema_eval_kept(model, optimizer, data, valid, guard=None, fix=False):
    """torch-ema's loop with the evaluation's outputs kept for a metric at the end, computed under
    ``with ema.average_parameters():`` without ``torch.no_grad()`` (the mistake: each keeps a graph of the model),
    or under it (``fix``)."""
    step, backward = hooks(guard)
    ema = ExponentialMovingAverage(model.parameters(), decay=0.9)
    outputs = []
    for x, y in data:
        with step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            ema.update()
        model.eval()
        with ema.average_parameters(), torch.no_grad() if fix else contextlib.nullcontext():
            outputs.append(model(valid[0]))
        model.train()
    accuracy = torch.cat(outputs).argmax(-1).eq(valid[1].repeat(len(outputs))).float().mean().item()
    return {"model": model, "optimizer": optimizer.state_dict(), "shadow": ema.shadow_params, "accuracy": accuracy,
            "graphs": sum(out.grad_fn is not None for out in outputs)}


@needs_torch_ema
def test_ema_evaluation_outputs_kept_with_their_graphs_and_the_no_grad_fix():
    """Bare, every kept output holds a graph of the model (the saved activations of 8 forwards stay alive); under
    ``torch.no_grad()`` none does, and the loop trains quiet and bit for bit alike bare, watched and guarded."""
    assert ema_eval_kept(*seeded(ema_build))["graphs"] == 8
    ref = three_runs(ema_build, lambda *a, guard=None: ema_eval_kept(*a, guard=guard, fix=True), "always",
                     guard_for=named_guard)
    assert ref["graphs"] == 0


@needs_torch_ema
@pytest.mark.parametrize("place", ["guard", "watch"])
def test_ema_evaluation_outputs_kept_with_their_graphs_are_warned(place):
    """The kept outputs: a ``GraphLeakWarning`` naming ``outputs``, with a ``GraphGuard`` and under ``watch``."""
    with pytest.warns(GraphLeakWarning, match=r"the tensors added to `outputs` keep their autograd graphs"):
        built = seeded(ema_build)
        watched(ema_eval_kept, *built) if place == "watch" else ema_eval_kept(*built, guard=named_guard("always",
                                                                                                         *built))


def ema_updated_before_step(model, optimizer, data, valid, guard=None):
    """torch-ema's loop with ``ema.update()`` before ``optimizer.step()``: each update averages the weights of the
    step before, so the average lags one update and never sees the last."""
    step, backward = hooks(guard)
    ema = ExponentialMovingAverage(model.parameters(), decay=0.9)
    for x, y in data:
        with step():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            ema.update()
            optimizer.step()
    return {"model": model, "optimizer": optimizer.state_dict(), "shadow": ema.shadow_params}


@needs_torch_ema
def test_ema_updated_before_the_step_lags_and_trains_quiet():
    """The lag is real (the shadows differ from the README order's), yet nothing in any graph records it: the loop
    trains bit for bit alike bare, watched and guarded, with no warning (the test below wants one)."""
    ref = three_runs(ema_build, ema_updated_before_step, "always", guard_for=named_guard)
    right = torch_ema_loop(*seeded(ema_build))
    same(ref["model"], right["model"])
    assert not all(torch.equal(a, b) for a, b in zip(ref["shadow"], right["shadow"]))


@needs_torch_ema
@pytest.mark.xfail(strict=True, reason="not a graph mistake: `update()` reads the parameters under no_grad before "
                   "the optimizer writes them; no graph, saved tensor or version counter differs from the right "
                   "order, so no check of the guard can tell them apart")
def test_ema_updated_before_the_step_is_warned():
    """``ema.update()`` before ``optimizer.step()``: a warning naming ``ema.update``."""
    with pytest.warns(UserWarning, match=r"ema\.update"):
        watched(ema_updated_before_step, *seeded(ema_build))


def ema_averaged_training(model, optimizer, data, valid, guard=None):
    """torch-ema's ``with ema.average_parameters():`` left around the training step (meant for the evaluation): each
    step trains from the averaged weights, and leaving the block restores the weights stored on entering it, so every
    update is thrown away; only the shadows (and Adam's moments) move."""
    step, backward = hooks(guard)
    ema = ExponentialMovingAverage(model.parameters(), decay=0.9)
    for x, y in data:
        with step(), ema.average_parameters():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            backward(loss)
            optimizer.step()
            ema.update()
    return {"model": model, "optimizer": optimizer.state_dict(), "shadow": ema.shadow_params}


@needs_torch_ema
def test_ema_average_parameters_around_the_training_step_trains_nothing_quietly():
    """Bare, the model's parameters end as they started (BatchNorm's statistics, not restored, move); the guard,
    watching or in the loop, stays quiet and changes nothing (the test below wants a warning)."""
    built = seeded(ema_build)
    start = deepcopy(built[0])
    ref = ema_averaged_training(*built)
    same(dict(ref["model"].named_parameters()), dict(start.named_parameters()))
    for run in (lambda b: watched(ema_averaged_training, *b),
                lambda b: ema_averaged_training(*b, guard=named_guard("always", *b))):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            same(run(seeded(ema_build)), ref)


@needs_torch_ema
@pytest.mark.xfail(strict=True, reason="not seen: `restore()` writes the stored weights back through `.data` after "
                   "the step's backward and update, where no graph saved them; the guard's fingerprints look only for "
                   "a `.data` write between a forward and its backward, and nothing checks that an update survives")
def test_ema_average_parameters_around_the_training_step_is_warned():
    """Training inside ``with ema.average_parameters():``: a warning that the update is undone."""
    with pytest.warns(UserWarning, match=r"average_parameters|restore"):
        watched(ema_averaged_training, *seeded(ema_build))


def ema_copy_trained(model, optimizer, data, valid, guard=None):
    """ema-pytorch's ``ema(x)`` used for the training loss in place of ``model(x)``: the copy's parameters are
    detached (``p.detach_()`` in ``init_ema``), so the loss has no graph."""
    step, backward = hooks(guard)
    ema = EMA(model, beta=0.9, update_after_step=2, update_every=2)
    for x, y in data:
        with step():
            optimizer.zero_grad()
            loss = F.cross_entropy(ema(x), y)
            backward(loss)
            optimizer.step()
            ema.update()
    return {"model": model}


@needs_ema_pytorch
@pytest.mark.parametrize("place", ["guard", "watch"])
def test_ema_pytorch_copy_trained_in_place_of_the_model_is_stopped(place):
    """``loss = F.cross_entropy(ema(x), y)``: bare, PyTorch's "does not require grad"; with a ``GraphGuard`` and under
    ``watch``, a ``NoGraphError`` at step 1 before any update, advising the model's output; the fix, ``model(x)``, is
    the README loop above. With no graph to follow, the message cannot name ``ema``: it names the loss."""
    with pytest.raises(RuntimeError, match="does not require grad"):
        ema_copy_trained(*seeded(ema_build))
    built = seeded(ema_build)
    start = deepcopy(built[0])
    with pytest.raises(NoGraphError, match=r"step 1, .*does not depend on any tensor that requires grad.*To fix: make "
                                           r"sure the loss is computed from the model's output inside the loop"):
        watched(ema_copy_trained, *built) if place == "watch" else \
            ema_copy_trained(*built, guard=named_guard("always", *built))
    same(built[0], start)


@needs_torch_ema
@pytest.mark.parametrize("place", ["guard", "watch"])
def test_torch_ema_teacher_with_its_graph_is_stopped_under_check_always(place):
    """The teacher's forward without ``torch.no_grad()``: its graph saved the weights holding the averages, which
    ``average_parameters()`` then wrote back to the student's through ``.data``; bare, the backward silently runs
    through the teacher with the student's weights. Under ``check=always``, an ``InplaceModificationError`` at step 2
    (at step 1 the averages are the weights), before its backward, naming the weights and advising the teacher's
    ``torch.no_grad()``; that fix is the loop above, quiet in every mode."""
    built = seeded(ema_build)
    kept = []
    built[1].register_step_post_hook(lambda *_: kept.append(deepcopy(dict(built[0].named_parameters()))))
    with pytest.raises(InplaceModificationError, match=r"step 2, .*whose graph saved `(model|local model)\.\d\.weight`"
                                                       r".*a teacher's prediction.*compute it under "
                                                       r"torch\.no_grad\(\) or detach it"):
        watched(mean_teacher_loop, *built, no_grad=False) if place == "watch" else \
            mean_teacher_loop(*built, guard=named_guard("always", *built), no_grad=False)
    assert len(kept) == 1
    same(dict(built[0].named_parameters()), kept[0])


def pre_57_update_with_decay(self, buffer_name, new_value, decay):
    """``Codebook.update_with_decay`` as vector-quantize-pytorch had it before its PR #57 ("detach buffer before
    registering"): the affine statistics re-registered as buffers with their graphs, each made from the last."""
    old_value = getattr(self, buffer_name)
    needs_init = getattr(self, buffer_name + "_needs_init", False)
    if needs_init:
        self.register_buffer(buffer_name + "_needs_init", torch.tensor(False))
    if old_value is None or needs_init:
        self.register_buffer(buffer_name, new_value)
        return
    self.register_buffer(buffer_name, old_value * decay + new_value * (1 - decay))


AFFINE = ("batch_mean", "batch_variance", "codebook_mean", "codebook_variance")


def vq_detaching_loop(model, optimizer, data, guard=None):
    """``vq_loop`` with the error's fix, written for each statistic it names in turn: ``model.vq._codebook.batch_mean
    = model.vq._codebook.batch_mean.detach()`` at the end of each step."""
    step, backward = hooks(guard)
    losses = []
    for x in data:
        with step():
            optimizer.zero_grad()
            recon, aux = model(x)
            loss = F.mse_loss(recon, x) + aux
            backward(loss)
            optimizer.step()
            losses.append(loss.item())
            for name in AFFINE:
                setattr(model.vq._codebook, name, getattr(model.vq._codebook, name).detach())
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses}


@needs_vq
@pytest.mark.parametrize("place", ["guard", "watch"])
def test_vq_affine_statistics_kept_with_their_graphs_are_stopped(place, monkeypatch):
    """PR #57's bug (``affine_param=True`` with a learnable codebook): bare, the second backward fails inside torch
    ("backward through the graph a second time", through the statistics the first step registered); with a
    ``GraphGuard`` and under ``watch``, a ``CarriedGraphError`` at step 2, before its backward, naming the buffer
    (``model.vq._codebook.batch_mean``) and advising its detach at the end of each step; that detach, for each
    statistic, trains quiet and bit for bit alike bare, watched and guarded."""
    monkeypatch.setattr(Codebook, "update_with_decay", pre_57_update_with_decay)
    build = functools.partial(vq_build, "affine_learnable")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        vq_loop(*seeded(build))
    built = seeded(build)
    kept = []
    built[1].register_step_post_hook(lambda *_: kept.append(deepcopy(built[0].state_dict())))
    with pytest.raises(CarriedGraphError, match=r"step 2, .*held by `model\.vq\._codebook\.(batch|codebook)_(mean|"
                                                r"variance)`.*To fix: detach the carried state at the end of each step "
                                                r"\(`model\.vq\._codebook\.\1_\2 = model\.vq\._codebook\.\1_\2\."
                                                r"detach\(\)`\)"):
        watched(vq_loop, *built) if place == "watch" else vq_loop(*built, guard=named_guard("always", *built))
    assert len(kept) == 1
    same(dict(built[0].named_parameters()), {k: kept[0][k] for k, _ in built[0].named_parameters()})
    three_runs(build, vq_detaching_loop, "always", guard_for=named_guard)


def sde_solved_once(sde, optimizer, guard=None, adjoint=False, niters=4):
    """``sde_loop`` with the SDE solved once before the loop (a fixed initial state: why solve it again?): every step
    back-propagates the same solution."""
    step, backward = hooks(guard)
    ys, log_ratio = solve(sde, torch.full((BATCH, STATE), 0.5), adjoint)
    for _ in range(niters):
        with step():
            optimizer.zero_grad()
            loss = F.mse_loss(ys.mean(1), TARGET) + 0.1 * log_ratio.sum(0).mean()
            backward(loss)
            optimizer.step()
    return {"sde": sde}


@needs_torchsde
@pytest.mark.parametrize("place", ["guard", "watch"])
@pytest.mark.parametrize("adjoint", [False, True], ids=["sdeint", "sdeint_adjoint"])
def test_sde_solution_reused_from_before_the_loop_is_stopped(adjoint, place):
    """Bare, the second backward fails inside torch (through Euler's steps, or the adjoint's ``Function``, whose
    saved tensors the first freed); with a ``GraphGuard`` and under ``watch``, a ``GraphReuseError`` at step 1,
    before any gradient or update, naming ``ys`` or ``log_ratio`` and advising to compute it inside the loop: the fix
    is ``sde_loop``, which trains quiet (test above)."""
    build = functools.partial(sde_build, "stratonovich" if adjoint else "ito")
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        sde_solved_once(*seeded(build), adjoint=adjoint)
    built = seeded(build)
    start = deepcopy(built[0])
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `(local )?(ys|log_ratio)`.*To fix: recompute "
                                              r"`\2` inside the loop"):
        watched(sde_solved_once, *built, adjoint=adjoint) if place == "watch" else \
            sde_solved_once(*built, guard=named_guard("always", *built), adjoint=adjoint)
    same(built[0], start)
    assert all(p.grad is None for p in built[0].parameters())
