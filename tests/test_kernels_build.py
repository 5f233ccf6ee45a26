"""Build and load policy: import never compiles, a missing library falls back with one warning, a failed build
does not raise, and ``zlightning kernels`` reports what is compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from zlightning.kernels import _build, _ext

from zlightning.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_without_a_built_library_import_works_ops_fall_back_and_warn_once(tmp_path):
    code = """
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import zlightning, zlightning.kernels as k
    from zlightning.kernels import _ext
    assert not _ext.available(), _ext.status()
    p = torch.randn(100, requires_grad=True); r = p.detach().clone().requires_grad_()
    opt, ref = k.CPUAdam([p], lr=1e-2, weight_decay=0.1), torch.optim.AdamW([r], lr=1e-2, weight_decay=0.1)
    for _ in range(5):
        p.grad = torch.ones(100); r.grad = torch.ones(100); opt.step(); ref.step()
    assert torch.equal(p, r)
    q = k.quantize(torch.randn(50), bits=4, group_size=10)
    assert k.dequantize(q).shape == (50,)
    eng = k.DeepSpeedIOEngine()
    assert eng.backend_name == "python-threadpool"
msgs = [str(w.message) for w in caught if "native kernels unavailable" in str(w.message)]
assert len(msgs) == 1, msgs
assert "`zlightning kernels --build`" in msgs[0] and "not built" in msgs[0]
print("OK")
"""
    env = {**os.environ, "ZLIGHTNING_KERNELS_DIR": str(tmp_path / "empty")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
    assert not (tmp_path / "empty").exists()  # nothing was compiled or written


def test_failed_build_reports_instead_of_raising(tmp_path, monkeypatch):
    monkeypatch.setenv("ZLIGHTNING_KERNELS_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    res = _build.build(verbose=False)
    assert not res.ok and res.library == "" and "/bin/false" in res.error
    meta = json.loads((tmp_path / res.key / "build.json").read_text())
    assert meta["ok"] is False
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no compiler anywhere
    res = _build.build(verbose=False)
    assert not res.ok and "no C++ compiler" in res.error


def test_cache_key_follows_sources_and_torch_version():
    key = _build.cache_key()
    assert key == _build.cache_key(torch.__version__) and len(key) == 16
    assert _build.cache_key("0.0.0") != key


def test_cli_report_matches_load_status(capsys):
    main(["kernels", "--json"])
    rep = json.loads(capsys.readouterr().out)
    status = _ext.status()
    assert rep["loaded"] == status.loaded and rep["torch"] == torch.__version__
    states = set(rep["ops"].values())
    if status.loaded:
        assert rep["isa"] in ("avx512", "avx2", "base (x86-64 SSE2)") and "compiled" in states
        assert "-O3" in rep["build_flags"]
    else:
        assert any("fallback" in s for s in states) and rep["reason"]
    main(["kernels"])
    text = capsys.readouterr().out
    assert "cpu_adam (zlightning::adam_step_)" in text and "DeepSpeedIOEngine" in text


@pytest.mark.skipif(not _ext.available(), reason="native kernels not built")
def test_isa_override_and_unknown_isa():
    assert torch.ops.zlightning.set_isa("base").startswith("base")
    try:
        with pytest.raises(RuntimeError, match="unknown ISA 'sse9'"):
            torch.ops.zlightning.set_isa("sse9")
    finally:
        torch.ops.zlightning.set_isa("")


def test_build_dir_falls_back_to_the_user_cache_when_the_package_is_read_only(tmp_path, monkeypatch):
    monkeypatch.delenv("ZLIGHTNING_KERNELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    package = _build._package_build_dir()
    assert _build.search_dirs() == [package, tmp_path / "xdg" / "zlightning" / "kernels"]
    monkeypatch.setattr(_build, "_writable", lambda path: False)  # e.g. a system-wide install
    assert _build.build_dir() == tmp_path / "xdg" / "zlightning" / "kernels"
    monkeypatch.setenv("CXX", "/bin/false")  # the build runs (and fails fast) in the user cache
    res = _build.build(force=True, verbose=False)
    assert not res.ok and (tmp_path / "xdg" / "zlightning" / "kernels" / res.key / "build.json").exists()
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert _build.user_cache_dir() == tmp_path / "home" / ".cache" / "zlightning" / "kernels"


def test_library_path_finds_a_build_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("ZLIGHTNING_KERNELS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(_build, "_package_build_dir", lambda: tmp_path / "package" / "build")
    key = _build.cache_key()
    assert _build.library_path(key) == tmp_path / "package" / "build" / key / _build.LIB_NAME  # none yet: where
    cached = tmp_path / "zlightning" / "kernels" / key / _build.LIB_NAME  # build would write
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")
    assert _build.library_path(key) == cached
