"""Preemption: SIGTERM during ``fit`` ends the run at a step boundary, after one checkpoint that every rank agreed on.

[Note: preemption]
Schedulers (SLURM, Kubernetes, ``torchrun``'s agent) announce the end of a job with SIGTERM and kill it a while later
(SLURM's ``KillWait`` and torchrun's grace period are 30 s by default). Outside the training loop SIGTERM ends every
rank at once (see [Note: SIGTERM ends every rank] in ``_launch.py``). While the training loop runs (from
``on_train_start`` to ``on_train_end``), `GracefulStop` handles it instead:

1. the signal handler only notes the request (which rank, when) and starts a deadline; it never talks to the peers
   (a collective from inside a handler deadlocks ranks that are in another collective);
2. at the end of every training batch each rank contributes its "requested" bit to one small all-reduce over a CPU
   (gloo) group, so all ranks see the same answer after the same batch: the step in progress when the signal came
   is finished on every rank, wherever the signal arrived (one rank, the launching process, or all of them);
3. the ranks write one checkpoint together, ``last`` in the ``ModelCheckpoint`` folder (its ``last`` name even
   without ``save_last``; nothing is written when the Trainer has no ``ModelCheckpoint``), through the usual durable
   save (see ``zlightning/_durable.py``), so a SIGKILL that comes early leaves the previous ``last`` complete;
4. rank 0 prints one line (who received the signal, the step, the path, how long it took) and every rank raises
   ``SystemExit(143)``; Lightning's exception path tears the strategy down without collectives.

A run resumed with ``ckpt_path="last"`` continues with the next step: the checkpoint is written at the same point as
``ModelCheckpoint(every_n_train_steps=...)`` writes its own, after the loop counted the batch. Losses match an
uninterrupted run when the data loader is resumable (Lightning saves ``state_dict()`` of a train loader that has
``state_dict``/``load_state_dict``); a plain ``DataLoader`` restarts its epoch, as with any mid-epoch checkpoint.

Bound: the step in progress, plus one checkpoint save. During validation inside ``fit`` the stop waits for the next
training batch. If the stop has not finished `PREEMPT_TIMEOUT_S` seconds after the signal (``ZLIGHTNING_PREEMPT_
TIMEOUT_S`` overrides it), the process groups are aborted and the rank exits with status 143 without the checkpoint;
a second SIGTERM does the same at once. The per-batch check costs one 8-byte all-reduce on a CPU group.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from zlightning._threads import small_thread_stacks
from zlightning._watchdog import note_step, wait_for

__all__ = ["PREEMPT_TIMEOUT_ENV", "PREEMPT_TIMEOUT_S", "GracefulStop", "preemption_timeout"]

PREEMPT_TIMEOUT_S = 120.0
"""Default seconds between SIGTERM and the forced exit when the step and the checkpoint have not finished."""
PREEMPT_TIMEOUT_ENV = "ZLIGHTNING_PREEMPT_TIMEOUT_S"


def preemption_timeout() -> float:
    """`PREEMPT_TIMEOUT_S`, or the value of ``ZLIGHTNING_PREEMPT_TIMEOUT_S`` (see ``seconds_from_env``)."""
    from zlightning._watchdog import seconds_from_env

    return seconds_from_env(PREEMPT_TIMEOUT_ENV, PREEMPT_TIMEOUT_S)


class GracefulStop(Callback):
    """Added to every zstack Trainer by the launcher; see [Note: preemption]."""

    def __init__(self) -> None:
        self._group: Any = None
        self._previous_handler: Any = None
        self._requested_at: float | None = None
        self._signum = int(signal.SIGTERM)
        self._deadline: threading.Timer | None = None
        self._armed = False

    # ---------------------------------------------------------------- arming (the training loop only)
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            backend = dist.get_backend()
            if self._group is None and backend != "gloo":
                with small_thread_stacks("gloo"):  # see [Note: thread stacks count against a data limit]
                    self._group = dist.new_group(backend="gloo")  # collective: every rank is here
        self._requested_at = None
        self._armed = True
        if threading.current_thread() is threading.main_thread():
            # Lightning's own handler (installed for the run) would broadcast from inside the handler: replaced
            # while the loop runs, put back at its end
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_signal)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._disarm()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._disarm()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._armed and self._previous_handler is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_handler)
        self._previous_handler = None
        self._armed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        from zlightning.strategies._launch import end_run

        if not self._armed or self._requested_at is not None:
            end_run(signum)  # a second signal, or the loop already ended: stop at once
        self._requested_at = time.monotonic()
        self._signum = signum
        bound = preemption_timeout()
        name = signal.Signals(signum).name
        world = int(os.environ.get("WORLD_SIZE", "0")) or (dist.get_world_size() if dist.is_initialized() else 1)
        print(
            f"zlightning: {name} received: ending this run's {world} processes after the step in progress and one "
            f"checkpoint (at most {bound:.0f} s; a second {name} ends them at once)",
            file=sys.stderr,
            flush=True,
        )
        self._deadline = threading.Timer(bound, self._give_up, args=(bound,))
        self._deadline.daemon = True
        self._deadline.start()

    def _give_up(self, bound: float) -> None:
        """The deadline passed (a step or the save is stuck): end this rank without the checkpoint."""
        from zlightning.strategies._launch import TERMINATED_EXIT_CODE, _abort_process_groups, _children, _signal

        print(
            f"zlightning: the step and checkpoint after {signal.Signals(self._signum).name} did not finish within "
            f"{bound:.0f} s ({PREEMPT_TIMEOUT_ENV}); ending now without them: the previous checkpoint is intact",
            file=sys.stderr,
            flush=True,
        )
        _abort_process_groups()
        for p in _children():
            _signal(p, signal.SIGKILL)
        os._exit(TERMINATED_EXIT_CODE)

    # ---------------------------------------------------------------- the per-batch agreement and the stop
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        note_step(trainer.global_step)  # names the step in the watchdog's errors

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._armed:
            return
        who = self._who_requested(trainer)
        if who:
            self._stop(trainer, who)

    def _who_requested(self, trainer: pl.Trainer) -> list[int]:
        """The ranks that received the signal (collective: the same answer on every rank after the same batch)."""
        mine = self._requested_at is not None
        if trainer.world_size == 1 or not dist.is_initialized():
            return [0] if mine else []
        flags = torch.zeros(trainer.world_size, dtype=torch.uint8)
        flags[trainer.global_rank] = int(mine)
        work = dist.all_reduce(flags, group=self._group, async_op=True)
        wait_for(work, what=f"the preemption check after step {trainer.global_step}")
        return [r for r, f in enumerate(flags.tolist()) if f]

    def _stop(self, trainer: pl.Trainer, who: list[int]) -> None:
        from zlightning.strategies._launch import TERMINATED_EXIT_CODE, _stop_child_observers

        _stop_child_observers()  # the ranks now exit with 143 on purpose; Lightning's observer would SIGKILL rank 0
        start = time.monotonic()
        path = self._save(trainer)
        if self._deadline is not None:
            self._deadline.cancel()
        if trainer.is_global_zero:
            name = signal.Signals(self._signum).name
            saved = (
                f'saved {path} in {time.monotonic() - start:.2f} s; resume with trainer.fit(..., ckpt_path="last")'
                if path is not None
                else "saved no checkpoint (the Trainer has no ModelCheckpoint: enable_checkpointing=False)"
            )
            since = (
                f", {time.monotonic() - self._requested_at:.2f} s after the signal"
                if self._requested_at is not None
                else ""
            )
            ranks = "rank" + ("s " if len(who) > 1 else " ") + ", ".join(map(str, who))
            print(
                f"zlightning: {name} received by {ranks}: all {trainer.world_size} ranks finished step "
                f"{trainer.global_step} and {saved}; exiting with status {TERMINATED_EXIT_CODE}{since}",
                file=sys.stderr,
                flush=True,
            )
        self._disarm()
        raise SystemExit(TERMINATED_EXIT_CODE)

    @staticmethod
    def _save(trainer: pl.Trainer) -> Path | None:
        """Writes ``last`` in the first ModelCheckpoint's folder (collective); None without a ModelCheckpoint."""
        callback = trainer.checkpoint_callback
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            return None
        try:
            candidates = callback._monitor_candidates(trainer)
        except Exception:  # noqa: BLE001 - a Lightning without it: the default name has no metrics in it
            candidates = {"epoch": torch.tensor(trainer.current_epoch), "step": torch.tensor(trainer.global_step)}
        path = Path(callback.format_checkpoint_name(candidates, callback.CHECKPOINT_NAME_LAST))
        trainer.save_checkpoint(path)
        callback.last_model_path = str(path)
        return path
