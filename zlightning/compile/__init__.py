"""A ZeRO-aware ``torch.compile`` backend.

Public surface::

    torch.compile(fn, backend=backend_fn)                      # zlightning passes, then Inductor
    torch.compile(fn, backend=make_backend(CompileConfig(passes=("prefetch",)), stats))
    handle = compile_zero3(zero_state, CompileConfig())        # graph mode: collectives inside fwd/bwd graphs
    handle = compile_zero3(zero_state, CompileConfig(mode="graph", unshard_budget=0.5))   # + selective unsharding
    handle = compile_zero3(zero_state, CompileConfig(mode="unit"))   # one graph per ZeRO-3 unit, hooks at boundaries
"""

from zlightning.compile._backend import CompileStats, backend_fn, make_backend
from zlightning.compile._budget import GroupProfile, UnshardPlan, plan_unshard, profile_gathers
from zlightning.compile._config import PASS_NAMES, CompileConfig
from zlightning.compile._graph import (
    GraphStats,
    defer_reduce_waits,
    make_graph_backend,
    place_gathers,
    prefetch_gathers,
)
from zlightning.compile._passes import late_wait, prefetch, run_passes, selective_unshard
from zlightning.compile._zero3 import ZeroCompileHandle, compile_zero3

__all__ = [
    "PASS_NAMES",
    "CompileConfig",
    "CompileStats",
    "GraphStats",
    "GroupProfile",
    "UnshardPlan",
    "ZeroCompileHandle",
    "backend_fn",
    "compile_zero3",
    "defer_reduce_waits",
    "late_wait",
    "make_backend",
    "make_graph_backend",
    "place_gathers",
    "plan_unshard",
    "prefetch",
    "prefetch_gathers",
    "profile_gathers",
    "run_passes",
    "selective_unshard",
]
