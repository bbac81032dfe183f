"""opacus's differentially private training (``PrivacyEngine.make_private``: a ``GradSampleModule`` whose hooks
store each sample's gradient in ``p.grad_sample``, a ``DPOptimizer`` that clips them and adds noise at its step, a
Poisson-sampling ``DPDataLoader``), written against opacus 1.6.0 as its examples write it, run from the same seeds:

- opacus's own loops (examples/mnist.py's ``train``, ``BatchMemoryManager``'s virtual batches, ghost clipping's
  two backwards in one ``loss.backward()``, examples/dcgan.py with a private discriminator) bare, under
  ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script) and with a
  ``safeloop.GraphGuard`` in the loop;
- a ``safeloop.Trainer`` whose ``configure_optimizers`` returns the ``DPOptimizer``, its model the
  ``GradSampleModule``, its ``train_data`` opacus's loader, against opacus's loop.

Every parameter, the optimizer's state and the accountant's history must come out bit for bit the same, with no
warning the bare run does not emit itself (torch warns that a full backward hook fires on a module whose inputs need
no gradient: opacus's own). Then the mistakes an opacus user makes (a tensor built by the private model before the
loop, a graph back-propagated twice): stopped before the update they would corrupt, and the fix the message advises,
written into the same loop, trains quiet.
"""
import warnings
from copy import deepcopy

import pytest
import torch
import torch.nn as nn

pytest.importorskip("opacus")

from opacus import PrivacyEngine  # noqa: E402
from opacus.utils.batch_memory_manager import BatchMemoryManager  # noqa: E402

import safeloop  # noqa: E402
from safeloop import GraphGuard  # noqa: E402
from safeloop.errors import DoubleBackwardError, GraphReuseError, NonFiniteError, StepError  # noqa: E402
from safeloop.watch import Watch  # noqa: E402
from tests.libraries.compare import same, stepped, three_runs  # noqa: E402
from tests.realworld.harness import checks, strict  # noqa: E402


# -- what every case runs -----------------------------------------------------------------------------------------


def net():
    """A tiny convolutional classifier opacus supports (GroupNorm: batch statistics are not private)."""
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))


def images(n=32, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, 1, 6, 6, generator=gen), torch.randint(3, (n,), generator=gen))


def private(n=32, batch_size=8, poisson=True, mode="hooks", epsilon=None):
    """The README's ``make_private`` on ``net()``, SGD and a loader of ``batch_size``: (model, optimizer, loader,
    privacy_engine, criterion). The noise comes from a seeded generator (``secure_mode=False``, opacus's warning);
    Poisson sampling draws from torch's global generator, seeded by the caller."""
    model = net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(images(n), batch_size=batch_size)
    privacy_engine = PrivacyEngine(accountant="rdp")
    criterion = nn.CrossEntropyLoss()
    common = dict(module=model, optimizer=optimizer, data_loader=loader, max_grad_norm=1.0, poisson_sampling=poisson,
                  noise_generator=torch.Generator().manual_seed(7))
    if mode == "ghost":
        common.update(criterion=criterion, grad_sample_mode="ghost")
    if epsilon is None:
        made = privacy_engine.make_private(noise_multiplier=1.0, **common)
    else:
        made = privacy_engine.make_private_with_epsilon(target_epsilon=epsilon, target_delta=1e-5, epochs=2,
                                                        epsilon_tolerance=0.5, **common)  # a coarser search
    if mode == "ghost":
        model, optimizer, criterion, loader = made
    else:
        model, optimizer, loader = made
    return model, optimizer, loader, privacy_engine, criterion


def results(model, optimizer, privacy_engine, **more):
    """What a run leaves: the model, the optimizer's state, the accountant's history (and ``more``)."""
    return {"model": model, "optimizer": optimizer.state_dict(), "history": list(privacy_engine.accountant.history),
            **more}


# -- examples/mnist.py ------------------------------------------------------------------------------------------------
def mnist_train(model, optimizer, train_loader, privacy_engine, criterion, guard=None, epochs=2):
    """examples/mnist.py's ``train``: zero_grad, forward, backward, step per Poisson batch; epsilon per epoch."""
    model.train()
    losses, epsilons = [], []
    for _epoch in range(epochs):
        for _batch_idx, (data, target) in enumerate(train_loader):
            with stepped(guard):
                optimizer.zero_grad()
                output = model(data)
                loss = criterion(output, target)
                guard.backward(loss) if guard is not None else loss.backward()
                optimizer.step()
            losses.append(loss.item())
        epsilons.append(privacy_engine.accountant.get_epsilon(delta=1e-5))
    return results(model, optimizer, privacy_engine, losses=losses, epsilons=epsilons)


@pytest.mark.parametrize("check", checks())
def test_mnist_train_loop(check):
    """opacus examples/mnist.py's ``train`` on ``make_private``'s model, optimizer and Poisson loader, two epochs:
    the per-sample gradient hooks, the clipping and the seeded noise give the same parameters, momentum buffers,
    losses and epsilons bare, watched and guarded."""
    ref = three_runs(private, mnist_train, check)
    assert len(ref["losses"]) == 8 and ref["history"][0][2] == 8  # (noise multiplier, sample rate, steps)


def test_make_private_with_epsilon_and_fixed_batches():
    """``make_private_with_epsilon`` (the noise multiplier found for a target epsilon: a search of seconds, so one
    guard mode) without Poisson sampling (the loader's own fixed batches), in examples/mnist.py's ``train``."""
    three_runs(lambda: private(poisson=False, epsilon=8.0), mnist_train, "always")


# -- BatchMemoryManager: virtual batches ------------------------------------------------------------------------------
def virtual(model, optimizer, data_loader, privacy_engine, criterion, guard=None, physical=3):
    """``BatchMemoryManager``'s docstring loop: physical batches of at most ``physical``; ``optimizer.step()`` only
    clips and accumulates until a Poisson batch's last physical batch (``signal_skip_step``), and ``zero_grad()``
    keeps the accumulated sum meanwhile."""
    model.train()
    sizes, skipped = [], []
    with BatchMemoryManager(data_loader=data_loader, max_physical_batch_size=physical,
                            optimizer=optimizer) as new_data_loader:
        for data, label in new_data_loader:
            with stepped(guard):
                output = model(data)
                loss = criterion(output, label)
                guard.backward(loss) if guard is not None else loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            sizes.append(len(data))
            skipped.append(optimizer._is_last_step_skipped)
    return results(model, optimizer, privacy_engine, sizes=sizes, skipped=skipped)


@pytest.mark.parametrize("check", checks())
def test_batch_memory_manager_virtual_steps(check):
    """Poisson batches of 8 expected, split by ``BatchMemoryManager`` into physical batches of at most 3: several
    backwards and skipped ``optimizer.step()`` calls per update, the same bit for bit."""
    ref = three_runs(private, virtual, check)
    assert any(ref["skipped"]) and max(ref["sizes"]) <= 3


# -- ghost clipping: two backwards in one loss.backward() -------------------------------------------------------------
def ghost(model, optimizer, train_loader, privacy_engine, criterion, guard=None, epochs=2):
    """``make_private(..., criterion=criterion, grad_sample_mode="ghost")``: the criterion returns a
    ``DPTensorFastGradientClipping`` whose ``backward()`` back-propagates the mean loss with ``retain_graph=True``,
    zeroes the gradients, and back-propagates the per-sample losses reweighted by their clipping coefficients through
    the same graph. With a guard it checks the per-sample losses, whose graph that backward runs."""
    model.train()
    losses = []
    for _epoch in range(epochs):
        for data, target in train_loader:
            with stepped(guard):
                optimizer.zero_grad()
                loss = criterion(model(data), target)
                if guard is not None:
                    guard.check(loss.loss_per_sample)
                loss.backward()
                optimizer.step()
            losses.append(loss.item())
    return results(model, optimizer, privacy_engine, losses=losses)


@pytest.mark.parametrize("check", checks())
def test_ghost_clipping_two_backwards_through_one_graph(check):
    """Fast gradient (ghost) clipping, opacus's ``DPLossFastGradientClipping``: its two backwards through one graph,
    the second after a ``zero_grad()``, are one step's; bare, watched and guarded the same bit for bit."""
    three_runs(lambda: private(mode="ghost"), ghost, check)


def test_ghost_clipping_loss_handed_to_guard_backward():
    """``guard.backward(loss)`` with ghost clipping's loss, which is no tensor: refused before anything runs, with a
    message that says what to do with a loss object that runs its own backward."""
    torch.manual_seed(0)
    model, optimizer, loader, _, criterion = private(mode="ghost")
    data, target = next(iter(loader))
    guard = GraphGuard(model, check="always")
    with guard.step():
        loss = criterion(model(data), target)
        with pytest.raises(StepError, match=r"guard\.backward\(\) takes the loss, got DPTensorFastGradientClipping"):
            guard.backward(loss)
    assert all(p.grad is None for p in model.parameters())


# -- GraphGuard told the DPOptimizer ----------------------------------------------------------------------------------
def told(check, model, optimizer, *_):
    return GraphGuard(model, optimizer, check=check)


def mnist_without_steps(model, optimizer, train_loader, privacy_engine, criterion, guard=None):
    """examples/mnist.py's ``train`` with ``guard.backward`` and no ``with guard.step()``: a guard told the
    optimizer ends a step at its update."""
    model.train()
    for _epoch in range(2):
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            guard.backward(loss) if guard is not None else loss.backward()
            optimizer.step()
    return results(model, optimizer, privacy_engine)


@pytest.mark.parametrize("check", checks())
def test_graph_guard_told_the_dp_optimizer(check):
    """``GraphGuard(model, optimizer)`` with the ``DPOptimizer`` (a ``torch.optim.Optimizer`` that never runs
    ``Optimizer.__init__``, wrapping the SGD in ``.original_optimizer``): its steps end the guard's steps."""
    three_runs(private, mnist_without_steps, check, guard_for=told)


def test_graph_guard_told_the_optimizer_a_dp_optimizer_wraps():
    """The advice of ``GraphGuard``'s refusal of an optimizer without step hooks, "pass the optimizer it wraps":
    ``optimizer.original_optimizer`` is accepted, and trains as the bare loop does."""
    three_runs(private, mnist_without_steps, "always",
               guard_for=lambda check, model, optimizer, *_: GraphGuard(model, optimizer.original_optimizer,
                                                                        check=check))


# -- examples/dcgan.py: a private discriminator ----------------------------------------------------------------------
class Generator(nn.Module):
    def __init__(self, nz=3):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(nz, 8), nn.ReLU(), nn.Linear(8, 4), nn.Tanh())

    def forward(self, x):
        return self.main(x)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1), nn.Sigmoid())

    def forward(self, x):
        return self.main(x).view(-1)


def gan_build():
    netG, netD = Generator(), Discriminator()
    gen = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=gen).tanh())
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=6)
    optimizerD = torch.optim.Adam(netD.parameters(), lr=0.01, betas=(0.5, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=0.01, betas=(0.5, 0.999))
    privacy_engine = PrivacyEngine(accountant="rdp")
    netD, optimizerD, dataloader = privacy_engine.make_private(
        module=netD, optimizer=optimizerD, data_loader=dataloader, noise_multiplier=1.0, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(9))
    return netD, netG, optimizerD, optimizerG, dataloader, privacy_engine


def dcgan(netD, netG, optimizerD, optimizerG, dataloader, privacy_engine, guard=None, epochs=2, nz=3, mistake=None):
    """examples/dcgan.py's loop (``mistake`` changes one line): D on real and on ``fake.detach()`` summed into one
    backward ("two backward passes ... opacus happens to treat as a recursive network"), D's step; G through
    ``netD(fake)``, whose hooks fire in G's backward too."""
    criterion = nn.BCELoss()
    REAL_LABEL, FAKE_LABEL = 1.0, 0.0
    for _epoch in range(epochs):
        for data in dataloader:
            with stepped(guard):
                optimizerD.zero_grad(set_to_none=True)
                real_data = data[0]
                batch_size = real_data.size(0)
                label_true = torch.full((batch_size,), REAL_LABEL)
                output = netD(real_data)
                errD_real = criterion(output, label_true)
                noise = torch.randn(batch_size, nz)
                fake = netG(noise)
                label_fake = torch.full((batch_size,), FAKE_LABEL)
                output = netD(fake if mistake == "fake not detached" else fake.detach())
                errD_fake = criterion(output, label_fake)
                errD = errD_real + errD_fake
                guard.backward(errD) if guard is not None else errD.backward()
                optimizerD.step()
                optimizerD.zero_grad(set_to_none=True)
                optimizerG.zero_grad()
                label_g = torch.full((batch_size,), REAL_LABEL)
                output_g = netD(fake)
                errG = criterion(output_g, label_g)
                guard.backward(errG) if guard is not None else errG.backward()
                optimizerG.step()
    return {"model": netD, "netG": netG, "optimizerD": optimizerD.state_dict(),
            "optimizerG": optimizerG.state_dict(), "history": list(privacy_engine.accountant.history)}


@pytest.mark.parametrize("check", checks())
def test_dcgan_private_discriminator(check):
    """opacus examples/dcgan.py: the discriminator a ``GradSampleModule`` with two forwards per backward, the
    generator's loss back-propagated through it (its hooks fire there too), two Adam optimizers."""
    three_runs(gan_build, dcgan, check)


def test_dcgan_fake_not_detached_is_stopped_and_the_advised_detach_trains():
    """examples/dcgan.py with ``netD(fake)`` where the source has ``netD(fake.detach())``: D's backward frees G's
    graph; stopped before G's backward, naming ``fake`` and advising ``fake.detach()``, which the source does."""
    torch.manual_seed(0)
    netD, netG, *rest = gan_build()
    start = deepcopy(dict(netG.named_parameters()))
    torch.manual_seed(1)
    with pytest.raises(DoubleBackwardError, match=r"`(local )?fake`.*`fake\.detach\(\)`"):
        dcgan(netD, netG, *rest, guard=GraphGuard(netD, check="always"), mistake="fake not detached")
    same(dict(netG.named_parameters()), start)
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__), \
            pytest.raises(DoubleBackwardError, match=r"`(local )?fake`.*`fake\.detach\(\)`"):
        dcgan(*gan_build(), mistake="fake not detached")


# -- the mistakes ------------------------------------------------------------------------------------------------------
def prior_train(model, optimizer, train_loader, privacy_engine, criterion, guard=None, fix=None):
    """examples/mnist.py's ``train`` with a label prior taken from the private model before the loop and added to
    every step's logits (the mistake); ``fix``: the prior as the guard's advice makes it (``"detach"``), or as
    opacus needs it (``"no_grad"``: no activation captured by opacus's forward hook)."""
    model.train()
    probe = train_loader.dataset.tensors[0][:4]
    if fix == "no_grad":
        with torch.no_grad():
            prior = model(probe).log_softmax(-1).mean(0)
    else:
        prior = model(probe).log_softmax(-1).mean(0)
        if fix == "detach":
            prior = prior.detach()
    for data, target in train_loader:
        with stepped(guard):
            optimizer.zero_grad()
            loss = criterion(model(data) + prior, target)
            guard.backward(loss) if guard is not None else loss.backward()
            optimizer.step()
    return results(model, optimizer, privacy_engine)


def test_prior_built_before_the_loop_is_stopped_at_the_first_step():
    """A prior built by the private model before the loop and reused by every step: stopped at the first step,
    before any gradient or update, naming ``prior``. Of the two fixes for a constant, opacus needs the second: stored
    ``.detach()``ed, the forward its hook recorded is never consumed by a backward, and opacus's next step fails
    ("Per sample gradient is not initialized"), bare too."""
    torch.manual_seed(0)
    model, *rest = private()
    start = deepcopy(dict(model.named_parameters()))
    torch.manual_seed(1)
    with pytest.raises(GraphReuseError, match=r"step 1, .*held by `(local )?prior`.*`prior\.detach\(\)` instead, or "
                                              r"compute it under `torch\.no_grad\(\)`"):
        prior_train(model, *rest, guard=GraphGuard(model, check="always"))
    same(dict(model.named_parameters()), start)
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())


def test_prior_built_before_the_loop_computed_without_grad_trains():
    """The prior computed under ``torch.no_grad()``: opacus's forward hook captures nothing, and the loop trains
    quiet and bit for bit as bare."""
    three_runs(private, lambda *a, guard=None: prior_train(*a, guard=guard, fix="no_grad"), "always")


def twice_train(model, optimizer, train_loader, privacy_engine, criterion, guard=None):
    """A loss back-propagated twice in one step (a backward left in a logging helper)."""
    model.train()
    for data, target in train_loader:
        with stepped(guard):
            optimizer.zero_grad()
            loss = criterion(model(data), target)
            guard.backward(loss) if guard is not None else loss.backward()
            guard.backward(loss) if guard is not None else loss.backward()
            optimizer.step()
    return results(model, optimizer, privacy_engine)


def test_backward_twice_is_stopped_before_the_second():
    """``loss.backward()`` twice on one loss: stopped before the second, advising to delete it (``retain_graph``
    would run opacus's per-sample hooks again and put a second per-sample gradient on every parameter)."""
    torch.manual_seed(0)
    model, *rest = private()
    torch.manual_seed(1)
    with pytest.raises(DoubleBackwardError, match=r"step 1, .*delete the second backward"):
        twice_train(model, *rest, guard=GraphGuard(model, check="always"))
    torch.manual_seed(0)
    built = private()
    torch.manual_seed(1)
    with Watch(GraphGuard(check="always"), __file__), pytest.raises(DoubleBackwardError, match=r"step 1"):
        twice_train(*built)


# == the safeloop Trainer ===========================================================================================
class DPTrainer(safeloop.Trainer):
    """The DPOptimizer from ``configure_optimizers``; the loss as examples/mnist.py computes it."""

    def __init__(self, *, dp_optimizer, criterion, **kwargs):
        self.dp_optimizer, self.criterion = dp_optimizer, criterion
        super().__init__(**kwargs)

    def configure_optimizers(self):
        return self.dp_optimizer

    def training_step(self, batch):
        data, target = batch
        return self.criterion(self.model(data), target)


class ManualDPTrainer(DPTrainer):
    """The same step in manual mode: ``self.backward`` and ``self.step``."""

    automatic = False

    def training_step(self, batch):
        data, target = batch
        self.backward(self.criterion(self.model(data), target))
        self.step()


def hand(model, optimizer, loader, privacy_engine, criterion, steps, physical=None):
    """opacus's loop for ``steps`` updates: zero_grad, forward, backward, step (examples/mnist.py); or physical
    batches of ``BatchMemoryManager`` (``steps`` then counts physical batches, as the Trainer's steps do)."""
    model.train()
    done = 0
    while done < steps:
        data = loader if physical is None else BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer).__enter__()
        for x, y in data:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
    return results(model, optimizer, privacy_engine)


def port(model, optimizer, loader, privacy_engine, criterion, steps, physical=None, cls=DPTrainer, **settings):
    data = loader if physical is None else BatchMemoryManager(
        data_loader=loader, max_physical_batch_size=physical, optimizer=optimizer).__enter__()
    trainer = cls(dp_optimizer=optimizer, criterion=criterion, model=model, train_data=data, max_steps=steps,
                        device="cpu", progress=False, loggers=(), **settings)
    trainer.fit()
    assert trainer.state.step == steps
    return results(model, optimizer, privacy_engine)


def versus(steps, build=private, hand_kw=None, **settings):
    """opacus's loop and the Trainer from the same seeds; the Trainer's run warns nothing the loop does not.
    Returns (the loop's result, the Trainer's)."""
    def run(train, **kw):
        torch.manual_seed(0)
        built = build()
        torch.manual_seed(1)
        return train(*built, steps, **kw)
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = run(hand, **(hand_kw or {}))
    with strict(own):
        ours = run(port, **settings)
    torch.manual_seed(0)
    assert any(not torch.equal(p, q) for p, q in zip(ref["model"].parameters(), build()[0].parameters()))
    return ref, ours


@pytest.mark.parametrize("cls", [DPTrainer, ManualDPTrainer], ids=["automatic", "manual"])
@pytest.mark.parametrize("check", checks())
def test_trainer_trains_as_the_mnist_loop(check, cls):
    """``DPTrainer(model=GradSampleModule, train_data=DPDataLoader)``, ``configure_optimizers`` returning the
    ``DPOptimizer``: the Trainer's ``zero_grad(set_to_none=True)`` at a step's start clears ``p.grad_sample`` and
    ``p.summed_grad`` as opacus's ``zero_grad()`` does, and its ``step()`` clips, noises and steps as in the loop;
    in manual mode too (``self.backward``, ``self.step``)."""
    ref, ours = versus(8, guard={"check": check}, cls=cls)
    same(ours, ref)


@pytest.mark.parametrize("settings", [{"undo": "full"}, {"on_nonfinite": "error"}, {"undo": "off"}],
                         ids=["undo_full", "nonfinite_error", "undo_off"])
def test_trainer_policies_leave_the_private_update_alone(settings):
    """The undo snapshot before the ``DPOptimizer``'s step (taken of its wrapped SGD too) and the non-finite check of
    the gradients a backward left (not yet clipped nor noised) change nothing in the update."""
    ref, ours = versus(8, **settings)
    same(ours, ref)


def test_trainer_batch_memory_manager():
    """``train_data`` a ``BatchMemoryManager``'s loader: one Trainer step per physical batch, whose
    ``optimizer.step()`` only accumulates until the Poisson batch's last (the Trainer's update returns None then),
    and whose ``zero_grad`` keeps the sum: as opacus's loop, bit for bit."""
    ref, ours = versus(10, physical=3, hand_kw={"physical": 3})
    same(ours, ref)


def test_trainer_empty_poisson_batches():
    """Poisson batches of one sample expected out of 12: some are empty (a NaN mean loss, zero gradients, a noised
    update counted by the accountant, as opacus makes it); the Trainer with its defaults steps through them as the
    loop does."""
    build = lambda: private(n=12, batch_size=1)  # noqa: E731
    torch.manual_seed(1)
    assert any(len(x) == 0 for x, _ in build()[2])  # the seeds give empty batches (sampled by the global generator)
    ref, ours = versus(20, build=build)
    same(ours, ref)


def test_trainer_empty_poisson_batch_under_on_nonfinite_error():
    """``on_nonfinite="error"`` stops at an empty Poisson batch: its mean loss is NaN (a loss over no sample), though
    opacus's loop goes on. The message says the gradients are finite (zero), not that the NaN made them
    non-finite."""
    torch.manual_seed(0)
    built = private(n=12, batch_size=1)
    torch.manual_seed(1)
    with pytest.raises(NonFiniteError, match=r"loss 'loss' is nan but every gradient is finite \(a mean over an "
                                             r"empty batch is NaN with zero gradients\)"):
        port(*built, 20, on_nonfinite="error")


@pytest.mark.parametrize("poisson", [True, False], ids=["poisson", "fixed_batches"])
def test_trainer_refuses_grad_accum_with_a_dp_optimizer(poisson):
    """``grad_accum=2`` would divide each loss by 2 before opacus's hooks take the per-sample gradients
    (``GradSampleModule``'s backward hook): they would be clipped at twice ``max_grad_norm``, and
    ``DPOptimizer.scale_grad`` divides by its ``accumulated_iterations`` once more. Trained, that is not opacus's
    accumulation (two backwards, then ``step()``), and with Poisson batches opacus refuses it at the second backward
    only. It is refused as the fit starts, nothing trained, pointing at ``BatchMemoryManager``."""
    torch.manual_seed(0)
    model, *rest = private(poisson=poisson)
    start = deepcopy(dict(model.named_parameters()))
    torch.manual_seed(1)
    with pytest.raises(safeloop.ConfigError, match=r"grad_accum=2 divides each loss by 2 before opacus's hooks .*"
                                                   r"optimizer 'optimizer' is opacus's DPOptimizer.*clipped at 2 times "
                                                   r"max_grad_norm.*BatchMemoryManager"):
        port(model, *rest, 4, grad_accum=2)
    same(dict(model.named_parameters()), start)
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in model.parameters())


@pytest.mark.parametrize("cls", [DPTrainer, ManualDPTrainer], ids=["automatic", "manual"])
def test_trainer_refuses_grad_clip_with_a_dp_optimizer(cls):
    """``grad_clip`` clips ``p.grad``, which ``DPOptimizer.step`` replaces by its clipped, noised sum of
    ``p.grad_sample``: it would train as without it. Refused as the fit starts (manual mode's ``self.step`` clips
    too), nothing trained, naming opacus's ``max_grad_norm``; with ``grad_accum`` too, both problems are listed."""
    torch.manual_seed(0)
    built = private(poisson=False)
    start = deepcopy(dict(built[0].named_parameters()))
    with pytest.raises(safeloop.ConfigError, match=r"grad_clip=0.01 would clip p.grad, and optimizer 'optimizer' is "
                                                   r"opacus's DPOptimizer, which replaces p.grad .*max_grad_norm"):
        port(*built, 4, grad_clip=0.01, cls=cls)
    same(dict(built[0].named_parameters()), start)
    assert all(p.grad is None and getattr(p, "grad_sample", None) is None for p in built[0].parameters())
    with pytest.raises(safeloop.ConfigError, match=r"(?s)invalid configuration:\n  - grad_clip=.*\n  - grad_accum="):
        port(*built, 4, grad_clip=0.01, grad_accum=2)