"""Hybrid CP on the real corpus: rank idle time per cost model, balance vs plain DP packing, wrapper overhead.

Used by ``benchmarks/hybrid_cp.py`` (``--skip-training`` leaves it out). Three measurements:

1. **Per-shard compute, measured.** One process (1 thread) times forward+backward of the example GPT on a rank's
   share of a sub-sample: ``L / c`` query tokens attending over ``L`` keys (K/V repeated locally instead of gathered,
   so only compute is timed), over a grid of ``(L, c)``. `fit_cost` turns the grid into the measured cost model that
   serves as the clock below (its worst relative error on the grid is reported).
2. **Idle time at group barriers.** Global batches of the real corpus (standard-library ``.py`` files, packed into
   ``seq_len`` windows by `PackedDocumentDataset`, ``batch`` windows per data replica, ``ranks`` replicas) are
   scheduled by `schedule_hybrid_cp` with the default ``L**2`` cost, with the shape-derived `transformer_cost`, and
   with the measured cost; plain DP packing (every replica runs its own windows' documents, no CP) is the baseline.
   Each schedule is clocked with the measured model: step time ``sum_g max_r busy``, idle fraction
   ``sum_g sum_r (max - busy_r) / (ranks * step time)``.
3. **Wrapper overhead.** ``ranks_overhead`` gloo processes iterate the real packed loader plain and through
   `HybridCPDataLoaderWrapper` (unpack, length all-gather, schedule, all-to-all); the difference per step is the
   wrapper's cost, compared with the measured compute of one step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from zlightning.datamodules import TextCorpusDataModule
from zlightning.datamodules.hybrid_cp import (
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    PackedDocumentDataset,
    TransformerShape,
    fit_cost,
    schedule_hybrid_cp,
    transformer_cost,
    unpack_packed_batch,
)

from examples.gpt_model import GPT, GPTConfig
from zlightning.testing import run_distributed

MODEL = GPTConfig(vocab_size=256, seq_len=4096, d_model=128, n_layer=2, n_head=4)
SEQ_LEN = 4096
MAX_SEQLEN_PER_RANK = 1024
RANKS = 8
BATCH = 2
GRID_LENGTHS = (128, 512, 1024, 2048, 4096)
GRID_CPS = (1, 2, 4, 8)


class _LocalKV(TorchFunctionMode):
    """Causal SDPA of ``t`` queries over ``c * t`` keys (the local K/V repeated): a CP rank's attention compute."""

    def __init__(self, cp: int) -> None:
        super().__init__()
        self.cp = cp

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.cp == 1:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        t = q.shape[2]
        mask = torch.ones(t, self.cp * t, dtype=torch.bool).tril(diagonal=(self.cp - 1) * t)
        return F.scaled_dot_product_attention(q, k.repeat(1, 1, self.cp, 1), v.repeat(1, 1, self.cp, 1), attn_mask=mask)


def measure_shard_costs(reps: int = 2) -> list[tuple[int, int, float]]:
    """``(L, c, seconds)``: min over ``reps`` of forward+backward of one rank's share of a sub-sample."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = GPT(MODEL)
    out = []
    for length in GRID_LENGTHS:
        for cp in GRID_CPS:
            t = length // cp
            tokens = torch.randint(0, 256, (1, t))
            best = float("inf")
            for _ in range(reps):
                start = time.perf_counter()
                with _LocalKV(cp):
                    logits, _ = model(tokens)
                logits.float().logsumexp(-1).sum().backward()
                best = min(best, time.perf_counter() - start)
                model.zero_grad(set_to_none=True)
            out.append((length, cp, best))
    return out


def corpus_batches(num_batches: int, max_bytes: int) -> list[list[list[int]]]:
    """``batches[b][replica]``: the sub-sample lengths each replica contributes to global batch ``b``."""
    dm = TextCorpusDataModule(seq_len=SEQ_LEN, max_bytes=max_bytes, batch_size=BATCH)
    dm.setup("fit")
    assert dm.train_dataset is not None
    docs = PackedDocumentDataset(dm.train_dataset, 2 * RANKS)
    order = torch.randperm(len(docs), generator=torch.Generator().manual_seed(0)).tolist()
    need = RANKS * BATCH
    batches = []
    for b in range(min(num_batches, len(order) // need)):
        ids = order[b * need : (b + 1) * need]
        batches.append([[int(x) for x in _lengths(docs, ids[r * BATCH : (r + 1) * BATCH])] for r in range(RANKS)])
    return batches


def _lengths(docs: PackedDocumentDataset, ids: list[int]) -> list[int]:
    return [int(s["tokens"].shape[0]) for s in unpack_packed_batch([docs[i] for i in ids])]


def _clock(schedule: list[list[list[int]]], seqlens: list[int], clock: Any) -> tuple[float, float]:
    """(step time, idle rank-time) of a schedule under the measured clock."""
    cps: dict[tuple[int, int], int] = {}
    for g, group in enumerate(schedule):
        for ids in group:
            for gid in ids:
                cps[(g, gid)] = sum(gid in other for other in group)
    step, idle = 0.0, 0.0
    for g, group in enumerate(schedule):
        busy = [sum(clock(seqlens[gid], cps[(g, gid)]) for gid in ids) for ids in group]
        step += max(busy)
        idle += sum(max(busy) - b for b in busy)
    return step, idle


def idle_time(batches: list[list[list[int]]], measured: list[tuple[int, int, float]]) -> dict[str, Any]:
    clock = fit_cost(measured)
    fit_err = max(abs(clock(n, c) - s) / s for n, c, s in measured)
    models = {
        "l2": None,
        "shape": transformer_cost(TransformerShape.of(MODEL)),
        "measured": clock,
    }
    rows: dict[str, dict[str, list[float]]] = {k: {"step": [], "idle": [], "ms": []} for k in ["dp_packing", *models]}
    for replicas in batches:
        seqlens = [n for rep in replicas for n in rep]
        offsets = [0]
        for rep in replicas:
            offsets.append(offsets[-1] + len(rep))
        dp = [[list(range(offsets[r], offsets[r + 1])) for r in range(RANKS)]]
        step, idle = _clock(dp, seqlens, clock)
        rows["dp_packing"]["step"].append(step)
        rows["dp_packing"]["idle"].append(idle / (RANKS * step))
        for name, cost in models.items():
            start = time.perf_counter()
            schedule = schedule_hybrid_cp(seqlens, RANKS, MAX_SEQLEN_PER_RANK, cost)
            rows[name]["ms"].append(1e3 * (time.perf_counter() - start))
            step, idle = _clock(schedule, seqlens, clock)
            rows[name]["step"].append(step)
            rows[name]["idle"].append(idle / (RANKS * step))
    ideal = statistics.mean(sum(clock(n, 1) for rep in r for n in rep) / RANKS for r in batches)
    summary = {
        name: {
            "step_s": statistics.mean(v["step"]),
            "idle_fraction": statistics.mean(v["idle"]),
            "schedule_ms": statistics.mean(v["ms"]) if v["ms"] else 0.0,
        }
        for name, v in rows.items()
    }
    return {
        "summary": summary,
        "ideal_cp1_step_s": ideal,
        "measured_cost": {
            "linear_s_per_token": clock.linear,
            "quadratic_s_per_pair": clock.quadratic,
            "crossover_tokens": clock.crossover_length,
            "max_rel_fit_error": fit_err,
        },
        "shape_cost_crossover_tokens": transformer_cost(TransformerShape.of(MODEL)).crossover_length,
        "global_batches": len(batches),
        "subsamples_per_batch": statistics.mean(sum(len(r) for r in b) for b in batches),
    }


def _overhead_worker(rank: int, world: int, steps: int, max_bytes: int) -> dict[str, float]:
    dm = TextCorpusDataModule(seq_len=SEQ_LEN, max_bytes=max_bytes, batch_size=BATCH)
    dm.setup("fit")
    assert dm.train_dataset is not None
    docs = PackedDocumentDataset(dm.train_dataset, 2 * world)
    mine = list(range(rank * BATCH, len(docs), world * BATCH))[: steps + 1]
    batches = [[docs[j] for j in range(i, i + BATCH)] for i in mine]
    torch.distributed.barrier()
    start = time.perf_counter()
    for batch in batches:
        unpack_packed_batch(batch)  # what a plain packed loop does with the batch it already has
    plain = (time.perf_counter() - start) / len(batches)
    config = HybridCPConfig(max_seqlen_per_rank=SEQ_LEN // world)  # the longest window fits on all ranks
    wrapper = iter(HybridCPDataLoaderWrapper(batches, config))
    next(wrapper)  # warm-up: first collectives
    torch.distributed.barrier()
    start = time.perf_counter()
    n = 0
    for _ in wrapper:
        n += 1
    wrapped = (time.perf_counter() - start) / max(n, 1)
    return {"plain_ms": 1e3 * plain, "wrapper_ms": 1e3 * wrapped, "steps": float(n)}


def wrapper_overhead(world: int, steps: int, max_bytes: int) -> dict[str, Any]:
    runs = run_distributed(_overhead_worker, world, steps, max_bytes, timeout=600)
    return {
        "ranks": world,
        "steps": int(runs[0]["steps"]),
        "plain_unpack_ms": statistics.mean(r["plain_ms"] for r in runs),
        "wrapper_next_ms": statistics.mean(r["wrapper_ms"] for r in runs),
    }
