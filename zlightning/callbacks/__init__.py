"""Lightning callbacks of zlightning: compression-aware training built on `zlightning.compression`."""

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

__all__ = ["ActivationQuantization", "ChannelPruning", "CompressionCallback", "HeadPruning", "LayerReduction",
           "RowPruning", "SparsePruning", "WeightQuantization"]
