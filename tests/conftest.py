"""Suite-wide test settings.

[Note: one torch thread in the test process]
Distributed tests spawn ranks with one intra-op thread each (``run_distributed(threads=1)``) on a 2-core CI machine;
single-process references computed here with torch's default thread count compete with those ranks and with each
other, which made small reference runs take seconds instead of milliseconds. One thread also gives the references
the same reduction order as the ranks. A test that needs more threads sets them itself.
"""

import os

import pytest
import torch

import tests._hub_kernels  # noqa: F401  (the installed `kernels` package, here and in the rank fork server below)
from zlightning.testing import set_start_method

torch.set_num_threads(1)

# Ranks of run_distributed fork from a server that imported these once (see [Note: a fork server for test suites]);
# ZLIGHTNING_TEST_SPAWN=1 starts every rank as a fresh interpreter instead.
if os.environ.get("ZLIGHTNING_TEST_SPAWN") != "1":
    set_start_method(
        "forkserver",
        preload=[
            "tests._hub_kernels",
            "torch",
            "torch.distributed",
            "lightning.pytorch",
            "zlightning.strategies",
            "zlightning.zero",
        ],
    )


@pytest.fixture(params=["fallback", "native"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test once on the PyTorch references and once on the compiled kernels (skipped when not built)."""
    from zlightning.kernels import _ext

    if request.param == "fallback":
        monkeypatch.setattr(_ext, "available", lambda: False)
        monkeypatch.setattr(_ext, "_warned", True)
    elif not _ext.available():
        pytest.skip(f"native kernels not built: {_ext.status().reason}")
    return request.param
