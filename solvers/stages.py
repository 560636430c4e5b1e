"""Stage matrices of the Checkmate formulation: completing S into (R, S), and schedules to S.

In the frontier-advancing formulation of Jain et al. ("Checkmate: Breaking the Memory
Wall with Optimal Tensor Rematerialization", MLSys 2020), stage t computes node t for the
first time; ``S[t, i]`` says node i's output is resident at the start of stage t and
``R[t, i]`` that stage t computes node i. Given S, the cheapest R is unique: stage t must
compute t, every value it keeps into stage t+1 without holding it now, and, walking the
dependencies backwards, every input of a computed node that is not resident. That closure
is the second phase of the paper's two-phase rounding, and turns any schedule's residency
pattern into a warm start for the MILP.

Every function here is vectorized over stages: one numpy operation per node, never per
(stage, node) entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import scipy.sparse as sp

from solvers.graph import Graph
from solvers.schedule import COMPUTE, Schedule

__all__ = [
    "closure_r",
    "complete_rs",
    "prune_s",
    "s_from_schedule",
    "rs_cost",
    "StageMemory",
    "stage_memory",
]

BoolMatrix = npt.NDArray[np.bool_]


def closure_r(graph: Graph, S: BoolMatrix) -> BoolMatrix:
    """The minimal R for a residency pattern S (O(n·|E|) work, one numpy step per node).

    Stage t computes t, every i with ``S[t+1, i] and not S[t, i]`` (to keep it, it must be
    computed now), and every input, transitively, of a computed node that S does not hold.

    Args:
        graph: the graph.
        S: (n, n) bool, strictly lower-triangular.

    Returns:
        (n, n) bool R, lower-triangular with a unit diagonal.
    """
    n = graph.n
    need = np.zeros((n, n), dtype=bool)
    need[np.arange(n), np.arange(n)] = True
    if n > 1:
        need[:-1] |= S[1:] & ~S[:-1]
    need &= np.tri(n, dtype=bool)
    missing = ~S
    for j in range(n - 1, 0, -1):
        p = graph.preds[j]
        if p:
            cols = list(p)
            need[:, cols] |= need[:, j : j + 1] & missing[:, cols]
    return need


def prune_s(graph: Graph, R: BoolMatrix, S: BoolMatrix) -> BoolMatrix:
    """Drop checkpoints that are neither read in their stage nor kept into the next one.

    Such a value costs memory for nothing; the decoder would free it at the stage start,
    but the MILP counts it until then, so pruning makes the two accountings agree.
    """
    n = graph.n
    if not graph.edges:
        return np.zeros_like(S)
    e = graph.edge_array
    adj = sp.csr_matrix((np.ones(len(e), dtype=np.int32), (e[:, 0], e[:, 1])), shape=(n, n))
    read = np.asarray((adj @ R.T.astype(np.int32)).T) > 0  # read[t, i]: a reader of i runs in t
    out = S.copy()
    keep_next = np.zeros(n, dtype=bool)
    for t in range(n - 1, 0, -1):
        out[t] &= read[t] | keep_next
        keep_next = out[t]
    out[0] = False
    return out


def complete_rs(graph: Graph, S: npt.ArrayLike) -> tuple[BoolMatrix, BoolMatrix]:
    """Turn a candidate residency pattern into a consistent, normalized (R, S) pair.

    Steps: restrict S to the strict lower triangle; keep each non-recomputable node from
    its computation to its last consumer (it cannot be produced again); take the minimal R
    (:func:`closure_r`); if R still recomputes a non-recomputable node, keep that node
    resident up to the stage that needs it and retry; prune checkpoints that are never
    read (:func:`prune_s`) and repeat until nothing changes. The result satisfies every
    constraint of the MILP except the memory budget, recomputes nothing that is resident,
    and its cost is ``rs_cost(graph, R)``.

    Args:
        graph: the graph.
        S: (n, n) array-like, nonzero where a value should be resident at a stage start.

    Returns:
        (R, S) as (n, n) bool arrays.
    """
    n = graph.n
    Sm = np.asarray(S, dtype=bool) & np.tri(n, k=-1, dtype=bool)
    rc = graph.recomputable_mask
    has_succ = np.array([bool(s) for s in graph.succs], dtype=bool)
    t_col = np.arange(n)[:, None]
    pinned = ~rc & has_succ
    Sm |= pinned[None, :] & (t_col > np.arange(n)[None, :]) & (t_col <= graph.last_use[None, :])
    off_diag = ~np.eye(n, dtype=bool)
    for _ in range(4 * n + 4):
        R = closure_r(graph, Sm)
        bad = R & off_diag & ~rc[None, :]
        if bad.any():
            # recomputing a non-recomputable node: keep it resident until that stage instead
            cols = np.flatnonzero(bad.any(axis=0))
            last = n - 1 - np.argmax(bad[::-1, cols], axis=0)
            for i, tmax in zip(cols.tolist(), last.tolist(), strict=True):
                Sm[i + 1 : tmax + 1, i] = True
            continue
        pruned = prune_s(graph, R, Sm)
        if np.array_equal(pruned, Sm):
            return R, Sm
        Sm = pruned
    raise AssertionError("complete_rs did not converge")  # pruning only shrinks S: a bug


def rs_cost(graph: Graph, R: BoolMatrix, S: BoolMatrix | None = None) -> float:
    """Cost of stage matrices: sum of R[t, i] * cost_i, plus, given S, the save costs of
    the values the forward hands to the backward (resident as the first backward stage b
    starts, or computed in it before b), as the simulator and the MILP charge them."""
    cost = float(R.sum(axis=0) @ graph.cost)
    b = graph.first_backward
    if S is not None and b < graph.n and graph.save_cost.any():
        handed = S[b].astype(bool).copy()
        handed[:b] |= R[b, :b].astype(bool)
        cost += float(graph.save_cost[handed].sum())
    return cost


def s_from_schedule(graph: Graph, schedule: Schedule) -> BoolMatrix | None:
    """The residency pattern of a schedule, mapped to frontier-advancing stages.

    Stage t spans the computes after the first compute of node t-1 up to the first
    compute of node t; ``S[t, i]`` is whether i is resident just before stage t's first
    compute. A schedule whose first computes are not in id order has no such stages.

    Args:
        graph: the graph.
        schedule: a valid schedule (e.g. from a heuristic).

    Returns:
        (n, n) bool S, or None when the schedule cannot be expressed in stages.
    """
    n = graph.n
    if schedule.S is not None and schedule.S.shape == (n, n):
        return np.asarray(schedule.S, dtype=bool).copy()
    S = np.zeros((n, n), dtype=bool)
    resident = np.zeros(n, dtype=bool)
    seen = np.zeros(n, dtype=bool)
    stage = 0  # the stage the next compute belongs to
    started = False
    for op, i in schedule.steps:
        if op == COMPUTE:
            if stage >= n:
                break
            if not started:
                S[stage] = resident
                started = True
            if not seen[i] and i != stage:
                return None  # first computes out of id order
            seen[i] = True
            resident[i] = True
            if i == stage:
                stage += 1
                started = False
        else:
            resident[i] = False
    if stage < n:
        return None
    return S & np.tri(n, k=-1, dtype=bool)


@dataclass(frozen=True)
class StageMemory:
    """Memory of a normalized (R, S) pair in the MILP's accounting (equal to the simulator's).

    Attributes:
        U: (n, n) int64, ``U[t, k]`` = bytes in use in stage t right after position k.
        free_pos: (n, n) int64, the position after which stage t frees i (-1: never).
        freed: (n, n) bool, whether stage t frees i (present, not kept, has a position).
        peak: the largest ``U[t, k]`` over computed positions (0 for an empty graph).
    """

    U: npt.NDArray[np.int64]
    free_pos: npt.NDArray[np.int64]
    freed: BoolMatrix
    peak: int


def stage_memory(
    graph: Graph, R: BoolMatrix, S: BoolMatrix, present: BoolMatrix | None = None
) -> StageMemory:
    """Vectorized memory accounting of a normalized (R, S) pair (see :func:`complete_rs`).

    Each value is freed right after its last reader in the stage (or right after it is
    computed when nothing reads it), unless it is kept into the next stage; the peak is
    taken after each compute. For normalized pairs this equals the peak that
    :func:`solvers.schedule.simulate` measures on ``schedule_from_rs(graph, R, S)``.

    Args:
        present: what is on the device at each stage start when that differs from S
            (POET: kept or paged in, ``S | IN``); S still says what is kept into the next
            stage. Default: S.
    """
    n = graph.n
    e = graph.edge_array
    last_read = np.full((n, n), -1, dtype=np.int64)
    if len(e):
        vals = np.where(R[:, e[:, 1]], e[:, 1][None, :], -1)
        rows = np.broadcast_to(np.arange(n)[:, None], vals.shape).ravel()
        np.maximum.at(last_read, (rows, np.broadcast_to(e[:, 0], vals.shape).ravel()), vals.ravel())
    cols = np.broadcast_to(np.arange(n)[None, :], (n, n))
    free_pos = np.where(last_read >= 0, last_read, np.where(R, cols, -1))
    at_start = S if present is None else present
    keep_next = np.zeros_like(S)
    keep_next[:-1] = S[1:]
    freed = (at_start | R) & ~keep_next & (free_pos >= 0)
    mem = graph.mem.astype(np.int64)
    freed_mem = np.zeros((n, n), dtype=np.int64)
    ft, fi = np.nonzero(freed)
    np.add.at(freed_mem, (ft, free_pos[ft, fi]), mem[fi])
    U = (at_start.astype(np.int64) @ mem)[:, None] + np.cumsum(R * mem[None, :], axis=1)
    U[:, 1:] -= np.cumsum(freed_mem, axis=1)[:, :-1]
    peak = int(U[R].max()) if n else 0
    return StageMemory(U=U, free_pos=free_pos, freed=freed, peak=peak)
