"""Tensor parallelism inside pipeline stages (PP x TP): each stage's layers are sharded over the stage's TP group
with ``zlightning.inject.module_inject`` once the stage is built.

[Note: what a stage shards]
``module_inject`` recognises transformer blocks as children of an ``nn.ModuleList``. A built ``PipelineModule`` holds
its layers as children named by layer index, so the stage is presented to it as a ``StageView``: a ``ModuleList``
``layers`` with this rank's layer ``i`` at position ``i`` (an ``nn.Identity`` placeholder for layers of other stages
and for plain callables). Each pipeline layer is therefore one block: its Linears are classified column/row-parallel
and validated per layer, and a layer must end with a replicated activation (it may be the last layer of a stage, and
stage boundaries carry full activations). Because a layer is a block, an untied LM head inside one (a layer holding
``ln_f`` and ``lm_head``) would fall under the block rule "last Linear is row-parallel" and have no column producer;
Linears named ``lm_head``/``head``/``embed_out``/``output`` (not sharing an embedding's weight) are therefore planned
``head`` (vocab-parallel, output gathered), as ``module_inject`` does outside blocks, unless the user plans them. A
user plan (``InjectPolicy.plan``) matches qualified names
``layers.<layer index>.<path>``; entries that match nothing on this stage are dropped for this stage, and an entry
that matches nothing on any stage is an error (checked over the pipeline group, on every rank together).

Tied layers (``TiedLayerSpec``, e.g. a GPT token embedding reused as its output head) are kept replicated over the
TP group: the user's ``forward_fn`` multiplies by ``module.weight`` directly, which a hidden-dim shard would silently
break. Their gradients are identical on TP peers (every sharded layer ends with replicated activations), so the
tied all-reduce between owning stages runs per TP index and the copies stay equal everywhere.
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.distributed as dist
from torch import nn

from zlightning.inject import InjectPolicy, module_inject, tp_split_names
from zlightning.inject._policy import PlanStyle
from zlightning.pipe._module import PipelineModule

__all__ = ["StageView", "shard_stage"]

_HEAD_NAMES = frozenset({"lm_head", "head", "embed_out", "output"})


class StageView(nn.Module):
    """This rank's layers of a built ``PipelineModule`` as ``layers[i]`` (placeholders elsewhere); see
    [Note: what a stage shards]."""

    def __init__(self, module: PipelineModule) -> None:
        super().__init__()
        layers = [module.local_layer(i) for i in range(len(module.specs))]
        self.layers = nn.ModuleList([nn.Identity() if layer is None else layer for layer in layers])


def _linear_names(view: StageView) -> list[str]:
    return [n for n, m in view.named_modules() if isinstance(m, nn.Linear)]


def _local_plan(
    view: StageView, policy: InjectPolicy, pipe_group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
) -> dict[str, PlanStyle]:
    """The plan entries that match a Linear of this stage. Raises on every rank if an entry matches no stage."""
    names = _linear_names(view)
    entries = list(policy.plan.items())
    hits = torch.tensor([float(any(re.fullmatch(p, n) for n in names)) for p, _ in entries] or [0.0], device=device)
    if pipe_group is not None and entries:
        dist.all_reduce(hits, op=dist.ReduceOp.MAX, group=pipe_group)
    missing = [p for (p, _), h in zip(entries, hits.tolist()) if h == 0]
    if missing:
        raise ValueError(
            f"PipelineConfig.tp_policy.plan: pattern(s) {missing} match no nn.Linear on any pipeline stage; under "
            "PP x TP a plan matches qualified names 'layers.<layer index>.<path>' (e.g. r'layers\\.\\d+\\.mlp\\.fc')"
        )
    plan = {p: s for p, s in entries if any(re.fullmatch(p, n) for n in names)}
    return {**plan, **_head_entries(view, names, plan)}


def _head_entries(view: StageView, names: list[str], plan: dict[str, PlanStyle]) -> dict[str, PlanStyle]:
    """``head`` entries for untied LM-head Linears (``lm_head``, ``head``, ``embed_out``, ``output``) that no user
    entry covers; see [Note: what a stage shards]."""
    embedded = {id(m.weight) for m in view.modules() if isinstance(m, nn.Embedding)}
    out: dict[str, PlanStyle] = {}
    for name in names:
        linear = view.get_submodule(name)
        if name.rsplit(".", 1)[-1] not in _HEAD_NAMES or id(linear.weight) in embedded:
            continue
        if not any(re.fullmatch(p, name) for p in plan):
            out[re.escape(name)] = "head"
    return out


def shard_stage(
    module: PipelineModule,
    tp_size: int,
    policy: InjectPolicy | None,
    tp_group: dist.ProcessGroup,
    pipe_group: dist.ProcessGroup | None,
    device: torch.device | str = "cpu",
) -> frozenset[int]:
    """Makes this rank's (non-tied) layers of ``module`` tensor-parallel over ``tp_group``, in place.

    Collective over ``tp_group`` (and ``pipe_group`` when a plan is given; its flags live on ``device``, which must
    suit the backend). Call it on identically initialised TP peers, before the optimizer is built.

    Returns:
        The ids of the parameters that hold a different slice on every TP rank (for the global gradient norm).

    Raises:
        zlightning.inject.InjectError: a layer cannot be sharded (indivisible sizes, a layer ending sharded...).
        ValueError: a plan entry matches no stage.
    """
    base = policy if policy is not None else InjectPolicy()
    view = StageView(module)
    plan = _local_plan(view, base, pipe_group, device)
    # check_inputs hooks the root's forward, which never runs here (the engine checks inputs itself)
    policy = dataclasses.replace(base, tp_size=tp_size, plan=plan, check_inputs=False)
    module_inject(view, policy, tp_group=tp_group)
    for i, layer in enumerate(view.layers):
        if module.local_layer(i) is not None and layer is not module.local_layer(i):
            module.replace_layer(i, layer)  # a top-level layer was rebuilt (e.g. an attention module)
    split = tp_split_names(view)
    return frozenset(id(p) for n, p in view.named_parameters(remove_duplicate=False) if n in split)
