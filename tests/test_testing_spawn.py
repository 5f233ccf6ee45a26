"""The multi-process test harness itself: failures are reported with their cause, hangs and deaths fail loudly."""

from __future__ import annotations

import os
import time

import pytest

from zlightning.testing import DistributedTestError, run_distributed


def _secondary_first(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(1.5)  # the real failure reaches the parent after the peer's disconnect error
        raise ValueError("rank zero's real cause")
    raise RuntimeError("[gloo/transport/tcp/pair.cc] Connection closed by peer [127.0.0.1]:1234")


def _hang_on_one(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


def _die(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def _ok(rank: int, world: int, base: int) -> int:
    return base + rank * world


def test_the_rank_that_really_failed_is_reported_first() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_secondary_first, 2, init_process_group=False, timeout=60)
    text = str(info.value)
    assert text.startswith("distributed test failed: rank 0 raised:")
    assert "rank zero's real cause" in text and "rank 1 also raised" in text
    assert text.index("real cause") < text.index("Connection closed by peer")


def test_a_hung_rank_times_out_and_a_dead_rank_is_named() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 15s; ranks without a result: \[1\]"):
        run_distributed(_hang_on_one, 2, init_process_group=False, timeout=15)
    assert time.monotonic() - start < 60
    with pytest.raises(DistributedTestError, match=r"ranks \[1\] exited without a result \(exit codes \{1: 3\}\)"):
        run_distributed(_die, 2, init_process_group=False, timeout=60)


def test_results_come_back_by_rank() -> None:
    assert run_distributed(_ok, 3, 10, init_process_group=False, timeout=60) == [10, 13, 16]
