"""The old module path of ``zlightning analyze``'s entry point, kept for code that imports it from here; the command
lives in ``zlightning.datamodules.curriculum._cli``."""

from .curriculum._cli import analyze_main

__all__ = ["analyze_main"]
