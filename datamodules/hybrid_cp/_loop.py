"""Running a model on the wrapper's hybrid-CP sub-samples: the per-sub-sample training loop and its normaliser.

`hybrid_cp_forward_backward` runs forward and backward for every sub-sample a rank received from
`HybridCPDataLoaderWrapper`, in schedule order, calling a loss function on this rank's zigzag shard of each (for the
example GPT: ``zlightning.models.gpt_hybrid_cp.gpt_cp_loss``). `global_token_count` is the loss normaliser and
`lockstep_plan` the micro-step order under ZeRO-3. Nothing here knows the model.

[Note: per-token loss normalised by the global token count]
A sub-sample's tokens are spread over a block of ranks and the blocks differ from step to step, so a per-rank mean
(or a per-sub-sample mean) would weigh tokens by where they happened to run. Every rank therefore returns
``sum(token losses of its shard) / N`` with ``N`` the tokens of the whole global batch (`HybridCPBatch.total_tokens`,
identical on every rank). Summed over all ranks this is the global batch's mean token loss, whatever the placement,
and so is the sum of the ranks' gradients: reduce the gradients with SUM over the DP×CP domain, not AVG.

[Note: lockstep micro-steps for ZeRO-3]
Ranks run different numbers of sub-samples. That is fine when the only collectives inside a micro-step are the
block's K/V all-gathers (DDP here reduces gradients once, after the last micro-step). A ZeRO-3 engine, however,
all-gathers every unit's parameters over the whole domain in *every* forward and backward: with unequal counts a rank
would wait in a unit all-gather while its block partner waits in the K/V all-gather of a later sub-sample, a deadlock.
`lockstep_plan` therefore pads each group's list to the group's longest list with ``None`` micro-steps; a padding
micro-step runs the model on a few tokens with a zero loss (the loop's ``pad_loss_fn``; ``gpt_pad_loss`` in
``zlightning.models.gpt_hybrid_cp`` for the example GPT), so every rank issues the same domain-wide collectives in
the same order: in micro-step ``k`` of group ``g``, all ranks gather the same units, and block partners (identical
lists) run the same sub-sample. The cost is ``sum_g max_r |list| - |own list|`` tiny forwards per rank. The
gradient reduction happens once, after the last micro-step (the engine's ``gradient_sync`` is off before it).

[Note: no barrier between groups]
Megatron issues a DP×CP barrier between schedule groups. It is not needed for correctness: every collective runs on
one block's group, and all ranks of a block hold identical ordered sub-sample lists in every group, so each group's
members issue the same collectives in the same order and nothing can deadlock. The loop here has no barrier; the
gradient reduction at the end of the step synchronises the ranks anyway.

Only ``torch`` and zlightning's own CP attention (`zlightning.parallel`) are imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import ContextManager, TypeAlias  # noqa: UP035 - used as a generic alias below

import torch
import torch.distributed as dist
from torch import Tensor

from zlightning.parallel import CPShard, HybridCPGroups

from ._schedule import HybridCPSchedule
from ._wrapper import HybridCPBatch, zigzag_shard

__all__ = [
    "BackwardFn",
    "SubSampleLossFn",
    "check_zigzag_splittable",
    "global_token_count",
    "hybrid_cp_forward_backward",
    "lockstep_plan",
]

SubSampleLossFn: TypeAlias = Callable[[dict[str, Tensor], CPShard], Tensor]
"""``loss_fn(shard_data, shard) -> loss``: this rank's loss on its zigzag shard of one sub-sample (a scalar that
already carries the global normalisation, see [Note: per-token loss normalised by the global token count])."""


BackwardFn: TypeAlias = Callable[[Tensor, bool], None]
"""``backward(loss, is_last)``: backpropagates one micro-step's loss; ``is_last`` marks the step's final micro-step
(where an engine that accumulates gradients locally should reduce them)."""


def lockstep_plan(schedule: HybridCPSchedule, rank: int, *, lockstep: bool) -> list[tuple[int, int | None]]:
    """The ``(group, gid)`` micro-steps ``rank`` runs, in order; ``gid`` None is a padding micro-step.

    Without ``lockstep`` this is just the rank's schedule lists, group by group. With it, every group's list is padded
    to that group's longest list, so every rank runs the same number of micro-steps per group. See
    [Note: lockstep micro-steps for ZeRO-3].

    Args:
        schedule: ``schedule[g][r]``, as `HybridCPBatch.schedule`.
        rank: This rank's position in the DP×CP domain.
        lockstep: Pad to equal counts per group.

    Returns:
        The micro-steps.

    Raises:
        ValueError: If ``rank`` is outside the schedule's domain.
    """
    plan: list[tuple[int, int | None]] = []
    for g, group in enumerate(schedule):
        if not 0 <= rank < len(group):
            raise ValueError(f"lockstep_plan: rank {rank} is outside the schedule's {len(group)}-rank domain.")
        plan.extend((g, gid) for gid in group[rank])
        if lockstep:
            plan.extend((g, None) for _ in range(max(len(ids) for ids in group) - len(group[rank])))
    return plan


def global_token_count(
    batch: HybridCPBatch, rank: int, *, key: str | None = None, group: dist.ProcessGroup | None = None
) -> float:
    """Tokens of the whole global batch that carry loss: ``batch.total_tokens``, or the global sum of ``key``.

    With ``key`` (e.g. ``"loss_mask"``), each sub-sample is counted once, by the first rank of its block (this rank
    holds whole sub-samples before the zigzag split), and one all-reduce over the DP×CP domain sums the counts; every
    rank of the domain must call it. The result is the normaliser of
    [Note: per-token loss normalised by the global token count].

    Raises:
        KeyError: If a sub-sample has no ``key``.
    """
    if key is None:
        return float(batch.total_tokens)
    device = next(iter(batch.sub_samples[0].data.values())).device if batch.sub_samples else None
    local = torch.zeros((), dtype=torch.float64, device=device)  # on the data's device: NCCL needs CUDA tensors
    for sub in batch.sub_samples:
        if key not in sub.data:
            raise KeyError(f"global_token_count: sub-sample {sub.gid} has no key {key!r}; keys: {sorted(sub.data)}.")
        if sub.block_start == rank:
            local += sub.data[key].double().sum().to(local.device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local, group=group)
    return float(local)


# [Note: every rank refuses a sub-sample no block can split]
# The zigzag split gives each of a block's ``cp`` ranks two of ``2 * cp`` equal chunks, so a sub-sample run on more
# than one rank needs a length that is a multiple of ``2 * cp`` (`HybridCPTextDataModule` pads its windows so). A
# user's own data may not be, and the scheduler may also widen a short sub-sample onto a larger block to keep every
# rank busy. Splitting failed on that block's ranks only, while the others went on into their own sub-samples'
# collectives and met gloo's "connection closed" instead of the reason. The schedule and every length are the same on
# every rank, so every rank checks the whole schedule first and raises the same error before any collective.
def check_zigzag_splittable(schedule: HybridCPSchedule, seqlens: list[int]) -> None:
    """Raises on every rank when a sub-sample of ``schedule`` runs on ``cp > 1`` ranks with a length that is not a
    multiple of ``2 * cp`` (see [Note: every rank refuses a sub-sample no block can split]).

    Raises:
        ValueError: Naming the first such sub-sample, its length, its CP size and what to pad to.
    """
    for g, ranks in enumerate(schedule):
        cp_of: dict[int, int] = {}
        for gids in ranks:
            for gid in gids:
                cp_of[gid] = cp_of.get(gid, 0) + 1
        for gid, cp in sorted(cp_of.items()):
            if cp > 1 and seqlens[gid] % (2 * cp):
                dp_cp = len(ranks)
                raise ValueError(
                    f"hybrid CP: sub-sample {gid} ({seqlens[gid]} tokens) runs on {cp} ranks in group {g}, and the "
                    f"zigzag split needs a length that is a multiple of 2 x {cp} = {2 * cp} (the scheduler places "
                    f"sub-samples on blocks of up to {dp_cp} ranks, widening short ones to keep every rank busy). Pad "
                    f"every sub-sample's length to a multiple of 2 x {dp_cp} = {2 * dp_cp}, as HybridCPTextDataModule "
                    "does."
                )


def hybrid_cp_forward_backward(
    batch: HybridCPBatch,
    groups: HybridCPGroups,
    loss_fn: SubSampleLossFn,
    *,
    pad_loss_fn: Callable[[], Tensor] | None = None,
    step_context: Callable[[], ContextManager[object]] | None = None,
    backward: BackwardFn | None = None,
) -> Tensor:
    """Forward and backward of every sub-sample this rank runs, in schedule order; gradients accumulate in ``.grad``.

    For each `HybridCPSubSample`: build its `CPShard`, take this rank's `zigzag_shard` of its data, call
    ``loss_fn(shard_data, shard)`` and backpropagate. The caller then reduces the gradients with SUM over the DP×CP
    domain (see [Note: per-token loss normalised by the global token count]) and steps the optimizer. Every rank of the
    domain must call it with its own batch of the same step. See [Note: no barrier between groups].

    Args:
        batch: This rank's `HybridCPBatch` from `HybridCPDataLoaderWrapper`.
        groups: The domain's `HybridCPGroups` (built once).
        loss_fn: This rank's loss of one shard (`SubSampleLossFn`), e.g. a closure over
            ``zlightning.models.gpt_hybrid_cp.gpt_cp_loss`` with ``num_tokens=batch.total_tokens``.
        pad_loss_fn: If given, run in lockstep (`lockstep_plan`), calling it for the padding micro-steps (e.g.
            ``lambda: gpt_pad_loss(model)``, a zero loss that still runs every submodule); needed under ZeRO-3. See
            [Note: lockstep micro-steps for ZeRO-3].
        step_context: Entered around each micro-step's forward and backward (e.g. a ZeRO engine's ``forward_pass``).
        backward: ``backward(loss, is_last)``; ``loss.backward()`` if None.

    Returns:
        The sum of this rank's losses (detached); summed over ranks it is the global batch's loss.
    """
    check_zigzag_splittable(batch.schedule, batch.seqlens)
    by_gid = {sub.gid: sub for sub in batch.sub_samples}
    plan = lockstep_plan(batch.schedule, groups.rank, lockstep=pad_loss_fn is not None)
    total = torch.zeros((), dtype=torch.float64)
    for i, (_, gid) in enumerate(plan):
        with step_context() if step_context is not None else contextlib.nullcontext():
            if gid is None:
                loss = pad_loss_fn()  # type: ignore[misc]  # only planned when given
            else:
                sub = by_gid[gid]
                shard = CPShard.for_sub_sample(sub, groups, next(iter(sub.data.values())).device)
                loss = loss_fn(zigzag_shard(sub.data, sub.cp_size, shard.cp_rank), shard)
            if backward is None:
                loss.backward()
            else:
                backward(loss, i == len(plan) - 1)
        total += loss.detach().double().cpu()
    return total
