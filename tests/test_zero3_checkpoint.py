"""Sharded ZeRO-3 checkpoints: resharding N->M, consolidation, corrupted/missing/mismatched checkpoints, atomic saves."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.testing import run_distributed
from zlightning.zero import (
    CheckpointError,
    DeepSpeedZeroOptimizer_Stage3,
    ZeroConfig,
    consolidate,
    load_sharded,
    save_sharded,
)

ROOT = Path(__file__).resolve().parents[1]
CFG = ZeroConfig(param_persistence_threshold=40)


def _engine(model: torch.nn.Module, config: ZeroConfig = CFG) -> DeepSpeedZeroOptimizer_Stage3:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    return DeepSpeedZeroOptimizer_Stage3(model, opt, config=config)


def _step(zero: DeepSpeedZeroOptimizer_Stage3, rank: int, world: int, seed: int) -> None:
    batch = batches(1, 8, seed=seed)[0]  # the same global batch at every world size
    zero.backward(gpt_loss(zero.module, batch.chunk(world)[rank]))
    zero.step()


def _save(rank: int, world: int, path: str, full_weights: bool = False) -> dict[str, Any]:
    zero = _engine(tiny_gpt())
    for seed in range(2):
        _step(zero, rank, world, seed)
    save_sharded(zero.state, [zero.optimizer], path, {"epoch": 3}, save_full_weights=full_weights)
    return {"model": zero.module_state_dict(), "optim": zero.state_dict()["optimizer"], "layout": _groups(zero)}


def _groups(zero: DeepSpeedZeroOptimizer_Stage3) -> list[list[str]]:
    return [[zp.fqn for zp in g.params] for g in zero.state.groups]


def _load(rank: int, world: int, path: str, extra_step: bool, config: ZeroConfig = CFG) -> dict[str, Any]:
    zero = _engine(tiny_gpt(seed=7), config)  # different init: everything must come from the checkpoint
    client = load_sharded(zero.state, [zero.optimizer], path)
    out = {
        "client": client,
        "model": zero.module_state_dict(),
        "optim": zero.state_dict()["optimizer"],
        "layout": _groups(zero),
    }
    if extra_step:
        _step(zero, rank, world, 5)
        out["after"] = zero.module_state_dict()
    return out


@pytest.mark.parametrize(("saved_at", "loaded_at"), [(2, (1, 2, 4)), (1, (2,))])
def test_reshard_between_world_sizes(tmp_path: Path, saved_at: int, loaded_at: tuple[int, ...]) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, saved_at, path, timeout=180)[0]
    assert sorted(os.listdir(path)) == ["client_state.pt", "meta.json"] + [f"rank_{r:05d}.pt" for r in range(saved_at)]
    continued = {}
    for world in loaded_at:
        out = run_distributed(_load, world, path, True, timeout=240)
        for r in out:
            assert r["client"] == {"epoch": 3}
            for name, value in saved["model"].items():
                assert torch.equal(r["model"][name], value), (world, name)
            for i, s in saved["optim"]["state"].items():
                for key, value in s.items():
                    assert torch.equal(r["optim"]["state"][i][key], value), (world, i, key)
        continued[world] = out[0]["after"]
    for world in loaded_at[1:]:  # training continues identically whatever the world size
        for name, value in continued[loaded_at[0]].items():
            torch.testing.assert_close(continued[world][name], value, rtol=1e-5, atol=1e-6, msg=name)


# Saved with CFG (persistent small params, one unit per block); loaded with other groupings of the same parameters.
OTHER_LAYOUTS = [
    ZeroConfig(param_persistence_threshold=0),  # nothing persistent: every parameter sharded in its unit
    ZeroConfig(param_persistence_threshold=100, unit_modules=("MLP", "CausalSelfAttention")),  # finer units
]


def test_load_with_a_different_sharding_layout(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, path, timeout=180)[0]
    reference = run_distributed(_load, 2, path, True, timeout=240)[0]["after"]
    for config, world in zip(OTHER_LAYOUTS, (2, 1)):
        r = run_distributed(_load, world, path, True, config, timeout=240)[0]
        assert r["layout"] != saved["layout"]  # the parameters really are grouped differently
        for name, value in saved["model"].items():
            assert torch.equal(r["model"][name], value), (world, name)
        for i, s in saved["optim"]["state"].items():
            for key, value in s.items():
                assert torch.equal(r["optim"]["state"][i][key], value), (world, i, key)
        for name, value in reference.items():  # and the next step is the same step
            torch.testing.assert_close(r["after"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def _save_single(rank: int, world: int, path: str) -> dict[str, Any]:
    return _save(rank, world, path)


def _load_expect_error(rank: int, world: int, path: str, wide: bool) -> str:
    zero = _engine(tiny_gpt(seed=7, d_model=48) if wide else tiny_gpt(seed=7))
    before = zero.module_state_dict()
    try:
        load_sharded(zero.state, [zero.optimizer], path)
    except CheckpointError as err:
        after = zero.module_state_dict()
        if any(not torch.equal(after[k], v) for k, v in before.items()):
            return "half-loaded"
        return str(err)
    return "no error"


def test_bad_checkpoints_fail_clearly_and_load_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    run_distributed(_save, 2, str(path), timeout=180)
    msg = run_distributed(_load_expect_error, 1, str(path), True, timeout=120)[0]
    assert "does not match this model" in msg and "attn" in msg
    data = bytearray((path / "rank_00001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "rank_00001.pt").write_bytes(bytes(data))
    msg = run_distributed(_load_expect_error, 1, str(path), False, timeout=120)[0]
    assert "rank_00001.pt is corrupted" in msg
    (path / "rank_00001.pt").unlink()
    msg = run_distributed(_load_expect_error, 1, str(path), False, timeout=120)[0]
    assert "rank_00001.pt is missing" in msg
    (path / "meta.json").unlink()
    msg = run_distributed(_load_expect_error, 1, str(path), False, timeout=120)[0]
    assert "meta.json is missing" in msg


def test_consolidate_cli_and_function(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    saved = run_distributed(_save, 2, str(path), timeout=180)[0]["model"]
    out = tmp_path / "model.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "zlightning.cli", "consolidate", str(path), str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = tiny_gpt(seed=9)
    plain.load_state_dict(torch.load(out, weights_only=True))  # no zlightning needed to use it
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[name]), name
    half = consolidate(path, tmp_path / "half.pt", dtype=torch.bfloat16, progress=False)
    sd = torch.load(half, weights_only=True)
    assert sd.keys() == saved.keys()
    for name, value in saved.items():  # the fp32 masters, rounded to bf16 once
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert sd[name].dtype == expected.dtype and torch.equal(sd[name], expected), name
    with pytest.raises(CheckpointError, match="not a sharded zlightning checkpoint"):
        consolidate(out, tmp_path / "x.pt")
    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.torch import load_file

        st = consolidate(path, tmp_path / "model.safetensors", progress=False)
        plain = tiny_gpt(seed=9)
        plain.load_state_dict(load_file(st), strict=False)  # tied head: safetensors stores the shared tensor once
        for name, value in plain.state_dict().items():
            assert torch.equal(value, saved[name]), name


def _crash_mid_save(rank: int, world: int, path: str) -> dict[str, Any]:
    import zlightning.zero._sharded_checkpoint as sc

    zero = _engine(tiny_gpt())
    save_sharded(zero.state, [zero.optimizer], path, {"epoch": 1})
    first = {k: v.clone() for k, v in zero.module_state_dict().items()}
    _step(zero, rank, world, 0)
    stepped = zero.module_state_dict()
    real_save = sc.torch.save

    def failing(obj: Any, f: Any, *a: Any, **k: Any) -> None:
        if str(f).endswith("client_state.pt"):
            raise OSError("disk full (simulated)")
        real_save(obj, f, *a, **k)

    sc.torch.save = failing
    try:
        save_sharded(zero.state, [zero.optimizer], path, {"epoch": 2})
    except sc.CheckpointSaveError as err:
        if "disk full (simulated)" not in str(err) or "unchanged" not in str(err):
            raise
    else:
        raise AssertionError("the failed save did not raise")
    finally:
        sc.torch.save = real_save
    fresh = _engine(tiny_gpt(seed=3))
    client = load_sharded(fresh.state, [fresh.optimizer], path)
    loaded = fresh.module_state_dict()
    return {
        "client": client,
        "shards_are_the_first_save": all(torch.equal(loaded[k], v) for k, v in first.items()),
        "step_changed_them": any(not torch.equal(stepped[k], v) for k, v in first.items()),
    }


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    """A save that fails part-way leaves the previous checkpoint whole: its client state and its shards (the weights
    the first save wrote, not the stepped ones the failed save had begun to write)."""
    (r,) = run_distributed(_crash_mid_save, 1, str(tmp_path / "ckpt"), timeout=120)
    assert r == {"client": {"epoch": 1}, "shards_are_the_first_save": True, "step_changed_them": True}


def test_save_full_weights(tmp_path: Path) -> None:
    saved = run_distributed(_save, 2, str(tmp_path / "ckpt"), True, timeout=180)[0]["model"]
    plain = tiny_gpt(seed=9)
    plain.load_state_dict(torch.load(tmp_path / "ckpt" / "full_weights.pt", weights_only=True))
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved[name]), name
