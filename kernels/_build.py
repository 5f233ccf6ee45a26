"""Ahead-of-time build of the native kernels: ``python -m zlightning.kernels._build`` (run by ``make install``).

[Note: build once, never at import]
DeepSpeed's op builders compile on first use, inside the user's training job, and a missing compiler or header turns
into an import-time crash. Here the compile happens only in this module's `build`, which ``make install`` (and
``zlightning kernels --build``) calls. The result is cached under a key made of the sources, the flags, the compiler
and the torch version (`cache_key`); `zlightning.kernels._ext` only *loads* a library whose key matches the current
sources and torch, and otherwise warns once and uses the pure-PyTorch reference of every op.

[Note: where built kernels live]
The library is keyed by sources and torch version (`cache_key`), so any number of builds can share a folder. `build`
writes into ``build/`` next to these sources when that folder can be written (the repository for an editable
install, site-packages of a user's own virtualenv), otherwise into the per-user cache (`user_cache_dir`, honouring
``XDG_CACHE_HOME``), so ``zlightning kernels --build`` works from a system-wide or read-only install too.
`library_path` (what `_ext` loads) looks in both places, package first; ``ZLIGHTNING_KERNELS_DIR`` replaces both.

The ISA-specific Adam kernel is compiled three times (AVX-512, AVX2, baseline x86-64) from the torch-free
``adam_isa.cpp`` and picked at run time by CPU feature detection in ``ops.cpp`` (override with
``ZLIGHTNING_KERNELS_ISA=avx2|base``), so one cached library is correct on any x86-64 machine. Only ``ops.cpp``
includes torch's headers (the slow part of the build); the objects compile in parallel.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "BuildResult",
    "build",
    "build_dir",
    "cache_key",
    "library_path",
    "library_problem",
    "search_dirs",
    "user_cache_dir",
]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("zl_kernels.h", "adam_isa.cpp", "aio_uring.cpp", "host_cache.cpp", "checksum.cpp", "ops.cpp")
LIB_NAME = "libzlkernels.so"
COMMON_FLAGS = ["-O3", "-std=c++20", "-fPIC", "-fno-math-errno", "-ffp-contract=off", "-fvisibility=hidden"]
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "base": [],
}


@dataclass(frozen=True)
class BuildResult:
    """What `build` did; also written as ``build.json`` next to the library."""

    ok: bool
    library: str
    key: str
    compiler: str
    compiler_version: str
    torch_version: str
    flags: str
    seconds: float
    error: str = ""


def _torch_info() -> tuple[str, list[str], str, bool]:
    import torch
    from torch.utils.cpp_extension import include_paths

    lib_dir = str(Path(torch.__file__).parent / "lib")
    return torch.__version__, include_paths(), lib_dir, bool(torch._C._GLIBCXX_USE_CXX11_ABI)


def _compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise FileNotFoundError("no C++ compiler found (set CXX, or install g++: `apt-get install g++`)")
    return cxx


def _compiler_version(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0].strip() if out else "unknown"


def cache_key(torch_version: str | None = None) -> str:
    """Hash of the sources, flags and torch version: a library with another key is never loaded. (The compiler
    is recorded in build.json, not in the key, so loading never runs a compiler.)"""
    if torch_version is None:
        import torch

        torch_version = torch.__version__
    h = hashlib.sha256()
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    h.update(json.dumps([COMMON_FLAGS, ISA_FLAGS, torch_version, platform.machine()]).encode())
    return h.hexdigest()[:16]


def user_cache_dir() -> Path:
    """The per-user cache for built libraries: ``$XDG_CACHE_HOME/zlightning/kernels``, else
    ``~/.cache/zlightning/kernels``."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "zlightning" / "kernels"


def _package_build_dir() -> Path:
    return Path(__file__).resolve().parent / "build"


def _writable(path: Path) -> bool:
    """True when ``path`` can be created or written: the nearest existing ancestor is writable."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return os.access(path, os.W_OK)


def build_dir() -> Path:
    """Where `build` writes: ``$ZLIGHTNING_KERNELS_DIR``, else ``build/`` inside the installed package when it is
    writable (an editable install, a user's own virtualenv), else `user_cache_dir` (a system-wide or read-only
    install). See [Note: where built kernels live]."""
    env = os.environ.get("ZLIGHTNING_KERNELS_DIR")
    if env:
        return Path(env)
    local = _package_build_dir()
    return local if _writable(local) else user_cache_dir()


def search_dirs() -> list[Path]:
    """Where a built library is looked for, in order: ``$ZLIGHTNING_KERNELS_DIR`` alone when set, else the package's
    ``build/`` then `user_cache_dir`."""
    env = os.environ.get("ZLIGHTNING_KERNELS_DIR")
    if env:
        return [Path(env)]
    return [_package_build_dir(), user_cache_dir()]


def library_path(key: str | None = None) -> Path:
    """The library for the current sources and torch: the first of `search_dirs` that has one, else where `build`
    would write it (it may not exist yet)."""
    key = key or cache_key()
    for base in search_dirs():
        if (base / key / LIB_NAME).exists():
            return base / key / LIB_NAME
    return build_dir() / key / LIB_NAME


def library_problem(path: Path) -> str:
    """Why the library file at ``path`` cannot be loaded safely ("" when it looks whole).

    A truncated shared object (a build or copy cut short, a full disk) is not refused by ``dlopen``: the loader maps
    segments past the end of the file and the process dies of SIGBUS at import. So the ELF header, the program
    header table and every segment are checked to lie inside the file before loading.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            head = fh.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:
                return f"{path} is not a 64-bit ELF shared library ({size} bytes): truncated or corrupted"
            end = "<" if head[5] == 1 else ">"
            phoff, shoff = struct.unpack_from(end + "QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(end + "HHHH", head, 0x36)
            tables = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
            if tables > size:
                return f"{path} is truncated: {size} bytes, its ELF tables end at byte {tables}"
            fh.seek(phoff)
            for _ in range(phnum):
                offset, filesz = struct.unpack_from(end + "8xQ16xQ", fh.read(phentsize))
                if offset + filesz > size:
                    return f"{path} is truncated: {size} bytes, a segment ends at byte {offset + filesz}"
    except (OSError, struct.error) as err:
        return f"{path} cannot be read: {err}"
    return ""


def _commands(
    cxx: str, out: Path, includes: list[str], lib_dir: str, abi: bool
) -> tuple[list[list[str]], list[str], str]:
    inc = [f"-I{p}" for p in includes] + [f"-I{CSRC}"]
    abi_flag = [f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}"]
    objs, cmds = [], []
    for isa, flags in ISA_FLAGS.items():
        obj = str(out / f"adam_{isa}.o")
        cmds.append(
            [
                cxx,
                *COMMON_FLAGS,
                "-fopenmp-simd",
                *flags,
                f"-DZL_ISA_FN=adam_{isa}",
                f"-I{CSRC}",
                "-c",
                str(CSRC / "adam_isa.cpp"),
                "-o",
                obj,
            ]
        )
        objs.append(obj)
    obj = str(out / "aio_uring.o")
    cmds.append([cxx, *COMMON_FLAGS, *abi_flag, f"-I{CSRC}", "-c", str(CSRC / "aio_uring.cpp"), "-o", obj])
    objs.append(obj)
    flags_str = (
        " ".join(COMMON_FLAGS)
        + " | isa: "
        + "; ".join(f"{k}: {' '.join(v) or '(x86-64)'}" for k, v in ISA_FLAGS.items())
    )
    for name in ("host_cache", "checksum"):
        obj = str(out / f"{name}.o")
        cmds.append([cxx, *COMMON_FLAGS, *abi_flag, *inc, "-c", str(CSRC / f"{name}.cpp"), "-o", obj])
        objs.append(obj)
    obj = str(out / "ops.o")
    cmds.append(
        [
            cxx,
            *COMMON_FLAGS,
            *abi_flag,
            "-fopenmp",
            "-DTORCH_EXTENSION_NAME=zlkernels",
            f'-DZL_BUILD_FLAGS="{flags_str}"',
            *inc,
            "-c",
            str(CSRC / "ops.cpp"),
            "-o",
            obj,
        ]
    )
    objs.append(obj)
    link = [
        cxx,
        "-shared",
        "-o",
        str(out / LIB_NAME),
        *objs,
        f"-L{lib_dir}",
        "-lc10",
        "-ltorch_cpu",
        "-ltorch",
        f"-Wl,-rpath,{lib_dir}",
        "-lpthread",
    ]
    gomp = Path(lib_dir) / "libgomp.so.1"  # torch's own OpenMP runtime: never load a second one
    link += [str(gomp)] if gomp.exists() else ["-fopenmp"]
    return cmds, link, flags_str


def _compile_cached(cmd: list[str]) -> subprocess.CompletedProcess:
    """Compiles one object, reusing an identical earlier compile (same command and sources) from ``objcache/``:
    editing one source recompiles only that object (ops.cpp, with torch's headers, is the slow one)."""
    src, obj = Path(cmd[cmd.index("-c") + 1]), Path(cmd[cmd.index("-o") + 1])
    h = hashlib.sha256(
        json.dumps([c for c in cmd if c != str(obj)]).encode() + src.read_bytes() + (CSRC / "zl_kernels.h").read_bytes()
    ).hexdigest()[:20]
    cached = build_dir() / "objcache" / f"{obj.stem}-{h}.o"
    if cached.exists():
        shutil.copyfile(cached, obj)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(obj, cached)
    return proc


def build(force: bool = False, verbose: bool = True) -> BuildResult:
    """Compiles and caches the native library (a no-op when the cached one matches). Never raises for compile
    errors: the result says ``ok=False`` with the compiler's output, and callers fall back to PyTorch."""
    t0 = time.perf_counter()
    torch_version, includes, lib_dir, abi = _torch_info()
    try:
        cxx = _compiler()
    except FileNotFoundError as err:
        return BuildResult(False, "", "", "", "", torch_version, "", 0.0, str(err))
    cver = _compiler_version(cxx)
    key = cache_key(torch_version)
    found = library_path(key)
    problem = library_problem(found) if found.exists() else ""
    if problem and verbose:
        print(f">> zlightning kernels: rebuilding: {problem}")
    if found.exists() and not force and not problem:
        out, lib = found.parent, found
        meta = json.loads((out / "build.json").read_text()) if (out / "build.json").exists() else {}
        if verbose:
            print(f">> zlightning kernels: cached build {lib} (built in {meta.get('seconds', 0):.0f}s)")
        return BuildResult(
            True, str(lib), key, cxx, cver, torch_version, meta.get("flags", ""), meta.get("seconds", 0.0)
        )
    out = build_dir() / key
    lib = out / LIB_NAME
    out.mkdir(parents=True, exist_ok=True)
    cmds, link, flags = _commands(cxx, out, includes, lib_dir, abi)
    if verbose:
        print(f">> zlightning kernels: compiling {len(cmds)} objects with {cver} into {out} (takes a few minutes)")
    with ThreadPoolExecutor(max_workers=max(1, min(len(cmds), os.cpu_count() or 1))) as pool:
        procs = list(pool.map(_compile_cached, cmds))
    errors = [f"$ {' '.join(c)}\n{p.stderr}" for c, p in zip(cmds, procs) if p.returncode]
    if not errors:
        p = subprocess.run(link, capture_output=True, text=True, check=False)
        if p.returncode:
            errors.append(f"$ {' '.join(link)}\n{p.stderr}")
    seconds = time.perf_counter() - t0
    res = BuildResult(
        not errors,
        str(lib) if not errors else "",
        key,
        cxx,
        cver,
        torch_version,
        flags,
        seconds,
        "\n".join(errors)[-8000:],
    )
    if errors and lib.exists():
        lib.unlink()
    (out / "build.json").write_text(json.dumps(asdict(res), indent=1))
    for obj in out.glob("*.o"):
        obj.unlink()
    if res.ok:
        _prune_stale(key, torch_version)
    if verbose:
        print(
            f">> zlightning kernels: {'built' if res.ok else 'BUILD FAILED'} in {seconds:.0f}s"
            + ("" if res.ok else f"; the PyTorch fallbacks will be used. Compiler output:\n{res.error}")
        )
    return res


def _prune_stale(key: str, torch_version: str) -> None:
    """Removes libraries built for the same torch from older sources (they can never load again)."""
    for meta in build_dir().glob("*/build.json"):
        if meta.parent.name != key and json.loads(meta.read_text()).get("torch_version") == torch_version:
            shutil.rmtree(meta.parent, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zlightning.kernels._build", description=__doc__.split("\n")[0])
    p.add_argument("--force", action="store_true", help="rebuild even if a matching cached library exists")
    p.add_argument("--strict", action="store_true", help="exit 1 when the build fails (default: warn, exit 0)")
    a = p.parse_args(argv)
    res = build(force=a.force)
    return 1 if (a.strict and not res.ok) else 0


if __name__ == "__main__":
    sys.exit(main())
