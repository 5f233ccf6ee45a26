"""What a new user meets in the first hour, beyond the README's code (tests/test_readme_snippets.py) and the command
line (tests/test_cli.py): SIGTERM ends every rank, a failed rank prints one short error, a missing NVMe mount is
refused, sizes read as written, and the pipeline example config builds."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from zlightning.strategies._launch import TERMINATE_GRACE_S, TERMINATED_EXIT_CODE, summarize

from zlightning.zero import NVMeOffload, ZeroConfig
from zlightning.zero._config import Bytes, Elements
from zlightning.zero._swap_io import SwapPathError, check_swap_path

ROOT = Path(__file__).resolve().parents[1]

# A 2-process zstack_zero3 run of the example GPT (popen launcher: the script is re-run for rank 1). Each rank writes
# "<dir>/rank<r>.pid" when it starts its third batch; FAIL_RANK makes that rank raise in its first training step.
_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import lightning.pytorch as pl
    import zlightning
    from zlightning.datamodules import TextCorpusDataModule
    from zlightning.models import GPTLightningModule

    out, fail_rank = sys.argv[1], int(sys.argv[2])

    class Model(GPTLightningModule):
        def training_step(self, batch, i):
            if self.global_rank == fail_rank:
                raise ValueError(f"planted failure on rank {fail_rank}")
            if i == 2:
                with open(os.path.join(out, f"rank{self.global_rank}.pid"), "w") as f:
                    f.write(str(os.getpid()))
            return super().training_step(batch, i)

    model = Model(seq_len=32, d_model=32, n_layer=1, n_head=2)
    trainer = pl.Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, max_steps=100000, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(model, datamodule=TextCorpusDataModule(seq_len=32, batch_size=2, max_bytes=50_000))
    """
)


def _start(tmp_path: Path, fail_rank: int) -> subprocess.Popen[str]:
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", ZLIGHTNING_ERROR_DIR=str(tmp_path / "errors"))
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(fail_rank)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_to_the_launcher_ends_every_rank(tmp_path: Path) -> None:
    proc = _start(tmp_path, fail_rank=-1)
    pids = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
    deadline = time.monotonic() + 240
    while not all(p.exists() and p.read_text() for p in pids):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"training did not start (rc {proc.returncode}):\n{out[-2000:]}\n{err[-3000:]}")
        time.sleep(0.5)
    ranks = [int(p.read_text()) for p in pids]
    assert ranks[0] == proc.pid  # popen: rank 0 is the launching process
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)  # the launching process only, as `kill PID` does
    try:
        _, err = proc.communicate(timeout=TERMINATE_GRACE_S + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the launching process did not end after SIGTERM")
    while _alive(ranks[1]) and time.monotonic() - start < TERMINATE_GRACE_S + 30:
        time.sleep(0.2)
    assert not _alive(ranks[1]), "rank 1 outlived the launching process"
    assert time.monotonic() - start < TERMINATE_GRACE_S + 30
    assert proc.returncode == TERMINATED_EXIT_CODE, err[-3000:]
    assert "SIGTERM received: ending this run's 2 processes" in err
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_a_failed_rank_prints_one_short_error(tmp_path: Path) -> None:
    proc = _start(tmp_path, fail_rank=1)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not end after rank 1 failed")
    assert proc.returncode != 0
    assert err.count("zlightning: rank 1 of 2 failed: ValueError: planted failure on rank 1") == 1, err[-4000:]
    assert "Traceback" not in err and "[rank1]" not in err, err[-4000:]
    after = err[err.index("zlightning: rank 1 of 2 failed") :].splitlines()
    summary = [after[0], *[line for line in after[1:4] if line.startswith("  ")]]  # other processes may interleave
    assert len(summary) <= 4 and "rank<r>.log" in summary[-1], after[:6]
    folder = Path(summary[-1].split(": ", 1)[1].split("/rank<r>.log")[0])
    assert folder.parent == tmp_path / "errors" and folder.name.startswith("run-"), summary[-1]
    log = folder / "rank1.log"
    assert "Traceback" in log.read_text() and "planted failure on rank 1" in log.read_text()


def test_summary_names_the_rank_the_cause_and_where() -> None:
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as cause:
            raise RuntimeError("swap write failed") from cause
    except RuntimeError as err:
        text = summarize(err, 3, 8, Path("/tmp/errors"))
    lines = text.splitlines()
    assert lines[0] == "zlightning: rank 3 of 8 failed: RuntimeError: swap write failed"
    assert "caused by OSError: [Errno 28] No space left on device" in lines[1]
    assert "raised at" in lines[2] and "test_first_hour.py" in lines[2]
    assert "/tmp/errors/rank<r>.log" in lines[3]


def test_nvme_path_with_a_missing_parent_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "nvme" / "swap"  # as if /local/nvme were not mounted
    with pytest.raises(SwapPathError, match=r"does not exist, and neither does its parent folder .*nvme.*mkdir -p"):
        check_swap_path(NVMeOffload(path=str(missing), direct_io="off"), 4096)
    assert not (tmp_path / "nvme").exists(), "nothing may be created on the wrong disk"
    (tmp_path / "nvme").mkdir()
    with caplog.at_level(logging.INFO, logger="zlightning"):
        root, _ = check_swap_path(NVMeOffload(path=str(missing), direct_io="off"), 4096)
    assert root == missing and missing.is_dir()  # the last folder alone is created
    assert f"swap files go to {missing}, on " in caplog.text and "GiB free" in caplog.text


def test_sizes_read_as_written() -> None:
    config = ZeroConfig(
        prefetch_bucket_size="50M", reduce_bucket_size=5e7, max_live_parameters="1e9", host_mmap_threshold="1MiB"
    )
    assert (config.prefetch_bucket_size, config.reduce_bucket_size) == (50_000_000, 50_000_000)
    assert config.max_live_parameters == 10**9 and config.host_mmap_threshold == 2**20
    assert int(Elements("64Mi")) == 2**26 and int(Bytes("200MB")) == 200_000_000
    with pytest.raises(ValueError, match=r"ZeroConfig.prefetch_bucket_size: '200MB' is a byte size"):
        ZeroConfig(prefetch_bucket_size="200MB")
    with pytest.raises(ValueError, match=r"ZeroConfig.reduce_bucket_size: 1.5 is not a whole number"):
        ZeroConfig(reduce_bucket_size=1.5)


@pytest.mark.parametrize("config", ["examples/gpt_pipeline.yaml", "examples/gpt_zero3.yaml"])
def test_example_config_builds(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from zlightning.cli import _CLI

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", ["zlightning"])
    cli = _CLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        run=False,
        args=["--config", config, "--trainer.logger=false", "--data.max_bytes=100000"],
    )
    expected = "GPTPipelineModule" if "pipeline" in config else "GPTLightningModule"
    assert type(cli.model).__name__ == expected and type(cli.model).__module__.startswith("zlightning.models")
    checkpoints = [c for c in cli.trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert checkpoints and checkpoints[0].save_last, "the example must keep last.ckpt for `zlightning consolidate`"
    assert cli.trainer.log_every_n_steps <= 10


@pytest.mark.slow
def test_spawn_start_method_returns_full_weights_to_the_main_process(tmp_path: Path) -> None:
    script = tmp_path / "spawn_fit.py"
    script.write_text(
        textwrap.dedent(
            """
        import lightning.pytorch as pl
        import torch
        import zlightning
        from zlightning.datamodules import TextCorpusDataModule
        from zlightning.models import GPTLightningModule
        from zlightning.strategies import ZStackZero3Strategy

        if __name__ == "__main__":
            model = GPTLightningModule(seq_len=32, d_model=32, n_layer=1, n_head=2)
            before = model.model.head.weight.detach().clone()
            trainer = pl.Trainer(strategy=ZStackZero3Strategy(start_method="spawn"), accelerator="cpu", devices=2,
                                 max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0,
                                 enable_progress_bar=False)
            trainer.fit(model, datamodule=TextCorpusDataModule(seq_len=32, batch_size=2, max_bytes=50_000))
            after = model.model.head.weight
            assert after.shape == before.shape and not torch.equal(after, before), "main process got no weights"
            print("FULL WEIGHTS BACK")
        """
        )
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0 and "FULL WEIGHTS BACK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
