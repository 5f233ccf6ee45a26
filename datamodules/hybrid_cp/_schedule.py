"""The hybrid data×context-parallel scheduler as pure, typed functions: schedules are data.

`schedule_hybrid_cp(seqlens, dp_cp_size, max_seqlen_per_rank, cost=None)` places every sub-sample of a global batch
on an aligned power-of-two block of the DP×CP ranks, in a few "groups" separated by barriers, so that every rank is
busy for about the same time. `HybridCPDataLoaderWrapper` (``_wrapper.py``) calls exactly this function;
`schedule_stats` measures a schedule without any process.

Vocabulary: *rank* is a position ``0 .. dp_cp_size - 1`` in the DP×CP domain; a *block* is a set of ranks
``[s, s + c)`` with ``c`` a power of two and ``s`` a multiple of ``c``; a *group* is one barrier-delimited round in
which the ranks are partitioned into blocks; a sub-sample's *CP size* is the size of the block that runs it.

[Note: cost model]
A sub-sample of length ``L`` run at CP size ``cp`` costs every rank of its block ``cost(L, cp)``. The default,
`quadratic_cost`, is ``L**2 / cp``: attention FLOPs grow as ``L**2`` and are split evenly over the block (Megatron's
estimator). It ignores the dense layers (linear in ``L``) and communication; pass your own callable, e.g. one derived
from the model's shape (``a * L**2 / cp + b * L / cp``) or from measurements. It must be deterministic and return a
finite number ``>= 0``, because every rank evaluates it and must reach the same schedule.

[Note: CP size of a sub-sample]
``cp_size_needed(L, M)`` is the smallest power of two ``c`` with ``L <= c * M``: the per-rank share of the sequence
fits in ``max_seqlen_per_rank`` tokens. A sub-sample runs at exactly that size unless no idle-free schedule exists
without widening it (for example one short sequence and eight ranks); then the scheduler widens the cheapest
sub-samples of the rarest sizes, one doubling at a time, until one exists. Widening never breaks the memory bound.

[Note: how groups are built]
Sub-samples are bucketed into *classes* by CP size; class ``c`` must run on blocks of size ``c``. Let ``P_c`` be the
per-rank cost of the whole class (``sum cost(L, c)``). A group with layout ``k`` (``k_c`` blocks of size ``c``,
``sum c * k_c = n``) lasting ``T`` serves ``k_c * T`` of ``P_c``. The scheduler

1. *plans* layouts by peeling: pick a layout that uses only classes with work left, run it for
   ``T = min_c P_c / k_c`` (so at least one class finishes and no block idles in the fluid model), subtract, repeat.
   Any such plan is perfectly balanced in the fluid model and has at most one group per class; layouts whose shape
   is closest to the remaining work are tried first (a few branches per step).
2. *packs* each plan: per class, items in decreasing cost go to the block of that class with the most room left
   (capacity ``T`` of its group); empty blocks take an item from a block holding two or more.
3. *refines* the best packed plans by local search (move one item, or swap two, between blocks of the same class)
   on the scheduled time ``sum over groups of the busiest block's load``, and keeps the best result.

Everything is deterministic: ties break on sub-sample ids and block positions, so every rank gets the same schedule.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, TypeAlias

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = [
    "BalancedCPScheduler",
    "CostFn",
    "HybridCPSchedule",
    "ScheduleStats",
    "cp_size_needed",
    "quadratic_cost",
    "schedule_hybrid_cp",
    "schedule_stats",
]

CostFn: TypeAlias = Callable[[int, int], float]
"""``cost(length, cp) -> per-rank cost`` of running a sub-sample of ``length`` tokens on ``cp`` ranks."""

HybridCPSchedule: TypeAlias = list[list[list[int]]]
"""``schedule[g][r]``: the ordered global ids rank ``r`` runs in group ``g``."""

_BRANCHING = 3  # layouts tried per peeling step
_MAX_PLANS = 24  # plans packed per attempt
_REFINED = 3  # best packed plans refined by local search
_MAX_SEARCH_STEPS = 400  # improving moves per refinement (each strictly lowers the scheduled time)
_REL_TOL = 1e-5  # a move must save this share of the step: below it, passes over all pairs cost more than they save


def quadratic_cost(length: int, cp: int) -> float:
    """The default cost model ``length**2 / cp``. See [Note: cost model]."""
    return float(length) * float(length) / cp


def cp_size_needed(length: int, max_seqlen_per_rank: int) -> int:
    """Smallest power of two ``c`` with ``length <= c * max_seqlen_per_rank``. See [Note: CP size of a sub-sample]."""
    c = 1
    while c * max_seqlen_per_rank < length:
        c *= 2
    return c


@dataclass(frozen=True)
class ScheduleStats:
    """Quality of a schedule under a cost model (computed by `schedule_stats`)."""

    efficiency: float
    """Ideal time (total busy rank-time / ranks) over scheduled time (sum over groups of the busiest rank's load)."""
    num_groups: int
    """Groups (barrier rounds) in the schedule."""
    mean_cp_size: float
    """Token-weighted mean CP size: ``sum L * cp / sum L``."""
    scheduled_time: float
    """Sum over groups of the busiest rank's load."""
    ideal_time: float
    """Total busy rank-time divided by the number of ranks."""
    group_imbalance: tuple[float, ...]
    """Per group, ``(max - min) / max`` of the rank loads."""


# --------------------------------------------------------------------------------------------------- validation


def _validate(seqlens: Sequence[int], dp_cp_size: int, max_seqlen_per_rank: int) -> None:
    if isinstance(dp_cp_size, bool) or not isinstance(dp_cp_size, int) or dp_cp_size < 1:
        raise ValueError(f"schedule_hybrid_cp: dp_cp_size must be a positive int, got {dp_cp_size!r}.")
    if dp_cp_size & (dp_cp_size - 1):
        lower = 1 << (dp_cp_size.bit_length() - 1)
        raise ValueError(
            f"schedule_hybrid_cp: dp_cp_size={dp_cp_size} is not a power of two. Hybrid CP runs sub-samples on "
            f"aligned power-of-two blocks of ranks, and a domain of {dp_cp_size} ranks cannot be cut into such blocks "
            f"without idle ranks or blocks that have no process group. Use a power-of-two DP×CP size "
            f"(e.g. {lower} or {lower * 2})."
        )
    if isinstance(max_seqlen_per_rank, bool) or not isinstance(max_seqlen_per_rank, int) or max_seqlen_per_rank < 1:
        raise ValueError(
            f"schedule_hybrid_cp: max_seqlen_per_rank must be a positive int, got {max_seqlen_per_rank!r}."
        )
    for gid, length in enumerate(seqlens):
        if isinstance(length, bool) or not isinstance(length, int):
            raise ValueError(f"schedule_hybrid_cp: seqlens[{gid}] must be an int, got {type(length).__name__}.")
        if length < 1:
            raise ValueError(
                f"schedule_hybrid_cp: seqlens[{gid}] = {length}; every sub-sample needs at least one token. Drop "
                f"zero-length entries (padding in cu_seqlens) before scheduling."
            )
        if length > max_seqlen_per_rank * dp_cp_size:
            raise ValueError(
                f"schedule_hybrid_cp: sub-sample {gid} has {length} tokens, more than all {dp_cp_size} ranks can hold "
                f"at max_seqlen_per_rank={max_seqlen_per_rank} ({max_seqlen_per_rank * dp_cp_size} tokens). Raise "
                f"max_seqlen_per_rank to at least {-(-length // dp_cp_size)}, use more ranks, or split the sequence."
            )


def _checked_cost(cost: CostFn, length: int, cp: int) -> float:
    value = float(cost(length, cp))
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"schedule_hybrid_cp: cost({length}, {cp}) returned {value!r}; a cost model must return a finite number "
            f">= 0 (see [Note: cost model] in zlightning.datamodules.hybrid_cp._schedule)."
        )
    return value


# ------------------------------------------------------------------------------------------------------ layouts


@lru_cache(maxsize=256)
def _layouts(n: int, sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """All multisets of block sizes (from ``sizes``, descending) that sum to ``n``, as descending tuples."""
    sizes = tuple(sorted(sizes, reverse=True))
    out: list[tuple[int, ...]] = []

    def rec(rest: int, start: int, acc: list[int]) -> None:
        if rest == 0:
            out.append(tuple(acc))
            return
        for i in range(start, len(sizes)):
            if sizes[i] <= rest:
                acc.append(sizes[i])
                rec(rest - sizes[i], i, acc)
                acc.pop()

    rec(n, 0, [])
    return tuple(out)


def _counts(layout: tuple[int, ...]) -> dict[int, int]:
    k: dict[int, int] = {}
    for c in layout:
        k[c] = k.get(c, 0) + 1
    return k


# --------------------------------------------------------------------------------------------------- planning

Plan: TypeAlias = list[tuple[tuple[int, ...], float]]  # (layout, fluid duration T) per group


def _plans(demand: dict[int, float], counts: dict[int, int], n: int) -> list[Plan]:
    """Peeling plans (see [Note: how groups are built]), most promising first, at most ``_MAX_PLANS``."""
    total = sum(demand.values())
    plans: list[Plan] = []

    def rec(rem: dict[int, float], used: dict[int, int], plan: Plan) -> None:
        if len(plans) >= _MAX_PLANS:
            return
        active = tuple(sorted(c for c, p in rem.items() if p > total * 1e-9))
        if not active:
            plans.append(list(plan))
            return
        weight = sum(c * rem[c] for c in active)
        share = {c: c * rem[c] / weight for c in active}
        options = []
        for layout in _layouts(n, active):
            k = _counts(layout)
            if any(used.get(c, 0) + kc > counts[c] for c, kc in k.items()):
                continue  # not enough sub-samples to give every block at least one
            distance = sum(abs(c * k.get(c, 0) / n - share[c]) for c in active)
            options.append((distance, layout, k))
        options.sort(key=lambda o: (o[0], o[1]))
        for _, layout, k in options[:_BRANCHING]:
            duration = min(rem[c] / kc for c, kc in k.items())
            nxt = dict(rem)
            for c, kc in k.items():
                nxt[c] = 0.0 if rem[c] / kc <= duration * (1 + 1e-9) else rem[c] - kc * duration
            nused = {c: used.get(c, 0) + k.get(c, 0) for c in set(used) | set(k)}
            plan.append((layout, duration))
            rec(nxt, nused, plan)
            plan.pop()

    rec(dict(demand), {}, [])
    return plans


# ---------------------------------------------------------------------------------------------------- packing


@dataclass
class _Packing:
    """Mutable packing of items into the blocks of a plan; the local search edits it in place."""

    block_group: list[int]  # group of each block
    block_size: list[int]  # CP size of each block
    block_start: list[int]  # first rank of each block
    block_items: list[list[int]]  # item indices per block
    block_load: list[float]  # per-rank load of each block
    group_blocks: list[list[int]]  # block indices per group

    def group_max(self, g: int) -> float:
        return max(self.block_load[b] for b in self.group_blocks[g])

    def scheduled_time(self) -> float:
        return sum(self.group_max(g) for g in range(len(self.group_blocks)))


def _empty_packing(plan: Plan) -> tuple[_Packing, list[float]]:
    pk = _Packing([], [], [], [], [], [])
    capacity: list[float] = []
    for g, (layout, duration) in enumerate(plan):
        pk.group_blocks.append([])
        start = 0
        for c in layout:  # descending sizes laid out consecutively are aligned
            pk.group_blocks[g].append(len(pk.block_size))
            pk.block_group.append(g)
            pk.block_size.append(c)
            pk.block_start.append(start)
            pk.block_items.append([])
            pk.block_load.append(0.0)
            capacity.append(duration)
            start += c
    return pk, capacity


def _pack(plan: Plan, cls: list[int], weight: list[float]) -> _Packing | None:
    """Largest-first packing of each class into its blocks; None if some block would stay empty."""
    pk, capacity = _empty_packing(plan)
    for c in sorted(set(cls)):
        blocks = [b for b in range(len(pk.block_size)) if pk.block_size[b] == c]
        items = sorted((i for i in range(len(cls)) if cls[i] == c), key=lambda i: (-weight[i], i))
        if len(items) < len(blocks) or not blocks:
            return None
        for i in items:
            b = max(blocks, key=lambda b: (capacity[b] - pk.block_load[b], -b))
            pk.block_items[b].append(i)
            pk.block_load[b] += weight[i]
        for b in blocks:  # repair: an empty block takes the smallest item of the fullest multi-item block
            if not pk.block_items[b]:
                donor = max((d for d in blocks if len(pk.block_items[d]) > 1), key=lambda d: (pk.block_load[d], -d))
                i = min(pk.block_items[donor], key=lambda i: (weight[i], i))
                pk.block_items[donor].remove(i)
                pk.block_load[donor] -= weight[i]
                pk.block_items[b].append(i)
                pk.block_load[b] += weight[i]
    return pk


# ----------------------------------------------------------------------------------------------- local search


def _delta(pk: _Packing, changes: dict[int, float]) -> float:
    """Change of the scheduled time if the blocks in ``changes`` get those new loads."""
    delta = 0.0
    for g in {pk.block_group[b] for b in changes}:
        old = pk.group_max(g)
        new = max(changes.get(b, pk.block_load[b]) for b in pk.group_blocks[g])
        delta += new - old
    return delta


def _improving_moves(pk: _Packing, weight: list[float]) -> Iterator[tuple[float, int, int, int, int | None]]:
    """Moves (delta, item, from_block, to_block, swap_item) out of each group's busiest block that lower the time."""
    blocks_of: dict[int, list[int]] = {}
    for b, c in enumerate(pk.block_size):
        blocks_of.setdefault(c, []).append(b)
    for g in range(len(pk.group_blocks)):
        src = max(pk.group_blocks[g], key=lambda b: (pk.block_load[b], -b))
        for i in pk.block_items[src]:
            for dst in blocks_of[pk.block_size[src]]:
                if dst == src:
                    continue
                if len(pk.block_items[src]) > 1:
                    d = _delta(pk, {src: pk.block_load[src] - weight[i], dst: pk.block_load[dst] + weight[i]})
                    if d < 0:
                        yield d, i, src, dst, None
                for j in pk.block_items[dst]:
                    w = weight[i] - weight[j]
                    if w > 0:
                        d = _delta(pk, {src: pk.block_load[src] - w, dst: pk.block_load[dst] + w})
                        if d < 0:
                            yield d, i, src, dst, j


def _refine(pk: _Packing, weight: list[float]) -> _Packing:
    """Best-improvement local search; stops at a local optimum or after ``_MAX_SEARCH_STEPS`` moves."""
    tol = _REL_TOL * max(1.0, pk.scheduled_time())
    for _ in range(_MAX_SEARCH_STEPS):
        best = min(_improving_moves(pk, weight), default=None, key=lambda m: (m[0], m[1], m[3]))
        if best is None or best[0] > -tol:
            break
        _, i, src, dst, j = best
        pk.block_items[src].remove(i)
        pk.block_items[dst].append(i)
        pk.block_load[src] -= weight[i]
        pk.block_load[dst] += weight[i]
        if j is not None:
            pk.block_items[dst].remove(j)
            pk.block_items[src].append(j)
            pk.block_load[dst] -= weight[j]
            pk.block_load[src] += weight[j]
    return pk


# ------------------------------------------------------------------------------------------------- entry point


def _widen_one(cls: list[int], weight_at: Callable[[int, int], float], n: int) -> bool:
    """Doubles the CP size of the cheapest sub-sample of the rarest widenable class. See [Note: CP size ...]."""
    members: dict[int, list[int]] = {}
    for i, c in enumerate(cls):
        if c < n:
            members.setdefault(c, []).append(i)
    if not members:
        return False
    c = min(members, key=lambda c: (len(members[c]), c))
    i = min(members[c], key=lambda i: (weight_at(i, c), i))
    cls[i] = 2 * c
    return True


def _best_packing(cls: list[int], weight: list[float], n: int) -> _Packing | None:
    demand: dict[int, float] = {}
    counts: dict[int, int] = {}
    for c, w in zip(cls, weight):
        # A zero-cost class still needs blocks; give it a tiny share so the planner schedules it.
        demand[c] = demand.get(c, 0.0) + max(w, 1e-300)
        counts[c] = counts.get(c, 0) + 1
    packed = [pk for plan in _plans(demand, counts, n) if (pk := _pack(plan, cls, weight)) is not None]
    packed.sort(key=lambda pk: (pk.scheduled_time(), len(pk.group_blocks)))
    best: _Packing | None = None
    for pk in packed[:_REFINED]:
        pk = _refine(pk, weight)
        if best is None or (pk.scheduled_time(), len(pk.group_blocks)) < (
            best.scheduled_time(),
            len(best.group_blocks),
        ):
            best = pk
    return best


def schedule_hybrid_cp(
    seqlens: Sequence[int],
    dp_cp_size: int,
    max_seqlen_per_rank: int,
    cost: CostFn | None = None,
) -> HybridCPSchedule:
    """Schedules the sub-samples of a global batch on ``dp_cp_size`` ranks in balanced, barrier-separated groups.

    Every sub-sample ``gid`` (an index into ``seqlens``) runs in exactly one group, on an aligned power-of-two block
    of ranks whose size is its CP size (at least `cp_size_needed`). All ranks of a block hold the identical ordered
    list of ids, and no rank is idle in any group. The groups minimise (heuristically) the scheduled time, the sum over
    groups of the busiest rank's load under ``cost``. The algorithm is in [Note: how groups are built]; the function
    is pure and deterministic, so every rank computes the same schedule from the same lengths.

    Args:
        seqlens: Length in tokens of every sub-sample of the global batch (each ``>= 1``), indexed by global id.
        dp_cp_size: Ranks in the DP×CP domain; a power of two.
        max_seqlen_per_rank: Most tokens of one sub-sample a rank may hold; sets each sub-sample's CP size.
        cost: ``cost(length, cp)``, the per-rank cost of a sub-sample; `quadratic_cost` (``L**2 / cp``) if None.

    Returns:
        ``schedule[g][r]``: the global ids rank ``r`` runs in group ``g``, in execution order. Empty if ``seqlens``
        is empty.

    Raises:
        ValueError: If ``dp_cp_size`` is not a power of two, an argument is not a positive int, a length is below 1,
            a sub-sample cannot fit on all ranks (``L > max_seqlen_per_rank * dp_cp_size``), or ``cost`` returns a
            negative or non-finite value.
    """
    _validate(seqlens, dp_cp_size, max_seqlen_per_rank)
    if not seqlens:
        return []
    cost_fn = quadratic_cost if cost is None else cost
    lengths = [int(length) for length in seqlens]

    def weight_at(i: int, c: int) -> float:
        return _checked_cost(cost_fn, lengths[i], c)

    cls = [cp_size_needed(length, max_seqlen_per_rank) for length in lengths]
    while True:
        weight = [weight_at(i, c) for i, c in enumerate(cls)]
        best = _best_packing(cls, weight, dp_cp_size)
        if best is not None:
            return _to_schedule(best, dp_cp_size)
        if not _widen_one(cls, weight_at, dp_cp_size):
            raise AssertionError(f"no schedule with every sub-sample at CP size {dp_cp_size}: {lengths=}")


def _to_schedule(pk: _Packing, n: int) -> HybridCPSchedule:
    schedule: HybridCPSchedule = []
    for blocks in pk.group_blocks:
        ranks: list[list[int]] = [[] for _ in range(n)]
        for b in blocks:
            ids = sorted(pk.block_items[b])
            for r in range(pk.block_start[b], pk.block_start[b] + pk.block_size[b]):
                ranks[r] = list(ids)
        schedule.append(ranks)
    return schedule


# ------------------------------------------------------------------------------------------- Megatron's name


class BalancedCPScheduler:
    """`schedule_hybrid_cp` under Megatron-core's scheduler name and call shape, for code ported from Megatron.

    ``BalancedCPScheduler(max_seq_len_per_rank, dp_cp_group).get_groups_and_subsamples(sample_id_seqlens, config)``
    returns ``(groups, sample_id_groups)`` as Megatron's does: ``sample_id_groups[g][r]`` are the ids rank ``r`` runs
    in group ``g`` and ``groups[g][r]`` their lengths. The placement is this module's (see [Note: how groups are
    built]), not Megatron's greedy one: it keeps every invariant Megatron's consumers rely on (each id in one group,
    aligned power-of-two blocks with identical lists, no idle rank) and balances better.

    Args:
        max_seq_len_per_rank: Most tokens of one sub-sample a rank may hold (Megatron's
            ``max_seqlen_per_dp_cp_rank``).
        dp_cp_group: The DP×CP process group whose size is the number of ranks; the default group if None. Its size
            is read at the first schedule, not here.
        cost: ``cost(length, cp)``; `quadratic_cost` (Megatron's ``L**2 / cp``) if None.
        dp_cp_size: The number of ranks, for use without a process group (pure scheduling); overrides the group.

    Raises:
        ValueError: If ``max_seq_len_per_rank`` or ``dp_cp_size`` is not a positive int.
    """

    max_seq_len_per_rank: int
    dp_cp_group: ProcessGroup | None
    cost: CostFn
    _dp_cp_size: int | None

    def __init__(
        self,
        max_seq_len_per_rank: int,
        dp_cp_group: ProcessGroup | None = None,
        *,
        cost: CostFn | None = None,
        dp_cp_size: int | None = None,
    ) -> None:
        for name, value in (("max_seq_len_per_rank", max_seq_len_per_rank), ("dp_cp_size", dp_cp_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"BalancedCPScheduler: {name} must be a positive int, got {value!r}.")
        self.max_seq_len_per_rank = max_seq_len_per_rank
        self.dp_cp_group = dp_cp_group
        self.cost = quadratic_cost if cost is None else cost
        self._dp_cp_size = dp_cp_size

    @property
    def total_hdp_gpus(self) -> int:
        """Ranks of the DP×CP domain (Megatron's attribute name)."""
        if self._dp_cp_size is not None:
            return self._dp_cp_size
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "BalancedCPScheduler: torch.distributed is not initialised, so the DP×CP size is unknown; call "
                "init_process_group first, or pass dp_cp_size= to schedule without processes."
            )
        return dist.get_world_size(self.dp_cp_group)

    def gpus_needed(self, seq_len: int) -> int:
        """The power-of-two CP size a sub-sample of ``seq_len`` tokens needs (`cp_size_needed`; not capped)."""
        return cp_size_needed(int(seq_len), self.max_seq_len_per_rank)

    def get_total_workload(self, seq_len: int, cp_size: int | None = None) -> float:
        """Per-rank cost of ``seq_len`` tokens on ``cp_size`` ranks (`gpus_needed` if None)."""
        return float(self.cost(int(seq_len), self.gpus_needed(seq_len) if cp_size is None else cp_size))

    def get_groups_and_subsamples(
        self, sample_id_seqlens: Sequence[tuple[int, int]], config: Any = None
    ) -> tuple[list[list[list[int]]], HybridCPSchedule]:
        """Schedules ``(id, length)`` pairs; returns ``(groups, sample_id_groups)``.

        Args:
            sample_id_seqlens: ``(global id, length)`` of every sub-sample (ids need not be contiguous; each once).
            config: Accepted for Megatron's call shape and not read (the settings are the constructor's).

        Returns:
            ``groups[g][r]``: the lengths of ``sample_id_groups[g][r]``, the ids rank ``r`` runs in group ``g`` in
            execution order.

        Raises:
            ValueError: If an id repeats, or as `schedule_hybrid_cp` does.
        """
        ids = [int(gid) for gid, _ in sample_id_seqlens]
        lengths = [int(length) for _, length in sample_id_seqlens]
        if len(set(ids)) != len(ids):
            repeated = sorted({gid for gid in ids if ids.count(gid) > 1})
            raise ValueError(f"BalancedCPScheduler: sub-sample ids {repeated[:8]} appear more than once.")
        by_index = schedule_hybrid_cp(lengths, self.total_hdp_gpus, self.max_seq_len_per_rank, self.cost)
        sample_id_groups = [[[ids[i] for i in ranks] for ranks in group] for group in by_index]
        groups = [[[lengths[i] for i in ranks] for ranks in group] for group in by_index]
        return groups, sample_id_groups


# ------------------------------------------------------------------------------------------------------ stats


def schedule_stats(schedule: HybridCPSchedule, seqlens: Sequence[int], cost: CostFn | None = None) -> ScheduleStats:
    """Measures a schedule: efficiency, groups, token-weighted CP size and per-group imbalance.

    A sub-sample's CP size in group ``g`` is the number of ranks whose list in ``g`` holds it.

    Args:
        schedule: A schedule as returned by `schedule_hybrid_cp`.
        seqlens: The lengths it was computed from.
        cost: The cost model to measure with; `quadratic_cost` if None.

    Returns:
        The `ScheduleStats`. For an empty schedule, efficiency 1.0 and zeros elsewhere.
    """
    cost_fn = quadratic_cost if cost is None else cost
    if not schedule:
        return ScheduleStats(1.0, 0, 0.0, 0.0, 0.0, ())
    n = len(schedule[0])
    busy = scheduled = tokens = token_cp = 0.0
    imbalance: list[float] = []
    for group in schedule:
        cp: dict[int, int] = {}
        for ids in group:
            for gid in ids:
                cp[gid] = cp.get(gid, 0) + 1
        loads = [sum(cost_fn(seqlens[gid], cp[gid]) for gid in ids) for ids in group]
        busy += sum(loads)
        scheduled += max(loads)
        imbalance.append((max(loads) - min(loads)) / max(loads) if max(loads) > 0 else 0.0)
        for gid, c in cp.items():
            tokens += seqlens[gid]
            token_cp += seqlens[gid] * c
    ideal = busy / n
    return ScheduleStats(
        efficiency=ideal / scheduled if scheduled > 0 else 1.0,
        num_groups=len(schedule),
        mean_cp_size=token_cp / tokens if tokens else 0.0,
        scheduled_time=scheduled,
        ideal_time=ideal,
        group_imbalance=tuple(imbalance),
    )
