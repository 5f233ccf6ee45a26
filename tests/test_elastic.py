"""Elastic restart (issue 18): ``examples/elastic.py`` under ``torchrun --max-restarts``: a worker SIGKILLed mid-run
makes torchrun restart the workers, which continue from ``last`` and finish the run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests._fork_ranks import wait_for

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_torchrun_restarts_a_killed_worker_from_last(tmp_path: Path) -> None:
    out = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", ZLIGHTNING_ERROR_DIR=str(tmp_path / "errors"))
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
         str(ROOT / "examples" / "elastic.py"), "--out", str(out), "--max-steps", "40", "--save-every", "5"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    meta = out / "checkpoints" / "last.ckpt" / "client_state.pt"
    try:
        assert wait_for(meta.exists, timeout=240), "no checkpoint was written"
        time.sleep(1.0)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[1]), signal.SIGKILL)  # a worker dies: torchrun tears the group down and restarts it
        log, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, log[-4000:]
    restored = re.findall(r"Restoring states from the checkpoint path at (\S+)", log)
    assert restored and restored[-1].endswith("last.ckpt"), log[-4000:]
    import torch

    client = torch.load(meta, weights_only=True)
    assert client["global_step"] == 40, client["global_step"]
