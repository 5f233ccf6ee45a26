"""Lightning callbacks over `zlightning.compression`: a thin adapter from Trainer hooks to the core functions.

[Note: when the model is compressed]
Modules are compressed before the strategy's ``setup`` (which builds the optimizers and, under ``zstack_zero3``,
shards the parameters), so learnable scores reach the optimizer and ZeRO-3 shards them like any parameter; the
quantizers and masks then work on the weights gathered for each forward. Lightning runs callback ``setup`` before
``configure_model``, and a model built there (as ``zstack_zero3`` asks for large models) does not exist yet in
``setup``. So when the LightningModule overrides ``configure_model``, ``setup("fit")`` arranges for the compression to
run right after that hook returns (still inside the strategy's init contexts: under ``zstack_zero3`` masks and scores
are recorded with the rest of the build, see `zlightning.zero.deferred_init`), and before Lightning restores a
checkpoint given as ``ckpt_path``, so the masks and scores it holds find their modules. Otherwise the model exists
and is compressed in ``setup``. A module compressed once is not compressed again by a later ``fit``.

[Note: schedule and logging]
Before every training batch (and before validation) the callback calls `apply_schedule` with
``trainer.global_step``, the number of optimizer steps, so a technique starts at its ``schedule_offset`` optimizer
step whatever the gradient accumulation. After each batch it logs `compression_stats` for its techniques
(``compression/<technique>/{active,bits,masked_fraction}``) to the Trainer's loggers.

[Note: validate, test and predict]
``trainer.validate/test/predict`` outside fit evaluate the compressed model the training left. The callback's
``setup`` compresses for every stage (a fresh module given with ``ckpt_path`` must hold the masks and scores the
checkpoint holds, or strict loading fails on their keys; a module already holding this callback's techniques, e.g.
fitted by another Trainer, is kept as it is), and the schedule is applied before the loop at the optimizer step the
weights come from: the checkpoint's ``global_step`` when one is restored (a fresh Trainer counts from 0), else the
Trainer's, or the step the techniques were last told if that is later (a module fitted by another Trainer). Without
this, a restored module evaluated with every technique off: the uncompressed model's metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from typing_extensions import override

from zlightning.compression import (
    ActivationQuantGroup,
    ActivationQuantizationConfig,
    ChannelPruningConfig,
    CompressionConfig,
    ExportReport,
    HeadPruningConfig,
    LayerReductionConfig,
    PruneGroup,
    RowPruningConfig,
    SparsePruningConfig,
    WeightQuantGroup,
    WeightQuantizationConfig,
    apply_schedule,
    compression_stats,
    distillation_loss,
    init_compression,
    reduce_layers,
    redundancy_clean,
    save_compressed,
)
from zlightning.compression._deepspeed import parse_compression_training
from zlightning.compression._techniques import ActivationQuantizer, ScheduledTechnique

__all__ = [
    "ActivationQuantization",
    "ChannelPruning",
    "CompressionCallback",
    "HeadPruning",
    "LayerReduction",
    "RowPruning",
    "SparsePruning",
    "WeightQuantization",
]

Patterns = str | Sequence[str] | None


def _patterns(modules: Patterns) -> tuple[str, ...] | None:
    if modules is None:
        return None
    return (modules,) if isinstance(modules, str) else tuple(modules)


def _related(related: Sequence[Sequence[str]] | None) -> tuple[tuple[str, ...], ...] | None:
    return None if related is None else tuple(tuple(r) for r in related)


def _refuse_pipeline(trainer: pl.Trainer, callback: Callback) -> None:
    """Compression is applied to the model a LightningModule holds; under ``zstack_pipeline`` each rank builds only
    its stage inside the strategy (after this hook), so there is nothing to select yet, and the export would hold one
    stage. Refused with the way that works rather than a "matches no module" error on some ranks."""
    from zlightning.strategies.pipeline import PipelineStrategy

    if isinstance(trainer.strategy, PipelineStrategy):
        raise ValueError(
            f"{type(callback).__name__}: compression callbacks do not support strategy='zstack_pipeline' (each rank "
            "builds only its stage, after the callbacks run). Compress without pipeline parallelism (zstack_zero3, "
            "ddp or one device)"
        )


def _holds_techniques(pl_module: pl.LightningModule, config: CompressionConfig) -> bool:
    """Whether the module already carries one of ``config``'s techniques (compressed by an earlier Trainer)."""
    wanted = set(config.techniques())
    return any(isinstance(m, ScheduledTechnique) and m.technique in wanted for m in pl_module.modules())


def _after_model_is_built(pl_module: pl.LightningModule, compress: Callable[[], None]) -> None:
    """Runs ``compress`` now, or right after ``pl_module.configure_model`` if it overrides that hook (see [Note: when
    the model is compressed]). The hook is wrapped on the instance for one call only, then restored."""
    if not is_overridden("configure_model", pl_module):
        compress()
        return
    inner = pl_module.__dict__.get("configure_model")  # an earlier callback's wrapper, or None (the class method)

    def configure_model_then_compress() -> None:
        if inner is None:
            del pl_module.__dict__["configure_model"]
            pl_module.configure_model()
        else:
            pl_module.__dict__["configure_model"] = inner
            inner()
        compress()

    pl_module.__dict__["configure_model"] = configure_model_then_compress


class CompressionCallback(Callback):
    """Compression-aware training from a `CompressionConfig` or DeepSpeed's ``compression_training`` dict/JSON.

    See [Note: when the model is compressed] and [Note: schedule and logging].

    Args:
        config: A `CompressionConfig`, a ``compression_training`` dict (or a whole DeepSpeed config holding one), or
            a JSON path. Parsed here, so bad configs fail when the callback is built.
        teacher_model: Teacher for ``layer_reduction``.
        clean_at_end: Run `redundancy_clean` at the end of fit (bake masks, remove pruned units).
        export_path: If set, clean and save the compressed model there at the end of fit (`save_compressed`);
            ``export_report`` then holds the sizes.

    Raises:
        ValueError: For an invalid config (all unknown DeepSpeed keys listed at once).
    """

    def __init__(
        self,
        config: CompressionConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        teacher_model: nn.Module | None = None,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = parse_compression_training(config)
        self.teacher_model = teacher_model
        self.clean_at_end = clean_at_end
        self.export_path = None if export_path is None else Path(export_path)
        self.export_report: ExportReport | None = None
        self._applied_to: int | None = None
        self._checkpoint_step: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._applied_to == id(pl_module):
            return
        _refuse_pipeline(trainer, self)

        def compress() -> None:
            # see [Note: validate, test and predict]
            if stage == "fit" or not _holds_techniques(pl_module, self.config):
                init_compression(pl_module, self.config, self.teacher_model)
            for module in pl_module.modules():  # see [Note: static ranges under data parallelism]
                if isinstance(module, ActivationQuantizer):
                    module.sync_ranges = trainer.world_size > 1
            self._applied_to = id(pl_module)

        _after_model_is_built(pl_module, compress)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        apply_schedule(pl_module, trainer.global_step)

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        step = checkpoint.get("global_step")
        self._checkpoint_step = step if isinstance(step, int) else None

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == "fit":
            apply_schedule(pl_module, trainer.global_step)
        else:
            apply_schedule(pl_module, self._evaluation_step(trainer, pl_module))

    @override
    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        apply_schedule(pl_module, self._evaluation_step(trainer, pl_module))

    @override
    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        apply_schedule(pl_module, self._evaluation_step(trainer, pl_module))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._checkpoint_step = None

    def _evaluation_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
        """The optimizer step whose schedule validate/test/predict use; see [Note: validate, test and predict]."""
        if self._checkpoint_step is not None:
            return self._checkpoint_step
        told = [m.step for m in pl_module.modules() if isinstance(m, ScheduledTechnique)]
        return max([trainer.global_step, *told])

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        mine = tuple(f"compression/{t}/" for t in self.config.techniques())
        stats = {k: v for k, v in compression_stats(pl_module).items() if k.startswith(mine)}
        if stats:
            pl_module.log_dict(stats, on_step=True, on_epoch=False)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning tears the strategy down before ``on_fit_end``: DDP has unwrapped the module. ``zstack_zero3``
        # keeps it sharded, but cleaning (which exporting does too) changes the modules' shapes and values, so the
        # full parameters are restored on every rank first: the result is a cleaned plain model, as under DDP.
        if not (self.clean_at_end or self.export_path):
            return
        from zlightning.zero import engine_of, unshard_module

        engine = engine_of(pl_module)
        if engine is not None:
            unshard_module(engine)
        if self.export_path is not None and trainer.is_global_zero:
            self._export(pl_module)
        else:
            redundancy_clean(pl_module)

    def _export(self, pl_module: pl.LightningModule) -> None:
        if self.export_path is None:
            raise AssertionError("_export without an export_path")
        self.export_report = save_compressed(pl_module, self.export_path)
        rank_zero_info(
            f"compressed model saved to {self.export_path}: {self.export_report.file_bytes} bytes, "
            f"{self.export_report.ratio:.2f}x smaller than the uncompressed model"
        )


class WeightQuantization(CompressionCallback):
    """Quantization-aware training of weights (int8/int4/...: symmetric or asymmetric; 2 bits ternary, 1 binary).

    Args:
        modules: Regexes over module names (``re.search``); None: every Linear, Conv2d and Embedding.
        target_bits: Final bits.
        start_bits: Bits at ``schedule_offset`` (None: ``target_bits``); one bit is dropped after
            ``quantization_period`` steps, then after each doubled period, down to ``target_bits``.
        quantization_period: See ``start_bits``.
        quantization_type: ``"symmetric"`` or ``"asymmetric"``.
        quantize_groups: Bands of rows with their own scale per Linear/Conv2d weight (Embeddings: per token).
        rounding: ``"nearest"`` or ``"stochastic"`` (training only).
        schedule_offset: First optimizer step at which weights are quantized.
        clean_at_end: See `CompressionCallback`.
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        target_bits: int = 8,
        start_bits: int | None = None,
        quantization_period: int = 1,
        quantization_type: Literal["symmetric", "asymmetric"] = "symmetric",
        quantize_groups: int = 1,
        rounding: Literal["nearest", "stochastic"] = "nearest",
        schedule_offset: int = 0,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        group = WeightQuantGroup(
            modules=_patterns(modules),
            target_bits=target_bits,
            start_bits=target_bits if start_bits is None else start_bits,
            quantization_period=quantization_period,
        )
        cfg = WeightQuantizationConfig(
            groups=(group,),
            schedule_offset=schedule_offset,
            rounding=rounding,
            quantization_type=quantization_type,
            quantize_groups=quantize_groups,
        )
        super().__init__(CompressionConfig(weight_quantization=cfg), clean_at_end=clean_at_end, export_path=export_path)


class ActivationQuantization(CompressionCallback):
    """Fake quantization of layer inputs (4 or 8 bits), dynamic per-token ranges or a static moving average.

    Args:
        modules: Regexes over module names; None: every Linear and Conv2d.
        bits: 4 or 8.
        quantization_type: ``"symmetric"`` or ``"asymmetric"``.
        range_calibration: ``"dynamic"`` (a range per token / per image, every call) or ``"static"`` (one range, a
            moving average updated in training and frozen in eval).
        schedule_offset: First optimizer step at which inputs are quantized.
        clean_at_end: See `CompressionCallback` (activation quantization stays in the module: it is not baked
            into a cleaned or exported model).
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        bits: int = 8,
        quantization_type: Literal["symmetric", "asymmetric"] = "symmetric",
        range_calibration: Literal["dynamic", "static"] = "dynamic",
        schedule_offset: int = 1000,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        cfg = ActivationQuantizationConfig(
            groups=(ActivationQuantGroup(modules=_patterns(modules), bits=bits),),
            quantization_type=quantization_type,
            range_calibration=range_calibration,
            schedule_offset=schedule_offset,
        )
        super().__init__(
            CompressionConfig(activation_quantization=cfg), clean_at_end=clean_at_end, export_path=export_path
        )


class SparsePruning(CompressionCallback):
    """Unstructured pruning keeping ``ceil(dense_ratio * N)`` weights per layer.

    Args:
        modules: Regexes over module names; None: every Linear and Conv2d.
        dense_ratio: Fraction of the weights kept.
        method: ``"l1"`` (largest magnitudes when the technique starts, then fixed) or ``"topk"`` (learnable scores).
        schedule_offset: First optimizer step at which the mask applies.
        schedule_offset_end: With ``topk``, the step after which the mask is frozen (None: never).
        clean_at_end: See `CompressionCallback`.
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        dense_ratio: float = 0.5,
        method: Literal["l1", "topk"] = "l1",
        schedule_offset: int = 1000,
        schedule_offset_end: int | None = None,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        cfg = SparsePruningConfig(
            groups=(PruneGroup(name="sp1", modules=_patterns(modules), dense_ratio=dense_ratio),),
            method=method,
            schedule_offset=schedule_offset,
            schedule_offset_end=schedule_offset_end,
        )
        super().__init__(CompressionConfig(sparse_pruning=cfg), clean_at_end=clean_at_end, export_path=export_path)


class RowPruning(CompressionCallback):
    """Pruning of Linear output rows (neurons).

    Args:
        modules: Regexes over module names; None: every Linear.
        dense_ratio: Fraction of the rows kept.
        related_modules: One list of regexes per entry of ``modules``: the next layers whose input columns are
            removed with the rows when the model is cleaned (None: the rows are zeroed, not removed).
        method: ``"l1"`` (row L1 norm) or ``"topk"`` (a learnable score per row).
        schedule_offset: First optimizer step at which the mask applies.
        clean_at_end: See `CompressionCallback`.
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        dense_ratio: float = 0.5,
        related_modules: Sequence[Sequence[str]] | None = None,
        method: Literal["l1", "topk"] = "l1",
        schedule_offset: int = 1000,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        group = PruneGroup(
            name="rp1", modules=_patterns(modules), dense_ratio=dense_ratio, related_modules=_related(related_modules)
        )
        cfg = RowPruningConfig(groups=(group,), method=method, schedule_offset=schedule_offset)
        super().__init__(CompressionConfig(row_pruning=cfg), clean_at_end=clean_at_end, export_path=export_path)


class HeadPruning(CompressionCallback):
    """Pruning of attention heads, selected on the attention output projection (its input columns per head).

    Args:
        modules: Regexes matching the output projections, e.g. ``r"attn\\.proj$"``.
        dense_ratio: Fraction of the heads kept.
        related_modules: One list of regexes per entry of ``modules``: the Q/K/V (or fused QKV) projections whose
            output rows are removed with the heads when the model is cleaned; the parent's head-count attribute
            (``n_head``, ``num_heads``, ``num_attention_heads``, ``n_heads``) is updated too.
        method: ``"topk"`` (a learnable score per head) or ``"l1"``.
        num_heads: Heads per layer; None: read from the projection's parent module.
        schedule_offset: First optimizer step at which the mask applies.
        clean_at_end: See `CompressionCallback`.
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        dense_ratio: float = 0.5,
        related_modules: Sequence[Sequence[str]] | None = None,
        method: Literal["l1", "topk"] = "topk",
        num_heads: int | None = None,
        schedule_offset: int = 1000,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        group = PruneGroup(
            name="hp1", modules=_patterns(modules), dense_ratio=dense_ratio, related_modules=_related(related_modules)
        )
        cfg = HeadPruningConfig(groups=(group,), method=method, num_heads=num_heads, schedule_offset=schedule_offset)
        super().__init__(CompressionConfig(head_pruning=cfg), clean_at_end=clean_at_end, export_path=export_path)


class ChannelPruning(CompressionCallback):
    """Pruning of Conv2d output channels.

    Args:
        modules: Regexes over module names; None: every Conv2d.
        dense_ratio: Fraction of the channels kept.
        related_modules: One list of regexes per entry of ``modules``: the next conv (input channels) and
            BatchNorm2d removed with the channels when the model is cleaned.
        method: ``"l1"`` (per-channel L1 norm) or ``"topk"``.
        schedule_offset: First optimizer step at which the mask applies.
        clean_at_end: See `CompressionCallback`.
        export_path: See `CompressionCallback`.
    """

    def __init__(
        self,
        modules: Patterns = None,
        *,
        dense_ratio: float = 0.5,
        related_modules: Sequence[Sequence[str]] | None = None,
        method: Literal["l1", "topk"] = "l1",
        schedule_offset: int = 1000,
        clean_at_end: bool = False,
        export_path: str | os.PathLike[str] | None = None,
    ) -> None:
        group = PruneGroup(
            name="cp1", modules=_patterns(modules), dense_ratio=dense_ratio, related_modules=_related(related_modules)
        )
        cfg = ChannelPruningConfig(groups=(group,), method=method, schedule_offset=schedule_offset)
        super().__init__(CompressionConfig(channel_pruning=cfg), clean_at_end=clean_at_end, export_path=export_path)


class LayerReduction(Callback):
    """Initialises the (shallower) student LightningModule from teacher layers at ``setup("fit")``, and optionally
    provides a distillation loss against the teacher.

    Distillation is user code in the student's ``training_step`` (the callback cannot change the returned loss)::

        kd = self.trainer.callbacks[i]  # or keep a reference to the callback
        loss = ce + kd.distillation_loss(logits, idx)  # runs the frozen teacher on idx

    Args:
        teacher_model: The teacher (any ``nn.Module`` with the same naming as the student). It is frozen and put in
            eval mode, and moved to the student's device at the start of fit.
        module_name_prefix: Name of the layer list, e.g. ``"model.blocks"``.
        teacher_layer: Teacher layer copied into each student layer.
        other_module_name: Other modules copied whole (embeddings, final norm, head).
        distillation_weight: Factor of `distillation_loss` (0 disables it: the method then returns 0).
        temperature: Softmax temperature of the distillation loss (see `zlightning.compression.distillation_loss`).
        teacher_output: Turns the teacher's output into logits (default: the output itself, or its first element
            if it is a tuple/list, e.g. ``(logits, loss)``).
    """

    def __init__(
        self,
        teacher_model: nn.Module,
        *,
        module_name_prefix: str,
        teacher_layer: Sequence[int],
        other_module_name: Sequence[str] = (),
        distillation_weight: float = 0.0,
        temperature: float = 1.0,
        teacher_output: Callable[[Any], Tensor] | None = None,
    ) -> None:
        if not isinstance(teacher_model, nn.Module):
            raise ValueError(f"LayerReduction: teacher_model must be an nn.Module, got {type(teacher_model).__name__}.")
        if not distillation_weight >= 0 or not temperature > 0:
            raise ValueError(
                f"LayerReduction: distillation_weight must be >= 0 and temperature > 0, got "
                f"{distillation_weight!r} and {temperature!r}."
            )
        self.teacher_model = teacher_model
        self.config = LayerReductionConfig(
            module_name_prefix=module_name_prefix,
            teacher_layer=tuple(teacher_layer),
            other_module_name=tuple(other_module_name),
        )
        self.distillation_weight = float(distillation_weight)
        self.temperature = float(temperature)
        self.teacher_output = teacher_output
        self._applied_to: int | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self._applied_to != id(pl_module):
            _refuse_pipeline(trainer, self)

            def reduce() -> None:
                reduce_layers(pl_module, self.teacher_model, self.config)
                self._applied_to = id(pl_module)

            _after_model_is_built(pl_module, reduce)
        self.teacher_model.eval().requires_grad_(False)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.teacher_model.to(pl_module.device)

    def distillation_loss(self, student_logits: Tensor, *teacher_args: Any, **teacher_kwargs: Any) -> Tensor:
        """``distillation_weight * distillation_loss(student_logits, teacher(*teacher_args, **teacher_kwargs))``."""
        if self.distillation_weight == 0.0:
            return student_logits.new_zeros(())
        with torch.no_grad():
            out = self.teacher_model(*teacher_args, **teacher_kwargs)
        if self.teacher_output is not None:
            out = self.teacher_output(out)
        elif isinstance(out, (tuple, list)):
            out = out[0]
        return self.distillation_weight * distillation_loss(student_logits, out, self.temperature)
