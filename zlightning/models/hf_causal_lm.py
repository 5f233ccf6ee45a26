"""Hugging Face causal LMs as LightningModules: `HFCausalLM` (the model as it is, for ``zstack_zero3`` with offload,
tensor parallelism and compile) and `HFCausalLMPipeline` (the same model as pipeline layers, for
``zstack_pipeline``). Both build the model from a configuration, so nothing is downloaded, and need ``transformers``
(``pip install zlightning[hf]``).

Pair them with ``TextCorpusDataModule`` (byte-level: ``vocab_size`` 256) or ``CurriculumDataModule``: batches are
``(inputs, targets)`` with the targets already shifted by one token, and the loss is the mean cross-entropy over
every position (`causal_lm_loss`), so a sequence-length curriculum that truncates both works unchanged.
``examples/hf_causal_lm.py`` and ``examples/hf_causal_lm.yaml`` train them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch import LightningModule
from torch import Tensor
from typing_extensions import override

from zlightning.integrations.huggingface import _load_hub_kernels, causal_lm_loss, hf_pipeline
from zlightning.models.gpt import LinearWarmup

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["DEFAULT_CONFIG", "HFCausalLM", "HFCausalLMPipeline", "hf_config"]

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
"""A small byte-level Llama: grouped-query attention (4 query heads, 2 key/value heads), rotary positions and tied
embeddings; every width divides by a tensor-parallel size of 2."""


def hf_config(model_type: str = "llama", config: dict[str, Any] | None = None) -> PretrainedConfig:
    """``AutoConfig.for_model(model_type, **config)``; without ``config``, `DEFAULT_CONFIG` (Llama's key names).

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: an unknown ``model_type``.
    """
    try:
        _load_hub_kernels()
        from transformers import AutoConfig
    except ImportError as err:
        raise ImportError("Hugging Face models need transformers: pip install 'zlightning[hf]'") from err
    return AutoConfig.for_model(model_type, **(DEFAULT_CONFIG if config is None else config))


def _adamw(module: LightningModule, lr: float, weight_decay: float, warmup_steps: int) -> dict[str, Any]:
    params = [p for p in module.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, LinearWarmup(warmup_steps))
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _check(lr: float, weight_decay: float, warmup_steps: int, name: str) -> None:
    if not lr > 0:
        raise ValueError(f"{name}: lr must be > 0, got {lr!r}")
    if not weight_decay >= 0:
        raise ValueError(f"{name}: weight_decay must be >= 0, got {weight_decay!r}")
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"{name}: warmup_steps must be an int >= 0, got {warmup_steps!r}")


class HFCausalLM(LightningModule):
    """A Hugging Face ``AutoModelForCausalLM`` built from a configuration (random weights), trained with AdamW.

    Under ``zstack_zero3`` its decoder layers become the ZeRO units (the repeated blocks); with
    ``tensor_parallel_size=2`` the attention (grouped-query included) and MLP projections are split across the TP
    group; ``compile=True`` compiles each unit. After ``fit`` the module stays sharded: ``summon_full_params`` or
    ``zlightning consolidate`` + `zlightning.integrations.huggingface.export_pretrained` give full weights.

    Args:
        model_type: a ``transformers`` model type (``"llama"``, ``"gpt2"``, ``"mistral"``, ...).
        config: its configuration keys; None: `DEFAULT_CONFIG`.
        lr: peak learning rate, reached after ``warmup_steps`` optimizer steps.
        weight_decay: AdamW weight decay on matrices and embeddings (not on norms and biases).
        warmup_steps: linear warmup steps.

    Raises:
        ValueError: invalid optimizer settings or configuration.
        ImportError: ``transformers`` is not installed.
    """

    def __init__(
        self,
        model_type: str = "llama",
        config: dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        _check(lr, weight_decay, warmup_steps, "HFCausalLM")
        self.save_hyperparameters()
        model_config = hf_config(model_type, config)  # imports transformers: see `_load_hub_kernels`
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(model_config)

    @override
    def forward(self, input_ids: Tensor) -> Tensor:
        """Logits ``[B, T, vocab]``, without a key/value cache: nothing here reads one, and building it in training
        would make each decoder layer a graph of its own under ``compile=True`` (see [Note: a key/value cache
        reaching a compiled unit] in ``zlightning/compile/_zero3.py``)."""
        return self.model(input_ids=input_ids, use_cache=False).logits

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = causal_lm_loss(self(batch[0]), batch[1])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", causal_lm_loss(self(batch[0]), batch[1]), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        return _adamw(self, hp.lr, hp.weight_decay, hp.warmup_steps)


class HFCausalLMPipeline(LightningModule):
    """The same Hugging Face model as pipeline layers (`zlightning.integrations.huggingface.hf_pipeline`), for
    ``Trainer(strategy="zstack_pipeline")``: each rank builds only its stage; tied embeddings stay tied across the
    first and last stage. The loader's batch size must be a multiple of the strategy's ``micro_batches``.

    Args:
        model_type, config, lr, weight_decay, warmup_steps: as `HFCausalLM`.

    Raises:
        ValueError: invalid settings, or a model type without a pipeline layout (Llama family, GPT-2).
    """

    def __init__(
        self,
        model_type: str = "llama",
        config: dict[str, Any] | None = None,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
    ) -> None:
        super().__init__()
        _check(lr, weight_decay, warmup_steps, "HFCausalLMPipeline")
        self.save_hyperparameters()
        self.pipe = hf_pipeline(hf_config(model_type, config))

    @override
    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self.pipe.batch_loss(tuple(batch))  # the whole schedule, backward included
        self.log("train/loss", loss, prog_bar=True)
        return loss

    @override
    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val/loss", self.pipe.batch_loss(tuple(batch)), prog_bar=True, sync_dist=True)

    @override
    def configure_optimizers(self) -> Any:
        hp = cast(AttributeDict, self.hparams)  # save_hyperparameters() stores an AttributeDict
        return _adamw(self, hp.lr, hp.weight_decay, hp.warmup_steps)
