"""``PipelineEngine``: runs a ``PipelineModule`` over a DP x PP grid with a schedule (``train_batch``/``eval_batch``).

[Note: gradients across Lightning's zero_grad]
Lightning's closure runs ``training_step``, then ``optimizer.zero_grad()`` (first batch of an accumulation window),
then ``backward``. A pipeline's backward happens inside ``training_step`` (the schedule interleaves it with
forwards), so that ``zero_grad`` would erase it. With ``stash_gradients`` the engine moves the fresh gradients aside
at the end of the schedule and the strategy's ``backward`` adds them back (``restore_gradients``).

[Note: one batch]
``train_batch`` pulls ``micro_batches`` items ``(inputs, labels)`` from the iterator (or splits one batch along dim 0),
runs this rank's lowered schedule (``BatchRun``) on its ``PipelineStage``, then: all-reduces tied gradients across
the owning stages, averages gradients over the data-parallel group, clips by the global norm of the whole model, steps
the optimizer (ZeRO-1: only owned parameters, then broadcast), and zeroes gradients. Every micro-batch loss is scaled by
``1 / (micro_batches * accumulation)`` before backward, so gradients are those of the mean loss of the global batch,
equal to a one-process run on the concatenated batch. The returned loss is the mean over micro-batches and
data-parallel replicas, identical on every rank.

[Note: fp16 loss scaling]
With ``PipelineConfig(loss_scaler=LossScalerConfig(...))`` every micro-batch loss is also multiplied by the current
scale before its backward (the scale is fixed for a whole batch and accumulation window), so activation gradients
cross stage boundaries scaled, as in one process. Before the step (after the tied and data-parallel reductions),
``unscale_and_check`` divides every local gradient by the scale and tests it for inf/NaN; one MAX all-reduce over
all ranks (every stage and every data-parallel replica) makes the verdict global, since an overflow on one stage
must skip the step on all of them or the stages' weights would drift apart. On overflow every rank drops its
gradients, skips the optimizer step (``skipped_steps`` += 1) and the shared ``DynamicLossScaler`` (hysteresis,
window, minimum: DeepSpeed's semantics, reused from ``zlightning.zero``) lowers the scale identically everywhere.
The scaler's state is part of the pipeline checkpoint (``meta.pt``, written once since every rank holds the same).

[Note: PP x TP]
``PipelineConfig(tensor_parallel_size=t)`` adds an innermost TP axis to the grid (see [Note: rank layout] in
``_topology.py``). After building its stage, each rank shards its layers over the stage's TP group with
``zlightning.inject.module_inject`` (``_tensor.py``, [Note: what a stage shards]); tied layers stay replicated.
Everything else keeps its meaning per TP index: rank ``(s, d, t)`` exchanges full activations with ``(s +- 1, d, t)``
(each TP rank sends and receives its own copy), the data-parallel all-reduce and ZeRO-1 run over the replicas of
``(s, t)``, tied gradients are summed over the owning stages of ``(d, t)``, and the loss is broadcast from the last
stage of ``(d, t)``. Gradient clipping computes ``[S, R]`` per rank (squares of TP-split slices, squares of
replicated parameters, tied duplicates skipped), sums it over the pipe group and then over the TP group, and takes
``sqrt(S + R / t)``: slices summed across TP, replicated parameters counted once, the same coefficient everywhere.
The fp16 overflow verdict is a MAX over all ranks, so one TP slice's overflow skips the step everywhere. The first
batch checks that TP peers received identical micro-batches. Checkpoints hold each rank's slices and resume on the
same split and TP size (``_checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from zlightning import _gradnorm
from zlightning.inject import InjectPolicy
from zlightning.pipe._calibrate import ZbvCalibration
from zlightning.pipe._executor import BatchRun
from zlightning.pipe._grads import Zero1Sharding, allreduce_mean, allreduce_sum
from zlightning.pipe._module import PipelineModule
from zlightning.pipe._p2p import P2P, flatten, unflatten
from zlightning.pipe._schedule import ActionCosts, Placement, Schedule, build_schedule, zbv_orders_by_costs
from zlightning.pipe._stage import PipelineStage
from zlightning.pipe._tensor import shard_stage
from zlightning.pipe._topology import PipeGrid, PipeGroups
from zlightning.pipe._zero import StageSharding
from zlightning.zero import DynamicLossScaler, LossScalerConfig

__all__ = ["PipelineConfig", "PipelineEngine", "split_microbatches"]

ScheduleName = Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv"]
_SCHEDULE_NAMES = ("1f1b", "gpipe", "interleaved_1f1b", "zb_h1", "zbv")


@dataclass(frozen=True)
class PipelineConfig:
    """Engine knobs. Validated on construction.

    Raises:
        ValueError: a size below its minimum, an unknown schedule, virtual stages without ``interleaved_1f1b``, or
            ZeRO stage 2/3 with tensor parallelism.
    """

    micro_batches: int = 4
    """Micro-batches per batch (DeepSpeed's ``gradient_accumulation_steps``)."""
    schedule: ScheduleName = "1f1b"
    """Order of work: ``1f1b`` (PipeDream-Flush), ``gpipe`` (all forwards, then all backwards), ``interleaved_1f1b``,
    or the zero-bubble schedules that split each backward into input and weight gradients: ``zb_h1`` (1F1B's peak
    memory, about a third of its bubble) and ``zbv`` (two chunks per rank in a V); see [Note: zero-bubble schedules]
    in ``_schedule.py``."""
    schedule_costs: ActionCosts | Literal["auto", "unit"] = "auto"
    """What ``zbv`` orders its actions by when ``micro_batches`` is below twice the pipeline ranks (``M < 2P``; from
    ``2P`` on ``zbv`` runs the phased order, which no cost changes, see [Note: the phased V order] in
    ``_schedule.py``; the other schedules' orders never depend on costs): ``"auto"`` measures the
    model's forward, input-backward and weight-backward times on the second training batch and reorders once (see
    [Note: calibrating zbv] in ``_calibrate.py``); ``"unit"`` assumes them equal; an ``ActionCosts`` gives them."""
    virtual_stages: int | None = None
    """Model chunks per rank; default 2 for ``interleaved_1f1b`` and ``zbv`` (which needs 2), else 1."""
    zero_stage: int = 0
    """0; 1 to shard optimizer state over the data-parallel group; 2 or 3 to shard each stage's gradients and
    optimizer state (3: and parameters between batches) over it with the ZeRO engine, gathering the stage once per
    batch and reduce-scattering its gradients once per batch (see [Note: ZeRO inside a pipeline stage] in
    ``_zero.py``)."""
    gradient_clipping: float = 0.0
    """Clip by global norm (0: off). Used by ``train_batch``; Lightning passes ``Trainer(gradient_clip_val)``."""
    loss_scaler: LossScalerConfig | None = None
    """Dynamic loss scaling for fp16 (DeepSpeed's ``fp16`` block; see [Note: fp16 loss scaling]); None: off.
    ``Trainer(precision="16-mixed")`` sets the default ``LossScalerConfig()`` when this is None."""
    tensor_parallel_size: int = 1
    """Tensor-parallel ranks per stage (PP x DP x TP grid, TP innermost): each stage's layers are sharded over its TP
    group with ``zlightning.inject.module_inject`` after the stage is built; see [Note: PP x TP]."""
    tp_policy: InjectPolicy | None = None
    """``module_inject`` knobs under ``tensor_parallel_size > 1`` (plan, kernel injection); None: ``InjectPolicy()``.
    Its ``tp_size`` is replaced by ``tensor_parallel_size``."""

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"PipelineConfig: micro_batches must be an int >= 1, got {self.micro_batches!r}")
        if self.schedule not in _SCHEDULE_NAMES:
            raise ValueError(
                f"PipelineConfig: schedule must be one of {', '.join(repr(n) for n in _SCHEDULE_NAMES)}, got {self.schedule!r}"
            )
        if not isinstance(self.schedule_costs, ActionCosts) and self.schedule_costs not in ("auto", "unit"):
            raise ValueError(
                "PipelineConfig: schedule_costs must be 'auto', 'unit' or a zlightning.pipe.ActionCosts, got "
                f"{self.schedule_costs!r}"
            )
        v = self.virtual_stages
        if v is not None and (not isinstance(v, int) or v < 1):
            raise ValueError(f"PipelineConfig: virtual_stages must be None or an int >= 1, got {v!r}")
        if self.schedule == "zbv" and v not in (None, 2):
            raise ValueError(
                f"PipelineConfig: schedule='zbv' runs two chunks per rank; virtual_stages={v} must be None or 2"
            )
        if v not in (None, 1) and self.schedule not in ("interleaved_1f1b", "zbv"):
            raise ValueError(
                f"PipelineConfig: virtual_stages={v} needs schedule='interleaved_1f1b' (got {self.schedule!r})"
            )
        if not isinstance(self.zero_stage, int) or isinstance(self.zero_stage, bool) or self.zero_stage not in range(4):
            raise ValueError(f"PipelineConfig: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        clip = self.gradient_clipping
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:  # NaN too
            raise ValueError(
                f"PipelineConfig: gradient_clipping must be a number >= 0 (0: off; a NaN would turn every gradient "
                f"into NaN), got {clip!r}"
            )
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"PipelineConfig: tensor_parallel_size must be an int >= 1, got {tp!r}")
        if tp > 1 and self.zero_stage >= 2:
            raise ValueError(
                f"PipelineConfig: zero_stage={self.zero_stage} with tensor_parallel_size={tp} is not supported (tensor "
                "parallelism replaces the layers the ZeRO engine would shard); use zero_stage=1 with TP"
            )
        if self.tp_policy is not None and not isinstance(self.tp_policy, InjectPolicy):
            raise ValueError(
                f"PipelineConfig: tp_policy must be None or a zlightning.inject.InjectPolicy, got {type(self.tp_policy).__name__}"
            )
        if self.loss_scaler is not None and not isinstance(self.loss_scaler, LossScalerConfig):
            raise ValueError(
                f"PipelineConfig: loss_scaler must be None or a zlightning.zero.LossScalerConfig, got {type(self.loss_scaler).__name__}"
            )

    @property
    def chunks_per_rank(self) -> int:
        if self.virtual_stages is not None:
            return self.virtual_stages
        return 2 if self.schedule in ("interleaved_1f1b", "zbv") else 1

    @property
    def placement(self) -> Placement:
        """Where stages live on the pipeline ranks (``"v"`` for ``zbv``, else ``"loop"``)."""
        return "v" if self.schedule == "zbv" else "loop"


def split_microbatches(obj: Any, n: int, what: str = "batch") -> list[Any]:
    """Splits every tensor of a structure into ``n`` equal chunks along dim 0.

    Raises:
        ValueError: a tensor's dim 0 is not divisible by ``n``, or tensors disagree on it.
    """
    tensors, skeleton = flatten(obj)
    if not tensors:
        return [obj] * n
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[0] % n:
            size = "a scalar" if t.dim() == 0 else f"dim 0 of size {t.shape[0]}"
            raise ValueError(
                f"cannot split {what} tensor #{i} (shape {list(t.shape)}, {size}) into micro_batches={n} equal parts; "
                f"make the batch size a multiple of {n} (if it is one, this is the loader's last, partial batch: "
                "pass drop_last=True to the DataLoader)"
            )
    pieces = [t.chunk(n) for t in tensors]
    return [unflatten([p[m] for p in pieces], skeleton) for m in range(n)]


def eval_micro_batches(obj: Any, n: int) -> int:
    """How many micro-batches an evaluation of ``obj`` runs in: the largest count up to ``n`` that divides the
    batch size.

    [Note: evaluation batches of any size]
    Training needs every batch to split into ``micro_batches`` equal parts (the schedule and the loss scaling are
    built for them), but validation, test and predict batches come in whatever size the data has: the last batch
    of a loader, a single sample to predict. Evaluation has no gradient to scale and its schedule is built per
    count, so it runs such a batch in fewer equal micro-batches, which keeps the mean of the micro-batch losses
    equal to the batch's mean loss. Every stage sees the same batch, so every stage picks the same count.
    """
    tensors = [t for t in flatten(obj)[0] if t.dim() > 0]
    if not tensors:
        return n
    size = tensors[0].shape[0]
    return next((d for d in range(min(n, size), 0, -1) if size % d == 0), n)


def _unpack(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(
        f"a pipeline batch must be a pair (inputs, labels), got {type(batch).__name__}"
        + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        + "; use (inputs, None) when the model computes its own loss"
    )


class PipelineEngine:
    """Trains and evaluates a ``PipelineModule`` over ``num_stages x dp x tensor_parallel_size`` ranks.

    Builds only this rank's stage(s) of ``module``, creates the pipe / data / tie process groups, makes tied copies
    and data-parallel replicas identical (broadcast), and checks the schedule with the simulator before any run.
    Direct ``forward``/``backward``/``step`` are not offered: use ``train_batch``/``eval_batch`` (as DeepSpeed).

    Args:
        module: the model; built here if it is not yet.
        optimizer: an optimizer over ``module.parameters()`` (after building) or a factory
            ``optimizer(params) -> Optimizer``; None for evaluation only.
        config: schedule, micro-batches, ZeRO-1, clipping.
        num_stages: pipeline ranks; default ``module.num_stages``, else the world size.
        device: where this rank's layers live; default ``cuda:LOCAL_RANK`` with CUDA, else CPU.

    Raises:
        ValueError: the world size is not a multiple of ``num_stages * tensor_parallel_size``, the layers cannot be
            split, the schedule needs more micro-batches, or an optimizer instance (not a factory) is given with TP.
        zlightning.inject.InjectError: a layer cannot be tensor-parallel (indivisible sizes, a bad plan).
    """

    def __init__(  # noqa: PLR0915 (one linear setup sequence)
        self,
        module: PipelineModule,
        optimizer: torch.optim.Optimizer | Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None,
        config: PipelineConfig = PipelineConfig(),
        *,
        num_stages: int | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineEngine needs a zlightning.pipe.PipelineModule, got {type(module).__name__}")
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"PipelineEngine(config=...) expects a PipelineConfig, got {type(config).__name__}")
        module.claim()  # this engine builds the rank's stages (see [Note: building without a pipeline])
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        tp = config.tensor_parallel_size
        pp = num_stages or module.num_stages or max(1, world // tp)
        _check_layer_count(module, pp, config)
        self.grid = PipeGrid.from_world(world, rank, pp, tp)
        is_factory = callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer)
        if tp > 1 and isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"PipelineEngine: tensor_parallel_size={tp} replaces the stage's parameters by their shards, so an "
                "optimizer built beforehand would update stale tensors; pass a factory, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=...)"
            )
        self.config = config
        self.device = torch.device(device) if device is not None else _default_device()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL point-to-point picks the current device
        v = config.chunks_per_rank
        costs = config.schedule_costs if isinstance(config.schedule_costs, ActionCosts) else None
        self.train_schedule: Schedule = build_schedule(config.schedule, pp, config.micro_batches, v, costs=costs)
        self._calibration = (
            ZbvCalibration()
            if config.schedule == "zbv"
            and config.schedule_costs == "auto"
            and zbv_orders_by_costs(pp, config.micro_batches)
            else None
        )
        """Reorders ``zbv`` by measured costs once, where its order depends on them; see [Note: calibrating zbv]."""
        self.eval_schedule: Schedule = build_schedule("inference", pp, config.micro_batches, v, config.placement)
        self.module = module
        stages = self.train_schedule.stages_of(self.grid.stage)
        module.build(stages, pp * v, self.device)
        self.groups = PipeGroups.build(self.grid, module.tie_owners(module.bounds or [], self.train_schedule.rank_of))
        self.tp_split: frozenset[int] = frozenset()
        """Ids of this rank's parameters that hold a different slice on every TP rank (empty without TP)."""
        if tp > 1:
            if self.groups.tensor is None:
                raise RuntimeError(f"tensor_parallel_size={tp} needs torch.distributed initialised")
            groups, device, tp_group = self.groups, self.device, self.groups.tensor
            self.tp_split = _all_or_none(
                lambda: shard_stage(module, tp, config.tp_policy, tp_group, groups.pipe, device), device
            )
        self._inputs_checked = tp == 1
        peers = self.grid.pipe_ranks(self.grid.dp_rank, self.grid.tp_rank)
        p2p = P2P(self.device, stages={r: s for s, r in enumerate(peers)})
        self.stage = PipelineStage(module, self.grid.stage, peers, p2p, self.device)
        """This rank's chunk(s), channel and ZeRO engines; see [Note: stage, engine and module] in ``_stage.py``."""
        self._sync_replicas()
        if config.zero_stage >= 2:
            self.stage.zero = StageSharding(
                module,
                3 if config.zero_stage == 3 else 2,
                self.groups.data,
                self.device,
                split_backward=config.schedule in ("zb_h1", "zbv"),
            )
        if is_factory:
            module.check_stage_has_parameters(self.grid.stage)
        self.optimizer: torch.optim.Optimizer | None = (
            self._build_optimizer(optimizer) if is_factory else optimizer  # type: ignore[arg-type,assignment]
        )
        if isinstance(self.optimizer, torch.optim.Optimizer):
            _check_optimizer_params(self.optimizer, module)
        params = [p for p in module.parameters() if p.requires_grad]
        self.zero1: Zero1Sharding | None = None
        if config.zero_stage == 1:
            g = self.grid
            self.zero1 = Zero1Sharding.plan(params, g.dp, g.dp_rank, g.dp_ranks(g.stage, g.tp_rank), self.groups.data)
        self.loss_scale_factor = 1.0
        """Extra loss multiplier (Lightning sets ``1 / accumulate_grad_batches``)."""
        self.scaler: DynamicLossScaler | None = (
            DynamicLossScaler(config.loss_scaler) if config.loss_scaler is not None else None
        )
        """fp16 dynamic loss scale; see [Note: fp16 loss scaling]."""
        self.skipped_steps = 0
        """Optimizer steps skipped because of an fp16 overflow."""
        self.stash_gradients = False
        """Move gradients aside after each ``forward_backward`` until ``restore_gradients``; see
        [Note: gradients across Lightning's zero_grad]."""
        self._stash: dict[nn.Parameter, torch.Tensor] = {}
        self.timings: list[tuple[str, float, float]] | None = None
        """Set to a list to record ``(action, start, end)`` of every compute action of the following runs."""
        self.data_iterator: Iterator[Any] | None = None
        """What ``train_batch()`` pulls from when called without ``data_iter`` (DeepSpeed's ``data_iterator``)."""
        self._eval_schedules: dict[int, Schedule] = {config.micro_batches: self.eval_schedule}
        module.set_driver(self)  # batch_loss/predict run the schedule; see [Note: who runs a claimed module]

    # ------------------------------------------------------------------------------------------ setup
    def _build_optimizer(
        self, factory: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
    ) -> torch.optim.Optimizer:
        """``factory(module.parameters())``; under ZeRO-2/3 over full-shape stand-ins, then re-pointed to the
        shards (see "Optimizers see full shapes" in [Note: ZeRO inside a pipeline stage])."""
        try:
            if self.zero is None:
                return factory(self.module.parameters())
            with self.zero.full_shape_stand_ins() as stand_ins:
                optimizer = factory(self.module.parameters())
        except ValueError as err:
            self.module.explain_empty_optimizer(self.grid.stage, err)
            raise
        self.zero.attach_optimizer(optimizer, stand_ins)
        return optimizer

    @property
    def p2p(self) -> P2P:
        """The stage's point-to-point channel."""
        return self.stage.p2p

    @property
    def schedule_costs(self) -> ActionCosts | None:
        """The costs the training schedule is ordered by: those given, those measured (``"auto"``, after the second
        training batch; see [Note: calibrating zbv]), or None (unit costs, or a schedule whose order ignores them)."""
        if self._calibration is not None:
            return self._calibration.costs
        given = self.config.schedule_costs
        return given if isinstance(given, ActionCosts) and self.config.schedule == "zbv" else None

    @property
    def zero(self) -> StageSharding | None:
        """ZeRO-2/3 engines of this rank's stage(s); see [Note: ZeRO inside a pipeline stage]. None below stage 2."""
        return self.stage.zero

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank holds the model's last stage (the loss): pipeline rank ``P - 1``, or rank 0 in the V
        of ``zbv``."""
        return self.grid.stage == self.last_rank

    @property
    def last_rank(self) -> int:
        """The pipeline rank holding the last stage."""
        return self.train_schedule.rank_of(self.train_schedule.num_stages - 1)

    def _tied_duplicates(self) -> set[int]:
        """Ids of tied parameters whose gradient norm is counted on another (lower) owning stage."""
        out: set[int] = set()
        for key, src in self.groups.tied_src.items():
            if src != self.grid.rank:
                out |= {id(p) for p in self.module.tied_parameters(key)}
        return out

    @torch.no_grad()
    def _sync_replicas(self) -> None:
        if not dist.is_initialized():
            return
        for key, group in self.groups.tied.items():
            if group is not None:
                for p in self.module.tied_parameters(key):
                    dist.broadcast(p.data, src=self.groups.tied_src[key], group=group)
        if self.grid.dp > 1:
            src = self.grid.global_rank(self.grid.stage, 0, self.grid.tp_rank)
            params = [] if self.zero is not None else list(self.module.parameters())  # shards differ by design
            for t in params + list(self.module.buffers()):
                dist.broadcast(t.data, src=src, group=self.groups.data)

    @torch.no_grad()
    def _check_tp_inputs(self, inputs: list[Any], labels: list[Any]) -> None:
        """First batch under TP: every TP peer must get the same micro-batches (a sampler over the DP group); all
        peers raise together otherwise."""
        mine = torch.zeros(3, dtype=torch.float64)  # fixed size: order-sensitive sums of every tensor
        for i, t in enumerate(flatten((inputs, labels))[0]):
            flat = t.detach().reshape(-1).double().cpu()
            weighted = (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()
            count = torch.tensor(flat.numel(), dtype=torch.float64)
            mine += torch.stack([(i + 1) * flat.sum(), (i + 1) * weighted, count])
        mine = mine.to(self.device)
        everyone = [torch.empty_like(mine) for _ in range(self.grid.tp)]
        dist.all_gather(everyone, mine, group=self.groups.tensor)
        self._inputs_checked = True
        if any(not torch.equal(e, everyone[0]) for e in everyone):
            raise ValueError(
                "PipelineEngine: the tensor-parallel peers of a stage received different batches; every TP rank must "
                "see the same data: shard by the data-parallel rank (num_replicas=engine.grid.dp, "
                "rank=engine.grid.dp_rank), not by the global rank"
            )

    # ------------------------------------------------------------------------------------------ schedule runs
    def _run(
        self, schedule: Schedule, inputs: list[Any], labels: list[Any], *, keep: bool, with_loss: bool
    ) -> BatchRun:
        if not self._inputs_checked:
            self._check_tp_inputs(inputs, labels)
        calibrate = schedule.training and self._calibration is not None and self._calibration.due()
        timings = [] if calibrate else self.timings
        run = BatchRun(
            self.stage,
            schedule,
            [_to(x, self.device) for x in inputs],
            [_to(y, self.device) for y in labels],
            loss_scale=self.loss_scale_factor * self.loss_scale / schedule.num_microbatches,
            keep_outputs=keep,
            with_loss=with_loss,
            timings=timings,
        )
        run.run()
        if calibrate and timings is not None and self._calibration is not None:
            if self.timings is not None:
                self.timings.extend(timings)
            costs = self._calibration.agree(timings, self.device)
            s = self.train_schedule
            self.train_schedule = build_schedule("zbv", s.num_ranks, s.num_microbatches, 2, costs=costs)
        if self.zero is not None and not schedule.training:
            self.zero.release()
        return run

    def _mean_loss(self, run: BatchRun, deferred: list[Any] | None = None) -> torch.Tensor:
        """Mean micro-batch loss of the last stage, broadcast over the pipe group and averaged over replicas. With
        ``deferred`` (a list) and no data parallelism the broadcast is left in flight and its work appended there
        (``train_batch`` overlaps it with the optimizer step and waits before returning)."""
        if self.is_last_stage:
            loss = torch.stack(run.losses).mean().float() if run.losses else torch.zeros((), device=self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if dist.is_initialized():
            src = self.grid.global_rank(self.last_rank, self.grid.dp_rank, self.grid.tp_rank)
            if deferred is not None and self.grid.dp == 1:
                deferred.append(dist.broadcast(loss, src=src, group=self.groups.pipe, async_op=True))
                return loss
            dist.broadcast(loss, src=src, group=self.groups.pipe)
            if self.grid.dp > 1:
                dist.all_reduce(loss, group=self.groups.data)
                loss /= self.grid.dp
        return loss

    def _microbatches(
        self, batch: Any, data_iter: Iterator[Any] | None, m: int | None = None
    ) -> tuple[list[Any], list[Any]]:
        m = self.config.micro_batches if m is None else m
        if (batch is None) == (data_iter is None):
            raise ValueError(
                "pass exactly one of data_iter= (yields micro-batches) or batch= (split into micro-batches)"
            )
        if data_iter is not None:
            items = []
            for i in range(m):
                try:
                    items.append(_unpack(next(data_iter)))
                except StopIteration:
                    raise ValueError(f"data_iter ran out after {i} of micro_batches={m} items") from None
            return [x for x, _ in items], [y for _, y in items]
        inputs, labels = _unpack(batch)
        return split_microbatches(inputs, m, "input"), split_microbatches(
            labels, m, "label"
        ) if labels is not None else [None] * m

    def forward_backward(
        self, batch: Any = None, data_iter: Iterator[Any] | None = None, *, _deferred: list[Any] | None = None
    ) -> torch.Tensor:
        """Runs the training schedule (forwards and backwards, gradients accumulate in ``.grad``); no reduction or
        step. Returns the mean loss (same on every rank)."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch/forward_backward need grad mode; call eval_batch under torch.no_grad()")
        self.module.train()
        inputs, labels = self._microbatches(batch, data_iter)
        before: dict[nn.Parameter, torch.Tensor | None] = {}
        if self.stash_gradients:  # run on empty .grad so only this batch's gradients get stashed
            before = {p: p.grad for p in self.module.parameters()}
            for p in before:
                p.grad = None
        loss = self._mean_loss(self._run(self.train_schedule, inputs, labels, keep=False, with_loss=True), _deferred)
        if self.stash_gradients:
            for p, old in before.items():
                if p.grad is not None:
                    g = p.grad.clone() if self.zero is not None else p.grad  # ZeRO: views of the engine's buffer
                    self._stash[p] = g if p not in self._stash else self._stash[p] + g
                p.grad = old
        return loss

    def restore_gradients(self) -> None:
        """Adds the stashed gradients back into ``.grad`` (see ``stash_gradients``)."""
        for p, g in self._stash.items():
            p.grad = g if p.grad is None else p.grad + g
        self._stash.clear()

    def run_batch(self, batch: Any) -> torch.Tensor:
        """``PipelineModule.batch_loss``: training schedule when grad mode is on and the module trains, else eval."""
        if torch.is_grad_enabled() and self.module.training:
            return self.forward_backward(batch)
        return self.eval_batch(batch=batch)  # any batch size: see [Note: evaluation batches of any size]

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` pulls ``(inputs, labels)`` items from when called without one
        (DeepSpeed's ``set_dataiterator``)."""
        self.data_iterator = iterator

    def set_dataloader(self, loader: Iterable[Any]) -> None:
        """``set_dataiterator(iter(loader))`` (DeepSpeed's ``set_dataloader``). The iterator is not restarted when
        the loader is exhausted: wrap the loader in one that repeats for endless training."""
        self.set_dataiterator(iter(loader))

    def train_batch(self, data_iter: Iterator[Any] | None = None, *, batch: Any = None) -> torch.Tensor:
        """One optimizer step on ``micro_batches`` micro-batches; see [Note: one batch]. Returns the mean loss.

        As DeepSpeed's ``train_batch(data_iter=None)``: ``data_iter`` yields ``(inputs, labels)`` items and becomes
        the iterator later calls without an argument pull from (``set_dataiterator``); exactly ``micro_batches``
        items are pulled per call. ``batch=(inputs, labels)`` instead splits one batch into the micro-batches.

        Raises:
            RuntimeError: no optimizer, or grad mode is off.
            ValueError: neither ``data_iter``/``batch`` nor an iterator set earlier, or the iterator runs out.
        """
        if self.optimizer is None:
            raise RuntimeError("PipelineEngine.train_batch needs an optimizer; pass optimizer= to PipelineEngine")
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled; use eval_batch() instead")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        elif batch is None:
            if self.data_iterator is None:
                raise ValueError(
                    "train_batch() was called without data_iter and no iterator is set: pass "
                    "train_batch(data_iter=iter(loader)) once (later calls reuse it), call "
                    "engine.set_dataiterator(iter(loader)), or pass batch=(inputs, labels)"
                )
            data_iter = self.data_iterator
        in_flight: list[Any] = []
        loss = self.forward_backward(batch, data_iter, _deferred=in_flight)
        self.reduce_gradients()
        overflow = self.unscale_and_check()
        if not overflow:
            if self.config.gradient_clipping > 0:
                self.clip_grad_norm_(self.config.gradient_clipping)
            self.step(self.optimizer)
        self.update_scale(overflow)
        self.optimizer.zero_grad(set_to_none=True)
        for work in in_flight:
            work.wait()
        return loss

    @torch.no_grad()
    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: Literal["avg"] | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
        *,
        batch: Any = None,
    ) -> Any:
        """Forward only, with the inference schedule and no gradients (DeepSpeed's ``eval_batch``, same arguments
        and meanings).

        Pulls ``num_micro_batches`` (default ``micro_batches``) items ``(inputs, labels)`` from ``data_iter`` (or
        splits ``batch=(inputs, labels)`` into that many; by default into the largest count up to ``micro_batches``
        that divides its size, see [Note: evaluation batches of any size]). The last stage computes, per micro-batch, the loss
        (``compute_loss=True``) or keeps the model's outputs (``compute_loss=False``). ``reduce_output="avg"``
        averages them over the micro-batches and then over the data-parallel replicas; ``None`` keeps the list of
        per-micro-batch values (not reduced over replicas). With ``compute_loss`` and ``bcast_loss`` the result is
        broadcast from the last stage, so every stage returns it; otherwise only the last stage has it and the
        others return None. The training iterator (``set_dataiterator``) is left untouched.

        Returns:
            The reduced value (or list); with ``return_logits``, ``(value, outputs)`` where ``outputs`` are the last
            stage's outputs of every micro-batch concatenated along dim 0 (None on the other stages). DeepSpeed
            returns the outputs of the last micro-batch only (it overwrites them per micro-batch); the two agree for
            ``num_micro_batches=1``.

        Raises:
            ValueError: an unknown ``reduce_output``, ``num_micro_batches < 1``, or the iterator runs out.
        """
        if reduce_output is not None and reduce_output != "avg":
            raise ValueError(f"eval_batch(reduce_output={reduce_output!r}): supported reductions are 'avg' and None")
        m = self.config.micro_batches if num_micro_batches is None else num_micro_batches
        if num_micro_batches is None and batch is not None:
            m = eval_micro_batches(batch, m)
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"eval_batch(num_micro_batches={num_micro_batches!r}) must be None or an int >= 1")
        was_training = self.module.training
        self.module.eval()
        try:
            inputs, labels = self._microbatches(batch, data_iter, m)
            keep = return_logits or not compute_loss
            run = self._run(self._eval_schedule(m), inputs, labels, keep=keep, with_loss=compute_loss)
        finally:
            self.module.train(was_training)
        value = self._eval_output(run, m, compute_loss, reduce_output, bcast_loss)
        if not return_logits:
            return value
        return value, (_concat([run.outputs[i] for i in sorted(run.outputs)]) if self.is_last_stage else None)

    def _eval_schedule(self, m: int) -> Schedule:
        if m not in self._eval_schedules:
            self._eval_schedules[m] = build_schedule(
                "inference", self.grid.pp, m, self.config.chunks_per_rank, self.config.placement
            )
        return self._eval_schedules[m]

    def _eval_output(self, run: BatchRun, m: int, compute_loss: bool, reduce: str | None, bcast: bool) -> Any:
        """``eval_batch``'s value: per-micro-batch losses or outputs of the last stage, reduced and broadcast."""
        if compute_loss and reduce == "avg" and bcast:
            return self._mean_loss(run)  # the training path's reduction: mean, broadcast, replica average
        values: Any = None
        if self.is_last_stage:
            values = list(run.losses) if compute_loss else [run.outputs[i] for i in sorted(run.outputs)]
            if reduce == "avg":
                values = _average(values, self.groups.data, self.grid.dp)
        if compute_loss and bcast and dist.is_initialized() and self.grid.pp > 1:
            shape = () if reduce == "avg" else (m,)
            out = torch.stack(values).float() if reduce != "avg" and values is not None else values
            buf = out.float().reshape(shape) if out is not None else torch.zeros(shape, device=self.device)
            src = self.grid.global_rank(self.last_rank, self.grid.dp_rank, self.grid.tp_rank)
            dist.broadcast(buf, src=src, group=self.groups.pipe)
            values = buf if reduce == "avg" else list(buf.unbind())
        return values

    @torch.no_grad()
    def predict(self, inputs: Any) -> Any:
        """Outputs of the model for ``inputs`` (split into up to ``micro_batches`` equal micro-batches, any batch
        size: see [Note: evaluation batches of any size]), returned on every rank of the pipe group.

        A collective of the pipe group: every stage of the pipeline must call it with the same inputs (as with
        ``batch_loss``); a call on one rank only waits for stages that never run it, until the transfer timeout.
        """
        was_training = self.module.training
        self.module.eval()
        try:
            m = eval_micro_batches(inputs, self.config.micro_batches)
            run = self._run(
                self._eval_schedule(m), split_microbatches(inputs, m, "input"), [None] * m, keep=True, with_loss=False
            )
        finally:
            self.module.train(was_training)
        out = [_concat([run.outputs[i] for i in sorted(run.outputs)]) if self.is_last_stage else None]
        if dist.is_initialized() and self.grid.pp > 1:
            out = [_to(out[0], "cpu")]
            src = self.grid.global_rank(self.last_rank, self.grid.dp_rank, self.grid.tp_rank)
            dist.broadcast_object_list(out, src=src, group=self.groups.pipe)
        return _to(out[0], self.device)

    # ------------------------------------------------------------------------------------------ gradients and step
    def _grads(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        return [p.grad for p in params if p.grad is not None]

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Sums tied gradients over their owning stages, then averages all gradients over data-parallel replicas."""
        for key, group in self.groups.tied.items():
            params = self.module.tied_parameters(key)
            if group is not None:
                _zero_fill_shared_grads(params, group, self.device)
            allreduce_sum(self._grads(params), group)
        if self.zero is None:  # ZeRO-2/3: the reduce-scatter averaged over the replicas already
            params = list(self.module.parameters())
            if self.groups.data is not None and self.grid.dp > 1:  # see [Note: a gradient on some replicas only]
                _zero_fill_shared_grads(params, self.groups.data, self.device)
            allreduce_mean(self._grads(params), self.groups.data, self.grid.dp)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scales all gradients by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` over the whole model (every stage,
        tied weights once; under TP the slices summed over the TP group and replicated parameters counted once).
        Call after ``reduce_gradients``. Returns the norm; see [Note: global norm over shards and model-parallel
        groups] in ``zlightning/_gradnorm.py``."""
        skip = self._tied_duplicates()
        held = [(id(p), p.grad) for p in self.module.parameters() if p.grad is not None]
        counted = [(i, g) for i, g in held if i not in skip]
        partitioned = [self.groups.data if self.zero is not None else None, self.groups.pipe]  # ZeRO-2/3: slices
        norm = _gradnorm.global_norm(
            [g for i, g in counted if i in self.tp_split],
            [g for i, g in counted if i not in self.tp_split],
            partitioned_over=[g for g in partitioned if g is not None],
            model_parallel=self.groups.tensor if self.grid.tp > 1 else None,
            device=self.device,
        )
        _gradnorm.clip_([g for _, g in held], norm, max_norm)
        return norm

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without a loss scaler)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    @torch.no_grad()
    def unscale_and_check(self) -> bool:
        """Divides every gradient by the loss scale and tells whether any rank of the whole grid found an inf/NaN
        (one MAX all-reduce over all ranks). Without a loss scaler: False, no communication. Call after
        ``reduce_gradients``; see [Note: fp16 loss scaling]."""
        if self.scaler is None:
            return False
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        world = [None] if dist.is_initialized() and dist.get_world_size() > 1 else []
        return _gradnorm.unscale_and_check_(grads, 1.0 / self.scaler.scale, world, device=self.device)

    def update_scale(self, overflow: bool) -> None:
        """Advances the loss scale after a step attempt; on overflow drops all gradients (the step was skipped)."""
        if self.scaler is None:
            return
        if overflow:
            self.skipped_steps += 1
            for p in self.module.parameters():
                p.grad = None
        self.scaler.update(overflow)

    def before_step(self) -> None:
        """ZeRO-1: drop gradients of parameters another replica steps."""
        if self.zero1 is not None:
            self.zero1.drop_foreign_grads()

    def after_step(self) -> None:
        """ZeRO-1: broadcast each parameter from the replica that stepped it. ZeRO-2/3: gathered copies are stale
        (ZeRO-3 frees them)."""
        if self.zero1 is not None:
            self.zero1.broadcast_from_owners()
        if self.zero is not None:
            self.zero.after_step()

    def memory_report(self) -> dict[str, int]:
        """This rank's resident model-state bytes under ZeRO-2/3 (``zlightning.zero.MemoryReport`` fields summed
        over the stage's engines).

        Raises:
            RuntimeError: ``zero_stage`` is below 2.
        """
        if self.zero is None:
            raise RuntimeError(
                "PipelineEngine.memory_report() reports ZeRO-2/3 stages; this engine runs zero_stage < 2"
            )
        return self.zero.memory_report(self.optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.before_step()
        optimizer.step()
        self.after_step()

    def forward(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("PipelineEngine has no forward(); use train_batch(data_iter) or eval_batch(data_iter)")

    backward = forward


def _check_layer_count(module: PipelineModule, pp: int, config: PipelineConfig) -> None:
    """With several chunks per rank, says so when the layers are too few for ``pp x chunks`` stages (the
    partition's own error counts stages the user never asked for and suggests a stage count that cannot help)."""
    v, n = config.chunks_per_rank, len(module.specs)
    if v == 1 or n >= pp * v:
        return
    fixes = [f"at most {n // v} pipeline ranks (num_stages)"] if n // v >= 2 else []
    fixes.append("a schedule with one chunk per rank ('1f1b', 'gpipe' or 'zb_h1')")
    raise ValueError(
        f"PipelineEngine: schedule={config.schedule!r} runs {v} model chunks per pipeline rank, so {pp} pipeline "
        f"ranks need {pp * v} stages of at least one layer each, but the PipelineModule has {n} layers; use "
        + ", ".join(fixes)
        + ", or split the model into more layers"
    )


def _all_or_none(make: Callable[[], frozenset[int]], device: torch.device) -> frozenset[int]:
    """Runs ``make`` on every rank; if it raises on any rank, every rank raises (the failing ones their own error),
    so a layer that cannot be sharded on one stage does not leave the other stages waiting for it."""
    error: Exception | None = None
    out: frozenset[int] = frozenset()
    try:
        out = make()
    except Exception as err:  # noqa: BLE001 (re-raised below, after the others learn of it)
        error = err
    flag = torch.tensor([float(dist.get_rank()) if error is not None else -1.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if error is not None:
        raise error
    if flag.item() >= 0:
        raise RuntimeError(
            f"tensor parallelism could not be applied on rank {int(flag.item())} (see its error); every rank stops"
        )
    return out


def _check_optimizer_params(optimizer: torch.optim.Optimizer, module: PipelineModule) -> None:
    mine = {id(p) for p in module.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in mine)
    if foreign:
        raise ValueError(
            f"PipelineEngine: the optimizer holds {foreign} tensors that are not parameters of this rank's stage(s) "
            "(an optimizer created before the engine built the stage sees other tensors); pass a factory instead, "
            "e.g. optimizer=lambda params: torch.optim.AdamW(params, lr=...)"
        )


def _average(values: list[Any], group: dist.ProcessGroup | None, dp: int) -> Any:
    """Mean over the micro-batches (tensors, or tuples/lists/dicts of them: element-wise), then over replicas."""
    tensors = [flatten(v)[0] for v in values]
    skeleton = flatten(values[0])[1]
    mean = [
        torch.stack([t[i].float() for t in tensors]).mean(0).to(tensors[0][i].dtype) for i in range(len(tensors[0]))
    ]
    if group is not None and dp > 1:
        for t in mean:
            dist.all_reduce(t, group=group)
            t /= dp
    return unflatten(mean, skeleton)


def _to(obj: Any, device: torch.device | str) -> Any:
    tensors, skeleton = flatten(obj)
    return unflatten([t.to(device) for t in tensors], skeleton) if tensors else obj


def _zero_fill_shared_grads(params: list[nn.Parameter], group: dist.ProcessGroup, device: torch.device) -> None:
    """Gives a zero ``.grad`` to each parameter that has none here but a gradient on another rank of ``group``, so
    every rank all-reduces the same list (a tied module's position embedding unused by the head's ``forward_fn``,
    see [Note: a tied module is one module]; an expert no sample of this replica was routed to, see [Note: a
    gradient on some replicas only]); a parameter no rank has a gradient for keeps ``None``.

    [Note: a gradient on some replicas only]
    The data-parallel all-reduce (ZeRO-0/1) packs the gradients each replica holds into one flat message. A layer
    whose parameters a replica's micro-batches did not use (a mixture of experts routing none of its samples to one
    expert, a branch taken by some batches only) leaves them without ``.grad`` there, so the replicas packed messages
    of different sizes: gloo aborted the run, or, when the sizes happened to agree, added one parameter's gradient
    to another's. One MAX all-reduce of has-a-gradient flags first (one integer per parameter) makes every replica
    pack the same list, zeros where it has none, which is the one-process gradient: the replicas' sum over the
    samples that used the parameter. A parameter no replica used keeps ``None``, so the optimizer skips it as in one
    process. ZeRO-2/3 settle the same question in the engine (``_settle_unused``)."""
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX, group=group)
    for p, anywhere in zip(params, has.tolist()):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)


def _concat(parts: list[Any]) -> Any:
    """The micro-batches' outputs as the batch's: tensors concatenated along dim 0, also inside tuples, lists and
    dicts of one layout (a model returning ``{"logits": ..., "probs": ...}`` gives that dict for the whole batch, as
    in one process; it gave a list of one dict per micro-batch). Outputs that do not join that way (scalars, layouts
    or trailing shapes that differ between micro-batches) stay the list of the micro-batches' outputs."""
    if not parts:
        return parts
    flat = [flatten(p) for p in parts]
    skeleton = flat[0][1]
    try:
        if any(s != skeleton for _, s in flat) or any(t.dim() == 0 for ts, _ in flat for t in ts) or not flat[0][0]:
            return parts
        return unflatten([torch.cat(ts) for ts in zip(*(ts for ts, _ in flat))], skeleton)
    except (RuntimeError, ValueError, TypeError):  # trailing shapes differ; a leaf whose == is not a bool
        return parts


def _default_device() -> torch.device:
    import os

    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
