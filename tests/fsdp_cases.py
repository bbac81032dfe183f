"""Sharded (FSDP2) training cases run under ``torchrun`` (2 ranks, gloo) and in one process, for test_fsdp.

``torchrun --nproc-per-node=2 tests/fsdp_cases.py OUT_DIR CASE...`` runs each case and saves the full
parameters (gathered from the ranks' shards) to ``OUT_DIR/CASE_rankR.pt``; ``result(case)`` runs the same
case in one process (no sharding) over the same global batches. ``FSDP_CASES_DEVICE=cuda`` runs them on
the GPUs (NCCL). Besides ``CASES``:

- ``resume-CASE`` stops halfway (a checkpoint in ``OUT_DIR/resume-CASE``) and resumes in a new Trainer;
  ``from-one-process-CASE`` resumes from ``OUT_DIR/one-process-CASE``;
- ``killed`` (sharded checkpoints) loses rank zero to SIGKILL at step 3, and ``after-killed`` runs the
  same job again with ``resume=auto``;
- ``sharded-checkpoint`` is ``resume-fsdp`` with ``checkpoint.sharded`` (each rank writes its shards);
- ``reused`` returns, at every step, a loss built before training; ``undo`` fails after one optimizer
  stepped; ``prebuilt`` gives an optimizer built before the sharding;
  ``precision16`` asks for a GradScaler and ``unsharded`` shards nothing in its ``configure_sharding``;
  ``fails_on_rank1`` raises on rank 1 alone; ``hand`` is a hand-written loop under
  GraphGuard, ``hand_through_data`` the same clearing its gradients through ``.data``.
"""
from __future__ import annotations

import os
import signal
import sys
import warnings
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from safeloop import GraphGuard, fsdp
from safeloop.errors import ConfigError, GraphLifecycleWarning, GraphReuseError, StepError
from safeloop.models import MLP
from tests.ddp_cases import (GLOBAL_BATCH, STEPS, FailsOnRank1, Gan, GanLike, ManualGan, NanOnRank1, Recording,
                              TwoLosses, dataset)

# CASE_always: the guard checks every step (no false alarm from FSDP2's hooks, gathers and resharding)
# user, user_manual_gan: the model sharded by the user before the Trainer (strategy=ddp, the default)
CASES = ("fsdp", "user", "user_manual_gan", "two_losses", "accum", "clip", "gan", "manual_gan", "nan_skip", "bf16",
         "fsdp_always", "gan_always", "manual_gan_always")


def build(case: str, world: int, cls: type | None = None, **settings):
    if case.endswith("_always"):
        return build(case.removesuffix("_always"), world, cls, guard={"check": "always"}, **settings)
    torch.manual_seed(0)
    accum = 2 if case == "accum" else 1
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world // accum, shuffle=False)
    common = dict(train_data=loader, max_steps=STEPS, device=os.environ.get("FSDP_CASES_DEVICE", "cpu"),
                  progress=False, loggers=(), grad_accum=accum,
                  optimizer=partial(torch.optim.Adam, lr=1e-2), strategy="ddp" if case.startswith("user") else "fsdp")
    if case == "clip":
        common["grad_clip"] = 0.05  # small enough to clip every step
    if case == "nan_skip":
        common["on_nonfinite"] = "skip"
    if case == "bf16":
        common["precision"] = "bf16-mixed"
    common.update(settings)
    model = GanLike() if case.endswith("gan") else MLP(8, 32, 1, 3)
    if case.startswith("user") and world > 1:  # sharded by the user as PyTorch's FSDP2 tutorial does
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    if case.endswith("gan"):
        return (cls or (Gan if case == "gan" else ManualGan))(model=model, **common)
    cls = cls or {"two_losses": TwoLosses, "nan_skip": NanOnRank1}.get(case, Recording)
    return cls(model=model, **common)


def full_params(trainer) -> list[torch.Tensor]:
    """The full parameters: gathered from every rank's shards (a collective call)."""
    return [fsdp.full(p.detach()).clone() for p in trainer.model.parameters()]


def result(case: str, world: int = 1, **settings) -> dict:
    trainer = build(case, world, **settings)
    trainer.fit()
    return {"params": full_params(trainer), "step": trainer.state.step, "skipped": trainer.state.skipped,
            "sharded": fsdp.is_sharded(trainer.model)}


class Reused(Recording):
    """Seed 001 on sharded parameters: the loss of a forward made before training, returned at every step."""

    def training_step(self, batch):
        return self.stale

    def on_fit_start(self):
        x, y = dataset()[:4]
        self.stale = F.mse_loss(self.model(x), y)  # after the sharding: the forward runs through FSDP2


class FailsAfterD(ManualGan):
    """Step 3 fails after optimizer d stepped (in g's on_before_optimizer_step): the undo puts d back."""

    def on_step_start(self):
        if self.state.step == 2:  # every rank gathers: a collective call
            self.before = {"params": full_params(self), "d": fsdp.full(self.optimizers["d"].state_dict())}

    def on_before_optimizer_step(self, name, optimizer):
        if self.state.step == 2 and name == "g":
            raise RuntimeError("fails after d stepped")
        super().on_before_optimizer_step(name, optimizer)


def hand(world: int, through_data: bool = False) -> dict:
    """A hand-written FSDP2 loop (sharded as the Trainer shards) under GraphGuard, checking every step; its gradients
    cleared by ``opt.zero_grad()`` after each step, or (``through_data``) by ``p.grad.data.zero_()`` before each
    backward, as code older than ``set_to_none`` clears them."""
    torch.manual_seed(0)
    model = MLP(8, 32, 1, 3)
    sampler = DistributedSampler(dataset(), shuffle=False) if world > 1 else None
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world, shuffle=False, sampler=sampler)
    if world > 1:
        fsdp.shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = GraphGuard(model, optimizers=opt, check="always")
    for _, (x, y) in zip(range(STEPS), loader):
        with guard.step():
            for p in model.parameters() if through_data else ():
                if p.grad is not None:
                    p.grad.data.zero_()
            loss = F.mse_loss(model(x), y)
            guard.backward(loss)
            opt.step()
            if not through_data:
                opt.zero_grad()
    return {"params": [fsdp.full(p.detach()).clone() for p in model.parameters()], "sharded": fsdp.is_sharded(model)}


class KilledAt3(Recording):
    """Rank zero dies (SIGKILL) at the end of step 3, before its checkpoint: the last one is step 2's."""

    def on_step_end(self, losses):
        if self.state.step == 3 and torch.distributed.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.simplefilter("error", GraphLifecycleWarning)  # a warning of the guard's is a false alarm here
    out = Path(sys.argv[1])
    dist.init_process_group()  # gloo on the CPU; NCCL too where the Trainer trains on CUDA
    rank, world = dist.get_rank(), dist.get_world_size()
    for case in sys.argv[2:]:
        if case == "sharded-checkpoint":  # checkpoint.sharded: each rank writes its shards; resumed from them
            build("fsdp", world, max_steps=STEPS // 2,  # step 1's checkpoint and shards are pruned (keep=1)
                  checkpoint={"dir": str(out / case), "sharded": True, "every": 1, "keep": 1}).fit()
            done = result("fsdp", world, resume=str(out / case), checkpoint=False)
        elif case.startswith("resume-"):
            name = case.removeprefix("resume-")
            build(name, world, max_steps=STEPS // 2, checkpoint={"dir": str(out / case)}).fit()
            done = result(name, world, resume=str(out / case), checkpoint=False)
        elif case.startswith("from-one-process-"):
            name = case.removeprefix("from-one-process-")
            done = result(name, world, resume=str(out / f"one-process-{name}"), checkpoint=False)
        elif case == "fails_on_rank1":  # rank 1 alone raises at step 3; nothing catches it
            trainer = build("fsdp", world, cls=FailsOnRank1)
            x, y = dataset()[:4]
            trainer.stale = F.mse_loss(trainer.model(x), y)
            trainer.fit()
        elif case in ("hand", "hand_through_data"):
            done = hand(world, through_data=case == "hand_through_data")
        elif case == "killed":
            build("fsdp", world, cls=KilledAt3,
                  checkpoint={"dir": str(out / "killed"), "every": 1, "sharded": True}).fit()
        elif case == "after-killed":  # the same command again: resume=auto finds step 2's checkpoint
            done = result("fsdp", world, resume="auto", checkpoint={"dir": str(out / "killed"), "every": 1,
                                                                    "sharded": True})
        elif case == "undo":
            trainer = build("manual_gan", world, cls=FailsAfterD)
            try:
                trainer.fit()
            except StepError as err:
                after = {"params": full_params(trainer), "d": fsdp.full(trainer.optimizers["d"].state_dict())}
                done = {"error": str(err), "before": trainer.before, "after": after}
        elif case in ("precision16", "unsharded"):  # refused: a GradScaler; a configure_sharding that shards nothing
            cls = type("Unsharded", (Recording,), {"configure_sharding": lambda self, model: None})
            try:
                build("fsdp", world, cls=cls if case == "unsharded" else None,
                      precision="16" if case == "precision16" else "32").fit()
                done = "no error"
            except ConfigError as err:
                done = str(err)
        elif case == "prebuilt":  # an optimizer built before the Trainer sharded the model
            model = MLP(8, 32, 1, 3)
            try:
                Recording(model=model, train_data=[], optimizer=torch.optim.Adam(model.parameters()), max_steps=1,
                          strategy="fsdp", device="cpu", loggers=()).fit()
                done = "no error"
            except ConfigError as err:
                done = str(err)
        elif case == "reused":
            trainer = build("fsdp", world, cls=Reused)
            try:
                trainer.fit()
                done = "no error"
            except GraphReuseError as err:
                done = str(err)
        else:
            done = result(case, world)
        torch.save(done, out / f"{case}_rank{rank}.pt")
    dist.destroy_process_group()
    # DTensor's sharding caches keep the group and its gloo threads alive past destroy_process_group (torch 2.13);
    # one that frees a finished collective's tensors once interpreter shutdown began aborts the process ("terminate
    # called without an active exception", one run in about ten): the job ends here, without that shutdown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
