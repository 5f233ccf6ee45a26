"""``requires_grad`` switched during training under ``zstack_zero3`` (2 gloo ranks), against one process: Lightning's
``BackboneFinetuning`` (backbone frozen before sharding, unfrozen at an epoch into a new param group), layers frozen
mid-run, and the clear error where offload cannot follow an unfreeze."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from zlightning.testing import DistributedTestError, run_distributed

D, V, T = 16, 24, 6
BATCHES = 2  # per epoch (global batches of 4 sequences)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class _Model(pl.LightningModule):
    """Embedding, a three-block ``backbone`` and a head; ``freeze_at``: the backbone's Linear layers stop training
    from that global step on (set in ``on_train_batch_start``)."""

    def __init__(self, freeze_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.backbone = nn.Sequential(*[_Block() for _ in range(3)])
        self.head = nn.Linear(D, V)
        self.freeze_at = freeze_at
        self.losses: list[float] = []

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.freeze_at is not None and self.global_step == self.freeze_at:
            for block in self.backbone:
                block.fc.requires_grad_(False)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        seq = batch[0]
        logits = self.head(self.backbone(self.emb(seq[:, :-1])))
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), seq[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _data() -> torch.Tensor:
    return torch.randint(0, V, (BATCHES * 4, T + 1), generator=torch.Generator().manual_seed(1))


def _trainer(strategy: str, world: int, epochs: int, finetune: bool) -> pl.Trainer:
    """A quiet Trainer; ``finetune``: with ``BackboneFinetuning`` unfreezing the backbone at epoch 1."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    import zlightning  # noqa: F401

    callbacks = [BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5)] if finetune else []
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_epochs=epochs,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def _loader(rank: int, world: int) -> Any:
    """This rank's part of every global batch of 4 sequences."""
    from torch.utils.data import DataLoader, TensorDataset

    micro = 4 // world
    mine = torch.cat([b[rank * micro : (rank + 1) * micro] for b in _data().chunk(BATCHES)])
    return DataLoader(TensorDataset(mine), batch_size=micro)


def _fit(rank: int, world: int, strategy: str, finetune: bool, freeze_at: int | None, epochs: int) -> dict[str, Any]:
    from tests._lightning_models import state_after_fit

    module = _Model(freeze_at)
    _trainer(strategy, world, epochs, finetune).fit(module, _loader(rank, world))
    return {
        "losses": module.losses,
        "state": state_after_fit(module),
        "trainable": sorted(n for n, p in module.named_parameters() if p.requires_grad),
    }


def _compare(ref: dict[str, Any], out: list[dict[str, Any]]) -> None:
    mean = [(a + b) / 2 for a, b in zip(out[0]["losses"], out[1]["losses"])]
    torch.testing.assert_close(mean, ref["losses"], rtol=1e-5, atol=1e-6)
    for got in out:
        assert got["trainable"] == ref["trainable"]
        for name, value in ref["state"].items():
            torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_backbone_finetuning_unfreezes_the_sharded_backbone() -> None:
    """The backbone is frozen in ``setup`` (before sharding) and unfrozen at epoch 1 into a new param group: it used
    to stay frozen for good under zstack_zero3 (its groups were built without gradients), silently."""
    args = ("zstack_zero3", True, None, 3)
    ref = run_distributed(_fit, 1, "auto", *args[1:], init_process_group=False, timeout=180)[0]
    initial = _Model().state_dict()
    backbone = [name for name in initial if name.startswith("backbone.")]
    moved = [name for name in backbone if not torch.equal(ref["state"][name], initial[name])]
    assert moved == backbone, f"backbone parameters the reference never trained: {set(backbone) - set(moved)}"
    _compare(ref, run_distributed(_fit, 2, *args, init_process_group=False, timeout=180))


def test_layers_frozen_mid_run_stop_training() -> None:
    """Layers frozen after the model was sharded kept receiving gradients and updates."""
    ref = run_distributed(_fit, 1, "auto", False, 2, 2, init_process_group=False, timeout=180)[0]
    out = run_distributed(_fit, 2, "zstack_zero3", False, 2, 2, init_process_group=False, timeout=180)
    _compare(ref, out)


def test_unfreezing_under_offload_is_a_clear_error() -> None:
    with pytest.raises(DistributedTestError, match=r"backbone\.0\..*frozen \(requires_grad=False\) when the model"):
        run_distributed(_fit, 2, "zstack_zero3_offload", True, None, 2, init_process_group=False, timeout=180)


def _fit_then_resume(rank: int, world: int, strategy: str, root: str) -> dict[str, Any]:
    """Two epochs (the backbone joins the optimizer at epoch 1), a checkpoint, then a new Trainer resumes to 3."""
    import os

    from tests._lightning_models import state_after_fit

    path = os.path.join(root, f"w{world}.ckpt")
    losses = []
    for epochs, ckpt in ((2, None), (3, path)):
        module = _Model()
        trainer = _trainer(strategy, world, epochs, finetune=True)
        trainer.fit(module, _loader(rank, world), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(path)
        losses += module.losses
    groups = [len(g["params"]) for g in trainer.optimizers[0].param_groups]
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    return {"losses": losses, "state": state_after_fit(module), "trainable": [], "groups": groups, "lrs": lrs}


def test_resume_restores_param_groups_added_during_training(tmp_path: Any) -> None:
    """The checkpoint's optimizer has the group BackboneFinetuning added; the resumed run's configure_optimizers
    builds one group, and Lightning restores this strategy's optimizer before the callback could add it back: loading
    failed ("the optimizer's parameters differ"). Now the group is restored, as Lightning does in one process (which
    then leaves the backbone frozen after the resume: the callback froze it in setup)."""
    ref = run_distributed(_fit_then_resume, 1, "auto", str(tmp_path), init_process_group=False, timeout=180)[0]
    out = run_distributed(_fit_then_resume, 2, "zstack_zero3", str(tmp_path), init_process_group=False, timeout=240)
    for got in out:
        assert got["groups"] == ref["groups"] == [3, 12]
        assert got["lrs"] == pytest.approx(ref["lrs"])
    _compare(ref, out)
