"""What a plain LightningModule (not one of ``zlightning.models``) prints under the zlightning strategies, at 2 gloo
ranks with standard output going to a pipe, as in a CI log:

* the model summary counts the full model (a tied head, a frozen layer; the pipeline's stages on both ranks), with a
  line on what each rank holds;
* the end-of-fit summary (final losses, throughput) appears once;
* progress comes as a few plain lines (no carriage returns, no bar), printed by rank 0.

The last tests check which callbacks the strategies swap in, in one process: the user's own bar, summary and
``enable_progress_bar=False`` are kept.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary, ProgressBar, RichProgressBar, TQDMProgressBar

from zlightning import _progress, _run_report
from zlightning._progress import LineProgress
from zlightning._run_report import ModelSizeSummary, RunSummary, install_run_report

# A user's language model: embedding 256x64 (16,384), body 64->128->64 (16,576), norm (128), a frozen 64x64 Linear
# (4,160) and a head tied to the embedding: 37,248 parameters, 4,160 of them frozen. Trained 60 steps at 2 ranks,
# validated at steps 30 and 60.
_ZERO3_SCRIPT = textwrap.dedent(
    """
    import torch
    import lightning.pytorch as pl
    import zlightning
    from torch.utils.data import DataLoader, TensorDataset

    class TinyLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(256, 64)
            self.body = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
            self.norm = torch.nn.LayerNorm(64)
            self.frozen = torch.nn.Linear(64, 64)
            self.frozen.requires_grad_(False)
            self.head = torch.nn.Linear(64, 256, bias=False)
            self.head.weight = self.emb.weight

        def _loss(self, x):
            h = self.emb(x[:, :-1])
            logits = self.head(self.norm(h + self.body(h) + self.frozen(h)))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())

        def training_step(self, batch, i):
            loss = self._loss(batch[0])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            self.log("val_loss", self._loss(batch[0]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = TensorDataset(torch.randint(0, 256, (512, 9)))
    trainer = pl.Trainer(strategy="zstack_zero3", accelerator="cpu", devices=2, max_steps=60, logger=False,
                         enable_checkpointing=False, val_check_interval=30, limit_val_batches=2,
                         num_sanity_val_steps=0)
    trainer.fit(TinyLM(), DataLoader(data, batch_size=4), DataLoader(data, batch_size=4))
    """
)

# The same kind of model as pipeline layers on 2 stages: a tied embedding (16,384) used again as the head, two
# Linears (8,320 + 8,256), an activation without parameters and a norm (128) that the module's setup hook freezes on
# the rank that holds it: 33,088 parameters, 128 of them frozen.
_PIPELINE_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    import lightning.pytorch as pl
    import zlightning
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from zlightning.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    def head(emb, h):
        return F.linear(h, emb.weight)

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    class TinyPipeLM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.pipe = PipelineModule(
                [
                    TiedLayerSpec("emb", nn.Embedding, 256, 64),
                    LayerSpec(nn.Linear, 64, 128),
                    F.gelu,
                    LayerSpec(nn.Linear, 128, 64),
                    LayerSpec(nn.LayerNorm, 64),
                    TiedLayerSpec("emb", nn.Embedding, 256, 64, forward_fn=head),
                ],
                loss_fn=loss_fn,
                num_stages=2,
            )

        def setup(self, stage):
            for name, p in self.pipe.named_parameters():
                if name.startswith("4."):
                    p.requires_grad_(False)

        def training_step(self, batch, i):
            x = batch[0]
            loss = self.pipe.batch_loss((x[:, :-1], x[:, 1:]))
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = TensorDataset(torch.randint(0, 256, (512, 9)))
    trainer = pl.Trainer(strategy="zstack_pipeline", accelerator="cpu", devices=2, max_steps=8, logger=False,
                         enable_checkpointing=False)
    trainer.fit(TinyPipeLM(), DataLoader(data, batch_size=8))
    """
)

_STEP_LINE = re.compile(r"^step (\d+)/(\d+)  .*train_loss \S+  \S+ (it/s|s/it)( {2}eta \d+:\d\d:\d\d)?$")


def _run(tmp_path: Path, script: str) -> str:
    """Runs ``script`` (2 ranks: the popen launcher re-runs it for rank 1) with standard output to a pipe and
    returns that output."""
    path = tmp_path / "run.py"
    path.write_text(script)
    drop = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONUNBUFFERED", _progress.PROGRESS_EVERY_ENV)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    proc = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,  # standard output is a pipe, as in a CI log
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.fixture(scope="module")
def zero3_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _run(tmp_path_factory.mktemp("zero3"), _ZERO3_SCRIPT)


@pytest.fixture(scope="module")
def pipeline_output(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _run(tmp_path_factory.mktemp("pipeline"), _PIPELINE_SCRIPT)


def _lines(output: str) -> list[str]:
    return [line.rstrip() for line in output.splitlines()]


# ---------------------------------------------------------------------------------------------- model summary
def test_zero3_summary_counts_the_full_model_and_what_each_rank_holds(zero3_output: str) -> None:
    lines = _lines(zero3_output)
    assert lines.count("37.2 K    Total params") == 1, zero3_output[:3000]  # printed once, by rank 0
    assert "33.1 K    Trainable params" in lines and "4.2 K     Non-trainable params" in lines
    assert "0.149     Total estimated model params size (MB)" in lines
    rows = {line.split("|")[1].strip(): line.split("|")[3].strip() for line in lines if line.count("|") >= 4}
    assert rows["emb"] == "16.4 K" and rows["head"] == "16.4 K"  # the tied head counts its weight, as in one process
    assert rows["body"] == "16.6 K" and rows["frozen"] == "4.2 K" and rows["norm"] == "128"
    held = [line for line in lines if line.startswith("Held per rank after sharding")]
    assert len(held) == 1 and "this rank holds 18.6 K of the 37.2 K parameters" in held[0], held
    assert "zstack_zero3, ZeRO stage 3, 2 ranks" in held[0]
    assert "FLOPs" not in zero3_output


def test_pipeline_summary_counts_every_stage(pipeline_output: str) -> None:
    lines = _lines(pipeline_output)
    assert lines.count("33.1 K    Total params") == 1, pipeline_output[:3000]
    assert "33.0 K    Trainable params" in lines and "128       Non-trainable params" in lines
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line.count("|") == 4]
    by_name = {r[1]: (r[2], r[3], r[4]) for r in rows if r[1].startswith("pipe.")}
    assert by_name["pipe.0"] == ("Embedding (tied: emb)", "16.4 K", "0"), by_name
    assert by_name["pipe.3"] == ("Linear", "8.3 K", "1") and by_name["pipe.2"][1] == "0"
    assert by_name["pipe.5"] == ("Embedding (tied: emb)", "16.4 K", "1")  # tied: listed twice, counted once
    held = [line for line in lines if line.startswith("Held per rank after sharding")]
    assert len(held) == 1 and "stage 0: 16.4 K; stage 1: 33.1 K" in held[0], held


# ---------------------------------------------------------------------------------------------- end of fit
def test_end_of_fit_summary_is_printed_once_for_a_plain_module(zero3_output: str) -> None:
    lines = _lines(zero3_output)
    final = [line for line in lines if line.startswith("final training loss")]
    assert len(final) == 1 and "(train_loss)" in final[0], zero3_output[-2000:]
    assert len([line for line in lines if line.startswith("final validation loss")]) == 1
    throughput = [line for line in lines if line.startswith("throughput")]
    assert len(throughput) == 1 and "tokens/s over 2 processes (60 optimizer steps)" in throughput[0]
    assert any(line.startswith("checkpoint") and "checkpointing is off" in line for line in lines)
    assert not any(line.startswith(("logs", "TensorBoard logs")) for line in lines)  # logger=False: omitted


# ---------------------------------------------------------------------------------------------- progress
def test_progress_to_a_pipe_is_a_few_plain_lines(zero3_output: str) -> None:
    assert "\r" not in zero3_output and "━" not in zero3_output and "it/s]" not in zero3_output
    steps = [line for line in _lines(zero3_output) if line.startswith("step ")]
    assert 3 <= len(steps) <= 25, zero3_output[-3000:]
    for line in steps:
        assert _STEP_LINE.match(line), line
    numbers = [int(_STEP_LINE.match(line).group(1)) for line in steps]  # type: ignore[union-attr]
    assert numbers == sorted(set(numbers)) and numbers[-1] == 60, numbers  # rank 0 only: no step twice
    validations = [line for line in _lines(zero3_output) if line.startswith("validation at step")]
    assert [line.split(":")[0] for line in validations] == ["validation at step 30", "validation at step 60"]
    assert all("val_loss" in line for line in validations), validations


def test_pipeline_progress_is_plain_lines(pipeline_output: str) -> None:
    steps = [line for line in _lines(pipeline_output) if line.startswith("step ")]
    assert [int(_STEP_LINE.match(line).group(1)) for line in steps] == list(range(1, 9)), steps  # type: ignore[union-attr]
    assert "\r" not in pipeline_output


# ---------------------------------------------------------------------------------------------- what is swapped
class _OwnBar(ProgressBar):
    def disable(self) -> None: ...

    def enable(self) -> None: ...


def _trainer(**kwargs: object) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, **kwargs)  # type: ignore[arg-type]


def _swapped(trainer: pl.Trainer) -> list[object]:
    install_run_report(trainer)
    return list(trainer.callbacks)  # type: ignore[attr-defined]


def test_stock_bar_becomes_lines_off_a_terminal_and_stays_a_bar_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_progress.PROGRESS_EVERY_ENV, raising=False)
    monkeypatch.setattr(_progress, "stdout_is_terminal", lambda: False)
    callbacks = _swapped(_trainer(callbacks=[TQDMProgressBar()]))
    assert [type(c) for c in callbacks if isinstance(c, ProgressBar)] == [LineProgress]
    assert sum(isinstance(c, _run_report._SizeSummary) for c in callbacks) == 1  # rich or not
    assert sum(isinstance(c, RunSummary) for c in callbacks) == 1
    monkeypatch.setattr(_progress, "stdout_is_terminal", lambda: True)
    bars = [c for c in _swapped(_trainer(callbacks=[TQDMProgressBar()])) if isinstance(c, ProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], TQDMProgressBar) and not isinstance(bars[0], LineProgress)


def test_the_users_own_choices_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_progress.PROGRESS_EVERY_ENV, raising=False)
    monkeypatch.setattr(_progress, "stdout_is_terminal", lambda: False)
    own, summary, report = _OwnBar(), ModelSummary(max_depth=2), RunSummary()
    callbacks = _swapped(_trainer(callbacks=[own, report]))
    assert own in callbacks and not any(isinstance(c, LineProgress) for c in callbacks)
    assert [c for c in callbacks if isinstance(c, RunSummary)] == [report]  # not a second one
    tuned = TQDMProgressBar(refresh_rate=20)  # a stock bar with settings of the user's own: a bar, with them
    bars = [c for c in _swapped(_trainer(callbacks=[tuned])) if isinstance(c, ProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], TQDMProgressBar) and bars[0].refresh_rate == 20
    callbacks = _swapped(_trainer(enable_progress_bar=False, callbacks=[summary]))
    assert not any(isinstance(c, ProgressBar) for c in callbacks)
    assert [c._max_depth for c in callbacks if isinstance(c, ModelSizeSummary)] == [2]  # type: ignore[attr-defined]
    assert not any(type(c) is ModelSummary for c in callbacks)
    monkeypatch.setenv(_progress.PROGRESS_EVERY_ENV, "0")  # 0: keep Lightning's bar
    bars = [c for c in _swapped(_trainer(callbacks=[RichProgressBar()])) if isinstance(c, ProgressBar)]
    assert len(bars) == 1 and isinstance(bars[0], RichProgressBar)


def test_progress_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [_progress._auto_every(n) for n in (8, 60, 1000, 100_000, float("inf"))] == [1, 5, 50, 5000, 50]
    monkeypatch.setattr(_progress, "stdout_is_terminal", lambda: False)
    monkeypatch.setenv(_progress.PROGRESS_EVERY_ENV, "25")
    bar = next(c for c in _swapped(_trainer(callbacks=[TQDMProgressBar()])) if isinstance(c, ProgressBar))
    assert isinstance(bar, LineProgress) and bar.every_n_steps == 25
    monkeypatch.setenv(_progress.PROGRESS_EVERY_ENV, "every 5")
    with pytest.raises(ValueError, match="ZLIGHTNING_PROGRESS_EVERY='every 5': give the number of optimizer steps"):
        _progress.progress_every_from_env()
    with pytest.raises(ValueError, match=r"every_n_steps=\.\.\.\) must be None or an int >= 1, got 0"):
        LineProgress(every_n_steps=0)


def _fake_trainer(step: int) -> SimpleNamespace:
    strategy = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2})
    return SimpleNamespace(
        global_step=step,
        world_size=2,
        strategy=strategy,
        is_global_zero=True,
        callback_metrics={"train_loss": torch.tensor(1.5)},
        logger=None,
        checkpoint_callback=None,
    )


@pytest.mark.parametrize(
    ("batch", "expected"),
    [
        ({"features": [1.0, 2.0]}, "optimizer steps/s over 2 processes (3 optimizer steps)"),  # nothing to count by
        ({"input_ids": torch.zeros(4, 8, dtype=torch.long)}, "tokens/s over 2 processes"),
        ((torch.zeros(4, 3), torch.zeros(4)), "samples/s over 2 processes"),
    ],
)
def test_throughput_is_tokens_samples_or_steps_per_second(batch: object, expected: str) -> None:
    out = io.StringIO()
    report = RunSummary(stream=out)
    for step in range(4):
        report.on_train_batch_end(_fake_trainer(step), pl.LightningModule(), None, batch, step)  # type: ignore[arg-type]
    report.on_fit_end(_fake_trainer(3), pl.LightningModule())  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert "final training loss : 1.5000 (train_loss)" in lines
    assert any(line.startswith("throughput") and expected in line for line in lines), lines
