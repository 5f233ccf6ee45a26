"""What the zlightning strategies share with each other: launching, ranks and the world-wide collectives Lightning
calls. Each strategy adds its engine, checkpoints and data-parallel group on top."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from typing_extensions import override
from zlightning.strategies._launch import (
    RankLauncher,
    SpawnRankLauncher,
    install_failure_report,
    install_sigterm_handler,
)

# the module, not its names: it may be mid-import here (importing it loads Lightning, which registers these strategies)
from zlightning import _run_report
from zlightning._exit import register_gloo_settle
from zlightning._threads import small_thread_stacks

__all__ = ["LaunchedParallelStrategy"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]


_FLIGHT_RECORDER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


class LaunchedParallelStrategy(ParallelStrategy):
    """A multi-process strategy launched like Lightning's DDP (``popen`` re-runs the script per rank; ``spawn`` /
    ``fork`` / ``forkserver`` start processes from the main one), with one process group over all ranks.

    Args:
        process_group_backend: ``"gloo"``/``"nccl"``; default: gloo on CPU, nccl on CUDA.
        timeout, start_method: as Lightning's DDP strategy.

    Raises:
        ValueError: an unknown ``start_method``.
    """

    strategy_name = "zstack"
    precision_type: type[Precision] = Precision
    """The strategy's own precision plugin: Lightning's plugin from ``Trainer(precision=...)`` is converted to it."""

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = default_pg_timeout,
        start_method: StartMethod = "popen",
    ) -> None:
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(
                f"{type(self).__name__}(start_method=...) must be popen/spawn/fork/forkserver, got {start_method!r}"
            )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    # ---------------------------------------------------------------- identity and ranks
    @property
    def is_distributed(self) -> bool:
        """Tells Lightning to inject a DistributedSampler and honour ``self.log(sync_dist=True)``."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise RuntimeError(f"{self.strategy_name}: root_device is read before the Trainer set parallel_devices")
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    # ---------------------------------------------------------------- precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else self.precision_type()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is None or isinstance(plugin, self.precision_type):
            self._precision_plugin = plugin
            return
        self._check_foreign_precision(plugin)
        self._precision_plugin = self.precision_type(getattr(plugin, "precision", "32-true"))  # type: ignore[call-arg]

    def _check_foreign_precision(self, plugin: Precision) -> None:
        """Raises for a Lightning precision plugin this strategy cannot take over (default: any is converted)."""

    # ---------------------------------------------------------------- launch and process group
    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise AssertionError("cluster_environment must be set before the launcher")
        # See [Note: SIGTERM ends every rank] and [Note: one concise error per failed run] in _launch.py.
        if self._start_method == "popen":
            self._launcher = RankLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = SpawnRankLauncher(self, start_method=self._start_method)

    # [Note: gloo's flight recorder]
    # torch's gloo backend keeps a trace entry per collective in a ring buffer (the "flight recorder", sized by
    # TORCH_FR_BUFFER_SIZE), about 1 KB each. The ZeRO-3 engine's in-place host collectives issue one broadcast or
    # reduce per rank and unit, so on CPU the buffer fills over the first steps and shows as resident memory that
    # creeps for tens of steps (MBs) before it levels off. Host-only (gloo) process groups therefore start with it
    # off; a run that sets TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) itself keeps its value, and NCCL
    # groups are untouched. zlightning's own hang reports do not depend on it.

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if self.cluster_environment is None:
            raise AssertionError("cluster_environment must be set before setup_environment")
        if backend == "gloo" and not any(k in os.environ for k in _FLIGHT_RECORDER_VARS):
            os.environ["TORCH_FR_BUFFER_SIZE"] = "0"  # see [Note: gloo's flight recorder]
        with small_thread_stacks(backend):  # see [Note: thread stacks count against a data limit]
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
        register_gloo_settle()  # see [Note: gloo's workers finish with Python before the interpreter does]
        install_sigterm_handler()  # ranks started by spawn, or by another tool (torchrun, SLURM)
        install_failure_report(self.global_rank, self.world_size)  # after init_process_group's own excepthook
        self._warn_slow_cpu_precision()
        trainer = self.lightning_module._trainer if self.lightning_module is not None else None
        if trainer is not None:  # see [Note: every run under a zlightning strategy gets the report]
            _run_report.install_run_report(trainer)

    def _warn_slow_cpu_precision(self) -> None:
        """bf16/fp16 on a CPU without native support runs emulated: warn before the first (very slow) step."""
        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if self.root_device.type != "cpu" or not precision.startswith(("bf16", "16")):
            return
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        if precision.startswith("bf16") and native:
            return
        rank_zero_warn(
            f"Trainer(precision={precision!r}) on a CPU without native {precision.split('-')[0]} arithmetic (no "
            "AVX512-BF16/AMX): every step is emulated and several times slower than fp32 (a bf16 step measured 8x an "
            "fp32 step on an AVX2 machine). Use precision='32-true' on this CPU; keep bf16 for GPUs and recent CPUs."
        )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # Lightning sets it the same way

    # ---------------------------------------------------------------- world-wide collectives used by Lightning
    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # every rank of the grid must agree (early stopping, checkpoint decisions): over the world, also when
        # `reduce` (sync_dist) uses a data-parallel group only
        votes = _sync_ddp_if_available(torch.tensor(int(decision), device=self.root_device), None, reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            if torch.distributed.get_backend() == "nccl" and self.root_device.type == "cuda":
                torch.distributed.barrier(device_ids=[self.root_device.index])
            else:
                torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]
