"""Durable, atomic publication of checkpoint files and directories (torch-free; used by every zlightning save path).

[Note: what durable means here]
A checkpoint written with plain ``open``/``rename`` lives in the page cache until the kernel writes it back: after a
power loss or a kernel crash the renamed directory can hold empty files, and the previous checkpoint, deleted right
after the rename, is gone too. As PyTorch DCP's file writer does, every save here:

1. writes into a temporary name next to the target and ``fsync`` s every file it wrote (`fsync_file`);
2. ``fsync`` s the temporary directory, so the names of those files are on disk as well (`fsync_dir`);
3. publishes with one atomic rename (`publish`), then ``fsync`` s the parent directory so the rename itself is durable;
4. deletes the previous checkpoint only after that.

[Note: the name always resolves]
Replacing an existing checkpoint takes one ``renameat2(RENAME_EXCHANGE)`` on Linux (ext4, xfs, btrfs, tmpfs, ...):
the new and the old checkpoint swap names in one step, so at every instant the name is either the complete old or the
complete new checkpoint. A file system without it (NFS, CIFS, other kernels) gets two renames: the old checkpoint is
first renamed to ``.zl-old.<id>.<name>``, then the new one into place. A crash between the two leaves no entry under
the name, so `resolve` (every zlightning load path, ``zlightning consolidate``) and `recover` (run by each rank before
Lightning resolves ``ckpt_path="last"``, and by every save) put the newest complete checkpoint back: the temporary
``.zl-tmp.<id>.<name>`` of the same ``<id>`` (complete, since the old one is moved aside only after it is) or else
the old one. `recover` is idempotent and safe when several processes run it at once: each step is a rename that only
one of them can win.

Temporary names start with ``.zl-`` and spell the target's name in hex, so they never contain "last": Lightning's
``ckpt_path="last"`` looks for entries whose name contains "last" and picks the newest, and must not pick a half-written
temporary. Leftovers of a crashed save (an incomplete ``.zl-tmp``, an old checkpoint not deleted yet) are removed by
the next save into the same folder (`clean_leftovers`): one run writes to a checkpoint folder at a time, as Lightning
assumes too.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "TMP_PREFIX",
    "clean_leftovers",
    "fsync_dir",
    "fsync_file",
    "fsync_tree",
    "full_disk_as_oserror",
    "publish",
    "recover",
    "remove_durably",
    "resolve",
    "save_failure_message",
    "temporary_name",
    "write_durably",
]

TMP_PREFIX = ".zl-tmp."
OLD_PREFIX = ".zl-old."
DEL_PREFIX = ".zl-del."  # a checkpoint being deleted: never restored
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}
_exchange_unsupported: set[int] = set()  # st_dev of file systems that refused RENAME_EXCHANGE


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flushes a written file's data and metadata to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flushes a directory's entries (names created, renamed or removed in it) to the device."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory descriptors: nothing more can be done
    try:
        os.fsync(fd)
    except OSError as err:  # some file systems refuse fsync on directories; their renames are synchronous
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """`fsync_file` every file under ``path`` and `fsync_dir` every directory, children first."""
    path = Path(path)
    if not path.is_dir():
        fsync_file(path)
        return
    for root, dirs, files in os.walk(path, topdown=False):
        for name in files:
            fsync_file(os.path.join(root, name))
        fsync_dir(root)


def _hex(name: str) -> str:
    return name.encode().hex()


def temporary_name(target: str | os.PathLike[str], token: str | None = None) -> Path:
    """Where a new version of ``target`` is written before `publish` (same folder, so the rename stays atomic)."""
    target = Path(target)
    return target.parent / f"{TMP_PREFIX}{token or uuid.uuid4().hex[:12]}.{_hex(target.name)}"


def _parts(entry: str) -> tuple[str, str, str] | None:
    """``(kind, token, target name)`` of a temporary or old entry, else None."""
    for prefix in (TMP_PREFIX, OLD_PREFIX):
        if entry.startswith(prefix):
            token, _, hexname = entry[len(prefix) :].partition(".")
            try:
                return prefix, token, bytes.fromhex(hexname).decode()
            except ValueError:
                return None
    return None


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the names ``a`` and ``b`` in one atomic step. False when the file system or kernel cannot."""
    dev = os.stat(a.parent).st_dev
    if dev in _exchange_unsupported or platform.system() != "Linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    fa, fb = os.fsencode(a), os.fsencode(b)
    if hasattr(libc, "renameat2"):
        rc = libc.renameat2(_AT_FDCWD, fa, _AT_FDCWD, fb, ctypes.c_uint(_RENAME_EXCHANGE))
    elif platform.machine() in _SYS_RENAMEAT2:
        rc = libc.syscall(_SYS_RENAMEAT2[platform.machine()], _AT_FDCWD, fa, _AT_FDCWD, fb, _RENAME_EXCHANGE)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        _exchange_unsupported.add(dev)
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def publish(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Puts the complete, fsynced ``tmp`` (file or directory, from `temporary_name`) at ``target`` atomically and
    durably, then deletes what ``target`` held before. See [Note: the name always resolves]."""
    tmp, target = Path(tmp), Path(target)
    fsync_dir(tmp if tmp.is_dir() else tmp.parent)
    if not os.path.lexists(target):
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return
    if _exchange(tmp, target):
        fsync_dir(target.parent)
        _remove(tmp)  # now the previous checkpoint
        return
    token = tmp.name[len(TMP_PREFIX) :].partition(".")[0]
    old = target.parent / f"{OLD_PREFIX}{token}.{_hex(target.name)}"
    os.rename(target, old)
    os.rename(tmp, target)
    fsync_dir(target.parent)
    _remove(old)


_FULL_BELOW = 1 << 20
"""A write that fails with less free space than this (1 MiB) failed because the file system is full."""


@contextlib.contextmanager
def full_disk_as_oserror(folder: str | os.PathLike[str]) -> Iterator[None]:
    """Turns a write error that a full file system caused into ``OSError(ENOSPC)``. torch's file writer reports a
    full disk as a ``RuntimeError`` without an errno ("unexpected pos ...", "iostream error"), which says nothing
    useful; it is recognised by the free space left at the moment of the failure."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            raise err from None
        if free >= _FULL_BELOW:
            raise
        text = " ".join(str(err).split())[:200]
        raise OSError(errno.ENOSPC, f"No space left on device (torch's writer: {type(err).__name__}: {text})") from err


def write_durably(target: str | os.PathLike[str], write: Callable[[Path], None]) -> None:
    """Writes one file at ``target`` through a temporary name, ``fsync`` and `publish` (see [Note: what durable means
    here]): ``write(tmp)`` writes the content. When writing fails the temporary is removed, ``target`` is unchanged
    and the error propagates."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(target.parent)
    tmp = temporary_name(target)
    try:
        with full_disk_as_oserror(target.parent):
            write(tmp)
            fsync_file(tmp)
    except BaseException:
        _remove(tmp)
        raise
    publish(tmp, target)  # a failure here leaves a complete version that `resolve` / `recover` find


def _pending(folder: Path, name: str) -> tuple[Path | None, Path | None]:
    """The newest complete version of a missing ``folder/name`` left by an interrupted two-rename publication:
    ``(tmp, old)`` of one token, either possibly None."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return None, None
    olds: dict[str, Path] = {}
    tmps: dict[str, Path] = {}
    for entry in entries:
        parts = _parts(entry)
        if parts is None or parts[2] != name:
            continue
        (olds if parts[0] == OLD_PREFIX else tmps)[parts[1]] = folder / entry
    for token, old in olds.items():
        return tmps.get(token), old
    return None, None


def resolve(target: str | os.PathLike[str]) -> Path:
    """``target``, or while a crashed publication left it missing, the complete version that `recover` would put
    there (read-only: nothing is renamed)."""
    target = Path(target)
    if os.path.lexists(target):
        return target
    tmp, old = _pending(target.parent, target.name)
    return tmp or old or target


def _recover_one(target: Path) -> None:
    tmp, old = _pending(target.parent, target.name)
    for candidate in (tmp, old):
        if os.path.lexists(target):
            break
        if candidate is None:
            continue
        with contextlib.suppress(FileNotFoundError):  # another process won this rename
            os.rename(candidate, target)
            fsync_dir(target.parent)


def recover(folder: str | os.PathLike[str]) -> list[Path]:
    """Puts back every checkpoint in ``folder`` that a crash between two renames left missing (see [Note: the name
    always resolves]). Returns the names it restored or found restored."""
    folder = Path(folder)
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    names = {p[2] for p in map(_parts, entries) if p is not None and p[0] == OLD_PREFIX}
    restored = []
    for name in sorted(names):
        target = folder / name
        if not os.path.lexists(target):
            _recover_one(target)
            restored.append(target)
    return restored


def clean_leftovers(folder: str | os.PathLike[str], keep: str | os.PathLike[str] | None = None) -> None:
    """After `recover`: deletes temporaries and old versions of crashed saves in ``folder`` (except ``keep``)."""
    folder = Path(folder)
    recover(folder)
    keep_name = Path(keep).name if keep is not None else None
    for entry in _entries(folder):
        if entry.name != keep_name and (_parts(entry.name) is not None or entry.name.startswith(DEL_PREFIX)):
            _remove(entry)


def _entries(folder: Path) -> Iterator[Path]:
    try:
        yield from folder.iterdir()
    except OSError:
        return


def remove_durably(target: str | os.PathLike[str]) -> None:
    """Deletes a checkpoint so that a crash midway never leaves a partial one under its name: it is renamed away
    (atomically, durably) before its files are deleted."""
    target = Path(target)
    if not os.path.lexists(target):
        return
    gone = target.parent / f"{DEL_PREFIX}{uuid.uuid4().hex[:12]}"
    os.rename(target, gone)
    fsync_dir(target.parent)
    _remove(gone)


def save_failure_message(path: Path, where: str, err: BaseException, existed: bool) -> str:
    """What a failed save tells the user: where it failed and why, what is on disk now, and what to do."""
    kept = (
        f"the previous checkpoint at {path} is unchanged and loadable"
        if existed
        else f"no checkpoint was written at {path}"
    )
    hint = ""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(path.parent).free / 2**20
            hint = (
                f" {free:.1f} MiB are free on that file system now: free space, or save elsewhere "
                "(ModelCheckpoint(dirpath=...))."
            )
    text = " ".join(str(err).split()) or type(err).__name__
    return (
        f"saving the checkpoint {path} failed on {where}: {type(err).__name__}: {text}. Nothing was replaced: "
        f"{kept}, and the partial files were removed.{hint}"
    )
