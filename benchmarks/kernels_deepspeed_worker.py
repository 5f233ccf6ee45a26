"""DeepSpeed side of ``benchmarks/kernels.py``; runs in ``benchmarks/.venv-deepspeed`` (setup_deepspeed_venv.sh).

Started once per benchmark section by ``kernels.py`` with that venv's python, it serves timing requests on stdin,
one JSON object per line, and answers each with one JSON line on stdout, so the driver can interleave DeepSpeed's
timed calls with its own contenders round by round (the shared machine's load then hits every contender alike):

    {"op": "adam_setup", "n": 50000000}                      -> {"ok": true, "load_s": ...}
    {"op": "adam_step"}                                      -> {"seconds": ...}
    {"op": "aio_setup", "nbytes": ..., "path": "...", "block_size": 1048576, "queue_depth": 32}
                                                             -> {"ok": true, "load_s": ...}
    {"op": "aio", "rw": "write" | "read"}                    -> {"seconds": ...}
    {"op": "quit"}

Any failure answers {"error": "..."} (the driver records the row as skipped with that reason). DeepSpeed's ops are
JIT-built on first use by its op builders into ``TORCH_EXTENSIONS_DIR`` (the driver points it inside the DeepSpeed
venv, so the ~7 min aio build and ~1.5 min CPU Adam build happen once). Only torch, DeepSpeed and the standard
library are imported here: this interpreter has no zlightning, Lightning or project dependencies.

[Note: what DeepSpeed is given]
* CPU Adam: ``DeepSpeedCPUAdam(lr=1e-3, weight_decay=0.01)`` (AdamW mode, fp32 state) on one fp32 parameter of
  ``n`` elements with a random gradient, exactly the driver's setup for torch and zlightning. Threads: OpenMP takes
  ``OMP_NUM_THREADS``, which the driver sets to its own torch thread count.
* aio: ``aio_handle(block_size, queue_depth, single_submit=False, overlap_events=False, intra_op_parallelism=1)``
  on a buffer from the handle's ``new_cpu_locked_tensor`` (page-aligned and mlock'ed), which is the buffer
  DeepSpeed's swapper uses and the one its aio path does direct I/O from without a bounce copy. A plain, unpinned
  tensor would make every request copy through a freshly allocated locked bounce buffer.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # explicit: never probe for CUDA/XPU

import torch  # noqa: E402


class _Server:
    """Holds the objects set up by earlier requests."""

    def __init__(self) -> None:
        self.adam_step: Any = None
        self.handle: Any = None
        self.buffer: torch.Tensor | None = None
        self.path = ""

    def adam_setup(self, n: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.randn(n, requires_grad=True)
        p.grad = torch.randn(n)
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01)
        self.adam_step = opt.step
        self.adam_step()  # warm-up: allocates the state, first touch of every page
        return {"ok": True, "load_s": time.perf_counter() - t0, "omp_threads": os.environ.get("OMP_NUM_THREADS")}

    def aio_setup(self, nbytes: int, path: str, block_size: int, queue_depth: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("AsyncIOBuilder")
        if builder is None or not builder.is_compatible(verbose=False):
            raise RuntimeError("DeepSpeed AsyncIOBuilder is not compatible here (needs libaio-dev)")
        aio = builder.load(verbose=False)
        self.handle = aio.aio_handle(block_size, queue_depth, False, False, 1)
        self.buffer = self.handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
        self.buffer.fill_(7)
        self.path = path
        return {"ok": True, "load_s": time.perf_counter() - t0, "locked": bool(self.handle.is_pinned(self.buffer))}

    def aio(self, rw: str) -> dict[str, Any]:
        if self.handle is None or self.buffer is None:
            raise RuntimeError("aio before aio_setup")
        t0 = time.perf_counter()
        if rw == "write":
            self.handle.async_pwrite(self.buffer, self.path)
        elif rw == "read":
            self.handle.async_pread(self.buffer, self.path)
        else:
            raise ValueError(f"aio: rw must be 'write' or 'read', got {rw!r}")
        done = self.handle.wait()
        seconds = time.perf_counter() - t0
        if done < 1:
            raise RuntimeError(f"aio {rw}: wait() returned {done} completed requests")
        return {"seconds": seconds}

    def handle_request(self, req: dict[str, Any]) -> dict[str, Any] | None:
        op = req.get("op")
        if op == "adam_setup":
            return self.adam_setup(int(req["n"]))
        if op == "adam_step":
            t0 = time.perf_counter()
            self.adam_step()
            return {"seconds": time.perf_counter() - t0}
        if op == "aio_setup":
            return self.aio_setup(int(req["nbytes"]), str(req["path"]), int(req["block_size"]), int(req["queue_depth"]))
        if op == "aio":
            return self.aio(str(req["rw"]))
        if op == "quit":
            return None
        raise ValueError(f"unknown request {req!r}")


def main() -> None:
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    server = _Server()
    # Replies go to a private copy of the original stdout; file descriptor 1 itself is pointed at stderr, so that
    # DeepSpeed's chatter (Python prints, C++ std::cout, the JIT build's compiler output) cannot corrupt the channel.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = server.handle_request(json.loads(line))
        except Exception as err:  # reported to the driver, which records the row as skipped
            traceback.print_exc()
            reply = {"error": f"{type(err).__name__}: {err}"[:300]}
        if reply is None:
            break
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
