"""What every strategy returns: a :class:`SolveResult` around one :class:`Schedule`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from solvers.schedule import Schedule

__all__ = ["Status", "SolveResult", "SolveProgress", "ProgressFn"]


class Status(StrEnum):
    """Outcome of a strategy, mapped from each solver's own codes through one table."""

    OPTIMAL = "optimal"  # proven optimal (within the solver's MIP gap tolerance)
    FEASIBLE = "feasible"  # a schedule within the budget, optimality not proven
    INFEASIBLE = "infeasible"  # proven: no schedule fits the budget
    NO_SOLUTION = "no_solution"  # nothing found (time limit, heuristic failed); not proven

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class SolveResult:
    """One strategy's answer for one graph and budget.

    Attributes:
        strategy: the registered name of the strategy.
        status: see :class:`Status`.
        budget: the budget in bytes the schedule was planned for.
        schedule: the schedule, or None when there is none.
        cost: the schedule's simulated cost (None without a schedule).
        peak: the schedule's simulated peak memory in bytes (None without a schedule).
        lower_bound: a proven lower bound on the cost of any schedule within the budget
            (e.g. the LP relaxation's objective), or None.
        build_seconds: time spent building the model (formulation), if any.
        solve_seconds: time spent solving.
        info: strategy-specific figures (MIP gap, variables, thresholds tried, ...).
    """

    strategy: str
    status: Status
    budget: int
    schedule: Schedule | None = None
    cost: float | None = None
    peak: int | None = None
    lower_bound: float | None = None
    build_seconds: float = 0.0
    solve_seconds: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when there is a schedule within the budget."""
        return self.schedule is not None and self.status in (Status.OPTIMAL, Status.FEASIBLE)

    @property
    def gap(self) -> float | None:
        """cost / lower_bound - 1, when both are known."""
        if self.cost is None or not self.lower_bound:
            return None
        return self.cost / self.lower_bound - 1.0


@dataclass(frozen=True, slots=True)
class SolveProgress:
    """A progress report from a searching strategy (passed as ``progress=callback``).

    Attributes:
        strategy: which strategy reports.
        elapsed: seconds since the solve started.
        incumbent: cost of the best schedule found so far, or None.
        bound: best proven lower bound so far, or None.
        message: a short phase description ("building", "root LP", "rounding 0.4", ...).
    """

    strategy: str
    elapsed: float
    incumbent: float | None = None
    bound: float | None = None
    message: str = ""

    @property
    def gap(self) -> float | None:
        """incumbent / bound - 1 when both are known."""
        if self.incumbent is None or not self.bound:
            return None
        return self.incumbent / self.bound - 1.0


ProgressFn = Callable[[SolveProgress], None]
