"""Compile and injection benchmark: eager vs compiled ZeRO-3 (per-unit mode, graph mode, graph mode + unshard
budget) vs eager and compiled DDP, a communication-free compute baseline, and TP=2 vs DP=2, on the benchmark GPT.

Run: ``python benchmarks/compile_inject.py [--model bench|small] [--quick]``. Every variant runs on 2 gloo ranks
(1 thread each) and trains `examples.gpt_model.GPT` on the same tokens; the step time is the median wall time of the
timed steps after warm-up (warm-up covers the torch.compile work; all variants are stepped round-robin in the same
two processes). Graph breaks and compiled graphs (after warm-up and at the end: a difference is a recompile) are
counted per variant, and every variant's collectives are also timed alone (the compute/communication breakdown). Writes
``benchmarks/results/compile_inject.{json,md}`` (``--model small``: ``compile_inject_small.*``).

``--model bench`` (the default) is the benchmark GPT of ``benchmarks/zero3.py`` (``_bench_common.BenchConfig``: d512
x 6 blocks, seq 256, 8 samples per rank); ``--model small`` a smaller d256 x 4, seq 128, 4 samples per rank, where
each collective's fixed gloo latency (~2 ms) is a large share of a 0.2 s step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.gpt_model import GPT, GPTConfig  # noqa: E402
from zlightning.compile import CompileStats  # noqa: E402
from zlightning.testing import run_distributed  # noqa: E402

VARIANTS = (
    "zero3_eager",
    "zero3_compiled_unit",
    "zero3_compiled_graph",
    "zero3_compiled_graph_budget",
    "zero3_compiled_graph_keep_all",
    "dp2_ddp",
    "ddp_compiled",
    "compute_only_eager",
    "compute_only_compiled",
    "tp2",
)
BUDGET = 0.5
"""``unshard_budget`` of the budgeted graph-mode variant: half of the units' gathered bytes may stay unsharded."""
MODES = {
    "zero3_compiled_unit": {"mode": "unit"},
    "zero3_compiled_graph": {"mode": "graph"},
    "zero3_compiled_graph_budget": {"mode": "graph", "unshard_budget": BUDGET},
    "zero3_compiled_graph_keep_all": {"mode": "graph", "unshard_budget": 1.0},
}


def _batches(cfg: GPTConfig, n: int, batch: int, rank_key: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank_key)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g) for _ in range(n)]


def _build(
    variant: str, cfg: GPTConfig
) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.nn.Module, Any, int]:
    """One variant on this rank: (step function, model, compile handle or None, data rank)."""
    from zlightning.compile import CompileConfig, compile_zero3
    from zlightning.inject import InjectPolicy, apply_tensor_parallel
    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant.startswith("zero3"):
        zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig())
        handle = compile_zero3(zero.state, CompileConfig(**MODES[variant])) if variant in MODES else None

        def zstep(x: torch.Tensor, y: torch.Tensor) -> None:
            zero.backward(model(x, y)[1])
            zero.step()

        return zstep, model, handle, dist.get_rank()
    data_rank = dist.get_rank()
    net: torch.nn.Module = model
    if variant.startswith("compute_only"):  # the same model and step with no communication at all
        stats = CompileStats() if variant == "compute_only_compiled" else None
        net = torch.compile(model, backend=_counting_backend(stats)) if stats is not None else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def local_step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad(set_to_none=True)
            net(x, y)[1].backward()
            opt.step()

        return local_step, model, stats, data_rank
    if variant == "tp2":
        # both ranks form one TP group (same batch); InjectPolicy(): TP plus the fused kernels, as measured
        data_rank = apply_tensor_parallel(model, 2, InjectPolicy()).dp_rank
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        stats = CompileStats()
        net = torch.compile(net, backend=_counting_backend(stats)) if variant == "ddp_compiled" else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        net(x, y)[1].backward()
        opt.step()

    return step, model, stats if variant == "ddp_compiled" else None, data_rank


def _counting_backend(stats: Any) -> Callable[..., Any]:
    """Inductor, counting the Dynamo graphs it is handed (recompiles and DDPOptimizer's bucket splits included)."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        stats.graphs += 1
        return compile_fx(gm, inputs)

    return backend


def _comm_breakdown(built: dict[str, Any], reps: int = 5) -> dict[str, float]:
    """Seconds per step of each variant's collectives alone (synchronous, no compute): what 2 gloo ranks on 2 shared
    cores must move, to compare with the step times."""

    def timed(fn: Callable[[], None]) -> float:
        fn()
        samples = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    out: dict[str, float] = {}
    handle = built["zero3_compiled_graph_budget"][2]
    kept = set(handle.plan.kept) if handle is not None and handle.plan is not None else set()
    from zlightning.compile._graph import ordered_groups

    groups = ordered_groups(built["zero3_compiled_graph"][2]._state)
    specs = built["zero3_compiled_graph"][2].specs
    bufs = [(torch.empty(g.world * g.shard_numel), g.shard.detach().clone()) for g in groups]

    def zero3(skip: set[int]) -> None:
        for full, shard in bufs:  # forward gathers
            dist.all_gather_single(full, shard)
        for i, (full, shard) in enumerate(bufs):  # backward re-gathers of unit groups
            if specs[i].kind == "unit" and i not in skip:
                dist.all_gather_single(full, shard)
        for full, shard in bufs:  # gradient reduce-scatters
            dist.reduce_scatter_single(shard, full)

    flat = torch.cat([p.detach().reshape(-1) for p in built["dp2_ddp"][1].parameters()])
    out["zero3_comm_s"] = timed(lambda: zero3(set()))
    out["zero3_budget_comm_s"] = timed(lambda: zero3(kept))
    out["ddp_comm_s"] = timed(lambda: dist.all_reduce(flat))
    return out


def _worker(rank: int, world: int, cfg: GPTConfig, batch: int, warmup: int, timed: int) -> dict[str, Any]:
    """All variants in the same two processes, stepped round-robin, so they share the machine's load equally."""
    from torch._dynamo.utils import counters

    built = {v: _build(v, cfg) for v in VARIANTS}
    data = {v: _batches(cfg, warmup + timed, batch * (2 if v == "tp2" else 1), built[v][3]) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    breaks: dict[str, int] = {}
    graphs_after: dict[str, int | None] = {}
    for i in range(warmup + timed):
        for v in VARIANTS:
            before = sum(counters["graph_break"].values())
            b = data[v][i]
            dist.barrier()
            t0 = time.perf_counter()
            built[v][0](b[:, :-1], b[:, 1:])
            dist.barrier()
            if i >= warmup:
                times[v].append(time.perf_counter() - t0)
            breaks[v] = breaks.get(v, 0) + sum(counters["graph_break"].values()) - before
            if i == warmup - 1:
                h = built[v][2]
                graphs_after[v] = h.graphs if h is not None else None
    out: dict[str, Any] = {}
    for v, (_, model, handle, _) in built.items():
        params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
        graphs = handle.graphs if handle is not None else None  # a compile handle or CompileStats
        out[v] = {
            "step_s": statistics.median(times[v]),
            "steps_s": times[v],
            "param_bytes_per_rank": sum(params.values()),
            "graph_breaks": breaks[v],
            "graphs_total": graphs,
            "graphs_after_warmup": graphs_after.get(v),
        }
        if getattr(handle, "graph_stats", None) is not None:
            gs = handle.graph_stats
            out[v]["graph_mode"] = {
                "forward_gathers": gs.forward_gathers,
                "backward_gathers": gs.backward_gathers,
                "backward_reduce_scatters": gs.backward_reduce_scatters,
                "saved_unit_bytes": gs.saved_unit_bytes,
                "saved_root_bytes": gs.saved_always_bytes,
            }
            if handle.plan is not None:
                out[v]["graph_mode"]["plan"] = {
                    "budget_bytes": handle.plan.budget_bytes,
                    "kept": handle.plan.kept,
                    "kept_bytes": handle.plan.kept_bytes,
                    "units": [p.unit for p in handle.plan.profile],
                }
    out["_comm"] = _comm_breakdown(built)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--model",
        choices=("bench", "small"),
        default="bench",
        help="bench: the benchmark GPT of benchmarks/zero3.py (BenchConfig: d512 x 6, seq 256, 8 "
        "samples/rank); small: d256 x 4, seq 128, 4 samples/rank (latency-bound on gloo)",
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model and fewer steps (smoke run)")
    parser.add_argument(
        "--timed",
        type=int,
        default=None,
        help="timed steps (default: 8 for --model bench, 12 for small, 4 with --quick)",
    )
    args = parser.parse_args()
    if args.quick:
        cfg, batch, timed = GPTConfig(vocab_size=256, seq_len=64, d_model=128, n_layer=2, n_head=4), 4, 4
    elif args.model == "small":
        cfg, batch, timed = GPTConfig(vocab_size=256, seq_len=128, d_model=256, n_layer=4, n_head=4), 4, 12
    else:
        from _bench_common import BenchConfig  # the script's folder is on sys.path, as for the other benchmarks

        b = BenchConfig()
        cfg = GPTConfig(
            vocab_size=b.vocab_size, seq_len=b.seq_len, d_model=b.d_model, n_layer=b.n_layer, n_head=b.n_head
        )
        batch, timed = b.micro_batch, 8
    warmup, timed = 3, args.timed or timed
    results: dict[str, Any] = {
        "model": "quick" if args.quick else args.model,
        "config": cfg.__dict__,
        "per_rank_batch": batch,
        "warmup": warmup,
        "timed": timed,
        "world": 2,
        "device": "cpu (gloo, 1 thread per rank)",
        "variants": {},
        "load_avg_start": os.getloadavg(),
    }
    t0 = time.time()
    variants = run_distributed(_worker, 2, cfg, batch, warmup, timed, timeout=3600)[0]
    results["comm_breakdown_s"] = variants.pop("_comm")
    results["variants"] = variants
    results["unshard_budget"] = BUDGET
    results["wall_s"] = round(time.time() - t0, 1)
    results["load_avg_end"] = os.getloadavg()
    r = results["variants"]
    ddp_c = r["ddp_compiled"]["step_s"]
    results["ratios"] = {
        "zero3_compiled_unit_speedup_vs_eager": r["zero3_eager"]["step_s"] / r["zero3_compiled_unit"]["step_s"],
        "zero3_compiled_graph_speedup_vs_eager": r["zero3_eager"]["step_s"] / r["zero3_compiled_graph"]["step_s"],
        "zero3_compiled_graph_budget_speedup_vs_eager": r["zero3_eager"]["step_s"]
        / r["zero3_compiled_graph_budget"]["step_s"],
        "zero3_compiled_unit_vs_ddp_compiled_time": r["zero3_compiled_unit"]["step_s"] / ddp_c,
        "zero3_compiled_graph_vs_ddp_compiled_time": r["zero3_compiled_graph"]["step_s"] / ddp_c,
        "zero3_compiled_graph_budget_vs_ddp_compiled_time": r["zero3_compiled_graph_budget"]["step_s"] / ddp_c,
        "zero3_compiled_graph_keep_all_vs_ddp_compiled_time": r["zero3_compiled_graph_keep_all"]["step_s"] / ddp_c,
        "tp2_vs_dp2_time": r["tp2"]["step_s"] / r["dp2_ddp"]["step_s"],
        "tp2_vs_dp2_param_bytes": r["tp2"]["param_bytes_per_rank"] / r["dp2_ddp"]["param_bytes_per_rank"],
    }
    c = results["comm_breakdown_s"]
    compute = r["compute_only_compiled"]["step_s"]
    results["breakdown"] = {
        "compute_only_eager_s": r["compute_only_eager"]["step_s"],
        "compute_only_compiled_s": compute,
        "zero3_graph_minus_compute_s": r["zero3_compiled_graph"]["step_s"] - compute,
        "ddp_compiled_minus_compute_s": ddp_c - compute,
        "zero3_comm_alone_s": c["zero3_comm_s"],
        "zero3_budget_comm_alone_s": c["zero3_budget_comm_s"],
        "ddp_comm_alone_s": c["ddp_comm_s"],
        "floor_zero3_vs_ddp_compiled": (compute + c["zero3_comm_s"]) / (compute + c["ddp_comm_s"]),
    }
    out_dir = ROOT / "benchmarks" / "results"
    stem = "compile_inject" if results["model"] == "bench" else f"compile_inject_{results['model']}"
    (out_dir / f"{stem}.json").write_text(json.dumps(results, indent=2))
    lines = [
        "# compile + inject benchmark",
        "",
        f"GPT {cfg.d_model}d x {cfg.n_layer} layers, seq {cfg.seq_len}, {batch} samples/rank/step (TP: "
        f"{2 * batch} on the one replica), 2 gloo ranks on CPU, median of {timed} steps after {warmup} "
        "warm-up; all variants live in the same 2 processes and are stepped round-robin (each step bracketed by "
        "barriers) so they share the machine's load. `zero3_compiled_graph_budget` uses "
        f'`CompileConfig(mode="graph", unshard_budget={BUDGET})` (half of the units\' gathered bytes may stay '
        "unsharded from forward to backward); `zero3_compiled_graph_keep_all` uses `unshard_budget=1.0` (every "
        "unit "
        "stays gathered from its forward to its backward: no backward re-gathers, sharded optimizer state and "
        "gradients). `compute_only_eager`/`compute_only_compiled` are the same model and step with no "
        "communication (each rank alone, eager / torch.compile).",
        "",
        f"Load average (1/5/15 min) at start {results['load_avg_start']}, at end {results['load_avg_end']}; "
        f"wall {results['wall_s']} s.",
        "",
        "| variant | step (s) | param bytes / rank | graph breaks | graphs compiled (after warm-up / end) |",
        "|---|---|---|---|---|",
    ]
    for v, x in r.items():
        g = "-" if x["graphs_total"] is None else f"{x['graphs_after_warmup']} / {x['graphs_total']}"
        lines.append(f"| {v} | {x['step_s']:.4f} | {x['param_bytes_per_rank']:,} | {x['graph_breaks']} | {g} |")
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in results["ratios"].items()]
    lines += [
        "",
        "Breakdown (seconds per step; communication timed alone, synchronously, same processes):",
        "",
        "| quantity | value |",
        "|---|---|",
    ] + [f"| {k} | {v:.4f} |" for k, v in results["breakdown"].items()]
    for v in ("zero3_compiled_graph", "zero3_compiled_graph_budget", "zero3_compiled_graph_keep_all"):
        gm = r[v].get("graph_mode")
        if gm:
            lines.append(f"\n`{v}` compiled graphs: {json.dumps(gm)}")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
