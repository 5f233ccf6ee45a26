"""A strategy name that is not registered gets the closest registered names, in Python and on the command line.

[Note: a mistyped strategy name]
``Trainer(strategy="zstack_zer03")`` fails inside Lightning's ``_AcceleratorConnector`` with a generic message ("Example
choices: auto, ddp, ddp_spawn, deepspeed, ...") that names neither the closest registered name nor zlightning's. Once
zlightning has registered its strategies (see [Note: registering strategies without importing Lightning] in
``zlightning/__init__.py``), `explain_unknown_strategy_names` wraps the one method where Lightning checks the flags:
when that check raises ``ValueError`` for a *string* that is not registered (and not ``"auto"``), the error becomes
`UnknownStrategyError`, itself a ``ValueError``, whose message names the string, the closest registered names and,
for a name that looks like one of zlightning's, every ``zstack_*`` name. Anything else goes through Lightning's code
untouched: registered names, ``Strategy`` instances, every other error of that check. Without zlightning imported,
Lightning's own message stands. The command line (``zlightning fit --trainer.strategy=...``) suggests names with the
same `close_strategy_names`.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "UnknownStrategyError",
    "close_strategy_names",
    "explain_unknown_strategy_names",
    "unknown_strategy_message",
    "zstack_strategy_names",
]

_WRAPPED = "_zlightning_explains_unknown_strategies"
_PREFIX = "zstack_"
_ZSTACK_LIKE = ("zstack", "stack", "zero", "pipe")


class UnknownStrategyError(ValueError):
    """``Trainer(strategy=NAME)`` with a name no strategy is registered under (see [Note: a mistyped strategy
    name])."""


def close_strategy_names(name: str, available: Sequence[str]) -> list[str]:
    """The registered names closest to ``name`` (``difflib``, at most three, all about as close as the closest).

    A ``zstack_*`` name is also matched without its prefix, so ``"zero3"`` finds ``"zstack_zero3"``.
    """
    aliases: dict[str, str] = {}
    for full in available:
        aliases.setdefault(full, full)
        if full.startswith(_PREFIX):
            aliases.setdefault(full[len(_PREFIX) :], full)
    key = name.lower()
    scored: dict[str, float] = {}
    for alias in difflib.get_close_matches(key, list(aliases), n=6, cutoff=0.6):
        ratio = difflib.SequenceMatcher(None, key, alias).ratio()
        scored[aliases[alias]] = max(ratio, scored.get(aliases[alias], 0.0))
    if not scored:
        return []
    best = max(scored.values())
    return [n for n, r in sorted(scored.items(), key=lambda item: -item[1]) if r >= best - 0.05][:3]


def zstack_strategy_names(available: Sequence[str]) -> list[str]:
    """zlightning's registered strategy names, in the order they were registered."""
    return [n for n in available if n.startswith(_PREFIX)]


def unknown_strategy_message(name: str, available: Sequence[str]) -> str:
    """The few lines of `UnknownStrategyError` for ``name`` given the registered names ``available``."""
    close = close_strategy_names(name, available)
    ours = zstack_strategy_names(available)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "."
    lines = [f"Trainer(strategy={name!r}): no strategy is registered under that name{hint}"]
    zstack_like = any(c in ours for c in close) or any(token in name.lower() for token in _ZSTACK_LIKE)
    if zstack_like and ours:
        lines.append(f"zlightning's strategies: {', '.join(ours)}.")
        lines.append("Lightning's include ddp, fsdp, deepspeed.")
    else:
        zl = f" and zlightning's {', '.join(ours)}" if ours else ""
        lines.append(f"Registered names include ddp, fsdp, deepspeed{zl}.")
    lines.append(
        "Every name: lightning.pytorch.strategies.StrategyRegistry.available_strategies(); a Strategy instance such as "
        "ZStackZero3Strategy(...) works too."
    )
    return "\n".join(lines)


def explain_unknown_strategy_names() -> None:
    """Makes ``Trainer(strategy=...)`` with a name that is not registered raise `UnknownStrategyError` (see [Note: a
    mistyped strategy name]). Idempotent; does nothing where Lightning's connector is not what it expects."""
    try:
        from lightning.pytorch.strategies import StrategyRegistry
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector
    except ImportError:
        return
    check = _AcceleratorConnector.__dict__.get("_check_config_and_set_final_flags")
    if not callable(check) or getattr(check, _WRAPPED, False):
        return
    wrapped = _explaining(check, StrategyRegistry)
    setattr(wrapped, _WRAPPED, True)
    _AcceleratorConnector._check_config_and_set_final_flags = wrapped  # type: ignore[method-assign]


def _explaining(check: Callable[..., Any], registry: Any) -> Callable[..., Any]:
    @functools.wraps(check)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return check(self, *args, **kwargs)
        except ValueError as err:
            strategy = kwargs.get("strategy", args[0] if args else None)
            if isinstance(err, UnknownStrategyError) or not isinstance(strategy, str):
                raise
            if strategy.lower() == "auto" or strategy.lower() in registry:
                raise  # the name is fine: the error is about something else
            raise UnknownStrategyError(unknown_strategy_message(strategy, registry.available_strategies())) from None

    return checked
