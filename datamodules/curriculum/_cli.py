"""``zlightning analyze``: runs `DataAnalyzer` from the command line.

Examples::

    zlightning analyze --save-path analysis                       # stdlib text corpus, seqlen + vocab_rarity
    zlightning analyze --save-path analysis --dataset mypkg.data:build_train --metric-fn n_lines=mypkg.m:lines
    zlightning analyze ... --num-workers 4 --worker-id 2 --map-only   # on each of 4 machines, then:
    zlightning analyze ... --num-workers 4 --reduce-only              # once, after every map finished
    torchrun --nproc-per-node 4 -m zlightning.cli analyze --save-path analysis --distributed   # no shared disk
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

__all__ = ["analyze_main"]


def _resolve(spec: str, what: str) -> Any:
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise SystemExit(f"zlightning analyze: {what} must look like 'package.module:name', got {spec!r}.")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zlightning analyze", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--save-path", required=True, help="output folder of the metric index files")
    p.add_argument("--metrics", nargs="*", default=["seqlen", "vocab_rarity"], help="built-in metrics to compute")
    p.add_argument(
        "--metric-fn",
        action="append",
        default=[],
        metavar="NAME=MODULE:FN",
        help="a user metric: FN(batch) returns one int64 value per sample (repeatable)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        metavar="MODULE:ATTR",
        help="a map-style dataset, or a zero-argument callable returning one (default: the text corpus)",
    )
    p.add_argument("--data-dir", default=None, help="text corpus root (default: the Python standard library)")
    p.add_argument("--pattern", default="*.py", help="text corpus file glob")
    p.add_argument("--seq-len", type=int, default=256, help="text corpus tokens per sample")
    p.add_argument("--max-bytes", type=int, default=4_000_000, help="text corpus train byte cap")
    p.add_argument("--batch-size", type=int, default=1000)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--worker-id", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--pad-token-id", type=int, default=None)
    p.add_argument("--no-progress", action="store_true")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--map-only", action="store_true", help="run this worker's map only")
    mode.add_argument("--reduce-only", action="store_true", help="run the reduce only")
    mode.add_argument(
        "--distributed",
        action="store_true",
        help="DistributedDataAnalyzer over the torch.distributed ranks (torchrun; gloo unless already "
        "initialised); rank 0 writes the files",
    )
    return p


def _dataset(a: argparse.Namespace) -> Any:
    if a.dataset is not None:
        obj = _resolve(a.dataset, "--dataset")
        return obj() if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "__getitem__")) else obj
    from ..text import TextCorpusDataModule

    dm = TextCorpusDataModule(data_dir=a.data_dir, pattern=a.pattern, seq_len=a.seq_len, max_bytes=a.max_bytes)
    dm.setup("fit")
    return dm.train_dataset


def analyze_main(argv: list[str]) -> None:
    """Entry point of ``zlightning analyze`` (arguments after the subcommand name)."""
    from ._analyzer import DataAnalyzer, MetricSpec

    a = _parser().parse_args(argv)
    specs = []
    for item in a.metric_fn:
        name, sep, target = item.partition("=")
        if not sep:
            raise SystemExit(f"zlightning analyze: --metric-fn must look like NAME=module:fn, got {item!r}.")
        specs.append(MetricSpec(name=name, fn=_resolve(target, "--metric-fn")))
    if a.distributed:
        _analyze_distributed(a, specs)
        return
    analyzer = DataAnalyzer(
        _dataset(a),
        save_path=a.save_path,
        metric_names=a.metrics,
        metrics=specs,
        batch_size=a.batch_size,
        num_workers=a.num_workers,
        worker_id=a.worker_id,
        num_threads=a.num_threads,
        pad_token_id=a.pad_token_id,
        progress=not a.no_progress,
    )
    if not a.reduce_only:
        analyzer.run_map()
    if not a.map_only and (a.reduce_only or a.num_workers == 1):
        analyzer.run_reduce()
        names = [m.name for m in analyzer.metrics]
        print(f"wrote metric index files of {names} under {a.save_path}")


def _analyze_distributed(a: argparse.Namespace, specs: list[Any]) -> None:
    import torch.distributed as dist

    from ._analyzer_dist import DistributedDataAnalyzer

    if a.num_workers != 1 or a.worker_id != 0:
        raise SystemExit(
            "zlightning analyze: --distributed takes its workers from torch.distributed; drop "
            "--num-workers/--worker-id."
        )
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    analyzer = DistributedDataAnalyzer(
        _dataset(a),
        save_path=a.save_path,
        metric_names=a.metrics,
        metrics=specs,
        batch_size=a.batch_size,
        num_threads=a.num_threads,
        pad_token_id=a.pad_token_id,
        progress=not a.no_progress,
    )
    analyzer.run_map_reduce()
    if dist.get_rank() == 0:
        print(f"wrote metric index files of {[m.name for m in analyzer.metrics]} under {a.save_path}")
