"""Configuration of the zlightning ``torch.compile`` backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PASS_NAMES", "CompileConfig"]

PASS_NAMES = ("selective_unshard", "prefetch", "late_wait")
"""Graph passes in the order they run; see `zlightning.compile._passes`."""


@dataclass(frozen=True)
class CompileConfig:
    """What `backend_fn` does to each Dynamo graph, and how `compile_zero3` compiles a ZeRO-3 model.

    Raises:
        ValueError: an unknown pass, backend or mode, a negative ``prefetch_distance``/``prefetch_depth``, or an
            ``unshard_budget`` that is negative or a fraction above 1.
    """

    passes: tuple[str, ...] = PASS_NAMES
    """Enabled graph passes (any subset of ``PASS_NAMES``; always run in ``PASS_NAMES`` order)."""
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """Compiler the transformed graph is handed to (``aot_eager``/``eager`` are for debugging and fast tests;
    graph mode needs AOT autograd, so ``eager`` means ``aot_eager`` there)."""
    prefetch_distance: int | None = None
    """``prefetch`` on Dynamo graphs: hoist an all-gather at most this many nodes earlier (None: as early as its inputs
    allow)."""
    mode: Literal["auto", "unit", "graph"] = "unit"
    """`compile_zero3`: ``"unit"`` (default) compiles each ZeRO unit's forward and lets the engine's hooks gather at
    the unit boundaries; ``"graph"`` compiles the model's whole forward with the ZeRO-3 all-gathers and reduce-scatters
    as ops inside the forward and backward graphs (see [Note: ZeRO-3 collectives as graph ops] in ``_graph.py``;
    measured a few percent faster, see ``benchmarks/results/compile_inject.md``); ``"auto"`` takes graph mode unless
    the engine offloads parameters/optimizer state or has a tensor-parallel group, which graph mode does not drive,
    and unit mode then. Unit mode is the default because it keeps the eager engine's semantics exactly: in graph mode
    a parameter that gets no gradient gets a zero gradient instead of ``None`` (so AdamW still decays it and moves
    its moments), and accumulation with ``gradient_sync=False`` still reduce-scatters every micro-batch."""
    prefetch_depth: int = 1
    """Graph mode, ``prefetch`` pass: each unit's all-gather is issued this many units ahead of its first use (0:
    gather just in time; larger: more overlap, more gathered memory)."""
    unshard_budget: int | float | None = None
    """Graph mode, ``selective_unshard``: extra bytes of gathered parameters that may stay unsharded from the forward
    to the backward (skipping their backward re-gather). An int is bytes; a float in [0, 1] is a fraction of the
    sharded units' total gathered bytes; None keeps none. Which units stay is decided from a measured profile (see
    [Note: memory budget] in ``_budget.py``)."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.passes if p not in PASS_NAMES]
        if unknown:
            raise ValueError(f"CompileConfig.passes: unknown {unknown}; choose from {list(PASS_NAMES)}")
        if self.inner not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"CompileConfig.inner must be inductor/aot_eager/eager, got {self.inner!r}")
        if self.prefetch_distance is not None and self.prefetch_distance < 0:
            raise ValueError(f"CompileConfig.prefetch_distance must be >= 0 or None, got {self.prefetch_distance}")
        if self.mode not in ("auto", "unit", "graph"):
            raise ValueError(f"CompileConfig.mode must be 'auto', 'unit' or 'graph', got {self.mode!r}")
        if self.prefetch_depth < 0:
            raise ValueError(f"CompileConfig.prefetch_depth must be >= 0, got {self.prefetch_depth}")
        b = self.unshard_budget
        if b is not None and (
            isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0 or (isinstance(b, float) and b > 1.0)
        ):
            raise ValueError(
                f"CompileConfig.unshard_budget must be bytes (int >= 0), a fraction (float in [0, 1]) or "
                f"None, got {b!r}"
            )
