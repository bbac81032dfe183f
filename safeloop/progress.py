"""Progress: a tqdm bar on a terminal, plain log lines otherwise; log lines shown in a plain script."""
from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

log = logging.getLogger("safeloop")


class _Shown(logging.Handler):
    """safeloop's lines on stderr for a program that configured no logging (a plain script), written
    through tqdm so that they never break a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:  # the program configured logging after all: it shows them
            return
        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never stop training
            self.handleError(record)


def show_logs() -> None:
    """Without any logging configured Python shows warnings only: show safeloop's progress, validation
    and where the outputs go too (as Lightning does). Hydra's runs configure logging: nothing added."""
    if logging.getLogger().handlers or any(isinstance(h, _Shown) for h in log.handlers):
        return
    handler = _Shown()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


def outputs_line(run_dir, checkpointer, logs: bool) -> str:
    """Where a fit writes (``logs``: it has metric loggers), or that it writes nothing."""
    ckpt_dir = checkpointer.dir if checkpointer is not None else None
    if run_dir is None and ckpt_dir is None:
        return ("no run_dir: no metrics file, no checkpoints and no graph pictures are written (pass "
                "run_dir=... to keep them)")
    parts = [f"metrics to {run_dir}" if logs and run_dir is not None else None,
             f"checkpoints to {ckpt_dir}" if ckpt_dir is not None else "no checkpoints (checkpoint=False)"]
    return "writing " + "; ".join(p for p in parts if p)


def say_outputs(run_dir, checkpointer, logs: bool, said: str | None) -> str:
    """Log where a fit writes (``outputs_line``), with ``show_logs``, unless it is what was ``said`` last (a run
    trained in several fit() calls); returns the line."""
    show_logs()
    line = outputs_line(run_dir, checkpointer, logs)
    if line != said:
        log.info(line)
    return line


class Progress:
    """A line every ``log_every`` steps (``step 500/10000 loss 0.31 ... steps/s``) through the "safeloop"
    logger, or a tqdm bar in its place: ``bar`` None shows one on a terminal, False never. Nothing when not
    ``enabled`` (the ranks other than zero)."""

    def __init__(self, total: int | None, enabled: bool = True, bar: bool | None = None):
        self.enabled = enabled
        self.bar = None
        self._last = (time.perf_counter(), 0)
        self._redirect = None
        if enabled and (sys.stderr.isatty() if bar is None else bar):
            self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
            self._redirect = logging_redirect_tqdm()  # the program's console log lines, above the bar
            self._redirect.__enter__()
        self.total = total

    def start(self, step: int) -> None:
        """The steps begin at ``step`` (a later fit, a resumed run): the rate counts from here."""
        self._last = (time.perf_counter(), step)
        if self.bar is not None:
            self.bar.reset(self.total)
            self.bar.n = self.bar.last_print_n = self.bar.initial = step

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
            self._redirect.__exit__(None, None, None)
