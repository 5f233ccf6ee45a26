"""Lightning wrapper of the example byte-level GPT (`zlightning.models.gpt_model.GPT`).

Pair it with `zlightning.datamodules.TextCorpusDataModule` (vocabulary 256, samples ``(x, y)`` of shape
[batch, seq_len]). It runs unchanged on CPU or GPU and under any strategy: it never picks a device itself.

Logged metrics (per training step unless noted):
  * ``train/loss``, ``train/ppl``: mean cross-entropy of the micro-batch and its perplexity;
  * ``train/tokens_per_s``: input tokens of the previous micro-batch times the world size, divided by the wall time
    between the starts of the previous and the current micro-batch (see [Note: throughput timing]);
  * ``train/rss_mb``: this process's resident memory (Linux ``/proc/self/status``; not logged elsewhere);
  * ``val/loss``, ``val/ppl``: averaged over the validation epoch and across ranks.

[Note: throughput timing]
The time between two consecutive ``on_train_batch_start`` calls covers everything done for one micro-batch: data
loading, forward, backward, optimizer step and logging, i.e. what a user's wall clock sees. It needs no device
synchronisation (unlike CUDA events around the step), so measuring adds no stall. The first micro-batch, and the
first one after a validation loop, have no previous start to compare with and log no throughput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torchmetrics.text import Perplexity
from typing_extensions import override

from zlightning._run_report import stock_callbacks

from .gpt_model import GPT, GPTConfig

__all__ = ["GPTLightningModule", "LinearWarmup", "resident_memory_mb"]


def resident_memory_mb() -> float | None:
    """Resident set size of this process in MiB, from ``/proc/self/status`` (``VmRSS``).

    Returns:
        The RSS in MiB, or None where ``/proc`` is unavailable (non-Linux).
    """
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0  # the value is in kB
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class LinearWarmup:
    """Learning-rate multiplier for ``LambdaLR``: ramps linearly to 1 over ``warmup_steps`` steps, then stays at 1.

    A callable object rather than a lambda so the scheduler state (and the module) stays picklable.
    """

    warmup_steps: int
    """Number of steps to reach the full learning rate; 0 disables warmup."""

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


class GPTLightningModule(LightningModule):
    """Byte-level GPT language model trained with AdamW and a linear warmup.

    Args:
        vocab_size: Number of token ids (256 for bytes).
        seq_len: Maximum context length.
        d_model: Width of the residual stream.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide ``d_model``.
        dropout: Dropout probability.
        lr: Peak learning rate.
        weight_decay: AdamW weight decay, applied only to parameters with 2 or more dimensions (matrices and
            embeddings), not to biases and LayerNorm parameters.
        betas: AdamW ``(beta1, beta2)``.
        warmup_steps: Optimizer steps of linear learning-rate warmup.

    Raises:
        ValueError: For an invalid architecture (see `GPTConfig`) or optimizer setting.
    """

    model: GPT

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 256,
        d_model: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        dropout: float = 0.0,
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        _check_optimizer_args(lr, weight_decay, betas, warmup_steps)
        self.save_hyperparameters()
        config = GPTConfig(
            vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, n_layer=n_layer, n_head=n_head, dropout=dropout
        )
        self.model = GPT(config)
        self.train_ppl = Perplexity()
        self.val_ppl = Perplexity()
        self._last_batch_start: float | None = None
        self._last_batch_tokens = 0
        self._tokens_per_s: float | None = None

    @override
    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape [B, T, vocab_size] for token ids ``idx`` of shape [B, T]."""
        logits, _ = self.model(idx)
        return logits

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # See [Note: throughput timing].
        now = time.perf_counter()
        if self._last_batch_start is not None and now > self._last_batch_start:
            tokens = self._last_batch_tokens * self.trainer.world_size
            self._tokens_per_s = tokens / (now - self._last_batch_start)
        self._last_batch_start = now
        self._last_batch_tokens = batch[0].numel()

    @override
    def on_train_epoch_start(self) -> None:
        self._reset_timer()

    @override
    def on_validation_end(self) -> None:
        self._reset_timer()  # the next gap would include the validation loop

    def _reset_timer(self) -> None:
        self._last_batch_start = None
        self._tokens_per_s = None

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        self.train_ppl(logits.detach().float(), y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/ppl", self.train_ppl, on_step=True, on_epoch=False)
        if self._tokens_per_s is not None:
            self.log("train/tokens_per_s", self._tokens_per_s, on_step=True, on_epoch=False)
        rss = resident_memory_mb()
        if rss is not None:
            self.log("train/rss_mb", rss, on_step=True, on_epoch=False)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        self.val_ppl.update(logits.float(), y)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/ppl", self.val_ppl, on_step=False, on_epoch=True)
        return loss

    @override
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        _, loss = self.model(x, y)
        self.log("test/loss", loss, sync_dist=True)
        return loss

    @override
    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Greedy next-byte predictions for every position of ``x``."""
        return self.model(batch[0])[0].argmax(dim=-1)

    @override
    def configure_callbacks(self) -> list[Callback]:
        """A progress bar with correct totals, a model summary with the sharded sizes, and the end-of-fit summary
        (final losses, tokens/s, logs, checkpoint); each replaces only Lightning's stock counterpart. See
        [Note: fixing Lightning's progress bar and summary] in ``zlightning/_run_report.py``."""
        return stock_callbacks(self.trainer) if self._trainer is not None else []

    @override
    def configure_optimizers(self) -> Any:
        """AdamW with weight decay on matrices/embeddings only, and a per-step linear warmup (`LinearWarmup`)."""
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        params = [p for _, p in self.named_parameters() if p.requires_grad]  # tied weights appear once
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=hp.lr, betas=tuple(hp.betas))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(hp.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def generate_text(self, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8, top_k: int = 40) -> str:
        """Continue a text prompt, byte by byte.

        Dropout is disabled while sampling and the previous train/eval mode restored afterwards.

        Args:
            prompt: Non-empty text; encoded as UTF-8 bytes.
            max_new_tokens: Number of bytes to sample.
            temperature: Softmax temperature (> 0).
            top_k: Sample only among this many most likely bytes.

        Returns:
            The prompt followed by the continuation, decoded as UTF-8 with invalid bytes replaced by U+FFFD.

        Raises:
            ValueError: If ``prompt`` is empty, or for invalid sampling settings (see `GPT.generate`).
        """
        if not prompt:
            raise ValueError("GPTLightningModule.generate_text: prompt must be non-empty, e.g. '\\n' or 'def '.")
        idx = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long, device=self.device)
        was_training = self.training
        self.eval()
        try:
            out = self.model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k)
        finally:
            self.train(was_training)
        return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def _check_optimizer_args(lr: float, weight_decay: float, betas: tuple[float, float], warmup_steps: int) -> None:
    if not lr > 0:
        raise ValueError(f"GPTLightningModule: lr must be > 0, got {lr!r}.")
    if not weight_decay >= 0:
        raise ValueError(f"GPTLightningModule: weight_decay must be >= 0, got {weight_decay!r}.")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"GPTLightningModule: betas must be two floats in [0, 1), got {betas!r}.")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"GPTLightningModule: warmup_steps must be an int >= 0, got {warmup_steps!r}.")
