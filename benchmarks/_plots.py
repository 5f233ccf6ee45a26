"""Charts beside the benchmark tables: a PNG next to each results Markdown file where a picture reads better.

    .venv/bin/python benchmarks/_plots.py            # re-render every chart from benchmarks/results/*.json
    .venv/bin/python -m pip install 'zlightning[bench]'   # matplotlib (benchmark-only extra)

Each benchmark script calls `write_png` after writing its JSON and Markdown; the charts are drawn from the same
record, so rendering again from the stored JSON (this script) gives the same picture without re-running anything.
Without matplotlib nothing is drawn and one line says so: the tables stay the results.

Charts:
* ``zero3.png``: step time relative to DDP and memory per parameter (model state and peak RSS) per strategy;
* ``memory.png``: peak resident growth per parameter at the measured steps per variant, with the sharded ideal;
* ``pipeline.png``: per-rank timelines of each schedule under the unit cost model (forward 1, backward 2) with the
  idle time (the bubble) shaded, and the measured bubble against theory per number of micro-batches;
* ``offload.png``: swap throughput (ours, fio, DeepSpeed's aio) and step time relative to in-memory ZeRO-3.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
_COLORS = {"F": "#4C72B0", "B": "#DD8452", "W": "#55A868", "idle": "#D0D0D0"}


def _pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_png(kind: str, record: dict[str, Any], path: Path) -> Path | None:
    """Draws chart ``kind`` (``"zero3"``, ``"memory"``, ``"pipeline"``, ``"offload"``) of a results record to ``path``.

    Returns:
        ``path``, or None when matplotlib is missing (a note is printed) or the record holds nothing to draw.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in _CHARTS:
        raise ValueError(f"write_png: unknown chart {kind!r}; known: {sorted(_CHARTS)}")
    plt = _pyplot()
    if plt is None:
        print(f"(no chart {path.name}: matplotlib is not installed; pip install 'zlightning[bench]')")
        return None
    fig = _CHARTS[kind](plt, record)
    if fig is None:
        return None
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"chart: {path}")
    return path


# ---------------------------------------------------------------------------------------------------- zero3
def _zero3(plt: Any, report: dict[str, Any]) -> Any:
    params = report["full_model"]["params"]
    rows = [(v["variant"], v["ranks"][0]) for v in report["variants"] if v.get("status") == "ok" and v.get("ranks")]
    names = [n for n, _ in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["#8C8C8C" if n == "ddp" else "#4C72B0" for n in names]
    if all(r["step_time_x_ddp"] is not None for _, r in rows):
        bars = ax1.barh(names, [r["step_time_x_ddp"] for _, r in rows], color=colors)
        ax1.axvline(1.0, color="black", lw=0.8, ls="--")
        ax1.bar_label(bars, fmt="%.2f×", padding=3)
        ax1.set_xlabel("median step time ÷ DDP's (rank 0)")
        ax1.set_title("Step time relative to DDP")
    else:  # a run without DDP (--variants): absolute times
        bars = ax1.barh(names, [r["median_step_s"] for _, r in rows], color=colors)
        ax1.bar_label(bars, fmt="%.2f s", padding=3)
        ax1.set_xlabel("median step time, s (rank 0)")
        ax1.set_title("Step time (no DDP run to compare with)")
    ax1.invert_yaxis()
    y = range(len(rows))
    state = [r["model_state_bytes"] / params for _, r in rows]
    rss = [r["peak_rss_kib"] * 1024 / params for _, r in rows]
    ax2.barh([i - 0.2 for i in y], state, height=0.4, label="model state (params + grads + Adam)", color="#55A868")
    ax2.barh([i + 0.2 for i in y], rss, height=0.4, label="peak RSS of the process", color="#C44E52")
    ax2.set_yticks(list(y), names)
    ax2.invert_yaxis()
    ax2.set_xlabel("bytes per model parameter (rank 0)")
    ax2.set_title("Memory per parameter")
    ax2.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2, fontsize=8)
    cfg = report["config"]
    fig.suptitle(
        f"ZeRO-3 benchmark: GPT d={cfg['d_model']}, {cfg['n_layer']} layers ({params / 1e6:.1f} M params), "
        f"{cfg['world_size']} CPU ranks",
        fontsize=11,
    )
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- memory
def _memory(plt: Any, record: dict[str, Any]) -> Any | None:
    rows = {k: v for k, v in record["results"].items() if "bytes_per_param" in v}
    if not rows:
        return None
    marks = sorted({int(k) for v in rows.values() for k in v["bytes_per_param"]})
    fig, ax = plt.subplots(figsize=(10, 4.2))
    width = 0.8 / len(marks)
    for j, mark in enumerate(marks):
        values = [v["bytes_per_param"].get(mark, v["bytes_per_param"].get(str(mark), 0.0)) for v in rows.values()]
        ax.bar([i + (j - (len(marks) - 1) / 2) * width for i in range(len(rows))], values, width, label=f"step {mark}")
    world = record["config"].get("world", 2)
    ax.axhline(16 / world, color="black", lw=0.8, ls="--", label=f"sharded ideal 16/{world} B/param")
    ax.set_xticks(range(len(rows)), list(rows), rotation=20, ha="right")
    ax.set_ylabel("peak resident growth (bytes / parameter)")
    ax.set_title(f"Memory per parameter per step ({record['numel'] / 1e6:.1f} M parameters, {world} CPU ranks)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- pipeline
def _timeline_axes(ax: Any, name: str, ranks: int, micro: int) -> float:
    from zlightning.pipe import build_schedule, timeline

    v = 2 if name in ("interleaved_1f1b", "zbv") else 1
    schedule = build_schedule(name, ranks, micro, v, "v") if name == "zbv" else build_schedule(name, ranks, micro, v)
    tl = timeline(schedule)
    for rank, spans in enumerate(tl.spans):
        ax.broken_barh(
            [(0, tl.makespan)], (rank - 0.4, 0.8), facecolors=_COLORS["idle"], hatch="//", edgecolor="white", lw=0
        )
        for action, start, end in spans:
            kind = action.kind.name[0]  # FORWARD / BACKWARD / WEIGHT
            ax.broken_barh(
                [(start, end - start)],
                (rank - 0.4, 0.8),
                facecolors=_COLORS.get(kind, "#999999"),
                edgecolor="white",
                lw=0.5,
            )
            ax.text(
                (start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=6, color="white"
            )
    ax.set_yticks(range(ranks), [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, tl.makespan)
    ax.set_title(f"{name}: bubble {tl.bubble_fraction:.0%}", fontsize=9, loc="left")
    return tl.bubble_fraction


def _pipeline(plt: Any, result: dict[str, Any]) -> Any:
    from matplotlib.patches import Patch

    cfg = result.get("config", {})
    ranks = int(cfg.get("ranks", 2))
    micro = 4
    names = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"]
    fig = plt.figure(figsize=(12, 2.0 + 1.1 * len(names)))
    grid = fig.add_gridspec(len(names), 2, width_ratios=[2.2, 1])
    for i, name in enumerate(names):
        _timeline_axes(fig.add_subplot(grid[i, 0]), name, ranks, micro)
    handles = [
        Patch(color=_COLORS[k], label=lbl)
        for k, lbl in (("F", "forward"), ("B", "backward"), ("W", "weight gradients"), ("idle", "idle (bubble)"))
    ]
    fig.legend(handles=handles, loc="upper left", ncols=4, fontsize=8, bbox_to_anchor=(0.0, 1.0))
    ax = fig.add_subplot(grid[:, 1])
    measured = [r for r in result.get("rows", []) if "bubble" in r and r.get("theory") is not None]
    for variant in sorted({r["variant"] for r in measured}):
        pts = sorted((r["m"], r["bubble"]) for r in measured if r["variant"] == variant)
        ax.plot([m for m, _ in pts], [b for _, b in pts], marker="o", label=f"{variant} measured")
        theory = sorted((r["m"], r["theory"]) for r in measured if r["variant"] == variant)
        ax.plot([m for m, _ in theory], [t for _, t in theory], ls="--", color=ax.lines[-1].get_color(), lw=0.8)
    ax.set_xlabel("micro-batches per step")
    ax.set_ylabel("bubble (idle share)")
    ax.set_title("Measured bubble (solid) vs theory (dashed)", fontsize=9)
    if measured:
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Pipeline schedules on {ranks} ranks, {micro} micro-batches (unit costs: F=1, B=2; W=1 when split)",
        fontsize=11,
        y=1.04,
    )
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------------- offload
def _offload(plt: Any, report: dict[str, Any]) -> Any:
    rows = {k: v for k, v in report.get("swap_throughput", {}).get("rows", {}).items() if v.get("status") == "ok"}
    ratios = report.get("ratios_to_in_memory", {})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.0))
    labels = [
        f"{k}\n({v['engine']})" if len(v["engine"]) < 28 else f"{k}\n({v['engine'][:26]}…)" for k, v in rows.items()
    ]
    x = range(len(rows))
    ax1.bar([i - 0.2 for i in x], [v["write_MBps"] for v in rows.values()], 0.4, label="write", color="#4C72B0")
    ax1.bar([i + 0.2 for i in x], [v["read_MBps"] for v in rows.values()], 0.4, label="read", color="#DD8452")
    ax1.set_xticks(list(x), labels, fontsize=8)
    ax1.set_ylabel("MB/s (median of the rounds)")
    nbytes = report.get("swap_throughput", {}).get("bytes", 0)
    ax1.set_title(f"Swap throughput ({nbytes / 2**20:.0f} MiB, direct I/O)")
    ax1.legend(fontsize=8)
    names = list(ratios)
    bars = ax2.barh(
        names, [ratios[n] for n in names], color=["#C44E52" if n.startswith("ds_") else "#4C72B0" for n in names]
    )
    ax2.axvline(1.0, color="black", lw=0.8, ls="--")
    ax2.bar_label(bars, fmt="%.2f×", padding=3, fontsize=8)
    ax2.invert_yaxis()
    ax2.set_xlabel("step time ÷ the same library's in-memory ZeRO-3 (red: DeepSpeed)")
    ax2.set_title("Offload step time")
    fig.tight_layout()
    return fig


_CHARTS: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "zero3": _zero3,
    "memory": _memory,
    "pipeline": _pipeline,
    "offload": _offload,
}


def main(argv: list[str] | None = None) -> int:
    """Renders every chart whose results JSON exists under ``benchmarks/results``."""
    argparse.ArgumentParser(
        description="Redraw the charts zero3.png, memory.png, pipeline.png and offload.png from the stored "
        "benchmarks/results/<name>.json (nothing is re-run)."
    ).parse_args(argv)
    if _pyplot() is None:
        print("matplotlib is not installed (pip install 'zlightning[bench]'): no charts drawn")
        return 0
    for kind in _CHARTS:
        source = RESULTS / f"{kind}.json"
        if source.exists():
            write_png(kind, json.loads(source.read_text()), RESULTS / f"{kind}.png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
