"""`DeepSpeedDataSampler` state in DeepSpeed's own checkpoint layout: import (resume from DeepSpeed) and export.

[Note: DeepSpeed checkpoints]
DeepSpeed saves ``checkpoint["data_sampler"] = sampler.state_dict()`` with seven keys: ``batch`` (the pending rest of
the global batch), ``consumed_samples``, ``curriculum_step``, ``current_difficulties``, ``data_cluster_paths``
(cluster file names, absolute paths in old checkpoints), ``data_cluster_current_position`` (one cursor per cluster)
and ``np_rng_state``. The cluster *files* (``{data_cluster_path}/{name}.bin/.idx``, one row: the cluster's sample ids
in the order of its current shuffled pass) are part of that state: DeepSpeed rewrites them on every reshuffle.

Import (`load_deepspeed_state`; `DeepSpeedDataSampler.load_state_dict` calls it for a state without our
``format`` key): the sampler's ``data_cluster_path`` must be the DeepSpeed run's cluster folder. Each cluster is
re-derived from its name (``cluster_{metric}{difficulty}...``) and the metric index files, and must hold exactly the
ids of the DeepSpeed file (else the files do not belong together: clear error); its current pass continues in the
file's order from the saved cursor, so the samples DeepSpeed had not yet drawn in that pass come before any repeat.
Later passes use this sampler's own permutations. ``np_rng_state`` is adopted when it is a ``PCG64`` generator state
(DeepSpeed after the #8405 fix saves ``np_rng.bit_generator.state``); DeepSpeed 0.19.8 saves the *global* legacy
``numpy.random`` state instead, which says nothing about the sampler's stream: it is ignored with a warning (the
generator restarts from the seed, as DeepSpeed itself does) and the global state is never touched. DeepSpeed's
``consumed_samples`` lags one micro-batch (spec 1.3): the import adds that micro-batch back. The schedulers' current
difficulties are set to ``current_difficulties``. What follows is the pending batch, then this sampler's draws: the
continuation is a correct curriculum run (bound, lockstep, within-pass uniqueness), not DeepSpeed's random stream
(the two samplers draw differently; see [Note: drawing] in ``_sampler.py``).

Reading a DeepSpeed checkpoint file (`read_deepspeed_sampler_state`): DeepSpeed pickles numpy values into it (the
legacy ``np_rng_state`` tuple holds an array, ids and counters may be numpy scalars). The file is read weights-only
(numpy arrays, scalars and dtypes are rebuilt from their bytes without calling anything the file names; see [Note:
what loading trusts] in ``zlightning/_safe_load.py``) and the sampler state is converted to plain Python values, so
that it also survives our own weights-only checkpoints.

Export (`deepspeed_state`): the same seven keys for the state after a given micro-batch, and one DeepSpeed cluster
file per cluster in a folder of its own (the order of the cluster's current pass), so that a DeepSpeed sampler whose
``data_cluster_path`` is that folder, or this sampler again, continues from it. Round trip export -> import is exact:
the imported sampler yields the identical sequence. A cluster still in its imported pass keeps that order in our own
state (``data_cluster_imported_order``: up to one id per sample) until the pass ends.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._index import IndexFile, write_index_file

if TYPE_CHECKING:
    from ._sampler import DeepSpeedDataSampler

__all__ = [
    "DEEPSPEED_STATE_KEYS",
    "deepspeed_state",
    "is_deepspeed_state",
    "load_deepspeed_state",
    "read_deepspeed_sampler_state",
]

log = logging.getLogger(__name__)

DEEPSPEED_STATE_KEYS = (
    "batch",
    "consumed_samples",
    "curriculum_step",
    "current_difficulties",
    "data_cluster_paths",
    "data_cluster_current_position",
    "np_rng_state",
)
"""The keys of DeepSpeed's ``DeepSpeedDataSampler.state_dict()``, in its order."""


def is_deepspeed_state(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` looks like DeepSpeed's sampler state (its keys, and not our ``format`` key)."""
    return "format" not in state and all(k in state for k in DEEPSPEED_STATE_KEYS)


def _plain(value: Any) -> Any:
    """``value`` with numpy arrays and scalars turned into Python lists and numbers (containers kept)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def read_deepspeed_sampler_state(path: str | os.PathLike[str], *, weights_only: bool | None = None) -> dict[str, Any]:
    """The sampler state (``checkpoint["data_sampler"]``) of a DeepSpeed checkpoint file, as plain Python values.

    Read without running code from the file (see [Note: DeepSpeed checkpoints]); pass the result to
    `DeepSpeedDataSampler.load_state_dict` or ``CurriculumDataModule.load_state_dict({"sampler": ...})``.

    Args:
        path: DeepSpeed's ``<save_dir>/<tag>/mp_rank_00_model_states.pt`` (or any file holding ``data_sampler``).
        weights_only: ``False`` unpickles the file in full (it can run code stored in it: trusted files only), for a
            checkpoint whose other entries need types weights-only loading refuses.

    Raises:
        UnsafeCheckpointError: the file needs full unpickling and ``weights_only`` is not ``False``.
        ValueError: the file has no sampler state in DeepSpeed's layout.
    """
    from zlightning._safe_load import load_file

    opt_in = "read_deepspeed_sampler_state(path, weights_only=False)"
    checkpoint = load_file(path, weights_only=weights_only, opt_in=opt_in)
    state = checkpoint.get("data_sampler") if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping) or not is_deepspeed_state(state):
        raise ValueError(
            f"read_deepspeed_sampler_state: {path} holds no DeepSpeed sampler state (a 'data_sampler' entry with "
            f"keys {list(DEEPSPEED_STATE_KEYS)}); DeepSpeed writes it to mp_rank_00_model_states.pt when data_efficiency.data_sampling is enabled."
        )
    return _plain(dict(state))


def parse_cluster_name(name: str, metrics: list[str]) -> dict[str, int]:
    """The difficulties encoded in a cluster file name ``cluster_{metric}{difficulty}...`` (metrics in config order).

    Raises:
        ValueError: If the name does not follow the pattern for these metrics.
    """
    pattern = "cluster" + "".join(f"_{re.escape(m)}(-?[0-9]+)" for m in metrics)
    match = re.fullmatch(pattern, name)
    if match is None:
        raise ValueError(
            f"DeepSpeedDataSampler: cluster file name {name!r} does not match 'cluster' + '_<metric><difficulty>' for "
            f"the configured metrics {metrics} (in this order); the checkpoint belongs to another curriculum config."
        )
    return {m: int(v) for m, v in zip(metrics, match.groups())}


def _err(msg: str) -> ValueError:
    return ValueError(f"DeepSpeedDataSampler.load_state_dict (DeepSpeed checkpoint): {msg}")


def _check_keys(sampler: DeepSpeedDataSampler, state: Mapping[str, Any]) -> Path:
    if not sampler.curriculum_enabled:
        raise _err("curriculum_learning is disabled in this config; DeepSpeed only saves sampler state with it on.")
    if sampler._cluster_dir is None:
        raise _err(
            "set curriculum_learning.data_cluster_path to the DeepSpeed run's cluster folder: its cluster files hold "
            "the order of each cluster's current pass."
        )
    names, positions = state["data_cluster_paths"], state["data_cluster_current_position"]
    if len(names) != len(positions):
        raise _err(f"{len(names)} data_cluster_paths but {len(positions)} data_cluster_current_position entries.")
    metrics = list(sampler.curriculum_schedulers)
    fresh = int(state["curriculum_step"]) == 0 and not state["current_difficulties"]  # saved before any batch
    if not fresh and sorted(state["current_difficulties"]) != sorted(metrics):
        raise _err(f"current_difficulties has metrics {sorted(state['current_difficulties'])}, config has {metrics}.")
    return sampler._cluster_dir


def _import_clusters(sampler: DeepSpeedDataSampler, folder: Path, state: Mapping[str, Any]) -> None:
    metrics = list(sampler.curriculum_schedulers)
    for raw, pos in zip(state["data_cluster_paths"], state["data_cluster_current_position"]):
        name = str(raw).replace("\\", "/").split("/")[-1]  # legacy checkpoints stored absolute paths
        diffs = parse_cluster_name(name, metrics)
        order = np.asarray(IndexFile(folder / name)[0], dtype=np.int64)
        members = sampler._compute_cluster(diffs)
        if order.size != members.size or not np.array_equal(np.sort(order), members):
            raise _err(
                f"cluster {name!r} in {folder} holds {order.size} ids, but the metric index files give "
                f"{members.size} samples newly eligible at {diffs}: the cluster files, the index files and the config "
                "must come from the same run."
            )
        if isinstance(pos, bool) or not 0 <= int(pos) <= order.size:
            raise _err(f"cluster {name!r}: position {pos!r} is outside [0, {order.size}].")
        cluster = sampler._add_cluster(name, diffs, members)
        cluster.first_pass, cluster.position = order, int(pos)


def _import_rng(sampler: DeepSpeedDataSampler, rng_state: Any) -> None:
    if isinstance(rng_state, Mapping) and rng_state.get("bit_generator") == "PCG64":
        sampler.np_rng.bit_generator.state = dict(rng_state)
        return
    log.warning(
        "DeepSpeedDataSampler: the DeepSpeed checkpoint's np_rng_state is the global legacy numpy RNG state "
        "(DeepSpeed <= 0.19.8, issue #8405), not the sampler's generator; sampling continues from the configured "
        "seed and the global numpy RNG is left untouched."
    )


def load_deepspeed_state(sampler: DeepSpeedDataSampler, state: Mapping[str, Any]) -> None:
    """Restores DeepSpeed's sampler state into ``sampler``. See [Note: DeepSpeed checkpoints].

    Raises:
        ValueError: If the config has no ``data_cluster_path`` or another metric set, a cluster file does not match
            the index files, or the pending batch does not fit this sampler's micro-batch layout.
        FileNotFoundError: If a cluster file named in the state is missing.
    """
    folder = _check_keys(sampler, state)
    sampler._reset_state()
    _import_clusters(sampler, folder, state)
    _import_rng(sampler, state["np_rng_state"])
    m, n = sampler.micro_batch_times_data_parallel_size, sampler.one_epoch_total_samples
    batch = np.asarray([int(i) for i in state["batch"]], dtype=np.int64)
    if batch.size % m or (batch.size and (batch.min() < 0 or batch.max() >= n)):
        raise _err(
            f"the pending batch has {batch.size} ids (range {batch.min(initial=0)}..{batch.max(initial=0)}); this "
            f"sampler needs a multiple of micro_batch_size * data_parallel_size = {m} ids in [0, {n}). Resume with "
            "the DeepSpeed run's micro-batch size and data-parallel size."
        )
    step = int(state["curriculum_step"])
    sampler.curriculum_step = step
    sampler.current_difficulties = {k: int(v) for k, v in state["current_difficulties"].items()}
    for name, d in sampler.current_difficulties.items():
        sampler.curriculum_schedulers[name].set_current_difficulty(d)
    consumed = int(state["consumed_samples"]) + (m if step > 0 else 0)  # DeepSpeed lags one micro-batch
    sampler.consumed_samples = consumed
    sampler.micro_batches = -(-consumed // m)
    sampler._batch, sampler._batch_pos = batch, 0
    sampler._restart_history()


def deepspeed_state(
    sampler: DeepSpeedDataSampler, cluster_dir: str | Path, micro_batches: int | None = None
) -> dict[str, Any]:
    """The sampler's state in DeepSpeed's layout, writing DeepSpeed cluster files under ``cluster_dir``.

    See [Note: DeepSpeed checkpoints].

    Args:
        sampler: The sampler.
        cluster_dir: Folder for the cluster files (not the sampler's own ``data_cluster_path``, whose files of the
            same names hold sorted members).
        micro_batches: As in `DeepSpeedDataSampler.state_dict`.

    Raises:
        ValueError: If the curriculum is disabled, or ``cluster_dir`` is the sampler's own cluster folder.
    """
    if not sampler.curriculum_enabled:
        raise ValueError(
            "DeepSpeedDataSampler.deepspeed_state_dict: DeepSpeed keeps no sampler state without curriculum."
        )
    folder = Path(cluster_dir)
    own = sampler._cluster_dir
    if own is not None and folder.resolve() == own.resolve():
        raise ValueError(
            f"DeepSpeedDataSampler.deepspeed_state_dict: {folder} is this sampler's own data_cluster_path; write the "
            "DeepSpeed cluster files to another folder."
        )
    mark = sampler._mark() if micro_batches is None else sampler._find_mark(micro_batches)
    d = mark.durable
    for i, name in enumerate(d.cluster_names):
        order = sampler._pass_order(i, d.cluster_pass[i])
        write_index_file(folder / name, order, [order.size], sampler.index_dtype)
    m = sampler.micro_batch_times_data_parallel_size
    return {
        "batch": mark.batch[mark.batch_pos :].tolist(),
        "consumed_samples": max(0, mark.consumed_samples - m) if mark.micro_batches > 0 else 0,
        "curriculum_step": d.curriculum_step,
        "current_difficulties": dict(d.current_difficulties),
        "data_cluster_paths": list(d.cluster_names),
        "data_cluster_current_position": list(d.cluster_position),
        "np_rng_state": copy.deepcopy(d.rng_state),
    }
