"""HybridCPDataLoaderWrapper: unpacking, validation and zigzag sharding in one process.

Reroute correctness on 2 and 4 gloo ranks (spec §4.2.7) runs in `test_hybrid_cp_distributed.py`, one spawn per
world size.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zlightning.datamodules.hybrid_cp import (
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    unpack_packed_batch,
    zigzag_shard,
)


def test_unpack_skips_zero_length_entries_and_returns_views() -> None:
    tokens = torch.arange(6)
    mask = torch.ones(6)
    subs = unpack_packed_batch({"cu_seqlens": torch.tensor([0, 2, 2, 6, 6]), "tokens": tokens, "mask": mask})
    assert [s["tokens"].tolist() for s in subs] == [[0, 1], [2, 3, 4, 5]]
    assert subs[1]["tokens"].data_ptr() == tokens[2:].data_ptr()  # a view, no copy
    assert set(subs[0]) == {"tokens", "mask"}


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"tokens": torch.arange(3)}, "needs a 1-D integer tensor 'cu_seqlens'"),
        ({"cu_seqlens": torch.tensor([1, 3]), "tokens": torch.arange(3)}, "must start at 0"),
        ({"cu_seqlens": torch.tensor([0, 3, 2]), "tokens": torch.arange(3)}, "never decrease"),
        ({"cu_seqlens": torch.tensor([0, 4]), "tokens": torch.arange(3)}, r"key 'tokens' is \(3,\).*ignored_keys"),
        ({"cu_seqlens": torch.tensor([0, 3])}, "no token-aligned key"),
        (
            [
                {"cu_seqlens": torch.tensor([0, 3]), "a": torch.arange(3)},
                {"cu_seqlens": torch.tensor([0, 1]), "b": torch.arange(1)},
            ],
            "sample 1 has keys",
        ),
    ],
)
def test_unpack_rejects_malformed_batches(batch: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpack_packed_batch(batch)


def test_config_validation_and_lazy_collectives() -> None:
    with pytest.raises(ValueError, match="max_seqlen_per_rank must be a positive int"):
        HybridCPConfig(max_seqlen_per_rank=0)
    with pytest.raises(ValueError, match="cp_size must be a positive int"):
        HybridCPConfig(max_seqlen_per_rank=4, cp_size=0)
    with pytest.raises(ValueError, match="must contain 'cu_seqlens'"):
        HybridCPConfig(max_seqlen_per_rank=4, ignored_keys=())
    # Construction runs no collective; iterating without a process group explains what to do.
    wrapper = HybridCPDataLoaderWrapper(
        [{"cu_seqlens": torch.tensor([0, 2]), "t": torch.arange(2)}], HybridCPConfig(max_seqlen_per_rank=4)
    )
    with pytest.raises(RuntimeError, match="not initialised; call init_process_group"):
        next(wrapper)
    assert wrapper.state_dict() == {}


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_zigzag_shard_partitions_the_sequence_with_balanced_causal_work(cp_size: int) -> None:
    length = 8 * cp_size
    data = {"tokens": torch.arange(length) * 10, "emb": torch.randn(length, 2)}
    shards = [zigzag_shard(data, cp_size, r) for r in range(cp_size)]
    positions = torch.cat([s["tokens"] // 10 for s in shards])
    assert sorted(positions.tolist()) == list(range(length))  # a partition of the tokens
    for r, shard in enumerate(shards):
        assert torch.equal(shard["emb"], data["emb"][shard["tokens"] // 10])  # keys stay aligned
        chunk = length // (2 * cp_size)
        assert (shard["tokens"] // 10).tolist()[:chunk] == list(range(r * chunk, (r + 1) * chunk))
    work = [int((s["tokens"] // 10 + 1).sum()) for s in shards]  # causal attention work ~ sum of (pos + 1)
    assert len(set(work)) == 1


def test_zigzag_shard_rejects_indivisible_lengths_and_bad_ranks() -> None:
    with pytest.raises(ValueError, match=r"6 tokens cannot be cut into 2 \* cp_size = 4"):
        zigzag_shard({"t": torch.arange(6)}, 2, 0)
    with pytest.raises(ValueError, match="cp_rank=2 is outside a block of cp_size=2"):
        zigzag_shard({"t": torch.arange(8)}, 2, 2)


def _packed(lengths: list[int]) -> dict[str, torch.Tensor]:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return {"tokens": torch.arange(cu[-1]), "cu_seqlens": torch.tensor(cu)}


def _alone(rank: int, world: int, case: str) -> str:
    from zlightning.datamodules.hybrid_cp import HybridCPConfig, HybridCPDataLoaderWrapper

    if case == "uneven":  # rank 0's loader holds one batch, rank 1's two
        batches = [[_packed([4, 5])]] * (1 if rank == 0 else 2)
    else:  # rank 0's batch is malformed (cu_seqlens ends past its 9 tokens)
        bad = _packed([4, 5])
        if rank == 0:
            bad["cu_seqlens"] = torch.tensor([0, 4, 12])
        batches = [[bad]]
    try:
        return f"{sum(1 for _ in HybridCPDataLoaderWrapper(batches, HybridCPConfig(max_seqlen_per_rank=16)))} batches"
    except (RuntimeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"


@pytest.mark.parametrize("case", ["uneven", "malformed"])
def test_a_rank_that_runs_out_or_fails_alone_stops_every_rank_with_the_reason(case: str) -> None:
    from zlightning.testing import run_distributed

    out = run_distributed(_alone, 2, case, timeout=60)  # a hang would time out here
    if case == "uneven":
        assert all("group rank(s) [0] ran out while the other ranks still had batches" in o for o in out), out
    else:
        assert out[0].startswith("ValueError: unpack_packed_batch"), out
        assert out[1].startswith("RuntimeError: HybridCPDataLoaderWrapper: a malformed batch on group rank(s) [0]")
