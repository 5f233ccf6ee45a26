"""quantize/dequantize as users call them: non-finite inputs and argument types, on the compiled kernel (when built)
and on the forced PyTorch fallback, against the documented math."""

from __future__ import annotations

import pytest
import torch
from zlightning.kernels import dequantize, quantize
from zlightning.kernels._quant import quantize_reference

MODES = [(8, True), (8, False), (4, True), (4, False)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("bits,symmetric", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_values_make_their_group_nan_and_leave_the_others_alone(kernel, bad, bits, symmetric, dtype):
    torch.manual_seed(0)
    x = torch.randn(250).to(dtype)  # 4 groups of 64, the last one short
    x[5] = bad  # group 0
    x[249] = bad  # the short last group
    q = quantize(x, bits=bits, group_size=64, symmetric=symmetric)
    assert q.scale[[0, 3]].isnan().all() and torch.isfinite(q.scale[1:3]).all()
    assert (q.offset == 0).all() if symmetric else q.offset[[0, 3]].isnan().all()  # symmetric offsets stay 0
    assert (q.data[[0, 3]] == 0).all()  # defined codes (a NaN was cast to int before)
    y = dequantize(q)
    assert y[:64].isnan().all() and y[192:].isnan().all()  # the NaN was dropped and the group coded as finite
    assert torch.isfinite(y[64:192]).all()
    clean = quantize(x[64:192].contiguous(), bits=bits, group_size=64, symmetric=symmetric)
    assert torch.equal(y[64:192], dequantize(clean))
    rd, rs, ro = quantize_reference(x, bits, 64, symmetric)  # the compiled kernel writes the reference's bytes
    assert torch.equal(q.data, rd) and torch.equal(q.scale.nan_to_num(), rs.nan_to_num())
    assert torch.equal(q.offset.nan_to_num(), ro.nan_to_num())


def test_bool_group_size_is_refused(kernel):
    with pytest.raises(ValueError, match="group_size=True"):
        quantize(torch.randn(10), bits=8, group_size=True)  # was taken as group_size=1
