"""ZeRO-3 units beside the repeated blocks: a language model's embedding and output head.

A model with a large vocabulary and an untied head holds most of its parameters outside its blocks. Kept in the
root unit, those were gathered for the whole step with their full gradient (peak resident growth near DDP's); as
units of their own they are gathered only around their use (see [Note: what the root unit keeps] in
``zlightning/zero/_unit.py``), an embedding is not gathered again for its backward ([Note: lookups need no gather in
backward]) and the forward's last unit stays gathered into its backward ([Note: the last unit of the forward stays
gathered] in ``_state.py``). Checked here: which units are chosen, parity with one process through the engine and
through ``Trainer.fit``, the all-gathers a step issues, and the resident memory of a step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from tests._zero_models import reference_train
from zlightning.testing import run_distributed
from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, NVMeOffload, ZeroConfig
from zlightning.zero._unit import select_unit_modules


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class UntiedLM(nn.Module):
    """Embedding (with a padding row), blocks, final norm and an untied head: most parameters beside the blocks."""

    def __init__(self, vocab: int = 512, d: int = 16, n_layer: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))


class Backbone(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d)


class NestedLM(nn.Module):
    """Hugging Face's layout: ``model.embed_tokens``, ``model.layers``, ``model.norm`` and a top-level ``lm_head``."""

    def __init__(self, vocab: int = 512, d: int = 16, n_layer: int = 2) -> None:
        super().__init__()
        self.model = Backbone(vocab, d, n_layer)
        self.lm_head = nn.Linear(d, vocab, bias=False)


def lm_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def lm_batches(n: int, global_batch: int, vocab: int = 512, seq_len: int = 12, seed: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g) for _ in range(n)]


def _names(model: nn.Module) -> list[str]:
    return [n for n, _ in select_unit_modules(model, (), None)]


def test_large_modules_beside_the_blocks_become_units_and_small_ones_stay_in_the_root() -> None:
    assert _names(UntiedLM()) == ["emb", "layers.0", "layers.1", "layers.2", "head"]  # norm stays in the root
    assert _names(NestedLM()) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    # tied: the shared weight belongs to the root (both users are in it), so no unit is made for it
    assert _names(UntiedLM(tied=True)) == ["layers.0", "layers.1", "layers.2"]
    # a small vocabulary beside large blocks: what is left is within half a block, the root keeps it
    assert _names(UntiedLM(vocab=8, d=32)) == ["layers.0", "layers.1", "layers.2"]


def _count_gathers(counter: dict[str, int]) -> None:
    from zlightning.zero import _param_group

    original = _param_group.ZeroParamGroup.start_gather

    large: list[Any] = []  # groups of the embedding's size (the embedding and the head)

    def counting(self: Any, async_op: bool) -> None:
        if self.status is _param_group.GroupState.SHARDED and not self.persistent:
            counter["gathers"] += 1
            if self.numel >= 512 * 16:
                if self not in large:
                    large.append(self)
                others = [g for g in large if g is not self and g.status is not _param_group.GroupState.SHARDED]
                counter["large_together"] = max(counter.get("large_together", 0), len(others))
        original(self, async_op)

    _param_group.ZeroParamGroup.start_gather = counting  # type: ignore[method-assign]


def _engine_train(rank: int, world: int, cfg: ZeroConfig, accumulate: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = UntiedLM()
    counter = {"gathers": 0}
    _count_gathers(counter)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1),
        config=cfg,
        gradient_clipping=0.5,
        gradient_accumulation_steps=accumulate,
    )
    units = [u.name for u in zero.state.units]
    root_groups = len(zero.state.units[0].groups)  # gathered once per micro-batch (the final norm, unless persistent)
    losses, gathers = [], []
    for i, batch in enumerate(lm_batches(steps * accumulate, global_batch=4 * world)):
        before = counter["gathers"]
        loss = lm_loss(model, batch.chunk(world)[rank])
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(float(full) / world)
        zero.backward(loss)
        if (i + 1) % accumulate == 0:
            zero.step()
        gathers.append(counter["gathers"] - before)
    return {
        "state": zero.module_state_dict(),
        "losses": losses,
        "units": units,
        "gathers": gathers,
        "root": root_groups,
        "large_together": counter.get("large_together", 0),
    }


@pytest.mark.parametrize(
    "cfg",
    [
        ZeroConfig(),
        ZeroConfig(param_persistence_threshold=0, overlap_comm=False),
        ZeroConfig(prefetch_bucket_size=0),
        ZeroConfig(offload_optimizer=CPUOffload()),
        ZeroConfig(offload_optimizer=NVMeOffload(), offload_params=NVMeOffload()),
    ],
    ids=["default", "sync-no-persist", "no-prefetch", "cpu-offload", "nvme"],
)
def test_untied_lm_matches_one_process_and_gathers_each_large_unit_only_around_its_use(cfg: ZeroConfig) -> None:
    world, accumulate, steps = 2, 2, 3
    out = run_distributed(_engine_train, world, cfg, accumulate, steps, timeout=240)
    torch.manual_seed(0)
    ref, ref_losses, _ = reference_train(
        UntiedLM(), lm_batches(steps * accumulate, global_batch=4 * world), accumulate=accumulate, clip=0.5,
        loss_fn=lm_loss,
    )  # fmt: skip
    for rank_out in out:
        torch.testing.assert_close(rank_out["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(rank_out["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    units = out[0]["units"]
    assert units[1:] == ["emb", "layers.0", "layers.1", "layers.2", "head"], units
    blocks, root = 3, out[0]["root"]
    # Forward: emb, the blocks, head. Backward: the blocks only (head stays gathered from its forward, the
    # embedding's backward reads no weight). The first micro-batch does not know its last unit yet: head once more.
    assert out[0]["gathers"][0] == root + (blocks + 2) + blocks + 1, out[0]["gathers"]
    assert all(g == root + (blocks + 2) + blocks for g in out[0]["gathers"][1:]), out[0]["gathers"]
    # The head is prefetched once the embedding is released, not beside it: a prefetch never goes past its budget
    # (the largest unit) when a unit is already ahead ([Note: prefetch within its budget] in _state.py).
    assert out[0]["large_together"] == 0


class LMModule(pl.LightningModule):
    def __init__(self, vocab: int, d: int, n_layer: int) -> None:
        super().__init__()
        self.vocab, self.d, self.n_layer = vocab, d, n_layer
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.baseline = self.file_baseline = 0
        self.peaks: list[int] = []

    def configure_model(self) -> None:
        if self.net is None:
            self.net = UntiedLM(self.vocab, self.d, self.n_layer)

    def setup(self, stage: str) -> None:  # before the model exists: its shards count too
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from here
        self.baseline = _status("VmRSS")
        self.file_baseline = _status("RssFile")

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = lm_loss(self.net, batch)
        self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *args: Any) -> None:
        # Less the file-backed pages (libtorch's code) the steps touched: 12-23 MB here depending on how much of the
        # library the page cache holds (the kernel maps cached neighbours of a faulting page too), which is not
        # the engine's memory and would make the bound depend on the machine's page cache.
        code = _status("RssFile") - self.file_baseline
        self.peaks.append(_status("VmHWM") - self.baseline - code)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _fit(rank: int, world: int, vocab: int, d: int, n_layer: int, steps: int, root: str) -> dict[str, Any]:
    import zlightning  # noqa: F401  (registers zstack_zero3)

    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    module = LMModule(vocab, d, n_layer)
    data = [b.chunk(world)[rank] for b in lm_batches(steps, global_batch=2 * world, vocab=vocab, seq_len=32)]
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        default_root_dir=root,
    )
    trainer.fit(module, DataLoader(data, batch_size=None))
    losses = torch.tensor(module.losses)
    dist.all_reduce(losses)
    numel = sum(p.numel() for p in UntiedLM(vocab, d, n_layer).parameters())
    largest = vocab * d  # the embedding's and the head's weight
    from zlightning.zero import full_state_dict

    full = full_state_dict(module)  # the documented way to read whole weights after fit
    weights = {k.removeprefix("net."): v for k, v in full.items()}
    return {
        "losses": (losses / world).tolist(),
        "peaks": [p / numel for p in module.peaks],
        "largest_fraction": largest / numel,
        "weights": weights if rank == 0 else None,
    }


def test_fit_trains_an_untied_lm_as_one_process_does(tmp_path: Path) -> None:
    vocab, d, n_layer, steps, world = 256, 16, 2, 4, 2
    out = run_distributed(_fit, world, vocab, d, n_layer, steps, str(tmp_path), init_process_group=False, timeout=300)
    pl.seed_everything(0, verbose=False)
    model = UntiedLM(vocab, d, n_layer)
    ref, ref_losses, _ = reference_train(
        copy.deepcopy(model), lm_batches(steps, global_batch=2 * world, vocab=vocab, seq_len=32), accumulate=1,
        clip=0.0, loss_fn=lm_loss,
    )  # fmt: skip
    torch.testing.assert_close(out[0]["losses"], ref_losses, rtol=1e-5, atol=1e-6)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(out[0]["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_fit_resident_growth_of_an_untied_lm_is_the_shards_plus_a_few_of_its_largest_unit(tmp_path: Path) -> None:
    """Below two copies of the largest unit (gathered, and autograd's whole gradient of it) no ZeRO-3 step can go;
    the bound allows four (the logits' activations and gradients and the reduce-scatter's scratch come on top).
    Kept in the root, the embedding and head cost their full parameters and gradients for the whole step (19.6
    bytes per parameter here against a bound of 15.4)."""
    world = 2
    out = run_distributed(
        _fit, world, 32000, 256, 8, 6, str(tmp_path), init_process_group=False, timeout=600, start_method="spawn"
    )
    for r in out:
        bound = 16 / world + 1 + 4 * 4 * r["largest_fraction"]
        assert max(r["peaks"]) <= bound, (r["peaks"], bound)
        assert r["peaks"][-1] <= r["peaks"][2] * 1.03, r["peaks"]


class MatmulTiedLM(UntiedLM):
    """Ties the output to the embedding by reading its weight in the parent's forward (a common pattern that
    calls no head module), and scales the input by a block parameter read from outside that block."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx) * self.layers[0].ln.weight.mean()  # read before that block runs
        for block in self.layers:
            h = block(h)
        return F.linear(self.norm(h), self.emb.weight)  # read after the embedding's own forward


def _engine_train_direct_reads(rank: int, world: int, cfg: ZeroConfig, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = MatmulTiedLM(n_layer=2)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), config=cfg, gradient_clipping=0.5
    )
    losses = []
    for batch in lm_batches(steps, global_batch=4 * world):
        loss = lm_loss(model, batch.chunk(world)[rank])
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(float(full) / world)
        zero.backward(loss)
        zero.step()
    with torch.no_grad():  # a no-grad pass reads them too (validation)
        eval_loss = float(lm_loss(model, lm_batches(1, global_batch=world, seed=9)[0].chunk(world)[rank]))
    after = model.emb.weight  # outside any pass: the shard piece, as for every sharded parameter
    return {"state": zero.module_state_dict(), "losses": losses, "eval": eval_loss, "piece_shape": tuple(after.shape)}


@pytest.mark.parametrize(
    "cfg",
    [
        ZeroConfig(param_persistence_threshold=0),
        ZeroConfig(param_persistence_threshold=0, overlap_comm=False),
        ZeroConfig(offload_optimizer=NVMeOffload(), offload_params=NVMeOffload()),
    ],
    ids=["overlap", "sync", "nvme"],
)
def test_parameters_read_outside_their_unit_are_gathered_for_the_reader(cfg: ZeroConfig) -> None:
    world, steps = 2, 3
    out = run_distributed(_engine_train_direct_reads, world, cfg, steps, timeout=240)
    torch.manual_seed(0)
    model = MatmulTiedLM(n_layer=2)
    ref, ref_losses, _ = reference_train(
        model, lm_batches(steps, global_batch=4 * world), accumulate=1, clip=0.5, loss_fn=lm_loss
    )
    with torch.no_grad():
        ref_eval = float(lm_loss(ref, lm_batches(1, global_batch=world, seed=9)[0]))
    for rank_out in out:
        torch.testing.assert_close(rank_out["losses"], ref_losses, rtol=1e-5, atol=1e-6)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(rank_out["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert len(rank_out["piece_shape"]) == 1
    evals = [r["eval"] for r in out]
    torch.testing.assert_close(sum(evals) / world, ref_eval, rtol=1e-5, atol=1e-6)
