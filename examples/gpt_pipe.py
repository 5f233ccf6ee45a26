"""The example GPT (``examples.gpt_model``) as a pipeline layer list.

Recipe (how ``GPT`` maps onto ``zlightning.pipe``):

1. The token embedding becomes ``TiedLayerSpec("embed", nn.Embedding, V, D)``: first layer, ids -> vectors.
2. ``PositionalEmbedding`` adds the learned positions (its own layer, so only the token table is tied).
3. Each ``Block`` is a ``LayerSpec(Block, config)``; ``ln_f`` is ``LayerSpec(nn.LayerNorm, ...)``.
4. The output head is the same tie key with ``forward_fn=tied_head`` (``x @ embed.weight.T``): the first and the last
   stage each hold a copy of the table and the engine all-reduces its gradient between them.
5. ``loss_fn=lm_loss`` (cross-entropy over the flattened logits). Batches are ``(ids[:, :-1], ids[:, 1:])``.

``gpt_state_to_pipe`` maps a ``GPT`` state dict onto these layers, so a pipeline run can start from (and be compared
with) the plain model.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.gpt_model import Block, GPTConfig
from zlightning.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = ["PositionalEmbedding", "gpt_layers", "gpt_pipeline", "gpt_state_to_pipe", "lm_loss", "tied_head"]

class PositionalEmbedding(nn.Module):
    """Adds learned positions to token vectors: ``x_BTD + pos[:T]``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return x_BTD + self.pos_emb(torch.arange(x_BTD.shape[1], device=x_BTD.device))

class TokenEmbedding(nn.Embedding):
    """``nn.Embedding`` with GPT-2 initialisation (normal, std 0.02)."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__(vocab, d_model)
        nn.init.normal_(self.weight, std=0.02)

def tied_head(embedding: nn.Module, x_BTD: Tensor) -> Tensor:
    """The output head reusing the token table: logits = x @ W_emb^T."""
    return F.linear(x_BTD, embedding.weight)

def lm_loss(logits_BTV: Tensor, targets_BT: Tensor) -> Tensor:
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), targets_BT.reshape(-1))

def gpt_layers(config: GPTConfig) -> list[Any]:
    """The layer list: embed, positions, ``n_layer`` blocks, final norm, tied head."""
    return [
        TiedLayerSpec("embed", TokenEmbedding, config.vocab_size, config.d_model),
        LayerSpec(PositionalEmbedding, config),
        *[LayerSpec(Block, config) for _ in range(config.n_layer)],
        LayerSpec(nn.LayerNorm, config.d_model, bias=config.bias),
        TiedLayerSpec("embed", TokenEmbedding, config.vocab_size, config.d_model, forward_fn=tied_head),
    ]

def gpt_pipeline(config: GPTConfig, **kwargs: Any) -> PipelineModule:
    """``PipelineModule(gpt_layers(config), loss_fn=lm_loss, **kwargs)``; ``partition_method`` defaults to
    ``"type:Block"`` (equal transformer blocks per stage)."""
    kwargs.setdefault("partition_method", "type:Block")
    return PipelineModule(gpt_layers(config), loss_fn=lm_loss, **kwargs)

def gpt_state_to_pipe(state: dict[str, Tensor], config: GPTConfig) -> dict[str, Tensor]:
    """Renames a ``GPT`` state dict to the parameter names of a one-stage ``gpt_pipeline`` (``tied_modules.embed``,
    ``1.pos_emb``, ``2..`` blocks, final norm)."""
    n = config.n_layer
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        if name == "tok_emb.weight":
            out["tied_modules.embed.weight"] = value
        elif name == "pos_emb.weight":
            out["1.pos_emb.weight"] = value
        elif name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            out[f"{int(i) + 2}.{rest}"] = value
        elif name.startswith("ln_f."):
            out[f"{n + 2}.{name[len('ln_f.'):]}"] = value
    return out
