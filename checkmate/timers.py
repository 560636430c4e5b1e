"""Named stage timers for the pipeline (after tinygrad's ``cpu_profile``).

Each stage of planning one graph runs inside ``with stage("trace", seconds):``; the
seconds add up into the dict given (the graph's :class:`~checkmate.runtime.PlanRecord`
is built from it) and are reported to every observer registered with :func:`observe`,
so that benchmarks time the stages, including those of a plan that fails before its
record exists, without patching the modules that run them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Observer", "stage", "observe"]

#: receives (stage name, seconds) each time a stage ends, nested stages included
Observer = Callable[[str, float], None]

_OBSERVERS: list[Observer] = []


@contextmanager
def stage(name: str, seconds: dict[str, float] | None = None) -> Iterator[None]:
    """Time the block as stage ``name``: add its seconds to ``seconds[name]`` and report
    them to the observers, also when the block raises.

    Example:
        >>> spent: dict[str, float] = {}
        >>> with stage("solve", spent):
        ...     pass
        >>> list(spent)
        ['solve']
    """
    start = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - start
        if seconds is not None:
            seconds[name] = seconds.get(name, 0.0) + dt
        for fn in tuple(_OBSERVERS):
            fn(name, dt)


@contextmanager
def observe(fn: Observer) -> Iterator[None]:
    """Report every stage that ends inside the block to ``fn(name, seconds)``."""
    _OBSERVERS.append(fn)
    try:
        yield
    finally:
        _OBSERVERS.remove(fn)
