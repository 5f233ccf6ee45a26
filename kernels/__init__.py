"""Native kernels: async tensor I/O, CPU Adam, group-wise quantization, and a caching host allocator.

Each op has a compiled implementation (C++ registered with ``torch.library``, built ahead of time by
``zlightning kernels --build``, which ``make install`` runs) and a pure-PyTorch reference used as the fallback and in tests.
Importing this package never compiles anything; ``zlightning kernels`` prints what is compiled and what falls back.

Public names (DeepSpeed code ports by changing the import)::

    CPUAdam             DeepSpeedCPUAdam's constructor; fp32/bf16/fp16 params, optional low-precision copy
    DeepSpeedIOEngine   DeepSpeed's aio handle: async_pread/async_pwrite/wait/sync_*/new_cpu_locked_tensor
    quantize/dequantize group-wise symmetric/asymmetric int8 and packed int4
"""

from zlightning.kernels._aio import AIOConfig, AIOError, DeepSpeedIOEngine, IORequest
from zlightning.kernels._cpu_adam import CPUAdam
from zlightning.kernels._quant import QuantizedTensor, dequantize, quantize
from zlightning.kernels._report import kernel_report

__all__ = [
    "AIOConfig",
    "AIOError",
    "CPUAdam",
    "DeepSpeedIOEngine",
    "IORequest",
    "QuantizedTensor",
    "dequantize",
    "kernel_report",
    "quantize",
]
