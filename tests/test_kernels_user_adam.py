"""CPUAdam as users call it: state dicts to and from torch.optim.AdamW/Adam, flags in parameter groups, maximize,
sparse gradients. Each case on the compiled kernel (when built) and on the forced PyTorch fallback."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from zlightning.kernels import CPUAdam


def _steps(pairs, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for opt, ref, p, r in pairs:
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.to(p.dtype), g.to(r.dtype)
        for opt, ref, _p, _r in pairs:
            opt.step()
            ref.step()


@pytest.mark.parametrize("shape", [(1023,), (30, 20)])
def test_torch_adamw_state_dict_loads_into_cpu_adam_and_back(kernel, shape):
    torch.manual_seed(0)
    base = torch.randn(30, 20).t() if shape == (30, 20) else torch.randn(shape)  # transposed: AdamW's state too
    r = nn.Parameter(base.clone())
    ref = torch.optim.AdamW([r], lr=1e-2, weight_decay=0.1)
    _steps([(ref, ref, r, r)], 1, seed=1)
    p = nn.Parameter(r.detach().clone().contiguous())
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # was KeyError: 'bias_correction'
    assert opt.state[p]["step"] == 2 and opt.param_groups[0]["adamw_mode"] is True
    _steps([(opt, ref, p, r)], 5, seed=2)
    torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    back = nn.Parameter(p.detach().clone())
    ref2 = torch.optim.Adam([back], lr=1e-2, weight_decay=0.1)  # Adam reads decoupled_weight_decay from our dict
    ref2.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert ref2.param_groups[0]["decoupled_weight_decay"] is True
    _steps([(opt, ref2, p, back)], 5, seed=3)
    torch.testing.assert_close(p.detach(), back.detach(), rtol=1e-6, atol=1e-7)


def test_torch_adam_l2_state_dict_keeps_l2_mode(kernel):
    r = nn.Parameter(torch.randn(100))
    ref = torch.optim.Adam([r], lr=1e-2, weight_decay=0.1)
    _steps([(ref, ref, r, r)], 2, seed=1)
    p = nn.Parameter(r.detach().clone())
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)  # adamw_mode=True by default; the state dict says L2
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["adamw_mode"] is False
    _steps([(opt, ref, p, r)], 3, seed=2)
    torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_state_dict_round_trip_keeps_fp32_master_and_moments(kernel, dtype):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(1023).to(dtype))
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    _steps([(opt, opt, p, p)], 3, seed=1)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    q = nn.Parameter(p.detach().clone())
    opt2 = CPUAdam([q], lr=1e-2, weight_decay=0.1)
    opt2.load_state_dict(torch.load(buf))
    for key in ("master", "exp_avg", "exp_avg_sq"):  # torch's load casts them to bf16/fp16 (precision lost)
        assert opt2.state[q][key].dtype == torch.float32
        assert torch.equal(opt2.state[q][key], opt.state[p][key])
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        g = torch.randn(1023, generator=gen).to(dtype)
        p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(p, q) and torch.equal(opt.state[p]["master"], opt2.state[q]["master"])


def test_fp32_adamw_state_dict_into_bf16_params_makes_a_master(kernel):
    r = nn.Parameter(torch.randn(64).bfloat16().float())
    ref = torch.optim.AdamW([r], lr=1e-2)
    _steps([(ref, ref, r, r)], 2, seed=1)
    p = nn.Parameter(r.detach().bfloat16())
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    st = opt.state[p]
    assert st["master"].dtype == st["exp_avg"].dtype == torch.float32
    assert torch.equal(st["exp_avg"], ref.state[r]["exp_avg"]) and torch.equal(st["master"], p.float())


def test_amsgrad_anywhere_is_refused_and_maximize_matches_torch(kernel):
    p = nn.Parameter(torch.randn(50))
    with pytest.raises(ValueError, match="param group 0: amsgrad=True.*not supported"):
        CPUAdam([{"params": [p], "amsgrad": True}])  # was silently accepted and ignored
    with pytest.raises(ValueError, match="param group 0: lr=-1"):
        CPUAdam([{"params": [p], "lr": -1.0}])
    opt = CPUAdam([p])
    with pytest.raises(ValueError, match="float64 unsupported"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1
    r = nn.Parameter(torch.randn(50))
    ams = torch.optim.AdamW([r], amsgrad=True)
    _steps([(ams, ams, r, r)], 1, seed=1)
    with pytest.raises(ValueError, match="load_state_dict: param group 0: amsgrad=True"):
        opt.load_state_dict(ams.state_dict())
    assert opt.param_groups[0]["amsgrad"] is False and not opt.state  # nothing changed
    r = nn.Parameter(p.detach().clone())
    opt = CPUAdam([{"params": [p], "maximize": True}], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([r], lr=1e-2, weight_decay=0.1, maximize=True)
    _steps([(opt, ref, p, r)], 5, seed=2)
    torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)


def test_sparse_gradient_is_a_clear_error(kernel):
    emb = nn.Embedding(10, 4, sparse=True)
    opt = CPUAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients.*SparseAdam"):
        opt.step()
