"""Optimizer-side pieces of ZeRO-3: attaching a user optimizer, global gradient norm and clipping, fp16 dynamic loss
scaling, the memory report, and ``DeepSpeedZeroOptimizer_Stage3`` for use without Lightning.

The global norm over shards (and a model-parallel group) is ``zlightning/_gradnorm.py``'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zlightning import _gradnorm
from zlightning.zero._checkpoint import (
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    load_full_state_dict,
    remap_optimizer,
    unshard_module,
)
from zlightning.zero._config import ZeroConfig
from zlightning.zero._offload_optimizer import OffloadedAdam
from zlightning.zero._param import ZeroParam
from zlightning.zero._param_group import GroupState
from zlightning.zero._state import ParamInitFn, ZeroState
from zlightning.zero._unit import UnitPolicy

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "DynamicLossScaler",
    "LossScalerConfig",
    "MemoryReport",
    "ModelParallelGrads",
    "attach_optimizer",
    "clip_grad_norm_",
    "global_grad_norm",
    "memory_report",
    "unscale_and_check_",
]


def attach_optimizer(
    state: ZeroState, optimizer: torch.optim.Optimizer, *, stand_ins: Mapping[int, ZeroParam] | None = None
) -> torch.optim.Optimizer:
    """Re-points ``optimizer`` (built over the full parameters, or over ``stand_ins`` from
    ``ZeroState.full_shape_stand_ins``) to the shard pieces and marks gathered copies stale after each of its steps.

    Returns:
        The optimizer to step: ``optimizer`` itself, or with ``ZeroConfig.offload_optimizer`` an ``OffloadedAdam``
        that shares its ``param_groups`` (LR schedulers on ``optimizer`` keep working) and keeps the state offloaded.

    Raises:
        ValueError: the optimizer has state already, or offload is on and it is not a plain Adam/AdamW.
    """
    remap_optimizer(state, optimizer, stand_ins)
    if state.offload is not None and state.config.offload_optimizer is not None:
        optimizer = OffloadedAdam(state, optimizer, state.offload)
    state.optimizer_hooks.append(optimizer.register_step_post_hook(lambda opt, args, kwargs: state.on_optimizer_step()))
    return optimizer


def _grads(pieces: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in pieces if p.grad is not None and p.grad.numel() > 0]


@dataclass(frozen=True)
class ModelParallelGrads:
    """Which parameters a model-parallel group (tensor parallelism) splits beyond the engine's data-parallel group.

    Set it as ``ZeroState.model_parallel``; `global_grad_norm`, `clip_grad_norm_` and the fp16 overflow check then
    reduce over both groups. See [Note: global norm over shards and model-parallel groups] in
    ``zlightning/_gradnorm.py``.

    Raises:
        ValueError: ``group`` is None.
    """

    group: dist.ProcessGroup
    """The model-parallel group: the ranks holding different slices of one model replica."""
    split: frozenset[str] = field(default_factory=frozenset)
    """Qualified names (relative to the engine's root module) of the parameters split across ``group``; every other
    parameter is replicated across it and counted once."""

    def __post_init__(self) -> None:
        if self.group is None:
            raise ValueError("ModelParallelGrads.group must be a process group (the tensor-parallel group)")

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def is_split(self, state: ZeroState, piece: torch.Tensor) -> bool:
        zp = state.zero_param_of(piece)
        return zp is not None and not self.split.isdisjoint(zp.fqns)


def _split_grads(state: ZeroState, pieces: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(split, replicated)`` local gradients: split across the model-parallel group, or replicated on it."""
    mp = state.model_parallel
    split = [mp is not None and mp.is_split(state, p) for p in pieces]
    return _grads(p for p, s in zip(pieces, split) if s), _grads(p for p, s in zip(pieces, split) if not s)


def global_grad_norm(state: ZeroState, pieces: Iterable[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The norm of the full gradient across all ranks' pieces (``inf`` norm supported). Collective over the engine's
    group and, with ``state.model_parallel``, its model-parallel group (see [Note: global norm over shards and
    model-parallel groups] in ``zlightning/_gradnorm.py``)."""
    split, replicated = _split_grads(state, list(pieces))
    mp = state.model_parallel
    return _gradnorm.global_norm(
        split,
        replicated,
        norm_type,
        partitioned_over=[state.process_group],
        device=state.device,
        model_parallel=mp.group if mp is not None else None,
    )


def clip_grad_norm_(
    state: ZeroState, pieces: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clips the full gradient to ``max_norm`` like ``torch.nn.utils.clip_grad_norm_``; returns the total norm."""
    pieces = list(pieces)
    if state.offload is not None:  # see [Note: optimizer steps in backward] in _offload_optimizer.py
        state.offload.check_gradients_unapplied("gradient clipping")
    total = global_grad_norm(state, pieces, norm_type)
    _gradnorm.clip_(_grads(pieces), total, max_norm)
    return total


def unscale_and_check_(state: ZeroState, pieces: Iterable[torch.Tensor], inv_scale: float) -> bool:
    """Multiplies gradients by ``inv_scale`` and returns whether any rank saw inf/NaN. Collective (a TP peer's
    overflow skips the step on every rank of the grid too)."""
    if state.offload is not None:  # see [Note: optimizer steps in backward] in _offload_optimizer.py
        state.offload.check_gradients_unapplied("fp16 unscaling and the overflow check")
    groups = [state.process_group] + ([state.model_parallel.group] if state.model_parallel is not None else [])
    return _gradnorm.unscale_and_check_(_grads(pieces), inv_scale, groups, device=state.device)


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """fp16 dynamic loss scaling (DeepSpeed's ``fp16`` block)."""

    initial_scale_power: int = 16
    """The first scale is ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Overflow-free steps before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget after every overflow-free step."""
    min_loss_scale: float = 1.0
    """Floor for the scale."""

    def __post_init__(self) -> None:
        if not 0 <= self.initial_scale_power <= 64:
            raise ValueError(f"LossScalerConfig.initial_scale_power must be in [0, 64], got {self.initial_scale_power}")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError(
                f"LossScalerConfig.loss_scale_window and hysteresis must be >= 1, got {self.loss_scale_window}, "
                f"{self.hysteresis}"
            )
        if self.min_loss_scale <= 0:
            raise ValueError(f"LossScalerConfig.min_loss_scale must be > 0, got {self.min_loss_scale}")


class DynamicLossScaler:
    """Loss-scale state: halves on overflow (after hysteresis), doubles after a clean window."""

    def __init__(self, config: LossScalerConfig | None = None) -> None:
        self.config = config or LossScalerConfig()
        self.scale = float(2**self.config.initial_scale_power)
        self._clean_steps = 0
        self._hysteresis = self.config.hysteresis

    def update(self, found_inf: bool) -> None:
        """Advances the schedule after a step attempt.

        Raises:
            FloatingPointError: an overflow happened with the scale already at ``min_loss_scale``.
        """
        if found_inf:
            self._clean_steps = 0
            if self._hysteresis > 1:
                self._hysteresis -= 1
                return
            if self.scale <= self.config.min_loss_scale:
                raise FloatingPointError(
                    f"fp16 gradients overflowed with the loss scale at its minimum ({self.config.min_loss_scale}): "
                    "lower the learning rate, use bf16, or lower LossScalerConfig.min_loss_scale"
                )
            self.scale = max(self.scale / 2.0, self.config.min_loss_scale)
            return
        if self.config.consecutive_hysteresis:
            self._hysteresis = self.config.hysteresis
        self._clean_steps += 1
        if self._clean_steps % self.config.loss_scale_window == 0:
            self.scale *= 2.0
            self._hysteresis = self.config.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean_steps": self._clean_steps, "hysteresis": self._hysteresis}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.scale = float(sd["scale"])
        self._clean_steps = int(sd["clean_steps"])
        self._hysteresis = int(sd["hysteresis"])


@dataclass(frozen=True)
class MemoryReport:
    """Resident model-state bytes on this rank."""

    param_bytes: int
    """Sharded master parameters (this rank's flat shards)."""
    grad_bytes: int
    """Sharded fp32 gradients."""
    optimizer_bytes: int
    """Optimizer state tensors held for this rank's pieces."""
    persistent_bytes: int
    """Gathered copies of persistent (small) parameters."""
    gathered_bytes: int
    """Gathered copies of other units right now (0 between steps)."""
    largest_unit_bytes: int
    """Largest unit's gathered size (the most a step gathers at once, without prefetch)."""
    full_model_bytes: int
    """All parameters unsharded, in their master dtype."""

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.persistent_bytes + self.gathered_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def memory_report(state: ZeroState, optimizers: Iterable[torch.optim.Optimizer] = ()) -> MemoryReport:
    """Counts this rank's resident model-state bytes (see ``MemoryReport``)."""
    opt_bytes = 0
    for opt in optimizers:
        if isinstance(opt, OffloadedAdam):
            opt_bytes += opt.memory_bytes()
            continue
        for s in opt.state.values():
            opt_bytes += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))
    gathered = [g for g in state.groups if g.status is not GroupState.SHARDED]
    return MemoryReport(
        param_bytes=sum(g.shard.untyped_storage().nbytes() for g in state.groups),  # 0 while swapped out
        grad_bytes=sum(g.grad.numel() * g.grad.element_size() for g in state.groups if g.grad is not None),
        optimizer_bytes=opt_bytes,
        persistent_bytes=sum(g.unsharded_bytes for g in gathered if g.persistent),
        gathered_bytes=sum(g.unsharded_bytes for g in gathered if not g.persistent),
        largest_unit_bytes=max((u.unsharded_bytes for u in state.units), default=0),
        full_model_bytes=sum(zp.numel * zp.original.element_size() for zp in state.params),
    )


class DeepSpeedZeroOptimizer_Stage3:  # noqa: N801 - DeepSpeed's public name, kept so its users recognise it
    """ZeRO stage 3 on a plain model and optimizer, without Lightning.

    Shards ``module`` in place (parameters, gradients and, through the re-pointed ``init_optimizer``, optimizer
    state), then runs the usual loop::

        zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters()), gradient_clipping=1.0)
        for batch in loader:
            loss = model(batch)
            zero.backward(loss)
            zero.step()

    Args:
        module: the model, already on its device; every rank builds it the same way (rank 0's values win when
            ``config.sync_module_states``).
        init_optimizer: any torch optimizer over ``module``'s parameters, with no state yet.
        config: engine knobs (``ZeroConfig``).
        process_group: data-parallel group (default: the world).
        gradient_clipping: clip the global gradient norm to this value (0: off).
        loss_scaler: fp16 dynamic loss scaling; None for fp32/bf16.
        gradient_accumulation_steps: ``backward`` divides the loss by this; call ``step`` once per window.
        unit_policy: ``policy(name, module) -> bool`` choosing units in code (overrides ``config.unit_modules``).
        device: where shards live; required when ``module`` was built on the meta device (sharded initialisation).
        param_init_fn: initialises one module's own parameters for a meta-device model (default: the values
            recorded by ``deferred_init()`` when the model was built under it, else its ``reset_parameters()``).
    """

    def __init__(
        self,
        module: nn.Module,
        init_optimizer: torch.optim.Optimizer,
        *,
        config: ZeroConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        gradient_clipping: float = 0.0,
        loss_scaler: LossScalerConfig | None = None,
        gradient_accumulation_steps: int = 1,
        unit_policy: UnitPolicy | None = None,
        device: torch.device | None = None,
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        if gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0 (0 disables it), got {gradient_clipping}")
        if gradient_accumulation_steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}")
        self.module = module
        self.optimizer = init_optimizer
        self.state = ZeroState(
            module, config or ZeroConfig(), process_group, unit_policy, device=device, param_init_fn=param_init_fn
        )
        self.optimizer = attach_optimizer(self.state, init_optimizer)
        self.gradient_clipping = gradient_clipping
        self.scaler = DynamicLossScaler(loss_scaler) if loss_scaler is not None else None
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._global_grad_norm: float | None = None
        self._micro_steps = 0
        self.skipped_steps = 0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def forward_pass(self) -> contextlib.AbstractContextManager[None]:
        """Optional bracket for code that runs the model through methods other than ``forward``."""
        return self.state.forward_pass()

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * loss_scale / gradient_accumulation_steps).backward()``; gradients land in the shards.

        Args:
            loss: the micro-batch loss (a scalar tensor).
            retain_graph: passed on to ``Tensor.backward``, as DeepSpeed's ``backward(loss, retain_graph=False)``
                does, so the graph can be walked again (a second backward through the same forward).
        """
        self._micro_steps += 1
        # Stage 1 reduces once per accumulation window: see ZeroConfig.stage.
        boundary = self._micro_steps % self.gradient_accumulation_steps == 0
        self.state.gradient_sync = self.state.config.stage != 1 or boundary
        if isinstance(self.optimizer, OffloadedAdam):  # the update may run in this backward when nothing comes between
            self.optimizer.step_in_next_backward(boundary and self.scaler is None and self.gradient_clipping == 0)
        scaled = loss * (self.loss_scale / self.gradient_accumulation_steps)
        self.state.expect_backward(scaled)
        scaled.backward(retain_graph=retain_graph)

    def step(self, closure: Callable[[], Any] | None = None) -> bool:
        """Unscales (fp16), skips on overflow, clips, steps and zeroes gradients. Returns False when skipped."""
        if closure is not None:
            closure()
        self._micro_steps = 0
        pieces = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            found_inf = unscale_and_check_(self.state, pieces, 1.0 / self.scaler.scale)
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped_steps += 1
                self._global_grad_norm = math.inf
                self.zero_grad()
                return False
        if self.gradient_clipping > 0:
            self._global_grad_norm = float(clip_grad_norm_(self.state, pieces, self.gradient_clipping))
        else:
            self._global_grad_norm = float(global_grad_norm(self.state, pieces))
        self.optimizer.step()
        self.zero_grad()
        return True

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_global_grad_norm(self) -> float | None:
        """The unscaled global gradient norm of the last step (inf when it was skipped for overflow)."""
        return self._global_grad_norm

    def state_dict(self) -> dict[str, Any]:
        """Full optimizer state (single-process layout) plus the loss scaler. Collective."""
        sd = full_optim_state_dict(self.state, self.optimizer)
        return {"optimizer": sd, "loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        load_full_optim_state_dict(self.state, self.optimizer, sd["optimizer"])
        if self.scaler is not None and sd.get("loss_scaler"):
            self.scaler.load_state_dict(sd["loss_scaler"])

    def module_state_dict(self) -> dict[str, Any]:
        """Full model state dict (fp32 masters). Collective."""
        return full_state_dict(self.state)

    def load_module_state_dict(self, sd: dict[str, Any], strict: bool = True) -> None:
        load_full_state_dict(self.state, sd, strict=strict)

    def memory_report(self) -> MemoryReport:
        return memory_report(self.state, [self.optimizer])

    def unshard_module(self) -> nn.Module:
        """Restores the plain module on every rank (collective) and returns it; with optimizer offload the user's
        optimizer gets its state back in memory (``self.optimizer`` becomes it) and the swap files are removed."""
        if isinstance(self.optimizer, OffloadedAdam):
            self.optimizer = self.optimizer.export_to_inner()
        unshard_module(self.state, [self.optimizer])
        return self.module

    def close(self) -> None:
        """Removes this rank's swap files without restoring the module (after a failure); idempotent."""
        self.state.close_offload()
