"""LightningModules and a rank entry point shared by the strategy tests."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests._zero_models import batches, gpt_loss, tiny_gpt


class TinyGPTModule(pl.LightningModule):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.model = tiny_gpt()
        self.lr = lr
        self.losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)[0]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = gpt_loss(self.model, batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", gpt_loss(self.model, batch[0]), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", gpt_loss(self.model, batch[0]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=self.lr
        )


def state_after_fit(module: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The full state dict (keys under ``prefix``, prefix removed) of a module trained by any strategy: zstack_zero3
    keeps the module sharded after fit, so its full values are gathered (collective: every rank calls this)."""
    from zlightning.zero import engine_of, full_state_dict

    sd = full_state_dict(module) if engine_of(module) is not None else module.state_dict()
    return {k[len(prefix) :]: v.detach().clone() for k, v in sd.items() if k.startswith(prefix)}


def loader(n_batches: int, micro_batch: int, world: int) -> DataLoader:
    data = torch.cat(batches(n_batches, micro_batch * world))
    return DataLoader(TensorDataset(data), batch_size=micro_batch, shuffle=False)


def rank_fit(rank: int, world: int, strategy: str, trainer_kwargs: dict[str, Any], n_batches: int) -> dict[str, Any]:
    import zlightning  # noqa: F401  (registers zstack_zero3)

    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **trainer_kwargs,
    )
    trainer.fit(module, train_dataloaders=loader(n_batches, 2, world))
    return {"losses": module.losses, "state": state_after_fit(module)}


def global_batches_of(n_batches: int, micro_batch: int, world: int) -> list[torch.Tensor]:
    """The global batch of each step as ranks see it: Lightning always shuffles training data with a
    DistributedSampler seeded by PL_GLOBAL_SEED (0 here), epoch 0."""
    from torch.utils.data import DistributedSampler

    data = torch.cat(batches(n_batches, micro_batch * world))
    per_rank = [
        data[list(DistributedSampler(TensorDataset(data), num_replicas=world, rank=r, shuffle=True, seed=0))]
        for r in range(world)
    ]
    steps = len(per_rank[0]) // micro_batch
    return [torch.cat([p[i * micro_batch : (i + 1) * micro_batch] for p in per_rank]) for i in range(steps)]
