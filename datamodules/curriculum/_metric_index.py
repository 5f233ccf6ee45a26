"""Metric lookups behind `DeepSpeedDataSampler`: DeepSpeed's helper functions over analyzed metric index files (which
samples fall within a metric value or percentile range, and a rank's slice of a micro-batch), and the memory-mapped
view of one metric's index that the sampler's clusters are computed from."""

from __future__ import annotations

import os

import numpy as np

from ._config import CurriculumMetricConfig
from ._index import IndexFile

__all__ = [
    "IndexSource",
    "get_sample_based_on_metric_percentile",
    "get_sample_based_on_metric_value",
    "get_start_end_idx",
]


IndexSource = IndexFile | str | os.PathLike
"""An index file (`IndexFile`) or its path prefix (without ``.bin``/``.idx``)."""


def get_start_end_idx(batch_len: int, data_parallel_rank: int, data_parallel_size: int) -> tuple[int, int]:
    """DeepSpeed's slice of a micro-batch for one data-parallel rank.

    ``start(r) = round(r * batch_len / data_parallel_size)`` (Python's round): the slices are contiguous, disjoint
    and cover the micro-batch; for a partial one their sizes differ by at most one.

    Args:
        batch_len: Samples in the (global) micro-batch.
        data_parallel_rank: This rank ``r``.
        data_parallel_size: Ranks sharing the micro-batch (DeepSpeed: ``data_parallel_group.size()``).

    Returns:
        ``(start_idx, end_idx)``: this rank's ``[start, end)``.

    Raises:
        ValueError: If ``data_parallel_size < 1`` or the rank is outside ``[0, data_parallel_size)``.
    """
    if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"get_start_end_idx: data_parallel_rank={data_parallel_rank} must be in [0, data_parallel_size="
            f"{data_parallel_size})."
        )
    return (
        round(data_parallel_rank * batch_len / data_parallel_size),
        round((data_parallel_rank + 1) * batch_len / data_parallel_size),
    )


def get_sample_based_on_metric_value(
    index_to_sample: IndexSource, index_to_metric: IndexSource, value_start: float, value_end: float
) -> np.ndarray | None:
    """Sample ids whose metric value ``v`` has ``value_start < v <= value_end``, as DeepSpeed selects them.

    Args:
        index_to_sample: The metric's ``*_index_to_sample`` file: row ``i`` holds the samples of the ``i``-th value.
        index_to_metric: The metric's ``*_index_to_metric`` file: row ``i`` holds that value.
        value_start: Exclusive lower bound (``-inf`` for "from the start").
        value_end: Inclusive upper bound.

    Returns:
        The matching rows' samples concatenated in row order (a copy, in the file's dtype), or None if no row
        matches (as DeepSpeed).

    Raises:
        ValueError: If the files do not have one value per sample row.
    """
    samples, metric = _as_index(index_to_sample), _as_index(index_to_metric)
    if len(metric) != len(samples) or metric.values.size != len(metric):
        raise ValueError(
            f"get_sample_based_on_metric_value: index_to_metric has {len(metric)} rows ({metric.values.size} values) "
            f"but index_to_sample has {len(samples)} rows; they must come from the same analysis (one value a row)."
        )
    values = np.asarray(metric.values)
    rows = np.flatnonzero((values > value_start) & (values <= value_end))
    if rows.size == 0:
        return None
    starts = samples.row_starts
    if rows[-1] - rows[0] + 1 == rows.size:  # contiguous (always, for an analyzer's strictly increasing values)
        return np.array(samples.values[starts[rows[0]] : starts[rows[-1] + 1]])
    return np.concatenate([samples.values[starts[r] : starts[r + 1]] for r in rows])


def get_sample_based_on_metric_percentile(
    index_to_sample: IndexSource, max_percentile: int, percentile_start: float, percentile_end: float
) -> np.ndarray | None:
    """Sample ids in percentile units ``[percentile_start, percentile_end)`` of the ascending-metric order.

    With ``N`` samples and ``k = N // max_percentile``, the range is positions ``[k * start, k * end)`` of the
    concatenated rows, or to the end when ``percentile_end == max_percentile`` (DeepSpeed's arithmetic).

    Args:
        index_to_sample: The metric's ``*_index_to_sample`` file.
        max_percentile: The metric's ``max_difficulty``.
        percentile_start: Start of the range, in percentile units.
        percentile_end: End of the range, in percentile units.

    Returns:
        The samples in the range (a copy, in the file's dtype), or None if the range holds no sample (DeepSpeed
        returns None when the range starts past the data, and may return an empty array for an empty range that
        starts inside it; None here in both cases).
    """
    samples = _as_index(index_to_sample)
    total = int(samples.values.size)
    per = total // max_percentile
    start = int(per * percentile_start)
    end = total if percentile_end == max_percentile else min(total, int(per * percentile_end))
    if start >= end:
        return None
    return np.array(samples.values[start:end])


def _as_index(source: IndexSource) -> IndexFile:
    return source if isinstance(source, IndexFile) else IndexFile(source)


class _MetricIndex:
    """Memory-mapped view of one metric's ``index_to_sample`` (and ``index_to_metric``) files."""

    def __init__(self, cfg: CurriculumMetricConfig) -> None:
        self.samples = IndexFile(cfg.index_to_sample_path)  # type: ignore[arg-type]
        self.metric: IndexFile | None = None
        self.values: np.ndarray | None = None
        if cfg.difficulty_type == "value":
            self.metric = metric = IndexFile(cfg.index_to_metric_path)  # type: ignore[arg-type]
            if len(metric) != len(self.samples):
                raise ValueError(
                    f"DeepSpeedDataSampler: {cfg.index_to_metric_path} has {len(metric)} rows but "
                    f"{cfg.index_to_sample_path} has {len(self.samples)}; they must come from the same analysis."
                )
            self.values = np.asarray(metric.values, dtype=np.int64)
            if np.any(np.diff(self.values) <= 0):
                raise ValueError(f"DeepSpeedDataSampler: {cfg.index_to_metric_path} is not strictly increasing.")

    def prefix_upto_value(self, d: float) -> int:
        """Number of samples (in index order) whose value is ``<= d``."""
        if self.values is None:
            raise AssertionError("value lookup on a percentile metric")
        rows = int(np.searchsorted(self.values, d, side="right"))
        return int(self.samples.row_starts[rows])

    def prefix_upto_percentile(self, p: float, max_difficulty: int) -> int:
        """Number of samples (in index order) in percentile units ``[0, p)``."""
        total = int(self.samples.values.size)
        if p >= max_difficulty:
            return total
        return max(0, (total // max_difficulty) * int(p))
