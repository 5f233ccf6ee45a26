"""`DeepSpeedDataSampler`: a curriculum batch sampler with DeepSpeed's names, made exact-resumable and DP-safe.

Iterating it yields this data-parallel rank's micro-batches (lists of dataset indices). Once per global batch
(``G = micro_batch_size * dp_size * grad_accum`` samples, i.e. per optimizer step) it advances ``curriculum_step``
(1-based), updates each metric's difficulty (`CurriculumScheduler`), adds a cluster when a difficulty changed, draws
the global batch from the clusters and shuffles it. Without curriculum it is a plain shuffled batch sampler.

[Note: clusters]
A cluster is the set of samples that became eligible at one difficulty change: cluster ``c`` is every sample eligible
under all metrics at the difficulties of its creation, minus every earlier cluster. Clusters are therefore disjoint
and their union is the currently eligible set. Eligibility per metric: ``value``: ``metric <= d``;
``percentile``: among the first ``(N1 // max_difficulty) * d`` samples in ascending-metric order (all when
``d >= max_difficulty``); ``single_cluster``: every sample. An empty intersection is an empty set, never "no
constraint" (DeepSpeed treats one metric's empty set as no constraint and breaks the bound). A cluster is named
``cluster_{metric}{difficulty}...`` and, with ``data_cluster_path``, persisted there (sorted ids, index-file
format) with a ``.json`` fingerprint of what produced it; a later sampler (a resume, another rank, the next run)
re-uses a file whose fingerprint matches and recomputes one that does not (no stale-file hazard). A file without a
fingerprint (a DeepSpeed run's cluster) is left untouched and the cluster is kept in memory.
Only data-parallel rank 0 writes, but every rank checks at its first cluster that the folder can be created and
written (a probe file): an unusable path must fail on every rank with the same message, not on rank 0 alone while
the others go on into the training collectives and wait for it (a hang, or a 'Connection reset by peer' there).

[Note: drawing]
Each global batch: ``choice(num_clusters, G, p = sizes / sum(sizes))`` on the sampler's own generator gives how
many samples come from each cluster; each cluster hands out successive passes over a permutation of its members,
wrapping as many times as needed, so the global batch always has exactly ``G`` samples and ``grad_accum``
micro-batches per curriculum step, whatever the cluster sizes (DeepSpeed wraps once only, PR #8520). The
permutation of pass ``k`` of cluster ``c`` is a pure function of ``(seed, c, k)``, so the state of a cluster is two
integers. The global batch is then shuffled with the sampler's generator.

[Note: no broadcast]
DeepSpeed draws on global rank 0 and broadcasts, which fails when global rank 0 is not in a rank's DP group (TP>1)
and needs a shared filesystem for clusters. Here every rank computes the same global batch from the same seed,
config and index files (everything is deterministic: numpy ``PCG64`` generators seeded from ``seed``), and takes its
slice. There is no collective at all. ``data_parallel_group``, when given, is what DeepSpeed uses it for besides the
broadcast: its size is the number of slices (`get_start_end_idx`), and it is checked against ``data_parallel_size``
and ``data_parallel_rank`` at construction (local queries, no communication), so a sampler built with a group it does
not match fails at once instead of handing ranks overlapping slices. ``global_rank`` is accepted for API
compatibility. The global RNGs (``random``, ``numpy.random``, ``torch``) are never read or written.

[Note: state and resume]
State: ``curriculum_step``, difficulties, cluster names and creation difficulties, per-cluster (pass, position),
the generator's ``bit_generator.state``, the schedulers' state, the pending rest of the global batch, the counters
(``consumed_samples``, ``micro_batches``) and, without curriculum, ``epoch``/``epoch_position``. Loading it into a
fresh sampler continues the identical sequence (DeepSpeed saves the global numpy RNG instead, #8405).
Loaders prefetch: by the time a training step runs, the sampler has already yielded later micro-batches. So the
sampler remembers the state after each of its recent yields, and ``state_dict(micro_batches=k)`` returns the state
right after the ``k``-th micro-batch; `CurriculumDataModule` passes the number the Trainer actually consumed.
DeepSpeed's own sampler state (its seven keys, and its cluster files) is imported by `load_state_dict` and exported
by `deepspeed_state_dict`: see [Note: DeepSpeed checkpoints] in ``_deepspeed_state.py``.

[Note: resuming on another number of ranks]
Every rank draws the same global stream and takes a contiguous slice of each global micro-batch of ``b * D`` samples
([Note: no broadcast]); nothing in the state depends on ``b`` or ``D`` apart from their product (counters count
global samples and micro-batch rounds, the pending batch is global). So a state loads into a sampler with other
``b`` and ``D`` but the same ``b * D``, gradient accumulation, dataset length and seed, and the union of its ranks'
slices continues the identical stream: 2 ranks x 4 samples resume as 1 rank x 8 (what DDP trains on is the same
global batch). A different ``b * D`` or accumulation would change the global batches and is refused, naming them.

[Note: counting and termination]
``consumed_samples`` counts global samples (``micro_batch_size * dp_size`` per micro-batch) *including* the one just
yielded (DeepSpeed lags one micro-batch). With curriculum, iteration stops once ``N * num_epochs`` samples are
consumed: ``floor(total / m)`` micro-batches with ``drop_last`` (DeepSpeed yields one more, its ``<=`` quirk), the
last one partial without it. ``len()`` is that per-rank micro-batch count, what a ``DataLoader`` built with
``batch_sampler=`` reports as its length and Lightning counts an epoch by; DeepSpeed's ``len()`` returns
``total_samples`` (a sample count, which its own loader never uses as a length), kept here as the attribute
`DeepSpeedDataSampler.total_samples`.

[Note: DeepSpeed's helper functions]
`get_start_end_idx`, `get_sample_based_on_metric_value` and `get_sample_based_on_metric_percentile` are module-level
functions with DeepSpeed's parameters and return values (``None`` where DeepSpeed returns ``None``: no sample in the
range), taking explicitly what DeepSpeed's methods read from the sampler (the rank and group size, the index files);
the sampler's methods of the same names and DeepSpeed signatures call them. The sampler's own cluster computation
uses the prefix arithmetic of `_MetricIndex`, which gives the same sets without copying rows.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._config import DataEfficiencyConfig
from ._deepspeed_state import (
    DEEPSPEED_STATE_KEYS,
    STATE_FORMAT,
    deepspeed_to_state,
    is_deepspeed_state,
    state_to_deepspeed,
)
from ._index import IndexFile, find_fit_int_dtype, write_index_file
from ._metric_index import (
    _MetricIndex,
    get_sample_based_on_metric_percentile,
    get_sample_based_on_metric_value,
    get_start_end_idx,
)
from ._schedule import CurriculumScheduler, CustomDifficultyFn

__all__ = [
    "DeepSpeedDataSampler",
    "get_sample_based_on_metric_percentile",
    "get_sample_based_on_metric_value",
    "get_start_end_idx",
]

log = logging.getLogger(__name__)

_HISTORY = 4096  # yields remembered for state_dict(micro_batches=k); far more than any loader prefetches


@dataclass
class _Cluster:
    name: str
    difficulties: dict[str, int]
    members: np.ndarray  # int64 [size], sorted sample ids
    pass_no: int = 0
    position: int = 0
    first_pass: np.ndarray | None = None  # int64 [size]: order of pass 0 imported from DeepSpeed, else None
    _perm: tuple[int, np.ndarray] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Durable:
    """Everything but the pending batch and counters; rebuilt only when a global batch is drawn."""

    curriculum_step: int
    current_difficulties: dict[str, int]
    cluster_names: list[str]
    cluster_difficulties: list[dict[str, int]]
    cluster_pass: list[int]
    cluster_position: list[int]
    rng_state: dict[str, Any]
    scheduler_states: dict[str, dict[str, int]]


@dataclass(frozen=True)
class _Mark:
    """The state right after one yield (cheap: references only)."""

    durable: _Durable
    batch: np.ndarray
    batch_pos: int
    consumed_samples: int
    micro_batches: int
    epoch: int
    epoch_position: int


class DeepSpeedDataSampler:
    """Curriculum batch sampler (DeepSpeed's ``DeepSpeedDataSampler``, same arguments and method names).

    See [Note: clusters], [Note: drawing], [Note: no broadcast], [Note: state and resume] and
    [Note: counting and termination] for the algorithm and how it differs from DeepSpeed 0.19.8.

    Args:
        data_efficiency_config: DeepSpeed's ``data_efficiency`` dict (or a whole DeepSpeed config) or a
            `DataEfficiencyConfig`.
        one_epoch_total_samples: Dataset length N.
        micro_batch_size: Samples per micro-batch per rank (b).
        data_parallel_rank: This rank's data-parallel index r.
        data_parallel_size: Number of data-parallel ranks D.
        data_parallel_group: The data-parallel process group, or None. When given, its size must equal
            ``data_parallel_size`` and this process's rank in it ``data_parallel_rank``; its size is the number of
            slices, as in DeepSpeed (see [Note: no broadcast]).
        gradient_accumulation_steps: Micro-batches per optimizer step A.
        global_rank: Unused (see [Note: no broadcast]).
        drop_last: Drop a final partial micro-batch.

    Raises:
        ValueError: For a non-positive size, ``r`` outside ``[0, D)``, an invalid config, or a
            ``data_parallel_group`` whose size or rank differs from ``data_parallel_size``/``data_parallel_rank``.
        TypeError: If ``data_parallel_group`` has no ``size()``/``rank()`` (not a process group).
    """

    config: DataEfficiencyConfig
    one_epoch_total_samples: int
    total_samples: int
    micro_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int
    data_parallel_group: Any
    gradient_accumulation_steps: int
    micro_batch_times_data_parallel_size: int
    global_batch_size: int
    drop_last: bool
    curriculum_schedulers: dict[str, CurriculumScheduler]
    consumed_samples: int
    micro_batches: int
    curriculum_step: int
    current_difficulties: dict[str, int]
    epoch: int
    epoch_position: int

    def __init__(
        self,
        data_efficiency_config: Mapping[str, Any] | DataEfficiencyConfig,
        one_epoch_total_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        data_parallel_group: Any = None,
        gradient_accumulation_steps: int = 1,
        global_rank: int = 0,
        drop_last: bool = True,
    ) -> None:
        cfg = data_efficiency_config
        self.config = cfg if isinstance(cfg, DataEfficiencyConfig) else DataEfficiencyConfig.from_dict(cfg)
        for name, value in (
            ("one_epoch_total_samples", one_epoch_total_samples),
            ("micro_batch_size", micro_batch_size),
            ("data_parallel_size", data_parallel_size),
            ("gradient_accumulation_steps", gradient_accumulation_steps),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepSpeedDataSampler: {name} must be a positive int, got {value!r}.")
        if (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or not 0 <= data_parallel_rank < data_parallel_size
        ):
            raise ValueError(
                f"DeepSpeedDataSampler: data_parallel_rank must be in [0, data_parallel_size={data_parallel_size}), "
                f"got {data_parallel_rank!r}."
            )
        _check_group(data_parallel_group, data_parallel_rank, data_parallel_size)
        self.data_parallel_group = data_parallel_group
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * self.config.data_sampling.num_epochs
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.drop_last = drop_last
        self.index_dtype = find_fit_int_dtype(0, one_epoch_total_samples - 1)
        cl = self.config.curriculum
        self.curriculum_schedulers = {n: CurriculumScheduler(m.schedule) for n, m in cl.curriculum_metrics.items()}
        self._metric_indexes: dict[str, _MetricIndex] = {}
        self._cluster_dir = Path(cl.data_cluster_path) if cl.data_cluster_path else None
        self._cluster_dir_checked = False
        self._reset_state()

    def _reset_state(self) -> None:
        self.np_rng = np.random.Generator(np.random.PCG64(self.config.seed))
        self.consumed_samples = 0
        self.micro_batches = 0
        self.curriculum_step = 0
        self.current_difficulties = {}
        self.epoch = 0
        self.epoch_position = 0
        self.data_clusters: list[_Cluster] = []
        self._assigned = np.zeros(self.one_epoch_total_samples, dtype=bool)
        self._batch = np.zeros(0, dtype=np.int64)
        self._batch_pos = 0
        self._durable = self._capture_durable()
        self._history: deque[_Mark] = deque(maxlen=_HISTORY)
        self._history.append(self._mark())

    @property
    def curriculum_enabled(self) -> bool:
        """Whether the curriculum is on (``curriculum_learning.enabled``)."""
        return self.config.curriculum.enabled

    @property
    def batch(self) -> list[int]:
        """The pending (not yet yielded) rest of the current global batch."""
        return self._batch[self._batch_pos :].tolist()

    def __len__(self) -> int:
        """Micro-batches one full iteration yields on this rank: the length of a ``DataLoader`` over this batch
        sampler. DeepSpeed's ``len()`` is a sample count, ``total_samples`` here (see [Note: counting and
        termination])."""
        total = self.total_samples if self.curriculum_enabled else self.one_epoch_total_samples
        m = self.micro_batch_times_data_parallel_size
        return total // m if self.drop_last else math.ceil(total / m)

    # ---------------------------------------------------------------------------------------------------------------
    # iteration

    def __iter__(self) -> Iterator[list[int]]:
        """Yields this rank's micro-batches: the rest of the run with curriculum, else the rest of one epoch."""
        if self.curriculum_enabled:
            yield from self._iter_curriculum()
        else:
            yield from self._iter_epoch()

    def _iter_curriculum(self) -> Iterator[list[int]]:
        m = self.micro_batch_times_data_parallel_size
        while self.consumed_samples < self.total_samples:
            if self._batch_pos >= self._batch.size:
                self.get_next_global_batch()
            take = min(m, self._batch.size - self._batch_pos, self.total_samples - self.consumed_samples)
            if take < m and self.drop_last:
                return
            cur = self._batch[self._batch_pos : self._batch_pos + take]
            self._batch_pos += take
            yield self._consume(cur)

    def _iter_epoch(self) -> Iterator[list[int]]:
        n, m = self.one_epoch_total_samples, self.micro_batch_times_data_parallel_size
        left = n - self.epoch_position
        if self.epoch_position > 0 and (left <= 0 or (self.drop_last and left < m)):
            # the last epoch was drawn to its end by a consumer that stopped after len() micro-batches (Lightning
            # never asks for one more, which is what would move the epoch on): this iteration is the next epoch
            self.epoch += 1
            self.epoch_position = 0
        perm = np.random.default_rng([self.config.seed, self.epoch]).permutation(n)
        while self.epoch_position < n:
            take = min(m, n - self.epoch_position)
            if take < m and self.drop_last:
                break
            cur = perm[self.epoch_position : self.epoch_position + take]
            self.epoch_position += take
            yield self._consume(cur)
        self.epoch += 1
        self.epoch_position = 0

    def end_epoch(self) -> None:
        """Ends the consumer's epoch where it stands, for a consumer that ends its epochs early, as Lightning's
        ``limit_train_batches`` does (`CurriculumDataModule` calls it; see [Note: Lightning epochs] there).

        Without curriculum the next iteration starts the next epoch's permutation instead of continuing this one.
        With curriculum the rest of the current global batch is dropped, so the next micro-batch starts the next
        curriculum step: Lightning takes an optimizer step at the end of every epoch, even after fewer than
        ``gradient_accumulation_steps`` micro-batches, and the curriculum step stays in lockstep with it. Does
        nothing at an epoch's or a global batch's start.
        """
        if self.curriculum_enabled:
            self._batch_pos = self._batch.size
            return
        if self.epoch_position == 0:
            return
        self.epoch += 1
        self.epoch_position = 0

    def _consume(self, cur: np.ndarray) -> list[int]:
        self.consumed_samples += int(cur.size)
        self.micro_batches += 1
        self._history.append(self._mark())
        ranks = self.data_parallel_size if self.data_parallel_group is None else self.data_parallel_group.size()
        if 0 < cur.size < ranks:
            # a last partial micro-batch with fewer samples than ranks (drop_last=False) would leave some rank an
            # empty batch (a collate error, a rank out of step with the others): its samples are repeated so every
            # rank gets one, as torch's DistributedSampler pads; consumed_samples counts the real ones
            cur = np.resize(cur, ranks)
        start, end = self.get_start_end_idx(int(cur.size))
        return cur[start:end].tolist()

    def get_start_end_idx(self, batch_len: int | None = None) -> tuple[int, int]:
        """This rank's ``[start, end)`` in a micro-batch of ``batch_len`` samples (default ``b * D``): the
        module-level `get_start_end_idx` with this rank and the data-parallel group's size (``D``, checked equal)."""
        n = self.micro_batch_times_data_parallel_size if batch_len is None else batch_len
        size = self.data_parallel_size if self.data_parallel_group is None else self.data_parallel_group.size()
        return get_start_end_idx(n, self.data_parallel_rank, size)

    def get_next_global_batch(self) -> None:
        """Advances the curriculum one step and draws the next global batch (``G`` samples). See [Note: drawing].

        Raises:
            ValueError: If no sample is eligible at the current difficulties (the message names the metrics).
        """
        self.curriculum_step += 1
        new_cluster_needed = False
        for name, scheduler in self.curriculum_schedulers.items():
            nxt = scheduler.update_difficulty(self.curriculum_step)
            self._check_not_decreasing(name, nxt)
            if self.current_difficulties.get(name) != nxt:
                new_cluster_needed = True
            self.current_difficulties[name] = nxt
        if new_cluster_needed:
            self.get_new_cluster()
        if not self.data_clusters:
            raise ValueError(self._empty_message())
        counts = self.sample_from_clusters()
        parts = [self.get_sample_from_cluster(c, int(k)) for c, k in enumerate(counts) if k > 0]
        batch = np.concatenate(parts)
        self.np_rng.shuffle(batch)
        if batch.size != self.global_batch_size:
            raise AssertionError(f"{batch.size=} {self.global_batch_size=}")
        self._batch, self._batch_pos = batch, 0
        self._durable = self._capture_durable()

    def _check_not_decreasing(self, name: str, difficulty: int) -> None:
        """Warns when a schedule-based metric's difficulty drops: clusters only grow (see [Note: clusters]), so the
        samples of the higher difficulty stay eligible, as in DeepSpeed, and the bound of the lower one does not hold
        until the schedule climbs back. A ``single_cluster`` metric has no bound (``seqlen_truncate`` may shrink)."""
        prev = self.current_difficulties.get(name)
        metric = self.config.curriculum.curriculum_metrics[name]
        if prev is None or difficulty >= prev or metric.clustering_type != "schedule_based":
            return
        warnings.warn(
            f"DeepSpeedDataSampler: the difficulty of curriculum metric {name!r} drops from {prev} to {difficulty} at "
            f"curriculum_step {self.curriculum_step} ({metric.schedule.schedule_type} schedule). Its samples are "
            f"clustered by difficulty and clusters only grow (as in DeepSpeed), so the samples eligible at {prev} "
            f"stay eligible: batches are not bounded by difficulty {difficulty}. Make the schedule non-decreasing "
            f"(e.g. a custom function returning max(previous, value)) if the bound matters.",
            UserWarning,
            stacklevel=2,
        )

    def _empty_message(self) -> str:
        sizes = {n: int(self._eligible(n, d).sum()) for n, d in self.current_difficulties.items()}
        empty = [n for n, s in sizes.items() if s == 0]
        metrics = self.config.curriculum.curriculum_metrics
        advice = []
        for name in empty:
            m = metrics.get(name)
            if m is not None and m.difficulty_type == "percentile":
                top = m.schedule.max_difficulty
                advice.append(
                    f"{name!r} is percentile-based: each of its {top} units holds N // {top} = "
                    f"{self.one_epoch_total_samples // top} samples of this dataset, so raise min_difficulty until "
                    f"min_difficulty * (N // {top}) >= 1, or lower max_difficulty to at most N"
                )
            else:
                advice.append(
                    f"raise min_difficulty of {name!r} to at least its smallest metric value (see *_index_to_metric)"
                )
        return (
            f"DeepSpeedDataSampler: no sample is eligible at curriculum_step {self.curriculum_step} with difficulties "
            f"{self.current_difficulties} (eligible samples per metric: {sizes}; empty: {empty or 'the intersection'}). "
            + ("; ".join(advice) + ", " if advice else "")
            + "or check that the index files belong to this dataset."
        )

    def sample_from_clusters(self) -> np.ndarray:
        """How many of the ``G`` samples come from each cluster: a size-weighted multinomial draw (int64)."""
        sizes = np.array([c.members.size for c in self.data_clusters], dtype=np.float64)
        draws = self.np_rng.choice(len(sizes), self.global_batch_size, replace=True, p=sizes / sizes.sum())
        return np.bincount(draws, minlength=len(sizes))

    def get_sample_from_cluster(self, cluster_index: int, num_samples: int) -> np.ndarray:
        """The next ``num_samples`` ids of a cluster's successive shuffled passes, wrapping as often as needed."""
        c = self.data_clusters[cluster_index]
        out: list[np.ndarray] = []
        need = num_samples
        while need > 0:
            if c.position >= c.members.size:
                c.pass_no, c.position = c.pass_no + 1, 0
            perm = self._permutation(cluster_index)
            take = perm[c.position : c.position + need]
            out.append(take)
            c.position += take.size
            need -= take.size
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def _permutation(self, cluster_index: int) -> np.ndarray:
        c = self.data_clusters[cluster_index]
        if c._perm is None or c._perm[0] != c.pass_no:
            c._perm = (c.pass_no, self._pass_order(cluster_index, c.pass_no))
        return c._perm[1]

    def _pass_order(self, cluster_index: int, pass_no: int) -> np.ndarray:
        """The order of pass ``pass_no`` of a cluster: imported (pass 0 only) or a pure function of the seed."""
        c = self.data_clusters[cluster_index]
        if pass_no == 0 and c.first_pass is not None:
            return c.first_pass
        if c._perm is not None and c._perm[0] == pass_no:
            return c._perm[1]
        return np.random.default_rng([self.config.seed, cluster_index, pass_no]).permutation(c.members)

    # ---------------------------------------------------------------------------------------------------------------
    # clusters

    def _metric_index(self, name: str) -> _MetricIndex:
        if name not in self._metric_indexes:
            m = self.config.curriculum.curriculum_metrics[name]
            try:
                self._metric_indexes[name] = _MetricIndex(m)
            except FileNotFoundError as err:
                raise FileNotFoundError(
                    f"DeepSpeedDataSampler: the index files of curriculum metric {name!r} (index_to_sample_path="
                    f"{m.index_to_sample_path!r}, index_to_metric_path={m.index_to_metric_path!r}) cannot be read: "
                    f"{err}"
                ) from err
        return self._metric_indexes[name]

    def _ordered(self, name: str, lo_pos: int, hi_pos: int) -> np.ndarray:
        idx = self._metric_index(name).samples.values
        if idx.size != self.one_epoch_total_samples:
            raise ValueError(
                f"DeepSpeedDataSampler: metric {name!r} indexes {idx.size} samples but the dataset has "
                f"{self.one_epoch_total_samples}; re-run the analysis on this dataset."
            )
        return np.asarray(idx[lo_pos:hi_pos], dtype=np.int64)

    def get_sample_based_on_metric_value(self, metric: str, value_start: float, value_end: float) -> np.ndarray | None:
        """Sample ids with ``value_start < metric <= value_end`` in ascending-metric order, or None if none: the
        module-level `get_sample_based_on_metric_value` on the metric's index files.

        Raises:
            ValueError: If ``metric`` is not a value-based metric of the config.
        """
        index = self._metric_index(metric)
        if index.metric is None:
            raise ValueError(
                f"DeepSpeedDataSampler.get_sample_based_on_metric_value: metric {metric!r} is percentile-based (no "
                f"index_to_metric file); use get_sample_based_on_metric_percentile."
            )
        return get_sample_based_on_metric_value(index.samples, index.metric, value_start, value_end)

    def get_sample_based_on_metric_percentile(
        self, metric: str, percentile_start: float, percentile_end: float
    ) -> np.ndarray | None:
        """Sample ids in percentile units ``[percentile_start, percentile_end)`` of the ascending-metric order, or
        None if none: the module-level `get_sample_based_on_metric_percentile` on the metric's index file."""
        top = self.config.curriculum.curriculum_metrics[metric].schedule.max_difficulty
        return get_sample_based_on_metric_percentile(
            self._metric_index(metric).samples, top, percentile_start, percentile_end
        )

    def _eligible(self, name: str, difficulty: int) -> np.ndarray:
        m = self.config.curriculum.curriculum_metrics[name]
        mask = np.zeros(self.one_epoch_total_samples, dtype=bool)
        if m.clustering_type == "single_cluster":
            mask[:] = True
        else:
            mask[self._ordered(name, 0, self._prefix(name, difficulty))] = True
        return mask

    def _cluster_name(self, difficulties: Mapping[str, int]) -> str:
        return "cluster" + "".join(f"_{n}{difficulties[n]}" for n in self.curriculum_schedulers)

    def get_new_cluster(self, previous_difficulties: Mapping[str, int] | None = None) -> None:
        """Adds the cluster of samples newly eligible at the current difficulties. See [Note: clusters].

        Args:
            previous_difficulties: Ignored (DeepSpeed signature); the increment is "eligible now minus every
                existing cluster".
        """
        diffs = dict(self.current_difficulties)
        members = self._load_or_compute_cluster(diffs)
        if members.size == 0:
            log.debug("DeepSpeedDataSampler: no new samples at difficulties %s", diffs)
            return
        self._add_cluster(self._cluster_name(diffs), diffs, members)

    def _add_cluster(self, name: str, diffs: dict[str, int], members: np.ndarray) -> _Cluster:
        self._assigned[members] = True
        self.data_clusters.append(_Cluster(name=name, difficulties=diffs, members=members))
        return self.data_clusters[-1]

    def _compute_cluster(self, diffs: Mapping[str, int]) -> np.ndarray:
        """Sorted ids eligible at ``diffs`` and in no existing cluster. See [Note: clusters]."""
        metrics = self.config.curriculum.curriculum_metrics
        restricting = [n for n, m in metrics.items() if m.clustering_type == "schedule_based"]
        if len(restricting) != 1:
            return self._compute_cluster_generic(diffs)
        # One restricting metric: its eligible sets are growing prefixes of its index order, so the existing
        # clusters are exactly the prefix up to their largest difficulty and the new cluster is the next slice
        # (DeepSpeed's ``prev < metric <= cur`` increment), without a pass over the whole dataset.
        name = restricting[0]
        lo = max((self._prefix(name, c.difficulties[name]) for c in self.data_clusters), default=0)
        hi = self._prefix(name, diffs[name])
        return np.sort(self._ordered(name, lo, hi)) if hi > lo else np.zeros(0, dtype=np.int64)

    def _compute_cluster_generic(self, diffs: Mapping[str, int]) -> np.ndarray:
        mask = ~self._assigned
        for name, d in diffs.items():
            mask &= self._eligible(name, d)
        return np.flatnonzero(mask).astype(np.int64)

    def _prefix(self, name: str, difficulty: int) -> int:
        """How many samples, in the metric's index order, are eligible at ``difficulty`` (a prefix)."""
        index, m = self._metric_index(name), self.config.curriculum.curriculum_metrics[name]
        if m.difficulty_type == "value":
            return index.prefix_upto_value(difficulty)
        return index.prefix_upto_percentile(difficulty, m.schedule.max_difficulty)

    def _fingerprint(self, diffs: Mapping[str, int]) -> dict[str, Any]:
        metrics = {}
        for name, m in self.config.curriculum.curriculum_metrics.items():
            if m.clustering_type == "schedule_based":
                self._metric_index(name)  # opens (checks) the files first: a missing one is named with its setting
            files = [
                p
                for p in (m.index_to_sample_path, m.index_to_metric_path)
                if p and m.clustering_type == "schedule_based"
            ]
            stats = [
                [str(Path(p).resolve()), Path(p + ".bin").stat().st_size, Path(p + ".bin").stat().st_mtime_ns]
                for p in files
            ]
            metrics[name] = {"difficulty_type": m.difficulty_type, "clustering_type": m.clustering_type, "files": stats}
        return {
            "num_samples": self.one_epoch_total_samples,
            "difficulties": dict(diffs),
            "previous_clusters": [c.name for c in self.data_clusters],
            "metrics": metrics,
        }

    def _load_or_compute_cluster(self, diffs: Mapping[str, int]) -> np.ndarray:
        if self._cluster_dir is None:
            return self._compute_cluster(diffs)
        if not self._cluster_dir_checked:
            _check_writable_folder(self._cluster_dir)  # on every rank: see [Note: clusters]
            self._cluster_dir_checked = True
        prefix = self._cluster_dir / self._cluster_name(diffs)
        meta_path = prefix.with_name(prefix.name + ".json")
        fingerprint = self._fingerprint(diffs)
        try:
            if json.loads(meta_path.read_text()) == fingerprint:
                members = np.asarray(IndexFile(prefix)[0], dtype=np.int64)
                if not self._assigned[members].any():
                    return members
        except (OSError, ValueError):
            pass
        members = self._compute_cluster(diffs)
        # A cluster file without our fingerprint is someone else's (a DeepSpeed run's): never used, never overwritten.
        foreign = not meta_path.exists() and prefix.with_name(prefix.name + ".bin").exists()
        if self.data_parallel_rank == 0 and not foreign:  # every rank computes the same; one per DP group writes
            write_index_file(prefix, members, [members.size], self.index_dtype)
            # a name no other writer can have (the rank 0 of every DP group writes, possibly in forked processes
            # where object ids coincide)
            tmp = meta_path.with_name(meta_path.name + f".{os.getpid()}.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps(fingerprint))
            tmp.replace(meta_path)
        return members

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, CustomDifficultyFn]) -> None:
        """Installs ``custom`` schedule functions by metric name (before the first batch is drawn).

        Raises:
            ValueError: For a metric that is not configured.
        """
        for name, fn in schedule_func_dict.items():
            if name not in self.curriculum_schedulers:
                raise ValueError(
                    f"DeepSpeedDataSampler.set_custom_curriculum_learning_schedule: unknown metric {name!r}; "
                    f"configured metrics: {list(self.curriculum_schedulers)}."
                )
            self.curriculum_schedulers[name].set_custom_get_difficulty(fn)

    # ---------------------------------------------------------------------------------------------------------------
    # state

    def _capture_durable(self) -> _Durable:
        return _Durable(
            curriculum_step=self.curriculum_step,
            current_difficulties=dict(self.current_difficulties),
            cluster_names=[c.name for c in self.data_clusters],
            cluster_difficulties=[dict(c.difficulties) for c in self.data_clusters],
            cluster_pass=[c.pass_no for c in self.data_clusters],
            cluster_position=[c.position for c in self.data_clusters],
            rng_state=dict(self.np_rng.bit_generator.state),
            scheduler_states={n: s.state_dict() for n, s in self.curriculum_schedulers.items()},
        )

    def _mark(self) -> _Mark:
        return _Mark(
            durable=self._durable,
            batch=self._batch,
            batch_pos=self._batch_pos,
            consumed_samples=self.consumed_samples,
            micro_batches=self.micro_batches,
            epoch=self.epoch,
            epoch_position=self.epoch_position,
        )

    def state_dict(self, micro_batches: int | None = None) -> dict[str, Any]:
        """The sampler's state, after its latest yield or after its ``micro_batches``-th one.

        Args:
            micro_batches: Return the state as it was right after this many micro-batches had been yielded (counted
                over the sampler's life, see `micro_batches`); None: now. See [Note: state and resume].

        Returns:
            A dict of plain Python values (picklable; goes into the Lightning checkpoint).

        Raises:
            ValueError: If ``micro_batches`` is in the future or older than the remembered history.
        """
        mark = self._mark() if micro_batches is None else self._find_mark(micro_batches)
        d = mark.durable
        return {
            "format": STATE_FORMAT,
            "shape": self._shape(),
            "batch": mark.batch[mark.batch_pos :].tolist(),
            "consumed_samples": mark.consumed_samples,
            "micro_batches": mark.micro_batches,
            "epoch": mark.epoch,
            "epoch_position": mark.epoch_position,
            "curriculum_step": d.curriculum_step,
            "current_difficulties": dict(d.current_difficulties),
            "data_cluster_paths": list(d.cluster_names),
            "data_cluster_difficulties": [dict(x) for x in d.cluster_difficulties],
            "data_cluster_pass": list(d.cluster_pass),
            "data_cluster_current_position": list(d.cluster_position),
            "np_rng_state": _plain(d.rng_state),
            "scheduler_states": {n: dict(s) for n, s in d.scheduler_states.items()},
            "data_cluster_imported_order": {
                c.name: c.first_pass.tolist()
                for c, p in zip(self.data_clusters, d.cluster_pass)
                if c.first_pass is not None and p == 0
            },
        }

    def deepspeed_state_dict(self, cluster_dir: str | Path, micro_batches: int | None = None) -> dict[str, Any]:
        """The state in DeepSpeed's ``state_dict`` layout, with DeepSpeed cluster files written to ``cluster_dir``.

        A DeepSpeed sampler (``data_cluster_path = cluster_dir``) or this one can resume from it. See
        [Note: DeepSpeed checkpoints] in ``_deepspeed_state.py``.

        Args:
            cluster_dir: Folder for the cluster files (not this sampler's ``data_cluster_path``).
            micro_batches: As in `state_dict`.

        Raises:
            ValueError: Without curriculum, or if ``cluster_dir`` is this sampler's own cluster folder.
        """
        if not self.curriculum_enabled:
            raise ValueError(
                "DeepSpeedDataSampler.deepspeed_state_dict: DeepSpeed keeps no sampler state without curriculum."
            )
        folder = Path(cluster_dir)
        if self._cluster_dir is not None and folder.resolve() == self._cluster_dir.resolve():
            raise ValueError(
                f"DeepSpeedDataSampler.deepspeed_state_dict: {folder} is this sampler's own data_cluster_path; write "
                "the DeepSpeed cluster files to another folder."
            )
        state = self.state_dict(micro_batches)
        orders = [self._pass_order(i, p) for i, p in enumerate(state["data_cluster_pass"])]
        return state_to_deepspeed(state, cluster_dir=folder, cluster_orders=orders)

    def _find_mark(self, k: int) -> _Mark:
        for mark in reversed(self._history):
            if mark.micro_batches == k:
                return mark
        have = (self._history[0].micro_batches, self._history[-1].micro_batches)
        raise ValueError(
            f"DeepSpeedDataSampler.state_dict: no state after micro-batch {k}; the sampler remembers micro-batches "
            f"{have[0]}..{have[1]}."
        )

    def _shape(self) -> dict[str, int]:
        return {
            "one_epoch_total_samples": self.one_epoch_total_samples,
            "micro_batch_size": self.micro_batch_size,
            "data_parallel_size": self.data_parallel_size,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "seed": self.config.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict` output (iteration then continues the identical sequence), or DeepSpeed's state.

        A state with DeepSpeed's keys and no ``format`` (``checkpoint["data_sampler"]`` of a DeepSpeed checkpoint)
        is first translated into this sampler's layout (``deepspeed_to_state``, which reads DeepSpeed's cluster files
        from ``data_cluster_path``), then loaded the same way: see [Note: DeepSpeed checkpoints] in
        ``_deepspeed_state.py``.

        Raises:
            ValueError: If the state is not from a compatible sampler (different dataset length, batch shape or
                seed: the message names what differs), a cluster cannot be rebuilt or its saved order does not hold
                its members, or a DeepSpeed state does not fit this config (see ``deepspeed_to_state``).
            FileNotFoundError: If a DeepSpeed cluster file named in the state is missing.
        """
        if is_deepspeed_state(state):
            state = deepspeed_to_state(state, config=self.config, shape=self._shape())
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"DeepSpeedDataSampler.load_state_dict: unsupported state format {state.get('format')!r} (expected "
                f"{STATE_FORMAT!r}, or DeepSpeed's sampler state with keys {list(DEEPSPEED_STATE_KEYS)})."
            )
        self._check_shape(state["shape"])
        self._reset_state()
        imported = state.get("data_cluster_imported_order", {})
        for name, diffs in zip(state["data_cluster_paths"], state["data_cluster_difficulties"]):
            members = self._load_or_compute_cluster(diffs)
            # An imported cluster may be empty (DeepSpeed keeps those); its order is checked below.
            if self._cluster_name(diffs) != name or (members.size == 0 and name not in imported):
                raise ValueError(f"DeepSpeedDataSampler.load_state_dict: cannot rebuild cluster {name!r} from {diffs}.")
            self._add_cluster(name, dict(diffs), members)
        for c, p, pos in zip(self.data_clusters, state["data_cluster_pass"], state["data_cluster_current_position"]):
            c.pass_no, c.position = int(p), int(pos)
        for c in self.data_clusters:
            order = imported.get(c.name)
            if order is not None:
                c.first_pass = np.asarray(order, dtype=np.int64)
                if not np.array_equal(np.sort(c.first_pass), c.members):
                    raise ValueError(
                        f"DeepSpeedDataSampler.load_state_dict: cluster {c.name!r}: the checkpoint's order of its "
                        f"current pass holds {c.first_pass.size} ids, but the metric index files give "
                        f"{c.members.size} samples newly eligible at {c.difficulties}: the cluster files (DeepSpeed's, "
                        "for an imported state), the index files and the config must come from the same run."
                    )
        self.np_rng.bit_generator.state = state["np_rng_state"]
        for name, s in state["scheduler_states"].items():
            self.curriculum_schedulers[name].load_state_dict(s)
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = dict(state["current_difficulties"])
        self.consumed_samples = int(state["consumed_samples"])
        self.micro_batches = int(state["micro_batches"])
        self.epoch, self.epoch_position = int(state["epoch"]), int(state["epoch_position"])
        self._batch, self._batch_pos = np.asarray(state["batch"], dtype=np.int64), 0
        self._restart_history()

    def _check_shape(self, saved: Mapping[str, Any]) -> None:
        """A state fits if it has this sampler's stream: see [Note: resuming on another number of ranks]."""
        mine = self._shape()
        diff = {k: (mine[k], saved.get(k)) for k in ("one_epoch_total_samples", "gradient_accumulation_steps", "seed")}
        try:
            saved_micro: int | None = int(saved["micro_batch_size"]) * int(saved["data_parallel_size"])
        except (KeyError, TypeError, ValueError):
            saved_micro = None
        diff["micro_batch_size * data_parallel_size"] = (self.micro_batch_times_data_parallel_size, saved_micro)
        diff = {k: v for k, v in diff.items() if v[0] != v[1]}
        if diff:
            raise ValueError(
                "DeepSpeedDataSampler.load_state_dict: the checkpoint was written by a sampler with different "
                f"settings {{name: (now, in checkpoint)}}: {diff}. Resume with the same dataset, gradient "
                "accumulation, seed and global micro-batch (micro_batch_size x data-parallel size: a run on 2 ranks "
                "with micro-batches of 4 resumes on 1 rank with micro-batches of 8)."
            )

    def _restart_history(self) -> None:
        """Makes the current state the only remembered one (after a load)."""
        self._durable = self._capture_durable()
        self._history.clear()
        self._history.append(self._mark())

    def rewind(self, micro_batches: int) -> None:
        """Returns the sampler to its state right after its ``micro_batches``-th yield (within the remembered
        history), so that a loader re-created after prefetching continues at the first micro-batch not consumed.

        Raises:
            ValueError: If that yield is not remembered (see `state_dict`).
        """
        mark = self._find_mark(micro_batches)
        d = mark.durable
        for c in self.data_clusters[len(d.cluster_names) :]:
            self._assigned[c.members] = False
        del self.data_clusters[len(d.cluster_names) :]
        for c, p, pos in zip(self.data_clusters, d.cluster_pass, d.cluster_position):
            c.pass_no, c.position = p, pos
        self.np_rng.bit_generator.state = d.rng_state
        for name, s in d.scheduler_states.items():
            self.curriculum_schedulers[name].load_state_dict(s)
        self.curriculum_step, self.current_difficulties = d.curriculum_step, dict(d.current_difficulties)
        self.consumed_samples, self.micro_batches = mark.consumed_samples, mark.micro_batches
        self.epoch, self.epoch_position = mark.epoch, mark.epoch_position
        self._batch, self._batch_pos, self._durable = mark.batch, mark.batch_pos, d
        while self._history[-1].micro_batches != micro_batches:
            self._history.pop()

    def difficulties_at(self, micro_batches: int) -> dict[str, int]:
        """The difficulties in force for the ``micro_batches``-th micro-batch (1-based; see `state_dict`)."""
        return dict(self._find_mark(micro_batches).durable.current_difficulties)


def _check_group(group: Any, rank: int, size: int) -> None:
    """A given data-parallel group must match ``data_parallel_size``/``data_parallel_rank`` (local queries only)."""
    if group is None:
        return
    if not callable(getattr(group, "size", None)) or not callable(getattr(group, "rank", None)):
        raise TypeError(
            f"DeepSpeedDataSampler: data_parallel_group must be a process group (with size() and rank()) or None, "
            f"got {type(group).__name__}."
        )
    if group.size() != size:
        raise ValueError(
            f"DeepSpeedDataSampler: data_parallel_group has {group.size()} ranks but data_parallel_size={size}; pass "
            f"the group of this rank's data-parallel peers, or its size as data_parallel_size."
        )
    if group.rank() != rank:
        raise ValueError(
            f"DeepSpeedDataSampler: this process is rank {group.rank()} of data_parallel_group but "
            f"data_parallel_rank={rank}; pass its rank in the group (a rank outside the group reports -1)."
        )


def _check_writable_folder(folder: Path) -> None:
    """Creates ``folder`` if missing and checks that a file can be written in it (the cluster folder)."""
    probe = folder / f".write_check.{os.getpid()}.{uuid.uuid4().hex}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(
            f"DeepSpeedDataSampler: data_cluster_path {str(folder)!r} is not a writable folder ({type(err).__name__}: "
            f"{err}); data-parallel rank 0 persists the curriculum clusters there. Set "
            "data_efficiency.data_sampling.curriculum_learning.data_cluster_path to a folder every rank can create "
            "and write, or remove it to keep the clusters in memory."
        ) from err


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def _starts_global_batch(sampler: DeepSpeedDataSampler, micro_batches: int) -> bool:
    """Whether the ``micro_batches``-th micro-batch was the first of its global batch (curriculum step)."""
    mark = sampler._find_mark(micro_batches)
    return mark.batch_pos <= sampler.micro_batch_times_data_parallel_size


def _consumed_samples_at(sampler: DeepSpeedDataSampler, micro_batches: int) -> int:
    """Global samples consumed right after the ``micro_batches``-th micro-batch (see `DeepSpeedDataSampler.state_dict`)."""
    return sampler._find_mark(micro_batches).consumed_samples
