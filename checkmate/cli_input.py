"""The door of the ``checkmate`` command line: input checks and error reporting.

Each command checks its arguments with these helpers before doing any work (an unknown
strategy or option, an output that cannot be written, a missing extra, a bad shape), and
:func:`handled` turns the project's errors into one line and an exit code:

- 0 (:data:`EXIT_OK`) success; 1 (:data:`EXIT_NO_PLAN`) no feasible plan (:class:`NoPlan`,
  or a budget proven infeasible); 2 (:data:`EXIT_USAGE`) usage or input error; 3
  (:data:`EXIT_BUG`) an internal error (a bug). ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from solvers.errors import CheckmateError, InfeasibleBudgetError

__all__ = [
    "EXIT_OK",
    "EXIT_NO_PLAN",
    "EXIT_USAGE",
    "EXIT_BUG",
    "NoPlan",
    "fail",
    "handled",
    "debug_option",
    "check_writable",
    "require_plot_extra",
    "load_graph",
    "check_strategy",
    "strategy_options",
    "parse_shape",
]

EXIT_OK, EXIT_NO_PLAN, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3

F = TypeVar("F", bound=Callable[..., Any])


class NoPlan(Exception):
    """No feasible plan: reported on one line, exit code 1."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(" ".join(message.split()), err=True)  # one line, whatever the message holds
    raise SystemExit(code)


def handled(fn: F) -> F:
    """Turn the project's errors into one line and an exit code (tracebacks with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(kwargs.get("debug")) or bool((ctx.obj or {}).get("debug"))
        try:
            return fn(*args, **kwargs)
        except NoPlan as exc:
            click.echo(str(exc))
            raise SystemExit(EXIT_NO_PLAN) from None
        except InfeasibleBudgetError as exc:
            if debug:
                raise
            # one line: the message, then what the layers below added (a line each in str(exc))
            click.echo("infeasible: " + exc.one_line())
            raise SystemExit(EXIT_NO_PLAN) from None
        except (CheckmateError, OSError) as exc:
            if debug:
                raise
            text = str(exc) if isinstance(exc, CheckmateError) else _os_error(exc)
            fail(f"error: {text}")
        except KeyboardInterrupt:
            fail("interrupted", 130)
        except Exception as exc:  # a bug, not a user error: still one line, and how to see more
            if debug:
                raise
            fail(
                f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
                EXIT_BUG,
            )

    return wrapper  # type: ignore[return-value]


def _os_error(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def debug_option(fn: F) -> F:
    return click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")(fn)


def check_writable(path: Path) -> None:
    """Fail before any work when ``path`` cannot be written."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        fail(f"error: {path} is a folder; give a file name")
    if not parent.is_dir():
        fail(f"error: cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"error: cannot write {path}: permission denied")


def require_plot_extra() -> None:
    """Fail before any work when matplotlib (the ``[plot]`` extra) is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        fail("error: plotting needs matplotlib, which is not installed: pip install 'checkmate-remat[plot]'")


def load_graph(path: str) -> Any:
    from solvers.io import load_graph as load

    return load(path)


def check_strategy(name: str) -> None:
    from solvers.strategies import get_strategy

    get_strategy(name)  # raises CheckmateError naming the known strategies


def strategy_options(strategy: str, pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("bandwidth=1e8", "heuristic=eq")`` -> options, checked against the strategy's options.

    Values are read as JSON when they parse (numbers, true/false, null), else as strings.
    """
    import json

    from solvers.strategies import COMMON_OPTIONS
    from solvers.strategies import strategy_options as declared

    known = [k for k in declared(strategy) if k not in COMMON_OPTIONS]
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            fail(f"error: --option {pair!r} must look like KEY=VALUE")
        if key in ("time_limit", "progress"):
            fail(f"error: --option {key} is set by the command itself; use its own flag")
        if key not in known:
            fail(
                f"error: strategy {strategy!r} has no option {key!r}; its options: {', '.join(known) or 'none'}"
            )
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def parse_shape(text: str) -> tuple[int, ...]:
    import re

    try:
        dims = tuple(int(x) for x in re.split(r"[,x]", text.strip()))
    except ValueError:
        fail(
            f"error: --input-shape {text!r} must be integers separated by commas, e.g. 8,3,32,32 or 8x3x32x32"
        )
    if not dims or min(dims) <= 0:
        fail(f"error: --input-shape {text!r} must list positive sizes")
    return dims
