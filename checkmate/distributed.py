"""Planning under ``torch.distributed``: one plan shared by the ranks, and what DDP adds to a step.

Ranks of a data-parallel job trace the same graph, most of the time. Planning it on every
rank wastes the time limit N times over on the host's cores, and a strategy that is not
deterministic (a solver stopped by its time limit) would hand ranks different schedules. So
the first rank to plan a graph at a budget publishes the plan document (the same JSON a
plan file holds) in the process group's key-value store, and a rank that asks for the same
plan later rebuilds the schedule for its own graph and re-validates it with the simulator
(:func:`plan_once`).

The ranks never meet in a collective while planning. Ranks do not compile in step: with
dynamic padding each rank's batch has its own sequence length, so one rank compiles a shape
while the other runs a shape it compiled before, and a collective there waits for a rank
that never joins (measured: a ``PlanError`` at the first step where the shapes differed,
where the next would have hung). Through the store a rank only ever waits for a plan that
another rank is making, and each rank's plan fits its own budget: ranks asking different
budgets (each measured its own memory) plan apart.

DDP all-reduces gradients through buckets: a flat copy of the gradients that lives during
the backward, outside the traced graph. :func:`ddp_reserve` is the bytes the planner must
leave for it, from the parameters of the module DDP is running.

FSDP2 (``torch.distributed.fsdp.fully_shard``) all-gathers a module's parameters before its
forward and again before its backward, and reduce-scatters its gradients after it. Its hooks
are ``torch._dynamo.disable``d (torch 2.13), so torch.compile cannot trace through a sharded
submodule: a model optimized as a whole and sharded per block (in either order) would run
its blocks outside every plan. The supported order is per block: ``optimize`` each block,
then ``fully_shard`` each block and the root. :func:`check_fsdp_order` raises for the
others, :func:`fsdp_reserve` is what FSDP2 holds beside a block's graph, and
:func:`fsdp_gradients` the gradients it keeps for a block over micro-batches.

FSDP1 (``FullyShardedDataParallel``) is not planned for: :func:`check_fsdp1` raises in
either order, naming FSDP2's.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import sys
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch

from solvers.api import closest_hint
from solvers.errors import CheckmateError, TraceError
from solvers.graph import Graph
from solvers.plan import graph_fingerprint, plan_from_dict, plan_to_dict
from solvers.result import SolveResult, Status
from solvers.schedule import Schedule, validate

__all__ = [
    "in_process_group",
    "rank_and_world",
    "active_ddp_module",
    "ddp_reserve",
    "fsdp_reserve",
    "check_fsdp_order",
    "check_fsdp1",
    "plan_hash",
    "plan_key",
    "plan_once",
]

log = logging.getLogger("checkmate")


def in_process_group() -> bool:
    """Whether a default process group is initialized (of any number of ranks)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized())


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group, ``(0, 1)`` without one."""
    if in_process_group():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
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


def _fsdp1_class() -> type | None:
    """FSDP1's ``FullyShardedDataParallel`` when ``torch.distributed.fsdp`` was imported."""
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _flattened(t: torch.Tensor) -> bool:
    """Whether ``t`` is an FSDP1 flat parameter, or a parameter FSDP1 flattened into one
    (``use_orig_params=True``; in its forward, a view of the flat parameter)."""
    # FSDP1 marks both with this attribute (torch.distributed.fsdp._common_utils.FSDP_FLATTENED)
    return bool(getattr(t, "_fsdp_flattened", False) or getattr(t._base, "_fsdp_flattened", False))


def check_fsdp1(module: torch.nn.Module, *, optimizing: bool = False) -> None:
    """Raise when FSDP1 (``FullyShardedDataParallel``) shards ``module`` (an optimized
    module, or one given to ``optimize`` when ``optimizing``), around it or inside it.

    In FSDP1's forward the module's parameters are views of a flat parameter whose
    gradient, a flat copy of them all, and the parameters it gathers again for the
    backward are held outside every plan: a 4-layer MLP optimized, then wrapped in FSDP1
    (``use_orig_params=True``, two gloo ranks), stepped at 1.54x its byte budget at every
    step, unwarned. Given to ``optimize`` whole, FSDP1's forward is one Dynamo gives up on:
    the step runs unplanned.

    Raises:
        TraceError: naming FSDP2's per-block order.
    """
    fsdp1 = _fsdp1_class()
    if fsdp1 is None:
        return
    own = "the module given to checkmate.optimize" if optimizing else "the optimized module"
    if any(isinstance(m, fsdp1) for m in module.modules()):
        where = own if optimizing else "a submodule of the optimized module"
    elif any(_flattened(p) for p in module.parameters()):
        where = f"{own} (FullyShardedDataParallel wraps it)"
    else:
        return
    raise TraceError(
        f"FSDP1 (FullyShardedDataParallel) shards {where}: checkmate plans steps under FSDP2 (fully_shard) "
        "and DDP, not FSDP1, whose flat parameters' gradients and gathered parameters are held outside every "
        f"plan, so the budget would not hold. Shard with FSDP2 instead: {_FSDP_ORDER}"
    )


def check_fsdp_order(module: torch.nn.Module, *, optimizing: bool = False) -> None:
    """Raise when ``module`` (an optimized module, or one given to ``optimize`` when
    ``optimizing``) holds FSDP2-sharded modules that its plan cannot cover, or is sharded
    by FSDP1 (:func:`check_fsdp1`).

    FSDP2's hooks are ``torch._dynamo.disable``d, so Dynamo stops at every sharded
    submodule and runs the surrounding forward eagerly: the plans would cover the blocks'
    forwards at the whole step's budget while the step runs unbounded (measured: 2.0x the
    budget, nothing recomputed). A module sharded itself *after* ``optimize`` is fine: its
    hooks run around the planned forward.

    Raises:
        TraceError: ``module`` was sharded before ``optimize``, or has sharded submodules, or
            FSDP1 shards it.
    """
    check_fsdp1(module, optimizing=optimizing)
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
    the step) count, at the dtype they are gathered in (a ``MixedPrecisionPolicy``'s
    ``param_dtype``), and the innermost module's once more: during its backward FSDP2
    prefetches the next block's all-gather, and after it copies the gradients into the
    reduce-scatter input, which is in the policy's ``reduce_dtype`` (float32 gradients of
    bfloat16 parameters are twice their size: planned at the parameters' size, such a
    block measured 1.09x its budget).
    """
    if _fsdp_module_class() is None:
        return 0
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    gathered: dict[torch.nn.Module, int] = {}  # module -> bytes of its unsharded parameters
    reduced: dict[torch.nn.Module, int] = {}  # module -> bytes of its reduce-scatter input
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if state is None or getattr(state, "_training_state", None) != TrainingState.FORWARD:
            continue
        params = [fp for group in getattr(state, "_fsdp_param_groups", ()) for fp in group.fsdp_params]
        gathered[module] = sum(fp._orig_size.numel() * _gathered_dtype(fp).itemsize for fp in params)
        reduced[module] = sum(
            fp._orig_size.numel() * (getattr(fp, "reduce_dtype", None) or _gathered_dtype(fp)).itemsize
            for fp in params
        )
    if not gathered:
        return 0
    # the innermost: the running module with no running module below it
    inner = [m for m in gathered if not any(o is not m and o in gathered for o in m.modules())]
    return sum(gathered.values()) + max(max(gathered[m], reduced[m]) for m in inner)


def _gathered_dtype(fp: Any) -> torch.dtype:
    """The dtype FSDP2 all-gathers an ``FSDPParam`` in (and computes its gradient in)."""
    return fp.param_dtype or fp.orig_dtype  # type: ignore[no-any-return]


def fsdp_params_of(module: torch.nn.Module) -> tuple[Any, ...]:
    """FSDP2's records (``FSDPParam``) of ``module``'s parameters, whether ``fully_shard`` was
    applied to ``module`` itself or to a module around it (an optimized block inside a sharded
    unit), empty where none is sharded. Found once per input signature: they live as long as
    the sharding, and :func:`fsdp_gradients` reads their gradients at every call."""
    if _fsdp_module_class() is None:
        return ()
    from torch.distributed._composable_state import _module_state_mapping

    mine = {id(m) for m in module.modules()}
    found = []
    for ref in list(_module_state_mapping.values()):
        state = ref()
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fp in group.fsdp_params:
                info = getattr(fp, "_module_info", None)
                if info is not None and id(info.module) in mine:
                    found.append(fp)
    return tuple(found)


def fsdp_gradients(params: Iterable[Any]) -> list[torch.Tensor]:
    """The gradients FSDP2 keeps for the parameters it manages (``params``, from
    :func:`fsdp_params_of`) where the forward does not see them.

    During a sharded module's forward its parameters are the unsharded ones, whose ``.grad`` is
    None once a backward's gradients were reduce-scattered: they are kept, this rank's shard,
    in each sharded parameter's ``.grad`` (a DTensor, as returned) until the optimizer step, accumulated
    over micro-batches. Under ``set_requires_gradient_sync(False)`` FSDP2 keeps the unsharded
    gradients instead: on the unsharded parameters (which the module's walk sees), or, with a
    ``reduce_dtype`` of its own, in ``unsharded_accumulated_grad``.
    """
    grads: list[torch.Tensor] = []
    for fp in params:
        sharded = getattr(fp, "sharded_param", None)
        if sharded is not None and sharded.grad is not None:
            grads.append(sharded.grad)  # a DTensor: its bytes are this rank's shard's
        accumulated = getattr(fp, "unsharded_accumulated_grad", None)
        if accumulated is not None:
            grads.append(accumulated)
    return grads


def plan_hash(graph: Graph, schedule: Schedule) -> str:
    """sha256 of the graph's fingerprint and the schedule's steps: equal on two ranks
    exactly when they run the same plan on the same graph."""
    h = hashlib.sha256(graph_fingerprint(graph).encode())
    h.update(repr(schedule.steps).encode())
    return h.hexdigest()


#: prefix of checkmate's keys in the process group's store
KEY_PREFIX = "checkmate/plan/"


def _store() -> Any:
    """The default process group's key-value store, None without a group of several ranks."""
    if rank_and_world()[1] == 1:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def plan_key(graph: Graph, budget_bytes: int, scope: str = "") -> str:
    """The store key of the plan of ``graph`` at ``budget_bytes`` (``-1``: the least peak)
    made with the settings ``scope`` names (strategy, options, time limit, costs)."""
    h = hashlib.sha256(graph_fingerprint(graph).encode())
    h.update(f"|{budget_bytes}|{scope}".encode())
    return KEY_PREFIX + h.hexdigest()[:40]


def plan_once(
    graph: Graph,
    budget_bytes: int,
    solve: Callable[[int], SolveResult],
    *,
    scope: str = "",
    wait_s: float = 600.0,
) -> SolveResult:
    """``solve(budget_bytes)`` on the first rank that asks for this plan; its plan on every
    other rank that asks for it.

    Without a process group of several ranks this is ``solve(budget_bytes)``. Otherwise the
    ranks meet in the process group's key-value store, never in a collective: the first to
    ask claims the key of (``graph``, ``budget_bytes``, ``scope``), solves and publishes the
    plan document (or its error); a rank asking later waits for it, at most ``wait_s``
    seconds, rebuilds the schedule for its own ``graph`` and re-validates it within its own
    budget. A rank that never asks (another input shape there, a step of a shape it
    compiled before) waits for nothing, and a rank whose wait ends without a plan (the
    claiming rank stopped), or whose graph the plan does not fit, solves alone.

    Raises:
        CheckmateError: the claiming rank's error (its type, re-raised on the ranks that
            waited for it), or the claiming rank found no plan.
    """
    store = _store()
    if store is None:
        return solve(budget_bytes)
    rank = torch.distributed.get_rank()
    key = plan_key(graph, budget_bytes, scope)
    if int(store.add(key + "/claim", 1)) == 1:
        return _solve_and_publish(store, key, graph, budget_bytes, solve, rank)
    log.info("another rank plans this graph at these bytes: waiting for its plan (%s)", key)
    try:
        store.wait([key], timedelta(seconds=wait_s))
        kind, payload, by = pickle.loads(store.get(key))
    except Exception as exc:  # the store's timeout, or a message that does not load
        log.warning("no plan came from another rank within %.0f s (%s): planning here", wait_s, exc)
        return solve(budget_bytes)
    if kind == "gone":
        return solve(budget_bytes)
    if kind == "error":
        if isinstance(payload, CheckmateError):
            # the same type on every rank: a fallback taken on an InfeasibleBudgetError (a
            # fraction too low) is taken alike
            payload.add_note(f"rank {by} planned this graph first; this is its error")
            raise payload
        name, text = payload
        raise CheckmateError(f"rank {by} could not plan this graph ({name}): {text}")
    if kind == "none":
        raise CheckmateError(f"rank {by} found no plan for this graph within its budget ({payload})")
    try:
        return _rebuild(graph, payload, budget_bytes, by)
    except CheckmateError as exc:
        log.warning("rank %d's plan does not fit this rank's graph (%s): planning here", by, exc)
        return solve(budget_bytes)


def _solve_and_publish(
    store: Any, key: str, graph: Graph, budget_bytes: int, solve: Callable[[int], SolveResult], rank: int
) -> SolveResult:
    """``solve(budget_bytes)``, its plan (or error) published under ``key``, whatever happens:
    other ranks may be waiting for it."""
    message: tuple[str, Any, int] = ("gone", None, rank)
    try:
        result = solve(budget_bytes)
        if not result.ok or result.schedule is None:
            message = ("none", f"{result.status}{closest_hint(result)}", rank)
        else:
            message = ("plan", plan_to_dict(graph, result), rank)
        return result
    except CheckmateError as exc:
        message = ("error", _portable(exc), rank)
        raise
    finally:
        store.set(key, pickle.dumps(message))


def _portable(exc: CheckmateError) -> CheckmateError | tuple[str, str]:
    """``exc`` if it pickles whole (then other ranks raise its type), else its name and text."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # an error holding something that does not pickle
        return (type(exc).__name__, str(exc))
    return exc


def _rebuild(graph: Graph, payload: dict[str, Any], budget_bytes: int, by: int) -> SolveResult:
    """Rank ``by``'s plan document as this rank's result for ``graph``, re-validated.

    Raises:
        PlanError: rank ``by`` traced another graph.
        ScheduleError: its schedule does not fit ``budget_bytes`` on this graph.
    """
    plan = plan_from_dict(payload, graph)  # PlanError where the graphs differ
    if budget_bytes < 0:  # the budget "min": that rank's least peak
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
        info={**dict(doc.get("info") or {}), "cache": f"rank {by}"},
    )
