"""DeepSpeed configs map onto the typed configuration; unsupported keys are all reported; Trainer mismatches fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest

from tests._lightning_models import TinyGPTModule, loader
from zlightning.testing import DistributedTestError, run_distributed
from zlightning.zero import UnsupportedConfigError, from_deepspeed_config

DS = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "train_batch_size": 8,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "steps_per_print": 10,
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 5e7,
        "stage3_prefetch_bucket_size": 1e6,
        "stage3_param_persistence_threshold": 1e4,
        "stage3_max_live_parameters": 1e8,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": "none"},
    },
}


def test_mapping(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DS))
    s = from_deepspeed_config(path)
    assert (s.zero.stage, s.zero.prefetch_bucket_size, s.zero.param_persistence_threshold) == (3, 1_000_000, 10_000)
    assert s.zero.max_live_parameters == 100_000_000 and s.zero.reduce_bucket_size == 50_000_000
    assert s.checkpoint.save_full_weights and s.precision == "bf16-mixed" and s.gradient_clipping == 1.0
    fp16 = from_deepspeed_config(
        {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 3}}
    )
    assert fp16.precision == "16-mixed" and fp16.loss_scaler is not None
    assert (fp16.loss_scaler.initial_scale_power, fp16.loss_scaler.hysteresis) == (8, 3)


def test_unsupported_keys_are_listed_together() -> None:
    bad = {
        "zero_optimization": {
            "stage": 3,
            "sub_group_size": 1e9,
            "reduce_scatter": False,
            "offload_optimizer": {"device": "nvme"},
        },
        "aio": {"thread_count": 4},
        "optimizer": {"type": "AdamW"},
        "fp16": {"enabled": True, "loss_scale": 128},
    }
    with pytest.raises(UnsupportedConfigError, match="sub_group_size") as info:
        from_deepspeed_config(bad)
    msg = str(info.value)
    for piece in (
        "sub_group_size",
        "reduce_scatter=False",
        "offload_optimizer.device='nvme'",
        "aio",
        "optimizer (return it from",
        "fp16.loss_scale",
    ):
        assert piece in msg, piece
    with pytest.raises(ValueError, match="stage=0"):
        from_deepspeed_config({"zero_optimization": {"stage": 0}})
    with pytest.raises(FileNotFoundError, match=r"DeepSpeed config /nonexistent/ds\.json does not exist"):
        from_deepspeed_config("/nonexistent/ds.json")


def _fit_with_config(rank: int, world: int, config: dict[str, Any], kwargs: dict[str, Any]) -> float:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401

    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    trainer = pl.Trainer(
        strategy=ZStackZero3Strategy(config=config),
        accelerator="cpu",
        devices=world,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader(8, 2, world))
    return module.losses[-1]


def test_trains_from_deepspeed_config_and_checks_trainer() -> None:
    good = {"precision": "bf16-mixed", "gradient_clip_val": 1.0, "accumulate_grad_batches": 2}
    losses = run_distributed(_fit_with_config, 2, DS, good, init_process_group=False, timeout=180)
    assert all(0 < x < 10 for x in losses)
    with pytest.raises(DistributedTestError, match="use Trainer\\(precision='bf16-mixed'\\)"):
        run_distributed(
            _fit_with_config, 2, DS, {**good, "precision": "32-true"}, init_process_group=False, timeout=180
        )
    with pytest.raises(DistributedTestError, match="train_micro_batch_size_per_gpu=4"):
        run_distributed(
            _fit_with_config,
            2,
            {**DS, "train_micro_batch_size_per_gpu": 4, "train_batch_size": 16},
            good,
            init_process_group=False,
            timeout=180,
        )
