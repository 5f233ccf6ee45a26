"""Lazy layer descriptions: ``LayerSpec`` (build later, only on the stage that owns the layer) and ``TiedLayerSpec``
(one module shared by several positions, possibly on different stages, whose gradients are summed across them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["LayerSpec", "TiedLayerSpec"]


class LayerSpec:
    """A layer described by its class and constructor arguments, built only on the rank that runs it.

    ``LayerSpec(nn.Linear, 16, 32, bias=False)`` builds ``nn.Linear(16, 32, bias=False)`` when its stage is
    materialised. Same signature as DeepSpeed's ``LayerSpec``.

    Raises:
        TypeError: ``typename`` is not an ``nn.Module`` subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec expects an nn.Module subclass as its first argument, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, device: torch.device | str | None = None) -> nn.Module:
        """Instantiates the layer (on ``device`` if given, e.g. ``"meta"`` to count parameters for free)."""
        if device is None:
            return self.typename(*self.module_args, **self.module_kwargs)
        with torch.device(device):
            return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer shared by every spec with the same ``key`` (e.g. a GPT's embedding reused as its output head).

    Each stage that holds one of the positions builds the module once; the owning stages start from the same weights
    (broadcast from the lowest owning stage) and the gradients of all the module's parameters are summed over them
    before the optimizer step, so the copies stay identical (DeepSpeed ties ``tied_weight_attr`` only; see [Note: a
    tied module is one module] in ``_module.py``).

    Args:
        key: identifies the tie group.
        typename: as ``LayerSpec``.
        module_args: as ``LayerSpec``.
        module_kwargs: as ``LayerSpec``.
        forward_fn: ``forward_fn(module, inputs)`` to run this position differently (e.g. the head multiplies by
            ``module.weight``); default: ``module(inputs)``.
        tied_weight_attr: names (dotted paths allowed) of the parameters the positions share (DeepSpeed's
            argument; checked to exist). The module's other parameters are kept identical across stages too.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[nn.Module, Any], Any] | None = None,
        tied_weight_attr: str | tuple[str, ...] | list[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ValueError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = (tied_weight_attr,) if isinstance(tied_weight_attr, str) else tuple(tied_weight_attr)

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"
