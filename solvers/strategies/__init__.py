"""The registry of strategies: name -> "module:function", imported on first use.

Every strategy has the signature ``fn(graph, budget_bytes, *, time_limit=None, <options>)
-> SolveResult`` and returns a :class:`~solvers.schedule.Schedule` that
:func:`solvers.schedule.validate` accepts. A strategy's options are the keyword-only
parameters of its entry point (plus those it forwards, :data:`FORWARDED`):
:func:`get_strategy` returns the function wrapped so that an unknown option raises
:class:`~solvers.errors.OptionError` naming the valid ones, and the common keywords
(:data:`COMMON_OPTIONS`) reach only the strategies that take them. Lazy imports keep
optional dependencies (OR-Tools for CP-SAT) optional.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from solvers.errors import CheckmateError, OptionError
from solvers.result import SolveResult

__all__ = [
    "STRATEGIES",
    "COMMON_OPTIONS",
    "check_options",
    "get_strategy",
    "strategy_names",
    "strategy_options",
    "StrategyFn",
]

StrategyFn = Callable[..., SolveResult]

#: name -> (target, one-line description)
STRATEGIES: dict[str, tuple[str, str]] = {
    "auto": (
        "solvers.strategies.auto:auto",
        "best heuristic, then LP rounding and the MILP warm-started from it; cheapest valid schedule wins",
    ),
    "ilp": ("solvers.strategies.ilp:ilp", "Checkmate MILP (Jain et al. 2020) solved by HiGHS"),
    "lp-rounding": (
        "solvers.strategies.lp_rounding:lp_rounding",
        "LP relaxation + two-phase rounding (Jain et al. 2020)",
    ),
    "checkpoint-all": ("solvers.strategies.baselines:checkpoint_all", "keep every output, never recompute"),
    "checkpoint-last-node": (
        "solvers.strategies.baselines:checkpoint_last_node",
        "Jain et al. 2020 baseline: stage t keeps only node t-1's output and recomputes the rest",
    ),
    "chen-sqrtn": (
        "solvers.strategies.baselines:chen_sqrtn",
        "Chen et al. 2016: sqrt(n) evenly spaced checkpoints",
    ),
    "chen-greedy": (
        "solvers.strategies.baselines:chen_greedy",
        "Chen et al. 2016: greedy segments under a memory threshold",
    ),
    "peak-greedy": (
        "solvers.strategies.greedy:peak_greedy",
        "drop the checkpoints live at the simulated peak, least recompute cost per byte first; then repair",
    ),
    "mincut": (
        "solvers.strategies.mincut:mincut",
        "minimum cuts pricing kept bytes against recompute cost (PyTorch's partitioner's choice), rate swept",
    ),
    "gap-cover": (
        "solvers.strategies.gapcover:gap_cover",
        "covering MIP over read-to-read gaps: drop a value between two reads, recompute it from resident inputs",
    ),
    "griewank": (
        "solvers.strategies.baselines:griewank",
        "Griewank & Walther 2000: binomial checkpointing (revolve) for chains",
    ),
    "dtr": (
        "solvers.strategies.dtr:dtr",
        "DTR (Kirisame et al. 2021): online greedy eviction, h_eq by default (option heuristic=dtr|eq|local|lru|size)",
    ),
    "dtr-full": ("solvers.strategies.dtr:dtr_full", "DTR with h_DTR (exact evicted neighbourhood)"),
    "dtr-eq": ("solvers.strategies.dtr:dtr_eq", "DTR with h_eq (union-find evicted neighbourhood)"),
    "dtr-local": ("solvers.strategies.dtr:dtr_local", "DTR with h_local = cost / (size x staleness)"),
    "dtr-lru": ("solvers.strategies.dtr:dtr_lru", "DTR evicting the least recently used value"),
    "dtr-size": ("solvers.strategies.dtr:dtr_size", "DTR evicting the largest value"),
    "coop": (
        "solvers.strategies.coop:coop",
        "Coop (Zhang et al. 2023): DTR evicting the cheapest contiguous window of an address-ordered pool",
    ),
    "poet": (
        "solvers.strategies.poet:poet",
        "POET (Patil et al. 2022): the MILP with paging to host memory (options bandwidth, latency, profile)",
    ),
    "cpsat": (
        "solvers.strategies.cpsat:cpsat",
        "Moccasin (Bartan et al. 2023): retention intervals, cumulative memory, OR-Tools CP-SAT",
    ),
}


#: keywords any strategy may be given (``auto`` and the front ends pass them to every
#: strategy); a strategy whose entry point lacks one never sees it
COMMON_OPTIONS: tuple[str, ...] = ("time_limit", "progress")

#: strategies whose entry point passes more options on to another function: name -> target
#: (a function, whose keyword-only parameters count, or a tuple of names: cpsat names its
#: worker's options so that checking them does not import OR-Tools here)
FORWARDED: dict[str, str] = {"cpsat": "solvers.strategies.cpsat:WORKER_OPTIONS"}


def strategy_names() -> list[str]:
    """The registered strategy names."""
    return list(STRATEGIES)


def _load(name: str, target: str) -> Any:
    module_name, func_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CheckmateError(
            f"strategy {name!r} needs a package that is not installed ({exc.name}); "
            f"install it (e.g. pip install {exc.name}) or choose another strategy"
        ) from None
    return getattr(module, func_name)


def _keyword_only(fn: Any) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]


def strategy_options(name: str) -> tuple[str, ...]:
    """The option names strategy ``name`` accepts (keyword-only parameters of its entry
    point and of the function it forwards to), the common ones first.

    Raises:
        CheckmateError: unknown name, or its optional dependency is missing.
    """
    _check_name(name)
    names = _keyword_only(_load(name, STRATEGIES[name][0]))
    if name in FORWARDED:
        target = _load(name, FORWARDED[name])
        names += list(target) if isinstance(target, tuple) else _keyword_only(target)
    own = [k for k in dict.fromkeys(names) if k not in COMMON_OPTIONS]
    return (*COMMON_OPTIONS, *own)


def _check_name(name: str) -> None:
    if name not in STRATEGIES:
        raise CheckmateError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}")


def check_options(name: str, options: Iterable[str] = ()) -> None:
    """Check, before any work, that strategy ``name`` exists and takes every option named
    in ``options`` (what :func:`get_strategy`'s function would reject when called).

    Raises:
        CheckmateError: unknown name (the message lists the known ones), or its optional
            dependency is missing.
        OptionError: an option the strategy does not take (the message lists its options).
    """
    _check_name(name)
    _reject_unknown(name, _load(name, STRATEGIES[name][0]), options)


def _reject_unknown(name: str, fn: Any, options: Iterable[str]) -> None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return  # a user's own strategy taking **kwargs receives every option
    valid = strategy_options(name)
    unknown = [k for k in options if k not in valid]
    if unknown:
        raise OptionError(f"strategy {name!r} has no option {unknown[0]!r}; its options: {', '.join(valid)}")


def get_strategy(name: str) -> StrategyFn:
    """The strategy function registered as ``name``, checking its options.

    The returned function takes the entry point's arguments; an option it does not know
    raises :class:`OptionError` naming the valid ones (:func:`strategy_options`), and a
    common keyword (:data:`COMMON_OPTIONS`) the entry point lacks is dropped. An entry point
    that takes ``**kwargs`` (a user's own registered strategy) receives every option.

    Raises:
        CheckmateError: unknown name (the message lists the known ones), or its optional
            dependency is missing.
    """
    _check_name(name)
    fn: Any = _load(name, STRATEGIES[name][0])
    params = inspect.signature(fn).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    @functools.wraps(fn)
    def checked(*args: Any, **options: Any) -> SolveResult:
        _reject_unknown(name, fn, options)
        passed = options if takes_all else {k: v for k, v in options.items() if k in params}
        result: SolveResult = fn(*args, **passed)
        return result

    return checked
