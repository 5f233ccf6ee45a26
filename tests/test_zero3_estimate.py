"""The memory estimator agrees with the memory report of a real run (within 2%)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig, estimate_zero_memory


def _report(rank: int, world: int, stage: int) -> Any:
    model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters()), config=ZeroConfig(stage=stage))
    zero.backward(gpt_loss(model, batches(1, 2 * world, vocab=128)[0].chunk(world)[rank]))
    zero.step()
    return zero.memory_report()


@pytest.mark.parametrize("stage", [3, 2])
def test_estimate_matches_report(stage: int) -> None:
    world = 2
    report = run_distributed(_report, world, stage, timeout=120)[0]
    with torch.device("meta"):
        model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    est = estimate_zero_memory(world_size=world, module=model, stage=stage)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "persistent_bytes"):
        actual = getattr(report, key)
        assert abs(getattr(est, key) - actual) <= 0.02 * max(actual, 1) + 64 * 4, (key, getattr(est, key), actual)
    assert abs(est.model_state_bytes - report.model_state_bytes) <= 0.02 * report.model_state_bytes
    assert est.largest_unit_bytes == report.largest_unit_bytes or stage < 3
    big = estimate_zero_memory(world_size=8, num_params=7_000_000_000, precision="bf16-mixed")
    assert big.param_bytes == 4 * 875_000_000 and big.optimizer_bytes == 8 * 875_000_000


def test_estimate_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        estimate_zero_memory(world_size=2)
    with pytest.raises(ValueError, match="precision"):
        estimate_zero_memory(world_size=2, num_params=10, precision="64-true")
