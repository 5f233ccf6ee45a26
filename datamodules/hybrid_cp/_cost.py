"""Cost models for `schedule_hybrid_cp` derived from a transformer's shape or from measurements.

The scheduler's default cost, ``L**2 / cp`` (`quadratic_cost`), counts only attention. For a sub-sample of ``L`` tokens
run on ``c`` ranks, every rank of the block actually does

* dense work on its ``L / c`` tokens: the QKV/output projections, the MLP and the LM head, about
  ``2 * (4 + 2 * mlp_ratio) * d_model**2 * n_layer + 2 * d_model * vocab_size`` FLOPs per token forward;
* attention of its ``L / c`` queries over the sub-sample's keys: ``4 * d_model * n_layer`` FLOPs per (query, key)
  pair forward (scores and weighted sum), over ``L`` keys when the masked half is computed (the reference
  `cp_causal_attention`, plain SDPA with a mask) or about ``L / 2`` keys when the kernel skips masked blocks
  (flash attention, ring attention).

so ``cost(L, c) = (L / c) * (dense + attention_per_key * keys(L))``: linear in ``L`` below a crossover length of about
``dense / attention_per_key`` tokens (``6 * d_model`` for the example GPT without the head) and quadratic above.
Backward is about twice the forward for both parts, so it does not change the ratio and is left out.

[Note: why the shape matters for balance]
Under ``L**2`` a 256-token document costs 1/256 of a 4096-token one; on a model with ``d_model = 256`` it really
costs about 1/12 (dense work dominates below about 1.5k tokens). A scheduler that believes the ``L**2`` model piles
many short documents onto one rank "for free" and that rank becomes the straggler every other rank waits for at the
group barrier. `transformer_cost` gives the scheduler the real ratio; `fit_cost` gets it from timings when the
FLOP count is not the whole story (memory-bound kernels, communication).

Only the standard library is imported; costs are plain callables ``(length, cp) -> float`` (``CostFn`` of ``hybrid_cp_schedule``), deterministic
so that every rank computes the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

__all__ = ["LinearQuadraticCost", "TransformerShape", "fit_cost", "transformer_cost"]


class _ShapeLike(Protocol):
    d_model: int
    n_layer: int
    vocab_size: int


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The sizes of a decoder-only transformer that decide its per-token costs.

    Raises:
        ValueError: If a size is not a positive int or ``attention`` is unknown.
    """

    d_model: int
    """Width of the residual stream."""
    n_layer: int
    """Transformer blocks."""
    vocab_size: int
    """Output vocabulary (the LM head's width)."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``d_model``."""
    attention: Literal["masked", "causal_skip"] = "masked"
    """``"masked"``: the kernel computes every (query, key) score and masks half (`cp_causal_attention`, SDPA with a
    mask); ``"causal_skip"``: it skips masked blocks (flash/ring attention), half the pairs."""

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layer", "vocab_size", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerShape: {name} must be a positive int, got {value!r}.")
        if self.attention not in ("masked", "causal_skip"):
            raise ValueError(f"TransformerShape: attention must be 'masked' or 'causal_skip', got {self.attention!r}.")

    @classmethod
    def of(cls, config: _ShapeLike, **overrides: object) -> TransformerShape:
        """The shape of a model config with ``d_model``, ``n_layer``, ``vocab_size`` (and optionally ``mlp_ratio``),
        such as ``examples.gpt_model.GPTConfig``."""
        fields = {
            "d_model": config.d_model,
            "n_layer": config.n_layer,
            "vocab_size": config.vocab_size,
            "mlp_ratio": getattr(config, "mlp_ratio", 4),
        }
        return cls(**{**fields, **overrides})  # type: ignore[arg-type]

    @property
    def dense_flops_per_token(self) -> float:
        """Forward FLOPs of the projections, MLP and head for one token."""
        per_layer = 2 * (4 + 2 * self.mlp_ratio) * self.d_model**2
        return float(per_layer * self.n_layer + 2 * self.d_model * self.vocab_size)

    @property
    def attention_flops_per_pair(self) -> float:
        """Forward FLOPs of one (query, key) pair over all layers (score and weighted sum)."""
        return float(4 * self.d_model * self.n_layer)


@dataclass(frozen=True)
class LinearQuadraticCost:
    """``cost(L, c) = (linear * L + quadratic * L**2) / c``: a picklable `CostFn`.

    Raises:
        ValueError: If a coefficient is negative or not finite, or both are zero.
    """

    linear: float
    """Per-token cost (dense layers)."""
    quadratic: float
    """Per-(token, key) cost (attention)."""

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"LinearQuadraticCost: {name} must be a finite number >= 0, got {value!r}.")
        if self.linear == 0 and self.quadratic == 0:
            raise ValueError("LinearQuadraticCost: linear and quadratic are both 0; every schedule would cost 0.")

    def __call__(self, length: int, cp: int) -> float:
        return (self.linear * length + self.quadratic * length * length) / cp

    @property
    def crossover_length(self) -> float:
        """Length at which attention costs as much as the dense layers (``inf`` without attention cost)."""
        return math.inf if self.quadratic == 0 else self.linear / self.quadratic


def transformer_cost(shape: TransformerShape) -> LinearQuadraticCost:
    """Per-rank forward FLOPs of a sub-sample, as a `CostFn` for `schedule_hybrid_cp`. See the module docs.

    Args:
        shape: The model's `TransformerShape` (e.g. ``TransformerShape.of(gpt.config)``).

    Returns:
        ``(L / c) * (dense + pair * keys(L))`` with ``keys(L) = L`` (masked) or ``L / 2`` (causal_skip).
    """
    pair = shape.attention_flops_per_pair * (1.0 if shape.attention == "masked" else 0.5)
    return LinearQuadraticCost(linear=shape.dense_flops_per_token, quadratic=pair)


def fit_cost(measurements: Sequence[tuple[int, int, float]]) -> LinearQuadraticCost:
    """Fits ``(a * L + b * L**2) / c`` to measured per-rank times by least squares (``a, b >= 0``).

    Args:
        measurements: ``(length, cp, seconds)`` triples: the time one rank spent on its share of a sub-sample of
            ``length`` tokens run at CP size ``cp``. At least two distinct lengths.

    Returns:
        The fitted cost (in seconds).

    Raises:
        ValueError: With fewer than two distinct lengths, or a non-positive length/cp or negative time.
    """
    rows = []
    for i, (length, cp, seconds) in enumerate(measurements):
        if length < 1 or cp < 1 or not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"fit_cost: measurement {i} = {(length, cp, seconds)} needs length >= 1, cp >= 1 and a "
                f"finite time >= 0."
            )
        rows.append((length / cp, length * length / cp, seconds))
    if len({x for x, _, _ in rows}) < 2:
        raise ValueError(
            "fit_cost: need measurements of at least two different lengths to separate the linear and quadratic terms."
        )
    sxx = sum(x * x for x, _, _ in rows)
    sxy = sum(x * y for x, y, _ in rows)
    syy = sum(y * y for _, y, _ in rows)
    sxt = sum(x * t for x, _, t in rows)
    syt = sum(y * t for _, y, t in rows)
    det = sxx * syy - sxy * sxy
    a = (sxt * syy - syt * sxy) / det if det > 0 else 0.0
    b = (syt * sxx - sxt * sxy) / det if det > 0 else 0.0
    if a < 0 or b < 0:  # the unconstrained optimum leaves the feasible set: best one-term fit instead
        a, b = max(sxt / sxx, 0.0), 0.0
        b_only = max(syt / syy, 0.0)
        if _sse(rows, 0.0, b_only) < _sse(rows, a, 0.0):
            a, b = 0.0, b_only
    return LinearQuadraticCost(linear=a, quadratic=b)


def _sse(rows: list[tuple[float, float, float]], a: float, b: float) -> float:
    return sum((a * x + b * y - t) ** 2 for x, y, t in rows)
