"""The ZeRO engine's host collectives (``zlightning.zero._collectives``) on real gloo ranks: the reduce-scatter's
two-rank exchange ([Note: the host reduce-scatter between two ranks]) and the per-chunk reduces of larger groups
give every rank the exact sum of its chunk, synchronously and asynchronously, in fp32 and bf16, for any chunk
size; the all-gather gives every rank every shard."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from zlightning.testing import run_distributed
from zlightning.zero._collectives import all_gather_into, reduce_scatter_into

SIZES = (1, 7, 4099)  # elements per rank chunk


def _input(rank: int, world: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(world * n, generator=g).to(dtype)


def _check_reduce_scatter(rank: int, world: int, dtype_name: str) -> list[str]:
    dtype = getattr(torch, dtype_name)
    wrong = []
    for n in SIZES:
        for async_op in (False, True):
            full = _input(rank, world, n, dtype)
            expected = _input(0, world, n, dtype).chunk(world)[rank].clone()
            for r in range(1, world):  # the order gloo's reduce sums in; two addends commute
                expected += _input(r, world, n, dtype).chunk(world)[rank]
            scratch = torch.full((n,), float("nan"), dtype=dtype) if world == 2 else None
            handle = reduce_scatter_into(full, dist.group.WORLD, async_op=async_op, scratch=scratch)
            out = handle.wait()
            if world == 2 and not torch.equal(out, expected):
                wrong.append(f"n={n} async={async_op}: {out[:4].tolist()} != {expected[:4].tolist()}")
            if world > 2 and not torch.allclose(out, expected, rtol=1e-6, atol=1e-6):
                wrong.append(f"n={n} async={async_op}")
            if out.data_ptr() != full.chunk(world)[rank].data_ptr():
                wrong.append(f"n={n}: the result is not this rank's chunk of the input")
    return wrong


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_two_rank_reduce_scatter_is_the_exact_sum(dtype_name: str) -> None:
    assert run_distributed(_check_reduce_scatter, 2, dtype_name) == [[], []]


def test_four_rank_reduce_scatter() -> None:
    assert run_distributed(_check_reduce_scatter, 4, "float32", timeout=240) == [[]] * 4


def _missing_scratch(rank: int, world: int) -> str:
    try:
        reduce_scatter_into(torch.ones(4), dist.group.WORLD, async_op=False)
    except AssertionError as err:
        return str(err)
    return "no error"


def test_two_rank_reduce_scatter_needs_its_scratch() -> None:
    assert all("needs a scratch chunk" in r for r in run_distributed(_missing_scratch, 2))


def _gather(rank: int, world: int) -> bool:
    n = 4099
    out = torch.zeros(world * n)
    out.chunk(world)[rank].copy_(_input(rank, world, n, torch.float32).chunk(world)[0])
    all_gather_into(out, dist.group.WORLD, async_op=True).wait()
    return all(
        torch.equal(out.chunk(world)[r], _input(r, world, n, torch.float32).chunk(world)[0]) for r in range(world)
    )


def test_all_gather_gives_every_shard() -> None:
    assert run_distributed(_gather, 2) == [True, True]
