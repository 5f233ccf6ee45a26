"""Failures and hangs that explain themselves: a dead peer, diverging ZeRO-3 control flow, a pipeline message that
never comes (torch only; used by ``zlightning.zero`` and ``zlightning.pipe``).

[Note: what a rank tells about itself]
When the process group is up, every rank of a multi-process run starts one `Monitor` (a daemon thread with its own
connection to the run's c10d store). It registers the rank's host, process id and start time in the store, and
keeps the last `_HISTORY` collectives the ZeRO-3 engine issued on this rank (`record_collective`: operation, unit,
forward/backward, pass number, Lightning step). Blocking waits of the engine and of the pipeline's transfers go
through `wait_for`, which waits in slices of `_SLICE_S` seconds so that the thread's verdict can end a hang.

[Note: a dead peer]
gloo reports a peer that died as "Connection closed by peer [address]:port", with no word of which rank. When an
engine collective fails, `explain_failure` finds the dead ranks: a process on this host that is gone or a zombie
(``/proc/<pid>/stat`` holds a zombie's exit signal or status), an exit that the launching process wrote to the store
(`note_exit`: Lightning's ``popen`` parent watches its ranks), a rank whose answer does not come, or the store itself
not answering (its host, rank 0 or the ``torchrun`` agent, died). The error it raises, `PeerFailureError`, names
the dead rank, its host and pid, how it ended when that is known, the collective in flight on this rank (unit,
forward/backward, pass, step) and gloo's own text.

[Note: diverging collectives]
ZeRO-3 needs every rank to run the same modules in the same order: a unit forwarded twice on one rank, a module
skipped, or a branch taken by one rank only pairs one rank's all-gather with another's different collective. gloo
then hangs until the process group's timeout (30 minutes by default), fails with a size mismatch, or silently
exchanges the wrong tensors when the sizes agree. When a rank has been blocked in an engine collective for
`watchdog_timeout` seconds (default `WATCHDOG_TIMEOUT_S`, 300 s; ``ZLIGHTNING_WATCHDOG_TIMEOUT_S`` sets it), or a
collective failed, its monitor asks every rank for its recent collectives through the store; each rank's monitor
publishes them and reads everybody's, and all compute the same verdict (`first_divergence`): the first sequence
number where the ranks issued different collectives, and what each did there. Each rank then raises
`CollectiveMismatchError` with that text from its blocked wait; a rank that is not blocked in an engine collective
prints it. When the sequences agree, the verdict says so and shows where each rank's main thread is.
"""

from __future__ import annotations

import atexit
import collections
import datetime
import json
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from zlightning._exit import register_gloo_settle
from zlightning._threads import small_thread_stacks

__all__ = [
    "WATCHDOG_TIMEOUT_ENV",
    "WATCHDOG_TIMEOUT_S",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "Record",
    "TransferTimeoutError",
    "explain_failure",
    "first_divergence",
    "note_exit",
    "note_step",
    "record_collective",
    "wait_for",
    "watch_engine",
    "watchdog_timeout",
]

WATCHDOG_TIMEOUT_S = 300.0
"""Seconds a rank may wait in one engine collective or pipeline transfer before the ranks compare notes."""
WATCHDOG_TIMEOUT_ENV = "ZLIGHTNING_WATCHDOG_TIMEOUT_S"
_NS = "zlightning/watch"
_HISTORY = 512  # collectives remembered per rank
_SLICE_S = 1.0  # a blocking wait checks for a verdict this often
_POLL_S = 0.5  # the monitor thread's period
_ANSWER_S = 8.0  # how long a comparison waits for the other ranks' answers


class CollectiveMismatchError(RuntimeError):
    """The ranks issued different collectives (see [Note: diverging collectives]); raised on every blocked rank."""


class PeerFailureError(RuntimeError):
    """A peer rank died during a collective (see [Note: a dead peer])."""

    killed: bool = False
    """The peer was killed by a signal (it could not report anything itself)."""


class CollectiveTimeoutError(RuntimeError):
    """A rank waited `watchdog_timeout` seconds in one engine collective while the ranks' collectives agree: one
    rank is stuck elsewhere (the error says where each rank is)."""


class TransferTimeoutError(RuntimeError):
    """A pipeline stage waited `watchdog_timeout` seconds for a message from a peer stage."""


def seconds_from_env(name: str, default: float) -> float:
    """``default``, or the positive number of seconds in the environment variable ``name``.

    Raises:
        ValueError: the variable is set but not a positive number.
    """
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a positive number of seconds, e.g. {default:g}")
    return value


def watchdog_timeout() -> float:
    """`WATCHDOG_TIMEOUT_S`, or the value of ``ZLIGHTNING_WATCHDOG_TIMEOUT_S`` (see `seconds_from_env`)."""
    return seconds_from_env(WATCHDOG_TIMEOUT_ENV, WATCHDOG_TIMEOUT_S)


@dataclass(frozen=True)
class Record:
    """One collective issued by the ZeRO-3 engine on one rank."""

    seq: int
    op: str
    unit: str
    phase: str  # "forward" / "backward" / "idle" (outside a pass, e.g. gathering for a checkpoint)
    pass_id: int
    step: int | None

    def key(self) -> tuple[str, str, str, int]:
        return (self.op, self.unit, self.phase, self.pass_id)

    def describe(self) -> str:
        step = f", step {self.step}" if self.step is not None else ""
        return f"{self.op} of unit '{self.unit}' ({self.phase}, pass {self.pass_id}{step})"


# ==================================================================== the per-process monitor
class _Stopping(Exception):
    """Raised inside the monitor thread when the process is ending in the middle of a comparison."""


class Monitor:
    """See [Note: what a rank tells about itself]."""

    def __init__(self, store: Any) -> None:
        self.source = store
        self.store = store.clone() if hasattr(store, "clone") else store  # the thread's own connection
        if self.store is not store and hasattr(self.store, "set_timeout"):  # no call of the thread blocks for long
            self.store.set_timeout(datetime.timedelta(seconds=_ANSWER_S))
        self.pg = dist.group.WORLD
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.timeout = watchdog_timeout()
        self.lock = threading.Lock()
        self.records: collections.deque[Record] = collections.deque(maxlen=_HISTORY)
        self.seq = 0
        self.step: int | None = None
        self.units: dict[int, tuple[str, Any]] = {}  # id(group) -> (unit name, weakref to its ZeroState)
        self.blocked: tuple[float, str] | None = None  # (since, what) while the main thread waits
        self.verdict: str | None = None
        self.verdict_at = 0.0  # time.monotonic() when the verdict was reached
        self.missing: list[int] = []  # ranks that did not answer the last comparison
        self.handled = 0  # comparison rounds answered
        self._collected = 0  # the round whose reports the last comparison read
        self.comparing = False  # the thread is between publishing its report and its verdict
        self._asked_at: float | None = None
        self.main = threading.main_thread().ident
        self.store.set(f"{_NS}/proc/{self.rank}", json.dumps(_me()))
        self._stopping = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="zlightning-watchdog", daemon=True)
        with small_thread_stacks():  # see [Note: thread stacks count against a data limit]
            self.thread.start()

    # ---------------------------------------------------------------- records (main thread)
    def add(self, op: str, unit: str, phase: str, pass_id: int) -> None:
        with self.lock:
            self.seq += 1
            self.records.append(Record(self.seq, op, unit, phase, pass_id, self.step))

    def last(self) -> Record | None:
        with self.lock:
            return self.records[-1] if self.records else None

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        while not self._stopping.wait(_POLL_S):
            try:
                self._tick()
            except _Stopping:
                return
            except Exception:  # noqa: BLE001 - the store went away (the run is ending): nothing left to watch
                return

    def stop(self) -> None:
        """Ends the thread and waits for it; see [Note: the monitor ends before the interpreter does]."""
        self._stopping.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=_ANSWER_S + 2 * _POLL_S)  # one store call: a comparison stops at the next poll

    def _tick(self) -> None:
        current = int(self.store.add(f"{_NS}/round", 0))
        blocked = self.blocked
        if (
            blocked is not None
            and self.verdict is None
            and time.monotonic() - blocked[0] > self.timeout
            and self._asked_at != blocked[0]
            and current <= self.handled
        ):
            self._asked_at = blocked[0]  # ask once per blocked wait, unless another rank asked already
            current = int(self.store.add(f"{_NS}/round", 1))
        if current > self.handled:
            self.comparing = True
            try:
                verdict = self._compare(current, self.store)
            finally:
                self.comparing = False
            self.verdict, self.verdict_at, self.handled = verdict, time.monotonic(), self._collected

    def _compare(self, round_: int, store: Any) -> str:
        """Publishes this rank's report for every round up to ``round_`` (ranks may have asked at once, each
        opening a round), collects the others' for ``round_`` and returns the verdict."""
        report = json.dumps(self._report())
        for n in range(self.handled + 1, round_ + 1):
            store.set(f"{_NS}/report/{n}/{self.rank}", report)
        keys = [f"{_NS}/report/{round_}/{r}" for r in range(self.world)]
        deadline = time.monotonic() + _ANSWER_S
        while time.monotonic() < deadline:
            if all(store.check([k]) for k in keys):
                break
            if self._stopping.wait(0.1):  # see [Note: the monitor ends before the interpreter does]
                raise _Stopping
            newer = int(store.add(f"{_NS}/round", 0))
            if newer > round_:  # another rank opened a newer round: answer and collect that one instead
                return self._compare_newer(round_, newer, store, report)
        reports: dict[int, dict[str, Any]] = {}
        for r, k in enumerate(keys):
            if store.check([k]):
                reports[r] = json.loads(store.get(k))
        self.missing = [r for r in range(self.world) if r not in reports]
        self._collected = round_
        verdict = first_divergence(reports, self.world)
        store.add(f"{_NS}/known/{round_}", 1)  # see Monitor.everyone_knows
        if self.rank == min(reports, default=self.rank):
            print(f"zlightning watchdog: {verdict}", file=sys.stderr, flush=True)
        return verdict

    def _compare_newer(self, round_: int, newer: int, store: Any, report: str) -> str:
        for n in range(round_ + 1, newer + 1):
            store.set(f"{_NS}/report/{n}/{self.rank}", report)
        self.handled = round_
        return self._compare(newer, store)

    def _report(self) -> dict[str, Any]:
        with self.lock:
            records = [asdict(r) for r in list(self.records)[-64:]]
        blocked = self.blocked
        frame = sys._current_frames().get(self.main) if self.main is not None else None
        while frame is not None and frame.f_code.co_filename == __file__:  # the watchdog's own frames
            frame = frame.f_back
        where = traceback.format_stack(frame, limit=1)[-1].strip().splitlines()[0] if frame is not None else "?"
        return {
            "records": records,
            "where": where,
            "blocked_s": time.monotonic() - blocked[0] if blocked else None,
            "blocked_in": blocked[1] if blocked else None,
        }

    def everyone_knows(self, timeout: float = 3.0) -> None:
        """Waits until every rank that answered the last comparison has its verdict: the first rank to raise may
        host the store, and its exit would cut the others off before they read the reports."""
        deadline = time.monotonic() + timeout
        answered = self.world - len(self.missing)
        try:
            while int(self.source.add(f"{_NS}/known/{self._collected}", 0)) < answered:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - the store is gone: nobody else can learn more
            return

    # ---------------------------------------------------------------- after a failed collective (main thread)
    def compare_now(self) -> str:
        """Asks every rank for a comparison and returns the verdict (waits at most `_ANSWER_S` seconds)."""
        store = self.source
        current = int(store.add(f"{_NS}/round", 1))
        deadline = time.monotonic() + _ANSWER_S + 2 * _POLL_S
        while self.handled < current and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.verdict or first_divergence({}, self.world)

    def peers(self) -> dict[int, dict[str, Any]]:
        """What each rank registered (host, pid, start time) and, when known, how it ended."""
        out: dict[int, dict[str, Any]] = {}
        for r in range(self.world):
            info: dict[str, Any] = {}
            if self.source.check([f"{_NS}/proc/{r}"]):
                info = json.loads(self.source.get(f"{_NS}/proc/{r}"))
            if self.source.check([f"{_NS}/exit/{r}"]):
                info["ended"] = self.source.get(f"{_NS}/exit/{r}").decode()
            out[r] = info
        return out


def _me() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _process_end(info: dict[str, Any]) -> str | None:
    """How a process of this host ended ("killed by SIGKILL", "exited with status 1", "exited"), None while it runs
    (or when it is on another host, or the pid now belongs to another process)."""
    if info.get("host") != socket.gethostname() or "pid" not in info:
        return None
    try:
        fields = Path(f"/proc/{info['pid']}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "exited"
    if info.get("start") is not None and fields[19] != info["start"]:
        return "exited"  # the pid was reused
    if fields[0] != "Z":
        return None
    code = int(fields[49]) if len(fields) > 49 else -1  # a zombie's wait status: its parent has not reaped it yet
    if code < 0:
        return "exited"
    if code & 0x7F:
        import signal

        try:
            return f"killed by {signal.Signals(code & 0x7F).name}"
        except ValueError:
            return f"killed by signal {code & 0x7F}"
    return f"exited with status {code >> 8}"


_monitor: Monitor | None = None
_monitor_lock = threading.Lock()


def _stop_monitor() -> None:
    """Stops this process's monitor, if any (registered with ``atexit`` when the first monitor starts).

    [Note: the monitor ends before the interpreter does]
    The monitor is a daemon thread that spends its time in c10d store calls, which release the GIL. A daemon thread
    still running when the interpreter finalises is ended by ``pthread_exit`` as soon as it asks for the GIL back,
    and that unwinds through the C++ frame of the store call, whose GIL guard may not be unwound: the process dies
    with SIGABRT ("terminate called without an active exception") after ``fit`` has finished, or turns a rank's
    explained error (exit 1) into an abort. CI failed two ``popen`` launches on it in one run; here it took 1 launch
    in 12 with the CPUs loaded, and the core dump showed the watchdog thread inside ``Store.add`` while the main
    thread was in ``Py_FinalizeEx``. ``atexit`` handlers run before the finalisation ends daemon threads, so the
    handler stops the loop and joins the thread while everything is alive. A comparison in progress stops at its
    next poll: it used to run its course (8 s waiting for a dead rank's answer, and again when the failing rank's
    own ``compare_now`` opened a newer round), past the join's timeout: the likely cause of a ``popen`` run in CI
    whose rank 0 aborted after rank 1 was SIGKILLed (exit -6 instead of the explained error's 1; not reproduced
    here). The thread's own store connection has a timeout of ``_ANSWER_S``, so no single call outlasts the join
    either, even when the store's host is gone.
    """
    monitor = _monitor
    if monitor is not None:
        monitor.stop()


def _get_monitor() -> Monitor | None:
    """This process's monitor (started on first use in a multi-rank run), or None in a one-rank run."""
    global _monitor
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    store = dist.distributed_c10d._get_default_store()
    if _monitor is None or _monitor.source is not store:
        with _monitor_lock:
            if _monitor is None or _monitor.source is not store:
                if _monitor is None:
                    register_gloo_settle()  # first, so that it runs after _stop_monitor
                    atexit.register(_stop_monitor)
                else:
                    _monitor.stop()  # the run's process group was replaced: watch the new store only
                _monitor = Monitor(store)
    return _monitor


# ==================================================================== hooks called by the engines
def watch_engine(state: Any) -> None:
    """Registers a ZeRO-3 engine (``ZeroState``) so that its collectives are named by unit and pass."""
    monitor = _get_monitor()
    if monitor is None:
        return
    ref = weakref.ref(state)
    named = [(unit.name, group) for unit in state.units for group in unit.groups]
    named += [("(persistent parameters)", group) for group in getattr(state, "persistent_groups", [])]
    for name, group in named:
        monitor.units[id(group)] = (name, ref)


def record_collective(op: str, group: Any) -> None:
    """Called by a ``ZeroParamGroup`` just before it issues a collective (see [Note: diverging collectives])."""
    monitor = _monitor if _monitor is not None and _monitor.pg is dist.group.WORLD else _get_monitor()
    if monitor is None:
        return
    name, ref = monitor.units.get(id(group), ("?", None))
    state = ref() if ref is not None else None
    training = getattr(state, "training_state", None)
    phase = training.name.lower() if training is not None else "?"
    pass_id = getattr(state, "_pass_id", -1)
    monitor.add(op, name, phase, pass_id)


def note_step(step: int) -> None:
    """The Lightning step the following collectives belong to (called at the start of every training batch)."""
    if _monitor is not None:
        _monitor.step = step


def note_exit(rank: int, how: str) -> None:
    """Records how a rank ended (called from a thread of the process that launched it), for the survivors' errors."""
    monitor = _monitor
    if monitor is not None:
        try:
            store = monitor.source.clone() if hasattr(monitor.source, "clone") else monitor.source
            store.set(f"{_NS}/exit/{rank}", how)
        except Exception:  # noqa: BLE001 - best effort: /proc tells the same on this host
            pass


def wait_for(
    work: Any,
    what: str | None = None,
    sliced: bool = True,
    hang_error: type[RuntimeError] = CollectiveTimeoutError,
    point_to_point: bool = False,
) -> None:
    """Waits for a ``torch.distributed`` work like ``work.wait()``, such that the watchdog can end a hang and a
    failure is explained (`explain_failure`). gloo collectives are waited in slices of `_SLICE_S` seconds;
    ``sliced=False`` for device collectives, whose waits do not block the host (their hangs end through the NCCL
    watchdog). gloo point-to-point receives and sends (``point_to_point=True``) cannot be waited in slices: a timed
    out wait closes the connection, so they are waited once with `watchdog_timeout`.

    Raises:
        CollectiveMismatchError: the ranks' collectives diverged (see [Note: diverging collectives]).
        PeerFailureError: a peer died during the wait (see [Note: a dead peer]).
        hang_error: the wait took longer than `watchdog_timeout` and the collectives agree (the message says where
            every rank is).
    """
    monitor = _get_monitor()
    if monitor is None:
        work.wait()
        return
    last = monitor.last()
    start = time.monotonic()
    doing = what or (last.describe() if last is not None else "a collective")
    monitor.blocked = (start, doing)
    try:
        if point_to_point:
            try:
                work.wait(timeout=timedelta(seconds=monitor.timeout))
                return
            except RuntimeError as err:
                if "time" not in str(err).lower():
                    raise
            compared = monitor.compare_now()
            waited = time.monotonic() - start
            raise hang_error(
                f"rank {monitor.rank} waited {waited:.0f} s for {doing} ({WATCHDOG_TIMEOUT_ENV}="
                f"{monitor.timeout:g}): {compared}"
            )
        if not sliced:
            work.wait()
            return
        while True:
            try:
                work.wait(timeout=timedelta(seconds=_SLICE_S))
                return
            except RuntimeError as err:
                if "timed out" not in str(err).lower():
                    raise
            verdict = monitor.verdict
            if verdict is None or monitor.verdict_at < start:
                continue
            if "diverge" in verdict:
                monitor.everyone_knows()
                raise CollectiveMismatchError(verdict)
            waited = time.monotonic() - start
            if waited > monitor.timeout:
                raise hang_error(
                    f"rank {monitor.rank} waited {waited:.0f} s for {doing} ({WATCHDOG_TIMEOUT_ENV}="
                    f"{monitor.timeout:g}): {verdict}"
                )
    except RuntimeError as err:
        if isinstance(err, (CollectiveMismatchError, PeerFailureError, hang_error)):
            raise
        raise explain_failure(err, doing) from err
    finally:
        monitor.blocked = None


# [Note: a peer that gloo aborted]
# Collectives of different sizes on two ranks (a rank that skips a unit, or runs one twice, where the units differ in
# size) never reach the watchdog's comparison: gloo's transport thread receives more bytes than the collective
# expects, throws ("Received data size doesn't match expected size") where nothing can catch it, and the process
# ends with SIGABRT at once, its Python state gone. The survivor can only say how the peer ended, so for SIGABRT it
# adds what that almost always means and how to have torch name both collectives before gloo aborts.
_ABORT_HINT = (
    "A rank killed by SIGABRT in a collective is most often gloo refusing a collective of another size than its "
    "peer's ('Received data size doesn't match' in its log): the ranks' collectives diverged, e.g. through control "
    "flow that depends on the rank's data or rank; TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch name both ranks' "
    "collectives before gloo aborts. "
)


def explain_failure(err: BaseException, what: str | None = None) -> BaseException:
    """The error to raise instead of ``err`` (a failed collective): `PeerFailureError` naming the dead rank,
    `CollectiveMismatchError` naming the first divergence, or ``err`` itself when neither is found."""
    monitor = _monitor
    if monitor is None:
        return err
    last = monitor.last()
    doing = what or (last.describe() if last is not None else "a collective")
    raw = " ".join(str(err).split())[:300]
    deadline = time.monotonic() + 2.0
    while monitor.comparing and time.monotonic() < deadline:  # a verdict on its way (peers may exit after theirs)
        time.sleep(0.05)
    if monitor.verdict is not None and "diverge" in monitor.verdict and time.monotonic() - monitor.verdict_at < 60:
        return CollectiveMismatchError(monitor.verdict)
    try:
        dead = _dead_peers(monitor)
        if not dead:
            verdict = monitor.compare_now()
            if "diverge" in verdict:
                return CollectiveMismatchError(verdict)
            dead = _dead_peers(monitor)
            for r in monitor.missing:
                dead.setdefault(
                    r,
                    (
                        monitor.peers().get(r, {}),
                        f"did not answer within {_ANSWER_S:.0f} s (dead, or its host unreachable)",
                    ),
                )
    except Exception:  # noqa: BLE001 - the store is gone with its host
        host = os.environ.get("MASTER_ADDR", "?")
        port = os.environ.get("MASTER_PORT", "?")
        return PeerFailureError(
            f"rank {monitor.rank}: a peer failed while this rank was in {doing}, and the run's store at "
            f"{host}:{port} does not answer either: the process hosting it (rank 0 under Lightning's launcher, the "
            f"torchrun agent under torchrun) has most likely died. Look at its log and exit status (the kernel log "
            f"for the OOM killer). gloo said: {raw}"
        )
    if not dead:
        return err
    parts = []
    for r, (info, how) in sorted(dead.items()):
        where = f" (pid {info['pid']} on {info['host']})" if "pid" in info else ""
        parts.append(f"rank {r}{where} {how}")
    aborted = any(how == "killed by SIGABRT" for _, how in dead.values())
    error = PeerFailureError(
        f"rank {monitor.rank}: {'; '.join(parts)} while this rank was in {doing}. The run cannot continue; the last "
        f'checkpoint is intact (restart with ckpt_path="last"). Look at the dead rank\'s log and exit status (a '
        f"SIGKILL often means the OOM killer: see the kernel log). {_ABORT_HINT if aborted else ''}gloo said: {raw}"
    )
    error.killed = any(how.startswith("killed") for _, how in dead.values())
    return error


def _dead_peers(monitor: Monitor, settle: bool = True) -> dict[int, tuple[dict[str, Any], str]]:
    dead = {}
    for r, info in monitor.peers().items():
        if r == monitor.rank:
            continue
        how = info.get("ended") or _process_end(info)
        if how is not None:
            dead[r] = (info, how if how.startswith(("killed", "exited")) else f"ended ({how})")
    if settle and any(how == "exited" for _, how in dead.values()):
        time.sleep(1.0)  # reaped already: its launcher may be writing how it ended (note_exit)
        return _dead_peers(monitor, settle=False)
    return dead


# ==================================================================== the verdict (pure)
def first_divergence(reports: dict[int, dict[str, Any]], world: int) -> str:
    """The verdict of a comparison (see [Note: diverging collectives]) from each answering rank's report
    (``records``: its recent `Record` dicts; ``where``: its main thread's current line)."""
    missing = [r for r in range(world) if r not in reports]
    silent = (
        f" Ranks {missing} did not answer within {_ANSWER_S:.0f} s (dead, or stuck without releasing the GIL)."
        if missing
        else ""
    )
    seqs = {r: {d["seq"]: Record(**d) for d in rep.get("records", [])} for r, rep in reports.items()}
    if not seqs:
        return "no rank answered the watchdog's comparison." + silent
    low = max((min(s) for s in seqs.values() if s), default=1)
    high = max((max(s) for s in seqs.values() if s), default=0)
    for seq in range(low, high + 1):
        at = {r: s.get(seq) for r, s in seqs.items()}
        keys = {rec.key() for rec in at.values() if rec is not None}
        if len(keys) == 1 and None in at.values():  # some ranks are behind: stuck before their next collective
            ahead = next(rec for rec in at.values() if rec is not None)
            behind = []
            for r, rec in sorted(at.items()):
                if rec is None:
                    last = seqs[r].get(max(seqs[r])) if seqs[r] else None
                    after = f" after #{last.seq}, {last.describe()}" if last is not None else ""
                    behind.append(f"rank {r} issued nothing more{after}; it is at {reports[r].get('where', '?')}")
            waiting = sorted(r for r, rec in at.items() if rec is not None)
            return (
                f"the ranks' ZeRO-3 collectives agree, but {'; '.join(behind)}, while ranks {waiting} wait in "
                f"#{seq}, {ahead.describe()}: the hang is in that rank's own code (or data loading)." + silent
            )
        if len(keys) > 1:
            lines = []
            for r, rec in sorted(at.items()):
                if rec is not None:
                    lines.append(f"rank {r} issued {rec.describe()}{_repeat_note(seqs[r], rec)}")
                else:
                    last = seqs[r].get(max(seqs[r])) if seqs[r] else None
                    after = f" after #{last.seq}, {last.describe()}" if last is not None else ""
                    lines.append(f"rank {r} issued nothing more{after}; it is at {reports[r].get('where', '?')}")
            return (
                f"the ranks' ZeRO-3 collectives diverge at collective #{seq}: " + "; ".join(lines) + ". Every "
                "rank must run the same modules in the same order under ZeRO-3: look for a branch taken on "
                "some ranks only, a unit called twice, or a module skipped (e.g. depending on the data)." + silent
            )
    where = "; ".join(
        f"rank {r} is at {rep.get('where', '?')}"
        + (f" (waiting {rep['blocked_s']:.0f} s for {rep['blocked_in']})" if rep.get("blocked_s") else "")
        for r, rep in sorted(reports.items())
    )
    if high == 0:
        return f"where each rank is: {where}." + silent
    return (
        f"every answering rank issued the same ZeRO-3 collectives (up to #{high}); the hang is elsewhere: "
        f"{where}." + silent
    )


def _repeat_note(records: dict[int, Record], rec: Record) -> str:
    """ ", its 2nd forward of that unit in this pass" when the unit was gathered before in the same pass."""
    same = [r for r in records.values() if r.seq <= rec.seq and r.key() == rec.key()]
    if len(same) < 2:
        return ""
    n = len(same)
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(n if n < 20 else n % 10, "th")
    return f" (its {n}{suffix} {rec.op} of that unit in this {rec.phase} pass)"
