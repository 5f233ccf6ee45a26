"""Sharding units: module subtrees whose parameters are gathered together, and how units are chosen.

[Note: units, not parameters]
Gathering per unit (one transformer block, say) keeps the number of collectives small and predictable: one
all-gather per group per use and one reduce-scatter per group per backward. A parameter shared by modules of two
units (tied embedding and head) belongs to the deepest unit that contains all of its modules, usually the root.
The root unit is special: its parameters are gathered on first use in a step and released when the step's backward
ends (or at the end of a no-grad pass), because they typically frame the whole forward (embeddings, head).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from zlightning.zero._param_group import GroupState, ZeroParamGroup

__all__ = [
    "GatheringParameters",
    "ParamOwners",
    "UnitHooks",
    "UnitPolicy",
    "ZeroUnit",
    "assign_owners",
    "deepest_common_unit",
    "select_unit_modules",
]

UnitPolicy = Callable[[str, nn.Module], bool]
"""``policy(qualified_name, module) -> bool``: True makes the module a sharding unit."""


class UnitHooks(Protocol):
    """What a unit's module hooks call: the engine's protocol around one unit's forward and backward."""

    def unit_pre_forward(self, unit: ZeroUnit) -> None: ...

    def unit_post_forward(self, unit: ZeroUnit) -> None: ...

    def unit_pre_backward(self, unit: ZeroUnit) -> None: ...

    def unit_keep_for_backward(self, unit: ZeroUnit) -> None: ...


class ZeroUnit:
    """A module subtree gathered as one: owns its groups and the hooks on its module."""

    def __init__(self, index: int, name: str, module: nn.Module, hooks: UnitHooks, is_root: bool) -> None:
        self.index = index
        self.name = name or "<root>"
        self.module = module
        self.hooks = hooks
        self.is_root = is_root
        self.groups: list[ZeroParamGroup] = []
        self._handles: list[Any] = []
        self._hooked_stash: dict[int, weakref.ref[torch.Tensor]] = {}  # see [Note: results kept on a module]
        self.reads_params_in_backward = is_root or not _only_lookups(module)
        """False for a unit whose backward never reads its parameters (see [Note: lookups need no gather in
        backward]): it is not gathered again for its backward."""

    @property
    def numel(self) -> int:
        return sum(g.world * g.shard_numel for g in self.groups)

    @property
    def unsharded_bytes(self) -> int:
        return sum(g.unsharded_bytes for g in self.groups)

    def is_gathered_or_inflight(self) -> bool:
        return all(g.status is not GroupState.SHARDED and not g.stale for g in self.groups)

    def start_gather(self) -> None:
        for g in self.groups:
            if g.stale:
                g.reshard()
            g.start_gather(async_op=True)

    def unshard(self) -> None:
        for g in self.groups:
            g.unshard()

    def install(self, pass_id: int, recompute: bool = False) -> None:
        for g in self.groups:
            g.install(pass_id, recompute)

    def install_for_backward(self, pass_id: int) -> None:
        for g in self.groups:
            g.install_for_backward(pass_id)

    def reshard(self) -> None:
        for g in self.groups:
            g.reshard()

    # ---------------------------------------------------------------- hooks
    def register_hooks(self) -> None:
        if self.is_root:
            return
        self._handles.append(self.module.register_forward_pre_hook(self._pre_forward, prepend=True))
        self._handles.append(self.module.register_forward_hook(self._post_forward, always_call=True))

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _pre_forward(self, module: nn.Module, args: Any) -> None:
        self.hooks.unit_pre_forward(self)

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if torch.is_grad_enabled() and self.reads_params_in_backward:
            # Frozen units need their parameters back too: the input gradient reads them.
            tensors = [t for t in _tensors_in(output) if t.requires_grad]
            for t in tensors:
                t.register_hook(self._pre_backward_hook)
            for t in self._new_stashed_tensors():  # see [Note: results kept on a module]
                t.register_hook(self._pre_backward_hook)
                tensors.append(t)
            if not tensors and self._may_be_backpropagated(args):  # see [Note: an output autograd cannot be seen in]
                self.hooks.unit_keep_for_backward(self)
        self.hooks.unit_post_forward(self)
        return output

    def _new_stashed_tensors(self) -> list[torch.Tensor]:
        """Tensors with an autograd history held as plain attributes of the unit's modules, not hooked before."""
        found = []
        for m in self.module.modules():
            for value in m.__dict__.values():
                if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                    seen = self._hooked_stash.get(id(value))
                    if seen is None or seen() is not value:
                        found.append(value)
        if found:  # (ids, not a WeakSet: tensors compare by value)
            self._hooked_stash = {k: r for k, r in self._hooked_stash.items() if r() is not None}
            self._hooked_stash.update((id(t), weakref.ref(t)) for t in found)
        return found

    def _may_be_backpropagated(self, args: Any) -> bool:
        inputs = [t for t in _tensors_in(args) if t.requires_grad]
        return bool(inputs) or any(g.requires_grad for g in self.groups)

    def warn_kept(self) -> None:
        warnings.warn(
            f"ZeRO-3 unit {self.name!r} ({type(self.module).__name__}) returned no tensor that requires grad where "
            "the engine can find it (it looks in tensors, lists, tuples, dicts and dataclasses), so it cannot tell "
            "when its backward starts: the unit stays gathered until the end of the backward. Return its outputs "
            "in one of those containers to release it after its forward.",
            stacklevel=2,
        )

    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.hooks.unit_pre_backward(self)
        return None

    def __repr__(self) -> str:
        return f"ZeroUnit({self.name}, numel={self.numel}, groups={len(self.groups)})"


# [Note: an output autograd cannot be seen in]
# A unit is gathered again for its backward by a hook on the tensors it returns. Outputs are searched with pytree
# (tensors, lists, tuples, dicts, named tuples, registered types such as Hugging Face's ModelOutput) and inside
# dataclass instances, which user code returns as often. When no tensor that requires grad is found although the
# unit's parameters or inputs require grad (an object pytree does not know, a result kept on ``self`` and read by
# the parent), the unit's backward may still come, reading parameters a release after the forward would have freed
# (it failed with "setStorage: ... out of bounds for storage of size 0"). Such a unit is kept gathered until the
# end of the backward instead, as a parameter read outside its unit is (correct, at the memory of the unit), and a
# warning says how to let it be released. A forward recomputed during backward is not kept: torch's checkpointing
# stops a recomputation as soon as it has what the backward needs, so its hook sees no output at all, and the unit's
# own backward releases it (see [Note: a unit's forward inside backward] in _state.py).


# [Note: results kept on a module]
# A unit may also keep a result on itself for its parent to read (an exit classifier's logits for deep supervision,
# an auxiliary loss as ``self.aux_loss``). When that result was computed after the unit's output from parameters the
# output does not use, its backward runs before the output's, so it read the unit's parameters released after the
# forward (it failed with
# "setStorage: ... out of bounds for storage of size 0"). So after the forward, tensors with an autograd history
# stored as plain attributes of the unit's modules get the pre-backward hook too (each tensor once: one kept from an
# earlier step is not hooked again). Results kept in containers on the module are not searched; return them instead.


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value``, looking through pytree containers and dataclass instances."""
    found: list[torch.Tensor] = []
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            found += _tensors_in([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return found


# [Note: lookups need no gather in backward]
# An embedding's backward scatters the output gradient into rows by the saved indices; it never reads the weight.
# Gathering such a unit again for its backward (an all-gather of what is often the model's largest unit) only
# for its reduce-scatter to follow is wasted, so a unit made only of plain ``nn.Embedding`` lookups (their own
# ``forward``, no ``max_norm``, which writes the weight) registers no pre-backward hook and is left out of the
# backward prefetch. Its gradient still arrives through its autograd node, which packs and reduce-scatters it as
# for any unit; a recomputed forward (activation checkpointing) gathers it as any forward does.


def _only_lookups(module: nn.Module) -> bool:
    """Whether every module in ``module``'s subtree that holds parameters is a plain ``nn.Embedding`` lookup."""
    holders = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    return bool(holders) and all(
        isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward and m.max_norm is None for m in holders
    )


def _matches(names: tuple[str, ...]) -> UnitPolicy:
    def policy(qualname: str, module: nn.Module) -> bool:
        cls = type(module)
        return cls.__name__ in names or f"{cls.__module__}.{cls.__qualname__}" in names

    return policy


def _holds_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


_CONTAINERS = (nn.ModuleList, nn.ModuleDict)  # never called themselves: hooks on them would never fire


def _auto_units(root: nn.Module) -> list[str]:
    """Blocks (members of a ``ModuleList``, or of a ``Sequential`` with a same-class sibling) plus the large
    parameter-holding modules beside them (see [Note: what the root unit keeps]), else the parameter-holding children
    of the root (looking through single-child wrappers and containers)."""
    picked: list[str] = []
    for name, module in root.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            children = list(module.named_children())
            classes = [type(c) for _, c in children]
            for child_name, child in children:
                repeated = isinstance(module, nn.ModuleList) or classes.count(type(child)) >= 2
                if repeated and _holds_params(child) and not isinstance(child, _CONTAINERS):
                    picked.append(f"{name}.{child_name}" if name else child_name)
    if picked:
        # Keep only outermost picks (a repeated block inside a repeated block stays inside its parent unit).
        blocks = [n for n in picked if not any(n.startswith(p + ".") for p in picked if p != n)]
        return blocks + _large_leftovers(root, blocks)
    node, prefix = root, ""
    while True:
        holders = [(n, c) for n, c in node.named_children() if _holds_params(c)]
        if len(holders) == 1 and not any(True for _ in node.parameters(recurse=False)):
            prefix = f"{prefix}{holders[0][0]}."
            node = holders[0][1]
            continue
        if len(holders) <= 1:
            return []
        out: list[str] = []
        for n, c in holders:
            if isinstance(c, _CONTAINERS):
                out += [f"{prefix}{n}.{cn}" for cn, cc in c.named_children() if _holds_params(cc)]
            else:
                out.append(f"{prefix}{n}")
        return out


# [Note: what the root unit keeps]
# Parameters that no unit claims belong to the root unit, which is gathered at its first use in a step and kept,
# with autograd's full gradient of it, until the step's backward ends. Beside its repeated blocks a model usually
# has an embedding and an output head that are no blocks, and in a language model with a large vocabulary those
# are most of the parameters (Embedding(32000, 256) and its head against four 0.8 M-element blocks: 89% of them).
# Kept in the root they cost their full parameters and full gradient for the whole step, which on such a model
# brought the peak to DDP's (17.9 bytes per parameter at two ranks, DDP 22-24), where DeepSpeed gathers each
# module only around its own use and torchtitan shards the embedding and the head apart from the blocks. So the
# modules beside the blocks that are large become units too, largest first, until what the root keeps is at most
# half the largest block: a small final norm or a bias stays in the root (a unit costs three collectives a step),
# an embedding or a head of any real size gets gathered only around its own forward and backward. A parameter
# shared between modules (a tied embedding and head) still belongs to the unit that contains all its users.


def _large_leftovers(root: nn.Module, blocks: list[str]) -> list[str]:
    """Subtrees beside ``blocks`` that hold many parameters of their own, as units (see [Note: what the root unit
    keeps])."""
    holders: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for _, p in module.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(p), []).append(mod_name)
            sizes[id(p)] = p.numel()

    def inside(name: str, prefix: str) -> bool:
        return prefix == "" or name == prefix or name.startswith(prefix + ".")

    def own_numel(prefix: str, beside_blocks: bool = True) -> int:
        """Elements of the parameters held only under ``prefix`` (and in no block)."""
        return sum(
            sizes[pid]
            for pid, names in holders.items()
            if all(inside(n, prefix) for n in names)
            and not (beside_blocks and any(inside(n, b) for n in names for b in blocks))
        )

    largest_block = max(own_numel(b, beside_blocks=False) for b in blocks)
    candidates: list[tuple[int, str]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if name in blocks:
                continue
            if isinstance(child, _CONTAINERS) or any(inside(b, name) for b in blocks):
                visit(child, name)  # never called itself, or holds blocks: look at what is beside them
            elif _holds_params(child):
                candidates.append((own_numel(name), name))

    visit(root, "")
    kept = sum(n for n, _ in candidates)
    chosen: list[str] = []
    for numel, name in sorted(candidates, key=lambda c: -c[0]):
        if kept <= largest_block // 2 or numel == 0:
            break
        chosen.append(name)
        kept -= numel
    return chosen


def select_unit_modules(
    root: nn.Module, unit_modules: tuple[str, ...], policy: UnitPolicy | None
) -> list[tuple[str, nn.Module]]:
    """Returns ``(qualified name, module)`` of every non-root unit, in module registration order.

    Raises:
        ValueError: ``unit_modules`` names a class that does not occur in the model.
    """
    if policy is None and unit_modules:
        policy = _matches(unit_modules)
        present = {type(m).__name__ for m in root.modules()} | {
            f"{type(m).__module__}.{type(m).__qualname__}" for m in root.modules()
        }
        missing = [n for n in unit_modules if n not in present]
        if missing:
            raise ValueError(
                f"ZeroConfig.unit_modules names {missing}, which no module of {type(root).__name__} is an instance of. "
                f"Module classes present: {sorted({type(m).__name__ for m in root.modules()})}"
            )
    if policy is None:
        wanted = set(_auto_units(root))
        return [(n, m) for n, m in root.named_modules() if n in wanted]
    chosen = [(n, m) for n, m in root.named_modules() if n and policy(n, m) and _holds_params(m)]
    containers = [n for n, m in chosen if isinstance(m, _CONTAINERS)]
    if containers:
        raise ValueError(
            f"sharding units {containers} are ModuleList/ModuleDict containers, which are never called, so their "
            "parameters would never be gathered: choose the modules inside them (e.g. the block class) instead"
        )
    return chosen


# [Note: a parameter read outside its unit]
# A unit's parameters are gathered around the unit's own forward and backward; between those the module slots hold
# the shard pieces. Code that reads a parameter from outside its module's forward (an output tied to the embedding
# by ``F.linear(h, self.emb.weight)``, a block's parameter used by its parent) then got a 1-D piece: a shape error
# at best. DeepSpeed gathers such a parameter on demand when it is read during a forward, and so does this engine:
# the ``_parameters`` dict of every module holding unit parameters is a `GatheringParameters`, whose item lookup (the
# one ``nn.Module.__getattr__`` makes) asks the engine, during a pass, to gather the group of a piece being read. The
# group is installed for the pass (the same autograd node as the unit's own use when that use still holds it, else a
# second node, whose backward reduce-scatters its own gradient: the shard gets the sum either way) and stays
# gathered until the end of the backward (or of a no-grad pass), as the root unit's parameters do, because the
# reader's backward can come at any time. Outside a pass (between steps) a read still gives the piece, as for every
# sharded parameter. Iterating the dict (``parameters()``, ``state_dict()``, the optimizer) never gathers. A compiled
# graph must not trace the engine: inside a region being compiled the lookup is a plain one (a unit compiled in
# per-unit mode reads its own parameters, gathered by its hooks, while the eager code around it, the root's forward
# reading ``self.emb.weight``, still gathers on demand; traced, the engine's checks became guards that recompiled the
# unit every step), and graph mode, which gathers every parameter itself, gives the modules plain dicts
# (`ZeroState.plain_parameter_dicts`, called by ``suspend_module_hooks``).


class GatheringParameters(dict):  # type: ignore[type-arg]
    """A module's ``_parameters`` under ZeRO-3: reading a sharded piece during a pass gathers its group first (see
    [Note: a parameter read outside its unit])."""

    def __init__(self, items: dict[str, Any], reader: Callable[[Any], bool]) -> None:
        super().__init__(items)
        self.reader = reader

    def __getitem__(self, name: str) -> Any:
        value = dict.__getitem__(self, name)
        if torch.compiler.is_compiling():  # never trace the engine: see [Note: a parameter read outside its unit]
            return value
        if value is not None and self.reader(value):
            return dict.__getitem__(self, name)  # the gathered full tensor, installed by the reader
        return value

    def __reduce__(self) -> Any:  # a copied or pickled module gets a plain dict
        return (dict, (dict(self),))


ParamOwners = dict[int, list[tuple[str, nn.Module, str, list[ZeroUnit]]]]
"""``id(parameter)`` -> every ``(qualified name, module, attribute, units on the path)`` that holds it."""


def assign_owners(root: nn.Module, units: list[ZeroUnit]) -> tuple[ParamOwners, dict[int, nn.Parameter]]:
    """Walks ``root`` and records, for every parameter (tied ones once), where it is held and under which units.

    ``units[0]`` must be the root unit. Returns the owners and ``id -> parameter``, in registration order.
    """
    unit_of_module = {id(u.module): u for u in units}
    owners: ParamOwners = {}
    objects: dict[int, nn.Parameter] = {}

    def walk(module: nn.Module, prefix: str, path: list[ZeroUnit]) -> None:
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((f"{prefix}{name}", module, name, list(path)))
                objects[id(p)] = p
        for name, child in module._modules.items():
            if child is not None:
                child_path = path + [unit_of_module[id(child)]] if id(child) in unit_of_module else path
                walk(child, f"{prefix}{name}.", child_path)

    walk(root, "", [units[0]])
    return owners, objects


def deepest_common_unit(unit_paths: list[list[ZeroUnit]]) -> ZeroUnit:
    """The deepest unit on every one of ``unit_paths`` (a parameter shared by two units belongs to their common
    ancestor, usually the root)."""
    common = unit_paths[0]
    for path in unit_paths[1:]:
        n = 0
        while n < min(len(common), len(path)) and common[n] is path[n]:
            n += 1
        common = common[:n]
    return common[-1]
