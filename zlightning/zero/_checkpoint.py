"""Full (world-size independent) state dicts of a ZeRO-3 model and its optimizer, and restoring a plain module.

[Note: full-state checkpoints]
A full state dict has the same keys, shapes and dtypes as the unsharded model's ``state_dict()``, and the optimizer
one the same structure as a single-process ``optimizer.state_dict()``, so a checkpoint written at one world size
loads at any other and loads into the plain model without zlightning. Gathering is collective (every rank calls;
``rank0_only`` keeps the result on rank 0) and walks one group at a time, so peak extra memory is one full model copy
on the receiving rank plus one group. To write full weights without holding them, see ``_export.py``
(``save_full_state_dict``); sharded checkpoints are ``_sharded_checkpoint.py``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zlightning._dist_compat import all_gather_single
from zlightning.zero._param import ZeroParam
from zlightning.zero._param_group import ZeroParamGroup
from zlightning.zero._state import ZeroState, engine_of

__all__ = [
    "full_optim_state_dict",
    "full_state_dict",
    "load_full_optim_state_dict",
    "load_full_state_dict",
    "remap_optimizer",
    "unshard_module",
]


def _gather_flat(group: ZeroParamGroup, local: torch.Tensor) -> torch.Tensor:
    """All-gathers a per-rank [S] tensor laid out like the group's shard into the full [W*S] layout."""
    out = torch.empty(group.world * group.shard_numel, dtype=local.dtype, device=local.device)
    if group.world == 1:
        out.copy_(local)
    else:
        all_gather_single(out, local.contiguous(), group=group.context.process_group)
    return out


def _is_rank0(state: ZeroState) -> bool:
    return state.rank == 0


def full_state_dict(state: ZeroState | nn.Module, *, rank0_only: bool = False, cpu: bool = True) -> dict[str, Any]:
    """The unsharded model's ``state_dict()`` (fp32 masters), assembled group by group. Collective.

    ``state`` is the engine or the module it shards. The result holds the whole model on every receiving rank: to
    write it to disk without that, use ``save_full_state_dict``.
    """
    if isinstance(state, nn.Module):
        engine = engine_of(state)
        if engine is None:
            raise ValueError(f"full_state_dict: {type(state).__name__} is not sharded by zlightning's ZeRO engine")
        state = engine
    base = state.root.state_dict()  # pieces under parameter keys; buffers and extra state as they are
    keep = not rank0_only or _is_rank0(state)
    fulls: dict[str, torch.Tensor] = {}
    with state.resident():  # parameter offload: shards come back from disk for the duration
        for group in state.groups:
            flat = _gather_flat(group, group.shard)
            if not keep:
                continue
            for zp in group.params:
                t = flat[zp.offset : zp.offset + zp.numel].view(zp.shape).clone()
                t = t.cpu() if cpu else t
                for name in zp.fqns:
                    fulls[name] = t
    if not keep:
        return {}
    out: dict[str, Any] = {}
    for key, value in base.items():
        if key in fulls:
            out[key] = fulls[key]
        else:
            out[key] = value.detach().cpu() if cpu and isinstance(value, torch.Tensor) else value
    return out


def load_full_state_dict(state: ZeroState, state_dict: Mapping[str, Any], strict: bool = True) -> None:
    """Loads a full (unsharded) model state dict into the shards; every rank passes the same dict.

    Raises:
        KeyError: ``strict`` and keys are missing or unexpected (names listed).
        ValueError: a tensor's shape differs from the model's (names and shapes listed).
    """
    param_keys = {name for zp in state.params for name in zp.fqns}
    missing = sorted(name for name in param_keys if name not in state_dict)
    rest = {k: v for k, v in state_dict.items() if k not in param_keys}
    result = state.root.load_state_dict(rest, strict=False)
    missing += [k for k in result.missing_keys if k not in param_keys]
    unexpected = list(result.unexpected_keys)
    if strict and (missing or unexpected):
        raise KeyError(
            f"state dict does not match {type(state.root).__name__}: missing keys {missing[:10]}"
            f"{'...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{'...' if len(unexpected) > 10 else ''}. Pass strict=False to load the overlap."
        )
    bad = [
        f"{zp.fqn}: checkpoint {tuple(state_dict[zp.fqn].shape)} vs model {tuple(zp.shape)}"
        for zp in state.params
        if zp.fqn in state_dict and tuple(state_dict[zp.fqn].shape) != tuple(zp.shape)
    ]
    if bad:
        raise ValueError(
            "checkpoint tensors have the wrong shape (was it saved from another model?): " + "; ".join(bad)
        )
    with torch.no_grad(), state.resident():
        for zp in state.params:
            src = next((state_dict[n] for n in zp.fqns if n in state_dict), None)
            if src is not None:
                zp.piece.copy_(zp.local_slice_of(src.to(zp.piece.device, zp.piece.dtype)))
    state.on_optimizer_step()  # gathered copies are stale


def remap_optimizer(
    state: ZeroState, optimizer: torch.optim.Optimizer, stand_ins: Mapping[int, ZeroParam] | None = None
) -> None:
    """Re-points an optimizer built over the full parameters (or over ``stand_ins``, see
    ``ZeroState.full_shape_stand_ins``) to their shard pieces (in place).

    Raises:
        ValueError: the optimizer already holds state (it must be fresh so that state shapes match the pieces).
    """
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            f"{type(optimizer).__name__} already has state for some parameters; ZeRO-3 re-points the optimizer to "
            "parameter shards and needs a fresh optimizer (create it before the first step, or load its state after "
            "sharding with load_full_optim_state_dict)."
        )
    by_original = {id(zp.original): zp.piece for zp in state.params}
    by_original.update({key: zp.piece for key, zp in (stand_ins or {}).items()})
    for group in optimizer.param_groups:
        group["params"][:] = [by_original.get(id(p), p) for p in group["params"]]
    optimizer.state.clear()


def _indexed_pieces(state: ZeroState, optimizer: torch.optim.Optimizer) -> list[ZeroParam | None]:
    return [state.zero_param_of(p) for g in optimizer.param_groups for p in g["params"]]


def _per_element(value: Any, zp: ZeroParam, key: str) -> bool:
    return isinstance(value, torch.Tensor) and key != "step" and value.dim() == 1 and value.numel() == zp.local_numel


def full_optim_state_dict(
    state: ZeroState, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
) -> dict[str, Any]:
    """The optimizer state dict a single-process run would have (full shapes). Collective.

    Per-element state tensors (Adam's moments) are gathered group by group; scalars (``step``) are taken as they are.
    """
    sd = optimizer.state_dict()
    pieces = _indexed_pieces(state, optimizer)
    keep = not rank0_only or _is_rank0(state)
    full_state: dict[int, dict[str, Any]] = {}
    if keep:  # copies: the caller owns the result (Adam's ``step`` would otherwise keep counting)
        full_state = {
            i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in sd["state"].items()
        }
    index_of = {zp.index: i for i, zp in enumerate(pieces) if zp is not None}
    for group in state.groups:
        members = [(index_of[zp.index], zp) for zp in group.params if zp.index in index_of]
        keys = sorted({k for i, zp in members for k, v in sd["state"].get(i, {}).items() if _per_element(v, zp, k)})
        for key in keys:
            local = torch.zeros(group.shard_numel, dtype=torch.float32, device=group.device)
            base = group.rank * group.shard_numel
            for i, zp in members:
                value = sd["state"].get(i, {}).get(key)
                if value is not None:
                    local[zp.local_start - base : zp.local_end - base].copy_(value)
            flat = _gather_flat(group, local)
            if not keep:
                continue
            for i, zp in members:
                if i in full_state and key in full_state[i]:
                    dtype = full_state[i][key].dtype
                    full_state[i][key] = flat[zp.offset : zp.offset + zp.numel].view(zp.shape).to(dtype).cpu()
    if not keep:
        return {}
    return {"state": full_state, "param_groups": sd["param_groups"]}


def load_full_optim_state_dict(state: ZeroState, optimizer: torch.optim.Optimizer, full: Mapping[str, Any]) -> None:
    """Loads a full optimizer state dict (as from ``full_optim_state_dict`` or a single-process run) into shards.

    Raises:
        ValueError: the number of parameters or a state tensor's shape does not match.
    """
    pieces = _indexed_pieces(state, optimizer)
    n_saved = sum(len(g["params"]) for g in full["param_groups"])
    if n_saved != len(pieces):
        raise ValueError(
            f"optimizer checkpoint has {n_saved} parameters but the optimizer has {len(pieces)}: it was saved from "
            "another model or optimizer configuration"
        )
    sharded: dict[int, dict[str, Any]] = {}
    for i, entry in full["state"].items():
        zp = pieces[int(i)]
        out = {}
        for key, value in entry.items():
            if zp is not None and isinstance(value, torch.Tensor) and key != "step" and value.shape == zp.shape:
                out[key] = zp.local_slice_of(value).clone()
            elif zp is not None and isinstance(value, torch.Tensor) and key != "step" and value.numel() == zp.numel > 1:
                raise ValueError(
                    f"optimizer state {key!r} of {zp.fqn} has shape {tuple(value.shape)}, expected {tuple(zp.shape)}"
                )
            else:
                out[key] = value
        sharded[int(i)] = out
    optimizer.load_state_dict({"state": sharded, "param_groups": full["param_groups"]})


def unshard_module(state: ZeroState, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
    """Turns the module back into a plain one on every rank: full fp32 parameters restored in the original
    ``nn.Parameter`` objects, hooks removed. ``optimizers`` attached to the engine are re-pointed to the original
    parameters with their full state, so they keep working (and checkpoint correctly) on the plain module.
    Collective. The engine must not be used afterwards."""
    full_optim = [full_optim_state_dict(state, opt) for opt in optimizers]
    state.release_all(keep_persistent=False)
    with state.resident():
        for group in state.groups:
            flat = _gather_flat(group, group.shard)
            for zp in group.params:
                full = flat[zp.offset : zp.offset + zp.numel].view(zp.shape).clone()
                if zp.original.is_meta:  # sharded init: there never was a real tensor to refill
                    zp.original = nn.Parameter(full, requires_grad=zp.requires_grad)
                else:
                    with torch.no_grad():
                        zp.original.data = full
                zp.original.requires_grad_(zp.requires_grad)
                zp.install(zp.original)
    state.remove_hooks()
    by_piece = {id(zp.piece): zp.original for zp in state.params}
    for opt, full_state in zip(optimizers, full_optim):
        for param_group in opt.param_groups:
            param_group["params"][:] = [by_piece.get(id(p), p) for p in param_group["params"]]
        opt.state.clear()
        opt.load_state_dict(full_state)
