"""The Checkmate MILP through PuLP: write MPS/LP files, or solve with any PuLP solver.

The portable path for users who have another solver (CBC, Gurobi, CPLEX, ...): the model is
the same sparse model that :func:`solvers.formulation.formulate` builds for HiGHS, with
the same scaling (memory in units of the budget, so every ``U`` is at most 1; cost in units
of the mean node cost). Variables are named ``R_t_i``, ``S_t_i``, ``U_t_k`` and
``FREE_t_i_p`` after their stage and nodes, so a solution read back from any solver can be
decoded through the model's index.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from solvers.bounds import below_floor
from solvers.errors import SolverError
from solvers.formulation import MilpModel, decode_schedule, formulate
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import simulate

__all__ = ["to_pulp", "pulp_problem", "write_mps", "write_lp", "solve_pulp"]

#: PuLP solution status (``prob.sol_status``) -> project status
_PULP_STATUS = {1: Status.OPTIMAL, 2: Status.FEASIBLE, 0: Status.NO_SOLUTION, -1: Status.INFEASIBLE}


def _names(model: MilpModel) -> list[str]:
    idx = model.index
    names = [f"R_{t}_{i}" for t, i in zip(idx.r_t.tolist(), idx.r_i.tolist(), strict=True)]
    names += [f"S_{t}_{i}" for t, i in zip(idx.s_t.tolist(), idx.s_i.tolist(), strict=True)]
    names += [f"U_{t}_{k}" for t, k in zip(idx.r_t.tolist(), idx.r_i.tolist(), strict=True)]
    names += [
        f"FREE_{t}_{i}_{p}"
        for t, i, p in zip(idx.f_t.tolist(), idx.f_i.tolist(), idx.f_p.tolist(), strict=True)
    ]
    return names


def pulp_problem(model: MilpModel, *, relax: bool = False, name: str = "checkmate") -> tuple[Any, list[Any]]:
    """A PuLP problem for a built model, and its variables in column order.

    Args:
        model: from :func:`solvers.formulation.formulate`.
        relax: make every variable continuous (the LP relaxation).
        name: the problem's name.

    Returns:
        ``(problem, variables)``; ``variables[j]`` is column j of the model.
    """
    import pulp

    prob = pulp.LpProblem(name, pulp.LpMinimize)
    lo, hi, integ = model.col_lower, model.col_upper, model.integrality
    variables = [
        prob.add_variable(
            nm,
            float(lo[j]),
            float(hi[j]),
            # integer in [lo, hi], not LpBinary: that category resets the bounds to [0, 1]
            cat=pulp.LpInteger if integ[j] and not relax else pulp.LpContinuous,
        )
        for j, nm in enumerate(_names(model))
    ]
    nz = np.flatnonzero(model.cost)
    prob.setObjective(pulp.LpAffineExpression([(variables[j], float(model.cost[j])) for j in nz.tolist()]))
    A = model.A.tocsr()
    for r in range(A.shape[0]):
        cols = A.indices[A.indptr[r] : A.indptr[r + 1]].tolist()
        vals = A.data[A.indptr[r] : A.indptr[r + 1]].tolist()
        expr = pulp.LpAffineExpression([(variables[c], v) for c, v in zip(cols, vals, strict=True)])
        rlo, rhi = float(model.row_lower[r]), float(model.row_upper[r])
        if rlo == rhi:
            prob += pulp.LpConstraint(expr, pulp.LpConstraintEQ, f"c{r}", rhi)
            continue
        if np.isfinite(rhi):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintLE, f"c{r}", rhi)
        if np.isfinite(rlo):
            prob += pulp.LpConstraint(expr, pulp.LpConstraintGE, f"c{r}_lo", rlo)
    return prob, variables


def to_pulp(graph: Graph, budget: int, *, relax: bool = False) -> Any:
    """The Checkmate MILP for ``graph`` under ``budget`` bytes as a ``pulp.LpProblem``.

    Example:
        >>> prob = to_pulp(graph, 10**9)  # doctest: +SKIP
        >>> prob.solve(pulp.HiGHS(msg=False))  # doctest: +SKIP
    """
    return pulp_problem(formulate(graph, budget), relax=relax, name=_safe(graph.name))[0]


def write_mps(graph: Graph, budget: int, path: str | Path, *, relax: bool = False) -> Path:
    """Write the MILP as a free-format MPS file; returns the path."""
    out = Path(path)
    to_pulp(graph, budget, relax=relax).writeMPS(str(out))
    return out


def write_lp(graph: Graph, budget: int, path: str | Path, *, relax: bool = False) -> Path:
    """Write the MILP as a CPLEX LP file; returns the path."""
    out = Path(path)
    to_pulp(graph, budget, relax=relax).writeLP(str(out))
    return out


def solve_pulp(
    graph: Graph,
    budget: int,
    solver: Any = None,
    *,
    time_limit: float | None = None,
) -> SolveResult:
    """Solve the MILP with a PuLP solver and decode its solution into a schedule.

    Args:
        graph: the graph.
        budget: bytes.
        solver: a PuLP solver object (e.g. ``pulp.HiGHS(msg=False)``, ``pulp.GUROBI()``);
            None uses PuLP's default (its bundled CBC) with ``time_limit``.
        time_limit: seconds, for the default solver (set it on your own solver object).

    Returns:
        A SolveResult with strategy ``"pulp"``.

    Raises:
        SolverError: the solver failed or returned a status PuLP does not classify.
    """
    import pulp

    t0 = time.perf_counter()
    if (early := below_floor("pulp", graph, budget)) is not None:
        return early
    model = formulate(graph, budget)
    prob, variables = pulp_problem(model, name=_safe(graph.name))
    build = time.perf_counter() - t0
    with warnings.catch_warnings():
        # PuLP 3.3 marks PULP_CBC_CMD as deprecated in favour of a separately installed CBC;
        # the bundled binary is exactly what a default install has.
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"pulp(\.|$)")
        if solver is None:
            solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
        try:
            prob.solve(solver)
        except pulp.PulpSolverError as exc:
            raise SolverError(f"PuLP solver {type(solver).__name__} failed: {exc}") from exc
    solve_s = time.perf_counter() - t0 - build
    status = _PULP_STATUS.get(int(prob.sol_status))
    if status is None:
        raise SolverError(f"PuLP solver returned status {pulp.LpStatus.get(prob.status, prob.status)!r}")
    common: dict[str, Any] = {
        "build_seconds": build,
        "solve_seconds": solve_s,
        "info": {"num_vars": model.num_vars, "num_constraints": model.num_constraints},
    }
    if status in (Status.INFEASIBLE, Status.NO_SOLUTION):
        return SolveResult("pulp", status, budget, **common)
    x = np.array([v.value() or 0.0 for v in variables], dtype=np.float64)
    schedule = decode_schedule(graph, model.index, x)
    sim = simulate(graph, schedule)
    if sim.peak > budget:
        status = Status.NO_SOLUTION
    return SolveResult("pulp", status, budget, schedule, sim.cost, sim.peak, **common)


def _safe(name: str) -> str:
    cleaned = "".join(c if c.isalnum() else "_" for c in name)
    return cleaned or "checkmate"
