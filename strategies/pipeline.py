"""``zstack_pipeline``: a thin Lightning adapter over ``zlightning.pipe`` (pipeline x data parallelism, ZeRO-1/2/3).

[Note: how a step maps onto Lightning]
The LightningModule holds a ``PipelineModule`` (``self.pipe = PipelineModule(layers=..., loss_fn=...)``) and its
``training_step`` returns ``self.pipe.batch_loss(batch)``. ``setup_environment`` builds only this rank's stage(s)
through a ``PipelineEngine`` before the module's ``setup`` hook and ``configure_optimizers`` run (so they see the local
parameters; see [Note: the stage exists from the setup hook on]). ``batch_loss`` runs
the whole schedule, backward included, and returns the batch's mean loss on every rank, so ``self.log`` and the
progress bar show the true number. ``backward`` is therefore a no-op here (its hooks still fire), and
the gradients are moved aside until then so Lightning's ``zero_grad`` (which runs between the two) cannot erase them;
``PipelinePrecision`` inserts, between Lightning's closure and the optimizer step: tied + data-parallel gradient
reduction, global-norm clipping over all stages (``Trainer(gradient_clip_val=...)``), and ZeRO-1's drop / broadcast.
``accumulate_grad_batches`` works: micro-batch losses are scaled by ``1 / accumulate`` and gradients are reduced
once, before the step. Validation, test and prediction use the inference schedule (``batch_loss`` under no-grad,
``self.pipe.predict(inputs)``).

[Note: clipping before the step]
The tied and data-parallel reductions run once per optimizer step, after the schedule's backwards (a ZeRO-0/1
replica holds only its own micro-batches' gradients until then). In automatic optimization Lightning clips inside the
step, after them. With manual optimization the LightningModule calls ``self.clip_gradients(opt, ...)`` after
``manual_backward`` and before ``opt.step()``, as it would under DDP, whose backward has reduced already: here it
clipped the local gradients by their local norm, and the step then averaged the clipped gradients (on DP2 x PP2 with
ZeRO-0/1 the run left one process's from the first step on). ``clip_gradients`` now reduces first, once per step
(``_reduce_once``), and the step does not reduce again; ZeRO-2/3 were right already (their backward
reduce-scatters). Under ``"16-mixed"`` the gradients are also unscaled (and checked for overflow) there, once: clipping
gradients still multiplied by the loss scale clipped them by a norm the scale times too large, so the step then
applied gradients shrunk by up to the scale.

[Note: the stage exists from the setup hook on]
The engine (and so this rank's stage) is built in ``setup_environment``, right after the process group, not in
``setup``: Lightning calls the LightningModule's ``setup(stage)`` and ``configure_model`` hooks in between, and code
there that walks ``self.pipe.named_parameters()`` (freezing layers by name, counting parameters) would see an
unbuilt module with no parameters and silently do nothing, while the same code works in one process (where the
module builds itself on first use). They see this rank's layers instead, as ``configure_optimizers`` does.

[Note: checkpoints here]
``trainer.save_checkpoint``/``ModelCheckpoint`` write a directory (``zlightning.pipe.save_pipeline_checkpoint``:
per-layer files, per-rank optimizer files, Lightning's loop state as client state); ``ckpt_path=`` resumes from it and
``consolidate_pipeline_checkpoint`` turns it into one plain state dict. With ``tensor_parallel_size > 1`` each rank
writes its slices and their layout; such a checkpoint resumes with its optimizer state on the same split and TP size
only, while consolidation and loading the weights elsewhere merge the slices (see [Note: checkpoints with tensor
parallelism] in ``zlightning.pipe._checkpoint``).
``ckpt_path=`` reads every file weights-only (no code from the checkpoint runs); Lightning's
``fit/validate/test/predict(..., weights_only=False)`` is the opt-in to full unpickling for trusted checkpoints (see
[Note: Lightning's weights_only after setup] in ``_weights_only.py``).

[Note: PP x TP in Lightning]
``PipelineStrategy(tensor_parallel_size=t)`` sets ``PipelineConfig.tensor_parallel_size`` (see [Note: PP x TP] in
``zlightning.pipe``). The stages and TP peers of one pipeline hold one model replica and read the same batches, so
the sampler shards by the data-parallel rank only, and ``reduce`` (``self.log(..., sync_dist=True)``) and the
LightningModule's torchmetrics metrics sync over the data-parallel group of this (stage, TP index)
(``data_parallel_group``), with or without TP: a world-wide sum would count each replica ``pp * t`` times. Every rank
logs the same batch loss, so a mean over that group is the global mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Callable, Generator
from datetime import timedelta
from functools import partial
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _sync_ddp_if_available
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType
from typing_extensions import override
from zlightning.strategies._base import LaunchedParallelStrategy
from zlightning.strategies._groups import metrics_to_group
from zlightning.strategies._weights_only import requested_weights_only

from zlightning.pipe import PipeGrid, PipelineConfig, PipelineEngine, PipelineModule
from zlightning.pipe._checkpoint import is_pipeline_checkpoint, load_pipeline_checkpoint, save_pipeline_checkpoint
from zlightning.pipe._partition import layer_weights
from zlightning.zero import LossScalerConfig

__all__ = ["PipelinePrecision", "PipelineStrategy"]


def _check_partition(partition: str) -> None:
    if partition.lower().startswith("type:"):
        try:
            re.compile(partition[len("type:") :])
        except re.error as e:
            raise ValueError(f"PipelineStrategy(partition={partition!r}): invalid regular expression ({e})") from e
    else:
        layer_weights(partition, [], [])


def _pipe_modules(root: torch.nn.Module) -> list[PipelineModule]:
    """The ``PipelineModule``s under ``root``, found without ``modules()`` (which would build an unclaimed one)."""
    found: list[PipelineModule] = []
    stack = [root]
    while stack:
        module = stack.pop()
        if isinstance(module, PipelineModule):
            found.append(module)
            continue
        stack.extend(m for m in module._modules.values() if m is not None)
    return found


class PipelinePrecision(Precision):
    """Full precision (``"32-true"``), bf16 autocast (``"bf16-mixed"``) or fp16 autocast with dynamic loss scaling
    (``"16-mixed"``) around the pipeline, with the engine's gradient reduction, global clipping and ZeRO-1 around the
    optimizer step (see [Note: how a step maps onto Lightning]). With ``"16-mixed"`` the engine scales the loss inside
    the schedule, unscales and checks the gradients of the whole grid after the reduction, and an overflow skips the
    optimizer step on every rank (see [Note: fp16 loss scaling] in ``zlightning.pipe``)."""

    def __init__(self, precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true") -> None:
        if precision not in ("32-true", "bf16-mixed", "16-mixed"):
            raise ValueError(
                f"zstack_pipeline supports precision '32-true', 'bf16-mixed' or '16-mixed', got {precision!r}"
            )
        self.precision = precision  # type: ignore[assignment]
        self.engine: PipelineEngine | None = None
        self._overflow = False
        self._reduced = False
        """Whether this step's gradients are reduced (and, under fp16, unscaled) already; see [Note: clipping before
        the step]."""

    def _engine(self) -> PipelineEngine:
        if self.engine is None:
            raise RuntimeError("zstack_pipeline: the optimizer step ran before the strategy built the pipeline engine")
        return self.engine

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        if self.precision in ("bf16-mixed", "16-mixed"):
            device = self.engine.device.type if self.engine is not None else "cpu"
            with torch.autocast(device, dtype=torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16):
                yield
        else:
            yield

    def gradients_changed(self) -> None:
        """A backward added gradients: they need the reduction before anything reads them."""
        self._reduced = False

    def _reduce_once(self) -> None:
        if not self._reduced:
            self._engine().reduce_gradients()
            self._overflow = self._engine().unscale_and_check()  # fp16 only; False otherwise
            self._reduced = True

    @override
    def _wrap_closure(self, model: pl.LightningModule, optimizer: Any, closure: Callable[[], Any]) -> Any:
        result = closure()
        self._reduce_once()
        self._after_closure(model, optimizer)  # on_before_optimizer_step hooks, then clipping
        self._engine().before_step()
        return result

    @override
    def optimizer_step(  # type: ignore[override]  # Lightning's own precision plugins widen it the same way
        self, optimizer: Any, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        engine = self._engine()
        try:
            if engine.scaler is None:
                out = optimizer.step(closure=partial(self._wrap_closure, model, optimizer, closure), **kwargs)
                engine.after_step()
                return out
            # fp16: the closure runs first (as Lightning's MixedPrecision does) so that an overflow skips the step
            result = self._wrap_closure(model, optimizer, closure)
            if not self._overflow:
                optimizer.step(**kwargs)
                engine.after_step()
            engine.update_scale(self._overflow)
            return result
        finally:
            self._reduced = False

    @override
    def clip_gradients(
        self, optimizer: Any, clip_val: int | float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        """Lightning's clipping, on the reduced gradients; see [Note: clipping before the step]."""
        if clip_val > 0:
            self._reduce_once()
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if not self._overflow:  # the step is skipped anyway; inf gradients would make the norm NaN
            self._engine().clip_grad_norm_(float(clip_val))


class PipelineStrategy(LaunchedParallelStrategy):
    """Pipeline parallelism (x data parallelism when ``devices`` exceeds ``num_stages``) for a LightningModule that
    holds a ``zlightning.pipe.PipelineModule``.

    ``Trainer(strategy="zstack_pipeline", devices=N)`` (N stages, 4 micro-batches, 1F1B) or
    ``Trainer(strategy=PipelineStrategy(num_stages=2, micro_batches=8, schedule="interleaved_1f1b"), devices=4)``.

    Args:
        num_stages: pipeline ranks; default: the module's ``num_stages``, else all devices.
        micro_batches: micro-batches per training batch (the loader's batch size must be a multiple).
        schedule: ``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, or the zero-bubble ``"zb_h1"`` / ``"zbv"`` (each
            backward split into input and weight gradients where that fills idle time; see [Note: zero-bubble schedules]
            in ``zlightning.pipe``).
        partition: overrides the module's ``partition_method`` (``"parameters"``, ``"uniform"``, ``"type:REGEX"``).
        config: full engine config instead of ``micro_batches``/``schedule`` (virtual stages, ZeRO stage 1-3 with any
            schedule, loss scaler).
            ``Trainer(precision="16-mixed")`` adds the default ``LossScalerConfig()`` when ``config`` has none.
        tensor_parallel_size: TP ranks per stage (PP x DP x TP grid; see [Note: PP x TP in Lightning]); also settable
            as ``config.tensor_parallel_size``.
        accelerator: set by the Trainer.
        parallel_devices: set by the Trainer.
        cluster_environment: set by the Trainer.
        checkpoint_io: set by the Trainer.
        precision_plugin: set by the Trainer.
        process_group_backend: as Lightning's DDP strategy.
        timeout: as Lightning's DDP strategy.
        start_method: as Lightning's DDP strategy.
    """

    strategy_name = "zstack_pipeline"

    def __init__(
        self,
        num_stages: int | None = None,
        micro_batches: int = 4,
        schedule: Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv"] = "1f1b",
        partition: str | None = None,
        config: PipelineConfig | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        tensor_parallel_size: int = 1,
    ) -> None:
        super().__init__(
            accelerator,
            parallel_devices,
            cluster_environment,
            checkpoint_io,
            precision_plugin,
            process_group_backend,
            timeout,
            start_method,
        )
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ValueError(f"PipelineStrategy(num_stages=...) must be None or an int >= 1, got {num_stages!r}")
        if config is not None and not isinstance(config, PipelineConfig):
            raise TypeError(
                f"PipelineStrategy(config=...) expects a zlightning.pipe.PipelineConfig, got {type(config).__name__}: "
                "write config=PipelineConfig(micro_batches=8, zero_stage=3, ...)"
            )
        if config is not None and (micro_batches != 4 or schedule != "1f1b"):
            raise ValueError(
                "PipelineStrategy: give either config=PipelineConfig(...) or micro_batches=/schedule=, not both"
            )
        self.config = config if config is not None else PipelineConfig(micro_batches=micro_batches, schedule=schedule)
        if tensor_parallel_size != 1:
            if self.config.tensor_parallel_size not in (1, tensor_parallel_size):
                raise ValueError(
                    f"PipelineStrategy: tensor_parallel_size={tensor_parallel_size!r} disagrees with "
                    f"config.tensor_parallel_size={self.config.tensor_parallel_size}; give it once"
                )
            self.config = dataclasses.replace(self.config, tensor_parallel_size=tensor_parallel_size)
        if partition is not None:
            _check_partition(partition)
        self.partition = partition
        self.num_stages = num_stages
        self.engine: PipelineEngine | None = None

    # ---------------------------------------------------------------- ranks and grid
    def grid(self) -> PipeGrid:
        """The PP x DP x TP grid of this run (pipeline ranks from ``num_stages``, the module, or all ranks / TP)."""
        world = self.num_nodes * self.num_processes
        tp = self.config.tensor_parallel_size
        module = self._pipe_module() if self.lightning_module is not None else None
        pp = self.num_stages or (module.num_stages if module is not None else None) or max(1, world // tp)
        return PipeGrid.from_world(world, self.global_rank, pp, tp)

    @property
    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        """The data-parallel group of this rank's (stage, TP index): the ranks that read other batches (None in a
        one-process run). Pass it as ``process_group=`` to torchmetrics metrics created outside the
        LightningModule's ``__init__``."""
        if self.engine is None:
            raise RuntimeError("zstack_pipeline: data_parallel_group is read before setup built the engine")
        return self.engine.groups.data

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        grid = self.grid()  # every stage of a replica reads the same samples
        return {"num_replicas": grid.dp, "rank": grid.dp_rank}

    # ---------------------------------------------------------------- precision (the property: LaunchedParallelStrategy)
    precision_type = PipelinePrecision

    # ---------------------------------------------------------------- setup
    @override
    def connect(self, model: pl.LightningModule) -> None:
        super().connect(model)
        for pipe in _pipe_modules(model):
            pipe.claim()  # before anything collects parameters: only this rank's stages get built

    def _pipe_module(self) -> PipelineModule:
        found = _pipe_modules(self.lightning_module) if self.lightning_module is not None else []
        if len(found) != 1:
            raise ValueError(
                f"zstack_pipeline needs the LightningModule to hold exactly one zlightning.pipe.PipelineModule, found "
                f"{len(found)}: set e.g. self.pipe = PipelineModule(layers=[...], loss_fn=...) in __init__ and return "
                "self.pipe.batch_loss(batch) from training_step"
            )
        return found[0]

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._build_engine()  # see [Note: the stage exists from the setup hook on]

    def _build_engine(self) -> PipelineEngine:
        """This rank's stage(s) and the engine, once (the process group must exist)."""
        if self.engine is None:
            pipe = self._pipe_module()
            if self.partition is not None and not pipe.is_built:
                pipe.partition_method = self.partition
            config = self.config
            if getattr(self.precision_plugin, "precision", None) == "16-mixed" and config.loss_scaler is None:
                config = dataclasses.replace(config, loss_scaler=LossScalerConfig())
            self.engine = PipelineEngine(pipe, None, config, num_stages=self.grid().pp, device=self.root_device)
        return self.engine

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.accelerator is None or self.model is None:
            raise AssertionError("setup() before connect()")
        self.accelerator.setup(trainer)
        pipe = self._pipe_module()
        self._build_engine()
        if self.engine is None:
            raise AssertionError("unreachable: _build_engine sets the engine")
        inside = {id(p) for p in pipe.parameters()}
        outside = [n for n, p in self.lightning_module.named_parameters() if id(p) not in inside]
        if outside:
            raise ValueError(
                f"zstack_pipeline: parameters outside the PipelineModule are not supported (found {outside[:3]}); "
                "make them layers of the PipelineModule"
            )
        if self.engine.groups.data is not None:  # see [Note: PP x TP in Lightning]; also metrics made in setup()
            metrics_to_group(self.lightning_module, self.engine.groups.data)
        pipe.set_driver(self.engine)  # (again, after a teardown: fit then predict with one Trainer)
        self.engine.loss_scale_factor = 1.0 / max(1, trainer.accumulate_grad_batches)
        self.engine.stash_gradients = True  # see [Note: gradients across Lightning's zero_grad] in zlightning.pipe
        self.model_to_device()
        plugin = self.precision_plugin
        if not isinstance(plugin, PipelinePrecision):
            raise AssertionError(f"unexpected precision plugin {type(plugin).__name__}")
        plugin.engine = self.engine
        if trainer.state.fn == TrainerFn.FITTING:
            pipe.check_stage_has_parameters(self.engine.grid.stage)
            self._setup_optimizers(trainer, self.engine)
            _optimizers_to_device(self.optimizers, self.root_device)
        self.setup_precision_plugin()

    def _setup_optimizers(self, trainer: pl.Trainer, engine: PipelineEngine) -> None:
        """``configure_optimizers`` over the stage's full-shape parameters, also under ZeRO-2/3 (then re-pointed to
        the shards), so ``p.ndim``-based weight-decay groups work as in one process."""
        try:
            if engine.zero is None:
                self.setup_optimizers(trainer)
                return
            with engine.zero.full_shape_stand_ins() as stand_ins:
                self.setup_optimizers(trainer)
        except ValueError as err:  # a stage that trains nothing given only trainable parameters: say so
            engine.module.explain_empty_optimizer(engine.grid.stage, err)
            raise
        for optimizer in self.optimizers:
            engine.zero.attach_optimizer(optimizer, stand_ins)

    @override
    def model_to_device(self) -> None:
        if self.model is None:
            raise AssertionError("model_to_device() before connect()")
        self.model.to(self.root_device)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule already ran the backward inside ``batch_loss``; only the hooks run here."""
        module = self.lightning_module
        if closure_loss.requires_grad:
            raise RuntimeError(
                "zstack_pipeline: training_step returned a loss with a graph; return self.pipe.batch_loss(batch), "
                "which runs forward and backward through the pipeline schedule"
            )
        self.precision_plugin.pre_backward(closure_loss, module)
        if self.engine is not None:
            self.engine.restore_gradients()
        if isinstance(self.precision_plugin, PipelinePrecision):
            self.precision_plugin.gradients_changed()
        self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    @override
    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.module.set_driver(None)
        plugin = self._precision_plugin
        if isinstance(plugin, PipelinePrecision):
            plugin.engine = None
        super().teardown()

    # ---------------------------------------------------------------- collectives
    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``self.log(sync_dist=True)``: over ``data_parallel_group`` (see [Note: PP x TP in Lightning])."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        if group is None and self.engine is not None and self.engine.groups.data is not None:
            group = self.engine.groups.data
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # ---------------------------------------------------------------- checkpoints: see [Note: checkpoints here]
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {} if self.engine is not None else super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {} if self.engine is not None else super().optimizer_state(optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.engine is None:
            raise RuntimeError("zstack_pipeline: save_checkpoint before setup (no pipeline engine)")
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_pipeline_checkpoint(self.engine, filepath, self._optimizer(), client_state=client)

    def _optimizer(self) -> torch.optim.Optimizer | None:
        if len(self.optimizers) > 1:
            raise ValueError(
                f"zstack_pipeline supports one optimizer, configure_optimizers returned {len(self.optimizers)}"
            )
        return self.optimizers[0] if self.optimizers else None

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not os.path.exists(checkpoint_path):
            raise FileNotFoundError(f"zstack_pipeline: checkpoint {checkpoint_path} does not exist")
        if self.engine is None or not is_pipeline_checkpoint(checkpoint_path):
            raise ValueError(
                f"zstack_pipeline resumes only from its own checkpoint directories; {checkpoint_path} is not one"
            )
        weights_only = requested_weights_only(weights_only)  # see [Note: Lightning's weights_only after setup]
        client = load_pipeline_checkpoint(self.engine, checkpoint_path, self._optimizer(), weights_only=weights_only)
        client["state_dict"] = {}
        return client

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        return None  # loaded in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        return None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Pipeline parallelism (x data parallelism, ZeRO-1/2/3)"
        )
