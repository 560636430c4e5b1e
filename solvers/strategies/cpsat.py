"""The ``cpsat`` strategy: the Moccasin-style CP model of :mod:`.cpsat_model` on OR-Tools
CP-SAT, run in a worker process when this process cannot load OR-Tools safely.

Why a worker: the wheels of highspy (1.15) and OR-Tools (9.15) each bundle a different
HiGHS build under the same shared-library name (``libhighs.so.1``). The dynamic loader keeps
the first one a process loads, so whichever of the two packages is imported second fails
with an undefined symbol. Unless OR-Tools is already loaded here, CP-SAT runs in a worker
started as ``python -c "...; main()"`` (about a second; see :mod:`solvers._subprocess` for
why not multiprocessing), which keeps highspy usable in this process for the MILP
and LP rounding. The worker reads (graph, budget, deadline, options) pickled on stdin and
writes the pickled result on stdout; it is killed a little after the time limit.
"""

from __future__ import annotations

import importlib.util
import pickle
import subprocess
import sys
import time
from typing import Any

from solvers import scaling
from solvers._subprocess import claim_stdout, worker_command
from solvers.errors import SolverError, WorkerError
from solvers.graph import Graph
from solvers.result import SolveResult
from solvers.schedule import Schedule

if importlib.util.find_spec("ortools") is None:  # pragma: no cover - needs a venv without it
    raise ImportError(
        "the cpsat strategy needs OR-Tools: pip install 'checkmate-remat[cpsat]' (or ortools)",
        name="ortools",
    )

__all__ = ["cpsat", "main", "WORKER_OPTIONS"]

_MODEL = "solvers.strategies.cpsat_model"
_WORKER = "from solvers.strategies.cpsat import main; main()"
#: the keyword-only parameters of :func:`~solvers.strategies.cpsat_model.solve_in_process`,
#: named here for option checking (:data:`solvers.strategies.FORWARDED`): importing that
#: module loads OR-Tools, after which CP-SAT would run in this process instead of its worker
WORKER_OPTIONS: tuple[str, ...] = (
    "time_limit",
    "max_computes",
    "backward_once",
    "hint",
    "workers",
    "seed",
    "progress",
)
#: seconds the worker gets beyond the time limit (start-up, model build, answer) before it is killed
KILL_GRACE = 30.0
#: computes per node of the model (the default of :mod:`.cpsat_model`'s ``max_computes``)
#: unless a hint needs more
MAX_COMPUTES = 3
#: the most computes per node a model is widened to so that a hint fits (:func:`_fit_to_hint`):
#: the precedence Booleans grow with its square
HINT_MAX_COMPUTES = 6


def _in_worker(graph: Graph, budget: int, deadline: float | None, options: dict[str, Any]) -> SolveResult:
    """Solve in a fresh ``python -c`` worker; SolverError if it fails or outlives its grace."""
    argv, env = worker_command(_WORKER)
    payload = pickle.dumps((graph, budget, deadline, options), protocol=pickle.HIGHEST_PROTOCOL)
    timeout = None if deadline is None else max(deadline - time.time(), 0.0) + KILL_GRACE
    try:
        proc = subprocess.run(argv, input=payload, capture_output=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SolverError(
            f"the CP-SAT worker outlived its time limit by {KILL_GRACE:.0f} s on {graph.name!r} and was killed"
        ) from None
    try:
        kind, value = pickle.loads(proc.stdout)
    except Exception:
        tail = proc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [
            f"exit code {proc.returncode}"
        ]
        raise WorkerError(f"the CP-SAT worker process died while solving {graph.name!r}: {tail[0]}") from None
    if kind == "error":
        if str(value).startswith(("ImportError", "ModuleNotFoundError")):
            raise WorkerError(f"the CP-SAT worker process could not import its solver: {value}")
        raise SolverError(f"CP-SAT failed on {graph.name!r}: {value}")
    assert isinstance(value, SolveResult)
    return value


def main() -> None:
    """The worker: read (graph, budget, deadline, options) on stdin, write the result on stdout."""
    out = claim_stdout()
    graph, budget, deadline, options = pickle.load(sys.stdin.buffer)
    try:
        from solvers.strategies.cpsat_model import solve_in_process

        # the worker's start-up and the transfer count against the time limit
        limit = None if deadline is None else max(0.5, deadline - time.time())
        msg: tuple[str, Any] = ("result", solve_in_process(graph, budget, time_limit=limit, **options))
    except BaseException as exc:  # the parent turns it into SolverError
        msg = ("error", f"{type(exc).__name__}: {exc}")
    pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
    out.close()


def _heuristic_hint(graph: Graph, budget: int) -> Schedule | None:
    """A starting schedule from the DTR heuristic (milliseconds), or None if it has none:
    large models reach a first solution much sooner from a hint."""
    try:
        from solvers.strategies import get_strategy

        res = get_strategy("dtr")(graph, budget)
    except Exception:  # a missing or failing heuristic only costs the hint
        return None
    return res.schedule if res.ok else None


def _fit_to_hint(graph: Graph, hint: Schedule, options: dict[str, Any]) -> None:
    """Widen the model's restrictions, where the caller left them at their defaults, so that
    ``hint`` fits them: as many computes per node as the hint makes (up to
    :data:`HINT_MAX_COMPUTES`), and backward nodes recomputable where it recomputes one.

    A hint the model cannot express is dropped, and CP-SAT starts from nothing: at budgets
    near the least peak, where the heuristics' plans recompute a node 4-5 times, it then
    found no schedule at all (a traced ResNet-18, 408 ops, at 0.6 of its keep-all peak:
    nothing in 90 s; widened to the hint, 1.374x -> 1.149x the step's compute in 20 s).
    """
    counts = hint.compute_counts(graph.n)
    need = int(counts.max(initial=1))
    if "max_computes" not in options and MAX_COMPUTES < need <= HINT_MAX_COMPUTES:
        options["max_computes"] = need
    if "backward_once" not in options and bool((counts[graph.backward_mask] > 1).any()):
        options["backward_once"] = False


def cpsat(
    graph: Graph,
    budget: int,
    *,
    time_limit: float | None = None,
    isolate: bool | None = None,
    auto_hint: bool = True,
    **options: Any,
) -> SolveResult:
    """Plan ``graph`` under ``budget`` bytes with the CP-SAT retention-interval model.

    Args:
        graph: the graph.
        budget: memory budget in bytes.
        time_limit: seconds for the search; the best incumbent is returned.
        isolate: run in the worker process (default: unless OR-Tools is already loaded
            here; see the module docstring).
        auto_hint: without a ``hint``, start from the DTR heuristic's schedule when it fits.
        options: ``max_computes`` (3, or up to 6 to fit a hint that computes a node more
            often: :func:`_fit_to_hint`), ``backward_once`` (True, unless a hint recomputes a
            backward node), ``hint`` (a Schedule),
            ``workers`` (2), ``seed`` (0), ``progress`` (in-process runs only); see
            :func:`solvers.strategies.cpsat_model.solve_in_process`.

    Returns:
        A :class:`SolveResult`; ``optimal`` means optimal within ``info["restrictions"]``.

    Raises:
        GraphError: the positive costs span more than CP-SAT resolves (see solvers.scaling).
        SolverError: CP-SAT rejected the model, or the worker process died.
    """
    scaling.check_cost_span(graph, "CP-SAT")  # here, not only in the worker: a GraphError
    if options.get("hint") is None and auto_hint:
        options["hint"] = _heuristic_hint(graph, budget)
    if options.get("hint") is not None:
        _fit_to_hint(graph, options["hint"], options)
    if isolate is None:
        isolate = _MODEL not in sys.modules or "ortools.sat.python.cp_model" not in sys.modules
    if not isolate:
        from solvers.strategies.cpsat_model import solve_in_process

        return solve_in_process(graph, budget, time_limit=time_limit, **options)
    options.pop("progress", None)  # a callback cannot cross the process boundary
    deadline = None if time_limit is None else time.time() + time_limit  # wall clock: shared
    return _in_worker(graph, budget, deadline, options)
