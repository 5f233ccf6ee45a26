"""`DeepSpeedDataSampler` state in DeepSpeed's checkpoint layout: resume from a DeepSpeed checkpoint, export to one."""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import Dataset
from zlightning.datamodules.curriculum import CurriculumDataModule, DeepSpeedDataSampler, write_metric_index
from zlightning.datamodules.curriculum._deepspeed_state import (
    DEEPSPEED_STATE_KEYS,
    deepspeed_to_state,
    state_to_deepspeed,
)
from zlightning.datamodules.curriculum._index import write_index_file

N = 1000


def _values() -> np.ndarray:
    return np.random.default_rng(0).integers(1, 101, N)  # metric uniform on 1..100


def _config(root: Path, clusters: Path | None, *, step: int = 10, total: int = 20) -> dict[str, Any]:
    if not (root / "m" / "m_index_to_sample.idx").exists():
        write_metric_index(root / "m", "m", _values())
    metric = {
        "index_to_sample_path": str(root / "m" / "m_index_to_sample"),
        "index_to_metric_path": str(root / "m" / "m_index_to_metric"),
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 2,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": total, "difficulty_step": step},
    }
    return {
        "seed": 5,
        "data_sampling": {
            "num_epochs": 50,
            "curriculum_learning": {
                "enabled": True,
                "data_cluster_path": str(clusters) if clusters else None,
                "curriculum_metrics": {"m": metric},
            },
        },
    }


def _sampler(cfg: dict[str, Any], b: int = 4, D: int = 1, r: int = 0, A: int = 2) -> DeepSpeedDataSampler:
    return DeepSpeedDataSampler(cfg, N, b, r, D, None, A)


def _take(s: DeepSpeedDataSampler, k: int) -> list[list[int]]:
    return list(itertools.islice(iter(s), k))


@pytest.mark.parametrize("k", [1, 6, 41])
def test_export_then_import_continues_identically(tmp_path: Path, k: int) -> None:
    # min_difficulty 2, steps of 2: the first clusters hold a handful of samples and wrap many passes.
    cfg = _config(tmp_path, tmp_path / "own", step=2, total=40)
    ref = _take(_sampler(cfg, b=3, A=3), 140)
    s = _sampler(cfg, b=3, A=3)
    _take(s, k + 5)  # a loader ran ahead; training consumed k
    ds_state = s.deepspeed_state_dict(tmp_path / "ds_clusters", micro_batches=k)
    assert list(ds_state) == list(DEEPSPEED_STATE_KEYS)
    assert ds_state["consumed_samples"] == (k - 1) * 3  # DeepSpeed's convention: lags one micro-batch
    assert all((tmp_path / "ds_clusters" / f"{name}.bin").is_file() for name in ds_state["data_cluster_paths"])
    with pytest.raises(ValueError, match="own data_cluster_path"):
        s.deepspeed_state_dict(tmp_path / "own")

    ds_files = {p.name: p.read_bytes() for p in (tmp_path / "ds_clusters").iterdir()}
    fresh = _sampler(_config(tmp_path, tmp_path / "ds_clusters", step=2, total=40), b=3, A=3)
    fresh.load_state_dict(ds_state)
    assert fresh.consumed_samples == k * 3 and fresh.curriculum_step == ds_state["curriculum_step"]
    got = _take(fresh, 60)
    assert got == ref[k : k + 60]
    # Our own state of the imported sampler (clusters still in their imported pass included) resumes exactly too.
    again = _sampler(_config(tmp_path, tmp_path / "ds_clusters", step=2, total=40), b=3, A=3)
    again.load_state_dict(fresh.state_dict(micro_batches=fresh.micro_batches - 7))
    assert _take(again, 40) == ref[k + 53 : k + 93]
    assert all((tmp_path / "ds_clusters" / n).read_bytes() == b for n, b in ds_files.items())  # never overwritten


def _deepspeed_0_19_8_checkpoint(root: Path, b: int, A: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A sampler state and cluster files laid out as DeepSpeed 0.19.8 writes them, after 3 curriculum steps.

    Schedule: fixed_linear 10 -> 100 over 20 steps, multiples of 10: steps 1, 2 give 10, step 3 gives 20. DeepSpeed
    files hold each cluster shuffled (its current pass); the state stores absolute paths (legacy) and the *global*
    numpy RNG state (its bug #8405); 5 micro-batches were consumed, so ``consumed_samples`` is 4 micro-batches.
    """
    values = _values()
    orders = {
        "cluster_m10": np.random.default_rng(11).permutation(np.flatnonzero(values <= 10)),
        "cluster_m20": np.random.default_rng(12).permutation(np.flatnonzero((values > 10) & (values <= 20))),
    }
    folder = root / "ds_run" / "clusters"
    for name, order in orders.items():
        write_index_file(folder / name, order, [order.size], np.uint16)
    pending = list(np.random.default_rng(13).choice(np.flatnonzero(values <= 20), b * (A - 1)).tolist())
    state = {
        "batch": pending,
        "consumed_samples": 4 * b,
        "curriculum_step": 3,
        "current_difficulties": {"m": 20},
        "data_cluster_paths": [str(folder / n) for n in orders],
        "data_cluster_current_position": [5, 3],
        "np_rng_state": np.random.get_state(),
    }
    return state, orders


def test_resume_from_a_deepspeed_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b, A = 4, 2
    state, orders = _deepspeed_0_19_8_checkpoint(tmp_path, b, A)
    cfg = _config(tmp_path, tmp_path / "ds_run" / "clusters")
    s = _sampler(cfg, b=b, A=A)
    np.random.seed(42)
    global_before = np.random.get_state()[1].copy()
    with caplog.at_level(logging.WARNING):
        s.load_state_dict(state)
    assert "global legacy numpy RNG" in caplog.text
    steps: list[int] = []
    out: list[list[int]] = []
    for mb in itertools.islice(iter(s), 400):
        out.append(mb)
        steps.append(s.curriculum_step)
    assert np.array_equal(np.random.get_state()[1], global_before)  # never touched
    assert out[0] == state["batch"] and steps[0] == 3  # the pending micro-batch first
    assert steps[1:3] == [4, 4] and steps[3:5] == [5, 5]  # lockstep: A micro-batches per curriculum step
    values = _values()
    for mb, step in zip(out[1:], steps[1:]):
        assert len(mb) == b and values[mb].max() <= s.curriculum_schedulers["m"].get_difficulty(step)
    # Each imported cluster finishes its current pass in DeepSpeed's order (from the saved cursor) before repeating.
    for (name, order), pos in zip(orders.items(), state["data_cluster_current_position"]):
        rest, members = set(order[pos:].tolist()), set(order.tolist())
        seen: set[int] = set()
        for i in range(1, len(out), A):
            drawn = [x for mb in out[i : i + A] for x in mb if x in members]
            if len(seen) + len(drawn) < len(rest):
                assert not seen & set(drawn) and set(drawn) <= rest and len(set(drawn)) == len(drawn), name
                seen |= set(drawn)
            else:
                assert rest - seen <= set(drawn), name
                break
        else:
            raise AssertionError(f"{name}: pass never finished")


def test_deepspeed_state_errors(tmp_path: Path) -> None:
    b, A = 4, 2
    state, orders = _deepspeed_0_19_8_checkpoint(tmp_path, b, A)
    folder = tmp_path / "ds_run" / "clusters"
    with pytest.raises(ValueError, match="data_cluster_path"):
        _sampler(_config(tmp_path, None), b=b, A=A).load_state_dict(state)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        _sampler(_config(tmp_path, folder), b=3, A=A).load_state_dict(state)
    with pytest.raises(ValueError, match="does not match"):
        _sampler(_config(tmp_path, folder), b=b, A=A).load_state_dict(
            state | {"data_cluster_paths": ["cluster_x10"] * 2}
        )
    with pytest.raises(FileNotFoundError, match="cluster_m30"):
        _sampler(_config(tmp_path, folder), b=b, A=A).load_state_dict(
            state | {"data_cluster_paths": ["cluster_m10", "cluster_m30"]}
        )
    bad = orders["cluster_m20"][:-1]
    write_index_file(folder / "cluster_m20", bad, [bad.size], np.uint16)
    with pytest.raises(ValueError, match="must come from the same run"):
        _sampler(_config(tmp_path, folder), b=b, A=A).load_state_dict(state)
    with pytest.raises(ValueError, match="current_difficulties has metrics"):
        _sampler(_config(tmp_path, folder), b=b, A=A).load_state_dict(state | {"current_difficulties": {"x": 3}})
    fresh = _sampler(_config(tmp_path, folder), b=b, A=A)  # a DeepSpeed state saved before the first batch
    fresh.load_state_dict(
        state
        | {
            "batch": [],
            "consumed_samples": 0,
            "curriculum_step": 0,
            "current_difficulties": {},
            "data_cluster_paths": [],
            "data_cluster_current_position": [],
        }
    )
    assert _take(fresh, 6) == _take(_sampler(_config(tmp_path, None), b=b, A=A), 6)
    with pytest.raises(ValueError, match="unsupported state format"):
        _sampler(_config(tmp_path, folder), b=b, A=A).load_state_dict({"batch": []})


def test_translation_gives_the_state_dict_layout(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    b, A = 4, 2
    state, orders = _deepspeed_0_19_8_checkpoint(tmp_path, b, A)
    cfg = _config(tmp_path, tmp_path / "ds_run" / "clusters")
    s = _sampler(cfg, b=b, A=A)
    with caplog.at_level(logging.WARNING):
        ours = deepspeed_to_state(state, config=s.config, shape=s.state_dict()["shape"])
    assert "global legacy numpy RNG" in caplog.text
    assert set(ours) == set(s.state_dict())  # the sampler's own layout, plain values
    json.dumps(ours)
    assert ours["consumed_samples"] == 5 * b and ours["micro_batches"] == 5 and ours["data_cluster_pass"] == [0, 0]
    assert ours["data_cluster_paths"] == list(orders)  # names, not the legacy absolute paths
    assert ours["data_cluster_imported_order"] == {name: order.tolist() for name, order in orders.items()}
    translated, direct = _sampler(cfg, b=b, A=A), _sampler(cfg, b=b, A=A)
    translated.load_state_dict(ours)
    direct.load_state_dict(state)
    assert _take(translated, 20) == _take(direct, 20)
    with pytest.raises(ValueError, match="expected a DeepSpeedDataSampler.state_dict"):
        state_to_deepspeed(state, cluster_dir=tmp_path / "out", cluster_orders=[])
    with pytest.raises(ValueError, match="1 cluster orders for 2 clusters"):
        state_to_deepspeed(ours, cluster_dir=tmp_path / "out", cluster_orders=[np.arange(3)])


class _IdDataset(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = torch.full((8,), i, dtype=torch.int64)
        return x, x


class _Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[list[int]] = []

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        self.seen.append(batch[0][:, 0].tolist())
        return (self.w * batch[0].float().mean() * 1e-3).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_trainer_resumes_from_a_deepspeed_checkpoint_file(tmp_path: Path) -> None:
    cfg = _config(tmp_path, tmp_path / "own")
    ref = _take(_sampler(cfg, b=4, A=2), 30)
    s = _sampler(cfg, b=4, A=2)
    _take(s, 10)  # 5 optimizer steps: DeepSpeed saves at a step boundary (nothing pending)
    ckpt = tmp_path / "global_step5" / "mp_rank_00_model_states.pt"  # DeepSpeed's checkpoint file name
    ckpt.parent.mkdir()
    torch.save({"module": {}, "data_sampler": s.deepspeed_state_dict(tmp_path / "ds_clusters")}, ckpt)

    dm = CurriculumDataModule(_config(tmp_path, tmp_path / "ds_clusters"), dataset=_IdDataset(), micro_batch_size=4)
    dm.load_state_dict({"sampler": torch.load(ckpt, weights_only=True)["data_sampler"]})
    model = _Recorder()
    trainer = pl.Trainer(
        max_steps=6,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    assert model.seen == ref[10:22]
    assert dm.state_dict()["sampler"]["consumed_samples"] == 22 * 4


_DS_VENV_PYTHON = Path(__file__).resolve().parents[1] / "benchmarks" / ".venv-deepspeed" / "bin" / "python"

_DS_SCRIPT = """
import json, sys, torch, deepspeed, numpy as np
import torch.distributed as tdist
from deepspeed.runtime.data_pipeline.config import get_data_efficiency_config
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
deepspeed.init_distributed(dist_backend="gloo")
cfg, out, k = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = DeepSpeedDataSampler(get_data_efficiency_config({"data_efficiency": cfg}), 1000, 4, 0, 1, tdist.group.WORLD, 2, 0)
it = iter(s)
seen = [next(it) for _ in range(k)]
torch.save({"data_sampler": s.state_dict(), "seen": seen}, out)
"""


@pytest.mark.skipif(not _DS_VENV_PYTHON.exists(), reason="needs benchmarks/.venv-deepspeed (setup_deepspeed_venv.sh)")
def test_real_deepspeed_sampler_state_resumes(tmp_path: Path) -> None:
    import json
    import os
    import subprocess

    # Tiny clusters (difficulty steps of 2 from 2): DeepSpeed wraps (reshuffles and rewrites) the first ones.
    cfg = _config(tmp_path, tmp_path / "ds_clusters", step=2, total=40)
    ds_cfg = {"enabled": True, **cfg}
    ds_cfg["data_sampling"] = {**cfg["data_sampling"], "enabled": True}
    env = {
        "PATH": "/usr/bin:/bin",
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
    }
    out = tmp_path / "mp_rank_00_model_states.pt"
    k = 2 * 11 + 1  # mid global batch: one micro-batch pending
    proc = subprocess.run(
        [str(_DS_VENV_PYTHON), "-c", _DS_SCRIPT, json.dumps(ds_cfg), str(out), str(k)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = torch.load(out, weights_only=False)
    state = ckpt["data_sampler"]
    assert len(state["batch"]) == 4 and state["curriculum_step"] == 12
    s = _sampler(cfg, b=4, A=2)
    s.load_state_dict(state)  # cluster names and members agree with DeepSpeed's files, or this raises
    assert s.consumed_samples == k * 4 and [c.name for c in s.data_clusters] == state["data_cluster_paths"]
    out_batches = _take(s, 41)
    assert out_batches[0] == state["batch"]
    values = _values()
    for step, i in enumerate(range(1, 41, 2), start=13):
        d = s.curriculum_schedulers["m"].get_difficulty(step)
        assert all(values[mb].max() <= d for mb in out_batches[i : i + 2])
