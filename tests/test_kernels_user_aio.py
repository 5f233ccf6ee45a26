"""DeepSpeedIOEngine as users drop it: an engine garbage-collected (or closed) with requests nobody waited for must
finish them and report their errors, on both backends."""

from __future__ import annotations

import gc

import pytest
import torch
from zlightning.kernels import DeepSpeedIOEngine

from tests.test_kernels_aio import BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_engine_finishes_its_queued_writes(tmp_path, backend):
    data = torch.randint(0, 256, (4 << 20,), dtype=torch.uint8)
    eng = DeepSpeedIOEngine(block_size=4096, queue_depth=2, backend=backend)  # 1024 blocks, 2 in the kernel
    eng.async_pwrite(data, tmp_path / "w.bin", 0)
    del eng  # no wait(): io_uring's ring was destroyed with most blocks still queued (file cut at a few KiB)
    gc.collect()
    got = (tmp_path / "w.bin").read_bytes()
    assert len(got) == data.numel() and got == bytes(data.numpy())


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropped_engine_warns_with_the_errors_nobody_waited_for(tmp_path, backend):
    (tmp_path / "short.bin").write_bytes(b"x" * 10)
    buf = torch.zeros(100, dtype=torch.uint8)
    eng = DeepSpeedIOEngine(block_size=4096, backend=backend)
    eng.async_pread(buf, tmp_path / "short.bin", 0)
    with pytest.warns(RuntimeWarning, match=r"garbage-collected with 1 failed block.*short\.bin.*short read"):
        del eng  # the short read was lost silently
        gc.collect()
    eng = DeepSpeedIOEngine(block_size=4096, backend=backend)
    eng.async_pread(buf, tmp_path / "short.bin", 0)
    with pytest.raises(OSError, match="short read"):
        eng.close()  # close() raises through wait(), and does not warn a second time
    del eng
    gc.collect()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_temporary_buffer_stays_alive_until_its_request_completes(tmp_path, backend):
    eng = DeepSpeedIOEngine(block_size=4096, queue_depth=1, backend=backend)
    eng.async_pwrite(torch.full((8 << 20,), 7, dtype=torch.uint8), tmp_path / "t.bin", 0)  # freed at once before
    junk = [torch.full((8 << 20,), 1, dtype=torch.uint8) for _ in range(4)]  # reuse its memory, if it was freed
    eng.wait()  # was EFAULT (unmapped) or other bytes in the file
    assert (tmp_path / "t.bin").read_bytes() == b"\x07" * (8 << 20) and len(junk) == 4
