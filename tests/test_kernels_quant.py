"""Group-wise int8/int4 quantization: compiled kernel == PyTorch reference byte for byte; error bounds; opcheck."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from zlightning.kernels import QuantizedTensor, _ext, dequantize, quantize
from zlightning.kernels._quant import dequantize_reference, quantize_reference

native = pytest.mark.skipif(not _ext.available(), reason=f"native kernels not built: {_ext.status().reason}")
MODES = [(8, True), (8, False), (4, True), (4, False)]


def test_hand_checked_values():
    x = torch.tensor([1.0, -2.0, 0.5, 4.0, 0.0, 0.0, 3.0])  # groups of 4: [1,-2,.5,4], [0,0,3] (short)
    q = quantize(x, bits=8, group_size=4, symmetric=True)
    torch.testing.assert_close(q.scale, torch.tensor([4 / 127, 3 / 127]))
    assert q.data.dtype == torch.int8 and q.data.shape == (2, 4)
    assert q.data.tolist() == [[32, -64, 16, 127], [0, 0, 127, 0]]  # round(127/4)=32 (31.75), pad code 0
    q4 = quantize(x, bits=4, group_size=4, symmetric=False)  # group 0: min -2, scale 6/15 = 0.4
    torch.testing.assert_close(q4.offset, torch.tensor([-2.0, 0.0]))
    # codes: (1+2)/.4=7.5->8, 0, (0.5+2)/.4=6.25->6, 15  -> bytes 0x08, 0xF6
    assert q4.data.dtype == torch.uint8 and q4.data[0].tolist() == [0x08, 0xF6]
    assert q4.data[1].tolist() == [0x00, 0x0F]  # 0, 0, 3/0.2=15, pad 0
    back = dequantize(q4)
    assert back.shape == x.shape and back.dtype == x.dtype


@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_error_within_half_a_step_and_shape_dtype_restored(bits, symmetric, dtype):
    x = (torch.randn(37, 129) * torch.logspace(-3, 2, 129)).to(dtype)
    q = quantize(x, bits=bits, group_size=64, symmetric=symmetric)
    back = dequantize(q)
    assert back.shape == x.shape and back.dtype == dtype
    steps = q.scale.repeat_interleave(64)[: x.numel()].view_as(x)
    slack = 1e-6 * x.float().abs().amax() + (0 if dtype == torch.float32 else 8e-3 * x.float().abs())
    assert ((dequantize(q, torch.float32) - x.float()).abs() <= steps / 2 * (1 + 1e-5) + slack).all()
    assert q.nbytes < x.numel() * x.element_size()


@native
@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(0, 3000),
    group=st.sampled_from([2, 8, 64, 100, 256]),
    mode=st.sampled_from(MODES),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_native_matches_reference_bytes(numel, group, mode, dtype, seed):
    bits, symmetric = mode
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    if numel > 10:
        x[::7] = 0.0  # exact zeros and constant runs
    data, scale, offset = torch.ops.zlightning.quantize(x, bits, group, symmetric)
    rd, rs, ro = quantize_reference(x, bits, group, symmetric)
    assert data.dtype == rd.dtype and torch.equal(data, rd)
    assert torch.equal(scale, rs) and torch.equal(offset, ro)
    out = torch.ops.zlightning.dequantize(data, scale, offset, bits, group, symmetric, numel, dtype)
    assert torch.equal(out, dequantize_reference(data, scale, offset, bits, group, symmetric, numel, dtype))


def test_constant_groups_and_fallback_path(monkeypatch):
    monkeypatch.setattr(_ext, "available", lambda: False)
    monkeypatch.setattr(_ext, "_warned", True)
    x = torch.full((10,), 2.5)
    for bits, symmetric in MODES:
        q = quantize(x, bits=bits, group_size=4, symmetric=symmetric)
        assert torch.isfinite(q.scale).all()
        torch.testing.assert_close(dequantize(q), x, rtol=0, atol=2.5 / 7)


def test_bad_arguments():
    x = torch.randn(10)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(x, bits=3)
    with pytest.raises(ValueError, match="group_size=5.*even"):
        quantize(x, bits=4, group_size=5)
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.arange(10))
    with pytest.raises(TypeError, match="QuantizedTensor"):
        dequantize(x)  # type: ignore[arg-type]


@native
def test_opcheck_quantize_dequantize():
    for bits, symmetric in MODES:
        x = torch.randn(1000)
        torch.library.opcheck(torch.ops.zlightning.quantize.default, (x, bits, 64, symmetric))
        d, s, o = torch.ops.zlightning.quantize(x, bits, 64, symmetric)
        torch.library.opcheck(
            torch.ops.zlightning.dequantize.default, (d, s, o, bits, 64, symmetric, 1000, torch.bfloat16)
        )


@native
def test_torch_compile_traces_through_fake_kernels():
    def f(x: torch.Tensor) -> torch.Tensor:
        d, s, o = torch.ops.zlightning.quantize(x * 2, 8, 32, False)
        return torch.ops.zlightning.dequantize(d, s, o, 8, 32, False, x.numel(), x.dtype).view_as(x) + 1

    x = torch.randn(8, 50)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), f(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bits,symmetric", MODES)
def test_cuda_matches_cpu_reference(bits, symmetric):
    x = torch.randn(4097, 33)
    q = quantize(x.cuda(), bits=bits, group_size=128, symmetric=symmetric)
    rd, rs, ro = quantize_reference(x, bits, 128, symmetric)
    assert torch.equal(q.data.cpu(), rd) and torch.equal(q.scale.cpu(), rs)
    assert isinstance(q, QuantizedTensor) and torch.equal(
        dequantize(q).cpu(), dequantize(quantize(x, bits, 128, symmetric))
    )
