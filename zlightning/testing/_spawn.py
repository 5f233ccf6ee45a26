"""A small multi-process harness for distributed tests on CPU with gloo.

[Note: why our own harness]
``torch.testing._internal`` is private and changes between releases, so tests spawn ranks with this ~150-line module
instead. Each rank is a fresh ``spawn`` process, or a fork of a clean fork server (no inherited state), the
rendezvous uses a free loopback port, and the parent enforces one deadline for the whole group: if any rank fails, or
the deadline passes (a hung collective), every rank is killed and the parent raises with each rank's traceback or a
"timed out" line. A hung group therefore fails loudly instead of blocking CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["DistributedTestError", "find_free_port", "run_distributed", "set_start_method"]

_start_method = "spawn"


def set_start_method(method: str, preload: Sequence[str] = ()) -> None:
    """How `run_distributed` starts ranks from now on: ``"spawn"`` (the default: a fresh interpreter per rank) or
    ``"forkserver"`` (ranks are forked from one server process that imported ``preload`` once).

    [Note: a fork server for test suites]
    A fresh interpreter spends seconds importing torch and Lightning before a rank runs a line of the test; a suite
    of a hundred two-rank tests on two cores loses minutes to that alone. A fork server imports them once and forks
    each rank from itself, so a rank starts in milliseconds, still without inheriting anything of the test process
    (its threads, its initialised process groups, its CUDA context). The rank gets the test process's current
    environment variables (the server's own are those of when it started), its ``sys.path`` and working directory,
    as with ``spawn``. Modules in ``preload`` must not start threads or touch devices when imported.

    Raises:
        ValueError: an unknown method.
    """
    global _start_method
    _check_start_method("set_start_method: method", method)
    if method == "forkserver":
        mp.get_context("forkserver").set_forkserver_preload(list(preload))
    _start_method = method


def _check_start_method(what: str, method: str) -> None:
    if method not in ("spawn", "forkserver"):
        raise ValueError(f"{what} must be 'spawn' or 'forkserver', got {method!r}")


class DistributedTestError(RuntimeError):
    """Raised in the parent when a rank fails, exits without a result, or the group exceeds its timeout."""


def find_free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    init_process_group: bool,
    threads: int,
    args: tuple[Any, ...],
    results: Any,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's environment now (a fork server's own is from when it started)
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        if init_process_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            out = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():  # also groups the function made (a Trainer): see strategies/_launch.py
                dist.destroy_process_group()
        # Plain pickle (bytes): torch's queue reducers share tensors through file descriptors that vanish with
        # the rank process.
        results.put((rank, True, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))


def _record(outcomes: dict[int, tuple[bool, Any]], rank: int, ok: bool, payload: Any) -> None:
    """Stores one rank's queued outcome: its unpickled result, or its traceback text."""
    try:
        outcomes[rank] = (ok, pickle.loads(payload) if ok else payload)
    except Exception:  # noqa: BLE001 - a result that cannot be unpickled must not hide a failure
        outcomes[rank] = (False, f"<result of rank {rank} could not be unpickled>")


_FAILURE_GRACE_S = 15.0
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket Timeout")


def _collect_stragglers(
    results: Any, procs: list[Any], outcomes: dict[int, tuple[bool, Any]], world_size: int, grace: float
) -> None:
    """After one rank failed, waits up to ``grace`` seconds for the other ranks' outcomes.

    [Note: which rank's error to report]
    When one rank raises, Lightning (or ``destroy_process_group``) tears its process group down, and its peers fail at
    once with gloo's "Connection closed by peer". That secondary error often reaches the parent first, while the rank
    that really failed is still formatting its traceback; stopping at the first message would kill it and lose the
    cause. So the parent keeps reading for a short grace period and reports a primary error first.
    """
    end = time.monotonic() + grace
    while len(outcomes) < world_size and time.monotonic() < end:
        try:
            rank, ok, payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(not p.is_alive() for r, p in enumerate(procs) if r not in outcomes):
                time.sleep(0.2)  # a rank that just exited may still be flushing its result
                if results.empty():
                    return
            continue
        _record(outcomes, rank, ok, payload)


def _primary_failure(outcomes: dict[int, tuple[bool, Any]]) -> str:
    """The first rank's error that is not a peer's disconnect, else the first error (see [Note: which rank's error
    to report]). ``outcomes`` holds at least one failure."""
    failed = sorted((r, v) for r, (ok, v) in outcomes.items() if not ok)
    primary = [(r, v) for r, v in failed if not any(m in v for m in _SECONDARY)]
    r, v = (primary or failed)[0]
    return f"rank {r} raised:\n{v}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout: float = 180.0,
    init_process_group: bool = True,
    threads: int = 1,
    start_method: str | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes and returns their results by rank.

    The processes are spawned, or forked from a fork server after `set_start_method` (see [Note: a fork server for
    test suites]).

    Args:
        fn: a picklable (module-level) function. Its return value must be picklable.
        world_size: number of ranks to spawn.
        *args: extra picklable arguments passed to every rank.
        timeout: seconds for the whole group; on expiry every rank is killed.
        init_process_group: if True, each rank joins a gloo process group before ``fn`` runs and leaves it after.
            Use False for code that initialises distributed itself (a Lightning ``Trainer`` reads the
            ``MASTER_ADDR``/``MASTER_PORT``/``WORLD_SIZE``/``LOCAL_RANK`` variables set here and does not relaunch).
        threads: ``torch.set_num_threads`` in each rank.
        start_method: ``"spawn"`` or ``"forkserver"`` for this call; None: the one `set_start_method` chose. Tests
            that measure a rank's resident memory use ``"spawn"``: a forked rank faults the library pages its server
            had already touched in again after its baseline, which reads as growth.

    Returns:
        A list with each rank's return value, indexed by rank.

    Raises:
        DistributedTestError: a rank raised (its traceback is included), died, or the group timed out.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    method = start_method or _start_method
    _check_start_method("run_distributed: start_method", method)
    ctx: Any = mp.get_context(method)  # a SpawnContext or ForkServerContext (both have Process, Queue)
    results = ctx.Queue()
    port = find_free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, init_process_group, threads, args, results, environ),
            daemon=False,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    failure: str | None = None
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = f"timed out after {timeout:.0f}s; ranks without a result: " + str(
                    sorted(set(range(world_size)) - set(outcomes))
                )
                break
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcomes]
                if dead:
                    # Give the queue a moment: a rank that just exited may still be flushing its result.
                    time.sleep(0.5)
                    while not results.empty():
                        _record(outcomes, *results.get())
                    dead = [r for r in dead if r not in outcomes]
                    if dead:
                        codes = {r: procs[r].exitcode for r in dead}
                        failure = f"ranks {dead} exited without a result (exit codes {codes})"
                        break
                continue
            _record(outcomes, rank, ok, payload)
            if not outcomes[rank][0]:
                _collect_stragglers(results, procs, outcomes, world_size, _FAILURE_GRACE_S)
                failure = _primary_failure(outcomes)
                break
    finally:
        exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
        if failure is not None:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if failure is not None:
        others = "".join(
            f"\n--- rank {r} also raised:\n{v}"
            for r, (ok, v) in sorted(outcomes.items())
            if not ok and v not in failure
        )
        silent = sorted(set(range(world_size)) - set(outcomes))
        if silent and not failure.startswith(("timed out", "ranks")):
            # Exit codes as read before the kill: a rank that had already died shows its own (-11: SIGSEGV).
            codes = {r: exit_codes.get(r) for r in silent}
            others += (
                f"\n--- ranks {silent} gave no result within {_FAILURE_GRACE_S:.0f}s of the failure "
                f"(exit codes before the kill: {codes}; None = still running, then killed)"
            )
        raise DistributedTestError(f"distributed test failed: {failure}{others}")
    return [outcomes[r][1] for r in range(world_size)]
