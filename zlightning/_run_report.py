"""What a run prints: a progress bar with correct totals, a model summary with the sharded sizes, and an end-of-fit
summary (final losses, tokens/s, log directory, checkpoint).

[Note: fixing Lightning's progress bar and summary]
Lightning 2.6's bars count ``max_steps`` as if it were a number of batches, so under ``accumulate_grad_batches=2`` a
40-step run shows ``80/40``; its rich bar prints ``Epoch 0/-2`` when only ``max_steps`` bounds the run
(``max_epochs=-1``) and the logger version as a float (``v_num: 2.000``). Its model summary prints ``Total FLOPs: 0``
for every model without an ``example_input_array`` and warns that ``bf16-mixed`` is not supported. `fixed_progress_bar`
returns the same kind of bar (rich or tqdm, same settings) without these faults, and `ModelSizeSummary` replaces the
summary; the ``zlightning`` command installs both, and ``zlightning.models`` modules return them from
``configure_callbacks`` (Lightning then uses them instead of its defaults, since they subclass them).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import (
    Callback,
    ModelSummary,
    ProgressBar,
    RichModelSummary,
    RichProgressBar,
    TQDMProgressBar,
)
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from typing_extensions import override

__all__ = ["ModelSizeSummary", "RunSummary", "fixed_progress_bar", "stock_callbacks"]


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
    """The model summary, printed once by rank 0 at the start of fit: the top-level modules and their parameter
    counts, the model size, and, under ``zstack_zero3``, what each rank holds after sharding. No FLOPs column
    (Lightning counts 0 without an ``example_input_array``), no precision warning."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        numel = _full_numel(pl_module)
        rows = [(name, type(child).__name__, _count(child, numel)) for name, child in pl_module.named_children()]
        total, trainable = _count(pl_module, numel), _count(pl_module, numel, trainable_only=True)
        width = max([len(r[0]) for r in rows] + [4])
        type_width = max([len(r[1]) for r in rows] + [4])
        lines = [f"  {'Name':<{width}}  {'Type':<{type_width}}  Params"]
        lines += [f"  {n:<{width}}  {t:<{type_width}}  {get_human_readable_count(c):>6}" for n, t, c in rows]
        first = next(iter(pl_module.parameters()), None)
        size = total * (first.element_size() if first is not None else 4)
        lines.append(
            f"  {get_human_readable_count(total)} parameters ({get_human_readable_count(trainable)} "
            f"trainable), {size / 2**20:.2f} MiB"
        )
        lines += _sharding_lines(trainer)
        print("\n".join(lines), flush=True)


def _full_numel(module: torch.nn.Module) -> Callable[[torch.nn.Parameter], int]:
    """Element count of a parameter before sharding (a sharded module's parameters are this rank's pieces)."""
    from zlightning.zero import engine_of

    engine = engine_of(module)
    if engine is None:
        return lambda p: p.numel()

    def numel(p: torch.nn.Parameter) -> int:
        try:
            return math.prod(engine.full_shape(p))
        except (KeyError, ValueError, AttributeError, RuntimeError):
            return p.numel()

    return numel


def _count(module: torch.nn.Module, numel: Callable[[torch.nn.Parameter], int], trainable_only: bool = False) -> int:
    return sum(numel(p) for p in module.parameters() if p.requires_grad or not trainable_only)


class ModelSizeSummary(_SizeSummary):
    """See `_SizeSummary`: replaces Lightning's ``ModelSummary``."""


class _RichSizeSummary(_SizeSummary, RichModelSummary):
    """See `_SizeSummary`: replaces Lightning's ``RichModelSummary`` (a subclass, so Lightning swaps it in)."""


def _sharding_lines(trainer: pl.Trainer) -> list[str]:
    strategy = trainer.strategy
    report_fn = getattr(strategy, "memory_report", None)
    if report_fn is None or getattr(strategy, "engine", None) is None:
        return []
    try:
        report = report_fn()
    except RuntimeError:
        return []
    zero = getattr(strategy, "zero", None)
    stage = getattr(zero, "stage", 3)
    offload = getattr(zero, "offload_optimizer", None)
    where = f", optimizer state offloaded ({type(offload).__name__})" if offload is not None else ""
    # every registered strategy class sets strategy_name; Lightning's Strategy base does not declare it
    name: str = strategy.strategy_name  # type: ignore[attr-defined]
    return [
        f"  {name} (ZeRO stage {stage}) over {trainer.world_size} ranks: this rank holds "
        f"{report.param_bytes / 2**20:.2f} MiB of the {report.full_model_bytes / 2**20:.2f} MiB of parameters; "
        f"gradients and optimizer state are sharded alike{where} (largest unit gathered: "
        f"{report.largest_unit_bytes / 2**20:.2f} MiB)"
    ]


class RunSummary(Callback):
    """Prints, on rank 0 at the end of ``fit``, what ``make demo`` prints: the final training and validation losses,
    the throughput (tokens/s when batches start with token ids, else samples/s; the first batch, start-up, is not
    timed), the log directory and the checkpoint to resume from or consolidate.

    Args:
        stream: where to print (standard output by default).
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self._start: float | None = None
        self._seconds = 0.0
        self._items = 0
        self._unit = "samples"

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._start is None:
            self._start = now
            return
        first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            tokens = not first.is_floating_point() and first.ndim >= 2
            self._unit = "tokens" if tokens else "samples"
            self._items += (first.numel() if tokens else first.shape[0]) * trainer.world_size
        self._seconds = now - self._start

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if _scalar(v)}
        rows: list[tuple[str, str]] = []
        for label, prefix in (("final training loss", "train"), ("final validation loss", "val")):
            key = _loss_key(metrics, prefix)
            if key is not None:
                rows.append((label, f"{metrics[key]:.4f} ({key})"))
        if self._seconds > 0 and self._items:
            rate = self._items / self._seconds
            rows.append(
                (
                    "throughput",
                    f"{rate:,.0f} {self._unit}/s over {trainer.world_size} processes "
                    f"({trainer.global_step} optimizer steps)",
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


def _loss_key(metrics: dict[str, float], prefix: str) -> str | None:
    for key in (f"{prefix}/loss", f"{prefix}_loss", f"{prefix}/loss_epoch", f"{prefix}_loss_epoch"):
        if key in metrics:
            return key
    found = sorted(k for k in metrics if k.startswith(prefix) and "loss" in k)
    return found[0] if found else None


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
