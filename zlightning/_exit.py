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
hands the GIL over in short sleeps until every gloo worker thread has been quiet through two in a row: not running
and without a single context switch while the GIL was free (a worker waiting for the GIL is woken by a release, so
it cannot look quiet; two, in case another thread took the GIL first). Idle workers wait on their queue's condition variable and pass at once: the handler
costs a few milliseconds. It gives up after `SETTLE_TIMEOUT_S`. It cannot help a collective that is still waiting
for its peers at exit (a rank leaving in the middle of one: that is a failed run, reported as such).
Linux only (it reads ``/proc/self/task``); elsewhere it does nothing.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

__all__ = ["SETTLE_TIMEOUT_S", "register_gloo_settle", "settle_gloo_workers"]

SETTLE_TIMEOUT_S = 5.0
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


def _snapshot(tids: list[str]) -> dict[str, tuple[str, int]]:
    """Each worker's scheduler state and its context switches so far (voluntary and not)."""
    out: dict[str, tuple[str, int]] = {}
    for tid in tids:
        stat, status = _read(f"{_TASKS}/{tid}/stat"), _read(f"{_TASKS}/{tid}/status")
        if stat is None or status is None:
            continue  # gone: nothing left to wait for
        state = stat.rsplit(")", 1)[-1].split()[0]
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches:" in line)
        out[tid] = (state, switches)
    return out


def settle_gloo_workers(timeout_s: float = SETTLE_TIMEOUT_S, pause_s: float = 0.002) -> bool:
    """Lets gloo's worker threads finish what they still do with Python; True when they did within ``timeout_s``.

    See [Note: gloo's workers finish with Python before the interpreter does]."""
    tids = _workers()
    if not tids:
        return True
    deadline = time.monotonic() + timeout_s
    before, quiet = _snapshot(tids), 0
    while True:
        time.sleep(pause_s)  # the GIL is free meanwhile: a worker that waits for it takes it now
        now = _snapshot(tids)
        still = all(state == "S" and before.get(tid, ("S", n))[1] == n for tid, (state, n) in now.items())
        quiet = quiet + 1 if still else 0
        if quiet >= 2:
            return True
        if time.monotonic() >= deadline:
            return False
        before = now
