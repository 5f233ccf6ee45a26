"""SLURM: every zstack strategy runs through Lightning's ``SLURMEnvironment`` when the variables are set
the way ``srun --nodes=2 --ntasks-per-node=1`` sets them for its 2 tasks (here two processes of one machine, each
playing one node)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._fork_ranks import RankForker

STRATEGIES = [
    "zstack_zero3",
    "zstack_zero2",
    "zstack_zero1",
    "zstack_zero3_offload",
    "zstack_zero3_nvme",
    "zstack_pipeline",
]


def _srun_env(rank: int, tmp: Path) -> dict[str, str]:
    """What ``srun`` exports to task ``rank`` of a 2-node job with one task per node (``MASTER_ADDR`` is set by
    the batch script, as usual, since the node names here do not resolve)."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOBID": "4242",
        "SLURM_JOB_NAME": "train",
        "SLURM_NTASKS": "2",
        "SLURM_NPROCS": "2",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_TASKS_PER_NODE": "1(x2)",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODELIST": "node[1-2]",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": str(rank),
        "SLURMD_NODENAME": f"node{rank + 1}",
        "SLURM_GTIDS": str(rank),
        "SLURM_CPUS_ON_NODE": "1",
        "TMPDIR": str(tmp / f"node{rank + 1}"),  # each "node" has its own local disk (NVMe swap goes there)
    }


def _fit(_: int, world: int, root: str, strategy: str) -> None:
    """Two steps of ``strategy`` on 2 nodes x 1 device; each task writes what Lightning saw to ``result<r>.json``."""
    import lightning.pytorch as pl
    import torch
    from lightning.fabric.plugins.environments import SLURMEnvironment
    from torch import nn

    import zlightning  # noqa: F401 (registers the strategies)
    from tests._lightning_models import TinyGPTModule, loader

    seen: list[float] = []
    if strategy == "zstack_pipeline":
        from zlightning.pipe import PipelineModule

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.pipe = PipelineModule(
                    layers=[nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16)],
                    loss_fn=lambda out, y: (out - y).square().mean(),
                    num_stages=2,
                )

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                seen.append(float(batch[0].sum()))
                return self.pipe.batch_loss((batch[0], batch[0]))

            def configure_optimizers(self) -> torch.optim.Optimizer:
                return torch.optim.SGD(self.parameters(), lr=0.1)

        module: pl.LightningModule = Module()
        data: Any = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16)), batch_size=4)
    else:

        class GPT(TinyGPTModule):
            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                seen.append(float(batch[0].float().sum()))
                return super().training_step(batch, batch_idx)

        module, data = GPT(), loader(4, 2, world)
    Path(os.environ["TMPDIR"]).mkdir(parents=True, exist_ok=True)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, train_dataloaders=data)
    env = trainer.strategy.cluster_environment
    losses = getattr(module, "losses", [])
    out = {
        "environment": type(env).__name__,
        "slurm": isinstance(env, SLURMEnvironment),
        "world": trainer.world_size,
        "rank": trainer.global_rank,
        "node": trainer.node_rank,
        "local": trainer.local_rank,
        "nodes": trainer.num_nodes,
        "steps": trainer.global_step,
        "seen": seen,
        "losses": losses,
    }
    Path(root, f"result{trainer.global_rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def forker() -> Iterator[RankForker]:
    with RankForker(2) as parent:
        yield parent


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_zstack_strategy_runs_under_slurm(tmp_path: Path, forker: RankForker, strategy: str) -> None:
    forker.start(
        "tests.test_slurm:_fit",
        tmp_path / "logs",
        rank_env=[_srun_env(r, tmp_path) for r in range(2)],
        torchrun_env=False,
        env={"ZLIGHTNING_ERROR_DIR": str(tmp_path / "errors")},
        root=str(tmp_path),
        strategy=strategy,
    )
    statuses = forker.wait(timeout=120)
    assert statuses == [0, 0], (
        statuses,
        (tmp_path / "logs" / "rank0.log").read_text()[-3000:],
        (tmp_path / "logs" / "rank1.log").read_text()[-3000:],
    )
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(results):
        assert r["environment"] == "SLURMEnvironment" and r["slurm"], r
        assert (r["world"], r["rank"], r["node"], r["local"], r["nodes"], r["steps"]) == (2, rank, rank, 0, 2, 2), r
    if strategy != "zstack_pipeline":  # data parallel: each node reads its own part of every batch
        assert results[0]["seen"] != results[1]["seen"], results
        assert all(loss == loss for r in results for loss in r["losses"]) and len(results[0]["losses"]) == 2
