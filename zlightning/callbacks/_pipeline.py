"""`PipelineBubbleMonitor`: the pipeline bubble of a ``zstack_pipeline`` run as TensorBoard scalars.

[Note: simulated and measured bubble]
``pipeline/bubble_simulated`` is the schedule's idle share under unit costs (a forward 1, a backward 2;
``zlightning.pipe.timeline``): what the schedule alone costs, the same on every machine. ``pipeline/idle_fraction``
is measured on rank 0 for one batch: the time its compute actions (forward, backward, weight gradients) did not
cover between the start of the batch and the end of its last action, so it also holds communication waits and
imbalance between stages. Recording spans costs two clock reads per action; the monitor turns it on only for the
batches it logs.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from zlightning.pipe import timeline

__all__ = ["PipelineBubbleMonitor"]


class PipelineBubbleMonitor(Callback):
    """Logs ``pipeline/bubble_simulated`` and ``pipeline/idle_fraction`` (rank 0) every ``every_n_batches`` training
    batches of a ``zstack_pipeline`` run (see [Note: simulated and measured bubble]); does nothing under other
    strategies. ``self.last`` keeps the last logged values.

    Raises:
        ValueError: ``every_n_batches`` < 1.
    """

    def __init__(self, every_n_batches: int = 10) -> None:
        if isinstance(every_n_batches, bool) or not isinstance(every_n_batches, int) or every_n_batches < 1:
            raise ValueError(f"PipelineBubbleMonitor(every_n_batches=...) must be an int >= 1, got {every_n_batches!r}")
        self.every_n_batches = every_n_batches
        self.last: dict[str, float] = {}
        self._start: float | None = None
        self._simulated: dict[int, float] = {}

    @staticmethod
    def _engine(trainer: pl.Trainer) -> Any:
        from zlightning.strategies import PipelineStrategy

        strategy = trainer.strategy
        return strategy.engine if isinstance(strategy, PipelineStrategy) else None

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine(trainer)
        if engine is None or batch_idx % self.every_n_batches:
            return
        engine.timings = []
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        engine = self._engine(trainer)
        if engine is None or self._start is None or engine.timings is None:
            return
        spans, start = engine.timings, self._start
        engine.timings, self._start = None, None
        key = id(engine.train_schedule)
        if key not in self._simulated:
            self._simulated = {key: timeline(engine.train_schedule).bubble_fraction}
        busy = sum(end - begin for _, begin, end in spans)
        wall = max((end for _, _, end in spans), default=start) - start
        self.last = {
            "pipeline/bubble_simulated": self._simulated[key],
            "pipeline/idle_fraction": 1.0 - busy / wall if wall > 0 else 0.0,
        }
        pl_module.log_dict(self.last, on_step=True, on_epoch=False, rank_zero_only=True)
