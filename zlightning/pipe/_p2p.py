"""Stage-to-stage transfers of tensors and nested tuples/lists/dicts of tensors (stateless apart from a per-channel
metadata cache).

[Note: negotiated metadata]
A transfer is a small int64 header, then (only when the structure, shapes, dtypes or grad flags differ from the last
transfer on that channel) a pickled description, then the tensors themselves. The receiver allocates its buffers from
the description, so shapes may change from batch to batch (variable sequence length) at the cost of one extra
message only when they do (with gloo, also one payload of zeros; see [Note: receives posted ahead]). The description records which floating tensors require grad; exactly those get a
gradient back (``send_grads``/``recv_grads`` need no header since the sender already knows the shapes), which avoids
DeepSpeed's hang when an output float tensor does not require grad (PR #5518). Bool tensors travel as uint8.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Incoming", "IncomingGrads", "P2P", "TensorMeta", "flatten", "unflatten"]


@dataclass(frozen=True)
class TensorMeta:
    """What the receiver needs to allocate one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @staticmethod
    def of(t: torch.Tensor) -> TensorMeta:
        return TensorMeta(tuple(t.shape), t.dtype, bool(t.requires_grad and t.is_floating_point()))


def _wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if dtype == torch.bool else dtype


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


_TAG_META = 1
"""Tag of headers and pickled descriptions; activations and gradients travel on their own tags, so a receive posted
ahead of time (see [Note: receives posted ahead]) can only match the message kind it is waiting for."""
_TAG_ACT = 2
_TAG_GRAD = 3


@dataclass
class Incoming:
    """An activation transfer whose header receive is posted ahead (``P2P.start_recv``); ``P2P.recv`` finishes it."""

    src: int
    header: torch.Tensor
    work: Any
    guessed: list[tuple[Any, torch.Tensor]] | None = None
    """Tensor receives posted with the cached description (see [Note: receives posted ahead])."""


@dataclass
class IncomingGrads:
    """Gradient receives posted ahead (``P2P.start_recv_grads``); ``P2P.recv_grads`` waits for them."""

    src: int
    bufs: list[tuple[Any, torch.Tensor]]


@dataclass
class P2P:
    """Point-to-point transfers of one rank. Sends are asynchronous (finish them with ``wait``); receives block, or
    are posted ahead with ``start_recv``/``start_recv_grads`` where the backend matches messages by tag.

    [Note: receives posted ahead]
    With gloo a message moves only once both sides have posted it (a rendezvous through the transport threads), so
    a receive posted just before it is needed costs a round trip on the critical path even when the sender finished
    long ago. The executor therefore posts the next receive of each channel (peer x activations / gradients) as soon
    as the previous one on that channel is consumed: the gradients whole (their shapes are known from the forward
    send), activations as their header plus tensor buffers shaped by the cached description (the one of the last
    transfer on the channel, known to both sides). When the description changes, the sender first sends zeros shaped
    like the old one, which those guessed receives take and the receiver drops, then the real tensors (one extra
    payload per change of shapes). Messages of a channel keep program order on both sides, as the schedule simulator
    checks; distinct tags keep activations, gradients and headers apart. NCCL ignores tags and matches
    point-to-point operations between two ranks in issue order, so there (``can_post_ahead`` False) no receive is
    posted ahead or guessed.
    """

    device: torch.device
    group: dist.ProcessGroup | None = None
    """Group whose ranks are addressed by global rank (``dist`` translates them)."""
    _sent_meta: dict[int, tuple[Any, list[TensorMeta]]] = field(default_factory=dict)
    _recv_meta: dict[int, tuple[Any, list[TensorMeta]]] = field(default_factory=dict)
    _pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    _backend: str | None = None

    @property
    def can_post_ahead(self) -> bool:
        """Whether receives may be posted ahead (the backend matches point-to-point messages by tag: gloo)."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)) if dist.is_initialized() else ""
        return self._backend == "gloo"

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        work = dist.isend(t, dst, group=self.group, tag=tag)
        self._pending.append((work, t))  # keep the buffer alive until the send completes

    def send(self, obj: Any, dst: int) -> list[TensorMeta]:
        """Sends a structure of tensors to ``dst``; returns the metadata of its tensors (grad flags included)."""
        tensors, skeleton = flatten(obj)
        metas = [TensorMeta.of(t) for t in tensors]
        changed = self._sent_meta.get(dst) != (skeleton, metas)  # compared unpickled; pickled only on change
        blob = pickle.dumps((skeleton, metas)) if changed else b""
        self._isend(torch.tensor([len(blob)], dtype=torch.int64, device=self.device), dst, _TAG_META)
        if changed:
            self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst, _TAG_META)
            if self.can_post_ahead and dst in self._sent_meta:  # fill the receives guessed from the old description
                for m in self._sent_meta[dst][1]:
                    self._isend(torch.zeros(m.shape, dtype=_wire_dtype(m.dtype), device=self.device), dst, _TAG_ACT)
            self._sent_meta[dst] = (skeleton, metas)
        for t in tensors:
            t = t.detach()
            self._isend((t.view(torch.uint8) if t.dtype == torch.bool else t).contiguous(), dst, _TAG_ACT)
        return metas

    def start_recv(self, src: int) -> Incoming:
        """Posts the header receive of the next activation transfer from ``src`` (finish with ``recv``)."""
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        incoming = Incoming(src, header, dist.irecv(header, src, group=self.group, tag=_TAG_META))
        if self.can_post_ahead and src in self._recv_meta:
            incoming.guessed = self._post_tensors(self._recv_meta[src][1], src)
        return incoming

    def _post_tensors(self, metas: list[TensorMeta], src: int) -> list[tuple[Any, torch.Tensor]]:
        posted = []
        for m in metas:
            buf = torch.empty(m.shape, dtype=_wire_dtype(m.dtype), device=self.device)
            posted.append((dist.irecv(buf, src, group=self.group, tag=_TAG_ACT), buf))
        return posted

    def recv(self, src: int, incoming: Incoming | None = None) -> Any:
        """Receives a structure sent by ``send`` (``incoming``: its header posted ahead by ``start_recv``); floating
        tensors that required grad on the sender require grad."""
        if incoming is None:
            incoming = self.start_recv(src)
        elif incoming.src != src:
            raise AssertionError(f"receive posted ahead from rank {incoming.src} used for rank {src}")
        incoming.work.wait()
        n = int(incoming.header.item())
        if n:
            blob = torch.empty(n, dtype=torch.uint8, device=self.device)
            dist.recv(blob, src, group=self.group, tag=_TAG_META)
            self._recv_meta[src] = pickle.loads(blob.cpu().numpy().tobytes())
            for work, _ in incoming.guessed or []:
                work.wait()  # the sender's zeros for a description that no longer holds
            incoming.guessed = None
        if src not in self._recv_meta:
            raise AssertionError(f"first transfer from rank {src} came without metadata")
        skeleton, metas = self._recv_meta[src]
        posted = incoming.guessed if incoming.guessed is not None else self._post_tensors(metas, src)
        tensors = []
        for (work, buf), m in zip(posted, metas):
            work.wait()
            t = buf.view(torch.bool) if m.dtype == torch.bool else buf
            tensors.append(t.requires_grad_(True) if m.requires_grad else t)
        return unflatten(tensors, skeleton)

    def send_grads(self, grads: list[torch.Tensor], dst: int) -> None:
        for g in grads:
            self._isend(g.detach().contiguous(), dst, _TAG_GRAD)

    def start_recv_grads(self, metas: list[TensorMeta], src: int) -> IncomingGrads:
        """Posts the receives of one gradient per ``metas`` entry that requires grad (finish with ``recv_grads``)."""
        bufs = []
        for m in metas:
            if m.requires_grad:
                buf = torch.empty(m.shape, dtype=m.dtype, device=self.device)
                bufs.append((dist.irecv(buf, src, group=self.group, tag=_TAG_GRAD), buf))
        return IncomingGrads(src, bufs)

    def recv_grads(self, metas: list[TensorMeta], src: int, incoming: IncomingGrads | None = None) -> list[torch.Tensor]:
        """Receives one gradient per ``metas`` entry that requires grad, in order (``incoming``: posted ahead)."""
        if incoming is None:
            incoming = self.start_recv_grads(metas, src)
        elif incoming.src != src:
            raise AssertionError(f"gradient receive posted ahead from rank {incoming.src} used for rank {src}")
        for work, _ in incoming.bufs:
            work.wait()
        return [buf for _, buf in incoming.bufs]

    def wait(self) -> None:
        """Completes every outstanding send."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
