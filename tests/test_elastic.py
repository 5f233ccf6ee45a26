"""Elastic restart: ``examples/elastic.py`` under ``torchrun --nnodes=1:2 --max-restarts`` on two hosts
(network namespaces joined by a veth pair): a host that dies makes the other continue alone, from ``last``, at the
new world size.

A restart at the same world size (one host, ``--nproc-per-node=2``, one worker SIGKILLed) is not tested: here the
restarted workers intermittently failed in gloo's ``connectFullMesh`` ("Connection refused") or hung there, which
looks like the restart problem reported upstream (pytorch/pytorch#167288, with NCCL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._fork_ranks import wait_for

ROOT = Path(__file__).resolve().parents[1]


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts() -> Iterator[list[tuple[str, str, str]]]:
    """Two "hosts": network namespaces joined by a veth pair (addresses of this pair only), as ``(namespace,
    interface, address)``. Every process left in them is killed and both are deleted afterwards."""
    tag = f"zl{os.getpid() % 100000}"
    hosts = [(f"{tag}a", f"{tag}va", "10.218.77.1"), (f"{tag}b", f"{tag}vb", "10.218.77.2")]
    made: list[str] = []
    try:
        for ns, _, _ in hosts:
            if _ip("netns", "add", ns).returncode != 0:
                pytest.skip("cannot create network namespaces here (needs root / CAP_SYS_ADMIN)")
            made.append(ns)
        steps = [("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])]
        for ns, dev, addr in hosts:
            steps += [
                ("link", "set", dev, "netns", ns),
                ("-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("-n", ns, "link", "set", dev, "up"),
                ("-n", ns, "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _ip(*step)
            assert done.returncode == 0, (step, done.stderr)
        yield hosts
    finally:
        for ns in made:
            for pid in _ip("netns", "pids", ns).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns)  # deletes the veth pair with it


@pytest.mark.slow
def test_a_dead_host_makes_the_survivor_restart_at_the_smaller_world_size(
    tmp_path: Path, two_hosts: list[tuple[str, str, str]]
) -> None:
    """``torchrun --nnodes=1:2`` with the c10d rendezvous on two hosts; one host's agent and worker are SIGKILLed
    after a checkpoint: the surviving worker names the dead rank, its agent restarts it at world size 1, it resumes
    from ``last`` (saved by 2 ranks, loaded by 1) and finishes."""
    out = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    agents, logs = [], []
    for i, (ns, dev, addr) in enumerate(two_hosts):
        command = [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            f"GLOO_SOCKET_IFNAME={dev}",
            "PYTHONUNBUFFERED=1",
            f"ZLIGHTNING_ERROR_DIR={tmp_path / f'errors{i}'}",
            str(torchrun),
            "--nnodes=1:2",
            "--nproc-per-node=1",
            "--max-restarts=2",
            "--monitor-interval=0.5",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={two_hosts[0][2]}:29400",
            "--rdzv-id=issue18",
            f"--rdzv-conf=join_timeout=60,last_call_timeout=2,is_host={str(i == 0).lower()}",
            f"--local-addr={addr}",
            str(ROOT / "examples" / "elastic.py"),
            "--out",
            str(out),
            "--max-steps",
            "60",
            "--save-every",
            "5",
        ]
        env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
        logs.append(tmp_path / f"host{i}.log")
        with open(logs[-1], "w") as log_file:  # a file, not a pipe: workers outlive a killed agent
            agents.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT))
    meta = out / "checkpoints" / "last.ckpt" / "meta.json"
    assert wait_for(meta.exists, timeout=180), logs[0].read_text()[-3000:]
    time.sleep(2.0)
    killed = time.monotonic()
    for pid in _ip("netns", "pids", two_hosts[1][0]).stdout.split():  # the host dies: its agent and its worker
        os.kill(int(pid), signal.SIGKILL)
    try:
        agents[0].wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the surviving host did not finish: {logs[0].read_text()[-4000:]}")  # the fixture kills all
    log = logs[0].read_text()
    took = time.monotonic() - killed
    print(f"[measured] two hosts: the survivor restarted alone and finished {took:.1f} s after the other host died")
    assert agents[0].returncode == 0, log[-4000:]
    # The survivor names the dead peer when its watchdog sees the death first; when gloo's own connection error
    # reaches the collective first, that error is reported (a race on this machine: both were observed).
    named = re.search(
        r"PeerFailureError: rank 0: rank 1 \(pid \d+ on [^)]+\) killed by SIGKILL while this rank was in "
        r"((all-gather|reduce-scatter) of unit|the preemption check after step \d+)",  # where the kill found it
        log,
    )
    raw = re.search(r"rank 0 of 2 failed: RuntimeError: \S+ (Read error|Connection (reset|closed) by peer)", log)
    assert named or raw, log[-4000:]
    after = log[(named or raw).start() :]  # type: ignore[union-attr]
    assert "Starting with 1 processes" in after and "Restoring states from the checkpoint path at" in after, after[
        -3000:
    ]
    import json

    import torch

    assert json.loads(meta.read_text())["world_size"] == 1  # the last save came from the restarted, single rank
    assert torch.load(meta.parent / "client_state.pt", weights_only=True)["global_step"] == 60
