"""Entry point: ``zero3_shard`` turns a module into a ZeRO-3 sharded module in place."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from zlightning.zero._config import ZeroConfig
from zlightning.zero._state import ParamInitFn, ZeroState
from zlightning.zero._unit import UnitPolicy

__all__ = ["zero3_shard"]


def zero3_shard(
    module: nn.Module,
    config: ZeroConfig | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
    unit_policy: UnitPolicy | None = None,
    device: torch.device | None = None,
    param_init_fn: ParamInitFn | None = None,
) -> ZeroState:
    """Shards ``module``'s parameters across the data-parallel ranks (ZeRO stage 3), in place.

    The algorithm: parameters are grouped into *units* (by default each repeated block, plus a root unit for the
    rest and a group of small "persistent" parameters); each unit's parameters are flattened, padded to a multiple of
    the world size, and each rank keeps one contiguous slice (fp32 master). Before a unit's forward its parameters
    are all-gathered into one buffer (prefetching the next unit), and released after; before its backward they are
    gathered again, and once its gradients exist they are reduce-scattered (averaged over ranks) into the shards'
    gradients and released. Modules then hold 1-D shard pieces as parameters, which any torch optimizer can step:
    build the optimizer before calling this and use ``attach_optimizer``, or build it over ``module.parameters()``
    after.

    Args:
        module: the model, on its device, identical on every rank (or ``config.sync_module_states``).
        config: knobs (``ZeroConfig``).
        process_group: data-parallel group (default: the world).
        unit_policy: ``policy(name, module) -> bool`` to choose units in code.
        device: where shards live (default: the module's device). Required for a model on the meta device.
        param_init_fn: for a meta-device model, initialises one module's own parameters (default: the values
            recorded by ``deferred_init()`` when the model was built under it, else the module's
            ``reset_parameters()``). Each rank then materialises only its shards.

    Returns:
        The engine state (``ZeroState``): pass it to ``attach_optimizer``, ``full_state_dict``, ``memory_report``...

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: ``config.unit_modules`` names classes the model does not contain.
    """
    return ZeroState(
        module, config or ZeroConfig(), process_group, unit_policy, device=device, param_init_fn=param_init_fn
    )
