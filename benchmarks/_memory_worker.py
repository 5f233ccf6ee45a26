"""One rank of ``benchmarks/memory.py``: trains the states-dominated model for N steps and records, after every
step, the peak resident growth of this process and the step time.

Runs in the project's venv (``ddp``, ``fsdp2``, ``zstack_*``) or in ``benchmarks/.venv-deepspeed``
(``deepspeed``): it imports only torch at module level. ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` come
from the launcher.

[Note: what "peak resident growth" is]
The baseline is this process's resident set right after the process group exists and before the model is built
(for Lightning variants: the LightningModule's ``setup`` hook, which Lightning calls after initialising the group;
the peak counter ``VmHWM`` is reset there through ``/proc/self/clear_refs``). After step k the worker records
``VmHWM - baseline``: the most memory the process has held since, whatever held it (shards, gathered units,
gradients, optimizer state, allocator slack, gloo, Python). Every variant builds its model after the baseline without
a full copy per rank where the framework allows it (``configure_model`` on the meta device, FSDP2 on meta then
``to_empty``, ``deepspeed.zero.Init``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{field}:"))


def _reset_peak() -> int:
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def build_blocks(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


class LMBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))


class LanguageModel(nn.Module):
    """``--model lm``: embedding, ``depth`` MLP blocks, final norm and an untied head (most parameters are the
    embedding and the head when the vocabulary is large)."""

    def __init__(self, vocab: int, width: int, depth: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(LMBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))


def build_model(args: argparse.Namespace) -> nn.Module:
    if args.model == "lm":
        return LanguageModel(args.vocab, args.width, args.depth)
    return build_blocks(args.width, args.depth)


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    if batch.dtype == torch.long:  # token ids: next-token cross-entropy
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    return model(batch).pow(2).mean()


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 wraps before the root: every block, and for the language model also the embedding and
    the head (as torchtitan does)."""
    if isinstance(model, LanguageModel):
        return [model.emb, *model.layers, model.head]
    return list(model)


class Recorder:
    """Peak growth and wall time per step (see [Note: what "peak resident growth" is])."""

    def __init__(self) -> None:
        self.baseline = 0
        self.peaks: list[int] = []
        self.times: list[float] = []
        self._t = 0.0

    def start(self) -> None:
        self.baseline = _reset_peak()

    def step_begin(self) -> None:
        self._t = time.perf_counter()

    def step_end(self) -> None:
        self.times.append(time.perf_counter() - self._t)
        self.peaks.append(_status("VmHWM") - self.baseline)


def batches(args: argparse.Namespace, rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    if args.model == "lm":
        return [torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    return [torch.randn(args.micro_batch, args.width, generator=g) for _ in range(args.steps)]


def run_lightning(args: argparse.Namespace, rec: Recorder) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    import zlightning  # noqa: F401  (registers the zstack strategy names)

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: nn.Module | None = None

        def setup(self, stage: str) -> None:
            rec.start()

        def configure_model(self) -> None:
            if self.net is None:
                self.net = build_model(args)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return loss_of(self.net, batch)

        def on_train_batch_start(self, *a: Any) -> None:
            rec.step_begin()

        def on_train_batch_end(self, *a: Any) -> None:
            rec.step_end()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    strategy: Any = args.variant
    swap = None
    if args.variant == "zstack_zero3_nvme":
        from zlightning.strategies import ZStackZero3Strategy

        from zlightning.zero import NVMeOffload

        swap = tempfile.mkdtemp(prefix="zl-memory-bench-", dir=args.swap_dir)
        strategy = ZStackZero3Strategy(offload_optimizer=NVMeOffload(path=swap), offload_params=NVMeOffload(path=swap))
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
    )
    data = batches(args, int(os.environ["RANK"]))
    trainer.fit(Module(), DataLoader(data, batch_size=None))


def run_fsdp2(args: argparse.Namespace, rec: Recorder) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rec.start()
    with torch.device("meta"):
        model = build_model(args)
    for block in shard_units(model):
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for x in batches(args, dist.get_rank()):
        rec.step_begin()
        loss_of(model, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.step_end()
    dist.destroy_process_group()


def run_deepspeed(args: argparse.Namespace, rec: Recorder) -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(args.threads)
    rec.start()
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000_000,
        "wall_clock_breakdown": False,
    }
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    torch.set_num_threads(args.threads)
    for x in batches(args, dist.get_rank()):
        rec.step_begin()
        engine.backward(loss_of(engine, x))
        engine.step()
        rec.step_end()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True)
    p.add_argument("--model", choices=("mlp", "lm"), default="mlp")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--width", type=int, required=True)
    p.add_argument("--depth", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--swap-dir", default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rec = Recorder()
    try:
        if args.variant == "fsdp2":
            run_fsdp2(args, rec)
        elif args.variant == "deepspeed":
            run_deepspeed(args, rec)
        else:
            run_lightning(args, rec)
        result: dict[str, Any] = {"status": "ok", "peaks": rec.peaks, "times": rec.times}
    except BaseException as err:  # noqa: BLE001  (reported by the launcher)
        import traceback

        traceback.print_exc()
        result = {"status": "error", "error": f"{type(err).__name__}: {err}"}
    args.out.write_text(json.dumps(result))
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
