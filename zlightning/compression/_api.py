"""Entry points: `init_compression`, `apply_schedule`, `compression_stats`, `redundancy_clean`, `reduce_layers`.

[Note: redundancy_clean keeps outputs]
Cleaning runs in three phases so that the cleaned model computes exactly what the compressed model computed:
1. *Bake*: every compressed layer's effective weight and bias (active masks, then quantization) is computed from the
   original parameters before any is overwritten (tied weights are baked once; two layers baking a shared parameter
   differently is an error).
2. *Unwrap*: compressed twins are replaced by plain ``nn.Linear``/``nn.Conv2d``/``nn.Embedding`` holding the baked
   data; techniques (masks, scores, quantizer state) leave the ``state_dict``.
3. *Remove*: where ``related_modules`` were given, pruned rows / heads / channels are sliced out of the pruned layer
   *and* the related layers' inputs, and module attributes (``in_features``, ``out_features``, channels, BN
   ``num_features``, and the attention head count) follow. A pruned unit contributes exactly zero before removal
   (its row, bias and downstream columns are all masked or sliced together), so removal leaves the outputs unchanged
   up to float summation order. A BatchNorm2d given as a related module of channel pruning sits between the pruned
   conv and the next one: a pruned channel enters it as zeros but leaves it as ``beta - gamma * mean / std`` (non-zero
   for a pretrained network), which the next conv reads. So while the mask is active the BN's output is gated by the
   same channel mask (`_ChannelGate`, a forward hook), and the channel contributes zero, as it does once removed.
   DeepSpeed sliced the BN without gating it ("BN models change accuracy after cleaning and need fine-tuning").
Techniques whose schedule has not started are dropped with a warning: they never affected the outputs.
Split (tensor-parallel) layers are sliced shard by shard: see [Note: compression under tensor parallelism] in
``_parallel.py``.

[Note: DeepSpeed's call shapes]
`init_compression` and `redundancy_clean` take DeepSpeed's parameters in DeepSpeed's order (``model,
deepspeed_config, teacher_model=None, mpu=None`` and ``model, deepspeed_config, mpu=None``), so ported calls run
unchanged, positional or by keyword; ``deepspeed_config`` may also be a typed `CompressionConfig`, and is optional for
`redundancy_clean` (the model's techniques say what to clean; a given config only re-validates the selection, as
DeepSpeed recomputes it).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

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
from zlightning.compression._deepspeed import parse_compression_training
from zlightning.compression._modules import (
    COMPRESSED_TYPES,
    CompressedParallelLinear,
    _CompressedMixin,
    compressed_twin,
    plain_twin,
)
from zlightning.compression._parallel import SplitKind, TensorParallel, check_group_size, update_split_sizes
from zlightning.compression._select import pair_related, select_modules
from zlightning.compression._techniques import ActivationQuantizer, Mask, MaskKind, ScheduledTechnique, WeightQuantizer

__all__ = [
    "HEAD_COUNT_ATTRS",
    "StructureEdit",
    "apply_schedule",
    "compression_stats",
    "init_compression",
    "redundancy_clean",
    "reduce_layers",
]

HEAD_COUNT_ATTRS = ("n_head", "num_heads", "num_attention_heads", "n_heads")
"""Attributes of an attention module read as its head count and updated when heads are removed."""
_ALL_ON = 2**62


@dataclass(frozen=True)
class StructureEdit:
    """One physical removal: ``module``'s parameters keep ``index`` along ``dim`` (0 = out/rows, 1 = in/columns)."""

    module: str
    dim: int
    index: Tensor


_PruningConfig = SparsePruningConfig | RowPruningConfig | HeadPruningConfig | ChannelPruningConfig
_TechniqueConfig = WeightQuantizationConfig | ActivationQuantizationConfig | _PruningConfig


def _weight(module: nn.Module) -> Tensor:
    """The weight of a compressible layer or of a related one (``nn.Module`` types attributes as Tensor | Module)."""
    return cast(Tensor, module.weight)


def _root(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for key, child in parent._modules.items():
            if child is old:
                parent._modules[key] = new


def _parent(root: nn.Module, name: str) -> nn.Module:
    return root.get_submodule(name.rpartition(".")[0])


def _num_heads(root: nn.Module, name: str, cfg: HeadPruningConfig, in_features: int, tp: TensorParallel | None) -> int:
    parent = _parent(root, name)
    local = getattr(parent, "num_attention_heads_per_partition", None)
    split = tp is not None and tp.kind(root.get_submodule(name)) == "row"
    if split and not cfg.num_heads and isinstance(local, int):
        heads: int | None = local
    else:
        heads = cfg.num_heads or next(
            (getattr(parent, a) for a in HEAD_COUNT_ATTRS if isinstance(getattr(parent, a, None), int)), None
        )
        if heads is not None and split and tp is not None:
            heads = tp.local_heads(heads, name)
    if heads is None:
        raise ValueError(
            f"head_pruning: cannot tell the head count of {name!r}: set head_pruning num_heads, or give its parent "
            f"module one of the attributes {list(HEAD_COUNT_ATTRS)}."
        )
    if in_features % heads != 0:
        raise ValueError(f"head_pruning: {name!r} has in_features={in_features}, not divisible by num_heads={heads}.")
    return heads


def _build(
    root: nn.Module,
    technique: str,
    cfg: object,
    group: object,
    name: str,
    index: int | None,
    module: nn.Module,
    wq_groups: dict[int, int],
    tp: TensorParallel | None,
) -> ScheduledTechnique:
    # ``cfg`` and ``group`` are the config and group classes of ``technique`` (`CompressionConfig.techniques`)
    offset = cast(_TechniqueConfig, cfg).schedule_offset
    if technique == "weight_quantization":
        wq_cfg, wq_group = cast(WeightQuantizationConfig, cfg), cast(WeightQuantGroup, group)
        groups = module.weight.shape[0] if isinstance(module, nn.Embedding) else wq_cfg.quantize_groups
        groups = wq_groups.setdefault(id(module.weight), groups)  # tied weights: the first module's grouping
        rows = _weight(module).shape[0]
        if rows % groups != 0:
            raise ValueError(
                f"weight_quantization: quantize_groups={groups} must divide the {rows} rows of "
                f"{name!r} (groups are bands of rows)."
            )
        return WeightQuantizer(
            schedule_offset=offset,
            start_bits=wq_group.start_bits,
            target_bits=wq_group.target_bits,
            period=wq_group.quantization_period,
            scheme=wq_cfg.quantization_type,
            num_groups=groups,
            stochastic=wq_cfg.rounding == "stochastic",
        )
    if technique == "activation_quantization":
        aq_cfg, aq_group = cast(ActivationQuantizationConfig, cfg), cast(ActivationQuantGroup, group)
        return ActivationQuantizer(
            schedule_offset=offset,
            bits=aq_group.bits,
            scheme=aq_cfg.quantization_type,
            calibration=aq_cfg.range_calibration,
            per_sample=isinstance(module, nn.Conv2d),
            device=_weight(module).device,
        )
    prune_cfg, prune_group = cast(_PruningConfig, cfg), cast(PruneGroup, group)
    kind = cast(MaskKind, technique.removesuffix("_pruning"))
    related: tuple[str, ...] = ()
    if kind != "sparse" and prune_group.related_modules is not None and index is not None:
        related = pair_related(
            root,
            name,
            prune_group.related_modules[index],
            technique,
            () if tp is None else tp.split_types,
        )
    heads = _num_heads(root, name, cast(HeadPruningConfig, cfg), _weight(module).shape[1], tp) if kind == "head" else 1
    return Mask(
        kind=kind,
        method=prune_cfg.method,
        dense_ratio=float(prune_group.dense_ratio),
        schedule_offset=offset,
        weight=_weight(module),
        num_heads=heads,
        freeze_after=getattr(cfg, "schedule_offset_end", None),
        related=related,
    )


class _ChannelGate:
    """Forward hook of a BatchNorm2d related to a channel-pruned conv: zeroes the pruned channels of its output while
    the mask is active. See [Note: redundancy_clean keeps outputs]."""

    def __init__(self, mask: Mask) -> None:
        self.mask = mask

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        if not self.mask.active:
            return output
        return output * self.mask.mask.reshape(1, -1, 1, 1).to(output.dtype)


def _gate_batch_norms(root: nn.Module, mask: Mask) -> None:
    for rel in mask.related:
        module = root.get_submodule(rel)
        if isinstance(module, nn.BatchNorm2d):
            mask.__dict__.setdefault("gates", []).append(module.register_forward_hook(_ChannelGate(mask)))


def init_compression(
    model: nn.Module,
    deepspeed_config: CompressionConfig | dict | str,
    teacher_model: nn.Module | None = None,
    mpu: Any = None,
) -> nn.Module:
    """Prepares ``model`` for compression-aware training (in place) and returns it (DeepSpeed's signature; see
    [Note: DeepSpeed's call shapes]).

    Selected layers are swapped for compressed twins that share their parameters, and each gets its technique
    objects (quantizers, masks, learnable scores). Every technique starts *off*: `apply_schedule` (or the Lightning
    callbacks, from ``trainer.global_step``) switches it on at its ``schedule_offset``, so the output is bit-identical
    to the uncompressed model until then. Learnable ``topk`` scores are new parameters: build the optimizer after
    this call. Every selection is validated before the model is changed.

    Args:
        model: The model (a DDP wrapper is unwrapped).
        deepspeed_config: A `CompressionConfig`, or DeepSpeed's config dict (whole, or its ``compression_training``
            section) or JSON path.
        teacher_model: Source of the layers for ``layer_reduction`` (required when it is enabled).
        mpu: Megatron's model-parallel unit, or None. With more than one model-parallel rank its split linears become
            compressible as [Note: compression under tensor parallelism] in ``_parallel.py`` says.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: For an invalid config, regex, selection (no match, wrong type, matched twice, also across
            calls), head count, a missing teacher, or a technique a split layer cannot take.
        TypeError: If ``mpu`` lacks the model-parallel accessors.
    """
    cfg = parse_compression_training(deepspeed_config)
    tp = TensorParallel.from_mpu(mpu)
    if tp is not None:
        check_group_size(tp)
    split_types = () if tp is None else tp.split_types
    root = _root(model)
    if cfg.layer_reduction is not None:
        if teacher_model is None:
            raise ValueError("layer_reduction is enabled but no teacher_model was given to init_compression.")
        reduce_layers(root, _root(teacher_model), cfg.layer_reduction)
    plans: list[tuple[str, str, nn.Module, ScheduledTechnique]] = []
    wq_groups: dict[int, int] = {}
    for technique, tcfg in cfg.techniques().items():
        claimed: dict[str, str] = {}
        for sel in select_modules(root, technique, tcfg.groups, split_types):  # type: ignore[attr-defined]
            module = root.get_submodule(sel.name)
            if tp is not None:
                tp.check(technique, sel.name, module)
            if getattr(module, technique, None) is not None:
                raise ValueError(
                    f"{technique}: module {sel.name!r} already has {technique} (from an earlier "
                    "init_compression call or another callback); select it once."
                )
            if sel.name == "":
                raise ValueError("cannot compress the root module itself; wrap it in a container module.")
            built = _build(root, technique, tcfg, sel.group, sel.name, sel.pattern_index, module, wq_groups, tp)
            for rel in getattr(built, "related", ()):
                if rel in claimed:
                    raise ValueError(
                        f"{technique}: related module {rel!r} is paired with both {claimed[rel]!r} and "
                        f"{sel.name!r}; make the related_modules regexes select one per module."
                    )
                claimed[rel] = sel.name
            plans.append((technique, sel.name, module, built))
    for technique, name, module, built in plans:  # all validated: now change the model
        twin = root.get_submodule(name)
        if not isinstance(twin, COMPRESSED_TYPES):
            twin = compressed_twin(module, tp)
            _replace(root, module, twin)
        twin.add_technique(technique, built, name)
        if isinstance(built, Mask) and built.kind == "channel":
            _gate_batch_norms(root, built)
        if isinstance(twin, CompressedParallelLinear) and tp is not None:  # how related layers are split, for cleaning
            split = {rel: tp.kind(root.get_submodule(rel)) for rel in getattr(built, "related", ())}
            twin.__dict__.setdefault("tp_related", {}).update(split)
    return model


def apply_schedule(model: nn.Module, step: int | None) -> None:
    """Tells every technique the current optimizer step (None: all techniques on, at their target bits and
    frozen masks, e.g. for post-training compression). Call it before each training step."""
    for module in _root(model).modules():
        if isinstance(module, ScheduledTechnique):
            module.set_step(_ALL_ON if step is None else step)


def compression_stats(model: nn.Module) -> dict[str, float]:
    """Scalars for logging, from technique state only (no weight reads, so safe under ZeRO-3 outside forward):
    ``compression/<technique>/active`` (fraction of layers), ``.../bits`` (mean current bits of active weight
    quantizers), ``.../masked_fraction`` (pruned fraction of units in computed masks; for sparse pruning, the
    sparsity of the pruned weights)."""
    by: dict[str, list[ScheduledTechnique]] = {}
    for module in _root(model).modules():
        if isinstance(module, ScheduledTechnique):
            by.setdefault(module.technique, []).append(module)
    stats: dict[str, float] = {}
    for technique, items in sorted(by.items()):
        key = f"compression/{technique}"
        stats[f"{key}/active"] = sum(t.active for t in items) / len(items)
        active = [t for t in items if t.active]
        if technique == "weight_quantization" and active:
            stats[f"{key}/bits"] = sum(cast(WeightQuantizer, t).bits for t in active) / len(active)
        masks = [t for t in active if isinstance(t, Mask) and bool(t.ready)]
        if masks:
            total = sum(t.mask.numel() for t in masks)
            stats[f"{key}/masked_fraction"] = sum(float((t.mask == 0).sum()) for t in masks) / total
    return stats


def _bake(root: nn.Module) -> list[tuple[str, _CompressedMixin]]:
    compressed: list[tuple[str, _CompressedMixin]] = [
        (n, m) for n, m in root.named_modules() if isinstance(m, COMPRESSED_TYPES)
    ]
    dropped = [f"{n}.{t}" for n, m in compressed for t, obj in m.techniques().items() if not obj.active]
    if dropped:
        warnings.warn(f"redundancy_clean: dropping techniques whose schedule has not started: {dropped}", stacklevel=3)
    baked: dict[int, tuple[str, nn.Parameter, Tensor]] = {}
    for module in root.modules():  # baking (and export) round to nearest: stochastic rounding is for training only
        if isinstance(module, WeightQuantizer):
            module.stochastic = False
    with torch.no_grad():
        for name, m in compressed:
            for pname, value in zip(("weight", "bias"), m.compressed_params()):
                param = getattr(m, pname, None)
                if param is None:
                    continue
                value = cast(Tensor, value)  # None only for a missing bias, skipped above
                prev = baked.get(id(param))
                if prev is not None and not torch.equal(prev[2], value):
                    raise ValueError(
                        f"redundancy_clean: {name}.{pname} is shared with {prev[0]} but the two layers "
                        "compress it differently; compress tied weights identically."
                    )
                baked[id(param)] = (f"{name}.{pname}", param, value.detach().clone())
        for _, param, value in baked.values():
            param.data = value.to(param.dtype)
    return compressed


def _slice(module: nn.Module, dim: int, index: Tensor, names: tuple[str, ...] = ("weight", "bias")) -> None:
    for pname in names:
        t = getattr(module, pname, None)
        if t is None or (pname == "bias" and dim == 1):
            continue
        new = t.detach().index_select(0 if pname != "weight" else dim, index.to(t.device)).clone()
        if isinstance(t, nn.Parameter):
            setattr(module, pname, nn.Parameter(new, requires_grad=t.requires_grad))
        else:
            setattr(module, pname, new)
    attr = {
        (nn.Linear, 0): "out_features",
        (nn.Linear, 1): "in_features",
        (nn.Conv2d, 0): "out_channels",
        (nn.Conv2d, 1): "in_channels",
    }
    for (kind, d), name in attr.items():
        if isinstance(module, kind) and d == dim:
            setattr(module, name, int(index.numel()))


_Splits = dict[str, tuple[SplitKind | None, int]]
"""Module name -> (how it is split, model-parallel world size) for the split layers involved in cleaning."""


def _slice_split(root: nn.Module, name: str, dim: int, index: Tensor, splits: _Splits) -> None:
    module = root.get_submodule(name)
    _slice(module, dim, index)
    if name in splits:
        update_split_sizes(module, dim, int(index.numel()), splits[name][1])


def _remove_rows(root: nn.Module, name: str, mask: Mask, edits: list[StructureEdit], splits: _Splits) -> None:
    keep = mask.keep_index()
    _slice_split(root, name, 0, keep, splits)
    edits.append(StructureEdit(name, 0, keep))
    for rel in mask.related:
        module = root.get_submodule(rel)
        if isinstance(module, nn.BatchNorm2d):
            _slice(module, 0, keep, ("weight", "bias", "running_mean", "running_var"))
            module.num_features = int(keep.numel())
            edits.append(StructureEdit(rel, 0, keep))
            continue
        if _weight(module).shape[1] != mask.mask.numel():
            raise ValueError(
                f"{mask.technique}: related module {rel!r} has {_weight(module).shape[1]} inputs but "
                f"{name!r} has {mask.mask.numel()} outputs; fix the related_modules regex."
            )
        _slice_split(root, rel, 1, keep, splits)
        edits.append(StructureEdit(rel, 1, keep))


def _head_rows(rel: str, out: int, width: int, cols: Tensor, heads: Tensor, mask: Mask, split: bool) -> Tensor:
    """Rows of a related Q/K/V (or fused QKV) layer that belong to the kept heads: chunk by chunk (``[q; k; v]``,
    each ``width`` rows), or head by head for a split layer (Megatron's ``[head][q, k, v][dim]``)."""
    if split:
        if out % mask.num_heads != 0:
            raise ValueError(
                f"head_pruning: related split layer {rel!r} has {out} local outputs, not a multiple of "
                f"its {mask.num_heads} local heads."
            )
        per_head = out // mask.num_heads
        return (heads[:, None] * per_head + torch.arange(per_head)).flatten()
    if out % width != 0:
        raise ValueError(
            f"head_pruning: related module {rel!r} has {out} outputs, not a multiple of the "
            f"{width} inputs of the output projection; it must be Q, K, V or a fused QKV projection."
        )
    return torch.cat([chunk * width + cols for chunk in range(out // width)])


def _remove_heads(root: nn.Module, name: str, mask: Mask, edits: list[StructureEdit], splits: _Splits) -> None:
    heads = mask.keep_index()
    proj = root.get_submodule(name)
    width = _weight(proj).shape[1]
    head_dim = width // mask.num_heads
    cols = (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
    _slice_split(root, name, 1, cols, splits)
    edits.append(StructureEdit(name, 1, cols))
    for rel in mask.related:
        module = root.get_submodule(rel)
        rows = _head_rows(
            rel, _weight(module).shape[0], width, cols, heads, mask, splits.get(rel, (None, 1))[0] is not None
        )
        _slice_split(root, rel, 0, rows, splits)
        edits.append(StructureEdit(rel, 0, rows))
    parents = {id(p): p for p in [_parent(root, name), *(_parent(root, r) for r in mask.related)]}
    world = splits.get(name, (None, 1))[1]
    kept = int(heads.numel())
    updated = False
    for parent in parents.values():
        for attr in HEAD_COUNT_ATTRS:
            if isinstance(getattr(parent, attr, None), int):
                setattr(parent, attr, kept * world)
                updated = True
        if isinstance(getattr(parent, "all_head_size", None), int):
            cast(Any, parent).all_head_size = kept * world * head_dim  # an attention module's own attribute
        for attr, value in (
            ("num_attention_heads_per_partition", kept),
            ("hidden_size_per_partition", kept * head_dim),
        ):
            if isinstance(getattr(parent, attr, None), int):
                setattr(parent, attr, value)
                updated = True
    if not updated:
        warnings.warn(
            f"head_pruning: removed heads of {name!r} but found no head-count attribute "
            f"({list(HEAD_COUNT_ATTRS)}) on its parent; update the attention module yourself.",
            stacklevel=3,
        )


def redundancy_clean(
    model: nn.Module, deepspeed_config: CompressionConfig | dict | str | None = None, mpu: Any = None
) -> nn.Module:
    """Bakes compression into plain layers and physically removes pruned units; see [Note: redundancy_clean keeps
    outputs]. DeepSpeed's signature (see [Note: DeepSpeed's call shapes]).

    Args:
        model: A model prepared by `init_compression` (a DDP wrapper is unwrapped); changed in place.
        deepspeed_config: Optional; when given, its selections are re-validated against the model (matched-twice
            errors).
        mpu: Megatron's model-parallel unit, or None. Split layers remember their split from `init_compression`;
            a given ``mpu`` must report the same model-parallel world size.

    Returns:
        ``model``, whose outputs equal the compressed model's (up to float summation order).

    Raises:
        ValueError: For an invalid config, related modules whose shapes do not fit, tied weights compressed
            differently, or an ``mpu`` whose world size differs from the one the model was compressed under.
    """
    return _clean(model, deepspeed_config, mpu)[0]


def _splits(compressed: Sequence[tuple[str, nn.Module]], tp: TensorParallel | None) -> _Splits:
    """Split layers among the compressed twins and their related modules, as recorded by `init_compression`."""
    out: _Splits = {}
    for name, m in compressed:
        if isinstance(m, CompressedParallelLinear):
            if tp is not None and tp.world_size != m.tp_world_size:
                raise ValueError(
                    f"redundancy_clean: {name!r} was compressed over {m.tp_world_size} model-parallel "
                    f"ranks but mpu reports {tp.world_size}; pass the mpu used with init_compression."
                )
            out[name] = (m.tp_kind, m.tp_world_size)
            for rel, kind in getattr(m, "tp_related", {}).items():
                out[rel] = (kind, m.tp_world_size)
    return out


def _clean(
    model: nn.Module, config: CompressionConfig | dict | str | None, mpu: Any = None
) -> tuple[nn.Module, list[StructureEdit]]:
    root = _root(model)
    tp = TensorParallel.from_mpu(mpu)
    if config is not None:
        cfg = parse_compression_training(config)
        for technique, tcfg in cfg.techniques().items():
            select_modules(root, technique, tcfg.groups, () if tp is None else tp.split_types)  # type: ignore[attr-defined]
    compressed = _bake(root)
    splits = _splits(compressed, tp)
    structural = [
        (n, t)
        for n, m in compressed
        for t in m.techniques().values()
        if isinstance(t, Mask) and t.kind != "sparse" and t.active and t.related
    ]
    for name, m in compressed:
        for held in m.techniques().values():
            for gate in held.__dict__.pop("gates", ()):  # the BN is sliced (or the mask dropped) below
                gate.remove()
        _replace(root, m, plain_twin(m))
    edits: list[StructureEdit] = []
    for name, mask in structural:
        if mask.kind == "head":
            _remove_heads(root, name, mask, edits, splits)
        else:
            _remove_rows(root, name, mask, edits, splits)
    return model, edits


def _named(model: nn.Module, name: str, role: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as err:
        raise ValueError(
            f"layer_reduction: the {role} ({type(model).__name__}) has no module {name!r} ({err}); "
            "student and teacher must use the same module names (e.g. both LightningModules, or both "
            "plain models)."
        ) from err


def reduce_layers(student: nn.Module, teacher: nn.Module, config: LayerReductionConfig) -> None:
    """Initialises ``student`` from ``teacher``: student layer i <- teacher layer ``teacher_layer[i]`` and each
    ``other_module_name`` module whole, parameter by parameter (shapes must match).

    Raises:
        ValueError: If the layer lists or modules are missing, the student has another number of layers than
            ``teacher_layer``, or shapes differ.
    """
    s_layers = _named(student, config.module_name_prefix, "student")
    t_layers = _named(teacher, config.module_name_prefix, "teacher")
    if len(s_layers) != len(config.teacher_layer):  # type: ignore[arg-type]
        raise ValueError(
            f"layer_reduction: the student has {len(s_layers)} layers under "  # type: ignore[arg-type]
            f"{config.module_name_prefix!r} but teacher_layer lists {len(config.teacher_layer)}; build the "
            "student with keep_number_layer layers."
        )
    pairs = [(s_layers[i], t_layers[t], f"{config.module_name_prefix}.{t}") for i, t in enumerate(config.teacher_layer)]  # type: ignore[index]
    pairs += [(_named(student, n, "student"), _named(teacher, n, "teacher"), n) for n in config.other_module_name]
    with torch.no_grad():
        for s, t, where in pairs:
            s_params, t_params = list(s.parameters()), list(t.parameters())
            if [p.shape for p in s_params] != [p.shape for p in t_params]:
                raise ValueError(f"layer_reduction: student and teacher {where!r} have different parameter shapes.")
            for sp, tp in zip(s_params, t_params):
                sp.copy_(tp)
