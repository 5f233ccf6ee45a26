"""NVMe optimizer offload through ``Trainer.fit`` on users' own models (2 gloo ranks): swap folders of ranks that
``multiprocessing`` forks. Real processes, real swap files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zlightning.testing import run_distributed

D, V, T = 16, 24, 6
STEPS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = self.fc.weight.dtype if self.fc.weight.ndim == 2 else x.dtype  # sharded: the gathered weight's
        return x + torch.tanh(self.fc(self.norm(x.to(dtype)))).to(x.dtype)


class _Net(nn.Module):
    """An embedding, three blocks (the last one in ``odd_dtype``, as a user's model may keep it) and a head."""

    def __init__(self, odd_dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(D, V)
        self.blocks[2].to(odd_dtype)
        self.odd_dtype = odd_dtype

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i, block in enumerate(self.blocks):
            x = block(x.to(self.odd_dtype)).float() if i == 2 else block(x)
        return self.head(x)


def _loss(net: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(net(batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1))


def _optimizer(params: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1, "lr": 3e-3}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3
    )


def _data() -> torch.Tensor:
    """``STEPS`` global batches of 4 sequences, rank-major within each batch."""
    return torch.randint(0, V, (STEPS * 4, T + 1), generator=torch.Generator().manual_seed(1))


def _fit_nvme(rank: int, world: int, root: str) -> list[str]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.zero import NVMeOffload

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Net(torch.float32)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return _loss(self.net, batch[0])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _optimizer(list(self.named_parameters()))

    swap = os.path.join(root, "swap")
    trainer = pl.Trainer(
        strategy=ZStackZero3Strategy(offload_optimizer=NVMeOffload(path=swap, buffer_size=1024, buffer_count=6)),
        accelerator="cpu",
        devices=world,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(_data()), batch_size=2))
    return [f for _, _, fs in os.walk(swap) for f in fs if f.endswith(".swp")]  # the sharded module's state


def test_nvme_swap_files_removed_when_forked_ranks_exit(tmp_path: Path) -> None:
    """Ranks that multiprocessing forks (``start_method="fork"``/``"forkserver"``, notebooks) end with ``os._exit``,
    which skips ``atexit``: the swap folder, holding the optimizer state of the module that stays sharded after fit,
    used to stay on disk after every such run."""
    during = run_distributed(_fit_nvme, 2, str(tmp_path), init_process_group=False, start_method="forkserver")
    assert all(during), during
    assert [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "swap") for f in fs] == []


def _child_closes_all() -> None:
    from zlightning.zero._swap_io import _close_all

    _close_all()  # what a forked child's inherited SIGTERM handler or exit hooks run


def test_forked_child_leaves_its_parents_swap_folder(tmp_path: Path) -> None:
    """A forked child (a DataLoader worker of a rank) inherits the list of live swap folders: its exit or SIGTERM
    cleanup must not remove its parent's."""
    import multiprocessing

    from zlightning.zero._swap_io import SwapDirectory

    folder = SwapDirectory(tmp_path, "parent", 0)
    folder.open("remove")
    try:
        child = multiprocessing.get_context("fork").Process(target=_child_closes_all)
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert folder.path.is_dir()
    finally:
        folder.close()
    assert not folder.path.exists()
