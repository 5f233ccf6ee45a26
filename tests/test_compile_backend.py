"""zlightning.compile: graph passes on FX graphs (one process), backend_fn under Dynamo, compiled ZeRO-3 parity."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import fx

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.compile import (
    PASS_NAMES,
    CompileConfig,
    CompileStats,
    compile_zero3,
    make_backend,
    run_passes,
)
from zlightning.testing import find_free_port, run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig

AG = torch.ops._c10d_functional.all_gather_into_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


@pytest.fixture(scope="module")
def world1() -> Iterator[str]:
    """A one-rank gloo group in this process (functional collectives need a registered group name); torn down after
    this module so later tests in the session see no process group."""
    created = not dist.is_initialized()
    if created:
        env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD.group_name
    if created:
        dist.destroy_process_group()
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        torch._dynamo.reset()


def test_tp_groups_validate_the_world(world1: str) -> None:
    from zlightning.inject import build_tp_groups

    with pytest.raises(ValueError, match="must divide the world size 1"):
        build_tp_groups(2)
    groups = build_tp_groups(1)
    assert (groups.tp_size, groups.dp_size, groups.tp_rank, groups.dp_rank) == (1, 1, 0, 0)


def _graph(name: str) -> fx.GraphModule:
    def f(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(x @ x.t()) * 2  # compute that does not depend on the gathers
        g1 = WAIT(AG(w1, 1, name))
        y = h.sum() + g1.sum()
        g1b = WAIT(AG(w1, 1, name))  # the same parameter gathered again
        z = torch.tanh(h).mean()
        g2 = WAIT(AG(w2, 1, name))
        return y + z + g1b.mean() + g2.mean()

    return fx.symbolic_trace(f)


def _kinds(gm: fx.GraphModule) -> list[str]:
    return ["AG" if n.target is AG else "W" if n.target is WAIT else n.op for n in gm.graph.nodes]


def _inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, generator=g), torch.randn(5, generator=g), torch.randn(6, 6, generator=g)


def test_each_pass_is_switchable_and_value_preserving(world1: str) -> None:
    ref = _graph(world1)(*_inputs())
    base = _kinds(_graph(world1))
    assert base.count("AG") == 3
    for passes in [(), *[(p,) for p in PASS_NAMES], PASS_NAMES]:
        gm = _graph(world1)
        stats = run_passes(gm, CompileConfig(passes=passes))
        assert set(stats) == set(passes)
        kinds = _kinds(gm)
        torch.testing.assert_close(gm(*_inputs()), ref)
        first_compute = next(
            i for i, n in enumerate(gm.graph.nodes) if n.op == "call_function" and n.target not in (AG, WAIT)
        )
        ags = [i for i, k in enumerate(kinds) if k == "AG"]
        assert len(ags) == (2 if "selective_unshard" in passes else 3)
        if "prefetch" in passes:  # every gather starts before any compute
            assert stats["prefetch"] >= 2 and max(ags) < first_compute
        else:
            assert min(ags) > first_compute
        if "late_wait" in passes:  # every wait sits right before its first user
            for n in gm.graph.nodes:
                if n.target is WAIT:
                    assert n.next in n.users
        if not passes:
            assert kinds == base and all(v == 0 for v in stats.values())


def test_prefetch_distance_bounds_the_hoist(world1: str) -> None:
    gm = _graph(world1)
    before = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    run_passes(gm, CompileConfig(passes=("prefetch",), prefetch_distance=1))
    after = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    moved = [before[n] - after[n] for n in before if n.startswith("all_gather")]
    assert max(moved) <= 1 and max(moved) >= 1


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown"):
        CompileConfig(passes=("fuse_everything",))
    with pytest.raises(ValueError, match="inner"):
        CompileConfig(inner="tvm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefetch_distance"):
        CompileConfig(prefetch_distance=-1)
    with pytest.raises(TypeError, match="ZeroState"):
        compile_zero3(torch.nn.Linear(2, 2))


def test_backend_fn_under_dynamo_with_functional_collectives(world1: str) -> None:
    from torch.distributed import _functional_collectives as funcol

    def step(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.sin(x) @ x
        full = funcol.all_gather_single(w, 0, dist.group.WORLD)
        return h.sum() * full.sum() + funcol.all_gather_single(w, 0, dist.group.WORLD).mean()

    stats = CompileStats()
    compiled = torch.compile(step, backend=make_backend(CompileConfig(inner="eager"), stats), fullgraph=True)
    w, x = torch.randn(8), torch.randn(5, 5)
    torch.testing.assert_close(compiled(w, x), step(w, x))
    compiled(torch.randn(8), torch.randn(5, 5))
    assert stats.graphs == 1  # same shapes: no recompile
    assert stats.passes[0]["selective_unshard"] == 1 and stats.passes[0]["prefetch"] >= 1


def _zero_rank(rank: int, world: int, compiled: bool, steps: int) -> dict:
    torch._dynamo.reset()
    model = tiny_gpt()
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig())
    handle = compile_zero3(zero.state, CompileConfig(mode="unit")) if compiled else None
    from torch._dynamo.utils import counters

    losses, graphs = [], []
    for batch in batches(steps, global_batch=4 * world):
        loss = gpt_loss(model, batch.chunk(world)[rank])
        zero.backward(loss)
        zero.step()
        losses.append(float(loss))
        graphs.append(handle.stats.graphs if handle else 0)
    return {
        "losses": losses,
        "state": zero.module_state_dict(),
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "units": len(handle.modules) if handle else 0,
    }


def test_compiled_zero3_matches_eager_without_recompiles() -> None:
    steps = 3
    eager = run_distributed(_zero_rank, 2, False, steps, timeout=120)
    comp = run_distributed(_zero_rank, 2, True, steps, timeout=400)
    for e, c in zip(eager, comp):
        torch.testing.assert_close(c["losses"], e["losses"], rtol=1e-4, atol=1e-5)
        for name, value in e["state"].items():
            torch.testing.assert_close(c["state"][name], value, rtol=1e-4, atol=1e-5, msg=name)
        assert c["breaks"] == 0
        assert c["units"] >= 1 and 1 <= c["graphs"][0] <= c["units"]
        assert c["graphs"] == [c["graphs"][0]] * steps  # compiled in step 1, never again
