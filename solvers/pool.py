"""An address-ordered memory pool: what a schedule's peak costs once memory has addresses.

The simulator counts bytes; a real allocator places each tensor in a contiguous range
of addresses. Freed ranges leave holes that a later, larger tensor may not fit in; then
the pool grows although enough bytes are free in total. This module replays any
:class:`~solvers.schedule.Schedule` through such a pool (the model of Zhang et al.,
"Coop: Memory is not a Commodity", NeurIPS 2023) and reports:

- peak reserved bytes: the largest extent the pool reached;
- fragmentation: the free bytes inside the pool that could not serve an allocation, at
  the worst moment (an allocation that had to grow the pool although that many bytes
  were free elsewhere in it).

Blocks are kept in address order; a freed block coalesces with free neighbours; an
allocation splits a free block. Policies: ``"first-fit"`` (lowest adequate address) and
``"best-fit"`` (smallest adequate block, lowest address on ties). An allocation may also
be placed at the top of the highest adequate block (``from_top``), which Coop uses to
keep cheap and expensive tensors at opposite ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from solvers.graph import Graph
from solvers.schedule import COMPUTE, FREE, PAGEIN, Schedule, Step

__all__ = ["POLICIES", "Block", "MemoryPool", "PoolStats", "pool_stats"]

POLICIES = ("first-fit", "best-fit")
FREE_OWNER = -1


@dataclass(slots=True)
class Block:
    """A contiguous range ``[addr, addr + size)``; ``owner`` is a node id or -1 when free."""

    addr: int
    size: int
    owner: int = FREE_OWNER

    @property
    def free(self) -> bool:
        return self.owner == FREE_OWNER


@dataclass(frozen=True)
class PoolStats:
    """What replaying a schedule through a pool measured.

    Attributes:
        policy: the placement policy.
        peak_reserved: the largest extent of the pool (bytes).
        peak_allocated: the largest sum of live tensors (bytes): the simulator's peak.
        fragmentation: free bytes inside the pool that an allocation could not use, at the
            worst moment (0 when no allocation ever grew the pool past free space).
        fragmentation_step: the step index of that moment, -1 if none.
        allocations: number of allocations of non-zero size.
    """

    policy: str
    peak_reserved: int
    peak_allocated: int
    fragmentation: int
    fragmentation_step: int
    allocations: int

    @property
    def overhead(self) -> float:
        """peak_reserved / peak_allocated - 1 (0 for an empty schedule)."""
        return self.peak_reserved / self.peak_allocated - 1.0 if self.peak_allocated else 0.0


class MemoryPool:
    """An address-ordered pool of blocks.

    Args:
        capacity: a fixed size (allocation returns None when nothing fits), or None for a
            pool that grows at its top end.
        policy: ``"first-fit"`` or ``"best-fit"``.

    Raises:
        ValueError: unknown policy or negative capacity.
    """

    def __init__(self, capacity: int | None = None, policy: str = "best-fit") -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: choose 'first-fit' or 'best-fit'")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self.policy = policy
        self.capacity = capacity
        self.blocks: list[Block] = [Block(0, capacity)] if capacity else []
        self.where: dict[int, int] = {}  # owner -> address
        self.allocated = 0
        self.peak_reserved = self.reserved
        self.peak_allocated = 0
        self.fragmentation = 0
        self.fragmentation_at = -1
        self.allocations = 0
        self.clock = 0  # bumped by the caller (e.g. the step index) for fragmentation_at

    # ------------------------------------------------------------------ queries
    @property
    def reserved(self) -> int:
        """The pool's extent in bytes."""
        return self.blocks[-1].addr + self.blocks[-1].size if self.blocks else 0

    @property
    def free_bytes(self) -> int:
        return self.reserved - self.allocated

    def largest_free(self) -> int:
        return max((b.size for b in self.blocks if b.free), default=0)

    def address_of(self, owner: int) -> int:
        """The address of ``owner``'s block (KeyError if it has none)."""
        return self.where[owner]

    # ------------------------------------------------------------------ operations
    def allocate(self, owner: int, size: int, *, from_top: bool = False) -> int | None:
        """Place ``size`` bytes for ``owner``; return the address, or None when a fixed
        pool has no adequate free block. Zero-size allocations take no block (address -1).

        Raises:
            ValueError: ``owner`` already holds a block or is negative.
        """
        if owner < 0 or owner in self.where:
            raise ValueError(f"owner {owner} is invalid or already allocated")
        if size <= 0:
            self.where[owner] = -1
            return -1
        k = self._fit(size, from_top)
        if k is None:
            if self.capacity is not None:
                return None
            k = self._grow(size)
        addr = self._split(k, size, owner, from_top)
        self.where[owner] = addr
        self.allocated += size
        self.allocations += 1
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return addr

    def release(self, owner: int) -> None:
        """Free ``owner``'s block and coalesce it with free neighbours.

        Raises:
            KeyError: ``owner`` holds no block.
        """
        addr = self.where.pop(owner)
        if addr < 0:
            return
        k = self._index(addr)
        blk = self.blocks[k]
        assert blk.owner == owner, "pool bookkeeping out of sync"
        blk.owner = FREE_OWNER
        self.allocated -= blk.size
        if k + 1 < len(self.blocks) and self.blocks[k + 1].free:
            blk.size += self.blocks.pop(k + 1).size
        if k > 0 and self.blocks[k - 1].free:
            self.blocks[k - 1].size += self.blocks.pop(k).size

    # ------------------------------------------------------------------ internals
    def _fit(self, size: int, from_top: bool) -> int | None:
        cands = [k for k, b in enumerate(self.blocks) if b.free and b.size >= size]
        if not cands:
            return None
        if from_top:
            return (
                cands[-1]
                if self.policy == "first-fit"
                else min(cands, key=lambda k: (self.blocks[k].size, -k))
            )
        if self.policy == "first-fit":
            return cands[0]
        return min(cands, key=lambda k: (self.blocks[k].size, k))

    def _grow(self, size: int) -> int:
        """Extend an unbounded pool so that its top free block holds ``size`` bytes."""
        top = self.blocks[-1] if self.blocks else None
        usable = top.size if top is not None and top.free else 0
        wasted = self.free_bytes - usable  # free bytes this allocation could not use
        if wasted > self.fragmentation:
            self.fragmentation, self.fragmentation_at = wasted, self.clock
        if top is not None and top.free:
            top.size = size
            return len(self.blocks) - 1
        self.blocks.append(Block(self.reserved, size))
        return len(self.blocks) - 1

    def _split(self, k: int, size: int, owner: int, from_top: bool) -> int:
        blk = self.blocks[k]
        rest = blk.size - size
        if rest == 0:
            blk.owner = owner
            return blk.addr
        if from_top:
            blk.size = rest
            self.blocks.insert(k + 1, Block(blk.addr + rest, size, owner))
            return blk.addr + rest
        self.blocks.insert(k + 1, Block(blk.addr + size, rest))
        blk.size, blk.owner = size, owner
        return blk.addr

    def _index(self, addr: int) -> int:
        lo, hi = 0, len(self.blocks) - 1
        while lo <= hi:
            mid = (lo + hi) // 2
            a = self.blocks[mid].addr
            if a == addr:
                return mid
            if a < addr:
                lo = mid + 1
            else:
                hi = mid - 1
        raise KeyError(f"no block at address {addr}")


def pool_stats(graph: Graph, schedule: Schedule | Sequence[Step], policy: str = "best-fit") -> PoolStats:
    """Replay ``schedule`` through a growing pool; report peak reserved bytes and
    fragmentation.

    Args:
        graph: the graph the schedule runs (sizes from ``graph.mem``).
        schedule: a schedule the simulator accepts.
        policy: ``"first-fit"`` or ``"best-fit"``.

    Returns:
        :class:`PoolStats`; ``peak_allocated`` equals the simulator's peak.

    Raises:
        ValueError: unknown policy; a step frees a value that holds no block.
    """
    steps = schedule.steps if isinstance(schedule, Schedule) else schedule
    pool = MemoryPool(None, policy)
    mem = graph.mem.tolist()
    for s, (op, i) in enumerate(steps):
        pool.clock = s
        if op in (COMPUTE, PAGEIN):  # a page-in allocates like a compute
            pool.allocate(i, mem[i])
        elif op == FREE:
            try:
                pool.release(i)
            except KeyError:
                raise ValueError(f"step {s} frees node {i}, which holds no memory") from None
        # a page-out copies to the host: the device block stays until its free
    return PoolStats(
        policy=policy,
        peak_reserved=pool.peak_reserved,
        peak_allocated=pool.peak_allocated,
        fragmentation=pool.fragmentation,
        fragmentation_step=pool.fragmentation_at,
        allocations=pool.allocations,
    )
