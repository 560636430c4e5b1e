"""Strategy ``"ilp"``: the Checkmate MILP (Jain et al., "Checkmate: Breaking the Memory
Wall with Optimal Tensor Rematerialization", MLSys 2020) solved by HiGHS.

The model, its variable index, encoding and decoding live in :mod:`solvers.formulation`
(shared with LP rounding, POET and the PuLP export); the LP dual certificates used for a
restricted support in :mod:`solvers.duals`. This module runs the solve: warm start,
time limit, status mapping, decoding and the simulator check.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from solvers import highs
from solvers.bounds import below_floor, memory_lower_bound
from solvers.duals import lagrangian_bound
from solvers.errors import OptionError
from solvers.formulation import (
    decode_schedule,
    formulate,
    liveness_masks,
    problem_of,
    progress_hook,
    too_large,
    warm_start_vector,
)
from solvers.graph import Graph
from solvers.result import ProgressFn, SolveResult, Status
from solvers.schedule import Schedule, simulate

__all__ = ["ilp"]


def ilp(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    warm_start: Schedule | None = None,
    mip_gap: float = 1e-4,
    threads: int | None = None,
    progress: ProgressFn | None = None,
    relax: bool = False,
    heuristic_effort: float = 0.2,
    lp_solver: str | None = None,
    support: str = "full",
    feasibility: bool = False,
    log: bool = False,
) -> SolveResult:
    """Solve the Checkmate MILP with HiGHS (strategy ``"ilp"``).

    Args:
        graph: the graph.
        budget: memory budget in bytes.
        time_limit: seconds for the whole call (model build, solve and decoding); at the
            limit the best incumbent is returned with status FEASIBLE and its MIP gap, or
            NO_SOLUTION with HiGHS's bound. HiGHS gets what is left after the build and
            runs in a worker process that is stopped by force just after the limit (see
            :mod:`solvers.highs`), so the call returns within about
            ``time_limit + 1 s + 2%`` plus the decoding of the incumbent.
        warm_start: a schedule to start from (e.g. a heuristic's); used when its first
            computes are in id order and its stage form fits the budget.
        mip_gap: relative gap at which HiGHS stops and the result counts as optimal.
        threads: HiGHS threads (None: HiGHS's default).
        progress: called with :class:`SolveProgress` on new incumbents and about every second.
        relax: solve only the LP relaxation: no schedule; its objective is the lower bound.
        heuristic_effort: HiGHS ``mip_heuristic_effort`` (its default 0.05 finds incumbents
            late on these models).
        lp_solver: HiGHS ``solver`` option ("simplex", "ipm", "choose").
        support: "full" (exact) or "liveness": R and S only while a value is live in the
            keep-all schedule (:func:`liveness_masks`), a model about half the size. A
            restriction: the result is at best FEASIBLE and HiGHS's bound, valid only for
            the restricted model, goes to ``info["restricted_bound"]``, not ``lower_bound``.
        feasibility: drop the objective and stop at the first schedule within the budget
            (status FEASIBLE, no bound). On small graphs with tight budgets HiGHS finds one
            several times sooner so; ``auto`` runs it when no heuristic fits and warm-starts
            the full MILP from its schedule.
        log: print HiGHS's log.

    Returns:
        A SolveResult: OPTIMAL (within ``mip_gap``), FEASIBLE (time limit, with
        ``info["mip_gap"]``), INFEASIBLE (proven; ``info["min_budget"]`` is the cheap bound)
        or NO_SOLUTION. ``lower_bound`` is HiGHS's dual bound (the LP optimum with
        ``relax``). ``info`` holds mip_gap, num_vars, num_constraints, num_binaries.

    Raises:
        SolverError: HiGHS failed.
    """
    t0 = time.perf_counter()
    if (early := below_floor("ilp", graph, budget)) is not None:
        return early
    if (early := too_large("ilp", graph, budget, time_limit)) is not None:
        kept = None if warm_start is None else simulate(graph, warm_start)
        if kept is None or kept.peak > budget:
            return dataclasses.replace(early, info={**early.info, "warm_start": False})
        # no time to build the model: the incumbent given is the best schedule known
        kept_info = {**early.info, "warm_start": True}
        return SolveResult("ilp", Status.FEASIBLE, budget, warm_start, kept.cost, kept.peak, info=kept_info)
    floor = memory_lower_bound(graph)
    if support not in ("full", "liveness"):
        raise OptionError(f"support must be 'full' or 'liveness', not {support!r}")
    restricted = support == "liveness"
    model = formulate(graph, budget, support=liveness_masks(graph) if restricted else None)
    if feasibility:
        model = dataclasses.replace(model, cost=np.zeros_like(model.cost))
    start = None
    if warm_start is not None and not relax:
        start = warm_start_vector(graph, model, warm_start)
    build = time.perf_counter() - t0
    info: dict[str, Any] = {
        "num_vars": model.num_vars,
        "num_constraints": model.num_constraints,
        "num_binaries": model.num_binaries,
        "warm_start": None if warm_start is None else start is not None,
        "support": support,
    }
    hook = progress_hook("ilp", progress, t0, model.cost_unit)
    remaining = None if time_limit is None else max(time_limit - (time.perf_counter() - t0), 0.0)
    res = highs.solve(
        problem_of(model),
        relax=relax,
        time_limit=remaining,
        mip_rel_gap=mip_gap,
        threads=threads,
        mip_heuristic_effort=None if relax else heuristic_effort,
        start=start,
        lp_solver=lp_solver,
        progress=hook,
        log=log,
    )
    bound = None if res.bound is None else res.bound * model.cost_unit
    info.update(model_status=res.model_status, mip_gap=res.mip_gap, **res.info)
    if feasibility:  # the zero objective bounds nothing
        info["feasibility"], bound = True, None
    if restricted:  # the restricted model's bound says nothing about the full model
        info["restricted_bound"], bound = bound, None
    common: dict[str, Any] = {"build_seconds": build, "solve_seconds": res.seconds}
    if res.status == Status.INFEASIBLE and restricted:
        return SolveResult("ilp", Status.NO_SOLUTION, budget, info=info, **common)
    if res.status == Status.INFEASIBLE:
        info["min_budget"] = floor
        return SolveResult("ilp", Status.INFEASIBLE, budget, info=info, **common)
    if relax:
        if restricted:  # certify on the full model with the restricted duals
            bound = None
            if res.row_dual is not None:
                full = formulate(graph, budget)
                bound = lagrangian_bound(full, model.row_key, res.row_dual) * full.cost_unit
        info["lp_objective"] = None if res.objective is None else res.objective * model.cost_unit
        return SolveResult("ilp", Status.NO_SOLUTION, budget, lower_bound=bound, info=info, **common)
    if res.x is None:
        return SolveResult("ilp", Status.NO_SOLUTION, budget, lower_bound=bound, info=info, **common)
    if not feasibility:
        info["objective"] = (res.objective or 0.0) * model.cost_unit
    schedule = decode_schedule(graph, model.index, res.x)
    sim = simulate(graph, schedule)
    status = Status.FEASIBLE if restricted or feasibility else res.status
    if sim.peak > budget:  # numerical slack beyond the tolerances: never hand it out as valid
        status = Status.NO_SOLUTION
        info["over_budget"] = sim.peak - budget
    return SolveResult(
        "ilp", status, budget, schedule, sim.cost, sim.peak, lower_bound=bound, info=info, **common
    )
