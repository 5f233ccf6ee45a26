"""A non-editable install works outside the repository: the wheel builds without packaging warnings, installs into a
fresh virtualenv (``--no-deps``, over this environment's packages), imports from site-packages, runs a short
2-process ``zstack_zero3`` fit from a directory that is not the repository, and its ``zlightning kernels`` finds a
library built into the per-user cache (see [Note: where built kernels live] in ``kernels/_build.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from zlightning.kernels import _build

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "zlightning", "strategies", "datamodules", "kernels")

FIT = """
import sys
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset
import zlightning
from zlightning.zero import summon_full_params

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 8), torch.randn(32, 1))
    module = Tiny()
    trainer = pl.Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(data, batch_size=4))
    with summon_full_params(module):
        n = sum(p.numel() for p in module.parameters())
    if trainer.is_global_zero:
        print("FIT-OK", zlightning.__file__, n, trainer.global_step)
"""


def _copy_sources(dst: Path) -> None:
    ignore = shutil.ignore_patterns("build", "__pycache__", "*.so", "*.egg-info")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=ignore)
        else:
            shutil.copy2(src, dst / name)


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False, **kwargs)  # type: ignore[call-overload]
    assert out.returncode == 0, f"$ {' '.join(cmd)}\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.mark.skipif(shutil.which("true") is None, reason="needs a POSIX shell environment")
def test_wheel_installs_and_trains_outside_the_repository(tmp_path: Path) -> None:
    src, wheels, venv, work = tmp_path / "src", tmp_path / "wheels", tmp_path / "venv", tmp_path / "work"
    src.mkdir(), work.mkdir()
    _copy_sources(src)
    built = _run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)]
    )
    log = built.stdout + built.stderr
    assert "absent from the `packages`" not in log and "zlightning.kernels.csrc" not in log, log[-3000:]
    (wheel,) = wheels.glob("zlightning-*.whl")

    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # this environment's packages (torch, lightning, ...) behind the venv's own; its .pth files (the editable
    # install of the repository) are not processed from a path listed in a .pth file
    (purelib / "parent_env.pth").write_text(sysconfig.get_path("purelib") + "\n")
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--ignore-installed",
            "--quiet",
            str(wheel),
        ]
    )
    installed = purelib / "zlightning"
    assert (installed / "kernels" / "csrc" / "ops.cpp").exists() and not (installed / "kernels" / "build").exists()

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ZLIGHTNING_KERNELS_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path / "cache"), PYTHONDONTWRITEBYTECODE="1")
    (work / "fit.py").write_text(FIT)
    fit = _run([str(python), "fit.py"], cwd=work, env=env)
    line = next(x for x in fit.stdout.splitlines() if x.startswith("FIT-OK"))
    assert line.split()[1] == str(installed / "__init__.py") and line.split()[2:] == ["161", "3"], line

    key = _build.cache_key()  # the installed copy has the same sources, hence the same key
    ours = REPO / "kernels" / "build" / key / _build.LIB_NAME
    cache = tmp_path / "cache" / "zlightning" / "kernels" / key
    if ours.exists():  # hand the library built here to the install through the per-user cache
        cache.mkdir(parents=True)
        shutil.copy2(ours, cache / _build.LIB_NAME)
        shutil.copy2(ours.parent / "build.json", cache / "build.json")
    out = _run(
        [str(venv / "bin" / "zlightning"), "kernels", "--build", "--json"], cwd=work, env={**env, "CXX": "/bin/false"}
    ).stdout  # never compiles here: a build would only fail fast
    report = json.loads(out[out.index("{") :])
    if ours.exists():
        assert "cached build" in out and report["loaded"], out
        assert report["library"] == str(cache / _build.LIB_NAME), report
    else:  # the failed build went next to the installed sources, which are writable in a user's venv
        assert "BUILD FAILED" in out and report["library"].startswith(str(installed)), out
