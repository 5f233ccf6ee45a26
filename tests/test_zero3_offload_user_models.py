"""CPU and NVMe optimizer offload through ``Trainer.fit`` on users' own models (2 gloo ranks), against one process:
parameters of several dtypes; swap folders of ranks that ``multiprocessing`` forks. Real processes, real swap files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
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


class _NetModule(pl.LightningModule):
    """`_Net` trained on `_loss`; ``make_optimizer(module)`` builds the optimizer (default: `_optimizer`)."""

    def __init__(
        self,
        odd_dtype: torch.dtype = torch.float32,
        make_optimizer: Callable[[pl.LightningModule], torch.optim.Optimizer] | None = None,
    ) -> None:
        super().__init__()
        self.net = _Net(odd_dtype)
        self.losses: list[float] = []
        self.make_optimizer = make_optimizer

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self.net, batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.make_optimizer is not None:
            return self.make_optimizer(self)
        return _optimizer(list(self.named_parameters()))


def _data() -> torch.Tensor:
    """``STEPS`` global batches of 4 sequences, rank-major within each batch."""
    return torch.randint(0, V, (STEPS * 4, T + 1), generator=torch.Generator().manual_seed(1))


def _reference(odd_dtype: torch.dtype) -> tuple[list[float], dict[str, torch.Tensor]]:
    net = _Net(odd_dtype)
    opt = _optimizer(list(net.named_parameters()))
    losses = []
    for batch in _data().chunk(STEPS):
        loss = _loss(net, batch)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


def _fit(rank: int, world: int, root: str, odd_dtype: torch.dtype) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from tests._lightning_models import state_after_fit
    from zlightning.zero import NVMeOffload

    micro = 4 // world
    mine = torch.cat([b[rank * micro : (rank + 1) * micro] for b in _data().chunk(STEPS)])
    out = {}
    for kind in ("cpu", "nvme"):
        swap = os.path.join(root, "swap")
        strategy: Any = (
            "zstack_zero3_offload"
            if kind == "cpu"
            else ZStackZero3Strategy(offload_optimizer=NVMeOffload(path=swap, buffer_size=1024, buffer_count=6))
        )
        module = _NetModule(odd_dtype)
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=world,
            max_steps=STEPS,
            use_distributed_sampler=False,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(TensorDataset(mine), batch_size=micro))
        out[kind] = {"losses": module.losses, "state": state_after_fit(module, "net.")}
    return out


@pytest.mark.parametrize("odd_dtype", [torch.float64], ids=["float64"])
def test_offload_steps_parameters_of_other_dtypes_like_torch_adam(tmp_path: Path, odd_dtype: torch.dtype) -> None:
    """A block kept in float64 under 32-true: its Adam state and update are float64, as torch's (the offloaded step
    used to refuse it in the CPU Adam kernel, or keep float32 state without the kernel)."""
    ref_losses, ref_state = _reference(odd_dtype)
    out = run_distributed(_fit, 2, str(tmp_path), odd_dtype, init_process_group=False, timeout=120)
    for kind in ("cpu", "nvme"):
        mean = [(a + b) / 2 for a, b in zip(out[0][kind]["losses"], out[1][kind]["losses"])]
        torch.testing.assert_close(mean, ref_losses, rtol=1e-5, atol=1e-6, msg=kind)
        for got in (out[0][kind], out[1][kind]):
            for name, value in ref_state.items():
                assert got["state"][name].dtype == value.dtype, (kind, name)
                torch.testing.assert_close(got["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"{kind} {name}")
    assert not [f for d, _, fs in os.walk(tmp_path) for f in fs], "swap files left after the ranks exited"


def _fit_nvme(rank: int, world: int, root: str) -> list[str]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.zero import NVMeOffload

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
    trainer.fit(_NetModule(), DataLoader(TensorDataset(_data()), batch_size=2))
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


class _ClampedAdamW(torch.optim.AdamW):
    """A user's AdamW with its own step: a clamp after each update."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.clamp_(-0.05, 0.05)
        return loss


def _fit_with_optimizer(rank: int, world: int, kind: str) -> dict[str, Any]:
    """Fits 3 steps with CPU optimizer offload and ``kind``'s optimizer: what ran, or the error."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import zlightning  # noqa: F401

    calls: list[str] = []

    def make_optimizer(module: pl.LightningModule) -> torch.optim.Optimizer:
        if kind == "subclass":
            return _ClampedAdamW(module.parameters(), lr=1e-3)
        opt = _optimizer(list(module.named_parameters()))
        opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
        opt.register_step_post_hook(lambda o, args, kwargs: calls.append(f"post lr={o.param_groups[0]['lr']}"))
        return opt

    trainer = pl.Trainer(
        strategy="zstack_zero3_offload",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(_NetModule(make_optimizer=make_optimizer), DataLoader(TensorDataset(_data()), batch_size=2))
    except ValueError as err:
        return {"error": str(err)}
    return {"calls": calls}


def test_offload_runs_step_hooks_registered_on_the_users_optimizer() -> None:
    """``register_step_pre_hook``/``register_step_post_hook`` on the optimizer configure_optimizers returns (EMA,
    counters): the offloaded step replaces that optimizer's, and its hooks used to never run."""
    for out in run_distributed(_fit_with_optimizer, 2, "hooks", init_process_group=False, timeout=120):
        assert out["calls"] == ["pre", "post lr=0.003"] * STEPS, out


def test_offload_refuses_an_adam_subclass_with_its_own_step() -> None:
    """An Adam/AdamW subclass that overrides ``step`` passed the Adam check and was stepped as plain AdamW: its own
    code silently never ran. Now a clear error names the override and the way out."""
    for out in run_distributed(_fit_with_optimizer, 2, "subclass", init_process_group=False, timeout=120):
        assert "_ClampedAdamW.step" in out.get("error", ""), out
        assert "strategy='zstack_zero3'" in out["error"]
