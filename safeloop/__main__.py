"""``python -m safeloop [overrides]``: a Hydra-configured training run.

With no arguments it trains the embedded default (an MLP on seeded synthetic data).
"""
from __future__ import annotations

import hydra
from omegaconf import DictConfig

from .config import register, train

register()


@hydra.main(version_base=None, config_path="../configs", config_name="train")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
