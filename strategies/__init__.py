"""Lightning strategies (thin adapters over the Lightning-free engines in ``zlightning.zero`` and friends)."""

from zlightning.strategies._precision import ZeroPrecision
from zlightning.strategies.zero3 import ZeroMemoryMonitor, ZStackZero3Strategy

__all__ = ["ZStackZero3Strategy", "ZeroMemoryMonitor", "ZeroPrecision"]
