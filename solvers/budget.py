"""Memory budgets: bytes (``16GB``, ``12GiB``, ``1000000``), fractions of the
checkpoint-all peak (``0.6``, ``"60%"``), or ``"min"``: the least peak a schedule can reach
within the time limit.

A budget is parsed once, at the front door, into a :class:`Budget`, and that typed value is
what every layer below receives; it is resolved to bytes against a graph's keep-all peak,
and a resolved budget carries that peak (``reference``) so that no layer simulates it again.
Rules for plain numbers: a Python ``int`` is bytes; a Python ``float`` is a fraction; a
unit-less string is a fraction when its value is at most 4 and bytes otherwise. A count of
bytes without a unit, or with ``B``, must be whole (``"4.5"`` is neither a fraction, being
above 4, nor a number of bytes, and is rejected); with a larger unit it is rounded down to
whole bytes (``"1.1 MiB"`` is 1,153,433 bytes). Non-finite values (``"1e400"``) are rejected.
The string ``"min"`` asks for the least peak a schedule reaches within the time limit
(:func:`solvers.strategies.least_peak.least_peak`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TypeAlias

from solvers.errors import BudgetError

__all__ = ["Budget", "BudgetSpec", "parse_budget", "format_bytes", "format_change"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z%]*)\s*$", re.IGNORECASE)
_MAX_FRACTION = 4.0


_LEAST = "min"


@dataclass(frozen=True, slots=True)
class Budget:
    """A parsed budget: exactly one of ``nbytes``, ``fraction`` and ``least`` is set.

    Attributes:
        nbytes: bytes.
        fraction: a fraction of the graph's checkpoint-all (keep-all) peak.
        least: plan at the least peak a schedule can reach within the time limit (the
            string ``"min"``); it has no byte value before planning (:meth:`resolve` raises).
        reference: the keep-all peak of the graph this budget was resolved for, when known
            (see :meth:`for_graph`), so that the layers below do not simulate it again.
        boundary: when set, bytes the plan may hold at its forward/backward boundary
            beside its peak budget (:mod:`solvers.boundary`): a graph of a step split by graph
            breaks leaves room there for the graphs that run between its forward and its
            backward. Not with ``least``.
    """

    nbytes: int | None = None
    fraction: float | None = None
    least: bool = False
    reference: int | None = None
    boundary: int | None = None

    def __post_init__(self) -> None:
        if (self.nbytes is not None) + (self.fraction is not None) + bool(self.least) != 1:
            raise BudgetError(
                f"a Budget needs exactly one of nbytes, fraction and least (got {self.nbytes!r}, "
                f"{self.fraction!r}, {self.least!r}); build it with parse_budget"
            )
        if self.boundary is not None and (self.least or isinstance(self.boundary, bool) or self.boundary < 0):
            raise BudgetError(
                f"a boundary of {self.boundary!r} bytes with budget {self}: it must be bytes >= 0, "
                "beside a byte or fraction budget (the least peak has no boundary to bound)"
            )

    @classmethod
    def least_peak(cls) -> Budget:
        """The budget ``"min"``: the least peak a schedule reaches within the time limit."""
        return cls(least=True)

    def resolve(self, reference: int) -> int:
        """Bytes, given the checkpoint-all peak ``reference`` that fractions refer to.

        Raises:
            BudgetError: the budget is ``"min"``, which has no byte value before planning.
        """
        if self.nbytes is not None:
            return self.nbytes
        if self.fraction is None:
            raise BudgetError(
                "budget 'min' has no byte value before planning: it asks for the least peak a "
                "schedule reaches, which only the planner finds; give bytes or a fraction to "
                "resolve a budget"
            )
        return math.floor(self.fraction * reference)

    def for_graph(self, reference: int, reserve: int = 0) -> Budget:
        """This budget in bytes for a graph whose keep-all peak is ``reference``, less
        ``reserve`` bytes held beside the graph (at least 1 byte), carrying ``reference``
        (and the boundary, less the reserve too).

        Raises:
            BudgetError: the budget is ``"min"`` (see :meth:`resolve`).
        """
        boundary = None if self.boundary is None else max(self.boundary - reserve, 0)
        return Budget(
            nbytes=max(self.resolve(reference) - reserve, 1), reference=reference, boundary=boundary
        )

    def __str__(self) -> str:
        held = (
            ""
            if self.boundary is None
            else f" (holding at most {format_bytes(self.boundary)} at the boundary)"
        )
        if self.nbytes is not None:
            return format_bytes(self.nbytes) + held
        if self.fraction is not None:
            return f"{self.fraction:.0%}" + held
        return _LEAST


#: what the front ends accept as a budget (see :func:`parse_budget`)
BudgetSpec: TypeAlias = Budget | int | float | str


def parse_budget(spec: object) -> Budget:
    """Parse ``spec`` into a :class:`Budget`.

    Args:
        spec: an int (bytes), a float (fraction of the checkpoint-all peak), a string such
            as ``"16GB"``, ``"12GiB"``, ``"60%"``, ``"0.6"``, ``"min"`` (the least peak a
            schedule reaches within the time limit), or a :class:`Budget` (returned as is).

    Raises:
        BudgetError: the spec is not a positive size or fraction.

    Example:
        >>> parse_budget("60%").fraction
        0.6
        >>> parse_budget("2KiB").nbytes
        2048
    """
    if isinstance(spec, Budget):
        return spec
    if isinstance(spec, bool):
        raise BudgetError(f"budget {spec!r} is a bool: give bytes (int) or a fraction (float)")
    if isinstance(spec, int):
        if spec <= 0:
            raise BudgetError(f"budget {spec} bytes must be positive")
        return Budget(nbytes=spec)
    if isinstance(spec, float):
        return _fraction(spec, repr(spec))
    if isinstance(spec, str) and spec.strip().lower() in (_LEAST, "minimum"):
        return Budget(least=True)
    if isinstance(spec, str):
        m = _RE.match(spec)
        if not m:
            raise BudgetError(
                f"budget {spec!r} is not a size or a fraction: write e.g. 16GB, 12GiB, 1500000000, 0.6, 60% or min"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
        if not math.isfinite(value):
            raise BudgetError(f"budget {spec!r} is too large to be a number of bytes or a fraction")
        if unit == "%":
            return _fraction(value / 100.0, spec)
        if unit == "" and value <= _MAX_FRACTION:
            return _fraction(value, spec)
        if unit not in _UNITS:
            raise BudgetError(
                f"budget {spec!r} has an unknown unit {m.group(2)!r}: use B, KB, MB, GB, KiB, MiB, GiB or %"
            )
        if unit in ("", "b") and not value.is_integer():
            why = f"is above {_MAX_FRACTION:g}, so it is bytes, but" if unit == "" else "is bytes but"
            raise BudgetError(
                f"budget {spec!r} {why} not a whole number of them: write a fraction <= "
                f"{_MAX_FRACTION:g} (e.g. 0.6 or 60%) or whole bytes"
            )
        scaled = value * _UNITS[unit]
        if not math.isfinite(scaled):
            raise BudgetError(f"budget {spec!r} is too large to be a number of bytes")
        nbytes = int(scaled)
        if nbytes <= 0:
            raise BudgetError(f"budget {spec!r} must be positive")
        return Budget(nbytes=nbytes)
    raise BudgetError(f"budget {spec!r} of type {type(spec).__name__} is not a size or a fraction")


def _fraction(value: float, text: str) -> Budget:
    if not (0.0 < value <= _MAX_FRACTION) or math.isnan(value):
        raise BudgetError(
            f"budget {text} as a fraction of the checkpoint-all peak must lie in (0, "
            f"{_MAX_FRACTION:g}]; give bytes with a unit (e.g. 16GB) for an absolute budget"
        )
    return Budget(fraction=float(value))


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_change(share: float, digits: int = 1) -> str:
    """A relative change with its sign: ``0.123`` -> ``'+12.3%'``, ``-1e-12`` -> ``'+0.0%'``
    (rounded first: a float error below the last digit printed ``'+-0.0%'``)."""
    return f"{round(share, digits + 2) + 0.0:+.{digits}%}"
