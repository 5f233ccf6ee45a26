"""How the zlightning strategies start their ranks, end them on SIGTERM, and report a failed rank.

[Note: SIGTERM ends every rank]
``timeout``, a batch scheduler or a user's ``kill`` sends SIGTERM to the process that launched the run (rank 0 under
``popen``, the parent under ``spawn``), sometimes to every rank at once. Lightning's own handler answers it with a
``torch.distributed.broadcast`` issued from inside the signal handler; a rank interrupted between two other
collectives then waits for a peer that is somewhere else, and every rank hangs until SIGKILL. Here the handler does
not talk to the peers at all:

1. the launching process sends SIGTERM to each rank it started;
2. every rank aborts its process groups, so a peer blocked in a collective with it fails at once ("connection closed")
   instead of waiting for the group timeout, and then handles its own SIGTERM;
3. the launching process waits at most `TERMINATE_GRACE_S` seconds for its ranks, SIGKILLs the rest and reaps them;
4. every rank raises ``SystemExit(143)`` (128 + SIGTERM, what a shell reports for "terminated"): Lightning's exception
   path runs ``on_exception`` and the strategy's teardown (which removes NVMe swap files and starts no collective).

The handler is installed where nothing else handles SIGTERM yet (the default disposition); a handler the user or
another library installed first is left alone. During ``trainer.fit/validate/test/predict`` Lightning puts its handler
in front; it calls the launcher's ``kill(SIGTERM)`` before its broadcast, and `kill` is where the steps above run, so
the broadcast is never reached. While the training loop of ``fit`` runs, SIGTERM is a preemption instead: the ranks
finish the step in progress and save one checkpoint before they exit with 143 (see [Note: preemption] in
``_preemption.py``); the launching process of ``spawn`` ranks then waits the preemption deadline as well.

[Note: one concise error per failed run]
When one rank raises, its peers fail a moment later with "connection closed by peer", and each process printed its
full traceback (several screens for two ranks). After the process group is set up, each rank's uncaught exception is
written in full to ``<error dir>/rank<r>.log`` and one short summary is printed by the first rank that failed for a
reason of its own: the exception type and message, where it was raised, the rank, and the folder of the logs. A rank
whose error only says that a peer went away waits a moment before claiming the report, so the rank with the cause
wins. ``ZLIGHTNING_FULL_TRACEBACK=1`` prints the full traceback of the reporting rank as well. A one-process run keeps
Python's usual traceback.

"Where it was raised" is two places when they differ: first the innermost frame of the user's own code (not torch,
Lightning, zlightning, the standard library or an installed package; see ``zlightning/_user_code.py``), with its
source line, then the frame that raised. An error inside torch (a shape mismatch in a layer the user called) is then
summarised at the user's line, not only at ``torch/nn/modules/linear.py``.

[Note: one error folder per run]
Every run that fails gets a folder of its own, ``<base>/run-<date>-<time>-<pid>``, under the base folder
``ZLIGHTNING_ERROR_DIR`` (default ``<system temp>/zlightning-<uid>/errors``). The launching process names it
(`_start_error_run`, through ``ZLIGHTNING_ERROR_RUN`` in the environment the ranks copy); ranks started by another
tool derive one name from what they share (`_external_run_name`): the SLURM job step, the torchrun rendezvous id,
else the rendezvous port and their common parent process (one folder per host). One folder for all runs would keep the first failure's "reported" claim, so that no later failed run
would print its error, and it would only grow. When a rank writes its log, the oldest run folders beyond the newest
`ERROR_RUNS_KEPT_ENV` (default 10, this run included) are removed (`prune_error_runs`): only folders named
``run-*``, never one whose launching process is still running, never anything else in the base folder.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, NoReturn

import torch.distributed
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.distributed import _set_num_threads_if_needed
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override
from zlightning.strategies._preemption import GracefulStop, preemption_timeout

from zlightning._oversubscription import warn_if_oversubscribed
from zlightning._user_code import user_frame
from zlightning._watchdog import PeerFailureError, note_exit

__all__ = [
    "ERROR_DIR_ENV",
    "ERROR_RUNS_KEPT_ENV",
    "TERMINATED_EXIT_CODE",
    "TERMINATE_GRACE_S",
    "RankFailedError",
    "RankLauncher",
    "SpawnRankLauncher",
    "add_graceful_stop",
    "end_run",
    "install_failure_report",
    "install_sigterm_handler",
    "prune_error_runs",
    "recover_checkpoint_dirs",
]

TERMINATE_GRACE_S = 10.0
"""Seconds the launching process waits for its ranks after SIGTERM before it SIGKILLs them."""
TERMINATED_EXIT_CODE = 128 + int(signal.SIGTERM)
"""Exit status of a rank ended by SIGTERM (143, as a shell reports a process killed by SIGTERM)."""
ERROR_DIR_ENV = "ZLIGHTNING_ERROR_DIR"
"""Environment variable naming the folder under which each failed run's error folder goes (see [Note: one error
folder per run])."""
ERROR_RUNS_KEPT_ENV = "ZLIGHTNING_ERROR_RUNS_KEPT"
"""Environment variable: how many run folders the error folder keeps, the newest (default 10)."""
_ERROR_RUN_ENV = "ZLIGHTNING_ERROR_RUN"
_RUN_PREFIX = "run-"
_DEFAULT_RUNS_KEPT = 10
_FULL_TRACEBACK_ENV = "ZLIGHTNING_FULL_TRACEBACK"
_SECONDARY_WAIT_S = 3.0
_PEER_EXIT_GRACE_S = 15.0
"""Seconds rank 0 of a ``popen`` run has, after another rank died, to end with its own error before it is killed."""
_SECONDARY = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Socket Timeout",
    "connection closed",
    "Connection refused",
)

_children: Callable[[], Sequence[Any]] = list
"""The processes this process launched (Popen or multiprocessing.Process), read when a signal arrives."""
_ending = False


class RankFailedError(RuntimeError):
    """A rank of a ``spawn``-launched run failed; the message is its summary, the traceback is in the error folder."""


# ==================================================================== SIGTERM: see [Note: SIGTERM ends every rank]
def install_sigterm_handler(children: Callable[[], Sequence[Any]] | None = None) -> None:
    """Ends the whole run on SIGTERM (see [Note: SIGTERM ends every rank]).

    Args:
        children: returns the rank processes this process started (only the launching process passes it).
    """
    global _children
    if children is not None:
        _children = children
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    end_run(signum)


def end_run(signum: int = int(signal.SIGTERM)) -> NoReturn:
    """Ends this rank and the ranks it launched, within `TERMINATE_GRACE_S` seconds, then raises ``SystemExit(143)``.

    Raises:
        SystemExit: always (exit status `TERMINATED_EXIT_CODE`).
    """
    global _ending
    if _ending:  # a second signal while ending: leave at once
        raise SystemExit(TERMINATED_EXIT_CODE)
    _ending = True
    children = [p for p in _children() if _alive(p)]
    # ranks started by this process that are training finish their step and save first (see [Note: preemption])
    grace = TERMINATE_GRACE_S + (preemption_timeout() if not torch.distributed.is_initialized() else 0.0)
    if children:
        name = signal.Signals(signum).name
        print(
            f"zlightning: {name} received: ending this run's {len(children) + 1} processes (at most {grace:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    _stop_child_observers()
    for p in children:
        _signal(p, signal.SIGTERM)
    _abort_process_groups()
    deadline = time.monotonic() + grace
    for p in children:
        _wait(p, max(0.0, deadline - time.monotonic()))
        if _alive(p):
            _signal(p, signal.SIGKILL)
            _wait(p, 5.0)
    raise SystemExit(TERMINATED_EXIT_CODE)


def _stop_child_observers() -> None:
    """Stops Lightning's child-process observer thread, which SIGKILLs the launching process as soon as a rank
    exits with a non-zero status: here ranks exit with 143 on purpose while this process waits for them."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next check then finds nothing to watch and ends


def _alive(p: Any) -> bool:
    if hasattr(p, "poll"):  # subprocess.Popen
        return p.poll() is None
    return bool(p.is_alive())


def _signal(p: Any, signum: int) -> None:
    try:
        os.kill(p.pid, signum)
    except (ProcessLookupError, TypeError):
        pass


def _wait(p: Any, timeout: float) -> None:
    try:
        if hasattr(p, "poll"):
            p.wait(timeout=timeout)
        else:
            p.join(timeout=timeout)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired; the caller checks liveness
        pass


def _abort_process_groups() -> None:
    """Aborts every process group of this rank, so peers blocked in a collective with it fail at once."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    try:
        torch.distributed.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - best effort: the peers then fail on this process's exit instead
        pass


class RankLauncher(_SubprocessScriptLauncher):
    """Lightning's ``popen`` launcher (the script re-run once per extra rank) whose SIGTERM ends every rank, and
    which gives every rank the same error folder. See [Note: SIGTERM ends every rank]."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if not self.cluster_environment.creates_processes_externally:
            _start_error_run()  # before the children copy the environment
        if self.cluster_environment.local_rank() == 0 and _on_cpu(getattr(trainer, "strategy", None)):
            warn_if_oversubscribed(self.num_processes)  # once per host: see [Note: oversubscribed CPU runs]
        install_sigterm_handler(lambda: self.procs)
        recover_checkpoint_dirs(trainer)
        add_graceful_stop(trainer)
        try:  # Lightning's launch, with an observer that reports how a rank ended (see _RankObserver)
            self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
            if not self.cluster_environment.creates_processes_externally:
                self._call_children_scripts()
                first = self.cluster_environment.node_rank() * self.num_processes + 1
                _RankObserver(os.getpid(), self.procs, first).start()
            _set_num_threads_if_needed(num_processes=self.num_processes)
            return function(*args, **kwargs)
        except SystemExit as stop:
            if stop.code == TERMINATED_EXIT_CODE:  # preempted: the other ranks are exiting too (see [Note: preemption])
                _reap(self.procs)
            raise

    @override
    def kill(self, signum: Any) -> None:
        if signum == signal.SIGTERM:
            end_run(int(signum))  # called from Lightning's SIGTERM handler: never returns
        super().kill(signum)


class SpawnRankLauncher(_MultiProcessingLauncher):
    """Lightning's ``spawn``/``fork``/``forkserver`` launcher with the same SIGTERM handling and short rank errors."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        _start_error_run()
        if _on_cpu(self._strategy):
            warn_if_oversubscribed(len(self._strategy.parallel_devices or []))
        install_sigterm_handler(lambda: self.procs)
        recover_checkpoint_dirs(trainer)
        add_graceful_stop(trainer)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def kill(self, signum: Any) -> None:
        if signum == signal.SIGTERM:
            end_run(int(signum))
        super().kill(signum)

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        """Lightning sends rank 0's ``state_dict()`` to the main process after ``fit``; a module that stays sharded
        (``zstack_zero3``) would send this rank's pieces, so here the full state is gathered unit by unit (Lightning's
        method otherwise)."""
        from zlightning.zero import engine_of, full_state_dict

        engine = engine_of(trainer.lightning_module)
        if engine is None:
            return super()._collect_rank_zero_results(trainer, results)
        state_dict = full_state_dict(engine, rank0_only=True)  # collective: every rank takes part
        if self._strategy.local_rank != 0:
            return None
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback is not None else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, self.get_extra_results(trainer))

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(process_idx, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - reported once, briefly; the traceback goes to the rank's log
            rank, world = self._strategy.global_rank, self._strategy.world_size
            summary = _report(err, rank, world, print_summary=False)
            raise RankFailedError(summary) from None
        _destroy_process_groups()  # see [Note: a spawned rank leaves its process groups before it exits]
        if self._start_method == "spawn":
            _exit_like_a_forked_rank()


def _destroy_process_groups() -> None:
    """Destroys this rank's process groups (the default one and every subgroup) after its work is done.

    [Note: a spawned rank leaves its process groups before it exits]
    Lightning's spawn worker returns and the process exits with its process groups still alive; gloo's worker
    threads then outlive the interpreter's finalisation, and a rank now and then died with SIGABRT ("terminate
    called without an active exception") after ``fit`` had finished, failing the whole launch. Every collective of
    the run has completed when the worker function returns (rank 0's results were gathered collectively), so each
    rank destroys its groups locally, while the interpreter is fully alive.

    That alone did not do it (CI, and about 1 run in 6 here): after ``destroy_process_group`` the gloo threads
    (``gloo_tcp_loop``, two ``pt_gloo_runloop``) are still running, the groups being still referenced from C++, and
    the finalisation of a spawned interpreter (``sys.exit`` at the end of ``multiprocessing.spawn``) destroys them
    in no particular order. Ranks started by ``fork`` and ``forkserver`` never finalise: ``multiprocessing`` ends
    them with ``os._exit`` once their target returns. So a spawned rank that finished its work ends the same way
    (`_exit_like_a_forked_rank`), after flushing its output and running its ``atexit`` handlers (swap-folder
    cleanup among them) while everything is alive. Rank 0's result is already in the parent's pipe by then
    (Lightning's ``SimpleQueue.put`` writes synchronously).

    Ranks that finalise normally (``popen``, ``torchrun``) can still meet the same abort from a daemon thread caught
    inside a C++ call by the finalisation: the watchdog's monitor was one (a core dump showed it in ``Store.add``),
    and it is now stopped before the interpreter finalises; see [Note: the monitor ends before the interpreter
    does] in ``zlightning/_watchdog.py``. So can gloo's own worker threads, which release the tensors of the last
    collective after the rank stopped waiting for it; see [Note: gloo's workers finish with Python before the
    interpreter does] in ``zlightning/_exit.py``.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort: the process is about to exit
            pass


def _exit_like_a_forked_rank() -> NoReturn:
    """Ends a spawned rank whose work is done as ``multiprocessing`` ends a forked one (see the note above)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can be written anyway
            pass
    os._exit(0)


class _RankObserver(_ChildProcessObserver):
    """Lightning's observer of the ranks a ``popen`` rank 0 started, which SIGKILLs the whole run as soon as one of
    them exits with an error. This one first records how the rank ended (for the survivors' errors: see [Note: a
    dead peer] in ``zlightning/_watchdog.py``), looks twice a second instead of every 5 s, and gives this process
    `_PEER_EXIT_GRACE_S` seconds to end with its own, explained error before it ends everything."""

    def __init__(self, main_pid: int, procs: list[Any], first_rank: int) -> None:
        super().__init__(main_pid, procs, sleep_period=1)
        self._sleep_period = 0.5  # type: ignore[assignment]
        self._first_rank = first_rank

    @override
    def _run(self) -> bool:
        for proc in self._child_processes:
            proc.poll()
        if all(proc.returncode == 0 for proc in self._child_processes):
            return True
        failed = [(i, proc) for i, proc in enumerate(self._child_processes) if proc.returncode]
        if not failed:
            return False
        for i, proc in failed:
            code = proc.returncode
            how = f"killed by {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
            note_exit(self._first_rank + i, how)
        time.sleep(_PEER_EXIT_GRACE_S)
        if self._child_processes:  # not stopped meanwhile (an intended exit: see _stop_child_observers)
            self._terminate_all()
        return True


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def add_graceful_stop(trainer: Any) -> None:
    """Gives the Trainer the callback that turns SIGTERM during ``fit`` into a coordinated stop (see [Note:
    preemption] in ``_preemption.py``), once."""
    callbacks = getattr(trainer, "callbacks", None)
    if isinstance(callbacks, list) and not any(isinstance(c, GracefulStop) for c in callbacks):
        callbacks.append(GracefulStop())


def _reap(procs: Sequence[Any]) -> None:
    """Waits for ranks that are exiting (at most `TERMINATE_GRACE_S` seconds), then SIGKILLs what is left."""
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        _wait(p, max(0.0, deadline - time.monotonic()))
        if _alive(p):
            _signal(p, signal.SIGKILL)
            _wait(p, 5.0)


def recover_checkpoint_dirs(trainer: Any) -> None:
    """Puts back a checkpoint that a crash between the two renames of a publication left missing (file systems
    without ``RENAME_EXCHANGE``; see [Note: the name always resolves] in ``zlightning/_durable.py``), before Lightning
    lists the folder for ``ckpt_path="last"``: otherwise it would not find ``last.ckpt`` and start from scratch."""
    from zlightning._durable import recover

    for callback in getattr(trainer, "checkpoint_callbacks", None) or []:
        folder = getattr(callback, "dirpath", None)
        if folder is None:  # Lightning resolves it from the logger at setup; the same function answers now
            try:
                folder = callback._ModelCheckpoint__resolve_ckpt_dir(trainer)
            except Exception:  # noqa: BLE001 - not a ModelCheckpoint, or no folder yet: nothing to recover
                continue
        if folder is not None and "://" not in str(folder):
            recover(folder)


# ==================================================================== errors: see [Note: one concise error per failed run]
def install_failure_report(rank: int, world_size: int) -> None:
    """Replaces ``sys.excepthook`` in a rank of a multi-process run (after ``init_process_group``, whose own hook
    prefixes every traceback line with the rank). See [Note: one concise error per failed run]."""
    if world_size <= 1 or getattr(sys.excepthook, "_zlightning_rank", None) == rank:
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], err: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, KeyboardInterrupt):
            previous(kind, err, tb)
            return
        try:
            _report(err, rank, world_size, print_summary=True)
        except Exception:  # noqa: BLE001 - never lose the error itself
            previous(kind, err, tb)

    hook._zlightning_rank = rank  # type: ignore[attr-defined]
    sys.excepthook = hook


def _on_cpu(strategy: Any) -> bool:
    """Whether the ranks of ``strategy`` (a Lightning strategy, or None) run on CPU devices."""
    devices = getattr(strategy, "parallel_devices", None) or []
    return bool(devices) and all(torch.device(d).type == "cpu" for d in devices)


def _start_error_run() -> None:
    """Names this run's error folder, in the process that starts the ranks (see [Note: one error folder per run])."""
    os.environ.setdefault(_ERROR_RUN_ENV, f"{_RUN_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")


def _error_dir() -> Path:
    """This run's error folder (see [Note: one error folder per run])."""
    base = os.environ.get(ERROR_DIR_ENV) or Path(tempfile.gettempdir()) / f"zlightning-{os.getuid()}" / "errors"
    return Path(base) / (os.environ.get(_ERROR_RUN_ENV) or _external_run_name())


def _external_run_name() -> str:
    """The error folder's name for ranks started by another tool, alike on every rank of the job: the SLURM job step
    or the torchrun rendezvous id when there is one, else the rendezvous port and the ranks' parent (this host)."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    attempt = f"restart{restart}-" if restart not in ("", "0") else ""
    job, rendezvous = os.environ.get("SLURM_JOB_ID"), os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if job:
        key = f"slurm{job}.{os.environ.get('SLURM_STEP_ID', '0')}"
    elif rendezvous not in ("", "none"):
        key = f"torchrun-{rendezvous}"
    else:
        key = f"port{os.environ.get('MASTER_PORT', '0')}-{os.getppid()}"
    return _RUN_PREFIX + re.sub(r"[^\w.-]", "_", attempt + key)


def prune_error_runs(base: Path, current: Path | None = None) -> list[Path]:
    """Removes the oldest run folders under ``base`` beyond the newest ``$ZLIGHTNING_ERROR_RUNS_KEPT`` (default 10,
    ``current`` included). See [Note: one error folder per run].

    Args:
        base: the folder holding the run folders.
        current: this run's folder, always kept.

    Returns:
        The folders removed.
    """
    raw = os.environ.get(ERROR_RUNS_KEPT_ENV, "").strip()
    kept = max(1, int(raw)) if raw.isdigit() else _DEFAULT_RUNS_KEPT
    try:
        runs = [p for p in base.iterdir() if p.name.startswith(_RUN_PREFIX) and p.is_dir() and not p.is_symlink()]
    except OSError:
        return []
    others = sorted((p for p in runs if p != current), key=_mtime, reverse=True)
    removed = []
    for old in others[kept - (current is not None) :]:
        if not _launcher_running(old.name):
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _launcher_running(name: str) -> bool:
    """Whether the process whose id ends a run folder's name (its launching process, or its ranks' parent) runs."""
    found = re.search(r"-(\d+)$", name)
    if found is None:
        return False
    pid = int(found.group(1))
    if pid <= 1:  # no process id, or init (the parent of orphaned ranks), which always runs
        return False
    try:
        os.kill(pid, 0)
    except PermissionError:  # another user's process
        return True
    except (ProcessLookupError, OverflowError):
        return False
    return True


def _rank() -> int:
    for name in ("RANK", "GLOBAL_RANK", "LOCAL_RANK"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def _report(err: BaseException, rank: int, world_size: int, print_summary: bool) -> str:
    """Writes ``err``'s traceback to this rank's log and prints the summary if this rank is the first to fail for a
    reason of its own. Returns the summary."""
    folder = _error_dir()
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = folder / f"rank{rank}.log"
    full = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    log.write_text(full)
    prune_error_runs(folder.parent, current=folder)
    summary = summarize(err, rank, world_size, folder)
    if not print_summary:
        return summary
    if _is_secondary(err):
        time.sleep(_SECONDARY_WAIT_S)  # let the rank with the cause claim the report first
    try:
        fd = os.open(folder / "reported", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return summary  # another rank printed the run's error
    os.write(fd, str(rank).encode())
    os.close(fd)
    if os.environ.get(_FULL_TRACEBACK_ENV) == "1":
        print(full, file=sys.stderr, end="")
    print(summary, file=sys.stderr, flush=True)
    return summary


def _is_secondary(err: BaseException) -> bool:
    if isinstance(err, PeerFailureError) and err.killed:
        return False  # the killed rank could not report: this names it, the best report there is
    text = f"{err}"
    return any(marker in text for marker in _SECONDARY)


def summarize(err: BaseException, rank: int, world_size: int, folder: Path | None = None, max_chars: int = 900) -> str:
    """A few lines about ``err``: the rank, the exception and its message, the root cause when another exception
    led to it, where it was raised, and the folder of the full tracebacks."""
    message = " ".join(str(err).split()) or "(no message)"
    if len(message) > max_chars:
        message = message[: max_chars - 3] + "..."
    lines = [f"zlightning: rank {rank} of {world_size} failed: {type(err).__name__}: {message}"]
    root, seen = err, {id(err)}
    while (root.__cause__ or root.__context__) is not None and id(root.__cause__ or root.__context__) not in seen:
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
        seen.add(id(root))
    if root is not err and str(root) and str(root) not in str(err):
        lines.append(f"  caused by {type(root).__name__}: {' '.join(str(root).split())[:300]}")
    frames = traceback.extract_tb(err.__traceback__)
    if frames:
        last, user = frames[-1], user_frame(frames)
        if user is not None and user is not last:  # see [Note: one concise error per failed run]
            code = " ".join((user.line or "").split())
            code = f": {code[:97]}..." if len(code) > 100 else f": {code}" if code else ""
            lines.append(f"  in your code at {_short_path(user.filename)}:{user.lineno} in {user.name}{code}")
        lines.append(f"  raised at {_short_path(last.filename)}:{last.lineno} in {last.name}")
    if folder is not None:
        lines.append(
            f"  full traceback of each failed rank: {folder}/rank<r>.log (or set {_FULL_TRACEBACK_ENV}=1 to print it)"
        )
    return "\n".join(lines)


def _short_path(filename: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in filename:
        return filename.split(marker, 1)[1]
    try:
        return os.path.relpath(filename)
    except ValueError:
        return filename
