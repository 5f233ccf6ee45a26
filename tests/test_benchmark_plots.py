"""``benchmarks/_plots.py``: the charts beside the benchmark tables render from the stored results JSON, and without
matplotlib nothing is drawn and a note says so."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import _plots  # noqa: E402


@pytest.mark.parametrize("kind", ["zero3", "pipeline", "offload"])
def test_charts_render_from_the_stored_results(kind: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    record = json.loads((BENCH / "results" / f"{kind}.json").read_text())
    out = _plots.write_png(kind, record, tmp_path / f"{kind}.png")
    assert out is not None and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_chart_and_missing_matplotlib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    record = {
        "config": {"world": 2},
        "numel": 1_000_000,
        "results": {"ddp": {"bytes_per_param": {"1": 17.0, "3": 18.0}}, "deepspeed": {"status": "error"}},
    }
    if _plots._pyplot() is not None:
        assert _plots.write_png("memory", record, tmp_path / "memory.png") == tmp_path / "memory.png"
    monkeypatch.setattr(_plots, "_pyplot", lambda: None)
    assert _plots.write_png("memory", record, tmp_path / "none.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().out and not (tmp_path / "none.png").exists()
    with pytest.raises(ValueError, match="unknown chart 'nope'"):
        _plots.write_png("nope", record, tmp_path / "x.png")
