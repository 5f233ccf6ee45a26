"""Many short multi-rank runs without paying Python's and torch's import time for each: a parent process imports
torch, Lightning and zlightning once, then forks the ranks of each run on request.

[Note: why fork ranks from a pre-imported parent]
The durability and preemption tests start a 2-rank ``Trainer.fit`` dozens of times and SIGKILL it at random
moments. A fresh ``python`` per rank spends about 5 s of a 2-core machine importing torch and Lightning before the
first step, which would make 30 kills take minutes. Here one parent (`RankForker`) imports everything, runs no torch
op (so no intra-op thread pool exists to be broken by ``fork``), and forks the ranks of each run: each rank sets the
variables ``torchrun`` sets (so Lightning takes the ranks as launched externally and starts none itself), joins a
fresh rendezvous port and runs the requested function, which builds a real ``Trainer`` as a user's script does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "import torch, lightning.pytorch, zlightning, tests._lightning_models; "
    "from tests._fork_ranks import _serve; _serve()"
)


class RankForker:
    """The pre-imported parent (see [Note: why fork ranks from a pre-imported parent])."""

    def __init__(self, world_size: int = 2, env: dict[str, str] | None = None) -> None:
        self.world_size = world_size
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, str(ROOT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
        )
        self.pids: list[int] = []

    def start(
        self,
        target: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        rank_env: list[dict[str, str]] | None = None,
        torchrun_env: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Forks the ranks of one run of ``target`` (``"module:function"``, called as ``fn(rank, world, **kwargs)``);
        rank ``r`` writes its output to ``log_dir/rank<r>.log``. Returns the ranks' process ids.

        Args:
            env: variables for every rank; ``rank_env``: for each rank.
            torchrun_env: set ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/... as torchrun does (False: only
                ``MASTER_ADDR``/``MASTER_PORT``, for tests that set another launcher's variables).
        """
        command = {
            "target": target,
            "kwargs": kwargs,
            "log_dir": str(log_dir),
            "env": env or {},
            "rank_env": rank_env or [{}] * self.world_size,
            "torchrun": torchrun_env,
            "world_size": self.world_size,
        }
        self._send(command)
        self.pids = [int(p) for p in self._read(120.0).split()[1:]]
        return self.pids

    def kill(self, signum: int = signal.SIGKILL, ranks: list[int] | None = None) -> None:
        for r in ranks if ranks is not None else range(len(self.pids)):
            try:
                os.kill(self.pids[r], signum)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> list[int]:
        """The ranks' exit statuses (negative: killed by that signal). SIGKILLs them after ``timeout`` seconds."""
        try:
            line = self._read(timeout)
        except TimeoutError:
            self.kill()
            line = self._read(30.0)
            statuses = [int(s) for s in line.split()[1:]]
            raise TimeoutError(
                f"the run did not end within {timeout:.0f} s (statuses after SIGKILL: {statuses})"
            ) from None
        return [int(s) for s in line.split()[1:]]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._send({"quit": True})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> RankForker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def _read(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no answer from the rank forker within {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank forker exited (status {self.proc.wait()})")
        return line.strip()


def _serve() -> None:
    """The forker's loop: one JSON command per line on stdin, answers on stdout."""
    from zlightning.testing import find_free_port

    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            return
        port = find_free_port()
        pids = []
        for rank in range(command["world_size"]):
            pid = os.fork()
            if pid == 0:
                _rank(command, rank, port)  # never returns
            pids.append(pid)
        print("pids", *pids, flush=True)
        statuses = []
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            statuses.append(os.waitstatus_to_exitcode(status))
        print("exited", *statuses, flush=True)


def _rank(command: dict[str, Any], rank: int, port: int) -> None:
    code = 1
    try:
        world = int(command["world_size"])
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if command["torchrun"]:
            os.environ.update(
                WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", LOCAL_WORLD_SIZE=str(world)
            )
        os.environ.update(**command["env"], **command["rank_env"][rank])
        log_dir = Path(command["log_dir"])
        log_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(log_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdin.close()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import importlib

        import torch

        torch.set_num_threads(1)
        module, _, name = command["target"].partition(":")
        fn = getattr(importlib.import_module(module), name)
        fn(rank, world, **command["kwargs"])
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported in the rank's log; the exit status tells the test
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def wait_for(predicate: Any, timeout: float, interval: float = 0.02) -> bool:
    """Polls ``predicate()`` until it is true or ``timeout`` seconds passed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
