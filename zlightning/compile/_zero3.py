"""Compiling a ZeRO-3 sharded model: graph mode (collectives inside the graphs, ``_graph.py``) or per-unit mode.

[Note: per-unit mode (the fallback)]
The engine gathers a unit's parameters in the unit's forward pre-hook and releases them in its post-hook (and again
around its backward). Tracing those hooks would put host-side collectives into Dynamo's path: a graph break at every
unit, plus guards on tensors that change identity each step (recompiles). `compile_zero3` therefore compiles each
non-root unit's *forward* (not ``__call__``), so the hooks keep running eagerly at the boundaries of one whole graph
per unit: no graph breaks inside a unit, no recompilation, and the engine's own prefetch (``overlap_comm``) still
overlaps the next unit's all-gather with this unit's compiled compute. The root unit (embeddings, final norm, head)
stays eager because its forward *calls* the other units, and so does a unit that contains other units.
The engine also hangs an idempotent "ensure root/persistent parameters are gathered" pre-hook on every module that
holds persistent (small, always-gathered) parameters -- e.g. the LayerNorms inside a block. Traced, it guards on the
engine's pass counter and recompiles every step, so the compiled forward detaches those engine hooks while it runs
and calls them once, eagerly, just before (same effect: the first call installs, later ones are no-ops).
Per-unit mode is the default (it keeps the eager engine's semantics exactly; see ``CompileConfig.mode``) and what
``CompileConfig(mode="auto")`` picks when graph mode cannot drive the engine (parameter or optimizer offload, a
tensor-parallel group).

[Note: a key/value cache reaching a compiled unit]
Identical units share one compiled graph: Dynamo caches per code object, and since ``torch.compile`` inlines
``nn.Module`` calls it guards on the parameters' shapes, not on which module runs. A Hugging Face model breaks that
when it builds a key/value cache in training (``use_cache`` defaults to the config's True): every decoder layer
then receives the same cache object and writes its own slot, ``cache.layers[layer_idx]``, so Dynamo specialises each
layer on its index and state -- one recompile per layer until ``recompile_limit`` (8), a warning for each, and the
remaining layers eager. A training forward never reads that cache (it starts empty, the attention covers the
current tokens either way, and nobody reads the cache a loss computation returns), so a compiled unit called in
training with an *empty* cache (``cache``, ``past_key_value(s)``, ``layer_past``) gets None instead: the same
outputs and gradients, every layer on the one graph, and only the unread returned cache stays empty -- what Hugging
Face's own gradient checkpointing does to the cache in training. A cache that holds tokens, or any cache outside
training (evaluation, generation: it is read there), makes the unit run its eager forward for that call, so
decoding stays correct and no per-layer recompiles are attempted. Models that do not want a cache in training pass
``use_cache=False`` (as `zlightning.models.HFCausalLM` does) and never reach this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from zlightning.compile._backend import CompileStats, make_backend
from zlightning.compile._budget import UnshardPlan, plan_unshard, profile_gathers
from zlightning.compile._config import CompileConfig
from zlightning.compile._graph import GraphStats, GroupSpec, ZeroGraphForward, group_specs, make_graph_backend

__all__ = ["ZeroCompileHandle", "compile_zero3"]


@dataclass
class ZeroCompileHandle:
    """What `compile_zero3` compiled and the backend's statistics (``stats.graphs`` counts recompiles).

    Per-unit mode fills ``modules``; graph mode fills ``graph``, ``graph_stats`` (gathers per partitioned graph, bytes
    kept for the backward) and ``plan`` (the selective-unsharding decision, when a budget was given).
    """

    modules: list[nn.Module] = field(default_factory=list)
    stats: CompileStats = field(default_factory=CompileStats)
    mode: str = "unit"
    graph: ZeroGraphForward | None = None
    graph_stats: GraphStats | None = None
    plan: UnshardPlan | None = None
    specs: list[GroupSpec] = field(default_factory=list)
    _state: Any = None

    @property
    def graphs(self) -> int:
        """Dynamo graphs compiled so far, in either mode (first compiles + recompiles + graph-break fragments)."""
        return self.stats.graphs

    def restore(self) -> None:
        """Back to eager forwards (graph mode: the engine's own hooks gather again)."""
        for m in self.modules:
            m.__dict__.pop("forward", None)
        self.modules.clear()
        if self.graph is not None:
            self.graph.remove()
            self.graph = None
            self._state.resume_module_hooks()


def compile_zero3(
    state: Any, config: CompileConfig | None = None, *, dynamic: bool | None = False
) -> ZeroCompileHandle:
    """Compiles every non-root unit of a ZeRO-3 engine with `backend_fn`; see [Note: ZeRO-3 gather/release ...].

    ``config.mode == "graph"`` instead compiles the root module's whole forward with the ZeRO-3 collectives inside
    the graphs (see [Note: ZeRO-3 collectives as graph ops] in ``_graph.py``); with ``config.unshard_budget`` this is
    collective (every rank profiles its all-gathers, see [Note: memory budget] in ``_budget.py``). Call it between
    steps.

    Args:
        state: the engine state (``zero3_shard(...)``), or a ``DeepSpeedZeroOptimizer_Stage3`` (its ``.state``).
        config: backend knobs and the mode.
        dynamic: passed to ``torch.compile`` (False: one graph per input shape).

    Returns:
        A handle with the compiled modules and the compile statistics.

    Raises:
        TypeError: ``state`` is not a ZeRO-3 engine state.
        RuntimeError: graph mode with parameter/optimizer offload, or called mid-step.
    """
    state = getattr(state, "state", state)  # a DeepSpeedZeroOptimizer_Stage3 carries its ZeroState as .state
    units = getattr(state, "units", None)
    if not isinstance(units, list) or not hasattr(state, "engine_hook_ids"):
        raise TypeError(f"compile_zero3 expects a ZeroState (zero3_shard(...)), got {type(state).__name__}")
    config = config or CompileConfig()
    mode = config.mode
    if mode == "auto":
        mode = "unit" if state.offload is not None or getattr(state, "model_parallel", None) is not None else "graph"
    if mode == "graph":
        return _compile_graph(state, config, dynamic)
    handle = ZeroCompileHandle()
    backend = make_backend(config, handle.stats)
    engine_hooks = state.engine_hook_ids()
    unit_modules = [u.module for u in units]
    for unit in units:
        inner = [m for m in unit.module.modules() if m is not unit.module and any(m is u for u in unit_modules)]
        if unit.is_root or inner:
            continue
        eager = unit.module.forward
        compiled = torch.compile(eager, backend=backend, dynamic=dynamic)
        unit.module.forward = _CompiledUnitForward(unit.module, compiled, engine_hooks, eager)  # type: ignore[method-assign]
        handle.modules.append(unit.module)
    return handle


def _compile_graph(state: Any, config: CompileConfig, dynamic: bool | None) -> ZeroCompileHandle:
    """Graph mode: see [Note: ZeRO-3 collectives as graph ops] in ``_graph.py``."""
    if config.inner == "eager":
        config = dataclasses.replace(config, inner="aot_eager")  # the recompute tagging needs AOT autograd
    specs = group_specs(state)
    plan = None
    if config.unshard_budget is not None and "selective_unshard" in config.passes:
        plan = plan_unshard(specs, profile_gathers(state, specs), config.unshard_budget)  # collective
    keep = frozenset(plan.kept if plan is not None else ())
    handle = ZeroCompileHandle(mode="graph", graph_stats=GraphStats(), plan=plan, specs=specs, _state=state)
    state.suspend_module_hooks()  # raises (clearly) with offload or mid-step
    backend = make_graph_backend(config, specs, keep, handle.graph_stats, handle.stats)  # type: ignore[arg-type]
    try:
        handle.graph = ZeroGraphForward(state, specs, backend, dynamic)
    except BaseException:
        state.resume_module_hooks()
        raise
    return handle


_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")
"""Keyword arguments under which Hugging Face decoder layers receive a key/value cache (by ``transformers`` version
and model family)."""


def _cache_length(cache: Any) -> int | None:
    """Tokens a key/value cache holds (a ``transformers`` ``Cache``: ``get_seq_length()``); None when unknown."""
    length = getattr(cache, "get_seq_length", None)
    if not callable(length):
        return None
    try:
        return int(length())
    except (TypeError, ValueError, RuntimeError, IndexError, AttributeError):
        return None


class _CompiledUnitForward:
    """Runs a unit's compiled forward with the engine's lazy pre-hooks of its submodules called eagerly up front, and
    keeps a key/value cache out of the compiled graph (see [Note: a key/value cache reaching a compiled unit])."""

    def __init__(
        self,
        module: nn.Module,
        compiled: Callable[..., Any],
        hook_ids: set[int],
        eager: Callable[..., Any] | None = None,
    ) -> None:
        self.module = module
        self.compiled = compiled
        self.eager = eager
        self.hooks = [
            (m, k) for m in module.modules() if m is not module for k in m._forward_pre_hooks if k in hook_ids
        ]

    def _target(self, kwargs: dict[str, Any]) -> tuple[Callable[..., Any], dict[str, Any]]:
        """The forward to run for these keyword arguments, and the arguments to run it with."""
        caches = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
        if not caches or self.eager is None:
            return self.compiled, kwargs
        training = self.module.training and torch.is_grad_enabled()
        if training and all(_cache_length(kwargs[k]) == 0 for k in caches):
            return self.compiled, {**kwargs, **dict.fromkeys(caches)}
        return self.eager, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward, kwargs = self._target(kwargs)
        saved = {id(m): (m, dict(m._forward_pre_hooks)) for m, _ in self.hooks}  # restored in the same order
        detached = [(m, m._forward_pre_hooks.pop(k)) for m, k in self.hooks]
        try:
            for m, fn in detached:
                fn(m, args)
            return forward(*args, **kwargs)
        finally:
            for m, hooks in saved.values():
                m._forward_pre_hooks.clear()
                m._forward_pre_hooks.update(hooks)
