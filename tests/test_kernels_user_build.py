"""The build cache as users break it: a truncated library must not kill the process at load; `build` redoes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from zlightning.kernels import _build, _ext

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(not _ext.available(), reason="needs a built library to truncate")
def test_truncated_cached_library_falls_back_with_a_reason_and_is_rebuilt(tmp_path, monkeypatch):
    key = _build.cache_key()
    good = Path(_ext.status().library)
    cut = tmp_path / key / _build.LIB_NAME
    cut.parent.mkdir()
    cut.write_bytes(good.read_bytes()[:10_000])  # a copy or build cut short (full disk, killed job)
    assert "truncated" in _build.library_problem(cut) and _build.library_problem(good) == ""
    code = """
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import zlightning.kernels as k
    q = k.dequantize(k.quantize(torch.randn(10), 8, 4))
assert not k._ext.available() and "truncated" in k._ext.status().reason, k._ext.status()
assert any("truncated" in str(w.message) and "kernels --build" in str(w.message) for w in caught)
print("OK")
"""
    env = {**os.environ, "ZLIGHTNING_KERNELS_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, (out.returncode, out.stderr[-2000:])  # was -7 (SIGBUS)
    monkeypatch.setenv("ZLIGHTNING_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a rebuild is attempted (and fails fast), not "cached build"
    res = _build.build(verbose=False)
    assert not res.ok and "/bin/false" in res.error


def test_kernels_build_force_reaches_the_build(monkeypatch, capsys) -> None:
    """``zlightning kernels --build --force`` compiles again (the cache is bypassed); --force alone is refused."""
    from zlightning.kernels import _report

    calls = []

    def fake_build(force: bool = False, verbose: bool = True) -> _build.BuildResult:
        calls.append(force)
        return _build.BuildResult(False, "", "", "", "", "", "", 0.0, error="not compiled in this test")

    monkeypatch.setattr(_build, "build", fake_build)
    _report.main(["--build", "--force", "--json"])
    assert calls == [True]
    with pytest.raises(SystemExit):
        _report.main(["--force"])
    assert "give it with --build" in capsys.readouterr().err
