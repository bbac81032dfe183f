"""Turning what ``training_step`` returned into an ordered list of backwards."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..errors import StepError
from ..guard.walk import ACCUMULATE, HAS_SEQ, iter_nodes, sequence_nr

REENTRANT = "CheckpointFunctionBackward"  # torch.utils.checkpoint(..., use_reentrant=True)


@dataclass(slots=True)
class Backward:
    """One backward of the step: which loss, into which parameters, retaining or not."""

    name: str
    loss: torch.Tensor
    optimizer: str | None  # the optimizer this loss's gradient is for (None: the only one)
    inputs: list[torch.Tensor] | None  # backward(inputs=...) when losses are routed
    retain: bool


def named_losses(output, step: int, optimizer_names, trained: bool = True) -> dict[str, torch.Tensor]:
    """Check ``training_step``'s return value; a single tensor becomes ``{'loss': tensor}``. ``trained``: the
    losses are back-propagated (automatic mode; manual mode's returned losses are only logged)."""
    hint = "training_step must return the loss tensor, or a dict {name: loss tensor}"
    if output is None:
        raise StepError(f"step {step}: training_step returned None; {hint} (did you forget `return loss`?)", step)
    if isinstance(output, torch.Tensor):
        if len(optimizer_names) > 1:
            raise StepError(
                f"step {step}: training_step returned one loss tensor, and there are several optimizers "
                f"({sorted(optimizer_names)}): return a dict {{optimizer name: loss}}, so that each loss's "
                "gradient goes to its optimizer's parameters (one loss that trains them all goes under each name: "
                f"{{{', '.join(f'{n!r}: loss' for n in sorted(optimizer_names))}}})", step)
        output = {"loss": output}
    elif not isinstance(output, Mapping):
        raise StepError(f"step {step}: training_step returned a {type(output).__name__}; {hint}", step)
    elif trained and "loss" in output and len(output) > 1 and "loss" not in optimizer_names:
        other = next(str(k) for k in output if k != "loss")
        raise StepError(
            f"step {step}: training_step returned a dict with 'loss' and {sorted(map(str, output))[:4]}: every "
            f"entry of a returned dict is a loss the Trainer back-propagates, so {other!r} would be trained too "
            f"(Lightning trains 'loss' and only logs the rest). Return the loss alone and log the others with "
            f"self.log({other!r}, value); if every entry is a loss to train, name none of them 'loss'", step)
    losses = {}
    for name, value in output.items():
        if not isinstance(value, torch.Tensor):
            raise StepError(
                f"step {step}: training_step returned {name!r} = {type(value).__name__}, not a tensor; {hint}", step)
        if value.numel() != 1:
            raise StepError(
                f"step {step}: loss {name!r} has shape {tuple(value.shape)}; a loss must be a scalar "
                "(reduce it with .mean() or .sum())", step)
        losses[str(name)] = value
    if not losses:
        raise StepError(f"step {step}: training_step returned an empty dict; {hint}", step)
    if len(optimizer_names) > 1:
        unknown = [n for n in losses if n not in optimizer_names]
        if unknown:
            raise StepError(
                f"step {step}: loss {unknown[0]!r} names no optimizer; with several optimizers each loss "
                f"key must be one of {sorted(optimizer_names)} (the names configure_optimizers returned)", step)
    return losses


def refuse_terms(losses: Mapping[str, torch.Tensor], step: int) -> None:
    """With one optimizer, a returned loss that another returned loss was computed from (``{"total": a + b, "a": a}``)
    would have its gradient applied twice; so would a tensor returned twice. Refused before any backward, on the steps
    the guard checks (with several optimizers each loss trains other parameters: not asked)."""
    roots: dict = {}
    for name, loss in losses.items():
        if loss.grad_fn is not None and roots.setdefault(loss.grad_fn, name) != name:
            _twice(roots[loss.grad_fn], name, step, f"{roots[loss.grad_fn]!r} and {name!r} are the same tensor")
    seen: set = set()
    for name, loss in losses.items():
        for node in iter_nodes(loss.grad_fn, seen=seen):
            for nxt, _ in node.next_functions:
                if roots.get(nxt, name) != name:
                    _twice(roots[nxt], name, step, f"{name!r} was computed from {roots[nxt]!r}")


def _twice(term: str, outer: str, step: int, why: str) -> None:
    raise StepError(
        f"step {step}: training_step returned {term!r} and {outer!r}, and {why}: every entry of a returned dict is "
        f"back-propagated into the same parameters, so the gradient of {term!r} would be applied twice. Return only "
        f"the losses to train (the terms, not their sum too: the Trainer adds their gradients) and log the others "
        f"with self.log({term!r}, value)", step)


def plan(
    losses: Mapping[str, torch.Tensor],
    optimizers: Mapping[str, torch.optim.Optimizer],
    retain: list[bool] | None,
    mode: str = "sequential",
    weights: Mapping[str, float] | None = None,
    routes: Routes | None = None,
    start_seq: int | None = None,
    step: int = 0,
) -> list[Backward]:
    """The ordered backwards for one micro-batch.

    ``retain`` comes from the guard's walk (a backward retains only when a later loss
    shares its graph); without a walk every backward but the last retains. Routed losses get
    ``inputs=`` where ``routes`` says they need it (without ``routes``: always).
    """
    routed = len(optimizers) > 1
    weights = weights or {}
    if mode == "sum" and not routed and len(losses) > 1:
        total = None
        for name, loss in losses.items():  # no 0 + and no * 1.0: as cheap as adding them by hand
            loss = loss * weights[name] if name in weights else loss
            total = loss if total is None else total + loss
        return [Backward("sum", total, None, None, False)]
    names = list(losses)
    if retain is None:
        retain = [True] * (len(names) - 1) + [False]
    out = []
    for i, name in enumerate(names):
        loss = losses[name] * weights[name] if name in weights else losses[name]
        inputs = None
        if routed:
            inputs = routes.inputs(name, losses[name], start_seq, step) if routes is not None else \
                trained(optimizers[name])
        out.append(Backward(name, loss, name if routed else None, inputs, retain[i]))
    return out


def trained(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` updates that take gradients."""
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


class Routes:
    """Which routed backwards need ``backward(inputs=...)``.

    ``inputs=`` is always right, except through reentrant ``torch.utils.checkpoint``, which
    rejects it. So a graph with reentrant checkpointing gets it only when it reaches a leaf that is
    not one of its optimizer's parameters (another optimizer's, or any other tensor that takes
    gradients); otherwise a plain backward writes the same gradients. Whether a graph has reentrant
    checkpointing is decided by one walk per graph shape, known without a walk by the loss's name
    and how many autograd nodes the step made before the loss's own (the node counter). Which
    leaves such a graph reaches is walked every step: the same shape can reach other leaves (a
    ``.detach()`` makes no node), and a plain backward that reaches them would add gradient where
    it must not. Without the node counter every routed loss gets ``inputs=``.
    """

    LIMIT = 1024  # shapes remembered; a run whose shapes never repeat walks each once, then starts over

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers = optimizers
        self.reentrant: dict[tuple[str, int], bool] = {}  # graph shape -> has reentrant checkpointing

    def inputs(self, name: str, loss: torch.Tensor, start_seq: int | None, step: int) -> list[torch.Tensor] | None:
        """``inputs=`` for ``loss``'s backward into optimizer ``name``'s parameters, or None (plain)."""
        if not HAS_SEQ or start_seq is None or loss.grad_fn is None:
            return trained(self.optimizers[name])
        key = (name, sequence_nr(loss.grad_fn) - start_seq)
        reentrant = self.reentrant.get(key)
        if reentrant is None:
            if len(self.reentrant) >= self.LIMIT:
                self.reentrant.clear()
            reentrant = self.reentrant[key] = self.plain(name, loss, step)
        elif reentrant:
            self.plain(name, loss, step)
        return None if reentrant else trained(self.optimizers[name])

    def plain(self, name: str, loss: torch.Tensor, step: int) -> bool:
        """Walk ``loss``'s graph: whether it has reentrant checkpointing, and so must be back-propagated
        plainly; raises if it also reaches a leaf optimizer ``name`` does not own (it needs ``inputs=``)."""
        own = {id(p) for g in self.optimizers[name].param_groups for p in g["params"]}  # now: groups can be added
        reentrant, hidden, other = None, False, False
        for node in iter_nodes(loss.grad_fn):
            if type(node) is ACCUMULATE:
                other = other or id(node.variable) not in own
            elif type(node).__name__ == REENTRANT:  # the parameters used inside are not in the graph
                reentrant = node
                inner = _parameters(getattr(node, "run_function", None))
                hidden = hidden or inner is None
                other = other or any(id(p) not in own for p in inner or ())
        if reentrant is not None and (other or hidden):
            what = f"{getattr(reentrant, 'run_function', None)!r}"
            why = (f"its graph reaches tensors that are not optimizer {name!r}'s parameters, so its backward must "
                   f"be limited to them (backward(inputs=...))" if other else
                   f"the checkpointed function {what} is not a module, so the Trainer cannot see whose parameters "
                   f"it uses and must limit the backward to optimizer {name!r}'s (backward(inputs=...))")
            raise StepError(
                f"step {step}: loss {name!r} goes through reentrant gradient checkpointing "
                f"(torch.utils.checkpoint with use_reentrant=True), and {why}, which reentrant checkpointing "
                "rejects. Use torch.utils.checkpoint.checkpoint(..., use_reentrant=False)", step)
        return reentrant is not None


def _parameters(fn) -> list[torch.Tensor] | None:
    """The parameters a checkpointed function uses, when it is a module or a module's method (else None)."""
    owner = getattr(fn, "__self__", fn)
    return list(owner.parameters()) if isinstance(owner, torch.nn.Module) else None
