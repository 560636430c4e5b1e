"""The one boundary to HiGHS (highspy): sparse arrays in, numpy and project statuses out.

Nothing of highspy leaves this module: HiGHS model statuses map to
:class:`solvers.result.Status` through one table (:data:`STATUS_TABLE`), and HiGHS
failures become :class:`solvers.errors.SolverError`.

Time limits: HiGHS checks its ``time_limit`` only at some points. Measured with HiGHS
1.15 on the public graphs, the MIP overruns it by tens of seconds: the analytic-centre
IPM that its root node runs (a separate solver object without a time limit, 200
iterations) and its setup after presolve take 20-50 s on MobileNet and ResNet50, with
no callback in between. So a MIP or LP with a time limit and at least
:data:`ISOLATE_MIN_NNZ` (LPs: :data:`ISOLATE_MIN_NNZ_LP`) nonzeros runs in a worker process (:mod:`solvers._highs_worker`)
that streams MIP incumbents back and is killed when the limit (plus :func:`kill_grace`)
has passed; the best incumbent and the last reported bound are then the result. An LP
returns its column values, row duals, objective and status from the worker; one killed
at the limit returns status NO_SOLUTION (model status ``kTimeLimit``) and no solution.

HiGHS: Huangfu & Hall, "Parallelizing the dual revised simplex method", Math. Prog.
Comp. 2018; the MIP solver is branch-and-cut with primal heuristics.

The module is over 450 lines because it is the solver boundary: the only code that touches
highspy objects (passing the model, options, the progress and incumbent callbacks, reading
results and mapping statuses) must live in one module so that no highspy type leaves it;
the worker process runs :func:`solve_here` from here rather than a copy of it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers.errors import SolverError
from solvers.result import Status

__all__ = [
    "HighsProblem",
    "HighsResult",
    "STATUS_TABLE",
    "ISOLATE_MIN_NNZ",
    "ISOLATE_MIN_NNZ_LP",
    "solve",
    "kill_grace",
    "ProgressHook",
]

FloatArray = npt.NDArray[np.float64]

#: (elapsed seconds, incumbent objective or None, dual bound or None, phase) -> None
ProgressHook = Callable[[float, float | None, float | None, str], None]
#: (column vector, objective, dual bound or None) -> None, on each improving MIP solution
IncumbentHook = Callable[[FloatArray, float, float | None], None]

#: MIPs with a time limit and at least this many nonzeros run in a worker process (the
#: smallest model that overran its limit here had 340k; below this, a solve is too short
#: for the 0.5-1 s start of a worker, mostly importing scipy and highspy, to pay off)
ISOLATE_MIN_NNZ = 20_000
#: the same for LPs: those that overran here had 1.3M+ nonzeros, while LPs of 0.1-0.5M
#: kept their limits in-process and would pay the worker's start on each of lp-rounding's LPs
ISOLATE_MIN_NNZ_LP = 500_000


def kill_grace(time_limit: float) -> float:
    """Seconds past ``time_limit`` after which an isolated solve is stopped by force (HiGHS
    normally stops itself at the limit; this leaves it time to return its answer)."""
    return 1.0 + 0.02 * time_limit


#: HiGHS model status name -> project status. None: a limit was hit, the status depends
#: on whether a feasible solution exists (FEASIBLE) or not (NO_SOLUTION). Names that are
#: absent (load/model/presolve/solve/postsolve errors, unbounded) raise SolverError.
STATUS_TABLE: dict[str, Status | None] = {
    "kOptimal": Status.OPTIMAL,
    "kModelEmpty": Status.OPTIMAL,
    "kInfeasible": Status.INFEASIBLE,
    # every variable of our models is bounded, so "unbounded or infeasible" is infeasible
    "kUnboundedOrInfeasible": Status.INFEASIBLE,
    "kTimeLimit": None,
    "kIterationLimit": None,
    "kSolutionLimit": None,
    "kInterrupt": None,
    "kHighsInterrupt": None,
    "kObjectiveBound": None,
    "kObjectiveTarget": None,
    "kMemoryLimit": None,
    "kUnknown": None,
}


@dataclass(frozen=True)
class HighsProblem:
    """``min cost·x + offset  s.t.  row_lower <= A x <= row_upper, col bounds``.

    ``integrality`` marks integer columns; None (or ``relax``) solves the LP.
    """

    A: sp.spmatrix | sp.sparray
    row_lower: FloatArray
    row_upper: FloatArray
    col_lower: FloatArray
    col_upper: FloatArray
    cost: FloatArray
    integrality: npt.NDArray[np.bool_] | None = None
    offset: float = 0.0


@dataclass(frozen=True)
class HighsResult:
    """What HiGHS returned, in project terms.

    Attributes:
        status: the mapped status.
        x: the best primal solution (None when there is none).
        objective: its objective value (None without one).
        bound: the best proven lower bound (MIP dual bound, or the LP optimum).
        mip_gap: relative gap between objective and bound (None for LPs / no solution).
        model_status: HiGHS's own status name, for logs.
        seconds: wall time of the solve.
        info: iteration and node counts.
        row_dual: the LP's row duals (None for MIPs or without a dual solution), in the
            convention ``cost - A^T row_dual = reduced costs``.
    """

    status: Status
    x: FloatArray | None
    objective: float | None
    bound: float | None
    mip_gap: float | None
    model_status: str
    seconds: float
    info: Mapping[str, Any] = field(default_factory=dict)
    row_dual: FloatArray | None = None


@dataclass(frozen=True)
class _Settings:
    """Everything :func:`solve` passes to HiGHS (picklable, for the worker process).

    ``wall_deadline`` (a ``time.time()`` value) replaces ``time_limit`` when set: the limit
    is then what is left of it just before HiGHS runs.
    """

    relax: bool
    time_limit: float | None
    mip_rel_gap: float
    threads: int | None
    mip_heuristic_effort: float | None
    start: FloatArray | None
    lp_solver: str | None
    presolve: bool
    feasibility_tolerance: float
    options: dict[str, Any]
    log: bool
    wall_deadline: float | None = None


def solve(
    problem: HighsProblem,
    *,
    relax: bool = False,
    time_limit: float | None = None,
    mip_rel_gap: float = 1e-4,
    threads: int | None = None,
    mip_heuristic_effort: float | None = None,
    start: npt.ArrayLike | None = None,
    lp_solver: str | None = None,
    presolve: bool = True,
    feasibility_tolerance: float = 1e-9,
    progress: ProgressHook | None = None,
    progress_interval: float = 1.0,
    options: Mapping[str, Any] | None = None,
    log: bool = False,
    isolate: bool | None = None,
) -> HighsResult:
    """Solve a MILP (or its LP relaxation) with HiGHS.

    Args:
        problem: the sparse problem.
        relax: drop integrality (solve the LP relaxation).
        time_limit: seconds; at the limit the best incumbent is returned (status FEASIBLE)
            or NO_SOLUTION when there is none.
        mip_rel_gap: relative MIP gap at which the solve stops as optimal.
        threads: HiGHS threads (None: HiGHS's default).
        mip_heuristic_effort: share of MIP effort on primal heuristics (HiGHS default 0.05).
        start: a feasible column vector passed to HiGHS as an incumbent (``setSolution``).
        lp_solver: HiGHS ``solver`` option: "simplex", "ipm", "pdlp" or "choose".
        presolve: run HiGHS presolve.
        feasibility_tolerance: primal and MIP feasibility tolerance (tight by default so
            that memory rows scaled to the budget hold to within bytes).
        progress: called with (elapsed, incumbent, bound, phase) on improving solutions and
            about every ``progress_interval`` seconds during the MIP search.
        progress_interval: seconds between periodic progress calls.
        options: further HiGHS options by name.
        log: print HiGHS's log to the console (stderr when isolated).
        isolate: run HiGHS in a worker process that is stopped by force at the time limit
            (see the module doc). None: for MIPs with a time limit and at least
            :data:`ISOLATE_MIN_NNZ` nonzeros, LPs with :data:`ISOLATE_MIN_NNZ_LP`. Without a time limit there is nothing to
            enforce and the solve runs here.

    Returns:
        A :class:`HighsResult`. An isolated solve stopped by force has model status
        ``kTimeLimit`` and ``info["killed"] = True``; a MIP keeps the best incumbent HiGHS
        reported (or ``start``) and the last dual bound it reported, an LP has no
        solution (status NO_SOLUTION, ``x`` and ``row_dual`` None).

    Raises:
        SolverError: HiGHS rejected the model or an option, or failed while solving.
    """
    is_mip = not relax and problem.integrality is not None and bool(np.any(problem.integrality))
    xs = None
    if start is not None and is_mip:
        xs = np.ascontiguousarray(start, dtype=np.float64)
        if xs.shape != (len(problem.cost),):
            raise SolverError(f"start vector has shape {xs.shape}; expected ({len(problem.cost)},)")
    settings = _Settings(
        relax=bool(relax),
        time_limit=None if time_limit is None else float(max(time_limit, 0.0)),
        mip_rel_gap=float(mip_rel_gap),
        threads=threads,
        mip_heuristic_effort=mip_heuristic_effort,
        start=xs,
        lp_solver=lp_solver,
        presolve=bool(presolve),
        feasibility_tolerance=float(feasibility_tolerance),
        options=dict(options or {}),
        log=bool(log),
    )
    if isolate is None:
        isolate = sp.csc_matrix(problem.A).nnz >= (ISOLATE_MIN_NNZ if is_mip else ISOLATE_MIN_NNZ_LP)
    t0 = time.perf_counter()
    res = _run(problem, settings, progress, progress_interval, isolate)
    if res.status == Status.INFEASIBLE and settings.presolve:
        # HiGHS 1.16's presolve has proven feasible MILPs infeasible (a 9-node Checkmate model at
        # exactly its keep-all peak, where checkpoint-all fits): an infeasibility claim is
        # believed only when the model without presolve confirms it in the time left
        left = None if settings.time_limit is None else settings.time_limit - (time.perf_counter() - t0)
        if left is None or left > 0:
            again = dataclasses.replace(settings, presolve=False, time_limit=left)
            check = _run(problem, again, progress, progress_interval, isolate)
            res = check if check.status != Status.INFEASIBLE else res
            if check.status not in (Status.INFEASIBLE, Status.OPTIMAL, Status.FEASIBLE):
                res = dataclasses.replace(check, status=Status.NO_SOLUTION)
        else:
            res = dataclasses.replace(res, status=Status.NO_SOLUTION)
    return res


def _run(
    problem: HighsProblem,
    settings: _Settings,
    progress: ProgressHook | None,
    progress_interval: float,
    isolate: bool,
) -> HighsResult:
    # an embedded interpreter (empty sys.executable) cannot start a worker: solve here
    if isolate and settings.time_limit is not None and sys.executable:
        from solvers._highs_worker import solve_isolated

        return solve_isolated(problem, settings, progress, progress_interval)
    return solve_here(problem, settings, progress, progress_interval)


def _new_highs(log: bool) -> Any:
    """A ``highspy.Highs``; without ``log`` its copyright banner, which the constructor
    prints to the C-level stdout before any option can silence it, goes to /dev/null."""
    import highspy

    if log:
        return highspy.Highs()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            return highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve_here(
    problem: HighsProblem,
    settings: _Settings,
    progress: ProgressHook | None = None,
    progress_interval: float = 1.0,
    on_incumbent: IncumbentHook | None = None,
) -> HighsResult:
    """:func:`solve` in this process (the worker's body too); ``on_incumbent`` receives
    each improving MIP solution. Internal: callers use :func:`solve`."""
    import highspy

    h = _new_highs(settings.log)
    t0 = time.perf_counter()
    callback_error: list[BaseException] = []
    try:
        _set(h, "output_flag", settings.log)
        _set(h, "log_to_console", settings.log)
        _set(h, "primal_feasibility_tolerance", settings.feasibility_tolerance)
        _set(h, "mip_feasibility_tolerance", settings.feasibility_tolerance)
        _set(h, "mip_rel_gap", settings.mip_rel_gap)
        _set(h, "presolve", "on" if settings.presolve else "off")
        if settings.time_limit is not None:
            _set(h, "time_limit", settings.time_limit)
        if settings.threads is not None:
            _set(h, "threads", int(settings.threads))
        if settings.mip_heuristic_effort is not None:
            _set(h, "mip_heuristic_effort", float(settings.mip_heuristic_effort))
        if settings.lp_solver is not None:
            _set(h, "solver", str(settings.lp_solver))
        for name, value in settings.options.items():
            _set(h, name, value)
        is_mip = not settings.relax and problem.integrality is not None and bool(np.any(problem.integrality))
        _pass_model(h, highspy, problem, is_mip)
        xs = settings.start
        if xs is not None and is_mip:
            _check(h.setSolution(len(xs), np.arange(len(xs), dtype=np.int32), xs), highspy, "setSolution")
        if progress is not None:
            _attach_progress(h, progress, progress_interval, t0, is_mip, callback_error)
        if on_incumbent is not None and is_mip:
            _attach_incumbent(h, on_incumbent, callback_error)
        if settings.wall_deadline is not None:  # what is left after passing the model
            _set(h, "time_limit", max(settings.wall_deadline - time.time(), 0.0))
        status = h.run()
        if callback_error:
            raise callback_error[0]
        if status == highspy.HighsStatus.kError:
            raise SolverError(f"HiGHS failed: {h.modelStatusToString(h.getModelStatus())}")
        return _result(h, highspy, is_mip, time.perf_counter() - t0)
    except SolverError:
        raise
    except Exception as exc:
        if callback_error and exc is callback_error[0]:
            raise  # the user's progress callback failed: its error, unchanged  # highspy raises plain exceptions (RuntimeError, TypeError, ...)
        raise SolverError(f"HiGHS failed: {type(exc).__name__}: {exc}") from exc
    finally:
        h.clear()


def _set(h: Any, name: str, value: Any) -> None:
    import highspy

    if h.setOptionValue(name, value) != highspy.HighsStatus.kOk:
        raise SolverError(f"HiGHS rejected option {name}={value!r}; check the option name and type")


def _check(status: Any, highspy: Any, what: str) -> None:
    if status == highspy.HighsStatus.kError:
        raise SolverError(f"HiGHS {what} failed")


def _pass_model(h: Any, highspy: Any, problem: HighsProblem, is_mip: bool) -> None:
    A = sp.csc_matrix(problem.A)
    A.sort_indices()
    num_row, num_col = A.shape
    integrality = np.zeros(num_col, dtype=np.int32)
    if is_mip and problem.integrality is not None:
        integrality[np.asarray(problem.integrality, dtype=bool)] = 1  # kInteger
    # the array overload of passModel avoids building a HighsLp attribute by attribute
    status = h.passModel(
        int(num_col),
        int(num_row),
        int(A.nnz),
        int(highspy.MatrixFormat.kColwise),
        int(highspy.ObjSense.kMinimize),
        float(problem.offset),
        np.ascontiguousarray(problem.cost, dtype=np.float64),
        np.ascontiguousarray(problem.col_lower, dtype=np.float64),
        np.ascontiguousarray(problem.col_upper, dtype=np.float64),
        np.ascontiguousarray(problem.row_lower, dtype=np.float64),
        np.ascontiguousarray(problem.row_upper, dtype=np.float64),
        np.ascontiguousarray(A.indptr, dtype=np.int32),
        np.ascontiguousarray(A.indices, dtype=np.int32),
        np.ascontiguousarray(A.data, dtype=np.float64),
        integrality,
    )
    _check(status, highspy, "passModel")


def _attach_progress(
    h: Any,
    progress: ProgressHook,
    interval: float,
    t0: float,
    is_mip: bool,
    errors: list[BaseException],
) -> None:
    last = [-math.inf]

    def report(incumbent: float | None, bound: float | None, phase: str, force: bool) -> None:
        now = time.perf_counter() - t0
        if not force and now - last[0] < interval:
            return
        last[0] = now
        try:
            progress(now, incumbent, bound, phase)
        except BaseException as exc:  # never let a user callback unwind through C++
            errors.append(exc)

    def finite(v: float) -> float | None:
        return float(v) if math.isfinite(v) else None

    def on_improving(e: Any) -> None:
        out = e.data_out
        report(finite(out.objective_function_value), finite(out.mip_dual_bound), "incumbent", True)

    def on_interrupt(e: Any) -> None:
        out = e.data_out
        report(finite(out.mip_primal_bound), finite(out.mip_dual_bound), "branch-and-bound", False)
        if errors:
            e.interrupt()

    def on_lp(e: Any) -> None:
        report(None, None, "LP", False)
        if errors:
            e.interrupt()

    if is_mip:
        h.cbMipImprovingSolution.subscribe(on_improving)
        h.cbMipInterrupt.subscribe(on_interrupt)
    else:
        h.cbSimplexInterrupt.subscribe(on_lp)
        h.cbIpmInterrupt.subscribe(on_lp)


def _attach_incumbent(h: Any, hook: IncumbentHook, errors: list[BaseException]) -> None:
    def on_improving(e: Any) -> None:
        out = e.data_out
        bound = float(out.mip_dual_bound)
        try:
            hook(
                np.array(out.mip_solution, dtype=np.float64),
                float(out.objective_function_value),
                bound if math.isfinite(bound) else None,
            )
        except BaseException as exc:  # never let a callback unwind through C++
            errors.append(exc)
            e.interrupt()

    h.cbMipImprovingSolution.subscribe(on_improving)


def _result(h: Any, highspy: Any, is_mip: bool, seconds: float) -> HighsResult:
    ms = h.getModelStatus()
    name = ms.name if hasattr(ms, "name") else str(ms).split(".")[-1]
    if name not in STATUS_TABLE:
        raise SolverError(f"HiGHS ended with status {h.modelStatusToString(ms)!r} ({name})")
    mapped = STATUS_TABLE[name]
    info = h.getInfo()
    has_x = int(info.primal_solution_status) == int(highspy.kSolutionStatusFeasible)
    x = np.array(h.getSolution().col_value, dtype=np.float64) if has_x else None
    objective = float(info.objective_function_value) if has_x else None
    if is_mip:
        bound: float | None = float(info.mip_dual_bound)
        gap: float | None = float(info.mip_gap) if has_x else None
    else:
        bound = objective if name == "kOptimal" else None
        gap = None
    if bound is not None and not math.isfinite(bound):
        bound = None
    if gap is not None and not math.isfinite(gap):
        gap = None
    if mapped is None:
        mapped = Status.FEASIBLE if has_x else Status.NO_SOLUTION
    elif mapped == Status.OPTIMAL and not has_x:
        if name == "kModelEmpty":
            x = np.zeros(0)
        else:
            raise SolverError("HiGHS reported optimal without a primal solution")
    row_dual = None
    if not is_mip and int(info.dual_solution_status) == int(highspy.kSolutionStatusFeasible):
        row_dual = np.array(h.getSolution().row_dual, dtype=np.float64)
    stats = {
        "simplex_iterations": int(info.simplex_iteration_count),
        "ipm_iterations": int(info.ipm_iteration_count),
        "mip_nodes": int(info.mip_node_count) if is_mip else 0,
    }
    return HighsResult(mapped, x, objective, bound, gap, name, seconds, stats, row_dual)
