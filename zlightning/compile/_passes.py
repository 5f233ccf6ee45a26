"""FX graph passes over functional collectives (pure: graph in, same graph mutated and re-linted out).

[Note: why the passes target functional collectives]
Inside a compiled region, communication is expressed as ``_c10d_functional`` ops: an ``all_gather_into_tensor`` (or
``all_reduce``...) *starts* the collective and returns a handle-like tensor, and ``wait_tensor`` completes it. Compute
placed between the two overlaps with communication. The passes therefore only reorder or deduplicate these nodes:
``prefetch`` moves a gather's start as early as its inputs allow (DeepCompile's proactive prefetch), ``late_wait``
moves each wait down to just before its first user (so the overlap window is as wide as the data dependencies permit),
and ``selective_unshard`` keeps one gathered copy of a parameter for all its uses in a graph instead of gathering it
again (DeepCompile's selective unsharding, within a graph). None of them changes values, which the tests check.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

from zlightning.compile._config import PASS_NAMES, CompileConfig

__all__ = ["PASSES", "PassStats", "late_wait", "prefetch", "run_passes", "selective_unshard"]

PassStats = dict[str, int]
"""Pass name -> number of nodes it moved or removed in one graph."""

_C10D = torch.ops._c10d_functional
_GATHER = {_C10D.all_gather_into_tensor, _C10D.all_gather_into_tensor.default}  # Dynamo emits the packet,
_WAIT = {_C10D.wait_tensor, _C10D.wait_tensor.default}  # make_fx/AOT graphs the overload


def _is(node: fx.Node, targets: set) -> bool:
    return node.op == "call_function" and node.target in targets


def prefetch(gm: fx.GraphModule, config: CompileConfig) -> int:
    """Moves each all-gather right after the latest node it depends on (bounded by ``prefetch_distance``)."""
    moved = 0
    for node in [n for n in gm.graph.nodes if _is(n, _GATHER)]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        deps = [a for a in node.all_input_nodes]
        anchor = max(deps, key=order.__getitem__) if deps else None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        last_placeholder = placeholders[-1] if placeholders else None
        anchor = anchor if anchor is not None else last_placeholder
        if anchor is None:
            continue
        target = max(order[anchor], order[last_placeholder] if last_placeholder is not None else -1) + 1
        if config.prefetch_distance is not None:
            target = max(target, order[node] - config.prefetch_distance)
        if target < order[node]:
            list(gm.graph.nodes)[target - 1].append(node)  # append() moves an existing node after the given one
            moved += 1
    return moved


def late_wait(gm: fx.GraphModule, config: CompileConfig) -> int:
    """Moves each ``wait_tensor`` to just before its first user."""
    moved = 0
    for node in [n for n in gm.graph.nodes if _is(n, _WAIT)]:
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        if not node.users:
            continue
        first = min(node.users, key=order.__getitem__)
        if order[first] > order[node] + 1:
            first.prepend(node)
            moved += 1
    return moved


def selective_unshard(gm: fx.GraphModule, config: CompileConfig) -> int:
    """Reuses the first gather (and its wait) of a tensor for later identical gathers of the same tensor."""
    seen: dict[tuple, fx.Node] = {}
    removed = 0
    for node in [n for n in gm.graph.nodes if _is(n, _GATHER)]:
        key = (node.args, tuple(sorted(node.kwargs.items())))
        if key not in seen:
            seen[key] = node
            continue
        keep = seen[key]
        waits = [u for u in node.users if _is(u, _WAIT)]
        keep_waits = [u for u in keep.users if _is(u, _WAIT)]
        if len(waits) != len(node.users) or len(keep_waits) != 1:
            continue  # consumed by something other than one wait: leave it alone
        for w in waits:
            w.replace_all_uses_with(keep_waits[0])
            gm.graph.erase_node(w)
        gm.graph.erase_node(node)
        removed += 1
    return removed


PASSES: dict[str, Callable[[fx.GraphModule, CompileConfig], int]] = {
    "prefetch": prefetch,
    "late_wait": late_wait,
    "selective_unshard": selective_unshard,
}


def run_passes(gm: fx.GraphModule, config: CompileConfig) -> PassStats:
    """Runs the enabled passes in the canonical order, then lints and recompiles ``gm``.

    Returns:
        Per-pass counts of moved/removed nodes.
    """
    stats: PassStats = {}
    for name in PASS_NAMES:  # dedupe first, so prefetch only moves the gathers that remain
        if name in config.passes:
            stats[name] = PASSES[name](gm, config)
    gm.graph.lint()
    gm.recompile()
    return stats
