"""module_inject: Linear classification, plan validation, kernel injection and TP=2 training parity on gloo."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt_model import GPT, GPTConfig
from zlightning.inject import (
    FusedNorm,
    FusedSelfAttention,
    InjectError,
    InjectPolicy,
    LinearStyle,
    build_tp_groups,
    classify_linears,
    module_inject,
    tp_full_state,
)
from zlightning.inject._classify import validate_tp
from zlightning.testing import run_distributed

CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=2, n_head=4)


# ------------------------------------------------------------------ a second, Llama-like model (split QKV, SwiGLU)
class ManualRMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class ManualLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))
        self.variance_epsilon = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(-1, keepdim=True)
        var = (x - mu).pow(2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + self.variance_epsilon) * self.weight + self.bias


class ManualAttention(nn.Module):
    """Full (non-causal) attention written by hand, HF style."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        h = self.num_heads
        q, k, v = (p(x).view(B, T, h, D // h).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        att = (q @ k.transpose(-1, -2) / math.sqrt(D // h)).softmax(-1)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, D))


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.input_layernorm = ManualRMSNorm(d)
        self.self_attn = ManualAttention(d, heads)
        self.post_attention_layernorm = ManualRMSNorm(d)
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab: int = 48, d: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaBlock(d, heads) for _ in range(layers))
        self.norm = ManualLayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ------------------------------------------------------------------ classification
def test_gpt_every_linear_classified() -> None:
    styles = classify_linears(GPT(CFG), InjectPolicy(tp_size=2))
    expected = {"head": LinearStyle.TIED_HEAD}
    for i in range(CFG.n_layer):
        expected |= {
            f"blocks.{i}.attn.qkv": LinearStyle.QKV,
            f"blocks.{i}.attn.proj": LinearStyle.ROW,
            f"blocks.{i}.mlp.fc": LinearStyle.COLUMN,
            f"blocks.{i}.mlp.proj": LinearStyle.ROW,
        }
    assert styles == expected


def test_llama_and_structure_rules_and_plan_override() -> None:
    styles = classify_linears(Llama(), InjectPolicy())
    assert styles["lm_head"] is LinearStyle.HEAD
    for i in range(2):
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "gate_proj", "up_proj"):
            assert styles[f"layers.{i}.{n}"] is LinearStyle.COLUMN
        for n in ("self_attn.o_proj", "down_proj"):
            assert styles[f"layers.{i}.{n}"] is LinearStyle.ROW
    # Structure only (names carry no hint): a Linear followed by a norm, or the last one, is row-parallel.
    anon = nn.Sequential(
        nn.ModuleList(
            [
                nn.ModuleDict(
                    {
                        "a": nn.Linear(8, 16),
                        "b": nn.Linear(16, 8),
                        "n": nn.LayerNorm(8),
                        "c": nn.Linear(8, 8),
                        "d": nn.Linear(8, 8),
                    }
                )
            ]
        ),
        nn.Linear(8, 3),
    )
    got = classify_linears(anon, InjectPolicy())
    col, row = LinearStyle.COLUMN, LinearStyle.ROW
    assert [got[f"0.0.{k}"] for k in "abcd"] == [col, row, col, row]
    assert got["1"] is LinearStyle.REPLICATE
    plan = {r"blocks\.\d+\.mlp\..*": "replicate"}
    over = classify_linears(GPT(CFG), InjectPolicy(plan=plan))
    assert over["blocks.1.mlp.fc"] is LinearStyle.REPLICATE and over["blocks.1.attn.proj"] is LinearStyle.ROW


def test_bad_plans_and_dims_raise_clear_errors() -> None:
    with pytest.raises(ValueError, match="not a style"):
        InjectPolicy(plan={"head": "diagonal"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="not a valid regex"):
        InjectPolicy(plan={"(": "row"})
    with pytest.raises(ValueError, match="tp_size"):
        InjectPolicy(tp_size=0)
    model = GPT(CFG)
    with pytest.raises(InjectError, match="match no nn.Linear"):
        classify_linears(model, InjectPolicy(plan={"blocks.0.nope": "row"}))
    with pytest.raises(InjectError, match="not nn.Linear"):
        classify_linears(model, InjectPolicy(plan={"ln_f": "row"}))
    styles = classify_linears(model, InjectPolicy())
    with pytest.raises(InjectError, match=r"blocks.0.attn.qkv.*not divisible by tp_size=3"):
        validate_tp(model, styles, 3)
    bad = classify_linears(model, InjectPolicy(plan={r"blocks\.0\.mlp\.fc": "row"}))
    with pytest.raises(InjectError, match="no column-parallel layer precedes"):
        validate_tp(model, bad, 2)
    dangling = classify_linears(model, InjectPolicy(plan={r"blocks\.0\.mlp\.proj": "column"}))
    with pytest.raises(InjectError, match="ends with a sharded activation"):
        validate_tp(model, dangling, 2)
    with pytest.raises(ValueError, match="needs tp_group"):
        module_inject(model, InjectPolicy(tp_size=2))


# ------------------------------------------------------------------ kernel injection
def test_injected_kernels_match_the_modules_they_replace() -> None:
    torch.manual_seed(0)
    for make, shape in ((lambda: GPT(CFG), CFG.vocab_size), (Llama, 48)):
        ref = make()
        fused = module_inject(copy.deepcopy(ref), InjectPolicy(tp_size=1))
        kinds = {type(m) for m in fused.modules()}
        assert FusedSelfAttention in kinds
        if isinstance(ref, Llama):
            assert FusedNorm in kinds
            assert not any(isinstance(m, (ManualRMSNorm, ManualLayerNorm)) for m in fused.modules())
            assert not any(m.causal for m in fused.modules() if isinstance(m, FusedSelfAttention))  # detected
        idx = torch.randint(0, shape, (3, 12))
        tgt = torch.randint(0, shape, (3, 12))
        (l1, loss1), (l2, loss2) = ref(idx, tgt), fused(idx, tgt)
        torch.testing.assert_close(l2, l1, rtol=1e-5, atol=1e-5)
        loss1.backward(), loss2.backward()
        g1 = {n: p.grad for n, p in ref.named_parameters()}
        for n, p in fused.named_parameters():
            torch.testing.assert_close(p.grad, g1[n], rtol=1e-5, atol=1e-6, msg=n)


def test_mismatching_module_is_kept_with_a_warning() -> None:
    class Scaled(ManualAttention):  # an attention that is *not* plain SDPA: must not be replaced
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    model = nn.Sequential(Scaled(16, 4))
    with pytest.warns(UserWarning, match="kept as is"):
        module_inject(model, InjectPolicy())
    assert isinstance(model[0], Scaled)


# ------------------------------------------------------------------ TP=2 parity on gloo
def _train(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], full: bool) -> list[dict]:
    # SGD: Adam divides by sqrt(v), which turns 1e-9 grad noise on near-zero grads into 1e-2-relative steps.
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    log = []
    for idx, tgt in batches:
        opt.zero_grad()
        _, loss = model(idx, tgt)
        loss.backward()
        grads = (
            {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
            if full
            else tp_full_state(model, grads=True)
        )
        opt.step()
        params = (
            {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
            if full
            else tp_full_state(model)
        )
        log.append({"loss": loss.detach(), "grads": grads, "params": params})
    return log


def _tp_rank(rank: int, world: int) -> list[str]:
    checked = []
    for name, make, vocab in (("gpt", lambda: GPT(CFG), CFG.vocab_size), ("llama", Llama, 48)):
        torch.manual_seed(0)
        ref = make()
        tp_model = copy.deepcopy(ref)
        gen = torch.Generator().manual_seed(1)
        batches = [
            (torch.randint(0, vocab, (4, 12), generator=gen), torch.randint(0, vocab, (4, 12), generator=gen))
            for _ in range(3)
        ]
        groups = build_tp_groups(2)
        module_inject(tp_model, InjectPolicy(tp_size=2), tp_group=groups.tp_group)
        local = sum(p.numel() for p in tp_model.parameters())
        assert local < sum(p.numel() for p in ref.parameters()), "TP must shrink per-rank parameters"
        want, got = _train(ref, batches, True), _train(tp_model, batches, False)
        for step, (w, g) in enumerate(zip(want, got)):
            torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
            for kind in ("grads", "params"):
                assert set(g[kind]) == set(w[kind]), (name, kind, set(g[kind]) ^ set(w[kind]))
                for n in w[kind]:
                    torch.testing.assert_close(
                        g[kind][n],
                        w[kind][n],
                        rtol=1e-5,
                        atol=1e-6,
                        msg=lambda m, n=n, k=kind: f"{name} step {step} {k} {n}: {m}",
                    )
        # Export: the gathered full weights load into the original architecture and reproduce the TP outputs.
        exported = make()
        exported.load_state_dict(tp_full_state(tp_model))
        idx, tgt = batches[0]
        torch.testing.assert_close(exported(idx, tgt)[0], tp_model(idx, tgt)[0], rtol=1e-5, atol=1e-5)
        checked.append(name)
    # A batch that differs across the TP group is refused on the first forward, on every rank at once.
    model = GPT(CFG)
    module_inject(model, InjectPolicy(tp_size=2), tp_group=build_tp_groups(2).tp_group)
    idx = torch.full((2, 8), rank, dtype=torch.long)
    with pytest.raises(ValueError, match="received different inputs"):
        model(idx, idx)
    model(idx, idx)  # checked once only
    return checked


def test_tp2_training_matches_single_process() -> None:
    assert run_distributed(_tp_rank, 2, timeout=240) == [["gpt", "llama"]] * 2
