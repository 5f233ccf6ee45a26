"""Threads that zlightning starts, or makes gloo start, get small stacks; the process's defaults come back after.

See [Note: thread stacks count against a data limit] in ``zlightning/_threads.py``. The whole effect, a model of
10.5 M parameters fitting under a cap of 12 bytes per parameter, is in ``tests/test_zero3_memory_fit.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from zlightning._threads import thread_stack_bytes

_PROBE = textwrap.dedent(
    """
    import ctypes, json, os, threading
    import torch.distributed as dist
    from zlightning._threads import small_thread_stacks

    libc = ctypes.CDLL(None)

    def default_stack():
        attr = ctypes.create_string_buffer(256)
        libc.pthread_getattr_default_np(attr)
        size = ctypes.c_size_t()
        libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
        libc.pthread_attr_destroy(attr)
        return size.value

    def own_stack(out):
        attr = ctypes.create_string_buffer(256)
        libc.pthread_getattr_np(ctypes.c_ulong(threading.get_ident()), attr)
        size = ctypes.c_size_t()
        libc.pthread_attr_getstacksize(attr, ctypes.byref(size))
        libc.pthread_attr_destroy(attr)
        out.append(size.value)

    def anonymous_writable():
        sizes = []
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if len(parts) < 6 and parts[1].startswith("rw"):
                    sizes.append(hi - lo)
        return sizes

    before, tasks = default_stack(), set(os.listdir("/proc/self/task"))
    maps = anonymous_writable()
    inner, python = [], []
    with small_thread_stacks(os.environ.get("PROBE_BACKEND", "gloo")):
        with small_thread_stacks():  # nested: only the outermost restores
            pass
        inner.append(default_stack())
        t = threading.Thread(target=own_stack, args=(python,))
        t.start()
        t.join()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PROBE_PORT"])
        dist.init_process_group("gloo", rank=0, world_size=1)
    new_threads = sorted(
        open(f"/proc/self/task/{t}/comm").read().strip() for t in set(os.listdir("/proc/self/task")) - tasks
    )
    grown = [s for s in anonymous_writable() if s >= 1 << 20]
    for s in maps:
        if s in grown:
            grown.remove(s)
    after_python = []
    t = threading.Thread(target=own_stack, args=(after_python,))
    t.start()
    t.join()
    print(json.dumps({"before": before, "inner": inner[0], "after": default_stack(), "python": python[0],
                      "after_python": after_python[0], "new_threads": new_threads, "new_maps": grown}))
    dist.destroy_process_group()
    """
)


def _probe(env: dict[str, str], stack_limit_kib: int | None = None) -> dict:
    from zlightning.testing import find_free_port

    full = {**os.environ, **env, "PROBE_PORT": str(find_free_port())}
    cmd = [sys.executable, "-c", _PROBE]
    if stack_limit_kib is not None:  # glibc takes its default thread stack from RLIMIT_STACK at start-up
        cmd = ["bash", "-c", f'ulimit -s {stack_limit_kib} && exec "$@"', "probe", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=full)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's default thread attributes")
def test_gloo_and_python_threads_started_inside_get_small_stacks_and_defaults_come_back() -> None:
    out = _probe({"ZLIGHTNING_THREAD_STACK_MIB": ""})
    small = 2 << 20
    assert out["before"] > small, out  # glibc's default from RLIMIT_STACK (8 MiB here)
    assert out["inner"] == small and out["python"] <= small, out
    assert out["after"] == out["before"] and out["after_python"] == out["before"], out
    gloo = [n for n in out["new_threads"] if n.startswith(("pt_gloo", "gloo_"))]
    assert len(gloo) >= 2, out  # the group's workers and transport loop did start inside
    assert out["new_maps"] and max(out["new_maps"]) <= small, out  # no thread mapped glibc's 8 MiB default


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's default thread attributes")
def test_zero_keeps_the_system_default() -> None:
    out = _probe({"ZLIGHTNING_THREAD_STACK_MIB": "0"})
    assert out["inner"] == out["before"] == out["after"], out
    assert max(out["new_maps"]) == out["before"], out  # the gloo threads got the system's stacks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's default thread attributes")
def test_other_backends_and_smaller_defaults_are_left_alone() -> None:
    nccl = _probe({"ZLIGHTNING_THREAD_STACK_MIB": "", "PROBE_BACKEND": "nccl"})  # NCCL sizes its own threads
    assert nccl["inner"] == nccl["before"] == nccl["after"] and nccl["python"] == nccl["before"], nccl
    small = _probe({"ZLIGHTNING_THREAD_STACK_MIB": ""}, stack_limit_kib=1024)
    assert small["before"] == small["inner"] == small["after"] == 1 << 20, small
    assert small["python"] == 1 << 20, small  # Python's threads are not raised to 2 MiB either


def test_a_bad_size_says_what_to_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZLIGHTNING_THREAD_STACK_MIB", "two")
    with pytest.raises(ValueError, match="ZLIGHTNING_THREAD_STACK_MIB='two' is not a number.*MiB, or 0"):
        thread_stack_bytes()
    monkeypatch.setenv("ZLIGHTNING_THREAD_STACK_MIB", "inf")
    with pytest.raises(ValueError, match="is not a number"):
        thread_stack_bytes()
    monkeypatch.setenv("ZLIGHTNING_THREAD_STACK_MIB", "-1")
    with pytest.raises(ValueError, match="is negative"):
        thread_stack_bytes()
    monkeypatch.setenv("ZLIGHTNING_THREAD_STACK_MIB", "0.5")
    assert thread_stack_bytes() == 512 << 10
