"""The ZeRO-3 engine state: units, groups, passes, prefetch and the end-of-backward protocol.

[Note: passes]
A *pass* is one forward (a training/validation step, or a call of the root module). It starts explicitly
(``forward_pass()``; the root module's forward hook; the Lightning strategy around each ``*_step``) or implicitly at
the first unit used outside one. Each pass records the order in which units ran; the next pass prefetches from that
order and backward prefetches in reverse. The recorded order is a hint: a unit that runs out of order is gathered on
demand (correct, just not overlapped), never an error.

[Note: training states]
The engine is in one `TrainingState` at a time, and every move goes through ``_to`` which raises on a move the
protocol does not allow (a bug, not user input): IDLE (between passes: only persistent groups may be gathered),
FORWARD (a pass is open: root and units gather on use; with grad enabled the pass stays open after the forward
returns, until its backward ends), BACKWARD (the end-of-backward callback is queued; units re-run for activation
checkpointing stay in it), PAUSED (hooks are no-ops while a caller installed full parameters itself:
``summon_full_params``) and SUSPENDED (hooks removed: a compiled graph gathers and releases instead).

[Note: unused parameters]
A reduce-scatter must be issued by every rank in the same order, so each group that took part in the forward with
grad enabled reduces its full gradient (zeros where a parameter got none). To still match single-process training,
where an unused parameter keeps ``grad=None`` and the optimizer skips it, each rank marks the parameters that got a
gradient; at the end of backward one small all-reduce (MAX) of those marks tells every rank which pieces to give a
``.grad``. A unit that no rank ran, or whose outputs no rank used, issues nothing on any rank. Control flow that uses
a unit on some ranks and not others cannot be matched without a collective per unit and is not supported (FSDP2 has
the same rule); the harness's timeouts turn such a hang into a failure.

[Note: step budgets from units]
DeepSpeed sizes its prefetch and reduce buckets in elements (5e7 and 5e8 by default): on a model of a few hundred
million parameters that lets the whole model be gathered ahead, and every gradient be in flight at once, so a step
holds up to two extra full models and the point of sharding is lost. The engine's defaults are in units instead:
one unit is prefetched ahead of the one computing, and one unit's reduce-scatter stays in flight while the next
unit's backward runs. That is the overlap there is to have (one collective hides behind one unit's compute), and the
step's peak beyond the shards is a handful of units (computing, prefetched, its autograd gradients, one reduction in
flight), whatever the model's size. Explicit sizes (``ZeroConfig`` or a DeepSpeed config) are honoured as given.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from zlightning._watchdog import wait_for, watch_engine
from zlightning.zero._buffers import StoragePool
from zlightning.zero._collectives import CommStreams
from zlightning.zero._config import ZeroConfig, dtype_from_name
from zlightning.zero._deferred import recording_for
from zlightning.zero._host_memory import pin_mmap_threshold, use_host_cache
from zlightning.zero._init import ParamInitFn, ShardedInit
from zlightning.zero._offload import ZeroOffload, close_swap_files
from zlightning.zero._offload_config import NVMeOffload
from zlightning.zero._param import ZeroParam
from zlightning.zero._param_group import (
    FlatGradient,
    GroupContext,
    GroupState,
    PendingReduce,
    ZeroParamGroup,
    persistent_indices,
    split_by_kind,
)
from zlightning.zero._unit import (
    GatheringParameters,
    UnitPolicy,
    ZeroUnit,
    assign_owners,
    deepest_common_unit,
    select_unit_modules,
)

if TYPE_CHECKING:
    from zlightning.zero._optimizer import ModelParallelGrads

__all__ = ["ParamInitFn", "TrainingState", "ZeroState", "engine_of"]

_ENGINES: weakref.WeakValueDictionary[int, ZeroState] = weakref.WeakValueDictionary()
"""``id(root module)`` -> the engine that shards it (see `engine_of`). Weak: the module's hooks keep its engine
alive, and both go together when the module is no longer used (the engine's swap files with them)."""


def engine_of(module: nn.Module) -> ZeroState | None:
    """The engine sharding ``module`` (the root given to ``zero3_shard``), or None when it is not sharded."""
    engine = _ENGINES.get(id(module))
    return engine if engine is not None and engine.root is module else None


class TrainingState(enum.Enum):
    """Where the engine is in the step protocol (see [Note: training states])."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    PAUSED = "paused"
    SUSPENDED = "suspended"


_MOVES: dict[TrainingState, frozenset[TrainingState]] = {
    TrainingState.IDLE: frozenset(
        {TrainingState.FORWARD, TrainingState.BACKWARD, TrainingState.PAUSED, TrainingState.SUSPENDED}
    ),
    TrainingState.FORWARD: frozenset({TrainingState.IDLE, TrainingState.FORWARD, TrainingState.BACKWARD}),
    TrainingState.BACKWARD: frozenset({TrainingState.IDLE}),
    TrainingState.PAUSED: frozenset({TrainingState.IDLE}),
    TrainingState.SUSPENDED: frozenset({TrainingState.IDLE}),
}


class ZeroState:
    """Shards a module in place and runs the gather/release/reduce protocol around its forward and backward."""

    def __init__(
        self,
        root: nn.Module,
        config: ZeroConfig,
        process_group: dist.ProcessGroup | None = None,
        unit_policy: UnitPolicy | None = None,
        *,
        device: torch.device | None = None,
        param_init_fn: ParamInitFn | None = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ZeRO-3 needs an initialised process group: call torch.distributed.init_process_group(...) first "
                "(the zstack_zero3 Lightning strategy does this for you)."
            )
        self.root = root
        self.config = config
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.global_src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        self.sync_module_states = config.sync_module_states
        self.param_dtype = dtype_from_name(config.mixed_precision.param_dtype)
        self.reduce_dtype = dtype_from_name(config.mixed_precision.reduce_dtype) or torch.float32
        self.device = device if device is not None else _module_device(root)
        if self.device.type == "meta":
            raise ValueError(
                "the model is on the meta device: pass device=... (where shards should live) so each rank can "
                "initialise only its own shards"
            )
        # see [Note: host memory of a sharded step]
        self.host_cached = self.device.type == "cpu" and config.host_cache and use_host_cache()
        if self.device.type == "cpu" and config.host_mmap_threshold is not None:
            pin_mmap_threshold(config.host_mmap_threshold)
        self.meta_init = any(p.is_meta for p in root.parameters())
        metas = [t for t in (*root.parameters(), *root.buffers()) if t.is_meta]
        self._init = (
            ShardedInit(self.device, param_init_fn, process_group, self.global_src, recording_for(metas))
            if metas
            else None
        )
        self.streams = CommStreams(self.device)
        self.params: list[ZeroParam] = []
        self.units: list[ZeroUnit] = []
        self.groups: list[ZeroParamGroup] = []
        self._by_piece: dict[int, ZeroParam] = {}
        self._group_of: dict[int, ZeroParamGroup] = {}  # ZeroParam.index -> its group
        # groups read outside their unit this pass -> whether they stay gathered to the end of the backward (read
        # with grad) or only to their unit's next release (see [Note: a parameter read outside its unit] and
        # [Note: a read outside without grad ends with the unit's use])
        self._read_outside: dict[int, bool] = {}
        # pass and backward bookkeeping (see [Note: training states])
        self.training_state = TrainingState.IDLE
        self._pass_id = 0
        self._depth = 0
        self._order: list[ZeroUnit] = []
        self._last_pos: dict[int, int] = {}
        self._last_order: list[ZeroUnit] = []
        self._pending: collections.deque[PendingReduce] = collections.deque()
        self._pending_numel = 0
        self._used = torch.zeros(0)
        self._reduces_before_backward = 0
        self.gradient_sync = True  # False: accumulate full gradients locally, reduce on the next synced backward
        self.reduce_scatters = 0  # issued so far (a statistic for tests and reports)
        self._root_handles: list[Any] = []
        self.optimizer_hooks: list[Any] = []  # step post-hooks of attached optimizers
        self.offload: ZeroOffload | None = None
        # set by tensor parallelism (see ModelParallelGrads in _optimizer.py): gradient norms also reduce over it
        self.model_parallel: ModelParallelGrads | None = None
        self.pool = StoragePool(self.device, idle_limit=0)  # see [Note: why the engine pools its step buffers]
        self.group_context = GroupContext(
            process_group=process_group,
            rank=self.rank,
            world=self.world_size,
            global_src=self.global_src,
            device=self.device,
            streams=self.streams,
            pool=self.pool,
            broadcast_init=self.sync_module_states and not self.meta_init,
            initial_value=self._init.initial_value if self._init is not None else None,
            on_gradients=self.post_backward,
        )
        self._build(unit_policy)
        self.prefetch_budget, self.reduce_budget = self._budgets()
        # see [Note: the host's backward gathers each unit at its own hook]
        explicit = self.config.prefetch_bucket_size is not None
        self.backward_prefetch_budget = self.prefetch_budget if explicit or self.device.type != "cpu" else 0
        # where the caching host allocator serves the buffers, it keeps them for reuse, by the pool and by autograd
        # alike (see [Note: why the engine pools its step buffers] in _buffers.py)
        self.pool.idle_limit = 0 if self.host_cached else self._pool_limit()
        if config.offload_optimizer is not None or config.offload_params is not None:
            self.offload = ZeroOffload(self)  # see [Note: what is offloaded where] in _offload.py
            self.group_context.offload = self.offload
            # swap files never outlive the engine (which lives as long as its module)
            weakref.finalize(self, close_swap_files, self.offload.swappers(), list(self.offload.folders))
        self._finish_init()
        _ENGINES[id(root)] = self
        watch_engine(self)  # names its collectives for the watchdog (see zlightning/_watchdog.py)

    # ================================================================ construction
    def _build(self, unit_policy: UnitPolicy | None) -> None:
        if self.sync_module_states and self.world_size > 1:
            for buf in self.root.buffers():
                if not buf.is_meta:
                    dist.broadcast(buf.data, src=self.global_src, group=self.process_group)
        unit_mods = select_unit_modules(self.root, self.config.unit_modules, unit_policy)
        self.units = [ZeroUnit(0, "", self.root, self, is_root=True)]
        self.units += [ZeroUnit(i + 1, n, m, self, is_root=False) for i, (n, m) in enumerate(unit_mods)]
        owners, objects = assign_owners(self.root, self.units)
        for pid, holders in owners.items():
            zp = ZeroParam(len(self.params), objects[pid], [h[0] for h in holders], [(h[1], h[2]) for h in holders])
            self.params.append(zp)
        cfg = self.config
        chosen = persistent_indices(
            self.params, cfg.stage, cfg.param_persistence_threshold, cfg.model_persistence_threshold
        )
        per_unit: dict[int, list[ZeroParam]] = collections.defaultdict(list)
        for zp, holders in zip(self.params, owners.values()):
            if zp.index not in chosen:
                per_unit[deepest_common_unit([h[3] for h in holders]).index].append(zp)
        for unit in self.units:
            for params in split_by_kind(per_unit.get(unit.index, [])):
                unit.groups.append(self._new_group(params, persistent=False))
        persistent = [zp for zp in self.params if zp.index in chosen]
        self.persistent_groups = [self._new_group(ps, persistent=True) for ps in split_by_kind(persistent)]
        for zp in self.params:  # the pieces go into the modules in _finish_init
            self._by_piece[id(zp.piece)] = zp
        for group in self.groups:
            for zp in group.params:
                self._group_of[zp.index] = group
        self._used = torch.zeros(len(self.params), dtype=torch.float32)
        self.units = [u for u in self.units if u.groups or u.is_root]
        self._register_module_hooks()

    def _register_module_hooks(self) -> None:
        for unit in self.units:
            unit.register_hooks()
        self._wrap_parameter_dicts()
        self._root_handles = [
            self.root.register_forward_pre_hook(lambda m, a: self.begin_pass(), prepend=True),
            self.root.register_forward_hook(lambda m, a, o: self.end_pass(), always_call=True),
        ]
        # Modules that hold root-unit or persistent parameters gather them lazily when used outside a pass.
        lazy = {id(m): m for g in self.units[0].groups + self.persistent_groups for zp in g.params for m, _ in zp.slots}
        for m in lazy.values():
            if m is not self.root:
                self._root_handles.append(m.register_forward_pre_hook(lambda mod, a: self._ensure_root()))

    def _budgets(self) -> tuple[int, int]:
        """Elements of prefetch and of reduce-scatters in flight (see [Note: step budgets from units])."""
        largest = max((u.numel for u in self.units if not u.is_root), default=0) or self.units[0].numel
        prefetch = self.config.prefetch_bucket_size
        reduce = self.config.reduce_bucket_size
        return (largest if prefetch is None else prefetch), (largest if reduce is None else reduce)

    def _pool_limit(self) -> int:
        """Idle bytes the buffer pool keeps: what one step of units needs at its peak, so nothing is reallocated."""
        sizes = sorted((g.unsharded_bytes for g in self.groups if not g.persistent), reverse=True)
        window = 4 * (self.prefetch_budget + self.reduce_budget) + sum(sizes[:4])
        return window + sum(g.unsharded_bytes for g in self.groups if g.persistent)

    def _finish_init(self) -> None:
        """After every shard has its initial values (in memory, or written to its swap file): the modules take their
        pieces. Until then they keep the full-shape originals that sharded initialisation calls ``reset_parameters``
        on."""
        pending = [g for g in self.groups if g.values_pending]
        if pending:
            raise AssertionError(f"{len(pending)} parameter groups never received their initial values")
        for zp in self.params:
            zp.install(zp.piece)
        if self._init is not None:
            replayed: dict[int, torch.Tensor] = {}  # a buffer registered twice stays one tensor
            with torch.no_grad():
                for module in self.root.modules():
                    for name, b in module._buffers.items():
                        if b is None or not b.is_meta:
                            continue
                        if id(b) not in replayed:
                            value = self._init.recorded_value(b)
                            if value is None:
                                continue
                            replayed[id(b)] = value.clone()  # its own storage, not the replayed one
                        module._buffers[name] = replayed[id(b)]
            self._init.done()
        meta_buffers = [n for n, b in self.root.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(
                f"buffers {meta_buffers[:5]} are still on the meta device after sharded initialisation: build the model "
                "under zlightning.zero.deferred_init() (Lightning's configure_model does), or make their modules "
                "(re)create them in reset_parameters() or param_init_fn, or create them outside the meta context"
            )

    def _new_group(self, params: list[ZeroParam], persistent: bool) -> ZeroParamGroup:
        # [Note: initial values straight to disk]
        # With parameter shards on NVMe and a model built on the meta device, a shard gets its initial values only
        # when the parameter offloader writes it to its swap file (one group at a time): building every shard first
        # would hold the whole sharded model in memory once, which is what offloading parameters exists to avoid.
        defer = isinstance(self.config.offload_params, NVMeOffload) and not persistent and self._init is not None
        group = ZeroParamGroup(
            params, self.group_context, persistent=persistent, param_dtype=self.param_dtype, defer_values=defer
        )
        self.groups.append(group)
        return group

    def _unit_param_modules(self) -> list[nn.Module]:
        seen: dict[int, nn.Module] = {}
        for unit in self.units[1:]:
            for group in unit.groups:
                for zp in group.params:
                    for module, _ in zp.slots:
                        seen[id(module)] = module
        return list(seen.values())

    def _wrap_parameter_dicts(self) -> None:
        """See [Note: a parameter read outside its unit]."""
        for module in self._unit_param_modules():
            if not isinstance(module._parameters, GatheringParameters):
                module._parameters = GatheringParameters(module._parameters, self._read_outside_unit)

    def plain_parameter_dicts(self) -> None:
        """Gives every module a plain ``_parameters`` dict again (for compilers: a traced graph must not call the
        engine); a parameter read outside its unit's forward then sees the shard piece."""
        for module in self._unit_param_modules():
            if isinstance(module._parameters, GatheringParameters):
                module._parameters = dict(module._parameters)

    def _read_outside_unit(self, value: Any) -> bool:
        """A module slot is being read: when it holds a shard piece during a pass, gathers and installs its group
        for the reader and returns True (see [Note: a parameter read outside its unit])."""
        zp = self._by_piece.get(id(value))
        if zp is None or not self._pass_open():
            return False
        group = self._group_of[zp.index]
        if group.persistent or self._is_root_group(group):
            return False
        group.unshard()  # re-gathers a stale copy too
        group.install(self._pass_id, recompute=self.training_state is TrainingState.BACKWARD)
        self._read_outside[id(group)] = torch.is_grad_enabled() or self._read_outside.get(id(group), False)
        return True

    # [Note: a read outside without grad ends with the unit's use]
    # A group read outside its unit stays gathered to the end of the pass, for the reader's backward. Without grad
    # there is no backward, and keeping it changed the collectives of the rest of the pass on this rank only when the
    # read depends on the data: nn.TransformerEncoder in eval reads its first layer's weights (for its fast-path
    # check) only when the padding mask is left-aligned, so a rank with right-padded batches kept that layer gathered
    # through the next calls of the model in the same step (generation in predict_step) while a rank with left
    # padding gathered it per call, and gloo aborted on mismatched sizes. So a group read without grad is released
    # at its own unit's next release, as if the read had been the unit's use; a later read gathers it again.

    def _reshard_unit(self, unit: ZeroUnit) -> None:
        for group in unit.groups:
            if self._read_outside.get(id(group)) is False:  # see [Note: a read outside without grad ends ...]
                del self._read_outside[id(group)]
            if id(group) not in self._read_outside:
                group.reshard()

    # ================================================================ module hooks (public, for compilers)
    def engine_hook_ids(self) -> set[int]:
        """Ids (``handle.id``) of the forward pre/post hooks this engine registered on modules: the root's pass
        hooks, the lazy "gather root/persistent parameters" pre-hooks and every unit's gather/release hooks. A
        compiler that traces through modules uses this to tell the engine's hooks from the user's."""
        return {h.id for h in self._root_handles} | {h.id for u in self.units for h in u._handles}

    def _to(self, new: TrainingState) -> None:
        """Moves to ``new`` (see [Note: training states]).

        Raises:
            AssertionError: the protocol does not allow the move (an engine bug, or hooks called out of order).
        """
        if new not in _MOVES[self.training_state]:
            raise AssertionError(f"ZeRO engine: illegal move {self.training_state.name} -> {new.name}")
        self.training_state = new

    def _pass_open(self) -> bool:
        return self.training_state in (TrainingState.FORWARD, TrainingState.BACKWARD)

    def _hooks_off(self) -> bool:
        return self.training_state in (TrainingState.PAUSED, TrainingState.SUSPENDED)

    def _close_pass(self) -> None:
        """A forward pass without backward is over (FORWARD -> IDLE); nothing to do otherwise."""
        if self.training_state is TrainingState.FORWARD:
            self._to(TrainingState.IDLE)

    def suspend_module_hooks(self) -> None:
        """Removes the engine's module hooks and makes passes no-ops: for a caller that gathers, releases and
        reduce-scatters itself (``zlightning.compile`` graph mode). Every group must be sharded (between steps).

        Raises:
            RuntimeError: a group is gathered (called mid-step) or parameter/optimizer offload is on.
        """
        if self.training_state is TrainingState.SUSPENDED:
            return
        if self.offload is not None:
            raise RuntimeError(
                "suspend_module_hooks: not supported with parameter/optimizer offload (the engine "
                "must drive the swaps); compile in per-unit mode instead"
            )
        busy = [g for g in self.groups if g.status is not GroupState.SHARDED and not g.persistent]
        if busy or self._pending:
            raise RuntimeError(
                "suspend_module_hooks: call it between steps (groups are gathered or reduce-scatters are in flight)"
            )
        self.release_all(keep_persistent=False)
        for unit in self.units:
            unit.remove_hooks()
        self.plain_parameter_dicts()
        for h in self._root_handles:
            h.remove()
        self._root_handles = []
        self._close_pass()
        self._depth = 0
        self._to(TrainingState.SUSPENDED)

    @contextlib.contextmanager
    def full_shape_stand_ins(self) -> Iterator[dict[int, ZeroParam]]:
        """Module slots hold meta-device parameters of the full shapes inside the block (no memory), so code that
        builds optimizers from ``module.parameters()`` sees ``p.ndim``/``p.shape`` as unsharded; yields
        ``id(stand_in) -> ZeroParam`` for `attach_optimizer`. The pieces are back in the slots afterwards."""
        stand_ins: dict[int, ZeroParam] = {}
        for zp in self.params:
            p = nn.Parameter(torch.empty(zp.shape, dtype=zp.dtype, device="meta"), requires_grad=zp.requires_grad)
            stand_ins[id(p)] = zp
            zp.install(p)
        try:
            yield stand_ins
        finally:
            for zp in self.params:
                zp.install(zp.piece)

    @contextlib.contextmanager
    def paused_hooks(self) -> Iterator[None]:
        """The engine's module hooks do nothing inside the block (the caller installed full parameters itself)."""
        if self._pending or self.training_state not in (TrainingState.IDLE, TrainingState.FORWARD):
            raise RuntimeError(
                f"paused_hooks: call it between steps (the engine is in {self.training_state.name}"
                f"{', reduce-scatters in flight' if self._pending else ''})"
            )
        self.release_all(keep_persistent=False)
        self._close_pass()
        self._depth = 0
        self._to(TrainingState.PAUSED)
        try:
            yield
        finally:
            self._to(TrainingState.IDLE)

    def resume_module_hooks(self) -> None:
        """Undoes `suspend_module_hooks` (the engine gathers and releases around modules again)."""
        if self.training_state is TrainingState.SUSPENDED:
            self._to(TrainingState.IDLE)
            self._register_module_hooks()

    # ================================================================ passes and forward hooks
    def begin_pass(self) -> None:
        """Starts a pass (nested calls only count depth): gathers and installs root and persistent groups."""
        if self._hooks_off():
            return
        self._depth += 1
        if self._depth > 1:
            return
        self._open_pass()
        self._ensure_root()

    def end_pass(self) -> None:
        if self._hooks_off():
            return
        self._depth = max(self._depth - 1, 0)
        if self._depth > 0:
            return
        if not torch.is_grad_enabled() and self.training_state is TrainingState.FORWARD:
            self.release_all(keep_persistent=True)
            self._to(TrainingState.IDLE)

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """Brackets one step's forward so root parameters are gathered once and units are prefetched in order."""
        self.begin_pass()
        try:
            yield
        finally:
            self.end_pass()

    def _open_pass(self) -> None:
        if self._order:
            self._last_order = self._order
            self._last_pos = {id(u): i for i, u in enumerate(self._order)}
        self._order = []
        self._pass_id += 1
        self._to(TrainingState.FORWARD)

    def _ensure_root(self) -> None:
        if self._hooks_off():
            return
        if not self._pass_open():
            self._open_pass()
        for g in self.units[0].groups + self.persistent_groups:
            g.unshard()
            if not g._installed or (g.requires_grad and torch.is_grad_enabled() and g._fulls_pass != self._pass_id):
                g.install(self._pass_id)

    def unit_pre_forward(self, unit: ZeroUnit) -> None:
        if self._hooks_off():
            return
        if not self._pass_open():
            self._open_pass()
            self._ensure_root()
        if self.training_state is TrainingState.BACKWARD:  # see [Note: a unit's forward inside backward]
            unit.unshard()
            unit.install(self._pass_id, recompute=True)
            return
        if unit not in self._order:
            self._order.append(unit)
        if self.offload is not None and self._last_order:  # disk reads run further ahead than all-gathers
            pos = self._last_pos.get(id(unit))
            self.offload.prefetch([g for u in self._last_order[(pos if pos is not None else 0) :] for g in u.groups])
        unit.unshard()
        unit.install(self._pass_id)
        if self.config.overlap_comm and self._last_order:
            pos = self._last_pos.get(id(unit))
            if pos is not None:
                self._prefetch(self._last_order[pos + 1 :], self.prefetch_budget)

    # [Note: a unit's forward inside backward]
    # Activation checkpointing runs a unit's forward again during backward, to rebuild what its backward reads.
    # * ``use_reentrant=False`` (torch's advice): the recomputed tensors are unpacked into the nodes of the original
    #   graph, which run right after, and the gradients flow through the original graph to the autograd node the
    #   forward made (still pending). So the recomputation gets that node's outputs again (their storage refilled by
    #   the gather) instead of a second node, whose backward would never come and would keep the unit gathered to
    #   the end of backward; and the unit is not resharded at the recomputation's end, which would free the
    #   parameters those nodes are about to read. The unit's own backward releases it, as without checkpointing.
    # * Hugging Face's gradient checkpointing calls the layer's ``forward`` directly in the recomputation, past the
    #   unit's hooks: the unit's pre-backward hook reinstalls the pending node's outputs in the module slots, so the
    #   recomputation reads gathered parameters connected to that node, in either mode.
    # * ``use_reentrant=True``: the original forward ran without grad (no node), the recomputed graph is the one
    #   backpropagated, in a backward nested in the outer one: it gets a node as any forward does, and the unit is
    #   released when that node's backward runs. Only the outer backward may end the engine's backward (reductions
    #   drained, unused gradients settled, root groups released): ``expect_backward`` queues that work on the outer
    #   backward before any nested one starts; without it (a plain ``loss.backward()``) each nested backward ends
    #   one, which is exact but re-gathers the root's groups per recomputed unit.
    # Neither prefetches: the forward order's next units are the ones whose backward is already done.
    def unit_post_forward(self, unit: ZeroUnit) -> None:
        if self._hooks_off() or self.training_state is TrainingState.BACKWARD:
            return
        if torch.is_grad_enabled() and not self.config.reshard_after_forward:
            return  # kept for backward: see ZeroConfig.reshard_after_forward
        if (
            torch.is_grad_enabled()
            and self._last_order
            and unit is self._last_order[-1]
            and unit.reads_params_in_backward
        ):
            return  # see [Note: the last unit of the forward stays gathered]
        self._reshard_unit(unit)

    def unit_keep_for_backward(self, unit: ZeroUnit) -> None:
        """See [Note: an output autograd cannot be seen in] in _unit.py: gathered until the backward ends."""
        if self._hooks_off() or self.training_state is TrainingState.BACKWARD:
            return  # a recomputation (see [Note: a unit's forward inside backward]), stopped early by torch
        unit.warn_kept()
        for group in unit.groups:
            self._read_outside[id(group)] = True

    # [Note: the last unit of the forward stays gathered]
    # The unit that ends the forward (an output head, the last block) is the first whose backward runs: releasing it
    # after its forward only to gather it again once the loss is computed costs an all-gather of it every step and
    # frees nothing at the step's peak. So, as torchtitan does for its last layer, it stays gathered into its
    # backward. The last unit is the previous step's (the forward order is recorded per pass); a first step, or a
    # forward that ends elsewhere, releases as usual.

    def unit_pre_backward(self, unit: ZeroUnit) -> None:
        if self._hooks_off():
            return
        self._queue_finish()
        if self.offload is not None and unit in self._order:
            pos = self._order.index(unit)
            upcoming = [u for u in reversed(self._order[: pos + 1]) if u.reads_params_in_backward]
            self.offload.prefetch([g for u in upcoming for g in u.groups])
        unit.unshard()  # also waits for a prefetch still in flight
        unit.install_for_backward(self._pass_id)  # see [Note: a unit's forward inside backward]
        if self.device.type == "cpu":  # see [Note: host reductions finish before the next unit computes]
            while self._pending:
                self._drain_one()
        if self.config.overlap_comm and self.backward_prefetch_budget and unit in self._order:
            pos = self._order.index(unit)
            upcoming = [u for u in reversed(self._order[:pos]) if u.reads_params_in_backward]
            self._prefetch(upcoming, self.backward_prefetch_budget)

    # [Note: host reductions finish before the next unit computes]
    # On a device, a unit's reduce-scatter stays in flight through the next unit's backward (one collective hides
    # behind one unit's compute). On the host that moment was the step's peak: the unit computing, the next one
    # prefetched, the autograd gradient being produced and the packed gradient of the reduction in flight, four
    # unit-sized buffers, where the compute it overlaps competes for the same cores as gloo's threads anyway. So
    # on the host the reduction is finished once the next unit is gathered: the reduction still overlaps the gather
    # of the unit, and the unit computes beside its own gradient only (see [Note: the host's backward gathers each
    # unit at its own hook]).
    # Measured through Trainer.fit at 2 ranks (Linear(1024) + Tanh blocks, AdamW): peak resident growth 9.35 ->
    # 9.18 bytes per parameter with 24 blocks, 9.01 -> 8.88 with 32; median step 0.575 -> 0.583 s (three
    # alternating runs each, within this machine's noise).

    # [Note: the host's backward gathers each unit at its own hook]
    # A backward prefetch gathers the next unit while this one computes, and this unit's computing ends by producing
    # its gradient (autograd's own unit-sized tensors, handed to the reduction): three unit buffers at once, the
    # step's peak. On the host the gather it hides is a copy through gloo's threads, competing for the cores the
    # compute runs on, so by default the host's backward prefetches nothing: each unit is gathered at its own
    # pre-backward hook, while the previous unit's reduction is still in flight (the two collectives overlap each
    # other), and the unit computes beside its gradient alone: two unit buffers. That holds only because the pool
    # keeps no idle storage where the caching host allocator serves CPU tensors: the buffer of the reduction finished
    # at the hook is the block autograd's gradient of this unit takes (a pool holding it would keep the forward's two
    # slots beside the gradient, three units again). The forward still prefetches one unit (no gradients there),
    # devices prefetch in both passes, and an explicit ``prefetch_bucket_size`` (or a DeepSpeed config's) is honoured
    # in both passes.
    # Measured through Trainer.fit at 2 ranks, AdamW (benchmarks/memory.py, 30 steps): 24 x Linear(1024) + Tanh peak
    # resident growth 9.01-9.02 -> 8.85 bytes per parameter at steps 3 and 30, step 0.335-0.350 -> 0.336 s; 12 x
    # Linear(2048) + Tanh (few wide units, a unit is 0.33 bytes per parameter) 9.26 -> 8.92, step 0.614 -> 0.569 s;
    # CPU offload 9.02 -> 8.79, NVMe offload 4.49 -> 4.26 (with [Note: a freed step buffer is freed now] in
    # _buffers.py, without which the saving came on some steps only).

    def _prefetch(self, upcoming: list[ZeroUnit], budget: int) -> None:
        live = sum(
            g.world * g.shard_numel for g in self.groups if not g.persistent and g.status is not GroupState.SHARDED
        )
        ahead = 0  # units gathered or in flight in the window (see [Note: prefetch within its budget])
        for unit in upcoming:
            if budget <= 0:
                return
            if unit.is_gathered_or_inflight():  # already inside the look-ahead window: it uses up budget too,
                budget -= unit.numel  # else every call would reach further ahead and gather without bound
                ahead += 1
                continue
            if ahead and unit.numel > budget:
                return
            if live + unit.numel > self.config.max_live_parameters:
                return
            if self._gather_would_wait_on_disk(unit):
                return
            unit.start_gather()
            budget -= unit.numel
            live += unit.numel
            ahead += 1

    # [Note: prefetch within its budget]
    # The prefetch budget is the largest unit's size. A unit larger than what is left of it used to be gathered
    # anyway, so with units of very different sizes the window overshot: at the embedding's forward, the small
    # blocks fitted and then the output head (as large as the embedding) was gathered too, beside the embedding,
    # and the engine's pool kept two buffers of that size for good (1.6 of 14.0 bytes per parameter on the
    # language model of ``benchmarks/memory.py --model lm``). Now a unit that does not fit what is left waits until
    # the window has room, unless nothing is ahead at all (then it is gathered, so prefetch always runs one unit
    # ahead); with units of one size nothing changes.

    # [Note: a gather prefetch never waits for the disk]
    # With parameter shards on NVMe, prefetching a unit's gather needs its shard, whose read may still be in flight
    # (issued a unit ago because the pool had no free buffer before). Waiting for it there stalls the compute of the
    # current unit to start a gather early. On one rank the "gather" is a local copy that gains nothing by being early,
    # so the prefetch stops at the first unit whose shard has not landed, and that unit gathers at its own hook, by
    # when the read has had the current unit's compute to finish. With several ranks every rank must issue its
    # collectives in the same order, which a local disk's timing cannot decide: there the prefetch waits.
    def _gather_would_wait_on_disk(self, unit: ZeroUnit) -> bool:
        if self.world_size != 1 or self.offload is None:
            return False
        return not all(self.offload.landed(g) for g in unit.groups if g.status is GroupState.SHARDED)

    # ================================================================ backward
    def expect_backward(self, loss: torch.Tensor) -> None:
        """Enters BACKWARD as soon as a backward of ``loss`` starts (its own gradient is the first one computed), so
        the end-of-backward work is queued on that outermost backward: a backward nested inside it (reentrant
        activation checkpointing) then runs as part of it instead of ending the engine's backward early (see
        [Note: a unit's forward inside backward]). The Lightning strategy and ``DeepSpeedZeroOptimizer_Stage3``
        call it; a plain ``loss.backward()`` works without it."""
        if not self._hooks_off() and loss.requires_grad:
            loss.register_hook(self._on_loss_gradient)

    def _on_loss_gradient(self, grad: torch.Tensor) -> None:
        self._queue_finish()

    def _queue_finish(self) -> None:
        if self.training_state is not TrainingState.BACKWARD:
            self._to(TrainingState.BACKWARD)
            self._reduces_before_backward = self.reduce_scatters
            Variable._execution_engine.queue_callback(self.finish_backward)

    def post_backward(self, group: ZeroParamGroup, grads: tuple[torch.Tensor | None, ...]) -> None:
        """Called by ``_UnshardFn.backward``: reduce-scatter this group's gradients (asynchronously)."""
        self._queue_finish()
        for zp, g in zip(group.params, grads):
            if g is not None:
                self._used[zp.index] = 1.0
        if self.gradient_sync:  # see [Note: room for a gradient before packing it]
            # before this use is counted off: draining an earlier reduction of this same group must not tell an
            # offloaded optimizer that its gradient is final (this use's part is not even packed yet)
            while self._pending and (self._pending_numel + group.shard_numel) * self.world_size > self.reduce_budget:
                self._drain_one()
        group.pending_backward = max(group.pending_backward - 1, 0)
        if (
            group.pending_backward == 0
            and not group.persistent
            and not self._is_root_group(group)
            and id(group) not in self._read_outside
        ):
            group.reshard()  # before packing: the packed gradient can take the gathered buffer's pool slot
        if self.gradient_sync and group.reduces_own_half_directly(grads, self.reduce_dtype):
            # see [Note: two host ranks reduce without packing their own half] in _param_group.py
            self._reduce(group, group.pack_peer_half(grads, self.reduce_dtype), peer_half=True)
            return
        flat = group.pack_gradients(grads, self.reduce_dtype)
        if group.unsynced is not None:
            flat.tensor.add_(group.unsynced.tensor)
            group.unsynced.release()
            group.unsynced = None
        if self.gradient_sync:
            self._reduce(group, flat)
        else:
            group.unsynced = flat

    # [Note: room for a gradient before packing it]
    # The reduce budget (one unit by default) bounds the gradients in flight. Waiting for the oldest reduce-scatter
    # only after the next one was issued held two packed unit gradients at once, plus autograd's own copy of the one
    # being packed, for no overlap: the older reduction has had the whole backward of this unit to finish. So room is
    # made before packing, and the packed gradient takes the finished one's pool slot; the new reduction overlaps the
    # next unit's backward, as before. (On 24 x Linear(1024) at 2 ranks this moment was not the step's peak, which
    # comes while a unit computes with the next unit prefetched and the previous one's reduction in flight: peak
    # unchanged there, one buffer less wherever packing is the peak.)
    def _reduce(self, group: ZeroParamGroup, flat: FlatGradient, peer_half: bool = False) -> None:
        if self.world_size > 1 and not peer_half:  # a packed peer half is divided already
            flat.tensor.div_(self.world_size)
        self._pending.append(group.start_reduce_scatter(flat, async_op=self.config.overlap_comm, peer_half=peer_half))
        self.reduce_scatters += 1
        self._pending_numel += group.shard_numel
        if not self.config.overlap_comm or self.world_size == 1:  # see [Note: a finished reduction is not held]
            while self._pending:
                self._drain_one()
        while len(self._pending) > 1 and self._pending_numel * self.world_size > self.reduce_budget:
            self._drain_one()

    # [Note: a finished reduction is not held]
    # A reduction stays pending so that it can overlap the next unit's backward. A synchronous one (``overlap_comm``
    # off) has nothing left to overlap, and on one rank there is no collective at all, yet both used to wait in the
    # queue until the next unit's gradients arrived, holding their packed unit-sized buffer through that unit's
    # whole backward. They are accumulated and their buffer returned at once: on 24 x Linear(1024) at 2 ranks with
    # ``overlap_comm=False`` the step's buffers at its peak went from three units to two (the unit computing and its
    # autograd gradient), 9.16 -> 8.99 bytes per parameter of resident growth.

    def _is_root_group(self, group: ZeroParamGroup) -> bool:
        return any(group is g for g in self.units[0].groups)

    def _drain_one(self) -> None:
        pending = self._pending.popleft()
        self._pending_numel -= pending.group.shard_numel
        pending.finish()
        if self.offload is not None:
            self._notify_gradient_final(pending.group)

    def _notify_gradient_final(self, group: ZeroParamGroup) -> None:
        """Tells the offloaded optimizer that ``group``'s gradient shard is final for this backward (it may step the
        group now: [Note: optimizer steps in backward] in _offload_optimizer.py): every use of the group was reduced,
        none of its reductions is still in flight, and which pieces get a ``.grad`` is settled. With one rank a
        piece that got no gradient here never will (finish_backward would drop its ``.grad`` the same way); with
        several, another rank may have used it, which only finish_backward's all-reduce tells, so such a group is
        left to ``optimizer.step()``."""
        if not self.gradient_sync or group.pending_backward or group.unsynced is not None:
            return
        if any(p.group is group for p in self._pending):
            return
        unsure = [zp for zp in group._fresh if not self._used[zp.index]]
        if unsure and self.world_size > 1:
            return
        for zp in unsure:
            zp.piece.grad = None
        self.offload.gradient_final(group)  # type: ignore[union-attr]

    def finish_backward(self) -> None:
        """End of backward: finish reduce-scatters, settle unused parameters, release everything non-persistent."""
        if self.gradient_sync:  # gradients held back in earlier micro-batches, for groups unused in this one
            for group in self.groups:
                if group.unsynced is not None:
                    flat, group.unsynced = group.unsynced, None
                    self._reduce(group, flat)
        while self._pending:
            self._drain_one()
        if self.reduce_scatters > self._reduces_before_backward:
            self._settle_unused()
        for group in self.groups:
            group.pending_backward = 0
        self.release_all(keep_persistent=True)
        if self.host_cached:  # see [Note: step buffers between backward and the optimizer step]
            self.pool.release_idle()
        self._to(TrainingState.IDLE)
        self._depth = 0

    def _settle_unused(self) -> None:
        """See [Note: unused parameters]: pieces no rank used since the last settlement get ``grad=None`` again."""
        used = self._used.to(self.device)
        if self.world_size > 1:
            work = dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            # a failure here (a peer that stopped on diverging collectives) is explained as the engine's own are
            wait_for(work, "the end of backward's all-reduce of which parameters got gradients", sliced=used.is_cpu)
        used = used.cpu()
        for group in self.groups:
            for zp in group.take_fresh():
                if used[zp.index] == 0:
                    zp.piece.grad = None
        self._used.zero_()

    def flush_unsynced(self) -> None:
        """Reduce-scatters the gradients still held back while gradient sync was off (a caller whose last backward
        used none of this engine's parameters: a pipeline stage's frozen chunk), then settles unused parameters as
        the end of a backward does. Collective over the data-parallel group when anything is held."""
        held = [(g, g.unsynced) for g in self.groups if g.unsynced is not None]
        if not held or not self.gradient_sync:
            return
        for group, flat in held:
            group.unsynced = None
            self._reduce(group, flat)
        while self._pending:
            self._drain_one()
        self._settle_unused()

    def release_all(self, keep_persistent: bool) -> None:
        """Reshards every group (persistent ones only leave the module slots unless ``keep_persistent`` is False)."""
        self._read_outside.clear()
        for group in self.groups:
            if group.persistent and keep_persistent:
                group.wait_gather()
                group.uninstall()
            else:
                group.reshard()

    def on_optimizer_step(self) -> None:
        """Gathered copies are out of date once the shards change."""
        if self._pending:
            raise RuntimeError("optimizer.step() ran while gradient reduce-scatters were still in flight")
        self._read_outside.clear()
        for group in self.groups:
            if group.persistent:
                group.wait_gather()
                group.uninstall()
                if group.status is not GroupState.SHARDED:
                    group.stale = True
            else:
                group.reshard()
        self._close_pass()

    # ================================================================ queries
    def zero_param_of(self, piece: torch.Tensor) -> ZeroParam | None:
        return self._by_piece.get(id(piece))

    def full_shape(self, piece: torch.Tensor) -> torch.Size:
        """The full shape of a sharded parameter piece (``p.shape`` is the 1-D local piece)."""
        zp = self._by_piece.get(id(piece))
        if zp is None:
            raise KeyError("not a ZeRO-3 parameter piece of this engine")
        return zp.shape

    def trainable_pieces(self) -> list[nn.Parameter]:
        return [zp.piece for zp in self.params if zp.requires_grad]

    def resident(self) -> contextlib.AbstractContextManager[None]:
        """Every shard in memory inside the block (with parameter offload they otherwise live on disk); changes
        made inside are written back. Checkpoint and consolidation code wraps its shard access in this."""
        return self.offload.resident() if self.offload is not None else contextlib.nullcontext()

    def close_offload(self) -> None:
        """Stops swap I/O and removes this rank's swap files (idempotent)."""
        if self.offload is not None:
            self.offload.close()

    def remove_hooks(self) -> None:
        """Detaches the engine from the module for good (hooks removed, swap files deleted)."""
        if _ENGINES.get(id(self.root)) is self:
            del _ENGINES[id(self.root)]
        self.close_offload()
        for unit in self.units:
            unit.remove_hooks()
        self.plain_parameter_dicts()
        for h in self._root_handles + self.optimizer_hooks:
            h.remove()
        self._root_handles.clear()
        self.optimizer_hooks.clear()


def _module_device(module: nn.Module) -> torch.device:
    for t in list(module.parameters()) + list(module.buffers()):
        return t.device
    return torch.device("cpu")
