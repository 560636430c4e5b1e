"""Planning under ``torch.distributed``: one plan for all ranks, and what DDP adds to a step.

Ranks of a data-parallel job trace the same graph. Planning it on every rank wastes the
time limit N times over, and a strategy that is not deterministic (a solver stopped by
its time limit) could hand ranks different schedules. So rank 0 plans and broadcasts the
plan document (the same JSON a plan file holds); every other rank rebuilds the schedule
for its own graph, re-validates it with the simulator, and all ranks compare the plan's
checksum before running it. Ranks may ask slightly different budgets (each measured its
own memory): rank 0 plans for the smallest, so every rank's budget holds. Every rank must
compile the same graphs in the same order (as DDP training does): the broadcast is a
collective.

DDP all-reduces gradients through buckets: a flat copy of the gradients that lives during
the backward, outside the traced graph. :func:`ddp_reserve` is the bytes the planner must
leave for it, from the parameters of the module DDP is running.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers a module's parameters before its
forward and again before its backward, and reduce-scatters its gradients after it. Its hooks
are ``torch._dynamo.disable``d (torch 2.13), so torch.compile cannot trace through a sharded
submodule: a model optimized as a whole and sharded per block (in either order) would run
its blocks outside every plan. The supported order is per block: ``optimize`` each block,
then ``fully_shard`` each block and the root. :func:`check_fsdp_order` raises for the
others, and :func:`fsdp_reserve` is what FSDP2 holds beside a block's graph.
"""

from __future__ import annotations

import hashlib
import pickle
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from checkmate.eager import real_tensors
from solvers.api import closest_hint
from solvers.errors import CheckmateError, PlanError, TraceError
from solvers.graph import Graph
from solvers.plan import graph_fingerprint, plan_from_dict, plan_to_dict
from solvers.result import SolveResult, Status
from solvers.schedule import Schedule, validate

__all__ = [
    "rank_and_world",
    "active_ddp_module",
    "ddp_reserve",
    "fsdp_reserve",
    "check_fsdp_order",
    "plan_hash",
    "plan_once",
    "agreed_budget",
    "agree_bytes",
]


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def active_ddp_module() -> torch.nn.Module | None:
    """The ``DistributedDataParallel`` module whose forward is running, if any (DDP sets
    it for the duration of its forward)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return getattr(DistributedDataParallel, "_active_ddp_module", None)


def ddp_reserve(module: torch.nn.Module | None = None) -> int:
    """Bytes DDP holds during a step beyond the traced graph: its gradient buckets, one
    copy of every gradient it reduces. 0 outside a DDP forward."""
    ddp = module if module is not None else active_ddp_module()
    if ddp is None:
        return 0
    return sum(p.numel() * p.element_size() for p in ddp.parameters() if p.requires_grad)


def _fsdp_module_class() -> type | None:
    """``FSDPModule`` when FSDP2 was imported (nothing to check otherwise), else None."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


_FSDP_ORDER = (
    "optimize each block first, then shard: `model.blocks[i] = checkmate.optimize(block, "
    "block_budget)`, `fully_shard(model.blocks[i])` for each block, then `fully_shard(model)`"
)


def check_fsdp_order(module: torch.nn.Module, *, optimizing: bool = False) -> None:
    """Raise when ``module`` (an optimized module, or one given to ``optimize`` when
    ``optimizing``) holds FSDP2-sharded modules that its plan cannot cover.

    FSDP2's hooks are ``torch._dynamo.disable``d, so Dynamo stops at every sharded
    submodule and runs the surrounding forward eagerly: the plans would cover the blocks'
    forwards at the whole step's budget while the step runs unbounded (measured: 2.0x the
    budget, nothing recomputed). A module sharded itself *after* ``optimize`` is fine: its
    hooks run around the planned forward.

    Raises:
        TraceError: ``module`` was sharded before ``optimize``, or has sharded submodules.
    """
    fsdp = _fsdp_module_class()
    if fsdp is None:
        return
    it = module.modules() if optimizing else (m for m in module.modules() if m is not module)
    sharded = next((m for m in it if isinstance(m, fsdp)), None)
    if sharded is None:
        return
    where = type(sharded).__name__ if sharded is not module else "the module itself"
    if optimizing:
        raise TraceError(
            f"fully_shard was applied before checkmate.optimize ({where} is sharded): torch.compile "
            f"cannot trace through FSDP2's hooks, so no plan would bound the step; {_FSDP_ORDER}"
        )
    raise TraceError(
        f"fully_shard was applied to a submodule ({where}) of a module optimized as a whole: "
        f"torch.compile cannot trace through FSDP2's hooks, so the step would run outside the plan; "
        f"{_FSDP_ORDER}"
    )


def fsdp_reserve() -> int:
    """Bytes FSDP2 holds beside the graph being planned, 0 outside a sharded forward.

    Parameters are primals, outside every graph's memory, but FSDP2 allocates the unsharded
    ones inside the step: the parameters of every sharded module whose forward is running
    (the block being planned and its enclosing root, which keeps its own unsharded through
    the step) count, and the innermost module's once more: during its backward FSDP2
    prefetches the next block's all-gather, and after it copies the gradients into the
    reduce-scatter input.
    """
    if _fsdp_module_class() is None:
        return 0
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    running: dict[torch.nn.Module, int] = {}
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if state is None or getattr(state, "_training_state", None) != TrainingState.FORWARD:
            continue
        running[module] = sum(
            fp._orig_size.numel() * (fp.param_dtype or fp.orig_dtype).itemsize
            for group in getattr(state, "_fsdp_param_groups", ())
            for fp in group.fsdp_params
        )
    if not running:
        return 0
    # the innermost: the running module with no running module below it
    inner = [m for m in running if not any(o is not m and o in running for o in m.modules())]
    return sum(running.values()) + max(running[m] for m in inner)


def plan_hash(graph: Graph, schedule: Schedule) -> str:
    """sha256 of the graph's fingerprint and the schedule's steps: equal on two ranks
    exactly when they run the same plan on the same graph."""
    h = hashlib.sha256(graph_fingerprint(graph).encode())
    h.update(repr(schedule.steps).encode())
    return h.hexdigest()


def plan_once(graph: Graph, budget_bytes: int, solve: Callable[[int], SolveResult]) -> SolveResult:
    """``solve(bytes)`` on rank 0, its plan on every rank.

    ``budget_bytes`` is this rank's budget for ``graph`` (``-1``: the least peak, asked of
    every rank alike). Without a process group (or with one rank) this is
    ``solve(budget_bytes)``. Otherwise the ranks first agree on the smallest of their
    budgets; rank 0 solves at it and broadcasts the plan document (or its error); the other
    ranks rebuild the schedule for ``graph``, re-validate it within that budget, and every
    rank checks that all hold the same plan checksum.

    Raises:
        PlanError: a rank's graph differs from rank 0's, the ranks' plans differ, or some
            ranks ask the least peak and others a number of bytes.
        CheckmateError: rank 0 could not plan (its error, re-raised on every rank).
    """
    rank, world = rank_and_world()
    if world == 1:
        return solve(budget_bytes)
    with _collectives():
        return _plan_once(graph, budget_bytes, solve, rank, world)


@contextmanager
def _collectives() -> Iterator[None]:
    """Where the planner may call collectives from inside a compile.

    The partitioner runs under AOTAutograd's fake mode and with the Python dispatcher on:
    the collectives need real tensors, and must not hold the GIL while they queue work.
    gloo's worker thread frees the last collective's tensors (which needs the GIL) while
    holding its queue's lock; with the dispatcher on, the next collective waited for that
    lock holding the GIL, and both ranks hung at the first plan in about one run in ten.
    """
    with real_tensors():
        yield


def agree_bytes(nbytes: int) -> int:
    """The smallest of the ranks' byte budgets (``nbytes`` without a process group; ``-1``
    when every rank asks the least peak, see :func:`agreed_budget`).

    Ranks that measured their own memory ask slightly different budgets; every decision
    the planner makes before it plans (reuse a plan of the graph's family, plan ahead) must
    be the same on every rank, or one rank waits in a collective that the others skip.
    Every rank must call this for the same graphs in the same order, as for
    :func:`plan_once`.
    """
    _, world = rank_and_world()
    if world == 1:
        return nbytes
    asked: list[Any] = [None] * world
    with _collectives():
        torch.distributed.all_gather_object(asked, int(nbytes))
    return agreed_budget(asked)


def agreed_budget(budgets: list[int]) -> int:
    """The budget every rank plans for: the smallest asked, ``-1`` when all ask the least
    peak.

    Raises:
        PlanError: some ranks ask the least peak and others a number of bytes.
    """
    least = [b < 0 for b in budgets]
    if any(least) and not all(least):
        asked = ", ".join(f"rank {r}: {'min' if b < 0 else f'{b:,} B'}" for r, b in enumerate(budgets))
        raise PlanError(
            f"ranks ask different kinds of budget for one graph ({asked}): pass every rank the same "
            'budget ("min", a fraction, or bytes)'
        )
    return -1 if all(least) else min(budgets)


def _plan_once(
    graph: Graph, budget_bytes: int, solve: Callable[[int], SolveResult], rank: int, world: int
) -> SolveResult:
    dist = torch.distributed
    budget_bytes = agree_bytes(budget_bytes)  # raises on every rank alike: they all see the same list
    message: list[Any] = [None]
    result: SolveResult | None = None
    if rank == 0:
        try:
            result = solve(budget_bytes)
            if not result.ok or result.schedule is None:
                message[0] = ("none", f"{result.status}{closest_hint(result)}")
            else:
                message[0] = ("plan", plan_to_dict(graph, result))
        except CheckmateError as exc:
            message[0] = ("error", _portable(exc))
            dist.broadcast_object_list(message, src=0)
            raise
    dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        if isinstance(payload, CheckmateError):
            # the same type on every rank: callers that fall back on an InfeasibleBudgetError
            # (a fraction too low) do so on every rank alike, and their collectives stay paired
            payload.add_note("rank 0 planned this graph for every rank; this is its error")
            raise payload
        name, text = payload
        raise CheckmateError(f"rank 0 could not plan this graph ({name}): {text}")
    if kind == "none":
        if rank == 0:
            assert result is not None
            return result  # the caller reports it (SolverError with the closest plan)
        raise CheckmateError(f"rank 0 found no plan for this graph within its budget ({payload})")
    failed: str | None = None
    if rank != 0:
        try:
            result = _rebuild(graph, payload, budget_bytes)
        except CheckmateError as exc:  # still joins the gather below: no rank is left waiting
            failed = f"{type(exc).__name__}: {exc}"
    sums: list[Any] = [None] * world
    mine = ("error", failed) if failed is not None else ("hash", plan_hash(graph, _schedule(result)))
    dist.all_gather_object(sums, mine)
    errors = [f"rank {r}: {text}" for r, (kind, text) in enumerate(sums) if kind == "error"]
    if errors:
        raise PlanError(f"rank 0's plan could not be used on every rank ({'; '.join(errors)})")
    if len({text for _, text in sums}) != 1:
        raise PlanError(
            f"ranks hold different plans for one graph (checksums {sorted({t for _, t in sums})}): their "
            "graphs differ; make every rank trace the same model with the same input shapes"
        )
    assert result is not None
    return result


def _portable(exc: CheckmateError) -> CheckmateError | tuple[str, str]:
    """``exc`` if it pickles whole (then other ranks raise its type), else its name and text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # an error holding something that does not pickle
        return (type(exc).__name__, str(exc))
    return exc


def _schedule(result: SolveResult | None) -> Schedule:
    assert result is not None and result.schedule is not None
    return result.schedule


def _rebuild(graph: Graph, payload: dict[str, Any], budget_bytes: int) -> SolveResult:
    """Rank 0's plan document as this rank's result for ``graph``, re-validated.

    Raises:
        PlanError: rank 0 traced another graph.
        ScheduleError: its schedule does not fit ``budget_bytes`` on this graph.
    """
    plan = plan_from_dict(payload, graph)  # PlanError when rank 0 traced another graph
    if budget_bytes < 0:  # the budget "min": rank 0's least peak
        budget_bytes = int(plan.doc["budget_bytes"])
    sim = validate(graph, plan.schedule, budget_bytes)
    doc = plan.doc
    lower = doc.get("lower_bound")
    return SolveResult(
        strategy=str(doc["strategy"]),
        status=Status(str(doc["status"])),
        budget=budget_bytes,
        schedule=plan.schedule,
        cost=sim.cost,
        peak=sim.peak,
        lower_bound=None if lower is None else float(lower),
        info={**dict(doc.get("info") or {}), "cache": "rank 0"},
    )
