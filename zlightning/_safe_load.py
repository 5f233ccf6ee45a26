"""Loading checkpoint files without running code from them: every zlightning load path reads through `load_file`.

[Note: what loading trusts]
Unpickling can call any function a file names, so a checkpoint from elsewhere (downloaded, shared, or a directory
another user can write) must not be unpickled in full. Every file is read with ``torch.load(weights_only=True)``:
tensors, numbers, strings, lists, tuples, dicts and the types below are rebuilt, any other global the file names is
refused before it is called. Full unpickling happens only when the caller opts in with ``weights_only=False``
(Lightning's ``trainer.fit/validate/test/predict(..., weights_only=False)``, ``zlightning consolidate
--unsafe-load``); a refused file raises `UnsafeCheckpointError` naming the refused types and that opt-in, before
anything has been restored. SHA-256 entries in a checkpoint's metadata detect corruption, not tampering: whoever can
change a file can recompute its digest, so they are no reason to trust a file.

Allowed beyond torch's own list (`torch.serialization.add_safe_globals`, done once on import): data-only types that
honest Lightning client state commonly holds -- ``argparse.Namespace`` and Lightning's ``AttributeDict``
(hyper-parameters), ``pathlib`` paths, numpy arrays, scalars and dtypes (under numpy 1 and numpy 2 module names, so
files written by DeepSpeed's sampler under either load). Rebuilding them sets fields and copies bytes; it calls
nothing the file chooses.

[Note: described hyper-parameters]
Lightning stores the module's and the datamodule's hyper-parameters in every checkpoint, and they may be any object
(a config dataclass, an enum, a class). Resuming does not read them, so they must not force the opt-in: before a
checkpoint is written, `split_client_state` replaces each hyper-parameter whose value would need unpickling by its
``repr`` string in the client state (which then loads with ``weights_only=True``) and returns the original values,
which the format writes to a file of their own. `join_client_state` puts the originals back only under the opt-in;
without it ``checkpoint["hyper_parameters"]`` holds the descriptions. Every other part of the client state (loops,
callbacks, schedulers, datamodule state) is needed to resume exactly and is never replaced: if it needs a refused
type, loading refuses.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import re
import sys
from collections.abc import Callable, Mapping
from mmap import MAP_SHARED
from typing import Any, Literal

import torch

__all__ = [
    "DESCRIBED_KEYS",
    "UnsafeCheckpointError",
    "join_client_state",
    "load_file",
    "loads_weights_only",
    "split_client_state",
]

DESCRIBED_KEYS = ("hyper_parameters", "datamodule_hyper_parameters", "hparams_type", "datamodule_hparams_type")
"""Client-state entries kept for information only (Lightning's hyper-parameters and their container types): see
[Note: described hyper-parameters]."""

LIGHTNING_OPT_IN = "trainer.fit/validate/test/predict(..., ckpt_path=..., weights_only=False)"
"""How a Lightning user opts in to full unpickling (named in refusals)."""


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file needs full unpickling (it names a type that could run code) and no opt-in was given."""


def _numpy_globals() -> list[Any]:
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:
        from numpy.core import multiarray  # type: ignore[no-redef]  # numpy 1
    out: list[Any] = [np.ndarray, np.dtype, multiarray._reconstruct, multiarray.scalar]
    for module in ("numpy.core.multiarray", "numpy._core.multiarray"):  # files written under the other major version
        out += [(multiarray._reconstruct, f"{module}._reconstruct"), (multiarray.scalar, f"{module}.scalar")]
    dtypes = getattr(np, "dtypes", None)  # numpy >= 1.25: one class per dtype, rebuilt by BUILD
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType") and isinstance(getattr(dtypes, n), type)]
    else:
        out += sorted({type(np.dtype(c)) for c in "?bBhHiIlLqQefdgFDGSUVOMm"}, key=str)
    return out


_lightning_registered = False


def register_lightning_safe_globals() -> None:
    """Allows Lightning's ``AttributeDict`` (saved hyper-parameters) in weights-only loads, once Lightning is loaded.

    Called by the Lightning strategies and before every load; it never imports Lightning itself, so the engines stay
    Lightning-free (a process that never imported Lightning cannot be loading Lightning's hyper-parameters).
    """
    global _lightning_registered
    if _lightning_registered or "lightning.fabric" not in sys.modules:
        return
    from lightning.fabric.utilities.data import AttributeDict

    torch.serialization.add_safe_globals([AttributeDict])
    _lightning_registered = True


def _register_safe_globals() -> None:
    paths: list[Any] = [
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.WindowsPath,
        pathlib.PurePosixPath,
        pathlib.PureWindowsPath,
    ]
    paths += [(cls, f"pathlib.{cls.__name__}") for cls in paths if cls.__module__ != "pathlib"]  # Python >= 3.13
    torch.serialization.add_safe_globals([argparse.Namespace, *paths, *_numpy_globals()])
    register_lightning_safe_globals()


_register_safe_globals()


def _refused(path: str | os.PathLike[str], err: pickle.UnpicklingError) -> str:
    """The types a file names that weights-only loading refuses (read from its opcodes: nothing is called)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - a malformed file: torch's own reason below still says what failed
        names = []
    if names:
        return ", ".join(names)
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|$)", str(err), re.S)
    return " ".join((match.group(1) if match else str(err)).split())


# [Note: reading a checkpoint through a shared map]
# ``torch.load(mmap=True)`` maps the file private and writable. Such a mapping takes no memory until written, but the
# kernel charges all of it to the process's data segment (``RLIMIT_DATA``) and, under strict overcommit, to its
# commit charge: consolidating a checkpoint whose rank files add up to more than the memory limit failed there before
# reading a byte (seen with a cap that training itself met). A shared mapping is charged to neither. Its tensors
# write through to the file, so only callers that never write into what they loaded (``consolidate`` copies out of
# the shards) ask for it.
def load_file(
    path: str | os.PathLike[str],
    *,
    weights_only: bool | None = None,
    opt_in: str | None,
    map_location: Any = "cpu",
    mmap: bool | Literal["shared"] = False,
) -> Any:
    """``torch.load`` that never runs code from the file unless the caller opted in. See [Note: what loading trusts].

    Args:
        path: the file.
        weights_only: ``False`` is the explicit opt-in to full unpickling; ``None`` and ``True`` load weights-only.
        opt_in: how the user of the calling entry point opts in (named in the error); None for a format that holds
            only plain data and so has no opt-in.
        map_location: as ``torch.load``.
        mmap: as ``torch.load``: tensors are views of the memory-mapped file (read on use). ``"shared"`` maps it
            shared, for callers that only ever read the tensors: see [Note: reading a checkpoint through a shared map].

    Raises:
        UnsafeCheckpointError: the file names a type weights-only loading refuses (nothing from it was called).
    """
    register_lightning_safe_globals()
    if mmap == "shared":
        with torch.serialization.set_default_mmap_options(MAP_SHARED):
            return load_file(path, weights_only=weights_only, opt_in=opt_in, map_location=map_location, mmap=True)
    if weights_only is False:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=bool(mmap))
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=bool(mmap))
    except pickle.UnpicklingError as err:
        how = (
            f"If you trust where this checkpoint comes from, load it with {opt_in}."
            if opt_in is not None
            else "Files of this format hold only tensors and plain data, so this one was not written by zlightning."
        )
        raise UnsafeCheckpointError(
            f"refused to load {path}: it needs {_refused(path, err)}, and unpickling that can run arbitrary code "
            f"(checksums do not tell an honest file from a tampered one). Nothing was restored. {how}"
        ) from err


def loads_weights_only(obj: Any) -> bool:
    """Whether ``obj`` comes back from ``torch.save`` under ``weights_only=True`` (a restricted round trip)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


def _describe(value: Any) -> str:
    try:
        return repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not stop a checkpoint
        return f"<{type(value).__module__}.{type(value).__qualname__}>"


def split_client_state(client: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits off the hyper-parameters that would need unpickling. See [Note: described hyper-parameters].

    Returns:
        ``(plain, originals)``: ``client`` with each such hyper-parameter replaced by its ``repr`` (a whole entry of
        `DESCRIBED_KEYS` when it is not a dict), and the original values of the entries that changed.
    """
    plain, originals = dict(client), {}
    for key in DESCRIBED_KEYS:
        if key not in plain:
            continue
        value = plain[key]
        described: object
        if type(value) is dict:
            described = {k: v if loads_weights_only({k: v}) else _describe(v) for k, v in value.items()}
            changed = any(described[k] is not value[k] for k in value)
        else:
            changed = not loads_weights_only(value)
            described = _describe(value) if changed else value
        if changed:
            plain[key], originals[key] = described, value
    return plain, originals


def join_client_state(
    client: dict[str, Any], load_originals: Callable[[], Mapping[str, Any]] | None, weights_only: bool | None
) -> dict[str, Any]:
    """Puts the original hyper-parameters back under the opt-in (``weights_only=False``); see `split_client_state`.

    Args:
        client: the client state as loaded (descriptions in place of values that need unpickling).
        load_originals: reads the originals' file; None when the checkpoint has none.
        weights_only: the caller's choice (only ``False`` reads the originals).
    """
    if load_originals is not None and weights_only is False:
        client.update(load_originals())
    return client
