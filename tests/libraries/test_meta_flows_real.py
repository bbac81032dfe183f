"""Meta-learning and normalizing flows, run from the same seeds:

- higher 0.2.1 (facebookresearch/higher, examples/maml-omniglot.py): ``higher.innerloop_ctx(net, inner_opt,
  copy_initial_weights=False)`` gives a patched ``fnet`` and a differentiable ``diffopt`` whose ``step(loss)`` calls
  ``torch.autograd.grad(loss, fast_weights, create_graph=track_higher_grads)``; each task's query loss is
  back-propagated through the unrolled inner loop into the net's initial weights (second order), one
  ``qry_loss.backward()`` per task or one backward of their mean. First order (``track_higher_grads=False``: every
  inner step detaches the fast weights) the query loss reaches no weight of ``net``: its gradient is taken with
  ``torch.autograd.grad(qry_loss, fnet.parameters())`` and added to the weights' ``.grad`` by hand (higher issue #63).
  higher imports and runs on torch 2.13 as it is;
- the same MAML written by hand with ``torch.func.functional_call`` and ``torch.autograd.grad`` (``create_graph=True``
  for the second order), as the plain-torch reference, also as ``safeloop.Trainer`` ports (``training_step`` returning
  the meta loss; manual mode with one ``self.backward`` per task);
- zuko 1.6.0's README loop (``loss = -flow(c).log_prob(x).mean()``) with conditional ``NSF`` and ``MAF``;
- normflows 1.7.3's README loop (a Real NVP of ``AffineCouplingBlock``s and ``Permute``s on ``TwoMoons``, ``loss =
  model.forward_kld(x)``, the backward and the update skipped when the loss is NaN or infinite).

Each runs bare, under ``python -m safeloop.watch``'s guard (``Watch``, in process, this file being the user's script)
and with a ``safeloop.GraphGuard`` (``with guard.step()`` around a meta-batch or an iteration, ``guard.backward``,
no guard call for a gradient taken with ``torch.autograd.grad``: ``guard.check`` cannot tell it from a backward and
would warn that it trains no parameter), in every guard mode. Every parameter and buffer,
the optimizers' state and what the loop records must come out bit for bit the same, with no warning the bare run does
not emit.

Then the mistakes: fast weights made with ``.detach().requires_grad_()``, higher's ``track_higher_grads=False`` and
``copy_initial_weights=True`` with the query loss back-propagated (nothing reaches the initial weights), a running
meta-loss kept with its graph, fast weights updated in place (``fast[k] -= lr * g``), a zuko distribution built
once before the loop (quiet for the lazy ``NSF``/``MAF``, whose transforms are built at each ``log_prob``; stopped
for the eager Gaussianization flow ``GF``), a trainable base distribution built once in ``__init__``.

Sizes: 3-way tasks of 4 features, 6 support and 6 query points, 2 tasks a meta-batch, 2 inner steps, nets of 8 to 16
hidden units, a few iterations.
"""
import re
import warnings
from copy import deepcopy
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from safeloop import GraphGuard, Trainer
from safeloop.errors import GraphLeakWarning, GraphReuseError, InplaceModificationError, UnusedGradientWarning
from safeloop.watch import Watch
from tests.libraries import compare
from tests.libraries.compare import same, stepped
from tests.realworld.harness import checks, strict

try:
    import higher
except ImportError:
    higher = None
try:
    import zuko
except ImportError:
    zuko = None
try:
    import normflows as nf
except ImportError:
    nf = None

needs_higher = pytest.mark.skipif(higher is None, reason="higher is not installed")
needs_zuko = pytest.mark.skipif(zuko is None, reason="zuko is not installed")
needs_nf = pytest.mark.skipif(nf is None, reason="normflows is not installed")


# -- what every case runs -----------------------------------------------------------------------------------------
def backward(guard, loss):
    """``guard.backward(loss)``, or ``loss.backward()`` without a guard: here, in this file, as the loops are (the guard
    names the tensor at fault by the variables of the function that calls it)."""
    return guard.backward(loss) if guard is not None else loss.backward()


def guard_for(check, model, optimizer, *_):
    """The guard these loops' users write: ``GraphGuard(model, meta_optimizer)`` (the optimizer the unused-gradient
    check reads)."""
    return GraphGuard(model, optimizer, check=check)


three_runs = partial(compare.three_runs, guard_for=guard_for)
def ported(build, hand, port, check, steps, **settings):
    """The hand-written loop ``hand(*build())`` bare, then ``port(model=built[0], train_data=built[2], ...)``, a
    ``safeloop.Trainer`` subclass, from the same seeds: the model and the optimizer's state bit for bit the same, with
    no warning but the hand loop's own."""
    with warnings.catch_warnings(record=True) as own:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        built = build()
        start = deepcopy(built[0])
        torch.manual_seed(1)
        ref = hand(*built)
    torch.manual_seed(0)
    built = build()
    torch.manual_seed(1)
    with strict(own):
        trainer = port(model=built[0], train_data=built[2], max_steps=steps, device="cpu", progress=False,
                       loggers=(), guard={"check": check}, **settings)
        trainer.fit()
    assert trainer.state.step == steps
    model, optimizer = list(ref.values())[:2]
    same(trainer.model, model)
    same(trainer.optimizers["optimizer"].state_dict(), optimizer)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters())), "nothing trained"
    return trainer


def said(category, run):
    """The warnings of ``category`` that ``run()`` emits."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w.message for w in caught if issubclass(w.category, category)]


# == MAML ============================================================================================================
N_WAY, FEATURES, SET, TASKS, INNER, INNER_LR = 3, 4, 6, 2, 2, 0.1


def meta_batches(n, seed=3):
    """``n`` meta-batches of ``TASKS`` tasks: (x_spt, y_spt, x_qry, y_qry), as OmniglotNShot's ``next()`` gives."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(TASKS, SET, FEATURES, generator=gen), torch.randint(N_WAY, (TASKS, SET), generator=gen),
             torch.randn(TASKS, SET, FEATURES, generator=gen), torch.randint(N_WAY, (TASKS, SET), generator=gen))
            for _ in range(n)]


def maml_net():
    """maml-omniglot.py's ``nn.Sequential`` net, with linear layers: BatchNorm with ``momentum=1``, in-place ReLU."""
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8, momentum=1, affine=True), nn.ReLU(inplace=True),
                         nn.Linear(8, N_WAY))


def maml_build(n=3):
    net = maml_net()
    return net, torch.optim.Adam(net.parameters(), lr=1e-2), meta_batches(n)


def higher_test(net, batch):
    """maml-omniglot.py's ``test``: adapted with ``track_higher_grads=False`` (copied initial weights), query losses
    of the adapted net, no meta update."""
    x_spt, y_spt, x_qry, y_qry = batch
    inner_opt = torch.optim.SGD(net.parameters(), lr=INNER_LR)
    qry_losses = []
    for i in range(x_spt.size(0)):
        with higher.innerloop_ctx(net, inner_opt, track_higher_grads=False) as (fnet, diffopt):
            for _ in range(INNER):
                diffopt.step(F.cross_entropy(fnet(x_spt[i]), y_spt[i]))
            qry_losses.append(F.cross_entropy(fnet(x_qry[i]).detach(), y_qry[i], reduction='none'))
    return torch.cat(qry_losses).mean().item()


def higher_maml(net, meta_opt, data, guard=None, order=2, summed=False, copy_initial_weights=False,
                backward_first_order=False, running=False):
    """maml-omniglot.py's ``train`` (and ``test`` after every meta-batch): for each task, ``INNER`` steps of
    ``diffopt.step(spt_loss)`` in ``higher.innerloop_ctx(net, inner_opt, copy_initial_weights=False)``, then the
    query loss. ``order=2``: ``qry_loss.backward()`` per task (``summed``: one backward of their mean). ``order=1``
    (``track_higher_grads=False``): the gradient with respect to the last fast weights, added to ``.grad`` by hand
    (higher issue #63). The mistakes: ``backward_first_order`` (``qry_loss.backward()`` at first order, higher issue
    #129), ``copy_initial_weights=True``, ``running`` (the meta-loss summed over meta-batches with its graph)."""
    net.train()
    log, tested, running_loss = [], [], 0.0
    for x_spt, y_spt, x_qry, y_qry in data:
        with stepped(guard):
            inner_opt = torch.optim.SGD(net.parameters(), lr=INNER_LR)
            qry_losses = []
            meta_opt.zero_grad()
            for i in range(x_spt.size(0)):
                with higher.innerloop_ctx(net, inner_opt, copy_initial_weights=copy_initial_weights,
                                          track_higher_grads=order == 2) as (fnet, diffopt):
                    for _ in range(INNER):
                        spt_loss = F.cross_entropy(fnet(x_spt[i]), y_spt[i])
                        diffopt.step(spt_loss)
                    qry_loss = F.cross_entropy(fnet(x_qry[i]), y_qry[i])
                    qry_losses.append(qry_loss if summed else qry_loss.detach())
                    if order == 1 and not backward_first_order:
                        grads = torch.autograd.grad(qry_loss, fnet.parameters())
                        for p, g in zip(net.parameters(), grads):
                            p.grad = g if p.grad is None else p.grad + g
                    elif not summed:
                        backward(guard, qry_loss)
            if summed:
                meta_loss = sum(qry_losses) / len(qry_losses)
                backward(guard, meta_loss)
                running_loss = running_loss + meta_loss if running else running_loss
            meta_opt.step()
        log.append((sum(qry_losses) / len(qry_losses)).item())
        tested.append(higher_test(net, (x_spt, y_spt, x_qry, y_qry)))
    return {"net": net, "optimizer": meta_opt.state_dict(), "log": log, "tested": tested}


@needs_higher
@pytest.mark.parametrize("variant", ["per_task", "summed", "first_order"])
@pytest.mark.parametrize("check", checks())
def test_higher_maml(check, variant):
    """maml-omniglot.py's meta-training with higher: second order with one ``qry_loss.backward()`` per task or one
    backward of the meta-batch's mean, first order by higher issue #63's recipe; the test-time adaptation (its own
    ``autograd.grad`` calls, outside any step) after each meta-batch."""
    kwargs = {"per_task": {}, "summed": {"summed": True}, "first_order": {"order": 1}}[variant]
    ref = three_runs(maml_build, lambda *a, guard=None: higher_maml(*a, guard=guard, **kwargs), check)
    assert len(ref["log"]) == 3 and len(ref["tested"]) == 3


class HigherMAML(Trainer):
    """maml-omniglot.py's meta-batch as ``training_step``: the tasks adapted with higher, the mean of their query
    losses returned (the Trainer back-propagates it and steps Adam)."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-2)

    def training_step(self, batch):
        x_spt, y_spt, x_qry, y_qry = batch
        inner_opt = torch.optim.SGD(self.model.parameters(), lr=INNER_LR)
        qry_losses = []
        for i in range(x_spt.size(0)):
            with higher.innerloop_ctx(self.model, inner_opt, copy_initial_weights=False) as (fnet, diffopt):
                for _ in range(INNER):
                    diffopt.step(F.cross_entropy(fnet(x_spt[i]), y_spt[i]))
                qry_losses.append(F.cross_entropy(fnet(x_qry[i]), y_qry[i]))
        return sum(qry_losses) / len(qry_losses)


class HigherMAMLPerTask(Trainer):
    """The same in manual mode, as the example writes it: ``self.backward(qry_loss)`` per task, then
    ``self.step()``."""
    automatic = False
    configure_optimizers = HigherMAML.configure_optimizers

    def training_step(self, batch):
        x_spt, y_spt, x_qry, y_qry = batch
        inner_opt = torch.optim.SGD(self.model.parameters(), lr=INNER_LR)
        qry_losses = []
        for i in range(x_spt.size(0)):
            with higher.innerloop_ctx(self.model, inner_opt, copy_initial_weights=False) as (fnet, diffopt):
                for _ in range(INNER):
                    diffopt.step(F.cross_entropy(fnet(x_spt[i]), y_spt[i]))
                qry_loss = F.cross_entropy(fnet(x_qry[i]), y_qry[i])
                qry_losses.append(qry_loss.detach())
                self.backward(qry_loss)
        self.step()
        return sum(qry_losses) / len(qry_losses)


@needs_higher
@pytest.mark.parametrize("port", [HigherMAML, HigherMAMLPerTask], ids=["summed", "per_task"])
@pytest.mark.parametrize("check", checks())
def test_higher_maml_as_a_trainer(check, port):
    """maml-omniglot.py's meta-training ported: the same net and Adam state as the hand loop, bit for bit."""
    summed = port is HigherMAML
    ported(maml_build, lambda *a: higher_maml(*a, summed=summed), port, check, steps=3)


# -- the same MAML by hand: torch.func.functional_call and torch.autograd.grad ----------------------------------------
def adapted(net, x, y, order=2, detached=False, inplace=False):
    """The fast weights after ``INNER`` steps on (x, y): ``autograd.grad(create_graph=order == 2)``, ``w - lr * g``.
    The mistakes: ``detached`` (fast weights made with ``.detach().requires_grad_()``), ``inplace`` (the fast weights
    cloned, then updated with ``fast[name] -= lr * g``)."""
    fast = {n: p.detach().requires_grad_() if detached else p.clone() if inplace else p
            for n, p in net.named_parameters()}
    for _ in range(INNER):
        inner = F.cross_entropy(torch.func.functional_call(net, fast, (x,)), y)
        grads = torch.autograd.grad(inner, list(fast.values()), create_graph=order == 2)
        if inplace:
            for name, g in zip(list(fast), grads):
                fast[name] -= INNER_LR * g
        else:
            fast = {n: w - INNER_LR * g for (n, w), g in zip(fast.items(), grads)}
    return fast


def query_losses(net, batch, order=2, **mistake):
    """Each task's query loss through its adapted fast weights."""
    x_spt, y_spt, x_qry, y_qry = batch
    return [F.cross_entropy(torch.func.functional_call(net, adapted(net, x_spt[i], y_spt[i], order, **mistake),
                                                       (x_qry[i],)), y_qry[i])
            for i in range(x_spt.size(0))]


def hand_maml(net, meta_opt, data, guard=None, order=2, per_task=False, **mistake):
    """MAML by hand: the meta-batch's mean query loss back-propagated (``per_task``: each task's), Adam stepped."""
    log = []
    for batch in data:
        with stepped(guard):
            meta_opt.zero_grad()
            losses = query_losses(net, batch, order, **mistake)
            if per_task:
                for loss in losses:
                    backward(guard, loss)
            else:
                backward(guard, sum(losses) / len(losses))
            meta_opt.step()
        log.append(sum(loss.item() for loss in losses))
    return {"net": net, "optimizer": meta_opt.state_dict(), "log": log}


@pytest.mark.parametrize("per_task", [False, True], ids=["mean", "per_task"])
@pytest.mark.parametrize("order", [1, 2])
@pytest.mark.parametrize("check", checks())
def test_hand_maml(check, order, per_task):
    """The plain-torch MAML, first and second order (the meta loss back-propagated through ``create_graph=True``
    inner gradients, a double backward), one backward of the mean or one per task."""
    three_runs(maml_build, lambda *a, guard=None: hand_maml(*a, guard=guard, order=order, per_task=per_task), check)


class HandMAML(Trainer):
    """``training_step`` returning the meta-batch's mean query loss."""
    order = 2
    configure_optimizers = HigherMAML.configure_optimizers

    def training_step(self, batch):
        losses = query_losses(self.model, batch, self.order)
        return sum(losses) / len(losses)


class HandMAMLFirstOrder(HandMAML):
    order = 1


class HandMAMLPerTask(HandMAML):
    """Manual mode: ``self.backward`` per task, ``self.step()``."""
    automatic = False

    def training_step(self, batch):
        losses = query_losses(self.model, batch, self.order)
        for loss in losses:
            self.backward(loss)
        self.step()
        return sum(loss.detach() for loss in losses)


@pytest.mark.parametrize("port", [HandMAML, HandMAMLFirstOrder, HandMAMLPerTask],
                         ids=["second_order", "first_order", "per_task"])
@pytest.mark.parametrize("check", checks())
def test_hand_maml_as_a_trainer(check, port):
    """The plain-torch MAML ported, bit for bit the hand loop's."""
    ported(maml_build, lambda *a: hand_maml(*a, order=port.order, per_task=port is HandMAMLPerTask), port, check,
           steps=3)


# -- the MAML mistakes -----------------------------------------------------------------------------------------------
def unused(run):
    """The ``UnusedGradientWarning`` messages of ``run()``."""
    return [str(m) for m in said(UnusedGradientWarning, run)]


def guarded(loop, n=3, **kwargs):
    """``loop(*maml_build(n), guard=GraphGuard(net, meta_opt, check="always"), **kwargs)``; returns the build."""
    torch.manual_seed(0)
    built = maml_build(n)
    loop(*built, guard=GraphGuard(built[0], built[1], check="always"), **kwargs)
    return built


def test_detached_fast_weights_are_warned_and_the_advised_fast_weights_train():
    """Fast weights made with ``.detach().requires_grad_()``: the meta loss reaches no parameter Adam holds; an
    ``UnusedGradientWarning`` at the first step with a ``GraphGuard`` (the second under watch), advising fast weights
    made from the parameters with ``create_graph=True``: the hand loop above, which trains quiet."""
    pattern = r"reaches none of the parameters the optimizers update.*fast weights made with " \
              r"\.detach\(\)\.requires_grad_\(\).*create_graph=True"
    messages = unused(lambda: guarded(hand_maml, detached=True))
    assert len(messages) == 1 and re.search(r"\(step 1, .*" + pattern, messages[0])
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__):
        messages = unused(lambda: hand_maml(*maml_build(), detached=True))
    assert len(messages) == 1 and re.search(r"\(step 2, .*" + pattern, messages[0])


def test_fast_weights_updated_in_place_are_stopped():
    """``fast[name] -= lr * g`` on cloned fast weights, at second order: bare, PyTorch's in-place error in the meta
    backward; with a ``GraphGuard`` and under watch an ``InplaceModificationError`` at step 1 before Adam steps,
    naming the tensor as the output of the ``Sub`` (no variable holds it by then) and advising the out-of-place
    form: ``fast = {n: w - lr * g ...}``, the loop above, which trains quiet."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hand_maml(*maml_build(), inplace=True)
    pattern = r"step 1, .*\[torch.FloatTensor \[\d+\]\], the output of Sub\) was changed in place.*To fix: use the " \
              r"out-of-place form"
    for watched in (False, True):
        torch.manual_seed(0)
        built = maml_build()
        start = deepcopy(built[0].state_dict())
        with pytest.raises(InplaceModificationError, match=pattern):
            if watched:
                with Watch(GraphGuard(check="always"), __file__):
                    hand_maml(*built, inplace=True)
            else:
                hand_maml(*built, guard=GraphGuard(built[0], built[1], check="always"), inplace=True)
        same(dict(built[0].named_parameters()), {k: v for k, v in start.items() if "running" not in k
                                                 and "num_batches" not in k})


@needs_higher
@pytest.mark.parametrize("mistake", ["first_order_backward", "copy_initial_weights"])
def test_higher_meta_loss_reaching_no_initial_weight_is_warned_with_a_guard(mistake):
    """``qry_loss.backward()`` with ``track_higher_grads=False`` (higher issue #129: every inner step detaches the
    fast weights) or with ``copy_initial_weights=True`` (the fast weights start from detached copies): no gradient
    reaches ``net``, Adam steps nothing, silently. With a ``GraphGuard`` an ``UnusedGradientWarning`` at step 1 names
    the fast weights (``fnet.…``) and advises fast weights made from the parameters with ``create_graph=True``:
    higher's are, with ``copy_initial_weights=False`` and ``track_higher_grads=True`` (the loop above, quiet)."""
    kwargs = {"first_order_backward": {"order": 1, "backward_first_order": True},
              "copy_initial_weights": {"copy_initial_weights": True}}[mistake]
    start = []
    messages = unused(lambda: start.append(guarded(higher_maml, **kwargs)))
    assert len(messages) == 1 and re.search(r"\(step 1, .*reaches none of the parameters the optimizers update, only "
                                            r"`fnet\.[^`]+`.*create_graph=True", messages[0])
    torch.manual_seed(0)
    same(dict(start[0][0].named_parameters()), dict(maml_build()[0].named_parameters()))  # nothing trained


@needs_higher
@pytest.mark.parametrize("mistake", ["first_order_backward", "copy_initial_weights"])
def test_higher_meta_loss_reaching_no_initial_weight_is_warned_under_watch(mistake):
    """The same mistakes under watch: warned from step 2 (the first after Adam's first step, which makes the
    optimizers known), although ``inner_opt``, found in the loop's variables, never steps: its parameters are
    Adam's."""
    kwargs = {"first_order_backward": {"order": 1, "backward_first_order": True},
              "copy_initial_weights": {"copy_initial_weights": True}}[mistake]
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__):
        messages = unused(lambda: higher_maml(*maml_build(), **kwargs))
    assert len(messages) == 1 and re.search(r"\(step 2, .*reaches none of the parameters the optimizers update, only "
                                            r"`fnet\.[^`]+`.*create_graph=True", messages[0])


@needs_higher
def test_running_meta_loss_kept_with_its_graph_is_warned_with_a_guard():
    """``running_loss = running_loss + meta_loss`` over meta-batches: a ``GraphLeakWarning`` naming
    ``running_loss`` and advising ``.item()``, with a ``GraphGuard`` (from the fifth meta-batch's check)."""
    with pytest.warns(GraphLeakWarning, match=r"held by `local running_loss`.*Store loss\.item\(\)"):
        guarded(higher_maml, n=5, summed=True, running=True)


@needs_higher
def test_running_meta_loss_kept_with_its_graph_is_warned_under_watch():
    """The same under ``watch``, with maml-omniglot's test-time adaptation between the meta-batches (``diffopt.step``'s
    ``autograd.grad`` calls, outside the meta-step): each step watches its meta-loss's graph too."""
    torch.manual_seed(0)
    with Watch(GraphGuard(check="always"), __file__), pytest.warns(GraphLeakWarning, match="running_loss"):
        higher_maml(*maml_build(5), summed=True, running=True)


# == zuko ============================================================================================================
def conditional_data(n=4, seed=5):
    """``n`` batches of 32 points x in R^3 whose law depends on a context c in R^2."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        c = torch.randn(32, 2, generator=gen)
        x = torch.stack([c[:, 0], c[:, 0] * c[:, 1], c[:, 1] ** 2], dim=-1) + 0.1 * torch.randn(32, 3, generator=gen)
        out.append((x, c))
    return out


def zuko_build(kind="NSF", n=4):
    flow = getattr(zuko.flows, kind)(3, 2, transforms=2, hidden_features=[16])
    return flow, torch.optim.Adam(flow.parameters(), lr=1e-3), conditional_data(n)


def zuko_loop(flow, optimizer, data, guard=None, built_once=False):
    """zuko's README loop: ``loss = -flow(c).log_prob(x).mean()``, backward, step, zero_grad. ``built_once``: a fixed
    data set (the first batch every iteration) whose distribution ``dist = flow(c)`` is built once before the
    loop."""
    losses = []
    x0, c0 = data[0]
    dist = flow(c0) if built_once else None
    for x, c in data:
        with stepped(guard):
            loss = -dist.log_prob(x0).mean() if built_once else -flow(c).log_prob(x).mean()
            backward(guard, loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return {"flow": flow, "optimizer": optimizer.state_dict(), "losses": losses}


@needs_zuko
@pytest.mark.parametrize("kind", ["NSF", "MAF"])
@pytest.mark.parametrize("check", checks())
def test_zuko_conditional_flow(check, kind):
    """zuko's README: a conditional neural spline flow (masked autoregressive flow) fitted by maximum likelihood."""
    three_runs(lambda: zuko_build(kind), zuko_loop, check)


class ZukoFlow(Trainer):
    """zuko's README loop as ``training_step``."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def training_step(self, batch):
        x, c = batch
        return -self.model(c).log_prob(x).mean()


@needs_zuko
@pytest.mark.parametrize("check", checks())
def test_zuko_flow_as_a_trainer(check):
    ported(zuko_build, zuko_loop, ZukoFlow, check, steps=4)


@needs_zuko
@pytest.mark.parametrize("kind", ["NSF", "MAF"])
def test_zuko_lazy_distribution_built_once_is_quiet(kind):
    """``dist = flow(c)`` built once for a fixed data set: NSF's and MAF's transforms are lazy (the hyper-network runs
    at each ``log_prob``), so the object holds no graph and trains exactly as ``flow(c)`` rebuilt every step: no
    false alarm, bare, watched and guarded alike."""
    fresh = zuko_loop(*zuko_build(kind), built_once=False)
    torch.manual_seed(0)
    once = three_runs(lambda: zuko_build(kind), lambda *a, guard=None: zuko_loop(*a, guard=guard, built_once=True),
                      "always")
    torch.manual_seed(0)
    rebuilt = zuko_build(kind)
    torch.manual_seed(1)
    x0, c0 = rebuilt[2][0]
    again = zuko_loop(rebuilt[0], rebuilt[1], [(x0, c0)] * len(rebuilt[2]))
    same(once["flow"], again["flow"])
    assert fresh["losses"] != once["losses"]


@needs_zuko
def test_zuko_eager_distribution_built_once_is_stopped_and_rebuilding_it_trains():
    """The Gaussianization flow ``GF`` builds its transforms eagerly in ``flow(c)`` (its element-wise
    hyper-network and rotations run there): built once, the second step fails bare ("backward through the graph a
    second time"); with a ``GraphGuard`` and under watch a ``GraphReuseError`` at step 1, before any update, naming
    the tensor inside the distribution (``dist.transform.transforms[i]...``) and advising to build ``dist`` inside the
    loop (its value must follow the parameters' updates), never to keep it detached (which would stop training GF's
    hyper-network): ``flow(c)`` in the loop trains quiet."""
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        zuko_loop(*zuko_build("GF"), built_once=True)
    for watched in (False, True):
        torch.manual_seed(0)
        built = zuko_build("GF")
        start = deepcopy(built[0].state_dict())
        with pytest.raises(GraphReuseError, match=r"step 1, .* held by `dist\.transform\.transforms\[\d\]\.[^`]+`"
                           r".*To fix: build `dist` inside the loop") as caught:
            if watched:
                with Watch(GraphGuard(check="always"), __file__):
                    zuko_loop(*built, built_once=True)
            else:
                zuko_loop(*built, guard=GraphGuard(built[0], built[1], check="always"), built_once=True)
        assert not any("detach" in fix for fix in caught.value.fixes)
        same(built[0].state_dict(), start)
    three_runs(lambda: zuko_build("GF"), zuko_loop, "always")


# == normflows =======================================================================================================
def nf_build(n=6, bad=2):
    """normflows' README model (``AffineCouplingBlock`` over an ``MLP([1, 16, 16, 2], init_zeros=True)`` and
    ``Permute(2, mode='swap')``, 4 layers: the README's 32 of 64 units), its Adam, and ``n`` batches of 64
    ``TwoMoons`` samples, batch ``bad`` with an infinite point (its loss is not finite)."""
    base = nf.distributions.base.DiagGaussian(2)
    flows = []
    for _ in range(4):
        param_map = nf.nets.MLP([1, 16, 16, 2], init_zeros=True)
        flows.append(nf.flows.AffineCouplingBlock(param_map))
        flows.append(nf.flows.Permute(2, mode='swap'))
    model = nf.NormalizingFlow(base, flows)
    target = nf.distributions.TwoMoons()
    data = [target.sample(64) for _ in range(n)]
    data[bad][0, 0] = float("inf")
    return model, torch.optim.Adam(model.parameters(), lr=5e-4, weight_decay=1e-5), data


def nf_loop(model, optimizer, data, guard=None):
    """The README's loop: ``loss = model.forward_kld(x)``, backward and step only when the loss is finite."""
    loss_hist = []
    for x in data:
        with stepped(guard):
            optimizer.zero_grad()
            loss = model.forward_kld(x)
            if ~(torch.isnan(loss) | torch.isinf(loss)):
                backward(guard, loss)
                optimizer.step()
        loss_hist.append(loss.item())
    return {"model": model, "optimizer": optimizer.state_dict(), "loss_hist": loss_hist}


@needs_nf
@pytest.mark.parametrize("check", checks())
def test_normflows_readme_loop_skipping_a_non_finite_loss(check):
    ref = three_runs(nf_build, nf_loop, check)
    assert sum(1 for v in ref["loss_hist"] if v != v or abs(v) == float("inf")) == 1


class NormflowsKLD(Trainer):
    """The README's step as ``training_step``, ``on_nonfinite="skip"`` for its NaN/Inf test."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.model.parameters(), lr=5e-4, weight_decay=1e-5)

    def training_step(self, x):
        return self.model.forward_kld(x)


@needs_nf
@pytest.mark.parametrize("check", checks())
def test_normflows_as_a_trainer(check):
    trainer = ported(nf_build, nf_loop, NormflowsKLD, check, steps=6, on_nonfinite="skip")
    assert trainer.state.skipped == 1
