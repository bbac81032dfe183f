"""What the ``deterministic``, ``compile`` and ``profile`` settings do while ``fit`` runs (``during_fit``)."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .errors import ConfigError
from .settings import Settings

log = logging.getLogger("safeloop")


@contextmanager
def during_fit(settings: Settings, model: torch.nn.Module | None, run_dir: Path | None,
               rank: int = 0) -> Iterator[Callable[[], None]]:
    """Deterministic algorithms on (as they were again afterwards), the model compiled, the profiler running;
    yields what to call after each training step. Refused inside ``torch.autocast``: autocast keeps its copy of
    each weight until its outermost region exits, so every step would compute with the first one's weights."""
    outer = [device for device in ("cpu", "cuda") if torch.is_autocast_enabled(device)]
    if outer:
        raise ConfigError(f"fit() is called inside torch.autocast({outer[0]!r}): autocast keeps its low-precision "
                          "copy of each weight until its outermost region exits, so every step would compute with "
                          "the first step's weights; call fit() outside it and set precision='bf16-mixed' (or "
                          "'16-mixed'): the Trainer opens a region around each step")
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if settings.deterministic:
        # cuBLAS reads it when it starts; without it deterministic algorithms refuse CUDA matrix products
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    if settings.compile and model is not None and getattr(model, "_compiled_call_impl", None) is None:
        model.compile()  # in place: the module, its state dict and checkpoints stay the user's
    try:
        with profiling(settings.profile, run_dir, rank) as step:
            yield step
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@contextmanager
def profiling(profile: int | dict | None, run_dir: Path | None, rank: int = 0) -> Iterator[Callable[[], None]]:
    """``torch.profiler`` over the steps ``profile`` says (N: one warm-up step, then N traced; or
    ``torch.profiler.schedule``'s ``wait``, ``warmup``, ``active``), its Chrome trace written to
    ``run_dir/trace.json`` (``trace-rankR.json`` for rank R > 0 under torchrun); yields its ``step``."""
    if profile is None:
        yield lambda: None
        return
    if run_dir is None:
        raise ConfigError(f"profile={profile!r} writes its trace to the run directory: pass run_dir=... (the "
                          "command line has one)")
    when = {"warmup": 1, "active": profile} if isinstance(profile, int) else dict(profile)
    path = Path(run_dir) / (f"trace-rank{rank}.json" if rank else "trace.json")
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(path))
        log.info("profile of %d steps written to %s", when["active"], path)

    with torch.profiler.profile(schedule=torch.profiler.schedule(**{"wait": 0, "warmup": 0, **when}, repeat=1),
                                on_trace_ready=write) as prof:
        yield prof.step
