"""Preemption: SIGTERM during ``fit`` finishes the step in progress on every rank, saves one
checkpoint, exits with 143 within a bound, and ``ckpt_path="last"`` continues exactly (see [Note: preemption] in
``strategies/_preemption.py``). Real 2-rank ``zstack_zero3`` fits, forked from a pre-imported parent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from zlightning.strategies._launch import TERMINATE_GRACE_S, TERMINATED_EXIT_CODE
from zlightning.strategies._preemption import PREEMPT_TIMEOUT_ENV, preemption_timeout

from tests._fork_ranks import RankForker, wait_for

STEPS = 10  # 6 batches per epoch: the runs cross an epoch boundary


class ResumableBatches:
    """This rank's micro-batches in order, epoch after epoch. Lightning saves ``state_dict()`` in checkpoints and
    calls ``load_state_dict`` on resume, so a run resumed mid-epoch continues with the next batch. The position
    counts batches that training consumed (Lightning fetches one batch ahead)."""

    def __init__(self, batches: list[Any]) -> None:
        self.batches = batches
        self.start = 0
        self.consumed = 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        start, self.start = self.start, 0
        self.consumed = start
        for batch in self.batches[start:]:
            yield (batch,)

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.start = int(state["consumed"])


def _fit(rank: int, world: int, root: str, phase: str, step_s: float = 0.05) -> None:
    """One 2-rank ``zstack_zero3`` fit of ``STEPS`` steps. Rank ``r`` appends ``<global step> <loss>`` per batch to
    ``root/<phase>-rank<r>``; ``phase`` "preempted" checkpoints only through the preemption, "resumed" starts from
    ``last``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from tests._lightning_models import TinyGPTModule
    from tests._zero_models import batches

    micro = 2
    loader = ResumableBatches([b[rank * micro : (rank + 1) * micro] for b in batches(6, micro * world)])
    out = Path(root) / f"{phase}-rank{rank}"

    class Module(TinyGPTModule):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = super().training_step(batch, batch_idx)
            loader.consumed += 1
            with open(out, "a") as f:
                f.write(f"{self.trainer.global_step} {self.losses[-1]!r}\n")
            time.sleep(step_s)  # a signal then most likely lands inside a step
            return loss

    pl.seed_everything(0, verbose=False)
    callbacks = [] if phase == "straight" else [ModelCheckpoint(dirpath=Path(root) / "ckpt", save_top_k=0)]
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=phase != "straight",
    )
    trainer.fit(Module(), train_dataloaders=loader, ckpt_path="last" if phase == "resumed" else None)


def _losses(path: Path) -> list[tuple[int, float]]:
    return [(int(step), float(loss)) for step, loss in (line.split() for line in path.read_text().splitlines())]


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankForker]:
    errors = tmp_path_factory.mktemp("errors")
    with RankForker(2, env={"ZLIGHTNING_ERROR_DIR": str(errors)}) as parent:
        yield parent


@pytest.fixture(scope="module")
def straight(forker: RankForker, tmp_path_factory: pytest.TempPathFactory) -> list[list[tuple[int, float]]]:
    """Each rank's losses of an uninterrupted run."""
    root = tmp_path_factory.mktemp("straight")
    forker.start("tests.test_preemption:_fit", root / "logs", root=str(root), phase="straight", step_s=0.0)
    assert forker.wait(timeout=120) == [0, 0], (root / "logs" / "rank0.log").read_text()[-3000:]
    return [_losses(root / f"straight-rank{r}") for r in range(2)]


@pytest.mark.parametrize("signalled", [[1], [0, 1]], ids=["one rank", "every rank"])
def test_sigterm_saves_one_checkpoint_and_the_resumed_run_is_exact(
    tmp_path: Path, forker: RankForker, straight: list[list[tuple[int, float]]], signalled: list[int]
) -> None:
    forker.start("tests.test_preemption:_fit", tmp_path / "logs", root=str(tmp_path), phase="preempted")
    progress = tmp_path / "preempted-rank0"
    assert wait_for(lambda: progress.exists() and len(progress.read_text().splitlines()) >= 3, timeout=60), (
        tmp_path / "logs" / "rank0.log"
    ).read_text()[-3000:]
    start = time.monotonic()
    forker.kill(signal.SIGTERM, ranks=signalled)
    statuses = forker.wait(timeout=60)
    took = time.monotonic() - start
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert statuses == [TERMINATED_EXIT_CODE] * 2, (statuses, log[-3000:])
    print(f"[measured] SIGTERM to {signalled}: every rank exited {took:.2f} s after the signal")
    assert took < 10, took  # the step in progress and one checkpoint of a tiny model
    preempted = [_losses(tmp_path / f"preempted-rank{r}") for r in range(2)]
    stopped_at = len(preempted[0])
    assert len(preempted[1]) == stopped_at and 3 <= stopped_at < STEPS  # both ranks finished the same step
    last = tmp_path / "ckpt" / "last.ckpt"
    who = "ranks 0, 1" if len(signalled) == 2 else "rank 1"
    assert (f"SIGTERM received by {who}: all 2 ranks finished step {stopped_at} and saved {last}") in log, log[-3000:]
    assert "Traceback" not in log and (last / "meta.json").is_file()

    forker.start("tests.test_preemption:_fit", tmp_path / "logs-resumed", root=str(tmp_path), phase="resumed")
    assert forker.wait(timeout=120) == [0, 0], (tmp_path / "logs-resumed" / "rank0.log").read_text()[-3000:]
    for rank in range(2):
        resumed = _losses(tmp_path / f"resumed-rank{rank}")
        assert resumed[0][0] == stopped_at  # continues with the next step
        assert preempted[rank] + resumed == straight[rank]  # the same losses, bit for bit


def test_a_stop_that_cannot_finish_ends_at_the_deadline(tmp_path: Path) -> None:
    """A step stuck longer than ``ZLIGHTNING_PREEMPT_TIMEOUT_S``: the ranks exit with 143 at the deadline, without
    the checkpoint, and say so."""
    with RankForker(2, env={PREEMPT_TIMEOUT_ENV: "2", "ZLIGHTNING_ERROR_DIR": str(tmp_path / "errors")}) as parent:
        parent.start(
            "tests.test_preemption:_fit", tmp_path / "logs", root=str(tmp_path), phase="preempted", step_s=30.0
        )
        progress = tmp_path / "preempted-rank0"
        assert wait_for(lambda: progress.exists() and progress.read_text(), timeout=60)
        start = time.monotonic()
        parent.kill(signal.SIGTERM)
        statuses = parent.wait(timeout=60)
        took = time.monotonic() - start
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert statuses == [TERMINATED_EXIT_CODE] * 2, (statuses, log[-3000:])
    print(f"[measured] a stop stuck past its 2 s deadline: the ranks exited after {took:.2f} s")
    assert 2 <= took < 2 + TERMINATE_GRACE_S, took
    assert "did not finish within 2 s (ZLIGHTNING_PREEMPT_TIMEOUT_S); ending now without them" in log, log[-2000:]
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()


_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    sys.path.insert(0, sys.argv[2])
    import zlightning
    from tests._lightning_models import TinyGPTModule, loader

    out = Path(sys.argv[1])

    class Module(TinyGPTModule):
        def training_step(self, batch, i):
            (out / f"rank{self.global_rank}.step").write_text(str(self.global_step))
            time.sleep(0.05)
            return super().training_step(batch, i)

    trainer = pl.Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, max_steps=100000, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[ModelCheckpoint(dirpath=out / "ckpt", save_top_k=0)])
    trainer.fit(Module(), train_dataloaders=loader(64, 2, 2))
    """
)


@pytest.mark.slow
def test_sigterm_to_the_launching_process_of_a_popen_run(tmp_path: Path) -> None:
    """``python train.py`` then ``kill <pid>``: rank 0 launched rank 1 and only rank 0 gets the signal."""
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", ZLIGHTNING_ERROR_DIR=str(tmp_path / "errors"))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(Path(__file__).parents[1])],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    steps = [tmp_path / "rank0.step", tmp_path / "rank1.step"]
    if not wait_for(lambda: all(p.exists() and p.read_text() not in ("", "0") for p in steps), timeout=240):
        proc.kill()
        pytest.fail(f"training did not start: {proc.communicate()[1][-3000:]}")
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not end after SIGTERM")
    took = time.monotonic() - start
    print(f"[measured] SIGTERM to the launching process of a popen run: it exited after {took:.2f} s")
    assert proc.returncode == TERMINATED_EXIT_CODE, err[-3000:]
    assert took < 15, took
    assert "SIGTERM received: ending this run's 2 processes after the step in progress" in err, err[-3000:]
    assert "SIGTERM received by rank 0: all 2 ranks finished step" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert (tmp_path / "ckpt" / "last.ckpt" / "meta.json").is_file()
    step = json.loads((tmp_path / "ckpt" / "last.ckpt" / "meta.json").read_text())["world_size"]
    assert step == 2


def test_preemption_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREEMPT_TIMEOUT_ENV, raising=False)
    assert preemption_timeout() == 120.0
    monkeypatch.setenv(PREEMPT_TIMEOUT_ENV, "7.5")
    assert preemption_timeout() == 7.5
    for bad in ("0", "-3", "soon"):
        monkeypatch.setenv(PREEMPT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="expected a positive number of seconds"):
            preemption_timeout()
