"""The ``checkmate`` command line (also ``python -m checkmate``).

Commands: ``solve`` (plan a saved graph, write a plan file), ``show``, ``compare``,
``sweep`` (budgets x strategies, a table and a Pareto plot), ``plot`` (the R and S
matrices and memory over the schedule) and ``trace`` (save a PyTorch model's graph).

Only ``trace`` imports torch; everything else runs on the torch-free ``solvers`` core.

Exit codes: 0 success; 1 no feasible plan (budget proven infeasible, or no schedule found
in the time limit); 2 usage or input error; 3 an internal error (a bug: please report it
with the ``--debug`` output). Errors are one line on stderr; ``--debug`` shows the
traceback instead. The input checks and the error handling are in
:mod:`checkmate.cli_input`, the tables and live progress in :mod:`checkmate.cli_report`.
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from checkmate import cli_report as report
from checkmate.cli_input import (
    EXIT_BUG,
    EXIT_NO_PLAN,
    EXIT_OK,
    EXIT_USAGE,
    NoPlan,
    check_strategy,
    check_writable,
    debug_option,
    fail,
    handled,
    load_graph,
    parse_shape,
    require_plot_extra,
    strategy_options,
)
from solvers.budget import format_bytes, parse_budget
from solvers.errors import BudgetError
from solvers.result import Status

__all__ = ["main", "cli", "EXIT_OK", "EXIT_NO_PLAN", "EXIT_USAGE", "EXIT_BUG"]


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
@click.option(
    "--boundary",
    default=None,
    help="Also hold at most this much at the forward/backward boundary (bytes, or a fraction of the "
    "keep-all peak): room for what runs between the forward and the backward, such as the other graphs "
    "of a step split by graph breaks.",
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
@debug_option
@handled
def solve(
    graph: str,
    budget: str,
    boundary: str | None,
    strategy: str,
    time_limit: float | None,
    output: str,
    option_pairs: tuple[str, ...],
    quiet: bool,
    debug: bool,
) -> None:
    """Plan GRAPH (a saved graph JSON) under --budget and write the plan file."""
    from dataclasses import replace

    from solvers.api import closest_hint
    from solvers.api import solve as solve_graph
    from solvers.boundary import boundary_hold
    from solvers.plan import write_plan
    from solvers.schedule import keep_all_peak

    asked = parse_budget(budget)
    try:
        held = None if boundary is None else parse_budget(boundary)
    except BudgetError as exc:
        raise BudgetError(f"--boundary: {exc}") from None
    if held is not None and (held.least or asked.least):
        raise BudgetError(
            f"--boundary {boundary} with --budget {budget}: the boundary takes bytes or a fraction of the "
            "keep-all peak, beside a byte or fraction budget ('min' has no boundary to bound)"
        )
    check_strategy(strategy)
    strategy_opts = strategy_options(strategy, option_pairs)
    out = Path(output)
    check_writable(out)
    g = load_graph(graph)
    report.kv("graph", g.summary())
    if held is not None:
        ref = keep_all_peak(g)
        asked = replace(asked, reference=ref, boundary=held.resolve(ref))
    start = time.perf_counter()
    with report.Progress(g.total_cost, quiet) as progress:
        opts: dict[str, Any] = {"progress": progress} if report.accepts_progress(strategy) else {}
        res = solve_graph(g, asked, strategy, time_limit=time_limit, **strategy_opts, **opts)
    wall = time.perf_counter() - start
    doc = report.result_doc(g, res, time_limit)
    rows = report.summary_rows(doc)
    if asked.boundary is not None and res.schedule is not None:
        hold = boundary_hold(g, res.schedule)
        rows.append(
            ("boundary", f"holds {report.fmt_bytes(hold)} of the {format_bytes(asked.boundary)} asked")
        )
    report.echo_rows([*rows, ("wall", f"{wall:.2f} s")])
    if not res.ok:
        why = str(res.status)
        if res.status == Status.NO_SOLUTION:
            spent = time_limit is not None and res.solve_seconds >= 0.9 * time_limit
            default = "time limit reached without a schedule" if spent else "no strategy tried found one"
            why = str(res.info.get("message") or default)
        raise NoPlan(
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
@debug_option
@handled
def show(plan: str, graph_path: str | None, top: int, debug: bool) -> None:
    """Summarise PLAN: figures, the most recomputed ops, and (with --graph) a replay and
    the graph's repeated blocks (layers)."""
    from solvers.plan import read_plan, read_plan_document
    from solvers.schedule import validate

    g = load_graph(graph_path) if graph_path else None
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
@debug_option
@handled
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
@debug_option
@handled
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
        fail("error: give at least one budget and one strategy")
    for b in specs:
        parse_budget(b)
    for name in names:
        check_strategy(name)
    for path in (output, plot_path):
        if path:
            check_writable(Path(path))
    if plot_path:
        require_plot_extra()
    g = load_graph(graph)
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
        raise NoPlan("no plan: no strategy found a schedule at any of these budgets")


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
@debug_option
@handled
def plot(plan: str, graph_path: str, output: str, debug: bool) -> None:
    """Draw PLAN's R and S matrices and its memory over the schedule against the budget."""
    from solvers.plan import read_plan

    out = Path(output)
    check_writable(out)
    require_plot_extra()
    g = load_graph(graph_path)
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
@click.option(
    "--fake",
    is_flag=True,
    help="Trace on fake tensors (no storage: a model larger than this machine's memory traces); "
    "needs --profile.",
)
@click.option("--output", "-o", required=True, help="Graph JSON to write.")
@debug_option
@handled
def trace(
    factory: str,
    shapes: tuple[str, ...],
    profile: str | None,
    device: str,
    fake: bool,
    output: str,
    debug: bool,
) -> None:
    """Trace MODULE:FACTORY (a function returning a model, or (model, inputs)) into a graph.

    The graph is captured as checkmate.optimize captures it (torch.compile, AOTAutograd) and
    its op costs measured on --device or estimated from --profile. A model with graph breaks
    gives one file per graph: GRAPH.0.json, GRAPH.1.json, ...

    With --fake the factory builds the model on fake tensors (shapes and dtypes, no data), so
    a model too large for this machine traces; the graph, its memory and its profile costs
    are those of the real trace. Example: checkmate trace models.py:llama7b --fake --profile h100 -o g.json
    """
    out = Path(output)
    check_writable(out)
    dims = [parse_shape(s) for s in shapes]
    from checkmate.cli_trace import trace_factory

    graphs = trace_factory(factory, dims, profile, device, fake=fake)
    from solvers.io import save_graph

    paths = [out] if len(graphs) == 1 else [out.with_suffix(f".{k}{out.suffix}") for k in range(len(graphs))]
    if len(graphs) > 1:
        click.echo(f"note: the model has {len(graphs)} graphs (graph breaks); one file each", err=True)
    for g, path in zip(graphs, paths):
        save_graph(g, path)
        report.kv("graph", g.summary())
        report.kv("saved", str(path))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``checkmate`` console script."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="checkmate")
