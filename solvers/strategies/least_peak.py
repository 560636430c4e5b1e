"""The least peak a schedule of a graph can reach, and a schedule that reaches it.

A budget below what every schedule needs has no plan; the user's next question is "then
what budget does?". The cheap bound of :mod:`solvers.bounds` (the largest working set of
one op) answers "at least this much" but is often far below any schedule (half the least
peak on traced CNNs), so retrying at it fails again. This module answers with a schedule
actually found, so that planning at its peak succeeds on the first try:

1. Bisect the budget between the cheap bound and the keep-all peak with the fast
   heuristics (peak-greedy, DTR; milliseconds to a second each): each budget where one
   fits lowers the best peak to that schedule's simulated peak. The heuristics are not
   monotone in the budget (one that fails at a budget may fit a lower one), so a sweep of
   budgets below the best peak follows, then gap-cover (seconds a call) down from the
   best while it fits.
2. On graphs the MILP takes, bisect further with the Checkmate MILP without objective
   (Jain et al., MLSys 2020; :func:`~solvers.strategies.ilp.ilp` with
   ``feasibility=True``): a schedule found lowers the best peak, a budget proven
   infeasible raises the proven lower bound. The search stops when the two meet within
   ``tolerance``, when the time runs out, or at the first budget the MILP leaves undecided
   in its share of the time (the budgets nearer the best peak were no easier).

On the way the search replays dozens of schedules at budgets between the least peak and
keep-all; the ones no other is cheaper and lower than (``LeastPeak.frontier``) tell a user
whose budget was too low what a little more memory buys: the least peak is often reached
only by recomputing several times over, where a budget a little higher costs a fraction of
that (a small transformer: +793% at its least peak, 23.1% of keep-all; +34% at 29.6%).

The result is memoized per graph (:func:`~solvers.plan.graph_fingerprint`: a schedule's
validity depends on structure and sizes only), so that a later solve of the same graph at
that peak, in the same process, finds the same schedule whatever its time limit.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from solvers.bounds import memory_lower_bound
from solvers.errors import CheckmateError
from solvers.graph import Graph
from solvers.schedule import Schedule, schedule_from_order, simulate

__all__ = ["LeastPeak", "known_least_peak", "least_peak", "pareto"]

#: heuristics of the first bisection, with their options: deterministic, fast, and together
#: the lowest peaks on traced graphs (peak-greedy on transformers, DTR on CNNs, DTR evicting
#: the largest value first where costs mislead the others)
HEURISTICS: tuple[tuple[str, dict[str, object]], ...] = (
    ("peak-greedy", {}),
    ("dtr", {}),
    ("dtr", {"banish": False}),
    ("dtr", {"heuristic": "size", "banish": False}),
)
#: tried after the bisection and its sweep, down from their best peak while they fit:
#: gap-cover takes seconds a call on traced graphs of a few hundred ops, where it never
#: lowered the peak (a GPT-2, a DenseNet, a transformer with dropout, a ResNet with
#: BatchNorm: 13-30 s of the search, 2-7 s without it), and finds the lowest on random
#: layered graphs (33,600 bytes against DTR's 37,449 on 100 nodes)
SLOW_HEURISTICS: tuple[tuple[str, dict[str, object]], ...] = (("gap-cover", {}),)
#: the exact phase runs on graphs of at most this many nodes (the MILP's O(n^2) model)
EXACT_MAX_NODES = 400
#: relative width of the bracket [proven bound, best peak] at which the search stops
TOLERANCE = 0.005
#: the sweep below the bisection's best peak: budgets each this share of the one before,
#: at most this many (the heuristics are not monotone in the budget: DTR without banishing
#: fitted a traced transformer with dropout at 0.84 and 0.86 of a budget, and not at 0.88-0.94,
#: where the bisection stopped)
SWEEP_RATIO = 0.97
SWEEP_STEPS = 16


@dataclass(frozen=True)
class LeastPeak:
    """The least peak found for a graph.

    Attributes:
        schedule: a schedule whose simulated peak is ``peak``.
        peak: bytes; a budget of at least this has a plan.
        cost: the schedule's simulated cost.
        lower_bound: bytes every schedule needs (proven: the cheap bound, or one more than
            a budget the MILP proved infeasible); ``lower_bound <= peak``.
        strategy: what found the schedule.
        exact_tried: whether the MILP phase ran (a memoized result without it does not
            answer a caller who asks for it).
        frontier: ``(peak, cost)`` of the schedules the search replayed that no other beats
            on both, by increasing peak (so decreasing cost): the least peak first, keep-all
            last. A plan solved at one of those budgets searches for a cheaper schedule.
    """

    schedule: Schedule
    peak: int
    cost: float
    lower_bound: int
    strategy: str
    exact_tried: bool
    frontier: tuple[tuple[int, float], ...] = ()

    @property
    def proven_minimal(self) -> bool:
        """Whether no schedule peaks lower (the bound meets the peak)."""
        return self.lower_bound >= self.peak


#: graph fingerprint -> its least peak, the oldest dropped past MEMO_SIZE entries (a process
#: that plans many graphs holds only the recent ones' schedules)
_MEMO: dict[str, LeastPeak] = {}
MEMO_SIZE = 64


def least_peak(
    graph: Graph,
    *,
    time_limit: float | None = None,
    exact: bool = True,
    exact_max_nodes: int = EXACT_MAX_NODES,
    tolerance: float = TOLERANCE,
    seeds: Sequence[Schedule] = (),
) -> LeastPeak:
    """Search the least peak of any schedule of ``graph`` (see the module docstring).

    Args:
        graph: the graph.
        time_limit: seconds for the whole search (default: 30). On a hundred ops the
            heuristic phase ends within a second, on traced graphs of 300-500 ops in 3-8 s
            on a 2-core CPU, and where the time does not bind its result is the same on
            every run; the MILP phase uses the rest.
        exact: run the MILP phase on graphs of at most ``exact_max_nodes`` nodes.
        exact_max_nodes: see ``exact``.
        tolerance: stop when the best peak is within this share of the proven bound.
        seeds: schedules found elsewhere (a strategy's attempts over its budget): the
            search starts from the lowest of them when it peaks below keep-all.

    Returns:
        The :class:`LeastPeak` found (memoized: a second call returns the first result,
        unless it asks for the MILP phase the first one skipped).
    """
    from solvers.plan import graph_fingerprint

    key = graph_fingerprint(graph)
    memo = _MEMO.get(key)
    seeded = _lowest(graph, [(sched, "seed") for sched in seeds])
    if memo is not None and seeded is not None and _order(seeded) < (memo.peak, memo.cost):
        memo = _MEMO[key] = dataclasses.replace(
            memo,
            schedule=seeded[0],
            peak=seeded[1],
            cost=seeded[2],
            strategy=seeded[3],
            frontier=pareto([*memo.frontier, (seeded[1], seeded[2])]),
        )
    want_exact = exact and graph.n <= exact_max_nodes
    if memo is not None and (memo.exact_tried or not want_exact):
        return memo
    limit = 30.0 if time_limit is None else max(float(time_limit), 0.0)
    start = time.perf_counter()

    def left() -> float:
        return max(limit - (time.perf_counter() - start), 0.0)

    seen: list[tuple[int, float]] = [] if memo is None else list(memo.frontier)
    if memo is None:
        best, lower = _bisect_heuristics(graph, tolerance, left, seeds, seen)
    else:
        best, lower = (memo.schedule, memo.peak, memo.cost, memo.strategy), memo.lower_bound
    if want_exact:
        best, lower = _bisect_exact(graph, best, lower, tolerance, left, seen)
    sched, peak, cost, who = best  # replayed by _lowest or _bisect_exact, or the memo's: in seen
    found = LeastPeak(sched, peak, cost, min(lower, peak), who, exact_tried=want_exact, frontier=pareto(seen))
    _MEMO.pop(key, None)
    _MEMO[key] = found
    while len(_MEMO) > MEMO_SIZE:
        del _MEMO[next(iter(_MEMO))]
    return found


def known_least_peak(graph: Graph) -> LeastPeak | None:
    """The least peak this process's searches found for ``graph`` (its structure and
    sizes: costs do not matter), or None where none searched it; searches nothing."""
    from solvers.plan import graph_fingerprint

    return _MEMO.get(graph_fingerprint(graph))


#: (schedule, peak, cost, strategy)
_Found = tuple[Schedule, int, float, str]


def pareto(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The ``(peak, cost)`` points no other point is at most on both and below on one, by
    increasing peak (and so strictly decreasing cost)."""
    front: list[tuple[int, float]] = []
    for peak, cost in sorted(set(points)):
        if not front or cost < front[-1][1]:
            front.append((peak, cost))
    return tuple(front)


def _order(found: _Found) -> tuple[int, float]:
    """What "lower" means for a schedule found: its peak, then its cost."""
    return found[1], found[2]


def _lowest(
    graph: Graph, schedules: Sequence[tuple[Schedule, str]], seen: list[tuple[int, float]] | None = None
) -> _Found | None:
    """The schedule with the least simulated peak (then cost), of those that replay; each
    one's ``(peak, cost)`` is appended to ``seen``."""
    best: _Found | None = None
    for sched, who in schedules:
        try:
            got = simulate(graph, sched)
        except CheckmateError:
            continue
        if seen is not None:
            seen.append((got.peak, got.cost))
        if best is None or (got.peak, got.cost) < _order(best):
            best = (sched, got.peak, got.cost, who)
    return best


def _bisect_heuristics(
    graph: Graph,
    tolerance: float,
    left: Callable[[], float],
    seeds: Sequence[Schedule],
    seen: list[tuple[int, float]],
) -> tuple[_Found, int]:
    """The heuristic bisection, started from the lowest of keep-all and the seeds, its sweep,
    then :data:`SLOW_HEURISTICS` down from the best: the least-peak schedule found and the
    cheap bound. Each heuristic gets at most a quarter of the time left (on hundreds of ops
    they take milliseconds and the time never binds; on thousands it stops the search with
    the best peak so far). Every schedule replayed goes to ``seen``."""

    keep_all = schedule_from_order(graph, range(graph.n))
    best = _lowest(graph, [(keep_all, "checkpoint-all"), *((sched, "seed") for sched in seeds)], seen)
    assert best is not None  # keep-all always replays
    lower = memory_lower_bound(graph)
    lo = lower - 1  # the heuristics' failures prove nothing: lo only steers the bisection
    while best[1] - lo > max(1, int(tolerance * best[1])) and left() > 0:
        mid = (lo + best[1]) // 2
        found = _lowest(graph, _attempts(graph, mid, left), seen)
        if found is not None and _order(found) < _order(best):
            best = found
        if found is None or found[1] > mid:
            lo = mid
    budget = best[1]
    for _ in range(SWEEP_STEPS):
        budget = int(budget * SWEEP_RATIO)
        if budget < lower or left() <= 0:
            break
        found = _lowest(graph, _attempts(graph, budget, left), seen)
        if found is not None and _order(found) < _order(best):
            best = found
            budget = min(budget, found[1])
    # the slow ones in the sweep's steps down from the best; once they fitted and then did not,
    # bisected between (gap-cover fitted a random layered graph at 0.98 of its best and not at
    # 0.96); where they fit nowhere below the best, one attempt
    high, failed, fitted = best[1], 0, False
    while left() > 0 and high - failed > max(1, int(tolerance * high)):
        budget = int(high * SWEEP_RATIO) if not failed else (failed + high) // 2
        if budget < lower:
            break
        found = _lowest(graph, _attempts(graph, budget, left, SLOW_HEURISTICS), seen)
        if found is None or found[1] > budget:
            if not fitted:
                break
            failed = budget
            continue
        fitted, high = True, found[1]
        if _order(found) < _order(best):
            best = found
    return best, lower


def _attempts(
    graph: Graph,
    budget: int,
    left: Callable[[], float],
    heuristics: Sequence[tuple[str, dict[str, object]]] = HEURISTICS,
) -> list[tuple[Schedule, str]]:
    """The heuristics' schedules at ``budget``, within or over it (each may take a quarter of
    the time left)."""
    from solvers.strategies import get_strategy

    attempts: list[tuple[Schedule, str]] = []
    for name, opts in heuristics:
        try:
            res = get_strategy(name)(graph, budget, time_limit=left() / 4, **opts)
        except CheckmateError:
            continue
        # an attempt over ``budget`` (peak-greedy returns its least-peak one) is still a
        # schedule: it may peak below the best so far
        if res.schedule is not None:
            attempts.append((res.schedule, name))
    return attempts


def _bisect_exact(
    graph: Graph,
    best: _Found,
    lower: int,
    tolerance: float,
    left: Callable[[], float],
    seen: list[tuple[int, float]],
) -> tuple[_Found, int]:
    """The MILP bisection between the proven bound and the best peak, in the time left,
    until a budget ends undecided; the schedules it finds go to ``seen``."""
    from solvers.result import Status
    from solvers.strategies.ilp import ilp

    lo = lower - 1  # the search's floor: proven infeasible, or undecided in its time
    # gallop down from the best peak (the heuristics leave it within a few tens of percent
    # of the least, and budgets near a schedule are found fastest), then bisect
    step = max(1, int(0.02 * best[1]))
    while best[1] - lo > max(1, int(tolerance * best[1])) and left() > 0.5:
        mid = max(best[1] - step, (lo + best[1]) // 2)  # strictly between lo and the best
        # a third of what is left: a hard budget may take it all and still end undecided
        res = ilp(graph, mid, time_limit=max(left() / 3, 0.5), feasibility=True)
        if res.status == Status.INFEASIBLE:
            lower, lo = max(lower, mid + 1), mid
        elif res.ok and res.schedule is not None:
            got = simulate(graph, res.schedule)
            seen.append((got.peak, got.cost))
            if got.peak > mid:  # the simulator has the last word
                break
            best = (res.schedule, got.peak, got.cost, "ilp (feasibility)")
            step *= 2
            continue
        else:
            # undecided in a third of the time left: the budgets nearer the best were no easier.
            # Measured (30 s): on four graphs every attempt after an undecided one was undecided
            # too (mlp16, dropout6, a traced Qwen2, zoo_masked), 11-20 s spent for nothing
            break
        step = max(1, (best[1] - lo) // 2)
    return best, lower
