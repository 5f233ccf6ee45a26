"""Every code block of README.md and the documentation site (docs/**/*.md), as a new user meets it.

Python blocks are programs and run as written, from an empty directory, in a subprocess. Shell blocks are commands:
each line is checked by what it is (a ``make`` target exists, ``zlightning fit ...`` parses with every override and
its config file through ``--print_config``, a script exists and answers ``--help``, a file it names exists). YAML
and JSON blocks parse. ``text`` blocks are output shown to the reader and are not run.

How a block says what it is (an HTML comment on the line before the fence, invisible on the rendered page):

- no comment: a ``python`` block is a whole program;
- ``<!-- continued -->``: the block extends the program before it on the same page (the chain runs once, as one
  file, so a page can show a program in steps);
- ``<!-- gpu -->``: a whole program that needs a CUDA device; it runs where one is present (``make gpu-check``).

Programs run with a ``sitecustomize`` that caps ``Trainer(max_steps=...)``, ``val_check_interval`` and
``limit_val_batches`` at a few, which is the only difference from running them by hand.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python", "bash", "yaml", "json", "text"}
MARKERS = {"continued", "gpu"}

_TINY_SITECUSTOMIZE = textwrap.dedent(
    """
    import os

    import sys

    # only the program itself and its re-runs for other ranks (Inductor's helper interpreters skip the import)
    if os.environ.get("ZLIGHTNING_README_TINY") == "1" and sys.argv[0].endswith("snippet.py"):
        import lightning.pytorch as pl

        _init = pl.Trainer.__init__

        def _tiny(self, *args, **kwargs):
            for key, cap in (("max_steps", 3), ("val_check_interval", 3), ("limit_val_batches", 2)):
                value = kwargs.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > cap:
                    kwargs[key] = cap
            _init(self, *args, **kwargs)

        pl.Trainer.__init__ = _tiny
    """
)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    language: str
    marker: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


_FENCE = re.compile(r"^(?:<!-- *(?P<marker>[\w-]+) *-->\n)?```(?P<info>[^\n`]*)\n(?P<code>.*?)^```", re.M | re.S)


def page_blocks(path: Path) -> list[Block]:
    """Every fenced block of one page (fences at the start of a line, as both renderers read them)."""
    text = path.read_text()
    name = str(path.relative_to(ROOT))
    return [
        Block(
            page=name,
            line=text.count("\n", 0, m.start("info")) + 1,
            language=m.group("info").strip(),
            marker=m.group("marker") or "",
            code=m.group("code"),
        )
        for m in _FENCE.finditer(text)
    ]


ALL_BLOCKS = [block for page in PAGES for block in page_blocks(page)]


def programs(blocks: list[Block]) -> list[tuple[Block, str]]:
    """``(first block, source)`` of every Python program, continued blocks appended to the one before them."""
    found: list[tuple[Block, str]] = []
    for block in blocks:
        if block.language != "python":
            continue
        if block.marker == "continued":
            if not found or found[-1][0].page != block.page:
                raise AssertionError(f"{block.where}: a continued block with no program before it on its page")
            first, code = found[-1]
            found[-1] = (first, code + "\n" + block.code)
        else:
            found.append((block, block.code))
    return found


PROGRAMS = programs(ALL_BLOCKS)


def test_every_block_names_a_known_language_and_marker() -> None:
    problems = [
        f"{b.where}: fence language {b.language!r} (use one of {sorted(LANGUAGES)})"
        for b in ALL_BLOCKS
        if b.language not in LANGUAGES
    ]
    problems += [
        f"{b.where}: marker {b.marker!r} (use one of {sorted(MARKERS)})"
        for b in ALL_BLOCKS
        if b.marker not in MARKERS | {""}
    ]
    problems += [
        f"{b.where}: only python blocks take a marker" for b in ALL_BLOCKS if b.marker and b.language != "python"
    ]
    assert not problems, "\n".join(problems)


def test_python_blocks_parse_and_import_only_public_names() -> None:
    problems = []
    for block in ALL_BLOCKS:
        if block.language != "python":
            continue
        try:
            tree = ast.parse(block.code)
        except SyntaxError as err:
            problems.append(f"{block.where}: not valid Python: {err}")
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "zlightning":
                problems += _private_names(block, node.module, [alias.name for alias in node.names])
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "examples":
                problems.append(f"{block.where}: `examples` imports only from the repository root")
    assert not problems, "\n".join(problems)


def _private_names(block: Block, module: str, names: list[str]) -> list[str]:
    if any(part.startswith("_") for part in module.split(".")):
        return [f"{block.where}: imports from the private module {module}"]
    exported = getattr(importlib.import_module(module), "__all__", None)
    if exported is None:
        return []
    return [
        f"{block.where}: {module}.{name} is not in {module}.__all__ (the API reference lists __all__)"
        for name in names
        if name not in exported
    ]


def test_yaml_and_json_blocks_parse() -> None:
    for block in ALL_BLOCKS:
        if block.language == "yaml":
            yaml.safe_load(block.code)
        elif block.language == "json":
            json.loads(block.code)


@pytest.mark.slow
@pytest.mark.parametrize(
    "first,code",
    [pytest.param(first, code, marks=[pytest.mark.gpu] if first.marker == "gpu" else []) for first, code in PROGRAMS],
    ids=[first.where for first, _ in PROGRAMS],
)
def test_program_runs_as_written(first: Block, code: str, tmp_path: Path) -> None:
    if first.marker == "gpu" and not torch.cuda.is_available():
        pytest.skip("a CUDA program: runs under make gpu-check")
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_TINY_SITECUSTOMIZE)
    work = tmp_path / "work"
    work.mkdir()
    script = work / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCAL_RANK", "RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=str(site), ZLIGHTNING_README_TINY="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, script.name], cwd=work, env=env, capture_output=True, text=True, timeout=420, check=False
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{first.where} failed as written:\n{output[-5000:]}"
    assert "Traceback" not in output, f"{first.where} printed a traceback:\n{output[-5000:]}"


# Shell blocks: one check per kind of command.


def _commands(code: str) -> list[list[str]]:
    """The block's commands as argument lists: comments dropped, backslash continuations joined."""
    joined = re.sub(r"\\\n\s*", " ", code)
    commands = []
    for line in joined.splitlines():
        line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if line:
            commands.append(shlex.split(line))
    return commands


@cache
def _make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([\w-]+):", text, flags=re.M))


@cache
def _run_cached(args: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False)


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Runs a check once per distinct command line (pages show one script with several flag sets)."""
    return _run_cached(tuple(args))


_BIN = Path(sys.executable).parent
_ZL_RUN_COMMANDS = {"fit", "validate", "test", "predict"}
_NOT_RUN = {"pip", "torchrun", "tensorboard", "cd", "export", "git", "srun", "sbatch", "fio", "apt-get", "bash"}


def _unknown_flags(args: list[str], help_text: str) -> str | None:
    """The ``--flags`` of a command line that its ``--help`` does not list."""
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    unknown = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", help_text))
    return f"flags its --help does not list: {unknown}" if unknown else None


def _check_command(args: list[str]) -> str | None:
    """None when the command is right as written, else what is wrong."""
    head = args[0]
    env_prefix = 0
    while "=" in args[env_prefix] and not args[env_prefix].startswith("-"):  # VAR=value command ...
        env_prefix += 1
    args = args[env_prefix:]
    head = Path(args[0]).name
    if head == "make":
        missing = [t for t in args[1:] if not t.startswith("-") and "=" not in t and t not in _make_targets()]
        return f"no make target {missing}" if missing else None
    if head == "zlightning":
        sub = args[1] if len(args) > 1 else ""
        if sub in _ZL_RUN_COMMANDS:
            proc = _run([str(_BIN / "zlightning"), *args[1:], "--print_config"])
        elif sub.startswith("-"):
            proc = _run([str(_BIN / "zlightning"), *args[1:]])
        else:
            proc = _run([str(_BIN / "zlightning"), sub, "--help"])
            if proc.returncode == 0:
                return _unknown_flags(args[2:], proc.stdout)
        return None if proc.returncode == 0 else f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}"
    if head in ("python", "python3"):
        rest = args[1:]
        if rest[:2] == ["-m", "pytest"]:
            paths = [a.split("::")[0] for a in rest[2:] if not a.startswith("-")]
            missing = [p for p in paths if not (ROOT / p).exists()]
            return f"no such test path {missing}" if missing else None
        if rest and rest[0] == "-m":
            proc = _run([sys.executable, "-m", rest[1], "--help"])
        else:
            script = ROOT / rest[0]
            if not script.is_file():
                return f"no such script {rest[0]}"
            proc = _run([sys.executable, str(script), "--help"])
        if proc.returncode != 0:
            return f"--help exit {proc.returncode}: {proc.stderr[-1500:]}"
        return _unknown_flags(rest[1:] if rest[0] != "-m" else rest[2:], proc.stdout)
    if head in _NOT_RUN:
        missing = [
            a for a in args[1:] if re.match(r"^(examples|benchmarks|tests|docs)/", a) and not (ROOT / a).exists()
        ]
        return f"names missing files {missing}" if missing else None
    return f"unknown command {head!r}: teach tests/test_docs_snippets.py how to check it"


SHELL_COMMANDS = sorted(
    {
        (block.where, shlex.join(cmd))
        for block in ALL_BLOCKS
        if block.language == "bash"
        for cmd in _commands(block.code)
    }
)


@pytest.mark.parametrize("where,command", SHELL_COMMANDS, ids=[f"{w}:{c[:60]}" for w, c in SHELL_COMMANDS])
def test_shell_command_is_right_as_written(where: str, command: str) -> None:
    problem = _check_command(shlex.split(command))
    assert problem is None, f"{where}: `{command}`: {problem}"


def test_every_page_is_in_the_site_navigation() -> None:
    config = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in PAGES if p.parent != ROOT]
    missing = [p for p in pages if p not in config]
    assert not missing, f"pages not in mkdocs.yml's nav: {missing}"
