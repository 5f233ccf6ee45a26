"""ZeRO-2/3 inside pipeline stages on DP2 x PP2 (4 gloo ranks, one spawn) against a single process.

Engine: ZeRO-3 and ZeRO-2 with tied embedding/head, global-norm clipping and AdamW: losses and every parameter (full
tensors gathered from the shards) equal the one-process run (fp32, rtol 1e-5); each stage is gathered once per batch
and its gradients reduce-scattered once per batch; per-rank model-state bytes at rest are about half (1/DP) of the
stage's under ZeRO-3. Checkpoints: a ZeRO-3 checkpoint resumes exactly on the same grid, on PP4 without ZeRO, and on
DP2 x PP2 with ZeRO-1 (the next step equals the uninterrupted one), and a ZeRO-1 checkpoint resumes under ZeRO-3.
Zero-bubble schedules: ZeRO-3 under ``zbv`` and ZeRO-2 under ``zb_h1`` match the same single process with every
backward split (none falls back to a whole backward), still one gather and one reduce-scatter per group per batch.
Lightning: ``PipelineStrategy(config=PipelineConfig(zero_stage=3))`` with gradient accumulation and clipping, under
1F1B and ``zbv``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt_pipe import gpt_pipeline
from tests.test_pipe_parity import (
    ACCUM,
    CFG,
    CLIP,
    MICRO,
    TOL,
    _check_states,
    _fit,
    data,
    lightning_global_batches,
    make_optimizer,
    reference,
    reference_on,
)
from zlightning.pipe import (
    PipelineConfig,
    PipelineEngine,
    _executor,
    load_pipeline_checkpoint,
    save_pipeline_checkpoint,
)
from zlightning.testing import run_distributed
from zlightning.zero._param_group import ZeroParamGroup


def _replica(engine: PipelineEngine, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, dp = engine.grid.dp_rank, engine.grid.dp
    b = x.shape[0] // dp
    return x[d * b : (d + 1) * b], y[d * b : (d + 1) * b]


def _full(engine: PipelineEngine) -> dict[str, torch.Tensor]:
    if engine.zero is not None:
        return engine.zero.full_state_dict()  # collective; filled on data-parallel rank 0
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()} if engine.grid.dp_rank == 0 else {}


class _Counter:
    """Counts real all-gathers of the ZeRO engine's parameter groups and split / whole ``B`` actions (a test-only
    look inside the engines)."""

    def __init__(self) -> None:
        self.gathers = 0
        original = ZeroParamGroup.start_gather

        def counting(group: ZeroParamGroup, async_op: bool) -> None:
            if group.status.value == "sharded":
                self.gathers += 1
            original(group, async_op)

        ZeroParamGroup.start_gather = counting  # type: ignore[method-assign]
        self.split, self.whole = 0, 0
        original_b = _executor.backward_input

        def counting_b(*args: Any) -> Any:
            work = original_b(*args)
            self.split, self.whole = self.split + (work is not None), self.whole + (work is None)
            return work

        _executor.backward_input = counting_b  # type: ignore[assignment]


ZERO_RUNS = (("zero3", 3, "1f1b"), ("zero2", 2, "1f1b"), ("zero3_zbv", 3, "zbv"), ("zero2_zb_h1", 2, "zb_h1"))
"""(result key, ZeRO stage, schedule) of the engine runs."""


def rank_engines(rank: int, ckpt: Path) -> dict[str, Any]:
    counter = _Counter()
    out: dict[str, Any] = {}
    batches = data()
    for key, stage, schedule in ZERO_RUNS:
        engine = PipelineEngine(
            gpt_pipeline(CFG, num_stages=2),
            make_optimizer,
            PipelineConfig(micro_batches=MICRO, zero_stage=stage, gradient_clipping=CLIP, schedule=schedule),
        )
        counter.split = counter.whole = 0
        losses, gathers, scatters = [], [], []
        for x, y in batches:
            g0, r0 = counter.gathers, sum(s.reduce_scatters for s in engine.zero.states)
            losses.append(float(engine.train_batch(batch=_replica(engine, x, y))))
            gathers.append(counter.gathers - g0)
            scatters.append(sum(s.reduce_scatters for s in engine.zero.states) - r0)
        out[key] = {
            "split": (counter.split, counter.whole),
            "losses": losses,
            "state": _full(engine),
            "gathers": gathers,
            "scatters": scatters,
            "groups": sum(len(s.groups) for s in engine.zero.states),
            "memory": engine.memory_report(),
            "grid": (engine.grid.stage, engine.grid.dp_rank),
        }
        if key == "zero3":
            zero3 = engine
    # checkpoint after 3 steps; the next step from the checkpoint on other grids and ZeRO stages
    x, y = data(1, seed=9)[0]
    save_pipeline_checkpoint(zero3, ckpt / "zero3")
    zero3.train_batch(batch=_replica(zero3, x, y))
    out["next"] = _full(zero3)
    for name, pp, config in (
        ("same", 2, PipelineConfig(micro_batches=MICRO, zero_stage=3, gradient_clipping=CLIP)),
        ("pp4", 4, PipelineConfig(micro_batches=2 * MICRO, gradient_clipping=CLIP)),
        ("zero1", 2, PipelineConfig(micro_batches=MICRO, zero_stage=1, gradient_clipping=CLIP)),
    ):
        other = PipelineEngine(gpt_pipeline(CFG, num_stages=pp, partition_method="uniform"), make_optimizer, config)
        load_pipeline_checkpoint(other, ckpt / "zero3")
        other.train_batch(batch=_replica(other, x, y))
        out[f"resumed_{name}"] = _full(other)
        if name == "zero1":  # and back: a ZeRO-1 checkpoint under ZeRO-3
            save_pipeline_checkpoint(other, ckpt / "zero1")
            back = PipelineEngine(
                gpt_pipeline(CFG, num_stages=2),
                make_optimizer,
                PipelineConfig(micro_batches=MICRO, zero_stage=3, gradient_clipping=CLIP),
            )
            load_pipeline_checkpoint(back, ckpt / "zero1")
            out["zero1_reloaded"] = (_full(back), _full(other))
    return out


def rank_main(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from zlightning.strategies import PipelineStrategy

    out: dict[str, Any] = {}
    for schedule in ("1f1b", "zbv"):
        config = PipelineConfig(micro_batches=MICRO, zero_stage=3, schedule=schedule)
        strategy = PipelineStrategy(num_stages=2, config=config)
        module, _ = _fit(world, strategy, epochs=1)
        out[f"lightning_{schedule}"] = {"losses": module.losses, "state": strategy.engine.zero.full_state_dict()}
    return {**out, **rank_engines(rank, Path(ckpt))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(rank_main, 4, str(tmp_path_factory.mktemp("zero3")), init_process_group=False, timeout=500)


@pytest.mark.parametrize("key", [k for k, _, _ in ZERO_RUNS])
def test_zero_in_stages_matches_single_process(runs: list[dict[str, Any]], key: str) -> None:
    ref_losses, ref_state = reference(dp=2)
    results = [r[key] for r in runs]
    assert [r["grid"] for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in results:
        torch.testing.assert_close(r["losses"], ref_losses, **TOL)
        # one all-gather per parameter group per batch (ZeRO-3 gathers again after each step; ZeRO-2 only after a
        # step, so not before the first batch... and also once: the buffer is refilled when stale), and one
        # reduce-scatter per group per batch, whatever the number of micro-batches
        assert r["gathers"] == [r["groups"]] * len(ref_losses), r["gathers"]
        assert r["scatters"] == [r["groups"]] * len(ref_losses), r["scatters"]
        split, whole = r["split"]
        if key.endswith(("zbv", "zb_h1")):  # every backward split: W (not B) ran the parameters' gradients
            assert split > 0 and whole == 0, r["split"]
        else:
            assert split == whole == 0, r["split"]
    _check_states([r["state"] for r in results], ref_state)


def test_zero3_model_state_is_sharded_over_the_replicas(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        m3, m2 = r["zero3"]["memory"], r["zero2"]["memory"]
        full = m3["full_model_bytes"] * 4  # parameters, gradients and AdamW's two moments of the stage
        assert m3["gathered_bytes"] == m3["persistent_bytes"] == 0  # ZeRO-3: nothing gathered between batches
        assert 0.45 <= m3["model_state_bytes"] / full <= 0.56, m3  # 1/DP plus padding and Adam's step counters
        assert m2["persistent_bytes"] == m2["full_model_bytes"]  # ZeRO-2 keeps the stage's parameters gathered


def test_zero3_checkpoint_resumes_and_reshards(runs: list[dict[str, Any]]) -> None:
    expected: dict[str, torch.Tensor] = {}
    for r in runs:
        expected.update(r["next"])
    for name in ("same", "pp4", "zero1"):
        _check_states([r[f"resumed_{name}"] for r in runs], expected)
    for r in runs:
        reloaded, saved = r["zero1_reloaded"]
        assert reloaded.keys() == saved.keys()
        for key, value in saved.items():
            torch.testing.assert_close(reloaded[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_lightning_dp2_pp2_zero3_with_accumulation_and_clipping(runs: list[dict[str, Any]], schedule: str) -> None:
    ref_losses, ref_state = reference_on(lightning_global_batches(dp=2, epochs=1), dp=2, accumulate=ACCUM)
    for r in runs:
        torch.testing.assert_close(r[f"lightning_{schedule}"]["losses"], ref_losses, **TOL)
    _check_states([r[f"lightning_{schedule}"]["state"] for r in runs], ref_state)
