"""ZeRO-Infinity offload benchmark: step time with NVMe / CPU offload divided by the in-memory zstack_zero3 step,
in the same run, on the ZeRO-3 benchmark's GPT; a state-dominated wide MLP; and swap throughput against a raw
O_DIRECT baseline (fio when installed).

Run ``.venv/bin/python benchmarks/offload.py`` (``--quick`` for a short run, written to ``offload_quick.*``).

Every run of a variant is a fresh process (``--worker``), one rank over gloo with 1 thread, the engine used through
``DeepSpeedZeroOptimizer_Stage3`` (no Lightning, so only the engine is timed), and the same timing rule as
``benchmarks/zero3.py`` (``_bench_common`` [Note: what a step time is]): median of the timed step intervals after
warm-up. Variants:

* ``zero3``: in-memory ZeRO-3 (the baseline of the ratios);
* ``nvme_opt``: Adam state on NVMe (``NVMeOffload``, default settings: exact), swap root ``--swap-dir``;
* ``nvme_opt_params``: the same plus parameter shards on NVMe;
* ``*_sib``: the same with ``step_in_backward=True`` (each group's update runs in backward; same results here,
  since nothing clips or rescales gradients);
* ``cpu_opt``: Adam state on the host (``CPUOffload``), stepped there;
* ``mlp_zero3`` / ``mlp_nvme_opt`` (/ ``_sib``): a wide MLP with a tiny batch, where swapping the state dominates.

[Note: interleaved repeats of the offload variants]
One run per variant, one after another, moved the ratios by tens of percent between two invocations (0.956 then
1.055 for ``nvme_opt``): the machine is shared and its load drifts over minutes. So every variant runs
``--repeats`` times (default 5), interleaved: repetition ``k`` runs each model's variants (ours and DeepSpeed's
together) starting one further along the list, so every variant's runs are spread over the whole benchmark and no
variant always follows the same neighbour. A variant's step time is the median of its runs' medians; its ratio to
its library's in-memory step is the median of the per-repetition ratios (a run divided by the baseline's run of the
same repetition, minutes apart at most). Each run's median and the load average when it started are recorded.

The in-memory baselines (``zero3``, ``mlp_zero3`` and DeepSpeed's ``ds_zero3``, ``ds_mlp_zero3``) step with torch's
``AdamW`` (foreach); the offload variants step with a CPU Adam kernel (ours: ``zlightning.kernels``, DeepSpeed's:
``DeepSpeedCPUAdam``), so a ratio below 1 means the faster kernel Adam outweighed the swapping.

With ``--deepspeed`` DeepSpeed runs beside it in the same invocation: DeepSpeed ZeRO-3 in memory and with NVMe optimizer
offload, on the GPT and on the MLP (``offload_deepspeed_worker.py`` in ``benchmarks/.venv-deepspeed``, its
``async_io`` op built against ``libaio-dev``), and DeepSpeed's ``aio_handle`` in the swap-throughput rounds
(through ``kernels_deepspeed_worker.py``). When that venv or libaio is missing the peer is recorded as unavailable.

[Note: swap throughput rounds]
Ours (the ``Swapper``: pool buffers, per-block checksums computed on write and verified on read), fio (libaio) and
DeepSpeed's aio handle each write then read the same number of bytes with the same block size and queue depth.
They take turns round by round in a rotated order, after one warm-up round, and each reports the median of its
rounds: the disk is shared with other jobs, so back-to-back single shots differ by 3x (measured), which would say
more about the neighbours than about the engines.
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

GPT_VARIANTS = ("zero3", "nvme_opt", "nvme_opt_sib", "nvme_opt_params", "nvme_opt_params_sib", "cpu_opt")
MLP_VARIANTS = ("mlp_zero3", "mlp_nvme_opt", "mlp_nvme_opt_sib")
DS_VARIANTS = ("ds_zero3", "ds_nvme_opt", "ds_mlp_zero3", "ds_mlp_nvme_opt")
BASELINE = {
    "ds_zero3": "ds_zero3",
    "ds_nvme_opt": "ds_zero3",
    "ds_mlp_zero3": "ds_mlp_zero3",
    "ds_mlp_nvme_opt": "ds_mlp_zero3",
    **{v: "zero3" for v in GPT_VARIANTS},
    **{v: "mlp_zero3" for v in MLP_VARIANTS},
}
"""Each variant's in-memory baseline: the same library's ZeRO-3 on the same model."""
MLP_BATCH = 2
MLP_DEPTH = 4
DS_VENV = BENCH_DIR / ".venv-deepspeed"


def _policy(variant: str, swap: str, buffer_elems: int) -> dict[str, Any]:
    from zlightning.zero import CPUOffload, NVMeOffload

    sib = variant.endswith("_sib")
    variant = variant.removesuffix("_sib")
    # buffer_count: NVMeOffload's default (8). The sub-group size is set below the default so that these small
    # models have several sub-groups to pipeline.
    opt = NVMeOffload(path=swap, buffer_size=buffer_elems, step_in_backward=sib)
    if variant.endswith("nvme_opt"):
        return {"offload_optimizer": opt}
    if variant == "nvme_opt_params":
        return {
            "offload_optimizer": opt,
            "offload_params": NVMeOffload(path=swap, buffer_size=8 * buffer_elems, buffer_count=3),
        }
    if variant == "cpu_opt":
        return {"offload_optimizer": CPUOffload()}
    return {}


def mlp_model(width: int) -> Any:
    """The state-dominated case: ``MLP_DEPTH`` square ``Linear + ReLU`` layers (shared with the DeepSpeed worker)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(MLP_DEPTH)])


def mlp_batches(width: int, steps: int) -> list[tuple[Any, None]]:
    """One fixed ``[MLP_BATCH, width]`` input per step (the loss is the mean squared output)."""
    import torch

    x = torch.randn(MLP_BATCH, width, generator=torch.Generator().manual_seed(1))
    return [(x, None)] * steps


def worker(variant: str, config: BenchConfig, swap: str, out: Path, mlp_width: int) -> None:
    import torch
    import torch.distributed as dist

    from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

    torch.set_num_threads(config.threads)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    if variant.startswith("mlp"):
        model = mlp_model(mlp_width)
        batches = mlp_batches(mlp_width, config.total_steps)
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
        "io_engine": type(zero.state.offload.swappers()[0].reader).__name__
        if zero.state.offload and zero.state.offload.swappers()
        else None,
        "swap_last_step": swapped[-1] if swapped else None,
    }
    zero.close()
    dist.destroy_process_group()
    out.write_text(json.dumps(result))


class _DeepSpeedAIO:
    """DeepSpeed's ``aio_handle`` behind ``kernels_deepspeed_worker.py`` (one JSON request/reply per line)."""

    def __init__(self, threads: int) -> None:
        env = {
            **os.environ,
            "DS_ACCELERATOR": "cpu",
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "TORCH_EXTENSIONS_DIR": str(DS_VENV / "torch_extensions"),
        }
        env.pop("VIRTUAL_ENV", None)
        self.proc = subprocess.Popen(
            [str(DS_VENV / "bin" / "python"), str(BENCH_DIR / "kernels_deepspeed_worker.py")],
            cwd=BENCH_DIR,
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def request(self, req: dict[str, Any], timeout: float = 900) -> dict[str, Any]:
        import select

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"DeepSpeed aio worker: no reply to {req['op']} within {timeout:.0f} s or it exited")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"DeepSpeed aio worker: {reply['error']}")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a stuck worker is killed
                self.proc.kill()
                self.proc.wait()


def _fio(path: Path, nbytes: int, block: int, depth: int, direct: bool, rw: str) -> float:
    res = subprocess.run(
        [
            "fio",
            "--name=zl",
            f"--filename={path}",
            f"--rw={rw}",
            f"--bs={block}",
            f"--size={nbytes}",
            f"--iodepth={depth}",
            "--ioengine=libaio",
            f"--direct={int(direct)}",
            "--numjobs=1",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    job = json.loads(res.stdout[res.stdout.index("{") :])["jobs"][0][rw]
    return nbytes / job["bw_bytes"]


def swap_throughput(swap: str, nbytes: int, block: int, depth: int, rounds: int, deepspeed: bool) -> dict[str, Any]:
    """Write/read bandwidth of our swapper, fio (libaio) and DeepSpeed's aio for ``nbytes`` with the same block size
    and queue depth, in rotated rounds (see [Note: swap throughput rounds]). Rows that cannot run say why."""
    import torch

    from zlightning.zero import NVMeOffload
    from zlightning.zero._swap import Swapper, SwapTensor
    from zlightning.zero._swap_io import SwapDirectory, check_swap_path

    policy = NVMeOffload(path=swap, buffer_size=nbytes // 4 // 4, buffer_count=4, block_size=block, queue_depth=depth)
    root, direct = check_swap_path(policy, nbytes * 4)
    folder = SwapDirectory(root, "bench", 0)
    folder.open("remove")
    swapper = Swapper(policy, folder, direct, pin=False, nbytes=nbytes // 4)
    tensors = [
        SwapTensor(f"t{i}", folder.file("bw.swp"), i * (nbytes // 4), nbytes // 16, torch.float32) for i in range(4)
    ]
    for t in tensors:
        swapper.stage(t, torch.randn(t.numel))

    def ours(rw: str) -> float:
        t0 = time.perf_counter()
        for t in tensors:
            swapper.write(t) if rw == "write" else swapper.read(t)
        swapper.wait_writes() if rw == "write" else swapper.wait_reads()
        return time.perf_counter() - t0

    calls: dict[str, Any] = {"ours": ours}
    rows: dict[str, dict[str, Any]] = {"ours": {"engine": type(swapper.reader).__name__, "direct": direct}}
    fio_path = root / f"fio-{os.getpid()}.bin"
    if shutil.which("fio"):
        calls["fio"] = lambda rw: _fio(fio_path, nbytes, block, depth, direct, rw)
        rows["fio"] = {"engine": "fio libaio, 1 job"}
    else:
        rows["fio"] = {"status": "unavailable: fio is not installed"}
    ds = None
    if deepspeed:
        status = _deepspeed_status()
        if status == "ok":
            ds = _DeepSpeedAIO(1)
            try:
                setup = ds.request(
                    {
                        "op": "aio_setup",
                        "nbytes": nbytes,
                        "path": str(root / f"ds-{os.getpid()}.bin"),
                        "block_size": block,
                        "queue_depth": depth,
                    }
                )
                calls["deepspeed_aio"] = lambda rw: float(ds.request({"op": "aio", "rw": rw})["seconds"])
                rows["deepspeed_aio"] = {
                    "engine": "DeepSpeed aio_handle (libaio), locked buffer",
                    "locked": setup.get("locked"),
                }
            except RuntimeError as err:
                rows["deepspeed_aio"] = {"status": f"unavailable: {err}"[:300]}
        else:
            rows["deepspeed_aio"] = {"status": status}
    times: dict[str, dict[str, list[float]]] = {n: {"write": [], "read": []} for n in calls}
    try:
        names = list(calls)
        for r in range(rounds + 1):
            shift = r % len(names)
            for name in names[shift:] + names[:shift]:
                for rw in ("write", "read"):
                    seconds = calls[name](rw)
                    if r:
                        times[name][rw].append(seconds)
    finally:
        swapper.close()
        folder.close()
        fio_path.unlink(missing_ok=True)
        if ds is not None:
            ds.close()
            (root / f"ds-{os.getpid()}.bin").unlink(missing_ok=True)
    for name, ts in times.items():
        for rw in ("write", "read"):
            rows[name][f"{rw}_MBps"] = nbytes / statistics.median(ts[rw]) / 1e6
            rows[name][f"{rw}_MBps_rounds"] = [nbytes / t / 1e6 for t in ts[rw]]
        rows[name]["status"] = "ok"
    return {"bytes": nbytes, "block_size": block, "queue_depth": depth, "rounds": rounds, "rows": rows}


def _run(variant: str, config: BenchConfig, swap: str, mlp_width: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        from zlightning.testing import find_free_port

        env = {**os.environ, "MASTER_PORT": str(find_free_port()), "OMP_NUM_THREADS": str(config.threads)}
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--config",
            config.to_json(),
            "--swap-dir",
            swap,
            "--out",
            str(out),
            "--mlp-width",
            str(mlp_width),
        ]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"variant": variant, "status": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out.exists():
            return {"variant": variant, "status": f"failed: {proc.stderr[-800:]}"}
        return {**json.loads(out.read_text()), "status": "ok"}


def _run_deepspeed(variant: str, config: BenchConfig, swap: str, mlp_width: int, timeout: float) -> dict[str, Any]:
    python = BENCH_DIR / ".venv-deepspeed" / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        from zlightning.testing import find_free_port

        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(find_free_port()),
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "OMP_NUM_THREADS": str(config.threads),
            "TORCH_EXTENSIONS_DIR": str(BENCH_DIR / ".venv-deepspeed" / "torch_extensions"),
        }
        env.pop("VIRTUAL_ENV", None)
        cmd = [
            str(python),
            str(BENCH_DIR / "offload_deepspeed_worker.py"),
            variant,
            config.to_json(),
            swap,
            str(out),
            str(mlp_width),
        ]
        try:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {
                "variant": variant,
                "status": f"timed out after {timeout:.0f} s (includes DeepSpeed's JIT op builds)",
            }
        if proc.returncode != 0 or not out.exists():
            return {"variant": variant, "status": f"failed: {(proc.stderr or proc.stdout)[-600:]}"}
        return {
            **json.loads(out.read_text()),
            "status": "ok",
            "optimizer_resident_bytes": None,
            "uses_kernel_adam": variant.endswith("nvme_opt"),
            "io_engine": "deepspeed aio" if "nvme" in variant else None,
            "params": None,
            "swap_last_step": None,
        }


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


def _order(run_ds: bool) -> list[list[str]]:
    """The variants of each model, ours and DeepSpeed's side by side (one block per model)."""
    gpt = [
        "zero3",
        "nvme_opt",
        "nvme_opt_sib",
        *(["ds_zero3", "ds_nvme_opt"] if run_ds else []),
        "nvme_opt_params",
        "nvme_opt_params_sib",
        "cpu_opt",
    ]
    mlp = ["mlp_zero3", "mlp_nvme_opt", "mlp_nvme_opt_sib", *(["ds_mlp_zero3", "ds_mlp_nvme_opt"] if run_ds else [])]
    return [gpt, mlp]


def _aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs -> median of their medians, plus every run (see [Note: interleaved repeats of the offload
    variants])."""
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {**runs[-1], "runs": runs}
    out = {k: v for k, v in ok[-1].items() if k not in ("step_s", "steps_s")}
    out.update(
        status="ok",
        step_s=statistics.median(r["step_s"] for r in ok),
        runs_step_s=[r["step_s"] for r in ok],
        runs_loadavg=[r.get("loadavg") for r in ok],
        runs_ok=len(ok),
        runs=len(runs),
    )
    return out


def _paired_ratios(runs: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Per variant: the median over repetitions of (run / its baseline's run in the same repetition), and the list."""
    medians, lists = {}, {}
    for v, rs in runs.items():
        base = BASELINE.get(v)
        if base is None or base == v or base not in runs:
            continue
        by_rep = {r["repetition"]: r["step_s"] for r in runs[base] if r.get("status") == "ok"}
        paired = [
            r["step_s"] / by_rep[r["repetition"]] for r in rs if r.get("status") == "ok" and r["repetition"] in by_rep
        ]
        if paired:
            medians[v], lists[v] = statistics.median(paired), paired
    return medians, lists


TARGETS = {
    "nvme_opt": 1.03,
    "nvme_opt_sib": 1.03,
    "nvme_opt_params": 1.10,
    "nvme_opt_params_sib": 1.10,
    "mlp_nvme_opt": 1.15,
    "mlp_nvme_opt_sib": 1.15,
}
"""The targets: NVMe step / our in-memory step."""


def _verdicts(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The targets, each with its measured value and ``met`` (None when a side did not run)."""
    res, ratios, tp = report["results"], report["ratios_to_in_memory"], report["swap_throughput"]["rows"]

    def row(value: float | None, target: str, met: bool | None) -> dict[str, Any]:
        return {"value": value, "target": target, "met": met}

    out = {}
    for v, goal in TARGETS.items():
        out[f"{v}_ratio"] = row(
            ratios.get(v), f"<= {goal} x our in-memory step", None if ratios.get(v) is None else ratios[v] <= goal
        )
    ours, theirs = res.get("nvme_opt", {}).get("step_s"), res.get("ds_nvme_opt", {}).get("step_s")
    out["nvme_opt_step_vs_deepspeed_nvme"] = row(
        ours / theirs if ours and theirs else None,
        "< 1 (faster than DeepSpeed's NVMe offload step)",
        None if not (ours and theirs) else ours < theirs,
    )
    for ours_v, ds_v in (("nvme_opt", "ds_nvme_opt"), ("mlp_nvme_opt", "ds_mlp_nvme_opt")):
        a, b = ratios.get(ours_v), ratios.get(ds_v)
        out[f"{ours_v}_ratio_vs_deepspeed_ratio"] = row(
            a / b if a and b else None,
            f"< 1 (our {ours_v} / in-memory beats DeepSpeed's {ds_v} / in-memory)",
            None if not (a and b) else a < b,
        )
    for rw in ("write", "read"):
        mine = tp["ours"].get(f"{rw}_MBps")
        for peer, target in (("deepspeed_aio", ">= 1 (target)"), ("fio", "reference")):
            other = tp.get(peer, {}).get(f"{rw}_MBps")
            value = mine / other if mine and other else None
            out[f"swap_{rw}_x_{peer}"] = row(value, target, None if value is None or peer == "fio" else value >= 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--swap-dir", default=None, help="swap root (default: a temp dir under benchmarks/results)")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--config", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--mlp-width", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--rounds", type=int, default=5, help="swap-throughput rounds per contender (after warm-up)")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs of every variant, interleaved (see [Note: interleaved repeats of the offload variants])",
    )
    parser.add_argument("--only", nargs="+", default=None, help="run only these variants (and their baselines)")
    parser.add_argument(
        "--deepspeed",
        action="store_true",
        help="also run DeepSpeed ZeRO-3 (in-memory and NVMe, GPT and MLP) and its aio",
    )
    parser.add_argument("--stem", default=None, help="results file name (default offload, or offload_quick)")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, BenchConfig.from_json(args.config), args.swap_dir, Path(args.out), args.mlp_width)
        return
    config = BenchConfig(world_size=1, warmup_steps=2, timed_steps=3 if args.quick else 5)
    repeats = 2 if args.quick else args.repeats
    swap = args.swap_dir or tempfile.mkdtemp(prefix="zl-offload-", dir=BENCH_DIR / "results")
    ds_status = _deepspeed_status()
    run_ds = args.deepspeed and ds_status == "ok"
    blocks = _order(run_ds)
    if args.only:
        wanted = set(args.only) | {BASELINE[v] for v in args.only if v in BASELINE}
        blocks = [[v for v in b if v in wanted] for b in blocks]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for b in blocks for v in b}
    for rep_i in range(repeats):  # see [Note: interleaved repeats of the offload variants]
        for block in blocks:
            shift = rep_i % max(len(block), 1)
            for v in block[shift:] + block[:shift]:
                t0, load = time.perf_counter(), [round(x, 2) for x in os.getloadavg()]
                runner = _run_deepspeed if v.startswith("ds_") else _run
                r = runner(v, config, swap, args.mlp_width, args.timeout)
                r.update(repetition=rep_i, loadavg=load)
                runs[v].append(r)
                print(
                    f"[{rep_i + 1}/{repeats}] {v}: {r.get('step_s', r['status'])} ({time.perf_counter() - t0:.0f} s, "
                    f"load {load[0]:.1f})",
                    flush=True,
                )
    results = {v: _aggregate(rs) for v, rs in runs.items()}
    ratios, ratio_runs = _paired_ratios(runs)
    throughput = swap_throughput(
        swap, 256 * 2**20 if not args.quick else 64 * 2**20, 1 << 20, 8, 2 if args.quick else args.rounds, run_ds
    )
    loads = [r["loadavg"][0] for rs in runs.values() for r in rs]
    report = {
        "config": json.loads(config.to_json()),
        "mlp_width": args.mlp_width,
        "mlp_batch": MLP_BATCH,
        "swap_dir": swap,
        "in_memory_optimizer": "torch.optim.AdamW (foreach); offload variants use a CPU Adam kernel",
        "repeats": repeats,
        "run_order": [v for b in blocks for v in b],
        "results": results,
        "ratios_to_in_memory": ratios,
        "ratios_per_repetition": ratio_runs,
        "swap_throughput": throughput,
        "deepspeed": ds_status if args.deepspeed or ds_status != "ok" else "not run (pass --deepspeed)",
        "deepspeed_reference_quoted": {"nvme_opt": 1.095},
        "cpu_count": os.cpu_count(),
        "loadavg": list(os.getloadavg()),
        "loadavg_at_run_starts": {
            "min": min(loads, default=None),
            "max": max(loads, default=None),
            "median": statistics.median(loads) if loads else None,
        },
    }
    report["targets"] = _verdicts(report)
    shutil.rmtree(swap, ignore_errors=True) if args.swap_dir is None else None
    stem = args.stem or ("offload_quick" if args.quick else "offload")
    (BENCH_DIR / "results" / f"{stem}.json").write_text(json.dumps(report, indent=1))
    md = _markdown(report)
    (BENCH_DIR / "results" / f"{stem}.md").write_text(md)
    from _plots import write_png  # matplotlib is optional: without it, one line says no chart was drawn

    write_png("offload", report, BENCH_DIR / "results" / f"{stem}.png")
    print(md)


def _mb(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 1e6:.1f}"


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _markdown(r: dict[str, Any]) -> str:
    load = r["loadavg_at_run_starts"]
    lines = [
        "# ZeRO-Infinity offload benchmark (CPU, 1 rank, 1 thread, gloo)",
        "",
        f"GPT: d_model {r['config']['d_model']}, {r['config']['n_layer']} layers, seq {r['config']['seq_len']}, "
        f"micro-batch {r['config']['micro_batch']}; MLP: width {r['mlp_width']}, {MLP_DEPTH} layers, batch "
        f"{r['mlp_batch']}. In-memory baselines step with torch AdamW (foreach); offload variants with a CPU Adam "
        "kernel (ours / DeepSpeedCPUAdam).",
        "",
        f"Every variant ran {r['repeats']} times, interleaved with the others of its model (ours and DeepSpeed's "
        f"together); step time = median of the runs' medians ({r['config']['timed_steps']} timed steps each after "
        f"{r['config']['warmup_steps']} warm-up); ratio = median over repetitions of the run / the same library's "
        f"in-memory run of that repetition. Load average (1 min) at run starts: {_fmt(load['min'], '.1f')} to "
        f"{_fmt(load['max'], '.1f')} (median {_fmt(load['median'], '.1f')}) on {r['cpu_count']} cores.",
        "",
        "| variant | median step (s) | / in-memory (paired, median) | per-repetition ratios | runs' medians (s) "
        "| resident optimizer MB | kernel Adam | I/O engine |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, res in r["results"].items():
        if res.get("status") != "ok":
            lines.append(f"| {v} | {res.get('status')} | | | | | | |")
            continue
        ratio = r["ratios_to_in_memory"].get(v)
        per = ", ".join(f"{x:.3f}" for x in r["ratios_per_repetition"].get(v, []))
        runs = ", ".join(f"{x:.3f}" for x in res.get("runs_step_s", []))
        lines.append(
            f"| {v} | {res['step_s']:.3f} | {f'{ratio:.3f}' if ratio else '1 (baseline)' if v.endswith('zero3') else '-'} "
            f"| {per or '-'} | {runs} | {_mb(res['optimizer_resident_bytes'])} | {res['uses_kernel_adam']} "
            f"| {res['io_engine'] or '-'} |"
        )
    tp = r["swap_throughput"]
    lines += [
        "",
        f"Swap throughput: {tp['bytes'] / 2**20:.0f} MiB, block {tp['block_size'] // 1024} KiB, queue depth "
        f"{tp['queue_depth']}, median of {tp['rounds']} rotated rounds after a warm-up.",
        "",
        "| contender | write MB/s | read MB/s | write rounds | read rounds | engine |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in tp["rows"].items():
        if row.get("status") != "ok":
            lines.append(f"| {name} | {row.get('status')} | | | | |")
            continue
        lines.append(
            f"| {name} | {row['write_MBps']:.0f} | {row['read_MBps']:.0f} | "
            f"{', '.join(f'{x:.0f}' for x in row['write_MBps_rounds'])} | "
            f"{', '.join(f'{x:.0f}' for x in row['read_MBps_rounds'])} | {row['engine']} |"
        )
    lines += ["", "| target | measured | goal | met |", "|---|---|---|---|"]
    for name, t in r["targets"].items():
        met = (
            "n/a"
            if t["met"] is None and "reference" in t["target"]
            else ("not run" if t["met"] is None else "yes" if t["met"] else "**no**")
        )
        lines.append(f"| {name} | {_fmt(t['value'])} | {t['target']} | {met} |")
    lines += ["", f"DeepSpeed peer: {r['deepspeed']}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
