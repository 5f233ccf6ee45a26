"""Offline data analysis: per-sample metrics over a map-style dataset, reduced into metric index files.

`DataAnalyzer` runs a *map* over its share of the dataset (worker ``worker_id`` of ``num_workers``, split further
into ``num_threads`` threads) and a *reduce* (on one worker, after every worker's map finished) that writes, per
single-value metric ``M``, under ``save_path/M/`` (format: [Note: index file format] in ``_index.py``):

* ``M_sample_to_metric``: N rows, row ``i`` = ``[metric(i)]``;
* ``M_index_to_sample``: U rows (U = number of distinct values), in ascending value order; row ``u`` lists the sample
  ids whose metric equals the ``u``-th value, ascending;
* ``M_index_to_metric``: U rows, row ``u`` = ``[u-th value]`` (strictly increasing);
* ``M_index_to_sample_percentile_merged``: consecutive groups of ``max(1, U // 100)`` rows of ``M_index_to_sample``
  concatenated (about 100 rows; same sample order, fewer rows to scan);

and, per accumulate metric, ``M_metric_value``: one row, the element-wise sum over all batches (e.g. a histogram).
Value dtypes are the tightest integer fit of the value range; sample-id dtypes the fit of ``[0, N - 1]``.

[Note: map chunks]
Each (worker, thread) writes two ``.npy`` files per metric (sample ids, values) under ``M/worker{w}_thread{t}/``,
instead of DeepSpeed's one CSV file per distinct value: a handful of files per thread, whatever the number of distinct
values. The reduce deletes them once the index files are written (``keep_chunks=True`` keeps them). Workers share
files through ``save_path``, so several workers on several machines need a shared filesystem; one worker with
``num_threads`` threads needs none.

[Note: built-in metrics]
``seqlen``: the number of tokens of each sample that are not ``pad_token_id`` (all of them when it is None).
``vocab_rarity``: ``round(100 * mean(-log p(token)))`` over each sample's non-pad tokens, with ``p`` the token's
frequency in the whole dataset; rarer vocabulary gives a higher (harder) value. Its token counts come from a first
pass over the entire dataset (on every worker), or from ``token_counts``. Tokens are the batch itself (a tensor), its
first element (a tuple such as ``(x, y)``), or ``batch["input_ids"]`` (a dict).
"""

from __future__ import annotations

import logging
import math
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

from ._index import find_fit_int_dtype, write_index_file

__all__ = ["BUILTIN_METRICS", "DataAnalyzer", "MetricFn", "MetricSpec", "seqlen_metric", "vocab_rarity_metric"]

log = logging.getLogger(__name__)

MetricFn = Callable[[Any], "Tensor | np.ndarray"]
"""A metric function: called with one collated batch, returns an integer tensor/array (one value per sample for
``single_value_per_sample``; any shape, summed over batches, for ``accumulate_value_over_samples``)."""

MetricType = Literal["single_value_per_sample", "accumulate_value_over_samples"]

BUILTIN_METRICS = ("seqlen", "vocab_rarity")
"""Metric names that need no function. See [Note: built-in metrics]."""


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric computed by `DataAnalyzer`.

    Raises:
        ValueError: For an empty or path-unsafe name, an unknown type, or a non-integer dtype.
    """

    name: str
    """Metric name: the output folder and file-name prefix."""
    fn: MetricFn
    """The metric function (see `MetricFn`)."""
    type: MetricType = "single_value_per_sample"
    """``single_value_per_sample`` (indexed for curriculum) or ``accumulate_value_over_samples`` (summed)."""
    dtype: str = "int64"
    """The numpy integer dtype the function must return (checked on every batch)."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"MetricSpec: name must be non-empty letters, digits, '_' or '-', got {self.name!r}.")
        if self.type not in ("single_value_per_sample", "accumulate_value_over_samples"):
            raise ValueError(f"MetricSpec({self.name}): unknown type {self.type!r}.")
        if not np.issubdtype(np.dtype(self.dtype), np.integer):
            raise ValueError(f"MetricSpec({self.name}): dtype must be an integer dtype, got {self.dtype!r}.")
        if not callable(self.fn):
            raise TypeError(f"MetricSpec({self.name}): fn must be callable, got {self.fn!r}.")


def _tokens(batch: Any) -> Tensor:
    if isinstance(batch, (tuple, list)) and batch:
        batch = batch[0]
    elif isinstance(batch, dict):
        if "input_ids" not in batch:
            raise TypeError(f"built-in metric: a dict batch needs an 'input_ids' entry, got keys {sorted(batch)}.")
        batch = batch["input_ids"]
    if not isinstance(batch, Tensor) or batch.dim() < 1:
        raise TypeError(
            f"built-in metric: expected token ids as a tensor [batch, seq], a tuple starting with one, or a dict with "
            f"'input_ids'; got {type(batch).__name__}. Pass your own metric function instead."
        )
    return batch.reshape(batch.shape[0], -1)


def seqlen_metric(pad_token_id: int | None = None) -> MetricFn:
    """The built-in ``seqlen`` metric: non-pad tokens per sample (int64). See [Note: built-in metrics]."""

    def seqlen(batch: Any) -> Tensor:
        ids = _tokens(batch)
        if pad_token_id is None:
            return torch.full((ids.shape[0],), ids.shape[1], dtype=torch.int64)
        return (ids != pad_token_id).sum(dim=1).to(torch.int64)

    return seqlen


def vocab_rarity_metric(token_counts: np.ndarray | Tensor, pad_token_id: int | None = None) -> MetricFn:
    """The built-in ``vocab_rarity`` metric given dataset token counts. See [Note: built-in metrics].

    Args:
        token_counts: Occurrences of each token id in the dataset (1-D, length = vocabulary size).
        pad_token_id: Token ignored in the mean, or None.
    """
    counts = torch.as_tensor(np.asarray(token_counts), dtype=torch.float64).clamp_min(1.0)
    neg_log_p = -(counts / counts.sum()).log()

    def vocab_rarity(batch: Any) -> Tensor:
        ids = _tokens(batch).long()
        cost = neg_log_p[ids]
        keep = torch.ones_like(cost) if pad_token_id is None else (ids != pad_token_id).double()
        mean = (cost * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return torch.round(100.0 * mean).to(torch.int64)

    return vocab_rarity


def _split_index(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(start, end, parts + 1, dtype=np.int64)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


class DataAnalyzer:
    """Computes per-sample metrics of a map-style dataset and writes the curriculum's metric index files.

    Typical use: ``DataAnalyzer(ds, save_path="analysis", metric_names=["seqlen"]).run_map_reduce()``, then point a
    curriculum metric's ``index_to_sample_path`` at ``analysis/seqlen/seqlen_index_to_sample`` and its
    ``index_to_metric_path`` at ``analysis/seqlen/seqlen_index_to_metric``. Command line: ``zlightning analyze``.

    Args:
        dataset: A map-style dataset (``__len__`` and ``__getitem__``).
        save_path: Output folder (shared by all workers); DeepSpeed's default ``"./"``.
        metric_names: DeepSpeed-style parallel lists: names...
        metric_functions: ...functions (None entries, or omitting the list, select a built-in by name)...
        metric_types: ...types (default ``single_value_per_sample``)...
        metric_dtypes: ...and integer dtypes the functions return (default int64).
        metrics: Alternatively, `MetricSpec` objects (appended after the parallel lists).
        batch_size: Samples per metric-function call.
        num_workers: Number of workers the dataset is split across (each runs `run_map` with its ``worker_id``).
        worker_id: This worker, in ``[0, num_workers)``.
        num_threads: Threads per worker, each mapping a contiguous part of the worker's range.
        num_threads_reduce: DeepSpeed's; accepted (the reduce here is sequential).
        specific_threads: DeepSpeed's: map only these thread ids of this worker (empty: all), e.g. to rerun one
            that failed; the reduce needs every thread's chunks.
        custom_map_init: DeepSpeed's hook; not supported (NotImplementedError when given).
        custom_map_update: DeepSpeed's hook; not supported (NotImplementedError when given).
        custom_map_finalize: DeepSpeed's hook; not supported (NotImplementedError when given).
        custom_reduce: DeepSpeed's hook; not supported (NotImplementedError when given).
        sample_indices: DeepSpeed's; not supported (NotImplementedError when given).
        collate_fn: DataLoader collate function (default: PyTorch's).
        pad_token_id: Padding token of the built-in metrics.
        token_counts: Dataset token histogram for ``vocab_rarity`` (computed by a first pass when None).
        progress: Show a progress bar.
        keep_chunks: Keep the per-thread map outputs after the reduce.

    Raises:
        ValueError: For inconsistent metric lists, a duplicate or unknown metric, or an invalid worker setting.
    """

    def __init__(  # DeepSpeed's parameter order up to sample_indices, so its positional calls port unchanged
        self,
        dataset: Dataset[Any],
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] = (),
        batch_size: int = 1000,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[MetricFn | None] | None = None,
        metric_types: Sequence[MetricType] | None = None,
        metric_dtypes: Sequence[Any] | None = None,
        save_path: str | Path = "./",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        custom_map_init: Any = None,
        custom_map_update: Any = None,
        custom_map_finalize: Any = None,
        custom_reduce: Any = None,
        sample_indices: Any = None,
        *,
        metrics: Sequence[MetricSpec] = (),
        pad_token_id: int | None = None,
        token_counts: np.ndarray | None = None,
        progress: bool = True,
        keep_chunks: bool = False,
    ) -> None:
        hooks = {
            "custom_map_init": custom_map_init,
            "custom_map_update": custom_map_update,
            "custom_map_finalize": custom_map_finalize,
            "custom_reduce": custom_reduce,
            "sample_indices": sample_indices,
        }
        unsupported = [k for k, v in hooks.items() if v is not None]
        if unsupported:
            raise NotImplementedError(
                f"DataAnalyzer: {unsupported} (DeepSpeed's custom map/reduce hooks) are not supported; express the "
                "analysis as metric_functions (batch -> one integer per sample, or a token-count vector with "
                "metric_types='accumulate_value_over_samples')"
            )
        if isinstance(num_threads_reduce, bool) or not isinstance(num_threads_reduce, int) or num_threads_reduce < 1:
            raise ValueError(f"DataAnalyzer: num_threads_reduce must be an int >= 1, got {num_threads_reduce!r}.")
        bad_threads = [t for t in specific_threads if not (isinstance(t, int) and 0 <= t < num_threads)]
        if bad_threads:
            raise ValueError(
                f"DataAnalyzer: specific_threads {bad_threads} are not thread ids in [0, num_threads={num_threads})."
            )
        self.num_threads_reduce = num_threads_reduce  # accepted for DeepSpeed's calls: the reduce is sequential
        self.specific_threads = tuple(specific_threads)
        for name, value, lo in (
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 1),
            ("num_threads", num_threads, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"DataAnalyzer: {name} must be an int >= {lo}, got {value!r}.")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"DataAnalyzer: worker_id must be in [0, num_workers={num_workers}), got {worker_id!r}.")
        self.dataset = dataset
        self.num_samples = len(dataset)  # type: ignore[arg-type]
        if self.num_samples < 1:
            raise ValueError("DataAnalyzer: the dataset is empty.")
        self.save_path = Path(save_path)
        self.batch_size, self.num_workers, self.worker_id, self.num_threads = (
            batch_size,
            num_workers,
            worker_id,
            num_threads,
        )
        self.collate_fn = collate_fn
        self.pad_token_id = pad_token_id
        self.token_counts = token_counts
        self.progress, self.keep_chunks = progress, keep_chunks
        self.metrics = self._build_specs(metric_names, metric_functions, metric_types, metric_dtypes) + list(metrics)
        names = [m.name for m in self.metrics]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"DataAnalyzer: need at least one metric and unique names, got {names}.")

    def _build_specs(
        self,
        names: Sequence[str],
        fns: Sequence[MetricFn | None] | None,
        types: Sequence[MetricType] | None,
        dtypes: Sequence[Any] | None,
    ) -> list[MetricSpec]:
        n = len(names)
        for label, seq in (("metric_functions", fns), ("metric_types", types), ("metric_dtypes", dtypes)):
            if seq is not None and len(seq) != n:
                raise ValueError(
                    f"DataAnalyzer: {label} has {len(seq)} entries but metric_names has {n}: {list(names)}."
                )
        specs = []
        for i, name in enumerate(names):
            fn = fns[i] if fns is not None else None
            if fn is None:
                fn = self._builtin(name)
            kind = types[i] if types is not None else "single_value_per_sample"
            dtype = np.dtype(dtypes[i]).name if dtypes is not None else "int64"
            specs.append(MetricSpec(name=name, fn=fn, type=kind, dtype=dtype))
        return specs

    def _builtin(self, name: str) -> MetricFn:
        if name == "seqlen":
            return seqlen_metric(self.pad_token_id)
        if name == "vocab_rarity":
            return _LazyRarity(self)
        raise ValueError(
            f"DataAnalyzer: metric {name!r} has no function and is not a built-in ({list(BUILTIN_METRICS)}); "
            "pass it in metric_functions."
        )

    # ---------------------------------------------------------------------------------------------------------------
    # map

    def _loader(self, start: int, end: int) -> DataLoader[Any]:
        subset = Subset(self.dataset, range(start, end))
        return DataLoader(
            subset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate_fn, drop_last=False
        )

    def compute_token_counts(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Token histogram of samples ``[start, end)`` (default: the whole dataset; the first pass of
        ``vocab_rarity``), as int64."""
        counts = np.zeros(0, dtype=np.int64)
        end = self.num_samples if end is None else end
        for batch in self._loader(start, end) if end > start else []:
            ids = _tokens(batch).reshape(-1)
            if self.pad_token_id is not None:
                ids = ids[ids != self.pad_token_id]
            c = torch.bincount(ids.long()).numpy()
            if c.size > counts.size:
                counts = np.pad(counts, (0, c.size - counts.size))
            counts[: c.size] += c
        return counts

    def _chunk_dir(self, metric: str, worker: int, thread: int) -> Path:
        return self.save_path / metric / f"worker{worker}_thread{thread}"

    def run_map(self) -> None:
        """Computes every metric on this worker's share and writes its chunks (see [Note: map chunks]).

        Raises:
            TypeError: If a metric function returns a non-integer result or the wrong dtype.
            ValueError: If a single-value metric returns the wrong number of values for a batch.
        """
        for spec in self.metrics:  # resolve lazy built-ins before the threads start
            if isinstance(spec.fn, _LazyRarity):
                spec.fn.resolve()
        lo, hi = _split_index(0, self.num_samples, self.num_workers)[self.worker_id]
        ranges = _split_index(lo, hi, self.num_threads)
        chosen = [(t, r) for t, r in enumerate(ranges) if not self.specific_threads or t in self.specific_threads]
        total = sum(math.ceil((b - a) / self.batch_size) for _, (a, b) in chosen)
        bar = _progress(total, f"analyze worker {self.worker_id}", self.progress)
        with ThreadPoolExecutor(max_workers=len(chosen)) as pool:
            futures = [pool.submit(self._map_range, t, a, b, bar) for t, (a, b) in chosen]
            for f in futures:
                f.result()
        bar.close()

    def _map_range(self, thread: int, start: int, end: int, bar: Any) -> None:
        ids, values, sums = self._map_arrays(start, end, bar)
        for spec in self.metrics:
            d = self._chunk_dir(spec.name, self.worker_id, thread)
            d.mkdir(parents=True, exist_ok=True)
            if spec.type == "single_value_per_sample":
                np.save(d / "values.npy", values[spec.name])
                np.save(d / "sample_ids.npy", ids)
            else:
                total = sums[spec.name]
                np.save(d / "metric_value.npy", total if total is not None else np.zeros(0, spec.dtype))

    def _map_arrays(
        self, start: int, end: int, bar: Any
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray | None]]:
        """Metrics of samples ``[start, end)``: (sample ids, single values by metric, accumulated sums by metric)."""
        ids: list[np.ndarray] = []
        values: dict[str, list[np.ndarray]] = {m.name: [] for m in self.metrics}
        sums: dict[str, np.ndarray | None] = {m.name: None for m in self.metrics}
        pos = start
        for batch in self._loader(start, end) if end > start else []:
            expected = min(self.batch_size, end - pos)
            for spec in self.metrics:
                out = _as_int_array(spec, spec.fn(batch))
                if spec.type == "single_value_per_sample":
                    out = out.reshape(-1)
                    if out.size != expected:
                        raise ValueError(
                            f"DataAnalyzer: metric {spec.name!r} returned {out.size} values for a batch of {expected} "
                            f"samples (samples {pos}..{pos + expected - 1}); return one value per sample."
                        )
                    values[spec.name].append(out)
                else:
                    prev = sums[spec.name]
                    sums[spec.name] = out.copy() if prev is None else prev + out
            ids.append(np.arange(pos, pos + expected, dtype=np.int64))
            pos += expected
            with _BAR_LOCK:
                bar.update(1)
        merged = {
            spec.name: np.concatenate(values[spec.name]) if values[spec.name] else np.zeros(0, spec.dtype)
            for spec in self.metrics
            if spec.type == "single_value_per_sample"
        }
        return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), merged, sums

    # ---------------------------------------------------------------------------------------------------------------
    # reduce

    def _chunks(self, metric: str, file: str) -> list[np.ndarray]:
        out = []
        for w in range(self.num_workers):
            for t in range(self.num_threads):
                path = self._chunk_dir(metric, w, t) / file
                if not path.is_file():
                    raise FileNotFoundError(
                        f"DataAnalyzer.run_reduce: {path} is missing: worker {w} has not finished run_map (every "
                        f"worker must run run_map with the same num_workers={self.num_workers} and "
                        f"num_threads={self.num_threads} before one of them runs run_reduce)."
                    )
                out.append(np.load(path))
        return out

    def run_reduce(self) -> None:
        """Merges every worker's chunks into the index files (run once, after every worker's `run_map`).

        Raises:
            FileNotFoundError: If a worker's chunks are missing.
            ValueError: If the chunks do not cover every sample exactly once.
        """
        for spec in self.metrics:
            if spec.type == "single_value_per_sample":
                ids = np.concatenate(self._chunks(spec.name, "sample_ids.npy"))
                vals = np.concatenate(self._chunks(spec.name, "values.npy"))
                write_metric_index(self.save_path / spec.name, spec.name, vals, sample_ids=ids, n=self.num_samples)
            else:
                parts = [p for p in self._chunks(spec.name, "metric_value.npy") if p.size]
                total = np.sum(np.stack(_pad_same(parts)), axis=0) if parts else np.zeros(0, np.int64)
                write_accumulated_metric(self.save_path / spec.name, spec.name, total)
            if not self.keep_chunks:
                for w in range(self.num_workers):
                    for t in range(self.num_threads):
                        shutil.rmtree(self._chunk_dir(spec.name, w, t), ignore_errors=True)

    def run_map_reduce(self) -> None:
        """`run_map`, then (single worker only) `run_reduce`.

        Raises:
            RuntimeError: With ``num_workers > 1``: run `run_map` on every worker, then `run_reduce` on one.
        """
        if self.num_workers > 1:
            raise RuntimeError(
                f"DataAnalyzer.run_map_reduce: with num_workers={self.num_workers}, call run_map() on every worker "
                "and, once all have finished, run_reduce() on one of them."
            )
        self.run_map()
        self.run_reduce()


_BAR_LOCK = threading.Lock()


class _NullBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NullBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="batch")


class _LazyRarity:
    """``vocab_rarity`` whose token counts are computed on first use (a pass over the dataset)."""

    def __init__(self, analyzer: DataAnalyzer) -> None:
        self._analyzer = analyzer
        self._fn: MetricFn | None = None

    def resolve(self) -> None:
        if self._fn is None:
            a = self._analyzer
            counts = a.token_counts if a.token_counts is not None else a.compute_token_counts()
            self._fn = vocab_rarity_metric(counts, a.pad_token_id)

    def __call__(self, batch: Any) -> Tensor | np.ndarray:
        self.resolve()
        return self._fn(batch)  # type: ignore[misc]


def _pad_same(parts: list[np.ndarray]) -> list[np.ndarray]:
    shape = np.max([p.shape for p in parts], axis=0)
    return [np.pad(p, [(0, s - d) for s, d in zip(shape, p.shape)]) for p in parts]


def _as_int_array(spec: MetricSpec, out: Any) -> np.ndarray:
    arr = out.detach().cpu().numpy() if isinstance(out, Tensor) else np.asarray(out)
    if arr.dtype != np.dtype(spec.dtype):
        raise TypeError(
            f"DataAnalyzer: metric {spec.name!r} returned dtype {arr.dtype}, but its declared dtype is {spec.dtype}; "
            "return that dtype (e.g. tensor.to(torch.int64)) or declare the one you return in metric_dtypes."
        )
    return arr


def write_accumulated_metric(folder: str | Path, metric: str, total: np.ndarray) -> None:
    """Writes ``folder/{metric}_metric_value``: one row, the accumulated values (flattened), tightest dtype."""
    total = np.asarray(total).reshape(-1)
    dt = find_fit_int_dtype(int(total.min(initial=0)), int(total.max(initial=0)))
    write_index_file(Path(folder) / f"{metric}_metric_value", total, [total.size], dt)


def write_metric_index(
    folder: str | Path, metric: str, values: np.ndarray, *, sample_ids: np.ndarray | None = None, n: int | None = None
) -> None:
    """Writes the four index files of one single-value metric (see the module docstring) from per-sample values.

    Args:
        folder: Output folder; files are ``folder/{metric}_*``.
        metric: Metric name.
        values: Integer metric values; ``values[j]`` belongs to sample ``sample_ids[j]`` (default: sample ``j``).
        sample_ids: Sample ids of ``values``; must be a permutation of ``range(n)``.
        n: Dataset length (default ``len(values)``).

    Raises:
        ValueError: If the ids are not each sample exactly once, or the values are not integers.
    """
    values = np.asarray(values).reshape(-1)
    if not np.issubdtype(values.dtype, np.integer):
        raise ValueError(f"write_metric_index({metric}): values must be integers, got dtype {values.dtype}.")
    n = values.size if n is None else n
    ids = np.arange(values.size, dtype=np.int64) if sample_ids is None else np.asarray(sample_ids, dtype=np.int64)
    if ids.size != n or values.size != n or (n and not np.array_equal(np.sort(ids), np.arange(n))):
        raise ValueError(
            f"write_metric_index({metric}): got {values.size} values for {ids.size} sample ids; every sample id in "
            f"[0, {n}) must appear exactly once (the dataset has {n} samples)."
        )
    folder = Path(folder)
    vdt = find_fit_int_dtype(int(values.min()), int(values.max()))
    sdt = find_fit_int_dtype(0, max(n - 1, 0))
    by_id = np.empty(n, dtype=values.dtype)
    by_id[ids] = values
    write_index_file(folder / f"{metric}_sample_to_metric", by_id, np.ones(n, np.int64), vdt)
    order = np.lexsort((ids, values))
    uniq, counts = np.unique(values[order], return_counts=True)
    write_index_file(folder / f"{metric}_index_to_sample", ids[order], counts, sdt)
    write_index_file(folder / f"{metric}_index_to_metric", uniq, np.ones(uniq.size, np.int64), vdt)
    step = max(1, uniq.size // 100)
    merged = np.add.reduceat(counts, np.arange(0, uniq.size, step))
    write_index_file(folder / f"{metric}_index_to_sample_percentile_merged", ids[order], merged, sdt)
    pct = np.percentile(values, np.arange(0, 101, 5), method="lower")
    log.info("metric %s: value at every 5th percentile: %s", metric, pct.tolist())
