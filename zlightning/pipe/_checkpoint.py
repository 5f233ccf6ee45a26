"""Per-stage checkpoints of a ``PipelineEngine``: one file per layer (so a checkpoint reloads with another stage
count), one optimizer file per rank, and consolidation into the plain state dict of a one-stage ``PipelineModule``.

Layout of a checkpoint directory::

    meta.pt                          split, grid, tie keys, format version (written by global rank 0)
    layer_{idx:03d}-model_states.pt  state dict of layer idx (written by data-parallel rank 0 of its stage)
    tied_{key}-model_states.pt       a tie group's module (written by its lowest owning stage)
    optim_pp{stage:02d}_dp{dp:02d}.pt  optimizer state of that rank (ZeRO-1: only its own parameters' state)
    client_state.pt                  anything else (Lightning's loop state), from global rank 0

Like the ZeRO checkpoints (``zlightning.zero``), every rank writes only what it owns and no rank gathers the model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zlightning.pipe._engine import PipelineEngine

__all__ = ["consolidate_pipeline_checkpoint", "is_pipeline_checkpoint", "load_pipeline_checkpoint", "save_pipeline_checkpoint"]

_FORMAT = "zlightning-pipeline-v1"


def is_pipeline_checkpoint(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / "meta.pt").is_file() and any(Path(path).glob("layer_*-model_states.pt"))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _local_layers(engine: PipelineEngine) -> list[int]:
    module = engine.module
    return [i for s in module.local_stages for i in module.stage_layers(s) if str(i) in module._modules]


def save_pipeline_checkpoint(
    engine: PipelineEngine, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None, client_state: dict[str, Any] | None = None
) -> None:
    """Writes ``engine``'s model (and ``optimizer``, default ``engine.optimizer``) to directory ``path``. Collective."""
    path = Path(path)
    grid, module = engine.grid, engine.module
    if grid.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    path.mkdir(parents=True, exist_ok=True)
    if grid.dp_rank == 0:
        for idx in _local_layers(engine):
            torch.save(module.get_submodule(str(idx)).state_dict(), path / f"layer_{idx:03d}-model_states.pt")
        for key, src in engine.groups.tied_src.items():
            if src == grid.rank:
                torch.save(module.tied_modules[key].state_dict(), path / f"tied_{key}-model_states.pt")
    optimizer = optimizer if optimizer is not None else engine.optimizer
    if optimizer is not None:
        torch.save(optimizer.state_dict(), path / f"optim_pp{grid.stage:02d}_dp{grid.dp_rank:02d}.pt")
    if grid.rank == 0:
        meta = {"format": _FORMAT, "bounds": module.bounds, "pp": grid.pp, "dp": grid.dp, "num_layers": len(module.specs),
                "zero_stage": engine.config.zero_stage}
        torch.save(meta, path / "meta.pt")
        torch.save(client_state or {}, path / "client_state.pt")
    _barrier()


def _read_meta(path: Path) -> dict[str, Any]:
    if not (path / "meta.pt").is_file():
        raise FileNotFoundError(f"{path} is not a zlightning pipeline checkpoint (no meta.pt)")
    meta = torch.load(path / "meta.pt", weights_only=True)
    if meta.get("format") != _FORMAT:
        raise ValueError(f"{path}: unknown pipeline checkpoint format {meta.get('format')!r}; expected {_FORMAT!r}")
    return meta


def load_pipeline_checkpoint(
    engine: PipelineEngine, path: str | os.PathLike[str], optimizer: torch.optim.Optimizer | None = None, load_optimizer: bool = True
) -> dict[str, Any]:
    """Loads the layers this rank holds (any earlier stage count works for the model) and, with the same grid, its
    optimizer state. Re-broadcasts tied weights. Returns the client state.

    Raises:
        ValueError: the checkpoint has another layer count, or optimizer state was saved on a different grid.
    """
    path = Path(path)
    meta = _read_meta(path)
    grid, module = engine.grid, engine.module
    if meta["num_layers"] != len(module.specs):
        raise ValueError(f"{path} holds {meta['num_layers']} layers but the PipelineModule has {len(module.specs)}")
    for idx in _local_layers(engine):
        module.get_submodule(str(idx)).load_state_dict(torch.load(path / f"layer_{idx:03d}-model_states.pt", map_location=engine.device, weights_only=True))
    for key in module.tied_modules:
        module.tied_modules[key].load_state_dict(torch.load(path / f"tied_{key}-model_states.pt", map_location=engine.device, weights_only=True))
    optimizer = optimizer if optimizer is not None else engine.optimizer
    if optimizer is not None and load_optimizer:
        same = meta["pp"] == grid.pp and meta["dp"] == grid.dp and meta["bounds"] == module.bounds
        if not same:
            raise ValueError(
                f"{path}: optimizer state was saved on a {meta['pp']} x {meta['dp']} grid with split {meta['bounds']}; "
                f"this run is {grid.pp} x {grid.dp} with split {module.bounds}. Load with load_optimizer=False "
                "(weights only) to change the grid"
            )
        osd = torch.load(path / f"optim_pp{grid.stage:02d}_dp{grid.dp_rank:02d}.pt", map_location=engine.device, weights_only=False)
        optimizer.load_state_dict(osd)
    engine._sync_replicas()
    return torch.load(path / "client_state.pt", weights_only=False)


def consolidate_pipeline_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """One plain state dict with the names of a one-stage ``PipelineModule`` (``"{idx}.{param}"`` and
    ``"tied_modules.{key}.{param}"``), loadable with ``PipelineModule(...).build().load_state_dict``. No process group
    needed."""
    path = Path(path)
    meta = _read_meta(path)
    out: dict[str, torch.Tensor] = {}
    for idx in range(meta["num_layers"]):
        f = path / f"layer_{idx:03d}-model_states.pt"
        if f.is_file():
            for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
                out[f"{idx}.{k}"] = v
    for f in sorted(path.glob("tied_*-model_states.pt")):
        key = f.name[len("tied_") : -len("-model_states.pt")]
        for k, v in torch.load(f, map_location="cpu", weights_only=True).items():
            out[f"tied_modules.{key}.{k}"] = v
    return out

