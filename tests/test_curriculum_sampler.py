"""Single-process tests of `DeepSpeedDataSampler`: every invariant of spec 4.1 and the upstream fixes it carries."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from zlightning.datamodules.curriculum import DataEfficiencyConfig, DeepSpeedDataSampler, IndexFile, write_metric_index

N = 1000


def _metric(
    tmp: Path,
    name: str,
    values: np.ndarray,
    *,
    kind: str = "value",
    lo: int = 10,
    hi: int = 100,
    schedule: dict | None = None,
) -> dict[str, Any]:
    write_metric_index(tmp / name, name, values)
    cfg = {
        "index_to_sample_path": str(tmp / name / f"{name}_index_to_sample"),
        "index_to_metric_path": str(tmp / name / f"{name}_index_to_metric"),
        "difficulty_type": kind,
        "clustering_type": "schedule_based",
        "min_difficulty": lo,
        "max_difficulty": hi,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 10},
    }
    return cfg | (schedule or {})


def _config(tmp: Path, metrics: dict[str, dict], *, epochs: int = 1, seed: int = 1234, clusters: bool = True) -> dict:
    return {
        "data_efficiency": {
            "enabled": True,
            "seed": seed,
            "data_sampling": {
                "enabled": True,
                "num_epochs": epochs,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": str(tmp / "clusters") if clusters else None,
                    "curriculum_metrics": metrics,
                },
            },
        }
    }


@pytest.fixture()
def values() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 101, N)  # metric uniform on 1..100


def _sampler(cfg: dict, b: int = 4, D: int = 1, r: int = 0, A: int = 2, n: int = N, **kw: Any) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(cfg, n, b, r, D, None, A, 0, **kw)


def _run(s: DeepSpeedDataSampler, k: int) -> list[tuple[list[int], int, dict[str, int]]]:
    """First k micro-batches with the curriculum step and difficulties at each."""
    return [(mb, s.curriculum_step, dict(s.current_difficulties)) for mb in itertools.islice(iter(s), k)]


def test_global_batch_and_lockstep(tmp_path: Path, values: np.ndarray) -> None:
    s = _sampler(_config(tmp_path, {"m": _metric(tmp_path, "m", values)}), b=4, A=3)
    out = _run(s, 30)
    assert all(len(mb) == 4 for mb, _, _ in out)
    assert [step for _, step, _ in out] == [i // 3 + 1 for i in range(30)]  # A micro-batches per curriculum step


def test_tiny_clusters_keep_batches_full_and_lockstep(tmp_path: Path) -> None:
    vals = np.full(N, 100)
    vals[:11] = 1  # the first cluster has 11 samples, far fewer than G = 32
    m = _metric(
        tmp_path,
        "m",
        vals,
        lo=1,
        hi=100,
        schedule={"schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [1, 100], "max_step": [5]}},
    )
    s = _sampler(_config(tmp_path, {"m": m}), b=8, A=4)
    out = _run(s, 40)
    assert all(len(mb) == 8 for mb, _, _ in out)
    assert [step for _, step, _ in out] == [i // 4 + 1 for i in range(40)]
    early = [i for mb, step, _ in out if step <= 5 for i in mb]
    assert set(early) == set(range(11))  # wrapped around several times within the 11-sample cluster


def test_bound_single_metric_value_and_first_step(tmp_path: Path, values: np.ndarray) -> None:
    s = _sampler(_config(tmp_path, {"m": _metric(tmp_path, "m", values)}), b=4, A=2)
    out = _run(s, 60)
    assert out[0][2]["m"] == 10 + 0 * 1  # d(1) = floor(1/20 * 90 + 10) = 14 -> 10
    assert out[6][2]["m"] == 20  # step 4: floor(4/20*90+10) = 28 -> 20
    for mb, _, diffs in out:
        assert values[mb].max() <= diffs["m"]


def test_bound_percentile(tmp_path: Path, values: np.ndarray) -> None:
    m = _metric(
        tmp_path,
        "m",
        values,
        kind="percentile",
        lo=5,
        hi=100,
        schedule={"schedule_config": {"total_curriculum_step": 20, "difficulty_step": 5}},
    )
    s = _sampler(_config(tmp_path, {"m": m}), b=4, A=2)
    order = np.asarray(IndexFile(tmp_path / "m" / "m_index_to_sample").values)
    rank = np.empty(N, dtype=np.int64)
    rank[order] = np.arange(N)
    for mb, _, diffs in _run(s, 60):
        assert rank[mb].max() < (N // 100) * diffs["m"]
    sizes = [c.members.size for c in s.data_clusters]
    assert all(size % (N // 100) == 0 for size in sizes)


def test_multi_metric_bound_holds_for_every_metric(tmp_path: Path, values: np.ndarray) -> None:
    other = np.random.default_rng(1).integers(1, 101, N)
    cfg = _config(tmp_path, {"a": _metric(tmp_path, "a", values), "b": _metric(tmp_path, "b", other, lo=50)})
    s = _sampler(cfg, b=4, A=2)
    for mb, _, d in _run(s, 60):
        assert values[mb].max() <= d["a"] and other[mb].max() <= d["b"]
    assert s.data_clusters[0].name == "cluster_a10_b50"


def test_empty_eligible_set_is_a_clear_error(tmp_path: Path, values: np.ndarray) -> None:
    # DeepSpeed treats metric a's empty set as "no constraint" and yields samples with a > 0.
    a = _metric(
        tmp_path,
        "a",
        values + 10,
        lo=0,
        hi=100,
        schedule={"schedule_config": {"total_curriculum_step": 1000, "difficulty_step": 1}},
    )
    cfg = _config(tmp_path, {"a": a, "b": _metric(tmp_path, "b", values, lo=50)})
    with pytest.raises(ValueError, match=r"no sample is eligible.*empty: \['a'\].*min_difficulty"):
        next(iter(_sampler(cfg)))


def test_clusters_disjoint_union_and_files(tmp_path: Path, values: np.ndarray) -> None:
    s = _sampler(_config(tmp_path, {"m": _metric(tmp_path, "m", values)}), b=4, A=2)
    _run(s, 200)
    members = [set(c.members.tolist()) for c in s.data_clusters]
    assert sum(map(len, members)) == len(set().union(*members))  # pairwise disjoint
    d = s.current_difficulties["m"]
    assert set().union(*members) == set(np.flatnonzero(values <= d).tolist())
    prev = -math.inf
    for c in s.data_clusters:
        cd = c.difficulties["m"]
        assert all(prev < values[i] <= cd for i in c.members)
        assert c.name == f"cluster_m{cd}"
        assert (tmp_path / "clusters" / f"{c.name}.bin").is_file()
        prev = cd


@pytest.mark.parametrize("kind", ["value", "percentile"])
def test_cluster_increments_equal_full_recomputation(tmp_path: Path, values: np.ndarray, kind: str) -> None:
    # The one-restricting-metric fast path (a slice of the index order) against the generic set computation, with a
    # difficulty that goes down and up again and a single_cluster metric alongside.
    m = _metric(tmp_path, "m", values, kind=kind, schedule={"schedule_type": "custom", "schedule_config": {}})
    trunc = {
        "clustering_type": "single_cluster",
        "min_difficulty": 8,
        "max_difficulty": 64,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 5, "difficulty_step": 8},
    }
    path = [30, 20, 50, 50, 45, 70, 70, 100]
    samplers = [_sampler(_config(tmp_path, {"m": m, "seqlen_truncate": trunc}, clusters=False)) for _ in range(2)]
    samplers[1]._compute_cluster = samplers[1]._compute_cluster_generic  # type: ignore[method-assign]
    for s in samplers:
        s.set_custom_curriculum_learning_schedule({"m": lambda t: path[min(t, len(path)) - 1]})
    outs = [_run(s, 2 * len(path)) for s in samplers]
    assert outs[0] == outs[1]
    fast, generic = ([c.members.tolist() for c in s.data_clusters] for s in samplers)
    assert fast == generic and len(fast) == 4  # 30, 50, 70, 100 (20 and 45 add nothing)


def test_within_pass_uniqueness(tmp_path: Path, values: np.ndarray) -> None:
    s = _sampler(_config(tmp_path, {"m": _metric(tmp_path, "m", values, lo=100)}), b=10, A=5)  # one cluster: all
    drawn = [i for mb, _, _ in _run(s, 100) for i in mb]  # exactly one pass of N
    assert len(drawn) == N and len(set(drawn)) == N


def test_determinism_and_seed(tmp_path: Path, values: np.ndarray) -> None:
    metrics = {"m": _metric(tmp_path, "m", values)}
    a = [mb for mb, _, _ in _run(_sampler(_config(tmp_path, metrics)), 40)]
    b = [mb for mb, _, _ in _run(_sampler(_config(tmp_path, metrics)), 40)]
    c = [mb for mb, _, _ in _run(_sampler(_config(tmp_path, metrics, seed=7)), 40)]
    assert a == b and a != c


@pytest.mark.parametrize("k", [1, 5, 6, 23])
def test_exact_resume_at_any_micro_batch(tmp_path: Path, values: np.ndarray, k: int) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    ref = [mb for mb, _, _ in _run(_sampler(cfg, b=4, A=3), 60)]
    s = _sampler(cfg, b=4, A=3)
    it = iter(s)
    _ = [next(it) for _ in range(k)]
    state = s.state_dict()
    fresh = _sampler(cfg, b=4, A=3)
    fresh.load_state_dict(state)
    assert [mb for mb, _, _ in _run(fresh, 60 - k)] == ref[k:]


def test_state_after_earlier_micro_batch_despite_prefetch(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    ref = [mb for mb, _, _ in _run(_sampler(cfg, b=4, A=3), 40)]
    s = _sampler(cfg, b=4, A=3)
    _run(s, 20)  # the loader ran ahead to 20; training consumed 7
    state = s.state_dict(micro_batches=7)
    assert state["micro_batches"] == 7 and state["consumed_samples"] == 28
    fresh = _sampler(cfg, b=4, A=3)
    fresh.load_state_dict(state)
    assert [mb for mb, _, _ in _run(fresh, 33)] == ref[7:]
    with pytest.raises(ValueError, match="no state after micro-batch 99"):
        s.state_dict(micro_batches=99)


def test_never_touches_global_rng(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    np.random.seed(3)
    random.seed(3)
    torch.manual_seed(3)
    before = (np.random.get_state()[1].copy(), random.getstate(), torch.get_rng_state().clone())
    s = _sampler(cfg)
    _run(s, 30)
    fresh = _sampler(cfg)
    fresh.load_state_dict(s.state_dict())
    _run(fresh, 5)
    assert np.array_equal(np.random.get_state()[1], before[0])
    assert random.getstate() == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])


def test_termination_counts(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values, lo=100)})
    s = _sampler(cfg, b=6, A=2)
    out = list(s)
    assert len(out) == len(s) == N // 6 and s.consumed_samples == (N // 6) * 6
    s = _sampler(cfg, b=6, A=2, drop_last=False)
    out = list(s)
    assert len(out) == len(s) == math.ceil(N / 6) and len(out[-1]) == N % 6 and s.consumed_samples == N


def test_start_end_idx_partial_batches(tmp_path: Path) -> None:
    cfg = {"data_efficiency": {"seed": 1}}

    def sizes(n: int, D: int) -> list[int]:
        spans = [_sampler(cfg, b=1, D=D, r=r).get_start_end_idx(n) for r in range(D)]
        assert all(spans[i][1] == spans[i + 1][0] for i in range(D - 1)) and spans[0][0] == 0 and spans[-1][1] == n
        return [e - s for s, e in spans]

    assert sizes(2, 4) == [0, 1, 1, 0]
    assert sizes(6, 4) == [2, 1, 1, 2]
    for n in range(1, 20):
        got = sizes(n, 3)
        assert sum(got) == n and max(got) - min(got) <= 1
    assert _sampler(cfg, b=3, D=4, r=2).get_start_end_idx() == (6, 9)


def test_dp_slices_concatenate_to_the_global_micro_batch(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    ranks = [_sampler(cfg, b=3, D=2, r=r, A=2) for r in range(2)]
    outs = [_run(s, 20) for s in ranks]
    for (mb0, step0, _), (mb1, step1, _) in zip(*outs):
        assert len(mb0) == len(mb1) == 3 and step0 == step1 and not set(mb0) & set(mb1)
    # Rank 0's slices followed by rank 1's reproduce the shared global batches in order.
    ref = _sampler(cfg, b=3, D=2, r=0, A=2)
    ref.get_next_global_batch()
    glob = ref.batch
    assert outs[0][0][0] + outs[1][0][0] == glob[:6] and outs[0][1][0] + outs[1][1][0] == glob[6:12]


def test_curriculum_disabled_is_one_epoch_per_iter(tmp_path: Path) -> None:
    s = _sampler({"data_efficiency": {"seed": 5}}, n=50, b=4, A=1)
    e0, e1 = list(s), list(s)
    assert len(e0) == len(e1) == len(s) == 12
    flat0 = [i for mb in e0 for i in mb]
    assert len(set(flat0)) == 48 and e0 != e1
    t = _sampler({"data_efficiency": {"seed": 5}}, n=50, b=4, A=1)
    it = iter(t)
    _ = [next(it) for _ in range(5)]
    u = _sampler({"data_efficiency": {"seed": 5}}, n=50, b=4, A=1)
    u.load_state_dict(t.state_dict())
    assert list(u) == e0[5:] and list(u) == e1


def test_clusters_are_reused_from_disk_and_stale_files_recomputed(
    tmp_path: Path, values: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    ref = [mb for mb, _, _ in _run(_sampler(cfg), 40)]
    calls: list[dict] = []
    orig = DeepSpeedDataSampler._compute_cluster
    monkeypatch.setattr(DeepSpeedDataSampler, "_compute_cluster", lambda self, d: calls.append(d) or orig(self, d))
    assert [mb for mb, _, _ in _run(_sampler(cfg), 40)] == ref
    assert calls == []  # every cluster came from its file
    # A different dataset behind the same cluster folder: fingerprints differ, clusters are recomputed.
    cfg2 = _config(tmp_path, {"m": _metric(tmp_path, "m", values[::-1].copy())})
    s = _sampler(cfg2)
    _run(s, 10)
    assert calls and all(values[::-1][c.members].max() <= c.difficulties["m"] for c in s.data_clusters)


def test_custom_schedule(tmp_path: Path, values: np.ndarray) -> None:
    m = _metric(tmp_path, "m", values, schedule={"schedule_type": "custom", "schedule_config": {}})
    s = _sampler(_config(tmp_path, {"m": m}))
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        next(iter(s))
    s = _sampler(_config(tmp_path, {"m": m}))
    s.set_custom_curriculum_learning_schedule({"m": lambda t: min(100, 5 + 3 * t)})
    out = _run(s, 6)
    assert [d["m"] for _, _, d in out] == [8, 8, 11, 11, 14, 14]
    with pytest.raises(ValueError, match="unknown metric 'x'"):
        s.set_custom_curriculum_learning_schedule({"x": abs})


def test_load_state_refuses_other_shape(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)})
    state = _sampler(cfg, b=4).state_dict()
    with pytest.raises(ValueError, match="micro_batch_size.*\\(8, 4\\)"):
        _sampler(cfg, b=8).load_state_dict(state)
    with pytest.raises(ValueError, match="unsupported state format.*DeepSpeed's sampler state with keys"):
        _sampler(cfg, b=4).load_state_dict({"batch": [], "np_rng_state": ("MT19937",)})  # DeepSpeed's, incomplete


def test_config_validation(tmp_path: Path, values: np.ndarray) -> None:
    with pytest.raises(ValueError, match="Did you mean 'curriculum_learning'"):
        DataEfficiencyConfig.from_dict({"data_sampling": {"curriculum_learnin": {}}})
    with pytest.raises(ValueError, match="dynamic_batching.enabled=true is not supported"):
        DataEfficiencyConfig.from_dict({"data_sampling": {"dynamic_batching": {"enabled": True}}})
    bad = _metric(tmp_path, "m", values)
    del bad["index_to_metric_path"]
    with pytest.raises(ValueError, match="curriculum_metrics.m: .*needs index_to_metric_path"):
        DataEfficiencyConfig.from_dict(_config(tmp_path, {"m": bad}))
    with pytest.raises(ValueError, match="data_parallel_rank must be in"):
        _sampler({}, D=2, r=2)
    with pytest.raises(ValueError, match="indexes 1000 samples but the dataset has 999"):
        next(iter(_sampler(_config(tmp_path, {"m": _metric(tmp_path, "m", values)}), n=999)))


def test_rewind_undoes_prefetched_draws_and_clusters(tmp_path: Path, values: np.ndarray) -> None:
    cfg = _config(tmp_path, {"m": _metric(tmp_path, "m", values)}, clusters=False)
    ref = [mb for mb, _, _ in _run(_sampler(cfg, b=4, A=3), 40)]
    s = _sampler(cfg, b=4, A=3)
    _run(s, 5)
    n_clusters = len(s.data_clusters)
    _run(s, 30)  # a dropped loader iterator ran far ahead (new clusters, new draws)
    assert len(s.data_clusters) > n_clusters
    s.rewind(5)
    assert len(s.data_clusters) == n_clusters and s.micro_batches == 5 and s.curriculum_step == 2
    assert [mb for mb, _, _ in _run(s, 35)] == ref[5:]


def test_an_epoch_stopped_after_len_batches_is_followed_by_the_next_one(tmp_path: Path) -> None:
    """Lightning stops after len() micro-batches and never asks for one more, so the generator never finishes: the
    next iteration must still be the next epoch (it yielded nothing, every second epoch)."""
    plain = {"data_efficiency": {"seed": 5}}
    for n, b in ((40, 4), (22, 4)):  # an exact and a ragged end (drop_last drops the ragged rest)
        s = _sampler(plain, n=n, b=b, A=1)
        epochs = [list(itertools.islice(iter(s), len(s))) for _ in range(3)]
        assert [len(e) for e in epochs] == [n // b] * 3
        assert epochs[0] != epochs[1] != epochs[2]
        ref = _sampler(plain, n=n, b=b, A=1)
        assert epochs == [list(ref) for _ in range(3)]  # the same epochs as iterations run to their end


def test_a_partial_micro_batch_smaller_than_the_ranks_gives_every_rank_a_sample() -> None:
    plain = {"data_efficiency": {"seed": 5}}
    per_rank = [list(_sampler(plain, n=9, b=2, D=2, r=r, A=1, drop_last=False)) for r in range(2)]
    assert [len(mbs) for mbs in per_rank] == [3, 3]
    assert all(len(mb) >= 1 for mbs in per_rank for mb in mbs)
    last = per_rank[0][-1] + per_rank[1][-1]
    first_two = {i for mbs in per_rank for mb in mbs[:2] for i in mb}
    assert set(last) | first_two == set(range(9)) and len(set(last)) == 1  # the last sample, repeated
