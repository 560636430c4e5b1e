"""peak-greedy: drop checkpoints where the simulated peak is, cheapest recompute per byte first.

A checkpointing policy here is the set of forward values kept for the backward pass
(:func:`~solvers.strategies._segments.checkpoint_sequence` turns it into a schedule: a value
not kept is dropped after its last forward reader and recomputed, with its dropped
ancestors, right before a backward node reads it). Chen et al.'s segmentations (2016) choose
that set by position alone; on a traced joint graph the values differ by orders of
magnitude in recompute cost per byte (a GELU's pointwise terms against a matmul), which is
what PyTorch's min-cut partitioner and Rockmate exploit. This strategy searches the set with
the simulator in the loop:

1. Start from keeping every forward value (the checkpoint-all schedule).
2. While the simulated peak exceeds the budget: among the kept values resident at the peak
   step (other than the inputs and output of the op running there, which would be
   recomputed on the spot), drop those with the least ``cost / bytes`` until the dropped
   bytes cover the excess; simulate again.
3. Repeat from the same start with the kept sets of a few of Chen's greedy segmentations
   that fit the budget protected from dropping: they bound how much a recompute closure
   holds at once, which the unprotected descent cannot (it would end at keeping nothing).
4. Repair: walk the dropped values from the most to the least costly per byte and keep each
   again if the schedule still fits and costs less.

Every step is one replay of a schedule (milliseconds on graphs of hundreds of ops), so the
search is fast and anytime: ``time_limit`` cuts the repair pass short. The result is a good
incumbent for the MILP's warm start, not a bound.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import COMPUTE, FREE, PAGEIN, Schedule, SimResult, simulate
from solvers.strategies._segments import forced_keep, forward_ids, schedule_from_kept
from solvers.strategies.baselines import chen_greedy_sets

__all__ = ["peak_greedy", "resident_at"]


def resident_at(graph: Graph, schedule: Schedule, step: int) -> npt.NDArray[np.bool_]:
    """Which values are resident right after ``schedule.steps[step]``."""
    resident = np.zeros(graph.n, dtype=bool)
    for op, i in schedule.steps[: step + 1]:
        if op in (COMPUTE, PAGEIN):
            resident[i] = True
        elif op == FREE:
            resident[i] = False
    return resident


def peak_greedy(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    starts: int = 8,
    **options: Any,
) -> SolveResult:
    """Search the kept set with the simulator (see the module docstring).

    Args:
        graph: the graph to plan.
        budget: bytes.
        time_limit: seconds; the search stops when they run out and returns the schedule
            found so far.
        starts: how many of Chen's greedy segmentations that fit the budget serve as
            protected checkpoint sets of further descents (besides protecting nothing).

    Returns:
        FEASIBLE with the cheapest schedule found within the budget, else NO_SOLUTION with
        the least-peak schedule reached (attached for information).
    """
    t0 = time.perf_counter()
    search = _Search(graph, budget, None if time_limit is None else t0 + max(float(time_limit), 0.0))
    protects: list[tuple[int, ...]] = [()]
    fitting = [
        kept
        for _, _, kept in chen_greedy_sets(graph)
        if search.run(np.isin(np.arange(graph.n), kept))[1].peak <= budget
    ]
    if fitting:  # spread over the sweep: few checkpoints (cheap) to many (low peak)
        picks = np.unique(np.linspace(0, len(fitting) - 1, min(starts, len(fitting))).round().astype(int))
        protects += [fitting[int(k)] for k in picks]
    for protect in protects:
        if search.expired():
            break
        search.descend(protect)
    if search.best is not None:
        search.repair()
    info: dict[str, Any] = {"evaluations": search.evaluations, "starts": len(protects)}
    elapsed = time.perf_counter() - t0
    if search.best is None:
        sched, sim = search.low
        info["message"] = f"peak-greedy's least peak is {sim.peak:,} bytes, over the budget of {budget:,}"
        return SolveResult(
            "peak-greedy", Status.NO_SOLUTION, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
            solve_seconds=elapsed, info=info,
        )  # fmt: skip
    sched, sim = search.best[1], search.best[2]
    info["kept"] = int(search.best[0].sum())
    return SolveResult(
        "peak-greedy", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
        solve_seconds=elapsed, info=info,
    )  # fmt: skip


class _Search:
    """The state of one peak-greedy search: the graph's droppable values, the best kept set
    found within the budget, and the least-peak schedule seen."""

    def __init__(self, graph: Graph, budget: int, deadline: float | None) -> None:
        self.graph, self.budget, self.deadline = graph, budget, deadline
        droppable = np.zeros(graph.n, dtype=bool)
        droppable[forward_ids(graph)] = True
        self.droppable = droppable & ~forced_keep(graph) & (graph.mem > 0)
        mem = graph.mem.astype(np.float64)
        self.ratio = np.where(mem > 0, graph.cost / np.maximum(mem, 1.0), np.inf)
        self.evaluations = 0
        self.best: tuple[npt.NDArray[np.bool_], Schedule, SimResult] | None = None
        self.low: tuple[Schedule, SimResult] = self.run(self.droppable.copy())

    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def run(self, keep: npt.NDArray[np.bool_]) -> tuple[Schedule, SimResult]:
        """Schedule and simulate the policy keeping ``keep`` (recording the best)."""
        sched = schedule_from_kept(self.graph, np.flatnonzero(keep).tolist())
        sim = simulate(self.graph, sched)
        self.evaluations += 1
        if sim.peak <= self.budget and (self.best is None or sim.cost < self.best[2].cost - 1e-15):
            self.best = (keep.copy(), sched, sim)
        if not hasattr(self, "low") or sim.peak < self.low[1].peak:
            self.low = (sched, sim)
        return sched, sim

    def descend(self, protect: tuple[int, ...]) -> None:
        """From keeping everything, drop unprotected values live at the peak, cheapest per
        byte first, until the peak fits (or nothing at the peak can go)."""
        graph = self.graph
        kept = self.droppable.copy()
        may_drop = self.droppable.copy()
        may_drop[list(protect)] = False
        sched, sim = self.run(kept)
        while sim.peak > self.budget and not self.expired():
            node = sched.steps[sim.peak_step][1]
            live = resident_at(graph, sched, sim.peak_step) & kept & may_drop
            live[node] = False
            live[list(graph.preds[node])] = False
            options = np.flatnonzero(live)
            if options.size == 0:
                return
            options = options[np.argsort(self.ratio[options], kind="stable")]
            upto = int(np.searchsorted(np.cumsum(graph.mem[options]), sim.peak - self.budget)) + 1
            kept[options[:upto]] = False
            sched, sim = self.run(kept)

    def repair(self) -> None:
        """Keep dropped values again while the best schedule still fits and gets cheaper,
        the costliest recomputations first."""
        assert self.best is not None
        kept = self.best[0].copy()
        dropped = np.flatnonzero(self.droppable & ~kept)
        for v in dropped[np.argsort(-self.ratio[dropped], kind="stable")].tolist():
            if self.expired():
                return
            kept[v] = True
            before = self.best[2].cost
            self.run(kept)
            if self.best[2].cost >= before:  # no gain (or over budget): undo
                kept[v] = False
