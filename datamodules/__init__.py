"""Data components of zlightning, imported as ``zlightning.datamodules``.

`TextCorpusDataModule` trains byte-level language models on a real corpus that exists on every machine (the Python
standard library's source) or on any directory of text files; `PackedByteDataset` packs documents into fixed-length
next-token samples and keeps the document boundaries. The curriculum pipeline is the subpackage ``curriculum``, the
hybrid-CP data path the subpackage ``hybrid_cp``.
"""

from __future__ import annotations

import importlib
from typing import Any

from zlightning.parallel import CPShard, HybridCPGroups, cp_attention, cp_causal_attention

from .curriculum import (
    CurriculumDataModule,
    CurriculumMetricConfig,
    CurriculumSchedule,
    CurriculumScheduler,
    DataAnalyzer,
    DataEfficiencyConfig,
    DeepSpeedDataSampler,
    DistributedDataAnalyzer,
    IndexFile,
    MetricSpec,
    difficulty_at,
    read_deepspeed_sampler_state,
    write_metric_index,
)
from .hybrid_cp import (
    CostFn,
    HybridCPBatch,
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    HybridCPSubSample,
    HybridCPTextDataModule,
    LinearQuadraticCost,
    PackedDocumentDataset,
    ScheduleStats,
    TransformerShape,
    cp_size_needed,
    fit_cost,
    hybrid_cp_forward_backward,
    quadratic_cost,
    schedule_hybrid_cp,
    schedule_stats,
    transformer_cost,
    unpack_packed_batch,
    zigzag_shard,
)
from .text import BYTE_VOCAB_SIZE, PackedByteDataset, TextCorpusDataModule, corpus_files

__all__ = [
    "BYTE_VOCAB_SIZE",
    "CPShard",
    "CostFn",
    "CurriculumDataModule",
    "CurriculumMetricConfig",
    "CurriculumSchedule",
    "CurriculumScheduler",
    "DataAnalyzer",
    "DataEfficiencyConfig",
    "DeepSpeedDataSampler",
    "DistributedDataAnalyzer",
    "HybridCPBatch",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPGroups",
    "HybridCPSubSample",
    "HybridCPTextDataModule",
    "IndexFile",
    "LinearQuadraticCost",
    "MetricSpec",
    "PackedByteDataset",
    "PackedDocumentDataset",
    "ScheduleStats",
    "TextCorpusDataModule",
    "TransformerShape",
    "corpus_files",
    "cp_attention",
    "cp_causal_attention",
    "cp_size_needed",
    "difficulty_at",
    "fit_cost",
    "gpt_cp_logits",
    "gpt_cp_loss",
    "hybrid_cp_forward_backward",
    "quadratic_cost",
    "read_deepspeed_sampler_state",
    "schedule_hybrid_cp",
    "schedule_stats",
    "transformer_cost",
    "unpack_packed_batch",
    "write_metric_index",
    "zigzag_shard",
]

_EXAMPLE_GPT_HELPERS = frozenset({"gpt_cp_logits", "gpt_cp_loss"})
"""The example GPT's CP forward and loss, which live with the example GPT in ``zlightning.models.gpt_hybrid_cp``;
imported on first use (that module imports this package)."""


def __getattr__(name: str) -> Any:
    if name in _EXAMPLE_GPT_HELPERS:
        return getattr(importlib.import_module("zlightning.models.gpt_hybrid_cp"), name)
    raise AttributeError(f"module 'zlightning.datamodules' has no attribute {name!r}")
