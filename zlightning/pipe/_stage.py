"""``PipelineStage``: this rank's part of a pipeline, the model chunk(s) it runs and the state that runs them.

[Note: stage, engine and module]
As in ``torch.distributed.pipelining`` (``PipelineStage`` versus ``Schedule*``) the work is split three ways. The
``PipelineModule`` describes the model (layer specs, partitioning, lazy building) and applies its layers; it knows
neither ranks nor schedules. A ``PipelineStage`` owns one rank's share: the chunk ids built on this rank, its
pipeline index and peers, the point-to-point channel and its receive buffers, and the ZeRO-2/3 engines that gather
the chunk's parameters around every run of its layers (recomputation included). ``BatchRun`` (``_executor.py``)
interprets a lowered schedule against a stage, and ``PipelineEngine`` builds the stage and drives it batch by batch
(reductions, clipping, the optimizer step). Dependencies point down: engine -> executor -> stage -> module.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zlightning.pipe._module import PipelineModule
from zlightning.pipe._p2p import P2P
from zlightning.pipe._zero import StageSharding

__all__ = ["PipelineStage"]


@dataclass(eq=False)
class PipelineStage:
    """One rank's model chunk(s) and the state to run them; see [Note: stage, engine and module]."""

    module: PipelineModule
    """The model, built for this rank's chunks only (``module.local_stages``)."""
    rank: int
    """This rank's pipeline index."""
    peers: list[int]
    """Global rank of each pipeline index of this rank's pipe group."""
    p2p: P2P
    """Activation and gradient transfers with the neighbouring stages (and their receive buffers)."""
    device: torch.device
    """Where the chunks' layers live."""
    zero: StageSharding | None = None
    """ZeRO-2/3 engines of the chunks (see [Note: ZeRO inside a pipeline stage] in ``_zero.py``); None otherwise."""

    @property
    def chunks(self) -> tuple[int, ...]:
        """The global stage ids built on this rank (more than one with virtual stages or ``zbv``)."""
        return self.module.local_stages

    def layers(self, chunk: int) -> range:
        """Indices of the layers of stage ``chunk``."""
        return self.module.stage_layers(chunk)

    def forward(self, chunk: int, x: Any) -> Any:
        """Applies the layers of stage ``chunk`` to ``x``; under ZeRO-2/3 with the chunk's parameters gathered."""
        return self.module.run_stage(chunk, x, context=self.zero.forward_pass if self.zero is not None else None)

    def compute_loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        """The model's loss of the last stage's ``outputs`` (a scalar tensor)."""
        return self.module.compute_loss(outputs, labels)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()
