"""`ZeroMemoryMonitor`: the ZeRO engine's memory report of a ``zstack_zero3`` run, logged to the trainer's logger."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

if TYPE_CHECKING:
    from zlightning.zero import MemoryReport

__all__ = ["ZeroMemoryMonitor"]


class ZeroMemoryMonitor(Callback):
    """Logs ``zstack_zero3``'s memory report (MB per rank, rank 0's values) every ``every_n_steps`` optimizer steps
    as ``memory/zero_<part>_mb`` (TensorBoard's ``memory`` section, beside ``*/rss_mb``; see [Note: TensorBoard
    sections] in ``zlightning.loggers``) and keeps the last report in ``self.last``. Under gradient accumulation it
    logs once per optimizer step, not once per micro-batch. Other strategies: it does nothing."""

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"ZeroMemoryMonitor(every_n_steps=...) must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.last: MemoryReport | None = None
        self._logged_step = -1

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        from zlightning.strategies.zero3 import ZStackZero3Strategy

        strategy = trainer.strategy
        if not isinstance(strategy, ZStackZero3Strategy) or strategy.engine is None:
            return
        step = trainer.global_step
        if step % self.every_n_steps or step == self._logged_step:
            return
        self._logged_step = step
        self.last = strategy.memory_report()
        mb = {f"memory/zero_{k}_mb": v / 2**20 for k, v in self.last.as_dict().items() if k != "full_model_bytes"}
        pl_module.log_dict(mb, rank_zero_only=True)
