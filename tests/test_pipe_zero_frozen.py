"""ZeRO-2/3 inside pipeline stages with layers frozen after the stages were sharded (DP2 x PP2, 4 gloo ranks), against
one process. Under ``zbv`` a rank runs two chunks; when every parameter of the chunk whose backward comes last is
frozen, that backward uses nothing of the rank's engine, and the gradient sums the earlier micro-batches held back
were never reduce-scattered: the step applied stale gradients (see "Held-back sums" in [Note: ZeRO inside a pipeline
stage])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._pipe_reference import one_process_losses
from zlightning.pipe import LayerSpec, PipelineConfig, PipelineEngine, PipelineModule
from zlightning.testing import run_distributed

D, C, GLOBAL_BATCH, STEPS, MICRO = 8, 3, 8, 3, 4
FROZEN = ("0.", "4.")  # layer 4 is a whole zbv chunk of the second rank


def _pipe() -> PipelineModule:
    layers = [
        LayerSpec(nn.Linear, D, 16),
        nn.Tanh(),
        LayerSpec(nn.Linear, 16, 12),
        LayerSpec(nn.LayerNorm, 12),
        LayerSpec(nn.Linear, 12, 10),
        nn.Tanh(),
        LayerSpec(nn.Linear, 10, C),
    ]
    return PipelineModule(layers, loss_fn=lambda out, y: F.cross_entropy(out, y), partition_method="uniform")


def _freeze(module: nn.Module) -> None:
    for name, p in module.named_parameters():
        if name.startswith(FROZEN):
            p.requires_grad_(False)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(GLOBAL_BATCH, D, generator=g), torch.randint(0, C, (GLOBAL_BATCH,), generator=g))
        for _ in range(STEPS)
    ]


def _rank(rank: int, world: int, schedule: str, zero_stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = PipelineConfig(micro_batches=MICRO, schedule=schedule, zero_stage=zero_stage)
    engine = PipelineEngine(_pipe(), lambda ps: torch.optim.AdamW(ps, lr=0.02), config, num_stages=2)
    _freeze(engine.module)  # after sharding: the stage's parameters are shard pieces now
    dp_rank, per = rank % 2, GLOBAL_BATCH // 2
    losses = [
        float(
            engine.train_batch(batch=(x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]))
        )
        for x, y in _batches()
    ]
    return {"losses": losses, "state": engine.zero.full_state_dict()}


@pytest.mark.parametrize("schedule,zero_stage", [("zbv", 3), ("zbv", 2), ("1f1b", 3)])
def test_layers_frozen_after_sharding_match_one_process(schedule: str, zero_stage: int) -> None:
    torch.manual_seed(0)
    ref = _pipe().build()
    initial = {k: v.clone() for k, v in ref.state_dict().items()}
    _freeze(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.02)
    losses = one_process_losses(ref, opt, _batches())
    runs = run_distributed(_rank, 4, schedule, zero_stage, timeout=240)
    merged: dict[str, torch.Tensor] = {}
    for r in runs:
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        merged.update(r["state"])
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=1e-5, atol=1e-6, msg=name)
        if name.startswith(FROZEN):
            torch.testing.assert_close(merged[name], initial[name], rtol=0, atol=0, msg=name)
