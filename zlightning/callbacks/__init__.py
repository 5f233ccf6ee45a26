"""Lightning callbacks of zlightning: compression-aware training built on `zlightning.compression`, and
`PipelineBubbleMonitor` (the pipeline bubble of a ``zstack_pipeline`` run in TensorBoard)."""

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
from zlightning.callbacks._pipeline import PipelineBubbleMonitor

__all__ = ["ActivationQuantization", "ChannelPruning", "CompressionCallback", "HeadPruning", "LayerReduction",
           "PipelineBubbleMonitor", "RowPruning", "SparsePruning", "WeightQuantization"]
