"""Test utilities: a gloo multi-process harness (spawn N ranks, free port, group timeout)."""

from zlightning.testing._spawn import DistributedTestError, find_free_port, run_distributed, set_start_method

__all__ = ["DistributedTestError", "find_free_port", "run_distributed", "set_start_method"]
