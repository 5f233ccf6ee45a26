"""The compression callbacks on models other than the tiny GPT, used as Lightning users do: an embedding + LayerNorm +
nested ModuleDict/ModuleList classifier (a Linear without bias), evaluated with validate/test/predict after fit from
a checkpoint in a fresh Trainer."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

VOCAB = 50


class Classifier(pl.LightningModule):
    """Embedding + LayerNorm + ``layers["a"][0..1]`` (the first without bias) + a classifier head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 16)
        self.norm = nn.LayerNorm(16)
        self.layers = nn.ModuleDict({"a": nn.ModuleList([nn.Linear(16, 32, bias=False), nn.Linear(32, 16)])})
        self.out = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x)).mean(1)
        return self.out(self.layers["a"][1](torch.relu(self.layers["a"][0](h))))

    def _loss(self, batch: Any) -> torch.Tensor:
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._loss(batch)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _data(n: int = 32) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, VOCAB, (n, 6), generator=g), torch.randint(0, 5, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    base: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(callbacks=callbacks, **{**base, **kwargs})


def _quantize_and_prune() -> list[pl.Callback]:
    from zlightning.callbacks import SparsePruning, WeightQuantization

    return [
        SparsePruning(r"layers\.a\.0$", dense_ratio=0.25, schedule_offset=2),
        WeightQuantization(r"layers|out", target_bits=4, start_bits=8, quantization_period=1, schedule_offset=1),
    ]


def test_validate_test_predict_from_a_checkpoint_in_a_fresh_trainer(tmp_path: Any) -> None:
    """A fresh module and Trainer given ``ckpt_path`` evaluate the compressed model the checkpoint holds: the masks'
    keys load, and the schedule is the checkpoint's step (the fresh Trainer's global_step is 0), so the metrics and
    predictions equal those of the fitted module. Before the fix, loading failed on the mask keys (test/validate/
    predict did not compress the module) and, with weight quantization alone, the model was evaluated uncompressed."""
    fitted = Classifier()
    trainer = _trainer(_quantize_and_prune(), max_steps=6)
    trainer.fit(fitted, _data())
    ckpt = str(tmp_path / "c.ckpt")
    trainer.save_checkpoint(ckpt)
    expected_test = trainer.test(fitted, _data(), verbose=False)[0]["test_loss"]
    expected_pred = torch.cat(trainer.predict(fitted, _data()))
    fc = fitted.layers["a"][0]
    assert fc.sparse_pruning.active and fc.weight_quantization.bits == 5  # 8 at step 1, 7/6/5 at steps 2/3/5

    for stage in ("validate", "test", "predict"):
        fresh = Classifier()
        fresh_trainer = _trainer(_quantize_and_prune())
        got = getattr(fresh_trainer, stage)(
            fresh, _data(), ckpt_path=ckpt, **({} if stage == "predict" else {"verbose": False})
        )
        if stage == "predict":
            torch.testing.assert_close(torch.cat(got), expected_pred, rtol=0, atol=0)
        else:
            assert got[0][f"{'val' if stage == 'validate' else 'test'}_loss"] == expected_test
        fresh_fc = fresh.layers["a"][0]
        assert fresh_fc.sparse_pruning.active and fresh_fc.weight_quantization.bits == 5
        torch.testing.assert_close(fresh_fc.sparse_pruning.mask, fc.sparse_pruning.mask, rtol=0, atol=0)

    # the fitted module in a new Trainer without a checkpoint: kept as compressed, not compressed twice
    again = _trainer(_quantize_and_prune()).test(fitted, _data(), verbose=False)[0]["test_loss"]
    assert again == expected_test
