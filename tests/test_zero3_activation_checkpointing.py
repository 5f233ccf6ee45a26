"""Activation checkpointing (``torch.utils.checkpoint``) inside ZeRO-3 units, both recompute modes, around a block
call (the recomputation calls the block, hooks and all) and inside a block (Hugging Face's GradientCheckpointingLayer
style: the recomputation calls the inner forward, past the hooks; it used to read the shards and fail).

With ``use_reentrant=False`` (torch's advice) the recomputed forward of a unit runs inside backward and hands its
tensors to the original graph; the unit must stay gathered through it (see [Note: a unit's forward inside
backward]). Proof on 2 ranks: training through ``Trainer.fit`` equals one process (losses and parameters), every
group is sharded again after backward, and a recompute holds no more gathered than a backward without checkpointing
(a second autograd node per recomputed unit, whose backward never comes, used to keep every unit gathered to the end
of backward; before that, resharding at the recomputation's end crashed the backward), and the engine's backward ends
once per backward in both modes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, TensorDataset

from zlightning.testing import run_distributed

D, DEPTH, STEPS, BATCH = 16, 6, 4, 8


class SelfCheckpointing(nn.Module):
    """Checkpoints itself as Hugging Face's GradientCheckpointingLayer does: the recomputation calls the inner
    forward directly, past the module's hooks."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._inner, x, use_reentrant=self.reentrant)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, style: str = "module") -> None:
        super().__init__()
        self.reentrant = reentrant
        self.style = style
        self.inp = nn.Linear(D, D)  # makes the blocks' inputs require grad (the reentrant mode needs that)
        if style == "module":  # torch.utils.checkpoint(block, x): the recomputation calls the block, hooks and all
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D)) for _ in range(DEPTH)
            )
        else:
            self.blocks = nn.ModuleList(SelfCheckpointing(reentrant) for _ in range(DEPTH))
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + (checkpoint(block, x, use_reentrant=self.reentrant) if self.style == "module" else block(x))
        return self.head(x).squeeze(-1)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS * BATCH, D, generator=g), torch.randn(STEPS * BATCH, generator=g)


class Module(pl.LightningModule):
    def __init__(self, reentrant: bool, style: str) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.style = style
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.gathered_in_recompute: list[int] = []
        self.left_gathered: list[int] = []
        self.in_backward = False
        self.finishes = 0
        self.forward_order = 0

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Checkpointed(self.reentrant, self.style)

    def on_fit_start(self) -> None:
        from zlightning.zero import engine_of
        from zlightning.zero._param_group import GroupState

        engine = engine_of(self)

        def count(*_: Any) -> None:
            if self.in_backward:  # a recomputation
                busy = [g for g in engine.groups if not g.persistent and g.status is not GroupState.SHARDED]
                self.gathered_in_recompute.append(len(busy))

        finish = engine.finish_backward

        def counted_finish() -> None:  # the engine's end of backward: once per backward, also when recomputing
            self.finishes += 1
            finish()

        engine.finish_backward = counted_finish  # type: ignore[method-assign]
        for block in self.net.blocks:
            block.register_forward_pre_hook(count)  # runs after the engine's (prepended) pre-hook has gathered

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.in_backward = True

    def on_after_backward(self) -> None:
        self.in_backward = False
        from zlightning.zero import engine_of
        from zlightning.zero._param_group import GroupState

        engine = engine_of(self)
        self.left_gathered.append(
            sum(1 for g in engine.groups if not g.persistent and g.status is not GroupState.SHARDED)
        )

    def on_train_end(self) -> None:
        from zlightning.zero import engine_of

        self.forward_order = len(engine_of(self)._order)  # what the next forward prefetches by

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = (self.net(batch[0]) - batch[1]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def _fit(rank: int, world: int, reentrant: bool, style: str) -> dict[str, Any]:
    import zlightning  # noqa: F401  (registers zstack_zero3)
    from zlightning.zero import full_state_dict

    pl.seed_everything(0, verbose=False)
    x, y = _data()
    per_rank = BATCH // world
    rows = torch.cat(
        [torch.arange(i * BATCH + rank * per_rank, i * BATCH + (rank + 1) * per_rank) for i in range(STEPS)]
    )
    module = Module(reentrant, style)
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(x[rows], y[rows]), batch_size=per_rank))
    return {
        "final": {k.removeprefix("net."): v.clone() for k, v in full_state_dict(module).items()},
        "losses": module.losses,
        "recompute": module.gathered_in_recompute,
        "left": module.left_gathered,
        "finishes": module.finishes,
        "order": module.forward_order,
    }


@pytest.mark.parametrize("style", ["module", "self"])
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_units_train_like_one_process(reentrant: bool, style: str) -> None:
    pl.seed_everything(0, verbose=False)
    reference = Checkpointed(reentrant, style)
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    x, y = _data()
    losses = []
    for i in range(STEPS):
        loss = (reference(x[i * BATCH : (i + 1) * BATCH]) - y[i * BATCH : (i + 1) * BATCH]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ranks = run_distributed(_fit, 2, reentrant, style, init_process_group=False, timeout=300, start_method="spawn")
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ranks[0]["final"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    for r in ranks:
        assert r["left"] == [0] * STEPS, r["left"]  # nothing stays gathered past backward
        if style == "module":  # (a self-checkpointing block recomputes past its hooks: nothing to count there)
            assert len(r["recompute"]) == STEPS * DEPTH, r["recompute"]  # every block recomputed in every backward
            # the root's group, the block recomputing and at most two prefetched (the window of a backward without
            # checkpointing): never the forward order's next blocks, never blocks whose backward is done
            assert max(r["recompute"]) <= 4, r["recompute"]
        # the engine's backward ends once per backward (a reentrant recomputation's nested backward used to end it,
        # re-gathering the root's groups per block), and recomputing leaves the forward order for prefetch intact
        assert r["finishes"] == STEPS, r["finishes"]
        assert r["order"] == DEPTH, r["order"]


def _llama() -> nn.Module:
    from zlightning.integrations.huggingface import _load_hub_kernels

    _load_hub_kernels()  # a spawned rank: the installed `kernels` package, not the repository's folder
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.gradient_checkpointing_enable()  # Hugging Face's default mode
    return model


class Llama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lm: nn.Module | None = None
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.lm is None:
            self.lm = _llama()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.lm(input_ids=batch[0], labels=batch[0]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2 * BATCH, 12), generator=torch.Generator().manual_seed(0))


def _fit_llama(rank: int, world: int) -> dict[str, Any]:
    import zlightning  # noqa: F401
    from zlightning.zero import full_state_dict

    pl.seed_everything(0, verbose=False)
    tokens = _tokens()
    per_rank = BATCH // world
    rows = torch.cat([torch.arange(i * BATCH + rank * per_rank, i * BATCH + (rank + 1) * per_rank) for i in range(2)])
    module = Llama()
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens[rows]), batch_size=per_rank))
    return {
        "final": {k.removeprefix("lm."): v.clone() for k, v in full_state_dict(module).items()},
        "losses": module.losses,
    }


def test_hugging_face_gradient_checkpointing_from_configure_model_matches_one_process() -> None:
    pytest.importorskip("transformers")
    pl.seed_everything(0, verbose=False)
    reference = _llama()
    reference.train()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    tokens = _tokens()
    losses = []
    for i in range(2):
        batch = tokens[i * BATCH : (i + 1) * BATCH]
        loss = reference(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ranks = run_distributed(_fit_llama, 2, init_process_group=False, timeout=300, start_method="spawn")
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ranks[0]["final"][name], value, rtol=1e-5, atol=1e-6, msg=name)
