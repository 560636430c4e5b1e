"""``make bench``: every strategy on the public graphs (and traced models) at fixed budgets.

For each graph and budget (a fraction of the keep-all peak) every registered strategy runs
through :func:`solvers.api.solve` (which validates its schedule with the simulator) in a
child process with a wall-clock guard, so a crash, a hang or an exception becomes a row with
status ``error`` and the message, never the end of the run. Searching strategies get the
cheapest schedule found so far at the same instance as a warm start (``hint``), the way the
``auto`` strategy chains them.

Columns: compute overhead = cost / no-recompute cost; cost / LB = cost / the best lower
bound any strategy proved at that instance (LP relaxation, MILP bound; the no-recompute
cost at least); peak / budget; build and solve seconds as the strategy reports them.

With the traced models (not ``--quick`` / ``--no-traced``), ``python -m benchmarks.e2e``
also runs in a subprocess: ``checkmate.optimize`` end to end on each traced model (trace +
profile + solve + codegen against issue 5's 120 s, one measured step); it writes
``e2e.csv`` / ``e2e.md`` and its rows join the targets section.

Outputs: ``benchmarks/results/<name>.csv`` and ``benchmarks/results/README_tables.md``
(the tables the README pastes), plus a targets section (issue 5's targets, met or missed
with the measured figure).

Usage::

    python -m benchmarks.run                  # everything (hours: up to 60 s per search)
    python -m benchmarks.run --quick          # a subset in under 5 minutes
    python -m benchmarks.run --only VGG16 --strategies cpsat,ilp --budgets 0.9,0.8
    python -m benchmarks.run --resume         # after an interrupt: only the graphs not yet in bench.csv
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import tables
from benchmarks.csvio import read_rows, write_rows

REPO = Path(__file__).resolve().parents[1]
GRAPHS_DIR = REPO / "benchmarks" / "graphs"
RESULTS_DIR = REPO / "benchmarks" / "results"

BUDGETS = (0.9, 0.8, 0.7, 0.6, 0.5)
#: in run order: fast heuristics first, so the searches can start from their best schedule
STRATEGIES = (
    "checkpoint-all",
    "chen-sqrtn",
    "chen-greedy",
    "peak-greedy",
    "gap-cover",
    "dtr",
    "coop",
    "lp-rounding",
    "ilp",
    "cpsat",
)
SEARCHING = {"ilp", "lp-rounding", "cpsat", "gap-cover", "auto"}  # get the time limit
CHECKMATE_GRAPHS = (
    "VGG16_b256_224x224",
    "VGG19_b256_224x224",
    "vgg_unet_b32_416x608",
    "fcn_8_vgg_b32_416x608",
    "segnet_b32_416x608",
    "MobileNet_b512_224x224",
    "ResNet50_b256_224x224",
)
QUICK_GRAPHS = ("VGG16_b256_224x224", "VGG19_b256_224x224", "vgg_unet_b32_416x608")
QUICK_BUDGETS = (0.9, 0.7, 0.5)
QUICK_TIME_LIMIT = 8.0
TIME_LIMIT = 60.0
#: issue 5: random_layered_n1000 at 0.8 gets 300 s
SPECIAL_LIMITS = {("random_layered_n1000", 0.8): 300.0}
TRACE_TIMEOUT = 900
#: seconds for ``python -m benchmarks.e2e`` (both models, one fresh process each)
E2E_TIMEOUT = 2400
GUARD = 2.0  # a child gets GUARD * time_limit + 30 s of wall clock before it is killed


@dataclass
class Row:
    """One (graph, budget, strategy) measurement."""

    graph: str
    n: int
    budget_frac: float
    budget_bytes: int
    strategy: str
    status: str
    cost: float | None = None
    overhead: float | None = None
    lower_bound: float | None = None
    best_lb: float | None = None
    cost_over_lb: float | None = None
    peak: int | None = None
    peak_over_budget: float | None = None
    build_s: float | None = None
    solve_s: float | None = None
    wall_s: float | None = None
    time_limit: float | None = None
    note: str = ""
    steps: tuple[tuple[str, int], ...] | None = field(default=None, repr=False)


def _child(
    graph_path: str,
    budget: int,
    strategy: str,
    time_limit: float | None,
    hint: tuple[tuple[str, int], ...] | None,
    conn: Any,
) -> None:
    """Run one strategy in a child process; send back a dict (never raise)."""
    out: dict[str, Any]
    try:
        from solvers.api import solve
        from solvers.io import load_graph
        from solvers.schedule import Schedule

        graph = load_graph(graph_path)
        options: dict[str, Any] = {}
        if hint is not None and strategy == "cpsat":
            options["hint"] = Schedule(hint)
        t0 = time.perf_counter()
        res = solve(graph, budget, strategy, time_limit=time_limit, raise_infeasible=False, **options)
        wall = time.perf_counter() - t0
        note = ""
        if "min_budget" in res.info:
            note = f"min budget >= {int(res.info['min_budget']):,} B"
        if res.info.get("restrictions"):
            note = (note + "; " if note else "") + "within: " + ", ".join(res.info["restrictions"])
        out = {
            "status": str(res.status),
            "cost": res.cost,
            "lower_bound": res.lower_bound,
            "peak": res.peak,
            "build_s": res.build_seconds,
            "solve_s": res.solve_seconds,
            "wall_s": wall,
            "note": note,
            "steps": res.schedule.steps if res.schedule is not None and res.ok else None,
        }
    except BaseException as exc:  # a strategy's failure is a row, not the end of the run
        tb = traceback.format_exc(limit=3).strip().splitlines()
        out = {"status": "error", "note": f"{type(exc).__name__}: {exc}"[:300], "trace": tb[-3:]}
    conn.send(out)
    conn.close()


def run_one(
    graph_path: Path,
    budget: int,
    strategy: str,
    time_limit: float | None,
    hint: tuple[tuple[str, int], ...] | None,
) -> dict[str, Any]:
    """One strategy on one instance, in a forked child guarded by a wall-clock limit."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(str(graph_path), budget, strategy, time_limit, hint, child))
    t0 = time.perf_counter()
    proc.start()
    child.close()
    guard = GUARD * (time_limit or 60.0) + 30.0
    out: dict[str, Any] | None = None
    if parent.poll(guard):
        try:
            out = parent.recv()
        except EOFError:
            out = None
    proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join()
    if out is None:
        why = (
            f"killed after {guard:.0f} s"
            if time.perf_counter() - t0 >= guard
            else f"exit code {proc.exitcode}"
        )
        out = {"status": "error", "note": f"child process died ({why})"}
    return out


def available_strategies(wanted: Sequence[str]) -> tuple[list[str], list[str]]:
    """(usable, notes): strategies registered and importable, and why others are skipped."""
    from solvers.errors import CheckmateError
    from solvers.strategies import STRATEGIES as REGISTRY
    from solvers.strategies import get_strategy

    usable, notes = [], []
    for name in wanted:
        if name not in REGISTRY:
            notes.append(f"{name}: not registered, skipped")
            continue
        try:
            get_strategy(name)
        except (CheckmateError, ImportError, AttributeError):
            notes.append(f"{name}: registered but its module is not importable here, skipped")
            continue
        usable.append(name)
    return usable, notes


def bench_graph(
    path: Path, budgets: Sequence[float], strategies: Sequence[str], time_limit: float, log: Any
) -> list[Row]:
    """Every strategy at every budget on one graph file."""
    from solvers.api import resolve_budget
    from solvers.io import load_graph

    graph = load_graph(path)
    stem = path.stem
    rows: list[Row] = []
    for frac in budgets:
        nbytes, _ = resolve_budget(graph, float(frac))
        limit = SPECIAL_LIMITS.get((stem, frac), time_limit)
        inst: list[Row] = []
        best: tuple[float, tuple[tuple[str, int], ...]] | None = None
        for strat in strategies:
            tl = limit if strat in SEARCHING else None
            out = run_one(path, nbytes, strat, tl, best[1] if best else None)
            row = Row(
                stem, graph.n, frac, nbytes, strat, out["status"], time_limit=tl, note=out.get("note", "")
            )
            for key in ("cost", "lower_bound", "peak", "build_s", "solve_s", "wall_s", "steps"):
                setattr(row, key, out.get(key))
            if row.cost is not None:
                row.overhead = row.cost / graph.total_cost if graph.total_cost else None
            if row.peak is not None:
                row.peak_over_budget = row.peak / nbytes
            if row.steps is not None and row.cost is not None and (best is None or row.cost < best[0]):
                best = (row.cost, row.steps)
            inst.append(row)
            print(
                f"  {stem} @ {frac:.2f}  {strat:<15} {row.status:<12} "
                f"{'' if row.overhead is None else f'{row.overhead:.4f}x':<10} "
                f"{(row.wall_s or 0):6.1f} s  {row.note[:80]}",
                file=log,
                flush=True,
            )
        lbs = [r.lower_bound for r in inst if r.lower_bound is not None and r.status != "error"]
        best_lb = max([graph.total_cost, *lbs])
        for r in inst:
            r.best_lb = best_lb
            if r.cost is not None and best_lb > 0 and r.status in ("optimal", "feasible"):
                r.cost_over_lb = r.cost / best_lb
        rows.extend(inst)
    return rows


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """The rows as CSV (no schedules)."""
    write_rows(rows, path, Row, exclude=("steps",))


def trace_models(out_dir: Path) -> tuple[list[Path], list[str]]:
    """Trace the GPT-2-small-like and ResNet-50-like models (``benchmarks.traced``) in a
    subprocess, so this process never imports torch. Returns the graph files and notes."""
    if importlib.util.find_spec("torch") is None:
        return [], ["not run: torch is not installed"]
    cmd = [sys.executable, "-m", "benchmarks.traced", str(out_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TRACE_TIMEOUT, cwd=REPO)
    except subprocess.TimeoutExpired:
        return [], [f"not run: tracing took more than {TRACE_TIMEOUT} s"]
    notes, paths = [], []
    for line in proc.stdout.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "error" in rec:
            notes.append(f"{rec['name']}: trace failed: {rec['error']}")
            continue
        notes.append(
            f"{rec['name']}: traced + profiled (cpu profile) in {rec['trace_seconds']} s, "
            f"{rec['graphs']} graph(s) of {rec['nodes']} nodes"
        )
        paths += sorted(out_dir.glob(f"traced_{rec['name']}*.json"))
    if proc.returncode != 0 and not notes:
        notes.append(f"not run: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
    return paths, notes


def run_e2e(out_dir: Path, time_limit: float) -> tuple[list[Any], list[str]]:
    """``checkmate.optimize`` end to end on the traced models (``benchmarks.e2e``: trace +
    profile + solve + codegen timed in a fresh process per model, plus one measured step),
    in a subprocess so this process never imports torch. Returns its rows and notes."""
    from benchmarks import e2e

    if importlib.util.find_spec("torch") is None:
        return [], ["not run: torch is not installed"]
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--time-limit", str(time_limit), "--out", str(out_dir)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=E2E_TIMEOUT, cwd=REPO)
    except subprocess.TimeoutExpired:
        return [], [f"not run: took more than {E2E_TIMEOUT} s"]
    rows = [
        e2e.row_from_json(line[len(e2e.MARKER) :])
        for line in proc.stdout.splitlines()
        if line.startswith(e2e.MARKER)
    ]
    if not rows:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        return [], [f"not run: {tail[-1] if tail else f'exit code {proc.returncode}'}"]
    return rows, []


def read_csv(path: Path) -> list[Row]:
    """Rows back from a CSV written by :func:`write_csv`."""
    return read_rows(path, Row)


def relink_bounds(rows: list[Row]) -> list[Row]:
    """Rows of several runs on the same instances: each instance's best lower bound (and so
    cost / LB) taken over all of them, as if they had run together."""
    best: dict[tuple[str, float], float] = {}
    for r in rows:
        key = (r.graph, r.budget_frac)
        for lb in (r.best_lb, r.lower_bound if r.status != "error" else None):
            if lb is not None:
                best[key] = max(best.get(key, lb), lb)
    for r in rows:
        lb = best.get((r.graph, r.budget_frac))
        if lb is None:
            continue
        r.best_lb = lb
        if r.cost is not None and lb > 0 and r.status in ("optimal", "feasible"):
            r.cost_over_lb = r.cost / lb
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.run``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a subset that runs in under 5 minutes")
    ap.add_argument("--only", default="", help="comma-separated substrings of graph names")
    ap.add_argument("--strategies", default="", help="comma-separated strategy names")
    ap.add_argument("--budgets", default="", help="comma-separated fractions of the keep-all peak")
    ap.add_argument("--time-limit", type=float, default=None, help="seconds per search")
    ap.add_argument("--graphs-dir", type=Path, default=GRAPHS_DIR)
    ap.add_argument("--out", default="", help="results name (default: bench or quick)")
    ap.add_argument("--no-traced", action="store_true", help="skip the traced PyTorch models")
    ap.add_argument(
        "--no-e2e",
        action="store_true",
        help="trace the models but skip the end-to-end step (run `python -m benchmarks.e2e` apart)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the graphs <out>.csv already has in full (every budget x strategy asked), and the "
        "traced graphs and e2e.csv already written; run only the rest (a run of hours survives a restart)",
    )
    ap.add_argument(
        "--tables-from",
        default="",
        help="comma-separated result CSVs: only rewrite README_tables.md from them (no solving)",
    )
    args = ap.parse_args(argv)
    if args.tables_from:
        loaded = relink_bounds([r for f in args.tables_from.split(",") if f for r in read_csv(Path(f))])
        limit = args.time_limit if args.time_limit is not None else TIME_LIMIT
        notes = [f"tables from {', '.join(Path(f).name for f in args.tables_from.split(',') if f)}"]
        e2e_csv = RESULTS_DIR / "e2e.csv"
        saved: list[Any] = []
        if e2e_csv.is_file():
            from benchmarks import e2e

            saved = e2e.read_csv(e2e_csv)
            notes.append(f"end to end from {e2e_csv.name}")
        md = tables.markdown(loaded, notes, limit, float("nan"), CHECKMATE_GRAPHS, saved)
        (RESULTS_DIR / "README_tables.md").write_text(md)
        print(f"wrote {RESULTS_DIR / 'README_tables.md'} from {len(loaded)} rows")
        return 0

    gdir = args.graphs_dir.resolve()
    paths = sorted(gdir.glob("*.json")) if gdir.is_dir() else []
    budgets = tuple(float(b) for b in args.budgets.split(",") if b) or BUDGETS
    time_limit = args.time_limit if args.time_limit is not None else TIME_LIMIT
    if args.quick:
        paths = [p for p in paths if p.stem in QUICK_GRAPHS]
        budgets = tuple(float(b) for b in args.budgets.split(",") if b) or QUICK_BUDGETS
        time_limit = args.time_limit if args.time_limit is not None else QUICK_TIME_LIMIT
    keys = [k.lower() for k in args.only.split(",") if k]

    def selected(p: Path) -> bool:
        return not keys or any(k in p.stem.lower() for k in keys)

    paths = [p for p in paths if selected(p)]
    traced_paths: list[Path] = []
    traced_notes: list[str] = []
    e2e_rows: list[Any] = []
    if args.no_traced or args.quick:
        traced_notes.append("not run (--no-traced or --quick)")
    elif keys and not any(k in "traced_gpt2_small traced_resnet50_like" for k in keys):
        traced_notes.append("not run (--only)")
    elif args.resume and (traced_paths := sorted((RESULTS_DIR / "graphs").glob("traced_*.json"))):
        traced_notes.append(
            f"traced graphs kept from the run resumed: {', '.join(p.name for p in traced_paths)}"
        )
        if (RESULTS_DIR / "e2e.csv").is_file():
            from benchmarks import e2e

            e2e_rows = e2e.read_csv(RESULTS_DIR / "e2e.csv")
            traced_notes.append("end to end kept from e2e.csv")
    else:
        traced_paths, traced_notes = trace_models(RESULTS_DIR / "graphs")
        if args.no_e2e:
            traced_notes.append("end to end not run (--no-e2e)")
        else:
            print(
                "end to end: checkmate.optimize on the traced models (python -m benchmarks.e2e)", flush=True
            )
            e2e_rows, e2e_notes = run_e2e(RESULTS_DIR, time_limit)
            traced_notes += [f"end to end {t}" for t in e2e_notes]
    paths += [p for p in traced_paths if selected(p)]
    wanted = [s for s in args.strategies.split(",") if s] or list(STRATEGIES)
    strategies, notes = available_strategies(wanted)
    if not gdir.is_dir():
        notes.append(f"public graphs not found at {gdir}: not run")
    name = args.out or ("quick" if args.quick else "bench")

    log = sys.stdout
    print(f"benchmark {name}: {len(paths)} graphs x {len(budgets)} budgets x {strategies}", file=log)
    for note in notes:
        print(f"  note: {note}", file=log)
    t0 = time.perf_counter()
    out_csv = RESULTS_DIR / f"{name}.csv"
    rows: list[Row] = read_csv(out_csv) if args.resume and out_csv.is_file() else []
    have = {(r.graph, round(r.budget_frac, 6), r.strategy) for r in rows}
    for p in paths:
        if args.resume and all((p.stem, round(b, 6), s) in have for b in budgets for s in strategies):
            print(f"  {p.stem}: kept from {out_csv.name} (--resume)", file=log, flush=True)
            continue
        rows = [r for r in rows if r.graph != p.stem]  # a graph cut short runs again in full
        rows.extend(bench_graph(p, budgets, strategies, time_limit, log))
        write_csv(rows, out_csv)  # partial results survive an interrupt: --resume goes on from here
    notes += [f"traced models (GPT-2-small-like, ResNet-50-like): {t}" for t in traced_notes]
    write_csv(rows, out_csv)
    md = tables.markdown(rows, notes, time_limit, time.perf_counter() - t0, CHECKMATE_GRAPHS, e2e_rows)
    (RESULTS_DIR / ("README_tables.md" if name == "bench" else f"{name}_tables.md")).write_text(md)
    print(
        f"wrote {RESULTS_DIR / (name + '.csv')} ({len(rows)} rows) in {time.perf_counter() - t0:.0f} s",
        file=log,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
