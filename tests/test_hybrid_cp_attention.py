"""Context-parallel attention and GPT training under the hybrid-CP wrapper (issue 8), on 2 and 4 gloo ranks.

One spawn per world size checks (a) CP attention forward and backward against full-sequence causal SDPA for every
aligned block, and (b) training parity: the example GPT trained for a few SGD steps on wrapper batches (CP sizes up
to the world size, loss-masked, per-token normalised) matches single-process training on the same global batches in
losses, first-step gradients and final parameters (fp32, rtol 1e-5). World 4 runs two ranks per data replica and the
lockstep (ZeRO-safe) micro-step plan.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt_model import GPT, GPTConfig
from zlightning.datamodules import (
    CPShard,
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    HybridCPGroups,
    cp_attention,
    cp_causal_attention,
    gpt_cp_logits,
    gpt_cp_loss,
    hybrid_cp_forward_backward,
    unpack_packed_batch,
    zigzag_shard,
)
from zlightning.datamodules.hybrid_cp_model import global_token_count, gpt_pad_loss, lockstep_plan
from zlightning.datamodules.hybrid_cp_wrapper import zigzag_positions
from zlightning.testing import run_distributed

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


def _cases(world_size: int) -> list[tuple[int, int, int, int]]:
    """(cp_size, block_start, length, seed): every aligned block of every size, two lengths each."""
    cases = []
    c = world_size
    while c >= 1:
        for start in range(0, world_size, c):
            for chunk in (1, 3):
                cases.append((c, start, 2 * c * chunk, 1000 * c + 10 * start + chunk))
        c //= 2
    return cases


def _attention_worker(rank: int, world_size: int) -> dict[str, Any]:
    groups = HybridCPGroups.build()
    results: dict[Any, Any] = {}
    for c, start, length, seed in _cases(world_size):
        if start <= rank < start + c:
            shard = CPShard.zigzag(length, c, rank - start, groups.group(start, c))
            for via_mode in (False, True):
                results[(c, start, length, seed, via_mode)] = _run_block(shard, length, seed, via_mode)
    out: dict[str, Any] = {"results": results, "blocks": sorted(groups.groups), "domain": groups.domain_ranks}
    out["training"] = _train_distributed(rank, world_size)
    if world_size == 4:
        # Two interleaved 2-rank domains ({0, 2} and {1, 3}, as with an inner tensor-parallel dimension): every rank
        # must create both domain groups and then build the blocks of both domains.
        domains = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        sub = HybridCPGroups.build(domains[rank % 2])
        shard = CPShard.zigzag(12, 2, sub.rank, sub.group(0, 2))
        out["interleaved"] = (sub.domain_ranks, _run_block(shard, 12, 77 + rank % 2, via_mode=True))
    return out


# ------------------------------------------------------------------------------------ GPT training parity

GPT_CFG = GPTConfig(vocab_size=17, seq_len=32, d_model=16, n_layer=2, n_head=2)
MAX_SEQLEN_PER_RANK = 8
TRAIN_STEPS = 3
LR = 0.5  # SGD with momentum: gradient differences map linearly onto parameters (Adam's g/|g| would amplify
# rounding noise of near-zero gradients into sign flips)


def _cp_per_replica(world_size: int) -> int:
    return 2 if world_size == 4 else 1


def _packed_batch(replica: int, step: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """A replica's packed batch: 2 samples of pieces whose lengths are multiples of 2 * world (zigzag at any CP
    size), up to the domain's capacity, with a random 0/1 loss mask and zero-length cu_seqlens entries."""
    gen = torch.Generator().manual_seed(7919 * step + 31 * replica + world_size)
    unit = 2 * world_size
    samples = []
    for _ in range(2):
        k = int(torch.randint(1, 4, (1,), generator=gen))
        lengths = unit * torch.randint(1, MAX_SEQLEN_PER_RANK * world_size // unit + 1, (k,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        cu = torch.cat([cu, cu[-1:]]).to(torch.int32)
        total = int(cu[-1])
        mask = (torch.rand(total, generator=gen) > 0.3).float()
        samples.append({
            "cu_seqlens": cu,
            "tokens": torch.randint(0, GPT_CFG.vocab_size, (total,), generator=gen),
            "labels": torch.randint(0, GPT_CFG.vocab_size, (total,), generator=gen),
            "loss_mask": mask,
        })
    return samples


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_reference(world_size: int) -> dict[str, Any]:
    """Single process: every step's global batch (all replicas' sub-samples), mean loss over loss-mask tokens."""
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    init = _params(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, first_grads = [], {}
    for step in range(TRAIN_STEPS):
        subs = [s for d in range(world_size // _cp_per_replica(world_size))
                for s in unpack_packed_batch(_packed_batch(d, step, world_size))]
        num = sum(float(s["loss_mask"].sum()) for s in subs)
        loss = torch.zeros(())
        for s in subs:
            logits, _ = model(s["tokens"][None])
            token_losses = F.cross_entropy(logits[0], s["labels"], reduction="none")
            loss = loss + (token_losses * s["loss_mask"]).sum() / num
        loss.backward()
        if step == 0:
            first_grads = _grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "grads": first_grads, "params": _params(model), "init": init}


def _train_distributed(rank: int, world_size: int) -> dict[str, Any]:
    """The same training on the wrapper's batches: CP attention, global normalisation, SUM-reduced gradients."""
    cp = _cp_per_replica(world_size)
    torch.manual_seed(0)
    model = GPT(GPT_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    groups = HybridCPGroups.build()
    batches = [_packed_batch(rank // cp, step, world_size) for step in range(TRAIN_STEPS)]
    wrapper = HybridCPDataLoaderWrapper(batches, HybridCPConfig(max_seqlen_per_rank=MAX_SEQLEN_PER_RANK, cp_size=cp))
    lockstep = world_size == 4  # the ZeRO-safe plan must give the same result
    losses, first_grads, cp_sizes, pads = [], {}, set(), 0
    for step, batch in enumerate(wrapper):
        num = global_token_count(batch, rank, key="loss_mask")

        def loss_fn(data: dict[str, torch.Tensor], shard: CPShard) -> torch.Tensor:
            return gpt_cp_loss(model, data["tokens"], data["labels"], shard, num_tokens=num,
                               loss_mask_t=data["loss_mask"])

        pad = (lambda: gpt_pad_loss(model)) if lockstep else None
        total = hybrid_cp_forward_backward(batch, groups, loss_fn, pad_loss_fn=pad)
        pads += sum(gid is None for _, gid in lockstep_plan(batch.schedule, rank, lockstep=lockstep))
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(total)
        if step == 0:
            first_grads = _grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
        cp_sizes |= {s.cp_size for s in batch.sub_samples}
    return {"losses": losses, "grads": first_grads, "params": _params(model), "cp_sizes": cp_sizes, "pads": pads}


def _check_training(runs: list[dict[str, Any]], world_size: int) -> None:
    ref = _train_reference(world_size)
    for rank, run in enumerate(runs):
        got = run["training"]
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(ref["losses"], dtype=torch.float64), rtol=1e-5, atol=1e-7)
        assert got["grads"].keys() == ref["grads"].keys() and got["params"].keys() == ref["params"].keys()
        for name in ref["grads"]:
            torch.testing.assert_close(got["grads"][name], ref["grads"][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank} grad {name}: {m}")
            torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"rank {rank} param {name}: {m}")
    cp_sizes = set().union(*(run["training"]["cp_sizes"] for run in runs))
    assert max(cp_sizes) == world_size and len(cp_sizes) >= 2, cp_sizes  # blocks of several sizes were exercised
    if world_size == 4:
        assert sum(run["training"]["pads"] for run in runs) > 0  # the lockstep plan padded someone
    moved = max(float((ref["params"][n] - ref["init"][n]).abs().max()) for n in ref["params"])
    assert moved > 1e-2, moved  # the parameters moved far more than the tolerance: the comparison is not vacuous


@pytest.mark.parametrize("world_size", [2, 4])
def test_cp_attention_and_gpt_training_match_single_process(world_size: int) -> None:
    runs = run_distributed(_attention_worker, world_size, timeout=240)
    _check_training(runs, world_size)
    checked = 0
    for rank, run in enumerate(runs):
        assert run["domain"] == tuple(range(world_size))
        expected_blocks = [(s, c) for c in (2, 4, 8) if c <= world_size for s in range(0, world_size, c)
                           if s <= rank < s + c]
        assert run["blocks"] == sorted(expected_blocks)  # only this rank's blocks are kept
        for (c, start, length, seed, via_mode), got in run["results"].items():
            index = zigzag_positions(length, c, rank - start)
            ref = _reference(length, seed)
            for name in ("out", "dq", "dk", "dv"):
                torch.testing.assert_close(got[name], ref[name].index_select(2, index), **TOL,
                                           msg=lambda m: f"rank {rank} c={c} L={length} mode={via_mode} {name}: {m}")
            checked += 1
    assert checked == 2 * sum(c for c, *_ in _cases(world_size))  # every rank of every block, both paths
    if world_size == 4:
        for rank, run in enumerate(runs):
            domain, got = run["interleaved"]
            assert domain == ((0, 2) if rank % 2 == 0 else (1, 3))
            index = zigzag_positions(12, 2, rank // 2)
            ref = _reference(12, 77 + rank % 2)
            for name in ("out", "dq", "dk", "dv"):
                torch.testing.assert_close(got[name], ref[name].index_select(2, index), **TOL)


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
        gpt_cp_loss(model, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                    CPShard.zigzag(4, 1, 0, None), num_tokens=0)
