"""Data components of zlightning, imported as ``zlightning.datamodules``.

`TextCorpusDataModule` trains byte-level language models on a real corpus that exists on every machine (the Python
standard library's source) or on any directory of text files; `PackedByteDataset` packs documents into fixed-length
next-token samples and keeps the document boundaries.
"""

from .text import BYTE_VOCAB_SIZE, PackedByteDataset, TextCorpusDataModule, corpus_files

__all__ = ["BYTE_VOCAB_SIZE", "PackedByteDataset", "TextCorpusDataModule", "corpus_files"]

# Curriculum data pipeline (issue 4): DeepSpeed's data-efficiency curriculum, typed, resumable and DP-safe.
from .curriculum_analyzer import DataAnalyzer, MetricSpec, write_metric_index
from .curriculum_analyzer_dist import DistributedDataAnalyzer
from .curriculum_config import CurriculumMetricConfig, DataEfficiencyConfig
from .curriculum_ds_state import read_deepspeed_sampler_state
from .curriculum_index import IndexFile
from .curriculum_module import CurriculumDataModule
from .curriculum_sampler import DeepSpeedDataSampler
from .curriculum_schedule import CurriculumSchedule, CurriculumScheduler, difficulty_at

__all__ += [
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
    "read_deepspeed_sampler_state",
    "write_metric_index",
]

# Hybrid context parallel (issue 8): the balanced DP×CP scheduler and the loader wrapper that reroutes sub-samples.
from .hybrid_cp_schedule import (
    CostFn,
    ScheduleStats,
    cp_size_needed,
    quadratic_cost,
    schedule_hybrid_cp,
    schedule_stats,
)
from .hybrid_cp_wrapper import (
    HybridCPBatch,
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    HybridCPSubSample,
    unpack_packed_batch,
    zigzag_shard,
)

__all__ += [
    "CostFn",
    "HybridCPBatch",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPSubSample",
    "ScheduleStats",
    "cp_size_needed",
    "quadratic_cost",
    "schedule_hybrid_cp",
    "schedule_stats",
    "unpack_packed_batch",
    "zigzag_shard",
]

# Hybrid CP (issue 8): context-parallel attention for the example GPT, and the per-sub-sample training loop.
from .hybrid_cp_attention import CPShard, HybridCPGroups, cp_attention, cp_causal_attention
from .hybrid_cp_model import gpt_cp_logits, gpt_cp_loss, hybrid_cp_forward_backward

__all__ += [
    "CPShard",
    "HybridCPGroups",
    "cp_attention",
    "cp_causal_attention",
    "gpt_cp_logits",
    "gpt_cp_loss",
    "hybrid_cp_forward_backward",
]

# Hybrid CP (issue 8): shape-derived / measured cost models, and the DataModule option over the real corpus.
from .hybrid_cp_cost import LinearQuadraticCost, TransformerShape, fit_cost, transformer_cost
from .hybrid_cp_data import HybridCPTextDataModule, PackedDocumentDataset

__all__ += [
    "HybridCPTextDataModule",
    "LinearQuadraticCost",
    "PackedDocumentDataset",
    "TransformerShape",
    "fit_cost",
    "transformer_cost",
]
