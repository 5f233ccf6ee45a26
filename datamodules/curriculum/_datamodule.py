"""`CurriculumDataModule`: `DeepSpeedDataSampler` as the batch sampler of a Lightning training run.

[Note: what the module reads from the Trainer]
When the Trainer asks for the train loader, the module builds the sampler with: the micro-batch size (argument, or
the wrapped data module's ``batch_size``), ``trainer.accumulate_grad_batches`` as gradient accumulation, and the
data-parallel rank/size from ``trainer.distributed_sampler_kwargs`` (the strategy's DP mesh axis for model-parallel
strategies; rank 0 of 1 without a distributed strategy). The loader is returned wrapped in a plain iterable so that
Lightning does not inject a ``DistributedSampler`` (the sampler already slices by DP rank).

[Note: consumed, not prefetched]
Lightning fetches a batch ahead, and loader workers fetch more, so the sampler runs ahead of training. The module
counts the micro-batches that training really consumed (``on_before_batch_transfer`` while training), and
`state_dict` saves the sampler's state right after that many (`DeepSpeedDataSampler.state_dict(micro_batches=k)`):
resuming from the checkpoint continues with exactly the next micro-batch the run would have trained on. The
sequence-length truncation and the logged difficulty use the difficulties of that consumed micro-batch, too.

[Note: Lightning epochs]
Without curriculum the sampler yields one epoch (a permutation of the dataset) per iteration, and a new iterator
continues the epoch where training stopped (a resume, or an iterator Lightning made and dropped). But Lightning may
end an epoch early (``limit_train_batches``): the next Lightning epoch must then start the sampler's next epoch, as a
shuffled ``DataLoader`` or ``DistributedSampler.set_epoch`` would, not hand out the rest of this one (which made every
second Lightning epoch short). So the module records, for the last micro-batch training consumed, its Lightning
epoch and whether it was that epoch's last one (``trainer.num_training_batches`` consumed in it), saved in
`state_dict`; a loader iterator created after an epoch's last micro-batch first ends the sampler's epoch
(`DeepSpeedDataSampler.end_epoch`). The test is "the epoch's batches were all consumed", not "Lightning's epoch
counter moved on": on resume from a checkpoint written at an epoch's last batch, Lightning creates (and prefetches
from) the iterator before it moves its counter on, then keeps that iterator for the next epoch; and a run stopped
mid-epoch by ``max_steps`` counts its epoch as completed, so the resumed run is in the next Lightning epoch but must
go on with the rest of the sampler's one (the batches the uninterrupted run would train on). With curriculum the
sampler is one stream for the whole run, across epochs, but Lightning ends every epoch with an optimizer step, also
after fewer than ``accumulate_grad_batches`` micro-batches: ending the epoch there drops the rest of the sampler's
global batch, so the next epoch starts a new curriculum step and every optimizer step trains on one global batch at
one difficulty (before, with ``limit_train_batches=3`` and ``accumulate_grad_batches=2``, later steps mixed two).

[Note: sequence-length curriculum]
A metric named ``seqlen_truncate`` (DeepSpeed's name; normally ``clustering_type: single_cluster``, so it needs no
index files) truncates every tensor of the batch with two or more dimensions to its current difficulty along
dimension 1 (``x[:, :d]``), so a language model sees short sequences first. Metric ``seqlen`` and friends still
select samples as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from typing_extensions import override

from ._config import DataEfficiencyConfig
from ._sampler import DeepSpeedDataSampler, _consumed_samples_at, _starts_global_batch

__all__ = ["CurriculumDataModule"]

SEQLEN_TRUNCATE = "seqlen_truncate"
"""The metric name that truncates batches. See [Note: sequence-length curriculum]."""


class _SamplerLoader:
    """A DataLoader behind a plain iterable (see [Note: what the module reads from the Trainer]).

    Each new iterator first rewinds the sampler to the last micro-batch training consumed: an iterator that
    prefetched and was then dropped (Lightning creates and discards some) must not skip samples.
    """

    def __init__(self, loader: DataLoader[Any], module: CurriculumDataModule) -> None:
        self.loader = loader
        self.module = module

    def __iter__(self) -> Iterator[Any]:
        sampler = self.module.sampler
        if sampler is not None and sampler.micro_batches != self.module._consumed:
            sampler.rewind(self.module._consumed)
        trainer, (epoch, _, done) = self.module.trainer, self.module._epoch_consumed
        if sampler is None or trainer is None or not trainer.training or epoch is None:
            return iter(self.loader)
        if done:  # See [Note: Lightning epochs].
            sampler.end_epoch()
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class CurriculumDataModule(LightningDataModule):
    """Curriculum-ordered training batches from any map-style dataset plus its metric index files.

    Args:
        data_efficiency: DeepSpeed's ``data_efficiency`` dict (or a `DataEfficiencyConfig`); see `DeepSpeedDataSampler`.
        base: A data module providing the datasets: after ``base.setup(stage)`` its ``train_dataset`` is sampled and
            its ``val_dataloader()`` used for validation (e.g. `TextCorpusDataModule`).
        dataset: Alternatively, the training dataset itself.
        val_dataset: Validation dataset when ``dataset`` is given (None: no validation loader).
        micro_batch_size: Samples per micro-batch per rank; None reads ``base.config.batch_size`` / ``base.batch_size``.
        collate_fn: DataLoader collate function.
        drop_last: Drop a final partial micro-batch.
        custom_schedules: The functions of metrics with ``schedule_type: custom``, by metric name: each maps the
            1-based curriculum step to a difficulty (DeepSpeed's ``set_custom_curriculum_learning_schedule``).

    Raises:
        ValueError: If neither or both of ``base`` and ``dataset`` are given, or the config is invalid.
    """

    config: DataEfficiencyConfig
    sampler: DeepSpeedDataSampler | None

    def __init__(
        self,
        data_efficiency: dict[str, Any] | DataEfficiencyConfig,
        base: LightningDataModule | None = None,
        dataset: Dataset[Any] | None = None,
        val_dataset: Dataset[Any] | None = None,
        micro_batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = True,
        custom_schedules: Mapping[str, Callable[[int], int]] | None = None,
    ) -> None:
        super().__init__()
        if (base is None) == (dataset is None):
            raise ValueError("CurriculumDataModule: pass exactly one of `base` (a data module) or `dataset`.")
        if isinstance(data_efficiency, DataEfficiencyConfig):
            self.config = data_efficiency
        else:
            self.config = DataEfficiencyConfig.from_dict(data_efficiency)
        self.base, self.dataset, self.val_dataset = base, dataset, val_dataset
        self._micro_batch_size = micro_batch_size
        self.collate_fn, self.drop_last = collate_fn, drop_last
        self.custom_schedules = dict(custom_schedules or {})
        self.sampler = None
        self._pending_state: dict[str, Any] | None = None
        self._consumed = 0
        # (Lightning epoch, micro-batches consumed in it, whether that was all of it): see [Note: Lightning epochs]
        self._epoch_consumed: tuple[int | None, int, bool] = (None, 0, False)

    @override
    def setup(self, stage: str) -> None:
        if self.base is not None:
            self.base.setup(stage)

    @property
    def train_dataset(self) -> Dataset[Any]:
        """The dataset the sampler draws from."""
        ds = self.dataset if self.base is None else getattr(self.base, "train_dataset", None)
        if ds is None:
            raise RuntimeError("CurriculumDataModule: no training dataset; call setup('fit') first.")
        return ds

    @property
    def micro_batch_size(self) -> int:
        """The micro-batch size (argument, else the base module's ``config.batch_size`` or ``batch_size``)."""
        if self._micro_batch_size is not None:
            return self._micro_batch_size
        for holder in (getattr(self.base, "config", None), self.base):
            size = getattr(holder, "batch_size", None)
            if isinstance(size, int):
                return size
        raise ValueError("CurriculumDataModule: pass micro_batch_size (the base data module has no batch_size).")

    def build_sampler(self, dp_rank: int = 0, dp_size: int = 1, grad_accum: int = 1) -> DeepSpeedDataSampler:
        """Builds the sampler (restoring a loaded checkpoint state) for the given data-parallel layout."""
        sampler = DeepSpeedDataSampler(
            self.config,
            len(self.train_dataset),  # type: ignore[arg-type]
            self.micro_batch_size,
            data_parallel_rank=dp_rank,
            data_parallel_size=dp_size,
            gradient_accumulation_steps=grad_accum,
            drop_last=self.drop_last,
        )
        if self.custom_schedules:
            sampler.set_custom_curriculum_learning_schedule(self.custom_schedules)
        if self._pending_state is not None:
            sampler.load_state_dict(self._pending_state)
            self._pending_state = None
        self._consumed = sampler.micro_batches
        return sampler

    @override
    def train_dataloader(self) -> Any:
        """The curriculum loader. See [Note: what the module reads from the Trainer]."""
        if self.sampler is None:
            rank, size, accum = 0, 1, 1
            trainer = self.trainer
            if trainer is not None:
                kwargs = trainer.distributed_sampler_kwargs or {}
                rank, size = int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1))
                accum = int(trainer.accumulate_grad_batches)
            self.sampler = self.build_sampler(rank, size, accum)
        ds = self.config.data_sampling
        loader = DataLoader(
            self.train_dataset,
            batch_sampler=self.sampler,
            num_workers=ds.num_workers,
            pin_memory=ds.pin_memory,
            collate_fn=self.collate_fn,
            persistent_workers=False,
        )
        return _SamplerLoader(loader, self)

    @override
    def val_dataloader(self) -> Any:
        if self.base is not None:
            return self.base.val_dataloader()
        if self.val_dataset is None:
            return []
        return DataLoader(self.val_dataset, batch_size=self.micro_batch_size, collate_fn=self.collate_fn)

    @override
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        batch = self._curriculum_batch(batch)
        # Lightning calls this data module's hook instead of the LightningModule's: call the user's one too
        trainer = self.trainer
        module = trainer.lightning_module if trainer is not None else None
        if module is not None and is_overridden("on_before_batch_transfer", module):
            batch = module.on_before_batch_transfer(batch, dataloader_idx)
        return batch

    def _curriculum_batch(self, batch: Any) -> Any:
        trainer = self.trainer
        if self.sampler is None or trainer is None or not trainer.training:
            return batch
        self._consumed += 1  # See [Note: consumed, not prefetched].
        epoch, batches, _ = self._epoch_consumed
        batches = batches + 1 if epoch == trainer.current_epoch else 1
        self._epoch_consumed = (trainer.current_epoch, batches, batches >= trainer.num_training_batches)
        if not self.sampler.curriculum_enabled:
            return batch
        diffs = self.sampler.difficulties_at(self._consumed)
        self._log(trainer, diffs)
        if SEQLEN_TRUNCATE in diffs:
            d = diffs[SEQLEN_TRUNCATE]
            batch = apply_to_collection(batch, Tensor, lambda t: t[:, :d] if t.dim() >= 2 else t)
        return batch

    def _log(self, trainer: Any, diffs: dict[str, int]) -> None:
        first_of_step = _starts_global_batch(self.sampler, self._consumed)  # type: ignore[arg-type]
        if not trainer.loggers or not first_of_step or trainer.global_step % max(1, trainer.log_every_n_steps):
            return
        metrics: dict[str, float] = {f"curriculum/{name}": float(d) for name, d in diffs.items()}
        metrics["curriculum/consumed_samples"] = float(_consumed_samples_at(self.sampler, self._consumed))  # type: ignore[arg-type]
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The sampler's state after the last micro-batch training consumed (see [Note: consumed, not prefetched])."""
        epoch = {"lightning_epoch": list(self._epoch_consumed)}  # See [Note: Lightning epochs].
        if self.sampler is not None:
            return {"sampler": self.sampler.state_dict(micro_batches=self._consumed)} | epoch
        return ({"sampler": self._pending_state} | epoch) if self._pending_state is not None else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores `state_dict` output (applied when the sampler is built, or at once if it exists)."""
        state = state_dict.get("sampler")
        if state is None:
            return
        epoch, batches, done = state_dict.get("lightning_epoch", (None, 0, False))
        self._epoch_consumed = (epoch, int(batches), bool(done))
        if self.sampler is None:
            self._pending_state = state
        else:
            self.sampler.load_state_dict(state)
            self._consumed = self.sampler.micro_batches
