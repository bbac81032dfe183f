"""Optimizers that make a training loop do unusual things, run from the same seeds, bare, under ``python -m
safeloop.watch``'s guard (``Watch``, in process, this file being the user's script) and with a ``safeloop.GraphGuard``
given the model and the optimizer (``with guard.step():`` around each step where natural):

- pytorch-optimizer 4.1.0: ``SAM`` (ASAM: ``adaptive=True``) as its README runs it, ``first_step`` / ``second_step``
  with two forward-backward passes in one step, and ``step(closure)`` with the closure re-running forward and
  backward between the perturbation and the update; ``AdaHessian`` and ``SophiaH`` after
  ``loss.backward(create_graph=True)`` (Hutchinson's estimate: ``torch.autograd.grad`` of the gradients inside
  ``step``); ``Lookahead`` wrapping AdamW (slow weights interpolated in place every ``k`` steps, swapped in for an
  evaluation with ``backup_and_load_cache``), with a ``StepLR``; ``ScheduleFreeAdamW``; ``Ranger21``, ``Lion``,
  ``Prodigy``, ``SOAP`` and ``Muon`` (with its AdamW group) in the plain loop;
- schedulefree 1.4.1: Facebook's ``AdamWScheduleFree``, ``optimizer.train()`` / ``optimizer.eval()`` swapping the
  parameters in place between y and x around an evaluation every few steps;
- torch-optimizer 0.3.0: ``Adahessian`` and ``Lookahead`` wrapping its ``RAdam``.

Every parameter, the optimizer's state (its ``state_dict()``: SAM's shared base state, the slow weights,
schedule-free's ``z``, the Hessian estimates) and the losses come out bit for bit the same, with no warning the bare
run does not emit, under ``check`` ``auto``, ``always`` and ``off``. The same loops as ``safeloop.Trainer`` ports
(the library optimizer from ``configure_optimizers``; SAM in manual mode with ``self.step(closure=...)`` and in
automatic mode; AdaHessian in manual mode with ``self.backward(loss, create_graph=True)``) train bit for bit as the
bare loop.

Then the mistakes of such loops (davda54/sam#45, kozistr/pytorch_optimizer#193, Liuhong99/Sophia#1): SAM's second
backward through the first pass's graph; AdaHessian or SophiaH without ``create_graph=True`` (the library's own
error, which a ``GraphGuard`` leaves as it is; under ``watch`` a ``NoGraphError`` naming the fix); gradients zeroed
by hand after a
``create_graph=True`` backward (PyTorch's own error inside ``step``; ``zero_grad(set_to_none=False)`` detaches and is
quiet); and two that change no graph and that the guard does not judge: a schedule-free
evaluation without ``optimizer.eval()``, and Lookahead's scheduler built on the base optimizer.
"""
import warnings
from copy import deepcopy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import safeloop
from safeloop import GraphGuard
from safeloop.errors import DoubleBackwardError
from safeloop.watch import Watch
from tests.libraries.compare import same, stepped, three_runs
from tests.realworld.harness import checks, strict

try:
    import pytorch_optimizer as po
except ImportError:
    po = None
try:
    import schedulefree
except ImportError:
    schedulefree = None
try:
    import torch_optimizer
except ImportError:
    torch_optimizer = None

needs_po = pytest.mark.skipif(po is None, reason="pytorch-optimizer is not installed")
needs_sf = pytest.mark.skipif(schedulefree is None, reason="schedulefree is not installed")
needs_to = pytest.mark.skipif(torch_optimizer is None, reason="torch-optimizer is not installed")


# -- what every loop trains -------------------------------------------------------------------------------------------
def mlp():
    """A tiny MLP whose second derivatives are not zero (tanh), for the Hessian-based optimizers."""
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def regression(n=6, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(n)]


def back(loss, guard, **kwargs):
    """``guard.backward(loss)`` with a guard, the README's ``loss.backward()`` without."""
    return guard.backward(loss, **kwargs) if guard is not None else loss.backward(**kwargs)


def state_of(optimizer):
    """The optimizer's ``state_dict()``; torch-optimizer's ``Lookahead``, which never ran ``Optimizer.__init__`` and
    whose ``state_dict()`` fails on torch 2.13 (no ``_optimizer_state_dict_pre_hooks``): its own state and its base
    optimizer's, parameter by parameter."""
    if torch_optimizer is not None and isinstance(optimizer, torch_optimizer.Lookahead):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {"fast": state_of(optimizer.optimizer), "slow": [dict(optimizer.state[p]) for p in params]}
    return optimizer.state_dict()


def built(make_optimizer):
    """``build`` for ``three_runs``: the model, its optimizer and the batches."""
    def build():
        model = mlp()
        return model, make_optimizer(model), regression()
    return build


def with_both(check, model, optimizer, _data):
    """The guard a user of the library makes: given the model (names) and the optimizer (steps)."""
    return GraphGuard(model, optimizer, check=check)


def runs(make_optimizer, train, check):
    """``three_runs`` of ``train`` on ``make_optimizer``'s model, the guard given the model and the optimizer."""
    return three_runs(built(make_optimizer), train, check, guard_for=with_both)


# == plain loops =====================================================================================================
def plain_loop(model, optimizer, data, guard=None, epochs=2):
    """The README loop: ``zero_grad``, forward, ``loss.backward()``, ``step``."""
    losses = []
    for _epoch in range(epochs):
        for x, y in data:
            with stepped(guard):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                back(loss, guard)
                optimizer.step()
            losses.append(loss.item())
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses}


def muon(model):
    """pytorch-optimizer's docstring: Muon on the hidden matrices, its AdamW group on the rest."""
    hidden = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return po.Muon([dict(params=hidden, lr=0.02, use_muon=True), dict(params=rest, lr=3e-3, use_muon=False)])


PLAIN = {
    "ranger21": lambda m: po.Ranger21(m.parameters(), num_iterations=12, lr=1e-2, lookahead_merge_time=3),
    "lion": lambda m: po.Lion(m.parameters(), lr=1e-3),
    "prodigy": lambda m: po.Prodigy(m.parameters(), lr=1.0),
    "soap": lambda m: po.SOAP(m.parameters(), lr=3e-3, precondition_frequency=2),
    "muon": muon,
    "lookahead": lambda m: po.Lookahead(torch.optim.AdamW(m.parameters(), lr=1e-2), k=3, alpha=0.5),
    "schedulefree_po": lambda m: po.ScheduleFreeAdamW(m.parameters(), lr=1e-2),
}


@needs_po
@pytest.mark.parametrize("name", list(PLAIN))
@pytest.mark.parametrize("check", checks())
def test_plain_loop(check, name):
    """Each optimizer in the README loop: bare, watched and guarded alike, bit for bit."""
    ref = runs(PLAIN[name], plain_loop, check)
    assert len(ref["losses"]) == 12


# == SAM =============================================================================================================
def sam(model, adaptive=False):
    return po.SAM(model.parameters(), torch.optim.SGD, rho=0.05, adaptive=adaptive, lr=0.1, momentum=0.9)


def sam_two_steps(model, optimizer, data, guard=None):
    """pytorch-optimizer's README, SAM's first form: two forward-backward passes, ``first_step`` climbing to
    w + e(w) in place between them, ``second_step`` going back to w and updating with the gradient at w + e(w)."""
    losses = []
    for x, y in data:
        with stepped(guard):
            loss = F.mse_loss(model(x), y)
            back(loss, guard)
            optimizer.first_step(zero_grad=True)
            back(F.mse_loss(model(x), y), guard)  # a full forward pass again, at w + e(w)
            optimizer.second_step(zero_grad=True)
        losses.append(loss.item())
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses}


def sam_closure(model, optimizer, data, guard=None, step=True):
    """The README's second form: the loss at w back-propagated, then ``optimizer.step(closure)``, whose closure
    re-runs the forward and backward at w + e(w). ``step``: inside ``with guard.step()`` (otherwise the guard, given
    the optimizer, ends a step at each ``optimizer.step``)."""
    losses = []
    for x, y in data:
        with stepped(guard if step else None):
            def closure():
                again = F.mse_loss(model(x), y)
                back(again, guard)
                return again

            loss = F.mse_loss(model(x), y)
            back(loss, guard)
            optimizer.step(closure)
            optimizer.zero_grad()
        losses.append(loss.item())
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses}


@needs_po
@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
@pytest.mark.parametrize("check", checks())
def test_sam_first_and_second_step(check, adaptive):
    """Two backwards a step, the weights written in place between them: quiet, bit for bit."""
    runs(lambda m: sam(m, adaptive), sam_two_steps, check)


@needs_po
@pytest.mark.parametrize("step", [True, False], ids=["guard_step", "optimizer_ends_step"])
@pytest.mark.parametrize("check", checks())
def test_sam_closure(check, step):
    """The closure's backward runs inside ``optimizer.step``: quiet, bit for bit, with ``with guard.step()`` or with
    the optimizer's step ending each step."""
    runs(sam, lambda *a, guard=None: sam_closure(*a, guard=guard, step=step), check)


# == Hessian-based: AdaHessian, SophiaH ==============================================================================
def hessian_loop(model, optimizer, data, guard=None, zero="none", create_graph=True):
    """pytorch-optimizer's docstring: ``loss.backward(create_graph=True)`` then ``step()``, whose Hutchinson estimate
    differentiates the gradients. ``zero``: ``"none"`` (``zero_grad()``), ``"zeros"`` (``zero_grad(set_to_none=False)``,
    which detaches each ``.grad`` before zeroing it) or ``"by_hand"`` (the mistake: ``p.grad.zero_()`` keeps each
    gradient's graph)."""
    losses = []
    for _epoch in range(2):
        for x, y in data:
            with stepped(guard):
                if zero == "by_hand":
                    for p in model.parameters():
                        if p.grad is not None:
                            p.grad.zero_()
                else:
                    optimizer.zero_grad(set_to_none=zero == "none")
                loss = F.mse_loss(model(x), y)
                back(loss, guard, create_graph=create_graph)
                optimizer.step()
            losses.append(loss.item())
    for p in model.parameters():  # the last gradients' graphs: dropped as the next zero_grad would
        p.grad = None
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses}


HESSIAN = {
    "adahessian": lambda m: po.AdaHessian(m.parameters(), lr=0.05),
    "adahessian_rademacher": lambda m: po.AdaHessian(m.parameters(), lr=0.05, hessian_distribution="rademacher",
                                                     num_samples=2, update_period=2),
    "sophiah": lambda m: po.SophiaH(m.parameters(), lr=0.05, update_period=2),
}


@needs_po
@pytest.mark.parametrize("name", list(HESSIAN))
@pytest.mark.parametrize("check", checks())
def test_hessian_optimizers(check, name):
    """``backward(create_graph=True)``, ``autograd.grad`` inside ``step``: quiet, bit for bit (the Hessian estimates
    in the optimizer's state too)."""
    ref = runs(HESSIAN[name], hessian_loop, check)
    assert all("exp_hessian_diag_sq" in s or "hessian_moment" in s for s in ref["optimizer"]["state"].values())


@needs_po
@pytest.mark.parametrize("check", checks())
def test_zero_grad_keeping_zeros_after_create_graph_is_quiet(check):
    """``zero_grad(set_to_none=False)``: torch's ``zero_grad`` detaches each ``.grad`` before zeroing it, so no graph
    is kept: quiet, bit for bit."""
    runs(HESSIAN["adahessian"], lambda *a, guard=None: hessian_loop(*a, guard=guard, zero="zeros"), check)


@needs_to
@pytest.mark.parametrize("check", checks())
def test_torch_optimizer_adahessian(check):
    """torch-optimizer's ``Adahessian`` (``torch.autograd.grad`` of the gradients with ``retain_graph=True``)."""
    runs(lambda m: torch_optimizer.Adahessian(m.parameters(), lr=0.05), hessian_loop, check)


# == Lookahead and schedule-free: weights swapped in place ===========================================================
def evaluate(model, data):
    with torch.no_grad():
        return sum(F.mse_loss(model(x), y).item() for x, y in data)


def lookahead_loop(model, optimizer, data, guard=None, on_base=False):
    """Lookahead(AdamW) with a ``StepLR`` stepped every batch (on the Lookahead, or ``on_base``: on the optimizer it
    wraps), and an evaluation of the slow weights every 4 steps (``backup_and_load_cache`` /
    ``clear_and_load_backup``)."""
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer.optimizer if on_base else optimizer, step_size=2, gamma=0.5)
    losses, evals = [], []
    for epoch in range(2):
        for i, (x, y) in enumerate(data):
            with stepped(guard):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                back(loss, guard)
                optimizer.step()
                scheduler.step()
            losses.append(loss.item())
            if (epoch * len(data) + i) % 4 == 3:
                optimizer.backup_and_load_cache()
                evals.append(evaluate(model, data))
                optimizer.clear_and_load_backup()
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses, "evals": evals,
            "lr": optimizer.param_groups[0]["lr"]}


def po_lookahead(model):
    return po.Lookahead(torch.optim.AdamW(model.parameters(), lr=1e-2), k=3, alpha=0.5)


@needs_po
@pytest.mark.parametrize("check", checks())
def test_lookahead_slow_weights_and_scheduler(check):
    """Slow weights interpolated in place every 3 steps, swapped in for evaluations: quiet, bit for bit."""
    ref = runs(po_lookahead, lookahead_loop, check)
    assert ref["lr"] < 1e-2 and len(ref["evals"]) == 3


@needs_to
@pytest.mark.parametrize("check", checks())
def test_torch_optimizer_lookahead(check):
    """torch-optimizer's ``Lookahead`` wrapping its ``RAdam`` in the README loop."""
    runs(lambda m: torch_optimizer.Lookahead(torch_optimizer.RAdam(m.parameters(), lr=1e-2), k=3), plain_loop, check)


def schedulefree_loop(model, optimizer, data, guard=None, evaluating=True):
    """schedulefree's README: ``optimizer.train()`` with ``model.train()`` before training, ``optimizer.eval()`` with
    ``model.eval()`` before each evaluation (every 3 steps, and at the end). ``evaluating=False``: the mistake of an
    evaluation without ``optimizer.eval()``, at the y sequence the gradients are taken at."""
    evals, losses = [], []
    model.train()
    optimizer.train()
    for epoch in range(2):
        for i, (x, y) in enumerate(data):
            with stepped(guard):
                optimizer.zero_grad()
                loss = F.mse_loss(model(x), y)
                back(loss, guard)
                optimizer.step()
            losses.append(loss.item())
            if i % 3 == 2:
                model.eval()
                if evaluating:
                    optimizer.eval()
                evals.append(evaluate(model, data))
                model.train()
                optimizer.train()
    optimizer.eval()
    return {"model": model, "optimizer": state_of(optimizer), "losses": losses, "evals": evals}


@needs_sf
@pytest.mark.parametrize("check", checks())
def test_schedulefree_train_eval_swaps(check):
    """``AdamWScheduleFree``: the parameters moved between y and x in place around every evaluation and at the end;
    quiet, bit for bit (``z`` in the state too)."""
    ref = runs(lambda m: schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, warmup_steps=2),
               schedulefree_loop, check)
    assert all("z" in s for s in ref["optimizer"]["state"].values()) and len(ref["evals"]) == 4


@needs_po
@pytest.mark.parametrize("check", checks())
def test_pytorch_optimizer_schedulefree_train_eval_swaps(check):
    """pytorch-optimizer's ``ScheduleFreeAdamW`` in the same loop (``p.data.lerp_``)."""
    runs(lambda m: po.ScheduleFreeAdamW(m.parameters(), lr=1e-2, warmup_steps=2), schedulefree_loop, check)


# == safeloop.Trainer ports ==========================================================================================
class OptimizerTrainer(safeloop.Trainer):
    """The default ``training_step`` (``mse_loss(model(x), y)``) with the library's optimizer."""

    def __init__(self, *args, build_optimizer, **kwargs):
        super().__init__(*args, **kwargs)
        self.build_optimizer = build_optimizer

    def configure_optimizers(self):
        return self.build_optimizer(self.model)


class SAMTrainer(OptimizerTrainer):
    """docs/trainer.md's SAM port in manual mode: the loss at w through ``self.backward``, the one at w + e(w) in the
    closure ``self.step`` hands SAM."""
    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)

        def perturbed():
            again = F.mse_loss(self.model(x), y)
            self.backward(again)
            return again

        self.step(closure=perturbed)
        return loss


class HessianTrainer(OptimizerTrainer):
    """Manual mode: ``self.backward(loss, create_graph=True)``, then ``self.step()``."""
    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss, create_graph=True)
        self.step()
        return loss


def trainer_versus(cls, make_optimizer, loop, check, epochs=2):
    """``loop`` bare, then ``cls`` on the same model, optimizer and batches for the same steps: the model and the
    optimizer's state bit for bit the same, with no warning the bare loop lacks."""
    def build():
        torch.manual_seed(0)
        model = mlp()
        return model, make_optimizer(model), regression()
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        ref = loop(*build())
    model, _, data = build()
    start = deepcopy(model)
    with strict(own):
        trainer = cls(model=model, train_data=data, max_steps=len(data) * epochs, device="cpu", progress=False,
                      loggers=(), guard={"check": check}, build_optimizer=make_optimizer)
        trainer.fit()
    same(model, ref["model"], "model")
    (optimizer,) = trainer.optimizers.values()
    same(state_of(optimizer), ref["optimizer"], "optimizer")
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())), "nothing trained"


@needs_po
@pytest.mark.parametrize("name", list(PLAIN))
@pytest.mark.parametrize("check", checks())
def test_trainer_with_library_optimizer(check, name):
    """``configure_optimizers`` returning the library's optimizer: as the README loop, bit for bit."""
    trainer_versus(OptimizerTrainer, PLAIN[name], plain_loop, check)


@needs_po
@pytest.mark.parametrize("check", checks())
def test_trainer_sam_manual_mode(check):
    """SAM in manual mode, ``self.step(closure=perturbed)``: as the README's closure loop, bit for bit."""
    trainer_versus(SAMTrainer, sam, sam_closure, check, epochs=1)


@needs_po
@pytest.mark.parametrize("check", checks())
def test_trainer_sam_automatic_mode(check):
    """SAM from ``configure_optimizers`` in automatic mode: the Trainer hands its ``step`` a closure re-running the
    step's forward and backward; as the README's closure loop, bit for bit."""
    trainer_versus(OptimizerTrainer, sam, sam_closure, check, epochs=1)


@needs_po
@pytest.mark.parametrize("name", list(HESSIAN))
@pytest.mark.parametrize("check", checks())
def test_trainer_hessian_manual_mode(check, name):
    """AdaHessian, SophiaH in manual mode with ``self.backward(loss, create_graph=True)``: bit for bit."""
    trainer_versus(HessianTrainer, HESSIAN[name], hessian_loop, check)


# == the mistakes ====================================================================================================
def sam_reusing_predictions(model, optimizer, data, guard=None):
    """davda54/sam#45: the second pass's loss made from the first pass's predictions, ``first_step`` having moved
    the weights that graph saved: PyTorch's answer is 'backward through the graph a second time'."""
    for x, y in data:
        with stepped(guard):
            predictions = model(x)
            loss = F.mse_loss(predictions, y)
            loss.backward() if guard is None else guard.backward(loss)
            optimizer.first_step(zero_grad=True)
            F.mse_loss(predictions, y).backward() if guard is None else guard.backward(F.mse_loss(predictions, y))
            optimizer.second_step(zero_grad=True)


SAM_REUSE = r"step 1, loss 'loss'\): the loss reaches .*held by `(local )?predictions`.*To fix: compute `predictions` " \
            r"again after the change \(a fresh forward\)"


@needs_po
def test_sam_second_pass_through_the_first_graph_is_stopped():
    """Stopped before the second backward writes any gradient, naming ``predictions`` and advising a fresh forward
    (retain_graph would back-propagate the values from before ``first_step``), with a guard and under ``watch``; the
    README's fresh forward trains quiet (``test_sam_first_and_second_step``)."""
    torch.manual_seed(0)
    model, optimizer, data = built(sam)()
    with pytest.raises(DoubleBackwardError, match=SAM_REUSE):
        sam_reusing_predictions(model, optimizer, data, guard=GraphGuard(model, optimizer, check="always"))
    assert all(p.grad is None for p in model.parameters())  # first_step(zero_grad=True) cleared; nothing written
    torch.manual_seed(0)
    with Watch(GraphGuard(check="auto"), __file__), pytest.raises(DoubleBackwardError, match=SAM_REUSE):
        sam_reusing_predictions(*built(sam)())


NO_CREATE_GRAPH = r"element 0 of tensors does not require grad and does not have a grad_fn"


@needs_po
@pytest.mark.parametrize("guarded", [False, True], ids=["bare", "guard"])
@pytest.mark.parametrize("name", ["adahessian", "sophiah"])
def test_hessian_without_create_graph_keeps_the_library_error(name, guarded):
    """``loss.backward()`` without ``create_graph=True``: the gradients have no graph, and ``autograd.grad`` inside
    ``step`` raises PyTorch's own error (kozistr/pytorch_optimizer#193), the same with a ``GraphGuard``: the guard
    neither hides it nor takes it for one of its own."""
    torch.manual_seed(0)
    model, optimizer, data = built(HESSIAN[name])()
    guard = GraphGuard(model, optimizer, check="always") if guarded else None
    with pytest.raises(RuntimeError, match=NO_CREATE_GRAPH) as raised:
        hessian_loop(model, optimizer, data, guard=guard, create_graph=False)
    assert type(raised.value) is RuntimeError


@needs_po
@pytest.mark.parametrize("name", ["adahessian", "sophiah"])
def test_hessian_without_create_graph_keeps_the_library_error_under_watch(name):
    """As above under ``watch``, which sees the optimizer's own ``autograd.grad`` of the gradients: a
    ``NoGraphError`` saying they are parameters' ``.grad`` made without ``create_graph=True``, with that fix."""
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__), \
            pytest.raises(safeloop.NoGraphError, match=r"it is a parameter's gradient \(\.grad\), made by a backward "
                                                       r"without create_graph=True.*`loss\.backward\(create_graph="
                                                       r"True\)`"):
        hessian_loop(*built(HESSIAN[name])(), create_graph=False)


@needs_po
@pytest.mark.parametrize("guarded", [False, True], ids=["bare", "guard"])
@pytest.mark.parametrize("name", ["adahessian", "sophiah"])
def test_gradients_zeroed_by_hand_after_create_graph_fail_in_the_library(name, guarded):
    """``p.grad.zero_()`` by hand after a ``create_graph=True`` backward keeps each gradient's graph; here it is no
    silent leak: the next Hutchinson ``autograd.grad`` inside ``step`` runs through the last step's graph, freed by the
    last estimate, and fails with PyTorch's own error (SophiaH: the in-place one), the same with a ``GraphGuard``. The fix,
    ``zero_grad()`` (``set_to_none=True``; ``set_to_none=False`` detaches first), trains quiet."""
    torch.manual_seed(0)
    model, optimizer, data = built(HESSIAN[name])()
    guard = GraphGuard(model, optimizer, check="always") if guarded else None
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation|backward through the graph a second"):
        hessian_loop(model, optimizer, data, guard=guard, zero="by_hand")


@needs_sf
def test_schedulefree_evaluation_without_optimizer_eval_is_not_the_guards():
    """An evaluation without ``optimizer.eval()`` scores the y sequence instead of the averaged x: a wrong number,
    and no graph mistake. The guard says nothing (it is not what it checks) and changes nothing: the loop trains bit
    for bit alike bare, watched and guarded, and its evaluations differ from the README's."""
    def make(m):
        return schedulefree.AdamWScheduleFree(m.parameters(), lr=1e-2, warmup_steps=2)
    wrong = runs(make, lambda *a, guard=None: schedulefree_loop(*a, guard=guard, evaluating=False), "always")
    right = runs(make, schedulefree_loop, "always")
    same(wrong["losses"], right["losses"])  # training is the same: only what the evaluations read differs
    assert wrong["evals"] != right["evals"]


@needs_po
def test_lookahead_scheduler_on_the_base_optimizer_is_not_a_mistake_here():
    """A ``StepLR`` built on the optimizer Lookahead wraps instead of the Lookahead: pytorch-optimizer's Lookahead
    shares its base optimizer's ``param_groups``, so both move the same learning rate and train alike; the guard
    is quiet either way."""
    on_base = runs(po_lookahead, lambda *a, guard=None: lookahead_loop(*a, guard=guard, on_base=True), "always")
    same(on_base, runs(po_lookahead, lookahead_loop, "always"))
