"""Loops a library runs: ``enginelib.py``, a file of its own as ignite's ``Engine`` and ``create_supervised_trainer``
and mmengine's ``OptimWrapper`` are, runs the loop and calls backward; the user's code (this file) gives it functions.
Under ``safeloop.watch`` (``Watch``, in process) the names a fix can use are this file's; the first step begins at the
call into the library; correct code stays quiet and bit for bit the same.
"""
import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from safeloop import GraphGuard
from safeloop.errors import CarriedGraphError, DoubleBackwardError, GraphLeakWarning, GraphReuseError
from safeloop.errors import InplaceModificationError, NoGraphError, UnusedGradientWarning
from safeloop.watch import Watch

from . import enginelib
from .enginelib import Engine, OptimWrapper, accumulated_backward, scaled_backward, supervised_trainer


def batches(n=3, shape=(8, 4)):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=gen), torch.randn(shape[0], 1, generator=gen)) for _ in range(n)]


def watched(run, *args, check="always"):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with Watch(GraphGuard(check=check), __file__):
            return run(*args)


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# -- a tensor built before the library's loop, reused through a closure (seed 001) ------------------------------------
def prompted(inside):
    torch.manual_seed(0)
    model, codes = nn.Linear(4, 1), nn.Linear(2, 4)
    optimizer = torch.optim.SGD([*model.parameters(), *codes.parameters()], lr=0.05)
    prompt = codes(torch.ones(1, 2))  # built once, before trainer.run
    model_fn = (lambda model, x: model(x + codes(torch.ones(1, 2)))) if inside else \
        (lambda model, x: model(x + prompt))
    supervised_trainer(model, optimizer, F.mse_loss, model_fn).run(batches())
    return model, codes


def test_a_tensor_built_before_a_librarys_loop_is_named_at_step_one_by_the_scripts_name():
    with pytest.raises(GraphReuseError, match=r"\(step 1, loss 'loss'\): the loss reaches AddmmBackward0, built "
                                              r"before the step \(before the loop\) and held by `local prompt`.*"
                                              r"To fix: recompute `prompt` inside the loop"):
        watched(prompted, False)


@pytest.mark.parametrize("check", ["auto", "always", "off"])
def test_the_same_loop_recomputing_it_in_every_step_is_quiet_and_unchanged(check):
    bare = prompted(True)
    for ours, ref in zip(watched(prompted, True, check=check), bare, strict=True):
        assert same(ours, ref)


def test_a_guard_checking_in_the_loss_function_names_the_scripts_tensor_at_step_one():
    """``guard.check(loss)`` where the library calls backward: the caller's file's frames are searched, a ``main``
    around the library's loop included."""
    torch.manual_seed(0)
    model, codes = nn.Linear(4, 1), nn.Linear(2, 4)
    optimizer = torch.optim.SGD([*model.parameters(), *codes.parameters()], lr=0.05)
    prompt = codes(torch.ones(1, 2))
    guard = GraphGuard(model, optimizer, check="always")

    def loss_fn(output, y):
        loss = F.mse_loss(output, y)
        guard.check(loss)
        return loss
    trainer = supervised_trainer(model, optimizer, loss_fn, lambda model, x: model(x + prompt))
    with pytest.raises(GraphReuseError, match=r"\(step 1, loss 'loss'\).*held by `local prompt`"):
        trainer.run(batches())


# -- state carried in the library's own objects ---------------------------------------------------------------------
def truncated(detach):
    torch.manual_seed(0)
    gru, head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*gru.parameters(), *head.parameters()], lr=0.05)

    def update(engine, batch):
        x, y = batch
        optimizer.zero_grad()
        out, h = gru(x, getattr(engine.state, "hidden", None))
        loss = F.mse_loss(head(out[:, -1]), y)
        loss.backward()
        optimizer.step()
        engine.state.hidden = h.detach() if detach else h
        return loss.item()
    Engine(update).run(batches(shape=(2, 3, 4)))
    return gru


def test_a_hidden_state_the_engine_carries_with_its_graph_is_named_with_the_fix():
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `engine.state.hidden`.*To fix: "
                                                r"detach the carried state at the end of each step "
                                                r"\(`engine.state.hidden = engine.state.hidden.detach\(\)`\)"):
        watched(truncated, False)
    assert same(watched(truncated, True), truncated(True))


def running(update_returns_tensor=True):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    def update(engine, batch):
        optimizer.zero_grad()
        x, y = batch
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss if update_returns_tensor else loss.item()

    def accumulate(engine):
        engine.state.running_loss = getattr(engine.state, "running_loss", 0) + engine.state.output
    engine = Engine(update)
    engine.completed.append(accumulate)
    engine.run(batches(5))
    return model


def test_a_running_loss_the_engine_keeps_with_its_graph_is_named():
    with pytest.warns(GraphLeakWarning, match=r"held by `engine.state.running_loss`: such graphs pile up"):
        with Watch(GraphGuard(check="always"), __file__):
            running()
    assert same(watched(running, False), running(False))


# -- two optimizers a step each, one dict of the iteration's losses kept until the next (mmengine's GAN log_vars) -----
def gan(history=None):
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    D = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    d_wrapper = OptimWrapper(torch.optim.SGD(D.parameters(), lr=0.05))
    g_wrapper = OptimWrapper(torch.optim.SGD(G.parameters(), lr=0.05))

    def train_step(real):
        with torch.no_grad():
            fake = G(torch.randn(6, 4))
        pf, pr = D(fake), D(real)
        loss_d = F.binary_cross_entropy(pf, torch.zeros_like(pf)) + F.binary_cross_entropy(pr, torch.ones_like(pr))
        d_wrapper.update_params(loss_d)
        D.requires_grad_(False)
        pg = D(G(torch.randn(6, 4)))
        loss_g = F.binary_cross_entropy(pg, torch.ones_like(pg))
        g_wrapper.update_params(loss_g)
        D.requires_grad_(True)
        return {"loss_d": loss_d, "loss_g": loss_g}  # with their graphs, as mmengine's parse_losses gives them
    for _ in range(5):
        log_vars = train_step(torch.randn(6, 4))  # kept until the next iteration replaces it
        if history is not None:
            history.append(log_vars)
    return G, D


def test_the_losses_of_one_iteration_of_two_optimizer_steps_kept_until_the_next_are_no_leak():
    bare = gan()
    for ours, ref in zip(watched(gan), bare, strict=True):
        assert same(ours, ref)


def test_the_losses_of_every_iteration_kept_in_a_list_are_a_leak():
    with pytest.warns(GraphLeakWarning, match=r"held by `local history\[\d\]\['loss_[dg]'\]`"):
        with Watch(GraphGuard(check="always"), __file__):
            gan([])


# -- a sum back-propagated after its terms (ignite's DCGAN example with an errD.backward() added) ---------------------
def discriminator_step(retain=None):
    torch.manual_seed(0)
    netG, netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    optimizerD = torch.optim.SGD(netD.parameters(), lr=0.1)
    bce = nn.BCELoss()

    def step(engine, batch):
        netD.zero_grad()
        errD_real = bce(netD(batch).view(-1), torch.ones(6))
        errD_real.backward(retain_graph=retain)
        errD_fake = bce(netD(netG(torch.randn(6, 3)).detach()).view(-1), torch.zeros(6))
        errD_fake.backward(retain_graph=retain)
        errD = errD_real + errD_fake
        errD.backward()
        optimizerD.step()
    Engine(step).run([torch.randn(6, 4)])


def test_a_sum_back_propagated_after_its_terms_is_said_to_add_their_gradients_twice():
    with pytest.raises(DoubleBackwardError, match=r"this loss is made from `errD_real` "
                                                  r"\(BinaryCrossEntropyBackward0\), which the backward of 'loss' at "
                                                  r"test_library_loops.py:\d+ in this step already back-propagated "
                                                  r"without retain_graph.*with "
                                                  r"retain_graph=True there it would be added twice. To fix: "
                                                  r"back-propagate it once: delete this backward, or the backward of "
                                                  r"'loss' at test_library_loops.py:\d+"):
        watched(discriminator_step)


# -- guard.check(loss) before the library's backward ----------------------------------------------------------------
class Gated(nn.Module):
    def __init__(self, inplace):
        super().__init__()
        self.fc, self.skip, self.out, self.inplace = nn.Linear(4, 8), nn.Linear(4, 8), nn.Linear(8, 1), inplace

    def forward(self, x):
        h = torch.sigmoid(self.fc(x))
        if self.inplace:
            h += self.skip(x)  # sigmoid saved its output for backward
        else:
            h = h + self.skip(x)
        return self.out(h)


def checked(model, loss_fn, guard):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def checked_loss(output, y):
        loss = loss_fn(output, y)
        guard.check(loss)
        return loss
    supervised_trainer(model, optimizer, checked_loss).run(batches(2))
    return model


def test_check_says_a_loss_remade_from_item_has_no_graph_before_the_librarys_backward():
    model = Gated(False)
    with pytest.raises(NoGraphError, match=r"loss has no autograd graph \(step \d, loss 'loss'\): it is a leaf tensor "
                                           r"made with requires_grad=True"):
        checked(model, lambda out, y: torch.tensor(F.mse_loss(out, y).item(), requires_grad=True),
                GraphGuard(model, check="always"))


def test_check_explains_a_saved_tensor_changed_in_place_before_the_librarys_backward():
    model = Gated(True)
    with pytest.raises(InplaceModificationError, match=r"a tensor the graph saved for backward \(\[torch.FloatTensor "
                                                       r"\[8, 8\]\], the output of Sigmoid\) was changed in place"):
        checked(model, F.mse_loss, GraphGuard(model, check="always"))
    ref = Gated(False)
    ours = copy.deepcopy(ref)
    torch.manual_seed(2)
    checked(ref, F.mse_loss, GraphGuard(ref, check="off"))
    torch.manual_seed(2)
    assert same(checked(ours, F.mse_loss, GraphGuard(ours, check="always")), ref)


def test_weights_written_by_an_optimizer_the_guard_was_not_given_are_not_said_to_have_no_step():
    """The generator's ``output = netD(fake)`` taken before ``optimizerD.step()``, a GraphGuard given only netD."""
    torch.manual_seed(0)
    netG, netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    optimizerD = torch.optim.SGD(netD.parameters(), lr=0.1)
    guard = GraphGuard(netD, check="always")
    bce = nn.BCELoss()
    with guard.step():
        fake = netG(torch.randn(6, 3))
        output = netD(fake)
        guard.backward(bce(netD(fake.detach()).view(-1), torch.zeros(6)))
        optimizerD.step()
        with pytest.raises(InplaceModificationError, match=r"written in place since, by no optimizer step the guard "
                                                           r"was told of .*if an optimizer step wrote them \(a GAN's "
                                                           r"discriminator step before the generator's loss\), "
                                                           r"compute the loss after that step"):
            guard.backward(bce(output.view(-1), torch.ones(6)))


# -- a loss function that runs its own backward, the library's update another ---------------------------------------
def test_a_loss_functions_own_backward_is_the_one_to_delete_not_the_librarys():
    def loss_fn(output, y):
        loss = F.mse_loss(output, y)
        loss.backward()  # copied from a hand-written loop
        return loss

    def run():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn).run(batches())
    with pytest.raises(DoubleBackwardError, match=r"To fix: delete the backward at test_library_loops.py:\d+: the code "
                                                  r"calling this one \(enginelib.py, a library's training step say\) "
                                                  r"runs backward on the loss itself"):
        watched(run)


# -- torch.autocast's cached casts of the weights, kept across optimizer steps ----------------------------------------
def autocast_run(region):
    """bfloat16 casts: ``region`` "outer": one region around the library's whole run (the casts of step 1 are
    every step's); "off-outer": an outer region turned off, a region per forward inside it (the casts are kept until
    the outer one exits all the same); "inner": a region per forward alone (right)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)

    def model_fn(model, x):
        if region == "outer":
            return model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x)
    trainer = supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                 lambda out, y: F.mse_loss(out.float(), y), model_fn)
    outer = {"outer": torch.autocast("cpu", dtype=torch.bfloat16),
             "off-outer": torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)}.get(region)
    if outer is None:
        trainer.run(batches(4))
    else:
        with outer:
            trainer.run(batches(4))
    return model


@pytest.mark.parametrize("region", ["outer", "off-outer"])
def test_weight_casts_autocast_keeps_across_updates_are_named_at_step_two(region):
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\): the loss reaches ToCopyBackward0, a "
                                                r"low-precision copy of a weight that torch.autocast made during an "
                                                r"earlier step.*To fix: enter torch.autocast around each forward and "
                                                r"its loss only, never around an optimizer step"):
        watched(autocast_run, region)
    assert same(watched(autocast_run, "inner"), autocast_run("inner"))


# -- torch.nn.utils.parametrize.cached(): a parametrized weight computed once per region --------------------------
class Symmetric(nn.Module):
    """pytorch/tutorials, intermediate_source/parametrizations.py: its graph saves nothing, so a weight cached across
    updates trains on in PyTorch without a word, every forward with the weight of the first."""

    def forward(self, X):
        return X.triu() + X.triu(1).transpose(-1, -2)


def parametrized_run(region):
    """``region`` "outer": ``parametrize.cached()`` around the library's whole run (step 1's weight is every
    step's); "inner": around each forward, which reads the weight three times (what the tutorial shows it for)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    parametrize.register_parametrization(model[0], "weight", Symmetric())

    def model_fn(model, x):
        with parametrize.cached() if region == "inner" else contextlib.nullcontext():
            for _ in range(3):
                x = model[1](model[0](x))
            return model[2](x)
    trainer = supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), F.mse_loss, model_fn)
    with parametrize.cached() if region == "outer" else contextlib.nullcontext():
        trainer.run(batches(4))
    return model


def test_a_parametrized_weight_cached_across_updates_is_named_at_step_two():
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\): the loss reaches AddBackward0, a "
                                                r"parametrized weight that torch.nn.utils.parametrize.cached\(\) "
                                                r"computed during an earlier step.*To fix: enter parametrize.cached\(\) "
                                                r"around each forward only, never around an optimizer step"):
        watched(parametrized_run, "outer")
    assert same(watched(parametrized_run, "inner"), parametrized_run("inner"))


def gan_in_one_region(clear=False):
    """ignite's DCGAN update inside one autocast region: G's loss on ``netD(fake)`` after ``optimizerD.step()``."""
    torch.manual_seed(0)
    netG, netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Sequential(nn.Linear(4, 1))
    optimizerG, optimizerD = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (netG, netD))

    def step(engine, real):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            netD.zero_grad()
            fake = netG(torch.randn(6, 3))
            errD = F.softplus(-netD(real)).mean() + F.softplus(netD(fake.detach())).mean()
            errD.float().backward()
            optimizerD.step()
            if clear:
                torch.clear_autocast_cache()
            netG.zero_grad()
            errG = F.softplus(-netD(fake)).mean()
            errG.float().backward()
            optimizerG.step()
    Engine(step).run([torch.randn(6, 4) for _ in range(3)])
    return netG, netD


def test_a_generator_loss_through_the_discriminators_casts_from_before_its_update_is_named():
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\): the loss reaches ToCopyBackward0, a "
                                                r"low-precision copy of a weight"):
        watched(gan_in_one_region)
    for ours, ref in zip(watched(gan_in_one_region, True), gan_in_one_region(True), strict=True):
        assert same(ours, ref)


class Elementwise(nn.Module):
    """A critic autocast casts nothing of (an elementwise product and a sum)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (x.float() * self.w).sum(-1)


def test_the_generators_casts_made_in_the_critics_step_are_no_stale_copy_when_only_the_critic_changed():
    """G's weights are cast in D's step (``fake = netG(z)`` inside the region) and G's loss goes through them after
    D's update, which changed D's weights only: nothing stale, nothing said."""
    def run():
        torch.manual_seed(0)
        netG, netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh()), Elementwise()
        optimizerG, optimizerD = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (netG, netD))

        def step(engine, real):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                netD.zero_grad()
                fake = netG(torch.randn(6, 3))
                F.softplus(netD(fake.detach()) - netD(real)).mean().backward()
                optimizerD.step()
                netG.zero_grad()
                F.softplus(-netD(fake)).mean().backward()
                optimizerG.step()
                torch.clear_autocast_cache()  # before the next iteration's forwards
        Engine(step).run([torch.randn(6, 4) for _ in range(3)])
        return netG, netD
    for ours, ref in zip(watched(run), run(), strict=True):
        assert same(ours, ref)


# -- an optimizer wrapped as accelerate prepares it ------------------------------------------------------------------
class Prepared(torch.optim.Optimizer):
    """As accelerate's ``AcceleratedOptimizer``: never runs ``Optimizer.__init__``, steps the optimizer it wraps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


class Listed(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.layers = [nn.Linear(4, 1)]  # a plain list: not registered, so not in model.parameters()

    def forward(self, x):
        return self.layers[0](self.first(x))


def test_a_layer_no_prepared_optimizer_holds_is_warned_of_under_watch():
    """The optimizer a wrapper holds is the one that steps (PyTorch's global step hooks see it): it counts once."""
    def run():
        torch.manual_seed(0)
        model = Listed()
        optimizer = Prepared(torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches(3):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    with pytest.warns(UnusedGradientWarning, match=r"gradient that no optimizer uses"):
        with Watch(GraphGuard(check="always"), __file__):
            run()


def test_an_update_between_a_loss_and_its_backward_is_named_by_the_functions_variable():
    """The update by the loop's optimizer variable, the loss to compute again by the loop's variable for it."""
    def run():
        torch.manual_seed(0)
        netG, netD = nn.Sequential(nn.Linear(3, 4), nn.Tanh()), nn.Linear(4, 1)
        optimizerD = Prepared(torch.optim.SGD(netD.parameters(), lr=0.1))
        for real in [torch.randn(6, 4) for _ in range(2)]:
            fake = netG(torch.randn(6, 3))
            errG = F.softplus(-netD(fake)).mean()  # built before D's update: the mistake
            F.softplus(netD(fake.detach()) - netD(real)).mean().backward()
            optimizerD.step()
            optimizerD.zero_grad()
            errG.backward()
    with pytest.raises(InplaceModificationError, match=r"optimizer 'optimizerD' stepped after this loss was built"
                                                       r".*To fix: recompute `errG` after the optimizer step"):
        watched(run)


def test_check_without_steps_before_someone_elses_backward_tells_a_carried_state_from_a_shared_graph():
    """``guard.check(loss)`` then a library's backward, no ``with guard.step()``: a hidden state carried with its
    graph is a state carried from the last iteration (the other backward freed it), not two losses of one step."""
    torch.manual_seed(0)
    rnn, head = nn.GRU(4, 8, batch_first=True), nn.Linear(8, 1)
    optimizer = torch.optim.SGD([*rnn.parameters(), *head.parameters()], lr=0.05)
    wrapper, guard, hidden = OptimWrapper(optimizer), GraphGuard(rnn, check="always"), None
    with pytest.raises(CarriedGraphError, match=r"\(step 2, loss 'loss'\).*held by `local hidden`.*"
                                                r"`hidden = hidden.detach\(\)`"):
        for x, y in batches(3, shape=(2, 3, 4)):
            out, hidden = rnn(x, hidden)
            loss = F.mse_loss(head(out[:, -1]), y)
            guard.check(loss)
            wrapper.update_params(loss)


def test_a_loss_back_propagated_again_by_a_library_that_divides_it_is_advised_one_backward():
    """``loss.backward()`` left above ``accelerator.backward(loss)``, which back-propagates ``loss / steps``: a new
    tensor over the same graph, made from the loss, so not a second loss to retain the graph for."""
    def run():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        for x, y in batches(2):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            accumulated_backward(loss)
    with pytest.raises(DoubleBackwardError, match=r"this loss is made from `loss` \(MseLossBackward0\).*To fix: "
                                                  r"back-propagate it once: delete this backward, or the backward of "
                                                  r"'loss' at test_library_loops.py:\d+"):
        watched(run)


class History:
    """A handler object the engine keeps in a list, keeping every iteration's loss with its graph."""

    def __init__(self):
        self.losses = []

    def __call__(self, engine):
        self.losses.append(engine.state.output)


def test_losses_a_handler_in_the_engines_list_keeps_are_named_through_the_list():
    def run():
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

        def update(engine, batch):
            optimizer.zero_grad()
            loss = F.mse_loss(model(batch[0]), batch[1])
            loss.backward()
            optimizer.step()
            return loss
        engine = Engine(update)
        engine.completed.append(History())
        engine.run(batches(4))
    with pytest.warns(GraphLeakWarning, match=r"held by `engine.completed\[0\].losses\[\d\]`"):
        with Watch(GraphGuard(check="always"), __file__):
            run()


def loop_with_a_scaled_backward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(16):
        loss = F.mse_loss(model(x), y)
        scaled_backward(loss)
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("check", ["always", "auto"])
def test_a_loss_the_library_scales_under_its_own_name_is_no_statistic_made_again(check):
    """The leak check of a statistic made again from its last value with a graph (DINO's center) compares a tensor's
    graph with what earlier looks saw: the loop's ``loss`` and the library's ``loss = loss / counts`` (mmengine's
    ``update_params``, accelerate's ``backward``), seen in one look, are not one tensor made again. Quiet under watch,
    trained as without it."""
    assert same(watched(loop_with_a_scaled_backward, check=check), loop_with_a_scaled_backward())


def test_graphs_a_library_keeps_where_the_loop_cannot_name_them_are_warned_once():
    """A library's own list keeps every step's loss (no variable of the loop holds it): the pile is warned once, its
    holder unnamed, however many steps keep adding to it."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = GraphGuard(model, check="always")
    try:
        with pytest.warns(GraphLeakWarning) as said:
            for x, y in batches(8):
                with guard.step():
                    loss = F.mse_loss(model(x), y)
                    enginelib.log_loss(loss)
                    guard.backward(loss)
                    opt.step()
                    opt.zero_grad()
    finally:
        enginelib.LOGGED.clear()
    leaks = [w for w in said if issubclass(w.category, GraphLeakWarning)]
    assert len(leaks) == 1, [str(w.message) for w in leaks]
    assert re.search(r"steps 1 and 2: the autograd graphs of both steps are still alive", str(leaks[0].message))
