"""`CurriculumDataModule` under a real Lightning Trainer: truncation, logging, exact resume, and 2-rank DP slicing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor, nn
from torch.utils.data import Dataset
from zlightning.datamodules.curriculum import CurriculumDataModule, write_metric_index

from zlightning.testing import run_distributed

N, T = 400, 32


class IdDataset(Dataset):
    """Sample i is ``(x, y)`` with every position holding i, so a batch tells which samples it holds."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = torch.full((T,), i, dtype=torch.int64)
        return x, x


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[tuple[list[int], int]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, _ = batch
        self.seen.append((x[:, 0].tolist(), x.shape[1]))
        return (self.w * x.float().mean() * 1e-3).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _metric_values() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 101, N)


def _config(root: str, workers: int = 0) -> dict[str, Any]:
    write_metric_index(Path(root) / "m", "m", _metric_values())
    return {
        "seed": 3,
        "data_sampling": {
            "num_epochs": 10,
            "num_workers": workers,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": str(Path(root) / "clusters"),
                "curriculum_metrics": {
                    "m": {
                        "index_to_sample_path": f"{root}/m/m_index_to_sample",
                        "index_to_metric_path": f"{root}/m/m_index_to_metric",
                        "difficulty_type": "value",
                        "clustering_type": "schedule_based",
                        "min_difficulty": 10,
                        "max_difficulty": 100,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 10},
                    },
                    "seqlen_truncate": {
                        "clustering_type": "single_cluster",
                        "min_difficulty": 8,
                        "max_difficulty": T,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 8},
                    },
                },
            },
        },
    }


def _fit(
    root: str,
    max_steps: int,
    ckpt: str | None = None,
    workers: int = 0,
    model: Recorder | None = None,
    dm: CurriculumDataModule | None = None,
    **trainer_kw: Any,
) -> tuple[Recorder, pl.Trainer]:
    model = model if model is not None else Recorder()
    if dm is None:
        dm = CurriculumDataModule(_config(root, workers), dataset=IdDataset(), micro_batch_size=4)
    kw: dict[str, Any] = dict(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer = pl.Trainer(**(kw | trainer_kw))
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model, trainer


def test_truncation_bound_and_tensorboard(tmp_path: Path) -> None:
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    model, _ = _fit(str(tmp_path), 10, logger=logger)
    lengths = [length for _, length in model.seen]
    assert len(model.seen) == 20 and all(len(ids) == 4 for ids, _ in model.seen)
    assert lengths[0] == 8 and lengths[-1] == T and lengths == sorted(lengths)  # short sequences first
    assert lengths[0::2] == lengths[1::2]  # one difficulty per optimizer step (2 micro-batches)
    vals = _metric_values()
    for step, (ids, _) in enumerate(model.seen[::2], start=1):
        raw = int(step / 8 * 90 + 10)
        assert vals[ids].max() <= min(100, raw - raw % 10)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    trunc = [e.value for e in acc.Scalars("curriculum/seqlen_truncate")]
    consumed = [e.value for e in acc.Scalars("curriculum/consumed_samples")]
    assert trunc[0] == 8 and trunc[-1] == T and trunc == sorted(trunc)
    assert consumed[:3] == [4, 12, 20]  # first micro-batch of each optimizer step


def test_exact_resume_through_a_checkpoint(tmp_path: Path) -> None:
    ref, _ = _fit(str(tmp_path / "a"), 8)
    # A loader worker prefetches (2 batches per worker), so the sampler runs ahead of training when it is saved.
    first, trainer = _fit(str(tmp_path / "b"), 3, workers=1)
    assert trainer.datamodule.sampler.micro_batches > 6  # type: ignore[union-attr]
    ckpt = str(tmp_path / "mid.ckpt")
    trainer.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["CurriculumDataModule"]["sampler"]["micro_batches"] == 6
    second, _ = _fit(str(tmp_path / "b"), 8, ckpt=ckpt, workers=1)
    assert first.seen + second.seen == ref.seen


def _ddp_rank(rank: int, world: int, root: str) -> tuple[list[tuple[list[int], int]], list[tuple[list[int], int]]]:
    model, trainer = _fit(root, 4, strategy="ddp", devices=world)
    assert trainer.datamodule.sampler.data_parallel_size == world  # type: ignore[union-attr]
    # Resume on 2 ranks: stop after 1 optimizer step (Lightning has prefetched ahead), checkpoint, resume to 4.
    first, trainer = _fit(root, 1, strategy="ddp", devices=world)
    ckpt = f"{root}/ddp_mid.ckpt"
    trainer.save_checkpoint(ckpt)
    second, _ = _fit(root, 4, ckpt=ckpt, strategy="ddp", devices=world)
    return model.seen, first.seen + second.seen


def test_two_ranks_slice_one_global_batch_and_resume(tmp_path: Path) -> None:
    runs = run_distributed(_ddp_rank, 2, str(tmp_path), init_process_group=False, timeout=240)
    assert runs[0][1] == runs[0][0] and runs[1][1] == runs[1][0]  # resumed run == uninterrupted run, per rank
    ranks = [runs[0][0], runs[1][0]]
    single = CurriculumDataModule(_config(str(tmp_path)), dataset=IdDataset(), micro_batch_size=4)
    ref = single.build_sampler(dp_rank=0, dp_size=2, grad_accum=2)
    assert len(ranks[0]) == len(ranks[1]) == 8
    for k, ((ids0, len0), (ids1, len1)) in enumerate(zip(*ranks)):
        if k % 2 == 0:
            ref.get_next_global_batch()
            glob = ref.batch
        mb = glob[(k % 2) * 8 : (k % 2 + 1) * 8]
        assert ids0 + ids1 == mb and len0 == len1  # contiguous rank slices, same truncation (lockstep)


def test_example_yaml_trains_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/gpt_curriculum.yaml, shrunk, through `zlightning fit`: truncated batches and the TensorBoard tag."""
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from zlightning.cli import main

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(repo)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["zlightning"])
    base = "--data.init_args.base.init_args"
    main(
        [
            "fit",
            "--config",
            "examples/gpt_curriculum.yaml",
            "--trainer.accelerator=cpu",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--model.d_model=32",
            "--model.n_layer=1",
            "--model.n_head=2",
            "--model.seq_len=32",
            f"{base}.seq_len=32",
            f"{base}.max_bytes=100000",
            f"{base}.batch_size=4",
        ]
    )
    (log_dir,) = tmp_path.glob("gpt_curriculum/version_*")
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    assert [e.value for e in acc.Scalars("curriculum/seqlen_truncate")] == [16.0] * 4  # min_difficulty first
    assert [e.value for e in acc.Scalars("curriculum/consumed_samples")] == [4.0, 8.0, 12.0, 16.0]


def test_custom_schedule_through_the_module_and_the_users_batch_hook_still_runs(tmp_path: Path) -> None:
    root = str(tmp_path)
    config = _config(root)
    metric = config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["m"]
    metric.update(schedule_type="custom", schedule_config={})
    steps: list[int] = []

    def difficulty(step: int) -> int:  # 30 for the first 4 optimizer steps, then everything
        steps.append(step)
        return 30 if step <= 4 else 100

    class Hooked(Recorder):
        transfers = 0

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            self.transfers += 1
            return batch

    dm = CurriculumDataModule(config, dataset=IdDataset(), micro_batch_size=4, custom_schedules={"m": difficulty})
    model, _ = _fit(root, 6, model=Hooked(), dm=dm)
    vals = _metric_values()
    assert steps[:5] == [1, 2, 3, 4, 5]  # (not called again once it returned max_difficulty)
    assert all(vals[ids].max() <= 30 for ids, _ in model.seen[:8])
    assert any(vals[ids].max() > 30 for ids, _ in model.seen[8:])
    assert model.transfers == len(model.seen) == 12
