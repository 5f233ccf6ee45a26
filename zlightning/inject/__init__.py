"""Module injection: automatic tensor parallelism for training and fused-kernel injection.

Public surface::

    groups = build_tp_groups(tp_size)                          # DP x TP grid (contiguous TP ranks)
    module_inject(model, InjectPolicy(tp_size=2), tp_group=groups.tp_group)
    classify_linears(model, policy)                            # inspect the column/row plan without changing anything
    print(injection_report(model))                            # what was fused / sharded
    clip_grad_norm_tp_(model, 1.0, tp_group=groups.tp_group)   # global-norm clipping of a TP model (no ZeRO)
"""

from zlightning.inject._api import TPGroups, apply_tensor_parallel, build_tp_groups, module_inject, tp_full_state
from zlightning.inject._classify import classify_linears
from zlightning.inject._clip import clip_grad_norm_tp_, tp_model_parallel_grads, tp_split_layout, tp_split_names
from zlightning.inject._layers import (
    ColumnParallelLinear,
    FusedNorm,
    FusedSelfAttention,
    HiddenParallelEmbedding,
    RowParallelLinear,
    tp_merge,
    tp_slice,
)
from zlightning.inject._mlp import FusedMLP
from zlightning.inject._policy import InjectError, InjectPolicy, LinearStyle
from zlightning.inject._report import InjectReport, injection_report

__all__ = [
    "ColumnParallelLinear",
    "FusedMLP",
    "FusedNorm",
    "FusedSelfAttention",
    "HiddenParallelEmbedding",
    "InjectError",
    "InjectPolicy",
    "InjectReport",
    "LinearStyle",
    "RowParallelLinear",
    "TPGroups",
    "apply_tensor_parallel",
    "build_tp_groups",
    "classify_linears",
    "injection_report",
    "clip_grad_norm_tp_",
    "module_inject",
    "tp_full_state",
    "tp_merge",
    "tp_model_parallel_grads",
    "tp_slice",
    "tp_split_layout",
    "tp_split_names",
]
