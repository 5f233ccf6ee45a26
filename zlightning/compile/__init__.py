"""A ZeRO-aware ``torch.compile`` backend (issue 7).

Public surface::

    torch.compile(fn, backend=backend_fn)                      # zlightning passes, then Inductor
    torch.compile(fn, backend=make_backend(CompileConfig(passes=("prefetch",)), stats))
    handle = compile_zero3(zero_state, CompileConfig())        # one graph per ZeRO-3 unit, hooks at the boundaries
"""

from zlightning.compile._backend import CompileStats, backend_fn, make_backend
from zlightning.compile._config import PASS_NAMES, CompileConfig
from zlightning.compile._passes import late_wait, prefetch, run_passes, selective_unshard
from zlightning.compile._zero3 import ZeroCompileHandle, compile_zero3

__all__ = [
    "PASS_NAMES",
    "CompileConfig",
    "CompileStats",
    "ZeroCompileHandle",
    "backend_fn",
    "compile_zero3",
    "late_wait",
    "make_backend",
    "prefetch",
    "run_passes",
    "selective_unshard",
]
