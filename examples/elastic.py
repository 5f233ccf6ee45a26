"""A training script that survives: run it under ``torchrun`` (elastic), SLURM or plain ``python``, kill it at any
moment, start it again, and it continues from its last checkpoint, at whatever world size it gets.

    # one host, 2 ranks; a rank that dies makes torchrun restart both from `last` (up to 3 times)
    torchrun --standalone --nproc-per-node=2 --max-restarts=3 examples/elastic.py --out runs/elastic

    # elastic across hosts: 1 to 2 hosts, c10d rendezvous on HOST0 (run the same line on each host)
    torchrun --nnodes=1:2 --nproc-per-node=1 --max-restarts=3 --rdzv-backend=c10d \\
        --rdzv-endpoint=HOST0:29400 --rdzv-id=elastic-demo examples/elastic.py --out /shared/runs/elastic

What makes it resumable (see "Failure behaviour" in the README):
* ``ModelCheckpoint(every_n_train_steps=..., save_last=True)`` writes ``last`` durably and atomically: a crash at
  any moment leaves the previous or the new checkpoint, complete, under that name;
* ``trainer.fit(..., ckpt_path="last")`` resumes from it when it exists (and starts from scratch the first time);
  a sharded ``zstack_zero3`` checkpoint loads at any world size, so a restart on fewer hosts needs no conversion;
* SIGTERM (preemption, or torchrun stopping the workers) finishes the step in progress, saves ``last`` and exits
  with status 143.
The folder given by ``--out`` must be visible from every host (a shared file system) for a multi-host run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from zlightning.datamodules import TextCorpusDataModule

import zlightning  # noqa: F401  (registers the zstack strategies)
from zlightning.models import GPTLightningModule


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/elastic"), help="checkpoints and logs (shared)")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--strategy", default="zstack_zero3")
    args = parser.parse_args(argv)

    pl.seed_everything(0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # set by torchrun: this restart's size, which may change
    nodes = int(os.environ.get("WORLD_SIZE", str(local))) // local
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="auto",
        devices=local,
        num_nodes=nodes,
        max_steps=args.max_steps,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.out / "checkpoints", every_n_train_steps=args.save_every, save_last=True, save_top_k=0
            )
        ],
    )
    model = GPTLightningModule(seq_len=64, d_model=64, n_layer=2, n_head=2)
    trainer.fit(model, datamodule=TextCorpusDataModule(seq_len=64, batch_size=4), ckpt_path="last")


if __name__ == "__main__":
    main()
