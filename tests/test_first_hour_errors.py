"""Errors and warnings a new user meets in the first hour: a mistyped strategy name gets the closest registered names,
a rank's failure inside torch names the user's own line first, each failed run gets an error folder of its own, and
more CPU processes than cores is said once, with its cost."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from zlightning.strategies._launch import ERROR_RUNS_KEPT_ENV, prune_error_runs, summarize

from zlightning._oversubscription import oversubscription_message

# A tiny 2-parameter-tensor model trained under zstack_zero3 (popen launcher: the script is re-run for each extra
# rank). argv: mode ("fail": every rank's training_step gives its Linear(5, 3) an input of 3 features), devices,
# cores (the CPU affinity the script gives itself before importing torch; 0 keeps the machine's).
_SCRIPT = textwrap.dedent(
    """
    import os, sys

    mode, devices, cores = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if cores:
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])

    import lightning.pytorch as pl
    import torch
    import zlightning
    from torch.utils.data import DataLoader, TensorDataset


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(5, 3)

        def training_step(self, batch, i):
            (x,) = batch
            if mode == "fail":
                x = x[:, :3]
            return self.proj(x).sum()  # the user's line

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    trainer = pl.Trainer(strategy="zstack_zero3", accelerator="cpu", devices=devices, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), DataLoader(TensorDataset(torch.randn(32, 5)), batch_size=4))
    print("FIT DONE")
    """
)
_USER_LINE = 1 + _SCRIPT.splitlines().index("        return self.proj(x).sum()  # the user's line")


def _env(**extra: str) -> dict[str, str]:
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "NODE_RANK", "OMP_NUM_THREADS", "ZLIGHTNING_ERROR_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def _run(tmp_path: Path, *args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ==================================================================== a mistyped strategy name
_TYPO = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "zlightning-first":
        import zlightning
        import lightning.pytorch as pl
    elif sys.argv[1] == "lightning-first":
        import lightning.pytorch as pl
        import zlightning
    elif sys.argv[1] == "strategies-first":
        from zlightning.strategies import ZStackZero3Strategy
        import lightning.pytorch as pl
    else:
        import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    for strategy in sys.argv[2:]:
        try:
            trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
        except ValueError as err:
            print(f"<<<{strategy}>>>{type(err).__name__}: {err}<<<end>>>")
        else:
            print(f"<<<{strategy}>>>ok {type(trainer.strategy).__name__}<<<end>>>")
    trainer = pl.Trainer(strategy=DDPStrategy(), accelerator="cpu", devices=1, logger=False)
    print("<<<instance>>>ok", type(trainer.strategy).__name__)
    """
)


def _try_strategies(tmp_path: Path, order: str, *names: str) -> dict[str, str]:
    script = tmp_path / "typo.py"
    script.write_text(_TYPO)
    proc = subprocess.run(
        [sys.executable, str(script), order, *names],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0 and "<<<instance>>>ok DDPStrategy" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    blocks = [b.split("<<<end>>>")[0] for b in proc.stdout.split("<<<")[1:] if ">>>" in b and not b.startswith("end")]
    return dict(b.split(">>>", 1) for b in blocks)


@pytest.mark.parametrize("order", ["zlightning-first", "lightning-first", "strategies-first"])
def test_mistyped_strategy_name_suggests_the_registered_one(tmp_path: Path, order: str) -> None:
    found = _try_strategies(tmp_path, order, "zstack_zer03", "zstack_pipline", "dpp", "zstack_zero3", "ddp", "auto")
    message = found["zstack_zer03"]
    lines = message.splitlines()
    assert (
        lines[0].startswith("UnknownStrategyError: ")
        and "'zstack_zer03'" in lines[0]
        and "did you mean 'zstack_zero3'" in lines[0]
    ), message
    assert len(lines) < 8, message
    for name in ("zstack_zero3_offload", "zstack_zero3_nvme", "zstack_zero2", "zstack_zero1", "zstack_pipeline"):
        assert name in message, message  # a zstack-like name gets every zstack strategy
    assert "did you mean 'zstack_pipeline'" in found["zstack_pipline"]
    assert "did you mean 'ddp'" in found["dpp"] and len(found["dpp"].splitlines()) < 8
    # registered names and "auto" are Lightning's business, unchanged
    assert found["zstack_zero3"] == "ok ZStackZero3Strategy" and found["ddp"] == "ok DDPStrategy"
    assert found["auto"].startswith("ok ")


def test_lightning_alone_keeps_its_own_message(tmp_path: Path) -> None:
    found = _try_strategies(tmp_path, "lightning-only", "zstack_zer03", "ddp")
    assert found["zstack_zer03"].startswith("ValueError: You selected an invalid strategy name"), found
    assert found["ddp"] == "ok DDPStrategy"


# ==================================================================== a failed rank names the user's line
def test_summary_names_the_user_frame_before_the_torch_frame() -> None:
    layer = torch.nn.Linear(5, 3)
    try:
        layer(torch.zeros(4, 3))  # the caller's line
    except RuntimeError as err:
        text = summarize(err, 1, 2, Path("/tmp/errors/run-1"))
    lines = text.splitlines()
    here = next(i for i, line in enumerate(lines) if f"{Path(__file__).name}:" in line)
    there = next(i for i, line in enumerate(lines) if "torch/nn/modules/" in line)
    assert here < there, text
    assert "in test_summary_names_the_user_frame_before_the_torch_frame" in lines[here], text
    assert "layer(torch.zeros(4, 3))" in lines[here], text


def test_summary_of_an_error_in_user_code_names_one_place() -> None:
    try:
        raise KeyError("missing column")
    except KeyError as err:
        text = summarize(err, 0, 2)
    where = [line for line in text.splitlines() if f"{Path(__file__).name}:" in line]
    assert len(where) == 1 and where[0].startswith("  raised at "), text


@pytest.mark.slow
def test_each_failed_run_names_the_user_line_and_gets_its_own_folder(tmp_path: Path) -> None:
    errors = tmp_path / "errors"
    folders = []
    for attempt in range(2):  # the same ZLIGHTNING_ERROR_DIR twice, as a user's environment would keep it
        proc = _run(tmp_path, "fail", "2", "0", ZLIGHTNING_ERROR_DIR=str(errors))
        err = proc.stderr
        assert proc.returncode != 0, err[-3000:]
        assert err.count("RuntimeError: mat1 and mat2 shapes cannot be multiplied") == 1, (attempt, err[-4000:])
        after = err[err.index("zlightning: rank ") :].splitlines()
        user = next(i for i, line in enumerate(after) if f"run.py:{_USER_LINE} in training_step" in line)
        torch_frame = next(i for i, line in enumerate(after) if "torch/nn/modules/linear.py" in line)
        assert user < torch_frame <= 4, after[:6]
        folder = Path(next(line for line in after if "rank<r>.log" in line).split(": ", 1)[1].split("/rank<r>.log")[0])
        assert folder.parent == errors, folder
        assert "mat1 and mat2" in "".join(p.read_text() for p in folder.glob("rank*.log"))
        folders.append(folder)
    assert folders[0] != folders[1]
    assert sorted(p for p in errors.iterdir()) == sorted(folders)


def test_old_error_runs_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    runs = []
    for i in range(14):
        run = tmp_path / f"run-20250101-0000{i:02d}-{4_000_000 + i}"  # pids no process has
        run.mkdir()
        (run / "rank0.log").write_text("Traceback ...")
        os.utime(run, (now - 1000 + i, now - 1000 + i))
        runs.append(run)
    alive = tmp_path / f"run-20240101-000000-{os.getpid()}"  # the oldest, but its launching process still runs
    alive.mkdir()
    os.utime(alive, (now - 5000, now - 5000))
    (tmp_path / "notes.txt").write_text("not a run folder")
    (tmp_path / "mine").mkdir()

    prune_error_runs(tmp_path, current=runs[0])
    left = {p.name for p in tmp_path.iterdir()}
    assert left == {p.name for p in runs[-9:]} | {runs[0].name, alive.name, "notes.txt", "mine"}, sorted(left)

    monkeypatch.setenv(ERROR_RUNS_KEPT_ENV, "3")
    prune_error_runs(tmp_path, current=runs[-1])
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in runs[-3:]} | {alive.name, "notes.txt", "mine"}


def test_ranks_started_by_another_tool_share_one_run_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zlightning.strategies._launch import _error_dir

    for name in ("ZLIGHTNING_ERROR_RUN", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ZLIGHTNING_ERROR_DIR", str(tmp_path))
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert _error_dir() == tmp_path / f"run-port29511-{os.getppid()}"  # torchrun's ranks share their parent
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert _error_dir() == tmp_path / "run-restart2-torchrun-job_7"  # every node of the rendezvous, each attempt
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_STEP_ID", "3")
    assert _error_dir() == tmp_path / "run-restart2-slurm4242.3"
    monkeypatch.setenv("ZLIGHTNING_ERROR_RUN", "run-20250101-000000-77")  # named by a zlightning launcher
    assert _error_dir() == tmp_path / "run-20250101-000000-77"


# ==================================================================== more CPU processes than cores
@pytest.mark.slow
def test_four_cpu_processes_on_one_core_warn_once(tmp_path: Path) -> None:
    proc = _run(tmp_path, "ok", "4", "1", timeout=480)
    assert proc.returncode == 0 and "FIT DONE" in proc.stdout, proc.stderr[-4000:]
    assert proc.stderr.count("4 CPU processes (devices=4) on 1 usable core") == 1, proc.stderr[-4000:]
    assert "about 4x" in proc.stderr and "Use devices=1" in proc.stderr, proc.stderr[-4000:]


@pytest.mark.slow
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable cores")
def test_two_cpu_processes_on_two_cores_do_not_warn(tmp_path: Path) -> None:
    proc = _run(tmp_path, "ok", "2", "2")
    assert proc.returncode == 0 and "FIT DONE" in proc.stdout, proc.stderr[-4000:]
    assert "CPU process" not in proc.stderr and "usable core" not in proc.stderr, proc.stderr[-4000:]


def test_oversubscription_message_counts_processes_and_threads() -> None:
    assert oversubscription_message(processes=2, threads=1, cores=2) is None
    assert oversubscription_message(processes=2, threads=None, cores=8) is None  # Lightning gives each 4 threads
    processes = oversubscription_message(processes=8, threads=None, cores=2)
    assert processes is not None and processes.startswith("8 CPU processes (devices=8) on 2 usable cores")
    assert "about 4x" in processes and "devices=2" in processes and "thread" not in processes
    threads = oversubscription_message(processes=2, threads=4, cores=2)
    assert threads is not None and "2 CPU processes x 4 torch threads (OMP_NUM_THREADS=4)" in threads
    assert "8 threads on 2 usable cores" in threads and "OMP_NUM_THREADS=1" in threads
    both = oversubscription_message(processes=4, threads=2, cores=2)
    assert both is not None and "about 2x" in both and "OMP_NUM_THREADS=2" in both
