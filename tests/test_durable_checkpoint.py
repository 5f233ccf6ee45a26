"""Durable, atomic checkpoints: the publication primitives of ``zlightning/_durable.py`` one by one,
then real 2-rank ``Trainer.fit`` runs SIGKILLed at random moments and a save that runs out of disk space."""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from zlightning import _durable
from zlightning._durable import (
    OLD_PREFIX,
    TMP_PREFIX,
    clean_leftovers,
    publish,
    recover,
    remove_durably,
    resolve,
    save_failure_message,
    temporary_name,
    write_durably,
)


# ==================================================================== the primitives (one process)
def _dir_ckpt(path: Path, text: str) -> Path:
    path.mkdir(parents=True)
    (path / "meta.json").write_text(text)
    (path / "rank_00000.pt").write_text(text * 3)
    return path


@pytest.fixture(params=["exchange", "two renames"])
def rename_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every publication test runs with ``renameat2(RENAME_EXCHANGE)`` and with the fallback of file systems that
    lack it (NFS, CIFS), which is forced here by marking every file system as unsupported."""
    if request.param == "two renames":
        monkeypatch.setattr(_durable, "_exchange", lambda a, b: False)
    return str(request.param)


def test_rename_exchange_is_used_on_this_file_system(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("A")
    b.mkdir()
    assert _durable._exchange(a, b), "renameat2(RENAME_EXCHANGE) is not available on the test machine's /tmp"
    assert a.is_dir() and b.read_text() == "A"  # a file and a directory swapped names in one step


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_publish_replaces_atomically_and_deletes_the_previous_version(
    tmp_path: Path, rename_mode: str, kind: str
) -> None:
    target = tmp_path / "last.ckpt"
    for version in ("v1", "v2", "v3"):
        tmp = temporary_name(target)
        if kind == "directory":
            _dir_ckpt(tmp, version)
        else:
            tmp.write_text(version)
        publish(tmp, target)
        content = (target / "meta.json").read_text() if kind == "directory" else target.read_text()
        assert content == version
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt"], rename_mode  # nothing left behind


def test_publish_can_replace_a_file_by_a_directory(tmp_path: Path, rename_mode: str) -> None:
    target = tmp_path / "last.ckpt"
    target.write_text("full checkpoint")
    publish(_dir_ckpt(temporary_name(target), "sharded"), target)
    assert (target / "meta.json").read_text() == "sharded"
    assert os.listdir(tmp_path) == ["last.ckpt"]


def _crash_between_the_two_renames(target: Path, new: str, keep_tmp: bool = True) -> tuple[Path, Path]:
    """What the two-rename publication leaves when the process dies after its first rename: the previous checkpoint
    under ``.zl-old.<id>.<name>``, the complete new one under ``.zl-tmp.<id>.<name>``, nothing under the name."""
    tmp = temporary_name(target)
    _dir_ckpt(tmp, new)
    token = tmp.name[len(TMP_PREFIX) :].partition(".")[0]
    old = target.parent / f"{OLD_PREFIX}{token}.{target.name.encode().hex()}"
    os.rename(target, old)
    if not keep_tmp:
        _durable._remove(tmp)
    return tmp, old


def test_resolve_and_recover_after_a_crash_between_the_two_renames(tmp_path: Path) -> None:
    target = _dir_ckpt(tmp_path / "last.ckpt", "old")
    tmp, old = _crash_between_the_two_renames(target, "new")
    assert not target.exists()
    assert resolve(target) == tmp  # the newest complete version, read-only
    assert os.path.exists(tmp) and os.path.exists(old)
    assert recover(tmp_path) == [target]
    assert (target / "meta.json").read_text() == "new"
    assert recover(tmp_path) == []  # idempotent
    clean_leftovers(tmp_path)
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_recover_falls_back_to_the_previous_version(tmp_path: Path) -> None:
    target = _dir_ckpt(tmp_path / "last.ckpt", "old")
    _, old = _crash_between_the_two_renames(target, "new", keep_tmp=False)
    assert resolve(target) == old
    recover(tmp_path)
    assert (target / "meta.json").read_text() == "old"


def test_the_next_save_recovers_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = _dir_ckpt(tmp_path / "last.ckpt", "old")
    _crash_between_the_two_renames(target, "crashed")
    stale = temporary_name(tmp_path / "epoch=0-step=3.ckpt")
    stale.write_text("incomplete")  # a save killed while writing
    monkeypatch.setattr(_durable, "_exchange", lambda a, b: False)
    write_durably(tmp_path / "other.ckpt", lambda p: p.write_text("x"))  # any save into the folder cleans up
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "other.ckpt"]
    assert (target / "meta.json").read_text() == "crashed"


def test_temporaries_never_look_like_last(tmp_path: Path) -> None:
    """Lightning's ``ckpt_path="last"`` picks the newest entry whose name starts with ``last``: a half-written
    temporary or a previous version on its way out must never be that entry."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    target = _dir_ckpt(tmp_path / "last.ckpt", "complete")
    _dir_ckpt(temporary_name(target), "half-written")
    _dir_ckpt(temporary_name(tmp_path / "last-v1.ckpt"), "half-written")
    _crash_between_the_two_renames(_dir_ckpt(tmp_path / "last-v2.ckpt", "v2"), "v2 new")
    for name in os.listdir(tmp_path):
        if name.startswith(".zl-"):
            assert "last" not in name and not name.endswith(".ckpt"), name
    callback = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    found = callback._find_last_checkpoints(SimpleNamespace())
    assert found == {str(target)}, found  # last-v2.ckpt is missing until recovered
    recover(tmp_path)
    found = callback._find_last_checkpoints(SimpleNamespace())
    assert found == {str(target), str(tmp_path / "last-v2.ckpt")}


def test_write_durably_leaves_the_previous_file_when_writing_fails(tmp_path: Path) -> None:
    target = tmp_path / "last.ckpt"
    write_durably(target, lambda p: p.write_text("v1"))

    def full_disk(path: Path) -> None:
        path.write_text("partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_durably(target, full_disk)
    assert target.read_text() == "v1"
    assert os.listdir(tmp_path) == ["last.ckpt"]


def test_remove_durably(tmp_path: Path) -> None:
    target = _dir_ckpt(tmp_path / "epoch=0-step=1.ckpt", "x")
    remove_durably(target)
    remove_durably(target)  # already gone: nothing to do
    assert os.listdir(tmp_path) == []


def test_save_failure_message_says_what_is_on_disk_and_what_to_do(tmp_path: Path) -> None:
    err = OSError(errno.ENOSPC, "No space left on device")
    text = save_failure_message(tmp_path / "last.ckpt", "rank 1", err, existed=True)
    assert "failed on rank 1" in text and "No space left on device" in text
    assert "previous checkpoint" in text and "unchanged and loadable" in text
    assert "MiB are free" in text and "ModelCheckpoint(dirpath=...)" in text
    text = save_failure_message(tmp_path / "last.ckpt", "rank 0", ValueError("bad"), existed=False)
    assert "no checkpoint was written" in text and "MiB" not in text


# ==================================================================== SIGKILL at random moments (2 real ranks)
def _fit_saving_every_step(rank: int, world: int, root: str, fmt: str, resume: bool) -> None:
    """A 2-rank ``zstack_zero3`` fit that saves ``last`` (and the newest top-1 checkpoint) after every step and
    runs until it is killed. Rank 0 appends ``start <step>`` and ``step <step>`` lines to ``root/progress``."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from zlightning.strategies import ZStackZero3Strategy

    from tests._lightning_models import TinyGPTModule, loader
    from zlightning.zero import CheckpointPolicy

    progress = Path(root) / "progress"

    class Progress(Callback):
        def _note(self, text: str) -> None:
            if rank == 0:
                with open(progress, "a") as f:
                    f.write(text + "\n")

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self._note(f"start {trainer.global_step}")

        def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
            self._note(f"step {trainer.global_step}")  # the save of the step before has completed

    pl.seed_everything(0, verbose=False)
    strategy = ZStackZero3Strategy(checkpoint=CheckpointPolicy(state_dict_type=fmt))  # type: ignore[arg-type]
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=10**6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Progress(), ModelCheckpoint(dirpath=Path(root) / "ckpt", every_n_train_steps=1, save_last=True)],
    )
    trainer.fit(TinyGPTModule(), train_dataloaders=loader(500, 2, world), ckpt_path="last" if resume else None)


def _saving(folder: Path) -> bool:
    """Whether a save's temporary (``.zl-*``) is in ``folder``: a save has begun and not yet been published."""
    try:
        return any(p.name.startswith(".zl-") for p in folder.iterdir())
    except FileNotFoundError:
        return False


def _last_step(last: Path) -> int:
    """Checks that ``last`` is a complete checkpoint (every file, checksums, ``zlightning consolidate``) and returns
    its global step."""
    import torch

    from zlightning.zero import consolidate, is_sharded_checkpoint

    if is_sharded_checkpoint(last):
        out = last.parent.parent / "consolidated.pt"
        consolidate(last, out, progress=False)
        weights = torch.load(out, weights_only=True)
        if not any(k.endswith("weight") for k in weights):
            raise AssertionError(f"consolidate wrote no weights: {sorted(weights)[:5]}")
        client = torch.load(last / "client_state.pt", weights_only=True)
        return int(client["global_step"])
    checkpoint = torch.load(last, weights_only=True)  # a full, single-file Lightning checkpoint
    if not checkpoint["state_dict"] or len(checkpoint["optimizer_states"]) != 1:
        raise AssertionError(f"incomplete full checkpoint: {sorted(checkpoint)}")
    return int(checkpoint["global_step"])


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests._fork_ranks import RankForker

    errors = tmp_path_factory.mktemp("errors")
    with RankForker(2, env={"ZLIGHTNING_ERROR_DIR": str(errors)}) as parent:
        yield parent


@pytest.mark.slow
def test_sigkill_at_random_moments_always_leaves_a_loadable_last(tmp_path: Path, forker: Any) -> None:
    """24 SIGKILLs of both ranks of a fit that saves every step (a node losing power), at random moments: while it
    starts, loads ``last``, trains or saves. After each kill ``last`` is complete (consolidated, every checksum), never
    older than the newest save that finished, and the next run resumes from exactly its step. One run in three
    writes full single-file checkpoints, so ``last`` also changes between a file and a directory."""
    import random
    import signal
    import subprocess
    import sys

    from tests._fork_ranks import wait_for

    rng = random.Random(18)
    root = tmp_path / "run"
    root.mkdir()
    last = root / "ckpt" / "last.ckpt"
    progress = root / "progress"
    verified = -1  # the step of the newest checkpoint seen complete
    kills = mid_save = 0  # mid_save: kills that left a save's temporary behind
    for round_ in range(24):
        final = round_ == 23  # saves a sharded checkpoint for the command line below
        fmt = "full" if round_ % 3 == 1 and not final else "sharded"
        progress.write_text("")
        forker.start(
            "tests.test_durable_checkpoint:_fit_saving_every_step",
            tmp_path / "logs" / str(round_),
            root=str(root),
            fmt=fmt,
            resume=round_ > 0,
        )
        moment = rng.random()
        if moment < 0.2 and not final:  # while starting, rendezvousing or loading `last`
            time.sleep(rng.uniform(0.0, 1.5))
        else:
            started = wait_for(lambda: progress.read_text().count("step") >= 1 + final, timeout=60)
            assert started, (tmp_path / "logs" / str(round_) / "rank0.log").read_text()[-3000:]
            if moment < 0.6 and not final:  # the moment a save has begun writing (not left to chance)
                wait_for(lambda: _saving(last.parent), timeout=20, interval=0.001)
                time.sleep(rng.uniform(0.0, 0.01))
            else:
                time.sleep(rng.uniform(0.0, 0.6))
        forker.kill(signal.SIGKILL)
        statuses = forker.wait(timeout=30)
        assert statuses == [-signal.SIGKILL] * 2, (
            statuses,
            (tmp_path / "logs" / str(round_) / "rank0.log").read_text()[-3000:],
        )
        kills += 1
        folder = last.parent
        mid_save += _saving(folder)
        lines = progress.read_text().split()
        starts = [int(lines[i + 1]) for i, word in enumerate(lines) if word == "start"]
        steps = [int(lines[i + 1]) for i, word in enumerate(lines) if word == "step"]
        if starts:
            assert starts[0] == max(verified, 0), (round_, starts, verified)  # resumed exactly from `last`
        if verified < 0 and (not steps or steps[-1] <= 1) and not last.exists():
            continue  # no save had finished yet ("step 1" follows the first step, before its save)
        assert not any(p.name.startswith("last") for p in last.parent.iterdir() if p != last)
        step = _last_step(last)
        assert step >= max(verified, (steps[-1] - 1) if steps else 0), (round_, step, verified, steps[-1:])
        verified = step
    print(f"[measured] {kills} SIGKILLs, {mid_save} during a save; last always complete; newest step {verified}")
    assert kills == 24 and verified > 0
    assert mid_save >= 5, f"only {mid_save} of {kills} kills interrupted a save"
    if not (last / "meta.json").is_file():
        raise AssertionError("the last run did not write a sharded checkpoint")
    cli = Path(sys.executable).parent / "zlightning"
    done = subprocess.run(
        [str(cli), "consolidate", str(last), str(tmp_path / "model.pt")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]


# ==================================================================== a full disk during a save (2 real ranks)
def _fit_until_the_disk_is_full(rank: int, world: int, root: str, fmt: str) -> None:
    """Saves ``last`` after every step into ``root/disk/ckpt`` (a small tmpfs); before the second save, rank 0 fills
    the file system to half a checkpoint's size. Each rank writes what ``fit`` raised to ``root/result<rank>.json``."""
    import json
    import shutil

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from zlightning.strategies import ZStackZero3Strategy

    from tests._lightning_models import TinyGPTModule, loader
    from zlightning.zero import CheckpointPolicy

    disk = Path(root) / "disk"
    last = disk / "ckpt" / "last.ckpt"

    class FillDisk(Callback):
        def on_train_batch_start(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
        ) -> None:
            if batch_idx == 1 and rank == 0:
                size = sum(p.stat().st_size for p in last.rglob("*")) if last.is_dir() else last.stat().st_size
                fd = os.open(disk / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
                os.posix_fallocate(fd, 0, shutil.disk_usage(disk).free - size // 2)
                os.close(fd)

    strategy = ZStackZero3Strategy(checkpoint=CheckpointPolicy(state_dict_type=fmt))  # type: ignore[arg-type]
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            FillDisk(),
            ModelCheckpoint(dirpath=last.parent, every_n_train_steps=1, save_last=True, save_top_k=0),
        ],
    )
    try:
        trainer.fit(TinyGPTModule(), train_dataloaders=loader(8, 2, world))
        outcome = {"raised": None, "step": trainer.global_step}
    except Exception as err:  # noqa: BLE001 - reported to the test
        outcome = {"raised": type(err).__name__, "message": str(err), "step": trainer.global_step}
    (Path(root) / f"result{rank}.json").write_text(json.dumps(outcome))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs (a real full file system: ENOSPC from the kernel), unmounted afterwards."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(disk)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({done.stderr.decode().strip()}); test_write_durably_leaves_the_"
            "previous_file_when_writing_fails and test_zero3_checkpoint's simulated ENOSPC cover the logic"
        )
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(
    tmp_path: Path, small_disk: Path, forker: Any, fmt: str
) -> None:
    import json

    forker.start(
        "tests.test_durable_checkpoint:_fit_until_the_disk_is_full", tmp_path / "logs", root=str(tmp_path), fmt=fmt
    )
    statuses = forker.wait(timeout=120)
    assert statuses == [0, 0], (statuses, (tmp_path / "logs" / "rank0.log").read_text()[-3000:])
    last = small_disk / "ckpt" / "last.ckpt"
    for rank in range(2):
        outcome = json.loads((tmp_path / f"result{rank}.json").read_text())
        assert outcome["raised"] == "CheckpointSaveError" and outcome["step"] == 2, outcome
        text = outcome["message"]
        assert f"saving the checkpoint {last} failed on rank" in text, text
        assert "No space left on device" in text, text
        assert f"the previous checkpoint at {last} is unchanged and loadable" in text, text
        assert "MiB are free on that file system now" in text and "ModelCheckpoint(dirpath=...)" in text, text
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]  # the partial files were removed
    assert _last_step(last) == 1
