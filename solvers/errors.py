"""The one error hierarchy of checkmate (shared by ``solvers`` and ``checkmate``).

Every error says what was wrong, where, and what to do. ``assert`` is kept for bugs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "CheckmateError",
    "GraphError",
    "BudgetError",
    "InfeasibleBudgetError",
    "HeldOutputsError",
    "ScheduleError",
    "SolverError",
    "WorkerError",
    "SolverWarning",
    "PlanError",
    "TraceError",
    "OptionError",
    "ProfileError",
]


class CheckmateError(Exception):
    """Base class of every error raised on purpose by checkmate.

    A note added by a layer the error passes through (:meth:`add_note`: what else the step
    held, a reserve taken off the budget) is part of the message: ``str(error)`` ends with
    one line per note. Python's own notes print only in a traceback, so a loop that logs
    ``str(error)`` lost the why.
    """

    def add_note(self, note: str, /) -> None:
        """Appends ``note`` to the message (a line of its own), in place of ``__notes__``; a
        note already there is not added again (an error raised again at a later call passes
        through the same layers)."""
        if not isinstance(note, str):
            raise TypeError(f"a note must be a str, not {type(note).__name__}")
        if note not in self.notes:
            self._notes = (*self.notes, note)

    def revise_notes(self, revise: Callable[[str], str], /) -> None:
        """Replaces each note by ``revise(note)`` (a later layer's figure superseding an
        earlier one's: one budget to pass, not two)."""
        self._notes = tuple(revise(n) for n in self.notes)

    @property
    def notes(self) -> tuple[str, ...]:
        """The notes added to the message, in order."""
        return self.__dict__.get("_notes", ())

    def __str__(self) -> str:
        return "\n".join((super().__str__(), *self.notes))

    def one_line(self) -> str:
        """The message and its notes on one line (a CLI's output, a table cell, a log line)."""
        return " ".join(str(self).splitlines())


class GraphError(CheckmateError, ValueError):
    """A graph is malformed: a cycle, a dangling edge, a negative size, a duplicate id."""


class BudgetError(CheckmateError, ValueError):
    """A budget could not be understood (e.g. ``"abc"``, a negative number)."""


class InfeasibleBudgetError(CheckmateError):
    """No schedule was found within the budget; the error says which budget has one.

    Attributes:
        budget: the budget asked for, in bytes.
        lower_bound: bytes every schedule needs, proven (the largest single-op working set,
            or one more than a budget a solver proved infeasible); None when unknown. When
            it is above ``budget`` the budget is proven infeasible; otherwise no schedule
            was found within the time limit, and one may exist.
        minimum: the simulated peak of a schedule actually found (bytes): planning at
            ``minimum`` succeeds on the first try (``optimize(model, exc.minimum)``); None
            when no schedule was searched. ``lower_bound <= minimum``.
        reference: the checkpoint-all peak (bytes) that fractions refer to, if known.
        exact: ``minimum`` is the least budget any schedule needs (the bound meets it).
        tradeoffs: ``(peak bytes, extra compute)`` of schedules the least-peak search found,
            by increasing peak and decreasing extra compute (0.25: the plan computes 25%
            more than the graph without recomputation), the first at ``minimum``: what a
            schedule found at each budget above it costs (a plan solved at that budget searches
            for a cheaper one). Empty when none was searched. The message names the lowest
            budget found within a few levels of extra compute (:data:`TRADEOFF_LEVELS`).
    """

    def __init__(
        self,
        budget: int,
        minimum: int | None = None,
        *,
        lower_bound: int | None = None,
        reference: int | None = None,
        exact: bool = False,
        detail: str = "",
        tradeoffs: Sequence[tuple[int, float]] = (),
    ) -> None:
        self.budget = int(budget)
        self.tradeoffs = tuple((int(p), float(c)) for p, c in tradeoffs)
        self.minimum = None if minimum is None else int(minimum)
        self.lower_bound = None if lower_bound is None else int(lower_bound)
        if self.minimum is not None and self.lower_bound is not None:
            self.lower_bound = min(self.lower_bound, self.minimum)
        self.reference = reference
        self._detail = detail
        self.exact = exact or (
            self.minimum is not None and self.lower_bound is not None and self.lower_bound >= self.minimum
        )
        proven = self.lower_bound is not None and self.lower_bound > self.budget
        head = "no schedule fits" if proven else "no schedule was found within"
        msg = f"{head} a budget of {_fmt(self.budget, reference)}"
        if detail:
            msg += f" ({detail})"
        if self.minimum is not None and self.exact:
            msg += f"; the least budget any schedule needs is {_fmt(self.minimum, reference)}"
            msg += _tradeoff_clause(self.tradeoffs, self.minimum, reference)
        else:
            # a bound of one byte over the budget says only that the budget was proven
            # infeasible ("no schedule fits"): printed, it read as the budget itself
            if proven and self.lower_bound is not None and self.lower_bound > self.budget + 1:
                msg += f"; every schedule needs at least {_fmt(self.lower_bound, reference)}"
            if self.minimum is not None:
                # "so that budget has a plan" read as the budget asked having one
                msg += f"; the least peak found is {_fmt(self.minimum, reference)}, a budget that has a plan"
                msg += _tradeoff_clause(self.tradeoffs, self.minimum, reference)
        if self.minimum is not None and self.minimum <= self.budget:
            # the strategy asked for missed a schedule that the least-peak search found
            msg += "; that schedule fits this budget: plan with strategy='auto', which uses it"
        elif self.exact or self.minimum is None:
            msg += "; raise the budget (budget='min' plans at the least peak)"
        else:
            # found in the time a failed plan leaves: budget='min' searches longer (a token-wise
            # MLP's error said 64.4% of its keep-all peak, where budget='min' planned at 57%)
            msg += (
                "; raise the budget, or pass budget='min', which searches longer for the least peak and can "
                "find less than this"
            )
        super().__init__(msg)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickles (to another process or rank) with its fields, not just its message."""
        kwargs = {
            "lower_bound": self.lower_bound,
            "reference": self.reference,
            "exact": self.exact,
            "detail": self._detail,
            "tradeoffs": self.tradeoffs,
        }
        return (_infeasible, (self.budget, self.minimum, kwargs), self.__dict__)

    @property
    def proven(self) -> bool:
        """Whether the budget is proven infeasible (below :attr:`lower_bound`)."""
        return self.lower_bound is not None and self.lower_bound > self.budget


def _infeasible(budget: int, minimum: int | None, kwargs: dict[str, Any]) -> InfeasibleBudgetError:
    return InfeasibleBudgetError(budget, minimum, **kwargs)


class HeldOutputsError(CheckmateError):
    """A backward found the loop holding outputs (a language model's logits beside its loss)
    that its plan drops when the backward starts, as the loop's first step dropped them,
    where holding them could exceed the budget. Raised before that backward runs; the next
    call plans the step holding them."""


class ScheduleError(CheckmateError):
    """A schedule is invalid: it reads a value that is not resident, frees twice, ..."""


class SolverError(CheckmateError):
    """A solver failed (crashed, returned garbage, or is not installed)."""


class WorkerError(SolverError):
    """A solver's worker process could not do its work: it did not start, died, or could not
    import its solver. ``auto`` then plans with its other strategies, with a
    :class:`SolverWarning`: the plan may be worse than the one asked for."""


class SolverWarning(UserWarning):
    """A solver could not run, so the plan was chosen without it."""


class PlanError(CheckmateError):
    """A plan file is unreadable, of an unknown version, or made for another graph."""


class TraceError(CheckmateError):
    """A model could not be traced into a joint forward+backward graph."""


class OptionError(CheckmateError, ValueError):
    """A strategy option is unknown (the message names the valid ones) or has a bad value."""


class ProfileError(CheckmateError, ValueError):
    """A device profile is unknown, unreadable or malformed."""


#: the extra-compute levels the message of :class:`InfeasibleBudgetError` names the lowest
#: budget within, where the least-peak search found one above the least peak
TRADEOFF_LEVELS = (1.0, 0.3, 0.1)


def _tradeoff_clause(tradeoffs: Sequence[tuple[int, float]], minimum: int, reference: int | None) -> str:
    """The extra compute of the schedule found at the least peak, and the lowest budget found
    within each of :data:`TRADEOFF_LEVELS` of extra compute below keep-all: at its least peak
    a graph is often planned at several times its compute, and a little more memory costs a
    fraction of that. Each figure is what a schedule the search found costs; a plan solved at
    that budget searches for a cheaper one (a small transformer: +34% found at 29.6% of its
    keep-all peak, +16.9% planned there). Empty where the search found nothing to compare."""
    from solvers.budget import format_bytes

    at_min = next((max(c, 0.0) for p, c in reversed(tradeoffs) if p <= minimum), None)
    above = [(p, max(c, 0.0)) for p, c in tradeoffs if p > minimum and (reference is None or p < reference)]
    picks: list[tuple[int, float]] = []
    for level in TRADEOFF_LEVELS:
        if at_min is not None and at_min <= level:  # the least peak's schedule is this cheap already
            continue
        pick = next(((p, c) for p, c in above if c <= level), None)
        if pick is not None and pick not in picks:
            picks.append(pick)
    text = "" if at_min is None else f" (its schedule: {at_min:+.0%} compute)"
    shown = [format_bytes(minimum)]
    parts = []
    for p, c in picks:
        # a few bytes more can cut the compute several times over (a TinyGPT: 4.5 KiB above
        # its least peak, +50% where the least peak took +261%): such a budget in bytes
        shown.append(format_bytes(p) if format_bytes(p) not in shown else f"{p:,} bytes")
        parts.append(f"{shown[-1]}{f' ({p / reference:.1%})' if reference else ''} at {c:+.0%}")
    if parts:
        text += "; schedules found above it cost less: " + ", ".join(parts)
    return text


def _fmt(nbytes: int, reference: int | None) -> str:
    from solvers.budget import format_bytes

    text = f"{format_bytes(nbytes)} ({nbytes:,} bytes)"
    if reference:
        text += f", {nbytes / reference:.1%} of the checkpoint-all peak"
    return text
