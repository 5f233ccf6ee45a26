"""Typed configuration of the curriculum data pipeline, parsed from DeepSpeed's ``data_efficiency`` dict.

`DataEfficiencyConfig.from_dict` accepts DeepSpeed's keys (a whole DeepSpeed config holding ``data_efficiency``, or
that section alone), fills DeepSpeed's parser defaults, rejects unknown keys by name, and builds frozen dataclasses;
the sampler reads only the dataclasses. ``dynamic_batching`` and ``data_routing`` (random-LTD) are accepted but must
stay disabled: zlightning does not implement them.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._schedule import CurriculumSchedule

__all__ = [
    "ClusteringType",
    "CurriculumLearningConfig",
    "CurriculumMetricConfig",
    "DataEfficiencyConfig",
    "DataSamplingConfig",
    "DifficultyType",
]

DifficultyType = Literal["value", "percentile"]
"""``value``: the difficulty is a metric threshold (eligible: ``metric <= d``). ``percentile``: the difficulty counts
units of ``N // max_difficulty`` samples in ascending-metric order (eligible: the first ``(N // max) * d``)."""

ClusteringType = Literal["schedule_based", "single_cluster"]
"""``schedule_based``: the metric restricts the samples. ``single_cluster``: it only carries a schedule (e.g.
``seqlen_truncate``, applied to the batch) and every sample is eligible."""


def _check_keys(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"{where}: expected a dict, got {type(d).__name__}.")
    for key in d:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{where}: unknown key {key!r}; allowed keys: {sorted(allowed)}.{hint}")


def _check_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be true or false, got {value!r}.")
    return value


@dataclass(frozen=True, kw_only=True)
class CurriculumMetricConfig:
    """One curriculum metric (``curriculum_metrics.<name>``).

    Raises:
        ValueError: For an unknown choice, or a missing index path the choice needs.
    """

    schedule: CurriculumSchedule
    """How the difficulty grows with the curriculum step."""
    difficulty_type: DifficultyType = "value"
    """``value`` or ``percentile``; see `DifficultyType`."""
    clustering_type: ClusteringType = "schedule_based"
    """``schedule_based`` or ``single_cluster``; see `ClusteringType`."""
    index_to_sample_path: str | None = None
    """Prefix of the metric's ``*_index_to_sample`` (or ``*_percentile_merged``) file; needed for schedule_based."""
    index_to_metric_path: str | None = None
    """Prefix of the metric's ``*_index_to_metric`` file; needed for schedule_based ``value`` metrics."""

    def __post_init__(self) -> None:
        if self.difficulty_type not in ("value", "percentile"):
            raise ValueError(
                f"CurriculumMetricConfig: difficulty_type must be 'value' or 'percentile', got {self.difficulty_type!r}."
            )
        if self.clustering_type not in ("schedule_based", "single_cluster"):
            raise ValueError(
                "CurriculumMetricConfig: clustering_type must be 'schedule_based' or 'single_cluster', "
                f"got {self.clustering_type!r}."
            )
        if self.clustering_type == "schedule_based":
            hint = " Build the index files with DataAnalyzer / `zlightning analyze`."
            if not self.index_to_sample_path:
                raise ValueError(f"CurriculumMetricConfig: a schedule_based metric needs index_to_sample_path.{hint}")
            if self.difficulty_type == "value" and not self.index_to_metric_path:
                raise ValueError(
                    f"CurriculumMetricConfig: a schedule_based value metric needs index_to_metric_path.{hint}"
                )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> CurriculumMetricConfig:
        """Builds the config from DeepSpeed's per-metric dict (schedule keys included)."""
        schedule = CurriculumSchedule.from_dict(d, where=where)
        try:
            return cls(
                schedule=schedule,
                difficulty_type=d.get("difficulty_type", "value"),
                clustering_type=d.get("clustering_type", "schedule_based"),
                index_to_sample_path=d.get("index_to_sample_path"),
                index_to_metric_path=d.get("index_to_metric_path"),
            )
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None


@dataclass(frozen=True, kw_only=True)
class CurriculumLearningConfig:
    """``data_sampling.curriculum_learning``.

    Raises:
        ValueError: If enabled without metrics, or a metric name is not usable in a file name.
    """

    enabled: bool = False
    """Turns the curriculum on; off, the sampler shuffles one epoch per iteration."""
    data_cluster_path: str | None = None
    """Folder where clusters are persisted and re-used; None keeps them in memory only."""
    curriculum_metrics: dict[str, CurriculumMetricConfig] = field(default_factory=dict)
    """The metrics, by name, in order (the order fixes cluster file names)."""

    def __post_init__(self) -> None:
        if self.enabled and not self.curriculum_metrics:
            raise ValueError("curriculum_learning: enabled=true needs at least one entry in curriculum_metrics.")
        for name in self.curriculum_metrics:
            if not name or not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(
                    f"curriculum_learning.curriculum_metrics: metric name {name!r} must be letters, digits, '_' or '-'."
                )


@dataclass(frozen=True, kw_only=True)
class DataSamplingConfig:
    """``data_efficiency.data_sampling``.

    Raises:
        ValueError: If a count is out of range.
    """

    enabled: bool = False
    """DeepSpeed's switch of the section (informational: the sampler follows ``curriculum_learning.enabled``)."""
    num_epochs: int = 1000
    """Passes over the dataset the curriculum sampler may draw (``total_samples = N * num_epochs``)."""
    num_workers: int = 0
    """DataLoader worker processes."""
    pin_memory: bool = False
    """DataLoader ``pin_memory``."""
    curriculum_learning: CurriculumLearningConfig = field(default_factory=CurriculumLearningConfig)
    """The curriculum."""

    def __post_init__(self) -> None:
        if isinstance(self.num_epochs, bool) or not isinstance(self.num_epochs, int) or self.num_epochs < 1:
            raise ValueError(f"data_sampling.num_epochs must be an int >= 1, got {self.num_epochs!r}.")
        if isinstance(self.num_workers, bool) or not isinstance(self.num_workers, int) or self.num_workers < 0:
            raise ValueError(f"data_sampling.num_workers must be an int >= 0, got {self.num_workers!r}.")


@dataclass(frozen=True, kw_only=True)
class DataEfficiencyConfig:
    """DeepSpeed's ``data_efficiency`` section, typed. Build it with `from_dict` to port a DeepSpeed config.

    Raises:
        ValueError: If ``seed`` is negative.
    """

    enabled: bool = False
    """DeepSpeed's master switch (informational here)."""
    seed: int = 1234
    """Seed of every random choice of the sampler."""
    data_sampling: DataSamplingConfig = field(default_factory=DataSamplingConfig)
    """Sampling settings."""

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"data_efficiency.seed must be an int >= 0, got {self.seed!r}.")

    @property
    def curriculum(self) -> CurriculumLearningConfig:
        """Shortcut for ``data_sampling.curriculum_learning``."""
        return self.data_sampling.curriculum_learning

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> DataEfficiencyConfig:
        """Parses DeepSpeed's ``data_efficiency`` dict (or a whole DeepSpeed config containing it).

        Raises:
            ValueError: For an unknown key (named, with a suggestion), a missing required key, or a bad value;
                or if ``dynamic_batching`` / ``data_routing`` is enabled (not implemented by zlightning).
        """
        if isinstance(config, Mapping) and "data_efficiency" in config:
            config = config["data_efficiency"]
        _check_keys(config, {"enabled", "seed", "data_sampling", "data_routing"}, "data_efficiency")
        _refuse_enabled(config.get("data_routing"), "data_efficiency.data_routing")
        ds = config.get("data_sampling", {})
        _check_keys(
            ds,
            {"enabled", "num_epochs", "num_workers", "pin_memory", "curriculum_learning", "dynamic_batching"},
            "data_efficiency.data_sampling",
        )
        _refuse_enabled(ds.get("dynamic_batching"), "data_efficiency.data_sampling.dynamic_batching")
        return cls(
            enabled=_check_bool(config.get("enabled", False), "data_efficiency.enabled"),
            seed=config.get("seed", 1234),
            data_sampling=DataSamplingConfig(
                enabled=_check_bool(ds.get("enabled", False), "data_sampling.enabled"),
                num_epochs=ds.get("num_epochs", 1000),
                num_workers=ds.get("num_workers", 0),
                pin_memory=_check_bool(ds.get("pin_memory", False), "data_sampling.pin_memory"),
                curriculum_learning=_parse_curriculum(ds.get("curriculum_learning", {})),
            ),
        )


def _refuse_enabled(section: Any, where: str) -> None:
    if section is not None and isinstance(section, Mapping) and section.get("enabled", False):
        raise ValueError(f"{where}.enabled=true is not supported by zlightning; set it to false or remove the section.")


def _parse_curriculum(cl: Mapping[str, Any]) -> CurriculumLearningConfig:
    where = "data_efficiency.data_sampling.curriculum_learning"
    _check_keys(cl, {"enabled", "data_cluster_path", "curriculum_metrics"}, where)
    metrics = cl.get("curriculum_metrics", {}) or {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}.curriculum_metrics must be a dict of metric name -> settings, got {metrics!r}.")
    return CurriculumLearningConfig(
        enabled=_check_bool(cl.get("enabled", False), f"{where}.enabled"),
        data_cluster_path=cl.get("data_cluster_path"),
        curriculum_metrics={
            name: CurriculumMetricConfig.from_dict(m, f"{where}.curriculum_metrics.{name}")
            for name, m in metrics.items()
        },
    )
