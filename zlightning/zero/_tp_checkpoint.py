"""Sharded ZeRO-3 checkpoints of a tensor-parallel model: one sharded checkpoint per TP rank, published as one.

[Note: sharded checkpoints with tensor parallelism]
Under ``tensor_parallel_size = t`` each TP rank has its own ZeRO-3 engine over its data-parallel group, sharding that
rank's slices of the split layers; the engines of two TP ranks hold different tensors under the same names. So a
checkpoint is a directory of ``t`` ordinary sharded checkpoints, one per TP rank, and a small index::

    tensor_parallel.json   format, TP size, and how each split parameter was cut: ``{name: [dim, chunks]}``
                           (`zlightning.inject.tp_split_layout`)
    tp_00/ ... tp_{t-1}/   the sharded checkpoint of that TP rank's engine ([Note: sharded checkpoint layout]),
                           each with the client state (Lightning's loops; small)

Saving: every rank writes its TP rank's checkpoint under a staging folder of its own (the per-engine save cleans its
parent folder of leftovers, so two engines never share one), every rank learns whether every other succeeded, and
global rank 0 moves the parts in place, writes the index last and publishes the whole directory in one atomic step
(see [Note: atomic, all-or-nothing]): a failure on any rank fails every rank and replaces nothing.

Loading needs the same TP size (each TP rank's part then reshards over any data-parallel size, as any sharded
checkpoint does); another TP size, or a checkpoint with TP into a run without it (or the reverse), is a
``CheckpointError`` that names ``zlightning consolidate``: the consolidated file loads anywhere. Consolidation merges
each parameter's slices (`zlightning.inject.tp_merge`) one parameter at a time, so it holds about ``t`` slices of one
parameter beyond what it writes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zlightning._durable import clean_leftovers, fsync_dir, fsync_file, publish, resolve, temporary_name
from zlightning.inject import tp_merge
from zlightning.zero._sharded_checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    full_parameters,
    load_sharded,
    open_for_consolidation,
    save_sharded,
)
from zlightning.zero._state import ZeroState

__all__ = ["TP_INDEX", "consolidate_tp", "is_tp_checkpoint", "load_sharded_tp", "read_tp_index", "save_sharded_tp"]

TP_INDEX = "tensor_parallel.json"
_FORMAT = "zlightning-zero-tensor-parallel"


def _part(tp_rank: int) -> str:
    return f"tp_{tp_rank:02d}"


def is_tp_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = resolve(path)
    return path.is_dir() and (path / TP_INDEX).is_file()


def read_tp_index(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The index of a tensor-parallel checkpoint (format checked).

    Raises:
        CheckpointError: not valid JSON or another format.
    """
    index_path = resolve(path) / TP_INDEX
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{index_path} is not valid JSON ({err}): the checkpoint is corrupted") from err
    if not isinstance(index, dict) or index.get("format") != _FORMAT:
        raise CheckpointError(f"{index_path}: not a zlightning tensor-parallel checkpoint index")
    return index


def save_sharded_tp(
    state: ZeroState,
    optimizers: list[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    client_state: dict[str, Any] | None,
    *,
    tp_rank: int,
    tp_size: int,
    layout: dict[str, tuple[int, int]],
    save_full_weights: bool = False,
) -> None:
    """Writes the checkpoint of every TP rank's engine at ``path`` (collective over the world). See [Note: sharded
    checkpoints with tensor parallelism].

    Raises:
        CheckpointSaveError: on every rank, when any rank failed; nothing was replaced.
    """
    path = Path(path)
    rank = dist.get_rank()
    name: list[str | None] = [None]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(path.parent)
        name = [temporary_name(path).name]
    dist.broadcast_object_list(name, src=0)
    tmp = path.parent / str(name[0])
    stage = tmp / f".stage_{_part(tp_rank)}"  # a folder per TP rank: see the Note
    error: str | None = None
    try:
        save_sharded(state, optimizers, stage / _part(tp_rank), client_state)
    except CheckpointSaveError as err:  # already agreed within this TP rank's data-parallel group
        error = str(err)
    except Exception as err:  # noqa: BLE001 - before the group agreed (its staging folder): every rank must learn it
        error = f"saving the tensor-parallel checkpoint {path} failed on rank {rank}: {type(err).__name__}: {err}"
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    if not failed and rank == 0:
        try:
            for t in range(tp_size):
                os.rename(tmp / f".stage_{_part(t)}" / _part(t), tmp / _part(t))
                os.rmdir(tmp / f".stage_{_part(t)}")
            if save_full_weights:
                from zlightning.zero._sharded_checkpoint import FULL_WEIGHTS

                consolidate_tp(tmp, tmp / FULL_WEIGHTS, progress=False, index={"tp": tp_size, "layout": layout})
                fsync_file(tmp / FULL_WEIGHTS)
            index = {"format": _FORMAT, "tp": tp_size, "layout": {k: list(v) for k, v in layout.items()}}
            (tmp / TP_INDEX).write_text(json.dumps(index, indent=1))
            fsync_file(tmp / TP_INDEX)
            fsync_dir(tmp)
            publish(tmp, path)
        except OSError as err:
            failed.append(f"publishing the tensor-parallel checkpoint {path} failed on rank 0: {err}")
    if failed and rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    box: list[str | None] = [failed[0] if failed else None]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointSaveError(box[0])


def load_sharded_tp(
    state: ZeroState,
    optimizers: list[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    tp_rank: int,
    tp_size: int,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Loads this TP rank's part of a tensor-parallel checkpoint into its engine (collective); returns the client
    state.

    Raises:
        CheckpointError: another TP size (or not a tensor-parallel checkpoint), as well as ``load_sharded``'s.
    """
    path = resolve(path)
    if not is_tp_checkpoint(path):
        raise CheckpointError(
            f"{path} was saved without tensor parallelism; this run has tensor_parallel_size={tp_size}. Consolidate "
            "it (zlightning consolidate CKPT model.pt) and load the weights with load_state_dict in configure_model, "
            "or resume it without tensor parallelism"
        )
    saved = int(read_tp_index(path)["tp"])
    if saved != tp_size:
        raise CheckpointError(
            f"{path} was saved with tensor_parallel_size={saved}; this run has {tp_size}. A checkpoint resumes with "
            "its own TP size (any data-parallel size); to change it, consolidate it (zlightning consolidate CKPT "
            "model.pt) and load the weights with load_state_dict in configure_model"
        )
    return load_sharded(state, optimizers, path / _part(tp_rank), weights_only=weights_only)


def consolidate_tp(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    weights_only: bool | None = None,
    index: dict[str, Any] | None = None,
) -> Path:
    """One plain state dict from a tensor-parallel checkpoint: every TP rank's parameters assembled and their slices
    merged, one parameter at a time (see [Note: sharded checkpoints with tensor parallelism]).

    Raises:
        CheckpointError: a part is missing, or the parts disagree on the parameters they hold.
    """
    from zlightning.zero._export import StateDictWriter, TensorSpec

    ckpt_dir, out = resolve(ckpt_dir), Path(out)
    index = index if index is not None else read_tp_index(ckpt_dir)
    tp, layout = int(index["tp"]), {k: (int(v[0]), int(v[1])) for k, v in index["layout"].items()}
    parts = []
    for t in range(tp):
        if not (ckpt_dir / _part(t)).is_dir():
            raise CheckpointError(
                f"{ckpt_dir / _part(t)} is missing from the tensor-parallel checkpoint (TP size {tp})"
            )
        parts.append(open_for_consolidation(ckpt_dir / _part(t), weights_only))

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() else x

    def full_shape(p: dict[str, Any]) -> tuple[int, ...]:
        shape = list(p["shape"])
        where = next((layout[n] for n in p["fqns"] if n in layout), None)
        if where is not None:
            shape[where[0]] *= tp
        return tuple(shape)

    meta0, _, buffers = parts[0]
    specs = []
    for g in meta0["groups"]:
        saved = getattr(torch, g["dtype"])
        target = dtype if saved.is_floating_point else saved
        specs += [TensorSpec(tuple(p["fqns"]), full_shape(p), target) for p in g["params"]]
    specs += [
        TensorSpec((k,), tuple(v.shape), cast(v).dtype) for k, v in buffers.items() if isinstance(v, torch.Tensor)
    ]
    streams = [
        full_parameters(meta, payloads, progress=progress and t == 0, desc=f"consolidating {ckpt_dir.name}")
        for t, (meta, payloads, _) in enumerate(parts)
    ]
    writer = StateDictWriter(out, specs)
    try:
        for items in zip(*streams, strict=True):
            names = [p["fqns"][0] for p, _ in items]
            if len(set(names)) != 1:
                raise CheckpointError(f"{ckpt_dir}: the TP parts hold different parameters ({names})")
            p = items[0][0]
            where = next((layout[n] for n in p["fqns"] if n in layout), None)
            full = items[0][1] if where is None else tp_merge([x for _, x in items], *where)
            writer.write(names[0], cast(full))
            del full, items
        for key, value in buffers.items():
            if isinstance(value, torch.Tensor):
                writer.write(key, cast(value))
    except CheckpointError:
        writer.abort()
        raise
    except ValueError as err:  # zip(strict=True): one part has more parameters
        writer.abort()
        raise CheckpointError(f"{ckpt_dir}: the TP parts hold different parameters ({err})") from err
    except BaseException:
        writer.abort()
        raise
    return writer.close()
