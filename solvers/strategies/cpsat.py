"""The ``cpsat`` strategy: the Moccasin-style CP model of :mod:`.cpsat_model` on OR-Tools
CP-SAT, run in a worker process when this process cannot load OR-Tools safely.

Why a worker: the wheels of highspy (1.15) and OR-Tools (9.15) each bundle a different
HiGHS build under the same shared-library name (``libhighs.so.1``). The dynamic loader keeps
the first one a process loads, so whichever of the two packages is imported second fails
with an undefined symbol. Unless OR-Tools is already loaded here, CP-SAT runs in one
long-lived spawned worker (started on first use, about a second), which keeps highspy
usable in this process for the MILP and LP rounding.
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from solvers.errors import SolverError
from solvers.graph import Graph
from solvers.result import SolveResult
from solvers.schedule import Schedule

if importlib.util.find_spec("ortools") is None:  # pragma: no cover - needs a venv without it
    raise ImportError(
        "the cpsat strategy needs OR-Tools: pip install 'checkmate-remat[cpsat]' (or ortools)",
        name="ortools",
    )

__all__ = ["solve_cpsat"]

_MODEL = "solvers.strategies.cpsat_model"
_pool: ProcessPoolExecutor | None = None


def _worker() -> ProcessPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=mp.get_context("spawn"),
            initializer=_watch_parent,
            initargs=(os.getpid(),),
        )
        atexit.register(_pool.shutdown, wait=False, cancel_futures=True)
    return _pool


def _watch_parent(parent: int) -> None:
    """In the worker: exit when the parent is gone. A parent that ends with ``os._exit``
    (a forked multiprocessing child does) skips atexit and would leave the worker idle."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="cpsat-parent-watch").start()


def _in_worker(graph: Graph, budget: int, deadline: float | None, options: dict[str, Any]) -> SolveResult:
    from solvers.strategies.cpsat_model import solve_in_process

    # the worker's start-up (first call) and the transfer count against the time limit
    limit = None if deadline is None else max(0.5, deadline - time.time())
    return solve_in_process(graph, budget, time_limit=limit, **options)


def _heuristic_hint(graph: Graph, budget: int) -> Schedule | None:
    """A starting schedule from the DTR heuristic (milliseconds), or None if it has none:
    large models reach a first solution much sooner from a hint."""
    try:
        from solvers.strategies import get_strategy

        res = get_strategy("dtr")(graph, budget)
    except Exception:  # a missing or failing heuristic only costs the hint
        return None
    return res.schedule if res.ok else None


def solve_cpsat(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    isolate: bool | None = None,
    **options: Any,
) -> SolveResult:
    """Plan ``graph`` under ``budget`` bytes with the CP-SAT retention-interval model.

    Args:
        graph: the graph.
        budget: memory budget in bytes.
        time_limit: seconds for the search; the best incumbent is returned.
        isolate: run in the worker process (default: unless OR-Tools is already loaded
            here; see the module docstring).
        options: ``max_computes`` (3), ``backward_once`` (True), ``hint`` (a Schedule;
            by default, with ``auto_hint`` True, the DTR heuristic's schedule when it fits),
            ``workers`` (2), ``seed`` (0), ``progress`` (in-process runs only); see
            :func:`solvers.strategies.cpsat_model.solve_in_process`.

    Returns:
        A :class:`SolveResult`; ``optimal`` means optimal within ``info["restrictions"]``.

    Raises:
        SolverError: CP-SAT rejected the model, or the worker process died.
    """
    if options.get("hint") is None and options.pop("auto_hint", True):
        options["hint"] = _heuristic_hint(graph, budget)
    options.pop("auto_hint", None)
    if isolate is None:
        isolate = _MODEL not in sys.modules or "ortools.sat.python.cp_model" not in sys.modules
    if not isolate:
        from solvers.strategies.cpsat_model import solve_in_process

        return solve_in_process(graph, budget, time_limit=time_limit, **options)
    options.pop("progress", None)  # a callback cannot cross the process boundary
    global _pool
    deadline = None if time_limit is None else time.time() + time_limit  # wall clock: shared
    try:
        return _worker().submit(_in_worker, graph, budget, deadline, options).result()
    except BrokenProcessPool as exc:
        _pool = None
        raise SolverError(f"the CP-SAT worker process died while solving {graph.name!r}: {exc}") from None
