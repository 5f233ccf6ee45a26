"""Byte-level text corpus: packed next-token samples and a Lightning data module over real text files.

The default corpus is the source of the running interpreter's standard library: a real, multi-megabyte body of text
that nobody in this project wrote and that exists on every machine with Python, so examples, tests and benchmarks can
train a language model without downloading anything.

[Note: byte-level tokens]
Tokens are raw bytes (vocabulary 256). There is no tokenizer to ship, version or download, every file is encodable,
and the token stream of a corpus is a pure function of its files. Documents are concatenated without separator bytes;
their start offsets are recorded instead (`PackedByteDataset.doc_starts`) so variable-length (per-document) attention
or loss masking can be built later without changing the stream.

[Note: deterministic split by file]
The train/val split is decided per file by a stable hash (BLAKE2b) of the file's path relative to the corpus root and
of the seed, never by listing order, random state or world size: every rank, every run and every filesystem derives
the same split. Splitting by file (not by sample) keeps near-duplicate windows of the same file out of both sides.
Files are then read in sorted relative-path order, and `max_bytes` keeps a prefix of that order, so the capped corpus
is also deterministic.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

__all__ = [
    "BYTE_VOCAB_SIZE",
    "SKIPPED_DIR_NAMES",
    "PackedByteDataset",
    "TextCorpusConfig",
    "TextCorpusDataModule",
    "corpus_files",
    "is_val_file",
    "read_documents",
]

BYTE_VOCAB_SIZE = 256
"""Number of distinct tokens of a byte-level model."""

SKIPPED_DIR_NAMES: frozenset[str] = frozenset({"test", "tests", "site-packages", "dist-packages", "__pycache__"})
"""Directory names never descended into: test suites (large generated data) and installed third-party packages."""


class PackedByteDataset(Dataset[tuple[Tensor, Tensor]]):
    """Documents (bytes) concatenated into one token stream and cut into fixed-length next-token samples.

    Sample ``i`` reads the ``seq_len + 1`` tokens starting at ``i * seq_len`` and returns ``(x, y)`` with
    ``y[t] == x[t + 1]``. The inputs of consecutive samples do not overlap, and each stream token (except the first)
    is a target exactly once; a tail shorter than a sample is dropped.

    Args:
        documents: The documents in stream order; each must be non-empty ``bytes``/``bytearray``.
        seq_len: Tokens per sample (length of ``x`` and ``y``).

    Raises:
        TypeError: If a document is not bytes-like.
        ValueError: If ``seq_len < 1``, a document is empty, or the stream is shorter than ``seq_len + 1`` tokens.
    """

    tokens: Tensor  # uint8 [num_tokens]: the packed stream
    doc_starts: Tensor  # int64 [num_docs]: stream offset of each document's first byte, strictly increasing
    seq_len: int

    def __init__(self, documents: Sequence[bytes], seq_len: int) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"PackedByteDataset: seq_len must be a positive int, got {seq_len!r}.")
        lengths = [_document_length(i, doc) for i, doc in enumerate(documents)]
        stream = bytearray().join(documents)
        if len(stream) < seq_len + 1:
            raise ValueError(
                f"PackedByteDataset: the corpus has {len(stream)} bytes in {len(lengths)} documents, but one sample "
                f"of seq_len={seq_len} needs {seq_len + 1} bytes. Add text, or lower seq_len."
            )
        self.seq_len = seq_len
        self.tokens = torch.frombuffer(stream, dtype=torch.uint8).clone()  # own the memory; `stream` is temporary
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64)
        self.doc_starts = torch.cumsum(starts, dim=0)

    @property
    def num_tokens(self) -> int:
        """Length of the packed stream, in bytes."""
        return self.tokens.numel()

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = self._sample_start(index)
        chunk = self.tokens[start : start + self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]

    def document_boundaries(self, index: int) -> Tensor:
        """Positions inside sample ``index`` where a document starts.

        Args:
            index: Sample index (negative values count from the end).

        Returns:
            Sorted int64 tensor of positions ``p`` in ``[0, seq_len)`` such that ``x[p]`` is the first byte of a
            document. It holds ``0`` only when the sample starts exactly at a document start; it is empty when the
            whole sample lies inside one document.

        Raises:
            IndexError: If ``index`` is out of range.
        """
        start = self._sample_start(index)
        bounds = torch.tensor([start, start + self.seq_len], dtype=torch.int64)
        lo, hi = torch.searchsorted(self.doc_starts, bounds).tolist()
        return self.doc_starts[lo:hi] - start

    def cu_seqlens(self, index: int) -> Tensor:
        """Cumulative document lengths inside sample ``index``, in the ``cu_seqlens`` form of varlen attention.

        Args:
            index: Sample index (negative values count from the end).

        Returns:
            Int64 tensor ``[0, b_1, ..., b_k, seq_len]`` where ``b_j`` are the non-zero document boundaries of the
            sample; consecutive differences are the lengths of the document pieces it contains.

        Raises:
            IndexError: If ``index`` is out of range.
        """
        inner = self.document_boundaries(index)
        inner = inner[inner > 0]
        edges = torch.tensor([0, self.seq_len], dtype=torch.int64)
        return torch.cat([edges[:1], inner, edges[1:]])

    def _sample_start(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"PackedByteDataset: sample index {index} is out of range for {n} samples.")
        return (index % n) * self.seq_len


def _document_length(index: int, doc: object) -> int:
    if not isinstance(doc, (bytes, bytearray)):
        hint = " Encode text first, e.g. text.encode('utf-8')." if isinstance(doc, str) else ""
        raise TypeError(f"PackedByteDataset: document {index} must be bytes, got {type(doc).__name__}.{hint}")
    if len(doc) == 0:
        raise ValueError(f"PackedByteDataset: document {index} is empty; drop empty documents before packing.")
    return len(doc)


def corpus_files(root: str | os.PathLike[str], pattern: str = "*.py") -> list[str]:
    """List the corpus files under ``root``, as sorted relative POSIX paths.

    The walk is recursive; ``pattern`` is a case-sensitive glob matched against file *names* (``"*.py"``,
    ``"*.txt"``). Directories named in `SKIPPED_DIR_NAMES` are not descended into, and symbolic links to
    directories are not followed.

    Args:
        root: The corpus directory.
        pattern: File-name glob.

    Returns:
        Relative paths with ``/`` separators, sorted, so the order is independent of the filesystem.

    Raises:
        ValueError: If ``root`` is not a directory.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        raise ValueError(f"corpus_files: data directory {str(root_path)!r} does not exist or is not a directory.")
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = [d for d in dirnames if d not in SKIPPED_DIR_NAMES]
        rel_dir = Path(dirpath).relative_to(root_path)
        found.extend((rel_dir / f).as_posix() for f in filenames if fnmatch.fnmatchcase(f, pattern))
    return sorted(found)


def _split_key(rel_path: str, seed: int) -> float:
    """Stable pseudo-uniform number in [0, 1) for a file. See [Note: deterministic split by file]."""
    digest = hashlib.blake2b(f"{seed}\0{rel_path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def is_val_file(rel_path: str, val_fraction: float, seed: int = 0) -> bool:
    """Whether a file belongs to the validation split, by a stable hash of its relative path.

    Args:
        rel_path: Path relative to the corpus root, with ``/`` separators.
        val_fraction: Expected fraction of files in the validation split.
        seed: Changes which files are chosen.

    Returns:
        True for validation files; about ``val_fraction`` of all paths.
    """
    return _split_key(rel_path, seed) < val_fraction


def _split_files(files: Sequence[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Split sorted relative paths into (train, val), each non-empty and sorted."""
    if len(files) < 2:
        raise ValueError(
            f"TextCorpusDataModule: the split is by file and needs at least 2 matching files, found {len(files)}: "
            f"{list(files)}. Add files or widen `pattern`."
        )
    keys = {f: _split_key(f, seed) for f in files}
    val = {f for f in files if keys[f] < val_fraction}
    # Tiny corpora: keep both sides non-empty, still by hash order, so the choice stays deterministic.
    if not val:
        val = {min(files, key=keys.__getitem__)}
    if len(val) == len(files):
        val.discard(max(files, key=keys.__getitem__))
    return [f for f in files if f not in val], [f for f in files if f in val]


def read_documents(root: str | os.PathLike[str], rel_paths: Sequence[str], max_bytes: int | None) -> list[bytes]:
    """Read files in the given order, keeping those that are non-empty valid UTF-8, up to a byte budget.

    Args:
        root: The corpus directory.
        rel_paths: Paths relative to ``root``, in the order to read.
        max_bytes: Total byte budget; the corpus is the first ``max_bytes`` bytes of the concatenation (the last
            file kept may be truncated). None reads everything.

    Returns:
        The documents, in order.
    """
    docs: list[bytes] = []
    total = 0
    for rel in rel_paths:
        if max_bytes is not None and total >= max_bytes:
            break
        data = (Path(root) / rel).read_bytes()
        if not data or not _is_utf8(data):
            continue
        if max_bytes is not None:
            data = data[: max_bytes - total]
        docs.append(data)
        total += len(data)
    return docs


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


@dataclass(frozen=True)
class TextCorpusConfig:
    """Validated settings of `TextCorpusDataModule`; see its docstring for the meaning of each field."""

    data_dir: str | None = None
    """Corpus root; None means the interpreter's standard library (``sysconfig.get_paths()["stdlib"]``)."""
    pattern: str = "*.py"
    """File-name glob, matched recursively."""
    seq_len: int = 256
    """Tokens per sample."""
    batch_size: int = 8
    """Micro-batch size per process."""
    val_fraction: float = 0.05
    """Expected fraction of files in the validation split, in (0, 1)."""
    max_bytes: int | None = 4_000_000
    """Train-corpus byte cap (val gets ``max_bytes * val_fraction``); None reads every file."""
    num_workers: int = 0
    """DataLoader worker processes."""
    seed: int = 0
    """Seed of the file split and of the training shuffle."""

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("num_workers", self.num_workers, minimum=0)
        _check_int("seed", self.seed, minimum=None)
        if self.max_bytes is not None:
            _check_int("max_bytes", self.max_bytes, minimum=1, hint=" Pass None to read the whole corpus.")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)):
            raise TypeError(f"TextCorpusDataModule: val_fraction must be a float, got {self.val_fraction!r}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(
                f"TextCorpusDataModule: val_fraction must be in (0, 1), got {self.val_fraction!r}. "
                "To skip validation, pass limit_val_batches=0 to the Trainer."
            )
        if not self.pattern:
            raise ValueError("TextCorpusDataModule: pattern must be a non-empty file-name glob such as '*.py'.")

    @property
    def root(self) -> str:
        """The corpus directory actually used."""
        return self.data_dir if self.data_dir is not None else sysconfig.get_paths()["stdlib"]

    @property
    def val_max_bytes(self) -> int | None:
        """Byte cap of the validation corpus."""
        return None if self.max_bytes is None else max(1, int(self.max_bytes * self.val_fraction))


def _check_int(name: str, value: object, minimum: int | None, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"TextCorpusDataModule: {name} must be an int, got {value!r}.{hint}")
    if minimum is not None and value < minimum:
        raise ValueError(f"TextCorpusDataModule: {name} must be >= {minimum}, got {value!r}.{hint}")


class TextCorpusDataModule(LightningDataModule):
    """Byte-level language-modelling data from a directory of text files (by default, Python's standard library).

    `setup` lists the files matching ``pattern`` (see `corpus_files`), splits them into train and validation by a
    stable hash of each relative path (see [Note: deterministic split by file]), reads each side in sorted order up to
    its byte cap, and packs it with `PackedByteDataset`. Every rank computes the same datasets. No distributed
    sampler is created here: Lightning injects a ``DistributedSampler`` when the strategy is distributed.

    Args:
        data_dir: Corpus root; None uses ``sysconfig.get_paths()["stdlib"]``.
        pattern: File-name glob, matched recursively; test directories and ``site-packages`` are skipped.
        seq_len: Tokens per sample.
        batch_size: Micro-batch size per process.
        val_fraction: Expected fraction of files held out for validation, in (0, 1).
        max_bytes: Train-corpus byte cap (validation gets ``max_bytes * val_fraction``); None reads every file.
        num_workers: DataLoader worker processes.
        seed: Seed of the file split and of the training shuffle.

    Raises:
        ValueError: For a missing ``data_dir`` or an out-of-range argument (the message names it).
        TypeError: For an argument of the wrong type.
    """

    config: TextCorpusConfig
    train_dataset: PackedByteDataset | None
    val_dataset: PackedByteDataset | None

    def __init__(
        self,
        data_dir: str | None = None,
        pattern: str = "*.py",
        seq_len: int = 256,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_bytes: int | None = 4_000_000,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = TextCorpusConfig(
            data_dir=data_dir,
            pattern=pattern,
            seq_len=seq_len,
            batch_size=batch_size,
            val_fraction=val_fraction,
            max_bytes=max_bytes,
            num_workers=num_workers,
            seed=seed,
        )
        if not Path(self.config.root).is_dir():
            raise ValueError(
                f"TextCorpusDataModule: data_dir {self.config.root!r} does not exist or is not a directory."
            )
        self.save_hyperparameters()
        self.train_dataset = None
        self.val_dataset = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids (bytes): 256."""
        return BYTE_VOCAB_SIZE

    @override
    def setup(self, stage: str) -> None:
        """Build both datasets (once; later calls are no-ops).

        Args:
            stage: Lightning stage name; both datasets are built for every stage.

        Raises:
            ValueError: If no file matches, there are fewer than 2 files, or a split is shorter than one sample.
        """
        if self.train_dataset is not None and self.val_dataset is not None:
            return
        cfg = self.config
        files = corpus_files(cfg.root, cfg.pattern)
        if not files:
            raise ValueError(
                f"TextCorpusDataModule: no files match pattern {cfg.pattern!r} under data_dir {cfg.root!r} "
                f"(directories named {sorted(SKIPPED_DIR_NAMES)} are skipped)."
            )
        train_files, val_files = _split_files(files, cfg.val_fraction, cfg.seed)
        self.train_dataset = self._build("train", train_files, cfg.max_bytes)
        self.val_dataset = self._build("val", val_files, cfg.val_max_bytes)

    def _build(self, split: str, files: list[str], max_bytes: int | None) -> PackedByteDataset:
        cfg = self.config
        docs = read_documents(cfg.root, files, max_bytes)
        size = sum(len(d) for d in docs)
        if size < cfg.seq_len + 1:
            raise ValueError(
                f"TextCorpusDataModule: the {split} split has {size} bytes of UTF-8 text in {len(docs)} of "
                f"{len(files)} files (cap {max_bytes}), fewer than one sample of seq_len={cfg.seq_len} needs "
                f"({cfg.seq_len + 1}). Lower seq_len, or raise max_bytes or val_fraction."
            )
        return PackedByteDataset(docs, cfg.seq_len)

    @override
    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Shuffled training batches ``(x, y)`` of shape [batch_size, seq_len]; the last partial batch is dropped."""
        dataset = self._require(self.train_dataset, "train_dataloader")
        generator = torch.Generator().manual_seed(self.config.seed)
        return self._loader(dataset, shuffle=True, drop_last=True, generator=generator)

    @override
    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Validation batches ``(x, y)`` in stream order."""
        dataset = self._require(self.val_dataset, "val_dataloader")
        return self._loader(dataset, shuffle=False, drop_last=False, generator=None)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """The held-out files again (the corpus has no separate test split): ``zlightning test`` evaluates on them."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        """Held-out batches ``(x, y)`` for ``zlightning predict`` (next-byte predictions)."""
        return self.val_dataloader()

    def _loader(
        self, dataset: PackedByteDataset, shuffle: bool, drop_last: bool, generator: torch.Generator | None
    ) -> DataLoader[tuple[Tensor, Tensor]]:
        workers = self.config.num_workers
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            num_workers=workers,
            persistent_workers=workers > 0,
            generator=generator,
        )

    @staticmethod
    def _require(dataset: PackedByteDataset | None, caller: str) -> PackedByteDataset:
        if dataset is None:
            raise RuntimeError(f"TextCorpusDataModule.{caller}() was called before setup(); call setup('fit') first.")
        return dataset
