"""Curriculum schedules as data: a frozen `CurriculumSchedule`, the pure `difficulty_at`, and `CurriculumScheduler`.

`difficulty_at(schedule, step)` is a pure function of the step (the schedule is data); `CurriculumScheduler` is the
thin stateful wrapper with DeepSpeed's names and meanings (`get_difficulty`, `update_difficulty`), so DeepSpeed code
that builds ``CurriculumScheduler(metric_config_dict)`` ports unchanged.

[Note: schedule formulas (DeepSpeed 0.19.8)]
With ``t`` the step (the sampler passes its 1-based ``curriculum_step``), ``lo``/``hi`` the min/max difficulty:

* ``fixed_root`` (root degree ``k``) and ``fixed_linear`` (``k = 1``), total steps ``T``, difficulty step ``s``::

      raw = floor((t / T) ** (1 / k) * (hi - lo) + lo)
      d = min(raw - raw % s, hi)          # round down to a multiple of s, clamp at hi
      d = max(d, ceil(lo / s) * s)        # 0.19.8 floor (PR #8334): never below lo, rounded up to a multiple of s

  The floor runs after the clamp, exactly as upstream, so ``ceil(lo / s) * s > hi`` yields a value above ``hi``.
  When ``hi`` is not a multiple of ``s`` the value at ``t = T`` is ``hi - hi % s``; ``hi`` itself is reached later.
* ``fixed_discrete``: ``difficulty = [d0 .. dn]``, ``max_step = [s0 .. s(n-1)]``: the first ``d_i`` with
  ``t <= s_i``, and ``dn`` once ``t > s(n-1)``.
* ``custom``: a user function ``fn(t) -> difficulty``.

`CurriculumScheduler.update_difficulty` is sticky at the maximum, as upstream: once the current difficulty is
``>= hi`` it is never recomputed, even if the schedule later returns a smaller value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = ["CurriculumSchedule", "CurriculumScheduler", "CustomDifficultyFn", "ScheduleType", "difficulty_at"]

ScheduleType = Literal["fixed_linear", "fixed_root", "fixed_discrete", "custom"]
"""The schedule types of DeepSpeed's ``schedule_type`` key."""

CustomDifficultyFn = Callable[[int], int]
"""A ``custom`` schedule: the difficulty at a (1-based) curriculum step."""

_SCHEDULE_KEYS = frozenset({"min_difficulty", "max_difficulty", "schedule_type", "schedule_config"})
_SAMPLER_KEYS = frozenset({"index_to_sample_path", "index_to_metric_path", "difficulty_type", "clustering_type"})
_SCHEDULE_CONFIG_KEYS = frozenset({"total_curriculum_step", "difficulty_step", "root_degree", "difficulty", "max_step"})


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, kw_only=True)
class CurriculumSchedule:
    """How one metric's difficulty grows with the curriculum step. See [Note: schedule formulas (DeepSpeed 0.19.8)].

    Build it directly, or from DeepSpeed's per-metric dict with `CurriculumSchedule.from_dict`.

    Raises:
        ValueError: If a field is out of range or a field needed by ``schedule_type`` is missing.
        TypeError: If a field has the wrong type.
    """

    min_difficulty: int
    """Difficulty at step 0 (and the floor of the root/linear schedules)."""
    max_difficulty: int
    """Largest difficulty; `CurriculumScheduler.update_difficulty` stops updating once it is reached."""
    schedule_type: ScheduleType
    """``fixed_linear``, ``fixed_root``, ``fixed_discrete`` or ``custom``."""
    total_curriculum_step: int | None = None
    """``fixed_linear``/``fixed_root``: steps over which the difficulty grows from min to max."""
    difficulty_step: int | None = None
    """``fixed_linear``/``fixed_root``: the difficulty is always a multiple of this (8 suits tensor cores)."""
    root_degree: float | None = None
    """``fixed_root`` only: ``k`` in ``(t / T) ** (1 / k)``."""
    difficulty: tuple[int, ...] = ()
    """``fixed_discrete`` only: the difficulties ``d0 .. dn``."""
    max_step: tuple[int, ...] = ()
    """``fixed_discrete`` only: the last step of each difficulty but the final one (one fewer than ``difficulty``)."""

    def __post_init__(self) -> None:
        where = f"CurriculumSchedule({self.schedule_type!r})"
        for name in ("min_difficulty", "max_difficulty"):
            if not _is_int(getattr(self, name)):
                raise TypeError(f"{where}: {name} must be an int, got {getattr(self, name)!r}.")
        if self.schedule_type not in get_args(ScheduleType):
            raise ValueError(
                f"CurriculumSchedule: schedule_type must be one of {list(get_args(ScheduleType))}, "
                f"got {self.schedule_type!r}."
            )
        if self.min_difficulty > self.max_difficulty:
            raise ValueError(
                f"{where}: min_difficulty ({self.min_difficulty}) must be <= max_difficulty ({self.max_difficulty})."
            )
        if self.schedule_type in ("fixed_linear", "fixed_root"):
            self._check_root()
        elif self.schedule_type == "fixed_discrete":
            self._check_discrete()

    def _check_root(self) -> None:
        where = f"CurriculumSchedule({self.schedule_type!r})"
        for name in ("total_curriculum_step", "difficulty_step"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(
                    f"{where}: schedule_config.{name} must be a positive int, got {value!r}. "
                    "Example: {'total_curriculum_step': 1000, 'difficulty_step': 8}."
                )
        if self.schedule_type == "fixed_root":
            k = self.root_degree
            if isinstance(k, bool) or not isinstance(k, (int, float)) or not k > 0:
                raise ValueError(f"{where}: schedule_config.root_degree must be a number > 0, got {k!r}.")

    def _check_discrete(self) -> None:
        where = "CurriculumSchedule('fixed_discrete')"
        if not self.difficulty or not all(_is_int(d) for d in self.difficulty):
            raise ValueError(
                f"{where}: schedule_config.difficulty must be a non-empty list of ints, got {self.difficulty!r}."
            )
        if len(self.difficulty) != len(self.max_step) + 1 or not all(_is_int(s) for s in self.max_step):
            raise ValueError(
                f"{where}: schedule_config.max_step must list one int step fewer than difficulty "
                f"(got {len(self.max_step)} steps for {len(self.difficulty)} difficulties). "
                "Example: difficulty=[8, 16, 32], max_step=[100, 200]."
            )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, where: str = "CurriculumSchedule") -> CurriculumSchedule:
        """Builds the schedule from DeepSpeed's per-metric dict (``curriculum_metrics.<metric>``).

        Sampler-only keys (``difficulty_type``, ``clustering_type``, ``index_to_*_path``) are accepted and ignored.

        Args:
            config: ``{"min_difficulty", "max_difficulty", "schedule_type", "schedule_config": {...}}``.
            where: Prefix for error messages (e.g. the metric's config path).

        Raises:
            ValueError: For a missing or unknown key (the message names it), or an invalid value.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"{where}: expected a dict, got {type(config).__name__}.")
        unknown = set(config) - _SCHEDULE_KEYS - _SAMPLER_KEYS
        if unknown:
            raise ValueError(
                f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(_SCHEDULE_KEYS | _SAMPLER_KEYS)}."
            )
        missing = [k for k in ("min_difficulty", "max_difficulty", "schedule_type") if k not in config]
        if missing:
            raise ValueError(f"{where}: missing required keys {missing}.")
        sched = dict(config.get("schedule_config") or {})
        unknown = set(sched) - _SCHEDULE_CONFIG_KEYS
        if unknown:
            raise ValueError(
                f"{where}.schedule_config: unknown keys {sorted(unknown)}; allowed: {sorted(_SCHEDULE_CONFIG_KEYS)}."
            )
        try:
            return cls(
                min_difficulty=config["min_difficulty"],
                max_difficulty=config["max_difficulty"],
                schedule_type=config["schedule_type"],
                total_curriculum_step=sched.get("total_curriculum_step"),
                difficulty_step=sched.get("difficulty_step"),
                root_degree=sched.get("root_degree"),
                difficulty=tuple(sched.get("difficulty", ())),
                max_step=tuple(sched.get("max_step", ())),
            )
        except (TypeError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from None


def difficulty_at(schedule: CurriculumSchedule, step: int, custom_fn: CustomDifficultyFn | None = None) -> int:
    """The difficulty of ``schedule`` at ``step``: a pure function. See [Note: schedule formulas (DeepSpeed 0.19.8)].

    Args:
        schedule: The schedule.
        step: The curriculum step (the sampler's is 1-based: its first global batch uses step 1).
        custom_fn: The function of a ``custom`` schedule; ignored otherwise.

    Returns:
        The difficulty (an int).

    Raises:
        RuntimeError: For a ``custom`` schedule without ``custom_fn``.
    """
    kind = schedule.schedule_type
    if kind == "fixed_discrete":
        return _discrete(schedule.difficulty, schedule.max_step, step)
    if kind == "custom":
        if custom_fn is None:
            raise RuntimeError(
                "CurriculumScheduler: schedule_type 'custom' needs a difficulty function; call "
                "set_custom_get_difficulty(fn) (or DeepSpeedDataSampler.set_custom_curriculum_learning_schedule"
                "({metric: fn})) before the first batch is drawn."
            )
        return int(custom_fn(step))
    degree = 1.0 if kind == "fixed_linear" else float(schedule.root_degree)  # type: ignore[arg-type]
    return _root(schedule, step, degree)


def _discrete(difficulty: tuple[int, ...], max_step: tuple[int, ...], step: int) -> int:
    for d, last in zip(difficulty, max_step):
        if step <= last:
            return d
    return difficulty[-1]


def _root(s: CurriculumSchedule, step: int, degree: float) -> int:
    lo, hi = s.min_difficulty, s.max_difficulty
    T, q = s.total_curriculum_step, s.difficulty_step
    if T is None or q is None:
        raise AssertionError(f"{s=}")  # __post_init__ guarantees both
    raw = math.floor((step / T) ** (1.0 / degree) * (hi - lo) + lo)
    d = min(raw - raw % q, hi)
    return max(d, math.ceil(lo / q) * q)


@dataclass
class _SchedulerState:
    current_difficulty: int
    custom_fn: CustomDifficultyFn | None = field(default=None, repr=False)


class CurriculumScheduler:
    """One metric's curriculum difficulty over training, with DeepSpeed's API.

    Args:
        config: DeepSpeed's per-metric dict (``min_difficulty``, ``max_difficulty``, ``schedule_type``,
            ``schedule_config``; sampler keys are ignored) or a `CurriculumSchedule`.

    Raises:
        ValueError, TypeError: For an invalid config (see `CurriculumSchedule`).
    """

    schedule: CurriculumSchedule

    def __init__(self, config: Mapping[str, Any] | CurriculumSchedule) -> None:
        self.schedule = config if isinstance(config, CurriculumSchedule) else CurriculumSchedule.from_dict(config)
        self._state = _SchedulerState(current_difficulty=self.schedule.min_difficulty)

    @property
    def current_difficulty(self) -> int:
        """The difficulty set by the last `update_difficulty` (``min_difficulty`` before the first)."""
        return self._state.current_difficulty

    def get_current_difficulty(self) -> int:
        """DeepSpeed's name for `current_difficulty`."""
        return self._state.current_difficulty

    def set_current_difficulty(self, difficulty: int) -> None:
        """Overrides the current difficulty (DeepSpeed API)."""
        self._state.current_difficulty = int(difficulty)

    def set_custom_get_difficulty(self, fn: CustomDifficultyFn) -> None:
        """Installs the function of a ``custom`` schedule.

        Raises:
            TypeError: If ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(f"CurriculumScheduler.set_custom_get_difficulty: fn must be callable, got {fn!r}.")
        self._state.custom_fn = fn

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at ``global_steps``: pure, no state change (see `difficulty_at`)."""
        return difficulty_at(self.schedule, global_steps, self._state.custom_fn)

    def update_difficulty(self, global_steps: int) -> int:
        """Advances the current difficulty to the schedule's value at ``global_steps`` unless it already reached the
        maximum (sticky), and returns it."""
        if self._state.current_difficulty < self.schedule.max_difficulty:
            self._state.current_difficulty = self.get_difficulty(global_steps)
        return self._state.current_difficulty

    def state_dict(self) -> dict[str, int]:
        """The mutable state: ``{"current_difficulty": int}`` (the custom function is code, not state)."""
        return {"current_difficulty": self._state.current_difficulty}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores `state_dict` output.

        Raises:
            ValueError: If ``current_difficulty`` is missing.
        """
        if "current_difficulty" not in state:
            raise ValueError(f"CurriculumScheduler.load_state_dict: missing 'current_difficulty' in {dict(state)!r}.")
        self._state.current_difficulty = int(state["current_difficulty"])
