"""module_inject on models written the way users write them, beyond the bundled GPT and the Llama-like model:

* kernel injection never changes what a module computes while training: a functional dropout in an MLP, a timm-style
  dropout of the attention probabilities, or a ``self.dropout`` applied to them keep their module (the fused
  replacement would drop or move the dropout); so do sliding-window attention, attention taking a padding mask, and a
  norm holding a buffer;
* tensor parallelism on 2 gloo ranks equals one process with a scaled embedding (an ``nn.Embedding`` subclass with
  its own forward) tied to the head, a small auxiliary embedding, and attention whose head count is ``self.heads``;
  and on ``nn.TransformerEncoder`` (attention replicated, MLPs split), in inference under ``no_grad`` too (PyTorch's
  fast path); a model with nothing to split says so;
* a GPT-NeoX-style block (parallel residual; a head-major fused ``query_key_value`` whose attention infers its head
  count from the width, and ``dense`` after it) splits whole heads and equals one process (its ``dense`` was taken
  for a column layer and ``query_key_value`` was cut as ``[q; k; v]``, mixing heads);
* attention that cannot be split safely is refused with an error naming the module and the plan that works: heads
  under an unrecognised layout, and key/value heads (read from the module's ``config`` as Hugging Face keeps them)
  that the TP size does not divide.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.test_inject_tp import _train
from zlightning.inject import (
    FusedSelfAttention,
    InjectError,
    InjectPolicy,
    build_tp_groups,
    classify_linears,
    module_inject,
    tp_full_state,
)
from zlightning.inject._api import _inject_attention
from zlightning.inject._classify import validate_tp
from zlightning.testing import run_distributed

D = 16


class FuncDropMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.dropout(F.gelu(self.fc1(x)), p=0.5, training=self.training))


class SplitAttention(nn.Module):
    """Causal attention on q/k/v/o projections; ``prob_drop`` applies ``self.dropout`` to the probabilities (BERT's
    naming), ``window`` restricts it to the last positions, ``masked`` takes a padding mask."""

    def __init__(self, heads_attr: str = "num_heads", prob_drop: float = 0.0, window: int = 0) -> None:
        super().__init__()
        setattr(self, heads_attr, 4)
        self.heads_attr = heads_attr
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(D, D) for _ in range(4))
        if prob_drop:
            self.dropout = nn.Dropout(prob_drop)
        self.window = window

    def _attend(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        h = getattr(self, self.heads_attr)
        q, k, v = (p(x).view(B, T, h, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        i = torch.arange(T)
        allowed = i[None, :] <= i[:, None]
        if self.window:
            allowed = allowed & (i[:, None] - i[None, :] < self.window)
        scores = (q @ k.transpose(-1, -2) / math.sqrt(D // h)).masked_fill(~allowed, float("-inf"))
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        att = scores.softmax(-1)
        if hasattr(self, "dropout"):
            att = self.dropout(att)
        return self.o_proj((att @ v).transpose(1, 2).reshape(B, T, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._attend(x)


class MaskedAttention(SplitAttention):
    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self._attend(x, key_padding_mask)


class BufferNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(D) + 0.5)
        self.register_buffer("eps", torch.tensor(1e-6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.norm = norm if norm is not None else nn.LayerNorm(D)
        self.attn, self.mlp = attn, mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))
        return x + self.mlp(x)


def _plain_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))


class Net(nn.Module):
    def __init__(self, *blocks: Block) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def _inject_and_check(net: Net, kept: list[str]) -> None:
    """Injects kernels; ``kept`` modules must stay as they are and the whole net must compute the same in eval and,
    from the same seed, in training mode."""
    ref = copy.deepcopy(net)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module_inject(net, InjectPolicy())
    for name in kept:
        assert type(net.get_submodule(name)) is type(ref.get_submodule(name)), name
    x = torch.randn(2, 12, D, generator=torch.Generator().manual_seed(0))
    for training in (False, True):
        net.train(training), ref.train(training)
        with torch.no_grad():
            torch.manual_seed(5)
            want = ref(x)
            torch.manual_seed(5)
            got = net(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"training={training}")


def test_dropout_a_fused_module_would_lose_or_move_keeps_the_module() -> None:
    torch.manual_seed(0)
    net = Net(
        Block(SplitAttention(prob_drop=0.5), FuncDropMLP()),
        Block(SplitAttention(), _plain_mlp()),  # nothing stochastic: fused
    )
    _inject_and_check(net, ["blocks.0.attn", "blocks.0.mlp"])
    assert isinstance(net.blocks[1].attn, FusedSelfAttention)


def test_windowed_masked_attention_and_a_norm_with_a_buffer_are_kept() -> None:
    torch.manual_seed(0)
    net = Net(Block(SplitAttention(window=4), _plain_mlp(), BufferNorm()), Block(MaskedAttention(), _plain_mlp()))
    keys = list(net.state_dict())
    _inject_and_check(net, ["blocks.0.attn", "blocks.0.norm", "blocks.1.attn"])
    assert list(net.state_dict()) == keys


class ScaledEmbedding(nn.Embedding):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx) * math.sqrt(self.embedding_dim)


class LM(nn.Module):
    """A scaled token embedding tied to the head, a 5-wide auxiliary embedding, attention with ``self.heads``."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.tok = ScaledEmbedding(vocab, D)
        self.aux = nn.Embedding(10, 5)
        self.aux_proj = nn.Linear(5, D)
        self.blocks = nn.ModuleList(Block(SplitAttention(heads_attr="heads"), _plain_mlp()) for _ in range(2))
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx) * 0.1 + self.aux_proj(self.aux(idx % 10))
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _tp2_equals_one_process(make: Callable[[], nn.Module]) -> nn.Module:
    """Builds ``make()`` from one seed, splits a copy over the 2-rank TP group, trains both 3 SGD steps on the same
    batches and checks that losses and every parameter agree; returns the split model."""
    torch.manual_seed(0)
    ref = make()
    tp = copy.deepcopy(ref)
    module_inject(tp, InjectPolicy(tp_size=2, inject_kernels=False), tp_group=build_tp_groups(2).tp_group)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (2, 8), generator=gen), torch.randint(0, 32, (2, 8), generator=gen))] * 3
    want, got = _train(ref, batches, True), _train(tp, batches, False)
    for step, (w, g) in enumerate(zip(want, got)):
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-6)
        for n in w["params"]:
            torch.testing.assert_close(g["params"][n], w["params"][n], rtol=1e-5, atol=1e-6, msg=f"{step} {n}")
    return tp


def _tp_rank(rank: int, world: int) -> bool:
    tp = _tp2_equals_one_process(LM)
    assert isinstance(tp.blocks[0].attn, FusedSelfAttention)  # its heads ("heads") are split with the projections
    assert type(tp.tok) is ScaledEmbedding and tp.head.weight is tp.tok.weight  # replicated, still tied
    exported = LM()
    exported.load_state_dict(tp_full_state(tp))

    # nn.TransformerEncoder: attention (in_proj_weight) replicated, MLP split; inference under no_grad (PyTorch's
    # fast path reads the Linear weights directly) and training equal one process
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    sharded = copy.deepcopy(encoder)
    module_inject(sharded, InjectPolicy(tp_size=2), tp_group=build_tp_groups(2).tp_group)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(2))
    encoder.eval(), sharded.eval()
    with torch.no_grad():
        torch.testing.assert_close(sharded(x), encoder(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sharded(x), encoder(x), rtol=1e-5, atol=1e-5)
    assert sum(p.numel() for p in sharded.parameters()) < sum(p.numel() for p in encoder.parameters())

    # nothing to split (no blocks in an nn.ModuleList, no head): said, not silent
    flat = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
    with pytest.warns(UserWarning, match="splits no Linear of Sequential"):
        module_inject(flat, InjectPolicy(tp_size=2), tp_group=build_tp_groups(2).tp_group)
    return True


def test_tp2_on_user_models_matches_one_process() -> None:
    assert run_distributed(_tp_rank, 2, timeout=240) == [True, True]


class LucidAttention(nn.Module):
    """Fused ``to_qkv`` and ``to_out = Sequential(Linear, Dropout)``: the forward splits by ``self.heads``."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = 4
        self.to_qkv = nn.Linear(D, 3 * D, bias=False)
        self.to_out = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(out.transpose(1, 2).reshape(B, T, D))


def test_attention_that_cannot_be_split_safely_is_refused_with_the_plan_that_works() -> None:
    net = Net(Block(LucidAttention(), _plain_mlp()))
    policy = InjectPolicy(tp_size=2)
    styles = classify_linears(net, policy)
    validate_tp(net, styles, 2)
    with pytest.raises(InjectError, match=r"blocks.0.attn \(LucidAttention\).*not recognised.*'replicate'"):
        _inject_attention(net, styles, policy, required=True)
    planned = InjectPolicy(tp_size=2, plan={r"blocks\.0\.attn\..*": "replicate"})
    _inject_attention(net, classify_linears(net, planned), planned, required=True)  # the user's plan decides

    gqa = SplitAttention()
    gqa.config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=1)  # Hugging Face keeps them here
    net = Net(Block(gqa, _plain_mlp()))
    with pytest.raises(InjectError, match="num_key_value_heads=1 is not divisible by tp_size=2"):
        validate_tp(net, classify_linears(net, policy), 2)


class HeadMajorAttention(nn.Module):
    """GPT-NeoX's layout: ``query_key_value`` rows head by head (``[q_h; k_h; v_h]``), the head count read from the
    width, the output projection named ``dense``."""

    def __init__(self) -> None:
        super().__init__()
        self.head_size = D // 4
        self.query_key_value = nn.Linear(D, 3 * D)
        self.dense = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.query_key_value(x).view(B, T, -1, 3 * self.head_size).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(out.transpose(1, 2).reshape(B, T, -1))


class NeoXMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense_h_to_4h, self.dense_4h_to_h = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)))


class NeoXBlock(nn.Module):
    """Registered as GPT-NeoX registers them: both norms, then the attention, then the MLP (parallel residual)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attention, self.mlp = HeadMajorAttention(), NeoXMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.input_layernorm(x)) + self.mlp(self.post_attention_layernorm(x))


class NeoXLM(nn.Module):
    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        self.embed_in = nn.Embedding(vocab, D)
        self.layers = nn.ModuleList(NeoXBlock() for _ in range(2))
        self.embed_out = nn.Linear(D, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed_in(idx)
        for layer in self.layers:
            x = layer(x)
        logits = self.embed_out(x)
        return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _neox_rank(rank: int, world: int) -> bool:
    tp = _tp2_equals_one_process(NeoXLM)
    assert tp.layers[0].attention.query_key_value.chunks == 1  # whole heads, not a [q; k; v] split
    return True


def test_neox_style_head_major_attention_splits_whole_heads() -> None:
    styles = classify_linears(NeoXLM(), InjectPolicy(tp_size=2))
    assert styles["layers.0.attention.query_key_value"].value == "column"
    assert styles["layers.0.attention.dense"].value == "row"
    assert styles["layers.0.mlp.dense_h_to_4h"].value == "column"
    assert styles["layers.0.mlp.dense_4h_to_h"].value == "row"
    assert run_distributed(_neox_rank, 2, timeout=240) == [True, True]


class MaskAttention(nn.Module):
    """OPT's layout: a forward taking a mask (so it cannot be rebuilt on SDPA) and viewing by ``self.num_heads``
    with the sequence length inferred; ``fixed_width`` reshapes its output to ``self.embed_dim`` instead of -1."""

    def __init__(self, fixed_width: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.embed_dim, self.fixed_width = 4, D // 4, D, fixed_width
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        B, T, _ = x.shape
        q, k, v = (
            p(x).view(B, -1, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, is_causal=attention_mask is None)
        out = out.transpose(1, 2).reshape(B, T, self.embed_dim if self.fixed_width else -1)
        return self.out_proj(out), None


class MaskBlock(nn.Module):
    def __init__(self, fixed_width: bool = False) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(D), MaskAttention(fixed_width), _plain_mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm(x))[0]
        return x + self.mlp(x)


class MaskLM(NeoXLM):
    def __init__(self, fixed_width: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MaskBlock(fixed_width) for _ in range(2))


def _mask_attention_rank(rank: int, world: int) -> dict[str, object]:
    tp = _tp2_equals_one_process(MaskLM)
    try:
        module_inject(MaskLM(fixed_width=True), InjectPolicy(tp_size=2), tp_group=build_tp_groups(2).tp_group)
        refused = None
    except InjectError as err:
        refused = str(err)
    return {"heads": tp.layers[0].attn.num_heads, "refused": refused}


def test_attention_taking_a_mask_splits_its_own_heads() -> None:
    """An attention that cannot be rebuilt on SDPA (it takes a mask) but runs on a rank's heads once its
    ``num_heads`` holds the local count is split, and equals one process; one whose forward keeps the full width is
    still refused (checked on a probe, not assumed)."""
    for r in run_distributed(_mask_attention_rank, 2, timeout=240):
        assert r["heads"] == 2
        assert r["refused"] is not None and "could not be rebuilt" in r["refused"], r["refused"]


class SelfAttentionNoOut(nn.Module):
    """BERT's layout: query/key/value only (the output projection lives in a sibling module), a head count
    attribute, the heads read from the width."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = 4, D // 4
        self.query, self.key, self.value = (nn.Linear(D, D) for _ in range(3))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor]:
        shape = (*x.shape[:-1], -1, self.attention_head_size)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return (out.transpose(1, 2).reshape(*x.shape[:-1], -1),)


class SelfOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.LayerNorm = nn.Linear(D, D), nn.LayerNorm(D)

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(h) + x)


class BertLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn, self.output, self.mlp = SelfAttentionNoOut(), SelfOutput(), _plain_mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.output(self.self_attn(x)[0], x)
        return x + self.mlp(x)


class BertLM(NeoXLM):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BertLayer() for _ in range(2))


def _bert_rank(rank: int, world: int) -> bool:
    tp = _tp2_equals_one_process(BertLM)
    assert tp.layers[0].self_attn.query.weight.shape[0] == D // 2
    return True


def test_attention_whose_output_projection_lives_elsewhere_splits_its_heads() -> None:
    """BERT-style self-attention (no output projection of its own, refused before as unrecognised) is split when
    the probe shows each rank's copy computes its heads' slice of the output; one process agrees."""
    assert run_distributed(_bert_rank, 2, timeout=240) == [True, True]


def test_a_compressed_model_is_refused_not_silently_stripped() -> None:
    """Kernel injection or tensor parallelism would replace compressed layers and drop their masks: refused, naming
    the layers (ZStackZero3Strategy(tensor_parallel_size=2) with compression callbacks raised an unrelated head-count
    error before)."""
    from zlightning.compression import init_compression

    config = {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
                "different_groups": {"sp": {"params": {"dense_ratio": 0.5}, "modules": [r"attn\."]}},
            }
        }
    }
    net = init_compression(Net(Block(SplitAttention(), _plain_mlp())), config)
    with pytest.raises(InjectError, match=r"\['blocks.0.attn.q_proj'.*carry compression techniques"):
        module_inject(net, InjectPolicy())
