"""Fused-kernel injection benchmark: `FusedMLP` vs the original MLP modules, forward + backward on CPU.

For each MLP (the example GPT's ``Linear -> GELU -> Linear`` and a Llama-like gated SiLU MLP) it times one training
forward + backward of the original module and of its ``module_inject`` replacement, interleaved round-robin (so both
see the same machine load), and counts the bytes autograd saves for backward (a ``saved_tensors_hooks`` count,
deduplicated by storage: deterministic, unlike RSS). Results: ``benchmarks/results/inject_kernels.{json,md}``.

Run (timed runs take the shared lock)::

    flock /tmp/zl_bench.lock .venv/bin/python benchmarks/inject_kernels.py [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.gpt_model import MLP, GPTConfig  # noqa: E402
from zlightning.inject import FusedMLP, InjectPolicy, module_inject  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class GatedMLP(nn.Module):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _fused(module: nn.Module, mode: str) -> nn.Module:
    holder = nn.Sequential(copy.deepcopy(module))
    module_inject(holder, InjectPolicy(fuse_mlp=mode))  # type: ignore[arg-type]
    if not isinstance(holder[0], FusedMLP):
        raise RuntimeError(f"module_inject did not fuse {type(module).__name__}")
    return holder[0]


def _step(module: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> None:
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x).backward(gy)


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage().data_ptr()
        if not isinstance(t, nn.Parameter) and storage != x.untyped_storage().data_ptr():  # activations only
            seen[storage] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum().backward()
    module.zero_grad(set_to_none=True)
    x.grad = None
    return sum(seen.values())


def _time(variants: dict[str, nn.Module], x: torch.Tensor, warmup: int, reps: int) -> dict[str, float]:
    gy = torch.randn(*x.shape[:-1], next(iter(variants.values()))(x).shape[-1])
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(warmup + reps):
        for name, module in variants.items():  # round-robin: the same load for every variant
            t0 = time.perf_counter()
            _step(module, x, gy)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run(quick: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    d, tokens = (128, 1024) if quick else (256, 4096)
    cases = {
        "gpt_mlp": MLP(GPTConfig(d_model=d, n_head=4)),
        "llama_gated_mlp": GatedMLP(d, 8 * d // 3 // 8 * 8),
    }
    rows = {}
    for name, module in cases.items():
        x = torch.randn(tokens // 256, 256, d, requires_grad=True)  # inside a model the input needs a gradient
        variants = {"original": module, "recompute": _fused(module, "recompute"), "save": _fused(module, "save")}
        t = _time(variants, x, warmup=3, reps=10 if quick else 20)
        saved = {k: _saved_bytes(m, x) for k, m in variants.items()}
        rows[name] = {"original_s": t["original"], "saved_bytes_original": saved["original"]}
        for mode in ("recompute", "save"):
            rows[name] |= {
                f"fused_{mode}_s": t[mode],
                f"speedup_{mode}": t["original"] / t[mode],
                f"saved_bytes_{mode}": saved[mode],
                f"saved_bytes_ratio_{mode}": saved[mode] / saved["original"],
            }
    return {
        "config": {
            "d_model": d,
            "tokens": tokens,
            "threads": torch.get_num_threads(),
            "quick": quick,
            "load_average_1min": os.getloadavg()[0],
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
        },
        "results": rows,
    }


def _markdown(out: dict[str, Any]) -> str:
    c = out["config"]
    lines = [
        "# Fused-kernel injection benchmark",
        "",
        f"`FusedMLP` (from `module_inject`) vs the original MLP module, one training forward + backward on CPU: "
        f"d_model {c['d_model']}, {c['tokens']} tokens, {c['threads']} threads, torch {c['torch']}; median of "
        f"round-robin interleaved steps (machine load average {c['load_average_1min']:.1f} at the end: shared "
        f"machine, timings are noisy). Saved bytes: what autograd keeps for backward (activations other than the "
        f"input, deduplicated by storage; deterministic).",
        "",
        "| MLP | variant | fwd+bwd (ms) | speedup vs original | saved for backward (MB) | memory ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in out["results"].items():
        lines.append(
            f"| {name} | original | {r['original_s'] * 1e3:.2f} | 1.000 | "
            f"{r['saved_bytes_original'] / 2**20:.2f} | 1.000 |"
        )
        for mode in ("recompute", "save"):
            lines.append(
                f"| {name} | fused_mlp={mode} | {r[f'fused_{mode}_s'] * 1e3:.2f} | "
                f"{r[f'speedup_{mode}']:.3f} | {r[f'saved_bytes_{mode}'] / 2**20:.2f} | "
                f"{r[f'saved_bytes_ratio_{mode}']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions (a smoke run)")
    args = parser.parse_args()
    out = run(args.quick)
    stem = "inject_kernels_quick" if args.quick else "inject_kernels"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(_markdown(out))
    print(_markdown(out))


if __name__ == "__main__":
    main()
