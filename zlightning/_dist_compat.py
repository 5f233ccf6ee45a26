"""Collectives under the names of the pinned torch, on older torch too.

torch 2.13 (the pinned version) names the one-tensor collectives ``all_gather_single`` / ``reduce_scatter_single``
and warns on the older ``all_gather_into_tensor`` / ``reduce_scatter_tensor``. GPU machines often carry an older
torch (``make gpu-check`` installs this tree into the machine's own CUDA torch with ``--no-deps``), where only the
older names exist. Both pairs take the same arguments.
"""

from __future__ import annotations

import torch.distributed as dist

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = ["all_gather_single", "reduce_scatter_single"]
