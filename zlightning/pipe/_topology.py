"""The PP x DP x TP process grid: pure coordinates (``PipeGrid``) and lazily built process groups (``PipeGroups``).

[Note: rank layout]
As in DeepSpeed's ``PipeDataParallelTopology`` the pipe axis is outermost and, as in Megatron, the tensor-parallel
axis innermost: ``rank = (stage * dp + dp_rank) * tp + tp_rank``. TP peers (an all-reduce in every layer's forward
and backward) are adjacent ranks, the data-parallel replicas of one stage come next (one gradient all-reduce per
batch), and pipeline neighbours are ``dp * tp`` ranks apart. Rank ``(s, d, t)`` exchanges activations with
``(s +- 1, d, t)``: after a row-parallel layer every TP rank holds the full activation, so each TP rank sends and
receives its own copy (no scatter/gather across the TP group at stage boundaries). With ``tp = 1`` this is the
DP x PP layout ``rank = stage * dp + dp_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from zlightning._threads import small_thread_stacks

__all__ = ["PipeGrid", "PipeGroups"]


@dataclass(frozen=True)
class PipeGrid:
    """Coordinates of ``pp * dp * tp`` ranks. Validated on construction; touches no process group.

    Raises:
        ValueError: a size below 1 or a rank outside the grid.
    """

    pp: int
    """Pipeline ranks (stages per replica when there are no virtual stages)."""
    dp: int = 1
    """Data-parallel replicas."""
    rank: int = 0
    """This process's global rank."""
    tp: int = 1
    """Tensor-parallel ranks per stage replica (innermost axis; see [Note: rank layout])."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipeGrid: {name} must be an int >= 1, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"PipeGrid: rank {self.rank} is outside a grid of {self.pp} stages x {self.dp} replicas x {self.tp} "
                "tensor-parallel ranks"
            )

    @staticmethod
    def from_world(world_size: int, rank: int, num_stages: int, tensor_parallel_size: int = 1) -> PipeGrid:
        """``num_stages`` pipeline ranks, ``tensor_parallel_size`` TP ranks and ``world_size // (num_stages * tp)``
        replicas.

        Raises:
            ValueError: ``num_stages * tensor_parallel_size`` does not divide ``world_size``.
        """
        tp = tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
            raise ValueError(
                f"tensor_parallel_size={tp!r} must be an int >= 1 dividing the world size {world_size}; "
                f"pick one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
        per_tp = world_size // tp
        if num_stages < 1 or per_tp % num_stages:
            raise ValueError(
                f"num_stages={num_stages} must divide the world size {world_size}"
                + (f" / tensor_parallel_size {tp} = {per_tp}" if tp > 1 else "")
                + f" (the rest is data parallelism); pick one of {[d for d in range(1, per_tp + 1) if per_tp % d == 0]}"
            )
        return PipeGrid(pp=num_stages, dp=per_tp // num_stages, rank=rank, tp=tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def stage(self) -> int:
        """This rank's pipeline position."""
        return self.rank // (self.dp * self.tp)

    @property
    def dp_rank(self) -> int:
        return (self.rank // self.tp) % self.dp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def global_rank(self, stage: int, dp_rank: int, tp_rank: int = 0) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    def pipe_ranks(self, dp_rank: int, tp_rank: int = 0) -> list[int]:
        """The ranks of one pipeline (every stage) at data-parallel index ``dp_rank`` and TP index ``tp_rank``."""
        return [self.global_rank(s, dp_rank, tp_rank) for s in range(self.pp)]

    def dp_ranks(self, stage: int, tp_rank: int = 0) -> list[int]:
        """The data-parallel replicas of ``stage`` holding TP slice ``tp_rank``."""
        return [self.global_rank(stage, d, tp_rank) for d in range(self.dp)]

    def tp_ranks(self, stage: int, dp_rank: int) -> list[int]:
        """The tensor-parallel peers of ``stage`` in replica ``dp_rank`` (adjacent ranks)."""
        return [self.global_rank(stage, dp_rank, t) for t in range(self.tp)]


@dataclass
class PipeGroups:
    """Process groups of one rank, built by ``build`` (a collective: every rank calls it with the same arguments)."""

    grid: PipeGrid
    pipe: dist.ProcessGroup | None = None
    """This replica's pipeline group (all stages)."""
    data: dist.ProcessGroup | None = None
    """This stage's data-parallel group (replicas holding the same TP slice)."""
    tensor: dist.ProcessGroup | None = None
    """This stage replica's tensor-parallel group (None when ``tp == 1``)."""
    tied: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    """Per tie key owned here: the group of this replica's owning stages at this TP index (None if only this stage
    owns it)."""
    tied_src: dict[str, int] = field(default_factory=dict)
    """Per tie key owned here: the global rank whose copy is broadcast at start (lowest owning stage)."""

    @staticmethod
    @small_thread_stacks(
        backend=None
    )  # every gloo group starts threads: see [Note: thread stacks count against a data limit]
    def build(grid: PipeGrid, tie_owners: dict[str, list[int]]) -> PipeGroups:
        """Creates pipe, data and tie groups. ``tie_owners`` maps a tie key to the pipeline ranks owning it.

        Every rank must call ``dist.new_group`` for every group in the same order, so all are created everywhere.
        """
        if not dist.is_initialized():
            if grid.world_size != 1:
                raise RuntimeError(
                    f"a {grid.pp} x {grid.dp} x {grid.tp} pipeline grid needs torch.distributed initialised "
                    "(dist.init_process_group) before the PipelineEngine is created"
                )
            return PipeGroups(grid, tied_src={k: 0 for k in tie_owners})
        if dist.get_world_size() != grid.world_size:
            raise ValueError(
                f"PipeGrid covers {grid.world_size} ranks but the process group has {dist.get_world_size()}"
            )
        out = PipeGroups(grid)
        me = (grid.stage, grid.dp_rank, grid.tp_rank)
        for d in range(grid.dp):
            for t in range(grid.tp):
                group = dist.new_group(grid.pipe_ranks(d, t))
                if (d, t) == me[1:]:
                    out.pipe = group
        for s in range(grid.pp):
            for t in range(grid.tp):
                group = dist.new_group(grid.dp_ranks(s, t))
                if (s, t) == (me[0], me[2]):
                    out.data = group
        if grid.tp > 1:
            for s in range(grid.pp):
                for d in range(grid.dp):
                    group = dist.new_group(grid.tp_ranks(s, d))
                    if (s, d) == me[:2]:
                        out.tensor = group
        for key in sorted(tie_owners):
            owners = sorted(set(tie_owners[key]))
            for d in range(grid.dp):
                for t in range(grid.tp):
                    ranks = [grid.global_rank(s, d, t) for s in owners]
                    group = dist.new_group(ranks) if len(ranks) > 1 else None
                    if grid.rank in ranks:
                        out.tied[key] = group
                        out.tied_src[key] = ranks[0]
        return out
