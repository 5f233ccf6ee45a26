"""Configuration of ``module_inject``: the policy dataclass, the Linear styles and the error type."""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

__all__ = ["InjectError", "InjectPolicy", "LinearStyle"]


class InjectError(ValueError):
    """A model or plan that ``module_inject`` cannot shard or rewrite (names the module and the fix)."""


class LinearStyle(enum.Enum):
    """How one ``nn.Linear`` is split across the tensor-parallel group.

    Naming: "dim 0" of a Linear weight is its output features, "dim 1" its input features.
    """

    COLUMN = "column"
    """Weight (and bias) split on dim 0; input replicated, output sharded on the last dim."""
    QKV = "qkv"
    """A fused ``[q; k; v]`` projection: each of the three row blocks is split on dim 0 separately (whole heads)."""
    ROW = "row"
    """Weight split on dim 1; input sharded on the last dim, output all-reduced, bias replicated and added once."""
    HEAD = "head"
    """Untied LM head: column-parallel (vocab split) with the output all-gathered (training AutoTP behaviour)."""
    TIED_HEAD = "tied_head"
    """LM head tied to an Embedding sharded on the hidden dim: row-parallel over the hidden dim, input split locally."""
    REPLICATE = "replicate"
    """Left as it is on every rank (gradients are identical across the TP group by construction)."""


PlanStyle = Literal["column", "qkv", "row", "head", "tied_head", "replicate"]


@dataclass(frozen=True)
class InjectPolicy:
    """What ``module_inject`` does to a model.

    Raises:
        ValueError: ``tp_size`` < 1, a plan pattern that is not a valid regex, or an unknown plan style.
    """

    tp_size: int = 1
    """Tensor-parallel degree (1: no sharding, kernel injection only). Must equal the TP group's size."""
    plan: Mapping[str, PlanStyle] = field(default_factory=dict)
    """User overrides: regex (``re.fullmatch`` on the module's qualified name) -> style. First matching entry wins and
    beats the automatic classification; every entry must match at least one ``nn.Linear``."""
    inject_kernels: bool = True
    """Swap attention for ``F.scaled_dot_product_attention`` and hand-written Layer/RMS norms for the fused ATen ops
    (each swap is verified on a probe input before it is made)."""
    fuse_mlp: Literal["recompute", "save", "off"] = "recompute"
    """With ``inject_kernels``: rebuild MLPs (``Linear -> act -> Linear`` and gated ``down(act(gate(x)) * up(x))``
    modules, recognised by structure and verified on a probe) as `FusedMLP`, one autograd Function on fused ATen ops
    (see [Note: what the fused MLP fuses]). ``"recompute"`` saves only the pre-activation for backward and recomputes
    the activation (about half the MLP's activation memory, some extra elementwise work); ``"save"`` also keeps the
    activation output; ``"off"`` leaves MLPs alone."""
    causal: bool | None = None
    """Causality of the replaced attention; None: detected by the probe (tries causal, then full attention)."""
    check_inputs: bool = True
    """With ``tp_size > 1``: on the first forward, verify that every TP rank got the same inputs (a sampler sharding
    by the global rank instead of the DP rank silently trains garbage); all ranks raise together on a mismatch."""
    probe_atol: float = 1e-5
    """Absolute tolerance of the probe comparing a fused replacement with the module it replaces."""

    def __post_init__(self) -> None:
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"InjectPolicy.tp_size must be an int >= 1, got {self.tp_size!r}")
        valid = {s.value for s in LinearStyle}
        for pattern, style in self.plan.items():
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"InjectPolicy.plan: pattern {pattern!r} is not a valid regex ({err})") from err
            if style not in valid:
                raise ValueError(
                    f"InjectPolicy.plan[{pattern!r}] = {style!r} is not a style; use one of {sorted(valid)}"
                )
        if self.fuse_mlp not in ("recompute", "save", "off"):
            raise ValueError(f"InjectPolicy.fuse_mlp must be 'recompute', 'save' or 'off', got {self.fuse_mlp!r}")
        if not self.probe_atol > 0:
            raise ValueError(f"InjectPolicy.probe_atol must be > 0, got {self.probe_atol!r}")
