"""zstack_zero3 through real Lightning Trainers on 2 CPU processes: checkpoint and exact resume, mixed precision,
validation with sync_dist under inference mode, and using the model after fit."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests._lightning_models import TinyGPTModule, loader, state_after_fit
from zlightning.testing import run_distributed

WORLD = 2


def _trainer(state_dict_type: str = "sharded", **kwargs: Any) -> pl.Trainer:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.zero import CheckpointPolicy

    base: dict[str, Any] = dict(
        strategy=ZStackZero3Strategy(checkpoint=CheckpointPolicy(state_dict_type=state_dict_type)),
        accelerator="cpu",
        devices=WORLD,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
    )
    base.update(kwargs)
    return pl.Trainer(**base)


def _resume(rank: int, world: int, ckpt_dir: str, kind: str) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    straight = TinyGPTModule()
    _trainer(max_epochs=2, accumulate_grad_batches=2).fit(straight, loader(4, 2, world))
    pl.seed_everything(0, verbose=False)
    first = TinyGPTModule()
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, save_top_k=0)
    _trainer(kind, max_epochs=1, accumulate_grad_batches=2, callbacks=[ckpt], enable_checkpointing=True).fit(
        first, loader(4, 2, world)
    )
    resumed = TinyGPTModule()
    trainer = _trainer(kind, max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(resumed, loader(4, 2, world), ckpt_path=os.path.join(ckpt_dir, "last.ckpt"))
    return {
        "straight": state_after_fit(straight),
        "resumed": state_after_fit(resumed),
        "step": trainer.global_step,
        "straight_losses": straight.losses[-4:],
        "resumed_losses": resumed.losses,
        "first": state_after_fit(first),
    }


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_checkpoint_resume_is_exact(tmp_path: Any, kind: str) -> None:
    out = run_distributed(_resume, WORLD, str(tmp_path), kind, init_process_group=False, timeout=300)
    for r in out:
        assert r["step"] == 4
        assert r["resumed_losses"] == r["straight_losses"]
        for name, value in r["straight"].items():
            assert torch.equal(r["resumed"][name], value), name
    plain = TinyGPTModule()
    if kind == "full":  # a plain Lightning checkpoint: full shapes, loadable without zlightning
        ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
        plain.load_state_dict(ckpt["state_dict"])
        assert ckpt["optimizer_states"][0]["state"][0]["exp_avg"].shape == plain.model.tok_emb.weight.shape
    else:  # a directory of per-rank shards, consolidated into one plain state dict
        assert (tmp_path / "last.ckpt" / "rank_00001.pt").is_file()
        from zlightning.zero import consolidate

        plain.load_state_dict(torch.load(consolidate(tmp_path / "last.ckpt", tmp_path / "c.pt", progress=False)))
    for name, value in out[0]["first"].items():
        assert torch.equal(plain.state_dict()[name], value), name


def _precision(rank: int, world: int, precision: str) -> dict[str, Any]:
    from zlightning.strategies import ZeroPrecision

    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule(lr=3e-3)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # on CPU Lightning turns precision="16-mixed" into bf16-mixed: the strategy's plugin keeps fp16
    setting: dict[str, Any] = {"plugins": [ZeroPrecision("16-mixed")]} if precision == "16-mixed" else {}
    trainer = _trainer(max_steps=6, precision=precision if not setting else None, gradient_clip_val=1.0, **setting)
    trainer.fit(module, loader(8, 2, world))
    after = state_after_fit(module)
    changed = all(not torch.equal(v, before[k]) for k, v in after.items())
    dtypes = {str(v.dtype) for v in after.values()}
    used = trainer.strategy.precision_plugin.precision
    return {"losses": module.losses, "changed": changed, "dtypes": dtypes, "precision": used}


def test_mixed_precision_trains_with_fp32_masters() -> None:
    ref = run_distributed(_precision, WORLD, "32-true", init_process_group=False, timeout=300)
    for precision in ("bf16-mixed", "16-mixed"):
        out = run_distributed(_precision, WORLD, precision, init_process_group=False, timeout=300)
        for r, f in zip(out, ref):
            assert r["precision"] == precision, (r["precision"], precision)
            assert r["changed"] and r["dtypes"] == {"torch.float32"}, precision
            assert all(torch.isfinite(torch.tensor(r["losses"])))
            torch.testing.assert_close(r["losses"], f["losses"], rtol=0.0, atol=5e-2, msg=precision)


def _validate_then_generate(rank: int, world: int) -> dict[str, Any]:
    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    trainer = _trainer(max_steps=2, limit_val_batches=2, val_check_interval=2)
    trainer.fit(module, loader(4, 2, world), loader(2, 2, world))
    val = float(trainer.callback_metrics["val_loss"])
    from zlightning.zero import engine_of, summon_full_params

    # after fit the module stays sharded: every rank calling it together generates (units gathered on use) ...
    assert engine_of(module) is not None and module.model.tok_emb.weight.ndim == 1
    with torch.no_grad():
        together = module.model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=5, top_k=1)
    # ... and rank 0 alone generates with the full parameters summoned to it
    with summon_full_params(module, rank0_only=True) as full:
        if rank == 0:
            assert full is module and module.model.tok_emb.weight.shape == (64, 32)
            out = module.model.generate(torch.zeros(1, 1, dtype=torch.long), max_new_tokens=5, top_k=1)
        else:
            assert full is None
            out = torch.zeros(1, 6, dtype=torch.long)
    assert module.model.tok_emb.weight.ndim == 1  # sharded again
    val_again = trainer.validate(module, loader(2, 2, world), verbose=False)[0]["val_loss"]
    state = state_after_fit(module)
    test_loss = trainer.test(module, loader(2, 2, world), verbose=False)  # test reuses the engine too
    return {"val": val, "val_again": val_again, "gen": out, "together": together, "state": state, "test": test_loss}


def test_validation_and_use_after_fit() -> None:
    out = run_distributed(_validate_then_generate, WORLD, init_process_group=False, timeout=300)
    assert out[0]["gen"].shape == (1, 6)
    assert torch.equal(out[0]["gen"], out[0]["together"]) and torch.equal(out[1]["together"], out[0]["together"])
    for name, value in out[0]["state"].items():
        assert torch.equal(out[1]["state"][name], value), name
    # validation through the sharded model equals validation of the plain model computed here
    plain = TinyGPTModule()
    plain.load_state_dict(out[0]["state"])
    from tests._zero_models import gpt_loss

    data = loader(2, 2, WORLD)
    with torch.no_grad():
        expected = sum(float(gpt_loss(plain.model, b[0])) for i, b in enumerate(data) if i < 2 * WORLD) / (2 * WORLD)
    assert abs(out[0]["val_again"] - expected) < 1e-5
    assert out[0]["val"] == out[1]["val"]
    assert abs(out[0]["test"][0]["test_loss"] - out[0]["val_again"]) < 1e-6


def _top_k(rank: int, world: int, ckpt_dir: str) -> list[str]:
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=1, save_last=True)
    _trainer(max_steps=3, callbacks=[ckpt], enable_checkpointing=True).fit(TinyGPTModule(), loader(4, 2, world))
    return sorted(os.listdir(ckpt_dir))


def test_model_checkpoint_rotates_sharded_directories(tmp_path: Any) -> None:
    listing = run_distributed(_top_k, WORLD, str(tmp_path), init_process_group=False, timeout=180)[0]
    assert listing == ["epoch=0-step=3.ckpt", "last.ckpt"], listing  # older top-k directories were removed
    assert (tmp_path / "epoch=0-step=3.ckpt" / "meta.json").is_file()
