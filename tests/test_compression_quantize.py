"""Quantizer functions: grids, straight-through gradient, exact pack/unpack round trip, bit schedule."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zlightning.compression import dequantize_weight, fake_quantize, quantize_weight, scheduled_bits
from zlightning.compression._quantize import pack_codes, unpack_codes


def _x(seed: int, shape=(8, 32)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.integers(3, 8), groups=st.sampled_from([1, 2, 8]))
def test_symmetric_grid_error_and_levels(seed: int, bits: int, groups: int) -> None:
    x = _x(seed)
    q = quantize_weight(x, bits, "symmetric", groups)
    qmax = 2 ** (bits - 1) - 1
    assert int(q.codes.min()) >= -qmax and int(q.codes.max()) <= qmax
    y = dequantize_weight(q)
    # the step is the group's largest magnitude over qmax, computed here rather than read back from the quantizer
    step = x.reshape(groups, -1).abs().amax(dim=1, keepdim=True) / qmax
    torch.testing.assert_close(q.scale.reshape(groups, 1), step, rtol=1e-6, atol=0.0)
    # error at most half a step everywhere (no clipping of the maximum, see [Note: quantizer grids])
    err = (y - x).reshape(groups, -1).abs()
    assert bool((err <= step / 2 + 1e-6).all())
    for row in y.reshape(groups, -1):
        assert row.unique().numel() <= 2**bits


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), bits=st.integers(3, 8))
def test_asymmetric_keeps_zero_exact_and_levels(seed: int, bits: int) -> None:
    x = _x(seed).abs() + 0.5  # all positive: zero is still representable
    x[0, 0] = 0.0
    q = quantize_weight(x, bits, "asymmetric", 4)
    y = dequantize_weight(q)
    assert y[0, 0].item() == 0.0
    assert int(q.codes.min()) >= 0 and int(q.codes.max()) <= 2**bits - 1
    assert all(row.unique().numel() <= 2**bits for row in y.reshape(4, -1))
    grouped = x.reshape(4, -1)  # the grid spans [min(x, 0), max(x, 0)] of each group in 2**bits - 1 steps
    step = (grouped.amax(dim=1, keepdim=True).clamp(min=0) - grouped.amin(dim=1, keepdim=True).clamp(max=0)) / (
        2**bits - 1
    )
    torch.testing.assert_close(q.scale.reshape(4, 1), step, rtol=1e-6, atol=0.0)
    assert bool(((y - x).reshape(4, -1).abs() <= step / 2 + 1e-6).all())


def test_ternary_and_binary_levels() -> None:
    x = _x(1)
    t = fake_quantize(x, 2, num_groups=8)
    b = fake_quantize(x, 1, num_groups=8)
    for row_t, row_b, row_x in zip(t.reshape(8, -1), b.reshape(8, -1), x.reshape(8, -1)):
        assert row_t.unique().numel() <= 3
        assert row_b.unique().numel() <= 2
        torch.testing.assert_close(row_b.abs(), row_x.abs().mean().expand_as(row_b))
    with pytest.raises(ValueError, match="symmetric only"):
        quantize_weight(x, 2, "asymmetric")


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_straight_through_gradient(bits: int) -> None:
    x = _x(2).requires_grad_()
    fake_quantize(x, bits, num_groups=8).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@pytest.mark.parametrize(
    "bits,scheme",
    [
        (1, "symmetric"),
        (2, "symmetric"),
        (3, "symmetric"),
        (4, "symmetric"),
        (4, "asymmetric"),
        (8, "symmetric"),
        (8, "asymmetric"),
        (12, "symmetric"),
    ],
)
def test_pack_unpack_is_exact(bits: int, scheme: str) -> None:
    x = _x(3, (7, 9))  # odd sizes exercise padding
    q = quantize_weight(x, bits, scheme, 7)
    packed = pack_codes(q)
    codes = unpack_codes(packed, bits, x.numel(), q.code_offset)
    assert torch.equal(codes, q.codes.flatten())
    container = 1 if bits == 1 else 2 if bits == 2 else 4 if bits <= 4 else 8
    if bits <= 8:
        assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(x.numel() * container / 8)
    # exact round trip at the target bits: dequantized codes are the fake-quantized values, bit for bit
    assert torch.equal(dequantize_weight(q), fake_quantize(x, bits, scheme, 7))


def test_bad_group_count_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="quantize_groups dividing"):
        quantize_weight(_x(0), 8, num_groups=5)


def test_bit_schedule_doubles_period() -> None:
    # start 12, target 8, period 50: 11 at 50, 10 at 100, 9 at 200, 8 from 400 (DeepSpeed MoQ semantics)
    got = {s: scheduled_bits(s, 12, 8, 50) for s in (0, 49, 50, 99, 100, 199, 200, 399, 400, 10_000)}
    assert got == {0: 12, 49: 12, 50: 11, 99: 11, 100: 10, 199: 10, 200: 9, 399: 9, 400: 8, 10_000: 8}
    assert scheduled_bits(5, 8, 8, 1) == 8


def _aq(calibration: str, bits: int = 8, scheme: str = "symmetric", per_sample: bool = False):
    from zlightning.compression._techniques import ActivationQuantizer

    aq = ActivationQuantizer(
        schedule_offset=0, bits=bits, scheme=scheme, calibration=calibration, per_sample=per_sample
    )
    aq.set_step(0)
    return aq


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("scheme", ["symmetric", "asymmetric"])
def test_dynamic_activation_quantization_is_per_token(bits: int, scheme: str) -> None:
    x = _x(4, (2, 5, 16)) * torch.arange(1, 11).reshape(2, 5, 1)  # every token has its own range
    x.requires_grad_()
    y = _aq("dynamic", bits, scheme)(x)
    for token_x, token_y in zip(x.detach().reshape(10, 16), y.detach().reshape(10, 16)):
        assert token_y.unique().numel() <= 2**bits
        step = (
            (token_x.max() - token_x.min()) / (2**bits - 1)
            if scheme == "asymmetric"
            else token_x.abs().max() / (2 ** (bits - 1) - 1)
        )
        assert float((token_y - token_x).abs().max()) <= float(step) / 2 + 1e-5  # per-token scale, not a global one
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # straight-through
    conv_in = _x(5, (3, 2, 4, 4)) * torch.tensor([1.0, 10.0, 100.0]).reshape(3, 1, 1, 1)
    per_image = _aq("dynamic", 8, per_sample=True)(conv_in)
    assert all(img.unique().numel() <= 256 for img in per_image)
    torch.testing.assert_close(per_image, conv_in, rtol=0, atol=float(conv_in.abs().amax()) / 127)


def test_static_activation_range_is_an_ema_frozen_in_eval() -> None:
    aq = _aq("static", 8)
    a, b = _x(6, (4, 8)), _x(7, (4, 8)) * 3
    aq(a)  # the first batch initialises the range
    torch.testing.assert_close(aq.x_min_max, torch.stack([a.min(), a.max()]))
    aq(b)
    expected = 0.95 * torch.stack([a.min(), a.max()]) + 0.05 * torch.stack([b.min(), b.max()])
    torch.testing.assert_close(aq.x_min_max, expected)
    aq.eval()
    out = aq(b * 10)
    torch.testing.assert_close(aq.x_min_max, expected)  # frozen in eval
    qmax = float(torch.maximum(-expected[0], expected[1]))
    assert float(out.abs().max()) <= qmax * (1 + 1e-6)  # values outside the calibrated range are clipped
    assert out.unique().numel() <= 255
    off = _aq("static", 8)
    off.set_step(-1)
    assert torch.equal(off(b), b) and not bool(off.initialized)  # before its offset: identity, no calibration


@pytest.mark.parametrize(
    "bits,shape,groups", [(8, (384, 128), 128), (8, (7, 9), 7), (4, (256, 128), 256), (4, (64, 30), 64), (8, (3, 5), 1)]
)
def test_native_kernel_path_is_bit_identical(bits: int, shape: tuple[int, int], groups: int) -> None:
    """fake_quantize uses zlightning.kernels for symmetric int8/int4 when built; it must equal the PyTorch grid."""
    from zlightning.compression._quantize import _kernel_fake_quantize

    for dtype in (torch.float32, torch.bfloat16):
        x = (_x(8, shape) * 0.05).to(dtype)
        x[0, 0] = 0.0
        reference = dequantize_weight(quantize_weight(x, bits, "symmetric", groups))
        native = _kernel_fake_quantize(x, bits, groups)
        if native is not None:  # None: kernels not built here, or this group size is not theirs
            assert native.dtype == dtype and torch.equal(native, reference)
        y = x.clone().requires_grad_()
        out = fake_quantize(y, bits, "symmetric", groups)
        assert torch.equal(out.detach(), reference)
        out.float().sum().backward()
        assert torch.equal(y.grad, torch.ones_like(y))
