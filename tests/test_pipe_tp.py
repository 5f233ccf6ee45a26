"""PP x TP: pipeline stages made tensor-parallel with ``zlightning.inject``, on real gloo ranks, against a
single-process reference.

One spawn of 4 ranks runs, on the same process group: a Lightning ``Trainer(strategy=PipelineStrategy(num_stages=2,
tensor_parallel_size=2))`` fit (clipping, a torchmetrics metric and a summed ``self.log``, which must see the
data-parallel group only), then the engine alone: PP2 x TP2 (1F1B, clipping far below the gradient norm), PP2 x TP2
with a user plan, PP2 x TP2 on a model with an untied embedding and an ``ln_f + lm_head`` layer, PP2 x TP2 with the
interleaved schedule and activation checkpointing, and DP2 x TP2 (one stage, ZeRO-1). Each gathers its full weights
(``tp_full_state``) and is compared with one process training the unsharded model on the same global batches (fp32,
rtol 1e-5: losses, pre-clipping gradient norms, every parameter). The same spawn checks the errors: TP peers fed
different data, a layer that cannot be sharded on one stage only (every rank raises), a plan entry matching no stage,
and checkpoints of a TP grid (engine and Lightning). Grid coordinates and argument errors are tested without
processes."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from zlightning.strategies import PipelineStrategy

from examples.gpt_model import Block, GPTConfig
from examples.gpt_pipe import PositionalEmbedding, gpt_pipeline, lm_loss
from zlightning.inject import InjectPolicy, tp_full_state
from zlightning.pipe import (
    LayerSpec,
    PipeGrid,
    PipelineConfig,
    PipelineEngine,
    PipelineModule,
    consolidate_pipeline_checkpoint,
    load_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from zlightning.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=4, bias=True)
STEPS, GLOBAL_BATCH, MICRO, LR, CLIP = 3, 8, 4, 1.0, 0.05
TOL = {"rtol": 1e-5, "atol": 1e-6}
PLAN = InjectPolicy(plan={r"layers\.\d+\.mlp\.(fc|proj)": "replicate"}, inject_kernels=False)  # only attention split


def data(seed: int = 3, lightning_order: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches; with ``lightning_order`` as Lightning's training sampler (a shuffling
    DistributedSampler over the one data-parallel replica, seed 0, epoch 0) reads them from ``data(seed)``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG.vocab_size, (STEPS * GLOBAL_BATCH, CFG.seq_len + 1), generator=g)
    if lightning_order:
        ids = ids[list(DistributedSampler(TensorDataset(ids), num_replicas=1, rank=0, shuffle=True, seed=0))]
    return [(b[:, :-1], b[:, 1:]) for b in ids.chunk(STEPS)]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD: Adam divides near-zero gradients (a qkv key bias has none mathematically) by their own size and turns
    # summation-order rounding into visible weight differences; SGD keeps a wrong gradient visible and rounding small
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


class Embed(torch.nn.Module):
    """An untied token table (sharded on the hidden dim under TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(CFG.vocab_size, CFG.d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids)


class Head(torch.nn.Module):
    """Final norm + untied LM head in one pipeline layer (planned vocab-parallel under TP)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_f = torch.nn.LayerNorm(CFG.d_model)
        self.lm_head = torch.nn.Linear(CFG.d_model, CFG.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def untied_pipeline(**kwargs: Any) -> PipelineModule:
    layers = [
        LayerSpec(Embed),
        LayerSpec(PositionalEmbedding, CFG),
        *[LayerSpec(Block, CFG) for _ in range(2)],
        LayerSpec(Head),
    ]
    return PipelineModule(layers, loss_fn=lm_loss, partition_method="type:Block", **kwargs)


def build(model: str, **kwargs: Any) -> PipelineModule:
    return gpt_pipeline(CFG, **kwargs) if model == "gpt" else untied_pipeline(**kwargs)


@functools.cache
def reference(
    dp: int, seed: int = 3, lightning_order: bool = False, model: str = "gpt"
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the whole unsharded model. Each replica's share of a batch is accumulated over ``MICRO``
    micro-batches and the replicas' gradients averaged (the pipeline's summation order). Returns the losses, the
    pre-clipping gradient norms and the final weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build(model).build()
        opt = make_optimizer(model.parameters())
        losses, norms = [], []
        for x, y in data(seed, lightning_order):
            total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            loss_sum = 0.0
            for d in range(dp):
                for xm, ym in zip(x.chunk(dp)[d].chunk(MICRO), y.chunk(dp)[d].chunk(MICRO)):
                    loss = model.compute_loss(model(xm), ym)
                    (loss / MICRO).backward()
                    loss_sum += float(loss.detach()) / (MICRO * dp)
                for n, p in model.named_parameters():
                    total[n] += p.grad / dp
                    p.grad = None
            for n, p in model.named_parameters():
                p.grad = total[n]
            losses.append(loss_sum)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            opt.zero_grad()
        return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _train(
    pp: int,
    tp: int,
    zero_stage: int,
    policy: InjectPolicy | None = None,
    model: str = "gpt",
    schedule: str = "1f1b",
    checkpoint_every: int = 0,
) -> dict[str, Any]:
    module = build(model, num_stages=pp, activation_checkpoint_interval=checkpoint_every)
    config = PipelineConfig(
        micro_batches=MICRO,
        gradient_clipping=CLIP,
        tensor_parallel_size=tp,
        zero_stage=zero_stage,
        tp_policy=policy,
        schedule=schedule,
    )  # type: ignore[arg-type]
    engine = PipelineEngine(module, make_optimizer, config)
    g = engine.grid
    norms: list[float] = []
    clip = engine.clip_grad_norm_
    engine.clip_grad_norm_ = lambda max_norm: norms.append(float(n := clip(max_norm))) or n  # type: ignore[method-assign]
    losses = []
    for x, y in data():
        b = x.shape[0] // g.dp
        losses.append(
            float(
                engine.train_batch(
                    batch=(x[g.dp_rank * b : (g.dp_rank + 1) * b], y[g.dp_rank * b : (g.dp_rank + 1) * b])
                )
            )
        )
    full = tp_full_state(module)  # collective over each layer's TP group
    sharded = {n: tuple(p.shape) for n, p in module.named_parameters()}
    return {
        "losses": losses,
        "norms": norms,
        "state": full,
        "coords": (g.stage, g.dp_rank, g.tp_rank),
        "shapes": sharded,
        "engine": engine,
    }


class OddMLP(torch.nn.Module):
    """An MLP whose hidden width (33) cannot be split over 2 TP ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(CFG.d_model, 33)
        self.proj = torch.nn.Linear(33, CFG.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.relu(self.fc(x)))


class PipeGPT(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = gpt_pipeline(CFG)
        self.batches = torchmetrics.SumMetric()  # synced over the data-parallel group by the strategy
        self.losses: list[float] = []
        self.batch_count = -1.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipe.batch_loss(batch)
        self.losses.append(float(loss))
        self.batches.update(1.0)
        self.log("replicas", 1.0, sync_dist=True, reduce_fx="sum")  # the number of data-parallel replicas
        return loss

    def on_train_epoch_end(self) -> None:
        self.batch_count = float(self.batches.compute())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


def _loader() -> DataLoader:
    batches = data(seed=7)
    return DataLoader(
        TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])), batch_size=GLOBAL_BATCH
    )


def _lightning(world: int, tmp: Path) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = PipeGPT()
    strategy = PipelineStrategy(num_stages=2, micro_batches=MICRO, tensor_parallel_size=2)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        gradient_clip_val=CLIP,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _loader())
    g = strategy.engine.grid
    votes = [
        strategy.reduce_boolean_decision(d, all=a) for d, a in ((True, True), (g.rank == 3, False), (g.rank != 3, True))
    ]
    trainer.save_checkpoint(tmp / "pl_ckpt")
    resumed = PipeGPT()  # resumes at the end of the finished epoch: the weights come back, nothing trains
    strategy2 = PipelineStrategy(num_stages=2, micro_batches=MICRO, tensor_parallel_size=2)
    pl.Trainer(
        strategy=strategy2,
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp / "pl_root"),
    ).fit(resumed, _loader(), ckpt_path=str(tmp / "pl_ckpt"))
    return {
        "votes": votes,
        "resumed_state": tp_full_state(resumed.pipe),
        "losses": module.losses,
        "state": tp_full_state(module.pipe),
        "coords": (g.stage, g.dp_rank, g.tp_rank),
        "replicas": float(trainer.callback_metrics["replicas"]),
        "batch_count": module.batch_count,
        "sampler": strategy.distributed_sampler_kwargs,
    }


def _checkpoint(rank: int, tmp: Path) -> dict[str, Any]:
    """PP2 x TP2: save after 2 steps; the 3rd step of a fresh engine resumed from it equals the uninterrupted 3rd step.
    Consolidation merges the slices; the weights load on another grid (DP2 x PP2 without TP, and from there a
    checkpoint without TP into PP1 x DP2 x TP2), the optimizer state there refuses."""
    config = PipelineConfig(micro_batches=MICRO, gradient_clipping=CLIP, tensor_parallel_size=2)
    batches = data(seed=11)
    engine = PipelineEngine(gpt_pipeline(CFG, num_stages=2), make_optimizer, config)
    for b in batches[:2]:
        engine.train_batch(batch=b)
    save_pipeline_checkpoint(engine, tmp / "ckpt")
    out: dict[str, Any] = {"saved_state": tp_full_state(engine.module)}
    out.update(loss=float(engine.train_batch(batch=batches[2])), state=tp_full_state(engine.module))
    resumed = PipelineEngine(gpt_pipeline(CFG, num_stages=2), make_optimizer, config)
    load_pipeline_checkpoint(resumed, tmp / "ckpt")
    out["resumed_loss"] = float(resumed.train_batch(batch=batches[2]))
    out["resumed_state"] = tp_full_state(resumed.module)
    out["files"] = sorted(p.name for p in (tmp / "ckpt").iterdir())
    out["consolidated"] = consolidate_pipeline_checkpoint(tmp / "ckpt") if rank == 0 else None
    other = PipelineEngine(
        gpt_pipeline(CFG, num_stages=2), make_optimizer, PipelineConfig(micro_batches=MICRO)
    )  # DP2 x PP2
    try:
        load_pipeline_checkpoint(other, tmp / "ckpt")
        out["optimizer_error"] = None
    except NotImplementedError as err:
        out["optimizer_error"] = str(err)
    load_pipeline_checkpoint(other, tmp / "ckpt", load_optimizer=False)
    out["other_state"] = {k: v.detach().clone() for k, v in other.module.named_parameters()}
    save_pipeline_checkpoint(other, tmp / "ckpt_no_tp")
    one_stage = PipelineEngine(
        gpt_pipeline(CFG, num_stages=1), make_optimizer, PipelineConfig(micro_batches=MICRO, tensor_parallel_size=2)
    )  # PP1 x DP2 x TP2
    load_pipeline_checkpoint(one_stage, tmp / "ckpt_no_tp", load_optimizer=False)
    out["one_stage_state"] = tp_full_state(one_stage.module)
    return out


def _ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {"lightning": _lightning(world, Path(tmp))}
    runs: dict[str, dict[str, Any]] = {
        "pp2tp2": {"pp": 2},
        "dp2tp2": {"pp": 1, "zero_stage": 1},
        "plan": {"pp": 2, "policy": PLAN},
        "untied": {"pp": 2, "model": "untied"},
        "interleaved": {"pp": 2, "schedule": "interleaved_1f1b", "checkpoint_every": 1},  # 2 chunks per rank
    }
    for name, kwargs in runs.items():
        res = _train(**{"tp": 2, "zero_stage": 0, **kwargs})
        engine = res.pop("engine")
        out[name] = res
    out["ckpt"] = _checkpoint(rank, Path(tmp))
    # TP peers fed different batches (sharded by the global rank): every peer raises
    module = gpt_pipeline(CFG, num_stages=2)
    engine = PipelineEngine(module, make_optimizer, PipelineConfig(micro_batches=2, tensor_parallel_size=2))
    x, y = data()[0]
    try:
        engine.train_batch(batch=(x[rank * 2 : rank * 2 + 2], y[rank * 2 : rank * 2 + 2]))
        out["data_error"] = None
    except ValueError as err:
        out["data_error"] = str(err)
    # a layer that cannot be sharded on stage 1 only: every rank raises (no rank left waiting for the others)
    odd = PipelineModule(
        [LayerSpec(Block, CFG), LayerSpec(OddMLP)],
        loss_fn=torch.nn.functional.mse_loss,
        partition_method="uniform",
        num_stages=2,
    )
    try:
        PipelineEngine(odd, make_optimizer, PipelineConfig(micro_batches=2, tensor_parallel_size=2))
        out["shard_error"] = None
    except Exception as err:  # noqa: BLE001 (the type is checked by the test)
        out["shard_error"] = f"{type(err).__name__}: {err}"
    try:  # a plan entry that matches no stage: every rank raises
        PipelineEngine(
            gpt_pipeline(CFG, num_stages=2),
            make_optimizer,
            PipelineConfig(tensor_parallel_size=2, tp_policy=InjectPolicy(plan={r"layers\.\d+\.nothing": "row"})),
        )
        out["plan_error"] = None
    except ValueError as err:
        out["plan_error"] = str(err)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(
        _ranks, 4, str(tmp_path_factory.mktemp("pptp")), timeout=240, threads=1, init_process_group=False
    )


def _check_run(
    results: list[dict[str, Any]], name: str, dp: int, seed: int = 3, lightning_order: bool = False, model: str = "gpt"
) -> None:
    ref_losses, ref_norms, ref_state = reference(dp, seed, lightning_order, model)
    assert min(ref_norms) > 4 * CLIP  # the clipping bites at every step
    for r in results:
        run = r[name]
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref_losses), **TOL)
        if "norms" in run:
            torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref_norms), **TOL)
        for key, value in run["state"].items():
            torch.testing.assert_close(
                value, ref_state[key], **TOL, msg=lambda m, k=key: f"{name} rank {r[name]['coords']} {k}: {m}"
            )
    merged = {k for r in results for k in r[name]["state"]}
    assert merged == set(ref_state), set(ref_state) ^ merged  # every parameter is checked on some rank


def test_pp2_tp2_matches_single_process(results: list[dict[str, Any]]) -> None:
    assert [r["pp2tp2"]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    _check_run(results, "pp2tp2", dp=1)
    # the blocks really are sharded: a rank holds half of each Linear of its blocks
    shapes = results[0]["pp2tp2"]["shapes"]
    qkv = next(n for n in shapes if n.endswith("attn.qkv.weight"))
    assert shapes[qkv] == (3 * CFG.d_model // 2, CFG.d_model), shapes


def test_pp2_tp2_with_a_user_plan_matches_single_process(results: list[dict[str, Any]]) -> None:
    _check_run(results, "plan", dp=1)
    shapes = results[0]["plan"]["shapes"]
    fc = next(n for n in shapes if n.endswith("mlp.fc.weight"))
    qkv = next(n for n in shapes if n.endswith("attn.qkv.weight"))
    assert shapes[fc] == (4 * CFG.d_model, CFG.d_model) and shapes[qkv] == (3 * CFG.d_model // 2, CFG.d_model), shapes
    for r in results:
        assert r["plan_error"] is not None and "nothing" in r["plan_error"] and "any pipeline stage" in r["plan_error"]


def test_pp2_tp2_untied_embedding_and_head_layer_match_single_process(results: list[dict[str, Any]]) -> None:
    _check_run(results, "untied", dp=1, model="untied")
    last = results[3]["untied"]["shapes"]  # the head layer is vocab-parallel, the first stage's table hidden-split
    assert last[next(n for n in last if n.endswith("lm_head.weight"))] == (CFG.vocab_size // 2, CFG.d_model), last
    first = results[0]["untied"]["shapes"]
    assert first[next(n for n in first if n.endswith("wte.weight"))] == (CFG.vocab_size, CFG.d_model // 2), first


def test_pp2_tp2_interleaved_with_activation_checkpointing_matches_single_process(
    results: list[dict[str, Any]],
) -> None:
    _check_run(results, "interleaved", dp=1)


def test_dp2_tp2_zero1_matches_single_process(results: list[dict[str, Any]]) -> None:
    assert [r["dp2tp2"]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    _check_run(results, "dp2tp2", dp=2)


def test_tp_checkpoint_resumes_exactly_consolidates_and_reshards_the_weights(results: list[dict[str, Any]]) -> None:
    files = results[0]["ckpt"]["files"]
    assert "layer_002-tp00-model_states.pt" in files and "layer_002-tp01-model_states.pt" in files, files
    assert "optim_pp01_dp00_tp01.pt" in files and "tied_embed-model_states.pt" in files, files
    assert "layer_002-tp_layout.pt" in files, files
    full: dict[str, torch.Tensor] = {}  # the saved weights, whole: every rank's full view of its stage
    for r in results:
        full.update(r["ckpt"]["saved_state"])
    consolidated = results[0]["ckpt"]["consolidated"]
    assert full.keys() <= consolidated.keys(), full.keys() - consolidated.keys()
    assert any(v.ndim == 2 for v in full.values())
    for k, v in full.items():
        torch.testing.assert_close(consolidated[k], v, rtol=0, atol=0, msg=k)
    for r in results:
        c = r["ckpt"]
        assert c["resumed_loss"] == c["loss"]
        assert c["state"].keys() == c["resumed_state"].keys()
        for k, v in c["state"].items():
            torch.testing.assert_close(c["resumed_state"][k], v, rtol=0, atol=0)
        assert c["optimizer_error"] is not None and "tensor_parallel_size=2 on 2 stages" in c["optimizer_error"]
        assert "load_optimizer=False" in c["optimizer_error"]
        assert c["other_state"] and c["other_state"].keys() <= full.keys()
        for k, v in c["other_state"].items():  # TP2 checkpoint -> no TP: the merged weights
            torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=k)
        assert c["one_stage_state"].keys() == full.keys()
        for k, v in c["one_stage_state"].items():  # checkpoint without TP -> one stage, TP2: sliced again
            torch.testing.assert_close(v, full[k], rtol=0, atol=0, msg=k)
        saved = r["lightning"]["state"]  # Lightning: the resumed module holds the saved weights
        assert saved.keys() == r["lightning"]["resumed_state"].keys()
        for k, v in saved.items():
            torch.testing.assert_close(r["lightning"]["resumed_state"][k], v, rtol=0, atol=0)


def test_tp_mismatched_data_and_unshardable_layer_raise(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["data_error"] is not None and "data-parallel rank" in r["data_error"]
    for r in results[:2]:  # stage 0 learns that stage 1 failed
        assert r["shard_error"] is not None and r["shard_error"].startswith(
            "RuntimeError: tensor parallelism could not"
        )
    for r in results[2:]:
        assert r["shard_error"] is not None and r["shard_error"].startswith("InjectError") and "fc" in r["shard_error"]


def test_grid_layout_and_errors() -> None:
    grid = PipeGrid.from_world(8, 5, 2, 2)  # rank = (stage * dp + dp_rank) * tp + tp_rank
    assert (grid.pp, grid.dp, grid.tp, grid.stage, grid.dp_rank, grid.tp_rank) == (2, 2, 2, 1, 0, 1)
    assert grid.pipe_ranks(0, 1) == [1, 5] and grid.dp_ranks(1, 1) == [5, 7] and grid.tp_ranks(1, 0) == [4, 5]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must be an int >= 1 dividing the world size 8"):
        PipeGrid.from_world(8, 0, 2, 3)
    with pytest.raises(ValueError, match=r"num_stages=3 must divide the world size 8 / tensor_parallel_size 2 = 4"):
        PipeGrid.from_world(8, 0, 3, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        PipelineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tp_policy must be None or a zlightning.inject.InjectPolicy"):
        PipelineConfig(tensor_parallel_size=2, tp_policy={"plan": {}})  # type: ignore[arg-type]


def test_lightning_pp2_tp2_matches_single_process(results: list[dict[str, Any]]) -> None:
    assert [r["lightning"]["coords"] for r in results] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]
    _check_run(results, "lightning", dp=1, seed=7, lightning_order=True)
    for r in results:  # one data-parallel replica: TP peers and stages read the same samples and are not counted
        assert r["lightning"]["sampler"] == {"num_replicas": 1, "rank": 0}
        assert r["lightning"]["replicas"] == 1.0
        assert r["lightning"]["batch_count"] == STEPS
        assert r["lightning"]["votes"] == [True, True, False]  # decisions (early stopping...) are agreed by all ranks
