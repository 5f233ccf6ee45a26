"""``backend_fn``: the zlightning ``torch.compile`` backend (graph passes, then Inductor)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import fx

from zlightning.compile._config import CompileConfig
from zlightning.compile._passes import PassStats, run_passes

__all__ = ["CompileStats", "backend_fn", "make_backend"]


@dataclass
class CompileStats:
    """What one backend instance did: graphs compiled (each recompile is one more) and per-graph pass counts."""

    graphs: int = 0
    """Dynamo graphs handed to the backend (first compiles + recompiles + graph-break fragments)."""
    passes: list[PassStats] = field(default_factory=list)
    """Per graph, nodes moved/removed by each pass."""


def backend_fn(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: CompileConfig | None = None,
    stats: CompileStats | None = None,
) -> Callable[..., Any]:
    """A ``torch.compile`` backend: runs the enabled zlightning passes on the Dynamo graph, then compiles it.

    Use ``torch.compile(fn, backend=backend_fn)`` for the defaults, or ``make_backend(config)`` for other knobs.

    Args:
        gm: the Dynamo FX graph.
        example_inputs: its example inputs (real or fake tensors).
        config: passes and inner compiler (default ``CompileConfig()``: all passes, Inductor).
        stats: filled in with graph and pass counts when given.

    Returns:
        The compiled callable.
    """
    config = config or CompileConfig()
    pass_stats = run_passes(gm, config)
    if stats is not None:
        stats.graphs += 1
        stats.passes.append(pass_stats)
    if config.inner == "eager":
        return gm.forward
    if config.inner == "aot_eager":
        # Dynamo hands the backend its own list of example inputs (CompilerFn annotates it as list[Tensor])
        return torch._dynamo.lookup_backend("aot_eager")(gm, cast("list[torch.Tensor]", example_inputs))
    from torch._inductor.compile_fx import compile_fx

    # without AOT export options compile_fx returns the compiled callable (CompileFxOutput also lists the export results)
    return cast(Callable[..., Any], compile_fx(gm, list(example_inputs)))


def make_backend(config: CompileConfig | None = None, stats: CompileStats | None = None) -> Callable[..., Any]:
    """``backend_fn`` bound to a config (and a stats sink), for ``torch.compile(..., backend=make_backend(cfg))``."""
    return functools.partial(backend_fn, config=config or CompileConfig(), stats=stats)
