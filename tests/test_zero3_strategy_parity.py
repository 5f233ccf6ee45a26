"""zstack_zero3 through a real Lightning Trainer on 2 CPU processes: parity with a single-process reference and
with Lightning's ddp strategy (accumulation and gradient clipping included)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests._lightning_models import TinyGPTModule, global_batches_of, rank_fit
from tests._zero_models import gpt_loss
from zlightning.testing import run_distributed

WORLD, N_BATCHES, ACCUM, CLIP = 2, 8, 2, 0.5
KW = {"max_steps": 3, "accumulate_grad_batches": ACCUM, "gradient_clip_val": CLIP}


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    torch.manual_seed(0)
    module = TinyGPTModule()
    opt = module.configure_optimizers()
    losses = []
    for i, batch in enumerate(global_batches_of(N_BATCHES, 2, WORLD)[: KW["max_steps"] * ACCUM]):
        loss = gpt_loss(module.model, batch)
        losses.append(float(loss.detach()))
        (loss / ACCUM).backward()
        if (i + 1) % ACCUM == 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
    return copy.deepcopy(module.state_dict()), losses


@pytest.fixture(scope="module")
def ddp_run() -> list[dict]:
    return run_distributed(rank_fit, WORLD, "ddp", KW, N_BATCHES, init_process_group=False, timeout=300)


@pytest.mark.parametrize("strategy", ["zstack_zero3", "zstack_zero2", "zstack_zero1"])
def test_zero_matches_single_process_and_ddp(strategy: str, ddp_run: list[dict]) -> None:
    zero = run_distributed(rank_fit, WORLD, strategy, KW, N_BATCHES, init_process_group=False, timeout=300)
    ref_state, ref_losses = _reference()
    for rank in range(WORLD):
        # per-rank micro-batch losses equal DDP's
        torch.testing.assert_close(zero[rank]["losses"], ddp_run[rank]["losses"], rtol=1e-5, atol=1e-6)
        for name, value in ref_state.items():
            torch.testing.assert_close(zero[rank]["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    mean_losses = [sum(z["losses"][i] for z in zero) / WORLD for i in range(len(ref_losses))]
    torch.testing.assert_close(mean_losses, ref_losses, rtol=1e-5, atol=1e-6)
