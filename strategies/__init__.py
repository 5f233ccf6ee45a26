"""Lightning strategies (thin adapters over the Lightning-free engines in ``zlightning.zero`` and friends)."""

from zlightning.strategies._precision import ZeroPrecision
from zlightning.strategies.pipeline import PipelinePrecision, PipelineStrategy
from zlightning.strategies.zero3 import ZeroMemoryMonitor, ZStackZero3Strategy
from zlightning.strategies.zero3 import ZeroStrategy  # issue 10: short name for offload users

__all__ = ["PipelinePrecision", "PipelineStrategy", "ZStackZero3Strategy", "ZeroMemoryMonitor", "ZeroPrecision", "ZeroStrategy"]
