"""Lightning callbacks of zlightning: compression-aware training built on `zlightning.compression`, and
`PipelineBubbleMonitor` / `ZeroMemoryMonitor` (the pipeline bubble, the ZeRO engine's memory, in TensorBoard)."""

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
    "SparsePruning",
    "WeightQuantization",
    "ZeroMemoryMonitor",
]
