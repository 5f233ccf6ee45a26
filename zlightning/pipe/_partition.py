"""Splitting a layer list into contiguous stages (pure functions; nothing is built on a real device)."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["partition_balanced", "partition_uniform", "layer_weights"]


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries (``num_parts + 1`` of them) giving each part ``num_items // num_parts`` items, the first
    ``num_items % num_parts`` parts one more (DeepSpeed's ``uniform``: 10 items, 4 parts -> [0, 3, 6, 8, 10])."""
    base, extra = divmod(num_items, num_parts)
    bounds = [0]
    for p in range(num_parts):
        bounds.append(bounds[-1] + base + (1 if p < extra else 0))
    return bounds


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Contiguous split into ``num_parts`` non-empty parts that minimises the heaviest part (the pipeline's
    bottleneck), then the spread ``max - min`` among splits with that maximum. Exact dynamic programme over
    ``O(parts * items^2)`` states; ties resolve to the earliest boundaries.

    Raises:
        ValueError: fewer items than parts.
    """
    n = len(weights)
    if n < num_parts:
        raise ValueError(f"cannot split {n} layers into {num_parts} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[p][i]: (max, -min, bounds) of splitting items[:i] into p parts
    INF: tuple[float, float, tuple[int, ...]] = (float("inf"), float("inf"), ())
    best: list[list[tuple[float, float, tuple[int, ...]]]] = [[INF] * (n + 1) for _ in range(num_parts + 1)]
    best[0][0] = (0.0, -float("inf"), (0,))
    for p in range(1, num_parts + 1):
        for i in range(p, n - (num_parts - p) + 1):
            cand = INF
            for j in range(p - 1, i):
                prev = best[p - 1][j]
                if prev[0] == float("inf"):
                    continue
                part = prefix[i] - prefix[j]
                hi = max(prev[0], part)
                lo = part if p == 1 else min(-prev[1], part)
                key = (hi, hi - lo, prev[2] + (i,))
                if (key[0], key[1]) < (cand[0], cand[1]):
                    cand = key
            best[p][i] = cand
    return list(best[num_parts][n][2])


def layer_weights(method: str, names: Sequence[str], trainable_numel: Sequence[int]) -> list[float] | None:
    """Per-layer weights for ``method``: ``parameters`` (trainable numel), ``type:REGEX`` (1 for layers whose class
    or function name matches, case-insensitively); ``None`` for ``uniform``.

    Raises:
        ValueError: unknown method, invalid regex, or a regex that matches no layer.
        NotImplementedError: ``profile`` (DeepSpeed does not implement it either).
    """
    lowered = method.lower()
    if lowered == "uniform":
        return None
    if lowered == "parameters":
        return [float(n) for n in trainable_numel]
    if lowered.startswith("type:"):
        pattern = method[len("type:") :]
        try:
            regex = re.compile(pattern, re.IGNORECASE)
        except re.error as e:
            raise ValueError(f"partition_method={method!r}: invalid regular expression ({e})") from e
        weights = [1.0 if regex.search(name) else 0.0 for name in names]
        if not any(weights):
            raise ValueError(
                f"partition_method={method!r} matches no layer; layer class names are {sorted(set(names))}"
            )
        return weights
    if lowered == "profile":
        raise NotImplementedError(
            "partition_method='profile' is not implemented; use 'parameters', 'uniform' or 'type:REGEX'"
        )
    raise ValueError(f"unknown partition_method {method!r}; use 'parameters', 'uniform' or 'type:REGEX'")
