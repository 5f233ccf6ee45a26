"""Shape-derived and measured cost models for the hybrid-CP scheduler, and the lockstep micro-step plan."""

from __future__ import annotations

import math

import pytest
from zlightning.datamodules.hybrid_cp import (
    LinearQuadraticCost,
    TransformerShape,
    fit_cost,
    lockstep_plan,
    quadratic_cost,
    schedule_hybrid_cp,
    schedule_stats,
    transformer_cost,
)

from examples.gpt_model import GPTConfig


def test_transformer_cost_counts_dense_and_attention_flops() -> None:
    shape = TransformerShape.of(GPTConfig(vocab_size=256, d_model=64, n_layer=2, mlp_ratio=4))
    cost = transformer_cost(shape)
    dense = 2 * (4 + 8) * 64**2 * 2 + 2 * 64 * 256  # qkv+proj (4 d^2) and MLP (8 d^2) per layer, head
    assert cost.linear == dense and cost.quadratic == 4 * 64 * 2
    assert cost(1000, 4) == pytest.approx((dense * 1000 + 4 * 64 * 2 * 1000**2) / 4)
    skip = transformer_cost(
        TransformerShape.of(GPTConfig(vocab_size=256, d_model=64, n_layer=2), attention="causal_skip")
    )
    assert skip.quadratic == cost.quadratic / 2 and skip.linear == cost.linear
    assert cost.crossover_length == pytest.approx(dense / (4 * 64 * 2))


def test_fit_cost_recovers_coefficients_and_stays_non_negative() -> None:
    truth = LinearQuadraticCost(linear=3e-6, quadratic=2e-9)
    points = [(n, c, truth(n, c)) for n in (128, 512, 2048, 4096) for c in (1, 2)]
    fitted = fit_cost(points)
    assert fitted.linear == pytest.approx(3e-6, rel=1e-6) and fitted.quadratic == pytest.approx(2e-9, rel=1e-6)
    linear_only = fit_cost([(n, 1, 1e-3 * n - (1e-9 * n * n)) for n in (10, 20, 40)])  # concave: b would be < 0
    assert linear_only.quadratic == 0.0 and linear_only.linear > 0
    with pytest.raises(ValueError, match="at least two different lengths"):
        fit_cost([(64, 1, 1.0), (64, 1, 1.1)])
    with pytest.raises(ValueError, match="measurement 0"):
        fit_cost([(0, 1, 1.0), (64, 1, 1.1)])


def test_cost_validation_messages() -> None:
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        TransformerShape(d_model=0, n_layer=1, vocab_size=2)
    with pytest.raises(ValueError, match="attention must be"):
        TransformerShape(d_model=8, n_layer=1, vocab_size=2, attention="flash")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="both 0"):
        LinearQuadraticCost(linear=0.0, quadratic=0.0)
    with pytest.raises(ValueError, match="finite number >= 0"):
        LinearQuadraticCost(linear=-1.0, quadratic=1.0)


def test_shape_cost_balances_short_documents_better_than_l2() -> None:
    """Many short documents and a few long ones: judged by the shape-derived cost (what the hardware does), the
    schedule built with it is better balanced than the one built with L**2."""
    lengths = [2048, 1536, 1024] + [64 + 37 * i % 400 for i in range(60)]
    true_cost = transformer_cost(TransformerShape(d_model=512, n_layer=4, vocab_size=256))
    with_l2 = schedule_stats(schedule_hybrid_cp(lengths, 8, 1024), lengths, true_cost)
    with_shape = schedule_stats(schedule_hybrid_cp(lengths, 8, 1024, true_cost), lengths, true_cost)
    assert with_shape.efficiency > with_l2.efficiency
    assert with_shape.efficiency > 0.95
    assert math.isclose(quadratic_cost(10, 2), 50.0)


def test_lockstep_plan_pads_each_group_to_its_longest_list() -> None:
    schedule = [[[0], [0], [1, 2], [3]], [[4, 5, 6], [7], [7], [8]]]
    assert lockstep_plan(schedule, 0, lockstep=False) == [(0, 0), (1, 4), (1, 5), (1, 6)]
    assert lockstep_plan(schedule, 0, lockstep=True) == [(0, 0), (0, None), (1, 4), (1, 5), (1, 6)]
    assert lockstep_plan(schedule, 1, lockstep=True) == [(0, 0), (0, None), (1, 7), (1, None), (1, None)]
    plans = [lockstep_plan(schedule, r, lockstep=True) for r in range(4)]
    assert len({len(p) for p in plans}) == 1  # every rank runs the same number of micro-steps
    with pytest.raises(ValueError, match="outside the schedule's 4-rank domain"):
        lockstep_plan(schedule, 4, lockstep=True)
