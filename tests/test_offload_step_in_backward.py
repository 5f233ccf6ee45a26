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
