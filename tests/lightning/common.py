"""What the parity tests share: seeded data, a tiny seeded model, Lightning's Trainer with everything but training
turned off, safeloop's settings to match it, the base module and Trainer both sides extend, and the comparisons."""
import pytorch_lightning as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import safeloop

# Lightning's hook: safeloop's (docs/trainer.md, "Coming from Lightning")
HOOKS = {"on_fit_start": "on_fit_start", "on_train_epoch_start": "on_epoch_start",
         "on_train_batch_start": "on_step_start", "on_before_backward": "on_before_backward",
         "on_after_backward": "on_after_backward", "on_before_optimizer_step": "on_before_optimizer_step",
         "on_train_batch_end": "on_step_end", "on_train_epoch_end": "on_epoch_end",
         "on_validation_end": "on_validation_end", "on_fit_end": "on_fit_end"}


def dataset(n=14, d=6, seed=1) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=gen), torch.randn(n, 1, generator=gen))


def loader(n=14, batch=2, seed=1) -> DataLoader:
    """Passes of 7 batches by default; ``seed=2`` for validation data."""
    return DataLoader(dataset(n, seed=seed), batch_size=batch)


def net(dropout=0.0, width=8, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Dropout(dropout), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, 1))


def sgd(params, lr=0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def lightning(**kwargs) -> pl.Trainer:
    """Lightning's Trainer on the CPU, without logger, checkpoints, progress bar, summary or sanity check."""
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False, num_sanity_val_steps=0)
    return pl.Trainer(**{**quiet, **kwargs})


def settings(**kwargs) -> dict:
    """safeloop's Trainer on the CPU, without progress bar or loggers."""
    return {"progress": False, "device": "cpu", "loggers": [], **kwargs}


def mse(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


class Lit(pl.LightningModule):
    """``model`` trained on the mean squared error and validated on it (``val_loss``), optimized by
    ``configure(model)``: whatever ``configure_optimizers`` returns."""

    def __init__(self, model=None, configure=lambda model: adam(model.parameters())):
        super().__init__()
        self.model = net() if model is None else model
        self.configure = configure

    def training_step(self, batch, batch_idx):
        return mse(self.model, batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", mse(self.model, batch))

    def configure_optimizers(self):
        return self.configure(self.model)


class Port(safeloop.Trainer):
    """``Lit`` ported: ``configure`` given as a class attribute (or ``optimizer=`` to the Trainer)."""

    configure = None  # a staticmethod taking the model

    def training_step(self, batch):
        return mse(self.model, batch)

    def validation_step(self, batch):
        return mse(self.model, batch)

    def configure_optimizers(self):
        return super().configure_optimizers() if self.configure is None else self.configure(self.model)


def assert_same(lightning_model: nn.Module, safeloop_model: nn.Module) -> None:
    a, b = lightning_model.state_dict(), safeloop_model.state_dict()
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{differ} differ from Lightning's (max |diff| {max_diff(lightning_model, safeloop_model):.3g})"


def max_diff(a: nn.Module, b: nn.Module) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    return max(float((sa[k].float() - sb[k].float()).abs().max()) for k in sa)


def assert_equal_tensors(lightning_values: list, safeloop_values: list) -> None:
    assert len(lightning_values) == len(safeloop_values)
    differ = [i for i, (a, b) in enumerate(zip(lightning_values, safeloop_values)) if not torch.equal(a, b)]
    assert not differ, f"entries {differ} differ"


def close(lightning_value: float, safeloop_value: float) -> bool:
    """Validation means: Lightning's summed in float32, safeloop's in float64 (docs/trainer.md, Validation)."""
    return abs(lightning_value - safeloop_value) <= 1e-6 * abs(lightning_value)


class Noisy(Dataset):
    """A random augmentation drawn where the sample is loaded (in a DataLoader worker): ``x + 0.1 * torch.rand``."""

    def __init__(self, n=8):
        self.data = dataset(n)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return x + 0.1 * torch.rand(x.shape), y


class LitScored(Lit):
    """Validation reports ``val_loss`` and ``val_score`` (its negative, for ``mode="max"``)."""

    def validation_step(self, batch, batch_idx):
        loss = mse(self.model, batch)
        self.log("val_loss", loss)
        self.log("val_score", -loss)


class PortScored(Port):
    def validation_step(self, batch):
        loss = mse(self.model, batch)
        return {"loss": loss, "score": -loss}


def saved_and_resumed(tmp_path, at: int, lit_run, port_run) -> tuple[dict, dict]:
    """For each framework (``lit_run(**kwargs)``, ``port_run(**kwargs)``: a run, given these settings): a run that
    never stopped (``whole``), one saved at step ``at`` with ``max_steps=at`` (``first``), and one resumed from that
    file by a new Trainer (``resumed``)."""
    saver = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", every_n_train_steps=at, save_top_k=-1,
                                         filename="{step}")
    lit = {"whole": lit_run(), "first": lit_run(max_steps=at, enable_checkpointing=True, callbacks=[saver])}
    lit["resumed"] = lit_run(ckpt_path=tmp_path / "lit" / f"step={at}.ckpt")
    ours = {"whole": port_run(), "first": port_run(max_steps=at, checkpoint={"dir": str(tmp_path / "sl"), "every": at})}
    ours["resumed"] = port_run(resume=str(tmp_path / "sl" / f"step-{at:09d}.pt"))
    return lit, ours
