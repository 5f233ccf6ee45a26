"""README.md's code, as a new user meets it: every ``python`` block runs as written, from an empty directory.

Conventions (also in a comment in README.md): a block fenced ```` ```python ```` is a whole program; ```` ```python
continued ```` extends the program before it (the chain runs once, as one file); ```` ```python fragment ```` is only
parsed. Programs run in a subprocess from a temporary directory (not the repository root, so ``examples`` is not
importable and only the installed package can be used) with a ``sitecustomize`` that caps ``Trainer(max_steps=...)``,
``val_check_interval`` and ``limit_val_batches`` at a few, which is the only difference from running them by hand.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
KINDS = {"python": "program", "python continued": "continued", "python fragment": "fragment"}

_TINY_SITECUSTOMIZE = textwrap.dedent(
    """
    import os

    if os.environ.get("ZLIGHTNING_README_TINY") == "1":
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
    kind: str
    code: str
    line: int


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block whose info string starts with ``python``."""
    blocks = []
    for match in re.finditer(r"^```(python[^\n]*)\n(.*?)^```", text, flags=re.M | re.S):
        info = match.group(1).strip()
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(KINDS.get(info, f"unknown: {info}"), match.group(2), line))
    return blocks


def readme_programs(text: str) -> list[tuple[int, str]]:
    """``(line of the first block, source)`` of every program, continued blocks appended."""
    programs: list[tuple[int, str]] = []
    for block in readme_blocks(text):
        if block.kind == "program":
            programs.append((block.line, block.code))
        elif block.kind == "continued":
            if not programs:
                raise AssertionError(f"README.md:{block.line}: a 'python continued' block with no program before it")
            line, code = programs[-1]
            programs[-1] = (line, code + "\n" + block.code)
    return programs


PROGRAMS = readme_programs(README.read_text())


def test_every_python_block_is_a_program_continuation_or_fragment() -> None:
    blocks = readme_blocks(README.read_text())
    unknown = [f"README.md:{b.line}: {b.kind}" for b in blocks if b.kind.startswith("unknown")]
    assert not unknown, "python blocks must be 'python', 'python continued' or 'python fragment': " + "; ".join(unknown)
    for block in blocks:
        try:
            ast.parse(block.code)
        except SyntaxError as err:
            raise AssertionError(f"README.md:{block.line}: the {block.kind} block is not valid Python: {err}") from err
    assert len(PROGRAMS) >= 2, "the headline and pipeline programs should be runnable blocks"


def test_readme_code_imports_nothing_from_the_repository_checkout() -> None:
    for block in readme_blocks(README.read_text()):
        assert "from examples" not in block.code and "import examples" not in block.code, (
            f"README.md:{block.line}: `examples` imports only from the repository root; use zlightning.models"
        )


def test_config_files_named_by_the_readme_exist() -> None:
    text = README.read_text()
    for path in sorted(set(re.findall(r"--config[ =](\S+\.ya?ml)", text))):
        assert (ROOT / path).is_file(), f"README.md names {path}, which does not exist"


@pytest.mark.slow
@pytest.mark.parametrize("line,code", PROGRAMS, ids=[f"README.md:{line}" for line, _ in PROGRAMS])
def test_readme_program_runs_as_written(line: int, code: str, tmp_path: Path) -> None:
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
    assert proc.returncode == 0, f"README.md:{line} failed as written:\n{output[-5000:]}"
    if "GPTLightningModule" in code and "trainer.fit" in code:  # the headline: the end-of-run summary is printed
        for label in ("final training loss", "final validation loss", "throughput", "logs", "checkpoint"):
            assert label in proc.stdout, output[-3000:]
        assert "Tip:" not in output and "LeafSpec" not in output
