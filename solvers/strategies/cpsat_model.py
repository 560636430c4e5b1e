"""Rematerialization as constraint programming with retention intervals, solved by CP-SAT.

Formulation after Moccasin (Bartan, Li, Teague, Hoffman, Tovar et al., "Moccasin: Efficient
Tensor Rematerialization for Neural Networks", ICML 2023), written from the paper, with
O(n) integer variables instead of the Checkmate MILP's O(n²) binaries:

- time is a sequence of integer slots, one compute per slot. Slots are staged as in the
  Checkmate MILP: stage t ends with the first compute of node t, and the recomputes of
  stage t run before it in id order, so the compute of v in stage t takes slot
  ``t * n + v``. First computes are constants; a recompute chooses only its stage;
- node v has up to ``C_v`` retention intervals ``[s_vk, e_vk)``: it is computed at slot
  ``s_vk`` and its output stays resident through slot ``e_vk - 1``. Interval 0 is
  mandatory, the others optional (presence ``p_vk``), ordered and disjoint
  (``e_v,k-1 <= s_vk``), so a resident value is never recomputed;
- memory: a ``Cumulative`` over all retention intervals with demand ``mem_v`` and capacity
  the budget. Usage at slot t is then exactly the simulator's reading right after the
  compute of slot t and before the frees that follow it (computing v allocates its output
  while its inputs are resident);
- precedence: each compute of v needs each input u resident: some present interval l of u
  with ``s_ul < s_vk < e_ul`` (a Boolean per (edge, k, l), at most C² per edge);
- objective: minimize Σ cost_v · p_vk (the first computes are a constant), plus the save
  cost of each value resident as the first backward node is computed (``Node.save_cost``).

Restrictions (the result is optimal *within* them; see ``info["restrictions"]``):
``C_v`` computes per node (``max_computes``, default 3); non-recomputable nodes, and
backward nodes when ``backward_once``, have C_v = 1; time is staged as in the Checkmate MILP (first
computes in id order; recomputes before the first compute of the stage's node, in id order),
the same frontier-advancing restriction as the MILP.
So a CP-SAT "infeasible" is not a proof that no schedule exists: it maps to ``no_solution``
unless the budget is below the single-op working-set bound.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from solvers import scaling
from solvers.bounds import below_floor
from solvers.errors import SolverError
from solvers.graph import Graph
from solvers.result import ProgressFn, SolveProgress, SolveResult, Status
from solvers.schedule import COMPUTE, FREE, Schedule, Step, simulate
from solvers.strategies.cpsat import MAX_COMPUTES

try:  # optional dependency: the strategy registry reports a missing package clearly
    from ortools.sat.python import cp_model
except ImportError as _exc:  # pragma: no cover - exercised only without ortools
    raise ImportError(
        "the cpsat strategy needs OR-Tools: pip install 'checkmate-remat[cpsat]' (or ortools)",
        name="ortools",
    ) from _exc

__all__ = ["solve_in_process", "CpsatModel", "build_model", "decode"]

_COST_RESOLUTION = 10**7  # total cost maps to this many integer units
_DECODE_MARGIN = 0.2  # seconds kept from a time limit for decoding and simulating

# One table from CP-SAT's statuses to the project's. INFEASIBLE holds only for this restricted
# model, so it is not a proof: proofs come from the working-set bound checked before solving.
_STATUS = {
    "OPTIMAL": Status.OPTIMAL,
    "FEASIBLE": Status.FEASIBLE,
    "INFEASIBLE": Status.NO_SOLUTION,
    "UNKNOWN": Status.NO_SOLUTION,
}


@dataclass
class CpsatModel:
    """A built model and the index of its variables (all that decoding needs).

    Attributes:
        model: the CP-SAT model.
        start, end, present: per node, its intervals' start (an int or an expression), end
            and presence.
        stage: per node, its intervals' stage variables (None for the first interval).
        horizon: number of time slots.
        cost_unit: cost represented by one integer unit of the objective.
        restrictions: human-readable list of the restrictions in force.
    """

    model: cp_model.CpModel
    start: list[list[Any]]
    end: list[list[Any]]
    present: list[list[Any]]
    stage: list[list[Any]]
    horizon: int
    cost_unit: float
    restrictions: list[str]


def _computes_allowed(graph: Graph, max_computes: int, backward_once: bool) -> tuple[np.ndarray, list[str]]:
    caps = np.full(graph.n, max(1, int(max_computes)), dtype=np.int64)
    notes = [f"at most {int(max_computes)} computes per node"]
    caps[~graph.recomputable_mask] = 1
    if backward_once:
        caps[graph.backward_mask] = 1
        notes.append("backward nodes computed once")
    # A node nobody reads is never worth recomputing.
    caps[[i for i in range(graph.n) if not graph.succs[i]]] = 1
    return caps, notes


def build_model(
    graph: Graph,
    budget: int,
    *,
    max_computes: int = MAX_COMPUTES,
    backward_once: bool = True,
) -> CpsatModel:
    """Build the retention-interval model of ``graph`` under ``budget`` bytes.

    Time is staged as in the Checkmate MILP: stage t ends with the first compute of node t,
    and recomputes in stage t run in id order before it, so the compute of v in stage t
    happens at slot ``t * n + v`` (distinct for distinct (stage, node) pairs). First
    computes are thus fixed (slot ``v * (n + 1)``); a recompute only chooses its stage.

    Args:
        graph: the graph.
        budget: memory budget in bytes (the capacity of the cumulative).
        max_computes: intervals per recomputable node (C).
        backward_once: backward nodes get one interval (a restriction).

    Returns:
        The model with its variable index.
    """
    n = graph.n
    caps, notes = _computes_allowed(graph, max_computes, backward_once)
    notes.append("first computes in id order, recomputes in id order within a stage")
    horizon = n * n
    m = cp_model.CpModel()
    # Memory in units of the gcd of all sizes: exact, and smaller numbers propagate faster.
    sizes = [int(x) for x in graph.mem if x > 0]
    g = math.gcd(*sizes) if sizes else 1
    demand = (graph.mem // g).astype(np.int64)
    capacity = min(int(budget), int(graph.mem.sum())) // g  # a larger budget changes nothing
    scaling.check_cost_span(graph, "CP-SAT")  # GraphError beyond a 1e9 span of costs
    total = graph.total_cost
    cost_unit = total / _COST_RESOLUTION if total > 0 else 1.0
    icost = np.rint(graph.cost / cost_unit).astype(np.int64)

    start: list[list[Any]] = []
    end: list[list[Any]] = []
    present: list[list[Any]] = []
    stages: list[list[Any]] = []
    mem_ivs: list[Any] = []
    mem_dem: list[int] = []
    for v in range(n):
        sv: list[Any] = []
        ev: list[Any] = []
        pv: list[Any] = []
        tv: list[Any] = []
        for k in range(int(caps[v])):
            if k == 0:
                s: Any = v * (n + 1)
                e = m.new_int_var(s + 1, horizon, f"e{v}_{k}")
                iv = m.new_interval_var(s, e - s, e, f"iv{v}_{k}")
                p: Any = m.new_constant(1)
                stage: Any = None
            else:
                stage = m.new_int_var(v + 1, n - 1, f"t{v}_{k}")
                s = n * stage + v
                e = m.new_int_var(v * (n + 1) + 2, horizon, f"e{v}_{k}")
                p = m.new_bool_var(f"p{v}_{k}")
                size = m.new_int_var(1, horizon, f"d{v}_{k}")
                iv = m.new_optional_interval_var(s, size, e, p, f"iv{v}_{k}")
                # ordered, disjoint intervals; absent ones pinned to break symmetry
                m.add_implication(p, pv[k - 1])
                m.add(s >= ev[k - 1]).only_enforce_if(p)
                m.add(stage == v + 1).only_enforce_if(p.Not())
                m.add(size == 1).only_enforce_if(p.Not())
            if demand[v] > 0:
                mem_ivs.append(iv)
                mem_dem.append(int(demand[v]))
            sv.append(s)
            ev.append(e)
            pv.append(p)
            tv.append(stage)
        stages.append(tv)
        start.append(sv)
        end.append(ev)
        present.append(pv)
    if mem_ivs:
        m.add_cumulative(mem_ivs, mem_dem, capacity)
    for u, v in graph.edges:
        for k in range(len(start[v])):
            if len(start[u]) == 1:  # u is never recomputed: its one interval must cover
                m.add(end[u][0] > start[v][k]).only_enforce_if(present[v][k])
                continue
            cover = []
            for lu in range(len(start[u])):
                b = m.new_bool_var(f"r{u}_{lu}_{v}_{k}")
                if lu > 0:
                    m.add_implication(b, present[u][lu])
                    m.add(start[u][lu] < start[v][k]).only_enforce_if(b)
                m.add(end[u][lu] > start[v][k]).only_enforce_if(b)
                cover.append(b)
            m.add_bool_or([present[v][k].Not(), *cover])
    objective = [int(icost[v]) * present[v][k] for v in range(n) for k in range(1, len(start[v]))]
    objective += _handed_over(m, graph, start, end, present, stages, cost_unit)
    m.minimize(sum(objective))
    return CpsatModel(m, start, end, present, stages, horizon, cost_unit, notes)


def _handed_over(
    m: Any,
    graph: Graph,
    start: list[list[Any]],
    end: list[list[Any]],
    present: list[list[Any]],
    stages: list[list[Any]],
    cost_unit: float,
) -> list[Any]:
    """Objective terms for the save costs (:attr:`solvers.graph.Node.save_cost`): a copy of
    v resident when the first backward node b is computed (slot ``X = b * (n + 1)``: computed
    before it, ``s < X``, and held through it, ``e > X``) pays v's save cost, as the
    simulator charges it. A Boolean per copy, forced up only when the copy covers X (the
    objective keeps it down otherwise)."""
    n, b = graph.n, graph.first_backward
    save = np.rint(graph.save_cost / cost_unit).astype(np.int64)
    if b >= n or not (save > 0).any():
        return []
    slot = b * (n + 1)
    terms: list[Any] = []
    for v in np.flatnonzero(save > 0).tolist():
        for k in range(len(start[v])):
            held = m.new_bool_var(f"h{v}_{k}")
            if k == 0:  # computed at slot v * (n + 1) < X: held through X unless it ends by X
                m.add(end[v][0] <= slot).only_enforce_if(held.Not())
            else:  # a recompute in a stage up to b runs before X
                early = m.new_bool_var(f"a{v}_{k}")
                m.add(stages[v][k] <= b).only_enforce_if(early)
                m.add(stages[v][k] > b).only_enforce_if(early.Not())
                m.add(end[v][k] <= slot).only_enforce_if([held.Not(), present[v][k], early])
            terms.append(int(save[v]) * held)
    return terms


def decode(graph: Graph, index: CpsatModel, value: Any) -> Schedule:
    """Steps from a solution: compute in slot order; free each interval's value after the
    last compute before its end. ``value`` maps a variable to its value (a solver's
    ``Value``)."""
    events: list[tuple[int, int, int]] = []  # (start, end, node)
    for v in range(graph.n):
        for k in range(len(index.start[v])):
            if value(index.present[v][k]):
                s = index.start[v][k]
                s = s if isinstance(s, int) else int(value(s))
                events.append((s, int(value(index.end[v][k])), v))
    events.sort()
    times = np.array([s for s, _, _ in events], dtype=np.int64)
    frees: list[list[int]] = [[] for _ in events]
    for _s, e, v in events:
        # the last compute slot strictly before e (it exists: the interval's own start)
        pos = int(np.searchsorted(times, e, side="left")) - 1
        frees[pos].append(v)
    steps: list[Step] = []
    for pos, (_, _, v) in enumerate(events):
        steps.append((COMPUTE, v))
        steps.extend((FREE, u) for u in frees[pos])
    return Schedule(tuple(steps))


def _add_hint(graph: Graph, index: CpsatModel, hint: Schedule) -> bool:
    """Hint the solver with ``hint``: each compute's stage is the next first compute's id.
    False (no hint) when it does not fit the model: too many computes of a node, or first
    computes out of id order."""
    n = graph.n
    counts = hint.compute_counts(n)
    caps = np.array([len(s) for s in index.start])
    if np.any(counts > caps) or np.any(counts == 0):
        return False
    # stage of each compute (in step order): recomputes belong to the next frontier stage
    comp = [i for op, i in hint.steps if op == COMPUTE]
    first_pos = np.full(n, -1, dtype=np.int64)
    for pos, i in enumerate(comp):
        if first_pos[i] < 0:
            first_pos[i] = pos
    if not np.all(np.diff(first_pos) > 0):
        return False
    slot: list[int] = []
    stage_of: list[int] = []
    frontier = 0  # the node whose first compute ends the current stage
    for pos, i in enumerate(comp):
        if first_pos[i] == pos:
            slot.append(i * (n + 1))
            stage_of.append(i)
            frontier = i + 1
        else:
            slot.append(frontier * n + i)
            stage_of.append(frontier)
    # interval end: one past its last read (slots reorder a stage's recomputes by id, which
    # keeps every read after its input's compute since ids are topological)
    kk = np.zeros(n, dtype=np.int64)
    current = np.full(n, -1, dtype=np.int64)  # the interval of each node now resident
    ends: dict[tuple[int, int], int] = {}
    for pos, i in enumerate(comp):
        for p in graph.preds[i]:
            key = (p, int(current[p]))
            ends[key] = max(ends[key], slot[pos] + 1)
        current[i] = kk[i]
        kk[i] += 1
        ends[(i, int(current[i]))] = slot[pos] + 1
    model = index.model
    kk[:] = 0
    for pos, i in enumerate(comp):
        k = int(kk[i])
        kk[i] += 1
        model.add_hint(index.end[i][k], ends[(i, k)])
        if k > 0:
            model.add_hint(index.stage[i][k], stage_of[pos])
            model.add_hint(index.present[i][k], 1)
    for v in range(n):
        for k in range(max(1, int(kk[v])), len(index.start[v])):
            model.add_hint(index.present[v][k], 0)
    return True


def _complete_hint(model: cp_model.CpModel, seconds: float | None, workers: int) -> bool:
    """Turn a partial hint into a complete one: solve a copy with the hinted values fixed
    and hint every variable with that solution (CP-SAT follows complete hints reliably; a
    partial one it may lose on large models). False if the hint does not complete."""
    proto = model.proto
    fixed = model.clone()
    for var, val in zip(proto.solution_hint.vars, proto.solution_hint.values):
        fixed.add(fixed.get_int_var_from_proto_index(var) == val)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = int(workers)
    solver.parameters.stop_after_first_solution = True
    if seconds is not None:
        solver.parameters.max_time_in_seconds = max(0.1, seconds)
    if solver.solve(fixed) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    values = [solver.value(fixed.get_int_var_from_proto_index(i)) for i in range(len(proto.variables))]
    model.clear_hints()
    for i, val in enumerate(values):
        model.add_hint(model.get_int_var_from_proto_index(i), val)
    return True


def solve_in_process(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    max_computes: int = MAX_COMPUTES,
    backward_once: bool = True,
    hint: Schedule | None = None,
    workers: int = 2,
    seed: int = 0,
    progress: ProgressFn | None = None,
    **_: Any,
) -> SolveResult:
    """Plan ``graph`` under ``budget`` with the retention-interval CP model on CP-SAT, in
    this process (see :func:`solvers.strategies.cpsat.cpsat`, which isolates it).

    Args:
        graph: the graph.
        budget: memory budget in bytes.
        time_limit: seconds for the search; the best incumbent is returned.
        max_computes: intervals (computes) allowed per recomputable node.
        backward_once: compute backward nodes exactly once (a restriction).
        hint: a schedule to start from (ignored when it breaks the restrictions).
        workers: CP-SAT search workers.
        seed: CP-SAT random seed.
        progress: called with a :class:`SolveProgress` on each improving solution.

    Returns:
        A :class:`SolveResult`; ``optimal`` means optimal within the restrictions listed
        in ``info["restrictions"]``; ``lower_bound`` is the no-recompute cost (valid for
        every schedule); the restricted model's bound is ``info["restricted_bound"]``.

    Raises:
        SolverError: CP-SAT rejected the model (a bug).
    """
    if (early := below_floor("cpsat", graph, budget)) is not None:
        return early
    t0 = time.perf_counter()
    index = build_model(graph, budget, max_computes=max_computes, backward_once=backward_once)
    hinted = _add_hint(graph, index, hint) if hint is not None else False
    if hinted:
        budget_s = None if time_limit is None else 0.25 * (time_limit - (time.perf_counter() - t0))
        hinted = _complete_hint(index.model, budget_s, workers)
    build_s = time.perf_counter() - t0

    solver = cp_model.CpSolver()
    if time_limit is not None:
        # the limit covers the whole call: model building and decoding included
        spent = time.perf_counter() - t0
        solver.parameters.max_time_in_seconds = max(0.1, float(time_limit) - spent - _DECODE_MARGIN)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    # one presolve round: on ResNet50 the default rounds took ~7 s of a 10 s budget on 2
    # cores and proved nothing more than one round does
    solver.parameters.max_presolve_iterations = 1
    cb = _Progress(progress, index.cost_unit, graph.total_cost, t0) if progress else None
    t1 = time.perf_counter()
    code = solver.solve(index.model, cb) if cb else solver.solve(index.model)
    solve_s = time.perf_counter() - t1
    if code == cp_model.MODEL_INVALID:
        raise SolverError(f"CP-SAT rejected the model of {graph.name!r}: {index.model.validate()}")
    status = _STATUS[solver.status_name(code)]
    info: dict[str, Any] = {
        "restrictions": index.restrictions,
        "solver_status": solver.status_name(code),
        "horizon": index.horizon,
        "hinted": hinted,
        "intervals": sum(len(s) for s in index.start),
    }
    if code in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        info["restricted_bound"] = graph.total_cost + solver.best_objective_bound * index.cost_unit
        schedule = decode(graph, index, solver.value)
        sim = simulate(graph, schedule)
        if sim.peak > budget:  # decoding must honour the model's memory: a bug otherwise
            raise SolverError(f"CP-SAT schedule for {graph.name!r} peaks at {sim.peak:,} > budget {budget:,}")
        return SolveResult(
            "cpsat",
            status,
            budget,
            schedule,
            sim.cost,
            sim.peak,
            graph.total_cost,
            build_s,
            solve_s,
            info,
        )
    if code == cp_model.INFEASIBLE:
        info["restricted_infeasible"] = True
        left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
        if backward_once and (left is None or left > 1.0):
            # the restriction, not the budget, may be what fails: retry without it
            res = solve_in_process(
                graph,
                budget,
                time_limit=left,
                max_computes=max_computes + 1,
                backward_once=False,
                hint=hint,
                workers=workers,
                seed=seed,
                progress=progress,
            )
            info["relaxed"] = "backward nodes recomputable, one more compute per node"
            return dataclasses.replace(
                res,
                build_seconds=res.build_seconds + build_s,
                solve_seconds=res.solve_seconds + solve_s,
                info={**res.info, "relaxed": info["relaxed"]},
            )
    return SolveResult("cpsat", status, budget, None, None, None, None, build_s, solve_s, info)


class _Progress(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
    def __init__(self, fn: ProgressFn, unit: float, base: float, t0: float) -> None:
        super().__init__()
        self._fn, self._unit, self._base, self._t0 = fn, unit, base, t0

    def on_solution_callback(self) -> None:
        self._fn(
            SolveProgress(
                "cpsat",
                time.perf_counter() - self._t0,
                incumbent=self._base + self.objective_value * self._unit,
                bound=None,
                message="incumbent",
            )
        )
