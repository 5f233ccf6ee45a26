"""Tests of `DataAnalyzer`, the index file format and ``zlightning analyze``."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset
from zlightning.datamodules.curriculum import DataAnalyzer, IndexFile, MetricSpec
from zlightning.datamodules.curriculum._index import find_fit_int_dtype, write_index_file

from zlightning.cli import main as cli_main

N, T, PAD = 1000, 12, 0


class Padded(Dataset):
    """Sample i: (tokens with length 1 + i % 11, then padding; targets); tokens are 1 + (i + t) % 5."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(T, dtype=torch.int64)
        n = 1 + i % 11
        x[:n] = 1 + (i + torch.arange(n)) % 5
        return x, x


def _files(root: Path, m: str) -> dict[str, IndexFile]:
    names = ("sample_to_metric", "index_to_sample", "index_to_metric", "index_to_sample_percentile_merged")
    return {n: IndexFile(root / m / f"{m}_{n}") for n in names}


def _parity(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return (batch[0][:, 0] % 2).to(torch.int64)


def _hist(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return torch.bincount(batch[0].reshape(-1), minlength=6).to(torch.int64)


def test_index_files_satisfy_the_invariants(tmp_path: Path) -> None:
    an = DataAnalyzer(
        Padded(),
        save_path=tmp_path,
        metric_names=["seqlen", "parity", "hist"],
        metric_functions=[None, _parity, _hist],
        metric_types=["single_value_per_sample", "single_value_per_sample", "accumulate_value_over_samples"],
        batch_size=64,
        num_threads=3,
        pad_token_id=PAD,
        progress=False,
    )
    an.run_map_reduce()
    f = _files(tmp_path, "seqlen")
    expect = 1 + np.arange(N) % 11
    assert np.array_equal(np.asarray(f["sample_to_metric"].values), expect)  # sample_to_metric[i] = f(i)
    assert isinstance(f["index_to_sample"].values, np.memmap)  # memory-mapped on read
    vals = np.asarray(f["index_to_metric"].values)
    assert np.array_equal(vals, np.arange(1, 12)) and np.all(np.diff(vals) > 0)
    assert int(f["index_to_sample"].sizes.sum()) == N
    assert np.array_equal(f["index_to_sample"][0], np.flatnonzero(expect == 1))
    merged = f["index_to_sample_percentile_merged"]
    assert np.array_equal(merged.values, f["index_to_sample"].values) and len(merged) == 11  # U // 100 = 0 -> step 1
    assert f["sample_to_metric"].dtype == np.uint8 and f["index_to_sample"].dtype == np.uint16  # minimal fits
    assert np.array_equal(_files(tmp_path, "parity")["index_to_metric"].values, [0, 1])
    hist = IndexFile(tmp_path / "hist" / "hist_metric_value")[0]
    tokens = torch.stack([Padded()[i][0] for i in range(N)])
    assert np.array_equal(hist, torch.bincount(tokens.reshape(-1), minlength=6).numpy())
    assert not list((tmp_path / "seqlen").glob("worker*"))  # map chunks removed


def test_multi_worker_map_then_reduce_equals_single(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    DataAnalyzer(
        Padded(), save_path=one, metric_names=["vocab_rarity"], pad_token_id=PAD, batch_size=100, progress=False
    ).run_map_reduce()
    workers = [
        DataAnalyzer(
            Padded(),
            save_path=two,
            metric_names=["vocab_rarity"],
            pad_token_id=PAD,
            batch_size=77,
            num_workers=2,
            worker_id=w,
            num_threads=2,
            progress=False,
        )
        for w in range(2)
    ]
    with pytest.raises(RuntimeError, match="run_map\\(\\) on every worker"):
        workers[0].run_map_reduce()
    workers[1].run_map()
    with pytest.raises(FileNotFoundError, match="worker 0 has not finished run_map"):
        workers[1].run_reduce()
    workers[0].run_map()
    workers[0].run_reduce()
    a, b = _files(one, "vocab_rarity"), _files(two, "vocab_rarity")
    for name in a:
        assert np.array_equal(a[name].values, b[name].values) and np.array_equal(a[name].sizes, b[name].sizes)
    # vocab_rarity = round(100 * mean(-log p(token))) with p over the dataset's non-pad tokens.
    tokens = torch.stack([Padded()[i][0] for i in range(N)]).reshape(-1).numpy()
    counts = np.bincount(tokens[tokens != PAD], minlength=6).astype(np.float64)
    with np.errstate(divide="ignore"):  # the pad token has count 0 and never appears below
        neg_log_p = -np.log(counts / counts.sum())
    x = Padded()[3][0]
    x = x[x != PAD].numpy()
    assert a["sample_to_metric"][3][0] == round(100 * neg_log_p[x].mean())


def test_metric_errors(tmp_path: Path) -> None:
    bad = MetricSpec(name="bad", fn=lambda b: b[0][:, 0].to(torch.int32))
    with pytest.raises(TypeError, match="returned dtype int32, but its declared dtype is int64"):
        DataAnalyzer(Padded(), save_path=tmp_path, metrics=[bad], progress=False).run_map_reduce()
    short = MetricSpec(name="short", fn=lambda b: torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="returned 1 values for a batch of 10"):
        DataAnalyzer(Padded(), save_path=tmp_path, metrics=[short], batch_size=10, progress=False).run_map_reduce()
    with pytest.raises(ValueError, match="not a built-in"):
        DataAnalyzer(Padded(), save_path=tmp_path, metric_names=["mystery"])
    with pytest.raises(ValueError, match="metric_functions has 2 entries"):
        DataAnalyzer(Padded(), save_path=tmp_path, metric_names=["seqlen"], metric_functions=[None, None])


def test_index_file_format_bytes(tmp_path: Path) -> None:
    write_index_file(tmp_path / "x", np.array([5, 6, 7, 8, 9]), [2, 3], np.uint16)
    raw = (tmp_path / "x.idx").read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack_from("<QBQQ", raw, 9) == (1, 6, 2, 2)
    assert list(np.frombuffer(raw, "<i4", 2, 34)) == [2, 3] and list(np.frombuffer(raw, "<i8", 2, 42)) == [0, 4]
    assert (tmp_path / "x.bin").read_bytes() == np.array([5, 6, 7, 8, 9], "<u2").tobytes()
    f = IndexFile(tmp_path / "x")
    assert f[1].tolist() == [7, 8, 9] and f[-2].tolist() == [5, 6]
    assert find_fit_int_dtype(-1, 100) == np.int8 and find_fit_int_dtype(0, 70000) == np.uint32
    with pytest.raises(FileNotFoundError, match="zlightning analyze"):
        IndexFile(tmp_path / "missing")


def test_zlightning_analyze_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"f{i}.txt").write_text(("abc " * (50 + 30 * i)) + "zq" * i)
    cli_main(
        [
            "analyze",
            "--save-path",
            str(tmp_path / "out"),
            "--data-dir",
            str(corpus),
            "--pattern",
            "*.txt",
            "--seq-len",
            "16",
            "--no-progress",
            "--batch-size",
            "7",
        ]
    )
    assert "wrote metric index files of ['seqlen', 'vocab_rarity']" in capsys.readouterr().out
    s2m = IndexFile(tmp_path / "out" / "seqlen" / "seqlen_sample_to_metric")
    assert len(s2m) > 10 and set(np.asarray(s2m.values).tolist()) == {16}
    assert len(IndexFile(tmp_path / "out" / "vocab_rarity" / "vocab_rarity_index_to_metric")) >= 2


def test_deepspeed_positional_call_and_specific_threads(tmp_path: Path) -> None:
    kw, ds_way, by_thread = tmp_path / "kw", tmp_path / "ds", tmp_path / "threads"
    DataAnalyzer(Padded(), save_path=kw, metric_names=["seqlen"], pad_token_id=PAD, progress=False).run_map_reduce()
    # Megatron-DeepSpeed's call: (dataset, num_workers, worker_id, num_threads, num_threads_reduce, specific_threads,
    # batch_size, metric_names, metric_functions, metric_types, metric_dtypes, save_path)
    DataAnalyzer(
        Padded(), 1, 0, 2, 2, [], 64, ["seqlen"], [None], ["single_value_per_sample"], [np.int64], str(ds_way),
        pad_token_id=PAD, progress=False,
    ).run_map_reduce()  # fmt: skip
    for t in (1, 0):  # each thread's share mapped by its own call, as DeepSpeed reruns specific threads
        DataAnalyzer(
            Padded(), num_threads=2, specific_threads=[t], save_path=by_thread, metric_names=["seqlen"],
            pad_token_id=PAD, progress=False,
        ).run_map()  # fmt: skip
    DataAnalyzer(
        Padded(), num_threads=2, save_path=by_thread, metric_names=["seqlen"], pad_token_id=PAD, progress=False
    ).run_reduce()
    want = _files(kw, "seqlen")
    for root in (ds_way, by_thread):
        for name, got in _files(root, "seqlen").items():
            assert [got[i].tolist() for i in range(len(got))] == [want[name][i].tolist() for i in range(len(got))]
    with pytest.raises(NotImplementedError, match="custom_map_init"):
        DataAnalyzer(Padded(), save_path=tmp_path, metric_names=["seqlen"], custom_map_init=lambda: None)
    with pytest.raises(ValueError, match=r"specific_threads \[3\]"):
        DataAnalyzer(Padded(), save_path=tmp_path, metric_names=["seqlen"], num_threads=2, specific_threads=[3])
