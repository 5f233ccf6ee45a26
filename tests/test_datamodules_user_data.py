"""The data modules as Lightning users drive them: their own data modules and samples, and Trainer features."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from zlightning.datamodules import CurriculumDataModule

from zlightning.testing import run_distributed

N = 40


class DictDataset(Dataset):
    """Sample ``i`` is a dict: ``ids`` (8 positions holding i) and a scalar ``label`` i."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"ids": torch.full((8,), i), "label": torch.tensor(i)}


class UserDataModule(pl.LightningDataModule):
    """A user's own data module (not the project's text one): ``train_dataset``, ``batch_size``, a val loader."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = 4

    def setup(self, stage: str) -> None:
        self.train_dataset = DictDataset()

    def val_dataloader(self) -> DataLoader:
        return DataLoader(DictDataset(), batch_size=8)


class Recorder(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.seen.append((self.current_epoch, batch["label"].tolist()))
        return (self.w * batch["ids"].float().mean() * 1e-3).sum()

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(ckpt: str | None = None, callbacks: list[Any] | None = None, **trainer_kw: Any) -> list[tuple[int, list[int]]]:
    model = Recorder()
    dm = CurriculumDataModule({"seed": 1}, base=UserDataModule())
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=callbacks is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **trainer_kw,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    return model.seen


def _by_epoch(seen: list[tuple[int, list[int]]]) -> dict[int, list[list[int]]]:
    out: dict[int, list[list[int]]] = {}
    for epoch, ids in seen:
        out.setdefault(epoch, []).append(ids)
    return out


def test_limit_train_batches_starts_each_epoch_afresh_and_resumes_at_an_epoch_end(tmp_path: Path) -> None:
    """Without curriculum, each Lightning epoch cut by limit_train_batches is the start of the sampler's next epoch
    (as with a shuffled DataLoader), not the rest of the previous one (which made every second epoch 3 batches
    long); a resume from the checkpoint written at an epoch's last batch continues identically."""
    full = _by_epoch(_fit(max_epochs=3))
    assert [len(v) for v in full.values()] == [10, 10, 10]
    cb = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{epoch}-{step}")
    limited_seen = _fit(max_epochs=3, limit_train_batches=7, callbacks=[cb])
    limited = _by_epoch(limited_seen)
    assert [len(v) for v in limited.values()] == [7, 7, 7]
    for epoch in range(3):
        assert limited[epoch] == full[epoch][:7]  # epoch e's permutation, from its start
    resumed = _fit(max_epochs=3, limit_train_batches=7, ckpt=str(tmp_path / "epoch=1-step=14.ckpt"))
    assert resumed == limited_seen[14:]


def _packed(lengths: list[int], tokens_dtype: torch.dtype) -> dict[str, Tensor]:
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "cu_seqlens": cu,
        "tokens": torch.arange(total).to(tokens_dtype),
        "mask": torch.ones(total, dtype=torch.bool),
    }


def _wrapper_with_mixed_dtypes_on_rank_0(rank: int, world: int) -> str:
    from zlightning.datamodules import HybridCPConfig, HybridCPDataLoaderWrapper

    second = torch.int32 if rank == 0 else torch.int64  # a user's collate that keeps each dataset's dtype
    batches = [[_packed([4, 3], torch.int64), _packed([5], second)]]
    try:
        next(iter(HybridCPDataLoaderWrapper(batches, HybridCPConfig(max_seqlen_per_rank=16))))
    except (ValueError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_hybrid_cp_batch_whose_samples_disagree_on_a_dtype_fails_clearly_on_every_rank() -> None:
    """A packed batch whose samples give one key different dtypes (on one rank only) used to fail on that rank
    inside the byte packing ('shape [5, 8] is invalid for input of size 20') after the peers had entered the
    all-to-all (they died with 'Connection closed by peer', or hung). It is now refused when unpacked, before any
    collective, and every rank says which rank, sample and key."""
    errors = run_distributed(_wrapper_with_mixed_dtypes_on_rank_0, 2, timeout=120)
    assert errors[0].startswith("ValueError: unpack_packed_batch: sample 1 key 'tokens' is torch.int32"), errors[0]
    assert "earlier sample's is torch.int64" in errors[0]
    assert errors[1].startswith("RuntimeError: HybridCPDataLoaderWrapper: a malformed batch on group rank(s) [0]")
    assert "sample 1 key 'tokens' is torch.int32" in errors[1]


def _curriculum_config(root: str, cluster_path: str) -> dict[str, Any]:
    from zlightning.datamodules.curriculum import write_metric_index

    write_metric_index(f"{root}/m", "m", np.random.default_rng(0).integers(1, 11, N))
    metric = {
        "index_to_sample_path": f"{root}/m/m_index_to_sample",
        "index_to_metric_path": f"{root}/m/m_index_to_metric",
        "min_difficulty": 3,
        "max_difficulty": 10,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 1},
    }
    learning = {"enabled": True, "data_cluster_path": cluster_path, "curriculum_metrics": {"m": metric}}
    return {"seed": 1, "data_sampling": {"num_epochs": 2, "curriculum_learning": learning}}


def _fit_with_a_file_as_cluster_path(rank: int, world: int, root: str) -> str:
    config = _curriculum_config(f"{root}/rank{rank}", f"{root}/not_a_folder")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    try:
        trainer.fit(Recorder(), datamodule=CurriculumDataModule(config, base=UserDataModule()))
    except Exception as err:  # noqa: BLE001 - the test compares what each rank raised
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_an_unusable_cluster_path_fails_with_the_same_clear_error_on_every_rank(tmp_path: Path) -> None:
    """data_cluster_path naming a file (or a folder that cannot be created) used to fail on DP rank 0 only, the one
    that writes, with a bare FileExistsError; rank 1 went on into DDP's collectives and died with 'Connection reset
    by peer' (or hung while rank 0 lived). Every rank now checks the folder at its first cluster."""
    (tmp_path / "not_a_folder").write_text("")
    errors = run_distributed(_fit_with_a_file_as_cluster_path, 2, str(tmp_path), init_process_group=False, timeout=120)
    for error in errors:
        assert error.startswith(
            f"ValueError: DeepSpeedDataSampler: data_cluster_path '{tmp_path}/not_a_folder' is not a writable folder"
        ), error
        assert "FileExistsError" in error and "data_cluster_path to a folder every rank can create and write" in error


def test_a_missing_metric_index_file_is_named_with_its_metric_and_setting(tmp_path: Path) -> None:
    """A mistyped index_to_sample_path used to fail with a bare "[Errno 2] No such file or directory: '....bin'"
    from the cluster fingerprint, before the index file's own message; now the metric and its settings are named."""
    from zlightning.datamodules import DeepSpeedDataSampler

    config = _curriculum_config(str(tmp_path), str(tmp_path / "clusters"))
    metric = config["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["m"]
    metric["index_to_sample_path"] = str(tmp_path / "m" / "typo_index_to_sample")
    sampler = DeepSpeedDataSampler(config, N, 4)
    with pytest.raises(FileNotFoundError) as info:
        next(iter(sampler))
    message = str(info.value)
    assert message.startswith("DeepSpeedDataSampler: the index files of curriculum metric 'm' (index_to_sample_path=")
    assert f"{tmp_path}/m/typo_index_to_sample.idx does not exist" in message


def _seqlen_config() -> dict[str, Any]:
    """A sequence-length curriculum: 2, 4, 6, 8 tokens at curriculum steps 1, 2, 3, 4+."""
    return {
        "seed": 1,
        "data_sampling": {
            "num_epochs": 2,
            "curriculum_learning": {
                "enabled": True,
                "curriculum_metrics": {
                    "seqlen_truncate": {
                        "clustering_type": "single_cluster",
                        "min_difficulty": 2,
                        "max_difficulty": 8,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"total_curriculum_step": 4, "difficulty_step": 2},
                    }
                },
            },
        },
    }


class StepRecorder(Recorder):
    """Records ``(optimizer step, sample ids, sequence length)`` per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, list[int], int]] = []

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.steps.append((self.trainer.global_step, batch["label"].tolist(), batch["ids"].shape[1]))
        return super().training_step(batch, batch_idx)


def test_curriculum_step_stays_in_lockstep_with_the_optimizer_step_across_short_epochs() -> None:
    """limit_train_batches=3 with accumulate_grad_batches=2: Lightning steps the optimizer at each epoch's end after
    one micro-batch. The sampler used to carry on with the rest of that global batch, so from then on every optimizer
    step mixed two curriculum steps (sequence lengths [4], [4, 6], [6], ...). Now each optimizer step k trains on
    global batch k only, at the difficulty of curriculum step k."""
    from zlightning.datamodules import DeepSpeedDataSampler

    config = _seqlen_config()
    model = StepRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=3,
        limit_train_batches=3,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(model, datamodule=CurriculumDataModule(config, base=UserDataModule()))
    assert trainer.global_step == 6 and len(model.steps) == 9
    per_step: dict[int, list[tuple[list[int], int]]] = {}
    for step, ids, length in model.steps:
        per_step.setdefault(step, []).append((ids, length))
    assert [[length for _, length in mbs] for mbs in per_step.values()] == [[2, 2], [4], [6, 6], [8], [8, 8], [8]]
    reference = DeepSpeedDataSampler(config, N, 4, gradient_accumulation_steps=2)
    for step, mbs in per_step.items():
        reference.get_next_global_batch()  # curriculum step `step + 1`
        assert reference.curriculum_step == step + 1
        global_batch = reference.batch
        assert [i for ids, _ in mbs for i in ids] == global_batch[: 4 * len(mbs)]  # one global batch per step


def _fit_steps(
    curriculum: bool, devices: int, micro_batch: int, max_steps: int, ckpt: str | None = None, save: str | None = None
) -> list[tuple[list[int], int]]:
    config = _seqlen_config() if curriculum else {"seed": 1}
    model = StepRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_steps=max_steps,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    dm = CurriculumDataModule(config, base=UserDataModule(), micro_batch_size=micro_batch)
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return [(ids, length) for _, ids, length in model.steps]


def _two_ranks_of_four(rank: int, world: int, root: str) -> dict[bool, list[Any]]:
    out: dict[bool, list[Any]] = {}
    for curriculum in (True, False):
        full = _fit_steps(curriculum, world, 4, 5)
        _fit_steps(curriculum, world, 4, 2, save=f"{root}/{curriculum}.ckpt")
        out[curriculum] = full
    return out


def test_a_two_rank_checkpoint_resumes_on_one_rank_with_the_same_global_micro_batch(tmp_path: Path) -> None:
    """DDP on 2 ranks with micro-batches of 4, stopped by max_steps and checkpointed, resumes on 1 process with
    micro-batches of 8 (the same global batch): it trains on exactly the union of what the 2 ranks of the
    uninterrupted run trained on, with and without curriculum. The sampler used to refuse any change of
    data_parallel_size or micro_batch_size, although its stream depends only on their product."""
    runs = run_distributed(_two_ranks_of_four, 2, str(tmp_path), init_process_group=False, timeout=240)
    for curriculum in (True, False):
        union = [(a[0] + b[0], a[1]) for a, b in zip(runs[0][curriculum], runs[1][curriculum])]
        assert len(union) == (10 if curriculum else 9)  # (without curriculum, 5 micro-batches an epoch)
        resumed = _fit_steps(curriculum, 1, 8, 5, ckpt=str(tmp_path / f"{curriculum}.ckpt"))
        assert resumed == union[4:]
    with pytest.raises(ValueError, match=r"'micro_batch_size \* data_parallel_size': \(4, 8\)"):
        _fit_steps(True, 1, 4, 5, ckpt=str(tmp_path / "True.ckpt"))


class SubSampleRecorder(pl.LightningModule):
    """Consumes `HybridCPBatch`es as a user's own module would; records ``(epoch, [(gid, tokens)])`` per step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[tuple[int, list[tuple[int, list[int]]]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.seen.append((self.current_epoch, [(s.gid, s.data["tokens"].tolist()) for s in batch.sub_samples]))
        return (self.w * 0.0).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_hybrid_cp(
    root: str,
    ckpt: str | None = None,
    save: str | None = None,
    weights_only: bool | None = None,
    devices: int = 2,
    callbacks: list[Any] | None = None,
    **trainer_kw: Any,
) -> list[Any]:
    from tests.test_hybrid_cp_lightning import _datamodule

    model = SubSampleRecorder()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp",
        logger=False,
        enable_checkpointing=callbacks is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        **trainer_kw,
    )
    trainer.fit(model, datamodule=_datamodule(root), ckpt_path=ckpt, weights_only=weights_only)
    if save is not None:
        trainer.save_checkpoint(save)
    return model.seen


def _hybrid_cp_resume(rank: int, world: int, root: str) -> tuple[list[Any], list[Any], list[Any]]:
    full = _fit_hybrid_cp(root, max_epochs=3)
    first = _fit_hybrid_cp(root, max_steps=8, save=f"{root}/mid.ckpt")
    second = _fit_hybrid_cp(root, ckpt=f"{root}/mid.ckpt", max_epochs=3)
    return full, first, second


def test_hybrid_cp_text_datamodule_resumed_run_shuffles_each_epoch_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """HybridCPTextDataModule counted its DistributedSampler's epochs itself, from 0 in every process, so a run
    resumed from a checkpoint (here: stopped by max_steps in epoch 1; Lightning goes on with epoch 2) trained epoch 2
    on epoch 0's order. It now takes the Trainer's epoch: the resumed run's batches equal the uninterrupted run's."""
    from tests.test_hybrid_cp_lightning import _write_corpus

    _write_corpus(tmp_path)
    runs = run_distributed(_hybrid_cp_resume, 2, str(tmp_path), init_process_group=False, timeout=240)
    for full, first, second in runs:
        by_epoch: dict[int, list[Any]] = {}
        for epoch, subs in full:
            by_epoch.setdefault(epoch, []).append(subs)
        assert sorted(by_epoch) == [0, 1, 2] and by_epoch[0] != by_epoch[2]  # epochs are shuffled differently
        assert first == full[: len(first)]
        assert [e for e, _ in second] == [2] * len(by_epoch[2])
        assert [subs for _, subs in second] == by_epoch[2]


def _hybrid_cp_resume_by_default(rank: int, world: int, root: str) -> tuple[list[Any], list[Any], list[Any], Any]:
    full = _fit_hybrid_cp(root, devices=world, max_steps=7)
    first = _fit_hybrid_cp(root, devices=world, max_steps=2, save=f"{root}/two.ckpt")
    second = _fit_hybrid_cp(root, devices=world, ckpt=f"{root}/two.ckpt", max_steps=3)  # weights_only as Lightning's
    return full, first, second, torch.load(f"{root}/two.ckpt", weights_only=True)["datamodule_hyper_parameters"]


def test_hybrid_cp_text_datamodule_checkpoint_resumes_without_the_unsafe_load_opt_in(tmp_path: Path) -> None:
    """Under Lightning's ddp strategy the checkpoint's datamodule hyper-parameters held the HybridCPConfig object, so
        trainer.fit(ckpt_path=...) failed in Lightning 2.6's weights-only load ('Unsupported global: ...HybridCPConfig')
        unless the user opted in to full unpickling. They now hold it as a plain dict and the resume continues as the
    uninterrupted run."""
    from tests.test_hybrid_cp_lightning import _write_corpus

    _write_corpus(tmp_path)
    runs = run_distributed(_hybrid_cp_resume_by_default, 2, str(tmp_path), init_process_group=False, timeout=120)
    for full, first, second, hparams in runs:
        # Lightning counts an epoch stopped by max_steps as completed: the resumed step is the next epoch's first
        assert len(full) == 7 and [e for e, _ in full] == [0] * 6 + [1]
        assert first == full[:2] and second == full[6:]
        assert hparams["hybrid_cp"] == {
            "max_seqlen_per_rank": 16,
            "cp_size": 1,
            "cost": None,
            "ignored_keys": ["cu_seqlens", "max_seqlen", "batch_idx"],
            "check_replicas": True,
        }


def _hybrid_cp_mid_epoch_resume(rank: int, world: int, root: str) -> tuple[list[Any], dict[str, list[Any]]]:
    every_step = ModelCheckpoint(dirpath=f"{root}/ck", every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")
    full = _fit_hybrid_cp(root, callbacks=[every_step], max_epochs=2)
    resumed = {}
    for name in ("epoch=0-step=2", "epoch=0-step=6", "epoch=1-step=9"):  # mid-epoch, an epoch's last batch, mid-epoch
        resumed[name] = _fit_hybrid_cp(root, ckpt=f"{root}/ck/{name}.ckpt", max_epochs=2)
    return full, resumed


def test_hybrid_cp_text_datamodule_resumes_mid_epoch_where_training_stood(tmp_path: Path) -> None:
    """A checkpoint written mid-epoch (ModelCheckpoint(every_n_train_steps=1)) used to resume at the start of its
    epoch: the wrapper looks stateful to Lightning but saved nothing, so the first resumed steps replayed the epoch's
    first batches and its last ones were never trained. The module now saves where training stands in its epoch and
    the first pass skips what was trained: from a mid-epoch checkpoint and from an epoch's last batch, the resumed
    run's steps equal the uninterrupted run's on both ranks."""
    from tests.test_hybrid_cp_lightning import _write_corpus

    _write_corpus(tmp_path)
    runs = run_distributed(_hybrid_cp_mid_epoch_resume, 2, str(tmp_path), init_process_group=False, timeout=240)
    for full, resumed in runs:
        assert len(full) == 12 and [e for e, _ in full] == [0] * 6 + [1] * 6
        for name, done in (("epoch=0-step=2", 2), ("epoch=0-step=6", 6), ("epoch=1-step=9", 9)):
            assert resumed[name] == full[done:], name
