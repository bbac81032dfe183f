"""The one step cycle, for every kind of step.

    batch -> device -> [autocast] training_step -> guard pre-flight -> backward(s)
    -> gradient sync -> non-finite policy -> (per optimizer: unscale -> clip
    -> on_before_optimizer_step -> undo snapshot -> step -> zero_grad -> scheduler)

An optimizer whose ``step`` takes a closure (L-BFGS, SAM) gets one that evaluates the loss
again through the same pieces: forward, backward(s), sync, non-finite policy, unscale, clip,
hook (``closure``).

Automatic mode runs all of it from ``run``; in manual mode ``training_step`` calls
``backward`` and ``optimizer_step`` (the Trainer's ``self.backward`` / ``self.step``),
which are the same two pieces the automatic step uses. What differs between runs (one
loss or several, routing, accumulation, DDP, scaler, clipping, hooks) is decided once,
when the ``Runner`` is made, so a plain step runs only what it needs: ``steps``, which the
Trainer's fit loop hands its batches to, runs the steps the guard does not check
of a run with one loss, one optimizer and nothing in between in one loop (``simple_steps``).
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from .. import nonfinite
from ..errors import ConfigError, NonFiniteError, SafeloopError, StepError
from ..guard.explain import Scope
from ..guard.walk import HAS_SEQ, sequence_now
from .plan import Backward, Routes, named_losses, plan
from .undo import Undo

log = logging.getLogger("safeloop")
_perf_counter = time.perf_counter
_zero_grad, _profiling = torch.optim.Optimizer.zero_grad, torch.autograd._profiler_enabled


class SkipStep(BaseException):
    """A non-finite step under ``on_nonfinite=skip``: abandoned, counted, training goes on.
    A BaseException, so that a user's ``except Exception`` in a manual step cannot swallow it."""


class Runner:
    """Runs the steps of one Trainer; made at ``setup``, from the Trainer's settings and parts.

    Args:
        trainer: its public settings, optimizers, state and guard are read here, once.
        forward: ``training_step`` (or the DDP wrapper that calls it).
        hooks: the bound hooks by name (empty lists for hooks nobody overrides).
        scope: what the guard may search to explain a mistake; its parameters lose their
            gradients when a step is abandoned.
        autocast: a context-manager factory, or None (precision 32).
        move: moves a batch to the device, or None (CPU).
        undo: the Trainer's ``Undo`` (it lives as long as the optimizers: what it learned and its
            snapshot buffers carry over to the next ``fit``).
        named_parameters: ``(name, parameter)`` pairs, for naming non-finite gradients.
        previous: the Runner of the last ``fit``, whose routes and gradient accumulators this one
            takes over (so that a ``fit`` neither walks its first step's graphs again nor makes nodes).
    """

    def __init__(self, trainer: Any, forward: Callable, hooks: Mapping[str, list], scope: Scope,
                 autocast: Callable | None, move: Callable | None, undo: Undo, named_parameters: Callable,
                 previous: Runner | None = None):
        self.forward, self.hooks, self.scope, self.autocast, self.move = forward, hooks, scope, autocast, move
        self.named_parameters = named_parameters
        self.state, self.guard, self.dist = trainer.state, trainer.guard, trainer.dist
        self.optimizers, self.scaler = trainer.optimizers, trainer.scaler
        # stepped with their optimizer; those with interval "epoch" or a monitor the Trainer steps
        self.schedulers = {name: s.scheduler for name, s in trainer.schedules.items() if s.every_step}
        self.undo = undo
        self.retain_plans = trainer.retain_plans
        self.automatic, self.grad_clip, self.grad_accum = trainer.automatic, trainer.grad_clip, trainer.grad_accum
        self.weights = dict(trainer.loss_weights)
        self.multi_loss = "sum" if self.dist is not None and self.dist.losses_summed else trainer.multi_loss
        self.on_nonfinite, self.max_skipped = trainer.on_nonfinite, trainer.max_skipped
        self.finite = nonfinite.FiniteCheck() if self.on_nonfinite != "off" else None
        self.skipped_losses: dict[str, torch.Tensor] = {}
        self.names = list(self.optimizers)
        self.routed = len(self.names) > 1
        same = previous is not None and previous.optimizers is self.optimizers
        self.routes = (previous.routes if same else Routes(self.optimizers)) if self.routed else None
        # optimizers whose step() cannot do without a closure (L-BFGS): the automatic step gives them one
        self.closures = {name for name, opt in self.optimizers.items() if needs_closure(opt)}
        if self.closures and self.scaler is not None:
            raise ConfigError(f"optimizer {sorted(self.closures)[0]!r} steps with a closure, which precision=16's "
                              "GradScaler does not support: use precision=bf16 or 32")
        # manual mode steps inside training_step's autocast region, whose cached low-precision weights
        # must be dropped after every update (a later forward would use the old ones)
        self.recast = autocast is not None and not self.automatic
        # One loss into one optimizer with nothing in between: back-propagated and stepped directly.
        plain = (not self.routed and self.scaler is None and self.dist is None and self.grad_clip is None
                 and self.grad_accum == 1 and not self.weights
                 and not any(hooks[h] for h in ("on_before_backward", "on_after_backward",
                                                "on_before_optimizer_step"))
                 and not self.closures)
        self.step_hooks = bool(hooks["on_step_start"] or hooks["on_step_end"])
        self.plain, self.simple = plain, plain and self.automatic and not self.step_hooks  # update, simple_steps
        self.only = (self.names[0], self.optimizers[self.names[0]]) if plain and self.names else None
        # what the Trainer warns about once: optimizers no gradient reached yet, loss_weights no loss had yet
        self.unreached = set() if plain else set(self.names)
        self.unweighted = set(self.weights)
        # Each trained parameter's AccumulateGrad node, held for as long as the Runner lives. A step's
        # graph is freed at its end, and with it the last reference to these nodes: the next forward
        # would make them again, parameter by parameter (2-3 us a step on a 4-parameter MLP; a loop that
        # keeps its `loss` until the next forward keeps them alive by accident). They belong to no step.
        self.accumulators = accumulators(self.optimizers, previous.accumulators if previous is not None else ())
        self.stepped: dict[str, int] = {}  # optimizers updated in this step -> node counter at the update
        self.fresh: dict[str, torch.Tensor] = {}  # manual mode: losses back-propagated since the last update
        self.batch = None  # manual mode: the micro-batch training_step is running on (re-run to explain a lost graph)

    # -- the steps ---------------------------------------------------------------------------
    def steps(self, groups: Iterator[list], until: float, stopped: Callable[[], bool]) -> bool:
        """Steps, each over the next list of micro-batches from ``groups``, until step ``until`` is done
        or ``stopped()`` says so after a step (True), or ``groups`` runs out (False)."""
        state, guard = self.state, self.guard
        while True:
            if self.simple and state.step + 1 < guard.next_due:  # until the guard checks a step:
                done = self.simple_steps(groups, until, stopped)
                if done is not None:
                    return done
            batches = next(groups, None)
            if batches is None:
                return False
            self.run(batches)
            if stopped() or state.step >= until:
                return True

    def run(self, batches: list, first: tuple | None = None) -> None:
        """One optimizer step over ``batches`` (its micro-batches); ``first``: see ``forward_backward``."""
        state, guard, hooks = self.state, self.guard, self.hooks
        step = state.step + 1
        timed = guard.begin_step(step)
        started = _perf_counter() if timed else 0.0
        if self.step_hooks:
            for fn in hooks["on_step_start"]:
                fn()
        total: dict[str, torch.Tensor] = {}
        try:
            total = self.forward_backward(batches, step, first=first)
            if self.automatic:
                if self.unweighted:
                    self.unweighted.difference_update(total)
                self.update(total, step, batches)
            elif self.scaler is not None and self.stepped:
                self.scaler.update()
        except SkipStep:
            self.abandon()
            total = total or self.skipped_losses
        except BaseException as err:
            raise self.abandoned(err, step)
        self.undo.end()
        if self.stepped:
            self.stepped.clear()
        if self.fresh:
            self.fresh.clear()
        state.losses = {k: v / len(batches) for k, v in total.items()} if len(batches) > 1 else total
        state.step = step
        if self.step_hooks:
            for fn in hooks["on_step_end"]:
                fn(state.losses)
        if timed:
            guard.end_step(step, self.scope)
            guard.record_step_time(step, _perf_counter() - started)
        guard.step_done()

    def simple_steps(self, groups: Iterator[list], until: float, stopped: Callable[[], bool]) -> bool | None:
        """The usual steps at their cheapest, in one loop: one batch whose one loss goes into one optimizer
        with nothing in between, on steps the guard does not check (it explains a step only if its backward
        fails; the step it times before a check is timed here, so that checks are measured against this
        loop). The same pieces as ``run``'s step, in the same order. Returns as ``steps`` does, or None
        before the step the guard checks. A ``training_step`` that returns anything but one loss tensor
        makes every step from then on a general one, this one included."""
        state, guard, forward, move, autocast = self.state, self.guard, self.forward, self.move, self.autocast
        update, full = self.plain_update, self.undo.mode == "full"
        timed_from, last = guard.next_timed, guard.next_due - 1
        for batches in groups:
            step = state.step + 1
            started = _perf_counter() if step >= timed_from else 0.0
            try:
                batch = batches[0] if move is None else move(batches[0])
                output = forward(batch) if autocast is None else self.forward_autocast(batch)
            except BaseException as err:
                raise self.abandoned(err, step)
            if type(output) is not torch.Tensor or not output.requires_grad or output.numel() != 1:
                self.simple = False
                self.run(batches, first=(batch, output))
            else:
                timed = guard.begin_step(step)
                try:
                    self.backward(output, "loss", step, batch, False, None)
                    total = {"loss": output.data}
                    del output  # the step's graph must not outlive it (checked at its end)
                    update(total, step)
                except SkipStep:
                    self.abandon()
                except BaseException as err:
                    raise self.abandoned(err, step)
                if full:
                    self.undo.end()
                state.losses = total
                state.step = step
                if timed:
                    guard.end_step(step, self.scope)
                    guard.record_step_time(step, _perf_counter() - started)
                guard.step_done()
            if stopped() or state.step >= until:
                return True
            if state.step >= last or not self.simple:
                return None
        return False

    def forward_autocast(self, batch):
        with self.autocast():
            return self.forward(batch)

    def forward_backward(self, batches: list, step: int, only: str | None = None,
                         first: tuple | None = None) -> dict[str, torch.Tensor]:
        """Forward and backward(s) of every micro-batch; returns their losses' values, summed.
        ``only``: an evaluation for optimizer ``only``'s closure, which back-propagates its losses alone.
        ``first``: the first micro-batch, moved to the device, and what ``training_step`` returned for it."""
        automatic, move = self.automatic, self.move
        total: dict[str, torch.Tensor] = {}
        last = len(batches) - 1
        for i, batch in enumerate(batches):
            if i == 0 and first is not None:
                batch, output = first
                first = None
            else:
                batch = batch if move is None else move(batch)
                if not automatic:
                    self.batch = batch
                output = self.forward(batch) if self.autocast is None else self.forward_autocast(batch)
            if not automatic:
                losses = named_losses(output, step, ()) if output is not None else {}
            else:
                losses = named_losses(output, step, self.optimizers)
                if only is not None and self.routed:
                    losses = {only: losses[only]} if only in losses else {}
                if losses:
                    self.backward_all(losses, step, batch, first=i == 0 and only is None, last=i == last)
            _add_values(total, losses)
            del output, losses, batch  # the step's graph must not outlive it (checked at its end)
        self.batch = None
        return total

    def update(self, losses: Mapping[str, torch.Tensor], step: int, batches: list) -> None:
        """Automatic mode, after the backwards: sync, the non-finite policy, every optimizer's update."""
        if self.plain:
            self.plain_update(losses, step)
            return
        if self.dist is not None:  # every rank decides on the same averaged gradients
            self.dist.sync_all(step)
        names = [n for n in self.names if n in losses] if self.routed else self.names
        if self.finite is not None:
            self.check_finite(losses, step, None)
        for name in names:
            closure, current = self.recompute(name, step, batches, losses) if name in self.closures else (None, None)
            self.optimizer_step(name, step, last=name is names[-1], closure=closure, current=current)
        if self.scaler is not None:
            self.scaler.update()

    def plain_update(self, losses: Mapping[str, torch.Tensor], step: int) -> None:
        """The update of a step with one optimizer and nothing to sync, clip, unscale or call in between:
        the non-finite policy, ``step``, ``zero_grad``, the scheduler."""
        if self.finite is not None:
            self.check_finite(losses, step, None)
        name, opt = self.only
        if self.undo.mode == "full":
            self.undo.before_update(name, True)
        try:
            opt.step()
            zero_grad(opt)  # free gradient memory now; the next step starts from None
            scheduler = self.schedulers.get(name)
            if scheduler is not None:
                scheduler.step()
        except BaseException:
            self.undo.before_update(name, True)  # the update began: the report says so unless undone
            raise

    # -- backward ----------------------------------------------------------------------------
    def backward_all(self, losses: dict[str, torch.Tensor], step: int, batch, first: bool, last: bool) -> None:
        """Automatic mode: every loss of one micro-batch, through the guard's pre-flight."""
        guard = self.guard
        summed = self.multi_loss == "sum" and not self.routed and len(losses) > 1
        retain = guard.preflight(losses, step, self.scope, batch, first, summed)
        todo = plan(losses, self.optimizers, retain, self.multi_loss, self.weights, self.routes, guard.start_seq, step)
        if len(todo) > 1:
            self.note_retain(todo, retain is not None, step)
        dist, scale = self.dist, (1.0 / self.grad_accum if self.grad_accum > 1 else None)
        before, after = self.hooks["on_before_backward"], self.hooks["on_after_backward"]
        for k, item in enumerate(todo):
            for fn in before:
                fn(item.name, item.loss)
            loss = item.loss * scale if scale is not None else item.loss
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            # DDP: the last backward into an optimizer's parameters all-reduces them while it runs
            armed = dist.arm(todo, k, self.optimizers) if last and dist is not None else None
            self.backward(loss, item.name, step, batch, item.retain, item.inputs, item.loss)
            if armed is not None:
                dist.flush(armed)
            for fn in after:
                fn(item.name)

    def manual_backward(self, loss: torch.Tensor, optimizer: str | None, retain_graph: bool) -> None:
        """Manual mode's ``self.backward``: one loss into one optimizer's parameters, through the guard."""
        step = self.state.step + 1
        if optimizer is None and self.routed:
            raise StepError(f"step {step}: self.backward(loss) needs optimizer=... when there are several "
                            f"optimizers, so that the loss's gradient reaches only that optimizer's parameters; "
                            f"choose from {sorted(self.optimizers)}", step)
        if optimizer is not None and optimizer not in self.optimizers:
            raise StepError(f"step {step}: self.backward(optimizer={optimizer!r}) names no optimizer; "
                            f"choose from {sorted(self.optimizers)}", step)
        name = optimizer or "loss"
        loss = named_losses(loss, step, ())["loss"]
        guard = self.guard
        if guard.checking or loss.grad_fn is None:  # else the pre-flight has nothing to do: skip building its call
            guard.preflight({name: loss}, step, self.scope, self.batch)
        inputs = self.routes.inputs(optimizer, loss, guard.start_seq, step) if self.routed else None
        if self.stepped and HAS_SEQ and guard.checking:  # unchecked steps: explained if backward fails
            found = guard.inplace_check(loss, self.stepped, guard.start_seq, inputs)
            if found is not None:
                err, stepped = found
                raise guard.explain(err, name, loss, step, self.scope, self.batch, stepped) from err
        for fn in self.hooks["on_before_backward"]:
            fn(name, loss)
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        self.backward(scaled, name, step, self.batch, retain_graph, inputs, loss)
        if guard.checking:
            guard.backward_done(retain_graph, inputs)
        if self.finite is not None:  # checked with the gradients at the next update
            self.fresh[name if name not in self.fresh else f"{name} #{len(self.fresh) + 1}"] = loss.data
        for fn in self.hooks["on_after_backward"]:
            fn(name)

    def backward(self, loss: torch.Tensor, name: str, step: int, batch, retain: bool, inputs,
                 original: torch.Tensor | None = None) -> None:
        """The one ``backward`` call; an autograd error comes back explained by the guard."""
        try:
            loss.backward(retain_graph=retain, inputs=inputs)
        except RuntimeError as err:
            raise self.explained(err, loss if original is None else original, name, step, batch)

    def explained(self, err: RuntimeError, loss: torch.Tensor, name: str, step: int, batch) -> Exception:
        """What to raise for backward's ``err``: the guard's explanation, or ``err`` itself."""
        explained = self.guard.explain(err, name, loss, step, self.scope, batch, list(self.stepped))
        if explained is None:
            return err
        explained.__cause__ = err
        return explained

    def note_retain(self, todo: list[Backward], walked: bool, step: int) -> None:
        """Log, once per pattern, which backwards kept the graph alive for a later loss."""
        key = (tuple(item.name for item in todo if item.retain), walked)
        if key in self.retain_plans:
            return
        self.retain_plans[key] = step
        kept = ", ".join(key[0]) or "none"
        if walked:
            freed = ", ".join(item.name for item in todo[:-1] if not item.retain) or "none"
            log.info("step %d: backward retained the graph for %s (a later loss shares nodes with it); "
                     "freed it for %s (no later loss shares it) and for the last loss, %s",
                     step, kept, freed, todo[-1].name)
        else:
            log.info("step %d (not walked by the guard): backward retained the graph for every loss but the "
                     "last: %s", step, kept)

    # -- optimizer updates -------------------------------------------------------------------
    def manual_step(self, optimizer: str | None, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """Manual mode's ``self.step``: one optimizer's update, as the automatic step makes it
        (``closure``: see ``closure``)."""
        step = self.state.step + 1
        if optimizer is None and self.routed:
            raise StepError(f"step {step}: self.step() needs the optimizer's name when there are several; "
                            f"choose from {sorted(self.optimizers)}", step)
        name = optimizer or self.names[0]
        if name not in self.optimizers:
            raise StepError(f"step {step}: self.step({name!r}) names no optimizer; "
                            f"choose from {sorted(self.optimizers)}", step)
        if closure is None and name in self.closures:
            raise StepError(f"step {step}: optimizer {name!r} ({type(self.optimizers[name]).__name__}) needs a "
                            "closure: self.step(name, closure=fn), where fn computes the loss, calls "
                            "self.backward(loss) and returns it", step)
        if closure is not None and self.scaler is not None:
            raise StepError(f"step {step}: self.step({name!r}, closure=...) under precision=16: the GradScaler "
                            "does not support closures; use precision=bf16 or 32", step)
        if self.dist is not None:  # every rank checks the same averaged gradients
            self.dist.sync(name, step)
        if self.finite is not None:
            self.check_finite(self.fresh, step, name)
            self.fresh.clear()
        self.optimizer_step(name, step, last=None, closure=closure)

    def optimizer_step(self, name: str, step: int, last: bool | None, closure: Callable[[], torch.Tensor] | None = None,
                       current: torch.Tensor | None = None) -> None:
        """Sync, unscale, clip, hook, snapshot (if a failure must be able to undo it), step, zero, schedule
        (``closure``, ``current``: see ``closure``)."""
        opt = self.optimizers[name]
        if self.dist is not None:  # average gradients over ranks (once: a no-op if already synced)
            self.dist.sync(name, step)
        self.prepare(name, opt)  # gradients only: a failure in it (a hook, say) leaves the optimizer unchanged
        # a step with a closure runs forward and backward inside: anything may fail after it changed weights
        self.undo.before_update(name, False if closure is not None else last)
        if closure is not None:
            opt.step(self.closure(name, step, opt, closure, current))
        elif self.scaler is not None:
            self.scaler.step(opt)
        else:
            opt.step()
        if self.unreached and name in self.unreached and any(p.grad is not None for g in opt.param_groups
                                                               for p in g["params"]):
            self.unreached.discard(name)
        zero_grad(opt)  # free gradient memory now; the next step starts from None
        scheduler = self.schedulers.get(name)
        if scheduler is not None:
            scheduler.step()
        self.stepped[name] = sequence_now()
        if self.recast:
            torch.clear_autocast_cache()

    def prepare(self, name: str, opt: torch.optim.Optimizer) -> None:
        """The gradients as the update must see them: unscaled, clipped, shown to the hook."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if self.grad_clip is not None:
            params = [p for g in opt.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip)
        for fn in self.hooks["on_before_optimizer_step"]:
            fn(name, opt)

    def closure(self, name: str, step: int, opt: torch.optim.Optimizer, evaluate: Callable[[], torch.Tensor],
                current: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """What ``opt.step(closure)`` calls: ``name``'s gradients cleared, ``evaluate()`` (the loss,
        back-propagated), then the gradients made ready as for any update: sync over ranks, the
        non-finite policy, unscale, clip, hook. ``current``: the loss whose gradients ``opt`` already
        holds, ready; the first call returns it as it is while no parameter of ``opt`` has changed."""
        params = [p for g in opt.param_groups for p in g["params"]]
        versions = [p._version for p in params] if current is not None else None

        def evaluated() -> torch.Tensor:
            loss = evaluation()
            # under torchrun every rank's optimizer decides on the same loss (L-BFGS compares them)
            return self.dist.mean(loss) if self.dist is not None else loss

        def evaluation() -> torch.Tensor:
            nonlocal versions
            if versions is not None and [p._version for p in params] == versions:
                versions = None
                return current
            versions = None
            opt.zero_grad(set_to_none=True)
            if self.recast:  # the weights changed inside training_step's autocast region
                torch.clear_autocast_cache()
            with torch.enable_grad():
                loss = evaluate()
            if self.dist is not None:
                self.dist.sync(name, step)
            if self.finite is not None:
                losses = self.fresh if not self.automatic else {name: loss}
                self.check_finite(losses, step, name)
                self.fresh.clear()
            self.prepare(name, opt)
            return loss

        return evaluated

    def recompute(self, name: str, step: int, batches: list, losses: Mapping[str, torch.Tensor]) -> tuple:
        """Automatic mode, for optimizer ``name``'s closure: a function that runs the step's forward and
        backward of the losses routed to it again and returns what they minimise (their weighted sum,
        averaged over micro-batches), and that value for ``losses``, whose gradients are there now."""
        def objective(values: Mapping[str, torch.Tensor]) -> torch.Tensor:
            weights, n = self.weights, len(batches)
            mine = [(k, v) for k, v in values.items() if not self.routed or k == name]
            return sum(v * weights[k] if k in weights else v for k, v in mine) / n

        def evaluate() -> torch.Tensor:
            return objective(self.forward_backward(batches, step, only=name))

        return evaluate, objective(losses)

    # -- non-finite values ---------------------------------------------------------------------
    def check_finite(self, losses: Mapping[str, torch.Tensor], step: int, name: str | None) -> None:
        """The ``on_nonfinite`` policy before an update: one fused NaN/Inf test over ``losses`` and the
        gradients of optimizer ``name`` (None: every optimizer). Raises ``NonFiniteError`` or ``SkipStep``."""
        optimizers = self.optimizers.values() if name is None else (self.optimizers[name],)
        # under precision 16 the GradScaler skips steps whose gradients overflow: only the losses are ours
        grads = nonfinite.gradients(optimizers) if self.scaler is None else []
        if self.finite(losses.values(), grads):
            self.state.skipped_in_row = 0
            return
        what = nonfinite.describe(losses, self.named_parameters())
        where = f"before optimizer {name!r} stepped" if name is not None and self.routed else \
            "before the optimizer step"
        if self.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: {what}. The step was abandoned {where} ({self.undo.report()}). To find the cause "
                "run with debug=default (anomaly detection names the backward operation that made the first NaN), "
                "lower the learning rate or set trainer.grad_clip; trainer.on_nonfinite=skip skips such steps "
                "instead", step)
        state = self.state
        if state.skipped_in_row >= self.max_skipped:
            raise NonFiniteError(
                f"step {step}: {what}, and the {state.skipped_in_row} steps before it were skipped for the same "
                f"reason (trainer.max_skipped={self.max_skipped}): training diverged, this is not a rare bad "
                "batch. Resume from an earlier checkpoint with a lower learning rate or trainer.grad_clip", step)
        state.skipped_in_row += 1
        state.skipped += 1
        self.skipped_losses = dict(losses)  # what the step shows, in manual mode too (its step did not return)
        left = "nothing updated" if not self.undo.unsaved else self.undo.report()
        log.warning("step %d skipped, %s: %s (%d skipped so far, %d in a row; trainer.max_skipped=%d)",
                    step, left, what, state.skipped, state.skipped_in_row, self.max_skipped)
        raise SkipStep

    # -- failure -------------------------------------------------------------------------------
    def abandoned(self, err: BaseException, step: int) -> BaseException:
        """Abandon the failed ``step``; returns the error to raise: ours as it is, any other
        exception as a StepError naming the step and saying what was undone (an in-place error of an
        autograd call made after an optimizer update of the step: the guard's explanation)."""
        stepped = {name: self.optimizers[name] for name in self.stepped}
        # the parameters' versions before the undo changes them: they name the one an in-place error is about
        versions = [(name, p, p._version) for name, p in self.named_parameters()] if stepped else []
        report = self.abandon()
        if isinstance(err, SafeloopError) or not isinstance(err, Exception):
            return err
        explained = self.guard.explain_outside(err, step, stepped, versions, report)
        if explained is not None:
            explained.__cause__ = err
            return explained
        wrapped = StepError(f"step {step} failed and was abandoned ({report}): {type(err).__name__}: {err}", step)
        wrapped.__cause__ = err
        return wrapped

    def abandon(self) -> str:
        """Drop the step's gradients and undo what ``undo`` can; returns what was left as it was."""
        report = self.undo.restore()
        self.stepped.clear()
        self.fresh.clear()
        self.batch = None
        if self.dist is not None:
            self.dist.reset()
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)
        for _, p in self.named_parameters():  # the model's parameters outside the optimizers too
            p.grad = None
        return report


def _add_values(total: dict[str, torch.Tensor], losses: Mapping[str, torch.Tensor]) -> None:
    for name, loss in losses.items():
        value = loss.data  # the value without the graph (cheaper than detach())
        total[name] = total[name] + value if name in total else value


def zero_grad(opt: torch.optim.Optimizer) -> None:
    """``opt.zero_grad(set_to_none=True)``. Where ``zero_grad`` is torch's own, what it does (every gradient
    to None) without the profiler range it opens: that range alone costs ~5 µs a call on CPU, a few
    percent of a small model's step. With a profiler running, ``zero_grad`` itself, so that traces show it."""
    if type(opt).zero_grad is not _zero_grad or "zero_grad" in vars(opt) or _profiling():
        opt.zero_grad(set_to_none=True)
        return
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None


def accumulators(optimizers: Mapping[str, torch.optim.Optimizer], kept: Iterable) -> list:
    """The AccumulateGrad node of every parameter the optimizers train; those in ``kept`` are reused
    (getting a parameter's node makes another node to find it: ~4 µs each)."""
    known = {id(node.variable): node for node in kept}  # a kept node holds its parameter: the id is its own
    nodes = []
    for opt in optimizers.values():
        for group in opt.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    node = known.get(id(p))
                    nodes.append(node if node is not None else torch.autograd.graph.get_gradient_edge(p).node)
    return nodes


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``closure`` argument without a default (L-BFGS)."""
    return _needs_closure(type(optimizer).step)


@functools.lru_cache(maxsize=256)
def _needs_closure(step: Callable) -> bool:
    closure = inspect.signature(step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty
