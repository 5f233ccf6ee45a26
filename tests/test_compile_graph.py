"""zlightning.compile graph mode: ZeRO-3 collectives inside the compiled graphs, placement passes, memory budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import fx

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.compile import CompileConfig, compile_zero3
from zlightning.compile._budget import GroupProfile, budget_bytes, plan_unshard
from zlightning.compile._graph import GroupSpec, place_gathers, prefetch_gathers
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

AG = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _spec(i: int, kind: str, nbytes: int) -> GroupSpec:
    return GroupSpec(
        index=i,
        kind=kind,
        unit=f"u{i}",
        world=2,
        group_name="g",
        pad=0,
        param_dtype=torch.float32,
        reduce_dtype=torch.float32,
        master_dtype=torch.float32,
        unsharded_bytes=nbytes,
        views=(),
    )


def test_config_validation_for_graph_mode() -> None:
    with pytest.raises(ValueError, match="mode"):
        CompileConfig(mode="whole")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch_depth"):
        CompileConfig(prefetch_depth=-1)
    for bad in (-1, 1.5, "1GB", True):
        with pytest.raises(ValueError, match="unshard_budget"):
            CompileConfig(unshard_budget=bad)  # type: ignore[arg-type]


def test_budget_plan_ranks_by_measured_time_per_byte_and_respects_the_cap() -> None:
    specs = [_spec(0, "root", 100), _spec(1, "unit", 400), _spec(2, "unit", 400), _spec(3, "unit", 200)]
    profile = [GroupProfile(1, "u1", 400, 4e-3), GroupProfile(2, "u2", 400, 1e-3), GroupProfile(3, "u3", 200, 3e-3)]
    assert budget_bytes(specs, 0.5) == 500 and budget_bytes(specs, 123) == 123 and budget_bytes(specs, None) == 0
    plan = plan_unshard(specs, profile, 600)  # u3 (15 us/B) then u1 (10 us/B); u2 no longer fits
    assert plan.kept == (1, 3) and plan.kept_bytes == 600 and plan.kept_bytes <= plan.budget_bytes
    assert plan_unshard(specs, profile, 399).kept == (3,)
    assert plan_unshard(specs, profile, 0).kept == () and plan_unshard(specs, profile, 1.0).kept == (1, 2, 3)


def _gather_graph() -> fx.GraphModule:
    """Three gathers issued up front (as Dynamo emits them), each used by a later stage of compute."""
    g = fx.Graph()
    x = g.placeholder("x")
    shards = [g.placeholder(f"s{i}") for i in range(3)]
    fulls = []
    for s in shards:
        fulls.append(g.call_function(WAIT, (g.call_function(AG, (s, 1, "grp")),)))
    h = x
    for f in fulls:
        v = g.call_function(torch.ops.aten.view.default, (f, [4]))
        h = g.call_function(torch.ops.aten.mul.Tensor, (g.call_function(torch.ops.aten.tanh.default, (h,)), v))
    g.output(h)
    return fx.GraphModule(torch.nn.Module(), g)


def _positions(gm: fx.GraphModule) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"ag": [], "wait": [], "tanh": []}
    for i, n in enumerate(gm.graph.nodes):
        key = {AG: "ag", WAIT: "wait", torch.ops.aten.tanh.default: "tanh"}.get(n.target)
        if key:
            out[key].append(i)
    return out


def test_place_then_prefetch_schedule_one_unit_ahead() -> None:
    gm = _gather_graph()
    assert max(_positions(gm)["wait"]) < min(_positions(gm)["tanh"])  # everything gathered before any compute
    assert place_gathers(gm) > 0
    p = _positions(gm)
    for k in range(3):  # each gather sits right before its use, after the compute before it: one unit at a time
        assert p["tanh"][k] < p["ag"][k] < p["wait"][k]
    assert prefetch_gathers(gm, CompileConfig(prefetch_depth=1)) == 2
    p = _positions(gm)
    for k in range(1, 3):  # issued right after the previous gather's wait, ahead of the compute it overlaps
        assert p["wait"][k - 1] < p["ag"][k] == p["wait"][k - 1] + 1 < p["tanh"][k]
    gm.graph.lint()
    gm.recompile()


def _rank(rank: int, world: int, config: CompileConfig | None, steps: int) -> dict[str, Any]:
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = tiny_gpt()
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig(), gradient_clipping=1.0
    )
    handle = compile_zero3(zero, config) if config is not None else None
    losses, graphs = [], []
    for batch in batches(steps, global_batch=4 * world):
        loss = gpt_loss(model, batch.chunk(world)[rank])
        zero.backward(loss)
        zero.step()
        losses.append(float(loss.detach()))
        graphs.append(handle.graphs if handle is not None else 0)
    with torch.no_grad():  # an evaluation pass compiles one inference graph, then reuses it
        evals = [float(gpt_loss(model, b.chunk(world)[rank])) for b in batches(2, global_batch=4 * world, seed=7)]
    out = {
        "losses": losses,
        "state": zero.module_state_dict(),
        "graphs": graphs,
        "evals": evals,
        "breaks": sum(counters["graph_break"].values()),
    }
    if handle is not None and handle.graph_stats is not None:
        gs = handle.graph_stats
        out.update(
            fw=gs.forward_gathers,
            bw=gs.backward_gathers,
            rs=gs.backward_reduce_scatters,
            saved=gs.saved_unit_bytes,
            n_units=sum(1 for s in handle.specs if s.kind == "unit"),
            n_groups=len(handle.specs),
            unit_bytes=[s.unsharded_bytes for s in handle.specs if s.kind == "unit"],
            plan=(handle.plan.budget_bytes, handle.plan.kept, handle.plan.kept_bytes) if handle.plan else None,
            graphs_end=handle.graphs,
        )
        with pytest.raises(RuntimeError, match="called outside"):  # a unit used behind the compiled graph's back
            model.blocks[0](torch.zeros(1, 4, 32))
        handle.restore()  # back to the eager engine: its hooks gather again and training continues
        loss = gpt_loss(model, batches(1, global_batch=4 * world, seed=9)[0].chunk(world)[rank])
        zero.backward(loss)
        zero.step()
        out["after_restore"] = float(loss.detach())
    return out


def _assert_parity(ref: list[dict], got: list[dict]) -> None:
    for e, c in zip(ref, got):
        torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c["evals"], e["evals"], rtol=1e-4, atol=1e-5)
        for name, value in e["state"].items():
            torch.testing.assert_close(c["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
        assert c["breaks"] == 0
        assert c["graphs"] == [1] * len(c["graphs"])  # one graph, compiled in step 1, no recompiles
        assert c["graphs_end"] == 2  # + the no-grad evaluation graph
        assert c["fw"][0] == c["n_groups"] and c["rs"] == [c["n_groups"]]  # every group gathered / reduced


STEPS = 3


@pytest.fixture(scope="module")
def eager_reference() -> list[dict[str, Any]]:
    """Eager zstack ZeRO-3 on 2 gloo ranks: the reference both graph-mode runs are held to."""
    return run_distributed(_rank, 2, None, STEPS, timeout=200)


def test_graph_mode_matches_eager_zero3_with_collectives_in_the_graph(eager_reference: list[dict[str, Any]]) -> None:
    """No budget: ZeRO-3 proper -- every unit is re-gathered in the backward, none is held across."""
    eager = eager_reference
    graph = run_distributed(_rank, 2, CompileConfig(mode="graph", inner="aot_eager"), STEPS, timeout=400)
    _assert_parity(eager, graph)
    for c in graph:
        assert c["bw"] == [c["n_units"]] and c["saved"][0] == 0 and c["plan"] is None
        assert c["after_restore"] > 0


def test_graph_mode_budget_keeps_units_within_the_budget(eager_reference: list[dict[str, Any]]) -> None:
    eager = eager_reference
    budget = 0.7  # room for two of the three equal blocks
    graph = run_distributed(
        _rank, 2, CompileConfig(mode="graph", inner="aot_eager", unshard_budget=budget), STEPS, timeout=400
    )
    _assert_parity(eager, graph)
    plans = {c["plan"] for c in graph}
    assert len(plans) == 1  # every rank made the same (measured, MAX-reduced) choice
    cap, kept, kept_bytes = plans.pop()
    assert cap == int(budget * sum(graph[0]["unit_bytes"])) and len(kept) == 2
    for c in graph:
        assert 0 < c["saved"][0] == kept_bytes <= cap  # measured on the partitioned forward graph
        assert c["bw"] == [c["n_units"] - len(kept)]  # kept units are not gathered again in the backward


def _fit(rank: int, world: int, compile_cfg: CompileConfig | bool) -> dict[str, Any]:
    import lightning.pytorch as pl
    from zlightning.strategies import ZStackZero3Strategy

    import zlightning  # noqa: F401
    from tests._lightning_models import TinyGPTModule, loader, state_after_fit

    torch._dynamo.reset()
    pl.seed_everything(0, verbose=False)
    module = TinyGPTModule()
    strategy = ZStackZero3Strategy(compile=compile_cfg)
    seen: list[tuple[str, int]] = []

    class _Graphs(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            handle = strategy._compiled
            seen.append((handle.mode, handle.graphs) if handle is not None else ("eager", 0))

    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=3,
        logger=False,
        callbacks=[_Graphs()],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2,
        val_check_interval=3,
    )
    trainer.fit(module, train_dataloaders=loader(3, 2, world), val_dataloaders=loader(2, 2, world))
    return {
        "losses": module.losses,
        "seen": seen,
        "val": float(trainer.callback_metrics["val_loss"]),
        "state": state_after_fit(module, "model."),
    }


def test_graph_mode_through_the_lightning_strategy() -> None:
    """The strategy compiles the LightningModule's model (the graph target below the root); matches eager zstack."""
    eager = run_distributed(_fit, 2, False, init_process_group=False, timeout=300)
    graph = run_distributed(
        _fit, 2, CompileConfig(mode="graph", inner="aot_eager"), init_process_group=False, timeout=400
    )
    for e, c in zip(eager, graph):
        assert c["seen"] == [("graph", 1)] * 3  # graph mode, one graph, no recompiles
        torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(c["val"], e["val"], rtol=1e-4, atol=1e-5)
        for name, value in e["state"].items():
            torch.testing.assert_close(c["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def _modes(rank: int, world: int) -> dict[str, Any]:
    from zlightning.zero import CPUOffload

    plain = DeepSpeedZeroOptimizer_Stage3(tiny_gpt(), torch.optim.AdamW(tiny_gpt().parameters()), config=ZeroConfig())
    hooks = len(plain.state.engine_hook_ids())
    plain.state.suspend_module_hooks()
    suspended = len(plain.state.engine_hook_ids())
    plain.state.resume_module_hooks()
    model = tiny_gpt()
    offloaded = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters()), config=ZeroConfig(offload_optimizer=CPUOffload())
    )
    auto = compile_zero3(offloaded, CompileConfig(mode="auto", inner="aot_eager"))
    mode = auto.mode
    auto.restore()
    with pytest.raises(RuntimeError, match="offload"):
        compile_zero3(offloaded, CompileConfig(mode="graph"))
    return {"hooks": hooks, "suspended": suspended, "resumed": len(plain.state.engine_hook_ids()), "mode": mode}


def test_engine_hook_api_and_auto_mode_with_offload() -> None:
    for r in run_distributed(_modes, 2, timeout=120):
        assert r["hooks"] > 0 and r["suspended"] == 0 and r["resumed"] == r["hooks"]
        assert r["mode"] == "unit"  # graph mode cannot drive offload: auto falls back, explicit graph raises
