"""Swap reads are verified as soon as they land, not when their consumer asks ([Note: overlapped read verification]
in zlightning/zero/_swap_io.py); corruption is still reported, by the consumer's ``finish``."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from zlightning.zero._offload_config import NVMeOffload
from zlightning.zero._swap_io import SwapCorruptionError, make_swap_io

BLOCK = 64 << 10


def _io(tmp_path: Path, engine: str):  # type: ignore[no-untyped-def]
    return make_swap_io(NVMeOffload(path=tmp_path, io_engine=engine, block_size=BLOCK, io_threads=2), direct=False)


def _landed(io, ticket) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + 30
    while not io.done(ticket):  # each call also hands landed reads to the checksum pool
        if time.monotonic() > deadline:
            raise TimeoutError("swap read did not land in 30 s")
        time.sleep(1e-3)
    io.done(ticket)


@pytest.fixture(params=["portable", "auto"])
def written(request, tmp_path: Path):  # type: ignore[no-untyped-def]
    """An I/O handle (each engine) and a 4-block buffer written through it: ``(io, values, path, checksums)``."""
    io = _io(tmp_path, request.param)
    src = torch.randn(4 * BLOCK // 4)
    sums: list[int] = []
    path = str(tmp_path / "t.swp")
    try:
        io.finish(io.pwrite(src, path, 0, sums))
        yield io, src, path, sums
    finally:
        io.close()


def test_a_landed_read_is_verified_before_its_consumer_asks(written) -> None:  # type: ignore[no-untyped-def]
    io, src, path, sums = written
    dst = torch.empty_like(src)
    ticket = io.pread(dst, path, 0, sums)
    _landed(io, ticket)
    assert ticket.checks is not None and len(ticket.checks) > 0  # submitted before finish
    io.finish(ticket)
    assert torch.equal(dst, src)


def test_corruption_found_by_an_early_verification_is_raised_by_finish(written) -> None:  # type: ignore[no-untyped-def]
    io, src, path, sums = written
    with open(path, "r+b") as f:  # one byte of the third block changes behind the engine's back
        f.seek(2 * BLOCK + 123)
        byte = f.read(1)
        f.seek(2 * BLOCK + 123)
        f.write(bytes([byte[0] ^ 0xFF]))
    ticket = io.pread(torch.empty_like(src), path, 0, sums)
    _landed(io, ticket)
    assert ticket.checks is not None
    with pytest.raises(SwapCorruptionError, match="block 2"):
        io.finish(ticket)


@pytest.mark.parametrize(
    "nbytes",
    [8, 24, 4096, 4096 + 24, 4 * BLOCK, 4 * BLOCK + 8 * 3, 3 * BLOCK + 4, 2 * BLOCK + 6],
)
def test_block_checksums_in_one_call_equal_the_reference_block_by_block(
    nbytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The native one-pass kernel ([Note: the checksum in one pass]) and the fallback give `block_checksum` of
    every block, tails that are not whole words included, and wrapping sums (every byte 0xff) too."""
    from zlightning.zero import _swap_io

    g = torch.Generator().manual_seed(nbytes)
    for raw in (
        torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g),
        torch.full((nbytes,), 255, dtype=torch.uint8),
    ):
        expected = [_swap_io.block_checksum(raw[s : s + BLOCK]) for s in range(0, nbytes, BLOCK)]
        assert _swap_io.block_checksums(raw, BLOCK) == expected
        monkeypatch.setattr(_swap_io, "_native_checksums", False)
        assert _swap_io.block_checksums(raw, BLOCK) == expected
        monkeypatch.undo()


def test_native_block_checksums_match_the_reference() -> None:
    from zlightning.kernels import _ext

    from zlightning.zero._swap_io import block_checksum

    if not _ext.available():
        pytest.skip("native kernels not built")
    raw = torch.randint(0, 256, (3 * BLOCK + 8 * 5,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for view in (raw, raw[8:], raw[3 : 3 + 2 * BLOCK]):  # aligned, offset by a word, and misaligned by 3 bytes
        pairs = torch.ops.zlightning.block_checksums(view, BLOCK).tolist()
        got = [((p % 2**64) << 64) | (w % 2**64) for p, w in pairs]
        assert got == [block_checksum(view[s : s + BLOCK].clone()) for s in range(0, view.numel(), BLOCK)]
    with pytest.raises(RuntimeError, match="8-byte words"):
        torch.ops.zlightning.block_checksums(raw[:12], BLOCK)
