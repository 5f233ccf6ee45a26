"""Product text speaks of the product: README, docs, benchmark pages, examples, code and tests say what the code does and
what was measured, never how the work was organised (issue numbers, work sessions, reviewers).

References to other projects' trackers stay allowed where the line names the project ("DeepSpeed issue 4808",
"pytorch/pytorch#167288"): they tell a user which upstream behaviour a choice works around.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {".venv", "build", "site", ".git", "__pycache__", ".venv-deepspeed", "runs", "lightning_logs"}
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".cpp", ".h", ".cu", ".sh"}
EXTRA_FILES = ("Makefile", ".ci/run")

FORBIDDEN = re.compile(
    r"\b(stop \d+|stops \d+|issue #?\d+|issues #?\d+|the issue's|helper-\d+|helper's|"
    r"(this|previous|earlier|next|later) (session|stop)(?!\w))",
    re.IGNORECASE,
)
UPSTREAM = re.compile(
    r"deepspeed|pytorch|torch|lightning|megatron|nccl|gloo|transformers|triton|glibc|mkdocs|torchtitan|upstream",
    re.IGNORECASE,
)


def _files() -> list[Path]:
    found = [ROOT / name for name in EXTRA_FILES if (ROOT / name).is_file()]
    for path in ROOT.rglob("*"):
        if path.is_file() and path.suffix in SUFFIXES and not SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
            found.append(path)
    return sorted(found)


def test_no_text_speaks_of_issues_sessions_or_reviewers() -> None:
    offending = []
    for path in _files():
        if path == Path(__file__):
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            for match in FORBIDDEN.finditer(line):
                if match.group(0).lower().startswith("issue") and UPSTREAM.search(line):
                    continue
                offending.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r}: {line.strip()[:120]}")
    assert not offending, "product text that speaks of the work, not the product:\n" + "\n".join(offending)


def test_the_check_catches_what_it_claims() -> None:
    for text in (
        "after stop 12 the step",
        "as in issue 7",
        "the helper's runs",
        "in this session we",
        "helper-24 found",
        "this stop's change",
    ):
        assert FORBIDDEN.search(text), text
    for text in ("a helper function", "the training session", "stop the run", "issues a collective"):
        assert not FORBIDDEN.search(text), text
