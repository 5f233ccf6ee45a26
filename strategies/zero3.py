"""``zstack_zero3``: a thin Lightning adapter over the ZeRO-3 engine in ``zlightning.zero``.

[Note: optimizers before sharding]
Lightning's FSDP strategies shard first and build optimizers after, which makes ``configure_optimizers`` see
flattened shards (``p.ndim == 1`` everywhere, so the usual "decay only matrices" grouping silently breaks). Like
DeepSpeed, this strategy calls ``configure_optimizers`` while the parameters are still full, then shards the model and
re-points each optimizer's parameter lists to the shard pieces (``attach_optimizer``). Optimizers are created lazily
(no state yet), so nothing full-sized is ever allocated for them. Models built in ``configure_model`` are created on
the meta device and each rank materialises only its shards; for them (and for a second ``fit`` of a module that is
still sharded) ``configure_optimizers`` sees full-shape meta stand-ins of the parameters, re-pointed to the shards
the same way.

[Note: after fit]
Gathering the model at the end of ``fit`` (full parameters and full optimizer state on every rank) would need more
memory than training did, so a model that trains only because it is sharded could not finish ``fit``. As Lightning's
own FSDP strategies do, the module therefore stays sharded after ``fit``: its hooks still gather each unit when it is
called (every rank calls it, as in training), ``trainer.validate/test/predict`` (and another ``fit``) reuse the
engine, and ``trainer.save_checkpoint`` writes sharded checkpoints as during training. Full weights come out unit by
unit: ``summon_full_params`` (the full module on rank 0 or on every rank, gathered one group at a time) and
``save_full_state_dict`` / ``zlightning consolidate`` (a file written one tensor at a time).

[Note: checkpoints here]
By default (``CheckpointPolicy(state_dict_type="sharded")``) ``trainer.save_checkpoint``, ``ModelCheckpoint`` and
``ckpt_path=`` use a directory where every rank writes only its own shards (``zlightning.zero.save_sharded``); it
loads at any world size and ``zlightning consolidate`` turns it into one plain file. With ``"full"`` the strategy
gathers full, world-size independent state on rank 0 into an ordinary Lightning checkpoint file. Both formats are
written durably and published atomically (see [Note: what durable means here] in ``zlightning/_durable.py``): a
crash at any moment leaves the previous or the new checkpoint, complete, under the name, and a failed save raises
``CheckpointSaveError`` on every rank. Loading happens
after setup (``restore_checkpoint_after_setup``), and ``load_checkpoint`` restores the optimizers itself for both
formats (``lightning_restore_optimizer`` is False), as DeepSpeed's and FSDP's strategies do.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override
from zlightning.kernels._host_cache import empty_host_cache
from zlightning.strategies._base import LaunchedParallelStrategy
from zlightning.strategies._groups import metrics_to_group
from zlightning.strategies._precision import ZeroPrecision
from zlightning.strategies._weights_only import requested_weights_only

from zlightning._durable import remove_durably, resolve, save_failure_message, write_durably
from zlightning.compile import CompileConfig
from zlightning.compile._zero3 import ZeroCompileHandle, compile_zero3
from zlightning.inject._api import TPGroups, apply_tensor_parallel
from zlightning.inject._clip import tp_model_parallel_grads, tp_split_layout
from zlightning.zero import (
    CheckpointError,
    CheckpointPolicy,
    CheckpointSaveError,
    DynamicLossScaler,
    MemoryReport,
    MixedPrecisionPolicy,
    ZeroConfig,
    ZeroState,
    attach_optimizer,
    engine_of,
    full_optim_state_dict,
    full_state_dict,
    is_sharded_checkpoint,
    load_full_optim_state_dict,
    load_full_state_dict,
    load_sharded,
    memory_report,
    save_sharded,
    zero3_shard,
)
from zlightning.zero._deepspeed_config import DeepSpeedSettings, from_deepspeed_config
from zlightning.zero._deferred import InitRecording, deferred_init
from zlightning.zero._offload_config import CPUOffload, NVMeOffload
from zlightning.zero._tp_checkpoint import is_tp_checkpoint, load_sharded_tp, read_tp_index, save_sharded_tp

__all__ = ["ZStackZero3Strategy", "ZeroMemoryMonitor"]

log = logging.getLogger(__name__)


class ZStackZero3Strategy(LaunchedParallelStrategy):
    """ZeRO stage 3 data parallelism: parameters, gradients and optimizer state sharded across ranks.

    Use ``Trainer(strategy="zstack_zero3")`` (after ``import zlightning``) or pass an instance to tune the engine::

        Trainer(strategy=ZStackZero3Strategy(ZeroConfig(unit_modules=("Block",))), precision="bf16-mixed")

    Any ``LightningModule`` works unchanged; ``configure_optimizers`` sees the full parameters. After ``fit`` the
    module stays sharded (see [Note: after fit]): call it on every rank as during training, or get full weights
    with ``zlightning.zero.summon_full_params`` / ``save_full_state_dict``.

    Args:
        zero: engine knobs (prefetch, persistence, buckets, overlap, units). See ``ZeroConfig``.
        checkpoint: sharded (default) or full checkpoints. See ``CheckpointPolicy``.
        config: a DeepSpeed config (dict or JSON path): its ZeRO keys are mapped, its precision, clipping and
            batch-size keys are checked against the Trainer, and unsupported keys are all reported in one error.
            Given together with ``zero``/``checkpoint`` (e.g. ``--trainer.strategy.config=ds.json`` on top of a
            YAML's ``zero:`` knobs), the config's settings win and the other knobs are kept; one line lists both.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        process_group_backend: ``"gloo"``/``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout: collective timeout (a hung rank fails after this instead of blocking forever).
        start_method: ``"popen"`` (re-run the script per rank, like ``ddp``), ``"spawn"``, ``"fork"`` or
            ``"forkserver"``.
        offload_optimizer: ``CPUOffload()`` or ``NVMeOffload(path=...)``: Adam/AdamW state (and fp32 masters) off
            the device, stepped on the host (shortcut for ``ZeroConfig.offload_optimizer``). Strategy names:
            ``"zstack_zero3_offload"`` (CPU) and ``"zstack_zero3_nvme"`` (NVMe, optimizer and parameters).
        offload_params: ``NVMeOffload(path=...)``: parameter shards in swap files between uses. With any NVMe
            offload, swap traffic is logged per step as ``offload/swap_*`` (bytes, MB/s).
        compile: True or a ``CompileConfig``: compile the model with ``zlightning.compile.compile_zero3`` at setup
            (Lightning refuses user-compiled models for custom strategies, so the strategy compiles). The default
            ``mode="unit"`` compiles each ZeRO unit; ``CompileConfig(mode="graph")`` (or ``"auto"``) puts the ZeRO-3
            collectives inside one compiled graph of the model (the step must call the model, e.g.
            ``self.model(x)``; per-unit mode is used with offload or tensor parallelism).
        tensor_parallel_size: > 1 gives a DP x TP grid: ``zlightning.inject`` shards every Linear over contiguous
            groups of this many ranks, ZeRO-3 shards over the strided data-parallel groups, and the sampler,
            ``self.log(..., sync_dist=True)`` and the module's torchmetrics metrics see data-parallel ranks only
            (``data_parallel_group``). ``gradient_clip_val`` clips the norm of the whole model.

    [Note: tensor parallel and compile in the strategy]
    Tensor parallelism is applied once, before the optimizers are built (``configure_optimizers`` then sees the
    tensor-parallel shards, which ZeRO-3 shards further across the data-parallel group); the modules stay
    tensor-parallel after ``fit`` (``zlightning.inject.tp_full_state`` gathers full weights). Gradient clipping
    (``Trainer(gradient_clip_val=...)``) and the fp16 overflow check see the whole grid: the engine is told which
    parameters are split across the TP group (``ZeroState.model_parallel``), so slices are summed over TP, replicated
    parameters counted once and ZeRO pieces summed over DP. Compilation wraps each
    unit's forward after sharding, so the engine's gather/release hooks stay at unit boundaries, and is undone in
    ``teardown`` before the module is unsharded.
    """

    strategy_name = "zstack_zero3"

    def __init__(
        self,
        zero: ZeroConfig = ZeroConfig(),
        checkpoint: CheckpointPolicy = CheckpointPolicy(),
        config: str | dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        *,
        offload_optimizer: CPUOffload | NVMeOffload | None = None,
        offload_params: NVMeOffload | None = None,
        compile: bool | CompileConfig = False,
        tensor_parallel_size: int = 1,
    ) -> None:
        if not isinstance(compile, (bool, CompileConfig)):
            raise TypeError(f"ZStackZero3Strategy(compile=...) expects a bool or a CompileConfig, got {compile!r}")
        if (
            not isinstance(tensor_parallel_size, int)
            or isinstance(tensor_parallel_size, bool)
            or tensor_parallel_size < 1
        ):
            raise ValueError(
                f"ZStackZero3Strategy(tensor_parallel_size=...) must be an int >= 1 dividing the world size, "
                f"got {tensor_parallel_size!r}"
            )
        if not isinstance(zero, ZeroConfig):
            raise TypeError(f"ZStackZero3Strategy(zero=...) expects a ZeroConfig, got {type(zero).__name__}")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )
        if not isinstance(checkpoint, CheckpointPolicy):
            raise TypeError(
                f"ZStackZero3Strategy(checkpoint=...) expects a CheckpointPolicy, got {type(checkpoint).__name__}"
            )
        self.deepspeed: DeepSpeedSettings | None = None
        if config is not None:
            self.deepspeed = from_deepspeed_config(config)
            zero, checkpoint = _merge_deepspeed(zero, checkpoint, self.deepspeed, config)
        if offload_optimizer is not None or offload_params is not None:  # ZeroConfig validates the policies
            zero = dataclasses.replace(
                zero,
                offload_optimizer=offload_optimizer or zero.offload_optimizer,
                offload_params=offload_params or zero.offload_params,
            )
        self.zero = zero
        self.checkpoint = checkpoint
        self._engine: ZeroState | None = None
        self._attached: list[torch.optim.Optimizer] = []
        self._loaded_sharded = False
        self._failed = False
        self._recording: InitRecording | None = None  # how configure_model built the model (meta device)
        # See [Note: tensor parallel and compile in the strategy].
        self.compile_config: CompileConfig | None = CompileConfig() if compile is True else (compile or None)
        self.tensor_parallel_size = tensor_parallel_size
        self._tp: TPGroups | None = None
        self._tp_layout: dict[str, tuple[int, int]] = {}
        self._compiled: ZeroCompileHandle | None = None

    # ---------------------------------------------------------------- ranks (launch and ranks: LaunchedParallelStrategy)
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        tp = self.tensor_parallel_size  # TP peers read the same samples: the sampler sees data-parallel ranks only
        return {"num_replicas": self.num_nodes * self.num_processes // tp, "rank": self.global_rank // tp}

    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        """The data-parallel group under ``tensor_parallel_size > 1`` (None otherwise: the world). Pass it as
        ``process_group=`` to torchmetrics metrics created outside the LightningModule's ``__init__``."""
        return self._tp.dp_group if self._tp is not None else None

    @property
    def engine(self) -> ZeroState | None:
        """The ZeRO-3 engine sharding the model (from setup on; None once the module was unsharded)."""
        if self._engine is not None and self.model is not None and engine_of(self.model) is not self._engine:
            self._engine, self._attached = None, []  # unsharded by ``unshard_module``: a plain module again
        return self._engine

    # ---------------------------------------------------------------- precision (the property: LaunchedParallelStrategy)
    precision_type = ZeroPrecision

    @override
    def _check_foreign_precision(self, plugin: Precision) -> None:
        if type(plugin).__name__ not in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision"):
            raise TypeError(
                f"zstack_zero3 manages precision itself and cannot use {type(plugin).__name__}; pass "
                "Trainer(precision='32-true'|'bf16-mixed'|'bf16-true'|'16-mixed'|'16-true') instead"
            )

    # ---------------------------------------------------------------- setup and teardown
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.accelerator is None:
            raise AssertionError("accelerator must be set before setup")
        self.accelerator.setup(trainer)
        self.model_to_device()
        if self._tp is None and self.tensor_parallel_size > 1 and self.model is not None and engine_of(self.model):
            raise ValueError(
                "this module is already sharded by an earlier zstack_zero3 run; tensor parallelism cannot be applied "
                "to it again from a new strategy: reuse the Trainer of that run (trainer.validate/test/predict/fit)"
            )
        if self.tensor_parallel_size > 1 and self._tp is None:  # once: the modules stay tensor-parallel afterwards
            if self.model is None:
                raise AssertionError("setup() before connect()")
            if self._recording is not None and any(t.is_meta for t in self.model.parameters()):
                # tensor parallelism slices full weights: a model built in configure_model is materialised whole
                # first (every rank from rank 0's generator states, so the replicas are identical)
                self._recording.synchronize(None, 0)
                self._recording.materialize_module(self.model)
            self._tp = apply_tensor_parallel(self.model, self.tensor_parallel_size)
            self._tp_layout = tp_split_layout(self.model)  # for checkpoints: see [Note: sharded checkpoints with TP]
            metrics_to_group(self.model, self._tp.dp_group)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.model is None:
            raise AssertionError("setup() before connect()")
        plugin = self.precision_plugin
        if not isinstance(plugin, ZeroPrecision):
            raise AssertionError(f"unexpected precision plugin {type(plugin).__name__}")
        self._check_deepspeed_against(trainer, plugin)
        config = self._config_for(plugin)
        engine = self._engine or engine_of(self.model)  # sharded by an earlier fit: see [Note: after fit]
        if engine is not None:
            self._adopt(engine, config)
        stand_ins = None
        if fitting and engine is not None:  # configure_optimizers still sees full shapes (meta stand-ins)
            with engine.full_shape_stand_ins() as stand_ins:
                self.setup_optimizers(trainer)
        elif fitting:
            self.setup_optimizers(trainer)  # over full parameters: see [Note: optimizers before sharding]
        if engine is None:
            dp_group = self._tp.dp_group if self._tp is not None else None
            engine = zero3_shard(self.model, config, process_group=dp_group, device=self.root_device)
            if self._recording is not None:  # every initial value is in the shards now: free what the log holds
                self._recording.discard()  # (e.g. a state dict that configure_model loaded into the meta model)
                self._recording = None
            # clipping and the fp16 overflow check also reduce over the TP group: see [Note: tensor parallel and
            # compile in the strategy]
            engine.model_parallel = (
                tp_model_parallel_grads(self.model, self._tp.tp_group) if self._tp is not None else None
            )
        self._engine = engine
        if self.compile_config is not None:
            self._compiled = compile_zero3(engine, self.compile_config)
        if fitting:  # validate/test/predict keep the optimizers of the fit (for checkpoints saved afterwards)
            users = [getattr(o, "_optimizer", o) for o in self.optimizers]  # type: ignore[has-type]
            # With offload_optimizer the optimizer to step is an OffloadedAdam sharing the user's param_groups.
            self._attached = [attach_optimizer(engine, optimizer, stand_ins=stand_ins) for optimizer in users]
            if any(a is not u for a, u in zip(self._attached, users)):
                self.optimizers = list(self._attached)
        plugin.engine = engine
        plugin.device = self.root_device.type
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _adopt(self, engine: ZeroState, config: ZeroConfig) -> None:
        """Reuses the engine of a module sharded by an earlier run (same or another Trainer).

        Raises:
            ValueError: the earlier run sharded it differently (stage, offload, group size or tensor parallelism).
        """
        if engine is self._engine:
            return
        old = engine.config
        differs = [
            name
            for name in ("stage", "offload_optimizer", "offload_params", "unit_modules")
            if getattr(old, name) != getattr(config, name)
        ]
        if engine.world_size * self.tensor_parallel_size != self.world_size or self.tensor_parallel_size > 1:
            differs.append("world size / tensor_parallel_size")
        if differs:
            raise ValueError(
                f"this module is already sharded by an earlier zstack_zero3 run, with other {', '.join(differs)}; "
                "it stays sharded after fit (see the strategy's docs). Run with the same strategy settings, or "
                "export full weights first (zlightning.zero.save_full_state_dict) and load them into a fresh module."
            )
        if old.mixed_precision != config.mixed_precision:
            raise ValueError(
                f"this module is already sharded by an earlier zstack_zero3 run with mixed precision "
                f"{old.mixed_precision}, now {config.mixed_precision}: use the same Trainer(precision=...)"
            )

    def _check_deepspeed_against(self, trainer: pl.Trainer, plugin: ZeroPrecision) -> None:
        ds = self.deepspeed
        if ds is None:
            return
        wrong = []
        if ds.precision is not None and plugin.precision != ds.precision:
            wrong.append(f"the config enables {ds.precision.split('-')[0]}: use Trainer(precision={ds.precision!r})")
        if ds.precision is None and plugin.precision != "32-true":
            wrong.append(f"Trainer(precision={plugin.precision!r}) but the config enables neither bf16 nor fp16")
        if ds.gradient_clipping and (trainer.gradient_clip_val or 0) != ds.gradient_clipping:
            wrong.append(
                f"gradient_clipping={ds.gradient_clipping}: use Trainer(gradient_clip_val={ds.gradient_clipping})"
            )
        gas = ds.gradient_accumulation_steps
        if gas is not None and gas != trainer.accumulate_grad_batches:
            wrong.append(f"gradient_accumulation_steps={gas}: use Trainer(accumulate_grad_batches={gas})")
        if wrong:
            raise ValueError("DeepSpeed config and Trainer disagree: " + "; ".join(wrong))
        if ds.loss_scaler is not None and plugin.scaler is not None:
            plugin.scaler = DynamicLossScaler(ds.loss_scaler)

    @override
    def on_train_start(self) -> None:
        ds, trainer = self.deepspeed, self.lightning_module.trainer if self.lightning_module else None
        if ds is None or trainer is None:
            return
        loader = trainer.train_dataloader
        micro = getattr(getattr(loader, "batch_sampler", None), "batch_size", None) or getattr(
            loader, "batch_size", None
        )
        world = self.num_nodes * self.num_processes
        wrong = []
        if (
            ds.train_micro_batch_size_per_gpu is not None
            and micro is not None
            and micro != ds.train_micro_batch_size_per_gpu
        ):
            wrong.append(
                f"train_micro_batch_size_per_gpu={ds.train_micro_batch_size_per_gpu} but the loader's batch size is {micro}"
            )
        if ds.train_batch_size is not None and micro is not None:
            actual = micro * trainer.accumulate_grad_batches * world
            if actual != ds.train_batch_size:
                wrong.append(
                    f"train_batch_size={ds.train_batch_size} but micro-batch x accumulation x ranks = {actual}"
                )
        if wrong:
            raise ValueError("DeepSpeed config and the training setup disagree: " + "; ".join(wrong))

    def _config_for(self, plugin: ZeroPrecision) -> ZeroConfig:
        wanted = self.zero.mixed_precision.param_dtype
        if wanted is not None and wanted != plugin.param_dtype:
            raise ValueError(
                f"ZeroConfig.mixed_precision.param_dtype={wanted!r} contradicts Trainer(precision="
                f"{plugin.precision!r}); leave param_dtype unset and choose the precision on the Trainer"
            )
        policy = MixedPrecisionPolicy(
            param_dtype=plugin.param_dtype, reduce_dtype=self.zero.mixed_precision.reduce_dtype
        )
        return ZeroConfig(**{**self.zero.__dict__, "mixed_precision": policy})

    @override
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Modules built in ``configure_model`` go to the meta device and their construction is recorded: each rank
        then materialises only its shards, with exactly the values an unsharded build of the same seeded code has
        (see [Note: recorded initialisation]), so a model larger than one rank's memory can be built."""
        if self._recording is not None:
            self._recording.discard()
        with deferred_init(self.root_device) as recording:
            yield
        self._recording = recording

    @override
    def model_to_device(self) -> None:
        if self.model is None:
            raise AssertionError("model_to_device() before connect()")
        if any(t.is_meta for t in self.model.parameters()):
            # Sharded initialisation: the engine materialises shards on root_device; move only real tensors.
            with torch.no_grad():
                for module in self.model.modules():
                    for p in module._parameters.values():
                        if p is not None and not p.is_meta:
                            p.data = p.data.to(self.root_device)
                    for name, b in module._buffers.items():
                        if b is not None and not b.is_meta:
                            module._buffers[name] = b.to(self.root_device)
            return
        self.model.to(self.root_device)

    # [Note: every rank runs as many evaluation steps]
    # Each call of the sharded module gathers its units together with the other ranks, so a rank with more batches
    # waits in a collective its peers never join: a hang, or a "peer exited" error once they finish. Lightning's
    # predict sampler does not pad (5 samples on 2 ranks: 3 and 2 batches), nor do custom samplers or
    # ``use_distributed_sampler=False``. The counts are compared at the start of each loop (one small all-gather)
    # and every rank raises the same error, so none is left waiting and the module stays sharded and usable.
    @override
    def on_validation_start(self) -> None:
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING
        loop = trainer.fit_loop.epoch_loop.val_loop if fitting else trainer.validate_loop
        self._check_even_batches("fit's validation" if fitting else "validate", loop.max_batches, "val")

    @override
    def on_test_start(self) -> None:
        self._check_even_batches("test", self.lightning_module.trainer.test_loop.max_batches, "test")

    @override
    def on_predict_start(self) -> None:
        self._check_even_batches("predict", self.lightning_module.trainer.predict_loop.max_batches, "predict")

    def _check_even_batches(self, stage: str, max_batches: list[int | float], limit: str) -> None:
        engine = self.engine
        if engine is None or engine.config.stage != 3 or engine.world_size == 1:
            return
        mine = torch.tensor([float(sum(max_batches))], dtype=torch.float64, device=self.root_device)
        counts = [torch.empty_like(mine) for _ in range(engine.world_size)]
        torch.distributed.all_gather(counts, mine, group=engine.process_group)
        seen = [float(c) for c in counts]
        if len(set(seen)) == 1 or any(c == float("inf") for c in seen):  # an unsized loader: nothing to compare
            return
        per_rank = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(seen))
        raise UnevenBatchesError(
            f"trainer.{stage} with zstack_zero3: the data-parallel ranks have different numbers of batches "
            f"({per_rank}). The module is sharded, and every call of it gathers its parameters together on all "
            "ranks, so each rank must run the same number of steps (a rank with more would wait for the others "
            f"forever). Make the dataset's length a multiple of world size x batch size, pass limit_{limit}_batches="
            f"{int(min(seen))}, use a sampler that gives every rank the same count (with use_distributed_sampler="
            "False), or run on one rank with the full model: `with summon_full_params(model, rank0_only=True) as "
            "full:` (zlightning.zero). See [Note: every rank runs as many evaluation steps] in strategies/zero3.py."
        )

    @override
    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, UnevenBatchesError):
            return  # raised on every rank alike before any step: the engine is intact and stays usable
        # Another rank may be gone: teardown must not start collectives (see teardown).
        self._failed = True

    @override
    def teardown(self) -> None:
        """Ends a run; the module stays sharded (see [Note: after fit]). Unlike Lightning's base teardown, nothing is
        moved to the CPU: the parameters are views of the engine's shards and must stay where the shards are."""
        if self._compiled is not None:
            self._compiled.restore()
            self._compiled = None
        if self._engine is not None:
            if self._failed:
                self._engine.remove_hooks()  # another rank may be gone: no collectives; also removes swap files
                self._engine = None
                self._attached = []
            else:
                self._engine.release_all(keep_persistent=False)
            if isinstance(self._precision_plugin, ZeroPrecision):
                self._precision_plugin.engine = None
        if self._recording is not None:
            self._recording.discard()  # a run that failed before sharding
            self._recording = None
        empty_host_cache()  # the step's idle buffers go back to the OS
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---------------------------------------------------------------- steps
    def _pass(self) -> Any:
        return self._engine.forward_pass() if self._engine is not None else nullcontext()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pass():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pass():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pass():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pass():
            return super().predict_step(*args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        out = super().optimizer_step(optimizer, closure, model, **kwargs)
        offload = self._engine.offload if self._engine is not None else None
        module = self.lightning_module
        if offload is not None and offload.swappers() and module is not None and module._current_fx_name:
            # TensorBoard (any logger): swap traffic of this step, forward/backward and optimizer together
            stats = {f"offload/{k}": v for k, v in offload.swap_stats().items()}
            module.log_dict(stats, on_step=True, on_epoch=False, rank_zero_only=True)
        return out

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning enters this for accumulation micro-batches: stage 1 then keeps gradients local."""
        if self._engine is None or self.zero.stage != 1:
            yield None
            return
        self._engine.gradient_sync = False
        try:
            yield None
        finally:
            self._engine.gradient_sync = True

    # ---------------------------------------------------------------- collectives used by Lightning
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``self.log(..., sync_dist=True)`` reduces over the data-parallel group by default: TP peers hold the same
        replica, so a world-wide sum would count each replica ``tensor_parallel_size`` times."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(
                tensor, group if group is not None else self.data_parallel_group, reduce_op=reduce_op
            )
        return tensor

    # ---------------------------------------------------------------- checkpoints: see [Note: checkpoints here]
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizers itself, for both formats

    def _sharded(self) -> bool:
        return self.engine is not None and self.checkpoint.state_dict_type == "sharded"

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            return super().lightning_module_state_dict()
        if self._sharded():
            return {}  # written shard by shard in save_checkpoint
        self._refuse_full_with_tp()
        return full_state_dict(engine, rank0_only=True)

    def _refuse_full_with_tp(self) -> None:
        if self._tp is not None:  # rank 0 would write its own tensor-parallel slices under the full names
            raise ValueError(
                "ZStackZero3Strategy(checkpoint=CheckpointPolicy(state_dict_type='full')) with tensor_parallel_size="
                f"{self._tp.tp_size}: a full checkpoint of a tensor-parallel model is not supported. Use the default "
                "sharded checkpoints (they resume at any data-parallel size) and `zlightning consolidate CKPT "
                "model.pt` for one plain state dict"
            )

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        engine = self.engine
        if engine is None:
            return super().optimizer_state(optimizer)
        if self._sharded():
            return {}
        return full_optim_state_dict(engine, getattr(optimizer, "_optimizer", optimizer), rank0_only=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded():
            if (
                storage_options is not None
                or type(self.checkpoint_io) is not TorchCheckpointIO
                or "://" in str(filepath)
            ):
                return super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return self._save_full_durably(checkpoint, Path(filepath))
        if storage_options is not None:
            raise TypeError(
                "zstack_zero3 sharded checkpoints do not take storage_options (use a local or mounted path)"
            )
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        engine = self._engine
        if engine is None:
            raise AssertionError("sharded save without an engine")
        if self._tp is not None:  # see [Note: sharded checkpoints with tensor parallelism] in zlightning.zero
            save_sharded_tp(
                engine,
                self._attached,
                filepath,
                client,
                tp_rank=self._tp.tp_rank,
                tp_size=self._tp.tp_size,
                layout=self._tp_layout,
                save_full_weights=self.checkpoint.save_full_weights,
            )
            return
        save_sharded(engine, self._attached, filepath, client, save_full_weights=self.checkpoint.save_full_weights)

    def _save_full_durably(self, checkpoint: dict[str, Any], path: Path) -> None:
        """Rank 0 writes the single-file checkpoint through a temporary, ``fsync`` and an atomic publication (see
        [Note: what durable means here] in ``zlightning/_durable.py``); a failure is raised on every rank."""
        error = None
        if self.is_global_zero:
            existed = os.path.lexists(path)
            try:
                write_durably(path, lambda tmp: torch.save(checkpoint, tmp))
            except Exception as err:  # noqa: BLE001 - every rank must learn of it (see CheckpointSaveError)
                error = save_failure_message(path, "rank 0", err, existed)
        error = self.broadcast(error)
        if error is not None:
            raise CheckpointSaveError(error)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """A checkpoint leaves its name in one rename before its files are deleted (never half-deleted)."""
        if not self.is_global_zero:
            return
        if type(self.checkpoint_io) is TorchCheckpointIO and "://" not in str(filepath):
            remove_durably(filepath)
        else:
            super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        weights_only = requested_weights_only(weights_only)  # see [Note: Lightning's weights_only after setup]
        if "://" not in str(checkpoint_path):
            checkpoint_path = resolve(checkpoint_path)  # see [Note: the name always resolves] in zlightning/_durable.py
        engine = self.engine
        if engine is not None and self._tp is not None and "://" not in str(checkpoint_path):
            client = load_sharded_tp(
                engine,
                self._attached,
                checkpoint_path,
                tp_rank=self._tp.tp_rank,
                tp_size=self._tp.tp_size,
                weights_only=weights_only,
            )
            self._loaded_sharded = True
            return client
        if engine is not None and "://" not in str(checkpoint_path) and is_tp_checkpoint(checkpoint_path):
            index = read_tp_index(checkpoint_path)
            raise CheckpointError(
                f"{checkpoint_path} was saved with tensor_parallel_size={index['tp']}; this run has none. Resume it "
                "with ZStackZero3Strategy(tensor_parallel_size=...) of that size, or consolidate it (zlightning "
                "consolidate CKPT model.pt) and load the weights with load_state_dict in configure_model"
            )
        if engine is not None and is_sharded_checkpoint(checkpoint_path):
            client = load_sharded(engine, self._attached, checkpoint_path, weights_only=weights_only)
            self._loaded_sharded = True
            return client
        self._loaded_sharded = False
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        if engine is not None and self._attached and "optimizer_states" in checkpoint:
            self.load_optimizer_state_dict(checkpoint)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        engine = self.engine
        if engine is None:
            return super().load_model_state_dict(checkpoint, strict=strict)
        if self._loaded_sharded:
            return  # loaded in load_checkpoint
        load_full_state_dict(engine, checkpoint["state_dict"], strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        engine = self.engine
        if engine is None:
            return super().load_optimizer_state_dict(checkpoint)
        states = checkpoint["optimizer_states"]
        if len(states) != len(self._attached):
            raise ValueError(
                f"checkpoint has {len(states)} optimizer states but configure_optimizers returned "
                f"{len(self._attached)} optimizers"
            )
        for optimizer, osd in zip(self._attached, states):
            load_full_optim_state_dict(engine, optimizer, osd)

    # ---------------------------------------------------------------- reporting
    def memory_report(self) -> MemoryReport:
        """This rank's resident model-state bytes (sharded params, grads, optimizer state, gathered copies).

        Raises:
            RuntimeError: called outside setup..teardown (the model is not sharded then).
        """
        engine = self.engine
        if engine is None:
            raise RuntimeError(
                "memory_report() needs a sharded model: call it during fit (e.g. from a callback) or use "
                "ZeroMemoryMonitor"
            )
        return memory_report(engine, self._attached)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="ZeRO stage 3: parameters, gradients and optimizer state sharded"
        )
        strategy_registry.register(
            "zstack_zero3_offload",
            cls,
            description="ZeRO-3 with optimizer state and fp32 masters on the CPU (CPU Adam)",
            zero=ZeroConfig(offload_optimizer=CPUOffload()),
        )
        strategy_registry.register(
            "zstack_zero3_nvme",
            cls,
            description="ZeRO-Infinity: optimizer state and parameter shards swapped to NVMe (temp dir by default)",
            zero=ZeroConfig(offload_optimizer=NVMeOffload(), offload_params=NVMeOffload()),
        )
        strategy_registry.register(
            "zstack_zero2",
            cls,
            description="ZeRO stage 2: gradients and optimizer state sharded",
            zero=ZeroConfig(stage=2),
        )
        strategy_registry.register(
            "zstack_zero1", cls, description="ZeRO stage 1: optimizer state sharded", zero=ZeroConfig(stage=1)
        )


class UnevenBatchesError(ValueError):
    """The ranks would run different numbers of evaluation or predict steps on the sharded module (see
    [Note: every rank runs as many evaluation steps])."""


def _merge_deepspeed(
    zero: ZeroConfig, checkpoint: CheckpointPolicy, ds: DeepSpeedSettings, source: str | dict[str, Any]
) -> tuple[ZeroConfig, CheckpointPolicy]:
    """``zero``/``checkpoint`` with the DeepSpeed config's settings applied on top (a setting counts as given by the
    config when it differs from zlightning's default), and one line naming what came from where."""
    default = ZeroConfig()
    from_config = {
        f.name: getattr(ds.zero, f.name)
        for f in dataclasses.fields(ZeroConfig)
        if getattr(ds.zero, f.name) != getattr(default, f.name)
    }
    kept = [
        f.name
        for f in dataclasses.fields(ZeroConfig)
        if getattr(zero, f.name) != getattr(default, f.name) and f.name not in from_config
    ]
    replaced = [
        f.name
        for f in dataclasses.fields(ZeroConfig)
        if f.name in from_config
        and getattr(zero, f.name) != getattr(default, f.name)
        and getattr(zero, f.name) != from_config[f.name]
    ]
    if ds.checkpoint != CheckpointPolicy():
        checkpoint = ds.checkpoint
    if not kept and not replaced:
        return ds.zero if zero == default else dataclasses.replace(zero, **from_config), checkpoint
    name = source if isinstance(source, str) else "the DeepSpeed config"
    parts = [f"{name} sets {', '.join(f'zero.{k}' for k in from_config) or 'no ZeRO knob'}"]
    if kept:
        parts.append(f"kept from zero=: {', '.join(f'zero.{k}' for k in kept)}")
    if replaced:
        parts.append(f"the config's value replaced zero=: {', '.join(f'zero.{k}' for k in replaced)}")
    rank_zero_info("ZStackZero3Strategy: " + "; ".join(parts))
    return dataclasses.replace(zero, **from_config), checkpoint


# Re-exported from its home, zlightning.callbacks (where the other callbacks live).
from zlightning.callbacks._memory import ZeroMemoryMonitor  # noqa: E402
