"""ZeRO-Infinity faults: illegal swap transitions, unusable paths, disk full, corrupted or truncated swap files,
stale folders of crashed runs, a process killed mid-step then restarted, SIGTERM. Real files, real processes."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.zero import (
    DeepSpeedZeroOptimizer_Stage3,
    NVMeOffload,
    SwapCorruptionError,
    SwapPathError,
    SwapSpaceError,
    SwapState,
    SwapStateError,
    ZeroConfig,
    load_sharded,
    save_sharded,
)
from zlightning.zero._swap import Swapper, SwapTensor
from zlightning.zero._swap_io import SwapDirectory, check_swap_path

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A one-rank gloo group in this process (the engine needs one; spawning would cost seconds per test)."""
    if dist.is_initialized():
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _files(path: Path) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]


def _engine(path: Path, params: bool = False, **opt: Any) -> tuple[torch.nn.Module, DeepSpeedZeroOptimizer_Stage3]:
    model = tiny_gpt()
    policy = NVMeOffload(path=path, buffer_size=opt.pop("buffer_size", 1024), buffer_count=6, **opt)
    cfg = ZeroConfig(
        param_persistence_threshold=0,
        offload_optimizer=policy,
        offload_params=NVMeOffload(path=path, buffer_size=16384, buffer_count=3, **opt) if params else None,
    )
    return model, DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)


def _step(model: torch.nn.Module, zero: DeepSpeedZeroOptimizer_Stage3, batch: torch.Tensor) -> None:
    zero.backward(gpt_loss(model, batch))
    zero.step()


# ==================================================================== state machine and pool
def test_swap_state_machine_and_pool_bounds(tmp_path: Path) -> None:
    folder = SwapDirectory(tmp_path, "unit", 0)
    folder.open("remove")
    swapper = Swapper(
        NVMeOffload(path=tmp_path, buffer_count=2, buffer_size=1024), folder, direct=False, pin=False, nbytes=4096
    )
    a = SwapTensor("a", folder.file("a.swp"), 0, 1000, torch.float32)
    b = SwapTensor("b", folder.file("a.swp"), 4096, 1000, torch.float32)
    c = SwapTensor("c", folder.file("c.swp"), 0, 10, torch.float32)
    with pytest.raises(SwapStateError, match="illegal swap transition from ON_DEVICE"):
        swapper.read(a)
    values = torch.arange(1000, dtype=torch.float32)
    swapper.stage(a, values)
    swapper.stage(b)
    with pytest.raises(RuntimeError, match="all 2 swap buffers are in use .*buffer_count"):
        swapper.stage(c)  # the pool is fixed: no allocation beyond it
    with pytest.raises(SwapStateError, match="released unwritten data"):
        swapper.release(a)
    swapper.write(a)
    assert a.state is SwapState.INFLIGHT
    with pytest.raises(SwapStateError, match="data\\(\\) needs IN_CPU"):
        a.data()
    swapper.wait_writes()
    assert a.state is SwapState.ON_NVME and a.buffer is None and len(a.checksums) == 1
    with pytest.raises(SwapStateError, match="from ON_NVME"):
        swapper.write(a)
    swapper.read(a)
    swapper.wait_reads()
    assert torch.equal(a.data(), values)
    swapper.release(a)
    assert swapper.pool.free_count == 1  # b still holds one
    swapper.close()
    folder.close()
    assert not (tmp_path / "zlightning_swap").exists()


# ==================================================================== path checks
def test_unwritable_path_is_refused_before_training(tmp_path: Path, world1: None) -> None:
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    for bad in (a_file / "swap", Path("/proc/zlightning_swap_test")):
        with pytest.raises(SwapPathError, match="is not a writable directory.*NVMeOffload\\(path=...\\)"):
            _engine(bad)
    assert _files(tmp_path) == [str(a_file)]


def test_free_space_check_names_bytes_needed_and_available(tmp_path: Path) -> None:
    import shutil

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(SwapSpaceError, match=f"needs {free + 2**40:,} bytes .* only [0-9,]+ bytes .* are free") as info:
        check_swap_path(NVMeOffload(path=tmp_path), free + 2**40)
    assert info.value.errno == errno.ENOSPC
    root, _ = check_swap_path(NVMeOffload(path=tmp_path), 4096)
    assert root == tmp_path and _files(tmp_path) == []


def test_o_direct_fallback_warns_and_on_refuses(tmp_path: Path, monkeypatch: Any) -> None:
    shm = Path("/dev/shm")
    root = (shm if shm.is_dir() else tmp_path) / f"zl-odirect-{os.getpid()}"
    _, direct = check_swap_path(NVMeOffload(path=root, direct_io="auto"), 4096)
    if direct:  # this tmpfs accepts O_DIRECT (Linux >= 6.6): simulate one that refuses it, at open(2)
        real_open = os.open

        def no_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_direct)
    try:
        with pytest.warns(UserWarning, match="does not support O_DIRECT .*buffered I/O"):
            _, direct = check_swap_path(NVMeOffload(path=root), 4096)
        assert direct is False
        with pytest.raises(SwapPathError, match="does not support O_DIRECT .*direct_io='on'"):
            check_swap_path(NVMeOffload(path=root, direct_io="on"), 4096)
    finally:
        monkeypatch.undo()
        os.rmdir(root)


def test_parameter_reads_wait_for_a_slow_disk_when_every_buffer_is_a_write(tmp_path: Path, world1: None) -> None:
    """With every pool buffer held by a write still in flight (a slow disk: writes report done only when waited for),
    reading a shard on demand waits for a write instead of failing "all swap buffers are in use" (found on a CI
    machine whose disk was slower than this one's)."""
    data = batches(3, 4)
    results = []
    for slow in (False, True):
        torch.manual_seed(0)
        model, zero = _engine(tmp_path / str(slow), params=True)
        if slow:
            writer = zero.state.offload.params.swapper.writer
            writer.done = lambda ticket: False  # type: ignore[method-assign]
        for batch in data:
            _step(model, zero, batch)
        results.append(zero.module_state_dict())
        zero.close()
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


def test_one_rank_gather_prefetch_never_waits_for_a_parameter_read(tmp_path: Path, world1: None) -> None:
    """On one rank a gather prefetch stops at a unit whose shard read has not landed ([Note: a gather prefetch never
    waits for the disk]): with a disk whose reads report landed only when waited for, no prefetch waits for a read
    (each unit's own hook does), and the trained weights equal a normal run's."""
    from zlightning.zero import _state

    data = batches(3, 4)
    results, waits_in_prefetch = [], []
    for slow in (False, True):
        torch.manual_seed(0)
        model, zero = _engine(tmp_path / str(slow), params=True)
        swapper = zero.state.offload.params.swapper
        if slow:
            swapper.reader.done = lambda ticket: False  # type: ignore[method-assign]
        count = [0]
        inside = [False]
        wait_read, prefetch = swapper.wait_read, _state.ZeroState._prefetch

        def counted_wait(t, wait_read=wait_read, count=count, inside=inside):  # type: ignore[no-untyped-def]
            count[0] += inside[0]
            return wait_read(t)

        def marked_prefetch(self, upcoming, budget, prefetch=prefetch, inside=inside):  # type: ignore[no-untyped-def]
            inside[0] = True
            try:
                return prefetch(self, upcoming, budget)
            finally:
                inside[0] = False

        swapper.wait_read = counted_wait  # type: ignore[method-assign]
        zero.state._prefetch = marked_prefetch.__get__(zero.state)  # type: ignore[method-assign]
        for batch in data:
            _step(model, zero, batch)
        results.append(zero.module_state_dict())
        waits_in_prefetch.append(count[0])
        zero.close()
    assert waits_in_prefetch[1] == 0, waits_in_prefetch
    for name, value in results[0].items():
        assert torch.equal(results[1][name], value), name


# ==================================================================== disk full, corruption
@pytest.mark.parametrize("engine", ["portable", "kernels"])
def test_disk_full_during_swap_is_a_clear_error(tmp_path: Path, world1: None, engine: str) -> None:
    import resource

    model, zero = _engine(tmp_path, io_engine=engine)
    data = batches(2, 4)
    _step(model, zero, data[0])
    # The file system "fills up": RLIMIT_FSIZE makes the kernel refuse writes past 4 KiB (EFBIG) in this process,
    # for the portable engine's pwrite and the native io_uring engine alike.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with pytest.raises(SwapSpaceError, match="ran out of space while writing swap files") as info:
            _step(model, zero, data[1])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old)
    assert info.value.errno == errno.ENOSPC
    zero.close()
    assert _files(tmp_path) == []


def _flip(path: str, at: int = 8) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove"])
def test_corrupted_optimizer_swap_file_is_detected(tmp_path: Path, world1: None, damage: str) -> None:
    model, zero = _engine(tmp_path)
    data = batches(2, 4)
    _step(model, zero, data[0])
    victim = sorted(f for f in _files(tmp_path) if f.endswith("_exp_avg_sq.swp"))[0]
    if damage == "flip":
        _flip(victim)
    elif damage == "truncate":
        os.truncate(victim, 100)
    else:
        os.remove(victim)
    pattern = {"flip": "is corrupted: block 0 .*checksum", "truncate": "truncated", "remove": "missing|truncated"}[
        damage
    ]
    with pytest.raises(SwapCorruptionError, match=pattern):
        _step(model, zero, data[1])
    zero.close()
    assert _files(tmp_path) == []


def test_corrupted_parameter_swap_file_is_detected_before_use(tmp_path: Path, world1: None) -> None:
    model, zero = _engine(tmp_path, params=True)
    data = batches(2, 4)
    _step(model, zero, data[0])
    victim = sorted(f for f in _files(tmp_path) if "param_group" in f)[-1]
    _flip(victim, at=64)
    with pytest.raises(SwapCorruptionError, match="param_group.* is corrupted"):
        zero.backward(gpt_loss(model, data[1]))  # the forward reads the shard before its gather
    zero.close()
    assert _files(tmp_path) == []


# ==================================================================== stale folders, kill -9, SIGTERM
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _fake_stale(root: Path, name: str, pid: int) -> Path:
    import json
    import socket

    folder = root / "zlightning_swap" / name
    folder.mkdir(parents=True)
    (folder / "owner.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    (folder / "optim_group0_exp_avg.swp").write_bytes(b"\0" * 4096)
    return folder


def test_stale_folders_are_removed_or_reported(tmp_path: Path, world1: None) -> None:
    stale = _fake_stale(tmp_path, "run-old-rank0", _dead_pid())
    live = _fake_stale(tmp_path, "run-live-rank0", os.getpid())  # another job on the same path: untouched
    with pytest.raises(SwapPathError, match="stale swap folders of a crashed run .*run-old-rank0"):
        _engine(tmp_path, stale_files="error")
    assert stale.exists()
    with pytest.warns(UserWarning, match="removing stale swap folders .*run-old-rank0"):
        _, zero = _engine(tmp_path)
    assert not stale.exists() and live.exists()
    zero.close()
    assert [Path(f).parent.name for f in _files(tmp_path)] == ["run-live-rank0", "run-live-rank0"]


def _child(mode: str, root: str) -> None:
    """A training process for the kill/restart and SIGTERM tests (run with ``python -c``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["ZL_PORT"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    swap, ckpt = Path(root) / "swap", Path(root) / "ckpt"
    data = batches(4, 4)
    model, zero = _engine(swap, params=True)
    if mode == "crash":
        for b in data[:2]:
            _step(model, zero, b)
        save_sharded(zero.state, [zero.optimizer], ckpt)
        from zlightning.zero._swap import Swapper as S

        original, calls = S.write, [0]

        def write_then_die(self: S, t: Any) -> None:
            original(self, t)
            calls[0] += 1
            if calls[0] == 5:  # mid-step: some sub-groups written, others not
                os.kill(os.getpid(), signal.SIGKILL)

        S.write = write_then_die  # type: ignore[method-assign]
        _step(model, zero, data[2])
    elif mode == "restart":
        load_sharded(zero.state, [zero.optimizer], ckpt)
        for b in data[2:]:
            _step(model, zero, b)
        torch.save(zero.module_state_dict(), Path(root) / "restarted.pt")
        zero.unshard_module()
    elif mode == "sigterm":
        _step(model, zero, data[0])
        (Path(root) / "ready").write_text("1")
        while True:
            _step(model, zero, data[1])


def _spawn(mode: str, root: Path) -> subprocess.Popen[bytes]:
    from zlightning.testing import find_free_port

    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); from tests.test_zero3_offload_faults import _child; _child({mode!r}, {str(root)!r})"
    env = {**os.environ, "ZL_PORT": str(find_free_port()), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def test_killed_mid_step_then_restarted_resumes_exactly(tmp_path: Path, world1: None) -> None:
    crash_root, term_root = tmp_path / "crash", tmp_path / "term"
    crash_root.mkdir()  # the swap path's parent must exist (a missing one is refused as a mistyped or unmounted path)
    term_root.mkdir()
    crash, term = _spawn("crash", crash_root), _spawn("sigterm", term_root)  # run side by side
    try:
        _kill_and_restart(tmp_path, crash_root, crash)
        _sigterm(term_root, term)
    finally:
        for proc in (crash, term):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def _kill_and_restart(tmp_path: Path, crash_root: Path, crash: subprocess.Popen[bytes]) -> None:
    out, _ = crash.communicate(timeout=240)
    assert crash.returncode == -signal.SIGKILL, out.decode()[-3000:]
    left = _files(crash_root / "swap")
    assert any(f.endswith(".swp") for f in left)  # what a SIGKILL leaves behind...
    restart = _spawn("restart", crash_root)
    out, _ = restart.communicate(timeout=240)
    assert restart.returncode == 0, out.decode()[-3000:]
    assert "removing stale swap folders" in out.decode()  # ...is found and cleaned by the next run
    assert _files(crash_root / "swap") == []
    model, zero = _engine(tmp_path / "straight", params=True)  # the uninterrupted run, in this process
    for b in batches(4, 4):
        _step(model, zero, b)
    restarted = torch.load(crash_root / "restarted.pt")
    for name, value in zero.module_state_dict().items():  # (a lost Adam state would be off by ~lr = 1e-3)
        torch.testing.assert_close(restarted[name], value, rtol=1e-5, atol=1e-6, msg=name)
    zero.close()


def _sigterm(term_root: Path, term: subprocess.Popen[bytes]) -> None:
    """The swap folder is removed and the process still dies of SIGTERM."""
    deadline = time.monotonic() + 180
    while not (term_root / "ready").exists() and term.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (term_root / "ready").exists(), term.communicate()[0].decode()[-3000:]
    assert _files(term_root / "swap")
    term.send_signal(signal.SIGTERM)
    out, _ = term.communicate(timeout=60)
    assert term.returncode == -signal.SIGTERM, out.decode()[-3000:]
    assert _files(term_root / "swap") == []
