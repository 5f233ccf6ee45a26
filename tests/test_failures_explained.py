"""Failures and hangs that explain themselves: a SIGKILLed peer is named with how it ended and
what this rank was doing, diverging ZeRO-3 control flow (an extra forward, a skipped module) raises on every rank
naming the first divergence, and a pipeline stage whose peer stops sending names the peer stage and the action
(see ``zlightning/_watchdog.py``). Real 2-rank fits forked from a pre-imported parent, watchdog timeout 3 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._fork_ranks import RankForker, wait_for
from zlightning._watchdog import WATCHDOG_TIMEOUT_ENV, Record, first_divergence, watchdog_timeout

TIMEOUT_S = 3


# ==================================================================== the verdict (one process)
def _records(*keys: tuple[str, str, str, int], start: int = 1) -> list[dict[str, Any]]:
    return [
        Record(start + i, op, unit, phase, pass_id, 7).__dict__ for i, (op, unit, phase, pass_id) in enumerate(keys)
    ]


def test_first_divergence_names_the_collective_and_what_each_rank_did() -> None:
    a = ("all-gather", "blocks.0", "forward", 3)
    b = ("all-gather", "blocks.1", "forward", 3)
    reports = {0: {"records": _records(a, b, b), "where": "x.py:1"}, 1: {"records": _records(a, b, a), "where": "y"}}
    text = first_divergence(reports, 2)
    assert "diverge at collective #3" in text, text
    assert (
        "rank 0 issued all-gather of unit 'blocks.1' (forward, pass 3, step 7) (its 2nd all-gather of that "
        "unit in this forward pass)"
    ) in text, text
    assert "rank 1 issued all-gather of unit 'blocks.0' (forward, pass 3, step 7)" in text, text


def test_first_divergence_when_one_rank_stopped_and_when_all_agree() -> None:
    a = ("all-gather", "blocks.0", "forward", 3)
    b = ("reduce-scatter", "blocks.0", "backward", 3)
    behind = {0: {"records": _records(a, b), "where": "a"}, 1: {"records": _records(a), "where": "train.py:9 in f"}}
    text = first_divergence(behind, 2)
    assert "rank 1 issued nothing more after #1, all-gather of unit 'blocks.0'" in text, text
    assert "it is at train.py:9 in f" in text, text
    same = {
        0: {"records": _records(a), "where": "a", "blocked_s": 5.0, "blocked_in": "x"},
        1: {"records": _records(a), "where": "b"},
    }
    text = first_divergence(same, 3)
    assert "the same ZeRO-3 collectives (up to #1); the hang is elsewhere" in text, text
    assert "rank 0 is at a (waiting 5 s for x)" in text and "Ranks [2] did not answer" in text, text


def test_watchdog_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(WATCHDOG_TIMEOUT_ENV, raising=False)
    assert watchdog_timeout() == 300.0
    monkeypatch.setenv(WATCHDOG_TIMEOUT_ENV, "4")
    assert watchdog_timeout() == 4.0
    monkeypatch.setenv(WATCHDOG_TIMEOUT_ENV, "never")
    with pytest.raises(ValueError, match="expected a positive number of seconds"):
        watchdog_timeout()


# ==================================================================== real ranks
def _zero3_fit(_: int | None, world: int, root: str, mode: str) -> None:
    """A 2-rank ``zstack_zero3`` fit of four blocks (each a ZeRO-3 unit). ``mode``: "kill" (rank 1 sleeps in step 3,
    where the test SIGKILLs it), "extra" (rank 0 runs block 1 twice in step 2), "skip" (rank 1 skips block 2 in
    step 2), "stuck" (rank 1 sleeps 60 s in step 2, outside any collective)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from zlightning.strategies import ZStackZero3Strategy

    from zlightning.zero import ZeroConfig

    class Blocks(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if mode == "skip-wide":  # block 2 is larger than the others: diverging collectives differ in size
                widths = (16, 16, 48, 16)
                self.blocks = nn.ModuleList(
                    nn.Sequential(nn.Linear(16, w), nn.Tanh(), nn.Linear(w, 16)) for w in widths
                )
            else:
                self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            odd, rank = self.global_step == 2, self.global_rank
            for i, block in enumerate(self.blocks):
                if mode in ("skip", "skip-wide") and odd and rank == 1 and i == 2:
                    continue
                x = block(x)
                if mode == "extra" and odd and rank == 0 and i == 1:
                    x = block(x)
            return x

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_rank == 1 and (
                (mode == "kill" and self.global_step == 3) or (mode == "stuck" and self.global_step == 2)
            ):
                (Path(root) / "rank1.waiting").write_text(str(os.getpid()))
                time.sleep(60)
            return self(batch[0]).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 16))
    strategy = ZStackZero3Strategy(ZeroConfig(param_persistence_threshold=0))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Blocks(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RankForker]:
    errors = tmp_path_factory.mktemp("errors")
    env = {WATCHDOG_TIMEOUT_ENV: str(TIMEOUT_S), "ZLIGHTNING_ERROR_DIR": str(errors)}
    with RankForker(2, env=env) as parent:
        yield parent


def _logs(tmp_path: Path) -> list[str]:
    return [(tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(2)]


def test_a_killed_peer_is_named_with_its_signal_and_the_collective_in_flight(
    tmp_path: Path, forker: RankForker
) -> None:
    forker.start("tests.test_failures_explained:_zero3_fit", tmp_path / "logs", root=str(tmp_path), mode="kill")
    assert wait_for(lambda: (tmp_path / "rank1.waiting").exists(), timeout=60), _logs(tmp_path)[1][-3000:]
    time.sleep(0.5)  # rank 0 is now waiting for rank 1 in a collective of step 3
    start = time.monotonic()
    forker.kill(signal.SIGKILL, ranks=[1])
    statuses = forker.wait(timeout=60)
    took = time.monotonic() - start
    log = _logs(tmp_path)[0]
    assert statuses == [1, -signal.SIGKILL], (statuses, log[-3000:])
    match = re.search(
        r"PeerFailureError: rank 0: rank 1 \(pid \d+ on [^)]+\) killed by SIGKILL while this rank was "
        r"in (all-gather|reduce-scatter) of unit 'blocks\.\d' \((forward|backward), pass \d+, step 3\)",
        log,
    )
    assert match, log[-3000:]
    print(f"[measured] SIGKILL of rank 1: rank 0 exited with the explained error after {took:.2f} s")
    assert "gloo said: " in log and took < 15, took


@pytest.mark.parametrize("mode", ["extra", "skip"])
def test_diverging_control_flow_raises_on_every_rank(tmp_path: Path, forker: RankForker, mode: str) -> None:
    start = time.monotonic()
    forker.start("tests.test_failures_explained:_zero3_fit", tmp_path / "logs", root=str(tmp_path), mode=mode)
    statuses = forker.wait(timeout=90)
    took = time.monotonic() - start
    logs = _logs(tmp_path)
    assert statuses == [1, 1], (statuses, logs[0][-3000:], logs[1][-3000:])
    for log in logs:
        errors = [line for line in log.splitlines() if line.startswith("zlightning._watchdog.CollectiveMismatchError")]
        assert errors, log[-3000:]
        text = errors[-1]
        assert "the ranks' ZeRO-3 collectives diverge at collective #" in text, text
        if mode == "extra":  # rank 0's second all-gather of blocks.1 against rank 1's next gather (a prefetch)
            assert (
                "rank 0 issued all-gather of unit 'blocks.1' (forward, pass 3, step 2) (its 2nd all-gather of "
                "that unit in this forward pass)"
            ) in text, text
            assert re.search(r"rank 1 issued all-gather of unit 'blocks\.[23]' \(forward, pass 3, step 2\)", text)
        else:  # the forward prefetches the previous pass's order on both ranks: rank 1 differs in its backward,
            # where it re-gathers blocks.1 when rank 0 re-gathers blocks.2
            assert re.search(
                r"rank 0 issued all-gather of unit 'blocks\.2' \(backward, pass 3, step 2\); rank 1 "
                r"issued all-gather of unit 'blocks\.1' \(backward, pass 3, step 2\)",
                text,
            ), text
    print(f"[measured] {mode}: both ranks raised after {took:.2f} s (fit start included, timeout {TIMEOUT_S} s)")
    assert took < 60, took


def test_collectives_of_different_sizes_name_the_abort_and_its_likely_cause(tmp_path: Path, forker: RankForker) -> None:
    """Rank 1 skips a unit larger than the others: gloo aborts the rank that receives more bytes than it expects
    before any comparison can run (see [Note: a peer that gloo aborted] in zlightning/_watchdog.py); the other rank
    names the abort and what it most often means."""
    forker.start("tests.test_failures_explained:_zero3_fit", tmp_path / "logs", root=str(tmp_path), mode="skip-wide")
    statuses = forker.wait(timeout=90)
    logs = _logs(tmp_path)
    assert sorted(statuses) == [-signal.SIGABRT, 1], (statuses, logs[0][-3000:], logs[1][-3000:])
    survivor, aborted = (0, 1) if statuses[0] == 1 else (1, 0)
    assert "Received data size doesn't match" in logs[aborted], logs[aborted][-3000:]
    text = next(x for x in logs[survivor].splitlines() if x.startswith("zlightning._watchdog.PeerFailureError"))
    assert f"rank {aborted} (pid" in text and "killed by SIGABRT" in text, text
    assert "the ranks' collectives diverged" in text and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in text, text


def test_a_rank_stuck_outside_collectives_is_located(tmp_path: Path, forker: RankForker) -> None:
    forker.start("tests.test_failures_explained:_zero3_fit", tmp_path / "logs", root=str(tmp_path), mode="stuck")
    assert wait_for(lambda: (tmp_path / "rank1.waiting").exists(), timeout=60)
    assert wait_for(lambda: "CollectiveTimeoutError" in _logs(tmp_path)[0], timeout=TIMEOUT_S + 30), _logs(tmp_path)[0][
        -3000:
    ]
    forker.kill(signal.SIGKILL, ranks=[1])  # still asleep in its training step
    forker.wait(timeout=60)
    log = _logs(tmp_path)[0]
    line = next(x for x in log.splitlines() if x.startswith("zlightning._watchdog.CollectiveTimeoutError"))
    assert re.search(r"rank 0 waited \d+ s for all-gather of unit 'blocks\.0' \(forward, pass 3, step 2\)", line)
    assert "the ranks' ZeRO-3 collectives agree, but rank 1 issued nothing more after #" in line, line
    assert "in training_step" in line and "the hang is in that rank's own code" in line, line


def _pipeline_fit(rank: int, world: int, root: str) -> None:
    """A 2-stage ``zstack_pipeline`` fit whose last stage (rank 1) stops in its loss at the third batch, so stage 0
    waits for gradients that never come."""
    import lightning.pytorch as pl
    import torch
    from torch import nn

    from zlightning.pipe import PipelineModule

    calls = [0]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            (Path(root) / "rank1.waiting").write_text("")
            time.sleep(60)
        return (out - target).square().mean()

    class Pipe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.pipe = PipelineModule(
                layers=[nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()], loss_fn=loss_fn, num_stages=2
            )

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.pipe.batch_loss((batch[0], batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 16))
    trainer = pl.Trainer(
        strategy="zstack_pipeline",
        accelerator="cpu",
        devices=world,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Pipe(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))


def test_a_pipeline_stage_whose_peer_stops_sending_names_it(tmp_path: Path, forker: RankForker) -> None:
    forker.start("tests.test_failures_explained:_pipeline_fit", tmp_path / "logs", root=str(tmp_path))
    assert wait_for(lambda: (tmp_path / "rank1.waiting").exists(), timeout=60), _logs(tmp_path)[1][-3000:]
    start = time.monotonic()
    assert wait_for(lambda: "TransferTimeoutError" in _logs(tmp_path)[0], timeout=TIMEOUT_S + 30), _logs(tmp_path)[0][
        -3000:
    ]
    took = time.monotonic() - start
    forker.kill(signal.SIGKILL, ranks=[1])  # still in its loss
    forker.wait(timeout=60)
    line = next(x for x in _logs(tmp_path)[0].splitlines() if x.startswith("zlightning._watchdog.TransferTimeoutError"))
    assert re.search(
        r"rank 0 waited \d+ s for the gradients \(RECV_B\) of this batch's micro-batch #\d+ on that "
        r"channel from pipeline stage 1 \(rank 1\)",
        line,
    ), line
    assert "rank 1 is at" in line and "in loss_fn" in line, line
    print(f"[measured] pipeline: stage 0 raised {took:.2f} s after stage 1 stopped (timeout {TIMEOUT_S} s)")
    assert took < TIMEOUT_S + 15, took


@pytest.mark.slow
def test_a_killed_rank_of_a_popen_run_is_named_by_the_launching_rank(tmp_path: Path) -> None:
    """``python train.py``: rank 0 launched rank 1 (Lightning's ``popen``); rank 1 is SIGKILLed while rank 0 waits
    for it. Rank 0 learns how rank 1 ended from its own observer and prints one explained error."""
    script = tmp_path / "train.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {str(Path(__file__).parents[1])!r})\n"
        "from tests.test_failures_explained import _zero3_fit\n"
        f"_zero3_fit(None, 2, {str(tmp_path)!r}, 'kill')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PYTHONUNBUFFERED="1", ZLIGHTNING_ERROR_DIR=str(tmp_path / "errors"))
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    waiting = tmp_path / "rank1.waiting"
    if not wait_for(lambda: waiting.exists() and waiting.read_text(), timeout=240):
        proc.kill()
        pytest.fail(f"training did not start: {proc.communicate()[1][-3000:]}")
    time.sleep(0.5)
    start = time.monotonic()
    os.kill(int(waiting.read_text()), signal.SIGKILL)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("rank 0 did not end after rank 1 was killed")
    took = time.monotonic() - start
    assert proc.returncode == 1, (proc.returncode, err[-3000:])
    summary = [line for line in err.splitlines() if line.startswith("zlightning: rank 0 of 2 failed")]
    assert len(summary) == 1, err[-3000:]
    assert re.search(
        r"PeerFailureError: rank 0: rank 1 \(pid \d+ on [^)]+\) killed by SIGKILL while this rank was in "
        r"(all-gather|reduce-scatter) of unit 'blocks\.\d' \((forward|backward), pass \d+, step 3\)",
        summary[0],
    ), summary[0]
    print(f"[measured] popen: rank 0 printed the explained error and exited {took:.2f} s after rank 1's SIGKILL")
    assert "Traceback" not in err and took < 20, took


_EXIT_WHILE_THE_MONITOR_WAITS = """
import gc, sys, time
from datetime import timedelta
import torch.distributed as dist
from zlightning import _watchdog

dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
monitor = _watchdog._get_monitor()
store = monitor.store
entered = []

class SlowStore:
    # Each poll of the monitor blocks in a C++ store call (GIL released) for 2 s: the interpreter's exit finds it there.
    def add(self, key, value):
        entered.append(key)
        try:
            store.wait(["zlightning-test/never"], timedelta(seconds=2))
        except Exception:
            pass
        return store.add(key, value)

def slow_collection(phase, info):
    # The interpreter's finalisation collects garbage: held in the first collection for 4 s, the call returns meanwhile.
    if phase == "start" and slow_collection in gc.callbacks:
        gc.callbacks.remove(slow_collection)
        time.sleep(4)

monitor.store = SlowStore()
while not entered:
    time.sleep(0.05)
gc.callbacks.append(slow_collection)
print("exiting", flush=True)
"""


def test_a_rank_exits_cleanly_while_its_monitor_is_in_a_store_call(tmp_path: Path) -> None:
    """A daemon thread inside a C++ call at interpreter exit aborts the process (SIGABRT) when it asks for the GIL
    back; the monitor is stopped and joined before that (see [Note: the monitor ends before the interpreter does])."""
    script = tmp_path / "rank.py"
    script.write_text(_EXIT_WHILE_THE_MONITOR_WAITS)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), init, str(r)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for r, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {r} did not exit")
        assert "exiting" in out, err[-2000:]
        assert proc.returncode == 0, (r, proc.returncode, err[-2000:])


_STOP_DURING_A_COMPARISON = """
import sys, time
import torch.distributed as dist
from zlightning import _watchdog

dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
if dist.get_rank() == 1:  # never answers: no monitor on this rank, as if it had died
    time.sleep(20)
    sys.exit(0)
monitor = _watchdog._get_monitor()
monitor.store.add(_watchdog._NS + "/round", 1)  # ask for a comparison, which waits for rank 1's report
deadline = time.monotonic() + 30
while not monitor.comparing and time.monotonic() < deadline:
    time.sleep(0.02)
started = time.monotonic()
monitor.stop()
print(f"comparing={monitor.comparing} stopped_in={time.monotonic() - started:.2f} alive={monitor.thread.is_alive()}")
sys.stdout.flush()
import os
os._exit(0)  # rank 1 is still asleep: nothing to tear down
"""


def test_a_monitor_in_the_middle_of_a_comparison_stops_at_once(tmp_path: Path) -> None:
    """A rank that ends while its monitor waits for a dead rank's answer: the monitor stops at its next poll instead
    of running the comparison's course past the exit handler's join (see [Note: the monitor ends before the
    interpreter does])."""
    script = tmp_path / "rank.py"
    script.write_text(_STOP_DURING_A_COMPARISON)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    procs = [
        subprocess.Popen([sys.executable, str(script), init, str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    out, _ = procs[0].communicate(timeout=120)
    procs[1].kill()
    procs[1].wait()
    match = re.search(r"comparing=(\w+) stopped_in=([\d.]+) alive=(\w+)", out)
    assert match is not None, out
    assert match.group(1) == "False" and match.group(3) == "False", out
    assert float(match.group(2)) < 2.0, out  # was the rest of an 8 s comparison
