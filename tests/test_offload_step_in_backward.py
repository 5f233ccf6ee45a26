"""NVMe optimizer offload with ``step_in_backward`` (each group's Adam update runs in backward, as its gradient
becomes final): the same parameters and optimizer state as one process, with and without ``release_gradients``;
with clipping the update stays in ``step()`` (exact), and an early update really happened when it could."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._zero_models import batches, gpt_loss, reference_train, tiny_gpt
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, NVMeOffload, ZeroConfig

STEPS, ACCUMULATE = 3, 2


def _train(rank: int, world: int, root: str, release: bool, clip: float) -> dict[str, Any]:
    policy = NVMeOffload(
        path=os.path.join(root, f"swap{int(release)}{clip}"),
        buffer_size=1024,
        buffer_count=6,
        step_in_backward=True,
        release_gradients=release,
    )
    model = tiny_gpt()
    zero = DeepSpeedZeroOptimizer_Stage3(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        config=ZeroConfig(offload_optimizer=policy),
        gradient_clipping=clip,
        gradient_accumulation_steps=ACCUMULATE,
    )
    early = []
    for i, batch in enumerate(batches(STEPS * ACCUMULATE, global_batch=4 * world)):
        zero.backward(gpt_loss(model, batch.chunk(world)[rank]))
        if (i + 1) % ACCUMULATE == 0:
            early.append(zero.optimizer.stepped_in_backward)
            zero.step()
    out = {"state": zero.module_state_dict(), "optim": zero.state_dict()["optimizer"], "early": early}
    zero.unshard_module()
    return out


@pytest.mark.parametrize("release,clip", [(False, 0.0), (True, 0.0), (False, 0.5)], ids=["exact", "release", "clip"])
def test_step_in_backward_matches_one_process(tmp_path: Path, release: bool, clip: float) -> None:
    world = 2
    results = run_distributed(_train, world, str(tmp_path), release, clip, timeout=300)
    ref, _, ref_opt = reference_train(
        tiny_gpt(), batches(STEPS * ACCUMULATE, global_batch=4 * world), accumulate=ACCUMULATE, clip=clip
    )
    for r in results:
        # with clipping the update must wait for every gradient's norm: nothing is stepped early
        assert r["early"] == ([False] * STEPS if clip else [True] * STEPS), r["early"]
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        for i, s in ref_opt.state_dict()["state"].items():
            for key, value in s.items():
                torch.testing.assert_close(r["optim"]["state"][i][key], value, rtol=1e-5, atol=1e-6)
    assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # swap files removed


def _twice_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch[0::2]).pow(2).mean() + model(batch[1::2]).pow(2).mean()


def _data(steps: int, rows: int) -> list[torch.Tensor]:
    return [torch.randn(rows, 32, generator=torch.Generator().manual_seed(s)) for s in range(steps)]


def _train_called_twice(rank: int, world: int, root: str) -> dict[str, Any]:
    policy = NVMeOffload(path=os.path.join(root, "swap"), buffer_size=1024, buffer_count=6, step_in_backward=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)  # no blocks: one group, in the root unit
    zero = DeepSpeedZeroOptimizer_Stage3(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        config=ZeroConfig(offload_optimizer=policy),
    )
    early = []
    for batch in _data(STEPS, 4 * world):
        zero.backward(_twice_loss(model, batch.chunk(world)[rank]))
        early.append(zero.optimizer.stepped_in_backward)
        zero.step()
    return {"state": zero.module_state_dict(), "early": early}


def test_a_group_used_twice_steps_only_after_its_last_use(tmp_path: Path) -> None:
    # the second use's reduction is drained to make room for the first use's; that drain used to tell the optimizer
    # the group's gradient was final (its use count already 0), so Adam stepped it on half the gradient and the
    # other half then met a group already stepped
    world = 2
    results = run_distributed(_train_called_twice, world, str(tmp_path), timeout=300)
    torch.manual_seed(0)
    ref, _, _ = reference_train(
        torch.nn.Linear(32, 32), _data(STEPS, 4 * world), accumulate=1, clip=0.0, loss_fn=_twice_loss
    )
    for r in results:
        assert r["early"] == [True] * STEPS, r["early"]
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
