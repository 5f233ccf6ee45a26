"""Configuration of the zlightning ``torch.compile`` backend."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["PASS_NAMES", "CompileConfig"]

PASS_NAMES = ("selective_unshard", "prefetch", "late_wait")
"""Graph passes in the order they run; see `zlightning.compile._passes`."""


@dataclass(frozen=True)
class CompileConfig:
    """What `backend_fn` does to each Dynamo graph.

    Raises:
        ValueError: an unknown pass or backend, or a negative ``prefetch_distance``.
    """

    passes: tuple[str, ...] = PASS_NAMES
    """Enabled graph passes (any subset of ``PASS_NAMES``; always run in ``PASS_NAMES`` order)."""
    inner: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """Compiler the transformed graph is handed to (``aot_eager``/``eager`` are for debugging and fast tests)."""
    prefetch_distance: int | None = None
    """``prefetch``: hoist an all-gather at most this many nodes earlier (None: as early as its inputs allow)."""

    def __post_init__(self) -> None:
        unknown = [p for p in self.passes if p not in PASS_NAMES]
        if unknown:
            raise ValueError(f"CompileConfig.passes: unknown {unknown}; choose from {list(PASS_NAMES)}")
        if self.inner not in ("inductor", "aot_eager", "eager"):
            raise ValueError(f"CompileConfig.inner must be inductor/aot_eager/eager, got {self.inner!r}")
        if self.prefetch_distance is not None and self.prefetch_distance < 0:
            raise ValueError(f"CompileConfig.prefetch_distance must be >= 0 or None, got {self.prefetch_distance}")
