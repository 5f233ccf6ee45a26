"""Pipeline parallelism benchmark: measured bubble vs theory, peak activation memory, and throughput side by side
with ``torch.distributed.pipelining`` (Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble, ScheduleDualPipeV) on the same model, split and micro-batches.

Usage::

    .venv/bin/python benchmarks/pipeline.py                 # P=2 ranks, m in {2,4,8}, 2 warm-up + 5 timed steps, 3 repeats
    .venv/bin/python benchmarks/pipeline.py --ranks 4 --steps 10 --d-model 256
    .venv/bin/python benchmarks/pipeline.py --zero-bubble --layers 8 --d-model 256 --seq 128 --out pipeline_zero_bubble

``--zero-bubble`` selects the zero-bubble comparison: our ``1f1b``, ``zb_h1`` and ``zbv`` against torch.pipelining's
``Schedule1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` at
m = 4/8/16. Two-chunk variants (``zbv``, torch's interleaved/ZBV/DualPipeV) split the layers into ``2P`` chunks.

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
also replayed with zero-cost transfers (and once more with every action at its stage and kind's median duration:
``median replay``, the schedule's bubble at this machine's real F/B/W costs without the per-action spread): every compute action keeps its measured duration and starts as soon as its
rank is free and its input (previous stage's forward, next stage's backward) is done. ``replay bubble`` is the
bubble of that replay: it differs from theory only by uneven stage times (the last stage also computes the loss;
on a shared CPU, time-slicing by other processes lengthens random actions). ``measured - replay`` is then what
transfers, waits and per-action overhead add. Both use the same compute spans, which exclude transfers.

The zero-bubble schedules' theory is the timing model of ``zlightning.pipe.timeline`` with unit costs (F = B = W,
a full backward 2F): ``(P-1)/(3m+P-1)`` for ZB-H1, and ZBV's list-scheduled order (0.020 at P = 2, m = 8); for 1F1B
it is the formula above.

[Note: peak activation memory]
After the timed steps each variant runs one more step with autograd's saved-tensor hooks counting the bytes of every
tensor saved for backward while it is alive (each storage once, parameters excluded): the peak per rank is the
activation memory the schedule holds at its fullest, in the same units for our engine and torch.pipelining. A zero-
bubble schedule keeps a micro-batch's saved tensors until its ``W`` (weight gradients) ran, not only until its
``B``. The counting step is not timed.

[Note: throughput]
Samples per second over the timed steps (median step time, rank 0), where a step is the schedule (forward and
backward of all micro-batches) plus the optimizer step. torch.distributed.pipelining gets the same stage modules,
loss and optimizer; its shape inference runs during warm-up.

[Note: the floor of a one-chunk schedule within 1F1B's memory at P = 2]
ZB-H1's target (a bubble at most half of 1F1B's) depends on the F/B/W costs, and at two ranks no schedule with one
chunk per rank that holds at most 1F1B's peak of activations (two micro-batches per rank, each held from its
forward until its ``W``) can beat the following floor. Write ``F0``, ``X0`` for the first stage's forward and whole
backward (its ``B`` is free, see [Note: the first stage's split backward] in ``zlightning/pipe/_schedule.py``) and
``F1``, ``B1``, ``W1`` for the second stage's. Rank 0 can forward two micro-batches before it must run the backward
of the first, whose input gradient arrives at ``F0 + F1 + B1`` at the earliest, so it idles at least
``F1 + B1 - F0``; rank 1 idles ``F0`` waiting for the first forward, and after its last ``B`` it holds at most two
pending ``W`` while rank 0 still runs that micro-batch's whole backward, so it idles at least ``X0 - 2 W1`` at the
end. With ``M`` micro-batches the makespan is therefore at least
``max(M (F0 + X0) + max(0, F1 + B1 - F0), M (F1 + B1 + W1) + F0 + max(0, X0 - 2 W1))``. It is a lower bound, not
always reached; with stages of equal cost ZB-H1 reaches it (tests/test_pipeline_benchmark_floor.py: the timing model
gives exactly this bubble, and random schedules within the memory never go below it). With equal stages
(``X0 = B1 + W1``) the bubble is half of 1F1B's only when ``F + 2B <= 4W``: where the input backward outweighs the
weight backward enough, half is out of reach for any schedule within 1F1B's memory. The benchmark computes the
floor from each timed ZB-H1 step's median action times (``floor`` below), so a miss can be told apart from the
schedule: ``median replay`` at the floor means the order is already optimal for those costs.

[Note: the 1F1B bubble at m = 8]
On this shared 2-core VM the measured 1F1B bubble at m = 8 is about 1.2x (P-1)/(m+P-1) although the two stages'
median action times are equal. It is already in the replay (free transfers), so it is compute time, not transfers:
each action's duration spreads (p90 +8-10%, max +25% over the median), and in 1F1B on two ranks each stage waits for
the other's previous action, so whenever one of a pair runs long the other idles, over 2m actions. Replaying with
every action at its stage's median time gives 1.02x theory. The zero-bubble schedules absorb part of it: a pending
``W`` fills the wait.
"""

from __future__ import annotations

import argparse
import dataclasses
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
from zlightning.pipe import LayerSpec, PipelineConfig, PipelineEngine, PipelineModule, build_schedule, timeline  # noqa: E402
from zlightning.pipe._schedule import Action, ActionKind  # noqa: E402
from zlightning.testing import run_distributed  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _module(args: argparse.Namespace, pp: int) -> PipelineModule:
    cfg = GPTConfig(d_model=args.d_model, n_head=args.heads, seq_len=args.seq, n_layer=args.layers)
    return PipelineModule(
        [LayerSpec(Block, cfg) for _ in range(args.layers)], loss_fn=_mse, num_stages=pp, partition_method="uniform"
    )


class _ActivationMeter:
    """Peak bytes of tensors saved for backward and still alive; see [Note: peak activation memory]."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[int, list[int]] = {}  # storage -> [references, bytes]
        self.bytes = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key in self.skip or t.device.type == "meta":
            return t
        entry = self.live.setdefault(key, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.bytes += entry[1]
            self.peak = max(self.peak, self.bytes)
        entry[0] += 1
        return _Held(self, key, t.detach())  # not the tensor itself: a saved output would keep its own node alive

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.bytes -= entry[1]
            del self.live[key]


class _Held:
    def __init__(self, meter: _ActivationMeter, key: int, t: torch.Tensor) -> None:
        self.meter, self.key, self.t = meter, key, t

    def __del__(self) -> None:
        self.meter.release(self.key)


def _unpack(x: Any) -> torch.Tensor:
    return x.t if isinstance(x, _Held) else x


def _peak_activations(params: list[torch.Tensor], step: Any) -> float:
    """MiB of saved activations at the fullest point of one ``step()`` on this rank."""
    meter = _ActivationMeter(params)
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, _unpack):
        step()
    return meter.peak / 2**20


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


def _median_spans(step_spans: list[list[tuple[str, float, float]]]) -> list[list[tuple[str, float, float]]]:
    """The same step with every action lasting the median duration of its stage and kind (F, B or W) in that step:
    what the schedule's order costs with this machine's average action times and no per-action spread."""
    durations: dict[tuple[int, ActionKind], list[float]] = {}
    for spans in step_spans:
        for a, s, e in spans:
            act = Action.parse(a)
            durations.setdefault((act.stage, act.kind), []).append(e - s)
    median = {k: statistics.median(v) for k, v in durations.items()}
    return [
        [(a, 0.0, median[(Action.parse(a).stage, Action.parse(a).kind)]) for a, _, _ in spans] for spans in step_spans
    ]


def one_chunk_floor(step_spans: list[list[tuple[str, float, float]]]) -> tuple[float, dict[str, float]] | None:
    """The least bubble a one-chunk schedule within 1F1B's activation memory can reach at two ranks with this step's
    median action times, and those times; None unless the step is a split-backward one at P = 2. See
    [Note: the floor of a one-chunk schedule within 1F1B's memory at P = 2]."""
    if len(step_spans) != 2:
        return None
    durations: dict[tuple[int, ActionKind], list[float]] = {}
    microbatches = set()
    for spans in step_spans:
        for a, s, e in spans:
            act = Action.parse(a)
            durations.setdefault((act.stage, act.kind), []).append(e - s)
            microbatches.add(act.microbatch)
    if (1, ActionKind.WEIGHT) not in durations or any(k[0] > 1 for k in durations):
        return None
    med = {k: statistics.median(v) for k, v in durations.items()}
    F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
    c = {
        "F0": med[(0, F)],
        "X0": med.get((0, B), 0.0) + med.get((0, W), 0.0),
        "F1": med[(1, F)],
        "B1": med[(1, B)],
        "W1": med[(1, W)],
    }
    return floor_bubble(c, len(microbatches)), c


def floor_bubble(c: dict[str, float], m: int) -> float:
    """The floor of [Note: the floor of a one-chunk schedule within 1F1B's memory at P = 2] for costs ``c`` (keys
    ``F0``, ``X0``, ``F1``, ``B1``, ``W1``) and ``m`` micro-batches."""
    busy0 = m * (c["F0"] + c["X0"])
    busy1 = m * (c["F1"] + c["B1"] + c["W1"])
    pending = min(2, m)
    makespan = max(
        busy0 + max(0.0, c["F1"] + c["B1"] - c["F0"]),
        busy1 + c["F0"] + max(0.0, c["X0"] - pending * c["W1"]),
    )
    return 1.0 - (busy0 + busy1) / (2 * makespan)


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
                if a.kind is ActionKind.WEIGHT:
                    deps = [(a.stage, ActionKind.BACKWARD, a.microbatch)]
                elif not fwd:
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
    engine = PipelineEngine(
        module, lambda ps: torch.optim.SGD(ps, lr=1e-3), PipelineConfig(micro_batches=m, schedule=schedule)
    )
    times, bubbles, replays, medians, floors = [], [], [], [], []
    batches = _data(args, m, args.warmup + args.steps + 1)
    x, y = batches.pop()
    peak = _peak_activations(list(module.parameters()), lambda: engine.train_batch(batch=(x, y)))
    for i, (x, y) in enumerate(batches):
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
            medians.append(_replay_bubble(_median_spans(spans)))
            floor = one_chunk_floor(spans) if schedule == "zb_h1" else None
            if floor is not None:
                floors.append(floor)
    return {
        "step_s": statistics.median(times[args.warmup :]),
        "bubble": statistics.median(bubbles),
        "replay_bubble": statistics.median(replays),
        "median_replay_bubble": statistics.median(medians),
        "peak_act_mib": _per_rank(peak),
        "costs": dataclasses.asdict(engine.schedule_costs) if engine.schedule_costs is not None else None,
        **(_floor_summary(floors) if floors else {}),
    }


def _floor_summary(floors: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """Median floor bubble over the timed steps and the median action times (s) it was computed from."""
    return {
        "floor_bubble": statistics.median(f for f, _ in floors),
        "floor_costs_s": {k: statistics.median(c[k] for _, c in floors) for k in floors[0][1]},
    }


def _per_rank(value: float) -> list[float]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


_TORCH_MULTI = {
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.pipelining schedules with two stages per rank (``--variants torch:<key>``)."""


def _run_torch(args: argparse.Namespace, pp: int, m: int, schedule: str) -> dict[str, Any]:
    from torch.distributed import pipelining

    rank = dist.get_rank()
    multi = schedule in _TORCH_MULTI
    total = 2 * pp if multi else pp
    v_shape = schedule in ("zbv", "dualpipev")  # torch places these in a V, like our zbv
    stages = (rank, 2 * pp - 1 - rank) if v_shape else tuple(range(rank, total, pp))
    module = _module(args, pp).build(stages=stages, total_stages=total)  # same layers, same seeds, same split
    mods = [nn.Sequential(*[module.get_submodule(str(i)) for i in module.stage_layers(s)]) for s in stages]
    pipe_stages = [pipelining.PipelineStage(mod, s, total, torch.device("cpu")) for mod, s in zip(mods, stages)]
    if multi:
        sched = getattr(pipelining, _TORCH_MULTI[schedule])(pipe_stages, n_microbatches=m, loss_fn=_mse)
    else:
        cls = pipelining.Schedule1F1B if schedule == "1f1b" else pipelining.ScheduleGPipe
        sched = cls(pipe_stages[0], n_microbatches=m, loss_fn=_mse)
    opt = torch.optim.SGD([p for mod in mods for p in mod.parameters()], lr=1e-3)
    first, last = 0 in stages, total - 1 in stages

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        kwargs: dict[str, Any] = {"target": y, "losses": []} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    batches = _data(args, m, args.warmup + args.steps + 1)
    extra = batches.pop()
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    peak = _peak_activations(list(module.parameters()), lambda: step(*extra))
    return {"step_s": statistics.median(times[args.warmup :]), "peak_act_mib": _per_rank(peak)}


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
        row: dict[str, Any] = {
            "variant": variant,
            "m": m,
            "step_s": statistics.median(o["step_s"] for o in outs),
            "runs_step_s": [o["step_s"] for o in outs],
            "peak_act_mib": outs[0]["peak_act_mib"],
        }
        if outs[0].get("costs") is not None:  # zbv's order: the costs measured in each run
            row["costs"] = [o["costs"] for o in outs]
        if "floor_costs_s" in outs[0]:
            row["floor_costs_s"] = [o["floor_costs_s"] for o in outs]
        for key in ("bubble", "replay_bubble", "median_replay_bubble", "floor_bubble"):
            if key in outs[0]:
                row[key] = statistics.median(o[key] for o in outs)
                row[f"runs_{key}"] = [o[key] for o in outs]
        rows.append(row)
    return rows


_CHUNKS = {"interleaved_1f1b": 2, "zbv": 2}


def _theory(schedule: str, p: int, m: int) -> float:
    """The timing model's bubble with unit costs (F = B = W, a whole backward 2F); see the module docstring."""
    v = _CHUNKS.get(schedule, 1)
    return timeline(build_schedule(schedule, p, m, v), 1.0, 2.0, 1.0).bubble_fraction


def _find(table: list[dict[str, Any]], variant: str, m: int) -> dict[str, Any] | None:
    return next((t for t in table if t["variant"] == variant and t["m"] == m), None)


def _compare(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """Throughput of ``a`` over ``b``: ratio of the median step times, and per repetition."""
    if a is None or b is None:
        return None
    return {
        "ratio": b["step_s"] / a["step_s"],
        "per_repetition": [y / x for x, y in zip(a["runs_step_s"], b["runs_step_s"])],
    }


def summarise(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    p = args.ranks
    table = []
    for r in rows:
        entry = {**r, "samples_per_s": args.micro_size * r["m"] / r["step_s"]}
        impl, schedule = r["variant"].split(":")
        if impl == "zlightning":
            entry["theory"] = _theory(schedule, p, r["m"])
            entry["bubble_vs_theory"] = r["bubble"] / entry["theory"] if entry["theory"] else float("nan")
        table.append(entry)
    ratios = []
    for m in args.micro:
        for sched in ("1f1b", "gpipe"):
            c = _compare(_find(table, f"zlightning:{sched}", m), _find(table, f"torch:{sched}", m))
            if c is not None:
                ratios.append(
                    {
                        "m": m,
                        "schedule": sched,
                        "throughput_ratio_vs_torch": c["ratio"],
                        "per_repetition": c["per_repetition"],
                    }
                )
    zero_bubble = []
    for m in args.micro:
        ours = {k: _find(table, f"zlightning:{k}", m) for k in ("1f1b", "zb_h1", "zbv")}
        theirs = [t for t in (_find(table, f"torch:{k}", m) for k in _TORCH_MULTI) if t is not None]
        if ours["1f1b"] is None or (ours["zb_h1"] is None and ours["zbv"] is None):
            continue
        best = max(theirs, key=lambda t: t["samples_per_s"]) if theirs else None
        entry: dict[str, Any] = {"m": m, "torch_best_zero_bubble": best["variant"] if best else None}
        for name in ("zb_h1", "zbv"):
            mine = ours[name]
            if mine is None:
                continue
            entry[f"{name}_vs_1f1b"] = _compare(mine, ours["1f1b"])
            entry[f"{name}_vs_torch_best"] = _compare(mine, best)
            entry[f"{name}_bubble_over_1f1b"] = mine["bubble"] / ours["1f1b"]["bubble"]
            entry[f"{name}_replay_bubble_over_1f1b"] = mine["replay_bubble"] / ours["1f1b"]["replay_bubble"]
            entry[f"{name}_peak_act_mib"] = mine["peak_act_mib"]
            if "floor_bubble" in mine:
                entry[f"{name}_floor_over_1f1b"] = mine["floor_bubble"] / ours["1f1b"]["bubble"]
                entry[f"{name}_median_replay_over_1f1b"] = mine["median_replay_bubble"] / ours["1f1b"]["bubble"]
                entry[f"{name}_floor_costs_s"] = mine["floor_costs_s"]
        entry["1f1b_peak_act_mib"] = ours["1f1b"]["peak_act_mib"]
        zero_bubble.append(entry)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    return {
        "config": config,
        "load_average": list(os.getloadavg()),
        "rows": table,
        "ratios": ratios,
        "zero_bubble": zero_bubble,
    }


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def write_markdown(result: dict[str, Any], path: Path) -> None:
    c = result["config"]
    lines = [
        "# Pipeline benchmark",
        "",
        f"P={c['ranks']} gloo ranks on CPU ({c['threads']} thread each), {c['layers']} GPT blocks (d_model {c['d_model']}, "
        f"seq {c['seq']}), micro-batch {c['micro_size']} samples, {c['warmup']} warm-up + {c['steps']} timed steps, "
        f"median; every variant run {c['repeats']} times, interleaved, and the median of the runs' medians reported. "
        f"Load average at the end: {', '.join(f'{x:.2f}' for x in result['load_average'])} (shared 2-core machine: "
        "timings are noisy, compare within this run). Generated by `benchmarks/pipeline.py`.",
        "",
        "Bubble: `1 - busy / (P * makespan)` over the schedule's compute spans (transfers excluded from busy time). "
        "`replay` re-runs each measured step with zero-cost transfers (same compute durations), so `replay` vs theory "
        "shows uneven stage times and per-action spread, `measured - replay` what transfers and per-action overhead "
        "add; `median replay` replays it with every action at its stage and kind's median duration (the schedule's "
        "bubble at this machine's average F/B/W costs, without the per-action spread). "
        "Theory: the timing model with unit costs (F = B = W; 1F1B: (P-1)/(m+P-1)). Peak activations: MiB of "
        "tensors saved for backward at the fullest point of one step, per rank. See the docstring of "
        "`benchmarks/pipeline.py`.",
        "",
        "| variant | m | step (s) | samples/s | measured bubble | replay bubble | median replay | theory | measured / theory | replay / theory | peak activations per rank (MiB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        th = r.get("theory")
        peaks = ", ".join(f"{x:.1f}" for x in r["peak_act_mib"])
        lines.append(
            f"| {r['variant']} | {r['m']} | {r['step_s']:.4f} | {r['samples_per_s']:.1f} | {_fmt(r.get('bubble'))} | "
            f"{_fmt(r.get('replay_bubble'))} | {_fmt(r.get('median_replay_bubble'))} | {_fmt(th)} | "
            f"{_fmt(r.get('bubble_vs_theory'), '.2f')} | "
            f"{_fmt(r['replay_bubble'] / th if th else None, '.2f')} | {peaks} |"
        )
    if result["ratios"]:
        lines += [
            "",
            "| m | schedule | zlightning / torch.pipelining throughput (ratio of medians) | per repetition |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {x['m']} | {x['schedule']} | {x['throughput_ratio_vs_torch']:.3f} | {', '.join(f'{r:.2f}' for r in x['per_repetition'])} |"
            for x in result["ratios"]
        ]
    if result["zero_bubble"]:
        lines += [
            "",
            "Zero-bubble schedules against our 1F1B and torch.pipelining's best zero-bubble schedule of the same m "
            "(throughput: ratio of median step times, per repetition in parentheses; bubble: measured and replay, "
            "as a fraction of our 1F1B's):",
            "",
            "| m | ours | throughput vs our 1F1B | vs torch's best ZB (which) | bubble / 1F1B's (replay) | peak activations per rank vs 1F1B's (MiB) |",
            "|---|---|---|---|---|---|",
        ]
        for z in result["zero_bubble"]:
            for name in ("zb_h1", "zbv"):
                if f"{name}_vs_1f1b" not in z:
                    continue
                a, b = z[f"{name}_vs_1f1b"], z[f"{name}_vs_torch_best"]
                vs_torch = (
                    f"{b['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in b['per_repetition'])}) ({z['torch_best_zero_bubble']})"
                    if b
                    else "n/a"
                )
                peaks = ", ".join(f"{x:.1f}" for x in z[f"{name}_peak_act_mib"])
                ref = ", ".join(f"{x:.1f}" for x in z["1f1b_peak_act_mib"])
                lines.append(
                    f"| {z['m']} | {name} | {a['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in a['per_repetition'])}) | {vs_torch} | "
                    f"{z[f'{name}_bubble_over_1f1b']:.2f} ({z[f'{name}_replay_bubble_over_1f1b']:.2f}) | {peaks} vs {ref} |"
                )
    floors = [z for z in result["zero_bubble"] if "zb_h1_floor_over_1f1b" in z]
    if floors:
        lines += [
            "",
            "zb_h1 against the floor of any one-chunk schedule within 1F1B's activation memory at P = 2, computed from "
            "each timed zb_h1 step's median action times (see [Note: the floor of a one-chunk schedule within 1F1B's "
            "memory at P = 2]); bubbles as a fraction of our 1F1B's measured bubble:",
            "",
            "| m | zb_h1 measured | zb_h1 median replay | floor | median action times, ms (F0 / X0 / F1 / B1 / W1) |",
            "|---|---|---|---|---|",
        ]
        for z in floors:
            costs = [
                statistics.median(c[k] for c in z["zb_h1_floor_costs_s"]) * 1e3 for k in ("F0", "X0", "F1", "B1", "W1")
            ]
            lines.append(
                f"| {z['m']} | {z['zb_h1_bubble_over_1f1b']:.2f} | {z['zb_h1_median_replay_over_1f1b']:.2f} | "
                f"{z['zb_h1_floor_over_1f1b']:.2f} | {' / '.join(f'{x:.1f}' for x in costs)} |"
            )
    measured = [(r["m"], c) for r in result["rows"] if r.get("costs") for c in r["costs"]]
    if measured:
        lines += [
            "",
            "zbv's order comes from the costs it measured on its second batch (F / B / W relative to the forward, "
            "per run; see [Note: calibrating zbv]): "
            + "; ".join(
                f"m={m}: {c['forward']:.2f} / {c['backward_input']:.2f} / {c['backward_weight']:.2f}"
                for m, c in measured
            )
            + ".",
        ]
    lines += ["", "Why the 1F1B bubble exceeds theory at larger m on this machine: " + _NOTE_1F1B]
    path.write_text("\n".join(lines) + "\n")


_NOTE_1F1B = " ".join(__doc__.split("[Note: the 1F1B bubble at m = 8]")[1].split("[Note:")[0].split())

ZERO_BUBBLE_VARIANTS = [
    "zlightning:1f1b",
    "zlightning:zb_h1",
    "zlightning:zbv",
    "torch:1f1b",
    "torch:interleaved_zb",
    "torch:zbv",
    "torch:dualpipev",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument(
        "--micro",
        type=int,
        nargs="+",
        default=None,
        help="micro-batch counts (default 2 4 8; 4 8 16 with --zero-bubble)",
    )
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-size", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="runs of every variant, interleaved; medians reported")
    ap.add_argument("--zero-bubble", action="store_true", help=f"variants {' '.join(ZERO_BUBBLE_VARIANTS)}")
    ap.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="impl:schedule; zlightning:{1f1b,gpipe,interleaved_1f1b,zb_h1,zbv}, torch:{1f1b,gpipe,interleaved_zb,zbv,dualpipev}",
    )
    ap.add_argument("--out", default="pipeline")
    args = ap.parse_args()
    if args.variants is None:
        args.variants = (
            ZERO_BUBBLE_VARIANTS
            if args.zero_bubble
            else ["zlightning:1f1b", "torch:1f1b", "zlightning:gpipe", "torch:gpipe", "zlightning:interleaved_1f1b"]
        )
    if args.micro is None:
        args.micro = [4, 8, 16] if args.zero_bubble else [2, 4, 8]
    rows = run_distributed(worker, args.ranks, args, timeout=3600, threads=args.threads)[0]
    result = summarise(rows, args)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, RESULTS / f"{args.out}.md")
    from _plots import write_png  # timelines per rank with the bubble shaded; skipped without matplotlib

    write_png("pipeline", result, RESULTS / f"{args.out}.png")
    print((RESULTS / f"{args.out}.md").read_text())


if __name__ == "__main__":
    main()
