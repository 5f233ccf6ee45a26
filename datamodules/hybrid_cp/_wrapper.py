"""`HybridCPDataLoaderWrapper`: unpack packed batches, schedule them over DP×CP, and reroute sub-samples.

On every ``next`` the wrapper (1) pulls this DP replica's packed batch and unpacks it into sub-samples along its
``cu_seqlens``, (2) all-gathers the sub-sample lengths and numbers them with global ids, (3) computes one schedule
with `schedule_hybrid_cp` (identical on every rank, no RNG), (4) moves every sub-sample to the ranks that run it with
one ``all_to_all_single`` per step, and (5) returns this rank's sub-samples in execution order with the CP size and
block each one runs on.

[Note: Megatron's call sequence]
Megatron-core's ``HybridCPDataLoaderWrapper`` documents these steps as public methods, and ports call them directly;
here they have the same names, parameters and return shapes, and ``__next__`` is nothing but their composition:
``unpack_batch(batch)``; ``get_global_seqlens(subsample_seqlens) -> (seqlens_gathered, offsets)``;
``get_global_id_seqlens(num_local_subsamples, offsets, seqlens_gathered) -> (global_id_seqlens,
global_ids_this_rank)``; ``cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, config) -> (groups,
sample_id_groups)`` (`BalancedCPScheduler`, our scheduler under Megatron's name); and
``reroute_samples_to_hdp_ranks(batch, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets) -> {gid:
sub-sample}``, which asks ``_gid_to_src_rank(gid, offsets)`` where each gid comes from. Three deliberate differences:
the batch is unpacked before the collectives rather than after the schedule (the same sub-samples either way, but a
malformed batch fails locally first); the lengths are gathered over the DP×CP group rather than the DP group (the same
result, plus the replica check below); and ``next`` returns a `HybridCPBatch`, which unpacks as Megatron's ``(samples,
sample_id_groups)`` tuple and also carries each sub-sample's CP size and block.

[Note: rank layout and the one process group]
The DP×CP domain is one process group of ``n`` ranks (``dp_cp_group`` or ``pg_collection.dp_cp``, the default group if
None). Without a DP group, rank ``h`` of it is CP index ``h % cp_size`` of data replica ``h // cp_size`` (Megatron's
order, CP inside DP): the ``cp_size`` consecutive ranks of a replica receive the same packed batches from their
loaders (as with static CP, where every CP rank of a DP replica reads the same samples). With ``pg_collection.dp``,
the DP group names this rank's peers (one per replica, same CP index) and any layout works; ranks are mapped through
the groups, not through global-rank arithmetic. Lengths are all-gathered over the whole DP×CP group rather than a
separate DP group: the replica members' copies are redundant, which lets the wrapper *check* that they agree (a
desynchronised loader would otherwise hang or train on wrong data). The all-to-all is also over the DP×CP group, but
only pairs of ranks with the same CP index exchange data, so each source tensor is read from exactly one rank of its
replica.

[Note: one byte-level all-to-all]
Each sub-sample travels as one ``uint8`` tensor of shape ``[L, width]``: row ``t`` holds the bytes of token ``t`` of
every key, keys in sorted order. One ``all_to_all_single`` per step therefore moves every key, any dtype survives
bit-exactly (gloo has no all-to-all for bool, int16 and others), and the receiver views the bytes back as the
original dtypes and per-token shapes, which all ranks agree on beforehand (a rank may hold no sub-sample itself).

[Note: global ids]
Replica ``d`` contributes its ``c_d`` non-empty sub-samples in batch order (sample by sample, ``cu_seqlens`` order);
global id ``offsets[d] + j`` names the ``j``-th of them, with ``offsets`` the exclusive prefix sum of ``c``.
Zero-length entries of ``cu_seqlens`` (padding that repeats the last offset) get no id.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from zlightning.parallel import zigzag_positions

from ._schedule import BalancedCPScheduler, CostFn, HybridCPSchedule

__all__ = [
    "HybridCPBatch",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPSubSample",
    "PackedBatch",
    "unpack_packed_batch",
    "zigzag_shard",
]

PackedBatch: TypeAlias = Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]]
"""One packed sample (a dict with ``cu_seqlens`` and token-aligned tensors) or a list of them."""


@dataclass(frozen=True, kw_only=True)
class HybridCPConfig:
    """Settings of `HybridCPDataLoaderWrapper`.

    Raises:
        ValueError: If a field is out of range.
    """

    max_seqlen_per_rank: int
    """Most tokens of one sub-sample a rank may hold; a sub-sample of length ``L`` runs on at least
    ``L / max_seqlen_per_rank`` ranks (rounded up to a power of two). A good start: max sequence length / CP size."""
    cp_size: int = 1
    """Consecutive DP×CP ranks that share one data replica (read the same packed batches). See
    [Note: rank layout and the one process group]."""
    cost: CostFn | None = None
    """Per-rank cost ``cost(length, cp)`` for the scheduler; ``L**2 / cp`` if None. See [Note: cost model] in
    ``_schedule.py``."""
    ignored_keys: tuple[str, ...] = ("cu_seqlens", "max_seqlen", "batch_idx")
    """Batch keys that are not token-aligned and are dropped from the sub-samples."""
    check_replicas: bool = True
    """Raise if the ranks of one data replica unpacked different lengths (a desynchronised input pipeline)."""

    @classmethod
    def from_megatron(cls, config: Any, **overrides: Any) -> HybridCPConfig:
        """The settings of a Megatron-style config object, read by attribute name.

        Reads ``max_seqlen_per_dp_cp_rank`` (required) and ``context_parallel_size`` (1 if absent), as Megatron's
        ``ModelParallelConfig`` / ``TransformerConfig`` name them; other attributes are not read.

        Args:
            config: Any object with those attributes (a Megatron config, a ``SimpleNamespace``, a dataclass).
            **overrides: Other `HybridCPConfig` fields (``cost``, ``ignored_keys``, ``check_replicas``).

        Raises:
            TypeError: If ``config`` has no ``max_seqlen_per_dp_cp_rank`` attribute.
            ValueError: If an attribute is None or not a positive int.
        """
        missing = object()
        seqlen = getattr(config, "max_seqlen_per_dp_cp_rank", missing)
        if seqlen is missing:
            raise TypeError(
                f"HybridCPConfig.from_megatron: config ({type(config).__name__}) has no attribute "
                f"'max_seqlen_per_dp_cp_rank'. Pass a HybridCPConfig, or an object with Megatron's attribute names "
                f"(max_seqlen_per_dp_cp_rank, context_parallel_size)."
            )
        cp = getattr(config, "context_parallel_size", 1)
        for name, value in (("max_seqlen_per_dp_cp_rank", seqlen), ("context_parallel_size", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                hint = " (Megatron's --max-seqlen-per-dp-cp-rank must be set for hybrid CP)" if value is None else ""
                raise ValueError(
                    f"HybridCPConfig.from_megatron: config.{name} must be a positive int, got {value!r}{hint}."
                )
        return cls(max_seqlen_per_rank=cast(int, seqlen), cp_size=cp, **overrides)  # checked above

    def __post_init__(self) -> None:
        for name in ("max_seqlen_per_rank", "cp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"HybridCPConfig: {name} must be a positive int, got {value!r}.")
        if "cu_seqlens" not in self.ignored_keys:
            raise ValueError("HybridCPConfig: ignored_keys must contain 'cu_seqlens' (it is not token-aligned).")


@dataclass(frozen=True)
class HybridCPSubSample:
    """One sub-sample this rank runs, with where it runs."""

    gid: int
    """Global id (index into `HybridCPBatch.seqlens`)."""
    group: int
    """Group (barrier round) it runs in."""
    cp_size: int
    """Ranks that run it together (its context-parallel size)."""
    block_start: int
    """First DP×CP rank of its block; the block is ``range(block_start, block_start + cp_size)``."""
    data: dict[str, Tensor]
    """Every token-aligned key of the batch, sliced to this sub-sample (length ``seqlens[gid]`` along dim 0)."""


@dataclass(frozen=True)
class HybridCPBatch:
    """What `HybridCPDataLoaderWrapper` returns for one global batch on one rank.

    It unpacks as Megatron's ``(samples, sample_id_groups)``: ``samples, sample_id_groups = next(wrapper)``.
    """

    sub_samples: list[HybridCPSubSample]
    """This rank's sub-samples in execution order (group by group)."""
    schedule: HybridCPSchedule
    """The full schedule, identical on every rank: ``schedule[g][r]`` are the gids rank ``r`` runs in group ``g``."""
    seqlens: list[int]
    """Length of every sub-sample of the global batch, by global id."""
    total_tokens: int = field(init=False)
    """Tokens in the global batch: the normaliser of a per-token loss that must not depend on placement."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "total_tokens", sum(self.seqlens))

    @property
    def num_groups(self) -> int:
        return len(self.schedule)

    @property
    def samples(self) -> dict[int, dict[str, Tensor]]:
        """``{gid: sub-sample}`` for every sub-sample this rank runs (Megatron's first return value)."""
        return {s.gid: s.data for s in self.sub_samples}

    @property
    def sample_id_groups(self) -> HybridCPSchedule:
        """The schedule under Megatron's name: ``sample_id_groups[g][r]``."""
        return self.schedule

    def __iter__(self) -> Iterator[Any]:
        """Yields ``samples`` then ``sample_id_groups``, so the batch unpacks as Megatron's tuple."""
        return iter((self.samples, self.schedule))

    def to(self, device: torch.device | str) -> HybridCPBatch:
        """The same batch with every sub-sample tensor on ``device`` (what a Lightning module's
        ``transfer_batch_to_device`` returns)."""
        subs = [
            HybridCPSubSample(s.gid, s.group, s.cp_size, s.block_start, {k: v.to(device) for k, v in s.data.items()})
            for s in self.sub_samples
        ]
        return HybridCPBatch(subs, self.schedule, self.seqlens)


def unpack_packed_batch(
    batch: PackedBatch, ignored_keys: Sequence[str] = ("cu_seqlens", "max_seqlen", "batch_idx")
) -> list[dict[str, Tensor]]:
    """Splits packed samples into their non-empty sub-samples, in batch order.

    Args:
        batch: One packed sample or a list of them. Each holds a 1-D integer ``cu_seqlens`` (``0 = cu[0] <= cu[1]
            <= ...``) and token-aligned tensors whose dim 0 has ``cu[-1]`` entries.
        ignored_keys: Keys dropped from the sub-samples.

    Returns:
        One dict per non-empty ``[cu[i], cu[i+1])`` with every other key sliced along dim 0 (views, not copies).

    Raises:
        ValueError: If ``cu_seqlens`` is missing or malformed, a kept value is not a tensor with ``cu[-1]`` rows, or
            the samples do not all have the same keys, and per key the same dtype and per-token shape.
    """
    samples = [batch] if isinstance(batch, Mapping) else list(batch)
    out: list[dict[str, Tensor]] = []
    keys: list[str] | None = None
    kinds: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}  # key -> (dtype, per-token shape) of the first sample
    for s, sample in enumerate(samples):
        cu = _checked_cu_seqlens(sample, s)
        kept = sorted(k for k in sample if k not in ignored_keys)
        if not kept:
            raise ValueError(f"unpack_packed_batch: sample {s} has no token-aligned key besides {sorted(sample)}.")
        if keys is None:
            keys = kept
        elif kept != keys:
            raise ValueError(f"unpack_packed_batch: sample {s} has keys {kept}, sample 0 has {keys}; all must match.")
        for key in kept:
            value = sample[key]
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != cu[-1]:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(
                    f"unpack_packed_batch: sample {s} key {key!r} is {shape}, but every kept key must be a tensor "
                    f"with cu_seqlens[-1]={cu[-1]} rows. Add the key to HybridCPConfig.ignored_keys if it is not "
                    f"token-aligned."
                )
            # the sub-samples travel as rows of one byte layout (see [Note: one byte-level all-to-all])
            kind = kinds.setdefault(key, (value.dtype, tuple(value.shape[1:])))
            if (value.dtype, tuple(value.shape[1:])) != kind:
                raise ValueError(
                    f"unpack_packed_batch: sample {s} key {key!r} is {value.dtype} with per-token shape "
                    f"{tuple(value.shape[1:])}, but an earlier sample's is {kind[0]} with {kind[1]}; every sample "
                    f"of a batch must give a key the same dtype and per-token shape (cast or pad it in the dataset "
                    f"or collate function)."
                )
        for lo, hi in zip(cu[:-1], cu[1:]):
            if hi > lo:
                out.append({key: sample[key][lo:hi] for key in kept})
    return out


def zigzag_shard(data: Mapping[str, Tensor], cp_size: int, cp_rank: int) -> dict[str, Tensor]:
    """This block rank's zigzag share of a sub-sample, for causal context-parallel attention.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank ``r`` of the block takes chunks ``r`` and
    ``2 * cp_size - 1 - r``, so every rank holds one early and one late chunk and does the same causal-attention work.
    Keep ``position_ids`` (or pass `zigzag_positions`) so attention can mask by original position.

    Args:
        data: A sub-sample's token-aligned tensors (all with the same length ``L`` along dim 0).
        cp_size: Ranks in the block (`HybridCPSubSample.cp_size`).
        cp_rank: This rank's position in the block (``rank - block_start``).

    Returns:
        Every key with this rank's ``L / cp_size`` rows (its two chunks, in order).

    Raises:
        ValueError: If ``cp_rank`` is outside the block, or ``cp_size > 1`` and ``L`` is not divisible by
            ``2 * cp_size`` (a block of one rank takes the whole sub-sample, of any length).
    """
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"zigzag_shard: cp_rank={cp_rank} is outside a block of cp_size={cp_size}.")
    index = None
    out: dict[str, Tensor] = {}
    for key, value in data.items():
        if index is None:
            index = zigzag_positions(value.shape[0], cp_size, cp_rank)
        out[key] = value.index_select(0, index)
    return out


def _checked_cu_seqlens(sample: Mapping[str, Any], index: int) -> list[int]:
    cu_t = sample.get("cu_seqlens")
    if not isinstance(cu_t, Tensor) or cu_t.dim() != 1 or cu_t.numel() < 1 or cu_t.is_floating_point():
        raise ValueError(
            f"unpack_packed_batch: sample {index} needs a 1-D integer tensor 'cu_seqlens' (cumulative sub-sample "
            f"offsets starting at 0), got {cu_t!r:.80}."
        )
    cu = [int(v) for v in cu_t.tolist()]
    if cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"unpack_packed_batch: sample {index} cu_seqlens {cu} must start at 0 and never decrease.")
    return cu


class HybridCPDataLoaderWrapper:
    """Turns each DP replica's packed batches into balanced, rerouted hybrid-CP sub-samples. See the module docs.

    The constructor and the methods have Megatron-core's names, parameters and return shapes (see [Note: Megatron's
    call sequence]), so code written against Megatron's wrapper runs unchanged; the typed `HybridCPConfig` and the
    keyword ``dp_cp_group`` remain for new code. ``next`` returns a `HybridCPBatch`, which also unpacks as Megatron's
    ``(samples, sample_id_groups)``.

    Construction is side-effect free; collectives run on ``next`` (and in the methods that say so). Every rank of the
    DP×CP group must call ``next`` the same number of times (every call runs collectives).

    Args:
        data_iterator: Yields this replica's packed batches (`PackedBatch`). None on ranks that read no data
            (Megatron's tensor-parallel ranks other than 0): ``next`` then returns ``(None, None)`` and runs nothing.
        config: A `HybridCPConfig`, or any object with Megatron's attribute names (``max_seqlen_per_dp_cp_rank``,
            ``context_parallel_size``), read by `HybridCPConfig.from_megatron`.
        pg_collection: Megatron-style process groups by attribute name: ``dp_cp`` (required), and optionally ``dp``
            (this rank's DP peers, which fixes the rank layout and the CP size), ``cp`` (its size is checked) and
            ``tp`` (not needed: ranks are mapped through the groups). None: ``dp_cp_group``, or the default group.
        dp_cp_group: The DP×CP process group (``n`` ranks, a power of two) when no ``pg_collection`` is given; the
            default group if None. Rank layout: [Note: rank layout and the one process group].

    Raises:
        TypeError: If ``config`` is neither a `HybridCPConfig` nor has ``max_seqlen_per_dp_cp_rank``, or
            ``pg_collection`` has no ``dp_cp`` group.
        ValueError: If a config attribute is invalid, or both ``pg_collection`` and ``dp_cp_group`` are given.
    """

    config: HybridCPConfig
    data_iterator: Iterable[PackedBatch] | None
    cp_balancing_scheduler: BalancedCPScheduler
    _iterator: Iterator[PackedBatch] | None
    _group: ProcessGroup | None
    _dp_group: ProcessGroup | None
    _cp_group: ProcessGroup | None
    _tp_group: ProcessGroup | None
    _layout_cache: _Layout | None

    def __init__(
        self,
        data_iterator: Iterable[PackedBatch] | None,
        config: HybridCPConfig | Any,
        pg_collection: Any = None,
        *,
        dp_cp_group: ProcessGroup | None = None,
    ) -> None:
        self.config = config if isinstance(config, HybridCPConfig) else HybridCPConfig.from_megatron(config)
        self.data_iterator = data_iterator
        self._iterator = None
        self._layout_cache = None
        self._tp_group = None if pg_collection is None else getattr(pg_collection, "tp", None)
        if pg_collection is None:
            self._group, self._dp_group, self._cp_group = dp_cp_group, None, None
        elif dp_cp_group is not None:
            raise ValueError(
                "HybridCPDataLoaderWrapper: pass the DP×CP group either as pg_collection.dp_cp or as dp_cp_group=, "
                "not both."
            )
        else:
            self._group = getattr(pg_collection, "dp_cp", None)
            if self._group is None:
                raise TypeError(
                    f"HybridCPDataLoaderWrapper: pg_collection ({type(pg_collection).__name__}) has no 'dp_cp' group. "
                    f"Pass an object whose attribute dp_cp is the DP×CP process group (Megatron's "
                    f"ProcessGroupCollection), or pass dp_cp_group= instead."
                )
            self._dp_group = getattr(pg_collection, "dp", None)
            self._cp_group = getattr(pg_collection, "cp", None)
        self.cp_balancing_scheduler = BalancedCPScheduler(
            self.config.max_seqlen_per_rank, self._group, cost=self.config.cost
        )

    @property
    def dp_cp_group(self) -> ProcessGroup | None:
        """The DP×CP process group (None: the default group)."""
        return self._group

    @property
    def dp_group(self) -> ProcessGroup | None:
        """``pg_collection.dp`` if one was given; None means the DP peers follow the rank layout."""
        return self._dp_group

    @property
    def tp_group(self) -> ProcessGroup | None:
        """``pg_collection.tp`` if one was given (kept for Megatron code that reads it; ranks are mapped through the
        DP and DP×CP groups, so the wrapper itself does not need it)."""
        return self._tp_group

    @property
    def total_hdp_gpus(self) -> int:
        """Ranks of the DP×CP group (Megatron's attribute name); needs an initialised process group."""
        return self._layout().size

    def __iter__(self) -> HybridCPDataLoaderWrapper:
        """Returns self; a pass over the wrapped iterable (a new epoch of a ``DataLoader``) starts at the next ``next``.

        Lazily: frameworks call ``iter()`` just to check that a loader is iterable (Lightning does), and an eager
        ``iter(source)`` would start (and, for a sampler with epochs, skip) an epoch there.
        """
        self._iterator = None
        return self

    def __len__(self) -> int:
        """Global batches per pass: the wrapped iterable's length.

        Raises:
            TypeError: If the wrapped iterable has no length.
        """
        return len(self.data_iterator)  # type: ignore[arg-type]

    def __next__(self) -> HybridCPBatch | tuple[None, None]:
        """One global batch: the five steps of [Note: Megatron's call sequence], composed of the public methods.

        Returns:
            This rank's `HybridCPBatch` (it unpacks as ``(samples, sample_id_groups)``), or ``(None, None)`` without
            any collective when ``data_iterator`` is None.

        Raises:
            StopIteration: When the wrapped iterable is exhausted.
            RuntimeError: If torch.distributed is not initialised, or the ranks of a replica read different batches.
            ValueError: If a batch is malformed or the groups do not match the config.
        """
        if self.data_iterator is None:
            return None, None
        if self._iterator is None:
            self._iterator = iter(self.data_iterator)
        batch = self._next_on_every_rank()  # step 1 (and 4: checks the batch before any collective)
        subsample_seqlens = torch.tensor([_sub_sample_length(s) for s in batch], dtype=torch.int32)
        seqlens_gathered, offsets = self.get_global_seqlens(subsample_seqlens)  # step 2
        global_id_seqlens, global_ids_this_rank = self.get_global_id_seqlens(len(batch), offsets, seqlens_gathered)
        _, sample_id_groups = self.cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, self.config)
        samples = self.reroute_samples_to_hdp_ranks(  # step 4
            batch, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets
        )
        return HybridCPBatch(
            _sub_samples(sample_id_groups, self._layout().rank, samples), sample_id_groups, seqlens_gathered
        )

    def _next_on_every_rank(self) -> list[dict[str, Tensor]]:
        """This rank's next batch, unpacked, once every rank of the group has one.

        [Note: ranks that run out or fail alone]
        A rank whose loader is exhausted, or whose batch is malformed, would otherwise stop (or raise) before the
        collectives its peers are already waiting in: they would hang until the process group's timeout. So the
        ranks first exchange one status each: all exhausted ends the iteration everywhere; some exhausted, or a
        malformed batch anywhere, raises on every rank with what happened and where.
        """
        status, error, batch = 0, "", []
        failure: Exception | None = None
        try:
            batch = self.unpack_batch(next(self._iterator))  # type: ignore[arg-type]
        except StopIteration:
            status = 1
        except (ValueError, TypeError) as err:
            status, error, failure = 2, f"{type(err).__name__}: {err}", err
        lay = self._layout()
        if lay.size == 1:
            if status == 1:
                raise StopIteration
            if failure is not None:
                raise failure
            return batch
        statuses = torch.empty(lay.size, dtype=torch.int64, device=lay.device)
        dist.all_gather_into_tensor(statuses, torch.tensor([status], device=lay.device), group=self._group)
        seen = statuses.tolist()
        if max(seen) == 0:
            return batch
        if 2 in seen:
            errors: list[Any] = [None] * lay.size
            dist.all_gather_object(errors, error, group=self._group)
            bad = {r: e for r, e in enumerate(errors) if e}
            if failure is not None:
                raise failure
            raise RuntimeError(f"HybridCPDataLoaderWrapper: a malformed batch on group rank(s) {sorted(bad)}: {bad}")
        if min(seen) == 1:
            raise StopIteration
        done = [r for r, v in enumerate(seen) if v == 1]
        raise RuntimeError(
            f"HybridCPDataLoaderWrapper: the data of group rank(s) {done} ran out while the other ranks still had "
            "batches; every DP rank must read the same number of batches (a DistributedSampler over the DP ranks "
            "with drop_last=True, or equally sized shards)"
        )

    # ------------------------------------------------------------------------------ Megatron's documented methods

    def get_global_seqlens(self, subsample_seqlens: Tensor | Sequence[int]) -> tuple[list[int], Tensor]:
        """All-gathers every DP rank's sub-sample lengths (a collective over the DP×CP group).

        Args:
            subsample_seqlens: This rank's non-empty sub-sample lengths in batch order (1-D int tensor or ints).

        Returns:
            ``(seqlens_gathered, offsets)``: every DP rank's lengths concatenated in DP-rank order (a list of ints,
            indexed by global id), and ``offsets``, a 1-D int32 CPU tensor with one entry per DP rank, the exclusive
            prefix sum of the per-rank counts (entry ``d`` is DP rank ``d``'s first global id). See
            [Note: global ids].

        Raises:
            RuntimeError: If the ranks of one data replica passed different lengths (``check_replicas``).
        """
        lay = self._layout()
        local = [
            int(v) for v in (subsample_seqlens.tolist() if isinstance(subsample_seqlens, Tensor) else subsample_seqlens)
        ]
        info = torch.empty(2 * lay.size, dtype=torch.int64, device=lay.device)
        mine = torch.tensor([len(local), lay.dp_rank], dtype=torch.int64, device=lay.device)
        dist.all_gather_into_tensor(info, mine, group=self._group)
        counts, dp_of = info[0::2].tolist(), info[1::2].tolist()
        width = max(1, max(counts))
        padded = torch.zeros(width, dtype=torch.int64)
        padded[: len(local)] = torch.tensor(local, dtype=torch.int64)
        table = torch.empty(lay.size * width, dtype=torch.int64, device=lay.device)
        dist.all_gather_into_tensor(table, padded.to(lay.device), group=self._group)
        table = table.cpu()
        rows = [table[r * width : r * width + counts[r]].tolist() for r in range(lay.size)]
        replicas = self._replica_rows(rows, dp_of)
        offsets = [0]
        for row in replicas[:-1]:
            offsets.append(offsets[-1] + len(row))
        return [length for row in replicas for length in row], torch.tensor(offsets, dtype=torch.int32)

    def get_global_id_seqlens(
        self, num_local_subsamples: int, offsets: Tensor | Sequence[int], seqlens_gathered: Sequence[int]
    ) -> tuple[list[tuple[int, int]], Tensor]:
        """Numbers the gathered sub-samples (no collective).

        Args:
            num_local_subsamples: This rank's non-empty sub-samples.
            offsets: As returned by `get_global_seqlens`.
            seqlens_gathered: As returned by `get_global_seqlens`.

        Returns:
            ``(global_id_seqlens, global_ids_this_rank)``: ``[(gid, length)]`` for every gid, identical on every rank;
            and this rank's gids ``offsets[dp_rank] .. offsets[dp_rank] + num_local_subsamples - 1`` as an int32 CPU
            tensor.

        Raises:
            ValueError: If this rank's gids run past ``seqlens_gathered``.
        """
        start = _offset_list(offsets)[self._layout().dp_rank]
        if start + int(num_local_subsamples) > len(seqlens_gathered):
            raise ValueError(
                f"HybridCPDataLoaderWrapper.get_global_id_seqlens: {num_local_subsamples} local sub-samples from gid "
                f"{start} run past the {len(seqlens_gathered)} gathered ones; pass the offsets and seqlens_gathered "
                f"that get_global_seqlens returned for this batch."
            )
        global_id_seqlens = [(gid, int(length)) for gid, length in enumerate(seqlens_gathered)]
        return global_id_seqlens, torch.arange(start, start + int(num_local_subsamples), dtype=torch.int32)

    def _gid_to_src_rank(self, gid: int, offsets: Tensor | Sequence[int]) -> int:
        """The DP×CP rank that sends ``gid`` to this rank: the member with this rank's CP index of the DP rank that
        holds ``gid`` (the ``d`` with ``offsets[d] <= gid < offsets[d + 1]``)."""
        bounds = _offset_list(offsets)
        if int(gid) < 0:
            raise ValueError(f"HybridCPDataLoaderWrapper._gid_to_src_rank: gid must be >= 0, got {gid}.")
        return self._layout().peers[bisect.bisect_right(bounds, int(gid)) - 1]

    def unpack_batch(self, batch: PackedBatch) -> list[dict[str, Tensor]]:
        """This rank's packed samples as non-empty sub-samples in batch order (`unpack_packed_batch` with the
        config's ``ignored_keys``); local index ``i`` is gid ``offsets[dp_rank] + i``."""
        return unpack_packed_batch(batch, self.config.ignored_keys)

    def reroute_samples_to_hdp_ranks(
        self,
        batch: Sequence[Mapping[str, Tensor]],
        global_ids_this_rank: Tensor | Sequence[int],
        global_id_seqlens: Sequence[tuple[int, int]],
        sample_id_groups: HybridCPSchedule,
        offsets: Tensor | Sequence[int],
    ) -> dict[int, dict[str, Tensor]]:
        """Moves every sub-sample to the ranks that run it (collectives over the DP×CP group).

        Only ranks with the same CP index exchange data (the members of a replica hold the same sub-samples); every
        key travels in one byte-level ``all_to_all_single`` ([Note: one byte-level all-to-all]), on the device of the
        group's backend (CUDA for NCCL).

        Args:
            batch: This rank's unpacked sub-samples (`unpack_batch`), in gid order.
            global_ids_this_rank: Their gids (`get_global_id_seqlens`).
            global_id_seqlens: ``[(gid, length)]`` of the global batch.
            sample_id_groups: ``sample_id_groups[g][r]``, the schedule.
            offsets: As returned by `get_global_seqlens`.

        Returns:
            ``{gid: {key: tensor}}`` for exactly the gids this rank runs in any group, ordered by source rank, then
            gid; tensors are bit-exact copies of the source slices (dtypes and per-token shapes kept).

        Raises:
            ValueError: If ``batch`` and ``global_ids_this_rank`` differ in length, a sub-sample's length differs from
                ``global_id_seqlens``, the schedule does not have one list per rank, or the ranks' keys, dtypes or
                per-token shapes differ.
        """
        lay = self._layout()
        local = self._local_by_gid(batch, global_ids_this_rank, global_id_seqlens)
        seqlen = {int(gid): int(length) for gid, length in global_id_seqlens}
        runs = _runs_per_rank(sample_id_groups, lay.size)
        send = {d: sorted(g for g in runs[d] if g in local) for d in sorted(set(lay.peers))}
        recv_src = {g: self._gid_to_src_rank(g, offsets) for g in runs[lay.rank]}
        recv = sorted(runs[lay.rank], key=lambda g: (recv_src[g], g))
        schema = _schema(list(batch), self._group, lay.size)
        width = sum(_row_bytes(dtype, trailing) for dtype, trailing in schema.values())
        pieces = [_to_rows(local[g], schema) for d in send for g in send[d]]
        inp = torch.cat(pieces) if pieces else torch.empty((0, width), dtype=torch.uint8)
        in_split = [sum(seqlen[g] for g in send.get(d, [])) for d in range(lay.size)]
        out_split = [sum(seqlen[g] for g in recv if recv_src[g] == s) for s in range(lay.size)]
        buf = torch.empty((sum(out_split), width), dtype=torch.uint8, device=lay.device)
        dist.all_to_all_single(buf, inp.to(lay.device), out_split, in_split, group=self._group)
        rows = torch.split(buf, [seqlen[g] for g in recv])
        return {g: _from_rows(piece, schema) for g, piece in zip(recv, rows)}

    # -------------------------------------------------------------------------------------------- checkpointing

    def state_dict(self) -> dict[str, Any]:
        """The wrapper keeps no state of its own (no RNG); it saves the wrapped iterator's, if that is stateful."""
        inner = getattr(self.data_iterator, "state_dict", None)
        return {"data_iterator": inner()} if callable(inner) else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the wrapped iterator's state saved by `state_dict`; call it before the first ``next``."""
        if "data_iterator" in state:
            loader = getattr(self.data_iterator, "load_state_dict", None)
            if not callable(loader):
                raise ValueError(
                    "HybridCPDataLoaderWrapper: the state holds data_iterator state, but the wrapped "
                    "iterator has no load_state_dict."
                )
            loader(state["data_iterator"])
            self._iterator = None

    # ------------------------------------------------------------------------------------------------ internals

    def _layout(self) -> _Layout:
        """The rank layout, read from the process groups at first use. See [Note: rank layout and the one process
        group]."""
        if self._layout_cache is None:
            self._layout_cache = _Layout.resolve(self._group, self._dp_group, self._cp_group, self.config.cp_size)
        return self._layout_cache

    def _replica_rows(self, rows: list[list[int]], dp_of: list[int]) -> list[list[int]]:
        """One row of lengths per DP rank, after checking that the ranks of each replica agree."""
        members: list[list[int]] = [[] for _ in range(self._layout().size // self._layout().cp_size)]
        for r, d in enumerate(dp_of):
            members[d].append(r)
        for d, ranks in enumerate(members):
            if not ranks:
                raise AssertionError(f"no rank reported DP rank {d}: {dp_of=}")
            first = ranks[0]
            for r in ranks[1:] if self.config.check_replicas else ():
                if rows[r] != rows[first]:
                    raise RuntimeError(
                        f"HybridCPDataLoaderWrapper: ranks {first} and {r} belong to data replica {d} "
                        f"(cp_size={self._layout().cp_size}) but unpacked different sub-sample lengths "
                        f"({rows[first][:8]}... vs {rows[r][:8]}...). Every rank of a replica must read the same "
                        f"batches: check the sampler's DP rank/size, or set cp_size to the ranks per replica."
                    )
        return [rows[ranks[0]] for ranks in members]

    def _local_by_gid(
        self,
        batch: Sequence[Mapping[str, Tensor]],
        global_ids_this_rank: Tensor | Sequence[int],
        global_id_seqlens: Sequence[tuple[int, int]],
    ) -> dict[int, Mapping[str, Tensor]]:
        ids = [
            int(g)
            for g in (
                global_ids_this_rank.tolist() if isinstance(global_ids_this_rank, Tensor) else global_ids_this_rank
            )
        ]
        if len(ids) != len(batch):
            raise ValueError(
                f"HybridCPDataLoaderWrapper.reroute_samples_to_hdp_ranks: {len(batch)} local sub-samples but "
                f"{len(ids)} global_ids_this_rank; pass unpack_batch's list and get_global_id_seqlens's ids."
            )
        seqlen = dict(global_id_seqlens)
        for gid, sub in zip(ids, batch):
            if _sub_sample_length(sub) != int(seqlen.get(gid, -1)):
                raise ValueError(
                    f"HybridCPDataLoaderWrapper.reroute_samples_to_hdp_ranks: local sub-sample gid {gid} has "
                    f"{_sub_sample_length(sub)} tokens, global_id_seqlens says {seqlen.get(gid)}."
                )
        return dict(zip(ids, batch))


@dataclass(frozen=True)
class _Layout:
    """Where this rank sits in the DP×CP domain. See [Note: rank layout and the one process group]."""

    size: int
    """Ranks of the DP×CP group."""
    rank: int
    """This rank's position in it."""
    cp_size: int
    """Ranks per data replica."""
    dp_rank: int
    """This rank's data replica."""
    peers: tuple[int, ...]
    """DP×CP rank of every replica's member with this rank's CP index, by replica (``peers[dp_rank] == rank``)."""
    device: torch.device
    """Where collective buffers live: CUDA for NCCL, else CPU."""

    @staticmethod
    def resolve(
        group: ProcessGroup | None, dp_group: ProcessGroup | None, cp_group: ProcessGroup | None, cp_size: int
    ) -> _Layout:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HybridCPDataLoaderWrapper: torch.distributed is not initialised; call init_process_group (Lightning "
                "does it in the strategy's setup) before iterating."
            )
        n, me = dist.get_world_size(group), dist.get_rank(group)
        cuda = dist.get_backend(group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if dp_group is None:
            if n % cp_size:
                raise ValueError(
                    f"HybridCPDataLoaderWrapper: the DP×CP group has {n} ranks, not a multiple of cp_size={cp_size}. "
                    f"Set HybridCPConfig.cp_size (Megatron's context_parallel_size) to the ranks per data replica."
                )
            peers = tuple(d * cp_size + me % cp_size for d in range(n // cp_size))
            layout = _Layout(n, me, cp_size, me // cp_size, peers, device)
        else:
            layout = _Layout._from_dp_group(group, dp_group, n, me, cp_size, device)
        if cp_group is not None and dist.get_world_size(cp_group) != layout.cp_size:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: pg_collection.cp has {dist.get_world_size(cp_group)} ranks, but the "
                f"DP×CP group has {layout.cp_size} ranks per data replica; pass matching groups."
            )
        return layout

    @staticmethod
    def _from_dp_group(
        group: ProcessGroup | None, dp_group: ProcessGroup, n: int, me: int, cp_size: int, device: torch.device
    ) -> _Layout:
        dp_size = dist.get_world_size(dp_group)
        if n % dp_size or n // dp_size != cp_size:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: the DP×CP group has {n} ranks and pg_collection.dp {dp_size}, so "
                f"{n / dp_size:g} ranks per data replica, but the config says cp_size={cp_size} (Megatron's "
                f"context_parallel_size). Set it to {n // dp_size if n % dp_size == 0 else 'n / dp'}, or pass "
                f"matching groups."
            )
        members = dist.get_process_group_ranks(dp_group)
        try:
            peers = tuple(g if group is None else dist.get_group_rank(group, g) for g in members)
        except (ValueError, RuntimeError) as err:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: pg_collection.dp (global ranks {members}) is not inside the DP×CP group "
                f"pg_collection.dp_cp; the DP group must hold this rank's data-parallel peers within it."
            ) from err
        dp_rank = dist.get_rank(dp_group)
        if peers[dp_rank] != me:
            raise AssertionError(f"{peers=} {dp_rank=} {me=}")
        return _Layout(n, me, cp_size, dp_rank, peers, device)


def _sub_sample_length(sub: Mapping[str, Tensor]) -> int:
    return int(next(iter(sub.values())).shape[0])


def _offset_list(offsets: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (offsets.tolist() if isinstance(offsets, Tensor) else offsets)]


def _runs_per_rank(sample_id_groups: HybridCPSchedule, n: int) -> list[set[int]]:
    """The gids each rank runs in any group."""
    runs: list[set[int]] = [set() for _ in range(n)]
    for g, group in enumerate(sample_id_groups):
        if len(group) != n:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: sample_id_groups[{g}] has {len(group)} rank lists, the DP×CP group has "
                f"{n} ranks; pass the schedule computed for this group."
            )
        for r, ids in enumerate(group):
            runs[r].update(int(gid) for gid in ids)
    return runs


def _row_bytes(dtype: torch.dtype, trailing: tuple[int, ...]) -> int:
    return math.prod(trailing) * dtype.itemsize


def _to_rows(sub: Mapping[str, Tensor], schema: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> Tensor:
    """A sub-sample as one uint8 ``[L, width]`` tensor: each key's row bytes, keys in schema order."""
    length = next(iter(sub.values())).shape[0]
    cols = [sub[k].contiguous().view(torch.uint8).reshape(length, _row_bytes(*schema[k])) for k in schema]
    return torch.cat(cols, dim=1)


def _from_rows(rows: Tensor, schema: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict[str, Tensor]:
    """Inverse of `_to_rows`: bit-exact tensors with their original dtypes and shapes."""
    out: dict[str, Tensor] = {}
    col = 0
    for key, (dtype, trailing) in schema.items():
        nbytes = _row_bytes(dtype, trailing)
        raw = rows[:, col : col + nbytes].flatten().clone()  # own 1-D storage at offset 0: any dtype views it
        out[key] = raw.view(dtype).reshape(rows.shape[0], *trailing)
        col += nbytes
    return out


def _schema(
    local: Sequence[Mapping[str, Tensor]], group: ProcessGroup | None, n: int
) -> dict[str, tuple[torch.dtype, tuple]]:
    """Keys, dtypes and trailing shapes of the sub-samples, agreed by all ranks (a rank may have none locally)."""
    mine = {k: (v.dtype, tuple(v.shape[1:])) for k, v in local[0].items()} if local else None
    gathered: list[Any] = [None] * n
    dist.all_gather_object(gathered, mine, group=group)
    known = [s for s in gathered if s is not None]
    if not known:
        return {}
    for r, s in enumerate(gathered):
        if s is not None and s != known[0]:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: rank {r}'s batch keys/dtypes/shapes {s} differ from {known[0]}; every "
                f"rank's loader must produce the same keys with the same dtypes and per-token shapes."
            )
    return dict(sorted(known[0].items()))


def _sub_samples(
    schedule: HybridCPSchedule, me: int, received: dict[int, dict[str, Tensor]]
) -> list[HybridCPSubSample]:
    out: list[HybridCPSubSample] = []
    for g, group in enumerate(schedule):
        for gid in group[me]:
            ranks = [r for r, ids in enumerate(group) if gid in ids]
            out.append(HybridCPSubSample(gid, g, len(ranks), ranks[0], received[gid]))
    return out
