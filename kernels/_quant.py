"""Group-wise int8 / packed-int4 quantization: `quantize`, `dequantize`, their PyTorch references, CUDA/Triton path.

[Note: quantized layout]
The input is flattened and cut into groups of ``group_size`` elements (the last group may be short). Per group:

* symmetric: ``scale = absmax / qmax`` with ``qmax = 127`` (int8) or ``7`` (int4); ``q = clamp(round(x / scale),
  -qmax, qmax)``; ``x ~= q * scale``; ``offset`` is 0.
* asymmetric: ``scale = (max - min) / qmax`` with ``qmax = 255`` or ``15``, ``offset = min``;
  ``q = clamp(round((x - offset) / scale), 0, qmax)``; ``x ~= q * scale + offset``.

A zero range gives ``scale = 1``. A group holding a NaN or an infinity gets ``scale = NaN`` (``offset = NaN`` when
asymmetric) and zero codes, so it dequantizes to NaN: a non-finite input is never hidden behind finite values.
Rounding is half-to-even; arithmetic is fp32 whatever the input dtype.
``data`` has shape ``[groups, group_size * bits / 8]``: int8 for symmetric 8-bit, uint8 otherwise; 4-bit codes
are packed two per byte, element ``2k`` in the low nibble (two's complement for symmetric). Padding codes of the
last group are 0. The compiled CPU kernel, the CUDA path and the reference produce identical bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from zlightning.kernels import _ext

__all__ = ["QuantizedTensor", "dequantize", "dequantize_reference", "quantize", "quantize_reference"]


@dataclass(frozen=True)
class QuantizedTensor:
    """A group-wise quantized tensor; see [Note: quantized layout]."""

    data: torch.Tensor
    """Codes, ``[groups, group_size * bits // 8]``, int8 (symmetric 8-bit) or uint8."""
    scale: torch.Tensor
    """fp32 ``[groups]``."""
    offset: torch.Tensor
    """fp32 ``[groups]`` (zeros when symmetric)."""
    bits: int
    group_size: int
    symmetric: bool
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus scales and offsets."""
        return self.data.numel() * self.data.element_size() + 4 * (self.scale.numel() + self.offset.numel())


def _check(x: torch.Tensor, bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"quantize: bits={bits!r}; supported are 8 (int8) and 4 (packed int4).")
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size <= 0
        or (bits == 4 and group_size % 2)
    ):
        raise ValueError(f"quantize: group_size={group_size!r} must be a positive integer (even for 4 bits).")
    if not x.is_floating_point():
        raise TypeError(f"quantize: expected a floating-point tensor, got {x.dtype}.")


def _qrange(bits: int, symmetric: bool) -> tuple[float, float]:
    qmax = float(2 ** (bits - 1) - 1) if symmetric else float(2**bits - 1)
    return (-qmax if symmetric else 0.0), qmax


def quantize_reference(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-PyTorch quantization (any device); returns ``(data, scale, offset)`` as the native op does."""
    n = x.numel()
    groups = -(-n // group_size)
    flat = x.reshape(-1).float()
    pad = groups * group_size - n
    if pad:  # repeat the last element: min, max and absmax of the last group are unchanged
        flat = torch.cat([flat, flat[-1:].expand(pad)])
    g = flat.view(groups, group_size)
    qmin, qmax = _qrange(bits, symmetric)
    if symmetric:
        scale = g.abs().amax(1) / qmax if groups else g.new_empty(0)
        offset = torch.zeros_like(scale)
    else:
        offset = g.amin(1) if groups else g.new_empty(0)
        scale = ((g.amax(1) - offset) / qmax) if groups else g.new_empty(0)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((g - offset[:, None]) / scale[:, None]).clamp_(qmin, qmax).nan_to_num_(0.0).to(torch.int32)
    if pad:
        q.view(-1)[n:] = 0
    scale, offset = _poison_nonfinite(~torch.isfinite(g).all(1), q, scale, offset, symmetric)
    return _pack(q, bits, symmetric), scale, offset


def _poison_nonfinite(
    bad: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups flagged ``bad`` (holding NaN or +-inf) get NaN scale (and offset when asymmetric) and zero codes
    (``codes`` is changed in place); see [Note: quantized layout]."""
    if not bool(bad.any()):
        return scale, offset
    codes[bad] = 0
    nan = torch.full_like(scale, float("nan"))
    return torch.where(bad, nan, scale), (offset if symmetric else torch.where(bad, nan, offset))


def _pack(codes: torch.Tensor, bits: int, symmetric: bool) -> torch.Tensor:
    """int32 codes ``[groups, group_size]`` to the stored layout: int8/uint8, or two 4-bit codes per byte."""
    if bits == 8:
        return codes.to(torch.int8) if symmetric else codes.to(torch.uint8)
    nib = codes & 0xF
    return (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)


def dequantize_reference(
    data: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Pure-PyTorch inverse of `quantize_reference`; returns a flat tensor of ``numel`` elements of ``dtype``."""
    if bits == 8:
        q = data.to(torch.int32)
    else:
        b = data.to(torch.int32)
        q = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(data.shape[0], 2 * data.shape[1])
        if symmetric:
            q = (q ^ 8) - 8
    f = q.float() * scale.float()[:, None]
    if not symmetric:
        f = f + offset.float()[:, None]
    return f.reshape(-1)[:numel].to(dtype)


def quantize(x: torch.Tensor, bits: int = 8, group_size: int = 128, symmetric: bool = True) -> QuantizedTensor:
    """Group-wise quantization of a floating-point tensor to int8 or packed int4 (see [Note: quantized layout]).

    CPU tensors use the compiled kernel when built (else the PyTorch reference, with one warning); CUDA tensors use
    the Triton kernel when triton is installed, else the reference on the GPU.

    Args:
        x: fp32/bf16/fp16 tensor of any shape, on CPU or CUDA.
        bits: 8 or 4.
        group_size: elements per scale (even for 4 bits).
        symmetric: symmetric (zero-centred) or asymmetric (min/max) ranges.

    Returns:
        a `QuantizedTensor`; `dequantize` restores ``x``'s shape and dtype.

    Raises:
        ValueError / TypeError: unsupported bits, group size or dtype.
    """
    _check(x, bits, group_size)
    if _ext.available() and x.device.type in ("cpu", "cuda"):
        data, scale, offset = torch.ops.zlightning.quantize(x.contiguous(), bits, group_size, symmetric)
    elif x.device.type == "cuda":
        data, scale, offset = quantize_cuda(x, bits, group_size, symmetric)
    else:
        _ext.warn_fallback("quantize")
        data, scale, offset = quantize_reference(x, bits, group_size, symmetric)
    return QuantizedTensor(data, scale, offset, bits, group_size, symmetric, x.shape, x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Restores a `QuantizedTensor` to its shape, in ``dtype`` (default: the original dtype)."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"dequantize: expected a QuantizedTensor from zlightning.kernels.quantize, got {type(q)}.")
    dtype = dtype or q.dtype
    numel = q.shape.numel()
    args = (q.data, q.scale, q.offset, q.bits, q.group_size, q.symmetric, numel, dtype)
    if _ext.available() and q.data.device.type in ("cpu", "cuda"):
        out = torch.ops.zlightning.dequantize(*args)
    elif q.data.device.type == "cuda":
        out = dequantize_cuda(*args)
    else:
        _ext.warn_fallback("dequantize")
        out = dequantize_reference(*args)
    return out.view(q.shape)


# ---- CUDA -------------------------------------------------------------------------------------------------------
def _triton_quantize():
    try:
        import triton
        import triton.language as tl
        from triton.language.extra import libdevice
    except ImportError:
        return None

    @triton.jit
    def kernel(
        x_ptr, q_ptr, scale_ptr, offset_ptr, n, group_size, qmin, qmax, SYMMETRIC: tl.constexpr, BLOCK: tl.constexpr
    ):
        g = tl.program_id(0)
        idx = tl.arange(0, BLOCK)
        pos = g * group_size + idx
        valid = (idx < group_size) & (pos < n)
        x = tl.load(x_ptr + pos, mask=valid, other=0.0).to(tl.float32)
        if SYMMETRIC:
            scale = libdevice.div_rn(tl.max(tl.where(valid, tl.abs(x), 0.0), axis=0), qmax)
            off = 0.0
        else:
            mn = tl.min(tl.where(valid, x, float("inf")), axis=0)
            mx = tl.max(tl.where(valid, x, float("-inf")), axis=0)
            scale = libdevice.div_rn(mx - mn, qmax)
            off = mn
        scale = tl.where(scale == 0.0, 1.0, scale)
        # IEEE-rounded division (div_rn): Triton's `/` on fp32 is the approximate div.full.f32 (up to 2 ulp), which
        # moved scales by an ulp and flipped codes at rounding ties against the reference (seen on an H200).
        q = libdevice.rint(libdevice.div_rn(x - off, scale))
        q = tl.minimum(tl.maximum(q, qmin), qmax)
        q = tl.where(valid, q, 0.0)
        tl.store(q_ptr + g * group_size + idx, q.to(tl.int32), mask=idx < group_size)
        tl.store(scale_ptr + g, scale)
        tl.store(offset_ptr + g, off)

    return triton, kernel


def quantize_cuda(
    x: torch.Tensor, bits: int, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA implementation of ``zlightning::quantize``: Triton computes int32 codes per group, torch packs them."""
    tri = _triton_quantize()
    if tri is None:
        return quantize_reference(x, bits, group_size, symmetric)
    triton, kernel = tri
    n = x.numel()
    groups = -(-n // group_size)
    codes = torch.empty(groups, group_size, dtype=torch.int32, device=x.device)
    scale = torch.empty(groups, dtype=torch.float32, device=x.device)
    offset = torch.empty(groups, dtype=torch.float32, device=x.device)
    qmin, qmax = _qrange(bits, symmetric)
    if groups:
        kernel[(groups,)](
            x.contiguous().view(-1),
            codes,
            scale,
            offset,
            n,
            group_size,
            qmin,
            qmax,
            SYMMETRIC=symmetric,
            BLOCK=triton.next_power_of_2(group_size),
        )
        finite = torch.ones(groups * group_size, dtype=torch.bool, device=x.device)
        finite[:n] = torch.isfinite(x.reshape(-1))
        scale, offset = _poison_nonfinite(~finite.view(groups, group_size).all(1), codes, scale, offset, symmetric)
    return _pack(codes, bits, symmetric), scale, offset


def dequantize_cuda(
    data: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    numel: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """CUDA implementation of ``zlightning::dequantize``: elementwise torch ops on the GPU (memory-bound)."""
    return dequantize_reference(data, scale, offset, bits, group_size, symmetric, numel, dtype)
