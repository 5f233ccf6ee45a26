"""Throughput of `DeepSpeedDataSampler` (samples/s) on a synthetic value metric.

    python benchmarks/curriculum_sampler.py --samples 10000000 --micro-batch 32 --dp 8 --accum 4 --steps 2000

Prints the one-off index build, cluster time and steady-state micro-batches/s and samples/s of one rank.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

import numpy as np

from zlightning.datamodules import DeepSpeedDataSampler, write_metric_index


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000, help="global batches to draw")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        values = np.random.default_rng(0).integers(1, 1025, a.samples)
        write_metric_index(Path(tmp) / "len", "len", values)
        t_index = time.perf_counter() - t0
        metric = {
            "index_to_sample_path": f"{tmp}/len/len_index_to_sample",
            "index_to_metric_path": f"{tmp}/len/len_index_to_metric",
            "min_difficulty": 64, "max_difficulty": 1024, "schedule_type": "fixed_linear",
            "schedule_config": {"total_curriculum_step": a.steps // 2, "difficulty_step": 64},
        }
        cfg = {"seed": 1, "data_sampling": {"curriculum_learning": {
            "enabled": True, "data_cluster_path": f"{tmp}/clusters", "curriculum_metrics": {"len": metric}}}}
        s = DeepSpeedDataSampler(cfg, a.samples, a.micro_batch, 0, a.dp, None, a.accum)
        n = a.steps * a.accum
        t0 = time.perf_counter()
        for _ in itertools.islice(iter(s), n):
            pass
        dt = time.perf_counter() - t0
        print(f"N={a.samples:,} b={a.micro_batch} dp={a.dp} accum={a.accum}: index build {t_index:.1f}s, "
              f"{len(s.data_clusters)} clusters")
        print(f"{n / dt:,.0f} micro-batches/s on one rank; {n * a.micro_batch * a.dp / dt:,.0f} global samples/s; "
              f"{dt / a.steps * 1e3:.2f} ms per optimizer step (includes cluster building)")


if __name__ == "__main__":
    main()
