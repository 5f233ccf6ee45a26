"""Stage-to-stage transfers of tensors and nested tuples/lists/dicts of tensors (state: a per-channel metadata cache,
a pool of reusable send buffers, and under gloo one send thread).

[Note: negotiated metadata]
An activation transfer is one message: a 64-byte header, then the tensors packed back to back (each at a 64-byte
aligned offset) into one flat byte buffer. The receiver sizes that buffer from the description of the last transfer on
the channel (structure, shapes, dtypes, grad flags; known to both sides) and unpacks it as views, without copies. When
the description changes, the sender first sends a message of the size the receiver expects (header only when there
is no description yet) whose header gives the length of the new pickled description, then the description itself,
then the packed tensors. So shapes may change from batch to batch (variable sequence length) at the cost of two extra
messages only when they do, and the steady state costs one message per transfer (gloo: one rendezvous; the earlier
header + one message per tensor cost ``1 + n``). The description records which floating tensors require grad; exactly
those get a gradient back (``send_grads``/``recv_grads`` need no header since the sender already knows the shapes),
which avoids DeepSpeed's hang when an output float tensor does not require grad (PR #5518). Bool tensors travel as
uint8.
"""

from __future__ import annotations

import math
import pickle
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zlightning._threads import small_thread_stacks
from zlightning._watchdog import TransferTimeoutError, wait_for

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


def _view(buf: torch.Tensor, m: TensorMeta, offset: int) -> torch.Tensor:
    """The wire-dtype tensor ``m`` at byte ``offset`` of the packed message ``buf`` (a view, no copy)."""
    nbytes = math.prod(m.shape) * _wire_dtype(m.dtype).itemsize
    return buf[offset : offset + nbytes].view(_wire_dtype(m.dtype)).view(m.shape)


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
"""Tag of pickled descriptions; packed activations and gradients travel on their own tags, so a receive posted ahead
of time (see [Note: receives posted ahead]) can only match the message kind it is waiting for."""
_TAG_ACT = 2
_TAG_GRAD = 3
_HEADER = 64
"""Bytes before the first packed tensor: an int64 (0: payload follows; n > 0: a description of n bytes follows on
``_TAG_META`` and this payload is void), padded to the packing alignment."""
_ALIGN = 64
"""Every packed tensor starts on a 64-byte boundary (as the CPU allocator aligns fresh tensors), so received
activations are as aligned for vectorised kernels as the sender's own."""


Description = tuple[Any, list[TensorMeta]]


def _layout(metas: list[TensorMeta]) -> tuple[list[int], int]:
    """Byte offset of each tensor in a packed message, and the message's size."""
    offsets, pos = [], _HEADER
    for m in metas:
        offsets.append(pos)
        nbytes = math.prod(m.shape) * _wire_dtype(m.dtype).itemsize
        pos += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, pos


def _message_size(desc: Description | None) -> int:
    return _layout(desc[1])[1] if desc is not None else _HEADER


@dataclass
class Incoming:
    """An activation receive posted ahead (``P2P.start_recv``), sized by the cached description; ``P2P.recv``
    finishes it."""

    src: int
    buf: torch.Tensor
    work: Any


@dataclass
class IncomingGrads:
    """Gradient receives posted ahead (``P2P.start_recv_grads``); ``P2P.recv_grads`` waits for them."""

    src: int
    bufs: list[tuple[Any, torch.Tensor]]


class _Sender:
    """Issues the sends of one ``P2P`` from a daemon thread, in submission order; see [Note: sends off the critical
    path]."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.queue: queue.SimpleQueue[tuple[torch.Tensor, int, int] | threading.Event | None] = queue.SimpleQueue()
        self.issued: list[tuple[Any, torch.Tensor]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, name="zlightning-pipe-sender", daemon=True)
        with small_thread_stacks(backend=None):  # see [Note: thread stacks count against a data limit]
            self.thread.start()

    # [Note: the send thread never frees a tensor]
    # Interpreter shutdown runs the finalizer that stops this thread (``P2P`` registers it with weakref.finalize,
    # whose callbacks run at exit). The thread then returned from ``_loop`` with the last tensor it sent still in a
    # local; releasing it there freed the tensor, whose deallocation releases and retakes the GIL, and a daemon thread
    # that retakes the GIL while the interpreter finalizes is ended by ``pthread_exit`` from inside C++ code that
    # cannot unwind: ``terminate called without an active exception`` and SIGABRT after a successful run (seen once
    # in about ten multi-engine runs of the zero-bubble schedules). So the loop drops its reference to each item at
    # once (``issued`` keeps the tensor alive until the main thread drains it), and ``stop`` joins the thread, which
    # therefore ends before finalization goes on.
    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif self.error is None:
                try:
                    self.issued.append((dist.isend(item[0], item[1], group=self.group, tag=item[2]), item[0]))
                except BaseException as e:  # surfaced by drain() on the main thread
                    self.error = e
            del item  # see [Note: the send thread never frees a tensor]

    def stop(self) -> None:
        self.queue.put(None)
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=10.0)

    def submit(self, t: torch.Tensor, dst: int, tag: int) -> None:
        if self.error is not None:
            self._raise()
        self.queue.put((t, dst, tag))

    def drain(self) -> list[tuple[Any, torch.Tensor]]:
        """Waits until every submitted send is issued; returns their works (to wait on)."""
        flushed = threading.Event()
        self.queue.put(flushed)
        while not flushed.wait(timeout=5.0):
            if not self.thread.is_alive():
                raise RuntimeError("zlightning pipeline: the send thread died")
        if self.error is not None:
            self._raise()
        issued, self.issued = self.issued, []
        return issued

    def _raise(self) -> None:
        error, self.error = self.error, None
        raise RuntimeError(
            f"zlightning pipeline: a point-to-point send failed: {type(error).__name__}: {error}"
        ) from error


@dataclass
class P2P:
    """Point-to-point transfers of one rank. Sends are asynchronous (finish them with ``wait``); receives block, or
    are posted ahead with ``start_recv``/``start_recv_grads`` where the backend matches messages by tag.

    [Note: receives posted ahead]
    With gloo a message moves only once both sides have posted it (a rendezvous through the transport threads), so
    a receive posted just before it is needed costs a round trip on the critical path even when the sender finished
    long ago. The executor therefore posts the next receive of each channel (peer x activations / gradients) as soon
    as the previous one on that channel is consumed: gradients shaped by the activations this rank sent, activations
    as one packed message sized by the cached description (see [Note: negotiated metadata]; when the description
    changed, the posted message is the sender's void one and the real payload follows). Messages of a channel keep
    program order on both sides, as the schedule simulator checks; distinct tags keep activations, gradients and
    descriptions apart. NCCL ignores tags and matches point-to-point operations between two ranks in issue order, so
    there (``can_post_ahead`` False) no receive is posted ahead; the protocol is the same.

    [Note: sends off the critical path]
    Posting receives ahead has a price on gloo: once the peer's receive is posted, ``isend`` writes the payload in the
    calling thread, under the transport's pair lock, which the transport thread also takes to read the messages
    coming the other way. On a loaded CPU that made one ``isend`` of 128 KiB take 0.7-5 ms of the main thread, right
    between a stage's compute actions. With gloo every send is therefore issued by one daemon thread per ``P2P``
    (FIFO, so the per-channel order is kept), and the main thread only enqueues; ``wait`` first drains that queue.
    ``dist.isend`` releases the GIL, so the compute thread is not held. NCCL sends are asynchronous already and stay
    on the calling thread (its stream order must follow issue order).
    """

    device: torch.device
    group: dist.ProcessGroup | None = None
    """Group whose ranks are addressed by global rank (``dist`` translates them)."""
    _sent_meta: dict[int, Description] = field(default_factory=dict)
    _recv_meta: dict[int, Description] = field(default_factory=dict)
    _pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)
    _backend: str | None = None
    _sender: _Sender | None = None
    _packed: list[torch.Tensor] = field(default_factory=list)
    """Packed send buffers in flight; back to ``_spare`` once their send completed (``wait``)."""
    _spare: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Reusable packed send buffers by size; see [Note: reused send buffers]."""
    stages: dict[int, int] = field(default_factory=dict)
    """Pipeline stage of each peer rank (named in errors); see [Note: a stage that waits forever]."""
    _received: dict[tuple[str, int], int] = field(default_factory=dict)
    """Receives of this batch per (kind, peer): which micro-batch a wait is for."""

    @property
    def can_post_ahead(self) -> bool:
        """Whether receives may be posted ahead (the backend matches point-to-point messages by tag: gloo)."""
        if self._backend is None:
            self._backend = str(dist.get_backend(self.group)) if dist.is_initialized() else ""
        return self._backend == "gloo"

    def _isend(self, t: torch.Tensor, dst: int, tag: int) -> None:
        if self.can_post_ahead:
            if self._sender is None:
                self._sender = _Sender(self.group)
                weakref.finalize(self, self._sender.stop)  # the thread ends with its P2P
            self._sender.submit(t, dst, tag)
            return
        work = dist.isend(t, dst, group=self.group, tag=tag)
        self._pending.append((work, t))  # keep the buffer alive until the send completes

    def _what(self, kind: str, peer: int) -> str:
        """What a receive waits for, for errors: ``the gradients (RECV_B) of micro-batch #2 from stage 1 (rank 1)``."""
        n = self._received.get((kind, peer), 0)
        self._received[(kind, peer)] = n + 1
        who = f"pipeline stage {self.stages[peer]} (rank {peer})" if peer in self.stages else f"rank {peer}"
        return f"the {kind} of this batch's micro-batch #{n} on that channel from {who}"

    def _wait(self, work: Any, what: str) -> None:
        """[Note: a stage that waits forever]
        A stage whose peer stopped sending (stuck in its loss, in a data loader, or running a different schedule)
        would wait for the process group's timeout (30 minutes by default). Every wait here goes through the
        watchdog (``zlightning/_watchdog.py``): after ``ZLIGHTNING_WATCHDOG_TIMEOUT_S`` seconds the stage raises
        `TransferTimeoutError` naming the peer stage and rank, the action (RECV_F/RECV_B/SEND), the micro-batch,
        and where the peer's main thread is; a peer that died is named with how it ended (`PeerFailureError`)."""
        try:
            wait_for(work, what=what, sliced=False, hang_error=TransferTimeoutError, point_to_point=self.can_post_ahead)
        except TransferTimeoutError as err:
            raise TransferTimeoutError(
                f"{err}. Every stage of a pipeline runs the same calls in the same order: call batch_loss, predict "
                "and eval_batch on every rank (not under `if rank == 0`)"
            ) from None

    def _send_buffer(self, size: int) -> torch.Tensor:
        """[Note: reused send buffers]
        Packing copies the activations into a buffer that must live until its send completes (``wait``, at the end
        of a batch). A fresh CPU buffer per transfer costs page faults on first touch (measured: ~0.8 ms to pack
        128 KiB that way vs ~15 us into a reused one), on the sender's critical path. So on CPU the buffers of a
        batch return to a pool keyed by size after ``wait`` and the next batch reuses them: the pool holds at most
        the peak number of one batch's in-flight sends (one activation each). CUDA's caching allocator already
        recycles memory, so there the pool is not used."""
        spare = self._spare.get(size)
        buf = spare.pop() if spare else torch.empty(size, dtype=torch.uint8, device=self.device)
        if self.device.type == "cpu":
            self._packed.append(buf)
        return buf

    def _header_message(self, size: int, value: int) -> torch.Tensor:
        buf = torch.zeros(size, dtype=torch.uint8, device=self.device)
        buf[:8].view(torch.int64).fill_(value)
        return buf

    def send(self, obj: Any, dst: int) -> list[TensorMeta]:
        """Sends a structure of tensors to ``dst``; returns the metadata of its tensors (grad flags included)."""
        tensors, skeleton = flatten(obj)
        metas = [TensorMeta.of(t) for t in tensors]
        old = self._sent_meta.get(dst)
        if old != (skeleton, metas):  # compared unpickled; pickled only on change
            blob = pickle.dumps((skeleton, metas))
            self._isend(self._header_message(_message_size(old), len(blob)), dst, _TAG_ACT)  # void: what dst awaits
            self._isend(torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(self.device), dst, _TAG_META)
            self._sent_meta[dst] = (skeleton, metas)
        offsets, size = _layout(metas)
        packed = self._send_buffer(size)
        packed[:8].view(torch.int64).zero_()
        with torch.no_grad():
            for t, m, off in zip(tensors, metas, offsets):
                _view(packed, m, off).copy_(t.detach().view(torch.uint8) if t.dtype == torch.bool else t.detach())
        self._isend(packed, dst, _TAG_ACT)
        return metas

    def start_recv(self, src: int) -> Incoming:
        """Posts the receive of the next activation transfer from ``src`` (finish with ``recv``)."""
        buf = torch.empty(_message_size(self._recv_meta.get(src)), dtype=torch.uint8, device=self.device)
        return Incoming(src, buf, dist.irecv(buf, src, group=self.group, tag=_TAG_ACT))

    def recv(self, src: int, incoming: Incoming | None = None) -> Any:
        """Receives a structure sent by ``send`` (``incoming``: posted ahead by ``start_recv``); floating tensors that
        required grad on the sender require grad."""
        if incoming is None:
            incoming = self.start_recv(src)
        elif incoming.src != src:
            raise AssertionError(f"receive posted ahead from rank {incoming.src} used for rank {src}")
        what = self._what("activations (RECV_F)", src)
        self._wait(incoming.work, what)
        buf = incoming.buf
        n = int(buf[:8].view(torch.int64).item())
        if n:  # the description changed: this message was void
            blob = torch.empty(n, dtype=torch.uint8, device=self.device)
            self._wait(dist.irecv(blob, src, group=self.group, tag=_TAG_META), what)
            self._recv_meta[src] = pickle.loads(blob.cpu().numpy().tobytes())
            buf = torch.empty(_message_size(self._recv_meta[src]), dtype=torch.uint8, device=self.device)
            self._wait(dist.irecv(buf, src, group=self.group, tag=_TAG_ACT), what)
        if src not in self._recv_meta:
            raise AssertionError(f"first transfer from rank {src} came without metadata")
        skeleton, metas = self._recv_meta[src]
        offsets, _ = _layout(metas)
        tensors = []
        for m, off in zip(metas, offsets):
            t = _view(buf, m, off)
            t = t.view(torch.bool) if m.dtype == torch.bool else t
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

    def recv_grads(
        self, metas: list[TensorMeta], src: int, incoming: IncomingGrads | None = None
    ) -> list[torch.Tensor]:
        """Receives one gradient per ``metas`` entry that requires grad, in order (``incoming``: posted ahead)."""
        if incoming is None:
            incoming = self.start_recv_grads(metas, src)
        elif incoming.src != src:
            raise AssertionError(f"gradient receive posted ahead from rank {incoming.src} used for rank {src}")
        what = self._what("gradients (RECV_B)", src)
        for work, _ in incoming.bufs:
            self._wait(work, what)
        return [buf for _, buf in incoming.bufs]

    def wait(self) -> None:
        """Completes every outstanding send."""
        if self._sender is not None:
            self._pending += self._sender.drain()
        for work, _ in self._pending:
            self._wait(work, "its sends to the neighbouring stages (SEND_F/SEND_B) to complete")
        self._pending.clear()
        self._received.clear()
        for buf in self._packed:
            self._spare.setdefault(buf.numel(), []).append(buf)
        self._packed.clear()
