"""The example GPT (``zlightning.models.gpt_model``) as a pipeline layer list, and a LightningModule training it.

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

from typing import Any, cast

import torch
import torch.nn.functional as F
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn
from typing_extensions import override

from zlightning._run_report import stock_callbacks
from zlightning.models.gpt import LinearWarmup
from zlightning.models.gpt_model import Block, GPTConfig
from zlightning.pipe import LayerSpec, PipelineModule, TiedLayerSpec

__all__ = [
    "GPTPipelineModule",
    "PositionalEmbedding",
    "gpt_layers",
    "gpt_pipeline",
    "gpt_state_to_pipe",
    "lm_loss",
    "tied_head",
]


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
    return F.linear(x_BTD, cast(Tensor, embedding.weight))  # the token table's weight


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
            out[f"{n + 2}.{name[len('ln_f.') :]}"] = value
    return out


class GPTPipelineModule(LightningModule):
    """The example GPT as a pipeline (`gpt_pipeline`) inside a LightningModule, for ``strategy="zstack_pipeline"``.

    Pair it with `zlightning.datamodules.TextCorpusDataModule`: its ``(x, y)`` batches go to the schedule as they are.
    The loader's batch size must be a multiple of the strategy's ``micro_batches`` (4 by default).
    ``zlightning fit --config examples/gpt_pipeline.yaml`` trains it on 2 processes.

    Args:
        vocab_size: the architecture (see `GPTConfig`).
        seq_len: the architecture (see `GPTConfig`).
        d_model: the architecture (see `GPTConfig`).
        n_layer: the architecture (see `GPTConfig`).
        n_head: the architecture (see `GPTConfig`).
        lr: peak AdamW learning rate, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW weight decay on matrices and embeddings (not on biases and norms).

    Raises:
        ValueError: an invalid architecture (see `GPTConfig`) or ``lr <= 0``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 128,
        d_model: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        if not lr > 0:
            raise ValueError(f"GPTPipelineModule: lr must be > 0, got {lr!r}.")
        self.save_hyperparameters()
        config = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layer=n_layer, n_head=n_head)
        self.pipe = gpt_pipeline(config)  # a PipelineModule: the strategy builds only this rank's stage

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipe.batch_loss(tuple(batch))  # runs the schedule, backward included
        self.log("train/loss", loss, prog_bar=True)  # the batch's mean loss, the same on every rank
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.pipe.batch_loss(tuple(batch)), prog_bar=True, sync_dist=True)

    @override
    def configure_callbacks(self) -> list[Callback]:
        """The fixed progress bar, model summary and end-of-fit summary (as `GPTLightningModule`)."""
        return stock_callbacks(self.trainer) if self._trainer is not None else []

    @override
    def configure_optimizers(self) -> Any:
        """AdamW over this rank's stage (decay on matrices only) with a linear warmup."""
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=(0.9, 0.95))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
