"""Bad knob values and misuse raise clear errors naming the knob (single process, no collectives)."""

from __future__ import annotations

import pytest
import torch
from zlightning.strategies import ZeroPrecision, ZStackZero3Strategy

import zlightning  # noqa: F401
from zlightning.zero import LossScalerConfig, MixedPrecisionPolicy, ZeroConfig, zero3_shard


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefetch_bucket_size": -1}, "prefetch_bucket_size"),
        ({"param_persistence_threshold": 1.5}, "param_persistence_threshold"),
        ({"max_live_parameters": 0}, "max_live_parameters"),
        ({"model_persistence_threshold": -1}, "model_persistence_threshold"),
        ({"reduce_bucket_size": -5}, "reduce_bucket_size"),
        ({"overlap_comm": "yes"}, "overlap_comm"),
        ({"unit_modules": "Block"}, "unit_modules"),
        ({"mixed_precision": "bf16"}, "mixed_precision"),
    ],
)
def test_bad_zero_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZeroConfig(**kwargs)


def test_bad_policies() -> None:
    with pytest.raises(ValueError, match="unknown dtype"):
        MixedPrecisionPolicy(param_dtype="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_scale_window"):
        LossScalerConfig(loss_scale_window=0)
    with pytest.raises(ValueError, match="precision"):
        ZeroPrecision("64-true")


def test_strategy_arguments() -> None:
    with pytest.raises(TypeError, match="ZeroConfig"):
        ZStackZero3Strategy(zero={"prefetch_bucket_size": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start_method"):
        ZStackZero3Strategy(start_method="thread")  # type: ignore[arg-type]


def test_needs_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        zero3_shard(torch.nn.Linear(2, 2))


def test_registered_with_lightning() -> None:
    from lightning.pytorch import Trainer
    from lightning.pytorch.strategies import StrategyRegistry

    assert "zstack_zero3" in StrategyRegistry
    trainer = Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, logger=False, precision="bf16-mixed")
    assert isinstance(trainer.strategy, ZStackZero3Strategy)
    assert isinstance(trainer.strategy.precision_plugin, ZeroPrecision)
    assert trainer.strategy.precision_plugin.param_dtype == "bf16"
    with pytest.raises(ValueError, match="precision"):
        Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, logger=False, precision="64-true")


def test_unit_selection() -> None:
    from torch import nn

    from tests._zero_models import tiny_gpt
    from zlightning.zero._unit import select_unit_modules

    names = [n for n, _ in select_unit_modules(tiny_gpt(), (), None)]
    assert names == ["blocks.0", "blocks.1", "blocks.2"]
    one_block = [n for n, _ in select_unit_modules(tiny_gpt(n_layer=1), (), None)]
    assert one_block == ["blocks.0"]
    flat = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Conv1d(3, 3, 1))
    assert [n for n, _ in select_unit_modules(flat, (), None)] == ["0", "2"]
    with pytest.raises(ValueError, match="Block9"):
        select_unit_modules(tiny_gpt(), ("Block9",), None)
    with pytest.raises(ValueError, match="ModuleList"):
        select_unit_modules(tiny_gpt(), ("ModuleList",), None)
