"""Sharded initialisation with parameter shards on NVMe: each shard gets its initial values only as it is written to
its swap file (``[Note: initial values straight to disk]`` in ``zlightning/zero/_state.py``), so the whole sharded
model never sits in memory at once. The values, and training from them, equal sharded initialisation in memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from zlightning.testing import run_distributed


def _model(width: int, depth: int) -> nn.Module:
    blocks = [nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.Tanh()) for _ in range(depth)]
    return nn.Sequential(*blocks, nn.Linear(width, 3))


def _train(rank: int, world: int, root: str, offload: bool, width: int, depth: int) -> dict[str, Any]:
    from zlightning.kernels._host_cache import host_cache_stats

    from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, NVMeOffload, ZeroConfig

    torch.manual_seed(7)
    with torch.device("meta"):
        model = _model(width, depth)
    params = NVMeOffload(path=root, buffer_size=width * width // 2 + width, buffer_count=3) if offload else None
    config = ZeroConfig(offload_optimizer=CPUOffload(), offload_params=params)
    live_before = host_cache_stats().live_bytes
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), config=config, device=torch.device("cpu")
    )
    built = host_cache_stats().peak_live_bytes - live_before
    initial = zero.module_state_dict()
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        x = torch.randn(4, width, generator=g)
        loss = model(x).square().mean()
        zero.backward(loss)
        zero.step()
        losses.append(float(loss))
    out = {"initial": initial, "final": zero.module_state_dict(), "losses": losses, "built_peak": built}
    zero.close()
    return out


def test_parameter_offload_without_an_offloaded_optimizer_is_refused() -> None:
    import pytest

    from zlightning.zero import NVMeOffload, ZeroConfig

    with pytest.raises(ValueError, match="needs offload_optimizer"):
        ZeroConfig(offload_params=NVMeOffload(path="/tmp"))


def test_meta_init_straight_to_disk_matches_in_memory_init(tmp_path: Path) -> None:
    width, depth = 512, 16  # shards of 512 KiB: large enough for the host cache's counters
    disk = run_distributed(_train, 2, str(tmp_path), True, width, depth, timeout=240)
    memory = run_distributed(_train, 2, str(tmp_path), False, width, depth, timeout=240)
    for d, m in zip(disk, memory):
        assert d["initial"].keys() == m["initial"].keys()
        for name, value in m["initial"].items():
            assert torch.equal(d["initial"][name], value), name
        assert d["losses"] == m["losses"]
        for name, value in m["final"].items():
            torch.testing.assert_close(d["final"][name], value, rtol=1e-6, atol=1e-7)
    assert not torch.equal(memory[0]["initial"]["0.0.weight"], memory[0]["initial"]["1.0.weight"])
    assert not any(tmp_path.rglob("*.swp")), "swap files must be gone after close()"
    # Building held about one shard at a time, not the whole sharded model: the peak of large host blocks (the CPU
    # optimizer's state included in both) is lower by most of the weight shards' bytes (16 x 512 KiB per rank),
    # although the disk run also holds its swap buffers (3 x 512 KiB).
    shards = depth * width * width // 2 * 4
    for d, m in zip(disk, memory):
        assert m["built_peak"] - d["built_peak"] >= shards // 2, (d["built_peak"], m["built_peak"], shards)
