"""Context-parallel causal attention: one sequence (a sub-sample) sharded zigzag over a block of ranks.

A sub-sample that runs at CP size ``c`` on the block ``[s, s + c)`` of the DP×CP domain is split zigzag across the
block (`zigzag_positions`; ``zlightning.datamodules.hybrid_cp.zigzag_shard`` applies it to a sub-sample's tensors):
block rank ``r`` holds chunks ``r`` and ``2c - 1 - r`` of ``2c`` equal chunks. Each rank computes Q, K and V for its
own tokens; `cp_causal_attention` all-gathers K and V within the block's process group and attends this rank's
queries to every key at an earlier or equal *original* position. The pieces:

- `HybridCPGroups.build()` creates one process group per aligned power-of-two block, once, on every rank.
- `CPShard` says where this rank's tokens sit in the sub-sample (its block group, block rank, positions).
- `cp_causal_attention(q, k, v, shard)` is the attention itself; ``c == 1`` is plain causal SDPA.
- `cp_attention(shard)` is a context manager that routes a model's own
  ``F.scaled_dot_product_attention(..., is_causal=True)`` calls to `cp_causal_attention`, so an unmodified model runs
  in CP mode (``zlightning.models.gpt_hybrid_cp.gpt_cp_logits`` does it for the example GPT).

Only ``torch`` is imported: the data side (``zlightning.datamodules.hybrid_cp``) depends on this module, never the
reverse. Shape suffixes: B = batch, H = heads, t = this rank's tokens, L = the sub-sample's tokens (``c * t``),
d = head width, c = CP size.

[Note: process groups for every block]
``torch.distributed.new_group`` must be entered by every rank of the job, in the same order, even by non-members.
`HybridCPGroups.build` therefore first all-gathers every rank's DP×CP domain (its global ranks; the whole job by
default), then walks the distinct domains in sorted order and, per domain, the sizes ``2, 4, ..., n`` and the aligned
block starts ``0, c, 2c, ...``: identical calls on every rank, one group per block, created once and reused for every
sub-sample. Size-1 blocks need no group.

[Note: the causal mask under zigzag]
After the all-gather, the keys are in block-rank order (rank 0's two chunks, then rank 1's, ...), not in sequence
order, so ``is_causal`` (a lower-triangular mask over *local* indices) would be wrong. The mask is instead built from
original positions: query ``i`` may see key ``j`` iff ``pos_q[i] >= pos_k[j]``. Every query sees at least its own key,
so no softmax row is empty. The result equals full-sequence causal attention up to float summation order. Each rank
computes a ``t × L`` score matrix of which about half is masked; zigzag makes that half the same on every rank (no
straggler), which is its point. Skipping the masked blocks (ring attention, flash-attention varlen) is a kernel-level
optimisation this reference implementation does not do.

[Note: the gradient of the K/V all-gather]
Every rank's attention reads the keys and values of the whole block, so the loss depends on rank ``r``'s K/V shard
through all ``c`` ranks' attention. The backward of the all-gather is therefore a reduce-scatter with SUM: rank ``r``
receives the sum over the block of the gradients flowing into the gathered copy of its shard. K and V travel stacked
as one tensor, so a layer costs one all-gather forward and one reduce-scatter backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from zlightning._dist_compat import all_gather_single, reduce_scatter_single
from zlightning._threads import small_thread_stacks

__all__ = ["CPShard", "HybridCPGroups", "PlacedSubSample", "cp_attention", "cp_causal_attention", "zigzag_positions"]


class PlacedSubSample(Protocol):
    """A sub-sample with the block it runs on (``zlightning.datamodules.hybrid_cp.HybridCPSubSample`` is one)."""

    @property
    def cp_size(self) -> int:
        """Ranks in the block."""
        ...

    @property
    def block_start(self) -> int:
        """First domain rank of the block."""
        ...

    @property
    def data(self) -> Mapping[str, Tensor]:
        """The sub-sample's token-aligned tensors (the whole sub-sample, before the zigzag split)."""
        ...


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def zigzag_positions(length: int, cp_size: int, cp_rank: int) -> Tensor:
    """Positions (int64) of the tokens rank ``cp_rank`` of a ``cp_size`` block holds: chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks. A block of one rank holds the whole sequence,
    of any length: its two chunks are the sequence's halves, in order, and a sub-sample that no rank shares needs no
    padding (a user's own odd-length documents run at CP size 1).

    Raises:
        ValueError: If ``cp_size > 1`` and ``length`` is not divisible by ``2 * cp_size``.
    """
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(
            f"zigzag_shard: a sub-sample of {length} tokens cannot be cut into 2 * cp_size = {2 * cp_size} equal "
            f"chunks; pad every sub-sample to a multiple of 2 * max CP size (Megatron requires the same)."
        )
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk)
    return torch.cat([first, second])


@dataclass(frozen=True)
class HybridCPGroups:
    """The process groups of one DP×CP domain's aligned power-of-two blocks. Build with `HybridCPGroups.build`.

    Block ``[s, s + c)`` (in domain ranks, as a sub-sample's ``block_start`` and ``cp_size`` give it) maps to a
    process group of the global ranks ``domain_ranks[s : s + c]``. Only the blocks this rank belongs to are kept.
    """

    domain_ranks: tuple[int, ...]
    """Global rank of every domain rank (``domain_ranks[h]`` is domain rank ``h``)."""
    rank: int
    """This process's domain rank."""
    groups: dict[tuple[int, int], ProcessGroup] = field(repr=False)
    """``(block_start, cp_size) -> group`` for every block of size >= 2 that contains this rank."""

    @classmethod
    @small_thread_stacks(
        backend=None
    )  # every gloo group starts threads: see [Note: thread stacks count against a data limit]
    def build(cls, dp_cp_group: ProcessGroup | None = None) -> HybridCPGroups:
        """Creates the groups of every aligned power-of-two block; a collective over the whole job.

        Every rank of the job must call it once, at the same point (it enters ``dist.new_group`` for every block of
        every domain, see [Note: process groups for every block]). Domains may differ between ranks (e.g. one per
        tensor-parallel index) but must be disjoint and power-of-two sized.

        Args:
            dp_cp_group: This rank's DP×CP domain, as passed to ``HybridCPDataLoaderWrapper``; the whole job if None.

        Returns:
            This rank's groups.

        Raises:
            RuntimeError: If torch.distributed is not initialised.
            ValueError: If a domain's size is not a power of two, or domains overlap.
        """
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HybridCPGroups.build: torch.distributed is not initialised; call init_process_group (Lightning does "
                "it in the strategy's setup) before building the hybrid-CP process groups."
            )
        # dist.group.WORLD is set once torch.distributed is initialised (checked above)
        domain = cast("ProcessGroup", dist.group.WORLD) if dp_cp_group is None else dp_cp_group
        mine = tuple(dist.get_global_rank(domain, h) for h in range(dist.get_world_size(domain)))
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        domains = sorted(set(gathered))
        _check_domains(domains)
        groups: dict[tuple[int, int], ProcessGroup] = {}
        me = dist.get_rank()
        for domain in domains:
            c = 2
            while c <= len(domain):
                for start in range(0, len(domain), c):
                    group = dist.new_group(list(domain[start : start + c]))
                    if domain == mine and me in domain[start : start + c]:
                        groups[(start, c)] = group
                c *= 2
        return cls(mine, mine.index(me), groups)

    @property
    def size(self) -> int:
        """Ranks in the DP×CP domain."""
        return len(self.domain_ranks)

    def group(self, block_start: int, cp_size: int) -> ProcessGroup | None:
        """The process group of block ``[block_start, block_start + cp_size)``; None for a size-1 block.

        Raises:
            ValueError: If the block is not an aligned power-of-two block of the domain, or does not contain this rank.
        """
        if not _is_power_of_two(cp_size) or block_start % cp_size or block_start + cp_size > self.size:
            raise ValueError(
                f"HybridCPGroups.group: block [{block_start}, {block_start + cp_size}) is not an aligned power-of-two "
                f"block of a {self.size}-rank domain (cp_size must be a power of two dividing block_start)."
            )
        if not block_start <= self.rank < block_start + cp_size:
            raise ValueError(
                f"HybridCPGroups.group: domain rank {self.rank} is not in block [{block_start}, "
                f"{block_start + cp_size}); a rank can only run sub-samples of its own blocks."
            )
        return None if cp_size == 1 else self.groups[(block_start, cp_size)]


def _check_domains(domains: list[tuple[int, ...]]) -> None:
    seen: set[int] = set()
    for domain in domains:
        if not _is_power_of_two(len(domain)):
            raise ValueError(
                f"HybridCPGroups.build: the DP×CP domain {list(domain)} has {len(domain)} ranks, not a power of two; "
                f"hybrid CP needs power-of-two domains (schedule_hybrid_cp rejects others too)."
            )
        if seen & set(domain):
            raise ValueError(
                f"HybridCPGroups.build: DP×CP domains overlap on ranks {sorted(seen & set(domain))}; every rank must "
                f"pass the dp_cp_group it belongs to, and the groups must partition the job."
            )
        seen |= set(domain)


@dataclass(frozen=True)
class CPShard:
    """Where this rank's tokens of one sub-sample sit: its block, block rank and original positions.

    Build it with `CPShard.zigzag` or `CPShard.for_sub_sample`; the fields are checked on construction.

    Raises:
        ValueError: If the fields are inconsistent (see the field docs).
    """

    group: ProcessGroup | None
    """The block's process group; None exactly when ``cp_size == 1``."""
    cp_size: int
    """Ranks in the block (a power of two)."""
    cp_rank: int
    """This rank's position in the block, ``0 <= cp_rank < cp_size``."""
    q_positions: Tensor
    """int64 [t]: original position of each of this rank's tokens (strictly increasing when ``cp_size == 1``)."""
    kv_positions: Tensor
    """int64 [c * t]: original position of each gathered key, block rank by block rank."""
    mask_tL: Tensor = field(init=False, repr=False)
    """bool [t, c * t]: ``q_positions[i] >= kv_positions[j]``. See [Note: the causal mask under zigzag]."""

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.cp_size) or not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(
                f"CPShard: need a power-of-two cp_size and 0 <= cp_rank < cp_size, got "
                f"cp_size={self.cp_size}, cp_rank={self.cp_rank}."
            )
        if (self.group is None) != (self.cp_size == 1):
            raise ValueError(
                f"CPShard: cp_size={self.cp_size} needs {'no group' if self.cp_size == 1 else 'its block group'}, "
                f"got group={self.group!r}; take it from HybridCPGroups.group(block_start, cp_size)."
            )
        q, kv = self.q_positions, self.kv_positions
        if q.dim() != 1 or kv.shape != (self.cp_size * q.shape[0],) or q.dtype != torch.int64 or kv.dtype != q.dtype:
            raise ValueError(
                f"CPShard: q_positions must be int64 [t] and kv_positions int64 [cp_size * t], got "
                f"{q.dtype} {tuple(q.shape)} and {kv.dtype} {tuple(kv.shape)} for cp_size={self.cp_size}."
            )
        if self.cp_size == 1 and q.numel() > 1 and not bool((q[1:] > q[:-1]).all()):
            raise ValueError(
                "CPShard: a cp_size=1 shard runs plain causal attention, so its q_positions must be "
                "strictly increasing."
            )
        object.__setattr__(self, "mask_tL", q[:, None] >= kv[None, :])

    @classmethod
    def zigzag(
        cls, length: int, cp_size: int, cp_rank: int, group: ProcessGroup | None, device: torch.device | None = None
    ) -> CPShard:
        """The shard that ``zigzag_shard(data, cp_size, cp_rank)`` gives a sub-sample of ``length`` tokens.

        Raises:
            ValueError: If ``cp_size > 1`` and ``length`` is not divisible by ``2 * cp_size`` (or as `CPShard`).
        """
        ranks = [zigzag_positions(length, cp_size, r) for r in range(cp_size)]
        return cls(group, cp_size, cp_rank, ranks[cp_rank].to(device), torch.cat(ranks).to(device))

    @classmethod
    def for_sub_sample(
        cls, sub: PlacedSubSample, groups: HybridCPGroups, device: torch.device | None = None
    ) -> CPShard:
        """This rank's zigzag shard of a sub-sample placed on a block (as ``HybridCPDataLoaderWrapper`` returns them).

        Raises:
            ValueError: If this rank is not in the sub-sample's block, or ``cp_size > 1`` and its length is not
                divisible by ``2 * cp_size``.
        """
        group = groups.group(sub.block_start, sub.cp_size)
        length = next(iter(sub.data.values())).shape[0]
        return cls.zigzag(length, sub.cp_size, groups.rank - sub.block_start, group, device)

    @property
    def num_tokens(self) -> int:
        """This rank's tokens ``t``."""
        return int(self.q_positions.shape[0])


class _AllGatherStack(torch.autograd.Function):
    """``x -> stack([x of block rank 0, ..., x of block rank c-1])``; backward reduce-scatters (sums) the gradient.

    See [Note: the gradient of the K/V all-gather].
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, size: int) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty(size * x.numel())  # flat: gloo wants [size * numel] buffers
        all_gather_single(out, x.view(-1), group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None]:
        grad = grad_out.new_empty(grad_out.shape[1:])
        reduce_scatter_single(grad.view(-1), grad_out.contiguous().view(-1), op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None, None


def cp_causal_attention(
    q_BHtd: Tensor,
    k_BHtd: Tensor,
    v_BHtd: Tensor,
    shard: CPShard,
    *,
    dropout_p: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Causal attention of this rank's queries over the whole sub-sample, which is sharded across the block.

    The algorithm: stack K and V, all-gather them within ``shard.group`` (backward: reduce-scatter of their
    gradients), and run ``F.scaled_dot_product_attention`` with the mask ``pos_q >= pos_k`` over original positions.
    With ``cp_size == 1`` it is plain ``F.scaled_dot_product_attention(is_causal=True)``. Every rank of the block must
    call it together (it is a collective). With ``dropout_p > 0`` the dropout pattern differs from a single-process
    run's.

    Args:
        q_BHtd: This rank's queries, [B, H, t, d] with ``t = shard.num_tokens``.
        k_BHtd: This rank's keys, same shape as the queries.
        v_BHtd: This rank's values, same shape as the queries.
        shard: Where this rank's tokens sit (`CPShard`).
        dropout_p: Attention dropout, as in SDPA.
        scale: Softmax scale; ``1 / sqrt(d)`` if None.

    Returns:
        This rank's attention output, [B, H, t, d].

    Raises:
        ValueError: If the shapes disagree with each other or with the shard.
    """
    if not (q_BHtd.shape == k_BHtd.shape == v_BHtd.shape) or q_BHtd.dim() != 4:
        raise ValueError(
            f"cp_causal_attention: q, k and v must share one [batch, heads, tokens, head_dim] shape, got "
            f"{tuple(q_BHtd.shape)}, {tuple(k_BHtd.shape)}, {tuple(v_BHtd.shape)} (grouped-query attention: repeat "
            f"the K/V heads first)."
        )
    if q_BHtd.shape[2] != shard.num_tokens:
        raise ValueError(
            f"cp_causal_attention: the inputs hold {q_BHtd.shape[2]} tokens but the shard has {shard.num_tokens}; "
            f"feed the model this rank's zigzag_shard of the sub-sample (cp_size={shard.cp_size})."
        )
    if shard.group is None:
        return F.scaled_dot_product_attention(q_BHtd, k_BHtd, v_BHtd, dropout_p=dropout_p, is_causal=True, scale=scale)
    kv_cBHtd = _AllGatherStack.apply(torch.stack([k_BHtd, v_BHtd]), shard.group, shard.cp_size)
    B, H, t, d = q_BHtd.shape
    k_BHLd, v_BHLd = (kv_cBHtd[:, i].permute(1, 2, 0, 3, 4).reshape(B, H, shard.cp_size * t, d) for i in (0, 1))
    mask_tL = shard.mask_tL.to(q_BHtd.device)
    return F.scaled_dot_product_attention(q_BHtd, k_BHLd, v_BHLd, attn_mask=mask_tL, dropout_p=dropout_p, scale=scale)


def _sdpa_arguments(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, float, bool, float | None, bool]:
    """Binds a call of ``F.scaled_dot_product_attention`` (same signature) to its arguments."""
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _CPAttentionMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to `cp_causal_attention` for one shard; other calls pass through.

    [Note: routing SDPA through a TorchFunctionMode]
    The model is not edited or patched: a torch-function mode sees every torch call made while it is active, so the
    model's own attention modules (their projections, head split and output projection) run unchanged and only the
    SDPA kernel call is replaced. While the mode handles a call it is inactive, so the SDPA call inside
    `cp_causal_attention` is not intercepted again.
    """

    def __init__(self, shard: CPShard) -> None:
        super().__init__()
        self.shard = shard

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_arguments(*args, **kwargs)
        if not is_causal or mask is not None or enable_gqa:
            raise NotImplementedError(
                f"cp_attention: only causal self-attention (is_causal=True, attn_mask=None, enable_gqa=False) can run "
                f"context-parallel, got is_causal={is_causal}, attn_mask={'set' if mask is not None else None}, "
                f"enable_gqa={enable_gqa}. Run other attention outside the cp_attention context."
            )
        return cp_causal_attention(q, k, v, self.shard, dropout_p=dropout_p, scale=scale)


@contextlib.contextmanager
def cp_attention(shard: CPShard) -> Iterator[CPShard]:
    """Runs every causal ``F.scaled_dot_product_attention`` call in the block as `cp_causal_attention` on ``shard``.

    Use it around the part of a model's forward that contains its attention layers, with the inputs being this
    rank's shard of the sub-sample; the backward needs no context (the collectives are recorded in the graph).
    See [Note: routing SDPA through a TorchFunctionMode].

    Args:
        shard: This rank's `CPShard` of the sub-sample being run.

    Yields:
        ``shard``.

    Raises:
        NotImplementedError: Inside the block, for an SDPA call that is not plain causal self-attention.
    """
    with _CPAttentionMode(shard):
        yield shard
