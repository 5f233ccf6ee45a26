"""``ZLIGHTNING_KERNELS=fallback`` runs every op on its PyTorch reference, without the fallback warning, and the
results are those of the native ops (checked in a fresh process: the choice is made once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from zlightning.kernels import _ext

_PROGRAM = """
import warnings, torch
warnings.simplefilter("error")
from zlightning.kernels import _ext, quantize, dequantize
x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
q = quantize(x, bits=8, group_size=64, symmetric=True)
torch.save({"loaded": _ext.status().loaded, "reason": _ext.status().reason, "out": dequantize(q)}, "{out}")
"""


def _run(tmp_path, value: str | None) -> dict:
    import torch

    out = tmp_path / f"{value}.pt"
    env = {k: v for k, v in os.environ.items() if k != "ZLIGHTNING_KERNELS"}
    if value is not None:
        env["ZLIGHTNING_KERNELS"] = value
    program = _PROGRAM.replace("{out}", str(out))
    result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return torch.load(out, weights_only=True)


def test_forced_fallback_uses_the_references_silently(tmp_path) -> None:
    forced = _run(tmp_path, "fallback")
    assert forced["loaded"] is False and "ZLIGHTNING_KERNELS=fallback" in forced["reason"]
    if not _ext.available():
        pytest.skip("native kernels not built here: nothing to compare the references with")
    native = _run(tmp_path, None)
    assert native["loaded"] is True
    assert (forced["out"] == native["out"]).all()
