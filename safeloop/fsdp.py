"""Sharded training under ``torchrun`` with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each rank keeps 1/world of every parameter, of its gradient and of the optimizer's state (as
``DTensor`` shards); FSDP2 all-gathers a module's parameters just before its forward and backward,
and reduce-scatters (averages) the gradients during backward. Two ways in:

- a model the user sharded (``fully_shard`` on blocks, then on the root, as PyTorch's FSDP2
  tutorial does), given to the Trainer as is, with an optimizer made after the sharding;
- ``trainer.strategy=fsdp``: the Trainer shards the model (``Trainer.configure_sharding``, whose
  default is ``shard``: every parameter-holding submodule outside containers, then the root), after
  giving every rank rank zero's weights, and before it builds the optimizers.

What differs from data parallelism, and why:

- The autograd graph's leaves are FSDP2's gathered parameters, not the sharded ones the optimizers
  hold, so ``backward(inputs=...)`` with the optimizers' parameters reaches nothing. A loss routed
  to one optimizer is back-propagated plainly, and the gradients it leaves on other optimizers'
  parameters are dropped (``only``): the same gradients, at the cost of computing the dropped ones.
- Gradients are averaged inside backward, so the Trainer's own reducer and DDP are not used;
  with ``grad_accum`` the micro-batches before the last do not reduce (``set_requires_gradient_sync``).
- Checkpoints hold full tensors (``full``; every rank gathers, rank zero writes): they load in one
  process, and under any number of ranks (``shards``). That needs the full state in each process's
  CPU memory while saving. With ``checkpoint.sharded=true`` each rank writes its own shards instead,
  through ``torch.distributed.checkpoint`` (``save_shards``), next to the checkpoint file, which keeps
  every tensor's shape (``split``); loading reads them back, resharded for any number of ranks or for
  one process (``join``).
"""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


# FSDP2's modules are imported where a run uses them, not with safeloop: they take half a second and some six
# hundred modules to import, which every run without sharding would pay.
def available() -> bool:
    """Whether this torch has FSDP2's public ``fully_shard`` (torch 2.6 or later)."""
    try:
        return hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard")
    except ImportError:
        return False


def _is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor: none is while ``torch.distributed.tensor`` is not imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def is_sharded(module: nn.Module | None) -> bool:
    """Whether ``module`` holds FSDP2-sharded parameters (``DTensor``)."""
    return module is not None and any(_is_dtensor(p) for p in module.parameters())


def shard(model: nn.Module, precision: str = "32", device: torch.device | None = None) -> None:
    """The default wrapping: ``fully_shard`` each submodule that holds parameters, looking inside containers
    (``nn.Sequential``, ``nn.ModuleList``, ``nn.ModuleDict``) for their children, then the model itself, over
    every rank of the process group on ``device``'s type (default: FSDP2's, CUDA wherever there is one).
    Under ``precision=bf16-mixed`` FSDP2 computes in bf16 and reduces gradients in float32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),)) if device is not None else None
    for unit in units(model):
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def units(module: nn.Module) -> Iterator[nn.Module]:
    """The submodules ``shard`` wraps one by one."""
    for child in module.children():
        if isinstance(child, CONTAINERS):
            yield from units(child)
        elif next(child.parameters(), None) is not None:
            yield child


def roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules of ``model``: those that set gradient sync for everything below them."""
    from torch.distributed.fsdp import FSDPModule

    found, inner = [], set()
    for module in model.modules():
        if isinstance(module, FSDPModule) and id(module) not in inner:
            found.append(module)
            inner.update(id(m) for m in module.modules())
    return found


def sync_gradients(model: nn.Module, on: bool) -> None:
    """Whether the next backward reduces gradients (off: each rank accumulates its own, for grad_accum)."""
    for root in roots(model):
        root.set_requires_gradient_sync(on)


@contextmanager
def only(optimizers: Mapping[str, torch.optim.Optimizer], name: str) -> Iterator[None]:
    """A backward into optimizer ``name``'s parameters only: the gradients it leaves on any other optimizer's
    parameters are dropped, theirs from before put back (see the module docstring)."""
    mine = {id(p) for g in optimizers[name].param_groups for p in g["params"]}
    others = [p for n, opt in optimizers.items() if n != name for g in opt.param_groups for p in g["params"]
              if id(p) not in mine]
    kept = [p.grad for p in others]
    for p in others:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in zip(others, kept):
            p.grad = grad


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``tensor`` (a plain tensor as it is)."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def locals_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``local`` of each of ``tensors`` (the list itself while no DTensor can exist)."""
    module = sys.modules.get("torch.distributed.tensor")
    return tensors if module is None else [t.to_local() if isinstance(t, module.DTensor) else t for t in tensors]


def full(value: Any) -> Any:
    """``value`` with every ``DTensor`` in it (any nesting of dicts, lists, tuples) gathered into a plain tensor
    on the CPU: a collective call, which every rank makes."""
    if _is_dtensor(value):
        return value.full_tensor().cpu()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(full(v) for v in value)
    return value


def like(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A saved full tensor as ``target`` holds it: this rank's shard when ``target`` is a DTensor (every rank
    has read the same file, so no communication is needed)."""
    if _is_dtensor(target) and not _is_dtensor(value):
        from torch.distributed.tensor import distribute_tensor

        value = value.to(device=target.device, dtype=target.dtype)
        return distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None)
    return value


def shards(module: nn.Module, state: dict) -> dict:
    """A module's saved (full) state dict, with each entry sharded as ``module``'s own."""
    live = module.state_dict()
    return {k: like(v, live[k]) if k in live else v for k, v in state.items()}


def optimizer_shards(optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """An optimizer's saved (full) state dict, each per-parameter tensor the shape of its parameter
    sharded as the parameter is (a step count stays as it is)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    per_param = {
        i: {k: like(v, params[i]) if isinstance(v, torch.Tensor) and v.shape == params[i].shape else v
            for k, v in entry.items()} if i < len(params) else entry
        for i, entry in state["state"].items()}
    return {**state, "state": per_param}


# -- sharded checkpoints (checkpoint.sharded) ---------------------------------------------------------
SHARDS = "shards"  # the checkpoint file's entry naming its shard directory and the directory's checksums


def split(checkpoint: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """``checkpoint`` with each DTensor in it replaced by a meta tensor of its shape and dtype (what the checkpoint
    file keeps, so that it is checked against the model before anything is read), and those DTensors by their
    path in it ("modules/model/0.weight"): what ``save_shards`` writes."""
    shards: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if _is_dtensor(value):
            shards["/".join(path)] = value
            return torch.empty(value.shape, dtype=value.dtype, device="meta")
        if isinstance(value, dict):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*path, str(i))) for i, v in enumerate(value))
        return value

    return walk(checkpoint, ()), shards


def save_shards(shards: dict[str, torch.Tensor], directory: Path, name: str) -> dict:
    """Every rank writes its shards into ``directory / name`` (a collective call), which appears only once
    complete; returns, on rank zero, the entry the checkpoint file records: the directory's name and the
    SHA-256 of each of its files (``verify``)."""
    tmp = directory / f".{name}.tmp"
    zero = dist.get_rank() == 0
    if zero:
        shutil.rmtree(tmp, ignore_errors=True)  # a dead writer's; the others write only after the plan below
    import torch.distributed.checkpoint as dcp  # here: it takes a while to import, and few runs need it

    dcp.save(shards, checkpoint_id=tmp)  # returns once every rank's files and the metadata are written
    if not zero:
        return {}
    final = directory / name
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return {"dir": name, "sha256": {f.name: _sha256(f) for f in sorted(final.iterdir())}}


def verify(directory: Path, recorded: Mapping[str, str]) -> str | None:
    """What is wrong with a shard directory against the checksums its checkpoint file recorded (None: nothing)."""
    if not directory.is_dir():
        return f"its shard directory {directory} is missing"
    for name, digest in recorded.items():
        file = directory / name
        if not file.is_file():
            return f"its shard file {file} is missing"
        if _sha256(file) != digest:
            return f"its shard file {file} does not match the checksum saved with it"
    return None


def join(checkpoint: dict, directory: Path, live: Callable[[tuple[str, ...]], torch.Tensor | None]) -> dict:
    """``checkpoint`` (a file ``split`` made) with its meta tensors read from ``directory``: each as ``live(path)``,
    the tensor it will be loaded into, holds it (a DTensor: this rank's shard), else whole."""
    targets: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, torch.Tensor) and value.is_meta:
            into = live(path)
            sharded = _is_dtensor(into) and into.shape == value.shape
            targets["/".join(path)] = target = torch.zeros_like(into, dtype=value.dtype) if sharded else \
                torch.empty(value.shape, dtype=value.dtype)
            return target
        if isinstance(value, dict):
            return {k: walk(v, (*path, str(k))) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v, (*path, str(i))) for i, v in enumerate(value))
        return value

    import torch.distributed.checkpoint as dcp

    filled = walk(checkpoint, ())
    with warnings.catch_warnings():  # one process: "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, checkpoint_id=directory)
    return filled


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
