"""The DataModule option for hybrid CP: the real corpus's documents, packed, fed through `HybridCPDataLoaderWrapper`.

`HybridCPTextDataModule` is `TextCorpusDataModule` (same corpus, split and packing) whose training loader yields
`HybridCPBatch` objects: each DP replica reads its packed samples, every document piece inside a sample becomes one
sub-sample (`PackedDocumentDataset`), and the wrapper balances and reroutes them over the DP×CP ranks. Validation,
test and predict loaders are the parent's plain ``(x, y)`` batches (a model evaluates them with its ordinary forward).

[Note: padding document pieces]
The zigzag split cuts a sub-sample into ``2 * cp`` equal chunks, so every sub-sample length must be a multiple of
``2 * cp`` for the largest CP size it may get (Megatron asks the dataset for multiples of ``2 * DP * CP``). Each
document piece is therefore padded at its end to a multiple of ``pad_multiple`` (default ``2 * `` the DP×CP size,
which covers every CP size the scheduler can choose) with token 0 and ``loss_mask`` 0: the padding sits after the
real tokens, so causal attention never lets a real token see it, and it carries no loss. A packed sample thus holds
``seq_len`` real tokens plus padding, and ``cu_seqlens`` marks the padded pieces.

[Note: epochs and resume]
The training loader's ``DistributedSampler`` sits behind the wrapper, where Lightning's ``set_epoch`` call does not
reach it, so the loader sets the epoch itself at each pass, to the Trainer's ``current_epoch`` (a count of passes
from 0 in each process replays epoch 0's order after a resume). And the wrapper looks stateful to
Lightning (it has ``state_dict``), so Lightning does not warn that a mid-epoch resume restarts the epoch: the module
saves where training stands (Lightning epoch, micro-batches processed in it, whether that was all of them, read from
the fit loop's counters when the checkpoint is written; the loader runs ahead, so its own count would be too high),
and the first pass after a restore skips those micro-batches' samples in the sampler's order (no sample is loaded for
them), or starts the next epoch if the saved one was complete: Lightning creates that pass's iterator before it
moves its epoch counter on. If Lightning is already in another epoch (a run stopped by ``max_steps`` counts its
epoch as completed), the pass starts that epoch.

[Note: resuming on another number of ranks]
A ``DistributedSampler`` over ``R`` replicas deals one permutation of the dataset (seeded by seed and epoch, whatever
``R``) round-robin: replica ``r``'s ``j``-th sample is position ``r + j * R``. After every replica trained ``k``
samples, positions ``[0, k * R)`` are trained, nothing else. The state therefore records that global count ``S``
(micro-batches x ``batch_size`` x replicas), and a restore on ``R'`` replicas skips ``S / R'`` samples on each:
counting the checkpoint's micro-batches per replica instead would retrain (fewer replicas) or skip (more) samples
of the epoch. Lightning goes on counting the resumed epoch's micro-batches from the checkpoint's count, so the
module keeps the difference to the true count for the rest of that epoch (a second resume stays exact, and the
epoch's last micro-batch still counts as its end). When ``R'`` does not divide ``S`` the skip rounds down: fewer
than ``R'`` samples are trained again, with a warning.

[Note: data-only hyper-parameters]
Lightning writes the data module's hyper-parameters into every checkpoint and, since 2.6, loads checkpoints with
``torch.load(weights_only=True)``, which refuses any class it does not know. With the `HybridCPConfig` object in
them, a checkpoint of Lightning's own strategies (``ddp``) could not be resumed by ``trainer.fit(ckpt_path=...)``
without ``weights_only=False`` (zlightning's strategies describe such values themselves). The hyper-parameters
therefore hold the config as a plain dict (a custom ``cost`` as its ``repr``); the module itself keeps the object.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
from typing_extensions import override

from ..text import PackedByteDataset, TextCorpusDataModule
from ._wrapper import HybridCPConfig, HybridCPDataLoaderWrapper

__all__ = ["HybridCPTextDataModule", "PackedDocumentDataset"]


class PackedDocumentDataset(Dataset[dict[str, Tensor]]):
    """A `PackedByteDataset` whose samples are split at document boundaries into padded sub-samples.

    Sample ``i`` is a dict with ``tokens`` and ``labels`` (int64, the parent's ``x`` and ``y`` pieces, padded),
    ``loss_mask`` (float32, 1 on real tokens) and ``cu_seqlens`` (int64, the padded pieces' offsets). See
    [Note: padding document pieces].

    Args:
        packed: The packed byte stream (e.g. ``TextCorpusDataModule.train_dataset``).
        pad_multiple: Every piece is padded to a multiple of this (``>= 1``).

    Raises:
        ValueError: If ``pad_multiple < 1``.
    """

    packed: PackedByteDataset
    pad_multiple: int

    def __init__(self, packed: PackedByteDataset, pad_multiple: int) -> None:
        if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"PackedDocumentDataset: pad_multiple must be a positive int, got {pad_multiple!r}.")
        self.packed = packed
        self.pad_multiple = pad_multiple

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        x, y = self.packed[index]
        cu = self.packed.cu_seqlens(index).tolist()
        tokens, labels, mask, offsets = [], [], [], [0]
        for lo, hi in zip(cu[:-1], cu[1:]):
            pad = -(hi - lo) % self.pad_multiple
            tokens += [x[lo:hi], x.new_zeros(pad)]
            labels += [y[lo:hi], y.new_zeros(pad)]
            mask += [torch.ones(hi - lo), torch.zeros(pad)]
            offsets.append(offsets[-1] + hi - lo + pad)
        return {
            "tokens": torch.cat(tokens),
            "labels": torch.cat(labels),
            "loss_mask": torch.cat(mask),
            "cu_seqlens": torch.tensor(offsets, dtype=torch.int64),
        }

    def max_piece_length(self) -> int:
        """The longest padded piece a sample can hold: ``seq_len`` rounded up to ``pad_multiple``."""
        return math.ceil(self.packed.seq_len / self.pad_multiple) * self.pad_multiple


def _describe(config: HybridCPConfig) -> dict[str, Any]:
    """``config`` as plain data for the hyper-parameters (see [Note: data-only hyper-parameters])."""
    return {
        "max_seqlen_per_rank": config.max_seqlen_per_rank,
        "cp_size": config.cp_size,
        "cost": None if config.cost is None else repr(config.cost),
        "ignored_keys": list(config.ignored_keys),
        "check_replicas": config.check_replicas,
    }


def _as_list(samples: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
    """Collate: a batch is the list of packed samples (the wrapper unpacks each)."""
    return samples


class _SkippingSampler(Sampler[int]):
    """A ``DistributedSampler``'s indices from position ``skip`` on; its length stays the whole epoch's."""

    def __init__(self, inner: DistributedSampler[Any]) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner)


class _EpochLoader:
    """Iterates a ``DataLoader`` over a ``DistributedSampler``, setting the epoch (and skipping trained
    micro-batches) on every pass. See [Note: epochs and resume].

    ``start()`` gives the pass's epoch and the samples of it to skip on this replica; a None epoch (no Trainer):
    passes are counted.
    """

    def __init__(
        self,
        loader: DataLoader[Any],
        sampler: DistributedSampler[Any],
        skipping: _SkippingSampler,
        start: Callable[[], tuple[int | None, int]],
    ) -> None:
        self.loader = loader
        self.sampler = sampler
        self.skipping = skipping
        self.start = start
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self.start()
        epoch = self.epoch if epoch is None else epoch
        self.sampler.set_epoch(epoch)
        self.skipping.skip = skip
        self.epoch = epoch + 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class HybridCPTextDataModule(TextCorpusDataModule):
    """`TextCorpusDataModule` whose training batches are hybrid-CP sub-samples of whole document pieces.

    Each training step every rank of the DP×CP domain receives a `HybridCPBatch`: the sub-samples (document pieces
    with ``tokens``, ``labels``, ``loss_mask``) it runs, each with its CP size and block. ``batch_size`` packed samples
    of ``seq_len`` real tokens are read per data replica per step. Use it with a module that consumes `HybridCPBatch`
    (``examples/gpt_hybrid_cp.py``); train with ``max_seqlen_per_rank`` below ``seq_len`` to get CP sizes above 1.

    Args:
        hybrid_cp: The wrapper's `HybridCPConfig` (``max_seqlen_per_rank``, ``cp_size`` ranks per data replica, cost).
        pad_multiple: Pad every document piece to a multiple of this; None: ``2 * `` the DP×CP size. See
            [Note: padding document pieces].
        **kwargs: `TextCorpusDataModule`'s arguments (``data_dir``, ``pattern``, ``seq_len``, ``batch_size``, ...).

    Raises:
        TypeError: If ``hybrid_cp`` is not a `HybridCPConfig`.
        ValueError: As `TextCorpusDataModule`, or for ``pad_multiple < 1``.
    """

    hybrid_cp: HybridCPConfig
    pad_multiple: int | None

    def __init__(self, *, hybrid_cp: HybridCPConfig, pad_multiple: int | None = None, **kwargs: Any) -> None:
        if not isinstance(hybrid_cp, HybridCPConfig):
            raise TypeError(
                f"HybridCPTextDataModule: hybrid_cp must be a HybridCPConfig, got {type(hybrid_cp).__name__}."
            )
        if pad_multiple is not None and (
            isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1
        ):
            raise ValueError(
                f"HybridCPTextDataModule: pad_multiple must be None or a positive int, got {pad_multiple!r}."
            )
        super().__init__(**kwargs)
        self.hybrid_cp = hybrid_cp
        self.pad_multiple = pad_multiple
        self.hparams["hybrid_cp"] = _describe(hybrid_cp)  # See [Note: data-only hyper-parameters].
        self._resume: tuple[int, int, bool, int | None] | None = None  # See [Note: epochs and resume].
        self._replicas: int | None = None  # data replicas of the running loader (world size // cp_size)
        self._epoch_samples = 0  # samples one epoch trains over all replicas
        self._offset: tuple[int, int] | None = None  # (epoch, true samples - Lightning's count x batch x replicas)

    @override
    def train_dataloader(self) -> HybridCPDataLoaderWrapper:  # type: ignore[override]
        """The wrapper over this replica's shuffled packed samples; needs torch.distributed initialised.

        Raises:
            RuntimeError: If torch.distributed is not initialised or ``setup`` has not run.
            ValueError: If the world size is not a multiple of ``hybrid_cp.cp_size``, or the ranks together cannot
                hold a full-window document piece (``max_seqlen_per_rank`` x world size below the padded
                ``seq_len``).
        """
        dataset = self._require(self.train_dataset, "train_dataloader")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "HybridCPTextDataModule.train_dataloader: torch.distributed is not initialised. Train through a "
                "distributed strategy (Trainer(strategy='ddp' or 'zstack_zero3', devices=N)), or call "
                "init_process_group yourself (a 1-rank gloo group works) before asking for the loader."
            )
        world, rank, cp = dist.get_world_size(), dist.get_rank(), self.hybrid_cp.cp_size
        if world % cp:
            raise ValueError(
                f"HybridCPTextDataModule: {world} ranks cannot be cut into data replicas of "
                f"hybrid_cp.cp_size={cp} ranks; choose a cp_size that divides the world size."
            )
        multiple = self.pad_multiple or 2 * world
        if self.config.seq_len % multiple:
            raise ValueError(
                f"HybridCPTextDataModule: seq_len={self.config.seq_len} is not a multiple of {multiple} (every piece "
                + (
                    "is padded to a multiple of pad_multiple"
                    if self.pad_multiple
                    else f"is padded to a multiple of 2 x {world} ranks for the zigzag split"
                )
                + f"), so a piece of a full window would be padded past the model's {self.config.seq_len} positions; "
                f"choose seq_len a multiple of {multiple}"
            )
        docs = PackedDocumentDataset(dataset, multiple)
        longest, capacity = docs.max_piece_length(), self.hybrid_cp.max_seqlen_per_rank * world
        if longest > capacity:  # the scheduler would refuse the first batch holding such a piece, possibly much later
            raise ValueError(
                f"HybridCPTextDataModule: a document piece can hold up to {longest} tokens (seq_len="
                f"{self.config.seq_len}, padded to a multiple of {multiple}), but the {world} ranks hold at most "
                f"{capacity} at hybrid_cp.max_seqlen_per_rank={self.hybrid_cp.max_seqlen_per_rank}; raise "
                f"max_seqlen_per_rank to at least {-(-longest // world)}, use more ranks, or lower seq_len."
            )
        self._replicas = world // cp
        sampler: DistributedSampler[Any] = DistributedSampler(
            docs, num_replicas=world // cp, rank=rank // cp, shuffle=True, seed=self.config.seed, drop_last=True
        )
        skipping = _SkippingSampler(sampler)
        loader = DataLoader(
            docs,
            batch_size=self.config.batch_size,
            sampler=skipping,
            drop_last=True,
            collate_fn=_as_list,
            num_workers=self.config.num_workers,
        )
        self._epoch_samples = len(loader) * self.config.batch_size * self._replicas
        return HybridCPDataLoaderWrapper(_EpochLoader(loader, sampler, skipping, self._epoch_start), self.hybrid_cp)

    def _epoch_start(self) -> tuple[int | None, int]:
        """The epoch of the loader's next pass and the samples of it this replica already trained. See [Note: epochs
        and resume] and [Note: resuming on another number of ranks]."""
        trainer = self.trainer
        if trainer is None:
            return None, 0
        resume, self._resume = self._resume, None
        if resume is not None:
            epoch, batches, done, samples = resume
            if done:
                return epoch + 1, 0
            if trainer.current_epoch == epoch:
                skip = self._replica_skip(batches, samples)
                # Lightning goes on counting from the restored micro-batches, in this run's units
                self._offset = (epoch, (skip - batches * self.config.batch_size) * (self._replicas or 1))
                return epoch, skip
        return int(trainer.current_epoch), 0

    def _replica_skip(self, batches: int, samples: int | None) -> int:
        """Samples of the epoch each replica skips: the saved global count over this run's replicas (a state without
        it, written before it was saved, counts micro-batches on the same number of replicas)."""
        replicas = self._replicas or 1
        if samples is None:
            return batches * self.config.batch_size
        if samples % replicas:
            rank_zero_warn(
                f"HybridCPTextDataModule: the checkpoint's epoch had {samples} samples trained, which {replicas} data "
                f"replicas cannot split evenly; each skips {samples // replicas}, so {samples % replicas} of them are "
                f"trained again. Resume on a number of replicas that divides {samples} to avoid it."
            )
        return samples // replicas

    @override
    def state_dict(self) -> dict[str, Any]:
        """Where training stands in its epoch: see [Note: epochs and resume]."""
        trainer = self.trainer
        # while the fit runs, not only while it trains: a checkpoint written after a mid-epoch validation
        # (val_check_interval) must still say where the epoch stands
        if trainer is None or trainer.state.status != TrainerStatus.RUNNING or trainer.state.fn != TrainerFn.FITTING:
            return {}
        current = trainer.fit_loop.epoch_loop.batch_progress.current  # a _ProcessedTracker (typed as its base)
        batches = int(current.processed)  # type: ignore[attr-defined]
        done = batches >= trainer.num_training_batches
        replicas = self._replicas or dist.get_world_size() // self.hybrid_cp.cp_size
        samples = batches * self.config.batch_size * replicas  # See [Note: resuming on another number of ranks].
        if self._offset is not None and self._offset[0] == trainer.current_epoch:
            samples += self._offset[1]  # a resumed epoch: Lightning's count started from the checkpoint's
            done = done or samples >= self._epoch_samples
        return {"epoch": int(trainer.current_epoch), "batches": batches, "done": bool(done), "samples": samples}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict` output; applied when the training loader's next pass starts."""
        if state_dict:
            samples = state_dict.get("samples")
            self._resume = (
                int(state_dict["epoch"]),
                int(state_dict["batches"]),
                bool(state_dict["done"]),
                None if samples is None else int(samples),
            )
