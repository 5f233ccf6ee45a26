"""Lightning precision plugin for the ZeRO-3 strategy: maps ``Trainer(precision=...)`` onto the engine.

[Note: precision mapping]
The optimizer always steps fp32 master shards. ``bf16-*``/``16-*`` set the engine's gather dtype (the shard is cast
before the all-gather, so half the bytes move) and ``*-mixed`` also enables ``torch.autocast`` so ops that need fp32
get it. Gradients are reduce-scattered in fp32 and accumulated into fp32 shard gradients. fp16 adds dynamic loss
scaling with a global overflow check (one all-reduce) before the step, and a skipped step on overflow. Gradient
clipping by norm uses the global norm across shards; Lightning's default would clip each rank's pieces separately.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch.optim import Optimizer
from typing_extensions import override

from zlightning.zero import DynamicLossScaler, LossScalerConfig, ZeroState, clip_grad_norm_
from zlightning.zero._config import DTypeName
from zlightning.zero._optimizer import unscale_and_check_

__all__ = ["ZeroPrecision", "SUPPORTED_PRECISION"]

SUPPORTED_PRECISION: dict[str, DTypeName | None] = {
    "32-true": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}


class ZeroPrecision(Precision):
    """Precision for ``zstack_zero3``: gather dtype, autocast, fp16 loss scaling, global-norm clipping.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"``, ``"16-true"``.
        loss_scaler: fp16 loss-scaling knobs (ignored for other precisions).

    Raises:
        ValueError: an unsupported precision.
    """

    def __init__(self, precision: str = "32-true", loss_scaler: LossScalerConfig | None = None) -> None:
        precision = str(precision)
        aliases = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}
        precision = aliases.get(precision, precision)
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(
                f"zstack_zero3 supports precision in {sorted(SUPPORTED_PRECISION)}, got {precision!r}. "
                "Pass one of those as Trainer(precision=...)."
            )
        self.precision = precision  # type: ignore[assignment]
        self.param_dtype: DTypeName | None = SUPPORTED_PRECISION[precision]
        self.scaler = DynamicLossScaler(loss_scaler) if self.param_dtype == "fp16" else None
        self.engine: ZeroState | None = None
        self.device = "cpu"

    def _autocast(self) -> Any:
        if not self.precision.endswith("-mixed"):
            return nullcontext()
        dtype = torch.bfloat16 if self.param_dtype == "bf16" else torch.float16
        return torch.autocast(self.device, dtype=dtype, cache_enabled=False)

    @override
    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._autocast():
            yield

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.scaler is not None:
            tensor = tensor * self.scaler.scale
        if self.engine is not None:
            self.engine.expect_backward(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Optimizer, model: pl.LightningModule, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skip = closure_result is None and model.automatic_optimization
        if skip:
            return closure_result
        found_inf = unscale_and_check_(self._engine(), self.main_params(optimizer), 1.0 / self.scaler.scale)
        self._after_closure(model, optimizer)
        self.scaler.update(found_inf)
        if found_inf:
            optimizer.zero_grad(set_to_none=True)
            return closure_result
        return optimizer.step(**kwargs)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_(self._engine(), self.main_params(optimizer), float(clip_val))

    def _engine(self) -> ZeroState:
        if self.engine is None:
            raise RuntimeError("ZeroPrecision is used before the zstack_zero3 strategy sharded the model (setup)")
        return self.engine

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)
