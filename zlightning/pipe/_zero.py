"""ZeRO-2/3 inside pipeline stages: each stage's parameters, gradients and optimizer state sharded over the stage's
data-parallel group with the ZeRO engine (``zlightning.zero``).

[Note: ZeRO inside a pipeline stage]
DeepSpeed refuses ZeRO-2/3 with pipelining because gradients must survive every micro-batch of a batch. Here each
rank hands its stage to the ZeRO engine as one sharded module (the local, untied layers) plus one per tie group it
owns, and drives the engine the way a pipeline needs:

- Gathered once per batch. Every parameter is declared *persistent* to the engine (persistence thresholds above the
  stage's size): a persistent parameter stays gathered between uses and is re-gathered once after each optimizer
  step. So the first forward of a batch all-gathers the stage (one collective per dtype) and every later micro-batch,
  forward or backward, reuses it; with ``zero_stage=3`` the gathered copy is released after the optimizer step
  (and after evaluation), so between batches each rank holds only its shard, as ZeRO-3 does, while ZeRO-2 keeps
  the (stale) copy's memory for the next gather.
- Reduce-scattered once per batch. Every backward but the rank's last of the batch runs with
  ``gradient_sync = False``: the engine sums the micro-batches' full gradients locally, and the last backward
  reduce-scatters the sum (averaged over the replicas) into the shards' gradients.
- One pass per micro-batch. Each stage forward is bracketed by the engines' ``forward_pass()``, which installs the
  gathered parameters autograd-connected for that micro-batch (a tied layer used through its ``forward_fn``, which
  never calls the module, gets its parameters this way too).
- Tied layers. A tie group is sharded by its own engine, so its flat layout depends only on the tied module and is
  the same on every owning stage: rank (s, d) holds the same slice on every owning stage s, and the pipeline's
  all-reduce of tied gradients over the owning stages adds matching elements.

Optimizers see full shapes. An optimizer made after sharding would see the shard pieces (1-D slices), so the usual
grouping by ``p.ndim`` (weight decay on matrices only) or by shape would silently put every parameter in one group.
As in ``zstack_zero3`` (DeepSpeed builds its optimizer before partitioning too), the optimizer factory and Lightning's
``configure_optimizers`` run inside ``full_shape_stand_ins()`` (meta-device parameters of the full shapes in the
module's slots) and the optimizer is then re-pointed to the pieces (``attach_optimizer``).

Everything after the schedule keeps its meaning: the data-parallel all-reduce is skipped (the reduce-scatter
averaged already), clipping sums squares over the data-parallel group too (each rank holds a slice), and the
optimizer (built over ``module.parameters()``, which are the shard pieces) steps only this rank's slice. The
engines' step hook (``on_optimizer_step``) runs after each step, so the next batch gathers the new values.

Split backwards (``zb_h1``, ``zbv``). The group's autograd function feeds every parameter of the stage from one node,
which would make each use's weight edge that node and tie all split nodes together (see [Note: how a backward is
split] in ``_backward.py``); with ``split_backward`` each installed parameter gets its own view node, so ``B`` stops
at them and ``W`` runs the gather node's backward (packing, and at the batch's end reduce-scattering). Which backward
reduce-scatters follows the schedule: the rank's last micro-batch to compute weight gradients, its ``W`` when split.

Held-back sums. The backward chosen to reduce-scatter may use nothing of an engine (every parameter of the chunk it
differentiates frozen, under ``zbv``'s two chunks per rank): the sums the earlier backwards held back would then never
be reduced, and the step would apply stale gradients. So once the batch's schedule has run, each engine reduce-scatters
whatever is still held (``ZeroState.flush_unsynced``); every replica of a stage runs the same schedule, so they issue
the same collectives.

What does not combine: tensor parallelism (its layers replace the parameters the engine would shard); it raises in
``PipelineConfig``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from zlightning.pipe._module import PipelineModule
from zlightning.zero import (
    ZeroConfig,
    ZeroState,
    full_optim_state_dict,
    full_state_dict,
    load_full_state_dict,
    zero3_shard,
)
from zlightning.zero import memory_report as zero_memory_report
from zlightning.zero._checkpoint import remap_optimizer
from zlightning.zero._config import Elements
from zlightning.zero._param import ZeroParam

__all__ = ["StageSharding"]

_ALWAYS = Elements(1 << 62)
"""Persistence thresholds above any stage's size: every parameter stays gathered between uses (see the Note)."""


class _LocalLayers(nn.Module):
    """The untied layers of this rank's stages under their layer index, as one module for the ZeRO engine (the
    layers stay registered in the ``PipelineModule`` too; sharding replaces their parameters in place)."""

    def __init__(self, layers: dict[int, nn.Module]) -> None:
        super().__init__()
        for idx, layer in layers.items():
            self.add_module(str(idx), layer)


class StageSharding:
    """The ZeRO engines of one rank's stage(s); see [Note: ZeRO inside a pipeline stage]."""

    def __init__(
        self,
        module: PipelineModule,
        stage: Literal[2, 3],
        group: dist.ProcessGroup | None,
        device: torch.device,
        split_backward: bool = False,
    ) -> None:
        if group is None:
            raise RuntimeError(
                "zero_stage 2/3 in a pipeline needs torch.distributed initialised (the data-parallel group)"
            )
        self.stage = stage
        config = ZeroConfig(
            stage=stage,
            param_persistence_threshold=_ALWAYS,
            model_persistence_threshold=_ALWAYS,
            sync_module_states=False,
            host_cache=False,  # replicas are made identical before sharding
        )
        layers = {
            int(name): m for name, m in module.named_children() if name.isdigit() and any(True for _ in m.parameters())
        }
        self.layers_root = _LocalLayers(layers)
        self.layers: ZeroState | None = None
        if layers:
            self.layers = zero3_shard(
                self.layers_root, config, process_group=group, device=device, unit_policy=_no_units
            )
        self.tied: dict[str, ZeroState] = {
            key: zero3_shard(tied, config, process_group=group, device=device, unit_policy=_no_units)
            for key, tied in sorted(module.tied_modules.items())
        }
        self.group = group
        if split_backward:  # see "Split backwards" in the Note
            for state in self.states:
                state.group_context.separate_grad_edges = True

    @property
    def states(self) -> list[ZeroState]:
        return ([self.layers] if self.layers is not None else []) + [self.tied[k] for k in sorted(self.tied)]

    # ------------------------------------------------------------------------------------------ a batch
    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """One micro-batch's stage forward: the stage's parameters installed (gathered on the first use)."""
        with contextlib.ExitStack() as stack:
            for state in self.states:
                stack.enter_context(state.forward_pass())
            yield

    def set_gradient_sync(self, sync: bool) -> None:
        """Whether the next backward reduce-scatters (the rank's last of the batch) or keeps summing locally."""
        for state in self.states:
            state.gradient_sync = sync

    def flush_gradients(self) -> None:
        """After the batch's backwards: reduce-scatters any sum still held back (see "Held-back sums" in the Note)."""
        for state in self.states:
            state.flush_unsynced()

    def after_step(self) -> None:
        """The shards changed: gathered copies are stale; ZeRO-3 also frees them until the next batch."""
        for state in self.states:
            state.on_optimizer_step()
        self.release()

    def release(self) -> None:
        """ZeRO-3: only the shards stay in memory between batches (ZeRO-2 keeps the gathered buffers)."""
        if self.stage == 3:
            for state in self.states:
                state.release_all(keep_persistent=False)

    # ------------------------------------------------------------------------------------------ optimizers
    @contextlib.contextmanager
    def full_shape_stand_ins(self) -> Iterator[dict[int, ZeroParam]]:
        """Inside the block the stage's parameters are meta-device stand-ins of their full shapes, so an optimizer
        built from ``module.parameters()`` groups them by ``ndim``/shape as in one process; yields what
        ``attach_optimizer`` needs. See "Optimizers see full shapes" in [Note: ZeRO inside a pipeline stage]."""
        with contextlib.ExitStack() as stack:
            stand_ins: dict[int, ZeroParam] = {}
            for state in self.states:
                stand_ins.update(stack.enter_context(state.full_shape_stand_ins()))
            yield stand_ins

    def attach_optimizer(self, optimizer: torch.optim.Optimizer, stand_ins: dict[int, ZeroParam]) -> None:
        """Re-points ``optimizer`` (built over stand-ins or the full parameters) to this rank's shard pieces."""
        for state in self.states:
            remap_optimizer(state, optimizer, stand_ins)

    # ------------------------------------------------------------------------------------------ reports
    def memory_report(self, optimizer: torch.optim.Optimizer | None) -> dict[str, int]:
        """This rank's resident model-state bytes over all its engines (optimizer state counted once)."""
        total: dict[str, int] = {}
        for i, state in enumerate(self.states):
            report = zero_memory_report(state, [optimizer] if optimizer is not None and i == 0 else []).as_dict()
            for k, v in report.items():
                total[k] = total.get(k, 0) + v
        return total

    # ------------------------------------------------------------------------------------------ checkpoints
    def full_layer_states(self) -> dict[int, dict[str, Any]]:
        """Per local untied layer, its full state dict (on data-parallel rank 0; empty elsewhere). Collective."""
        if self.layers is None:
            return {}
        flat = full_state_dict(self.layers, rank0_only=True)
        out: dict[int, dict[str, Any]] = {}
        for key, value in flat.items():
            idx, rest = key.split(".", 1)
            out.setdefault(int(idx), {})[rest] = value
        return out

    def full_state_dict(self) -> dict[str, Any]:
        """This rank's stage(s) as full tensors under the names of a one-stage ``PipelineModule``
        (``"{layer}.{param}"``, ``"tied_modules.{key}.{param}"``), on data-parallel rank 0 (empty elsewhere); layers
        without parameters are not included. Collective over the data-parallel group."""
        out = {f"{idx}.{k}": v for idx, sd in self.full_layer_states().items() for k, v in sd.items()}
        for key in sorted(self.tied):
            out.update({f"tied_modules.{key}.{k}": v for k, v in self.full_tied_state(key).items()})
        return out

    @property
    def layer_ids(self) -> set[int]:
        """Indices of the local layers sharded by the layers' engine."""
        return {int(name) for name, _ in self.layers_root.named_children()}

    def full_tied_state(self, key: str) -> dict[str, Any]:
        """The full state dict of tie group ``key`` (on data-parallel rank 0). Collective."""
        return full_state_dict(self.tied[key], rank0_only=True)

    def load_full(self, layers: dict[int, dict[str, Any]], tied: dict[str, dict[str, Any]]) -> None:
        """Loads full state dicts into the shards (every replica passes the same); gathered copies become stale."""
        if self.layers is not None:
            load_full_state_dict(self.layers, {f"{idx}.{k}": v for idx, sd in layers.items() for k, v in sd.items()})
        for key, sd in tied.items():
            load_full_state_dict(self.tied[key], sd)
        self.release()

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state dict with full-shaped per-parameter state (on data-parallel rank 0). Collective."""
        merged: dict[str, Any] = {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
        pieces = [p for g in optimizer.param_groups for p in g["params"]]
        for state in self.states:
            full = full_optim_state_dict(state, optimizer, rank0_only=True)
            for i, piece in enumerate(pieces):
                if state.zero_param_of(piece) is not None and i in full.get("state", {}):
                    merged["state"][i] = full["state"][i]
        return merged

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, full: dict[str, Any]) -> dict[str, Any]:
        """``full`` (full-shaped per-parameter state, indexed like ``optimizer``) cut to this rank's pieces."""
        pieces = [p for g in optimizer.param_groups for p in g["params"]]
        out: dict[int, dict[str, Any]] = {}
        for i, entry in full["state"].items():
            zp = self._zero_param(pieces[int(i)])
            out[int(i)] = {
                k: zp.local_slice_of(v).clone() if zp is not None and _per_element(v, zp.shape) else v
                for k, v in entry.items()
            }
        return {"state": out, "param_groups": full["param_groups"]}

    def _zero_param(self, piece: torch.Tensor) -> Any:
        for state in self.states:
            zp = state.zero_param_of(piece)
            if zp is not None:
                return zp
        return None


def _no_units(name: str, module: nn.Module) -> bool:
    return False  # all parameters are persistent anyway; see [Note: ZeRO inside a pipeline stage]


def _per_element(value: Any, shape: Sequence[int]) -> bool:
    return isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shape) and value.dim() > 0
