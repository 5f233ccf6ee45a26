"""Compressed twins of ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding`` and Megatron's split linears.

A twin *is* its base class (``isinstance(CompressedLinear(...), nn.Linear)``) and holds the very same ``weight`` and
``bias`` Parameter objects, so optimizers, tied weights and ``state_dict`` keys are unchanged; techniques are child
modules (``layer.sparse_pruning.mask`` in the state dict).

[Note: order inside forward]
Masks first (sparse, row, head, channel), then weight quantization, then the input's activation quantization. Masking
before quantizing means the quantizer sees the weights that are really used, zeros stay exact (both grids contain 0),
and a cleaned model holds exactly the weights the training forward used. DeepSpeed quantized first, then masked.
"""

from __future__ import annotations

from functools import cache
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from zlightning.compression._parallel import SplitKind, TensorParallel, parallel_forward
from zlightning.compression._techniques import ActivationQuantizer, Mask, ScheduledTechnique, WeightQuantizer

__all__ = [
    "COMPRESSED_TYPES",
    "CompressedConv2d",
    "CompressedEmbedding",
    "CompressedLinear",
    "CompressedParallelLinear",
    "TECHNIQUES",
    "compressed_twin",
    "plain_twin",
]

TECHNIQUES = (
    "weight_quantization",
    "activation_quantization",
    "sparse_pruning",
    "row_pruning",
    "head_pruning",
    "channel_pruning",
)
_MASKS = ("sparse_pruning", "row_pruning", "head_pruning", "channel_pruning")


class _CompressedMixin(nn.Module):
    """Technique slots and the compressed weight; see [Note: order inside forward]."""

    weight: Tensor  # the base class's; so is ``bias`` (a Tensor or None; read with getattr)
    weight_quantization: WeightQuantizer | None
    activation_quantization: ActivationQuantizer | None
    sparse_pruning: Mask | None
    row_pruning: Mask | None
    head_pruning: Mask | None
    channel_pruning: Mask | None

    def add_technique(self, name: str, technique: ScheduledTechnique, module_name: str) -> None:
        """Attaches a technique.

        Raises:
            ValueError: If the layer already has this technique (matched twice, e.g. by two callbacks).
        """
        if name not in TECHNIQUES:
            raise AssertionError(f"{name=}")
        if getattr(self, name, None) is not None:
            raise ValueError(
                f"{name}: module {module_name!r} already has {name}; a module may be selected once per technique "
                "(check for two callbacks or two init_compression calls selecting it)."
            )
        setattr(self, name, technique)

    def techniques(self) -> dict[str, ScheduledTechnique]:
        return {n: t for n in TECHNIQUES if (t := getattr(self, n, None)) is not None}

    def compressed_params(self, quantize: bool = True) -> tuple[Tensor, Tensor | None]:
        """The effective ``(weight, bias)``: active masks applied (a row/channel mask also zeroes its bias entries,
        with the same straight-through gradient to the scores), then weight quantization."""
        w, b = self.weight, getattr(self, "bias", None)
        for name in _MASKS:
            mask = getattr(self, name, None)
            if mask is None:
                continue
            w, m = mask(w)
            if m is not None and b is not None and mask.kind in ("row", "channel"):
                b = b * m.reshape(-1).to(b.dtype)
        if quantize and self.weight_quantization is not None:
            w = self.weight_quantization(w)
        return w, b

    def compressed_weight(self, quantize: bool = True) -> Tensor:
        """The effective weight (see `compressed_params`)."""
        return self.compressed_params(quantize)[0]

    def _input(self, x: Tensor) -> Tensor:
        aq = self.activation_quantization
        return x if aq is None else aq(x)


class CompressedLinear(_CompressedMixin, nn.Linear):
    """``nn.Linear`` with compression techniques."""

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.compressed_params()
        return F.linear(self._input(x), w, b)


class CompressedConv2d(_CompressedMixin, nn.Conv2d):
    """``nn.Conv2d`` with compression techniques."""

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.compressed_params()
        return self._conv_forward(self._input(x), w, b)


class CompressedEmbedding(_CompressedMixin, nn.Embedding):
    """``nn.Embedding`` with weight quantization."""

    def forward(self, idx: Tensor) -> Tensor:
        w = self.compressed_weight()
        return F.embedding(
            idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq, self.sparse
        )


class CompressedParallelLinear(_CompressedMixin):
    """Base of the compressed twins of Megatron's split linears (``mpu.ColumnParallelLinear`` /
    ``mpu.RowParallelLinear``): a twin class derives from this and from the original class, so ``isinstance`` checks
    against Megatron's class still hold. See [Note: compression under tensor parallelism] in ``_parallel.py``."""

    plain_class: ClassVar[type[nn.Module]]
    tp_kind: SplitKind
    tp_group: Any
    tp_world_size: int

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        w, b = self.compressed_params()
        return parallel_forward(self, self.tp_kind, self.tp_group, self.tp_world_size, self._input(x), w, b)


@cache
def _parallel_twin_class(cls: type[nn.Module]) -> type[CompressedParallelLinear]:
    return type(f"Compressed{cls.__name__}", (CompressedParallelLinear, cls), {"plain_class": cls})


_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: CompressedLinear,
    nn.Conv2d: CompressedConv2d,
    nn.Embedding: CompressedEmbedding,
}
COMPRESSED_TYPES = (CompressedLinear, CompressedConv2d, CompressedEmbedding, CompressedParallelLinear)


def _copy_into(cls: type[nn.Module], module: nn.Module) -> Any:
    new = cls.__new__(cls)
    new.__dict__.update({k: (v.copy() if isinstance(v, (dict, set)) else v) for k, v in module.__dict__.items()})
    return new


def compressed_twin(module: nn.Module, tp: TensorParallel | None = None) -> _CompressedMixin:
    """The compressed twin of a Linear/Conv2d/Embedding, or of a split linear of ``tp``, sharing its parameters (the
    module itself if already one)."""
    if isinstance(module, COMPRESSED_TYPES):
        return module
    kind = None if tp is None else tp.kind(module)
    if kind is not None and tp is not None:
        # a class is hashable; mypy checks type[Module] against Hashable with Module's unbound __hash__
        twin = _copy_into(_parallel_twin_class(type(module)), module)  # type: ignore[arg-type]
        twin.tp_kind, twin.tp_group, twin.tp_world_size = kind, tp.group, tp.world_size
        for name in TECHNIQUES:
            setattr(twin, name, None)
        return twin
    base = next((b for b in _TWINS if type(module) is b), None)
    if base is None:
        base = next((b for b in _TWINS if isinstance(module, b)), None)
        if base is None or type(module).forward is not base.forward:
            raise ValueError(
                f"cannot compress a {type(module).__name__}: only nn.Linear, nn.Conv2d and nn.Embedding (or subclasses "
                "that keep their forward) are supported; narrow the module regexes."
            )
    new = _copy_into(_TWINS[base], module)
    for name in TECHNIQUES:
        setattr(new, name, None)
    return new


def plain_twin(module: nn.Module) -> nn.Module:
    """The plain base module (Linear/Conv2d/Embedding, or the original split linear) sharing the parameters,
    techniques dropped."""
    if isinstance(module, CompressedParallelLinear):
        new = _copy_into(module.plain_class, module)
        for name in ("tp_kind", "tp_group", "tp_world_size"):
            new.__dict__.pop(name, None)
    else:
        new = _copy_into(next(b for b in _TWINS if isinstance(module, b)), module)
    for name in TECHNIQUES:
        new._modules.pop(name, None)
        new.__dict__.pop(name, None)
    return new
