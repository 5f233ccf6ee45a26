"""CUDA/NCCL paths of the ZeRO-3 engine (side streams, nccl collectives). Skipped without a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._zero_models import batches, gpt_loss, reference_train, tiny_gpt
from zlightning.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _cuda_train(rank: int, world: int, precision: str | None) -> dict[str, Any]:
    import torch.distributed as dist

    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, MixedPrecisionPolicy, ZeroConfig

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        model = tiny_gpt().cuda()
        cfg = ZeroConfig(mixed_precision=MixedPrecisionPolicy(param_dtype=precision))
        zero = DeepSpeedZeroOptimizer_Stage3(
            model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), config=cfg, gradient_clipping=1.0
        )
        for batch in batches(3, 4 * world):
            zero.backward(gpt_loss(model, batch.chunk(world)[rank].cuda()))
            zero.step()
        return {k: v.cpu() for k, v in zero.module_state_dict().items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_cuda_parity(precision: str | None) -> None:
    world = min(2, torch.cuda.device_count())
    out = run_distributed(_cuda_train, world, precision, init_process_group=False, timeout=300)
    ref, _, _ = reference_train(tiny_gpt(), batches(3, 4 * world), accumulate=1, clip=1.0)
    tol = {"rtol": 1e-4, "atol": 1e-5} if precision is None else {"rtol": 0.0, "atol": 2e-2}
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(out[0][name], value, **tol, msg=name)
