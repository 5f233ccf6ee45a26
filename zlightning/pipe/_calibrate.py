"""Measuring the costs ``zbv`` orders its actions by.

[Note: calibrating zbv]
``zbv``'s order comes from a list scheduler over the relative costs of a chunk's forward, input backward and weight
backward (see [Note: zbv orders by measured costs] in ``_schedule.py``), and only the running model knows them. With
``PipelineConfig(schedule_costs="auto")`` (the default) the engine starts from unit costs, times every compute action
of the second training batch (the first pays one-off costs: allocator growth, lazy initialisation), and reorders:
each rank takes the median duration of its forwards, of its split input backwards and of its weight backwards (the
first stage's backward is left out: its ``B`` is free and its ``W`` the whole backward), every rank gathers everyone's,
and each takes the median over ranks, relative to the forward and rounded to ``_STEP``, so all ranks build the same
schedule from the same numbers and a few percent of timing noise does not change the order. This happens once; the
costs chosen are logged. Only the order changes, not what is computed, so results stay equal to a single process up
to the rounding of summing micro-batch gradients in another order. ``schedule_costs="unit"`` or an explicit
``ActionCosts`` keeps one order from the first batch on (bitwise repeatable runs). With ``M >= 2P`` micro-batches
``zbv`` runs the phased order, which no cost changes (see [Note: the phased V order] in ``_schedule.py``), and nothing
is measured.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from zlightning.pipe._schedule import Action, ActionCosts, ActionKind

__all__ = ["ZbvCalibration"]

log = logging.getLogger(__name__)

_STEP = 0.05
"""Resolution of the measured cost ratios (relative to the forward)."""


class ZbvCalibration:
    """Counts training batches and, at the one to measure, turns this rank's action timings into ``ActionCosts``
    that every rank agrees on; see [Note: calibrating zbv]."""

    def __init__(self, measure_batch: int = 1) -> None:
        self.measure_batch = measure_batch
        self.batches = 0
        self.costs: ActionCosts | None = None
        """The costs chosen (None until measured)."""

    def due(self) -> bool:
        """Counts a training batch; True for the one to time."""
        self.batches += 1
        return self.costs is None and self.batches == self.measure_batch + 1

    def agree(self, timings: Sequence[tuple[str, float, float]], device: torch.device) -> ActionCosts:
        """The costs from this rank's ``timings`` and every other rank's (collective over the default group when
        ``torch.distributed`` is initialised)."""
        mine = torch.tensor(local_medians(timings), dtype=torch.float64, device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(everyone, mine)
            rows = [e.cpu().tolist() for e in everyone]
        else:
            rows = [mine.cpu().tolist()]
        self.costs = costs_from(rows)
        log.info(
            "zbv: ordered by measured costs F %.2f, B %.2f, W %.2f (relative to the forward; see [Note: calibrating "
            "zbv])",
            self.costs.forward,
            self.costs.backward_input,
            self.costs.backward_weight,
        )
        return self.costs


def local_medians(timings: Sequence[tuple[str, float, float]]) -> list[float]:
    """Median seconds of this rank's forwards, split input backwards and weight backwards (NaN for a kind with no
    sample). The first stage's backward is left out (see [Note: the first stage's split backward])."""
    spans: dict[ActionKind, list[float]] = {k: [] for k in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)}
    for text, start, end in timings:
        a = Action.parse(text)
        if a.kind in spans and (a.kind is ActionKind.FORWARD or a.stage != 0):
            spans[a.kind].append(end - start)
    return [statistics.median(v) if v else math.nan for v in spans.values()]


def costs_from(rows: Sequence[Sequence[float]]) -> ActionCosts:
    """``ActionCosts`` from per-rank ``[forward, backward_input, backward_weight]`` medians: the median over ranks of
    each, relative to the forward, rounded to ``_STEP`` (at least ``_STEP``). Unit costs when nothing was measured."""
    columns = []
    for i in range(3):
        values = [r[i] for r in rows if not math.isnan(r[i]) and r[i] > 0]
        columns.append(statistics.median(values) if values else math.nan)
    forward, b, w = columns
    if math.isnan(forward) or math.isnan(b) or math.isnan(w):
        return ActionCosts()

    def ratio(x: float) -> float:
        return round(max(_STEP, round(x / forward / _STEP) * _STEP), 2)

    return ActionCosts(1.0, ratio(b), ratio(w))
