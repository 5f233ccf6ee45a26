"""One DeepSpeed ZeRO-3 run, DeepSpeed's side of ``benchmarks/offload.py``, in ``benchmarks/.venv-deepspeed``.

``python offload_deepspeed_worker.py VARIANT CONFIG_JSON SWAP_DIR OUT_JSON MLP_WIDTH`` with the rendezvous variables
set. Variants: ``ds_zero3`` (in-memory, torch AdamW, as ``benchmarks/zero3.py``) and ``ds_nvme_opt`` (optimizer
state on NVMe through DeepSpeed's pipelined swapper and its ``async_io`` op, ``DeepSpeedCPUAdam``) on the GPT;
``ds_mlp_zero3`` / ``ds_mlp_nvme_opt`` the same on the state-dominated wide MLP (``offload.mlp_model``, batch 2).
Same models, data and timing rule as the zlightning variants (``_bench_common``). DeepSpeed's ops are JIT-built
once into ``TORCH_EXTENSIONS_DIR`` (the driver points it inside the DeepSpeed venv).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _bench_common import BenchConfig, build_model, make_batches  # noqa: E402
from _deepspeed_worker import deepspeed_config  # noqa: E402
from offload import MLP_BATCH, mlp_batches, mlp_model  # noqa: E402


def main() -> None:
    variant, config, swap, out = sys.argv[1], BenchConfig.from_json(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    mlp_width = int(sys.argv[5]) if len(sys.argv) > 5 else 2048
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(config.threads)
    mlp = "_mlp_" in variant
    model = mlp_model(mlp_width) if mlp else build_model(config)
    ds = deepspeed_config(config)
    if mlp:
        ds["train_micro_batch_size_per_gpu"] = MLP_BATCH
    if variant.endswith("nvme_opt"):
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        ds["zero_optimization"]["offload_optimizer"] = {
            "device": "nvme",
            "nvme_path": swap,
            "pipeline_read": True,
            "pipeline_write": True,
            "buffer_count": 4,
        }
        ds["aio"] = {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        }
        ds["zero_force_ds_cpu_optimizer"] = True
        optimizer = DeepSpeedCPUAdam(model.parameters(), lr=config.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    torch.set_num_threads(config.threads)
    ends = []
    for x, y in mlp_batches(mlp_width, config.total_steps) if mlp else make_batches(config, 0):
        loss = engine(x).square().mean() if y is None else engine(x, y)[1]
        engine.backward(loss)
        engine.step()
        ends.append(time.perf_counter())
    timed = [b - a for a, b in zip(ends[config.warmup_steps - 1 :], ends[config.warmup_steps :])]
    out.write_text(
        json.dumps(
            {
                "variant": variant,
                "step_s": statistics.median(timed),
                "steps_s": timed,
                "deepspeed": deepspeed.__version__,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
