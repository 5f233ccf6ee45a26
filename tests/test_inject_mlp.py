"""Fused MLP injection: plain (GPT) and gated (Llama-like) MLPs are recognised by structure, keep their parameters
and names, match the original forward and backward (fp32, dropout, bf16 autocast) and compose with TP=2 on gloo."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt_model import GPT, GPTConfig
from zlightning.inject import (
    FusedMLP,
    InjectPolicy,
    build_tp_groups,
    injection_report,
    module_inject,
    tp_full_state,
)
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)


class LlamaMLP(nn.Module):
    """Hugging Face style gated MLP: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, d: int, hidden: int, bias: bool = False, act: nn.Module | None = None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=bias)
        self.up_proj = nn.Linear(d, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class AnonGated(nn.Module):
    """No hint in the names and a functional activation: the probe must find which input Linear is the gate."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(hidden, d), nn.Linear(d, hidden), nn.Linear(d, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(x) * F.gelu(self.c(x)))


class LlamaBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.mlp = LlamaMLP(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d) for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _fuse(module: nn.Module, mode: str = "recompute") -> nn.Module:
    """module_inject on a wrapper (the root itself cannot be swapped) and return the fused child."""
    holder = nn.Sequential(module)
    module_inject(holder, InjectPolicy(fuse_mlp=mode))  # type: ignore[arg-type]
    return holder[0]


def _check_forward_backward(ref: nn.Module, fused: nn.Module, x: torch.Tensor, seed: int = 0) -> None:
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(seed)
    ya = ref(xa)
    torch.manual_seed(seed)
    yb = fused(xb)
    torch.testing.assert_close(yb, ya, rtol=1e-5, atol=1e-6)
    gy = torch.randn_like(ya)
    ya.backward(gy), yb.backward(gy)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=1e-5, atol=1e-6)
    ref_grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(("bias", "mode"), [(True, "recompute"), (False, "save")])
def test_gpt_mlp_fused_matches_including_dropout(bias: bool, mode: str) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**CFG.__dict__, "bias": bias, "dropout": 0.1}))
    ref = copy.deepcopy(model)
    params_before = {n: p for n, p in model.named_parameters()}
    module_inject(model, InjectPolicy(fuse_mlp=mode))  # type: ignore[arg-type]
    report = injection_report(model)
    assert {f"blocks.{i}.mlp": "mlp" for i in range(CFG.n_layer)}.items() <= report.kernels.items()
    assert report.counts()["mlp"] == CFG.n_layer and "blocks.0.mlp: mlp" in str(report)
    for i in range(CFG.n_layer):
        mlp = model.blocks[i].mlp
        assert isinstance(mlp, FusedMLP) and (mlp.act, mlp.gate_name, mlp.out_drop) == ("gelu", None, "drop")
    # the very same Parameter objects under the same names: optimizers, state dicts and TP plans are unaffected
    assert {n: p for n, p in model.named_parameters()} == params_before
    assert list(model.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 7, CFG.d_model)
    ref.train(), model.train()  # training mode: the output dropout draws the same mask
    _check_forward_backward(ref.blocks[0].mlp, model.blocks[0].mlp, x)
    idx = torch.randint(0, CFG.vocab_size, (2, 12))
    torch.manual_seed(1)
    _, loss_ref = ref(idx, idx)
    torch.manual_seed(1)
    _, loss = model(idx, idx)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: LlamaMLP(16, 40),
        lambda: LlamaMLP(16, 40, bias=True, act=nn.GELU(approximate="tanh")),
        lambda: AnonGated(16, 24),
    ],
    ids=["llama_silu", "geglu_tanh_bias", "anonymous_names"],
)
@pytest.mark.parametrize("mode", ["recompute", "save"])
def test_gated_mlps_fused_match(make: object, mode: str) -> None:
    torch.manual_seed(0)
    ref = make()  # type: ignore[operator]
    fused = _fuse(copy.deepcopy(ref), mode)
    assert isinstance(fused, FusedMLP) and fused.gate_name is not None and fused.recompute == (mode == "recompute")
    if isinstance(ref, AnonGated):
        assert (fused.gate_name, fused.up_name, fused.down_name, fused.act) == ("c", "b", "a", "gelu")
    _check_forward_backward(ref, fused, torch.randn(2, 5, 16))


def test_frozen_parts_get_no_gradient() -> None:
    torch.manual_seed(0)
    ref = LlamaMLP(16, 40, bias=True)
    for lin in (ref.gate_proj, ref.up_proj):
        lin.requires_grad_(False)
    fused = _fuse(copy.deepcopy(ref))
    x = torch.randn(2, 5, 16)  # no input gradient either
    fused(x).sum().backward(), ref(x).sum().backward()
    assert fused.gate_proj.weight.grad is None and fused.up_proj.bias.grad is None
    torch.testing.assert_close(fused.down_proj.weight.grad, ref.down_proj.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused.down_proj.bias.grad, ref.down_proj.bias.grad, rtol=1e-5, atol=1e-6)


def test_fused_mlp_under_bf16_autocast_tracks_the_original() -> None:
    torch.manual_seed(0)
    ref = LlamaMLP(16, 40)
    fused = _fuse(copy.deepcopy(ref))
    x = torch.randn(4, 6, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = ref(x), fused(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), ya.float(), rtol=2e-2, atol=2e-2)
    ya.float().sum().backward(), yb.float().sum().backward()
    assert list(fused.state_dict()) == list(ref.state_dict())
    fused_params = dict(fused.named_parameters())
    for name, pa in ref.named_parameters():
        pb = fused_params[name]
        assert pb.grad is not None and pb.grad.dtype == torch.float32
        torch.testing.assert_close(pb.grad, pa.grad, rtol=5e-2, atol=5e-2, msg=name)


def test_non_mlps_are_left_alone() -> None:
    class TwoLinears(nn.Module):  # no activation: not an MLP (no reading matches on the probe)
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    class ScaledMLP(LlamaMLP):  # looks like an MLP but computes something else: kept, with a warning
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    holder = nn.Sequential(TwoLinears(), nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)))
    module_inject(holder, InjectPolicy())
    assert isinstance(holder[0], TwoLinears) and not injection_report(holder).kernels
    scaled = nn.Sequential(ScaledMLP(8, 16))
    with pytest.warns(UserWarning, match="no fused MLP reading matches"):
        module_inject(scaled, InjectPolicy())
    assert isinstance(scaled[0], ScaledMLP)
    off = nn.Sequential(LlamaMLP(8, 16))
    module_inject(off, InjectPolicy(fuse_mlp="off"))
    assert isinstance(off[0], LlamaMLP)


# ------------------------------------------------------------------ TP=2: column/row parallel inside the fused MLP
def _tp_rank(rank: int, world: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, make, vocab in (("gpt", lambda: GPT(CFG), CFG.vocab_size), ("llama", TinyLlama, 40)):
        torch.manual_seed(0)
        ref = make()
        model = copy.deepcopy(ref)
        module_inject(model, InjectPolicy(tp_size=2), tp_group=build_tp_groups(2).tp_group)
        report = injection_report(model)
        fused = [m for m in model.modules() if isinstance(m, FusedMLP)]
        assert fused and all(m._fusable() is not None for m in fused)  # the fused path, not the fallback
        gen = torch.Generator().manual_seed(1)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        for _ in range(2):
            idx, tgt = (torch.randint(0, vocab, (3, 10), generator=gen) for _ in range(2))
            losses = []
            for m, opt in zip((ref, model), opts):
                opt.zero_grad()
                _, loss = m(idx, tgt)
                loss.backward()
                losses.append(loss.detach())
            grads = tp_full_state(model, grads=True)
            torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
            for n, p in ref.named_parameters():
                torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
            for opt in opts:
                opt.step()
        full = tp_full_state(model)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(full[n], p.detach(), rtol=1e-5, atol=1e-6, msg=f"{name} {n}")
        results[name] = (report.kernels, report.tensor_parallel)
    results["zero_linear_units"] = _zero_linear_units()
    return results


def _zero_linear_units() -> list[tuple[float, float]]:
    """ZeRO-3 units finer than the MLP (each Linear): the fused MLP must fall back to calling its children."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    module_inject(model, InjectPolicy())
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.SGD(model.parameters(), lr=0.1), config=ZeroConfig(unit_modules=("Linear",))
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    losses = []
    for _ in range(2):
        idx = torch.randint(0, CFG.vocab_size, (2, 10), generator=gen)  # the same batch on both ranks
        _, loss = model(idx, idx)
        zero.backward(loss)
        zero.step()
        _, ref_loss = ref(idx, idx)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((float(loss.detach()), float(ref_loss.detach())))
    return losses


def test_fused_mlp_composes_with_tp2() -> None:
    out = run_distributed(_tp_rank, 2, timeout=240)
    gpt_kernels, gpt_tp = out[0]["gpt"]
    assert gpt_kernels["blocks.1.mlp"] == "mlp"
    assert (gpt_tp["blocks.1.mlp.fc"], gpt_tp["blocks.1.mlp.proj"]) == ("column", "row")
    llama_kernels, llama_tp = out[0]["llama"]
    assert llama_kernels == {"layers.0.mlp": "gated_mlp", "layers.1.mlp": "gated_mlp"}
    assert [llama_tp[f"layers.0.mlp.{n}"] for n in ("gate_proj", "up_proj", "down_proj")] == ["column"] * 2 + ["row"]
    assert out[1] == out[0]
    for got, want in out[0]["zero_linear_units"]:
        assert got == pytest.approx(want, rel=1e-5)
