"""`DeepSpeedDataSampler` when global rank 0 is not in every data-parallel group (2 gloo ranks: TP 2 x DP 1).

DeepSpeed broadcasts each global batch from global rank 0 inside the DP group, which fails ("global rank 0 is not
part of group") for the DP group {1}. Here every rank computes the global batch itself from the shared seed, so
tensor-parallel peers get the same data. (DP slicing across ranks: test_curriculum_datamodule, 2 DDP ranks.)
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
from zlightning.datamodules.curriculum import DeepSpeedDataSampler, write_metric_index

from zlightning.testing import run_distributed

N, B, A, TP, DP = 600, 3, 2, 2, 1


def _config(root: str) -> dict[str, Any]:
    metric = {
        "index_to_sample_path": f"{root}/m/m_index_to_sample",
        "index_to_metric_path": f"{root}/m/m_index_to_metric",
        "min_difficulty": 10,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 10},
    }
    return {
        "seed": 9,
        "data_sampling": {
            "num_epochs": 5,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": f"{root}/clusters",
                "curriculum_metrics": {"m": metric},
            },
        },
    }


def _rank(rank: int, world: int, root: str) -> list[tuple[list[int], int]]:
    groups = [dist.new_group([t + TP * d for d in range(DP)]) for t in range(TP)]  # DP groups {0}, {1}
    tp_rank, dp_rank = rank % TP, rank // TP
    group = groups[tp_rank]
    assert (0 in dist.get_process_group_ranks(group)) == (tp_rank == 0)
    s = DeepSpeedDataSampler(_config(root), N, B, dp_rank, DP, group, A, rank)
    return [(mb, s.curriculum_step) for mb in itertools.islice(iter(s), 24)]


def test_dp_groups_without_global_rank_0(tmp_path: Path) -> None:
    write_metric_index(tmp_path / "m", "m", np.random.default_rng(1).integers(1, 101, N))
    out = run_distributed(_rank, TP * DP, str(tmp_path), timeout=180)
    assert out[0] == out[1]  # tensor-parallel peers get the same data, though rank 1's DP group lacks rank 0
    ref = DeepSpeedDataSampler(_config(str(tmp_path)), N, B, 0, DP, None, A)
    for k, (mb, step) in enumerate(out[1]):
        if k % A == 0:
            ref.get_next_global_batch()
            glob = ref.batch
        assert step == ref.curriculum_step and mb == glob[(k % A) * B : (k % A + 1) * B]
