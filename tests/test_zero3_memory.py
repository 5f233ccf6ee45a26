"""Per-rank model-state memory under ZeRO-3 is about 1/N of DDP's (plus padding, persistent params, one unit)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zlightning.kernels import _ext

from tests._zero_models import batches, gpt_loss, tiny_gpt
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3, ZeroConfig


def _measure(rank: int, world: int) -> dict[str, Any]:
    model = tiny_gpt(d_model=64, n_layer=4, vocab_size=128)
    numel = sum(p.numel() for p in model.parameters())
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig())
    after_setup = zero.memory_report()
    freed = all(zp.original.numel() == 0 for zp in zero.state.params)
    data = batches(1, 2 * world, vocab=128)[0]
    zero.backward(gpt_loss(model, data.chunk(world)[rank]))
    during = zero.memory_report()  # gradients exist, optimizer state not yet
    zero.step()
    after_step = zero.memory_report()
    return {"numel": numel, "setup": after_setup, "during": during, "step": after_step, "freed": freed}


def test_model_state_is_one_over_n() -> None:
    for world in (2, 4):
        for r in run_distributed(_measure, world, timeout=240):
            full_params = 4 * r["numel"]
            setup, step = r["setup"], r["step"]
            assert r["freed"], "original full parameter storage must be released after sharding"
            assert setup.full_model_bytes == full_params
            assert setup.grad_bytes == 0 and setup.optimizer_bytes == 0 and setup.gathered_bytes == 0
            slack = 1.02
            assert setup.model_state_bytes <= full_params / world * slack + setup.largest_unit_bytes
            # DDP holds params + grads + two Adam moments: 16 bytes per parameter.
            assert step.optimizer_bytes > 0 and step.grad_bytes > 0
            assert step.gathered_bytes == 0, "nothing but persistent parameters may stay gathered after a step"
            assert step.model_state_bytes <= 16 * r["numel"] / world * slack + step.largest_unit_bytes
            # and it is genuinely sharded: well under half of DDP's 16 bytes/param at world 2
            assert step.param_bytes + step.grad_bytes + step.optimizer_bytes <= 16 * r["numel"] / world * slack


def _pending_at_each_unit(rank: int, world: int, overlap: bool) -> list[int]:
    from zlightning.zero._state import ZeroState

    seen: list[int] = []
    post_backward = ZeroState.post_backward

    def counting(self: ZeroState, group: Any, grads: Any) -> None:
        seen.append(len(self._pending))  # reductions still held when the next unit's gradients arrive
        post_backward(self, group, grads)

    ZeroState.post_backward = counting  # type: ignore[method-assign]  (this rank's own process)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(5)])
    zero = DeepSpeedZeroOptimizer_Stage3(
        model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=ZeroConfig(overlap_comm=overlap)
    )
    for _ in range(2):
        zero.backward(model(torch.randn(3, 64)).pow(2).mean())
        zero.step()
    return seen


def test_a_finished_reduction_is_not_held_into_the_next_units_backward() -> None:
    # see [Note: a finished reduction is not held]: synchronous (overlap off) and single-rank reductions return
    # their packed buffer at once; overlapped ones keep exactly one in flight
    for world, overlap, held in ((2, False, {0}), (1, True, {0}), (2, True, {0, 1})):
        for seen in run_distributed(_pending_at_each_unit, world, overlap, timeout=240):
            assert len(seen) >= 10 and set(seen) == held, (world, overlap, seen)


def _pending_when_each_unit_computes(rank: int, world: int) -> list[int]:
    from zlightning.zero._state import ZeroState

    seen: list[int] = []
    pre_backward = ZeroState.unit_pre_backward

    def counting(self: ZeroState, unit: Any) -> None:
        pre_backward(self, unit)
        seen.append(len(self._pending))  # reductions in flight while this unit's backward computes

    ZeroState.unit_pre_backward = counting  # type: ignore[method-assign]  (this rank's own process)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(5)])
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for _ in range(2):
        zero.backward(model(torch.randn(3, 64)).pow(2).mean())
        zero.step()
    return seen


def test_host_reductions_finish_before_the_next_unit_computes() -> None:
    # see [Note: host reductions finish before the next unit computes]: one unit-sized buffer fewer at the step's
    # peak on the host (the previous unit's packed gradient was held through this unit's backward)
    for seen in run_distributed(_pending_when_each_unit_computes, 2, timeout=240):
        assert len(seen) >= 8 and set(seen) == {0}, seen


class _Block(torch.nn.Module):
    """``Linear + Tanh`` with a second weight only some ranks read (its gradient is None on the others). The
    unit's 2 x 129 x 129 + 129 elements are odd: its last chunk ends in padding, and the first weight straddles
    the two ranks' chunks."""

    def __init__(self, width: int, uses_extra: bool) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.extra = torch.nn.Linear(width, width, bias=False)
        self.uses_extra = uses_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return h + self.extra(x) if self.uses_extra else h


def _reduce_two_ways(rank: int, world: int, direct: bool) -> dict[str, Any]:
    from zlightning.zero._buffers import StoragePool
    from zlightning.zero._param_group import ZeroParamGroup

    if not direct:  # the packed path: whole gradient packed, the peer's part received into a scratch chunk
        ZeroParamGroup.reduces_own_half_directly = lambda *a: False  # type: ignore[method-assign]
    lent = {"now": 0, "max": 0}
    acquire, release = StoragePool.acquire, StoragePool.release

    def counted_acquire(self: StoragePool, nbytes: int) -> torch.UntypedStorage:
        s = acquire(self, nbytes)
        lent["now"] += s.nbytes()
        lent["max"] = max(lent["max"], lent["now"])
        return s

    def counted_release(self: StoragePool, storage: torch.UntypedStorage) -> None:
        lent["now"] -= storage.nbytes()
        release(self, storage)

    StoragePool.acquire, StoragePool.release = counted_acquire, counted_release  # type: ignore[method-assign]
    torch.manual_seed(0)
    width = 129
    model = torch.nn.Sequential(*[_Block(width, uses_extra=rank == 1) for _ in range(5)])
    model[1].fc.bias.requires_grad_(False)  # frozen inside a trainable group
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    grads, losses = [], []
    for step in range(3):
        for micro in range(2 if step == 2 else 1):  # the last step accumulates two micro-batches
            x = torch.randn(4, width, generator=torch.Generator().manual_seed(10 * step + micro + rank))
            loss = model(x).pow(2).mean()
            losses.append(loss.item())
            zero.backward(loss)
        grads.append([zp.piece.grad.clone() for zp in zero.state.params if zp.piece.grad is not None])
        zero.step()
    unit_bytes = 4 * sum(p.numel() for p in _Block(width, True).parameters())
    return {"grads": grads, "losses": losses, "max_lent": lent["max"], "unit_bytes": unit_bytes}


def test_two_host_ranks_reduce_without_packing_their_own_half() -> None:
    # see [Note: two host ranks reduce without packing their own half]: the same gradients (bit for bit where the
    # shard's gradient starts from zero), with half a unit less of step buffers at the backward's peak
    direct = run_distributed(_reduce_two_ways, 2, True, timeout=240)
    packed = run_distributed(_reduce_two_ways, 2, False, timeout=240)
    for d, p in zip(direct, packed):
        assert d["losses"] == p["losses"]
        for step, (gd, gp) in enumerate(zip(d["grads"], p["grads"])):
            assert len(gd) == len(gp) >= 5
            for a, b in zip(gd, gp):
                if step < 2:
                    assert torch.equal(a, b), step
                else:  # two micro-batches: the halves of the second are added one after the other
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
        unit = d["unit_bytes"]
        assert p["max_lent"] - d["max_lent"] >= unit // 2 - 8192, (d["max_lent"], p["max_lent"], unit)
        assert d["max_lent"] <= 2 * unit + 16384, (d["max_lent"], unit)  # the unit computing and the one prefetched


def _buffers_above_the_state(rank: int, world: int, prefetch: int | None) -> dict[str, int]:
    from zlightning.kernels._host_cache import host_cache_stats

    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(8)]
    )
    config = ZeroConfig(prefetch_bucket_size=prefetch)
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config=config)
    for step in range(4):
        x = torch.randn(2, width, generator=torch.Generator().manual_seed(10 * step + rank))
        zero.backward(model(x).pow(2).mean())
        zero.step()
    stats = host_cache_stats()
    # the optimizer state exists from the first step on, so the peak is a later backward's: the state, the units
    # gathered and the gradients being reduced
    return {"above": stats.peak_live_bytes - stats.live_bytes, "unit": 4 * (width * width + width)}


@pytest.mark.skipif(not _ext.available(), reason="native kernels not built (the host cache measures the buffers)")
def test_the_hosts_backward_holds_two_unit_buffers() -> None:
    # see [Note: the host's backward gathers each unit at its own hook]: the unit computing and its gradient, with
    # the pool's released buffers reused by autograd; an explicit prefetch size still prefetches in backward
    for r in run_distributed(_buffers_above_the_state, 2, None, timeout=240):
        assert r["above"] <= 2.25 * r["unit"], (r["above"], r["unit"])
    for r in run_distributed(_buffers_above_the_state, 2, 2 * 512 * 513, timeout=240):
        assert r["above"] >= 2.75 * r["unit"], (r["above"], r["unit"])


def test_a_storage_the_pool_frees_is_freed_while_a_late_reference_lives() -> None:
    # see [Note: a freed step buffer is freed now] in _buffers.py: a collective's work object may still hold a view
    from zlightning.zero._buffers import StoragePool

    pool = StoragePool(torch.device("cpu"), idle_limit=0)
    slot = pool.acquire(1 << 20)
    late = torch.empty(0, dtype=torch.uint8).set_(slot, 0, (1 << 20,), (1,))  # what gloo's work keeps a moment
    pool.release(slot)
    assert late.untyped_storage().nbytes() == 0 and pool.allocated_bytes == 0
    kept = StoragePool(torch.device("cpu"), idle_limit=2 << 20)  # within the idle limit it is kept for reuse
    slot = kept.acquire(1 << 20)
    kept.release(slot)
    assert slot.nbytes() == 1 << 20 and kept.acquire(1 << 20) is slot
