"""Mistakes the loss's graph alone does not show, in the Trainer and in a ``GraphGuard``
loop (``python -m safeloop.watch`` runs them in tests/watch/scripts): graphs kept outside the loss (model outputs
kept for an epoch metric; a ``.grad`` that ``backward(create_graph=True)`` gave a graph) warn naming the holder,
and a tensor an autograd Function keeps on its ``ctx`` and that is changed in place before backward stops the step.
Each fix the message gives is applied as written: the fixed program is quiet, and trains as without the guard."""
import copy
import io
import re
import sys
import warnings
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from safeloop import CarriedGraphError, GraphGuard, GraphLeakWarning, InplaceModificationError, Trainer, UnusedGradientWarning
from safeloop.watch import Watch
from tests.conftest import manual

DATA = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(4)]


@contextmanager
def quiet():
    """Every warning an error: the fixed programs warn nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- model outputs kept for an epoch metric ------------------------------------------------------------------------
class KeepsOutputs(Trainer):
    """The step outputs of sktime/pytorch-forecasting's BaseModel, appended to ``self.training_step_outputs`` for
    the epoch's metrics without ``.detach()`` (the leak its pull request #1924 fixed; TRI-ML/packnet-sfm #51 is the
    same with the loss): every step's graph stays alive in the list until the epoch ends."""

    detach = False

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        self.training_step_outputs.append(out.detach() if self.detach else out)  # the fix: at the append
        return F.cross_entropy(out, y)


def fit_outputs(cls, check: str, detach: bool = False):
    torch.manual_seed(0)
    cls.detach = detach
    trainer = cls(model=nn.Linear(4, 2), train_data=DATA, max_steps=len(DATA), guard={"check": check}, device="cpu",
                  progress=False, loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.training_step_outputs = []
    trainer.fit()
    accuracy = (torch.cat(trainer.training_step_outputs).argmax(1) == torch.cat([y for _, y in DATA])).float().mean()
    return weights(trainer.model), accuracy.item()


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("check", ["always", "auto"])
def test_outputs_kept_for_an_epoch_metric_warn_naming_the_list_with_the_fix_at_the_append(mode, check):
    cls = mode(KeepsOutputs)
    with pytest.warns(GraphLeakWarning) as caught:
        fit_outputs(cls, check)
    said, = [w for w in caught if w.category is GraphLeakWarning]
    leak = said.message
    assert leak.holder == "self.training_step_outputs[0]" and leak.step == 2
    assert said.filename == __file__  # the user's own line (trainer.fit()), not one of safeloop's
    assert "one more in `self.training_step_outputs` every step" in str(leak)
    assert leak.fixes[0].startswith("detach what is added to `self.training_step_outputs` where it is added "
                                    "(`self.training_step_outputs.append(x.detach())`")
    with quiet():
        fixed = fit_outputs(cls, check, detach=True)
    off = fit_outputs(cls, "off", detach=True)
    assert fixed[1] == off[1] and all(torch.equal(a, b) for a, b in zip(fixed[0], off[0]))


def classifier_loop(guard_check: str | None, keep) -> list[torch.Tensor]:
    """A hand-written loop training a linear classifier, each step's output handed to ``keep`` after the update;
    returns the trained weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    for x, y in DATA:
        out = model(x)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
        keep(out)
    return weights(model)


def outputs_loop(guard_check: str | None, detach: bool = False):
    """The same in a hand-written loop: ``all_outputs.append(out)`` for an accuracy at the end of the epoch."""
    all_outputs = []
    trained = classifier_loop(guard_check, lambda out: all_outputs.append(out.detach() if detach else out))
    return trained, torch.cat(all_outputs).argmax(1)


def test_outputs_kept_in_a_loop_warn_naming_the_list_and_the_fix_at_the_append_works():
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `local all_outputs[0]`")) as caught:
        outputs_loop("always")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert "`all_outputs.append(x.detach())`" in leak.fixes[0]
    with quiet():
        fixed = outputs_loop("always", detach=True)
    bare = outputs_loop(None, detach=True)
    assert torch.equal(fixed[1], bare[1]) and all(torch.equal(a, b) for a, b in zip(fixed[0], bare[0]))


def losses_kept_loop(epochs: int = 2, batches: int = 3) -> list[torch.Tensor]:
    """The ``fit_one_cycle`` of Jovian's "Zero to GANs" lesson (tests/realworld/test_one_cycle_resnet9.py):
    ``train_losses.append(loss)`` *before* ``loss.backward()``, the list started afresh each epoch for the epoch's
    mean. Returns the trained weights."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(batches)]
    for _ in range(epochs):
        train_losses = []
        for x, y in data:
            loss = F.cross_entropy(model(x), y)
            train_losses.append(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.stack(train_losses).mean().item()
    return weights(model)


@pytest.mark.parametrize("check", ["auto", "always"])
def test_losses_appended_before_their_backward_are_named_as_losses_with_the_detach_fix(check):
    """The list grows by the loss about to be back-propagated: its graph is the step's loss graph, not one that no
    loss uses, and ``torch.no_grad()`` is no fix for a loss (it could not be back-propagated)."""
    with Watch(GraphGuard(check=check), __file__):
        with pytest.warns(GraphLeakWarning, match="`local train_losses") as caught:
            watched = losses_kept_loop()
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert "no loss uses" not in str(leak) and "made from the graph of a loss" in str(leak)
    assert leak.fixes == [re.sub(r"\s+", " ", """detach what is added to `train_losses` where it is added
        (`train_losses.append(x.detach())`, and `train_losses[i] = x.detach()` where an item is replaced, as an
        image pool does; `x.item()` for a number to log), so that no step's graph stays alive in it""")]
    bare = losses_kept_loop()
    assert all(torch.equal(a, b) for a, b in zip(watched, bare, strict=True))


def evaluation_loop(guard_check: str | None, no_grad: bool = False, keep=None):
    """An evaluation after each update, outside the step and without ``torch.no_grad()``, its outputs kept for a
    metric at the end: torch-ema's ``with ema.average_parameters(): outputs.append(model(x_val))``
    (tests/libraries/test_ema_vq_sde_real.py). Each output keeps a graph of the model that no loss reaches;
    ``no_grad``: the fix. ``keep``: what keeps each output (default: the loop's ``val_outputs.append``)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    x_val = torch.randn(8, 4)
    val_outputs = []
    keep = keep or val_outputs.append
    for x, y in DATA:
        with guard.step() if guard else nullcontext():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            guard.backward(loss) if guard else loss.backward()
            opt.step()
        with torch.no_grad() if no_grad else nullcontext():
            keep(model(x_val))
    return weights(model), val_outputs


def test_evaluation_outputs_kept_outside_the_step_train_as_without_the_guard():
    _, kept = evaluation_loop(None)
    assert all(out.grad_fn is not None for out in kept)  # four graphs alive, none a loss's
    with quiet():
        fixed = evaluation_loop("always", no_grad=True)
    bare = evaluation_loop(None, no_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed[0] + fixed[1], bare[0] + bare[1]))


def test_evaluation_outputs_kept_with_their_graphs_outside_the_step_warn_naming_the_list():
    """Graphs no loss reaches, made between the steps and kept in a list: warned once the list has grown with its
    first graph alive, naming the list, with the evaluation's ``torch.no_grad()`` as the fix (quiet: above); under
    watch too."""
    with pytest.warns(GraphLeakWarning, match=re.escape("the first held by `local val_outputs[0]`")) as caught:
        evaluation_loop("always")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes[0].startswith("compute what is added to `val_outputs` under torch.no_grad()")
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match="`val_outputs`"):
        evaluation_loop(None)


class EvaluatingTrainer:
    """A hand-written trainer class: ``fit`` evaluates after each update, outside the step and without
    ``torch.no_grad()``, and keeps the outputs on ``self`` for a metric at the end (``evaluation_loop``'s list, held
    by an object of the script's own class). ``no_grad``: the fix."""

    def __init__(self, guard_check: str | None, no_grad: bool = False):
        torch.manual_seed(0)
        self.model = nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.guard = GraphGuard(self.model, self.opt, check=guard_check) if guard_check else None
        self.x_val, self.no_grad, self.val_outputs = torch.randn(8, 4), no_grad, []

    def fit(self):
        guard = self.guard
        for x, y in DATA:
            with guard.step() if guard else nullcontext():
                loss = F.cross_entropy(self.model(x), y)
                self.opt.zero_grad()
                guard.backward(loss) if guard else loss.backward()
                self.opt.step()
            with torch.no_grad() if self.no_grad else nullcontext():
                self.val_outputs.append(self.model(self.x_val))
        return weights(self.model), self.val_outputs


def test_evaluation_outputs_kept_on_the_trainers_object_warn_naming_its_list():
    with pytest.warns(GraphLeakWarning, match=re.escape("the first held by `self.val_outputs[0]`")) as caught:
        EvaluatingTrainer("always").fit()
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes == ["compute what is added to `self.val_outputs` under torch.no_grad() (`with torch.no_grad(): "
                          "out = model(x)`), or detach it where it is added (`self.val_outputs.append(x.detach())`)"]
    trainer = EvaluatingTrainer(None)
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match="`self.val_outputs`"):
        trainer.fit()
    with quiet():
        fixed = EvaluatingTrainer("always", no_grad=True).fit()
    bare = EvaluatingTrainer(None, no_grad=True).fit()
    assert all(torch.equal(a, b) for a, b in zip(fixed[0] + fixed[1], bare[0] + bare[1], strict=True))


def preds_loop(guard_check: str | None, detach: bool = False):
    """Probabilities kept for an epoch's AUROC as torchmetrics' ``MulticlassAUROC.update`` keeps them: reshaped under
    ``no_grad`` (``preds.transpose(0, 1).reshape(c, -1).T``), a view with no ``grad_fn`` of its own that keeps its
    base, graph and all; ``detach``: the fix, ``probs.detach()`` handed over."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    preds = []
    for x, y in DATA:
        out = model(x)
        probs = out.softmax(-1).detach() if detach else out.softmax(-1)
        loss = F.cross_entropy(out, y)
        opt.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
        with torch.no_grad():
            preds.append(probs.transpose(0, 1).reshape(2, -1).T)
    return weights(model), preds


def test_views_made_under_no_grad_and_kept_warn_naming_the_list():
    _, preds = preds_loop(None)
    assert preds[0].grad_fn is None and preds[0]._base.grad_fn is not None  # the graph, kept through the base
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `local preds[0]`")):
        preds_loop("always")
    with quiet():
        fixed = preds_loop("always", detach=True)
    bare = preds_loop(None, detach=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed[0] + fixed[1], bare[0] + bare[1]))


class LossTotal:
    """A callback summing the losses it is handed (skorch's ``on_batch_end``): the tensor with its graph, or
    ``loss.item()`` (the fix)."""

    def __init__(self, fix: bool):
        self.fix, self.total = fix, 0.0

    def on_batch_end(self, loss):
        self.total = self.total + (loss.item() if self.fix else loss)


class Fitter:
    """A library's fit loop: callbacks kept as (name, callback) pairs in a private list, called from a method of
    their own, so that no variable of the running functions holds one."""

    def __init__(self, model, callbacks):
        self.model, self._callbacks = model, [(type(cb).__name__, cb) for cb in callbacks]
        self.opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def fit(self, guard_check: str | None):
        guard = GraphGuard(self.model, self.opt, check=guard_check) if guard_check else None
        for x, y in DATA:
            loss = F.cross_entropy(self.model(x), y)
            self.opt.zero_grad()
            guard.backward(loss) if guard else loss.backward()
            self.opt.step()
            self._notify(loss)

    def _notify(self, loss):
        for _, callback in self._callbacks:
            callback.on_batch_end(loss)


def callback_loop(guard_check: str | None, fix: bool = False):
    torch.manual_seed(0)
    fitter = Fitter(nn.Linear(4, 2), [LossTotal(fix)])
    fitter.fit(guard_check)
    total = fitter._callbacks[0][1].total
    return weights(fitter.model) + [torch.as_tensor(total).detach()]


def test_a_graph_kept_by_a_callback_in_a_librarys_private_list_is_named_there():
    """The holder is found deeper than the two levels searched each step, once the graphs pile up: the loop's
    ``self``, its private list, the (name, callback) pair, the callback's attribute."""
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `self._callbacks[0][1].total`")):
        callback_loop("always")
    with quiet():
        fixed = callback_loop("always", fix=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, callback_loop(None, fix=True)))


LIBRARY_METRIC = '''
import torch


class Concat(torch.nn.Module):
    """A metric as torchmetrics writes one: ``update`` appends what it is handed to a list state."""

    def __init__(self):
        super().__init__()
        self.preds = []

    def update(self, preds):
        self.preds.append(preds)


class Bank:
    """A memory bank of negatives: ``push`` appends what it is handed, ``negatives`` stacks the last four."""

    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)

    def negatives(self):
        return torch.stack(self.items[-4:])
'''


@pytest.fixture
def metric_lib(tmp_path, monkeypatch):
    """``LIBRARY_METRIC`` importable as ``metric_lib``, from where this machine's pip would have put it."""
    from safeloop.guard import explain

    (tmp_path / "metric_lib.py").write_text(LIBRARY_METRIC)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(explain, "_INSTALLED", (str(tmp_path),))


def metric_loop(guard_check: str | None, detach: bool = False):
    from metric_lib import Concat  # an installed package's class (see the test)

    concat = Concat()
    trained = classifier_loop(guard_check, lambda out: concat.update(out.softmax(1).detach() if detach
                                                                      else out.softmax(1)))
    return trained + concat.preds


def test_a_list_an_installed_librarys_object_fills_is_fixed_where_the_loop_hands_it_the_tensors(metric_lib):
    """torchmetrics' ``auroc.update(probs, y)`` appends ``probs`` to ``auroc.preds``: the user writes no append, so the
    fix detaches what the loop hands the metric."""
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `concat.preds[0]`")) as caught:
        metric_loop("always")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes == ["detach the tensors the loop hands to `concat` where it calls it (`.detach()` on each "
                          "tensor argument): `concat`'s own code adds them to `concat.preds`, graphs and all"]
    with quiet():
        fixed = metric_loop("always", detach=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, metric_loop(None, detach=True), strict=True))


def evaluated_metric_loop(guard_check: str | None, no_grad: bool = False):
    """``evaluation_loop`` with the outputs handed to a metric of an installed library (``Concat.update``)."""
    from metric_lib import Concat  # an installed package's class (see the test)

    concat = Concat()
    trained, _ = evaluation_loop(guard_check, no_grad, keep=lambda out: concat.update(out.softmax(1)))
    return trained + concat.preds


def test_evaluation_outputs_an_installed_metric_keeps_are_fixed_where_the_loop_hands_them(metric_lib):
    with pytest.warns(GraphLeakWarning, match=re.escape("the first held by `concat.preds[0]`")) as caught:
        evaluated_metric_loop("always")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert leak.fixes == ["compute the tensors the loop hands to `concat` under torch.no_grad() (`with "
                          "torch.no_grad(): out = model(x)`), or detach them where it calls `concat`"]
    with quiet():
        fixed = evaluated_metric_loop("always", no_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, evaluated_metric_loop(None, no_grad=True), strict=True))


def bank_loop(guard_check: str | None, detach: bool = False):
    """Each step's features pushed to an installed library's memory bank (``Bank.push``), the next steps' loss pushing
    them away from the bank's; ``detach``: the fix, ``feats.detach()`` pushed."""
    from metric_lib import Bank  # an installed package's class (see the test)

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    bank = Bank()
    bank.push(torch.zeros(8, 3))
    for x, _ in DATA:
        feats = model(x)
        loss = (feats * bank.negatives().mean(0)).sum(1).mean() + feats.pow(2).mean()
        opt.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
        bank.push(feats.detach() if detach else feats)
    return weights(model)


def test_a_graph_an_installed_librarys_bank_keeps_for_the_next_loss_is_fixed_where_the_loop_hands_it(metric_lib):
    """The bank's list is the library's: the one fix is at the loop's ``bank.push(...)``, not an emptying of
    ``bank.items`` (the user's own list's second fix), which the library's code owns."""
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        bank_loop(None)
    with pytest.raises(CarriedGraphError, match=re.escape("held by `bank.items[1]`")) as caught:
        bank_loop("always")
    assert caught.value.fixes[:-1] == ["detach the tensors the loop hands to `bank` where it calls it (`.detach()` on "
                                       "each tensor argument): `bank`'s own code adds them to `bank.items`, graphs "
                                       "and all"]  # then trace=True's hint
    with quiet():
        fixed = bank_loop("always", detach=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, bank_loop(None, detach=True), strict=True))


# -- backward(create_graph=True): a .grad with a graph ---------------------------------------------------------------
def create_graph_loop(guard_check: str | None, zero: str):
    """The loop of davda54/ada-hessian's README ("you only need to set `create_graph=True` in the `backward()`
    call": ``loss.backward(create_graph=True); optimizer.step()``, with Adam standing in for AdaHessian), its
    gradients cleared as old code does (``p.grad.data.zero_()``), which keeps the graph on ``.grad``: each step's
    gradient graph is added to the last one's. ``zero``: how the gradients are cleared."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    guard = GraphGuard(model, optimizer, check=guard_check) if guard_check else None
    for x, _ in DATA:
        loss = model(x).pow(2).mean()
        if zero == "data":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.data.zero_()
        else:
            optimizer.zero_grad(set_to_none=True)  # the fix
        guard.backward(loss, create_graph=True) if guard else loss.backward(create_graph=True)
        optimizer.step()
    return weights(model)


class Jacobians:
    """A cache of derivatives keyed by (output, input), as DeepXDE's ``dde.grad`` keeps them until ``clear()``."""

    def __init__(self):
        self.Js = {}

    def __call__(self, ys, xs):
        key = (ys, xs)
        if key not in self.Js:
            self.Js[key] = torch.autograd.grad(ys, xs, torch.ones_like(ys), create_graph=True)[0]
        return self.Js[key]


def derivative_cache_loop(guard=None, clear=False, steps=6):
    """A physics-informed loss ``(u_x - cos x)^2`` through the cache, never cleared (the mistake: each step's ``u``
    and ``u_x`` stay in it with their graphs), or cleared at the end of each step (``clear``, the fix)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    x = torch.linspace(-1, 1, 16).reshape(-1, 1).requires_grad_()
    jacobian = Jacobians()
    for _ in range(steps):
        with guard.step() if guard else nullcontext():
            optimizer.zero_grad()
            u = net(x)
            loss = (jacobian(u, x) - torch.cos(x)).pow(2).mean()
            guard.backward(loss) if guard else loss.backward()
            optimizer.step()
            if clear:
                jacobian.Js.clear()
    return weights(net)


def test_a_cache_keyed_by_each_steps_tensors_is_named_by_their_shapes_and_cleared():
    """The holder's name shows a tensor key by its shape, not its values (which differ every step, so that the
    holder looked new every step and the pile was never reported), and the fix clears the cache; cleared, the loop
    is quiet and trains as without the guard. Under ``watch`` the cache is named from its own method (``self.Js``)."""
    pattern = r"held by `(jacobian|self)\.Js\[\(<tensor of shape \[16, 1\]>, <tensor of shape \[16, 1\]>\)\]`.*" \
              r"To fix: clear `(jacobian|self)\.Js` at the end of each step \(`\1\.Js\.clear\(\)`\)"
    with pytest.warns(GraphLeakWarning, match=pattern):
        derivative_cache_loop(GraphGuard(check="always"))
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match=pattern):
        derivative_cache_loop()
    bare = derivative_cache_loop(clear=True)
    with quiet():
        guarded = derivative_cache_loop(GraphGuard(check="always"), clear=True)
        with Watch(GraphGuard(check="always"), __file__):
            watched = derivative_cache_loop(clear=True)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(bare, guarded, watched))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True:UserWarning")
def test_a_grad_that_keeps_its_graph_across_steps_is_named_and_zero_grad_set_to_none_fixes_it():
    with pytest.warns(GraphLeakWarning, match=re.escape("held by `model.0.weight.grad`")) as caught:
        create_graph_loop("always", "data")
    leak, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert "backward(create_graph=True) gave the gradient a graph" in str(leak)
    assert leak.fixes[0].startswith("set the gradients to None before each backward "
                                    "(`optimizer.zero_grad(set_to_none=True)`")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphLeakWarning)
        fixed = create_graph_loop("always", "set_to_none")
    assert all(torch.equal(a, b) for a, b in zip(fixed, create_graph_loop(None, "set_to_none")))
    assert all(torch.equal(a, b) for a, b in zip(fixed, create_graph_loop(None, "data")))  # same update, no leak


# -- a tensor kept on ctx, changed in place --------------------------------------------------------------------------
class CtxLinear(torch.autograd.Function):
    """The ``LinearFunction`` of PyTorch's "Extending torch.autograd" notes, with its input and weight kept on ctx
    as attributes (``ctx.tensor1 = tensor1``, as in pytorch/pytorch#32625) instead of ``ctx.save_for_backward``:
    PyTorch checks the version of saved tensors only."""

    @staticmethod
    def forward(ctx, input, weight):
        ctx.input, ctx.weight = input, weight
        return input.mm(weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.mm(ctx.weight), grad_output.t().mm(ctx.input)


class Residual(nn.Module):
    """A residual block written to save memory, ``h += block(h)``: the in-place add changes ``h``, which the
    Function keeps, after the Function ran. ``h = h + block(h)`` is the fix."""

    inplace = True

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.weight = nn.Parameter(torch.randn(4, 4) * 0.5)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = self.inp(x)
        if self.inplace:
            h += CtxLinear.apply(h, self.weight)
        else:
            h = h + CtxLinear.apply(h, self.weight)
        return self.head(h)


class TrainsResidual(Trainer):
    def training_step(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)


def fit_residual(cls, check: str, inplace: bool):
    torch.manual_seed(0)
    model = Residual()
    model.inplace = inplace
    cls(model=model, train_data=DATA, max_steps=len(DATA), guard={"check": check}, device="cpu", progress=False,
        loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)).fit()
    return weights(model)


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
@pytest.mark.parametrize("check", ["always", "auto"])
def test_a_tensor_kept_on_ctx_and_changed_in_place_stops_the_first_step_before_backward(mode, check):
    cls = mode(TrainsResidual)
    with pytest.raises(InplaceModificationError) as caught:
        fit_residual(cls, check, inplace=True)
    err = caught.value
    assert err.step == 1 and err.node_name == "CtxLinearBackward" and "The step was abandoned" in str(err)
    assert "the node of the autograd Function `CtxLinear`, which keeps a tensor made in the step as an attribute " \
           "of its ctx (`ctx.input`) instead of saving it with ctx.save_for_backward" in str(err)
    assert err.fixes[0].startswith("change it out of place (`x = x + 1` rather than `x += 1`")
    with quiet():
        fixed = fit_residual(cls, check, inplace=False)
    assert all(torch.equal(a, b) for a, b in zip(fixed, fit_residual(cls, "off", inplace=False)))


def residual_loop(guard_check: str | None, inplace: bool, ignore=()):
    torch.manual_seed(0)
    model = Residual()
    model.inplace = inplace
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check, ignore=ignore) if guard_check else None
    for x, y in DATA:
        h = model.inp(x)
        if inplace:
            h += CtxLinear.apply(h, model.weight)
        else:
            h = h + CtxLinear.apply(h, model.weight)
        loss = F.cross_entropy(model.head(h), y)
        opt.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
    return weights(model)


def test_a_tensor_kept_on_ctx_and_changed_in_place_in_a_loop_is_named_and_can_be_ignored():
    with pytest.raises(InplaceModificationError, match=re.escape("which keeps `local h` as an attribute of its ctx "
                                                                 "(`ctx.input`)")) as caught:
        residual_loop("always", True)
    assert caught.value.step == 1 and caught.value.holder == "local h"
    with warnings.catch_warnings():  # turned off, it trains as without the guard (wrongly, as PyTorch does)
        # (and the graph leaks: ctx.input holds the in-place add's node, which holds the Function's: a cycle)
        warnings.simplefilter("ignore", GraphLeakWarning)
        ignored = residual_loop("always", True, ignore=["inplace"])
    assert all(torch.equal(a, b) for a, b in zip(ignored, residual_loop(None, True)))


class KeepsUnread(torch.autograd.Function):
    """A straight-through rounding that keeps its input on ctx and never reads it in backward (``round_func5`` of a
    public quantization model: ``ctx.input = input``; backward returns ``grad_output.clone()``): changing that
    input in place afterwards changes no gradient, and nothing is said."""

    @staticmethod
    def forward(ctx, input):
        ctx.input = input
        return torch.round(5 * input) / 5

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.clone()


def test_a_tensor_kept_on_ctx_that_backward_never_reads_may_change():
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check="always")
    with quiet():
        for x, _ in DATA:
            h = model(x)
            rounded = KeepsUnread.apply(h).sum()
            h.relu_()
            guard.backward(rounded + h.sum())
            opt.step()
            opt.zero_grad()


# -- guard.ignore for the unused-gradient check ------------------------------------------------------------------------
def test_the_unused_gradient_check_has_an_ignore_name():
    """A part of a model deliberately left out of the optimizer, which looks like a layer in a plain list."""

    class Frozen(nn.Module):
        def __init__(self):
            super().__init__()
            self.kept = [nn.Linear(4, 4)]  # no optimizer on purpose
            self.out = nn.Linear(4, 2)

        def forward(self, x):
            return self.out(self.kept[0](x))

    for ignore, said in ((), 1), (["unused"], 0):
        model = Frozen()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = GraphGuard(model, opt, check="always", ignore=ignore)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in DATA[:2]:
                guard.backward(F.cross_entropy(model(x), y))
                opt.step()
                opt.zero_grad()
        assert len([w for w in caught if w.category is UnusedGradientWarning]) == said
    model = Frozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check="always")
    with quiet():
        for x, y in DATA[:2]:
            with guard.ignore("unused"):
                guard.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()


# -- a parameter written through .data between a forward and its backward (check=always) -------------------------
def gan_data(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 4, generator=gen) + 1, torch.randn(8, 4, generator=gen)) for _ in range(4)]


GAN_DATA = gan_data(0)


class Critic(Trainer):
    """The critic step of martinarjovsky/WassersteinGAN's main.py, whose weight clipping ("clamp parameters to a
    cube": ``p.data.clamp_(opt.clamp_lower, opt.clamp_upper)``) comes first; ``clip_after``: moved after the
    critic's forward, so backward computes with clipped weights what the forward did with the others."""

    clip_after = True

    def clip(self):
        for p in self.model.parameters():
            p.data.clamp_(-0.01, 0.01)

    def training_step(self, batch):
        real, fake = batch
        if not self.clip_after:
            self.clip()
        err = self.model(fake).mean() - self.model(real).mean()
        if self.clip_after:
            self.clip()
        return err


def fit_critic(cls, check: str, clip_after: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    cls.clip_after = clip_after
    cls(model=model, train_data=GAN_DATA, max_steps=len(GAN_DATA), guard={"check": check}, device="cpu",
        progress=False, loggers=(), optimizer=lambda p: torch.optim.RMSprop(p, lr=5e-5)).fit()
    return weights(model)


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_weights_clipped_through_data_after_the_forward_stop_the_second_step_under_check_always(mode):
    cls = mode(Critic)
    with pytest.raises(InplaceModificationError) as caught:
        fit_critic(cls, "always", clip_after=True)
    err = caught.value
    assert err.step == 2 and err.holder == "self.model.2.weight" and "The step was abandoned" in str(err)
    assert "whose graph saved `self.model.2.weight`, written since the forward that used them by a write PyTorch's " \
           "version counter does not see (through `.data`" in str(err)
    assert err.fixes[0].startswith("write them before the forward that uses them")
    with quiet():  # the fix, and check=auto (no fingerprints: a write through .data goes unseen there)
        fixed = fit_critic(cls, "always", clip_after=False)
        fit_critic(cls, "auto", clip_after=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, fit_critic(cls, "off", clip_after=False)))


@pytest.mark.parametrize("seed", [19, 25, 26])
def test_clipping_that_raises_as_many_weights_as_it_lowers_is_seen_at_the_second_step(seed, monkeypatch):
    """With these batches the second step's clipping lowers as many of the last layer's weights by 5e-4 (RMSprop's
    first update, from the clip bound) as it raises: their sum stays the same, their norm does not."""
    monkeypatch.setattr(sys.modules[__name__], "GAN_DATA", gan_data(seed))
    with pytest.raises(InplaceModificationError) as caught:
        fit_critic(Critic, "always", clip_after=True)
    assert caught.value.step == 2 and caught.value.holder == "self.model.2.weight"


class ClipBetween(Critic):
    """The clipping between the critic's two forwards: the first forward's graph saved the weights it used."""

    def training_step(self, batch):
        real, fake = batch
        d_real = self.model(real)
        self.clip()
        return self.model(fake).mean() - d_real.mean()


def test_weights_clipped_between_two_forwards_of_the_critic_stop_the_second_step_under_check_always():
    with pytest.raises(InplaceModificationError) as caught:
        fit_critic(ClipBetween, "always", clip_after=True)
    assert caught.value.step == 2 and caught.value.holder == "self.model.2.weight"
    assert "written since the forward that used them by a write PyTorch's version counter does not see" \
        in str(caught.value)


class ClipInHook(Critic):
    """The clipping in ``on_before_backward``: after the forward that saved the weights, before the backward."""

    def training_step(self, batch):
        real, fake = batch
        return self.model(fake).mean() - self.model(real).mean()

    def on_before_backward(self, name, loss):
        self.clip()


@pytest.mark.parametrize("mode", [lambda cls: cls, manual], ids=["automatic", "manual"])
def test_weights_clipped_through_data_in_on_before_backward_stop_the_second_step_under_check_always(mode):
    """The hook runs after the pre-flight: its writes are compared with the forward's fingerprints again."""
    with pytest.raises(InplaceModificationError) as caught:
        fit_critic(mode(ClipInHook), "always", clip_after=True)
    assert caught.value.step == 2 and caught.value.holder == "self.model.2.weight"
    assert "written since the forward that used them by a write PyTorch's version counter does not see" \
        in str(caught.value)


class DataSGD(torch.optim.Optimizer):
    """SGD as older optimizers are written: the update through ``p.data``, which moves no version counter."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


class DataGAN(Trainer):
    """The critic updated through ``.data`` between its two forwards of the step: the second forward's graph is
    made from the updated weights, the first's was back-propagated before the update."""

    automatic = False

    def configure_optimizers(self):
        return {"d": DataSGD(self.model[2].parameters(), lr=0.01), "g": DataSGD(self.model[0].parameters(), lr=0.01)}

    def training_step(self, batch):
        real, noise = batch
        gen, critic = self.model[0], self.model[2]
        fake = gen(noise)
        d_loss = critic(fake.detach()).mean() - critic(real).mean()
        self.backward(d_loss, optimizer="d")
        self.step("d")
        g_loss = -critic(fake).mean()
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}


def test_an_optimizer_updating_through_data_between_two_forwards_of_a_module_is_no_mistake():
    def fit(check: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2),
                                                                             nn.Linear(8, 1)))
        DataGAN(model=model, train_data=GAN_DATA, max_steps=len(GAN_DATA), guard={"check": check}, device="cpu",
                progress=False, loggers=()).fit()
        return weights(model)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checked = fit("always")
    assert all(torch.equal(a, b) for a, b in zip(checked, fit("off")))


def critic_loop(guard_check: str | None, clip_after: bool):
    torch.manual_seed(0)
    netD = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    optimizerD = torch.optim.RMSprop(netD.parameters(), lr=5e-5)
    guard = GraphGuard(netD, optimizerD, check=guard_check) if guard_check else None
    for real, fake in GAN_DATA:
        if not clip_after:
            for p in netD.parameters():
                p.data.clamp_(-0.01, 0.01)
        errD = netD(fake).mean() - netD(real).mean()
        if clip_after:
            for p in netD.parameters():
                p.data.clamp_(-0.01, 0.01)
        optimizerD.zero_grad()
        guard.backward(errD) if guard else errD.backward()
        optimizerD.step()
    if guard:
        guard.close()
    return weights(netD)


def test_weights_clipped_through_data_after_the_forward_in_a_loop_are_named_and_the_fix_is_quiet():
    """Only parameters a node saved count: the first layer's weight is not saved (its input needs no gradient),
    nor are the biases, so their new values change no gradient."""
    with pytest.raises(InplaceModificationError, match=re.escape("whose graph saved `netD.2.weight`, written")):
        critic_loop("always", clip_after=True)
    with quiet():
        fixed = critic_loop("always", clip_after=False)
    assert all(torch.equal(a, b) for a, b in zip(fixed, critic_loop(None, clip_after=False)))


class GradientProbe(Trainer):
    """DARTS' finite-difference step (quark0/darts, architect.py): a forward whose graph goes to
    ``torch.autograd.grad`` only, the weights moved through ``.data`` and back, then a fresh forward for the loss,
    whose graph saved the values it saw."""

    def training_step(self, batch):
        real, fake = batch
        probe = self.model(real).mean()
        grads = torch.autograd.grad(probe, list(self.model.parameters()))
        for p, g in zip(self.model.parameters(), grads):
            p.data.add_(g, alpha=0.01)
            p.data.sub_(g, alpha=0.02)
            p.data.add_(g, alpha=0.01)
        return self.model(fake).mean() - self.model(real).mean()


class DroppedForward(Critic):
    """A forward whose output is dropped, then the clipping, then the loss's forwards (clipped weights)."""

    def training_step(self, batch):
        real, fake = batch
        self.model(real)
        self.clip()
        return self.model(fake).mean() - self.model(real).mean()


@pytest.mark.parametrize("cls", [GradientProbe, DroppedForward])
def test_a_data_write_after_a_forward_the_loss_does_not_hold_is_no_mistake_under_check_always(cls):
    with quiet():
        checked = fit_critic(cls, "always", clip_after=True)
    assert all(torch.equal(a, b) for a, b in zip(checked, fit_critic(cls, "off", clip_after=True)))


def save_whole_model_loop(guard_check: str | None) -> list[bytes]:
    """pytorch/examples' word_language_model saves the whole module (``torch.save(model, f)``) inside its loop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    saved = []
    for x in torch.randn(3, 4, 3):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        guard.backward(loss) if guard else loss.backward()
        opt.step()
        buffer = io.BytesIO()
        torch.save(model, buffer)
        saved.append(buffer.getvalue())
    assert not copy.deepcopy(model)[0]._forward_hooks  # a copy holds none of the guard's hooks either
    return saved


def test_a_model_saved_whole_under_check_always_is_the_bytes_saved_without_the_guard():
    """The fingerprints' forward hooks stay out of what the module pickles: a local function pickle cannot save, and
    nothing of safeloop belongs in a user's file."""
    with quiet():
        assert save_whole_model_loop("always") == save_whole_model_loop(None)


def swapped_teacher_loop(guard_check: str | None, no_grad: bool):
    """A mean teacher whose prediction is made with the averaged weights swapped into the student and back through
    ``.data`` (torch-ema's ``with ema.average_parameters():``, tests/libraries/test_ema_vq_sde_real.py); the mistake:
    the teacher's forward without ``torch.no_grad()``, so the loss back-propagates through a graph that saved the
    weights while they held the averages, and holds the student's values now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shadow = [p.detach().clone() for p in model.parameters()]
    guard = GraphGuard(model, opt, check=guard_check) if guard_check else None
    for x, y in DATA:
        with guard.step() if guard else nullcontext():
            logits = model(x)
            stored = [p.detach().clone() for p in model.parameters()]
            for p, s in zip(model.parameters(), shadow):
                p.data.copy_(s)
            with torch.no_grad() if no_grad else nullcontext():
                teacher = model(x).softmax(-1)
            for p, s in zip(model.parameters(), stored):
                p.data.copy_(s)
            loss = F.cross_entropy(logits, y) + F.kl_div(logits.log_softmax(-1), teacher, reduction="batchmean")
            opt.zero_grad()
            guard.backward(loss) if guard else loss.backward()
            opt.step()
            with torch.no_grad():
                for p, s in zip(model.parameters(), shadow):
                    s.lerp_(p, 0.1)
    return weights(model) + shadow


def test_a_teacher_made_with_weights_swapped_through_data_is_advised_no_grad_and_the_fix_is_quiet():
    """Stopped at step 2 under ``check=always`` (at step 1 the averages are the weights), naming the weights; among
    the fixes, the teacher's ``torch.no_grad()``, which trains quiet and as without the guard."""
    with pytest.raises(InplaceModificationError, match=r"step 2, .*whose graph saved `model\.\d\.weight`") as caught:
        swapped_teacher_loop("always", no_grad=False)
    assert any("a teacher's prediction" in fix and "compute it under torch.no_grad()" in fix
               for fix in caught.value.fixes)
    with quiet():
        fixed = swapped_teacher_loop("always", no_grad=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, swapped_teacher_loop(None, no_grad=True)))


# -- an EMA copy written outside torch.no_grad() -------------------------------------------------------------------
class EmaTeacher(Trainer):
    """Mean teacher's shape: a frozen EMA copy of the model (``self.ema``) moved after each step. Written without
    torch.no_grad() (``fix`` False), its parameters hold a graph of every update: with ``in_loss`` the consistency
    loss back-propagates through it into the model (from step 2 on, gradients PyTorch accepts until a freed multiply
    is reached), otherwise the graph only piles up (a generator's EMA, sampled from under no_grad)."""

    fix, in_loss = False, True

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        if self.in_loss:
            loss = loss + F.mse_loss(out.softmax(1), self.ema(x).softmax(1))
        return loss

    def on_step_end(self, losses):
        with torch.no_grad() if self.fix else nullcontext():
            for ema_p, p in zip(self.ema.parameters(), self.model.parameters()):
                ema_p.mul_(0.9).add_(p, alpha=0.1)


def fit_ema(check: str, fix: bool, in_loss: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    EmaTeacher.fix, EmaTeacher.in_loss = fix, in_loss
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    trainer = EmaTeacher(model=model, train_data=DATA, max_steps=len(DATA), guard={"check": check}, device="cpu",
                         progress=False, loggers=(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.ema = copy.deepcopy(model).requires_grad_(False)
    trainer.fit()
    return weights(trainer.model) + [p.detach().clone() for p in trainer.ema.parameters()]


@pytest.mark.parametrize("check", ["always", "auto"])
def test_an_ema_copy_written_outside_no_grad_is_stopped_where_a_loss_reaches_it_and_the_fix_trains_as_intended(check):
    said = re.escape("(step 2, loss 'loss'): the loss reaches AddBackward0, the graph of the parameter "
                     "`self.ema.0.weight`")
    with pytest.warns(GraphLeakWarning, match=re.escape("(step 1): the parameters `self.ema.0.weight`")), \
            pytest.raises(CarriedGraphError, match=said) as caught:
        fit_ema(check, fix=False, in_loss=True)
    assert caught.value.fixes[0].startswith("make that write under `torch.no_grad()`")
    with quiet():
        fixed = fit_ema(check, fix=True, in_loss=True)
    assert all(torch.equal(a, b) for a, b in zip(fixed, fit_ema("off", fix=True, in_loss=True)))


def test_an_ema_copy_written_outside_no_grad_and_in_no_loss_warns_once_naming_its_parameters():
    with pytest.warns(GraphLeakWarning) as caught:
        kept = fit_ema("auto", fix=False, in_loss=False)
    said, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert said.holder == "self.ema.0.weight" and said.fixes[0].startswith("make that write under `torch.no_grad()`")
    assert "`self.ema.0.weight`, `self.ema.0.bias`, `self.ema.2.weight` and 1 more hold an autograd graph" in str(said)
    with quiet():
        fixed = fit_ema("auto", fix=True, in_loss=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, fixed))  # the warning changes nothing


class GanWithEma(Trainer):
    """Manual mode, two optimizers: a GAN whose generator's EMA copy (``self.g_ema``, BigGAN's G_ema) is moved in
    ``on_step_end`` and sampled from under no_grad; written without torch.no_grad() (``fix`` False)."""

    automatic, fix = False, False

    def configure_optimizers(self):
        return {"d": torch.optim.SGD(self.model.d.parameters(), lr=0.05),
                "g": torch.optim.SGD(self.model.g.parameters(), lr=0.05)}

    def training_step(self, batch):
        real, _ = batch
        fake = self.model.g(torch.randn(8, 2))
        d_loss = F.softplus(self.model.d(fake.detach())).mean() + F.softplus(-self.model.d(real)).mean()
        self.backward(d_loss, optimizer="d")
        self.step("d")
        g_loss = F.softplus(-self.model.d(fake)).mean()
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}

    def on_step_end(self, losses):
        with torch.no_grad() if self.fix else nullcontext():
            for ema_p, p in zip(self.g_ema.parameters(), self.model.g.parameters()):
                ema_p.mul_(0.99).add_(p, alpha=0.01)


def fit_gan_ema(check: str, fix: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.ModuleDict({"g": nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 4)),
                           "d": nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))})
    GanWithEma.fix = fix
    trainer = GanWithEma(model=model, train_data=DATA, max_steps=len(DATA), guard={"check": check}, device="cpu",
                         progress=False, loggers=())
    trainer.g_ema = copy.deepcopy(model.g).requires_grad_(False)
    trainer.fit()
    return weights(trainer.model) + [p.detach().clone() for p in trainer.g_ema.parameters()]


@pytest.mark.parametrize("check", ["always", "auto"])
def test_a_generators_ema_written_outside_no_grad_in_manual_mode_with_two_optimizers_warns_and_changes_nothing(check):
    with pytest.warns(GraphLeakWarning, match=re.escape("(step 1): the parameters `self.g_ema.0.weight`, "
                                                        "`self.g_ema.0.bias`, `self.g_ema.2.weight` and 1 more")):
        kept = fit_gan_ema(check, fix=False)
    with quiet():
        fixed = fit_gan_ema(check, fix=True)
    assert all(torch.equal(a, b) for a, b in zip(kept, fixed))
    assert all(torch.equal(a, b) for a, b in zip(fixed, fit_gan_ema("off", fix=True)))


def test_a_guard_given_the_ema_copy_as_part_of_its_model_warns_only_its_own_warning():
    """The copy's parameters, written outside no_grad, are no longer leaves: they are not taken for trained parameters,
    whose `.grad` the guard reads (PyTorch warns on a non-leaf's), and only the GraphLeakWarning is shown."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(nn.ModuleDict({"model": model, "ema": ema}), opt, check="always")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, y in DATA:
            with guard.step():
                loss = F.cross_entropy(model(x), y)
                guard.backward(loss)
                opt.step()
                opt.zero_grad()
                for ema_p, p in zip(ema.parameters(), model.parameters()):
                    ema_p.mul_(0.9).add_(p, alpha=0.1)
    assert [w.category for w in caught] == [GraphLeakWarning], [str(w.message) for w in caught]
    assert "`model.ema.0.weight`" in str(caught[0].message)
    assert [id(p) for p in guard.scope.parameters()] == [id(p) for p in model.parameters()]


# -- a running statistic made again from itself outside no_grad ----------------------------------------------------
def d2l_batch_norm(X, gamma, beta, moving_mean, moving_var, eps, momentum, data):
    """d2l-en's ``batch_norm`` from scratch (chapter_convolutional-modern/batch-norm.md): in training, the moving
    statistics are made again from their last values and the batch's; returned without ``.data`` before d2l-ai/d2l-en
    #1342 (``data`` False), they keep the graph of every batch so far (pytorch/pytorch#20275, nflows #10)."""
    if not torch.is_grad_enabled():
        X_hat = (X - moving_mean) / torch.sqrt(moving_var + eps)
    else:
        mean = X.mean(dim=0)
        var = ((X - mean) ** 2).mean(dim=0)
        X_hat = (X - mean) / torch.sqrt(var + eps)
        moving_mean = (1.0 - momentum) * moving_mean + momentum * mean
        moving_var = (1.0 - momentum) * moving_var + momentum * var
    Y = gamma * X_hat + beta
    return (Y, moving_mean.data, moving_var.data) if data else (Y, moving_mean, moving_var)


class D2lBatchNorm(nn.Module):
    data = True

    def __init__(self, num_features):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(num_features))
        self.beta = nn.Parameter(torch.zeros(num_features))
        self.moving_mean = torch.zeros(num_features)
        self.moving_var = torch.ones(num_features)

    def forward(self, X):
        Y, self.moving_mean, self.moving_var = d2l_batch_norm(
            X, self.gamma, self.beta, self.moving_mean, self.moving_var, eps=1e-5, momentum=0.1, data=self.data)
        return Y


def d2l_batch_norm_loop(check: str | None, data: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    D2lBatchNorm.data = data
    model = nn.Sequential(nn.Linear(4, 8), D2lBatchNorm(8), nn.Sigmoid(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = GraphGuard(model, opt, check=check) if check else None
    for x, y in DATA:
        with guard.step() if guard else nullcontext():
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            guard.backward(loss) if guard else loss.backward()
            opt.step()
    with torch.no_grad():
        return weights(model) + [model[1].moving_mean.clone(), model[1].moving_var.clone(), model(DATA[0][0])]


@pytest.mark.parametrize("check", ["always", "auto"])
def test_moving_statistics_made_again_from_themselves_outside_no_grad_warn_once_naming_them(check):
    """No loss reads the moving statistics in training, but their graph holds each step's batch forward: the graphs
    of two steps alive at once, named by the first statistic. `.data` (d2l's fix) is quiet and trains the same weights
    and statistics."""
    with pytest.warns(GraphLeakWarning) as caught:
        kept = d2l_batch_norm_loop(check, data=False)
    said, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert said.holder == "model[1].moving_mean" and "steps 1 and 2" in str(said)
    with quiet():
        fixed = d2l_batch_norm_loop(check, data=True)
    bare = d2l_batch_norm_loop(None, data=False)
    assert all(torch.equal(a, b) for a, b in zip(kept, bare)) and all(torch.equal(a, b) for a, b in zip(fixed, bare))
    with quiet():
        assert all(torch.equal(a, b) for a, b in zip(d2l_batch_norm_loop("off", data=False), bare))


def test_moving_statistics_kept_with_their_graphs_are_told_to_be_kept_detached_not_as_a_loss():
    """A tensor of several values is no loss: the fix is not `loss.item()`."""
    with pytest.warns(GraphLeakWarning) as caught:
        d2l_batch_norm_loop("always", data=False)
    said, = [w.message for w in caught if w.category is GraphLeakWarning]
    assert "loss.item()" not in str(said) and "not a loss" in str(said)
    assert said.fixes[0].startswith("store `model[1].moving_mean` detached, or make it under `torch.no_grad()`")
