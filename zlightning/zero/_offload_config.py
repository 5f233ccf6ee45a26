"""Typed offload policies for ZeRO-Infinity: where optimizer state and parameter shards live between uses.

Orthogonal concerns are separate policy objects (FSDP2's ``CPUOffloadPolicy(OffloadPolicy)``), passed as
``ZeroConfig(offload_optimizer=..., offload_params=...)`` or to the Lightning strategy. Field names follow
DeepSpeed's ``offload_optimizer`` / ``offload_param`` / ``aio`` blocks where one exists. Nothing here touches the
file system: paths are checked when the engine starts (``zlightning.zero._swap_io.check_swap_path``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CPUOffload", "NVMeOffload", "OffloadPolicy", "IO_ALIGNMENT"]

IO_ALIGNMENT = 4096
"""Bytes: buffer addresses, sizes and file offsets of swap I/O are multiples of this (O_DIRECT needs the logical
block size, 512 or 4096 on current devices; 4096 satisfies both)."""


def _positive_int(owner: str, name: str, value: object, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class OffloadPolicy:
    """Base class: keep the tensors this policy is given to off the compute device between uses."""

    pin_memory: bool = True
    """Page-lock host buffers (only meaningful with a CUDA device: copies to and from it are then asynchronous).
    Ignored on CPU-only machines."""

    step_in_backward: bool = False
    """Optimizer offload only: run each parameter group's Adam update during backward, as soon as its gradient is
    final, instead of all of them in ``optimizer.step()`` (the swap traffic and the update then overlap the rest of
    backward). Bitwise the same result as the step it replaces, provided nothing changes gradients or
    hyper-parameters between backward and ``optimizer.step()``: gradient clipping and fp16 loss scaling are
    refused with it (``DeepSpeedZeroOptimizer_Stage3`` then keeps the update in ``step()``), and a changed learning
    rate is an error. See [Note: optimizer steps in backward] in ``zlightning/zero/_offload_optimizer.py``."""

    release_gradients: bool = False
    """With ``step_in_backward``: free each group's gradient shard once its update ran, so gradients never all sit
    in memory at once (what a model whose gradients alone exceed RAM needs). Those parameters' ``.grad`` is None
    after backward: nothing can read or clip them before ``optimizer.step()``."""

    def __post_init__(self) -> None:
        name = type(self).__name__
        for flag in ("pin_memory", "step_in_backward", "release_gradients"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{name}.{flag} must be a bool, got {getattr(self, flag)!r}")
        if self.release_gradients and not self.step_in_backward:
            raise ValueError(
                f"{name}(release_gradients=True) needs step_in_backward=True: a gradient can only be freed once its "
                "update ran, which without step_in_backward is in optimizer.step()"
            )


@dataclass(frozen=True, kw_only=True)
class CPUOffload(OffloadPolicy):
    """Host memory. For ``offload_optimizer``: fp32 master weights and optimizer state live on the host and the
    step runs there (CPU Adam). For ``offload_params``: parameter shards live on the host and are copied to the
    device before each gather."""


@dataclass(frozen=True, kw_only=True)
class NVMeOffload(OffloadPolicy):
    """Files on a fast local disk, read and written through a fixed pool of aligned host buffers.

    For ``offload_optimizer`` the state is stepped in sub-groups of at most ``buffer_size`` elements, pipelined:
    while sub-group ``i`` is stepped, ``i+1`` is read and ``i-1`` written. For ``offload_params`` each parameter
    group's shard (one unit) is one file, prefetched in execution order ahead of its all-gather.
    """

    path: str | os.PathLike[str] | None = None
    """Directory for swap files (a per-run, per-rank folder is created under it and removed at exit). None: the
    system temporary directory, with a warning (set it explicitly to a local NVMe drive)."""

    buffer_count: int = 8
    """Host buffers in the pool. The pipelined optimizer needs ``3 x tensors per sub-group`` (Adam: exp_avg,
    exp_avg_sq, plus the fp32 master when it does not live in device memory); with fewer (but at least one
    sub-group's worth) it steps without overlap and warns. Parameter offload needs one buffer per unit in flight."""

    buffer_size: int = 16_777_216
    """Elements per buffer (rounded up to a multiple of ``IO_ALIGNMENT`` bytes). For ``offload_optimizer`` it is
    the largest sub-group size (buffers are made no larger than the largest parameter shard); for
    ``offload_params`` every unit's shard must fit in one buffer. The pool's host memory is ``buffer_count`` times
    the buffer size, allocated once."""

    block_size: int = 1_048_576
    """Bytes per I/O request handed to the I/O engine (DeepSpeed ``aio.block_size``); a multiple of 4096."""

    queue_depth: int = 8
    """I/O requests in flight per thread (DeepSpeed ``aio.queue_depth``)."""

    io_threads: int = 2
    """Threads per I/O handle (DeepSpeed ``aio.intra_op_parallelism``)."""

    direct_io: Literal["auto", "on", "off"] = "auto"
    """``"auto"``: use O_DIRECT when the file system supports it, else buffered I/O with a warning (tmpfs, some
    overlay file systems). ``"on"``: refuse to start without it. ``"off"``: always buffered."""

    io_engine: Literal["auto", "kernels", "portable"] = "auto"
    """Backend of ``zlightning.kernels.DeepSpeedIOEngine``: ``"kernels"`` the native io_uring one (an error when it is
    not built), ``"portable"`` its thread pool of ``pread``/``pwrite``, ``"auto"`` native when built."""

    stale_files: Literal["remove", "error"] = "remove"
    """Swap folders left by a crashed run (its process is gone): ``"remove"`` deletes them with a warning,
    ``"error"`` refuses to start and names them."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ValueError(f"NVMeOffload.path must be a directory path or None, got {self.path!r}")
        if self.path is not None and str(self.path) == "":
            raise ValueError("NVMeOffload.path is empty: give a directory on a local NVMe drive, or None")
        _positive_int("NVMeOffload", "buffer_count", self.buffer_count)
        _positive_int("NVMeOffload", "buffer_size", self.buffer_size, minimum=1024)
        _positive_int("NVMeOffload", "queue_depth", self.queue_depth)
        _positive_int("NVMeOffload", "io_threads", self.io_threads)
        _positive_int("NVMeOffload", "block_size", self.block_size, minimum=IO_ALIGNMENT)
        if self.block_size % IO_ALIGNMENT:
            raise ValueError(
                f"NVMeOffload.block_size must be a multiple of {IO_ALIGNMENT} bytes, got {self.block_size}"
            )
        if self.direct_io not in ("auto", "on", "off"):
            raise ValueError(f"NVMeOffload.direct_io must be 'auto', 'on' or 'off', got {self.direct_io!r}")
        if self.io_engine not in ("auto", "kernels", "portable"):
            raise ValueError(f"NVMeOffload.io_engine must be 'auto', 'kernels' or 'portable', got {self.io_engine!r}")
        if self.stale_files not in ("remove", "error"):
            raise ValueError(f"NVMeOffload.stale_files must be 'remove' or 'error', got {self.stale_files!r}")

    def resolved_path(self) -> Path:
        """The swap root as an absolute path (the system temporary directory when ``path`` is None)."""
        import tempfile

        return Path(self.path if self.path is not None else tempfile.gettempdir()).expanduser().absolute()
