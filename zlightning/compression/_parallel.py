"""Compression of tensor-parallel layers: DeepSpeed's ``mpu`` argument, honoured where it matters.

[Note: compression under tensor parallelism]
``init_compression(model, deepspeed_config, teacher_model=None, mpu=None)`` takes Megatron's model-parallel unit as
DeepSpeed does: ``mpu.get_model_parallel_world_size/rank/group`` (or Megatron-core's ``get_tensor_model_parallel_*``)
and its layer classes ``mpu.ColumnParallelLinear`` / ``mpu.RowParallelLinear``, whose instances become compressible
(``weight`` is this rank's shard; Megatron's attribute names ``input_size``, ``output_size``,
``output_size_per_partition``, ``input_size_per_partition``, ``gather_output``, ``input_is_parallel``,
``skip_bias_add``; ``forward`` returns ``(output, output_bias)``). With one model-parallel rank those layers hold
their whole weight and take every technique a plain ``nn.Linear`` takes. With more, two techniques act on split
layers, where the split decides what a unit is:

* *Row pruning of a column-parallel layer* (its output rows are split): each rank scores and keeps
  ``ceil(dense_ratio * local_rows)`` of its own rows, so every shard keeps the same count and cleaning can slice every
  rank alike (a global top-k could keep more rows on one rank than another, which no split layer can hold). The
  related row-parallel layer loses the matching local input columns.
* *Head pruning of a row-parallel attention output projection* (its input columns, i.e. the heads, are split): the
  configured ``num_heads`` is the model's head count and each rank holds ``num_heads / world_size`` of them (read from
  the parent's ``num_attention_heads_per_partition`` when the config has no ``num_heads``); each rank keeps
  ``ceil(dense_ratio * local_heads)``. Related column-parallel Q/K/V (or fused QKV) layers lose those heads' rows,
  grouped head by head as Megatron lays them out (``[head][q, k, v][dim]`` for a fused QKV). Cleaning updates the
  per-partition and global sizes and head counts.

Any other technique on a split layer, row pruning of a row-parallel layer, head pruning of a column-parallel one and
sequence-parallel layers are refused with an error naming the layer: their per-shard result would differ from the
unsplit model in ways a user did not ask for (for example quantization groups that straddle shards). Compress the
unsplit model first, or exclude the layer with a narrower regex. Replicated (unsplit) layers compress as without
``mpu``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zlightning.inject._collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = ["SPLIT_TECHNIQUES", "ModelParallelUnit", "TensorParallel", "parallel_forward"]

SplitKind = Literal["column", "row"]

SPLIT_TECHNIQUES: dict[str, SplitKind] = {"row_pruning": "column", "head_pruning": "row"}
"""Techniques allowed on split layers, and the split each needs. See [Note: compression under tensor parallelism]."""


class ModelParallelUnit(Protocol):
    """What is read of Megatron's ``mpu`` (Megatron-core's ``get_tensor_model_parallel_*`` names also work)."""

    def get_model_parallel_world_size(self) -> int: ...

    def get_model_parallel_rank(self) -> int: ...

    def get_model_parallel_group(self) -> Any: ...


def _call(mpu: Any, what: str) -> Any:
    for name in (f"get_model_parallel_{what}", f"get_tensor_model_parallel_{what}"):
        fn = getattr(mpu, name, None)
        if callable(fn):
            return fn()
    raise TypeError(
        f"mpu ({type(mpu).__name__}) has neither get_model_parallel_{what}() nor get_tensor_model_parallel_{what}(); "
        f"pass Megatron's mpu (megatron.mpu or megatron.core.parallel_state) or None."
    )


@dataclass(frozen=True)
class TensorParallel:
    """The model-parallel layout read from an ``mpu`` with more than one rank."""

    world_size: int
    """Ranks a split layer is split over."""
    rank: int
    """This process's rank among them."""
    group: Any
    """The model-parallel process group (collectives of split layers run on it)."""
    column_types: tuple[type[nn.Module], ...]
    """``mpu.ColumnParallelLinear`` (output rows split), if the mpu names it."""
    row_types: tuple[type[nn.Module], ...]
    """``mpu.RowParallelLinear`` (input columns split), if the mpu names it."""

    @staticmethod
    def from_mpu(mpu: Any) -> TensorParallel | None:
        """The layout of ``mpu``, or None when ``mpu`` is None.

        Raises:
            TypeError: If ``mpu`` lacks the model-parallel size, rank or group accessors.
            ValueError: If its size or rank is not an int in range.
        """
        if mpu is None:
            return None
        world, rank = _call(mpu, "world_size"), _call(mpu, "rank")
        if not isinstance(world, int) or not isinstance(rank, int) or world < 1 or not 0 <= rank < world:
            raise ValueError(
                f"mpu reports model-parallel world size {world!r} and rank {rank!r}; expected ints with "
                f"0 <= rank < world size."
            )
        types = {k: getattr(mpu, f"{k.capitalize()}ParallelLinear", None) for k in ("column", "row")}
        return TensorParallel(
            world, rank, _call(mpu, "group"), *(((t,) if isinstance(t, type) else ()) for t in types.values())
        )

    @property
    def split_types(self) -> tuple[type[nn.Module], ...]:
        return self.column_types + self.row_types

    def kind(self, module: nn.Module) -> SplitKind | None:
        """How ``module`` is split (None: a replicated module)."""
        if isinstance(module, self.column_types):
            return "column"
        if isinstance(module, self.row_types):
            return "row"
        return None

    def check(self, technique: str, name: str, module: nn.Module) -> None:
        """Refuses a technique this module's split does not allow. See [Note: compression under tensor parallelism].

        Raises:
            ValueError: Naming the layer, its split and what is allowed.
        """
        kind = self.kind(module)
        if kind is None or self.world_size == 1:
            return
        if getattr(module, "sequence_parallel", False) or getattr(module, "sequence_parallel_enabled", False):
            raise ValueError(
                f"{technique}: {name!r} is a sequence-parallel layer; compressing it under mpu is not "
                "supported. Compress the model before splitting it, or narrow the module regexes."
            )
        if SPLIT_TECHNIQUES.get(technique) != kind:
            allowed = [t for t, k in SPLIT_TECHNIQUES.items() if k == kind]
            raise ValueError(
                f"{technique}: {name!r} is a {kind}-parallel layer split over {self.world_size} model-parallel ranks; "
                f"on it only {allowed} can act shard by shard like the unsplit model (see [Note: compression under "
                f"tensor parallelism] in zlightning.compression._parallel). Compress the model before splitting it, "
                f"or narrow the module regexes to leave {name!r} out."
            )

    def local_heads(self, num_heads: int, name: str) -> int:
        """Heads of ``num_heads`` (the model's count) held by one rank.

        Raises:
            ValueError: If ``num_heads`` is not divisible by the model-parallel world size.
        """
        if num_heads % self.world_size:
            raise ValueError(
                f"head_pruning: num_heads={num_heads} is not divisible by the {self.world_size} "
                f"model-parallel ranks {name!r} is split over; set num_heads to the model's head count."
            )
        return num_heads // self.world_size


def parallel_forward(
    module: Any, kind: SplitKind, group: Any, world_size: int, x: Tensor, w: Tensor, b: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Megatron's split-linear forward with the compressed ``(w, b)``; returns ``(output, output_bias)``. With one
    model-parallel rank no collective runs (as Megatron's layers bypass them)."""
    skip = bool(getattr(module, "skip_bias_add", False))
    split = world_size > 1
    if kind == "column":
        y = F.linear(copy_to_tp(x, group) if split else x, w, None if skip else b)
        if split and getattr(module, "gather_output", False):
            y = gather_from_tp(y, group)
        return y, (b if skip else None)
    if split and not getattr(module, "input_is_parallel", False):
        x = scatter_to_tp(x, group)
    y = F.linear(x, w)
    y = reduce_from_tp(y, group) if split else y
    if skip or b is None:
        return y, (b if skip else None)
    return y + b, None


def update_split_sizes(module: nn.Module, dim: int, kept: int, world_size: int) -> None:
    """After slicing a split layer on ``dim`` (0 = output rows, 1 = input columns) to ``kept`` local entries, sets
    Megatron's per-partition and global size attributes (every rank keeps the same count)."""
    names = ("output_size_per_partition", "output_size") if dim == 0 else ("input_size_per_partition", "input_size")
    split = (dim == 0 and hasattr(module, "output_size_per_partition")) or (
        dim == 1 and hasattr(module, "input_size_per_partition")
    )
    if split:
        setattr(module, names[0], kept)
        setattr(module, names[1], kept * world_size)
    elif hasattr(module, names[1]):
        setattr(module, names[1], kept)


def check_group_size(tp: TensorParallel) -> None:
    """The mpu's group must have ``world_size`` ranks (a local query)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(tp.group) != tp.world_size:
        raise ValueError(
            f"mpu reports {tp.world_size} model-parallel ranks but its group has "
            f"{dist.get_world_size(tp.group)}; pass a consistent mpu."
        )
