"""Replacement modules: tensor-parallel Linear/Embedding and fused attention / norms.

[Note: TP layers share the parameter objects they are built from]
A sharded layer owns a *new* ``nn.Parameter`` holding its slice. Sharing is preserved through a memo keyed by the
original parameter's id and the slice taken: the tied LM head and the token embedding (both sliced on the hidden dim,
see `LinearStyle.TIED_HEAD`) therefore end up holding the very same shard parameter, as the unsharded model did.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zlightning.inject._collectives import copy_to_tp, gather_from_tp, reduce_from_tp, scatter_to_tp

__all__ = [
    "ColumnParallelLinear",
    "FusedNorm",
    "FusedSelfAttention",
    "HiddenParallelEmbedding",
    "RowParallelLinear",
    "ShardMemo",
]

ShardMemo = dict[tuple[int, str], nn.Parameter]
"""(id(original parameter), slice spec) -> shard parameter; see [Note: TP layers share the parameter objects ...]."""


def tp_slice(full: Tensor, dim: int, chunks: int, rank: int, world: int) -> Tensor:
    """TP rank ``rank``'s slice of ``full`` on ``dim``; with ``chunks`` > 1 (a fused ``[q; k; v]``) each chunk is
    sliced separately. A view or a new tensor: clone it before keeping it."""
    pieces = [c.chunk(world, dim=dim)[rank] for c in full.chunk(chunks, dim=dim)]
    return pieces[0] if chunks == 1 else torch.cat(pieces, dim=dim)


def tp_merge(slices: list[Tensor], dim: int, chunks: int) -> Tensor:
    """Inverse of `tp_slice`: the full tensor from every TP rank's slice, in rank order."""
    per_rank = [p.chunk(chunks, dim=dim) for p in slices]
    return torch.cat([per_rank[r][c] for c in range(chunks) for r in range(len(slices))], dim=dim)


def _gather(local: Tensor, dim: int, chunks: int, group: dist.ProcessGroup) -> Tensor:
    """Inverse of `_shard`: the full tensor from every rank's slice (a collective over ``group``)."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return tp_merge(parts, dim, chunks)


def _shard(param: torch.Tensor, dim: int, chunks: int, rank: int, world: int, memo: ShardMemo) -> nn.Parameter:
    """This rank's slice of ``param`` on ``dim``; with ``chunks`` > 1 each of the chunks is sliced separately."""
    key = (id(param), f"dim{dim}/chunks{chunks}/{rank}of{world}")
    if key in memo:
        return memo[key]
    shard = nn.Parameter(tp_slice(param.detach(), dim, chunks, rank, world).clone(), requires_grad=param.requires_grad)
    memo[key] = shard
    return shard


class ColumnParallelLinear(nn.Module):
    """``y = x W_r^T + b_r`` with W split on the output dim; optionally all-gathers ``y`` (``gather_output``)."""

    weight: nn.Parameter  # [out_features / tp, in_features]
    bias: nn.Parameter | None  # [out_features / tp]
    tp_split: ClassVar[tuple[str, ...]] = ("weight", "bias")  # parameters holding a different slice per TP rank

    def __init__(
        self,
        linear: nn.Linear,
        group: dist.ProcessGroup,
        memo: ShardMemo,
        *,
        chunks: int = 1,
        gather_output: bool = False,
    ) -> None:
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.gather_output, self.chunks = group, gather_output, chunks
        self.in_features, self.out_features = linear.in_features, linear.out_features // world
        self.weight = _shard(linear.weight, 0, chunks, rank, world, memo)
        self.bias = None if linear.bias is None else _shard(linear.bias, 0, chunks, rank, world, memo)

    def tp_layout(self, attr: str) -> tuple[int, int] | None:
        """``(dim, chunks)`` of ``weight`` and ``bias``: both sliced on the output dim."""
        return (0, self.chunks)

    def unshard(self, attr: str, local: Tensor) -> Tensor:
        """The full (unsharded) value of ``weight``/``bias`` or of its gradient ``local`` (collective)."""
        return _gather(local, 0, self.chunks, self.group)

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out_local={self.out_features}, chunks={self.chunks}, gather={self.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """``y = allreduce(x_r W_r^T) + b`` with W split on the input dim; the bias is replicated and added once.

    ``input_is_parallel=False`` slices a replicated input locally first (the tied LM head).
    """

    weight: nn.Parameter  # [out_features, in_features / tp]
    bias: nn.Parameter | None  # [out_features], replicated
    tp_split: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(
        self, linear: nn.Linear, group: dist.ProcessGroup, memo: ShardMemo, *, input_is_parallel: bool = True
    ) -> None:
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.input_is_parallel = group, input_is_parallel
        self.in_features, self.out_features = linear.in_features // world, linear.out_features
        self.weight = _shard(linear.weight, 1, 1, rank, world, memo)
        self.bias = linear.bias

    def tp_layout(self, attr: str) -> tuple[int, int] | None:
        """``weight`` is sliced on the input dim; ``bias`` is replicated (None)."""
        return (1, 1) if attr == "weight" else None

    def unshard(self, attr: str, local: Tensor) -> Tensor:
        """The full value of ``weight`` (gathered on dim 1) or ``bias`` (replicated), or of its gradient."""
        return _gather(local, 1, 1, self.group) if attr == "weight" else local

    def forward(self, x: Tensor) -> Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, input_is_parallel={self.input_is_parallel}"


class HiddenParallelEmbedding(nn.Module):
    """An ``nn.Embedding`` sliced on the hidden dim; lookups are all-gathered back to full width."""

    weight: nn.Parameter  # [num_embeddings, embedding_dim / tp]
    tp_split: ClassVar[tuple[str, ...]] = ("weight",)

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, memo: ShardMemo) -> None:
        super().__init__()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.group, self.padding_idx = group, embedding.padding_idx
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.weight = _shard(embedding.weight, 1, 1, rank, world, memo)

    def tp_layout(self, attr: str) -> tuple[int, int] | None:
        """The table is sliced on the hidden dim."""
        return (1, 1)

    def unshard(self, attr: str, local: Tensor) -> Tensor:
        """The full embedding table (or its gradient), gathered on the hidden dim (collective)."""
        return _gather(local, 1, 1, self.group)

    def forward(self, idx: Tensor) -> Tensor:
        return gather_from_tp(F.embedding(idx, self.weight, self.padding_idx), self.group)


class FusedSelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``, built from an existing module's
    projections (kept as children under their original names, so they can be sharded afterwards).

    The head count is read from the (possibly sharded) projection width, so the same module serves TP ranks that
    hold ``n_head / tp`` heads.
    """

    def __init__(
        self,
        *,
        qkv_names: tuple[str, ...],
        out_name: str,
        modules: dict[str, nn.Module],
        head_dim: int,
        causal: bool,
        attn_dropout: float,
        resid_drop: tuple[str, nn.Module] | None,
    ) -> None:
        super().__init__()
        self.qkv_names, self.out_name, self.head_dim = qkv_names, out_name, head_dim
        self.causal, self.attn_dropout = causal, attn_dropout
        for name, mod in modules.items():
            self.add_module(name, mod)
        self.resid_name = None
        if resid_drop is not None:
            self.resid_name = resid_drop[0]
            self.add_module(resid_drop[0], resid_drop[1])

    def _heads(self, t_BTX: Tensor) -> Tensor:
        B, T, X = t_BTX.shape
        return t_BTX.view(B, T, X // self.head_dim, self.head_dim).transpose(1, 2)

    def forward(self, x_BTD: Tensor) -> Tensor:
        if len(self.qkv_names) == 1:
            qkv = getattr(self, self.qkv_names[0])(x_BTD)
            q, k, v = qkv.split(qkv.shape[-1] // 3, dim=-1)
        else:
            q, k, v = (getattr(self, n)(x_BTD) for n in self.qkv_names)
        p = self.attn_dropout if self.training else 0.0
        y_BHTd = F.scaled_dot_product_attention(
            self._heads(q), self._heads(k), self._heads(v), dropout_p=p, is_causal=self.causal
        )
        B, H, T, d = y_BHTd.shape
        y = getattr(self, self.out_name)(y_BHTd.transpose(1, 2).reshape(B, T, H * d))
        return y if self.resid_name is None else getattr(self, self.resid_name)(y)

    def extra_repr(self) -> str:
        return f"qkv={self.qkv_names}, out={self.out_name}, head_dim={self.head_dim}, causal={self.causal}"


class FusedNorm(nn.Module):
    """A hand-written LayerNorm/RMSNorm replaced by ``F.layer_norm`` / ``F.rms_norm`` (same parameter objects)."""

    def __init__(
        self, kind: str, weight: nn.Parameter | None, bias: nn.Parameter | None, eps: float, shape: tuple[int, ...]
    ) -> None:
        super().__init__()
        if kind not in ("layer", "rms"):
            raise AssertionError(f"{kind=}")
        self.kind, self.eps, self.shape = kind, eps, shape
        self.weight, self.bias = weight, bias

    def forward(self, x: Tensor) -> Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)
        y = F.rms_norm(x, self.shape, self.weight, self.eps)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"kind={self.kind}, shape={self.shape}, eps={self.eps}"


def probe_equal_training(original: nn.Module, replacement: nn.Module, example: Tensor, atol: float) -> bool:
    """Whether two modules agree on ``example`` in training mode under the same random stream.

    [Note: probing in training mode]
    The eval-mode probe cannot see what a module does only while training: a functional ``F.dropout`` in an MLP's
    forward, a ``nn.Dropout`` applied to attention probabilities rather than to the output. A replacement that
    reproduces the module's dropout draws the same masks from the same generator state (its ``nn.Dropout``
    modules are the original's), so both run from one seed and must agree exactly; a replacement that lost or moved
    a dropout does not. The generator is forked (the caller's random stream is untouched) and buffers that a
    training forward updates (batch-norm statistics) are restored afterwards.
    """
    modes = [original.training, replacement.training]
    buffers = {id(b): (b, b.detach().clone()) for m in (original, replacement) for b in m.buffers()}
    devices = [example.device] if example.device.type == "cuda" else []
    original.train(), replacement.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(4321)
            a = original(example)
            torch.manual_seed(4321)
            b = replacement(example)
        return isinstance(a, Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=1e-4)
    except Exception:  # noqa: BLE001 - a module that cannot run on the probe is simply not replaced
        return False
    finally:
        original.train(modes[0]), replacement.train(modes[1])
        with torch.no_grad():
            for buf, saved in buffers.values():
                buf.copy_(saved)


def probe_equal(original: nn.Module, replacement: nn.Module, example: Tensor, atol: float) -> bool:
    """Whether two modules agree on ``example`` (eval mode, no grad); any exception counts as a mismatch."""
    modes: list[Any] = [original.training, replacement.training]
    original.eval(), replacement.eval()
    try:
        with torch.no_grad():
            a, b = original(example), replacement(example)
        return isinstance(a, Tensor) and a.shape == b.shape and torch.allclose(a, b, atol=atol, rtol=1e-4)
    except Exception:  # noqa: BLE001 - a module that cannot run on the probe is simply not replaced
        return False
    finally:
        original.train(modes[0]), replacement.train(modes[1])
