"""Checkpoints of ``ZStackZero3Strategy(tensor_parallel_size=2)`` through a real Lightning Trainer on 2 CPU ranks
(DP1 x TP2): Lightning's own ModelCheckpoint saves at every epoch (it failed: both TP ranks' engines wrote the same
files), a fit resumed from the first epoch's checkpoint ends equal to the uninterrupted fit, ``zlightning
consolidate`` merges the slices into a state dict the plain model loads strictly, and the wrong resumes are clear
errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from tests._lightning_models import loader
from tests.test_zero3_tp_compile_lightning import SGDModule
from zlightning.testing import run_distributed

WORLD, N_BATCHES = 2, 2


def _trainer(tmp: Path, strategy: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=WORLD,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _full(module: SGDModule) -> dict[str, torch.Tensor]:
    from zlightning.inject import tp_full_state
    from zlightning.zero import summon_full_params

    with summon_full_params(module):
        return tp_full_state(module)


def _ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.zero import CheckpointPolicy

    out: dict[str, Any] = {}
    pl.seed_everything(0, verbose=False)
    whole = SGDModule()  # two epochs, Lightning's ModelCheckpoint keeping each epoch's checkpoint
    saver = pl.callbacks.ModelCheckpoint(dirpath=f"{tmp}/ckpts", save_top_k=-1, filename="{epoch}")
    strategy = ZStackZero3Strategy(tensor_parallel_size=2, checkpoint=CheckpointPolicy(save_full_weights=True))
    trainer = _trainer(Path(tmp), strategy, max_epochs=2, callbacks=[saver])
    trainer.fit(whole, train_dataloaders=loader(N_BATCHES, 2, world))
    out["whole"] = _full(whole)

    pl.seed_everything(0, verbose=False)
    resumed = SGDModule()
    trainer = _trainer(Path(tmp), ZStackZero3Strategy(tensor_parallel_size=2), max_epochs=2, enable_checkpointing=False)
    trainer.fit(resumed, train_dataloaders=loader(N_BATCHES, 2, world), ckpt_path=f"{tmp}/ckpts/epoch=0.ckpt")
    out["resumed"] = _full(resumed)

    errors = {}
    for name, strategy in {
        "no_tp": ZStackZero3Strategy(),
        "full_policy": ZStackZero3Strategy(tensor_parallel_size=2, checkpoint=CheckpointPolicy(state_dict_type="full")),
    }.items():
        pl.seed_everything(0, verbose=False)
        trainer = _trainer(Path(tmp), strategy, max_epochs=3, enable_checkpointing=False)
        try:
            if name == "no_tp":
                trainer.fit(SGDModule(), loader(N_BATCHES, 2, world), ckpt_path=f"{tmp}/ckpts/epoch=1.ckpt")
            else:
                trainer.fit(SGDModule(), loader(N_BATCHES, 2, world))
                trainer.save_checkpoint(f"{tmp}/full.ckpt")
            errors[name] = None
        except (ValueError, OSError) as err:
            errors[name] = f"{type(err).__name__}: {err}"
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("zero3_tp_ckpt")
    return run_distributed(_ranks, WORLD, str(tmp), timeout=300), tmp


def test_model_checkpoint_saves_and_a_resumed_fit_equals_the_whole_one(
    results: tuple[list[dict[str, Any]], Path],
) -> None:
    ranks, tmp = results
    assert sorted(p.name for p in (tmp / "ckpts").iterdir()) == ["epoch=0.ckpt", "epoch=1.ckpt"]
    names = {p.name for p in (tmp / "ckpts" / "epoch=1.ckpt").iterdir()}
    assert names == {"tensor_parallel.json", "tp_00", "tp_01", "full_weights.pt"}, names
    for r in ranks:
        assert r["whole"].keys() == r["resumed"].keys()
        for k, v in r["whole"].items():
            torch.testing.assert_close(r["resumed"][k], v, rtol=0, atol=0, msg=k)


def test_consolidate_merges_the_slices(results: tuple[list[dict[str, Any]], Path]) -> None:
    from zlightning.zero import consolidate

    ranks, tmp = results
    out = consolidate(tmp / "ckpts" / "epoch=1.ckpt", tmp / "model.pt", progress=False)
    state = torch.load(out, weights_only=True)
    plain = SGDModule()
    plain.load_state_dict(state, strict=True)  # full shapes: the slices were merged
    whole = ranks[0]["whole"]
    split = [k for k in whole if "qkv.weight" in k or "fc.weight" in k]
    assert split, sorted(whole)
    full_weights = torch.load(tmp / "ckpts" / "epoch=1.ckpt" / "full_weights.pt", weights_only=True)
    for k, v in whole.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
        torch.testing.assert_close(full_weights[k], v, rtol=0, atol=0, msg=k)


def test_wrong_resumes_are_clear_errors(results: tuple[list[dict[str, Any]], Path]) -> None:
    for r in results[0]:
        no_tp, full = r["errors"]["no_tp"], r["errors"]["full_policy"]
        assert no_tp is not None and "tensor_parallel_size=2" in no_tp and "zlightning consolidate" in no_tp, no_tp
        assert full is not None and "state_dict_type='full'" in full and "zlightning consolidate" in full, full


def _failing_save(rank: int, world: int, tmp: str) -> str | None:
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from zlightning.zero import CheckpointSaveError, _tp_checkpoint

    pl.seed_everything(0, verbose=False)
    module = SGDModule()
    trainer = _trainer(Path(tmp), ZStackZero3Strategy(tensor_parallel_size=2), max_steps=1, enable_checkpointing=False)
    trainer.fit(module, train_dataloaders=loader(N_BATCHES, 2, world))
    if rank == 1:  # this TP rank's part fails before its data-parallel group could agree on anything

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise PermissionError("staging folder not writable")

        _tp_checkpoint.save_sharded = refuse  # type: ignore[assignment]
    try:
        trainer.save_checkpoint(f"{tmp}/ckpt")
    except CheckpointSaveError as err:
        return str(err)
    return None


def test_a_part_failing_on_one_rank_fails_every_rank_and_publishes_nothing(tmp_path: Path) -> None:
    for error in run_distributed(_failing_save, WORLD, str(tmp_path), timeout=120):
        assert error is not None and "failed on rank 1: PermissionError: staging folder not writable" in error, error
    assert not (tmp_path / "ckpt").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".zl-tmp")]  # the staging folder is removed
