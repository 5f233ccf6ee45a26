"""Adam/AdamW with offloaded state: the step runs on the host over sub-groups whose state lives on the host or
on NVMe.

[Note: pipelined optimizer swapping]
The trainable shards are cut into sub-groups of at most ``buffer_size`` elements, stepped in a fixed *step order*
(the groups' order, or its reverse with ``step_in_backward``, the order their gradients become final). With NVMe
state each sub-group is read into pool buffers, stepped there and written back, and reads run ahead of the step::

    read(i+1 .. i+k) in flight  ->  Adam on i (its reads waited for, one by one)  ->  write(i) in flight

``k`` is whatever the pool holds: a read is issued whenever a whole sub-group's buffers are free (finished writes
give theirs back without blocking), so reads of later sub-groups and writes of earlier ones overlap the compute
of ``i``. Reads do not depend on gradients, so the read-ahead starts with the next step's forward (the engine's
prefetch calls reach ``read_ahead``) and keeps going through backward: on a state-dominated model most of the
state is in memory before ``optimizer.step()`` begins. A sub-group needed out of order is read on demand, giving
back buffers of read-ahead sub-groups furthest in the order when the pool is full. Between steps nothing holds a
buffer: the step waits for its last writes and gives back read-ahead buffers it did not use (sub-groups without a
gradient), so checkpoints and files on disk are settled. A sub-group whose pieces got no gradient this step is
skipped without I/O, as torch's Adam skips them. With fewer than three sub-groups' buffers there is little to
overlap (and a warning says so); the minimum is one sub-group's.

[Note: optimizer steps in backward]
With ``step_in_backward`` the engine tells the optimizer when a group's gradient shard is final (every use of the
group reduced; see ``ZeroState._notify_gradient_final``) and, when the coming ``step()`` was announced
(`step_in_next_backward`, which ``DeepSpeedZeroOptimizer_Stage3.backward`` calls on the last micro-batch of a window
and ``step(closure)`` calls around its closure, as Lightning steps), the group's sub-groups are stepped right there,
between the units of backward, and their writes overlap what is left of it. ``step()`` then only steps what is
left (groups whose gradient was not final early: unused units, pieces whose use another rank decides).

That is the same update, operation for operation, as long as what it reads is what ``step()`` would have read:

* the gradient: nothing may change it after backward. Gradient clipping (needs every gradient's norm first) and
  fp16 unscaling/overflow checks do; ``clip_grad_norm_`` and ``unscale_and_check_`` raise after an early update
  instead of silently doing nothing, and ``DeepSpeedZeroOptimizer_Stage3`` does not announce the step when it
  clips or scales (the update then stays in ``step()``; the reads still run ahead, so the default stays exact);
* the hyper-parameters: they are read when the group is stepped and compared at ``step()``, where a change (a
  learning rate set between backward and step) raises, since the update cannot be undone. Schedulers that step
  after ``optimizer.step()`` (Lightning's, the usual loop) are fine;
* the step count: pieces stepped early count their step at ``step()`` like the others.

With ``release_gradients`` the group's gradient shard is freed after its update (``.grad`` None): gradients never
all exist at once, which with ``offload_params`` is what lets a model whose training state exceeds RAM train (the
parameter shard read for the group's backward all-gather also stays in memory for its update, so it is read once).
Nothing is traded for the overlap: without the announcement, or with clipping, it falls back to the exact path.

[Note: exact Adam]
The update is torch's single-tensor Adam/AdamW, operation for operation (``lerp_``, ``mul_().addcmul_()``, bias
corrections from a per-parameter step count), so results match ``torch.optim.Adam(W)`` on the unsharded model
bitwise. Hyper-parameters are read from the user's optimizer's ``param_groups`` at every step (LR schedulers keep
working), and parameters of different groups or step counts are stepped as separate segments. When
``zlightning.kernels.CPUAdam`` is built it replaces the per-segment update of float32 state (vectorised, same math).

[Note: optimizer state in the parameter's dtype]
torch's Adam keeps ``exp_avg``/``exp_avg_sq`` in the parameter's dtype (``zeros_like``) and does its math there. A
group's master is its parameters' own dtype (float32 under every ``Trainer(precision=...)``, but a model may keep
float64 or bfloat16 parameters of its own), so each sub-group's state, gradient and update use that dtype too: float32
groups through the kernel when built, others through ``torch_adam``. With NVMe a sub-group holds ``buffer_size``
elements of its dtype and a pool buffer is sized for the widest one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from zlightning.zero._offload_config import NVMeOffload
from zlightning.zero._swap import SwapState, SwapTensor

if TYPE_CHECKING:
    from zlightning.zero._offload import ZeroOffload
    from zlightning.zero._param import ZeroParam
    from zlightning.zero._param_group import ZeroParamGroup
    from zlightning.zero._state import ZeroState

__all__ = ["OffloadedAdam", "check_offloadable"]

_FLAGS_OFF = ("amsgrad", "maximize", "capturable", "differentiable", "fused")


def check_offloadable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is an Adam/AdamW the offloaded step reproduces; returns its decoupled-decay flag.

    Raises:
        ValueError: another optimizer type, or an Adam option the offloaded step does not implement.
    """
    if not isinstance(optimizer, torch.optim.Adam):
        raise ValueError(
            f"offload_optimizer steps Adam/AdamW on the host, but configure_optimizers returned "
            f"{type(optimizer).__name__}: use torch.optim.Adam or AdamW, or turn optimizer offload off"
        )
    overridden = _overridden_update(type(optimizer))
    if overridden:
        raise ValueError(
            f"offload_optimizer steps Adam/AdamW on the host with its own update, but configure_optimizers returned "
            f"{type(optimizer).__name__}, a subclass that overrides {', '.join(overridden)}: that code would never "
            "run. Use torch.optim.Adam or AdamW as they are, or turn optimizer offload off (strategy='zstack_zero3')"
        )
    for group in optimizer.param_groups:
        on = [flag for flag in _FLAGS_OFF if group.get(flag)]
        if on:
            raise ValueError(f"offload_optimizer does not support Adam options {on}: leave them at their defaults")
    return bool(optimizer.param_groups[0].get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))


def _overridden_update(cls: type) -> list[str]:
    """Methods of ``cls`` that replace torch's Adam/AdamW update (``step``, ``_init_group``), up to those classes."""
    out: list[str] = []
    for klass in cls.__mro__:
        if klass in (torch.optim.Adam, torch.optim.AdamW):
            break
        out += [f"{klass.__name__}.{name}" for name in ("step", "_init_group") if name in vars(klass)]
    return out


@dataclass(frozen=True)
class _Hyper:
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int  # the step number this update performs (1-based)


_HyperValues = tuple[float, float, float, float, float]
"""A param group's ``(lr, beta1, beta2, eps, weight_decay)``: `_Hyper` without the step."""

AdamFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, _Hyper, bool], None]


def torch_adam(
    param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: _Hyper, adamw: bool
) -> None:
    """torch's single-tensor Adam/AdamW update, in place (see [Note: exact Adam])."""
    if h.weight_decay != 0:
        if adamw:
            param.mul_(1 - h.lr * h.weight_decay)
        else:
            grad = grad.add(param, alpha=h.weight_decay)
    m.lerp_(grad, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias_correction1 = 1 - h.beta1**h.step
    bias_correction2 = 1 - h.beta2**h.step
    step_size = h.lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(h.eps)
    param.addcdiv_(m, denom, value=-step_size)


def _kernel_adam() -> AdamFn | None:
    """``zlightning.kernels``' compiled CPU Adam step (the op behind ``CPUAdam``) when built, else None."""
    try:
        from zlightning.kernels import _ext

        if not _ext.available():
            return None
        op = torch.ops.zlightning.adam_step_
    except Exception:  # noqa: BLE001 - kernels not built here: the torch update is used
        return None

    def step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: _Hyper, adamw: bool) -> None:
        if grad.dtype != torch.float32 or not grad.is_contiguous():
            grad = grad.float().contiguous()
        op(param, grad, m, v, None, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, h.step, True, adamw)

    return step


@dataclass
class _SubGroup:
    """Elements ``[lo, hi)`` of one group's shard, and their state tensors (swap tensors or host tensors)."""

    group: ZeroParamGroup
    lo: int
    hi: int
    pieces: list[tuple[ZeroParam, int, int]]  # (param, lo, hi) in shard coordinates, clipped to [lo, hi)
    swapped: dict[str, SwapTensor]
    host: dict[str, torch.Tensor]

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its state, gradient and update: its parameters' (see [Note: optimizer state in the
        parameter's dtype])."""
        return self.group.master_dtype

    def tensors(self) -> list[SwapTensor]:
        return list(self.swapped.values())


class OffloadedAdam(torch.optim.Optimizer):
    """The user's Adam/AdamW, stepped on the host with its state offloaded (see the Notes above).

    It shares ``param_groups`` with the user's optimizer (so LR schedulers attached to that one keep working) and
    keeps no tensors in ``self.state``: ``state_dict()`` reads the state back (from disk if needed) in torch's
    per-parameter format and ``load_state_dict()`` writes it out, so checkpoints look like plain Adam's.
    """

    def __init__(
        self, engine: ZeroState, inner: torch.optim.Optimizer, offload: ZeroOffload, *, use_kernel: bool = True
    ) -> None:
        self.adamw = check_offloadable(inner)
        pieces = [p for g in inner.param_groups for p in g["params"]]
        super().__init__(pieces, dict(inner.defaults))
        self.param_groups = inner.param_groups
        # Step hooks registered on the user's optimizer (an EMA, a counter; before or after this) run around this
        # step, which replaces that optimizer's: they see this optimizer, with the same param_groups.
        self._optimizer_step_pre_hooks = inner._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = inner._optimizer_step_post_hooks
        self.inner = inner
        self.engine = engine
        self.offload = offload
        self.policy = offload.optimizer_policy
        kernel = _kernel_adam() if use_kernel else None
        self._adam: AdamFn = kernel or torch_adam
        self.uses_kernel = kernel is not None
        self._steps: dict[int, int] = {}  # ZeroParam.index -> Adam steps taken
        self._subgroups = self._plan()
        self._check_buffers()
        self.step_in_backward = bool(self.policy is not None and self.policy.step_in_backward)
        self.release_gradients = bool(self.policy is not None and self.policy.release_gradients)
        # the step order (see [Note: pipelined optimizer swapping]) and each group's sub-groups in it
        by_group: dict[int, list[_SubGroup]] = {}
        for sg in self._subgroups:
            by_group.setdefault(id(sg.group), []).append(sg)
        groups = list(by_group.values())
        self._order = [sg for subs in (reversed(groups) if self.step_in_backward else groups) for sg in subs]
        self._by_group = by_group
        self._ahead = 0  # position in _order up to which read-ahead was considered this step
        # per step (see [Note: optimizer steps in backward])
        self._announced = False
        self._done: set[int] = set()  # id(_SubGroup) stepped this step
        self._early_groups: set[int] = set()  # id(group) stepped during backward this step
        self._early_hypers: dict[int, _HyperValues] = {}  # id(piece) -> hyper-parameters used early
        self._early_pieces: set[int] = set()  # ZeroParam.index stepped early whose .grad was released
        offload.optimizer = self

    # ---------------------------------------------------------------- planning
    def _plan(self) -> list[_SubGroup]:
        names = self.offload.optimizer_state_names()
        swapper = self.offload.optimizer_swapper
        out = []
        for gi, g in enumerate(self.engine.groups):
            if not g.trainable_at_build:
                continue
            size, dtype = self.offload.sub_group_numel_of(g), g.master_dtype
            base = g.rank * g.shard_numel
            spans = [(zp, zp.local_start - base, zp.local_end - base) for zp in g.params if zp.local_numel]
            step = size if swapper is not None else max(g.shard_numel, 1)
            for k, lo in enumerate(range(0, g.shard_numel, step)):
                hi = min(lo + step, g.shard_numel)
                pieces = [(zp, max(a, lo), min(b, hi)) for zp, a, b in spans if a < hi and b > lo]
                swapped, host = {}, {}
                for name in names:
                    if swapper is not None:
                        path = swapper.folder.file(f"optim_group{gi}_{name}.swp")
                        swapped[name] = SwapTensor(
                            f"group {gi} {name}[{lo}:{hi}]", path, k * size * dtype.itemsize, hi - lo, dtype
                        )
                    else:
                        host[name] = torch.zeros(hi - lo, dtype=dtype, pin_memory=self.offload.pin)
                if "master" in host:
                    host["master"].copy_(g.shard[lo:hi])
                out.append(_SubGroup(g, lo, hi, pieces, swapped, host))
        return out

    def _check_buffers(self) -> None:
        """Refuses a pool smaller than one sub-group's buffers; warns below three (little overlap)."""
        policy = self.policy
        if not isinstance(policy, NVMeOffload):
            return
        per = len(self.offload.optimizer_state_names())
        if policy.buffer_count < per:
            raise ValueError(
                f"offload_optimizer=NVMeOffload(buffer_count={policy.buffer_count}) is too small: one sub-group needs "
                f"{per} buffers ({', '.join(self.offload.optimizer_state_names())}); use buffer_count >= {3 * per} "
                "for the pipelined step"
            )
        if policy.buffer_count < 3 * per:
            warnings.warn(
                f"NVMeOffload(buffer_count={policy.buffer_count}) < {3 * per}: the optimizer step barely overlaps "
                "reads, compute and writes. Raise buffer_count to pipeline it.",
                stacklevel=3,
            )

    # ---------------------------------------------------------------- the step
    def _hypers(self) -> dict[int, _HyperValues]:
        out: dict[int, _HyperValues] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            values = (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]))
            for p in group["params"]:
                out[id(p)] = values
        return out

    def _segments(
        self, sg: _SubGroup, hypers: dict[int, _HyperValues]
    ) -> list[tuple[int, int, _Hyper, list[tuple[ZeroParam, int, int]]]]:
        """Runs of adjacent pieces with a gradient and identical hyper-parameters and step."""
        segs: list[tuple[int, int, _Hyper, list[tuple[ZeroParam, int, int]]]] = []
        for zp, a, b in sg.pieces:
            if zp.piece.grad is None or id(zp.piece) not in hypers:
                continue
            h = _Hyper(*hypers[id(zp.piece)], step=self._steps.get(zp.index, 0) + 1)
            if segs and segs[-1][1] == a and segs[-1][2] == h:
                lo, _, _, members = segs[-1]
                segs[-1] = (lo, b, h, members + [(zp, a, b)])
            else:
                segs.append((a, b, h, [(zp, a, b)]))
        return segs

    def _grad(self, sg: _SubGroup, members: list[tuple[ZeroParam, int, int]], lo: int, hi: int) -> torch.Tensor:
        g = sg.group
        parts = []
        base = g.rank * g.shard_numel
        for zp, a, b in members:
            start = zp.local_start - base
            parts.append(zp.piece.grad.reshape(-1)[a - start : b - start])  # type: ignore[union-attr]
        grad = parts[0] if len(parts) == 1 else torch.cat(parts)
        if g.grad is not None and len(parts) > 1 and all(_views(x, g.grad) for x in parts):
            grad = g.grad[lo:hi]  # the usual case: one contiguous slice, no copy
        return grad.to("cpu", sg.dtype) if grad.device.type != "cpu" or grad.dtype != sg.dtype else grad

    def _compute(self, sg: _SubGroup, segs: list[Any]) -> None:
        master = self._tensor(sg, "master") if self.offload.master_on_host else sg.group.shard[sg.lo : sg.hi]
        m, v = self._tensor(sg, "exp_avg"), self._tensor(sg, "exp_avg_sq")
        adam = self._adam if sg.dtype == torch.float32 else torch_adam  # the kernel steps float32 state
        with torch.no_grad():
            for a, b, h, members in segs:
                i, j = a - sg.lo, b - sg.lo
                adam(master[i:j], self._grad(sg, members, a, b), m[i:j], v[i:j], h, self.adamw)
            if self.offload.master_on_host:
                # A pool buffer is reused as soon as its write finishes: copy from it synchronously. A CPUOffload
                # master is a pinned host tensor of its own, so that copy overlaps (the next step's backward
                # synchronises the stream before the host touches the master again).
                sg.group.shard[sg.lo : sg.hi].copy_(master, non_blocking=not sg.swapped)

    def _tensor(self, sg: _SubGroup, name: str) -> torch.Tensor:
        return sg.swapped[name].data() if sg.swapped else sg.host[name]

    # ---------------------------------------------------------------- swapping (see [Note: pipelined optimizer swapping])
    def read_ahead(self) -> None:
        """Issues reads of upcoming sub-groups while the pool has a whole sub-group's buffers free; never blocks.
        The engine calls it (through ``ZeroOffload.prefetch``) at every unit of forward and backward."""
        swapper = self.offload.optimizer_swapper
        if swapper is None:
            return
        swapper.reap_writes()
        per = len(self.offload.optimizer_state_names())
        while self._ahead < len(self._order) and swapper.pool.free_count >= per:
            sg = self._order[self._ahead]
            self._ahead += 1
            if id(sg) not in self._done and all(t.state is SwapState.ON_NVME for t in sg.tensors()):
                for t in sg.tensors():
                    swapper.read(t)

    def _make_room(self, needed: int, keep: _SubGroup) -> None:
        """Frees pool buffers for ``needed`` tensors of ``keep``: finished writes first, then read-ahead sub-groups
        furthest in the step order (their data is on disk), then every write."""
        swapper = self.offload.optimizer_swapper
        if swapper is None or swapper.pool.free_count >= needed:
            return
        swapper.reap_writes()
        for sg in reversed(self._order):
            if swapper.pool.free_count >= needed:
                return
            if sg is keep or id(sg) in self._done:
                continue
            for t in sg.tensors():
                if swapper.is_reading(t):
                    swapper.wait_read(t)
                if t.state is SwapState.IN_CPU and t.checksums:
                    swapper.release(t)
        if swapper.pool.free_count < needed:
            swapper.wait_writes()

    def _bring_in(self, sg: _SubGroup) -> None:
        """Every state tensor of ``sg`` in its pool buffer (waiting for its read-ahead, or reading it now)."""
        swapper = self.offload.optimizer_swapper
        if swapper is None:
            return
        missing = [t for t in sg.tensors() if t.state in (SwapState.ON_NVME, SwapState.ON_DEVICE)]
        self._make_room(len(missing), keep=sg)
        for name, t in sg.swapped.items():
            if t.state is SwapState.ON_DEVICE:  # first step: state starts at zero, the master at the shard
                swapper.stage(t, sg.group.shard[sg.lo : sg.hi] if name == "master" else None)
            elif t.state is SwapState.ON_NVME:
                swapper.read(t)
        for t in sg.tensors():
            if swapper.is_reading(t):
                swapper.wait_read(t)

    def _step_group(self, group: ZeroParamGroup, work: list[tuple[_SubGroup, list[Any]]]) -> None:
        """Steps ``group``'s sub-groups that have work (the shard made resident first and written back after, with
        parameter offload); their writes are left in flight."""
        params = self.offload.params
        if params is not None:
            params.mark_dirty(group)
        swapper = self.offload.optimizer_swapper
        for sg, segs in work:
            self._bring_in(sg)
            self._compute(sg, segs)
            self._done.add(id(sg))
            if swapper is not None:
                for t in sg.tensors():
                    swapper.write(t)
            self.read_ahead()
        if params is not None:
            params.commit(group)

    def _settle(self) -> None:
        """End of a step: waits for the writes and gives back read-ahead buffers the step did not use."""
        self.quiesce()
        if self.offload.params is not None:
            self.offload.params.drop_held()
            self.offload.params.flush()

    def quiesce(self) -> None:
        """Waits for every read and write of the optimizer state and gives back read-ahead buffers, so the files
        hold the state and no buffer is lent (before the state is read or replaced wholesale: checkpoints). Safe
        mid-step: sub-groups stepped during backward stay stepped."""
        swapper = self.offload.optimizer_swapper
        if swapper is None:
            return
        swapper.wait_writes()
        swapper.wait_reads()
        for sg in self._order:
            for t in sg.tensors():
                if t.state is SwapState.IN_CPU and t.checksums:
                    swapper.release(t)
        self._ahead = 0

    def _abandon(self) -> None:
        """After a failed step: wait for in-flight I/O so no buffer is still being filled or drained."""
        swapper = self.offload.optimizer_swapper
        self._reset_step()
        if swapper is None:
            return
        for wait in (swapper.wait_reads, swapper.wait_writes):
            try:
                wait()
            except BaseException:  # noqa: BLE001 - the first error is the one that is raised
                pass
        for sg in self._order:
            for t in sg.tensors():
                if t.state is SwapState.IN_CPU:
                    if t.checksums:
                        swapper.release(t)
                    else:  # staged (first step) and never written: its values are lost with the failed step
                        swapper.discard(t)

    # ---------------------------------------------------------------- steps in backward
    def step_in_next_backward(self, announce: bool = True) -> None:
        """Announces that the next backward is the last before ``step()`` and that nothing changes gradients or
        hyper-parameters in between, so with ``step_in_backward`` groups are stepped as their gradients become final
        (see [Note: optimizer steps in backward]). ``announce=False`` withdraws it (an accumulation micro-batch, or
        clipping to come). Without ``step_in_backward`` it does nothing."""
        self._announced = announce and self.step_in_backward

    def updates_in_backward(self, group: ZeroParamGroup) -> bool:
        """Whether ``group`` will be stepped later in the backward now running (its parameter shard is worth
        keeping in memory until then)."""
        from zlightning.zero._state import TrainingState

        return (
            self._announced
            and id(group) in self._by_group
            and id(group) not in self._early_groups
            and self.engine.training_state is TrainingState.BACKWARD
        )

    @property
    def stepped_in_backward(self) -> bool:
        """Whether some group was already stepped during this step's backward."""
        return bool(self._early_groups)

    def gradient_final(self, group: ZeroParamGroup) -> None:
        """Called by the engine when ``group``'s gradient shard is final for this backward: steps it now when the
        step was announced, else only moves the read-ahead along.

        Raises:
            RuntimeError: the group was stepped already in this step (a second backward before ``step()``).
        """
        subs = self._by_group.get(id(group))
        if not self._announced or subs is None:
            self.read_ahead()
            return
        if id(group) in self._early_groups:
            raise RuntimeError(
                "step_in_backward: a second backward reached a parameter group already stepped in this step's "
                "backward. Call optimizer.step() after each backward, or announce only the last micro-batch of an "
                "accumulation window (step_in_next_backward(False) before the others)."
            )
        hypers = self._hypers()
        work = [(sg, segs) for sg in subs if (segs := self._segments(sg, hypers))]
        if not work:
            return
        self._early_groups.add(id(group))
        for _, segs in work:
            for _, _, _, members in segs:
                for zp, _, _ in members:
                    self._early_hypers[id(zp.piece)] = hypers[id(zp.piece)]
        try:
            self._step_group(group, work)
        except BaseException:
            self._abandon()
            raise
        if self.release_gradients:
            self._release_gradients(group, hypers)

    def _release_gradients(self, group: ZeroParamGroup, hypers: dict[int, _HyperValues]) -> None:
        for zp in group.params:
            if zp.piece.grad is not None and id(zp.piece) in hypers:
                self._early_pieces.add(zp.index)
                zp.piece.grad = None
        if all(zp.piece.grad is None for zp in group.params):
            group.grad = None  # the shard's memory goes back (the next backward makes a new one)

    def _check_hypers(self, hypers: dict[int, _HyperValues]) -> None:
        changed = [k for k, v in self._early_hypers.items() if hypers.get(k) != v]
        if changed:
            raise RuntimeError(
                "step_in_backward: the optimizer's hyper-parameters (lr, betas, eps, weight_decay) changed between "
                "backward and optimizer.step(), but some groups were already updated during backward with the old "
                "values. Set them before backward (schedulers that step after optimizer.step() are fine), or turn "
                "step_in_backward off."
            )

    def _reset_step(self) -> None:
        self._announced = False
        self._done.clear()
        self._early_groups.clear()
        self._early_hypers.clear()
        self._early_pieces.clear()
        self._ahead = 0

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One Adam step over every sub-group not stepped during backward yet. Returns ``closure()``'s value (a
        closure's backward is the last before this step, so it is announced: see `step_in_next_backward`)."""
        loss = None
        if closure is not None:
            self.step_in_next_backward()
            with torch.enable_grad():
                loss = closure()
        hypers = self._hypers()
        try:
            self._check_hypers(hypers)
            work = [
                (sg, segs) for sg in self._order if id(sg) not in self._done and (segs := self._segments(sg, hypers))
            ]
            by_group: list[tuple[ZeroParamGroup, list[tuple[_SubGroup, list[Any]]]]] = []
            for sg, segs in work:
                if not by_group or by_group[-1][0] is not sg.group:
                    by_group.append((sg.group, []))
                by_group[-1][1].append((sg, segs))
            params = self.offload.params
            for i, (group, items) in enumerate(by_group):
                if params is not None:
                    params.prefetch([g for g, _ in by_group[i + 1 :]])
                self._step_group(group, items)
            self._settle()
        except BaseException:
            self._abandon()
            raise
        for zp in self.engine.params:  # empty pieces count too: torch steps a parameter whenever it has a .grad
            if id(zp.piece) in hypers and (zp.piece.grad is not None or zp.index in self._early_pieces):
                self._steps[zp.index] = self._steps.get(zp.index, 0) + 1
        self._reset_step()
        self.inner._opt_called = True  # type: ignore[attr-defined]  # LR schedulers check the user's optimizer
        return loss

    # ---------------------------------------------------------------- state dict (torch Adam's format)
    def _read_all(self, sg: _SubGroup) -> dict[str, torch.Tensor]:
        """Copies of a sub-group's state tensors (zeros for a sub-group never stepped)."""
        swapper = self.offload.optimizer_swapper
        if swapper is None:
            return {k: t.clone() for k, t in sg.host.items()}
        out = {}
        for name, t in sg.swapped.items():
            if t.state is SwapState.ON_DEVICE:
                out[name] = (
                    torch.zeros(t.numel, dtype=t.dtype) if name != "master" else sg.group.shard[sg.lo : sg.hi].cpu()
                )
                continue
            swapper.read(t)
            swapper.wait_reads()
            out[name] = t.data().clone()
            swapper.release(t)
        return out

    def _write_all(self, sg: _SubGroup, values: dict[str, torch.Tensor]) -> None:
        swapper = self.offload.optimizer_swapper
        if swapper is None:
            for name, t in values.items():
                sg.host[name].copy_(t)
            return
        for name, swapped in sg.swapped.items():
            if swapped.state is SwapState.ON_NVME:
                swapper.supersede(swapped)
            swapper.stage(swapped, values[name])
            swapper.write(swapped)
            swapper.wait_writes()

    def state_dict(self) -> dict[str, Any]:
        self.quiesce()
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state: dict[int, dict[str, Any]] = {}
        for zp in self.engine.params:
            if self._steps.get(zp.index, 0) > 0 and id(zp.piece) in index:
                state[index[id(zp.piece)]] = self._empty_entry(zp)
        for sg in self._subgroups:
            stepped = [(zp, a, b) for zp, a, b in sg.pieces if self._steps.get(zp.index, 0) > 0]
            if not stepped:
                continue
            values = self._read_all(sg)
            base = sg.group.rank * sg.group.shard_numel
            for zp, a, b in stepped:
                entry = state[index[id(zp.piece)]]
                start = zp.local_start - base
                for key in ("exp_avg", "exp_avg_sq"):
                    entry[key][a - start : b - start].copy_(values[key][a - sg.lo : b - sg.lo])
        groups = []
        start = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        return {"state": state, "param_groups": groups}

    def _empty_entry(self, zp: ZeroParam) -> dict[str, Any]:
        n, dtype = zp.local_numel, zp.piece.dtype
        return {
            "step": torch.tensor(float(self._steps[zp.index])),
            "exp_avg": torch.zeros(n, dtype=dtype),
            "exp_avg_sq": torch.zeros(n, dtype=dtype),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads torch Adam's format (pieces' local state) into the offloaded store and the hyper-parameters."""
        self.quiesce()
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, self.param_groups)
        ):
            raise ValueError("optimizer state dict has a different parameter-group structure than this optimizer")
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        pieces = [p for g in self.param_groups for p in g["params"]]
        entries = {id(pieces[int(i)]): e for i, e in state_dict["state"].items()}
        self._steps = {}
        for sg in self._subgroups:
            values = (
                self._read_all(sg)
                if self._steps_any(sg)
                else {
                    k: (
                        sg.group.shard[sg.lo : sg.hi].cpu()
                        if k == "master"
                        else torch.zeros(sg.hi - sg.lo, dtype=sg.dtype)
                    )
                    for k in self.offload.optimizer_state_names()
                }
            )
            base = sg.group.rank * sg.group.shard_numel
            touched = False
            for zp, a, b in sg.pieces:
                e = entries.get(id(zp.piece))
                if e is None:
                    continue
                start = zp.local_start - base
                for key in ("exp_avg", "exp_avg_sq"):
                    values[key][a - sg.lo : b - sg.lo].copy_(e[key].reshape(-1)[a - start : b - start])
                if "master" in values:
                    values["master"].copy_(sg.group.shard[sg.lo : sg.hi])
                touched = True
            if touched:
                self._write_all(sg, values)
        for zp in self.engine.params:
            e = entries.get(id(zp.piece))
            if e is not None and "step" in e:
                self._steps[zp.index] = int(float(e["step"]))

    def _steps_any(self, sg: _SubGroup) -> bool:
        return any(t.state is not SwapState.ON_DEVICE for t in sg.swapped.values()) if sg.swapped else True

    def export_to_inner(self) -> torch.optim.Optimizer:
        """Puts the state into the user's optimizer (per piece, in memory) and returns it: after training, the
        plain module and a plain optimizer remain."""
        sd = self.state_dict()
        self.inner.state.clear()
        self.inner.load_state_dict(sd)
        return self.inner

    def memory_bytes(self) -> int:
        """Host bytes of optimizer state held resident (the pool for NVMe, all state for CPU offload)."""
        if self.offload.optimizer_swapper is not None:
            return self.offload.optimizer_swapper.pool.total_bytes
        return sum(t.numel() * 4 for sg in self._subgroups for t in sg.host.values())


def _views(a: torch.Tensor, base: torch.Tensor) -> bool:
    return a.numel() == 0 or a.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
