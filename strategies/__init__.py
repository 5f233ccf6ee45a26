"""Lightning strategies (thin adapters over the Lightning-free engines in ``zlightning.zero`` and friends)."""

from zlightning.strategies import _register  # noqa: E402,F401  (registers the strategy names with Lightning)
from zlightning.strategies._precision import ZeroPrecision
from zlightning.strategies.pipeline import PipelinePrecision, PipelineStrategy
from zlightning.strategies.zero3 import ZeroMemoryMonitor, ZStackZero3Strategy

__all__ = ["PipelinePrecision", "PipelineStrategy", "ZStackZero3Strategy", "ZeroPrecision"]


def __getattr__(name: str) -> object:
    """``ZeroStrategy``, an earlier second name of `ZStackZero3Strategy`, keeps working with a warning."""
    if name == "ZeroStrategy":
        import warnings

        warnings.warn(
            "zlightning.strategies.ZeroStrategy is ZStackZero3Strategy: use that name", DeprecationWarning, stacklevel=2
        )
        return ZStackZero3Strategy
    raise AttributeError(f"module 'zlightning.strategies' has no attribute {name!r}")
