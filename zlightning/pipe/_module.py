"""``PipelineModule``: a model described as a list of layers, split into stages, built lazily per rank.

[Note: lazy building]
DeepSpeed's ``PipelineModule`` builds its stage in the constructor (so it needs an initialised process group there)
and, with ``partition_method='parameters'``, instantiates every layer on every rank once to count parameters. Here
the constructor only validates and stores the specs; ``build(stage ids)`` materialises just the layers of the
requested stages, and parameter counting builds each ``LayerSpec`` on the ``meta`` device (no memory, no RNG use).
``PipelineEngine`` (or ``Trainer(strategy="zstack_pipeline")``) calls ``build``; a one-stage ``build()`` gives the
whole model in one process, which is what a single-process reference run uses.

[Note: building without a pipeline]
A ``PipelineModule`` that no pipeline engine drives (a Lightning strategy other than ``zstack_pipeline``, no strategy,
or plain PyTorch) builds its single stage itself the first time something needs its layers: collecting its
parameters or submodules (``parameters()``, ``modules()``, also through a parent such as the LightningModule),
moving it (``.to()``, ``.cuda()``), ``forward``, ``state_dict``/``load_state_dict``. Otherwise an optimizer created in
``configure_optimizers`` would get an empty parameter list. A pipeline engine, and the ``zstack_pipeline`` strategy
as soon as it sees the model, *claim* the module first (``claim()``), so it is never built whole on a rank that
should hold one stage. Should it have been built whole before it was claimed (its parameters counted before the
engine was created, say), the first ``build`` for a real split discards that copy and builds the split; with
``seed_layers`` the weights are the same.

[Note: seeding layers]
With ``seed_layers=True`` (the default here, DeepSpeed's default is False) layer ``i`` is built under
``torch.manual_seed(base_seed + i)`` inside a forked RNG, so its initial weights do not depend on which rank builds
it or how the model is split: a pipeline run starts from exactly the weights of a one-process run, and resharding to
another stage count changes nothing numerically. A tie group is seeded by its first position.

[Note: who runs a claimed module]
The module does not know the pipeline engine (see [Note: stage, engine and module] in ``_stage.py``). Its
``batch_loss``/``predict`` need one, though: a LightningModule returns ``self.pipe.batch_loss(batch)`` and the whole
schedule must run there. Whatever drives the module registers itself with ``set_driver`` as a ``PipelineDriver``
(two calls: ``run_batch`` and ``predict``) and unregisters with ``set_driver(None)``; without a driver both run the
layers in this process.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.checkpoint import checkpoint

from zlightning.pipe._partition import layer_weights, partition_balanced, partition_uniform
from zlightning.pipe._spec import LayerSpec, TiedLayerSpec

__all__ = ["PipelineModule"]

LossFn = Callable[[Any, Any], torch.Tensor]
LayerContext = Callable[[], AbstractContextManager[Any]]
"""Entered around every run of a stage's layers, recomputation included (ZeRO stages gather their parameters)."""
_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class PipelineDriver(Protocol):
    """What runs the batches of a claimed ``PipelineModule`` (``PipelineEngine``); see
    [Note: who runs a claimed module]."""

    def run_batch(self, batch: Any) -> torch.Tensor:
        """Mean loss of ``(inputs, labels)`` (backward included when training), the same on every rank."""
        ...

    def predict(self, inputs: Any) -> Any:
        """Outputs of the last layer for ``inputs``, on every rank."""
        ...


def _layer_name(layer: Any) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _check_tied_weight_attr(idx: int, spec: TiedLayerSpec, module: nn.Module) -> None:
    """Raises a ``ValueError`` naming the module's parameters if a ``tied_weight_attr`` entry is not one of them."""
    names = [n for n, _ in module.named_parameters()]
    missing = [a for a in spec.tied_weight_attr if a not in names]
    if missing:
        raise ValueError(
            f"PipelineModule: layer {idx}, TiedLayerSpec({spec.key!r}, {spec.typename.__name__}): tied_weight_attr "
            f"{missing[0]!r} is not a parameter of {spec.typename.__name__} (its parameters: {', '.join(names) or 'none'})"
            + (f"; pass tied_weight_attr={names[0]!r} (or a tuple of names)" if names else "")
        )


class PipelineModule(nn.Module):
    """A sequential model split into pipeline stages (same constructor as DeepSpeed's ``PipelineModule``).

    The layers are applied in order: ``x = layer(x)``; each layer's output (a tensor, or a tuple/list/dict of tensors)
    is the next layer's input. On the last stage ``loss_fn(outputs, labels)`` gives the loss (without ``loss_fn`` the
    output is the loss).

    Args:
        layers: ``LayerSpec``/``TiedLayerSpec`` (built lazily), ``nn.Module`` instances, or plain callables.
        loss_fn: ``loss_fn(outputs, labels) -> scalar tensor`` run on the last stage.
        num_stages: pipeline stages; None lets the engine/strategy decide (its ``num_stages``).
        partition_method: ``"parameters"`` (balance trainable parameter counts), ``"uniform"`` (balance layer
            counts) or ``"type:REGEX"`` (balance layers whose class name matches REGEX, case-insensitive).
        activation_checkpoint_interval: recompute every ``k`` consecutive local layers in backward (0: off). A block
            is checkpointed if one of its layers has parameters, or, with ``checkpointable_layers``, if one of its
            layers' class names is listed.
        checkpointable_layers: class names eligible for activation checkpointing.
        seed_layers: seed each layer's construction by its index; see [Note: seeding layers].
        base_seed: seed of layer 0.

    Raises:
        ValueError: empty ``layers``, a nested ``PipelineModule``, a bad tie key, a negative interval, or an unknown
            ``partition_method``.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec | nn.Module | Callable[..., Any]],
        loss_fn: LossFn | None = None,
        num_stages: int | None = None,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        checkpointable_layers: Sequence[str] | None = None,
        seed_layers: bool = True,
        base_seed: int = 1234,
    ) -> None:
        super().__init__()
        self._check_args(layers, num_stages, partition_method, activation_checkpoint_interval)
        self.specs: list[Any] = list(layers)
        self.loss_fn = loss_fn
        self.num_stages = num_stages
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.checkpointable_layers = tuple(checkpointable_layers) if checkpointable_layers is not None else None
        self.seed_layers = seed_layers
        self.base_seed = base_seed
        self.tied_modules = nn.ModuleDict()
        self.bounds: list[int] | None = None  # num_stages_total + 1 boundaries, set by build
        self.local_stages: tuple[int, ...] = ()
        self._funcs: dict[int, Callable[[Any], Any]] = {}
        self._driver: PipelineDriver | None = None  # see [Note: who runs a claimed module]
        self._claimed = False  # a pipeline engine or strategy builds it; see [Note: building without a pipeline]
        self._auto_built = False  # built whole by _ensure_built (discarded by a later build for a real split)
        self._building = False

    @staticmethod
    def _check_args(layers: Sequence[Any], num_stages: int | None, method: str, interval: int) -> None:
        if len(layers) == 0:
            raise ValueError("PipelineModule: layers is empty; give at least one LayerSpec, module or callable")
        for i, layer in enumerate(layers):
            if isinstance(layer, PipelineModule):
                raise ValueError(f"PipelineModule: layer {i} is itself a PipelineModule; nesting is not supported")
            if isinstance(layer, TiedLayerSpec) and not _KEY_RE.match(layer.key):
                raise ValueError(f"PipelineModule: tie key {layer.key!r} of layer {i} must be a Python identifier")
            if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
                raise ValueError(f"PipelineModule: layer {i} ({layer!r}) is not a LayerSpec, nn.Module or callable")
        if num_stages is not None and (
            isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1
        ):
            raise ValueError(f"PipelineModule: num_stages must be None or an int >= 1, got {num_stages!r}")
        if not isinstance(interval, int) or interval < 0:
            raise ValueError(f"PipelineModule: activation_checkpoint_interval must be an int >= 0, got {interval!r}")
        layer_weights(method, [_layer_name(x) for x in layers], [0] * len(layers))  # validates the method name

    # ------------------------------------------------------------------------------------------ partitioning (pure)
    def _numel(self, idx: int, layer: Any, seen_keys: set[str]) -> int:
        """Trainable elements of layer ``idx`` (a tie group's at its first position only), checked to be countable
        and, for a tie group, to hold its ``tied_weight_attr``.

        Raises:
            ValueError: a lazy module (parameters of unknown shape), or a ``tied_weight_attr`` that names no parameter.
        """
        if isinstance(layer, TiedLayerSpec):
            if layer.key in seen_keys:
                return 0  # counted (and checked) at its first position
            seen_keys.add(layer.key)
        module = layer.build("meta") if isinstance(layer, LayerSpec) else layer
        if not isinstance(module, nn.Module):
            return 0
        if any(is_lazy(p) for p in module.parameters()):
            raise ValueError(
                f"PipelineModule: layer {idx} ({_layer_name(layer)}) is a lazy module whose parameters get their shape "
                "from its first input; a pipeline needs every parameter before the first batch (to partition the "
                "layers, make replicas identical, shard them under ZeRO and build the optimizer) and no rank runs the "
                "whole model to infer them. Give the input size instead, e.g. nn.Linear(in_features, out_features) "
                "for nn.LazyLinear(out_features)"
            )
        if isinstance(layer, TiedLayerSpec):
            _check_tied_weight_attr(idx, layer, module)
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def partition(self, total_stages: int) -> list[int]:
        """Layer boundaries of ``total_stages`` contiguous stages (``total_stages + 1`` indices).

        Raises:
            ValueError: fewer layers than stages.
        """
        n = len(self.specs)
        if n < total_stages:
            raise ValueError(
                f"PipelineModule has {n} layers, which cannot be split into {total_stages} stages "
                f"(each stage needs at least one layer); use at most {n} stages or split the model into more layers"
            )
        seen: set[str] = set()
        numels = [self._numel(i, layer, seen) for i, layer in enumerate(self.specs)]
        weights = layer_weights(self.partition_method, [_layer_name(x) for x in self.specs], numels)
        if weights is None:
            return partition_uniform(n, total_stages)
        return partition_balanced(weights, total_stages)

    def tie_owners(self, bounds: Sequence[int], rank_of: Callable[[int], int]) -> dict[str, list[int]]:
        """Per tie key, the pipeline ranks holding one of its positions (stage ``s`` is on rank ``rank_of(s)``)."""
        owners: dict[str, list[int]] = {}
        for s in range(len(bounds) - 1):
            for idx in range(bounds[s], bounds[s + 1]):
                spec = self.specs[idx]
                if isinstance(spec, TiedLayerSpec):
                    rank = rank_of(s)
                    if rank not in owners.setdefault(spec.key, []):
                        owners[spec.key].append(rank)
        return owners

    # ------------------------------------------------------------------------------------------ building
    @property
    def is_built(self) -> bool:
        return self.bounds is not None

    def claim(self) -> None:
        """Marks the module as driven by a pipeline engine, which will ``build`` the stages of its rank: it no longer
        builds its single stage on first use (see [Note: building without a pipeline])."""
        self._claimed = True

    def _ensure_built(self) -> None:
        """Builds the single stage of an unclaimed, unbuilt module (see [Note: building without a pipeline])."""
        if getattr(self, "bounds", 0) is None and not getattr(self, "_claimed", True) and not self._building:
            self.build()
            self._auto_built = True

    def _discard_auto_build(self) -> None:
        for idx in list(self._funcs):
            if str(idx) in self._modules:
                del self._modules[str(idx)]
        self._funcs.clear()
        self.tied_modules = nn.ModuleDict()
        self.bounds, self.local_stages, self._auto_built = None, (), False

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True) -> Any:
        self._ensure_built()  # parameters(), modules(), and the same calls on any parent module come through here
        return super().named_modules(memo, prefix, remove_duplicate)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PipelineModule:
        self._ensure_built()  # .to(), .cuda(), .double(), ...
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        self._ensure_built()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        self._ensure_built()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def build(
        self, stages: Sequence[int] = (0,), total_stages: int = 1, device: torch.device | str | None = None
    ) -> PipelineModule:
        """Materialises the layers of ``stages`` (of ``total_stages``) on ``device``. Idempotent for the same split.

        Raises:
            RuntimeError: already built for another split.
            ValueError: the layers cannot be split into ``total_stages``.
        """
        bounds = self.partition(total_stages)
        self._check_modules_shared_across_stages(bounds)
        if (
            self.bounds is not None
            and self._auto_built
            and (self.bounds != bounds or tuple(stages) != self.local_stages)
        ):
            self._discard_auto_build()  # built whole before a pipeline claimed it; see [Note: building without a pipeline]
        if self.bounds is not None:
            if self.bounds != bounds or tuple(stages) != self.local_stages:
                raise RuntimeError(
                    f"PipelineModule is already built for stages {self.local_stages} of {len(self.bounds) - 1}; "
                    "build a fresh PipelineModule for another split"
                )
            return self
        self.bounds, self.local_stages = bounds, tuple(stages)
        self._building = True
        try:
            for s in stages:
                for idx in range(bounds[s], bounds[s + 1]):
                    self._build_layer(idx, device)
        finally:
            self._building = False
        return self

    def _check_modules_shared_across_stages(self, bounds: Sequence[int]) -> None:
        """Raises if a parameter of an ``nn.Module`` given as a layer is also held by a layer of another stage.

        [Note: a module instance at several positions]
        An ``nn.Module`` instance given at two positions (``layers=[shared, ..., shared]``), or two instances holding
        the same parameter, is one module in a single process. Split into stages, every rank builds its own stage
        from its own copy of the list, so the positions on different stages trained separate copies, silently: the
        losses left the one-process run's from the second step on (with or without ZeRO) and the checkpoint held
        two different values under two names. Sharing across stages is what ``TiedLayerSpec`` does (one module on
        every owning stage, its gradients summed over them); so a parameter on two stages is an error naming it.
        Within one stage the positions run on one copy and train as in one process. Every rank checks the whole
        split before building anything, so they all raise together, before any collective."""
        first: dict[int, tuple[int, int, str]] = {}  # id(parameter) -> (layer, stage, name) where it was first held
        for stage in range(len(bounds) - 1):
            for idx in range(bounds[stage], bounds[stage + 1]):
                spec = self.specs[idx]
                if isinstance(spec, LayerSpec) or not isinstance(spec, nn.Module):
                    continue
                for name, p in spec.named_parameters():
                    layer, where, held_as = first.setdefault(id(p), (idx, stage, name))
                    if where != stage:
                        kind = type(spec).__name__
                        raise ValueError(
                            f"PipelineModule: layers {layer} and {idx} hold the same parameter ({layer}.{held_as} is "
                            f"{idx}.{name}) but fall in different stages ({where} and {stage} of {len(bounds) - 1}), "
                            "whose ranks would each train their own copy. To share a layer across stages, give "
                            f"TiedLayerSpec('some_key', {kind}, ...) at each position (one module, its gradients "
                            "summed over the stages; forward_fn= runs a position differently); otherwise pass "
                            "distinct modules"
                        )

    def _seeded(self, idx: int, make: Callable[[], nn.Module]) -> nn.Module:
        if not self.seed_layers:
            return make()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.base_seed + idx)
            return make()

    def _build_layer(self, idx: int, device: torch.device | str | None) -> None:
        spec = self.specs[idx]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                first = next(i for i, x in enumerate(self.specs) if isinstance(x, TiedLayerSpec) and x.key == spec.key)
                self.tied_modules[spec.key] = self._seeded(first, lambda: spec.build(device))
            module = self.tied_modules[spec.key]
            fn = spec.forward_fn
            if fn is not None:

                def tied_forward(x: Any, m: nn.Module = module, f: Callable[[nn.Module, Any], Any] = fn) -> Any:
                    return f(m, x)

                self._funcs[idx] = tied_forward
            else:
                self._funcs[idx] = module
        elif isinstance(spec, LayerSpec):
            module = self._seeded(idx, lambda: spec.build(device))
            self.add_module(str(idx), module)
            self._funcs[idx] = module
        elif isinstance(spec, nn.Module):
            self.add_module(str(idx), spec if device is None else spec.to(device))
            self._funcs[idx] = spec
        else:
            self._funcs[idx] = spec

    def stage_layers(self, stage: int) -> range:
        if self.bounds is None:
            raise RuntimeError("PipelineModule is not built yet")
        return range(self.bounds[stage], self.bounds[stage + 1])

    def check_stage_has_parameters(self, rank: int) -> None:
        """Raises a clear error if this rank's stages hold no parameter (an optimizer over them cannot be built:
        torch raises "optimizer got an empty parameter list")."""
        if self.bounds is None or next(iter(self.parameters()), None) is not None:
            return
        raise ValueError(
            f"PipelineModule: stage(s) {list(self.local_stages)} on pipeline rank {rank} hold no parameter "
            f"(layers {self._local_layer_names()}), so no optimizer can be built there. Give every stage a layer with "
            "parameters: partition_method='parameters' (the default, balances parameters), a 'type:REGEX' partition, "
            "or fewer stages (num_stages)"
        )

    def explain_empty_optimizer(self, rank: int, err: ValueError) -> None:
        """Raises, from ``err`` (torch's "optimizer got an empty parameter list"), why a pipeline rank got no
        parameter to optimize when its stages train none (every one frozen: a fine-tuning run freezing the first
        layers, whose optimizer takes the parameters that require grad); returns for any other error, which the
        caller re-raises. In one process the same optimizer gets the trainable parameters of the whole model."""
        if (
            "empty parameter list" not in str(err)
            or self.bounds is None
            or any(p.requires_grad for p in self.parameters())
        ):
            return
        raise ValueError(
            f"PipelineModule: stage(s) {list(self.local_stages)} on pipeline rank {rank} train no parameter (layers "
            f"{self._local_layer_names()} are frozen), so an optimizer given only the parameters that require grad "
            "gets an empty list there. Give it every parameter (frozen ones get no gradient, which torch's "
            "optimizers skip: torch.optim.AdamW(self.parameters(), ...)), or split the model so that every stage "
            "trains a layer (num_stages, partition_method)"
        ) from err

    def _local_layer_names(self) -> str:
        layers = [i for s in self.local_stages for i in self.stage_layers(s)]
        return ", ".join(f"{i}: {_layer_name(self.specs[i])}" for i in layers[:6]) + (
            ", ..." if len(layers) > 6 else ""
        )

    def local_layer(self, idx: int) -> nn.Module | None:
        """Layer ``idx`` if this rank built it as its own module (not a tied layer, not a plain callable), else None."""
        module = self._modules.get(str(idx))
        return module if self._funcs.get(idx) is module else None

    def replace_layer(self, idx: int, new: nn.Module) -> None:
        """Swaps the module of local layer ``idx`` (tensor parallelism rebuilds some layers).

        Raises:
            KeyError: layer ``idx`` is not a module built on this rank.
        """
        if self.local_layer(idx) is None:
            raise KeyError(f"layer {idx} is not a module built on this rank")
        self.add_module(str(idx), new)
        self._funcs[idx] = new

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The parameters of tie group ``key``'s module on this rank: every one of them, ``tied_weight_attr`` first.

        [Note: a tied module is one module]
        DeepSpeed keeps only ``tied_weight_attr`` in step across the owning stages; any other parameter of the module
        (a Linear's bias, an embedding block's norm) trains separately on each stage, silently, under one name.
        Here the module is one module, as in a single process: all its parameters start equal on the owning stages
        and their gradients are summed there, so the copies stay identical and the checkpoint (one entry per name,
        written by the lowest owning stage) holds the model's only value. ``tied_weight_attr`` is still checked.
        """
        spec = next(x for x in self.specs if isinstance(x, TiedLayerSpec) and x.key == key)
        module = self.tied_modules[key]
        named = [module.get_parameter(name) for name in spec.tied_weight_attr]
        seen = {id(p) for p in named}
        return named + [p for p in module.parameters() if id(p) not in seen]

    # ------------------------------------------------------------------------------------------ running
    def _checkpointable(self, indices: Sequence[int]) -> bool:
        for idx in indices:
            f = self._funcs[idx]
            module = f if isinstance(f, nn.Module) else None
            spec = self.specs[idx]
            if isinstance(spec, TiedLayerSpec):
                module = self.tied_modules[spec.key]
            if self.checkpointable_layers is not None:
                if _layer_name(spec) in self.checkpointable_layers:
                    return True
            elif module is not None and any(True for _ in module.parameters()):
                return True
        return False

    def checkpoints_stage(self, stage: int) -> bool:
        """Whether a training ``run_stage(stage)`` recomputes some of its layers in backward (activation
        checkpointing with a checkpointable block in the stage)."""
        k = self.activation_checkpoint_interval
        indices = list(self.stage_layers(stage))
        return k > 0 and any(self._checkpointable(indices[i : i + k]) for i in range(0, len(indices), k))

    def run_stage(self, stage: int, x: Any, *, context: LayerContext | None = None) -> Any:
        """Applies the layers of ``stage`` to ``x`` (with activation checkpointing when enabled and training),
        inside ``context()`` if given (entered again around each recomputation)."""
        indices = list(self.stage_layers(stage))
        k = self.activation_checkpoint_interval
        if k <= 0 or not (self.training and torch.is_grad_enabled()):
            return self._run(indices, x, context)
        with context() if context is not None else contextlib.nullcontext():  # one pass
            for start in range(0, len(indices), k):
                block = indices[start : start + k]
                if self._checkpointable(block):
                    x = checkpoint(self._run, block, x, context, use_reentrant=False)
                else:
                    x = self._run(block, x, context)
        return x

    def _run(self, indices: Sequence[int], x: Any, context: LayerContext | None = None) -> Any:
        with context() if context is not None else contextlib.nullcontext():
            for idx in indices:
                x = self._funcs[idx](x)
        return x

    def forward(self, inputs: Any) -> Any:
        """Applies all layers of a module built as one stage (built here on first use unless a pipeline engine
        claimed it); pipelined runs use the engine.

        Raises:
            RuntimeError: claimed by a pipeline engine but not built, or this rank holds only part of the model.
        """
        self._ensure_built()
        if self.bounds is None:
            raise RuntimeError(
                "PipelineModule is claimed by a pipeline engine but not built yet: train it through "
                "zlightning.pipe.PipelineEngine or Trainer(strategy='zstack_pipeline')"
            )
        if len(self.bounds) != 2:
            raise RuntimeError(
                f"this rank holds stages {self.local_stages} of {len(self.bounds) - 1}; forward() of a partial model "
                "is not defined: use batch_loss(batch) / predict(inputs), which run the pipeline schedule"
            )
        return self.run_stage(0, inputs)

    def compute_loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        loss = self.loss_fn(outputs, labels) if self.loss_fn is not None else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"the pipeline loss must be a scalar tensor, got {what}"
                + ("" if self.loss_fn is not None else "; pass loss_fn= or make the last layer return the loss")
            )
        return loss.reshape(())

    def set_driver(self, driver: PipelineDriver | None) -> None:
        """Routes ``batch_loss``/``predict`` through ``driver`` (None: run in this process); see
        [Note: who runs a claimed module]."""
        self._driver = driver

    def batch_loss(self, batch: Any) -> torch.Tensor:
        """Mean loss of a batch ``(inputs, labels)``: runs the driving engine's schedule (training schedule with the
        backward pass included when grad mode is on and the module is training, else the inference schedule); on a
        one-stage module without an engine, a plain forward. The value is the same on every rank."""
        if self._driver is not None:
            return self._driver.run_batch(batch)
        inputs, labels = batch
        return self.compute_loss(self(inputs), labels)

    def predict(self, inputs: Any) -> Any:
        """Outputs of the last layer for ``inputs`` (inference schedule), returned on every rank."""
        if self._driver is not None:
            return self._driver.predict(inputs)
        with torch.no_grad():
            return self(inputs)
