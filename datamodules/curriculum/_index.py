"""Metric index files: DeepSpeed's variant of Megatron's memory-mapped indexed dataset, written and read with numpy.

[Note: index file format]
An index file ``PREFIX`` is a pair ``PREFIX.idx`` + ``PREFIX.bin`` holding a list of integer rows (variable length).
``.bin`` is the rows' values concatenated, in the file's dtype. ``.idx`` is, all little-endian:

====================  ==================  ===========================================================
field                 type                meaning
====================  ==================  ===========================================================
magic                 9 bytes             ``b"MMIDIDX\\x00\\x00"``
version               u64                 1
dtype code            u8                  1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 uint16, 7 uint32,
                                          8 uint64 (DeepSpeed's codes; classic Megatron differs from 6 on)
len                   u64                 number of rows
doc_count             u64                 length of ``doc_idx``
sizes                 int32[len]          elements per row
pointers              int64[len]          byte offset of each row in ``.bin``
doc_idx               int64[doc_count]    document boundaries (``[0, len]`` here: one document)
====================  ==================  ===========================================================

Files written here are readable by DeepSpeed's ``MMapIndexedDataset`` and vice versa. `IndexFile` maps ``.bin``
read-only (``numpy.memmap``): rows are views, nothing is loaded until touched, so a 100M-sample index costs no RAM.

Files are written to a temporary name and renamed into place (``os.replace``), so a reader never sees a half-written
file and several ranks may write the same file concurrently.
"""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["IndexFile", "find_fit_int_dtype", "write_index_file"]

_MAGIC = b"MMIDIDX\x00\x00"
_CODES: dict[int, type[np.integer]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.uint16,
    7: np.uint32,
    8: np.uint64,
}
_CODE_OF = {np.dtype(t): c for c, t in _CODES.items()}


def find_fit_int_dtype(min_value: int, max_value: int) -> np.dtype:
    """The smallest integer dtype holding ``[min_value, max_value]``: unsigned when ``min_value >= 0``.

    Raises:
        ValueError: If no 64-bit integer type holds the range.
    """
    kinds = (np.uint8, np.uint16, np.uint32, np.uint64) if min_value >= 0 else (np.int8, np.int16, np.int32, np.int64)
    for kind in kinds:
        info = np.iinfo(kind)
        if info.min <= min_value and max_value <= info.max:
            return np.dtype(kind)
    raise ValueError(f"find_fit_int_dtype: no integer dtype holds [{min_value}, {max_value}].")


def _paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path]:
    p = Path(prefix)
    return p.with_name(p.name + ".idx"), p.with_name(p.name + ".bin")


def write_index_file(
    prefix: str | os.PathLike[str], values: np.ndarray, sizes: Sequence[int] | np.ndarray, dtype: np.dtype | type
) -> None:
    """Writes ``PREFIX.idx``/``PREFIX.bin`` (see [Note: index file format]) atomically.

    Args:
        prefix: Path without extension.
        values: The rows' values concatenated (1-D, integer).
        sizes: Elements per row; must sum to ``len(values)``.
        dtype: Storage dtype, one of the eight integer types of the format.

    Raises:
        ValueError: For an unsupported dtype, mismatched sizes, or values that do not fit the dtype.
    """
    dt = np.dtype(dtype)
    if dt not in _CODE_OF:
        raise ValueError(f"write_index_file({prefix}): dtype {dt} is not one of {sorted(map(str, _CODE_OF))}.")
    values = np.asarray(values).reshape(-1)
    sizes_arr = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if int(sizes_arr.sum()) != values.size or (sizes_arr < 0).any():
        raise ValueError(f"write_index_file({prefix}): sizes sum to {int(sizes_arr.sum())}, values has {values.size}.")
    if values.size and (values.min() < np.iinfo(dt).min or values.max() > np.iinfo(dt).max):
        raise ValueError(f"write_index_file({prefix}): values [{values.min()}, {values.max()}] do not fit {dt}.")
    pointers = np.zeros_like(sizes_arr)
    np.cumsum(sizes_arr[:-1] * dt.itemsize, out=pointers[1:])
    idx_path, bin_path = _paths(prefix)
    idx_path.parent.mkdir(parents=True, exist_ok=True)
    header = _MAGIC + struct.pack("<Q", 1) + struct.pack("<B", _CODE_OF[dt])
    header += struct.pack("<Q", sizes_arr.size) + struct.pack("<Q", 2)
    body = sizes_arr.astype("<i4").tobytes() + pointers.astype("<i8").tobytes()
    body += np.array([0, sizes_arr.size], dtype="<i8").tobytes()
    _atomic_write(bin_path, values.astype(dt.newbyteorder("<")).tobytes())
    _atomic_write(idx_path, header + body)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class IndexFile:
    """A read-only, memory-mapped index file (see [Note: index file format]).

    ``f[i]`` is row ``i`` (a numpy view), ``len(f)`` the number of rows, `values` all rows concatenated.

    Args:
        prefix: Path without extension.

    Raises:
        FileNotFoundError: If ``PREFIX.idx`` or ``PREFIX.bin`` is missing.
        ValueError: If the ``.idx`` header is not this format.
    """

    prefix: str
    dtype: np.dtype
    sizes: np.ndarray  # int32 [len]
    pointers: np.ndarray  # int64 [len], byte offsets into .bin
    doc_idx: np.ndarray  # int64 [doc_count]
    values: np.ndarray  # dtype [sum(sizes)], memory-mapped

    def __init__(self, prefix: str | os.PathLike[str]) -> None:
        self.prefix = str(prefix)
        idx_path, bin_path = _paths(prefix)
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise FileNotFoundError(
                    f"IndexFile: {p} does not exist. Metric index files are written by DataAnalyzer "
                    "(`zlightning analyze`); check the index_to_sample_path / index_to_metric_path settings."
                )
        raw = idx_path.read_bytes()
        if raw[:9] != _MAGIC:
            raise ValueError(f"IndexFile: {idx_path} does not start with the MMIDIDX magic; not an index file.")
        (version,) = struct.unpack_from("<Q", raw, 9)
        (code,) = struct.unpack_from("<B", raw, 17)
        if version != 1 or code not in _CODES:
            raise ValueError(f"IndexFile: {idx_path} has version {version} / dtype code {code}; expected 1 / 1..8.")
        n, docs = struct.unpack_from("<QQ", raw, 18)
        self.dtype = np.dtype(_CODES[code])
        self.sizes = np.frombuffer(raw, dtype="<i4", count=n, offset=34)
        self.pointers = np.frombuffer(raw, dtype="<i8", count=n, offset=34 + 4 * n)
        self.doc_idx = np.frombuffer(raw, dtype="<i8", count=docs, offset=34 + 12 * n)
        total = int(self.sizes.sum(dtype=np.int64))
        if total == 0:
            self.values = np.zeros(0, dtype=self.dtype)
        else:
            self.values = np.memmap(bin_path, dtype=self.dtype.newbyteorder("<"), mode="r", shape=(total,))
        self._starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=self._starts[1:])

    def __len__(self) -> int:
        return int(self.sizes.size)

    def __getitem__(self, row: int) -> np.ndarray:
        n = len(self)
        if not -n <= row < n:
            raise IndexError(f"IndexFile({self.prefix}): row {row} out of range for {n} rows.")
        row %= n
        return self.values[self._starts[row] : self._starts[row + 1]]

    @property
    def row_starts(self) -> np.ndarray:
        """Element offset of each row in `values`, plus the total at the end (int64 [len + 1])."""
        return self._starts
