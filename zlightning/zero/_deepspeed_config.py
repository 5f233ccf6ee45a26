"""DeepSpeed JSON configuration -> typed zlightning configuration.

[Note: no silently ignored keys]
DeepSpeed and Lightning's DeepSpeed strategy both ignore some keys (a renamed ``aio`` key, say), which users only
discover from memory or speed. Here every key is either mapped onto the typed configuration, checked against the
Trainer (batch sizes, accumulation, clipping, precision), accepted because our design already behaves that way (listed
in ``_SATISFIED``), or reported: all unsupported keys of a config are listed in one error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zlightning.zero._config import CheckpointPolicy, MixedPrecisionPolicy, ZeroConfig
from zlightning.zero._optimizer import LossScalerConfig

__all__ = ["DeepSpeedSettings", "UnsupportedConfigError", "from_deepspeed_config"]


class UnsupportedConfigError(ValueError):
    """A DeepSpeed config uses keys (or values) that zlightning does not support; all of them are listed."""


_ZERO_KEYS = {
    "stage": "stage",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "max_live_parameters": "max_live_parameters",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
}

# Keys whose stated value our design already has: accepted only with that value.
_SATISFIED: dict[str, Any] = {
    "contiguous_gradients": None,  # any value: gradients always land in one flat buffer per group
    "reduce_scatter": True,  # gradients are always reduce-scattered
    "allgather_partitions": True,  # parameters are always all-gathered
    "allgather_bucket_size": None,  # one all-gather per group, whatever the bucket
    "elastic_checkpoint": False,
}

_TOP_NOOP = {"steps_per_print", "wall_clock_breakdown"}  # logging cadence of DeepSpeed's own engine

_FP16_KEYS = {
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "consecutive_hysteresis": "consecutive_hysteresis",
    "min_loss_scale": "min_loss_scale",
}


@dataclass(frozen=True)
class DeepSpeedSettings:
    """What a DeepSpeed config means for zlightning."""

    zero: ZeroConfig
    checkpoint: CheckpointPolicy = field(default_factory=CheckpointPolicy)
    precision: str | None = None
    """``"bf16-mixed"``/``"16-mixed"`` when the config enables bf16/fp16; None for fp32 or unspecified."""
    loss_scaler: LossScalerConfig | None = None
    gradient_clipping: float | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    train_batch_size: int | None = None


def _load(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {err}") from err
    if not isinstance(loaded, dict):
        raise ValueError(f"DeepSpeed config {path} must hold a JSON object, got {type(loaded).__name__}")
    return loaded


def from_deepspeed_config(config: str | os.PathLike[str] | Mapping[str, Any]) -> DeepSpeedSettings:
    """Maps a DeepSpeed config (dict or JSON file) onto ``ZeroConfig`` and friends.

    Raises:
        UnsupportedConfigError: listing every key or value that is not supported.
        ValueError: values out of range (from the typed configs).
    """
    cfg = _load(config)
    problems: list[str] = []
    zero_block = dict(cfg.pop("zero_optimization", {}) or {})
    zero_kwargs: dict[str, Any] = {}
    pending_offload: dict[str, dict[str, Any]] = {}
    checkpoint = CheckpointPolicy()
    for key, value in zero_block.items():
        if key in _ZERO_KEYS:
            zero_kwargs[_ZERO_KEYS[key]] = int(value) if key != "overlap_comm" else bool(value)
        elif key in ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"):
            checkpoint = CheckpointPolicy(save_full_weights=bool(value))
        elif key in _SATISFIED:
            wanted = _SATISFIED[key]
            if wanted is not None and value != wanted:
                problems.append(f"zero_optimization.{key}={value!r} (only {wanted!r} is supported)")
        elif key in ("offload_param", "offload_optimizer"):
            pending_offload[key] = dict(value or {})
        else:
            problems.append(f"zero_optimization.{key}")
    aio = dict(cfg.pop("aio", None) or {})
    zero_kwargs.update(_offload_policies(pending_offload, aio, problems))
    if zero_kwargs.get("stage", 3) == 0:
        problems.append("zero_optimization.stage=0 (use Lightning's 'ddp' strategy for plain data parallelism)")
    precision, scaler = None, None
    bf16 = cfg.pop("bf16", None) or cfg.pop("bfloat16", None) or {}
    fp16 = cfg.pop("fp16", None) or {}
    if bf16.get("enabled") and fp16.get("enabled"):
        problems.append("bf16.enabled and fp16.enabled are both true")
    if bf16.get("enabled"):
        precision = "bf16-mixed"
    for key in bf16:
        if key != "enabled":
            problems.append(f"bf16.{key}")
    if fp16.get("enabled"):
        precision = "16-mixed"
        if fp16.get("loss_scale", 0) not in (0, 0.0):
            problems.append("fp16.loss_scale (a static loss scale; only dynamic scaling, loss_scale=0, is supported)")
        scaler = LossScalerConfig(**{_FP16_KEYS[k]: v for k, v in fp16.items() if k in _FP16_KEYS})
    problems += [f"fp16.{k}" for k in fp16 if k not in _FP16_KEYS and k not in ("enabled", "loss_scale")]
    comm = cfg.pop("communication_data_type", None)
    policy = MixedPrecisionPolicy()
    if comm is not None:
        names = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
        if comm not in names:
            problems.append(f"communication_data_type={comm!r} (fp32 or bf16 gradient reduction are supported)")
        else:
            policy = MixedPrecisionPolicy(reduce_dtype=names[comm])  # type: ignore[arg-type]
    clip = cfg.pop("gradient_clipping", None)
    batch = {
        k: cfg.pop(k, None)
        for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
    }
    for key in _TOP_NOOP:
        cfg.pop(key, None)
    for key in ("optimizer", "scheduler"):
        if key in cfg:
            cfg.pop(key)
            problems.append(f"{key} (return it from LightningModule.configure_optimizers instead)")
    problems += sorted(cfg)  # everything left is unknown to us (aio, activation_checkpointing, ...)
    if problems:
        raise UnsupportedConfigError(
            "DeepSpeed config keys not supported by zlightning (remove them or use the zlightning equivalent): "
            + "; ".join(problems)
        )
    return DeepSpeedSettings(
        zero=ZeroConfig(**zero_kwargs, mixed_precision=policy),
        checkpoint=checkpoint,
        precision=precision,
        loss_scaler=scaler,
        gradient_clipping=float(clip) if clip is not None else None,
        train_micro_batch_size_per_gpu=batch["train_micro_batch_size_per_gpu"],
        gradient_accumulation_steps=batch["gradient_accumulation_steps"],
        train_batch_size=batch["train_batch_size"],
    )


_AIO_KEYS = {"block_size": "block_size", "queue_depth": "queue_depth", "intra_op_parallelism": "io_threads"}
_AIO_SATISFIED = ("single_submit", "overlap_events", "use_gds")  # our engines' own choices; no effect on results


def _offload_policies(blocks: dict[str, dict[str, Any]], aio: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """``offload_optimizer``/``offload_param`` (+ the ``aio`` block) -> ``CPUOffload``/``NVMeOffload`` kwargs."""
    from zlightning.zero._offload_config import CPUOffload, NVMeOffload

    # NVMeOffload keyword arguments named at run time (all ints)
    io: dict[str, Any] = {ours: int(aio[k]) for k, ours in _AIO_KEYS.items() if k in aio}
    for k in aio:
        if k == "thread_count":
            problems.append("aio.thread_count (renamed intra_op_parallelism in DeepSpeed, which ignores it now)")
        elif k not in _AIO_KEYS and k not in _AIO_SATISFIED:
            problems.append(f"aio.{k}")
    out: dict[str, Any] = {}
    for key, block in blocks.items():
        device = block.get("device", "none")
        ours = "offload_optimizer" if key == "offload_optimizer" else "offload_params"
        pin = bool(block.get("pin_memory", True))
        if device in (None, "none"):
            continue
        if device == "cpu" and key == "offload_optimizer":
            out[ours] = CPUOffload(pin_memory=pin)
        elif device == "nvme" and block.get("nvme_path"):
            sizes: dict[str, Any] = {"buffer_count": int(block["buffer_count"])} if "buffer_count" in block else {}
            if "buffer_size" in block:
                sizes["buffer_size"] = int(block["buffer_size"])
            out[ours] = NVMeOffload(path=block["nvme_path"], pin_memory=pin, **sizes, **io)
        elif device == "nvme":
            problems.append(f"zero_optimization.{key}.device='nvme' without nvme_path")
        else:
            problems.append(f"zero_optimization.{key}.device={device!r} (supported: 'cpu' for the optimizer, 'nvme')")
        unknown = set(block) - {
            "device",
            "nvme_path",
            "pin_memory",
            "buffer_count",
            "buffer_size",
            "pipeline_read",
            "pipeline_write",
            "pipeline",
            "fast_init",
            "max_in_cpu",
            "ratio",
        }
        problems += [f"zero_optimization.{key}.{k}" for k in sorted(unknown)]
        if float(block.get("ratio", 1.0)) != 1.0:
            problems.append(f"zero_optimization.{key}.ratio (partial offload is not supported)")
    return out
