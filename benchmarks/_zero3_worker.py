"""One rank of a benchmark variant that runs in the project's ``.venv``: Lightning DDP, raw FSDP2, or zstack_zero3.

Launched twice (one process per rank) by ``benchmarks/zero3.py`` with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/
``MASTER_ADDR``/``MASTER_PORT`` set, so every variant starts in fresh processes. Lightning sees ``LOCAL_RANK`` and
treats the processes as externally launched (as under ``torchrun``) instead of spawning its own.

Each rank writes ``<out>/rank<k>.json``: the timed step intervals, the model-state bytes on that rank (see
``_bench_common`` [Note: counting model-state bytes]), the losses and the peak RSS. On failure it writes
``status: "error"`` with the exception, prints the traceback and exits 1.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _bench_common import (  # noqa: E402
    BenchConfig,
    RankEnv,
    StepTimer,
    build_model,
    current_rss_kib,
    make_batches,
    plain_model_state,
    setup_process,
    worker_args,
    write_rank_result,
)

MEMORY_REPORT_FIELDS = (
    "param_bytes",
    "grad_bytes",
    "optimizer_bytes",
    "persistent_bytes",
    "gathered_bytes",
    "model_state_bytes",
)
"""The integer attributes of ``ZStackZero3Strategy.memory_report()`` that the benchmark records."""


def run_fsdp2(config: BenchConfig, env: RankEnv, out_dir: Path) -> dict[str, Any]:
    """A plain torch loop over FSDP2: ``fully_shard`` on each transformer block, then on the root.

    ``out_dir`` is unused (the signature is shared with `run_lightning`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (env.world_size,))
        model = build_model(config)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
        timer, losses = StepTimer(config.warmup_steps), []
        rss_before = current_rss_kib()
        for x, y in make_batches(config, env.rank):
            _, loss = model(x, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            timer.step_end()
            losses.append(loss.item())
        memory = plain_model_state(model.parameters(), optimizer)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return _result(timer, memory, losses, rss_before, {"torch": torch.__version__})


def run_lightning(config: BenchConfig, env: RankEnv, out_dir: Path, strategy: str) -> dict[str, Any]:
    """Lightning ``Trainer.fit`` with ``strategy`` ("ddp" or "zstack_zero3") on CPU, ``devices=world_size``.

    Model state is taken in the last ``on_train_batch_end``, while the model is still wrapped: for DDP counted from
    the module and optimizer, for zstack_zero3 from ``trainer.strategy.memory_report()`` (its parameters live in
    the strategy's own shards, and the strategy un-shards the module at the end of ``fit``). If that report fails
    during fit it is asked again after ``fit``.

    Args:
        config: The benchmark configuration.
        env: This rank's place in the group.
        out_dir: Scratch directory (deleted by the launcher); Lightning's ``default_root_dir`` goes under it.
        strategy: The registered Lightning strategy name.

    Returns:
        This rank's result dict (see the module docstring).
    """
    import lightning
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch.utils.data import DataLoader, Dataset

    zstack = strategy.startswith("zstack_zero3")
    trainer_strategy: Any = strategy
    if zstack:
        from zlightning.strategies import ZStackZero3Strategy

        import zlightning  # noqa: F401  (registers the strategy)
        from zlightning.zero import ZeroConfig

        if strategy == "zstack_zero3_keep":  # one all-gather per unit per step (reshard_after_forward=False)
            trainer_strategy = ZStackZero3Strategy(ZeroConfig(reshard_after_forward=False))
        if strategy == "zstack_zero3_lowmem":  # fixed 1 MiB glibc mmap threshold (ZeroConfig.host_mmap_threshold)
            trainer_strategy = ZStackZero3Strategy(ZeroConfig(host_mmap_threshold=1 << 20))

    class GPTModule(LightningModule):
        """The benchmark GPT: ``training_step`` returns the loss, AdamW over all parameters."""

        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(config)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            _, loss = self.model(*batch)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=config.lr)

    class Batches(Dataset):
        """This rank's precomputed micro-batches, one per index (used with ``batch_size=None``)."""

        def __init__(self) -> None:
            self.batches = make_batches(config, env.rank)

        def __len__(self) -> int:
            return len(self.batches)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.batches[i]

    timer, losses, memory = StepTimer(config.warmup_steps), [], {}
    in_fit_errors: list[str] = []

    class Probe(Callback):
        """Stamps each step end; counts DDP's model state after the last step."""

        def on_train_batch_end(
            self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            timer.step_end()
            losses.append(float(outputs["loss"]))
            if trainer.global_step != config.total_steps:
                return
            if strategy == "ddp":
                memory.update(plain_model_state(pl_module.parameters(), trainer.optimizers[0]))
            else:
                try:
                    memory.update(zstack_memory(trainer))
                except Exception as err:  # noqa: BLE001  (retried after fit, then raised with both reasons)
                    in_fit_errors.append(f"{type(err).__name__}: {err}")

    trainer = Trainer(
        strategy=trainer_strategy,
        accelerator="cpu",
        devices=env.world_size,
        precision="32-true",
        max_steps=config.total_steps,
        max_epochs=1,
        use_distributed_sampler=False,  # each rank already holds its own slice; see make_batches
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out_dir / "lightning"),  # a scratch dir the launcher deletes
        callbacks=[Probe()],
    )
    torch.set_num_threads(config.threads)  # Trainer construction must not have changed it; enforce anyway
    rss_before = current_rss_kib()
    trainer.fit(GPTModule(), DataLoader(Batches(), batch_size=None, shuffle=False, num_workers=0))
    if zstack and not memory:
        try:
            memory = zstack_memory(trainer)
        except Exception as err:
            raise RuntimeError(
                f"trainer.strategy.memory_report() failed in the last on_train_batch_end ({in_fit_errors}) "
                f"and after fit ({type(err).__name__}: {err})."
            ) from err
    if len(losses) != config.total_steps:
        raise RuntimeError(f"Lightning ran {len(losses)} steps, expected {config.total_steps} (max_steps).")
    return _result(timer, memory, losses, rss_before, {"torch": torch.__version__, "lightning": lightning.__version__})


def zstack_memory(trainer: Any) -> dict[str, int]:
    """The integer fields of ``trainer.strategy.memory_report()`` named in `MEMORY_REPORT_FIELDS`."""
    report = trainer.strategy.memory_report()
    return {name: int(getattr(report, name)) for name in MEMORY_REPORT_FIELDS}


def _result(
    timer: StepTimer, memory: dict[str, int], losses: list[float], rss_before_kib: int | None, versions: dict[str, str]
) -> dict[str, Any]:
    return {
        "status": "ok",
        "step_times_s": timer.timed_intervals(),
        "memory": memory,
        "losses": losses,
        "rss_before_train_kib": rss_before_kib,
        "threads": torch.get_num_threads(),
        "versions": versions,
    }


VARIANTS: dict[str, Callable[[BenchConfig, RankEnv, Path], dict[str, Any]]] = {
    "ddp": lambda config, env, out_dir: run_lightning(config, env, out_dir, "ddp"),
    "fsdp2": run_fsdp2,
    "zstack_zero3": lambda config, env, out_dir: run_lightning(config, env, out_dir, "zstack_zero3"),
    "zstack_zero3_keep": lambda config, env, out_dir: run_lightning(config, env, out_dir, "zstack_zero3_keep"),
    "zstack_zero3_lowmem": lambda config, env, out_dir: run_lightning(config, env, out_dir, "zstack_zero3_lowmem"),
}


def main() -> int:
    args = worker_args(__doc__.splitlines()[0], VARIANTS)
    config = BenchConfig.from_json(args.config)
    env = RankEnv.from_environ()
    setup_process(config)
    try:
        result = VARIANTS[args.variant](config, env, args.out)
    except BaseException as err:  # noqa: BLE001  (recorded for the report, then re-signalled by the exit code)
        traceback.print_exc()
        write_rank_result(args.out, env, {"status": "error", "error": f"{type(err).__name__}: {err}"})
        return 1
    write_rank_result(args.out, env, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
