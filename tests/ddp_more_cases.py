"""More cases run under ``torchrun`` (2 ranks, gloo) and in one process, for test_distributed_more.

``torchrun --nproc-per-node=2 tests/ddp_more_cases.py OUT_DIR CASE...`` runs each case and saves what it
records to ``OUT_DIR/CASE_rankR.pt``; ``result(case, world=1)`` runs the same case in one process over the
same global batches.

- ``masked_nan``: a loss that is the mean over a mask, empty on rank 1's batch at step 2 only (a batch without
  positives): the loss is NaN there, its gradient finite (zeros). ``on_nonfinite=skip`` promises that every rank
  skips the same step.
- ``masked_manual_gan``: the same in tests/ddp_cases.py's manual-mode GAN, where a rank skipping alone would leave
  ``training_step`` while the other goes on into the next optimizer's all-reduce.
- ``fp16_nan``: ``precision="16"`` (a GradScaler on the CPU) with ``on_nonfinite=skip``, a NaN loss on rank 1
  only at step 2: the GradScaler's scale and the parameters must stay the same on every rank.
- ``NAME-straight`` / ``NAME-resumed`` (``RESUMED``): the same steps run straight, and stopped at a checkpoint then
  resumed in a new Trainer. ``rng_resume``: dropout, each rank seeded with its own seed before ``fit``
  (karpathy/nanoGPT train.py: ``torch.manual_seed(1337 + seed_offset)``, ``seed_offset = ddp_rank``);
  ``rng_same``: one seed for every rank; ``stateful``: precision=16, a schedule per update, EarlyStopping,
  ``checkpoint.monitor`` and dropout; ``shuffled``: a shuffled DataLoader, resumed in the second pass by a
  process seeded otherwise than the first (``shuffled_same_seed``: seeded as the first).
- ``val_drop_last``: ``val_data`` a DataLoader with ``drop_last=True`` (37 samples, batches of 4).
- ``bf16``: ``precision="bf16-mixed"`` under DDP, against one process over the same global batches.
- ``batchnorm`` / ``batchnorm_accum``: a model with BatchNorm, validated at the end, trained through
  DistributedDataParallel (the usual run) or safeloop's own reducer (``grad_accum=2``).
- ``best_k``: ``checkpoint.monitor`` with ``keep=1``; ``trainer.checkpointer.best`` read on every rank right after
  ``fit()``, rank zero's last save taking a second longer.
- ``handwritten``: the usual run (DDP) and safeloop's reducer (``grad_accum=2``), with and without ``grad_clip``,
  in float32 and under ``precision="16"`` (a GradScaler), against a hand-written DDP loop (pytorch/examples'
  ddp-tutorial-series, with PyTorch's AMP recipe), bit for bit.
- ``test_before_fit``: each rank makes its model after seeding with its own seed (nanoGPT), and ``test()`` runs
  before any ``fit()``; then ``predict()`` over one sample (fewer samples than ranks).
- ``unfreeze``: ``grad_accum=2`` (safeloop's own reducer), in the process group the script made; a backbone frozen
  (``requires_grad_(False)``) for a first ``fit()`` and unfrozen for a second, its optimizer holding it throughout.
- ``unfreeze_epoch``: the usual run (DistributedDataParallel); the backbone frozen before ``fit()`` and unfrozen
  in ``on_epoch_start`` of the second pass (Lightning's ``BaseFinetuning``). ``freeze_at_start``: the backbone
  frozen in ``on_fit_start`` instead, and never trained; a failure is recorded as its error.
  ``unfreeze_epoch_accum``: ``unfreeze_epoch`` with ``grad_accum=2`` (safeloop's own reducer).
- ``sparse_accum``: ``nn.Embedding(sparse=True)`` with ``grad_accum=2`` (safeloop's own reducer); a failure is
  recorded as its error.
- ``create_graph``: manual mode, ``self.backward(loss, create_graph=True)`` then ``self.step()``; a failure is
  recorded as its error.
- ``class_metrics`` (run last): ``validation_step`` logs a metric per class its batch holds; each rank's share holds
  one class, so the ranks log different names.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from safeloop import EarlyStopping, SafeloopError, Trainer
from safeloop.models import MLP
from tests.ddp_cases import GLOBAL_BATCH, GanLike, ManualGan, dataset, val_dataset

STEPS = 4


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def world() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


class Recording(Trainer):
    """Keeps the GradScaler's scale after every step."""

    def on_step_end(self, losses):
        if self.scaler is not None:
            self.scales = getattr(self, "scales", []) + [float(self.scaler.get_scale())]


class MaskedLoss(Recording):
    """The loss over the samples whose target is positive, as a detection loss over a batch's positives. At step 2
    rank 1's batch (every sample in one process) counts none: the mean over no sample is NaN, and its gradient is
    zeros, finite; the all-reduce carries no NaN to rank 0."""

    def training_step(self, batch):
        x, y = batch
        out = self.model(x)
        positive = y[:, 0] > -2.0  # every sample: sin() > -2
        if self.state.step == 1 and (world() == 1 or rank() == 1):
            positive = torch.zeros_like(positive)
        return F.mse_loss(out[positive], y[positive])


class MaskedManualGan(ManualGan):
    """tests/ddp_cases.py's manual-mode GAN whose discriminator loss on real samples is a mean over a mask, empty on
    rank 1's batch at step 2 only (every sample in one process): NaN there, with zero gradients."""

    def training_step(self, batch):
        real, y = batch
        if self.state.step == 1 and (world() == 1 or rank() == 1):
            real = real[:0]  # no sample kept: the mean over none is NaN, its gradient zeros
        z = torch.tanh(2 * batch[0][:, :4])
        fake = self.model.g(z)
        d_loss = F.softplus(self.model.d(fake.detach())).mean() + F.softplus(-self.model.d(real)).mean()
        self.backward(d_loss, "d")
        self.step("d")
        g_loss = F.softplus(-self.model.d(self.model.g(z))).mean()
        self.backward(g_loss, "g")
        self.step("g")
        return {"d": d_loss.detach(), "g": g_loss.detach()}


class NanOnRank1(Recording):
    """Step 2's loss is NaN on rank 1 only (on every sample in one process)."""

    def training_step(self, batch):
        loss = super().training_step(batch)
        if self.state.step == 1 and (world() == 1 or rank() == 1):
            return loss * float("nan")
        return loss


class ClassMetrics(Recording):
    """Logs in validation_step the mean error of each class that the batch holds (as a per-class accuracy
    would): rank 0's share here holds only class "a", rank 1's only class "b" (one process: both)."""

    def validation_step(self, batch):
        x, y = batch
        which = "a" if (world() == 1 and x[0, 0] > 0) or rank() == 0 else "b"
        self.log(f"val_err_{which}", (self.model(x) - y).abs().mean())
        return F.mse_loss(self.model(x), y)


class CreateGraph(Recording):
    """Manual mode back-propagating with ``create_graph=True``, the way docs/trainer.md gives for AdaHessian or a
    gradient penalty (the gradients keep their graph for a second backward), then one update."""

    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x), y)
        self.backward(loss, create_graph=True)
        self.step()
        return loss.detach()


class UnfreezeAtEpoch(Recording):
    """Lightning's BaseFinetuning done by hand: the backbone, frozen before ``fit()``, trained from the second pass on
    (its optimizer holds it throughout)."""

    def on_epoch_start(self):
        if self.state.epoch == 1:
            self.model[0].requires_grad_(True)


class FreezeAtStart(Recording):
    """The backbone frozen in ``on_fit_start``, its optimizer holding it (docs/trainer.md: "done in on_fit_start,
    the optimizer already holds the frozen layers"): a linear probe."""

    def on_fit_start(self):
        self.model[0].requires_grad_(False)


class Scheduled(Recording):
    """A learning rate stepped after every update."""

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class SlowSave(Recording):
    """Rank zero's last save takes a moment longer (a large checkpoint, a slow file system)."""

    def on_save_checkpoint(self, checkpoint):
        if rank() == 0 and self.state.step == self.max_steps:
            time.sleep(1.0)


class Bag(nn.Module):
    """A bag of embeddings with sparse gradients (``nn.Embedding(sparse=True)``), then a linear layer."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8, sparse=True)
        self.out = nn.Linear(8, 1)

    def forward(self, i):
        return self.out(self.emb(i).mean(1))


def bags() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 50, (128, 5), generator=gen), torch.randn(128, 1, generator=gen))


def batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))


def dropout_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(32, 1))


def build(case: str, world_size: int, **settings) -> Trainer:
    torch.manual_seed(0)
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size, shuffle=case == "shuffled")
    common = dict(train_data=loader, max_steps=STEPS, device="cpu", progress=False, loggers=())
    model = MLP(8, 32, 1, 3)
    cls = Recording
    if case == "masked_nan":
        cls, common["on_nonfinite"] = MaskedLoss, "skip"
    if case == "masked_manual_gan":
        return MaskedManualGan(model=GanLike(), on_nonfinite="skip", **common)
    if case == "fp16_nan":
        cls = NanOnRank1
        common.update(on_nonfinite="skip", precision="16")
    if case == "bf16":
        common["precision"] = "bf16-mixed"
    if case in ("rng_resume", "shuffled"):
        model = dropout_model()
    if case in ("batchnorm", "batchnorm_accum"):  # through DistributedDataParallel, or safeloop's reducer
        model = batchnorm_model()
        common.update(val_data=DataLoader(val_dataset(), batch_size=4))
        if case == "batchnorm_accum":
            common["grad_accum"] = 2
            loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size // 2, shuffle=False)
            common["train_data"] = loader
    if case == "best_k":  # validated at steps 0, 2 and 4, each improving; the best kept, and the newest
        cls = SlowSave
        common.update(val_data=DataLoader(val_dataset(), batch_size=4), val_every=2,
                      checkpoint={"dir": settings.pop("directory"), "monitor": "val_loss", "keep": 1})
    if case == "unfreeze":  # grad_accum=2: through safeloop's own reducer; its optimizer holds every parameter
        model = nn.Sequential(MLP(8, 32, 16, 2), nn.ReLU(), nn.Linear(16, 1))
        common.update(grad_accum=2, train_data=DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size // 2))
    if case in ("unfreeze_epoch", "unfreeze_epoch_accum", "freeze_at_start"):  # 4 steps a pass, two passes
        cls = FreezeAtStart if case == "freeze_at_start" else UnfreezeAtEpoch
        model = nn.Sequential(MLP(8, 32, 16, 2), nn.ReLU(), nn.Linear(16, 1))
        model[0].requires_grad_(case == "freeze_at_start")
        accum = 2 if case == "unfreeze_epoch_accum" else 1  # 2: safeloop's reducer; 1: DistributedDataParallel
        common.update(max_steps=8, grad_accum=accum, train_data=DataLoader(
            TensorDataset(*dataset()[:GLOBAL_BATCH * 4]), batch_size=GLOBAL_BATCH // world_size // accum))
    if case == "sparse_accum":  # grad_accum=2: through safeloop's own reducer
        model = Bag()
        common.update(grad_accum=2, train_data=DataLoader(bags(), batch_size=GLOBAL_BATCH // world_size // 2))
        return cls(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **common)
    if case == "create_graph":
        cls = CreateGraph
    if case == "class_metrics":
        cls = ClassMetrics
        common.update(val_data=DataLoader(val_dataset(), batch_size=4), max_steps=1)
    if case == "stateful":  # what a checkpoint holds beyond weights: GradScaler, schedule, EarlyStopping, best-k
        cls, model = Scheduled, dropout_model()
        common.update(precision="16", val_data=DataLoader(val_dataset(), batch_size=4), val_every=1,
                      callbacks=[EarlyStopping(patience=3)])
        if "checkpoint" in settings and settings["checkpoint"]:
            settings["checkpoint"] = {**settings["checkpoint"], "monitor": "val_loss", "keep": 2}
    if case == "val_drop_last":
        common.update(val_data=DataLoader(val_dataset(), batch_size=4, drop_last=True), max_steps=1)
    common.update(settings)
    lr = 2e-3 if case == "best_k" else 1e-2  # best_k: each validation improves on the last
    return cls(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr), **common)


def record(trainer: Trainer, **more) -> dict:
    return {"params": [p.detach().clone() for p in trainer.model.parameters()], "step": trainer.state.step,
            "buffers": [b.detach().clone() for b in trainer.model.buffers()],
            "skipped": trainer.state.skipped, "scales": getattr(trainer, "scales", None),
            "val_history": trainer.state.val_history, "error": None, **more}


def by_hand(world_size: int, accum: int, clip: float | None, precision: str, steps: int = 12) -> list[torch.Tensor]:
    """pytorch/examples distributed/ddp-tutorial-series/multigpu_torchrun.py's loop: DDP over the model, a shuffling
    DistributedSampler (``set_epoch`` at each pass, as the examples' imagenet does), ``zero_grad``, backward, step;
    accumulation under ``no_sync`` for all but the last micro-batch, and ``clip_grad_norm_`` before the step. Under
    ``precision="16"`` PyTorch's AMP recipe: autocast to float16, ``GradScaler`` scale, ``unscale_`` before clipping,
    ``step``, ``update``."""
    from contextlib import nullcontext

    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = MLP(8, 32, 1, 3)
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu") if precision == "16" else None
    sampler = torch.utils.data.DistributedSampler(dataset(), shuffle=True, seed=0)
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size // accum, sampler=sampler)
    step, epoch = 0, 0
    while step < steps:
        sampler.set_epoch(epoch)
        batches = iter(loader)
        for _ in range(len(loader) // accum):
            optimizer.zero_grad(set_to_none=True)
            for k in range(accum):
                x, y = next(batches)
                with ddp.no_sync() if k < accum - 1 else nullcontext():
                    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler is not None):
                        loss = F.mse_loss(ddp(x), y) / accum
                    (scaler.scale(loss) if scaler is not None else loss).backward()
            if scaler is not None:
                scaler.unscale_(optimizer)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            step += 1
            if step == steps:
                break
        epoch += 1
    return [p.detach().clone() for p in model.parameters()]


HAND = ((1, None, "32"), (2, None, "32"), (1, 0.05, "32"), (2, 0.05, "32"), (1, 0.05, "16"), (2, None, "16"))


def against_hand(world_size: int) -> dict:
    """For each (grad_accum, grad_clip, precision) of ``HAND``: whether the Trainer's weights after 12 steps (a pass
    and a half, shuffled) equal the hand-written loop's, bit for bit."""
    equal = {}
    for accum, clip, precision in HAND:
        torch.manual_seed(0)  # the DistributedSampler's seed: torch.initial_seed(), 0 as the loop's
        model = MLP(8, 32, 1, 3)
        trainer = Trainer(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), device="cpu",
                          train_data=DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size // accum,
                                                shuffle=True),
                          grad_accum=accum, grad_clip=clip, precision=precision, max_steps=12, progress=False,
                          loggers=())
        trainer.fit()
        ours = [p.detach().clone() for p in model.parameters()]
        hand = by_hand(world_size, accum, clip, precision)
        equal[(accum, clip, precision)] = all(torch.equal(a, b) for a, b in zip(ours, hand, strict=True))
    return equal


# the resumed cases: what build() makes, the seed each rank sets before the first fit(), the seed set before the
# resumed one (which the checkpoint's random state replaces), the steps in all, and the step the first fit stops at
RESUMED = {"rng_resume": ("rng_resume", lambda: 1337 + rank(), 12345, STEPS, STEPS // 2),  # nanoGPT's per-rank seed
           "rng_same": ("rng_resume", lambda: 1337, 12345, STEPS, STEPS // 2),  # one seed for every rank
           # precision=16, a schedule per update, EarlyStopping, checkpoint.monitor, dropout: one seed for every rank
           "stateful": ("stateful", lambda: 1337, 12345, 6, 3),
           # 8 steps a pass, shuffled: stopped 2 steps into the second pass, resumed in a process seeded otherwise
           "shuffled": ("shuffled", lambda: 1337, 12345, 12, 10),
           "shuffled_same_seed": ("shuffled", lambda: 1337, 1337, 12, 10)}  # ... or seeded as the first


def result(case: str, world_size: int = 1, out: Path | None = None) -> dict:
    name, how = case.rsplit("-", 1) if "-" in case else (case, None)
    if how is not None:  # NAME-straight: one fit; NAME-resumed: stopped at a checkpoint, resumed in a new Trainer
        built, seed, again, steps, stop = RESUMED[name]
        if how == "straight":
            trainer = build(built, world_size, max_steps=steps)
            torch.manual_seed(seed())
            trainer.fit()
            return record(trainer)
        directory = (out or Path(".")) / f"{name}-checkpoints"
        first = build(built, world_size, max_steps=stop, checkpoint={"dir": str(directory)})
        torch.manual_seed(seed())
        first.fit()
        if world_size > 1:
            torch.distributed.barrier()  # rank zero has written the checkpoint
        trainer = build(built, world_size, max_steps=steps, resume=str(directory), checkpoint=False)
        torch.manual_seed(again)  # the checkpoint's random state is set before the next step
        trainer.fit()
        return record(trainer)
    if case == "handwritten":
        return {"equal": against_hand(world_size)}
    if case == "test_before_fit":  # each rank's model made after its own seed (nanoGPT); tested before any fit
        torch.manual_seed(1337 + rank())
        model = MLP(8, 32, 1, 3)
        trainer = Trainer(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), device="cpu",
                          train_data=DataLoader(dataset(), batch_size=GLOBAL_BATCH // world_size), max_steps=1,
                          progress=False, loggers=())
        one = DataLoader(TensorDataset(*val_dataset()[:1]), batch_size=4)  # fewer samples than ranks
        return record(trainer, tested=trainer.test(DataLoader(val_dataset(), batch_size=4)),
                      predicted_one=[len(out) for out in trainer.predict(one)])
    if case == "unfreeze":  # a backbone frozen for the first fit, trained in the second
        trainer = build(case, world_size, max_steps=STEPS // 2)
        trainer.model[0].requires_grad_(False)
        trainer.fit()
        trainer.model[0].requires_grad_(True)
        trainer.max_steps = STEPS
        trainer.fit()
        return record(trainer)
    if case == "best_k":
        trainer = build(case, world_size, directory=str((out or Path(".")) / "best_k"))
        trainer.fit()
        best = trainer.checkpointer.best  # right after fit, as a script would take it to test the best model
        if world_size > 1:
            torch.distributed.barrier()
        return record(trainer, best=str(best), best_exists=best is not None and best.exists(),
                      best_txt=(trainer.checkpointer.dir / "best.txt").read_text().strip())
    trainer = build(case, world_size)
    try:
        trainer.fit()
    except SafeloopError as err:  # the cases whose failure is recorded (create_graph...), class_metrics last
        return record(trainer, error=str(err))
    return record(trainer)


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    for name in sys.argv[2:]:
        torch.save(result(name, dist.get_world_size(), out_dir), out_dir / f"{name}_rank{dist.get_rank()}.pt")
    dist.destroy_process_group()
