"""Per-stage checkpoints of a ``PipelineEngine``: one file per layer (so a checkpoint reloads with another stage
count), one optimizer file per rank, and consolidation into the plain state dict of a one-stage ``PipelineModule``.

Layout of a checkpoint directory::

    meta.pt                          split, grid, tie keys, format version (written by global rank 0)
    layer_{idx:03d}-model_states.pt  state dict of layer idx (written by data-parallel rank 0 of its stage)
    tied_{key}-model_states.pt       a tie group's module (written by its lowest owning stage)
    optim_pp{stage:02d}_dp{dp:02d}.pt  optimizer state of that rank (ZeRO-1: only its own parameters' state), with
                                     the model name of each of its parameters
    client_state.pt                  anything else (Lightning's loop state), from global rank 0
    client_objects.pt                only when a hyper-parameter is not plain data: the original values (see
                                     [Note: described hyper-parameters] in ``zlightning/_safe_load.py``)

Every file is read weights-only unless the caller opts in (see [Note: what loading trusts] in
``zlightning/_safe_load.py``); loading reads every file it needs before it changes anything, and consolidation reads
only ``meta.pt`` and the layer files.

With tensor parallelism (``grid.tp > 1``) layer and optimizer files carry the TP index: ``layer_{idx:03d}-tp{t:02d}-
model_states.pt`` (the slices of TP rank ``t``) and ``optim_pp{stage:02d}_dp{dp:02d}_tp{t:02d}.pt``; see
[Note: checkpoints with tensor parallelism].

Like the ZeRO checkpoints (``zlightning.zero``), every rank writes only what it owns and no rank gathers the model.

[Note: optimizer state on another grid]
An optimizer file stores ``{"optimizer": state_dict, "param_names": [...]}``: the name (in a one-stage
``PipelineModule``: ``"{layer}.{param}"`` or ``"tied_modules.{key}.{param}"``) of every parameter, in the order the
optimizer indexes them. Loaded on the grid it was saved on, each rank reads its own file. On another grid (other
stage count, split or data-parallel size) each rank reads every optimizer file, takes the per-parameter state of
the parameters it now holds (with ZeRO-1: only those it now owns) by name, and the hyperparameters of the saved
group each came from; so ZeRO-1 state saved on DP=2 x PP=2 resumes on PP=4 or DP=1 x PP=2 exactly. This needs an
optimizer whose state is per parameter (every ``torch.optim`` optimizer except LBFGS) and the same param-group
layout on both sides. A tied parameter's state is the same on all its owning stages; any copy serves. A group's
hyperparameters (the learning rate an LR scheduler has moved) come from the saved group of one of its parameters,
also when no parameter of the group has per-parameter state on this rank: an optimizer without any (SGD without
momentum), or ZeRO-1 state owned by another replica; the fresh optimizer's values would restart the LR schedule.

[Note: ZeRO-2/3 checkpoints]
Under ``zero_stage`` 2 or 3 each replica holds a slice of its stage. Saving gathers, one collective per engine of the
stage, the full parameters (written as the usual layer and tie files) and the full-shaped optimizer state to
data-parallel replica 0 of each stage, which writes the stage's one optimizer file (``optim_ppSS_dp00.pt``, every
parameter's state with its name); the other replicas write none. Loading always goes through the by-name path of
[Note: optimizer state on another grid] and each rank cuts the full state to its own slice, so such a checkpoint
resumes on any split, replica count and ZeRO stage (0-3), and a ZeRO-0/1 checkpoint resumes under ZeRO-2/3. The
price is the gather: replica 0 of a stage holds that stage's full parameters and optimizer state while saving.

[Note: checkpoints with tensor parallelism]
Under TP each rank holds slices of its layers, written as they are (no gather) with the TP index in the file name;
tied layers are replicated over TP and written once. Beside each layer, ``layer_{idx:03d}-tp_layout.pt`` records how
its split parameters were cut (``{name: (dim, chunks)}``, `zlightning.inject.tp_split_layout`; plain data). With it:

* consolidation merges each parameter's slices (`zlightning.inject.tp_merge`) into the one-stage state dict, reading
  one layer's slices at a time;
* the weights reload on any grid: another TP size, split or stage count, no TP at all, and a checkpoint without TP
  into a TP run. Each rank merges the slices of the layers it holds and cuts its own slice by its own model's layout
  (a layer split differently in the new run, or replicated there, is cut as the new run needs).

The optimizer state reloads on the same pipeline split and TP size (the data-parallel size may change only with the
same ZeRO stage at DP 1); on another TP grid it raises ``NotImplementedError`` naming ``load_optimizer=False``, since
regridding optimizer state by parameter name cannot tell TP slices apart. Checkpoints written before layouts were
recorded reload only on their own grid and do not consolidate (the error says so).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zlightning._safe_load import LIGHTNING_OPT_IN, join_client_state, load_file, split_client_state
from zlightning.inject import tp_merge, tp_slice, tp_split_layout
from zlightning.pipe._engine import PipelineEngine

__all__ = [
    "consolidate_pipeline_checkpoint",
    "is_pipeline_checkpoint",
    "load_pipeline_checkpoint",
    "save_pipeline_checkpoint",
]

_FORMAT = "zlightning-pipeline-v1"
_OPTIM_RE = re.compile(r"^optim_pp(\d+)_dp(\d+)\.pt$")
_LOAD_OPT_IN = f"{LIGHTNING_OPT_IN}, or load_pipeline_checkpoint(..., weights_only=False)"
_CONSOLIDATE_OPT_IN = (
    "zlightning consolidate --unsafe-load, or consolidate_pipeline_checkpoint(..., weights_only=False)"
)


def is_pipeline_checkpoint(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / "meta.pt").is_file() and any(Path(path).glob("layer_*-model_states.pt"))


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _local_layers(engine: PipelineEngine) -> list[int]:
    module = engine.module
    return [i for s in module.local_stages for i in module.stage_layers(s) if str(i) in module._modules]


def _layer_file(idx: int, tp: int, tp_rank: int) -> str:
    return f"layer_{idx:03d}-model_states.pt" if tp == 1 else f"layer_{idx:03d}-tp{tp_rank:02d}-model_states.pt"


def _optim_file(stage: int, dp_rank: int, tp: int, tp_rank: int) -> str:
    tail = "" if tp == 1 else f"_tp{tp_rank:02d}"
    return f"optim_pp{stage:02d}_dp{dp_rank:02d}{tail}.pt"


def _layout_file(idx: int) -> str:
    return f"layer_{idx:03d}-tp_layout.pt"


def _same_tp_grid(engine: PipelineEngine, meta: dict[str, Any]) -> bool:
    saved, tp = meta.get("tp", 1), engine.grid.tp
    if saved == tp == 1:
        return True
    return saved == tp and meta["pp"] == engine.grid.pp and meta["bounds"] == engine.module.bounds


def _check_tp(engine: PipelineEngine, path: Path, meta: dict[str, Any], load_optimizer: bool) -> None:
    """See [Note: checkpoints with tensor parallelism]."""
    if _same_tp_grid(engine, meta):
        return
    saved, tp = meta.get("tp", 1), engine.grid.tp
    where = (
        f"{path} was saved with tensor_parallel_size={saved} on {meta['pp']} stages (split {meta['bounds']}); this run "
        f"has tensor_parallel_size={tp} on {engine.grid.pp} stages (split {engine.module.bounds})"
    )
    if saved > 1 and not (path / _layout_file(_first_layer_with_file(path, meta))).is_file():
        raise NotImplementedError(
            f"{where}. It was written before checkpoints recorded how layers are split (no *-tp_layout.pt files), so "
            "it reloads only on its own grid; load it there and save it again"
        )
    if load_optimizer and engine.optimizer is not None:
        raise NotImplementedError(
            f"{where}. The weights reload on this grid, the optimizer state does not (it cannot be regridded across "
            "tensor-parallel slices): load with load_optimizer=False (in Lightning, load the weights in "
            "configure_model or on_fit_start and start a fresh fit)"
        )


def _first_layer_with_file(path: Path, meta: dict[str, Any]) -> int:
    tp = meta.get("tp", 1)
    return next((i for i in range(meta["num_layers"]) if (path / _layer_file(i, tp, 0)).is_file()), 0)


def _merged_layer(path: Path, idx: int, meta: dict[str, Any], load: Any) -> dict[str, torch.Tensor] | None:
    """Layer ``idx``'s full state dict from a checkpoint with any TP size (None: the layer has no file)."""
    tp = meta.get("tp", 1)
    if tp == 1:
        f = path / _layer_file(idx, 1, 0)
        return load(f) if f.is_file() else None
    files = [path / _layer_file(idx, tp, t) for t in range(tp)]
    if not files[0].is_file():
        return None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: layer {idx} is missing the slices {missing} (tensor_parallel_size={tp})")
    layout_path = path / _layout_file(idx)
    if not layout_path.is_file():
        raise NotImplementedError(
            f"{path} holds tensor-parallel slices (tensor_parallel_size={tp}) written before checkpoints recorded how "
            f"layers are split (no {layout_path.name}); they cannot be put together. Load the checkpoint on its own "
            "grid and save it again, or gather in the running job with zlightning.inject.tp_full_state"
        )
    layout = load(layout_path)
    slices = [load(f) for f in files]
    return {k: tp_merge([s[k] for s in slices], *layout[k]) if k in layout else v for k, v in slices[0].items()}


def _sliced_layer(full: dict[str, torch.Tensor], layer: torch.nn.Module, engine: PipelineEngine) -> dict[str, Any]:
    """This TP rank's slice of a full layer state dict, cut by the running layer's own layout."""
    if engine.grid.tp == 1:
        return full
    layout = tp_split_layout(layer)
    tp, rank = engine.grid.tp, engine.grid.tp_rank
    return {k: tp_slice(v, *layout[k], rank, tp).clone() if k in layout else v for k, v in full.items()}


def save_pipeline_checkpoint(
    engine: PipelineEngine,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    client_state: dict[str, Any] | None = None,
) -> None:
    """Writes ``engine``'s model (and ``optimizer``, default ``engine.optimizer``) to directory ``path``. Collective.

    Raises:
    """
    path = Path(path)
    grid, module = engine.grid, engine.module
    if grid.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    _barrier()
    path.mkdir(parents=True, exist_ok=True)
    zero = engine.zero  # ZeRO-2/3: layers, tie groups and optimizer state gathered to replica 0 (collectives)
    full_layers = zero.full_layer_states() if zero is not None else {}
    full_tied = {key: zero.full_tied_state(key) for key in sorted(zero.tied)} if zero is not None else {}
    if grid.dp_rank == 0:
        for idx in _local_layers(engine):
            layer = module.get_submodule(str(idx))
            state = full_layers[idx] if idx in full_layers else layer.state_dict()
            torch.save(state, path / _layer_file(idx, grid.tp, grid.tp_rank))
            if grid.tp > 1 and grid.tp_rank == 0:  # see [Note: checkpoints with tensor parallelism]
                torch.save(tp_split_layout(layer), path / _layout_file(idx))
        for key, src in engine.groups.tied_src.items():
            if src == grid.rank and grid.tp_rank == 0:  # replicated over TP: written once
                state = full_tied[key] if key in full_tied else module.tied_modules[key].state_dict()
                torch.save(state, path / f"tied_{key}-model_states.pt")
    optimizer = optimizer if optimizer is not None else engine.optimizer
    if optimizer is not None:
        names = _param_names(engine)
        optim_sd = zero.full_optimizer_state(optimizer) if zero is not None else optimizer.state_dict()
        optim = {"optimizer": optim_sd, "param_names": [names.get(id(p)) for p in _optimizer_params(optimizer)]}
        if zero is None or grid.dp_rank == 0:  # see [Note: ZeRO-2/3 checkpoints]
            torch.save(optim, path / _optim_file(grid.stage, grid.dp_rank, grid.tp, grid.tp_rank))
    if grid.rank == 0:
        meta = {
            "format": _FORMAT,
            "bounds": module.bounds,
            "pp": grid.pp,
            "dp": grid.dp,
            "num_layers": len(module.specs),
            "zero_stage": engine.config.zero_stage,
            "tp": grid.tp,
            "loss_scaler": engine.scaler.state_dict() if engine.scaler else None,
        }
        torch.save(meta, path / "meta.pt")
        plain, originals = split_client_state(client_state or {})
        torch.save(plain, path / "client_state.pt")
        (path / "client_objects.pt").unlink(missing_ok=True)  # from an earlier save into the same directory
        if originals:
            torch.save(originals, path / "client_objects.pt")
    _barrier()


def _param_names(engine: PipelineEngine) -> dict[int, str]:
    """Grid-independent name of every local parameter (tie groups by their ``tied_modules`` name)."""
    names: dict[int, str] = {}
    for name, p in engine.module.named_parameters(remove_duplicate=False):
        old = names.get(id(p))
        if old is None or (name.startswith("tied_modules.") and not old.startswith("tied_modules.")):
            names[id(p)] = name
    return names


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _split_optim_file(data: dict[str, Any]) -> tuple[dict[str, Any], list[str | None] | None]:
    if "param_names" in data and "optimizer" in data:
        return data["optimizer"], data["param_names"]
    return data, None  # written before names were recorded


def _regridded_state(
    engine: PipelineEngine,
    optimizer: torch.optim.Optimizer,
    path: Path,
    meta: dict[str, Any],
    weights_only: bool | None,
) -> dict[str, Any]:
    """This rank's optimizer state dict gathered from every optimizer file. See [Note: optimizer state on another
    grid]."""
    names = _param_names(engine)
    params = _optimizer_params(optimizer)
    owned = {id(p) for p in params}  # ZeRO-2/3: every piece (its full-shaped state is cut to the piece below)
    if engine.zero1 is not None:
        owned = {id(p) for p, o in zip(engine.zero1.params, engine.zero1.owner) if o == engine.grid.dp_rank}
    wanted = {names[id(p)]: i for i, p in enumerate(params) if id(p) in names and id(p) in owned}
    index_of = {names[id(p)]: i for i, p in enumerate(params) if id(p) in names}
    state: dict[int, Any] = {}
    group_of: dict[int, dict[str, Any]] = {}
    listed_in: dict[int, dict[str, Any]] = {}  # any saved group naming the parameter, state or not
    files = sorted(f for f in path.iterdir() if _OPTIM_RE.match(f.name))
    for f in files:
        # on the host: only this rank's share is kept; load_state_dict moves it next to the parameters
        saved, saved_names = _split_optim_file(load_file(f, weights_only=weights_only, opt_in=_LOAD_OPT_IN))
        if saved_names is None:
            raise ValueError(
                f"{f}: optimizer state was saved on a {meta['pp']} x {meta['dp']} grid without parameter names (an older "
                "checkpoint); it reloads only on the same grid and split. Load with load_optimizer=False (weights only)"
            )
        index_group = {i: g for g in saved["param_groups"] for i in g["params"]}
        for i, name in enumerate(saved_names):
            if name in index_of:
                listed_in.setdefault(index_of[name], index_group[i])
            if name in wanted and i in saved["state"] and wanted[name] not in state:
                state[wanted[name]] = saved["state"][i]
                group_of[wanted[name]] = index_group[i]
    current = optimizer.state_dict()
    groups = []
    for g in current["param_groups"]:
        source = next((group_of[i] for i in g["params"] if i in group_of), None)
        if source is None:  # no state here (SGD without momentum, ZeRO-1 owned elsewhere): see the Note
            source = next((listed_in[i] for i in g["params"] if i in listed_in), None)
        hyper = {k: v for k, v in (source or g).items() if k not in ("params", "param_names")}
        groups.append({**g, **hyper})  # this grid's parameter indices (and names, if any), the saved hyperparameters
    if engine.zero is not None:
        return engine.zero.shard_optimizer_state(optimizer, {"state": state, "param_groups": groups})
    return {"state": state, "param_groups": groups}


def _read_meta(path: Path, weights_only: bool | None, opt_in: str) -> dict[str, Any]:
    if not (path / "meta.pt").is_file():
        raise FileNotFoundError(f"{path} is not a zlightning pipeline checkpoint (no meta.pt)")
    meta = load_file(path / "meta.pt", weights_only=weights_only, opt_in=opt_in)
    found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
    if found != _FORMAT:
        raise ValueError(f"{path}: unknown pipeline checkpoint format {found!r}; expected {_FORMAT!r}")
    return meta


def load_pipeline_checkpoint(
    engine: PipelineEngine,
    path: str | os.PathLike[str],
    optimizer: torch.optim.Optimizer | None = None,
    load_optimizer: bool = True,
    *,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Loads the layers this rank holds (any earlier stage count works for the model), the optimizer state (on any
    grid; see [Note: optimizer state on another grid]) and the fp16 loss scale (with ``load_optimizer``).
    Re-broadcasts tied weights. Returns the client state.

    Every file is read weights-only, and before anything is restored, unless ``weights_only=False`` (the opt-in to
    full unpickling for trusted checkpoints; it also restores hyper-parameters that are not plain data).

    Raises:
        ValueError: the checkpoint has another layer count, or it is an older checkpoint (no parameter names) whose
            optimizer state was saved on a different grid.
        NotImplementedError: tensor parallelism on either side and another split or TP size, or optimizer state
            saved under TP on another data-parallel size (see [Note: checkpoints with tensor parallelism]).
        UnsafeCheckpointError: a file needs full unpickling and ``weights_only`` is not ``False`` (nothing was
            restored).
    """
    path = Path(path)
    meta = _read_meta(path, weights_only, _LOAD_OPT_IN)
    grid, module = engine.grid, engine.module
    if meta["num_layers"] != len(module.specs):
        raise ValueError(f"{path} holds {meta['num_layers']} layers but the PipelineModule has {len(module.specs)}")
    _check_tp(engine, path, meta, load_optimizer and (optimizer is not None or engine.optimizer is not None))

    def load(name: str, **kwargs: Any) -> Any:
        return load_file(path / name, weights_only=weights_only, opt_in=_LOAD_OPT_IN, **kwargs)

    client = load("client_state.pt")
    objects = path / "client_objects.pt"
    client = join_client_state(client, (lambda: load(objects.name)) if objects.is_file() else None, weights_only)
    if _same_tp_grid(engine, meta):
        layers = {
            idx: load(_layer_file(idx, grid.tp, grid.tp_rank), map_location=engine.device)
            for idx in _local_layers(engine)
        }
    else:  # another TP grid: merge the saved slices, cut this rank's (see [Note: checkpoints with tensor parallelism])
        layers = {}
        for idx in _local_layers(engine):
            full = _merged_layer(path, idx, meta, lambda f: load(f.name, map_location=engine.device))
            if full is None:
                raise FileNotFoundError(f"{path}: no file for layer {idx}")
            layers[idx] = _sliced_layer(full, module.get_submodule(str(idx)), engine)
    tied = {key: load(f"tied_{key}-model_states.pt", map_location=engine.device) for key in module.tied_modules}
    optimizer = optimizer if optimizer is not None else engine.optimizer
    optim_state = None
    if optimizer is not None and load_optimizer:
        same = meta["pp"] == grid.pp and meta["dp"] == grid.dp and meta["bounds"] == module.bounds
        sharded = max(meta.get("zero_stage", 0), engine.config.zero_stage) >= 2  # full-shaped state, cut on load
        if same and not sharded and (grid.dp == 1 or meta.get("zero_stage", 0) == engine.config.zero_stage):
            own = _optim_file(grid.stage, grid.dp_rank, grid.tp, grid.tp_rank)
            optim_state = _split_optim_file(load(own, map_location=engine.device))[0]
        elif grid.tp > 1:
            raise NotImplementedError(
                f"{path}: optimizer state saved under tensor parallelism on a {meta['dp']}-replica grid (ZeRO stage "
                f"{meta.get('zero_stage', 0)}) cannot be regridded to {grid.dp} replicas (ZeRO stage "
                f"{engine.config.zero_stage}); load with load_optimizer=False (weights only)"
            )
        else:
            optim_state = _regridded_state(engine, optimizer, path, meta, weights_only)
    # Everything is read: restore.
    zero = engine.zero
    sharded_layers = zero.layer_ids if zero is not None else set()
    for idx, state in layers.items():
        if idx not in sharded_layers:
            module.get_submodule(str(idx)).load_state_dict(state)
    if zero is not None:
        zero.load_full({i: sd for i, sd in layers.items() if i in sharded_layers}, tied)
    else:
        for key, state in tied.items():
            module.tied_modules[key].load_state_dict(state)
    if optimizer is not None and optim_state is not None:
        optimizer.load_state_dict(optim_state)
    if load_optimizer and engine.scaler is not None and meta.get("loss_scaler") is not None:
        engine.scaler.load_state_dict(meta["loss_scaler"])
    engine._sync_replicas()
    return client


def consolidate_pipeline_checkpoint(
    path: str | os.PathLike[str], *, weights_only: bool | None = None
) -> dict[str, torch.Tensor]:
    """One plain state dict with the names of a one-stage ``PipelineModule`` (``"{idx}.{param}"`` and
    ``"tied_modules.{key}.{param}"``), loadable with ``PipelineModule(...).build().load_state_dict``. No process group
    needed. Reads ``meta.pt`` and the layer files only, weights-only unless ``weights_only=False``.

    Tensor-parallel slices are merged layer by layer (see [Note: checkpoints with tensor parallelism]).

    Raises:
        NotImplementedError: a tensor-parallel checkpoint written before layouts were recorded.
        FileNotFoundError: a layer's slice is missing.
        UnsafeCheckpointError: a file needs full unpickling and ``weights_only`` is not ``False``."""
    path = Path(path)
    meta = _read_meta(path, weights_only, _CONSOLIDATE_OPT_IN)
    out: dict[str, torch.Tensor] = {}
    for idx in range(meta["num_layers"]):
        state = _merged_layer(
            path, idx, meta, lambda f: load_file(f, weights_only=weights_only, opt_in=_CONSOLIDATE_OPT_IN)
        )
        for k, v in (state or {}).items():
            out[f"{idx}.{k}"] = v
    for f in sorted(path.glob("tied_*-model_states.pt")):
        key = f.name[len("tied_") : -len("-model_states.pt")]
        for k, v in load_file(f, weights_only=weights_only, opt_in=_CONSOLIDATE_OPT_IN).items():
            out[f"tied_modules.{key}.{k}"] = v
    return out
