"""Stage-to-stage transfers of tensors and nested tuples/lists/dicts of tensors (stateless apart from a per-channel
metadata cache).

[Note: negotiated metadata]
A transfer is a small int64 header, then (only when the structure, shapes, dtypes or grad flags differ from the last
transfer on that channel) a pickled description, then the tensors themselves. The receiver allocates its buffers from
the description, so shapes may change from batch to batch (variable sequence length) at the cost of one extra
message only when they do. The description records which floating tensors require grad; exactly those get a
gradient back (``send_grads``/``recv_grads`` need no header since the sender already knows the shapes), which avoids
DeepSpeed's hang when an output float tensor does not require grad (PR #5518). Bool tensors travel as uint8.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["P2P", "TensorMeta", "flatten", "unflatten"]


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad and t.is_floating_point()))


def flatten(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Splits a tensor / tuple / list / dict (str keys) structure into its tensors and a picklable skeleton; other
    leaves (ints, strings, None) stay in the skeleton."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return ("T", len(tensors) - 1)
        if isinstance(x, (tuple, list)):
            return ("L" if isinstance(x, list) else "U", [walk(v) for v in x])
        if isinstance(x, dict):
            return ("D", [(k, walk(v)) for k, v in x.items()])
        return ("V", x)

    return tensors, walk(obj)


def unflatten(tensors: list[torch.Tensor], skeleton: Any) -> Any:
    kind, payload = skeleton
    if kind == "T":
        return tensors[payload]
    if kind == "L":
        return [unflatten(tensors, s) for s in payload]
    if kind == "U":
        return tuple(unflatten(tensors, s) for s in payload)
    if kind == "D":
        return {k: unflatten(tensors, s) for k, s in payload}
    return payload


@dataclass
class P2P:
    """Point-to-point transfers of one rank. Sends are asynchronous (finish them with ``wait``); receives block."""

    device: torch.device
    group: dist.ProcessGroup | None = None
    """Group whose ranks are addressed by global rank (``dist`` translates them)."""
    _sent_meta: dict[int, bytes] = field(default_factory=dict)
    _recv_meta: dict[int, tuple[Any, list[TensorMeta]]] = field(default_factory=dict)
    _pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)

    def _isend(self, t: torch.Tensor, dst: int) -> None:
        work = dist.isend(t, dst, group=self.group)
        self._pending.append((work, t))  # keep the buffer alive until the send completes

    def send(self, obj: Any, dst: int) -> list[TensorMeta]:
        """Sends a structure of tensors to ``dst``; returns the metadata of its tensors (grad flags included)."""
        tensors, skeleton = flatten(obj)
        metas = [TensorMeta.of(t) for t in tensors]
        blob = pickle.dumps((skeleton, metas))
        changed = self._sent_meta.get(dst) != blob
        header = torch.tensor([len(blob) if changed else 0], dtype=torch.int64, device=self.device)
        self._isend(header, dst)
        if changed:
            self._sent_meta[dst] = blob
            self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst)
        for t in tensors:
            t = t.detach()
            self._isend((t.view(torch.uint8) if t.dtype == torch.bool else t).contiguous(), dst)
        return metas

    def recv(self, src: int) -> Any:
        """Receives a structure sent by ``send``; floating tensors that required grad on the sender require grad."""
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=self.group)
        n = int(header.item())
        if n:
            blob = torch.empty(n, dtype=torch.uint8, device=self.device)
            dist.recv(blob, src, group=self.group)
            self._recv_meta[src] = pickle.loads(blob.cpu().numpy().tobytes())
        if src not in self._recv_meta:
            raise AssertionError(f"first transfer from rank {src} came without metadata")
        skeleton, metas = self._recv_meta[src]
        tensors = []
        for m in metas:
            buf = torch.empty(m.shape, dtype=torch.uint8 if m.dtype == torch.bool else m.dtype, device=self.device)
            dist.recv(buf, src, group=self.group)
            t = buf.view(torch.bool) if m.dtype == torch.bool else buf
            tensors.append(t.requires_grad_(True) if m.requires_grad else t)
        return unflatten(tensors, skeleton)

    def send_grads(self, grads: list[torch.Tensor], dst: int) -> None:
        for g in grads:
            self._isend(g.detach().contiguous(), dst)

    def recv_grads(self, metas: list[TensorMeta], src: int) -> list[torch.Tensor]:
        """Receives one gradient per ``metas`` entry that requires grad, in order."""
        out = []
        for m in metas:
            if m.requires_grad:
                buf = torch.empty(m.shape, dtype=m.dtype, device=self.device)
                dist.recv(buf, src, group=self.group)
                out.append(buf)
        return out

    def wait(self) -> None:
        """Completes every outstanding send."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
