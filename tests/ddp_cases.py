"""Training cases run both under ``torchrun`` (2 ranks, gloo) and in one process, for test_distributed.

``torchrun --nproc-per-node=2 tests/ddp_cases.py OUT_DIR CASE...`` runs each case on its rank's
shard and saves every rank's parameters and first-step gradients to ``OUT_DIR/CASE_rankR.pt``;
``result(case, world=1)`` runs the same case in one process over the same global batches.
``resume-CASE`` stops halfway (a checkpoint in ``OUT_DIR/resume-CASE``) and resumes in a new
Trainer; ``from-one-process-CASE`` resumes from ``OUT_DIR/one-process-CASE``, written by
``halfway(CASE, 1, ...)`` before the launch. ``lone_save`` (the last case) has rank 1 alone call
``state_dict()`` in manual mode, which gathers every rank's gradients, and keeps the error it gets.
"""
from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import EarlyStopping, StepError, Trainer
from safeloop.distributed import DistributedError
from safeloop.models import MLP

GLOBAL_BATCH = 16
STEPS = 4
VAL_SAMPLES = 37  # odd: on 2 ranks, shares of 19 and 18 samples in batches of 4, the last smaller


def dataset(n: int = GLOBAL_BATCH * STEPS * 2, seed: int = 0) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    return TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))


def val_dataset() -> TensorDataset:
    return dataset(VAL_SAMPLES, seed=1)


class Recording(Trainer):
    """Keeps the gradients each optimizer steps with in the first step (after the all-reduce), and
    whether the step ran through DistributedDataParallel."""

    def on_before_optimizer_step(self, name, optimizer):
        self.through_ddp = self.dist is not None and self.dist.ddp is not None
        if self.state.step == 0:
            self.first_grads = getattr(self, "first_grads", {})
            for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
                self.first_grads[f"{name}.{i}"] = None if p.grad is None else p.grad.clone()


class Validating(Recording):
    """Keeps, for each validation, the step it follows and the first input of every sample it validated."""

    def validation_step(self, batch):
        self.validated = getattr(self, "validated", [])
        if not self.validated or self.validated[-1][0] != self.state.step:
            self.validated.append((self.state.step, []))
        self.validated[-1][1].extend(batch[0][:, 0].tolist())
        return super().validation_step(batch)


class PassEnd(Validating):
    """A run of one whole pass: an epoch scheduler (Lightning's default interval), ``self.log`` in
    ``validation_step``, and what ``on_epoch_end`` and ``on_step_end`` see (the update's gradients)."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)}

    def validation_step(self, batch):
        x, y = batch
        self.log("val_abs", (self.model(x) - y).abs().mean())
        return super().validation_step(batch)

    def on_step_end(self, losses):
        grads = [None if p.grad is None else p.grad.clone() for p in self.model.parameters()]
        self.step_end_grads = getattr(self, "step_end_grads", []) + [(self.state.step, grads)]

    def on_epoch_end(self):
        self.ends = getattr(self, "ends", []) + [(self.state.step, next(iter(self.optimizers.values())).param_groups[0]["lr"])]


class SchedulerTwice(Recording):
    """Steps its per-update scheduler itself too, at step 2's end: the Trainer's next update refuses."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        self.scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": self.scheduler, "interval": "step"}}

    def on_step_end(self, losses):
        if self.state.step == 2:
            self.scheduler.step()


class Outside(Recording):
    """A head kept on the Trainer, outside ``model``, trained by the model's optimizer: each rank makes it with other
    values, and rank zero's reach every rank as the model's do; checkpoints hold it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.head = nn.Linear(1, 1)
        with torch.no_grad():
            self.head.weight.fill_(1.0 + (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0))

    def configure_optimizers(self):
        return torch.optim.SGD([*self.model.parameters(), *self.head.parameters()], lr=0.05, momentum=0.9)

    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.head(self.model(x)), y)


class TwoLosses(Recording):
    """Two losses through one graph: the Trainer retains it for the first backward."""

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        return {"fit": F.mse_loss(out, y), "small": 0.1 * out.pow(2).mean()}


class FailsOnRank1(Recording):
    """Rank 1 alone returns, at step 3, a loss whose graph was built before training."""

    def training_step(self, batch):
        if self.state.step == 2 and torch.distributed.get_rank() == 1:
            return self.stale
        return super().training_step(batch)


class NanOnRank1(Recording):
    """Step 2's loss is NaN on rank 1 only (on every sample in one process): every rank skips step 2."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        dist = torch.distributed
        if self.state.step == 1 and (not dist.is_initialized() or dist.get_rank() == 1):
            return loss * float("nan")
        return loss


class UnevenChecks(Recording):
    """Rank 1's checked steps take 1 ms longer: on its own, its guard would check less often."""

    def on_fit_start(self):
        self.checked = []

    def training_step(self, batch):
        if self.guard.checking and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            time.sleep(1e-3)
        return super().training_step(batch)

    def on_step_end(self, losses):
        if self.guard.checking:
            self.checked.append(self.state.step)


class WithSpare(nn.Module):
    """An MLP and a layer no step uses."""

    def __init__(self):
        super().__init__()
        self.net = MLP(8, 32, 1, 3)
        self.spare = nn.Linear(8, 1)

    def forward(self, x):
        return self.net(x)


class ManualAccumulation(Recording):
    """Manual mode accumulating over steps: backward every step, an update every 3rd; the backwards before it
    leave each rank's own gradients (``sync=False``, DDP's ``no_sync()``), so the halfway checkpoint (step 2) falls
    between two updates with each rank's own gradients carried."""

    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y) / 3
        self.backward(loss, sync=self.state.step % 3 == 2)
        if self.state.step % 3 == 2:
            self.step()
        return loss

    def on_before_optimizer_step(self, name, optimizer):
        if self.state.step == 2:  # the first update: record what it steps with
            self.state.step, recorded = 0, self.state.step
            super().on_before_optimizer_step(name, optimizer)
            self.state.step = recorded


class GanLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = MLP(4, 16, 8, 2)
        self.d = MLP(8, 16, 1, 2)


class Gan(Recording):
    """Two optimizers, sub-network calls (``self.model.g``) and a loss per optimizer."""

    def configure_optimizers(self):
        return {"d": torch.optim.Adam(self.model.d.parameters(), lr=1e-2),
                "g": torch.optim.Adam(self.model.g.parameters(), lr=1e-2)}

    def training_step(self, batch):
        real, _ = batch
        z = torch.tanh(2 * real[:, :4])  # noise made from the sample, so it does not depend on the shard
        fake = self.model.g(z)
        d_loss = F.softplus(self.model.d(fake.detach())).mean() + F.softplus(-self.model.d(real)).mean()
        g_loss = F.softplus(-self.model.d(fake)).mean()
        return {"d": d_loss, "g": g_loss}


class ManualGan(Gan):
    automatic = False

    def training_step(self, batch):
        real, _ = batch
        z = torch.tanh(2 * real[:, :4])  # noise made from the sample, so it does not depend on the shard
        fake = self.model.g(z)
        d_loss = F.softplus(self.model.d(fake.detach())).mean() + F.softplus(-self.model.d(real)).mean()
        self.backward(d_loss, "d")
        self.step("d")
        g_loss = F.softplus(-self.model.d(self.model.g(z))).mean()
        self.backward(g_loss, "g")
        self.step("g")
        return {"d": d_loss.detach(), "g": g_loss.detach()}


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimization: the gradient at w moves w uphill by rho (first step); the
    gradient there updates the original w (second step). ``step`` needs the closure that computes it."""

    def __init__(self, params, rho=0.05, lr=0.1):
        super().__init__(params, dict(rho=rho, lr=lr))

    @torch.no_grad()
    def first_step(self):
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"] if p.grad is not None]).norm()
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    e = p.grad * (g["rho"] / (norm + 1e-12))
                    p.add_(e)
                    self.state[p]["e"] = e

    @torch.no_grad()
    def second_step(self):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.sub_(self.state[p]["e"]).sub_(g["lr"] * p.grad)

    def step(self, closure):
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


class ManualSAM(Recording):
    """The two-phase update through the Trainer: the gradient at w, then SAM's step with the closure."""

    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss)

        def perturbed():
            again = F.mse_loss(self.model(x), y)
            self.backward(again)
            return again

        self.step(closure=perturbed)
        return loss


OPTIMIZERS = {"sam": partial(SAM, lr=1e-2), "lbfgs": partial(torch.optim.LBFGS, lr=0.5, max_iter=3)}


def build(case: str, world: int, **settings) -> Trainer:
    torch.manual_seed(0)
    accum = 2 if case in ("accum", "accum_tail") else 1
    data = dataset()
    if case == "accum_tail":  # 5 micro-batches a pass: its steps take 2, 2 and the 1 left, over two passes
        data = TensorDataset(*data[:GLOBAL_BATCH // 2 * 5])
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // world // accum, shuffle=False)
    common = dict(train_data=loader, max_steps=STEPS if case != "accum_tail" else 6, device="cpu", progress=False,
                  loggers=(), grad_accum=accum)
    if case == "nan_skip":
        common["on_nonfinite"] = "skip"
    if case == "unused":
        common["find_unused_parameters"] = True
    if case == "sam":
        common["grad_clip"] = 0.5
    if case in ("validation", "early_stop"):  # before training, at steps 2 and 4
        common.update(val_data=DataLoader(val_dataset(), batch_size=4), val_every=2)
    if case == "pass_end":  # one whole pass (8 steps of 16 samples), validated at steps 0, 4 and 8
        common.update(max_steps=8, val_data=DataLoader(val_dataset(), batch_size=4), val_every=4)
    if case == "early_stop":  # after the best at step 2, no validation improves by 10: step 4's stops the run
        common.update(max_steps=8, callbacks=[EarlyStopping(patience=1, min_delta=10.0)])
    if case == "schedule":  # long enough for the auto schedule to space its checks
        common.update(max_steps=120, guard={"check": "auto", "warmup": 2, "budget": 0.1})
    common.update(settings)
    if case in ("gan", "manual_gan"):
        cls = Gan if case == "gan" else ManualGan
        return cls(model=GanLike(), **common)
    cls = {"two_losses": TwoLosses, "fails_on_rank1": FailsOnRank1, "nan_skip": NanOnRank1,
           "schedule": UnevenChecks, "sam": ManualSAM, "manual_accum": ManualAccumulation,
           "validation": Validating, "early_stop": Validating, "pass_end": PassEnd,
           "scheduler_twice": SchedulerTwice, "outside": Outside}.get(case, Recording)
    model = WithSpare() if case.startswith("unused") else MLP(8, 32, 1, 3)
    optimizer = OPTIMIZERS.get(case, partial(torch.optim.Adam, lr=1e-2))(model.parameters())
    trainer = cls(model=model, optimizer=optimizer, **common)
    x, y = dataset()[:4]
    trainer.stale = F.mse_loss(model(x), y)
    return trainer


def result(case: str, world: int = 1, **settings) -> dict:
    trainer = build(case, world, **settings)
    try:
        trainer.fit()
        error = None
    except StepError as err:  # scheduler_twice's
        error = str(err)
    tested = predicted = None
    validated = [(step, list(seen)) for step, seen in getattr(trainer, "validated", [])] or None  # test runs it too
    if case == "validation":  # after training: test and predict over the validation data
        tested = trainer.test(DataLoader(val_dataset(), batch_size=4))
        predicted = torch.cat(trainer.predict(DataLoader(val_dataset(), batch_size=4)))
    trained = [*trainer.model.parameters(), *(trainer.head.parameters() if case == "outside" else ())]
    return {"params": [p.detach().clone() for p in trained], "step": trainer.state.step,
            "tested": tested, "predicted": predicted,
            "grads": getattr(trainer, "first_grads", None),  # none when resumed after step 1
            "skipped": trainer.state.skipped, "ddp": getattr(trainer, "through_ddp", None),
            "checked": getattr(trainer, "checked", None), "val_history": trainer.state.val_history,
            "validated": validated, "ends": getattr(trainer, "ends", None), "error": error,
            "step_end_grads": getattr(trainer, "step_end_grads", None)}


def halfway(case: str, world: int, directory: Path) -> None:
    """``case`` trained for half its steps, with a checkpoint at the end in ``directory``."""
    build(case, world, max_steps=STEPS // 2, checkpoint={"dir": str(directory)}).fit()


def run(out: str | Path, cases: list[str]) -> None:
    """Each case on this rank, its result in the directory ``out``: the cases of the module's docstring, in one
    group (``torchrun ... tests/ddp_cases.py OUT_DIR CASE...``, or a script of the test's)."""
    import torch.distributed as dist

    out = Path(out)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # one group for every case; each Trainer joins it
    rank = dist.get_rank()
    world = dist.get_world_size()
    for case in cases:
        if case.startswith("resume-"):
            halfway(case.removeprefix("resume-"), world, out / case)
            dist.barrier()  # rank zero has written the checkpoint before the others look for it
            done = result(case.removeprefix("resume-"), world, resume=str(out / case), checkpoint=False)
        elif case.startswith("from-one-process-"):
            name = case.removeprefix("from-one-process-")
            done = result(name, world, resume=str(out / f"one-process-{name}"), checkpoint=False)
        elif case == "lone_save":  # last: rank 1 alone saves, in manual mode, and rank 0 ends
            trainer = build("manual_gan", world)
            trainer.fit()
            done = None
            if rank == 1:
                try:
                    trainer.state_dict()
                except DistributedError as err:
                    done = str(err)
        else:
            done = result(case, world)
        torch.save(done, out / f"{case}_rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
