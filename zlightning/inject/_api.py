"""``module_inject``: automatic tensor parallelism for training plus kernel injection, in place.

[Note: tensor parallelism alone is silent about kernels]
With ``inject_kernels=False`` and ``tp_size > 1`` only what sharding needs is rebuilt: an attention module whose
projections are sharded must run on `FusedSelfAttention` to split its heads (or the call fails), every other
attention, MLP and norm is left as it is, and nothing is said about fusing them.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import warnings
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch import nn

from zlightning._threads import small_thread_stacks
from zlightning.inject._classify import (
    HEAD_ATTRS,
    KV_HEAD_ATTRS,
    classify_linears,
    shardable_embedding,
    validate_tp,
)
from zlightning.inject._layers import (
    ColumnParallelLinear,
    FusedSelfAttention,
    HiddenParallelEmbedding,
    RowParallelLinear,
    ShardMemo,
    probe_equal,
    probe_equal_training,
    tp_slice,
)
from zlightning.inject._mlp import FusedMLP, fused_mlp_for
from zlightning.inject._norms import fused_norm_for, norm_candidates
from zlightning.inject._norms import probe_input as _probe_input
from zlightning.inject._policy import InjectError, InjectPolicy, LinearStyle

__all__ = ["TPGroups", "apply_tensor_parallel", "build_tp_groups", "module_inject", "tp_full_state"]

_SPLIT_QKV = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("q", "k", "v"), ("wq", "wk", "wv"))
_OUT_NAMES = ("proj", "o_proj", "out_proj", "c_proj", "dense", "wo", "out")
_RESID_DROP = ("resid_drop", "resid_dropout", "proj_drop", "dropout")


@dataclass(frozen=True)
class TPGroups:
    """A DP x TP grid: TP groups are contiguous ranks ``[k*tp, (k+1)*tp)``, DP groups strided (``r mod tp``)."""

    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    tp_rank: int
    dp_rank: int
    tp_size: int
    dp_size: int


@small_thread_stacks(
    backend=None
)  # every gloo group starts threads: see [Note: thread stacks count against a data limit]
def build_tp_groups(tp_size: int) -> TPGroups:
    """Builds the TP and DP process groups of the world (every rank must call it, in the same order).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: ``tp_size`` does not divide the world size.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_tp_groups: call torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"build_tp_groups: tp_size={tp_size} must divide the world size {world}")
    tp_group = dp_group = None
    for k in range(world // tp_size):
        g = dist.new_group(list(range(k * tp_size, (k + 1) * tp_size)))
        tp_group = g if rank // tp_size == k else tp_group
    for j in range(tp_size):
        g = dist.new_group(list(range(j, world, tp_size)))
        dp_group = g if rank % tp_size == j else dp_group
    if tp_group is None or dp_group is None:
        raise AssertionError(f"{rank=} {tp_size=}")
    return TPGroups(tp_group, dp_group, rank % tp_size, rank // tp_size, tp_size, world // tp_size)


def module_inject(
    model: nn.Module, policy: InjectPolicy = InjectPolicy(), *, tp_group: dist.ProcessGroup | None = None
) -> nn.Module:
    """Rewrites ``model`` in place: fused kernels and/or tensor parallelism (training).

    The algorithm: (1) classify every ``nn.Linear`` (`classify_linears`; see [Note: how a Linear is classified]) and,
    for ``tp_size > 1``, validate divisibility and per-block data flow; (2) kernel injection: each attention module
    (a head-count attribute plus a fused or split Q/K/V and an output projection) is rebuilt as `FusedSelfAttention`
    (``F.scaled_dot_product_attention``), each MLP (plain or gated) as `FusedMLP` and each hand-written Layer/RMS
    norm (recognised by structure and behaviour, see [Note: what counts as a norm] in ``_norms.py``) as `FusedNorm`,
    each only if it agrees with the original on a probe input (causality is detected the same way); with
    ``inject_kernels=False`` only the attention modules that sharding needs are rebuilt (see [Note: tensor
    parallelism alone is silent about kernels]); (3) tensor parallelism: Linears become
    `ColumnParallelLinear` / `RowParallelLinear` per style, embeddings are sliced on the hidden dim (a tied LM head
    keeps sharing the shard), and autograd Functions place the all-reduce/all-gather in forward and backward.
    Replicated parameters receive identical full gradients on every TP rank, so a TP run equals a single-process run.

    Call it on identically initialised replicas on every TP rank, before building the optimizer (parameters are
    replaced). Feed every TP rank of a group the same batch (a sampler over the DP group only).

    Args:
        model: the model (modified in place and returned).
        policy: what to do (`InjectPolicy`).
        tp_group: the tensor-parallel process group (``build_tp_groups(...).tp_group``); required when
            ``policy.tp_size > 1`` and its size must equal ``tp_size``.

    Returns:
        ``model``.

    Raises:
        InjectError: an indivisible dimension, an invalid plan, an attention module that cannot be sharded, or a
            compressed model (its techniques would be dropped).
        ValueError: a missing or mismatched ``tp_group``.
    """
    tp = policy.tp_size
    if tp > 1:
        if tp_group is None:
            raise ValueError(f"module_inject: policy.tp_size={tp} needs tp_group= (see build_tp_groups({tp}))")
        if dist.get_world_size(tp_group) != tp:
            raise ValueError(
                f"module_inject: tp_group has {dist.get_world_size(tp_group)} ranks but policy.tp_size={tp}"
            )
    compressed = [n for n, m in model.named_modules() if callable(getattr(m, "compressed_params", None))]
    if compressed and (tp > 1 or policy.inject_kernels):
        # a swapped or split layer would silently lose its masks and quantizer (zlightning.compression)
        raise InjectError(
            f"module_inject: {compressed[:3]} carry compression techniques (zlightning.compression or its callbacks), "
            "which tensor parallelism and kernel injection would drop. Compression applies to the unsplit model: "
            "train it without tensor parallelism (tensor_parallel_size=1), or compress after splitting through "
            "init_compression(..., mpu=...) with Megatron-style layers"
        )
    styles = classify_linears(model, policy)
    if tp > 1:
        validate_tp(model, styles, tp)
    if policy.inject_kernels or tp > 1:
        _inject_attention(model, styles, policy, required=tp > 1)
    if policy.inject_kernels and policy.fuse_mlp != "off":
        _inject_mlps(model, policy)
    if policy.inject_kernels:
        _inject_norms(model, policy)
    if tp > 1 and not any(s not in (LinearStyle.REPLICATE,) for s in styles.values()):
        warnings.warn(
            f"module_inject: tensor parallelism splits no Linear of {type(model).__name__}: every parameter stays "
            "replicated on the TP ranks. Automatic planning looks for nn.Linear layers inside the children of an "
            "nn.ModuleList (blocks) and for lm_head/head/output; layers of other types (GPT-2's Conv1D) are not "
            "split. Plan Linears with InjectPolicy(plan=...)",
            stacklevel=2,
        )
    if tp > 1 and tp_group is not None:
        _shard_model(model, styles, tp_group)
        if policy.check_inputs:
            _check_inputs_once(model, tp_group)
    return model


def _fingerprint(values: list[object]) -> torch.Tensor:
    """Two float64 numbers per tensor input: its sum and a position-weighted sum (order-sensitive)."""
    parts = []
    for v in values:
        if isinstance(v, torch.Tensor):
            flat = v.detach().reshape(-1).double().cpu()
            parts += [flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()]
    return torch.stack(parts) if parts else torch.zeros(1, dtype=torch.float64)


def _check_inputs_once(model: nn.Module, group: dist.ProcessGroup) -> None:
    handle = None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if handle is not None:
            handle.remove()
        mine = _fingerprint([*args, *kwargs.values()])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        if any(e.shape != mine.shape or not torch.equal(e, everyone[0]) for e in everyone):
            raise ValueError(
                "module_inject: the ranks of a tensor-parallel group received different inputs on the first forward; "
                "every TP rank must see the same batch: shard data by the DP rank (num_replicas=dp_size, "
                "rank=dp_rank from build_tp_groups), not by the global rank"
            )

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)


def apply_tensor_parallel(model: nn.Module, tp_size: int, policy: InjectPolicy | None = None) -> TPGroups:
    """One call for strategies: builds the DP x TP grid over the world and shards ``model`` over its TP group.

    Without ``policy`` this is tensor parallelism alone (``InjectPolicy(inject_kernels=False)``): only what sharding
    needs is rebuilt and nothing is said about fusing other modules (see [Note: tensor parallelism alone is silent
    about kernels]); pass ``InjectPolicy()`` to inject the fused kernels as well.

    Args:
        model: identical on every rank; modified in place (build optimizers afterwards).
        tp_size: tensor-parallel degree (must divide the world size).
        policy: other knobs (its ``tp_size`` is replaced by ``tp_size``); default: TP alone.

    Returns:
        The groups: hand ``dp_group`` to the data-parallel engine and ``dp_rank``/``dp_size`` to the sampler.
    """
    groups = build_tp_groups(tp_size)
    if tp_size > 1:
        base = policy if policy is not None else InjectPolicy(inject_kernels=False)
        module_inject(model, dataclasses.replace(base, tp_size=tp_size), tp_group=groups.tp_group)
    return groups


def _attention_parts(module: nn.Module) -> tuple[tuple[str, ...], str, int] | None:
    heads = next((getattr(module, a) for a in HEAD_ATTRS if isinstance(getattr(module, a, None), int)), None)
    children = dict(module.named_children())
    out = next((n for n in _OUT_NAMES if isinstance(children.get(n), nn.Linear)), None)
    if heads is None or out is None:
        return None
    fused = [n for n, c in children.items() if isinstance(c, nn.Linear) and c.out_features == 3 * c.in_features]
    split = next((t for t in _SPLIT_QKV if all(isinstance(children.get(n), nn.Linear) for n in t)), None)
    qkv = (fused[0],) if len(fused) == 1 else split
    return None if qkv is None else (qkv, out, heads)


def _check_unrecognised_attention(
    name: str, module: nn.Module, styles: dict[str, LinearStyle], policy: InjectPolicy
) -> None:
    """Refuses to shard an attention module (it has a head-count attribute) whose projections were not recognised.

    Its own forward would split the sharded width into the full head count (``x.view(B, T, self.heads, -1)``)
    and compute wrong attention without any error, so only a module rebuilt on `FusedSelfAttention` (whose heads
    are split with the projections) may be sharded automatically; a module that reads its head count from the
    tensor width cannot be told apart, so the user's plan decides (``styles`` holds the automatic styles only).
    A module holding attention modules (a block with a head count) is a container, not attention.
    """
    if not any(isinstance(getattr(module, a, None), int) for a in HEAD_ATTRS):
        return
    for sub in module.modules():
        if sub is not module and (
            _attention_parts(sub) is not None or any(isinstance(getattr(sub, a, None), int) for a in HEAD_ATTRS)
        ):
            return
    prefix = f"{name}." if name else ""
    sharded = [n for n, s in styles.items() if n.startswith(prefix) and s is not LinearStyle.REPLICATE]
    cuts = _cuts(module, name, styles) if sharded else None
    if cuts:  # its forward may read the head count from the width: see [Note: attention that splits its own heads]
        first = cast(nn.Linear, module.get_submodule(next(iter(cuts))))
        example = _probe_input(first.in_features, first.weight.dtype, first.weight.device)
        local = _splits_heads_itself(module, cuts, policy.tp_size, example, policy.probe_atol)
        if local is not None:
            for attr, value in local.items():
                setattr(module, attr, value)
            return
    if sharded:
        raise InjectError(
            f"{name} ({type(module).__name__}) has attention heads but its query/key/value and output projections "
            f"are not recognised, so splitting its heads over {sharded[:3]} cannot be checked; plan them as "
            f"'replicate' (plan={{r'{re.escape(prefix)}.*': 'replicate'}}), or as 'column'/'row' explicitly if its "
            "forward reads the head count from the tensor width"
        )


def _inject_attention(model: nn.Module, styles: dict[str, LinearStyle], policy: InjectPolicy, required: bool) -> None:
    for name, module in list(model.named_modules()):
        parts = _attention_parts(module)
        if parts is None and required and not isinstance(module, FusedSelfAttention):
            automatic = {n: s for n, s in styles.items() if not any(re.fullmatch(p, n) for p in policy.plan)}
            _check_unrecognised_attention(name, module, automatic, policy)
        if parts is None or isinstance(module, FusedSelfAttention) or module is model:  # the root cannot be swapped
            continue
        qkv, out, heads = parts
        children = dict(module.named_children())
        width = children[out].out_features
        drop = next(((n, children[n]) for n in _RESID_DROP if isinstance(children.get(n), nn.Dropout)), None)
        p = next(
            (
                float(getattr(module, a))
                for a in ("dropout", "attn_dropout", "dropout_p")
                if isinstance(getattr(module, a, None), float)
            ),
            0.0,
        )
        weight = children[out].weight
        example = _probe_input(width, weight.dtype, weight.device)
        replacement = None
        # a local (sliding-window) attention equals full causal attention on any probe shorter than its window:
        # never rebuilt on SDPA's full attention
        # and one taking more than its input (a padding mask, position ids) would reject its callers' arguments
        windowed = _window(module)
        kept_because = f"sliding window {windowed!r}" if windowed else None
        if kept_because is None and not _takes_one_input(module):
            kept_because = "its forward takes more than one input"
        for causal in [] if kept_because else [policy.causal] if policy.causal is not None else [True, False]:
            cand = FusedSelfAttention(
                qkv_names=qkv,
                out_name=out,
                modules={n: children[n] for n in (*qkv, out)},
                head_dim=width // heads,
                causal=causal,
                attn_dropout=p,
                resid_drop=drop,
            )
            # in training mode too, unless the candidate's attention dropout runs inside SDPA (its own random
            # stream: statistically the module's dropout, never the same masks); see [Note: probing in training mode]
            if probe_equal(module, cand, example, policy.probe_atol) and (
                p > 0.0 or probe_equal_training(module, cand, example, policy.probe_atol)
            ):
                replacement = cand
                break
        sharded = any(styles.get(f"{name}.{n}") not in (None, LinearStyle.REPLICATE) for n in (*qkv, out))
        if not policy.inject_kernels and not sharded:
            continue  # See [Note: tensor parallelism alone is silent about kernels].
        cuts = _cuts(module, name, styles) if replacement is None and required and sharded else None
        local = _splits_heads_itself(module, cuts, policy.tp_size, example, policy.probe_atol) if cuts else None
        if local is not None:  # its own forward runs on a rank's heads: see [Note: attention that splits its own heads]
            for attr, value in local.items():
                setattr(module, attr, value)
            continue
        if replacement is None:
            if required and sharded:
                why = kept_because or "outputs differ on a probe, in eval or in training mode"
                raise InjectError(
                    f"{name} ({type(module).__name__}): attention could not be rebuilt on "
                    f"F.scaled_dot_product_attention ({why}), so its heads cannot be split; plan its projections "
                    rf"as 'replicate' (plan={{r'{re.escape(name)}\..*': 'replicate'}})"
                    + ("" if kept_because else ", or set InjectPolicy.causal if only causality was misread")
                )
            if policy.inject_kernels:
                why = kept_because or "fused attention differs on the probe"
                warnings.warn(f"module_inject: {name} kept as is ({why})", stacklevel=3)
            continue
        _set_submodule(model, name, replacement)


def _first_tensor(out: object) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _cuts(module: nn.Module, name: str, styles: dict[str, LinearStyle]) -> dict[str, tuple[int, int]] | None:
    """How TP slices the direct Linear children of ``module``: ``{child: (dim, chunks)}`` (None: a sharded Linear
    sits deeper, where a copy of the module cannot be cut)."""
    prefix = f"{name}." if name else ""
    cuts = {}
    for child, lin in module.named_children():
        style = styles.get(prefix + child, LinearStyle.REPLICATE)
        if isinstance(lin, nn.Linear) and style in (LinearStyle.COLUMN, LinearStyle.QKV, LinearStyle.ROW):
            cuts[child] = (1, 1) if style is LinearStyle.ROW else (0, 3 if style is LinearStyle.QKV else 1)
    deeper = [
        n
        for n, s in styles.items()
        if n.startswith(prefix) and "." in n[len(prefix) :] and s is not LinearStyle.REPLICATE
    ]
    return None if deeper or not cuts else cuts


def _splits_heads_itself(
    module: nn.Module, cuts: dict[str, tuple[int, int]], tp: int, example: torch.Tensor, atol: float
) -> dict[str, int] | None:
    """The head-count attributes with which ``module``'s own forward computes the attention of one TP rank's heads
    (``{}``: none to change), or None when it cannot.

    [Note: attention that splits its own heads]
    An attention module that cannot be rebuilt on `FusedSelfAttention` (its forward takes a mask or a cache, as
    Hugging Face's OPT attention does; or its output projection lives elsewhere, as BERT's does) may still run on a
    rank's heads by itself: a forward that reads the head count from the projection's width (``view(..., -1,
    head_dim)``) as it is, and one that reads ``self.num_heads`` once that attribute holds the local count (what
    DeepSpeed's AutoTP changes too). That is checked, not assumed: for every TP rank, a copy holding that rank's
    slices (its heads of the query/key/value projections and, when the module has one, the matching input columns
    of its output projection with the output bias on one rank only) runs on a probe in eval mode, first as it is,
    then with its head-count attributes divided by the TP size. With an output projection the copies' outputs must
    add up to the module's; without one each copy's output must be the module's output for its heads (its slice of
    the last dimension). Otherwise the module is refused as before.
    """
    if tp < 2:
        return None
    counts = {
        a: v
        for a in HEAD_ATTRS + KV_HEAD_ATTRS
        if isinstance(v := getattr(module, a, None), int) and not isinstance(v, bool) and v % tp == 0
    }
    for local in ({}, {a: v // tp for a, v in counts.items()}) if counts else ({},):
        if _rank_copies_agree(module, cuts, tp, example, atol, local):
            return local
    return None


def _rank_copies_agree(
    module: nn.Module,
    cuts: dict[str, tuple[int, int]],
    tp: int,
    example: torch.Tensor,
    atol: float,
    local: dict[str, int],
) -> bool:
    """One try of [Note: attention that splits its own heads], with the attributes ``local`` set on the copies."""
    reduced = any(dim == 1 for dim, _ in cuts.values())  # an output projection: the copies' outputs add up
    mode = module.training
    module.eval()
    try:
        with torch.no_grad():
            want = _first_tensor(module(example))
            outs = []
            for rank in range(tp):
                part = copy.deepcopy(module)
                for attr, value in local.items():
                    setattr(part, attr, value)
                for child, (dim, chunks) in cuts.items():
                    lin = cast(nn.Linear, part.get_submodule(child))
                    lin.weight = nn.Parameter(tp_slice(lin.weight, dim, chunks, rank, tp).clone())
                    if lin.bias is not None and dim == 0:
                        lin.bias = nn.Parameter(tp_slice(lin.bias, 0, chunks, rank, tp).clone())
                    elif lin.bias is not None and rank > 0:
                        lin.bias = nn.Parameter(torch.zeros_like(lin.bias))
                    lin.out_features, lin.in_features = lin.weight.shape
                outs.append(_first_tensor(part(example)))
    except Exception:  # noqa: BLE001 - a forward that cannot run on a rank's heads is refused
        return False
    finally:
        module.train(mode)
    if want is None or any(o is None for o in outs):
        return False
    got = torch.stack(outs).sum(0) if reduced else torch.cat(outs, dim=-1)  # type: ignore[arg-type]
    return got.shape == want.shape and torch.allclose(got, want, atol=atol, rtol=1e-4)


def _takes_one_input(module: nn.Module) -> bool:
    """Whether ``module.forward`` takes a single argument (what `FusedSelfAttention` accepts)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) == 1 and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD)


def _window(module: nn.Module) -> str | None:
    """The name of a sliding-window setting of an attention module (its own attribute or its ``config``'s), if
    one is set."""
    for owner in (module, getattr(module, "config", None)):
        for attr, value in vars(owner).items() if owner is not None else ():
            if "window" in attr.lower() and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return attr
    return None


def _inject_mlps(model: nn.Module, policy: InjectPolicy) -> None:
    for name, module in list(model.named_modules()):
        if module is model or isinstance(module, (FusedMLP, FusedSelfAttention)):
            continue
        weight = next((c.weight for c in module.children() if type(c) is nn.Linear), None)
        if weight is None:
            continue
        fused = fused_mlp_for(
            module,
            lambda width: _probe_input(width, weight.dtype, weight.device),
            policy.probe_atol,
            recompute=policy.fuse_mlp == "recompute",
        )
        if fused is not None:
            _set_submodule(model, name, fused)
        elif any(h in type(module).__name__.lower() for h in ("mlp", "ffn", "feedforward")):
            warnings.warn(
                f"module_inject: {name} ({type(module).__name__}) kept: no fused MLP reading matches it", stacklevel=3
            )


def _inject_norms(model: nn.Module, policy: InjectPolicy) -> None:
    """Fuses every norm recognised by structure and behaviour; see [Note: what counts as a norm]."""
    unfused = []
    for name, module, weight, bias in norm_candidates(model):
        cand = fused_norm_for(module, weight, bias, policy.probe_atol)
        if cand is None:
            unfused.append(f"{name} ({type(module).__name__})")
        else:
            _set_submodule(model, name, cand)
    if unfused:
        warnings.warn(
            f"module_inject: kept {len(unfused)} norm-shaped module(s) whose output matches neither "
            f"LayerNorm nor RMSNorm on a probe: {unfused}; injection_report(model).unfused lists them",
            stacklevel=3,
        )


def _shard_model(model: nn.Module, styles: dict[str, LinearStyle], group: dist.ProcessGroup) -> None:
    memo: ShardMemo = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    tied = {
        id(m.weight): n
        for n, m in modules.items()
        if isinstance(m, nn.Linear)
        and styles.get(n) in (LinearStyle.COLUMN, LinearStyle.HEAD, LinearStyle.QKV, LinearStyle.ROW)
    }
    tp = dist.get_world_size(group)
    for name, module in modules.items():
        if isinstance(module, nn.Embedding):
            if id(module.weight) in tied:
                raise InjectError(
                    f"{name} shares its weight with {tied[id(module.weight)]}, which is planned "
                    f"{styles[tied[id(module.weight)]].value}; plan that layer "
                    + (
                        "'tied_head'"
                        if shardable_embedding(module, tp)
                        else "'replicate' (this embedding is not sliced)"
                    )
                )
            if shardable_embedding(module, tp):  # else replicated: see [Note: embeddings that stay replicated]
                _set_submodule(model, name, HiddenParallelEmbedding(module, group, memo))
    for name, style in styles.items():
        linear = modules[name]
        if not isinstance(linear, nn.Linear):
            raise AssertionError(f"{name=}")
        new: nn.Module | None = {
            LinearStyle.COLUMN: lambda: ColumnParallelLinear(linear, group, memo),
            LinearStyle.QKV: lambda: ColumnParallelLinear(linear, group, memo, chunks=3),
            LinearStyle.HEAD: lambda: ColumnParallelLinear(linear, group, memo, gather_output=True),
            LinearStyle.ROW: lambda: RowParallelLinear(linear, group, memo),
            LinearStyle.TIED_HEAD: lambda: RowParallelLinear(linear, group, memo, input_is_parallel=False),
        }.get(style, lambda: None)()
        if new is not None:
            _set_submodule(model, name, new)
    for module in model.modules():
        # nn.TransformerEncoderLayer's inference fast path reads linear1/linear2 weights directly (the shards,
        # without the collectives): this flag is one of its conditions, so the layer keeps its regular forward
        if hasattr(module, "activation_relu_or_gelu") and any(
            isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in module.modules()
        ):
            setattr(module, "activation_relu_or_gelu", False)  # noqa: B010 (a plain attribute, not a submodule)


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


def tp_full_state(model: nn.Module, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded parameters (or their gradients) of a tensor-parallel model, by qualified name.

    A collective over each TP layer's group: every rank of the group must call it. Names are those of the original
    model (tied parameters appear under each name that holds them), so the result loads into the unsharded model.

    Args:
        model: a model rewritten by `module_inject`.
        grads: return ``param.grad`` values (None gradients are skipped) instead of the parameters.
    """
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(prefix="", recurse=False):
            value = param.grad if grads else param.detach()
            if value is None:
                continue
            unshard = getattr(module, "unshard", None)
            full = unshard(attr, value) if callable(unshard) else value
            out[f"{mod_name}.{attr}" if mod_name else attr] = full.clone() if full is value else full
    return out
