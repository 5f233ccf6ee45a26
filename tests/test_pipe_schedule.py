"""Schedules as data: generators, CSV round-trip, lowering, and the simulator's checks (single process)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlightning.pipe import Action, ActionKind, Schedule, ScheduleError, build_schedule, simulate, timeline
from zlightning.pipe._schedule import add_send_recv, gpipe, interleaved_one_f_one_b, one_f_one_b

F, B = ActionKind.FORWARD, ActionKind.BACKWARD


def _compute(prog: tuple[Action, ...]) -> list[Action]:
    return [a for a in prog if a.kind in (F, B)]


@given(p=st.integers(1, 6), m=st.integers(1, 9), name=st.sampled_from(["gpipe", "1f1b", "inference"]))
@settings(max_examples=60, deadline=None)
def test_every_schedule_passes_the_simulator_and_covers_each_microbatch(p: int, m: int, name: str) -> None:
    sched = build_schedule(name, p, m)
    for r, prog in enumerate(sched.programs):
        comp = _compute(prog)
        fwd = [a.microbatch for a in comp if a.kind is F]
        bwd = [a.microbatch for a in comp if a.kind is B]
        assert fwd == list(range(m))  # in micro-batch order
        assert bwd == (list(range(m)) if name != "inference" else [])
        assert {a.stage for a in comp} == {r}


@given(p=st.integers(1, 5), groups=st.integers(1, 3), v=st.integers(2, 3))
@settings(max_examples=40, deadline=None)
def test_interleaved_schedule_is_valid(p: int, groups: int, v: int) -> None:
    sched = build_schedule("interleaved_1f1b", p, p * groups, v)
    assert sched.num_stages == p * v
    for r in range(p):
        assert {a.stage for a in _compute(sched.programs[r])} == set(range(r, p * v, p))
    simulate(sched)  # idempotent on a lowered schedule


def test_one_f_one_b_in_flight_bound_and_deepspeed_order() -> None:
    """At most ``P - r`` forwards in flight on rank r (the 1F1B memory bound); matches DeepSpeed's S=2, M=4 order."""
    for p in range(1, 6):
        for m in range(1, 9):
            sched = one_f_one_b(p, m)
            for r, prog in enumerate(sched.programs):
                live, peak = 0, 0
                for a in prog:
                    live += 1 if a.kind is F else -1
                    peak = max(peak, live)
                assert peak <= max(1, min(p - r, m))
    s = one_f_one_b(2, 4)
    assert " ".join(map(str, s.programs[0])) == "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3"
    assert " ".join(map(str, s.programs[1])) == "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"
    lowered = add_send_recv(s)
    assert " ".join(map(str, lowered.programs[1][:4])) == "1RECV_F0 1F0 1B0 1SEND_B0"
    assert gpipe(2, 2).programs[0] == (Action(0, F, 0), Action(0, F, 1), Action(0, B, 0), Action(0, B, 1))


def test_action_strings_and_csv_round_trip() -> None:
    assert Action.parse("12SEND_F3") == Action(12, ActionKind.SEND_F, 3)
    with pytest.raises(ValueError, match="cannot parse pipeline action"):
        Action.parse("F0")
    sched = build_schedule("interleaved_1f1b", 2, 4, 2)
    back = Schedule.from_csv(sched.to_csv(), name=sched.name, num_stages=4, num_microbatches=4)
    assert back.programs == sched.programs and back.lowered
    simulate(back)


def test_bubble_matches_theory() -> None:
    """Timing model with B = 2F: (P-1)/(M+P-1) for 1F1B and GPipe, (P-1)/(vM+P-1) interleaved."""
    for p, m in [(2, 2), (4, 4), (4, 8), (3, 5)]:
        for name in ("1f1b", "gpipe"):
            assert timeline(build_schedule(name, p, m)).bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert timeline(build_schedule("interleaved_1f1b", 4, 8, 2)).bubble_fraction == pytest.approx(3 / 19)


def _sched(rows: list[str], stages: int = 2, m: int = 1) -> Schedule:
    return Schedule.from_csv("\n".join(rows), name="custom", num_stages=stages, num_microbatches=m)


def test_simulator_catches_deadlock() -> None:
    # both ranks receive before they send: a cycle of blocking receives
    bad = _sched(["0RECV_B0,0F0,0SEND_F0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"])
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad)


def test_simulator_catches_missing_and_duplicate_work() -> None:
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate(_sched(["0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"], m=2))
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate(_sched(["0F0,0F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"]))
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate(_sched(["0B0,0F0"], stages=1))
    with pytest.raises(ScheduleError, match="not on rank"):
        simulate(_sched(["1F0", "0F0"]))


def test_simulator_catches_unmatched_and_misordered_transfers() -> None:
    with pytest.raises(ScheduleError, match="never received"):
        simulate(_sched(["0F0,0SEND_F0,0SEND_F0,0RECV_B0,0B0", "1RECV_F0,1F0,1B0,1SEND_B0"]))
    # rank 1 receives micro-batch 1 first while rank 0 sent 0 first: FIFO pairing would swap the tensors
    rows = [
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1",
        "1RECV_F1,1F1,1RECV_F0,1F0,1B0,1SEND_B0,1B1,1SEND_B1",
    ]
    with pytest.raises(ScheduleError, match="first-in first-out"):
        simulate(_sched(rows, m=2))
    with pytest.raises(ScheduleError, match="lowered"):
        simulate(one_f_one_b(2, 2))


def test_schedule_argument_errors() -> None:
    with pytest.raises(ValueError, match="multiple of the pipeline ranks.*micro_batches=4"):
        interleaved_one_f_one_b(4, 3, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zero_bubble", 2, 2)
    with pytest.raises(ValueError, match="micro-batches must be >= 1"):
        build_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        build_schedule("1f1b", 2, 2, virtual_stages=2)


def test_csv_skips_blank_lines_and_locates_bad_cells() -> None:
    sched = build_schedule("1f1b", 2, 2)
    text = "\n" + sched.to_csv().replace("\r\n", "\n\n") + " , \n"  # blank lines and a line of empty cells
    back = Schedule.from_csv(text, name=sched.name, num_stages=2, num_microbatches=2)
    assert back.num_ranks == 2 and back.programs == sched.programs
    simulate(back)
    with pytest.raises(ValueError, match=r"schedule CSV line 2, column 2: cannot parse pipeline action 'X1'"):
        Schedule.from_csv("0F0\n1F0,X1\n", name="custom", num_stages=2, num_microbatches=1)
