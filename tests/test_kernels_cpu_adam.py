"""CPUAdam: parity with torch.optim.AdamW/Adam over many steps, on the compiled kernel (each ISA) and the fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zlightning.kernels import CPUAdam, _ext
from zlightning.kernels._cpu_adam import adam_step_reference

native = pytest.mark.skipif(not _ext.available(), reason=f"native kernels not built: {_ext.status().reason}")
SIZES = (1, 33, 70_001)  # a scalar-ish tail, a SIMD tail, and several parallel chunks


def _isas() -> list[str]:
    if not _ext.available():
        return []
    found = []
    for name in ("avx512", "avx2", "base"):
        if torch.ops.zlightning.set_isa(name).startswith(name):
            found.append(name)
    torch.ops.zlightning.set_isa("")
    return found


@pytest.fixture(autouse=True)
def one_thread():
    """Single-threaded parity loops: OpenMP on an oversubscribed 2-core test machine is 50x slower, and the
    kernel is elementwise, so threads cannot change results (test_threads_do_not_change_results checks that)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["fallback", *_isas()])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.param == "fallback":
        monkeypatch.setattr(_ext, "available", lambda: False)
        monkeypatch.setattr(_ext, "_warned", True)
        yield "fallback"
        return
    torch.ops.zlightning.set_isa(request.param)
    yield request.param
    torch.ops.zlightning.set_isa("")


def _run_pair(opt, ref_opt, params, refs, steps: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, r in zip(params, refs):
            g = torch.randn(p.shape, generator=gen)
            p.grad, r.grad = g.to(p.dtype), g.clone()
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_parity_with_torch_over_many_steps(kernel, weight_decay, adamw_mode):
    torch.manual_seed(1)
    params = [torch.randn(n, requires_grad=True) for n in SIZES]
    refs = [p.detach().clone().requires_grad_() for p in params]
    opt = CPUAdam(params, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, adamw_mode=adamw_mode)
    ref_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref_opt = ref_cls(refs, lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=weight_decay, foreach=False)
    _run_pair(opt, ref_opt, params, refs, steps=100)
    for p, r in zip(params, refs):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[p]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"], rtol=1e-6, atol=0)
    assert opt.uses_native_kernel == (kernel != "fallback")


def test_no_bias_correction_matches_reference(kernel):
    p = torch.randn(5000, requires_grad=True)
    master, m, v = p.detach().clone(), torch.zeros(5000), torch.zeros(5000)
    opt = CPUAdam([p], lr=1e-2, bias_correction=False, weight_decay=0.1)
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 40):
        g = torch.randn(5000, generator=gen)
        p.grad = g
        opt.step()
        adam_step_reference(
            master,
            g,
            m,
            v,
            None,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            step=step,
            bias_correction=False,
            adamw_mode=True,
        )
    torch.testing.assert_close(p.detach(), master, rtol=1e-6, atol=1e-6)


def test_bf16_params_keep_fp32_master_and_round_in_the_same_pass(kernel):
    torch.manual_seed(2)
    full = [torch.randn(n) for n in SIZES]
    params = [f.to(torch.bfloat16).requires_grad_() for f in full]
    refs = [p.detach().float().requires_grad_() for p in params]  # the fp32 master, updated by torch
    opt = CPUAdam(params, lr=1e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(refs, lr=1e-3, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(5)
    for _ in range(60):
        for p, r in zip(params, refs):
            g = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
            p.grad, r.grad = g, g.float()
        opt.step()
        ref_opt.step()
    for p, r in zip(params, refs):
        master = opt.state[p]["master"]
        assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(master, r.detach(), rtol=1e-6, atol=1e-6)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))  # round-to-nearest-even, as torch


@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
def test_fp16_param_groups_receive_the_update(kernel, copy_dtype):
    a, b = torch.randn(300, requires_grad=True), torch.randn(7, 9, requires_grad=True)
    copies = [torch.empty(300, dtype=copy_dtype), torch.empty(7, 9, dtype=copy_dtype)]
    opt = CPUAdam([a, b], lr=1e-2)
    a.grad, b.grad = torch.randn(300), torch.randn(7, 9)
    opt.step(fp16_param_groups=copies)  # a flat list for one group, as DeepSpeed accepts
    assert torch.equal(copies[0], a.detach().to(copy_dtype)) and torch.equal(copies[1], b.detach().to(copy_dtype))
    with pytest.raises(ValueError, match="one tensor per parameter"):
        opt.step(fp16_param_groups=[copies[:1]])


def test_trains_a_model_like_adamw(kernel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    ref = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    ref.load_state_dict(model.state_dict())
    opt = CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    x, y = torch.randn(128, 16), torch.randn(128, 4)
    losses = []
    for _ in range(30):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            loss = nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
        losses.append(loss.item())
        torch.testing.assert_close(
            nn.functional.mse_loss(model(x), y), nn.functional.mse_loss(ref(x), y), rtol=1e-5, atol=1e-6
        )
    assert losses[-1] < 0.7 * losses[0]


def test_fp32_optimizer_states_false_keeps_low_precision_state():
    p = torch.randn(100).to(torch.bfloat16).requires_grad_()
    opt = CPUAdam([p], lr=0.1, fp32_optimizer_states=False)  # bf16 spacing at 4.0 is 0.03
    before = p.detach().clone()
    p.grad = torch.ones(100, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and "master" not in opt.state[p]
    assert (p.detach().float() < before.float()).all()  # a positive gradient moves every weight down


def test_bad_arguments():
    p = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ValueError, match="amsgrad.*not supported"):
        CPUAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        CPUAdam(p, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="lr=-1"):
        CPUAdam(p, lr=-1)
    with pytest.raises(ValueError, match="CPU tensors; got a parameter on meta"):
        CPUAdam([torch.zeros(3, device="meta", requires_grad=True)])


@native
def test_threads_do_not_change_results():
    torch.manual_seed(4)
    base = [torch.randn(300_001) for _ in range(4)]  # param, grad, exp_avg, exp_avg_sq: ~10 parallel chunks
    base[3].abs_()
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p, g, m, v = (t.clone() for t in base)
        copy = torch.empty(300_001, dtype=torch.bfloat16)
        for step in (1, 2):
            torch.ops.zlightning.adam_step_(p, g, m, v, copy, 1e-3, 0.9, 0.999, 1e-8, 0.01, step, True, True)
        outs.append((p, m, v, copy))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@native
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_decay,adamw_mode", [(0.0, True), (0.05, True), (0.05, False)])
def test_large_copy_path_matches_plain_step_and_to(copy_dtype, grad_dtype, weight_decay, adamw_mode):
    """Above 64 Ki elements the AVX-512 kernel writes the copy with streaming stores (its own vector loop): the
    state must equal the no-copy step bit for bit and the copy must equal ``param.to(copy_dtype)``, from
    misaligned views, with NaN/inf/denormal/overflowing values in the update."""
    n, off = 200_003, 3  # odd sizes and offsets: unaligned head and tail around the vector body
    gen = torch.Generator().manual_seed(11)
    base = torch.randn(4, n + off, generator=gen)
    base[3].abs_()
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 7e4, 3.0e38, 0.0])
    base[0, 100_000:100_008] = specials  # values the copy must round exactly as torch does
    base[1:, 100_000:100_008] = 0.0  # zero grad and moments there: the update keeps them (denormals included)
    for isa in _isas():
        torch.ops.zlightning.set_isa(isa)
        try:
            with_copy = [t.clone()[off:] for t in base]
            without = [t.clone()[off:] for t in base]
            copy = torch.empty(n + 1, dtype=copy_dtype)[1:]  # 2 bytes past an aligned start
            for state, c in ((with_copy, copy), (without, None)):
                p, g, m, v = state
                for step in (1, 2):
                    torch.ops.zlightning.adam_step_(
                        p, g.to(grad_dtype), m, v, c, 1e-3, 0.9, 0.999, 1e-8, weight_decay, step, True, adamw_mode
                    )
            for a, b in zip(with_copy, without):
                assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()), isa
            expect = with_copy[0].to(copy_dtype)
            assert torch.equal(copy.view(torch.int16), expect.view(torch.int16)) or (
                torch.equal(copy.isnan(), expect.isnan()) and torch.equal(copy[~copy.isnan()], expect[~expect.isnan()])
            ), isa
        finally:
            torch.ops.zlightning.set_isa("")


@native
def test_native_op_checks_its_inputs():
    p, m, v = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    with pytest.raises(RuntimeError, match="equal numel"):
        torch.ops.zlightning.adam_step_(p, torch.zeros(5), m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1, True, True)
    with pytest.raises(RuntimeError, match="step must be >= 1"):
        torch.ops.zlightning.adam_step_(p, torch.zeros(4), m, v, None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 0, True, True)


@native
def test_opcheck_adam_step():
    for copy in (None, torch.empty(1000, dtype=torch.bfloat16)):
        args = (
            torch.randn(1000),
            torch.randn(1000),
            torch.rand(1000),
            torch.rand(1000),
            copy,
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            3,
            True,
            True,
        )
        torch.library.opcheck(torch.ops.zlightning.adam_step_.default, args)
