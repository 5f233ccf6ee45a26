"""Tests of the curriculum schedules: DeepSpeed 0.19.8 golden sequences, the min clamp, stickiness, custom, config."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from zlightning.datamodules.curriculum import CurriculumSchedule, CurriculumScheduler, difficulty_at


def _root(lo: int, hi: int, s: int, T: int, k: float | None = None) -> dict:
    cfg = {"total_curriculum_step": T, "difficulty_step": s}
    if k is not None:
        cfg["root_degree"] = k
    return {
        "min_difficulty": lo,
        "max_difficulty": hi,
        "schedule_type": "fixed_linear" if k is None else "fixed_root",
        "schedule_config": cfg,
    }


def test_fixed_linear_golden() -> None:
    s = CurriculumScheduler(_root(64, 1024, 8, 100))
    steps = [0, 1, 2, 10, 50, 99, 100, 150]
    assert [s.get_difficulty(t) for t in steps] == [64, 72, 80, 160, 544, 1008, 1024, 1024]


def test_fixed_root_golden_and_min_clamp() -> None:
    s = CurriculumScheduler(_root(8, 1024, 16, 100, k=2))
    steps = [0, 1, 2, 5, 10, 50, 99, 100]
    # t=0 gives 16, not 0: the 0.19.8 floor ceil(min/s)*s (PR #8334).
    assert [s.get_difficulty(t) for t in steps] == [16, 96, 144, 224, 320, 720, 1008, 1024]


def test_legacy_sequence_with_update() -> None:
    s = CurriculumScheduler(_root(2, 10, 2, 8))
    assert [s.update_difficulty(t) for t in range(1, 11)] == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10]


def test_floor_after_clamp_edge_case() -> None:
    # ceil(min/s)*s = 16 > max = 10: the floor runs after the clamp, as upstream, so the value exceeds max.
    sched = CurriculumSchedule(
        min_difficulty=9, max_difficulty=10, schedule_type="fixed_linear", total_curriculum_step=5, difficulty_step=16
    )
    assert difficulty_at(sched, 3) == 16


def test_max_not_multiple_of_step_reached_late() -> None:
    sched = CurriculumSchedule(
        min_difficulty=8, max_difficulty=100, schedule_type="fixed_linear", total_curriculum_step=10, difficulty_step=16
    )
    assert difficulty_at(sched, 10) == 96  # max - max % s at t = T
    assert difficulty_at(sched, 12) == 100  # raw >= 112 only later


def test_fixed_discrete_golden() -> None:
    cfg = {
        "min_difficulty": 1,
        "max_difficulty": 5,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]},
    }
    s = CurriculumScheduler(cfg)
    assert [s.get_difficulty(t) for t in range(11)] == [1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_update_is_sticky_at_max() -> None:
    cfg = {
        "min_difficulty": 1,
        "max_difficulty": 5,
        "schedule_type": "fixed_discrete",
        "schedule_config": {"difficulty": [5, 1, 3], "max_step": [1, 2]},
    }
    s = CurriculumScheduler(cfg)
    assert s.current_difficulty == 1  # starts at min
    assert [s.update_difficulty(t) for t in (1, 2, 3)] == [5, 5, 5]
    assert [s.get_difficulty(t) for t in (1, 2, 3)] == [5, 1, 3]  # get_difficulty stays pure


def test_custom_requires_function_then_uses_it() -> None:
    s = CurriculumScheduler({"min_difficulty": 5, "max_difficulty": 100, "schedule_type": "custom"})
    with pytest.raises(RuntimeError, match="set_custom_get_difficulty"):
        s.get_difficulty(3)
    s.set_custom_get_difficulty(lambda t: min(100, 5 + 3 * t))
    assert s.update_difficulty(3) == 14
    with pytest.raises(TypeError, match="callable"):
        s.set_custom_get_difficulty(42)  # type: ignore[arg-type]


def test_state_dict_round_trip() -> None:
    a = CurriculumScheduler(_root(8, 64, 8, 10))
    a.update_difficulty(5)
    b = CurriculumScheduler(_root(8, 64, 8, 10))
    b.load_state_dict(a.state_dict())
    assert b.current_difficulty == a.current_difficulty == 36 - 36 % 8
    with pytest.raises(ValueError, match="current_difficulty"):
        b.load_state_dict({})


def test_from_dict_accepts_sampler_keys_and_rejects_unknown() -> None:
    cfg = _root(8, 64, 8, 10) | {"difficulty_type": "value", "clustering_type": "single_cluster"}
    assert CurriculumScheduler(cfg).schedule.max_difficulty == 64
    with pytest.raises(ValueError, match="unknown keys.*'min_dificulty'"):
        CurriculumScheduler(cfg | {"min_dificulty": 1})
    with pytest.raises(ValueError, match="missing required keys.*schedule_type"):
        CurriculumScheduler({"min_difficulty": 1, "max_difficulty": 2})
    with pytest.raises(ValueError, match="difficulty_step must be a positive int"):
        CurriculumScheduler(_root(8, 64, 0, 10))
    with pytest.raises(ValueError, match="root_degree"):
        CurriculumScheduler(_root(8, 64, 8, 10) | {"schedule_type": "fixed_root"})
    with pytest.raises(ValueError, match="one int step fewer"):
        CurriculumScheduler(
            {
                "min_difficulty": 1,
                "max_difficulty": 3,
                "schedule_type": "fixed_discrete",
                "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5]},
            }
        )
    with pytest.raises(ValueError, match="must be <= max_difficulty"):
        CurriculumScheduler(_root(80, 64, 8, 10))
    with pytest.raises(ValueError, match="schedule_type must be one of"):
        CurriculumSchedule(min_difficulty=1, max_difficulty=2, schedule_type="linear")  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    lo=st.integers(1, 500),
    span=st.integers(0, 3000),
    s=st.integers(1, 64),
    T=st.integers(1, 500),
    k=st.sampled_from([None, 1, 2, 3, 1.5]),
    t=st.integers(0, 1000),
)
def test_root_schedule_properties(lo: int, span: int, s: int, T: int, k: float | None, t: int) -> None:
    hi = lo + span
    sched = CurriculumSchedule.from_dict(_root(lo, hi, s, T, k))
    floor = math.ceil(lo / s) * s
    d, d_next = difficulty_at(sched, t), difficulty_at(sched, t + 1)
    assert d <= d_next  # monotone
    assert d >= floor  # never below min (0.19.8 clamp)
    if floor <= hi:
        assert d <= hi
        assert d == hi or d % s == 0
    if t >= T and hi % s == 0:
        assert d == hi
