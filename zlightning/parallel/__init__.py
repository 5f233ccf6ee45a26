"""Parallelism that runs inside a model's forward: context-parallel (CP) attention.

One sequence is split zigzag over an aligned power-of-two block of ranks; each rank computes its own tokens' Q, K, V,
and the attention all-gathers K and V within the block (see ``zlightning/parallel/_cp_attention.py``)::

    groups = HybridCPGroups.build(dp_cp_group)                  # once, on every rank: one group per block
    shard = CPShard.for_sub_sample(sub, groups)                  # where this rank's tokens sit
    with cp_attention(shard):                                    # the model's causal SDPA calls run as CP attention
        h = blocks(embed(tokens, positions=shard.q_positions))   # this rank's tokens at their original positions

The data side (balancing sub-samples over the ranks, rerouting them, the zigzag split of their tensors) is
``zlightning.datamodules.hybrid_cp``.
"""

from zlightning.parallel._cp_attention import (
    CPShard,
    HybridCPGroups,
    PlacedSubSample,
    cp_attention,
    cp_causal_attention,
    zigzag_positions,
)

__all__ = ["CPShard", "HybridCPGroups", "PlacedSubSample", "cp_attention", "cp_causal_attention", "zigzag_positions"]
