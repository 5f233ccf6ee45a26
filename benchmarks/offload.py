"""ZeRO-Infinity offload benchmark: step time with NVMe / CPU offload divided by the in-memory zstack_zero3 step,
in the same run, on the ZeRO-3 benchmark's GPT; a state-dominated wide MLP; and swap throughput against a raw
O_DIRECT baseline (fio when installed).

Run ``.venv/bin/python benchmarks/offload.py`` (``--quick`` for a short run, written to ``offload_quick.*``).

Every variant runs in a fresh process (``--worker``), one rank over gloo with 1 thread, the engine used through
``DeepSpeedZeroOptimizer_Stage3`` (no Lightning, so only the engine is timed), and the same timing rule as
``benchmarks/zero3.py`` (``_bench_common`` [Note: what a step time is]): median of the timed step intervals after
warm-up. Variants:

* ``zero3``: in-memory ZeRO-3 (the baseline of the ratios);
* ``nvme_opt``: Adam state on NVMe, pipelined (``NVMeOffload``), swap root ``--swap-dir``;
* ``nvme_opt_params``: the same plus parameter shards on NVMe;
* ``cpu_opt``: Adam state on the host (``CPUOffload``), stepped there;
* ``mlp_zero3`` / ``mlp_nvme_opt``: a wide MLP with a tiny batch, where swapping the state dominates the step.

DeepSpeed's NVMe offload (the issue's peer) needs ``benchmarks/.venv-deepspeed`` with DeepSpeed's ``async_io`` op
built against ``libaio-dev``; when that is not available the peer is recorded as unavailable with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _bench_common import REPO_ROOT, BenchConfig, build_model, make_batches  # noqa: E402

GPT_VARIANTS = ("zero3", "nvme_opt", "nvme_opt_params", "cpu_opt")
MLP_VARIANTS = ("mlp_zero3", "mlp_nvme_opt")


def _policy(variant: str, swap: str, buffer_elems: int) -> dict[str, Any]:
    from zlightning.zero import CPUOffload, NVMeOffload

    opt = NVMeOffload(path=swap, buffer_size=buffer_elems, buffer_count=6)
    if variant.endswith("nvme_opt"):
        return {"offload_optimizer": opt}
    if variant == "nvme_opt_params":
        return {"offload_optimizer": opt, "offload_params": NVMeOffload(path=swap, buffer_size=8 * buffer_elems, buffer_count=3)}
    if variant == "cpu_opt":
        return {"offload_optimizer": CPUOffload()}
    return {}


def _mlp(width: int, depth: int) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])


def worker(variant: str, config: BenchConfig, swap: str, out: Path, mlp_width: int) -> None:
    import torch
    import torch.distributed as dist

    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.set_num_threads(config.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if variant.startswith("mlp"):
        model = _mlp(mlp_width, 4)
        x = torch.randn(2, mlp_width)
        batches = [(x, None)] * config.total_steps
        buffer_elems = mlp_width * mlp_width // 2
    else:
        model = build_model(config)
        batches = make_batches(config, 0)
        buffer_elems = 1 << 20
    cfg = ZeroConfig(**_policy(variant, swap, buffer_elems))
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=config.lr), config=cfg)
    ends, swapped = [], []
    for x, y in batches:
        loss = model(x).square().mean() if y is None else model(x, y)[1]
        zero.backward(loss)
        zero.step()
        ends.append(time.perf_counter())
        if zero.state.offload is not None:
            swapped.append(zero.state.offload.swap_stats())
    timed = [b - a for a, b in zip(ends[config.warmup_steps - 1 :], ends[config.warmup_steps :])]
    result = {
        "variant": variant,
        "step_s": statistics.median(timed),
        "steps_s": timed,
        "optimizer_resident_bytes": zero.memory_report().optimizer_bytes,
        "params": sum(zp.numel for zp in zero.state.params),
        "uses_kernel_adam": bool(getattr(zero.optimizer, "uses_kernel", False)),
        "io_engine": type(zero.state.offload.swappers()[0].reader).__name__ if zero.state.offload and zero.state.offload.swappers() else None,
        "swap_last_step": swapped[-1] if swapped else None,
    }
    zero.close()
    dist.destroy_process_group()
    out.write_text(json.dumps(result))


def swap_throughput(swap: str, nbytes: int, block: int, depth: int) -> dict[str, Any]:
    """Our swapper's write/read bandwidth for ``nbytes`` through the pool vs a raw O_DIRECT single-stream loop
    (or fio's, when installed) with the same block size and depth."""
    import torch

    from zlightning.zero import NVMeOffload
    from zlightning.zero._swap import Swapper, SwapTensor
    from zlightning.zero._swap_io import SwapDirectory, check_swap_path

    policy = NVMeOffload(path=swap, buffer_size=nbytes // 4 // 4, buffer_count=4, block_size=block, queue_depth=depth)
    root, direct = check_swap_path(policy, nbytes * 2)
    folder = SwapDirectory(root, "bench", 0)
    folder.open("remove")
    swapper = Swapper(policy, folder, direct, pin=False, nbytes=nbytes // 4)
    tensors = [SwapTensor(f"t{i}", folder.file("bw.swp"), i * (nbytes // 4), nbytes // 16, torch.float32) for i in range(4)]
    for t in tensors:
        swapper.stage(t, torch.randn(t.numel))
    t0 = time.perf_counter()
    for t in tensors:
        swapper.write(t)
    swapper.wait_writes()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for t in tensors:
        swapper.read(t)
    swapper.wait_reads()
    read_s = time.perf_counter() - t0
    engine = type(swapper.reader).__name__
    swapper.close()
    folder.close()
    ours = {"write_MBps": nbytes / write_s / 1e6, "read_MBps": nbytes / read_s / 1e6, "engine": engine, "direct": direct}
    return {"ours": ours, "baseline": _baseline(root, nbytes, block, depth, direct)}


def _baseline(root: Path, nbytes: int, block: int, depth: int, direct: bool) -> dict[str, Any]:
    path = root / f"baseline-{os.getpid()}.bin"
    fio = shutil.which("fio")
    try:
        if fio:
            out = {}
            for rw in ("write", "read"):
                res = subprocess.run(
                    [fio, "--name=zl", f"--filename={path}", f"--rw={rw}", f"--bs={block}", f"--size={nbytes}",
                     f"--iodepth={depth}", "--ioengine=libaio", f"--direct={int(direct)}", "--output-format=json"],
                    capture_output=True, text=True, check=True,
                )
                job = json.loads(res.stdout)["jobs"][0][rw]
                out[f"{rw}_MBps"] = job["bw_bytes"] / 1e6
            return {**out, "tool": "fio libaio"}
        import ctypes

        import torch

        buf = torch.empty(block + 4096, dtype=torch.uint8)
        view = buf[(-buf.data_ptr()) % 4096 :][:block]
        mem = (ctypes.c_char * block).from_address(view.data_ptr())
        flags = os.O_DIRECT if direct else 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o600)
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            os.pwrite(fd, mem, off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0) / 1e6
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | flags)
        t0 = time.perf_counter()
        for off in range(0, nbytes, block):
            os.preadv(fd, [mem], off)
        read = nbytes / (time.perf_counter() - t0) / 1e6
        os.close(fd)
        return {"write_MBps": write, "read_MBps": read, "tool": "raw single-stream pread/pwrite (fio not installed)"}
    finally:
        path.unlink(missing_ok=True)


def _run(variant: str, config: BenchConfig, swap: str, mlp_width: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        from zlightning.testing import find_free_port

        env = {**os.environ, "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": str(config.threads)}
        cmd = [sys.executable, __file__, "--worker", variant, "--config", config.to_json(), "--swap-dir", swap,
               "--out", str(out), "--mlp-width", str(mlp_width)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "status": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"variant": variant, "status": f"failed: {proc.stderr[-800:]}"}
        return {**json.loads(out.read_text()), "status": "ok"}


def _run_deepspeed(variant: str, config: BenchConfig, swap: str, timeout: float) -> dict[str, Any]:
    python = BENCH_DIR / ".venv-deepspeed" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        from zlightning.testing import find_free_port

        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "RANK": "0",
               "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": str(config.threads),
               "TORCH_EXTENSIONS_DIR": str(BENCH_DIR / ".venv-deepspeed" / "torch_extensions")}
        env.pop("VIRTUAL_ENV", None)
        cmd = [str(python), str(BENCH_DIR / "offload_deepspeed_worker.py"), variant, config.to_json(), swap, str(out)]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "status": f"timed out after {timeout:.0f} s (includes DeepSpeed's JIT op builds)"}
        if proc.returncode != 0 or not out.exists():
            return {"variant": variant, "status": f"failed: {(proc.stderr or proc.stdout)[-600:]}"}
        return {**json.loads(out.read_text()), "status": "ok", "optimizer_resident_bytes": None,
                "uses_kernel_adam": variant == "ds_nvme_opt", "io_engine": "deepspeed aio" if "nvme" in variant else None}


def _deepspeed_status() -> str:
    venv = BENCH_DIR / ".venv-deepspeed" / "bin" / "python"
    libaio = any(Path(p).exists() for p in ("/usr/include/libaio.h", "/usr/local/include/libaio.h"))
    if not venv.exists():
        return f"unavailable: {venv} missing (benchmarks/setup_deepspeed_venv.sh builds it without native ops)" + (
            "" if libaio else "; libaio-dev is not installed, so DeepSpeed's async_io (NVMe) op cannot build here"
        )
    if not libaio:
        return "unavailable: libaio-dev is not installed, so DeepSpeed's async_io (NVMe offload) op cannot build"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--swap-dir", default=None, help="swap root (default: a temp dir under benchmarks/results)")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--mlp-width", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--deepspeed", action="store_true", help="also run DeepSpeed ZeRO-3 in-memory and NVMe")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, BenchConfig.from_json(args.config), args.swap_dir, Path(args.out), args.mlp_width)
        return
    config = BenchConfig(world_size=1, warmup_steps=2, timed_steps=3 if args.quick else 6)
    swap = args.swap_dir or tempfile.mkdtemp(prefix="zl-offload-", dir=BENCH_DIR / "results")
    results = {v: _run(v, config, swap, args.mlp_width, args.timeout) for v in GPT_VARIANTS + MLP_VARIANTS}
    ds_status = _deepspeed_status()
    if args.deepspeed and ds_status == "ok":
        for v in ("ds_zero3", "ds_nvme_opt"):
            results[v] = _run_deepspeed(v, config, swap, args.timeout)
    base, mlp_base = results["zero3"].get("step_s"), results["mlp_zero3"].get("step_s")
    ratios = {v: results[v]["step_s"] / base for v in GPT_VARIANTS[1:] if base and results[v].get("step_s")}
    if results.get("ds_zero3", {}).get("step_s") and results.get("ds_nvme_opt", {}).get("step_s"):
        ratios["ds_nvme_opt"] = results["ds_nvme_opt"]["step_s"] / results["ds_zero3"]["step_s"]
    if mlp_base and results["mlp_nvme_opt"].get("step_s"):
        ratios["mlp_nvme_opt"] = results["mlp_nvme_opt"]["step_s"] / mlp_base
    throughput = swap_throughput(swap, 256 * 2**20 if not args.quick else 64 * 2**20, 1 << 20, 8)
    tp_ratio = {k: throughput["ours"][k] / throughput["baseline"][k] for k in ("write_MBps", "read_MBps")}
    report = {
        "config": json.loads(config.to_json()), "mlp_width": args.mlp_width, "swap_dir": swap,
        "results": results, "ratios_to_in_memory": ratios, "swap_throughput": throughput,
        "throughput_ratio_to_baseline": tp_ratio,
        "deepspeed": ds_status if args.deepspeed or ds_status != "ok" else "not run (pass --deepspeed)",
        "deepspeed_reference_from_issue": {"nvme_opt": 1.03, "cpu_opt": 0.98},
        "cpu_count": os.cpu_count(),
    }
    shutil.rmtree(swap, ignore_errors=True) if args.swap_dir is None else None
    stem = "offload_quick" if args.quick else "offload"
    (BENCH_DIR / "results" / f"{stem}.json").write_text(json.dumps(report, indent=1))
    md = _markdown(report)
    (BENCH_DIR / "results" / f"{stem}.md").write_text(md)
    print(md)


def _mb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def _markdown(r: dict[str, Any]) -> str:
    lines = [
        "# ZeRO-Infinity offload benchmark (CPU, 1 rank, 1 thread, gloo)", "",
        f"GPT: d_model {r['config']['d_model']}, {r['config']['n_layer']} layers, seq {r['config']['seq_len']}, "
        f"micro-batch {r['config']['micro_batch']}; MLP: width {r['mlp_width']}, 4 layers, batch 2.", "",
        "| variant | median step (s) | / in-memory | DeepSpeed (issue's numbers) | resident optimizer MB | kernel Adam | I/O engine |",
        "|---|---|---|---|---|---|---|",
    ]
    ds = r["deepspeed_reference_from_issue"]
    for v, res in r["results"].items():
        if res.get("status") != "ok":
            lines.append(f"| {v} | {res.get('status')} | | | | | |")
            continue
        ratio = r["ratios_to_in_memory"].get(v)
        lines.append(
            f"| {v} | {res['step_s']:.3f} | {f'{ratio:.3f}' if ratio else '1 (baseline)' if v.endswith('zero3') else '-'} "
            f"| {ds.get(v, '-')} | {_mb(res['optimizer_resident_bytes'])} | {res['uses_kernel_adam']} | {res['io_engine'] or '-'} |"
        )
    tp = r["swap_throughput"]
    lines += [
        "", "| swap throughput | ours (MB/s) | baseline (MB/s) | ratio |", "|---|---|---|---|",
        *(f"| {k.split('_')[0]} | {tp['ours'][k]:.0f} | {tp['baseline'][k]:.0f} | {r['throughput_ratio_to_baseline'][k]:.2f} |"
          for k in ("write_MBps", "read_MBps")),
        "", f"Baseline tool: {tp['baseline']['tool']}; our engine: {tp['ours']['engine']}, O_DIRECT={tp['ours']['direct']}.",
        "Step times are medians of the timed steps of one run on a 2-core machine shared with other jobs: variants run "
        "one after another, so load changes between them move the ratios by tens of percent (see steps_s in the JSON).",
        f"DeepSpeed peer: {r['deepspeed']}.", "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
