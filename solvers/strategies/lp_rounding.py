"""LP relaxation of the Checkmate MILP with two-phase rounding (Jain et al., MLSys 2020, §5).

1. Solve the LP relaxation of :func:`solvers.formulation.formulate` at the budget: its
   objective is a lower bound on the cost of every schedule within the budget. By default
   the LP runs on a restricted support (values only while they are live in the keep-all
   schedule), several times smaller; its duals give a Lagrangian bound on the full model,
   which equals the full LP optimum whenever the restriction loses nothing (so far on
   every public graph: the bound is reported as certified in ``info["lp_certified"]``).
2. Round S by a threshold sweep: ``S = S_lp >= θ`` for θ over the distinct fractional
   values (deterministic, and better than randomized rounding in the paper).
3. For each rounded S take the cheapest R (:func:`solvers.stages.complete_rs`: the closure
   of stage t's needs walking dependencies backwards, O(n·|E|)), measure its peak with the
   vectorized accounting (equal to the simulator's), and keep the cheapest pattern that
   fits the real budget.
4. Solve the LP again at slightly reduced budgets (``budget_factors``, as the paper does)
   and round each: tighter memory rows push S towards patterns that fit. Keep the best.

The result is OPTIMAL when its cost meets the LP bound, otherwise FEASIBLE.

Time: ``time_limit`` covers the whole call (model building, every LP, rounding, decoding).
Each LP gets what is left of it; the sweep stops at the limit once it holds a schedule,
and may run :func:`rounding_grace` seconds past it only while it has none. ``info``
lists every LP solve in order (``lp_solves``: model, budget factor, seconds, HiGHS
status), so where the time went is visible.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers import highs
from solvers.bounds import below_floor, memory_lower_bound
from solvers.duals import lagrangian_bound, reduced_costs
from solvers.errors import OptionError
from solvers.formulation import MilpModel, formulate, liveness_masks, problem_of, too_large
from solvers.graph import Graph
from solvers.result import ProgressFn, SolveProgress, SolveResult, Status
from solvers.schedule import schedule_from_rs, simulate
from solvers.stages import complete_rs, rs_cost, stage_memory

__all__ = ["lp_rounding", "round_threshold_sweep", "thresholds_for", "rounding_grace"]

BoolMatrix = npt.NDArray[np.bool_]

#: relative slack under which a rounded cost counts as meeting the LP bound
_BOUND_TOL = 1e-7


def rounding_grace(time_limit: float) -> float:
    """Seconds past ``time_limit`` the sweep may take while it has no schedule yet: a
    schedule found just late beats none (half the stated slack, max(2 s, 10%))."""
    return 0.5 * max(2.0, 0.1 * time_limit)


def thresholds_for(S_lp: npt.NDArray[np.float64], max_count: int = 48) -> list[float]:
    """Thresholds for the sweep: the distinct fractional values of S (at most ``max_count``,
    evenly spaced in rank), plus 0.5 and 1 (the integral part)."""
    vals = np.unique(np.round(S_lp[(S_lp > 1e-6) & (S_lp < 1 - 1e-6)], 6))
    if len(vals) > max_count:
        vals = vals[np.linspace(0, len(vals) - 1, max_count).round().astype(int)]
    return sorted({1.0 - 1e-6, 0.5, *vals.tolist()})


def round_threshold_sweep(
    graph: Graph,
    budget: int,
    S_lp: npt.NDArray[np.float64],
    thresholds: Sequence[float] | None = None,
    deadline: float | None = None,
    hard_deadline: float | None = None,
) -> tuple[BoolMatrix, BoolMatrix, float, float] | None:
    """Round a fractional S by a threshold sweep; keep the cheapest (R, S) within budget.

    Args:
        graph: the graph.
        budget: bytes.
        S_lp: (n, n) fractional S (e.g. from the LP relaxation).
        thresholds: the θ to try (default :func:`thresholds_for`).
        deadline: ``time.perf_counter()`` value after which to stop sweeping once a
            pattern fits.
        hard_deadline: ``time.perf_counter()`` value after which to stop in any case.

    Returns:
        (R, S, cost, θ) of the cheapest fitting pattern, or None if none fits.
    """
    best: tuple[BoolMatrix, BoolMatrix, float, float] | None = None
    seen: set[bytes] = set()
    for theta in thresholds if thresholds is not None else thresholds_for(S_lp):
        now = time.perf_counter()
        if deadline is not None and best is not None and now > deadline:
            break
        if hard_deadline is not None and now > hard_deadline:
            break
        S0 = S_lp >= theta
        key = np.packbits(S0).tobytes()
        if key in seen:
            continue
        seen.add(key)
        R, S = complete_rs(graph, S0)
        cost = rs_cost(graph, R, S)
        if best is not None and cost >= best[2]:
            continue
        if stage_memory(graph, R, S).peak <= budget:
            best = (R, S, cost, float(theta))
    return best


def lp_rounding(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    budget_factors: Sequence[float] = (1.0, 0.98, 0.95, 0.9, 0.8),
    thresholds: Sequence[float] | None = None,
    lp_solver: str | None = None,
    threads: int | None = None,
    progress: ProgressFn | None = None,
    support: str = "liveness",
    pricing_rounds: int = 3,
    log: bool = False,
) -> SolveResult:
    """LP relaxation + two-phase rounding (strategy ``"lp-rounding"``).

    Args:
        graph: the graph.
        budget: memory budget in bytes.
        time_limit: seconds for the whole call (model building, every LP solve, rounding
            and decoding); each LP gets what is left. The call returns within about
            ``time_limit + rounding_grace(time_limit)`` plus one threshold's rounding,
            with the best schedule so far, or NO_SOLUTION with the bound if there is none.
        budget_factors: the LP is solved at ``budget * f`` for each f in turn (tighter
            memory rows push the rounding towards patterns that fit; the best of all is
            kept) until a rounding meets the bound or time runs out; f = 1.0 gives the
            lower bound.
        thresholds: θ values for the sweep (default: the LP's distinct fractional values).
        lp_solver: HiGHS ``solver`` option ("simplex", "ipm", "choose").
        threads: HiGHS threads.
        progress: called with :class:`SolveProgress` after each LP and rounding.
        support: "liveness" (default) solves the LP on the restricted support of
            :func:`~solvers.formulation.liveness_masks` (several times smaller) and
            certifies the bound on the full model with its duals
            (:func:`~solvers.duals.lagrangian_bound`); "full" solves the full LP.
            Falls back to the full LP when the restricted one is infeasible.
        pricing_rounds: when the restricted LP's bound is not certified, at most this
            many rounds of column generation (admit the R and S columns whose reduced
            cost on the full model is negative, re-solve).
        log: print HiGHS's log.

    Returns:
        A SolveResult with ``lower_bound`` = the LP objective at the full budget; OPTIMAL
        when the rounded cost meets it, FEASIBLE otherwise, NO_SOLUTION when no rounding
        fits, INFEASIBLE when the cheap bound or the LP proves the budget too small.
        ``info`` holds the LP objective, the θ and budget factor of the winner, num_vars,
        num_constraints and the LP seconds.

    Raises:
        SolverError: HiGHS failed.
    """
    t0 = time.perf_counter()
    if (early := below_floor("lp-rounding", graph, budget)) is not None:
        return early
    if (early := too_large("lp-rounding", graph, budget, time_limit, builds=2)) is not None:
        return early  # the full model and the liveness one
    deadline = None if time_limit is None else t0 + time_limit
    hard_deadline = None if time_limit is None else t0 + time_limit + rounding_grace(time_limit)
    full = formulate(graph, budget)
    model = full
    masks = liveness_masks(graph)
    if support == "liveness":
        model = formulate(graph, budget, support=masks)
    elif support != "full":
        raise OptionError(f"support must be 'liveness' or 'full', not {support!r}")
    build = time.perf_counter() - t0
    info: dict[str, Any] = {
        "num_vars": model.num_vars,
        "num_constraints": model.num_constraints,
        "full_num_vars": full.num_vars,
        "support": support,
        "lp_seconds": [],
        "tried_factors": [],
        "lp_solves": [],
    }
    lower: float | None = None
    best: tuple[BoolMatrix, BoolMatrix, float, float] | None = None
    best_factor = None

    def report(message: str) -> None:
        if progress is not None:
            progress(
                SolveProgress(
                    "lp-rounding",
                    time.perf_counter() - t0,
                    None if best is None else best[2],
                    lower,
                    message,
                )
            )

    def lp(m: MilpModel, factor: float, what: str) -> highs.HighsResult:
        remaining = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
        res = highs.solve(
            problem_of(m.with_budget(budget * factor)),
            relax=True,
            time_limit=remaining,
            threads=threads,
            lp_solver=lp_solver,
            log=log,
        )
        info["lp_seconds"].append(res.seconds)
        info["tried_factors"].append(factor)
        info["lp_solves"].append(
            {"model": what, "factor": factor, "seconds": res.seconds, "status": res.model_status}
        )
        return res

    for factor in budget_factors:
        if deadline is not None and time.perf_counter() >= deadline:
            break  # (before the first LP too: building the model took the whole limit)
        res = lp(model, factor, "full" if model is full else "restricted")
        if res.status == Status.INFEASIBLE and model is not full and factor >= 1.0:
            # the restricted support cannot fit the budget: the full model may
            model = full
            info.update(support="full", num_vars=full.num_vars, num_constraints=full.num_constraints)
            res = lp(model, factor, "full (restricted infeasible)")
        if res.status == Status.INFEASIBLE:
            if factor >= 1.0:
                info["min_budget"] = memory_lower_bound(graph)
                return SolveResult(
                    "lp-rounding",
                    Status.INFEASIBLE,
                    budget,
                    build_seconds=build,
                    solve_seconds=time.perf_counter() - t0 - build,
                    info={**info, "reason": "LP relaxation infeasible"},
                )
            break
        if res.x is None:
            continue
        rounds = 0
        while factor == 1.0 and res.row_dual is not None and res.objective is not None:
            # a valid bound for the full model from these duals, whatever the support
            cert = lagrangian_bound(full, model.row_key, res.row_dual)
            lower = max(lower or -np.inf, cert * full.cost_unit)
            info["lp_objective"] = res.objective * model.cost_unit
            info["lp_certified"] = cert >= res.objective - 1e-7 * max(1.0, abs(res.objective))
            if info["lp_certified"] or model is full or rounds >= pricing_rounds:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
            # column generation: admit the R and S columns that price out negative
            d = reduced_costs(full, model.row_key, res.row_dual)
            fi = full.index
            new_r = d[: fi.num_r] < -1e-7
            new_s = d[fi.s_off : fi.u_off] < -1e-7
            if not (new_r.any() or new_s.any()):
                break
            masks = (masks[0].copy(), masks[1].copy())
            masks[0][fi.r_t[new_r], fi.r_i[new_r]] = True
            masks[1][fi.s_t[new_s], fi.s_i[new_s]] = True
            grown = formulate(graph, budget, support=masks)
            rounds += 1
            nxt = lp(grown, factor, f"pricing round {rounds}")
            if nxt.x is None:
                break
            model, res = grown, nxt
            info.update(num_vars=model.num_vars, num_constraints=model.num_constraints, pricing_rounds=rounds)
        report(f"LP at {factor:g} x budget")
        x = res.x
        assert x is not None
        found = round_threshold_sweep(
            graph, budget, model.index.dense_s(x), thresholds, deadline, hard_deadline
        )
        if found is not None and (best is None or found[2] < best[2]):
            best, best_factor = found, factor
        report(f"rounded LP at {factor:g} x budget")
        if best is not None and lower is not None and best[2] <= lower * (1 + _BOUND_TOL):
            break  # meets the bound: optimal
    solve_s = time.perf_counter() - t0 - build
    if best is None:
        if lower is None and deadline is not None and time.perf_counter() >= deadline:
            reason = "time limit reached before the LP relaxation was solved"
        else:
            reason = "no rounding of the LP solutions fits the budget"
        return SolveResult(
            "lp-rounding",
            Status.NO_SOLUTION,
            budget,
            lower_bound=lower,
            build_seconds=build,
            solve_seconds=solve_s,
            info={**info, "reason": reason},
        )
    R, S, _, theta = best
    schedule = schedule_from_rs(graph, R, S)
    sim = simulate(graph, schedule)
    info.update(threshold=theta, budget_factor=best_factor)
    optimal = lower is not None and sim.cost <= lower * (1 + _BOUND_TOL)
    return SolveResult(
        "lp-rounding",
        Status.OPTIMAL if optimal else Status.FEASIBLE,
        budget,
        schedule,
        sim.cost,
        sim.peak,
        lower_bound=lower,
        build_seconds=build,
        solve_seconds=solve_s,
        info=info,
    )
