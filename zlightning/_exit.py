"""Leaving a process whose gloo process groups are still alive, without an abort at exit.

[Note: gloo's workers finish with Python before the interpreter does]
gloo runs each collective on a worker thread of its process group (``pt_gloo_runloop``). After the collective has
completed, and after the rank that waited for it has moved on, that thread still releases its reference to the
collective's work, and with it to the tensors the work holds. Those tensors were made in Python, so letting go of
them takes the GIL; so do completion callbacks chained to the work's future. When the rank's script ends at that
moment (the last collective of ``fit``, of ``summon_full_params`` or of a checkpoint, then ``exit``), the worker asks
for the GIL while the interpreter finalises; Python ends such a thread with ``pthread_exit``, whose unwinding
crosses the worker's C++ frames, and the process dies with SIGABRT ("terminate called without an active
exception") after its work was done, failing the launch (exit -6 instead of 0). A core dump of a ``popen`` rank
showed exactly that: the main thread in ``Py_FinalizeEx``, a ``pt_gloo_runloop`` thread in
``~AsyncBroadcastWork`` -> ``THPVariable_clear`` -> ``take_gil`` -> ``pthread_exit``. Here it took 1 exit in 40
with the CPUs loaded; a completion callback still running at exit aborts every time.

``destroy_process_group`` does not prevent it: for gloo it only drops Python's references, and joining the workers
from the thread that holds the GIL would deadlock with a worker waiting for that GIL. So this module registers an
``atexit`` handler (``atexit`` runs before the finalisation starts, while threads can still take the GIL) that
hands the GIL over in short sleeps until every gloo worker is idle: asleep in its queue's wait, which is a
condition-variable wait without a timeout (``/proc/self/task/<tid>/syscall``: ``futex`` with ``FUTEX_WAIT_BITSET``
and no timeout), with no context switch while the GIL was free, three checks in a row. Busy is anything else: a
worker running, waiting for the GIL (a timed condition-variable wait, and woken by every release), or blocked on
something else it will want the GIL after (a callback's op waiting for the intra-op thread pool is a plain
``FUTEX_WAIT``; a first version that counted any sleeping worker as idle let such a callback abort the process
under a loaded CPU, 3 exits in 12). Where the idle wait never shows (another C library), a worker asleep without a
context switch for `LOOSE_QUIET_S` passes too. The handler costs about 7 ms with idle workers and gives up after
`SETTLE_TIMEOUT_S`. It cannot help a collective still waiting for its peers at exit (a rank leaving in the middle of
one: that is a failed run, reported as such). Linux only (it reads ``/proc``); elsewhere it does nothing.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["LOOSE_QUIET_S", "SETTLE_TIMEOUT_S", "register_gloo_settle", "settle_gloo_workers"]

SETTLE_TIMEOUT_S = 5.0
LOOSE_QUIET_S = 0.25
_QUIET_PAUSES = 3
_WORKER_NAME = "pt_gloo_runloop"
_TASKS = "/proc/self/task"
_registered = False
_lock = threading.Lock()


def register_gloo_settle() -> None:
    """Registers `settle_gloo_workers` with ``atexit`` once per process (see [Note: gloo's workers finish with
    Python before the interpreter does]). Handlers registered later run earlier, so the watchdog's own (which
    stops a thread that uses the store) still runs before this one."""
    global _registered
    with _lock:
        if not _registered:
            atexit.register(settle_gloo_workers)
            _registered = True


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread has exited meanwhile
        return None


def _workers() -> list[str]:
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    return [tid for tid in tids if (_read(f"{_TASKS}/{tid}/comm") or "").strip() == _WORKER_NAME]


_FUTEX = "202"  # x86-64; the check below simply never matches on other architectures (LOOSE_QUIET_S then)
_FUTEX_CMD_MASK = 0x7F
_FUTEX_WAIT_BITSET = 9


def _state(tid: str) -> tuple[str, int, bool] | None:
    """A worker's scheduler state, its context switches so far, and whether it sleeps in a condition-variable
    wait without a timeout (its queue's wait when idle); None once it has exited."""
    stat, status, call = (_read(f"{_TASKS}/{tid}/{name}") for name in ("stat", "status", "syscall"))
    if stat is None or status is None:
        return None
    state = stat.rsplit(")", 1)[-1].split()[0]
    switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
    fields = (call or "").split()
    untimed_cond_wait = (
        len(fields) >= 5
        and fields[0] == _FUTEX
        and int(fields[2], 16) & _FUTEX_CMD_MASK == _FUTEX_WAIT_BITSET
        and int(fields[4], 16) == 0
    )
    return state, switches, untimed_cond_wait


def _snapshot(tids: list[str]) -> dict[str, tuple[str, int, bool]]:
    out = {}
    for tid in tids:
        found = _state(tid)
        if found is not None:  # gone: nothing left to wait for
            out[tid] = found
    return out


def settle_gloo_workers(timeout_s: float = SETTLE_TIMEOUT_S, pause_s: float = 0.002) -> bool:
    """Lets gloo's worker threads finish what they still do with Python; True when they did within ``timeout_s``.

    See [Note: gloo's workers finish with Python before the interpreter does]."""
    tids = _workers()
    if not tids:
        return True
    start = time.monotonic()
    before, idle, asleep_since = _snapshot(tids), 0, None
    while True:
        time.sleep(pause_s)  # the GIL is free meanwhile: a worker that waits for it takes it now
        now, at = _snapshot(tids), time.monotonic()
        unchanged = [
            state == "S" and before.get(tid, (state, n, wait))[1] == n for tid, (state, n, wait) in now.items()
        ]
        idle = idle + 1 if all(unchanged) and all(wait for _, _, wait in now.values()) else 0
        if all(unchanged):
            asleep_since = at if asleep_since is None else asleep_since
        else:
            asleep_since = None
        if idle >= _QUIET_PAUSES or (asleep_since is not None and at - asleep_since >= LOOSE_QUIET_S):
            return True
        if at - start >= timeout_s:
            return False
        before = now
