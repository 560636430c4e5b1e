"""Plan cache (placeholder: passes through to the planner; the cache proper is being built)."""

from __future__ import annotations

from typing import Any

from solvers import Graph, SolveResult, solve

__all__ = ["cached_solve"]


def cached_solve(
    graph: Graph,
    budget: object,
    strategy: str = "auto",
    *,
    time_limit: float | None = None,
    options: dict[str, Any] | None = None,
    profile_id: str = "",
    plan_path: str | None = None,
) -> SolveResult:
    """Solve ``graph`` under ``budget``, reusing a cached plan when one matches.

    Args:
        graph: the (profiled) graph to plan.
        budget: bytes or fraction (see ``solvers.parse_budget``).
        strategy: strategy name.
        time_limit: seconds for searching strategies.
        options: strategy options (part of the cache key).
        profile_id: identifies the device profile the costs came from (part of the key).
        plan_path: pin one plan file instead of the cache directory.
    """
    return solve(graph, budget, strategy, time_limit=time_limit, **(options or {}))
