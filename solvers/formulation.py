"""The Checkmate MILP (Jain et al., "Checkmate: Breaking the Memory Wall with Optimal
Tensor Rematerialization", MLSys 2020) as sparse arrays: formulate, encode, decode.

One formulation for every MILP-family strategy: :mod:`solvers.strategies.ilp` (HiGHS),
:mod:`solvers.strategies.lp_rounding` (its LP relaxation), :mod:`solvers.strategies.poet`
(which appends paging columns, Patil et al., ICML 2022) and :mod:`solvers.pulp_export`
(any PuLP solver). Building returns the model and an index of its variables; decoding a
solution needs only that index (:meth:`RSIndex.decode`, :func:`decode_schedule`).

Formulation (frontier-advancing stages t = 0..n-1; stage t computes node t first):

- ``R[t,i]`` binary, i <= t, ``R[t,t] = 1``: stage t computes i. ``S[t,i]`` binary,
  i < t: i's output is resident at the start of stage t. Objective: min Σ cost_i R[t,i]
  (+ each forward value's save cost where it is resident as the first backward stage b
  starts, S[b,i], or computed in it before b, R[b,i]: see ``Node.save_cost``).
- Dependencies: ``R[t,j] <= R[t,i] + S[t,i]`` for each edge i -> j.
- Memory: ``U[t,k]`` = bytes in use in stage t right after computing k (the simulator's
  peak point, before the frees that follow k), ``U[t,k] <= budget``::

      U[t,k0] = Σ_i mem_i S[t,i] + mem_k0 R[t,k0]          (k0: the stage's first position)
      U[t,k]  = U[t,k'] - Σ_i mem_i FREE[t,i,k'] + mem_k R[t,k]   (k': the previous position)

- ``FREE[t,i,p]`` (p in {i} ∪ succs(i), p < t): i is freed right after position p (if
  p cannot be computed in stage t: before the next position that can). The
  paper defines it as ``R[t,p] (1 - S[t+1,i]) Π_{j in succs(i), j > p} (1 - R[t,j])`` and
  linearizes the product with a hazard count. Only upper bounds on FREE matter (freeing
  less is always allowed), so we write them as two families that are at least as tight:

      Σ_p FREE[t,i,p] + S[t+1,i] <= S[t,i] + R[t,i]          (freed at most once, only if
                                                               present and not kept; for
                                                               FREE = 0 it is the paper's
                                                               S[t+1,i] <= S[t,i] + R[t,i])
      Σ_{p in {i} ∪ succs(i), p < j} FREE[t,i,p] + R[t,j] <= 1   for each j in succs(i)
                                                              (not freed before a reader)

  FREE may then be continuous: for binary R and S, the best FREE frees each value once,
  right after its last reader in the stage, which is exactly what the decoder does.

Only variables that can be nonzero exist: ``R[t,i]`` (i < t) and ``S[t,i]`` only up to the
last stage that can still read i (``n-1`` if some consumer of i is recomputable, else its
last consumer), none for nodes without consumers, no recomputation of non-recomputable
nodes (whose S is pinned to 1 from their computation to their last consumer), and FREE
only where its node can be present. ``U`` shares R's positions. Everything is built
with vectorized numpy into one ``scipy.sparse`` matrix: no loop over (stage, node) pairs.

The module is over 450 lines because the build is one vectorized function (about 210
lines) whose row families share their index arrays; splitting it would pass a dozen arrays
between files. The encoder, the decoder and the HiGHS adapters (:func:`problem_of`,
:func:`progress_hook`) stay beside it: they read the same index and scaling.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers import highs, scaling
from solvers.graph import Graph
from solvers.result import ProgressFn, SolveProgress, SolveResult, Status
from solvers.schedule import Schedule, schedule_from_rs
from solvers.stages import complete_rs, s_from_schedule, stage_memory

__all__ = [
    "RSIndex",
    "MilpModel",
    "useful_masks",
    "liveness_masks",
    "build_seconds",
    "too_large",
    "formulate",
    "encode",
    "decode_schedule",
    "max_violation",
    "problem_of",
    "progress_hook",
    "warm_start_vector",
]

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolMatrix = npt.NDArray[np.bool_]

#: Numbers HiGHS sees are scaled: memory in units of the budget, cost so that the mean is 1.
_INF = np.inf


@dataclass(frozen=True)
class RSIndex:
    """Where each variable of the MILP lives in the column vector.

    Column blocks, in order: R (``num_r``), S (``num_s``), U (``num_r``, at R's
    positions), FREE (``num_f``). Positions are sorted by stage, then node.

    Attributes:
        n: number of nodes (and stages).
        r_t, r_i: stage and node of each R (and U) column.
        s_t, s_i: stage and node of each S column.
        f_t, f_i, f_p: stage, freed node and position of each FREE column.
    """

    n: int
    r_t: IntArray
    r_i: IntArray
    s_t: IntArray
    s_i: IntArray
    f_t: IntArray
    f_i: IntArray
    f_p: IntArray

    @property
    def num_r(self) -> int:
        return len(self.r_t)

    @property
    def num_s(self) -> int:
        return len(self.s_t)

    @property
    def num_f(self) -> int:
        return len(self.f_t)

    @property
    def s_off(self) -> int:
        return self.num_r

    @property
    def u_off(self) -> int:
        return self.num_r + self.num_s

    @property
    def f_off(self) -> int:
        return 2 * self.num_r + self.num_s

    @property
    def num_cols(self) -> int:
        return 2 * self.num_r + self.num_s + self.num_f

    def decode(self, x: npt.ArrayLike, threshold: float = 0.5) -> tuple[BoolMatrix, BoolMatrix]:
        """(R, S) as dense (n, n) bool matrices from a solution vector."""
        xv = np.asarray(x, dtype=np.float64)
        return self.dense_r(xv) > threshold, self.dense_s(xv) > threshold

    def dense_r(self, x: npt.ArrayLike) -> FloatArray:
        """R's values as a dense (n, n) matrix (zero where no variable exists)."""
        out = np.zeros((self.n, self.n))
        out[self.r_t, self.r_i] = np.asarray(x)[: self.num_r]
        return out

    def dense_s(self, x: npt.ArrayLike) -> FloatArray:
        """S's values as a dense (n, n) matrix (zero where no variable exists)."""
        out = np.zeros((self.n, self.n))
        out[self.s_t, self.s_i] = np.asarray(x)[self.s_off : self.u_off]
        return out


@dataclass(frozen=True)
class MilpModel:
    """The MILP ``min cost·x  s.t.  row_lower <= A x <= row_upper, col bounds, integrality``.

    Attributes:
        A: (rows, cols) CSR constraint matrix.
        row_lower, row_upper, col_lower, col_upper, cost: bounds and objective (scaled).
        integrality: True for binary columns.
        index: where each variable lives (decode needs only this).
        budget: the budget in bytes; ``mem_unit`` bytes are one unit of U.
        cost_unit: graph cost units per objective unit (objective * cost_unit = cost).
        row_key: an id per row, the same for the same constraint in models of the same
            graph with different supports (maps duals between them).
    """

    A: sp.csr_matrix
    row_lower: FloatArray
    row_upper: FloatArray
    col_lower: FloatArray
    col_upper: FloatArray
    cost: FloatArray
    integrality: npt.NDArray[np.bool_]
    index: RSIndex
    budget: int
    mem_unit: float
    cost_unit: float
    row_key: IntArray
    num_edges: int

    @property
    def num_vars(self) -> int:
        return self.A.shape[1]

    @property
    def num_constraints(self) -> int:
        return self.A.shape[0]

    @property
    def num_binaries(self) -> int:
        return int(self.integrality.sum())

    def with_budget(self, budget_bytes: float) -> MilpModel:
        """The same model with U bounded by another budget (same scaling)."""
        idx = self.index
        hi = self.col_upper.copy()
        hi[idx.u_off : idx.u_off + idx.num_r] = budget_bytes / self.mem_unit
        return dataclasses.replace(self, col_upper=hi)


def _ranges(starts: IntArray, counts: IntArray) -> tuple[IntArray, IntArray]:
    """For groups g with ``counts[g]`` members: (group of each member, offset within group)."""
    total = int(counts.sum())
    group = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return group, np.arange(total) - first[group] + starts[group]


def useful_masks(graph: Graph) -> tuple[BoolMatrix, BoolMatrix]:
    """Where R and S can be nonzero in some optimal solution: ``(r_mask, s_mask)``.

    ``R[t,i]`` off the diagonal and ``S[t,i]`` only for i < t up to the last stage that can
    read i (``n-1`` if a consumer of i is recomputable, else its last consumer); no
    recomputation of non-recomputable nodes.
    """
    n = graph.n
    rc = graph.recomputable_mask
    max_useful = _max_useful(graph)
    t_col = np.arange(n)[:, None]
    i_row = np.arange(n)[None, :]
    s_mask = (i_row < t_col) & (t_col <= max_useful[None, :])
    r_mask = (i_row == t_col) | (s_mask & rc[None, :])
    return r_mask, s_mask


def _max_useful(graph: Graph) -> IntArray:
    """Per value, the last stage that can read it: ``n-1`` if a consumer is recomputable,
    else its last consumer."""
    rc = graph.recomputable_mask
    e = graph.edge_array
    rc_succ = np.zeros(graph.n, dtype=bool)
    if len(e):
        np.logical_or.at(rc_succ, e[:, 0], rc[e[:, 1]])
    return np.where(rc_succ, graph.n - 1, graph.last_use).astype(np.int64)


#: seconds to build the model per possibly-nonzero R or S entry (:func:`useful_masks`),
#: on the slower side of what was measured (4-10 us on a 2-core x86 machine: ResNet-50's
#: 125k entries in 0.7 s, a DenseNet-121 step's 4.7M in 48 s)
BUILD_SECONDS_PER_ENTRY = 4e-6


def build_seconds(graph: Graph) -> float:
    """A quick estimate of the seconds :func:`formulate` takes on ``graph`` (it grows with
    n^2): strategies with a time limit skip a model they cannot build within it instead of
    overrunning it (the build cannot be interrupted)."""
    # the entries of useful_masks, counted in O(n): S[t,i] for i < t <= max_useful[i], and
    # R's diagonal plus S's entries of the recomputable columns
    s_count = np.maximum(_max_useful(graph) - np.arange(graph.n), 0)
    entries = graph.n + int(s_count.sum()) + int(s_count[graph.recomputable_mask].sum())
    return float(entries) * BUILD_SECONDS_PER_ENTRY


def too_large(
    strategy: str, graph: Graph, budget: int, time_limit: float | None, builds: int = 1
) -> SolveResult | None:
    """The NO_SOLUTION result of ``strategy`` when building its model (``builds`` times)
    would take longer than ``time_limit``; None when it fits (or there is no limit)."""
    if time_limit is None:
        return None
    need = builds * build_seconds(graph)
    if need <= time_limit:
        return None
    reason = (
        f"the model would take about {need:.0f} s to build ({graph.n} nodes), more than the "
        f"time limit of {time_limit:.0f} s; give more time or use a heuristic"
    )
    return SolveResult(strategy, Status.NO_SOLUTION, budget, info={"reason": reason, "build_estimate": need})


def liveness_masks(graph: Graph) -> tuple[BoolMatrix, BoolMatrix]:
    """A restricted support: R and S of node i only while i is live in the keep-all
    schedule (``i < t <= last_use[i]``). Contains the keep-all schedule; on the public
    graphs it also contains an optimal LP solution (certified by :func:`lagrangian_bound`)."""
    r_mask, s_mask = useful_masks(graph)
    n = graph.n
    live = np.arange(n)[:, None] <= graph.last_use[None, :]
    return r_mask & (live | np.eye(n, dtype=bool)), s_mask & live


def formulate(
    graph: Graph,
    budget: int,
    support: tuple[npt.ArrayLike, npt.ArrayLike] | None = None,
) -> MilpModel:
    """Build the Checkmate MILP for ``graph`` under ``budget`` bytes (see the module doc).

    Args:
        graph: the graph (ids in topological order).
        budget: memory budget in bytes.
        support: optional ``(r_mask, s_mask)``, (n, n) bools: only these R and S exist
            (intersected with :func:`useful_masks`; the diagonal of R and the pinned S of
            non-recomputable nodes always exist). A restriction: its optimum is an upper
            bound, its LP objective not a lower bound (see :func:`lagrangian_bound`).

    Returns:
        The model; ``model.index`` maps columns back to (R, S).
    """
    n = graph.n
    rc = graph.recomputable_mask
    mem = graph.mem.astype(np.float64)
    e = graph.edge_array
    e = e[np.lexsort((e[:, 1], e[:, 0]))]  # sorted by (src, dst): a node's edges are adjacent
    src, dst = e[:, 0], e[:, 1]
    num_e = len(e)
    num_pairs = n + num_e
    mem_unit = float(budget) if budget > 0 else 1.0
    cost_unit = scaling.cost_unit(graph, "the MILP")  # the mean cost; GraphError beyond 1e9 span
    memu = mem / mem_unit

    r_mask, s_mask = useful_masks(graph)
    t_col = np.arange(n)[:, None]
    pinned_mask = (~rc & np.array([bool(x) for x in graph.succs], dtype=bool))[None, :] & (
        (np.arange(n)[None, :] < t_col) & (t_col <= graph.last_use[None, :])
    )
    if support is not None:
        r_mask = r_mask & (np.asarray(support[0], dtype=bool) | np.eye(n, dtype=bool))
        s_mask = s_mask & (np.asarray(support[1], dtype=bool) | pinned_mask)
    r_t, r_i = (a.astype(np.int64) for a in np.nonzero(r_mask))  # row-major: by stage, node
    s_t, s_i = (a.astype(np.int64) for a in np.nonzero(s_mask))
    num_r, num_s = len(r_t), len(s_t)
    r_map = np.full((n, n), -1, dtype=np.int64)
    r_map[r_t, r_i] = np.arange(num_r)
    s_map = np.full((n, n), -1, dtype=np.int64)
    s_map[s_t, s_i] = np.arange(num_s)
    present = r_mask | s_mask

    # FREE over pairs (i, p): pair q < n is (q, q); pair n + q is edge q. A column for each
    # stage t > p where i can be present. Its memory row is that of the first position
    # after p that the stage has (nothing happens in between when p itself is absent).
    pair_i = np.concatenate([np.arange(n), src])
    pair_p = np.concatenate([np.arange(n), dst])
    f_q, f_t = _ranges(pair_p + 1, n - 1 - pair_p)
    ok = present[f_t, pair_i[f_q]]
    f_q, f_t = f_q[ok], f_t[ok]
    # next_pos[t, p]: the first position after p in stage t (t itself at the latest)
    cand = np.where(r_mask, np.arange(n)[None, :], n)
    next_pos = np.minimum.accumulate(cand[:, ::-1], axis=1)[:, ::-1]
    next_pos = np.concatenate([next_pos[:, 1:], np.full((n, 1), n)], axis=1)
    # FREE of the same (t, i) at positions with no position of the stage between them are
    # the same column (same memory row, same readers after them): keep the first of each
    group = (f_t * n + pair_i[f_q]) * (n + 1) + next_pos[f_t, pair_p[f_q]]
    order = np.lexsort((pair_p[f_q], group))
    g_sorted = group[order]
    lead = np.ones(len(order), dtype=bool)
    lead[1:] = g_sorted[1:] != g_sorted[:-1]
    col_of = np.empty(len(order), dtype=np.int64)
    col_of[order] = np.cumsum(lead) - 1
    keep_cols = order[lead]
    f_map = np.full((n, num_pairs), -1, dtype=np.int64)
    f_map[f_t, f_q] = col_of
    f_q, f_t = f_q[keep_cols], f_t[keep_cols]
    reorder = np.lexsort((pair_p[f_q], pair_i[f_q], f_t))  # columns by stage, node, position
    inverse = np.empty_like(reorder)
    inverse[reorder] = np.arange(len(reorder))
    if len(inverse):
        f_map = np.where(f_map >= 0, inverse[np.maximum(f_map, 0)], -1)
    f_q, f_t = f_q[reorder], f_t[reorder]
    f_i, f_p = pair_i[f_q], pair_p[f_q]
    num_f = len(f_t)
    index = RSIndex(n, r_t, r_i, s_t, s_i, f_t, f_i, f_p)
    S0, U0, F0 = index.s_off, index.u_off, index.f_off

    rows: list[IntArray] = []
    cols: list[IntArray] = []
    vals: list[FloatArray] = []
    lo: list[FloatArray] = []
    hi: list[FloatArray] = []
    keys: list[IntArray] = []
    n_rows = 0

    def add(r: IntArray, c: IntArray, v: FloatArray | float) -> None:
        rows.append(r)
        cols.append(c)
        vals.append(np.broadcast_to(np.asarray(v, dtype=np.float64), r.shape))

    def key(kind: int, t: IntArray, x: IntArray) -> None:
        # identifies a row across models of the same graph (full vs restricted support)
        keys.append((kind * n + t) * num_pairs + x)

    # --- memory recurrence, one row per U column (equality) ---------------------------
    ar = np.arange(num_r)
    add(ar, U0 + ar, 1.0)
    same = np.flatnonzero(r_t[1:] == r_t[:-1]) + 1
    add(same, U0 + same - 1, -1.0)
    add(ar, ar, -memu[r_i])
    first = np.searchsorted(r_t, np.arange(n))
    add(first[s_t], S0 + np.arange(num_s), -memu[s_i])
    add(r_map[f_t, next_pos[f_t, f_p]], F0 + np.arange(num_f), memu[f_i])
    lo.append(np.zeros(num_r))
    hi.append(np.zeros(num_r))
    key(0, r_t, r_i)
    n_rows += num_r

    # --- release: Σ_p FREE[t,i,p] + S[t+1,i] - S[t,i] - R[t,i] <= 0 --------------------
    need = np.zeros((n, n), dtype=bool)
    need[f_t, f_i] = True
    need[s_t - 1, s_i] = True
    rel_t, rel_i = np.nonzero(need)
    rel = np.full((n, n), -1, dtype=np.int64)
    rel[rel_t, rel_i] = n_rows + np.arange(len(rel_t))
    add(rel[f_t, f_i], F0 + np.arange(num_f), 1.0)
    add(rel[s_t - 1, s_i], S0 + np.arange(num_s), 1.0)
    sel = np.flatnonzero(rel[s_t, s_i] >= 0)
    add(rel[s_t[sel], s_i[sel]], S0 + sel, -1.0)
    sel = np.flatnonzero(rel[r_t, r_i] >= 0)
    add(rel[r_t[sel], r_i[sel]], sel, -1.0)
    lo.append(np.full(len(rel_t), -_INF))
    hi.append(np.zeros(len(rel_t)))
    key(1, rel_t.astype(np.int64), rel_i.astype(np.int64))
    n_rows += len(rel_t)

    # --- not freed before a reader: Σ_{p < j} FREE[t,i,p] + R[t,j] <= 1 ----------------
    # one row per (edge q = (i, j), stage t with R[t,j]); terms: i's self pair and the
    # edges of i to consumers before j (edges are sorted by (src, dst))
    b_q, b_t = _ranges(dst, n - dst)
    ok = r_mask[b_t, dst[b_q]]
    b_q, b_t = b_q[ok], b_t[ok]
    b_id = np.full((n, max(num_e, 1)), -1, dtype=np.int64)
    b_id[b_t, b_q] = np.arange(len(b_q))
    rank = np.arange(num_e) - np.searchsorted(src, src, side="left")
    tr_q, tr_k = _ranges(np.zeros(num_e, dtype=np.int64), rank + 1)
    tr_pair = np.where(tr_k == 0, src[tr_q], n + tr_q - rank[tr_q] + tr_k - 1)
    # expand each (edge, pair) term over the edge's stages, keep those with a FREE column
    x_tr, x_t = _ranges(dst[tr_q], n - dst[tr_q])
    x_q, pq = tr_q[x_tr], tr_pair[x_tr]
    x_row = b_id[x_t, x_q]
    x_col = f_map[x_t, pq]
    ok = (x_row >= 0) & (x_col >= 0)
    # merged FREE columns appear once per row
    uniq = np.unique(x_row[ok] * max(num_f, 1) + x_col[ok])
    x_row, x_col = uniq // max(num_f, 1), uniq % max(num_f, 1)
    used = np.zeros(len(b_q), dtype=bool)
    used[x_row] = True
    renum = np.cumsum(used) - 1 + n_rows
    add(renum[x_row], F0 + x_col, 1.0)
    ub = np.flatnonzero(used)
    add(renum[ub], r_map[b_t[ub], dst[b_q[ub]]], 1.0)
    lo.append(np.full(len(ub), -_INF))
    hi.append(np.ones(len(ub)))
    key(2, b_t[ub], b_q[ub])
    n_rows += len(ub)

    # --- dependencies: R[t,j] - R[t,i] - S[t,i] <= 0 for each edge i -> j ----------------
    d_q, d_t = b_q, b_t
    d_rows = n_rows + np.arange(len(d_q))
    add(d_rows, r_map[d_t, dst[d_q]], 1.0)
    ri = r_map[d_t, src[d_q]]
    sel = np.flatnonzero(ri >= 0)
    add(d_rows[sel], ri[sel], -1.0)
    si = s_map[d_t, src[d_q]]
    sel = np.flatnonzero(si >= 0)
    add(d_rows[sel], S0 + si[sel], -1.0)
    lo.append(np.full(len(d_q), -_INF))
    hi.append(np.zeros(len(d_q)))
    key(3, d_t, d_q)
    n_rows += len(d_q)

    A = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
        shape=(n_rows, index.num_cols),
    )
    A.sum_duplicates()

    # --- bounds, objective, integrality ----------------------------------------------
    num_cols = index.num_cols
    col_lo = np.zeros(num_cols)
    col_hi = np.ones(num_cols)
    col_lo[np.flatnonzero(r_t == r_i)] = 1.0
    col_lo[S0 + np.flatnonzero(pinned_mask[s_t, s_i])] = 1.0
    col_hi[U0 : U0 + num_r] = budget / mem_unit
    cost = np.zeros(num_cols)
    cost[:num_r] = graph.cost[r_i] / cost_unit
    b = graph.first_backward
    if b < n and graph.save_cost.any():
        # what the forward hands to the backward: resident at stage b's start, or computed in
        # stage b before node b (those steps still run in the forward: checkmate.codegen)
        save = graph.save_cost / cost_unit
        s_cols = np.flatnonzero((s_t == b) & (save[s_i] > 0))
        cost[S0 + s_cols] += save[s_i[s_cols]]
        r_cols = np.flatnonzero((r_t == b) & (r_i < b) & (save[r_i] > 0))
        cost[r_cols] += save[r_i[r_cols]]
    integrality = np.zeros(num_cols, dtype=bool)
    integrality[:U0] = True
    return MilpModel(
        A=A,
        row_lower=np.concatenate(lo),
        row_upper=np.concatenate(hi),
        col_lower=col_lo,
        col_upper=col_hi,
        cost=cost,
        integrality=integrality,
        index=index,
        budget=int(budget),
        mem_unit=mem_unit,
        cost_unit=cost_unit,
        row_key=np.concatenate(keys),
        num_edges=num_e,
    )


def encode(graph: Graph, model: MilpModel, R: BoolMatrix, S: BoolMatrix) -> FloatArray | None:
    """The MILP column vector of a normalized (R, S) pair (e.g. from ``complete_rs``).

    FREE frees each value right after its last reader in the stage (or right after it is
    computed when nothing reads it) unless it is kept; U follows the recurrence. For a
    normalized pair, U at the computed positions equals the simulator's timeline.

    Returns:
        The vector, or None when (R, S) uses a variable the model does not have.
    """
    idx = model.index
    Rm = np.asarray(R, dtype=bool)
    Sm = np.asarray(S, dtype=bool)
    x = np.zeros(idx.num_cols)
    x[: idx.num_r] = Rm[idx.r_t, idx.r_i]
    x[idx.s_off : idx.u_off] = Sm[idx.s_t, idx.s_i]
    if x[: idx.num_r].sum() != Rm.sum() or x[idx.s_off : idx.u_off].sum() != Sm.sum():
        return None
    sm = stage_memory(graph, Rm, Sm)
    fi = sm.freed[idx.f_t, idx.f_i] & (sm.free_pos[idx.f_t, idx.f_i] == idx.f_p)
    x[idx.f_off :] = fi
    x[idx.u_off : idx.f_off] = sm.U[idx.r_t, idx.r_i] / model.mem_unit
    return x


def max_violation(model: MilpModel, x: npt.ArrayLike) -> float:
    """The largest violation of a row or column bound by ``x`` (0 when feasible)."""
    xv = np.asarray(x, dtype=np.float64)
    ax = model.A @ xv
    viol = [
        np.maximum(model.row_lower - ax, 0.0),
        np.maximum(ax - model.row_upper, 0.0),
        np.maximum(model.col_lower - xv, 0.0),
        np.maximum(xv - model.col_upper, 0.0),
    ]
    return float(max((v.max() if v.size else 0.0) for v in viol))


def problem_of(model: MilpModel) -> highs.HighsProblem:
    """The model as a HiGHS problem (same arrays, no copy)."""
    return highs.HighsProblem(
        A=model.A,
        row_lower=model.row_lower,
        row_upper=model.row_upper,
        col_lower=model.col_lower,
        col_upper=model.col_upper,
        cost=model.cost,
        integrality=model.integrality,
    )


def progress_hook(
    strategy: str, progress: ProgressFn | None, t0: float, cost_unit: float
) -> highs.ProgressHook | None:
    """HiGHS's progress reports on a model (objective in its scaled units, infinite while
    unknown) as :class:`SolveProgress` in the graph's cost units, timed from ``t0``."""
    if progress is None:
        return None
    fn = progress

    def hook(_: float, incumbent: float | None, bound: float | None, phase: str) -> None:
        scale = lambda v: None if v is None or not math.isfinite(v) else v * cost_unit  # noqa: E731
        fn(SolveProgress(strategy, time.perf_counter() - t0, scale(incumbent), scale(bound), phase))

    return hook


def warm_start_vector(graph: Graph, model: MilpModel, schedule: Schedule) -> FloatArray | None:
    """A MILP incumbent from any schedule whose first computes are in id order.

    The schedule's residency at each stage start gives S; the minimal R for it
    (:func:`solvers.stages.complete_rs`) can only be cheaper. Returns None when the
    schedule has no stage form or its stage form does not fit the model's budget.
    """
    S = s_from_schedule(graph, schedule)
    if S is None:
        return None
    R, S = complete_rs(graph, S)
    x = encode(graph, model, R, S)
    if x is None or max_violation(model, x) > 1e-9:
        return None
    return x


def decode_schedule(graph: Graph, index: RSIndex, x: npt.ArrayLike) -> Schedule:
    """The schedule of a solution vector: its S (rounded at 0.5), completed into the
    cheapest consistent (R, S) (:func:`solvers.stages.complete_rs`) and decoded by
    :func:`solvers.schedule.schedule_from_rs`. Completing R from S can only lower the cost
    and makes the decoder's memory accounting equal the MILP's."""
    R, S = complete_rs(graph, index.decode(x)[1])
    return schedule_from_rs(graph, R, S)
