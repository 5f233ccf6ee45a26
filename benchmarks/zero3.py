"""Side-by-side ZeRO-3 benchmark on CPU: Lightning DDP, raw FSDP2, DeepSpeed ZeRO-3 and zlightning's zstack_zero3.

Run it with ``make bench`` (``.venv/bin/python benchmarks/zero3.py``); ``--quick`` runs 1 warm-up + 2 timed steps.

Every variant trains the same GPT (``examples.gpt_model``: d_model 512, 6 layers, 8 heads, vocabulary 256) on the
same random byte tokens (sequence 256, micro-batch 8 per rank) with torch AdamW (lr 1e-4) in fp32, on 2 ranks over
gloo with 1 thread each. Each run of a variant is 2 fresh processes started here (rank workers: ``_zero3_worker.py``
in this venv, ``_deepspeed_worker.py`` in ``benchmarks/.venv-deepspeed``), under a timeout. A variant that fails or
times out is recorded as such; zstack_zero3 failing (for example because ``zlightning`` does not register it yet) is
recorded as "unavailable: <reason>". The others still run.

[Note: interleaved repeats]
The machine is shared, so its load drifts over minutes: variants run back to back once each would compare
different machines. Every variant therefore runs ``--repeats`` times (default 3), interleaved: repetition ``k`` runs
all variants, starting one further along the list each time (so no variant always follows the same neighbour).
A variant's step time is the median of its runs' medians, and its ratio to DDP is the median of the per-repetition
ratios (each taken between runs minutes apart, not across the whole benchmark). Every run's median and the load
average when it started are in the JSON, so a noisy repetition is visible.

Outputs (``--quick`` writes ``zero3_quick.*`` instead, so it never overwrites a full run):
  * ``benchmarks/results/zero3.json``: config, machine, per-variant and per-rank numbers, ratios;
  * ``benchmarks/results/zero3.md``: the Markdown table, also printed at the end;
  * ``benchmarks/results/zero3_<variant>_rank<k>.log``: each rank's stdout and stderr (git-ignored).

How step time and model-state bytes are defined: ``_bench_common.py`` ([Note: what a step time is],
[Note: counting model-state bytes]) and ``_deepspeed_worker.py`` ([Note: what DeepSpeed model state is counted]).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _bench_common import REPO_ROOT, BenchConfig, build_model, full_model_state_bytes  # noqa: E402

VARIANTS: tuple[str, ...] = ("ddp", "fsdp2", "deepspeed", "zstack_zero3", "zstack_zero3_keep", "zstack_zero3_lowmem")
"""Benchmark variants, in the order they run; ``ddp`` is the baseline of the ratios."""

DEEPSPEED_VENV = BENCH_DIR / ".venv-deepspeed"
SETUP_SCRIPT = BENCH_DIR / "setup_deepspeed_venv.sh"
FAILURE_GRACE_S = 30.0
"""After one rank fails, how long the others get to exit on their own (they usually die on a broken collective)."""
MB = 1_000_000


@dataclass(kw_only=True)
class VariantOutcome:
    """What one variant produced: per-rank results, or why there are none."""

    variant: str
    """Name from `VARIANTS`."""
    status: str
    """"ok", "failed: <reason>", "timed out after <s> s" or "unavailable: <reason>"."""
    wall_s: float
    """Wall time of the whole variant, including process start-up and model construction."""
    ranks: list[dict[str, Any]] = field(default_factory=list)
    """One result per rank (see the workers), sorted by rank; empty unless every rank succeeded."""
    repetition: int = 0
    """Which interleaved repetition this run belongs to (see [Note: interleaved repeats])."""
    loadavg: list[float] = field(default_factory=list)
    """1, 5 and 15-minute load averages when the run started."""


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(variant: str, deepspeed_python: Path) -> list[str]:
    """The interpreter and script that run one rank of ``variant``."""
    if variant == "deepspeed":
        return [str(deepspeed_python), str(BENCH_DIR / "_deepspeed_worker.py")]
    return [sys.executable, str(BENCH_DIR / "_zero3_worker.py")]


def rank_environ(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    """The environment of one rank: the torchrun-style rendezvous variables and pinned thread counts."""
    env = dict(os.environ)
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
    )
    env.pop("VIRTUAL_ENV", None)  # the DeepSpeed venv's python must not believe it runs in this one
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """Kills a rank and everything it started (it leads its own process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def _wait_ranks(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> str:
    """Waits for all ranks; returns "ok", or the failure, after killing whatever is left."""
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_S):
            break
        time.sleep(0.2)
    timed_out = any(p.poll() is None for p in procs) and time.monotonic() > deadline
    for p in procs:
        _kill_group(p)
    if timed_out:
        return f"timed out after {timeout_s:.0f} s"
    codes = [p.returncode for p in procs]
    return "ok" if all(c == 0 for c in codes) else f"exit codes {codes}"


def run_variant(variant: str, config: BenchConfig, args: argparse.Namespace) -> VariantOutcome:
    """Runs ``variant`` once in ``config.world_size`` fresh processes and collects their ``rank<k>.json``."""
    load = [round(x, 2) for x in os.getloadavg()]
    outcome = _run_variant_once(variant, config, args)
    outcome.loadavg = load
    return outcome


def _run_variant_once(variant: str, config: BenchConfig, args: argparse.Namespace) -> VariantOutcome:
    start = time.monotonic()
    cmd = worker_command(variant, args.deepspeed_python)
    if not Path(cmd[0]).exists():
        return VariantOutcome(
            variant=variant, status=f"unavailable: {cmd[0]} not found; run {SETUP_SCRIPT}", wall_s=0.0
        )
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix=f"zero3_{variant}_") as tmp:
        out_dir = Path(tmp)
        procs = []
        for rank in range(config.world_size):
            log_path = args.out_dir / f"{args.stem}_{variant}_rank{rank}.log"
            with open(log_path, "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [*cmd, "--variant", variant, "--config", config.to_json(), "--out", str(out_dir)],
                        cwd=REPO_ROOT,
                        env=rank_environ(rank, config.world_size, port, config.threads),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        status = _wait_ranks(procs, args.timeout)
        ranks = [_read_rank(out_dir, rank) for rank in range(config.world_size)]
    errors = _rank_errors(ranks)
    if status == "ok" and not errors:
        return VariantOutcome(variant=variant, status="ok", wall_s=time.monotonic() - start, ranks=ranks)
    reason = "; ".join(errors) if errors else status
    if not status.startswith("timed out"):
        reason = f"failed: {reason}" if not variant.startswith("zstack_zero3") else f"unavailable: {reason}"
    return VariantOutcome(variant=variant, status=reason, wall_s=time.monotonic() - start)


def _rank_errors(ranks: list[dict[str, Any]]) -> list[str]:
    """The failed ranks' errors, with an error shared by several ranks written once ("ranks 0, 1: ...")."""
    by_error: dict[str, list[int]] = {}
    for r in ranks:
        if r.get("status") != "ok":
            by_error.setdefault(str(r.get("error")), []).append(r["rank"])
    return [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {err}" for err, rs in by_error.items()]


def _read_rank(out_dir: Path, rank: int) -> dict[str, Any]:
    path = out_dir / f"rank{rank}.json"
    if not path.exists():
        return {"rank": rank, "status": "error", "error": "no result file (killed or crashed; see its log)"}
    return json.loads(path.read_text())


def ensure_deepspeed_venv(args: argparse.Namespace) -> None:
    """Creates the DeepSpeed venv with ``setup_deepspeed_venv.sh`` when it is missing (unless told not to)."""
    custom_python = args.deepspeed_python.parent.parent != DEEPSPEED_VENV
    if args.deepspeed_python.exists() or args.skip_deepspeed_setup or custom_python:
        return
    print(f">> {DEEPSPEED_VENV} is missing: running {SETUP_SCRIPT} (downloads DeepSpeed from PyPI once)", flush=True)
    rc = subprocess.call(["bash", str(SETUP_SCRIPT)], cwd=REPO_ROOT)
    if rc != 0:
        print(f">> {SETUP_SCRIPT} failed with exit code {rc}; the deepspeed variant will be unavailable", flush=True)


def machine_info() -> dict[str, Any]:
    """CPU model, core count, memory, OS and interpreter of this machine."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "hostname": socket.gethostname(),
    }
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        info["cpu_model"] = next(
            (ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), None
        )
        meminfo = Path("/proc/meminfo").read_text().split()
        info["mem_total_gib"] = round(int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20, 1)
    except (OSError, ValueError, StopIteration):
        pass
    try:
        info["git_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        info["git_commit"] = None
    return info


def summarize(outcomes: list[VariantOutcome], full: dict[str, int]) -> list[dict[str, Any]]:
    """Per-variant, per-rank numbers over the variant's runs, and their ratios to DDP (same rank) and to the full
    model state (see [Note: interleaved repeats])."""
    ddp_runs = {o.repetition: o for o in outcomes if o.variant == "ddp" and o.status == "ok"}
    rows = []
    for variant in dict.fromkeys(o.variant for o in outcomes):
        runs = [o for o in outcomes if o.variant == variant]
        ok = [o for o in runs if o.status == "ok"]
        entry: dict[str, Any] = {
            "variant": variant,
            "status": "ok" if ok else runs[-1].status,
            "runs": len(runs),
            "runs_ok": len(ok),
            "wall_s": round(sum(o.wall_s for o in runs), 2),
            "ranks": [],
            "run_status": [o.status for o in runs],
            "run_loadavg": [o.loadavg for o in runs],
        }
        for rank in range(len(ok[0].ranks) if ok else 0):
            per_run = [statistics.median(o.ranks[rank]["step_times_s"]) for o in ok]
            paired = [
                statistics.median(o.ranks[rank]["step_times_s"])
                / statistics.median(ddp_runs[o.repetition].ranks[rank]["step_times_s"])
                for o in ok
                if o.repetition in ddp_runs
            ]
            r = ok[-1].ranks[rank]
            state = r["memory"]["model_state_bytes"]
            entry["ranks"].append(
                {
                    "rank": rank,
                    "median_step_s": statistics.median(per_run),
                    "runs_median_step_s": per_run,
                    "step_time_x_ddp": statistics.median(paired) if paired else None,
                    "runs_step_time_x_ddp": paired,
                    "model_state_bytes": state,
                    "model_state_fraction_of_full": state / full["model_state_bytes"],
                    "peak_rss_kib": max(o.ranks[rank]["peak_rss_kib"] for o in ok),
                    "rss_before_train_kib": r.get("rss_before_train_kib"),
                    "memory": r["memory"],
                    "step_times_s": r["step_times_s"],
                    "losses": r["losses"],
                    "threads": r.get("threads"),
                    "versions": r.get("versions"),
                }
            )
        rows.append(entry)
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table, one line per variant and rank (MB = 10^6 bytes; RSS from KiB)."""
    lines = [
        "| variant | step time (s) (each run's median) | × DDP | model-state MB/rank | ÷ full model | peak RSS MB/rank |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if not row["ranks"]:
            lines.append(f"| {row['variant']} | {row['status']} | — | — | — | — |")
            continue
        for r in row["ranks"]:
            ratio = "—" if r["step_time_x_ddp"] is None else f"{r['step_time_x_ddp']:.2f}"
            runs = ", ".join(f"{x:.2f}" for x in r.get("runs_median_step_s", []))
            lines.append(
                f"| {row['variant']} (rank {r['rank']}) | {r['median_step_s']:.3f} ({runs}) | {ratio} | "
                f"{r['model_state_bytes'] / MB:.1f} | {r['model_state_fraction_of_full']:.3f} | "
                f"{r['peak_rss_kib'] * 1024 / MB:.0f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=3, help="untimed warm-up steps (default 3)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 2 timed steps; writes zero3_quick.*")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="subset to run, in this order (default: all)",
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run of a variant (default 900)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs of every variant, interleaved (default 3; see [Note: interleaved repeats])",
    )
    parser.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    parser.add_argument("--deepspeed-python", type=Path, default=DEEPSPEED_VENV / "bin" / "python")
    parser.add_argument(
        "--skip-deepspeed-setup",
        action="store_true",
        help=f"do not run {SETUP_SCRIPT.name} when the DeepSpeed venv is missing",
    )
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.repeats = 1, 2, 1
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    args.stem = "zero3_quick" if args.quick else "zero3"
    return args


def main() -> int:
    args = parse_args()
    config = BenchConfig(warmup_steps=args.warmup, timed_steps=args.steps)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if "deepspeed" in args.variants:
        ensure_deepspeed_venv(args)
    import torch

    with torch.device("meta"):
        full = full_model_state_bytes(build_model(config))
    outcomes = []
    for repetition in range(args.repeats):  # see [Note: interleaved repeats]
        shift = repetition % len(args.variants)
        for variant in args.variants[shift:] + args.variants[:shift]:
            print(
                f">> [{repetition + 1}/{args.repeats}] {variant}: {config.world_size} ranks, {config.warmup_steps} "
                f"warm-up + {config.timed_steps} timed steps (timeout {args.timeout:.0f} s), load "
                f"{os.getloadavg()[0]:.1f}",
                flush=True,
            )
            outcome = run_variant(variant, config, args)
            outcome.repetition = repetition
            print(f">> {variant}: {outcome.status} ({outcome.wall_s:.1f} s)", flush=True)
            outcomes.append(outcome)
    rows = summarize(outcomes, full)
    report = {
        "benchmark": "zero3",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(config),
        "optimizer": {"name": "torch.optim.AdamW", "lr": config.lr, "precision": "fp32"},
        "full_model": full,
        "machine": {**machine_info(), "torch_main_venv": torch.__version__},
        "repeats": args.repeats,
        "definitions": {
            "median_step_s": "median over the variant's runs of each run's median wall time between consecutive "
            "optimizer-step ends over the timed steps (runs interleaved with the other variants)",
            "step_time_x_ddp": "median over repetitions of (this run's median step / DDP's run in the same repetition)",
            "model_state_bytes": "params + grads + optimizer state resident on the rank after the last step, "
            "distinct storages (see benchmarks/_bench_common.py)",
            "model_state_fraction_of_full": "model_state_bytes / (4 x unsharded fp32 param bytes)",
            "peak_rss_kib": "ru_maxrss of the rank process (KiB)",
        },
        "variants": rows,
    }
    (args.out_dir / f"{args.stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown_table(rows)
    loads = [o.loadavg[0] for o in outcomes if o.loadavg]
    header = (
        f"# ZeRO-3 benchmark ({config.world_size} CPU ranks, gloo, {config.threads} thread each; "
        f"{config.warmup_steps} warm-up + {config.timed_steps} timed steps; every variant {args.repeats} "
        f"times, interleaved: medians of the runs)\n\n"
        f"Load average (1 min) when runs started: {min(loads, default=0):.1f} to {max(loads, default=0):.1f}."
        " Ratios to DDP are medians of per-repetition ratios.\n\n"
        f"Full fp32 model state (params + grads + 2 AdamW moments): {full['model_state_bytes'] / MB:.1f} MB "
        f"({full['params']:,} parameters). MB = 10^6 bytes.\n\n"
    )
    (args.out_dir / f"{args.stem}.md").write_text(header + table)
    from _plots import write_png  # matplotlib is optional: without it, one line says no chart was drawn

    write_png("zero3", report, args.out_dir / f"{args.stem}.png")
    print()
    print(table, end="")
    return 0 if any(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
