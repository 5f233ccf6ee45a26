"""Lightning callbacks of zlightning: compression-aware training built on `zlightning.compression`,
`PipelineBubbleMonitor` / `ZeroMemoryMonitor` (the pipeline bubble, the ZeRO engine's memory, in TensorBoard), and
`RunSummary` (the end-of-fit report: final losses, throughput, logs, checkpoint; ``zlightning.models`` modules and the
``zlightning`` command add it themselves)."""

from typing import TYPE_CHECKING

from zlightning.callbacks._compression import (
    ActivationQuantization,
    ChannelPruning,
    CompressionCallback,
    HeadPruning,
    LayerReduction,
    RowPruning,
    SparsePruning,
    WeightQuantization,
)
from zlightning.callbacks._memory import ZeroMemoryMonitor
from zlightning.callbacks._pipeline import PipelineBubbleMonitor

__all__ = [
    "ActivationQuantization",
    "ChannelPruning",
    "CompressionCallback",
    "HeadPruning",
    "LayerReduction",
    "PipelineBubbleMonitor",
    "RowPruning",
    "RunSummary",
    "SparsePruning",
    "WeightQuantization",
    "ZeroMemoryMonitor",
]


if TYPE_CHECKING:  # the API reference reads this; at run time __getattr__ below resolves the name
    from zlightning._run_report import RunSummary


def __getattr__(name: str) -> object:
    """``RunSummary`` is looked up on first use: ``zlightning._run_report`` imports this package's modules."""
    if name == "RunSummary":
        from zlightning._run_report import RunSummary

        return RunSummary
    raise AttributeError(f"module 'zlightning.callbacks' has no attribute {name!r}")
