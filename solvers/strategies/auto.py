"""The default strategy: a small portfolio whose cheapest valid schedule wins.

1. Cheap heuristics (checkpoint-all, peak-greedy, Chen's greedy and sqrt(n) segmentations,
   DTR with and without banishing): each gives a valid schedule in milliseconds to seconds
   or fails; the cheapest one that fits is the incumbent. Checkpoint-all fitting the budget
   is optimal outright (every node runs once).
2. Graphs the MILP takes (at most ``milp_max_nodes``): LP relaxation + two-phase rounding
   (Jain et al., MLSys 2020): a lower bound on every schedule's cost and often a better
   schedule (two windows, see below, when an incumbent exists; half the time left when
   none does). Then the Checkmate MILP, warm-started from the incumbent. When nothing fits
   yet, a third of the time left first goes to the MILP without objective (its first
   schedule within the budget warm-starts the MILP; where it finds none, the full MILP is
   not run).
3. Larger graphs: CP-SAT (Moccasin-style, when OR-Tools is installed) started from the
   incumbent; the LP rarely finishes at that size. Without an incumbent (below the least
   peak the heuristics reach), nothing more is tried: the LP there found no schedule in a
   minute. On graphs the MILP takes, CP-SAT also gets the time the MILP's windows leave.
4. Nothing fits: the least-peak search (:mod:`solvers.strategies.least_peak`), whose
   schedule is the plan when it fits and otherwise names the budget that has one. Its
   heuristic phase runs before the LP and the MILP when the heuristics found nothing at the
   budget, nor at a ladder of budgets below it: they are not monotone in it, and a schedule
   found at a lower budget fits this one (the MILP then starts from it).

More search stops paying at some point: the portfolio stops as soon as its best plan is
within 1% of its lower bound, and the searches started from the incumbent (MILP, CP-SAT)
run in windows of 15% of the time limit, another only while the last one improved the
plan (or, for CP-SAT, twice as long after one that took the incumbent as its hint and ended
before returning any schedule). On traced graphs of 300-400 ops the heuristics' plan
usually stands, and ``auto`` returns well before its time limit; a budget that keeps the
search improving uses it all.

Every candidate's schedule is polished before it is compared (:mod:`solvers.polish`): a
recompute whose value can stay resident within the budget is removed. A heuristic plans
under the memory it has at each step, and one planned down the ladder below the budget
leaves room everywhere; ``info["polished"]`` gives, per candidate polishing made cheaper,
its cost before and the recomputes removed.

Strategies that are not installed (optional dependencies) are skipped. The result names
the strategy that produced the schedule (``info["chosen"]``) and every candidate's cost.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

from solvers.bounds import memory_lower_bound
from solvers.errors import CheckmateError, SolverWarning, WorkerError
from solvers.graph import Graph
from solvers.polish import polish as polish_schedule
from solvers.result import ProgressFn, SolveProgress, SolveResult, Status
from solvers.schedule import Schedule, simulate, validate
from solvers.strategies.least_peak import LeastPeak, least_peak

__all__ = ["auto"]

#: heuristics tried first, in order: (label in ``info["candidates"]``, strategy, options)
HEURISTICS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("checkpoint-all", "checkpoint-all", {}),
    ("peak-greedy", "peak-greedy", {}),
    ("chen-greedy", "chen-greedy", {}),
    ("chen-sqrtn", "chen-sqrtn", {}),
    ("dtr", "dtr", {}),
    # a static plan may recompute what the program freed (no banishing): fits where DTR's
    # eager-runtime rule pins too much (traced transformers)
    ("dtr (no banishing)", "dtr", {"banish": False}),
    # largest first: blind to costs, so it fits where cost-weighted eviction keeps the large
    # values that are cheap to make (a transformer block at 0.6 of keep-all with measured
    # costs: only this one of the heuristics fitted, 5% above the proven bound)
    ("dtr (largest first)", "dtr", {"heuristic": "size", "banish": False}),
    # a MIP, exact within one-op recomputes: last, so that where the others found nothing
    # (graphs without a backward) it gets half of what is left
    ("gap-cover", "gap-cover", {}),
)
#: MILP skipped above this many nodes (its O(n^2) model would not finish usefully)
MILP_MAX_NODES = 400
DEFAULT_TIME_LIMIT = 60.0
#: most of the time limit one heuristic may take once a schedule fits (before: half of what is left)
HEURISTIC_SHARE = 0.3
#: relative gap to the lower bound under which a schedule counts as optimal
GAP_TOLERANCE = 1e-4
#: a search started from the incumbent (MILP, CP-SAT) runs in windows of this share of the
#: time limit (at least MIN_WINDOW seconds), another only while the last improved the plan
#: by IMPROVEMENT: a search that finds nothing better in a window rarely does in the next
WINDOW = 0.15
MIN_WINDOW = 3.0
IMPROVEMENT = 1e-3
#: where no heuristic fits the budget, they run again at budgets each this share of the one
#: before, at most this many, until one fits (in HEURISTIC_SHARE of the time limit, all rungs,
#: and not below the cheap bound every schedule needs)
LADDER_RATIO = 0.97
LADDER_STEPS = 6
#: the option through which each windowed search takes the incumbent
_START = {"ilp": "warm_start", "cpsat": "hint"}
#: relative gap to the lower bound under which more search cannot pay: the portfolio stops
#: and the MILP is told to stop there too (an hour's training at +1% compute costs less
#: than the minute a user waits for the last percent, every new shape)
GAP_STOP = 0.01


def auto(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    progress: ProgressFn | None = None,
    milp_max_nodes: int = MILP_MAX_NODES,
    polish: bool = True,
) -> SolveResult:
    """Run the portfolio; return the cheapest schedule within ``budget``.

    Args:
        graph: the graph to plan.
        budget: bytes.
        time_limit: seconds for the whole portfolio (default 60).
        progress: receives :class:`SolveProgress` reports.
        milp_max_nodes: skip the MILP above this many nodes.
        polish: polish every candidate's schedule (:mod:`solvers.polish`); False compares
            the strategies' own schedules (``make bench-polish`` measures both).

    Returns:
        A :class:`SolveResult` with ``strategy="auto"``; ``info["chosen"]`` names the
        strategy that produced the schedule, ``info["candidates"]`` maps each strategy
        tried to its cost or status. Without a schedule, ``info["closest_peak"]`` (bytes)
        and ``info["closest_strategy"]`` give the least peak of the attempts over the
        budget, when a strategy returned one: a budget that has a plan.
    """
    from solvers.strategies import get_strategy

    limit = DEFAULT_TIME_LIMIT if time_limit is None else float(time_limit)
    start = time.perf_counter()
    candidates: dict[str, Any] = {}
    #: the candidates whose schedules polishing made cheaper: their cost before, recomputes removed
    polished: dict[str, Any] = {}
    best: SolveResult | None = None
    best_cost = float("inf")
    lower = graph.total_cost  # every node runs at least once
    proven_infeasible: SolveResult | None = None
    #: the least-peak schedule over the budget that any strategy reached: (peak, strategy,
    #: schedule; a seed of the least-peak search)
    closest: tuple[int, str, Schedule] | None = None

    def left() -> float:
        return max(limit - (time.perf_counter() - start), 0.0)

    def report(msg: str) -> None:
        if progress is not None:
            progress(
                SolveProgress(
                    "auto",
                    time.perf_counter() - start,
                    None if best is None else best_cost,
                    lower,
                    msg,
                )
            )

    def consider(name: str, res: SolveResult) -> None:
        nonlocal best, best_cost, lower, proven_infeasible, closest
        if res.lower_bound is not None:
            lower = max(lower, float(res.lower_bound))
        if res.status == Status.INFEASIBLE:
            proven_infeasible = res
            candidates[name] = "infeasible"
            return
        if not res.ok or res.schedule is None:
            candidates[name] = str(res.status)
            if res.schedule is not None:  # an attempt over the budget: its replayed peak
                try:
                    peak = simulate(graph, res.schedule).peak
                except CheckmateError:
                    return
                if peak > budget and (closest is None or peak < closest[0]):
                    closest = (peak, name, res.schedule)
            return
        try:
            sim = validate(graph, res.schedule, budget)
        except CheckmateError as exc:  # a strategy's bug must not become the user's plan
            candidates[name] = f"invalid: {exc}"
            return
        try:  # keep what the budget leaves room for instead of recomputing it
            kept = polish_schedule(graph, res.schedule, budget) if polish else None
        except CheckmateError as exc:
            polished[name] = f"error: {exc}"
        else:
            if kept is not None and kept.sim.cost < sim.cost:
                polished[name] = {"before": sim.cost, "merged": kept.merged, "dropped": kept.dropped}
                res, sim = dataclasses.replace(res, schedule=kept.schedule), kept.sim
        candidates[name] = sim.cost
        if sim.cost < best_cost - 1e-12:
            best, best_cost = dataclasses.replace(res, strategy=name, cost=sim.cost, peak=sim.peak), sim.cost

    def run(name: str, label: str | None = None, at: int | None = None, **opts: Any) -> SolveResult | None:
        # ``at``: plan for fewer bytes than the budget (a schedule within them fits it)
        label = label or name
        try:
            fn = get_strategy(name)
        except CheckmateError as exc:
            candidates[label] = f"unavailable: {exc}"
            return None
        try:
            res = fn(graph, budget if at is None else at, **opts)
        except WorkerError as exc:  # the environment, not the graph: say so
            candidates[label] = f"error: {exc}"
            warnings.warn(
                f"auto: {label} could not run ({exc}); the plan is chosen from the other strategies and "
                "may cost more than the one asked for",
                SolverWarning,
                stacklevel=2,
            )
            return None
        except CheckmateError as exc:
            candidates[label] = f"error: {exc}"
            return None
        consider(label, res)
        report(f"{label}: {candidates[label]}")
        return res

    def window() -> float:
        return max(MIN_WINDOW, WINDOW * limit)

    def done() -> bool:
        return best is not None and best_cost <= lower * (1 + GAP_STOP)

    for label, name, opts in HEURISTICS:
        # a heuristic that searches (peak-greedy on thousands of ops) leaves time for the
        # rest; while nothing fits, one may take half of what is left
        share = HEURISTIC_SHARE * limit if best is not None else max(HEURISTIC_SHARE * limit, 0.5 * left())
        run(name, label=label, time_limit=min(left(), share), **opts)
        if done():
            break
    milp = graph.n <= milp_max_nodes
    # nothing fits: the heuristics again at budgets below this one, whose schedules fit it.
    # They are not monotone in the budget: DTR fitted a traced transformer at 0.84 and 0.86
    # of a budget and nothing did at 0.88-0.94, where the MILP found no schedule in 20 s
    # either. Down a ladder to the first rung where one fits (the cheapest plans are near the
    # budget), then the least-peak search's heuristic phase
    at, floor = budget, memory_lower_bound(graph)
    ladder_end = time.perf_counter() + HEURISTIC_SHARE * limit  # the ladder's time, all rungs
    for rung in range(1, LADDER_STEPS + 1):
        at = int(at * LADDER_RATIO)
        if best is not None or at < floor:
            break
        for label, name, opts in HEURISTICS[1:]:  # keep-all fits no lower budget
            rest = min(left(), ladder_end - time.perf_counter())
            if rest <= 0:
                break
            run(name, label=f"{label} at {LADDER_RATIO}^{rung}", at=at, time_limit=rest, **opts)
    if best is None and left() > 0:
        low = _least_peak(graph, min(left(), HEURISTIC_SHARE * limit), exact=False, closest=closest)
        if low.peak <= budget:
            consider("least-peak", SolveResult("least-peak", Status.FEASIBLE, budget, schedule=low.schedule))
            report(f"least-peak: {candidates['least-peak']}")

    def improving(name: str, **opts: Any) -> None:
        # a search started from the incumbent, in windows: another window only while the
        # last one improved it (a search that found nothing better in a window rarely pays
        # for the next; on traced graphs the heuristics' plan usually stands). A CP-SAT
        # window that took the incumbent but ended before returning any schedule, not even
        # it, was too short to tell: the next one is twice as long
        span = window()
        while not done() and left() > 1.0 and best is not None:
            before = best_cost
            assert best.schedule is not None
            start_from: dict[str, Any] = {_START[name]: best.schedule}
            res = run(name, time_limit=min(left(), span), **opts, **start_from)
            if best_cost <= before * (1 - IMPROVEMENT):
                continue
            if res is None or res.schedule is not None or not res.info.get("hinted"):
                return
            span *= 2

    if not done() and left() > 0 and not milp and best is not None and _available("cpsat"):
        # above the MILP's size the LP rarely finishes (no bound, no better rounding on the
        # traced GPT-2/ResNet graphs and random_layered_n500 in make bench) while CP-SAT
        # started from the incumbent improves it (up to 0.6%)
        improving("cpsat")
    elif best is None and not milp and budget >= floor:
        # nothing fits on a graph above the MILP's size, and the least-peak search's heuristic
        # phase found nothing within the budget either: the LP there finds no schedule and
        # proves nothing in the time a call has (traced graphs of 412, 781 and 791 ops at
        # 0.85-0.99 of that least peak: the restricted LP infeasible, the full one unsolved
        # in 12 s, or in 60 s on the 412-op one), so the call says so sooner
        candidates["lp-rounding"] = "skipped: no incumbent above the MILP's size"
    elif not done() and left() > 0:
        # with an incumbent, the LP's worth is its bound (and a rounding): two windows; without
        # one (a graph the MILP takes, or a budget below the cheap bound, which the LP proves
        # too small at once), half the time when the MILP follows, else all of it
        share = min(left(), 2 * window()) if best is not None else (left() * 0.5 if milp else left())
        run("lp-rounding", time_limit=share, progress=progress)
    if proven_infeasible is not None and best is None:
        return _finish(proven_infeasible, candidates, lower, start, chosen=None)
    undecided = False  # the MILP without objective found no schedule, and proved none absent
    if best is None and milp and left() > 3.0:
        # nothing fits yet: a MILP without objective finds a first schedule several times
        # sooner (tight budgets on small graphs), and the full MILP starts from it
        run("ilp", label="ilp (feasibility)", time_limit=left() / 3, feasibility=True)
        if proven_infeasible is not None:  # the same model: no need to solve it again
            return _finish(proven_infeasible, candidates, lower, start, chosen=None)
        undecided = best is None
    # where it found none, neither did the full MILP in twice its time: 9 budgets 0.5-5% below
    # the heuristics' least peak on four graphs (mlp16, dropout6, random n100; zoo_masked's
    # were all found by the first), 20 s each in vain
    if milp and best is None and left() > 1.0 and not undecided:
        run("ilp", time_limit=left(), progress=progress, mip_gap=GAP_STOP)
        if proven_infeasible is not None and best is None:
            return _finish(proven_infeasible, candidates, lower, start, chosen=None)
    elif milp:
        improving("ilp", progress=progress, mip_gap=GAP_STOP)
    if milp and best is not None and _available("cpsat"):
        # the MILP's windows stopped improving the incumbent: CP-SAT, hinted with it, gets
        # the time left (a 16-layer MLP at half its keep-all peak: the MILP found no schedule
        # in 90 s, LP rounding's stood at 2.89x the step, CP-SAT reached 1.34x)
        improving("cpsat")
    if best is None:
        # last resort: the least peak any schedule reaches (memoized per graph, so that a
        # retry at the minimum an InfeasibleBudgetError stated finds this same schedule)
        # at least a second: the heuristic bisection takes milliseconds on hundreds of ops, and
        # the minimum it finds is what the error tells the user to ask for
        low = _least_peak(graph, max(left(), 1.0), exact=True, closest=closest)
        if low.peak <= budget:
            consider("least-peak", SolveResult("least-peak", Status.FEASIBLE, budget, schedule=low.schedule))
        else:
            candidates["least-peak"] = f"least peak found {low.peak:,} bytes ({low.strategy})"
            if closest is None or low.peak < closest[0]:
                closest = (low.peak, "least-peak", low.schedule)
    if best is None:
        return SolveResult(
            "auto",
            Status.NO_SOLUTION,
            budget,
            lower_bound=lower,
            solve_seconds=time.perf_counter() - start,
            info={"candidates": candidates}
            | ({} if closest is None else {"closest_peak": closest[0], "closest_strategy": closest[1]}),
        )
    return _finish(best, candidates, lower, start, chosen=best.strategy, polished=polished)


def _least_peak(
    graph: Graph, time_limit: float, *, exact: bool, closest: tuple[int, str, Schedule] | None
) -> LeastPeak:
    """The least-peak search (memoized per graph), seeded with the lowest attempt over the budget."""
    return least_peak(
        graph, time_limit=time_limit, exact=exact, seeds=[] if closest is None else [closest[2]]
    )


def _available(name: str) -> bool:
    """Whether strategy ``name`` can run here (its optional dependency is installed)."""
    from solvers.strategies import get_strategy

    try:
        get_strategy(name)
    except CheckmateError:
        return False
    return True


def _finish(
    res: SolveResult,
    candidates: dict[str, Any],
    lower: float,
    start: float,
    chosen: str | None,
    polished: dict[str, Any] | None = None,
) -> SolveResult:
    status = res.status
    if res.schedule is not None and res.cost is not None and res.cost <= lower * (1 + GAP_TOLERANCE):
        status = Status.OPTIMAL
    elif status == Status.OPTIMAL:
        status = Status.FEASIBLE  # optimal only where the bound is met (the MILP stops at 1%)
    return SolveResult(
        "auto",
        status,
        res.budget,
        schedule=res.schedule,
        cost=res.cost,
        peak=res.peak,
        lower_bound=lower,
        build_seconds=res.build_seconds,
        solve_seconds=time.perf_counter() - start,
        info={**res.info, "chosen": chosen, "candidates": candidates}
        | ({"polished": polished} if polished else {}),
    )
