"""Global-norm gradient clipping under tensor parallelism matches torch.nn.utils.clip_grad_norm_ on one process.

TP2 x ZeRO-3 DP2 on 4 gloo ranks through the engine (norm 2 and inf, plus plain TP without ZeRO, plus the fp16
overflow check), and TP2 x DP1 / TP2 x DP2 through a real Lightning Trainer with ``gradient_clip_val`` (also checking
that the sampler, ``sync_dist`` and torchmetrics use the data-parallel group only). The clip value is far below the gradient norm, so clipping bites on
every step (asserted on the reference).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests._lightning_models import TinyGPTModule, loader
from tests._zero_models import batches, gpt_loss, tiny_gpt
from tests.test_inject_zero3 import _unshard_tp
from zlightning.inject import apply_tensor_parallel, clip_grad_norm_tp_, tp_full_state, tp_model_parallel_grads
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ModelParallelGrads, ZeroConfig, clip_grad_norm_
from zlightning.zero._optimizer import unscale_and_check_

STEPS, LR, CLIP = 2, 0.1, 0.02
NORMS = (2.0, math.inf)


def _model() -> nn.Module:
    return tiny_gpt(bias=True)  # row-parallel biases and LayerNorm biases: replicated parameters counted once


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _reference(
    norm_type: float, global_batches: list[torch.Tensor], model: nn.Module | None = None, lr: float = LR
) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    ref = copy.deepcopy(model if model is not None else _model())
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    losses, norms = [], []
    for batch in global_batches:
        loss = gpt_loss(ref, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP, norm_type)))
        opt.step()
        opt.zero_grad()
    return ref.state_dict(), losses, norms


def _zero_tp_run(norm_type: float) -> dict[str, Any]:
    model = _model()
    groups = apply_tensor_parallel(model, 2)
    split = tp_model_parallel_grads(model, groups.tp_group)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, _sgd(model.parameters()), config=ZeroConfig(), process_group=groups.dp_group
    )
    zero.state.model_parallel = split
    losses, norms = [], []
    for batch in batches(STEPS, global_batch=4 * groups.dp_size):
        loss = gpt_loss(model, batch.chunk(groups.dp_size)[groups.dp_rank])
        full = loss.detach().clone()
        dist.all_reduce(full, group=groups.dp_group)
        losses.append(float(full) / groups.dp_size)
        zero.backward(loss)
        pieces = [p for g in zero.optimizer.param_groups for p in g["params"]]
        norms.append(float(clip_grad_norm_(zero.state, pieces, CLIP, norm_type)))
        zero.optimizer.step()
        zero.zero_grad()
    state = _unshard_tp(model, zero.module_state_dict())
    return {"losses": losses, "norms": norms, "state": state, "split": sorted(split.split)}


def _plain_tp_run(norm_type: float) -> dict[str, Any]:
    """TP without ZeRO: every TP group trains on the whole global batch (no DP sharding needed)."""
    model = _model()
    groups = apply_tensor_parallel(model, 2)
    opt = _sgd(model.parameters())
    norms = []
    for batch in batches(STEPS, global_batch=8):
        gpt_loss(model, batch).backward()
        norms.append(float(clip_grad_norm_tp_(model, CLIP, norm_type, tp_group=groups.tp_group)))
        opt.step()
        opt.zero_grad()
    return {"norms": norms, "state": tp_full_state(model)}


def _overflow_seen_by_all(rank: int) -> bool:
    """fp16 overflow check: an inf in one TP rank's slice must make every rank of the grid skip the step."""
    model = _model()
    groups = apply_tensor_parallel(model, 2)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, _sgd(model.parameters()), config=ZeroConfig(), process_group=groups.dp_group
    )
    zero.state.model_parallel = tp_model_parallel_grads(model, groups.tp_group)
    zero.backward(gpt_loss(model, batches(1, global_batch=4)[0]))
    pieces = [p for g in zero.optimizer.param_groups for p in g["params"] if p.grad is not None and p.numel()]
    if rank == 1:  # TP rank 1 of DP replica 0 only
        pieces[0].grad[0] = math.inf
    return unscale_and_check_(zero.state, pieces, 1.0)


def _engine_rank(rank: int, world: int) -> dict[str, Any]:
    out: dict[Any, Any] = {norm: {"zero": _zero_tp_run(norm), "plain": _plain_tp_run(norm)} for norm in NORMS}
    out["overflow"] = _overflow_seen_by_all(rank)
    return out


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="ModelParallelGrads.group"):
        ModelParallelGrads(group=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_norm >= 0"):
        clip_grad_norm_tp_(nn.Linear(2, 2), -1.0, tp_group=None)  # type: ignore[arg-type]


def test_tp2_x_zero3_dp2_clipping_matches_clip_grad_norm() -> None:
    out = run_distributed(_engine_rank, 4, timeout=300)
    assert [r["overflow"] for r in out] == [True] * 4
    for norm in NORMS:
        ref_state, ref_losses, ref_norms = _reference(norm, batches(STEPS, global_batch=8))
        assert all(n > 2 * CLIP for n in ref_norms), ref_norms  # clipping bites on every step
        for r in out:
            for kind in ("zero", "plain"):
                run = r[norm][kind]
                # the same norm on every rank of the grid, bit for bit, and the norm of the full gradient
                assert run["norms"] == out[0][norm][kind]["norms"]
                torch.testing.assert_close(run["norms"], ref_norms, rtol=1e-5, atol=0)
                for name, value in ref_state.items():
                    torch.testing.assert_close(run["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")
            torch.testing.assert_close(r[norm]["zero"]["losses"], ref_losses, rtol=1e-5, atol=1e-6)
            split = set(r[norm]["zero"]["split"])
            assert {"tok_emb.weight", "head.weight", "blocks.0.attn.qkv.bias", "blocks.0.mlp.proj.weight"} <= split
            assert not split & {"blocks.0.mlp.proj.bias", "blocks.0.ln_1.weight", "ln_f.bias"}


# ---------------------------------------------------------------------------------------------- Lightning Trainer
N_BATCHES, L_STEPS, L_LR, MICRO = 6, 3, 0.05, 2


class _SGDModule(TinyGPTModule):
    """Logs a torchmetrics SumMetric/MeanMetric and a summed ``sync_dist`` value: under TP they must reduce over the
    data-parallel group only (a world-wide sum would count each replica ``tp`` times)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model()
        self.rows = torchmetrics.SumMetric()
        self.mean_loss = torchmetrics.MeanMetric()
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.seen.append(batch[0].clone())
        self.rows.update(batch[0].shape[0])
        self.mean_loss.update(loss.detach())
        self.log("rows_synced", float(batch[0].shape[0]), sync_dist=True, reduce_fx="sum")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=L_LR, momentum=0.9)


def _fit(rank: int, world: int) -> dict[str, Any]:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401

    pl.seed_everything(0, verbose=False)
    module = _SGDModule()
    trainer = pl.Trainer(
        strategy=ZStackZero3Strategy(tensor_parallel_size=2),
        accelerator="cpu",
        devices=world,
        max_steps=L_STEPS,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader(N_BATCHES, MICRO, world))
    from zlightning.zero import summon_full_params

    with summon_full_params(module):  # the module stays sharded after fit
        state = tp_full_state(module.model)
    return {
        "losses": module.losses,
        "state": state,
        "seen": module.seen,
        "rows": float(module.rows.compute()),
        "mean_loss": float(module.mean_loss.compute()),
        "rows_synced": float(trainer.callback_metrics["rows_synced"]),
    }


def _global_batches(world: int, dp: int) -> list[torch.Tensor]:
    """What the Trainer feeds: the dataset of `loader`, split by a seeded DistributedSampler over the DP replicas."""
    data = torch.cat(batches(N_BATCHES, MICRO * world))
    per_replica = [
        data[list(DistributedSampler(TensorDataset(data), num_replicas=dp, rank=r, shuffle=True, seed=0))]
        for r in range(dp)
    ]
    return [torch.cat([p[MICRO * i : MICRO * (i + 1)] for p in per_replica]) for i in range(L_STEPS)]


@pytest.mark.parametrize("world", [2, 4], ids=["tp2xdp1", "tp2xdp2"])
def test_lightning_tp_clip_metrics_sampler_match_single_process(world: int) -> None:
    out = run_distributed(_fit, world, init_process_group=False, timeout=400)
    dp = world // 2
    global_batches = _global_batches(world, dp)
    ref_state, ref_losses, ref_norms = _reference(2.0, global_batches, _SGDModule().model, lr=L_LR)
    assert all(n > 2 * CLIP for n in ref_norms), ref_norms
    for rank, r in enumerate(out):
        # the sampler shards by the DP rank: TP peers (contiguous ranks) read the same rows, DP replicas others
        dp_rank = rank // 2
        for step, seen in enumerate(r["seen"]):
            torch.testing.assert_close(
                seen, global_batches[step][MICRO * dp_rank : MICRO * (dp_rank + 1)], rtol=0, atol=0
            )
        # torchmetrics and sync_dist reduce over the DP group: dp replicas x MICRO rows (world-wide would be 2x)
        assert r["rows"] == dp * MICRO * L_STEPS, (r["rows"], dp)
        assert r["rows_synced"] == dp * MICRO, (r["rows_synced"], dp)
        torch.testing.assert_close(r["mean_loss"], sum(ref_losses) / L_STEPS, rtol=1e-5, atol=1e-6)
        for name, value in ref_state.items():
            torch.testing.assert_close(r["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # each DP replica's micro-batch losses average to the reference loss of the global batch
    mean = [sum(out[k]["losses"][i] for k in range(0, world, 2)) / dp for i in range(L_STEPS)]
    torch.testing.assert_close(mean, ref_losses, rtol=1e-5, atol=1e-6)
