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


class MLPBlock(nn.Module):
    def __init__(self, d: int, extra: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.unused = nn.Linear(d, d) if extra else None  # never called: its grads stay None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class EdgeNet(nn.Module):
    """Exercises: a block called twice, a block never called, an unused sub-module, buffers, frozen parameters."""

    def __init__(self, d: int = 24, freeze: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([MLPBlock(d, extra=(i == 1)) for i in range(4)])
        self.out = nn.Linear(d, 1)
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        if freeze:
            self.inp.requires_grad_(False)
            self.blocks[2].fc.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.inp(x) * self.scale
        h = self.blocks[0](h)
        h = self.blocks[1](h)
        h = self.blocks[0](h)  # called twice
        h = self.blocks[2](h)  # blocks[3] is never called
        return self.out(h)


def edge_net(seed: int = 0, freeze: bool = False) -> EdgeNet:
    torch.manual_seed(seed)
    return EdgeNet(freeze=freeze)


def regression_batches(n: int, global_batch: int, seed: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(global_batch, 9, generator=g) for _ in range(n)]


def mse_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch[:, :8]).squeeze(-1), batch[:, 8])
