"""The ``zlightning`` command: Lightning's ``LightningCLI`` with zlightning's strategies registered.

Usage::

    zlightning fit --config examples/gpt_zero3.yaml
    zlightning fit --config examples/gpt_zero3.yaml --trainer.max_steps=50 --model.d_model=128
    zlightning fit --help
    zlightning fit --trainer.strategy.help zlightning.strategies.ZStackZero3Strategy

The subcommands are LightningCLI's (``fit``, ``validate``, ``test``, ``predict``). ``model`` and ``data`` are given
by class path (``subclass_mode_model=True`` / ``subclass_mode_data=True``), e.g.::

    model:
      class_path: examples.gpt.GPTLightningModule
      init_args: {d_model: 256, n_layer: 4}
    data:
      class_path: zlightning.datamodules.TextCorpusDataModule
    trainer:
      strategy:
        class_path: zlightning.strategies.ZStackZero3Strategy
        init_args: {zero: {prefetch_bucket_size: 10000000, unit_modules: [Block]}}

``trainer.strategy: zstack_zero3`` (the registered name) works too, with the default `ZeroConfig`.

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

import os
import sys
from collections.abc import Callable
from typing import Any

# Imported for its side effect: registering "zstack_zero3" (and later strategies) in Lightning's StrategyRegistry,
# so `trainer.strategy: zstack_zero3` resolves. It must precede LightningCLI's parsing.
import zlightning  # noqa: F401
from jsonargparse import set_parsing_settings
from lightning.pytorch.cli import LightningCLI

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
        "--unsafe-load", action="store_true",
        help="unpickle the model files in full (torch.load weights_only=False), which can run code stored in them: "
        "only for checkpoints from a source you trust whose buffers or extra state are not plain data",
    )
    a = p.parse_args(argv)
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
    src.add_argument("--model", help="class path of the model, e.g. examples.gpt.GPTLightningModule (built on meta)")
    src.add_argument("--params", type=float, help="parameter count, e.g. 7e9")
    p.add_argument("--init-args", default="{}", help='JSON keyword arguments for --model, e.g. \'{"d_model": 512}\'')
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--stage", type=int, choices=[1, 2, 3], default=3)
    p.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed, ...")
    p.add_argument("--offload", choices=["none"], default="none", help="CPU/NVMe offload: not available yet")
    a = p.parse_args(argv)
    module = None
    if a.model:
        mod_name, _, cls_name = a.model.rpartition(".")
        cls = getattr(importlib.import_module(mod_name), cls_name)
        with torch.device("meta"):
            module = cls(**json.loads(a.init_args))
    est = estimate_zero_memory(
        world_size=a.world_size, module=module, num_params=int(a.params) if a.params else None,
        stage=a.stage, precision=a.precision,
    )
    print(f"per-rank model states (ZeRO stage {a.stage}, {a.world_size} ranks, {a.precision}):")
    for key, value in est.as_dict().items():
        print(f"  {key:20s} {value / 2**30:10.3f} GiB")


def _analyze(argv: list[str]) -> None:
    """``zlightning analyze``: the curriculum DataAnalyzer (metric index files for DeepSpeedDataSampler)."""
    from zlightning.datamodules.curriculum_cli import analyze_main

    analyze_main(argv)


def _kernels(argv: list[str]) -> None:
    """``zlightning kernels [--build] [--json]``: native kernel report (compiled or fallback, ISA, flags, versions)."""
    from zlightning.kernels._report import main as kernels_main

    kernels_main(argv)


EXTRA_COMMANDS: dict[str, Command] = {"consolidate": _consolidate, "estimate": _estimate, "analyze": _analyze}
"""Subcommands dispatched before LightningCLI, by name (the first argument): ``consolidate``, ``estimate``,
``analyze``; every other first argument (``fit``, ``validate``, ``--help``, ...) goes to LightningCLI."""
EXTRA_COMMANDS["kernels"] = _kernels  # issue 9: native kernel report


_HELP_EPILOG = (
    "ZeRO-3 knobs: --trainer.strategy.help zlightning.strategies.ZStackZero3Strategy"
)


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
        EXTRA_COMMANDS[argv[0]](argv[1:])
        return
    # See [Note: where the ZeroConfig knobs are documented].
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=_parser_kwargs(),
        # None lets LightningCLI read sys.argv itself (passing both warns, see LightningCLI.parse_arguments).
        args=args,
    )


if __name__ == "__main__":
    main()
