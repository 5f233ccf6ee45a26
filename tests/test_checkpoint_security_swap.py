"""Swap folders and files hold a run's model and optimizer state: readable by their owner only, whatever the umask,
and never written under a swap folder that belongs to another user."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from zlightning.kernels import DeepSpeedIOEngine

from zlightning.zero._offload_config import NVMeOffload
from zlightning.zero._swap_io import SWAP_ROOT, SwapDirectory, SwapPathError, make_swap_io


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The loosest umask: modes must not come from it."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_swap_folders_and_files_are_private(tmp_path: Path, open_umask: None) -> None:
    folder = SwapDirectory(tmp_path, "unit", 0)
    folder.open("error")
    try:
        assert _mode(tmp_path / SWAP_ROOT) == 0o700 and _mode(folder.path) == 0o700
        posix = make_swap_io(NVMeOffload(path=tmp_path, io_engine="portable", block_size=4096), direct=False)
        posix.pwrite(torch.ones(1024), folder.file("posix.swp"), 0, [])
        posix.wait()
        posix.close()
        engine = DeepSpeedIOEngine(backend="python")
        engine.async_pwrite(torch.ones(1024), folder.file("aio.swp"), 0)
        engine.wait()
        assert _mode(folder.file("posix.swp")) == 0o600 and _mode(folder.file("aio.swp")) == 0o600
    finally:
        folder.close()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to hand a folder to another uid"
)
def test_swap_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    base = tmp_path / SWAP_ROOT
    base.mkdir()
    os.chown(base, 4242, 4242)
    with pytest.raises(SwapPathError, match="belongs to another user .*uid 4242.*NVMeOffload\\(path=...\\)"):
        SwapDirectory(tmp_path, "unit", 0).open("remove")
    assert list(base.iterdir()) == []


def test_malformed_owner_file_is_treated_as_orphaned(tmp_path: Path) -> None:
    stale = tmp_path / SWAP_ROOT / "run-old-rank0"
    stale.mkdir(parents=True)
    (stale / "owner.json").write_text(json.dumps(["not", "an", "owner"]))
    folder = SwapDirectory(tmp_path, "unit", 0)
    with pytest.warns(UserWarning, match="removing stale swap folders"):
        folder.open("remove")
    folder.close()
    assert not stale.exists()
