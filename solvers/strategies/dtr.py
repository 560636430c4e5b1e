"""Dynamic Tensor Rematerialization (Kirisame et al., "Dynamic Tensor Rematerialization",
ICLR 2021), simulated over a static :class:`~solvers.graph.Graph`.

The graph's ops are replayed in id order (the "program") under a memory budget:

- Before an op allocates its output, resident values are evicted until the output fits.
  Only unlocked values (not an input of an op being computed), recomputable ones and ones
  of non-zero size are candidates; the victim is the one of least heuristic score.
- An op whose input was evicted first recomputes it, recursively (rematerialization);
  each recompute makes its own evictions and locks its own inputs.
- A value with no future read in the program is freed at once. When none of its
  children is evicted it is *banished* (the paper's term): its children can no longer be
  rematerialized by an eager runtime, so they are pinned (never evicted) until dead.
  Otherwise it is treated as evicted (it joins its neighbours' evicted neighbourhood and a
  rematerialization may compute it again).
- A thrash limit stops the replay (NO_SOLUTION) when the computed cost passes
  ``thrash_factor`` x the no-recompute cost.

Heuristics (lower score = evicted first), with c(t) the cost of t's op, m(t) its size,
s(t) its staleness (time since its last access, time being the compute clock), e*(t) its
evicted neighbourhood (evicted values connected to t through evicted values, both ways):

- ``"dtr"``: h_DTR = (c(t) + c(e*(t))) / (m(t) s(t)), e* found by graph search.
- ``"eq"`` (default): h_DTR with e* approximated by union-find over evicted values; a
  class is never split, a recomputed value's cost is subtracted from its class. The
  paper's cheap approximation, near h_DTR in quality at O(1) per candidate.
- ``"local"``: c(t) / (m(t) s(t)).
- ``"lru"``: 1 / s(t) (least recently used first).
- ``"size"``: 1 / m(t) (largest first; ties by staleness).

The module is over 450 lines because the online simulator (``DTRSimulator``, about 270
lines with its evicted-neighbourhood bookkeeping) is one class; the strategy entry points
around it are short.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from solvers.errors import OptionError
from solvers.graph import Graph
from solvers.result import SolveResult, Status
from solvers.schedule import COMPUTE, FREE, Schedule, Step, simulate

__all__ = [
    "HEURISTICS",
    "DEFAULT_HEURISTIC",
    "DTRRun",
    "DTRSimulator",
    "run_dtr",
    "dtr",
    "dtr_full",
    "dtr_eq",
    "dtr_local",
    "dtr_lru",
    "dtr_size",
]

HEURISTICS = ("dtr", "eq", "local", "lru", "size")
DEFAULT_HEURISTIC = "eq"
DEFAULT_THRASH_FACTOR = 20.0
_TINY = 1e-12


@dataclass(frozen=True)
class DTRRun:
    """What one replay produced.

    Attributes:
        ok: the whole program ran within the budget.
        schedule: the steps taken (None when the replay stopped).
        message: why it stopped ("" when ok).
        evictions: values evicted to make room (not counting values freed as dead).
        recomputes: op executions beyond the first of each op.
        cost: total cost of every compute performed (including a stopped run's).
        peak: the largest memory in use after a compute.
    """

    ok: bool
    schedule: Schedule | None
    message: str
    evictions: int
    recomputes: int
    cost: float
    peak: int


class _Stop(Exception):
    """The replay cannot go on (budget too small, thrashing, time limit)."""


class DTRSimulator:
    """One DTR replay of a graph under a budget. Subclasses change how room is made
    (:meth:`reserve`) and observe allocations (:meth:`on_alloc`, :meth:`on_release`)."""

    def __init__(
        self,
        graph: Graph,
        budget: int,
        heuristic: str = DEFAULT_HEURISTIC,
        *,
        thrash_factor: float = DEFAULT_THRASH_FACTOR,
        time_limit: float | None = None,
        banish: bool = True,
    ) -> None:
        if heuristic not in HEURISTICS:
            raise OptionError(f"heuristic={heuristic!r}: choose one of {', '.join(HEURISTICS)}")
        self.graph = graph
        self.budget = int(budget)
        self.heuristic = heuristic
        self.banish = banish
        n = graph.n
        self.n = n
        self.preds = graph.preds
        self.succs = graph.succs
        self.cost = graph.cost.tolist()
        self.mem = graph.mem.tolist()
        self.recomputable = graph.recomputable_mask.tolist()
        # program position after which a value is dead; a non-recomputable value is held
        # until every descendant is dead, since rematerializing any of them may need it
        dead_after = graph.last_use.tolist()
        hold = list(dead_after)
        for u in range(n - 1, -1, -1):
            for s in self.succs[u]:
                hold[u] = max(hold[u], hold[s])
        for u in range(n):
            if not self.recomputable[u]:
                dead_after[u] = hold[u]
        self.dead_after = dead_after
        self.release_at: list[list[int]] = [[] for _ in range(n)]
        for u, t in enumerate(dead_after):
            self.release_at[t].append(u)
        self.max_cost = thrash_factor * max(graph.total_cost, _TINY)
        self.deadline = None if time_limit is None else time.perf_counter() + time_limit
        # state
        self.resident = [False] * n
        self.computed = [False] * n
        self.banished = [False] * n
        self.locks = [0] * n
        self.pinned = [False] * n
        self.last_access = [0.0] * n
        self.live: set[int] = set()
        self.done = -1  # last completed program op
        self.clock = 0.0
        self.used = 0
        self.peak = 0
        self.total = 0.0
        self.evictions = 0
        self.recomputes = 0
        self.steps: list[Step] = []
        # union-find over evicted values (h_eq)
        self.uf_parent: list[int] = []
        self.uf_cost: list[float] = []
        self.uf_of = [-1] * n

    # ------------------------------------------------------------------ the replay
    def run(self) -> DTRRun:
        """Replay the program; never raises for a budget that is too small."""
        try:
            for v in range(self.n):
                self._program_op(v)
        except _Stop as stop:
            return DTRRun(False, None, str(stop), self.evictions, self.recomputes, self.total, self.peak)
        return DTRRun(
            True, Schedule(tuple(self.steps)), "", self.evictions, self.recomputes, self.total, self.peak
        )

    def _program_op(self, v: int) -> None:
        self._materialize(v)
        self.done = v
        for u in self.release_at[v]:
            if self.resident[u] and self.locks[u] == 0:
                self._free_dead(u)

    def _materialize(self, target: int) -> None:
        """Compute ``target``, first recomputing (recursively) its evicted inputs."""
        stack: list[tuple[int, bool]] = [(target, False)]
        while stack:
            v, expanded = stack.pop()
            if not expanded:
                if self.resident[v]:
                    continue
                if self.computed[v] and not self.recomputable[v]:
                    raise _Stop(f"would have to recompute non-recomputable node {self._name(v)}")
                for p in self.preds[v]:
                    self.locks[p] += 1
                stack.append((v, True))
                stack.extend((p, False) for p in reversed(self.preds[v]) if not self.resident[p])
                continue
            self.reserve(v)
            self._compute(v)
            for p in self.preds[v]:
                self.locks[p] -= 1
                self.last_access[p] = self.clock
            for p in self.preds[v]:
                if self.resident[p] and self.locks[p] == 0 and self.dead_after[p] <= self.done:
                    self._free_dead(p)

    def _compute(self, v: int) -> None:
        self.steps.append((COMPUTE, v))
        if self.computed[v]:
            self.recomputes += 1
            k = self.uf_of[v]
            if k >= 0:
                self.uf_cost[self._find(k)] -= self.cost[v]
                self.uf_of[v] = -1
        self.computed[v] = True
        self.banished[v] = False
        self.resident[v] = True
        self.live.add(v)
        self.used += self.mem[v]
        self.peak = max(self.peak, self.used)
        self.clock += self.cost[v]
        self.total += self.cost[v]
        self.last_access[v] = self.clock
        self.on_alloc(v)
        if self.total > self.max_cost:
            raise _Stop(
                f"thrashing: computed cost passed {self.max_cost / max(self.graph.total_cost, _TINY):g}x "
                "the no-recompute cost (raise thrash_factor or the budget)"
            )
        if self.deadline is not None and len(self.steps) % 512 == 0 and time.perf_counter() > self.deadline:
            raise _Stop("time limit reached")

    def _release(self, u: int) -> None:
        self.steps.append((FREE, u))
        self.resident[u] = False
        self.live.discard(u)
        self.used -= self.mem[u]
        self.on_release(u)

    def _free_dead(self, u: int) -> None:
        """Free a value the program will not read again (banishing)."""
        self._release(u)
        if self.banish and all(self.resident[c] or self.banished[c] for c in self.succs[u]):
            # banished: as in DTR, a value whose parent is banished is no longer
            # evictable (it could not be rematerialized by the eager runtime)
            self.banished[u] = True
            for c in self.succs[u]:
                self.pinned[c] = True
        else:
            self._join_evicted(u)

    def evict(self, u: int) -> None:
        """Evict resident value ``u`` to make room."""
        self._release(u)
        self.evictions += 1
        self._join_evicted(u)

    # ------------------------------------------------------------------ making room
    def reserve(self, v: int) -> None:
        """Evict until ``v``'s output fits in the budget."""
        need = self.mem[v]
        while self.used + need > self.budget:
            victim = self.choose()
            if victim is None:
                raise _Stop(self._stuck_message(v))
            self.evict(victim)

    def candidates(self) -> list[int]:
        """Resident values that may be evicted now."""
        return [
            u
            for u in self.live
            if self.locks[u] == 0 and self.recomputable[u] and self.mem[u] > 0 and not self.pinned[u]
        ]

    def choose(self) -> int | None:
        """The candidate of least score (ties: the lowest id), or None."""
        best, best_score = None, math.inf
        for u in sorted(self.candidates()):
            s = self.score(u)
            if best is None or s < best_score:
                best, best_score = u, s
        return best

    def score(self, u: int) -> float:
        """The heuristic's score of resident value ``u`` (lower = evicted first)."""
        stale = max(self.clock - self.last_access[u], _TINY)
        h = self.heuristic
        if h == "lru":
            return 1.0 / stale
        if h == "size":
            return 1.0 / self.mem[u] + _TINY / stale
        c = self.cost[u]
        if h == "eq":
            c += self.neighbourhood_cost_eq(u)
        elif h == "dtr":
            c += self.neighbourhood_cost(u)
        return c / (self.mem[u] * stale)

    def is_evicted(self, u: int) -> bool:
        return self.computed[u] and not self.resident[u] and not self.banished[u]

    def neighbourhood_cost(self, u: int) -> float:
        """c(e*(u)): the cost of the evicted values connected to u through evicted values."""
        seen = {u}
        stack = [u]
        total = 0.0
        while stack:
            v = stack.pop()
            for w in (*self.preds[v], *self.succs[v]):
                if w not in seen and self.is_evicted(w):
                    seen.add(w)
                    total += self.cost[w]
                    stack.append(w)
        return total

    def neighbourhood_cost_eq(self, u: int) -> float:
        """The union-find estimate of c(e*(u)): the cost of the distinct classes of u's
        evicted neighbours."""
        roots = {
            self._find(self.uf_of[w])
            for w in (*self.preds[u], *self.succs[u])
            if self.uf_of[w] >= 0 and self.is_evicted(w)
        }
        return sum(self.uf_cost[r] for r in roots)

    # ------------------------------------------------------------------ hooks
    def on_alloc(self, v: int) -> None:
        """Called after ``v``'s output is allocated."""

    def on_release(self, u: int) -> None:
        """Called after ``u``'s output is freed."""

    # ------------------------------------------------------------------ union-find
    def _find(self, k: int) -> int:
        parent = self.uf_parent
        root = k
        while parent[root] != root:
            root = parent[root]
        while parent[k] != root:
            parent[k], k = root, parent[k]
        return root

    def _join_evicted(self, u: int) -> None:
        k = len(self.uf_parent)
        self.uf_parent.append(k)
        self.uf_cost.append(self.cost[u])
        self.uf_of[u] = k
        for w in (*self.preds[u], *self.succs[u]):
            if self.uf_of[w] >= 0 and self.is_evicted(w):
                a, b = self._find(k), self._find(self.uf_of[w])
                if a != b:
                    self.uf_parent[b] = a
                    self.uf_cost[a] += self.uf_cost[b]

    # ------------------------------------------------------------------ messages
    def _name(self, v: int) -> str:
        nd = self.graph.nodes[v]
        return f"{nd.ext!r} ({nd.name})"

    def _stuck_message(self, v: int) -> str:
        return (
            f"no value can be evicted to fit node {self._name(v)} ({self.mem[v]:,} bytes): "
            f"{self.used:,} bytes in use are locked or not recomputable under a budget of "
            f"{self.budget:,}; raise the budget"
        )


def run_dtr(
    graph: Graph,
    budget: int,
    heuristic: str = DEFAULT_HEURISTIC,
    *,
    thrash_factor: float = DEFAULT_THRASH_FACTOR,
    time_limit: float | None = None,
) -> DTRRun:
    """Replay ``graph`` under ``budget`` with DTR (see the module docstring).

    Raises:
        ValueError: unknown heuristic.
    """
    return DTRSimulator(graph, budget, heuristic, thrash_factor=thrash_factor, time_limit=time_limit).run()


def dtr(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    heuristic: str = DEFAULT_HEURISTIC,
    thrash_factor: float = DEFAULT_THRASH_FACTOR,
    banish: bool = True,
) -> SolveResult:
    """The DTR strategy: FEASIBLE with the replay's schedule, or NO_SOLUTION with the
    reason in ``info["message"]`` (budget too small for the locked values, thrashing).

    Args:
        heuristic: one of :data:`HEURISTICS` (default ``"eq"``).
        thrash_factor: stop when the computed cost passes this multiple of the
            no-recompute cost.
        banish: as the paper's eager runtime, pin the children of a freed value none of
            whose children is evicted (they could not be rematerialized). A static plan
            can recompute the freed value too: ``banish=False`` never pins, so a
            rematerialization may recompute ancestors the program already freed.
    """
    return _solve("dtr", graph, budget, heuristic, thrash_factor, time_limit, DTRSimulator, banish=banish)


def _variant(heuristic: str, doc: str) -> Callable[..., SolveResult]:
    """The entry point of DTR with one fixed heuristic (its options: ``thrash_factor``)."""
    name = "dtr-full" if heuristic == "dtr" else f"dtr-{heuristic}"

    def variant(
        graph: Graph,
        budget: int,
        *,
        time_limit: float | None = None,
        thrash_factor: float = DEFAULT_THRASH_FACTOR,
    ) -> SolveResult:
        return _solve(name, graph, budget, heuristic, float(thrash_factor), time_limit, DTRSimulator)

    variant.__name__ = variant.__qualname__ = name.replace("-", "_")
    variant.__doc__ = doc
    return variant


dtr_full = _variant("dtr", "DTR with h_DTR (exact evicted neighbourhood).")
dtr_eq = _variant("eq", "DTR with h_eq (union-find neighbourhood).")
dtr_local = _variant("local", "DTR with h_local = c / (m s).")
dtr_lru = _variant("lru", "DTR evicting the least recently used value.")
dtr_size = _variant("size", "DTR evicting the largest value.")


def _solve(
    name: str,
    graph: Graph,
    budget: int,
    heuristic: str,
    thrash_factor: float,
    time_limit: float | None,
    cls: type[DTRSimulator],
    *,
    banish: bool = True,
) -> SolveResult:
    t0 = time.perf_counter()
    run = cls(
        graph, budget, heuristic, thrash_factor=thrash_factor, time_limit=time_limit, banish=banish
    ).run()
    info: dict[str, Any] = {
        "heuristic": heuristic,
        "banish": banish,
        "evictions": run.evictions,
        "recomputes": run.recomputes,
    }
    return run_result(name, graph, budget, run, info, t0)


def run_result(
    name: str, graph: Graph, budget: int, run: Any, info: dict[str, Any], t0: float
) -> SolveResult:
    """The :class:`SolveResult` of one eviction run (DTR or Coop), replayed by the simulator."""
    if not run.ok or run.schedule is None:
        info["message"] = f"{name}: {run.message}"
        return SolveResult(
            name, Status.NO_SOLUTION, budget, solve_seconds=time.perf_counter() - t0, info=info
        )
    sim = simulate(graph, run.schedule)
    assert sim.peak == run.peak and sim.peak <= budget, (
        f"{name}'s own accounting disagrees with the simulator"
    )
    return SolveResult(
        name,
        Status.FEASIBLE,
        budget,
        schedule=run.schedule,
        cost=sim.cost,
        peak=sim.peak,
        solve_seconds=time.perf_counter() - t0,
        info=info,
    )
