"""DeepSpeed conformance of the seeds: DeepSpeed's names called as DeepSpeed's own code and documentation call them.

- Curriculum sampler: ``get_start_end_idx``, ``get_sample_based_on_metric_value`` (and ``..._percentile``) as
  module-level functions with DeepSpeed's parameters and ``None`` results, the sampler's methods calling them,
  ``DeepSpeedDataSampler(...)`` built positionally as ``deepspeed_io`` builds it with a ``data_parallel_group``, and
  ``len()``; checked against DeepSpeed itself when ``benchmarks/.venv-deepspeed`` exists.
- Compression: ``init_compression(model, deepspeed_config, teacher_model, mpu)`` and
  ``redundancy_clean(model, deepspeed_config, mpu=mpu)`` with a Megatron-style ``mpu`` on 2 gloo ranks (head and row
  pruning of split layers, compared with a single-process reference; refusals).
- ``DeepSpeedZeroOptimizer_Stage3.backward(loss, retain_graph=True)`` on 2 ranks against a plain model.
- ``DeepSpeedIOEngine``: DeepSpeed's swap-code checks on the return values (``== 0``, ``0 == r``, ``wait() == n``).
- ``module_inject``: norms found by structure and behaviour, not class name; what is left unfused is reported; with
  tensor parallelism alone nothing is said about fusion (2 ranks).
The multi-process checks run in one spawn of 2 ranks; each test asserts its part.
"""

from __future__ import annotations

import inspect
import json
import math
import subprocess
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from zlightning.datamodules import DeepSpeedDataSampler
from zlightning.datamodules.curriculum import (
    IndexFile,
    get_sample_based_on_metric_percentile,
    get_sample_based_on_metric_value,
    get_start_end_idx,
    write_metric_index,
)
from zlightning.kernels import DeepSpeedIOEngine

from zlightning.compression import apply_schedule, init_compression, redundancy_clean
from zlightning.inject import InjectPolicy, build_tp_groups, injection_report, module_inject
from zlightning.testing import run_distributed
from zlightning.zero import DeepSpeedZeroOptimizer_Stage3

N = 1000
_DS_VENV_PYTHON = Path(__file__).resolve().parents[1] / "benchmarks" / ".venv-deepspeed" / "bin" / "python"


# ------------------------------------------------------------------------------------------ curriculum sampler


class _Group:
    """What DeepSpeed reads of ``data_parallel_group``: ``size()`` (and we also check ``rank()``)."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.fixture(scope="module")
def metric(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("metric")
    values = np.random.default_rng(0).integers(1, 101, N)
    write_metric_index(root / "m", "m", values)
    return {
        "index_to_sample_path": str(root / "m" / "m_index_to_sample"),
        "index_to_metric_path": str(root / "m" / "m_index_to_metric"),
        "difficulty_type": "value",
        "clustering_type": "schedule_based",
        "min_difficulty": 10,
        "max_difficulty": 100,
        "schedule_type": "fixed_linear",
        "schedule_config": {"total_curriculum_step": 20, "difficulty_step": 10},
    }


def _ds_config(metric: dict[str, Any]) -> dict[str, Any]:
    return {
        "data_efficiency": {
            "enabled": True,
            "seed": 3,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 1,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": None,
                    "curriculum_metrics": {"m": metric},
                },
            },
        }
    }


def _rows(metric: dict[str, Any]) -> tuple[list[np.ndarray], list[int]]:
    samples, values = IndexFile(metric["index_to_sample_path"]), IndexFile(metric["index_to_metric_path"])
    return [np.asarray(samples[r]) for r in range(len(samples))], [int(values[r][0]) for r in range(len(values))]


def _value_reference(metric: dict[str, Any], lo: float, hi: float) -> list[int] | None:
    """DeepSpeed's documented selection, row by row: rows with ``lo < value <= hi``, concatenated; None if none."""
    rows, values = _rows(metric)
    hit = [row for row, v in zip(rows, values) if lo < v <= hi]
    return None if not hit else np.concatenate(hit).tolist()


VALUE_RANGES = [(-math.inf, 0), (-math.inf, 30), (30, 60), (99, 100), (100, 200), (50.2, 50.7)]
PERCENTILE_RANGES = [(0, 10), (10, 37), (90, 100), (100, 110), (0, 100)]


def test_module_level_functions_have_deepspeeds_parameters() -> None:
    assert list(inspect.signature(get_start_end_idx).parameters) == [
        "batch_len",
        "data_parallel_rank",
        "data_parallel_size",
    ]
    assert list(inspect.signature(get_sample_based_on_metric_value).parameters)[-2:] == ["value_start", "value_end"]
    assert list(inspect.signature(get_sample_based_on_metric_percentile).parameters)[-2:] == [
        "percentile_start",
        "percentile_end",
    ]
    # the sampler's methods keep DeepSpeed's exact signatures
    assert list(inspect.signature(DeepSpeedDataSampler.get_start_end_idx).parameters) == ["self", "batch_len"]
    assert list(inspect.signature(DeepSpeedDataSampler.get_sample_based_on_metric_value).parameters) == [
        "self",
        "metric",
        "value_start",
        "value_end",
    ]
    assert list(inspect.signature(DeepSpeedDataSampler.get_sample_based_on_metric_percentile).parameters) == [
        "self",
        "metric",
        "percentile_start",
        "percentile_end",
    ]


def test_metric_value_selection_and_none(metric: dict[str, Any]) -> None:
    s = DeepSpeedDataSampler(_ds_config(metric), N, 4, 0, 1, None, 2, 0)
    for lo, hi in VALUE_RANGES:
        ref = _value_reference(metric, lo, hi)
        got = get_sample_based_on_metric_value(metric["index_to_sample_path"], metric["index_to_metric_path"], lo, hi)
        method = s.get_sample_based_on_metric_value("m", lo, hi)
        if ref is None:
            assert got is None and method is None, (lo, hi)
        else:
            assert got.tolist() == ref and method.tolist() == ref, (lo, hi)
    for lo, hi in PERCENTILE_RANGES:
        got = s.get_sample_based_on_metric_percentile("m", lo, hi)
        flat = np.concatenate(_rows(metric)[0])
        per = N // 100
        end = N if hi == 100 else min(N, per * hi)
        assert (got is None) == (per * lo >= end) and (got is None or got.tolist() == flat[per * lo : end].tolist())
    with pytest.raises(ValueError, match="index_to_metric has .* rows"):
        get_sample_based_on_metric_value(metric["index_to_sample_path"], metric["index_to_sample_path"], 0, 1)


def test_start_end_idx_and_data_parallel_group(metric: dict[str, Any]) -> None:
    cfg = _ds_config(metric)
    for n, D in ((12, 3), (7, 3), (2, 4)):
        spans = [get_start_end_idx(n, r, D) for r in range(D)]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        # positional, as deepspeed_io builds it: (config, N, b, rank, size, group, grad_accum, global_rank, drop_last)
        for r in range(D):
            s = DeepSpeedDataSampler(cfg, N, 4, r, D, _Group(D, r), 2, r, True)
            assert s.data_parallel_group.size() == D and s.get_start_end_idx(n) == spans[r]
    with pytest.raises(ValueError, match="data_parallel_group has 2 ranks but data_parallel_size=4"):
        DeepSpeedDataSampler(cfg, N, 4, 0, 4, _Group(2, 0), 2, 0)
    with pytest.raises(ValueError, match="rank 1 of data_parallel_group but data_parallel_rank=0"):
        DeepSpeedDataSampler(cfg, N, 4, 0, 2, _Group(2, 1), 2, 0)
    with pytest.raises(TypeError, match="must be a process group"):
        DeepSpeedDataSampler(cfg, N, 4, 0, 2, "dp", 2, 0)
    with pytest.raises(ValueError, match=r"data_parallel_rank=3 must be in \[0, data_parallel_size=3\)"):
        get_start_end_idx(6, 3, 3)


def test_len_is_the_loaders_length_and_total_samples_is_deepspeeds(metric: dict[str, Any]) -> None:
    s = DeepSpeedDataSampler(_ds_config(metric), N, 4, 0, 2, None, 2, 0, drop_last=True)
    assert len(s) == N // 8 == len(list(s))  # micro-batches this rank yields: what DataLoader(batch_sampler=) reports
    assert s.total_samples == N  # DeepSpeed's len(): a sample count
    assert "total_samples" in (DeepSpeedDataSampler.__len__.__doc__ or "")


_DS_SAMPLER_SCRIPT = """
import json, math, sys
import numpy as np
from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler
from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset
args = json.loads(sys.argv[1])
class G:
    def __init__(self, n): self.n = n
    def size(self): return self.n
s = object.__new__(DeepSpeedDataSampler)  # DeepSpeed's own methods, on DeepSpeed's own index readers
s.curriculum_index_to_sample = {"m": MMapIndexedDataset(args["samples"], skip_warmup=True)}
s.curriculum_index_to_metric = {"m": MMapIndexedDataset(args["metric"], skip_warmup=True)}
s.data_efficiency_config = {"data_sampling": {"curriculum_learning": {"curriculum_metrics": {"m": {"max_difficulty": 100}}}}}
s.data_1epoch_size = None
out = {"value": [], "percentile": [], "spans": []}
for lo, hi in args["value"]:
    r = s.get_sample_based_on_metric_value("m", float(lo), float(hi))
    out["value"].append(None if r is None else [int(v) for v in r])
for lo, hi in args["percentile"]:
    r = s.get_sample_based_on_metric_percentile("m", lo, hi)
    out["percentile"].append(None if r is None else [int(v) for v in r])
for n, rank, size in args["spans"]:
    s.micro_batch_times_data_parallel_size, s.data_parallel_rank, s.data_parallel_group = 8, rank, G(size)
    out["spans"].append(list(s.get_start_end_idx(n)))
print(json.dumps(out))
"""


@pytest.mark.skipif(not _DS_VENV_PYTHON.exists(), reason="needs benchmarks/.venv-deepspeed (setup_deepspeed_venv.sh)")
def test_same_results_as_deepspeed_itself(metric: dict[str, Any]) -> None:
    spans = [(n, r, size) for n, size in ((12, 3), (7, 3), (5, 2)) for r in range(size)]
    args = {
        "samples": metric["index_to_sample_path"],
        "metric": metric["index_to_metric_path"],
        "value": [[str(lo), str(hi)] for lo, hi in VALUE_RANGES],
        "percentile": PERCENTILE_RANGES,
        "spans": spans,
    }
    env = {"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu"}
    proc = subprocess.run(
        [str(_DS_VENV_PYTHON), "-c", _DS_SAMPLER_SCRIPT, json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ds = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = [
        get_sample_based_on_metric_value(metric["index_to_sample_path"], metric["index_to_metric_path"], lo, hi)
        for lo, hi in VALUE_RANGES
    ]
    assert [None if r is None else r.tolist() for r in ours] == ds["value"]
    ours_p = [
        get_sample_based_on_metric_percentile(metric["index_to_sample_path"], 100, lo, hi)
        for lo, hi in PERCENTILE_RANGES
    ]
    assert [None if r is None else r.tolist() for r in ours_p] == ds["percentile"]
    assert [list(get_start_end_idx(n, r, size)) for n, r, size in spans] == ds["spans"]


# ------------------------------------------------------------------------------------------ aio


def test_io_engine_return_values_port_deepspeed_swap_code(tmp_path: Path) -> None:
    handle = DeepSpeedIOEngine(block_size=4096, queue_depth=4)
    buffers = [torch.arange(1024, dtype=torch.float32) + i for i in range(3)]
    paths = [str(tmp_path / f"t{i}.swp") for i in range(3)]
    # deepspeed/runtime/swap_tensor/utils.py: swap_out_tensors / swap_in_tensors, then the swappers' wait checks
    for buffer, path in zip(buffers, paths):
        assert handle.async_pwrite(buffer, path, 0) == 0
    assert handle.wait() == len(buffers)
    back = [torch.empty(1024) for _ in paths]
    for buffer, path in zip(back, paths):
        assert handle.async_pread(buffer, path, 0) == 0
    assert len(back) == handle.wait()
    assert all(torch.equal(a, b) for a, b in zip(buffers, back))
    # deepspeed/io/base_io_buffer.py: r = ...async_pwrite(...); assert 0 == r; the request is DeepSpeed's int 0
    r = handle.async_pwrite(buffers[0], paths[0], 0)
    assert r == 0 and r != -1 and int(r) == 0 and not r and [7][r] == 7
    assert handle.wait() == 1 and r.done()
    assert handle.sync_pread(back[0], paths[0], 0) == 1 and handle.pread(back[0], paths[0], False, True, 0) == 0
    assert handle.wait() == 1


# ------------------------------------------------------------------------------------------ compression: mpu

HIDDEN, HEADS, HEAD_DIM, FFN = 8, 4, 2, 16

DS_COMPRESSION = {
    "compression_training": {
        "row_pruning": {
            "shared_parameters": {"enabled": True, "method": "l1", "schedule_offset": 0},
            "different_groups": {
                "rp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["dense_h_to_4h"],
                    "related_modules": [["dense_4h_to_h"]],
                }
            },
        },
        "head_pruning": {
            "shared_parameters": {"enabled": True, "method": "topk", "schedule_offset": 0, "num_heads": HEADS},
            "different_groups": {
                "hp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": [r"attention\.dense"],
                    "related_modules": [["query_key_value"]],
                }
            },
        },
    }
}


def _full() -> dict[str, nn.Linear]:
    torch.manual_seed(7)
    return {
        "qkv": nn.Linear(HIDDEN, 3 * HEADS * HEAD_DIM),
        "dense": nn.Linear(HEADS * HEAD_DIM, HIDDEN),
        "fc1": nn.Linear(HIDDEN, FFN),
        "fc2": nn.Linear(FFN, HIDDEN),
    }


class MegatronColumn(nn.Module):
    """Megatron's (old ``mpu``) ColumnParallelLinear, as DeepSpeed's compression reads it."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.input_size, self.output_size = full.in_features, full.out_features
        self.output_size_per_partition = full.out_features // world
        self.gather_output, self.skip_bias_add = False, False
        self.weight = nn.Parameter(full.weight.detach().chunk(world, 0)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(world, 0)[rank].clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight, self.bias), None


class MegatronRow(nn.Module):
    """Megatron's RowParallelLinear (input split, output all-reduced, bias replicated)."""

    def __init__(self, full: nn.Linear, rank: int, world: int) -> None:
        super().__init__()
        self.input_size, self.output_size = full.in_features, full.out_features
        self.input_size_per_partition = full.in_features // world
        self.input_is_parallel, self.skip_bias_add = True, False
        self.weight = nn.Parameter(full.weight.detach().chunk(world, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        y = F.linear(x, self.weight)
        if dist.is_initialized():
            dist.all_reduce(y)
        return y + self.bias, None


class Attention(nn.Module):
    def __init__(self, full: dict[str, nn.Linear], rank: int, world: int) -> None:
        super().__init__()
        self.query_key_value = MegatronColumn(full["qkv"], rank, world)  # rows: [head][q, k, v][dim]
        self.dense = MegatronRow(full["dense"], rank, world)
        self.num_attention_heads_per_partition = HEADS // world
        self.hidden_size_per_attention_head = HEAD_DIM

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.query_key_value(x)
        h = h.view(*x.shape[:-1], self.num_attention_heads_per_partition, 3, HEAD_DIM)
        return self.dense((h[..., 2, :] * torch.sigmoid(h[..., 0, :] * h[..., 1, :])).flatten(-2))[0]


class MLP(nn.Module):
    def __init__(self, full: dict[str, nn.Linear], rank: int, world: int) -> None:
        super().__init__()
        self.dense_h_to_4h = MegatronColumn(full["fc1"], rank, world)
        self.dense_4h_to_h = MegatronRow(full["fc2"], rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x)[0]))[0]


class Block(nn.Module):
    def __init__(self, rank: int = 0, world: int = 1) -> None:
        super().__init__()
        full = _full()
        self.attention, self.mlp = Attention(full, rank, world), MLP(full, rank, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(x) + self.mlp(x)


class Mpu:
    """Megatron's model-parallel unit, the parts DeepSpeed's compression reads."""

    ColumnParallelLinear = MegatronColumn
    RowParallelLinear = MegatronRow

    def __init__(self, world: int, rank: int, group: Any = None) -> None:
        self._world, self._rank, self._group = world, rank, group

    def get_model_parallel_world_size(self) -> int:
        return self._world

    def get_model_parallel_rank(self) -> int:
        return self._rank

    def get_model_parallel_group(self) -> Any:
        return self._group


def _x() -> torch.Tensor:
    return torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))


def _reference(heads: list[int] | None, rows: list[int] | None) -> torch.Tensor:
    """The unsplit block with global head and FFN-row masks applied by hand."""
    full, x = _full(), _x()
    with torch.no_grad():
        h = full["qkv"](x).view(3, HEADS, 3, HEAD_DIM)
        ctx = h[..., 2, :] * torch.sigmoid(h[..., 0, :] * h[..., 1, :])
        if heads is not None:
            ctx = ctx * torch.isin(torch.arange(HEADS), torch.tensor(heads))[None, :, None]
        a = full["fc1"](x)
        if rows is not None:
            a = a * torch.isin(torch.arange(FFN), torch.tensor(rows))
        return x + full["dense"](ctx.flatten(-2)) + full["fc2"](F.gelu(a))


def _compression_worker(rank: int, world: int) -> dict[str, Any]:
    mpu = Mpu(world, rank, dist.group.WORLD)
    model, x = Block(rank, world), _x()
    with torch.no_grad():
        plain = model(x)
    model = init_compression(model, DS_COMPRESSION, None, mpu)  # DeepSpeed's positional order
    apply_schedule(model, 0)
    with torch.no_grad():
        masked = model(x)
    heads = model.attention.dense.head_pruning.keep_index().tolist()
    rows = model.mlp.dense_h_to_4h.row_pruning.keep_index().tolist()
    assert isinstance(model.attention.dense, MegatronRow)  # the twin is still a Megatron layer
    model = redundancy_clean(model, DS_COMPRESSION, mpu=mpu)
    with torch.no_grad():
        cleaned = model(x)
    att, mlp = model.attention, model.mlp
    errors = {}
    for technique, pattern in (
        ("sparse_pruning", "query_key_value"),
        ("row_pruning", r"attention\.dense"),
        ("weight_quantization", "dense_4h_to_h"),
    ):
        params = {"dense_ratio": 0.5} if technique != "weight_quantization" else {"start_bits": 8, "target_bits": 8}
        cfg = {
            technique: {
                "shared_parameters": {"enabled": True, "schedule_offset": 0},
                "different_groups": {"g": {"params": params, "modules": [pattern]}},
            }
        }
        try:
            init_compression(Block(rank, world), cfg, mpu=mpu)
        except ValueError as err:
            errors[technique] = str(err)
    return {
        "plain": plain,
        "masked": masked,
        "cleaned": cleaned,
        "heads": heads,
        "rows": rows,
        "errors": errors,
        "types": (type(att.query_key_value).__name__, type(att.dense).__name__),
        "shapes": {
            n: tuple(m.weight.shape)
            for n, m in (
                ("qkv", att.query_key_value),
                ("dense", att.dense),
                ("fc1", mlp.dense_h_to_4h),
                ("fc2", mlp.dense_4h_to_h),
            )
        },
        "sizes": (
            att.query_key_value.output_size_per_partition,
            att.query_key_value.output_size,
            att.dense.input_size_per_partition,
            att.dense.input_size,
            att.num_attention_heads_per_partition,
            mlp.dense_h_to_4h.output_size_per_partition,
            mlp.dense_4h_to_h.input_size,
        ),
    }


# ------------------------------------------------------------------------------------------ ZeRO-3 backward


def _zero_worker(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    zero = DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), device=torch.device("cpu"))
    x = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(1)).chunk(world)[rank]
    loss = model(x).square().mean()
    zero.backward(loss, retain_graph=True)  # DeepSpeed's signature; the graph survives for a second pass
    zero.backward(loss)
    zero.step()
    again = model(x).square().mean()
    zero.backward(again)
    try:
        zero.backward(again)  # retain_graph defaults to False, as in DeepSpeed
        second = None
    except RuntimeError as err:
        second = str(err)
    zero.zero_grad()
    return {"init": init, "state": zero.module_state_dict(), "second": second}


def _zero_reference(world: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3 * world, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # two backward passes accumulate: twice the gradient
        model(x).square().mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return model.state_dict()


# ------------------------------------------------------------------------------------------ module_inject norms


class Scale(nn.Module):
    """An RMSNorm whose class name says nothing (and whose eps attribute is not named eps)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Thing(nn.Module):
    """A LayerNorm under another name."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.rand(d) + 0.5), nn.Parameter(torch.randn(d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], None, None, self.eps) * self.weight + self.bias


class FakeRMSNorm(nn.Module):
    """Named like a norm, computes a per-channel scale (a LayerScale): must not be fused."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class NormNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp, self.a, self.b, self.c, self.out = (
            nn.Linear(d, d),
            Scale(d),
            Thing(d),
            FakeRMSNorm(d),
            nn.Linear(d, d),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.c(self.b(self.a(self.inp(x)))))


def test_norms_are_recognised_by_structure_and_behaviour() -> None:
    ref, model = NormNet(), NormNet()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module_inject(model, InjectPolicy())
    report = injection_report(model)
    assert report.kernels == {"a": "rms_norm", "b": "layer_norm"}
    assert model.a.eps == 1e-6  # eps found by the small-scale probe
    assert isinstance(model.c, FakeRMSNorm) and list(report.unfused) == ["c"]
    assert "neither LayerNorm nor RMSNorm" in report.unfused["c"] and "c: kept" in str(report)
    assert next(str(w.message) for w in caught if "norm-shaped" in str(w.message)).count("c (FakeRMSNorm)") == 1
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)
    untouched = NormNet()
    module_inject(untouched, InjectPolicy(inject_kernels=False))
    assert injection_report(untouched).unfused == {
        "a": "computes RMSNorm; kernel injection was off",
        "b": "computes LayerNorm; kernel injection was off",
        "c": "matches neither LayerNorm nor RMSNorm on the probes",
    }


class TinyAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, D))


class Odd(nn.Module):
    """Attention-shaped but not SDPA: with kernels asked for, this is the module that draws a warning."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.num_heads, self.qkv, self.proj = 2, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.qkv(x)[..., : x.shape[-1]] * 2)


class TPNet(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.blocks = nn.ModuleList([nn.ModuleDict({"attn": TinyAttention(d, 2), "norm": Scale(d)})])
        self.side, self.odd = Scale(d), Odd(d)


def _inject_worker(rank: int, world: int) -> dict[str, Any]:
    model = TPNet()
    plan = {r"blocks\.0\.attn\.qkv": "qkv", r"blocks\.0\.attn\.proj": "row", r"odd\..*": "replicate"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module_inject(
            model, InjectPolicy(tp_size=2, inject_kernels=False, plan=plan), tp_group=build_tp_groups(2).tp_group
        )
    return {
        "warnings": [str(w.message) for w in caught],
        "report": injection_report(model),
        "types": {n: type(m).__name__ for n, m in model.named_modules() if n},
    }


# ------------------------------------------------------------------------------------------ the 2-rank spawn


def _sampler_worker(rank: int, world: int, metric: dict[str, Any]) -> dict[str, Any]:
    group = dist.group.WORLD  # engine.data_parallel_group
    s = DeepSpeedDataSampler(_ds_config(metric), N, 4, rank, world, group, 2, rank)
    try:
        DeepSpeedDataSampler(_ds_config(metric), N, 4, rank, 4, group, 2, rank)
        mismatch = None
    except ValueError as err:
        mismatch = str(err)
    return {"span": s.get_start_end_idx(), "first": next(iter(s)), "mismatch": mismatch}


def _rank_checks(rank: int, world: int, metric: dict[str, Any]) -> dict[str, Any]:
    return {
        "compression": _compression_worker(rank, world),
        "zero": _zero_worker(rank, world),
        "inject": _inject_worker(rank, world),
        "sampler": _sampler_worker(rank, world, metric),
    }


@pytest.fixture(scope="module")
def runs(metric: dict[str, Any]) -> list[dict[str, Any]]:
    return run_distributed(_rank_checks, 2, metric, timeout=300)


def test_init_compression_and_redundancy_clean_honour_mpu(runs: list[dict[str, Any]]) -> None:
    world = 2
    res = [r["compression"] for r in runs]
    heads = [h + rank * (HEADS // world) for rank, r in enumerate(res) for h in r["heads"]]
    rows = [i + rank * (FFN // world) for rank, r in enumerate(res) for i in r["rows"]]
    assert [len(r["heads"]) for r in res] == [1, 1] and [len(r["rows"]) for r in res] == [4, 4]  # per shard
    ref, ref_masked = _reference(None, None), _reference(heads, rows)
    assert not torch.allclose(ref, ref_masked)  # pruning changed the output: the comparison is not vacuous
    for r in res:
        torch.testing.assert_close(r["plain"], ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["masked"], ref_masked, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["cleaned"], ref_masked, rtol=1e-5, atol=1e-6)
        assert r["types"] == ("MegatronColumn", "MegatronRow")  # cleaned back to Megatron's own classes
        assert r["shapes"] == {"qkv": (6, HIDDEN), "dense": (HIDDEN, 2), "fc1": (4, HIDDEN), "fc2": (HIDDEN, 4)}
        assert r["sizes"] == (6, 12, 2, 4, 1, 4, 8)
        assert "column-parallel layer split over 2" in r["errors"]["sparse_pruning"]
        assert "row-parallel layer" in r["errors"]["row_pruning"]
        assert "['head_pruning']" in r["errors"]["weight_quantization"]


def test_compression_signatures_and_mpu_with_one_rank() -> None:
    assert list(inspect.signature(init_compression).parameters) == ["model", "deepspeed_config", "teacher_model", "mpu"]
    assert list(inspect.signature(redundancy_clean).parameters) == ["model", "deepspeed_config", "mpu"]
    model, x = Block(), _x()
    model = init_compression(model=model, deepspeed_config=DS_COMPRESSION, teacher_model=None, mpu=Mpu(1, 0))
    apply_schedule(model, 0)
    with torch.no_grad():
        masked = model(x)
    heads = model.attention.dense.head_pruning.keep_index().tolist()
    rows = model.mlp.dense_h_to_4h.row_pruning.keep_index().tolist()
    torch.testing.assert_close(masked, _reference(heads, rows), rtol=1e-5, atol=1e-6)
    redundancy_clean(model, DS_COMPRESSION, Mpu(1, 0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), masked, rtol=1e-5, atol=1e-6)
    assert model.attention.num_attention_heads_per_partition == 2 and model.mlp.dense_h_to_4h.output_size == 8
    with pytest.raises(TypeError, match="get_model_parallel_world_size"):
        init_compression(Block(), DS_COMPRESSION, None, object())
    with pytest.raises(ValueError, match="compressed over 1 model-parallel ranks but mpu reports 2"):
        twin = init_compression(Block(), DS_COMPRESSION, None, Mpu(1, 0))
        apply_schedule(twin, 0)
        redundancy_clean(twin, None, Mpu(2, 0))


def test_zero3_backward_takes_retain_graph(runs: list[dict[str, Any]]) -> None:
    ref = _zero_reference(2)
    for r in runs:
        z = r["zero"]
        assert any(not torch.equal(z["init"][k], v) for k, v in ref.items())
        for k, v in ref.items():
            torch.testing.assert_close(z["state"][k], v, rtol=1e-5, atol=1e-6, msg=k)
        assert z["second"] is not None and "backward through the graph a second time" in z["second"]
    assert list(inspect.signature(DeepSpeedZeroOptimizer_Stage3.backward).parameters) == [
        "self",
        "loss",
        "retain_graph",
    ]


def test_tensor_parallelism_alone_says_nothing_about_fusion(runs: list[dict[str, Any]]) -> None:
    for r in runs:
        inj = r["inject"]
        assert inj["warnings"] == [], inj["warnings"]
        types = inj["types"]
        assert types["blocks.0.attn"] == "FusedSelfAttention"  # sharded: rebuilt because TP needs it
        assert (
            types["blocks.0.attn.qkv"] == "ColumnParallelLinear" and types["blocks.0.attn.proj"] == "RowParallelLinear"
        )
        assert types["odd"] == "Odd" and types["side"] == "Scale" and types["blocks.0.norm"] == "Scale"
        assert set(inj["report"].unfused) == {"blocks.0.norm", "side"} and not {
            k: v for k, v in inj["report"].kernels.items() if v != "attention"
        }


def test_sampler_with_a_real_process_group(runs: list[dict[str, Any]], metric: dict[str, Any]) -> None:
    single = DeepSpeedDataSampler(_ds_config(metric), N, 8, 0, 1, None, 2, 0)
    global_micro_batch = next(iter(single))
    got = [r["sampler"] for r in runs]
    assert [g["span"] for g in got] == [(0, 4), (4, 8)]
    assert got[0]["first"] + got[1]["first"] == global_micro_batch  # the ranks' slices make the global micro-batch
    assert all("data_parallel_group has 2 ranks but data_parallel_size=4" in g["mismatch"] for g in got)
