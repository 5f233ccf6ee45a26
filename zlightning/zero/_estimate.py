"""Per-rank model-state memory estimate for ZeRO stages 1-3 (DeepSpeed's ``estimate_zero3_model_states_mem_needs``).

It follows the engine's own accounting (``MemoryReport``): fp32 master shards, fp32 sharded gradients, the optimizer's
per-element state (Adam: two fp32 moments) for this rank's shard, and the gathered copies that stay resident between
steps (persistent small parameters at stage 3, every parameter at stages 1-2) in the gather dtype. Given a module (it
may live on the meta device) the persistent set and the largest unit come from the same rules the engine applies.

[Note: where the estimate puts each byte]
With the config's offload policies the same bytes are split by where they live, as the engine places them (see
[Note: what is offloaded where]): on the accelerator, in host memory, or in swap files.

* no offload: everything on the compute device;
* ``offload_optimizer=CPUOffload``: Adam's state on the host, plus an fp32 master shard there when the compute
  device is an accelerator (on a CPU-only machine the engine's shard is the master);
* ``offload_optimizer=NVMeOffload``: that state in files; the host holds the pool (``buffer_count`` buffers of
  ``buffer_size`` elements, or of the largest shard when smaller);
* ``offload_params=NVMeOffload``: non-persistent parameter shards in files; the host holds their pool (buffers of
  the largest shard). Gradient shards stay on the compute device.

``model_state_bytes`` stays the sum the engine's ``MemoryReport`` counts (shards, gradients, optimizer state or its
pool, persistent copies); ``device_bytes`` / ``host_bytes`` / ``nvme_bytes`` are the placement, ``host_bytes``
including the parameter pool that ``MemoryReport`` does not count.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from torch import nn

from zlightning.zero._config import ZeroConfig
from zlightning.zero._offload_config import CPUOffload, NVMeOffload
from zlightning.zero._swap import aligned_numel
from zlightning.zero._unit import select_unit_modules

__all__ = ["MemoryEstimate", "estimate_zero_memory"]

_GATHER_BYTES = {"32-true": 4, "bf16-mixed": 2, "bf16-true": 2, "16-mixed": 2, "16-true": 2}


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated resident model-state bytes on one rank after an optimizer step."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    persistent_bytes: int
    largest_unit_bytes: int
    """Transient: the largest unit gathered during forward/backward (not part of the resident total)."""
    device_bytes: int = 0
    """Of the resident bytes, those on the accelerator (0 when the compute device is the CPU)."""
    host_bytes: int = 0
    """Host memory: everything on a CPU-only machine; offloaded state, masters and swap pools otherwise."""
    nvme_bytes: int = 0
    """Swap files (``NVMeOffload``): optimizer state and parameter shards kept on disk."""

    @property
    def model_state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.persistent_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "model_state_bytes": self.model_state_bytes}


def _module_counts(module: nn.Module, config: ZeroConfig) -> tuple[int, int, int]:
    """(parameters, persistent parameters, largest unit's parameters), as the engine would choose them."""
    params = {id(p): p.numel() for p in module.parameters()}
    total = sum(params.values())
    cap = total // 100 if config.model_persistence_threshold is None else config.model_persistence_threshold
    persistent, acc = set(), 0
    for pid, n in sorted(params.items(), key=lambda kv: kv[1]):
        if n > config.param_persistence_threshold or acc + n > cap:
            break
        persistent.add(pid)
        acc += n
    units = select_unit_modules(module, config.unit_modules, None)
    claimed: set[int] = set()
    largest = 0
    for _, unit in units:
        own = {id(p): p.numel() for p in unit.parameters() if id(p) not in persistent}
        largest = max(largest, sum(own.values()))
        claimed |= set(own)
    root = sum(n for pid, n in params.items() if pid not in claimed and pid not in persistent)
    return total, acc, max(largest, root)


def estimate_zero_memory(
    *,
    world_size: int,
    module: nn.Module | None = None,
    num_params: int | None = None,
    stage: Literal[1, 2, 3] | None = None,
    precision: str = "32-true",
    optimizer_state_per_param: int = 2,
    config: ZeroConfig | None = None,
    device_type: Literal["cuda", "cpu"] = "cuda",
) -> MemoryEstimate:
    """Estimates one rank's model-state memory.

    Args:
        world_size: data-parallel ranks.
        module: the model (meta device is fine); gives the persistent set and largest unit exactly.
        num_params: instead of ``module``: a parameter count (persistent and unit sizes then assumed 0 and P/100).
        stage: ZeRO stage (default: ``config.stage``, else 3).
        precision: the Trainer's precision (sets the gathered dtype).
        optimizer_state_per_param: fp32 state tensors per parameter element (Adam/AdamW: 2, SGD with momentum: 1).
        config: engine knobs (persistence thresholds, units, ``offload_optimizer`` / ``offload_params``); default
            ``ZeroConfig(stage=stage)``.
        device_type: the compute device: ``"cuda"`` (an accelerator; offloaded bytes go to the host) or ``"cpu"``
            (everything is host memory). See [Note: where the estimate puts each byte].

    Raises:
        ValueError: neither or both of ``module``/``num_params``; bad sizes or precision; ``stage`` disagreeing with
            ``config.stage``; a unit's shard larger than ``offload_params``' buffer (the engine refuses it too).
    """
    if (module is None) == (num_params is None):
        raise ValueError("estimate_zero_memory: give exactly one of module= or num_params=")
    if world_size < 1:
        raise ValueError(f"estimate_zero_memory: world_size must be >= 1, got {world_size}")
    if precision not in _GATHER_BYTES:
        raise ValueError(f"estimate_zero_memory: precision must be one of {sorted(_GATHER_BYTES)}, got {precision!r}")
    if config is not None and stage is not None and stage != config.stage:
        raise ValueError(
            f"estimate_zero_memory: stage={stage} but config.stage={config.stage}; give the stage in one place"
        )
    config = config or ZeroConfig(stage=stage or 3)
    if module is not None:
        total, persistent, largest = _module_counts(module, config)
    else:
        if num_params is None or num_params < 1:
            raise ValueError(f"estimate_zero_memory: num_params must be >= 1, got {num_params}")
        total, persistent, largest = int(num_params), 0, int(num_params) // 100
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"estimate_zero_memory: device_type must be 'cuda' or 'cpu', got {device_type!r}")
    stage = config.stage
    if stage < 3:
        persistent = total
    shard = math.ceil(total / world_size)
    largest_shard = max(math.ceil(largest / world_size), 1)
    gather = _GATHER_BYTES[precision]
    accelerator = device_type != "cpu"
    state_bytes = 4 * optimizer_state_per_param * shard
    master_bytes = 4 * shard if accelerator else 0  # a second fp32 copy only when the optimizer leaves the device
    param_bytes, nvme_bytes, param_pool_bytes = 4 * shard, 0, 0
    offload_opt, offload_par = config.offload_optimizer, config.offload_params
    if isinstance(offload_opt, NVMeOffload):
        sub = aligned_numel(min(offload_opt.buffer_size, largest_shard), torch.float32)
        optimizer_bytes, nvme_bytes = offload_opt.buffer_count * 4 * sub, state_bytes + master_bytes
    elif isinstance(offload_opt, CPUOffload):
        optimizer_bytes = state_bytes + master_bytes
    else:
        optimizer_bytes = state_bytes
    if isinstance(offload_par, NVMeOffload):
        resident_shard = math.ceil(persistent / world_size) if stage == 3 else shard
        nvme_bytes += 4 * (shard - resident_shard)
        param_bytes = 4 * resident_shard
        if largest_shard > offload_par.buffer_size:  # the engine refuses it too (ParamOffloader)
            raise ValueError(
                f"estimate_zero_memory: with offload_params every unit's shard must fit one buffer, but the largest "
                f"is about {largest_shard:,} elements > NVMeOffload.buffer_size={offload_par.buffer_size:,}; raise "
                f"buffer_size (the parameter pool then holds buffer_count x that) or use smaller units"
            )
        param_pool_bytes = offload_par.buffer_count * max(4 * aligned_numel(largest_shard, torch.float32), 4096)
    resident = param_bytes + 4 * shard + optimizer_bytes + gather * persistent
    return MemoryEstimate(
        param_bytes=param_bytes,
        grad_bytes=4 * shard,
        optimizer_bytes=optimizer_bytes,
        persistent_bytes=gather * persistent,
        largest_unit_bytes=gather * largest,
        device_bytes=resident - (optimizer_bytes if offload_opt is not None else 0) if accelerator else 0,
        host_bytes=(optimizer_bytes if offload_opt is not None else 0) + param_pool_bytes
        if accelerator
        else resident + param_pool_bytes,
        nvme_bytes=nvme_bytes,
    )
