"""`HybridCPDataLoaderWrapper`: unpack packed batches, schedule them over DP×CP, and reroute sub-samples.

On every ``next`` the wrapper (1) pulls this DP replica's packed batch, (2) unpacks it into sub-samples along its
``cu_seqlens``, (3) all-gathers the sub-sample lengths over the DP×CP group, (4) numbers them with global ids,
(5) computes one schedule with `schedule_hybrid_cp` (identical on every rank, no RNG), (6) moves every sub-sample to
the ranks that run it with one ``all_to_all_single`` per key, and (7) returns this rank's sub-samples in execution
order with the CP size and block each one runs on.

[Note: rank layout and the one process group]
The DP×CP domain is one process group of ``n`` ranks (``dp_cp_group``, the default group if None). Rank ``h`` of it is
CP index ``h % cp_size`` of data replica ``h // cp_size``: the ``cp_size`` consecutive ranks of a replica receive the
same packed batches from their loaders (as with static CP, where every CP rank of a DP replica reads the same
samples). Lengths are all-gathered over the whole DP×CP group rather than a separate DP group: the replica members'
copies are redundant, which lets the wrapper *check* that they agree (a desynchronised loader would otherwise hang or
train on wrong data) and needs no extra group. The all-to-all is also over the DP×CP group, but only pairs of ranks
with the same CP index exchange data, so each source tensor is read from exactly one rank of its replica.

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

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from .hybrid_cp_schedule import CostFn, HybridCPSchedule, schedule_hybrid_cp

__all__ = [
    "HybridCPBatch",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPSubSample",
    "PackedBatch",
    "unpack_packed_batch",
    "zigzag_positions",
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
    ``hybrid_cp_schedule.py``."""
    ignored_keys: tuple[str, ...] = ("cu_seqlens", "max_seqlen", "batch_idx")
    """Batch keys that are not token-aligned and are dropped from the sub-samples."""
    check_replicas: bool = True
    """Raise if the ranks of one data replica unpacked different lengths (a desynchronised input pipeline)."""

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
    """What `HybridCPDataLoaderWrapper` returns for one global batch on one rank."""

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
            the samples do not all have the same keys.
    """
    samples = [batch] if isinstance(batch, Mapping) else list(batch)
    out: list[dict[str, Tensor]] = []
    keys: list[str] | None = None
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
        ValueError: If ``cp_rank`` is outside the block or ``L`` is not divisible by ``2 * cp_size``.
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


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> Tensor:
    """Positions (int64) of the tokens rank ``cp_rank`` of a ``cp_size`` block holds under `zigzag_shard`."""
    if length % (2 * cp_size):
        raise ValueError(
            f"zigzag_shard: a sub-sample of {length} tokens cannot be cut into 2 * cp_size = {2 * cp_size} equal "
            f"chunks; pad every sub-sample to a multiple of 2 * max CP size (Megatron requires the same)."
        )
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


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

    Construction is side-effect free; collectives run on ``next``. Every rank of the DP×CP group must call ``next``
    the same number of times (every call runs collectives).

    Args:
        data_iterator: Yields this replica's packed batches (`PackedBatch`).
        config: The `HybridCPConfig`.
        dp_cp_group: The DP×CP process group (``n`` ranks, a power of two); the default group if None.
    """

    config: HybridCPConfig
    _source: Iterable[PackedBatch]
    _iterator: Iterator[PackedBatch] | None
    _group: ProcessGroup | None

    def __init__(
        self, data_iterator: Iterable[PackedBatch], config: HybridCPConfig, *, dp_cp_group: ProcessGroup | None = None
    ) -> None:
        if not isinstance(config, HybridCPConfig):
            raise TypeError(f"HybridCPDataLoaderWrapper: config must be a HybridCPConfig, got {type(config).__name__}.")
        self.config = config
        self._source = data_iterator
        self._iterator = None
        self._group = dp_cp_group

    def __iter__(self) -> HybridCPDataLoaderWrapper:
        """Starts a pass over the wrapped iterable (a new epoch of a ``DataLoader``) at the first ``next``.

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
        return len(self._source)  # type: ignore[arg-type]

    def __next__(self) -> HybridCPBatch:
        if self._iterator is None:
            self._iterator = iter(self._source)
        local = unpack_packed_batch(next(self._iterator), self.config.ignored_keys)
        n, me = self._domain()
        seqlens, offsets = self._gather_seqlens([next(iter(s.values())).shape[0] for s in local], n, me)
        schedule = schedule_hybrid_cp(seqlens, n, self.config.max_seqlen_per_rank, self.config.cost)
        received = self._reroute(local, seqlens, offsets, schedule, n, me)
        return HybridCPBatch(_sub_samples(schedule, me, received), schedule, seqlens)

    def state_dict(self) -> dict[str, Any]:
        """The wrapper keeps no state of its own (no RNG); it saves the wrapped iterator's, if that is stateful."""
        inner = getattr(self._source, "state_dict", None)
        return {"data_iterator": inner()} if callable(inner) else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the wrapped iterator's state saved by `state_dict`; call it before the first ``next``."""
        if "data_iterator" in state:
            loader = getattr(self._source, "load_state_dict", None)
            if not callable(loader):
                raise ValueError("HybridCPDataLoaderWrapper: the state holds data_iterator state, but the wrapped "
                                 "iterator has no load_state_dict.")
            loader(state["data_iterator"])
            self._iterator = None

    # ------------------------------------------------------------------------------------------------ internals

    def _domain(self) -> tuple[int, int]:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HybridCPDataLoaderWrapper: torch.distributed is not initialised; call init_process_group (Lightning "
                "does it in the strategy's setup) before iterating."
            )
        n, me = dist.get_world_size(self._group), dist.get_rank(self._group)
        if n % self.config.cp_size:
            raise ValueError(
                f"HybridCPDataLoaderWrapper: the DP×CP group has {n} ranks, not a multiple of cp_size="
                f"{self.config.cp_size}. Set HybridCPConfig.cp_size to the number of ranks per data replica."
            )
        return n, me

    def _gather_seqlens(self, local: list[int], n: int, me: int) -> tuple[list[int], list[int]]:
        """All-gathers lengths; returns (seqlens by gid, offsets by replica). See [Note: global ids]."""
        counts = torch.empty(n, dtype=torch.int64)
        dist.all_gather_single(counts, torch.tensor([len(local)], dtype=torch.int64), group=self._group)
        width = max(1, int(counts.max()))
        padded = torch.zeros(width, dtype=torch.int64)
        padded[: len(local)] = torch.tensor(local, dtype=torch.int64)
        table = torch.empty(n * width, dtype=torch.int64)
        dist.all_gather_single(table, padded, group=self._group)
        rows = [table[r * width : r * width + int(counts[r])].tolist() for r in range(n)]
        cp = self.config.cp_size
        if self.config.check_replicas:
            for r in range(n):
                if rows[r] != rows[r - r % cp]:
                    raise RuntimeError(
                        f"HybridCPDataLoaderWrapper: ranks {r - r % cp} and {r} belong to data replica {r // cp} "
                        f"(cp_size={cp}) but unpacked different sub-sample lengths ({rows[r - r % cp][:8]}... vs "
                        f"{rows[r][:8]}...). Every rank of a replica must read the same batches: check the sampler's "
                        f"DP rank/size, or set cp_size to the ranks per replica."
                    )
        replicas = [rows[d * cp] for d in range(n // cp)]
        offsets = [0]
        for row in replicas:
            offsets.append(offsets[-1] + len(row))
        return [length for row in replicas for length in row], offsets

    def _reroute(
        self,
        local: list[dict[str, Tensor]],
        seqlens: list[int],
        offsets: list[int],
        schedule: HybridCPSchedule,
        n: int,
        me: int,
    ) -> dict[int, dict[str, Tensor]]:
        """Sends each sub-sample from its replica's same-CP-index rank to every rank that runs it."""
        cp = self.config.cp_size
        mine = me // cp
        runs: list[set[int]] = [set() for _ in range(n)]
        for group in schedule:
            for r, ids in enumerate(group):
                runs[r].update(ids)
        peers = [d for d in range(n) if d % cp == me % cp]
        send = {d: sorted(g for g in runs[d] if offsets[mine] <= g < offsets[mine + 1]) for d in peers}
        recv_src = {g: _owner(g, offsets) * cp + me % cp for g in runs[me]}
        recv = sorted(runs[me], key=lambda g: (recv_src[g], g))
        schema = _schema(local, self._group, n)
        width = sum(_row_bytes(dtype, trailing) for dtype, trailing in schema.values())
        pieces = [_to_rows(local[g - offsets[mine]], schema) for d in peers for g in send[d]]
        inp = torch.cat(pieces) if pieces else torch.empty((0, width), dtype=torch.uint8)
        in_split = [sum(seqlens[g] for g in send.get(d, [])) for d in range(n)]
        out_split = [sum(seqlens[g] for g in recv if recv_src[g] == s) for s in range(n)]
        buf = torch.empty((sum(out_split), width), dtype=torch.uint8)
        dist.all_to_all_single(buf, inp, out_split, in_split, group=self._group)
        rows = torch.split(buf, [seqlens[g] for g in recv])
        out = {g: _from_rows(piece, schema) for g, piece in zip(recv, rows)}
        return out


def _row_bytes(dtype: torch.dtype, trailing: tuple[int, ...]) -> int:
    return math.prod(trailing) * dtype.itemsize


def _to_rows(sub: dict[str, Tensor], schema: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> Tensor:
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


def _owner(gid: int, offsets: list[int]) -> int:
    """Replica owning ``gid``: the ``d`` with ``offsets[d] <= gid < offsets[d + 1]``."""
    lo, hi = 0, len(offsets) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if offsets[mid] <= gid:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _schema(local: list[dict[str, Tensor]], group: ProcessGroup | None, n: int) -> dict[str, tuple[torch.dtype, tuple]]:
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
