"""Config schemas (Hydra ConfigStore) and ``train(cfg)``, the run a config describes.

The schemas make a typo or a wrong type fail at start-up with the key path
(``trainer.max_stepz``); ``train`` is kept apart from the ``@hydra.main`` entry
point so that tests and other programs can call it with a composed config.
"""
from __future__ import annotations

import logging
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import get_class, instantiate
from lightning_utilities.core.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from . import distributed
from .errors import ConfigError
from .trainer import Trainer

log = logging.getLogger("safeloop")
_print = rank_zero_only(print)  # one report per job under torchrun


@dataclass
class TrainerConfig:
    _target_: str = "safeloop.Trainer"  # a Trainer subclass runs from the command line
    device: str = "auto"
    precision: str = "32"
    max_steps: Optional[int] = 1000
    max_epochs: Optional[int] = None
    val_every: Optional[int] = 250
    grad_accum: int = 1
    grad_clip: Optional[float] = None
    log_every: int = 50
    multi_loss: str = "sequential"
    loss_weights: dict[str, float] = field(default_factory=dict)
    loggers: list[str] = field(default_factory=lambda: ["csv"])
    progress: bool = True


@dataclass
class GuardConfig:
    on_reuse: str = "error"
    check: str = "auto"
    trace: bool = False
    warmup: int = 10
    budget: float = 0.01


def register() -> None:
    cs = ConfigStore.instance()
    cs.store(group="trainer", name="schema", node=TrainerConfig)
    cs.store(group="guard", name="schema", node=GuardConfig)
    # Under torchrun every rank runs @hydra.main: ranks > 0 make no output directory or log file.
    sys.argv += [o for o in distributed.hydra_overrides() if o not in sys.argv]


def run_dir(cfg: DictConfig) -> Path:
    if HydraConfig.initialized():
        return Path(HydraConfig.get().runtime.output_dir)
    return Path(cfg.get("run_dir") or "safeloop_runs/latest")


def build(cfg: DictConfig) -> Trainer:
    """The Trainer a config describes (data, model, optimizer instantiated)."""
    seed = cfg.get("seed")
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
    settings: dict[str, Any] = OmegaConf.to_container(cfg.trainer, resolve=True)  # type: ignore[assignment]
    target = settings.pop("_target_")
    try:
        cls = get_class(target)
    except Exception as err:
        raise ConfigError(f"trainer._target_={target!r} cannot be imported ({err}); give the dotted path "
                          "of a safeloop.Trainer subclass, e.g. mypackage.train.MyTrainer") from None
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise ConfigError(f"trainer._target_={target!r} is not a safeloop.Trainer subclass")
    data = instantiate(cfg.data) if cfg.get("data") else None
    return cls(
        model=instantiate(cfg.model) if cfg.get("model") else None,
        train_data=getattr(data, "train", data),
        val_data=getattr(data, "val", None),
        optimizer=instantiate(cfg.optimizer) if cfg.get("optimizer") else None,
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        guard=OmegaConf.to_container(cfg.guard, resolve=True) if cfg.get("guard") else None,
        run_dir=run_dir(cfg),
        **settings,
    )


def train(cfg: DictConfig) -> Trainer:
    """Build the Trainer from ``cfg``, fit it, and report where the outputs went."""
    trainer = build(cfg)
    trainer.fit()
    history = trainer.state.val_history
    if history:
        (s0, first), (s1, last) = history[0], history[-1]
        key = next(iter(first))
        _print(f"{key}: {first[key]:.4g} at step {s0} -> {last[key]:.4g} at step {s1}")
    _print(f"outputs: {trainer.run_dir}")
    return trainer
