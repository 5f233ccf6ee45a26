"""Pipeline parallelism (Lightning-free): ``PipelineModule`` + ``LayerSpec``/``TiedLayerSpec`` describe the model,
``PipelineEngine`` runs it over a PP x DP (x TP: ``PipelineConfig(tensor_parallel_size=...)``) grid with a simulated
schedule (``train_batch``/``eval_batch``): GPipe, 1F1B, interleaved 1F1B, or the zero-bubble ``zb_h1``/``zbv``, with
ZeRO-1, or ZeRO-2/3 inside the stages (``PipelineConfig(zero_stage=3)``)."""

from zlightning.pipe._checkpoint import (
    consolidate_pipeline_checkpoint,
    load_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from zlightning.pipe._engine import PipelineConfig, PipelineEngine
from zlightning.pipe._module import PipelineModule
from zlightning.pipe._schedule import (
    Action,
    ActionCosts,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
    timeline,
)
from zlightning.pipe._spec import LayerSpec, TiedLayerSpec
from zlightning.pipe._topology import PipeGrid

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "LayerSpec",
    "PipeGrid",
    "PipelineConfig",
    "PipelineEngine",
    "PipelineModule",
    "Schedule",
    "ScheduleError",
    "TiedLayerSpec",
    "build_schedule",
    "consolidate_pipeline_checkpoint",
    "load_pipeline_checkpoint",
    "save_pipeline_checkpoint",
    "simulate",
    "timeline",
]
