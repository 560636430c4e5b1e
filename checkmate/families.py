"""Plans shared across shapes: a graph seen at new sizes runs a plan already made.

Dynamo compiles one graph per input shape. Graphs of one *family* have the same structure
(:func:`solvers.resize.structure`: ops and edges, not sizes); a plan of one carries over to
another by re-simulating its schedule at the new sizes (:func:`solvers.resize.transfer_and_check`).
The :class:`~checkmate.runtime.Planner` asks, for each new graph, in this order:

- :func:`family_target`: the budget to plan at (a fraction never gets fewer bytes than a
  larger shape of the family was planned at, so a short last batch always has a plan);
- keeping every value, when that fits these sizes (a short last batch): no plan recomputes less;
- :func:`reuse`: the cheapest family plan that fits at these sizes, polished there (a value
  it recomputes is kept where these sizes leave room for it), unless it then costs more
  than :data:`REUSE_COST` times the least any schedule there can: then the graph is planned anew;
- :func:`plan_ahead`: for a byte budget and a graph larger than the whole family, a plan
  made for shapes about twice as large (or less, where that does not fit), so that the next
  larger shapes reuse it;
- :func:`larger_shape_budget`: the bytes the same graph got in a larger training step,
  when a fraction is infeasible for it (Dynamo specialized a size of 1 differently).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import numpy as np

from checkmate.records import HELD_TO, PlanRecord
from solvers.bounds import memory_lower_bound
from solvers.budget import Budget
from solvers.cost_bounds import recompute_lower_bound
from solvers.errors import CheckmateError, SolverError
from solvers.graph import Graph
from solvers.polish import polish
from solvers.resize import stretch, transfer_and_check
from solvers.result import SolveResult, Status
from solvers.schedule import keep_all_peak

__all__ = [
    "AHEAD",
    "AHEAD_COST",
    "REUSE_COST",
    "FALLBACK",
    "family_target",
    "reuse",
    "plan_ahead",
    "larger_shape_budget",
]

#: a byte budget's plan for a graph larger than the planned ones of its family is made for
#: shapes about this many times larger (see :func:`plan_ahead`)
AHEAD = 2.0
#: the smaller stretches tried, in order, when no plan fits the budget at ``AHEAD``
FALLBACK = (1.5, 1.25, 1.1)
#: a plan made ahead is kept only where, at the graph's own sizes, it costs at most this
#: many times the least any schedule there can cost (:func:`solvers.cost_bounds.recompute_lower_bound`)
AHEAD_COST = 1.15
#: a family's plan carried over to a graph is kept only where it costs at most this many times
#: the least any schedule there can cost (:func:`reuse`); else the graph is planned anew, once
#: per shape, where the plan runs at every step of it
REUSE_COST = 1.15


def family_target(
    budget: Budget, ref: int, records: Sequence[PlanRecord], family: Sequence[int], reserve: int = 0
) -> tuple[Budget, int | None]:
    """The budget to plan a graph of keep-all peak ``ref`` at and, when it is a byte
    budget or the graph has a family, its bytes, for the graph alone: ``reserve`` bytes
    held beside the graph (DDP's gradient buckets, FSDP2's parameters) are taken off.

    A byte budget is itself, less ``reserve``. A fraction is of the graph's own keep-all
    peak, but never less than the bytes a larger graph of its family was planned at: the
    step's memory is then that of the family's largest planned shape, and a shorter batch
    always has a plan (the larger one's schedule fits it). A fraction without a family is
    returned as it is (the reserve is taken off where it is resolved).
    """
    if budget.least:  # the least peak: no bytes before planning
        return budget, None
    if budget.fraction is None:
        assert budget.nbytes is not None
        net = max(budget.nbytes - reserve, 1)
        return Budget(nbytes=net, reference=ref), net
    if not family:
        return budget, None
    # the bytes each was held to (a plan checked compiled may be solved at more, see
    # checkmate.compiled: its simulated target is not the step's bytes)
    floor = max(records[i].budget or 0 for i in family)
    target = max(budget.resolve(ref) - reserve, floor)
    return Budget(nbytes=target, reference=ref), target


def reuse(
    graph: Graph,
    ref: int,
    records: Sequence[PlanRecord],
    family: Sequence[int],
    target: int,
    holds: Callable[[SolveResult], bool] | None = None,
) -> tuple[SolveResult, int] | None:
    """The cheapest plan of ``family`` that, carried over to ``graph``'s sizes, fits
    ``target`` bytes (simulated), with the index of its record; None when none fits, or
    when the cheapest costs more than :data:`REUSE_COST` times the least any schedule of
    ``graph`` within ``target`` can (:func:`~solvers.cost_bounds.recompute_lower_bound`):
    a Hugging Face BERT's plan for 64 tokens, at a byte budget its 40-token batch nearly
    fits whole, recomputed its 19 values there too, +34.4% compute.

    At new sizes the plan is first polished within ``target`` (:func:`solvers.polish.polish`):
    a plan made for a longer sequence recomputes values a shorter one has room to keep. A
    GPT-2 (3 layers, fraction 0.6) planned at 48 and 64 tokens ran its 40-token batch at
    +6.9% compute with 13.75 MiB of its 22.13 MiB used; polished, +0.3% at 21.91 MiB, in 3 ms.
    ``holds``: the caller's check of a plan (a bound on what it holds at its forward/backward
    boundary): the polished schedule is taken only where it holds, else the plan as carried
    over, and None is returned where that does not hold either.

    A plan kept by the compiled check (:mod:`checkmate.compiled`) was solved at more
    simulated bytes than its step holds, since Inductor's step holds less than the plan
    simulates; carried over, it may simulate up to ``target`` times that same ratio (its
    result's ``budget``; ``info[HELD_TO]`` keeps ``target``), so that the check of the new
    sizes starts where the family's ended: one compile, not one per replan."""
    best: tuple[SolveResult, int] | None = None
    for i in family:
        rec = records[i]
        if rec.result.schedule is None:
            continue
        allowed = int(target * _held_ratio(rec))
        got = transfer_and_check(rec.joint.graph, rec.result.schedule, graph, allowed)
        if got is None:
            continue
        schedule, sim = got
        if best is not None and (best[0].cost or 0.0) <= sim.cost:
            continue
        info = {
            "chosen": rec.result.info.get("chosen", rec.result.strategy),
            "reference": ref,
            "reused_from": i,
        }
        if allowed != target:
            info[HELD_TO] = target
        res = replace(
            rec.result,
            status=Status.FEASIBLE,
            budget=allowed,
            schedule=schedule,
            cost=sim.cost,
            peak=sim.peak,
            lower_bound=None,
            build_seconds=0.0,
            solve_seconds=0.0,
            info=info,
        )
        best = (res, i)
    if best is None:
        return None
    # the same sizes (a recompile on a guard): planned there already, whatever its cost
    same = np.array_equal(records[best[1]].joint.graph.mem, graph.mem)
    polished = None if same else _polished(graph, best[0])
    tries = [best[0]] if polished is None else [polished, best[0]]
    chosen = next((res for res in tries if holds is None or holds(res)), None)
    if chosen is None:
        return None
    best = (chosen, best[1])
    if same:
        return best
    least = recompute_lower_bound(graph, target)
    if least is not None and (best[0].cost or 0.0) > REUSE_COST * least:
        return None  # planned anew: far cheaper plans may fit these sizes
    return best


def _polished(graph: Graph, res: SolveResult) -> SolveResult | None:
    """``res``, a plan carried over, with its schedule polished within the bytes it was
    carried over at (its ``budget``; see :func:`reuse`); None where that removes no recompute."""
    assert res.schedule is not None and res.budget is not None
    try:
        done = polish(graph, res.schedule, res.budget)
    except SolverError:  # polish's own check failed: the plan as carried over stands
        return None
    if not done.merged:
        return None
    info = {**res.info, "kept_resident": done.merged}
    return replace(res, schedule=done.schedule, cost=done.sim.cost, peak=done.sim.peak, info=info)


def _held_ratio(rec: PlanRecord) -> float:
    """The simulated bytes ``rec``'s plan was solved at over the bytes its step holds: above
    1 for a plan the compiled check kept after replanning upwards, else 1."""
    check, solved = rec.compiled, rec.result.budget
    if check is None or not check.fits or not solved or check.budget <= 0:
        return 1.0
    return max(1.0, solved / check.budget)


def plan_ahead(
    graph: Graph,
    ref: int,
    records: Sequence[PlanRecord],
    family: Sequence[int],
    nbytes: int,
    solve: Callable[[Graph, Budget], SolveResult],
    at_size: Callable[[Graph], int] | None = None,
    ceiling: int | None = None,
) -> tuple[SolveResult | None, int | None]:
    """For a byte budget, a graph larger than every planned one of its family: its plan
    made by ``solve`` on the graph stretched to about twice its size
    (:func:`solvers.resize.stretch`, extrapolating from the family's largest), when that
    plan fits ``nbytes`` at the real sizes; None otherwise (then the graph is planned at
    its own sizes). Returned with the least keep-all peak of a stretched graph that got
    no plan to keep (or ``ceiling``, when less), for the next call's ``ceiling``.

    Where no plan of twice the size fits the budget (a budget set at the largest batch's
    eager peak holds no larger one), the smaller stretches of :data:`FALLBACK` are tried,
    each skipped without a solve when its largest single-op working set alone is over the
    budget: with a 14-length ascending sweep the first length that needed recomputation
    otherwise planned every length after it (8 plans), since shorter lengths keep every
    value and are no family plan to stretch from.

    ``at_size(big)``: the bytes the budget leaves the graph at the stretched sizes, where
    they are fewer than ``nbytes`` (room held beside the graph that grows with its shapes,
    such as a loss on its outputs); the stretched graph is planned at those. Planned at
    ``nbytes``, a plan made ahead did not fit the larger shapes it was made for.

    A plan made ahead runs at these sizes each time they come again: one that costs more
    than :data:`AHEAD_COST` times the least cost possible at them (a stretched graph near
    the least peak it can reach is planned with most of its values recomputed) is refused,
    and the next smaller stretch tried. Measured on a TinyGPT over 30 ascending lengths at
    0.6 of the longest's eager peak: the plan made ahead at length 38 for twice it ran
    every later length at +58% compute, where plans of their sizes took +9 to +15%.

    Each try costs a solve, up to the time limit where the stretched graph has no plan, so
    a stretch at least as large as ``ceiling`` (the keep-all peak of one that got no plan
    to keep at an earlier graph of the family) is not tried again."""
    old = max(family, key=lambda i: records[i].reference_peak)
    if ref <= records[old].reference_peak:
        return None, ceiling
    least = recompute_lower_bound(graph, nbytes)
    for factor in (AHEAD, *FALLBACK):
        big = stretch(records[old].joint.graph, graph, factor)
        if big is None:
            return None, ceiling
        size = keep_all_peak(big)
        if ceiling is not None and size >= ceiling:
            continue
        ahead = min(nbytes, at_size(big)) if at_size is not None else nbytes
        got = None
        # a stretched graph keeps its nodes' costs: a schedule costs the same at both sizes
        floor = None if memory_lower_bound(big) > ahead else recompute_lower_bound(big, ahead)
        if floor is not None and (least is None or floor <= AHEAD_COST * least):
            try:
                res = solve(big, Budget(nbytes=ahead))
            except CheckmateError:
                res = None
            if res is not None and res.ok and res.schedule is not None:
                got = transfer_and_check(big, res.schedule, graph, nbytes)
        if got is None or (least is not None and got[1].cost > AHEAD_COST * least):
            # no plan, or one dear at these sizes, which come again: a smaller stretch, or their own
            ceiling = size if ceiling is None else min(ceiling, size)
            continue
        assert res is not None
        schedule, sim = got
        info = {**res.info, "reference": ref, "planned_ahead": factor}
        made = replace(
            res, budget=nbytes, schedule=schedule, cost=sim.cost, peak=sim.peak, lower_bound=None, info=info
        )
        return made, ceiling
    return None, ceiling


def larger_shape_budget(
    records: Sequence[PlanRecord], steps: Mapping[object, Sequence[int]], step: object, ref: int
) -> int | None:
    """The most bytes a graph at this graph's position in another training step (its
    graphs in compile order) was planned at, among those whose keep-all peak is at least
    ``ref``; None when there is none."""
    pos = len(steps.get(step, []))
    got = [
        records[idx[pos]].budget or 0
        for sig, idx in steps.items()
        if sig != step and len(idx) > pos and records[idx[pos]].reference_peak >= ref
    ]
    return max(got, default=None)
