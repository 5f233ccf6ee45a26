"""Context-parallel attention for the hybrid-CP wrapper: single-process parts and the block helpers.

The 2- and 4-rank checks (CP attention against full-sequence causal SDPA on every aligned block, GPT training parity)
run in `test_hybrid_cp_distributed.py`, one spawn per world size; `_reference` and `_run_block` here serve both.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from zlightning.datamodules.hybrid_cp import zigzag_shard

from examples.gpt_model import GPT, GPTConfig
from zlightning.models.gpt_hybrid_cp import gpt_cp_logits, gpt_cp_loss
from zlightning.parallel import CPShard, HybridCPGroups, cp_attention, cp_causal_attention, zigzag_positions

B, H, D = 2, 3, 4
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _full_inputs(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and the upstream gradient dy of one full sequence, [B, H, L, D] each."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, length, D, generator=gen) for _ in range(4))


def _reference(length: int, seed: int) -> dict[str, torch.Tensor]:
    q, k, v, dy = _full_inputs(length, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(dy)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _run_block(shard: CPShard, length: int, seed: int, via_mode: bool) -> dict[str, torch.Tensor]:
    """This rank's share of one sub-sample: its zigzag rows of q, k, v, dy; returns output and gradients."""
    index = zigzag_positions(length, shard.cp_size, shard.cp_rank)
    q, k, v, dy = (t.index_select(2, index).clone() for t in _full_inputs(length, seed))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if via_mode:  # the model-facing path: a plain causal SDPA call inside cp_attention
        with cp_attention(shard):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = cp_causal_attention(q, k, v, shard)
    out.backward(dy)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


# ----------------------------------------------------------------------------------------- single-process tests


def test_cp_size_one_is_plain_causal_sdpa() -> None:
    shard = CPShard.zigzag(6, 1, 0, None)
    assert shard.q_positions.tolist() == list(range(6)) and shard.mask_tL.shape == (6, 6)
    got = _run_block(shard, 6, seed=5, via_mode=False)
    ref = _reference(6, seed=5)
    for name in got:
        torch.testing.assert_close(got[name], ref[name], rtol=0, atol=0)


def test_gpt_cp_forward_on_one_rank_equals_the_model() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=17, seq_len=16, d_model=8, n_layer=2, n_head=2))
    tokens = torch.randint(0, 17, (12,))
    targets = torch.randint(0, 17, (12,))
    logits_ref, loss_ref = model(tokens[None], targets[None])
    shard = CPShard.zigzag(12, 1, 0, None)
    data = zigzag_shard({"tokens": tokens, "labels": targets}, 1, 0)
    torch.testing.assert_close(gpt_cp_logits(model, data["tokens"], shard), logits_ref[0], rtol=0, atol=0)
    loss = gpt_cp_loss(model, data["tokens"], data["labels"], shard, num_tokens=48)
    torch.testing.assert_close(loss, loss_ref * 12 / 48)  # summed token loss / global token count


def test_zigzag_shard_positions_and_mask() -> None:
    shard = CPShard.zigzag(8, 2, 1, group=_FakeGroup())  # type: ignore[arg-type]
    assert shard.q_positions.tolist() == [2, 3, 4, 5]
    assert shard.kv_positions.tolist() == [0, 1, 6, 7, 2, 3, 4, 5]  # block rank 0's chunks, then rank 1's
    # query at position 2 sees keys 0, 1, 2; query at position 5 sees every key up to 5, none of 6, 7
    assert shard.mask_tL[0].tolist() == [True, True, False, False, True, False, False, False]
    assert shard.mask_tL[3].tolist() == [True, True, False, False, True, True, True, True]


class _FakeGroup:
    """Stands in for a ProcessGroup where no collective runs."""


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cp_size": 3, "cp_rank": 0}, "power-of-two cp_size"),
        ({"cp_size": 2, "cp_rank": 2}, "0 <= cp_rank < cp_size"),
        ({"cp_size": 2, "cp_rank": 0, "group": None}, "needs its block group"),
        ({"cp_size": 1, "cp_rank": 0, "group": _FakeGroup()}, "needs no group"),
        ({"cp_size": 1, "cp_rank": 0, "group": None, "q": [1, 0], "kv": [1, 0]}, "strictly increasing"),
        ({"cp_size": 2, "cp_rank": 0, "q": [0, 3], "kv": [0, 3, 1]}, r"int64 \[cp_size \* t\]"),
    ],
)
def test_cp_shard_rejects_inconsistent_fields(kwargs: dict[str, Any], match: str) -> None:
    q = torch.tensor(kwargs.pop("q", [0, 3]))
    kv = torch.tensor(kwargs.pop("kv", [0, 3, 1, 2] if kwargs["cp_size"] == 2 else [0, 3]))
    group = kwargs.pop("group", _FakeGroup())
    with pytest.raises(ValueError, match=match):
        CPShard(group, kwargs["cp_size"], kwargs["cp_rank"], q, kv)  # type: ignore[arg-type]


def test_zigzag_shard_needs_divisible_length() -> None:
    with pytest.raises(ValueError, match="cannot be cut into 2 \\* cp_size = 4 equal chunks"):
        CPShard.zigzag(6, 2, 0, _FakeGroup())  # type: ignore[arg-type]


def test_attention_rejects_mismatched_inputs() -> None:
    shard = CPShard.zigzag(4, 1, 0, None)
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="inputs hold 3 tokens but the shard has 4"):
        cp_causal_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], shard)
    with pytest.raises(ValueError, match="grouped-query attention"):
        cp_causal_attention(q, q[:, :, :, :1], q, shard)


def test_cp_attention_mode_refuses_non_causal_sdpa_and_passes_other_calls() -> None:
    shard = CPShard.zigzag(4, 1, 0, None)
    q = torch.randn(1, 1, 4, 2)
    with cp_attention(shard):
        assert torch.equal(torch.add(q, 1), q + 1)  # other torch calls pass through
        with pytest.raises(NotImplementedError, match="only causal self-attention"):
            F.scaled_dot_product_attention(q, q, q)
        with pytest.raises(NotImplementedError, match="attn_mask=set"):
            F.scaled_dot_product_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool), is_causal=True)


def test_groups_reject_foreign_or_misaligned_blocks() -> None:
    groups = HybridCPGroups(domain_ranks=(0, 1, 2, 3), rank=1, groups={})
    assert groups.group(1, 1) is None
    with pytest.raises(ValueError, match=r"not in block \[2, 4\)"):
        groups.group(2, 2)
    with pytest.raises(ValueError, match="not an aligned power-of-two block"):
        groups.group(1, 2)
    with pytest.raises(ValueError, match="not an aligned power-of-two block"):
        groups.group(0, 8)


def test_build_needs_initialised_distributed() -> None:
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="call init_process_group"):
        HybridCPGroups.build()


def test_gpt_cp_logits_checks_shapes_and_length() -> None:
    model = GPT(GPTConfig(vocab_size=7, seq_len=4, d_model=4, n_layer=1, n_head=1))
    with pytest.raises(ValueError, match="exceeds the model's 4 positions"):
        gpt_cp_logits(model, torch.zeros(8, dtype=torch.int64), CPShard.zigzag(8, 1, 0, None))
    with pytest.raises(ValueError, match="shard's 4 tokens"):
        gpt_cp_logits(model, torch.zeros(3, dtype=torch.int64), CPShard.zigzag(4, 1, 0, None))
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        gpt_cp_loss(
            model,
            torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64),
            CPShard.zigzag(4, 1, 0, None),
            num_tokens=0,
        )
