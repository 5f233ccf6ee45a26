"""Train a Hugging Face causal LM with zlightning, from a config (random weights: nothing is downloaded).

    pip install 'zlightning[hf]' torch==2.13.0      # transformers; keep torch at its pin on the same command line
    python examples/hf_causal_lm.py                  # ZeRO-3 + CPU offload + TP2 + compile, curriculum data
    python examples/hf_causal_lm.py --run zero3      # plain zstack_zero3 (DP2)
    python examples/hf_causal_lm.py --run pipeline   # the same Llama as pipeline layers, zstack_pipeline on 2 stages

The model is a small byte-level ``LlamaForCausalLM`` (grouped-query attention, rotary positions, tied embeddings;
``--model-type gpt2`` with ``--config '{...}'`` for others), the data the Python standard library's source with a
sequence-length curriculum (``CurriculumDataModule``). At the end rank 0 writes a Hugging Face folder that
``AutoModelForCausalLM.from_pretrained`` reads without zlightning, and prints where it and the TensorBoard logs are.
``examples/hf_causal_lm.yaml`` is the same run for ``zlightning fit``.

Lightning re-runs this script once per extra rank, so everything is rank-agnostic until the final report.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from zlightning.datamodules import CurriculumDataModule, TextCorpusDataModule  # noqa: E402
from zlightning.strategies import PipelineStrategy, ZStackZero3Strategy  # noqa: E402

import zlightning  # noqa: E402,F401  (registers the strategies)
from zlightning.callbacks import PipelineBubbleMonitor, ZeroMemoryMonitor  # noqa: E402
from zlightning.integrations.huggingface import export_pretrained, pipeline_to_hf_state  # noqa: E402
from zlightning.loggers import TensorBoardLogger  # noqa: E402
from zlightning.models.hf_causal_lm import HFCausalLM, HFCausalLMPipeline, hf_config  # noqa: E402
from zlightning.zero import CPUOffload, summon_full_params  # noqa: E402

RUNS = ("all", "zero3", "offload", "tp", "compile", "pipeline")


def curriculum_data(seq_len: int, batch_size: int, max_bytes: int, ramp_steps: int) -> CurriculumDataModule:
    """Byte-level text, each batch truncated to the curriculum's length: 16 tokens first, ``seq_len`` after
    ``ramp_steps`` steps (DeepSpeed's ``seqlen_truncate``)."""
    metric = {
        "clustering_type": "single_cluster",
        "min_difficulty": 16,
        "max_difficulty": seq_len,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": ramp_steps, "difficulty_step": 8},
    }
    return CurriculumDataModule(
        base=TextCorpusDataModule(seq_len=seq_len, batch_size=batch_size, max_bytes=max_bytes),
        data_efficiency={
            "seed": 1234,
            "data_sampling": {
                "num_epochs": 100,
                "curriculum_learning": {"enabled": True, "curriculum_metrics": {"seqlen_truncate": metric}},
            },
        },
    )


def strategy_for(run: str) -> Any:
    if run == "pipeline":
        return PipelineStrategy(micro_batches=4)
    offload = CPUOffload() if run in ("all", "offload") else None
    return ZStackZero3Strategy(
        offload_optimizer=offload,
        tensor_parallel_size=2 if run in ("all", "tp") else 1,
        compile=run in ("all", "compile"),
    )


def full_hf_state(module: pl.LightningModule, strategy: Any, config: Any) -> dict[str, torch.Tensor] | None:
    """Hugging Face names and full tensors on rank 0 (None elsewhere); a collective: every rank calls it."""
    if isinstance(module, HFCausalLMPipeline):
        parts: list[dict[str, torch.Tensor] | None] = [None] * strategy.world_size
        local = {k: v.detach().cpu() for k, v in module.pipe.state_dict().items()}
        torch.distributed.all_gather_object(parts, local)  # a small model; large ones consolidate a checkpoint
        merged = {k: v for part in parts if part is not None for k, v in part.items()}
        return pipeline_to_hf_state(merged, config) if strategy.global_rank == 0 else None
    with summon_full_params(module):  # the module stays sharded after fit
        if strategy.tensor_parallel_size > 1:
            from zlightning.inject import tp_full_state

            state = tp_full_state(module.model)
        else:
            state = {k: v.detach().clone() for k, v in module.model.state_dict().items()}
    return state if strategy.global_rank == 0 else None


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", choices=RUNS, default="all", help="which strategy setup (default: all of them at once)")
    p.add_argument("--model-type", default="llama", help="a transformers model type (llama, gpt2, mistral, qwen2)")
    p.add_argument("--config", default=None, help="JSON config keys (default: the small byte-level Llama)")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--short", action="store_true", help="a few steps on a small corpus (smoke run)")
    p.add_argument("--out", default="runs", help="TensorBoard logs and the exported Hugging Face folder")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    steps = 4 if args.short else args.steps
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    config = json.loads(args.config) if args.config else None
    cls = HFCausalLMPipeline if args.run == "pipeline" else HFCausalLM
    module = cls(model_type=args.model_type, config=config, lr=2e-3, warmup_steps=min(20, steps))
    hf_cfg = hf_config(args.model_type, config)
    strategy = strategy_for(args.run)
    logger = TensorBoardLogger(args.out, name=f"hf_causal_lm_{args.run}")
    monitor = PipelineBubbleMonitor() if args.run == "pipeline" else ZeroMemoryMonitor(every_n_steps=10)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        val_check_interval=min(50, steps),
        check_val_every_n_epoch=None,
        limit_val_batches=2 if args.short else 5,
        num_sanity_val_steps=0,
        log_every_n_steps=1 if args.short else 5,
        logger=logger,
        enable_checkpointing=False,
        callbacks=[monitor],
    )
    data = curriculum_data(
        seq_len=128, batch_size=8, max_bytes=100_000 if args.short else 2_000_000, ramp_steps=max(1, steps // 2)
    )
    trainer.fit(module, datamodule=data)
    state = full_hf_state(module, strategy, hf_cfg)
    if trainer.is_global_zero and state is not None:
        folder = export_pretrained(state, hf_cfg, os.path.join(logger.log_dir, "hf_model"), prefix="")
        print("\n" + "=" * 72)
        print(f"run                   : {args.run} ({type(strategy).__name__})")
        print(f"final validation loss : {float(trainer.callback_metrics.get('val/loss', float('nan'))):.4f}")
        print(f"TensorBoard logs      : {logger.log_dir}  (tensorboard --logdir {args.out})")
        print(f"Hugging Face folder   : {folder}  (AutoModelForCausalLM.from_pretrained)")
        print("=" * 72)


if __name__ == "__main__":
    main()
