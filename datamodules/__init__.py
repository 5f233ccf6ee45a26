"""Data components of zlightning, imported as ``zlightning.datamodules``.

Three DataModules and what they are built from:

* `TextCorpusDataModule`: byte-level language-model data from a real corpus that exists on every machine (the Python
  standard library's source) or from any directory of text files (``text.py``).
* `CurriculumDataModule`: a curriculum over any DataModule, sampled by `DeepSpeedDataSampler` and configured by
  `DataEfficiencyConfig`; the subpackage ``zlightning.datamodules.curriculum``.
* `HybridCPTextDataModule`: the corpus's documents balanced over data×context-parallel ranks by
  `HybridCPDataLoaderWrapper`, configured by `HybridCPConfig`; the subpackage ``zlightning.datamodules.hybrid_cp``
  (the model side, CP attention, is `zlightning.parallel`).

DeepSpeed's and Megatron's names are kept and mean what they mean upstream: DeepSpeed's data-efficiency
`DeepSpeedDataSampler`, `CurriculumScheduler`, `DataAnalyzer` and `DistributedDataAnalyzer` (same arguments,
methods, ``data_efficiency`` config keys and sampler state), and Megatron-core's `HybridCPDataLoaderWrapper` and
`BalancedCPScheduler` (same calls and return shapes). ``tests/test_seed_api_deepspeed.py`` and
``tests/test_seed_api_megatron.py`` call them as upstream code does.

Names kept for compatibility: every other name this package exported before the subpackages existed is still an
attribute of it (e.g. ``from zlightning.datamodules import IndexFile, schedule_hybrid_cp, cp_attention``), but is not
in ``__all__``; new code imports it from its home: ``zlightning.datamodules.curriculum``,
``zlightning.datamodules.hybrid_cp``, ``zlightning.parallel`` (CP attention), ``zlightning.models.gpt_hybrid_cp``
(``gpt_cp_logits``, ``gpt_cp_loss``: the example GPT's CP forward, loaded on first use) or
``zlightning.datamodules.text``.
"""

from __future__ import annotations

import importlib
from typing import Any

# Names kept for compatibility (see the module docs); the `X as X` form marks them as deliberate re-exports.
from zlightning.parallel import CPShard as CPShard
from zlightning.parallel import HybridCPGroups as HybridCPGroups
from zlightning.parallel import cp_attention as cp_attention
from zlightning.parallel import cp_causal_attention as cp_causal_attention

from .curriculum import (
    CurriculumDataModule,
    CurriculumScheduler,
    DataAnalyzer,
    DataEfficiencyConfig,
    DeepSpeedDataSampler,
    DistributedDataAnalyzer,
)
from .curriculum import CurriculumMetricConfig as CurriculumMetricConfig
from .curriculum import CurriculumSchedule as CurriculumSchedule
from .curriculum import IndexFile as IndexFile
from .curriculum import MetricSpec as MetricSpec
from .curriculum import difficulty_at as difficulty_at
from .curriculum import read_deepspeed_sampler_state as read_deepspeed_sampler_state
from .curriculum import write_metric_index as write_metric_index
from .hybrid_cp import BalancedCPScheduler, HybridCPConfig, HybridCPDataLoaderWrapper, HybridCPTextDataModule
from .hybrid_cp import CostFn as CostFn
from .hybrid_cp import HybridCPBatch as HybridCPBatch
from .hybrid_cp import HybridCPSubSample as HybridCPSubSample
from .hybrid_cp import LinearQuadraticCost as LinearQuadraticCost
from .hybrid_cp import PackedDocumentDataset as PackedDocumentDataset
from .hybrid_cp import ScheduleStats as ScheduleStats
from .hybrid_cp import TransformerShape as TransformerShape
from .hybrid_cp import cp_size_needed as cp_size_needed
from .hybrid_cp import fit_cost as fit_cost
from .hybrid_cp import hybrid_cp_forward_backward as hybrid_cp_forward_backward
from .hybrid_cp import quadratic_cost as quadratic_cost
from .hybrid_cp import schedule_hybrid_cp as schedule_hybrid_cp
from .hybrid_cp import schedule_stats as schedule_stats
from .hybrid_cp import transformer_cost as transformer_cost
from .hybrid_cp import unpack_packed_batch as unpack_packed_batch
from .hybrid_cp import zigzag_shard as zigzag_shard
from .text import BYTE_VOCAB_SIZE as BYTE_VOCAB_SIZE
from .text import PackedByteDataset as PackedByteDataset
from .text import TextCorpusDataModule
from .text import corpus_files as corpus_files

__all__ = [
    "BalancedCPScheduler",
    "CurriculumDataModule",
    "CurriculumScheduler",
    "DataAnalyzer",
    "DataEfficiencyConfig",
    "DeepSpeedDataSampler",
    "DistributedDataAnalyzer",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPTextDataModule",
    "TextCorpusDataModule",
]

_EXAMPLE_GPT_HELPERS = frozenset({"gpt_cp_logits", "gpt_cp_loss"})
"""Kept for compatibility too: the example GPT's CP forward and loss live with the example GPT in
``zlightning.models.gpt_hybrid_cp``, which imports this package, so they are imported on first use."""


def __getattr__(name: str) -> Any:
    if name in _EXAMPLE_GPT_HELPERS:
        return getattr(importlib.import_module("zlightning.models.gpt_hybrid_cp"), name)
    raise AttributeError(f"module 'zlightning.datamodules' has no attribute {name!r}")
