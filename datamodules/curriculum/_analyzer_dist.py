"""`DistributedDataAnalyzer`: the `DataAnalyzer` map/reduce over the ranks of a ``torch.distributed`` group.

[Note: distributed analysis]
Every rank of the group maps a contiguous share of the dataset (``linspace`` split, the same as `DataAnalyzer`'s
workers; each share split further over ``num_threads`` threads) and keeps the results in memory. The ``vocab_rarity``
token histogram is summed over the ranks with ``all_reduce`` (each rank counts its own share only), so every rank
scores with the histogram of the whole dataset. The reduce gathers every rank's ``(sample id, value)`` rows and
accumulated sums to group rank 0, which writes the index files with the same writers as `DataAnalyzer.run_reduce`
(`write_metric_index`, `write_accumulated_metric`): the files are byte-identical to a single-process analysis, and
no shared filesystem is needed (they are written on rank 0's). No intermediate files are written.

DeepSpeed's ``DistributedDataAnalyzer`` sorts the rows with a distributed sample-sort before rank 0 writes them;
here rank 0 receives the rows unsorted and sorts them once. Either way rank 0 ends up writing all N rows; rank 0
holds ``16 * N`` bytes per metric while it does (160 MB for 10M samples).

A metric function that fails on one rank makes every rank raise (the failing rank its own error, the others a
`RuntimeError` naming it) instead of leaving them blocked in a collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ._analyzer import (
    DataAnalyzer,
    MetricFn,
    MetricSpec,
    MetricType,
    _LazyRarity,
    _pad_same,
    _progress,
    _split_index,
    write_accumulated_metric,
    write_metric_index,
)

__all__ = ["DistributedDataAnalyzer"]

_MAX_NDIM = 8


class DistributedDataAnalyzer(DataAnalyzer):
    """`DataAnalyzer` whose map runs on every rank of a process group and whose reduce is collective.

    Call `run_map_reduce` on every rank of ``comm_group`` (default: the whole world), after
    ``torch.distributed.init_process_group``. See [Note: distributed analysis].

    Args:
        dataset: The same map-style dataset on every rank.
        save_path: Output folder on group rank 0.
        metric_names: As in `DataAnalyzer` (``seqlen`` and ``vocab_rarity`` are built in)...
        metric_functions: ...
        metric_types: ...
        metric_dtypes: ...
        metrics: ...
        batch_size: Samples per metric-function call.
        num_threads: Threads per rank.
        comm_group: The process group (None: the default group).
        collate_fn: DataLoader collate function.
        pad_token_id: Padding token of the built-in metrics.
        token_counts: Dataset token histogram for ``vocab_rarity`` (summed over the ranks when None).
        progress: Show a progress bar on group rank 0.

    Raises:
        ValueError: As `DataAnalyzer`.
    """

    comm_group: Any

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        save_path: str | Path,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[MetricFn | None] | None = None,
        metric_types: Sequence[MetricType] | None = None,
        metric_dtypes: Sequence[Any] | None = None,
        metrics: Sequence[MetricSpec] = (),
        batch_size: int = 1000,
        num_threads: int = 1,
        comm_group: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pad_token_id: int | None = None,
        token_counts: np.ndarray | None = None,
        progress: bool = True,
    ) -> None:
        super().__init__(
            dataset,
            save_path=save_path,
            metric_names=metric_names,
            metric_functions=metric_functions,
            metric_types=metric_types,
            metric_dtypes=metric_dtypes,
            metrics=metrics,
            batch_size=batch_size,
            num_threads=num_threads,
            collate_fn=collate_fn,
            pad_token_id=pad_token_id,
            token_counts=token_counts,
            progress=progress,
        )
        self.comm_group = comm_group

    def run_map(self) -> None:
        """Not available: the distributed map keeps its results in memory; call `run_map_reduce` on every rank."""
        raise RuntimeError("DistributedDataAnalyzer: call run_map_reduce() on every rank of the group.")

    def run_reduce(self) -> None:
        """Not available: see `run_map`."""
        raise RuntimeError("DistributedDataAnalyzer: call run_map_reduce() on every rank of the group.")

    def run_map_reduce(self) -> None:
        """Maps this rank's share, then gathers and writes the index files on group rank 0 (collective).

        Raises:
            RuntimeError: If ``torch.distributed`` is not initialised, or a metric failed on another rank.
            TypeError, ValueError: As `DataAnalyzer.run_map`, on the rank where a metric function misbehaved.
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "DistributedDataAnalyzer.run_map_reduce: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) on every rank first, or use DataAnalyzer in one process."
            )
        group = self.comm_group
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        lo, hi = _split_index(0, self.num_samples, world)[rank]
        needs_counts = self.token_counts is None and any(isinstance(m.fn, _LazyRarity) for m in self.metrics)
        counts = self._guarded(lambda: self.compute_token_counts(lo, hi) if needs_counts else None)
        if needs_counts:
            self.token_counts = self._sum_over_ranks(counts)  # type: ignore[arg-type]
        for spec in self.metrics:
            if isinstance(spec.fn, _LazyRarity):
                spec.fn.resolve()
        result = self._guarded(lambda: self._map_share(rank, lo, hi))
        ids, values, sums = result  # type: ignore[misc]
        single = [m for m in self.metrics if m.type == "single_value_per_sample"]
        gathered: dict[str, list[np.ndarray]] = {"": self._gather(ids)} if single else {}
        for spec in self.metrics:
            if spec.type == "single_value_per_sample":
                gathered[spec.name] = self._gather(values[spec.name])
            else:
                total = sums[spec.name]
                gathered[spec.name] = self._gather(np.zeros(0, np.int64) if total is None else total)
        self._guarded(lambda: self._write(gathered) if rank == 0 else None)

    def _write(self, gathered: dict[str, list[np.ndarray]]) -> None:
        """Group rank 0: writes the files from every rank's results (the writers of `DataAnalyzer.run_reduce`)."""
        for spec in self.metrics:
            if spec.type == "single_value_per_sample":
                vals = np.concatenate(gathered[spec.name]).astype(spec.dtype)
                ids = np.concatenate(gathered[""])
                write_metric_index(self.save_path / spec.name, spec.name, vals, sample_ids=ids, n=self.num_samples)
            else:
                kept = [p.astype(spec.dtype) for p in gathered[spec.name] if p.size]
                summed = np.sum(np.stack(_pad_same(kept)), axis=0) if kept else np.zeros(0, np.int64)
                write_accumulated_metric(self.save_path / spec.name, spec.name, summed)

    # ---------------------------------------------------------------------------------------------------------------
    # helpers

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` on every rank; if it raised anywhere, every rank raises (no rank is left in a collective)."""
        result, error = None, None
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001  (re-raised below, after telling the other ranks)
            error = err
        failed = self._all_gather_ints([int(error is not None)])
        if error is not None:
            raise error
        if any(failed):
            bad = [r for r, f in enumerate(failed) if f]
            raise RuntimeError(f"DistributedDataAnalyzer: the analysis failed on group rank(s) {bad}; see their error.")
        return result

    def _sum_over_ranks(self, counts: np.ndarray) -> np.ndarray:
        """Element-wise sum of every rank's 1-D int64 histogram (padded to the longest)."""
        size = max(self._all_gather_ints([counts.size]))
        full = torch.zeros(size, dtype=torch.int64, device=self._device())
        full[: counts.size] = torch.from_numpy(counts)
        dist.all_reduce(full, group=self.comm_group)
        return full.cpu().numpy()

    def _map_share(
        self, rank: int, lo: int, hi: int
    ) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray | None]]:
        ranges = _split_index(lo, hi, self.num_threads)
        total = sum(math.ceil((b - a) / self.batch_size) for a, b in ranges)
        bar = _progress(total, f"analyze rank {rank}", self.progress and rank == 0)
        with ThreadPoolExecutor(max_workers=self.num_threads) as pool:
            parts = [f.result() for f in [pool.submit(self._map_arrays, a, b, bar) for a, b in ranges]]
        bar.close()
        ids = np.concatenate([p[0] for p in parts])
        values = {n: np.concatenate([p[1][n] for p in parts]) for n in parts[0][1]}
        sums: dict[str, np.ndarray | None] = {}
        for name in parts[0][2]:
            got = [p[2][name] for p in parts if p[2][name] is not None]
            sums[name] = np.sum(np.stack(_pad_same(got)), axis=0) if got else None  # type: ignore[arg-type]
        return ids, values, sums

    def _device(self) -> torch.device:
        if dist.get_backend(self.comm_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _all_gather_ints(self, xs: list[int]) -> list[int]:
        """Every rank's ``xs`` (same length on every rank), concatenated in rank order."""
        mine = torch.tensor(xs, dtype=torch.int64, device=self._device())
        out = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.comm_group))]
        dist.all_gather(out, mine, group=self.comm_group)
        return torch.cat(out).tolist()

    def _gather(self, arr: np.ndarray) -> list[np.ndarray]:
        """Every rank's integer array (any shape) on group rank 0, in rank order; ``[]`` elsewhere.

        Values travel as int64 (a same-width wrap for uint64, undone by the caller's ``astype``).
        """
        group, world = self.comm_group, dist.get_world_size(self.comm_group)
        if arr.ndim > _MAX_NDIM:
            raise ValueError(f"DistributedDataAnalyzer: metric results have at most {_MAX_NDIM} dimensions.")
        shape = list(arr.shape) + [0] * (_MAX_NDIM - arr.ndim)
        meta = self._all_gather_ints([arr.ndim, arr.size, *shape])
        rows = [meta[i * (_MAX_NDIM + 2) : (i + 1) * (_MAX_NDIM + 2)] for i in range(world)]
        width = max(1, max(r[1] for r in rows))
        device = self._device()
        mine = torch.zeros(width, dtype=torch.int64, device=device)
        mine[: arr.size] = torch.from_numpy(np.ascontiguousarray(arr).reshape(-1).astype(np.int64))
        root = 0 if group is None else dist.get_global_rank(group, 0)
        is_root = dist.get_rank(group) == 0
        bufs = [torch.empty_like(mine) for _ in range(world)] if is_root else None
        dist.gather(mine, bufs, dst=root, group=group)
        if not is_root:
            return []
        return [b[: r[1]].cpu().numpy().reshape(r[2 : 2 + r[0]]) for b, r in zip(bufs, rows)]  # type: ignore[arg-type]
