"""Data-parallel training under ``torchrun``: process group, sharding, gradient all-reduce.

``torchrun --nproc-per-node=N -m safeloop ...`` (or any script that builds a Trainer)
sets ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``; the Trainer then runs one replica per
process, on ``cuda:LOCAL_RANK`` (NCCL) or the CPU (gloo), each on its own shard of the
DataLoader, and averages gradients across processes before every optimizer step.

Two ways to all-reduce. The usual run (automatic mode, one optimizer over the model's
parameters, no accumulation, no per-backward hooks) runs ``training_step`` inside the
forward of a ``DistributedDataParallel`` wrapper (``_Step``), so DDP sees whatever
submodules the step calls and its C++ reducer all-reduces during backward; several
losses are then back-propagated as their sum (the same gradients, one backward), since a
second backward through one DDP graph leaves ranks with different gradients on torch 2.13
without an error. As with DDP itself, a step that leaves a parameter without gradient needs
``find_unused_parameters`` (a Trainer setting); without it the step stops with an error
before the optimizer step. ``self.model`` stays the module users wrote. Everything else (manual
mode, several optimizers, ``backward(inputs=...)`` routing, accumulation) goes through
safeloop's own reducer: the Trainer knows which backward is the last one into each
optimizer's parameters, so it all-reduces once per optimizer per step whatever the step
did, when that backward has ended (a parameter under several reentrant checkpoints gets its
gradient in parts: complete only then), and before ``on_after_backward``, which sees the averaged
gradients as after DDP's backward. The gradients are bucketed (DDP's bucket sizes), every
bucket's all-reduce started before the first is waited for.
Every collective happens at a point all ranks reach in the same order, so a rank that
fails simply exits: ``torchrun`` (or the closed connection) stops the others, and they
report which step was waiting.

Per-rank batch size is the DataLoader's ``batch_size``; the global batch is
``batch_size * WORLD_SIZE``. Losses shown and logged are rank zero's.
"""
from __future__ import annotations

import atexit
import importlib
import logging
import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning_utilities.core.rank_zero import rank_zero_only
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from . import fsdp, slurm
from .checkpoint import stateful
from .errors import ConfigError, SafeloopError, user_stacklevel

if TYPE_CHECKING:
    from .epochs import TrainData
    from .guard.guard import Guard

log = logging.getLogger("safeloop")
# how torch's backends word a collective that failed because a peer failed or left (a plain RuntimeError)
COLLECTIVE_FAILURES = ("/gloo/", "NCCL", "ProcessGroup", "Connection reset by peer", "Connection closed by peer")

# a task srun started, without torchrun: SLURM's rank and world as torchrun's variables
BY_SRUN = bool(slurm.adopt(os.environ))
# lightning_utilities' rank_zero_only needs the rank set before use; torchrun sets RANK.
rank_zero_only.rank = int(os.environ.get("RANK", 0))

FIRST_BUCKET_BYTES = 1024 * 1024  # DDP's defaults: a small first bucket starts communication early
BUCKET_BYTES = 25 * 1024 * 1024


class DistributedError(SafeloopError):
    """A collective failed: another rank stopped (its own error is in its output) or the group broke."""


if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Imported after the process group is made (the first optimizer step imports it), torch._dynamo
    # keeps the gloo backend alive past destroy_process_group (torch 2.13): its worker threads then
    # outlive the interpreter, and one releasing a finished all-reduce's tensors during interpreter
    # shutdown aborts the process ("terminate called without an active exception"). Imported with
    # safeloop, it comes first whether the Trainer makes the group or a script that imports safeloop does.
    importlib.import_module("torch._dynamo")


def from_env(device: torch.device) -> Distributed | None:
    """A ``Distributed`` when this process is one of several (torchrun's env or an initialized group)."""
    if dist.is_available() and dist.is_initialized():
        return Distributed(device) if dist.get_world_size() > 1 else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return Distributed(device)
    return None


def hydra_overrides() -> list[str]:
    """Command-line overrides for ranks other than zero: no Hydra output directory or log file of their own.

    Every rank runs ``@hydra.main``; left alone, each makes an output directory named from its
    own clock (two directories when ranks start across a second boundary) and appends to the
    same log file. Rank zero's run directory is sent to the others once the group is up.
    """
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=none", "hydra/hydra_logging=none"]


class _Step(torch.nn.Module):
    """What ``DistributedDataParallel`` wraps: the model, and the Trainer's ``training_step`` as its forward."""

    def __init__(self, model: torch.nn.Module, training_step):
        super().__init__()
        self.model = model
        self.step = training_step  # a bound method, not a submodule

    def forward(self, batch):
        return self.step(batch)


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    flat: torch.Tensor | None = None  # set while an all-reduce is in flight
    work: Any = None
    buffer: torch.Tensor | None = None  # kept: a fresh multi-MB tensor every step costs page faults


@dataclass
class _Group:
    """One optimizer's parameters, cut into buckets in reverse order (the order backward fills them)."""

    buckets: list[_Bucket]
    synced: bool = False  # the gradients are the all-ranks mean (until a backward adds to them)


def too_many_processes(local_rank: int, gpus: int, by_srun: bool) -> str:
    """A process whose local rank has no GPU of its own, in the words of what started it (torchrun, srun)."""
    devices, many = f"{gpus} CUDA device{'s' * (gpus != 1)}", gpus != 1
    if by_srun:
        return (f"srun started this task as SLURM_LOCALID={local_rank}, but this node has {devices}: each task "
                f"trains on the GPU of its local rank. Start at most {gpus} task{'s' * many} per node "
                f"(#SBATCH --ntasks-per-node={gpus}, and as many GPUs: --gpus-per-node={gpus}), or use device=cpu "
                "(gloo)")
    return (f"torchrun started this process as LOCAL_RANK={local_rank}, but this machine has {devices}: each "
            f"process trains on the GPU of its local rank. Launch at most {gpus} process{'es' * many} per machine "
            f"(--nproc-per-node={gpus}), or use device=cpu (gloo)")


def ready_twice(err: BaseException) -> str:
    """What to do, added to DDP's "Expected to mark a variable ready only once" (its advice, ``_set_static_graph()``,
    is on a wrapper the Trainer makes): a parameter's gradient accumulated twice in one backward."""
    if not (isinstance(err, RuntimeError) and "mark a variable ready only once" in str(err)):
        return ""
    return (" A parameter's gradient was accumulated more than once in one backward (a layer under several "
            "reentrant checkpoints, say), which DistributedDataParallel cannot follow by default: pass "
            "use_reentrant=False to torch.utils.checkpoint.checkpoint, or, if every step runs the same graph, set "
            "trainer.static_graph=true (DistributedDataParallel's static_graph)")


def collective_failed(err: BaseException) -> bool:
    """Whether ``err`` is a collective call's failure (DistributedDataParallel's all-reduce inside backward)."""
    return isinstance(err, dist.DistBackendError) or (
        isinstance(err, RuntimeError) and any(words in str(err) for words in COLLECTIVE_FAILURES))


class Distributed:
    """This process's place in the job: rank, world size, device, and the gradient all-reduce."""

    def __init__(self, device: torch.device, timeout_s: float | None = None):
        self.owned = not dist.is_initialized()
        if self.owned:
            self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            self.device = torch.device("cuda", self.local_rank) if device.type == "cuda" else torch.device("cpu")
            if self.device.type == "cuda":
                gpus = torch.cuda.device_count()
                if self.local_rank >= gpus:
                    raise ConfigError(too_many_processes(self.local_rank, gpus, BY_SRUN))
                torch.cuda.set_device(self.device)
            timeout = timedelta(seconds=timeout_s or float(os.environ.get("SAFELOOP_DIST_TIMEOUT", 1800)))
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", timeout=timeout,
                                    device_id=self.device if self.device.type == "cuda" else None)
            atexit.register(_end_group)  # kept between fit() calls of the Trainer, ended at exit
        else:
            self.local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
            self.device = torch.device("cuda", self.local_rank) if device.type == "cuda" else torch.device("cpu")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        rank_zero_only.rank = self.rank
        self.groups: dict[str, _Group] = {}
        self.ddp: DistributedDataParallel | None = None  # the usual run's forward (see the module docstring)
        self.sharded = False  # the model is sharded with FSDP2, which averages gradients itself (safeloop.fsdp)
        self.find_unused = False
        self.trained: list[tuple[str, torch.Tensor]] = []  # under DDP: the parameters every step must reach
        self.buffers: list[torch.Tensor] = []
        self.shared = False  # rank zero's weights copied to every rank (``share``)
        self.trainable: list[int] = []  # the parameters the reducer's buckets were made for, by id
        self.frozen: list[tuple[str, torch.Tensor]] = []  # the model's parameters that did not require grad at attach
        self.seed = 0  # rank zero's, at ``share``: every shard of the data shuffles with it
        self.step = 0  # the step running (set by the step itself), for error messages
        self._hooks: list = []
        self._quieted: int | None = None
        self._val: tuple | None = None  # (val_data, for metrics, this rank's share of it), made at its first use
        self.joined = False  # weights, run directory and data seed shared by the ranks (``join``)

    @property
    def is_zero(self) -> bool:
        return self.rank == 0

    def agree(self, value: int) -> int:
        """The largest ``value`` over all ranks (a stop signal's number any rank received, or 0; 1 where a rank
        found a non-finite value)."""
        flag = torch.tensor([value], dtype=torch.int64, device=self.device)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        except RuntimeError as err:
            raise self._lost(err, "agree with the other ranks on a stop signal, a non-finite value or the guard's next "
                             "check") from err
        return int(flag.item())

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over all ranks (a closure's loss, which the optimizer decides on)."""
        value = value.detach().clone()
        try:
            dist.all_reduce(value)
        except RuntimeError as err:
            raise self._lost(err, "average a closure's loss over the ranks") from err
        return value.div_(self.world)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` added up over all ranks, the same on every rank (validation's sums and sample counts)."""
        values = values.to(self.device)
        try:
            dist.all_reduce(values)
        except RuntimeError as err:
            raise self._lost(err, "add up the ranks' validation metrics") from err
        return values.cpu()

    def gather(self, value: Any, doing: str = "gather every rank's random state and gradients for a checkpoint "
               "(every rank calls Trainer.state_dict() together, as the Trainer's saves do: not under `if rank == 0`)"
               ) -> list:
        """Every rank's ``value`` (plain containers of CPU tensors), in rank order."""
        every: list = [None] * self.world
        try:
            dist.all_gather_object(every, value)
        except RuntimeError as err:
            raise self._lost(err, doing) from err
        return every

    # -- start of fit --------------------------------------------------------------------
    def attach(self, model, optimizers: dict, training_step, settings, automatic: bool,
               per_backward_hooks: bool) -> None:
        """At every fit, after ``share``: the DDP wrapper for the usual run, otherwise the gradient hooks
        of safeloop's reducer. ``per_backward_hooks``: the Trainer calls hooks around each backward,
        which DDP's single summed backward cannot honour."""
        if self.rank != 0 and self._quieted is None:  # progress and validation lines come from rank zero only
            self._quieted = log.level
            log.setLevel(logging.WARNING)
        self.sharded = fsdp.is_sharded(model)
        self.frozen = [] if self.sharded else [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        trainable = [id(p) for opt in optimizers.values() for g in opt.param_groups for p in g["params"]
                     if p.requires_grad]
        # a later fit() in a group the caller made: the reducer's hooks are in place, unless the parameters that
        # require grad changed since (a layer unfrozen for this fit): then they are made again; FSDP2 needs neither
        if (self.groups and trainable == self.trainable) or self.sharded:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.groups.clear()
        self.trainable = trainable
        if not dist.is_initialized():
            raise DistributedError(
                "the process group ended with an earlier fit() that failed (the other ranks stopped with it): "
                "start the job again; trainer.resume=auto continues from the last checkpoint" if self.owned else
                "the process group this Trainer joined has ended (destroy_process_group): fit() needs it; "
                "destroy it after the last fit()")
        if automatic and not per_backward_hooks and _ddp_can_run(model, optimizers, settings):
            self.find_unused = bool(settings.find_unused_parameters)
            self.ddp = DistributedDataParallel(_Step(model, training_step), device_ids=[self.device]
                                               if self.device.type == "cuda" else None,
                                               find_unused_parameters=self.find_unused,
                                               static_graph=bool(settings.static_graph))
            self.trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            return
        for name, opt in optimizers.items():
            # every parameter it holds, one another optimizer holds too (InfoGAN's info loss over G and D) included:
            # its gradient is averaged whichever optimizer's backward wrote it
            params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
            group = self.groups[name] = _Group(_buckets(params))
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(partial(self._added, group)))

    def join(self, model, optimizers: dict, run_dir: Path | None, data: TrainData, guard: Guard) -> Path | None:
        """At every fit, before ``attach``: the first time, rank zero's weights, run directory and data seed
        (``share``); every time, this rank's share of the training data, which may have been replaced since,
        and the guard's agreement with the other ranks on the steps it checks. Returns the run directory."""
        if not self.joined:
            run_dir = self.share(model, optimizers, run_dir, data.data)
            if run_dir is not None:
                guard.out_dir = run_dir / "graphs" / (f"rank{self.rank}" if self.rank else "")
            self.joined, data.shard = True, self.shard
        data.shard_again()
        guard.agree = self.agree
        return run_dir

    def shard_model(self, model, strategy: str, precision: str, wrap) -> None:
        """``strategy=fsdp``, once, before the optimizers are made: rank zero's weights on every rank, then
        ``wrap(model)`` shards them (``Trainer.configure_sharding``). A model already sharded is left as it is."""
        if strategy == "fsdp" and not fsdp.available():
            raise ConfigError(f"trainer.strategy=fsdp needs torch 2.6 or later (FSDP2); this is {torch.__version__}")
        if model is not None and strategy == "fsdp" and not fsdp.is_sharded(model):
            self._broadcast(list(model.parameters()) + list(model.buffers()))
            wrap(model)
            if not fsdp.is_sharded(model):
                raise ConfigError("trainer.strategy=fsdp: configure_sharding(model) left no parameter sharded; call "
                                  "torch.distributed.fsdp.fully_shard on the model's blocks and on the model itself")
        if fsdp.is_sharded(model) and precision == "16":
            raise ConfigError("precision=16 (a GradScaler) does not work with a model sharded by FSDP2: use "
                              "precision=bf16-mixed (FSDP2 computes in bf16 and reduces gradients in float32) or 32")

    def share(self, model, optimizers: dict, run_dir: Path | None, train_data) -> Path | None:
        """Once per Trainer, before ``attach``: rank zero's weights on every rank (the model's, and those its
        optimizers train outside it), and its data seed (see ``shard``); returns rank zero's run directory."""
        tensors = list(model.parameters()) + list(model.buffers()) if model is not None else []
        inside = {id(t) for t in tensors}
        self._broadcast(tensors + list({id(p): p for opt in optimizers.values() for g in opt.param_groups
                                        for p in g["params"] if id(p) not in inside}.values()))
        self.buffers = [b for b in model.buffers() if b.is_floating_point()] if model is not None else []
        self.shared = True
        seed = train_data.generator.initial_seed() if getattr(train_data, "generator", None) else torch.initial_seed()
        shared = [str(run_dir) if run_dir is not None else None, seed]
        dist.broadcast_object_list(shared, src=0)
        run_dir, self.seed = shared
        return Path(run_dir) if run_dir is not None else None

    def shard(self, train_data):
        """This rank's share of ``train_data`` (see ``shard``), shuffled with the seed ``share`` agreed on: no
        collective call, so data replaced later (between fits, in ``on_epoch_start``) is sharded the same way."""
        return shard(train_data, self.rank, self.world, self.seed)

    def align(self, model: torch.nn.Module | None) -> None:
        """Before an evaluation: rank zero's floating buffers on every rank (BatchNorm's running statistics, which
        each rank keeps between DDP's forwards: the metrics and checkpoints are then those of rank zero's model),
        and before the first fit its weights too, which nothing has copied yet."""
        if model is not None:
            buffers = [b for b in model.buffers() if b.is_floating_point()]
            self._broadcast(buffers if self.shared else list(model.parameters()) + buffers)

    def shard_val(self, val_data, means: bool = True):
        """This rank's share of ``val_data`` (see ``shard_in_order``; ``means``: for metrics, not ``predict``),
        made once per data object: a loader with persistent workers keeps them from one validation to the next."""
        if self._val is None or self._val[0] is not val_data or self._val[1] != means:
            self._val = val_data, means, shard_in_order(val_data, self.rank, self.world, means)
        return self._val[2]

    def uneven_val(self, err: BaseException) -> str | None:
        """Why a collective failed inside validation, when the ranks validate different numbers of batches (shares
        differ by a sample, see ``shard_in_order``): a collective of ``validation_step``'s own (an all_gather) then
        meets another rank's end of validation. None for another failure, or even shares."""
        shard = self._val[2] if self._val is not None else None
        order = getattr(getattr(shard, "sampler", None), "indices", None)  # _InOrder's range(rank, size, world)
        if not collective_failed(err) or not isinstance(order, range) or not getattr(shard, "batch_size", None):
            return None
        counts = [-(-len(range(r, order.stop, order.step)) // shard.batch_size) for r in range(order.step)]
        if len(set(counts)) == 1:
            return None
        more = counts.count(counts[0])  # shares differ by one sample at most, the larger first

        def ranks(first: int, last: int) -> str:
            return f"rank {first}" if first == last else f"ranks {first}-{last}"
        return (f"the ranks validate different numbers of batches ({ranks(0, more - 1)}: {counts[0]}, "
                f"{ranks(more, order.step - 1)}: {counts[-1]}): val_data's {order.stop} samples are split without "
                "repeating any, so a collective of validation_step's own (an all_gather, as a contrastive loss makes) "
                f"met another rank's end of validation. Give val_data a number of samples divisible by {order.step} "
                "(the ranks), so that every rank validates as many batches of the same sizes, or compute that loss "
                "without collectives in validation_step")

    def forward(self, batch):
        """The Trainer's forward under DDP. Only this object holds the wrapper, so that ``close`` ends it:
        a wrapper kept past the end of the group keeps the group's threads alive until interpreter
        shutdown, which they can abort ("terminate called without an active exception")."""
        return self.ddp(batch)

    @property
    def losses_summed(self) -> bool:
        """Several losses of a step are back-propagated as one sum (under DDP)."""
        return self.ddp is not None

    def _broadcast(self, tensors: list[torch.Tensor]) -> None:
        tensors = [t for t in tensors if fsdp.local(t) is t]  # a sharded tensor is one tensor over all ranks
        with torch.no_grad():
            for same in _by_dtype(tensors):
                flat = torch._utils._flatten_dense_tensors(same)
                dist.broadcast(flat, src=0)
                for t, value in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
                    t.copy_(value)

    # -- during the step -------------------------------------------------------------------
    def after_backward(self, plan: list, index: int, optimizers) -> None:
        """After backward ``plan[index]`` of the last micro-batch: average its optimizer's gradients if it was the
        last backward into them this step, so that ``on_after_backward`` sees (and edits) the averaged gradients,
        as after ``loss.backward()`` under DDP."""
        name = plan[index].optimizer or next(iter(optimizers))
        if not any((todo.optimizer or name) == name for todo in plan[index + 1:]):
            self.sync(name)

    @staticmethod
    def _added(group: _Group, _param) -> None:
        group.synced = False  # a backward added this rank's gradient: the group must be averaged again

    def _launch(self, bucket: _Bucket) -> None:
        # A parameter without a gradient sends zeros plus a 0 in the presence vector, so that it
        # stays None (skipped by the optimizer) only when no rank produced a gradient for it.
        odd = next((p.grad for p in bucket.params if p.grad is not None and (p.grad.is_sparse or p.grad.requires_grad)),
                   None)
        if odd is not None:
            raise DistributedError(
                f"step {self.step}: " + ("a sparse gradient (nn.Embedding(sparse=True))" if odd.is_sparse else
                                         "a gradient with a graph (backward(create_graph=True), for an optimizer that "
                                         "differentiates it: AdaHessian)") +
                " cannot go through safeloop's all-reduce (manual mode, several optimizers, grad_accum, backward "
                "hooks): not supported under torchrun. " + ("Use a dense embedding, or the usual run (automatic "
                                                            "mode, one optimizer, no accumulation), where "
                                                            "DistributedDataParallel averages it" if odd.is_sparse
                                                            else "It trains in one process"))
        parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in bucket.params]
        parts.append(torch.tensor([p.grad is not None for p in bucket.params], dtype=parts[0].dtype,
                                  device=parts[0].device))
        if bucket.buffer is None:
            bucket.buffer = torch.empty(sum(t.numel() for t in parts), dtype=parts[0].dtype, device=parts[0].device)
        bucket.flat = torch.cat(parts, out=bucket.buffer)
        try:
            bucket.work = dist.all_reduce(bucket.flat, async_op=True)
        except RuntimeError as err:
            raise self._lost(err) from err

    def check(self, step: int) -> None:
        """Automatic mode, before the updates (each optimizer's gradients were averaged after its last backward):
        no parameter unfrozen during the fit, and under DDP without find_unused_parameters none left unused."""
        self._check_unfrozen()
        if self.ddp is not None and not self.find_unused:
            self._check_used(step)

    def sync(self, name: str) -> None:
        """Average optimizer ``name``'s gradients over all ranks, once the backward that wrote them has ended (a
        reentrant checkpoint accumulates a parameter's gradient once per call: the sum is complete only then)."""
        self._check_unfrozen()
        group = self.groups.get(name)
        if group is None or group.synced:
            return
        for bucket in group.buckets:  # every bucket's all-reduce started at once, in the same order on every rank
            self._launch(bucket)
        try:
            for bucket in group.buckets:
                bucket.work.wait()
                flat = bucket.flat.div_(self.world)
                present = flat[-len(bucket.params):]
                offset = 0
                for p, seen in zip(bucket.params, present.tolist()):
                    value = flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                    if p.grad is not None:
                        p.grad.copy_(value)
                    elif seen:
                        p.grad = torch.empty_like(p).copy_(value)
                bucket.flat = bucket.work = None
            group.synced = True
            if self.buffers:  # like DDP: every rank continues with rank zero's running statistics
                self._broadcast(self.buffers)
        except RuntimeError as err:
            raise self._lost(err) from err

    def _check_unfrozen(self) -> None:
        """A layer unfrozen during the fit (Lightning's BaseFinetuning, in on_epoch_start) is in no all-reduce: each
        rank would update it with its own gradient, and the ranks' weights would part without a word."""
        unfrozen = [name for name, p in self.frozen if p.requires_grad and p.grad is not None]
        if unfrozen:
            raise DistributedError(
                f"step {self.step}: {len(unfrozen)} model parameter(s) were unfrozen after fit() began (the first: "
                f"{unfrozen[0]}; in on_epoch_start, say): the gradients averaged over the ranks are those of the "
                "parameters that required grad when fit() started, so each rank would update these with its own "
                "gradient and the ranks' weights would part. The step was abandoned before the optimizer step. Under "
                "torchrun unfreeze between fits: end this fit (trainer.request_stop, or max_steps) and call fit() "
                "again, which averages every parameter that requires grad then")

    def _check_used(self, step: int) -> None:
        """Without find_unused_parameters, DDP all-reduces a parameter's bucket only once every
        parameter in it has a gradient: one left without leaves the bucket unsynced."""
        unused = [name for name, p in self.trained if p.grad is None]
        frozen = [name for name, p in self.trained if not p.requires_grad] if unused else []
        if frozen:
            raise DistributedError(
                f"step {step}: {len(frozen)} model parameter(s) were frozen after fit() began (the first: {frozen[0]}; "
                "in on_fit_start, say): DistributedDataParallel was built over the parameters that required grad "
                "when fit() started, and waits for their gradients. The step was abandoned before the optimizer "
                "step. Under torchrun freeze them before calling fit()")
        if unused:
            raise DistributedError(
                f"step {step}: {len(unused)} model parameter(s) got no gradient on rank {self.rank} (the first: "
                f"{unused[0]}), so DistributedDataParallel cannot average this step's gradients; the step was "
                "abandoned before the optimizer step. If steps may leave parameters unused, set "
                "trainer.find_unused_parameters=true (one more small all-reduce per step); otherwise freeze "
                "them (requires_grad=False) or leave them out of the model")

    def reset(self) -> None:
        """A failed step: forget half-done buckets (their all-reduce is not waited for)."""
        for group in self.groups.values():
            group.synced = False
            for bucket in group.buckets:
                bucket.flat, bucket.work = None, None

    def _lost(self, err: Exception, what: str = "all-reduce gradients") -> DistributedError:
        return self.lost(err, self.step, what)

    def lost(self, err: Exception, step: int, what: str, undone: str | None = None) -> DistributedError:
        """``what``: the collective, in words. Every rank must make it at the same point; this one waited in
        vain, because another rank failed or went on without making it. ``undone``: what abandoning the step
        left as it was."""
        abandoned = f" The step was abandoned ({undone})." if undone is not None else ""
        return DistributedError(
            f"step {step}: rank {self.rank} of {self.world} could not {what} ({err}).{abandoned} Every rank makes "
            "this call at the same point, and another did not: it most likely failed, and its error is printed in "
            "its own output (torchrun prints the first failure's rank and traceback at the end); or it went on "
            "without making the call")

    # -- end of fit -------------------------------------------------------------------------
    def close(self, failed: bool = False) -> None:
        """At the end of fit. The DDP wrapper goes (a later fit() builds it again): kept, it would keep
        the group's threads alive past the caller's destroy_process_group (see ``forward``). In a group
        the caller made, the reducer's hooks stay for a later fit(). In one the Trainer made, they go
        too and the group stays until exit, unless the fit failed: then the group ends, and with it the
        other ranks' wait in their next all-reduce. A fit that did not fail ends together on every rank."""
        if self._quieted is not None:
            log.setLevel(self._quieted)
            self._quieted = None
        self.ddp = None
        if not failed:  # every rank returns once rank zero's last save and pruning are done: checkpointer.best agrees
            try:
                dist.barrier()
            except RuntimeError as err:
                raise self._lost(err, "wait for the other ranks at the end of fit()") from err
        if not self.owned:
            return
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self.groups.clear()
        if failed:
            _end_group()


def _end_group() -> None:
    """End the process group. Its gloo worker threads let go of a finished collective only after it completed,
    and one started in a backward holds the backward's Python context (torch 2.13), which takes the GIL to let go
    of; the group's destructor joins those threads while it holds the GIL. A group ended, or its last holder (a
    failed step's DistributedDataParallel) freed, right after such a collective would wait forever: the GIL is let
    go of for a moment first."""
    if dist.is_initialized():
        time.sleep(0.05)
        dist.destroy_process_group()


def _ddp_can_run(model, optimizers: dict, settings) -> bool:
    """The usual run (automatic mode): one optimizer over exactly the model's trainable parameters,
    no accumulation (it would need ``no_sync``) and no loss weights (losses are summed)."""
    if model is None or len(optimizers) != 1 or settings.grad_accum != 1 or settings.loss_weights:
        return False
    opt, = optimizers.values()
    trained = {id(p) for g in opt.param_groups for p in g["params"] if p.requires_grad}
    return trained == {id(p) for p in model.parameters() if p.requires_grad}


def _by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return list(out.values())


def _buckets(params: list[torch.Tensor]) -> list[_Bucket]:
    """Reverse order (gradients arrive last layer first), one dtype per bucket, DDP's size caps."""
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    size, cap = 0, FIRST_BUCKET_BYTES
    for p in reversed(params):
        if current and p.dtype != current[0].dtype:
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap:  # like DDP, a bucket closes once it reaches its cap
            buckets.append(_Bucket(current))
            current, size, cap = [], 0, BUCKET_BYTES
    if current:
        buckets.append(_Bucket(current))
    return buckets


def shard(data, rank: int, world: int, seed: int):
    """``data`` with a ``DistributedSampler``: each rank its own equal share, reshuffled every epoch.

    Ranks must see the same number of batches (every step all-reduces), which the sampler
    guarantees by padding. An iterable with a ``shard(rank, world)`` method splits itself
    (it must give every rank the same number of batches); anything else safeloop cannot
    rebuild is returned as is, with a warning.
    """
    if isinstance(data, DataLoader) and isinstance(data.sampler, DistributedSampler):
        return data
    return _split(data, rank, world, "train_data", lambda loader: DistributedSampler(
        loader.dataset, num_replicas=world, rank=rank, shuffle=type(loader.sampler).__name__ == "RandomSampler",
        seed=seed, drop_last=loader.drop_last))


def shard_in_order(data, rank: int, world: int, means: bool = True):
    """This rank's part of ``val_data``: samples ``rank``, ``rank + world``, ... in order.

    Nothing is padded: ``DistributedSampler`` repeats samples so that every rank gets as many, and
    a validation would count those twice. So shares differ by one sample, and ranks may validate
    different numbers of batches (validation communicates once, at its end). A loader's own
    ``DistributedSampler`` is replaced for the same reason. With fewer samples than ranks, every rank
    validates them all (``means``: its sums and counts are added up, the mean is the same), and for
    ``predict`` (not ``means``) the ranks past the last sample get none. A loader with ``drop_last`` leaves
    out the samples one process leaves out (those of its last incomplete batch), and no rank drops more.
    Anything else as ``shard`` does: a ``shard(rank, world)`` method, or the data as it is, with a warning;
    each rank then validates what it is given, and since validation adds up every rank's sums and counts,
    the metrics are still the mean over samples.
    """
    if means and isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset) and \
            len(data.dataset) < world:
        return data  # a share of nothing would leave a rank without a batch to add up

    def in_order(loader: DataLoader) -> _InOrder:
        size = len(loader.dataset)
        if loader.drop_last and loader.batch_size:
            size -= size % loader.batch_size
        return _InOrder(size, rank, world)
    return _split(data, rank, world, "val_data", in_order, replaces=("DistributedSampler",), drop_last=False)


# what every rank does with data it is given as it is, by the argument's name
_AS_GIVEN = {"train_data": "trains on the batches it is given, so shard them yourself and give every rank the same "
                           "number (or give it a shard(rank, world) method)",
             "val_data": "validates the batches it is given: all of them, unless you shard them yourself or give "
                         "it a shard(rank, world) method (the metrics are the mean over samples either way)"}


def _split(data, rank: int, world: int, name: str, sampler, replaces: tuple[str, ...] = (),
           drop_last: bool | None = None):
    """``data`` (the argument ``name``) split for ``rank``: by its own ``shard(rank, world)``, or a DataLoader
    rebuilt with ``sampler(data)`` in place of the sampler ``shuffle=...`` made (or one named in ``replaces``),
    and ``drop_last`` unless given. Anything else as it is, with a warning."""
    if not isinstance(data, DataLoader) and callable(getattr(data, "shard", None)):
        return data.shard(rank, world)
    if not isinstance(data, DataLoader):
        warnings.warn(f"{name} is a {type(data).__name__}, not a DataLoader: every rank {_AS_GIVEN[name]}",
                      stacklevel=user_stacklevel())
        return data
    # the samplers a loader makes itself from shuffle=..., torch's or a stateful loader's own versions
    # of them (torchdata's StatefulDataLoader), by name: any other was the user's choice
    custom = type(data.sampler).__name__ not in ("SequentialSampler", "RandomSampler", *replaces) or \
        (data.batch_sampler is not None and type(data.batch_sampler).__name__ != "BatchSampler")
    if isinstance(data.dataset, IterableDataset) or custom:
        warnings.warn(f"{name} uses an IterableDataset or a custom sampler that safeloop cannot shard: every "
                      "rank gets the same batches unless your dataset shards by torch.distributed.get_rank()",
                      stacklevel=user_stacklevel())
        return data
    # a loader that keeps its own position (torchdata's StatefulDataLoader) stays one, so that checkpoints
    # save where it stands; it takes DataLoader's arguments
    loader = type(data) if stateful(data) else DataLoader
    return loader(data.dataset, batch_size=data.batch_size, sampler=sampler(data), num_workers=data.num_workers,
                  collate_fn=data.collate_fn, pin_memory=data.pin_memory,
                  drop_last=data.drop_last if drop_last is None else drop_last,
                  timeout=data.timeout, worker_init_fn=data.worker_init_fn,
                  multiprocessing_context=data.multiprocessing_context, generator=data.generator,
                  prefetch_factor=data.prefetch_factor, persistent_workers=data.persistent_workers)


class _InOrder(Sampler):
    """Samples ``rank``, ``rank + world``, ... of ``size``: every sample on exactly one rank."""

    def __init__(self, size: int, rank: int, world: int):
        self.indices = range(rank, size, world)

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
