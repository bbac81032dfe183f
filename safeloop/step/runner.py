"""The one step cycle, for every kind of step.

    batch -> device -> [autocast] training_step -> guard pre-flight -> backward(s)
    -> gradient sync -> non-finite policy -> (per optimizer: unscale -> on_before_optimizer_step
    -> clip -> undo snapshot -> step -> zero_grad -> scheduler)

``Runner.run`` runs one step. Every backward goes through ``_backward`` and every optimizer
update through ``_update``: the automatic step calls them from ``run``; manual mode's
``self.backward`` / ``self.step`` (``Runner.backward`` / ``Runner.step``) call them from inside
``training_step``. An optimizer whose ``step`` takes a closure (L-BFGS, SAM) gets one that runs
the same pieces again: forward, backward(s), sync, non-finite policy, unscale, hook, clip.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from .. import fsdp, nonfinite
from ..callbacks import Hooks
from ..devices import AUTOCAST
from ..distributed import collective_failed, ready_twice
from ..errors import (ConfigError, ConfigWarning, GraphLifecycleError, NonFiniteError, SafeloopError, StepError,
                      user_stacklevel)
from ..guard.explain import Scope
from ..guard.guard import Guard, Recorder
from ..guard.walk import HAS_SEQ, sequence_now
from ..schedules import Schedules
from ..settings import Settings
from ..state import TrainState
from .plan import Backward, Routes, named_losses, plan, refuse_terms, trained
from .undo import Undo

log = logging.getLogger("safeloop")
UNUSED_AFTER = 20  # steps after which an optimizer no gradient reached, or an unused loss weight, is reported
MODAL = ("torch.nn.modules.dropout", "torch.nn.modules.batchnorm")  # the layers that train differently in eval mode


class SkipStep(BaseException):
    """A non-finite step under ``on_nonfinite=skip``: abandoned, counted, training goes on.
    A BaseException, so that a user's ``except Exception`` in a manual step cannot swallow it."""


@dataclass
class StepConfig:
    """What the step is made of, handed down by the Trainer at each ``fit`` (never the Trainer itself).

    Attributes:
        settings: the run's settings (grad_accum, grad_clip, multi_loss, loss_weights, on_nonfinite...).
        automatic: False in manual mode (``training_step`` calls ``self.backward`` / ``self.step``).
        training_step: the user's ``training_step``; ``forward``: what runs it (DDP's wrapper under torchrun).
        autocast: returns the forward's autocast context (a null context for precision 32).
        move: moves a batch to the device, or None (the CPU: DataLoader batches are there already).
        scope: what the guard may search to explain a mistake; its parameters lose their gradients
            when a step is abandoned.
        named_parameters: ``(name, parameter)`` pairs, for naming non-finite gradients.
        model: its buffers are put back after a diagnosis re-run of ``training_step``.
    """

    settings: Settings
    automatic: bool
    optimizers: dict[str, torch.optim.Optimizer]
    schedules: Schedules
    undo: Undo
    hooks: Hooks
    guard: Guard
    state: TrainState
    training_step: Callable
    forward: Callable
    autocast: Callable
    move: Callable | None
    scope: Scope
    named_parameters: Callable[[], list[tuple[str, torch.nn.Parameter]]]
    model: torch.nn.Module | None = None
    precision: str = "32"  # resolved: 32, bf16, bf16-true or 16
    scaler: Any = None
    dist: Any = None


class Runner:
    """Runs the steps of one ``fit``. ``previous``: the last fit's Runner over the same optimizers,
    whose routes and what it has reported carry over (logged once per run, not once per fit)."""

    def __init__(self, config: StepConfig, previous: Runner | None = None):
        c = self.config = config
        self.state, self.guard, self.hooks, self.dist = c.state, c.guard, c.hooks, c.dist
        self.optimizers, self.scaler, self.undo, self.settings = c.optimizers, c.scaler, c.undo, c.settings
        self.scope = dataclasses.replace(c.scope, rerun=self.rerun, optimized=lambda: [
            p for opt in self.optimizers.values() for g in opt.param_groups for p in g["params"]])
        self.automatic, self.names = c.automatic, list(self.optimizers)
        self.routed = len(self.names) > 1
        # FSDP2: the graph's leaves are the gathered parameters, not the optimizers' shards, so a routed loss is
        # back-propagated plainly and the gradients it leaves on other optimizers' parameters dropped (safeloop.fsdp)
        self.sharded = self.dist is not None and self.dist.sharded
        # under DDP several losses are back-propagated as their sum (see safeloop.distributed)
        self.multi_loss = "sum" if self.dist is not None and self.dist.losses_summed else c.settings.multi_loss
        self.finite = nonfinite.FiniteCheck() if c.settings.on_nonfinite != "off" else None
        if self.automatic and self.routed:
            shared_parameters(self.optimizers, c.named_parameters())
        self.clear = {name: clearing(opt) for name, opt in self.optimizers.items()}
        # optimizers updated whose gradients stay until the next step begins (or the next self.backward), as a
        # loop's stay from its step() to its next zero_grad(): on_step_end, on_epoch_end, validation see them
        self.applied: set[str] = set()
        if previous is not None:  # a new fit: the last one's are dropped now
            previous.clear_applied()
            previous.unhook()
        # manual mode: an optimizer stepped in the step other than by self.step (a Lightning port keeping opt.step())
        # would skip grad_clip, the non-finite check, its scheduler and the undo: refused before it changes anything
        self.updating = False  # inside the Trainer's own opt.step()
        self.step_hooks = [] if self.automatic else [handle for name, opt in self.optimizers.items() if (
            handle := step_pre_hook(opt, partial(self.stepped_directly, name))) is not None]
        # optimizers whose step() cannot do without a closure (L-BFGS): the automatic step gives them one
        self.closures = {name for name, opt in self.optimizers.items() if needs_closure(opt)}
        if self.closures and self.scaler is not None:
            raise ConfigError(f"optimizer {sorted(self.closures)[0]!r} steps with a closure, which precision=16's "
                              "GradScaler does not support: use precision=bf16 or 32")
        refuse_private(self.optimizers, c.settings)
        # manual mode steps inside training_step's autocast region, whose cached low-precision weights
        # must be dropped after every update (a later forward would use the old ones)
        self.recast = c.precision in AUTOCAST and not self.automatic
        same = previous is not None and previous.optimizers is self.optimizers
        self.routes = previous.routes if same else Routes(self.optimizers)
        # the parameters frozen when the optimizers were made (at the first fit: configure_optimizers runs once)
        self.frozen = previous.frozen if same else {id(p) for _, p in c.named_parameters() if not p.requires_grad}
        if same:
            warn_unfrozen(c.named_parameters(), self.optimizers, self.frozen)
        # logged once per run: (the losses whose backward retained the graph, walked by the guard) -> first step
        self.retain_plans: dict[tuple[tuple[str, ...], bool], int] = previous.retain_plans if same else {}
        # reported once: optimizers no gradient reached yet (and whose parameters nothing changed since these
        # version counters: manual mode may update them its own way, SAM's first_step and second_step), loss_weights
        # no loss had yet
        self.unreached: set[str] = previous.unreached if same else set(self.names)
        self.unreached_versions = previous.unreached_versions if same else {
            name: _versions(opt) for name, opt in self.optimizers.items()}
        self.unweighted: set[str] = previous.unweighted if same else set(self.weights)
        self.stepped: dict[str, int] = {}  # optimizers updated in this step -> node counter at the update
        self.fresh: dict[str, torch.Tensor] = {}  # manual mode: losses back-propagated since the last update
        self.batch = None  # manual mode: the micro-batch training_step runs on (re-run to explain a lost graph)
        self.skipped_losses: dict[str, torch.Tensor] = {}
        # version counters, to tell what a failed step changed other than by the Trainer's updates: the trained
        # parameters' at the step's start, and each updated optimizer's parameters' when its update began
        self.params = list(c.scope.parameters())
        self.versions: list[int] = []
        self.began: dict[str, list[int]] = {}
        # manual mode, on the steps the guard checks: the parameters a backward other than the Trainer's wrote
        # gradient into (see ``watch_outside``)
        self.outside: set[int] = set()
        self.outside_hooks: list = []
        self.own = False  # the Trainer's own backward is running
        self.diagnosing = False  # re-running training_step to explain a missing graph
        self.running: int | None = None  # the step under way, until it counts itself (before on_step_end)
        # the mode-changing layers, if the run began with every one in eval mode (after the first step: reported if
        # they still are; set to eval by the run's own code, a hook or training_step, they are taken as meant, in a
        # later fit too)
        self.left_in_eval = in_eval(c.model) if c.state.step == 0 else []
        self.mid_pass: tuple[int, int] | None = None  # (pass, batches of it before this fit) if the fit began in one
        self.model_order = {id(p): i for i, (_, p) in enumerate(c.named_parameters())}  # grad_clip's order
        if c.state.step == 0:  # a run starts from no gradient, as every step does (not from a probe's before fit)
            for p in [*self.params, *(p for _, p in c.named_parameters())]:
                p.grad = None

    @property
    def weights(self) -> dict[str, float]:
        """``loss_weights`` as they are now: a hook may change them between steps (a KL weight annealed)."""
        return self.settings.loss_weights or {}

    # -- the step ----------------------------------------------------------------------------
    def run(self, batches: list) -> None:
        """One optimizer step over ``batches`` (its micro-batches)."""
        state, guard = self.state, self.guard
        step = self.running = state.step + 1
        if self.dist is not None:
            self.dist.step = step  # named by its errors, whichever collective call fails
        timed = guard.begin_step(step)
        if self.mid_pass is None:  # the fit's first step: did its pass begin before the fit (a resume mid-pass)?
            self.mid_pass = (state.epoch, state.batch_in_epoch - len(batches))
        started = time.perf_counter()
        self.versions, self.began = [p._version for p in self.params], {}
        if guard.checking and not self.automatic:
            self.watch_outside()
        total: dict[str, torch.Tensor] = {}
        try:
            self.hooks("on_step_start")
            self.clear_applied()  # every step starts from the gradients no update applied yet (None, or accumulating)
            total = self.forward_backward(batches, step)
            if self.automatic:
                self.unweighted.difference_update(total)
                self.update(total, step, batches)
            elif self.scaler is not None and self.stepped:
                self.scaler.update()
            if self.automatic or self.stepped:  # an update made (or tried: precision 16's scaler skips it)
                state.skipped_in_row = 0
        except SkipStep:
            self.abandon()
            total = total or self.skipped_losses
        except BaseException as err:
            raise self.abandoned(err, step)
        self.undo.end()
        if self.stepped or self.automatic:  # (manual mode accumulating over steps: checked at the next update)
            self.fresh.clear()
        self.stepped.clear()
        self.unwatch_outside()
        state.losses = {k: v / len(batches) for k, v in total.items()} if len(batches) > 1 else total
        state.step, self.running = step, None
        if self.left_in_eval:
            warn_evaluating(self.left_in_eval, step)
            self.left_in_eval = []
        try:
            self.hooks("on_step_end", state.losses)
        except Exception as err:  # the update was made, and was right: it stays, and the error says so
            raise StepError(f"step {step}'s update was applied; the error came after it, in on_step_end: "
                            f"{type(err).__name__}: {err}", step) from err
        finally:
            if timed:
                guard.end_step(step, self.scope)
                guard.record_step_time(step, time.perf_counter() - started)
            guard.step_done()

    def forward_backward(self, batches: list, step: int, only: str | None = None) -> dict[str, torch.Tensor]:
        """Forward and backward(s) of every micro-batch; returns their losses' values, summed.
        ``only``: an evaluation for optimizer ``only``'s closure, which back-propagates its losses alone."""
        total: dict[str, torch.Tensor] = {}
        kept = None  # the gradients the last micro-batch's backward left, which the next one must find
        read = self.state.batch_in_epoch  # the pass's batches read, the step's all
        try:
            for i, batch in enumerate(batches):
                # counted up to this micro-batch, as training_step sees it (Lightning's batch_idx + 1)
                self.state.batch_in_epoch = read - len(batches) + 1 + i
                batch = batch if self.config.move is None else self.config.move(batch)
                self.batch = batch
                with self.config.autocast():
                    output = self.config.forward(batch)
                if not self.automatic:  # the losses training_step returns, if any, are logged
                    losses = named_losses(output, step, (), trained=False) if output is not None else {}
                else:
                    losses = named_losses(output, step, self.optimizers)
                    if only is not None and self.routed:
                        losses = {only: losses[only]} if only in losses else {}
                    if losses:
                        self.backward_all(losses, step, batch, first=i == 0 and only is None,
                                          last=i == len(batches) - 1, kept=kept)
                        if only is None and i < len(batches) - 1 and self.guard.check != "off":
                            kept = self.guard.accumulated(self.scope)
                            self.guard.micro_batch_done()
                for name, loss in losses.items():
                    total[name] = total[name] + loss.detach() if name in total else loss.detach()
                del output, losses, batch  # the step's graph must not outlive it (checked at its end)
        finally:
            self.state.batch_in_epoch = read
        self.batch = None
        return total

    # -- backward ----------------------------------------------------------------------------
    def backward_all(self, losses: dict[str, torch.Tensor], step: int, batch, first: bool, last: bool,
                     kept: list | None = None) -> None:
        """Automatic mode: every loss of one micro-batch, through the guard's pre-flight (``kept``: the gradients
        the last micro-batch's backward left)."""
        guard, dist = self.guard, self.dist
        accum = self.settings.grad_accum  # each loss divided by it, as a hand loop's `loss / accum` and Lightning's
        summed = self.multi_loss == "sum" and not self.routed and len(losses) > 1
        retain = guard.preflight(losses, step, self.scope, batch, first, summed, kept=kept)
        if retain is not None and len(losses) > 1 and not self.routed:
            refuse_terms(losses, step)
        todo = plan(losses, self.optimizers, retain, self.multi_loss, self.weights,
                    self.routes if self.routed else None, guard.start_seq, step)
        if len(todo) > 1:
            self.note_retain(todo, retain is not None, step)
        if self.sharded and self.settings.grad_accum > 1:  # FSDP2 reduces the gradients of the last micro-batch
            fsdp.sync_gradients(self.config.model, last)
        for k, item in enumerate(todo):
            loss = item.loss / accum if accum > 1 else item.loss
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            self.hooks("on_before_backward", item.name, loss)  # what is back-propagated, as Lightning gives it
            if self.hooks.has("on_before_backward"):
                guard.check_written_again(item.name)
            if self.sharded:
                self._backward(loss, item.name, step, batch, item.retain, None, item.loss, route=item.optimizer)
            else:
                self._backward(loss, item.name, step, batch, item.retain, item.inputs, item.loss)
            if last and dist is not None:  # the last backward into an optimizer's parameters: averaged, as by DDP's
                dist.after_backward(todo, k, self.optimizers)
            self.hooks("on_after_backward", item.name)

    def backward(self, loss: torch.Tensor, optimizer: str | None, retain_graph: bool,
                 create_graph: bool = False, sync: bool = True) -> None:
        """Manual mode's ``self.backward``: one loss into one optimizer's parameters, through the guard; under
        torchrun the optimizer's gradients are then averaged over the ranks (``sync``), as after DDP's backward."""
        if self.diagnosing:
            return
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
        if self.outside:
            self.check_outside(optimizer or self.names[0], step)
        self.clear_applied()  # what updates applied is not added to (optimizers may share parameters)
        guard = self.guard
        routed = self.routed and not self.sharded
        inputs = self.routes.inputs(optimizer, loss, guard.start_seq, step) if routed else None
        if inputs is not None:
            inputs = _not_yet_reached(loss, inputs, optimizer)
        guard.preflight({name: loss}, step, self.scope, self.batch, inputs=inputs, keeps=retain_graph)
        if self.stepped and HAS_SEQ and guard.checking:  # unchecked steps: explained if backward fails
            found = guard.inplace_check(loss, self.stepped, guard.start_seq, inputs)
            if found is not None:
                err, stepped = found
                raise guard.explain(err, name, loss, step, self.scope, self.batch, stepped) from err
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        self.hooks("on_before_backward", name, scaled)
        if self.hooks.has("on_before_backward"):
            guard.check_written_again(name)
        self._backward(scaled, name, step, self.batch, retain_graph, inputs, loss,
                       route=optimizer if self.sharded and self.routed else None, create_graph=create_graph)
        guard.backward_done(retain_graph, inputs)
        if self.recast:  # the next forward casts the weights anew, as a hand loop's region per forward does, so
            torch.clear_autocast_cache()  # weights written by hand since (AWP's attack, SAM's ascent) are not stale
        if self.dist is not None and sync:  # not sync: accumulating, as under DDP's no_sync (self.step averages)
            self.dist.sync(optimizer or self.names[0])
        if self.finite is not None:  # checked with the gradients at the next update
            self.fresh[name if name not in self.fresh else f"{name} #{len(self.fresh) + 1}"] = loss.detach()
        self.hooks("on_after_backward", name)

    def _backward(self, loss: torch.Tensor, name: str, step: int, batch, retain: bool, inputs,
                  original: torch.Tensor, route: str | None = None, create_graph: bool = False) -> None:
        """The one ``backward`` call; an autograd error comes back explained by the guard. ``route``: under
        FSDP2, the optimizer whose parameters alone keep the gradients (``inputs=`` reaches no shard)."""
        self.own = True
        try:
            with fsdp.only(self.optimizers, route) if route is not None else nullcontext():
                if inputs is None or inputs:  # (not when every parameter was reached already: ``_not_yet_reached``)
                    loss.backward(retain_graph=retain, create_graph=create_graph, inputs=inputs)
        except RuntimeError as err:
            explained = self.guard.explain(err, name, original, step, self.scope, batch, list(self.stepped))
            if explained is None:
                raise
            raise explained from err
        finally:
            self.own = False

    def watch_outside(self) -> None:
        """Manual mode, on a step the guard checks: note each parameter a backward other than the Trainer's
        accumulates gradient into (a post-accumulate hook per parameter, removed at the step's end). Gradient
        assigned by hand (``p.grad = g``, implicit MAML) is no backward's and is not noted."""
        def written(param: torch.Tensor) -> None:
            if not self.own:
                self.outside.add(id(param))

        self.outside_hooks = [p.register_post_accumulate_grad_hook(written) for p in self.params if p.requires_grad]

    def unwatch_outside(self) -> None:
        for handle in self.outside_hooks:
            handle.remove()
        self.outside_hooks.clear()
        self.outside.clear()

    def check_outside(self, name: str, step: int) -> None:
        """Before the Trainer's backward into optimizer ``name``'s parameters: gradient an outside backward of
        this step left there would be added to the update (an attack's ``loss.backward()``, say)."""
        # still there: not cleared since (None, or zeros: read only on this rare path)
        held = {id(p) for p in trained(self.optimizers[name])
                if id(p) in self.outside and p.grad is not None and bool(p.grad.any())}
        if held:
            names = [n for n, p in self.config.named_parameters() if id(p) in held]
            raise StepError(
                f"step {step}: {', '.join(f'`{n}`' for n in names[:3])}{' and more' if len(names) > 3 else ''} hold "
                "gradient from a backward run outside self.backward in this step (loss.backward() in "
                "training_step: an attack taking an input's gradient, say), which self.backward(loss, "
                f"optimizer={name!r}) would add to, changing the update. Clear it after that backward "
                f"(self.optimizers[{name!r}].zero_grad()), or take that gradient with torch.autograd.grad(loss, "
                "[x]), which writes no .grad", step)

    def note_retain(self, todo: list[Backward], walked: bool, step: int) -> None:
        """Log, once per set of losses, which backwards kept the graph alive for a later loss (a step the
        guard does not walk that retains the same ones is recorded in ``retain_plans``, not logged again)."""
        key = (tuple(item.name for item in todo if item.retain), walked)
        if key in self.retain_plans:
            return
        said = any(kept == key[0] for kept, _ in self.retain_plans)
        self.retain_plans[key] = step
        if said:
            return
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
    def update(self, losses: Mapping[str, torch.Tensor], step: int, batches: list) -> None:
        """Automatic mode, after the backwards: sync, the non-finite policy, every optimizer's update."""
        if self.dist is not None:  # (each optimizer's gradients were averaged after its last backward)
            self.dist.check(step)
        names = [n for n in self.names if n in losses] if self.routed else self.names
        if self.finite is not None:
            self.check_finite(losses, step, None)
        for name in names:
            closure, current = self.recompute(name, step, batches, losses) if name in self.closures else (None, None)
            self._update(name, step, last=name is names[-1], closure=closure, current=current)
        if self.scaler is not None:
            self.scaler.update()

    def step(self, optimizer: str | None, closure: Callable[[], torch.Tensor] | None = None) -> None:
        """Manual mode's ``self.step``: one optimizer's update, as the automatic step makes it
        (``closure``: see ``closure``)."""
        if self.diagnosing:
            return
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
        if self.scaler is not None and name in self.stepped:  # unscale_ would fail: "... called after step()"
            raise StepError(f"step {step}: self.step({name!r}) a second time in one step under precision=16: the "
                            "GradScaler is updated once per step, after every optimizer's update (as PyTorch's AMP "
                            "examples do), so each optimizer updates once a step; make each update a step of its "
                            "own, or use precision=bf16", step)
        if self.dist is not None:  # every rank checks the same averaged gradients
            self.dist.sync(name)
        if self.finite is not None:
            self.check_finite(self.fresh, step, name)
            self.fresh.clear()
        self._update(name, step, last=None, closure=closure)

    def _update(self, name: str, step: int, last: bool | None, closure: Callable[[], torch.Tensor] | None = None,
                current: torch.Tensor | None = None) -> None:
        """The one optimizer update: sync, unscale, hook, clip, snapshot (if a later failure of the step
        must be able to undo it; ``last``: whether it is the step's last update, None when unknown),
        step, scheduler (its gradients are cleared when the next step begins). ``closure``, ``current``: see
        ``closure``."""
        opt = self.optimizers[name]
        self.config.schedules.check(name, step)  # not stepped by other code too: before anything changes
        if self.dist is not None:  # average gradients over ranks (once: a no-op if already synced)
            self.dist.sync(name)
        # gradients only: a failure in it (a hook, say) leaves the optimizer unchanged. With a closure, the gradients
        # a backward left before it (SAM's first phase); its own are readied after each of its calls (L-BFGS's)
        if closure is None or current is not None or any(p.grad is not None for p in trained(opt)):
            self.prepare(name, opt)
        self.began[name] = _versions(opt)
        # a step with a closure runs forward and backward inside: anything may fail after it changed weights
        self.undo.before_update(name, False if closure is not None else last)
        self.guard.at_update(trained(opt))
        self.updating = True
        try:
            if closure is not None:
                opt.step(self.closure(name, step, opt, closure, current))
            elif self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
        finally:
            self.updating = False
        if closure is not None:  # the gradients its backwards wrote were this update's
            self.guard.at_update(trained(opt))
        if name in self.unreached and any(p.grad is not None for g in opt.param_groups for p in g["params"]):
            self.unreached.discard(name)
        self.applied.add(name)  # its gradients stay until the next step begins (``clear_applied``)
        self.config.schedules.after_update(name, opt, step)
        self.stepped[name] = sequence_now()
        if self.recast:
            torch.clear_autocast_cache()

    def stepped_directly(self, name: str, *_: Any) -> None:
        """An optimizer's step pre-hook (manual mode): its ``step()`` called by the step's own code."""
        if self.running is not None and not self.updating and not self.diagnosing:
            raise StepError(f"step {self.running}: optimizer {name!r} was stepped by its own step() in the step (as "
                            f"Lightning's opt.step()); in manual mode call self.step({name!r}), which updates as the "
                            "Trainer does: the non-finite check, grad_clip, on_before_optimizer_step, its scheduler, "
                            "and the undo of a step that fails", self.running)

    def unhook(self) -> None:
        for handle in self.step_hooks:
            handle.remove()
        self.step_hooks = []

    def clear_applied(self) -> None:
        """Clear the gradients that updates already applied (at a step's start, and before the Trainer's backward)."""
        for name in self.applied:
            self.clear[name]()
        self.applied.clear()

    def applied_parameters(self) -> frozenset[int]:
        """The ids of the parameters whose gradients an update already applied (no checkpoint keeps them)."""
        return frozenset(id(p) for name in self.applied for p in trained(self.optimizers[name]))

    def prepare(self, name: str, opt: torch.optim.Optimizer) -> None:
        """The gradients as the update must see them: unscaled, shown to the hook (before clipping, as Lightning
        shows them), clipped. The norm is taken over the optimizer's parameters in the model's order, as
        ``clip_grad_norm_(model.parameters(), ...)`` takes it (the order changes the norm's last bit)."""
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        self.hooks("on_before_optimizer_step", name, opt)
        if self.settings.grad_clip is not None:
            params = sorted((p for g in opt.param_groups for p in g["params"]),
                            key=lambda p: self.model_order.get(id(p), len(self.model_order)))
            if any(p.grad is not None and p.grad.is_sparse for p in params):
                self.refuse_sparse_clip(name, params)
            torch.nn.utils.clip_grad_norm_(params, self.settings.grad_clip)

    def refuse_sparse_clip(self, name: str, params: list[torch.Tensor]) -> None:
        """``grad_clip`` over sparse gradients (``nn.Embedding(sparse=True)``'s), which torch's ``clip_grad_norm_``
        cannot take a norm of: said before anything changed, with what to do instead."""
        sparse = {id(p) for p in params if p.grad is not None and p.grad.is_sparse}
        names = [f"`{n}`" for n, p in self.config.named_parameters() if id(p) in sparse] or ["a parameter"]
        step = self.state.step + 1
        raise StepError(f"step {step}: grad_clip={self.settings.grad_clip} clips optimizer {name!r}'s gradients, and "
                        f"{', '.join(names[:3])} holds a sparse gradient (nn.Embedding(sparse=True), "
                        "nn.EmbeddingBag(sparse=True)), whose norm torch's clip_grad_norm_ cannot take. Leave "
                        "grad_clip out and clip the dense parameters in on_before_optimizer_step "
                        "(torch.nn.utils.clip_grad_norm_(params, max_norm) for the optimizer it is given), or make "
                        "the embedding dense (sparse=False)", step)

    def closure(self, name: str, step: int, opt: torch.optim.Optimizer, evaluate: Callable[[], torch.Tensor],
                current: torch.Tensor | None = None) -> Callable[[], torch.Tensor]:
        """What ``opt.step(closure)`` calls: ``name``'s gradients cleared, ``evaluate()`` (the loss,
        back-propagated), then the gradients made ready as for any update: sync over ranks, the
        non-finite policy, unscale, hook, clip. ``current``: the loss whose gradients ``opt`` already
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
            self.clear[name]()
            if self.recast:  # the weights changed inside training_step's autocast region
                torch.clear_autocast_cache()
            with torch.enable_grad():
                loss = evaluate()
            if self.dist is not None:
                self.dist.sync(name)
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
        finite = self.finite(losses.values(), grads)
        if self.dist is not None:  # a loss (or a shard of the gradients) is this rank's: all skip or stop together
            finite = self.dist.agree(int(not finite)) == 0
        if finite:  # (the count of steps skipped in a row starts again once the step is done: ``run``)
            return
        what = nonfinite.describe(losses, self.config.named_parameters())
        where = f"before optimizer {name!r} stepped" if name is not None and self.routed else \
            "before the optimizer step"
        if self.settings.on_nonfinite == "error":
            raise NonFiniteError(
                f"step {step}: {what}. The step was abandoned {where} ({self.left()}). To find the cause "
                "run with debug=default (anomaly detection names the backward operation that made the first NaN), "
                "lower the learning rate or set trainer.grad_clip; trainer.on_nonfinite=skip skips such steps "
                "instead", step)
        state, most = self.state, self.settings.max_skipped
        if state.skipped_in_row >= most:
            raise NonFiniteError(
                f"step {step}: {what}, and the {state.skipped_in_row} steps before it were skipped for the same "
                f"reason (trainer.max_skipped={most}): training diverged, this is not a rare bad "
                "batch. Resume from an earlier checkpoint with a lower learning rate or trainer.grad_clip", step)
        state.skipped_in_row += 1
        state.skipped += 1
        self.skipped_losses = dict(losses)  # what the step shows, in manual mode too (its step did not return)
        left = "nothing updated" if not (self.undo.unsaved or self.changed_outside()) else self.left()
        log.warning("step %d skipped, %s: %s (%d skipped so far, %d in a row; trainer.max_skipped=%d)",
                    step, left, what, state.skipped, state.skipped_in_row, most)
        raise SkipStep

    # -- failure -------------------------------------------------------------------------------
    def abandoned(self, err: BaseException, step: int) -> BaseException:
        """Abandon the failed ``step``; returns the error to raise: ours as it is, any other
        exception as a StepError naming the step and saying what was undone (an in-place error of an
        autograd call made after an optimizer update of the step: the guard's explanation)."""
        self.running = None
        stepped = {name: self.optimizers[name] for name in self.stepped}
        # the parameters' versions before the undo changes them: they name the one an in-place error is about
        named = self.config.named_parameters()
        versions = [(name, p, p._version) for name, p in named] if stepped else []
        report, by_hand = self.left(), bool(self.changed_outside())
        self.abandon()
        if isinstance(err, GraphLifecycleError) and err.abandoned is None:
            err.abandon(report)  # in manual mode updates of this step may have run before it: say what is left
        if type(err) is StepError and by_hand:  # ours, after parameters changed by hand: say that they stay so
            return StepError(f"{err} (the step was abandoned: {report})", err.step)
        if not isinstance(err, Exception):  # a KeyboardInterrupt (a second signal): as it is, saying what is left
            err.add_note(f"step {step} was abandoned: {report}")
            return err
        if isinstance(err, SafeloopError):
            return err
        explained = self.guard.explain_outside(err, step, stepped, versions, report)
        if explained is None and self.dist is not None and collective_failed(err):
            explained = self.dist.lost(err, step, "take part in this step's collective calls (under "
                                       "DistributedDataParallel: its all-reduce of the gradients)", report)
        if explained is not None:
            explained.__cause__ = err
            return explained
        wrapped = StepError(f"step {step} failed and was abandoned ({report}): {type(err).__name__}: {err}"
                            + self.missing_hint(err) + ready_twice(err), step)
        wrapped.__cause__ = err
        return wrapped

    def missing_hint(self, err: BaseException) -> str:
        """For a Trainer attribute missing in the first pass of a fit that began mid-pass (a resume): the hook that
        sets it at each pass's start did not run in this process. For a dict called: Lightning's optimizers()."""
        if isinstance(err, TypeError) and str(err) == "'dict' object is not callable":
            return (". If it is self.optimizers() or self.lr_schedulers() (Lightning's): self.optimizers and "
                    "self.schedulers are dicts by optimizer name here, self.optimizers['name']")
        epoch, before = self.mid_pass or (None, 0)
        trainer = getattr(self.config.training_step, "__self__", None)
        if not (isinstance(err, AttributeError) and err.obj is trainer and before > 0 and epoch == self.state.epoch):
            return ""
        return (f". This fit began {before} batches into pass {epoch} (a resume mid-pass): on_epoch_start ran when the "
                f"pass began, before the checkpoint, and not again; if it sets `{err.name}`, save it in "
                "on_save_checkpoint and put it back in on_load_checkpoint")

    def left(self) -> str:
        """What abandoning the step now leaves as it was before the step, and what it does not."""
        changed = self.changed_outside()
        if not changed:
            return self.undo.report()
        return (f"{self.undo.report()}; but {', '.join(f'`{n}`' for n in changed[:3])}"
                f"{f' and {len(changed) - 3} more' if len(changed) > 3 else ''} changed in this step other than by "
                "self.step or the Trainer's update (by hand, as SAM's first_step does), and stay changed")

    def changed_outside(self) -> list[str]:
        """The trained parameters this step changed other than by the Trainer's own updates (their version
        counters moved since the step began, or, for an optimizer the Trainer updated, before its update began;
        or the guard saw them written through `.data`, unless their optimizer's snapshot, taken at its update, puts
        them back)."""
        began = {id(p): v for name, versions in self.began.items()
                 for p, v in zip((p for g in self.optimizers[name].param_groups for p in g["params"]), versions)}
        moved = {id(p) for p, v in zip(self.params, self.versions) if began.get(id(p), p._version) != v}
        restored = {id(p) for name in self.undo.saved for g in self.optimizers[name].param_groups for p in g["params"]}
        moved.update(id(p) for p in self.guard.written_unseen if id(p) not in restored)
        return [name for name, p in self.config.named_parameters() if id(p) in moved] if moved else []

    def abandon(self) -> str:
        """Drop the step's gradients and undo what ``undo`` can; returns what was left as it was."""
        report = self.undo.restore()
        self.unwatch_outside()
        self.stepped.clear()
        self.fresh.clear()
        self.batch = None
        if self.dist is not None:
            self.dist.reset()
        for clear in self.clear.values():
            clear()
        self.applied.clear()
        for _, p in self.config.named_parameters():  # the model's parameters outside the optimizers too
            p.grad = None
        if self.scaler is not None:  # its scale changes at update() only; forget which optimizers it unscaled, stepped
            self.scaler._per_optimizer_states.clear()  # (torch's own name: update() resets it so)
        return report

    def rerun(self, batch) -> set[str] | None:
        """Re-run ``training_step`` on ``batch`` recording how the graph was lost (the error path only).
        RNG state and module buffers are put back afterwards, and manual ``self.backward`` / ``self.step``
        do nothing meanwhile, so the re-run changes nothing."""
        if batch is None or self.diagnosing:
            return None
        model = self.config.model
        rng = torch.get_rng_state()
        buffers = {k: v.clone() for k, v in model.named_buffers()} if model is not None else {}
        self.diagnosing = True
        recorder = Recorder()
        try:
            # the re-run only records how the graph was lost; its own failure adds nothing
            with suppress(Exception), recorder, self.config.autocast():
                self.config.training_step(batch)
        finally:
            self.diagnosing = False
            torch.set_rng_state(rng)
            for k, v in model.named_buffers() if model is not None else ():
                v.copy_(buffers[k])
        return recorder.seen

    # -- what is reported once ---------------------------------------------------------------
    def warn_unused(self, step: int, final: bool) -> None:
        """After ``UNUSED_AFTER`` steps (or at the end), once: the optimizers no gradient reached and the
        ``loss_weights`` keys that named no loss so far."""
        if not (self.unreached or self.unweighted) or not (final or step >= UNUSED_AFTER):
            return
        for name in sorted(self.unreached):
            opt = self.optimizers[name]
            if any(p.grad is not None for g in opt.param_groups for p in g["params"]):
                continue  # reached: its gradients wait for a later self.step() (manual mode accumulating over steps)
            if _versions(opt) != self.unreached_versions[name]:
                continue  # its parameters changed: updated another way
            warnings.warn(f"optimizer {name!r} has not updated anything in the {step} steps so far: no loss's "
                          "gradient reached its parameters (is a loss returned, or self.backward(loss, "
                          f"optimizer={name!r}) called, for it? are its parameters the ones the forward uses, "
                          "with requires_grad?)", ConfigWarning, stacklevel=user_stacklevel())
        if self.unweighted:
            warnings.warn(f"loss_weights names {sorted(self.unweighted)}, but no loss of the {step} steps so "
                          f"far had that name (the losses: {sorted(self.state.losses)}): the weight is not "
                          "applied; fix the key", ConfigWarning, stacklevel=user_stacklevel())
        self.unreached.clear()
        self.unweighted.clear()


def step_pre_hook(opt: torch.optim.Optimizer, fn: Callable) -> Any:
    """``opt.register_step_pre_hook(fn)``'s handle; None for a wrapper that never ran ``Optimizer.__init__``, which
    keeps no hooks (a Lookahead of its own making)."""
    try:
        return opt.register_step_pre_hook(fn)
    except AttributeError:
        return None


def in_eval(model: torch.nn.Module | None) -> list[tuple[str, torch.nn.Module]]:
    """The dropout and batch-norm layers of ``model`` that eval mode changes (dropout of p > 0, batch norm tracking
    running statistics), if ``model`` itself and every one of them are in eval mode (``model.eval()``); otherwise (a
    part frozen on purpose, ``model.backbone.eval()``; or no such layer) an empty list."""
    if model is None or model.training:
        return []
    layers = [(name, m) for name, m in model.named_modules() if type(m).__module__ in MODAL  # that mode changes:
              and getattr(m, "p", 1) and getattr(m, "track_running_stats", True)]  # not p=0, not batch statistics
    return [] if any(m.training for _, m in layers) else layers


def warn_evaluating(layers: list[tuple[str, torch.nn.Module]], step: int) -> None:
    """A ``ConfigWarning`` when ``layers``, every mode-changing layer of the model and all in eval mode when the fit
    began, still are after ``step`` (``model.eval()`` left from an evaluation, or a loader that returns models so).
    A part of the model in eval mode is taken as meant (a fine-tuning's frozen backbone), as is eval mode the run's
    own code sets (a linear probe on frozen features calling ``model.eval()`` in ``on_epoch_start``)."""
    if any(m.training for _, m in layers):
        return
    shown = ", ".join(f"`model.{name}` ({type(m).__name__})" for name, m in layers[:3])
    warnings.warn(f"every dropout and batch-norm layer of the model ({shown}{' and more' if len(layers) > 3 else ''}) "
                  f"was in eval mode through step {step}: training runs without dropout, and batch norm normalizes "
                  "with running statistics it does not update. The Trainer leaves modes as it finds them (as "
                  "Lightning's does); call model.train() before fit(), or in training_step if your loop did. If eval "
                  "mode is meant (a linear probe keeping batch-norm statistics), call model.eval() in on_fit_start "
                  "rather than before fit()",
                  ConfigWarning, stacklevel=user_stacklevel())


def _versions(opt: torch.optim.Optimizer) -> list[int]:
    return [p._version for g in opt.param_groups for p in g["params"]]


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` has a ``closure`` argument without a default (L-BFGS), or the optimizer is a
    two-phase one, SAM as its authors wrote it: ``first_step`` and ``second_step``, and a ``step(closure=None)`` that
    calls them around the closure (and fails without one)."""
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    two_phase = all(callable(getattr(optimizer, name, None)) for name in ("first_step", "second_step"))
    return closure is not None and (closure.default is inspect.Parameter.empty or two_phase)


def refuse_private(optimizers: Mapping[str, torch.optim.Optimizer], settings: Settings) -> None:
    """opacus's ``DPOptimizer`` clips each sample's gradient and averages over the backwards since its last step
    itself: ``grad_clip`` would clip ``p.grad``, which its step replaces, and ``grad_accum``'s division of each loss
    would shrink the per-sample gradients it clips (clipped at N times the bound) and average twice."""
    dp = sys.modules.get("opacus.optimizers.optimizer")  # (opacus is not imported here: a DPOptimizer imported it)
    name = next((n for n, opt in optimizers.items() if dp is not None and isinstance(opt, dp.DPOptimizer)), None)
    if name is None:
        return
    what = f"optimizer {name!r} is opacus's {type(optimizers[name]).__name__}, which"
    problems = []
    if settings.grad_clip is not None:
        problems.append(f"grad_clip={settings.grad_clip} would clip p.grad, and {what} replaces p.grad by its own "
                        "clipped and noised sum of per-sample gradients: drop grad_clip, the clipping is opacus's "
                        "max_grad_norm (make_private(..., max_grad_norm=...))")
    if settings.grad_accum > 1:
        problems.append(f"grad_accum={settings.grad_accum} divides each loss by {settings.grad_accum} before "
                        f"opacus's hooks take the per-sample gradients, and {what} clips those and averages over "
                        "its accumulated backwards itself: the samples would be clipped at "
                        f"{settings.grad_accum} times max_grad_norm and the update divided twice. Drop grad_accum: "
                        "give train_data the logical batch size and split it with opacus's BatchMemoryManager "
                        "(max_physical_batch_size=...), one Trainer step per physical batch")
    if problems:
        raise ConfigError(problems)


def warn_unfrozen(named_parameters, optimizers: dict, frozen: set[int]) -> None:
    """A later fit: parameters unfrozen since the optimizers were made, which none of them holds, would not train."""
    held = {id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]}
    names = [n for n, p in named_parameters if id(p) in frozen and p.requires_grad and id(p) not in held]
    if names:
        shown = ", ".join(f"`{n}`" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        warnings.warn(f"{shown} require grad now but were frozen when the optimizers were made, at this Trainer's "
                      "first fit(), and no optimizer holds them: configure_optimizers runs once per Trainer "
                      "(Lightning's runs at every fit), so this fit would not train them. Add them "
                      f"(trainer.optimizers[{next(iter(optimizers))!r}].add_param_group({{'params': [...]}})), or "
                      "make their optimizers over every parameter (frozen ones get no gradient and stay as they "
                      "are)", ConfigWarning, stacklevel=user_stacklevel())


def _not_yet_reached(loss: torch.Tensor, inputs: list[torch.Tensor], optimizer: str) -> list[torch.Tensor]:
    """``inputs`` (``optimizer``'s parameters) less those whose ``.grad`` holds ``loss``'s gradient already, from its
    backward into another optimizer that holds them too (the chatbot tutorial's embedding, shared by its encoder's and
    its decoder's optimizers, which a hand-written loop back-propagates one loss into once and steps twice): routed to
    both, it would get that gradient twice. Noted on the loss's graph, which forgets it when it dies; a gradient an
    update cleared since is written again. A second backward into the same optimizer is left to the guard."""
    if loss.grad_fn is None:
        return inputs
    reached = loss.grad_fn.metadata.setdefault(_REACHED, {})  # parameter -> the optimizer it was first reached for
    return [p for p in inputs if reached.setdefault(id(p), optimizer) == optimizer or p.grad is None]


_REACHED = "safeloop.routed"  # the key of ``_not_yet_reached``'s note in a loss's root node's metadata


def clearing(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    """What clears ``optimizer``'s gradients: ``zero_grad(set_to_none=True)``, or ``zero_grad()`` where it
    takes no argument (Lookahead as its authors published it, older wrappers), as a hand-written loop calls it."""
    try:
        params = inspect.signature(optimizer.zero_grad).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): torch's own
        return partial(optimizer.zero_grad, set_to_none=True)
    takes = any(p.name == "set_to_none" or p.kind is p.VAR_KEYWORD for p in params)
    return partial(optimizer.zero_grad, set_to_none=True) if takes else optimizer.zero_grad


def shared_parameters(optimizers: Mapping[str, torch.optim.Optimizer], named: list[tuple[str, torch.Tensor]]) -> None:
    """Automatic mode back-propagates every loss of a step before any optimizer steps: two optimizers
    holding the same parameter would each step with both losses' gradients on it, and the one that steps
    second would find it cleared. Refused, naming them (a hand-written loop steps each in turn)."""
    held = {name: {id(p) for g in opt.param_groups for p in g["params"]} for name, opt in optimizers.items()}
    for (a, in_a), (b, in_b) in itertools.combinations(held.items(), 2):
        both = in_a & in_b
        if both:
            shown = [name for name, p in named if id(p) in both] or ["tensors outside the model"]
            raise ConfigError(
                f"optimizers {a!r} and {b!r} both hold {len(both)} parameter(s) ({', '.join(shown[:3])}"
                f"{', ...' if len(shown) > 3 else ''}): in automatic mode every loss is back-propagated before "
                f"any optimizer steps, so {a!r} would also step with the gradient of the loss for {b!r}, and {b!r} "
                "would find it cleared. Give each parameter to one optimizer, or set automatic = False and call "
                "self.backward(loss, optimizer=name) and self.step(name) in the order the updates must happen")
