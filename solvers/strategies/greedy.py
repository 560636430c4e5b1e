"""peak-greedy: drop values where the simulated peak is, cheapest recompute per byte first.

A policy here is a set of drop points: edge ``(u, r)`` chosen means value u is dropped
right after node r first runs and recomputed (with its dropped ancestors) when a later node
reads it (:func:`~solvers.strategies._segments.drop_sequence`). Chen et al.'s segmentations
(2016) choose what to drop by position alone; on a traced joint graph the values differ by
orders of magnitude in recompute cost per byte (a GELU's pointwise terms against a matmul),
which is what PyTorch's min-cut partitioner and Rockmate exploit. This strategy searches
the policy with the simulator in the loop:

1. Start from dropping nothing (the checkpoint-all schedule).
2. While the simulated peak exceeds the budget: among the values resident at the peak step
   (other than the inputs and output of the ops running there, which would be recomputed
   on the spot), drop those with the least ``cost / bytes`` until the dropped bytes cover
   the excess; simulate again. Where a value is dropped is the mode: at its last forward
   read (``checkpoint``: the backward recomputes it, as in Chen's policies) or at its last
   read before the peak (``gap``, and ``gap-transient`` whose recomputes do not hold what
   they read).
3. Repeat the checkpoint descent with the kept sets of a few of Chen's greedy segmentations
   that fit the budget protected from dropping: they bound how much a recompute closure
   holds at once, which the unprotected descent cannot (it would end at keeping nothing).
4. Repair the cheapest few ends: undo drops, the most costly per byte first, wherever the
   schedule still fits and costs less.

Every step is one replay of a schedule (milliseconds on graphs of hundreds of ops), so the
search is fast and anytime: ``time_limit`` stops it with the best policy found. The result
is a good incumbent for the MILP's warm start, not a bound.

With ``tie_layers``, the repeated blocks of the graph (:func:`solvers.repeats.find_repeats`,
structure only: op, size and edges; costs ignored) share their drop points: choosing edge
``(u, r)`` in one copy of a layer chooses its image in every copy
(:func:`solvers.repeats.edge_classes`), and the repair undoes them together. This is a
restriction of the policy space (an approximation, listed in ``info["restrictions"]``).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers.graph import Graph
from solvers.repeats import edge_classes, find_repeats
from solvers.result import SolveResult, Status
from solvers.schedule import Schedule, SimResult, schedule_from_order, simulate
from solvers.strategies._segments import drop_sequence, forced_keep, last_forward_reader, schedule_from_kept
from solvers.strategies.baselines import chen_greedy_sets

__all__ = ["peak_greedy", "resident_at"]

#: above this many nodes, fewer descents and repairs (each replay costs O(n))
LARGE = 1000


def resident_at(graph: Graph, schedule: Schedule, step: int) -> npt.NDArray[np.bool_]:
    """Which values are resident right after ``schedule.steps[step]``."""
    return _state_at(graph, schedule, step)[0]


def _state_at(graph: Graph, schedule: Schedule, step: int) -> tuple[npt.NDArray[np.bool_], int]:
    """The resident values right after ``schedule.steps[step]``, and how many compute
    steps ran up to it: the simulator's replay of the prefix."""
    sim = simulate(graph, schedule.steps[: step + 1])
    resident = np.zeros(graph.n, dtype=bool)
    resident[list(sim.resident_end)] = True
    return resident, int(sim.compute_counts.sum())


def peak_greedy(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    starts: int | None = None,
    repairs: int | None = None,
    tie_layers: bool = False,
) -> SolveResult:
    """Search the kept set with the simulator (see the module docstring).

    Args:
        graph: the graph to plan.
        budget: bytes.
        time_limit: seconds; the search stops when they run out and returns the schedule
            found so far.
        starts: how many of Chen's greedy segmentations that fit the budget serve as
            protected checkpoint sets of further descents (besides protecting nothing);
            default 8, 3 above 1,000 nodes.
        repairs: how many of the cheapest distinct descent ends get the repair pass;
            default 3, 1 above 1,000 nodes (a repair replays the schedule once per drop).
        tie_layers: give every copy of a repeated block the same drop points (see the
            module docstring); an approximation, reported in ``info["restrictions"]``.

    Returns:
        FEASIBLE with the cheapest schedule found within the budget, else NO_SOLUTION with
        the least-peak schedule reached (attached for information).
    """
    t0 = time.perf_counter()
    large = graph.n > LARGE
    starts = (3 if large else 8) if starts is None else starts
    repairs = (1 if large else 3) if repairs is None else repairs
    deadline = None if time_limit is None else t0 + max(float(time_limit), 0.0)
    classes = None
    info: dict[str, Any] = {}
    if tie_layers:
        repeats = find_repeats(graph, cost_rtol=None)
        classes = edge_classes(graph, repeats)
        info["repeats"] = repeats.describe()
        info["restrictions"] = ["same drop points in every repeated layer (approximation)"]
    search = _Search(graph, budget, deadline, classes)
    nothing = np.zeros(graph.n, dtype=bool)
    protects: list[npt.NDArray[np.bool_]] = [nothing]
    if graph.backward_mask.any():
        fitting = []
        for _, _, kept in chen_greedy_sets(graph):
            mask = nothing.copy()
            mask[list(kept)] = True
            if simulate(graph, schedule_from_kept(graph, kept)).peak <= budget:
                fitting.append(mask)
        if fitting:  # spread over the sweep: few checkpoints (cheap) to many (low peak)
            picks = np.unique(np.linspace(0, len(fitting) - 1, min(starts, len(fitting))).round().astype(int))
            protects += [fitting[int(k)] for k in picks]
    first = ("gap", "gap-transient", "checkpoint") if graph.backward_mask.any() else ("gap", "gap-transient")
    for k, protect in enumerate(protects):
        for mode in first if k == 0 else ("checkpoint",):
            if not search.expired():
                search.descend(protect, mode)
    # repair the cheapest few descents' ends (repairs differ: each starts elsewhere)
    ends: list[tuple[float, npt.NDArray[np.bool_], bool]] = []
    for cost, drop, transient in sorted(search.fits, key=lambda f: f[0]):
        if all((drop != other).any() or transient != t for _, other, t in ends):
            ends.append((cost, drop, transient))
    for cost, drop, transient in ends[:repairs]:
        search.repair(cost, drop, transient)
    info.update(evaluations=search.evaluations, starts=len(protects))
    elapsed = time.perf_counter() - t0
    if search.best is None:
        assert search.low is not None
        sched, sim = search.low
        info["message"] = f"peak-greedy's least peak is {sim.peak:,} bytes, over the budget of {budget:,}"
        return SolveResult(
            "peak-greedy", Status.NO_SOLUTION, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
            solve_seconds=elapsed, info=info,
        )  # fmt: skip
    sched, sim = search.best[1], search.best[2]
    info["drops"] = int(search.best[0].sum())
    return SolveResult(
        "peak-greedy", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
        solve_seconds=elapsed, info=info,
    )  # fmt: skip


class _Search:
    """The state of one peak-greedy search over drop points: which edges ``(u, r)`` drop
    ``u`` after ``r`` runs (see :func:`~solvers.strategies._segments.drop_sequence`), the
    best policy found within the budget, and the least-peak schedule seen."""

    def __init__(
        self, graph: Graph, budget: int, deadline: float | None, classes: npt.NDArray[np.int64] | None = None
    ) -> None:
        self.graph, self.budget, self.deadline = graph, budget, deadline
        #: edge -> the edges tied to it (itself included), for edges with copies
        self.tied: dict[int, npt.NDArray[np.int64]] = {}
        if classes is not None:
            order = np.argsort(classes, kind="stable")
            bounds = np.flatnonzero(np.diff(classes[order])) + 1
            for group in np.split(order, bounds):
                if len(group) > 1:
                    for k in group.tolist():
                        self.tied[k] = group
        e = graph.edge_array.reshape(-1, 2)
        self.src = e[:, 0]
        droppable = graph.recomputable_mask & (graph.mem > 0)
        # dropping after the last read is freeing, which every schedule does anyway
        last = np.full(graph.n, -1, dtype=np.int64)
        np.maximum.at(last, self.src, e[:, 1])
        self.candidate = droppable[self.src] & (e[:, 1] < last[self.src])
        # per value, its reads in id order (edge indices), for "the read before the peak"
        order = np.lexsort((e[:, 1], self.src))
        self.reads: list[list[int]] = [[] for _ in range(graph.n)]
        for k in order.tolist():
            self.reads[int(self.src[k])].append(k)
        self.dst = e[:, 1]
        # checkpoint mode: a forward value goes at its last forward read, or not at all
        self.at_last_forward = np.full(graph.n, -1, dtype=np.int64)
        fwd_value = ~forced_keep(graph) & ~graph.backward_mask & droppable
        lf = last_forward_reader(graph)
        hit = fwd_value[self.src] & (e[:, 1] == lf[self.src])
        self.at_last_forward[self.src[hit]] = np.flatnonzero(hit)
        mem = graph.mem.astype(np.float64)
        self.ratio = np.where(mem > 0, graph.cost / np.maximum(mem, 1.0), np.inf)
        self.evaluations = 0
        self.best: tuple[npt.NDArray[np.bool_], Schedule, SimResult] | None = None
        self.low: tuple[Schedule, SimResult] | None = None
        #: (cost, drops, transient) of each policy a descent met that fits
        self.fits: list[tuple[float, npt.NDArray[np.bool_], bool]] = []
        # every descent starts from dropping nothing (transient or not: nothing recomputes)
        self.start = self.run(np.zeros(len(self.src), dtype=bool))

    def group(self, k: int) -> npt.NDArray[np.int64]:
        """Edge ``k`` and the edges tied to it."""
        found = self.tied.get(k)
        return np.array([k], dtype=np.int64) if found is None else found

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def run(
        self, drop: npt.NDArray[np.bool_], transient: bool = False
    ) -> tuple[Schedule, SimResult, list[int]]:
        """Schedule and simulate the policy ``drop`` (recording the best and the lowest)."""
        seq, owner = drop_sequence(self.graph, drop, transient=transient)
        sched = schedule_from_order(self.graph, seq)
        sim = simulate(self.graph, sched)
        self.evaluations += 1
        if sim.peak <= self.budget and (self.best is None or sim.cost < self.best[2].cost - 1e-15):
            self.best = (drop.copy(), sched, sim)
        if self.low is None or sim.peak < self.low[1].peak:
            self.low = (sched, sim)
        return sched, sim, owner

    def descend(self, protect: npt.NDArray[np.bool_], mode: str) -> None:
        """Drop values live at the peak (not ``protect``-ed), cheapest per byte first, until
        the peak fits or nothing there can go. ``mode="gap"`` drops a value at its last read
        before the peak (``"gap-transient"``: recomputes do not hold what they read, see
        :func:`~solvers.strategies._segments.drop_sequence`); ``mode="checkpoint"`` drops a
        forward value at its last forward read (Chen's policies are of this kind: the
        backward recomputes it)."""
        graph = self.graph
        drop = np.zeros(len(self.src), dtype=bool)
        transient = mode == "gap-transient"
        sched, sim, owner = self.start
        if sim.peak <= self.budget:
            self.fits.append((sim.cost, drop.copy(), transient))
        while sim.peak > self.budget and not self.expired():
            resident, computes = _state_at(graph, sched, sim.peak_step)
            prog = owner[computes - 1]  # the program node being run at the peak
            node = sched.steps[sim.peak_step][1]
            live = resident & ~protect
            live[[node, prog, *graph.preds[node], *graph.preds[prog]]] = False
            options: list[tuple[float, int]] = []
            for u in np.flatnonzero(live).tolist():
                if mode == "checkpoint":
                    k = int(self.at_last_forward[u])
                else:
                    before = [k for k in self.reads[u] if self.dst[k] < prog]
                    k = before[-1] if before and self.candidate[before[-1]] else -1
                if k >= 0 and not drop[k]:
                    options.append((float(self.ratio[u]), k))
            if not options:
                return
            options.sort()
            excess, freed = sim.peak - self.budget, 0
            for _, k in options:
                if drop[k]:  # dropped with a tied edge already
                    continue
                tied = self.group(k)
                drop[tied[~protect[self.src[tied]]]] = True
                drop[k] = True
                freed += int(graph.mem[self.src[k]])
                if freed >= excess:
                    break
            sched, sim, owner = self.run(drop, transient)
            if sim.peak <= self.budget:
                self.fits.append((sim.cost, drop.copy(), transient))

    def repair(self, cost: float, drop: npt.NDArray[np.bool_], transient: bool) -> None:
        """Undo drops of the policy ``drop`` (which costs ``cost`` and fits) while it still
        fits and gets cheaper, the costliest recomputations first."""
        drop = drop.copy()
        dropped = np.flatnonzero(drop)
        seen: set[int] = set()
        for k in dropped[np.argsort(-self.ratio[self.src[dropped]], kind="stable")].tolist():
            if self.expired():
                return
            tied = self.group(k)
            if int(tied[0]) in seen:  # tried with a tied edge
                continue
            seen.add(int(tied[0]))
            tied = tied[drop[tied]]
            drop[tied] = False
            sim = self.run(drop, transient)[1]
            if sim.peak <= self.budget and sim.cost < cost - 1e-15:
                cost = sim.cost
            else:  # no gain (or over budget): drop again
                drop[tied] = True
