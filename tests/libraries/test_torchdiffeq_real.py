"""torchdiffeq 0.2.5's neural ODEs, trained as its examples (rtqichen/torchdiffeq at commit 657943a,
``examples/ode_demo.py``, ``examples/odenet_mnist.py``, ``examples/latent_ode.py``, ``examples/learn_physics.py``)
train them. ``odeint`` back-propagates through the solver's steps; ``odeint_adjoint`` (``--adjoint``) solves the
ODE under ``no_grad`` in the forward of an autograd ``Function`` (``OdeintAdjointMethod``) and, in its backward,
solves the adjoint ODE backwards in time, calling ``torch.autograd.grad`` under ``torch.enable_grad()`` on a fresh
graph of the ODE function at every solver stage: autograd run inside the guarded backward, on graphs made there.

Each loop runs three ways from the same seeds (torch's and NumPy's global generators, which the examples draw
from): bare; under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script);
and with a ``safeloop.GraphGuard`` (``with guard.step()`` around an iteration, ``guard.backward(loss)``). Then ported
to ``safeloop.Trainer``. Every parameter and buffer, the optimizer's state and what the loop records (losses, the
function evaluation counts odenet_mnist keeps on its module) must come out bit for bit the same in every guard
mode, with no warning the bare run does not emit itself.

Then the mistakes a torchdiffeq user makes (the latent ODE's encoder hoisted out of the loop because the data is
one fixed batch, a trajectory continued from the last step's solution without ``.detach()``, an initial state put
together from parameters once in ``__init__``): each is stopped before the update it would corrupt, naming the
tensor, and the fix the message advises, written into the same loop, runs quiet and right.

Changes for a seconds-long test: tiny sizes, a few iterations, ``rtol=1e-3, atol=1e-4`` for the training solves of
ode_demo (its source leaves torchdiffeq's ``1e-7``/``1e-9``) and ``t`` over [0, 5] at 200 points (its spacing: the
source's 1000 over [0, 25]); odenet_mnist's ``--tol`` 1e-2 (its default: 1e-3); random tensors for MNIST; plotting
and logging left out.
"""
import contextlib
import functools
import math
import re
import warnings
from copy import deepcopy

import numpy as np
import numpy.random as npr
import pytest
import torch
import torch.nn as nn
import torch.optim as optim

LIB = pytest.importorskip("torchdiffeq")

from torchdiffeq import odeint as plain_odeint  # noqa: E402
from torchdiffeq import odeint_adjoint  # noqa: E402

from safeloop import GraphGuard, Trainer  # noqa: E402
from safeloop.errors import CarriedGraphError, GraphReuseError, GraphSharingWarning  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries import compare  # noqa: E402
from tests.libraries.compare import same  # noqa: E402
from tests.realworld.harness import CHECKS, checks, strict  # noqa: E402

RTOL, ATOL = 1e-3, 1e-4


# -- what every case runs -----------------------------------------------------------------------------------------


seed = compare.seed_all
seeded = functools.partial(compare.seeded, seed=seed)
three_runs = functools.partial(compare.three_runs, seed=seed)


def ported(build, hand, port, check, steps, **settings):
    """The hand-written loop ``hand(*build())`` bare, then ``port`` (a ``safeloop.Trainer`` subclass, built by
    ``port.make(built, check, steps, **settings)``) from the same seeds: every parameter and buffer, the optimizer's
    state and what each records (``port.recorded(trainer)`` against the hand loop's dict past its first two
    values) bit for bit the same, with no warning but the hand loop's own. Returns the hand loop's result."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        built = seeded(build)
        start = deepcopy(built[0])
        ref = hand(*built)
    with strict(own):
        trainer = port.make(seeded(build), check, steps, **settings)
        trainer.fit()
    assert trainer.state.step == steps
    model, optimizer = list(ref.values())[:2]
    same(trainer.model, model)
    same(trainer.optimizers["optimizer"].state_dict(), optimizer)
    same(port.recorded(trainer), dict(list(ref.items())[2:]))
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())), "nothing trained"
    return ref


def hooks(guard):
    """(step, backward) of a loop: the guard's, or a null context and ``Tensor.backward``."""
    if guard is None:
        return contextlib.nullcontext, torch.Tensor.backward
    return guard.step, guard.backward


def watched(train, *args, check="always", **kwargs):
    """``train(*args, **kwargs)`` under ``Watch`` (this file as the script)."""
    with Watch(GraphGuard(check=check), train.__code__.co_filename):
        return train(*args, **kwargs)


# -- examples/ode_demo.py -----------------------------------------------------------------------------------------
DATA_SIZE, BATCH_TIME, BATCH_SIZE, TEST_FREQ = 200, 10, 20, 3
true_y0 = torch.tensor([[2., 0.]])
t = torch.linspace(0., 5., DATA_SIZE)
true_A = torch.tensor([[-0.1, 2.0], [-2.0, -0.1]])


class Lambda(nn.Module):

    def forward(self, t, y):
        return torch.mm(y**3, true_A)


@functools.cache
def spiral():
    """``true_y`` as ode_demo.py computes it at module level, once for the module's tests."""
    with torch.no_grad():
        return plain_odeint(Lambda(), true_y0, t, method='dopri5')


def get_batch():
    true_y = spiral()
    s = torch.from_numpy(np.random.choice(np.arange(DATA_SIZE - BATCH_TIME, dtype=np.int64), BATCH_SIZE,
                                          replace=False))
    batch_y0 = true_y[s]  # (M, D)
    batch_t = t[:BATCH_TIME]  # (T)
    batch_y = torch.stack([true_y[s + i] for i in range(BATCH_TIME)], dim=0)  # (T, M, D)
    return batch_y0, batch_t, batch_y


class ODEFunc(nn.Module):

    def __init__(self):
        super(ODEFunc, self).__init__()

        self.net = nn.Sequential(
            nn.Linear(2, 50),
            nn.Tanh(),
            nn.Linear(50, 2),
        )

        for m in self.net.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0, std=0.1)
                nn.init.constant_(m.bias, val=0)

    def forward(self, t, y):
        return self.net(y**3)


class RunningAverageMeter(object):
    """Computes and stores the average and current value"""

    def __init__(self, momentum=0.99):
        self.momentum = momentum
        self.reset()

    def reset(self):
        self.val = None
        self.avg = 0

    def update(self, val):
        if self.val is None:
            self.avg = val
        else:
            self.avg = self.avg * self.momentum + val * (1 - self.momentum)
        self.val = val


def demo_build():
    func = ODEFunc()
    return func, optim.RMSprop(func.parameters(), lr=1e-3)


def ode_demo(func, optimizer, guard=None, adjoint=False, niters=5):
    """ode_demo.py's ``__main__``: ``odeint`` is ``odeint_adjoint`` under ``--adjoint``; every ``TEST_FREQ``
    iterations the whole trajectory is solved under ``no_grad``."""
    odeint = odeint_adjoint if adjoint else plain_odeint
    step, backward = hooks(guard)
    loss_meter = RunningAverageMeter(0.97)
    tested = []
    for itr in range(1, niters + 1):
        with step():
            optimizer.zero_grad()
            batch_y0, batch_t, batch_y = get_batch()
            pred_y = odeint(func, batch_y0, batch_t, rtol=RTOL, atol=ATOL)
            loss = torch.mean(torch.abs(pred_y - batch_y))
            backward(loss)
            optimizer.step()
            loss_meter.update(loss.item())

        if itr % TEST_FREQ == 0:
            with torch.no_grad():
                pred_y = odeint(func, true_y0, t, rtol=RTOL, atol=ATOL)
                loss = torch.mean(torch.abs(pred_y - spiral()))
                tested.append(loss.item())
    return {"func": func, "optimizer": optimizer.state_dict(), "avg": loss_meter.avg, "tested": tested}


@pytest.mark.parametrize("adjoint", [False, True], ids=["odeint", "odeint_adjoint"])
@pytest.mark.parametrize("check", checks())
def test_ode_demo(check, adjoint):
    """examples/ode_demo.py: an MLP vector field fitted to batches of a spiral's trajectory with RMSprop, through
    ``odeint`` (back-propagated through dopri5's steps) or ``odeint_adjoint`` (the adjoint ODE solved in backward,
    ``autograd.grad`` at each of its stages), with the ``no_grad`` test solve every third iteration."""
    ref = three_runs(demo_build, lambda *a, guard=None: ode_demo(*a, guard=guard, adjoint=adjoint), check)
    assert len(ref["tested"]) == 1 and math.isfinite(ref["avg"])


# -- the same loops as safeloop.Trainer subclasses ----------------------------------------------------------------
class Port(Trainer):
    """What the ports share: built from what the hand loop's ``build`` made, recording nothing but the loss."""

    @classmethod
    def make(cls, built, check, steps, **settings):
        model = built[0]  # the optimizer comes from configure_optimizers, as the example makes it
        return cls(model=model, train_data=cls.data(built, steps), max_steps=steps, device="cpu", progress=False,
                   loggers=(), guard={"check": check}, **settings)

    def on_fit_start(self):
        self.loss_meter = RunningAverageMeter(0.97)

    def on_step_end(self, losses):
        self.loss_meter.update(losses["loss"].item())

    @staticmethod
    def recorded(trainer):
        return {"avg": trainer.loss_meter.avg}


class ODEDemo(Port):
    """ode_demo.py's iteration as ``training_step``: the batch drawn by ``get_batch`` (the data), the solve and
    the loss in the step; RMSprop from ``configure_optimizers``."""
    adjoint = False

    @staticmethod
    def data(built, steps):
        return [get_batch() for _ in range(steps)]

    def configure_optimizers(self):
        return optim.RMSprop(self.model.parameters(), lr=1e-3)

    def training_step(self, batch):
        odeint = odeint_adjoint if self.adjoint else plain_odeint
        batch_y0, batch_t, batch_y = batch
        pred_y = odeint(self.model, batch_y0, batch_t, rtol=RTOL, atol=ATOL)
        return torch.mean(torch.abs(pred_y - batch_y))


class ODEDemoAdjoint(ODEDemo):
    adjoint = True


def demo_hand(func, optimizer, adjoint=False, niters=5):
    out = ode_demo(func, optimizer, adjoint=adjoint, niters=niters)
    return {"func": out["func"], "optimizer": out["optimizer"], "avg": out["avg"]}


@pytest.mark.parametrize("port", [ODEDemo, ODEDemoAdjoint], ids=["odeint", "odeint_adjoint"])
@pytest.mark.parametrize("check", checks())
def test_ode_demo_as_a_trainer(check, port):
    """examples/ode_demo.py ported: ``training_step`` returns the mean absolute error of ``odeint(self.model, ...)``
    (``odeint_adjoint``), ``configure_optimizers`` the example's RMSprop; the same as the hand loop."""
    ported(demo_build, functools.partial(demo_hand, adjoint=port.adjoint), port, check, steps=5)


# -- examples/odenet_mnist.py -------------------------------------------------------------------------------------
TOL, LR, BATCH, BATCHES_PER_EPOCH = 1e-2, 0.1, 8, 2  # the source's --tol: 1e-3


def norm(dim):
    return nn.GroupNorm(min(32, dim), dim)


class ConcatConv2d(nn.Module):

    def __init__(self, dim_in, dim_out, ksize=3, stride=1, padding=0, dilation=1, groups=1, bias=True, transpose=False):
        super(ConcatConv2d, self).__init__()
        module = nn.ConvTranspose2d if transpose else nn.Conv2d
        self._layer = module(
            dim_in + 1, dim_out, kernel_size=ksize, stride=stride, padding=padding, dilation=dilation, groups=groups,
            bias=bias
        )

    def forward(self, t, x):
        tt = torch.ones_like(x[:, :1, :, :]) * t
        ttx = torch.cat([tt, x], 1)
        return self._layer(ttx)


class ODEfunc(nn.Module):

    def __init__(self, dim):
        super(ODEfunc, self).__init__()
        self.norm1 = norm(dim)
        self.relu = nn.ReLU(inplace=True)
        self.conv1 = ConcatConv2d(dim, dim, 3, 1, 1)
        self.norm2 = norm(dim)
        self.conv2 = ConcatConv2d(dim, dim, 3, 1, 1)
        self.norm3 = norm(dim)
        self.nfe = 0

    def forward(self, t, x):
        self.nfe += 1
        out = self.norm1(x)
        out = self.relu(out)
        out = self.conv1(t, out)
        out = self.norm2(out)
        out = self.relu(out)
        out = self.conv2(t, out)
        out = self.norm3(out)
        return out


class ODEBlock(nn.Module):
    """The source's ``odeint`` is ``odeint_adjoint`` under ``--adjoint True`` (a module-level import): here an
    argument."""

    def __init__(self, odefunc, adjoint=True):
        super(ODEBlock, self).__init__()
        self.odefunc = odefunc
        self.integration_time = torch.tensor([0, 1]).float()
        self.odeint = odeint_adjoint if adjoint else plain_odeint

    def forward(self, x):
        self.integration_time = self.integration_time.type_as(x)
        out = self.odeint(self.odefunc, x, self.integration_time, rtol=TOL, atol=TOL)
        return out[1]

    @property
    def nfe(self):
        return self.odefunc.nfe

    @nfe.setter
    def nfe(self, value):
        self.odefunc.nfe = value


class Flatten(nn.Module):

    def __init__(self):
        super(Flatten, self).__init__()

    def forward(self, x):
        shape = torch.prod(torch.tensor(x.shape[1:])).item()
        return x.view(-1, shape)


def inf_generator(iterable):
    """Allows training with DataLoaders in a single infinite loop:
        for i, (x, y) in enumerate(inf_generator(train_loader)):
    """
    iterator = iterable.__iter__()
    while True:
        try:
            yield iterator.__next__()
        except StopIteration:
            iterator = iterable.__iter__()


def learning_rate_with_decay(batch_size, batch_denom, batches_per_epoch, boundary_epochs, decay_rates):
    initial_learning_rate = LR * batch_size / batch_denom

    boundaries = [int(batches_per_epoch * epoch) for epoch in boundary_epochs]
    vals = [initial_learning_rate * decay for decay in decay_rates]

    def learning_rate_fn(itr):
        lt = [itr < b for b in boundaries] + [True]
        i = np.argmax(lt)
        return vals[i]

    return learning_rate_fn


# the learning rate decays after the first epoch and a half (the source: after epochs 60, 100 and 140)
lr_fn = learning_rate_with_decay(BATCH, batch_denom=128, batches_per_epoch=BATCHES_PER_EPOCH, boundary_epochs=[1.5],
                                 decay_rates=[1, 0.1])


def odenet_build(adjoint=True):
    """The ``--network odenet --downsampling-method conv`` model on 1x10x10 images, 8 channels (the source: 64), and a
    shuffling loader of random images and labels."""
    dim = 8
    downsampling_layers = [
        nn.Conv2d(1, dim, 3, 1),
        norm(dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(dim, dim, 4, 2, 1),
        norm(dim),
        nn.ReLU(inplace=True),
        nn.Conv2d(dim, dim, 4, 2, 1),
    ]
    feature_layers = [ODEBlock(ODEfunc(dim), adjoint)]
    fc_layers = [norm(dim), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d((1, 1)), Flatten(), nn.Linear(dim, 10)]
    model = nn.Sequential(*downsampling_layers, *feature_layers, *fc_layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    gen = torch.Generator().manual_seed(5)
    images = torch.utils.data.TensorDataset(torch.rand(BATCH * BATCHES_PER_EPOCH, 1, 10, 10, generator=gen),
                                            torch.randint(10, (BATCH * BATCHES_PER_EPOCH,), generator=gen))
    train_loader = torch.utils.data.DataLoader(images, batch_size=BATCH, shuffle=True, drop_last=True,
                                               generator=torch.Generator().manual_seed(6))
    return model, optimizer, train_loader


def odenet_mnist(model, optimizer, train_loader, guard=None, niters=4, accumulate=1):
    """odenet_mnist.py's ``__main__`` loop (the accuracy and checkpoint of each epoch left out); ``accumulate``: that
    many micro-batches an update, each loss divided by it (the source has none)."""
    step, backward = hooks(guard)
    criterion = nn.CrossEntropyLoss()
    feature_layers = [model[7]]
    data_gen = inf_generator(train_loader)
    f_nfe, b_nfe = [], []

    for itr in range(niters):
        with step():
            for param_group in optimizer.param_groups:
                param_group['lr'] = lr_fn(itr)

            optimizer.zero_grad()
            for _ in range(accumulate):
                x, y = data_gen.__next__()
                logits = model(x)
                loss = criterion(logits, y)

                nfe_forward = feature_layers[0].nfe
                feature_layers[0].nfe = 0

                backward(loss / accumulate if accumulate > 1 else loss)
                f_nfe.append(nfe_forward)
            optimizer.step()

            nfe_backward = feature_layers[0].nfe
            feature_layers[0].nfe = 0
            b_nfe.append(nfe_backward)
    return {"model": model, "optimizer": optimizer.state_dict(), "f_nfe": f_nfe, "b_nfe": b_nfe}


@pytest.mark.parametrize("check, adjoint", [*((check, True) for check in CHECKS), ("always", False)],
                         ids=[*(f"{check}-odeint_adjoint" for check in CHECKS), "always-odeint"])
def test_odenet_mnist(check, adjoint):
    """examples/odenet_mnist.py: convolutions, then an ``ODEBlock`` whose function counts its evaluations on the
    module (``nfe``, read and reset after the forward and after the update), in-place ReLUs inside the ODE function
    (run again inside the adjoint's backward), SGD with the learning rate set by hand each iteration, the loader
    restarted by ``inf_generator`` mid-run. ``--adjoint True`` in every guard mode; without, in ``always`` (ode_demo's
    tests run ``odeint`` in every mode)."""
    ref = three_runs(lambda: odenet_build(adjoint), odenet_mnist, check)
    assert all(n > 0 for n in ref["f_nfe"]) and all((n > 0) == adjoint for n in ref["b_nfe"])


class ODENet(Port):
    """odenet_mnist.py's iteration as ``training_step`` (the forward's evaluation count read and reset there) and
    hooks: the learning rate set in ``on_step_start``, the backward's evaluation count read in ``on_step_end``."""

    @staticmethod
    def data(built, steps):
        return built[2]

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)

    def on_fit_start(self):
        self.feature_layers = [self.model[7]]
        self.criterion = nn.CrossEntropyLoss()
        self.f_nfe, self.b_nfe = [], []

    def on_step_start(self):
        for param_group in self.optimizers["optimizer"].param_groups:
            param_group['lr'] = lr_fn(self.state.step)

    def training_step(self, batch):
        x, y = batch
        logits = self.model(x)
        loss = self.criterion(logits, y)
        self.f_nfe.append(self.feature_layers[0].nfe)
        self.feature_layers[0].nfe = 0
        return loss

    def on_step_end(self, losses):
        self.b_nfe.append(self.feature_layers[0].nfe)
        self.feature_layers[0].nfe = 0

    @staticmethod
    def recorded(trainer):
        return {"f_nfe": trainer.f_nfe, "b_nfe": trainer.b_nfe}


@pytest.mark.parametrize("check, accumulate", [*((check, 1) for check in CHECKS), ("always", 2)])
def test_odenet_mnist_as_a_trainer(check, accumulate):
    """examples/odenet_mnist.py (``--adjoint True``) ported, the evaluation counts kept on the module read and reset
    in ``training_step`` and ``on_step_end``; with ``grad_accum=2`` (under ``always``) against the loop dividing
    each loss by 2."""
    steps = 4 // accumulate
    ported(odenet_build, lambda *a: odenet_mnist(*a, niters=steps, accumulate=accumulate), ODENet, check, steps,
           grad_accum=accumulate)


# -- examples/latent_ode.py ---------------------------------------------------------------------------------------
def generate_spiral2d(nspiral=1000,
                      ntotal=500,
                      nsample=100,
                      start=0.,
                      stop=1,  # approximately equal to 6pi
                      noise_std=.1,
                      a=0.,
                      b=1.):
    """latent_ode.py's, its ``savefig`` plot left out."""

    # add 1 all timestamps to avoid division by 0
    orig_ts = np.linspace(start, stop, num=ntotal)
    samp_ts = orig_ts[:nsample]

    # generate clock-wise and counter clock-wise spirals in observation space
    # with two sets of time-invariant latent dynamics
    zs_cw = stop + 1. - orig_ts
    rs_cw = a + b * 50. / zs_cw
    xs, ys = rs_cw * np.cos(zs_cw) - 5., rs_cw * np.sin(zs_cw)
    orig_traj_cw = np.stack((xs, ys), axis=1)

    zs_cc = orig_ts
    rw_cc = a + b * zs_cc
    xs, ys = rw_cc * np.cos(zs_cc) + 5., rw_cc * np.sin(zs_cc)
    orig_traj_cc = np.stack((xs, ys), axis=1)

    # sample starting timestamps
    orig_trajs = []
    samp_trajs = []
    for _ in range(nspiral):
        # don't sample t0 very near the start or the end
        t0_idx = npr.multinomial(
            1, [1. / (ntotal - 2. * nsample)] * (ntotal - int(2 * nsample)))
        t0_idx = np.argmax(t0_idx) + nsample

        cc = bool(npr.rand() > .5)  # uniformly select rotation
        orig_traj = orig_traj_cc if cc else orig_traj_cw
        orig_trajs.append(orig_traj)

        samp_traj = orig_traj[t0_idx:t0_idx + nsample, :].copy()
        samp_traj += npr.randn(*samp_traj.shape) * noise_std
        samp_trajs.append(samp_traj)

    # batching for sample trajectories is good for RNN; batching for original
    # trajectories only for ease of indexing
    orig_trajs = np.stack(orig_trajs, axis=0)
    samp_trajs = np.stack(samp_trajs, axis=0)

    return orig_trajs, samp_trajs, orig_ts, samp_ts


class LatentODEfunc(nn.Module):

    def __init__(self, latent_dim=4, nhidden=20):
        super(LatentODEfunc, self).__init__()
        self.elu = nn.ELU(inplace=True)
        self.fc1 = nn.Linear(latent_dim, nhidden)
        self.fc2 = nn.Linear(nhidden, nhidden)
        self.fc3 = nn.Linear(nhidden, latent_dim)
        self.nfe = 0

    def forward(self, t, x):
        self.nfe += 1
        out = self.fc1(x)
        out = self.elu(out)
        out = self.fc2(out)
        out = self.elu(out)
        out = self.fc3(out)
        return out


class RecognitionRNN(nn.Module):

    def __init__(self, latent_dim=4, obs_dim=2, nhidden=25, nbatch=1):
        super(RecognitionRNN, self).__init__()
        self.nhidden = nhidden
        self.nbatch = nbatch
        self.i2h = nn.Linear(obs_dim + nhidden, nhidden)
        self.h2o = nn.Linear(nhidden, latent_dim * 2)

    def forward(self, x, h):
        combined = torch.cat((x, h), dim=1)
        h = torch.tanh(self.i2h(combined))
        out = self.h2o(h)
        return out, h

    def initHidden(self):
        return torch.zeros(self.nbatch, self.nhidden)


class Decoder(nn.Module):

    def __init__(self, latent_dim=4, obs_dim=2, nhidden=20):
        super(Decoder, self).__init__()
        self.relu = nn.ReLU(inplace=True)
        self.fc1 = nn.Linear(latent_dim, nhidden)
        self.fc2 = nn.Linear(nhidden, obs_dim)

    def forward(self, z):
        out = self.fc1(z)
        out = self.relu(out)
        out = self.fc2(out)
        return out


def log_normal_pdf(x, mean, logvar):
    const = torch.from_numpy(np.array([2. * np.pi])).float().to(x.device)
    const = torch.log(const)
    return -.5 * (const + logvar + (x - mean) ** 2. / torch.exp(logvar))


def normal_kl(mu1, lv1, mu2, lv2):
    v1 = torch.exp(lv1)
    v2 = torch.exp(lv2)
    lstd1 = lv1 / 2.
    lstd2 = lv2 / 2.

    kl = lstd2 - lstd1 + ((v1 + (mu1 - mu2) ** 2.) / (2. * v2)) - .5
    return kl


latent_dim, nhidden, rnn_nhidden, obs_dim, nspiral, noise_std = 4, 20, 25, 2, 8, .3


def latent_build():
    """latent_ode.py's data and model: 8 spirals (the source: 1000) of 6 samples (100) among 30 points (1000)."""
    orig_trajs, samp_trajs, orig_ts, samp_ts = generate_spiral2d(nspiral=nspiral, ntotal=30, nsample=6, start=0.,
                                                                 stop=6 * np.pi, noise_std=noise_std, a=0., b=.3)
    samp_trajs = torch.from_numpy(samp_trajs).float()
    samp_ts = torch.from_numpy(samp_ts).float()
    nets = nn.ModuleDict({"func": LatentODEfunc(latent_dim, nhidden),
                          "rec": RecognitionRNN(latent_dim, obs_dim, rnn_nhidden, nspiral),
                          "dec": Decoder(latent_dim, obs_dim, nhidden)})
    params = (list(nets["func"].parameters()) + list(nets["dec"].parameters()) + list(nets["rec"].parameters()))
    return nets, optim.Adam(params, lr=0.01), samp_trajs, samp_ts


def latent_ode(nets, optimizer, samp_trajs, samp_ts, guard=None, adjoint=True, niters=4):
    """latent_ode.py's ``__main__`` loop (``--adjoint True``; the solves at ``rtol=RTOL, atol=ATOL``, the source's
    at torchdiffeq's default)."""
    odeint = odeint_adjoint if adjoint else plain_odeint
    func, rec, dec = nets["func"], nets["rec"], nets["dec"]
    step, backward = hooks(guard)
    elbos = []
    for itr in range(1, niters + 1):
        with step():
            optimizer.zero_grad()
            # backward in time to infer q(z_0)
            h = rec.initHidden()
            for t in reversed(range(samp_trajs.size(1))):
                obs = samp_trajs[:, t, :]
                out, h = rec.forward(obs, h)
            qz0_mean, qz0_logvar = out[:, :latent_dim], out[:, latent_dim:]
            epsilon = torch.randn(qz0_mean.size())
            z0 = epsilon * torch.exp(.5 * qz0_logvar) + qz0_mean

            # forward in time and solve ode for reconstructions
            pred_z = odeint(func, z0, samp_ts, rtol=RTOL, atol=ATOL).permute(1, 0, 2)
            pred_x = dec(pred_z)

            # compute loss
            noise_std_ = torch.zeros(pred_x.size()) + noise_std
            noise_logvar = 2. * torch.log(noise_std_)
            logpx = log_normal_pdf(
                samp_trajs, pred_x, noise_logvar).sum(-1).sum(-1)
            pz0_mean = pz0_logvar = torch.zeros(z0.size())
            analytic_kl = normal_kl(qz0_mean, qz0_logvar,
                                    pz0_mean, pz0_logvar).sum(-1)
            loss = torch.mean(-logpx + analytic_kl, dim=0)
            backward(loss)
            optimizer.step()
            elbos.append(-loss.item())
    return {"nets": nets, "optimizer": optimizer.state_dict(), "elbos": elbos}


def latent_ode_hoisted(nets, optimizer, samp_trajs, samp_ts, guard=None, niters=4):
    """The mistake: latent_ode.py's loop with the recognition RNN run once, before the loop, since the data is one
    fixed batch."""
    func, rec, dec = nets["func"], nets["rec"], nets["dec"]
    step, backward = hooks(guard)
    h = rec.initHidden()
    for t in reversed(range(samp_trajs.size(1))):
        obs = samp_trajs[:, t, :]
        out, h = rec.forward(obs, h)
    qz0_mean, qz0_logvar = out[:, :latent_dim], out[:, latent_dim:]
    for itr in range(1, niters + 1):
        with step():
            optimizer.zero_grad()
            epsilon = torch.randn(qz0_mean.size())
            z0 = epsilon * torch.exp(.5 * qz0_logvar) + qz0_mean
            pred_z = odeint_adjoint(func, z0, samp_ts, rtol=RTOL, atol=ATOL).permute(1, 0, 2)
            pred_x = dec(pred_z)
            noise_std_ = torch.zeros(pred_x.size()) + noise_std
            noise_logvar = 2. * torch.log(noise_std_)
            logpx = log_normal_pdf(samp_trajs, pred_x, noise_logvar).sum(-1).sum(-1)
            pz0_mean = pz0_logvar = torch.zeros(z0.size())
            analytic_kl = normal_kl(qz0_mean, qz0_logvar, pz0_mean, pz0_logvar).sum(-1)
            loss = torch.mean(-logpx + analytic_kl, dim=0)
            backward(loss)
            optimizer.step()


@pytest.mark.parametrize("check", checks())
def test_latent_ode(check):
    """examples/latent_ode.py: a recognition RNN run backwards over the observations, ``z0`` sampled from its
    posterior with ``torch.randn``, ``odeint_adjoint`` through the latent dynamics, a decoder, the ELBO; Adam over
    the three modules' parameters."""
    three_runs(latent_build, latent_ode, check)


def test_latent_ode_encoder_hoisted_out_of_the_loop():
    """latent_ode.py with the recognition RNN run once before the loop (its data is one fixed batch): under watch
    and with a ``GraphGuard``, stopped at the first iteration before its backward (bare, the second would fail with
    PyTorch's "backward through the graph a second time"), naming the posterior's tensors and advising to compute
    them inside the loop; nothing is updated. The fix is the source's loop, which trains quiet (test above)."""
    for guard in (None, GraphGuard(check="always")):
        nets, optimizer, samp_trajs, samp_ts = seeded(latent_build)
        start = deepcopy(nets)
        with pytest.raises(GraphReuseError, match=r"step 1, loss 'loss'.*held by `local (qz0_mean|qz0_logvar)`.*"
                                                  r"To fix: recompute `\1` inside the loop"):
            watched(latent_ode_hoisted, nets, optimizer, samp_trajs, samp_ts) if guard is None else \
                latent_ode_hoisted(nets, optimizer, samp_trajs, samp_ts, guard=guard)
        same(nets, start)


# -- a trajectory continued from the last step's solution ---------------------------------------------------------
def windows(func, optimizer, guard=None, adjoint=True, niters=4, detached=True):
    """ode_demo.py's model fitted window after window along the spiral, each solve starting where the last one
    ended (truncated back-propagation through time for an ODE); the mistake: the next ``y0`` kept with its graph
    (``detached=False``)."""
    odeint = odeint_adjoint if adjoint else plain_odeint
    step, backward = hooks(guard)
    true_y = spiral()
    batch_t = t[:BATCH_TIME]
    y0 = true_y0
    for itr in range(niters):
        with step():
            optimizer.zero_grad()
            pred_y = odeint(func, y0, batch_t, rtol=RTOL, atol=ATOL)
            window = true_y[itr * (BATCH_TIME - 1):(itr + 1) * (BATCH_TIME - 1) + 1]
            loss = torch.mean(torch.abs(pred_y - window))
            backward(loss)
            optimizer.step()
            y0 = pred_y[-1].detach() if detached else pred_y[-1]
    return {"func": func, "optimizer": optimizer.state_dict(), "y0": y0}


def continued(adjoint, guard=None):
    """``windows`` with the mistake, under watch (``guard`` None) or with ``guard``: (the error it raises, the
    parameters after each update that ran)."""
    func, optimizer = seeded(demo_build)
    kept = []
    optimizer.register_step_post_hook(lambda *_: kept.append(deepcopy(func.state_dict())))
    with pytest.raises(CarriedGraphError) as caught:
        if guard is None:
            watched(windows, func, optimizer, adjoint=adjoint, detached=False)
        else:
            windows(func, optimizer, guard=guard, adjoint=adjoint, detached=False)
    same(func.state_dict(), kept[-1])
    return caught.value, kept


@pytest.mark.parametrize("adjoint", [False, True], ids=["odeint", "odeint_adjoint"])
def test_trajectory_continued_with_its_graph(adjoint):
    """The next window's ``y0 = pred_y[-1]`` kept with its graph: bare, the second backward fails inside torch
    ("backward through the graph a second time", through the last solve or the last ``OdeintAdjointMethod``);
    under watch and with a ``GraphGuard``, stopped before that backward, naming ``y0`` and advising
    ``y0 = y0.detach()`` at the end of each step (under watch, where the step ended at the update before ``y0`` was
    taken, first), the first update kept and nothing else changed. With the detach, quiet and bit for bit as
    bare."""
    func, optimizer = seeded(demo_build)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        windows(func, optimizer, adjoint=adjoint, detached=False)
    err, kept = continued(adjoint)
    assert err.step == 2 and len(kept) == 1
    assert re.search(r"held by `local y0`.*To fix: detach the carried state at the end of each step "
                     r"\(`y0 = y0.detach\(\)`\)", str(err))
    err, kept_by_guard = continued(adjoint, GraphGuard(check="always"))
    assert err.step == 2 and re.search(r"held by `local y0`.*\(`y0 = y0.detach\(\)`\)", str(err))
    same(kept_by_guard, kept)
    three_runs(demo_build, lambda *a, guard=None: windows(*a, guard=guard, adjoint=adjoint), "always")


def test_trajectory_continued_with_its_graph_is_advised_to_detach_first():
    """As above, with a ``GraphGuard``: the first fix offered is the detach (a trajectory continued on purpose), not
    rebuilding ``y0`` as a stale cache."""
    err, _ = continued(True, GraphGuard(check="always"))
    assert re.search(r"To fix: detach the carried state at the end of each step \(`y0 = y0.detach\(\)`\)",
                     str(err))


# -- examples/learn_physics.py (--no_events) ----------------------------------------------------------------------
class Sine(nn.Module):
    def forward(self, x):
        return torch.sin(x)


def mlp(input_dim, hidden_dim, output_dim, hidden_depth, output_mod=None, act=nn.ReLU):
    if hidden_depth == 0:
        mods = [nn.Linear(input_dim, output_dim)]
    else:
        mods = [nn.Linear(input_dim, hidden_dim), act()]
        for i in range(hidden_depth - 1):
            mods += [nn.Linear(hidden_dim, hidden_dim), act()]
        mods.append(nn.Linear(hidden_dim, output_dim))
    if output_mod is not None:
        mods.append(output_mod)
    trunk = nn.Sequential(*mods)
    return trunk


class NeuralODE(nn.Module):
    def __init__(self, aug_dim=2):
        super().__init__()
        self.initial_pos = nn.Parameter(torch.tensor([10.0]))
        self.initial_aug = nn.Parameter(torch.zeros(aug_dim))
        self.odefunc = mlp(
            input_dim=1 + aug_dim,
            hidden_dim=16,  # the source: 64
            output_dim=1 + aug_dim,
            hidden_depth=2,
            act=Sine,
        )

        def init(m):
            if isinstance(m, nn.Linear):
                std = 1.0 / math.sqrt(m.weight.size(1))
                m.weight.data.uniform_(-2.0 * std, 2.0 * std)
                m.bias.data.zero_()

        self.odefunc.apply(init)

    def forward(self, t, state):
        return self.odefunc(state)

    def simulate(self, times):
        x0 = torch.cat([self.initial_pos, self.initial_aug]).reshape(-1)
        solution = plain_odeint(self, x0, times, atol=ATOL, rtol=RTOL, method="dopri5")
        trajectory = solution[:, 0]
        return trajectory, []


class NeuralODEStartBuiltOnce(NeuralODE):
    """The mistake: the initial state put together once, in ``__init__``, from the parameters it is made of."""

    def __init__(self, aug_dim=2):
        super().__init__(aug_dim)
        self.x0 = torch.cat([self.initial_pos, self.initial_aug]).reshape(-1)

    def simulate(self, times):
        solution = plain_odeint(self, self.x0, times, atol=ATOL, rtol=RTOL, method="dopri5")
        return solution[:, 0], []


def cosine_decay(learning_rate, global_step, decay_steps, alpha=0.0):
    global_step = min(global_step, decay_steps)
    cosine_decay = 0.5 * (1 + math.cos(math.pi * global_step / decay_steps))
    decayed = (1 - alpha) * cosine_decay + alpha
    return learning_rate * decayed


def learning_rate_schedule(
    global_step, warmup_steps, base_learning_rate, lr_scaling, train_steps
):
    warmup_steps = int(round(warmup_steps))
    scaled_lr = base_learning_rate * lr_scaling
    if warmup_steps:
        learning_rate = global_step / warmup_steps * scaled_lr
    else:
        learning_rate = scaled_lr

    if global_step < warmup_steps:
        learning_rate = learning_rate
    else:
        learning_rate = cosine_decay(
            scaled_lr, global_step - warmup_steps, train_steps - warmup_steps
        )
    return learning_rate


def set_learning_rate(optimizer, lr):
    for group in optimizer.param_groups:
        group["lr"] = lr


def physics_build(model=NeuralODE):
    """The model and Adam; a falling ball's heights at 20 times in [0, 1] in place of bouncing_ball.py's simulation
    (float32: the source sets float64 as torch's default dtype)."""
    model = model()
    obs_times = torch.linspace(0., 1., 20)
    return model, torch.optim.Adam(model.parameters(), lr=0.1), obs_times, 10. - 4.9 * obs_times ** 2


def learn_physics(model, optimizer, obs_times, gt_trajectory, guard=None, num_iterations=4):
    """learn_physics.py's ``__main__`` loop with ``--no_events`` (the plots and checkpoints left out)."""
    step, backward = hooks(guard)
    decay = 1.0
    losses = []

    model.train()
    for itr in range(num_iterations):
        with step():
            optimizer.zero_grad()
            trajectory, event_times = model.simulate(obs_times)
            weights = decay**obs_times
            loss = (
                ((trajectory - gt_trajectory) / (gt_trajectory + 1e-3))
                .abs()
                .mul(weights)
                .mean()
            )
            backward(loss)

            lr = learning_rate_schedule(itr, 0, 0.1, 1.0, num_iterations)
            set_learning_rate(optimizer, lr)
            optimizer.step()
            losses.append(loss.item())

            del trajectory, loss
    return {"model": model, "optimizer": optimizer.state_dict(), "losses": losses}


@pytest.mark.parametrize("check", checks())
def test_learn_physics(check):
    """examples/learn_physics.py ``--no_events``: the model is its own ODE function (``odeint(self, x0, times)``),
    its initial state put together from two parameters in ``simulate``; a cosine learning rate set by hand."""
    three_runs(physics_build, learn_physics, check)


def test_initial_state_built_once_in_init():
    """learn_physics.py's ``x0 = torch.cat([self.initial_pos, self.initial_aug])`` made once in ``__init__``: bare,
    it trains without a word while ``x0`` keeps the initial values (Adam moves ``initial_pos``, which no solve
    reads again); under watch and with a ``GraphGuard(model)``, a ``GraphSharingWarning`` at the first step names
    ``model.x0`` and says to compute it in the loop: the source's ``simulate`` does, and trains quiet (test above)."""
    model, optimizer, obs_times, gt = seeded(lambda: physics_build(NeuralODEStartBuiltOnce))
    learn_physics(model, optimizer, obs_times, gt)
    assert not torch.equal(model.initial_pos.detach(), torch.tensor([10.0]))
    assert torch.equal(model.x0[:1].detach(), torch.tensor([10.0]))
    for guarded in (False, True):
        built = seeded(lambda: physics_build(NeuralODEStartBuiltOnce))
        with pytest.warns(GraphSharingWarning, match=r"step 1, .*held by `model\.x0`; its value does not follow "
                                                     r"their updates.*To fix: compute `model\.x0` inside the loop"):
            learn_physics(*built, guard=GraphGuard(built[0])) if guarded else watched(learn_physics, *built)


class LatentODE(Port):
    """latent_ode.py's iteration as ``training_step`` (the encoder, ``torch.randn`` for ``z0``, ``odeint_adjoint``,
    the ELBO), Adam over the three modules' parameters in the source's order from ``configure_optimizers``."""

    @staticmethod
    def data(built, steps):
        return [built[2]] * steps  # the whole data set, every iteration

    def configure_optimizers(self):
        nets = self.model
        params = (list(nets["func"].parameters()) + list(nets["dec"].parameters()) + list(nets["rec"].parameters()))
        return optim.Adam(params, lr=0.01)

    def on_fit_start(self):
        self.elbos = []

    def training_step(self, samp_trajs):
        func, rec, dec = self.model["func"], self.model["rec"], self.model["dec"]
        h = rec.initHidden()
        for t in reversed(range(samp_trajs.size(1))):
            obs = samp_trajs[:, t, :]
            out, h = rec.forward(obs, h)
        qz0_mean, qz0_logvar = out[:, :latent_dim], out[:, latent_dim:]
        epsilon = torch.randn(qz0_mean.size())
        z0 = epsilon * torch.exp(.5 * qz0_logvar) + qz0_mean
        pred_z = odeint_adjoint(func, z0, self.samp_ts, rtol=RTOL, atol=ATOL).permute(1, 0, 2)
        pred_x = dec(pred_z)
        noise_std_ = torch.zeros(pred_x.size()) + noise_std
        noise_logvar = 2. * torch.log(noise_std_)
        logpx = log_normal_pdf(samp_trajs, pred_x, noise_logvar).sum(-1).sum(-1)
        pz0_mean = pz0_logvar = torch.zeros(z0.size())
        analytic_kl = normal_kl(qz0_mean, qz0_logvar, pz0_mean, pz0_logvar).sum(-1)
        return torch.mean(-logpx + analytic_kl, dim=0)

    def on_step_end(self, losses):
        self.elbos.append(-losses["loss"].item())

    @classmethod
    def make(cls, built, check, steps, **settings):
        trainer = super().make(built, check, steps, **settings)
        trainer.samp_ts = built[3]
        return trainer

    @staticmethod
    def recorded(trainer):
        return {"elbos": trainer.elbos}


@pytest.mark.parametrize("check", checks())
def test_latent_ode_as_a_trainer(check):
    """examples/latent_ode.py ported: ``torch.randn`` drawn in ``training_step`` as in the loop, the recognition RNN
    unrolled there, ``odeint_adjoint`` through the latent dynamics; the same as the hand loop."""
    ported(latent_build, latent_ode, LatentODE, check, steps=4)
