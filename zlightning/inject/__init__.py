"""Module injection (issue 7): automatic tensor parallelism for training and fused-kernel injection.

Public surface::

    groups = build_tp_groups(tp_size)                          # DP x TP grid (contiguous TP ranks)
    module_inject(model, InjectPolicy(tp_size=2), tp_group=groups.tp_group)
    classify_linears(model, policy)                            # inspect the column/row plan without changing anything
"""

from zlightning.inject._api import TPGroups, apply_tensor_parallel, build_tp_groups, module_inject, tp_full_state
from zlightning.inject._classify import classify_linears
from zlightning.inject._layers import (
    ColumnParallelLinear,
    FusedNorm,
    FusedSelfAttention,
    HiddenParallelEmbedding,
    RowParallelLinear,
)
from zlightning.inject._policy import InjectError, InjectPolicy, LinearStyle

__all__ = [
    "ColumnParallelLinear",
    "FusedNorm",
    "FusedSelfAttention",
    "HiddenParallelEmbedding",
    "InjectError",
    "InjectPolicy",
    "LinearStyle",
    "RowParallelLinear",
    "TPGroups",
    "apply_tensor_parallel",
    "build_tp_groups",
    "classify_linears",
    "module_inject",
    "tp_full_state",
]
