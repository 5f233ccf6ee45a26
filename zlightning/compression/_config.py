"""Typed configuration of the compression techniques (one frozen dataclass per technique, plus its groups).

Field names follow DeepSpeed's ``compression_training`` schema so that a DeepSpeed user finds them (see
`CompressionConfig.from_deepspeed`); defaults are DeepSpeed's *code* defaults, and every field's docstring states its
default (a test checks that the two agree, fixing DeepSpeed's doc/code drift).

Vocabulary: a *technique* (weight quantization, sparse pruning, ...) has one or more *groups*; a group selects modules
by regex (``re.search`` over qualified module names; ``None`` = every module of a type the technique supports) and
carries its per-group parameters (bits, dense ratio, related modules).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "ActivationQuantizationConfig",
    "ActivationQuantGroup",
    "ChannelPruningConfig",
    "CompressionConfig",
    "HeadPruningConfig",
    "LayerReductionConfig",
    "PruneGroup",
    "RowPruningConfig",
    "SparsePruningConfig",
    "WeightQuantGroup",
    "WeightQuantizationConfig",
]

PruneMethod = Literal["l1", "topk"]
QuantScheme = Literal["symmetric", "asymmetric"]


def _check_patterns(owner: str, modules: tuple[str, ...] | None) -> None:
    if modules is None:
        return
    if isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules) or not modules:
        raise ValueError(
            f"{owner}: modules must be None (all supported modules) or a non-empty tuple of regex strings, "
            f"got {modules!r}."
        )


def _check_offset(owner: str, offset: int, end: int | None = None) -> None:
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"{owner}: schedule_offset must be an int >= 0 (an optimizer step), got {offset!r}.")
    if end is not None and (not isinstance(end, int) or end < offset):
        raise ValueError(f"{owner}: schedule_offset_end={end!r} must be an int >= schedule_offset={offset}.")


def _check_groups(owner: str, groups: tuple[object, ...], kind: type) -> None:
    if not isinstance(groups, tuple) or not groups or not all(isinstance(g, kind) for g in groups):
        raise ValueError(f"{owner}: groups must be a non-empty tuple of {kind.__name__}, got {groups!r}.")
    names = [g.name for g in groups]  # type: ignore[attr-defined]
    if len(set(names)) != len(names):
        raise ValueError(f"{owner}: group names must be unique, got {names}.")


@dataclass(frozen=True, kw_only=True)
class WeightQuantGroup:
    """One group of weight quantization: which modules and at how many bits."""

    name: str = "wq1"
    """Group name (DeepSpeed's ``different_groups`` key). Default ``"wq1"``."""
    modules: tuple[str, ...] | None = None
    """Regexes (``re.search``) over module names; None = every Linear, Conv2d and Embedding. Default None."""
    start_bits: int = 8
    """Bits when the technique starts; reduced by one bit per ``quantization_period`` (doubling). Default 8."""
    target_bits: int = 8
    """Final bits: >= 3 uniform (int), 2 ternary, 1 binary. Default 8."""
    quantization_period: int = 1
    """Optimizer steps before the first one-bit reduction; the period doubles after each. Default 1."""

    def __post_init__(self) -> None:
        owner = f"weight_quantization group {self.name!r}"
        _check_patterns(owner, self.modules)
        for name in ("start_bits", "target_bits"):
            bits = getattr(self, name)
            if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
                raise ValueError(f"{owner}: {name} must be an int in [1, 16], got {bits!r}.")
        if self.start_bits < self.target_bits:
            raise ValueError(
                f"{owner}: start_bits={self.start_bits} < target_bits={self.target_bits}; the bit schedule only goes "
                "down. Set start_bits >= target_bits (equal for a fixed width)."
            )
        if isinstance(self.quantization_period, bool) or self.quantization_period < 1:
            raise ValueError(f"{owner}: quantization_period must be an int >= 1, got {self.quantization_period!r}.")


@dataclass(frozen=True, kw_only=True)
class WeightQuantizationConfig:
    """Quantization-aware training of weights (fake quantization in forward, straight-through gradient)."""

    groups: tuple[WeightQuantGroup, ...] = (WeightQuantGroup(),)
    """The groups. Default: one group over all supported modules at 8 bits."""
    schedule_offset: int = 0
    """First optimizer step (Lightning ``global_step``) at which weights are quantized. Default 0."""
    quantization_type: QuantScheme = "symmetric"
    """``"symmetric"`` (zero maps to zero, scale per group) or ``"asymmetric"`` (scale + zero point). Default
    ``"symmetric"``. Ternary and binary are symmetric only."""
    rounding: Literal["nearest", "stochastic"] = "nearest"
    """Rounding during training; export and cleaning always round to nearest. Default ``"nearest"``."""
    quantize_groups: int = 1
    """Scale groups per Linear/Conv2d weight (the weight is split into this many equal rows of scales). Embeddings
    always use one group per token row. Default 1."""

    def __post_init__(self) -> None:
        _check_groups("weight_quantization", self.groups, WeightQuantGroup)
        _check_offset("weight_quantization", self.schedule_offset)
        if self.quantization_type not in ("symmetric", "asymmetric"):
            raise ValueError(
                f"weight_quantization: quantization_type must be 'symmetric' or 'asymmetric', "
                f"got {self.quantization_type!r}."
            )
        if self.rounding not in ("nearest", "stochastic"):
            raise ValueError(f"weight_quantization: rounding must be 'nearest' or 'stochastic', got {self.rounding!r}.")
        if (
            isinstance(self.quantize_groups, bool)
            or not isinstance(self.quantize_groups, int)
            or self.quantize_groups < 1
        ):
            raise ValueError(f"weight_quantization: quantize_groups must be an int >= 1, got {self.quantize_groups!r}.")
        low = [g.name for g in self.groups if g.target_bits <= 2]
        if low and self.quantization_type != "symmetric":
            raise ValueError(
                f"weight_quantization: groups {low} use ternary/binary (target_bits <= 2), which are symmetric only; "
                "set quantization_type='symmetric'."
            )


@dataclass(frozen=True, kw_only=True)
class ActivationQuantGroup:
    """One group of activation quantization."""

    name: str = "aq1"
    """Group name. Default ``"aq1"``."""
    modules: tuple[str, ...] | None = None
    """Regexes over module names; None = every Linear and Conv2d. Default None."""
    bits: int = 8
    """Bits of the quantized layer *input*: 4 or 8. Default 8."""

    def __post_init__(self) -> None:
        _check_patterns(f"activation_quantization group {self.name!r}", self.modules)
        if self.bits not in (4, 8):
            raise ValueError(f"activation_quantization group {self.name!r}: bits must be 4 or 8, got {self.bits!r}.")


@dataclass(frozen=True, kw_only=True)
class ActivationQuantizationConfig:
    """Fake quantization of layer inputs."""

    groups: tuple[ActivationQuantGroup, ...] = (ActivationQuantGroup(),)
    """The groups. Default: one group over all Linear/Conv2d at 8 bits."""
    schedule_offset: int = 1000
    """First optimizer step at which inputs are quantized. Default 1000."""
    quantization_type: QuantScheme = "symmetric"
    """``"symmetric"`` or ``"asymmetric"``. Default ``"symmetric"``."""
    range_calibration: Literal["dynamic", "static"] = "dynamic"
    """``"dynamic"``: range per token (Linear) or per sample (Conv2d) on every call. ``"static"``: one range, a
    moving average (momentum 0.95) updated in training and frozen in eval. Default ``"dynamic"``."""

    def __post_init__(self) -> None:
        _check_groups("activation_quantization", self.groups, ActivationQuantGroup)
        _check_offset("activation_quantization", self.schedule_offset)
        if self.quantization_type not in ("symmetric", "asymmetric"):
            raise ValueError(f"activation_quantization: bad quantization_type {self.quantization_type!r}.")
        if self.range_calibration not in ("dynamic", "static"):
            raise ValueError(
                f"activation_quantization: range_calibration must be 'dynamic' or 'static', "
                f"got {self.range_calibration!r}."
            )


@dataclass(frozen=True, kw_only=True)
class PruneGroup:
    """One group of a pruning technique: which modules, how much is kept, and which modules shrink with them."""

    name: str = "p1"
    """Group name. Default ``"p1"``."""
    modules: tuple[str, ...] | None = None
    """Regexes over module names; None = every module of a supported type. Default None."""
    dense_ratio: float = 0.5
    """Fraction *kept*: ``ceil(dense_ratio * N)`` of the N units (elements, rows, heads, channels). Default 0.5."""
    related_modules: tuple[tuple[str, ...], ...] | None = None
    """Row/head/channel pruning only: for each entry of ``modules`` (zipped), regexes of the downstream modules whose
    *input* shrinks with the pruned unit (row: next Linear's columns; head: Q/K/V rows; channel: next conv / BN).
    Each pruned module is paired with the matching related module nearest to it in the module tree (longest common
    name prefix). None: masked units are zeroed, not removed. Default None."""

    def __post_init__(self) -> None:
        owner = f"pruning group {self.name!r}"
        _check_patterns(owner, self.modules)
        if isinstance(self.dense_ratio, bool) or not 0.0 < float(self.dense_ratio) <= 1.0:
            raise ValueError(f"{owner}: dense_ratio (the fraction kept) must be in (0, 1], got {self.dense_ratio!r}.")
        if self.related_modules is not None:
            if self.modules is None or len(self.related_modules) != len(self.modules):
                raise ValueError(
                    f"{owner}: related_modules needs one inner tuple per entry of modules (zipped); got "
                    f"modules={self.modules!r} and related_modules={self.related_modules!r}."
                )
            for inner in self.related_modules:
                _check_patterns(owner + " related_modules", inner)


@dataclass(frozen=True, kw_only=True)
class SparsePruningConfig:
    """Unstructured (element-wise) pruning of weights."""

    groups: tuple[PruneGroup, ...] = (PruneGroup(name="sp1"),)
    """The groups. Default: one group over all Linear/Conv2d keeping half."""
    method: PruneMethod = "l1"
    """``"l1"``: keep the largest ``|w|`` (computed when the technique starts). ``"topk"``: learnable scores (a
    parameter per weight, initialised from ``|w|``) with a straight-through gradient. Default ``"l1"``."""
    schedule_offset: int = 1000
    """First optimizer step at which the mask applies. Default 1000."""
    schedule_offset_end: int | None = None
    """With ``topk``: the step after which the mask is frozen (scores stop changing it); the mask keeps applying.
    None: never frozen. Default None."""

    def __post_init__(self) -> None:
        _check_groups("sparse_pruning", self.groups, PruneGroup)
        _check_offset("sparse_pruning", self.schedule_offset, self.schedule_offset_end)
        if self.method not in ("l1", "topk"):
            raise ValueError(
                f"sparse_pruning: method must be 'l1' or 'topk', got {self.method!r} "
                "(snip_momentum needs neural_compressor and is not supported)."
            )


@dataclass(frozen=True, kw_only=True)
class RowPruningConfig:
    """Structured pruning of Linear output rows (neurons)."""

    groups: tuple[PruneGroup, ...] = (PruneGroup(name="rp1"),)
    """The groups. Default: one group over all Linear keeping half."""
    method: PruneMethod = "l1"
    """``"l1"`` (row L1 norm) or ``"topk"`` (learnable score per row). Default ``"l1"``."""
    schedule_offset: int = 1000
    """First optimizer step at which the mask applies. Default 1000."""

    def __post_init__(self) -> None:
        _check_groups("row_pruning", self.groups, PruneGroup)
        _check_offset("row_pruning", self.schedule_offset)
        if self.method not in ("l1", "topk"):
            raise ValueError(f"row_pruning: method must be 'l1' or 'topk', got {self.method!r}.")


@dataclass(frozen=True, kw_only=True)
class HeadPruningConfig:
    """Pruning of attention heads, selected on the attention *output* projection (its input columns per head)."""

    groups: tuple[PruneGroup, ...] = (PruneGroup(name="hp1"),)
    """The groups; ``modules`` should match the output projections (e.g. ``r"attn\\.proj$"``) and
    ``related_modules`` the Q/K/V (or fused QKV) projections. Default: one group keeping half (modules None is
    rarely what you want here)."""
    method: PruneMethod = "topk"
    """``"topk"`` (learnable score per head) or ``"l1"`` (L1 norm of each head's columns). Default ``"topk"``."""
    schedule_offset: int = 1000
    """First optimizer step at which the mask applies. Default 1000."""
    num_heads: int | None = None
    """Heads per attention layer; None: read from the parent module's ``n_head``/``num_heads``/
    ``num_attention_heads``/``n_heads`` attribute. Default None."""

    def __post_init__(self) -> None:
        _check_groups("head_pruning", self.groups, PruneGroup)
        _check_offset("head_pruning", self.schedule_offset)
        if self.method not in ("l1", "topk"):
            raise ValueError(f"head_pruning: method must be 'l1' or 'topk', got {self.method!r}.")
        if self.num_heads is not None and (isinstance(self.num_heads, bool) or self.num_heads < 1):
            raise ValueError(f"head_pruning: num_heads must be None or an int >= 1, got {self.num_heads!r}.")


@dataclass(frozen=True, kw_only=True)
class ChannelPruningConfig:
    """Pruning of Conv2d output channels."""

    groups: tuple[PruneGroup, ...] = (PruneGroup(name="cp1"),)
    """The groups. Default: one group over all Conv2d keeping half."""
    method: PruneMethod = "l1"
    """``"l1"`` (per-channel L1 norm) or ``"topk"``. Default ``"l1"``."""
    schedule_offset: int = 1000
    """First optimizer step at which the mask applies. Default 1000."""

    def __post_init__(self) -> None:
        _check_groups("channel_pruning", self.groups, PruneGroup)
        _check_offset("channel_pruning", self.schedule_offset)
        if self.method not in ("l1", "topk"):
            raise ValueError(f"channel_pruning: method must be 'l1' or 'topk', got {self.method!r}.")


@dataclass(frozen=True, kw_only=True)
class LayerReductionConfig:
    """Initialise a shallower student from chosen teacher layers (the student is built with fewer layers)."""

    module_name_prefix: str
    """Name of the layer list in both models, e.g. ``"blocks"``. Required."""
    teacher_layer: tuple[int, ...]
    """Teacher layer index copied into each student layer, in order. Required."""
    other_module_name: tuple[str, ...] = ()
    """Other modules copied whole (embeddings, final norm, head). Default ()."""
    keep_number_layer: int | None = None
    """Number of student layers; checked against ``len(teacher_layer)`` when given. Default None."""

    def __post_init__(self) -> None:
        if not self.module_name_prefix:
            raise ValueError("layer_reduction: module_name_prefix is required (e.g. 'blocks').")
        if not self.teacher_layer or not all(isinstance(i, int) and i >= 0 for i in self.teacher_layer):
            raise ValueError(f"layer_reduction: teacher_layer must be non-empty ints >= 0, got {self.teacher_layer!r}.")
        if self.keep_number_layer is not None and self.keep_number_layer != len(self.teacher_layer):
            raise ValueError(
                f"layer_reduction: keep_number_layer={self.keep_number_layer} but teacher_layer lists "
                f"{len(self.teacher_layer)} layers; they must agree."
            )


@dataclass(frozen=True, kw_only=True)
class CompressionConfig:
    """All techniques; None disables one. Build directly, or from DeepSpeed's JSON with `from_deepspeed`."""

    weight_quantization: WeightQuantizationConfig | None = None
    """Weight quantization. Default None (off)."""
    activation_quantization: ActivationQuantizationConfig | None = None
    """Activation quantization. Default None (off)."""
    sparse_pruning: SparsePruningConfig | None = None
    """Sparse pruning. Default None (off)."""
    row_pruning: RowPruningConfig | None = None
    """Row pruning. Default None (off)."""
    head_pruning: HeadPruningConfig | None = None
    """Head pruning. Default None (off)."""
    channel_pruning: ChannelPruningConfig | None = None
    """Channel pruning. Default None (off)."""
    layer_reduction: LayerReductionConfig | None = None
    """Layer reduction (needs a teacher model). Default None (off)."""

    @classmethod
    def from_deepspeed(cls, config: object) -> CompressionConfig:
        """Parses DeepSpeed's ``compression_training`` section (a dict, a whole DeepSpeed config, or a JSON path).

        Raises:
            ValueError: Listing every unknown key at once, or for invalid values.
        """
        from zlightning.compression._deepspeed import parse_compression_training

        return parse_compression_training(config)

    def techniques(self) -> dict[str, object]:
        """The enabled techniques by DeepSpeed key, in the order they are applied and cleaned."""
        names = (
            "weight_quantization",
            "sparse_pruning",
            "row_pruning",
            "head_pruning",
            "channel_pruning",
            "activation_quantization",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}
