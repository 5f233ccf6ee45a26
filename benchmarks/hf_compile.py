"""Compiled vs eager training steps of a Hugging Face Llama (`zlightning.models.HFCausalLM`) under ``zstack_zero3``.

Run: ``python benchmarks/hf_compile.py [--quick]``. Each world size (1 and 2 gloo ranks on CPU, 1 thread each) trains
the same byte-level ``LlamaForCausalLM`` built from a config (hidden 256, 4 decoder layers, 4 heads with 2 key/value
heads, sequence 128, 4 samples per rank) through a Lightning ``Trainer`` with ``ZStackZero3Strategy()`` and
``ZStackZero3Strategy(compile=True)`` (per-unit mode: each decoder layer is a ZeRO unit whose forward is compiled).
The variants alternate (eager, compiled, eager, ...) in the same processes, so a change in the machine's load
touches both. A step's time is the interval between the ends of two consecutive training batches; the first
``--warmup`` intervals (the compile work, lazy optimizer state) are dropped and the median of the rest is reported,
over both repeats. Per compiled run the Dynamo frames and graphs compiled are counted (one graph for all decoder
layers is the expected outcome) with any ``recompile_limit`` message, and the losses are compared with eager.
Writes ``benchmarks/results/hf_compile.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from zlightning.integrations.huggingface import _load_hub_kernels
from zlightning.testing import run_distributed

ROOT = Path(__file__).resolve().parent.parent

CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}
SEQ, MICRO = 128, 4
VARIANTS = ("eager", "compiled")


def _rank(rank: int, world: int, warmup: int, timed: int, repeats: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.utils.data import DataLoader, TensorDataset
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.models.hf_causal_lm import HFCausalLM

    class Clock(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.ends.append(time.perf_counter())
            self.losses.append(float(outputs["loss"]))

    class Messages(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    steps = warmup + timed + 1
    ids = torch.randint(
        0, CONFIG["vocab_size"], (steps * MICRO * world, SEQ + 1), generator=torch.Generator().manual_seed(0)
    )
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    out: dict[str, Any] = {v: {"intervals": [], "losses": [], "frames": 0, "graphs": 0, "limit": []} for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            torch._dynamo.reset()  # every compiled run compiles from scratch (the inductor cache on disk may help)
            counters.clear()
            messages = Messages()
            logging.getLogger("torch._dynamo").addHandler(messages)
            pl.seed_everything(0, verbose=False)
            module = HFCausalLM(config=CONFIG, warmup_steps=0)
            clock = Clock()
            trainer = pl.Trainer(
                strategy=ZStackZero3Strategy(compile=variant == "compiled"),
                accelerator="cpu",
                devices=world,
                max_steps=steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                limit_val_batches=0,
                callbacks=[clock],
            )
            trainer.fit(module, DataLoader(data, batch_size=MICRO))
            logging.getLogger("torch._dynamo").removeHandler(messages)
            intervals = [b - a for a, b in zip(clock.ends, clock.ends[1:])][warmup:]
            row = out[variant]
            row["intervals"] += intervals
            row["losses"] = clock.losses
            row["frames"] = max(row["frames"], counters["frames"]["total"])
            row["graphs"] = max(row["graphs"], counters["stats"]["unique_graphs"])
            row["limit"] += [m[:200] for m in messages.lines if "recompile_limit" in m]
    return out


def _summary(world: int, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    rank0 = ranks[0]
    eager = statistics.median(rank0["eager"]["intervals"])
    compiled = statistics.median(rank0["compiled"]["intervals"])
    losses = zip(rank0["eager"]["losses"], rank0["compiled"]["losses"])
    return {
        "world_size": world,
        "eager_step_s": round(eager, 4),
        "compiled_step_s": round(compiled, 4),
        "compiled_over_eager": round(compiled / eager, 3),
        "timed_intervals": len(rank0["eager"]["intervals"]),
        "dynamo_frames": rank0["compiled"]["frames"],
        "dynamo_graphs": rank0["compiled"]["graphs"],
        "recompile_limit_messages": sum(len(r["compiled"]["limit"]) for r in ranks),
        "loss_max_rel_diff": max(abs(c - e) / abs(e) for e, c in losses),
    }


def _markdown(result: dict[str, Any]) -> str:
    m = result["meta"]
    lines = [
        "# Hugging Face Llama: compiled vs eager steps under zstack_zero3",
        "",
        f"`LlamaForCausalLM` from a config (hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} decoder "
        f"layers, {CONFIG['num_attention_heads']} heads / {CONFIG['num_key_value_heads']} key-value heads, byte "
        f"vocabulary, tied embeddings), sequence {SEQ}, {MICRO} samples per rank, as `zlightning.models.HFCausalLM` "
        "through a Lightning `Trainer` with `ZStackZero3Strategy()` (eager) and `ZStackZero3Strategy(compile=True)` "
        "(per-unit mode: each decoder layer's forward compiled by Inductor). CPU, gloo, 1 thread per rank. Step time: "
        f"median interval between the ends of consecutive training batches, after {m['warmup']} warm-up intervals "
        f"(they hold the compile), {m['timed']} timed intervals per run, {m['repeats']} runs per variant alternating "
        "eager and compiled. Ratio below 1: the compiled step is faster. Dynamo frames/graphs: what the compiled run "
        "compiled (one graph shared by the decoder layers is expected); recompile-limit messages: Dynamo's "
        "`hit config.recompile_limit` warnings, all ranks. Loss difference: largest relative difference between "
        "the eager and compiled losses of one run, step by step.",
        "",
        "| ranks | eager step (s) | compiled step (s) | compiled / eager | Dynamo frames | Dynamo graphs "
        "| recompile-limit messages | loss max rel. diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['world_size']} | {r['eager_step_s']:.4f} | {r['compiled_step_s']:.4f} | "
            f"{r['compiled_over_eager']:.3f} | {r['dynamo_frames']} | {r['dynamo_graphs']} | "
            f"{r['recompile_limit_messages']} | {r['loss_max_rel_diff']:.1e} |"
        )
    lines += [
        "",
        f"Machine: {m['cpus']} CPUs ({m['machine']}), torch {m['torch']}, transformers {m['transformers']}; load "
        f"average {m['load_before']} before and {m['load_after']} after (the machine was shared, so the absolute "
        "times carry that noise; the alternating order keeps the ratio fair).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warmup", type=int, default=3, help="untimed intervals per run (the compile happens there)")
    p.add_argument("--timed", type=int, default=20, help="timed intervals per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per variant, alternating eager and compiled")
    p.add_argument("--worlds", default="1,2", help="world sizes, comma-separated")
    p.add_argument("--quick", action="store_true", help="1 repeat of 4 timed intervals (a smoke run)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hf_compile"), help="output path stem")
    a = p.parse_args()
    if a.quick:
        a.timed, a.repeats = 4, 1
    _load_hub_kernels()  # before transformers: see the note beside it
    import transformers

    load_before = os.getloadavg()[0]
    rows = []
    for world in (int(w) for w in a.worlds.split(",")):
        ranks = run_distributed(_rank, world, a.warmup, a.timed, a.repeats, init_process_group=False, timeout=1800)
        rows.append(_summary(world, ranks))
        print(json.dumps(rows[-1]), flush=True)
    meta = {
        "warmup": a.warmup,
        "timed": a.timed,
        "repeats": a.repeats,
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "config": CONFIG,
        "seq_len": SEQ,
        "micro_batch": MICRO,
    }
    result = {"meta": meta, "rows": rows}
    Path(a.out).with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    Path(a.out).with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
