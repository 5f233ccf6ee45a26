"""Sharded ZeRO-3 checkpoints: every rank writes only its shards; load at any world size; consolidate to one file.

[Note: sharded checkpoint layout]
A checkpoint is a directory::

    meta.json            format, version, world size, per-group layout (parameter names, shapes, offsets), the
                         optimizer layout, and a SHA-256 per file
    rank_00000.pt ...    one per rank: that rank's flat shard of every group (model), and its optimizer state as one
                         flat tensor per (group, state key) plus per-parameter scalars (Adam's ``step``); rank 0's
                         also holds the module's buffers and extra state (replicated)
    client_state.pt      everything else (Lightning's loops, callbacks, schedulers, hyper-parameters), from rank 0
    client_objects.pt    only when a hyper-parameter is not plain data: the original values (see [Note: described
                         hyper-parameters] in ``zlightning/_safe_load.py``)
    full_weights.pt      optional (``save_full_weights``): the consolidated model state dict

Every file is read weights-only unless the caller opts in (see [Note: what loading trusts] in
``zlightning/_safe_load.py``), and `consolidate` reads only ``meta.json`` and the rank files, never the client state.
Version 1 checkpoints kept the buffers in the client state; they still load (`consolidate` then reads the client
state, weights-only).

A group's flat layout (parameters end to end, padded to a multiple of the world size) does not depend on the world
size, only its cut into per-rank slices does. So loading at world size M reads, for each new rank, the old rank files
whose slices overlap its new slice: resharding needs no separate conversion step.

[Note: loading across layouts]
Loading works parameter by parameter: for every parameter piece this rank owns now, the saved metadata says which
saved group held the parameter, at which offset, and so which saved rank slices hold its elements. The saved run may
therefore have grouped parameters differently (other ``unit_modules``, persistence thresholds or world size): only
the set of parameter names and their shapes must match.

[Note: atomic, all-or-nothing]
Ranks write into a temporary directory next to the target (``zlightning._durable.temporary_name``) and ``fsync`` their
files; rank 0 writes ``meta.json`` last, ``fsync`` s it and the directory, and publishes it under the target's name in
one atomic, durable step that deletes the previous checkpoint only afterwards (see [Note: what durable means here]
and [Note: the name always resolves] in ``zlightning/_durable.py``). So a crash or a power loss at any moment leaves
either the previous or the new checkpoint, complete, under the name. A save that fails on any rank (a full disk, an
I/O error) fails on every rank with the same `CheckpointSaveError`: it names the rank and the cause, the partial
files are removed and nothing was replaced. Loading validates everything first (format, model layout, files present,
checksums) and builds the new shards in temporary tensors; the engine's shards and the optimizer change only when
every check passed.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zlightning._durable import (
    clean_leftovers,
    fsync_dir,
    fsync_file,
    full_disk_as_oserror,
    publish,
    resolve,
    save_failure_message,
    temporary_name,
)
from zlightning._safe_load import LIGHTNING_OPT_IN, join_client_state, load_file, split_client_state
from zlightning.zero._export import LazyTensor, save_full_state_dict, save_streaming
from zlightning.zero._param import ZeroParam
from zlightning.zero._state import ZeroState

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "FORMAT",
    "consolidate",
    "is_sharded_checkpoint",
    "load_sharded",
    "read_metadata",
    "save_sharded",
]

FORMAT = "zlightning-zero-sharded"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: buffers inside the client state
META = "meta.json"
CLIENT = "client_state.pt"
OBJECTS = "client_objects.pt"
FULL_WEIGHTS = "full_weights.pt"
BUFFERS = "zero_buffers"  # key in rank 0's file (version 1: in the client state): the module's buffers and extra state
LOAD_OPT_IN = f"{LIGHTNING_OPT_IN}, or load_sharded(..., weights_only=False)"
CONSOLIDATE_OPT_IN = "zlightning consolidate --unsafe-load, or consolidate(..., weights_only=False)"


class CheckpointError(ValueError):
    """A sharded checkpoint is missing, corrupted, or does not belong to this model."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (a full disk, an I/O error) on some rank, raised on every rank; nothing was replaced
    (see [Note: atomic, all-or-nothing]). An ``OSError``, as the failure underneath it."""


def _rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    path = resolve(path)  # see [Note: the name always resolves] in zlightning/_durable.py
    return path.is_dir() and (path / META).is_file()


def _layout(state: ZeroState) -> list[dict[str, Any]]:
    return [
        {
            "numel": g.numel,
            "dtype": str(g.master_dtype).removeprefix("torch."),
            "params": [
                {"fqns": zp.fqns, "shape": list(zp.shape), "offset": zp.offset, "numel": zp.numel} for zp in g.params
            ],
        }
        for g in state.groups
    ]


def _optimizer_index(state: ZeroState, optimizer: torch.optim.Optimizer) -> list[ZeroParam | None]:
    return [state.zero_param_of(p) for group in optimizer.param_groups for p in group["params"]]


def _per_element(value: Any, zp: ZeroParam, key: str) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() == 1 and value.numel() == zp.local_numel


def _local_optimizer_payload(state: ZeroState, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's optimizer state: flat per (group, key) tensors in shard layout, and per-parameter scalars. The
    flats are `LazyTensor` s, assembled one at a time as the file is written (no copy of the whole state)."""
    sd = optimizer.state_dict()
    index = _optimizer_index(state, optimizer)
    where = {zp.index: i for i, zp in enumerate(index) if zp is not None}
    flats: dict[str, dict[str, LazyTensor]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for gi, group in enumerate(state.groups):
        members: dict[str, list[tuple[ZeroParam, torch.Tensor]]] = {}
        for zp in group.params:
            entry = sd["state"].get(where.get(zp.index, -1))
            if not entry:
                continue
            scalars[str(zp.index)] = {k: v for k, v in entry.items() if not _per_element(v, zp, k)}
            for key, value in entry.items():
                if _per_element(value, zp, key):
                    members.setdefault(key, []).append((zp, value))
        for key, pieces in members.items():
            flats.setdefault(str(gi), {})[key] = LazyTensor(
                (group.shard_numel,), pieces[0][1].dtype, functools.partial(_flat_of, group, pieces)
            )
    return {
        "param_groups": sd["param_groups"],
        "param_index": [zp.index if zp is not None else None for zp in index],
        "flats": flats,
        "scalars": scalars,
    }


def _shard_on_cpu(group: Any) -> torch.Tensor:
    """A group's current master shard, on the CPU (read when its `LazyTensor` is written)."""
    return group.shard.detach().cpu()


def _flat_of(group: Any, pieces: list[tuple[ZeroParam, torch.Tensor]]) -> torch.Tensor:
    """One optimizer-state tensor of a group in shard layout (zeros where a parameter has none)."""
    base = group.rank * group.shard_numel
    flat = torch.zeros(group.shard_numel, dtype=pieces[0][1].dtype)
    for zp, value in pieces:
        flat[zp.local_start - base : zp.local_end - base].copy_(value)
    return flat


def _collective_name(state: ZeroState, path: Path) -> str:
    if state.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        clean_leftovers(path.parent)  # a crashed earlier save's temporaries (see [Note: the name always resolves])
    box = [temporary_name(path).name if state.rank == 0 else None]
    if state.world_size > 1:
        dist.broadcast_object_list(box, src=state.global_src, group=state.process_group)
    return str(box[0])


def _agree(state: ZeroState, mine: Any) -> list[Any]:
    """Every rank's ``mine`` (collective)."""
    if state.world_size == 1:
        return [mine]
    everyone: list[Any] = [None] * state.world_size
    dist.all_gather_object(everyone, mine, group=state.process_group)
    return everyone


def _from_rank0(state: ZeroState, value: Any) -> Any:
    box = [value]
    if state.world_size > 1:
        dist.broadcast_object_list(box, src=state.global_src, group=state.process_group)
    return box[0]


def save_sharded(
    state: ZeroState,
    optimizers: Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    client_state: Mapping[str, Any] | None = None,
    *,
    save_full_weights: bool = False,
) -> None:
    """Writes a sharded checkpoint directory at ``path`` (collective: every rank calls, each writes its shards).

    Args:
        state: the engine.
        optimizers: optimizers attached to it (their sharded state is saved).
        path: target directory; replaced atomically if it exists.
        client_state: extra picklable state written once by rank 0 (e.g. Lightning's loops and callbacks); it
            should load with ``torch.load(weights_only=True)`` (plain data), except hyper-parameters (see
            [Note: described hyper-parameters] in ``zlightning/_safe_load.py``).
        save_full_weights: also gather a consolidated model state dict into ``full_weights.pt``.
    """
    path = Path(path)
    existed = os.path.lexists(path)
    tmp = path.parent / _collective_name(state, path)
    try:  # this rank's file; a failure is reported to every rank below (see [Note: atomic, all-or-nothing])
        tmp.mkdir(parents=True, exist_ok=True)
        mine: tuple[str, str] = ("ok", _write_rank_file(state, optimizers, tmp))
    except Exception as err:  # noqa: BLE001 - every rank must learn of it, or the others wait for this one
        mine = ("error", save_failure_message(path, f"rank {state.rank}", err, existed))
    outcomes = _agree(state, mine)
    failed = [text for kind, text in outcomes if kind == "error"]
    if failed:
        if state.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointSaveError(failed[0])
    digests = [digest for _, digest in outcomes]
    if save_full_weights:  # streamed by rank 0, one gathered group at a time
        save_full_state_dict(state, tmp / FULL_WEIGHTS)
    error = None
    if state.rank == 0:
        try:
            _write_rank0_files(state, optimizers, tmp, digests, client_state, save_full_weights)
        except Exception as err:  # noqa: BLE001 - reported on every rank
            shutil.rmtree(tmp, ignore_errors=True)
            error = save_failure_message(path, "rank 0", err, existed)
        else:
            try:
                publish(tmp, path)
            except OSError as err:  # a rename refused: the complete new checkpoint stays at tmp
                error = f"publishing the complete checkpoint {tmp} as {path} failed on rank 0: {err}"
    error = _from_rank0(state, error)
    if error is not None:
        raise CheckpointSaveError(error)


def _write_rank_file(state: ZeroState, optimizers: Sequence[torch.optim.Optimizer], tmp: Path) -> str:
    """Writes and fsyncs this rank's shard file; returns its SHA-256."""
    payload = {
        "shards": [
            LazyTensor((g.shard_numel,), g.master_dtype, functools.partial(_shard_on_cpu, g)) for g in state.groups
        ],
        "optimizers": [_local_optimizer_payload(state, opt) for opt in optimizers],
    }
    if state.rank == 0:
        payload[BUFFERS] = _buffers(state)
    rank_path = tmp / _rank_file(state.rank)
    with state.resident(), full_disk_as_oserror(tmp):  # resident: offloaded parameters are read back to be written
        save_streaming(payload, rank_path)  # one tensor at a time: the save needs no copy of the state
    fsync_file(rank_path)
    return _sha256(rank_path)


def _write_rank0_files(
    state: ZeroState,
    optimizers: Sequence[torch.optim.Optimizer],
    tmp: Path,
    digests: list[str],
    client_state: Mapping[str, Any] | None,
    save_full_weights: bool,
) -> None:
    """The client state and ``meta.json`` (last), each fsynced, then the directory itself."""
    files = {_rank_file(r): d for r, d in enumerate(digests)}
    plain, originals = split_client_state(client_state or {})
    with full_disk_as_oserror(tmp):
        torch.save(plain, tmp / CLIENT)
        if originals:
            torch.save(originals, tmp / OBJECTS)
    files[CLIENT] = _sha256(tmp / CLIENT)
    if originals:
        files[OBJECTS] = _sha256(tmp / OBJECTS)
    if save_full_weights:
        files[FULL_WEIGHTS] = _sha256(tmp / FULL_WEIGHTS)
    for name in files:
        if not name.startswith("rank_"):  # each rank fsynced its own file
            fsync_file(tmp / name)
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "world_size": state.world_size,
        "groups": _layout(state),
        "num_optimizers": len(optimizers),
        "files": files,
    }
    (tmp / META).write_text(json.dumps(meta, indent=1))
    fsync_file(tmp / META)
    fsync_dir(tmp)


def _buffers(state: ZeroState) -> dict[str, Any]:
    names = {n for zp in state.params for n in zp.fqns}
    return {
        k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
        for k, v in state.root.state_dict().items()
        if k not in names
    }


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Reads and checks ``meta.json`` of a sharded checkpoint.

    Raises:
        CheckpointError: not a directory with ``meta.json``, or not this format/version.
    """
    path = resolve(path)
    if not path.is_dir():
        raise CheckpointError(
            f"{path} is not a sharded zlightning checkpoint directory (a single .ckpt/.pt file is a full checkpoint: "
            "load it with torch.load or pass it to the strategy as ckpt_path)"
        )
    meta_path = path / META
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is not a complete sharded checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{meta_path} is not valid JSON ({err}): the checkpoint is corrupted") from err
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(
            f"{meta_path}: format {meta.get('format')!r} version {meta.get('version')!r}, expected {FORMAT!r} version "
            f"{' or '.join(map(str, READABLE_VERSIONS))}"
        )
    return meta


def _verify_files(path: Path, meta: Mapping[str, Any], names: Sequence[str]) -> None:
    for name in names:
        file = path / name
        if not file.is_file():
            raise CheckpointError(
                f"{file} is missing from the sharded checkpoint (saved at world size {meta['world_size']})"
            )
        expected = meta["files"].get(name)
        if expected is not None and _sha256(file) != expected:
            raise CheckpointError(f"{file} is corrupted: its SHA-256 does not match meta.json")


def _check_layout(state: ZeroState, meta: Mapping[str, Any], path: Path) -> None:
    saved, here = meta["groups"], _layout(state)
    params_saved = {p["fqns"][0]: p["shape"] for g in saved for p in g["params"]}
    params_here = {p["fqns"][0]: p["shape"] for g in here for p in g["params"]}
    if params_saved != params_here:
        missing = sorted(set(params_here) - set(params_saved))[:5]
        unexpected = sorted(set(params_saved) - set(params_here))[:5]
        shapes = [
            f"{n}: checkpoint {params_saved[n]} vs model {s}"
            for n, s in params_here.items()
            if n in params_saved and params_saved[n] != s
        ][:5]
        raise CheckpointError(
            f"{path} does not match this model: missing {missing or '-'}, unexpected {unexpected or '-'}, "
            f"different shapes {shapes or '-'}"
        )


class _Source:
    """Where a parameter's elements live in the saved checkpoint (see [Note: loading across layouts])."""

    def __init__(self, group: int, offset: int, old_shard: int) -> None:
        self.group = group
        self.offset = offset
        self.old_shard = old_shard

    def span(self, zp: ZeroParam) -> tuple[int, int]:
        """Saved group-flat positions of this rank's current piece of ``zp``."""
        return self.offset + zp.local_start - zp.offset, self.offset + zp.local_end - zp.offset

    def ranks(self, zp: ZeroParam) -> set[int]:
        lo, hi = self.span(zp)
        if hi <= lo or not self.old_shard:
            return set()
        return set(range(lo // self.old_shard, (hi - 1) // self.old_shard + 1))


def _sources(meta: Mapping[str, Any]) -> dict[str, _Source]:
    world = int(meta["world_size"])
    return {
        p["fqns"][0]: _Source(og, int(p["offset"]), -(-int(g["numel"]) // world))
        for og, g in enumerate(meta["groups"])
        for p in g["params"]
    }


class _RankFiles:
    """Loads old rank files lazily, at most the ones a new shard overlaps."""

    def __init__(self, path: Path, weights_only: bool | None, opt_in: str) -> None:
        self.path = path
        self.weights_only = weights_only
        self.opt_in = opt_in
        self._cache: dict[int, dict[str, Any]] = {}

    def get(self, rank: int) -> dict[str, Any]:
        if rank not in self._cache:
            file = self.path / _rank_file(rank)
            self._cache[rank] = load_file(file, weights_only=self.weights_only, opt_in=self.opt_in)
        return self._cache[rank]


def _assemble(
    lo: int, hi: int, old_shard: int, fetch: Callable[[int], torch.Tensor | None], dtype: torch.dtype
) -> torch.Tensor:
    """Elements [lo, hi) of a flat layout cut into old slices of ``old_shard`` elements (zeros where absent)."""
    out = torch.zeros(max(hi - lo, 0), dtype=dtype)
    pos = lo
    while pos < hi:
        rank, start = divmod(pos, old_shard) if old_shard else (0, 0)
        take = min(hi - pos, old_shard - start)
        src = fetch(rank)
        if src is not None:
            out[pos - lo : pos - lo + take].copy_(src[start : start + take])
        pos += take
    return out


def load_sharded(
    state: ZeroState,
    optimizers: Sequence[torch.optim.Optimizer],
    path: str | os.PathLike[str],
    *,
    weights_only: bool | None = None,
) -> dict[str, Any]:
    """Loads a sharded checkpoint saved at any world size into this engine's shards and optimizers (collective).

    Every file is read weights-only (see [Note: what loading trusts] in ``zlightning/_safe_load.py``) unless
    ``weights_only=False``, which also restores hyper-parameters that are not plain data.

    Args:
        state: the engine.
        optimizers: optimizers attached to it (their sharded state is loaded).
        path: the checkpoint directory.
        weights_only: ``False`` opts in to full unpickling (trusted checkpoints only); ``None``/``True`` do not.

    Returns:
        The client state (Lightning's loops, callbacks, schedulers...).

    Raises:
        CheckpointError: missing or corrupted files, or a checkpoint of another model (nothing is modified then).
        UnsafeCheckpointError: a file needs full unpickling and ``weights_only`` is not ``False`` (nothing is
            modified then).
    """
    path = resolve(path)
    meta = read_metadata(path)
    _check_layout(state, meta, path)
    sources = _sources(meta)
    new_opt = len(optimizers)
    if optimizers and meta["num_optimizers"] != new_opt:
        raise CheckpointError(f"{path} holds {meta['num_optimizers']} optimizers' state, this run has {new_opt}")
    files = _RankFiles(path, weights_only, LOAD_OPT_IN)
    needed = {r for zp in state.params for r in sources[zp.fqn].ranks(zp)}
    if not needed:
        needed = {0}  # optimizer metadata lives in every rank file; rank 0's always exists
    objects = OBJECTS in meta["files"] and weights_only is False  # read only under the opt-in
    names = [_rank_file(r) for r in sorted(needed | {0})] + [CLIENT] + ([OBJECTS] if objects else [])
    _verify_files(path, meta, names)
    # Build everything first (see [Note: atomic, all-or-nothing]), the client state before all.
    client = load_file(path / CLIENT, weights_only=weights_only, opt_in=LOAD_OPT_IN)
    if not isinstance(client, dict):
        raise CheckpointError(
            f"{path / CLIENT} holds a {type(client).__name__}, not a dict: the checkpoint is corrupted"
        )
    originals = (lambda: load_file(path / OBJECTS, weights_only=False, opt_in=LOAD_OPT_IN)) if objects else None
    client = join_client_state(client, originals, weights_only)
    legacy_buffers = client.pop(BUFFERS, {})  # version 1
    buffers = files.get(0).get(BUFFERS, legacy_buffers)
    new_shards = []
    for g in state.groups:
        base = g.rank * g.shard_numel
        shard = torch.zeros(g.shard_numel, dtype=g.master_dtype)
        for zp in g.params:
            src = sources[zp.fqn]
            lo, hi = src.span(zp)

            def saved_shard(r: int, og: int = src.group) -> torch.Tensor | None:
                return files.get(r)["shards"][og]

            piece = _assemble(lo, hi, src.old_shard, saved_shard, g.master_dtype)
            shard[zp.local_start - base : zp.local_end - base].copy_(piece)
        new_shards.append(shard)

    def every_rank(which: int) -> list[dict[str, Any]]:
        old_world = int(meta["world_size"])
        _verify_files(path, meta, [_rank_file(r) for r in range(old_world)])
        return [files.get(r)["optimizers"][which] for r in range(old_world)]

    opt_states = [_build_optimizer_state(state, opt, files, sources, i, every_rank) for i, opt in enumerate(optimizers)]
    with torch.no_grad(), state.resident():  # parameter offload: written back to the swap files on exit
        for g, new in zip(state.groups, new_shards):
            g.shard.zero_()
            g.shard[: new.numel()].copy_(new.to(g.shard.device))
    for opt, (sd, added) in zip(optimizers, opt_states):
        for group in added:  # see [Note: param groups added during training]
            opt.add_param_group(group)
        opt.load_state_dict(sd)
    if buffers:
        state.root.load_state_dict(buffers, strict=False)
    state.on_optimizer_step()  # gathered copies are stale
    return client


# [Note: param groups added during training]
# A run may add param groups to its optimizer while it trains (``add_param_group``: Lightning's ``BaseFinetuning``
# adds the unfrozen backbone at some epoch). Its checkpoint then holds more groups than the optimizer that
# ``configure_optimizers`` builds when the run resumes, and Lightning restores this strategy's optimizers before the
# callback could add them back (``restore_checkpoint_after_setup``): loading failed. When the optimizer's groups are
# exactly the checkpoint's first ones and the rest hold other parameters of this model, those groups are added with
# their saved hyper-parameters. Ranks may have saved them differently: ``BaseFinetuning`` skips parameters that
# ``torch.equal`` finds in the optimizer already, and every empty piece (a parameter with no elements on a rank)
# equals every other, so each rank's group lacked its own empty pieces. A group is therefore the union over the
# saved ranks, and each parameter's state comes from whichever rank saved it.
def _groups_added_since(
    state: ZeroState, optimizer: torch.optim.Optimizer, heads: list[dict[str, Any]], live: list[int | None]
) -> list[list[int]] | None:
    """Per param group the checkpoint has beyond the optimizer's own, its parameters (``ZeroParam.index``, in saved
    order); None when the checkpoint's groups do not extend the optimizer's."""
    k, sizes = len(optimizer.param_groups), [len(g["params"]) for g in optimizer.param_groups]
    extra_groups = {len(h["param_groups"]) for h in heads}
    if len(extra_groups) != 1 or extra_groups.pop() <= k:
        return None
    added: list[list[int]] = [[] for _ in heads[0]["param_groups"][k:]]
    for head in heads:
        groups, saved_index = head["param_groups"], head["param_index"]
        if [len(g["params"]) for g in groups[:k]] != sizes or saved_index[: len(live)] != live:
            return None
        pos = len(live)
        for j, g in enumerate(groups[k:]):
            for i in saved_index[pos : pos + len(g["params"])]:
                if i is None or not 0 <= i < len(state.params) or i in live:
                    return None
                if i not in added[j]:
                    added[j].append(i)
            pos += len(g["params"])
    everywhere = [i for group in added for i in group]
    return added if len(everywhere) == len(set(everywhere)) else None


def _build_optimizer_state(
    state: ZeroState,
    optimizer: torch.optim.Optimizer,
    files: _RankFiles,
    sources: Mapping[str, _Source],
    which: int,
    every_rank: Callable[[int], list[dict[str, Any]]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The optimizer's state dict for ``load_state_dict``, and the param groups to add to it first (see [Note: param
    groups added during training])."""
    head = files.get(0)["optimizers"][which]
    index = _optimizer_index(state, optimizer)
    saved_index = head["param_index"]
    live = [zp.index if zp is not None else None for zp in index]
    added: list[dict[str, Any]] = []
    param_groups = head["param_groups"]
    scalars, flats = head["scalars"], head["flats"]
    if live != saved_index:
        heads = every_rank(which)
        grown = _groups_added_since(state, optimizer, heads, live)
        if grown is None:
            raise CheckpointError(
                f"optimizer {which}'s parameters differ from the checkpoint's ({len(live)} parameters in "
                f"{len(optimizer.param_groups)} param groups here, {len(saved_index)} in {len(head['param_groups'])} "
                "there): another model, or configure_optimizers returned different parameter groups"
            )
        k = len(optimizer.param_groups)
        param_groups = [dict(g) for g in head["param_groups"]]
        pos = len(live)
        for g, members in zip(param_groups[k:], grown):
            added.append({**{key: v for key, v in g.items() if key != "params"}, "params": []})
            for i in members:
                added[-1]["params"].append(state.params[i].piece)
                index.append(state.params[i])
            g["params"] = list(range(pos, pos + len(members)))
            pos += len(members)
        scalars, flats = {}, {}
        for h in heads:  # each parameter's state from whichever rank saved it
            for key, value in h["scalars"].items():
                scalars.setdefault(key, value)
            for og, templates in h["flats"].items():
                for key, template in templates.items():
                    flats.setdefault(og, {}).setdefault(key, template)
    out_state: dict[int, dict[str, Any]] = {}
    for i, zp in enumerate(index):
        if zp is None or str(zp.index) not in scalars:
            continue
        src = sources[zp.fqn]
        entry = dict(scalars[str(zp.index)])
        lo, hi = src.span(zp)
        for key, template in flats.get(str(src.group), {}).items():

            def saved_flat(r: int, og: int = src.group, key: str = key) -> torch.Tensor | None:
                return files.get(r)["optimizers"][which]["flats"].get(str(og), {}).get(key)

            entry[key] = _assemble(lo, hi, src.old_shard, saved_flat, template.dtype)
        out_state[i] = entry
    return {"state": out_state, "param_groups": param_groups}, added


def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    weights_only: bool | None = None,
) -> Path:
    """Writes one plain ``state_dict`` file (``.pt``, or ``.safetensors`` when the name ends so) from a sharded
    checkpoint, one parameter at a time: rank files are memory-mapped and each full parameter is assembled, written
    and dropped, so the process holds about one parameter (see [Note: streaming a state dict to disk] in
    ``_export.py``), whatever the model's size.

    Reads ``meta.json`` and the rank files only (shards, and buffers from rank 0's), weights-only unless
    ``weights_only=False`` (needed only for buffers or extra state that are not plain data); never the client state's
    objects. The result loads with ``model.load_state_dict(torch.load(out))``; tied weights appear under every name.

    Raises:
        CheckpointError: as ``load_sharded``.
        UnsafeCheckpointError: a file needs full unpickling and ``weights_only`` is not ``False``.
    """
    from zlightning.zero._export import StateDictWriter, TensorSpec

    ckpt_dir, out = resolve(ckpt_dir), Path(out)
    from zlightning.zero._tp_checkpoint import consolidate_tp, is_tp_checkpoint

    if is_tp_checkpoint(ckpt_dir):  # see [Note: sharded checkpoints with tensor parallelism]
        return consolidate_tp(ckpt_dir, out, dtype=dtype, progress=progress, weights_only=weights_only)
    meta, payloads, buffers = open_for_consolidation(ckpt_dir, weights_only)

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() else t

    specs = []
    for g in meta["groups"]:
        saved = getattr(torch, g["dtype"])
        target = dtype if saved.is_floating_point else saved
        specs += [TensorSpec(tuple(p["fqns"]), tuple(p["shape"]), target) for p in g["params"]]
    specs += [
        TensorSpec((k,), tuple(v.shape), cast(v).dtype) for k, v in buffers.items() if isinstance(v, torch.Tensor)
    ]
    objects = {k: v for k, v in buffers.items() if not isinstance(v, torch.Tensor)}  # non-tensor extra state
    writer = StateDictWriter(out, specs, objects)
    try:
        for p, full in full_parameters(meta, payloads, progress=progress, desc=f"consolidating {ckpt_dir.name}"):
            writer.write(p["fqns"][0], cast(full))
            del full
        for key, value in buffers.items():
            if isinstance(value, torch.Tensor):
                writer.write(key, cast(value))
    except BaseException:
        writer.abort()
        raise
    return writer.close()


def open_for_consolidation(
    ckpt_dir: Path, weights_only: bool | None
) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """``meta.json``, every rank file (memory-mapped) and the buffers of a sharded checkpoint, files verified."""
    meta = read_metadata(ckpt_dir)
    world = int(meta["world_size"])
    legacy = meta["version"] == 1 and (ckpt_dir / CLIENT).is_file()  # buffers in the client state
    _verify_files(ckpt_dir, meta, [_rank_file(r) for r in range(world)] + ([CLIENT] if legacy else []))
    payloads = [
        load_file(ckpt_dir / _rank_file(r), weights_only=weights_only, opt_in=CONSOLIDATE_OPT_IN, mmap="shared")
        for r in range(world)
    ]
    buffers: dict[str, Any] = dict(payloads[0].get(BUFFERS, {}))
    if legacy:
        buffers = load_file(ckpt_dir / CLIENT, weights_only=weights_only, opt_in=CONSOLIDATE_OPT_IN).get(BUFFERS, {})
    return meta, payloads, buffers


def full_parameters(
    meta: Mapping[str, Any], payloads: Sequence[Mapping[str, Any]], *, progress: bool = False, desc: str = ""
) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
    """Each saved parameter's metadata and full value (its saved dtype and shape), assembled from the rank slices one
    at a time, in the saved order."""
    world = int(meta["world_size"])
    groups: Any = list(enumerate(meta["groups"]))
    if progress:
        try:
            from tqdm import tqdm

            groups = tqdm(groups, desc=desc, unit="group")
        except ImportError:
            pass
    for gi, g in groups:
        shard = -(-g["numel"] // world)
        for p in g["params"]:

            def saved_shard(r: int, gi: int = gi) -> torch.Tensor | None:
                return payloads[r]["shards"][gi]

            full = _assemble(p["offset"], p["offset"] + p["numel"], shard, saved_shard, getattr(torch, g["dtype"]))
            yield p, full.view(p["shape"])
