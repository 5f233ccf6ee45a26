"""Shared pieces of the ZeRO-3 benchmark workers: config, model, data, timing and memory accounting.

This module imports only ``torch`` and the standard library, because it runs in two environments: the project's
``.venv`` (Lightning DDP, FSDP2, zstack_zero3) and ``benchmarks/.venv-deepspeed`` (DeepSpeed ZeRO-3). Every variant
therefore trains the same model (`examples.gpt_model.GPT`) on the same tokens with the same timing rule.

[Note: what a step time is]
A step's time is the wall-clock interval between the end of one optimizer step and the end of the next one, taken
with ``time.perf_counter()`` on each rank. It covers everything a training loop does for one micro-batch: fetching
the batch, forward, backward, gradient communication and the optimizer step (and, for Lightning, its hooks). With
``W`` warm-up steps and ``N`` timed steps a rank runs ``W + N`` steps and keeps the ``N`` intervals that end at steps
``W+1 .. W+N``; the first ``W`` steps (allocator growth, lazy optimizer state, first collectives) are excluded. Ranks
are kept in lock-step by their collectives, so their medians agree closely; each rank reports its own.

[Note: counting model-state bytes]
"Model state" is parameters + gradients + optimizer state resident on a rank after the last step (gradients are
still present then: every loop zeroes them with ``set_to_none`` *before* the next backward, not after the step).
Bytes are counted per distinct storage (``untyped_storage().nbytes()``, deduplicated by data pointer), so views
into one flat buffer (DeepSpeed's partitions, FSDP2's padded shards, a tied weight) count once, and padding that is
really allocated counts too. DTensors are counted through their local tensor. Communication buffers (DDP's reducer
buckets, FSDP2's all-gather outputs, DeepSpeed's reduce buckets) are not model state and are not counted; peak RSS
shows them.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

REPO_ROOT = Path(__file__).resolve().parent.parent
"""The repository root; put on ``sys.path`` so that ``examples.gpt_model`` imports without installing anything."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Everything that defines one benchmark run; identical for every variant.

    Raises:
        ValueError: If a size is not positive, ``warmup_steps < 1`` (the first timed interval needs a previous step
            end) or ``lr <= 0``.
    """

    vocab_size: int = 256
    """Token ids are bytes."""
    seq_len: int = 256
    """Tokens per sample."""
    d_model: int = 512
    """Width of the residual stream."""
    n_layer: int = 6
    """Transformer blocks (FSDP2 shards each one as a unit)."""
    n_head: int = 8
    """Attention heads per block."""
    micro_batch: int = 8
    """Samples per rank per step."""
    world_size: int = 2
    """Ranks (one process each)."""
    threads: int = 1
    """``torch.set_num_threads`` in every rank."""
    lr: float = 1e-4
    """AdamW learning rate (other AdamW arguments are torch's defaults)."""
    warmup_steps: int = 3
    """Untimed steps before the timed ones; see [Note: what a step time is]."""
    timed_steps: int = 10
    """Timed steps whose median is reported."""
    seed: int = 0
    """Seed for the model initialisation and the token stream."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head", "micro_batch", "world_size", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BenchConfig: {name} must be a positive int, got {value!r}.")
        if self.warmup_steps < 1 or self.timed_steps < 1:
            raise ValueError(
                f"BenchConfig: warmup_steps ({self.warmup_steps}) and timed_steps ({self.timed_steps}) must be >= 1; "
                "the first timed interval is measured from the end of the last warm-up step."
            )
        if not self.lr > 0:
            raise ValueError(f"BenchConfig: lr must be > 0, got {self.lr!r}.")

    @property
    def total_steps(self) -> int:
        """Warm-up plus timed steps."""
        return self.warmup_steps + self.timed_steps

    def to_json(self) -> str:
        """The config as a JSON string (passed to workers on their command line)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        """Inverse of `to_json`."""
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the group, read from the launcher's environment variables."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        """Reads ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``.

        Raises:
            RuntimeError: If one is missing (the worker was started by hand instead of by ``benchmarks/zero3.py``).
        """
        missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"benchmark worker: environment variables {missing} are not set; workers are launched by "
                "benchmarks/zero3.py, which sets them for each rank."
            )
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))


def worker_args(description: str, variants: Iterable[str]) -> argparse.Namespace:
    """Parses a worker's command line: ``--variant``, ``--config`` (JSON) and ``--out`` (a directory)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--variant", required=True, choices=sorted(variants))
    parser.add_argument("--config", required=True, help="BenchConfig as JSON (see _bench_common.BenchConfig).")
    parser.add_argument("--out", required=True, type=Path, help="Directory for rank<k>.json result files.")
    return parser.parse_args()


def setup_process(config: BenchConfig) -> None:
    """Pins the thread count and seeds torch's RNG, before any model or data is built."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)


def build_model(config: BenchConfig) -> nn.Module:
    """The benchmark GPT, initialised identically on every rank (seeded global RNG)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    from examples.gpt_model import GPT, GPTConfig

    torch.manual_seed(config.seed)
    return GPT(
        GPTConfig(
            vocab_size=config.vocab_size,
            seq_len=config.seq_len,
            d_model=config.d_model,
            n_layer=config.n_layer,
            n_head=config.n_head,
        )
    )


def make_batches(config: BenchConfig, rank: int) -> list[tuple[Tensor, Tensor]]:
    """This rank's ``(x, y)`` micro-batches for every step, each of shape [micro_batch, seq_len].

    All ranks (and all variants, in either venv) draw the same stream of random bytes from one seeded generator;
    rank ``r`` takes slice ``r`` of each step's ``world_size`` micro-batches, so together the ranks see the same
    global batch in every variant.
    """
    gen = torch.Generator().manual_seed(config.seed + 1)
    shape = (config.total_steps, config.world_size, config.micro_batch, config.seq_len + 1)
    tokens = torch.randint(0, config.vocab_size, shape, generator=gen, dtype=torch.int64)
    return [(step[rank, :, :-1].contiguous(), step[rank, :, 1:].contiguous()) for step in tokens]


class StepTimer:
    """Collects step-end timestamps; see [Note: what a step time is]."""

    def __init__(self, warmup_steps: int) -> None:
        self._warmup_steps = warmup_steps
        self._ends: list[float] = []

    def step_end(self) -> None:
        """Call right after each optimizer step."""
        self._ends.append(time.perf_counter())

    def timed_intervals(self) -> list[float]:
        """Seconds per timed step (intervals ending after the warm-up)."""
        ends = self._ends[self._warmup_steps - 1 :]
        return [b - a for a, b in zip(ends, ends[1:])]


def _local(t: Tensor) -> Tensor:
    """The tensor whose storage is resident here: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


class StorageCounter:
    """Sums the bytes of distinct storages; see [Note: counting model-state bytes]."""

    def __init__(self) -> None:
        self._seen: set[int] = set()

    def add(self, tensors: Iterable[Tensor | None]) -> int:
        """Adds the storages of ``tensors`` not counted yet (by this counter) and returns their bytes."""
        total = 0
        for t in tensors:
            if t is None:
                continue
            storage = _local(t).untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in self._seen:
                continue
            self._seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Every tensor in ``optimizer.state`` (AdamW: ``exp_avg``, ``exp_avg_sq`` and the ``step`` counter)."""
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, Tensor)]


def plain_model_state(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes of a model whose parameters are plain tensors or DTensors."""
    params = list(params)
    counter = StorageCounter()
    report = {
        "param_bytes": counter.add(params),
        "grad_bytes": counter.add(p.grad for p in params),
        "optimizer_bytes": counter.add(optimizer_state_tensors(optimizer)),
    }
    report["model_state_bytes"] = sum(report.values())
    return report


def full_model_state_bytes(model: nn.Module) -> dict[str, int]:
    """The unsharded fp32 model state: parameters, gradients and AdamW's two moments (4 copies of the parameters).

    Computed from the model before any wrapping; ``parameters()`` yields a tied weight once.
    """
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "param_bytes": param_bytes,
        "model_state_bytes": 4 * param_bytes,
    }


def current_rss_kib() -> int | None:
    """This process's resident set size now, in KiB (``VmRSS``), or None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def peak_rss_kib() -> int:
    """This process's peak resident set size (``ru_maxrss``: KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def write_rank_result(out_dir: Path, env: RankEnv, result: dict[str, Any]) -> None:
    """Writes ``rank<k>.json`` into ``out_dir`` (read back by ``benchmarks/zero3.py``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"rank": env.rank, "world_size": env.world_size, "peak_rss_kib": peak_rss_kib(), **result}
    tmp = out_dir / f"rank{env.rank}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(out_dir / f"rank{env.rank}.json")
