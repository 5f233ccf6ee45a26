"""Pipeline schedules as data: an action IR, generators, a lowering pass, a checker/simulator and a timing model.

Naming: a *rank* is one process of a pipeline group (``P`` of them); a *stage* is one model chunk (``S = P * v``
stages with ``v`` virtual chunks per rank; stage ``s`` lives on rank ``s % P`` in the ``"loop"`` placement, and on
rank ``s`` or ``2P - 1 - s`` in the ``"v"`` placement of ``zbv``); a *micro-batch* is ``m`` in ``[0, M)``.

[Note: schedules are data]
A schedule is a frozen ``Schedule``: per rank, a tuple of ``Action``s (``0F3`` = stage 0 forwards micro-batch 3,
``1B2`` = stage 1 backwards micro-batch 2, ``1RECV_F3`` = stage 1 receives the activation of micro-batch 3, ...).
Generators (``gpipe``, ``one_f_one_b``, ``interleaved_one_f_one_b``, ``zb_h1``, ``zbv``, ``inference``) emit
compute actions only; the pure lowering pass ``add_send_recv`` inserts the transfers (a send right after the compute
that produced it, a receive right before the compute that needs it or earlier, in the sender's order; none between
stages on the same rank). ``simulate`` then runs the lowered program abstractly with the executor's communication
semantics and raises before anything touches a process group if a micro-batch is missing or duplicated, an order is
illegal, sends and receives do not pair up, or the program deadlocks. The executor (``_executor.py``) only
interprets actions; it never decides what runs next.

[Note: split backward]
A ``W`` action (``1W2``) computes the weight gradients of stage 1 for micro-batch 2. Its presence splits that
backward: the ``B`` of the same stage and micro-batch then computes only the gradient of the stage input (what the
previous stage waits for) and ``W``, which nothing downstream waits for, may run later to fill idle time. Without a
``W`` a ``B`` is the whole backward, as in 1F1B. The optimizer step follows the whole program, so it always comes
after the last ``W``. How a backward is split inside one stage is the executor's business (``_backward.py``).

[Note: zero-bubble schedules]
``zb_h1`` (ZB-H1 of Qi et al., 2023) keeps 1F1B's order of forwards and input backwards and defers weight
gradients: on rank ``r`` the ``W`` of micro-batch ``j`` runs right after the ``B`` of micro-batch ``j + r``, the rest
after the last ``B``. With unit costs F = B = W the idle time per rank drops from 1F1B's ``3 (P - 1)`` to ``P - 1``
units (a third) when ``M >= P``. Each rank then holds at most ``min(P, M)`` micro-batches of activations (until their
``W``): 1F1B's peak (that of rank 0), reached on every rank instead of only the first. ``zbv`` places two chunks per
rank in a V (rank ``r`` holds stages ``r`` and ``2P - 1 - r``, so the first and last stage share rank 0 and the
turn at rank ``P - 1`` needs no transfer). With ``M >= 2P`` it runs the phased order of [Note: the phased V order]
(DualPipeV's: whole backwards in the steady state, split ones where a deferred ``W`` fills the drain; 2P + 1 chunk
activations per rank, one chunk above 1F1B's first rank). With fewer micro-batches it orders the actions with a list
scheduler over chunk costs (``ActionCosts``; the first stage's ``B`` free and its ``W`` the whole backward, see
[Note: the first stage's split backward]): when a rank is free it runs a ready ``B`` (the lowest micro-batch, the
later stage first, every backward split), else the forward of its deepest chunk that is ready, within 1F1B's
activation peak of ``2P`` chunk activations (a chunk-0 forward leaves one slot for chunk 1, so a full rank never
blocks the V's turn), else the oldest pending ``W``. Simulated bubble at unit costs (1F1B / ZB-H1 / ZBV phased /
the list order at the same size): P = 2, M = 8: 0.111 / 0.040 / 0.020 / 0.040; P = 4, M = 16: 0.158 / 0.059 / 0.030 /
0.086; P = 8, M = 32: 0.179 / 0.068 / 0.035 / 0.229. ``zbv`` holds two chunks per rank (half the layers per action,
twice the transfers).

[Note: zbv orders by measured costs]
(Below ``M = 2P``, where ``zbv`` uses the list scheduler; the phased order does not depend on costs.) The list
scheduler's order is only as good as the costs it is given. Ordered over unit costs and run where a weight
gradient costs less than an input gradient (the usual case: attention's backward is mostly input-side work), the
order leaves more idle time than 1F1B: the timing model at P = 2, M = 8 with F = 1, B = 1.3, W = 0.7 gives 0.156
(1F1B 0.111), and the same list scheduler ordering over those costs gives 0.073. So ``zbv`` takes the costs
(``ActionCosts``), and the engine measures them (``PipelineConfig(schedule_costs="auto")``, see
[Note: calibrating zbv] in ``_calibrate.py``). ``zb_h1``'s fixed order degrades less (0.062 there) and a list
scheduler does worse than it on one chunk per rank beyond P = 2, so it stays as it is.

[Note: communication model]
Sends are non-blocking (``isend``; completed at the end of the batch) and receives block. Per ordered rank pair the
messages are matched first-in first-out (NCCL's rule; gloo matches by tag, and the executor uses one tag), so the
simulator also checks that every channel's receive order equals its send order: a schedule that passes cannot pair
the wrong tensors or hang on either backend.
"""

from __future__ import annotations

import collections
import csv
import io
import re
from dataclasses import dataclass
from enum import Enum
from typing import Literal

__all__ = [
    "Action",
    "ActionCosts",
    "ActionKind",
    "Placement",
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
    "zb_h1",
    "zbv",
    "zbv_orders_by_costs",
]

Placement = Literal["loop", "v"]


class ScheduleError(RuntimeError):
    """A schedule is incomplete, out of order, has unmatched transfers, or deadlocks."""


class ActionKind(Enum):
    FORWARD = "F"
    BACKWARD = "B"
    """The backward of a stage; only the input gradient when a ``W`` of the same stage and micro-batch exists."""
    WEIGHT = "W"
    """The weight gradients of a split backward; see [Note: split backward]."""
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)
_ACTION_RE = re.compile(r"^(\d+)(F|B|W|SEND_F|RECV_F|SEND_B|RECV_B)(\d+)$")


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
class ActionCosts:
    """Relative durations of one chunk's actions, which ``zbv`` orders by (only their ratios matter); see
    [Note: zbv orders by measured costs]. The first stage's ``B`` is free and its ``W`` costs both (see
    [Note: the first stage's split backward]).

    Raises:
        ValueError: a cost that is not a positive finite number.
    """

    forward: float = 1.0
    backward_input: float = 1.0
    """``B`` of a split backward: the gradient of the chunk's input."""
    backward_weight: float = 1.0
    """``W``: the weight gradients."""

    def __post_init__(self) -> None:
        for name in ("forward", "backward_input", "backward_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"ActionCosts.{name} must be a positive finite number, got {value!r}")

    def of(self, a: Action) -> float:
        """The cost of compute action ``a`` of a split backward."""
        if a.kind is ActionKind.FORWARD:
            return float(self.forward)
        if a.stage == 0:  # see [Note: the first stage's split backward]
            return 0.0 if a.kind is ActionKind.BACKWARD else float(self.backward_input + self.backward_weight)
        return float(self.backward_input if a.kind is ActionKind.BACKWARD else self.backward_weight)


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
    placement: Placement = "loop"
    """Where stages live: ``"loop"`` (stage ``s`` on rank ``s % P``) or ``"v"`` (two chunks per rank, stage ``s`` on
    rank ``s`` for ``s < P`` and on rank ``2P - 1 - s`` after the turn)."""

    def __post_init__(self) -> None:
        if len(self.programs) != self.num_ranks:
            raise ValueError(f"Schedule {self.name}: {len(self.programs)} programs for {self.num_ranks} ranks")
        if self.num_stages % self.num_ranks:
            raise ValueError(
                f"Schedule {self.name}: {self.num_stages} stages are not a multiple of {self.num_ranks} ranks"
            )
        if self.placement not in ("loop", "v"):
            raise ValueError(f"Schedule {self.name}: placement must be 'loop' or 'v', got {self.placement!r}")
        if self.placement == "v" and self.num_stages != 2 * self.num_ranks:
            raise ValueError(
                f"Schedule {self.name}: the 'v' placement needs 2 stages per rank, got {self.num_stages} stages"
            )

    @property
    def training(self) -> bool:
        return any(a.kind is ActionKind.BACKWARD for prog in self.programs for a in prog)

    @property
    def split(self) -> frozenset[tuple[int, int]]:
        """``(stage, micro-batch)`` pairs whose backward is split by a ``W``; see [Note: split backward]."""
        return frozenset((a.stage, a.microbatch) for prog in self.programs for a in prog if a.kind is ActionKind.WEIGHT)

    def rank_of(self, stage: int) -> int:
        return _rank_of(stage, self.num_ranks, self.placement)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s in range(self.num_stages) if self.rank_of(s) == rank)

    def to_csv(self) -> str:
        """One row per rank, one action per column (the torch.distributed.pipelining CSV convention)."""
        out = io.StringIO()
        writer = csv.writer(out)
        for prog in self.programs:
            writer.writerow([str(a) for a in prog])
        return out.getvalue()

    @staticmethod
    def from_csv(
        text: str, *, name: str, num_stages: int, num_microbatches: int, placement: Placement = "loop"
    ) -> Schedule:
        """Reads ``to_csv`` output (one row per rank). Lowered if any transfer action appears. Blank lines (and lines
        of empty cells) are skipped: every rank runs at least one action, so they never stand for a rank.

        Raises:
            ValueError: a cell is not an action (the message gives its line and column).
        """
        programs: list[tuple[Action, ...]] = []
        reader = csv.reader(io.StringIO(text))
        for row in reader:
            cells = [(col, c) for col, c in enumerate(row, start=1) if c.strip()]
            if cells:
                programs.append(tuple(_parse_cell(c, reader.line_num, col) for col, c in cells))
        lowered = any(a.kind not in _COMPUTE for prog in programs for a in prog)
        return Schedule(name, len(programs), num_stages, num_microbatches, tuple(programs), lowered, placement)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in prog) for r, prog in enumerate(self.programs))


def _parse_cell(cell: str, line: int, column: int) -> Action:
    try:
        return Action.parse(cell)
    except ValueError as e:
        raise ValueError(f"schedule CSV line {line}, column {column}: {e}") from None


def _rank_of(stage: int, num_ranks: int, placement: Placement) -> int:
    if placement == "v":
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


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


def inference(
    num_ranks: int, num_microbatches: int, virtual_stages: int = 1, placement: Placement = "loop"
) -> Schedule:
    """Forward only, stage by stage in micro-batch order (validation and prediction). In the ``"v"`` placement each
    rank runs its forwards in the order they become ready with unit costs (stage + micro-batch), so the turn of
    micro-batch ``m`` does not wait behind the first chunk of every later micro-batch."""
    _check_sizes("inference", num_ranks, num_microbatches)
    S = num_ranks * virtual_stages
    programs = []
    for r in range(num_ranks):
        stages = [s for s in range(S) if _rank_of(s, num_ranks, placement) == r]
        prog = [Action(s, ActionKind.FORWARD, i) for s in stages for i in range(num_microbatches)]
        # chunk-major order would deadlock with v > 1 (rank 0's chunk 1 waits for rank P-1); go micro-batch-major
        if placement == "v":
            prog.sort(key=lambda a: (a.microbatch + a.stage, a.stage))
        elif virtual_stages > 1:
            prog.sort(key=lambda a: (a.microbatch, a.stage))
        programs.append(tuple(prog))
    return Schedule("inference", num_ranks, S, num_microbatches, tuple(programs), placement=placement)


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


def zb_h1(num_ranks: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's forwards and input backwards, each weight gradient deferred by the rank's index; see
    [Note: zero-bubble schedules]."""
    _check_sizes("zb_h1", num_ranks, num_microbatches)
    W = ActionKind.WEIGHT
    programs = []
    for r, prog in enumerate(one_f_one_b(num_ranks, num_microbatches).programs):
        out: list[Action] = []
        for a in prog:
            out.append(a)
            if a.kind is ActionKind.BACKWARD and a.microbatch - r >= 0:
                out.append(Action(r, W, a.microbatch - r))
        out += [Action(r, W, j) for j in range(max(0, num_microbatches - r), num_microbatches)]
        programs.append(tuple(out))
    return Schedule("zb_h1", num_ranks, num_ranks, num_microbatches, tuple(programs))


def zbv(num_ranks: int, num_microbatches: int, costs: ActionCosts | None = None) -> Schedule:
    """The V-shaped zero-bubble schedule: two chunks per rank in the ``"v"`` placement. With at least two
    micro-batches per stage pair (``M >= 2P``) the phased order of [Note: the phased V order] (costs do not change
    it); with fewer, a list scheduler over chunk costs (unit costs when None). See [Note: zero-bubble schedules] and
    [Note: zbv orders by measured costs]."""
    _check_sizes("zbv", num_ranks, num_microbatches)
    if _phased_v_fits(num_ranks, num_microbatches):
        return _phased_v(num_ranks, num_microbatches)
    return _VListScheduler(num_ranks, num_microbatches, costs or ActionCosts()).run()


def zbv_orders_by_costs(num_ranks: int, num_microbatches: int) -> bool:
    """Whether ``zbv``'s order at this size depends on ``ActionCosts`` (the list scheduler's range, ``M < 2P``)."""
    return num_ranks > 1 and not _phased_v_fits(num_ranks, num_microbatches)


def _phased_v_fits(num_ranks: int, num_microbatches: int) -> bool:
    """Whether the phases of [Note: the phased V order] fit: at least two micro-batches per rank (``M >= 2P``)."""
    return num_microbatches >= 2 * num_ranks


# [Note: the phased V order]
# With M >= 2P, ``zbv`` follows the phases of DualPipeV (DeepSeek-V3 report, 2024; the V-shaped variant of DualPipe,
# also in torch.distributed.pipelining), written here over this IR. Rank r holds chunk a = r (down the V) and chunk
# b = 2P - 1 - r (back up). Its program, phase by phase, each phase repeated the number of times given:
#   1. 2 (P - r - 1)       F(a)                       fill the V's descent
#   2. r + 1               F(a) F(b)                   reach the turn
#   3. P - r - 1           B(b) split, W(b), F(b)      the first backwards of b, input gradient first
#   4. M - 2P + r + 1      F(a) B(b) F(b) B(a)         steady state, whole backwards
#   5. P - r - 1           B(b) F(b) B(a)              the last forwards
#   6. r + 1               B(b) B(a)                   drain; from the middle pair on (b's on odd ranks, a's on even
#                                                      ones) each backward is split, its W deferred
#   7. P - r - 1           W, B(a) (split if 6 split)  deferred weight gradients fill the drain's gaps
#   8. the rest of the deferred W.
# Each phase takes the chunk's next micro-batch in order. Compared with the list scheduler below (which splits every
# backward and keeps 1F1B's peak of 2P chunk activations per rank), this order holds one chunk activation more
# (2P + 1) and splits only where a deferred W has a gap to fill: the timing model gives it half the list order's bubble
# at unit costs on two ranks (P = 2, M = 8: 0.020 against 0.040) and far less from four ranks (P = 4, M = 16: 0.030
# against 0.086; P = 8, M = 32: 0.035 against 0.229, where the list order is behind 1F1B). Whole backwards matter on
# hardware where a split one costs more than the whole (on the 2-core CPU machine of the benchmark, B + W of two GPT
# blocks took 1.02-1.17x their plain backward over several runs: the retained graph's memory goes cold between B and
# W). Below M = 2P the phases do not fit (phase 4 would repeat a negative number of times) and the list scheduler
# orders.
def _phased_v(num_ranks: int, num_microbatches: int) -> Schedule:
    P, M = num_ranks, num_microbatches
    programs = []
    for r in range(P):
        a, b = r, 2 * P - 1 - r
        prog: list[Action] = []
        next_mb: collections.Counter[tuple[int, ActionKind]] = collections.Counter()
        deferred: list[Action] = []

        def run(stage: int, kind: ActionKind, split: bool = False) -> None:
            mb = next_mb[(stage, kind)]
            next_mb[(stage, kind)] += 1
            prog.append(Action(stage, kind, mb))
            if split:
                deferred.append(Action(stage, ActionKind.WEIGHT, mb))

        def weight() -> None:
            if deferred:
                prog.append(deferred.pop(0))

        F, B = ActionKind.FORWARD, ActionKind.BACKWARD
        for _ in range(2 * (P - r - 1)):
            run(a, F)
        for _ in range(r + 1):
            run(a, F)
            run(b, F)
        for _ in range(P - r - 1):
            run(b, B, split=True)
            weight()
            run(b, F)
        for _ in range(M - 2 * P + r + 1):
            run(a, F)
            run(b, B)
            run(b, F)
            run(a, B)
        for _ in range(P - r - 1):
            run(b, B)
            run(b, F)
            run(a, B)
        split = False
        middle = (r + 1) // 2
        for i in range(r + 1):
            split = split or (i == middle and r % 2 == 1)
            run(b, B, split)
            split = split or (i == middle and r % 2 == 0)
            run(a, B, split)
        for _ in range(P - r - 1):
            weight()
            run(a, B, split)
        while deferred:
            weight()
        programs.append(tuple(prog))
    return Schedule("zbv", P, 2 * P, M, tuple(programs), placement="v")


class _VListScheduler:
    """Event-driven list scheduling of F/B/W over the ``"v"`` placement with given chunk costs. Ranks act in time
    order (the earliest free rank first), so every decision sees only work already finished at that time."""

    def __init__(self, num_ranks: int, num_microbatches: int, costs: ActionCosts) -> None:
        self.costs = costs
        self.P, self.M, self.S = num_ranks, num_microbatches, 2 * num_ranks
        self.limit = 2 * num_ranks  # 1F1B's activation peak, in chunk activations (one chunk is half a rank's layers)
        self.stages = [(r, 2 * num_ranks - 1 - r) for r in range(num_ranks)]
        self.f_end: dict[tuple[int, int], float] = {}
        self.b_end: dict[tuple[int, int], float] = {}
        self.next_f = [0] * self.S
        self.clock = [0.0] * num_ranks
        self.held = [0] * num_ranks  # chunk activations alive (forward done, weight gradient not yet)
        self.pending_w: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
        self.programs: list[list[Action]] = [[] for _ in range(num_ranks)]

    def _done(self, r: int) -> bool:
        return len(self.programs[r]) == 3 * 2 * self.M

    def _choose(self, r: int) -> Action | None:
        t, M = self.clock[r], self.M
        ready_b = [
            (m, -s)
            for s in self.stages[r]
            for m in range(M)
            if self.f_end.get((s, m), t + 1) <= t
            and (s, m) not in self.b_end
            and (s == self.S - 1 or self.b_end.get((s + 1, m), t + 1) <= t)
        ]
        if ready_b:
            m, neg_s = min(ready_b)
            return Action(-neg_s, ActionKind.BACKWARD, m)
        for s in sorted(self.stages[r], reverse=True):  # the deeper chunk first
            m = self.next_f[s]
            reserve = 1 if s < self.P else 0  # keep a slot for the chunk after the turn
            ready = s == 0 or self.f_end.get((s - 1, m), t + 1) <= t
            if m < M and ready and self.held[r] + reserve < self.limit:
                return Action(s, ActionKind.FORWARD, m)
        if self.pending_w[r]:
            s, m = self.pending_w[r][0]
            return Action(s, ActionKind.WEIGHT, m)
        return None

    def _apply(self, r: int, a: Action) -> None:
        key, end = (a.stage, a.microbatch), self.clock[r] + self.costs.of(a)
        if a.kind is ActionKind.FORWARD:
            self.f_end[key] = end
            self.next_f[a.stage] += 1
            self.held[r] += 1
        elif a.kind is ActionKind.BACKWARD:
            self.b_end[key] = end
            self.pending_w[r].append(key)
        else:
            self.pending_w[r].pop(0)
            self.held[r] -= 1
        self.clock[r] = end
        self.programs[r].append(a)

    def run(self) -> Schedule:
        while True:
            order = sorted((r for r in range(self.P) if not self._done(r)), key=lambda r: (self.clock[r], r))
            if not order:
                break
            for r in order:
                a = self._choose(r)
                if a is not None:
                    self._apply(r, a)
                    break
            else:  # nobody can act at its clock: the earliest rank waits for the next finish or rank
                r = order[0]
                later = [e for e in (*self.f_end.values(), *self.b_end.values()) if e > self.clock[r]]
                later += [self.clock[q] for q in order if self.clock[q] > self.clock[r]]
                if not later:
                    raise AssertionError(f"zbv list scheduler stuck: P={self.P}, M={self.M}, rank {r}")
                self.clock[r] = min(later)
        programs = tuple(tuple(p) for p in self.programs)
        return Schedule("zbv", self.P, self.S, self.M, programs, placement="v")


SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv", "inference")
"""Names ``build_schedule`` knows."""


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    placement: Placement = "loop",
    costs: ActionCosts | None = None,
) -> Schedule:
    """The lowered, simulated schedule called ``name`` (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zb_h1``,
    ``zbv``, ``inference``). ``zbv`` has two chunks per rank in the ``"v"`` placement and is ordered by ``costs``
    (unit costs when None; the other schedules' orders do not depend on costs); ``placement`` only matters for
    ``inference``, which must match the training schedule's.

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
    elif name == "zb_h1":
        sched = zb_h1(num_ranks, num_microbatches)
    elif name == "zbv":
        sched = zbv(num_ranks, num_microbatches, costs)
    elif name == "inference":
        sched = inference(num_ranks, num_microbatches, virtual_stages, placement)
    else:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(repr(n) for n in SCHEDULES)}")
    if name in ("gpipe", "1f1b", "zb_h1") and virtual_stages != 1:
        raise ValueError(
            f"schedule {name!r} runs one chunk per rank; use 'interleaved_1f1b' for virtual_stages={virtual_stages}"
        )
    if name == "zbv" and virtual_stages != 2:
        raise ValueError(f"schedule 'zbv' runs two chunks per rank (a V); got virtual_stages={virtual_stages}")
    lowered = add_send_recv(sched)
    simulate(lowered)
    return lowered


# ---------------------------------------------------------------------------------------------------- lowering
def _transfer_source(a: Action, num_stages: int) -> int | None:
    """The stage whose output ``a`` consumes from elsewhere (None: a weight gradient, or the pipeline's end)."""
    if a.kind is ActionKind.FORWARD:
        return a.stage - 1 if a.stage > 0 else None
    if a.kind is ActionKind.BACKWARD:
        return a.stage + 1 if a.stage < num_stages - 1 else None
    return None


def add_send_recv(schedule: Schedule) -> Schedule:
    """Inserts transfers. Pure.

    A send goes right after the compute that produced a value for another rank (``SEND_F`` after a forward,
    ``SEND_B`` after a backward). A receive goes right before the compute that needs it, preceded by the receives of
    every message the same peer sent earlier that this rank has not received yet: messages between two ranks are
    received in the order they were sent (see [Note: communication model]) even when this rank consumes them in
    another order, which can happen with two chunks per rank. Receiving early never waits longer than the compute
    that needs the later message would anyway."""
    if schedule.lowered:
        return schedule
    S, rank_of = schedule.num_stages, schedule.rank_of
    sends: list[list[Action]] = []
    for r, prog in enumerate(schedule.programs):
        out: list[Action] = []
        for a in prog:
            if a.kind not in _COMPUTE:
                raise ScheduleError(f"rank {r}: unlowered schedule {schedule.name} already holds transfer {a}")
            out.append(a)
            if a.kind is ActionKind.WEIGHT:
                continue
            fwd = a.kind is ActionKind.FORWARD
            dst = a.stage + 1 if fwd else a.stage - 1
            if 0 <= dst < S and rank_of(dst) != r:
                out.append(Action(a.stage, ActionKind.SEND_F if fwd else ActionKind.SEND_B, a.microbatch))
        sends.append(out)
    channel: dict[tuple[int, int], list[Action]] = {}  # (src rank, dst rank) -> the receives, in send order
    for q, sent in enumerate(sends):
        for a in sent:
            if a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                fwd = a.kind is ActionKind.SEND_F
                consumer = a.stage + 1 if fwd else a.stage - 1
                recv = Action(consumer, ActionKind.RECV_F if fwd else ActionKind.RECV_B, a.microbatch)
                channel.setdefault((q, rank_of(consumer)), []).append(recv)
    programs = []
    for r, sent in enumerate(sends):
        lowered: list[Action] = []
        taken = {key: 0 for key in channel if key[1] == r}
        for a in sent:
            src = _transfer_source(a, S) if a.kind in _COMPUTE else None
            if src is not None and rank_of(src) != r:
                queue = channel.get((rank_of(src), r), [])
                want = Action(
                    a.stage, ActionKind.RECV_F if a.kind is ActionKind.FORWARD else ActionKind.RECV_B, a.microbatch
                )
                if want not in queue[taken.get((rank_of(src), r), 0) :]:
                    if want not in queue:
                        raise ScheduleError(f"{schedule.name}: rank {r} runs {a} but no rank sends its input")
                else:
                    key = (rank_of(src), r)
                    upto = queue.index(want, taken[key])
                    lowered += queue[taken[key] : upto + 1]
                    taken[key] = upto + 1
            lowered.append(a)
        programs.append(tuple(lowered))
    return Schedule(
        schedule.name,
        schedule.num_ranks,
        S,
        schedule.num_microbatches,
        tuple(programs),
        lowered=True,
        placement=schedule.placement,
    )


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
                raise ScheduleError(
                    f"{schedule.name}: rank {r} runs {a} with a micro-batch outside [0, {schedule.num_microbatches})"
                )
            if a.kind in _COMPUTE:
                seen.setdefault((a.stage, a.kind), []).append(a.microbatch)
        kinds = (ActionKind.FORWARD, ActionKind.BACKWARD) if training else (ActionKind.FORWARD,)
        for s in schedule.stages_of(r):
            for kind in kinds:
                got = sorted(seen.get((s, kind), []))
                if got != list(range(schedule.num_microbatches)):
                    raise ScheduleError(
                        f"{schedule.name}: stage {s} on rank {r} runs {kind.name} for micro-batches {got}; "
                        f"expected each of 0..{schedule.num_microbatches - 1} exactly once"
                    )
            weights = sorted(seen.get((s, ActionKind.WEIGHT), []))
            if len(set(weights)) != len(weights) or (weights and not training):
                raise ScheduleError(
                    f"{schedule.name}: stage {s} on rank {r} runs WEIGHT for micro-batches {weights}; each at most once, "
                    "and only in a training schedule"
                )


def simulate(schedule: Schedule) -> None:
    """Runs a lowered schedule abstractly and raises ``ScheduleError`` on any defect. See [Note: schedules are data]
    and [Note: communication model]. Checks: coverage (each micro-batch forwarded and, when training, backwarded
    exactly once per stage on its rank, weight gradients at most once); a forward runs after its input exists, a
    backward after its own forward and its output gradient, a weight gradient after its backward; receives pair with
    sends of the same kind/stage/micro-batch in FIFO order per rank pair; no transfer is left unmatched; no
    deadlock."""
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
        if a.kind is ActionKind.WEIGHT:
            return True if (s, ActionKind.BACKWARD, m) in done else f"weight gradient {a} before its backward"
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
# [Note: the first stage's split backward]
# The first stage's inputs are data, which need no gradient, so its ``B`` has nothing to compute and its ``W`` is the
# whole backward (see ``_backward.py``). The timing model and the ``zbv`` list scheduler cost it that way: the first
# stage's backward is all filler, which nothing downstream waits for.
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

    def peak_activations(self) -> list[int]:
        """Per rank, the most micro-batch activations alive at once (a forward's live from its start until its
        backward ends, or its weight gradient ends when the backward is split), in chunks of ``1 / v`` of a rank."""
        peaks = []
        for prog in self.spans:
            split = {(a.stage, a.microbatch) for a, _, _ in prog if a.kind is ActionKind.WEIGHT}
            live = peak = 0
            for a, _, _ in prog:
                frees = ActionKind.WEIGHT if (a.stage, a.microbatch) in split else ActionKind.BACKWARD
                live += 1 if a.kind is ActionKind.FORWARD else (-1 if a.kind is frees else 0)
                peak = max(peak, live)
            peaks.append(peak)
        return peaks


def timeline(
    schedule: Schedule, forward_cost: float = 1.0, backward_cost: float = 2.0, weight_cost: float | None = None
) -> Timeline:
    """Event-driven timing of a lowered schedule: each action starts when its rank is free and its input exists.
    Costs are per rank's worth of layers (a chunk costs ``1 / v`` of them). A split backward costs
    ``backward_cost - weight_cost`` for its ``B`` and ``weight_cost`` (default half the backward) for its ``W``, except
    on the first stage, whose ``B`` is free and whose ``W`` is the whole backward (see
    [Note: the first stage's split backward])."""
    lowered = add_send_recv(schedule)
    simulate(lowered)
    S, P = lowered.num_stages, lowered.num_ranks
    v = S // P
    w_cost = backward_cost / 2 if weight_cost is None else weight_cost
    split = lowered.split
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
                deps = _inputs_of(a, S)
                if any(d not in finish for d in deps):
                    break
                start = max([clock[r]] + [finish[d] for d in deps])
                if a.kind is ActionKind.FORWARD:
                    cost = forward_cost
                elif (a.stage, a.microbatch) not in split:
                    cost = backward_cost
                elif a.stage == 0:  # see [Note: the first stage's split backward]
                    cost = 0.0 if a.kind is ActionKind.BACKWARD else backward_cost
                else:
                    cost = w_cost if a.kind is ActionKind.WEIGHT else backward_cost - w_cost
                end = start + cost / v
                finish[(a.stage, a.kind, a.microbatch)] = clock[r] = end
                spans[r].append((a, start, end))
                pcs[r] += 1
    return Timeline(tuple(tuple(s) for s in spans), max(clock))


def _inputs_of(a: Action, num_stages: int) -> list[tuple[int, ActionKind, int]]:
    """What a compute action waits for: the previous stage's forward, the next stage's backward (and its own
    forward), or its own backward (a weight gradient)."""
    s, m = a.stage, a.microbatch
    if a.kind is ActionKind.FORWARD:
        return [(s - 1, ActionKind.FORWARD, m)] if s > 0 else []
    if a.kind is ActionKind.WEIGHT:
        return [(s, ActionKind.BACKWARD, m)]
    own = (s, ActionKind.FORWARD, m)
    return [own] if s == num_stages - 1 else [own, (s + 1, ActionKind.BACKWARD, m)]
