"""Per-rank model-state memory estimate for ZeRO stages 1-3 (DeepSpeed's ``estimate_zero3_model_states_mem_needs``).

It follows the engine's own accounting (``MemoryReport``): fp32 master shards, fp32 sharded gradients, the optimizer's
per-element state (Adam: two fp32 moments) for this rank's shard, and the gathered copies that stay resident between
steps (persistent small parameters at stage 3, every parameter at stages 1-2) in the gather dtype. Given a module (it
may live on the meta device) the persistent set and the largest unit come from the same rules the engine applies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

from torch import nn

from zlightning.zero._config import ZeroConfig
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
    stage: Literal[1, 2, 3] = 3,
    precision: str = "32-true",
    optimizer_state_per_param: int = 2,
    config: ZeroConfig | None = None,
) -> MemoryEstimate:
    """Estimates one rank's model-state memory.

    Args:
        world_size: data-parallel ranks.
        module: the model (meta device is fine); gives the persistent set and largest unit exactly.
        num_params: instead of ``module``: a parameter count (persistent and unit sizes then assumed 0 and P/100).
        stage: ZeRO stage.
        precision: the Trainer's precision (sets the gathered dtype).
        optimizer_state_per_param: fp32 state tensors per parameter element (Adam/AdamW: 2, SGD with momentum: 1).
        config: engine knobs (persistence thresholds, units); default ``ZeroConfig()``.

    Raises:
        ValueError: neither or both of ``module``/``num_params``; bad sizes or precision.
    """
    if (module is None) == (num_params is None):
        raise ValueError("estimate_zero_memory: give exactly one of module= or num_params=")
    if world_size < 1:
        raise ValueError(f"estimate_zero_memory: world_size must be >= 1, got {world_size}")
    if precision not in _GATHER_BYTES:
        raise ValueError(f"estimate_zero_memory: precision must be one of {sorted(_GATHER_BYTES)}, got {precision!r}")
    config = config or ZeroConfig(stage=stage)
    if module is not None:
        total, persistent, largest = _module_counts(module, config)
    else:
        if num_params is None or num_params < 1:
            raise ValueError(f"estimate_zero_memory: num_params must be >= 1, got {num_params}")
        total, persistent, largest = int(num_params), 0, int(num_params) // 100
    if stage < 3:
        persistent = total
    shard = math.ceil(total / world_size)
    gather = _GATHER_BYTES[precision]
    return MemoryEstimate(
        param_bytes=4 * shard,
        grad_bytes=4 * shard,
        optimizer_bytes=4 * optimizer_state_per_param * shard,
        persistent_bytes=gather * persistent,
        largest_unit_bytes=gather * largest,
    )
