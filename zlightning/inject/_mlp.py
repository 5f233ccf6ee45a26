"""Fused MLP kernel injection: ``Linear -> act -> Linear`` and gated ``down(act(gate(x)) * up(x))`` MLPs.

[Note: what the fused MLP fuses]
`FusedMLP` runs the whole MLP as one autograd Function (`_FusedMLPFn`) built on fused ATen ops:
(1) a gated MLP's gate and up projections are one GEMM over the concatenated weights (``[gate; up]``, one
``addmm`` with the bias folded in, and one GEMM for both weight gradients in backward); (2) every projection is an
``addmm`` with the bias as its epilogue; (3) only the input and the pre-activation are saved for backward: the
activation (and the gated product) is recomputed from the pre-activation with the ATen backward kernels
(``gelu_backward``/``silu_backward``/``threshold_backward``), so autograd keeps 1 hidden-sized tensor per token
instead of 2 (plain) or 4 (gated). Parameters stay in the original ``nn.Linear`` children under their original names
(state dicts, optimizers, ZeRO units and the TP plan see no change).

Tensor parallelism composes: when the children are a `ColumnParallelLinear` (up/gate) and a `RowParallelLinear`
(down) the Function runs on the local shards between ``copy_to_tp`` and ``reduce_from_tp``, and the replicated down
bias is added once after the reduce. Any other combination (a replicated or user-planned layer, hidden dropout while
training) runs the children one by one, which is always correct. The fused path reads its children's parameters in
its own forward; when they are not materialised there (ZeRO-3 units finer than the MLP, e.g. ``unit_modules=
("Linear",)``, leave 1-D shard pieces until each Linear's own forward gathers them) it also runs the children.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zlightning.inject._collectives import copy_to_tp, reduce_from_tp
from zlightning.inject._layers import ColumnParallelLinear, RowParallelLinear, probe_equal, probe_equal_training

__all__ = ["Activation", "FusedMLP", "fused_mlp_for"]

Activation = Literal["gelu", "gelu_tanh", "silu", "relu"]
_ACT_MODULES: dict[type[nn.Module], Activation] = {nn.SiLU: "silu", nn.ReLU: "relu"}


class _LinearLike(Protocol):
    """What the fused path reads of a child linear (`nn.Linear`, `ColumnParallelLinear`, `RowParallelLinear`)."""

    @property
    def weight(self) -> Tensor: ...
    @property
    def bias(self) -> Tensor | None: ...


def activation_of(module: nn.Module) -> Activation | None:
    """The `Activation` an activation module computes, or None for anything else."""
    if isinstance(module, nn.GELU):
        return "gelu_tanh" if module.approximate == "tanh" else "gelu"
    return _ACT_MODULES.get(type(module))


def _act(h: Tensor, act: Activation) -> Tensor:
    if act == "silu":
        return F.silu(h)
    if act == "relu":
        return F.relu(h)
    return F.gelu(h, approximate="tanh" if act == "gelu_tanh" else "none")


def _act_backward(grad: Tensor, h: Tensor, act: Activation) -> Tensor:
    if act == "silu":
        return torch.ops.aten.silu_backward(grad, h)
    if act == "relu":
        return torch.ops.aten.threshold_backward(grad, h, 0)
    return torch.ops.aten.gelu_backward(grad, h, approximate="tanh" if act == "gelu_tanh" else "none")


def _linear2d(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    return torch.addmm(b, x2, w.t()) if b is not None else x2 @ w.t()


class _FusedMLPFn(torch.autograd.Function):
    """``y = act(x W1^T + b1) [* (x W3^T + b3)] W2^T + b2``; see [Note: what the fused MLP fuses]."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        act: Activation,
        recompute: bool,
        w1: Tensor,
        b1: Tensor | None,
        w3: Tensor | None,
        b3: Tensor | None,
        w2: Tensor,
        b2: Tensor | None,
    ) -> Tensor:
        gated, hidden = w3 is not None, w1.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        if w3 is not None:  # gated
            w13 = torch.cat([w1, w3])
            b13 = (
                None
                if b1 is None and b3 is None
                else torch.cat([b if b is not None else w1.new_zeros(hidden) for b in (b1, b3)])
            )
            pre = _linear2d(x2, w13, b13)  # [N, 2h]: gate | up
            g, u = pre.split(hidden, dim=-1)
            p = _act(g, act) * u
        else:
            w13, pre = w1, _linear2d(x2, w1, b1)
            p = _act(pre, act)
        y = _linear2d(p, w2, b2)
        ctx.save_for_backward(x2, pre, w13, w2, *(() if recompute else (p,)))
        ctx.act, ctx.gated, ctx.hidden, ctx.x_shape = act, gated, hidden, x.shape
        ctx.has_b1, ctx.has_b3, ctx.has_b2 = b1 is not None, b3 is not None, b2 is not None
        return y.view(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x2, pre, w13, w2, *kept = ctx.saved_tensors
        gy2 = gy.reshape(-1, gy.shape[-1])
        if ctx.gated:
            g, u = pre.split(ctx.hidden, dim=-1)
            s = _act(g, ctx.act)
            p = kept[0] if kept else s * u
            gp = gy2 @ w2
            gpre = torch.empty_like(pre)
            gpre[:, : ctx.hidden] = _act_backward(gp * u, g, ctx.act)
            torch.mul(gp, s, out=gpre[:, ctx.hidden :])
        else:
            p = kept[0] if kept else _act(pre, ctx.act)
            gpre = _act_backward(gy2 @ w2, pre, ctx.act)
        need = ctx.needs_input_grad  # (x, act, recompute, w1, b1, w3, b3, w2, b2): frozen parts cost nothing
        gw2 = gy2.t() @ p if need[7] else None
        gb2 = gy2.sum(0) if ctx.has_b2 and need[8] else None
        gw13 = gpre.t() @ x2 if need[3] or need[5] else None
        gb13 = gpre.sum(0) if need[4] or need[6] else None
        gx = (gpre @ w13).view(ctx.x_shape) if need[0] else None
        h = ctx.hidden
        if gw13 is None:
            return gx, None, None, None, None, None, None, gw2, gb2
        if ctx.gated:
            return (
                gx,
                None,
                None,
                gw13[:h],
                gb13[:h] if gb13 is not None and ctx.has_b1 else None,
                gw13[h:],
                gb13[h:] if gb13 is not None and ctx.has_b3 else None,
                gw2,
                gb2,
            )
        return gx, None, None, gw13, gb13 if ctx.has_b1 else None, None, None, gw2, gb2


class FusedMLP(nn.Module):
    """An MLP rebuilt on `_FusedMLPFn`, keeping the original projections (and dropouts) as children.

    Args:
        up: name of the input projection (the "up" half of a gated MLP).
        down: name of the output projection.
        gate: name of the gate projection of a gated MLP (``down(act(gate(x)) * up(x))``), or None.
        act: the activation.
        modules: the children by name (projections, dropouts).
        hidden_drop: name of the dropout applied to the hidden activation, or None.
        out_drop: name of the dropout applied to the output, or None.
        recompute: save only the pre-activation and recompute the activation in backward (less memory); False
            also saves the activation output (the hidden tensor the down projection reads), trading memory for time.
    """

    def __init__(
        self,
        *,
        up: str,
        down: str,
        gate: str | None,
        act: Activation,
        modules: dict[str, nn.Module],
        hidden_drop: str | None = None,
        out_drop: str | None = None,
        recompute: bool = True,
    ) -> None:
        super().__init__()
        self.up_name, self.down_name, self.gate_name, self.act = up, down, gate, act
        self.recompute = recompute
        self.hidden_drop, self.out_drop = hidden_drop, out_drop
        for name, module in modules.items():
            self.add_module(name, module)

    def _fusable(self) -> tuple[_LinearLike, _LinearLike, _LinearLike | None, Any] | None:
        """(first, down, up-of-gated, TP group or None) when the fused path applies, else None."""
        up, down = getattr(self, self.up_name), getattr(self, self.down_name)
        gate = getattr(self, self.gate_name) if self.gate_name else None
        first, third = (gate, up) if gate is not None else (up, None)
        ins = [m for m in (first, third) if m is not None]
        if any(m.weight.shape != (m.out_features, m.in_features) for m in (*ins, down)):
            return None  # parameters not materialised here (e.g. ZeRO-3 units finer than the MLP): call the children
        if all(type(m) is nn.Linear for m in (*ins, down)):
            return first, down, third, None
        cols = all(isinstance(m, ColumnParallelLinear) and m.chunks == 1 and not m.gather_output for m in ins)
        if cols and isinstance(down, RowParallelLinear) and down.input_is_parallel and down.group is first.group:
            return first, down, third, first.group
        return None

    def _unfused(self, x: Tensor) -> Tensor:
        up = getattr(self, self.up_name)
        h = _act(getattr(self, self.gate_name)(x), self.act) * up(x) if self.gate_name else _act(up(x), self.act)
        if self.hidden_drop:
            h = getattr(self, self.hidden_drop)(h)
        return getattr(self, self.down_name)(h)

    def forward(self, x_BTD: Tensor) -> Tensor:
        parts = self._fusable()
        hidden_dropout = self.hidden_drop is not None and self.training and getattr(self, self.hidden_drop).p > 0
        if parts is None or hidden_dropout:
            y = self._unfused(x_BTD)
        else:
            y = self._fused(x_BTD, *parts)
        return getattr(self, self.out_drop)(y) if self.out_drop else y

    def _fused(self, x: Tensor, first: _LinearLike, down: _LinearLike, third: _LinearLike | None, group: Any) -> Tensor:
        weights = [
            first.weight,
            first.bias,
            third.weight if third is not None else None,
            third.bias if third is not None else None,
            down.weight,
            down.bias if group is None else None,
        ]
        device = x.device.type
        if torch.is_autocast_enabled(device):  # autocast does not reach inside a Function: cast like F.linear would
            dtype = torch.get_autocast_dtype(device)
            x = x.to(dtype)
            weights = [w.to(dtype) if w is not None else None for w in weights]
        if group is not None:
            x = copy_to_tp(x, group)
        with torch.autocast(device, enabled=False):
            y = _FusedMLPFn.apply(x, self.act, self.recompute, *weights)
        if group is not None:
            y = reduce_from_tp(y, group)
            y = y if down.bias is None else y + down.bias
        return y

    def extra_repr(self) -> str:
        kind = f"gated(gate={self.gate_name}, up={self.up_name})" if self.gate_name else f"up={self.up_name}"
        return f"{kind}, down={self.down_name}, act={self.act}, recompute={self.recompute}"


_GATE_NAMES = ("gate_proj", "gate", "w1", "wg", "fc_gate")
_UP_NAMES = ("up_proj", "up", "w3", "wu", "fc_up")
_ALL_ACTS: tuple[Activation, ...] = ("gelu", "silu", "gelu_tanh", "relu")


def _stateless_leaf(module: nn.Module) -> bool:
    """No children, parameters or buffers: possibly an activation, identified by the probe (`_agrees`)."""
    return not any(True for _ in module.children()) and not module._parameters and not module._buffers


def _candidates(module: nn.Module, recompute: bool) -> list[FusedMLP]:
    """Every structural reading of ``module`` as an MLP (to be verified on a probe); empty if it is not one."""
    children = dict(module.named_children())
    linears = {n: c for n, c in children.items() if type(c) is nn.Linear}
    acts = {n: activation_of(c) for n, c in children.items() if activation_of(c) is not None}
    drops = [n for n, c in children.items() if isinstance(c, nn.Dropout)]
    if not acts:  # an activation module of another library (transformers' SiLUActivation): read by the probe
        acts = {n: None for n, c in children.items() if _stateless_leaf(c) and n not in linears and n not in drops}
    if len(children) != len(linears) + len(acts) + len(drops) or len(acts) > 1 or len(drops) > 1:
        return []  # something else lives here (a norm, an attention, a nested block)
    order = list(children)
    found = next(iter(acts.values()), None)
    act_choices: tuple[Activation, ...] = (found,) if found is not None else _ALL_ACTS
    shapes = [(n, lin.in_features, lin.out_features) for n, lin in linears.items()]
    readings: list[tuple[str, str, str | None]] = []  # (up, down, gate)
    if len(shapes) == 2:
        (a, ai, ao), (b, bi, bo) = shapes
        readings = [(u, d, None) for u, d, ok in ((a, b, ao == bi), (b, a, bo == ai)) if ok]
    elif len(shapes) == 3:
        for down, di, do in shapes:
            ins = [(n, i, o) for n, i, o in shapes if n != down]
            if all(o == di for _, _, o in ins) and ins[0][1] == ins[1][1]:
                x, y = ins[0][0], ins[1][0]
                named = [(u, g) for u, g in ((y, x), (x, y)) if g in _GATE_NAMES or u in _UP_NAMES]
                readings += [(u, down, g) for u, g in (named or [(y, x), (x, y)])]
    out = []
    for up, down, gate in readings:
        hidden_drop = out_drop = None
        if drops:
            before_down = order.index(drops[0]) < order.index(down)
            hidden_drop, out_drop = (drops[0], None) if before_down else (None, drops[0])
        wanted = {up, down, gate, hidden_drop, out_drop}
        mods = {n: children[n] for n in order if n in wanted}  # original order: same state-dict key order
        out += [
            FusedMLP(
                up=up,
                down=down,
                gate=gate,
                act=a,
                modules=mods,
                hidden_drop=hidden_drop,
                out_drop=out_drop,
                recompute=recompute,
            )
            for a in act_choices
        ]
    return out


def _agrees(original: nn.Module, candidate: nn.Module, example: Tensor, atol: float) -> bool:
    """Same output in eval mode and in training mode under the same random stream (see [Note: probing in training
    mode] in ``_layers.py``: a functional dropout the candidate does not reproduce makes them differ)."""
    return probe_equal(original, candidate, example, atol) and probe_equal_training(original, candidate, example, atol)


def fused_mlp_for(
    module: nn.Module, probe: Callable[[int], Tensor], atol: float, recompute: bool = True
) -> FusedMLP | None:
    """A `FusedMLP` equal to ``module`` (verified on ``probe(input_width)``), or None when it is not an MLP."""
    for cand in _candidates(module, recompute):
        if _agrees(module, cand, probe(getattr(cand, cand.up_name).in_features), atol):
            return cand
    return None
