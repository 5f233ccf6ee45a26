"""A small decoder-only transformer (GPT) in plain PyTorch.

This module imports only ``torch`` (and the standard library): it is shared by the Lightning example (`zlightning.models.gpt`)
and by benchmark environments that have no Lightning, so every framework trains the exact same model.

Shape suffixes in variable names: B = batch, T = sequence (time), D = d_model, H = heads, V = vocabulary.

[Note: parameter access only inside submodule forwards]
`GPT.forward` never reads a parameter (``.weight``) itself; it only calls submodules (``self.tok_emb(idx)``,
``self.head(x)``). A ZeRO-3 engine gathers a module's sharded parameters in that module's forward pre-hook and frees
them after its forward; a direct ``self.tok_emb.weight`` read in the parent is gathered on demand and then held until
the end of the step's backward (zlightning's engine does, see [Note: a parameter read outside its unit]; others
give an empty shard). The tied output head is therefore an ``nn.Linear`` whose ``weight`` *is* the embedding's
parameter, rather than a matmul with ``tok_emb.weight``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "Block", "CausalSelfAttention", "GPTConfig", "MLP"]


@dataclass(frozen=True)
class GPTConfig:
    """Architecture of `GPT`.

    Raises:
        ValueError: If a size is not positive, ``d_model`` is not divisible by ``n_head``, or ``dropout`` is not in
            [0, 1).
    """

    vocab_size: int = 256
    """Number of token ids (256 for bytes)."""
    seq_len: int = 256
    """Maximum context length (size of the learned position table)."""
    d_model: int = 256
    """Width of the residual stream."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``d_model``."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of ``d_model``."""
    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches."""
    bias: bool = True
    """Whether Linear and LayerNorm layers have biases (the tied output head never has one)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layer", "n_head", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}.")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: d_model={self.d_model} must be divisible by n_head={self.n_head}; "
                f"pick n_head among the divisors of d_model."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}.")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_head


# A data-only frozen dataclass: rebuilding it sets fields and calls nothing a file chooses (see [Note: what loading
# trusts] in zlightning/_safe_load.py). Modules that keep a GPTConfig in their hyper-parameters (HybridCPGPTModule,
# the pipeline GPT) then resume under Lightning's own strategies, which load checkpoints weights-only, without the
# unsafe-load opt-in.
torch.serialization.add_safe_globals([GPTConfig])


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention(is_causal=True)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x_BTD: Tensor) -> Tensor:
        B, T, _ = x_BTD.shape
        inner = self.qkv.out_features // 3  # read from the layer: head pruning may have removed heads
        q, k, v = self.qkv(x_BTD).split(inner, dim=2)
        q_BHTd, k_BHTd, v_BHTd = (t.view(B, T, self.n_head, inner // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, dropout_p=p, is_causal=True)
        y_BTI = y_BHTd.transpose(1, 2).contiguous().view(B, T, inner)
        return self.resid_drop(self.proj(y_BTI))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear → GELU → Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.drop(self.proj(self.act(self.fc(x_BTD))))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x_BTD: Tensor) -> Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.mlp(self.ln_2(x_BTD))


class GPT(nn.Module):
    """Decoder-only transformer language model with learned positions and a tied output head.

    Parameters are initialised GPT-2 style: normal(0, 0.02) for Linear and Embedding weights, zero biases, and the
    residual output projections (``attn.proj``, ``mlp.proj``) scaled by ``1/sqrt(2 * n_layer)`` so the residual stream's
    variance does not grow with depth. Initialisation draws only from torch's global RNG, so it is deterministic
    after ``torch.manual_seed``.

    Args:
        config: The architecture.
    """

    config: GPTConfig
    tok_emb: nn.Embedding  # weight [V, D], shared with head.weight
    pos_emb: nn.Embedding  # weight [seq_len, D]
    blocks: nn.ModuleList
    ln_f: nn.LayerNorm
    head: nn.Linear  # weight [V, D] is tok_emb.weight

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied; see [Note: parameter access only inside submodule forwards]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """(Re-)initialise every parameter GPT-2 style; see the class docstring."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if module is self.head:
                continue  # tied to tok_emb, initialised there
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = resid_std if name.endswith(("attn.proj", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Next-token logits, and the mean cross-entropy loss when targets are given.

        Args:
            idx: Int64 token ids, shape [B, T] with ``T <= config.seq_len``.
            targets: Optional int64 next-token ids, shape [B, T].

        Returns:
            ``(logits, loss)``: logits of shape [B, T, vocab_size]; loss is a scalar, or None without targets.

        Raises:
            ValueError: If ``idx`` is not 2-D, is longer than ``seq_len``, or ``targets`` has another shape.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must have shape [batch, seq], got {tuple(idx.shape)}.")
        T = idx.shape[1]
        if self.config.seq_len < T:
            raise ValueError(
                f"GPT.forward: sequence length {T} exceeds config.seq_len={self.config.seq_len}; "
                "crop the input (generate() does this) or build the model with a larger seq_len."
            )
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"GPT.forward: targets shape {tuple(targets.shape)} != idx shape {tuple(idx.shape)}.")
        pos_T = torch.arange(T, device=idx.device)
        x_BTD = self.drop(self.tok_emb(idx) + self.pos_emb(pos_T))
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.head(self.ln_f(x_BTD))
        if targets is None:
            return logits_BTV, None
        loss = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), targets.reshape(-1))
        return logits_BTV, loss

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None) -> Tensor:
        """Sample a continuation autoregressively, one token per forward pass.

        The context fed to the model is cropped to the last ``config.seq_len`` tokens. The module's train/eval mode is
        left as it is; call ``eval()`` first to disable dropout.

        Args:
            idx: Int64 prompt ids, shape [B, T] with T >= 1.
            max_new_tokens: Number of tokens to append.
            temperature: Softmax temperature (> 0); lower is greedier.
            top_k: If given, sample only among the ``top_k`` most likely tokens (``top_k=1`` is greedy).

        Returns:
            Int64 tensor of shape [B, T + max_new_tokens]: the prompt followed by the sampled tokens.

        Raises:
            ValueError: For an empty prompt, a negative ``max_new_tokens``, ``temperature <= 0`` or ``top_k < 1``.
        """
        if idx.dim() != 2 or idx.shape[1] < 1:
            raise ValueError(f"GPT.generate: idx must have shape [batch, seq] with seq >= 1, got {tuple(idx.shape)}.")
        if max_new_tokens < 0:
            raise ValueError(f"GPT.generate: max_new_tokens must be >= 0, got {max_new_tokens}.")
        if not temperature > 0:
            raise ValueError(f"GPT.generate: temperature must be > 0, got {temperature}; use top_k=1 for greedy.")
        if top_k is not None and top_k < 1:
            raise ValueError(f"GPT.generate: top_k must be None or >= 1, got {top_k}.")
        for _ in range(max_new_tokens):
            logits_BTV, _ = self(idx[:, -self.config.seq_len :])
            logits_BV = logits_BTV[:, -1, :].float() / temperature
            if top_k is not None:
                kth_B1 = torch.topk(logits_BV, min(top_k, logits_BV.shape[-1]), dim=-1).values[:, -1:]
                logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
            next_B1 = torch.multinomial(F.softmax(logits_BV, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_B1], dim=1)
        return idx
