"""Tests of `zlightning.datamodules.text`: packing, document boundaries, the by-file split and argument errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch
from zlightning.datamodules import TextCorpusDataModule
from zlightning.datamodules.text import BYTE_VOCAB_SIZE, PackedByteDataset, corpus_files, is_val_file, read_documents


def _write_corpus(root: Path, n_files: int = 20, size: int = 300) -> list[str]:
    """Write n_files text files (some nested) of about `size` bytes; return their relative paths."""
    rels = []
    for i in range(n_files):
        rel = f"sub{i % 3}/doc_{i:02d}.txt"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text((f"file {i}: " + "lorem ipsum dolor sit amet " * 20)[:size], encoding="utf-8")
        rels.append(rel)
    return sorted(rels)


# ---------------------------------------------------------------------------------------------------------------------
# PackedByteDataset


def test_packing_shapes_and_shift() -> None:
    docs = [b"hello world\n", b"abc", b"0123456789" * 3]
    ds = PackedByteDataset(docs, seq_len=8)
    stream = b"".join(docs)
    assert ds.num_tokens == len(stream)
    assert len(ds) == (len(stream) - 1) // 8
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == y.shape == (8,)
        assert x.dtype == y.dtype == torch.int64
        assert bytes(x.tolist()) == stream[i * 8 : i * 8 + 8]
        assert torch.equal(x[1:], y[:-1])
        assert y[-1].item() == stream[i * 8 + 8]
    # Inputs of consecutive samples tile the stream without overlap.
    xs = torch.cat([ds[i][0] for i in range(len(ds))])
    assert bytes(xs.tolist()) == stream[: len(ds) * 8]


def test_exact_one_sample_and_negative_index() -> None:
    ds = PackedByteDataset([b"abcde"], seq_len=4)
    assert len(ds) == 1
    x, y = ds[-1]
    assert bytes(x.tolist()) == b"abcd" and bytes(y.tolist()) == b"bcde"
    with pytest.raises(IndexError, match="out of range"):
        ds[1]


def test_document_boundaries() -> None:
    docs = [b"a" * 5, b"b" * 3, b"c" * 10, b"d" * 7]  # starts at 0, 5, 8, 18
    ds = PackedByteDataset(docs, seq_len=6)
    assert ds.doc_starts.dtype == torch.int64
    assert ds.doc_starts.tolist() == [0, 5, 8, 18]
    assert ds.document_boundaries(0).tolist() == [0, 5]  # sample covers [0, 6)
    assert ds.document_boundaries(1).tolist() == [2]  # [6, 12): doc starting at 8
    assert ds.document_boundaries(2).tolist() == []  # [12, 18): inside doc "c"
    assert ds.document_boundaries(3).tolist() == [0]  # [18, 24): starts exactly at doc "d"
    assert ds.cu_seqlens(0).tolist() == [0, 5, 6]
    assert ds.cu_seqlens(2).tolist() == [0, 6]
    # Every boundary points at the first byte of a document.
    for i in range(len(ds)):
        x, _ = ds[i]
        for p in ds.document_boundaries(i).tolist():
            assert x[p].item() in b"abcd" and (i * 6 + p) in ds.doc_starts.tolist()


def test_packed_dataset_errors() -> None:
    with pytest.raises(ValueError, match=r"corpus has 4 bytes .* needs 9 bytes"):
        PackedByteDataset([b"ab", b"cd"], seq_len=8)
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        PackedByteDataset([b"abc"], seq_len=0)
    with pytest.raises(ValueError, match="document 1 is empty"):
        PackedByteDataset([b"abc", b"", b"def"], seq_len=2)
    with pytest.raises(TypeError, match=r"document 0 must be bytes, got str.*encode"):
        PackedByteDataset(["text"], seq_len=2)  # type: ignore[list-item]


# ---------------------------------------------------------------------------------------------------------------------
# Corpus listing and the split


def test_corpus_files_sorted_and_skips(tmp_path: Path) -> None:
    rels = _write_corpus(tmp_path, n_files=6)
    for skipped in ("tests", "test", "site-packages"):
        (tmp_path / skipped).mkdir()
        (tmp_path / skipped / "x.txt").write_text("skip me")
    (tmp_path / "notes.md").write_text("other pattern")
    assert corpus_files(tmp_path, "*.txt") == rels
    assert corpus_files(tmp_path, "*.md") == ["notes.md"]


def test_split_is_deterministic_and_disjoint(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=40)
    a = TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=16, val_fraction=0.25)
    b = TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=16, val_fraction=0.25)
    a.setup("fit")
    b.setup("fit")
    assert torch.equal(a.train_dataset.tokens, b.train_dataset.tokens)
    assert torch.equal(a.val_dataset.tokens, b.val_dataset.tokens)
    files = corpus_files(tmp_path, "*.txt")
    val = [f for f in files if is_val_file(f, 0.25)]
    train = [f for f in files if not is_val_file(f, 0.25)]
    assert val and train and not set(val) & set(train)
    # The datasets hold exactly those files' bytes, in sorted order.
    assert bytes(a.val_dataset.tokens.tolist()) == b"".join(read_documents(tmp_path, val, None))
    assert bytes(a.train_dataset.tokens.tolist()) == b"".join(read_documents(tmp_path, train, None))
    # The split depends on the path and the seed only, never on listing order.
    assert [f for f in reversed(files) if is_val_file(f, 0.25)] == val[::-1]
    assert [f for f in files if is_val_file(f, 0.25, seed=1)] != val


def test_tiny_corpus_keeps_both_splits(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=2, size=100)
    dm = TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=8, val_fraction=0.01)
    dm.setup("fit")
    assert len(dm.train_dataset) > 0 and len(dm.val_dataset) > 0


def test_skips_invalid_utf8_and_empty_files(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=4)
    (tmp_path / "aa_binary.txt").write_bytes(b"\xff\xfe\x00bad")
    (tmp_path / "aa_empty.txt").write_bytes(b"")
    docs = read_documents(tmp_path, corpus_files(tmp_path, "*.txt"), None)
    assert len(docs) == 4 and all(docs)


def test_max_bytes_caps_deterministically(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=30, size=300)
    dm = TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=16, max_bytes=1000, val_fraction=0.5)
    dm.setup("fit")
    assert dm.train_dataset.num_tokens == 1000
    assert dm.val_dataset.num_tokens == 500
    train = [f for f in corpus_files(tmp_path, "*.txt") if not is_val_file(f, 0.5)]
    assert bytes(dm.train_dataset.tokens.tolist()) == b"".join(read_documents(tmp_path, train, None))[:1000]


def test_custom_dir_dataloaders(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=20)
    dm = TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=32, batch_size=4, val_fraction=0.2)
    assert dm.vocab_size == BYTE_VOCAB_SIZE == 256
    dm.setup("fit")
    train = dm.train_dataloader()
    x, y = next(iter(train))
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert len(train) == len(dm.train_dataset) // 4  # drop_last
    val = dm.val_dataloader()
    first = next(iter(val))[0]
    assert torch.equal(first[0], dm.val_dataset[0][0])  # not shuffled
    # The training shuffle is seeded: two fresh loaders give the same order.
    assert torch.equal(next(iter(dm.train_dataloader()))[0], next(iter(dm.train_dataloader()))[0])


def test_stdlib_default() -> None:
    dm = TextCorpusDataModule(seq_len=64, max_bytes=100_000)
    assert dm.config.root == sysconfig.get_paths()["stdlib"]
    dm.setup("fit")
    assert dm.train_dataset.num_tokens == 100_000
    assert dm.val_dataset.num_tokens == 5_000
    files = corpus_files(dm.config.root)
    assert files and all(f.endswith(".py") for f in files)
    assert not any(part in {"test", "tests", "site-packages"} for f in files for part in f.split("/"))
    x, y = dm.train_dataset[0]
    assert x.max().item() < 256 and torch.equal(x[1:], y[:-1])


# ---------------------------------------------------------------------------------------------------------------------
# Errors


def test_datamodule_argument_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"data_dir '.*missing' does not exist"):
        TextCorpusDataModule(data_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        TextCorpusDataModule(seq_len=0)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got -2"):
        TextCorpusDataModule(batch_size=-2)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.5"):
        TextCorpusDataModule(val_fraction=1.5)
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 0.0"):
        TextCorpusDataModule(val_fraction=0.0)
    with pytest.raises(ValueError, match="max_bytes must be >= 1, got 0"):
        TextCorpusDataModule(max_bytes=0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        TextCorpusDataModule(seq_len=3.5)  # type: ignore[arg-type]


def test_datamodule_corpus_errors(tmp_path: Path) -> None:
    _write_corpus(tmp_path, n_files=3, size=20)
    with pytest.raises(ValueError, match=r"no files match pattern '\*.rst' under data_dir"):
        TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.rst").setup("fit")
    with pytest.raises(ValueError, match=r"the (train|val) split has \d+ bytes .* seq_len=4096"):
        TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt", seq_len=4096).setup("fit")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "one.txt").write_text("x" * 100)
    with pytest.raises(ValueError, match="needs at least 2 matching files, found 1"):
        TextCorpusDataModule(data_dir=str(tmp_path / "only"), pattern="*.txt").setup("fit")
    with pytest.raises(RuntimeError, match=r"before setup\(\)"):
        TextCorpusDataModule(data_dir=str(tmp_path), pattern="*.txt").train_dataloader()
