"""Global gradient norm and clipping for tensor-parallel models.

A tensor-parallel layer holds a different slice of some parameters on every TP rank (`ColumnParallelLinear`'s
weight and bias, `RowParallelLinear`'s weight, `HiddenParallelEmbedding`'s table: their ``tp_split`` names) and the
same full copy of every other parameter (norms, row-parallel biases, replicated Linears). The full model's gradient
norm sums the slices over the TP group and counts each replicated parameter once; see [Note: global norm with model
parallelism] in ``zlightning/zero/_optimizer.py``, which implements the ZeRO-3 case (``ZeroState.model_parallel``,
built by `tp_model_parallel_grads`). `clip_grad_norm_tp_` is the same rule for a model that is not ZeRO-sharded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zlightning.inject._layers import ColumnParallelLinear, HiddenParallelEmbedding, RowParallelLinear
from zlightning.zero import ModelParallelGrads

__all__ = ["clip_grad_norm_tp_", "tp_model_parallel_grads", "tp_split_names"]

_TP_LAYERS = (ColumnParallelLinear, RowParallelLinear, HiddenParallelEmbedding)


def tp_split_names(model: nn.Module) -> frozenset[str]:
    """Qualified names of the parameters of ``model`` that hold a different slice on every TP rank.

    Tied parameters appear under every name that holds them. Everything else is replicated across the TP group.
    """
    names = set()
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _TP_LAYERS):
            for attr in module.tp_split:
                if module._parameters.get(attr) is not None:
                    names.add(f"{mod_name}.{attr}" if mod_name else attr)
    return frozenset(names)


def tp_model_parallel_grads(model: nn.Module, tp_group: dist.ProcessGroup) -> ModelParallelGrads:
    """What a ZeRO-3 engine over the DP group needs to compute the global norm of a tensor-parallel ``model``.

    Call it on the engine's root module before sharding it, and set the result as ``ZeroState.model_parallel``.
    """
    return ModelParallelGrads(group=tp_group, split=tp_split_names(model))


def _term(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """``max |g|`` or ``sum |g|^p`` over ``grads`` (float32 scalar on ``device``)."""
    if not grads:
        return torch.zeros((), device=device)
    if norm_type == math.inf:
        return torch.stack([g.detach().abs().max().float().to(device) for g in grads]).max()
    return torch.stack([g.detach().float().norm(norm_type).to(device) for g in grads]).pow(norm_type).sum()


def clip_grad_norm_tp_(model: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                       tp_group: dist.ProcessGroup, parameters: Iterable[nn.Parameter] | None = None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for a tensor-parallel model that is not ZeRO-sharded (TP alone, or TP
    with DDP over the DP group, whose gradients are already averaged). Collective over ``tp_group``.

    Args:
        model: the model after ``module_inject`` (its TP layers tell which parameters are split).
        max_norm: the largest allowed global norm.
        norm_type: ``p`` of the p-norm (``math.inf`` for the max norm).
        tp_group: the tensor-parallel group the model is sharded over.
        parameters: the parameters to clip (default: all of ``model``'s).

    Returns:
        The global norm of the full (unsharded) gradient, identical on every rank of the group.

    Raises:
        ValueError: ``max_norm`` < 0 or ``norm_type`` <= 0.
    """
    if not max_norm >= 0 or not norm_type > 0:
        raise ValueError(f"clip_grad_norm_tp_: need max_norm >= 0 and norm_type > 0, got {max_norm}, {norm_type}")
    split_names = tp_split_names(model)
    split_ids = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in split_names}
    params = list(model.parameters() if parameters is None else parameters)
    grads = [(p.grad, id(p) in split_ids) for p in params if p.grad is not None]
    device = next((p.device for p in params), torch.device("cpu"))
    terms = torch.stack([_term([g for g, s in grads if s], norm_type, device),
                         _term([g for g, s in grads if not s], norm_type, device)])
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    dist.all_reduce(terms, op=op, group=tp_group)
    size = dist.get_world_size(tp_group)
    total = terms.max() if norm_type == math.inf else (terms[0] + terms[1] / size).pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_([g for g, _ in grads], coef)
    return total
