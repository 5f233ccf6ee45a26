"""Conformance of the pipeline seed APIs with DeepSpeed's, called exactly as DeepSpeed's documentation and code call them.

``PipelineEngine.train_batch(data_iter=None)``: the iterator passed once is reused by later ``train_batch()`` calls
(DeepSpeed's pipeline tutorial: ``engine.train_batch()`` in the loop after ``deepspeed.initialize(training_data=...)``,
or ``engine.train_batch(data_iter=train_iter)``), exactly ``micro_batches`` items per call.
``PipelineEngine.eval_batch(data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
num_micro_batches=None)``: each argument with DeepSpeed's meaning, on 2 gloo ranks (PP=2) against one process.
A ``PipelineModule`` used without a pipeline engine (a Lightning Trainer with its default strategy, or a plain
optimizer) builds its single stage itself.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zlightning.pipe import LayerSpec, PipelineConfig, PipelineEngine, PipelineModule
from zlightning.testing import run_distributed

MICRO, LR = 2, 0.1
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _layers() -> list[Any]:
    return [LayerSpec(nn.Linear, 6, 8), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.Linear, 8, 2)]


def make_module(num_stages: int | None = None) -> PipelineModule:
    return PipelineModule(_layers(), loss_fn=nn.functional.mse_loss, num_stages=num_stages, partition_method="uniform")


def items(n: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 6, generator=g), torch.randn(3, 2, generator=g)) for _ in range(n)]


def reference() -> dict[str, Any]:
    """One process: two optimizer steps of ``MICRO`` micro-batches, then the evaluations the ranks run."""
    model = make_module().build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"train": []}
    train = items(2 * MICRO, seed=0)
    for step in range(2):
        losses = [model.compute_loss(model(x), y) for x, y in train[step * MICRO : (step + 1) * MICRO]]
        (sum(losses) / MICRO).backward()
        opt.step()
        opt.zero_grad()
        out["train"].append(float(sum(losses).detach()) / MICRO)
    with torch.no_grad():
        ev = items(3, seed=1)
        losses = [model.compute_loss(model(x), y) for x, y in ev]
        out["eval_avg"] = float(sum(losses[:MICRO]) / MICRO)
        out["eval_none"] = [float(v) for v in losses[:MICRO]]
        out["eval_three"] = float(sum(losses) / 3)
        out["logits"] = torch.cat([model(x) for x, _ in ev[:MICRO]])
        out["outputs_avg"] = sum(model(x) for x, _ in ev[:MICRO]) / MICRO
        out["eval_one"] = float(losses[0])
        out["logits_one"] = model(ev[0][0])
    return out


def rank_main(rank: int, world: int) -> dict[str, Any]:
    engine = PipelineEngine(
        make_module(num_stages=2), lambda ps: torch.optim.SGD(ps, lr=LR), PipelineConfig(micro_batches=MICRO)
    )
    out: dict[str, Any] = {}
    train_iter = iter(items(2 * MICRO, seed=0))
    out["train"] = [float(engine.train_batch(data_iter=train_iter))]  # DeepSpeed tutorial: train_batch(data_iter=...)
    out["train"].append(float(engine.train_batch()))  # ... and later calls without an argument reuse it
    out["exhausted"] = next(train_iter, None) is None  # exactly MICRO items per call
    ev = items(3, seed=1)
    out["eval_avg"] = engine.eval_batch(iter(ev))  # Megatron-DeepSpeed: loss = model.eval_batch(data_iterator)
    out["eval_none"] = engine.eval_batch(data_iter=iter(ev), reduce_output=None)
    out["eval_no_bcast"] = engine.eval_batch(iter(ev), bcast_loss=False)
    out["eval_three"] = engine.eval_batch(iter(ev), num_micro_batches=3)
    loss, logits = engine.eval_batch(iter(ev), return_logits=True)
    out["return_logits"] = (loss, logits)
    out["outputs_avg"] = engine.eval_batch(iter(ev), compute_loss=False)
    out["outputs_none"] = engine.eval_batch(iter(ev), compute_loss=False, reduce_output=None)
    out["one"] = engine.eval_batch(iter(ev), return_logits=True, num_micro_batches=1)
    with pytest.raises(ValueError, match="supported reductions are 'avg' and None"):
        engine.eval_batch(iter(ev), reduce_output="sum")  # type: ignore[arg-type]
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients enabled"):
        engine.train_batch()
    with pytest.raises(ValueError, match="ran out after 0"):
        engine.train_batch()  # the training iterator is exhausted (eval_batch did not touch it)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(rank_main, 2, timeout=200)


def test_train_batch_reuses_its_iterator(runs: list[dict[str, Any]]) -> None:
    ref = reference()
    for r in runs:
        torch.testing.assert_close(r["train"], ref["train"], **TOL)
        assert r["exhausted"]


def test_eval_batch_arguments_mean_what_deepspeed_means(runs: list[dict[str, Any]]) -> None:
    ref = reference()
    first, last = runs
    for r in runs:  # bcast_loss=True (default): every stage returns the loss
        torch.testing.assert_close(float(r["eval_avg"]), ref["eval_avg"], **TOL)
        torch.testing.assert_close([float(v) for v in r["eval_none"]], ref["eval_none"], **TOL)
        torch.testing.assert_close(float(r["eval_three"]), ref["eval_three"], **TOL)
        torch.testing.assert_close(float(r["return_logits"][0]), ref["eval_avg"], **TOL)
        torch.testing.assert_close(float(r["one"][0]), ref["eval_one"], **TOL)
    assert first["eval_no_bcast"] is None  # bcast_loss=False: only the last stage has the value
    torch.testing.assert_close(float(last["eval_no_bcast"]), ref["eval_avg"], **TOL)
    assert first["return_logits"][1] is None and first["outputs_avg"] is None and first["outputs_none"] is None
    torch.testing.assert_close(last["return_logits"][1], ref["logits"], **TOL)
    torch.testing.assert_close(last["outputs_avg"], ref["outputs_avg"], **TOL)  # compute_loss=False: outputs averaged
    torch.testing.assert_close(torch.cat(last["outputs_none"]), ref["logits"], **TOL)
    torch.testing.assert_close(last["one"][1], ref["logits_one"], **TOL)  # one micro-batch: DeepSpeed's logits exactly


# ---------------------------------------------------------------------------------------------------- no pipeline
class LitPipe(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = make_module()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipe.batch_loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            self.parameters(), lr=LR
        )  # DeepSpeed users' PipelineModule, Lightning's default strategy


def test_pipeline_module_without_a_pipeline_builds_its_single_stage() -> None:
    x, y = torch.randn(8, 6, generator=torch.Generator().manual_seed(2)), torch.randn(8, 2)
    pl.seed_everything(0, verbose=False)
    lit = LitPipe()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(lit, DataLoader(TensorDataset(x, y), batch_size=4))
    ref = make_module().build()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for xb, yb in zip(x.split(4), y.split(4)):
        ref.compute_loss(ref(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    assert lit.pipe.bounds == [0, 4]
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(lit.pipe.state_dict()[name], value, **TOL, msg=name)
    plain = make_module()  # outside Lightning: a plain optimizer over parameters(), forward, state_dict
    assert len(list(plain.parameters())) == 6 and plain.is_built
    plain.load_state_dict(ref.state_dict())
    torch.testing.assert_close(plain(x), ref(x), **TOL)


def test_a_module_counted_before_the_engine_is_rebuilt_for_the_split() -> None:
    module = make_module()
    assert sum(p.numel() for p in module.parameters()) == 6 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2  # built whole
    engine = PipelineEngine(module, lambda ps: torch.optim.SGD(ps, lr=LR), PipelineConfig(micro_batches=MICRO))
    assert module.bounds == [0, 4] and engine.optimizer is not None
    claimed = make_module()
    claimed.claim()
    assert list(claimed.parameters()) == [] and not claimed.is_built
    with pytest.raises(RuntimeError, match="claimed by a pipeline engine but not built"):
        claimed(torch.zeros(1, 6))
    stale = torch.optim.SGD(make_module().parameters(), lr=LR)
    with pytest.raises(ValueError, match="not parameters of this rank's stage.*factory"):
        PipelineEngine(make_module(), stale, PipelineConfig(micro_batches=MICRO))
