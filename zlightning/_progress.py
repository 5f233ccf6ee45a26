"""Plain progress lines for runs whose output goes to a file or a CI log.

[Note: progress in a log file]
Lightning's bars draw for a terminal. Redirected, its tqdm bar writes every refresh as carriage-return output that
a log keeps (341 lines for a 60-step run, the last bar's metrics wrapped), and its rich bar, the default when
``rich`` is installed, prints nothing until the bar closes, so a log shows no progress for minutes. When standard
output is not a terminal, the zlightning strategies put `LineProgress` in place of Lightning's stock bar: rank 0
prints one flushed line every N optimizer steps, about 10-20 lines per run,

    step 20/60  train_loss 2.31  1.8 it/s  eta 0:00:22

and one line per validation, test or predict run. ``ZLIGHTNING_PROGRESS_EVERY=N`` sets N; ``0`` keeps Lightning's
bar. A bar the user chose is kept: a bar class of their own, or a stock bar with settings of their own (a stock bar
with the stock settings cannot be told apart from the one Lightning adds, and is replaced);
``Trainer(enable_progress_bar=False)`` adds no bar, so none is replaced.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["PROGRESS_EVERY_ENV", "LineProgress", "loss_key", "progress_every_from_env", "stdout_is_terminal"]

PROGRESS_EVERY_ENV = "ZLIGHTNING_PROGRESS_EVERY"
_NICE_INTERVALS = (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000)
_UNKNOWN_TOTAL_EVERY = 50
_MAX_METRICS = 6


def stdout_is_terminal() -> bool:
    """Whether standard output is a terminal (False for a file, a pipe, a CI log or a closed stream)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def progress_every_from_env() -> int | None:
    """``ZLIGHTNING_PROGRESS_EVERY``: None when unset (choose from the run's length), 0 (keep Lightning's bar) or
    the interval in optimizer steps.

    Raises:
        ValueError: a value that is not an integer >= 0.
    """
    raw = os.environ.get(PROGRESS_EVERY_ENV, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(
            f"{PROGRESS_EVERY_ENV}={raw!r}: give the number of optimizer steps between two progress lines (e.g. 50), "
            "or 0 to keep Lightning's progress bar"
        )
    return int(raw)


def _auto_every(total: float) -> int:
    """About 10-20 lines for a run of ``total`` steps (a round interval); every 50 steps when unknown."""
    if not math.isfinite(total) or total <= 0:
        return _UNKNOWN_TOTAL_EVERY
    wanted = total / 20
    return next((n for n in _NICE_INTERVALS if n >= wanted), 10 ** math.ceil(math.log10(wanted)))


def loss_key(metrics: dict[str, float], prefix: str) -> str | None:
    """The logged loss of ``prefix`` ("train", "val"): ``{prefix}/loss``, ``{prefix}_loss`` (or their epoch means),
    else the first key starting with ``prefix`` that names a loss; None when none was logged."""
    for key in (f"{prefix}/loss", f"{prefix}_loss", f"{prefix}/loss_epoch", f"{prefix}_loss_epoch"):
        if key in metrics:
            return key
    found = sorted(k for k in metrics if k.startswith(prefix) and "loss" in k)
    return found[0] if found else None


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _rate(steps: int, seconds: float) -> str:
    if seconds <= 0 or steps <= 0:
        return ""
    per_second = steps / seconds
    return f"{per_second:.2f} it/s" if per_second >= 0.1 else f"{1 / per_second:.1f} s/it"


def _value(v: Any) -> str | None:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            return None
        v = v.item()
    if isinstance(v, float):
        return f"{v:.4g}"
    return None if isinstance(v, dict) else str(v)


class LineProgress(ProgressBar):
    """A progress "bar" for logs: rank 0 prints one line every ``every_n_steps`` optimizer steps (and at the last
    one) with the progress-bar metrics (the training loss when none is shown), the rate and the time left, one line
    after each validation run, and one when a validate, test or predict run ends. See [Note: progress in a log
    file].

    Args:
        every_n_steps: optimizer steps between two lines; None: about 10-20 lines per run (every 50 steps when the
            run's length is unknown).

    Raises:
        ValueError: ``every_n_steps`` below 1.
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        super().__init__()
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1
        ):
            raise ValueError(f"LineProgress(every_n_steps=...) must be None or an int >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._every = every_n_steps or _UNKNOWN_TOTAL_EVERY
        self._total: float = math.inf
        self._mark = (0.0, 0)  # (time, step) of the last line
        self._shown_step = -1

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self._trainer is not None and self._trainer.is_global_zero

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    @override
    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, **{"flush": True, **kwargs})

    def _line(self, text: str) -> None:
        if self.is_enabled:
            print(text, file=sys.stdout, flush=True)

    # ---------------------------------------------------------------- training
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._total = float(trainer.estimated_stepping_batches)
        self._every = self.every_n_steps or _auto_every(self._total)
        self._mark = (time.perf_counter(), trainer.global_step)
        self._shown_step = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step != self._shown_step and (step % self._every == 0 or step >= self._total):
            self._show_step(trainer, pl_module)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._shown_step:
            self._show_step(trainer, pl_module)

    def _show_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step, now = trainer.global_step, time.perf_counter()
        last_time, last_step = self._mark
        self._mark, self._shown_step = (now, step), step
        total = f"{int(self._total)}" if math.isfinite(self._total) else "?"
        parts = [f"step {step}/{total}"]
        parts += self._metrics(trainer, pl_module)
        rate = _rate(step - last_step, now - last_time)
        if rate:
            parts.append(rate)
            left = self._total - step
            if math.isfinite(left) and left > 0:
                parts.append(f"eta {_duration(left * (now - last_time) / (step - last_step))}")
        self._line("  ".join(parts))

    def _metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
        shown = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        if not any("loss" in k for k in shown):
            values = {k: float(v) for k, v in trainer.callback_metrics.items() if _value(v) is not None}
            key = loss_key(values, "train")
            if key is not None:
                shown = {key: values[key], **shown}
        out = [f"{k} {text}" for k, v in shown.items() if (text := _value(v)) is not None]
        return out[:_MAX_METRICS]

    # ---------------------------------------------------------------- evaluation
    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        fitting = trainer.state.fn == TrainerFn.FITTING
        label = f"validation at step {trainer.global_step}" if fitting else "validate done"
        self._evaluation_line(trainer, label, ("val",))

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._evaluation_line(trainer, "test done", ("test",))

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        batches = sum(trainer.num_predict_batches)
        self._line(f"predict done: {int(batches) if math.isfinite(batches) else '?'} batches")

    def _evaluation_line(self, trainer: pl.Trainer, label: str, prefixes: tuple[str, ...]) -> None:
        values = [
            f"{k} {text}"
            for k, v in trainer.callback_metrics.items()
            if k.startswith(prefixes) and (text := _value(v)) is not None
        ]
        self._line(f"{label}: {'  '.join(values[:_MAX_METRICS]) or 'no metrics logged'}")
