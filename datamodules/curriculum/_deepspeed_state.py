"""`DeepSpeedDataSampler` state in DeepSpeed's checkpoint layout: a translation to and from the sampler's own.

[Note: DeepSpeed checkpoints]
DeepSpeed saves ``checkpoint["data_sampler"] = sampler.state_dict()`` with seven keys: ``batch`` (the pending rest of
the global batch), ``consumed_samples``, ``curriculum_step``, ``current_difficulties``, ``data_cluster_paths``
(cluster file names, absolute paths in old checkpoints), ``data_cluster_current_position`` (one cursor per cluster)
and ``np_rng_state``. The cluster *files* (``{data_cluster_path}/{name}.bin/.idx``, one row: the cluster's sample ids
in the order of its current shuffled pass) are part of that state: DeepSpeed rewrites them on every reshuffle.

This module only translates between that layout and the one of `DeepSpeedDataSampler.state_dict` (tagged
`STATE_FORMAT`); the sampler's ``load_state_dict`` does the loading, whichever layout it is given.

Import (`deepspeed_to_state`; ``DeepSpeedDataSampler.load_state_dict`` calls it for a state without our ``format``
key): the config's ``data_cluster_path`` must be the DeepSpeed run's cluster folder. Each cluster's difficulties come
from its name (``cluster_{metric}{difficulty}...``) and the order of its current pass from its file; the translated
state carries that order (``data_cluster_imported_order``) with the pass number 0 and the saved cursor, so the
samples DeepSpeed had not yet drawn in that pass come before any repeat. Loading then rebuilds each cluster from the
metric index files and checks that the file holds exactly its members (else the files do not belong together: clear
error). Later passes use this sampler's own permutations. ``np_rng_state`` is adopted when it is a ``PCG64``
generator state (DeepSpeed after its fix of issue #8405 saves ``np_rng.bit_generator.state``); DeepSpeed 0.19.8 saves
the *global* legacy ``numpy.random`` state instead, which says nothing about the sampler's stream: it is replaced,
with a warning, by the generator's state at the seed (as DeepSpeed itself restarts it), and the global state is never
touched. DeepSpeed's ``consumed_samples`` lags one micro-batch (DeepSpeed counts the micro-batch being yielded only
at the next one): the import adds that micro-batch back. The schedulers' current difficulties are set to
``current_difficulties``. What follows is the pending batch, then this sampler's draws: the continuation is a correct
curriculum run (bound, lockstep, within-pass uniqueness), not DeepSpeed's random stream (the two samplers draw
differently; see [Note: drawing] in ``_sampler.py``).

Reading a DeepSpeed checkpoint file (`read_deepspeed_sampler_state`): DeepSpeed pickles numpy values into it (the
legacy ``np_rng_state`` tuple holds an array, ids and counters may be numpy scalars). The file is read weights-only
(numpy arrays, scalars and dtypes are rebuilt from their bytes without calling anything the file names; see [Note:
what loading trusts] in ``zlightning/_safe_load.py``) and the sampler state is converted to plain Python values, so
that it also survives our own weights-only checkpoints.

Export (`state_to_deepspeed`; ``DeepSpeedDataSampler.deepspeed_state_dict`` calls it with the order of each cluster's
current pass): the same seven keys for the state after a given micro-batch, and one DeepSpeed cluster file per
cluster in a folder of its own, so that a DeepSpeed sampler whose ``data_cluster_path`` is that folder, or this
sampler again, continues from it. Round trip export -> import is exact: the imported sampler yields the identical
sequence. A cluster still in its imported pass keeps that order in our own state (``data_cluster_imported_order``:
up to one id per sample) until the pass ends.
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ._config import DataEfficiencyConfig
from ._index import IndexFile, find_fit_int_dtype, write_index_file

__all__ = [
    "DEEPSPEED_STATE_KEYS",
    "STATE_FORMAT",
    "deepspeed_to_state",
    "is_deepspeed_state",
    "read_deepspeed_sampler_state",
    "state_to_deepspeed",
]

log = logging.getLogger(__name__)

STATE_FORMAT = "zlightning.DeepSpeedDataSampler/1"
"""The ``format`` tag of `DeepSpeedDataSampler.state_dict` (zlightning's layout); DeepSpeed's state has none."""

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

SHAPE_KEYS = (
    "one_epoch_total_samples",
    "micro_batch_size",
    "data_parallel_size",
    "gradient_accumulation_steps",
    "seed",
)
"""The keys of the ``shape`` entry of `DeepSpeedDataSampler.state_dict` (what a resuming sampler must match)."""


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
            f"keys {list(DEEPSPEED_STATE_KEYS)}); DeepSpeed writes it to mp_rank_00_model_states.pt when "
            "data_efficiency.data_sampling is enabled."
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


def deepspeed_to_state(
    ds_state: Mapping[str, Any], *, config: DataEfficiencyConfig, shape: Mapping[str, int]
) -> dict[str, Any]:
    """DeepSpeed's sampler state translated into the layout of `DeepSpeedDataSampler.state_dict`.

    Reads the cluster files named in ``ds_state`` from the config's ``data_cluster_path``. See
    [Note: DeepSpeed checkpoints].

    Args:
        ds_state: DeepSpeed's ``checkpoint["data_sampler"]`` (see `is_deepspeed_state`).
        config: The receiving sampler's config (its metrics, ``data_cluster_path`` and seed).
        shape: The receiving sampler's ``state_dict()["shape"]`` (keys `SHAPE_KEYS`).

    Returns:
        A state that the receiving sampler's ``load_state_dict`` accepts.

    Raises:
        ValueError: If the curriculum is disabled, the config has no ``data_cluster_path`` or another metric set, a
            cluster name does not match the metrics, a cursor is out of range, or the pending batch does not fit the
            micro-batch layout of ``shape``.
        FileNotFoundError: If a cluster file named in the state is missing.
    """
    curriculum = config.curriculum
    if not curriculum.enabled:
        raise _err("curriculum_learning is disabled in this config; DeepSpeed only saves sampler state with it on.")
    if not curriculum.data_cluster_path:
        raise _err(
            "set curriculum_learning.data_cluster_path to the DeepSpeed run's cluster folder: its cluster files hold "
            "the order of each cluster's current pass."
        )
    metrics = list(curriculum.curriculum_metrics)
    step, difficulties = int(ds_state["curriculum_step"]), dict(ds_state["current_difficulties"])
    if not (step == 0 and not difficulties) and sorted(difficulties) != sorted(metrics):  # step 0: before any batch
        raise _err(f"current_difficulties has metrics {sorted(difficulties)}, config has {metrics}.")
    names, cluster_difficulties, orders = _read_clusters(ds_state, Path(curriculum.data_cluster_path), metrics)
    m, n = shape["micro_batch_size"] * shape["data_parallel_size"], shape["one_epoch_total_samples"]
    batch = _checked_batch(ds_state["batch"], m, n)
    consumed = int(ds_state["consumed_samples"]) + (m if step > 0 else 0)  # DeepSpeed lags one micro-batch
    schedules = {name: metric.schedule for name, metric in curriculum.curriculum_metrics.items()}
    return {
        "format": STATE_FORMAT,
        "shape": {k: shape[k] for k in SHAPE_KEYS},
        "batch": batch,
        "consumed_samples": consumed,
        "micro_batches": -(-consumed // m),
        "epoch": 0,
        "epoch_position": 0,
        "curriculum_step": step,
        "current_difficulties": {k: int(v) for k, v in difficulties.items()},
        "data_cluster_paths": names,
        "data_cluster_difficulties": cluster_difficulties,
        "data_cluster_pass": [0] * len(names),
        "data_cluster_current_position": [int(pos) for pos in ds_state["data_cluster_current_position"]],
        "np_rng_state": _rng_state(ds_state["np_rng_state"], shape["seed"]),
        "scheduler_states": {
            name: {"current_difficulty": int(difficulties.get(name, schedule.min_difficulty))}
            for name, schedule in schedules.items()
        },
        "data_cluster_imported_order": {name: order.tolist() for name, order in zip(names, orders)},
    }


def _read_clusters(
    ds_state: Mapping[str, Any], folder: Path, metrics: list[str]
) -> tuple[list[str], list[dict[str, int]], list[np.ndarray]]:
    """Names, difficulties and current-pass orders of DeepSpeed's clusters, the cursors checked against the files."""
    paths, positions = ds_state["data_cluster_paths"], ds_state["data_cluster_current_position"]
    if len(paths) != len(positions):
        raise _err(f"{len(paths)} data_cluster_paths but {len(positions)} data_cluster_current_position entries.")
    names, difficulties, orders = [], [], []
    for raw, pos in zip(paths, positions):
        name = str(raw).replace("\\", "/").split("/")[-1]  # legacy checkpoints stored absolute paths
        difficulties.append(parse_cluster_name(name, metrics))
        order = np.asarray(IndexFile(folder / name)[0], dtype=np.int64)
        if isinstance(pos, bool) or not 0 <= int(pos) <= order.size:
            raise _err(f"cluster {name!r}: position {pos!r} is outside [0, {order.size}].")
        names.append(name)
        orders.append(order)
    return names, difficulties, orders


def _checked_batch(raw: Sequence[Any], m: int, n: int) -> list[int]:
    batch = np.asarray([int(i) for i in raw], dtype=np.int64)
    if batch.size % m or (batch.size and (batch.min() < 0 or batch.max() >= n)):
        raise _err(
            f"the pending batch has {batch.size} ids (range {batch.min(initial=0)}..{batch.max(initial=0)}); this "
            f"sampler needs a multiple of micro_batch_size * data_parallel_size = {m} ids in [0, {n}). Resume with "
            "the DeepSpeed run's micro-batch size and data-parallel size."
        )
    return batch.tolist()


def _rng_state(rng_state: Any, seed: int) -> dict[str, Any]:
    if isinstance(rng_state, Mapping) and rng_state.get("bit_generator") == "PCG64":
        return _plain(dict(rng_state))
    log.warning(
        "DeepSpeedDataSampler: the DeepSpeed checkpoint's np_rng_state is the global legacy numpy RNG state "
        "(DeepSpeed <= 0.19.8, its issue #8405), not the sampler's generator; sampling continues from the configured "
        "seed and the global numpy RNG is left untouched."
    )
    return _plain(np.random.Generator(np.random.PCG64(seed)).bit_generator.state)


def state_to_deepspeed(
    state: Mapping[str, Any], *, cluster_dir: str | os.PathLike[str], cluster_orders: Sequence[np.ndarray]
) -> dict[str, Any]:
    """A `DeepSpeedDataSampler.state_dict` translated into DeepSpeed's layout, writing its cluster files.

    See [Note: DeepSpeed checkpoints].

    Args:
        state: The sampler's ``state_dict()`` (with curriculum).
        cluster_dir: Folder for DeepSpeed's cluster files (not the sampler's own ``data_cluster_path``, whose files
            of the same names hold sorted members).
        cluster_orders: The order of each cluster's current pass, in the order of ``state["data_cluster_paths"]``
            (the sampler knows them: its passes are permutations derived from the seed, or an imported order).

    Returns:
        DeepSpeed's seven keys (`DEEPSPEED_STATE_KEYS`).

    Raises:
        ValueError: If ``state`` is not in the sampler's layout, or ``cluster_orders`` does not have one order per
            cluster.
    """
    if state.get("format") != STATE_FORMAT:
        raise ValueError(
            f"state_to_deepspeed: expected a DeepSpeedDataSampler.state_dict() (format {STATE_FORMAT!r}), got format "
            f"{state.get('format')!r}."
        )
    names = list(state["data_cluster_paths"])
    if len(cluster_orders) != len(names):
        raise ValueError(f"state_to_deepspeed: {len(cluster_orders)} cluster orders for {len(names)} clusters {names}.")
    shape = state["shape"]
    dtype = find_fit_int_dtype(0, shape["one_epoch_total_samples"] - 1)
    folder = Path(cluster_dir)
    for name, order in zip(names, cluster_orders):
        write_index_file(folder / name, order, [len(order)], dtype)
    m = shape["micro_batch_size"] * shape["data_parallel_size"]
    consumed = int(state["consumed_samples"])
    return {
        "batch": list(state["batch"]),
        "consumed_samples": max(0, consumed - m) if state["micro_batches"] > 0 else 0,
        "curriculum_step": state["curriculum_step"],
        "current_difficulties": dict(state["current_difficulties"]),
        "data_cluster_paths": names,
        "data_cluster_current_position": list(state["data_cluster_current_position"]),
        "np_rng_state": copy.deepcopy(state["np_rng_state"]),
    }
