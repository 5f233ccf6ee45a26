"""``zlightning.loggers.TensorBoardLogger``: tags grouped by concern, no ``hp_metric`` or top-level ``epoch`` card,
the validation loss charted; ``self.log`` keys (callback metrics, checkpoint monitors) unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from zlightning.loggers import TensorBoardLogger, section_tag


@pytest.mark.parametrize(
    ("tag", "expected"),
    [
        ("epoch", "progress/epoch"),
        ("train/loss", "loss/train"),
        ("val/loss", "loss/val"),
        ("val_loss", "loss/val"),
        ("train_loss_step", "loss/train_step"),
        ("val/ppl", "loss/val_ppl"),
        ("train/tokens_per_s", "throughput/tokens_per_s"),
        ("val/tokens_per_s", "throughput/val_tokens_per_s"),
        ("test_samples_per_sec", "throughput/test_samples_per_sec"),
        ("train|device/batches_per_sec", "throughput/device_batches_per_sec"),
        ("train/rss_mb", "memory/rss_mb"),
        ("val/rss_mb", "memory/val_rss_mb"),
        ("memory/zero_params_mb", "memory/zero_params_mb"),
        ("offload/swap_read_MBps", "offload/swap_read_MBps"),
        ("curriculum/seqlen_truncate", "curriculum/seqlen_truncate"),
        ("pipeline/bubble_simulated", "pipeline/bubble_simulated"),
        ("lr-AdamW", "optim/lr-AdamW"),
        ("my/own", "my/own"),
    ],
)
def test_section_tag(tag: str, expected: str) -> None:
    assert section_tag(tag) == expected


def test_invalid_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="not a valid regex"):
        TensorBoardLogger("unused", sections=[("(", "x")])


class _Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 4})
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train/loss", loss)
        self.log("train/tokens_per_s", 100.0 + batch_idx)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))
        self.log("val/tokens_per_s", -1.0)  # a rate of validation's own: never drawn into training's chart

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_fit_writes_sectioned_tags(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=8,
        val_check_interval=4,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(_Module(), DataLoader(data, batch_size=2), DataLoader(data, batch_size=8))
    assert "val/loss" in trainer.callback_metrics and "train/loss" in trainer.callback_metrics  # keys unchanged
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss/train", "loss/val", "throughput/tokens_per_s", "progress/epoch"} <= tags, tags
    assert not tags & {"hp_metric", "epoch", "train/loss", "val/loss"}, tags
    assert [e.step for e in events.Scalars("loss/val")] == [3, 7]  # one point per validation: a line, not a dot
    assert all(e.value >= 100 for e in events.Scalars("throughput/tokens_per_s")), "validation's rate mixed in"
    assert [e.value for e in events.Scalars("throughput/val_tokens_per_s")] == [-1.0, -1.0]


def test_tags_that_meet_are_kept_apart(tmp_path: Path) -> None:
    """A user's rules that send two keys to one tag: the second key is written as logged (one warning), so that
    no chart mixes two series and nothing is lost."""
    logger = TensorBoardLogger(str(tmp_path), name="run", sections=[(r"(?:\w+)/loss", "loss")])
    with pytest.warns(UserWarning, match="'val/loss' and 'train/loss' both map to the tag 'loss'"):
        for step in range(3):
            logger.log_metrics({"train/loss": 1.0 + step, "val/loss": -1.0 - step}, step)
    logger.finalize("success")
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    assert [e.value for e in events.Scalars("loss")] == [1.0, 2.0, 3.0]
    assert [e.value for e in events.Scalars("val/loss")] == [-1.0, -2.0, -3.0]
