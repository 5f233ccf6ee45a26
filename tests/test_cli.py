"""The ``zlightning`` command (`zlightning.cli`): help, config resolution, and an end-to-end ZeRO-3 run.

Help and ``--print_config`` run in-process (`main` with an explicit argument list, SystemExit caught); training runs
as a subprocess (``python -m zlightning.cli``) because the ``popen`` launcher re-runs the command for rank 1.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from zlightning.cli import main
from zlightning.zero import ZeroConfig
from zlightning.zero._config import MixedPrecisionPolicy

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/gpt_zero3.yaml"
STRATEGY = "zlightning.strategies.ZStackZero3Strategy"

# Overrides that shrink examples/gpt_zero3.yaml to a few seconds on 2 CPU processes. limit_val_batches is 2, not 1:
# Trainer types it float-first, so the CLI reads "1" as 1.0, which means "all validation batches".
TINY = [
    "--trainer.accelerator=cpu",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--model.d_model=32",
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.seq_len=32",
    "--data.seq_len=32",
    "--data.max_bytes=100000",
]


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    if not isinstance(body, ast.ClassDef):
        raise AssertionError(f"{cls.__name__}: expected a class definition, got {type(body).__name__}")
    docs: dict[str, str] = {}
    for node, after in zip(body.body, body.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
        ):
            docs[node.target.id] = str(after.value.value)
    return docs


def _words(text: str) -> str:
    return " ".join(text.split())


def _run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Runs `main(args)` from the repository root, expecting it to exit 0, and returns its stdout."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code in (0, None), capsys.readouterr().err
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def _isolated_process_state(monkeypatch: pytest.MonkeyPatch) -> None:
    # main() puts the working directory on sys.path; LightningCLI warns when sys.argv also holds arguments.
    monkeypatch.chdir(REPO_ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", ["zlightning"])


def test_fit_help_points_to_strategy_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_main(["fit", "--help"], capsys)
    assert "--trainer.strategy STRATEGY" in out
    assert "--model CONFIG" in out and "--data CONFIG" in out
    assert f"--trainer.strategy.help {STRATEGY}" in _words(out)


def test_strategy_class_help_lists_every_zero_knob_with_its_doc(capsys: pytest.CaptureFixture[str]) -> None:
    strategy_help = _run_main(["fit", "--trainer.strategy.help", STRATEGY], capsys)
    assert "--trainer.strategy.start_method {popen,spawn,fork,forkserver}" in strategy_help
    out = _words(strategy_help)
    for cls, prefix in ((ZeroConfig, "zero."), (MixedPrecisionPolicy, "zero.mixed_precision.")):
        docs = _attribute_docs(cls)
        for field in dataclasses.fields(cls):
            assert field.name in docs, f"{cls.__name__}.{field.name} has no docstring to show"
            if field.name != "mixed_precision":  # a nested dataclass: its doc titles the group of its fields
                assert f"--trainer.strategy.{prefix}{field.name}" in out
            # rstrip: a group title ends with ":" instead of the doc's final period
            doc = _words(docs[field.name]).rstrip(".")
            assert doc in out, f"{cls.__name__}.{field.name}: its doc is missing from the help"


def test_print_config_resolves_strategy_class_and_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_main(["fit", "--config", CONFIG, "--print_config"], capsys)
    config = yaml.safe_load(out)
    strategy = config["trainer"]["strategy"]
    assert strategy["class_path"] == STRATEGY
    zero = strategy["init_args"]["zero"]
    assert zero["unit_modules"] == ["Block"]
    assert zero["prefetch_bucket_size"] == 2_000_000
    assert zero["reduce_bucket_size"] == ZeroConfig().reduce_bucket_size  # unset knobs keep ZeroConfig's defaults
    assert config["model"]["class_path"] == "zlightning.models.GPTLightningModule"
    assert config["model"]["init_args"]["d_model"] == 256
    assert config["data"]["class_path"] == "zlightning.datamodules.TextCorpusDataModule"
    assert config["trainer"]["devices"] == 2
    assert config["trainer"]["logger"]["init_args"]["save_dir"] == "runs"


def test_print_config_accepts_registered_strategy_name(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_main(["fit", "--config", CONFIG, "--trainer.strategy=zstack_zero3", "--print_config"], capsys)
    assert yaml.safe_load(out)["trainer"]["strategy"] == "zstack_zero3"


def test_invalid_knob_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, "--trainer.strategy.init_args.zero.overlpa_comm=false", "--print_config"])
    assert exit_info.value.code != 0
    assert "overlpa_comm" in capsys.readouterr().err


def _run_cli(args: list[str], save_dir: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "zlightning.cli", *args, f"--trainer.logger.init_args.save_dir={save_dir}"]
    return subprocess.run(
        command, cwd=REPO_ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=240, check=False
    )


def _events_files(save_dir: Path) -> list[Path]:
    return sorted(save_dir.glob("gpt_zero3/version_*/events.out.tfevents.*"))


@pytest.mark.slow
def test_fit_end_to_end_two_processes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "fit",
        "--config",
        CONFIG,
        *TINY,
        "--trainer.max_steps=3",
        "--trainer.val_check_interval=3",
        f"--trainer.callbacks.init_args.dirpath={tmp_path / 'ckpt'}",
    ]
    result = _run_cli(args, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Starting with 2 processes" in output
    assert _events_files(tmp_path), f"no TensorBoard events under {tmp_path}: {sorted(tmp_path.rglob('*'))}"
    assert list(tmp_path.glob("gpt_zero3/version_*/config.yaml")), "LightningCLI did not save the run's config"
    # what the run prints: the summary of `make demo`, the sharded sizes, and none of Lightning's noise
    for label in ("final training loss", "final validation loss", "throughput", "logs", "checkpoint"):
        assert label in result.stdout, output[-3000:]
    assert "this rank holds" in result.stdout
    for noise in ("Tip:", "LeafSpec", "Total FLOPs", "is not supported by the model summary", "[rank1]: Traceback"):
        assert noise not in output, noise
    # the example YAML keeps last.ckpt, which the README's next command consolidates
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir(), sorted(p.name for p in tmp_path.rglob("*"))
    out = tmp_path / "model.pt"
    main(["consolidate", str(last), str(out), "--no-progress"])
    assert f"wrote {out}" in capsys.readouterr().out
    import torch

    assert any(k.endswith("tok_emb.weight") for k in torch.load(out, weights_only=True))


@pytest.mark.slow
def test_validate_one_process(tmp_path: Path) -> None:
    result = _run_cli(["validate", "--config", CONFIG, *TINY, "--trainer.devices=1"], tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "val/loss" in result.stdout
    assert _events_files(tmp_path)


@pytest.mark.slow
def test_test_and_predict_two_processes(tmp_path: Path) -> None:
    result = _run_cli(["test", "--config", CONFIG, *TINY, "--trainer.limit_test_batches=2"], tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "test/loss" in result.stdout
    result = _run_cli(["predict", "--config", CONFIG, *TINY, "--trainer.limit_predict_batches=2"], tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


# ---------------------------------------------------------------------------------------------------- first hour
def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "consolidate", "estimate", "analyze", "kernels"):
        assert f"  {command} " in out, out
    assert "zstack_zero3_offload" in out


def test_unknown_command_suggests_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidat", "a", "b"])
    assert exit_info.value.code == 2
    assert "did you mean 'consolidate'" in capsys.readouterr().err


def test_strategy_typo_suggests_the_registered_name(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, *TINY, "--trainer.strategy=zstack_zer03"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "'zstack_zer03' is not a registered strategy" in err and "did you mean 'zstack_zero3'" in err
    assert "zstack_zero3_offload" in err


def test_sizes_accept_integral_floats_and_suffixes(capsys: pytest.CaptureFixture[str]) -> None:
    out = _run_main(
        [
            "fit",
            "--config",
            CONFIG,
            "--trainer.strategy.zero.prefetch_bucket_size=5e7",
            "--trainer.strategy.zero.reduce_bucket_size=50M",
            "--print_config",
        ],
        capsys,
    )
    zero = yaml.safe_load(out)["trainer"]["strategy"]["init_args"]["zero"]
    assert zero["prefetch_bucket_size"] == 50_000_000 and zero["reduce_bucket_size"] == 50_000_000
    with pytest.raises(SystemExit):
        main(["fit", "--config", CONFIG, "--trainer.strategy.zero.reduce_bucket_size=200MB", "--print_config"])
    assert "counts tensor elements" in capsys.readouterr().err


def test_tools_report_a_missing_path_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["consolidate", str(tmp_path / "runs" / "last.ckpt"), str(tmp_path / "model.pt")])
    assert "last.ckpt does not exist" in str(exit_info.value.code)
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--save-path", str(tmp_path / "analysis"), "--data-dir", str(tmp_path / "corpus")])
    message = str(exit_info.value.code)
    assert message.startswith("zlightning analyze: ") and "corpus' does not exist" in message


def test_offload_name_over_the_yaml_keeps_its_zero_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    from zlightning.cli import _config_strategy, _strategy_over_config
    from zlightning.zero import CPUOffload

    block, name = _config_strategy(["fit", "--config", CONFIG, "--trainer.strategy=zstack_zero3_offload"])
    assert name == "zstack_zero3_offload" and block is not None
    strategy = _strategy_over_config(block, name)
    assert strategy.zero.unit_modules == ("Block",)
    assert strategy.zero.prefetch_bucket_size == 2_000_000
    assert strategy.zero.offload_optimizer == CPUOffload()
    err = capsys.readouterr().err
    assert (
        "added zero.offload_optimizer=CPUOffload" in err and "kept zero.prefetch_bucket_size, zero.unit_modules" in err
    )
    assert _strategy_over_config(block, "ddp") is None
    assert "replaces the config's ZStackZero3Strategy (its init_args are not used: zero)" in capsys.readouterr().err


def test_deepspeed_config_over_the_yaml_merges(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from zlightning.strategies import ZStackZero3Strategy

    from zlightning.zero import CPUOffload

    ds = tmp_path / "ds.json"
    ds.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_optimizer": {"device": "cpu"},
                    "stage3_prefetch_bucket_size": 1000000,
                }
            }
        )
    )
    out = _run_main(["fit", "--config", CONFIG, f"--trainer.strategy.config={ds}", "--print_config"], capsys)
    init_args = yaml.safe_load(out)["trainer"]["strategy"]["init_args"]
    assert init_args["config"] == str(ds) and init_args["zero"]["unit_modules"] == ["Block"]
    with caplog.at_level("INFO"):
        strategy = ZStackZero3Strategy(
            ZeroConfig(unit_modules=("Block",), prefetch_bucket_size=2_000_000), config=str(ds)
        )
    assert strategy.zero.unit_modules == ("Block",)
    assert strategy.zero.offload_optimizer == CPUOffload() and strategy.zero.prefetch_bucket_size == 1_000_000
    assert "kept from zero=: zero.unit_modules" in caplog.text
    assert "replaced zero=: zero.prefetch_bucket_size" in caplog.text


def test_estimate_with_offload(capsys: pytest.CaptureFixture[str]) -> None:
    """``zlightning estimate --offload``: the bytes leave the device for the host, then for the disk (8 ranks, 7e9
    parameters: shards of 875e6 elements, 3.26 GiB per 4 bytes an element, 16 bytes for Adam training), estimated
    for a GPU machine (``--device cuda``, whatever this machine has) unless a case gives ``--device cpu``."""

    def gib(args: list[str], key: str) -> float:
        main(["estimate", "--params", "7e9", "--world-size", "8", "--device", "cuda", *args])
        out = capsys.readouterr().out
        return float(next(line.split()[1] for line in out.splitlines() if line.split()[:1] == [key]))

    assert gib([], "device_bytes") == pytest.approx(4 * 3.26, abs=0.01)
    assert gib(["--offload", "cpu"], "device_bytes") == pytest.approx(2 * 3.26, abs=0.01)
    assert gib(["--offload", "cpu"], "host_bytes") == pytest.approx(3 * 3.26, abs=0.01)
    assert gib(["--offload", "nvme", "--offload-params", "nvme"], "nvme_bytes") == pytest.approx(4 * 3.26, abs=0.01)
    assert gib(["--offload", "cpu", "--device", "cpu"], "host_bytes") == pytest.approx(4 * 3.26, abs=0.01)
    with pytest.raises(SystemExit, match="needs offload_optimizer"):
        main(["estimate", "--params", "7e9", "--world-size", "8", "--offload-params", "nvme"])


def test_a_registered_name_with_the_strategys_knobs(tmp_path: Path) -> None:
    """``--trainer.strategy=zstack_zero3_offload --trainer.strategy.tensor_parallel_size=2`` on top of the YAML: the
    knobs parse (they failed: the name made the strategy a string), the YAML's zero knobs stay, the name's offload
    is added on every rank (both ranks re-run the rewritten command; a rank without it would hang the other)."""
    from zlightning.strategies import ZStackZero3Strategy

    from zlightning.cli import _apply_registered_zero, _name_with_knobs
    from zlightning.zero import ZeroConfig

    argv = ["fit", "--config", CONFIG, "--trainer.strategy", "zstack_zero3_offload", "--trainer.strategy.zero.stage=2"]
    rewritten, name = _name_with_knobs(argv)
    assert name == "zstack_zero3_offload"
    # the YAML's ZStackZero3Strategy block stays (naming its class again would reset its zero knobs)
    assert rewritten == ["fit", "--config", CONFIG, "--trainer.strategy.zero.stage=2"]
    no_block = ["fit", "--trainer.strategy=zstack_zero3_offload", "--trainer.strategy.tensor_parallel_size=2"]
    assert _name_with_knobs(no_block)[0] == ["fit", f"--trainer.strategy={STRATEGY}", no_block[2]]
    strategy = ZStackZero3Strategy(zero=ZeroConfig(stage=2, unit_modules=("Block",)))
    _apply_registered_zero(strategy, "zstack_zero3_nvme", ["--trainer.strategy.zero.offload_params=null"])
    assert strategy.zero.offload_optimizer is not None and strategy.zero.offload_params is None  # the user's wins
    assert strategy.zero.unit_modules == ("Block",)
    assert _name_with_knobs(["fit", "--trainer.strategy=zstack_zero3_offload"]) == (
        ["fit", "--trainer.strategy=zstack_zero3_offload"],
        None,
    )

    result = _run_cli(
        [
            "fit",
            "--config",
            CONFIG,
            *TINY,
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.strategy=zstack_zero3_offload",
            "--trainer.strategy.tensor_parallel_size=2",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "added zero.offload_optimizer=CPUOffload" in result.stderr
    assert "optimizer state offloaded (CPUOffload)" in result.stdout + result.stderr
