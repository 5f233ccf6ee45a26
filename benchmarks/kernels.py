"""Native kernels benchmark (issue 9), side by side in one run. Results: benchmarks/results/kernels.{json,md}.

    .venv/bin/python benchmarks/kernels.py            # 50M-param AdamW, 1 GiB I/O, 64M-element quantize
    .venv/bin/python benchmarks/kernels.py --quick    # 10M params, 256 MiB I/O, 16M elements

[Note: what is compared]
* AdamW step on N fp32 parameters: `zlightning.kernels.CPUAdam` (compiled, best ISA and AVX2) against
  ``torch.optim.AdamW(fused=True)`` and DeepSpeedCPUAdam (only when ``deepspeed`` with its CPU Adam op imports in
  this interpreter). Also "step + bf16 copy": CPUAdam writing the bf16 copy in the same pass against torch fused
  step followed by ``copy_`` into a bf16 tensor. Effective GB/s counts 28 bytes per parameter (30 with the copy)
  and is set against a plain ``copy_`` measurement of this machine's memory bandwidth.
* Async I/O: write then read ``--io-bytes`` with O_DIRECT, 1 MiB blocks, queue depth 32, against ``fio`` with the
  same settings (when installed) and DeepSpeed's aio op (when importable). The native io_uring backend and the
  Python thread-pool backend of DeepSpeedIOEngine both run.
* Quantize: input GB/s of compiled group-wise int8/int4 quantization against the plain PyTorch reference.
Each timing is the median of ``--repeats`` runs after one warm-up. The machine is shared: numbers are noisy.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zlightning.kernels import CPUAdam, DeepSpeedIOEngine, _ext  # noqa: E402
from zlightning.kernels._quant import quantize_reference  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_memcpy(nbytes: int, repeats: int) -> dict[str, float]:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    t = _median_time(lambda: dst.copy_(src), repeats)
    return {"bytes": nbytes, "seconds": t, "gbps": 2 * nbytes / t / 1e9}  # read + write


def _adam_case(n: int, make: Callable[[list[torch.Tensor]], Callable[[], None]], repeats: int) -> float:
    p = torch.randn(n, requires_grad=True)
    p.grad = torch.randn(n)
    step = make([p])
    t = _median_time(step, repeats)
    del p, step
    gc.collect()
    return t


def bench_adam(n: int, repeats: int) -> dict[str, dict[str, float | str]]:
    out: dict[str, dict[str, float | str]] = {}

    def torch_fused(ps: list[torch.Tensor]) -> Callable[[], None]:
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
        return opt.step

    def torch_fused_copy(ps: list[torch.Tensor]) -> Callable[[], None]:
        opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True)
        copy = torch.empty(ps[0].shape, dtype=torch.bfloat16)
        return lambda: (opt.step(), copy.copy_(ps[0]))

    def ours(isa: str, with_copy: bool = False) -> Callable[[list[torch.Tensor]], Callable[[], None]]:
        def make(ps: list[torch.Tensor]) -> Callable[[], None]:
            torch.ops.zlightning.set_isa(isa)
            opt = CPUAdam(ps, lr=1e-3, weight_decay=0.01)
            if not with_copy:
                return opt.step
            copies = [torch.empty(ps[0].shape, dtype=torch.bfloat16)]
            return lambda: opt.step(fp16_param_groups=copies)
        return make

    out["torch AdamW(fused=True)"] = {"seconds": _adam_case(n, torch_fused, repeats)}
    out["torch AdamW(fused=True) + bf16 copy_"] = {"seconds": _adam_case(n, torch_fused_copy, repeats)}
    if _ext.available():
        best = torch.ops.zlightning.set_isa("")
        out[f"CPUAdam ({best})"] = {"seconds": _adam_case(n, ours(""), repeats)}
        out["CPUAdam (avx2)"] = {"seconds": _adam_case(n, ours("avx2"), repeats)}
        out[f"CPUAdam ({best}) + bf16 copy, one pass"] = {"seconds": _adam_case(n, ours("", True), repeats)}
        torch.ops.zlightning.set_isa("")
    else:
        out["CPUAdam"] = {"skipped": f"native kernels not built: {_ext.status().reason}"}
    out["DeepSpeedCPUAdam"] = _deepspeed_adam(n, repeats)
    base = out["torch AdamW(fused=True)"]["seconds"]
    base_copy = out["torch AdamW(fused=True) + bf16 copy_"]["seconds"]
    for name, row in out.items():
        if "seconds" in row:
            extra = 2 if "copy" in name else 0
            row["gbps"] = (28 + extra) * n / row["seconds"] / 1e9
            row["x_torch_fused"] = row["seconds"] / (base_copy if "copy" in name else base)
    return out


def _deepspeed_adam(n: int, repeats: int) -> dict[str, float | str]:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as err:  # not installed, or its op cannot build here
        return {"skipped": f"deepspeed not importable in this interpreter ({type(err).__name__}: {err})"[:200]}
    try:
        return {"seconds": _adam_case(n, lambda ps: DeepSpeedCPUAdam(ps, lr=1e-3, weight_decay=0.01).step, repeats)}
    except Exception as err:
        return {"skipped": f"DeepSpeedCPUAdam failed: {type(err).__name__}: {err}"[:200]}


def _io_engine(backend: str, path: Path, nbytes: int, repeats: int) -> dict[str, float | str]:
    eng = DeepSpeedIOEngine(block_size=1 << 20, queue_depth=32, backend=backend)  # type: ignore[arg-type]
    buf = eng.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    buf.fill_(7)

    def write() -> None:
        eng.async_pwrite(buf, path, 0)
        eng.wait()

    def read() -> None:
        eng.async_pread(buf, path, 0)
        eng.wait()

    tw = _median_time(write, repeats)
    os.sync()
    tr = _median_time(read, repeats)
    eng.close()
    return {"write_gbps": nbytes / tw / 1e9, "read_gbps": nbytes / tr / 1e9, "backend": eng.backend_name}


def _fio(path: Path, nbytes: int) -> dict[str, float | str]:
    fio = shutil.which("fio")
    if not fio:
        return {"skipped": "fio not installed (Debian package `fio`)"}
    res = {}
    for rw in ("write", "read"):
        cmd = [fio, "--name=zl", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--iodepth=32", "--direct=1",
               "--ioengine=io_uring", f"--size={nbytes}", "--numjobs=1", "--output-format=json"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode:
            return {"skipped": f"fio failed: {out.stderr[-200:]}"}
        job = json.loads(out.stdout)["jobs"][0][rw]
        res[f"{rw}_gbps"] = job["bw_bytes"] / 1e9
    return res


def _deepspeed_aio(path: Path, nbytes: int, repeats: int) -> dict[str, float | str]:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = AsyncIOBuilder().load(verbose=False)
        handle = aio.aio_handle(1 << 20, 32, False, False, 1)
    except Exception as err:
        return {"skipped": f"DeepSpeed aio unavailable (needs deepspeed + libaio-dev): {type(err).__name__}"}
    buf = torch.empty(nbytes, dtype=torch.uint8).pin_memory() if torch.cuda.is_available() else torch.empty(nbytes, dtype=torch.uint8)
    tw = _median_time(lambda: (handle.async_pwrite(buf, str(path)), handle.wait()), repeats)
    tr = _median_time(lambda: (handle.async_pread(buf, str(path)), handle.wait()), repeats)
    return {"write_gbps": nbytes / tw / 1e9, "read_gbps": nbytes / tr / 1e9}


def bench_io(nbytes: int, repeats: int, directory: Path) -> dict[str, dict[str, float | str]]:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "zl_kernels_bench.bin"
    out: dict[str, dict[str, float | str]] = {}
    try:
        out["fio (io_uring, 1 job)"] = _fio(path, nbytes)
        if _ext.aio_native_available():
            out["DeepSpeedIOEngine native io_uring"] = _io_engine("native", path, nbytes, repeats)
        out["DeepSpeedIOEngine python thread pool"] = _io_engine("python", path, nbytes, repeats)
        out["DeepSpeed aio"] = _deepspeed_aio(path, nbytes, repeats)
    finally:
        path.unlink(missing_ok=True)
    return out


def bench_quant(numel: int, repeats: int) -> dict[str, dict[str, float | str]]:
    x = torch.randn(numel)
    out: dict[str, dict[str, float | str]] = {}
    for bits, sym in ((8, True), (4, False)):
        label = f"int{bits} {'sym' if sym else 'asym'} g128"
        tr = _median_time(lambda: quantize_reference(x, bits, 128, sym), repeats)
        out[f"{label} plain PyTorch"] = {"seconds": tr, "gbps": x.nbytes / tr / 1e9}
        if _ext.available():
            tn = _median_time(lambda: torch.ops.zlightning.quantize(x, bits, 128, sym), repeats)
            out[f"{label} compiled"] = {"seconds": tn, "gbps": x.nbytes / tn / 1e9, "x_plain": tr / tn}
    return out


def _markdown(res: dict) -> str:
    lines = [f"# Native kernels benchmark ({res['threads']} threads, torch {res['torch']}, ISA {res['isa']})", "",
             f"Memory copy: {res['memcpy']['gbps']:.1f} GB/s (read+write). Params: {res['adam_params']:,}; "
             f"I/O: {res['io_bytes'] / 2**20:.0f} MiB, 1 MiB blocks, depth 32, O_DIRECT. Median of "
             f"{res['repeats']} runs. Shared 2-core machine: expect noise.", "",
             "| AdamW step | ms | × torch fused | effective GB/s | ÷ memcpy GB/s |", "|---|---:|---:|---:|---:|"]
    for name, row in res["adam"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | | | |")
        else:
            lines.append(f"| {name} | {row['seconds'] * 1e3:.1f} | {row['x_torch_fused']:.2f} | {row['gbps']:.1f} | "
                         f"{row['gbps'] / res['memcpy']['gbps']:.2f} |")
    lines += ["", "| I/O | write GB/s | read GB/s |", "|---|---:|---:|"]
    for name, row in res["io"].items():
        if "skipped" in row:
            lines.append(f"| {name} | skipped: {row['skipped']} | |")
        else:
            lines.append(f"| {name} | {row['write_gbps']:.2f} | {row['read_gbps']:.2f} |")
    lines += ["", "| quantize | ms | input GB/s | × plain PyTorch |", "|---|---:|---:|---:|"]
    for name, row in res["quant"].items():
        lines.append(f"| {name} | {row['seconds'] * 1e3:.1f} | {row['gbps']:.2f} | {row.get('x_plain', 1.0):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes (10M params, 256 MiB, 16M elements)")
    p.add_argument("--params", type=float, default=50e6)
    p.add_argument("--io-bytes", type=int, default=1 << 30)
    p.add_argument("--quant-numel", type=int, default=64 << 20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-dir", type=Path, default=None, help="directory for the I/O test file (a local disk)")
    p.add_argument("--out", default="kernels", help="results name under benchmarks/results/")
    a = p.parse_args(argv)
    if a.quick:
        a.params, a.io_bytes, a.quant_numel, a.out = 10e6, 256 << 20, 16 << 20, a.out + "_quick"
    n = int(a.params)
    io_dir = a.io_dir or Path(tempfile.gettempdir()) / "zl_kernels_bench"
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": a.repeats,
           "isa": _ext.build_info().get("isa", "not built"), "adam_params": n, "io_bytes": a.io_bytes,
           "memcpy": bench_memcpy(min(4 * n, 1 << 30), a.repeats)}
    res["adam"] = bench_adam(n, a.repeats)
    res["io"] = bench_io(a.io_bytes, max(2, a.repeats // 2), io_dir)
    res["quant"] = bench_quant(a.quant_numel, a.repeats)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{a.out}.json").write_text(json.dumps(res, indent=1))
    md = _markdown(res)
    (RESULTS / f"{a.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
