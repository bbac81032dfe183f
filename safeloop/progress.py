"""Progress: a tqdm bar on a terminal, plain log lines otherwise."""
from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

log = logging.getLogger("safeloop")


class Progress:
    def __init__(self, total: int | None, enabled: bool = True, bar: bool | None = None):
        self.enabled = enabled
        self.bar = None
        self._last = (time.perf_counter(), 0)
        if enabled and (sys.stderr.isatty() if bar is None else bar):
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.total = total

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Called at log points only, so that the bar costs nothing per step."""
        if not self.enabled:
            return
        now = time.perf_counter()
        rate = (step - self._last[1]) / max(now - self._last[0], 1e-9)
        self._last = (now, step)
        shown = {k: f"{v:.4g}" for k, v in metrics.items()}
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(shown, refresh=True)
        else:
            total = f"/{self.total}" if self.total else ""
            text = " ".join(f"{k} {v}" for k, v in shown.items())
            log.info("step %d%s %s %.1f steps/s", step, total, text, rate)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
