"""Pipeline schedules as data: an action IR, generators, a lowering pass, a checker/simulator and a timing model.

Naming: a *rank* is one process of a pipeline group (``P`` of them); a *stage* is one model chunk (``S = P * v``
stages with ``v`` virtual chunks per rank; stage ``s`` lives on rank ``s % P``); a *micro-batch* is ``m`` in
``[0, M)``.

[Note: schedules are data]
A schedule is a frozen ``Schedule``: per rank, a tuple of ``Action``s (``0F3`` = stage 0 forwards micro-batch 3,
``1B2`` = stage 1 backwards micro-batch 2, ``1RECV_F3`` = stage 1 receives the activation of micro-batch 3, ...).
Generators (``gpipe``, ``one_f_one_b``, ``interleaved_one_f_one_b``, ``inference``) emit compute actions only; the
pure lowering pass ``add_send_recv`` inserts the transfers (a receive right before the compute that needs it, a send
right after the compute that produced it; none between stages on the same rank). ``simulate`` then runs the lowered
program abstractly with the executor's communication semantics and raises before anything touches a process group
if a micro-batch is missing or duplicated, an order is illegal, sends and receives do not pair up, or the program
deadlocks. The executor (``_executor.py``) only interprets actions; it never decides what runs next.

[Note: communication model]
Sends are non-blocking (``isend``; completed at the end of the batch) and receives block. Per ordered rank pair the
messages are matched first-in first-out (NCCL's rule; gloo matches by tag, and the executor uses one tag), so the
simulator also checks that every channel's receive order equals its send order: a schedule that passes cannot pair
the wrong tensors or hang on either backend.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "add_send_recv",
    "build_schedule",
    "gpipe",
    "inference",
    "interleaved_one_f_one_b",
    "one_f_one_b",
    "simulate",
    "timeline",
]


class ScheduleError(RuntimeError):
    """A schedule is incomplete, out of order, has unmatched transfers, or deadlocks."""


class ActionKind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_ACTION_RE = re.compile(r"^(\d+)(F|B|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")


@dataclass(frozen=True)
class Action:
    """One step of one rank's program: ``kind`` of work on ``stage`` for ``microbatch``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``str(action)``, e.g. ``Action.parse("1RECV_F3")``.

        Raises:
            ValueError: ``text`` is not of the form ``<stage><kind><microbatch>``.
        """
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse pipeline action {text!r}; expected e.g. '0F1', '2B0', '1SEND_F3'")
        return Action(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


@dataclass(frozen=True)
class Schedule:
    """The order of work of every rank of one pipeline group for one batch."""

    name: str
    """Generator name (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``inference``)."""
    num_ranks: int
    """Pipeline ranks ``P``."""
    num_stages: int
    """Model chunks ``S`` (``P`` times the virtual chunks per rank); stage ``s`` runs on rank ``s % P``."""
    num_microbatches: int
    """Micro-batches ``M`` per batch."""
    programs: tuple[tuple[Action, ...], ...]
    """Per rank, its actions in execution order."""
    lowered: bool = False
    """Whether transfers have been inserted (``add_send_recv``)."""

    def __post_init__(self) -> None:
        if len(self.programs) != self.num_ranks:
            raise ValueError(f"Schedule {self.name}: {len(self.programs)} programs for {self.num_ranks} ranks")
        if self.num_stages % self.num_ranks:
            raise ValueError(f"Schedule {self.name}: {self.num_stages} stages are not a multiple of {self.num_ranks} ranks")

    @property
    def training(self) -> bool:
        return any(a.kind is ActionKind.BACKWARD for prog in self.programs for a in prog)

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(range(rank, self.num_stages, self.num_ranks))

    def to_csv(self) -> str:
        """One row per rank, one action per column (the torch.distributed.pipelining CSV convention)."""
        out = io.StringIO()
        writer = csv.writer(out)
        for prog in self.programs:
            writer.writerow([str(a) for a in prog])
        return out.getvalue()

    @staticmethod
    def from_csv(text: str, *, name: str, num_stages: int, num_microbatches: int) -> Schedule:
        """Reads ``to_csv`` output (one row per rank). Lowered if any transfer action appears."""
        rows = [row for row in csv.reader(io.StringIO(text)) if row is not None]
        programs = tuple(tuple(Action.parse(c) for c in row if c.strip()) for row in rows)
        lowered = any(a.kind not in _COMPUTE for prog in programs for a in prog)
        return Schedule(name, len(programs), num_stages, num_microbatches, programs, lowered)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in prog) for r, prog in enumerate(self.programs))


# ---------------------------------------------------------------------------------------------------- generators
def _check_sizes(name: str, num_ranks: int, num_microbatches: int) -> None:
    if num_ranks < 1:
        raise ValueError(f"{name}: number of pipeline ranks must be >= 1, got {num_ranks}")
    if num_microbatches < 1:
        raise ValueError(f"{name}: number of micro-batches must be >= 1, got {num_microbatches}")


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
    """GPipe: every stage forwards all micro-batches, then backwards all of them (M activations in flight)."""
    _check_sizes("gpipe", num_ranks, num_microbatches)
    m = range(num_microbatches)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    programs = tuple(tuple([Action(r, F, i) for i in m] + [Action(r, B, i) for i in m]) for r in range(num_ranks))
    return Schedule("gpipe", num_ranks, num_ranks, num_microbatches, programs)


def inference(num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Forward only, stage by stage in micro-batch order (validation and prediction)."""
    _check_sizes("inference", num_ranks, num_microbatches)
    S = num_ranks * virtual_stages
    programs = []
    for r in range(num_ranks):
        prog = [Action(s, ActionKind.FORWARD, i) for s in range(r, S, num_ranks) for i in range(num_microbatches)]
        # chunk-major order would deadlock with v > 1 (rank 0's chunk 1 waits for rank P-1); go micro-batch-major
        if virtual_stages > 1:
            prog.sort(key=lambda a: (a.microbatch, a.stage))
        programs.append(tuple(prog))
    return Schedule("inference", num_ranks, S, num_microbatches, tuple(programs))


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``P - r - 1`` warm-up forwards on rank ``r``, then alternate one forward and one
    backward, then drain the backwards. At most ``P - r`` activations are in flight on rank ``r``."""
    _check_sizes("1f1b", num_ranks, num_microbatches)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    M = num_microbatches
    programs = []
    for r in range(num_ranks):
        warmup = min(num_ranks - r - 1, M)
        prog = [Action(r, F, i) for i in range(warmup)]
        for i in range(M - warmup):
            prog += [Action(r, F, warmup + i), Action(r, B, i)]
        prog += [Action(r, B, i) for i in range(M - warmup, M)]
        programs.append(tuple(prog))
    return Schedule("1f1b", num_ranks, num_ranks, M, tuple(programs))


def interleaved_one_f_one_b(num_ranks: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): ``v`` chunks per rank, micro-batches in groups of ``P``.

    Rank ``r`` visits its chunks in rounds of ``P`` micro-batches (forward chunk 0 for the first ``P`` micro-batches,
    then chunk 1, ...), with ``2 (P - r - 1) + (v - 1) P`` warm-up forwards, then one forward / one backward, then the
    remaining backwards (chunks in reverse order). The bubble shrinks by ``v``.

    Raises:
        ValueError: ``virtual_stages < 1``, or ``num_microbatches`` is not a multiple of ``num_ranks`` (the rounds of
            ``P`` micro-batches need it; pick ``micro_batches`` as a multiple of the stage count).
    """
    _check_sizes("interleaved_1f1b", num_ranks, num_microbatches)
    if virtual_stages < 1:
        raise ValueError(f"interleaved_1f1b: virtual_stages must be >= 1, got {virtual_stages}")
    if virtual_stages == 1:
        return one_f_one_b(num_ranks, num_microbatches)
    P, M, v = num_ranks, num_microbatches, virtual_stages
    if M % P:
        raise ValueError(
            f"interleaved_1f1b needs the micro-batch count to be a multiple of the pipeline ranks: got "
            f"micro_batches={M} with {P} ranks; use micro_batches={((M + P - 1) // P) * P}"
        )
    total = M * v
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD

    def key(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // P) % v
        return (chunk if forward else v - 1 - chunk), (k // (P * v)) * P + k % P

    programs = []
    for r in range(P):
        warmup = min((P - r - 1) * 2 + (v - 1) * P, total)
        prog = []
        for k in range(warmup):
            c, mb = key(k, True)
            prog.append(Action(c * P + r, F, mb))
        for i in range(total - warmup):
            c, mb = key(warmup + i, True)
            prog.append(Action(c * P + r, F, mb))
            c, mb = key(i, False)
            prog.append(Action(c * P + r, B, mb))
        for k in range(total - warmup, total):
            c, mb = key(k, False)
            prog.append(Action(c * P + r, B, mb))
        programs.append(tuple(prog))
    return Schedule("interleaved_1f1b", P, P * v, M, tuple(programs))


def build_schedule(name: str, num_ranks: int, num_microbatches: int, virtual_stages: int = 1) -> Schedule:
    """The lowered, simulated schedule called ``name`` (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``inference``).

    Raises:
        ValueError: unknown name or invalid sizes.
        ScheduleError: the generated program fails the simulator (a bug in a generator).
    """
    if name == "gpipe":
        sched = gpipe(num_ranks, num_microbatches)
    elif name == "1f1b":
        sched = one_f_one_b(num_ranks, num_microbatches)
    elif name == "interleaved_1f1b":
        sched = interleaved_one_f_one_b(num_ranks, num_microbatches, virtual_stages)
    elif name == "inference":
        sched = inference(num_ranks, num_microbatches, virtual_stages)
    else:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose 'gpipe', '1f1b', 'interleaved_1f1b' or 'inference'")
    if name in ("gpipe", "1f1b") and virtual_stages != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank; use 'interleaved_1f1b' for virtual_stages={virtual_stages}")
    lowered = add_send_recv(sched)
    simulate(lowered)
    return lowered


# ---------------------------------------------------------------------------------------------------- lowering
def add_send_recv(schedule: Schedule) -> Schedule:
    """Inserts transfers: ``RECV_F`` before a forward whose input stage is on another rank, ``SEND_F`` after a forward
    whose consumer is on another rank, and the mirror ``RECV_B`` / ``SEND_B`` around backwards. Pure."""
    if schedule.lowered:
        return schedule
    S, rank_of = schedule.num_stages, schedule.rank_of
    programs = []
    for r, prog in enumerate(schedule.programs):
        out: list[Action] = []
        for a in prog:
            if a.kind not in _COMPUTE:
                raise ScheduleError(f"rank {r}: unlowered schedule {schedule.name} already holds transfer {a}")
            fwd = a.kind is ActionKind.FORWARD
            src = a.stage - 1 if fwd else a.stage + 1  # where the input (activation or gradient) comes from
            dst = a.stage + 1 if fwd else a.stage - 1
            if 0 <= src < S and rank_of(src) != r:
                out.append(Action(a.stage, ActionKind.RECV_F if fwd else ActionKind.RECV_B, a.microbatch))
            out.append(a)
            if 0 <= dst < S and rank_of(dst) != r:
                out.append(Action(a.stage, ActionKind.SEND_F if fwd else ActionKind.SEND_B, a.microbatch))
        programs.append(tuple(out))
    return Schedule(schedule.name, schedule.num_ranks, S, schedule.num_microbatches, tuple(programs), lowered=True)


# ---------------------------------------------------------------------------------------------------- simulation
def _check_coverage(schedule: Schedule) -> None:
    """Each stage runs every micro-batch's forward (and backward, if training) exactly once, on its own rank."""
    training = schedule.training
    for r, prog in enumerate(schedule.programs):
        seen: dict[tuple[int, ActionKind], list[int]] = {}
        for a in prog:
            if schedule.rank_of(a.stage) != r or not 0 <= a.stage < schedule.num_stages:
                raise ScheduleError(f"{schedule.name}: rank {r} runs {a}, but stage {a.stage} is not on rank {r}")
            if not 0 <= a.microbatch < schedule.num_microbatches:
                raise ScheduleError(f"{schedule.name}: rank {r} runs {a} with a micro-batch outside [0, {schedule.num_microbatches})")
            if a.kind in _COMPUTE:
                seen.setdefault((a.stage, a.kind), []).append(a.microbatch)
        kinds = _COMPUTE if training else (ActionKind.FORWARD,)
        for s in schedule.stages_of(r):
            for kind in kinds:
                got = sorted(seen.get((s, kind), []))
                if got != list(range(schedule.num_microbatches)):
                    raise ScheduleError(
                        f"{schedule.name}: stage {s} on rank {r} runs {kind.name} for micro-batches {got}; "
                        f"expected each of 0..{schedule.num_microbatches - 1} exactly once"
                    )


def simulate(schedule: Schedule) -> None:
    """Runs a lowered schedule abstractly and raises ``ScheduleError`` on any defect. See [Note: schedules are data]
    and [Note: communication model]. Checks: coverage (each micro-batch forwarded and, when training, backwarded
    exactly once per stage on its rank); a forward runs after its input exists, a backward after its own forward and
    its output gradient; receives pair with sends of the same kind/stage/micro-batch in FIFO order per rank pair;
    no transfer is left unmatched; no deadlock."""
    if not schedule.lowered and add_send_recv(schedule).programs != schedule.programs:
        raise ScheduleError(f"simulate() needs a lowered schedule; call add_send_recv({schedule.name}) first")
    _check_coverage(schedule)
    S, P, training = schedule.num_stages, schedule.num_ranks, schedule.training
    done: set[tuple[int, ActionKind, int]] = set()
    arrived: set[tuple[int, ActionKind, int]] = set()  # inputs delivered by a receive: (stage, F|B, mb)
    channels: dict[tuple[int, int], list[Action]] = {}
    pcs = [0] * P

    def ready(r: int, a: Action) -> bool | str:
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.FORWARD:
            if s == 0:
                return True
            local = schedule.rank_of(s - 1) == r
            return (s - 1, ActionKind.FORWARD, m) in done if local else (s, ActionKind.FORWARD, m) in arrived
        if a.kind is ActionKind.BACKWARD:
            if (s, ActionKind.FORWARD, m) not in done:
                return f"backward {a} before its forward"
            if s == S - 1:
                return True
            local = schedule.rank_of(s + 1) == r
            return (s + 1, ActionKind.BACKWARD, m) in done if local else (s, ActionKind.BACKWARD, m) in arrived
        if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            kind = ActionKind.FORWARD if a.kind is ActionKind.SEND_F else ActionKind.BACKWARD
            return True if (s, kind, m) in done else f"{a} sends before its compute ran"
        src_stage = s - 1 if a.kind is ActionKind.RECV_F else s + 1
        queue = channels.get((schedule.rank_of(src_stage), r), [])
        if not queue:
            return False
        want = ActionKind.SEND_F if a.kind is ActionKind.RECV_F else ActionKind.SEND_B
        head = queue[0]
        if head.kind is not want or head.stage != src_stage or head.microbatch != m:
            return f"{a} on rank {r} would receive {head} (first-in first-out order of the rank pair differs)"
        return True

    def step(r: int, a: Action) -> None:
        s, m = a.stage, a.microbatch
        if a.kind in _COMPUTE:
            done.add((s, a.kind, m))
        elif a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
            dst_stage = s + 1 if a.kind is ActionKind.SEND_F else s - 1
            channels.setdefault((r, schedule.rank_of(dst_stage)), []).append(a)
        else:
            src_stage = s - 1 if a.kind is ActionKind.RECV_F else s + 1
            channels[(schedule.rank_of(src_stage), r)].pop(0)
            arrived.add((s, ActionKind.FORWARD if a.kind is ActionKind.RECV_F else ActionKind.BACKWARD, m))

    while any(pcs[r] < len(schedule.programs[r]) for r in range(P)):
        progressed = False
        for r in range(P):
            while pcs[r] < len(schedule.programs[r]):
                a = schedule.programs[r][pcs[r]]
                ok = ready(r, a)
                if isinstance(ok, str):
                    raise ScheduleError(f"{schedule.name}: rank {r}, action #{pcs[r]}: {ok}")
                if not ok:
                    break
                step(r, a)
                pcs[r] += 1
                progressed = True
        if not progressed:
            blocked = {r: str(schedule.programs[r][pcs[r]]) for r in range(P) if pcs[r] < len(schedule.programs[r])}
            raise ScheduleError(f"{schedule.name}: deadlock; blocked ranks and their next action: {blocked}")
    leftover = {k: [str(a) for a in v] for k, v in channels.items() if v}
    if leftover:
        raise ScheduleError(f"{schedule.name}: sends never received (rank pair: actions): {leftover}")
    if training and len([d for d in done if d[1] is ActionKind.BACKWARD]) != S * schedule.num_microbatches:
        raise AssertionError("coverage check passed but backwards are missing")


# ---------------------------------------------------------------------------------------------------- timing model
@dataclass(frozen=True)
class Timeline:
    """Start and end time of every compute action under a cost model (transfers free)."""

    spans: tuple[tuple[tuple[Action, float, float], ...], ...]
    """Per rank, ``(action, start, end)`` for each compute action."""
    makespan: float
    """End of the last action."""

    @property
    def bubble_fraction(self) -> float:
        """Idle share of ``P * makespan`` (the pipeline bubble): ``(P-1)/(M+P-1)`` for 1F1B/GPipe with B = 2F."""
        busy = sum(end - start for prog in self.spans for _, start, end in prog)
        return 1.0 - busy / (len(self.spans) * self.makespan) if self.makespan else 0.0


def timeline(schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0) -> Timeline:
    """Event-driven timing of a lowered schedule: each action starts when its rank is free and its input exists."""
    lowered = add_send_recv(schedule)
    simulate(lowered)
    S, P = lowered.num_stages, lowered.num_ranks
    v = S // P
    f, b = forward_cost / v, backward_cost / v  # a chunk holds 1/v of a rank's layers
    finish: dict[tuple[int, ActionKind, int], float] = {}
    clock = [0.0] * P
    pcs = [0] * P
    spans: list[list[tuple[Action, float, float]]] = [[] for _ in range(P)]
    while any(pcs[r] < len(lowered.programs[r]) for r in range(P)):
        for r in range(P):
            while pcs[r] < len(lowered.programs[r]):
                a = lowered.programs[r][pcs[r]]
                if a.kind not in _COMPUTE:
                    pcs[r] += 1
                    continue
                dep = _input_of(a, S)
                if dep is not None and dep not in finish:
                    break
                start = max(clock[r], finish.get(dep, 0.0) if dep else 0.0)
                if a.kind is ActionKind.BACKWARD:
                    start = max(start, finish[(a.stage, ActionKind.FORWARD, a.microbatch)])
                end = start + (f if a.kind is ActionKind.FORWARD else b)
                finish[(a.stage, a.kind, a.microbatch)] = clock[r] = end
                spans[r].append((a, start, end))
                pcs[r] += 1
    return Timeline(tuple(tuple(s) for s in spans), max(clock))


def _input_of(a: Action, num_stages: int) -> tuple[int, ActionKind, int] | None:
    if a.kind is ActionKind.FORWARD:
        return (a.stage - 1, ActionKind.FORWARD, a.microbatch) if a.stage > 0 else None
    if a.stage == num_stages - 1:
        return (a.stage, ActionKind.FORWARD, a.microbatch)
    return (a.stage + 1, ActionKind.BACKWARD, a.microbatch)
