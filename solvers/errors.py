"""The one error hierarchy of checkmate (shared by ``solvers`` and ``checkmate``).

Every error says what was wrong, where, and what to do. ``assert`` is kept for bugs.
"""

from __future__ import annotations

__all__ = [
    "CheckmateError",
    "GraphError",
    "BudgetError",
    "InfeasibleBudgetError",
    "ScheduleError",
    "SolverError",
    "PlanError",
    "TraceError",
    "OptionError",
    "ProfileError",
]


class CheckmateError(Exception):
    """Base class of every error raised on purpose by checkmate."""


class GraphError(CheckmateError, ValueError):
    """A graph is malformed: a cycle, a dangling edge, a negative size, a duplicate id."""


class BudgetError(CheckmateError, ValueError):
    """A budget could not be understood (e.g. ``"abc"``, a negative number)."""


class InfeasibleBudgetError(CheckmateError):
    """No schedule fits the budget.

    Attributes:
        budget: the budget asked for, in bytes.
        minimum: the smallest budget (bytes) known to admit a schedule, or a lower bound
            on it when ``exact`` is False; None when unknown. Always above ``budget``: a
            strategy may prove a budget infeasible at or above the cheap lower bound it
            reports, and then the bound says only that more than ``budget`` is needed, so
            ``minimum`` becomes ``budget + 1`` (an int a retry can use; not exact).
        reference: the checkpoint-all peak (bytes) that fractions refer to, if known.
    """

    def __init__(
        self,
        budget: int,
        minimum: int | None,
        *,
        reference: int | None = None,
        exact: bool = False,
        detail: str = "",
    ) -> None:
        self.budget = int(budget)
        self.minimum = None if minimum is None else int(minimum)
        beyond = self.minimum is not None and self.minimum <= self.budget
        if beyond:  # proven infeasible at or above the bound given: only "more" is known
            self.minimum, exact = self.budget + 1, False
        self.reference = reference
        self.exact = exact
        msg = f"no schedule fits a budget of {_fmt(self.budget, reference)}"
        if self.minimum is not None and beyond:
            msg += f"; every schedule needs more than that, at least {_fmt(self.minimum, reference)}"
        elif self.minimum is not None:
            word = "the minimum feasible budget is" if exact else "every schedule needs at least"
            msg += f"; {word} {_fmt(self.minimum, reference)}"
        if detail:
            msg += f" ({detail})"
        msg += "; raise the budget"
        super().__init__(msg)


class ScheduleError(CheckmateError):
    """A schedule is invalid: it reads a value that is not resident, frees twice, ..."""


class SolverError(CheckmateError):
    """A solver failed (crashed, returned garbage, or is not installed)."""


class PlanError(CheckmateError):
    """A plan file is unreadable, of an unknown version, or made for another graph."""


class TraceError(CheckmateError):
    """A model could not be traced into a joint forward+backward graph."""


class OptionError(CheckmateError, ValueError):
    """A strategy option is unknown (the message names the valid ones) or has a bad value."""


class ProfileError(CheckmateError, ValueError):
    """A device profile is unknown, unreadable or malformed."""


def _fmt(nbytes: int, reference: int | None) -> str:
    from solvers.budget import format_bytes

    text = f"{format_bytes(nbytes)} ({nbytes:,} bytes)"
    if reference:
        text += f", {nbytes / reference:.1%} of the checkpoint-all peak"
    return text
