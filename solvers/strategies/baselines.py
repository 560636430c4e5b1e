"""The classic checkpointing baselines, as strategies over the one Schedule type.

- checkpoint-all: no recomputation; every value lives until its last read.
- checkpoint-last-node (Jain et al., MLSys 2020, baseline): stage t keeps only the
  previous node's output and recomputes every other input of node t from scratch.
- chen-sqrtn (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016):
  keep every ~sqrt(k)-th of k candidate nodes, the candidates being all forward nodes
  (linearized) or the forward graph's articulation points.
- chen-greedy (Chen et al. 2016, Alg. 3): walk the candidates accumulating memory; keep a
  node when the running sum passes a threshold b. The threshold is swept and the cheapest
  schedule that fits the budget is returned.
- griewank (Griewank & Walther, "Algorithm 799: revolve", ACM TOMS 2000): binomial
  checkpointing for training graphs whose forward part is a chain.

The kept-set baselines share :func:`~solvers.strategies._segments.checkpoint_sequence`.
Strategies that take no budget input still receive it: they return FEASIBLE when the
simulated peak fits and NO_SOLUTION (schedule attached, for information) otherwise.
Non-recomputable nodes are always kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from solvers.errors import OptionError
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import Schedule, schedule_from_order, simulate
from solvers.strategies._segments import (
    articulation_points,
    forced_keep,
    forward_ids,
    recompute_closure,
    schedule_from_kept,
    sticky_values,
)

__all__ = [
    "checkpoint_all",
    "checkpoint_last_node",
    "chen_sqrtn",
    "chen_greedy",
    "griewank",
    "chen_greedy_kept",
    "chen_greedy_sets",
    "revolve_table",
]

_MODES = ("linearized", "articulation")


def checkpoint_all(graph: Graph, budget: int, *, time_limit: float | None = None) -> SolveResult:
    """Run every node once in id order; free each value after its last read.

    Its cost (the sum of all node costs) is a lower bound on any schedule, so a fitting
    peak makes it OPTIMAL; otherwise NO_SOLUTION with the schedule attached.
    """
    t0 = time.perf_counter()
    # every forward value kept: the generic routine runs each node once, in id order
    sched = schedule_from_kept(graph, forward_ids(graph).tolist())
    return _result("checkpoint-all", graph, budget, sched, t0, {}, optimal=True)


def checkpoint_last_node(graph: Graph, budget: int, *, time_limit: float | None = None) -> SolveResult:
    """Stage t keeps only node t-1's output (and non-recomputable values); it recomputes
    every other ancestor node t needs. Minimal memory, quadratic compute."""
    t0 = time.perf_counter()
    sticky = ~graph.recomputable_mask
    seq: list[int] = []
    for t in range(graph.n):
        avail = np.zeros(graph.n, dtype=bool)
        avail[:t] = sticky[:t]
        if t > 0:
            avail[t - 1] = True
        seq.extend(recompute_closure(graph, t, avail))
    sched = schedule_from_order(graph, seq)
    return _result("checkpoint-last-node", graph, budget, sched, t0, {})


def chen_sqrtn(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    mode: str = "best",
) -> SolveResult:
    """Chen et al.'s sqrt(n) checkpoints.

    Args:
        mode: ``"linearized"`` (candidates: every forward node), ``"articulation"``
            (candidates: articulation points of the forward graph) or ``"best"`` (both; the
            cheapest schedule that fits, else the one with the lower peak).
    """
    t0 = time.perf_counter()
    modes = _modes(mode)
    cands: list[tuple[Schedule, dict[str, Any]]] = []
    for md in modes:
        c, extra = _candidates(graph, md)
        step = max(1, math.isqrt(c.size)) if c.size else 1
        kept = c[step - 1 :: step]
        cands.append((schedule_from_kept(graph, kept.tolist() + extra), {"mode": md, "kept": len(kept)}))
    return _pick("chen-sqrtn", graph, budget, cands, t0)


def chen_greedy_kept(sizes: Sequence[int] | npt.NDArray[np.int64], threshold: float) -> list[int]:
    """Chen et al.'s greedy segmentation: positions kept when the running memory passes
    ``threshold`` (the running sum restarts after each kept position)."""
    kept: list[int] = []
    run = 0.0
    for k, s in enumerate(sizes):
        run += float(s)
        if run > threshold:
            kept.append(k)
            run = 0.0
    return kept


def chen_greedy_sets(
    graph: Graph, mode: str = "best", thresholds: int = 40
) -> list[tuple[str, float, tuple[int, ...]]]:
    """The distinct kept sets of Chen's greedy segmentation over a sweep of ``thresholds``
    memory thresholds (geometric, from the smallest candidate segment to the total forward
    memory; threshold 0 keeps every candidate), as ``(mode, threshold, kept)``; ``kept``
    includes the values the mode keeps besides its candidates."""
    fwd = forward_ids(graph)
    cum = np.concatenate([[0], np.cumsum(graph.mem[fwd])])
    out: list[tuple[str, float, tuple[int, ...]]] = []
    seen: set[tuple[int, ...]] = set()
    for md in _modes(mode):
        c, extra = _candidates(graph, md)
        if c.size == 0:
            continue
        # segment size of a candidate: the forward memory since the previous candidate
        pos = np.searchsorted(fwd, c)
        sizes = cum[pos + 1] - cum[np.concatenate([[0], pos[:-1] + 1])]
        lo, hi = max(1.0, float(sizes.min())), max(2.0, float(sizes.sum()))
        for b in np.concatenate([[0.0], np.geomspace(lo, hi, thresholds)]):
            kept = tuple(int(c[k]) for k in chen_greedy_kept(sizes, b)) + tuple(extra)
            if kept in seen:
                continue
            seen.add(kept)
            out.append((md, float(b), kept))
    return out


def chen_greedy(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    mode: str = "best",
    thresholds: int = 40,
) -> SolveResult:
    """Chen et al.'s greedy segmentation, swept over ``thresholds`` memory thresholds
    (geometric, from the smallest candidate size to the total forward memory).

    Returns the cheapest schedule within the budget; if none fits, the one with the least
    peak, as NO_SOLUTION. ``info["threshold"]`` is the winning threshold in bytes.
    """
    t0 = time.perf_counter()
    cands: list[tuple[Schedule, dict[str, Any]]] = []
    for md, b, kept in chen_greedy_sets(graph, mode, thresholds):
        if time_limit is not None and time.perf_counter() - t0 > time_limit and cands:
            break
        cands.append((schedule_from_kept(graph, kept), {"mode": md, "threshold": b, "kept": len(kept)}))
    if not cands:
        cands.append((schedule_from_kept(graph, []), {"mode": "none"}))
    return _pick("chen-greedy", graph, budget, cands, t0, extra={"tried": len(cands)})


def revolve_table(length: int, slots: int) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Optimal first advance of binomial checkpointing, by dynamic programming.

    ``T(l, s)`` is the number of forward steps needed to serve, in decreasing order, the
    demands for the l chain values above an available base, with s free slots:
    ``T(0, s) = 0``, ``T(l, 0) = l + T(l-1, 0)`` and
    ``T(l, s) = min(l + T(l-1, s), min_{1<=m<l} m + T(l-m, s-1) + T(m-1, s))``
    (advance m steps and checkpoint there; serve the upper part with one slot fewer, then
    the lower part with the slot returned). Griewank & Walther show the optimum follows the
    binomial law; the DP computes it exactly for unit step costs.

    With s+1 stored states in all (the base included), ``T(l, s)`` equals Griewank's
    minimal step count for reversing l+1 steps, ``r(l+1) - C(s+r+1, s+2)`` with r the
    least integer such that ``C(s+1+r, s+1) >= l+1`` (the unit tests check this).

    Returns:
        ``(T, choice)``: ``T[l, s]`` as above and ``choice[l, s]``, the number of steps m
        of the first advance (``l`` = no checkpoint), both of shape (length+1, slots+1).
    """
    T = np.zeros((length + 1, slots + 1), dtype=np.int64)
    choice = np.zeros((length + 1, slots + 1), dtype=np.int64)
    ls = np.arange(length + 1, dtype=np.int64)
    T[:, 0] = ls * (ls + 1) // 2
    choice[:, 0] = ls
    for s in range(1, slots + 1):
        for ln in range(1, length + 1):
            best, arg = ln + T[ln - 1, s], ln
            if ln > 1:
                m = np.arange(1, ln, dtype=np.int64)
                vals = m + T[ln - m, s - 1] + T[m - 1, s]
                k = int(np.argmin(vals))
                if vals[k] < best:
                    best, arg = int(vals[k]), int(m[k])
            T[ln, s], choice[ln, s] = best, arg
    return T, choice


def griewank(graph: Graph, budget: int, *, time_limit: float | None = None) -> SolveResult:
    """Binomial checkpointing (revolve) for training graphs whose forward part is a chain.

    The forward sweep and every later recomputation advance from the nearest stored
    value, storing checkpoints where :func:`revolve_table` says; the number of slots is
    swept and the cheapest schedule within the budget is returned. Other graphs get
    NO_SOLUTION with the reason in ``info["message"]``.
    """
    t0 = time.perf_counter()
    fwd = forward_ids(graph)
    preds = graph.preds
    bad = _chain_violation(graph, fwd)
    if bad is not None:
        return SolveResult(
            "griewank",
            Status.NO_SOLUTION,
            budget,
            solve_seconds=time.perf_counter() - t0,
            info={
                "message": f"griewank applies to graphs whose forward part is a chain: {bad}; "
                "use chen-greedy, lp-rounding or ilp for this graph"
            },
        )
    L = int(fwd.size)
    _, choice = revolve_table(L, L)
    bwd = np.flatnonzero(graph.backward_mask)
    sticky = forced_keep(graph)
    cands: list[tuple[Schedule, dict[str, Any]]] = []
    for slots in range(L + 1):
        if time_limit is not None and time.perf_counter() - t0 > time_limit and cands:
            break
        seq = _revolve_sequence(fwd, bwd, preds, choice, slots, sticky)
        cands.append((schedule_from_order(graph, seq), {"slots": slots}))
        if slots >= 1 and len(cands) >= 2 and cands[-1][0].steps == cands[-2][0].steps:
            break  # more slots change nothing
    return _pick("griewank", graph, budget, cands, t0)


# ---------------------------------------------------------------------------- helpers
def _revolve_sequence(
    fwd: npt.NDArray[np.int64],
    bwd: npt.NDArray[np.int64],
    preds: tuple[tuple[int, ...], ...],
    choice: npt.NDArray[np.int64],
    slots: int,
    sticky: npt.NDArray[np.bool_],
) -> list[int]:
    n = len(preds)
    L = int(fwd.size)
    pos = np.full(n, -1, dtype=np.int64)
    pos[fwd] = np.arange(L)
    avail = np.zeros(n, dtype=bool)
    seq: list[int] = []

    def advance(base: int, target: int, free: int) -> None:
        # compute chain positions base+1..target; keep revolve's checkpoints and the target
        cur = base
        while cur < target:
            ln = target - cur
            m = int(choice[ln, min(free, choice.shape[1] - 1)]) if free > 0 else ln
            for k in range(cur + 1, cur + m + 1):
                node = int(fwd[k])
                seq.append(node)
                avail[node] = True
                prev = k - 1
                if prev > cur and not sticky[fwd[prev]]:
                    avail[fwd[prev]] = False  # an intermediate value: dropped
            cur += m
            free -= 1

    if L:
        advance(-1, L - 1, slots)
    for v in bwd:
        for p in preds[v]:
            if avail[p]:
                continue
            j = int(pos[p])
            assert j >= 0, "only forward values are ever dropped"
            below = np.flatnonzero(avail[fwd[:j]])
            base = int(below[-1]) if below.size else -1
            advance(base, j, max(0, slots - int(below.size)))
        seq.append(int(v))
        avail[v] = True
    return seq


def _chain_violation(graph: Graph, fwd: npt.NDArray[np.int64]) -> str | None:
    if fwd.size == 0:
        return "the graph has no forward nodes"
    preds = graph.preds
    if preds[int(fwd[0])]:
        return f"the first forward node {graph.nodes[int(fwd[0])].name!r} reads other nodes"
    for a, b in pairwise(fwd.tolist()):
        if preds[b] != (a,):
            return (
                f"forward node {graph.nodes[b].name!r} reads {len(preds[b])} value(s), "
                f"not just the previous forward node {graph.nodes[a].name!r}"
            )
    return None


def _modes(mode: str) -> tuple[str, ...]:
    if mode == "best":
        return _MODES
    if mode not in _MODES:
        raise OptionError(f"mode={mode!r}: choose 'linearized', 'articulation' or 'best'")
    return (mode,)


def _candidates(graph: Graph, mode: str) -> tuple[npt.NDArray[np.int64], list[int]]:
    """Checkpoint candidates of ``mode`` and the values kept besides them (articulation
    mode keeps :func:`sticky_values`, which its candidates assume resident)."""
    if mode == "linearized":
        c, extra = forward_ids(graph), []
    else:
        sticky = sticky_values(graph)
        # forced values are kept by every policy anyway: only the rest is listed
        c, extra = articulation_points(graph, sticky), np.flatnonzero(sticky & ~forced_keep(graph)).tolist()
    return (c[graph.recomputable_mask[c]] if c.size else c), extra


def _pick(
    name: str,
    graph: Graph,
    budget: int,
    cands: list[tuple[Schedule, dict[str, Any]]],
    t0: float,
    extra: dict[str, Any] | None = None,
) -> SolveResult:
    """The cheapest candidate within the budget, else the one with the least peak."""
    best: tuple[tuple[int, float, int], Schedule, dict[str, Any]] | None = None
    for sched, info in cands:
        sim = simulate(graph, sched)
        fits = sim.peak <= budget
        key = (0, sim.cost, sim.peak) if fits else (1, float(sim.peak), 0)
        if best is None or key < best[0]:
            best = (key, sched, info)
    assert best is not None
    return _result(name, graph, budget, best[1], t0, {**best[2], **(extra or {})})


def _result(
    name: str,
    graph: Graph,
    budget: int,
    sched: Schedule,
    t0: float,
    info: dict[str, Any],
    *,
    optimal: bool = False,
) -> SolveResult:
    sim = simulate(graph, sched)
    fits = sim.peak <= budget
    info = dict(info)
    if not graph.backward_mask.any() and name != "checkpoint-all":
        info["note"] = "no backward nodes: nothing to recompute, the keep-all order is returned"
    if fits:
        status = Status.OPTIMAL if optimal else Status.FEASIBLE
    else:
        status = Status.NO_SOLUTION
        info["message"] = f"{name}'s schedule peaks at {sim.peak:,} bytes, over the budget of {budget:,}"
    return SolveResult(
        name,
        status,
        budget,
        schedule=sched,
        cost=sim.cost,
        peak=sim.peak,
        lower_bound=graph.total_cost if optimal else None,
        solve_seconds=time.perf_counter() - t0,
        info=info,
    )
