"""Everything that needs a GPU, in one command (``make gpu-check``): the GPU-marked tests, then GPU measurements.

    .venv/bin/python benchmarks/gpu_check.py            # tests + measurements, writes benchmarks/results/gpu.md
    .venv/bin/python benchmarks/gpu_check.py --no-tests

Measurements (each in fresh processes, one GPU per rank, NCCL; world = min(2, GPUs)):

* ``zero3_memory``: ZeRO-3 on the states-dominated model (``depth x Linear(width) + Tanh``, AdamW fp32), peak
  ``torch.cuda.max_memory_allocated`` per parameter after steps 1, 3 and N, against DDP's;
* ``offload_capped``: a model bigger than a capped device memory fraction (``set_per_process_memory_fraction``)
  trained with CPU offload and with NVMe offload (optimizer and parameters): losses fall and equal those of the same
  run without offload or cap (``device``, rtol 1e-4);
* ``cpu_adam``: CPU Adam stepping fp32 masters on the host from device gradients (``CPUOffload``), step time;
* ``compile``: ``ZStackZero3Strategy(compile=True)`` through a Lightning Trainer, step time against eager;
* ``quantize``: the CUDA (Triton when installed) int8/int4 quantize kernels against the CPU reference, GB/s.

Without a CUDA device it says so, lists what it would run, and exits 0 without writing results.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

MEASUREMENTS = ("zero3_memory", "offload_capped", "cpu_adam", "compile", "quantize")


def _blocks(width: int, depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


# ---------------------------------------------------------------------------------------------- rank functions
def _zero3_memory(rank: int, world: int, kind: str, width: int, depth: int, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(_blocks(width, depth).cuda(), device_ids=[rank])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            with torch.device("meta"):
                model = _blocks(width, depth)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            zero = DeepSpeedZeroOptimizer_Stage3(model, opt, device=torch.device("cuda", rank))
        numel = depth * (width * width + width)
        peaks, times = [], []
        for _ in range(steps):
            x = torch.randn(2, width, device="cuda")
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(x).pow(2).mean()
            if kind == "ddp":
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                zero.backward(loss)
                zero.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            peaks.append((torch.cuda.max_memory_allocated() - base) / numel)
        return {"peaks": peaks, "median_step_s": statistics.median(times[1:] or times)}
    finally:
        dist.destroy_process_group()


def _offload_capped(
    rank: int, world: int, kind: str, width: int, depth: int, fraction: float | None, swap: str
) -> dict[str, Any]:
    import torch.distributed as dist

    from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, NVMeOffload, ZeroConfig

    torch.cuda.set_device(rank)
    # [Note: the capped offload run's cap] Default: below what the device would need without the offload, so the run
    # fails unless the offload works, whatever the card's size. Without offload ZeRO-3 holds 16 bytes per parameter
    # (fp32 parameters, gradients, Adam's two moments). Optimizer offload moves Adam's state and the step to the host
    # but keeps the fp32 parameter and gradient shards on the device (8 bytes; DeepSpeed also moves the gradient
    # shards to the host as they are reduced): its cap is 12 bytes per parameter. NVMe offload of the parameters
    # too keeps only the gathered units and the gradient shards there: its cap is 6 bytes.
    # ``device`` is the reference: the same model, seed and data with no offload and no cap.
    numel = depth * (width * width + width)
    if kind == "device":
        fraction = 1.0
    elif fraction is None:
        per_param = 12 if kind == "cpu" else 6
        fraction = per_param * numel / world / torch.cuda.get_device_properties(rank).total_memory
    torch.cuda.set_per_process_memory_fraction(fraction, rank)
    torch.manual_seed(0)  # the deferred initialisation derives each module's seed from the run's
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        with torch.device("meta"):
            model = _blocks(width, depth)
        config = (
            ZeroConfig()
            if kind == "device"
            else ZeroConfig(offload_optimizer=CPUOffload())
            if kind == "cpu"
            else ZeroConfig(  # a unit's shard must fit one parameter buffer (a whole unit at world size 1)
                offload_optimizer=NVMeOffload(path=swap),
                offload_params=NVMeOffload(path=swap, buffer_size=max(1 << 24, width * width)),
            )
        )
        zero = DeepSpeedZeroOptimizer_Stage3(
            model, torch.optim.AdamW(model.parameters(), lr=1e-5), config=config, device=torch.device("cuda", rank)
        )
        # A regression target, so that the loss has somewhere to fall (the deep Tanh stack's output starts near 0:
        # minimising its square made Adam's first steps overshoot and the loss rise, whatever the offload).
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(4, width, device="cuda", generator=g)
        y = 0.5 * torch.randn(4, width, device="cuda", generator=g)
        losses, times = [], []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = (model(x) - y).pow(2).mean()
            zero.backward(loss)
            zero.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
        total = torch.cuda.get_device_properties(rank).total_memory
        zero.close()
        return {
            "losses": losses,
            "median_step_s": statistics.median(times[1:]),
            "model_fp32_gb": 4 * numel / 1e9,
            "device_cap_gb": fraction * total / 1e9,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
        }
    finally:
        dist.destroy_process_group()


def _cpu_adam(rank: int, world: int, width: int, depth: int) -> dict[str, Any]:
    import torch.distributed as dist

    from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        out = {}
        for kind in ("device", "cpu_adam"):
            with torch.device("meta"):
                model = _blocks(width, depth)
            config = ZeroConfig(offload_optimizer=CPUOffload()) if kind == "cpu_adam" else ZeroConfig()
            zero = DeepSpeedZeroOptimizer_Stage3(
                model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config, device=torch.device("cuda", rank)
            )
            times = []
            for _ in range(6):
                x = torch.randn(8, width, device="cuda")
                torch.cuda.synchronize()
                t = time.perf_counter()
                zero.backward(model(x).pow(2).mean())
                zero.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            out[kind] = statistics.median(times[1:])
            zero.close()
        return out
    finally:
        dist.destroy_process_group()


def _compile(rank: int, world: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from tests._lightning_models import TinyGPTModule, loader

    out = {}
    for compiled in (False, True):
        times: list[float] = []

        class Clock(pl.Callback):
            def on_train_batch_start(self, *a: Any) -> None:
                torch.cuda.synchronize()
                self.t = time.perf_counter()

            def on_train_batch_end(self, *a: Any) -> None:
                torch.cuda.synchronize()
                times.append(time.perf_counter() - self.t)

        trainer = pl.Trainer(
            strategy=ZStackZero3Strategy(compile=compiled),
            accelerator="cuda",
            devices=world,
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[Clock()],
        )
        trainer.fit(TinyGPTModule(), loader(12, 4, world))
        out["compiled" if compiled else "eager"] = statistics.median(times[4:])
    return out


def _quantize() -> dict[str, Any]:
    from zlightning.kernels import dequantize, quantize

    out = {}
    x = torch.randn(64 << 20, device="cuda")
    for bits in (8, 4):
        q = quantize(x, bits=bits, group_size=128, symmetric=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            q = quantize(x, bits=bits, group_size=128, symmetric=True)
        torch.cuda.synchronize()
        gbps = 10 * x.numel() * 4 / (time.perf_counter() - t) / 1e9
        ref = quantize(x[: 1 << 20].cpu(), bits=bits, group_size=128, symmetric=True)
        err = (dequantize(q).flatten()[: 1 << 20].cpu() - dequantize(ref).flatten()).abs().max().item()
        out[f"int{bits}"] = {"GBps": gbps, "max_abs_diff_vs_cpu": err}
    return out


# ---------------------------------------------------------------------------------------------- driver
def _run(fn: Any, world: int, *args: Any, init: bool = False) -> list[Any]:
    from zlightning.testing import run_distributed

    return run_distributed(fn, world, *args, init_process_group=init, timeout=900)


def _failure(err: Exception) -> dict[str, str]:
    """A failed measurement's record: the error's start and its tail (a rank's traceback ends with the cause)."""
    text = str(err)
    return {"status": f"failed: {type(err).__name__}: {text[:300]} ... {text[-1500:]}"}


def _guarded(fn: Any, world: int, *args: Any) -> dict[str, Any]:
    """One variant of a measurement; its failure is recorded without hiding the other variants."""
    try:
        return _run(fn, world, *args, tempfile.mkdtemp(prefix="zl-gpu-swap-"))[0]
    except Exception as err:  # noqa: BLE001
        return _failure(err)


def _offload_parity(found: dict[str, Any], rtol: float = 1e-4) -> dict[str, Any]:
    """Marks an offload variant failed unless its losses fall and equal the uncapped device reference's.

    CPU Adam and the device's AdamW differ only in rounding (about 1e-7 of a loss per step); a step that goes wrong
    moves the loss by its whole change, about 1e-3 of it per step here.
    """
    ref = found.get("device", {}).get("losses")
    for kind, r in found.items():
        losses = r.get("losses")
        if kind == "device" or losses is None or ref is None:
            continue
        r["max_rel_diff_vs_device"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))
        if not losses[-1] < losses[0]:
            r["status"] = f"failed: losses did not fall ({losses[0]} -> {losses[-1]})"
        elif r["max_rel_diff_vs_device"] > rtol:
            r["status"] = f"failed: losses differ from the device reference by {r['max_rel_diff_vs_device']:.2e}"
    return found


def measure(args: argparse.Namespace, tests_rc: int | None) -> dict[str, Any]:
    world = min(2, torch.cuda.device_count())
    results: dict[str, Any] = {}
    plan = {
        "zero3_memory": lambda: {k: _run(_zero3_memory, world, k, 4096, 24, 20)[0] for k in ("ddp", "zero3")},
        "offload_capped": lambda: _offload_parity(
            {k: _guarded(_offload_capped, world, k, 8192, 12, args.cap_fraction) for k in ("device", *args.offload)}
        ),
        "cpu_adam": lambda: _run(_cpu_adam, world, 4096, 16)[0],
        "compile": lambda: _run(_compile, world)[0],
        "quantize": _quantize,
    }
    for name in args.only or MEASUREMENTS:
        print(f">> {name}", flush=True)
        try:
            found = plan[name]()
            failed = [k for k, v in found.items() if isinstance(v, dict) and v.get("status", "ok") != "ok"]
            results[name] = {"status": f"failed: {', '.join(failed)}" if failed else "ok", **found}
        except Exception as err:  # noqa: BLE001  (recorded; the other measurements still run)
            results[name] = _failure(err)
        print(f"   {results[name]}", flush=True)
        _write(args.out, tests_rc, results)  # after each one: a run cut off by a time limit keeps what it measured
    return results


def _write(out: Path, tests_rc: int | None, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(_markdown(tests_rc, results))
    out.with_suffix(".json").write_text(json.dumps({"tests_rc": tests_rc, "results": results}, indent=2, default=str))


def _markdown(tests_rc: int | None, results: dict[str, Any]) -> str:
    dev = torch.cuda.get_device_name(0)
    lines = [
        f"# GPU check ({datetime.date.today()}, {torch.cuda.device_count()} x {dev}, torch {torch.__version__})",
        "",
        f"GPU-marked tests: {'not run' if tests_rc is None else ('passed' if tests_rc == 0 else 'FAILED')}",
        "",
    ]
    for name, r in results.items():
        lines.append(f"## {name}\n\n```\n{json.dumps(r, indent=1, default=str)}\n```\n")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-tests", action="store_true", help="skip the GPU-marked tests")
    p.add_argument("--only", nargs="+", choices=MEASUREMENTS, help="run only these measurements")
    p.add_argument(
        "--cap-fraction",
        type=float,
        default=None,
        help="device memory fraction for the capped offload run (default: half the model's fp32 parameters)",
    )
    p.add_argument(
        "--offload", nargs="+", choices=("cpu", "nvme"), default=["cpu", "nvme"], help="offload_capped variants"
    )
    p.add_argument("--out", type=Path, default=BENCH / "results" / "gpu.md")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing run. On a GPU machine it runs:")
        print("  * pytest -m gpu tests   (tests/test_zero3_gpu.py, the CUDA quantize tests, ...)")
        for name in MEASUREMENTS:
            print(f"  * {name}")
        return 0
    tests_rc = None
    if not args.no_tests:
        # only the files that hold GPU-marked tests: the others need the CPU venv's extras (jsonargparse, ...)
        files = sorted(
            str(f.relative_to(REPO)) for f in (REPO / "tests").glob("test_*.py") if "mark.gpu" in f.read_text()
        )
        tests_rc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-m", "gpu", *files], cwd=REPO, env=dict(os.environ)
        ).returncode
    _write(args.out, tests_rc, {})
    results = measure(args, tests_rc)
    print(f"wrote {args.out}")
    # pytest exit 5 (nothing collected) fails the check: the GPU tests it exists to run did not run
    return 0 if tests_rc in (0, None) and all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
