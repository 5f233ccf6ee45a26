"""Typed configuration for the ZeRO-3 engine.

Knob names and meanings follow DeepSpeed's ``zero_optimization`` block (stage 3) where one exists, so that a
DeepSpeed user finds them; values are validated here, before any process group exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

import torch

from zlightning.zero._offload_config import CPUOffload, NVMeOffload

__all__ = [
    "Bytes",
    "CheckpointPolicy",
    "DTypeName",
    "Elements",
    "MixedPrecisionPolicy",
    "ZeroConfig",
    "dtype_from_name",
]

DTypeName = Literal["fp32", "bf16", "fp16"]

_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_from_name(name: DTypeName | None) -> torch.dtype | None:
    """Maps ``"fp32"``/``"bf16"``/``"fp16"`` (or None) to a torch dtype (or None)."""
    if name is None:
        return None
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype name {name!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


_DECIMAL = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_BINARY = {"KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


_COUNT = re.compile(r"(?P<number>[0-9]*\.?[0-9]+(?:E[+-]?[0-9]+)?)\s*(?P<unit>[KMGT]I?)?(?P<bytes>B)?")


def _parse_count(value: object, what: str, allow_bytes: bool) -> int:
    """``value`` as a non-negative int: an int, an integral float (``5e7``), or a string ``"5e7"``, ``"50M"``
    (decimal K/M/G/T), ``"64Mi"`` (binary Ki/Mi/Gi/Ti), with a trailing ``B`` where ``allow_bytes``."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what}: expected a number, got {type(value).__name__} {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{what}: {value!r} is not a whole number")
        return int(value)
    match = _COUNT.fullmatch(value.strip().replace("_", "").upper())
    if match is not None and match["bytes"] and not allow_bytes:
        raise ValueError(
            f"{what}: {value!r} is a byte size, but this counts tensor elements: write e.g. '50M' (50 million "
            "elements; 200 MB of fp32 values are 50M elements)"
        )
    amount = (
        float(match["number"]) * (_BINARY.get(match["unit"] or "") or _DECIMAL[match["unit"] or ""]) if match else None
    )
    if amount is None or not amount.is_integer():
        suffixes = "K/M/G/T (x1000) or Ki/Mi/Gi/Ti (x1024)" + (", optionally followed by B" if allow_bytes else "")
        raise ValueError(
            f"{what}: cannot read {value!r} as a whole number; write e.g. 50000000, 5e7 or 50M ({suffixes})"
        )
    return int(amount)


class Elements(int):
    """A count of tensor elements. Accepts an int, an integral float (``5e7``) or a string such as ``"5e7"``,
    ``"50M"`` (decimal K/M/G/T) or ``"64Mi"`` (binary Ki/Mi/Gi/Ti); a byte size (``"200MB"``) is refused."""

    def __new__(cls, value: object) -> Elements:
        return super().__new__(cls, _parse_count(value, "element count", allow_bytes=False))


class Bytes(int):
    """A size in bytes. Accepts what `Elements` accepts plus a trailing ``B`` (``"200MB"``, ``"1MiB"``)."""

    def __new__(cls, value: object) -> Bytes:
        return super().__new__(cls, _parse_count(value, "byte size", allow_bytes=True))


def _register_with_jsonargparse() -> None:
    """Lets jsonargparse (LightningCLI, YAML configs) read `Elements`/`Bytes` from ``5e7``/``"50M"`` strings."""
    try:
        from jsonargparse.typing import register_type
    except ImportError:  # no jsonargparse: only the command line needs it
        return
    for size_type in (Elements, Bytes):
        try:
            register_type(size_type, serializer=int, deserializer=size_type)
        except ValueError:  # registered already
            pass


_register_with_jsonargparse()

_ELEMENT_KNOBS = (
    "prefetch_bucket_size",
    "param_persistence_threshold",
    "model_persistence_threshold",
    "max_live_parameters",
    "reduce_bucket_size",
)


@dataclass(frozen=True, kw_only=True)
class MixedPrecisionPolicy:
    """How parameters are gathered and gradients reduced. The sharded master copy keeps its own dtype (fp32)."""

    param_dtype: DTypeName | None = None
    """dtype of gathered parameters and of compute (None: the master dtype, no cast). Casting happens on the shard
    before the all-gather, so bf16 halves the bytes sent."""

    reduce_dtype: DTypeName | None = None
    """dtype of the gradient reduce-scatter (None: fp32). Gradients always accumulate into fp32 shard gradients."""

    def __post_init__(self) -> None:
        dtype_from_name(self.param_dtype)
        dtype_from_name(self.reduce_dtype)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Knobs of the ZeRO-3 engine (DeepSpeed's stage-3 meanings, our defaults).

    Sizes in elements (and ``host_mmap_threshold`` in bytes) take an int, an integral float or a string: ``5e7``,
    ``"50M"`` (decimal K/M/G/T), ``"64Mi"`` (binary); ``host_mmap_threshold`` also ``"1MiB"``.

    Sharding is by *unit*: a module subtree (by default each repeated block, e.g. a transformer layer) whose
    parameters are gathered with one collective; what no unit claims belongs to the root unit.
    """

    stage: Literal[1, 2, 3] = 3
    """ZeRO stage. 3: parameters, gradients and optimizer state sharded. 2: parameters stay replicated (gathered
    once after each step), gradients and optimizer state sharded. 1: as 2, but gradients are kept whole and summed
    locally across accumulation micro-batches, then reduce-scattered once per optimizer step (less communication,
    more memory)."""

    prefetch_bucket_size: Elements | None = None
    """Elements (DeepSpeed ``stage3_prefetch_bucket_size``): how many parameter elements of upcoming units may be
    gathered ahead of use. 0 disables prefetch. None (default): the largest unit's size, so one unit is gathered
    ahead of the one computing (see [Note: step budgets from units] in ``_state.py``), except in a backward on the
    host, which gathers each unit at its own hook (see [Note: the host's backward gathers each unit at its own hook]);
    a size given here applies to both passes everywhere."""

    param_persistence_threshold: Elements = Elements(100_000)
    """Elements (``stage3_param_persistence_threshold``): parameters with at most this many elements stay gathered
    between uses (re-gathered once after each optimizer step) instead of being gathered per unit."""

    model_persistence_threshold: Elements | None = None
    """Elements (``stage3_model_persistence_threshold``): cap on the total size of persistent parameters, filled
    smallest first. None: 1% of the model, so persistent copies stay within the ZeRO-3 memory budget on small models
    where every parameter is under ``param_persistence_threshold``."""

    max_live_parameters: Elements = Elements(1_000_000_000)
    """Elements (``stage3_max_live_parameters``): prefetch stops when gathered non-persistent elements would exceed
    this. It bounds prefetch, not the parameters a running unit needs."""

    reduce_bucket_size: Elements | None = None
    """Elements (``reduce_bucket_size``): bound on gradient elements in flight in asynchronous reduce-scatters; past
    it the oldest is waited for and accumulated. None (default): the largest unit's size (the reduction of one unit
    overlaps the backward of the next)."""

    overlap_comm: bool = True
    """Run all-gathers (prefetch) and reduce-scatters asynchronously, overlapping compute (``overlap_comm``). When
    False every collective completes before compute continues: the step's buffers at its peak are two units (the
    unit computing and its gradient) instead of three on devices (on the host the default backward already holds
    two), for slower steps (about 10% on the CPU benchmarks)."""

    reshard_after_forward: bool = True
    """Release each unit's gathered parameters after its forward (FSDP2's ``reshard_after_forward``). False keeps
    them until the unit's backward: one all-gather per unit per step instead of two, for up to a full unsharded
    model of memory during the step. Gradients and optimizer state stay sharded either way."""

    unit_modules: tuple[str, ...] = ()
    """Class names (``"Block"``) or qualified names (``"pkg.mod.Block"``) of modules that become sharding units.
    Empty: automatic (each module in a ``ModuleList``/``Sequential`` with at least one sibling of the same class,
    plus the modules beside those blocks that hold more than half a block, such as an untied embedding and output
    head; else the parameter-holding children of the root). See [Note: what the root unit keeps] in ``_unit.py``."""

    sync_module_states: bool = True
    """Broadcast parameters and buffers from rank 0 before sharding so every rank starts identical."""

    host_cache: bool = True
    """When shards live in host memory, serve large CPU tensors (every step's gradients, temporaries, activations)
    from zlightning's caching host allocator instead of glibc's heaps, so resident memory stays flat at the step's
    peak instead of growing with fragmentation (see [Note: host memory of a sharded step] in ``_host_memory.py``).
    Needs the native kernels (``zlightning kernels --build``); without them a warning says so and glibc serves everything."""

    host_mmap_threshold: Bytes | None = None
    """Bytes, e.g. ``1 << 20``: fix glibc's mmap threshold at this size (every large block is mapped and returned to
    the OS on free). Only for runs without the native kernels (``host_cache`` unavailable): it bounds resident memory
    at a step-time cost (each large block is page-faulted afresh). None (default): leave glibc alone."""

    mixed_precision: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    """Gather and reduce dtypes. The Lightning strategy sets this from ``Trainer(precision=...)``."""

    offload_optimizer: CPUOffload | NVMeOffload | None = None
    """ZeRO-Offload / ZeRO-Infinity: keep fp32 optimizer state (Adam/AdamW) on the host (``CPUOffload``) or in
    swap files (``NVMeOffload``) and step it there. None: optimizer state stays with the shards."""

    offload_params: NVMeOffload | None = None
    """ZeRO-Infinity: keep parameter shards in swap files between uses (prefetched ahead of each gather)."""

    def __post_init__(self) -> None:
        for name in (*_ELEMENT_KNOBS, "host_mmap_threshold"):  # "5e7", 5e7, "50M", "1MiB" -> int
            value = getattr(self, name)
            if isinstance(value, (str, float)):
                count = _parse_count(value, f"ZeroConfig.{name}", allow_bytes=name == "host_mmap_threshold")
                object.__setattr__(self, name, count)
        if self.stage not in (1, 2, 3) or isinstance(self.stage, bool):
            raise ValueError(f"ZeroConfig.stage must be 1, 2 or 3, got {self.stage!r}")
        value = self.param_persistence_threshold
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"ZeroConfig.param_persistence_threshold must be an int >= 0 (elements), got {value!r}")
        value = self.prefetch_bucket_size
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(
                f"ZeroConfig.prefetch_bucket_size must be None (one unit) or an int >= 0 (elements), got {value!r}"
            )
        cap = self.model_persistence_threshold
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise ValueError(f"ZeroConfig.model_persistence_threshold must be None or an int >= 0, got {cap!r}")
        for name in ("max_live_parameters", "reduce_bucket_size"):
            value = getattr(self, name)
            if name == "reduce_bucket_size" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ZeroConfig.{name} must be an int > 0 (elements), got {value!r}")
        mmap = self.host_mmap_threshold
        if mmap is not None and (not isinstance(mmap, int) or isinstance(mmap, bool) or not 0 < mmap <= 1 << 30):
            raise ValueError(f"ZeroConfig.host_mmap_threshold must be None or bytes in (0, 1 GiB], got {mmap!r}")
        if not isinstance(self.host_cache, bool):
            raise ValueError(f"ZeroConfig.host_cache must be a bool, got {self.host_cache!r}")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"ZeroConfig.reshard_after_forward must be a bool, got {self.reshard_after_forward!r}")
        if not isinstance(self.overlap_comm, bool):
            raise ValueError(f"ZeroConfig.overlap_comm must be a bool, got {self.overlap_comm!r}")
        if isinstance(self.unit_modules, str) or not all(isinstance(n, str) and n for n in self.unit_modules):
            raise ValueError(
                f"ZeroConfig.unit_modules must be a tuple of module class names such as ('Block',), "
                f"got {self.unit_modules!r}"
            )
        if self.offload_optimizer is not None and not isinstance(self.offload_optimizer, (CPUOffload, NVMeOffload)):
            raise ValueError(
                f"ZeroConfig.offload_optimizer must be CPUOffload(), NVMeOffload(path=...) or None, got "
                f"{self.offload_optimizer!r}"
            )
        if self.offload_params is not None and not isinstance(self.offload_params, NVMeOffload):
            raise ValueError(
                f"ZeroConfig.offload_params must be NVMeOffload(path=...) or None, got {self.offload_params!r} "
                "(parameter shards already live on the host when the device is the CPU)"
            )
        if self.offload_params is not None and self.offload_optimizer is None:
            raise ValueError(
                "ZeroConfig.offload_params=NVMeOffload(...) needs offload_optimizer=CPUOffload() or NVMeOffload(...): "
                "offloaded parameter shards are updated only by the offloaded optimizer step, which brings each shard "
                "back, steps it and writes it out (an optimizer stepping them in place would find them on disk)"
            )
        if self.offload_params is not None and self.stage != 3:
            raise ValueError(
                f"ZeroConfig.offload_params needs stage=3 (parameters are replicated at stage {self.stage})"
            )
        if not isinstance(self.mixed_precision, MixedPrecisionPolicy):
            raise ValueError(
                f"ZeroConfig.mixed_precision must be a MixedPrecisionPolicy, got {type(self.mixed_precision).__name__}"
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointPolicy:
    """How the Lightning strategy writes checkpoints."""

    state_dict_type: Literal["sharded", "full"] = "sharded"
    """``"sharded"``: a directory where every rank writes only its shards (loads at any world size; turn it into one
    file with ``zlightning consolidate``). ``"full"``: one file gathered on rank 0, a plain Lightning checkpoint."""

    save_full_weights: bool = False
    """With ``"sharded"``, also gather the consolidated model state dict into ``full_weights.pt`` at save time."""

    def __post_init__(self) -> None:
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"CheckpointPolicy.state_dict_type must be 'sharded' or 'full', got {self.state_dict_type!r}"
            )
        if not isinstance(self.save_full_weights, bool):
            raise ValueError(f"CheckpointPolicy.save_full_weights must be a bool, got {self.save_full_weights!r}")
