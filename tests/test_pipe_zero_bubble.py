"""Zero-bubble schedules (single process): ``zb_h1`` and ``zbv`` as data (simulator, coverage, CSV), their bubble and
activation peak under the unit-cost timing model against 1F1B, and the split backward (``B`` = input gradient,
``W`` = weight gradients) against one ordinary backward. Multi-rank parity (P = 2 and 4, tied weights, ZeRO-1,
Lightning) is in ``test_pipe_parity.py``, which spawns its ranks once for every schedule."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from examples.gpt_model import GPTConfig
from examples.gpt_pipe import gpt_pipeline
from zlightning.pipe import (
    Action,
    ActionCosts,
    ActionKind,
    PipelineConfig,
    PipelineEngine,
    Schedule,
    ScheduleError,
    build_schedule,
    simulate,
    timeline,
)
from zlightning.pipe._backward import SavedActivations, backward_input, backward_weight
from zlightning.pipe._calibrate import costs_from, local_medians
from zlightning.pipe._schedule import add_send_recv, zb_h1, zbv

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
CFG = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=4, n_head=4, bias=False)


@pytest.mark.parametrize("name", ["zb_h1", "zbv"])
def test_zero_bubble_schedules_are_valid_for_every_size(name: str) -> None:
    v = 2 if name == "zbv" else 1
    for p in range(1, 7):
        for m in range(1, 13):
            sched = build_schedule(name, p, m, v)  # lowered and simulated
            every = {(s, i) for s in range(p * v) for i in range(m)}
            if name == "zb_h1" or m < 2 * p:
                assert sched.split == every  # every backward is split
            else:  # the phased V: whole backwards in the steady state ([Note: the phased V order])
                assert sched.split < every
            for r, prog in enumerate(sched.programs):
                assert {a.stage for a in prog} == set(sched.stages_of(r))
                for s in sched.stages_of(r):
                    for kind in (F, B):
                        assert sorted(a.microbatch for a in prog if a.stage == s and a.kind is kind) == list(range(m))
                    weights = sorted(a.microbatch for a in prog if a.stage == s and a.kind is W)
                    assert weights == sorted(i for st, i in sched.split if st == s)


def test_placements() -> None:
    v = build_schedule("zbv", 3, 6, 2)
    assert [v.stages_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]  # the V: first and last stage on rank 0
    assert build_schedule("zb_h1", 3, 6).stages_of(1) == (1,)
    assert build_schedule("inference", 3, 6, 2, "v").stages_of(0) == (0, 5)
    # the turn of the V (stage 2 -> 3, both on rank 2) needs no transfer
    assert not any(
        a.kind in (ActionKind.SEND_F, ActionKind.RECV_F) and a.stage in (2, 3) and a.stage != 2
        for a in v.programs[2]
        if a.kind is ActionKind.RECV_F
    )
    assert Action(2, ActionKind.SEND_F, 0) not in v.programs[2]


def test_zb_h1_structure_bubble_and_memory() -> None:
    """1F1B's F/B order; on rank r the W of micro-batch j right after the B of j + r. Unit costs (F = B = W): the
    bubble is (P-1)/(3M+P-1), a third of 1F1B's idle time, and no rank holds more activations than 1F1B's peak."""
    h1 = zb_h1(3, 6)
    assert " ".join(map(str, h1.programs[2][:8])) == "2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3"
    assert " ".join(map(str, h1.programs[0][:8])) == "0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1"
    for p in (2, 3, 4, 6):
        for m in (p, 2 * p, 8, 16):
            zb = timeline(build_schedule("zb_h1", p, m), 1.0, 2.0, 1.0)
            ref = timeline(build_schedule("1f1b", p, m), 1.0, 2.0)
            assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
            assert (zb.makespan - 3 * m) == pytest.approx((ref.makespan - 3 * m) / 3)
            assert max(zb.peak_activations()) <= max(ref.peak_activations()) == min(p, m)


def test_zbv_bubble_and_memory() -> None:
    """Unit chunk costs (the first stage's backward all W). With M >= 2P (the phased order) ZBV's bubble is about
    half of ZB-H1's on two ranks and below it from three, each rank holds at most 2P + 1 chunk activations (1F1B's
    first rank holds 2P), and the order is DualPipeV's phases: on two ranks, rank 0 runs
    F0 F0 F0 | F3 B3 W3 | F3 F0 | B3 F3 B0 F0 ... ([Note: the phased V order]). Below 2P the list order stays within
    2P. ZBV beats 1F1B up to P = 6 (see [Note: zero-bubble schedules])."""
    v = zbv(2, 8)
    assert " ".join(map(str, v.programs[0][:12])) == "0F0 0F1 0F2 3F0 3B0 3W0 3F1 0F3 3B1 3F2 0B0 0F4"
    assert " ".join(map(str, v.programs[1][-4:])) == "2B7 1B7 2W7 1W7"
    for m in (4, 8, 16):
        zbv_bubble = timeline(build_schedule("zbv", 2, m, 2), 1.0, 2.0, 1.0).bubble_fraction
        assert zbv_bubble <= 0.55 * timeline(build_schedule("zb_h1", 2, m), 1.0, 2.0, 1.0).bubble_fraction
    for p in (2, 3, 4, 6):
        for m in (p, 2 * p, 4 * p):
            t = timeline(build_schedule("zbv", p, m, 2), 1.0, 2.0, 1.0)
            ref = timeline(build_schedule("1f1b", p, m), 1.0, 2.0)
            assert max(t.peak_activations()) <= 2 * max(ref.peak_activations()) + (m >= 2 * p)
            assert t.bubble_fraction < ref.bubble_fraction
            if m >= 2 * p and p > 2:
                assert t.bubble_fraction < timeline(build_schedule("zb_h1", p, m), 1.0, 2.0, 1.0).bubble_fraction


COSTS = [(1.0, 1.3, 0.7), (1.0, 1.4, 0.8), (1.0, 1.2, 0.6), (1.0, 1.0, 1.0), (1.0, 0.8, 1.2), (0.7, 1.1, 0.9)]


@pytest.mark.parametrize("f,b,w", COSTS)
def test_zbv_ordered_by_its_costs(f: float, b: float, w: float) -> None:
    """Ordered over the costs it runs at, zbv leaves no more idle time than the unit-cost order, stays within 1F1B's
    activation peak, and on two ranks beats 1F1B; where a weight gradient costs less than an input gradient the
    unit-cost order is worse than 1F1B and the cost-aware one is not (see [Note: zbv orders by measured costs])."""
    costs = ActionCosts(f, b, w)
    for p in (2, 3, 4):
        for m in (p, 2 * p, 4 * p, 8):
            tuned = timeline(build_schedule("zbv", p, m, 2, costs=costs), f, b + w, w)
            unit = timeline(build_schedule("zbv", p, m, 2), f, b + w, w)
            ref = timeline(build_schedule("1f1b", p, m), f, b + w)
            assert max(tuned.peak_activations()) <= 2 * max(ref.peak_activations()) + (m >= 2 * p)
            if m >= 2 * p:  # the phased order does not depend on costs
                assert tuned == unit
            if p == 2:
                assert tuned.makespan <= unit.makespan + 1e-9, (p, m)
                assert tuned.bubble_fraction < ref.bubble_fraction, (p, m)
    skewed = timeline(build_schedule("zbv", 3, 5, 2), 1.0, 2.0, 0.6)  # the list order's range (M < 2P)
    assert skewed.bubble_fraction > timeline(build_schedule("1f1b", 3, 5), 1.0, 2.0).bubble_fraction
    assert timeline(build_schedule("zbv", 3, 5, 2, costs=ActionCosts(1.0, 1.4, 0.6)), 1.0, 2.0, 0.6).bubble_fraction < (
        0.6 * skewed.bubble_fraction
    )


def test_cost_ordered_zbv_is_valid_for_every_size() -> None:
    for f, b, w in COSTS:
        for p in range(1, 6):
            for m in range(1, 11):
                sched = build_schedule("zbv", p, m, 2, costs=ActionCosts(f, b, w))  # lowered and simulated
                if m < 2 * p:
                    assert sched.split == {(s, i) for s in range(2 * p) for i in range(m)}
                else:
                    assert sched == build_schedule("zbv", p, m, 2)


def test_costs_from_measurements() -> None:
    nan = float("nan")
    # per rank [forward, input backward, weight backward] seconds; the median over ranks, relative to the forward
    assert costs_from([[0.010, 0.013, 0.007], [0.011, 0.014, 0.0071], [0.5, 0.9, 0.1]]) == ActionCosts(1.0, 1.25, 0.65)
    assert costs_from([[0.02, nan, nan], [0.02, 0.03, 0.01]]) == ActionCosts(1.0, 1.5, 0.5)  # a rank with stage 0 only
    assert costs_from([[0.02, nan, nan]]) == ActionCosts()  # nothing to go by: unit costs
    assert costs_from([[0.1, 0.0001, 0.2]]).backward_input == 0.05  # never zero
    timings = [("0F0", 0.0, 1.0), ("0W0", 1.0, 3.0), ("0B0", 3.0, 3.0), ("3F0", 3.0, 4.5), ("3B0", 5.0, 6.0)]
    assert local_medians(timings)[0] == 1.25 and local_medians(timings)[1] == 1.0  # stage 0's B and W left out
    assert math.isnan(local_medians(timings)[2])


def test_action_costs_and_config_validation() -> None:
    with pytest.raises(ValueError, match="ActionCosts.backward_weight must be a positive finite number"):
        ActionCosts(1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="ActionCosts.forward must be a positive finite number"):
        ActionCosts(float("inf"))
    with pytest.raises(ValueError, match="schedule_costs must be 'auto', 'unit' or a zlightning.pipe.ActionCosts"):
        PipelineConfig(schedule="zbv", schedule_costs="measured")  # type: ignore[arg-type]
    assert PipelineConfig(schedule="zbv", schedule_costs=ActionCosts(1, 2, 1)).schedule_costs.backward_input == 2


def test_csv_round_trip_weights_and_simulator_errors() -> None:
    sched = build_schedule("zbv", 2, 4, 2)
    back = Schedule.from_csv(sched.to_csv(), name="zbv", num_stages=4, num_microbatches=4, placement="v")
    assert back.programs == sched.programs and back.lowered and back.placement == "v"
    simulate(back)
    assert Action.parse("3W2") == Action(3, W, 2)
    bad = Schedule.from_csv("0F0,0W0,0B0", name="w-first", num_stages=1, num_microbatches=1)
    with pytest.raises(ScheduleError, match="weight gradient 0W0 before its backward"):
        simulate(bad)
    twice = Schedule.from_csv("0F0,0B0,0W0,0W0", name="twice", num_stages=1, num_microbatches=1)
    with pytest.raises(ScheduleError, match="WEIGHT for micro-batches \\[0, 0\\]"):
        simulate(twice)
    with pytest.raises(ValueError, match="'v' placement needs 2 stages per rank"):
        Schedule("x", 2, 2, 1, ((), ()), placement="v")


def test_lowering_receives_in_the_senders_order() -> None:
    """With two chunks per rank a rank may consume messages of one peer in another order than they were sent; the
    lowering then receives the earlier ones first (here rank 1 receives activation 2 before the gradient 0)."""
    prog = build_schedule("zbv", 2, 3, 2).programs[1]  # the list order (M < 2P)
    text = " ".join(map(str, prog))
    assert "1RECV_F2 2RECV_B0 2B0" in text
    # schedules whose receive order already matches are lowered exactly as before
    assert (
        " ".join(map(str, add_send_recv(build_schedule("1f1b", 2, 4)).programs[1][:4])) == "1RECV_F0 1F0 1B0 1SEND_B0"
    )


def test_config_accepts_zero_bubble_schedules() -> None:
    assert PipelineConfig(schedule="zbv").chunks_per_rank == 2 and PipelineConfig(schedule="zbv").placement == "v"
    assert PipelineConfig(schedule="zb_h1").chunks_per_rank == 1
    with pytest.raises(ValueError, match="'zbv' runs two chunks per rank"):
        PipelineConfig(schedule="zbv", virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved_1f1b'"):
        PipelineConfig(schedule="zb_h1", virtual_stages=2)
    with pytest.raises(ValueError, match="'zbv' runs two chunks per rank"):
        build_schedule("zbv", 2, 4)


# ---------------------------------------------------------------------------------------------------- split backward
def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("interval", [0, 1])
def test_split_backward_equals_one_backward(interval: int) -> None:
    """The last GPT stage (blocks, norm, tied head, loss) with a received input: ``B`` gives the input gradient (and
    the norms' weight gradients, computed by the same kernels), ``W`` the remaining weight gradients, together
    exactly those of one backward (also with activation checkpointing)."""
    torch.manual_seed(0)
    split, whole = (gpt_pipeline(CFG, activation_checkpoint_interval=interval).build((1,), 2) for _ in range(2))
    x = torch.randn(2, 16, 32, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    y = torch.randint(0, 64, (2, 16))
    loss = split.compute_loss(split.run_stage(1, x), y)
    work = backward_input([loss * 0.5], [torch.ones(())], [x])
    assert work is not None and work.levels
    # B leaves every matrix multiply's weight gradient to W; only the norms' (same kernel as their dX) are there
    assert _grads(split) and all(".ln_" in name or name.startswith("6.") for name in _grads(split)), sorted(
        _grads(split)
    )
    backward_weight(work)
    (whole.compute_loss(whole.run_stage(1, x_ref), y) * 0.5).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    expected = _grads(whole)
    assert _grads(split).keys() == expected.keys()
    for name, g in _grads(split).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-6, atol=1e-7, msg=name)


def test_first_stage_is_all_weight_and_shared_weights_fall_back_only_when_they_must() -> None:
    torch.manual_seed(0)
    split, whole = (gpt_pipeline(CFG).build((0,), 2) for _ in range(2))
    ids = torch.randint(0, 64, (2, 16))
    out = split.run_stage(0, ids)
    g = torch.randn_like(out)
    work = backward_input([out], [g], [])  # token ids: no input gradient, the whole backward is W
    assert work is not None and not work.levels and not _grads(split)
    backward_weight(work)
    whole.run_stage(0, ids).backward(g)
    for name, value in _grads(whole).items():
        torch.testing.assert_close(_grads(split)[name], value, msg=name)
    # one layer applied at two depths of the input path, its bias feeding both matrix multiplies' edges: B runs the
    # whole backward, W has nothing to do
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    out = lin(torch.tanh(lin(x)))
    assert backward_input([out], [torch.ones_like(out)], [x]) is None
    assert lin.weight.grad is not None and x.grad is not None
    # without the bias every edge belongs to one use (its own transpose node; the weight is shared only below the
    # edges, as a ZeRO stage's gather node is): split, and the same gradients as one backward
    for use_twice in (
        lambda lin, x: lin(torch.tanh(lin(x))),
        lambda lin, x: torch.tanh(x @ (2 * lin.weight).t()) @ (2 * lin.weight).t(),
    ):
        lin = nn.Linear(4, 4, bias=False)
        x = torch.randn(3, 4, requires_grad=True)
        out = use_twice(lin, x)
        work = backward_input([out], [torch.ones_like(out)], [x])
        assert work is not None and work.levels and lin.weight.grad is None
        backward_weight(work)
        split_grads = (x.grad.clone(), lin.weight.grad.clone())
        x.grad, lin.weight.grad = None, None
        use_twice(lin, x).backward(torch.ones_like(out))
        torch.testing.assert_close(split_grads, (x.grad, lin.weight.grad), rtol=1e-6, atol=1e-7)


class _LiveBytes:
    """Outer saved-tensor hooks that count the bytes of saved tensors still held (as the benchmark's meter)."""

    def __init__(self) -> None:
        self.live = 0

    def pack(self, t: torch.Tensor) -> object:
        meter, nbytes = self, t.untyped_storage().nbytes()

        class Held:
            def __init__(self) -> None:
                self.t = t.detach()
                meter.live += nbytes

            def __del__(self) -> None:
                meter.live -= nbytes

        return Held()

    def unpack(self, held: object) -> torch.Tensor:
        return held.t  # type: ignore[attr-defined]


@pytest.mark.parametrize("interval", [0, 1])
def test_after_b_only_what_w_needs_stays_saved(interval: int) -> None:
    """[Note: what B leaves for W]: after ``B`` the last GPT stage keeps only the tensors its ``W`` reads (well under
    what its forward saved), through outer saved-tensor hooks that still see every tensor, and ``W`` still gives one
    backward's gradients (also with activation checkpointing)."""
    torch.manual_seed(0)
    split, whole = (gpt_pipeline(CFG, activation_checkpoint_interval=interval).build((1,), 2) for _ in range(2))
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = torch.randint(0, 64, (2, 16))
    meter, saved = _LiveBytes(), SavedActivations()
    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack), saved.recording():
        loss = split.compute_loss(split.run_stage(1, x), y)
    after_forward = meter.live
    assert after_forward > 0
    work = backward_input([loss], [torch.ones(())], [x])
    saved.keep_only_for(work)
    if interval == 0:  # checkpointed layers save only their inputs: little to free, but nothing W needs
        assert meter.live < 0.75 * after_forward, (meter.live, after_forward)
    backward_weight(work)
    x_ref = x.detach().clone().requires_grad_()
    whole.compute_loss(whole.run_stage(1, x_ref), y).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=0)
    expected = _grads(whole)
    assert _grads(split).keys() == expected.keys()
    for name, g in _grads(split).items():
        torch.testing.assert_close(g, expected[name], rtol=1e-6, atol=1e-7, msg=name)
    del work, loss  # the executor keeps neither after W: the stage's graph and what it saved are gone
    if interval == 0:  # with checkpointing a few records outlive the graph in this test, with or without
        assert meter.live == 0  # SavedActivations (20 KiB without it, 4 KiB with): not this test's subject


def test_a_freed_activation_fails_loudly() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    saved = SavedActivations()
    with saved.recording():
        out = torch.tanh(lin(x)).sum()
    saved.keep_only_for(None)  # as after a B that ran the whole backward: nothing is needed any more
    with pytest.raises(RuntimeError, match="freed after its input backward"):
        out.backward()


@pytest.mark.parametrize("schedule", ["zb_h1", "zbv"])
def test_single_process_engine_with_zero_bubble_schedule(schedule: str) -> None:
    """One rank (P = 1; zbv: both chunks of the V on it): train_batch equals a plain loop."""
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(1))
    engine = PipelineEngine(
        gpt_pipeline(CFG), lambda ps: torch.optim.SGD(ps, lr=0.1), PipelineConfig(micro_batches=2, schedule=schedule)
    )
    ref = gpt_pipeline(CFG).build()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        loss = engine.train_batch(batch=(ids[:, :-1], ids[:, 1:]))
        losses = [ref.compute_loss(ref(x), y) for x, y in zip(ids[:, :-1].chunk(2), ids[:, 1:].chunk(2))]
        (sum(losses) / 2).backward()
        opt.step()
        opt.zero_grad()
        torch.testing.assert_close(float(loss), float(sum(losses).detach()) / 2, rtol=1e-5, atol=1e-6)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(engine.module.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


class TinyPipeModule(pl.LightningModule):
    """A LightningModule holding a PipelineModule, for the command line to name by class path."""

    def __init__(self) -> None:
        super().__init__()
        self.pipe = gpt_pipeline(CFG)


def test_lightning_cli_selects_zero_bubble_schedules(capsys: pytest.CaptureFixture[str]) -> None:
    from zlightning.cli import main

    base = ["fit", f"--model={__name__}.TinyPipeModule", "--trainer.strategy=zlightning.strategies.PipelineStrategy"]
    with pytest.raises(SystemExit) as done:
        main(base + ["--trainer.strategy.schedule=zbv", "--print_config"])
    assert done.value.code == 0 and "schedule: zbv" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        main(base + ["--trainer.strategy.schedule=zb_h2", "--print_config"])
    assert bad.value.code != 0 and "zb_h1" in capsys.readouterr().err
