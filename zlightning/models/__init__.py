"""Ready-to-train example models, shipped with the package so that they import from any directory.

* `GPT` / `GPTConfig` (``zlightning.models.gpt_model``): a byte-level decoder-only transformer in plain PyTorch
  (imports only torch, so benchmark environments without Lightning train the very same model).
* `GPTLightningModule` (``zlightning.models.gpt``): its LightningModule (AdamW, warmup, perplexity, tokens/s).
* `gpt_pipeline` / `GPTPipelineModule` (``zlightning.models.gpt_pipe``): the same GPT as a pipeline layer list and
  its LightningModule for ``strategy="zstack_pipeline"``.
* `HybridCPGPTModule` (``zlightning.models.gpt_hybrid_cp``): the GPT trained on hybrid context-parallel batches.

Pair them with ``zlightning.datamodules.TextCorpusDataModule``. The names are imported on first use, so importing
``zlightning.models.gpt_model`` needs torch only. ``examples.gpt`` and friends re-export them for older configs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from zlightning.models.gpt import GPTLightningModule
    from zlightning.models.gpt_hybrid_cp import HybridCPGPTModule
    from zlightning.models.gpt_model import GPT, GPTConfig
    from zlightning.models.gpt_pipe import GPTPipelineModule, gpt_pipeline

__all__ = ["GPT", "GPTConfig", "GPTLightningModule", "GPTPipelineModule", "HybridCPGPTModule", "gpt_pipeline"]

_HOME = {
    "GPT": "gpt_model",
    "GPTConfig": "gpt_model",
    "GPTLightningModule": "gpt",
    "GPTPipelineModule": "gpt_pipe",
    "gpt_pipeline": "gpt_pipe",
    "HybridCPGPTModule": "gpt_hybrid_cp",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'zlightning.models' has no attribute {name!r}; it offers {', '.join(__all__)}")
    return getattr(importlib.import_module(f"zlightning.models.{home}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
