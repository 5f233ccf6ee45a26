"""Dependencies point down: the engines load no Lightning, and importing zlightning still registers the strategies."""

from __future__ import annotations

import subprocess
import sys

import pytest

ENGINES = [
    "zlightning.zero",
    "zlightning.pipe",
    "zlightning.compression",
    "zlightning.compile",
    "zlightning.inject",
    "zlightning.kernels",
    "zlightning.parallel",
]


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


@pytest.mark.parametrize("package", ENGINES)
def test_engine_package_does_not_import_lightning(package: str) -> None:
    out = _run(f"import sys, {package}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))")
    assert out == "[]", f"importing {package} loaded Lightning modules: {out[:300]}"


_ORDERS = {
    "zlightning first": "import zlightning; import lightning.pytorch",
    "lightning first": "import lightning.pytorch; import zlightning",
    "strategies directly": "from zlightning.strategies import ZStackZero3Strategy",
    "a strategy module directly": "import zlightning.strategies.zero3",
}


@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_importing_zlightning_registers_the_strategies_in_any_order(order: str) -> None:
    imports = _ORDERS[order]
    out = _run(
        f"{imports}\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
        "print(sorted(n for n in StrategyRegistry if n.startswith('zstack')))"
    )
    for name in (
        "zstack_zero3",
        "zstack_zero3_offload",
        "zstack_zero3_nvme",
        "zstack_zero1",
        "zstack_zero2",
        "zstack_pipeline",
    ):
        assert name in out, out
