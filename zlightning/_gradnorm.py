"""Global gradient norm, clipping and fp16 unscaling over gradients that are sharded or split across groups.

Stateless and torch-only: the ZeRO engine (shards over the data-parallel group), tensor parallelism (slices over the
tensor-parallel group) and their combination all reduce the same two local terms.

[Note: global norm over shards and model-parallel groups]
Every gradient element is held either by exactly one rank of a group that *partitions* it (ZeRO pieces over the
data-parallel group; pipeline stages over the pipeline group; tensor-parallel slices over the TP group) or by every
rank of a group that *replicates* it (norm weights, row-parallel biases under TP). Each rank sums ``|g|^p`` of what
it holds into two terms, ``[split, replicated]`` (split: partitioned by the model-parallel group too; replicated:
the same on every rank of it). All-reducing both terms over the partitioning groups and over the model-parallel
group gives ``[S, tp * R]`` on every rank; the norm is ``(S + R)^(1/p)``: slices summed, replicated copies counted
once. The inf norm takes the MAX of both terms instead. Every rank gets the same value, so the clip coefficient is
identical everywhere, as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["clip_", "global_norm", "unscale_and_check_"]


def _term(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``max |g|`` (inf norm) or ``sum |g|^p`` over ``grads``, as a float32 scalar on ``device``."""
    grads = [g for g in grads if g.numel() > 0]
    if not grads:
        return torch.zeros((), device=device)
    if norm_type == math.inf:
        return torch.stack([g.detach().abs().max().float().to(device) for g in grads]).max()
    norms = torch._foreach_norm([g.detach().float() for g in grads], norm_type)
    return torch.stack([n.to(device) for n in norms]).pow(norm_type).sum()


def global_norm(
    split: Sequence[torch.Tensor],
    replicated: Sequence[torch.Tensor] = (),
    norm_type: float = 2.0,
    *,
    partitioned_over: Sequence[dist.ProcessGroup | None] = (),
    model_parallel: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The norm of the whole gradient (see [Note: global norm over shards and model-parallel groups]). Collective
    over every group of ``partitioned_over`` (None there means the world) and over ``model_parallel``.

    Args:
        split: local gradients partitioned by ``model_parallel`` (slices), or every local gradient without it.
        replicated: local gradients identical on every rank of ``model_parallel`` (counted once).
        norm_type: ``p`` of the p-norm (``math.inf`` for the max norm).
        partitioned_over: groups over which the local gradients are disjoint pieces (summed).
        model_parallel: the tensor-parallel group, or None.
        device: where the reduction runs (default: the first gradient's device, else the CPU).

    Raises:
        ValueError: ``norm_type`` is not positive.
    """
    if not norm_type > 0:
        raise ValueError(f"global_norm: norm_type must be > 0, got {norm_type}")
    if device is None:
        device = next((g.device for g in [*split, *replicated]), torch.device("cpu"))
    terms = torch.stack([_term(split, norm_type, device), _term(replicated, norm_type, device)])
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group in partitioned_over:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(terms, op=op, group=group)
    mp = dist.get_world_size(model_parallel) if model_parallel is not None else 1
    if mp > 1:
        dist.all_reduce(terms, op=op, group=model_parallel)
    if norm_type == math.inf:
        return terms.max()
    return (terms[0] + terms[1] / mp).pow(1.0 / norm_type)


def clip_(grads: Sequence[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Scales ``grads`` in place so that a gradient of norm ``total`` has norm at most ``max_norm``."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    grads = [g for g in grads if g.numel() > 0]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def unscale_and_check_(
    grads: Sequence[torch.Tensor],
    inv_scale: float,
    groups: Sequence[dist.ProcessGroup | None] = (),
    device: torch.device | None = None,
) -> bool:
    """Multiplies ``grads`` by ``inv_scale`` and returns whether any rank of ``groups`` holds an inf or NaN.
    Collective over ``groups``; one host synchronisation in all."""
    grads = [g for g in grads if g.numel() > 0]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    found = torch.zeros(1, device=device)
    if grads:
        torch._foreach_mul_(grads, inv_scale)
        found = torch.stack([(~torch.isfinite(g)).any().to(device) for g in grads]).any().float().reshape(1)
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return bool(found.item() > 0)
