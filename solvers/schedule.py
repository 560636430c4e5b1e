"""Schedules and the one simulator every strategy goes through.

A :class:`Schedule` is an ordered list of steps ``("compute", i)`` / ``("free", i)``
(and, for paging strategies such as POET, ``("pageout", i)`` / ``("pagein", i)``),
optionally with the (R, S) matrices of the Checkmate formulation it was decoded from
(Jain et al., "Checkmate: Breaking the Memory Wall with Optimal Tensor
Rematerialization", MLSys 2020): ``R[t, i]`` = node i is computed in stage t,
``S[t, i]`` = node i's output is resident at the start of stage t.

Memory convention (shared by the MILP and the simulator): computing node i allocates its
output while its inputs are still resident; the peak is taken after each compute, before
the frees that follow it. Graph inputs (parameters, user inputs) are outside the budget.

Paging: ``("pageout", i)`` copies the device-resident value i to host memory (unbounded,
outside the budget; the host copy persists and the device copy stays until a ``free``);
``("pagein", i)`` copies it back, allocating its bytes on the device like a compute (the
peak is also taken after it). A page-in is not a recompute. Each transfer of ``b`` bytes
costs ``transfer_time(b)``, reported apart from the compute cost.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import numpy.typing as npt

from solvers.errors import ScheduleError
from solvers.graph import Graph

__all__ = [
    "COMPUTE",
    "FREE",
    "PAGEOUT",
    "PAGEIN",
    "Step",
    "Schedule",
    "SimResult",
    "simulate",
    "validate",
    "schedule_from_rs",
    "schedule_from_order",
    "keep_all_peak",
]

COMPUTE: Literal["compute"] = "compute"
FREE: Literal["free"] = "free"
PAGEOUT: Literal["pageout"] = "pageout"
PAGEIN: Literal["pagein"] = "pagein"
Step = tuple[str, int]

BoolMatrix = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Schedule:
    """An executable plan: the ordered steps, and (R, S) when the strategy has them.

    Attributes:
        steps: ``(("compute", i) | ("free", i), ...)`` with internal node ids.
        R: (T, n) bool, node i computed in stage t; None for strategies without stages.
        S: (T, n) bool, node i resident at the start of stage t; None likewise.
    """

    steps: tuple[Step, ...]
    R: BoolMatrix | None = field(default=None, compare=False, repr=False)
    S: BoolMatrix | None = field(default=None, compare=False, repr=False)

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def computes(self) -> list[int]:
        """The node ids computed, in order (with repeats)."""
        return [i for op, i in self.steps if op == COMPUTE]

    def compute_counts(self, n: int) -> npt.NDArray[np.int64]:
        """How many times each of ``n`` nodes is computed."""
        ids = np.fromiter((i for op, i in self.steps if op == COMPUTE), dtype=np.int64)
        return np.bincount(ids, minlength=n).astype(np.int64)


@dataclass(frozen=True)
class SimResult:
    """What the simulator measured.

    Attributes:
        cost: sum of the cost of every compute step, plus ``save_cost``.
        peak: the largest memory in use right after a compute (bytes).
        peak_step: index into ``steps`` where the peak occurs (-1 for an empty schedule).
        timeline: memory in use after each step, shape (len(steps),).
        compute_counts: times each node was computed, shape (n,).
        resident_end: nodes still resident after the last step.
        transfer_cost: sum of ``transfer_time(bytes)`` over page-outs and page-ins (0.0
            without paging steps or without a ``transfer_time``).
        transfer_bytes: bytes moved between host and device, both directions.
        transfers: number of page-out and page-in steps.
        save_cost: the save costs (:attr:`solvers.graph.Node.save_cost`) of the values
            resident at the first compute of a backward node: what the forward hands to the
            backward.
        boundary: bytes resident right before the first compute of a backward node (what
            the forward hands to the backward, and its outputs; :mod:`solvers.boundary`); the
            bytes resident at the end when no backward node is computed.
    """

    cost: float
    peak: int
    peak_step: int
    timeline: npt.NDArray[np.int64]
    compute_counts: npt.NDArray[np.int64]
    resident_end: frozenset[int]
    transfer_cost: float = 0.0
    transfer_bytes: int = 0
    transfers: int = 0
    save_cost: float = 0.0
    boundary: int = 0

    @property
    def recomputes(self) -> int:
        """Number of compute steps beyond the first of each node."""
        return int(np.maximum(self.compute_counts - 1, 0).sum())


def simulate(
    graph: Graph,
    schedule: Schedule | Sequence[Step],
    *,
    transfer_time: Callable[[int], float] | None = None,
) -> SimResult:
    """Replay ``schedule`` on ``graph``; return its cost, peak memory and timeline.

    The cost is the compute steps' costs plus, once, the save costs of the values resident
    when the first backward node is computed (the values the forward hands to the backward).

    Args:
        graph: the graph.
        schedule: a Schedule or a sequence of steps.
        transfer_time: cost of moving that many bytes between host and device (for
            schedules with paging steps); None counts transfers at zero cost.

    Raises:
        ScheduleError: a step computes a node whose input is not resident, computes a node
            that is already resident, frees a node that is not resident, pages out a node
            that is not resident, pages in a node that is resident or not on the host,
            names a node that does not exist, or has an unknown op.
    """
    steps = schedule.steps if isinstance(schedule, Schedule) else tuple(schedule)
    n = graph.n
    mem = graph.mem
    cost = graph.cost
    preds = graph.preds
    resident = np.zeros(n, dtype=bool)
    on_host = np.zeros(n, dtype=bool)
    moved = 0
    moves = 0
    transfer = 0.0
    counts = np.zeros(n, dtype=np.int64)
    timeline = np.empty(len(steps), dtype=np.int64)
    cur = 0
    peak = 0
    peak_step = -1
    total = 0.0
    bwd = graph.backward_mask
    saving = graph.save_cost
    charge = bool(saving.any())
    saved = 0.0
    boundary = -1  # not reached yet
    for s, (op, i) in enumerate(steps):
        if not (0 <= i < n):
            raise ScheduleError(f"step {s} ({op}, {i}) names a node that does not exist (n={n})")
        if op == COMPUTE:
            if resident[i]:
                raise ScheduleError(f"step {s} computes node {_name(graph, i)} which is already resident")
            for p in preds[i]:
                if not resident[p]:
                    raise ScheduleError(
                        f"step {s} computes node {_name(graph, i)} but its input "
                        f"{_name(graph, p)} is not resident"
                    )
            if boundary < 0 and bwd[i]:  # the backward starts: what the forward hands over
                boundary = cur
                if charge:
                    saved = float(saving[resident].sum())
            resident[i] = True
            counts[i] += 1
            cur += int(mem[i])
            total += float(cost[i])
            if cur > peak or peak_step < 0:
                peak, peak_step = cur, s
        elif op == FREE:
            if not resident[i]:
                raise ScheduleError(f"step {s} frees node {_name(graph, i)} which is not resident")
            resident[i] = False
            cur -= int(mem[i])
        elif op == PAGEOUT:
            if not resident[i]:
                raise ScheduleError(f"step {s} pages out node {_name(graph, i)} which is not resident")
            on_host[i] = True
            moved, moves = moved + int(mem[i]), moves + 1
            transfer += transfer_time(int(mem[i])) if transfer_time is not None else 0.0
        elif op == PAGEIN:
            if resident[i]:
                raise ScheduleError(f"step {s} pages in node {_name(graph, i)} which is already resident")
            if not on_host[i]:
                raise ScheduleError(
                    f"step {s} pages in node {_name(graph, i)} which is not on the host; page it out first"
                )
            resident[i] = True
            cur += int(mem[i])
            moved, moves = moved + int(mem[i]), moves + 1
            transfer += transfer_time(int(mem[i])) if transfer_time is not None else 0.0
            if cur > peak or peak_step < 0:
                peak, peak_step = cur, s
        else:
            raise ScheduleError(
                f"step {s} has unknown op {op!r}: expected 'compute', 'free', 'pageout' or 'pagein'"
            )
        timeline[s] = cur
    return SimResult(
        cost=total + saved,
        peak=peak,
        peak_step=peak_step,
        timeline=timeline,
        compute_counts=counts,
        resident_end=frozenset(np.flatnonzero(resident).tolist()),
        transfer_cost=transfer,
        transfer_bytes=moved,
        transfers=moves,
        save_cost=saved,
        boundary=cur if boundary < 0 else boundary,
    )


def validate(
    graph: Graph,
    schedule: Schedule | Sequence[Step],
    budget: int | None = None,
    *,
    transfer_time: Callable[[int], float] | None = None,
) -> SimResult:
    """Simulate and check every rule a runnable plan must satisfy.

    Rules: valid reads (see :func:`simulate`); every node computed at least once;
    non-recomputable nodes computed exactly once (a page-in is not a compute, so a
    non-recomputable value may come back from the host any number of times);
    peak <= ``budget`` when given. ``transfer_time`` is passed to :func:`simulate`.

    Raises:
        ScheduleError: the first rule broken, naming the node or step.
    """
    res = simulate(graph, schedule, transfer_time=transfer_time)
    missing = np.flatnonzero(res.compute_counts == 0)
    if missing.size:
        raise ScheduleError(
            f"the schedule never computes {len(missing)} node(s), e.g. {_name(graph, int(missing[0]))}"
        )
    again = np.flatnonzero((res.compute_counts > 1) & ~graph.recomputable_mask)
    if again.size:
        raise ScheduleError(
            f"non-recomputable node {_name(graph, int(again[0]))} is computed "
            f"{int(res.compute_counts[again[0]])} times"
        )
    if budget is not None and res.peak > budget:
        raise ScheduleError(
            f"peak memory {res.peak:,} bytes exceeds the budget of {budget:,} bytes (at step {res.peak_step})"
        )
    return res


def schedule_from_order(graph: Graph, computes: Iterable[int], keep: Iterable[int] = ()) -> Schedule:
    """Steps for a sequence of computes: each value is freed right after its last read.

    ``computes`` may repeat nodes (recomputation); a value that is recomputed later is
    freed after its last read before that recompute. Values in ``keep`` are never freed.
    A value with no reader at all is freed right after it is computed.
    """
    seq = list(computes)
    keep_set = set(keep)
    preds = graph.preds
    # last read position of each (value, generation): walk backwards.
    m = len(seq)
    free_after: list[list[int]] = [[] for _ in range(m)]
    needed: dict[int, bool] = {}  # value -> read later (before its next compute)
    for pos in range(m - 1, -1, -1):
        i = seq[pos]
        # this compute produces i: if nothing later reads this generation, free right away
        if not needed.get(i, False) and i not in keep_set:
            free_after[pos].append(i)
        needed[i] = False
        for p in preds[i]:
            if not needed.get(p, False):
                needed[p] = True
                if p not in keep_set:
                    free_after[pos].append(p)
    steps: list[Step] = []
    for pos, i in enumerate(seq):
        steps.append((COMPUTE, i))
        steps.extend((FREE, j) for j in sorted(set(free_after[pos])))
    return Schedule(tuple(steps))


def schedule_from_rs(
    graph: Graph,
    R: npt.ArrayLike,
    S: npt.ArrayLike,
    *,
    pagein: npt.ArrayLike | None = None,
    pageout: npt.ArrayLike | None = None,
) -> Schedule:
    """Decode the (R, S) matrices of the Checkmate formulation into steps.

    Stage t computes, in id order, every node i with ``R[t, i]``. After computing k, each
    of k's inputs and k itself is freed if no later compute of stage t reads it and it is
    not kept into stage t+1 (``S[t+1, i] = 0``). Checkpoints that stage t neither reads
    nor keeps are freed at the start of the stage. A node already resident when R asks for
    it is not computed again.

    With paging (POET, Patil et al., ICML 2022): ``pagein[t, i]`` pages i in at the start
    of stage t (after the frees, when the stage reads or keeps it and it is not resident;
    it is then not computed); ``pageout[i]`` pages i out right after its first compute.

    Raises:
        ScheduleError: R and S are inconsistent (a read or a kept value not resident, a
            page-in of a value never paged out).
    """
    Rm = np.asarray(R, dtype=bool)
    Sm = np.asarray(S, dtype=bool)
    n = graph.n
    if Rm.ndim != 2 or Rm.shape[1] != n or Sm.shape != Rm.shape:
        raise ScheduleError(f"R and S must both have shape (T, {n}); got {Rm.shape} and {Sm.shape}")
    T = Rm.shape[0]
    INm = np.zeros_like(Rm) if pagein is None else np.asarray(pagein, dtype=bool)
    OUTv = np.zeros(n, dtype=bool) if pageout is None else np.asarray(pageout, dtype=bool)
    preds = graph.preds
    resident = np.zeros(n, dtype=bool)
    on_host = np.zeros(n, dtype=bool)
    done = np.zeros(n, dtype=bool)
    steps: list[Step] = []
    for t in range(T):
        row = Rm[t]
        keep_next = Sm[t + 1] if t + 1 < T else np.zeros(n, dtype=bool)
        # checkpoints the stage expects must be resident
        lacking = np.flatnonzero(Sm[t] & ~resident)
        if lacking.size:
            raise ScheduleError(
                f"stage {t}: S keeps node {_name(graph, int(lacking[0]))} which is not resident"
            )
        incoming = INm[t] & ~resident
        comp: list[int] = np.flatnonzero(row & ~resident & ~incoming).tolist()
        # last reader of each value within this stage
        last_read = np.full(n, -1, dtype=np.int64)
        for k in comp:
            for p in preds[k]:
                last_read[p] = k
        # drop checkpoints that this stage neither reads nor keeps
        for i in np.flatnonzero(resident & (last_read < 0) & ~keep_next).tolist():
            steps.append((FREE, i))
            resident[i] = False
        for i in np.flatnonzero(incoming & ((last_read >= 0) | keep_next)).tolist():
            if not on_host[i]:
                raise ScheduleError(f"stage {t}: pages in {_name(graph, i)} which was never paged out")
            steps.append((PAGEIN, i))
            resident[i] = True
        for k in comp:
            for p in preds[k]:
                if not resident[p]:
                    raise ScheduleError(
                        f"stage {t}: computing {_name(graph, k)} reads {_name(graph, p)}, "
                        "which is neither kept nor recomputed"
                    )
            steps.append((COMPUTE, k))
            resident[k] = True
            if OUTv[k] and not done[k]:
                steps.append((PAGEOUT, k))
                on_host[k] = True
            done[k] = True
            for j in (*preds[k], k):
                if resident[j] and last_read[j] <= k and not keep_next[j]:
                    steps.append((FREE, j))
                    resident[j] = False
    return Schedule(tuple(steps), R=Rm.copy(), S=Sm.copy())


def keep_all_peak(graph: Graph) -> int:
    """Peak memory of computing every node once in id order, freeing each output right
    after its last consumer (no rematerialization): the reference for budget fractions."""
    return simulate(graph, schedule_from_order(graph, range(graph.n))).peak


def _name(graph: Graph, i: int) -> str:
    nd = graph.nodes[i]
    return f"{nd.ext!r} ({nd.name})" if nd.name != str(nd.ext) else repr(nd.ext)
