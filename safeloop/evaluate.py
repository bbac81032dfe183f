"""The evaluation loop of ``validate``, ``test`` and ``predict``: a step over a data set, without gradients, in
eval mode; the mean loss(es) per sample (validation, test) or each batch's output (predict).

Each batch's losses count as many times as the batch has samples, so that the result is the mean over
samples whatever the batch sizes (a smaller last batch weighs less). A batch's number of samples is the
leading size of its first tensor, as Lightning infers ``batch_size``; a ``validation_step`` that knows
better returns ``(losses, n)``. Under torchrun each rank evaluates its own share of the data
(``Distributed.shard_val``) and one all-reduce adds up the ranks' sums and counts, so that every rank
gets the same metrics over the whole set; predictions are not gathered: each rank keeps its own share's.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .checkpoint import epoch_start, rng_state, set_generators, set_rng_state
from .devices import autocast, place
from .errors import ConfigError, ConfigWarning, SafeloopError, StepError, user_stacklevel
from .seed import seeded_workers
from .settings import samples_problem

if TYPE_CHECKING:
    from .distributed import Distributed

log = logging.getLogger("safeloop")


@dataclass(frozen=True)
class Kind:
    """An evaluation pass as its messages name it."""

    name: str  # validation, test, predict
    data: str  # what holds its batches
    step: str  # the Trainer's method run on each batch
    prefix: str = ""  # of its metrics' names


VALIDATION = Kind("validation", "val_data", "validation_step", "val_")
TEST = Kind("test", "test data", "test_step", "test_")  # Trainer.test(data)
PREDICT = Kind("predict", "predict data", "predict_step")  # Trainer.predict(data)


@dataclass
class Evaluator:
    """One loop over a data set in eval mode and without gradients, for ``validate``, ``test`` and ``predict``:
    ``model`` on ``device`` in ``precision`` (``test`` and ``predict`` may come before any ``fit``), each batch
    moved by ``move`` where training's are (None: as it is) and passed to a step under the precision's
    autocast; under torchrun (``dist``) over this rank's share. ``step`` is the training step the pass follows,
    named in its errors."""

    model: torch.nn.Module | None
    device: torch.device
    precision: str
    move: Callable | None
    step: int
    dist: Distributed | None = None
    others: tuple = ()  # the modules kept outside ``model`` (``Trainer.modules()``: an EMA copy): in eval mode too
    fitting: bool = False  # inside ``fit()``: the random generators come back after the pass

    def means(self, data: Iterable, step_fn: Callable[[object], torch.Tensor | Mapping | None],
              kind: Kind = VALIDATION, logged: dict | None = None) -> dict[str, float]:
        """``step_fn``'s loss (or dict of losses) over the samples of ``data``, named ``<kind.prefix><name>``
        (``val_loss``) and logged; under torchrun over every rank's share, the same on every rank. ``logged``: the
        Trainer's ``self.log`` values, set aside while the pass runs, so that what ``step_fn`` logs
        (``self.log("val_acc", acc)``) is a mean over the samples too, named as logged (Lightning's default for a
        validation step); it takes the place of a loss's metric of the same name."""
        totals: dict[str, list[float]] = {}  # name: [sum of loss * samples, samples]
        kept = dict(logged or {})  # logged in training, before this pass: put back after it
        logs = {} if logged is None else logged
        logs.clear()

        def add(batch, out) -> None:
            losses, n = counted(out, kind) if isinstance(out, tuple) else (out, samples(batch, kind))
            if losses is not None and not isinstance(losses, (torch.Tensor, Mapping)):
                raise TypeError(f"{kind.step} returned a {type(losses).__name__}: return the loss as a tensor (or a "
                                "dict of them, or (losses, n)), or log metrics with self.log(name, value)")
            losses = {"loss": losses} if isinstance(losses, torch.Tensor) else dict(losses or {})
            if not losses and not logs:
                raise TypeError(f"{kind.step} returned {type(out).__name__} and logged nothing: return the loss (or "
                                "a dict of losses), or log the metrics with self.log(name, value)")
            for name, value in losses.items():  # (float() would name neither the entry nor its shape)
                if isinstance(value, torch.Tensor) and value.numel() != 1:
                    raise ValueError(f"{kind.step} returned {name!r} of shape {tuple(value.shape)}; each loss (each "
                                     "entry of a returned dict) must be a scalar, averaged over the samples: reduce "
                                     "it with .mean(), and keep predictions or labels for a metric of the whole set "
                                     "on self, to compute it in on_validation_end(metrics)")
            for name, value in {**{kind.prefix + k: v for k, v in losses.items()}, **logs}.items():
                total = totals.setdefault(name, [0.0, 0.0])
                total[0] += float(value) * float(n)
                total[1] += float(n)
            logs.clear()

        try:
            done = self.run(data, step_fn, add, kind)
        finally:
            logs.clear()
            logs.update(kept)
        if self.dist is not None:
            totals = summed(totals, done, self.dist, kind)
        metrics = {name: total / count if count else math.nan for name, (total, count) in totals.items()}
        log.info("%s at step %d: %s", kind.name, self.step, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        return metrics

    def outputs(self, data: Iterable, step_fn: Callable[[object], object]) -> list:
        """What ``step_fn`` returns for each batch of ``data``, in order, as it returns it; under torchrun
        this rank's share only (nothing is gathered)."""
        out: list = []
        self.run(data, step_fn, lambda batch, value: out.append(value), PREDICT)
        return out

    @torch.no_grad()
    def run(self, data: Iterable, step_fn: Callable, collect: Callable[[object, object], None], kind: Kind) -> int:
        """``collect(batch, step_fn(batch))`` for each batch; returns how many there were. ``model`` is in eval
        mode meanwhile, as are ``others``, and each module's own mode comes back afterwards, by its ``train(mode)``:
        a part frozen in eval (BatchNorm statistics) stays frozen. Inside ``fit`` so do the global random
        generators: a DataLoader's iterator draws a seed from torch's, a step may use dropout or Python's and
        numpy's, and training must draw what it would have drawn without this pass (outside it, each ``predict()``
        draws anew: Monte Carlo dropout). A failure is a ``StepError`` naming the batch."""
        if data is None:
            raise ConfigError(f"{kind.name} has no data: " + ("pass val_data=... to the Trainer" if kind is VALIDATION
                                                              else f"pass the batches, trainer.{kind.name}(loader)"))
        if (problem := samples_problem(kind.data, data)) is not None:  # (val_data's was said as the Trainer was made)
            raise ConfigError(problem)
        roots = [m for m in (self.model, *self.others) if m is not None]
        modes = [(m, m.training) for root in roots for m in root.modules()]
        if self.model is not None:
            place(self.model, self.device, self.precision)
        if self.dist is not None:
            self.dist.align(self.model)
        for root in roots:
            root.eval()
        # the global generators, and the data's own (one torch.Generator may order both train_data and val_data)
        rng = {**epoch_start(data), **rng_state()} if self.fitting else None
        # a step taking a gradient by backward() (an attack's input gradient) leaves the training's gradients as it
        # found them: the next update is the training's alone
        grads = [(p, p.grad, p.grad._version if p.grad is not None else 0) for root in roots for p in root.parameters()]
        done, given = 0, data
        data = seeded_workers(data)  # seed_everything(..., workers=True)
        try:
            for batch in self.dist.shard_val(data, kind is not PREDICT) if self.dist is not None else data:
                with autocast(self.precision, self.device):
                    out = step_fn(self.move(batch) if self.move is not None else batch)
                collect(batch, out)
                done += 1
            if not done and self.dist is None:  # (under torchrun a rank may have none of a small data set)
                raise ConfigError(_no_batches(kind, data))
        except Exception as err:
            if isinstance(err, SafeloopError):
                raise
            uneven = self.dist.uneven_val(err) if self.dist is not None else None
            said = (f"{kind.name} at step {self.step} failed on batch {done + 1} of {kind.data} (training is "
                    f"unchanged): {uneven + '. ' if uneven else ''}{type(err).__name__}: {err}")
            if uneven:  # said at once: the other rank aborted, and torchrun's SIGTERM ends this one outside fit()
                log.error(said)
            raise StepError(said, self.step) from err
        finally:
            # by train(mode), so that an override runs (loralib's Linear takes back out the weights its eval() merged);
            # parent first, as modules() lists them: a part left in eval mode under a training parent (a frozen
            # BatchNorm) is set back to eval after its parent's train(True) set it to training
            for module, training in modes:
                if module.training != training:
                    module.train(training)
            if rng is not None:
                set_rng_state(rng)
                set_generators(given, rng)
            for param, grad, _ in grads:
                param.grad = grad
        if any(grad is not None and grad._version != version for _, grad, version in grads):
            raise StepError(f"{kind.step} added to gradients that training had accumulated (a backward() in it), "
                            "which cannot be taken back: take its gradient with torch.autograd.grad(loss, inputs) "
                            "instead", self.step)
        return done


def counted(out: tuple, kind: Kind = VALIDATION) -> tuple:
    """``validation_step``'s (``kind.step``'s) ``(losses, n)``, checked: a tuple of two losses would pass for one
    loss counted by the other's value; so is a loss and a tensor (``return loss, correct``: a count of right answers,
    not of samples): the count is an int (``len(x)``, ``int(mask.sum())``)."""
    losses, n = out if len(out) == 2 else (None, None)
    if not isinstance(n, numbers.Integral):  # an int, or numpy's
        raise TypeError(f"{kind.step} returned a tuple of {', '.join(type(v).__name__ for v in out)}: a tuple "
                        "is (losses, number of samples), the number an int (len(x), int(mask.sum())); several "
                        "losses or metrics go in a dict")
    return losses, n


def samples(batch, kind: Kind = VALIDATION) -> int:
    """The number of samples in ``batch``: the leading size of its first tensor (of any nesting of lists,
    tuples, dicts, dataclasses). Tensors of other leading sizes beside it get a warning: the count may be
    wrong, and only ``validation_step`` (``kind.step``) can say."""
    sizes = list(leading_sizes(batch))
    if not sizes:
        raise ValueError(f"the batch holds no tensor to count its samples by (each batch's losses count as many "
                         "times as it has samples: the leading size of its first tensor); return (losses, number "
                         f"of samples) from {kind.step}")
    if len(set(sizes)) > 1:
        warnings.warn(f"a {kind.data} batch holds tensors of different leading sizes: its losses count as many times "
                      "as the first tensor's leading size; if that is not its number of samples, return (losses, "
                      f"number of samples) from {kind.step}", ConfigWarning, stacklevel=user_stacklevel())
    return sizes[0]


def leading_sizes(batch) -> Iterator[int]:
    """The leading size of each tensor of ``batch`` but scalars, in order, through lists, tuples, dicts and
    dataclasses. Only read: a frozen dataclass cannot be rebuilt (as apply_to_collection does); ``size(0)``, as
    a nested tensor (sequences of different lengths) has no ``shape`` but has a number of sequences."""
    if isinstance(batch, torch.Tensor):
        if batch.dim():
            yield batch.size(0)
    elif isinstance(batch, Mapping):
        for value in batch.values():
            yield from leading_sizes(value)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            yield from leading_sizes(value)
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        for field in dataclasses.fields(batch):
            yield from leading_sizes(getattr(batch, field.name))


def summed(totals: dict[str, list[float]], batches: int, dist: Distributed,
           kind: Kind = VALIDATION) -> dict[str, list[float]]:
    """Every rank's ``totals`` added up, in one all-reduce: the same on every rank."""
    if not batches:  # its all-reduce would not match the others' (it knows no loss names)
        raise SafeloopError(f"{kind.data} gave rank {dist.rank} of {dist.world} no batch for {kind.name}: each rank "
                            f"runs {kind.step} over its own share, so give {kind.data} at least one batch per rank")
    names = sorted(totals)  # the same order on every rank
    every = dist.gather(names, "agree with the other ranks on the names of the validation metrics")
    if any(theirs != names for theirs in every):
        raise SafeloopError(f"{kind.step} reported other metrics on other ranks ("
                            + "; ".join(f"rank {i}: {', '.join(n) or 'none'}" for i, n in enumerate(every))
                            + "): their sums are added up by name, so every rank must report the same names: log "
                            "each metric from every batch (one only some batches have, such as a per-class error, "
                            "can be summed yourself and set in on_validation_end(metrics))")
    flat = dist.sum(torch.tensor([totals[name] for name in names], dtype=torch.float64))
    return dict(zip(names, flat.tolist()))


def _no_batches(kind: Kind, data: Iterable) -> str:
    if iter(data) is data:  # a generator an earlier pass used up (the validation before training)
        return (f"{kind.data} is a {type(data).__name__}, an iterator that one pass uses up: this pass got no batches. "
                "Pass something that can be iterated again (a DataLoader, a list, or an object whose __iter__ returns "
                "a new generator each time)")
    return f"{kind.data} yielded no batches: check the dataset and batch size" + \
        (", or pass no val_data" if kind is VALIDATION else "")
