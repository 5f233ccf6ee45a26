"""Loading the prebuilt native library, its fake kernels, and the warn-once fallback.

Nothing here compiles: see [Note: build once, never at import] in ``_build.py``. `available` loads the cached
library on first call (``torch.ops.load_library``), registers fake kernels (so ``torch.compile`` traces the ops) and
the CUDA implementations of quantize/dequantize, and remembers the outcome. When the library is missing or fails to
load, every op uses its PyTorch reference and `warn_fallback` warns once per process group, naming the reason and the
fix.
"""

from __future__ import annotations

import json
import os
import re
import threading
import warnings
from dataclasses import dataclass

import torch

__all__ = ["ExtStatus", "aio_native_available", "available", "build_info", "status", "warn_fallback"]


@dataclass(frozen=True)
class ExtStatus:
    """Outcome of loading the native library."""

    loaded: bool
    """True when ``torch.ops.zlightning.*`` are the compiled kernels."""
    reason: str
    """Why not loaded (empty when loaded)."""
    library: str = ""
    """Path of the library (loaded or expected)."""
    build: dict | None = None
    """Contents of the library's build.json (compiler, flags, build seconds), when present."""


_lock = threading.Lock()
_status: ExtStatus | None = None
_warned = False
_uring_ok: bool | None = None


_FORCE_ENV = "ZLIGHTNING_KERNELS"
"""``ZLIGHTNING_KERNELS=fallback`` runs every op on its PyTorch reference (to compare, or to rule the native code out);
unset or ``auto``: the native library when it loads."""


def _forced_fallback() -> bool:
    value = os.environ.get(_FORCE_ENV, "auto").strip().lower()
    if value not in ("auto", "fallback", ""):
        warnings.warn(f"{_FORCE_ENV}={value!r} is not 'auto' or 'fallback'; using 'auto'", RuntimeWarning, stacklevel=3)
    return value == "fallback"


def _load() -> ExtStatus:
    from zlightning.kernels import _build

    if _forced_fallback():
        return ExtStatus(False, f"{_FORCE_ENV}=fallback asks for the PyTorch references")

    try:
        lib = _build.library_path()
    except OSError as err:
        return ExtStatus(False, f"kernel sources unreadable: {err}")
    meta_file = lib.parent / "build.json"
    try:
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else None
    except (OSError, ValueError):  # a cut-short build.json: not a reason to fail
        meta = None
    if not lib.exists():
        why = "not built for these sources and this torch" if meta is None or meta.get("ok") else "the build failed"
        where = " or ".join(str(d / lib.parent.name) for d in _build.search_dirs())
        return ExtStatus(False, f"{why} (looked for {lib.name} in {where})", str(lib), meta)
    problem = _build.library_problem(lib)  # a truncated library would kill the process (SIGBUS) in dlopen
    if problem:
        return ExtStatus(False, f"{problem}; rebuild with `zlightning kernels --build`", str(lib), meta)
    try:
        torch.ops.load_library(str(lib))
    except (OSError, RuntimeError) as err:
        return ExtStatus(False, f"loading {lib} failed: {err}", str(lib), meta)
    _register_fakes()
    _register_cuda()
    return ExtStatus(True, "", str(lib), meta)


def status() -> ExtStatus:
    """Loads the library once (never compiles) and returns the outcome."""
    global _status
    with _lock:
        if _status is None:
            _status = _load()
        return _status


def available() -> bool:
    """True when the compiled ops are loaded."""
    return status().loaded


def build_info() -> dict[str, str]:
    """``isa``, ``compiler``, ``flags``, ``io_uring`` as reported by the loaded library (empty if not loaded)."""
    if not available():
        return {}
    parts = re.split(r";(?=(?:isa|compiler|flags|io_uring)=)", torch.ops.zlightning.build_info())
    return dict(kv.split("=", 1) for kv in parts)


def aio_native_available() -> bool:
    """True when the io_uring backend can be used: library loaded and the kernel allows io_uring."""
    global _uring_ok
    if _uring_ok is None:
        _uring_ok = available() and build_info().get("io_uring") == "yes"
    return _uring_ok


def _speaks_for_its_group() -> bool:
    """True on the one process that warns for a process group: global rank 0 where a rank is known
    (``torch.distributed`` initialised, else ``RANK``), local rank 0 where only ``LOCAL_RANK`` is set (Lightning's
    launcher sets it for the ranks it starts), and any process with no rank at all."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value) == 0
    return True


def warn_fallback(op: str) -> None:
    """Warns, once per process group (rank 0 only; see `_speaks_for_its_group`), that ``op`` (and the other native
    ops) run their PyTorch reference, naming the reason and the public command that builds the kernels."""
    global _warned
    if _warned or _forced_fallback():  # asked for: nothing to warn about
        return
    _warned = True
    if not _speaks_for_its_group():  # the other ranks run the same install: one warning speaks for the group
        return
    warnings.warn(
        f"zlightning.kernels: native kernels unavailable ({status().reason}); {op} and the other ops use their "
        "PyTorch fallback (correct, slower). Build them once with `zlightning kernels --build` (from any install; "
        "`zlightning kernels` shows the report).",
        RuntimeWarning,
        stacklevel=3,
    )


def _register_fakes() -> None:
    """Fake kernels: shapes/dtypes only, so torch.compile and FakeTensor tracing see the ops."""

    @torch.library.register_fake("zlightning::adam_step_")
    def _adam_fake(
        param,
        grad,
        exp_avg,
        exp_avg_sq,
        param_copy,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        step,
        bias_correction,
        adamw_mode,
    ):
        return None

    @torch.library.register_fake("zlightning::quantize")
    def _quantize_fake(x, bits, group_size, symmetric):
        groups = -(-x.numel() // group_size)
        qdtype = torch.int8 if bits == 8 and symmetric else torch.uint8
        q = x.new_empty((groups, group_size * bits // 8), dtype=qdtype)
        return q, x.new_empty((groups,), dtype=torch.float32), x.new_empty((groups,), dtype=torch.float32)

    @torch.library.register_fake("zlightning::dequantize")
    def _dequantize_fake(data, scale, offset, bits, group_size, symmetric, numel, dtype):
        return data.new_empty((numel,), dtype=dtype)


def _register_cuda() -> None:
    """quantize/dequantize on CUDA tensors: the Triton kernels when triton is importable, else the torch reference
    (which runs on the GPU as ordinary torch ops)."""
    from zlightning.kernels import _quant

    torch.library.impl("zlightning::quantize", "CUDA")(_quant.quantize_cuda)
    torch.library.impl("zlightning::dequantize", "CUDA")(_quant.dequantize_cuda)
