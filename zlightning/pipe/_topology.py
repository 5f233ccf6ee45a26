"""The DP x PP process grid: pure coordinates (``PipeGrid``) and lazily built process groups (``PipeGroups``).

[Note: rank layout]
As in DeepSpeed's ``PipeDataParallelTopology`` the pipe axis is outermost: ``rank = stage * dp + dp_rank``, so the
data-parallel replicas of one stage are adjacent ranks (on one node, where the gradient all-reduce is heaviest) and
pipeline neighbours are ``dp`` ranks apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["PipeGrid", "PipeGroups"]


@dataclass(frozen=True)
class PipeGrid:
    """Coordinates of ``pp * dp`` ranks. Validated on construction; touches no process group.

    Raises:
        ValueError: a size below 1 or a rank outside the grid.
    """

    pp: int
    """Pipeline ranks (stages per replica when there are no virtual stages)."""
    dp: int = 1
    """Data-parallel replicas."""
    rank: int = 0
    """This process's global rank."""

    def __post_init__(self) -> None:
        for name in ("pp", "dp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipeGrid: {name} must be an int >= 1, got {value!r}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"PipeGrid: rank {self.rank} is outside a grid of {self.pp} stages x {self.dp} replicas")

    @staticmethod
    def from_world(world_size: int, rank: int, num_stages: int) -> PipeGrid:
        """``num_stages`` pipeline ranks and ``world_size // num_stages`` replicas.

        Raises:
            ValueError: ``num_stages`` does not divide ``world_size``.
        """
        if num_stages < 1 or world_size % num_stages:
            raise ValueError(
                f"num_stages={num_stages} must divide the world size {world_size} (the rest is data parallelism); "
                f"pick one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
            )
        return PipeGrid(pp=num_stages, dp=world_size // num_stages, rank=rank)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def stage(self) -> int:
        """This rank's pipeline position."""
        return self.rank // self.dp

    @property
    def dp_rank(self) -> int:
        return self.rank % self.dp

    def global_rank(self, stage: int, dp_rank: int) -> int:
        return stage * self.dp + dp_rank

    def pipe_ranks(self, dp_rank: int) -> list[int]:
        return [self.global_rank(s, dp_rank) for s in range(self.pp)]

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.global_rank(stage, d) for d in range(self.dp)]


@dataclass
class PipeGroups:
    """Process groups of one rank, built by ``build`` (a collective: every rank calls it with the same arguments)."""

    grid: PipeGrid
    pipe: dist.ProcessGroup | None = None
    """This replica's pipeline group (all stages)."""
    data: dist.ProcessGroup | None = None
    """This stage's data-parallel group."""
    tied: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    """Per tie key owned here: the group of this replica's owning stages (None if only this stage owns it)."""
    tied_src: dict[str, int] = field(default_factory=dict)
    """Per tie key owned here: the global rank whose copy is broadcast at start (lowest owning stage)."""

    @staticmethod
    def build(grid: PipeGrid, tie_owners: dict[str, list[int]]) -> PipeGroups:
        """Creates pipe, data and tie groups. ``tie_owners`` maps a tie key to the pipeline ranks owning it.

        Every rank must call ``dist.new_group`` for every group in the same order, so all are created everywhere.
        """
        if not dist.is_initialized():
            if grid.world_size != 1:
                raise RuntimeError(
                    f"a {grid.pp} x {grid.dp} pipeline grid needs torch.distributed initialised "
                    "(dist.init_process_group) before the PipelineEngine is created"
                )
            return PipeGroups(grid, tied_src={k: 0 for k in tie_owners})
        if dist.get_world_size() != grid.world_size:
            raise ValueError(f"PipeGrid covers {grid.world_size} ranks but the process group has {dist.get_world_size()}")
        out = PipeGroups(grid)
        for d in range(grid.dp):
            group = dist.new_group(grid.pipe_ranks(d))
            if d == grid.dp_rank:
                out.pipe = group
        for s in range(grid.pp):
            group = dist.new_group(grid.dp_ranks(s))
            if s == grid.stage:
                out.data = group
        for key in sorted(tie_owners):
            owners = sorted(set(tie_owners[key]))
            for d in range(grid.dp):
                ranks = [grid.global_rank(s, d) for s in owners]
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if grid.rank in ranks:
                    out.tied[key] = group
                    out.tied_src[key] = ranks[0]
        return out
