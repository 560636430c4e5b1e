"""The ``checkmate`` command line (also ``python -m checkmate``).

Commands: ``solve`` (plan a saved graph, write a plan file), ``show``, ``compare``,
``sweep`` (budgets x strategies, a table and a Pareto plot), ``plot`` (the R and S
matrices and memory over the schedule) and ``trace`` (save a PyTorch model's graph).

Only ``trace`` imports torch; everything else runs on the torch-free ``solvers`` core.

Exit codes: 0 success; 1 no feasible plan (budget proven infeasible, or no schedule found
in the time limit); 2 usage or input error; 3 an internal error (a bug: please report it
with the ``--debug`` output). Errors are one line on stderr; ``--debug`` shows the
traceback instead.
"""

from __future__ import annotations

import csv
import functools
import inspect
import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import numpy as np

from solvers.budget import format_bytes, parse_budget
from solvers.errors import CheckmateError, InfeasibleBudgetError
from solvers.result import SolveProgress, SolveResult, Status

__all__ = ["main", "cli", "EXIT_OK", "EXIT_NO_PLAN", "EXIT_USAGE", "EXIT_BUG"]

EXIT_OK, EXIT_NO_PLAN, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3

F = TypeVar("F", bound=Callable[..., Any])


class _NoPlan(Exception):
    """No feasible plan: reported on one line, exit code 1."""


# ---------------------------------------------------------------- error handling
def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(message, err=True)
    raise SystemExit(code)


def _handled(fn: F) -> F:
    """Turn the project's errors into one line and an exit code (tracebacks with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        debug = bool(kwargs.get("debug")) or bool((ctx.obj or {}).get("debug"))
        try:
            return fn(*args, **kwargs)
        except _NoPlan as exc:
            click.echo(str(exc))
            raise SystemExit(EXIT_NO_PLAN) from None
        except InfeasibleBudgetError as exc:
            if debug:
                raise
            click.echo(f"infeasible: {exc}")
            raise SystemExit(EXIT_NO_PLAN) from None
        except (CheckmateError, OSError) as exc:
            if debug:
                raise
            text = str(exc) if isinstance(exc, CheckmateError) else _os_error(exc)
            _fail(f"error: {text}")
        except KeyboardInterrupt:
            _fail("interrupted", 130)
        except Exception as exc:  # a bug, not a user error: still one line, and how to see more
            if debug:
                raise
            _fail(
                f"internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)",
                EXIT_BUG,
            )

    return wrapper  # type: ignore[return-value]


def _os_error(exc: OSError) -> str:
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def _debug_option(fn: F) -> F:
    return click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")(fn)


def _check_writable(path: Path) -> None:
    """Fail before any work when ``path`` cannot be written."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        _fail(f"error: {path} is a folder; give a file name")
    if not parent.is_dir():
        _fail(f"error: cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        _fail(f"error: cannot write {path}: permission denied")


def _load(path: str) -> Any:
    from solvers.io import load_graph

    return load_graph(path)


def _check_strategy(name: str) -> None:
    from solvers.strategies import get_strategy

    get_strategy(name)  # raises CheckmateError naming the known strategies


# ---------------------------------------------------------------- live progress
class _Progress:
    """Shows solver progress on stderr: a live line in a terminal, sparse lines otherwise."""

    def __init__(self, total_cost: float, quiet: bool) -> None:
        from rich.console import Console

        self.total = total_cost
        self.quiet = quiet
        self.console = Console(file=sys.stderr, highlight=False)
        self.live: Any = None
        self.last = -1e9

    def __enter__(self) -> _Progress:
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


def _accepts_progress(strategy: str) -> bool:
    from solvers.strategies import get_strategy

    params = inspect.signature(get_strategy(strategy)).parameters
    return "progress" in params and params["progress"].kind is not inspect.Parameter.VAR_KEYWORD


# ---------------------------------------------------------------- formatting
def _bytes(n: int | None, ref: int | None = None) -> str:
    if n is None:
        return "-"
    text = f"{format_bytes(n)} ({n:,} B)"
    return text + (f", {n / ref:.1%} of keep-all" if ref else "")


def _num(x: float | None, fmt: str = ".6g") -> str:
    return "-" if x is None else format(x, fmt)


def _summary(doc: dict[str, Any]) -> list[tuple[str, str]]:
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
    rows.append(("budget", _bytes(budget, ref)))
    if cost is not None and total:
        rows.append(("cost", f"{_num(cost)} = {cost / total:.4f}x no recompute ({_num(total)})"))
    else:
        rows.append(("cost", _num(cost)))
    if lb is not None:
        gap = f", gap {cost / lb - 1:.2%}" if cost is not None and lb > 0 else ""
        ratio = f" = {lb / total:.4f}x" if total else ""
        rows.append(("lower bound", f"{_num(lb)}{ratio}{gap}"))
    else:
        rows.append(("lower bound", "-"))
    if peak is not None and budget:
        rows.append(("peak", f"{_bytes(peak)}, {peak / budget:.1%} of budget"))
    if doc.get("recomputes") is not None:
        rows.append(("recomputes", str(doc["recomputes"])))
    rows.append(
        (
            "time",
            f"build {_num(doc.get('build_seconds'), '.2f')} s, solve {_num(doc.get('solve_seconds'), '.2f')} s",
        )
    )
    return rows


_KEY_WIDTH = 12


def _kv(key: str, value: str) -> None:
    click.echo(f"{key.ljust(_KEY_WIDTH)} {value}")


def _echo_rows(rows: Sequence[tuple[str, str]]) -> None:
    for k, v in rows:
        _kv(k, v)


def _result_doc(graph: Any, res: SolveResult) -> dict[str, Any]:
    """A plan-like document for a result (with or without a schedule)."""
    from solvers.plan import plan_to_dict

    if res.schedule is not None:
        return plan_to_dict(graph, res)
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


def _table(title: str | None, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=None, header_style="bold", pad_edge=False)
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    buf = io.StringIO()
    Console(file=buf, width=max(100, 12 * len(header)), highlight=False, no_color=True).print(table)
    click.echo(buf.getvalue().rstrip("\n"))


# ---------------------------------------------------------------- the commands
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="checkmate-remat", prog_name="checkmate")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Plan tensor rematerialization: fit a training step into a memory budget at the
    least extra compute (Checkmate, Jain et al. 2020)."""
    ctx.obj = {"debug": debug}


@cli.command()
@click.argument("graph")
@click.option(
    "--budget", "-b", required=True, help="Bytes (16GB, 12GiB) or a fraction of the keep-all peak (0.8, 80%)."
)
@click.option(
    "--strategy",
    "-s",
    default="auto",
    show_default=True,
    help="A strategy name (see `checkmate strategies`).",
)
@click.option("--time-limit", "-t", type=float, default=None, help="Seconds for searching strategies.")
@click.option("--output", "-o", required=True, help="Plan file to write (JSON).")
@click.option("--quiet", "-q", is_flag=True, help="No live progress.")
@_debug_option
@_handled
def solve(
    graph: str, budget: str, strategy: str, time_limit: float | None, output: str, quiet: bool, debug: bool
) -> None:
    """Plan GRAPH (a saved graph JSON) under --budget and write the plan file."""
    from solvers.api import solve as solve_graph
    from solvers.plan import plan_to_dict, write_plan

    parse_budget(budget)
    _check_strategy(strategy)
    out = Path(output)
    _check_writable(out)
    g = _load(graph)
    _kv("graph", g.summary())
    start = time.perf_counter()
    with _Progress(g.total_cost, quiet) as progress:
        opts: dict[str, Any] = {"progress": progress} if _accepts_progress(strategy) else {}
        res = solve_graph(g, budget, strategy, time_limit=time_limit, **opts)
    wall = time.perf_counter() - start
    doc = _result_doc(g, res)
    _echo_rows([*_summary(doc), ("wall", f"{wall:.2f} s")])
    if not res.ok:
        why = "time limit reached without a schedule" if res.status == Status.NO_SOLUTION else str(res.status)
        raise _NoPlan(f"no plan: {res.strategy} found no schedule within the budget ({why}); nothing written")
    write_plan(out, plan_to_dict(g, res))
    _kv("plan", f"{out} ({len(doc['schedule'])} steps)")


@cli.command()
def strategies() -> None:
    """List the registered strategies."""
    from solvers.strategies import STRATEGIES

    width = max(map(len, STRATEGIES))
    for name, (_, desc) in STRATEGIES.items():
        click.echo(f"{name.ljust(width)}  {desc}")


@cli.command()
@click.argument("plan")
@click.option(
    "--graph",
    "-g",
    "graph_path",
    help="The graph, to check the plan and name ops.",
)
@click.option("--top", type=int, default=10, show_default=True, help="How many recomputed ops to list.")
@_debug_option
@_handled
def show(plan: str, graph_path: str | None, top: int, debug: bool) -> None:
    """Summarise PLAN: figures, the most recomputed ops, and (with --graph) a replay."""
    from solvers.plan import read_plan, read_plan_document
    from solvers.schedule import validate

    g = _load(graph_path) if graph_path else None
    doc = read_plan_document(plan)
    click.echo(
        f"plan        {plan} (format v{doc.get('version')}, checkmate {doc.get('library_version', '?')})"
    )
    if doc.get("graph_name") or doc.get("n_nodes"):
        _kv("graph", f"{doc.get('graph_name') or '?'} ({doc.get('n_nodes', '?')} nodes)")
    _echo_rows(_summary(doc))
    if g is not None:
        p = read_plan(plan, g)
        sim = validate(g, p.schedule, int(doc["budget_bytes"]))
        _kv("replay", f"valid; peak {_bytes(sim.peak)}, cost {_num(sim.cost)}")
        frag = _fragmentation(g, p.schedule)
        if frag:
            _kv("memory", frag)
    rows = _recomputed(doc, g, top)
    if rows:
        _table(f"top {len(rows)} recomputed ops", ["op", "computes", "extra cost"], rows)
    else:
        click.echo("no op is recomputed")


def _recomputed(doc: dict[str, Any], graph: Any, top: int) -> list[list[str]]:
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
    return [[f"{names.get(k, k)}", str(counts[k]), _num(extra[k])] for k in again[:top]]


def _fragmentation(graph: Any, schedule: Any) -> str:
    """The pool's fragmentation beside the peak, when ``solvers.pool`` is available."""
    try:
        from solvers.pool import pool_stats  # type: ignore[import-not-found]
    except ImportError:
        return ""
    try:
        stats = pool_stats(graph, schedule)
    except Exception as exc:  # optional figure: never fail `show` because of it
        return f"pool statistics unavailable ({exc})"
    fields: dict[str, Any]
    if hasattr(stats, "__dataclass_fields__"):
        fields = {k: getattr(stats, k) for k in stats.__dataclass_fields__}
    elif isinstance(stats, dict):
        fields = dict(stats)
    else:
        return str(stats)
    return ", ".join(f"{k} {_fmt_stat(k, v)}" for k, v in fields.items()) or str(stats)


def _fmt_stat(key: str, value: Any) -> str:
    if isinstance(value, (int, np.integer)) and ("byte" in key or "peak" in key or "size" in key):
        return format_bytes(int(value))
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


@cli.command()
@click.argument("plans", nargs=-1, required=True)
@_debug_option
@_handled
def compare(plans: tuple[str, ...], debug: bool) -> None:
    """Compare PLANS side by side."""
    from solvers.plan import read_plan_document

    docs = [read_plan_document(p) for p in plans]
    fields: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("strategy", lambda d: str(d.get("strategy"))),
        ("status", lambda d: str(d.get("status"))),
        ("budget", lambda d: format_bytes(d["budget_bytes"])),
        ("cost", lambda d: _num(d.get("cost"))),
        ("overhead", lambda d: _ratio(d.get("cost"), d.get("total_cost"), "x")),
        ("lower bound", lambda d: _num(d.get("lower_bound"))),
        ("gap", lambda d: _gap(d.get("cost"), d.get("lower_bound"))),
        ("peak", lambda d: "-" if d.get("peak_memory") is None else format_bytes(d["peak_memory"])),
        ("peak/budget", lambda d: _ratio(d.get("peak_memory"), d.get("budget_bytes"), "%")),
        ("recomputes", lambda d: str(d.get("recomputes", "-"))),
        ("steps", lambda d: str(len(d["schedule"]))),
        ("solve s", lambda d: _num(d.get("solve_seconds"), ".2f")),
        ("graph", lambda d: str(d.get("graph_fingerprint", "?"))[:12]),
    ]
    header = ["", *[Path(p).name for p in plans]]
    _table(None, header, [[name, *[f(d) for d in docs]] for name, f in fields])
    if len({d.get("graph_fingerprint") for d in docs}) > 1:
        click.echo("note: the plans were made for different graphs")


def _ratio(a: float | None, b: float | None, unit: str) -> str:
    if a is None or not b:
        return "-"
    return f"{a / b:.4f}x" if unit == "x" else f"{a / b:.1%}"


def _gap(cost: float | None, lb: float | None) -> str:
    return "-" if cost is None or not lb else f"{cost / lb - 1:.2%}"


@cli.command()
@click.argument("graph")
@click.option("--budgets", required=True, help="Comma-separated budgets, e.g. 0.9,0.8,0.7 or 12GiB,10GiB.")
@click.option(
    "--strategies", "strategy_list", default="auto", show_default=True, help="Comma-separated strategy names."
)
@click.option(
    "--time-limit", "-t", type=float, default=None, help="Seconds per solve for searching strategies."
)
@click.option("--output", "-o", help="Write the table as CSV.")
@click.option("--plot", "plot_path", help="Write the Pareto plot (PNG).")
@click.option("--quiet", "-q", is_flag=True, help="No line per solve while running.")
@_debug_option
@_handled
def sweep(
    graph: str,
    budgets: str,
    strategy_list: str,
    time_limit: float | None,
    output: str | None,
    plot_path: str | None,
    quiet: bool,
    debug: bool,
) -> None:
    """Solve GRAPH at every budget with every strategy: a table and a Pareto plot."""
    specs = [b.strip() for b in budgets.split(",") if b.strip()]
    names = [s.strip() for s in strategy_list.split(",") if s.strip()]
    if not specs or not names:
        _fail("error: give at least one budget and one strategy")
    for b in specs:
        parse_budget(b)
    for name in names:
        _check_strategy(name)
    for path in (output, plot_path):
        if path:
            _check_writable(Path(path))
    g = _load(graph)
    _kv("graph", g.summary())
    rows = [_sweep_point(g, name, spec, time_limit, quiet) for name in names for spec in specs]
    table = [
        [
            r["strategy"],
            r["budget"],
            f"{r['budget_fraction']:.3f}",
            r["status"],
            _num(r["overhead"], ".4f"),
            _gap(r["cost"], r["lower_bound"]),
            "-" if r["peak"] is None else format_bytes(r["peak"]),
            f"{r['seconds']:.2f}",
        ]
        for r in rows
    ]
    _table(None, ["strategy", "budget", "fraction", "status", "overhead", "gap", "peak", "seconds"], table)
    if output:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        from solvers.plan import atomic_write_text

        atomic_write_text(Path(output), buf.getvalue())
        _kv("table", output)
    if plot_path:
        from checkmate.plot import pareto_figure

        pareto_figure(rows, plot_path, title=f"{g.name}: overhead against budget")
        _kv("plot", plot_path)


def _sweep_point(g: Any, strategy: str, spec: str, time_limit: float | None, quiet: bool) -> dict[str, Any]:
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
        row.update(status=str(Status.INFEASIBLE), note=str(exc))
    except CheckmateError as exc:
        row.update(status="error", note=str(exc))
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


@cli.command()
@click.argument("plan")
@click.option(
    "--graph",
    "-g",
    "graph_path",
    required=True,
    help="The graph the plan was made for.",
)
@click.option("--output", "-o", required=True, help="PNG to write.")
@_debug_option
@_handled
def plot(plan: str, graph_path: str, output: str, debug: bool) -> None:
    """Draw PLAN's R and S matrices and its memory over the schedule against the budget."""
    from solvers.plan import read_plan

    out = Path(output)
    _check_writable(out)
    g = _load(graph_path)
    p = read_plan(plan, g)
    from checkmate.plot import plan_figure

    doc = p.doc
    title = f"{doc.get('graph_name') or g.name}: {doc.get('strategy')} ({doc.get('status')}), budget {format_bytes(p.budget_bytes)}"
    plan_figure(g, p.schedule, p.budget_bytes, out, title=title)
    _kv("plot", str(out))


@cli.command()
@click.argument("factory")
@click.option(
    "--input-shape",
    "shapes",
    multiple=True,
    help="Shape of one random input, e.g. 8,3,32,32 (repeat for several).",
)
@click.option(
    "--profile",
    "profile",
    default=None,
    help="Device profile (name in profiles/ or a JSON file) for the op costs; default: measure on --device.",
)
@click.option("--device", default="cpu", show_default=True, help="Where to run the model while tracing.")
@click.option("--output", "-o", required=True, help="Graph JSON to write.")
@_debug_option
@_handled
def trace(
    factory: str, shapes: tuple[str, ...], profile: str | None, device: str, output: str, debug: bool
) -> None:
    """Trace MODULE:FACTORY (a function returning a model, or (model, inputs)) into a graph."""
    out = Path(output)
    _check_writable(out)
    dims = [_shape(s) for s in shapes]
    from checkmate.cli_trace import trace_factory

    g = trace_factory(factory, dims, profile, device)
    from solvers.io import save_graph

    save_graph(g, out)
    _kv("graph", g.summary())
    _kv("saved", str(out))


def _shape(text: str) -> tuple[int, ...]:
    import re

    try:
        dims = tuple(int(x) for x in re.split(r"[,x]", text.strip()))
    except ValueError:
        _fail(
            f"error: --input-shape {text!r} must be integers separated by commas, e.g. 8,3,32,32 or 8x3x32x32"
        )
    if not dims or min(dims) <= 0:
        _fail(f"error: --input-shape {text!r} must list positive sizes")
    return dims


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``checkmate`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="checkmate")
