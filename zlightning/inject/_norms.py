"""Hand-written normalisation layers, recognised by structure and behaviour (pure: probes run in eval mode under
``no_grad`` and restore the module's mode).

[Note: what counts as a norm]
A hand-written normalisation layer is recognised by what it is and does, never by its class name: a leaf module (no
children, not one of ``torch.nn``'s own classes, which already run fused ATen ops) whose only parameters are a 1-D
``weight`` whose length is a hidden size of the model (an ``in_features``/``out_features`` of a Linear or an
embedding width) and optionally a ``bias`` of the same shape. Such a candidate is fused when its output equals
``F.layer_norm`` or ``F.rms_norm`` (with its ``eps``/``variance_epsilon``/``epsilon`` attribute, else the first of
1e-5, 1e-6, 1e-8, 1e-12 that fits) on two probes: a unit-scale one and one scaled by 1e-3, on which a wrong ``eps``
shows. Candidates that match neither are kept, listed by `injection_report` under ``unfused`` and named in one
warning when kernel injection was asked for.
"""

from __future__ import annotations

import torch
from torch import nn

from zlightning.inject._layers import FusedNorm, probe_equal

__all__ = ["fused_norm_for", "hidden_sizes", "is_norm", "norm_candidates", "probe_input"]

_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon")
_EPS_GUESSES = (1e-5, 1e-6, 1e-8, 1e-12)
_TORCH_NORMS = (
    nn.LayerNorm,
    nn.RMSNorm,
    nn.GroupNorm,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LocalResponseNorm,
    FusedNorm,
)


def probe_input(width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A fixed ``[2, 5, width]`` probe (its own generator: the global RNG is never touched)."""
    gen = torch.Generator(device="cpu").manual_seed(1234)
    return torch.randn(2, 5, width, generator=gen).to(device=device, dtype=dtype)


def hidden_sizes(model: nn.Module) -> set[int]:
    sizes: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            sizes |= {module.in_features, module.out_features}
        elif isinstance(module, nn.Embedding):
            sizes.add(module.embedding_dim)
    return sizes


def norm_candidates(model: nn.Module) -> list[tuple[str, nn.Module, nn.Parameter, nn.Parameter | None]]:
    """``(name, module, weight, bias)`` of every module shaped like a hand-written norm ([Note: what counts as a
    norm]); whether it computes one is for `fused_norm_for` to say."""
    hidden = hidden_sizes(model)
    out = []
    for name, module in model.named_modules():
        if module is model or isinstance(module, FusedNorm) or type(module).__module__.startswith("torch.nn."):
            continue
        params = dict(module.named_parameters(recurse=False))
        weight, bias = params.get("weight"), params.get("bias")
        if next(module.children(), None) is not None or set(params) - {"weight", "bias"}:
            continue
        if any(True for _ in module.buffers(recurse=False)):  # FusedNorm would drop them from the state dict
            continue
        if weight is None or weight.dim() != 1 or weight.shape[0] not in hidden or weight.device.type == "meta":
            continue
        if bias is not None and bias.shape != weight.shape:
            continue
        out.append((name, module, weight, bias))
    return out


def fused_norm_for(module: nn.Module, weight: nn.Parameter, bias: nn.Parameter | None, atol: float) -> FusedNorm | None:
    """The `FusedNorm` computing what ``module`` computes on both probes, or None."""
    eps_attr = next(
        (float(getattr(module, a)) for a in _EPS_ATTRS if isinstance(getattr(module, a, None), float)), None
    )
    probe = probe_input(weight.shape[0], weight.dtype, weight.device)
    for kind in ("rms", "layer"):
        for eps in (eps_attr,) if eps_attr is not None else _EPS_GUESSES:
            cand = FusedNorm(kind, weight, bias, eps, tuple(weight.shape))
            if all(probe_equal(module, cand, x, atol) for x in (probe, probe * 1e-3)):
                return cand
    return None


def is_norm(module: nn.Module, hidden: set[int], atol: float = 1e-5) -> bool:
    """Whether ``module`` is a normalisation layer: one of torch's own, or a norm-shaped module computing LayerNorm
    or RMSNorm on the probes ([Note: what counts as a norm])."""
    if isinstance(module, _TORCH_NORMS):
        return True
    if type(module).__module__.startswith("torch.nn.") or next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight, bias = params.get("weight"), params.get("bias")
    if weight is None or set(params) - {"weight", "bias"} or weight.dim() != 1 or weight.shape[0] not in hidden:
        return False
    if weight.device.type == "meta" or (bias is not None and bias.shape != weight.shape):
        return False
    return fused_norm_for(module, weight, bias, atol) is not None
