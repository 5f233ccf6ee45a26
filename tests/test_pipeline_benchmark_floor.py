"""The floor ``benchmarks/pipeline.py`` reports beside ZB-H1's bubble (see [Note: the floor of a one-chunk schedule
within 1F1B's memory at P = 2] there): ZB-H1 reaches it at any costs, no one-chunk schedule holding at most two
micro-batches per rank goes below it, and the benchmark computes it from a step's recorded spans."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from types import ModuleType

import pytest

from zlightning.pipe._schedule import (
    Action,
    ActionKind,
    Timeline,
    one_f_one_b,
    timeline,
    zb_h1,
)


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline.py"
    spec = importlib.util.spec_from_file_location("zlightning_bench_pipeline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


def _costs(f: float, b: float, w: float) -> dict[str, float]:
    return {"F0": f, "X0": b + w, "F1": f, "B1": b, "W1": w}


def _spans(t: Timeline) -> list[list[tuple[str, float, float]]]:
    return [[(str(a), s, e) for a, s, e in prog] for prog in t.spans]


COSTS = [(1.0, 1.0, 1.0), (1.0, 1.3, 0.7), (1.0, 1.5, 0.5), (1.0, 0.6, 1.4), (0.5, 1.2, 0.3), (1.0, 2.0, 0.2)]


@pytest.mark.parametrize("f,b,w", COSTS)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_zb_h1_reaches_the_floor(f: float, b: float, w: float, m: int) -> None:
    t = timeline(zb_h1(2, m), f, b + w, w)
    assert t.bubble_fraction == pytest.approx(BENCH.floor_bubble(_costs(f, b, w), m), abs=1e-12)
    # what the benchmark computes from a recorded step: the same floor, and the step's median replay equals it
    floor, costs = BENCH.one_chunk_floor(_spans(t))
    assert floor == pytest.approx(t.bubble_fraction, abs=1e-12)
    assert costs["W1"] == pytest.approx(w) and costs["X0"] == pytest.approx(b + w)
    assert BENCH._replay_bubble(BENCH._median_spans(_spans(t))) == pytest.approx(floor, abs=1e-12)


def test_half_of_1f1b_needs_heavy_weight_gradients() -> None:
    # equal stages: ZB-H1's bubble is at most half of 1F1B's only when F + 2B <= 4W
    for f, b, w in COSTS:
        ratio = BENCH.floor_bubble(_costs(f, b, w), 8) / timeline(one_f_one_b(2, 8), f, b + w, w).bubble_fraction
        assert (ratio <= 0.5 + 1e-9) == (f + 2 * b <= 4 * w + 1e-9), (f, b, w, ratio)


def _random_program(rank: int, m: int, rng: random.Random) -> tuple[Action, ...] | None:
    """A random order of one rank's forwards, input backwards and weight backwards (each kind in micro-batch order),
    holding at most two micro-batches (from forward to weight backward)."""
    nxt = {ActionKind.FORWARD: 0, ActionKind.BACKWARD: 0, ActionKind.WEIGHT: 0}
    prog: list[Action] = []
    while len(prog) < 3 * m:
        held = nxt[ActionKind.FORWARD] - nxt[ActionKind.WEIGHT]
        options = []
        if nxt[ActionKind.FORWARD] < m and held < 2:
            options.append(ActionKind.FORWARD)
        if nxt[ActionKind.BACKWARD] < nxt[ActionKind.FORWARD]:
            options.append(ActionKind.BACKWARD)
        if nxt[ActionKind.WEIGHT] < nxt[ActionKind.BACKWARD]:
            options.append(ActionKind.WEIGHT)
        if not options:
            return None
        kind = rng.choice(options)
        prog.append(Action(rank, kind, nxt[kind]))
        nxt[kind] += 1
    return tuple(prog)


def _replay(programs: list[tuple[Action, ...]], c: dict[str, float]) -> float:
    """The benchmark's replay of a step whose actions cost ``c`` per stage (the first stage's ``B`` free)."""
    first = {ActionKind.FORWARD: c["F0"], ActionKind.BACKWARD: 0.0, ActionKind.WEIGHT: c["X0"]}
    last = {ActionKind.FORWARD: c["F1"], ActionKind.BACKWARD: c["B1"], ActionKind.WEIGHT: c["W1"]}
    return BENCH._replay_bubble([[(str(a), 0.0, (last if a.stage else first)[a.kind]) for a in p] for p in programs])


def test_no_schedule_within_the_memory_beats_the_floor() -> None:
    """Random one-chunk programs holding at most two micro-batches per rank, at random per-stage costs (stages of
    unequal cost included): none idles less than the floor, and ZB-H1 never does either."""
    rng = random.Random(0)
    checked = 0
    for _ in range(1500):
        m = rng.choice([2, 3, 4, 6])
        c = {k: rng.uniform(0.2, 2.0) for k in ("F0", "X0", "F1", "B1")} | {"W1": rng.uniform(0.05, 2.0)}
        floor = BENCH.floor_bubble(c, m)
        zb = tuple(tuple(a for a, _, _ in prog) for prog in timeline(zb_h1(2, m)).spans)
        assert _replay(list(zb), c) >= floor - 1e-12
        programs = [_random_program(r, m, rng) for r in range(2)]
        if any(p is None for p in programs):
            continue
        try:
            bubble = _replay([p for p in programs if p is not None], c)
        except RuntimeError:
            continue  # an order that deadlocks
        assert bubble >= floor - 1e-12, ([[str(a) for a in p] for p in programs if p is not None], c)
        checked += 1
    assert checked >= 300
