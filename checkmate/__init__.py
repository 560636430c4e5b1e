"""checkmate: optimal tensor rematerialization for PyTorch training.

``model = checkmate.optimize(model, budget)`` traces the joint forward+backward graph,
profiles it, plans which activations to keep and which to recompute (the Checkmate MILP,
Jain et al., MLSys 2020, and other strategies from ``solvers``), and returns a module whose
training step fits the budget with gradients equal to eager PyTorch.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from solvers import __version__
from solvers.errors import (
    BudgetError,
    CheckmateError,
    GraphError,
    HeldOutputsError,
    InfeasibleBudgetError,
    OptionError,
    PlanError,
    ProfileError,
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
    "HeldOutputsError",
    "InfeasibleBudgetError",
    "OptionError",
    "OverheadWarning",
    "CompilerFallbackWarning",
    "PlanError",
    "ProfileError",
    "ScheduleError",
    "SolverError",
    "SolverWarning",
    "WorkerError",
    "TraceError",
    "UnplannedWarning",
    "__version__",
    "disabled",
    "optimize",
    "plans_of",
]

#: torch-dependent names, imported on first use so that ``import checkmate`` (and the
#: CLI's torch-free ``solve``) never imports torch
_LAZY = {
    "optimize": "checkmate.api",
    "disabled": "checkmate.api",
    "plans_of": "checkmate.api",
    "UnplannedWarning": "checkmate.api",
    "BudgetWarning": "checkmate.planner_common",
    "OverheadWarning": "checkmate.planner_common",
    "CompilerFallbackWarning": "checkmate.backends",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'checkmate' has no attribute {name!r}")


def _log_from_environment() -> None:
    """``CHECKMATE_LOG=info`` (or ``debug``, ``warning``): planning progress on stderr, for a
    first step that plans for seconds; without it the ``checkmate`` logger is the
    application's to configure, as any library's."""
    level = os.environ.get("CHECKMATE_LOG", "").strip().upper()
    if not level:
        return
    logger = logging.getLogger("checkmate")
    if not isinstance(logging.getLevelName(level), int):
        logger.warning(
            "CHECKMATE_LOG=%r is not a logging level (debug, info, warning): ignored", level.lower()
        )
        return
    if not any(getattr(h, "_checkmate", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("checkmate: %(message)s"))
        handler._checkmate = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)


_log_from_environment()
