"""A warning, once per run and host, when a CPU run starts more processes or threads than this host's usable cores.

[Note: oversubscribed CPU runs]
``Trainer(accelerator="cpu", devices=8)`` on a machine (or a CPU affinity, or a batch job's allocation) with 2 usable
cores runs 8 ranks that take turns on 2 cores: every step takes about 4 times as long as with ``devices=2``, and the
run processes no more samples per second, often fewer (each collective waits for the rank that is not scheduled). So
does a run whose ranks each use several intra-op threads: Lightning gives each rank ``max(1, cores // processes)``
torch threads unless ``OMP_NUM_THREADS`` is set, and a value set by hand can make ``processes x threads`` exceed the
cores. Nothing failed or said so. The process that starts the ranks of this host (the launching process, or local
rank 0 under ``torchrun``/SLURM) now warns once, with a `CPUOversubscriptionWarning`, naming the counts, the cost and
the fix. "Usable cores" are those of ``os.sched_getaffinity`` (what ``taskset`` and batch schedulers restrict), the
count Lightning's thread default divides as well.
"""

from __future__ import annotations

import os
import warnings

from zlightning._user_code import user_stacklevel

__all__ = ["CPUOversubscriptionWarning", "oversubscription_message", "usable_cores", "warn_if_oversubscribed"]

_warned: set[tuple[int, int | None, int]] = set()


class CPUOversubscriptionWarning(UserWarning):
    """A CPU run uses more processes, or processes x threads, than this host's usable cores (see [Note:
    oversubscribed CPU runs])."""


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where affinity is not available)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _threads_from_environment() -> int | None:
    """Each rank's intra-op threads when ``OMP_NUM_THREADS`` fixes them (None: Lightning picks ``cores //
    processes``)."""
    raw = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _cores(n: int) -> str:
    return f"{n} usable core{'s' if n != 1 else ''}"


def oversubscription_message(*, processes: int, threads: int | None, cores: int) -> str | None:
    """What running ``processes`` CPU processes of ``threads`` intra-op threads each on ``cores`` cores costs, or
    None when they fit.

    Args:
        processes: the CPU processes (ranks) of the run on this host.
        threads: each one's torch intra-op threads when fixed by ``OMP_NUM_THREADS``; None for Lightning's default
            ``max(1, cores // processes)``.
        cores: the usable cores (`usable_cores`).
    """
    cores = max(1, cores)
    fair = max(1, cores // processes)
    parts = []
    if processes > cores:
        slower = f"{processes / cores:.3g}"
        parts.append(
            f"{processes} CPU processes (devices={processes}) on {_cores(cores)}: they take turns on "
            f"{'it' if cores == 1 else 'them'}, so each step runs about {slower}x slower than with devices={cores}, "
            f"for no more samples per second. Use devices={cores} (raise the batch size or accumulate_grad_batches "
            "to keep the global batch), or run where more cores are usable."
        )
    if threads is not None and threads > fair and processes * threads > cores:
        if parts:
            parts.append(
                f"Each also runs {threads} torch threads (OMP_NUM_THREADS={threads}): set OMP_NUM_THREADS={fair}."
            )
        else:
            parts.append(
                f"{processes} CPU processes x {threads} torch threads (OMP_NUM_THREADS={threads}) make "
                f"{processes * threads} threads on {_cores(cores)}: they compete for the cores, which slows every "
                f"step. Set OMP_NUM_THREADS={fair}, or unset it (Lightning then gives each process {cores} // "
                f"{processes} = {fair})."
            )
    return " ".join(parts) or None


def warn_if_oversubscribed(processes: int) -> None:
    """Warns once per process and setting when ``processes`` CPU ranks on this host oversubscribe its cores (see
    [Note: oversubscribed CPU runs]). Call it where this host's ranks are started, in one process per host."""
    key = (processes, _threads_from_environment(), usable_cores())
    message = oversubscription_message(processes=key[0], threads=key[1], cores=key[2])
    if message is None or key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, CPUOversubscriptionWarning, stacklevel=user_stacklevel())
