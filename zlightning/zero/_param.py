"""One parameter under ZeRO-3: where it lives in its group's flat layout and which module slots hold it.

[Note: what the optimizer sees]
Each parameter's registered ``nn.Parameter`` is replaced by its *local piece*: the 1-D slice of this rank's shard of
the group's flat layout that falls inside the parameter (possibly empty). Pieces are views into the group's flat fp32
shard, so any torch optimizer updates the shard in place and the next all-gather sends the new values. The full
shape stays discoverable through ``ZeroParam.shape`` (``ZeroState.full_shape``), and the strategy builds optimizers
while the parameters are still full, then re-points them to the pieces, so ``p.ndim``-based weight-decay groups work.
No attribute is ever set on an ``nn.Parameter``: this object owns the metadata.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ZeroParam"]


class ZeroParam:
    """Metadata and module bindings of one original parameter (identity-deduplicated: tied weights are one)."""

    index: int  # position in the engine's parameter list (stable, construction order)
    fqn: str  # first fully qualified name (root-relative)
    fqns: list[str]  # every name it is registered under (tied weights have several)
    slots: list[tuple[nn.Module, str]]  # (module, attribute) pairs that hold it
    shape: torch.Size  # full shape
    numel: int
    dtype: torch.dtype  # master dtype
    trainable_at_build: bool  # requires_grad when the engine was built (see `requires_grad` for the current one)
    offset: int  # start within the group's unsharded flat layout
    local_start: int  # this rank's piece, in group-flat coordinates [local_start, local_end)
    local_end: int
    piece: nn.Parameter  # 1-D view into the group's shard (what modules and optimizers hold while sharded)
    original: nn.Parameter  # the user's object, storage released while sharded, restored by ``unshard_module``

    def __init__(self, index: int, param: nn.Parameter, fqns: list[str], slots: list[tuple[nn.Module, str]]) -> None:
        self.index = index
        self.fqn = fqns[0]
        self.fqns = fqns
        self.slots = slots
        self.shape = param.shape
        self.numel = param.numel()
        self.dtype = param.dtype
        self.trainable_at_build = param.requires_grad
        self.original = param
        self.offset = 0
        self.local_start = 0
        self.local_end = 0

    @property
    def requires_grad(self) -> bool:
        """Whether the parameter trains now: its piece's flag, which users (or Lightning's ``BaseFinetuning``)
        switch on the module's parameters during training (see [Note: freezing and unfreezing a sharded
        parameter] in ``_param_group.py``)."""
        piece = self.__dict__.get("piece")
        return self.trainable_at_build if piece is None else piece.requires_grad

    @property
    def local_numel(self) -> int:
        return self.local_end - self.local_start

    def place(self, offset: int, shard_start: int, shard_end: int) -> None:
        """Sets the offset in the group layout and the intersection with this rank's shard [shard_start, shard_end)."""
        self.offset = offset
        self.local_start = min(max(offset, shard_start), shard_end)
        self.local_end = max(min(offset + self.numel, shard_end), self.local_start)

    def bind_piece(self, shard: torch.Tensor, shard_start: int) -> None:
        """Creates the sharded ``nn.Parameter`` as a view of ``shard`` (this rank's flat shard)."""
        lo = self.local_start - shard_start
        self.piece = nn.Parameter(shard[lo : lo + self.local_numel], requires_grad=self.requires_grad)

    def local_slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece cut out of a full tensor of the parameter's shape (for loading checkpoints)."""
        lo = self.local_start - self.offset
        return full.reshape(-1)[lo : lo + self.local_numel]

    def install(self, tensor: torch.Tensor) -> None:
        """Makes every slot hold ``tensor`` (a gathered full tensor, or the piece when sharded)."""
        for module, name in self.slots:
            module._parameters[name] = tensor  # type: ignore[assignment]

    def release_original_storage(self) -> None:
        """Frees the original full tensor's memory while keeping the Python object for ``unshard_module``."""
        if not self.original.is_meta:  # a meta-device original (sharded init) holds no memory anyway
            self.original.data = torch.empty(0, dtype=self.dtype, device=self.piece.device)

    def __repr__(self) -> str:
        return f"ZeroParam({self.fqn}, shape={tuple(self.shape)}, local=[{self.local_start},{self.local_end}))"
