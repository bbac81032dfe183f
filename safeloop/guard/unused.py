"""Gradient that no optimizer uses (``UnusedGradientWarning``), read at the guard's thorough checks of the backwards
that write the optimizers' gradients, and at each update:

- a loss that reaches none of the optimizers' parameters trains nothing (said at the next update, unless a gradient
  was handed to them by hand since);
- a Parameter that requires grad and that no optimizer holds gets a gradient that goes nowhere, where that is a
  mistake: its layer kept in a plain list, made anew in forward, replaced after the optimizer was built, or unfrozen
  for a later phase with the first phase's optimizer kept;
- gradients cleared before the update that should use them, or never cleared, and an optimizer whose parameters never
  get one (``order.GradientOrder``).
"""
from __future__ import annotations

from itertools import islice

import torch
from torch.autograd.function import BackwardCFunction

from .. import fsdp
from ..errors import GraphLifecycleWarning, UnusedGradientWarning, warn_at
from . import explain, walk
from .explain import Scope
from .order import GradientOrder


class UnusedGradients:
    """What the checks above keep from one backward and update to the next (see the module docstring)."""

    def __init__(self) -> None:
        self._warned: set[str] = set()
        # No weak reference to a parameter is kept (see order.py): those below are held, each only until a later check
        # finds it gone. The Parameters found getting gradient for no optimizer at the last check that reached them,
        # and the last found under each name (one found again under its name as another tensor is made anew every step)
        self._unused: dict[int, torch.Tensor] = {}
        self._named: dict[str, torch.Tensor] = {}
        self._frozen: dict[int, torch.Tensor] = {}  # the trained Parameters seen with requires_grad=False, still there
        # the losses found reaching none of the optimizers' parameters, said at the next update unless their gradient
        # was handed to them by then (see ``at_update``) or a later loss of the step trains them through the same
        # leaves: (warning, where to warn, their gradients then, those a later backward reached, the loss's leaves,
        # whether they were all frozen at its backward)
        self._untrained: list[tuple[Warning, tuple | None, dict, set[int], dict, bool]] = []
        self.order = GradientOrder()  # the order of zero_grad(), backward() and step()
        self._scope: Scope | None = None  # the last checked backward's, to name an optimizer's parameters at its update

    def check(self, reached, step: int, scope: Scope, inputs, where: tuple | None, heeded: list | None) -> None:
        """Gradient that no optimizer uses, once the optimizers are known (thorough steps; said once per loss and
        per parameter): a loss that reaches none of their parameters trains nothing; a Parameter that requires grad
        and that none of them holds gets a gradient that goes nowhere. Plain tensors that require grad (an input
        for its gradient, a perturbation, fast weights updated by hand) are another matter: only Parameters count.
        ``reached``: each checked loss's (name, root, leaves); ``inputs``: the backward's ``inputs=``; ``where`` and
        ``heeded``: where to warn (``warn_at``)."""
        params = scope.optimized()
        # FSDP2: the graph's leaves are the gathered parameters, not the optimizers' shards: nothing to compare
        if params is None or any(fsdp.local(p) is not p for p in params):
            return
        held = set(map(id, params))
        now = {id(p): p for p in scope.parameters()}
        self._frozen = {i: p for i, p in self._frozen.items() if i in now} | \
            {i: p for i, p in now.items() if not p.requires_grad}
        more = None  # the optimizers the scope holds too: looked for only when something looks unheld

        def unheld(leaves) -> list:
            nonlocal more
            out = [t for t in leaves if id(t) not in held]
            if out and more is None:
                more = {id(p) for opt in explain.optimizers(scope) for g in opt.param_groups for p in g["params"]}
                held.update(more)
                out = [t for t in out if id(t) not in held]
            return out

        reached = [(name, root, [n.variable for n in leaves]) for name, root, leaves in reached]
        routed = None if inputs is None else set(map(id, inputs))  # backward(inputs=...) writes theirs only
        # every parameter the optimizers hold frozen around this backward: it may be meant for the gradient of what it
        # reaches alone (an energy-based model's Langevin steps: `x.grad` of the samples), if a later backward of the
        # step trains them, once thawed
        frozen = not any(p.requires_grad for p in params)
        for name, root, leaves in reached:
            key = f"untrained:{name}"
            if key in self._warned or any(id(t) in held for t in leaves) or len(unheld(leaves)) < len(leaves):
                continue
            # its walk stopped at what earlier losses' walks met: the whole graph tells, unless an autograd Function
            # in it runs a backward of its own (reentrant checkpointing: the parameters are not its inputs)
            nodes = list(islice(walk.iter_nodes(root), 100_000))
            every = [n.variable for n in nodes if type(n) is walk.ACCUMULATE]
            hidden = any(isinstance(n, BackwardCFunction) for n in nodes)
            # a placeholder made from scalar leaves (``torch.tensor(0., requires_grad=True).to(out)``) trains nothing
            placeholder = all(t.dim() == 0 and type(t) is not torch.nn.Parameter for t in every)
            if every and not hidden and not placeholder and len(unheld(every)) == len(every):
                self._warned.add(key)
                self._pend(params, every, where, UnusedGradientWarning(
                    f"the loss reaches none of the parameters the optimizers update, only "
                    f"{explain.leaf_names(every, scope)}: backward gives the optimizers nothing, so this loss trains "
                    "nothing", step=step, loss_name=name,
                    fixes=["if it goes through copies of the parameters (fast weights made with "
                           ".detach().requires_grad_(), copy.deepcopy), make them from the parameters themselves: "
                           "`fast = [p - lr * g for p, g in zip(params, grads)]` with grads = "
                           "torch.autograd.grad(inner_loss, params, create_graph=True), so the loss reaches them",
                           "if the tensors it reaches are the ones to train, give them to an optimizer",
                           "if the gradient of a parameter an optimizer updates comes from this one by another way, "
                           "turn this check off for that backward (guard.ignore('unused'); under watch, "
                           "--ignore unused)"]), frozen)
        for *_, written, _, _ in self._untrained:  # the gradients a later backward of the step writes: not handed over
            written.update(id(t) for _, _, leaves in reached for t in leaves
                           if id(t) in held and (routed is None or id(t) in routed))
        # a later loss of the step that reaches the optimizers' parameters and that loss's leaves trains them through
        # it: learning to learn back-propagates each unrolled step's loss of the optimizee for the gradient its
        # meta-optimizer reads, and then the unrolled sum of those losses, which reaches the meta-optimizer's weights;
        # one made with the parameters frozen is answered by any later loss that reaches them (the EBM's, thawed)
        self._untrained = [u for u in self._untrained if not any(any(id(t) in held for t in leaves) and (
            u[5] or any(u[4].get(id(t)) is t for t in leaves)) for _, _, leaves in reached)]
        # Parameters no optimizer holds: a mistake where their layer is kept in a plain list, where they are made
        # anew every step (in forward), where the optimizer holds parameters the model no longer has (a layer
        # replaced after the optimizer was built), or where they were frozen at an earlier check (unfrozen for a
        # second phase of fine-tuning, the optimizer of the first kept); else a part left out of training on purpose
        # judged already: one the last checks found, reached again (held since: the same tensor)
        found = {id(t) for _, _, leaves in reached for t in leaves}
        self._unused = {i: t for i, t in self._unused.items() if i in found}
        fresh = [t for _, _, leaves in reached for t in leaves if id(t) not in held and id(t) not in self._unused
                 and isinstance(t, torch.nn.Parameter) and t.requires_grad]
        wasted = list({id(t): t for t in unheld(fresh)}.values()) if fresh else []
        if not wasted:
            return
        self._unused.update((id(t), t) for t in wasted)  # one kept across steps is judged once
        names = explain.parameter_names(scope)
        listed = {id(t) for t in wasted if names.get(id(t), ("", False))[1]}
        earlier, self._named = self._named, {names[id(t)][0]: t for t in wasted if id(t) in names}
        optimized = list(scope.optimized() or ()) + [p for o in explain.optimizers(scope) for g in o.param_groups
                                                     for p in g["params"]]
        # made anew in a forward: in a model some of whose parameters are trained (not a whole copy of one made again
        # now and then, FedProx's `global_model = copy.deepcopy(server)` for each client: a reference, left out)
        trained = {names[id(p)][0].split(".")[0] for p in optimized if id(p) in names}
        remade = {id(t) for t in wasted if id(t) in names and earlier.get(names[id(t)][0], t) is not t
                  and names[id(t)][0].split(".")[0] in trained}
        known = {id(t) for _, t in explain.candidates(scope)} | set(names)
        stale = any(id(p) not in known for p in optimized)  # held by the optimizer only: a replaced layer's
        replaced = {id(t) for t in wasted if id(t) in names and id(t) not in listed} if stale else set()
        fixes = []
        if listed:
            fixes.append("keep layers in an nn.ModuleList (an nn.ModuleDict for a dict), not a plain list: a plain "
                         "list's layers are not registered, so model.parameters(), and the optimizer built from it, "
                         "miss them")
        if remade:
            fixes.append("create layers and Parameters once, in __init__: one made in forward is a new tensor every "
                         "step, which no optimizer holds")
        if replaced:
            fixes.append("build the optimizer after replacing a layer: one built before updates the old layer's "
                         "parameters (or add the new ones: optimizer.add_param_group({'params': "
                         "new_layer.parameters()})); to set a parameter's values (Glow's ActNorm initialised from the "
                         "first batch), copy them into it under torch.no_grad() (`p.copy_(value)`, or "
                         "`p.data.copy_(value)`) instead of assigning a new nn.Parameter")
        unfrozen = {id(t) for t in wasted if self._frozen.get(id(t)) is t}
        if unfrozen:
            fixes.append("build the optimizer again after unfreezing parameters (one built while they were frozen "
                         "was not given them), or add them to it: optimizer.add_param_group({'params': [...]})")
        mistaken = listed | remade | replaced | unfrozen
        said = [t for t in wasted if id(t) in mistaken and f"unused:{names[id(t)][0]}" not in self._warned]
        if not said:
            return
        self._warned.update(f"unused:{names[id(t)][0]}" for t in said)
        fixes.append("if they are meant to stay fixed, p.requires_grad_(False): backward then skips them")
        warn_at(UnusedGradientWarning(
            f"the loss reaches {explain.leaf_names(said, scope)}, which require grad but which no optimizer "
            "updates: their gradient goes nowhere and they keep their initial values",
            step=step, loss_name=reached[0][0], fixes=fixes), where, heeded)

    def before_backward(self, params, leaves, by: tuple, scope: Scope, heeded: list | None) -> None:
        """A checked backward is about to write the gradients of ``params`` (the optimizers') and of ``leaves`` (the
        plain tensors that require grad it reaches): where it adds to the gradient an attack of an earlier step left
        in a kept input, never cleared since (``order.GradientOrder``), that is said (once)."""
        self._scope = scope
        kept = self.order.before_backward(params, by, leaves)
        if not kept or "kept input" in self._warned:
            return
        self._warned.add("kept input")
        step, name, where = by
        first = explain.leaf_names(kept[:1], scope).strip("`").removeprefix("local ")
        warn_at(GraphLifecycleWarning(
            f"this backward adds to `{first}.grad`, which an attack's backward of an earlier step wrote (the "
            "gradients it gave the parameters were cleared before the next backward) and which nothing cleared "
            "since: the same tensor, kept from step to step, so the attack that reads it now reads the sum of both "
            "steps' gradients", step=step, loss_name=name, fixes=[
                f"clear it before the attack's backward (`{first}.grad = None`), or take the input's gradient "
                f"without writing `.grad`: `grad, = torch.autograd.grad(loss, [{first}])`"]), where, heeded)

    def _pend(self, params, leaves, where: tuple | None, warning: Warning, frozen: bool) -> None:
        """Keep ``warning`` (a loss that reaches none of the optimizers' ``params``, only ``leaves``) for the next
        update; ``frozen``: every one of ``params`` was frozen at its backward (see ``check``)."""
        self._untrained.append((warning, where, {id(p): (p, _grad_state(p)) for p in params}, set(),
                                {id(t): t for t in leaves}, frozen))

    def at_update(self, params, heeded: list | None, starved: bool = True) -> None:
        """An optimizer update is about to run (the Trainer's, watch's), or has just run (a ``GraphGuard``'s loop, and
        the Trainer's and watch's after a closure's backwards): a loss found reaching none of the optimizers'
        parameters since the last update is said now, unless one of them holds a gradient that no backward wrote since
        that loss's check: a gradient handed over by hand (A3C's ``shared_param._grad = param.grad``, DARTS'
        ``alpha.grad = g``, first-order MAML's), which is the loss's. A gradient changed in place counts as handed
        over too (``shared.grad.copy_(local.grad)``). Then: the updated ``params`` (the optimizer's; None: unknown)
        have their gradients cleared too early, or never, or none (``_check_cleared``; ``starved``: whether that last
        one is said)."""
        pending, self._untrained = self._untrained, []
        for warning, where, before, written, *_ in pending:
            if any(_grad_state(p) != state for i, (p, state) in before.items() if i not in written):
                continue
            warn_at(warning, where, heeded)
        self._check_cleared(params, heeded, starved)

    def _check_cleared(self, params, heeded: list | None, starved: bool) -> None:
        """Gradients cleared before the update of ``params`` that should use them, or never cleared, or none ever
        (``order``)."""
        found = self.order.at_update(params)
        if found is None or found[0] in self._warned or (found[0] == "starved" and not starved):
            return
        kind, (step, name, where) = found
        self._warned.add(kind)
        if kind == "starved":
            # said already: a loss reaching none of the optimizers' parameters, or Parameters no optimizer holds
            # (replaced after the optimizer was built, which holds the old ones: a predictive-coding loop's value nodes)
            if any(key.startswith(("untrained:", "unused:")) for key in self._warned):
                return
            trained = [p for p in params if p.requires_grad]
            has = "has" if len(trained) == 1 else "have"
            warn_at(UnusedGradientWarning(
                f"an optimizer updates {explain.leaf_names(trained, self._scope)}, which {has} had no gradient at any "
                "of its steps so far: no backward "
                "reaches them, so its steps change nothing and they keep their initial values", step=step,
                loss_name=name, fixes=[
                    "make the loss reach them through its graph: a gradient taken on its way with torch.autograd.grad "
                    "(an unrolled inner step, a matched gradient) needs create_graph=True, and a value read from them "
                    "through .item(), .detach() or under torch.no_grad() cuts the way",
                    "if the loop replaced them after the optimizer was built (`x = x.detach().requires_grad_()`), "
                    "build the optimizer after",
                    "if they are meant to stay fixed, leave them out of the optimizer"]), where, heeded)
            return
        if kind == "cleared":
            what = ("the gradients this backward writes are cleared before the optimizer step that should use them: "
                    "at the step, none of the optimizers' parameters has a gradient (zero_grad() is called between "
                    "backward() and step(), or before step() with backward() after it), so the update changes nothing "
                    "and the model does not train")
        else:
            what = ("this backward adds to the gradients an earlier optimizer step already applied: nothing cleared "
                    "them since (zero_grad() is never called, or less often than step()), so every step applies the "
                    "sum of every gradient so far")
        warn_at(UnusedGradientWarning(what, step=step, loss_name=name, fixes=[
            "clear the gradients before the backward (optimizer.zero_grad() at the top of the iteration), or right "
            "after optimizer.step(): the order is zero_grad(), backward(), step() (to accumulate gradients over "
            "several backwards, step and clear once per group)"]), where, heeded)


def _grad_state(p: torch.Tensor) -> tuple[int, int] | None:
    """``p``'s gradient as an update will find it: which tensor, and its version (None: no gradient)."""
    return None if p.grad is None else (id(p.grad), p.grad._version)
