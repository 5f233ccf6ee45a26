"""Hybrid CP through Lightning: `HybridCPTextDataModule` and `HybridCPGPTModule`, single-process parts.

The corpus is a directory of real text files (pieces of the standard library's ``textwrap.py`` of varied lengths), so
the packed samples hold several documents each and the scheduler sees genuinely variable lengths. The real 2-rank
Trainer runs (DDP and ``zstack_zero3`` against single-process training) are in `test_hybrid_cp_distributed.py`,
sharing one spawn with the other 2-rank checks; they use this module's corpus, config and datamodule.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from zlightning.datamodules.hybrid_cp import HybridCPConfig, HybridCPTextDataModule, PackedDocumentDataset

from examples.gpt_hybrid_cp import HybridCPGPTModule
from examples.gpt_model import GPTConfig

SEQ_LEN = 32
BATCH = 2
CFG = GPTConfig(seq_len=SEQ_LEN, d_model=16, n_layer=2, n_head=2)
HCP = HybridCPConfig(max_seqlen_per_rank=16)


def _write_corpus(root: Path) -> None:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_bytes()
    gen = torch.Generator().manual_seed(3)
    offset = 0
    for i in range(40):
        length = int(torch.randint(3, 45, (1,), generator=gen))
        (root / f"doc{i:02d}.txt").write_bytes(text[offset : offset + length])
        offset += length


def _datamodule(root: str) -> HybridCPTextDataModule:
    return HybridCPTextDataModule(
        hybrid_cp=HCP,
        data_dir=root,
        pattern="*.txt",
        seq_len=SEQ_LEN,
        batch_size=BATCH,
        val_fraction=0.2,
        max_bytes=None,
        seed=5,
    )


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


def _loader_error(rank: int, world: int, root: str, seq_len: int = 30, hybrid_cp: HybridCPConfig = HCP) -> str:
    """The message the training loader refuses with on this rank, or "no error"."""
    dm = HybridCPTextDataModule(hybrid_cp=hybrid_cp, data_dir=root, pattern="*.txt", seq_len=seq_len, batch_size=BATCH)
    dm.setup("fit")
    try:
        dm.train_dataloader()
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_seq_len_the_padding_does_not_divide_is_refused_at_the_loader(tmp_path: Path) -> None:
    from zlightning.testing import run_distributed

    _write_corpus(tmp_path)
    out = run_distributed(_loader_error, 2, str(tmp_path), timeout=120)  # pieces padded to multiples of 2 x 2
    assert all("seq_len=30 is not a multiple of 4" in o for o in out), out


def test_module_rejects_plain_batches() -> None:
    module = HybridCPGPTModule(CFG)
    with pytest.raises(TypeError, match="expects a HybridCPBatch"):
        module.training_step((torch.zeros(1, 4, dtype=torch.int64),) * 2, 0)  # type: ignore[arg-type]
