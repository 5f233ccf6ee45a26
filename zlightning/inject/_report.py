"""What ``module_inject`` did to a model, read back from the model itself (no state is kept anywhere else)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from zlightning.inject._layers import (
    ColumnParallelLinear,
    FusedNorm,
    FusedSelfAttention,
    HiddenParallelEmbedding,
    RowParallelLinear,
)
from zlightning.inject._mlp import FusedMLP
from zlightning.inject._norms import fused_norm_for, norm_candidates

__all__ = ["InjectReport", "injection_report"]


@dataclass(frozen=True)
class InjectReport:
    """The replaced modules of a model, by qualified name."""

    kernels: dict[str, str]
    """Fused replacements: ``"attention"``, ``"mlp"``, ``"gated_mlp"``, ``"layer_norm"`` or ``"rms_norm"``."""
    tensor_parallel: dict[str, str]
    """Sharded layers: ``"column"``, ``"qkv"``, ``"head"`` (gathered output), ``"row"``, ``"tied_head"`` or
    ``"embedding"`` (hidden-dim slices)."""
    unfused: dict[str, str] = field(default_factory=dict)
    """Norm-shaped modules left as they are, with why (see [Note: what counts as a norm] in ``_norms.py``)."""

    def counts(self) -> dict[str, int]:
        """How many modules of each kind (kernels and TP styles together)."""
        out: dict[str, int] = {}
        for kind in (*self.kernels.values(), *self.tensor_parallel.values()):
            out[kind] = out.get(kind, 0) + 1
        return out

    def __str__(self) -> str:
        rows = [f"{name}: {kind}" for name, kind in {**self.kernels, **self.tensor_parallel}.items()]
        rows += [f"{name}: kept ({why})" for name, why in self.unfused.items()]
        summary = ", ".join(f"{k}={v}" for k, v in sorted(self.counts().items())) or "nothing injected"
        return "\n".join([f"module_inject: {summary}", *rows])


def _kernel_kind(module: nn.Module) -> str | None:
    if isinstance(module, FusedSelfAttention):
        return "attention"
    if isinstance(module, FusedMLP):
        return "gated_mlp" if module.gate_name else "mlp"
    if isinstance(module, FusedNorm):
        return "layer_norm" if module.kind == "layer" else "rms_norm"
    return None


def _tp_kind(module: nn.Module) -> str | None:
    if isinstance(module, ColumnParallelLinear):
        return "qkv" if module.chunks == 3 else "head" if module.gather_output else "column"
    if isinstance(module, RowParallelLinear):
        return "row" if module.input_is_parallel else "tied_head"
    if isinstance(module, HiddenParallelEmbedding):
        return "embedding"
    return None


def injection_report(model: nn.Module) -> InjectReport:
    """Lists every fused kernel and tensor-parallel layer in ``model`` (after ``module_inject``), and the norm-shaped
    modules left unfused (each probed again to say whether it computes a norm)."""
    kernels: dict[str, str] = {}
    tp: dict[str, str] = {}
    for name, module in model.named_modules():
        if (kind := _kernel_kind(module)) is not None:
            kernels[name] = kind
        if (style := _tp_kind(module)) is not None:
            tp[name] = style
    unfused: dict[str, str] = {}
    for name, module, weight, bias in norm_candidates(model):
        fused = fused_norm_for(module, weight, bias, 1e-5)
        unfused[name] = (
            "matches neither LayerNorm nor RMSNorm on the probes"
            if fused is None
            else f"computes {'RMSNorm' if fused.kind == 'rms' else 'LayerNorm'}; kernel injection was off"
        )
    return InjectReport(kernels=kernels, tensor_parallel=tp, unfused=unfused)
