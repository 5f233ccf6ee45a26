"""MkDocs hooks for the zlightning site.

[Note: the API reference sees the installed package layout]
``pyproject.toml`` maps the top-level folders ``strategies/``, ``datamodules/`` and ``kernels/`` into the package as
``zlightning.strategies`` and so on. mkdocstrings reads sources statically (griffe) by walking folders, so it would
find ``zlightning/`` without those three. Before the build, a staging folder ``build/docs-api/zlightning`` is made of
a copy of
``zlightning/`` with the three mapped folders copied in under their package names (griffe resolves symbolic links
to their real folders, so links would not do). The copy is made afresh for every build, so the reference is always
rendered from the current sources, under the names users import. The hook runs before every plugin's own
``on_config``: mkdocstrings drops a search path that does not exist yet, and would then find the installed
``zlightning/`` folder, which lacks the mapped packages.

Benchmark charts live in ``benchmarks/results/`` beside their tables; the site serves them from there too, so a chart
is never copied into ``docs/`` and cannot go stale.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
STAGING = ROOT / "build" / "docs-api"
MAPPED = {"strategies": "strategies", "datamodules": "datamodules", "kernels": "kernels"}


def _stage_package() -> None:
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.so")
    shutil.rmtree(STAGING, ignore_errors=True)
    shutil.copytree(ROOT / "zlightning", STAGING / "zlightning", ignore=ignore)
    for name, folder in MAPPED.items():
        shutil.copytree(ROOT / folder, STAGING / "zlightning" / name, ignore=ignore)


@event_priority(100)  # before mkdocstrings fixes its search paths: they must exist by then
def on_config(config, **kwargs):  # noqa: ANN001, ANN003, ANN201
    _stage_package()
    return config


def on_files(files: Files, config, **kwargs) -> Files:  # noqa: ANN001, ANN003
    results = ROOT / "benchmarks" / "results"
    for chart in sorted(results.glob("*.png")):
        files.append(
            File(
                f"benchmarks/results/{chart.name}",
                src_dir=str(ROOT),
                dest_dir=config["site_dir"],
                use_directory_urls=config["use_directory_urls"],
            )
        )
    return files
