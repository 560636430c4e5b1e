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
import io
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from checkmate import cli_report as report
from solvers.budget import format_bytes, parse_budget
from solvers.errors import CheckmateError, InfeasibleBudgetError
from solvers.result import Status

__all__ = ["main", "cli", "EXIT_OK", "EXIT_NO_PLAN", "EXIT_USAGE", "EXIT_BUG"]

EXIT_OK, EXIT_NO_PLAN, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3

F = TypeVar("F", bound=Callable[..., Any])


class _NoPlan(Exception):
    """No feasible plan: reported on one line, exit code 1."""


# ---------------------------------------------------------------- error handling
def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    click.echo(" ".join(message.split()), err=True)  # one line, whatever the message holds
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


def _require_plot_extra() -> None:
    """Fail before any work when matplotlib (the ``[plot]`` extra) is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        _fail("error: plotting needs matplotlib, which is not installed: pip install 'checkmate-remat[plot]'")


def _load(path: str) -> Any:
    from solvers.io import load_graph

    return load_graph(path)


def _check_strategy(name: str) -> None:
    from solvers.strategies import get_strategy

    get_strategy(name)  # raises CheckmateError naming the known strategies


def _strategy_options(strategy: str, pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("bandwidth=1e8", "heuristic=eq")`` -> options, checked against the strategy's options.

    Values are read as JSON when they parse (numbers, true/false, null), else as strings.
    """
    import json

    from solvers.strategies import COMMON_OPTIONS, strategy_options

    known = [k for k in strategy_options(strategy) if k not in COMMON_OPTIONS]
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            _fail(f"error: --option {pair!r} must look like KEY=VALUE")
        if key in ("time_limit", "progress"):
            _fail(f"error: --option {key} is set by the command itself; use its own flag")
        if key not in known:
            _fail(
                f"error: strategy {strategy!r} has no option {key!r}; its options: {', '.join(known) or 'none'}"
            )
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


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
@click.option(
    "--option",
    "-O",
    "option_pairs",
    multiple=True,
    metavar="KEY=VALUE",
    help="A strategy option, e.g. -O heuristic=local (dtr) or -O bandwidth=1e9 (poet); repeatable.",
)
@click.option("--quiet", "-q", is_flag=True, help="No live progress.")
@_debug_option
@_handled
def solve(
    graph: str,
    budget: str,
    strategy: str,
    time_limit: float | None,
    output: str,
    option_pairs: tuple[str, ...],
    quiet: bool,
    debug: bool,
) -> None:
    """Plan GRAPH (a saved graph JSON) under --budget and write the plan file."""
    from solvers.api import closest_hint
    from solvers.api import solve as solve_graph
    from solvers.plan import write_plan

    parse_budget(budget)
    _check_strategy(strategy)
    strategy_opts = _strategy_options(strategy, option_pairs)
    out = Path(output)
    _check_writable(out)
    g = _load(graph)
    report.kv("graph", g.summary())
    start = time.perf_counter()
    with report.Progress(g.total_cost, quiet) as progress:
        opts: dict[str, Any] = {"progress": progress} if report.accepts_progress(strategy) else {}
        res = solve_graph(g, budget, strategy, time_limit=time_limit, **strategy_opts, **opts)
    wall = time.perf_counter() - start
    doc = report.result_doc(g, res, time_limit)
    report.echo_rows([*report.summary_rows(doc), ("wall", f"{wall:.2f} s")])
    if not res.ok:
        why = str(res.status)
        if res.status == Status.NO_SOLUTION:
            why = str(res.info.get("message") or "time limit reached without a schedule")
        raise _NoPlan(
            f"no plan: {res.strategy} found no schedule within the budget ({why}){closest_hint(res)}; "
            "nothing written"
        )
    write_plan(out, doc)
    report.kv("plan", f"{out} ({len(doc['schedule'])} steps)")


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
    """Summarise PLAN: figures, the most recomputed ops, and (with --graph) a replay and
    the graph's repeated blocks (layers)."""
    from solvers.plan import read_plan, read_plan_document
    from solvers.schedule import validate

    g = _load(graph_path) if graph_path else None
    doc = read_plan_document(plan, g)
    report.kv("plan", f"{plan} (format v{doc.get('version')}, checkmate {doc.get('library_version', '?')})")
    if doc.get("graph_name") or doc.get("n_nodes"):
        report.kv("graph", f"{doc.get('graph_name') or '?'} ({doc.get('n_nodes', '?')} nodes)")
    report.echo_rows(report.summary_rows(doc))
    if g is not None:
        p = read_plan(plan, g)
        sim = validate(g, p.schedule, int(doc["budget_bytes"]))
        report.kv("replay", f"valid; peak {report.fmt_bytes(sim.peak)}, cost {report.num(sim.cost)}")
        frag = report.fragmentation(g, p.schedule)
        if frag:
            report.kv("memory", frag)
        from solvers.repeats import find_repeats

        report.kv("repeats", find_repeats(g, cost_rtol=None).describe())
    rows = report.recomputed_rows(doc, g, top)
    if rows:
        report.table(f"top {len(rows)} recomputed ops", ["op", "computes", "extra cost"], rows)
    else:
        click.echo("no op is recomputed")


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
        ("cost", lambda d: report.num(d.get("cost"))),
        ("overhead", lambda d: report.ratio(d.get("cost"), d.get("total_cost"), "x")),
        ("lower bound", lambda d: report.num(d.get("lower_bound"))),
        ("gap", lambda d: report.gap(d.get("cost"), d.get("lower_bound"))),
        ("peak", lambda d: "-" if d.get("peak_memory") is None else format_bytes(d["peak_memory"])),
        ("peak/budget", lambda d: report.ratio(d.get("peak_memory"), d.get("budget_bytes"), "%")),
        ("recomputes", lambda d: str(d.get("recomputes", "-"))),
        ("steps", lambda d: str(len(d["schedule"]))),
        ("solve s", lambda d: report.num(d.get("solve_seconds"), ".2f")),
        ("graph", lambda d: str(d.get("graph_fingerprint", "?"))[:12]),
    ]
    header = ["", *[Path(p).name for p in plans]]
    report.table(None, header, [[name, *[f(d) for d in docs]] for name, f in fields])
    if len({d.get("graph_fingerprint") for d in docs}) > 1:
        click.echo("note: the plans were made for different graphs")


@cli.command()
@click.argument("graph")
@click.option("--budgets", required=True, help="Comma-separated budgets, e.g. 0.9,0.8,0.7 or 12GiB,10GiB.")
@click.option(
    "--strategies",
    "-s",
    "strategy_list",
    default="auto",
    show_default=True,
    help="Comma-separated strategy names.",
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
    """Solve GRAPH at every budget with every strategy: a table and a Pareto plot.

    Budgets without a schedule are rows too (infeasible, no_solution, error). Exits 1 when
    no budget had a schedule at all.
    """
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
    if plot_path:
        _require_plot_extra()
    g = _load(graph)
    report.kv("graph", g.summary())
    rows = [report.sweep_point(g, name, spec, time_limit, quiet) for name in names for spec in specs]
    table = [
        [
            r["strategy"],
            r["budget"],
            f"{r['budget_fraction']:.3f}",
            r["status"],
            report.num(r["overhead"], ".4f"),
            report.gap(r["cost"], r["lower_bound"]),
            "-" if r["peak"] is None else format_bytes(r["peak"]),
            f"{r['seconds']:.2f}",
        ]
        for r in rows
    ]
    report.table(
        None, ["strategy", "budget", "fraction", "status", "overhead", "gap", "peak", "seconds"], table
    )
    if output:
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        from solvers.plan import atomic_write_text

        atomic_write_text(Path(output), buf.getvalue())
        report.kv("table", output)
    if plot_path:
        from checkmate.plot import pareto_figure

        pareto_figure(rows, plot_path, title=f"{g.name}: overhead against budget")
        report.kv("plot", plot_path)
    if all(r["overhead"] is None for r in rows):
        raise _NoPlan("no plan: no strategy found a schedule at any of these budgets")


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
    _require_plot_extra()
    g = _load(graph_path)
    p = read_plan(plan, g)
    from checkmate.plot import plan_figure

    doc = p.doc
    title = f"{doc.get('graph_name') or g.name}: {doc.get('strategy')} ({doc.get('status')}), budget {format_bytes(p.budget_bytes)}"
    plan_figure(g, p.schedule, p.budget_bytes, out, title=title)
    report.kv("plot", str(out))


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
    """Trace MODULE:FACTORY (a function returning a model, or (model, inputs)) into a graph.

    The graph is captured as checkmate.optimize captures it (torch.compile, AOTAutograd) and
    its op costs measured on --device or estimated from --profile. A model with graph breaks
    gives one file per graph: GRAPH.0.json, GRAPH.1.json, ...
    """
    out = Path(output)
    _check_writable(out)
    dims = [_shape(s) for s in shapes]
    from checkmate.cli_trace import trace_factory

    graphs = trace_factory(factory, dims, profile, device)
    from solvers.io import save_graph

    paths = [out] if len(graphs) == 1 else [out.with_suffix(f".{k}{out.suffix}") for k in range(len(graphs))]
    if len(graphs) > 1:
        click.echo(f"note: the model has {len(graphs)} graphs (graph breaks); one file each", err=True)
    for g, path in zip(graphs, paths):
        save_graph(g, path)
        report.kv("graph", g.summary())
        report.kv("saved", str(path))


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
