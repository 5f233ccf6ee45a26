"""Loading a checkpoint never runs code from it: a pickle planted in any file of any format (sharded ZeRO, full
Lightning, pipeline, compression export, DeepSpeed sampler state) is refused with an error naming the refused types
and the opt-in, before anything is restored, and the code it carries (touching a marker file) never runs. Honest
checkpoints, hyper-parameters that are not plain data included, still load without the opt-in."""

from __future__ import annotations

import argparse
import enum
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

from tests._lightning_models import TinyGPTModule, loader
from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning._safe_load import LIGHTNING_OPT_IN, UnsafeCheckpointError
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig, consolidate, load_sharded, save_sharded

ROOT = Path(__file__).resolve().parents[1]


class _Planted:
    """Unpickled in full, this touches ``marker``: it stands for any code a tampered checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> Any:
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


class _Mode(enum.Enum):
    """A hyper-parameter that is not plain data (an enum of the user's project)."""

    FAST = "fast"


def _hparams() -> dict[str, Any]:
    return {
        "lr": 0.1,
        "ns": argparse.Namespace(layers=2),
        "root": Path("runs"),
        "mode": _Mode.FAST,
        "ids": np.arange(3),
    }


def _plant(file: Path, marker: Path, key: str = "planted") -> None:
    """Adds a planted object to a (trusted, our own) checkpoint file."""
    obj = torch.load(file, weights_only=False)
    obj[key] = _Planted(marker)
    torch.save(obj, file)


def _reseal(ckpt: Path, version: int | None = None) -> None:
    """Recomputes meta.json's SHA-256 entries, as whoever tampers with a checkpoint can."""
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"] = {name: hashlib.sha256((ckpt / name).read_bytes()).hexdigest() for name in meta["files"]}
    if version is not None:
        meta["version"] = version
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _assert_refused(msg: str, file: str, opt_in: str) -> None:
    assert "refused to load" in msg and file in msg, msg
    assert "builtins.getattr" in msg, msg  # the refused global (how the planted object reaches Path.touch) is named
    assert opt_in in msg, msg


def _cli_consolidate(ckpt: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zlightning.cli", "consolidate", str(ckpt), str(out), "--no-progress", *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ==================================================================== sharded ZeRO checkpoints, engine level
def _engine(seed: int) -> DeepSpeedZeroOptimizer_Stage3:
    model = tiny_gpt(seed=seed)
    return DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig())


def _save_zero(rank: int, world: int, path: str) -> dict[str, torch.Tensor]:
    zero = _engine(0)
    zero.backward(gpt_loss(zero.module, batches(1, 8)[0].chunk(world)[rank]))
    zero.step()
    save_sharded(zero.state, [zero.optimizer], path, {"epoch": 3, "hyper_parameters": _hparams()})
    return zero.module_state_dict()


def _load_zero(rank: int, world: int, attempts: list[tuple[str, bool | None]]) -> list[dict[str, Any]]:
    out = []
    for path, weights_only in attempts:
        zero = _engine(7)  # another init: every value must come from the checkpoint
        before = zero.module_state_dict()
        try:
            client = load_sharded(zero.state, [zero.optimizer], path, weights_only=weights_only)
        except UnsafeCheckpointError as err:
            after = zero.module_state_dict()
            out.append(
                {
                    "error": str(err),
                    "unchanged": all(torch.equal(after[k], v) for k, v in before.items()),
                    "optimizer_empty": not zero.optimizer.state,
                }
            )
            continue
        out.append({"client": client, "model": zero.module_state_dict()})
    return out


def test_sharded_zero_checkpoint(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    honest = tmp_path / "honest"
    saved = run_distributed(_save_zero, 2, str(honest), timeout=180)[0]
    assert (honest / "client_objects.pt").is_file()  # the enum hyper-parameter's original value
    planted_client, planted_rank, legacy = tmp_path / "planted_client", tmp_path / "planted_rank", tmp_path / "legacy"
    for copy, file, version in (
        (planted_client, "client_state.pt", None),
        (planted_rank, "rank_00000.pt", None),
        (legacy, "client_state.pt", 1),
    ):
        shutil.copytree(honest, copy)
        _plant(copy / file, marker)
        _reseal(copy, version)

    attempts = [(str(honest), None), (str(honest), False), (str(planted_client), None), (str(planted_rank), None)]
    plain, opted_in, refused_client, refused_rank = run_distributed(_load_zero, 1, attempts, timeout=180)[0]
    assert not marker.exists()
    for name, value in saved.items():  # honest: exact, without the opt-in
        assert torch.equal(plain["model"][name], value), name
    hp = plain["client"]["hyper_parameters"]
    assert hp["lr"] == 0.1 and hp["ns"] == argparse.Namespace(layers=2) and hp["root"] == Path("runs")
    assert np.array_equal(hp["ids"], np.arange(3))
    assert hp["mode"] == repr(_Mode.FAST)  # described, not unpickled
    assert opted_in["client"]["hyper_parameters"]["mode"] is _Mode.FAST
    assert plain["client"]["epoch"] == 3 and "zero_buffers" not in plain["client"]
    for refused, file in ((refused_client, "client_state.pt"), (refused_rank, "rank_00000.pt")):
        _assert_refused(refused["error"], file, "weights_only=False")
        assert "trainer.fit/validate/test/predict" in refused["error"]
        assert refused["unchanged"] and refused["optimizer_empty"]  # nothing restored

    # consolidate never reads the client state: a planted client changes nothing
    out = consolidate(planted_client, tmp_path / "model.pt", progress=False)
    state = torch.load(out, weights_only=True)
    assert all(torch.equal(state[name], value) for name, value in saved.items())
    for ckpt, file in ((planted_rank, "rank_00000.pt"), (legacy, "client_state.pt")):  # version 1: buffers in client
        with pytest.raises(UnsafeCheckpointError) as info:
            consolidate(ckpt, tmp_path / "x.pt", progress=False)
        _assert_refused(str(info.value), file, "--unsafe-load")
    proc = _cli_consolidate(planted_rank, tmp_path / "cli.pt")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    _assert_refused(proc.stderr, "rank_00000.pt", "zlightning consolidate --unsafe-load")
    assert not marker.exists() and not (tmp_path / "cli.pt").exists() and not (tmp_path / "x.pt").exists()

    proc = _cli_consolidate(planted_rank, tmp_path / "cli.pt", "--unsafe-load")  # the opt-in unpickles in full
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.exists()


# ==================================================================== zstack_zero3 through Lightning: ckpt_path=
class _HparamsModule(TinyGPTModule):
    def __init__(self, lr: float = 1e-3, ns: Any = None, root: Any = None, mode: Any = None) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()
        self.loaded_hparams: dict[str, Any] | None = None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_hparams = dict(checkpoint["hyper_parameters"])


def _module(mode: Any) -> _HparamsModule:
    return _HparamsModule(ns=argparse.Namespace(layers=2), root=Path("runs"), mode=mode)


def _mode_for(kind: str) -> Any:
    # A full checkpoint is Lightning's own file: its hyper-parameters are pickled as they are, so an enum there would
    # need the opt-in; the sharded format stores a description (see [Note: described hyper-parameters]).
    return _Mode.FAST if kind == "sharded" else None


def _zero_trainer(kind: str, **kwargs: Any) -> pl.Trainer:
    from zlightning.strategies import ZStackZero3Strategy

    from zlightning.zero import CheckpointPolicy

    base: dict[str, Any] = dict(
        strategy=ZStackZero3Strategy(checkpoint=CheckpointPolicy(state_dict_type=kind)),
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**base, **kwargs})


def _save_lightning_zero(rank: int, world: int, root: str) -> None:
    for kind in ("sharded", "full"):
        pl.seed_everything(0, verbose=False)
        callbacks = [
            ModelCheckpoint(dirpath=os.path.join(root, kind), monitor="val_loss", save_last=True),
            EarlyStopping("val_loss", patience=3),
        ]
        _zero_trainer(kind, callbacks=callbacks).fit(_module(_mode_for(kind)), loader(2, 2, world), loader(1, 2, world))


def _resume_lightning_zero(rank: int, world: int, attempts: list[tuple[str, str, bool | None]]) -> list[Any]:
    out: list[Any] = []
    for kind, ckpt, weights_only in attempts:
        module = _module(_mode_for(kind))
        trainer = _zero_trainer(kind, max_epochs=2, enable_checkpointing=False)
        try:
            trainer.fit(module, loader(2, 2, world), ckpt_path=ckpt, weights_only=weights_only)
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            out.append({"error": f"{type(err).__name__}: {err}"})
            continue
        out.append({"hparams": module.loaded_hparams, "step": trainer.global_step})
    return out


@pytest.fixture(scope="module")
def zero3_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Honest sharded and full zstack_zero3 checkpoints (ModelCheckpoint and EarlyStopping state, hyper-parameters
    with a Namespace and a Path, and an enum in the sharded one), and copies with planted pickles."""
    root = tmp_path_factory.mktemp("zero3")
    run_distributed(_save_lightning_zero, 2, str(root), init_process_group=False, timeout=300)
    for name, mark in (("planted", "MARKER"), ("opted", "OPTED_IN")):
        shutil.copytree(root / "sharded" / "last.ckpt", root / f"{name}_sharded")
        _plant(root / f"{name}_sharded" / "client_state.pt", root / mark)
        _reseal(root / f"{name}_sharded")
        shutil.copy(root / "full" / "last.ckpt", root / f"{name}_full.ckpt")
        _plant(root / f"{name}_full.ckpt", root / mark)
    return root


def test_zero3_ckpt_path_refuses_planted_checkpoints(zero3_checkpoints: Path) -> None:
    root = zero3_checkpoints
    attempts = [
        ("sharded", str(root / "sharded" / "last.ckpt"), None),
        ("full", str(root / "full" / "last.ckpt"), None),
        ("sharded", str(root / "planted_sharded"), None),
        ("full", str(root / "planted_full.ckpt"), None),
    ]
    for honest_sharded, honest_full, refused_sharded, refused_full in run_distributed(
        _resume_lightning_zero, 2, attempts, init_process_group=False, timeout=400
    ):
        for honest in (honest_sharded, honest_full):  # resumed without any opt-in
            assert honest["step"] > 0 and honest["hparams"]["ns"] == argparse.Namespace(layers=2), honest
            assert honest["hparams"]["root"] == Path("runs")
        assert honest_sharded["hparams"]["mode"] == repr(_Mode.FAST)  # described, not unpickled
        assert refused_sharded["error"].startswith("UnsafeCheckpointError"), refused_sharded
        _assert_refused(refused_sharded["error"], "client_state.pt", "weights_only=False")
        # A full checkpoint is Lightning's own file, which Lightning reads with torch.load(weights_only=True) as well.
        assert "getattr" in refused_full["error"] and "weights_only" in refused_full["error"], refused_full["error"]
    assert not (root / "MARKER").exists()


def test_zero3_ckpt_path_opt_in_loads_trusted_checkpoints(zero3_checkpoints: Path) -> None:
    root = zero3_checkpoints
    attempts = [("sharded", str(root / "opted_sharded"), False), ("full", str(root / "opted_full.ckpt"), False)]
    for sharded, full in run_distributed(_resume_lightning_zero, 2, attempts, init_process_group=False, timeout=400):
        assert "error" not in sharded and "error" not in full, (sharded, full)
        assert sharded["hparams"]["mode"] is _Mode.FAST  # the original value, under the opt-in
    assert (root / "OPTED_IN").exists()


# ==================================================================== pipeline checkpoints
def _pipe_engine(seed: int) -> Any:
    from examples.gpt_model import GPTConfig
    from examples.gpt_pipe import gpt_pipeline
    from zlightning.pipe import PipelineConfig, PipelineEngine

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2)
    return PipelineEngine(gpt_pipeline(cfg), lambda ps: torch.optim.AdamW(ps, lr=1e-2), PipelineConfig(micro_batches=2))


def test_pipeline_checkpoint(tmp_path: Path) -> None:
    from zlightning.cli import EXTRA_COMMANDS
    from zlightning.pipe import consolidate_pipeline_checkpoint, load_pipeline_checkpoint, save_pipeline_checkpoint

    marker = tmp_path / "MARKER"
    engine = _pipe_engine(0)
    ids = torch.randint(0, 32, (4, 9))
    engine.train_batch(batch=(ids[:, :-1], ids[:, 1:]))
    honest = tmp_path / "honest"
    save_pipeline_checkpoint(engine, honest, client_state={"epoch": 1, "hyper_parameters": _hparams()})
    fresh = _pipe_engine(1)
    client = load_pipeline_checkpoint(fresh, honest)
    assert client["hyper_parameters"]["mode"] == repr(_Mode.FAST) and client["hyper_parameters"]["root"] == Path("runs")
    assert all(torch.equal(v, engine.module.state_dict()[k]) for k, v in fresh.module.state_dict().items())
    opted_in = load_pipeline_checkpoint(_pipe_engine(1), honest, weights_only=False)
    assert opted_in["hyper_parameters"]["mode"] is _Mode.FAST

    for file in ("client_state.pt", "optim_pp00_dp00.pt", "layer_001-model_states.pt", "meta.pt"):
        planted = tmp_path / f"planted_{file}"
        shutil.copytree(honest, planted)
        _plant(planted / file, marker)
        other = _pipe_engine(2)
        before = {k: v.clone() for k, v in other.module.state_dict().items()}
        with pytest.raises(UnsafeCheckpointError) as info:
            load_pipeline_checkpoint(other, planted)
        _assert_refused(str(info.value), file, LIGHTNING_OPT_IN)
        assert all(torch.equal(v, before[k]) for k, v in other.module.state_dict().items())  # nothing restored
        assert not other.optimizer.state
        if file in ("client_state.pt", "optim_pp00_dp00.pt"):  # consolidation reads neither
            assert consolidate_pipeline_checkpoint(planted).keys() == engine.module.state_dict().keys()
            continue
        with pytest.raises(UnsafeCheckpointError, match="zlightning consolidate --unsafe-load"):
            consolidate_pipeline_checkpoint(planted)
        with pytest.raises(SystemExit, match="refused to load .*--unsafe-load") as info:
            EXTRA_COMMANDS["consolidate"]([str(planted), str(tmp_path / "model.pt")])
        assert not (tmp_path / "model.pt").exists()
    assert not marker.exists()


class _PipeHparams(pl.LightningModule):
    def __init__(self, mode: Any = None) -> None:
        from examples.gpt_model import GPTConfig
        from examples.gpt_pipe import gpt_pipeline

        super().__init__()
        self.save_hyperparameters()
        self.pipe = gpt_pipeline(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_layer=2, n_head=2))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.pipe.batch_loss((batch[0][:, :-1], batch[0][:, 1:]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _pipe_fit(root: str, ckpt: str | None, weights_only: bool | None = None) -> pl.Trainer:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        strategy="zstack_pipeline",
        accelerator="cpu",
        devices=2,
        max_epochs=1 if ckpt is None else 2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = torch.utils.data.TensorDataset(torch.randint(0, 32, (8, 9), generator=torch.Generator().manual_seed(0)))
    trainer.fit(
        _PipeHparams(mode=_Mode.FAST),
        torch.utils.data.DataLoader(data, batch_size=4),
        ckpt_path=ckpt,
        weights_only=weights_only,
    )
    return trainer


def _lightning_pipe(rank: int, world: int, root: str, phase: str) -> Any:
    if phase == "save":
        _pipe_fit(root, None).save_checkpoint(os.path.join(root, "honest"))
        return None
    out = {"honest": _pipe_fit(root, os.path.join(root, "honest")).global_step}
    try:
        _pipe_fit(root, os.path.join(root, "planted"))
    except UnsafeCheckpointError as err:
        out["refused"] = str(err)
    out["opted_in"] = _pipe_fit(root, os.path.join(root, "opted"), weights_only=False).global_step
    return out


def test_pipeline_ckpt_path(tmp_path: Path) -> None:
    marker, opt_in_marker = tmp_path / "MARKER", tmp_path / "OPTED_IN"
    run_distributed(_lightning_pipe, 2, str(tmp_path), "save", init_process_group=False, timeout=300)
    for name, mark in (("planted", marker), ("opted", opt_in_marker)):
        shutil.copytree(tmp_path / "honest", tmp_path / name)
        _plant(tmp_path / name / "client_state.pt", mark)
    for r in run_distributed(_lightning_pipe, 2, str(tmp_path), "resume", init_process_group=False, timeout=300):
        assert r["honest"] > 0 and r["opted_in"] > 0
        _assert_refused(r["refused"], "client_state.pt", "weights_only=False")
    assert not marker.exists()
    assert opt_in_marker.exists()


# ==================================================================== compression export
def test_compression_export_refuses_planted_pickle(tmp_path: Path) -> None:
    from zlightning.compression import load_compressed

    marker, path = tmp_path / "MARKER", tmp_path / "export.pt"
    torch.save(
        {
            "format": "zlightning.compressed.v1",
            "tensors": {},
            "quantized": {},
            "aliases": {},
            "attributes": {},
            "planted": _Planted(marker),
        },
        path,
    )
    with pytest.raises(UnsafeCheckpointError, match="not written by zlightning") as info:
        load_compressed(path, torch.nn.Linear(2, 2))
    _assert_refused(str(info.value), "export.pt", "")
    assert not marker.exists()


# ==================================================================== DeepSpeed sampler state
def _as_numpy_1(path: Path) -> None:
    """Rewrites a torch.save file as numpy 1.x pickles it (``numpy.core`` instead of ``numpy._core``)."""
    with zipfile.ZipFile(path) as z:
        entries = [(info, z.read(info)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                data = data.replace(b"numpy._core.multiarray", b"numpy.core.multiarray")
            z.writestr(info, data)


@pytest.mark.parametrize("numpy_1", [False, True])
def test_deepspeed_sampler_state_loads_without_running_code(tmp_path: Path, numpy_1: bool) -> None:
    from zlightning.datamodules import read_deepspeed_sampler_state

    from tests.test_curriculum_deepspeed_state import _config, _deepspeed_0_19_8_checkpoint, _sampler, _take

    state, _ = _deepspeed_0_19_8_checkpoint(tmp_path, 4, 2)
    # As DeepSpeed pickles it: numpy scalars among the ids and counters, the global numpy RNG state (an array).
    ds_state = {**state, "batch": [np.int64(i) for i in state["batch"]], "consumed_samples": np.int64(16)}
    ckpt = tmp_path / "global_step3" / "mp_rank_00_model_states.pt"
    ckpt.parent.mkdir()
    torch.save({"module": {}, "data_sampler": ds_state, "ds_version": "0.19.8"}, ckpt)
    if numpy_1:
        _as_numpy_1(ckpt)
    loaded = read_deepspeed_sampler_state(ckpt)
    assert loaded["batch"] == state["batch"] and type(loaded["consumed_samples"]) is int
    cfg = _config(tmp_path, tmp_path / "ds_run" / "clusters")
    imported, reference = _sampler(cfg, b=4, A=2), _sampler(cfg, b=4, A=2)
    imported.load_state_dict(loaded)
    reference.load_state_dict(state)
    assert _take(imported, 20) == _take(reference, 20)

    marker = tmp_path / "MARKER"
    _plant(ckpt, marker)
    with pytest.raises(UnsafeCheckpointError) as info:
        read_deepspeed_sampler_state(ckpt)
    _assert_refused(str(info.value), "mp_rank_00_model_states.pt", "weights_only=False")
    assert not marker.exists()


def test_real_deepspeed_sampler_file_loads_weights_only(tmp_path: Path) -> None:
    from zlightning.datamodules import read_deepspeed_sampler_state

    from tests.test_curriculum_deepspeed_state import _DS_SCRIPT, _DS_VENV_PYTHON, _config, _sampler

    if not _DS_VENV_PYTHON.exists():
        pytest.skip("needs benchmarks/.venv-deepspeed (setup_deepspeed_venv.sh)")
    cfg = _config(tmp_path, tmp_path / "ds_clusters", step=2, total=40)
    ds_cfg = {"enabled": True, **cfg, "data_sampling": {**cfg["data_sampling"], "enabled": True}}
    env = {
        "PATH": "/usr/bin:/bin",
        "DS_ACCELERATOR": "cpu",
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_PORT": str(29500 + os.getpid() % 1000),
    }
    out = tmp_path / "mp_rank_00_model_states.pt"
    proc = subprocess.run(
        [str(_DS_VENV_PYTHON), "-c", _DS_SCRIPT, json.dumps(ds_cfg), str(out), "23"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = read_deepspeed_sampler_state(out)
    s = _sampler(cfg, b=4, A=2)
    s.load_state_dict(state)
    assert s.consumed_samples == 23 * 4


def test_a_gpt_config_in_hyper_parameters_loads_weights_only(tmp_path: Path) -> None:
    """HybridCPGPTModule and the pipeline GPT keep a GPTConfig in their hyper-parameters; Lightning's own strategies
    load checkpoints with ``weights_only=True``, which refused it (resume under ``strategy="ddp"`` needed the unsafe
    opt-in). It is a data-only dataclass on the allow list; other classes stay refused."""
    from zlightning.models.gpt_model import GPTConfig

    path = tmp_path / "hp.ckpt"
    torch.save({"hyper_parameters": {"config": GPTConfig(d_model=64, n_head=2)}}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["hyper_parameters"]["config"] == GPTConfig(d_model=64, n_head=2)
