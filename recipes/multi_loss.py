"""Three losses on a shared trunk: which backwards must retain the graph, decided for you.

    python recipes/multi_loss.py                              # sequential backwards (the default)
    python recipes/multi_loss.py trainer.multi_loss=sum       # one backward of the weighted sum
    python recipes/multi_loss.py -m trainer.multi_loss=sequential,sum   # both, one after the other
    python -m safeloop experiment=multi_loss                  # the same from the main CLI

Config: ``configs/experiment/multi_loss.yaml``. A trunk feeds three heads:

- ``recon`` reconstructs an *unlabelled* batch through the trunk (a separate forward pass),
- ``reg`` regresses a smooth target and ``cls`` classifies, both from the labelled batch.

``training_step`` returns the three losses as a dict. With ``multi_loss: sequential`` the
Trainer back-propagates them in order. Raw PyTorch would need ``retain_graph=True`` on every
backward but the last (and fail with "Trying to backward through the graph a second time"
without it). The guard walks the graphs and retains only where a later loss shares nodes:
``reg`` shares the labelled trunk pass with ``cls`` and retains it; ``recon`` shares only
parameters with the others, so its graph (activations included) is freed by its own backward.
On steps the guard does not walk (``guard.check: auto`` after warm-up) every backward but
the last retains. At the end the recipe prints what was retained; each loss is logged by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from safeloop import Trainer
from safeloop.data import Data, data_seed, positive


class Batches:
    """Batches of fixed tensors, reshuffled every epoch.

    The order depends on the epoch, so it knows where it stands (``epoch``, and ``batch``: batches
    taken in it), and checkpoints save that (``state_dict``): a resumed run goes on with the same
    batches in the same order.
    """

    def __init__(self, tensors: tuple[torch.Tensor, ...], batch_size: int, seed: int, shuffle: bool = True):
        self.tensors, self.batch_size, self.seed, self.shuffle = tensors, batch_size, seed, shuffle
        self.epoch = self.batch = 0

    def __len__(self) -> int:
        return len(self.tensors[0]) // self.batch_size

    def __iter__(self):
        n = len(self.tensors[0])
        gen = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)
        while self.batch < len(self):
            idx = order[self.batch * self.batch_size:(self.batch + 1) * self.batch_size]
            self.batch += 1
            yield tuple(t[idx] for t in self.tensors)
        self.epoch, self.batch = self.epoch + 1, 0

    def shard(self, rank: int, world: int) -> "Batches":
        """Under torchrun: every rank its own equal slice of the samples, so as many batches each (called by
        safeloop); ``batch_size`` is per rank, as a DataLoader's is."""
        n = len(self.tensors[0]) // world
        return Batches(tuple(t[rank * n:(rank + 1) * n] for t in self.tensors), self.batch_size, self.seed + rank,
                       self.shuffle)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.batch = state["epoch"], state["batch"]


def tasks(n_train: int = 8192, n_val: int = 1024, in_dim: int = 16, classes: int = 4, batch_size: int = 128,
          seed: int | None = 0) -> Data:
    """Batches ``(x, y_reg, y_cls, x_unlabelled)``: a smooth regression target and a class
    (which of ``classes`` directions ``x`` points to most) for ``x``, and unlabelled inputs."""
    positive(n_train=n_train, n_val=n_val, in_dim=in_dim, classes=classes, batch_size=batch_size)
    seed = data_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(in_dim, 32, generator=gen) / in_dim**0.5
    b = torch.randn(32, 1, generator=gen) / 32**0.5
    c = torch.randn(in_dim, classes, generator=gen)

    def make(n: int):
        x = torch.randn(n, in_dim, generator=gen)
        x_u = torch.randn(n, in_dim, generator=gen)
        return x, torch.sin(2 * x @ a) @ b, (x @ c).argmax(dim=1), x_u

    return Data(Batches(make(n_train), batch_size, seed), Batches(make(n_val), batch_size, seed, shuffle=False))


class MultiTask(nn.Module):
    """A shared trunk and three heads: ``reg`` (1 output), ``cls`` (``classes`` logits), ``recon`` (the input)."""

    def __init__(self, in_dim: int = 16, hidden: int = 128, classes: int = 4):
        super().__init__()
        positive(in_dim=in_dim, hidden=hidden, classes=classes)
        self.trunk = nn.Sequential(nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.reg = nn.Linear(hidden, 1)
        self.cls = nn.Linear(hidden, classes)
        self.recon = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, in_dim))

    def forward(self, x):
        h = self.trunk(x)
        return self.reg(h), self.cls(h)


class MultiLossTrainer(Trainer):
    """Returns three named losses; the Trainer orders, routes and retains their backwards."""

    def training_step(self, batch):
        x, y_reg, y_cls, x_u = batch
        model = self.model
        recon = F.mse_loss(model.recon(model.trunk(x_u)), x_u)  # its own trunk pass
        out_reg, out_cls = model(x)  # one trunk pass, shared by reg and cls
        return {"recon": recon, "reg": F.mse_loss(out_reg, y_reg), "cls": F.cross_entropy(out_cls, y_cls)}

    def on_fit_end(self) -> None:
        print(f"multi_loss={self.multi_loss}, loss weights {self.loss_weights or 'none'}")
        if not self.retain_plans:
            print("  one backward per step (of the weighted sum): no graph had to be retained")
        for (kept, walked), step in self.retain_plans.items():
            how = "walked by the guard" if walked else "not walked by the guard: every backward but the last"
            print(f"  steps {how} (first: step {step}): retained the graph for {', '.join(kept) or 'none'}")
        if self.state.val_history:
            print("  validation: " + ", ".join(f"{k} {v:.4g}" for k, v in self.state.val_history[-1][1].items()))


if __name__ == "__main__":
    from safeloop.recipes import main

    main("multi_loss")
