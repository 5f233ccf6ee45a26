"""Interpreting one rank's lowered schedule for one batch (no decisions about order; see ``_schedule.py``).

[Note: stage boundaries are detached]
Every stage input is a leaf: received tensors are fresh buffers, and when two consecutive stages share a rank (one
pipeline rank with virtual stages) the output of the first is detached before the second consumes it. So a
``B`` action backpropagates through exactly one stage, and the gradient of its inputs is handed on explicitly,
whether by ``SEND_B`` or in memory. Floating inputs that required grad on the producing side require grad here; an
input that receives no gradient (unused) sends zeros so the pairing of sends and receives never depends on autograd.

[Note: checkpointed stages backpropagate whole]
torch's (non-reentrant) activation checkpointing recomputes a checkpointed forward once per autograd call that
unpacks what it saved. A split backward (see [Note: how a backward is split] in ``_backward.py``) makes three such
calls, ``B`` and the two phases of ``W``, and ``SavedActivations.keep_only_for`` unpacks once more to see what ``W``
reads: a stage with ``activation_checkpoint_interval`` ran its checkpointed layers five times per split micro-batch
instead of twice. Beyond three extra forwards of compute (more than the idle time ``W`` could fill), a layer with
state in its forward diverged from one process: BatchNorm's running statistics moved five times per micro-batch. So
such a stage's backward runs whole in its ``B`` (one recomputation, as under 1F1B) and its ``W`` does nothing. The
first stage still splits: its ``B`` computes nothing (its input is data) and its ``W`` is one backward, which
recomputes once. Under ZeRO-2/3 the backward that reduce-scatters is then such a ``B`` when it is the rank's last
to compute weight gradients (``_last_gradients``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from zlightning.pipe._backward import DeferredWeights, SavedActivations, backward_input, backward_weight
from zlightning.pipe._p2p import P2P, Incoming, IncomingGrads, TensorMeta, flatten, unflatten
from zlightning.pipe._schedule import Action, ActionKind, Schedule
from zlightning.pipe._stage import PipelineStage

__all__ = ["BatchRun", "describe"]


def describe(obj: Any) -> str:
    """``input[0]: float32[2, 16, 32], input[1]: int64[2]`` for a structure of tensors."""
    tensors, _ = flatten(obj)
    return ", ".join(f"input[{i}]: {str(t.dtype).replace('torch.', '')}{list(t.shape)}" for i, t in enumerate(tensors))


def _detach_boundary(obj: Any) -> Any:
    tensors, skeleton = flatten(obj)
    out = [t.detach().requires_grad_(t.requires_grad and t.is_floating_point()) for t in tensors]
    return unflatten(out, skeleton)


@dataclass
class BatchRun:
    """State of one batch on one rank: inputs, outputs and gradients per ``(stage, micro-batch)``."""

    stage: PipelineStage
    """This rank's chunk(s) and channel; see [Note: stage, engine and module] in ``_stage.py``."""
    schedule: Schedule
    inputs: list[Any]
    """Micro-batch inputs (used by stage 0)."""
    labels: list[Any]
    """Micro-batch labels (used by the last stage)."""
    loss_scale: float = 1.0
    """Multiplier of each micro-batch loss before backward (1 / (micro-batches x accumulation))."""
    keep_outputs: bool = False
    """Keep the last stage's outputs (prediction, ``return_logits``)."""
    with_loss: bool = True
    """Compute the loss on the last stage (False for prediction)."""
    timings: list[tuple[str, float, float]] | None = None
    """If a list, each compute action appends ``(action, start, end)`` (``time.perf_counter``; on CUDA the device is
    synchronised after each timed action, so a span covers its kernels, not only their launch). Used by the
    benchmark's bubble measurement and by zbv's calibration (``_calibrate.py``)."""
    losses: list[torch.Tensor] = field(default_factory=list)
    outputs: dict[int, Any] = field(default_factory=dict)
    _x: dict[tuple[int, int], Any] = field(default_factory=dict)
    _y: dict[tuple[int, int], Any] = field(default_factory=dict)
    _loss: dict[int, torch.Tensor] = field(default_factory=dict)
    _metas: dict[tuple[int, int], list[TensorMeta]] = field(default_factory=dict)
    _dy: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    _dx: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    _weights: dict[tuple[int, int], DeferredWeights | None] = field(default_factory=dict)
    """Weight gradients a split ``B`` left for its ``W`` (see [Note: split backward] in ``_schedule.py``)."""
    _saved: dict[tuple[int, int], SavedActivations] = field(default_factory=dict)
    """What the forwards of split backwards saved, until their ``B`` ran (see [Note: what B leaves for W] in
    ``_backward.py``)."""
    _split: frozenset[tuple[int, int]] = frozenset()
    _last_gradients: tuple[int, int] | None = None
    """The ``(stage, micro-batch)`` whose weight gradients this rank computes last in the batch (its ``W`` when
    split, else its ``B``): under ZeRO-2/3 that backward reduce-scatters the batch's sum."""
    _upcoming: dict[tuple[ActionKind, int], deque[Action]] = field(default_factory=dict)
    """Receives of each channel ``(RECV_F / RECV_B, peer)`` not yet posted, in program order."""
    _posted: dict[tuple[ActionKind, int], tuple[Action, Incoming | IncomingGrads]] = field(default_factory=dict)
    """The receive posted ahead on each channel (at most one); see [Note: receives posted ahead] in ``_p2p.py``."""

    @property
    def last(self) -> int:
        return self.schedule.num_stages - 1

    @property
    def rank(self) -> int:
        """This rank's pipeline index."""
        return self.stage.rank

    @property
    def p2p(self) -> P2P:
        return self.stage.p2p

    def run(self) -> None:
        handlers = {
            ActionKind.FORWARD: self._forward,
            ActionKind.BACKWARD: self._backward,
            ActionKind.WEIGHT: self._weight,
            ActionKind.SEND_F: self._send_f,
            ActionKind.RECV_F: self._recv_f,
            ActionKind.SEND_B: self._send_b,
            ActionKind.RECV_B: self._recv_b,
        }
        program = self.schedule.programs[self.rank]
        # stages whose split backwards run whole: see [Note: checkpointed stages backpropagate whole]
        whole = {s for s in self.stage.chunks if s > 0 and self.stage.module.checkpoints_stage(s)}
        self._split = frozenset(k for k in self.schedule.split if k[0] not in whole)
        finishing = [
            a
            for a in program
            if (a.kind is ActionKind.WEIGHT and (a.stage, a.microbatch) in self._split)
            or (a.kind is ActionKind.BACKWARD and (a.stage, a.microbatch) not in self._split)
        ]
        self._last_gradients = (finishing[-1].stage, finishing[-1].microbatch) if finishing else None
        timed = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)
        if self.p2p.can_post_ahead:
            for a in program:
                if a.kind in (ActionKind.RECV_F, ActionKind.RECV_B):
                    self._upcoming.setdefault(self._channel(a), deque()).append(a)
            for channel in self._upcoming:
                self._post_ahead(channel)
        try:
            for action in program:
                if self.timings is not None and action.kind in timed:
                    start = time.perf_counter()
                    handlers[action.kind](action)
                    if self.stage.device.type == "cuda":
                        torch.cuda.synchronize(self.stage.device)
                    self.timings.append((str(action), start, time.perf_counter()))
                else:
                    handlers[action.kind](action)
            if self.stage.zero is not None:  # see "Held-back sums" in [Note: ZeRO inside a pipeline stage]
                self.stage.zero.flush_gradients()
        finally:
            self.p2p.wait()
            self._upcoming.clear()
            self._posted.clear()
            self._weights.clear()
            self._saved.clear()

    # ---------------------------------------------------------------------------------------- receives ahead
    def _channel(self, a: Action) -> tuple[ActionKind, int]:
        return a.kind, self._peer(a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage + 1)

    def _post_ahead(self, channel: tuple[ActionKind, int]) -> None:
        """Posts the next receive of ``channel`` unless one is posted already (gradients: once the matching
        activations are sent, which gives their shapes)."""
        queue = self._upcoming.get(channel)
        if not queue or channel in self._posted:
            return
        a = queue[0]
        if a.kind is ActionKind.RECV_F:
            incoming: Incoming | IncomingGrads = self.p2p.start_recv(channel[1])
        else:
            metas = self._metas.get((a.stage, a.microbatch))
            if metas is None:
                return
            incoming = self.p2p.start_recv_grads(metas, channel[1])
        queue.popleft()
        self._posted[channel] = (a, incoming)

    def _take_posted(self, a: Action) -> Incoming | IncomingGrads | None:
        """The receive posted ahead for ``a`` (None: post it now); frees the channel for the next one."""
        channel = self._channel(a)
        queue = self._upcoming.get(channel)
        if queue and queue[0] == a:
            queue.popleft()  # not posted ahead (only possible when its forward was never sent: the simulator forbids)
            return None
        posted = self._posted.pop(channel, None)
        if posted is None:
            return None  # posting ahead is off
        if posted[0] != a:
            raise AssertionError(f"rank {self.rank}: receive {posted[0]} was posted ahead but {a} runs first")
        return posted[1]

    def _peer(self, stage: int) -> int:
        return self.stage.peers[self.schedule.rank_of(stage)]

    # ---------------------------------------------------------------------------------------- forward
    def _forward(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        if s == 0:
            x = self.inputs[m]
        elif (s, m) in self._x:
            x = self._x[(s, m)]  # received
        else:
            x = _detach_boundary(self._y[(s - 1, m)])  # previous stage on this rank
            self._x[(s, m)] = x
        if s == 0:
            self._x[(s, m)] = x
        saved = None
        if s > 0 and (s, m) in self._split:  # the first stage's W is its whole backward: nothing to free early
            saved = self._saved[(s, m)] = SavedActivations()
        with saved.recording() if saved is not None else contextlib.nullcontext():
            try:
                y = self.stage.forward(s, x)
            except Exception as e:
                layers = self.stage.layers(s)
                raise RuntimeError(
                    f"pipeline stage {s} (layers {layers.start}..{layers.stop - 1}) failed in the forward of "
                    f"micro-batch {m} with {describe(x) or 'no tensor inputs'}: {type(e).__name__}: {e}. Check that "
                    "the previous stage's output matches what this stage's first layer expects"
                ) from e
            loss = self.stage.compute_loss(y, self.labels[m]) if s == self.last and self.with_loss else None
        if s == self.last:
            if loss is not None:
                self._loss[m] = loss
                self.losses.append(loss.detach())
            if self.keep_outputs:
                self.outputs[m] = y.detach() if isinstance(y, torch.Tensor) else y
        if s != self.last or self.schedule.training:
            self._y[(s, m)] = y
        if not self.schedule.training:
            self._x.pop((s, m), None)

    def _send_f(self, a: Action) -> None:
        key, peer = (a.stage, a.microbatch), self._peer(a.stage + 1)
        self._metas[key] = self.p2p.send(self._y[key], peer)
        if not self.schedule.training:
            del self._y[key]
        self._post_ahead((ActionKind.RECV_B, peer))  # its gradient's shapes are now known

    def _recv_f(self, a: Action) -> None:
        incoming = self._take_posted(a)
        peer = self._peer(a.stage - 1)
        self._x[(a.stage, a.microbatch)] = self.p2p.recv(peer, incoming)  # type: ignore[arg-type]
        self._post_ahead((ActionKind.RECV_F, peer))

    # ---------------------------------------------------------------------------------------- backward
    def _backward(self, a: Action) -> None:
        s, m = a.stage, a.microbatch
        if s == self.last:
            loss = self._loss.pop(m)
            wanted, grads = [loss * self.loss_scale], [torch.ones((), dtype=loss.dtype, device=loss.device)]
        else:
            outs, _ = flatten(self._y[(s, m)])
            wanted = [t for t in outs if t.requires_grad and t.is_floating_point()]
            grads = self._dy.pop((s, m)) if (s, m) in self._dy else self._dx.pop((s + 1, m))
            if len(grads) != len(wanted):
                raise AssertionError(f"stage {s} mb {m}: {len(grads)} gradients for {len(wanted)} outputs")
            for i, (t, g) in enumerate(zip(wanted, grads)):
                if t.shape != g.shape:
                    raise RuntimeError(
                        f"pipeline stage {s}: gradient for output tensor {i} of micro-batch {m} has shape "
                        f"{list(g.shape)} but the output has shape {list(t.shape)}"
                    )
        self._y.pop((s, m), None)
        x = self._x.pop((s, m))
        ins = [t for t in flatten(x)[0] if t.requires_grad and t.is_floating_point()] if s > 0 else []
        self._sync_gradients_after(s, m)
        if (s, m) in self._split:  # see [Note: split backward] in _schedule.py
            work = self._weights[(s, m)] = backward_input(wanted, grads, ins) if wanted else None
            saved = self._saved.pop((s, m), None)
            if saved is not None:
                saved.keep_only_for(work)
        elif wanted:
            torch.autograd.backward(wanted, grads)
        if s > 0:
            self._dx[(s, m)] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]

    def _weight(self, a: Action) -> None:
        if (a.stage, a.microbatch) not in self._split:
            return  # its B ran the whole backward: see [Note: checkpointed stages backpropagate whole]
        self._sync_gradients_after(a.stage, a.microbatch)
        backward_weight(self._weights.pop((a.stage, a.microbatch)))

    def _sync_gradients_after(self, stage: int, microbatch: int) -> None:
        """ZeRO-2/3: whether the next backward reduce-scatters the batch's gradients (the rank's last to compute
        weight gradients) or keeps summing them locally. A split ``B`` computes none unless it had to run whole, and
        then the flag of its own micro-batch is the right one too."""
        if self.stage.zero is not None:
            self.stage.zero.set_gradient_sync((stage, microbatch) == self._last_gradients)

    def _send_b(self, a: Action) -> None:
        self.p2p.send_grads(self._dx.pop((a.stage, a.microbatch)), self._peer(a.stage - 1))

    def _recv_b(self, a: Action) -> None:
        key, peer = (a.stage, a.microbatch), self._peer(a.stage + 1)
        incoming = self._take_posted(a)
        self._dy[key] = self.p2p.recv_grads(self._metas.pop(key), peer, incoming)  # type: ignore[arg-type]
        self._post_ahead((ActionKind.RECV_B, peer))
