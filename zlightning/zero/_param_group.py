"""One communication group: parameters gathered by one all-gather and reduced by one reduce-scatter.

[Note: flat layout]
A group's parameters (same dtype, same ``requires_grad``) are laid end to end (total ``T`` elements) and padded to
``W * S`` with ``S = ceil(T / W)``; rank ``r`` owns elements ``[r*S, (r+1)*S)``. The all-gather output *is* the
unsharded flat buffer, so gathered parameters are zero-copy views into it; gradients are packed into the same layout
(one copy) for the reduce-scatter. Padding is zero and never belongs to a parameter.

[Note: storage lifetime and autograd]
Gathered full tensors are created with ``Tensor.set_`` on the buffer's storage, so they are not autograd views of the
buffer and have their own version counters: refilling the buffer (all-gather before backward) does not trip autograd's
saved-tensor version check. Releasing leaves the storage with 0 bytes (its memory goes back to the engine's pool, see [Note: why the engine
pools its step buffers] in ``_buffers.py``): tensors that autograd saved keep their identity and get their bytes back
when the group is gathered again before its backward.

[Note: freezing and unfreezing a sharded parameter]
Users switch ``requires_grad`` during training (Lightning's ``BaseFinetuning`` freezes a backbone in ``setup``, before
the model is sharded, and unfreezes it at some epoch, adding it to the optimizer as a new param group; others freeze
layers mid-run). The flag lives on the pieces, which are the module's parameters while sharded, so the engine reads
it there at every use instead of fixing it when the groups were built (they were built per ``requires_grad``, and
that grouping stays): a group takes the autograd path while any of its parameters trains, and a frozen parameter in
it gets a detached full tensor, hence no gradient and (by [Note: unused parameters] in ``_state.py``) ``grad=None``,
which the optimizer skips. A frozen group was previously never differentiated again, so an unfrozen backbone
silently never trained; a parameter frozen after the build kept receiving gradients and updates.

[Note: gradients through autograd]
In grad mode the full tensors are the outputs of ``_UnshardFn`` whose inputs are the shard pieces. Autograd calls its
backward once per application, after every use of those full tensors has produced its gradient (modules called
twice, tied weights inside the unit), and that is where the reduce-scatter is issued. It returns no gradient to the
pieces: the engine accumulates reduce-scatter results into an fp32 flat gradient it owns, whose slices become the
pieces' ``.grad`` (see ``ZeroState`` for the unused-parameter protocol).
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from zlightning._watchdog import record_collective
from zlightning.zero._buffers import StoragePool
from zlightning.zero._collectives import CommHandle, CommStreams, all_gather_into, reduce_scatter_into
from zlightning.zero._param import ZeroParam

__all__ = ["GroupContext", "GroupState", "PendingReduce", "ZeroParamGroup", "persistent_indices", "split_by_kind"]


class GroupState(enum.Enum):
    SHARDED = "sharded"  # only the local shard exists
    GATHERING = "gathering"  # an all-gather into the buffer is in flight
    UNSHARDED = "unsharded"  # the buffer holds the full parameters


class GatherHooks(Protocol):
    """Called around a group's all-gather (parameter offload reads the shard from disk before, drops it after)."""

    def gather_source(self, group: ZeroParamGroup) -> contextlib.AbstractContextManager[torch.Tensor]: ...

    def after_gather(self, group: ZeroParamGroup) -> None: ...


@dataclass
class GroupContext:
    """What a group needs from its engine: where it lives, whom it talks to, and whom it tells (as FSDP2's
    ``FSDPParamGroup`` takes its mesh info and policies). One per engine, shared by its groups."""

    process_group: dist.ProcessGroup | None
    rank: int
    world: int
    global_src: int
    """Global rank of the group's rank 0 (the source of broadcasts)."""
    device: torch.device
    streams: CommStreams
    pool: StoragePool
    broadcast_init: bool
    """Take rank 0's values at construction (``sync_module_states`` on a materialised model)."""
    initial_value: Callable[[ZeroParam], torch.Tensor] | None
    """Full initial value of a meta-device parameter (sharded initialisation), None when nothing is on meta."""
    on_gradients: Callable[[ZeroParamGroup, tuple[torch.Tensor | None, ...]], None]
    """Called by the group's autograd function once the full gradients of one use of the group exist."""
    offload: GatherHooks | None = None
    """Set once the engine's parameter offload exists."""
    separate_grad_edges: bool = False
    """Give every installed full tensor its own autograd node (a view of the group function's output), so that a
    split backward can stop at one parameter's gradient edge without running the others' uses; set by pipeline
    stages under a zero-bubble schedule (see [Note: ZeRO inside a pipeline stage] in ``zlightning/pipe/_zero.py``)."""


class _UnshardFn(torch.autograd.Function):
    """Identity from shard pieces to full tensors, whose backward reduce-scatters the full gradients."""

    @staticmethod
    def forward(ctx: Any, group: ZeroParamGroup, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        ctx.set_materialize_grads(False)
        return tuple(group.full_tensors())

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:  # type: ignore[override]
        ctx.group.context.on_gradients(ctx.group, grads)
        return (None,) * (len(grads) + 1)


class FlatGradient:
    """A group's full gradient laid out flat ([W*S], padding zero) in a storage lent by the engine's pool."""

    def __init__(self, pool: StoragePool, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.pool = pool
        self.slot: torch.UntypedStorage | None = pool.acquire(numel * dtype.itemsize)
        self.tensor = torch.empty(0, dtype=dtype, device=device).set_(self.slot, 0, (numel,), (1,))

    def release(self) -> None:
        """Returns the storage to the pool (the tensor must not be used afterwards)."""
        if self.slot is not None:
            self.tensor = self.tensor.new_empty(0)
            self.pool.release(self.slot)
            self.slot = None


class PendingReduce:
    """A reduce-scatter in flight: its group, its handle and the buffers it holds until accumulated."""

    def __init__(self, group: ZeroParamGroup, handle: CommHandle, held: list[FlatGradient]) -> None:
        self.group = group
        self.handle = handle
        self.held = held

    def finish(self) -> None:
        """Waits, accumulates the result into the group's gradient shard and returns the buffers to the pool."""
        self.group.accumulate(self.handle.wait())
        for buf in self.held:
            buf.release()


class ZeroParamGroup:
    """Owns a flat fp32 shard, its gradient, and the unsharded buffer of a set of parameters."""

    params: list[ZeroParam]
    context: GroupContext
    persistent: bool  # stays gathered between uses (small parameters)
    trainable_at_build: bool  # its parameters' requires_grad when the engine was built (one value per group)
    numel: int  # T: unpadded total
    shard_numel: int  # S
    shard: torch.Tensor  # [S] master dtype; pieces are views
    grad: torch.Tensor | None  # [S] fp32 accumulated gradient (pieces' .grad are views)
    storage: torch.UntypedStorage  # the gathered buffer's storage: same object always, 0 bytes while SHARDED
    status: GroupState
    stale: bool  # gathered data predates the last optimizer step

    def __init__(
        self,
        params: list[ZeroParam],
        context: GroupContext,
        *,
        persistent: bool,
        param_dtype: torch.dtype | None,
        defer_values: bool = False,
    ) -> None:
        self.params = params
        self.context = context
        self.persistent = persistent
        self.trainable_at_build = params[0].trainable_at_build
        self.master_dtype = params[0].dtype
        self.param_dtype = (
            param_dtype if (param_dtype is not None and self.master_dtype.is_floating_point) else self.master_dtype
        )
        self.world = context.world
        self.rank = context.rank
        self.numel = sum(p.numel for p in params)
        self.shard_numel = -(-self.numel // self.world)
        self.device = context.device
        self.grad = None
        self.status = GroupState.SHARDED
        self.stale = False
        self._handle: CommHandle | None = None
        self._installed = False
        self._autograd_fulls: tuple[torch.Tensor, ...] | None = None
        self._fulls_pass = -1
        self.pending_backward = 0
        self._node_pass = -1  # the pass that made the last autograd node (kept across reshards, unlike _fulls_pass)
        self._node_fulls: tuple[torch.Tensor, ...] | None = None  # its outputs (views of self.storage, refilled)
        self.unsynced: FlatGradient | None = None  # [W*S] full gradients summed while gradient sync is off
        self._lent: torch.UntypedStorage | None = None  # the pool's token for the bytes in ``storage``
        self._fresh: list[ZeroParam] = []  # pieces whose .grad this backward created (see ZeroState.finish_backward)
        # True while the shard has its shape but no bytes (see [Note: initial values straight to disk])
        self.values_pending = False
        self._build_shard(defer_values and all(p.original.is_meta for p in params))

    @property
    def requires_grad(self) -> bool:
        """Whether any of its parameters trains now (see [Note: freezing and unfreezing a sharded parameter])."""
        return any(p.requires_grad for p in self.params)

    # ---------------------------------------------------------------- construction
    def _build_shard(self, defer_values: bool) -> None:
        start = self.rank * self.shard_numel
        end = start + self.shard_numel
        offset = 0
        for p in self.params:
            p.place(offset, start, end)
            offset += p.numel
        ctx = self.context
        if defer_values:
            self.shard = torch.empty(self.shard_numel, dtype=self.master_dtype, device=self.device)
            self.values_pending = True  # the bytes go once the pieces are bound (below)
        elif ctx.broadcast_init and self.world > 1:
            # Everyone takes rank 0's values: build the whole flat layout once and broadcast it.
            flat = torch.zeros(self.world * self.shard_numel, dtype=self.master_dtype, device=self.device)
            for p in self.params:
                flat[p.offset : p.offset + p.numel].copy_(p.original.detach().reshape(-1))
            dist.broadcast(flat, src=ctx.global_src, group=ctx.process_group)
            self.shard = flat[start:end].clone()
            del flat
        else:
            # Write only this rank's slice (the shard is allocated first, temporaries after: less fragmentation).
            self.shard = torch.zeros(self.shard_numel, dtype=self.master_dtype, device=self.device)
            self._write_local_values()
        for p in self.params:
            p.bind_piece(self.shard, start)
            p.release_original_storage()
        if self.values_pending:
            self.shard.untyped_storage().resize_(0)
        self.storage = torch.empty(0, dtype=torch.uint8, device=self.device).untyped_storage()

    def _write_local_values(self) -> None:
        start = self.rank * self.shard_numel
        initial_value = self.context.initial_value
        for p in self.params:
            if p.local_numel:
                if p.original.is_meta and initial_value is None:
                    raise AssertionError(f"{p.fqn} is on the meta device but the engine has no initialiser")
                value = initial_value(p) if p.original.is_meta else p.original.detach()  # type: ignore[misc]
                self.shard[p.local_start - start : p.local_end - start].copy_(p.local_slice_of(value))

    def fill_pending_values(self) -> None:
        """Gives a shard built with ``defer_values`` its bytes and initial values (see [Note: initial values straight
        to disk]); the caller writes it out and drops it again."""
        if not self.values_pending:
            return
        self.shard.untyped_storage().resize_(self.shard.numel() * self.shard.element_size())
        self.shard.zero_()
        self._write_local_values()
        self.values_pending = False

    @property
    def unsharded_bytes(self) -> int:
        return self.world * self.shard_numel * self.param_dtype.itemsize

    @property
    def buffer(self) -> torch.Tensor:
        """The gathered flat buffer [W*S] in the compute dtype (only while GATHERING or UNSHARDED)."""
        if self.storage.nbytes() < self.unsharded_bytes:
            raise AssertionError(f"{self!r}: the gathered buffer is not allocated (state {self.status})")
        flat = torch.empty(0, dtype=self.param_dtype, device=self.device)
        return flat.set_(self.storage, 0, (self.world * self.shard_numel,), (1,))

    @property
    def pool(self) -> StoragePool:
        return self.context.pool

    # ---------------------------------------------------------------- all-gather
    def start_gather(self, async_op: bool) -> None:
        """SHARDED -> GATHERING (or UNSHARDED when synchronous). No-op if already gathered or gathering."""
        if self.status is not GroupState.SHARDED:
            return
        offload = self.context.offload
        self._lent = self.pool.lend_into(self.storage, self.unsharded_bytes)
        buffer = self.buffer
        mine = buffer[self.rank * self.shard_numel : (self.rank + 1) * self.shard_numel]
        if offload is None:
            mine.copy_(self.shard)  # casts
        else:
            with offload.gather_source(self) as source:  # the shard may live on disk: see _offload_params.py
                mine.copy_(source)
        streams: CommStreams = self.context.streams
        if self.world == 1:
            self._handle = None
            self.status = GroupState.UNSHARDED
            if offload is not None:
                offload.after_gather(self)
        else:
            record_collective("all-gather", self)  # see [Note: diverging collectives] in zlightning/_watchdog.py
            self._handle = all_gather_into(
                buffer, self.context.process_group, async_op=async_op, stream=streams.all_gather
            )
            self.status = GroupState.GATHERING
        self.stale = False
        if not async_op:
            self.wait_gather()

    def wait_gather(self) -> None:
        """GATHERING -> UNSHARDED."""
        if self.status is GroupState.GATHERING:
            handle, self._handle = self._handle, None
            if handle is not None:
                handle.wait()
            self.status = GroupState.UNSHARDED
            if self.context.offload is not None:
                self.context.offload.after_gather(self)

    def unshard(self) -> None:
        """Ensures the full parameters are in the buffer and current (re-gathers after an optimizer step)."""
        if self.stale and self.status is not GroupState.SHARDED:
            self.reshard()
        self.start_gather(async_op=False)
        self.wait_gather()

    def reshard(self) -> None:
        """Any state -> SHARDED: modules hold the pieces again and the buffer's bytes are freed."""
        self.wait_gather()
        self.uninstall()
        if self.status is GroupState.UNSHARDED:
            self._free_buffer()
        self.status = GroupState.SHARDED
        self._autograd_fulls = None
        self._fulls_pass = -1

    def _free_buffer(self) -> None:
        # On CUDA the pool's next borrower writes on the compute stream (ordered after the kernels already queued
        # there) or on a side stream that first waits for the compute stream (see _collectives.py).
        self.pool.take_back(self.storage, self._lent)
        self._lent = None

    # ---------------------------------------------------------------- module slots
    def full_tensors(self) -> list[torch.Tensor]:
        """Fresh full-shape tensors over the buffer's storage (see [Note: storage lifetime and autograd])."""
        storage = self.storage
        out = []
        with torch.inference_mode(False):
            for p in self.params:
                t = torch.empty(0, dtype=self.param_dtype, device=self.device)
                t.set_(storage, p.offset, p.shape, _contiguous_strides(p.shape))
                out.append(t)
        return out

    def install(self, pass_id: int, recompute: bool = False) -> None:
        """Points every module slot at the full tensors (autograd-connected in grad mode, once per pass).

        ``recompute``: a forward inside backward (activation checkpointing). When this pass's autograd node is still
        waiting for its gradients, the recomputation gets that node's outputs again (their storage is refilled by
        the gather): it saves what the original forward saved, a graph it builds and backpropagates (reentrant
        mode) reaches the same node, and no second node is made whose backward would never come (see
        [Note: a unit's forward inside backward] in ``_state.py``)."""
        if self.status is not GroupState.UNSHARDED:
            raise AssertionError(f"install() on a group in state {self.status}")
        fulls: list[torch.Tensor] | tuple[torch.Tensor, ...]
        if self.requires_grad and not self.trainable_at_build and self.context.offload is not None:
            names = [p.fqn for p in self.params if p.requires_grad]
            raise RuntimeError(
                f"ZeRO-3 offload: {names[:4]}{' ...' if len(names) > 4 else ''} were frozen (requires_grad=False) "
                "when the model was sharded and are trainable now. Offloaded optimizer state and parameter swap "
                "plans exist only for the parameters trainable at setup. Build the model with them trainable (an "
                "optimizer param group with lr=0 keeps them still until you raise it), or unfreeze them under "
                "zstack_zero3 without offload."
            )
        if self.requires_grad and torch.is_grad_enabled():
            if recompute and self._node_pending(pass_id):
                self._install(self._node_fulls)  # type: ignore[arg-type]
                return
            if self._fulls_pass != pass_id or self._autograd_fulls is None:
                fulls = _UnshardFn.apply(self, *[p.piece for p in self.params])
                if self.context.separate_grad_edges:
                    fulls = tuple(t.view_as(t) for t in fulls)
                # a frozen parameter in a group that trains gets no gradient, as in plain PyTorch
                self._autograd_fulls = tuple(t if p.requires_grad else t.detach() for p, t in zip(self.params, fulls))
                self._fulls_pass = pass_id
                self._node_pass = pass_id
                self._node_fulls = self._autograd_fulls
                self.pending_backward += 1
            fulls = self._autograd_fulls
        else:
            fulls = self.full_tensors()
        for p, t in zip(self.params, fulls):
            p.install(t)
        self._installed = True

    def _node_pending(self, pass_id: int) -> bool:
        return self.pending_backward > 0 and self._node_pass == pass_id and self._node_fulls is not None

    def _install(self, fulls: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        for p, t in zip(self.params, fulls):
            p.install(t)
        self._installed = True

    def install_for_backward(self, pass_id: int) -> None:
        """Module slots hold full tensors during the group's backward, for a recomputation that calls a module's
        ``forward`` directly, past the engine's hooks (Hugging Face's gradient checkpointing): the pending node's
        outputs, or plain tensors for a group that needs no gradient. Nothing else: a new node there would never
        see its backward."""
        if self.status is not GroupState.UNSHARDED:
            return
        if not self.requires_grad:
            self._install(self.full_tensors())
        elif self._node_pending(pass_id):
            self._install(self._node_fulls)  # type: ignore[arg-type]

    def uninstall(self) -> None:
        if self._installed:
            for p in self.params:
                p.install(p.piece)
            self._installed = False

    # ---------------------------------------------------------------- gradients
    # [Note: sparse gradients]
    # ``nn.Embedding(sparse=True)`` gives its weight a sparse COO gradient (the rows looked up). Gradients are
    # reduce-scattered as one dense flat buffer per group, so the sparse gradient is added into its zeroed slot
    # (no dense temporary) and the shard gets a dense gradient: SGD (and Adagrad) step as in one process; a
    # sparse-only optimizer (``SparseAdam``) refuses dense gradients, as it says.
    def pack_gradients(self, grads: tuple[torch.Tensor | None, ...], reduce_dtype: torch.dtype) -> FlatGradient:
        """Full gradients -> one flat [W*S] pool buffer in ``reduce_dtype`` (zeros for missing gradients and
        padding)."""
        flat = FlatGradient(self.pool, self.world * self.shard_numel, reduce_dtype, self.device)
        out = flat.tensor
        for p, g in zip(self.params, grads):
            dst = out[p.offset : p.offset + p.numel]
            if g is None:
                dst.zero_()
            elif g.layout is torch.sparse_coo:  # see [Note: sparse gradients]
                dst.zero_()
                dst.view(g.shape).add_(g)
            else:
                dst.copy_(g.reshape(-1))
        out[self.numel :].zero_()
        return flat

    def start_reduce_scatter(self, flat: FlatGradient, async_op: bool, peer_half: bool = False) -> PendingReduce:
        """Issues the reduce-scatter of a packed gradient (already divided for averaging); with ``peer_half`` only
        the peer's chunk was packed (see `pack_peer_half`)."""
        if self.world == 1:
            return PendingReduce(self, CommHandle([], flat.tensor), [flat])
        held = [flat]
        out = scratch = None
        if flat.tensor.device.type != "cpu":  # devices reduce into a separate output; see _collectives.py
            held.append(FlatGradient(self.pool, self.shard_numel, flat.tensor.dtype, self.device))
            out = held[-1].tensor
        elif self.world == 2 and not peer_half:  # see [Note: the host reduce-scatter between two ranks]
            held.append(FlatGradient(self.pool, self.shard_numel, flat.tensor.dtype, self.device))
            scratch = held[-1].tensor
        record_collective("reduce-scatter", self)
        handle = reduce_scatter_into(
            flat.tensor,
            self.context.process_group,
            async_op=async_op,
            output=out,
            stream=self.context.streams.reduce_scatter,
            scratch=scratch,
            peer_half=peer_half,
        )
        return PendingReduce(self, handle, held)

    def _gradient_views(self) -> tuple[torch.Tensor, bool]:
        """Creates the gradient shard and the pieces' ``.grad`` views where absent. Returns the shard and whether
        every piece's ``.grad`` is still a view of it (a user may have replaced some)."""
        if self.grad is None:
            self.grad = torch.zeros(self.shard_numel, dtype=self.master_dtype, device=self.device)
        grad = self.grad
        base = self.rank * self.shard_numel
        own = True
        for p in self.params:
            view = grad[p.local_start - base : p.local_end - base]
            g = p.piece.grad
            if g is None:
                view.zero_()
                p.piece.grad = view
                self._fresh.append(p)
            elif not _is_view_of(g, view):
                own = False
        return grad, own

    # [Note: two host ranks reduce without packing their own half]
    # Between two host ranks the reduce-scatter is one exchange (see [Note: the host reduce-scatter between two
    # ranks] in _collectives.py): each rank sends the peer the peer's chunk of its gradient and receives the peer's
    # part of its own chunk. Packing the whole gradient and receiving into a separate scratch chunk held one and a
    # half units of buffers beside autograd's own copy of the gradient (which autograd keeps until the hook returns),
    # at the moment of the step's peak. So there only the peer's chunk is packed; this rank's own part goes from
    # autograd's gradients straight into the gradient shard (halved, as the reduction averages), and the peer's part
    # is received into the packed buffer's own chunk, which is free: one unit of buffers, which takes the pool slot
    # of the unit's gathered parameters, released just before. The sum is the same as before, bit for bit, whenever
    # the shard's gradient starts from zero (x/2 + y/2 rounds once either way); with gradients accumulated over
    # micro-batches the two halves are added one after the other. Other cases keep the packed path: a reduction
    # dtype other than the shard's (the sum would round differently), sparse gradients, gradients held back while
    # sync is off, and more than two ranks (one reduce per chunk there).
    # On 24 x Linear(1024) + Tanh at 2 ranks through Trainer.fit the host cache's live peak went from 3.5 unit
    # buffers above the sharded state to 3 (see benchmarks/results/memory.md).
    def reduces_own_half_directly(self, grads: tuple[torch.Tensor | None, ...], reduce_dtype: torch.dtype) -> bool:
        """Whether these gradients take [Note: two host ranks reduce without packing their own half]."""
        return (
            self.world == 2
            and self.device.type == "cpu"
            and reduce_dtype == self.master_dtype
            and self.unsynced is None
            and all(g is None or g.layout is torch.strided for g in grads)
        )

    def pack_peer_half(self, grads: tuple[torch.Tensor | None, ...], reduce_dtype: torch.dtype) -> FlatGradient:
        """Two host ranks: packs the peer's chunk of the flat gradient (halved) and adds this rank's own part of
        ``grads`` (halved) into the gradient shard; the returned buffer's own chunk is left for the peer's part. See
        [Note: two host ranks reduce without packing their own half]."""
        flat = FlatGradient(self.pool, self.world * self.shard_numel, reduce_dtype, self.device)
        lo, hi = (1 - self.rank) * self.shard_numel, (2 - self.rank) * self.shard_numel
        send = flat.tensor[lo:hi]
        grad, own = self._gradient_views()
        base = self.rank * self.shard_numel
        for p, g in zip(self.params, grads):
            flat_g = None if g is None else g.reshape(-1)
            a, b = max(p.offset, lo), min(p.offset + p.numel, hi)
            if a < b:  # the peer's part
                if flat_g is None:
                    send[a - lo : b - lo].zero_()
                else:
                    send[a - lo : b - lo].copy_(flat_g[a - p.offset : b - p.offset])
            if flat_g is not None and p.local_end > p.local_start:  # this rank's own part
                src = flat_g[p.local_start - p.offset : p.local_end - p.offset]
                dst = grad[p.local_start - base : p.local_end - base] if own else p.piece.grad
                dst.add_(src, alpha=1.0 / self.world)  # type: ignore[union-attr]
        if self.numel < hi:
            send[max(self.numel, lo) - lo :].zero_()
        send.div_(self.world)
        return flat

    def accumulate(self, reduced: torch.Tensor) -> None:
        """Adds an averaged reduce-scatter result into the pieces' gradients (creating them where absent)."""
        grad, own = self._gradient_views()
        base = self.rank * self.shard_numel
        if own:
            grad.add_(reduced)  # in place: a bf16 result is added into the fp32 gradient without a copy
            return
        for p in self.params:  # a user replaced some .grad tensors: add piece by piece
            lo, hi = p.local_start - base, p.local_end - base
            p.piece.grad.add_(reduced[lo:hi])  # type: ignore[union-attr]

    def take_fresh(self) -> list[ZeroParam]:
        fresh, self._fresh = self._fresh, []
        return fresh


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides = []
    acc = 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _is_view_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.numel() == b.numel()
        and (a.numel() == 0 or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())
    )


def persistent_indices(
    params: list[ZeroParam], stage: int, param_threshold: int, model_threshold: int | None
) -> set[int]:
    """Indices of the small parameters that stay gathered between uses, smallest first, within ``model_threshold``
    elements in total (None: 1% of the model). At stages 1 and 2 every parameter stays gathered (replicated)."""
    if stage < 3:
        return {zp.index for zp in params}
    cap = sum(zp.numel for zp in params) // 100 if model_threshold is None else model_threshold
    chosen: set[int] = set()
    total = 0
    for zp in sorted((zp for zp in params if zp.numel <= param_threshold), key=lambda z: (z.numel, z.index)):
        if total + zp.numel > cap:
            break
        chosen.add(zp.index)
        total += zp.numel
    return chosen


def split_by_kind(params: list[ZeroParam]) -> list[list[ZeroParam]]:
    """One group per (dtype, requires_grad), in first-seen order: a collective needs one dtype, and frozen
    parameters need no reduce-scatter."""
    kinds: dict[tuple[torch.dtype, bool], list[ZeroParam]] = {}
    for zp in params:
        kinds.setdefault((zp.dtype, zp.trainable_at_build), []).append(zp)
    return list(kinds.values())
