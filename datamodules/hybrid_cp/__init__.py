"""Hybrid data×context parallelism on the data side: balance variable-length sub-samples over the DP×CP ranks.

Megatron-core's names are kept, so Megatron code ports unchanged: `HybridCPDataLoaderWrapper` (same call, methods
and returns) and `BalancedCPScheduler`. The pieces, one module each:

* scheduling: `schedule_hybrid_cp` gives every sub-sample of a global batch a power-of-two CP size and an aligned
  block of ranks (a pure function, ``_schedule.py``); `schedule_stats` measures a schedule;
* cost models for the scheduler: `transformer_cost` (`TransformerShape`), `fit_cost` from measurements, or any
  `CostFn` (``_cost.py``);
* the loader: `HybridCPDataLoaderWrapper` (`HybridCPConfig`) unpacks, schedules and reroutes sub-samples and returns
  a `HybridCPBatch` of `HybridCPSubSample` objects; `zigzag_shard` gives a rank its part of one (``_wrapper.py``);
* Lightning: `HybridCPTextDataModule` over the real corpus (`PackedDocumentDataset`, ``_datamodule.py``);
* training: `hybrid_cp_forward_backward` runs a rank's sub-samples, `global_token_count` normalises the loss
  (``_loop.py``).

The model side (CP attention, its process groups) is `zlightning.parallel`; the example GPT's CP forward is
``zlightning.models.gpt_hybrid_cp``. Also importable here, for code written against the flat
``zlightning.datamodules`` of earlier versions: `ScheduleStats`, `cp_size_needed`, `quadratic_cost`,
`LinearQuadraticCost`, `unpack_packed_batch`, `lockstep_plan`.
"""

# Also importable here (see the module docs); the `X as X` form marks them as deliberate re-exports.
from ._cost import LinearQuadraticCost as LinearQuadraticCost
from ._cost import TransformerShape, fit_cost, transformer_cost
from ._datamodule import HybridCPTextDataModule, PackedDocumentDataset
from ._loop import global_token_count, hybrid_cp_forward_backward
from ._loop import lockstep_plan as lockstep_plan
from ._schedule import BalancedCPScheduler, CostFn, schedule_hybrid_cp, schedule_stats
from ._schedule import ScheduleStats as ScheduleStats
from ._schedule import cp_size_needed as cp_size_needed
from ._schedule import quadratic_cost as quadratic_cost
from ._wrapper import HybridCPBatch, HybridCPConfig, HybridCPDataLoaderWrapper, HybridCPSubSample, zigzag_shard
from ._wrapper import unpack_packed_batch as unpack_packed_batch

__all__ = [
    "BalancedCPScheduler",
    "CostFn",
    "HybridCPBatch",
    "HybridCPConfig",
    "HybridCPDataLoaderWrapper",
    "HybridCPSubSample",
    "HybridCPTextDataModule",
    "PackedDocumentDataset",
    "TransformerShape",
    "fit_cost",
    "global_token_count",
    "hybrid_cp_forward_backward",
    "schedule_hybrid_cp",
    "schedule_stats",
    "transformer_cost",
    "zigzag_shard",
]
