"""The ``zlightning`` command: Lightning's ``LightningCLI`` with zlightning's strategies registered.

Usage::

    zlightning fit --config examples/gpt_zero3.yaml
    zlightning fit --config examples/gpt_zero3.yaml --trainer.max_steps=50 --model.d_model=128
    zlightning fit --help
    zlightning fit --trainer.strategy.help zlightning.strategies.ZStackZero3Strategy
    zlightning consolidate runs/gpt_zero3/version_0/checkpoints/last.ckpt model.pt

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's; ``consolidate``, ``estimate``, ``analyze`` and
``kernels`` are zlightning tools (`EXTRA_COMMANDS`); ``zlightning --help`` lists both. ``model`` and ``data`` are
given by class path (``subclass_mode_model=True`` / ``subclass_mode_data=True``), e.g.::

    model:
      class_path: zlightning.models.GPTLightningModule
      init_args: {d_model: 256, n_layer: 4}
    data:
      class_path: zlightning.datamodules.TextCorpusDataModule
    trainer:
      strategy:
        class_path: zlightning.strategies.ZStackZero3Strategy
        init_args: {zero: {prefetch_bucket_size: 10000000, unit_modules: [Block]}}

``trainer.strategy: zstack_zero3`` (the registered name) works too, with the default `ZeroConfig`. Sizes in
elements accept ``5e7`` and ``50M`` (``zlightning.zero._config.Elements``, registered with jsonargparse there).

[Note: command-line strategy over a config's strategy]
jsonargparse replaces a config's ``trainer.strategy`` block wholesale when the command line names a registered
strategy, so ``--trainer.strategy=zstack_zero3_offload`` on top of ``examples/gpt_zero3.yaml`` silently lost the
config's ``zero:`` knobs. `main` therefore reads the strategy block of the config files itself; when the command
line then names a registered ``zstack_zero*`` strategy and the config's block is a ``ZStackZero3Strategy``, the
strategy is built from the config's block with the registered name's ZeRO settings applied on top (offload, stage),
and one line says what was kept and what was added. Naming any other strategy drops the block, and a line says
so. A DeepSpeed config given as ``--trainer.strategy.config=ds.json`` merges with the config's ``zero:`` knobs in the
strategy itself (its keys win; see ``ZStackZero3Strategy``).

A registered name followed by the strategy's own knobs (``--trainer.strategy=zstack_zero3_offload
--trainer.strategy.tensor_parallel_size=2``) cannot be parsed as given: the name makes the strategy a string,
which has no knobs. `_name_with_knobs` therefore drops the name when a config's block is a ``ZStackZero3Strategy``
(its class and knobs stay; naming the class again would reset them) and puts the class path in its place otherwise,
so the knobs parse; the built strategy then gets the name's ZeRO settings, except the ``zero.*`` knobs the command
line sets itself.

[Note: what a run prints]
The command adds the fixed progress bar, the model summary with sharded sizes and the end-of-fit summary of
``zlightning._run_report`` unless the config brings its own (or turns the bar or summary off).

[Note: where the ZeroConfig knobs are documented]
``ZStackZero3Strategy(zero: ZeroConfig = ZeroConfig())``: jsonargparse inlines a (non-optional) dataclass argument's
fields in the strategy's class help, so ``--trainer.strategy.help <class>`` lists every knob as
``--trainer.strategy.zero.<knob>``. Their documentation is the docstring under each field, which jsonargparse reads
only with ``docstring_parse_attribute_docstrings``; `main` turns that on. Every subcommand's ``--help`` ends with an
epilog naming the command.

[Note: the working directory on sys.path]
``python -m`` and ``python script.py`` put a directory on ``sys.path``; a console script (``zlightning`` installed
by pip) puts only its own ``bin/`` there. Class paths in a config such as ``examples.gpt.GPTLightningModule`` name
modules of the user's project, which lives in the directory the command is run from, so `main` puts the current
working directory at the front of ``sys.path`` before resolving any class path. Multi-process strategies that
re-launch the command per rank (``start_method="popen"``) re-run it from the same directory, so every rank resolves
the same modules.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jsonargparse import set_parsing_settings
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

# Imported for its side effect: registering "zstack_zero3" (and later strategies) in Lightning's StrategyRegistry,
# so `trainer.strategy: zstack_zero3` resolves. It must precede LightningCLI's parsing.
import zlightning  # noqa: F401
from zlightning._run_report import ModelSizeSummary, RunSummary, _RichBar, _RichSizeSummary, _TQDMBar
from zlightning._strategy_names import close_strategy_names, zstack_strategy_names

__all__ = ["EXTRA_COMMANDS", "main"]

Command = Callable[[list[str]], None]
"""A zlightning subcommand that is not a LightningCLI one: called with the arguments after its name."""


def _consolidate(argv: list[str]) -> None:
    """``zlightning consolidate CKPT_DIR OUT``: one plain state-dict file from a sharded checkpoint.

    Reads only the checkpoint's metadata and model files (never its client state), without running code from them
    unless ``--unsafe-load`` is given; a file that needs it stops the command with the refused types named.
    """
    import argparse

    import torch

    from zlightning._safe_load import UnsafeCheckpointError
    from zlightning.pipe._checkpoint import consolidate_pipeline_checkpoint, is_pipeline_checkpoint
    from zlightning.zero import consolidate

    p = argparse.ArgumentParser(prog="zlightning consolidate", description=_consolidate.__doc__)
    p.add_argument("ckpt_dir", help="checkpoint directory (as written by zstack_zero3 or zstack_pipeline)")
    p.add_argument("out", help="output file: .pt, or .safetensors when the safetensors package is installed")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="dtype of the written tensors")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--unsafe-load",
        action="store_true",
        help="unpickle the model files in full (torch.load weights_only=False), which can run code stored in them: "
        "only for checkpoints from a source you trust whose buffers or extra state are not plain data",
    )
    a = p.parse_args(argv)
    if not Path(a.ckpt_dir).exists():
        sys.exit(
            f"zlightning consolidate: {a.ckpt_dir} does not exist (give the checkpoint directory or file that "
            "trainer.save_checkpoint / ModelCheckpoint wrote, e.g. runs/gpt_zero3/version_0/checkpoints/last.ckpt)"
        )
    if Path(a.out).parent != Path("") and not Path(a.out).parent.is_dir():
        sys.exit(f"zlightning consolidate: the folder of the output file {a.out} does not exist; create it first")
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    weights_only = False if a.unsafe_load else None
    try:
        if is_pipeline_checkpoint(a.ckpt_dir):  # a zstack_pipeline checkpoint directory
            state = consolidate_pipeline_checkpoint(a.ckpt_dir, weights_only=weights_only)
            torch.save({k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}, a.out)
            out = a.out
        else:
            out = consolidate(a.ckpt_dir, a.out, dtype=dtype, progress=not a.no_progress, weights_only=weights_only)
    except UnsafeCheckpointError as err:
        sys.exit(f"zlightning consolidate: {err}")
    print(f"wrote {out}")


def _estimate(argv: list[str]) -> None:
    """``zlightning estimate``: per-rank model-state memory for ZeRO stages 1-3, from a model or a parameter count."""
    import argparse
    import importlib
    import json

    import torch

    from zlightning.zero import estimate_zero_memory

    p = argparse.ArgumentParser(prog="zlightning estimate", description=_estimate.__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--model", help="class path of the model, e.g. zlightning.models.GPTLightningModule (built on meta)"
    )
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    p.add_argument("--init-args", default="{}", help="JSON keyword arguments for --model, e.g. '{\"d_model\": 512}'")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    p.add_argument(
        "--offload",
        choices=["none", "cpu", "nvme"],
        default="none",
        help="optimizer offload: none, cpu (zstack_zero3_offload) or nvme (state in swap files)",
    )
    p.add_argument(
        "--offload-params",
        choices=["none", "nvme"],
        default="none",
        help="parameter offload: nvme keeps parameter shards in swap files (zstack_zero3_nvme; stage 3)",
    )
    p.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="compute device: cuda splits the bytes between the accelerator and the host; cpu counts all as host "
        "(default: cuda when this machine has a CUDA device, else cpu)",
    )
    a = p.parse_args(argv)
    if a.device is not None:
        device, why = a.device, "given by --device"
    elif torch.cuda.is_available():
        device, why = "cuda", "detected; --device cpu estimates for a CPU-only machine"
    else:
        device, why = "cpu", "no CUDA device here; --device cuda estimates for a GPU machine"
    from zlightning.zero import CPUOffload, NVMeOffload, ZeroConfig

    try:
        config = ZeroConfig(
            stage=a.stage,
            offload_optimizer={"none": None, "cpu": CPUOffload(), "nvme": NVMeOffload()}[a.offload],
            offload_params=NVMeOffload() if a.offload_params == "nvme" else None,
        )
    except ValueError as err:
        sys.exit(f"zlightning estimate: {err}")
    module = None
    if a.model:
        mod_name, _, cls_name = a.model.rpartition(".")
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError, ValueError) as err:
            sys.exit(
                f"zlightning estimate: cannot import --model {a.model!r} ({err}); give a class path such as "
                "zlightning.models.GPTLightningModule"
            )
        with torch.device("meta"):
            module = cls(**json.loads(a.init_args))
    est = estimate_zero_memory(
        world_size=a.world_size,
        module=module,
        num_params=int(a.params) if a.params else None,
        precision=a.precision,
        config=config,
        device_type=device,
    )
    offload = f", offload optimizer={a.offload} params={a.offload_params}, {device}"
    print(f"compute device: {device} ({why})")
    print(f"per-rank model states (ZeRO stage {a.stage}, {a.world_size} ranks, {a.precision}{offload}):")
    for key, value in est.as_dict().items():
        print(f"  {key:20s} {value / 2**30:10.3f} GiB")


def _analyze(argv: list[str]) -> None:
    """``zlightning analyze``: the curriculum DataAnalyzer (metric index files for DeepSpeedDataSampler)."""
    from zlightning.datamodules.curriculum._cli import analyze_main

    analyze_main(argv)


def _kernels(argv: list[str]) -> None:
    """``zlightning kernels [--build [--force]] [--json]``: native kernel report (compiled or fallback, ISA, flags, versions)."""
    from zlightning.kernels._report import main as kernels_main

    kernels_main(argv)


EXTRA_COMMANDS: dict[str, Command] = {
    "consolidate": _consolidate,
    "estimate": _estimate,
    "analyze": _analyze,
    "kernels": _kernels,
}
"""Subcommands dispatched before LightningCLI, by name (the first argument): ``consolidate``, ``estimate``,
``analyze``, ``kernels``; every other first argument (``fit``, ``validate``, ...) goes to LightningCLI."""

_LIGHTNING_COMMANDS = {
    "fit": "train a model (zlightning fit --config examples/gpt_zero3.yaml)",
    "validate": "one pass over the validation set",
    "test": "one pass over the test set",
    "predict": "predictions over the predict set",
}

_HELP_EPILOG = "ZeRO-3 knobs: --trainer.strategy.help zlightning.strategies.ZStackZero3Strategy"


def _overview() -> str:
    """``zlightning --help``: every command, LightningCLI's and zlightning's tools."""
    tools = {
        name: (fn.__doc__ or "").split(":", 1)[-1].strip().split("\n")[0].rstrip(".")
        for name, fn in EXTRA_COMMANDS.items()
    }
    ours = sorted(name for name in StrategyRegistry.available_strategies() if name.startswith("zstack"))
    width = max(map(len, [*_LIGHTNING_COMMANDS, *tools]))
    lines = [
        "usage: zlightning COMMAND [options]      (zlightning COMMAND --help for the options of one command)",
        "",
        "training (LightningCLI):",
    ]
    lines += [f"  {name:<{width}}  {text}" for name, text in _LIGHTNING_COMMANDS.items()]
    lines += ["", "tools:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in tools.items()]
    lines += [
        "",
        f"strategies (--trainer.strategy=NAME): {', '.join(ours)}",
        "ZeRO-3 knobs: zlightning fit --trainer.strategy.help zlightning.strategies.ZStackZero3Strategy",
    ]
    return "\n".join(lines)


def _put_cwd_on_path() -> None:
    """Puts the current working directory first on ``sys.path``. See [Note: the working directory on sys.path]."""
    cwd = os.getcwd()
    if cwd in sys.path:
        sys.path.remove(cwd)
    sys.path.insert(0, cwd)


def _parser_kwargs() -> dict[str, Any]:
    """LightningCLI ``parser_kwargs``: the program name, and the knob epilog on the main and subcommand parsers.

    LightningCLI applies keys named after a subcommand to that subcommand's parser and the others to the main one.
    """
    per_subcommand = {name: {"epilog": _HELP_EPILOG} for name in LightningCLI.subcommands()}
    return {"prog": "zlightning", "epilog": _HELP_EPILOG, **per_subcommand}


def _say(message: str) -> None:
    """Prints a line of the command's own, once per run (the launching process; ranks re-run the command)."""
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        print(f"zlightning: {message}", file=sys.stderr, flush=True)


# ==================================================================== strategy from the command line
def _registered_strategy_error(name: str) -> str | None:
    """The error for a strategy name that is not registered (with the closest registered names), or None."""
    available = StrategyRegistry.available_strategies()
    if name == "auto" or name in available or "." in name:
        return None
    close = close_strategy_names(name, available)
    ours = zstack_strategy_names(available)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return (
        f"trainer.strategy={name!r} is not a registered strategy: {hint}zlightning's strategies: "
        f"{', '.join(ours)}; Lightning's include ddp, fsdp, deepspeed (a class path such as "
        "zlightning.strategies.ZStackZero3Strategy works too)"
    )


def _config_strategy(argv: list[str]) -> tuple[dict[str, Any] | None, str | None]:
    """The ``trainer.strategy`` block of the last config file on the command line that has one, and the strategy
    name given on the command line after it (``--trainer.strategy=NAME``). See [Note: command-line strategy over a
    config's strategy]."""
    import yaml

    block: dict[str, Any] | None = None
    name: str | None = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, value = arg.partition("=")
        if not eq and i + 1 < len(argv) and key in ("--config", "-c", "--trainer.strategy"):
            value, i = argv[i + 1], i + 1
        if key in ("--config", "-c"):
            try:
                loaded = yaml.safe_load(Path(value).read_text())
            except (OSError, yaml.YAMLError):
                loaded = None  # LightningCLI reports an unreadable config itself
            found = (loaded.get("trainer") or {}).get("strategy") if isinstance(loaded, dict) else None
            if isinstance(found, dict) and "class_path" in found:
                block, name = found, None
        elif key == "--trainer.strategy" and "." not in value:
            name = value
        i += 1
    return block, name


_ZERO3_PATH = "zlightning.strategies.ZStackZero3Strategy"
_NAME_ENV = "ZLIGHTNING_CLI_STRATEGY_NAME"


def _name_with_knobs(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` with a registered ``zstack_zero*`` name that is followed by ``--trainer.strategy.*`` knobs replaced by
    the strategy's class path, and that name (None when nothing was replaced). See [Note: command-line strategy over a
    config's strategy]."""
    from zlightning.strategies import ZStackZero3Strategy

    found: tuple[int, int, str] | None = None
    for i, arg in enumerate(argv):
        key, eq, value = arg.partition("=")
        if key == "--trainer.strategy":
            width = 1 if eq else 2
            value = value if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            found = (i, width, value) if "." not in value else None
    knobs = [a for a in argv if a.startswith("--trainer.strategy.") and not a.startswith("--trainer.strategy.help")]
    if found is None or not knobs:
        return argv, None
    i, width, name = found
    entry = dict.get(StrategyRegistry, name)  # the registration (its .get would build the strategy)
    if entry is None or entry["strategy"] is not ZStackZero3Strategy:
        return argv, None
    block, _ = _config_strategy(argv[:i])
    if block is not None and str(block.get("class_path", "")).rpartition(".")[2] == "ZStackZero3Strategy":
        return [*argv[:i], *argv[i + width :]], name  # the config's class and knobs stay; the name is applied later
    return [*argv[:i], f"--trainer.strategy={_ZERO3_PATH}", *argv[i + width :]], name


def _apply_registered_zero(strategy: Any, name: str, argv: list[str]) -> None:
    """Applies the ZeRO settings registered under ``name`` to ``strategy`` (built from the class path and the knobs),
    except the ``zero.*`` knobs given in ``argv``."""
    from zlightning.zero import ZeroConfig

    entry = dict.get(StrategyRegistry, name) or {}  # the registration (its .get would build the strategy)
    registered = entry.get("init_params", {}).get("zero", ZeroConfig())
    given = {
        a.partition("=")[0].rsplit(".", 1)[-1]
        for a in argv
        if a.startswith(("--trainer.strategy.zero.", "--trainer.strategy.init_args.zero."))
    }
    default = ZeroConfig()
    added = {
        f.name: getattr(registered, f.name)
        for f in dataclasses.fields(ZeroConfig)
        if getattr(registered, f.name) != getattr(default, f.name) and f.name not in given
    }
    strategy.zero = dataclasses.replace(strategy.zero, **added)
    what = ", ".join(f"zero.{k}={v!r}" for k, v in added.items()) or "nothing"
    _say(f"--trainer.strategy={name} with the strategy's knobs from the command line: added {what}")


def _strategy_over_config(block: dict[str, Any], name: str) -> Any:
    """The strategy for ``--trainer.strategy=NAME`` given on top of a config whose strategy is ``block``: the config's
    ``ZStackZero3Strategy`` with NAME's ZeRO settings applied, or None when NAME replaces it (said in one line)."""
    from jsonargparse import ArgumentParser

    from zlightning.strategies import ZStackZero3Strategy
    from zlightning.zero import ZeroConfig

    entry = dict.get(StrategyRegistry, name)  # the registration (its .get would build the strategy)
    cls_name = str(block.get("class_path", "")).rpartition(".")[2]
    if (
        entry is None
        or cls_name not in ("ZStackZero3Strategy", "ZeroStrategy")
        or entry["strategy"] is not ZStackZero3Strategy
    ):
        kept = ", ".join(sorted((block.get("init_args") or {}).keys())) or "nothing"
        _say(f"--trainer.strategy={name} replaces the config's {cls_name} (its init_args are not used: {kept})")
        return None
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(ZStackZero3Strategy, "strategy")
    base = parser.instantiate_classes(parser.parse_object({"strategy": block})).strategy
    registered = entry["init_params"].get("zero", ZeroConfig())
    default = ZeroConfig()
    added = {
        f.name: getattr(registered, f.name)
        for f in dataclasses.fields(ZeroConfig)
        if getattr(registered, f.name) != getattr(default, f.name)
    }
    kept_knobs = [
        f"zero.{f.name}"
        for f in dataclasses.fields(ZeroConfig)
        if getattr(base.zero, f.name) != getattr(default, f.name) and f.name not in added
    ]
    base.zero = dataclasses.replace(base.zero, **added)
    what = ", ".join(f"zero.{k}={v!r}" for k, v in added.items()) or "nothing"
    _say(
        f"--trainer.strategy={name} applied on top of the config's {cls_name}: added {what}; kept "
        f"{', '.join(kept_knobs) or 'no other knob'} from the config"
    )
    return base


class _CLI(LightningCLI):
    """LightningCLI with zlightning's checks before anything is built and its callbacks (see [Note: what a run
    prints] and [Note: command-line strategy over a config's strategy])."""

    strategy_block: dict[str, Any] | None = None
    strategy_name: str | None = None
    name_with_knobs: str | None = None  # see [Note: command-line strategy over a config's strategy]
    argv: list[str] = []

    def before_instantiate_classes(self) -> None:
        config = self.config.get(str(self.subcommand), self.config)
        strategy = config.get("trainer", {}).get("strategy") if hasattr(config, "get") else None
        if isinstance(strategy, str):
            problem = _registered_strategy_error(strategy)
            if problem is not None:
                print(f"zlightning {self.subcommand}: {problem}", file=sys.stderr)
                raise SystemExit(2)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init.get(str(self.subcommand), self.config_init)
        strategy = config.get("trainer", {}).get("strategy")
        if isinstance(strategy, str) and self.strategy_block is not None and strategy == self.strategy_name:
            merged = _strategy_over_config(self.strategy_block, strategy)
            if merged is not None:
                kwargs["strategy"] = merged
        if self.name_with_knobs is not None and hasattr(strategy, "zero"):
            _apply_registered_zero(strategy, self.name_with_knobs, self.argv)
        return super().instantiate_trainer(**kwargs)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Any:
        given = config.get("callbacks") or []
        given = given if isinstance(given, list) else [given]
        everything = [*given, *callbacks]
        extra: list[Callback] = []
        if config.get("enable_progress_bar", True) is not False and not any(
            isinstance(c, ProgressBar) for c in everything
        ):
            extra.append(_RichBar() if _RICH_AVAILABLE else _TQDMBar())
        if config.get("enable_model_summary", True) is not False and not any(
            isinstance(c, ModelSummary) for c in everything
        ):
            extra.append(_RichSizeSummary() if _RICH_AVAILABLE else ModelSizeSummary())
        if self.subcommand == "fit" and not any(isinstance(c, RunSummary) for c in everything):
            extra.append(RunSummary())
        return super()._instantiate_trainer(config, [*callbacks, *extra])


def main(args: list[str] | None = None) -> None:
    """Runs the ``zlightning`` command.

    Args:
        args: Command-line arguments without the program name (``["fit", "--config", "cfg.yaml"]``); None reads
            ``sys.argv[1:]``.

    Raises:
        SystemExit: As argparse does, for ``--help``, ``--print_config`` and invalid arguments.
    """
    argv = sys.argv[1:] if args is None else list(args)
    _put_cwd_on_path()
    if argv and argv[0] in EXTRA_COMMANDS:
        try:
            EXTRA_COMMANDS[argv[0]](argv[1:])
        except (OSError, ValueError) as err:  # a missing path, a bad value: one line (the traceback on request)
            if os.environ.get("ZLIGHTNING_FULL_TRACEBACK") == "1":
                raise
            sys.exit(f"zlightning {argv[0]}: {type(err).__name__}: {err} (ZLIGHTNING_FULL_TRACEBACK=1 shows where)")
        return
    if not argv or argv[0] in ("-h", "--help"):
        print(_overview())
        raise SystemExit(0 if argv else 2)
    if not argv[0].startswith("-") and argv[0] not in _LIGHTNING_COMMANDS:
        close = difflib.get_close_matches(argv[0], [*_LIGHTNING_COMMANDS, *EXTRA_COMMANDS], n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        print(f"zlightning: unknown command {argv[0]!r}; {hint}run zlightning --help for the list", file=sys.stderr)
        raise SystemExit(2)
    # See [Note: where the ZeroConfig knobs are documented].
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    argv, _CLI.name_with_knobs = _name_with_knobs(argv)
    # ranks re-run the rewritten command (Lightning's launcher reads sys.argv): the name travels in the environment,
    # tied to that exact command line
    signature = hashlib.sha256("\0".join(argv).encode()).hexdigest()[:16]
    if _CLI.name_with_knobs is not None:
        os.environ[_NAME_ENV] = f"{_CLI.name_with_knobs}:{signature}"
    else:
        saved_name, _, saved_signature = os.environ.get(_NAME_ENV, "").partition(":")
        _CLI.name_with_knobs = saved_name if saved_name and saved_signature == signature else None
    _CLI.argv = argv
    _CLI.strategy_block, _CLI.strategy_name = _config_strategy(argv)
    if _CLI.name_with_knobs is not None and args is None:
        sys.argv = [sys.argv[0], *argv]  # LightningCLI reads sys.argv itself (see below)
    _CLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=_parser_kwargs(),
        # None lets LightningCLI read sys.argv itself (passing both warns, see LightningCLI.parse_arguments).
        args=argv if args is not None else None,
    )


if __name__ == "__main__":
    main()
