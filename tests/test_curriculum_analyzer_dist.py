"""`DistributedDataAnalyzer` on 2 gloo ranks: byte-identical index files to the single-process `DataAnalyzer`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from zlightning.datamodules.curriculum import DataAnalyzer, DistributedDataAnalyzer, MetricSpec
from zlightning.datamodules.curriculum._cli import analyze_main

from zlightning.testing import run_distributed

N, T, PAD = 1001, 12, 0  # odd N: the ranks get unequal shares


class Padded(Dataset):
    """Sample i: 1 + i % 11 tokens (ids 1 + (i * 7 + t) % 9), then padding."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(T, dtype=torch.int64)
        n = 1 + i % 11
        x[:n] = 1 + (i * 7 + torch.arange(n)) % 9
        return x, x


def _parity(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (batch[0][:, 0] % 2 - 1).to(torch.int32)  # values -1, 0: signed dtype


def _hist(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.bincount(batch[0].reshape(-1), minlength=10).to(torch.int64)


def _bad_on_rank1(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    first = batch[0][:, 0]
    if _bad_on_rank1.rank == 1:  # type: ignore[attr-defined]
        return first.to(torch.float32)  # a float metric: the analyzer refuses it
    return first.to(torch.int64)


def _analyze(metric_names: list[str], metrics: list[MetricSpec], cls: type, path: Path, **kw: object) -> None:
    cls(
        Padded(), save_path=path, metric_names=metric_names, metrics=metrics, pad_token_id=PAD, progress=False, **kw
    ).run_map_reduce()


def _specs() -> list[MetricSpec]:
    return [
        MetricSpec(name="parity", fn=_parity, dtype="int32"),
        MetricSpec(name="hist", fn=_hist, type="accumulate_value_over_samples"),
    ]


def _rank(rank: int, world: int, root: str) -> str:
    _analyze(
        ["seqlen", "vocab_rarity"], _specs(), DistributedDataAnalyzer, Path(root) / "dist", batch_size=64, num_threads=2
    )
    analyze_main(
        [
            "--save-path",
            f"{root}/cli",
            "--dataset",
            f"{__name__}:Padded",
            "--metrics",
            "seqlen",
            "--pad-token-id",
            str(PAD),
            "--batch-size",
            "50",
            "--no-progress",
            "--distributed",
        ]
    )
    _bad_on_rank1.rank = rank  # type: ignore[attr-defined]
    try:
        _analyze([], [MetricSpec(name="bad", fn=_bad_on_rank1)], DistributedDataAnalyzer, Path(root) / "bad")
    except (TypeError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_two_ranks_write_the_single_process_files(tmp_path: Path) -> None:
    errors = run_distributed(_rank, 2, str(tmp_path), timeout=120)
    # The rank whose metric misbehaved raises its own error; the other is told which rank failed (no hang).
    assert errors[1].startswith("TypeError") and "declared dtype" in errors[1]
    assert errors[0].startswith("RuntimeError") and "rank(s) [1]" in errors[0]

    _analyze(["seqlen", "vocab_rarity"], _specs(), DataAnalyzer, tmp_path / "single", batch_size=100)
    files = sorted(p.relative_to(tmp_path / "single") for p in (tmp_path / "single").rglob("*") if p.is_file())
    assert len(files) == 3 * 4 * 2 + 2  # 3 single-value metrics x 4 index files x (.idx, .bin) + the histogram
    assert sorted(p.relative_to(tmp_path / "dist") for p in (tmp_path / "dist").rglob("*") if p.is_file()) == files
    for f in files:
        assert (tmp_path / "dist" / f).read_bytes() == (tmp_path / "single" / f).read_bytes(), f
    cli = sorted(p.relative_to(tmp_path / "cli") for p in (tmp_path / "cli").rglob("*") if p.is_file())
    assert cli == [f for f in files if f.parts[0] == "seqlen"] and len(cli) == 8  # `zlightning analyze --distributed`
    for f in cli:
        assert (tmp_path / "cli" / f).read_bytes() == (tmp_path / "single" / f).read_bytes(), f


def test_needs_an_initialised_process_group(tmp_path: Path) -> None:
    analyzer = DistributedDataAnalyzer(Padded(), save_path=tmp_path, metric_names=["seqlen"], progress=False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        analyzer.run_map_reduce()
    with pytest.raises(RuntimeError, match="run_map_reduce\\(\\) on every rank"):
        analyzer.run_map()
    assert not np.any([p.is_file() for p in tmp_path.rglob("*")])
