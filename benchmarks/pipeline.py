"""Pipeline parallelism benchmark: measured bubble vs theory, and throughput side by side with
``torch.distributed.pipelining`` (Schedule1F1B, ScheduleGPipe) on the same model, split and micro-batches.

Usage::

    .venv/bin/python benchmarks/pipeline.py                 # P=2 ranks, m in {2,4,8}, 2 warm-up + 5 timed steps, 3 repeats
    .venv/bin/python benchmarks/pipeline.py --ranks 4 --steps 10 --d-model 256

Model: ``--layers`` transformer ``Block``s of ``examples/gpt_model.py`` (uniform split, ``layers / P`` per stage),
float inputs ``[micro_size * m, seq, d_model]``, MSE loss against a random target, SGD. Every variant runs in the same
P gloo processes (CPU, ``--threads`` each), one after another, from the same seeded weights and data.

[Note: how the bubble is measured]
During the timed steps of a zlightning run the engine records the start and end (``time.perf_counter``, one
monotonic clock shared by the processes of a machine) of every forward and backward. Per step, the makespan is the
latest end minus the earliest start over all ranks and the busy time is the sum of all compute spans, so
``bubble = 1 - busy / (P * makespan)``: the share of rank-time spent waiting (transfers included). Theory for 1F1B
and GPipe with equal stages is ``(P - 1) / (m + P - 1)``; interleaved 1F1B with ``v`` chunks: ``(P - 1) / (v m + P - 1)``.

That theory assumes equal stages and free transfers. To tell the schedule's own bubble from the rest, each step is
also replayed with zero-cost transfers: every compute action keeps its measured duration and starts as soon as its
rank is free and its input (previous stage's forward, next stage's backward) is done. ``replay bubble`` is the
bubble of that replay: it differs from theory only by uneven stage times (the last stage also computes the loss;
on a shared CPU, time-slicing by other processes lengthens random actions). ``measured - replay`` is then what
transfers, waits and per-action overhead add. Both use the same compute spans, which exclude transfers.

[Note: throughput]
Samples per second over the timed steps (median step time, rank 0), where a step is the schedule (forward and
backward of all micro-batches) plus the optimizer step. torch.distributed.pipelining gets the same stage modules,
loss and optimizer; its shape inference runs during warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt_model import Block, GPTConfig  # noqa: E402
from zlightning.pipe import LayerSpec, PipelineConfig, PipelineEngine, PipelineModule  # noqa: E402
from zlightning.pipe._schedule import Action, ActionKind  # noqa: E402
from zlightning.testing import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _module(args: argparse.Namespace, pp: int) -> PipelineModule:
    cfg = GPTConfig(d_model=args.d_model, n_head=args.heads, seq_len=args.seq, n_layer=args.layers)
    return PipelineModule([LayerSpec(Block, cfg) for _ in range(args.layers)], loss_fn=_mse, num_stages=pp, partition_method="uniform")


def _data(args: argparse.Namespace, m: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    shape = (args.micro_size * m, args.seq, args.d_model)
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(steps)]


def _bubble(step_spans: list[list[tuple[str, float, float]]]) -> float:
    """``step_spans[r]``: rank r's compute spans of one step. See [Note: how the bubble is measured]."""
    starts = [s for spans in step_spans for _, s, _ in spans]
    ends = [e for spans in step_spans for _, _, e in spans]
    busy = sum(e - s for spans in step_spans for _, s, e in spans)
    return 1.0 - busy / (len(step_spans) * (max(ends) - min(starts)))


def _replay_bubble(step_spans: list[list[tuple[str, float, float]]]) -> float:
    """Bubble of one step replayed with free transfers; see [Note: how the bubble is measured]."""
    programs = [[(Action.parse(a), e - s) for a, s, e in spans] for spans in step_spans]
    last = max(a.stage for prog in programs for a, _ in prog)
    done: dict[tuple[int, ActionKind, int], float] = {}
    free, pos = [0.0] * len(programs), [0] * len(programs)
    while any(pos[r] < len(prog) for r, prog in enumerate(programs)):
        progressed = False
        for r, prog in enumerate(programs):
            while pos[r] < len(prog):
                a, dur = prog[pos[r]]
                fwd = a.kind is ActionKind.FORWARD
                deps = [(a.stage - 1, a.kind, a.microbatch)] if fwd and a.stage > 0 else []
                if not fwd:
                    deps = [(a.stage, ActionKind.FORWARD, a.microbatch)]
                    deps += [(a.stage + 1, a.kind, a.microbatch)] if a.stage < last else []
                if any(d not in done for d in deps):
                    break
                free[r] = max([free[r]] + [done[d] for d in deps]) + dur
                done[(a.stage, a.kind, a.microbatch)] = free[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("replay of the measured step deadlocked; the recorded programs are inconsistent")
    busy = sum(dur for prog in programs for _, dur in prog)
    return 1.0 - busy / (len(programs) * max(free))


def _run_zlightning(args: argparse.Namespace, pp: int, m: int, schedule: str) -> dict[str, Any]:
    module = _module(args, pp)
    engine = PipelineEngine(module, lambda ps: torch.optim.SGD(ps, lr=1e-3), PipelineConfig(micro_batches=m, schedule=schedule))
    times, bubbles, replays = [], [], []
    for i, (x, y) in enumerate(_data(args, m, args.warmup + args.steps)):
        timed = i >= args.warmup
        engine.timings = [] if timed else None
        dist.barrier()
        t0 = time.perf_counter()
        engine.train_batch(batch=(x, y))
        times.append(time.perf_counter() - t0)
        if timed:
            spans: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(spans, engine.timings)
            bubbles.append(_bubble(spans))
            replays.append(_replay_bubble(spans))
    return {
        "step_s": statistics.median(times[args.warmup :]),
        "bubble": statistics.median(bubbles),
        "replay_bubble": statistics.median(replays),
    }


def _run_torch(args: argparse.Namespace, pp: int, m: int, schedule: str) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    module = _module(args, pp).build(stages=(rank,), total_stages=pp)  # same layers, same seeds, same split
    stage_mod = nn.Sequential(*[module.get_submodule(str(i)) for i in module.stage_layers(rank)])
    stage = PipelineStage(stage_mod, rank, pp, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=m, loss_fn=_mse)
    opt = torch.optim.SGD(stage_mod.parameters(), lr=1e-3)
    times = []
    for x, y in _data(args, m, args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            sched.step(x)
        elif rank == pp - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(times[args.warmup :])}


def worker(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every variant ``args.repeats`` times per m, interleaved (variant order inside a repetition), so slow phases of
    a shared machine hit all variants alike; one row per variant and m with the runs' median step time."""
    torch.set_num_threads(args.threads)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for m in args.micro:
        for _ in range(args.repeats):
            for variant in args.variants:
                impl, schedule = variant.split(":")
                if schedule == "interleaved_1f1b" and m % world:
                    continue
                run = _run_zlightning if impl == "zlightning" else _run_torch
                runs.setdefault((variant, m), []).append(run(args, world, m, schedule))
    rows = []
    for (variant, m), outs in runs.items():
        row: dict[str, Any] = {"variant": variant, "m": m, "step_s": statistics.median(o["step_s"] for o in outs),
                               "runs_step_s": [o["step_s"] for o in outs]}
        for key in ("bubble", "replay_bubble"):
            if key in outs[0]:
                row[key] = statistics.median(o[key] for o in outs)
        rows.append(row)
    return rows


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    p = args.ranks
    table = []
    for r in rows:
        samples = args.micro_size * r["m"]
        entry = {**r, "samples_per_s": samples / r["step_s"]}
        if "bubble" in r:
            v = 2 if r["variant"].endswith("interleaved_1f1b") else 1
            theory = (p - 1) / (v * r["m"] + p - 1)
            entry.update(theory=theory, bubble_vs_theory=r["bubble"] / theory)
        table.append(entry)
    ratios = []
    for m in args.micro:
        for sched in ("1f1b", "gpipe"):
            ours = next((t for t in table if t["variant"] == f"zlightning:{sched}" and t["m"] == m), None)
            theirs = next((t for t in table if t["variant"] == f"torch:{sched}" and t["m"] == m), None)
            if ours and theirs:
                per_run = [t / o for o, t in zip(ours["runs_step_s"], theirs["runs_step_s"])]
                ratios.append({"m": m, "schedule": sched, "throughput_ratio_vs_torch": theirs["step_s"] / ours["step_s"],
                               "per_repetition": per_run})
    config = {k: v for k, v in vars(args).items() if k != "out"}
    return {"config": config, "load_average": list(os.getloadavg()), "rows": table, "ratios": ratios}


def write_markdown(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    lines = [
        "# Pipeline benchmark",
        "",
        f"P={c['ranks']} gloo ranks on CPU ({c['threads']} thread each), {c['layers']} GPT blocks (d_model {c['d_model']}, "
        f"seq {c['seq']}), micro-batch {c['micro_size']} samples, {c['warmup']} warm-up + {c['steps']} timed steps, "
        f"median; every variant run {c['repeats']} times, interleaved, and the median of the runs' medians reported. "
        f"Load average at the end: {', '.join(f'{x:.2f}' for x in result['load_average'])} (shared 2-core machine). "
        "Generated by `benchmarks/pipeline.py`.",
        "",
        "Bubble: `1 - busy / (P * makespan)` over the schedule's compute spans (transfers excluded from busy time). "
        "`replay` re-runs each measured step with zero-cost transfers (same compute durations), so `replay` vs theory "
        "shows uneven stage times and `measured - replay` what transfers and per-action overhead add. See the "
        "docstring of `benchmarks/pipeline.py`.",
        "",
        "| variant | m | step (s) | samples/s | measured bubble | replay bubble (free transfers) | theory (P-1)/(vm+P-1) | measured / theory | replay / theory |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        b = f"{r['bubble']:.3f}" if "bubble" in r else "n/a"
        t = f"{r['theory']:.3f}" if "theory" in r else "n/a"
        q = f"{r['bubble_vs_theory']:.2f}" if "theory" in r else "n/a"
        rb = f"{r['replay_bubble']:.3f}" if "replay_bubble" in r else "n/a"
        rq = f"{r['replay_bubble'] / r['theory']:.2f}" if "theory" in r else "n/a"
        lines.append(f"| {r['variant']} | {r['m']} | {r['step_s']:.4f} | {r['samples_per_s']:.1f} | {b} | {rb} | {t} | {q} | {rq} |")
    lines += ["", "| m | schedule | zlightning / torch.pipelining throughput (ratio of medians) | per repetition |", "|---|---|---|---|"]
    lines += [
        f"| {x['m']} | {x['schedule']} | {x['throughput_ratio_vs_torch']:.3f} | {', '.join(f'{r:.2f}' for r in x['per_repetition'])} |"
        for x in result["ratios"]
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--micro", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every variant, interleaved; medians reported")
    ap.add_argument(
        "--variants", nargs="+",
        default=["zlightning:1f1b", "torch:1f1b", "zlightning:gpipe", "torch:gpipe", "zlightning:interleaved_1f1b"],
    )
    ap.add_argument("--out", default="pipeline")
    args = ap.parse_args()
    rows = run_distributed(worker, args.ranks, args, timeout=1800, threads=args.threads)[0]
    result = summarise(rows, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, RESULTS / f"{args.out}.md")
    print((RESULTS / f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
