"""`CPUAdam`: Adam/AdamW on CPU tensors in one fused, vectorised pass (DeepSpeedCPUAdam's constructor).

[Note: one pass, 28 bytes per parameter]
An Adam step on fp32 state reads param, grad, exp_avg, exp_avg_sq (16 bytes per parameter) and writes param,
exp_avg, exp_avg_sq (12 bytes): it is bound by memory bandwidth, not arithmetic. The native kernel
(``csrc/adam_isa.cpp``) touches each byte once, in cache-sized chunks spread over torch's OpenMP threads; writing a
bf16/fp16 copy of the updated parameter (what an offloaded step sends to the GPU) costs 2 more bytes in the same pass
instead of a second pass reading 4 and writing 2 (plus 2 read for ownership of the written lines): on AVX-512 large
copies go out with streaming stores, see [Note: the low-precision copy folded into the step's memory traffic]. The arithmetic follows ``torch.optim.AdamW``'s single-tensor
code operation by operation (no FMA contraction), so results agree with it to within an ulp per step.

[Note: bf16 parameters keep an fp32 master]
For bf16/fp16 parameters the fp32 master copy lives in the optimizer state (``state["master"]``) beside exp_avg and
exp_avg_sq; the step updates the master and rounds it (nearest-even) into the parameter in the same pass. With
``fp32_optimizer_states=False`` (DeepSpeed's knob) the moments are kept in the parameter's dtype and no master is
kept; that path runs the PyTorch reference.

[Note: loading state dicts]
``torch.optim.Optimizer.load_state_dict`` casts every floating-point state tensor to its parameter's dtype: for a
bf16 parameter that rounded the fp32 master and moments to bf16 (and took the step off the fused kernel).
`CPUAdam.load_state_dict` keeps the saved fp32 values, makes a master from the parameter when the state dict has
none (one saved by ``torch.optim.AdamW``), and reads torch's group keys, so a ``torch.optim.AdamW``/``Adam`` state
dict loads into `CPUAdam` and `CPUAdam`'s loads into them (``state_dict`` also writes ``decoupled_weight_decay``,
``amsgrad`` and ``maximize``, which torch's ``Adam`` reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from zlightning.kernels import _ext

__all__ = ["CPUAdam", "adam_step_reference"]

_LOW = (torch.bfloat16, torch.float16)


def adam_step_reference(
    master: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    copy: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    bias_correction: bool,
    adamw_mode: bool,
) -> None:
    """The pure-PyTorch Adam/AdamW step (same operations as ``torch.optim.AdamW``'s single-tensor path), in place.

    ``master``, ``exp_avg``, ``exp_avg_sq`` are updated; ``copy`` (if given) receives the updated ``master`` in its
    own dtype. Used as fallback and as the reference in tests.
    """
    g = grad.to(exp_avg.dtype)
    if weight_decay != 0:
        if adamw_mode:
            master.mul_(1 - lr * weight_decay)
        else:
            g = g.add(master.to(g.dtype), alpha=weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
    if master.dtype == exp_avg.dtype:
        master.addcdiv_(exp_avg, denom, value=-(lr / bc1))
    else:
        master.copy_(master.float().addcdiv_(exp_avg.float(), denom.float(), value=-(lr / bc1)))
    if copy is not None:
        copy.copy_(master)


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW for CPU parameters (fp32, bf16 or fp16), DeepSpeedCPUAdam's drop-in.

    Uses the compiled kernel (``zlightning::adam_step_``) when built, else the PyTorch reference (with one
    warning). See [Note: one pass, 28 bytes per parameter] and [Note: bf16 parameters keep an fp32 master].

    Args:
        model_params: parameters or parameter groups, as for any ``torch.optim.Optimizer``.
        lr: learning rate.
        bias_correction: apply Adam's bias correction.
        betas: (beta1, beta2) in [0, 1).
        eps: added to the denominator.
        weight_decay: decoupled (AdamW) when ``adamw_mode``, else L2 added to the gradient (Adam).
        amsgrad: not supported: ``True`` raises ``ValueError`` (also in a parameter group or a loaded state dict).
        adamw_mode: AdamW (True, default) or Adam with L2 (False).
        fp32_optimizer_states: keep exp_avg/exp_avg_sq (and a master copy) in fp32 for low-precision params.
        maximize: maximize the objective (torch's flag): steps along the gradient.

    Raises:
        ValueError: amsgrad, a hyper-parameter out of range, or a parameter that is not a CPU float tensor.
    """

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        maximize: bool = False,
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            amsgrad=amsgrad,
            maximize=maximize,
        )
        _check_group(defaults, "CPUAdam")
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(model_params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a parameter group (missing hyper-parameters take the constructor's values).

        Raises:
            ValueError: ``amsgrad=True``, a hyper-parameter out of range, or a parameter that is not a CPU
                float32/bfloat16/float16 tensor.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group, f"CPUAdam param group {len(self.param_groups) - 1}")
            for p in group["params"]:
                self._check_param(p)
        except ValueError:
            self.param_groups.pop()
            raise

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict saved by `CPUAdam`, ``torch.optim.AdamW`` or ``torch.optim.Adam``.

        See [Note: loading state dicts]: fp32 moments and masters stay fp32 (torch would cast them to the parameter's
        dtype), a missing master is made from the parameter, and torch's group keys map to ours
        (``decoupled_weight_decay`` -> ``adamw_mode``; a missing ``bias_correction`` is True, as in torch).

        Raises:
            ValueError: a group with ``amsgrad=True`` (its ``max_exp_avg_sq`` cannot be used) or invalid values.
        """
        for i, g in enumerate(state_dict["param_groups"]):  # before anything changes
            _check_group({**self.defaults, **g}, f"CPUAdam.load_state_dict: param group {i}")
        saved = dict(state_dict["state"])  # before torch casts floating-point state to each parameter's dtype
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "adamw_mode" not in group:
                group["adamw_mode"] = bool(group.get("decoupled_weight_decay", self.defaults["adamw_mode"]))
            group.setdefault("bias_correction", True)
            for key, value in self.defaults.items():
                group.setdefault(key, value)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            if self.state.get(p):
                self._restore_state(p, self.state[p], saved.get(pid, {}))

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, plus ``decoupled_weight_decay`` (= ``adamw_mode``) per group for ``torch.optim.Adam``."""
        sd = super().state_dict()
        for group in sd["param_groups"]:
            group["decoupled_weight_decay"] = bool(group["adamw_mode"])
        return sd

    def _restore_state(self, p: torch.Tensor, state: dict[str, Any], saved: dict[str, Any]) -> None:
        low = p.dtype in _LOW
        fp32 = self.fp32_optimizer_states or not low
        sdtype = torch.float32 if fp32 else p.dtype
        state["step"] = int(saved.get("step", state.get("step", 0)))
        for key in ("exp_avg", "exp_avg_sq"):
            value = saved.get(key, state.get(key))
            if value is None:
                raise ValueError(f"CPUAdam.load_state_dict: the state of a {tuple(p.shape)} parameter has no {key}.")
            state[key] = value.to(device="cpu", dtype=sdtype).contiguous()
        if low and self.fp32_optimizer_states:
            master = saved.get("master")
            state["master"] = (p.detach() if master is None else master).to(device="cpu", dtype=torch.float32)
        else:
            state.pop("master", None)
        state.pop("max_exp_avg_sq", None)

    @staticmethod
    def _check_param(p: torch.Tensor) -> None:
        if p.device.type != "cpu":
            raise ValueError(
                f"CPUAdam updates CPU tensors; got a parameter on {p.device}. Offload it (ZeRO "
                "offload_optimizer) or use torch.optim.AdamW(fused=True) on the GPU."
            )
        if p.dtype not in (torch.float32, *_LOW):
            raise ValueError(f"CPUAdam: parameter dtype {p.dtype} unsupported (float32, bfloat16, float16).")

    @property
    def uses_native_kernel(self) -> bool:
        """True when steps run the compiled kernel."""
        return _ext.available()

    @torch.no_grad()
    def step(  # type: ignore[override]  # DeepSpeedCPUAdam's signature (fp16_param_groups)
        self,
        closure: Callable[[], float] | None = None,
        fp16_param_groups: list[torch.Tensor] | list[list[torch.Tensor]] | None = None,
    ) -> float | None:
        """One update of every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (run with grad enabled).
            fp16_param_groups: DeepSpeed's argument: per parameter group, a list of bf16/fp16 tensors (or one flat
                list for a single group) shaped like the parameters; each receives the updated parameter in its
                dtype, written in the same pass as the update.

        Returns:
            the closure's loss, if a closure was given.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        copies = self._copy_targets(fp16_param_groups)
        native = _ext.available()
        if not native:
            _ext.warn_fallback("CPUAdam")
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self._update(p, group, copies[gi][pi] if copies else None, native)
        return loss

    def _copy_targets(self, groups: list | None) -> list[list[torch.Tensor]] | None:
        if groups is None:
            return None
        if groups and isinstance(groups[0], torch.Tensor):
            groups = [groups]
        if len(groups) != len(self.param_groups) or any(
            len(c) != len(g["params"]) for c, g in zip(groups, self.param_groups)
        ):
            raise ValueError(
                "CPUAdam.step(fp16_param_groups=...): need one tensor per parameter, grouped like "
                f"param_groups (sizes {[len(g['params']) for g in self.param_groups]})."
            )
        for c, g in zip(groups, self.param_groups):
            for t, p in zip(c, g["params"]):
                if t.numel() != p.numel() or t.dtype not in _LOW:
                    raise ValueError(
                        f"CPUAdam.step: fp16_param_groups tensor {tuple(t.shape)} {t.dtype} does not "
                        f"match parameter {tuple(p.shape)} or is not bfloat16/float16."
                    )
        return groups

    def _state_for(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            low = p.dtype in _LOW
            sdtype = torch.float32 if (self.fp32_optimizer_states or not low) else p.dtype
            state["step"] = 0
            state["exp_avg"] = torch.zeros(p.shape, dtype=sdtype)
            state["exp_avg_sq"] = torch.zeros(p.shape, dtype=sdtype)
            if low and self.fp32_optimizer_states:
                state["master"] = p.detach().float()
        return state

    def _update(self, p: torch.Tensor, group: dict[str, Any], copy: Any, native: bool) -> None:
        """One parameter's step; ``copy``: None, a tensor to round the result into, or `_TwoCopies`."""
        state = self._state_for(p)
        state["step"] += 1
        master = state.get("master", p)
        if copy is None and master is not p:
            copy = p  # bf16/fp16 param: rounded from the fp32 master in the same pass
        elif copy is not None and master is not p:
            copy = _TwoCopies(p, copy)
        beta1, beta2 = group["betas"]
        kw = dict(
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=state["step"],
            bias_correction=group["bias_correction"],
            adamw_mode=group["adamw_mode"],
        )
        grad = p.grad
        if grad is None:  # step() skips parameters without a gradient
            raise AssertionError(f"{tuple(p.shape)=}")
        if grad.is_sparse:
            raise RuntimeError(
                f"CPUAdam does not support sparse gradients (a {tuple(p.shape)} parameter has one); use "
                "torch.optim.SparseAdam for embeddings with sparse=True."
            )
        if group.get("maximize", False):
            grad = -grad
        fast = (
            native
            and master.dtype == torch.float32
            and state["exp_avg"].dtype == torch.float32
            and master.is_contiguous()
            and state["exp_avg"].is_contiguous()
            and state["exp_avg_sq"].is_contiguous()
            and not isinstance(copy, _TwoCopies)
            and (copy is None or copy.is_contiguous())
        )
        if fast:
            if grad.dtype not in (torch.float32, torch.bfloat16) or not grad.is_contiguous():
                grad = grad.float().contiguous()
            torch.ops.zlightning.adam_step_(
                master,
                grad,
                state["exp_avg"],
                state["exp_avg_sq"],
                copy,
                kw["lr"],
                beta1,
                beta2,
                kw["eps"],
                kw["weight_decay"],
                kw["step"],
                kw["bias_correction"],
                kw["adamw_mode"],
            )
            return
        target = copy.first if isinstance(copy, _TwoCopies) else copy
        adam_step_reference(master, grad, state["exp_avg"], state["exp_avg_sq"], target, **kw)
        if isinstance(copy, _TwoCopies):
            copy.second.copy_(master)


def _check_group(group: dict[str, Any], where: str) -> None:
    """Validates one parameter group's hyper-parameters (the constructor's defaults, an added or a loaded group)."""
    if group.get("amsgrad", False):
        raise ValueError(
            f"{where}: amsgrad=True: AMSGrad is not supported (as in DeepSpeedCPUAdam). Use "
            "torch.optim.AdamW(amsgrad=True) if you need it."
        )
    lr, eps, betas, wd = group["lr"], group["eps"], group["betas"], group["weight_decay"]
    if not lr >= 0.0:
        raise ValueError(f"{where}: lr={lr!r} must be >= 0.")
    if not eps >= 0.0:
        raise ValueError(f"{where}: eps={eps!r} must be >= 0.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas={betas!r} must be two values in [0, 1).")
    if not wd >= 0.0:
        raise ValueError(f"{where}: weight_decay={wd!r} must be >= 0.")


class _TwoCopies:
    """A low-precision param that also has an fp16_param_groups target (rare): both get the master."""

    def __init__(self, first: torch.Tensor, second: torch.Tensor) -> None:
        self.first, self.second = first, second
