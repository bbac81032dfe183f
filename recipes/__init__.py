"""Runnable examples, each paired with ``configs/experiment/<name>.yaml``.

``python recipes/<name>.py [overrides]`` (from a checkout) and ``python -m safeloop.recipes.<name>``
(installed: the recipes ship as ``safeloop.recipes``) run the same thing as
``python -m safeloop experiment=<name> [overrides]``.
"""
from __future__ import annotations

import sys


def main(experiment: str) -> None:
    """``python -m safeloop experiment=<experiment> [overrides]``: the same checks, messages and exit codes."""
    from safeloop.__main__ import main as cli

    if not any(arg.split("=", 1)[0].lstrip("+~") == "experiment" for arg in sys.argv[1:]):
        sys.argv.insert(1, f"experiment={experiment}")
    cli()
