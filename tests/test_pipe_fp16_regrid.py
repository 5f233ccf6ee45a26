"""fp16 dynamic loss scaling in the pipeline, and optimizer state reloaded on another grid, on 4 real gloo ranks.

Loss scaling: DP2 x PP2 (ZeRO-1) with a loss scaler whose scale changes during the run, against a one-process loop
running the same ``DynamicLossScaler`` logic (fp32 compute, so powers-of-two scaling is exact and parity is tight);
an inf injected into one parameter's gradient on ONE rank (stage 0, replica 1) must make all four ranks skip the
step, keep their weights and halve the scale; the scaler state survives a checkpoint. Then Lightning with the
strategy's ``PipelinePrecision("16-mixed")`` plugin (real fp16 autocast on CPU: ``Trainer(precision="16-mixed")``
becomes bf16-mixed on CPU, Lightning's own rule) against the same loop under fp16 autocast.

ZB-H1 (weight gradients in deferred W actions) runs the same loss-scaled steps with the same result.

Regrid: ZeRO-1 state saved on DP2 x PP2 reloads on PP4 (DP1) and on DP2 x PP2 without ZeRO, and the next step equals
the uninterrupted run's; weights-only reload (no optimizer state) does not, which shows the state was used.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from examples.gpt_pipe import gpt_pipeline
from tests.test_pipe_parity import CFG, CLIP, MICRO, TOL, _check_states, data, make_optimizer
from zlightning.pipe import PipelineConfig, PipelineEngine, load_pipeline_checkpoint, save_pipeline_checkpoint
from zlightning.testing import run_distributed
from zlightning.zero import DynamicLossScaler, LossScalerConfig

SCALER = LossScalerConfig(initial_scale_power=10, loss_scale_window=2, hysteresis=1)
SCALED_STEPS, POISON_STEP = 5, 3
SGD_LR = 0.5


def make_sgd(params: Any) -> torch.optim.Optimizer:
    """SGD for the loss-scaling tests: unlike Adam its step is not invariant to the gradients' scale, so a wrong
    unscale would show in the weights."""
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


"""Scale 1024, doubled after every 2 clean steps; step 3 (0-based) overflows on one rank only."""
PL_STEPS, PL_BATCH = 3, 8


def scaled_reference(
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    dp: int,
    config: LossScalerConfig,
    poison_step: int | None,
    autocast: bool = False,
    clip: float = CLIP,
) -> dict[str, Any]:
    """One process, whole model, the pipeline's arithmetic (per-replica micro-batch accumulation, replica average) with
    the loss scaled by the current scale, gradients unscaled, the step skipped and the scale updated on overflow."""
    model = gpt_pipeline(CFG).build()
    opt = make_sgd(model.parameters())
    scaler = DynamicLossScaler(config)
    losses, scales, states = [], [], []
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step, (x, y) in enumerate(batches):
        total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
        loss_sum = 0.0
        for d in range(dp):
            for xm, ym in zip(x.chunk(dp)[d].chunk(MICRO), y.chunk(dp)[d].chunk(MICRO)):
                with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                    loss = model.compute_loss(model(xm), ym)
                (loss * scaler.scale / MICRO).backward()
                loss_sum += float(loss.detach().float()) / (MICRO * dp)
            for n, p in model.named_parameters():
                total[n] += p.grad / dp
                p.grad = None
        for n, p in model.named_parameters():
            p.grad = total[n] * (1.0 / scaler.scale)
        overflow = step == poison_step or not all(torch.isfinite(p.grad).all() for p in model.parameters())
        scales.append(scaler.scale)
        if not overflow:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        opt.zero_grad()
        scaler.update(overflow)
        losses.append(loss_sum)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {"losses": losses, "scales": scales, "states": states, "final_scale": scaler.scale, "initial": initial}


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _replica_batch(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dp = engine.grid.dp_rank, engine.grid.dp
    b = x.shape[0] // dp
    return x[d * b : (d + 1) * b], y[d * b : (d + 1) * b]


def rank_scaled(rank: int, ckpt: Path, schedule: str = "1f1b") -> dict[str, Any]:
    config = PipelineConfig(
        micro_batches=MICRO, zero_stage=1, gradient_clipping=CLIP, loss_scaler=SCALER, schedule=schedule
    )  # type: ignore[arg-type]
    module = gpt_pipeline(CFG, num_stages=2)
    engine = PipelineEngine(module, make_sgd, config)
    poison = [False]
    if (engine.grid.stage, engine.grid.dp_rank) == (0, 1):  # one rank only: the others learn it from the all-reduce
        first = next(p for p in module.parameters() if p.requires_grad)
        first.register_hook(lambda g: g * float("inf") if poison[0] else g)
    out: dict[str, Any] = {"losses": [], "scales": [], "states": [], "skipped": []}
    for step, (x, y) in enumerate(data(SCALED_STEPS, seed=11)):
        poison[0] = step == POISON_STEP
        out["scales"].append(engine.loss_scale)
        out["losses"].append(float(engine.train_batch(batch=_replica_batch(engine, x, y))))
        out["states"].append(_snapshot(module))
        out["skipped"].append(engine.skipped_steps)
    save_pipeline_checkpoint(engine, ckpt)
    fresh = PipelineEngine(gpt_pipeline(CFG, num_stages=2), make_sgd, config)
    load_pipeline_checkpoint(fresh, ckpt)
    out["scaler"], out["reloaded_scaler"] = engine.scaler.state_dict(), fresh.scaler.state_dict()
    return out


def rank_regrid(rank: int, ckpt: Path) -> dict[str, Any]:
    """ZeRO-1 on DP2 x PP2 for 3 steps, checkpoint, one more step; the same step after reloading on other grids."""
    batches = data(4, seed=13)
    engine = PipelineEngine(
        gpt_pipeline(CFG, num_stages=2), make_optimizer, PipelineConfig(micro_batches=MICRO, zero_stage=1)
    )
    for x, y in batches[:3]:
        engine.train_batch(batch=_replica_batch(engine, x, y))
    save_pipeline_checkpoint(engine, ckpt)
    x, y = batches[3]
    out: dict[str, Any] = {"n_state_saved": len(engine.optimizer.state)}
    engine.train_batch(batch=_replica_batch(engine, x, y))
    out["uninterrupted"] = _snapshot(engine.module)
    # PP4 x DP1 (the replicas' micro-batches become 8 micro-batches of the same size) and DP2 x PP2 without ZeRO
    for name, pp, config, load_optimizer in (
        ("pp4", 4, PipelineConfig(micro_batches=2 * MICRO), True),
        ("pp4_weights_only", 4, PipelineConfig(micro_batches=2 * MICRO), False),
        ("dp2pp2_no_zero", 2, PipelineConfig(micro_batches=MICRO), True),
    ):
        other = PipelineEngine(gpt_pipeline(CFG, num_stages=pp, partition_method="uniform"), make_optimizer, config)
        load_pipeline_checkpoint(other, ckpt, load_optimizer=load_optimizer)
        out[f"{name}_n_state"] = len(other.optimizer.state)
        out[f"{name}_n_params"] = sum(1 for _ in other.module.parameters())
        other.train_batch(batch=_replica_batch(other, x, y))
        out[name] = _snapshot(other.module)
    return out


class Fp16GPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = gpt_pipeline(CFG)
        self.losses: list[float] = []
        self.scales: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.scales.append(self.trainer.strategy.engine.loss_scale)
        ids = batch[0]
        loss = self.pipe.batch_loss((ids[:, :-1], ids[:, 1:]))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_sgd(self.parameters())


def _pl_ids() -> torch.Tensor:
    return torch.randint(
        0, CFG.vocab_size, (PL_STEPS * PL_BATCH, CFG.seq_len + 1), generator=torch.Generator().manual_seed(17)
    )


def rank_lightning_fp16(world: int) -> dict[str, Any]:
    from zlightning.strategies import PipelinePrecision, PipelineStrategy

    pl.seed_everything(0, verbose=False)
    module = Fp16GPT()
    strategy = PipelineStrategy(
        num_stages=2,
        config=PipelineConfig(
            micro_batches=MICRO, loss_scaler=LossScalerConfig(initial_scale_power=12, loss_scale_window=2)
        ),
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        plugins=[PipelinePrecision("16-mixed")],  # real fp16 on CPU (precision="16-mixed" would become bf16 there)
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(_pl_ids()), batch_size=PL_BATCH // 2))
    return {
        "losses": module.losses,
        "scales": module.scales,
        "state": {k.removeprefix("pipe."): v.detach().clone() for k, v in module.state_dict().items()},
    }


def rank_main(rank: int, world: int, scaled_ckpt: str, regrid_ckpt: str) -> dict[str, Any]:
    out = {"lightning": rank_lightning_fp16(world)}
    out["scaled"] = rank_scaled(rank, Path(scaled_ckpt))
    out["scaled_zb_h1"] = rank_scaled(rank, Path(scaled_ckpt) / "zb_h1", "zb_h1")  # weight gradients in deferred W
    out["regrid"] = rank_regrid(rank, Path(regrid_ckpt))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    a, b = tmp_path_factory.mktemp("scaled"), tmp_path_factory.mktemp("regrid")
    return run_distributed(rank_main, 4, str(a), str(b), init_process_group=False, timeout=500)


@functools.cache
def _scaled_ref() -> dict[str, Any]:
    return scaled_reference(data(SCALED_STEPS, seed=11), dp=2, config=SCALER, poison_step=POISON_STEP)


@pytest.mark.parametrize("key", ["scaled", "scaled_zb_h1"])
def test_loss_scaling_matches_single_process_and_overflow_skips_everywhere(
    runs: list[dict[str, Any]], key: str
) -> None:
    ref = _scaled_ref()
    assert ref["scales"] == [1024.0, 1024.0, 2048.0, 2048.0, 1024.0]  # the schedule really moves: up, then halved
    for r in (x[key] for x in runs):
        assert r["scales"] == ref["scales"]
        torch.testing.assert_close(r["losses"], ref["losses"], **TOL)
        # every rank skipped exactly the poisoned step, though only rank 1's gradient overflowed
        assert r["skipped"] == [0, 0, 0, 1, 1]
        for name, value in r["states"][POISON_STEP].items():
            torch.testing.assert_close(value, r["states"][POISON_STEP - 1][name], rtol=0, atol=0, msg=name)
        assert r["scaler"] == r["reloaded_scaler"] and r["scaler"]["scale"] == ref["final_scale"]
    for step in range(SCALED_STEPS):
        _check_states([x[key]["states"][step] for x in runs], ref["states"][step])


def test_lightning_16_mixed_matches_fp16_reference(runs: list[dict[str, Any]]) -> None:
    ids, per = _pl_ids(), PL_BATCH // 2
    orders = [
        list(DistributedSampler(TensorDataset(ids), num_replicas=2, rank=d, shuffle=True, seed=0)) for d in range(2)
    ]
    batches = []
    for s in range(
        PL_STEPS
    ):  # Lightning's sampler: replica d reads orders[d]; the reference splits the batch in halves
        rows = torch.cat([ids[o[s * per : (s + 1) * per]] for o in orders])
        batches.append((rows[:, :-1], rows[:, 1:]))
    ref = scaled_reference(
        batches,
        dp=2,
        config=LossScalerConfig(initial_scale_power=12, loss_scale_window=2),
        poison_step=None,
        autocast=True,
    )
    fp16_tol = {"rtol": 1e-3, "atol": 1e-5}
    for r in (x["lightning"] for x in runs):
        assert r["scales"] == ref["scales"]
        torch.testing.assert_close(r["losses"], ref["losses"], **fp16_tol)
    for x in runs:
        for name, value in x["lightning"]["state"].items():
            moved = float((ref["states"][-1][name] - ref["initial"][name]).abs().max())
            diff = float((value - ref["states"][-1][name]).abs().max())
            # fp16 rounding differs slightly with the summation order; a skipped step or a wrong scale moves ~100 %
            assert diff <= 0.05 * moved + 1e-6, (name, diff, moved)


def test_zero1_optimizer_state_reloads_on_another_grid(runs: list[dict[str, Any]]) -> None:
    for r in (x["regrid"] for x in runs):
        assert r["n_state_saved"] > 0
        # PP4: all of this rank's parameters get state (no ZeRO there); DP2 x PP2 without ZeRO: the whole stage's
        assert r["pp4_n_state"] == r["pp4_n_params"] and r["dp2pp2_no_zero_n_state"] == r["dp2pp2_no_zero_n_params"]
        assert r["pp4_weights_only_n_state"] == 0
    uninterrupted = {}
    for x in runs:
        uninterrupted.update(x["regrid"]["uninterrupted"])
    _check_states([x["regrid"]["pp4"] for x in runs], uninterrupted)
    _check_states([x["regrid"]["dp2pp2_no_zero"] for x in runs], uninterrupted)
    with pytest.raises(
        AssertionError, match="are not close"
    ):  # without the optimizer state the next step differs: the test can fail
        _check_states([x["regrid"]["pp4_weights_only"] for x in runs], uninterrupted)
