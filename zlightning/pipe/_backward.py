"""Splitting one stage's backward into the input gradient (``B``) and the weight gradients (``W``).

[Note: how a backward is split]
The autograd graph of one stage and micro-batch runs from its outputs (or loss) down to two kinds of leaves: the
stage inputs (received activations, which require grad) and the parameters. Call a node *on the input path* if some
stage input is reachable from it. ``B`` runs autograd restricted to the stage inputs (``inputs=``), which executes
exactly the nodes on the input path and, inside each, only the outputs that lead to an input: a matrix multiply then
computes ``dX`` but not ``dW``. The nodes where the weight side branches off the input path (*split nodes*: on the
input path, with an edge to a node that reaches a parameter but no input) get a pre-hook that records the gradient
arriving at them, and the graph is kept (``retain_graph``).

A split node whose weight edges lead straight to parameters (a layer norm's weight and bias) computes them in the
same kernel as its input gradient, so ``B`` accumulates those at once instead of deferring them.

``W`` then finishes the weight side from those records in two phases. Phase 1 re-enters each split node with its
recorded gradient and asks autograd only for the gradients along its weight-side edges (``GradientEdge`` inputs):
autograd executes the split node alone, computing just its weight outputs (``dW``, not ``dX`` again), and stops at
the edges. Split nodes that reach one another are re-entered in separate calls (grouped by depth from the outputs:
nodes of equal depth cannot reach each other), since a call with both would run the nodes between them and count
the deeper one twice. Phase 2 is one ordinary backward from all those edges, plus the outputs whose node is not on
the input path at all (a first stage whose input is token ids has no input path: its whole backward is ``W``), into
the parameters' ``.grad`` with their usual hooks. Each weight gradient is therefore computed once and the input path
is never re-run: ``B + W`` costs what one backward costs, plus one graph walk (a few hundred nodes per stage).

One graph shape cannot be split this way: a weight edge whose node is also on the weight side of a split node of
another depth, e.g. a layer applied twice along the stage's input path whose bias feeds both uses' matrix multiplies
straight into one ``AccumulateGrad``. Asked for the gradient at an edge, autograd runs every path from its roots to
the edge's node, so phase 1 of the shallower node would run the deeper one (and free its graph). ``B`` then detects
it and runs the whole backward itself, and ``W`` has nothing to do: the same numbers, without the deferral. A node
shared *below* the edges is harmless (phase 1 stops at the edges, phase 2 runs it once): a bias-free weight used
twice (each use has its own transpose node) splits, and so do ZeRO-2/3 stages, whose parameters all come out of one
gather node per group and micro-batch: the engine gives each installed parameter its own view node there, so every
edge node belongs to one use (see [Note: ZeRO inside a pipeline stage] in ``_zero.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

__all__ = ["DeferredWeights", "SavedActivations", "backward_input", "backward_weight"]


@dataclass
class DeferredWeights:
    """What a split backward's ``W`` still has to compute (holds the stage's graph until then)."""

    levels: list[tuple[list[GradientEdge], list[torch.Tensor], list[GradientEdge]]] = field(default_factory=list)
    """Per depth: split-node outputs (re-entry points), the gradients recorded there, and the weight-side edges."""
    roots: list[GradientEdge] = field(default_factory=list)
    """Stage outputs whose node reaches parameters only (phase 2 starts there directly)."""
    root_grads: list[torch.Tensor] = field(default_factory=list)


@dataclass
class _Graph:
    """One walk of a stage's graph: which nodes reach an input, which reach a parameter, and their depth."""

    order: list[Node]
    """Every node reachable from the outputs, outputs first (reverse post-order: parents before children)."""
    to_input: set[Node]
    to_param: set[Node]
    depth: dict[Node, int]


def _walk(roots: Sequence[Node], input_nodes: set[Node]) -> _Graph:
    post: list[Node] = []
    seen: set[Node] = set()
    for root in roots:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(root.next_functions))]
        while stack:
            node, children = stack[-1]
            for child, _ in children:
                if child is not None and child not in seen:
                    seen.add(child)
                    stack.append((child, iter(child.next_functions)))
                    break
            else:
                stack.pop()
                post.append(node)
    to_input: set[Node] = set()
    to_param: set[Node] = set()
    for node in post:  # children first
        if node in input_nodes:
            to_input.add(node)
        elif not node.next_functions and hasattr(node, "variable"):
            to_param.add(node)  # an AccumulateGrad of a parameter
        for child, _ in node.next_functions:
            if child is not None:
                if child in to_input:
                    to_input.add(node)
                if child in to_param:
                    to_param.add(node)
    order = post[::-1]
    depth = {node: 0 for node in roots}
    for node in order:
        for child, _ in node.next_functions:
            if child is not None:
                depth[child] = max(depth.get(child, 0), depth.get(node, 0) + 1)
    return _Graph(order, to_input, to_param, depth)


def _weight_edges(node: Node, graph: _Graph) -> list[tuple[Node, int]]:
    return [
        (child, nr)
        for child, nr in node.next_functions
        if child is not None and child in graph.to_param and child not in graph.to_input
    ]


def _shared_across_depths(splits: dict[Node, list[tuple[Node, int]]], graph: _Graph) -> bool:
    """Whether the node of some weight edge is also on the weight side of a split node of another depth; see
    [Note: how a backward is split]."""
    depths: dict[Node, set[int]] = {}
    for d in sorted({graph.depth[node] for node in splits}):
        stack = [child for node, edges in splits.items() if graph.depth[node] == d for child, _ in edges]
        seen: set[Node] = set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            depths.setdefault(n, set()).add(d)
            stack += [c for c, _ in n.next_functions if c is not None and c in graph.to_param]
    return any(len(depths[child]) > 1 for edges in splits.values() for child, _ in edges)


def backward_input(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> DeferredWeights | None:
    """``B``: accumulates the gradient of ``inputs`` (leaves of this stage) into their ``.grad`` and returns the
    deferred weight work for ``backward_weight``; see [Note: how a backward is split]. Returns None when it ran the
    whole backward (parameters included) because the graph cannot be split."""
    root_edges = [get_gradient_edge(t) for t in outputs]
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    graph = _walk([e.node for e in root_edges], input_nodes)
    splits = {n: _weight_edges(n, graph) for n in graph.order if n in graph.to_input}
    splits = {n: edges for n, edges in splits.items() if edges}
    if _shared_across_depths(splits, graph):
        torch.autograd.backward(list(outputs), list(grads))
        return None
    # A split node whose weight edges end right at parameters (a norm's weight and bias) computes them in the same
    # kernel as its input gradient: B takes those too, and W has one autograd call less per such node.
    direct = [n for n, edges in splits.items() if all(not c.next_functions for c, _ in edges)]
    leaves = [c.variable for n in direct for c, _ in splits.pop(n)]  # type: ignore[attr-defined]  # AccumulateGrad
    recorded: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = [n.register_prehook(lambda g, n=n: recorded.__setitem__(n, g)) for n in splits]
    try:
        wanted = [(t, g) for t, g, e in zip(outputs, grads, root_edges) if e.node in graph.to_input]
        if wanted:
            targets = list(inputs) + leaves
            torch.autograd.backward([t for t, _ in wanted], [g for _, g in wanted], inputs=targets, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    work = DeferredWeights()
    by_depth: dict[int, list[Node]] = {}
    for node in recorded:
        by_depth.setdefault(graph.depth[node], []).append(node)
    for d in sorted(by_depth):
        entries, entry_grads, edges = [], [], []
        for node in by_depth[d]:
            for nr, g in enumerate(recorded[node]):
                if g is not None:
                    entries.append(GradientEdge(node, nr))
                    entry_grads.append(g)
            edges += [e for e in _weight_edges(node, graph) if e not in edges]
        if entries:
            work.levels.append((entries, entry_grads, [GradientEdge(c, nr) for c, nr in edges]))
    for e, g in zip(root_edges, grads):
        if e.node not in graph.to_input and e.node in graph.to_param:
            work.roots.append(e)
            work.root_grads.append(g)
    return work


def backward_weight(work: DeferredWeights | None) -> None:
    """``W``: accumulates the deferred weight gradients into the parameters' ``.grad``; see
    [Note: how a backward is split]."""
    if work is None:
        return
    edges, values = list(work.roots), list(work.root_grads)
    for entries, entry_grads, weight_edges in work.levels:
        got = torch.autograd.grad(entries, weight_edges, grad_outputs=entry_grads, allow_unused=True)
        for edge, g in zip(weight_edges, got):
            if g is not None:
                edges.append(edge)
                values.append(g)
    work.levels.clear()
    if edges:
        torch.autograd.backward(edges, values)


# [Note: what B leaves for W]
# ``B`` keeps the stage's graph (``retain_graph``) so that ``W`` can re-enter it, and a kept graph keeps every tensor
# its nodes saved, also those only the input path needed: attention's and GELU's inputs, a norm's statistics, the
# loss's operands. ``W`` runs only the split nodes (a matrix multiply needs its input for ``dW``) and the weight side
# below them, so a micro-batch waiting for its ``W`` held about twice what it needs, and ZB-H1's last rank, which
# keeps one such micro-batch next to 1F1B's, peaked above 1F1B's first rank. ``SavedActivations`` packs every tensor
# the stage forward saves into a holder (through the hooks already installed, if any, so outer accounting or offload
# still applies); after ``B`` it reads the saved tensors of exactly the nodes ``W`` will run, which marks their
# holders, and empties the rest. A holder emptied by mistake fails loudly when unpacked, it never computes wrong.


class _Saved:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class SavedActivations:
    """The tensors one stage forward saved for backward, so that those only ``B`` needed are freed once it ran; see
    [Note: what B leaves for W]."""

    def __init__(self) -> None:
        self._holders: list[_Saved] = []
        self._marked: set[int] | None = None

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)

        def pack(t: torch.Tensor) -> _Saved:
            held = _Saved(outer[0](t) if outer is not None else t.detach())  # not t: a saved output would form a cycle
            self._holders.append(held)
            return held

        def unpack(held: _Saved) -> torch.Tensor:
            if self._marked is not None:
                self._marked.add(id(held))
            if held.value is None:
                raise RuntimeError(
                    "zlightning pipeline: a tensor saved by a stage's forward was freed after its input backward (B) "
                    "but its weight backward (W) needs it; this is a bug in zlightning/pipe/_backward.py, please "
                    "report it with the model (as a workaround, use schedule='1f1b')"
                )
            return outer[1](held.value) if outer is not None else held.value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def keep_only_for(self, work: DeferredWeights | None) -> None:
        """After ``B``: frees every saved tensor that the nodes ``work`` runs do not use (all of them when ``B`` ran
        the whole backward: ``work`` None)."""
        self._marked = set()
        try:
            for node in _nodes_of(work) if work is not None else []:
                for name in dir(node):
                    if name.startswith("_saved_"):
                        getattr(node, name)  # unpacks, which marks the holder
                if hasattr(node, "saved_tensors"):  # a custom autograd.Function
                    node.saved_tensors  # noqa: B018 - read for its unpack hooks
            kept = self._marked
        finally:
            self._marked = None
        for held in self._holders:
            if id(held) not in kept:
                held.value = None
        self._holders = []  # the kept ones live in their nodes, which W releases


def _nodes_of(work: DeferredWeights) -> list[Node]:
    """The nodes ``backward_weight(work)`` runs: the split nodes (phase 1) and everything below the weight edges and
    the weight-only roots (phase 2)."""
    out: list[Node] = []
    seen: set[Node] = set()
    stack: list[Node] = [e.node for e in work.roots]
    for entries, _, weight_edges in work.levels:
        for e in entries:
            if e.node not in seen:
                seen.add(e.node)
                out.append(e.node)
        stack += [e.node for e in weight_edges]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        out.append(node)
        stack += [c for c, _ in node.next_functions if c is not None]
    return out
