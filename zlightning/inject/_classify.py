"""AutoTP-style classification of every ``nn.Linear`` (pure: reads the model, changes nothing).

[Note: how a Linear is classified]
Priority: (1) the user's plan (first regex that fully matches the qualified name); (2) a Linear whose weight *is* an
``nn.Embedding``'s weight is a tied LM head; (3) inside a transformer block (a child of an ``nn.ModuleList``): a name
rule (``o_proj``, ``down_proj``, ``proj`` ... are row-parallel; ``q_proj``, ``up_proj``, ``fc`` ... column), else the
structure rule -- a Linear followed (in registration order) by a norm (recognised by structure and behaviour, see
[Note: what counts as a norm] in ``_norms.py``), or the block's last Linear, is row-parallel,
every other one column-parallel; a column Linear with ``out == 3 * in`` named like a fused projection, or sitting in an
attention module, is a fused QKV; (4) outside blocks: ``lm_head``/``head``/``embed_out``/``output`` is the LM head,
everything else replicated.
A TP plan is then checked as data flow per block: a row layer needs a column layer before it (since the last row
layer), and a block must not end with a sharded activation.
"""

from __future__ import annotations

import re

from torch import nn

from zlightning.inject._norms import hidden_sizes, is_norm
from zlightning.inject._policy import InjectError, InjectPolicy, LinearStyle

__all__ = ["HEAD_ATTRS", "classify_linears", "shardable_embedding", "validate_tp"]

HEAD_ATTRS = ("n_head", "num_heads", "n_heads", "num_attention_heads", "heads", "nhead")
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
_ROW_NAMES = {"proj", "o_proj", "out_proj", "down_proj", "c_proj", "dense_4h_to_h", "fc2", "w2", "wo", "out"}
_COL_NAMES = {
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "fc",
    "fc1",
    "c_fc",
    "w1",
    "w3",
    "wq",
    "wk",
    "wv",
    "query",
    "key",
    "value",
    "dense_h_to_4h",
}
_QKV_NAMES = {"qkv", "c_attn", "wqkv", "qkv_proj", "in_proj"}
_HEAD_MAJOR_QKV_NAMES = {"query_key_value"}
"""Fused projections laid out head by head (Megatron, GPT-NeoX, BLOOM: the rows of head ``h`` are its q, k and v), so
a plain column split hands each rank whole heads: see [Note: head-major fused projections]."""
_HEAD_NAMES = {"lm_head", "head", "embed_out", "output"}


def shardable_embedding(module: nn.Module, tp: int) -> bool:
    """Whether TP slices this embedding on its hidden dimension (`HiddenParallelEmbedding`).

    [Note: embeddings that stay replicated]
    Only a plain lookup is sliced: an ``nn.Embedding`` subclass with its own ``forward`` (a scaled embedding, a
    learned positional embedding taking ``position_ids``) would lose that forward, and an embedding whose width does
    not divide by ``tp`` (a small auxiliary table) or that uses ``max_norm``/``sparse`` cannot be sliced. Those stay
    replicated (correct: every TP rank computes the same lookup and receives the same gradient), and a Linear tied to
    such an embedding's weight stays replicated with it, so the tie holds.
    """
    return (
        isinstance(module, nn.Embedding)
        and type(module).forward is nn.Embedding.forward
        and module.embedding_dim % tp == 0
        and module.max_norm is None
        and not module.sparse
    )


def _blocks(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> block, for every child of every ``nn.ModuleList``."""
    out: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for child_name, child in module.named_children():
                out[f"{name}.{child_name}" if name else child_name] = child
    return out


def _block_styles(prefix: str, block: nn.Module, hidden: set[int]) -> dict[str, LinearStyle]:
    markers = [(n, m) for n, m in block.named_modules() if n and (isinstance(m, nn.Linear) or is_norm(m, hidden))]
    styles: dict[str, LinearStyle] = {}
    linears = [i for i, (_, m) in enumerate(markers) if isinstance(m, nn.Linear)]
    for i in linears:
        name, linear = markers[i]
        leaf = name.rsplit(".", 1)[-1].lower()
        parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
        if isinstance(parent, nn.MultiheadAttention):
            # its Q/K/V come from in_proj_weight, a Parameter TP does not split: the output projection has no
            # sharded input to reduce, so the attention stays replicated (the block's MLP is still split)
            styles[f"{prefix}.{name}"] = LinearStyle.REPLICATE
            continue
        if leaf in _ROW_NAMES:
            style = LinearStyle.ROW
        elif leaf in _COL_NAMES:
            style = LinearStyle.COLUMN
        else:
            followed_by_norm = i + 1 < len(markers) and not isinstance(markers[i + 1][1], nn.Linear)
            style = LinearStyle.ROW if followed_by_norm or i == linears[-1] else LinearStyle.COLUMN
        fused = linear.out_features == 3 * linear.in_features and (
            leaf in _QKV_NAMES or any(isinstance(getattr(parent, a, None), int) for a in HEAD_ATTRS)
        )
        if leaf in _HEAD_MAJOR_QKV_NAMES:
            style = LinearStyle.COLUMN  # see [Note: head-major fused projections]
        elif style is LinearStyle.COLUMN and fused:
            style = LinearStyle.QKV
        styles[f"{prefix}.{name}"] = style
    # [Note: head-major fused projections]
    # Megatron's ``query_key_value`` (GPT-NeoX, BLOOM) orders its rows head by head, ``[q_h; k_h; v_h]`` for each head
    # ``h``, and its attention views the output as ``(..., heads, 3 * head_dim)``. A plain column split then gives each
    # rank whole heads with their q, k and v (the attention infers the local head count from the width), whereas the
    # ``[q; k; v]`` split of `LinearStyle.QKV` would mix heads: it is a column layer. The attention's output projection
    # (the last Linear beside it, ``dense``) is row-parallel, whatever follows it in the block (a parallel-residual
    # block runs its MLP next, which the structure rule would take for the row layer's successor).
    for name, linear in block.named_modules():
        if not (isinstance(linear, nn.Linear) and "." in name):
            continue
        parent_name = name.rsplit(".", 1)[0]
        siblings = [c for c, m in block.get_submodule(parent_name).named_children() if isinstance(m, nn.Linear)]
        fused_here = [c for c in siblings if c.lower() in _QKV_NAMES | _HEAD_MAJOR_QKV_NAMES]
        if fused_here and siblings[-1] == name.rsplit(".", 1)[1] and siblings[-1] not in fused_here:
            styles[f"{prefix}.{name}"] = LinearStyle.ROW
    return styles


def classify_linears(model: nn.Module, policy: InjectPolicy) -> dict[str, LinearStyle]:
    """Classifies every ``nn.Linear`` of ``model``; see [Note: how a Linear is classified].

    Args:
        model: the (unsharded) model.
        policy: supplies the user plan.

    Returns:
        Qualified Linear name -> style, in ``named_modules`` order.

    Raises:
        InjectError: a plan pattern matches no Linear, or names a module that is not an ``nn.Linear``.
    """
    tp = policy.tp_size
    embed_weights = {id(m.weight) for m in model.modules() if shardable_embedding(m, tp)}
    replicated_embed_weights = {  # see [Note: embeddings that stay replicated]
        id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and not shardable_embedding(m, tp)
    }
    auto: dict[str, LinearStyle] = {}
    hidden = hidden_sizes(model)
    for prefix, block in _blocks(model).items():
        auto.update(_block_styles(prefix, block, hidden))
    styles: dict[str, LinearStyle] = {}
    used: set[str] = set()
    modules = dict(model.named_modules())
    for pattern in policy.plan:
        bad = [n for n, m in modules.items() if re.fullmatch(pattern, n) and not isinstance(m, nn.Linear)]
        if bad and not any(isinstance(modules[n], nn.Linear) for n in modules if re.fullmatch(pattern, n)):
            raise InjectError(
                f"InjectPolicy.plan: pattern {pattern!r} matches {bad[:3]}, which are not nn.Linear; "
                "plans classify Linear layers only"
            )
    for name, module in modules.items():
        if not isinstance(module, nn.Linear):
            continue
        hit = next((p for p in policy.plan if re.fullmatch(p, name)), None)
        if hit is not None:
            used.add(hit)
            styles[name] = LinearStyle(policy.plan[hit])
        elif id(module.weight) in embed_weights:
            styles[name] = LinearStyle.TIED_HEAD
        elif id(module.weight) in replicated_embed_weights:
            styles[name] = LinearStyle.REPLICATE
        elif name in auto:
            styles[name] = auto[name]
        elif name.rsplit(".", 1)[-1].lower() in _HEAD_NAMES:
            styles[name] = LinearStyle.HEAD
        else:
            styles[name] = LinearStyle.REPLICATE
    unused = [p for p in policy.plan if p not in used]
    if unused:
        raise InjectError(
            f"InjectPolicy.plan: patterns {unused} match no nn.Linear (re.fullmatch on qualified names "
            f"such as {list(styles)[:3]}); fix or remove them"
        )
    return styles


def validate_tp(model: nn.Module, styles: dict[str, LinearStyle], tp: int) -> None:
    """Checks that every sharded dimension divides by ``tp`` and that each block's plan is a valid data flow.

    Raises:
        InjectError: naming the module, the dimension and the fix.
    """
    modules = dict(model.named_modules())
    for name, style in styles.items():
        lin = modules[name]
        if not isinstance(lin, nn.Linear):
            raise AssertionError(f"{name=}")
        dim, what = {
            LinearStyle.COLUMN: (lin.out_features, "out_features"),
            LinearStyle.HEAD: (lin.out_features, "out_features"),
            LinearStyle.QKV: (lin.out_features // 3, "out_features/3"),
            LinearStyle.ROW: (lin.in_features, "in_features"),
            LinearStyle.TIED_HEAD: (lin.in_features, "in_features"),
        }.get(style, (0, ""))
        if style is LinearStyle.QKV and lin.out_features % 3:
            raise InjectError(f"{name}: fused QKV needs out_features divisible by 3, got {lin.out_features}")
        if dim % tp:
            raise InjectError(
                f"{name} ({style.value}-parallel): {what}={dim} is not divisible by tp_size={tp}; "
                f"choose a tp_size dividing it or plan the layer as 'replicate'"
            )
    for name, module in modules.items():
        heads = next((getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
        if heads is not None and heads % tp:
            raise InjectError(f"{name}: {heads} attention heads are not divisible by tp_size={tp}")
        projections = [f"{name}.{c}" if name else c for c, m in module.named_children() if isinstance(m, nn.Linear)]
        if any(styles.get(n, LinearStyle.REPLICATE) is not LinearStyle.REPLICATE for n in projections):
            # the heads an attention module splits, read where Hugging Face keeps them too (module.config)
            config = getattr(module, "config", None)
            for attr in HEAD_ATTRS + KV_HEAD_ATTRS:
                value = getattr(module, attr, None)
                value = getattr(config, attr, None) if not isinstance(value, int) else value
                if isinstance(value, int) and not isinstance(value, bool) and value % tp:
                    raise InjectError(
                        f"{name} ({type(module).__name__}): {attr}={value} is not divisible by tp_size={tp}, so its "
                        "sharded projections would split a head; choose a tp_size dividing it or plan its "
                        "projections as 'replicate'"
                    )
    for prefix, _ in _blocks(model).items():
        sharded, last = False, ""
        for name, style in styles.items():
            if not name.startswith(prefix + "."):
                continue
            if style is LinearStyle.ROW and not sharded:
                raise InjectError(
                    f"{name} is planned row-parallel but no column-parallel layer precedes it in block "
                    f"{prefix}, so its input is not sharded; plan the Linear producing its input as 'column', or "
                    f"plan {name} as 'replicate' when its input comes from elsewhere (a Parameter, another block)"
                )
            sharded = style in (LinearStyle.COLUMN, LinearStyle.QKV) or (sharded and style is not LinearStyle.ROW)
            last = name
        if sharded:
            raise InjectError(
                f"block {prefix} ends with a sharded activation after {last}; plan its last layer as "
                "'row' so the output is all-reduced"
            )
