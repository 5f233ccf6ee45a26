"""Global gradient norm and clipping for tensor-parallel models.

A tensor-parallel layer holds a different slice of some parameters on every TP rank (`ColumnParallelLinear`'s
weight and bias, `RowParallelLinear`'s weight, `HiddenParallelEmbedding`'s table: their ``tp_split`` names) and the
same full copy of every other parameter (norms, row-parallel biases, replicated Linears). The full model's gradient
norm sums the slices over the TP group and counts each replicated parameter once (see [Note: global norm over shards
and model-parallel groups] in ``zlightning/_gradnorm.py``); the ZeRO-3 engine applies the same rule through
``ZeroState.model_parallel`` (built by `tp_model_parallel_grads`). `clip_grad_norm_tp_` is it for a model that is not
ZeRO-sharded.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from zlightning import _gradnorm
from zlightning.inject._layers import ColumnParallelLinear, HiddenParallelEmbedding, RowParallelLinear
from zlightning.zero import ModelParallelGrads

__all__ = ["clip_grad_norm_tp_", "tp_model_parallel_grads", "tp_split_layout", "tp_split_names"]

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


def tp_split_layout(model: nn.Module) -> dict[str, tuple[int, int]]:
    """``{qualified name: (dim, chunks)}`` of the parameters of ``model`` that hold a different slice on every TP
    rank (the names of `tp_split_names`): ``zlightning.inject.tp_merge`` of every rank's slice, in TP rank order, with
    these arguments gives the full tensor, and ``tp_slice`` cuts one rank's slice from it. Plain data: checkpoints
    record it, so that their slices can be put back together without the model."""
    layout: dict[str, tuple[int, int]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, _TP_LAYERS):
            for attr in module.tp_split:
                where = module.tp_layout(attr)
                if module._parameters.get(attr) is not None and where is not None:
                    layout[f"{mod_name}.{attr}" if mod_name else attr] = where
    return layout


def tp_model_parallel_grads(model: nn.Module, tp_group: dist.ProcessGroup) -> ModelParallelGrads:
    """What a ZeRO-3 engine over the DP group needs to compute the global norm of a tensor-parallel ``model``.

    Call it on the engine's root module before sharding it, and set the result as ``ZeroState.model_parallel``.
    """
    return ModelParallelGrads(group=tp_group, split=tp_split_names(model))


def clip_grad_norm_tp_(
    model: nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    tp_group: dist.ProcessGroup,
    parameters: Iterable[nn.Parameter] | None = None,
) -> torch.Tensor:
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
    grads = [p.grad for p in params if p.grad is not None]
    split = [p.grad for p in params if p.grad is not None and id(p) in split_ids]
    replicated = [p.grad for p in params if p.grad is not None and id(p) not in split_ids]
    device = next((p.device for p in params), torch.device("cpu"))
    total = _gradnorm.global_norm(split, replicated, norm_type, model_parallel=tp_group, device=device)
    _gradnorm.clip_(grads, total, max_norm)
    return total
