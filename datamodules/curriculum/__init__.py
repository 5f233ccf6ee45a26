"""The curriculum data pipeline: DeepSpeed's data-efficiency curriculum, typed, exact-resumable and DP-safe.

DeepSpeed's names and ``data_efficiency`` config keys are kept, so DeepSpeed code ports unchanged:
`DeepSpeedDataSampler` (same arguments, methods and state), `CurriculumScheduler`, `DataAnalyzer`,
`DistributedDataAnalyzer`, and the sampler's helper functions `get_start_end_idx`,
`get_sample_based_on_metric_value` and `get_sample_based_on_metric_percentile`.

The pieces, one module each:

* configuration: `DataEfficiencyConfig` (parsed from DeepSpeed's dict), `CurriculumMetricConfig`;
* schedule: the frozen `CurriculumSchedule`, the pure `difficulty_at(schedule, step)` and the stateful
  `CurriculumScheduler` (``_schedule.py``);
* metric index files: `IndexFile` reads DeepSpeed's memory-mapped format (``_index.py``);
* analysis: `DataAnalyzer`, `DistributedDataAnalyzer` and `MetricSpec` write the index files, `write_metric_index`
  those of one metric from its values (``_analyzer.py``, ``_analyzer_dist.py``; ``zlightning analyze`` on the
  command line, ``_cli.py``);
* sampling: `DeepSpeedDataSampler` (``_sampler.py``); its state in DeepSpeed's checkpoint layout is translated by
  ``_deepspeed_state.py`` (`read_deepspeed_sampler_state` reads a DeepSpeed checkpoint file);
* Lightning: `CurriculumDataModule` (``_datamodule.py``).
"""

from ._analyzer import DataAnalyzer, MetricSpec, write_metric_index
from ._analyzer_dist import DistributedDataAnalyzer
from ._config import CurriculumMetricConfig, DataEfficiencyConfig
from ._datamodule import CurriculumDataModule
from ._deepspeed_state import read_deepspeed_sampler_state
from ._index import IndexFile
from ._sampler import (
    DeepSpeedDataSampler,
    get_sample_based_on_metric_percentile,
    get_sample_based_on_metric_value,
    get_start_end_idx,
)
from ._schedule import CurriculumSchedule, CurriculumScheduler, difficulty_at

__all__ = [
    "CurriculumDataModule",
    "CurriculumMetricConfig",
    "CurriculumSchedule",
    "CurriculumScheduler",
    "DataAnalyzer",
    "DataEfficiencyConfig",
    "DeepSpeedDataSampler",
    "DistributedDataAnalyzer",
    "IndexFile",
    "MetricSpec",
    "difficulty_at",
    "get_sample_based_on_metric_percentile",
    "get_sample_based_on_metric_value",
    "get_start_end_idx",
    "read_deepspeed_sampler_state",
    "write_metric_index",
]
