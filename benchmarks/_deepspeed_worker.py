"""One rank of the DeepSpeed ZeRO-3 variant; runs in ``benchmarks/.venv-deepspeed`` (see setup_deepspeed_venv.sh).

Launched twice by ``benchmarks/zero3.py`` with that venv's python and ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set (no ``deepspeed`` launcher). It runs ZeRO stage 3 on the CPU accelerator over
gloo, in fp32, with torch's ``AdamW`` as the client optimizer (DeepSpeed's native CPU Adam is not built:
``DS_BUILD_OPS=0``), and otherwise DeepSpeed's default ZeRO-3 settings.

[Note: what DeepSpeed model state is counted]
After the last step, distinct storages (see ``_bench_common`` [Note: counting model-state bytes]) of:
  * ``param_bytes``: the partitioned parameters, ``p.ds_tensor`` for every parameter, and the flat partition
    buffers they view (``fp16_partitioned_groups_flat``; in fp32 these *are* the parameters' partitions);
  * ``master_bytes``: the fp32 master partitions (``fp32_partitioned_groups_flat``). DeepSpeed means to reuse the
    partitions above when they are already fp32 on the same device, but its check compares a ``torch.device`` with
    the accelerator's device *string* ``'cpu'`` (``stage3.py``, ``_create_fp32_partitions``), which is never equal;
    so on CPU it keeps a second fp32 copy and ``master_bytes == param_bytes`` here;
  * ``grad_bytes``: the flat gradient-partition buffer (``grad_partitions_flat_buffer``), the per-subgroup
    ``averaged_gradients`` and any ``.grad`` on the fp32 partitions;
  * ``optimizer_bytes``: the client AdamW's state (``exp_avg``, ``exp_avg_sq``, ``step``), keyed by the partitions;
  * ``persistent_bytes``: full copies of parameters that are still gathered between steps. DeepSpeed keeps
    parameters below ``stage3_param_persistence_threshold`` (default 1e5 elements: biases, LayerNorms) gathered on
    every rank.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")  # explicit: never probe for CUDA/XPU

import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    BenchConfig,
    RankEnv,
    StepTimer,
    StorageCounter,
    build_model,
    current_rss_kib,
    make_batches,
    optimizer_state_tensors,
    setup_process,
    worker_args,
    write_rank_result,
)


def deepspeed_config(config: BenchConfig) -> dict[str, Any]:
    """The DeepSpeed JSON config: ZeRO-3, fp32, torch AdamW accepted as an untested client optimizer.

    DeepSpeed only takes a dict here; it is built in this one place from the typed `BenchConfig`.
    """
    return {
        "train_micro_batch_size_per_gpu": config.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 1_000_000_000,  # no periodic log lines inside the timed loop
        "wall_clock_breakdown": False,
    }


def zero3_model_state(module: torch.nn.Module, zero_optimizer: Any) -> dict[str, int]:
    """This rank's resident ZeRO-3 model state; see [Note: what DeepSpeed model state is counted]."""
    params = list(module.parameters())
    counter = StorageCounter()
    fp32_partitions = list(getattr(zero_optimizer, "fp32_partitioned_groups_flat", []))
    averaged = getattr(zero_optimizer, "averaged_gradients", {}) or {}
    report = {
        "param_bytes": counter.add(
            [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]
            + list(getattr(zero_optimizer, "fp16_partitioned_groups_flat", []))
        ),
        "master_bytes": counter.add(fp32_partitions),
        "grad_bytes": counter.add(
            [getattr(zero_optimizer, "grad_partitions_flat_buffer", None)]
            + [g for grads in averaged.values() for g in (grads or [])]
            + [t.grad for t in fp32_partitions]
        ),
        "optimizer_bytes": counter.add(optimizer_state_tensors(zero_optimizer.optimizer)),
        "persistent_bytes": counter.add(p.data for p in params if p.data.numel() > 0),
    }
    report["model_state_bytes"] = sum(report.values())
    report["persistent_params"] = sum(1 for p in params if getattr(p, "ds_persist", False))
    return report


def run_deepspeed(config: BenchConfig, env: RankEnv) -> dict[str, Any]:
    """ZeRO-3 training loop: ``engine(x, y)`` → ``engine.backward(loss)`` → ``engine.step()``."""
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(config.threads)  # DeepSpeed's CPU accelerator may have changed it
    try:
        model = build_model(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(config))
        torch.set_num_threads(config.threads)
        timer, losses = StepTimer(config.warmup_steps), []
        rss_before = current_rss_kib()
        for x, y in make_batches(config, env.rank):
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            timer.step_end()
            losses.append(loss.item())
        memory = zero3_model_state(engine.module, engine.optimizer)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return {
        "status": "ok",
        "step_times_s": timer.timed_intervals(),
        "memory": memory,
        "losses": losses,
        "rss_before_train_kib": rss_before,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "deepspeed": deepspeed.__version__},
    }


def main() -> int:
    args = worker_args(__doc__.splitlines()[0], ["deepspeed"])
    config = BenchConfig.from_json(args.config)
    env = RankEnv.from_environ()
    setup_process(config)
    try:
        result = run_deepspeed(config, env)
    except BaseException as err:  # noqa: BLE001  (recorded for the report, then re-signalled by the exit code)
        traceback.print_exc()
        write_rank_result(args.out, env, {"status": "error", "error": f"{type(err).__name__}: {err}"})
        return 1
    write_rank_result(args.out, env, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
