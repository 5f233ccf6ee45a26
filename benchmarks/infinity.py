"""ZeRO-Infinity's headline job on this machine: train a model whose fp32 parameters and Adam state do not fit in RAM.

Run ``.venv/bin/python benchmarks/infinity.py --swap-dir /local/disk/swap`` (not part of CI: it writes tens of GB
and runs for minutes; ``--quick`` trains a 0.2 B model for 4 steps into ``infinity_quick.*``).

What it does, each phase in its own process:

1. **Throughput**: our swapper writes then reads ``--probe-gib`` GiB on the swap disk (the same block size and queue
   depth as training), median of rotated rounds (``offload.py``'s ``swap_throughput``).
2. **Compute slice**: ``--slice`` blocks of the model, in memory (fp32 shards and CPU Adam state on the host,
   ``CPUOffload``), the same batch; the median step, scaled by ``blocks / slice``, is the compute time of one step.
3. **Training**: ``Trainer.fit`` with ``ZStackZero3Strategy`` on one rank, the model built in ``configure_model``
   (sharded initialisation from the meta device: no full copy ever exists in memory), parameters and Adam state in
   swap files (``NVMeOffload`` for both; the optimizer steps each group in backward as its gradient becomes final and
   frees the gradient: ``step_in_backward=True, release_gradients=True``), ``--steps`` optimizer steps. Each step's
   loss, wall time, swap bytes and the process's peak resident memory (``VmHWM``) are recorded; after ``fit`` the
   swap folder must be empty.

[Note: the lower bound of an offloaded step]
A step cannot be faster than its compute (phase 2) nor than moving its swap bytes at the measured throughput
(bytes read / read bandwidth + bytes written / write bandwidth, phase 1 and the step's own counters). With perfect
overlap the step takes the larger of the two: that is the lower bound the ratio is taken against. The sum of the two
(no overlap at all) is reported beside it.

The model is a residual MLP: ``blocks`` x (LayerNorm, Linear(width, 4 width), GELU, Linear(4 width, width)),
regressing a fixed random target from a fixed random batch of ``--rows`` rows (a state-dominated job: the batch is
tiny next to the weights, as in ZeRO-Infinity's own demonstrations).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(f"{field}:"))


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))


def block_params(width: int) -> int:
    """Parameters of one block: LayerNorm (2 width) + Linear(width, 4 width) + Linear(4 width, width)."""
    return 2 * width + (width * 4 * width + 4 * width) + (4 * width * width + width)


def build_blocks(count: int, width: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    return nn.Sequential(*[Block() for _ in range(count)])


def batch(rows: int, width: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def _nvme(swap: str, width: int, optimizer: bool) -> Any:
    from zlightning.zero import NVMeOffload

    if optimizer:  # sub-groups of half a Linear's shard; 3 tensors per sub-group x 3 in the pipeline
        return NVMeOffload(
            path=swap,
            buffer_size=2 * width * width,
            buffer_count=9,
            step_in_backward=True,
            release_gradients=True,
        )
    return NVMeOffload(path=swap, buffer_size=block_params(width), buffer_count=3)  # one unit per buffer


# ---------------------------------------------------------------------------------------------------- phase 2
def slice_worker(args: argparse.Namespace, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    model = build_blocks(args.slice, args.width)
    x, y = batch(args.rows, args.width)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters(), lr=args.lr), config=ZeroConfig(offload_optimizer=CPUOffload())
    )
    times = []
    for _ in range(args.slice_steps):
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        zero.backward(loss)
        zero.step()
        times.append(time.perf_counter() - t0)
    zero.close()
    dist.destroy_process_group()
    timed = times[2:] if len(times) > 3 else times
    out.write_text(json.dumps({"step_s": statistics.median(timed), "steps_s": times}))


# ---------------------------------------------------------------------------------------------------- phase 3
def train_worker(args: argparse.Namespace, out: Path) -> None:
    import lightning.pytorch as pl
    import torch
    from zlightning.strategies import ZStackZero3Strategy

    from zlightning.zero import engine_of

    torch.set_num_threads(args.threads)
    swap = str(Path(args.swap_dir).absolute())
    x, y = batch(args.rows, args.width)

    class Infinity(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: Any = None
            self.rows: list[dict[str, Any]] = []
            self.setup_peak = 0
            self._t0 = 0.0

        def configure_model(self) -> None:
            if self.net is None:
                self.net = build_blocks(args.blocks, args.width)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            self._loss = float(loss.detach())
            return loss

        def on_train_start(self) -> None:
            self.setup_peak = _status_kib("VmHWM") * 1024  # sharded initialisation and swap-out included

        def on_train_batch_start(self, *unused: Any) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, *unused: Any) -> None:
            metrics = self.trainer.callback_metrics
            self.rows.append(
                {
                    "step": len(self.rows) + 1,
                    "loss": self._loss,
                    "step_s": time.perf_counter() - self._t0,
                    "peak_rss_bytes": _status_kib("VmHWM") * 1024,
                    "rss_bytes": _status_kib("VmRSS") * 1024,
                    "swap_bytes_read": float(metrics.get("offload/swap_bytes_read", 0.0)),
                    "swap_bytes_written": float(metrics.get("offload/swap_bytes_written", 0.0)),
                }
            )
            print(json.dumps(self.rows[-1]), flush=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=args.lr)

    strategy = ZStackZero3Strategy(
        offload_optimizer=_nvme(swap, args.width, optimizer=True),
        offload_params=_nvme(swap, args.width, optimizer=False),
    )
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.rows)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = Infinity()
    t0 = time.perf_counter()
    trainer.fit(module, data)
    fit_s = time.perf_counter() - t0
    # After fit the module stays sharded and its parameters live in the swap files; done with it, the swap files go.
    engine = engine_of(module)
    if engine is not None:
        engine.close_offload()
    leftovers = sorted(str(p) for p in Path(swap).rglob("*") if p.is_file() and p.parent.name != "results")
    out.write_text(
        json.dumps(
            {
                "rows": module.rows,
                "fit_s": fit_s,
                "params": args.blocks * block_params(args.width),
                "peak_rss_bytes": _status_kib("VmHWM") * 1024,
                "setup_peak_rss_bytes": module.setup_peak,
                "swap_files_left": leftovers,
            }
        )
    )


# ---------------------------------------------------------------------------------------------------- driver
def _phase(name: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    out = scratch / f"{name}.json"
    cmd = [sys.executable, __file__, "--worker", name, "--out", str(out)] + _forward(args)
    print(f">> {name}: {' '.join(cmd[2:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)
    return dict(json.loads(out.read_text()))


def _forward(args: argparse.Namespace) -> list[str]:
    keys = ("width", "blocks", "rows", "steps", "lr", "threads", "slice", "slice_steps", "swap_dir")
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys]


def _throughput(args: argparse.Namespace) -> dict[str, Any]:
    from offload import swap_throughput

    nbytes = int(args.probe_gib * (1 << 30))
    rows = swap_throughput(args.swap_dir, nbytes, 1 << 20, 8, rounds=3, deepspeed=False)
    return dict(rows["rows"]["ours"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=2.0e9, help="target parameter count (sets --blocks)")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=0, help="blocks (0: from --params)")
    parser.add_argument("--rows", type=int, default=16, help="batch rows per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slice", type=int, default=1, help="blocks in the in-memory compute slice")
    parser.add_argument("--slice-steps", type=int, default=6)
    parser.add_argument("--probe-gib", type=float, default=2.0)
    parser.add_argument("--swap-dir", default=str(REPO_ROOT / ".infinity-swap"))
    parser.add_argument("--quick", action="store_true", help="0.2 B parameters, 4 steps, infinity_quick.*")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        {"slice": slice_worker, "train": train_worker}[args.worker](args, Path(args.out))
        return 0
    if args.quick:
        args.params, args.width, args.steps, args.probe_gib = 2.0e8, 2048, 4, 0.5
    if args.blocks <= 0:
        args.blocks = max(1, round(args.params / block_params(args.width)))
    swap = Path(args.swap_dir)
    swap.mkdir(parents=True, exist_ok=True)
    scratch = swap / "results"
    scratch.mkdir(exist_ok=True)
    params = args.blocks * block_params(args.width)
    ram = _mem_total()
    state = 16 * params  # fp32 parameters, gradients, exp_avg, exp_avg_sq
    print(f">> {params / 1e9:.2f} B parameters: {state / 1e9:.1f} GB of fp32 training state, RAM {ram / 2**30:.1f} GiB")
    free = shutil.disk_usage(swap).free
    if free < 14 * params:
        raise SystemExit(f"--swap-dir {swap} has {free / 1e9:.0f} GB free; this model needs ~{14 * params / 1e9:.0f}")
    load = os.getloadavg()[0]
    throughput = _throughput(args)
    compute = _phase("slice", args, scratch)
    train = _phase("train", args, scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    rows = train["rows"]
    timed = rows[1:] if len(rows) > 2 else rows
    step_s = statistics.median(r["step_s"] for r in timed)
    read_bps = throughput["read_MBps"] * 1e6
    write_bps = throughput["write_MBps"] * 1e6
    io_s = statistics.median(r["swap_bytes_read"] / read_bps + r["swap_bytes_written"] / write_bps for r in timed)
    compute_s = compute["step_s"] * args.blocks / args.slice
    bound = max(compute_s, io_s)
    result = {
        "params": params,
        "training_state_bytes": state,
        "ram_bytes": ram,
        "blocks": args.blocks,
        "width": args.width,
        "rows": args.rows,
        "threads": args.threads,
        "load_at_start": load,
        "throughput": throughput,
        "compute_slice": compute,
        "steps": rows,
        "fit_s": train["fit_s"],
        "peak_rss_bytes": train["peak_rss_bytes"],
        "peak_rss_fraction_of_ram": train["peak_rss_bytes"] / ram,
        "setup_peak_rss_bytes": train["setup_peak_rss_bytes"],
        "step_s": step_s,
        "compute_s": compute_s,
        "io_s": io_s,
        "lower_bound_s": bound,
        "ratio_to_lower_bound": step_s / bound,
        "ratio_to_serial_bound": step_s / (compute_s + io_s),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "swap_files_left": train["swap_files_left"],
    }
    name = "infinity_quick" if args.quick else "infinity"
    results = BENCH_DIR / "results"
    (results / f"{name}.json").write_text(json.dumps(result, indent=1))
    (results / f"{name}.md").write_text(_markdown(result))
    print(_markdown(result))
    ok = (
        rows[-1]["loss"] < rows[0]["loss"]
        and result["peak_rss_fraction_of_ram"] < 0.5
        and not result["swap_files_left"]
    )
    return 0 if ok else 1


def _markdown(r: dict[str, Any]) -> str:
    gb = 1e9
    lines = [
        f"# ZeRO-Infinity past RAM: {r['params'] / 1e9:.2f} B parameters on one CPU rank",
        "",
        f"{r['blocks']} residual MLP blocks of width {r['width']}, batch {r['rows']} rows, {r['threads']} threads; "
        f"fp32 training state {r['training_state_bytes'] / gb:.1f} GB against {r['ram_bytes'] / 2**30:.1f} GiB of RAM "
        f"(load average {r['load_at_start']:.2f} at start). Parameters and Adam state in swap files "
        "(`NVMeOffload` for both, `step_in_backward=True, release_gradients=True`), sharded initialisation.",
        "",
        "| step | loss | step s | swap read GB | swap written GB | peak RSS GB |",
        "|---|---|---|---|---|---|",
    ]
    for s in r["steps"]:
        lines.append(
            f"| {s['step']} | {s['loss']:.5f} | {s['step_s']:.1f} | {s['swap_bytes_read'] / gb:.1f} | "
            f"{s['swap_bytes_written'] / gb:.1f} | {s['peak_rss_bytes'] / gb:.2f} |"
        )
    t = r["throughput"]
    lines += [
        "",
        "| measure | value |",
        "|---|---|",
        f"| peak resident memory | {r['peak_rss_bytes'] / gb:.2f} GB ({100 * r['peak_rss_fraction_of_ram']:.0f}% of RAM) |",
        f"| peak resident memory by the first step (sharded init) | {r['setup_peak_rss_bytes'] / gb:.2f} GB |",
        f"| step time (median after the first) | {r['step_s']:.1f} s |",
        f"| compute of a step in memory (slice x {r['blocks']})  | {r['compute_s']:.1f} s |",
        f"| swap bytes / measured throughput ({t['write_MBps']:.0f} MB/s write, {t['read_MBps']:.0f} MB/s read) "
        f"| {r['io_s']:.1f} s |",
        f"| lower bound max(compute, I/O) | {r['lower_bound_s']:.1f} s |",
        f"| step / lower bound | {r['ratio_to_lower_bound']:.2f} (goal <= 1.3) |",
        f"| step / (compute + I/O) | {r['ratio_to_serial_bound']:.2f} |",
        f"| loss first -> last | {r['loss_first']:.5f} -> {r['loss_last']:.5f} |",
        f"| swap files left after fit | {len(r['swap_files_left'])} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
