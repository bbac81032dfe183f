"""Public DDP code run under ``torchrun`` (2 ranks, gloo), for test_ddp_real.

``torchrun --nproc-per-node=2 tests/realworld/ddp_real_cases.py OUT_DIR CASE...`` runs each case on both ranks: the
Trainer, then the public loop it ports (DistributedDataParallel by hand), and saves both to ``OUT_DIR/CASE_rankR.pt``.

- ``zero``: pytorch/tutorials, recipes_source/zero_redundancy_optimizer.rst: a ``ZeroRedundancyOptimizer`` over
  Adam, each rank feeding its own random batch to a DDP model; ``zero_saved`` adds a checkpoint every 2 steps, and
  a run resumed from step 2's (``trainer.undo=full``: a snapshot of the loaded state before each update).
- ``spectral`` / ``spectral_accum``: neuraloperator/neuraloperator's ``SpectralConv1d`` as in zongyi-li's
  fourier_1d.py (complex ``cfloat`` weights), through DistributedDataParallel / safeloop's own reducer (grad_accum=2
  against ``no_sync``).
- ``ema``: pytorch/vision references/classification/train.py: the EMA model made after DDP wrapped the model
  (``ExponentialMovingAverage(model_without_ddp)``), each rank's model initialised unseeded (here: its own seed).
  The Trainer makes it in ``configure_optimizers`` (docs: "an EMA copy (made in configure_optimizers, say)").
- ``leftover``: huggingface/accelerate's gradient_accumulation example: grad_accum=2 over passes of 5 batches per
  rank (steps of 2, 2 and 1 batch), 2 epochs.
- ``densenet`` / ``densenet_accum``: torchvision 0.4's memory-efficient DenseNet (reentrant checkpoints around
  BatchNorm, dropout drawn per rank) as pytorch/examples imagenet/main.py trains it under DDP; grad_accum=2 against
  ``no_sync``.
- ``lottery``: rahulvigneswaran/Lottery-Ticket-Hypothesis-in-Pytorch's ``train``: the gradients of the weights under
  EPS zeroed after the backward, in ``on_after_backward``.
- ``clipped``: cleanrl's ppo_atari_multigpu.py update: gradients averaged, then ``clip_grad_norm_``; in manual mode
  the clip between ``self.backward`` and ``self.step``.
- ``penalty`` / ``penalty_accum``: PyTorch's AMP notes' gradient penalty (float32): ``torch.autograd.grad`` of the
  loss over the parameters with ``create_graph=True`` inside the step, through DDP and safeloop's own reducer.
- ``moco``: facebookresearch/moco's MoCo with its DDP parts (keys gathered from every rank into the queue, the key
  encoder's batch shuffled across ranks: collectives inside the forward), trained as main_moco.py does.
- ``barlow``: facebookresearch/barlowtwins main.py's ``torch.distributed.all_reduce(c)`` of the cross-correlation
  inside the forward (in place on the graph), with LARS and float16 autocast.
- ``simclr_val`` (a launch of its own): lightning-bolts' SimCLR, whose NT-Xent loss all-gathers every rank's
  embeddings in ``validation_step`` too; 9 validation samples in batches of 4.
- ``shared`` / ``shared_accum``: one layer applied twice, each under a reentrant checkpoint, through DDP and
  safeloop's own reducer (grad_accum=2).
- ``augment_N``: MONAI's ``Randomizable`` transform (an ``np.random.RandomState`` the dataset keeps), seeded per
  rank: 12 steps straight, and stopped at step N (3: in the first pass; 8: in the second) and resumed.
- ``wrapped``: pytorch/examples distributed/ddp-tutorial-series multigpu.py: the script wraps its model in
  DistributedDataParallel and gives a DataLoader with its own ``DistributedSampler`` (``set_epoch`` each epoch).
- ``dcgan`` / ``dcgan_nosync``: pytorch/examples dcgan/main.py with netD and netG each in DDP: two backwards into D
  (``errD_real``, ``errD_fake``) before ``optimizerD.step()``, then G's; manual mode (``sync=False`` on the first).
- ``wgan_gp``: caogang/wgan-gp gan_toy.py: three backwards into the critic (real, fake, the gradient penalty taken
  with ``create_graph=True``), CRITIC_ITERS=2 critic updates per generator update; manual mode.
- ``cyclegan_accum``: junyanz/pytorch-CycleGAN-and-pix2pix models/cycle_gan_model.py: two generators under one
  optimizer, D_A and D_B each under its own; automatic mode, three routed losses, grad_accum=2, the gradients
  ``on_after_backward`` sees recorded.
- ``cyclegan_manual``: the same model in manual mode, in ``optimize_parameters``' order: G's backward and update,
  then D_A's and D_B's backwards, then their updates.
- ``manual_accum`` / ``manual_accum_nosync``: Lightning's manual optimization accumulating over 2 steps
  (``self.backward(loss / 2)`` each step, ``self.step`` every second) against DDP with (without) ``no_sync``.
- ``infogan``: eriklindernoren/PyTorch-GAN implementations/infogan/infogan.py: ``optimizer_info`` over the
  generator's and the discriminator's parameters, next to ``optimizer_G`` and ``optimizer_D``; manual mode.
"""
from __future__ import annotations

import gc
import math
import sys
import warnings
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from safeloop import Trainer

STEPS = 4


def params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def attempt(run) -> dict:
    try:
        return run()
    except Exception as err:  # noqa: BLE001  the failure is what the test reads
        return {"error": f"{type(err).__name__}: {err}"}


# -- zero: pytorch/tutorials recipes_source/zero_redundancy_optimizer.rst -----------------------------------------
def zero_model() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(6, 6) for _ in range(3)])  # the recipe: 20 Linear(2000, 2000)


def zero_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # the recipe: torch.randn(20, 2000) on each rank
    return [(torch.randn(5, 6, generator=gen), torch.randn(5, 6, generator=gen)) for _ in range(STEPS)]


def zero_optimizer(model: nn.Module):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)


def zero_by_hand(rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = zero_model()
    ddp_model = DistributedDataParallel(model)
    loss_fn = nn.MSELoss()
    optimizer = zero_optimizer(ddp_model)
    for inputs, labels in zero_batches(rank):
        outputs = ddp_model(inputs)
        loss_fn(outputs, labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    return params(model)


class Zero(Trainer):
    def configure_optimizers(self):
        return zero_optimizer(self.model)

    def training_step(self, batch):
        inputs, labels = batch
        return nn.MSELoss()(self.model(inputs), labels)


def zero(rank: int, out: Path, saved: bool) -> dict:
    def trainer(**kwargs) -> Zero:
        torch.manual_seed(0)
        return Zero(model=zero_model(), train_data=zero_batches(rank), max_steps=STEPS, device="cpu", progress=False,
                    loggers=(), **kwargs)
    straight = trainer(checkpoint={"dir": str(out / "zero"), "every": 2} if saved else False)
    straight.fit()
    dist.barrier()
    if not saved:
        return {"ours": params(straight.model), "saved": []}
    resumed = trainer(resume=str(out / "zero" / "step-000000002.pt"), checkpoint=False, undo="full")
    resumed.fit()
    return {"ours": params(straight.model), "saved": sorted(p.name for p in (out / "zero").glob("*.pt")),
            "resumed": params(resumed.model), "undone": zero_undone(resumed, zero_batches(rank)[0])}


def zero_undone(trainer: Trainer, batch) -> bool:
    """An update of the (resumed) ZeroRedundancyOptimizer undone by the Trainer's snapshot: the weights, and this
    rank's share of the Adam state, are as before it."""
    from safeloop.step.undo import Snapshot

    opt = trainer.optimizers["optimizer"]
    before = params(trainer.model), zero_share(opt)
    snapshot = Snapshot(opt)
    snapshot.take()
    trainer.training_step(batch).backward()
    opt.step()
    moved = not same(params(trainer.model), before[0])
    snapshot.restore()
    return moved and same(params(trainer.model), before[0]) and same(zero_share(opt), before[1])


def zero_share(opt) -> list[torch.Tensor]:
    """This rank's share of a ZeroRedundancyOptimizer's Adam state, in the order of its parameters."""
    local = opt.optim
    return [t.clone() for g in local.param_groups for p in g["params"] for t in local.state[p].values()]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# -- spectral: neuraloperator SpectralConv1d (zongyi-li/fourier_neural_operator fourier_1d.py) --------------------
class SpectralConv1d(nn.Module):
    def __init__(self, in_channels, out_channels, modes1):
        super().__init__()
        self.in_channels, self.out_channels, self.modes1 = in_channels, out_channels, modes1
        self.scale = (1 / (in_channels * out_channels))
        self.weights1 = nn.Parameter(
            self.scale * torch.rand(in_channels, out_channels, self.modes1, dtype=torch.cfloat))

    def compl_mul1d(self, input, weights):
        return torch.einsum("bix,iox->box", input, weights)

    def forward(self, x):
        batchsize = x.shape[0]
        x_ft = torch.fft.rfft(x)
        out_ft = torch.zeros(batchsize, self.out_channels, x.size(-1) // 2 + 1, device=x.device, dtype=torch.cfloat)
        out_ft[:, :, :self.modes1] = self.compl_mul1d(x_ft[:, :, :self.modes1], self.weights1)
        return torch.fft.irfft(out_ft, n=x.size(-1))


class FNO1d(nn.Module):
    def __init__(self, modes=3, width=4):
        super().__init__()
        self.fc0 = nn.Linear(2, width)
        self.conv0 = SpectralConv1d(width, width, modes)
        self.w0 = nn.Conv1d(width, width, 1)
        self.fc1 = nn.Linear(width, 1)

    def forward(self, x):  # x: (batch, points, 2)
        x = self.fc0(x).permute(0, 2, 1)
        x = F.gelu(self.conv0(x) + self.w0(x))
        return self.fc1(x.permute(0, 2, 1))


def spectral_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(32, 8, 1, generator=gen)
    grid = torch.linspace(0, 1, 8).reshape(1, 8, 1).repeat(32, 1, 1)
    return TensorDataset(torch.cat([a, grid], -1), torch.cumsum(a, 1) / 8)


def spectral_by_hand(rank: int, world: int, accum: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = FNO1d()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    shard = torch.utils.data.Subset(spectral_data(), range(rank, 32, world))
    batches = iter(DataLoader(shard, batch_size=32 // world // STEPS // accum))
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        for k in range(accum):
            x, y = next(batches)
            with ddp.no_sync() if k < accum - 1 else nullcontext():
                (F.mse_loss(ddp(x), y) / accum).backward()
        optimizer.step()
    return params(model)


def spectral(rank: int, world: int, accum: int) -> dict:
    torch.manual_seed(0)
    model = FNO1d()
    trainer = Trainer(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4),
                      train_data=DataLoader(spectral_data(), batch_size=32 // world // STEPS // accum),
                      grad_accum=accum, max_steps=STEPS, device="cpu", progress=False, loggers=())
    trainer.on_step_end = lambda losses: setattr(trainer, "ddp", trainer.dist.ddp is not None)
    trainer.fit()
    return {"ours": params(model), "ddp": trainer.ddp}


# -- ema: pytorch/vision references/classification (train.py, utils.py) ------------------------------------------
class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    def __init__(self, model, decay, device="cpu"):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, device, ema_avg, use_buffers=True)


EMA_DECAY = 0.5


def ema_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(32, 3, generator=gen)
    return TensorDataset(x, (x.sum(1) > 0).long())


def ema_model(rank: int) -> nn.Module:
    torch.manual_seed(10 + rank)  # torchvision's references set no seed: each process initialises its own weights
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def evaluate(model, data) -> tuple[float, int]:
    """references/classification/train.py evaluate(): the loss summed over this rank's samples, and their count."""
    model.eval()
    with torch.inference_mode():
        x, y = data.tensors
        return float(F.cross_entropy(model(x), y, reduction="sum")), len(y)


def ema_by_hand(rank: int, world: int) -> dict:
    model = ema_model(rank)
    model = DistributedDataParallel(model)
    model_without_ddp = model.module
    model_ema = ExponentialMovingAverage(model_without_ddp, decay=EMA_DECAY)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    shard = torch.utils.data.Subset(ema_data(), range(rank, 32, world))
    for image, target in DataLoader(shard, batch_size=32 // world // STEPS):
        loss = F.cross_entropy(model(image), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model_ema.update_parameters(model)
    val = TensorDataset(*(t[rank::world] for t in ema_data().tensors))
    total = torch.tensor(evaluate(model_ema, val), dtype=torch.float64)
    dist.all_reduce(total)  # the reference's metric_logger.synchronize_between_processes()
    return {"ema": params(model_ema.module), "val_loss": float(total[0] / total[1])}


class Ema(Trainer):
    def configure_optimizers(self):
        self.ema = ExponentialMovingAverage(self.model, decay=EMA_DECAY)
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def modules(self):
        return {**super().modules(), "ema": self.ema}

    def training_step(self, batch):
        image, target = batch
        return F.cross_entropy(self.model(image), target)

    def on_step_end(self, losses):
        self.ema.update_parameters(self.model)

    def validation_step(self, batch):
        image, target = batch
        return F.cross_entropy(self.ema(image), target)


def ema(rank: int, world: int) -> dict:
    trainer = Ema(model=ema_model(rank), train_data=DataLoader(ema_data(), batch_size=32 // world // STEPS),
                  val_data=DataLoader(ema_data(), batch_size=8), max_steps=STEPS, device="cpu", progress=False,
                  loggers=())
    trainer.fit()
    return {"ema": params(trainer.ema.module), "val_loss": float(trainer.validate()["val_loss"])}


# -- wrapped: pytorch/examples distributed/ddp-tutorial-series multigpu.py (Trainer._run_batch) -------------------
def wrapped_data(world: int, rank: int) -> DataLoader:
    gen = torch.Generator().manual_seed(5)  # datautils.MyTrainDataset: random (x, y) pairs
    data = TensorDataset(torch.rand(32, 6, generator=gen), torch.rand(32, 1, generator=gen))
    return DataLoader(data, batch_size=4, shuffle=False, sampler=torch.utils.data.DistributedSampler(data))


def wrapped_by_hand(world: int, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-1)
    train_data = wrapped_data(world, rank)
    for epoch in range(2):
        train_data.sampler.set_epoch(epoch)
        for source, targets in train_data:
            optimizer.zero_grad()
            output = model(source)
            loss = F.mse_loss(output, targets)
            loss.backward()
            optimizer.step()
    return params(model)


def wrapped(world: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(6, 1))  # the script's own wrapper, given to the Trainer as it is
    trainer = Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-1), max_epochs=2,
                      train_data=wrapped_data(world, rank), device="cpu", progress=False, loggers=())
    trainer.fit()
    return {"ours": params(model)}


# -- leftover: huggingface/accelerate examples/by_feature/gradient_accumulation.py -------------------------------
# ``with accelerator.accumulate(model)``: gradients sync every ``gradient_accumulation_steps`` batches and at the
# loader's last batch (GradientState.end_of_dataloader), where the optimizer steps on the batches left; each loss
# is divided by the accumulation steps. A pass of 5 batches per rank, accumulated by 2: steps of 2, 2 and 1 batch.
LEFTOVER_SAMPLES, LEFTOVER_ACCUM = 40, 2


def leftover_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(LEFTOVER_SAMPLES, 5, generator=gen)
    return TensorDataset(x, x.sum(1, keepdim=True).tanh())


def leftover_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def leftover_by_hand(rank: int, world: int, epochs: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(leftover_model())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(torch.utils.data.Subset(leftover_data(), range(rank, LEFTOVER_SAMPLES, world)), batch_size=4)
    for _ in range(epochs):
        for step, (x, y) in enumerate(loader):
            sync = (step + 1) % LEFTOVER_ACCUM == 0 or step == len(loader) - 1
            with nullcontext() if sync else model.no_sync():
                loss = F.mse_loss(model(x), y) / LEFTOVER_ACCUM
                loss.backward()
            if sync:
                optimizer.step()
                optimizer.zero_grad()
    return params(model.module)


def leftover(world: int, epochs: int) -> dict:
    model = leftover_model()
    trainer = Trainer(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), max_epochs=epochs,
                      train_data=DataLoader(leftover_data(), batch_size=4), grad_accum=LEFTOVER_ACCUM, device="cpu",
                      progress=False, loggers=())
    trainer.fit()
    return {"ours": params(model), "steps": trainer.state.step}


# -- augment: a MONAI random transform (Project-MONAI/MONAI monai/transforms/transform.py ``Randomizable``) ---------
class RandShift:
    """``RandShiftIntensity`` as MONAI writes it: ``self.R``, an ``np.random.RandomState`` of the transform's own, set
    by ``set_random_state(seed)``; each rank seeds its own (``seed + rank``, as nanoGPT seeds ``1337 + rank``)."""

    def __init__(self, seed):
        self.R = np.random.RandomState(seed)

    def __call__(self, x):
        return x + float(self.R.uniform(-0.5, 0.5))


class Transformed(torch.utils.data.Dataset):
    """MONAI's ``Dataset(data, transform)``: the transform applied to each sample as it is read."""

    def __init__(self, x, y, transform):
        self.x, self.y, self.transform = x, y, transform

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


def augmented(rank: int) -> DataLoader:
    """24 samples, 6 steps a pass on 2 ranks (num_workers=0: the transform runs in the training process)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 4, generator=gen), torch.randn(24, 1, generator=gen)
    return DataLoader(Transformed(x, y, RandShift(5 + rank)), batch_size=2, shuffle=True,
                      generator=torch.Generator().manual_seed(2))


def augment(rank: int, out: Path, stop: int) -> dict:
    """12 steps straight, and stopped at step ``stop`` then resumed by a new Trainer over new data, as a new
    process would be: the resumed weights are the straight run's."""
    def trainer(steps: int, **kwargs) -> Trainer:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        return Trainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), max_steps=steps,
                       train_data=augmented(rank), device="cpu", progress=False, loggers=(), **kwargs)
    straight = trainer(12)
    straight.fit()
    directory = out / f"augment-{stop}"
    trainer(stop, checkpoint={"dir": str(directory)}).fit()
    dist.barrier()
    resumed = trainer(12, resume=str(directory), checkpoint=False)
    resumed.fit()
    return {"ours": params(resumed.model), "hand": params(straight.model)}


# -- densenet: torchvision 0.4's memory-efficient DenseNet (tests/realworld/test_reentrant_checkpoint.py), trained as
# pytorch/examples imagenet/main.py trains it under DDP (its ``train``; accumulation under ``no_sync``) -------------
def densenet_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(32, 2, 6, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen))


def densenet_optimizer(model: nn.Module):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)


def densenet_by_hand(rank: int, world: int, accum: int) -> dict:
    from tests.realworld.test_reentrant_checkpoint import DenseNet

    torch.manual_seed(0)
    model = DenseNet()
    ddp = DistributedDataParallel(model)
    criterion, optimizer = nn.CrossEntropyLoss(), densenet_optimizer(model)
    sampler = torch.utils.data.DistributedSampler(densenet_data(), shuffle=False)
    torch.manual_seed(7 + rank)  # dropout: each rank draws its own masks (after the loader's base seed)
    batches = iter(DataLoader(densenet_data(), batch_size=4 // accum, sampler=sampler))
    for _ in range(STEPS):
        optimizer.zero_grad()
        for k in range(accum):
            images, target = next(batches)
            with ddp.no_sync() if k < accum - 1 else nullcontext():
                (criterion(ddp(images), target) / accum).backward()
        optimizer.step()
    return {"params": params(model), "buffers": [b.clone() for b in model.buffers()]}


class Classifier(Trainer):
    def training_step(self, batch):
        images, target = batch
        return F.cross_entropy(self.model(images), target)


def densenet(rank: int, accum: int) -> dict:
    from tests.realworld.test_reentrant_checkpoint import DenseNet

    torch.manual_seed(0)
    model = DenseNet()
    trainer = Classifier(model=model, optimizer=densenet_optimizer(model), grad_accum=accum, max_steps=STEPS,
                         train_data=DataLoader(densenet_data(), batch_size=4 // accum), device="cpu", progress=False,
                         loggers=())
    torch.manual_seed(7 + rank)
    trainer.fit()
    return {"ours": params(model), "buffers": [b.clone() for b in model.buffers()]}


# -- lottery: rahulvigneswaran/Lottery-Ticket-Hypothesis-in-Pytorch main.py ``train`` ------------------------------
# After ``train_loss.backward()`` the gradients of the weights under EPS are zeroed ("Freezing Pruned weights by
# making their gradients Zero"); under DDP the backward has averaged them already. The Trainer does it in
# ``on_after_backward`` (Lightning's hook "after loss.backward() and before optimizers are stepped").
def freeze_pruned(model: nn.Module) -> None:
    EPS = 1e-6
    for name, p in model.named_parameters():
        if 'weight' in name:
            tensor = p.data.cpu().numpy()
            grad_tensor = p.grad.data.cpu().numpy()
            grad_tensor = np.where(tensor < EPS, 0, grad_tensor)
            p.grad.data = torch.from_numpy(grad_tensor)


def lottery_model() -> nn.Module:
    torch.manual_seed(0)  # archs/mnist/fc1.py, 784-300-100-10 made 6-5-3
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))


def lottery_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(8)
    return TensorDataset(torch.randn(32, 6, generator=gen), torch.randint(0, 3, (32,), generator=gen))


def lottery_by_hand(rank: int, world: int) -> list[torch.Tensor]:
    model = DistributedDataParallel(lottery_model())
    optimizer, criterion = torch.optim.Adam(model.parameters(), lr=1.2e-3), nn.CrossEntropyLoss()
    sampler = torch.utils.data.DistributedSampler(lottery_data(), shuffle=False)
    for imgs, targets in DataLoader(lottery_data(), batch_size=8 // world, sampler=sampler):
        optimizer.zero_grad()
        output = model(imgs)
        train_loss = criterion(output, targets)
        train_loss.backward()
        freeze_pruned(model.module)
        optimizer.step()
    return params(model.module)


class Lottery(Classifier):
    def on_after_backward(self, name):
        freeze_pruned(self.model)


def lottery(world: int) -> dict:
    model = lottery_model()
    trainer = Lottery(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1.2e-3), max_steps=STEPS,
                      train_data=DataLoader(lottery_data(), batch_size=8 // world), device="cpu", progress=False,
                      loggers=())
    trainer.fit()
    return {"ours": params(model)}


# -- clipped: vwxyzjn/cleanrl cleanrl/ppo_atari_multigpu.py: ``loss.backward()``, the gradients all-reduced by hand
# (summed in one flat tensor, divided by world_size), ``nn.utils.clip_grad_norm_``, ``optimizer.step()``. The port
# is manual mode, where the Trainer does the all-reduce: ``self.backward(loss)``, the clip, ``self.step()``.
MAX_GRAD_NORM = 0.05


def clipped_by_hand(rank: int, world: int) -> list[torch.Tensor]:
    agent = lottery_model()
    optimizer = torch.optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
    sampler = torch.utils.data.DistributedSampler(lottery_data(), shuffle=False)
    for x, y in DataLoader(lottery_data(), batch_size=8 // world, sampler=sampler):
        loss = F.cross_entropy(agent(x), y)
        optimizer.zero_grad()
        loss.backward()
        all_grads_list = []
        for param in agent.parameters():
            if param.grad is not None:
                all_grads_list.append(param.grad.view(-1))
        all_grads = torch.cat(all_grads_list)
        dist.all_reduce(all_grads, op=dist.ReduceOp.SUM)
        offset = 0
        for param in agent.parameters():
            if param.grad is not None:
                param.grad.data.copy_(all_grads[offset:offset + param.numel()].view_as(param.grad.data) / world)
                offset += param.numel()
        nn.utils.clip_grad_norm_(agent.parameters(), MAX_GRAD_NORM)
        optimizer.step()
    return params(agent)


class Clipped(Trainer):
    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.backward(loss)
        nn.utils.clip_grad_norm_(self.model.parameters(), MAX_GRAD_NORM)
        self.step()
        return loss.detach()


def clipped(world: int) -> dict:
    model = lottery_model()
    trainer = Clipped(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5),
                      max_steps=STEPS, train_data=DataLoader(lottery_data(), batch_size=8 // world), device="cpu",
                      progress=False, loggers=())
    trainer.fit()
    return {"ours": params(model)}


# -- penalty: pytorch/pytorch docs/source/notes/amp_examples.rst, "Gradient penalty" (its float32 listing): the
# gradients of the loss with respect to the parameters (create_graph=True), their norm added to the loss ----------
def penalized(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    grad_params = torch.autograd.grad(outputs=loss, inputs=list(model.parameters()), create_graph=True)
    grad_norm = 0
    for grad in grad_params:
        grad_norm += grad.pow(2).sum()
    grad_norm = grad_norm.sqrt()
    return loss + grad_norm


def penalty_by_hand(rank: int, world: int, accum: int) -> list[torch.Tensor]:
    model = lottery_model()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = torch.utils.data.DistributedSampler(lottery_data(), shuffle=False)
    batches = iter(DataLoader(lottery_data(), batch_size=8 // world // accum, sampler=sampler))
    for _ in range(STEPS):
        optimizer.zero_grad()
        for k in range(accum):
            with ddp.no_sync() if k < accum - 1 else nullcontext():
                (penalized(ddp, *next(batches)) / accum).backward()
        optimizer.step()
    return params(model)


class Penalized(Trainer):
    def training_step(self, batch):
        return penalized(self.model, *batch)


def penalty(world: int, accum: int) -> dict:
    model = lottery_model()
    trainer = Penalized(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), grad_accum=accum,
                        max_steps=STEPS, train_data=DataLoader(lottery_data(), batch_size=8 // world // accum),
                        device="cpu", progress=False, loggers=())
    trainer.fit()
    return {"ours": params(model)}


# -- moco: facebookresearch/moco moco/builder.py with its DDP parts (``concat_all_gather``, ``_batch_shuffle_ddp``,
# ``_batch_unshuffle_ddp``: collectives inside the model's forward), trained as main_moco.py does under DDP --------
@torch.no_grad()
def concat_all_gather(tensor):
    """Performs all_gather operation on the provided tensors. *** Warning ***: torch.distributed.all_gather has no
    gradient."""
    tensors_gather = [torch.ones_like(tensor) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(tensors_gather, tensor, async_op=False)
    output = torch.cat(tensors_gather, dim=0)
    return output


def moco_ddp():
    from tests.realworld.test_contrastive import DIM, K, M, T, MoCo, TinyEncoder

    class MoCoDDP(MoCo):
        """builder.py's MoCo whole: the keys of every rank enqueued, BatchNorm's batch shuffled across ranks."""

        @torch.no_grad()
        def _dequeue_and_enqueue(self, keys):
            super()._dequeue_and_enqueue(concat_all_gather(keys))  # gather keys before updating queue

        @torch.no_grad()
        def _batch_shuffle_ddp(self, x):
            batch_size_this = x.shape[0]
            x_gather = concat_all_gather(x)
            batch_size_all = x_gather.shape[0]
            num_gpus = batch_size_all // batch_size_this
            idx_shuffle = torch.randperm(batch_size_all)  # random shuffle index
            torch.distributed.broadcast(idx_shuffle, src=0)  # broadcast to all gpus
            idx_unshuffle = torch.argsort(idx_shuffle)  # index for restoring
            gpu_idx = torch.distributed.get_rank()  # shuffled index for this gpu
            idx_this = idx_shuffle.view(num_gpus, -1)[gpu_idx]
            return x_gather[idx_this], idx_unshuffle

        @torch.no_grad()
        def _batch_unshuffle_ddp(self, x, idx_unshuffle):
            batch_size_this = x.shape[0]
            x_gather = concat_all_gather(x)
            batch_size_all = x_gather.shape[0]
            num_gpus = batch_size_all // batch_size_this
            gpu_idx = torch.distributed.get_rank()  # restored index for this gpu
            idx_this = idx_unshuffle.view(num_gpus, -1)[gpu_idx]
            return x_gather[idx_this]

        def forward(self, im_q, im_k):
            q = nn.functional.normalize(self.encoder_q(im_q), dim=1)  # queries: NxC
            with torch.no_grad():  # no gradient to keys
                self._momentum_update_key_encoder()  # update the key encoder
                im_k, idx_unshuffle = self._batch_shuffle_ddp(im_k)  # shuffle for making use of BN
                k = nn.functional.normalize(self.encoder_k(im_k), dim=1)  # keys: NxC
                k = self._batch_unshuffle_ddp(k, idx_unshuffle)  # undo shuffle
            l_pos = torch.einsum("nc,nc->n", [q, k]).unsqueeze(-1)
            l_neg = torch.einsum("nc,ck->nk", [q, self.queue.clone().detach()])
            logits = torch.cat([l_pos, l_neg], dim=1)
            logits /= self.T
            labels = torch.zeros(logits.shape[0], dtype=torch.long)
            self._dequeue_and_enqueue(k)
            return logits, labels

    torch.manual_seed(0)
    return MoCoDDP(TinyEncoder, DIM, K, M, T, mlp=True)


def moco_views(rank: int, world: int) -> list:
    """Each rank's share of test_contrastive's two noisy views of a batch (2 samples a rank: K % 4 == 0)."""
    from tests.realworld.test_contrastive import two_crops

    return [([v[rank::world] for v in views], target[rank::world]) for views, target in two_crops(STEPS)]


def moco_by_hand(rank: int, world: int) -> dict:
    from tests.realworld.test_contrastive import moco_opt

    model = moco_ddp()
    ddp = DistributedDataParallel(model)
    criterion, optimizer = nn.CrossEntropyLoss(), moco_opt(model.parameters())
    torch.manual_seed(3)  # the shuffle's randperm (rank zero's is broadcast)
    for images, _ in moco_views(rank, world):
        output, target = ddp(im_q=images[0], im_k=images[1])
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {"params": params(model), "queue": model.queue.clone()}


def moco(rank: int, world: int) -> dict:
    from tests.realworld.test_contrastive import MoCoTrainer

    trainer = MoCoTrainer(model=moco_ddp(), train_data=moco_views(rank, world), max_steps=STEPS, device="cpu",
                          progress=False, loggers=())
    torch.manual_seed(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a list of batches: each rank's share is given
        trainer.fit()
    return {"ours": params(trainer.model), "queue": trainer.model.queue.clone()}


# -- barlow: facebookresearch/barlowtwins main.py under DDP: ``torch.distributed.all_reduce(c)`` sums the
# cross-correlation over the ranks inside the forward, in place on a tensor of the graph (tests/realworld/
# test_barlow_twins.py's model, LARS, schedule and float16 autocast with a GradScaler) ----------------------------
def barlow_model():
    from tests.realworld.test_barlow_twins import Args, BarlowTwins, off_diagonal

    class BarlowTwinsDDP(BarlowTwins):
        def forward(self, y1, y2):
            z1 = self.projector(self.backbone(y1))
            z2 = self.projector(self.backbone(y2))

            # empirical cross-correlation matrix
            c = self.bn(z1).T @ self.bn(z2)

            # sum the cross-correlation matrix between all gpus
            c.div_(self.args.batch_size)
            torch.distributed.all_reduce(c)

            on_diag = torch.diagonal(c).add_(-1).pow_(2).sum()
            off_diag = off_diagonal(c).pow_(2).sum()
            loss = on_diag + self.args.lambd * off_diag
            return loss

    torch.manual_seed(0)
    return BarlowTwinsDDP(Args())


def barlow_views(rank: int, world: int) -> list:
    from tests.realworld.test_barlow_twins import views

    return [((y1[rank::world], y2[rank::world]), t[rank::world]) for (y1, y2), t in views()]


def barlow_by_hand(rank: int, world: int) -> list[torch.Tensor]:
    from tests.realworld.test_barlow_twins import barlow_hand

    model = barlow_model()
    barlow_hand(DistributedDataParallel(model), barlow_views(rank, world))
    return params(model)


def barlow(rank: int, world: int) -> dict:
    from tests.realworld.test_barlow_twins import EPOCHS, BarlowTwinsTrainer

    model = barlow_model()
    trainer = BarlowTwinsTrainer(model=model, train_data=barlow_views(rank, world), max_epochs=EPOCHS,
                                 precision="16", device="cpu", progress=False, loggers=())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a list of batches: each rank's share is given
        trainer.fit()
    return {"ours": params(model)}


# -- simclr_val: Lightning-Universe/lightning-bolts pl_bolts/models/self_supervised/simclr/simclr_module.py: the
# NT-Xent loss gathers every rank's embeddings (``SyncFunction``: all_gather forward, all_reduce backward), in
# ``shared_step``, which ``validation_step`` runs too; a validation set of 9 samples, batches of 4 ---------------
class SyncFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor):
        ctx.batch_size = tensor.shape[0]

        gathered_tensor = [torch.zeros_like(tensor) for _ in range(torch.distributed.get_world_size())]

        torch.distributed.all_gather(gathered_tensor, tensor)
        return torch.cat(gathered_tensor, 0)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = grad_output.clone()
        torch.distributed.all_reduce(grad_input, op=torch.distributed.ReduceOp.SUM, async_op=False)

        idx_from = torch.distributed.get_rank() * ctx.batch_size
        idx_to = (torch.distributed.get_rank() + 1) * ctx.batch_size
        return grad_input[idx_from:idx_to]


class Projection(nn.Module):
    def __init__(self, input_dim=2048, hidden_dim=2048, output_dim=128) -> None:
        super().__init__()
        self.model = nn.Sequential(
            nn.Linear(input_dim, hidden_dim),
            nn.BatchNorm1d(hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, output_dim, bias=False),
        )

    def forward(self, x):
        x = self.model(x)
        return F.normalize(x, dim=1)


def nt_xent_loss(out_1, out_2, temperature, eps=1e-6):
    out_1_dist = SyncFunction.apply(out_1)
    out_2_dist = SyncFunction.apply(out_2)
    out = torch.cat([out_1, out_2], dim=0)
    out_dist = torch.cat([out_1_dist, out_2_dist], dim=0)
    cov = torch.mm(out, out_dist.t().contiguous())
    sim = torch.exp(cov / temperature)
    neg = sim.sum(dim=-1)
    row_sub = torch.Tensor(neg.shape).fill_(math.e ** (1 / temperature)).to(neg.device)
    neg = torch.clamp(neg - row_sub, min=eps)  # clamp for numerical stability
    pos = torch.exp(torch.sum(out_1 * out_2, dim=-1) / temperature)
    pos = torch.cat([pos, pos], dim=0)
    return -torch.log(pos / (neg + eps)).mean()


class SimCLR(Trainer):
    temperature = 0.5  # cifar10's

    def shared_step(self, batch):
        (img1, img2, _), y = batch
        encoder, projection = self.model
        z1 = projection(encoder(img1))
        z2 = projection(encoder(img2))
        return nt_xent_loss(z1, z2, self.temperature)

    def training_step(self, batch):
        return self.shared_step(batch)

    def validation_step(self, batch):
        return self.shared_step(batch)


def simclr_data(n: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(n, 6, generator=gen)
    views = [x + 0.1 * torch.randn(n, 6, generator=gen) for _ in range(3)]  # the last for online evaluation
    return TensorDataset(*views, torch.zeros(n, dtype=torch.long))


def simclr_val(world: int) -> dict:
    torch.manual_seed(0)
    model = nn.ModuleList([nn.Sequential(nn.Linear(6, 8), nn.ReLU()), Projection(8, 8, 4)])
    regroup = lambda batch: ((batch[0], batch[1], batch[2]), batch[3])  # noqa: E731  ((img1, img2, img3), y)
    trainer = SimCLR(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3), max_steps=2,
                     train_data=DataLoader(simclr_data(16), batch_size=8 // world, collate_fn=lambda b: regroup(
                         torch.utils.data.default_collate(b))),
                     val_data=DataLoader(simclr_data(9), batch_size=4, collate_fn=lambda b: regroup(
                         torch.utils.data.default_collate(b))), device="cpu", progress=False, loggers=())
    trainer.fit()
    return {"val_loss": float(trainer.validate()["val_loss"])}


# -- shared: one layer applied twice, each time under a reentrant checkpoint (ALBERT-style sharing with activation
# checkpointing): "activation checkpointing multiple times", which the ``static_graph`` docstring of
# pytorch/pytorch torch/nn/parallel/distributed.py names as needing it. Its gradient is accumulated once per call.
class SharedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.layer, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 1)

    def block(self, h):
        return torch.tanh(self.layer(h))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(2):
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        return self.out(h)


def shared_by_hand(rank: int, world: int, accum: int) -> list[torch.Tensor]:
    """accum 1: DDP(static_graph=True); accum 2 (where torch's own DDP fails an internal assert under no_sync): the
    micro-batches accumulated, then the gradients all-reduced by hand (summed in one flat tensor, divided by
    world), which equals DDP(static_graph=True) at accum 1 bit for bit."""
    torch.manual_seed(0)
    model = SharedLayer()
    forward = DistributedDataParallel(model, static_graph=True) if accum == 1 else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = torch.utils.data.DistributedSampler(lottery_data(), shuffle=False)
    batches = iter(DataLoader(lottery_data(), batch_size=8 // world // accum, sampler=sampler))
    for _ in range(STEPS):
        optimizer.zero_grad()
        for _ in range(accum):
            x, y = next(batches)
            (F.mse_loss(forward(x), y[:, None].float()) / accum).backward()
        if accum > 1:
            flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            dist.all_reduce(flat)
            offset = 0
            for p in model.parameters():
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p) / world)
                offset += p.numel()
        optimizer.step()
    return params(model)


class SharedTrainer(Trainer):
    def training_step(self, batch):
        x, y = batch
        return F.mse_loss(self.model(x), y[:, None].float())


def shared(world: int, accum: int) -> dict:
    """accum 1, the usual run: first without static_graph (DDP's error, and what safeloop adds to it), then with it."""
    def run(static_graph: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = SharedLayer()
        trainer = SharedTrainer(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                grad_accum=accum, max_steps=STEPS, static_graph=static_graph, device="cpu",
                                train_data=DataLoader(lottery_data(), batch_size=8 // world // accum),
                                progress=False, loggers=())
        trainer.fit()
        return params(model)
    if accum > 1:
        return {"ours": run(False)}
    return {"without": attempt(lambda: {"ours": run(False)}).get("error"), "ours": run(True)}


# -- dcgan: pytorch/examples dcgan/main.py (netD, netG each wrapped in DistributedDataParallel):
# ``errD_real.backward()`` and ``errD_fake.backward()`` into D (each averaged by DDP), ``optimizerD.step()``, then
# ``errG.backward()`` through D into G and ``optimizerG.step()``. ``nosync``: the first backward under
# ``netD.no_sync()``. Made 6-dim and tiny.
NZ = 3


class GanNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(NZ, 5), nn.ReLU(), nn.Linear(5, 6), nn.Tanh())
        self.d = nn.Sequential(nn.Linear(6, 5), nn.LeakyReLU(0.2), nn.Linear(5, 1), nn.Sigmoid())


def gan_data() -> TensorDataset:
    return TensorDataset(lottery_data().tensors[0])


def gan_adam(parameters) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=2e-2, betas=(0.5, 0.999))


def dcgan_by_hand(rank: int, world: int, nosync: bool) -> list[torch.Tensor]:
    net = GanNet()
    netG, netD = DistributedDataParallel(net.g), DistributedDataParallel(net.d)
    optimizerD, optimizerG = gan_adam(netD.parameters()), gan_adam(netG.parameters())
    criterion, gen = nn.BCELoss(), torch.Generator().manual_seed(50 + rank)
    sampler = torch.utils.data.DistributedSampler(gan_data(), shuffle=False)
    for (real,) in DataLoader(gan_data(), batch_size=8 // world, sampler=sampler):
        netD.zero_grad()
        label = torch.full((real.size(0),), 1.0)
        with netD.no_sync() if nosync else nullcontext():
            errD_real = criterion(netD(real).view(-1), label)
            errD_real.backward()
        fake = netG(torch.randn(real.size(0), NZ, generator=gen))
        label.fill_(0.0)
        errD_fake = criterion(netD(fake.detach()).view(-1), label)
        errD_fake.backward()
        optimizerD.step()
        netG.zero_grad()
        label.fill_(1.0)
        errG = criterion(netD(fake).view(-1), label)
        errG.backward()
        optimizerG.step()
    return params(net)


class DCGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"d": gan_adam(self.model.d.parameters()), "g": gan_adam(self.model.g.parameters())}

    def training_step(self, batch):
        (real,) = batch
        criterion, ones, zeros = nn.BCELoss(), torch.ones(real.size(0)), torch.zeros(real.size(0))
        errD_real = criterion(self.model.d(real).view(-1), ones)
        self.backward(errD_real, optimizer="d", sync=not self.nosync)
        fake = self.model.g(torch.randn(real.size(0), NZ, generator=self.gen))
        errD_fake = criterion(self.model.d(fake.detach()).view(-1), zeros)
        self.backward(errD_fake, optimizer="d")
        self.step("d")
        errG = criterion(self.model.d(fake).view(-1), ones)
        self.backward(errG, optimizer="g")
        self.step("g")
        return {"d": (errD_real + errD_fake).detach(), "g": errG.detach()}


def dcgan(rank: int, world: int, nosync: bool) -> dict:
    model = GanNet()
    trainer = DCGAN(model=model, max_steps=STEPS, train_data=DataLoader(gan_data(), batch_size=8 // world),
                    device="cpu", progress=False, loggers=())
    trainer.gen, trainer.nosync = torch.Generator().manual_seed(50 + rank), nosync
    trainer.fit()
    return {"ours": params(model)}


# -- wgan_gp: caogang/wgan-gp gan_toy.py (the PyTorch port of igul222/improved_wgan_training): per critic iteration
# ``D_real.backward(mone)``, ``D_fake.backward(one)``, ``gradient_penalty.backward()`` (``autograd.grad`` of D at
# the interpolates with ``create_graph=True``), ``optimizerD.step()``; every CRITIC_ITERS=2 the generator's
# ``G.backward(mone)``. Under DDP each backward averages D's gradients: here by hand, as DDP does (world 2: the
# same bits as its pre-divided sum).
CRITIC_ITERS, LAMBDA = 2, 0.1


class WganNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(NZ, 5), nn.ReLU(), nn.Linear(5, 6))
        self.d = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 1))


def averaged(module: nn.Module, world: int) -> None:
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def gradient_penalty(netD, real, fake, gen) -> torch.Tensor:
    alpha = torch.rand(real.size(0), 1, generator=gen).expand(real.size())
    interpolates = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    disc_interpolates = netD(interpolates)
    gradients = torch.autograd.grad(outputs=disc_interpolates, inputs=interpolates,
                                    grad_outputs=torch.ones(disc_interpolates.size()), create_graph=True,
                                    retain_graph=True, only_inputs=True)[0]
    return ((gradients.norm(2, dim=1) - 1) ** 2).mean() * LAMBDA


def wgan_adam(parameters) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=1e-2, betas=(0.5, 0.9))


def wgan_by_hand(rank: int, world: int) -> list[torch.Tensor]:
    net = WganNet()
    netG, netD = net.g, net.d
    optimizerD, optimizerG = wgan_adam(netD.parameters()), wgan_adam(netG.parameters())
    one, gen = torch.tensor(1.0), torch.Generator().manual_seed(70 + rank)
    mone = one * -1
    sampler = torch.utils.data.DistributedSampler(gan_data(), shuffle=False)
    for i, (real,) in enumerate(DataLoader(gan_data(), batch_size=8 // world, sampler=sampler)):
        netD.zero_grad()
        D_real = netD(real).mean()
        D_real.backward(mone)
        averaged(netD, world)
        fake = netG(torch.randn(real.size(0), NZ, generator=gen)).detach()
        D_fake = netD(fake).mean()
        D_fake.backward(one)
        averaged(netD, world)
        gradient_penalty(netD, real, fake, gen).backward()
        averaged(netD, world)
        optimizerD.step()
        if (i + 1) % CRITIC_ITERS == 0:
            netG.zero_grad()
            G = netD(netG(torch.randn(real.size(0), NZ, generator=gen))).mean()
            G.backward(mone)
            averaged(netG, world)
            optimizerG.step()
    return params(net)


class WGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return {"d": wgan_adam(self.model.d.parameters()), "g": wgan_adam(self.model.g.parameters())}

    def training_step(self, batch):
        (real,) = batch
        D_real = self.model.d(real).mean()
        self.backward(-D_real, optimizer="d")
        fake = self.model.g(torch.randn(real.size(0), NZ, generator=self.gen)).detach()
        D_fake = self.model.d(fake).mean()
        self.backward(D_fake, optimizer="d")
        self.backward(gradient_penalty(self.model.d, real, fake, self.gen), optimizer="d")
        self.step("d")
        if self.state.step % CRITIC_ITERS == CRITIC_ITERS - 1:
            G = self.model.d(self.model.g(torch.randn(real.size(0), NZ, generator=self.gen))).mean()
            self.backward(-G, optimizer="g")
            self.step("g")
        return (D_fake - D_real).detach()


def wgan(rank: int, world: int) -> dict:
    model = WganNet()
    trainer = WGAN(model=model, max_steps=STEPS, train_data=DataLoader(gan_data(), batch_size=8 // world),
                   device="cpu", progress=False, loggers=())
    trainer.gen = torch.Generator().manual_seed(70 + rank)
    trainer.fit()
    return {"ours": params(model)}


# -- cyclegan_accum: junyanz/pytorch-CycleGAN-and-pix2pix models/cycle_gan_model.py ``optimize_parameters`` (LSGAN
# loss, cycle loss with lambda 10, no identity loss, no image pool), D_A and D_B each under its own optimizer, 2
# micro-batches a step: each loss / 2 back-propagated into its own optimizer's parameters, the gradients averaged
# after the last micro-batch's backward (DDP under ``no_sync`` for the first), then the three updates.
class CycleNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g_ab, self.g_ba = nn.Linear(6, 6), nn.Linear(6, 6)
        self.d_a, self.d_b = nn.Sequential(nn.Linear(6, 4), nn.LeakyReLU(0.2), nn.Linear(4, 1)), \
            nn.Sequential(nn.Linear(6, 4), nn.LeakyReLU(0.2), nn.Linear(4, 1))


def cycle_data() -> TensorDataset:
    gen = torch.Generator().manual_seed(9)
    return TensorDataset(lottery_data().tensors[0], torch.randn(32, 6, generator=gen) + 1)


def cycle_losses(net: CycleNet, real_a, real_b) -> dict[str, torch.Tensor]:
    fake_b, fake_a = net.g_ab(real_a), net.g_ba(real_b)
    rec_a, rec_b = net.g_ba(fake_b), net.g_ab(fake_a)

    def gan(pred, real: bool):
        return F.mse_loss(pred, torch.full_like(pred, 1.0 if real else 0.0))
    loss_g = gan(net.d_a(fake_b), True) + gan(net.d_b(fake_a), True) + \
        F.l1_loss(rec_a, real_a) * 10 + F.l1_loss(rec_b, real_b) * 10
    loss_d_a = (gan(net.d_a(real_b), True) + gan(net.d_a(fake_b.detach()), False)) * 0.5
    loss_d_b = (gan(net.d_b(real_a), True) + gan(net.d_b(fake_a.detach()), False)) * 0.5
    return {"g": loss_g, "d_a": loss_d_a, "d_b": loss_d_b}


def cycle_groups(net: CycleNet) -> dict[str, list[nn.Parameter]]:
    return {"g": [*net.g_ab.parameters(), *net.g_ba.parameters()], "d_a": list(net.d_a.parameters()),
            "d_b": list(net.d_b.parameters())}


def cycle_adam(parameters) -> torch.optim.Optimizer:
    return torch.optim.Adam(parameters, lr=2e-2, betas=(0.5, 0.999))


def cycle_seen(net: CycleNet, name: str) -> torch.Tensor:
    return {"g": net.g_ab.weight, "d_a": net.d_a[0].weight, "d_b": net.d_b[0].weight}[name].grad.clone()


def cyclegan_by_hand(rank: int, world: int) -> dict:
    net = CycleNet()
    groups = cycle_groups(net)
    optimizers = {name: cycle_adam(group) for name, group in groups.items()}
    sampler = torch.utils.data.DistributedSampler(cycle_data(), shuffle=False)
    batches = list(DataLoader(cycle_data(), batch_size=8 // world // 2, sampler=sampler))
    seen = []
    for step in range(STEPS):
        for micro in (0, 1):
            losses = cycle_losses(net, *batches[2 * step + micro])
            for name, loss in losses.items():
                (loss / 2).backward(inputs=groups[name])
                if micro == 1:
                    for p in groups[name]:
                        dist.all_reduce(p.grad)
                        p.grad.div_(world)
                seen.append(cycle_seen(net, name))
        for opt in optimizers.values():
            opt.step()
            opt.zero_grad()
    return {"params": params(net), "seen": seen}


class CycleGAN(Trainer):
    def configure_optimizers(self):
        return {name: cycle_adam(group) for name, group in cycle_groups(self.model).items()}

    def training_step(self, batch):
        return cycle_losses(self.model, *batch)

    def on_after_backward(self, name):
        self.seen.append(cycle_seen(self.model, name))


def cyclegan(world: int) -> dict:
    model = CycleNet()
    trainer = CycleGAN(model=model, max_steps=STEPS, grad_accum=2, device="cpu", progress=False, loggers=(),
                       train_data=DataLoader(cycle_data(), batch_size=8 // world // 2))
    trainer.seen = []
    trainer.fit()
    return {"ours": params(model), "seen": trainer.seen}


def cyclegan_manual_by_hand(rank: int, world: int) -> dict:
    net = CycleNet()
    groups = cycle_groups(net)
    optimizers = {name: cycle_adam(group) for name, group in groups.items()}
    sampler = torch.utils.data.DistributedSampler(cycle_data(), shuffle=False)
    seen = []
    for batch in DataLoader(cycle_data(), batch_size=8 // world, sampler=sampler):
        losses = cycle_losses(net, *batch)
        for names in (("g",), ("d_a", "d_b")):
            for name in names:
                losses[name].backward(inputs=groups[name])
                for p in groups[name]:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
                seen.append(cycle_seen(net, name))
            for name in names:
                optimizers[name].step()
                optimizers[name].zero_grad()
    return {"params": params(net), "seen": seen}


class CycleGANManual(CycleGAN):
    automatic = False

    def training_step(self, batch):
        losses = cycle_losses(self.model, *batch)
        for names in (("g",), ("d_a", "d_b")):
            for name in names:
                self.backward(losses[name], optimizer=name)
            for name in names:
                self.step(name)
        return {name: loss.detach() for name, loss in losses.items()}


def cyclegan_manual(world: int) -> dict:
    model = CycleNet()
    trainer = CycleGANManual(model=model, max_steps=STEPS, device="cpu", progress=False, loggers=(),
                             train_data=DataLoader(cycle_data(), batch_size=8 // world))
    trainer.seen = []
    trainer.fit()
    return {"ours": params(model), "seen": trainer.seen}


# -- manual_accum: Lightning's manual optimization docs ("Gradient accumulation": ``self.manual_backward(loss / N)``
# each step, ``opt.step()`` every N-th) under DDP, N=2: each backward averaged (``nosync``: the first of each pair
# under ``no_sync()``, the Trainer's ``sync=False``).
def manual_accum_by_hand(rank: int, world: int, nosync: bool) -> list[torch.Tensor]:
    model = DistributedDataParallel(lottery_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    sampler = torch.utils.data.DistributedSampler(lottery_data(), shuffle=False)
    for i, (x, y) in enumerate(DataLoader(lottery_data(), batch_size=8 // world, sampler=sampler)):
        with model.no_sync() if nosync and i % 2 == 0 else nullcontext():
            (F.cross_entropy(model(x), y) / 2).backward()
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    return params(model.module)


class ManualAccum(Trainer):
    automatic = False

    def training_step(self, batch):
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        last = self.state.step % 2 == 1
        self.backward(loss / 2, sync=last or not self.nosync)
        if last:
            self.step()
        return loss.detach()


def manual_accum(world: int, nosync: bool) -> dict:
    model = lottery_model()
    trainer = ManualAccum(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-2), max_steps=STEPS,
                          train_data=DataLoader(lottery_data(), batch_size=8 // world), device="cpu", progress=False,
                          loggers=())
    trainer.nosync = nosync
    trainer.fit()
    return {"ours": params(model)}


# -- infogan: eriklindernoren/PyTorch-GAN implementations/infogan/infogan.py: G's update (``g_loss``), D's update
# (``d_loss``), then ``optimizer_info`` (over ``itertools.chain(generator.parameters(),
# discriminator.parameters())``) with the categorical and continuous code losses. Under DDP each backward averages
# the gradients it wrote: here by hand, after each backward, over both networks.
N_CLASSES, CODE_DIM, LATENT = 3, 1, 2


class InfoNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(LATENT + N_CLASSES + CODE_DIM, 6), nn.Tanh())
        self.body = nn.Sequential(nn.Linear(6, 5), nn.LeakyReLU(0.2))
        self.adv, self.aux, self.latent = nn.Linear(5, 1), nn.Linear(5, N_CLASSES), nn.Linear(5, CODE_DIM)

    def d(self, img):
        out = self.body(img)
        return self.adv(out), self.aux(out), self.latent(out)

    def d_parameters(self) -> list[nn.Parameter]:
        return [*self.body.parameters(), *self.adv.parameters(), *self.aux.parameters(), *self.latent.parameters()]


def info_optimizers(net: InfoNet) -> dict[str, torch.optim.Optimizer]:
    def adam(parameters):
        return torch.optim.Adam(parameters, lr=2e-2, betas=(0.5, 0.999))
    return {"g": adam(net.g.parameters()), "d": adam(net.d_parameters()),
            "info": adam([*net.g.parameters(), *net.d_parameters()])}


def info_losses(net: InfoNet, real, gen, part: str) -> torch.Tensor:
    """One of the script's three losses; ``gen``: this rank's generator of noise and codes."""
    b = real.size(0)
    valid, fake = torch.ones(b, 1), torch.zeros(b, 1)
    if part in ("g", "d"):
        if part == "g":
            labels = torch.randint(0, N_CLASSES, (b,), generator=gen)
            net.gen_imgs = net.g(torch.cat([torch.randn(b, LATENT, generator=gen), F.one_hot(labels, N_CLASSES),
                                            torch.rand(b, CODE_DIM, generator=gen) * 2 - 1], 1))
            return F.mse_loss(net.d(net.gen_imgs)[0], valid)
        return (F.mse_loss(net.d(real)[0], valid) + F.mse_loss(net.d(net.gen_imgs.detach())[0], fake)) / 2
    labels = torch.randint(0, N_CLASSES, (b,), generator=gen)
    code = torch.rand(b, CODE_DIM, generator=gen) * 2 - 1
    gen_imgs = net.g(torch.cat([torch.randn(b, LATENT, generator=gen), F.one_hot(labels, N_CLASSES), code], 1))
    _, pred_label, pred_code = net.d(gen_imgs)
    return F.cross_entropy(pred_label, labels) + 0.1 * F.mse_loss(pred_code, code)


def infogan_by_hand(rank: int, world: int) -> list[torch.Tensor]:
    net = InfoNet()
    optimizers, gen = info_optimizers(net), torch.Generator().manual_seed(90 + rank)
    sampler = torch.utils.data.DistributedSampler(gan_data(), shuffle=False)
    for (real,) in DataLoader(gan_data(), batch_size=8 // world, sampler=sampler):
        for part in ("g", "d", "info"):
            optimizers[part].zero_grad()
            info_losses(net, real, gen, part).backward()
            averaged(net, world)
            optimizers[part].step()
    return params(net)


class InfoGAN(Trainer):
    automatic = False

    def configure_optimizers(self):
        return info_optimizers(self.model)

    def training_step(self, batch):
        (real,) = batch
        losses = {}
        for part in ("g", "d", "info"):
            losses[part] = info_losses(self.model, real, self.gen, part)
            self.backward(losses[part], optimizer=part)
            self.step(part)
        self.model.gen_imgs = None
        return {name: loss.detach() for name, loss in losses.items()}


def infogan(rank: int, world: int) -> dict:
    model = InfoNet()
    trainer = InfoGAN(model=model, max_steps=STEPS, train_data=DataLoader(gan_data(), batch_size=8 // world),
                      device="cpu", progress=False, loggers=())
    trainer.gen = torch.Generator().manual_seed(90 + rank)
    trainer.fit()
    return {"ours": params(model)}


def result(case: str, out: Path) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if case in ("zero", "zero_saved"):
        return {**attempt(lambda: zero(rank, out, case == "zero_saved")), "hand": zero_by_hand(rank)}
    if case in ("spectral", "spectral_accum"):
        accum = 2 if case == "spectral_accum" else 1
        return {**attempt(lambda: spectral(rank, world, accum)), "hand": spectral_by_hand(rank, world, accum)}
    if case == "ema":
        return {**attempt(lambda: ema(rank, world)), "hand": ema_by_hand(rank, world)}
    if case == "wrapped":
        return {**attempt(lambda: wrapped(world, rank)), "hand": wrapped_by_hand(world, rank)}
    if case == "leftover":
        return {**attempt(lambda: leftover(world, 2)), "hand": leftover_by_hand(rank, world, 2)}
    if case.startswith("augment_"):
        return augment(rank, out, int(case.split("_")[1]))
    if case in ("densenet", "densenet_accum"):
        accum = 2 if case == "densenet_accum" else 1
        return {**attempt(lambda: densenet(rank, accum)), "hand": densenet_by_hand(rank, world, accum)}
    if case == "lottery":
        return {**attempt(lambda: lottery(world)), "hand": lottery_by_hand(rank, world)}
    if case == "clipped":
        return {**attempt(lambda: clipped(world)), "hand": clipped_by_hand(rank, world)}
    if case in ("penalty", "penalty_accum"):
        accum = 2 if case == "penalty_accum" else 1
        return {**attempt(lambda: penalty(world, accum)), "hand": penalty_by_hand(rank, world, accum)}
    if case == "moco":
        return {**attempt(lambda: moco(rank, world)), "hand": moco_by_hand(rank, world)}
    if case == "barlow":
        return {**attempt(lambda: barlow(rank, world)), "hand": barlow_by_hand(rank, world)}
    if case == "simclr_val":  # run in a launch of its own: a rank may abort
        return simclr_val(world)
    if case in ("shared", "shared_accum"):
        accum = 2 if case == "shared_accum" else 1
        return {**attempt(lambda: shared(world, accum)), "hand": shared_by_hand(rank, world, accum)}
    if case in ("dcgan", "dcgan_nosync"):
        nosync = case == "dcgan_nosync"
        return {**attempt(lambda: dcgan(rank, world, nosync)), "hand": dcgan_by_hand(rank, world, nosync)}
    if case == "wgan_gp":
        return {**attempt(lambda: wgan(rank, world)), "hand": wgan_by_hand(rank, world)}
    if case == "cyclegan_accum":
        return {**attempt(lambda: cyclegan(world)), "hand": cyclegan_by_hand(rank, world)}
    if case in ("manual_accum", "manual_accum_nosync"):
        nosync = case == "manual_accum_nosync"
        return {**attempt(lambda: manual_accum(world, nosync)), "hand": manual_accum_by_hand(rank, world, nosync)}
    if case == "cyclegan_manual":
        return {**attempt(lambda: cyclegan_manual(world)), "hand": cyclegan_manual_by_hand(rank, world)}
    if case == "infogan":
        return {**attempt(lambda: infogan(rank, world)), "hand": infogan_by_hand(rank, world)}
    raise ValueError(case)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a mismatched collective fails, not hangs
    for name in sys.argv[2:]:
        torch.save(result(name, out_dir), out_dir / f"{name}_rank{dist.get_rank()}.pt")
        dist.barrier()
    gc.collect()  # the cases' DDP wrappers, kept only by reference cycles: freed before their process group ends
    dist.destroy_process_group()
