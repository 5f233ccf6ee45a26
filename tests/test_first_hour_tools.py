"""The tools a new user meets first, outside the training loop: the warning when the native kernels are not built
(the public command that builds them, printed by one rank), ``zlightning estimate`` on the machine it runs on, and
the examples importing only public names, each from the package that exports it."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from zlightning.kernels import _ext

ROOT = Path(__file__).resolve().parents[1]


def _fallback_warnings(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], calls: int = 2) -> list[str]:
    """The kernel fallback warnings of ``calls`` ops in a fresh process state with ``env`` as its rank variables."""
    for var in ("RANK", "LOCAL_RANK", "ZLIGHTNING_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(_ext, "_warned", False)
    monkeypatch.setattr(_ext, "_status", _ext.ExtStatus(False, "not built for these sources and this torch"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for op in ("CPUAdam", "quantize", "dequantize")[:calls]:
            _ext.warn_fallback(op)
    return [str(w.message) for w in caught if "native kernels unavailable" in str(w.message)]


def test_kernel_fallback_warning_names_the_public_build_command(monkeypatch: pytest.MonkeyPatch) -> None:
    (message,) = _fallback_warnings(monkeypatch, {})
    assert "`zlightning kernels --build`" in message, message
    # neither the repository's Makefile nor a private module: both are missing from a pip install
    assert "make install" not in message and "_build" not in message, message
    assert "CPUAdam" in message and "not built" in message, message


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RANK": "0", "LOCAL_RANK": "0"}, 1),
        ({"RANK": "3", "LOCAL_RANK": "1"}, 0),
        ({"RANK": "2", "LOCAL_RANK": "0"}, 0),  # the first rank of a second host: rank 0 speaks for the group
        ({"LOCAL_RANK": "1"}, 0),  # a rank started by Lightning's popen launcher
        ({"LOCAL_RANK": "0"}, 1),
    ],
)
def test_kernel_fallback_warning_is_printed_by_one_rank(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], expected: int
) -> None:
    assert len(_fallback_warnings(monkeypatch, env, calls=3)) == expected


def _estimate(*args: str) -> str:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no CUDA device, whatever this machine has
    proc = subprocess.run(
        [sys.executable, "-m", "zlightning.cli", "estimate", "--params", "7e9", "--world-size", "8", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _gib(out: str, key: str) -> float:
    return float(next(line.split()[1] for line in out.splitlines() if line.split()[:1] == [key]))


def test_estimate_defaults_to_the_device_present_and_says_which() -> None:
    out = _estimate()
    assert "compute device: cpu" in out and "--device cuda" in out, out
    # on a CPU-only machine every byte is host memory: 16 bytes an element of a 875e6-element shard
    assert _gib(out, "device_bytes") == 0 and _gib(out, "host_bytes") == pytest.approx(4 * 3.26, abs=0.01), out
    explicit = _estimate("--device", "cuda")  # the flag wins over detection
    assert "compute device: cuda" in explicit and "--device" in explicit, explicit
    assert _gib(explicit, "device_bytes") == pytest.approx(4 * 3.26, abs=0.01), explicit


def _example_imports() -> list[tuple[str, str, list[str]]]:
    """(file, module, names) for every ``import``/``from ... import`` of zlightning in examples/*.py."""
    found = []
    for path in sorted((ROOT / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zlightning":
                found.append((path.name, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found += [(path.name, a.name, []) for a in node.names if a.name.split(".")[0] == "zlightning"]
    return found


def test_examples_import_only_public_names_from_the_package_exporting_them() -> None:
    imports = _example_imports()
    assert any(module == "zlightning.callbacks" for _, module, _ in imports)  # the scan sees the examples' imports
    problems = []
    for where, module, names in imports:
        if any(part.startswith("_") for part in module.split(".")):
            problems.append(f"examples/{where}: imports the private module {module}")
            continue
        exported = getattr(importlib.import_module(module), "__all__", None)
        for name in (n for n in names if n not in ("*", "__all__")):  # the compatibility modules re-export all
            if name.startswith("_") or (exported is not None and name not in exported):
                problems.append(f"examples/{where}: {module}.{name} is not in {module}.__all__")
    assert not problems, "\n".join(problems)


def test_zero_memory_monitor_and_run_summary_are_exported_by_zlightning_callbacks() -> None:
    import zlightning.strategies as strategies

    import zlightning.callbacks as callbacks

    assert {"ZeroMemoryMonitor", "RunSummary"} <= set(callbacks.__all__)
    assert "ZeroMemoryMonitor" not in strategies.__all__  # one public home
    assert strategies.ZeroMemoryMonitor is callbacks.ZeroMemoryMonitor  # older imports keep working
