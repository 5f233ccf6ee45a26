"""Hugging Face decoder-only causal LMs in zlightning: a pipeline layer list, state-dict renaming, and an export to a
``save_pretrained`` folder.

[Note: a Hugging Face model as pipeline layers]
``PipelineModule`` applies its layers one after the other, each taking the previous layer's output. A Hugging Face
``*ForCausalLM`` computes a few things once per forward and hands them to every decoder layer: the positions, the
rotary ``(cos, sin)`` tables and the attention mask. Here each decoder layer is wrapped (`DecoderLayer`) so that it
recomputes them from the hidden states it receives: positions ``0..T-1`` (training batches, no cache), the rotary
tables from a non-persistent copy of the model's rotary module (a few hundred flops per token) and the mask from
the configuration. Only the hidden states cross a stage boundary, so any split works and nothing else is sent.

The mask follows what the model itself does without padding: ``sdpa`` and flash attention get no mask and run
causally; ``eager`` attention gets the additive causal mask; a sliding window (Mistral) adds the window to an
explicit mask once the sequence is longer than the window. Padding masks are not passed through the pipeline: pad
with ``-100`` labels instead (ignored by `causal_lm_loss`).

The layers are, for the Llama family (Llama, Mistral, Qwen2): the token embedding, the decoder layers, the final
norm and the head; for GPT-2: the token embedding, the learned positions (plus embedding dropout), the blocks, the
final LayerNorm and the head. With ``tie_word_embeddings`` the embedding and the head are one ``TiedLayerSpec`` key,
``"embed"``: the first and the last stage each hold the table and the pipeline engine sums its gradients, so the two
stay one parameter as they are in the Hugging Face model.

[Note: starting from the Hugging Face weights]
Layers are built lazily on the rank that runs them, from the configuration. Given a model instead of a
configuration, every layer spec carries that model's tensors for its own layer (references, no copy) and the
built layer loads them, so the pipeline starts from exactly the model's weights on any split. Given a
configuration, each built layer is initialised by the model class's own ``_init_weights`` (called on a copy of the
model on the meta device, which holds no memory), so it starts like a fresh Hugging Face model, seeded per layer
by ``PipelineModule`` (the same values on any split). For models too large to hold whole on each rank, pass the
configuration and load weights per stage with `hf_to_pipeline_state`.

[Note: the checkout's kernels folder and the kernels package]
``transformers`` 5 imports the Hugging Face ``kernels`` package when it is imported. A checkout of zlightning keeps
the sources of ``zlightning.kernels`` in a top-level folder named ``kernels``, so wherever the checkout's root is on
``sys.path`` (``zlightning fit`` run from it puts the working directory there, so does pytest's ``pythonpath``)
``import kernels`` finds that folder and ``import transformers`` fails with "cannot import name ... from 'kernels'".
`_load_hub_kernels` loads the installed ``kernels`` distribution under its name first; every import of
``transformers`` here goes through it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zlightning.pipe import LayerSpec, PipelineModule, TiedLayerSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

__all__ = [
    "DecoderLayer",
    "causal_lm_loss",
    "export_pretrained",
    "hf_pipeline",
    "hf_pipeline_layers",
    "hf_to_pipeline_state",
    "pipeline_to_hf_state",
]

Family = Literal["llama", "gpt2"]
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
"""``model_type`` values laid out as Llama (``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``)."""
_MASKLESS = ("sdpa", "flash_attention_2", "flash_attention_3")


def _load_hub_kernels() -> None:
    """Makes ``import kernels`` the installed Hugging Face ``kernels`` package, not a folder of that name on
    ``sys.path`` (see [Note: the checkout's kernels folder and the kernels package]); does nothing when it is not
    installed or already imported."""
    if "kernels" in sys.modules:
        return
    try:
        init = Path(str(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")))
    except importlib.metadata.PackageNotFoundError:
        return
    found = importlib.util.find_spec("kernels")
    if not init.is_file() or (found is not None and found.origin and Path(found.origin).resolve() == init.resolve()):
        return
    spec = importlib.util.spec_from_file_location("kernels", init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


def _family(config: PretrainedConfig) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type in LLAMA_FAMILY:
        return "llama"
    if model_type == "gpt2":
        return "gpt2"
    raise ValueError(
        f"zlightning.integrations.huggingface: model_type {model_type!r} is not supported; supported are the Llama "
        f"family {LLAMA_FAMILY} and 'gpt2' (decoder-only causal LMs). Other models train as they are under "
        "zstack_zero3; only the pipeline layer list needs a known layout"
    )


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each pipeline layer's parameters live in the Hugging Face state dict (one-stage pipeline names)."""

    family: Family
    n_layer: int
    tied: bool

    @property
    def first_block(self) -> int:
        return 1 if self.family == "llama" else 2

    def prefixes(self) -> list[tuple[str, str]]:
        """``(pipeline prefix, Hugging Face prefix)`` pairs, the tied head excepted."""
        root = "model." if self.family == "llama" else "transformer."
        embed = "embed_tokens." if self.family == "llama" else "wte."
        pairs = [("tied_modules.embed." if self.tied else "0.", root + embed)]
        if self.family == "gpt2":
            pairs.append(("1.wpe.", root + "wpe."))
        blocks = "layers." if self.family == "llama" else "h."
        pairs += [(f"{self.first_block + i}.layer.", f"{root}{blocks}{i}.") for i in range(self.n_layer)]
        norm_idx = self.first_block + self.n_layer
        pairs.append((f"{norm_idx}.norm.", root + ("norm." if self.family == "llama" else "ln_f.")))
        if not self.tied:
            pairs.append((f"{norm_idx + 1}.", "lm_head."))
        return pairs

    @property
    def embed_key(self) -> str:
        return "model.embed_tokens.weight" if self.family == "llama" else "transformer.wte.weight"


def _layout(config: PretrainedConfig) -> _Layout:
    return _Layout(_family(config), int(config.num_hidden_layers), bool(getattr(config, "tie_word_embeddings", True)))


# ---------------------------------------------------------------------------------------------------- layers
def _load_init(
    module: nn.Module, init: Mapping[str, Tensor] | None, initializer: PreTrainedModel | None = None
) -> None:
    """Copies ``init`` into a freshly built layer (strict), or else initialises it as the Hugging Face model does
    (``initializer._init_weights`` on every submodule: normal(0, ``initializer_range``) matrices, zero biases, unit
    norms, GPT-2's scaled residual projections); nothing on the meta device (parameter counting)."""
    if any(p.is_meta for p in module.parameters()):
        return
    if init is None:
        if initializer is not None:
            with torch.no_grad():
                for sub in module.modules():
                    initializer._init_weights(sub)
        return
    missing, unexpected = module.load_state_dict(dict(init), strict=False)
    missing = [k for k in missing if k in dict(module.named_parameters())]
    if missing or unexpected:
        raise ValueError(
            f"{type(module).__name__}: the Hugging Face weights do not fit this layer (missing "
            f"{missing}, unexpected {unexpected}); is the model of the family its config names?"
        )


class TokenEmbedding(nn.Embedding):
    """The token table (``embed_tokens`` / ``wte``); with tied weights also read by the head (`tied_lm_head`)."""

    def __init__(
        self,
        vocab_size: int,
        hidden: int,
        padding_idx: int | None = None,
        init: Mapping[str, Tensor] | None = None,
        initializer: PreTrainedModel | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden, padding_idx=padding_idx)
        _load_init(self, init, initializer)


def tied_lm_head(embedding: nn.Module, hidden_BTD: Tensor) -> Tensor:
    """The output head reusing the token table: ``logits_BTV = hidden_BTD @ W_emb^T``."""
    return F.linear(hidden_BTD, cast(Tensor, embedding.weight))  # the token table's weight


class LMHead(nn.Linear):
    """The output head of a model whose embeddings are not tied (``lm_head``, no bias)."""

    def __init__(
        self,
        hidden: int,
        vocab_size: int,
        init: Mapping[str, Tensor] | None = None,
        initializer: PreTrainedModel | None = None,
    ) -> None:
        super().__init__(hidden, vocab_size, bias=False)
        _load_init(self, init, initializer)


class GPT2Positions(nn.Module):
    """GPT-2's learned positions and embedding dropout: ``drop(x_BTD + wpe[0..T-1])``."""

    def __init__(
        self,
        config: PretrainedConfig,
        init: Mapping[str, Tensor] | None = None,
        initializer: PreTrainedModel | None = None,
    ) -> None:
        super().__init__()
        self.wpe = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.drop = nn.Dropout(config.embd_pdrop)
        _load_init(self, init, initializer)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.drop(x_BTD + self.wpe(torch.arange(x_BTD.shape[1], device=x_BTD.device)))


class FinalNorm(nn.Module):
    """The final norm (``model.norm`` / ``transformer.ln_f``) under the attribute ``norm``."""

    def __init__(
        self,
        norm_cls: type[nn.Module],
        hidden: int,
        eps: float,
        init: Mapping[str, Tensor] | None = None,
        initializer: PreTrainedModel | None = None,
    ) -> None:
        super().__init__()
        self.norm = norm_cls(hidden, eps=eps)
        _load_init(self, init, initializer)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return self.norm(x_BTD)


def _causal_mask(config: PretrainedConfig, x_BTD: Tensor) -> Tensor | None:
    """See [Note: a Hugging Face model as pipeline layers]: None where the attention runs causally by itself."""
    t = x_BTD.shape[1]
    window = getattr(config, "sliding_window", None)
    windowed = window is not None and t > window
    if config._attn_implementation in _MASKLESS and not windowed:
        return None
    i = torch.arange(t, device=x_BTD.device)
    allowed = i[None, :] <= i[:, None]
    if windowed and window is not None:  # (windowed implies a window)
        allowed &= (i[:, None] - i[None, :]) < window
    mask = torch.zeros(t, t, dtype=x_BTD.dtype, device=x_BTD.device)
    return mask.masked_fill(~allowed, torch.finfo(x_BTD.dtype).min)[None, None]


class DecoderLayer(nn.Module):
    """One Hugging Face decoder layer (``self.layer``) that rebuilds its positions, rotary tables and mask from its
    input (see [Note: a Hugging Face model as pipeline layers]).

    Args:
        config: the model's configuration (with its attention implementation resolved).
        layer_idx: the layer's index in the model.
        layer_cls: the decoder layer class (``LlamaDecoderLayer``, ``GPT2Block``, ...).
        rotary_cls: the rotary embedding class (Llama family), None for learned positions (GPT-2).
        init: the layer's Hugging Face weights (``model.layers.{i}.*`` without the prefix), or None.
        initializer: without ``init``, a (meta-device) model of the family whose ``_init_weights`` initialises the
            layer as Hugging Face does; None keeps PyTorch's defaults.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layer_idx: int,
        layer_cls: type[nn.Module],
        rotary_cls: type[nn.Module] | None = None,
        init: Mapping[str, Tensor] | None = None,
        initializer: PreTrainedModel | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.layer = layer_cls(config, layer_idx)
        self.rotary = rotary_cls(config=config) if rotary_cls is not None else None  # buffers only, not saved
        _load_init(self.layer, init, initializer)

    def forward(self, x_BTD: Tensor) -> Tensor:
        position_ids = torch.arange(x_BTD.shape[1], device=x_BTD.device)[None]
        extra: dict[str, Any] = {}
        if self.rotary is not None:
            extra["position_embeddings"] = self.rotary(x_BTD, position_ids)
        out = self.layer(x_BTD, attention_mask=_causal_mask(self.config, x_BTD), position_ids=position_ids, **extra)
        return out[0] if isinstance(out, tuple) else out


def causal_lm_loss(logits_BTV: Tensor, targets_BT: Tensor) -> Tensor:
    """Mean next-token cross-entropy over the targets (already shifted: ``targets[t]`` follows ``inputs[t]``);
    ``-100`` targets are ignored, as in Hugging Face."""
    return F.cross_entropy(
        logits_BTV.reshape(-1, logits_BTV.shape[-1]).float(), targets_BT.reshape(-1), ignore_index=-100
    )


# ---------------------------------------------------------------------------------------------------- building
def _meta_model(config: PretrainedConfig) -> PreTrainedModel:
    _load_hub_kernels()
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _sub_state(state: Mapping[str, Tensor] | None, prefix: str) -> dict[str, Tensor] | None:
    if state is None:
        return None
    return {k[len(prefix) :]: v.detach() for k, v in state.items() if k.startswith(prefix)}


def _prefixed(state: dict[str, Tensor] | None, prefix: str) -> dict[str, Tensor] | None:
    return None if state is None else {prefix + k: v for k, v in state.items()}


def hf_pipeline_layers(source: PreTrainedModel | PretrainedConfig) -> list[LayerSpec]:
    """The layer list of a Hugging Face decoder-only causal LM (see [Note: a Hugging Face model as pipeline layers]).

    Args:
        source: a ``*ForCausalLM`` model (its weights become the layers' initial weights, see [Note: starting from
            the Hugging Face weights]) or its configuration (layers start from a seeded random initialisation).

    Returns:
        ``LayerSpec``/``TiedLayerSpec`` objects for ``PipelineModule``: embedding, (GPT-2: positions,) one
        `DecoderLayer` per layer, `FinalNorm`, head (tied to the embedding under key ``"embed"`` when
        ``tie_word_embeddings``).

    Raises:
        ValueError: an unsupported ``model_type`` or attention implementation.
    """
    _load_hub_kernels()
    from transformers import PreTrainedModel

    model = source if isinstance(source, PreTrainedModel) else _meta_model(source)
    config = model.config
    layout = _layout(config)
    if config._attn_implementation not in (*_MASKLESS, "eager"):
        raise ValueError(
            f"hf_pipeline: attention implementation {config._attn_implementation!r} is not supported in pipeline "
            "layers; build the model with attn_implementation='sdpa' or 'eager'"
        )
    state = model.state_dict() if isinstance(source, PreTrainedModel) else None
    ini = None if state is not None else model  # the meta model's _init_weights: see [Note: starting from ...]
    pairs = dict(layout.prefixes())
    # the decoder stack of the family's *ForCausalLM (LlamaModel, GPT2Model): its submodules are read by name
    inner: Any = model.model if layout.family == "llama" else model.transformer
    blocks = inner.layers if layout.family == "llama" else inner.h
    layer_cls = type(blocks[0])
    rotary_cls = type(inner.rotary_emb) if layout.family == "llama" else None
    vocab, hidden = config.vocab_size, config.hidden_size
    embed_prefix = next(iter(pairs.values()))
    embed_init = _sub_state(state, embed_prefix)
    padding_idx = inner.embed_tokens.padding_idx if layout.family == "llama" else None
    embed_args = (vocab, hidden, padding_idx)
    layers: list[LayerSpec] = [
        TiedLayerSpec("embed", TokenEmbedding, *embed_args, init=embed_init, initializer=ini)
        if layout.tied
        else LayerSpec(TokenEmbedding, *embed_args, init=embed_init, initializer=ini)
    ]
    if layout.family == "gpt2":
        wpe = _prefixed(_sub_state(state, "transformer.wpe."), "wpe.")
        layers.append(LayerSpec(GPT2Positions, config, init=wpe, initializer=ini))
    for i in range(layout.n_layer):
        hf_prefix = pairs[f"{layout.first_block + i}.layer."]
        layers.append(
            LayerSpec(
                DecoderLayer, config, i, layer_cls, rotary_cls, init=_sub_state(state, hf_prefix), initializer=ini
            )
        )
    norm = inner.norm if layout.family == "llama" else inner.ln_f
    eps = norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps
    norm_init = _sub_state(state, pairs[f"{layout.first_block + layout.n_layer}.norm."])
    layers.append(LayerSpec(FinalNorm, type(norm), hidden, eps, init=_prefixed(norm_init, "norm."), initializer=ini))
    if layout.tied:
        layers.append(
            TiedLayerSpec(
                "embed", TokenEmbedding, *embed_args, init=embed_init, initializer=ini, forward_fn=tied_lm_head
            )
        )
    else:
        layers.append(LayerSpec(LMHead, hidden, vocab, init=_sub_state(state, "lm_head."), initializer=ini))
    return layers


def hf_pipeline(source: PreTrainedModel | PretrainedConfig, **kwargs: Any) -> PipelineModule:
    """``PipelineModule(hf_pipeline_layers(source), loss_fn=causal_lm_loss, **kwargs)``: a Hugging Face causal LM
    for ``Trainer(strategy="zstack_pipeline")`` or ``PipelineEngine``. Batches are ``(input_ids, targets)`` with the
    targets already shifted (what ``TextCorpusDataModule`` yields). ``partition_method`` defaults to
    ``"type:DecoderLayer"`` (the same number of decoder layers per stage).

    Raises:
        ValueError: see `hf_pipeline_layers`.
    """
    kwargs.setdefault("partition_method", "type:DecoderLayer")
    kwargs.setdefault("loss_fn", causal_lm_loss)
    return PipelineModule(hf_pipeline_layers(source), **kwargs)


# ---------------------------------------------------------------------------------------------------- state dicts
def _rename(state: Mapping[str, Tensor], pairs: Sequence[tuple[str, str]], what: str) -> Iterator[tuple[str, Tensor]]:
    unknown = []
    for name, value in state.items():
        match = max((p for p in pairs if name.startswith(p[0])), key=lambda p: len(p[0]), default=None)
        if match is None:
            unknown.append(name)
            continue
        yield match[1] + name[len(match[0]) :], value
    if unknown:
        raise ValueError(f"{what}: {len(unknown)} key(s) have no counterpart: {unknown[:8]}")


def hf_to_pipeline_state(state: Mapping[str, Tensor], config: PretrainedConfig) -> dict[str, Tensor]:
    """Renames a Hugging Face ``*ForCausalLM`` state dict to the names of a one-stage `hf_pipeline` (a split
    pipeline's ``state_dict`` holds the subset of its stages: load with ``strict=False`` and check that nothing of the
    rank's own keys is missing).

    Raises:
        ValueError: unsupported model type, or keys that belong to no pipeline layer.
    """
    layout = _layout(config)
    body = {k: v for k, v in state.items() if not (layout.tied and k == "lm_head.weight")}
    return dict(_rename(body, [(hf, pipe) for pipe, hf in layout.prefixes()], "hf_to_pipeline_state"))


def pipeline_to_hf_state(state: Mapping[str, Tensor], config: PretrainedConfig, prefix: str = "") -> dict[str, Tensor]:
    """Renames a one-stage (or consolidated) `hf_pipeline` state dict to Hugging Face names, ready for
    ``model.load_state_dict(..., strict=True)``; with tied embeddings ``lm_head.weight`` is the embedding's tensor.

    Args:
        state: pipeline names, e.g. ``consolidate_pipeline_checkpoint``'s output.
        config: the model's configuration.
        prefix: removed from every key first (e.g. ``"pipe."`` for a LightningModule attribute); keys without it
            are skipped.

    Raises:
        ValueError: unsupported model type, or keys that belong to no layer.
    """
    layout = _layout(config)
    body = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    out = dict(_rename(body, layout.prefixes(), "pipeline_to_hf_state"))
    if layout.tied:
        out["lm_head.weight"] = out[layout.embed_key]
    return out


def export_pretrained(
    state: Mapping[str, Tensor], config: PretrainedConfig, out_dir: str | Path, prefix: str = "model."
) -> Path:
    """Writes a ``save_pretrained`` folder from a consolidated state dict (``zlightning consolidate`` output of a
    LightningModule holding the Hugging Face model as ``self.model``): the weights are loaded with
    ``load_state_dict(strict=True)`` into the model class of ``config`` first, so a missing or extra key fails here,
    not when the folder is read. ``AutoModelForCausalLM.from_pretrained(out_dir)`` then loads it without zlightning.

    Args:
        state: the consolidated state dict (``torch.load(path, weights_only=True)``).
        config: the model's configuration.
        out_dir: the folder to write.
        prefix: the LightningModule attribute of the model (``"model."``); keys without it are skipped.

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        RuntimeError: the weights do not match the model class (``load_state_dict`` strict).
    """
    _load_hub_kernels()
    from transformers import AutoModelForCausalLM

    weights = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layout = _layout(config) if getattr(config, "model_type", None) in (*LLAMA_FAMILY, "gpt2") else None
    if layout is not None and layout.tied and "lm_head.weight" not in weights and layout.embed_key in weights:
        weights["lm_head.weight"] = weights[layout.embed_key]  # a state dict that kept one name of the tied pair
    model.load_state_dict(weights, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
