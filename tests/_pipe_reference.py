"""The single-process reference the pipeline tests compare against."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from zlightning.pipe import PipelineModule


def one_process_losses(
    pipe: PipelineModule, optimizer: torch.optim.Optimizer, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> list[float]:
    """Trains the built ``pipe`` in this process, one optimizer step per ``(x, y)`` batch; the losses."""
    losses = []
    for x, y in batches:
        loss = pipe.compute_loss(pipe(x), y)
        losses.append(float(loss))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return losses
