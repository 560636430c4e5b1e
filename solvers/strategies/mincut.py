"""min-cut: which forward values to keep, by a minimum cut that prices bytes and recompute.

PyTorch's partitioner (``min_cut_rematerialization_partition``, after Rockmate's and
Checkmate's observation that recompute costs differ by orders of magnitude per byte) keeps
the forward values a minimum s-t cut selects: the backward reads what the cut keeps and
recomputes the rest from it. This strategy writes that choice as one cut with both prices
in it, and sweeps the exchange rate between them:

- every forward node v is split into ``v_in -> v_out`` with capacity
  ``mem(v) + lam * save_cost(v)``: cut, v's output is kept from the forward for the backward
  (its bytes, and what handing it over costs: :attr:`solvers.graph.Node.save_cost`);
- ``source -> v_in`` with capacity ``lam * cost(v)``: cut, v runs again in the backward;
  infinite for values every policy keeps (:func:`~solvers.strategies._segments.forced_keep`:
  ops that may run only once, values no forward op reads);
- ``v_out -> u_in`` (infinite) for each forward edge, ``v_out -> sink`` (infinite) when a
  backward op reads v: what the backward reads is kept or recomputed, and a recompute reads
  values that are kept or recomputed in turn.

A minimum cut therefore minimizes ``kept bytes + lam * recompute cost``. ``lam = 0`` keeps the
fewest bytes the graph allows, ``lam -> inf`` keeps everything. The kept set becomes a
schedule through :func:`~solvers.strategies._segments.schedule_from_kept` (each dropped
value recomputed once, before its first backward read, and held to its last), and the
simulator judges it: the cut does not see the backward's transient memory, so the sweep
keeps the cheapest schedule whose simulated peak fits, refining the rate by bisection
where fitting turns to not fitting. Each cut is one ``scipy.sparse.csgraph.maximum_flow``
(Dinic's algorithm) on 2 x (forward ops) vertices: milliseconds on traced transformers.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import Schedule, simulate
from solvers.strategies._segments import forced_keep, forward_ids, schedule_from_kept

__all__ = ["mincut", "kept_by_cut"]

#: finite capacities are scaled to sum below this (maximum_flow takes int32 capacities)
_SCALE_TO = 2**30
_INF = 2**31 - 1
#: rates on the first sweep, and bisection steps where fitting turns to not fitting
GRID = 14
REFINE = 8


class _Network:
    """The cut network of one graph; :meth:`kept` solves it at one exchange rate."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        fwd = forward_ids(graph)
        self.fwd = fwd
        k = fwd.size
        pos = np.full(graph.n, -1, dtype=np.int64)
        pos[fwd] = np.arange(k)
        self.source, self.sink = 2 * k, 2 * k + 1
        e = graph.edge_array.reshape(-1, 2)
        both = (pos[e[:, 0]] >= 0) & (pos[e[:, 1]] >= 0)
        read_back = np.zeros(graph.n, dtype=bool)
        read_back[e[(pos[e[:, 0]] >= 0) & (pos[e[:, 1]] < 0), 0]] = True
        j = np.arange(k, dtype=np.int64)
        # fixed edges: v_out -> u_in along forward edges, v_out -> sink when the backward reads v
        self.fixed_src = np.concatenate([2 * pos[e[both, 0]] + 1, 2 * j[read_back[fwd]] + 1])
        self.fixed_dst = np.concatenate([2 * pos[e[both, 1]], np.full(int(read_back[fwd].sum()), self.sink)])
        self.mem = graph.mem[fwd].astype(np.float64)
        self.cost = graph.cost[fwd].astype(np.float64)
        self.save = graph.save_cost[fwd].astype(np.float64)
        self.pinned = forced_keep(graph)[fwd]

    def kept(self, lam: float) -> npt.NDArray[np.int64]:
        """The forward nodes a minimum cut at rate ``lam`` (bytes per unit of cost) computes
        in the forward only (the source side of their ``v_in``)."""
        k = self.fwd.size
        if k == 0 or not np.isfinite(lam):  # an infinite rate recomputes nothing
            return self.fwd.copy()
        j = np.arange(k, dtype=np.int64)
        recompute = np.where(self.pinned, 0.0, lam * self.cost)
        keep = self.mem + lam * self.save  # keeping v for the backward: its bytes, its save cost
        total = float(keep.sum() + recompute.sum())
        scale = _SCALE_TO / total if total > 0 else 1.0
        mem_cap = np.minimum(np.rint(keep * scale), _INF - 1).astype(np.int64)
        rec_cap = np.where(self.pinned, _INF, np.rint(recompute * scale)).astype(np.int64)
        src = np.concatenate([2 * j, np.full(k, self.source), self.fixed_src])
        dst = np.concatenate([2 * j + 1, 2 * j, self.fixed_dst])
        cap = np.concatenate([mem_cap, rec_cap, np.full(self.fixed_src.size, _INF, dtype=np.int64)])
        nv = 2 * k + 2
        net = csr_matrix((cap.astype(np.int32), (src, dst)), shape=(nv, nv))
        net.sum_duplicates()
        flow = maximum_flow(net, self.source, self.sink).flow
        # residual graph: capacity left forward, flow sent backward
        residual = (net - flow).tocsr()
        residual.data = np.maximum(residual.data, 0)
        residual.eliminate_zeros()
        reached = breadth_first_order(residual, self.source, directed=True, return_predecessors=False)
        side = np.zeros(nv, dtype=bool)
        side[reached] = True
        return self.fwd[side[2 * j]]


def kept_by_cut(graph: Graph, lam: float) -> npt.NDArray[np.int64]:
    """The forward nodes kept by a minimum cut at exchange rate ``lam`` (see the module
    docstring): the kept set whose ``kept bytes + lam * recompute cost`` is least."""
    return _Network(graph).kept(lam)


def mincut(graph: Graph, budget: int, *, time_limit: float | None = None, grid: int = GRID) -> SolveResult:
    """The cheapest schedule within ``budget`` among the kept sets of minimum cuts over a
    sweep of exchange rates (see the module docstring).

    Args:
        graph: the graph to plan (a training graph; without backward nodes nothing is
            dropped).
        budget: bytes.
        time_limit: seconds; the sweep stops when they run out and returns the best
            schedule found.
        grid: exchange rates on the first sweep (geometric, over the graph's own
            bytes-per-cost ratios), before the bisection.

    Returns:
        FEASIBLE with the cheapest schedule found within the budget, else NO_SOLUTION with
        the least-peak one (attached for information).
    """
    t0 = time.perf_counter()
    deadline = None if time_limit is None else t0 + max(float(time_limit), 0.0)
    net = _Network(graph)
    seen: dict[bytes, tuple[float, int]] = {}
    best: list[Any] = [None, None]  # [(cost, sched, lam, kept) fitting, (peak, sched, lam, kept) least peak]

    def expired() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    def evaluate(lam: float) -> bool:
        kept = net.kept(lam)
        key = kept.tobytes()
        if key not in seen:
            sched = schedule_from_kept(graph, kept.tolist())
            sim = simulate(graph, sched)
            seen[key] = (sim.cost, sim.peak)
            if sim.peak <= budget and (best[0] is None or sim.cost < best[0][0]):
                best[0] = (sim.cost, sched, lam, kept.size)
            if best[1] is None or sim.peak < best[1][0]:
                best[1] = (sim.peak, sched, lam, kept.size)
        return seen[key][1] <= budget

    rates = _rates(net, grid)
    fits = []
    for lam in rates:
        if expired() and (best[0] is not None or best[1] is not None):
            break
        fits.append(evaluate(lam))
    # refine between the largest fitting rate and the next (keeping more: cheaper, larger)
    ok = [i for i, f in enumerate(fits) if f]
    if ok and ok[-1] + 1 < len(fits):
        lo = np.log(max(rates[ok[-1]], 1e-300))
        hi = np.log(rates[ok[-1] + 1]) if np.isfinite(rates[ok[-1] + 1]) else lo + np.log(100.0)
        for _ in range(REFINE):
            if expired():
                break
            mid = 0.5 * (lo + hi)
            if evaluate(float(np.exp(mid))):
                lo = mid
            else:
                hi = mid
    info: dict[str, Any] = {"cuts": len(rates), "kept_sets": len(seen)}
    if best[0] is not None:
        _, sched, lam, nkept = best[0]
        status = Status.FEASIBLE
    else:
        _, sched, lam, nkept = best[1]
        status = Status.NO_SOLUTION
    info.update(rate=lam, kept=nkept)
    return _result(graph, budget, sched, status, t0, info)


def _rates(net: _Network, grid: int) -> list[float]:
    """Exchange rates to sweep, ascending: 0 (fewest bytes kept), then geometric over the
    graph's bytes-per-cost ratios (a decade beyond each end), then infinity (keep
    everything: ops that cost nothing are recomputed at every finite rate)."""
    ok = (net.cost > 0) & (net.mem > 0) & ~net.pinned
    if not ok.any():
        return [0.0, float("inf")]
    ratio = net.mem[ok] / net.cost[ok]
    lo, hi = float(ratio.min()) / 10, float(ratio.max()) * 10
    return [0.0, *np.geomspace(lo, hi, max(grid, 2)).tolist(), float("inf")]


def _result(
    graph: Graph, budget: int, sched: Schedule, status: Status, t0: float, info: dict[str, Any]
) -> SolveResult:
    sim = simulate(graph, sched)
    if status is Status.NO_SOLUTION:
        info["message"] = (
            f"min-cut's least-peak schedule peaks at {sim.peak:,} bytes, over the budget of {budget:,}"
        )
    return SolveResult(
        strategy="mincut",
        status=status,
        budget=budget,
        schedule=sched,
        cost=sim.cost,
        peak=sim.peak,
        solve_seconds=time.perf_counter() - t0,
        info=info,
    )
