"""ZeRO-3 engine (Lightning-free): parameters, gradients and optimizer state sharded across data-parallel ranks.

Public surface::

    state = zero3_shard(model, ZeroConfig(...))          # shard in place
    attach_optimizer(state, optimizer)                    # optimizer built over the full parameters
    DeepSpeedZeroOptimizer_Stage3(model, optimizer, ...)  # the same, with backward/step/clipping/loss scaling
    ZeroConfig(offload_optimizer=NVMeOffload(path=...), offload_params=NVMeOffload(path=...))  # ZeRO-Infinity
"""

from zlightning.zero._api import zero3_shard
from zlightning.zero._checkpoint import (
    full_optim_state_dict,
    full_state_dict,
    load_full_optim_state_dict,
    load_full_state_dict,
    unshard_module,
)
from zlightning.zero._config import CheckpointPolicy, MixedPrecisionPolicy, ZeroConfig
from zlightning.zero._deepspeed_config import DeepSpeedSettings, UnsupportedConfigError, from_deepspeed_config
from zlightning.zero._deferred import InitRecording, deferred_init
from zlightning.zero._estimate import MemoryEstimate, estimate_zero_memory
from zlightning.zero._export import StateDictWriter, iter_full_state_dict, save_full_state_dict, summon_full_params
from zlightning.zero._offload_config import CPUOffload, NVMeOffload, OffloadPolicy
from zlightning.zero._offload_optimizer import OffloadedAdam
from zlightning.zero._optimizer import (
    DeepSpeedZeroOptimizer_Stage3,
    DynamicLossScaler,
    LossScalerConfig,
    MemoryReport,
    ModelParallelGrads,
    attach_optimizer,
    clip_grad_norm_,
    global_grad_norm,
    memory_report,
)
from zlightning.zero._sharded_checkpoint import (
    CheckpointError,
    CheckpointSaveError,
    consolidate,
    is_sharded_checkpoint,
    load_sharded,
    save_sharded,
)
from zlightning.zero._state import ZeroState, engine_of
from zlightning.zero._swap import SwapState, SwapStateError
from zlightning.zero._swap_io import SwapCorruptionError, SwapPathError, SwapSpaceError

ZeroOptimizer = DeepSpeedZeroOptimizer_Stage3

# The public surface (what the API reference lists): the engine, its configuration, full weights out of a sharded
# model, checkpoints and the errors the guides show how to handle. Every other name imported above stays importable
# from here.
__all__ = [
    "CPUOffload",
    "CheckpointError",
    "CheckpointPolicy",
    "CheckpointSaveError",
    "DeepSpeedZeroOptimizer_Stage3",
    "MemoryReport",
    "MixedPrecisionPolicy",
    "NVMeOffload",
    "SwapCorruptionError",
    "SwapPathError",
    "SwapSpaceError",
    "ZeroConfig",
    "attach_optimizer",
    "consolidate",
    "deferred_init",
    "engine_of",
    "estimate_zero_memory",
    "full_state_dict",
    "save_full_state_dict",
    "summon_full_params",
    "unshard_module",
    "zero3_shard",
]
