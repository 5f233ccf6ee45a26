"""What a run prints: a progress bar with correct totals (plain lines when the output is a file), a model summary
with the full model's sizes, and an end-of-fit summary (final losses, throughput, log directory, checkpoint).

[Note: fixing Lightning's progress bar and summary]
Lightning 2.6's bars count ``max_steps`` as if it were a number of batches, so under ``accumulate_grad_batches=2`` a
40-step run shows ``80/40``; its rich bar prints ``Epoch 0/-2`` when only ``max_steps`` bounds the run
(``max_epochs=-1``) and the logger version as a float (``v_num: 2.000``). Its model summary counts this rank's
shards of a sharded model, prints ``Total FLOPs: 0`` for every model without an ``example_input_array`` and warns
that ``bf16-mixed`` is not supported. `fixed_progress_bar` returns the same kind of bar (rich or tqdm, same settings)
without these faults, `ModelSizeSummary` replaces the summary, and `RunSummary` prints the end of fit.

[Note: every run under a zlightning strategy gets the report]
The zlightning strategies call `install_run_report` in ``setup_environment``: after ``configure_callbacks`` (so the
callbacks a ``zlightning.models`` module returns are already there) and before the callbacks' ``setup`` hooks. It
swaps Lightning's stock summary for `ModelSizeSummary` (same ``max_depth``), its stock bar for the fixed bar, or for
`LineProgress` when standard output is not a terminal (see [Note: progress in a log file] in
``zlightning/_progress.py``), and adds a `RunSummary` unless one is there: the ``zlightning`` command, a
``zlightning.models`` module or the user brought it, so it prints once. Callbacks of the user's own classes are
kept, and ``enable_progress_bar=False`` / ``enable_model_summary=False`` leave nothing to swap.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    Callback,
    Checkpoint,
    ModelSummary,
    ProgressBar,
    RichModelSummary,
    RichProgressBar,
    TQDMProgressBar,
)
from typing_extensions import override

# modules, not their names: importing Lightning registers the strategies, which import this module, so either of
# these may be mid-import here
from zlightning import _model_summary, _progress

__all__ = ["ModelSizeSummary", "RunSummary", "fixed_progress_bar", "install_run_report", "stock_callbacks"]


def _batches_left(trainer: pl.Trainer) -> int | float:
    """Training batches left in this epoch: ``max_steps`` counts optimizer steps, a batch is a micro-batch."""
    if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
        remaining = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
        return min(trainer.num_training_batches, remaining)
    return trainer.num_training_batches


def _version_as_text(metrics: dict[str, Any]) -> dict[str, Any]:
    if "v_num" in metrics:
        metrics["v_num"] = str(metrics["v_num"])
    return metrics


class _RichBar(RichProgressBar):
    """``RichProgressBar`` with the fixes of [Note: fixing Lightning's progress bar and summary]."""

    @property
    @override
    def total_train_batches(self) -> int | float:
        return _batches_left(self.trainer)

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is None or self.trainer.max_epochs < 0:
            return f"Epoch {current_epoch}"
        return super()._get_train_description(current_epoch)

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        return _version_as_text(super().get_metrics(trainer, pl_module))


class _TQDMBar(TQDMProgressBar):
    """``TQDMProgressBar`` with the batch total of [Note: fixing Lightning's progress bar and summary]."""

    @property
    @override
    def total_train_batches(self) -> int | float:
        return _batches_left(self.trainer)


def fixed_progress_bar(bar: ProgressBar | None) -> ProgressBar | None:
    """The fixed counterpart of Lightning's stock bar ``bar`` (same kind, same settings); None for any other bar
    (a user's own bar is left alone) or when there is none."""
    if type(bar) is RichProgressBar:
        return _RichBar(
            refresh_rate=bar._refresh_rate, leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs
        )
    if type(bar) is TQDMProgressBar:
        return _TQDMBar(refresh_rate=bar.refresh_rate, process_position=bar.process_position, leave=bar._leave)
    return None


class _SizeSummary(ModelSummary):
    """The model summary, printed once by rank 0 at the start of fit: Lightning's table (layers, trainable,
    non-trainable and total parameters, size in MB) with the counts of the full model, and under the zlightning
    strategies a line on what each rank holds after sharding (see [Note: counting a sharded model] in
    ``zlightning/_model_summary.py``). No FLOPs column (Lightning counts 0 without an ``example_input_array``), no
    precision warning."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth:
            return
        # every rank: collective under zstack_pipeline
        table = _model_summary.summary_table(trainer, pl_module, self._max_depth)
        if trainer.is_global_zero:
            print(table.render(), flush=True)


class ModelSizeSummary(_SizeSummary):
    """See `_SizeSummary`: replaces Lightning's ``ModelSummary``."""


class _RichSizeSummary(_SizeSummary, RichModelSummary):
    """See `_SizeSummary`: replaces Lightning's ``RichModelSummary`` (a subclass, so Lightning swaps it in)."""


class RunSummary(Callback):
    """Prints, on rank 0 at the end of ``fit``, what ``make demo`` prints: the final training and validation losses
    (those the module logged), the throughput (tokens/s when batches start with token ids, else samples/s, else
    optimizer steps/s; the first batch, start-up, is not timed), the log directory and the checkpoint to resume from
    or consolidate.

    Args:
        stream: where to print (standard output by default).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._start: float | None = None
        self._start_step = 0
        self._steps = 0
        self._seconds = 0.0
        self._items = 0
        self._unit = "samples"

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start, self._start_step = now, trainer.global_step
            return
        first = _first_tensor(batch)
        if first is not None:
            tokens = not first.is_floating_point() and first.ndim >= 2
            self._unit = "tokens" if tokens else "samples"
            self._items += (first.numel() if tokens else first.shape[0]) * _replicas(trainer)
        self._steps = trainer.global_step - self._start_step
        self._seconds = now - self._start

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if _scalar(v)}
        rows: list[tuple[str, str]] = []
        for label, prefix in (("final training loss", "train"), ("final validation loss", "val")):
            key = _progress.loss_key(metrics, prefix)
            if key is not None:
                rows.append((label, f"{metrics[key]:.4f} ({key})"))
        if self._seconds > 0 and (self._items or self._steps):
            rate = f"{self._items / self._seconds:,.0f} {self._unit}/s" if self._items else ""
            rate = rate or f"{self._steps / self._seconds:,.2f} optimizer steps/s"
            rows.append(
                (
                    "throughput",
                    f"{rate} over {trainer.world_size} processes ({trainer.global_step} optimizer steps)",
                )
            )
        log_dir = getattr(trainer.logger, "log_dir", None) if trainer.logger is not None else None
        if log_dir:
            root = getattr(trainer.logger, "root_dir", None) or getattr(trainer.logger, "save_dir", None) or log_dir
            label = "TensorBoard logs" if "TensorBoard" in type(trainer.logger).__name__ else "logs"
            rows.append((label, f"{_shown(log_dir)}  (tensorboard --logdir {_shown(root)})"))
        checkpoint = getattr(trainer.checkpoint_callback, "last_model_path", "") or getattr(
            trainer.checkpoint_callback, "best_model_path", ""
        )
        if checkpoint:
            hint = f"  (zlightning consolidate {_shown(checkpoint)} model.pt)" if _is_dir(checkpoint) else ""
            rows.append(("checkpoint", f"{_shown(checkpoint)}{hint}"))
        elif trainer.checkpoint_callback is None:
            rows.append(("checkpoint", "none (checkpointing is off)"))
        if not rows:
            return
        width = max(len(label) for label, _ in rows)
        out = self.stream or sys.stdout
        print("\n" + "=" * 72, file=out)
        for label, value in rows:
            print(f"{label:<{width}} : {value}", file=out)
        print("=" * 72, file=out, flush=True)


def _scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and math.isfinite(float(value))
    return isinstance(value, (int, float)) and math.isfinite(float(value))


def _first_tensor(batch: Any) -> torch.Tensor | None:
    """The tensor that sizes a batch: its first element (``input_ids`` of a dict batch), if it has a batch dim."""
    if isinstance(batch, Mapping):
        batch = batch.get("input_ids", next(iter(batch.values()), None))
    elif isinstance(batch, (tuple, list)):
        batch = batch[0] if batch else None
    return batch if isinstance(batch, torch.Tensor) and batch.ndim >= 1 else None


def _replicas(trainer: pl.Trainer) -> int:
    """Processes that read different batches (pipeline stages and tensor-parallel peers read the same ones)."""
    try:
        kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    except (RuntimeError, ValueError):
        kwargs = {}
    return int(kwargs.get("num_replicas", trainer.world_size))


def _is_dir(path: str) -> bool:
    return os.path.isdir(path)


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies inside it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def stock_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The callbacks a run gets in place of Lightning's stock ones: the fixed progress bar (when the Trainer uses a
    stock bar), `ModelSizeSummary` (when it uses a stock summary) and `RunSummary` (when it has none). For a
    LightningModule's ``configure_callbacks``; see [Note: fixing Lightning's progress bar and summary]."""
    callbacks: list[Callback] = []
    bar = fixed_progress_bar(trainer.progress_bar_callback)
    if bar is not None:
        callbacks.append(bar)
    # set on the Trainer by Lightning's callback connector (not declared on the class)
    present: list[Callback] = trainer.callbacks  # type: ignore[attr-defined]
    for c in present:
        if type(c) is RichModelSummary:
            callbacks.append(_RichSizeSummary(max_depth=c._max_depth))
        elif type(c) is ModelSummary:
            callbacks.append(ModelSizeSummary(max_depth=c._max_depth))
    if not any(isinstance(c, RunSummary) for c in present):
        callbacks.append(RunSummary())
    return callbacks


_STOCK_BARS = (TQDMProgressBar, RichProgressBar, _TQDMBar, _RichBar)


def _has_stock_settings(bar: ProgressBar) -> bool:
    """Whether ``bar`` is one of Lightning's bars (or zlightning's fixed ones) with the settings Lightning's default
    bar has."""
    if isinstance(bar, TQDMProgressBar) and type(bar) in _STOCK_BARS:
        return _tqdm_settings(bar) == _tqdm_settings(TQDMProgressBar())
    if isinstance(bar, RichProgressBar) and type(bar) in _STOCK_BARS:
        return _rich_settings(bar) == _rich_settings(RichProgressBar())
    return False


def _tqdm_settings(bar: TQDMProgressBar) -> tuple[Any, ...]:
    return bar.refresh_rate, bar.process_position, bar._leave


def _rich_settings(bar: RichProgressBar) -> tuple[Any, ...]:
    return bar._refresh_rate, bar._leave, bar.theme, bar._console_kwargs


def _progress_for(bar: ProgressBar, every: int | None) -> ProgressBar:
    """What replaces ``bar``: see [Note: progress in a log file] in ``zlightning/_progress.py``."""
    if every != 0 and _has_stock_settings(bar) and not _progress.stdout_is_terminal():
        return _progress.LineProgress(every_n_steps=every)
    return fixed_progress_bar(bar) or bar


def install_run_report(trainer: pl.Trainer) -> None:
    """Puts the model summary of the full model, the fixed progress bar (plain lines when standard output is not a
    terminal) and the end-of-fit `RunSummary` in ``trainer``'s callbacks; see [Note: every run under a zlightning
    strategy gets the report].

    Raises:
        ValueError: ``ZLIGHTNING_PROGRESS_EVERY`` is not an integer >= 0.
    """
    if trainer.barebones:
        return
    every = _progress.progress_every_from_env()
    callbacks: list[Callback] = []
    # set on the Trainer by Lightning's callback connector (not declared on the class)
    for c in trainer.callbacks:  # type: ignore[attr-defined]
        if type(c) is RichModelSummary:
            c = _RichSizeSummary(max_depth=c._max_depth)
        elif type(c) is ModelSummary:
            c = ModelSizeSummary(max_depth=c._max_depth)
        elif isinstance(c, ProgressBar):
            c = _progress_for(c, every)
        callbacks.append(c)
    if not any(isinstance(c, RunSummary) for c in callbacks):
        at = next((i for i, c in enumerate(callbacks) if isinstance(c, Checkpoint)), len(callbacks))
        callbacks.insert(at, RunSummary())
    trainer.callbacks = callbacks  # type: ignore[attr-defined]
