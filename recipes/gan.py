"""A GAN on a ring of 8 Gaussians, trained with alternating updates in manual mode.

    python recipes/gan.py                      # same as: python -m safeloop experiment=gan
    python recipes/gan.py trainer.max_steps=500 optimizer.lr=5e-4

Config: ``configs/experiment/gan.yaml``. The generator ``g`` maps noise to 2-D points and
the discriminator ``d`` tells them from samples of 8 Gaussians on a circle (generated
in-process). Each step is the standard alternating update:

1. D step: D's loss on real points and on ``fake.detach()``, so that it cannot reach G;
   ``self.backward(d_loss, optimizer="d")`` puts gradient on D's parameters only.
2. G step: G's loss through a *fresh* ``D(fake)``, computed after D's step. Re-using a
   D output computed before D's step would back-propagate through D weights the step
   changed in place; the guard raises ``InplaceModificationError`` before that backward.

At the end it prints how many of the 8 modes the generator covers and how many samples
are of high quality (within 3 standard deviations of a mode), and saves a scatter plot
of real vs generated points as ``gan.png`` in the run directory when matplotlib is installed.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from safeloop import ConfigError, Trainer
from safeloop.data import Data, data_seed, positive


def ring_modes(modes: int = 8, radius: float = 2.0) -> torch.Tensor:
    angles = torch.arange(modes) * (2 * math.pi / modes)
    return radius * torch.stack([angles.cos(), angles.sin()], dim=1)


class Batches:
    """Batches ``(x,)`` of a fixed sample, reshuffled every epoch (cheaper than a DataLoader per step).

    It knows where it stands (``epoch``, and ``batch``: batches taken in it), and checkpoints save
    that (``state_dict``), so a resumed run goes on with the same batches in the same order.
    """

    def __init__(self, x: torch.Tensor, batch_size: int, seed: int):
        self.x, self.batch_size, self.seed = x, batch_size, seed
        self.epoch = self.batch = 0

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def shard(self, rank: int, world: int) -> "Batches":
        """Under torchrun: every rank its own equal slice of the sample (called by safeloop)."""
        n = len(self.x) // world
        return Batches(self.x[rank * n:(rank + 1) * n], self.batch_size, self.seed + rank)

    def __iter__(self):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(self.seed + self.epoch))
        while self.batch < len(self):
            i = self.batch
            self.batch += 1
            yield (self.x[order[i * self.batch_size:(i + 1) * self.batch_size]],)
        self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]


def ring(n: int = 32768, modes: int = 8, radius: float = 2.0, std: float = 0.05,
         batch_size: int = 256, seed: int | None = 0) -> Data:
    """``n`` points from ``modes`` Gaussians (std ``std``) evenly spaced on a circle."""
    positive(n=n, modes=modes, radius=radius, std=std, batch_size=batch_size)
    seed = data_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    centers = ring_modes(modes, radius)
    which = torch.randint(modes, (n,), generator=gen)
    return Data(Batches(centers[which] + std * torch.randn(n, 2, generator=gen), batch_size, seed))


def mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, n_out))


class GAN(nn.Module):
    """Generator ``g`` (noise -> 2-D point) and discriminator ``d`` (point -> logit), in one module."""

    def __init__(self, noise_dim: int = 8, hidden: int = 128):
        super().__init__()
        positive(noise_dim=noise_dim, hidden=hidden)
        self.noise_dim = noise_dim
        self.g = mlp(noise_dim, hidden, 2)
        self.d = mlp(2, hidden, 1)

    def sample(self, n: int) -> torch.Tensor:
        device = self.g[0].weight.device  # not next(self.parameters()): that walks every submodule, every step
        return self.g(torch.randn(n, self.noise_dim, device=device))


def coverage(points: torch.Tensor, centers: torch.Tensor, std: float, min_share: float = 0.02):
    """(modes covered, share of high-quality points): a point is of high quality within 3 std
    of a mode, and a mode is covered when at least ``min_share`` of the points are near it."""
    dist, nearest = torch.cdist(points, centers).min(dim=1)
    good = dist < 3 * std
    counts = torch.bincount(nearest[good], minlength=len(centers))
    return int((counts >= min_share * len(points)).sum()), float(good.float().mean())


class GANTrainer(Trainer):
    """Alternating D and G updates; ``samples`` points are drawn at the end to measure coverage."""

    automatic = False  # training_step drives backward and the optimizer steps itself

    def __init__(self, *args, samples: int = 4000, modes: int = 8, radius: float = 2.0, std: float = 0.05,
                 **kwargs):
        try:
            positive(samples=samples, modes=modes, radius=radius, std=std)
        except ValueError as err:  # the recipe's own arguments: recipe.KEY on the command line
            raise ConfigError(f"{err} (recipe.KEY=VALUE on the command line)") from None
        super().__init__(*args, **kwargs)
        self.samples, self.centers, self.std = samples, ring_modes(modes, radius), std

    def configure_optimizers(self):
        # The configured optimizer, once for each network.
        gan = self.model
        return {"d": self.make_optimizer(gan.d.parameters()), "g": self.make_optimizer(gan.g.parameters())}

    def training_step(self, batch):
        (real,) = batch
        gan = self.model
        fake = gan.sample(len(real))

        d_real, d_fake = gan.d(real), gan.d(fake.detach())  # detach: D's loss must not reach G
        d_loss = (F.binary_cross_entropy_with_logits(d_real, torch.ones_like(d_real))
                  + F.binary_cross_entropy_with_logits(d_fake, torch.zeros_like(d_fake)))
        self.backward(d_loss, optimizer="d")
        self.step("d")

        d_fake = gan.d(fake)  # fresh: D changed in the step above
        g_loss = F.binary_cross_entropy_with_logits(d_fake, torch.ones_like(d_fake))
        self.backward(g_loss, optimizer="g")
        self.step("g")
        return {"d": d_loss, "g": g_loss}

    def on_fit_end(self) -> None:
        with torch.no_grad():
            fake = self.model.sample(self.samples).cpu()
        covered, good = coverage(fake, self.centers, self.std)
        print(f"modes covered: {covered}/{len(self.centers)}; high-quality samples (within 3 std of a mode): "
              f"{good:.0%}")
        self.plot(fake, Path(self.run_dir or ".") / "gan.png")

    def plot(self, fake: torch.Tensor, path: Path) -> None:
        try:
            import matplotlib
        except ImportError:  # the picture is optional
            print(f"no scatter plot of the samples: pip install matplotlib to have it drawn to {path}")
            return
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        real = self.train_data.x[:len(fake)]
        fig, ax = plt.subplots(figsize=(5, 5))
        ax.scatter(real[:, 0], real[:, 1], s=4, alpha=0.5, label="real")
        ax.scatter(fake[:, 0], fake[:, 1], s=4, alpha=0.5, label="generated")
        ax.set_aspect("equal")
        ax.legend(loc="upper right")
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        print(f"scatter plot: {path}")


if __name__ == "__main__":
    from safeloop.recipes import main

    main("gan")
