"""Small models and a reference training loop shared by the ZeRO-3 tests."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from examples.gpt_model import GPT, GPTConfig


def tiny_gpt(seed: int = 0, **overrides: Any) -> GPT:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=64, seq_len=16, d_model=32, n_layer=3, n_head=4, bias=False)
    cfg.update(overrides)
    return GPT(GPTConfig(**cfg))


def batches(n: int, global_batch: int, seq_len: int = 16, vocab: int = 64, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (global_batch, seq_len + 1), generator=g) for _ in range(n)]


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    _, loss = model(batch[:, :-1], batch[:, 1:])
    return loss


def reference_train(
    model: nn.Module,
    data: list[torch.Tensor],
    *,
    accumulate: int,
    clip: float,
    lr: float = 1e-3,
    loss_fn: Any = gpt_loss,
) -> tuple[nn.Module, list[float], torch.optim.Optimizer]:
    """Single-process training on the global batches; each group of ``accumulate`` batches is one step."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    losses = []
    for i, batch in enumerate(data):
        loss = loss_fn(model, batch)
        losses.append(float(loss.detach()))
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return model, losses, opt
