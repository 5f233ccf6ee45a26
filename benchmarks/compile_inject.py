"""Issue 7 benchmark: compiled vs eager ZeRO-3 (vs compiled DDP), and TP=2 vs DP=2, on the benchmark GPT.

Run: ``python benchmarks/compile_inject.py [--quick]``. Every variant runs on 2 gloo ranks (1 thread each) and trains
`examples.gpt_model.GPT` on the same tokens; the step time is the median wall time of the timed steps after warm-up
(warm-up covers the torch.compile work; all variants are stepped round-robin in the same two processes). Writes ``benchmarks/results/compile_inject.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from examples.gpt_model import GPT, GPTConfig  # noqa: E402
from zlightning.testing import run_distributed  # noqa: E402

VARIANTS = ("zero3_eager", "zero3_compiled", "ddp_compiled", "dp2_ddp", "tp2")


def _batches(cfg: GPTConfig, n: int, batch: int, rank_key: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank_key)
    return [torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=g) for _ in range(n)]


def _build(variant: str, cfg: GPTConfig) -> tuple[Callable[[torch.Tensor, torch.Tensor], None], torch.nn.Module,
                                                    Any, int]:
    """One variant on this rank: (step function, model, compile handle or None, data rank)."""
    from zlightning.compile import CompileConfig, compile_zero3
    from zlightning.inject import apply_tensor_parallel
    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.manual_seed(0)
    model = GPT(cfg)
    if variant.startswith("zero3"):
        zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig())
        handle = compile_zero3(zero.state, CompileConfig()) if variant == "zero3_compiled" else None

        def zstep(x: torch.Tensor, y: torch.Tensor) -> None:
            zero.backward(model(x, y)[1])
            zero.step()

        return zstep, model, handle, dist.get_rank()
    data_rank = dist.get_rank()
    net: torch.nn.Module = model
    if variant == "tp2":
        data_rank = apply_tensor_parallel(model, 2).dp_rank  # both ranks form one TP group: same batch
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        net = torch.compile(net) if variant == "ddp_compiled" else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        net(x, y)[1].backward()
        opt.step()

    return step, model, None, data_rank


def _worker(rank: int, world: int, cfg: GPTConfig, batch: int, warmup: int, timed: int) -> dict[str, Any]:
    """All variants in the same two processes, stepped round-robin, so they share the machine's load equally."""
    from torch._dynamo.utils import counters

    built = {v: _build(v, cfg) for v in VARIANTS}
    data = {v: _batches(cfg, warmup + timed, batch * (2 if v == "tp2" else 1), built[v][3]) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    breaks: dict[str, int] = {}
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
    out = {}
    for v, (_, model, handle, _) in built.items():
        params = {id(p): p.numel() * p.element_size() for p in model.parameters()}
        out[v] = {"step_s": statistics.median(times[v]), "steps_s": times[v],
                  "param_bytes_per_rank": sum(params.values()), "graph_breaks": breaks[v],
                  "graphs_total": handle.stats.graphs if handle is not None else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer steps")
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=256, seq_len=64 if args.quick else 128, d_model=128 if args.quick else 256,
                    n_layer=2 if args.quick else 4, n_head=4)
    batch, warmup, timed = 4, 3, 4 if args.quick else 8
    results: dict[str, Any] = {"config": cfg.__dict__, "per_rank_batch": batch, "warmup": warmup, "timed": timed,
                               "world": 2, "device": "cpu (gloo, 1 thread per rank)", "variants": {}}
    t0 = time.time()
    results["variants"] = run_distributed(_worker, 2, cfg, batch, warmup, timed, timeout=1800)[0]
    results["wall_s"] = round(time.time() - t0, 1)
    r = results["variants"]
    results["ratios"] = {
        "zero3_compiled_speedup_vs_eager": r["zero3_eager"]["step_s"] / r["zero3_compiled"]["step_s"],
        "zero3_compiled_vs_ddp_compiled_time": r["zero3_compiled"]["step_s"] / r["ddp_compiled"]["step_s"],
        "tp2_vs_dp2_time": r["tp2"]["step_s"] / r["dp2_ddp"]["step_s"],
        "tp2_vs_dp2_param_bytes": r["tp2"]["param_bytes_per_rank"] / r["dp2_ddp"]["param_bytes_per_rank"],
    }
    out_dir = ROOT / "benchmarks" / "results"
    (out_dir / "compile_inject.json").write_text(json.dumps(results, indent=2))
    lines = ["# compile + inject benchmark (issue 7)", "",
             f"GPT {cfg.d_model}d x {cfg.n_layer} layers, seq {cfg.seq_len}, {batch} samples/rank/step (TP: "
             f"{2 * batch} on the one replica), 2 gloo ranks on CPU, median of {timed} steps after {warmup} "
             "warm-up; all variants live in the same 2 processes and are stepped round-robin (each step bracketed by "
             "barriers) so they share the machine's load.", "",
             "| variant | step (s) | param bytes / rank | graph breaks | graphs compiled |", "|---|---|---|---|---|"]
    for v, x in r.items():
        lines.append(f"| {v} | {x['step_s']:.4f} | {x['param_bytes_per_rank']:,} | {x['graph_breaks']} | "
                     f"{x['graphs_total'] if x['graphs_total'] is not None else '-'} |")
    lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in results["ratios"].items()]
    (out_dir / "compile_inject.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
