"""Process-group helpers shared by the strategies (data-parallel groups under tensor parallelism)."""

from __future__ import annotations

import torch

__all__ = ["metrics_to_group"]


def metrics_to_group(module: torch.nn.Module, group: torch.distributed.ProcessGroup) -> None:
    """Points the torchmetrics metrics of ``module`` that sync over the world (``process_group=None``) at the
    data-parallel group: pipeline stages and TP peers of one replica update them with the same batches, so a
    world-wide sync would count each data-parallel replica once per such rank."""
    from torchmetrics import Metric

    for metric in module.modules():
        if isinstance(metric, Metric) and metric.process_group is None:
            metric.process_group = group
