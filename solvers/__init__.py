"""checkmate's torch-free core: graph IR, schedules, the simulator and the strategies.

Nothing here imports torch: a saved graph can be planned on any machine.

Example:
    >>> import solvers
    >>> g = solvers.load_graph("VGG16_b256_224x224.json")  # doctest: +SKIP
    >>> res = solvers.solve(g, 0.9, "ilp", time_limit=60)  # doctest: +SKIP
"""

from __future__ import annotations

__version__ = "0.2.0"

from solvers.api import memory_lower_bound, resolve_budget, solve
from solvers.budget import Budget, format_bytes, parse_budget
from solvers.errors import (
    BudgetError,
    CheckmateError,
    GraphError,
    InfeasibleBudgetError,
    PlanError,
    ScheduleError,
    SolverError,
    SolverWarning,
    TraceError,
    WorkerError,
)
from solvers.graph import Graph, Node
from solvers.io import graph_from_dict, graph_to_dict, load_graph, save_graph
from solvers.plan import Plan, plan_to_dict, read_plan, write_plan
from solvers.result import SolveResult, Status
from solvers.schedule import (
    Schedule,
    SimResult,
    keep_all_peak,
    schedule_from_order,
    schedule_from_rs,
    simulate,
    validate,
)
from solvers.strategies import STRATEGIES, get_strategy, strategy_names

__all__ = [
    "__version__",
    "Budget",
    "BudgetError",
    "CheckmateError",
    "Graph",
    "GraphError",
    "InfeasibleBudgetError",
    "Node",
    "Plan",
    "PlanError",
    "STRATEGIES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "SolveResult",
    "SolverError",
    "SolverWarning",
    "WorkerError",
    "Status",
    "TraceError",
    "format_bytes",
    "get_strategy",
    "graph_from_dict",
    "graph_to_dict",
    "keep_all_peak",
    "load_graph",
    "memory_lower_bound",
    "parse_budget",
    "plan_to_dict",
    "read_plan",
    "resolve_budget",
    "save_graph",
    "schedule_from_order",
    "schedule_from_rs",
    "simulate",
    "solve",
    "strategy_names",
    "validate",
    "write_plan",
]
