"""DeepSpeedIOEngine: real files, real O_DIRECT, real errors (ENOSPC from /dev/full, short reads, missing files)."""

from __future__ import annotations

import errno
import os
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zlightning.kernels import AIOError, DeepSpeedIOEngine, _aio, _ext

BACKENDS = [
    "python",
    pytest.param(
        "native",
        marks=pytest.mark.skipif(
            not _ext.aio_native_available(), reason="native io_uring backend not built or io_uring not allowed"
        ),
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def _bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_roundtrip_many_requests_in_flight(tmp_path, backend):
    eng = DeepSpeedIOEngine(block_size=64 << 10, queue_depth=16, backend=backend)
    n = (1 << 20) + 4096  # 17 blocks of 64 KiB: all aligned, O_DIRECT
    srcs = []
    for i in range(4):
        buf = eng.new_cpu_locked_tensor(n // 4, torch.empty(0, dtype=torch.float32))
        assert buf.data_ptr() % _aio.ALIGNMENT == 0
        buf.copy_(torch.randn(n // 4, generator=torch.Generator().manual_seed(i)))
        srcs.append(buf)
        req = eng.async_pwrite(buf, tmp_path / "swap.bin", i * n)
        assert req.nbytes == n and req.offset == i * n
    assert eng.pending() == 4
    assert eng.wait() == 4
    assert eng.pending() == 0 and eng.wait() == 0
    assert os.path.getsize(tmp_path / "swap.bin") == 4 * n
    outs = [eng.new_cpu_locked_tensor(n // 4, srcs[0]) for _ in range(4)]
    reqs = [eng.async_pread(out, tmp_path / "swap.bin", i * n) for i, out in enumerate(outs)]
    assert eng.wait() == 4
    assert all(r.done() for r in reqs)
    for src, out in zip(srcs, outs):
        assert torch.equal(src, out)
    for t in srcs + outs:
        eng.free_cpu_locked_tensor(t)


def test_large_locked_buffers_are_huge_page_aligned_and_round_trip(tmp_path, backend):
    # >= 2 MiB: the mmap'ed, huge-page-advised, prefaulted path of new_cpu_locked_tensor ([Note: buffer memory])
    eng = DeepSpeedIOEngine(block_size=1 << 20, queue_depth=8, backend=backend)
    numel = (3 << 20) // 8 + 3  # 3 MiB + 24 B of float64: the last block is unaligned (buffered tail)
    src = eng.new_cpu_locked_tensor(numel, torch.empty(0, dtype=torch.float64))
    out = eng.new_cpu_locked_tensor(numel, src)
    assert src.dtype == torch.float64 and src.shape == (numel,) and src.is_contiguous()
    if not torch.cuda.is_available():  # CUDA: pinned cudaHostAlloc memory, 4096-aligned only
        assert src.data_ptr() % _aio.HUGE_PAGE == 0 and out.data_ptr() % _aio.HUGE_PAGE == 0
    assert src.data_ptr() % _aio.ALIGNMENT == 0
    src.copy_(torch.randn(numel, dtype=torch.float64, generator=torch.Generator().manual_seed(7)))
    out.fill_(-1.0)
    assert eng.sync_pwrite(src, tmp_path / "big.bin", 8192) == 1
    assert os.path.getsize(tmp_path / "big.bin") == 8192 + numel * 8
    eng.async_pread(out, tmp_path / "big.bin", 8192)
    assert eng.wait() == 1
    assert torch.equal(src, out)
    view = out[5:]  # a view keeps the mapping alive after the engine lets go of the buffer
    eng.free_cpu_locked_tensor(out)
    del out
    assert torch.equal(view, src[5:])
    eng.free_cpu_locked_tensor(src)
    eng.close()


def test_unaligned_buffers_offsets_and_dtypes(tmp_path, backend):
    eng = DeepSpeedIOEngine(block_size=8192, queue_depth=4, backend=backend)
    path = str(tmp_path / "f.bin")
    data = torch.arange(10_007, dtype=torch.float64)[3:]  # storage offset 24 B: unaligned address, odd length
    assert eng.sync_pwrite(data, path, 777) == 1
    raw = _bytes(path)
    assert raw[:777] == b"\0" * 777 and raw[777:] == bytes(data.numpy().tobytes())
    back = torch.empty_like(data)
    assert eng.sync_pread(back, path, 777) == 1
    assert torch.equal(back, data)
    bf = torch.randn(3, 5, 7).to(torch.bfloat16)
    eng.sync_pwrite(bf, path, 8192)
    got = torch.empty_like(bf)
    eng.sync_pread(got, path, 8192)
    assert torch.equal(got, bf)


def test_write_at_offset_never_truncates(tmp_path, backend):
    path = tmp_path / "keep.bin"
    path.write_bytes(b"A" * 20000)
    eng = DeepSpeedIOEngine(block_size=4096, backend=backend)
    eng.sync_pwrite(torch.full((100,), 66, dtype=torch.uint8), path, 4096)
    raw = _bytes(str(path))
    assert len(raw) == 20000 and raw[:4096] == b"A" * 4096 and raw[4096:4196] == b"B" * 100
    assert raw[4196:] == b"A" * (20000 - 4196)


@settings(max_examples=25, deadline=None)
@given(
    nbytes=st.integers(0, 70_000),
    offset=st.integers(0, 20_000),
    skip=st.integers(0, 64),
    block_kib=st.sampled_from([4, 8, 16]),
    backend=st.sampled_from(["python", "native"] if _ext.aio_native_available() else ["python"]),
)
def test_random_requests_match_plain_python(tmp_path_factory, nbytes, offset, skip, block_kib, backend):
    path = str(tmp_path_factory.mktemp("prop") / "x.bin")
    eng = DeepSpeedIOEngine(block_size=block_kib << 10, queue_depth=3, backend=backend)
    src = torch.randint(0, 256, (nbytes + skip,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    view = src[skip:]
    eng.async_pwrite(view, path, offset)
    assert eng.wait() == 1
    raw = _bytes(path)
    assert len(raw) == (offset + nbytes if nbytes else 0)  # an empty write creates the file, extends nothing
    assert raw[offset:] == bytes(view.tolist())
    out = torch.empty(nbytes + 3, dtype=torch.uint8)[3:]
    eng.sync_pread(out, path, offset)
    assert torch.equal(out, view)


def test_short_read_names_file_and_offset(tmp_path, backend):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 10_000)
    eng = DeepSpeedIOEngine(block_size=4096, backend=backend)
    buf = torch.empty(8192, dtype=torch.uint8)
    eng.async_pread(buf, path, 4096)
    with pytest.raises(AIOError, match=r"short read.*10000 bytes") as info:
        eng.wait()
    err = info.value
    assert err.errno == errno.EIO and err.filename == str(path) and err.op == "read"
    assert err.request_offset == 4096 and err.offset == 10_000
    assert "short.bin" in str(err) and "offset 4096" in str(err)
    assert eng.pending() == 0 and eng.wait() == 0  # nothing left in flight after the error


def test_missing_file_raises_at_submit(tmp_path, backend):
    eng = DeepSpeedIOEngine(backend=backend)
    with pytest.raises(AIOError, match=r"nope\.bin.*No such file") as info:
        eng.async_pread(torch.empty(10), tmp_path / "nope.bin", 128)
    assert info.value.errno == errno.ENOENT and info.value.request_offset == 128
    with pytest.raises(AIOError, match="No such file"):
        eng.sync_pwrite(torch.empty(10), tmp_path / "no_dir" / "f.bin", 0)
    assert eng.pending() == 0


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_enospc_surfaces_at_wait_after_other_requests_finish(tmp_path, backend):
    eng = DeepSpeedIOEngine(block_size=4096, queue_depth=4, backend=backend)
    ok = torch.arange(5000, dtype=torch.int32)
    eng.async_pwrite(ok, tmp_path / "ok.bin", 0)
    eng.async_pwrite(torch.ones(3000), "/dev/full", 8192)
    with pytest.raises(AIOError, match=r"write of 12000 bytes at offset 8192 of '/dev/full'.*No space") as info:
        eng.wait()
    assert info.value.errno == errno.ENOSPC
    assert (tmp_path / "ok.bin").read_bytes() == bytes(ok.numpy().tobytes())  # the good request completed
    assert eng.pending() == 0


def test_io_error_on_directory_is_reported(tmp_path, backend):
    eng = DeepSpeedIOEngine(backend=backend)
    eng.async_pread(torch.empty(16, dtype=torch.uint8), tmp_path, 0)
    with pytest.raises(AIOError) as info:
        eng.wait()
    assert info.value.errno in (errno.EISDIR, errno.EINVAL) and info.value.filename == str(tmp_path)


def test_filesystem_without_o_direct_falls_back_with_one_warning(tmp_path, monkeypatch):
    # Fault injection: the kernel's EINVAL for O_DIRECT on such filesystems cannot be produced on this disk.
    real_open = os.open

    def refusing_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(_aio.os, "open", refusing_open)
    monkeypatch.setattr(_aio, "_warned_filesystems", set())
    eng = DeepSpeedIOEngine(block_size=4096, backend="python")
    buf = eng.new_cpu_locked_tensor(4096, torch.empty(0))
    buf.normal_()
    with pytest.warns(RuntimeWarning, match="does not support O_DIRECT"):
        eng.sync_pwrite(buf, tmp_path / "a.bin", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per filesystem
        out = torch.empty_like(buf)
        eng.sync_pread(out, tmp_path / "a.bin", 0)
    assert torch.equal(out, buf)


def test_plan_uses_direct_io_only_for_aligned_blocks():
    a = 1 << 20  # an aligned address
    plan = _aio._plan_blocks(a, 3 * 8192 + 100, 8192, 8192)
    assert plan == [
        (True, a, 8192, 8192),
        (True, a + 8192, 8192, 16384),
        (True, a + 16384, 8192, 24576),
        (False, a + 24576, 100, 32768),
    ]
    plan = _aio._plan_blocks(a, 10_000, 8192, 16384)
    assert plan == [(True, a, 8192, 8192), (False, a + 8192, 1808, 16384)]
    assert all(not d for d, *_ in _aio._plan_blocks(a + 8, 20_000, 0, 8192))


def test_bad_arguments_have_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="block_size=1000.*multiple of 4096"):
        DeepSpeedIOEngine(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth=0"):
        DeepSpeedIOEngine(queue_depth=0)
    with pytest.raises(ValueError, match="backend='gpu'"):
        DeepSpeedIOEngine(backend="gpu")  # type: ignore[arg-type]
    eng = DeepSpeedIOEngine(backend="python")
    with pytest.raises(ValueError, match="contiguous"):
        eng.async_pwrite(torch.empty(4, 4).t(), tmp_path / "x", 0)
    with pytest.raises(ValueError, match="file_offset=-1"):
        eng.async_pwrite(torch.empty(4), tmp_path / "x", -1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        eng.async_pwrite(b"abc", tmp_path / "x", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not allocated by this engine"):
        eng.free_cpu_locked_tensor(torch.empty(3))
    assert (
        eng.get_block_size(),
        eng.get_queue_depth(),
        eng.get_single_submit(),
        eng.get_overlap_events(),
        eng.get_intra_op_parallelism(),
    ) == (1 << 20, 8, False, False, 1)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.async_pwrite(torch.empty(4), tmp_path / "x", 0)


def test_deepspeed_general_forms_read_write_and_validate(tmp_path, backend):
    eng = DeepSpeedIOEngine(block_size=4096, queue_depth=4, backend=backend)
    path = tmp_path / "g.bin"
    src = torch.arange(3000, dtype=torch.float32)  # 12000 B: aligned body + buffered tail
    assert eng.pwrite(src, path, True, False, 4096) == 1  # DeepSpeed's positional (validate, async, file_offset)
    assert eng.write(src, tmp_path / "w.bin", validate=True) == 1
    assert (tmp_path / "w.bin").read_bytes() == src.numpy().tobytes()
    out = torch.empty_like(src)
    assert eng.pread(out, path, validate=True, async_op=True, file_offset=4096) == 0 and eng.pending() == 1
    assert eng.wait() == 1 and torch.equal(out, src)
    again = torch.empty_like(src)
    assert eng.read(again, tmp_path / "w.bin", True) == 1 and torch.equal(again, src)
    assert eng.get_alignment() == 4096
    locked = eng.new_cpu_locked_tensor(16, src)
    assert eng.is_pinned(locked) and not eng.is_pinned(torch.empty(16))


def test_validation_names_the_first_differing_byte(tmp_path):
    # The python backend completes blocks without wait(), so the file can be changed between completion and
    # validation: what a concurrent writer or a lying device would do.
    eng = DeepSpeedIOEngine(block_size=4096, backend="python")
    path = tmp_path / "v.bin"
    src = torch.zeros(8192, dtype=torch.uint8)
    assert eng.pwrite(src, path, validate=True, async_op=True) == 0
    (req,) = eng._pending
    req._event.wait(30)
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\x01")
    with pytest.raises(AIOError, match=r"validation: buffer and file differ at byte 5000") as info:
        eng.wait()
    assert info.value.errno == errno.EIO and info.value.offset == 5000 and info.value.filename == str(path)
    assert eng.pending() == 0
