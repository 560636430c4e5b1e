"""The planner's front door: budget in, validated :class:`SolveResult` out.

``solve`` resolves the budget, rejects budgets below a cheap lower bound on every
schedule's peak, runs one registered strategy, and replays its schedule through the one
simulator before returning it: no strategy's word is taken on trust.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from solvers.boundary import with_ballast, without_ballast
from solvers.bounds import largest_working_set, memory_lower_bound
from solvers.budget import Budget, BudgetSpec, format_bytes, parse_budget
from solvers.errors import InfeasibleBudgetError, SolverError
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import keep_all_peak, simulate, validate
from solvers.strategies import get_strategy
from solvers.strategies.least_peak import least_peak

__all__ = ["solve", "resolve_budget", "memory_lower_bound", "closest_hint", "no_plan_error"]


def resolve_budget(graph: Graph, budget: BudgetSpec) -> tuple[int, int]:
    """``(budget_bytes, keep_all_peak)`` for a budget spec (see :func:`parse_budget`); the
    keep-all peak is simulated only when the budget does not carry it (``Budget.reference``)."""
    b: Budget = parse_budget(budget)
    ref = _reference(graph, b)
    return b.resolve(ref), ref


def _reference(graph: Graph, b: Budget) -> int:
    """The keep-all peak fractions refer to: carried by the budget, else simulated."""
    return b.reference if b.reference is not None else keep_all_peak(graph)


def solve(
    graph: Graph,
    budget: BudgetSpec,
    strategy: str = "auto",
    *,
    time_limit: float | None = None,
    raise_infeasible: bool = True,
    **options: Any,
) -> SolveResult:
    """Plan ``graph`` under ``budget`` with one strategy, and check the plan.

    Args:
        graph: the graph to plan.
        budget: bytes or a fraction of the checkpoint-all peak (see :func:`parse_budget`);
            a :class:`Budget` with a ``boundary`` also bounds what the plan holds at its
            forward/backward boundary (:mod:`solvers.boundary`).
        strategy: a name from :data:`solvers.strategies.STRATEGIES`.
        time_limit: seconds for strategies that search (the best incumbent is returned).
        raise_infeasible: raise :class:`InfeasibleBudgetError` for a budget proven too
            small; when False, return a result with status ``infeasible`` instead.
        options: passed to the strategy.

    Returns:
        A :class:`SolveResult` whose schedule (if any) the simulator accepted.

    Raises:
        InfeasibleBudgetError: the budget is below what any schedule needs.
        SolverError: a strategy returned a schedule that breaks its own promise.

    Example:
        >>> from solvers import solve, load_graph  # doctest: +SKIP
        >>> solve(load_graph("VGG16.json"), 0.9, "ilp").status  # doctest: +SKIP
        <Status.OPTIMAL: 'optimal'>
    """
    b = parse_budget(budget)
    ref = _reference(graph, b)
    floor = memory_lower_bound(graph)
    if b.least:  # plan at the least peak found (half the time), then at it (the rest)
        started = time.perf_counter()
        nbytes = least_peak(graph, time_limit=None if time_limit is None else time_limit / 2).peak
        if time_limit is not None:
            time_limit = max(time_limit - (time.perf_counter() - started), 0.0)
    else:
        nbytes = b.resolve(ref)
    if nbytes < floor:
        res = SolveResult(strategy, Status.INFEASIBLE, nbytes, info={"min_budget": floor, "reference": ref})
        if raise_infeasible:
            raise no_plan_error(graph, res, time_limit=time_limit)
        return res
    if b.boundary is not None and b.boundary < nbytes and graph.first_backward < graph.n:
        return _solve_bounded(graph, nbytes, b.boundary, ref, strategy, time_limit, raise_infeasible, options)
    fn = get_strategy(strategy)
    res = fn(graph, nbytes, time_limit=time_limit, **options)
    res = dataclasses.replace(res, strategy=res.strategy or strategy, info={**res.info, "reference": ref})
    if res.status == Status.INFEASIBLE:
        if raise_infeasible:
            raise no_plan_error(graph, res, time_limit=time_limit)
        return res
    if res.schedule is None:
        return res
    if res.ok:
        try:
            sim = validate(graph, res.schedule, nbytes)
        except Exception as exc:
            raise SolverError(f"strategy {res.strategy!r} returned an invalid schedule: {exc}") from exc
    else:
        sim = simulate(graph, res.schedule)
    return dataclasses.replace(res, cost=sim.cost, peak=sim.peak)


def _solve_bounded(
    graph: Graph,
    nbytes: int,
    boundary: int,
    ref: int,
    strategy: str,
    time_limit: float | None,
    raise_infeasible: bool,
    options: dict[str, Any],
) -> SolveResult:
    """:func:`solve` with at most ``boundary`` bytes held at the forward/backward boundary:
    the strategy plans the graph with a ballast there (:mod:`solvers.boundary`), and its
    schedule, the ballast dropped, is checked on ``graph`` itself."""
    held, at = with_ballast(graph, nbytes, boundary)
    try:
        # fractions and messages refer to the graph's own keep-all peak, not the ballast's
        asked = Budget(nbytes=nbytes, reference=ref)
        res = solve(
            held, asked, strategy, time_limit=time_limit, raise_infeasible=raise_infeasible, **options
        )
    except InfeasibleBudgetError as exc:
        exc.add_note(
            f"The plan was also to hold at most {format_bytes(boundary)} at its forward/backward boundary "
            f"(room for the graphs that run between its forward and backward); the peaks above count "
            f"{format_bytes(held.mem[at])} of ballast held there"
        )
        raise
    info = {**res.info, "reference": ref, "boundary": boundary}
    if res.schedule is None:
        return dataclasses.replace(res, info=info)
    schedule = without_ballast(res.schedule, at)
    if not res.ok:
        sim = simulate(graph, schedule)
        return dataclasses.replace(res, schedule=schedule, cost=sim.cost, peak=sim.peak, info=info)
    try:
        sim = validate(graph, schedule, nbytes)
    except Exception as exc:
        raise SolverError(f"strategy {res.strategy!r} returned an invalid schedule: {exc}") from exc
    if sim.boundary > boundary:
        raise SolverError(
            f"strategy {res.strategy!r} returned a schedule holding {format_bytes(sim.boundary)} at its "
            f"forward/backward boundary, over the {format_bytes(boundary)} asked"
        )
    return dataclasses.replace(res, schedule=schedule, cost=sim.cost, peak=sim.peak, info=info)


def no_plan_error(
    graph: Graph, res: SolveResult, *, time_limit: float | None = None, exact: bool | None = None
) -> InfeasibleBudgetError:
    """The :class:`InfeasibleBudgetError` for a result without a schedule within its budget:
    the proven lower bound (the cheap bound, or more than a budget proven infeasible) and
    the least peak a schedule actually reaches (:func:`least_peak`, memoized per graph),
    so that planning at ``exc.minimum`` succeeds on the first try. ``exact``: whether the
    least-peak search runs its MILP phase (default: only where no strategy searched, a
    budget below the cheap bound); False for a caller that plans otherwise on this error
    (the heuristic phase, about a second, names a minimum that has a plan)."""
    floor = memory_lower_bound(graph)
    proven = max(int(res.info.get("min_budget", 0) or 0), floor)
    if res.status == Status.INFEASIBLE and proven <= res.budget:
        proven = res.budget + 1  # proven infeasible at or above the bound: more is needed
    # where a strategy already spent the time limit, only the heuristic search (about a
    # second) runs; below the cheap bound nothing ran, and the whole search gets the time
    searched = res.budget >= floor
    found = least_peak(
        graph, time_limit=time_limit, exact=not searched if exact is None else exact
    )  # memoized
    detail = (
        f"proven by {res.strategy}" if res.status == Status.INFEASIBLE else f"{res.strategy}: {res.status}"
    )
    if res.budget < floor:
        detail = f"the largest single-op working set is more: {largest_working_set(graph)}"
    return InfeasibleBudgetError(
        res.budget,
        found.peak,
        lower_bound=max(proven, found.lower_bound),
        reference=res.info.get("reference") or keep_all_peak(graph),
        detail=detail,  # exact where the proven bound meets the peak found (the error sees both)
        tradeoffs=[(p, c / graph.total_cost - 1.0) for p, c in found.frontier] if graph.total_cost else (),
    )


def closest_hint(res: SolveResult) -> str:
    """For a result without a schedule: the least peak an attempt over the budget reached,
    as a clause to append to an error message (empty when no strategy returned one).

    ``auto`` records it in ``info["closest_peak"]``; a single strategy that attaches its
    least-peak attempt (``peak-greedy``) gives it as ``peak``. That schedule is valid for
    any budget at or above its peak, so the clause names a budget that has a plan.
    """
    peak = res.info.get("closest_peak")
    who = res.info.get("closest_strategy", res.strategy)
    if peak is None and res.schedule is not None and not res.ok and res.peak is not None:
        peak = res.peak if res.peak > res.budget else None
    if peak is None:
        return ""
    ref = res.info.get("reference")
    share = f", {peak / ref:.1%} of the checkpoint-all peak" if ref else ""
    return (
        f"; the closest schedule found ({who}) peaks at {format_bytes(peak)} "
        f"({int(peak):,} bytes{share}), so a budget of at least that has a plan"
    )
