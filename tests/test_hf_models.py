"""Hugging Face causal LMs (``transformers``, built from tiny configs: nothing is downloaded) through a real
Lightning Trainer on 2 CPU ranks, each against a single-process reference (losses and parameters):

* ``LlamaForCausalLM`` (tied embeddings, rotary, grouped-query attention) under ``zstack_zero3``, under
  ``ZStackZero3Strategy(tensor_parallel_size=2)`` and with ``compile=True``;
* ``compile=True`` on a 10-layer Llama at 1 process: its decoder layers share one compiled graph (no recompile per
  layer), with or without the key/value cache the model builds by default, and the losses equal eager;
* the same model as pipeline layers (``zlightning.integrations.huggingface.hf_pipeline``) under ``zstack_pipeline``
  on 2 stages, against the unsplit Hugging Face model from the same weights;
* exports: ``zlightning consolidate`` of the sharded ZeRO-3 checkpoint loads into ``LlamaForCausalLM`` with
  ``load_state_dict(strict=True)`` and ``export_pretrained`` writes a folder ``from_pretrained`` reads; the pipeline
  checkpoint, consolidated and renamed (``pipeline_to_hf_state``), loads strictly too;
* ``PipelineBubbleMonitor`` on the pipeline run: the simulated bubble of the schedule, a measured idle fraction;
* single process: the pipeline layers reproduce the logits of Llama (tied and untied, sdpa and eager), Mistral with a
  sliding window, Qwen2 and GPT-2 exactly, and the renaming round-trips.

All ranks are spawned once (every run on the same process group) to keep the suite fast.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from zlightning.integrations.huggingface import _load_hub_kernels

_load_hub_kernels()  # pytest's pythonpath puts the checkout's kernels/ folder ahead of the package transformers needs
transformers = pytest.importorskip("transformers")

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

from zlightning.testing import run_distributed  # noqa: E402

CONFIG: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "tie_word_embeddings": True,
}
WORLD, SEQ, MICRO, N_SAMPLES, STEPS, LR = 2, 12, 2, 12, 3, 0.05
TOL = {"rtol": 1e-5, "atol": 2e-6}


def _dataset() -> TensorDataset:
    ids = torch.randint(0, CONFIG["vocab_size"], (N_SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def _global_batches(dp: int, per_replica: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The global batch of every step as Lightning feeds it (a DistributedSampler over the dp replicas, seed 0)."""
    ds = _dataset()
    orders = [list(DistributedSampler(ds, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    out = []
    for i in range(len(orders[0]) // per_replica):
        idx = [j for o in orders for j in o[i * per_replica : (i + 1) * per_replica]]
        out.append((ds.tensors[0][idx], ds.tensors[1][idx]))
    return out


def _sgd(module: pl.LightningModule) -> torch.optim.Optimizer:
    # SGD with momentum: Adam turns ~1e-9 reduction-order noise on near-zero gradients into visible updates
    return torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)


def _plain_module() -> pl.LightningModule:
    from zlightning.models.hf_causal_lm import HFCausalLM

    class Module(HFCausalLM):
        losses: list[float]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return _sgd(self)

    pl.seed_everything(0, verbose=False)
    module = Module(config=CONFIG, warmup_steps=0)
    module.losses = []
    return module


def _pipe_module() -> pl.LightningModule:
    from zlightning.models.hf_causal_lm import HFCausalLMPipeline

    class Module(HFCausalLMPipeline):
        losses: list[float]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self) -> Any:
            return _sgd(self)

    module = Module(config=CONFIG, warmup_steps=0)
    module.losses = []
    return module


def _trainer(strategy: Any, callbacks: list[pl.Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def rank_runs(rank: int, world: int, zero_ckpt: str, pipe_ckpt: str) -> dict[str, Any]:
    from zlightning.strategies import PipelineStrategy, ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.callbacks import PipelineBubbleMonitor
    from zlightning.inject import tp_full_state
    from zlightning.zero import summon_full_params

    out: dict[str, Any] = {}
    for name, kwargs in (("zero3", {}), ("tp2", {"tensor_parallel_size": 2}), ("compile", {"compile": True})):
        module = _plain_module()
        dp = WORLD // kwargs.get("tensor_parallel_size", 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer = _trainer(ZStackZero3Strategy(**kwargs))
            trainer.fit(module, DataLoader(_dataset(), batch_size=MICRO))
        if name == "zero3":
            trainer.save_checkpoint(zero_ckpt)
        with summon_full_params(module):  # the module stays sharded after fit
            state = tp_full_state(module.model) if name == "tp2" else module.model.state_dict()
            state = {k: v.detach().clone() for k, v in state.items()}
        inject = [str(w.message) for w in caught if "module_inject" in str(w.message)]
        out[name] = {"losses": module.losses, "state": state, "dp": dp, "inject_warnings": inject}
    module = _pipe_module()
    bubble = PipelineBubbleMonitor(every_n_batches=1)
    trainer = _trainer(PipelineStrategy(micro_batches=2), callbacks=[bubble])
    trainer.fit(module, DataLoader(_dataset(), batch_size=2 * MICRO))  # one pipeline replica: the whole global batch
    trainer.save_checkpoint(pipe_ckpt)
    out["pipeline"] = {
        "losses": module.losses,
        "stage": trainer.strategy.engine.grid.stage,
        "bubble": bubble.last,
        "state": {k: v.detach().clone() for k, v in module.pipe.state_dict().items()},
    }
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path, Path]:
    root = tmp_path_factory.mktemp("hf")
    zero_ckpt, pipe_ckpt = root / "zero.ckpt", root / "pipe.ckpt"
    out = run_distributed(rank_runs, WORLD, str(zero_ckpt), str(pipe_ckpt), init_process_group=False, timeout=500)
    return out, zero_ckpt, pipe_ckpt


def _reference(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from zlightning.integrations.huggingface import causal_lm_loss

    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x, y in batches[:STEPS]:
        loss = causal_lm_loss(model(input_ids=x).logits, y)
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", ["zero3", "tp2", "compile"])
def test_llama_under_zstack_zero3_matches_one_process(runs: Any, name: str) -> None:
    out, _, _ = runs
    dp = out[0][name]["dp"]
    ref_losses, ref_state = _reference(_plain_module().model, _global_batches(dp))
    mean = [sum(out[r][name]["losses"][i] for r in range(0, WORLD, WORLD // dp)) / dp for i in range(STEPS)]
    torch.testing.assert_close(mean, ref_losses, **TOL)
    for r in out:
        assert set(r[name]["state"]) >= {k for k in ref_state if k != "lm_head.weight"}
        for key, value in r[name]["state"].items():
            torch.testing.assert_close(value, ref_state[key], **TOL, msg=f"{name}: {key}")
        # tensor parallelism alone: module_inject says nothing about modules it was not asked to fuse
        assert r[name]["inject_warnings"] == [], r[name]["inject_warnings"]


def rank_compile_runs(rank: int, world: int) -> dict[tuple[str, bool], Any]:
    """A 10-layer Llama under ``zstack_zero3`` at 1 process, eager and with ``compile=True``: ``HFCausalLM`` as it
    ships, and a module calling the Hugging Face model with its defaults (a key/value cache built in training). Per
    compiled run: the Dynamo graphs compiled and every message Dynamo logged."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.integrations.huggingface import causal_lm_loss
    from zlightning.models.hf_causal_lm import HFCausalLM

    class Module(HFCausalLM):
        def __init__(self, cache_on: bool) -> None:
            super().__init__(config={**CONFIG, "num_hidden_layers": 10}, warmup_steps=0)
            self.cache_on = cache_on
            self.losses: list[float] = []

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.model(input_ids=input_ids).logits if self.cache_on else super().forward(input_ids)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            self.losses.append(float(loss.detach()))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(causal_lm_loss(self(batch[0]), batch[1])))

        def configure_optimizers(self) -> Any:
            return _sgd(self)

    class Messages(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    out: dict[tuple[str, bool], Any] = {}
    for name, cache_on in (("hf_causal_lm", False), ("cache_on", True)):
        for compile_ in (False, True):
            torch._dynamo.reset()
            counters.clear()
            messages = Messages()
            logging.getLogger("torch._dynamo").addHandler(messages)
            pl.seed_everything(0, verbose=False)
            module = Module(cache_on)
            trainer = pl.Trainer(
                strategy=ZStackZero3Strategy(compile=compile_),
                accelerator="cpu",
                devices=1,
                max_steps=STEPS,
                limit_val_batches=2,
                val_check_interval=STEPS,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
            )
            loader = DataLoader(_dataset(), batch_size=MICRO)
            trainer.fit(module, loader, loader)
            logging.getLogger("torch._dynamo").removeHandler(messages)
            out[name, compile_] = {
                "losses": module.losses,
                "graphs": counters["stats"]["unique_graphs"],
                "frames": counters["frames"]["total"],
                "messages": messages.lines,
            }
    return out


def test_compiled_llama_compiles_its_decoder_layers_once() -> None:
    """``compile=True`` compiles each ZeRO unit's forward; the 10 decoder layers share one graph (and one more for
    evaluation) instead of recompiling per layer up to Dynamo's limit of 8 and running the rest eagerly, also when
    the model builds its default key/value cache in training; the losses (3 training steps, 2 validation batches)
    equal the eager run."""
    (out,) = run_distributed(rank_compile_runs, 1, init_process_group=False, timeout=500)
    for name in ("hf_causal_lm", "cache_on"):
        eager, compiled = out[name, False], out[name, True]
        assert len(compiled["losses"]) == STEPS + 2, compiled["losses"]
        torch.testing.assert_close(compiled["losses"], eager["losses"], rtol=1e-5, atol=0, msg=name)
        limit = [m for m in compiled["messages"] if "recompile_limit" in m or "cache_size_limit" in m]
        assert not limit, f"{name}: {limit[0][:2000]}"
        assert 1 <= compiled["graphs"] <= 2 and compiled["frames"] <= 2, (name, compiled["graphs"], compiled["frames"])
        assert eager["graphs"] == 0, (name, eager["graphs"])


def test_llama_pipeline_on_two_stages_matches_the_unsplit_model(runs: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from zlightning.integrations.huggingface import hf_pipeline, pipeline_to_hf_state

    out, _, _ = runs
    config = LlamaConfig(**CONFIG)
    start = hf_pipeline(config).build().state_dict()  # the seeded initial weights every stage starts from
    model = LlamaForCausalLM(config)
    model.load_state_dict(pipeline_to_hf_state(start, config), strict=True)
    ref_losses, ref_state = _reference(model, _global_batches(1, per_replica=2 * MICRO))
    assert sorted(r["pipeline"]["stage"] for r in out) == [0, 1]
    for r in out:  # PipelineBubbleMonitor: 1F1B on 2 stages, 2 micro-batches: (P - 1) / (M + P - 1) simulated
        assert r["pipeline"]["bubble"]["pipeline/bubble_simulated"] == pytest.approx(1 / 3)
        assert 0.0 <= r["pipeline"]["bubble"]["pipeline/idle_fraction"] < 1.0
    for r in out:
        torch.testing.assert_close(r["pipeline"]["losses"], ref_losses, **TOL)
    merged = {k: v for r in out for k, v in r["pipeline"]["state"].items()}
    tied = [r["pipeline"]["state"]["tied_modules.embed.weight"] for r in out]
    torch.testing.assert_close(tied[0], tied[1], rtol=0, atol=0)  # first and last stage: one parameter
    for key, value in pipeline_to_hf_state(merged, config).items():
        torch.testing.assert_close(value, ref_state[key], **TOL, msg=key)


def test_consolidated_checkpoints_load_into_the_hugging_face_class(runs: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from zlightning.cli import main
    from zlightning.integrations.huggingface import export_pretrained, pipeline_to_hf_state
    from zlightning.pipe import consolidate_pipeline_checkpoint

    out, zero_ckpt, pipe_ckpt = runs
    config = LlamaConfig(**CONFIG)
    main(["consolidate", str(zero_ckpt), str(tmp_path / "full.pt"), "--no-progress"])
    state = torch.load(tmp_path / "full.pt", weights_only=True)
    weights = {k.removeprefix("model."): v for k, v in state.items()}
    model = LlamaForCausalLM(config)
    model.load_state_dict(weights, strict=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied after loading
    for key, value in out[0]["zero3"]["state"].items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=0, atol=0, msg=key)

    folder = export_pretrained(state, config, tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert type(loaded) is LlamaForCausalLM and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)

    pipe_state = pipeline_to_hf_state(consolidate_pipeline_checkpoint(pipe_ckpt), config)
    copy.deepcopy(model).load_state_dict(pipe_state, strict=True)


def _tiny_models() -> dict[str, torch.nn.Module]:
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = {k: v for k, v in CONFIG.items() if k != "tie_word_embeddings"}
    gpt2 = {
        "vocab_size": 64,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 32,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    torch.manual_seed(0)
    return {
        "llama": LlamaForCausalLM(LlamaConfig(**CONFIG)),
        "llama-untied-eager": LlamaForCausalLM(
            LlamaConfig(**common, tie_word_embeddings=False, attn_implementation="eager")
        ),
        "mistral-window": MistralForCausalLM(MistralConfig(**common, sliding_window=4)),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(**common)),
        "gpt2": GPT2LMHeadModel(GPT2Config(**gpt2)),
        "gpt2-eager": GPT2LMHeadModel(GPT2Config(**gpt2, attn_implementation="eager")),
    }


def test_pipeline_layers_reproduce_the_hugging_face_logits() -> None:
    from zlightning.integrations.huggingface import hf_pipeline, hf_to_pipeline_state, pipeline_to_hf_state

    ids = torch.randint(0, CONFIG["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(0))
    for name, model in _tiny_models().items():
        model.eval()
        from_model = hf_pipeline(model).build().eval()  # starts from the model's weights
        from_config = hf_pipeline(model.config).build().eval()  # seeded init, then the renamed state dict
        from_config.load_state_dict(hf_to_pipeline_state(model.state_dict(), model.config), strict=True)
        with torch.no_grad():
            expected = model(input_ids=ids).logits
            torch.testing.assert_close(from_model(ids), expected, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(from_config(ids), expected, rtol=0, atol=0, msg=name)
        fresh = copy.deepcopy(model)
        fresh.load_state_dict(pipeline_to_hf_state(from_model.state_dict(), model.config), strict=True)
        tied = model.config.tie_word_embeddings
        assert ("tied_modules.embed.weight" in from_model.state_dict()) == tied, name


def test_unsupported_models_are_refused_by_name() -> None:
    from transformers import BertConfig

    from zlightning.integrations.huggingface import hf_pipeline, hf_to_pipeline_state

    with pytest.raises(ValueError, match="model_type 'bert' is not supported.*Llama family"):
        hf_pipeline(BertConfig())
    with pytest.raises(ValueError, match="no counterpart.*model.rotary"):
        hf_to_pipeline_state({"model.rotary.weight": torch.zeros(1)}, transformers.LlamaConfig(**CONFIG))


def test_example_config_resolves(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/hf_causal_lm.yaml: zstack_zero3 with CPU offload, TP2 and compile, the Llama, the curriculum data."""
    from zlightning.cli import main

    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(repo / "examples" / "hf_causal_lm.yaml"), "--print_config"])
    assert done.value.code in (0, None)
    text = capsys.readouterr().out
    for needle in (
        "zlightning.strategies.ZStackZero3Strategy",
        "tensor_parallel_size: 2",
        "compile: true",
        "offload_optimizer:\n        pin_memory: true",
        "zlightning.models.hf_causal_lm.HFCausalLM",
        "num_key_value_heads: 2",
        "zlightning.datamodules.CurriculumDataModule",
        "seqlen_truncate",
        "zlightning.loggers.TensorBoardLogger",
    ):
        assert needle in text, needle
