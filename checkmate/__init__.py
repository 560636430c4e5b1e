"""checkmate: optimal tensor rematerialization for PyTorch training.

``model = checkmate.optimize(model, budget)`` traces the joint forward+backward graph,
profiles it, plans which activations to keep and which to recompute (the Checkmate MILP,
Jain et al., MLSys 2020, and other strategies from ``solvers``), and returns a module whose
training step fits the budget with gradients equal to eager PyTorch.
"""

from __future__ import annotations

from typing import Any

from solvers import __version__
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

__all__ = [
    "BudgetError",
    "BudgetWarning",
    "CheckmateError",
    "GraphError",
    "InfeasibleBudgetError",
    "PlanError",
    "ScheduleError",
    "SolverError",
    "SolverWarning",
    "WorkerError",
    "TraceError",
    "UnplannedWarning",
    "__version__",
    "optimize",
    "plans_of",
]

#: torch-dependent names, imported on first use so that ``import checkmate`` (and the
#: CLI's torch-free ``solve``) never imports torch
_LAZY = {
    "optimize": "checkmate.api",
    "plans_of": "checkmate.api",
    "UnplannedWarning": "checkmate.api",
    "BudgetWarning": "checkmate.runtime",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'checkmate' has no attribute {name!r}")
