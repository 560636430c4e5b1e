"""Coop (Zhang et al., "Coop: Memory is not a Commodity", NeurIPS 2023) as a DTR variant.

DTR (see :mod:`solvers.strategies.dtr`) frees the cheapest tensors one at a time, which
counts bytes but not addresses: the freed bytes may be scattered and no hole may fit
the next tensor. Coop evicts with the memory layout in view:

- The budget is a pool of fixed size with address-ordered blocks
  (:class:`solvers.pool.MemoryPool`, best-fit, splitting and coalescing).
- When no free block fits a new tensor of size m, Coop evicts a *contiguous window* of
  blocks (free blocks and evictable tensors, none locked, pinned or non-recomputable)
  of at least m bytes with the least total eviction cost, found by two pointers over the
  address-ordered blocks in one pass. The freed bytes are adjacent, so they are used.
- Cheap and expensive tensors (compute cost per byte below / above the median) are
  allocated from opposite ends of the pool, so windows of cheap tensors form.

The eviction cost of a tensor t is its DTR score times its size,
(c(t) + c(e*(t))) / s(t) with h_eq's neighbourhood by default: the recompute work its
eviction is expected to cause, discounted by staleness.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from solvers.errors import OptionError
from solvers.graph import Graph
from solvers.pool import MemoryPool
from solvers.result import SolveResult
from solvers.strategies.dtr import DEFAULT_THRASH_FACTOR, DTRSimulator, _Stop, run_result

__all__ = ["CoopSimulator", "coop"]

_HEURISTICS = ("eq", "dtr", "local")


class CoopSimulator(DTRSimulator):
    """DTR whose room-making evicts the cheapest contiguous window of a fixed pool."""

    def __init__(
        self,
        graph: Graph,
        budget: int,
        heuristic: str = "eq",
        *,
        thrash_factor: float = DEFAULT_THRASH_FACTOR,
        time_limit: float | None = None,
        partition: bool = True,
    ) -> None:
        if heuristic not in _HEURISTICS:
            raise OptionError(f"coop heuristic={heuristic!r}: choose one of {', '.join(_HEURISTICS)}")
        super().__init__(graph, budget, heuristic, thrash_factor=thrash_factor, time_limit=time_limit)
        self.pool = MemoryPool(capacity=self.budget, policy="best-fit")
        dens = [c / m for c, m in zip(self.cost, self.mem) if m > 0]
        cut = statistics.median(dens) if dens else 0.0
        # expensive tensors (high cost per byte) go to the top of the pool
        self.top = [partition and m > 0 and c / m > cut for c, m in zip(self.cost, self.mem)]
        self.windows = 0

    def reserve(self, v: int) -> None:
        need = self.mem[v]
        if self.pool.allocate(v, need, from_top=self.top[v]) is not None:
            return
        window = self._cheapest_window(need)
        if window is None:
            raise _Stop(self._stuck_message(v))
        self.windows += 1
        for u in window:
            self.evict(u)
        addr = self.pool.allocate(v, need, from_top=self.top[v])
        assert addr is not None, "an evicted window of enough bytes must fit the tensor"

    def on_release(self, u: int) -> None:
        self.pool.release(u)

    def _cheapest_window(self, need: int) -> list[int] | None:
        """The evictable tensors of the least-cost run of adjacent blocks of >= need bytes
        (two pointers: the right end advances, the left end follows while the window
        minus its leftmost block still holds ``need`` bytes)."""
        evictable = set(self.candidates())
        blocks = self.pool.blocks
        costs: list[float | None] = []  # None = a block no window may contain
        for b in blocks:
            if b.free:
                costs.append(0.0)
            elif b.owner in evictable:
                costs.append(self.score(b.owner) * self.mem[b.owner])
            else:
                costs.append(None)
        best: tuple[float, int, int, int] | None = None  # (cost, bytes, left, right)
        left, size, cost = 0, 0, 0.0
        for right, b in enumerate(blocks):
            c = costs[right]
            if c is None:
                left, size, cost = right + 1, 0, 0.0
                continue
            size += b.size
            cost += c
            while left < right and size - blocks[left].size >= need:
                size -= blocks[left].size
                cost -= costs[left] or 0.0
                left += 1
            if size >= need and (best is None or (cost, size) < best[:2]):
                best = (cost, size, left, right)
        if best is None:
            return None
        return [b.owner for b in blocks[best[2] : best[3] + 1] if not b.free]


def coop(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    heuristic: str = "eq",
    partition: bool = True,
    thrash_factor: float = DEFAULT_THRASH_FACTOR,
) -> SolveResult:
    """The Coop strategy: FEASIBLE with a schedule whose tensors also fit a pool of
    ``budget`` bytes with addresses, or NO_SOLUTION with the reason.

    Args:
        heuristic: the DTR score behind each tensor's eviction cost: ``"eq"`` (default),
            ``"dtr"`` or ``"local"``.
        partition: allocate cheap and expensive tensors from opposite ends of the pool.
        thrash_factor: stop when the computed cost passes this multiple of the
            no-recompute cost.

    Returns:
        ``info`` carries ``pool_capacity`` (= budget: every tensor had an address below
        it), the number of window evictions and the DTR counters.
    """
    t0 = time.perf_counter()
    sim_ = CoopSimulator(
        graph, budget, heuristic, thrash_factor=thrash_factor, time_limit=time_limit, partition=partition
    )
    run = sim_.run()
    info: dict[str, Any] = {
        "heuristic": heuristic,
        "evictions": run.evictions,
        "recomputes": run.recomputes,
        "windows": sim_.windows,
        "pool_capacity": sim_.pool.capacity,
    }
    return run_result("coop", graph, budget, run, info, t0)
