"""The model summary of a sharded run: the full model's parameter counts, and beside them what each rank holds.

[Note: counting a sharded model]
Lightning computes its summary at the start of fit, after the strategy's ``setup``: under ``zstack_zero3`` every
parameter is then this rank's 1-D piece (a 95.9 K-parameter model showed "Total params: 48.0 K" at 2 ranks, a layer
whose pieces all fell on the other rank showed 0), and under ``zstack_pipeline`` the module holds only this rank's
stage. The counts here are those of the unsharded model:

- ZeRO (``zlightning.zero``): each piece is looked up in its engine (``ZeroState.zero_param_of``), which keeps the
  full shape and master dtype of every parameter; tied parameters are one ``ZeroParam`` and count once. The engine's
  state is only read, never changed (no gather, no stand-ins), so the summary can run between any two steps.
- Pipeline (``zlightning.pipe``): every layer's count comes from its spec (a ``LayerSpec`` is built on the meta
  device, as partitioning does; an ``nn.Module`` layer is counted as given, through its ZeRO engine when this rank
  shards it), so stages on other ranks are counted too; a tie group counts once in the total. Which parameters are
  frozen (a module's ``setup`` hook may freeze layers by name) and what each rank holds come from one small
  ``all_gather_object`` over the world, so every rank must call `summary_table` (every rank runs ``on_fit_start``).

No forward pass runs (Lightning runs ``example_input_array`` through the model for FLOPs and sizes; on sharded
modules that would gather every unit), so there is no FLOPs column, and no precision warning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

__all__ = ["SummaryTable", "summary_table"]

_Numel = Callable[[torch.Tensor], tuple[int, int]]
"""(elements, bytes) of a parameter before sharding."""


@dataclasses.dataclass(frozen=True)
class SummaryTable:
    """What the model summary prints."""

    columns: tuple[tuple[str, tuple[str, ...]], ...]
    """(header, cells) per column; one cell per layer row."""
    total: int
    """Parameters of the full model (tied ones once)."""
    trainable: int
    """Of ``total``, those that require grad."""
    size_bytes: int
    """Bytes of the full model's parameters in their master dtypes."""
    modes: tuple[int, int] | None
    """Modules in train mode and in eval mode (None where not counted)."""
    held: tuple[str, ...]
    """Lines on what each rank holds after sharding (empty for an unsharded model)."""

    def render(self) -> str:
        """The table in the layout of Lightning's ``ModelSummary``, then the totals and the lines of ``held``."""
        widths = [max([len(h), *(len(c) for c in cells)]) for h, cells in self.columns]
        rows = len(self.columns[0][1]) if self.columns else 0
        line = "-" * (sum(widths) + 3 * len(widths))
        out = [" | ".join(f"{h:<{w}}" for (h, _), w in zip(self.columns, widths)), line]
        out += [" | ".join(f"{c[i]:<{w}}" for (_, c), w in zip(self.columns, widths)) for i in range(rows)]
        out.append(line)
        totals = [
            (get_human_readable_count(self.trainable), "Trainable params"),
            (get_human_readable_count(self.total - self.trainable), "Non-trainable params"),
            (get_human_readable_count(self.total), "Total params"),
            (f"{self.size_bytes / 1e6:,.3f}", "Total estimated model params size (MB)"),
        ]
        if self.modes is not None:
            totals += [(str(self.modes[0]), "Modules in train mode"), (str(self.modes[1]), "Modules in eval mode")]
        out += [f"{value:<10}{label}" for value, label in totals]
        return "\n".join(out + list(self.held))


def summary_table(trainer: pl.Trainer, pl_module: pl.LightningModule, max_depth: int) -> SummaryTable:
    """The summary of ``pl_module``'s full model (see [Note: counting a sharded model]).

    Collective under ``zstack_pipeline`` (one ``all_gather_object``): every rank calls it.

    Args:
        trainer: the Trainer running ``fit``.
        pl_module: the module being fitted.
        max_depth: layer nesting shown, as Lightning's ``ModelSummary(max_depth=...)`` (-1: all).
    """
    pipe_engine = _pipeline_engine(trainer)
    if pipe_engine is not None:
        return _pipeline_table(trainer, pipe_engine)
    return _module_table(trainer, pl_module, max_depth)


# ---------------------------------------------------------------------------------------------- any module, ZeRO
def _module_table(trainer: pl.Trainer, pl_module: pl.LightningModule, max_depth: int) -> SummaryTable:
    from zlightning.zero import engine_of

    engine = engine_of(pl_module)
    numel = _full_numel([engine] if engine is not None else [])
    layers = _named_layers(pl_module, max_depth)
    counts = [sum(numel(p)[0] for p in m.parameters()) for _, m in layers]
    unique = list({id(p): p for p in pl_module.parameters()}.values())
    total = sum(numel(p)[0] for p in unique)
    columns: list[tuple[str, list[str]]] = [
        (" ", [str(i) for i in range(len(layers))]),
        ("Name", [n for n, _ in layers]),
        ("Type", [type(m).__name__ for _, m in layers]),
        ("Params", [get_human_readable_count(c) for c in counts]),
        ("Mode", ["train" if m.training else "eval" for _, m in layers]),
    ]
    leftover = total - sum(counts)
    if leftover > 0:  # parameters held by the LightningModule itself
        for (_, cells), cell in zip(columns, (" ", "other params", "n/a", get_human_readable_count(leftover), "n/a")):
            cells.append(cell)
    modes = [m.training for m in list(pl_module.modules())[1:]]
    return SummaryTable(
        columns=tuple((h, tuple(c)) for h, c in columns),
        total=total,
        trainable=sum(numel(p)[0] for p in unique if p.requires_grad),
        size_bytes=sum(numel(p)[1] for p in unique),
        modes=(modes.count(True), modes.count(False)),
        held=tuple(_zero_held(trainer, engine, total)) if engine is not None else (),
    )


def _named_layers(module: nn.Module, max_depth: int) -> list[tuple[str, nn.Module]]:
    """The rows of Lightning's summary: the children at depth 1, nested modules down to ``max_depth`` (-1: all)."""
    if max_depth == 0:
        return []
    if max_depth == 1:
        return list(module.named_children())
    named = list(module.named_modules())[1:]
    return [(n, m) for n, m in named if max_depth < 0 or n.count(".") < max_depth]


def _full_numel(engines: Iterable[Any]) -> _Numel:
    """(elements, bytes) before sharding: a piece of a ZeRO engine counts as its full parameter."""
    found = list(engines)

    def numel(p: torch.Tensor) -> tuple[int, int]:
        for engine in found:
            zp = engine.zero_param_of(p)
            if zp is not None:
                return zp.numel, zp.numel * zp.dtype.itemsize
        return p.numel(), p.numel() * p.element_size()

    return numel


def _zero_held(trainer: pl.Trainer, engine: Any, total: int) -> list[str]:
    """The line on what rank 0 holds under ``zstack_zero3`` (and its stage 1/2 names)."""
    strategy = trainer.strategy
    report_fn = getattr(strategy, "memory_report", None)
    if report_fn is None:
        return []
    try:
        report = report_fn()
    except RuntimeError:
        return []
    stage = engine.config.stage
    offload = engine.config.offload_optimizer
    where = f", optimizer state offloaded ({type(offload).__name__})" if offload is not None else ""
    tp = getattr(strategy, "tensor_parallel_size", 1)
    per_slice = f" (counts of one tensor-parallel slice of {tp})" if tp > 1 else ""
    # every registered strategy class sets strategy_name; Lightning's Strategy base does not declare it
    name: str = getattr(strategy, "strategy_name", type(strategy).__name__)
    head = f"Held per rank after sharding ({name}, ZeRO stage {stage}, {trainer.world_size} ranks){per_slice}: "
    if stage == 3:
        held = sum(zp.local_numel for zp in engine.params)
        what = (
            f"this rank holds {get_human_readable_count(held).strip()} of the "
            f"{get_human_readable_count(total).strip()} parameters ({report.param_bytes / 1e6:,.3f} of "
            f"{report.full_model_bytes / 1e6:,.3f} MB); gradients and optimizer state are sharded alike"
        )
    else:
        sharded = "optimizer state" if stage == 1 else "gradients and optimizer state"
        what = f"this rank holds all {get_human_readable_count(total).strip()} parameters; {sharded} are sharded"
    return [f"{head}{what}{where} (largest unit gathered: {report.largest_unit_bytes / 1e6:,.3f} MB)"]


# ---------------------------------------------------------------------------------------------- pipeline
def _pipeline_engine(trainer: pl.Trainer) -> Any:
    from zlightning.pipe import PipelineEngine

    engine = getattr(trainer.strategy, "engine", None)
    return engine if isinstance(engine, PipelineEngine) else None


def _pipeline_table(trainer: pl.Trainer, engine: Any) -> SummaryTable:
    from zlightning.pipe import LayerSpec, TiedLayerSpec

    pipe = engine.module
    bounds: list[int] = pipe.bounds
    stage_of = {i: s for s in range(len(bounds) - 1) for i in range(bounds[s], bounds[s + 1])}
    zero_states = engine.zero.states if engine.zero is not None else []
    numel = _full_numel(zero_states)
    mine = _local_report(pipe, zero_states)
    reports = [mine]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        reports = [{} for _ in range(torch.distributed.get_world_size())]
        torch.distributed.all_gather_object(reports, mine)
    frozen: dict[int, set[str]] = {}
    for report in reports:
        for idx, names in report["frozen"].items():
            frozen.setdefault(idx, set()).update(names)
    prefix = _attribute_name(trainer.lightning_module, pipe)
    rows: list[tuple[str, str, int, int]] = []  # name, type, params, stage
    total = trainable = size = 0
    counted: set[str] = set()
    for idx, spec in enumerate(pipe.specs):
        module = spec.build("meta") if isinstance(spec, LayerSpec) else spec if isinstance(spec, nn.Module) else None
        params = dict(module.named_parameters()) if module is not None else {}
        sizes = {n: numel(p) for n, p in params.items()}
        count = sum(e for e, _ in sizes.values())
        kind = getattr(spec, "typename", type(spec)).__name__ if module is not None else _callable_name(spec)
        if isinstance(spec, TiedLayerSpec):
            kind = f"{kind} (tied: {spec.key})"
        rows.append((f"{prefix}.{idx}", kind, count, stage_of[idx]))
        key = spec.key if isinstance(spec, TiedLayerSpec) else f"#{idx}"
        if key in counted:
            continue
        counted.add(key)
        total += count
        size += sum(b for _, b in sizes.values())
        off = frozen.get(idx, set())
        trainable += sum(e for n, (e, _) in sizes.items() if n not in off and params[n].requires_grad)
    columns = (
        (" ", tuple(str(i) for i in range(len(rows)))),
        ("Name", tuple(r[0] for r in rows)),
        ("Type", tuple(r[1] for r in rows)),
        ("Params", tuple(get_human_readable_count(r[2]) for r in rows)),
        ("Stage", tuple(str(r[3]) for r in rows)),
    )
    held = _pipeline_held(trainer, engine, reports)
    return SummaryTable(columns, total, trainable, size, None, held)


def _local_report(pipe: Any, zero_states: list[Any]) -> dict[str, Any]:
    """This rank's share of the pipeline summary: its stages, the parameter elements it holds now (ZeRO-3 pieces,
    tensor-parallel slices) and, per local layer, the names of its frozen parameters."""
    from zlightning.pipe import TiedLayerSpec

    pieces = {id(zp.piece): zp.local_numel for state in zero_states for zp in state.params}
    unique = {id(p): p for p in pipe.parameters()}
    held = sum(pieces.get(i, p.numel()) for i, p in unique.items())
    frozen: dict[int, list[str]] = {}
    for s in pipe.local_stages:
        for idx in pipe.stage_layers(s):
            spec = pipe.specs[idx]
            module = pipe.tied_modules[spec.key] if isinstance(spec, TiedLayerSpec) else pipe.local_layer(idx)
            if module is not None:
                frozen[idx] = [n for n, p in module.named_parameters() if not p.requires_grad]
    return {"stages": tuple(pipe.local_stages), "held": held, "frozen": frozen}


def _pipeline_held(trainer: pl.Trainer, engine: Any, reports: list[dict[str, Any]]) -> tuple[str, ...]:
    by_stages: dict[tuple[int, ...], int] = {}
    for report in reports:
        by_stages[report["stages"]] = max(by_stages.get(report["stages"], 0), report["held"])
    grid = engine.grid
    parts = [
        f"stage{'s' if len(stages) > 1 else ''} {','.join(map(str, stages))}: {get_human_readable_count(held).strip()}"
        for stages, held in sorted(by_stages.items())
    ]
    tp = f" x {grid.tp} tensor-parallel" if grid.tp > 1 else ""
    name: str = getattr(trainer.strategy, "strategy_name", type(trainer.strategy).__name__)
    return (
        f"Held per rank after sharding ({name}, {grid.pp} pipeline ranks x {grid.dp} data-parallel{tp}, ZeRO stage "
        f"{engine.config.zero_stage}): parameters per rank by stage: {'; '.join(parts)}",
    )


def _attribute_name(root: nn.Module | None, target: nn.Module) -> str:
    """Where ``target`` sits in ``root`` (without ``named_modules``, which would build an unclaimed pipeline)."""
    stack = [("", root)] if root is not None else []
    while stack:
        prefix, module = stack.pop()
        for name, child in module._modules.items():
            path = f"{prefix}.{name}" if prefix else name
            if child is target:
                return path
            if child is not None:
                stack.append((path, child))
    return "pipe"


def _callable_name(layer: Any) -> str:
    return getattr(layer, "__name__", type(layer).__name__)
