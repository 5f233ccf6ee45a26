"""Profile-guided selective unsharding for graph mode: which units stay gathered from forward to backward.

[Note: memory budget]
ZeRO-3 gathers every unit twice per step: in the forward and again in the backward. Keeping a unit's gathered
parameters alive from its forward use to its backward use saves the second all-gather at the price of holding
``unsharded_bytes`` for that time (DeepCompile's selective unsharding). Which units to keep is decided from a
measured profile, not from sizes alone: every unit group's all-gather is timed on the real process group (a few
repetitions, median), and the times are all-reduced with MAX so every rank makes the *same* choice -- a rank that
kept a unit while another re-gathers it would issue a different sequence of collectives and hang. Units are then
taken greedily by measured seconds saved per byte held, while their total stays within the budget
(``CompileConfig.unshard_budget``: bytes, or a fraction of all unit groups' gathered bytes). The compiled forward
graph is checked afterwards: `GraphStats.saved_unit_bytes` is what the partitioned graph really hands to the
backward, and tests assert it never exceeds the budget.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zlightning._dist_compat import all_gather_single
from zlightning.compile._graph import GroupSpec, ordered_groups

__all__ = ["GroupProfile", "UnshardPlan", "budget_bytes", "plan_unshard", "profile_gathers"]


@dataclass(frozen=True)
class GroupProfile:
    """One unit group's measured all-gather."""

    index: int
    unit: str
    gathered_bytes: int
    gather_s: float  # median over repetitions, MAX over ranks


@dataclass(frozen=True)
class UnshardPlan:
    """The groups kept gathered between forward and backward, and why."""

    budget_bytes: int
    kept: tuple[int, ...]
    kept_bytes: int
    saved_gather_s: float  # measured all-gather time the kept groups no longer spend in the backward
    profile: tuple[GroupProfile, ...]


def budget_bytes(specs: Sequence[GroupSpec], budget: int | float | None) -> int:
    """The budget in bytes (a float is a fraction of all unit groups' gathered bytes)."""
    if budget is None:
        return 0
    if isinstance(budget, float):
        return int(budget * sum(s.unsharded_bytes for s in specs if s.kind == "unit"))
    return int(budget)


def profile_gathers(state: object, specs: Sequence[GroupSpec], repeats: int = 3) -> list[GroupProfile]:
    """Times the all-gather of every unit group on the engine's process group. Collective: every rank calls it."""
    by_spec = ordered_groups(state)
    pg = state.process_group  # type: ignore[attr-defined]
    times = []
    for spec, group in zip(specs, by_spec):
        if spec.kind != "unit":
            times.append(0.0)
            continue
        src = group.shard.detach().to(group.param_dtype)
        out = torch.empty(group.world * group.shard_numel, dtype=group.param_dtype, device=group.device)
        samples = []
        for _ in range(repeats + 1):  # the first one warms the connection up
            t0 = time.perf_counter()
            if group.world > 1:
                all_gather_single(out, src, group=pg)
            else:
                out.copy_(src)
            if out.is_cuda:
                torch.cuda.synchronize(out.device)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples[1:]))
    t = torch.tensor(times, dtype=torch.float64)
    if state.world_size > 1:  # type: ignore[attr-defined]
        t = t.to(state.device)  # type: ignore[attr-defined]
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
    return [
        GroupProfile(s.index, s.unit, s.unsharded_bytes, float(x))
        for s, x in zip(specs, t.cpu().tolist())
        if s.kind == "unit"
    ]


def plan_unshard(
    specs: Sequence[GroupSpec], profile: Sequence[GroupProfile], budget: int | float | None
) -> UnshardPlan:
    """Greedy by measured seconds saved per byte, within the budget (deterministic: ties by group index)."""
    cap = budget_bytes(specs, budget)
    ranked = sorted(profile, key=lambda p: (-(p.gather_s / max(p.gathered_bytes, 1)), p.index))
    kept, used, saved = [], 0, 0.0
    for p in ranked:
        if used + p.gathered_bytes <= cap:
            kept.append(p.index)
            used += p.gathered_bytes
            saved += p.gather_s
    return UnshardPlan(cap, tuple(sorted(kept)), used, saved, tuple(profile))
