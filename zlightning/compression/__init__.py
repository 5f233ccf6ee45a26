"""Model compression (Lightning-free core): quantization-aware training, pruning, layer reduction, cleaning, export.

The maintained home of DeepSpeed's ``init_compression`` / ``redundancy_clean`` with its ``compression_training``
config (DeepSpeed removed the library in 0.19.8). Typical use without Lightning::

    model = init_compression(model, CompressionConfig(...))     # or DeepSpeed's dict / JSON path
    optimizer = build_optimizer(model)                          # after: topk scores are parameters
    for step, batch in enumerate(loader):
        apply_schedule(model, step)                             # techniques start at their schedule_offset
        ...
    report = save_compressed(model, "model.zlc")                # cleans in place, int8/int4 codes + scales
    model = load_compressed("model.zlc", build_model())

The Lightning callbacks in ``zlightning.callbacks`` drive the same functions from ``trainer.global_step``.
"""

from zlightning.compression._api import (
    apply_schedule,
    compression_stats,
    init_compression,
    reduce_layers,
    redundancy_clean,
)
from zlightning.compression._config import (
    ActivationQuantGroup,
    ActivationQuantizationConfig,
    ChannelPruningConfig,
    CompressionConfig,
    HeadPruningConfig,
    LayerReductionConfig,
    PruneGroup,
    RowPruningConfig,
    SparsePruningConfig,
    WeightQuantGroup,
    WeightQuantizationConfig,
)
from zlightning.compression._deepspeed import UnknownCompressionKeysError
from zlightning.compression._distill import distillation_loss
from zlightning.compression._export import ExportReport, load_compressed, save_compressed
from zlightning.compression._quantize import (
    QuantizedWeight,
    dequantize_weight,
    fake_quantize,
    quantize_weight,
    scheduled_bits,
)

__all__ = [
    "ActivationQuantGroup",
    "ActivationQuantizationConfig",
    "ChannelPruningConfig",
    "CompressionConfig",
    "ExportReport",
    "HeadPruningConfig",
    "LayerReductionConfig",
    "PruneGroup",
    "RowPruningConfig",
    "SparsePruningConfig",
    "UnknownCompressionKeysError",
    "WeightQuantGroup",
    "WeightQuantizationConfig",
    "apply_schedule",
    "compression_stats",
    "QuantizedWeight",
    "dequantize_weight",
    "distillation_loss",
    "fake_quantize",
    "init_compression",
    "load_compressed",
    "quantize_weight",
    "redundancy_clean",
    "reduce_layers",
    "save_compressed",
    "scheduled_bits",
]


_RENAMED = {"quantize": "quantize_weight", "dequantize": "dequantize_weight", "QuantizedTensor": "QuantizedWeight"}


def __getattr__(name: str) -> object:
    """Old names of the weight quantizer, kept working with a warning: ``quantize``/``QuantizedTensor`` are the
    native group-size kernels' names (``zlightning.kernels``); here quantization is by number of groups."""
    if name in _RENAMED:
        import warnings

        new = _RENAMED[name]
        warnings.warn(
            f"zlightning.compression.{name} is now {new} (zlightning.kernels.{name} is the native kernel, "
            "by group size)",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    raise AttributeError(f"module 'zlightning.compression' has no attribute {name!r}")
