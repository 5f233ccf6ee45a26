"""Module selection: regexes over qualified module names -> the modules each technique group compresses.

Patterns are Python regexes applied with ``re.search`` (a substring match unless anchored) in ``named_modules()``
order, as in DeepSpeed. Unlike DeepSpeed: ``modules=None`` means every module of a type the technique supports; a
pattern that matches no supported module, a supported-looking module of the wrong type, or a module already selected
by another pattern or group of the same technique is an error, raised before anything is changed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

__all__ = ["COMPRESSIBLE", "SUPPORTED", "Selection", "pair_related", "select_modules"]

COMPRESSIBLE: tuple[type[nn.Module], ...] = (nn.Linear, nn.Conv2d, nn.Embedding)
SUPPORTED: dict[str, tuple[type[nn.Module], ...]] = {
    "weight_quantization": (nn.Linear, nn.Conv2d, nn.Embedding),
    "activation_quantization": (nn.Linear, nn.Conv2d),
    "sparse_pruning": (nn.Linear, nn.Conv2d),
    "row_pruning": (nn.Linear,),
    "head_pruning": (nn.Linear,),
    "channel_pruning": (nn.Conv2d,),
}
_RELATED_TYPES = (nn.Linear, nn.Conv2d, nn.BatchNorm2d)


@dataclass(frozen=True)
class Selection:
    """One selected module of one technique group."""

    group: object
    """The group config (`WeightQuantGroup`, `PruneGroup`, ...)."""
    name: str
    """Qualified module name."""
    pattern_index: int | None
    """Index of the matching entry of ``group.modules`` (None when ``modules`` is None)."""


def _compile(technique: str, group: str, pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as err:
        raise ValueError(
            f"{technique} group {group!r}: module pattern {pattern!r} is not a valid regex ({err})."
        ) from err


def select_modules(
    model: nn.Module, technique: str, groups: tuple[object, ...], split_types: tuple[type[nn.Module], ...] = ()
) -> list[Selection]:
    """The modules selected by each group of ``technique``, validated.

    ``split_types`` (Megatron's split linears, from ``mpu``) are candidates of every technique here; which technique
    may act on which split is checked by the caller (`TensorParallel.check`).

    Raises:
        ValueError: For an invalid regex, a pattern matching no supported module, a matched module of an unsupported
            type, or a module matched twice (by two patterns or two groups).
    """
    supported = SUPPORTED[technique] + split_types
    candidates = [(n, m) for n, m in model.named_modules() if isinstance(m, COMPRESSIBLE + split_types)]
    owner: dict[str, tuple[str, str]] = {}
    out: list[Selection] = []
    for group in groups:
        gname, patterns = group.name, group.modules  # type: ignore[attr-defined]
        matches: list[tuple[str, int | None, str]]
        if patterns is None:
            matches = [(n, None, "<all>") for n, m in candidates if isinstance(m, supported)]
        else:
            matches = []
            for i, pattern in enumerate(patterns):
                regex = _compile(technique, gname, pattern)
                hit = [(n, m) for n, m in candidates if regex.search(n)]
                wrong = [f"{n} ({type(m).__name__})" for n, m in hit if not isinstance(m, supported)]
                if wrong:
                    raise ValueError(
                        f"{technique} group {gname!r}: pattern {pattern!r} matches modules of an unsupported type: "
                        f"{wrong}; {technique} supports {[t.__name__ for t in supported]}. Narrow the regex."
                    )
                if not hit:
                    names = [n for n, m in candidates if isinstance(m, supported)][:8]
                    raise ValueError(
                        f"{technique} group {gname!r}: pattern {pattern!r} matches no module; supported modules "
                        f"include {names}."
                    )
                matches.extend((n, i, pattern) for n, _ in hit)
        for name, index, pattern in matches:
            if name in owner:
                g0, p0 = owner[name]
                raise ValueError(
                    f"{technique}: module {name!r} is matched by group {gname!r} (pattern {pattern!r}) but is already "
                    f"in group {g0!r} (pattern {p0!r}); a module may belong to one group per technique. Anchor or "
                    "narrow the regexes (e.g. r'\\.fc$')."
                )
            owner[name] = (gname, pattern)
            out.append(Selection(group, name, index))
    return out


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def pair_related(
    model: nn.Module,
    primary: str,
    patterns: tuple[str, ...],
    technique: str,
    split_types: tuple[type[nn.Module], ...] = (),
) -> tuple[str, ...]:
    """The related modules of ``primary``: for each pattern, the matches nearest to it in the module tree.

    Raises:
        ValueError: If a pattern matches no Linear/Conv2d/BatchNorm2d module (or split linear of ``split_types``).
    """
    names = [n for n, m in model.named_modules() if isinstance(m, _RELATED_TYPES + split_types) and n != primary]
    out: list[str] = []
    for pattern in patterns:
        hits = [n for n in names if _compile(technique, "related_modules", pattern).search(n)]
        if not hits:
            raise ValueError(f"{technique}: related_modules pattern {pattern!r} (for {primary!r}) matches no module.")
        best = max(_common_prefix(primary, n) for n in hits)
        out.extend(n for n in hits if _common_prefix(primary, n) == best and n not in out)
    return tuple(out)
