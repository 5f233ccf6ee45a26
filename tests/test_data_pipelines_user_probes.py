"""The hybrid-CP and curriculum data pipelines probed with data shapes, grids and resumes the other tests do not use.

Every test but one failed before the fix its docstring names (see the git log); the multi-rank runs of the resume
tests share one module-scoped fixture so the file stays short to run on a 2-core machine. What they cover:

* HybridCPTextDataModule resumed on another number of ranks (2 -> 1), then again from the resumed run's own
  checkpoints (mid-epoch and at the epoch's last batch); a checkpoint written after a mid-epoch validation; a
  max_seqlen_per_rank too small for a full window refused at the loader; DP2 x CP2 through Lightning equal to
  DP2 x CP1 (passed without a fix: no other test runs cp_size > 1 through the data module).
* HybridCPDataLoaderWrapper + hybrid_cp_forward_backward on a user's unpadded odd-length documents (CP size 1).
* DeepSpeedDataSampler with a custom metric and a custom schedule whose difficulty drops.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DistributedSampler
from zlightning.datamodules.curriculum import DeepSpeedDataSampler, write_metric_index
from zlightning.datamodules.hybrid_cp import (
    HybridCPConfig,
    HybridCPDataLoaderWrapper,
    HybridCPTextDataModule,
    PackedDocumentDataset,
    global_token_count,
    hybrid_cp_forward_backward,
    unpack_packed_batch,
)

from examples.gpt_model import GPT, GPTConfig
from tests.test_hybrid_cp_lightning import _loader_error, _write_corpus
from zlightning.models.gpt_hybrid_cp import HybridCPGPTModule, gpt_cp_loss
from zlightning.parallel import CPShard, HybridCPGroups
from zlightning.testing import run_distributed

# ------------------------------------------------------------------------------------------------- hybrid CP


def _hybrid_cp_datamodule(root: str, max_seqlen_per_rank: int = 32, cp_size: int = 1) -> HybridCPTextDataModule:
    # max_seqlen_per_rank = seq_len (the default): one rank can hold every piece, so the data runs on 1 or 2 ranks
    return HybridCPTextDataModule(
        hybrid_cp=HybridCPConfig(max_seqlen_per_rank=max_seqlen_per_rank, cp_size=cp_size),
        data_dir=root,
        pattern="*.txt",
        seq_len=32,
        batch_size=2,
        val_fraction=0.2,
        max_bytes=None,
        seed=5,
    )


class PieceRecorder(pl.LightningModule):
    """Records each step's sub-samples as their real tokens (padding, which depends on the world size, removed)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.seen: list[tuple[int, list[tuple[int, ...]]]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        pieces = [tuple(s.data["tokens"][s.data["loss_mask"] > 0].tolist()) for s in batch.sub_samples]
        self.seen.append((self.global_step, pieces))
        return (self.w * 0.0).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit_pieces(
    root: str, devices: int, ckpt: str | None = None, callbacks: list[Any] | None = None, max_epochs: int = 1
) -> list[Any]:
    model = PieceRecorder()
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
        max_epochs=max_epochs,
    )
    trainer.fit(model, datamodule=_hybrid_cp_datamodule(root), ckpt_path=ckpt)
    return model.seen


def _every_step(folder: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}")


def _two_rank_epoch_with_checkpoints(rank: int, world: int, root: str) -> list[Any]:
    return _fit_pieces(root, world, callbacks=[_every_step(f"{root}/ck")])


def _resume_on_one_rank(rank: int, world: int, root: str) -> dict[str, list[Any]]:
    # from the 2-rank run's step 2, then from this run's own checkpoints: mid-epoch and at the epoch's last batch
    runs = {"from two": _fit_pieces(root, world, f"{root}/ck/epoch=0-step=2.ckpt", [_every_step(f"{root}/ck1")], 2)}
    for name in ("epoch=0-step=5", "epoch=0-step=10"):
        runs[name] = _fit_pieces(root, world, f"{root}/ck1/{name}.ckpt", max_epochs=2)
    return runs


@pytest.fixture(scope="module")
def hybrid_cp_resume_on_fewer_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, list[Any], dict[str, list[Any]]]:
    root = tmp_path_factory.mktemp("hcp_resume")
    _write_corpus(root)
    two = run_distributed(_two_rank_epoch_with_checkpoints, 2, str(root), init_process_group=False, timeout=240)
    one = run_distributed(_resume_on_one_rank, 1, str(root), init_process_group=False, timeout=240)[0]
    return root, two, one


def _pieces_of_windows(root: Path, positions: slice, epoch: int = 0) -> list[Counter[tuple[int, ...]]]:
    """The real-token pieces of each 2-window micro-batch of a 1-replica epoch, at the given sampler positions."""
    dm = _hybrid_cp_datamodule(str(root))
    dm.setup("fit")
    assert dm.train_dataset is not None
    docs = PackedDocumentDataset(dm.train_dataset, 2)
    sampler = DistributedSampler(docs, num_replicas=1, rank=0, shuffle=True, seed=5, drop_last=True)
    sampler.set_epoch(epoch)
    order = list(sampler)[positions]
    batches = []
    for start in range(0, len(order) - 1, 2):  # the loader's batch_size=2, drop_last=True
        pieces: Counter[tuple[int, ...]] = Counter()
        for i in order[start : start + 2]:
            sample = docs[i]
            cu = sample["cu_seqlens"].tolist()
            for lo, hi in zip(cu[:-1], cu[1:]):
                mask = sample["loss_mask"][lo:hi] > 0
                pieces[tuple(sample["tokens"][lo:hi][mask].tolist())] += 1
        batches.append(pieces)
    return batches


def test_hybrid_cp_mid_epoch_checkpoint_resumes_on_fewer_ranks_without_retraining_samples(
    hybrid_cp_resume_on_fewer_ranks: tuple[Path, list[Any], dict[str, list[Any]]],
) -> None:
    """HybridCPTextDataModule saved how many micro-batches each rank had trained in its epoch, and a restore skipped
    that many on each rank of the new run: a checkpoint of 2 ranks at step 2 (8 windows of the epoch's permutation
    trained) resumed on 1 rank skipped 4 windows only, and trained 4 again (8 of their document pieces). The state now
    holds the epoch's global sample count, which a restore divides by its own replicas: the resumed run trains
    exactly the permutation's windows from position 8 on, micro-batch by micro-batch, then epoch 1 in full."""
    root, two, one = hybrid_cp_resume_on_fewer_ranks
    trained: Counter[tuple[int, ...]] = Counter()
    for seen in two:
        for step, pieces in seen:
            if step < 2:
                trained.update(pieces)
    assert trained == sum(_pieces_of_windows(root, slice(0, 8)), Counter())  # the 2-rank run's steps 0, 1
    expected = _pieces_of_windows(root, slice(8, None)) + _pieces_of_windows(root, slice(None), epoch=1)
    resumed = one["from two"]
    assert [step for step, _ in resumed] == list(range(2, 2 + len(expected)))
    assert [Counter(pieces) for _, pieces in resumed] == expected


def test_hybrid_cp_epoch_resumed_on_fewer_ranks_resumes_again_exactly(
    hybrid_cp_resume_on_fewer_ranks: tuple[Path, list[Any], dict[str, list[Any]]],
) -> None:
    """After a resume on another number of ranks, Lightning counts the epoch's micro-batches on from the checkpoint's
    count (2 steps of 2 ranks, counted as 2 of this rank's): the next checkpoint's sample count was short by the
    difference, so a second resume at step 5 trained 4 samples again, and the epoch's true last micro-batch (step
    10, before Lightning's count reached the epoch's length) was not its end. The module keeps the difference: both
    second resumes continue exactly as the first resumed run."""
    _, _, one = hybrid_cp_resume_on_fewer_ranks
    resumed = one["from two"]
    assert one["epoch=0-step=5"] == resumed[3:]
    assert one["epoch=0-step=10"] == resumed[8:]


def test_ranks_that_cannot_hold_a_full_window_piece_are_refused_at_the_loader(tmp_path: Path) -> None:
    """With max_seqlen_per_rank x ranks (8 x 2) below seq_len (32), the loader was built and training ran until the
    first global batch holding a document piece longer than 16 tokens (in a corpus of mostly short documents, possibly
    hours in), and the scheduler's advice named only that piece's length (raise to 12), not the 16 a full window
    needs. The loader now refuses the configuration on every rank, naming the longest piece and the fix."""
    _write_corpus(tmp_path)
    out = run_distributed(_loader_error, 2, str(tmp_path), 32, HybridCPConfig(max_seqlen_per_rank=8), timeout=120)
    for message in out:
        assert "up to 32 tokens" in message and "max_seqlen_per_rank=8" in message, message
        assert "at least 16" in message, message


class ValidatingPieceRecorder(PieceRecorder):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", (self.w * 0.0).sum(), sync_dist=True)


def _fit_with_mid_epoch_validation(rank: int, world: int, root: str, ckpt: str | None) -> list[Any]:
    model = ValidatingPieceRecorder()
    every_validation = ModelCheckpoint(dirpath=f"{root}/val_ck", save_top_k=-1, filename="{epoch}-{step}")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        logger=False,
        callbacks=[every_validation] if ckpt is None else None,
        enable_checkpointing=ckpt is None,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        val_check_interval=3,  # validates (and checkpoints) after steps 3 and 6 of the 6-step epoch
        max_epochs=1,
    )
    trainer.fit(model, datamodule=_hybrid_cp_datamodule(root), ckpt_path=ckpt)
    return model.seen


def test_hybrid_cp_checkpoint_written_after_a_mid_epoch_validation_resumes_where_the_epoch_stood(
    tmp_path: Path,
) -> None:
    """HybridCPTextDataModule saved its place in the epoch only while Lightning was training; ModelCheckpoint writes
    after a validation (val_check_interval=3 here, mid-epoch), when Lightning is validating, so the checkpoint held
    no data state and the resumed run trained steps 3-5 on the epoch's first windows (repeating them, never
    training the last ones). The state is now saved whenever the Trainer is fitting: the resumed steps equal the
    uninterrupted run's on both ranks."""
    _write_corpus(tmp_path)
    root = str(tmp_path)
    full = run_distributed(_fit_with_mid_epoch_validation, 2, root, None, init_process_group=False, timeout=240)
    ckpt = f"{root}/val_ck/epoch=0-step=3.ckpt"
    resumed = run_distributed(_fit_with_mid_epoch_validation, 2, root, ckpt, init_process_group=False, timeout=240)
    for whole, rest in zip(full, resumed):
        assert [step for step, _ in whole] == list(range(6))
        assert rest == whole[3:]


def _fit_gpt_losses(rank: int, world: int, root: str, cp_size: int) -> tuple[list[float], dict[str, Tensor]]:
    torch.manual_seed(0)
    dm = _hybrid_cp_datamodule(root, max_seqlen_per_rank=16, cp_size=cp_size)
    model = HybridCPGPTModule(GPTConfig(seq_len=32, d_model=16, n_layer=1, n_head=2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy="ddp",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        max_steps=3,
    )
    trainer.fit(model, datamodule=dm)
    return model.losses, {n: p.detach().clone() for n, p in model.model.named_parameters()}


def test_dp2_cp2_through_lightning_trains_as_dp2_cp1(tmp_path: Path) -> None:
    """HybridCPTextDataModule with cp_size=2 on 4 ranks (2 data replicas of 2 ranks, oversubscribed) under
    Trainer(strategy='ddp') reads the same packed windows as 2 ranks with cp_size=1 (pieces padded to 8 instead of
    4, the padding masked): the losses of 3 AdamW steps and the parameters after them agree on every rank."""
    _write_corpus(tmp_path)
    cp1 = run_distributed(_fit_gpt_losses, 2, str(tmp_path), 1, init_process_group=False, timeout=240)
    cp2 = run_distributed(_fit_gpt_losses, 4, str(tmp_path), 2, init_process_group=False, timeout=300)
    ref_losses, ref_params = cp1[0]
    for losses, params in cp1 + cp2:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        for name, value in ref_params.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6)


# A user's own packed documents, unpadded: odd lengths, single tokens; every one fits a rank (CP size 1)
ODD_CFG = GPTConfig(vocab_size=13, seq_len=16, d_model=16, n_layer=1, n_head=2)
ODD_LENGTHS = [[[3, 1, 5], [7, 2]], [[1, 1, 9], [4]], [[15], [3, 3, 1]]]  # per step: replica 0's samples, then 1's


def _odd_batch(replica: int, step: int) -> list[dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(100 * step + replica)
    lengths = ODD_LENGTHS[step][replica]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    return [
        {
            "cu_seqlens": cu,
            "tokens": torch.randint(0, ODD_CFG.vocab_size, (total,), generator=gen),
            "labels": torch.randint(0, ODD_CFG.vocab_size, (total,), generator=gen),
        }
    ]


def _odd_training(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(ODD_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    groups = HybridCPGroups.build()
    batches = [_odd_batch(rank, step) for step in range(len(ODD_LENGTHS))]
    losses, cp_sizes = [], set()
    for batch in HybridCPDataLoaderWrapper(batches, HybridCPConfig(max_seqlen_per_rank=16)):
        num = global_token_count(batch, rank)

        def loss_fn(data: dict[str, Tensor], shard: CPShard) -> Tensor:
            return gpt_cp_loss(model, data["tokens"], data["labels"], shard, num_tokens=num)

        total = hybrid_cp_forward_backward(batch, groups, loss_fn)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        dist.all_reduce(total)
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
        cp_sizes |= {s.cp_size for s in batch.sub_samples}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}, "cp": cp_sizes}


def _odd_reference() -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(ODD_CFG)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for step in range(len(ODD_LENGTHS)):
        subs = [s for d in range(2) for s in unpack_packed_batch(_odd_batch(d, step))]
        num = sum(s["tokens"].numel() for s in subs)
        loss = sum(F.cross_entropy(model(s["tokens"][None])[0][0], s["labels"], reduction="sum") / num for s in subs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def test_unpadded_odd_length_documents_train_at_cp_size_one_as_one_process() -> None:
    """A sub-sample the scheduler runs on one rank (CP size 1) still went through the zigzag split, which needs its
    length divisible by 2: a user's own unpadded documents (3 tokens, 1 token) failed in hybrid_cp_forward_backward
    ('cannot be cut into 2 * cp_size = 2 equal chunks') although no rank shares them. At CP size 1 the shard is now
    the whole sub-sample: 2 gloo ranks train on odd-length documents exactly as one process on the global batches
    (losses and parameters after 3 SGD steps, fp32 rtol 1e-5)."""
    runs = run_distributed(_odd_training, 2, timeout=120)
    ref = _odd_reference()
    for run in runs:
        assert run["cp"] == {1}
        torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-7)
        for name, value in ref["params"].items():
            torch.testing.assert_close(run["params"][name], value, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ curriculum


def _decreasing_schedule_config(root: Path, clustering: str) -> dict[str, Any]:
    write_metric_index(root / "m", "m", np.arange(20) % 10)  # a user's own metric: ties, values 0..9
    metric = {
        "index_to_sample_path": str(root / "m" / "m_index_to_sample"),
        "index_to_metric_path": str(root / "m" / "m_index_to_metric"),
        "difficulty_type": "value",
        "clustering_type": clustering,
        "min_difficulty": 0,
        "max_difficulty": 9,
        "schedule_type": "custom",
    }
    curriculum = {"enabled": True, "data_cluster_path": None, "curriculum_metrics": {"m": metric}}
    sampling = {"enabled": True, "num_epochs": 1, "curriculum_learning": curriculum}
    return {"data_efficiency": {"enabled": True, "seed": 3, "data_sampling": sampling}}


def test_a_difficulty_that_drops_warns_that_the_bound_no_longer_holds(tmp_path: Path) -> None:
    """A custom schedule whose difficulty drops (8 for two steps, then 1) keeps drawing samples of metric up to 8 at
    difficulty 1 (clusters only grow, as in DeepSpeed, and test_curriculum_sampler keeps that behaviour), against the
    README's bound, and said nothing. The sampler now warns at the step the difficulty drops, naming the metric, the
    values and the fix; a single_cluster metric (no bound) shrinks silently."""
    values = np.arange(20) % 10
    sampler = DeepSpeedDataSampler(_decreasing_schedule_config(tmp_path, "schedule_based"), 20, 2)
    sampler.set_custom_curriculum_learning_schedule({"m": lambda step: 8 if step < 3 else 1})
    with pytest.warns(UserWarning, match="'m' drops from 8 to 1 at curriculum_step 3 .*non-decreasing") as caught:
        tops = [max(int(values[i]) for i in micro_batch) for micro_batch in sampler]
    assert len(caught) == 1 and len(tops) == 10 and max(tops[2:]) > 1  # DeepSpeed's semantics, now announced
    single = DeepSpeedDataSampler(_decreasing_schedule_config(tmp_path, "single_cluster"), 20, 2)
    single.set_custom_curriculum_learning_schedule({"m": lambda step: 8 if step < 3 else 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(single)) == 10 and single.current_difficulties == {"m": 1}


def test_a_sub_sample_no_block_can_split_is_refused_on_every_rank() -> None:
    """See [Note: every rank refuses a sub-sample no block can split]: ranks 0-1 run a 3-token sub-sample as a CP-2
    block (3 is not a multiple of 4), rank 2 runs a sub-sample of its own. Rank 2 used to go on into its own work
    (and, in a real run, meet a peer's dropped connection); it now raises the reason before anything runs."""
    from zlightning.datamodules.hybrid_cp._wrapper import HybridCPBatch, HybridCPSubSample

    schedule = [[[0], [0], [1], [2]]]
    mine = HybridCPSubSample(
        gid=1, group=0, cp_size=1, block_start=2, data={"tokens": torch.zeros(4, dtype=torch.long)}
    )
    batch = HybridCPBatch(sub_samples=[mine], schedule=schedule, seqlens=[3, 4, 4])
    called = []

    class _Rank2:
        rank = 2

    with pytest.raises(ValueError, match=r"sub-sample 0 \(3 tokens\) runs on 2 ranks .* multiple of 2 x 4 = 8"):
        hybrid_cp_forward_backward(batch, _Rank2(), lambda data, shard: called.append(1))  # type: ignore[arg-type]
    assert not called
