"""Quantizers (pure tensor functions): integer codes + scales, fake quantization with a straight-through gradient,
bit packing for export, and the start->target bit schedule.

Tensors are quantized in ``num_groups`` equal groups (the flattened tensor reshaped to ``[num_groups, -1]``), each with
its own scale (and zero point). Shape suffixes: G = groups, E = elements per group.

[Note: quantizer grids]
* Symmetric, b >= 3 bits: ``scale = max|x| / (2^(b-1) - 1)``, codes in ``[-(2^(b-1)-1), 2^(b-1)-1]``, so the error is
  at most ``scale / 2`` everywhere and the largest element is exact. DeepSpeed used ``scale = 2 max|x| / 2^b`` and
  clipped a positive maximum by one step; we give up one code (-2^(b-1)) to never clip.
* Asymmetric: the range is widened to contain 0 (``lo = min(min x, 0)``, ``hi = max(max x, 0)``) with an integer zero
  point, so 0 is exact: pruned (zeroed) weights stay zero after quantization.
* Ternary (2 bits): ``thr = 0.7 mean|x|``, ``alpha = mean(|x| over |x| > thr)``, codes in {-1, 0, 1}.
* Binary (1 bit): ``alpha = mean|x|``, codes in {-1, 1} (0 maps to +1).
* `dequantize` is the only place codes turn into values, and `fake_quantize` calls it: the training forward, a
  cleaned model and a model loaded from an export see bit-identical weights.

[Note: native quantize kernels]
Symmetric int8/int4 fake quantization (the common QAT case) goes through ``zlightning.kernels.quantize`` /
``dequantize`` when their compiled CPU op is built, or on CUDA: the kernels use the same grid (``scale = absmax /
qmax``, codes clamped to ``[-qmax, qmax]``, round half to even, fp32 arithmetic) over the same contiguous groups, so
their values are bit-identical to `dequantize_weight(quantize_weight(...))` (a test checks it) and about an order of magnitude
faster on CPU. Everything else (asymmetric, other widths, stochastic rounding, group sizes the kernels reject, no
kernels built) uses the PyTorch code here; the straight-through gradient is the same either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = [
    "QuantizedWeight",
    "dequantize_weight",
    "fake_quantize",
    "pack_codes",
    "quantize_weight",
    "scheduled_bits",
    "unpack_codes",
]

Scheme = Literal["symmetric", "asymmetric"]


@dataclass(frozen=True)
class QuantizedWeight:
    """Integer codes of a tensor with per-group scales (and zero points for asymmetric)."""

    codes: Tensor
    """int32 codes, shape [G, E]."""
    scale: Tensor
    """float32, shape [G, 1]."""
    zero_point: Tensor | None
    """float32 integer-valued zero points [G, 1] (asymmetric only)."""
    bits: int
    scheme: Scheme
    shape: tuple[int, ...]
    """Shape of the original tensor."""
    dtype: torch.dtype
    """dtype of the original tensor (the dequantized tensor's dtype)."""

    @property
    def code_offset(self) -> int:
        """Added to codes to make them unsigned (``0 .. 2^bits - 1``) for packing."""
        if self.scheme == "asymmetric":
            return 0
        return 1 if self.bits <= 2 else 2 ** (self.bits - 1) - 1


def _grouped(x: Tensor, num_groups: int) -> Tensor:
    if num_groups < 1 or x.numel() % num_groups != 0:
        raise ValueError(
            f"cannot split a tensor of shape {tuple(x.shape)} ({x.numel()} elements) into {num_groups} equal "
            "quantization groups; choose quantize_groups dividing the number of elements (e.g. the row count)."
        )
    return x.detach().reshape(num_groups, -1).float()


def quantize_weight(
    x: Tensor, bits: int, scheme: Scheme = "symmetric", num_groups: int = 1, stochastic: bool = False
) -> QuantizedWeight:
    """Integer codes and scales of ``x``; see [Note: quantizer grids].

    Args:
        x: Any float tensor.
        bits: 1 (binary), 2 (ternary) or 3..16 (uniform).
        scheme: ``"symmetric"`` or ``"asymmetric"`` (uniform grids only).
        num_groups: Number of equal groups, each with its own scale.
        stochastic: Stochastic rounding (uniform grids only; training).

    Raises:
        ValueError: For a group count that does not divide ``x.numel()``, bits out of range, or an asymmetric
            ternary/binary request.
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"quantize: bits must be in [1, 16], got {bits}.")
    if bits <= 2 and scheme != "symmetric":
        raise ValueError(f"quantize: {bits}-bit (ternary/binary) quantization is symmetric only, got {scheme!r}.")
    x_GE = _grouped(x, num_groups)
    zero_point = None
    if bits == 1:
        scale = x_GE.abs().mean(dim=1, keepdim=True)
        codes = torch.where(x_GE >= 0, 1, -1)
    elif bits == 2:
        thr = 0.7 * x_GE.abs().mean(dim=1, keepdim=True)
        keep = x_GE.abs() > thr
        scale = (x_GE.abs() * keep).sum(dim=1, keepdim=True) / keep.sum(dim=1, keepdim=True).clamp(min=1)
        codes = torch.sign(x_GE) * keep
    else:
        noise = (torch.rand_like(x_GE) - 0.5) if stochastic else 0.0
        if scheme == "symmetric":
            qmax = 2 ** (bits - 1) - 1
            scale = (x_GE.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=torch.finfo(torch.float32).tiny)
            codes = torch.clamp(torch.round(x_GE / scale + noise), -qmax, qmax)
        else:
            lo = x_GE.amin(dim=1, keepdim=True).clamp(max=0)
            hi = x_GE.amax(dim=1, keepdim=True).clamp(min=0)
            scale = ((hi - lo) / (2**bits - 1)).clamp(min=torch.finfo(torch.float32).tiny)
            zero_point = torch.round(-lo / scale)
            codes = torch.clamp(torch.round(x_GE / scale + noise) + zero_point, 0, 2**bits - 1)
    return QuantizedWeight(codes.to(torch.int32), scale, zero_point, bits, scheme, tuple(x.shape), x.dtype)


def dequantize_weight(q: QuantizedWeight) -> Tensor:
    """Values of ``q`` in its original shape and dtype."""
    codes = q.codes.float()
    if q.zero_point is not None:
        codes = codes - q.zero_point
    return (codes * q.scale).reshape(q.shape).to(q.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the quantized values; backward: the gradient unchanged (d out / d x = 1)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, q: Tensor) -> Tensor:  # type: ignore[override]
        return q

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad, None


def _kernel_fake_quantize(x: Tensor, bits: int, num_groups: int) -> Tensor | None:
    """Symmetric int8/int4 values from the native kernels, or None where they do not apply; see
    [Note: native quantize kernels]."""
    if bits not in (4, 8) or num_groups < 1 or x.numel() % num_groups or not x.is_floating_point():
        return None
    group_size = x.numel() // num_groups
    if bits == 4 and group_size % 2:
        return None
    try:
        from zlightning.kernels import _ext
        from zlightning.kernels import dequantize as kernel_dequantize
        from zlightning.kernels import quantize as kernel_quantize
    except ImportError:
        return None
    built = getattr(_ext, "available", None)  # the kernels' "compiled op loaded" probe
    if not (x.is_cuda or (x.device.type == "cpu" and callable(built) and built())):
        return None
    return kernel_dequantize(kernel_quantize(x.detach(), bits, group_size, True), x.dtype)


def fake_quantize(
    x: Tensor, bits: int, scheme: Scheme = "symmetric", num_groups: int = 1, stochastic: bool = False
) -> Tensor:
    """``dequantize_weight(quantize_weight(x))`` with a straight-through gradient to ``x``; see [Note: native quantize kernels]."""
    q = _kernel_fake_quantize(x, bits, num_groups) if scheme == "symmetric" and not stochastic else None
    if q is None:
        q = dequantize_weight(quantize_weight(x, bits, scheme, num_groups, stochastic))
    return _StraightThrough.apply(x, q)


def _container_bits(bits: int) -> int:
    return 1 if bits == 1 else 2 if bits == 2 else 4 if bits <= 4 else 8


def pack_codes(q: QuantizedWeight) -> Tensor:
    """Codes as a flat uint8 tensor, ``8 // c`` codes per byte for container width c in {1, 2, 4, 8} (3-bit codes go in
    4-bit slots, 5..8-bit codes in bytes). For bits > 8 an int16 tensor is returned instead.
    """
    unsigned = ((q.codes + 1) // 2 if q.bits == 1 else q.codes + q.code_offset).flatten()  # binary: {-1, 1} -> {0, 1}
    if q.bits > 8:
        return (unsigned - 2**15).to(torch.int16)
    width = _container_bits(q.bits)
    per = 8 // width
    u = unsigned.to(torch.uint8)
    pad = (-u.numel()) % per
    u = torch.cat([u, u.new_zeros(pad)]).reshape(-1, per)
    out = torch.zeros(u.shape[0], dtype=torch.uint8)
    for i in range(per):
        out |= u[:, i] << (width * i)
    return out


def unpack_codes(packed: Tensor, bits: int, numel: int, offset: int) -> Tensor:
    """Inverse of `pack_codes`: signed int32 codes, flat, ``numel`` long."""
    if bits > 8:
        return packed.to(torch.int32)[:numel] + 2**15 - offset
    width = _container_bits(bits)
    per = 8 // width
    mask = (1 << width) - 1
    cols = [(packed >> (width * i)) & mask for i in range(per)]
    unsigned = torch.stack(cols, dim=1).flatten()[:numel].to(torch.int32)
    return 2 * unsigned - 1 if bits == 1 else unsigned - offset


def scheduled_bits(steps_since_start: int, start_bits: int, target_bits: int, period: int) -> int:
    """Bits after ``steps_since_start`` optimizer steps of the bit schedule.

    One bit is dropped when the count reaches ``period``, then at ``2 period``, ``4 period``, ... (the period doubles
    after each drop), never below ``target_bits``: start 12, target 8, period 50 gives 11 at 50, 10 at 100, 9 at 200
    and 8 from 400 on.
    """
    bits, threshold = start_bits, period
    while bits > target_bits and steps_since_start >= threshold:
        bits -= 1
        threshold *= 2
    return bits
