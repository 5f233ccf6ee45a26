"""The main job: train a byte-level GPT on the Python standard library's source with ``zstack_zero3``.

Run with ``make demo`` (or ``.venv/bin/python examples/demo.py``). Two CPU processes (or every GPU), a progress bar,
TensorBoard logs under ``runs/``, a checkpoint, and at the end: final validation loss, tokens/s, where the logs are,
and a text sample from the trained model. ``--short`` runs 60 steps (CI). The validation loss is charted every 100
steps (every 20 with ``--short``) on 8 batches (4).

How long it takes on a 2-core x86-64 machine (2 CPU processes, 1,000 steps): 2 min 23 s for the whole script with the
cores otherwise idle (2 min 11 s of it training, about 15,000 tokens/s), and about 4 minutes of training (4 min 13 s
measured) when other jobs share the cores; ``--short`` takes about 17 s. The first ``make demo`` also creates the
virtualenv and builds the native kernels (about 3 minutes there).

Lightning re-runs this script once per extra rank (its ``popen`` launcher), so everything below is rank-agnostic
until the final report, which rank 0 prints.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from zlightning.datamodules import TextCorpusDataModule
from zlightning.strategies import ZStackZero3Strategy

import zlightning  # noqa: F401  (registers zstack_zero3)
from zlightning.callbacks import ZeroMemoryMonitor
from zlightning.loggers import TensorBoardLogger  # a section per concern (loss, throughput, memory), no hp_metric
from zlightning.models import GPTLightningModule
from zlightning.zero import ZeroConfig, summon_full_params


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--short", action="store_true", help="60 steps only (CI smoke run)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--devices", type=int, default=None, help="processes (default: every GPU, else 2 CPU processes)")
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    p.add_argument("--out", default="runs", help="directory for TensorBoard logs and checkpoints")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    steps = 60 if args.short else args.steps  # 60 steps: enough to learn past byte frequencies (CI checks it)
    cuda = torch.cuda.is_available()
    devices = args.devices or (torch.cuda.device_count() if cuda else 2)
    torch.set_num_threads(1 if not cuda else torch.get_num_threads())
    pl.seed_everything(1234, verbose=False)

    data = TextCorpusDataModule(seq_len=128, batch_size=8, max_bytes=200_000 if args.short else 3_000_000)
    model = GPTLightningModule(seq_len=128, d_model=128, n_layer=4, n_head=4, lr=2e-3, warmup_steps=30)
    strategy = ZStackZero3Strategy(ZeroConfig(unit_modules=("Block",)))
    logger = TensorBoardLogger(args.out, name="gpt_zero3")
    ckpt = ModelCheckpoint(
        dirpath=os.path.join(logger.log_dir, "checkpoints"), save_last=True, save_top_k=1, monitor="val/loss"
    )
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="auto",
        devices=devices,
        precision=args.precision,
        max_steps=steps,
        # a validation curve of 10 points (3 with --short), each on a few batches: as many batches in all as 4
        # points of 20 batches took, so the curve costs no extra time
        val_check_interval=20 if args.short else max(steps // 10, 1),
        check_val_every_n_epoch=None,
        limit_val_batches=4 if args.short else 8,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        log_every_n_steps=5 if args.short else 10,
        logger=logger,
        # GPTLightningModule adds the end-of-fit report itself (final losses, tokens/s, the logs and the checkpoint,
        # printed by rank 0): zlightning.callbacks.RunSummary, from its configure_callbacks
        callbacks=[ckpt, ZeroMemoryMonitor(every_n_steps=10 if args.short else 50)],
    )
    trainer.fit(model, datamodule=data)
    # The module stays sharded after fit: rank 0 gets the full parameters, gathered one unit at a time.
    with summon_full_params(model, rank0_only=True) as full:
        sample = full.generate_text("def ", max_new_tokens=120, temperature=0.8, top_k=20) if full is not None else ""
    if trainer.is_global_zero:
        print("sample (byte-level, from the trained model):")
        print(sample)
        print("=" * 72)


if __name__ == "__main__":
    main()
