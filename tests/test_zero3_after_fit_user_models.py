"""zstack_zero3 after ``Trainer.fit`` on users' models other than the suite's (2 CPU ranks, gloo): a model with
buffers (BatchNorm, a scalar buffer, a non-persistent rotary cache), a frozen layer, a root parameter, a block called
twice and an output tied to the embedding, exported with ``save_full_state_dict`` and loaded strictly into the plain
model, compared with one process trained on the same global batches."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zlightning.testing import run_distributed

WORLD, V, D, T, STEPS = 2, 32, 16, 8, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.ln(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.shared = Block()  # called twice per forward
        self.bn = nn.BatchNorm1d(D)  # num_batches_tracked: a 0-d buffer
        self.scale = nn.Parameter(torch.ones(D))  # outside any block
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        pos = torch.arange(T).float()[:, None] * torch.arange(D // 2).float()[None] / D
        self.register_buffer("rope", torch.cat([pos.sin(), pos.cos()], -1), persistent=False)
        self.register_buffer("calls", torch.zeros(()))
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) + self.rope[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        h = self.shared(self.shared(h))
        h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        self.calls += 1
        return self.head((h + 0.1 * self.frozen(h)) * self.scale)


def _loss(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(net(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))


class UserModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = _loss(self.net, batch[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def _data(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (n, T + 1), generator=torch.Generator().manual_seed(seed))


def _trainer(**kwargs: Any) -> pl.Trainer:
    import zlightning  # noqa: F401  (registers zstack_zero3)

    base: dict[str, Any] = dict(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=WORLD,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # each rank gets its own rows: step i is rows (2i, 2i+1) in one process
    )
    base.update(kwargs)
    return pl.Trainer(**base)


def _rows(rank: int) -> torch.Tensor:
    return _data(2 * WORLD * STEPS)[rank::WORLD]  # batches of 2: step i is rows [2i, 2i + 2) of each rank


def _fit(rank: int) -> UserModule:
    torch.manual_seed(0)
    module = UserModule()
    _trainer(max_steps=STEPS).fit(module, DataLoader(TensorDataset(_rows(rank)), batch_size=2))
    return module


def _edit(net: Net) -> None:
    """What the writeback test changes between two fits: in place (the tied embedding, a frozen bias) and by
    assigning a new parameter of the same shape."""
    with torch.no_grad():
        net.emb.weight[0].fill_(7.0)
        net.frozen.bias.fill_(3.0)
    net.blocks[1].fc.bias = nn.Parameter(torch.full((D,), 0.5))


def _reference(edit: bool = False) -> tuple[Net, list[list[float]]]:
    """One process on the same batches: each rank's rows go through the model on their own (BatchNorm normalises
    per rank), the gradient is the mean of the ranks' losses, and the buffers are rank 0's (its own rows only).
    With ``edit``: `_edit`, then the same steps again (a second fit)."""
    torch.manual_seed(0)
    net = Net()
    losses: list[list[float]] = [[] for _ in range(WORLD)]
    _train(net, losses)
    if edit:
        _edit(net)
        _train(net, losses)
    return net, losses


def _train(net: Net, losses: list[list[float]]) -> None:
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.1)
    for i in range(STEPS):
        total = torch.zeros(())
        for r in range(WORLD):
            loss = _loss(net, _rows(r)[2 * i : 2 * i + 2])
            losses[r].append(float(loss.detach()))
            total = total + loss / WORLD
            if r == 0:
                rank0 = {k: v.clone() for k, v in net.named_buffers()}
        total.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for k, v in net.named_buffers():
                v.copy_(rank0[k])


def _export(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from zlightning.zero import save_full_state_dict

    module = _fit(rank)
    for name in ("m.safetensors", "m.pt"):
        save_full_state_dict(module, os.path.join(tmp, name))
    return {"buffers": {k: v.clone() for k, v in module.net.named_buffers()}, "losses": module.losses}


def test_full_weights_of_a_model_with_buffers_load_strictly_and_match_one_process(tmp_path: Any) -> None:
    """``.safetensors`` export of a model with a 0-d buffer (BatchNorm's num_batches_tracked) failed on rank 0 with
    'self.dim() cannot be 0 to view Float as Byte' (and rank 1 then lost its peer); ``.pt`` worked."""
    import safetensors.torch

    out = run_distributed(_export, WORLD, str(tmp_path), init_process_group=False, timeout=120)
    ref, losses = _reference()
    for r in range(WORLD):
        torch.testing.assert_close(out[r]["losses"], losses[r], rtol=1e-6, atol=0.0)
    for name in ("m.safetensors", "m.pt"):
        path = tmp_path / name
        loaded = safetensors.torch.load_file(path) if name.endswith(".safetensors") else torch.load(path)
        plain = UserModule()
        plain.load_state_dict(loaded, strict=True)
        assert plain.net.head.weight is plain.net.emb.weight  # still tied after loading
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(plain.net.state_dict()[key], value, rtol=1e-6, atol=1e-7, msg=key)
        for key, value in out[0]["buffers"].items():  # rank 0's buffers, the non-persistent cache excluded
            if key != "rope":
                assert torch.equal(plain.net.state_dict()[key], value), (name, key)
    assert float(plain.net.calls) == STEPS and int(plain.net.bn.num_batches_tracked) == STEPS


class Predicting(UserModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", _loss(self.net, batch[0]), sync_dist=True)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).argmax(-1)


def _uneven(rank: int, world: int) -> dict[str, Any]:
    from zlightning.strategies.zero3 import UnevenBatchesError

    from zlightning.zero import engine_of, full_state_dict

    torch.manual_seed(0)
    module = Predicting()
    trainer = _trainer(max_steps=STEPS)
    trainer.fit(module, DataLoader(TensorDataset(_rows(rank)), batch_size=2))
    module.eval()
    errors = []
    five = _data(5, seed=1)[:, :T]  # Lightning's predict sampler does not pad: 3 batches on rank 0, 2 on rank 1
    try:
        _trainer(use_distributed_sampler=True).predict(module, DataLoader(TensorDataset(five), batch_size=1))
    except UnevenBatchesError as err:
        errors.append(str(err))
    try:  # a loader of each rank's own: 3 batches on rank 0, 2 on rank 1
        trainer.validate(module, DataLoader(TensorDataset(_data(3 - rank, seed=2)), batch_size=1), verbose=False)
    except UnevenBatchesError as err:
        errors.append(str(err))
    # the module is still sharded and usable: the same data with even counts, a batch size unlike training's
    preds = _trainer(use_distributed_sampler=True, limit_predict_batches=2).predict(
        module, DataLoader(TensorDataset(five), batch_size=1)
    )
    val = trainer.validate(module, DataLoader(TensorDataset(_data(2, seed=2)), batch_size=1), verbose=False)
    plain = Net().eval()
    plain.load_state_dict({k[len("net.") :]: v for k, v in full_state_dict(module).items()})  # this rank's buffers
    with torch.no_grad():
        expected = [plain(five[[rank + world * i]]).argmax(-1) for i in range(2)]
        val_mine = sum(float(_loss(plain, b[None])) for b in _data(2, seed=2)) / 2
    return {
        "errors": errors,
        "sharded": engine_of(module) is not None and module.net.emb.weight.ndim == 1,
        "preds_equal": all(torch.equal(p, e) for p, e in zip(preds, expected)) and len(preds) == 2,
        "val": val[0]["val_loss"],
        "val_mine": val_mine,
    }


def test_uneven_batches_per_rank_are_refused_on_every_rank_and_the_module_stays_usable() -> None:
    """trainer.predict after fit on 5 samples at 2 ranks (Lightning's unpadded predict sampler: 3 and 2 batches) left
    rank 0 in a collective rank 1 never joined ('rank 1 exited while this rank was in all-gather of unit <root>');
    a validate loader with different lengths per rank the same. Now every rank raises one clear error before any
    step, and the module stays sharded for the next call."""
    out = run_distributed(_uneven, WORLD, init_process_group=False, timeout=120)
    for r in out:
        assert len(r["errors"]) == 2, r["errors"]
        assert "trainer.predict" in r["errors"][0] and "rank 0: 3, rank 1: 2" in r["errors"][0]
        assert "limit_predict_batches=2" in r["errors"][0] and "summon_full_params" in r["errors"][0]
        assert "trainer.validate" in r["errors"][1] and "rank 0: 3, rank 1: 2" in r["errors"][1]
        assert "limit_val_batches=2" in r["errors"][1]  # the Trainer's argument, not limit_validate_batches
        assert r["sharded"] and r["preds_equal"]
    # every rank validates both batches with its own BatchNorm statistics; sync_dist averages the ranks
    assert abs(out[0]["val"] - (out[0]["val_mine"] + out[1]["val_mine"]) / 2) < 1e-5


def _writeback(rank: int, world: int) -> dict[str, Any]:
    from zlightning.zero import full_state_dict, summon_full_params

    module = _fit(rank)
    with summon_full_params(module, writeback=True) as full:
        _edit(full.net)
    error = ""
    try:
        with summon_full_params(module, writeback=True) as full:
            full.net.blocks[0].fc.weight = nn.Parameter(torch.zeros(D, D + 1))
    except ValueError as err:
        error = str(err)
    module.losses.clear()
    _trainer(max_steps=STEPS).fit(module, DataLoader(TensorDataset(_rows(rank)), batch_size=2))  # a second fit
    return {"losses": module.losses, "state": full_state_dict(module, rank0_only=True), "error": error}


def test_writeback_edits_and_replaced_parameters_carry_into_the_next_fit() -> None:
    """``full.net.blocks[1].fc.bias = nn.Parameter(...)`` inside summon_full_params(writeback=True) was dropped
    silently (the shards kept the old bias; only in-place edits were written back). A replacement of the same shape
    is kept now, and one of another shape is refused on every rank with a message naming the parameter."""
    out = run_distributed(_writeback, WORLD, init_process_group=False, timeout=120)
    ref, losses = _reference(edit=True)
    for r in range(WORLD):
        torch.testing.assert_close(out[r]["losses"], losses[r][STEPS:], rtol=1e-6, atol=0.0)
        assert "net.blocks.0.fc.weight" in out[r]["error"] and "(16, 17)" in out[r]["error"], out[r]["error"]
        assert "in place" in out[r]["error"]
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(out[0]["state"]["net." + key], value, rtol=1e-6, atol=1e-7, msg=key)
    assert float(out[0]["state"]["net.frozen.bias"][0]) == 3.0  # frozen: the edit stays as it was written


class _Wide(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        for block in self.blocks:
            block.fc = nn.Linear(width, width)
            block.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _export_memory(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import resource

    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig, save_full_state_dict

    def peak() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    torch.manual_seed(0)
    with torch.device("meta"):  # never full on any rank: the process's peak so far is the sharded step's
        model = _Wide(1024, 10)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        config=ZeroConfig(host_mmap_threshold=1 << 20),
        device=torch.device("cpu"),
    )
    zero.backward(model(torch.randn(4, 1024)).pow(2).mean())
    zero.step()
    growth = {}
    for name in ("m.pt", "m.safetensors"):
        before = peak()
        save_full_state_dict(model, os.path.join(tmp, name))
        growth[name] = peak() - before
    return {"growth": growth, "unit": zero.memory_report().largest_unit_bytes}


def test_save_full_state_dict_holds_about_one_unit_beyond_the_sharded_step(tmp_path: Any) -> None:
    """The README's claim, measured: writing the full weights (10 units, 42 MB) to .pt and .safetensors raises no
    rank's peak resident memory by more than about one unit over the sharded training step's."""
    import safetensors.torch

    out = run_distributed(_export_memory, WORLD, str(tmp_path), timeout=120, start_method="spawn")
    for r in out:
        for name, growth in r["growth"].items():
            assert growth < 1.5 * r["unit"], (name, growth, r["unit"])
    pt, st = torch.load(tmp_path / "m.pt"), safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert pt.keys() == st.keys() == _Wide(8, 10).state_dict().keys()
    assert all(torch.equal(pt[k], st[k]) for k in pt) and pt["blocks.9.fc.weight"].shape == (1024, 1024)


class Versioned(Block):
    """A block whose ``get_extra_state`` is a dict (as modules that record a format version or fp8 metadata do)."""

    def __init__(self) -> None:
        super().__init__()
        self.version = {"format": 1}

    def get_extra_state(self) -> dict[str, int]:
        return dict(self.version)

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.version = dict(state)


class VersionedModule(UserModule):
    def __init__(self) -> None:
        super().__init__()
        self.net.blocks[1] = Versioned()


def _extra_state(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from zlightning.zero import consolidate, full_state_dict, save_full_state_dict

    torch.manual_seed(0)
    module = VersionedModule()
    trainer = _trainer(max_steps=1)
    trainer.fit(module, DataLoader(TensorDataset(_rows(rank)), batch_size=2))
    module.net.blocks[1].version["format"] = 2  # what the files must carry
    save_full_state_dict(module, os.path.join(tmp, "v.pt"))
    refused = ""
    try:
        save_full_state_dict(module, os.path.join(tmp, "v.safetensors"))
    except ValueError as err:
        refused = str(err)
    trainer.save_checkpoint(os.path.join(tmp, "v.ckpt"))
    if rank == 0:
        consolidate(os.path.join(tmp, "v.ckpt"), os.path.join(tmp, "c.pt"), progress=False)
    state = {k: v for k, v in full_state_dict(module).items() if isinstance(v, torch.Tensor)}
    return {"refused": refused, "state": state}


def test_non_tensor_extra_state_is_written_to_pt_and_refused_clearly_for_safetensors(tmp_path: Any) -> None:
    """A block with ``get_extra_state() -> dict``: save_full_state_dict raised 'state dict entry
    net.blocks.1._extra_state is a dict, not a tensor' even for .pt (which torch.save writes), and consolidate
    dropped the entry silently, so a strict load failed on the missing key. Both .pt files now carry it; safetensors,
    which holds tensors only, is refused on every rank with what to do instead."""
    out = run_distributed(_extra_state, WORLD, str(tmp_path), init_process_group=False, timeout=120)
    for r in out:
        assert "net.blocks.1._extra_state (dict)" in r["refused"] and "Write a .pt file" in r["refused"], r["refused"]
    assert not (tmp_path / "v.safetensors").exists()
    for name in ("v.pt", "c.pt"):
        plain = VersionedModule()
        plain.load_state_dict(torch.load(tmp_path / name), strict=True)  # weights_only: plain data
        assert plain.net.blocks[1].version == {"format": 2}, name
        for key, value in out[0]["state"].items():
            assert torch.equal(plain.state_dict()[key], value), (name, key)
