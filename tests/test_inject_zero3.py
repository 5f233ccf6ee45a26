"""DP x TP grid: module_inject(tp=2) composed with the ZeRO-3 engine over the DP group (world 4) vs one process."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.inject import apply_tensor_parallel
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

STEPS, LR = 2, 0.1


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)  # see test_inject_tp: Adam amplifies 1e-9 noise


def _unshard_tp(model: nn.Module, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    modules = dict(model.named_modules(remove_duplicate=False))
    out = {}
    for name, value in local.items():
        mod_name, _, attr = name.rpartition(".")
        unshard = getattr(modules[mod_name], "unshard", None)
        out[name] = unshard(attr, value) if callable(unshard) else value
    return out


def _grid_rank(rank: int, world: int) -> dict:
    model = tiny_gpt()
    groups = apply_tensor_parallel(model, 2)  # the one-line strategy hook
    assert (groups.tp_rank, groups.dp_rank, groups.dp_size) == (rank % 2, rank // 2, 2)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, _sgd(model.parameters()), config=ZeroConfig(), process_group=groups.dp_group
    )
    losses = []
    for batch in batches(STEPS, global_batch=4 * groups.dp_size):
        loss = gpt_loss(model, batch.chunk(groups.dp_size)[groups.dp_rank])  # TP peers see the same rows
        full = loss.detach().clone()
        dist.all_reduce(full, group=groups.dp_group)
        losses.append(float(full) / groups.dp_size)
        zero.backward(loss)
        zero.step()
    local = zero.module_state_dict()  # unsharded over DP, still TP-sharded
    return {"losses": losses, "state": _unshard_tp(model, local), "tp_local": sum(v.numel() for v in local.values())}


def test_tp2_x_zero3_dp2_matches_single_process() -> None:
    out = run_distributed(_grid_rank, 4, timeout=300)
    ref = copy.deepcopy(tiny_gpt())
    opt = _sgd(ref.parameters())
    losses = []
    for batch in batches(STEPS, global_batch=8):
        loss = gpt_loss(ref, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    full = ref.state_dict()
    for r in out:
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        assert set(r["state"]) == set(full)
        for name, value in full.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert r["tp_local"] < sum(v.numel() for v in full.values())
