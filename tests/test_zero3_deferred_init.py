"""Recorded initialisation (``deferred_init``): a model built on the meta device gets exactly the values an unsharded
build of the same seeded code has, whatever its modules do in ``__init__``.

* Replay, single process: every parameter and buffer of a zoo of modules that ``reset_parameters()`` cannot
  rebuild (attention's ``_reset_parameters``, LSTM, weight norm, a custom RMSNorm of ``torch.ones``, a scalar from
  ``torch.tensor``, rotary buffers, a parent that re-initialises its children, ``trunc_normal_``/``orthogonal_``,
  ``.data`` re-assignment, a bf16 cast) equals a real build bit for bit, and the generator ends where a real build
  leaves it.
* Through ``Trainer.fit`` on 2 ranks: such a model built in ``configure_model`` starts from the single-process values
  and trains to the same losses and parameters.
* Ranks seeded differently replay rank 0's build (as DDP's broadcast would give them).
* Weights loaded with ``load_state_dict`` inside ``configure_model`` are the run's starting point (they used to be
  dropped: a copy into a meta tensor keeps nothing).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, deferred_init, full_state_dict

D = 16


class RMSNorm(nn.Module):
    """A norm as most LLaMA-style code writes it: no reset_parameters()."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    """Parameter-free, with buffers computed in __init__."""

    def __init__(self, d: int, seq: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("cos", torch.outer(torch.arange(seq).float(), inv_freq).cos(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([x[..., :half] * self.cos[: x.shape[1]], x[..., half:]], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = RMSNorm(D)
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class Zoo(nn.Module):
    """Every way of giving a parameter its value that a per-module reset_parameters() loses."""

    def __init__(self, depth: int = 3, seq: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(40, D, padding_idx=1)
        self.rotary = Rotary(D, seq)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.lstm = nn.LSTM(D, D, batch_first=True)
        self.proj = nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.gate = nn.Parameter(torch.empty(D))
        self.mix = nn.Parameter(torch.empty(D, D))
        self.head = nn.Linear(D, 1)
        self.apply(self._init_weights)  # GPT-2 style, from the parent
        nn.init.trunc_normal_(self.gate, std=0.5, a=-1.0, b=1.0)
        nn.init.orthogonal_(self.mix)
        self.head.weight.data = torch.randn(1, D) / math.sqrt(D)  # re-pointed to a new tensor
        self.embed.weight.data[1].zero_()  # a view written in place

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear) and not nn.utils.parametrize.is_parametrized(module):
            nn.init.normal_(module.weight, std=0.05)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.rotary(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        x, _ = self.lstm(x @ self.mix)
        return self.head(torch.tanh(self.proj(x[:, -1]) * self.gate) * self.temperature).squeeze(-1)


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def test_replay_equals_a_real_build_bit_for_bit() -> None:
    def build() -> nn.Module:
        model = Zoo()
        model.cast = nn.Linear(3, 3).to(torch.bfloat16)  # a dtype conversion after the build
        return model

    torch.manual_seed(7)
    real = build()
    real_next = torch.rand(4)
    torch.manual_seed(7)
    with deferred_init() as recording:
        meta = build()
    assert all(t.is_meta for t in _values(meta).values())
    assert torch.equal(torch.rand(4), real_next)  # the generator advanced exactly as in the real build
    expected = _values(real)
    for name, t in _values(meta).items():
        value = recording.materialize(t)
        assert value is not None, name
        assert value.dtype == expected[name].dtype and torch.equal(value, expected[name].detach()), name
    recording.discard()


def test_a_tensor_built_outside_the_recording_is_not_claimed() -> None:
    with torch.device("meta"):
        outside = nn.Linear(2, 2)
    with deferred_init() as recording:
        inside = nn.Linear(2, 2)
        derived = outside.weight * 2  # depends on a tensor whose values were never recorded
    assert recording.materialize(outside.weight) is None
    assert recording.materialize(derived) is None
    assert recording.materialize(inside.weight) is not None
    recording.discard()


class ZooModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.initial: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = Zoo()

    def on_fit_start(self) -> None:
        self.initial = _unprefixed(full_state_dict(self))  # the strategy shards the LightningModule

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, target = batch
        loss = (self.net(tokens) - target).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.net.parameters(), lr=0.05, momentum=0.9)


def _unprefixed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("net."): v.clone() for k, v in state.items()}


def _data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, 40, (steps * batch, 6), generator=g), torch.randn(steps * batch, generator=g)


def _fit(rank: int, world: int, steps: int, batch: int) -> dict[str, Any]:
    import zlightning  # noqa: F401  (registers zstack_zero3)

    pl.seed_everything(3, verbose=False)
    tokens, target = _data(steps, batch)
    per_rank = batch // world
    rows = torch.cat(
        [torch.arange(i * batch + rank * per_rank, i * batch + (rank + 1) * per_rank) for i in range(steps)]
    )
    module = ZooModule()
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens[rows], target[rows]), batch_size=per_rank))
    final = _unprefixed(full_state_dict(module))
    return {"initial": module.initial, "final": final, "losses": module.losses}


def test_configure_model_through_fit_matches_an_unsharded_build_and_run() -> None:
    steps, batch = 4, 8
    pl.seed_everything(3, verbose=False)
    reference = Zoo()
    initial = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    opt = torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9)
    tokens, target = _data(steps, batch)
    losses = []
    for i in range(steps):
        loss = (reference(tokens[i * batch : (i + 1) * batch]) - target[i * batch : (i + 1) * batch]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = reference.state_dict()
    ranks = run_distributed(_fit, 2, steps, batch, init_process_group=False, timeout=300, start_method="spawn")
    for name, value in initial.items():  # the sharded run starts from the unsharded build's values, exactly
        assert torch.equal(ranks[0]["initial"][name], value), name
    mean_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for name, value in final.items():
        torch.testing.assert_close(ranks[0]["final"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _unseeded(rank: int, world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(100 + rank)  # ranks disagree on the seed
    with deferred_init():
        model = Zoo(depth=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    DeepSpeedZeroOptimizer_Stage3(model, opt, device=torch.device("cpu"))
    return {k: v.clone() for k, v in full_state_dict(model).items()}


@pytest.mark.parametrize("world", [2])
def test_ranks_seeded_differently_replay_rank_zeros_build(world: int) -> None:
    torch.manual_seed(100)
    expected = Zoo(depth=1).state_dict()
    for r in run_distributed(_unseeded, world, timeout=180):
        for name, value in expected.items():
            assert torch.equal(r[name], value), name


class Pretrained(pl.LightningModule):
    """Loads saved weights into the (meta-device) model inside configure_model, as fine-tuning code does."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.net: nn.Module | None = None
        self.start: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
            self.net.load_state_dict(torch.load(self.path, weights_only=True))

    def on_fit_start(self) -> None:
        self.start = _unprefixed(full_state_dict(self))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit_pretrained(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    import zlightning  # noqa: F401

    module = Pretrained(path)
    trainer = pl.Trainer(
        strategy="zstack_zero3",
        accelerator="cpu",
        devices=world,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 8)), batch_size=2))
    return module.start


def test_weights_loaded_in_configure_model_are_the_starting_point(tmp_path: Any) -> None:
    torch.manual_seed(5)
    saved = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).state_dict()
    torch.save(saved, tmp_path / "weights.pt")
    for r in run_distributed(
        _fit_pretrained, 2, str(tmp_path / "weights.pt"), init_process_group=False, timeout=180, start_method="spawn"
    ):
        for name, value in saved.items():
            assert torch.equal(r[name], value), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_replay_on_cuda_equals_a_build_on_cuda() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(7)
    with device:
        real = Zoo()
    torch.manual_seed(7)
    with deferred_init(device) as recording:
        meta = Zoo()
    expected = _values(real)
    for name, t in _values(meta).items():
        value = recording.materialize(t)
        assert value is not None and value.device == device, name
        assert torch.equal(value, expected[name].detach()), name
    recording.discard()


def test_value_dependent_draws_and_nesting_match_a_real_build() -> None:
    def build() -> nn.Module:
        model = nn.Linear(6, 6)
        weights = torch.ones(6).cumsum(0)  # multinomial's draws depend on these values
        model.register_buffer("picks", torch.multinomial(weights, 4))
        model.register_buffer("mask", torch.bernoulli(torch.full((6, 6), 0.3)))
        return model

    torch.manual_seed(2)
    real = build()
    torch.manual_seed(2)
    with deferred_init() as outer, deferred_init() as inner:
        meta = build()
    assert inner is outer
    for name, value in _values(real).items():
        assert torch.equal(outer.materialize(_values(meta)[name]), value.detach()), name
    outer.discard()


def test_a_hugging_face_model_from_config_gets_its_own_initialisation() -> None:
    # Hugging Face skips its init when torch.tensor([]) says "meta" (see [Note: the device probe])
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    real = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with deferred_init() as recording:
        meta = transformers.AutoModelForCausalLM.from_config(config)
    expected = _values(real)
    for name, t in _values(meta).items():
        value = recording.materialize(t)
        assert value is not None and torch.equal(value, expected[name].detach()), name
    assert float(expected["lm_head.weight"].std()) < 0.05  # its normal(0, 0.02), not nn.Linear's default
    recording.discard()
