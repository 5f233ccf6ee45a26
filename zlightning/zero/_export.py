"""Full weights out of a sharded model without ever holding them: streaming state-dict files and per-group gathers.

[Note: streaming a state dict to disk]
``torch.save`` needs the whole dict in memory. A ``.pt`` file is a zip archive of ``data.pkl`` (the pickled object,
in which every tensor refers to a storage record by key) plus one ``data/<key>`` record of raw bytes per storage, so
the pickle can be written first from shapes and dtypes alone and the storages appended one by one as they become
available: `StateDictWriter` does that with PyTorch's own archive writer, and the result is an ordinary file that
``torch.load(..., weights_only=True)`` (and ``mmap=True``) reads. A ``.safetensors`` file is a JSON header with every
tensor's byte range followed by the data, so the header is written first and each tensor lands at its offset. Either
way the writer holds one tensor at a time. The live engine (`save_full_state_dict`, `iter_full_state_dict`) and
``zlightning consolidate`` (from a sharded checkpoint on disk) both write through it.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pickle
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zlightning.zero._collectives import all_gather_into
from zlightning.zero._param import ZeroParam
from zlightning.zero._state import ZeroState, engine_of

__all__ = [
    "LazyTensor",
    "StateDictWriter",
    "TensorSpec",
    "save_streaming",
    "iter_full_state_dict",
    "save_full_state_dict",
    "summon_full_params",
]

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a state dict to be written: every name it is stored under (tied weights share one storage),
    its shape and dtype."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


class _StorageRef:
    """Stands for a storage record in the pickle (see `_Pickler.persistent_id`)."""

    def __init__(self, key: str, spec: TensorSpec) -> None:
        self.key = key
        self.spec = spec


class _TensorRef:
    """Pickles as PyTorch pickles a contiguous CPU tensor over a whole storage, without the data."""

    def __init__(self, storage: _StorageRef) -> None:
        self.storage = storage

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _rebuild_args(self.storage)


def _rebuild_args(storage: _StorageRef) -> tuple[Any, ...]:
    shape = storage.spec.shape
    stride = torch.empty(shape, device="meta").stride()
    return torch._utils._rebuild_tensor_v2, (storage, 0, shape, stride, False, collections.OrderedDict())


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageRef):
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.spec.dtype])
            return ("storage", kind, obj.key, "cpu", torch.Size(obj.spec.shape).numel())
        return None


def _open_archive(path: Path, pickled: bytes) -> Any:
    """A PyTorch archive writer with ``data.pkl`` and the format records written; storages follow."""
    archive = torch._C.PyTorchFileWriter(str(path))
    try:
        archive.write_record("data.pkl", pickled, len(pickled))
        # the binding takes str records too, as torch.serialization writes them (its stub lists bytes only)
        archive.write_record(".format_version", "1", 1)  # type: ignore[arg-type]
        align = str(torch.serialization._get_storage_alignment())
        archive.write_record(".storage_alignment", align, len(align))  # type: ignore[arg-type]
        archive.write_record("byteorder", sys.byteorder, len(sys.byteorder))  # type: ignore[arg-type]
    except BaseException:
        _finish_quietly(archive)
        raise
    return archive


def _finish_quietly(archive: Any) -> None:
    """Finalises an archive whose writing failed, so that its destructor does not try again: on a full disk that
    second write throws inside a C++ destructor, which aborts the whole process (std::terminate)."""
    try:
        archive.write_end_of_file()  # marks the archive finished even when it raises
    except Exception:  # noqa: BLE001 - the caller raises the first failure
        pass


def _write_storage(archive: Any, key: str, tensor: torch.Tensor, spec: TensorSpec) -> None:
    data = tensor.detach().contiguous().cpu()
    if data.storage_offset() != 0 or data.untyped_storage().nbytes() != spec.nbytes:
        data = data.clone()
    archive.write_record(f"data/{key}", data.untyped_storage(), spec.nbytes)


class LazyTensor:
    """A tensor for `save_streaming` that is produced only when its bytes are written (then dropped)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, produce: Callable[[], torch.Tensor]) -> None:
        self.spec = TensorSpec(("",), tuple(shape), dtype)
        self.produce = produce


def save_streaming(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that holds one tensor at a time: every tensor (and `LazyTensor`) in ``obj`` is
    written as its own contiguous storage after the pickle, a `LazyTensor` produced just before it is written. The
    file loads with ``torch.load(..., weights_only=True)`` when ``obj`` is otherwise plain data. Tensors that share
    storage are written separately (no aliasing is kept)."""
    pending: list[tuple[_StorageRef, Callable[[], torch.Tensor]]] = []

    class Pickler(_Pickler):
        def reducer_override(self, value: Any) -> Any:
            if isinstance(value, LazyTensor):
                ref = _StorageRef(str(len(pending)), value.spec)
                pending.append((ref, value.produce))
                return _rebuild_args(ref)
            if isinstance(value, torch.Tensor):
                ref = _StorageRef(str(len(pending)), TensorSpec(("",), tuple(value.shape), value.dtype))

                def produce(t: torch.Tensor = value) -> torch.Tensor:
                    return t

                pending.append((ref, produce))
                return _rebuild_args(ref)
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    archive = _open_archive(Path(path), buf.getvalue())
    try:
        for ref, produce in pending:
            tensor = produce()
            if tuple(tensor.shape) != ref.spec.shape or tensor.dtype != ref.spec.dtype:
                raise ValueError(
                    f"save_streaming: a lazy tensor produced {tuple(tensor.shape)} {tensor.dtype}, "
                    f"declared {ref.spec.shape} {ref.spec.dtype}"
                )
            _write_storage(archive, ref.key, tensor, ref.spec)
            del tensor
    except BaseException:
        _finish_quietly(archive)
        raise
    archive.write_end_of_file()


class StateDictWriter:
    """Writes a state dict to ``path`` one tensor at a time (see [Note: streaming a state dict to disk]).

    Declare every tensor up front (`TensorSpec`, in the order the dict should have), then call `write` once per spec
    in any order, then `close`. ``.safetensors`` paths get the safetensors format, anything else PyTorch's.
    ``objects`` are entries that are not tensors (a module's ``get_extra_state()``), pickled as they are after the
    tensors (``.pt`` only).

    Raises:
        ValueError: a dtype safetensors cannot hold, non-tensor ``objects`` for safetensors, a name declared twice,
            or a tensor that does not match its spec.
    """

    def __init__(
        self, path: str | os.PathLike[str], specs: Sequence[TensorSpec], objects: Mapping[str, Any] | None = None
    ) -> None:
        self.path = Path(path)
        self.specs = list(specs)
        self.objects = dict(objects or {})
        if self.objects and self.path.suffix == ".safetensors":
            raise ValueError(_objects_refused(self.path, self.objects))
        names = [n for s in self.specs for n in s.names] + list(self.objects)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"StateDictWriter: names declared more than once: {dup[:5]}")
        self._index = {n: i for i, s in enumerate(self.specs) for n in s.names}
        self._written: set[int] = set()
        self.safetensors = self.path.suffix == ".safetensors"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.safetensors:
            self._open_safetensors()
        else:
            self._open_pt()

    def _open_pt(self) -> None:
        refs = [_TensorRef(_StorageRef(str(i), s)) for i, s in enumerate(self.specs)]
        obj: dict[str, Any] = collections.OrderedDict((n, refs[i]) for i, s in enumerate(self.specs) for n in s.names)
        obj.update(self.objects)
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(obj)
        self._zip = _open_archive(self.path, buf.getvalue())

    def _open_safetensors(self) -> None:
        header: dict[str, Any] = {}
        self._offsets: list[int] = []
        offset = 0
        for s in self.specs:
            if s.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(f"safetensors cannot store {s.dtype} ({s.names[0]}): write a .pt file instead")
            self._offsets.append(offset)
            for n in s.names:  # safetensors has no aliasing: tied names get their own copy of the bytes
                header[n] = {"dtype": _SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape), "data_offsets": []}
            offset += s.nbytes * len(s.names)
        for i, s in enumerate(self.specs):
            for j, n in enumerate(s.names):
                start = self._offsets[i] + j * s.nbytes
                header[n]["data_offsets"] = [start, start + s.nbytes]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._file.write(len(raw).to_bytes(8, "little") + raw)
        self._data_start = 8 + len(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Writes the tensor declared under ``name`` (any of its names)."""
        if name not in self._index:
            raise ValueError(f"StateDictWriter.write: {name!r} was not declared")
        i = self._index[name]
        spec = self.specs[i]
        if i in self._written:
            raise ValueError(f"StateDictWriter.write: {name!r} was written already")
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"StateDictWriter.write: {name!r} is {tuple(tensor.shape)} {tensor.dtype}, declared as {spec.shape} "
                f"{spec.dtype}"
            )
        if self.safetensors:
            data = tensor.detach().contiguous().cpu()
            # reshape: a 0-d tensor (BatchNorm's num_batches_tracked, a scalar buffer) cannot be viewed as bytes
            raw = data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b""
            for j in range(len(spec.names)):
                self._file.seek(self._data_start + self._offsets[i] + j * spec.nbytes)
                self._file.write(raw)
        else:
            _write_storage(self._zip, str(i), tensor, spec)
        self._written.add(i)

    def abort(self) -> None:
        """Closes and removes a partly written file (after a failure)."""
        try:
            if self.safetensors:
                self._file.close()
            else:
                _finish_quietly(self._zip)
                del self._zip
        finally:
            self.path.unlink(missing_ok=True)

    def close(self) -> Path:
        """Finishes the file.

        Raises:
            ValueError: some declared tensors were never written (the file is removed).
        """
        missing = [s.names[0] for i, s in enumerate(self.specs) if i not in self._written]
        if self.safetensors:
            self._file.close()
        else:
            self._zip.write_end_of_file()
            del self._zip
        if missing:
            self.path.unlink(missing_ok=True)
            raise ValueError(f"StateDictWriter.close: never written: {missing[:5]}")
        return self.path


def _objects_refused(path: Path, objects: Mapping[str, Any]) -> str:
    kinds = ", ".join(f"{k} ({type(v).__name__})" for k, v in list(objects.items())[:5])
    return (
        f"{path.name}: safetensors holds tensors only, and the state dict has other entries: {kinds} (a module's "
        "get_extra_state() returning a non-tensor). Write a .pt file instead (it keeps them), or make "
        "get_extra_state() return a tensor."
    )


def _gather_group(state: ZeroState, group: Any, to_rank0: bool) -> torch.Tensor | None:
    """The group's full flat master values ([T]) on the receiving ranks (rank 0 only when ``to_rank0``); collective.
    One group is gathered at a time, into a buffer of the group's size."""
    full = torch.empty(group.world * group.shard_numel, dtype=group.master_dtype, device=group.device)
    chunk = full[group.rank * group.shard_numel : (group.rank + 1) * group.shard_numel]
    chunk.copy_(group.shard)
    if group.world > 1 and to_rank0:  # point to point into rank 0's buffer: no temporaries
        if state.rank == 0:
            for r, piece in enumerate(full.chunk(group.world)):
                if r:
                    dist.recv(piece, group_src=r, group=state.process_group)
        else:
            dist.send(chunk, group_dst=0, group=state.process_group)
    elif group.world > 1:
        all_gather_into(full, state.process_group, async_op=False)
    if to_rank0 and state.rank != 0:
        return None
    return full[: group.numel]


def iter_full_state_dict(
    state: ZeroState, *, rank0_only: bool = True, dtype: torch.dtype | None = None
) -> Iterator[tuple[ZeroParam, torch.Tensor]]:
    """Yields ``(parameter, full CPU tensor)`` group by group (collective: every rank iterates to the end).

    Receiving ranks (rank 0, or all with ``rank0_only=False``) get every parameter; the others get nothing but must
    still exhaust the iterator. Beyond its shards a rank holds one group's gathered values and the tensor it was
    just given.
    """
    with state.resident():  # parameter offload: shards come back from disk for the duration
        for group in state.groups:
            flat = _gather_group(state, group, to_rank0=rank0_only)
            if flat is None:
                continue
            for zp in group.params:
                t = flat[zp.offset : zp.offset + zp.numel].view(zp.shape)
                yield (
                    zp,
                    t.to(
                        device="cpu", dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype, copy=True
                    ),
                )
            del flat


def _non_param_entries(state: ZeroState) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Buffers and tensor extra state of the module, and its entries that are not tensors (extra state such as a
    dict), as ``state_dict()`` would write them."""
    param_names = {n for zp in state.params for n in zp.fqns}
    tensors, objects = {}, {}
    for key, value in state.root.state_dict().items():
        if key in param_names:
            continue
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        else:
            objects[key] = value
    return tensors, objects


def save_full_state_dict(
    module: nn.Module | ZeroState, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> Path | None:
    """Writes the unsharded model's ``state_dict()`` to ``path`` on rank 0, streaming (collective). ``module`` is
    the sharded module (the one ``zero3_shard`` or the strategy sharded) or its engine.

    The file loads with ``model.load_state_dict(torch.load(path))`` into the plain model (``.safetensors``: with
    ``safetensors.torch.load_file``). No rank ever holds more than one gathered group beyond its shards, so this
    works for a model that only fits sharded. ``dtype`` casts floating-point tensors (e.g. ``torch.bfloat16``).

    Returns:
        The path on rank 0, None on the other ranks.
    """
    state = _engine(module)
    extra, objects = _non_param_entries(state)
    if objects and Path(path).suffix == ".safetensors":  # every rank refuses, before any collective
        raise ValueError(f"save_full_state_dict: {_objects_refused(Path(path), objects)}")
    order = list(state.root.state_dict().keys())
    cast = lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t
    specs_by_key: dict[str, TensorSpec] = {}
    for zp in state.params:
        d = dtype if dtype is not None and zp.dtype.is_floating_point else zp.dtype
        spec = TensorSpec(tuple(n for n in order if n in zp.fqns) or tuple(zp.fqns), tuple(zp.shape), d)
        specs_by_key[spec.names[0]] = spec
    for key, value in extra.items():
        specs_by_key[key] = TensorSpec((key,), tuple(value.shape), cast(value).dtype)
    specs = [specs_by_key[k] for k in order if k in specs_by_key]
    writer = StateDictWriter(path, specs, objects) if state.rank == 0 else None
    try:
        for zp, tensor in iter_full_state_dict(state, rank0_only=True, dtype=dtype):
            if writer is not None:
                writer.write(zp.fqns[0], tensor)
        if writer is not None:
            for key, value in extra.items():
                writer.write(key, cast(value))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return writer.close() if writer is not None else None


def _engine(module_or_state: nn.Module | ZeroState) -> ZeroState:
    if isinstance(module_or_state, ZeroState):
        return module_or_state
    state = engine_of(module_or_state)
    if state is None:
        raise ValueError(
            f"{type(module_or_state).__name__} is not sharded by zlightning's ZeRO engine (pass the module that "
            "zero3_shard or the zstack_zero3 strategy sharded, e.g. the LightningModule, or its ZeroState)"
        )
    return state


def _written_back(zp: ZeroParam, full: nn.Parameter) -> torch.Tensor:
    """What ``summon_full_params(writeback=True)`` keeps for ``zp``: the summoned tensor (edited in place), or a
    tensor of the same shape the user assigned to its one module slot inside the block (``m.bias = nn.Parameter(..)``).

    Raises:
        ValueError: a replacement of another shape (or None), or a tied parameter replaced in some of its slots.
    """
    held = [module._parameters.get(name) for module, name in zp.slots]  # dict.get: no gather hook
    if all(t is full for t in held):
        return full
    if len(held) == 1 and held[0] is not None and tuple(held[0].shape) == tuple(zp.shape):
        return held[0]
    got = ", ".join(
        f"{name}: {'None' if t is None else tuple(t.shape)}{' (summoned)' if t is full else ''}"
        for name, t in zip(zp.fqns, held)
    )
    raise ValueError(
        f"summon_full_params(writeback=True): parameter {zp.fqn} (shape {tuple(zp.shape)}) was replaced inside the "
        f"block ({got}). The shards keep each parameter's shape and ties: edit its values in place instead "
        "(`with torch.no_grad(): p.copy_(new)`), and give tied parameters the same values in every slot."
    )


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module | ZeroState, *, rank0_only: bool = False, writeback: bool = False, offload_to_cpu: bool = True
) -> Iterator[nn.Module | None]:
    """Gives the sharded module its full parameters for the duration of the block (collective: every rank enters).

    Parameters are gathered one group at a time and copied out (to the CPU with ``offload_to_cpu``), so the shards'
    device never holds more than one gathered group beyond the shards; the receiving ranks hold the full model where
    the copies go. Inside the block the module is a plain module on the receiving ranks (rank 0 with
    ``rank0_only``, else every rank): call it, generate text with it, read its ``state_dict()``. The engine's hooks
    are paused, so ranks do not have to call it together; with ``rank0_only`` the other ranks must not call it.
    After the block the shards are back; with ``writeback`` (every rank receiving) changes made to the parameters
    inside are kept: in-place edits, and a parameter of the same shape assigned to its module (not to one slot of a
    tied parameter).

    Yields:
        The module on the receiving ranks, None on the others.

    Raises:
        ValueError: ``writeback`` with ``rank0_only``, a module that is not sharded, or (with ``writeback``) a
            parameter replaced by one of another shape.
    """
    state = _engine(module)
    if writeback and rank0_only:
        raise ValueError(
            "summon_full_params(writeback=True) needs every rank to hold the full parameters: rank0_only=False"
        )
    receiving = not rank0_only or state.rank == 0
    fulls: dict[int, nn.Parameter] = {}
    with state.paused_hooks():
        try:
            for zp, tensor in iter_full_state_dict(state, rank0_only=rank0_only):
                value = tensor if offload_to_cpu else tensor.to(state.device)
                fulls[zp.index] = nn.Parameter(value, requires_grad=zp.requires_grad)
                zp.install(fulls[zp.index])
            yield state.root if receiving else None
            if writeback:
                kept = {zp.index: _written_back(zp, fulls[zp.index]) for zp in state.params}  # before any copy
                with torch.no_grad(), state.resident():
                    for zp in state.params:
                        zp.piece.copy_(zp.local_slice_of(kept[zp.index].detach().to(zp.piece.device)))
        finally:
            for zp in state.params:
                zp.install(zp.piece)
            fulls.clear()
    if writeback:
        state.on_optimizer_step()  # gathered copies are stale
