"""Polishing a schedule: keep a value instead of recomputing it, where the budget allows.

Every strategy's schedule is a sequence of computes and frees. Its heuristics (DTR's
eviction, the greedy segmentations, the ladder of lower budgets in ``auto``) and LP
rounding free values that could have stayed resident within the budget, and recompute
them later: a heuristic plans under the memory it has at each step, not the slack the
finished schedule leaves, and a schedule planned for fewer bytes than the budget leaves
slack everywhere. This pass removes such recomputes greedily.

Its one move merges two successive *instances* of a value (a compute and the free that
ends it): the free before a recompute and the recompute itself are dropped, so the value
stays resident in between, which costs its bytes over that interval and saves the
recompute's cost. The recompute's inputs lose a read; an input instance that was itself a
recompute and is left with no reader is dropped with its free (recursively), which only
lowers memory and cost. A merge is taken when the memory after every step of the interval,
plus the value's bytes, stays within the budget; candidates are tried in order of cost saved
per byte-step held (the cheapest memory for the most compute first), in passes until one
changes nothing. First computations are never dropped, so every node still runs, random
and non-recomputable ones exactly once, and the order of what remains is unchanged.

It is the "remat elimination" step that rematerialization planners run after a
heuristic (Kirisame et al., "Dynamic Tensor Rematerialization", ICLR 2021, discuss the same
slack for an online policy); the memory accounting is the one simulator's
(:func:`solvers.schedule.simulate`), tracked incrementally with one array, and the result
is checked by :func:`solvers.schedule.validate` before it replaces the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solvers.errors import ScheduleError, SolverError
from solvers.graph import Graph
from solvers.schedule import COMPUTE, FREE, Schedule, SimResult, simulate, validate

__all__ = ["Polished", "polish"]

#: passes over the candidates at most (a pass after one that merged nothing changes nothing)
MAX_PASSES = 4


@dataclass(frozen=True)
class Polished:
    """What :func:`polish` did.

    Attributes:
        schedule: the polished schedule (the one given when nothing was merged).
        sim: its simulation.
        merged: recomputes replaced by keeping the value resident.
        dropped: recomputes dropped because nothing read them any more.
    """

    schedule: Schedule
    sim: SimResult
    merged: int
    dropped: int


def polish(graph: Graph, schedule: Schedule, budget: int) -> Polished:
    """Remove recomputes from ``schedule`` whose values can stay resident within ``budget``.

    Args:
        graph: the graph ``schedule`` runs.
        schedule: a valid schedule whose peak is within ``budget`` (paging steps: returned
            unchanged).
        budget: bytes the polished schedule's peak may reach.

    Returns:
        A :class:`Polished` whose schedule costs at most what ``schedule`` does and peaks
        within ``budget`` (or at the given schedule's peak, when that was over it), checked
        by the simulator.

    Raises:
        SolverError: the polished schedule broke a rule of the simulator (a bug here; the
            caller keeps the schedule it gave).
    """
    given = simulate(graph, schedule)
    if given.recomputes == 0 or any(op not in (COMPUTE, FREE) for op, _ in schedule.steps):
        return Polished(schedule, given, 0, 0)
    limit = max(int(budget), given.peak)
    work = _Instances(graph, schedule, given.timeline)
    merged = dropped = 0
    for _ in range(MAX_PASSES):
        gained = 0
        for x in work.candidates():
            if work.merge(x, limit):
                gained += 1
        merged += gained
        dropped = work.dropped
        if not gained:
            break
    if not merged:
        return Polished(schedule, given, 0, 0)
    out = Schedule(tuple(step for s, step in enumerate(schedule.steps) if not work.deleted[s]))
    try:
        sim = validate(graph, out, limit)
    except ScheduleError as exc:  # a bug here must not become the user's plan
        raise SolverError(f"polishing produced an invalid schedule: {exc}") from exc
    if sim.cost > given.cost:  # save costs of values now held across the boundary
        return Polished(schedule, given, 0, 0)
    return Polished(out, sim, merged, dropped)


class _Instances:
    """The schedule's value instances (a compute and the free that ends it), their readers,
    and the memory after each step, updated as instances are merged or dropped."""

    def __init__(self, graph: Graph, schedule: Schedule, timeline: np.ndarray) -> None:
        steps = schedule.steps
        n = graph.n
        self.mem = graph.mem.astype(np.int64)
        self.cost = graph.cost
        self.timeline = timeline.astype(np.int64).copy()
        self.deleted = np.zeros(len(steps), dtype=bool)
        self.dropped = 0
        live = [-1] * n  # the instance of each node resident now
        last = [-1] * n  # the latest instance of each node
        node: list[int] = []
        start: list[int] = []
        end: list[int] = []  # -1: resident at the end
        first: list[bool] = []
        prev: list[int] = []  # the node's instance before this one
        nxt: list[int] = []
        reads: list[int] = []  # computes that read the instance
        self.read_by: dict[int, list[int]] = {}  # compute step -> instances it reads
        preds = graph.preds
        for s, (op, i) in enumerate(steps):
            if op == COMPUTE:
                inputs = [live[p] for p in preds[i]]
                for r in inputs:
                    reads[r] += 1
                self.read_by[s] = inputs
                x = len(node)
                node.append(i)
                start.append(s)
                end.append(-1)
                first.append(last[i] < 0)
                prev.append(last[i])
                nxt.append(-1)
                reads.append(0)
                if last[i] >= 0:
                    nxt[last[i]] = x
                live[i] = last[i] = x
            else:
                end[live[i]] = s
                live[i] = -1
        self.node, self.start, self.end, self.first = node, start, end, first
        self.prev, self.next, self.reads = prev, nxt, reads
        self.alive = [True] * len(node)
        self.parent = list(range(len(node)))  # merged instances point at the one they joined

    def find(self, x: int) -> int:
        """The live instance that instance ``x`` was merged into (itself if none)."""
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def candidates(self) -> list[int]:
        """Recompute instances whose previous instance was freed before them, best first:
        the cost saved per byte-step the value would be held."""
        out: list[tuple[float, int]] = []
        for x, v in enumerate(self.node):
            p = self.prev[x]
            if not self.alive[x] or self.first[x] or p < 0 or self.end[p] < 0:
                continue
            held = int(self.mem[v]) * (self.start[x] - self.end[p]) + 1
            out.append((-float(self.cost[v]) / held, x))
        out.sort()
        return [x for _, x in out]

    def merge(self, x: int, limit: int) -> bool:
        """Keep the previous instance of ``x`` resident through ``x``'s life instead of
        recomputing it, when the memory allows; drop the inputs left unread."""
        p = self.prev[x]
        if not self.alive[x] or p < 0 or self.end[p] < 0:
            return False
        a, b = self.end[p], self.start[x]
        nbytes = int(self.mem[self.node[x]])
        if nbytes and int(self.timeline[a:b].max()) + nbytes > limit:
            return False
        self.timeline[a:b] += nbytes
        self.deleted[a] = self.deleted[b] = True
        self.end[p] = self.end[x]
        self.reads[p] += self.reads[x]
        self.alive[x] = False
        self.parent[x] = p
        self.next[p] = self.next[x]
        if self.next[x] >= 0:
            self.prev[self.next[x]] = p
        self._unread(b)
        return True

    def _unread(self, step: int) -> None:
        """The compute at ``step`` was removed: its inputs lose a read, and an input
        instance that was a recompute and is left unread is dropped too (recursively)."""
        pending = list(self.read_by[step])
        while pending:
            r = self.find(pending.pop())
            self.reads[r] -= 1
            if self.reads[r] or self.first[r] or self.end[r] < 0 or not self.alive[r]:
                continue
            s, e = self.start[r], self.end[r]
            self.timeline[s:e] -= int(self.mem[self.node[r]])
            self.deleted[s] = self.deleted[e] = True
            self.alive[r] = False
            self.dropped += 1
            p, q = self.prev[r], self.next[r]
            if p >= 0:
                self.next[p] = q
            if q >= 0:
                self.prev[q] = p
            pending.extend(self.read_by[s])
