"""Compression on a real task: the example GPT trained on a real corpus, then each technique, side by side.

One run, one process, CPU, every number from this run:

1. *base*: `examples.gpt.GPTLightningModule` is trained ``--base-steps`` optimizer steps on
   `TextCorpusDataModule` (byte-level, the Python standard library's source, deterministic file split).
2. Every variant starts from the base weights and is fine-tuned ``--ft-steps`` more steps in a Lightning Trainer with
   the zlightning compression callbacks (techniques from step 0 of the fine-tune). The control variant
   ``fp32 (fine-tuned)`` fine-tunes with no compression, so every variant has seen the same number of steps.
3. At the end of fit the callbacks export the model (`save_compressed`: clean, pack int8/int4 codes + scales); the
   export is loaded into a freshly built model and *that* model is validated (torchmetrics ``Perplexity`` on the
   validation split), so the table measures what a user gets back from the file. Activation quantization is not
   part of a saved model (it is an inference-time transformation of layer inputs), so the W8A8 row is validated on the
   in-memory model and its file holds the W8 weights.

The file size of the uncompressed model is ``torch.save(model.state_dict())`` of the fp32 GPT. Results go to
``benchmarks/results/compression.json`` and ``compression.md`` (``--quick`` writes ``compression_quick.*``).

Run: ``.venv/bin/python benchmarks/compression.py`` (a few minutes on 2 CPU cores), or ``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import lightning.pytorch as pl  # noqa: E402
from zlightning.datamodules import TextCorpusDataModule  # noqa: E402

from examples.gpt import GPTLightningModule  # noqa: E402
from zlightning.callbacks import (  # noqa: E402
    ActivationQuantization,
    CompressionCallback,
    HeadPruning,
    LayerReduction,
    RowPruning,
    SparsePruning,
    WeightQuantization,
)
from zlightning.compression import apply_schedule, init_compression, load_compressed, save_compressed  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Settings:
    """Everything that defines one run."""

    d_model: int = 128
    n_layer: int = 4
    n_head: int = 4
    seq_len: int = 64
    batch_size: int = 16
    lr: float = 2e-3
    base_steps: int = 500
    ft_steps: int = 100
    val_batches: int = 30
    max_bytes: int = 3_000_000
    threads: int = 1
    seed: int = 0


class _KDStudent(GPTLightningModule):
    """The example GPT trained with cross-entropy plus the layer-reduction callback's distillation loss."""

    def __init__(self, kd: LayerReduction, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kd = kd

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits, loss = self.model(x, y)
        return loss + self.kd.distillation_loss(logits, x)


def _module(s: Settings, n_layer: int | None = None) -> GPTLightningModule:
    return GPTLightningModule(
        seq_len=s.seq_len, d_model=s.d_model, n_layer=n_layer or s.n_layer, n_head=s.n_head, lr=s.lr, warmup_steps=20
    )


def _trainer(s: Settings, steps: int, callbacks: list[pl.Callback]) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=s.val_batches,
        val_check_interval=None,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def _validate(s: Settings, module: GPTLightningModule, data: TextCorpusDataModule) -> tuple[float, float]:
    out = _trainer(s, 0, []).validate(module, datamodule=data, verbose=False)[0]
    return float(out["val/loss"]), float(out["val/ppl"])


def _float_bytes(module: GPTLightningModule) -> int:
    buf = io.BytesIO()
    torch.save(module.model.state_dict(), buf)
    return buf.tell()


def _variants(s: Settings, export: Path) -> dict[str, list[pl.Callback]]:
    """Callbacks of each fine-tuned variant; the first callback of each list exports (and cleans) at fit end."""
    # 128 scale groups (bands of rows) per Linear weight divide every row count of this GPT (128, 384, 512);
    # embeddings (and the tied head) always use one scale per token row.
    wq8 = dict(target_bits=8, quantize_groups=128, schedule_offset=0)
    mlp_rows = dict(dense_ratio=0.5, related_modules=[[r"mlp\.proj$"]], schedule_offset=0)
    return {
        "fp32 (fine-tuned)": [],
        "int8 weights (QAT)": [WeightQuantization(**wq8, export_path=export)],
        "int4 weights (QAT)": [
            WeightQuantization(
                target_bits=4,
                start_bits=8,
                quantization_period=5,
                quantize_groups=128,
                schedule_offset=0,
                export_path=export,
            )
        ],
        "W8A8 (int8 weights + dynamic int8 activations)": [
            WeightQuantization(**wq8),
            ActivationQuantization(bits=8, schedule_offset=0),
        ],
        "50% sparse (l1)": [SparsePruning(r"blocks\.", dense_ratio=0.5, schedule_offset=0, export_path=export)],
        "50% MLP rows removed": [RowPruning(r"mlp\.fc$", **mlp_rows, export_path=export)],
        "50% heads masked (topk)": [
            HeadPruning(r"attn\.proj$", dense_ratio=0.5, schedule_offset=0, export_path=export)
        ],
        "int8 + 50% sparse attention + 50% MLP rows": [
            WeightQuantization(**wq8, export_path=export),
            SparsePruning(r"attn\.", dense_ratio=0.5, schedule_offset=0),
            RowPruning(r"mlp\.fc$", **mlp_rows),
        ],
    }


def _row(name: str, loss: float, ppl: float, size: int, float_bytes: int, seconds: float) -> dict:
    return {
        "variant": name,
        "val_loss": loss,
        "val_ppl": ppl,
        "ppl_vs_fp32": float("nan"),
        "file_bytes": size,
        "size_ratio": float_bytes / size,
        "seconds": seconds,
    }


def run(s: Settings) -> dict[str, Any]:
    torch.set_num_threads(s.threads)
    pl.seed_everything(s.seed, verbose=False)
    data = TextCorpusDataModule(seq_len=s.seq_len, batch_size=s.batch_size, max_bytes=s.max_bytes, seed=s.seed)
    base = _module(s)
    t0 = time.perf_counter()
    _trainer(s, s.base_steps, []).fit(base, datamodule=data)
    base_seconds = time.perf_counter() - t0
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    float_bytes = _float_bytes(base)
    loss0, ppl0 = _validate(s, base, data)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "model.zlc"
        # post-training int8 (no fine-tune): quantize the base weights and export
        ptq = _module(s)
        ptq.load_state_dict(base_state)
        init_compression(ptq, WeightQuantization(target_bits=8, quantize_groups=128).config)
        apply_schedule(ptq, 0)
        size = save_compressed(ptq, export).file_bytes
        loss, ppl = _validate(s, load_compressed(export, _module(s)), data)
        rows.append(_row("int8 weights (post-training, no fine-tune)", loss, ppl, size, float_bytes, 0.0))
        for name, callbacks in _variants(s, export).items():
            module = _module(s)
            module.load_state_dict(base_state)
            pl.seed_everything(s.seed + 1, verbose=False)
            t0 = time.perf_counter()
            _trainer(s, s.ft_steps, callbacks).fit(module, datamodule=data)
            seconds = time.perf_counter() - t0
            exported = any(getattr(c, "export_path", None) for c in callbacks)
            if exported:
                size = export.stat().st_size
                loss, ppl = _validate(s, load_compressed(export, _module(s)), data)
            else:  # fp32 control, or W8A8 whose activation quantization lives in the module, not the file
                loss, ppl = _validate(s, module, data)
                size = save_compressed(module, export).file_bytes if callbacks else _float_bytes(module)
            rows.append(_row(name, loss, ppl, size, float_bytes, seconds))
        rows.append(_layer_reduction(s, base, data, export, float_bytes))
    return _ratios(
        {
            "settings": asdict(s),
            "base": {"val_loss": loss0, "val_ppl": ppl0, "file_bytes": float_bytes, "seconds": base_seconds},
            "rows": rows,
            "torch": torch.__version__,
            "lightning": pl.__version__,
        }
    )


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    """Perplexity ratios against the fp32 model that saw the same number of steps: the base model for the
    post-training row, the fine-tuned fp32 control for every fine-tuned row."""
    control = next(r for r in result["rows"] if r["variant"] == "fp32 (fine-tuned)")
    for r in result["rows"]:
        post_training = "post-training" in r["variant"]
        r["reference"] = "fp32 base" if post_training else "fp32 (fine-tuned)"
        r["ppl_vs_fp32"] = r["val_ppl"] / (result["base"]["val_ppl"] if post_training else control["val_ppl"])
    return result


def _layer_reduction(
    s: Settings, base: GPTLightningModule, data: TextCorpusDataModule, export: Path, float_bytes: int
) -> dict:
    keep = tuple(range(1, s.n_layer, 2))  # every other layer: (1, 3) of 4
    kd = LayerReduction(
        base,
        module_name_prefix="model.blocks",
        teacher_layer=keep,
        other_module_name=("model.tok_emb", "model.pos_emb", "model.ln_f"),
        distillation_weight=1.0,
        temperature=2.0,
    )
    student = _KDStudent(
        kd, seq_len=s.seq_len, d_model=s.d_model, n_layer=len(keep), n_head=s.n_head, lr=s.lr, warmup_steps=20
    )
    pl.seed_everything(s.seed + 1, verbose=False)
    exporter = CompressionCallback({}, export_path=export)  # no technique: export the plain student
    t0 = time.perf_counter()
    _trainer(s, s.ft_steps, [kd, exporter]).fit(student, datamodule=data)
    seconds = time.perf_counter() - t0
    loss, ppl = _validate(s, load_compressed(export, _module(s, len(keep))), data)
    return _row(
        f"{len(keep)} of {s.n_layer} layers (layer reduction + KD)",
        loss,
        ppl,
        export.stat().st_size,
        float_bytes,
        seconds,
    )


def _markdown(result: dict[str, Any]) -> str:
    s, b = result["settings"], result["base"]
    lines = [
        "# Compression of the example GPT on a real corpus",
        "",
        f"GPT d_model {s['d_model']}, {s['n_layer']} layers, {s['n_head']} heads, byte vocabulary, seq_len "
        f"{s['seq_len']}, batch {s['batch_size']}; trained {s['base_steps']} steps on the Python standard library "
        f"source (TextCorpusDataModule, {s['max_bytes']} bytes), then each variant fine-tuned {s['ft_steps']} steps "
        f"from those weights. Validation: {s['val_batches']} batches of the held-out files, torchmetrics Perplexity, "
        "measured on the model loaded back from the exported file. CPU, "
        f"{s['threads']} threads, torch {result['torch']}, lightning {result['lightning']}.",
        "",
        f"Base model after {s['base_steps']} steps: val loss {b['val_loss']:.4f}, ppl {b['val_ppl']:.3f}, "
        f"fp32 file {b['file_bytes'] / 1e6:.2f} MB.",
        "",
        "| variant | val loss | val ppl | ppl / fp32 same steps | file (MB) | smaller than fp32 | fine-tune s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['val_loss']:.4f} | {r['val_ppl']:.3f} | {r['ppl_vs_fp32']:.4f} | "
            f"{r['file_bytes'] / 1e6:.3f} | {r['size_ratio']:.2f}x | {r['seconds']:.0f} |"
        )
    lines += [
        "",
        "ppl / fp32 same steps: against the base model for the post-training row, against the fp32 model "
        "fine-tuned the same number of steps for the others.",
        "",
        "Targets: int8 weights within 1% perplexity, 50% sparse after fine-tuning within 5%, int8 "
        "export at least 3.5x smaller than fp32.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (results compression_quick.*)")
    parser.add_argument("--base-steps", type=int, default=None)
    parser.add_argument("--ft-steps", type=int, default=None)
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        help="only recompute the ratios and tables of an existing results JSON (no training)",
    )
    args = parser.parse_args(argv)
    if args.render is not None:
        result = _ratios(json.loads(args.render.read_text()))
        args.render.write_text(json.dumps(result, indent=2) + "\n")
        args.render.with_suffix(".md").write_text(_markdown(result))
        print(_markdown(result))
        return
    s = Settings()
    if args.quick:
        s = Settings(base_steps=20, ft_steps=5, val_batches=4, max_bytes=300_000)
    if args.base_steps is not None or args.ft_steps is not None:
        s = Settings(
            **{**asdict(s), "base_steps": args.base_steps or s.base_steps, "ft_steps": args.ft_steps or s.ft_steps}
        )
    result = run(s)
    stem = "compression_quick" if args.quick else "compression"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
