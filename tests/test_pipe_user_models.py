"""``zstack_pipeline`` and ``PipelineEngine`` with what users' own training code does (found by probing them the way
users do), against one process:

* ZeRO-2/3 inside stages with an optimizer that groups parameters by ``p.ndim`` (weight decay on matrices only, its
  own learning rate for biases and norms): the optimizer factory and ``configure_optimizers`` see full shapes, so
  the groups are those of one process (they saw 1-D shard pieces and put everything in the no-decay group);
* a checkpoint resumed onto another grid (here: another schedule, so another split) keeps the learning rate an LR
  scheduler had moved when the optimizer holds no per-parameter state (SGD without momentum): the next step equals
  the uninterrupted run's (the resumed optimizer restarted from the initial learning rate);
* layers frozen by name in the LightningModule's ``setup`` hook stay frozen, as in one process (the hook saw an
  unbuilt module without parameters, so nothing was frozen and the run silently trained every layer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from tests._pipe_reference import one_process_losses
from zlightning.pipe import (
    LayerSpec,
    PipelineConfig,
    PipelineEngine,
    PipelineModule,
    load_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from zlightning.testing import run_distributed

D, C, GLOBAL_BATCH, STEPS, MICRO = 6, 3, 8, 4, 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _layers() -> list[Any]:
    return [
        LayerSpec(nn.Linear, D, 16),
        nn.Tanh(),
        LayerSpec(nn.Linear, 16, 12),
        LayerSpec(nn.LayerNorm, 12),
        LayerSpec(nn.Linear, 12, C),
    ]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y)


def _pipe() -> PipelineModule:
    return PipelineModule(_layers(), loss_fn=_loss, partition_method="uniform")


def _grouped_adamw(params: Any) -> torch.optim.Optimizer:
    """The usual recipe: decay matrices only, a smaller learning rate for vectors (biases, norms)."""
    params = list(params)
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.5},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "lr": 0.003},
        ],
        lr=0.02,
    )


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * GLOBAL_BATCH, D, generator=g)
    y = torch.randint(0, C, (STEPS * GLOBAL_BATCH,), generator=g)
    return [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)]


def _replica(x: torch.Tensor, dp_rank: int, dp: int) -> torch.Tensor:
    per = x.shape[0] // dp
    return x[dp_rank * per : (dp_rank + 1) * per]


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    pipe = _pipe().build()
    opt = _grouped_adamw(pipe.parameters())
    losses = one_process_losses(pipe, opt, _batches())
    return losses, {k: v.detach().clone() for k, v in pipe.state_dict().items()}


class _Lit(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.pipe = _pipe()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.pipe.batch_loss(tuple(batch))
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _grouped_adamw(self.parameters())


def _zero_grouped_rank(rank: int, world: int) -> dict[str, Any]:
    """DP2 x PP2: the engine under ZeRO-2 with a grouping factory, then Lightning under ZeRO-3 with grouping
    ``configure_optimizers``."""
    from zlightning.strategies import PipelineStrategy

    out: dict[str, Any] = {}
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy=PipelineStrategy(num_stages=2, config=PipelineConfig(micro_batches=MICRO, zero_stage=3)),
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # each replica takes its half of every global batch, as the reference
    )
    module = _Lit()
    dp, dp_rank = 2, rank % 2
    xs = torch.cat([_replica(x, dp_rank, dp) for x, _ in _batches()])
    ys = torch.cat([_replica(y, dp_rank, dp) for _, y in _batches()])
    trainer.fit(module, DataLoader(TensorDataset(xs, ys), batch_size=GLOBAL_BATCH // dp))
    engine = trainer.strategy.engine  # type: ignore[attr-defined]
    groups = [[tuple(p.shape) for p in g["params"]] for g in trainer.optimizers[0].param_groups]
    out["lightning"] = {"losses": module.losses, "state": engine.zero.full_state_dict(), "groups": groups}

    engine = PipelineEngine(_pipe(), _grouped_adamw, PipelineConfig(micro_batches=MICRO, zero_stage=2), num_stages=2)
    losses = [
        float(engine.train_batch(batch=(_replica(x, dp_rank, dp), _replica(y, dp_rank, dp)))) for x, y in _batches()
    ]
    out["engine"] = {"losses": losses, "state": engine.zero.full_state_dict()}
    return out


@pytest.fixture(scope="module")
def zero_grouped_runs() -> list[dict[str, Any]]:
    return run_distributed(_zero_grouped_rank, 4, init_process_group=False, timeout=300)


@pytest.mark.parametrize("key", ["lightning", "engine"])
def test_zero_in_stages_keeps_ndim_param_groups(zero_grouped_runs: list[dict[str, Any]], key: str) -> None:
    ref_losses, ref_state = _reference()
    merged: dict[str, torch.Tensor] = {}
    for r in zero_grouped_runs:
        torch.testing.assert_close(r[key]["losses"], ref_losses, **TOL)
        merged.update(r[key]["state"])
    assert set(merged) == set(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(merged[name], value, **TOL, msg=name)
    if key == "lightning":  # the groups hold this rank's shard pieces (1-D), matrices in the first one
        for r in zero_grouped_runs:
            decay, vectors = r[key]["groups"]
            assert decay and vectors and all(len(s) == 1 for s in decay + vectors), r[key]["groups"]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.4)  # no momentum: no per-parameter state at all


def _resume_other_schedule_rank(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    batches = _batches()
    engine = PipelineEngine(_pipe(), _sgd, PipelineConfig(micro_batches=MICRO), num_stages=2)
    scheduler = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)  # type: ignore[arg-type]
    for x, y in batches[:2]:
        engine.train_batch(batch=(x, y))
        scheduler.step()
    save_pipeline_checkpoint(engine, Path(ckpt))
    engine.train_batch(batch=batches[2])
    resumed = PipelineEngine(_pipe(), _sgd, PipelineConfig(micro_batches=MICRO, schedule="zbv"), num_stages=2)
    load_pipeline_checkpoint(resumed, Path(ckpt))
    lrs = (engine.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"])  # type: ignore[union-attr]
    resumed.train_batch(batch=batches[2])
    return {"lrs": lrs, "next": dict(engine.module.state_dict()), "resumed": dict(resumed.module.state_dict())}


def test_resume_on_another_split_keeps_the_scheduled_learning_rate(tmp_path: Path) -> None:
    runs = run_distributed(_resume_other_schedule_rank, 2, str(tmp_path / "ckpt"), timeout=240)
    expected: dict[str, torch.Tensor] = {}
    resumed: dict[str, torch.Tensor] = {}
    for r in runs:
        assert r["lrs"] == (0.1, 0.1), r["lrs"]  # 0.4 halved twice (the bug: 0.4, the initial one)
        expected.update(r["next"])
        resumed.update(r["resumed"])
    assert set(resumed) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(resumed[name], value, **TOL, msg=name)


class _FreezeFirstLayer(_Lit):
    """Freezes layer 0 by name in ``setup``, the way a fine-tuning script does."""

    def setup(self, stage: str) -> None:
        for name, p in self.pipe.named_parameters():
            if name.startswith("0."):
                p.requires_grad_(False)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=0.02)


def _freeze_in_setup_rank(rank: int, world: int) -> dict[str, Any]:
    from zlightning.strategies import PipelineStrategy

    pl.seed_everything(0, verbose=False)
    module = _FreezeFirstLayer()
    trainer = pl.Trainer(
        strategy=PipelineStrategy(num_stages=2, micro_batches=MICRO),
        accelerator="cpu",
        devices=world,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    xs, ys = (torch.cat(t) for t in zip(*_batches()))
    trainer.fit(module, DataLoader(TensorDataset(xs, ys), batch_size=GLOBAL_BATCH))
    return {"losses": module.losses, "state": dict(module.pipe.state_dict())}


def test_layers_frozen_in_the_setup_hook_stay_frozen() -> None:
    runs = run_distributed(_freeze_in_setup_rank, 2, init_process_group=False, timeout=240)
    pipe = _pipe().build()
    initial = {k: v.clone() for k, v in pipe.state_dict().items()}
    pipe.get_submodule("0").requires_grad_(False)
    opt = torch.optim.AdamW([p for p in pipe.parameters() if p.requires_grad], lr=0.02)
    losses = one_process_losses(pipe, opt, _batches())
    merged: dict[str, torch.Tensor] = {}
    for r in runs:
        torch.testing.assert_close(r["losses"], losses, **TOL)
        merged.update(r["state"])
    torch.testing.assert_close(merged["0.weight"], initial["0.weight"], rtol=0, atol=0)
    assert set(merged) == set(pipe.state_dict())
    for name, value in pipe.state_dict().items():
        torch.testing.assert_close(merged[name], value, **TOL, msg=name)
