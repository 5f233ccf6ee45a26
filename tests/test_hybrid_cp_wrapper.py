"""HybridCPDataLoaderWrapper: unpacking (single process) and reroute correctness on 2 and 4 gloo ranks (spec §4.2.7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from zlightning.datamodules import (
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    PackedByteDataset,
    unpack_packed_batch,
    zigzag_shard,
)
from zlightning.testing import run_distributed

MAX_SEQLEN = 8
STEPS = 2


def _make_batch(replica: int, step: int, world_size: int) -> list[dict[str, torch.Tensor]]:
    """A replica's packed batch: 2 samples, zero-length cu_seqlens entries, many dtypes, a 2-D key."""
    gen = torch.Generator().manual_seed(1000 * step + replica)
    samples = []
    for _ in range(2):
        k = int(torch.randint(1, 5, (1,), generator=gen))
        lengths = torch.randint(1, MAX_SEQLEN * world_size + 1, (k,), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        cu = torch.cat([cu[:2], cu[1:2], cu[2:], cu[-1:], cu[-1:]]).to(torch.int32)  # zero-length entries
        total = int(cu[-1])
        samples.append(
            {
                "cu_seqlens": cu,
                "max_seqlen": torch.tensor(int(lengths.max())),
                "tokens": torch.randint(0, 256, (total,), generator=gen),
                "labels": torch.randint(0, 256, (total,), generator=gen, dtype=torch.int32),
                "loss_mask": torch.rand(total, generator=gen),
                "flags": torch.rand(total, generator=gen) > 0.5,
                "emb": torch.randn(total, 3, generator=gen).to(torch.bfloat16),
                "bytes": torch.randint(0, 256, (total,), generator=gen, dtype=torch.uint8),
            }
        )
    return samples


def _expected(world_size: int, cp_size: int, step: int) -> tuple[list[int], list[dict[str, torch.Tensor]]]:
    """Reference: seqlens and sub-sample tensors by global id, from the sources directly."""
    subs: list[dict[str, torch.Tensor]] = []
    for replica in range(world_size // cp_size):
        for sample in _make_batch(replica, step, world_size):
            cu = sample["cu_seqlens"].tolist()
            for lo, hi in zip(cu[:-1], cu[1:]):
                if hi > lo:
                    kept = (k for k in sample if k not in ("cu_seqlens", "max_seqlen"))
                    subs.append({k: sample[k][lo:hi].clone() for k in kept})
    return [s["tokens"].shape[0] for s in subs], subs


def _offsets(world_size: int, cp_size: int, step: int) -> list[int]:
    counts = [len(unpack_packed_batch(_make_batch(d, step, world_size))) for d in range(world_size // cp_size)]
    return [sum(counts[:d]) for d in range(len(counts) + 1)]


def _reroute_worker(rank: int, world_size: int, cp_size: int) -> dict[str, Any]:
    batches = [_make_batch(rank // cp_size, step, world_size) for step in range(STEPS)]
    for batch in batches:
        for sample in batch:  # marks which rank sent each token; replica members differ only here
            sample["src"] = torch.full((int(sample["cu_seqlens"][-1]),), rank, dtype=torch.int16)
    config = HybridCPConfig(max_seqlen_per_rank=MAX_SEQLEN, cp_size=cp_size)
    steps = []
    for out in HybridCPDataLoaderWrapper(iter(batches), config):
        steps.append(
            {
                "schedule": out.schedule,
                "seqlens": out.seqlens,
                "total_tokens": out.total_tokens,
                "subs": [(s.gid, s.group, s.cp_size, s.block_start, s.data) for s in out.sub_samples],
            }
        )
    result: dict[str, Any] = {"steps": steps}
    if world_size == 4:
        result["dataset"] = _dataset_worker(rank, world_size)
    if cp_size == 1 and world_size == 2:
        # Both ranks claim to be one replica but read different data: every rank must raise, none may hang.
        desync = HybridCPDataLoaderWrapper(iter([_make_batch(rank, 0, world_size)]), HybridCPConfig(
            max_seqlen_per_rank=MAX_SEQLEN, cp_size=2))
        try:
            next(desync)
        except RuntimeError as err:
            result["desync_error"] = str(err)
    return result


@pytest.fixture(scope="module", params=[(2, 1), (4, 2)], ids=["2ranks-cp1", "4ranks-cp2"])
def distributed_run(request: pytest.FixtureRequest) -> tuple[int, int, list[dict[str, Any]]]:
    world_size, cp_size = request.param
    return world_size, cp_size, run_distributed(_reroute_worker, world_size, cp_size, timeout=120)


def test_reroute_returns_bit_exact_source_slices(distributed_run: tuple[int, int, list[dict[str, Any]]]) -> None:
    world_size, cp_size, results = distributed_run
    for step in range(STEPS):
        seqlens, subs = _expected(world_size, cp_size, step)
        offsets = _offsets(world_size, cp_size, step)
        schedule = results[0]["steps"][step]["schedule"]
        assert schedule, "empty schedule"
        for rank, res in enumerate(results):
            got = res["steps"][step]
            assert got["schedule"] == schedule  # identical on every rank
            assert got["seqlens"] == seqlens  # gids = offsets[replica] + j, zero-length entries ignored
            assert got["total_tokens"] == sum(seqlens)
            order = [gid for group in schedule for gid in group[rank]]
            assert [s[0] for s in got["subs"]] == order  # exactly this rank's gids, in execution order
            for gid, group, cp, block_start, data in got["subs"]:
                ranks = [r for r, ids in enumerate(schedule[group]) if gid in ids]
                assert (cp, block_start) == (len(ranks), ranks[0])
                assert gid in schedule[group][rank]
                assert set(data) == set(subs[gid]) | {"src"} and "cu_seqlens" not in data
                owner = next(d for d in range(world_size // cp_size) if gid < offsets[d + 1])
                # only same-CP-index peers exchange data: the sender is the owner replica's rank with my CP index
                assert torch.equal(data.pop("src"), torch.full((seqlens[gid],), owner * cp_size + rank % cp_size,
                                                               dtype=torch.int16))
                for key, tensor in data.items():
                    ref = subs[gid][key]
                    assert tensor.dtype == ref.dtype, (key, tensor.dtype, ref.dtype)
                    assert tensor.shape == ref.shape and tensor.shape[0] == seqlens[gid]
                    assert torch.equal(tensor, ref), f"rank {rank} gid {gid} key {key} differs"
    if world_size == 2:
        for res in results:
            assert "belong to data replica 0" in res["desync_error"]
    else:
        _check_dataset_run([run["dataset"] for run in results])


def _dataset_worker(rank: int, world_size: int) -> list[tuple[int, int, list[int]]]:
    docs = [bytes([65 + (i % 26)]) * (7 + 13 * i % 40) for i in range(40)]
    ds = PackedByteDataset(docs, seq_len=32)
    batch = [
        {"tokens": ds[i][0], "labels": ds[i][1], "cu_seqlens": ds.cu_seqlens(i)}
        for i in range(rank, 4 * world_size, world_size)
    ]
    out = next(HybridCPDataLoaderWrapper([batch], HybridCPConfig(max_seqlen_per_rank=16)))
    result = []
    for sub in out.sub_samples:
        tokens = sub.data["tokens"]
        assert torch.equal(sub.data["labels"][:-1], tokens[1:])  # next-token targets survive the reroute
        result.append((sub.gid, sub.cp_size, tokens.tolist()))
    return result


def _check_dataset_run(results: list[list[tuple[int, int, list[int]]]]) -> None:
    """Real packed documents on 4 ranks (cp_size 1): every document piece reaches its ranks intact."""
    docs = [bytes([65 + (i % 26)]) * (7 + 13 * i % 40) for i in range(40)]
    ds = PackedByteDataset(docs, seq_len=32)
    pieces = []
    for rank in range(4):
        for i in range(rank, 16, 4):
            cu = ds.cu_seqlens(i).tolist()
            pieces += [ds[i][0][lo:hi].tolist() for lo, hi in zip(cu[:-1], cu[1:])]
    holders: dict[int, list[int]] = {}
    for rank, subs in enumerate(results):
        for gid, cp, tokens in subs:
            assert tokens == pieces[gid]
            assert len(set(tokens)) == 1  # a piece never crosses a document boundary
            holders.setdefault(gid, []).append(rank)
            assert cp >= 1 and cp * 16 >= len(tokens)
    assert sorted(holders) == list(range(len(pieces)))  # every piece is run somewhere
    for gid, ranks in holders.items():
        assert len(ranks) == next(cp for g, cp, _ in results[ranks[0]] if g == gid)


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
    wrapper = HybridCPDataLoaderWrapper([{"cu_seqlens": torch.tensor([0, 2]), "t": torch.arange(2)}],
                                        HybridCPConfig(max_seqlen_per_rank=4))
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
