"""ZeRO-3 memory as the process holds it: peak resident growth per parameter at steps 1, 3 and N, and step time, for
DDP, FSDP2, DeepSpeed ZeRO-3 and zlightning's zstack_zero3 (defaults, CPU offload, NVMe offload), side by side.

    .venv/bin/python benchmarks/memory.py                 # 200 steps, every variant (DeepSpeed: its own venv)
    .venv/bin/python benchmarks/memory.py --steps 20 --variants ddp zstack_zero3

The model is states-dominated: ``depth`` blocks of ``Linear(width, width) + Tanh`` (default 24 x 1024: 25.2 M
parameters), AdamW in fp32, micro-batch 2, 2 CPU ranks over gloo with 1 thread each. Each variant runs in 2 fresh
processes (``_memory_worker.py``); how growth is measured: [Note: what "peak resident growth" is] there. The ideal
for sharded fp32 parameters, gradients and Adam's two moments is 16 / N bytes per parameter (8 on 2 ranks); DDP
holds 16 plus its gradient buckets.

``--model lm`` trains a language model instead: ``Embedding(vocab, width)``, ``depth`` MLP blocks (LayerNorm,
``Linear(w, 4w)``, GELU, ``Linear(4w, w)``), a final norm and an untied head (default 32000 x 256 with 8 blocks:
20.6 M parameters, 80% of them in the embedding and the head), next-token cross-entropy on random tokens. FSDP2
wraps the embedding and the head as well as the blocks (torchtitan's recipe); zstack_zero3 chooses its units itself.

Writes ``benchmarks/results/memory.json`` and ``memory.md`` (``memory_lm.*`` for ``--model lm``; the table, also
printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VARIANTS = ("ddp", "fsdp2", "deepspeed", "zstack_zero3", "zstack_zero3_offload", "zstack_zero3_nvme")
DEEPSPEED_PY = BENCH / ".venv-deepspeed" / "bin" / "python"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_variant(variant: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    python = str(DEEPSPEED_PY) if variant == "deepspeed" else sys.executable
    if variant == "deepspeed" and not DEEPSPEED_PY.exists():
        return {"status": "unavailable: run benchmarks/setup_deepspeed_venv.sh first"}
    port = _free_port()
    procs, outs = [], []
    for rank in range(args.world):
        out = scratch / f"{variant}_rank{rank}.json"
        log = open(scratch / f"{variant}_rank{rank}.log", "w")  # noqa: SIM115 - closed below
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(args.world),
            NODE_RANK="0",
            LOCAL_WORLD_SIZE=str(args.world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        cmd = [
            python,
            str(BENCH / "_memory_worker.py"),
            "--variant",
            variant,
            "--model",
            args.model,
            "--vocab",
            str(args.vocab),
            "--seq",
            str(args.seq),
            "--width",
            str(args.width),
            "--depth",
            str(args.depth),
            "--micro-batch",
            str(args.micro_batch),
            "--steps",
            str(args.steps),
            "--out",
            str(out),
            "--swap-dir",
            str(scratch),
        ]
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO), log))
        outs.append(out)
    for proc, log in procs:
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
        log.close()
    results = [json.loads(o.read_text()) if o.exists() else {"status": "error", "error": "no result"} for o in outs]
    bad = [r for r in results if r["status"] != "ok"]
    if bad:
        return {"status": f"failed: {bad[0].get('error', '?')[:200]}"}
    return {"status": "ok", "ranks": results}


def summarise(ranks: list[dict[str, Any]], numel: int, steps: int) -> dict[str, Any]:
    marks = sorted({1, min(3, steps), steps})
    per_param = {k: max(r["peaks"][k - 1] for r in ranks) / numel for k in marks}
    times = [t for r in ranks for t in r["times"][2:]] or [t for r in ranks for t in r["times"]]
    return {"bytes_per_param": per_param, "median_step_s": statistics.median(times)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--model",
        choices=("mlp", "lm"),
        default="mlp",
        help="mlp: depth x (Linear(width) + Tanh); lm: embedding, depth MLP blocks, untied head (writes memory_lm.*)",
    )
    p.add_argument("--vocab", type=int, default=32000, help="--model lm: vocabulary")
    p.add_argument("--seq", type=int, default=32, help="--model lm: tokens per sample")
    p.add_argument("--width", type=int, default=None, help="default 1024 (mlp) / 256 (lm)")
    p.add_argument("--depth", type=int, default=None, help="default 24 (mlp) / 8 (lm)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out-dir", type=Path, default=BENCH / "results")
    args = p.parse_args()
    lm = args.model == "lm"
    args.width = args.width or (256 if lm else 1024)
    args.depth = args.depth or (8 if lm else 24)
    if lm:  # embedding + head + blocks (LayerNorm, Linear(w, 4w), Linear(4w, w)) + final LayerNorm
        w = args.width
        numel = 2 * args.vocab * w + args.depth * (2 * w + 8 * w * w + 5 * w) + 2 * w
        model_text = (
            f"Embedding({args.vocab}, {w}), {args.depth} MLP blocks and an untied head ({numel / 1e6:.1f} M "
            f"parameters, {2 * args.vocab * w / numel:.0%} in the embedding and head), {args.seq} tokens"
        )
    else:
        numel = args.depth * (args.width * args.width + args.width)
        model_text = f"{args.depth} x Linear({args.width}) + Tanh ({numel / 1e6:.1f} M parameters)"
    stem = "memory_lm" if lm else "memory"
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="zl-memory-") as tmp:
        for variant in args.variants:
            print(f">> {variant}: {args.world} ranks, {args.steps} steps", flush=True)
            outcome = run_variant(variant, args, Path(tmp))
            rows[variant] = summarise(outcome["ranks"], numel, args.steps) if outcome["status"] == "ok" else outcome
            print(f"   {rows[variant]}", flush=True)
    marks = sorted({1, min(3, args.steps), args.steps})
    ddp_time = rows.get("ddp", {}).get("median_step_s")
    lines = [
        f"Peak resident growth per parameter (bytes; max over ranks) and median step time; {model_text}, AdamW "
        f"fp32, micro-batch {args.micro_batch}, {args.world} CPU ranks. Ideal sharded: {16 / args.world:g} B/param.",
        "",
        "| variant | " + " | ".join(f"step {k}" for k in marks) + " | step time (s) | x DDP |",
        "|---|" + "---:|" * (len(marks) + 2),
    ]
    for variant, row in rows.items():
        if "bytes_per_param" not in row:
            lines.append(f"| {variant} | " + " | ".join("—" for _ in marks) + f" | {row['status']} | — |")
            continue
        bpp = row["bytes_per_param"]
        ratio = f"{row['median_step_s'] / ddp_time:.2f}" if ddp_time else "—"
        lines.append(
            f"| {variant} | "
            + " | ".join(f"{bpp[k]:.2f}" for k in marks)
            + f" | {row['median_step_s']:.3f} | {ratio} |"
        )
    table = "\n".join(lines)
    print("\n" + table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.platform(),
        "load_average": os.getloadavg(),
        "config": {k: v for k, v in vars(args).items() if k != "out_dir"},
        "numel": numel,
        "results": rows,
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps(record, indent=2, default=str))
    (args.out_dir / f"{stem}.md").write_text(table + "\n")
    from _plots import write_png  # matplotlib is optional: without it, one line says no chart was drawn

    write_png("memory", record, args.out_dir / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
