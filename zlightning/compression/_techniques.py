"""Per-module technique state: one small ``nn.Module`` per technique attached to a compressed layer.

Each technique owns its typed state (masks and ``ready`` flags as buffers, learnable scores as parameters), so it is
saved in the model's ``state_dict``, moved with the model and, under ZeRO-3, sharded like any parameter. Techniques
read the layer's weight only when the layer calls them from its forward, where ZeRO-3 has gathered it.

[Note: schedule state]
``step`` is the optimizer step the technique was last told about (`apply_schedule`); -1 means "never scheduled" and
keeps every technique off. A technique is active iff ``step >= schedule_offset``. The step is not saved: Lightning
restores ``global_step`` on resume and the callback re-applies it before the first batch.

[Note: masks are computed when they start]
An ``l1`` mask is computed from the weights on the first forward in which it is active (DeepSpeed computed it once at
``init_compression``, from weights that may then train for ``schedule_offset`` more steps). It is then stored in the
``mask`` buffer and fixed. A ``topk`` mask follows its learnable scores on every forward (straight-through gradient
to the scores) until ``freeze_after`` (sparse ``schedule_offset_end``), then the last mask stays.

[Note: static ranges under data parallelism]
A static activation range is a moving average of each training batch's min and max. Under data parallelism each rank
sees a slice of the batch: with its own min/max the ranks' ranges drift apart (zstack_zero3 never broadcasts buffers,
so the replicas quantize differently; DDP copies rank 0's range, seen from half the batch). With ``sync_ranges`` the
min and max are reduced over all ranks (one 2-element all-reduce per layer and training forward, which every rank
runs in data-parallel training), so the range is the global batch's, as one process computes it. Every rank must run
the same training forwards; evaluation does not update the range and runs no collective.

[Note: scores always in the graph]
Learnable scores that are not used in a forward (before the offset, or once frozen) are added as ``0 * scores.sum()``
so DDP sees a gradient for every parameter without ``find_unused_parameters=True``; the values are unchanged.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zlightning.compression._quantize import Scheme, fake_quantize, scheduled_bits

__all__ = ["ActivationQuantizer", "Mask", "MaskKind", "ScheduledTechnique", "WeightQuantizer", "topk_mask"]

MaskKind = Literal["sparse", "row", "head", "channel"]


class _TopKBinarizer(torch.autograd.Function):
    """Forward: 1 for the ``k`` largest scores, else 0. Backward: the gradient passes straight to the scores."""

    @staticmethod
    def forward(ctx: object, scores: Tensor, k: int) -> Tensor:  # type: ignore[override]
        flat = scores.detach().flatten()
        mask = torch.zeros_like(flat)
        mask[torch.topk(flat, k, sorted=False).indices] = 1.0
        return mask.view_as(scores)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def topk_mask(scores: Tensor, dense_ratio: float) -> Tensor:
    """Binary mask keeping exactly ``ceil(dense_ratio * scores.numel())`` entries, straight-through to ``scores``."""
    k = min(scores.numel(), max(1, math.ceil(dense_ratio * scores.numel())))
    return _TopKBinarizer.apply(scores, k)


class ScheduledTechnique(nn.Module):
    """Base: a technique switched on from ``schedule_offset`` on. See [Note: schedule state]."""

    technique: str = ""
    schedule_offset: int
    step: int

    def __init__(self, schedule_offset: int) -> None:
        super().__init__()
        self.schedule_offset = schedule_offset
        self.step = -1

    @property
    def active(self) -> bool:
        return self.step >= self.schedule_offset

    def set_step(self, step: int) -> None:
        self.step = step


class WeightQuantizer(ScheduledTechnique):
    """Fake-quantizes a weight at the scheduled bit width (`scheduled_bits`), straight-through gradient."""

    technique = "weight_quantization"

    def __init__(
        self,
        *,
        schedule_offset: int,
        start_bits: int,
        target_bits: int,
        period: int,
        scheme: Scheme,
        num_groups: int,
        stochastic: bool = False,
    ) -> None:
        super().__init__(schedule_offset)
        self.start_bits, self.target_bits, self.period = start_bits, target_bits, period
        self.scheme, self.num_groups, self.stochastic = scheme, num_groups, stochastic

    @property
    def bits(self) -> int:
        """The current bit width (``start_bits`` before the offset; the schedule after)."""
        return scheduled_bits(max(0, self.step - self.schedule_offset), self.start_bits, self.target_bits, self.period)

    def forward(self, weight: Tensor) -> Tensor:
        if not self.active:
            return weight
        stochastic = self.stochastic and self.training and self.bits >= 3
        return fake_quantize(weight, self.bits, self.scheme, self.num_groups, stochastic)

    def extra_repr(self) -> str:
        return f"bits={self.start_bits}->{self.target_bits}, {self.scheme}, groups={self.num_groups}"


class ActivationQuantizer(ScheduledTechnique):
    """Fake-quantizes a layer's input: per token/sample ranges (dynamic) or one moving-average range (static)."""

    technique = "activation_quantization"
    x_min_max: Tensor  # [2] float32: running (min, max), static calibration only
    initialized: Tensor  # [] bool

    def __init__(
        self,
        *,
        schedule_offset: int,
        bits: int,
        scheme: Scheme,
        calibration: str,
        per_sample: bool,
        momentum: float = 0.95,
        device: torch.device | None = None,
    ) -> None:
        super().__init__(schedule_offset)
        self.bits, self.scheme, self.calibration = bits, scheme, calibration
        self.per_sample, self.momentum = per_sample, momentum
        self.sync_ranges = False
        """Static calibration: take the min/max of the whole data-parallel batch (all ranks); see [Note: static ranges
        under data parallelism]. Set by the Lightning callbacks when the Trainer has more than one process."""
        # on the layer's device, as `Mask`'s buffers: without it a layer compressed inside
        # `zlightning.zero.deferred_init` (zstack_zero3, a module overriding configure_model) got meta buffers next to
        # its real weight, which the strategy cannot move to its device
        self.register_buffer("x_min_max", torch.zeros(2, device=device))
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool, device=device))

    def forward(self, x: Tensor) -> Tensor:
        if not self.active:
            return x
        if self.calibration == "dynamic":
            groups = x.shape[0] if self.per_sample else x.numel() // x.shape[-1]
            return fake_quantize(x, self.bits, self.scheme, groups)
        if self.training:
            with torch.no_grad():
                now = torch.stack([x.min(), x.max()]).float()
                if self.sync_ranges and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                    # See [Note: static ranges under data parallelism].
                    neg_min_max = torch.stack([-now[0], now[1]])
                    dist.all_reduce(neg_min_max, op=dist.ReduceOp.MAX)
                    now = torch.stack([-neg_min_max[0], neg_min_max[1]])
                ema = self.momentum * self.x_min_max + (1 - self.momentum) * now
                self.x_min_max.copy_(torch.where(self.initialized, ema, now))
                self.initialized.fill_(True)
        lo, hi = self.x_min_max[0].clamp(max=0), self.x_min_max[1].clamp(min=0)
        if self.scheme == "symmetric":
            qmax = 2 ** (self.bits - 1) - 1
            scale = (torch.maximum(-lo, hi) / qmax).clamp(min=1e-12)
            q = torch.clamp(torch.round(x.detach() / scale), -qmax, qmax) * scale
        else:
            scale = ((hi - lo) / (2**self.bits - 1)).clamp(min=1e-12)
            zp = torch.round(-lo / scale)
            q = (torch.clamp(torch.round(x.detach() / scale) + zp, 0, 2**self.bits - 1) - zp) * scale
        return x + (q.to(x.dtype) - x).detach()


class Mask(ScheduledTechnique):
    """A pruning mask over weight elements (sparse), output rows (row), attention heads (head) or conv output
    channels (channel). See [Note: masks are computed when they start].
    """

    mask: Tensor  # score shape (see _score_shape), float 0/1
    ready: Tensor  # [] bool: mask holds a computed mask
    scores: nn.Parameter | None  # score shape, topk only

    def __init__(
        self,
        *,
        kind: MaskKind,
        method: str,
        dense_ratio: float,
        schedule_offset: int,
        weight: Tensor,
        num_heads: int = 1,
        freeze_after: int | None = None,
        related: tuple[str, ...] = (),
    ) -> None:
        super().__init__(schedule_offset)
        self.technique = f"{kind}_pruning"
        self.kind, self.method, self.dense_ratio = kind, method, dense_ratio
        self.num_heads, self.freeze_after, self.related = num_heads, freeze_after, related
        shape = self._score_shape(weight)
        self.register_buffer("mask", torch.ones(shape, device=weight.device))
        self.register_buffer("ready", torch.zeros((), dtype=torch.bool, device=weight.device))
        self.scores = None
        if method == "topk":
            # on a meta weight too: inside `zlightning.zero.deferred_init` (a model built in ``configure_model``
            # under zstack_zero3) the computation is recorded and replayed with the weight's real values
            self.scores = nn.Parameter(self.l1_scores(weight).detach().clone().float())

    def _score_shape(self, weight: Tensor) -> tuple[int, ...]:
        if self.kind == "sparse":
            return tuple(weight.shape)
        if self.kind == "head":
            return (self.num_heads,)
        return (weight.shape[0],)

    def l1_scores(self, weight: Tensor) -> Tensor:
        """Importance of each unit: |w| (sparse), the L1 norm of each row/channel, or of each head's input columns."""
        w = weight.detach().abs().float()
        if self.kind == "sparse":
            return w
        if self.kind == "head":
            return w.reshape(w.shape[0], self.num_heads, -1).sum(dim=(0, 2))
        return w.reshape(w.shape[0], -1).sum(dim=1)

    @property
    def learning(self) -> bool:
        """Whether the mask still follows the topk scores (active, topk, not past ``freeze_after``)."""
        return self.active and self.scores is not None and (self.freeze_after is None or self.step <= self.freeze_after)

    def current(self, weight: Tensor) -> Tensor:
        """The mask in score shape (0/1), computing and storing it when needed."""
        if self.learning:
            m = topk_mask(self.scores, self.dense_ratio)  # type: ignore[arg-type]
            with torch.no_grad():
                self.mask.copy_(m)
                self.ready.fill_(True)
            return m
        if not bool(self.ready):
            with torch.no_grad():
                scores = self.scores if self.scores is not None else self.l1_scores(weight)
                self.mask.copy_(topk_mask(scores.detach(), self.dense_ratio))
                self.ready.fill_(True)
        return self.mask

    def expand(self, m: Tensor, weight: Tensor) -> Tensor:
        """Broadcasts a score-shaped mask onto the weight."""
        if self.kind == "sparse":
            return m
        if self.kind == "head":
            return m.repeat_interleave(weight.shape[1] // self.num_heads)[None, :]
        return m.reshape(-1, *([1] * (weight.dim() - 1)))

    def forward(self, weight: Tensor) -> tuple[Tensor, Tensor | None]:
        """``(masked weight, score-shaped mask)``; the mask is None while the technique is off."""
        if not self.active:
            # See [Note: scores always in the graph].
            return (weight if self.scores is None else weight + 0 * self.scores.sum()), None
        m = self.current(weight)
        out = weight * self.expand(m, weight).to(weight.dtype)
        if self.scores is not None and not self.learning:
            out = out + 0 * self.scores.sum()
        return out, m

    def keep_index(self) -> Tensor:
        """Indices of kept units (rows/channels/heads) of a computed mask."""
        return torch.nonzero(self.mask.flatten() > 0).flatten()

    def extra_repr(self) -> str:
        return f"kind={self.kind}, method={self.method}, dense_ratio={self.dense_ratio}, related={list(self.related)}"
