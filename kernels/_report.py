"""``zlightning kernels``: what is compiled, what falls back, and why (DeepSpeed's ``ds_report`` for our ops)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import shutil
import subprocess
from typing import cast

import torch
from zlightning.kernels import _ext

__all__ = ["kernel_report", "main"]


def _compiler_line() -> str:
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        return "none found (install g++ to build the kernels)"
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    return f"{cxx}: {out.splitlines()[0] if out else 'unknown'}"


def kernel_report() -> dict[str, object]:
    """A dict describing each op (``compiled`` or ``fallback``), the ISA chosen, build flags and versions."""
    from zlightning.kernels import _build

    st = _ext.status()
    info = _ext.build_info()
    build = st.build or {}
    native = "compiled" if st.loaded else "fallback (PyTorch)"
    cuda = "triton" if importlib.util.find_spec("triton") else "torch reference"
    ops = {
        "cpu_adam (zlightning::adam_step_)": native,
        "quantize (zlightning::quantize)": native + (f"; CUDA: {cuda}" if torch.cuda.is_available() else ""),
        "dequantize (zlightning::dequantize)": native,
        "async_io (DeepSpeedIOEngine)": "native io_uring"
        if _ext.aio_native_available()
        else "python thread pool of pread/pwrite" + ("" if st.loaded else " (native backend not built)"),
    }
    return {
        "ops": ops,
        "library": st.library or str(_build.library_path()),
        "loaded": st.loaded,
        "reason": st.reason,
        "isa": info.get("isa", "n/a (not loaded)"),
        "io_uring": info.get("io_uring", "n/a"),
        "build_flags": info.get("flags") or build.get("flags", ""),
        "build_seconds": build.get("seconds"),
        "built_with": info.get("compiler") or build.get("compiler_version", ""),
        "compiler_now": _compiler_line(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "cuda_available": torch.cuda.is_available(),
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }


def _print(rep: dict[str, object]) -> None:
    print("zlightning kernels report")
    print("-" * 72)
    for op, state in cast(dict[str, object], rep["ops"]).items():
        print(f"  {op:40s} {state}")
    print("-" * 72)
    for key in (
        "library",
        "loaded",
        "reason",
        "isa",
        "io_uring",
        "build_flags",
        "build_seconds",
        "built_with",
        "compiler_now",
        "torch",
        "cuda",
        "cuda_available",
        "cpu",
        "threads",
    ):
        if key == "reason" and not rep[key]:
            continue
        print(f"  {key:15s} {rep[key]}")
    if not rep["loaded"]:
        print("\n  Build the kernels once with `zlightning kernels --build`.")


def main(argv: list[str]) -> None:
    """``zlightning kernels [--build [--force]] [--json]``: report (after building, with --build)."""
    p = argparse.ArgumentParser(prog="zlightning kernels", description="Native kernel report (ds_report's job).")
    p.add_argument("--build", action="store_true", help="build (or verify the cached build of) the kernels first")
    p.add_argument("--force", action="store_true", help="with --build: compile again even when a cached build matches")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    a = p.parse_args(argv)
    from zlightning.kernels import _build

    if a.force and not a.build:
        p.error("--force rebuilds: give it with --build")
    if a.build:
        res = _build.build(force=a.force)
        if not res.ok:
            print(f"build failed: {res.error[-2000:]}")
    rep = kernel_report()
    if a.json:
        print(json.dumps(rep, indent=1, default=str))
    else:
        _print(rep)
