"""Sharded initialisation: the full initial value of one meta-device parameter, computed locally and identically on
every rank and at every world size.

[Note: sharded initialisation]
A model built on the meta device (Lightning's ``configure_model`` under the strategy, ``deferred_init()`` or
``torch.device("meta")``) costs no memory. Each group then materialises, one parameter at a time, only the values it
needs, copies this rank's slice into its flat layout, and drops them; peak memory is one group's flat layout (one
unit), not the model. Where the values come from, in order:

1. ``param_init_fn(module)`` when the user gives one (explicit wins);
2. the recording of the build, when the model was built under ``deferred_init`` (the strategy's ``configure_model``):
   the exact values an unsharded build of the same seeded code would have (see [Note: recorded initialisation]);
3. the module's ``reset_parameters()`` under a seed derived from the run's seed and the module's qualified name (a
   model built under a plain ``torch.device("meta")``).

Every rank and every world size gets the same values in each case.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zlightning.zero._deferred import InitRecording
from zlightning.zero._param import ZeroParam

__all__ = ["ParamInitFn", "ShardedInit"]

ParamInitFn = Callable[[nn.Module], None]
"""Initialises one module's own (non-recursive) parameters in place, like ``nn.Linear.reset_parameters``."""


class ShardedInit:
    """Initial values of meta-device parameters (see [Note: sharded initialisation]); caches one module's values."""

    def __init__(
        self,
        device: torch.device,
        param_init_fn: ParamInitFn | None,
        process_group: dist.ProcessGroup | None,
        global_src: int,
        recording: InitRecording | None = None,
    ) -> None:
        self.device = device
        self.param_init_fn = param_init_fn
        self.recording = recording  # parameters: only without param_init_fn (explicit wins); buffers: always
        self.seed = _shared_seed(process_group, global_src)
        if self.recording is not None:
            self.recording.synchronize(process_group, global_src)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}

    def recorded_value(self, t: torch.Tensor) -> torch.Tensor | None:
        """``t``'s value replayed from the build's recording on this engine's device, or None when not recorded."""
        if self.recording is None:
            return None
        value = self.recording.materialize(t)
        return None if value is None else value.to(self.device)

    def initial_value(self, zp: ZeroParam) -> torch.Tensor:
        """Full initial value of ``zp`` (replayed, or computed for its whole module on first use)."""
        value = self.recorded_value(zp.original) if self.param_init_fn is None else None
        if value is not None:
            return value
        module, name = zp.slots[0]
        key = id(module)
        if key not in self._cache:
            self._cache = {key: self._init_module(module, zp.fqn[: -len(name)].rstrip("."))}
        return self._cache[key][name]

    def done(self) -> None:
        """Drops the cached values (after every group has its shard)."""
        self._cache = {}

    def _init_module(self, module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
        originals = dict(module._parameters)
        for n, p in originals.items():
            if p is not None:
                module._parameters[n] = nn.Parameter(torch.empty_like(p, device=self.device), p.requires_grad)
        for n, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[n] = torch.empty_like(b, device=self.device)
        seed = (self.seed * 1_000_003 + _stable_hash(prefix)) % (2**63)
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(seed)
            if self.param_init_fn is not None:
                self.param_init_fn(module)
            elif hasattr(module, "reset_parameters"):
                module.reset_parameters()  # type: ignore[operator]
            else:
                raise ValueError(
                    f"parameters of {prefix or '<root>'} ({type(module).__name__}) are on the meta device but the "
                    "module has no reset_parameters() and its construction was not recorded: build the model under "
                    "zlightning.zero.deferred_init() (Lightning's configure_model does) instead of a plain "
                    "torch.device('meta'), or give the ZeRO engine param_init_fn=... (called per module)"
                )
        values = {n: p.detach() for n, p in module._parameters.items() if p is not None}
        module._parameters.update(originals)  # back to meta; buffers stay materialised
        return values


def _shared_seed(process_group: dist.ProcessGroup | None, global_src: int) -> int:
    """The run's seed as rank ``global_src`` sees it (collective when there are several ranks)."""
    seed = torch.tensor([torch.initial_seed() % (2**62)], dtype=torch.int64)
    if dist.get_world_size(process_group) > 1:
        dist.broadcast(seed, src=global_src, group=process_group)
    return int(seed.item())


def _stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
