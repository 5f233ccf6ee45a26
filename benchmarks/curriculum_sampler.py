"""Throughput of `DeepSpeedDataSampler` (samples/s) on a 10M-sample value metric, side by side with DeepSpeed's.

    .venv/bin/python benchmarks/curriculum_sampler.py                  # 10M samples; writes curriculum_sampler.*
    .venv/bin/python benchmarks/curriculum_sampler.py --samples 100000 --steps 200 --quick   # smoke test

One metric index (values uniform on 1..1024, written once by `write_metric_index`, read by both samplers: the file
format is DeepSpeed's) and one curriculum: ``fixed_linear`` 64 -> 1024 in steps of 64 over ``steps // 2`` curriculum
steps (16 clusters of ~N/16 samples), global batch ``G = micro_batch * dp * accum``. Each sampler draws ``steps``
global batches one after the other in a fresh process (zlightning's in this process's venv, DeepSpeed 0.19.8's in
``benchmarks/.venv-deepspeed`` over a 1-rank gloo group, when that venv exists; see setup_deepspeed_venv.sh).

[Note: what is timed]
``first_batch_s``: construction and the first global batch (opening the index, the first cluster). ``steady``: the
remaining ``steps - 1`` global batches, cluster creation at each difficulty change and cluster reshuffles included,
as a training run would pay them. Samples/s counts global samples drawn (every zlightning rank computes the whole
global batch, see [Note: no broadcast] in the sampler; DeepSpeed computes it on rank 0 and broadcasts). Both samplers
are timed with ``dp = 1`` so DeepSpeed's per-micro-batch slicing by its process group matches.

Outputs ``benchmarks/results/curriculum_sampler.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DS_PYTHON = BENCH_DIR / ".venv-deepspeed" / "bin" / "python"


def data_efficiency(root: Path, steps: int) -> dict[str, Any]:
    """The shared DeepSpeed ``data_efficiency`` section."""
    metric = {
        "index_to_sample_path": str(root / "len" / "len_index_to_sample"),
        "index_to_metric_path": str(root / "len" / "len_index_to_metric"),
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 64,
        "max_difficulty": 1024,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": max(1, steps // 2), "difficulty_step": 64},
    }
    return {
        "enabled": True,
        "seed": 1,
        "data_sampling": {
            "enabled": True,
            "num_epochs": 1000,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": str(root / "clusters"),
                "curriculum_metrics": {"len": metric},
            },
        },
    }


def time_sampler(sampler_factory: Any, micro_batches: int, accum: int) -> dict[str, float]:
    """Times construction + first global batch, then the rest. See [Note: what is timed]."""
    t0 = time.perf_counter()
    sampler = sampler_factory()
    it = iter(sampler)
    for _ in range(accum):
        next(it)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in itertools.islice(it, micro_batches - accum):
        pass
    return {"first_batch_s": first, "steady_s": time.perf_counter() - t0}


def run_zlightning(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO_ROOT))
    from zlightning.datamodules import DeepSpeedDataSampler

    cfg = data_efficiency(root, args.steps)
    cfg["data_sampling"]["curriculum_learning"]["data_cluster_path"] = str(root / "clusters_zl")
    out = time_sampler(
        lambda: DeepSpeedDataSampler(cfg, args.samples, args.micro_batch, 0, 1, None, args.accum),
        args.steps * args.accum,
        args.accum,
    )
    return out


def run_deepspeed(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """DeepSpeed's sampler in its venv (this script with ``--deepspeed-worker``)."""
    if not DS_PYTHON.exists():
        return {"status": "skipped: benchmarks/.venv-deepspeed missing (run benchmarks/setup_deepspeed_venv.sh)"}
    cmd = [
        str(DS_PYTHON),
        __file__,
        "--deepspeed-worker",
        "--root",
        str(root),
        "--samples",
        str(args.samples),
        "--micro-batch",
        str(args.micro_batch),
        "--accum",
        str(args.accum),
        "--steps",
        str(args.steps),
    ]
    env = {
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "OMP_NUM_THREADS": "1",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"status": f"error (rc {proc.returncode}): {proc.stderr[-2000:]}"}
    return json.loads(lines[-1][7:])


def deepspeed_worker(args: argparse.Namespace) -> None:
    """Runs inside benchmarks/.venv-deepspeed."""
    import deepspeed
    import deepspeed.comm as dist
    import torch.distributed
    from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    deepspeed.init_distributed(dist_backend="gloo")
    root = Path(args.root)
    cfg = get_data_efficiency_config({"data_efficiency": data_efficiency(root, args.steps)})
    group = torch.distributed.group.WORLD
    out = time_sampler(
        lambda: DeepSpeedDataSampler(cfg, args.samples, args.micro_batch, 0, 1, group, args.accum, dist.get_rank()),
        args.steps * args.accum,
        args.accum,
    )
    out["status"] = "ok"
    out["version"] = deepspeed.__version__
    print("RESULT " + json.dumps(out), flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def summarize(args: argparse.Namespace, index_s: float, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    g = args.micro_batch * args.accum
    for r in runs.values():
        if "steady_s" in r:
            r.setdefault("status", "ok")
            r["steady_global_samples_per_s"] = (args.steps - 1) * g / r["steady_s"]
            r["ms_per_global_batch"] = 1e3 * r["steady_s"] / (args.steps - 1)
    report: dict[str, Any] = {
        "benchmark": "curriculum_sampler",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {
            "samples": args.samples,
            "micro_batch": args.micro_batch,
            "dp": 1,
            "accum": args.accum,
            "global_batch": g,
            "steps": args.steps,
            "metric": "uniform 1..1024",
            "schedule": f"fixed_linear 64->1024 step 64 over {max(1, args.steps // 2)} steps",
        },
        "index_build_s": index_s,
        "runs": runs,
    }
    zl, ds = runs.get("zlightning", {}), runs.get("deepspeed", {})
    if "steady_s" in zl and "steady_s" in ds:
        report["speedup_zlightning_vs_deepspeed"] = ds["steady_s"] / zl["steady_s"]
    return report


def markdown(report: dict[str, Any]) -> str:
    c = report["config"]
    lines = [
        f"# Curriculum sampler throughput ({c['samples']:,} samples, global batch {c['global_batch']}, "
        f"{c['steps']} global batches, {c['schedule']})\n",
        f"Index build (`write_metric_index`, once): {report['index_build_s']:.1f} s.\n",
        "| sampler | first global batch (s) | ms / global batch | global samples/s | status |",
        "|---|---:|---:|---:|---|",
    ]
    for name, r in report["runs"].items():
        if "steady_s" in r:
            lines.append(
                f"| {name} | {r['first_batch_s']:.2f} | {r['ms_per_global_batch']:.3f} | "
                f"{r['steady_global_samples_per_s']:,.0f} | {r['status']} |"
            )
        else:
            lines.append(f"| {name} | — | — | — | {r['status'][:200]} |")
    if "speedup_zlightning_vs_deepspeed" in report:
        lines.append(f"\nzlightning / DeepSpeed steady throughput: {report['speedup_zlightning_vs_deepspeed']:.2f}x.")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=10_000_000)
    p.add_argument("--micro-batch", type=int, default=256)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000, help="global batches to draw")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--quick", action="store_true", help="write curriculum_sampler_quick.* (git-ignored)")
    p.add_argument("--deepspeed-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.deepspeed_worker:
        deepspeed_worker(args)
        return 0
    sys.path.insert(0, str(REPO_ROOT))
    import numpy as np
    from zlightning.datamodules.curriculum import write_metric_index

    with tempfile.TemporaryDirectory(prefix="curriculum_sampler_") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_metric_index(root / "len", "len", np.random.default_rng(0).integers(1, 1025, args.samples))
        index_s = time.perf_counter() - t0
        runs = {"zlightning": run_zlightning(args, root)}
        print(">> zlightning", runs["zlightning"], flush=True)
        runs["deepspeed"] = run_deepspeed(args, root)
        print(">> deepspeed", runs["deepspeed"], flush=True)
    report = summarize(args, index_s, runs)
    stem = "curriculum_sampler_quick" if args.quick else "curriculum_sampler"
    out = BENCH_DIR / "results"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / f"{stem}.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
