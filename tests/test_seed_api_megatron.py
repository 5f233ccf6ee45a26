"""Megatron-core conformance of the hybrid-CP seed: ``HybridCPDataLoaderWrapper`` called as Megatron's code calls it.

A port keeps Megatron's call sequence: ``HybridCPDataLoaderWrapper(data_iterator, config, pg_collection)`` with a
Megatron-style config object (``max_seqlen_per_dp_cp_rank``, ``context_parallel_size``) and process groups by
attribute name (``dp_cp``, ``dp``, ``cp``, ``tp``), then either ``samples, sample_id_groups = next(wrapper)`` or the
documented steps one by one: ``get_global_seqlens``, ``get_global_id_seqlens``,
``cp_balancing_scheduler.get_groups_and_subsamples``, ``unpack_batch``, ``reroute_samples_to_hdp_ranks`` (with
``_gid_to_src_rank``). The multi-process part runs every call on 2 and 4 gloo ranks in one spawn per world size and
checks, in the parent, each return value against references computed from the source batches, and the full ``next``
against the step-by-step result and against the typed API (`HybridCPConfig`, ``dp_cp_group``). World 4 also runs a
layout Megatron's rank arithmetic cannot express (DP inside CP), where the DP group alone says who holds what.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from zlightning.datamodules import BalancedCPScheduler, HybridCPConfig, HybridCPDataLoaderWrapper
from zlightning.datamodules.hybrid_cp import schedule_hybrid_cp

from zlightning.testing import run_distributed

MAX_SEQLEN = 8  # max_seqlen_per_dp_cp_rank
KEYS = ("tokens", "labels", "loss_mask", "position_ids")


def _megatron_config(cp: int) -> SimpleNamespace:
    """What Megatron hands the wrapper: a config object with Megatron's attribute names (and others we ignore)."""
    return SimpleNamespace(
        max_seqlen_per_dp_cp_rank=MAX_SEQLEN,
        context_parallel_size=cp,
        hybrid_context_parallel=True,
        tensor_model_parallel_size=1,
    )


def _packed_batch(replica: int, step: int, n: int) -> list[dict[str, torch.Tensor]]:
    """A replica's ``next(data_iterator)``: a list of packed samples, ``cu_seqlens`` padded with zero lengths."""
    gen = torch.Generator().manual_seed(100 * step + replica)
    out = []
    for _ in range(2):
        lengths = torch.randint(1, MAX_SEQLEN * n + 1, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
        cu = torch.cat([cu, cu[-1:], cu[-1:]])  # the SFT dataset's padding: repeated last offset
        total = int(cu[-1])
        out.append(
            {
                "cu_seqlens": cu,
                "max_seqlen": torch.tensor(int(lengths.max()), dtype=torch.int32),
                "tokens": torch.randint(0, 50000, (total,), generator=gen),
                "labels": torch.randint(0, 50000, (total,), generator=gen),
                "loss_mask": torch.rand(total, generator=gen),
                "position_ids": torch.cat([torch.arange(int(v)) for v in lengths]),
            }
        )
    return out


def _reference(n: int, cp: int, step: int) -> tuple[list[list[int]], list[dict[str, torch.Tensor]]]:
    """Per replica, its sub-sample lengths; and every sub-sample by global id, sliced from the sources."""
    per_replica, subs = [], []
    for replica in range(n // cp):
        lengths = []
        for sample in _packed_batch(replica, step, n):
            cu = sample["cu_seqlens"].tolist()
            for lo, hi in zip(cu[:-1], cu[1:]):
                if hi > lo:
                    lengths.append(hi - lo)
                    subs.append({k: sample[k][lo:hi].clone() for k in KEYS})
        per_replica.append(lengths)
    return per_replica, subs


# ------------------------------------------------------------------------------------------ in one process


def test_megatron_config_object_is_read_by_attribute_name() -> None:
    wrapper = HybridCPDataLoaderWrapper(iter([]), _megatron_config(2))
    assert wrapper.config == HybridCPConfig(max_seqlen_per_rank=MAX_SEQLEN, cp_size=2)
    assert wrapper.cp_balancing_scheduler.max_seq_len_per_rank == MAX_SEQLEN
    no_cp = HybridCPDataLoaderWrapper(iter([]), SimpleNamespace(max_seqlen_per_dp_cp_rank=16))
    assert no_cp.config.cp_size == 1
    with pytest.raises(TypeError, match="has no attribute 'max_seqlen_per_dp_cp_rank'"):
        HybridCPDataLoaderWrapper(iter([]), SimpleNamespace(max_seqlen_per_cp_rank=16))
    with pytest.raises(ValueError, match=r"max_seqlen_per_dp_cp_rank must be a positive int, got None.*must be set"):
        HybridCPDataLoaderWrapper(iter([]), SimpleNamespace(max_seqlen_per_dp_cp_rank=None))
    with pytest.raises(ValueError, match=r"config.context_parallel_size must be a positive int, got 0"):
        HybridCPDataLoaderWrapper(iter([]), SimpleNamespace(max_seqlen_per_dp_cp_rank=16, context_parallel_size=0))


def test_pg_collection_is_positional_and_needs_dp_cp() -> None:
    group = object()  # never used before iteration: construction runs no collective
    wrapper = HybridCPDataLoaderWrapper(iter([]), _megatron_config(1), SimpleNamespace(dp_cp=group, dp=None))
    assert wrapper.dp_cp_group is group and wrapper.cp_balancing_scheduler.dp_cp_group is group
    assert wrapper.dp_group is None and wrapper.tp_group is None
    with pytest.raises(TypeError, match="pg_collection .* has no 'dp_cp' group"):
        HybridCPDataLoaderWrapper(iter([]), _megatron_config(1), SimpleNamespace(dp=group))
    with pytest.raises(ValueError, match="either as pg_collection.dp_cp or as dp_cp_group="):
        HybridCPDataLoaderWrapper(iter([]), _megatron_config(1), SimpleNamespace(dp_cp=group), dp_cp_group=group)


def test_rank_without_data_iterator_returns_none_pair() -> None:
    # Megatron's tensor-parallel ranks other than 0 pass data_iterator=None and get (None, None), no collective.
    wrapper = iter(HybridCPDataLoaderWrapper(None, _megatron_config(1)))
    assert next(wrapper) == (None, None)


def test_balanced_cp_scheduler_has_megatron_call_shape() -> None:
    seqlens = [30, 5, 17, 8, 8, 2, 29]
    ids = [10 + 3 * i for i in range(len(seqlens))]  # ids need not be 0..N-1
    scheduler = BalancedCPScheduler(MAX_SEQLEN, dp_cp_size=4)
    groups, sample_id_groups = scheduler.get_groups_and_subsamples(list(zip(ids, seqlens)), _megatron_config(1))
    by_index = schedule_hybrid_cp(seqlens, 4, MAX_SEQLEN)
    assert sample_id_groups == [[[ids[i] for i in ranks] for ranks in g] for g in by_index]
    assert groups == [[[seqlens[i] for i in ranks] for ranks in g] for g in by_index]
    assert scheduler.gpus_needed(17) == 4 and scheduler.gpus_needed(40) == 8  # not capped, as Megatron's
    assert scheduler.get_total_workload(16) == 16 * 16 / 2 and scheduler.get_total_workload(16, 4) == 64.0
    with pytest.raises(ValueError, match="appear more than once"):
        scheduler.get_groups_and_subsamples([(1, 4), (1, 5)])
    with pytest.raises(RuntimeError, match="not initialised.*dp_cp_size="):
        BalancedCPScheduler(MAX_SEQLEN).get_groups_and_subsamples([(0, 4)])


# ------------------------------------------------------------------------------------------ on 2 and 4 ranks


def _groups(rank: int, n: int, cp: int, dp_inner: bool) -> SimpleNamespace:
    """A pg_collection. Megatron's layout (``dp_inner=False``): replica ``h // cp``; else replica ``h % dp``."""
    dp_size = n // cp
    if dp_inner:
        dp_sets = [[c * dp_size + d for d in range(dp_size)] for c in range(cp)]
        cp_sets = [[c * dp_size + d for c in range(cp)] for d in range(dp_size)]
    else:
        dp_sets = [[d * cp + c for d in range(dp_size)] for c in range(cp)]
        cp_sets = [[d * cp + c for c in range(cp)] for d in range(dp_size)]
    made = {}
    for ranks in dp_sets + cp_sets + [[r] for r in range(n)]:  # every rank creates every group, in one order
        made[tuple(ranks)] = dist.new_group(ranks)
    mine = lambda sets: made[tuple(next(s for s in sets if rank in s))]  # noqa: E731
    return SimpleNamespace(dp_cp=dist.group.WORLD, dp=mine(dp_sets), cp=mine(cp_sets), tp=made[(rank,)])


def _step_by_step(
    wrapper: HybridCPDataLoaderWrapper, batch: list[dict[str, torch.Tensor]], config: SimpleNamespace
) -> dict[str, Any]:
    """Megatron's ``__next__`` body, call for call."""
    subsample_seqlens = []
    for sample in batch:
        subsample_seqlens.extend(
            int(sample["cu_seqlens"][i + 1] - sample["cu_seqlens"][i]) for i in range(sample["cu_seqlens"].shape[0] - 1)
        )
    subsample_seqlens = torch.tensor(subsample_seqlens, dtype=torch.int32)
    subsample_seqlens = subsample_seqlens[subsample_seqlens != 0]
    seqlens_gathered, offsets = wrapper.get_global_seqlens(subsample_seqlens)
    global_id_seqlens, global_ids_this_rank = wrapper.get_global_id_seqlens(
        subsample_seqlens.shape[0], offsets, seqlens_gathered
    )
    groups, sample_id_groups = wrapper.cp_balancing_scheduler.get_groups_and_subsamples(global_id_seqlens, config)
    unpacked = wrapper.unpack_batch(batch)
    samples = wrapper.reroute_samples_to_hdp_ranks(
        unpacked, global_ids_this_rank, global_id_seqlens, sample_id_groups, offsets
    )
    return {
        "seqlens_gathered": seqlens_gathered,
        "offsets": offsets,
        "global_id_seqlens": global_id_seqlens,
        "global_ids_this_rank": global_ids_this_rank,
        "groups": groups,
        "sample_id_groups": sample_id_groups,
        "src_rank": [wrapper._gid_to_src_rank(gid, offsets) for gid in range(len(seqlens_gathered))],
        "unpacked_lengths": [int(s["tokens"].shape[0]) for s in unpacked],
        "samples": samples,
        "total_hdp_gpus": wrapper.total_hdp_gpus,
    }


def _worker(rank: int, n: int) -> dict[str, Any]:
    cp = 2 if n == 4 else 1
    config = _megatron_config(cp)
    out: dict[str, Any] = {}
    layouts = [("megatron", False)] + ([("dp_inner", True)] if n == 4 else [])
    for name, dp_inner in layouts:
        pg = _groups(rank, n, cp, dp_inner)
        replica = rank % (n // cp) if dp_inner else rank // cp
        batches = [_packed_batch(replica, step, n) for step in range(2)]
        wrapper = HybridCPDataLoaderWrapper(iter(batches), config, pg)  # positional pg_collection, as Megatron
        out[name] = {"steps": _step_by_step(wrapper, batches[0], config), "replica": replica}
        samples, sample_id_groups = next(iter(HybridCPDataLoaderWrapper(iter(batches[1:]), config, pg)))
        out[name]["next"] = {"samples": samples, "sample_id_groups": sample_id_groups}
    typed = HybridCPDataLoaderWrapper(
        iter([_packed_batch(rank // cp, 1, n)]), HybridCPConfig(max_seqlen_per_rank=MAX_SEQLEN, cp_size=cp)
    )
    batch = next(typed)
    out["typed"] = {"samples": batch.samples, "schedule": batch.schedule, "seqlens": batch.seqlens}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks-cp1", "4ranks-cp2"])
def runs(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, run_distributed(_worker, request.param, timeout=300)


def _layouts(n: int) -> list[tuple[str, bool]]:
    return [("megatron", False)] + ([("dp_inner", True)] if n == 4 else [])


def test_each_documented_method_returns_megatrons_shapes(runs: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = runs
    cp = 2 if n == 4 else 1
    per_replica, subs = _reference(n, cp, step=0)
    counts = [len(lengths) for lengths in per_replica]
    flat = [length for lengths in per_replica for length in lengths]
    for name, _ in _layouts(n):
        for rank, res in enumerate(results):
            got, replica = res[name]["steps"], res[name]["replica"]
            # get_global_seqlens: every DP rank's lengths in DP order; offsets the exclusive prefix sum (DP entries)
            assert got["seqlens_gathered"] == flat
            assert got["offsets"].dtype == torch.int32 and got["offsets"].tolist() == [
                sum(counts[:d]) for d in range(n // cp)
            ]
            # get_global_id_seqlens: (gid, L) for all; this rank's gids offsets[r] .. + count
            assert got["global_id_seqlens"] == list(enumerate(flat))
            start = sum(counts[:replica])
            assert got["global_ids_this_rank"].tolist() == list(range(start, start + counts[replica]))
            assert got["unpacked_lengths"] == per_replica[replica]
            # _gid_to_src_rank: the owning replica's member with my CP index, in the DP×CP group
            for gid, src in enumerate(got["src_rank"]):
                owner = next(d for d in range(n // cp) if gid < sum(counts[: d + 1]))
                peer = owner + (rank // (n // cp)) * (n // cp) if name == "dp_inner" else owner * cp + rank % cp
                assert src == peer, (name, rank, gid, src, peer)
            assert got["total_hdp_gpus"] == n
            # the scheduler: same schedule everywhere; groups are the lengths of sample_id_groups
            assert got["sample_id_groups"] == results[0][name]["steps"]["sample_id_groups"]
            assert got["groups"] == [[[flat[g] for g in ids] for ids in grp] for grp in got["sample_id_groups"]]
            # reroute: exactly this rank's gids, bit-exact source slices, dtypes kept
            mine = {gid for grp in got["sample_id_groups"] for gid in grp[rank]}
            assert set(got["samples"]) == mine and mine
            for gid, data in got["samples"].items():
                assert set(data) == set(KEYS)
                for key in KEYS:
                    assert data[key].dtype == subs[gid][key].dtype and torch.equal(data[key], subs[gid][key])


def test_next_equals_the_step_by_step_calls_and_the_typed_api(runs: tuple[int, list[dict[str, Any]]]) -> None:
    n, results = runs
    cp = 2 if n == 4 else 1
    per_replica, subs = _reference(n, cp, step=1)
    for rank, res in enumerate(results):
        typed = res["typed"]
        assert typed["seqlens"] == [length for lengths in per_replica for length in lengths]
        for name, _ in _layouts(n):
            got = res[name]["next"]
            assert got["sample_id_groups"] == typed["schedule"]  # same schedule as the typed API
            assert got["samples"].keys() == typed["samples"].keys()
            for gid, data in got["samples"].items():
                for key in KEYS:
                    assert torch.equal(data[key], typed["samples"][gid][key])
                    assert torch.equal(data[key], subs[gid][key])


def _nccl_worker(rank: int, n: int) -> dict[str, Any]:
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=n)
    try:
        batches = [_packed_batch(0, 0, n)]
        samples, sample_id_groups = next(HybridCPDataLoaderWrapper(iter(batches), _megatron_config(1)))
        return {
            "devices": {str(t.device) for s in samples.values() for t in s.values()},
            "samples": {g: {k: v.cpu() for k, v in s.items()} for g, s in samples.items()},
            "groups": sample_id_groups,
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (NCCL)")
def test_nccl_path_returns_cuda_sub_samples() -> None:
    (res,) = run_distributed(_nccl_worker, 1, timeout=300, init_process_group=False)
    _, subs = _reference(1, 1, step=0)
    assert res["devices"] == {"cuda:0"}
    assert set(res["samples"]) == set(range(len(subs)))
    for gid, data in res["samples"].items():
        for key in KEYS:
            assert torch.equal(data[key], subs[gid][key])
