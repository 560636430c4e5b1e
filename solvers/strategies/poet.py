"""POET: the Checkmate MILP extended with paging to host memory.

Patil, Jha, Ha, Gonzalez, Prasanna, "POET: Training Neural Networks on Tiny Devices with
Integrated Rematerialization and Paging", ICML 2022. POET adds to Checkmate's (R, S)
binaries a secondary store (host memory), page-out and page-in binaries, and charges every
transfer in the objective. This module builds that model on top of the Checkmate MILP of
:mod:`solvers.formulation` (same stages, variables, memory recurrence and HiGHS
boundary) and appends the paging columns and rows:

- ``IN[t,i]`` binary (wherever ``S[t,i]`` exists): i is paged in at the start of stage t.
  A paged-in value is on the device like a kept one: ``IN`` gets every coefficient of
  ``S[t,i]`` (memory at the stage start, dependencies ``R[t,j] <= R[t,i] + S[t,i] +
  IN[t,i]``, and may be kept into t+1: ``S[t+1,i] <= S[t,i] + R[t,i] + IN[t,i]``) except
  the one that says "resident at t only if present at t-1".
- ``OUT[i]`` binary: i is paged out right after its first computation (stage i). POET's
  host residency ``S_host[t,i]`` collapses to ``OUT[i]`` for every t > i: host memory is
  unbounded and a host copy persists, and paging out at stage i dominates paging out later
  (the same bytes, no device memory, the value is on the device then anyway).
- ``IN[t,i] <= OUT[i]`` (a page-in needs the host copy), ``IN[t,i] + S[t,i] <= 1``.
- Non-recomputable values are no longer pinned in device memory: paging them out and in
  again is the one way to lower the memory they hold (it is not a recompute).
- Objective: ``Σ cost_i R[t,i] + Σ c_i (OUT[i] + Σ_t IN[t,i])`` with the transfer time
  ``c_i = latency + mem_i / bandwidth`` of the host link (a device profile's
  ``host_bandwidth`` and ``host_latency``, or given directly).

Simplifications (ours): time, not energy (the shipped profiles carry no power figures),
and no runtime constraint; transfers are not overlapped with compute (each costs its full
time); a page-in holds its device memory from the start of its stage; host memory is
unbounded. Decoded schedules use the steps ``("pageout", i)`` and ``("pagein", i)`` that
:func:`solvers.schedule.simulate` replays and charges with the same ``c_i``.

A schedule that computes every node once, pages every value out after computing it and
pages each input in for the stage that reads it fits any budget at or above the largest
single-op working set (:func:`solvers.bounds.memory_lower_bound`); it is the MILP's first
incumbent, so POET always has a schedule where that bound allows one, including budgets
where the no-paging MILP is infeasible.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers import highs
from solvers.bounds import below_floor, memory_lower_bound
from solvers.errors import ScheduleError, SolverError
from solvers.formulation import (
    BoolMatrix,
    FloatArray,
    IntArray,
    MilpModel,
    formulate,
    max_violation,
    problem_of,
    progress_hook,
)
from solvers.graph import Graph
from solvers.hostlink import HostLink, host_link
from solvers.result import ProgressFn, SolveResult, Status
from solvers.schedule import PAGEIN, PAGEOUT, Schedule, schedule_from_order, schedule_from_rs, simulate
from solvers.stages import complete_rs, s_from_schedule, stage_memory

__all__ = [
    "HostLink",
    "host_link",
    "PagingIndex",
    "PoetModel",
    "formulate_poet",
    "encode_poet",
    "decode_poet",
    "page_all_schedule",
    "poet",
]


@dataclass(frozen=True)
class PagingIndex:
    """Where the paging columns live (appended after the Checkmate MILP's columns).

    Attributes:
        in_off: first IN column; IN column ``in_off + k`` belongs to S column k
            (stage ``index.s_t[k]``, node ``index.s_i[k]``).
        out_off: first OUT column; OUT column ``out_off + m`` belongs to node ``out_node[m]``.
        out_node: the nodes that can be paged out (those with a later stage to read them).
        out_col: (n,) column of each node's OUT, -1 where there is none.
    """

    in_off: int
    out_off: int
    out_node: IntArray
    out_col: IntArray


@dataclass(frozen=True)
class PoetModel:
    """The POET MILP: ``milp`` holds the extended arrays (its ``index`` still maps R, S,
    U, FREE); ``paging`` maps IN and OUT; ``link`` is what transfers cost."""

    milp: MilpModel
    paging: PagingIndex
    link: HostLink


def formulate_poet(graph: Graph, budget: int, link: HostLink) -> PoetModel:
    """Build the POET MILP (see the module doc) on top of the Checkmate MILP.

    Args:
        graph: the graph.
        budget: device memory budget in bytes.
        link: the host link whose transfer times enter the objective.

    Returns:
        The model.
    """
    base = formulate(graph, budget)
    idx = base.index
    n, num_s, S0 = graph.n, idx.num_s, idx.s_off
    A = sp.csc_matrix(base.A)
    rows, cols = A.shape

    # IN columns: S's columns without their +1, which sits in the row "kept into stage t only
    # if present in stage t-1" (S's other coefficients are <= 0: memory, dependencies, the
    # release of stage t)
    s_block = A[:, S0 : S0 + num_s].tocoo()
    positive = s_block.data > 0
    if np.bincount(s_block.col[positive], minlength=num_s).max(initial=0) > 1:
        raise AssertionError("formulation.formulate changed: an S column has more than one positive entry")
    in_block = sp.csc_matrix(
        (s_block.data[~positive], (s_block.row[~positive], s_block.col[~positive])), shape=(rows, num_s)
    )

    has_s = np.zeros(n, dtype=bool)
    has_s[idx.s_i] = True
    out_node = np.flatnonzero(has_s).astype(np.int64)
    out_col = np.full(n, -1, dtype=np.int64)
    in_off = cols
    out_off = cols + num_s
    out_col[out_node] = out_off + np.arange(len(out_node))
    total = out_off + len(out_node)

    # new rows: IN[t,i] - OUT[i] <= 0 and IN[t,i] + S[t,i] <= 1, one of each per IN column
    k = np.arange(num_s)
    new = sp.csr_matrix(
        (
            np.concatenate([np.ones(num_s), -np.ones(num_s), np.ones(num_s), np.ones(num_s)]),
            (
                np.concatenate([k, k, num_s + k, num_s + k]),
                np.concatenate([in_off + k, out_col[idx.s_i], in_off + k, S0 + k]),
            ),
        ),
        shape=(2 * num_s, total),
    )
    wide = sp.hstack([A, in_block, sp.csc_matrix((rows, len(out_node)))], format="csr")
    A_all = sp.vstack([wide, new], format="csr")

    col_lo = np.concatenate([base.col_lower, np.zeros(num_s + len(out_node))])
    col_lo[S0 : S0 + num_s] = 0.0  # non-recomputable values may now leave the device
    col_hi = np.concatenate([base.col_upper, np.ones(num_s + len(out_node))])
    xfer = np.array([link.time(int(b)) for b in graph.mem], dtype=np.float64) / base.cost_unit
    cost = np.concatenate([base.cost, xfer[idx.s_i], xfer[out_node]])
    integrality = np.concatenate([base.integrality, np.ones(num_s + len(out_node), dtype=bool)])
    milp = dataclasses.replace(
        base,
        A=A_all,
        row_lower=np.concatenate([base.row_lower, np.full(2 * num_s, -np.inf)]),
        row_upper=np.concatenate([base.row_upper, np.zeros(num_s), np.ones(num_s)]),
        col_lower=col_lo,
        col_upper=col_hi,
        cost=cost,
        integrality=integrality,
    )
    return PoetModel(milp, PagingIndex(in_off, out_off, out_node, out_col), link)


def _dense(
    model: PoetModel, x: FloatArray
) -> tuple[BoolMatrix, BoolMatrix, BoolMatrix, npt.NDArray[np.bool_]]:
    idx, pg = model.milp.index, model.paging
    R, S = idx.decode(x)
    IN = np.zeros((idx.n, idx.n), dtype=bool)
    IN[idx.s_t, idx.s_i] = x[pg.in_off : pg.in_off + idx.num_s] > 0.5
    OUT = np.zeros(idx.n, dtype=bool)
    OUT[pg.out_node] = x[pg.out_off :] > 0.5
    return R, S, IN, OUT


def encode_poet(
    graph: Graph, model: PoetModel, R: BoolMatrix, S: BoolMatrix, IN: BoolMatrix, OUT: npt.ArrayLike
) -> FloatArray | None:
    """The column vector of binary (R, S, IN, OUT) (e.g. a warm start).

    FREE frees each value on the device (kept, paged in or computed) right after its last
    reader in the stage unless it is kept into the next one; U follows the recurrence.

    Returns:
        The vector, or None when it uses a variable the model lacks or breaks a row.
    """
    idx, pg, milp = model.milp.index, model.paging, model.milp
    Rm, Sm, INm = (np.asarray(a, dtype=bool) for a in (R, S, IN))
    OUTv = np.asarray(OUT, dtype=bool)
    x = np.zeros(milp.num_vars)
    x[: idx.num_r] = Rm[idx.r_t, idx.r_i]
    x[idx.s_off : idx.u_off] = Sm[idx.s_t, idx.s_i]
    x[pg.in_off : pg.in_off + idx.num_s] = INm[idx.s_t, idx.s_i]
    x[pg.out_off :] = OUTv[pg.out_node]
    if (
        x[: idx.num_r].sum() != Rm.sum()
        or x[idx.s_off : idx.u_off].sum() != Sm.sum()
        or x[pg.in_off : pg.in_off + idx.num_s].sum() != INm.sum()
        or x[pg.out_off :].sum() != OUTv.sum()
    ):
        return None
    # on the device at the stage start: kept or paged in; S alone says what is kept on
    sm = stage_memory(graph, Rm, Sm, present=Sm | INm)
    x[idx.f_off : pg.in_off] = sm.freed[idx.f_t, idx.f_i] & (sm.free_pos[idx.f_t, idx.f_i] == idx.f_p)
    x[idx.u_off : idx.f_off] = sm.U[idx.r_t, idx.r_i] / milp.mem_unit
    if max_violation(milp, x) > 1e-9:
        return None
    return x


def decode_poet(graph: Graph, R: BoolMatrix, S: BoolMatrix, IN: BoolMatrix, OUT: npt.ArrayLike) -> Schedule:
    """Steps for binary (R, S, IN, OUT) matrices: :func:`solvers.schedule.schedule_from_rs`
    with page-ins ``IN`` and page-outs ``OUT``.

    Stage t: free the values it neither reads nor keeps; page in ``IN[t]`` (those it reads
    or keeps and that are not on the device); compute ``R[t]`` in id order (skipping values
    already on the device), paging out right after its first computation a node with
    ``OUT``; free each value after its last reader unless ``S[t+1]`` keeps it.

    Raises:
        ScheduleError: the matrices are inconsistent (a read of a value that is neither
            on the device nor paged in, a page-in without a host copy).
    """
    return schedule_from_rs(graph, R, S, pagein=IN, pageout=OUT)


def _page_all(graph: Graph) -> tuple[BoolMatrix, BoolMatrix, BoolMatrix, npt.NDArray[np.bool_]]:
    n = graph.n
    R = np.eye(n, dtype=bool)
    S = np.zeros((n, n), dtype=bool)
    IN = np.zeros((n, n), dtype=bool)
    e = graph.edge_array
    if len(e):
        IN[e[:, 1], e[:, 0]] = True
    OUT: npt.NDArray[np.bool_] = np.asarray(IN.any(axis=0), dtype=bool)
    return R, S, IN, OUT


def page_all_schedule(graph: Graph) -> Schedule:
    """Compute each node once, page every value out after computing it and page each input
    in for the stage that reads it: peak = the largest single-op working set, no recompute,
    the most transfers. POET's first incumbent."""
    return decode_poet(graph, *_page_all(graph))


def poet(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    bandwidth: float | None = None,
    latency: float | None = None,
    profile: str | None = None,
    warm_start: Schedule | None = None,
    mip_gap: float = 1e-4,
    threads: int | None = None,
    progress: ProgressFn | None = None,
    heuristic_effort: float = 0.2,
    presolve: bool = True,
    log: bool = False,
) -> SolveResult:
    """Solve the POET MILP with HiGHS (strategy ``"poet"``).

    Args:
        graph: the graph.
        budget: device memory budget in bytes.
        time_limit: seconds for HiGHS; at the limit the best incumbent is returned.
        bandwidth: host link bytes per graph cost unit (overrides the profile's).
        latency: graph cost units per transfer (overrides the profile's).
        profile: device profile name or JSON path for the host link (see :func:`host_link`).
        warm_start: a schedule without paging steps to start from (its stage form is used
            when it fits); the page-everything schedule is always offered too.
        mip_gap: relative gap at which the result counts as optimal.
        threads: HiGHS threads.
        progress: called with :class:`SolveProgress` (incumbent and bound are compute +
            transfer cost).
        heuristic_effort: HiGHS ``mip_heuristic_effort``.
        presolve: run HiGHS presolve. HiGHS 1.15's MIP presolve can cut off the optimum and
            report a worse point as optimal (seen on a 10-node model whose transfers cost
            ~100x an op, cf. ERGO-Code/HiGHS issues #2900, #3094); False avoids that at
            some speed.
        log: print HiGHS's log.

    Returns:
        A SolveResult whose ``cost`` is the compute cost (as the simulator reports it);
        ``info`` holds ``transfer_cost``, ``total_cost`` (compute + transfer, the
        objective), ``bound`` (HiGHS's bound on the total), ``pageins``, ``pageouts``,
        ``transfer_bytes`` and ``host_link``. ``lower_bound`` is None: the MILP bounds the
        total, not the compute cost. INFEASIBLE only below the largest single-op working
        set (with ``info["min_budget"]``), where no schedule exists at all.

    Raises:
        CheckmateError: the host link cannot be determined.
        SolverError: HiGHS failed, or its solution does not decode into a valid schedule.
    """
    t0 = time.perf_counter()
    link = host_link(graph, bandwidth=bandwidth, latency=latency, profile=profile)
    info: dict[str, Any] = {
        "host_link": {"bandwidth": link.bandwidth, "latency": link.latency, "source": link.source}
    }
    if (early := below_floor("poet", graph, budget, exact=True, **info)) is not None:
        return early
    model = formulate_poet(graph, budget, link)
    milp = model.milp
    starts = [encode_poet(graph, model, *_page_all(graph))]
    no_paging = [schedule_from_order(graph, range(graph.n))] + ([warm_start] if warm_start else [])
    for sched in no_paging:
        S = s_from_schedule(graph, sched)
        if S is not None:
            R, S = complete_rs(graph, S)
            starts.append(encode_poet(graph, model, R, S, np.zeros_like(S), np.zeros(graph.n, dtype=bool)))
    feasible = [x for x in starts if x is not None]
    start = min(feasible, key=lambda x: float(milp.cost @ x)) if feasible else None
    build = time.perf_counter() - t0
    info.update(
        num_vars=milp.num_vars,
        num_constraints=milp.num_constraints,
        num_binaries=milp.num_binaries,
        start_objective=None if start is None else float(milp.cost @ start) * milp.cost_unit,
    )
    res = highs.solve(
        problem_of(milp),
        time_limit=time_limit,
        mip_rel_gap=mip_gap,
        threads=threads,
        mip_heuristic_effort=heuristic_effort,
        start=start,
        presolve=presolve,
        progress=progress_hook("poet", progress, t0, milp.cost_unit),
        log=log,
    )
    info.update(model_status=res.model_status, mip_gap=res.mip_gap, **res.info)
    info["bound"] = None if res.bound is None else res.bound * milp.cost_unit
    common: dict[str, Any] = {"build_seconds": build, "solve_seconds": res.seconds}
    if res.status == Status.INFEASIBLE:  # the page-everything schedule fits: a solver bug
        raise SolverError(
            f"HiGHS reports the POET model infeasible at {budget} bytes >= the floor {memory_lower_bound(graph)}"
        )
    if res.x is None:
        return SolveResult("poet", Status.NO_SOLUTION, budget, info=info, **common)
    try:
        schedule = decode_poet(graph, *_dense(model, res.x))
        sim = simulate(graph, schedule, transfer_time=link.time)
    except ScheduleError as exc:
        raise SolverError(f"poet: the MILP solution does not decode into a valid schedule: {exc}") from exc
    status = res.status
    if sim.peak > budget:  # numerical slack beyond the tolerances
        status = Status.NO_SOLUTION
        info["over_budget"] = sim.peak - budget
    info.update(
        objective=(res.objective or 0.0) * milp.cost_unit,
        compute_cost=sim.cost,
        transfer_cost=sim.transfer_cost,
        total_cost=sim.cost + sim.transfer_cost,
        pageins=sum(op == PAGEIN for op, _ in schedule.steps),
        pageouts=sum(op == PAGEOUT for op, _ in schedule.steps),
        transfer_bytes=sim.transfer_bytes,
    )
    return SolveResult("poet", status, budget, schedule, sim.cost, sim.peak, info=info, **common)
