"""gap-cover: choose which read-to-read gaps to drop values over, as a small covering MIP.

Run the graph once in id order and hold every value from its computation to its last read:
the memory after node t runs is ``M[t]``. A *gap* is a value u between two consecutive
reads ``r < s``: dropping u right after r runs and recomputing it just before s runs frees
``mem[u]`` at every node strictly between r and s and costs ``cost[u]`` once. The
recompute reads u's inputs at s; an input p already freed by then (its last read is before
s) is held until s instead, which costs ``mem[p]`` over the nodes after its last read.

Within this policy space (every recompute is one op from resident inputs), the cheapest
set of gaps that brings every ``M[t]`` under the budget is a covering integer program with
one binary per gap (O(edges) variables, not Checkmate's O(n^2)):

    minimise   sum_g cost[u_g] x_g
    subject to sum_g a[g, t] x_g >= M[t] - budget           for every node t
               x_g + x_h <= 1     where gap h drops an input of u_g over the step that
                                  recomputes u_g (the recompute would need a chain)

with ``a[g, t] = mem[u_g]`` inside the gap and ``-mem[p]`` where the recompute holds an
input p longer (one continuous column per held input and step, so a value held for several
recomputes is counted once; see :class:`Gaps`). When this model has no plan, a larger one
also lets a recompute recompute a freed input first and drop it again (chains of depth
one). The model is exact for the memory after each program node, and a recompute's own
step is charged to the node it serves (conservatively); the simulator replays the result,
and a plan that does not fit after all gets its overshooting rows tightened and is solved
again (the property tests find every plan fitting on the first round). This is the MIP
analogue of the local "recompute from saved inputs" rule of PyTorch's min-cut partitioner,
and needs no backward pass: the random layered graphs of Gagrani et al. (2022), on which
DTR and the segment baselines find nothing, are its case.

The MIP bound is a bound on this restricted space only, so no lower bound is reported.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers import highs
from solvers.errors import SolverError
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import COMPUTE, Schedule, SimResult, schedule_from_order, simulate
from solvers.strategies._segments import drop_sequence

__all__ = ["gap_cover", "keep_all_memory", "Gaps"]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

#: simulate-and-tighten rounds before giving up on a plan that does not fit
ROUNDS = 8
#: the covering rows' nonzeros above which the MIP is not built (memory, build time);
#: a value read at both ends of a 5,000-op graph alone spans 5,000 rows
MAX_NONZEROS = 8_000_000


def keep_all_memory(graph: Graph) -> IntArray:
    """``M[t]``: bytes resident right after node t runs in the id-order run that holds
    every value from its computation to its last read: the simulator's timeline of
    :func:`solvers.schedule.schedule_from_order` at its compute steps."""
    sched = schedule_from_order(graph, range(graph.n))
    at = [s for s, (op, _) in enumerate(sched.steps) if op == COMPUTE]
    return simulate(graph, sched).timeline[at].astype(np.int64)


def _intervals(lo: IntArray, hi: IntArray, owner: IntArray) -> tuple[IntArray, IntArray]:
    """Rows ``lo[i] .. hi[i]-1`` of each interval i, flattened: (row, owner) pairs."""
    length = np.maximum(hi - lo, 0)
    total = int(length.sum())
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    idx = np.repeat(np.arange(len(lo)), length)
    start = np.repeat(np.cumsum(length) - length, length)
    rows = lo[idx] + (np.arange(total) - start)
    return rows, owner[idx]


class _Links:
    """Rows ``sum_j coef_j * column_j <= upper`` collected piecewise, each piece a set of
    rows with the same pattern (vectorized), assembled once into a CSR matrix."""

    def __init__(self) -> None:
        self.rows: list[IntArray] = []
        self.cols: list[IntArray] = []
        self.data: list[FloatArray] = []
        self.upper: list[FloatArray] = []
        self.count = 0

    def add(self, upper: float, *terms: tuple[IntArray, float]) -> None:
        """One row per position of the equal-length column arrays in ``terms``:
        ``sum coef * x[cols[i]] <= upper``."""
        size = len(terms[0][0])
        idx = self.count + np.arange(size, dtype=np.int64)
        for cols, coef in terms:
            self.rows.append(idx)
            self.cols.append(np.asarray(cols, dtype=np.int64))
            self.data.append(np.full(size, float(coef)))
        self.upper.append(np.full(size, float(upper)))
        self.count += size

    def matrix(self, columns: int) -> tuple[sp.csr_matrix, FloatArray]:
        if not self.rows:
            return sp.csr_matrix((0, columns)), np.zeros(0)
        A = sp.csr_matrix(
            (np.concatenate(self.data), (np.concatenate(self.rows), np.concatenate(self.cols))),
            shape=(self.count, columns),
        )
        return A, np.concatenate(self.upper)


class Gaps:
    """The covering MIP of a graph: its columns and rows.

    Columns, in order:

    - ``x`` (binary), one per gap: drop value u after read r, recompute it before read s;
    - ``w`` (continuous), one per (value p, step) pair: ``w[p, j] = 1`` holds p from its
      last read through the j-th distinct step at which a recompute reads it
      (``w[p, j+1] <= w[p, j]``), so a value held for several recomputes is counted once;
    - ``y`` (binary), one per value that some recompute reads after its last read:
      *release* p there (drop it at its last read) instead of holding it; a recompute that
      needs it then recomputes p first and frees it right after (a chain of depth one);
    - ``z`` (continuous), one per (gap, released input) pair: ``z >= x + y - 1`` pays
      p's recompute and its transient bytes at that step.

    A gap's recompute needs every input resident: live and not dropped over that step
    (else a conflict row), or held (``x <= w + y``). A chained input's own inputs must be
    live and not dropped there, or held and not released themselves (no deeper chains).

    Attributes:
        edge: per gap, the index in ``graph.edge_array`` of its drop point ``(u, r)``.
        value: per gap, the value u it drops.
        release_edge: per ``y`` column, the edge index of its value's last read.
        columns: (gaps, holds, releases, chains): the sizes of the four column blocks.
        cover: (n, columns) bytes freed after each node runs (holds and chains negative).
        links: (k, columns) the other rows, ``links @ v <= link_upper``.
        conflicts: how many of the link rows forbid a pair of drops.
        chain_gap, chain_release, chain_value: per ``z`` column, its gap, its ``y`` column
            and the value it recomputes.

    Raises:
        SolverError: the gaps would span more than ``max_nonzeros`` covering entries.
    """

    def __init__(self, graph: Graph, max_nonzeros: int = MAX_NONZEROS, chains: bool = True) -> None:
        e = graph.edge_array.reshape(-1, 2)
        src, dst = e[:, 0], e[:, 1]
        n = graph.n
        last_use = graph.last_use
        nxt = np.flatnonzero(src[:-1] == src[1:]) if len(src) > 1 else np.zeros(0, dtype=np.int64)
        gap_edge = nxt[dst[nxt + 1] - dst[nxt] > 1]  # a gap covers at least one node
        recomputable = graph.recomputable_mask & (graph.mem > 0)
        gap_edge = gap_edge[recomputable[src[gap_edge]]].astype(np.int64)
        self.edge: IntArray = gap_edge
        u, r, s = src[gap_edge], dst[gap_edge], dst[gap_edge + 1]
        self.value: IntArray = u.astype(np.int64)
        m = len(gap_edge)
        g = np.arange(m, dtype=np.int64)
        self.size = int(np.maximum(s - r - 1, 0).sum())
        if self.size > max_nonzeros:
            raise SolverError(
                f"gap-cover: the covering model would have {self.size:,} nonzeros (limit "
                f"{max_nonzeros:,}); use peak-greedy or lp-rounding on this graph"
            )
        key = src * n + dst
        gap_of_edge = np.full(len(src), -1, dtype=np.int64)
        gap_of_edge[gap_edge] = g
        by_dst = np.argsort(dst, kind="stable")
        dst_sorted = dst[by_dst]

        def inputs(of: IntArray) -> tuple[IntArray, IntArray]:
            """(position in ``of``, input value) for every input of every node in ``of``."""
            lo = np.searchsorted(dst_sorted, of, side="left")
            hi = np.searchsorted(dst_sorted, of, side="right")
            pos, owner = _intervals(lo, hi, np.arange(len(of), dtype=np.int64))
            return owner, src[by_dst[pos]]

        def dropped_over(value: IntArray, step: IntArray) -> IntArray:
            """The gap dropping ``value`` over ``step`` (strictly inside), or -1."""
            want = value * n + step
            where = np.searchsorted(key, want)
            read_there = (where < len(key)) & (key[np.minimum(where, len(key) - 1)] == want)
            before = np.where(read_there | (where == 0), 0, where - 1)
            found = gap_of_edge[before]
            ok = ~read_there & (where > 0) & (src[before] == value) & (last_use[value] >= step)
            return np.where(ok, found, -1)

        # the inputs of each gap's recompute
        k, p = inputs(u)
        at = s[k]
        dead = last_use[p] < at
        # chains: a dead input that can be recomputed may be released instead of held
        release = dead & recomputable[p] if chains else np.zeros(len(p), dtype=bool)
        rel_values, rel_of = np.unique(p[release], return_inverse=True)
        ny = len(rel_values)
        self.release_edge: IntArray = np.searchsorted(key, rel_values * n + last_use[rel_values]).astype(
            np.int64
        )
        dk = np.flatnonzero(release)  # chain pairs (gap k[d], released input p[d])
        nz = len(dk)
        ck, q = inputs(p[dk])  # inputs of each chained input, at its gap's step
        q_at = at[dk][ck]
        q_dead = last_use[q] < q_at
        # hold columns: distinct (value, step) pairs over gap inputs and chain inputs
        hv = np.concatenate([p[dead], q[q_dead]])
        hs = np.concatenate([at[dead], q_at[q_dead]])
        pairs, inverse = np.unique(hv * (n + 1) + hs, return_inverse=True)
        w_of_gap_input, w_of_chain_input = inverse[: int(dead.sum())], inverse[int(dead.sum()) :]
        wp, wat = pairs // (n + 1), pairs % (n + 1)
        nw = len(pairs)
        first = np.ones(nw, dtype=bool)
        first[1:] = wp[1:] != wp[:-1]
        X, W, Y, Z = 0, m, m + nw, m + nw + ny
        self.columns = (m, nw, ny, nz)
        total = m + nw + ny + nz
        # cover rows: a gap frees mem[u] strictly inside; a hold costs mem[p] after p's
        # last read through the recompute (which runs before node ``wat``, and frees it);
        # a chain holds mem[p] during its recompute (charged at that node's row)
        rows, cols = _intervals(r + 1, s, g)
        data = graph.mem[u][cols].astype(np.float64)
        start = np.where(first, last_use[wp] + 1, np.concatenate([[0], wat[:-1] + 1]))
        wr, wc = _intervals(start, wat + 1, np.arange(nw, dtype=np.int64))
        zrow = at[dk]
        self.cover = sp.csr_matrix(
            (
                np.concatenate([data, -graph.mem[wp][wc], -graph.mem[p[dk]]]).astype(np.float64),
                (np.concatenate([rows, wr, zrow]), np.concatenate([X + cols, W + wc, Z + np.arange(nz)])),
            ),
            shape=(n, total),
        )
        self.cover.sum_duplicates()
        links = _Links()
        # a dead input is held or released: x - w - y <= 0 (x - w <= 0 when it cannot be)
        gk, gy = k[dead], np.full(int(dead.sum()), -1, dtype=np.int64)
        gy[release[dead]] = rel_of
        held_only = gy < 0
        links.add(0.0, (X + gk[held_only], 1.0), (W + w_of_gap_input[held_only], -1.0))
        links.add(
            0.0, (X + gk[~held_only], 1.0), (W + w_of_gap_input[~held_only], -1.0), (Y + gy[~held_only], -1.0)
        )
        nest = np.flatnonzero(~first)
        links.add(0.0, (W + nest, 1.0), (W + nest - 1, -1.0))
        # chain pays when both its gap and the release are chosen: x + y - z <= 1
        links.add(1.0, (X + k[dk], 1.0), (Y + rel_of, 1.0), (Z + np.arange(nz), -1.0))
        # a chained input's dead inputs are held (z - w <= 0) and not released (z + y <= 1)
        cz = ck[q_dead]
        links.add(0.0, (Z + cz, 1.0), (W + w_of_chain_input, -1.0))
        qy = np.searchsorted(rel_values, q[q_dead])
        is_rel = (qy < ny) & (rel_values[np.minimum(qy, max(ny - 1, 0))] == q[q_dead]) if ny else qy < 0
        links.add(1.0, (Z + cz[is_rel], 1.0), (Y + qy[is_rel], 1.0))
        # live inputs must not be dropped over the recompute: conflicts
        before = links.count
        live = ~dead
        other = dropped_over(p[live], at[live])
        ok = other >= 0
        links.add(1.0, (X + k[live][ok], 1.0), (X + other[ok], 1.0))
        q_live = ~q_dead
        other = dropped_over(q[q_live], q_at[q_live])
        ok = other >= 0
        links.add(1.0, (Z + ck[q_live][ok], 1.0), (X + other[ok], 1.0))
        self.conflicts = links.count - before
        self.links, self.link_upper = links.matrix(total)
        self.chain_gap: IntArray = k[dk]
        self.chain_release: IntArray = rel_of.astype(np.int64)
        self.chain_value: IntArray = p[dk]

    def __len__(self) -> int:
        return len(self.edge)


def gap_cover(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    rounds: int = ROUNDS,
    chains: bool = True,
    mip_rel_gap: float = 1e-3,
) -> SolveResult:
    """Solve the gap-covering MIP (see the module docstring) and replay its plan.

    Args:
        graph: the graph to plan.
        budget: bytes.
        time_limit: seconds for the whole search (model builds, MIP solves, replays); the
            MIP keeps its best incumbent when time runs out.
        rounds: simulate-and-tighten rounds when a plan's replay exceeds the budget.
        chains: when the one-op model has no plan, solve the model in which a recompute
            may also recompute an input that was freed (depth one). It is larger and
            slower (on random_layered_n1000 minutes instead of seconds) and rarely cheaper,
            so it runs only as the fallback.
        mip_rel_gap: HiGHS's relative MIP gap (default 1e-3).

    Returns:
        FEASIBLE with the replayed schedule (the MIP is exact only within its policy
        space, so never OPTIMAL), else NO_SOLUTION with the reason.
    """
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + max(float(time_limit), 0.0)
    need = keep_all_memory(graph).astype(np.float64) - float(budget)
    if need.max(initial=0.0) <= 0:
        sched = schedule_from_order(graph, range(graph.n))
        sim = simulate(graph, sched)
        return SolveResult("gap-cover", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
                           build_seconds=time.perf_counter() - t0, info={"gaps": 0})  # fmt: skip
    info: dict[str, Any] = {}
    build = 0.0
    best: tuple[Schedule, SimResult] | None = None
    for chained in (False, True) if chains else (False,):
        if deadline is not None and time.perf_counter() >= deadline:
            break
        info["model"] = "chains" if chained else "one-op"
        tb = time.perf_counter()
        try:
            gaps = Gaps(graph, MAX_NONZEROS, chains=chained)
        except SolverError as exc:
            info["message"] = str(exc)
            break
        build += time.perf_counter() - tb
        if chained and gaps.columns[2] == 0:
            break  # no freed input to recompute: the same model again
        best = _search(graph, budget, gaps, need, deadline, rounds, float(mip_rel_gap), info)
        if best is not None:
            break
    elapsed = time.perf_counter() - t0
    if best is None:
        info.setdefault("message", "gap-cover: no plan within the budget")
        return SolveResult("gap-cover", Status.NO_SOLUTION, budget, build_seconds=build,
                           solve_seconds=elapsed - build, info=info)  # fmt: skip
    sched, sim = best
    return SolveResult("gap-cover", Status.FEASIBLE, budget, schedule=sched, cost=sim.cost, peak=sim.peak,
                       build_seconds=build, solve_seconds=elapsed - build, info=info)  # fmt: skip


def _search(
    graph: Graph,
    budget: int,
    gaps: Gaps,
    need: FloatArray,
    deadline: float | None,
    rounds: int,
    mip_rel_gap: float,
    info: dict[str, Any],
) -> tuple[Schedule, SimResult] | None:
    """Solve one covering model, replay its plan, tighten and re-solve where it overshoots;
    the replayed plan that fits, else None (``info`` says why)."""
    m, nw, ny, nz = gaps.columns
    info.update(gaps=m, holds=nw, releases=ny, chains=nz, conflicts=gaps.conflicts)
    info.pop("message", None)
    cols = m + nw + ny + nz
    rows_needed = np.flatnonzero((need > 0) | (np.asarray(gaps.cover.getnnz(axis=1)) > 0))
    cover = gaps.cover[rows_needed]
    if m == 0 or ((need[rows_needed] > 0) & (cover[:, :m].getnnz(axis=1) == 0)).any():
        info["message"] = "gap-cover: no gap covers a node where the keep-all run exceeds the budget"
        return None
    nl = gaps.links.shape[0]
    A = sp.vstack([cover, gaps.links]).tocsc()
    eps = 1e-9 * max(float(graph.total_cost), 1.0)  # no drop or release for nothing
    cost = np.zeros(cols)
    cost[:m] = graph.cost[gaps.value] + eps
    cost[m + nw : m + nw + ny] = eps
    cost[m + nw + ny :] = graph.cost[gaps.chain_value]
    integrality = np.zeros(cols, dtype=bool)
    integrality[:m] = True
    integrality[m + nw : m + nw + ny] = True
    lower = need[rows_needed].copy()
    row_of = np.full(graph.n, -1, dtype=np.int64)
    row_of[rows_needed] = np.arange(len(rows_needed))
    for rnd in range(max(int(rounds), 1)):
        left = None if deadline is None else deadline - time.perf_counter()
        if left is not None and left <= 0:
            info["message"] = "gap-cover: time limit reached"
            return None
        problem = highs.HighsProblem(
            A=A,
            row_lower=np.concatenate([lower, np.full(nl, -np.inf)]),
            row_upper=np.concatenate([np.full(len(lower), np.inf), gaps.link_upper]),
            col_lower=np.zeros(cols),
            col_upper=np.ones(cols),
            cost=cost,
            integrality=integrality,
        )
        res = highs.solve(problem, time_limit=left, mip_rel_gap=mip_rel_gap)
        info[f"{info['model']} round {rnd}"] = str(res.model_status)
        if res.x is None:
            info["message"] = f"gap-cover: the covering MIP found no plan ({res.model_status})"
            return None
        chosen = res.x[:m] > 0.5
        released = res.x[m + nw : m + nw + ny] > 0.5
        drop = np.zeros(len(graph.edges), dtype=bool)
        drop[gaps.edge[chosen]] = True
        drop[gaps.release_edge[released]] = True
        seq, owner = drop_sequence(graph, drop, transient=True)
        sched = schedule_from_order(graph, seq)
        sim = simulate(graph, sched)
        if sim.peak <= budget:
            info["drops"] = int(chosen.sum())
            info["chained"] = int((chosen[gaps.chain_gap] & released[gaps.chain_release]).sum())
            return sched, sim
        # tighten the rows of the program nodes whose steps overshoot, and solve again
        over = _overshoot(graph, sched, sim.timeline, owner) - budget
        hit = np.flatnonzero(over > 0)
        lower[row_of[hit]] += over[hit]
        info["rounds"] = rnd + 1
    info["message"] = f"gap-cover: no plan within the budget after {info.get('rounds', 0)} rounds"
    return None


def _overshoot(graph: Graph, sched: Schedule, timeline: IntArray, owner: list[int]) -> IntArray:
    """Per program node, the most memory any of its compute steps (recomputes included) reached."""
    worst = np.zeros(graph.n, dtype=np.int64)
    k = 0
    for s, (op, _) in enumerate(sched.steps):
        if op == COMPUTE:
            v = owner[k]
            worst[v] = max(worst[v], int(timeline[s]))
            k += 1
    return worst
