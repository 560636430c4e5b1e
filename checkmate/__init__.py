"""checkmate: optimal tensor rematerialization for PyTorch training.

``model = checkmate.optimize(model, budget)`` traces the joint forward+backward graph,
profiles it, plans which activations to keep and which to recompute (the Checkmate MILP,
Jain et al., MLSys 2020, and other strategies from ``solvers``), and returns a module whose
training step fits the budget with gradients equal to eager PyTorch.
"""

from __future__ import annotations

from solvers import __version__
from solvers.errors import (
    BudgetError,
    CheckmateError,
    GraphError,
    InfeasibleBudgetError,
    PlanError,
    ScheduleError,
    SolverError,
    TraceError,
)

__all__ = [
    "BudgetError",
    "CheckmateError",
    "GraphError",
    "InfeasibleBudgetError",
    "PlanError",
    "ScheduleError",
    "SolverError",
    "TraceError",
    "__version__",
]
