"""Formatting for the ``checkmate`` command line: summaries, tables, live progress, sweeps.

Kept apart from the click wiring in :mod:`checkmate.cli`; torch-free. rich is imported
lazily so that ``checkmate --help`` starts fast.
"""

from __future__ import annotations

import inspect
import io
import sys
import time
from collections.abc import Sequence
from typing import Any

import click

from solvers.budget import format_bytes
from solvers.errors import CheckmateError, InfeasibleBudgetError
from solvers.result import SolveProgress, SolveResult, Status

__all__ = [
    "Progress",
    "accepts_progress",
    "echo_rows",
    "fmt_bytes",
    "fragmentation",
    "gap",
    "kv",
    "num",
    "ratio",
    "recomputed_rows",
    "result_doc",
    "summary_rows",
    "sweep_point",
    "table",
]


# ---------------------------------------------------------------- live progress
class Progress:
    """Shows solver progress on stderr: a live line in a terminal, sparse lines otherwise."""

    def __init__(self, total_cost: float, quiet: bool) -> None:
        from rich.console import Console

        self.total = total_cost
        self.quiet = quiet
        self.console = Console(file=sys.stderr, highlight=False)
        self.live: Any = None
        self.last = -1e9

    def __enter__(self) -> Progress:
        if not self.quiet and self.console.is_terminal:
            from rich.live import Live

            self.live = Live("", console=self.console, transient=True, refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def __call__(self, p: SolveProgress) -> None:
        if self.quiet:
            return
        line = self.format(p)
        if self.live is not None:
            from rich.text import Text

            self.live.update(Text(line, no_wrap=True, overflow="ellipsis"))
        elif p.elapsed - self.last >= 1.0:  # a log, not a flood, when not on a terminal
            self.last = p.elapsed
            self.console.print(line, markup=False, soft_wrap=True)

    def format(self, p: SolveProgress) -> str:
        def ratio(x: float | None) -> str:
            return "-" if x is None or not self.total else f"{x / self.total:.4f}x"

        gap = "-" if p.gap is None else f"{p.gap:.2%}"
        return (
            f"{p.strategy}: {p.elapsed:7.1f}s  incumbent {ratio(p.incumbent)}  "
            f"bound {ratio(p.bound)}  gap {gap}  {p.message}"
        )


def accepts_progress(strategy: str) -> bool:
    from solvers.strategies import get_strategy

    params = inspect.signature(get_strategy(strategy)).parameters
    return "progress" in params and params["progress"].kind is not inspect.Parameter.VAR_KEYWORD


# ---------------------------------------------------------------- formatting
def fmt_bytes(n: int | None, ref: int | None = None) -> str:
    if n is None:
        return "-"
    text = f"{format_bytes(n)} ({n:,} B)"
    return text + (f", {n / ref:.1%} of keep-all" if ref else "")


def num(x: float | None, fmt: str = ".6g") -> str:
    return "-" if x is None else format(x, fmt)


def summary_rows(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """Key-value lines describing a plan document (or a result turned into one)."""
    total = doc.get("total_cost")
    cost = doc.get("cost")
    lb = doc.get("lower_bound")
    ref = doc.get("reference_peak")
    budget = doc.get("budget_bytes")
    peak = doc.get("peak_memory")
    rows = [("strategy", str(doc.get("strategy"))), ("status", str(doc.get("status")))]
    if doc.get("info", {}).get("chosen"):
        rows[0] = ("strategy", f"{doc['strategy']} (chose {doc['info']['chosen']})")
    rows.append(("budget", fmt_bytes(budget, ref)))
    if cost is not None and total:
        rows.append(("cost", f"{num(cost)} = {cost / total:.4f}x no recompute ({num(total)})"))
    else:
        rows.append(("cost", num(cost)))
    if lb is not None:
        gap = f", gap {_gap_value(cost, lb):.2%}" if cost is not None and lb > 0 else ""
        ratio = f" = {lb / total:.4f}x" if total else ""
        rows.append(("lower bound", f"{num(lb)}{ratio}{gap}"))
    else:
        rows.append(("lower bound", "-"))
    if peak is not None and budget:
        rows.append(("peak", f"{fmt_bytes(peak)}, {peak / budget:.1%} of budget"))
    if doc.get("recomputes") is not None:
        rows.append(("recomputes", str(doc["recomputes"])))
    rows.append(
        (
            "time",
            f"build {num(doc.get('build_seconds'), '.2f')} s, solve {num(doc.get('solve_seconds'), '.2f')} s",
        )
    )
    return rows


KEY_WIDTH = 12


def kv(key: str, value: str) -> None:
    click.echo(f"{key.ljust(KEY_WIDTH)} {value}")


def echo_rows(rows: Sequence[tuple[str, str]]) -> None:
    for k, v in rows:
        kv(k, v)


def result_doc(graph: Any, res: SolveResult, time_limit: float | None = None) -> dict[str, Any]:
    """A plan-like document for a result (with or without a schedule)."""
    from solvers.plan import plan_to_dict

    if res.schedule is not None:
        # a traced graph names the device profile its costs came from
        return plan_to_dict(graph, res, profile_id=str(graph.meta.get("profile", "")), time_limit=time_limit)
    return {
        "strategy": res.strategy,
        "status": str(res.status),
        "budget_bytes": res.budget,
        "cost": res.cost,
        "lower_bound": res.lower_bound,
        "peak_memory": res.peak,
        "solve_seconds": res.solve_seconds,
        "build_seconds": res.build_seconds,
        "total_cost": graph.total_cost,
        "reference_peak": res.info.get("reference"),
        "info": dict(res.info),
    }


def table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=max(100, 12 * len(header)), highlight=False, no_color=True).print(table)
    click.echo("\n".join(line.rstrip() for line in buf.getvalue().rstrip("\n").splitlines()))


def recomputed_rows(doc: dict[str, Any], graph: Any, top: int) -> list[list[str]]:
    counts: dict[Any, int] = {}
    names: dict[Any, str] = {}
    if isinstance(doc.get("decisions"), list):
        for d in doc["decisions"]:
            counts[d["id"]] = int(d["computes"])
            names[d["id"]] = str(d.get("name", d["id"]))
    else:
        for op, node in doc["schedule"]:
            if op == "compute":
                counts[node] = counts.get(node, 0) + 1
    extra: dict[Any, float | None] = {}
    for k, c in counts.items():
        cost = graph.nodes[graph.index_of(k)].cost if graph is not None else None
        extra[k] = None if cost is None else (c - 1) * cost
    again = [k for k, c in counts.items() if c > 1]
    again.sort(key=lambda k: (-(extra[k] or 0.0), -counts[k]))
    return [[f"{names.get(k, k)}", str(counts[k]), num(extra[k])] for k in again[:top]]


def fragmentation(graph: Any, schedule: Any) -> str:
    """The memory pool's reserved peak and fragmentation beside the live peak.

    Empty when ``solvers.pool`` is not available; never raises (an optional figure).
    """
    try:
        from solvers.pool import pool_stats
    except ImportError:
        return ""
    try:
        st = pool_stats(graph, schedule)
        text = (
            f"{st.policy} pool reserves {format_bytes(st.peak_reserved)} "
            f"(+{st.overhead:.1%} over the live peak {format_bytes(st.peak_allocated)})"
        )
        if st.fragmentation:
            text += f"; fragmentation {format_bytes(st.fragmentation)} at step {st.fragmentation_step}"
        else:
            text += "; no fragmentation"
        return text
    except Exception as exc:  # optional figure: never fail `show` because of it
        return f"pool statistics unavailable ({type(exc).__name__}: {exc})"


def ratio(a: float | None, b: float | None, unit: str) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.4f}x" if unit == "x" else f"{a / b:.1%}"


def gap(cost: float | None, lb: float | None) -> str:
    """``cost / lb - 1`` as a percentage; "-" when unknown."""
    return "-" if cost is None or not lb else f"{_gap_value(cost, lb):.2%}"


def _gap_value(cost: float, lb: float) -> float:
    g = cost / lb - 1.0
    # a solver's bound may exceed its optimum by its tolerance: not a negative gap worth showing
    return 0.0 if -1e-6 < g < 0 else g


def sweep_point(g: Any, strategy: str, spec: str, time_limit: float | None, quiet: bool) -> dict[str, Any]:
    """One (strategy, budget) solve; infeasible budgets and solver failures become rows."""
    from solvers.api import resolve_budget
    from solvers.api import solve as solve_graph

    nbytes, ref = resolve_budget(g, spec)
    row: dict[str, Any] = {
        "strategy": strategy,
        "budget": spec,
        "budget_bytes": nbytes,
        "budget_fraction": nbytes / ref if ref else float("nan"),
        "status": "",
        "cost": None,
        "overhead": None,
        "lower_bound": None,
        "peak": None,
        "seconds": 0.0,
        "note": "",
    }
    start = time.perf_counter()
    try:
        res = solve_graph(g, nbytes, strategy, time_limit=time_limit)
    except InfeasibleBudgetError as exc:
        row.update(status=str(Status.INFEASIBLE), note=exc.one_line())  # a table cell
    except CheckmateError as exc:
        row.update(status="error", note=exc.one_line())
    else:
        row.update(status=str(res.status), lower_bound=res.lower_bound)
        if res.ok and res.cost is not None:
            row.update(
                cost=res.cost, overhead=res.cost / g.total_cost if g.total_cost else None, peak=res.peak
            )
    row["seconds"] = time.perf_counter() - start
    if not quiet:
        over = "-" if row["overhead"] is None else f"{row['overhead']:.4f}x"
        click.echo(f"  {strategy} @ {spec}: {row['status']} {over} ({row['seconds']:.1f} s)", err=True)
    return row
