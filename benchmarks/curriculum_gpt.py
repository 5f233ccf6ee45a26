"""A byte-level GPT with and without a sequence-length curriculum, compared at equal tokens, plus the curriculum
sampler's overhead per training step.

    .venv/bin/python benchmarks/curriculum_gpt.py           # both runs, one after the other (a few minutes)
    .venv/bin/python benchmarks/curriculum_gpt.py --quick   # smoke test: a few steps; writes curriculum_quick.*
    .venv/bin/python benchmarks/curriculum_gpt.py --render  # rewrite curriculum.md from curriculum.json

Both runs train `examples.gpt.GPTLightningModule` through the Lightning ``Trainer`` (2 CPU processes over gloo,
1 thread each, strategy ``ddp`` by default) on the Python standard library's source (`TextCorpusDataModule`), fed by
`CurriculumDataModule`. The curriculum run takes the ``data_efficiency`` section of ``examples/gpt_curriculum.yaml``
as it is (``seqlen_truncate``: 16 -> 128 tokens, ``fixed_linear`` over 200 steps, multiples of 8); the baseline
run uses the same section with ``curriculum_learning.enabled: false`` (plain shuffled batches of full length).
Model init, data split, learning rate and warmup are identical. The runs start one after the other, never in
parallel, each in 2 fresh processes (this script with ``--worker``).

[Note: equal tokens]
The baseline trains ``--baseline-steps`` optimizer steps of ``G = micro_batch * world_size`` full-length samples:
a budget of ``steps * G * seq_len`` input tokens. A curriculum step carries ``G * d(s)`` tokens, with ``d(s)`` the
schedule's difficulty at curriculum step ``s`` (`CurriculumScheduler`, the same code the sampler runs), so the
curriculum run gets as many steps as it takes to reach the same budget (the first step whose cumulative tokens
reach it; the overshoot is under one step's tokens and is reported). Validation is measured at the same token
fractions of the budget (``--eval-fractions``; the last one is the final result), always on the whole validation
split at full length (128): the token-weighted mean cross-entropy over all its samples, split across the ranks and
summed with ``all_reduce``. Lightning's own validation loop is off, so both runs are evaluated by the same code at
the same token counts. Each worker checks that the tokens it really trained on equal the plan.

[Note: what the sampler overhead counts]
The sampler's cost is the wall time spent inside ``next()`` of its iterator (`DeepSpeedDataSampler.__iter__`,
timed by a delegating wrapper `_TimedSampler`) plus the time of `CurriculumDataModule.on_before_batch_transfer`
(difficulty look-up, truncation, and the TensorBoard logging of the curriculum scalars). Dataset reads and collation
are not counted: a plain loader pays them too. The step time is the interval between consecutive
``on_train_batch_end`` calls (data, forward, backward, all-reduce, optimizer step, logging), excluding the
evaluations. Overhead = (sampler + hook seconds) / (sum of step intervals), per rank; Lightning prefetches one batch,
so the sampler is called one or two times more than there are steps, which is counted.

Outputs: ``benchmarks/results/curriculum.json`` (config, plan, per-run and per-rank numbers, the TensorBoard
difficulty series) and ``benchmarks/results/curriculum.md`` (tables, also printed). Per-rank logs go to
``benchmarks/results/curriculum_<run>_rank<k>.log`` (git-ignored), TensorBoard logs to ``runs/curriculum_gpt/<run>``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))

from _bench_common import REPO_ROOT, RankEnv, peak_rss_kib  # noqa: E402
from zero3 import _wait_ranks, find_free_port, machine_info, rank_environ  # noqa: E402

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

YAML_PATH = REPO_ROOT / "examples" / "gpt_curriculum.yaml"
RUNS: tuple[str, ...] = ("curriculum", "baseline")
"""Run names, in the order they run."""
SEQLEN_METRIC = "seqlen_truncate"
TB_ROOT = REPO_ROOT / "runs" / "curriculum_gpt"


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Everything both runs share (the curriculum itself comes from the YAML).

    Raises:
        ValueError: If a size is not positive or an evaluation fraction is outside (0, 1].
    """

    d_model: int = 128
    """Width of the residual stream (the YAML's 256 is too slow for 2 shared CPU cores)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads."""
    seq_len: int = 128
    """Full sample length (the YAML's; the curriculum's maximum difficulty)."""
    micro_batch: int = 16
    """Samples per rank per step (the YAML's ``batch_size``)."""
    world_size: int = 2
    """Data-parallel ranks (processes)."""
    strategy: str = "ddp"
    """Lightning strategy: ``ddp`` or ``zstack_zero3``."""
    lr: float = 1e-3
    """AdamW peak learning rate (both runs)."""
    warmup_steps: int = 20
    """Linear learning-rate warmup steps (both runs)."""
    baseline_steps: int = 400
    """Optimizer steps of the baseline (the YAML's ``max_steps``); fixes the token budget."""
    max_bytes: int = 4_000_000
    """Train-corpus byte cap (validation gets 5% of it)."""
    eval_fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    """Token-budget fractions at which validation is measured; see [Note: equal tokens]."""
    eval_batch: int = 32
    """Validation samples per forward."""
    log_every_n_steps: int = 10
    """Trainer ``log_every_n_steps`` (the curriculum scalars are logged at this rate)."""
    seed: int = 0
    """Model-init and corpus-split seed."""

    def __post_init__(self) -> None:
        for name in (
            "d_model",
            "n_layer",
            "n_head",
            "seq_len",
            "micro_batch",
            "world_size",
            "baseline_steps",
            "eval_batch",
            "log_every_n_steps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunConfig: {name} must be a positive int, got {value!r}.")
        if not self.eval_fractions or not all(0.0 < f <= 1.0 for f in self.eval_fractions):
            raise ValueError(f"RunConfig: eval_fractions must be in (0, 1], got {self.eval_fractions!r}.")

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks (no gradient accumulation)."""
        return self.micro_batch * self.world_size


# ---------------------------------------------------------------------------------------------------------------------
# plan (pure): data_efficiency dicts, steps, token counts, evaluation steps


def curriculum_section(yaml_path: Path, total_curriculum_step: int | None) -> dict[str, Any]:
    """The YAML's ``data.init_args.data_efficiency`` dict (optionally with another ``total_curriculum_step``)."""
    import yaml

    section = yaml.safe_load(yaml_path.read_text())["data"]["init_args"]["data_efficiency"]
    if total_curriculum_step is not None:
        metric = section["data_sampling"]["curriculum_learning"]["curriculum_metrics"][SEQLEN_METRIC]
        metric["schedule_config"]["total_curriculum_step"] = total_curriculum_step
    return section


def without_curriculum(section: dict[str, Any]) -> dict[str, Any]:
    """The same section with ``curriculum_learning.enabled: false``."""
    out = copy.deepcopy(section)
    out["data_sampling"]["curriculum_learning"]["enabled"] = False
    return out


def tokens_per_step(config: RunConfig, section: dict[str, Any], steps: int) -> list[int]:
    """Input tokens of each optimizer step ``1..steps`` over all ranks. See [Note: equal tokens]."""
    from zlightning.datamodules import CurriculumScheduler, DataEfficiencyConfig

    cl = DataEfficiencyConfig.from_dict(section).curriculum
    if not cl.enabled:
        return [config.global_batch * config.seq_len] * steps
    scheduler = CurriculumScheduler(cl.curriculum_metrics[SEQLEN_METRIC].schedule)
    return [config.global_batch * min(config.seq_len, scheduler.update_difficulty(s)) for s in range(1, steps + 1)]


def plan_run(config: RunConfig, section: dict[str, Any], budget: int) -> dict[str, Any]:
    """Steps to reach ``budget`` tokens and the steps at which each evaluation fraction is reached."""
    steps, per_step = 0, []
    while sum(per_step) < budget:
        steps += 256
        per_step = tokens_per_step(config, section, steps)
    cumulative, total = [], 0
    for t in per_step:
        total += t
        cumulative.append(total)
    last = next(i for i, c in enumerate(cumulative) if c >= budget) + 1
    evals = [next(i for i, c in enumerate(cumulative) if c >= f * budget) + 1 for f in config.eval_fractions]
    return {
        "steps": last,
        "tokens": cumulative[last - 1],
        "eval_steps": evals,
        "eval_tokens": [cumulative[s - 1] for s in evals],
        "seq_len_per_step": [t // config.global_batch for t in per_step[:last]],
    }


# ---------------------------------------------------------------------------------------------------------------------
# worker (one rank of one run)


class _TimedSampler:
    """Delegates to a `DeepSpeedDataSampler` and adds up the wall time spent in its iterator's ``next()``.

    A wrapper rather than a subclass or a patched instance: the sampler under test runs unchanged.
    See [Note: what the sampler overhead counts].
    """

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.seconds = 0.0
        self.calls = 0
        self.max_call_s = 0.0

    def __getattr__(self, name: str) -> Any:
        try:
            sampler = self.__dict__["sampler"]
        except KeyError:  # not constructed yet (copy, pickle)
            raise AttributeError(name) from None
        return getattr(sampler, name)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        it = iter(self.sampler)
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                self.seconds += time.perf_counter() - start
                return
            elapsed = time.perf_counter() - start
            self.seconds, self.calls, self.max_call_s = (
                self.seconds + elapsed,
                self.calls + 1,
                max(self.max_call_s, elapsed),
            )
            yield batch

    def rewind(self, micro_batches: int) -> None:
        start = time.perf_counter()
        self.sampler.rewind(micro_batches)
        self.seconds += time.perf_counter() - start


def _timed_data_module(base_cls: type) -> type:
    """`CurriculumDataModule` whose sampler is wrapped in `_TimedSampler` and whose batch hook is timed."""

    class TimedCurriculumDataModule(base_cls):  # type: ignore[misc,valid-type]
        hook_s = 0.0
        hook_calls = 0

        def build_sampler(self, dp_rank: int = 0, dp_size: int = 1, grad_accum: int = 1) -> Any:
            return _TimedSampler(super().build_sampler(dp_rank, dp_size, grad_accum))

        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            start = time.perf_counter()
            out = super().on_before_batch_transfer(batch, dataloader_idx)
            self.hook_s += time.perf_counter() - start
            self.hook_calls += 1
            return out

    return TimedCurriculumDataModule


class _ValSet:
    """The whole validation split as two int64 tensors [N, seq_len]; this rank evaluates every world-th batch.

    Every rank runs the same number of forwards (a rank short of real batches repeats batch 0 with weight 0): a
    sharded model (``zstack_zero3``) gathers parameters collectively in every forward.
    """

    def __init__(self, dataset: Any, batch: int, rank: int, world: int) -> None:
        import torch

        pairs = [dataset[i] for i in range(len(dataset))]
        self.x = torch.stack([p[0] for p in pairs])
        self.y = torch.stack([p[1] for p in pairs])
        self.batch, self.rank, self.world = batch, rank, world

    def loss(self, model: Any) -> float:
        """Token-weighted mean cross-entropy of ``model`` (a `GPT`) over the whole split, summed over ranks."""
        import torch
        import torch.distributed as dist
        import torch.nn.functional as F

        was_training = model.training
        model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        batches = -(-len(self.x) // self.batch)
        with torch.no_grad():
            for i in range(-(-batches // self.world)):
                j = self.rank + i * self.world
                real = j < batches
                start = j * self.batch if real else 0
                x, y = self.x[start : start + self.batch], self.y[start : start + self.batch]
                logits, _ = model(x)
                if real:
                    total[0] += F.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"
                    ).double()
                    total[1] += y.numel()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        model.train(was_training)
        return float(total[0] / total[1])


def _probe_class() -> type:
    from lightning.pytorch import Callback

    class Probe(Callback):
        """Counts tokens, stamps step ends, evaluates at the planned steps. See [Note: equal tokens]."""

        def __init__(self, eval_steps: list[int], val: _ValSet, world: int) -> None:
            self.eval_steps, self.val, self.world = set(eval_steps), val, world
            self.tokens, self.seq_lens, self.losses = 0, [], []
            self.intervals: list[float] = []
            self.evals: list[dict[str, Any]] = []
            self.eval_s = 0.0
            self._last: float | None = None

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.tokens += batch[0].numel() * self.world  # after truncation: every rank has the same length
            self.seq_lens.append(int(batch[0].shape[1]))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            now = time.perf_counter()
            if self._last is not None:
                self.intervals.append(now - self._last)
            self.losses.append(float(outputs["loss"]))
            step = trainer.global_step
            if step % trainer.log_every_n_steps == 0 and trainer.logger is not None:
                trainer.logger.log_metrics({"data/tokens": float(self.tokens)}, step=step)
            if step in self.eval_steps:
                loss = self.val.loss(pl_module.model)
                self.evals.append({"step": step, "tokens": self.tokens, "val_loss": loss})
                if trainer.logger is not None:
                    trainer.logger.log_metrics({"val/loss": loss, "data/tokens": float(self.tokens)}, step=step)
            self.eval_s += time.perf_counter() - now
            self._last = time.perf_counter()

    return Probe


def run_worker(run: str, config: RunConfig, plan: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """Trains one run on this rank and returns its numbers (see the module docstring)."""
    import torch

    torch.set_num_threads(1)
    import lightning
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger
    from zlightning.datamodules import CurriculumDataModule, TextCorpusDataModule

    import zlightning  # noqa: F401  (registers zstack_zero3)
    from examples.gpt import GPTLightningModule

    env = RankEnv.from_environ()
    base = TextCorpusDataModule(
        seq_len=config.seq_len, batch_size=config.micro_batch, max_bytes=config.max_bytes, seed=config.seed
    )
    dm = _timed_data_module(CurriculumDataModule)(section, base=base)
    base.setup("fit")
    val = _ValSet(base.val_dataset, config.eval_batch, env.rank, env.world_size)
    probe = _probe_class()(plan["eval_steps"], val, env.world_size)
    torch.manual_seed(config.seed)
    model = GPTLightningModule(
        seq_len=config.seq_len,
        d_model=config.d_model,
        n_layer=config.n_layer,
        n_head=config.n_head,
        lr=config.lr,
        warmup_steps=config.warmup_steps,
    )
    trainer = pl.Trainer(
        strategy=config.strategy,
        accelerator="cpu",
        devices=env.world_size,
        precision="32-true",
        max_steps=plan["steps"],
        max_epochs=-1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=config.log_every_n_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
        default_root_dir=str(TB_ROOT),
        logger=TensorBoardLogger(str(TB_ROOT), name=run, version=0),
    )
    torch.set_num_threads(1)
    start = time.perf_counter()
    trainer.fit(model, datamodule=dm)
    fit_s = time.perf_counter() - start
    _check_against_plan(probe, plan, trainer.global_step)
    sampler = dm.sampler
    return {
        "status": "ok",
        "steps": trainer.global_step,
        "tokens": probe.tokens,
        "evals": probe.evals,
        "fit_wall_s": fit_s,
        "eval_wall_s": probe.eval_s,
        "train_wall_s": fit_s - probe.eval_s,
        "step_intervals_s": probe.intervals,
        "train_losses": probe.losses,
        "sampler_s": sampler.seconds,
        "sampler_calls": sampler.calls,
        "sampler_max_call_s": sampler.max_call_s,
        "hook_s": dm.hook_s,
        "hook_calls": dm.hook_calls,
        "log_dir": trainer.logger.log_dir,
        "threads": torch.get_num_threads(),
        "versions": {"torch": torch.__version__, "lightning": lightning.__version__},
    }


def _check_against_plan(probe: Any, plan: dict[str, Any], steps: int) -> None:
    if steps != plan["steps"] or probe.tokens != plan["tokens"] or probe.seq_lens != plan["seq_len_per_step"]:
        raise RuntimeError(
            f"the run does not match its plan: {steps} steps / {probe.tokens} tokens trained, planned "
            f"{plan['steps']} / {plan['tokens']}; first differing step: "
            f"{next((i + 1 for i, (a, b) in enumerate(zip(probe.seq_lens, plan['seq_len_per_step'])) if a != b), None)}."
        )


def worker_main(args: argparse.Namespace) -> int:
    payload = json.loads(Path(args.spec).read_text())
    config = RunConfig(**{**payload["config"], "eval_fractions": tuple(payload["config"]["eval_fractions"])})
    env = RankEnv.from_environ()
    out = Path(args.out)
    try:
        result = run_worker(args.run, config, payload["plan"], payload["section"])
    except BaseException as err:  # noqa: BLE001  (recorded for the report, then signalled by the exit code)
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(err).__name__}: {err}"}
    result.update(rank=env.rank, peak_rss_kib=peak_rss_kib())
    (out / f"rank{env.rank}.json").write_text(json.dumps(result))
    return 0 if result["status"] == "ok" else 1


# ---------------------------------------------------------------------------------------------------------------------
# launcher


def launch(
    run: str, config: RunConfig, plan: dict[str, Any], section: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    """Runs one run in ``world_size`` fresh processes; returns its status, wall time and per-rank results."""
    shutil.rmtree(TB_ROOT / run, ignore_errors=True)
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"curriculum_{run}_") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": asdict(config), "plan": plan, "section": section}))
        port, procs = find_free_port(), []
        for rank in range(config.world_size):
            with open(args.out_dir / f"{args.stem}_{run}_rank{rank}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--worker", "--run", run, "--spec", str(spec), "--out", tmp],
                        cwd=REPO_ROOT,
                        env=rank_environ(rank, config.world_size, port, 1),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        status = _wait_ranks(procs, args.timeout)
        ranks = []
        for rank in range(config.world_size):
            path = Path(tmp) / f"rank{rank}.json"
            ranks.append(
                json.loads(path.read_text())
                if path.exists()
                else {"rank": rank, "status": "error", "error": "no result (killed or crashed; see its log)"}
            )
    errors = [f"rank {r['rank']}: {r['error']}" for r in ranks if r["status"] != "ok"]
    if errors:
        status = "; ".join(errors)
    return {
        "run": run,
        "status": status,
        "wall_s": time.monotonic() - start,
        "ranks": ranks,
        "loadavg_1min": [load_before, os.getloadavg()[0]],
    }


def tensorboard_series(log_dir: str, tag: str) -> list[list[float]]:
    """``[[step, value], ...]`` of one scalar in a TensorBoard run directory (empty if absent)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir, size_guidance={"scalars": 0})
    acc.Reload()
    if tag not in acc.Tags().get("scalars", []):
        return []
    return [[e.step, e.value] for e in acc.Scalars(tag)]


def overhead(rank: dict[str, Any]) -> dict[str, float]:
    """Sampler and hook time per step, and their share of the step time. See [Note: what the sampler overhead counts]."""
    steps_s = sum(rank["step_intervals_s"])
    n = len(rank["step_intervals_s"])
    spent = rank["sampler_s"] + rank["hook_s"]
    # The intervals cover steps 2..S; scale the sampler's total (all S steps plus prefetch) by the same share.
    share = n / rank["steps"]
    return {
        "sampler_ms_per_call": 1e3 * rank["sampler_s"] / max(1, rank["sampler_calls"]),
        "sampler_max_call_ms": 1e3 * rank["sampler_max_call_s"],
        "hook_ms_per_call": 1e3 * rank["hook_s"] / max(1, rank["hook_calls"]),
        "curriculum_ms_per_step": 1e3 * spent / rank["steps"],
        "mean_step_ms": 1e3 * steps_s / n,
        "median_step_ms": 1e3 * statistics.median(rank["step_intervals_s"]),
        "overhead_pct": 100.0 * spent * share / steps_s,
    }


def summarize(config: RunConfig, plans: dict[str, dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """The report: per run (rank 0's losses, both ranks' timings), comparison, TensorBoard check."""
    runs: dict[str, Any] = {}
    for res in results:
        entry: dict[str, Any] = {
            "status": res["status"],
            "wall_s": res["wall_s"],
            "loadavg_1min": res["loadavg_1min"],
            "plan": {k: v for k, v in plans[res["run"]].items() if k != "seq_len_per_step"},
        }
        if res["status"] == "ok":
            r0 = res["ranks"][0]
            entry.update(
                steps=r0["steps"],
                tokens=r0["tokens"],
                evals=r0["evals"],
                final_val_loss=r0["evals"][-1]["val_loss"],
                fit_wall_s=r0["fit_wall_s"],
                train_wall_s=r0["train_wall_s"],
                log_dir=r0["log_dir"],
                overhead={f"rank{r['rank']}": overhead(r) for r in res["ranks"]},
                peak_rss_kib=[r["peak_rss_kib"] for r in res["ranks"]],
                train_loss_last10=statistics.mean(r0["train_losses"][-10:]),
            )
        runs[res["run"]] = entry
    report: dict[str, Any] = {"runs": runs}
    cur, base = runs.get("curriculum", {}), runs.get("baseline", {})
    if "final_val_loss" in cur and "final_val_loss" in base:
        report["comparison"] = {
            "val_loss_curriculum": cur["final_val_loss"],
            "val_loss_baseline": base["final_val_loss"],
            "delta_curriculum_minus_baseline": cur["final_val_loss"] - base["final_val_loss"],
            "tokens_curriculum": cur["tokens"],
            "tokens_baseline": base["tokens"],
            "at_fraction": [
                {"fraction": f, "curriculum": c, "baseline": b}
                for f, c, b in zip(config.eval_fractions, cur["evals"], base["evals"])
            ],
        }
    if "log_dir" in cur:
        series = tensorboard_series(cur["log_dir"], f"curriculum/{SEQLEN_METRIC}")
        values = [v for _, v in series]
        report["tensorboard"] = {
            "log_dir": str(Path(cur["log_dir"]).relative_to(REPO_ROOT)),
            "tag": f"curriculum/{SEQLEN_METRIC}",
            "points": len(series),
            "first": series[0] if series else None,
            "last": series[-1] if series else None,
            "non_decreasing": values == sorted(values),
            "rising": bool(values) and values[-1] > values[0],
            "series": series,
        }
    return report


def markdown(config: RunConfig, report: dict[str, Any], section: dict[str, Any]) -> str:
    """The Markdown report (also printed)."""
    metric = section["data_sampling"]["curriculum_learning"]["curriculum_metrics"][SEQLEN_METRIC]
    lines = [
        f"# Sequence-length curriculum vs none at equal tokens ({config.world_size} CPU ranks, {config.strategy}, "
        "1 thread each)\n",
        f"GPT d_model {config.d_model}, {config.n_layer} layers, {config.n_head} heads, seq_len {config.seq_len}, "
        f"micro-batch {config.micro_batch}/rank, AdamW lr {config.lr:g} (warmup {config.warmup_steps}), fp32, on "
        f"the Python stdlib source ({config.max_bytes:,} train bytes). Curriculum ({YAML_PATH.relative_to(REPO_ROOT)}):"
        f" `{SEQLEN_METRIC}` {metric['min_difficulty']} -> {metric['max_difficulty']}, {metric['schedule_type']} over "
        f"{metric['schedule_config']['total_curriculum_step']} steps, multiples of "
        f"{metric['schedule_config']['difficulty_step']}. Val loss: mean cross-entropy (nats/byte) on the whole "
        "validation split at full length.\n",
        "| run | steps | tokens | val loss | wall time (s) | train time (s) | load avg (start, end) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    runs = report["runs"]
    for name, r in runs.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | {r['status']} | — | — | {r['wall_s']:.0f} | — | — |")
            continue
        load = ", ".join(f"{x:.1f}" for x in r["loadavg_1min"])
        lines.append(
            f"| {name} | {r['steps']} | {r['tokens']:,} | {r['final_val_loss']:.4f} | {r['wall_s']:.0f} | "
            f"{r['train_wall_s']:.0f} | {load} |"
        )
    if "comparison" in report:
        cmp_ = report["comparison"]
        lines += [
            "",
            f"Curriculum minus baseline at the end: {cmp_['delta_curriculum_minus_baseline']:+.4f} (one seed; "
            "the curriculum takes more, shorter optimizer steps for the same tokens). Wall times are on a "
            f"shared {os.cpu_count()}-core machine: compare them only at similar load averages.",
            "",
            "| token fraction | curriculum: step / tokens / val loss | baseline: step / tokens / val loss |",
            "|---:|---|---|",
        ]
        for row in cmp_["at_fraction"]:
            c, b = row["curriculum"], row["baseline"]
            lines.append(
                f"| {row['fraction']:g} | {c['step']} / {c['tokens']:,} / {c['val_loss']:.4f} | "
                f"{b['step']} / {b['tokens']:,} / {b['val_loss']:.4f} |"
            )
    lines += [
        "",
        "Sampler overhead per training step (sampler `next()` + `on_before_batch_transfer`, target < 2%):",
        "",
        "| run | rank | curriculum ms/step | sampler ms/call (max) | mean step ms | overhead |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        for rank, o in r.get("overhead", {}).items():
            lines.append(
                f"| {name} | {rank[4:]} | {o['curriculum_ms_per_step']:.3f} | {o['sampler_ms_per_call']:.3f} "
                f"({o['sampler_max_call_ms']:.1f}) | {o['mean_step_ms']:.0f} | {o['overhead_pct']:.3f}% |"
            )
    cur = [o["curriculum_ms_per_step"] for o in runs.get("curriculum", {}).get("overhead", {}).values()]
    if cur:
        worst = max(cur)
        lines += [
            "",
            f"The overhead is small here because CPU steps are slow; in absolute terms the curriculum costs "
            f"{worst:.2f} ms per step on this machine, i.e. {100 * worst / 50:.1f}% of a 50 ms (GPU-class) step.",
        ]
    tb = report.get("tensorboard")
    if tb:
        lines += [
            "",
            f"TensorBoard (`{tb['log_dir']}`, tag `{tb['tag']}`): {tb['points']} points from "
            f"{tb['first']} to {tb['last']} ([step, value]); non-decreasing: {tb['non_decreasing']}.",
        ]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="smoke test: 12 baseline steps; writes curriculum_quick.*")
    p.add_argument("--baseline-steps", type=int, default=None, help="baseline optimizer steps (default: YAML's 400)")
    p.add_argument(
        "--curriculum-steps",
        type=int,
        default=None,
        help="override the YAML's total_curriculum_step (default: keep it)",
    )
    p.add_argument("--strategy", choices=("ddp", "zstack_zero3"), default="ddp")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    p.add_argument("--out-dir", type=Path, default=BENCH_DIR / "results")
    p.add_argument("--render", action="store_true", help="rewrite the .md from the existing .json (no training)")
    args = p.parse_args()
    args.stem = "curriculum_quick" if args.quick else "curriculum"
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker_main(args)
    import yaml

    if args.render:
        report = json.loads((args.out_dir / f"{args.stem}.json").read_text())
        config = RunConfig(**{**report["config"], "eval_fractions": tuple(report["config"]["eval_fractions"])})
        text = markdown(config, report, report["data_efficiency"]["curriculum"])
        (args.out_dir / f"{args.stem}.md").write_text(text)
        print(text, end="")
        return 0
    yaml_steps = int(yaml.safe_load(YAML_PATH.read_text())["trainer"]["max_steps"])
    steps = args.baseline_steps or (12 if args.quick else yaml_steps)
    config = RunConfig(strategy=args.strategy, baseline_steps=steps, **({"max_bytes": 1_000_000} if args.quick else {}))
    section = curriculum_section(YAML_PATH, args.curriculum_steps or (6 if args.quick else None))
    sections = {"curriculum": section, "baseline": without_curriculum(section)}
    budget = steps * config.global_batch * config.seq_len
    plans = {run: plan_run(config, sections[run], budget) for run in RUNS}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for run in RUNS:  # one after the other, never in parallel
        print(f">> {run}: {plans[run]['steps']} steps, {plans[run]['tokens']:,} tokens", flush=True)
        results.append(launch(run, config, plans[run], sections[run], args))
        print(f">> {run}: {results[-1]['status']} ({results[-1]['wall_s']:.0f} s)", flush=True)
    report = {
        "benchmark": "curriculum_gpt",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": asdict(config),
        "token_budget": budget,
        "data_efficiency": sections,
        "machine": machine_info(),
        "definitions": {
            "tokens": "input tokens trained on, all ranks (after seqlen truncation)",
            "val_loss": "token-weighted mean cross-entropy (nats) over the whole validation split, full length",
            "wall_s": "launch to exit of the run's processes (imports, data, training, evaluations)",
            "train_wall_s": "rank 0's Trainer.fit wall time minus the evaluations",
            "overhead_pct": "(sampler next() + on_before_batch_transfer) seconds / step-interval seconds",
        },
        **summarize(config, plans, results),
    }
    (args.out_dir / f"{args.stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(config, report, section)
    (args.out_dir / f"{args.stem}.md").write_text(text)
    print()
    print(text, end="")
    return 0 if all(r["status"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
