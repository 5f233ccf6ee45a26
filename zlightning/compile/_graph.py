"""Graph mode: the whole ZeRO-3 forward and backward as compiled graphs, with the collectives as graph ops.

[Note: ZeRO-3 collectives as graph ops]
Per-unit mode leaves gathering to the engine's module hooks, which run eagerly between compiled unit graphs. Graph
mode removes those hooks (``ZeroState.suspend_module_hooks``) and compiles one function over the model's forward
(`graph_target`: the root, or the one child holding every parameter -- a LightningModule's model) that
takes the shard pieces (the optimizer's parameters) as inputs and, per communication group, builds the group's flat
shard, all-gathers it and cuts the full parameters out of the result as views, which it binds into the module with
``_reparametrize_module`` for the traced forward. The all-gather is ``_c10d_functional.all_gather_into_tensor``
followed by ``wait_tensor``: PyTorch's own functional collective ops, registered with fake kernels and understood by
Dynamo, AOT autograd and Inductor (asynchronous start + wait, so compute placed between the two overlaps). So the
Dynamo graph holds every gather as a node and the engine's hooks cannot cause graph breaks. The gather is an
``autograd.Function`` (`_GatherGroup`) whose backward reduce-scatters the full gradient (``reduce_scatter_tensor``),
averages it over ranks and splits it into the pieces' gradients; autograd then accumulates into ``piece.grad``,
exactly what the eager engine's ``_UnshardFn`` produces. Nothing else of the engine runs during the step.

Release: a compiled graph frees a buffer after its last use, so "release after last use" is where the data flow puts
it -- *provided* the full parameters are not saved for the backward. AOT autograd would save them (that is ZeRO-2,
not ZeRO-3), so `RecomputeGathers` tags every forward all-gather and wait on the joint graph ``MUST_RECOMPUTE``
before partitioning: the backward graph then re-gathers each unit right before its gradient computation and frees
it after, the ZeRO-3 schedule. Groups the budget keeps (`selective_unshard`) and the root/persistent groups (which the
eager engine also holds for the whole step) are tagged ``MUST_SAVE`` instead.

Placement passes on the partitioned forward and backward graphs (`place_gathers`, `prefetch_gathers`):
``place_gathers`` sinks each all-gather, its wait and the parameter views to just before their first use (Dynamo
puts all gathers at the top, which would gather the whole model at once); ``prefetch_gathers`` then starts each
gather ``prefetch_depth`` units early -- right after the wait of the gather ``prefetch_depth`` positions before it
-- so a unit's all-gather overlaps the previous unit's compute while at most ``prefetch_depth + 1`` units are gathered.
``defer_reduce_waits`` (with ``late_wait``) lets a gradient reduce-scatter run until the next one is issued.

Why PyTorch's functional collectives rather than new ``zlightning::`` custom ops: they already carry fake kernels,
the async start/wait split, autograd formulas and Inductor lowerings (extern kernels with correct buffer lifetimes),
and AOT's partitioner knows them (it refuses to recompute collectives unless tagged, which is exactly the switch the
budget needs). A custom op would have to re-implement all of that to end up with the same graph nodes.

Differences from the eager engine (documented limits): a parameter that gets no gradient gets a zero gradient (the
graph cannot see which slices of a group's flat gradient were touched), and ``gradient_sync=False`` accumulation still
reduce-scatters every micro-batch (same values, more traffic). Offload and tensor parallelism use per-unit mode.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed import _functional_collectives as funcol
from torch.utils.checkpoint import CheckpointPolicy

from zlightning.compile._config import CompileConfig
from zlightning.compile._passes import late_wait

__all__ = [
    "GraphStats",
    "GroupSpec",
    "RecomputeGathers",
    "ZeroGraphForward",
    "defer_reduce_waits",
    "group_specs",
    "make_graph_backend",
    "ordered_groups",
    "place_gathers",
    "prefetch_gathers",
    "saved_gather_bytes",
]

_C10D = torch.ops._c10d_functional
_AG = _C10D.all_gather_into_tensor.default
_WAIT = _C10D.wait_tensor.default
_RS = _C10D.reduce_scatter_tensor.default
_A = torch.ops.aten
_VIEWS = {
    _A.view.default,
    _A._unsafe_view.default,
    _A.slice.Tensor,
    _A.t.default,
    _A.permute.default,
    _A.transpose.int,
    _A.alias.default,
    _A.as_strided.default,
    _A.expand.default,
    _A.reshape.default,
    _A.unsqueeze.default,
    _A.squeeze.dim,
    _A.squeeze.default,
    _A.select.int,
    _A.narrow.default,
}


@dataclass(frozen=True)
class GroupSpec:
    """What the compiled step needs to gather one ZeRO-3 communication group (plain values, constant per rank)."""

    index: int
    kind: str  # "unit" (gathered per use), "root" or "persistent" (held for the whole step, as the eager engine does)
    unit: str
    world: int
    group_name: str
    pad: int  # zeros appended to this rank's pieces to make the flat shard [S]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    master_dtype: torch.dtype
    unsharded_bytes: int
    views: tuple[tuple[int, int, tuple[int, ...], tuple[str, ...]], ...]  # (offset, numel, shape, fqns) per param


def ordered_groups(state: Any) -> list[Any]:
    """The engine's groups in gather order: root and persistent first (held all step), then units in model order."""
    held = {id(g) for g in state.units[0].groups} | {id(g) for g in state.persistent_groups}
    return [g for g in state.groups if id(g) in held] + [g for u in state.units[1:] for g in u.groups]


def group_specs(state: Any) -> list[GroupSpec]:
    """One spec per group of the engine, in gather order (root and persistent first, then units in model order)."""
    pg = state.process_group
    if pg is None:  # the default group, set once torch.distributed is initialised
        pg = cast("dist.ProcessGroup", dist.group.WORLD)
    name = pg.group_name
    root = {id(g) for g in state.units[0].groups}
    persistent = {id(g) for g in state.persistent_groups}
    unit_of = {id(g): u.name for u in state.units for g in u.groups}
    specs: list[GroupSpec] = []
    for g in ordered_groups(state):
        start = g.rank * g.shard_numel
        covered = max(min(g.numel, start + g.shard_numel), start) - start
        kind = "root" if id(g) in root else "persistent" if id(g) in persistent else "unit"
        specs.append(
            GroupSpec(
                index=len(specs),
                kind=kind,
                unit=unit_of.get(id(g), "<persistent>"),
                world=g.world,
                group_name=name,
                pad=g.shard_numel - covered,
                param_dtype=g.param_dtype,
                reduce_dtype=state.reduce_dtype,
                master_dtype=g.master_dtype,
                unsharded_bytes=g.unsharded_bytes,
                views=tuple((p.offset, p.numel, tuple(p.shape), tuple(p.fqns)) for p in g.params),
            )
        )
    return specs


def _gather(
    world: int, group_name: str, pad: int, param_dtype: torch.dtype, pieces: Sequence[torch.Tensor]
) -> torch.Tensor:
    """This rank's flat shard (pieces + zero padding, in the compute dtype), all-gathered into the full flat group."""
    parts = list(pieces) + ([pieces[0].new_zeros(pad)] if pad else [])
    shard = torch.cat(parts).to(param_dtype)
    return funcol.wait_tensor(_C10D.all_gather_into_tensor(shard, world, group_name))


class _GatherGroup(torch.autograd.Function):
    """Pieces -> full flat group (all-gather); backward: reduce-scatter, average, split back into piece gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        world: int,
        group_name: str,
        pad: int,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        *pieces: torch.Tensor,
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.sizes = [p.numel() for p in pieces]
        ctx.world, ctx.group_name, ctx.reduce_dtype = world, group_name, reduce_dtype
        ctx.master_dtype = pieces[0].dtype
        return _gather(world, group_name, pad, param_dtype, pieces)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        flat = grad.to(ctx.reduce_dtype).contiguous()
        reduced = funcol.wait_tensor(_C10D.reduce_scatter_tensor(flat, "sum", ctx.world, ctx.group_name))
        reduced = (reduced / ctx.world).to(ctx.master_dtype)
        return (None,) * 5 + tuple(torch.split(reduced[: sum(ctx.sizes)], ctx.sizes))


# ==================================================================================================== graph passes
def _gathers(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node | None]]:
    """(all-gather, its wait) pairs in graph order."""
    out = []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is _AG:
            waits = [u for u in n.users if u.target is _WAIT]
            out.append((n, waits[0] if waits else None))
    return out


def _chain(ag: fx.Node, wait: fx.Node | None) -> set[fx.Node]:
    """The gather, its wait and every pure view of the gathered tensor (what moves together)."""
    chain = {ag} | ({wait} if wait is not None else set())
    frontier = [wait] if wait is not None else []
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.op == "call_function" and u.target in _VIEWS and u not in chain:
                chain.add(u)
                frontier.append(u)
    return chain


def place_gathers(gm: fx.GraphModule, config: CompileConfig | None = None) -> int:
    """Sinks every all-gather, its wait and its views to just before their first use; returns nodes moved."""
    movable: set[fx.Node] = set()
    for ag, wait in _gathers(gm.graph):
        movable |= _chain(ag, wait)
    moved = 0
    nodes = list(gm.graph.nodes)
    for node in reversed(nodes):  # users first, so each node lands right before its (already placed) first user
        if node not in movable or not node.users:
            continue
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = min(node.users, key=order.__getitem__)
        if order[first] > order[node] + 1:
            first.prepend(node)
            moved += 1
    return moved


def _hoist_after(gm: fx.GraphModule, node: fx.Node, anchor: fx.Node) -> fx.Node:
    """Moves ``node`` (and any of its inputs that come later) right after ``anchor``; returns the new anchor."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for dep in node.all_input_nodes:
        if order[dep] > order[anchor] and dep.op != "placeholder":
            anchor = _hoist_after(gm, dep, anchor)
    anchor.append(node)
    return node


def prefetch_gathers(gm: fx.GraphModule, config: CompileConfig) -> int:
    """Issues each all-gather right after the wait of the gather ``prefetch_depth`` places before it."""
    depth = config.prefetch_depth
    moved = 0
    pairs = _gathers(gm.graph)
    for i in range(depth, len(pairs)):
        ag = pairs[i][0]
        anchor = pairs[i - depth][1] or pairs[i - depth][0]
        order = {n: k for k, n in enumerate(gm.graph.nodes)}
        if order[anchor] < order[ag] - 1:
            _hoist_after(gm, ag, anchor)
            moved += 1
    return moved


def defer_reduce_waits(gm: fx.GraphModule, config: CompileConfig | None = None, max_nodes: int = 64) -> int:
    """Backward graphs: waits for each gradient reduce-scatter after the *next* one is issued (the last before the
    output), moving the small chain that turns the result into piece gradients along, so a reduce-scatter overlaps
    the next unit's backward compute while at most two are in flight. Returns waits moved."""
    rs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _RS]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    moved = 0
    for k, node in enumerate(rs):
        waits = [u for u in node.users if u.target is _WAIT]
        if len(waits) != 1:
            continue
        anchor = rs[k + 1] if k + 1 < len(rs) else output.prev
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if order[anchor] <= order[waits[0]]:
            continue
        chain, frontier = [waits[0]], [waits[0]]  # the wait and every node depending on it before the anchor
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u.op == "output" or order[u] > order[anchor] or u in chain:
                    continue
                chain.append(u)
                frontier.append(u)
        if len(chain) > max_nodes or any(n.target in (_AG, _RS, _WAIT) for n in chain[1:]):
            continue
        for n in sorted(chain, key=order.__getitem__):
            anchor.append(n)
            anchor = n
        moved += 1
    return moved


def saved_gather_bytes(fw: fx.GraphModule, specs: Sequence[GroupSpec] | None = None) -> dict[int, int]:
    """Gathered groups a partitioned forward graph hands to the backward: ``{gather position: bytes}``."""
    outputs = next(n for n in reversed(fw.graph.nodes) if n.op == "output").args[0]
    position = {wait: i for i, (_, wait) in enumerate(_gathers(fw.graph)) if wait is not None}
    saved: dict[int, int] = {}
    for out in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
        n = out
        while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS:
            n = n.args[0]
        if isinstance(n, fx.Node) and n in position:
            val = n.meta.get("val")
            saved[position[n]] = val.numel() * val.element_size() if val is not None else 0
    return saved


# ==================================================================================================== joint tagging
class RecomputeGathers:
    """Joint-graph pass: forward all-gathers are re-done in the backward unless kept (see the module's Note)."""

    def __init__(self, specs: Sequence[GroupSpec], keep: frozenset[int]) -> None:
        self.specs = list(specs)
        self.keep = keep

    def __call__(self, graph: fx.Graph) -> None:
        pairs = [(ag, w) for ag, w in _gathers(graph) if not _is_backward_node(ag)]
        if len(pairs) != len(self.specs):
            raise RuntimeError(
                f"zlightning graph mode: expected {len(self.specs)} forward all-gathers in the joint "
                f"graph, found {len(pairs)}; the model's forward must not issue its own all-gathers"
            )
        for spec, (ag, wait) in zip(self.specs, pairs):
            val = wait.meta.get("val") if wait is not None else None
            if val is not None and val.numel() * val.element_size() != spec.unsharded_bytes:
                raise RuntimeError(
                    f"zlightning graph mode: gather {spec.index} has {val.numel()} elements, expected "
                    f"{spec.unsharded_bytes // max(val.element_size(), 1)}"
                )
            save = spec.kind != "unit" or spec.index in self.keep
            policy = CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.MUST_RECOMPUTE
            for n in (ag, wait):
                if n is not None:
                    n.meta["recompute"] = policy
                    n.meta["ac_graph_id"] = 0

    def uuid(self) -> str:
        text = repr([(s.index, s.kind, s.unsharded_bytes) for s in self.specs]) + repr(sorted(self.keep))
        return hashlib.sha256(text.encode()).hexdigest()


def _is_backward_node(node: fx.Node) -> bool:
    """Whether a joint-graph node depends on a tangent (belongs to the backward)."""
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder" and "tangent" in n.name:
            return True
        stack.extend(n.all_input_nodes)
    return False


# ==================================================================================================== backend
@dataclass
class GraphStats:
    """What graph mode compiled: Dynamo graphs (each recompile is one more) and, per partitioned graph, its gathers."""

    graphs: int = 0
    forward_gathers: list[int] = field(default_factory=list)
    backward_gathers: list[int] = field(default_factory=list)
    backward_reduce_scatters: list[int] = field(default_factory=list)
    saved_unit_bytes: list[int] = field(default_factory=list)
    """Per forward graph: bytes of *unit* groups kept gathered for the backward (root/persistent excluded)."""
    saved_always_bytes: list[int] = field(default_factory=list)
    """Per forward graph: bytes of root/persistent groups held for the backward (the eager engine holds them too)."""
    moved: list[dict[str, int]] = field(default_factory=list)


def make_graph_backend(
    config: CompileConfig,
    specs: Sequence[GroupSpec],
    keep: frozenset[int],
    stats: GraphStats,
    compile_stats: Any = None,
) -> Callable[..., Any]:
    """The Dynamo backend of graph mode: AOT autograd with `RecomputeGathers`, placement passes, then the compiler."""
    tagger = RecomputeGathers(specs, keep)

    def transform(gm: fx.GraphModule, is_backward: bool) -> None:
        # Gathers are still in spec order here (the traced step issues them so); the passes below reorder them.
        in_spec_order = not is_backward and len(_gathers(gm.graph)) == len(specs)
        saved = saved_gather_bytes(gm) if in_spec_order else {}
        moved = {"place_gathers": place_gathers(gm)}
        if "prefetch" in config.passes:
            moved["prefetch"] = prefetch_gathers(gm, config)
        if "late_wait" in config.passes:
            moved["late_wait"] = late_wait(gm, config)
            if is_backward:
                moved["defer_reduce_waits"] = defer_reduce_waits(gm, config)
        gm.graph.lint()
        gm.recompile()
        pairs = _gathers(gm.graph)
        if is_backward:
            stats.backward_gathers.append(len(pairs))
            stats.backward_reduce_scatters.append(sum(1 for n in gm.graph.nodes if n.target is _RS))
        else:
            stats.forward_gathers.append(len(pairs))
            if in_spec_order:
                stats.saved_unit_bytes.append(sum(b for i, b in saved.items() if specs[i].kind == "unit"))
                stats.saved_always_bytes.append(sum(b for i, b in saved.items() if specs[i].kind != "unit"))
        stats.moved.append(moved)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        stats.graphs += 1
        if compile_stats is not None:
            compile_stats.graphs += 1
        if config.inner == "inductor":
            from torch._inductor import config as inductor_config
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(g: fx.GraphModule, inputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
                transform(g, bool(kwargs.get("is_backward", False)))
                return compile_fx_inner(g, inputs, *args, **kwargs)

            with inductor_config.patch(joint_custom_pre_pass=tagger):
                # without AOT export options compile_fx returns the compiled callable (CompileFxOutput also lists
                # the export results)
                return cast(Callable[..., Any], compile_fx(gm, list(example_inputs), inner_compile=inner_compile))
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        def fw(g: fx.GraphModule, inputs: Sequence[Any]) -> Any:
            transform(g, False)
            return make_boxed_func(g.forward)

        def bw(g: fx.GraphModule, inputs: Sequence[Any]) -> Any:
            transform(g, True)
            return make_boxed_func(g.forward)

        def partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], **kwargs: Any) -> Any:
            tagger(joint.graph)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        return aot_autograd(fw_compiler=fw, bw_compiler=bw, partition_fn=partition)(gm, example_inputs)

    return backend


# ==================================================================================================== the module
class ZeroGraphForward:
    """Replaces the compiled target's ``forward``: runs the compiled step over the current shard pieces.

    The target is the module the step calls: the root, or -- when the root holds no parameters of its own and one
    child holds them all (a LightningModule around its model) -- that child, repeatedly (see `graph_target`). Every
    unit module gets a guard pre-hook that raises a clear error when it is called outside the compiled target (its
    parameters would be the 1-D shard pieces).
    """

    def __init__(
        self, state: Any, specs: Sequence[GroupSpec], backend: Callable[..., Any], dynamic: bool | None
    ) -> None:
        self.prefix, self.target = graph_target(state.root)
        self.specs = list(specs)
        self._groups = ordered_groups(state)
        cut = len(self.prefix)
        self._names = [tuple((o, n, sh, tuple(f[cut:] for f in fq)) for o, n, sh, fq in s.views) for s in specs]
        outside = [f for s in specs for *_, fq in s.views for f in fq if not f.startswith(self.prefix)]
        if outside:
            raise ValueError(
                f"zlightning graph mode: parameters {outside[:3]} live outside {self.prefix[:-1]!r}, the "
                "module the compiled step calls; use CompileConfig(mode='unit')"
            )
        self._forward = type(self.target).forward.__get__(self.target)  # the class's forward, not this wrapper
        self.compiled = torch.compile(self._step, backend=backend, dynamic=dynamic)
        self.active = False
        inside = {id(m) for m in self.target.modules() if m is not self.target}
        self._guards = [
            u.module.register_forward_pre_hook(self._guard) for u in state.units[1:] if id(u.module) in inside
        ]
        self.target.forward = self  # type: ignore[method-assign]

    def _guard(self, module: nn.Module, args: Any) -> None:
        if not self.active:
            raise RuntimeError(
                f"zlightning graph mode compiled {type(self.target).__name__}.forward ({self.prefix[:-1] or 'the root'}"
                f"), but {type(module).__name__} was called outside it, where its parameters are shards. Call the "
                "compiled module in the step, or compile with CompileConfig(mode='unit')"
            )

    def remove(self) -> None:
        """Back to the eager forward (the engine's hooks are the caller's to resume)."""
        self.target.__dict__.pop("forward", None)
        for h in self._guards:
            h.remove()
        self._guards.clear()

    def _step(self, pieces: list[list[torch.Tensor]], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        params: dict[str, torch.Tensor] = {}
        grad = torch.is_grad_enabled()  # a constant while tracing (Dynamo guards on the grad mode)
        for spec, names, ps in zip(self.specs, self._names, pieces):
            if grad:
                full = _GatherGroup.apply(
                    spec.world, spec.group_name, spec.pad, spec.param_dtype, spec.reduce_dtype, *ps
                )
            else:
                full = _gather(spec.world, spec.group_name, spec.pad, spec.param_dtype, ps)
            for offset, numel, shape, fqns in names:
                t = full[offset : offset + numel].view(shape)
                for fqn in fqns:
                    params[fqn] = t
        with torch.nn.utils.stateless._reparametrize_module(self.target, params, tie_weights=False, strict=False):
            return self._forward(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        pieces = [[zp.piece for zp in g.params] for g in self._groups]
        self.active = True
        try:
            return self.compiled(pieces, args, kwargs)
        finally:
            self.active = False


def graph_target(root: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, module)``: descends from ``root`` while a module holds no parameters itself and exactly one child
    holds parameters (the LightningModule -> model case); the prefix ends with a dot unless empty."""
    prefix, module = "", root
    while not any(True for _ in module.parameters(recurse=False)):
        holders = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        if len(holders) != 1 or isinstance(holders[0][1], (nn.ModuleList, nn.ModuleDict)):
            break
        prefix, module = f"{prefix}{holders[0][0]}.", holders[0][1]
    return prefix, module
