"""Hybrid CP through a real Lightning Trainer (issue 8): `HybridCPTextDataModule` + `HybridCPGPTModule` under DDP and
``zstack_zero3`` on 2 gloo ranks match single-process training on the same global batches (losses and parameters).

The corpus is a directory of real text files (pieces of the standard library's ``textwrap.py`` of varied lengths), so
the packed samples hold several documents each and the scheduler sees genuinely variable lengths.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from examples.gpt_hybrid_cp import HybridCPGPTModule
from examples.gpt_model import GPT, GPTConfig
from zlightning.datamodules import HybridCPConfig, HybridCPTextDataModule, PackedDocumentDataset, unpack_packed_batch
from zlightning.testing import run_distributed

WORLD = 2
SEQ_LEN = 32
BATCH = 2
STEPS = 3
LR = 0.5
CFG = GPTConfig(seq_len=SEQ_LEN, d_model=16, n_layer=2, n_head=2)
HCP = HybridCPConfig(max_seqlen_per_rank=16)


class _SGDModule(HybridCPGPTModule):
    """SGD keeps parameter differences linear in gradient differences (a tight parity check)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=0.9)


def _write_corpus(root: Path) -> None:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    gen = torch.Generator().manual_seed(3)
    offset = 0
    for i in range(40):
        length = int(torch.randint(3, 45, (1,), generator=gen))
        (root / f"doc{i:02d}.txt").write_bytes(text[offset : offset + length])
        offset += length


def _datamodule(root: str) -> HybridCPTextDataModule:
    return HybridCPTextDataModule(hybrid_cp=HCP, data_dir=root, pattern="*.txt", seq_len=SEQ_LEN, batch_size=BATCH,
                                  val_fraction=0.2, max_bytes=None, seed=5)


def _fit(rank: int, world: int, root: str) -> dict[str, Any]:
    import zlightning  # noqa: F401  (registers zstack_zero3)

    out: dict[str, Any] = {}
    for strategy in ("ddp", "zstack_zero3"):
        pl.seed_everything(0, verbose=False)
        module = _SGDModule(CFG)
        trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world, max_steps=STEPS, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, limit_val_batches=0)
        trainer.fit(module, datamodule=_datamodule(root))
        params = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        out[strategy] = {"losses": module.losses, "params": params, "steps": trainer.global_step}
    return out


def _reference(root: str) -> dict[str, Any]:
    """Single process: the global batch of every step is every replica's packed samples, in replica order."""
    dm = _datamodule(root)
    dm.setup("fit")
    assert dm.train_dataset is not None
    docs = PackedDocumentDataset(dm.train_dataset, 2 * WORLD)
    orders = []
    for replica in range(WORLD):
        sampler = DistributedSampler(docs, num_replicas=WORLD, rank=replica, shuffle=True, seed=5, drop_last=True)
        sampler.set_epoch(0)
        orders.append(list(sampler))
    torch.manual_seed(0)
    model = GPT(CFG)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, lengths = [], set()
    for step in range(STEPS):
        samples = [docs[i] for order in orders for i in order[step * BATCH : (step + 1) * BATCH]]
        subs = unpack_packed_batch(samples)
        lengths |= {s["tokens"].shape[0] for s in subs}
        num = sum(float(s["loss_mask"].sum()) for s in subs)
        loss = torch.zeros(())
        for s in subs:
            logits, _ = model(s["tokens"][None])
            loss = loss + (F.cross_entropy(logits[0], s["labels"], reduction="none") * s["loss_mask"]).sum() / num
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params, "init": init, "lengths": lengths}


def test_lightning_ddp_and_zero3_match_single_process(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    runs = run_distributed(_fit, WORLD, str(tmp_path), init_process_group=False, timeout=400)
    ref = _reference(str(tmp_path))
    assert len(ref["lengths"]) >= 3 and max(ref["lengths"]) > HCP.max_seqlen_per_rank  # variable, some need CP 2
    moved = max(float((ref["params"][n] - ref["init"][n]).abs().max()) for n in ref["params"])
    assert moved > 1e-2
    for strategy in ("ddp", "zstack_zero3"):
        for rank, run in enumerate(runs):
            got = run[strategy]
            assert got["steps"] == STEPS
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{strategy} rank {rank} losses: {m}")
            assert got["params"].keys() == ref["params"].keys()
            for name, want in ref["params"].items():
                torch.testing.assert_close(got["params"][name], want, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"{strategy} rank {rank} {name}: {m}")


# --------------------------------------------------------------------------------------- single-process parts


def test_packed_document_dataset_pads_pieces_and_masks_padding(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    dm = _datamodule(str(tmp_path))
    dm.setup("fit")
    assert dm.train_dataset is not None
    docs = PackedDocumentDataset(dm.train_dataset, 4)
    several = 0
    for i in range(len(docs)):
        sample = docs[i]
        cu = sample["cu_seqlens"].tolist()
        assert cu[0] == 0 and all((b - a) % 4 == 0 and b > a for a, b in zip(cu[:-1], cu[1:]))
        assert sample["tokens"].shape == sample["labels"].shape == sample["loss_mask"].shape == (cu[-1],)
        x, y = dm.train_dataset[i]
        real = sample["loss_mask"].bool()
        assert int(real.sum()) == SEQ_LEN  # every real token once, padding masked
        assert torch.equal(sample["tokens"][real], x) and torch.equal(sample["labels"][real], y)
        pieces = dm.train_dataset.cu_seqlens(i).tolist()
        for k, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            n = pieces[k + 1] - pieces[k]
            assert sample["loss_mask"][a : a + n].all() and not sample["loss_mask"][a + n : b].any()
        several += len(cu) > 2
    assert several > 0  # packed samples hold several documents


def test_datamodule_rejects_bad_options_and_needs_distributed(tmp_path: Path) -> None:
    _write_corpus(tmp_path)
    with pytest.raises(TypeError, match="hybrid_cp must be a HybridCPConfig"):
        HybridCPTextDataModule(hybrid_cp={"max_seqlen_per_rank": 8}, data_dir=str(tmp_path))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pad_multiple must be None or a positive int"):
        HybridCPTextDataModule(hybrid_cp=HCP, pad_multiple=0, data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="pad_multiple must be a positive int"):
        PackedDocumentDataset(None, 0)  # type: ignore[arg-type]
    dm = _datamodule(str(tmp_path))
    dm.setup("fit")
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        dm.train_dataloader()


def test_module_rejects_plain_batches() -> None:
    module = HybridCPGPTModule(CFG)
    with pytest.raises(TypeError, match="expects a HybridCPBatch"):
        module.training_step((torch.zeros(1, 4, dtype=torch.int64),) * 2, 0)  # type: ignore[arg-type]
