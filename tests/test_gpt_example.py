"""Tests of the example byte-level GPT (`examples.gpt_model`) and its Lightning module (`examples.gpt`)."""

from __future__ import annotations

import math

import lightning
import pytest
import torch
from zlightning.datamodules import TextCorpusDataModule

from examples.gpt import GPTLightningModule, LinearWarmup, resident_memory_mb
from examples.gpt_model import GPT, GPTConfig

TINY = GPTConfig(seq_len=32, d_model=32, n_layer=2, n_head=2)


def _model(seed: int = 0, config: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def test_forward_shapes_and_loss() -> None:
    model = _model()
    idx = torch.randint(0, 256, (3, 20))
    logits, loss = model(idx)
    assert logits.shape == (3, 20, 256) and loss is None
    logits, loss = model(idx, torch.randint(0, 256, (3, 20)))
    assert loss is not None and loss.dim() == 0
    # A freshly initialised model predicts nearly uniformly.
    assert abs(loss.item() - math.log(256)) < 0.5


def test_tied_weights_share_storage() -> None:
    model = _model()
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names  # counted once
    assert model.head.bias is None


def test_init_is_deterministic_and_scaled() -> None:
    a, b = _model(seed=3), _model(seed=3)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), name
    proj = a.blocks[0].attn.proj.weight.std().item()
    fc = a.blocks[0].mlp.fc.weight.std().item()
    assert proj == pytest.approx(0.02 / math.sqrt(2 * TINY.n_layer), rel=0.2)
    assert fc == pytest.approx(0.02, rel=0.2)


def test_loss_decreases_on_tiny_batch() -> None:
    model = _model()
    torch.manual_seed(1)
    x = torch.randint(0, 256, (4, 33))
    inputs, targets = x[:, :-1], x[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_generate_length_and_context_crop() -> None:
    model = _model().eval()
    out = model.generate(torch.randint(0, 256, (2, 5)), max_new_tokens=40, top_k=5)  # runs past seq_len=32
    assert out.shape == (2, 45) and out.dtype == torch.int64
    assert int(out.min()) >= 0 and int(out.max()) < 256
    greedy_a = model.generate(out[:, :5], max_new_tokens=8, top_k=1)
    greedy_b = model.generate(out[:, :5], max_new_tokens=8, top_k=1)
    assert torch.equal(greedy_a, greedy_b)


def test_model_errors() -> None:
    with pytest.raises(ValueError, match="d_model=30 must be divisible by n_head=4"):
        GPTConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="n_layer must be a positive int, got 0"):
        GPTConfig(n_layer=0)
    with pytest.raises(ValueError, match=r"dropout must be in \[0, 1\)"):
        GPTConfig(dropout=1.0)
    model = _model()
    with pytest.raises(ValueError, match="sequence length 33 exceeds config.seq_len=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        model.generate(torch.zeros(1, 1, dtype=torch.long), 1, temperature=0.0)
    with pytest.raises(ValueError, match="lr must be > 0"):
        GPTLightningModule(lr=0.0)


def test_lightning_module_helpers() -> None:
    torch.manual_seed(0)
    module = GPTLightningModule(seq_len=32, d_model=32, n_layer=2, n_head=2)
    assert module(torch.zeros(2, 7, dtype=torch.long)).shape == (2, 7, 256)
    text = module.generate_text("def ", max_new_tokens=10)
    assert text.startswith("def ") and module.training
    conf = module.configure_optimizers()
    decay, no_decay = conf["optimizer"].param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(module.parameters()))
    assert conf["lr_scheduler"]["interval"] == "step"
    assert [LinearWarmup(4)(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    rss = resident_memory_mb()
    assert rss is None or rss > 1.0


def test_trainer_fit_three_steps() -> None:
    lightning.seed_everything(0, verbose=False)
    dm = TextCorpusDataModule(max_bytes=200_000, seq_len=64, batch_size=4)
    module = GPTLightningModule(seq_len=64, d_model=32, n_layer=2, n_head=2, warmup_steps=2)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        val_check_interval=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=dm)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    for key in ("train/loss", "train/ppl", "train/tokens_per_s", "train/rss_mb", "val/loss", "val/ppl"):
        assert key in metrics, (key, sorted(metrics))
    assert torch.isfinite(metrics["val/loss"])
    assert metrics["train/tokens_per_s"] > 0
