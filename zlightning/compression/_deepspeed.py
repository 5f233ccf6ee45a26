"""DeepSpeed ``compression_training`` JSON -> `CompressionConfig`.

[Note: DeepSpeed compression keys we accept without a behaviour]
* ``quantize_weight_in_forward``: DeepSpeed's ``false`` (the default) selects "MoQ", an fp16-only mode that
  overwrites the fp16 weights in place after each optimizer step, losing the full-precision master copy. Here both
  values mean quantization-aware training in forward (the master weights stay full precision), with the bit schedule
  (``start_bits`` -> ``target_bits``, period doubling) applied to the forward's bit width. Cleaning and export bake
  the quantization in both cases (DeepSpeed baked only the ``true`` case).
* ``quantizer_kernel``, ``quantize_verbose``: kernel choice and log verbosity; no effect on results.
* ``block_pattern``, ``schedule_offset_stride``, ``excluded_modules`` (sparse pruning): read by DeepSpeed only for
  ``method: snip_momentum``, which is rejected with its own error; with ``l1``/``topk`` they had no effect there
  either, so a migrated config keeps them without error.
* Unknown keys are never ignored: every one is listed in one error (``UnknownCompressionKeysError``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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

__all__ = ["UnknownCompressionKeysError", "parse_compression_training"]


class UnknownCompressionKeysError(ValueError):
    """A ``compression_training`` config has keys zlightning does not know; all of them are listed."""


_SNIP_ONLY = {"block_pattern", "schedule_offset_stride", "excluded_modules"}
_NOOP = _SNIP_ONLY | {
    "enabled",
    "quantizer_kernel",
    "quantize_verbose",
    "quantize_weight_in_forward",
    "fp16_mixed_quantize",
}
_SHARED: dict[str, set[str]] = {
    "weight_quantization": _NOOP | {"schedule_offset", "quantize_groups", "quantization_type", "rounding"},
    "activation_quantization": {"enabled", "quantization_type", "range_calibration", "schedule_offset"},
    "sparse_pruning": {"enabled", "method", "schedule_offset", "schedule_offset_end"} | _SNIP_ONLY,
    "row_pruning": {"enabled", "method", "schedule_offset"},
    "head_pruning": {"enabled", "method", "schedule_offset", "num_heads"},
    "channel_pruning": {"enabled", "method", "schedule_offset"},
}
_PARAMS: dict[str, set[str]] = {
    "weight_quantization": {"start_bits", "target_bits", "quantization_period"},
    "activation_quantization": {"bits"},
    "sparse_pruning": {"dense_ratio"},
    "row_pruning": {"dense_ratio"},
    "head_pruning": {"dense_ratio"},
    "channel_pruning": {"dense_ratio"},
}
_REQUIRED: dict[str, tuple[str, ...]] = {
    "weight_quantization": ("start_bits", "target_bits"),
    "activation_quantization": ("bits",),
}
_LAYER_REDUCTION = {"enabled", "keep_number_layer", "module_name_prefix", "teacher_layer", "other_module_name"}
_CONFIG_TYPES: dict[str, type] = {
    "weight_quantization": WeightQuantizationConfig,
    "activation_quantization": ActivationQuantizationConfig,
    "sparse_pruning": SparsePruningConfig,
    "row_pruning": RowPruningConfig,
    "head_pruning": HeadPruningConfig,
    "channel_pruning": ChannelPruningConfig,
}


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"compression config JSON has duplicate keys {dupes}; each key may appear once per object.")
    return dict(pairs)


def _load(config: object) -> Mapping[str, Any]:
    if isinstance(config, (str, os.PathLike)):
        text = Path(config).read_text(encoding="utf-8")
        config = json.loads(text, object_pairs_hook=_reject_duplicates)
    if not isinstance(config, Mapping):
        raise ValueError(
            f"compression config must be a dict, a JSON file path or a CompressionConfig, got {type(config).__name__}."
        )
    if "compression_training" in config:  # a whole DeepSpeed config: other sections belong to the strategy
        config = config["compression_training"]
        if not isinstance(config, Mapping):
            raise ValueError("compression_training must be a JSON object.")
    return config


def _unknown(prefix: str, got: Mapping[str, Any], known: set[str], out: list[str]) -> None:
    out.extend(f"{prefix}.{k}" for k in got if k not in known)


def _tuple(value: Any) -> tuple[Any, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _group(technique: str, name: str, spec: Any, shared: Mapping[str, Any], unknown: list[str]) -> object:
    where = f"{technique}.different_groups.{name}"
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where} must be an object with 'params' and 'modules', got {spec!r}.")
    _unknown(where, spec, {"params", "modules", "related_modules"}, unknown)
    params = dict(spec.get("params", {}))
    _unknown(where + ".params", params, _PARAMS[technique], unknown)
    # DeepSpeed merges {**params, **shared}: on a clash the shared value wins.
    params.update({k: v for k, v in shared.items() if k in _PARAMS[technique]})
    missing = [k for k in _REQUIRED.get(technique, ()) if k not in params]
    if technique.endswith("pruning") and "dense_ratio" not in params:
        missing.append("dense_ratio")
    if missing:
        raise ValueError(f"{where}.params is missing required keys {missing}.")
    modules = _tuple(spec.get("modules"))
    if technique == "weight_quantization":
        return WeightQuantGroup(name=name, modules=modules, **{k: params[k] for k in params if k in _PARAMS[technique]})
    if technique == "activation_quantization":
        return ActivationQuantGroup(name=name, modules=modules, bits=params["bits"])
    related = spec.get("related_modules")
    related_t = None if related is None else tuple(_tuple(r) or () for r in related)
    return PruneGroup(name=name, modules=modules, dense_ratio=params["dense_ratio"], related_modules=related_t)


def _technique(technique: str, spec: Any, unknown: list[str]) -> object | None:
    if not isinstance(spec, Mapping):
        raise ValueError(f"compression_training.{technique} must be an object, got {spec!r}.")
    _unknown(technique, spec, {"shared_parameters", "different_groups"}, unknown)
    shared = dict(spec.get("shared_parameters", {}))
    _unknown(technique + ".shared_parameters", shared, _SHARED[technique] | _PARAMS[technique], unknown)
    if not shared.get("enabled", False):
        return None
    mixed = shared.get("fp16_mixed_quantize", {})
    if isinstance(mixed, Mapping):
        _unknown(
            technique + ".shared_parameters.fp16_mixed_quantize", mixed, {"enabled", "quantize_change_ratio"}, unknown
        )
        if mixed.get("enabled", False):
            raise ValueError(
                "weight_quantization.shared_parameters.fp16_mixed_quantize.enabled=true is not supported: "
                "quantization runs in forward with full-precision master weights, so there is no fp16 blend to do. "
                "Remove the key or set it to false."
            )
    if shared.get("method") == "snip_momentum":
        raise ValueError(
            f"{technique}: method 'snip_momentum' (neural_compressor pruners) is not supported; use 'l1' or 'topk'."
        )
    groups_spec = spec.get("different_groups")
    if not groups_spec:
        raise ValueError(
            f"{technique} is enabled but has no different_groups; add at least one group, e.g. "
            '{"g1": {"params": {...}}} (omitting "modules" selects every supported module).'
        )
    groups = tuple(_group(technique, name, g, shared, unknown) for name, g in groups_spec.items())
    kwargs = {k: v for k, v in shared.items() if k in _SHARED[technique] and k not in _NOOP}
    return _CONFIG_TYPES[technique](groups=groups, **kwargs)


def parse_compression_training(config: object) -> CompressionConfig:
    """Parses DeepSpeed's ``compression_training`` section into a `CompressionConfig`.

    Args:
        config: The section as a dict, a whole DeepSpeed config dict holding it, or a path to such a JSON file
            (duplicate JSON keys are rejected), or a `CompressionConfig` (returned as is).

    Returns:
        The typed configuration; techniques with ``enabled: false`` (or absent) are None.

    Raises:
        UnknownCompressionKeysError: Listing every unknown key (dotted paths) of the config at once.
        ValueError: For a missing required key or an invalid value (from the typed configs).
    """
    if isinstance(config, CompressionConfig):
        return config
    section = _load(config)
    unknown: list[str] = []
    _unknown("compression_training", section, set(_SHARED) | {"layer_reduction"}, unknown)
    parsed: dict[str, object] = {}
    errors: list[Exception] = []
    for technique in _SHARED:
        if technique in section:
            try:
                parsed[technique] = _technique(technique, section[technique], unknown)
            except ValueError as err:  # unknown keys first: they often explain the value errors
                errors.append(err)
    if "layer_reduction" in section:
        lr = dict(section["layer_reduction"])
        _unknown("layer_reduction", lr, _LAYER_REDUCTION, unknown)
        if lr.pop("enabled", False):
            lr = {k: (tuple(v) if isinstance(v, list) else v) for k, v in lr.items() if k in _LAYER_REDUCTION}
            parsed["layer_reduction"] = LayerReductionConfig(**lr)
    if unknown:
        raise UnknownCompressionKeysError(
            f"unknown keys in compression_training: {', '.join(unknown)}. Check the spelling against DeepSpeed's "
            "schema (zlightning.compression.CompressionConfig documents every supported key)."
        )
    if errors:
        raise errors[0]
    return CompressionConfig(**parsed)  # type: ignore[arg-type]
