"""The example GPT trained on hybrid-CP batches (`HybridCPTextDataModule`) under DDP or ``zstack_zero3``.

Every training step receives this rank's `HybridCPBatch`: the document pieces it runs, each with the CP size and
block the scheduler chose. The module runs them one by one (``hybrid_cp_forward_backward``): each piece's zigzag
shard goes through the unmodified GPT with its attention routed through `cp_attention` (K/V gathered within the
piece's block), and each piece's loss is its masked token losses summed and divided by the global batch's loss-token
count, so the step's gradient is the same whatever the placement. Optimisation is manual (several backward passes
per step).

`gpt_cp_logits` runs the GPT on this rank's zigzag shard of one sub-sample: it calls the model's own submodules
(embeddings at the shard's *original* positions, every block with its attention routed through `cp_attention`, the
final norm and the tied head). `gpt_cp_loss` is that shard's summed token loss divided by the global token count;
`gpt_pad_loss` is the zero loss of a padding micro-step under ZeRO-3.

[Note: gradient reduction per strategy]
Summed over ranks, the per-rank gradients are the global batch's gradient (see
[Note: per-token loss normalised by the global token count] in ``zlightning/datamodules/hybrid_cp/_loop.py``).

* DDP (and any strategy that leaves ``.grad`` local): the micro-steps call ``loss.backward()`` directly, so DDP's
  reducer is never armed (Lightning's manual optimisation arms it only in ``manual_backward``); after the last
  micro-step the module all-reduces the gradients with SUM, in one flat buffer.
* ``zstack_zero3`` (any stage): the engine gathers parameters per forward and reduce-scatters with AVG over the
  ranks. The micro-steps run in lockstep (see [Note: lockstep micro-steps for ZeRO-3], same file), each inside the
  engine's ``forward_pass`` (the root unit is gathered per micro-step), with ``gradient_sync`` off until the last
  one, and the loss is multiplied by the world size so AVG gives the sum (a power of two: exact in floating point).

Validation uses the plain model forward on ``(x, y)`` batches.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor, nn
from typing_extensions import override

from zlightning.datamodules.hybrid_cp import HybridCPBatch, global_token_count, hybrid_cp_forward_backward
from zlightning.parallel import CPShard, HybridCPGroups, cp_attention
from zlightning.strategies.zero3 import ZStackZero3Strategy

from .gpt_model import GPT, GPTConfig

__all__ = ["CausalLM", "HybridCPGPTModule", "gpt_cp_logits", "gpt_cp_loss", "gpt_pad_loss"]


class CausalLM(Protocol):
    """The submodules of the example GPT (`GPT`) that a CP forward calls, in order (read-only members, so a model
    may declare narrower module types, e.g. ``drop: nn.Dropout``)."""

    @property
    def tok_emb(self) -> nn.Embedding: ...
    @property
    def pos_emb(self) -> nn.Embedding: ...
    @property
    def drop(self) -> nn.Module: ...
    @property
    def blocks(self) -> nn.ModuleList: ...
    @property
    def ln_f(self) -> nn.Module: ...
    @property
    def head(self) -> nn.Module: ...


def gpt_cp_logits(model: CausalLM, tokens_t: Tensor, shard: CPShard) -> Tensor:
    """Next-token logits of this rank's tokens of a sub-sample, with attention over the whole sub-sample.

    Equals the rows ``shard.q_positions`` of ``model(sub_sample[None])[0][0]``. Every rank of the block must call it
    together (the attention layers run collectives).

    Args:
        model: The example GPT, or any module with its submodule layout (`CausalLM`).
        tokens_t: int64 [t], this rank's `zigzag_shard` of the sub-sample's tokens.
        shard: This rank's `CPShard` of the sub-sample.

    Returns:
        [t, vocab] logits.

    Raises:
        ValueError: If ``tokens_t`` does not match the shard, or the sub-sample is longer than the position table.
    """
    if tokens_t.dim() != 1 or tokens_t.shape[0] != shard.num_tokens:
        raise ValueError(
            f"gpt_cp_logits: tokens must be 1-D with the shard's {shard.num_tokens} tokens, got "
            f"{tuple(tokens_t.shape)}; pass zigzag_shard(sub.data, cp_size, cp_rank)['tokens']."
        )
    length = shard.kv_positions.shape[0]
    if length > model.pos_emb.num_embeddings:
        raise ValueError(
            f"gpt_cp_logits: a sub-sample of {length} tokens exceeds the model's {model.pos_emb.num_embeddings} "
            f"positions; pack documents into pieces of at most config.seq_len tokens."
        )
    positions_t = shard.q_positions.to(tokens_t.device)
    x_1tD = model.drop(model.tok_emb(tokens_t[None]) + model.pos_emb(positions_t))
    with cp_attention(shard):
        for block in model.blocks:
            x_1tD = block(x_1tD)
    return model.head(model.ln_f(x_1tD))[0]


def gpt_cp_loss(
    model: CausalLM,
    tokens_t: Tensor,
    targets_t: Tensor,
    shard: CPShard,
    *,
    num_tokens: int | float,
    loss_mask_t: Tensor | None = None,
) -> Tensor:
    """This shard's summed next-token cross-entropy divided by the global batch's token count.

    See [Note: per-token loss normalised by the global token count] in ``zlightning/datamodules/hybrid_cp/_loop.py``.

    Args:
        model: The example GPT (`CausalLM`).
        tokens_t: int64 [t], this rank's shard of the input tokens.
        targets_t: int64 [t], this rank's shard of the next-token targets.
        shard: This rank's `CPShard`.
        num_tokens: Tokens of the whole global batch (`HybridCPBatch.total_tokens`), or the global sum of the loss
            mask when ``loss_mask_t`` is given.
        loss_mask_t: Optional float [t] weights of this rank's tokens.

    Returns:
        A scalar; its sum over all ranks and sub-samples is the global batch's mean token loss.

    Raises:
        ValueError: If ``num_tokens`` is not positive, or shapes disagree.
    """
    if not num_tokens > 0:
        raise ValueError(f"gpt_cp_loss: num_tokens must be > 0 (the global batch's token count), got {num_tokens}.")
    if targets_t.shape != tokens_t.shape or (loss_mask_t is not None and loss_mask_t.shape != tokens_t.shape):
        raise ValueError(f"gpt_cp_loss: targets and loss mask must have the tokens' shape {tuple(tokens_t.shape)}.")
    logits_tV = gpt_cp_logits(model, tokens_t, shard)
    losses_t = F.cross_entropy(logits_tV.float(), targets_t, reduction="none")
    if loss_mask_t is not None:
        losses_t = losses_t * loss_mask_t
    return losses_t.sum() / num_tokens


def gpt_pad_loss(model: CausalLM, device: torch.device | None = None) -> Tensor:
    """A zero loss that still runs every submodule of the example GPT (a padding micro-step, 2 tokens, CP size 1).

    Its gradients are zero, but every ZeRO unit is gathered in forward and backward exactly as in a real micro-step.
    See [Note: lockstep micro-steps for ZeRO-3] in ``zlightning/datamodules/hybrid_cp/_loop.py``.
    """
    tokens_t = torch.zeros(2, dtype=torch.int64, device=device)
    return gpt_cp_logits(model, tokens_t, CPShard.zigzag(2, 1, 0, None, device)).sum() * 0.0


class HybridCPGPTModule(LightningModule):
    """The example GPT with a training step that consumes `HybridCPBatch` (see the module docs).

    Args:
        config: The GPT's architecture; ``seq_len`` must cover the longest (padded) document piece.
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay of the matrices (vectors get none).
        loss_mask_key: Sub-sample key of the per-token loss weights; None weighs every token (normaliser
            ``HybridCPBatch.total_tokens``).
    """

    model: GPT
    losses: list[float]
    """Global-batch mean token loss of every training step (identical on every rank)."""

    def __init__(
        self, config: GPTConfig, lr: float = 1e-3, weight_decay: float = 0.1, loss_mask_key: str | None = "loss_mask"
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = GPT(config)
        self.lr = lr
        self.weight_decay = weight_decay
        self.loss_mask_key = loss_mask_key
        self.automatic_optimization = False
        self.losses = []
        self._groups: HybridCPGroups | None = None

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=self.lr)

    @override
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, HybridCPBatch):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, batch: HybridCPBatch, batch_idx: int) -> Tensor:
        if not isinstance(batch, HybridCPBatch):
            raise TypeError(
                f"HybridCPGPTModule.training_step expects a HybridCPBatch (use HybridCPTextDataModule or wrap the "
                f"loader in HybridCPDataLoaderWrapper), got {type(batch).__name__}."
            )
        if self._groups is None:
            self._groups = HybridCPGroups.build()  # once, on every rank at the same step
        groups = self._groups
        num_tokens = global_token_count(batch, groups.rank, key=self.loss_mask_key)
        mask_key = self.loss_mask_key

        def loss_fn(data: dict[str, Tensor], shard: CPShard) -> Tensor:
            mask = data[mask_key] if mask_key is not None else None
            return gpt_cp_loss(
                self.model, data["tokens"], data["labels"], shard, num_tokens=num_tokens, loss_mask_t=mask
            )

        strategy = self.trainer.strategy
        engine = strategy.engine if isinstance(strategy, ZStackZero3Strategy) else None
        if engine is None:
            total = hybrid_cp_forward_backward(batch, groups, loss_fn)
            _all_reduce_grads(self.model)
        else:
            scale = float(engine.world_size)

            def backward(loss: Tensor, is_last: bool) -> None:
                engine.gradient_sync = is_last
                try:
                    (loss * scale).backward()
                finally:
                    engine.gradient_sync = True

            device = self.device
            total = hybrid_cp_forward_backward(
                batch,
                groups,
                loss_fn,
                pad_loss_fn=lambda: gpt_pad_loss(self.model, device),
                step_context=engine.forward_pass,
                backward=backward,
            )
        optimizer = cast(LightningOptimizer, self.optimizers())  # configure_optimizers returns one optimizer
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = total.to(self.device)  # float64; on the module's device for NCCL
        dist.all_reduce(loss)
        self.losses.append(float(loss))
        self.log("train/loss", float(loss), prog_bar=True, batch_size=1)
        return loss.detach()

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)


def _all_reduce_grads(model: torch.nn.Module) -> None:
    """Sums every trainable parameter's gradient over the world in one flat all-reduce.

    A parameter without a gradient on this rank contributes zeros (every rank must send the same layout); one that
    got none on any rank keeps ``grad=None``, as in single-process training.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params or dist.get_world_size() == 1:
        return
    present = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
    flat = torch.cat([*grads, present.to(grads[0].dtype)])  # one collective: gradients, then presence counts
    dist.all_reduce(flat)
    offset = 0
    for p, used in zip(params, (flat[-len(params) :] > 0).tolist()):
        if used:
            p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
        offset += p.numel()
