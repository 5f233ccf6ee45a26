"""The memory estimator agrees with the memory report of a real run (within 2%)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.testing import run_distributed
from zlightning.zero import CPUOffload, DeepSpeedZeroOptimizer_Stage3, NVMeOffload, ZeroConfig, estimate_zero_memory


def _report(rank: int, world: int, stage: int) -> Any:
    model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters()), config=ZeroConfig(stage=stage))
    zero.backward(gpt_loss(model, batches(1, 2 * world, vocab=128)[0].chunk(world)[rank]))
    zero.step()
    return zero.memory_report()


@pytest.mark.parametrize("stage", [3, 2])
def test_estimate_matches_report(stage: int) -> None:
    world = 2
    report = run_distributed(_report, world, stage, timeout=120)[0]
    with torch.device("meta"):
        model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    est = estimate_zero_memory(world_size=world, module=model, stage=stage)
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "persistent_bytes"):
        actual = getattr(report, key)
        assert abs(getattr(est, key) - actual) <= 0.02 * max(actual, 1) + 64 * 4, (key, getattr(est, key), actual)
    assert abs(est.model_state_bytes - report.model_state_bytes) <= 0.02 * report.model_state_bytes
    assert est.largest_unit_bytes == report.largest_unit_bytes or stage < 3
    big = estimate_zero_memory(world_size=8, num_params=7_000_000_000, precision="bf16-mixed")
    assert big.param_bytes == 4 * 875_000_000 and big.optimizer_bytes == 8 * 875_000_000


def test_estimate_errors() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        estimate_zero_memory(world_size=2)
    with pytest.raises(ValueError, match="precision"):
        estimate_zero_memory(world_size=2, num_params=10, precision="64-true")


def _offload_config(kind: str, swap: str) -> ZeroConfig:
    if kind == "cpu":
        return ZeroConfig(offload_optimizer=CPUOffload())
    return ZeroConfig(
        offload_optimizer=NVMeOffload(path=swap, buffer_size=2048, buffer_count=6),
        offload_params=NVMeOffload(path=swap, buffer_size=32768, buffer_count=3),
    )


def _offload_report(rank: int, world: int, kind: str, swap: str) -> tuple[dict[str, int], int]:
    model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters()), config=_offload_config(kind, swap)
    )
    zero.backward(gpt_loss(model, batches(1, 2 * world, vocab=128)[0].chunk(world)[rank]))
    zero.step()
    offload = zero.state.offload
    assert offload is not None
    on_disk = sum(f.stat().st_size for d in offload.folders for f in d.path.rglob("*") if f.is_file())
    report = zero.memory_report().as_dict()
    zero.close()
    return report, on_disk


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
def test_offload_estimate_matches_run(kind: str, tmp_path: Path) -> None:
    """With offload the estimate still matches what a real run holds (CPU ranks: every resident byte is host
    memory) and, for NVMe, the bytes its swap files take on disk."""
    world = 2
    report, on_disk = run_distributed(_offload_report, world, kind, str(tmp_path), timeout=120)[0]
    with torch.device("meta"):
        model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    est = estimate_zero_memory(
        world_size=world, module=model, config=_offload_config(kind, str(tmp_path)), device_type="cpu"
    )
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "persistent_bytes", "model_state_bytes"):
        actual = report[key]
        assert abs(getattr(est, key) - actual) <= 0.02 * max(actual, 1) + 64 * 4, (key, getattr(est, key), actual)
    assert est.device_bytes == 0 and est.host_bytes >= est.model_state_bytes
    if kind == "nvme":
        assert report["param_bytes"] < report["grad_bytes"] / 2  # shards really are on disk
        assert abs(est.nvme_bytes - on_disk) <= 0.05 * on_disk, (est.nvme_bytes, on_disk)
    else:
        assert est.nvme_bytes == 0 and on_disk == 0


def test_offload_estimate_places_bytes_on_an_accelerator() -> None:
    """On an accelerator, offload moves bytes off the device: to the host, then (NVMe) to disk. 8 ranks, 7e9
    parameters, Adam: shard S = 875e6 elements."""
    shard, n = 875_000_000, 7_000_000_000
    plain = estimate_zero_memory(world_size=8, num_params=n)
    assert (plain.device_bytes, plain.host_bytes, plain.nvme_bytes) == (16 * shard, 0, 0)
    cpu = estimate_zero_memory(world_size=8, num_params=n, config=ZeroConfig(offload_optimizer=CPUOffload()))
    # Adam's moments and an fp32 master on the host; parameter and gradient shards stay on the device
    assert (cpu.device_bytes, cpu.host_bytes, cpu.nvme_bytes) == (8 * shard, 12 * shard, 0)
    pool = NVMeOffload(buffer_count=4, buffer_size=1 << 20)
    params = NVMeOffload(buffer_count=3, buffer_size=1 << 24)  # units assumed n / 100: 8.75e6-element shards
    nvme = estimate_zero_memory(
        world_size=8, num_params=n, config=ZeroConfig(offload_optimizer=pool, offload_params=params)
    )
    assert nvme.device_bytes == 4 * shard  # gradient shards only
    assert nvme.nvme_bytes == 16 * shard  # moments, master, parameter shards
    assert nvme.host_bytes == 4 * 4 * (1 << 20) + 3 * 4 * 8_750_080  # the two pools (buffers 4 KiB aligned)
    with pytest.raises(ValueError, match="raise buffer_size"):
        estimate_zero_memory(world_size=8, num_params=n, config=ZeroConfig(offload_optimizer=pool, offload_params=pool))
    with pytest.raises(ValueError, match="give the stage in one place"):
        estimate_zero_memory(world_size=2, num_params=10, stage=2, config=ZeroConfig())
