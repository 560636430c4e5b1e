"""Plan for a GPU you do not have: billion-parameter decoders traced on fake tensors.

``make bench-big``: for a Llama-2-7B-shaped and a GPT-2-XL-shaped decoder
(:mod:`benchmarks.big_models`, bf16, random init), ``checkmate trace --fake --profile h100``
in a child process (its wall seconds and peak RSS measured), then plans of the graph at
80, 60 and 40 GiB (and at the peak of per-layer checkpointing) with ``auto`` (60 s limit),
beside no rematerialization, per-layer checkpointing (each repeated layer's outputs kept,
its inside recomputed, as ``torch.utils.checkpoint`` around every layer does) and Chen et
al.'s sqrt(n) and greedy baselines, all on the same graph and simulated by the same
simulator. Every figure is a prediction from the h100 profile's roofline, not a
measurement on a GPU. Writes ``benchmarks/results/big.md``.

Per model also a Pareto curve: ``auto`` (``--pareto-time-limit``, 25 s) at ``--points``
budgets evenly spaced from the keep-all peak down to the least peak found, with no
rematerialization and per-layer checkpointing as marked points and the proven lower bound
(:func:`solvers.cost_bounds.recompute_lower_bound`) as a line, drawn to
``benchmarks/results/big_<model>_pareto.png`` with a CSV beside it (``--pareto-only``
skips the budget table).

Budgets are the bytes the plan controls: activations, their gradients, temporaries and
parameter gradients (the graph's nodes). Parameters and optimizer state are resident
outside the budget (the table lists the parameters' bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from solvers import keep_all_peak, load_graph, solve
from solvers.cost_bounds import recompute_lower_bound
from solvers.graph import Graph
from solvers.repeats import find_repeats
from solvers.schedule import simulate
from solvers.strategies._segments import schedule_from_kept

GiB = 2**30
MODELS = ("llama7b", "gpt2xl")
TARGET_SECONDS, TARGET_RSS = 300.0, 8 * 10**9


def _child(name: str, layers: int | None, out: Path) -> None:
    """In the child process: trace ``name`` with --fake and save the graph; print a JSON line."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import benchmarks.big_models as bm
    from checkmate.cli_trace import trace_factory
    from solvers import save_graph

    bm.LAYERS[name] = layers
    t0 = time.perf_counter()
    (g,) = trace_factory(f"benchmarks.big_models:{name}", profile="h100", fake=True)
    seconds = time.perf_counter() - t0
    save_graph(g, out)
    with FakeTensorMode():
        model, _ = getattr(bm, name)()
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        count = sum(p.numel() for p in model.parameters())
    print(
        json.dumps({"trace_s": seconds, "param_bytes": params, "params": count, "torch": torch.__version__})
    )


def trace(name: str, layers: int | None, out: Path) -> dict[str, Any]:
    """Trace in a child process: its result line, wall seconds and peak RSS (bytes)."""
    argv = [sys.executable, "-m", "benchmarks.big", "--child", name, "--graph", str(out)]
    if layers:
        argv += ["--layers", str(layers)]
    with tempfile.TemporaryFile("w+") as out_f, tempfile.TemporaryFile("w+") as err_f:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out_f, stderr=err_f, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS
        wall = time.perf_counter() - t0
        out_f.seek(0), err_f.seek(0)
        stdout, stderr = out_f.read(), err_f.read()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"tracing {name} failed (exit {code}): {stderr.strip()[-2000:]}")
    row = json.loads(stdout.strip().splitlines()[-1])
    row["wall_s"] = wall
    row["rss"] = usage.ru_maxrss * 1024  # Linux: KiB
    return row


def per_layer_kept(graph: Graph) -> list[int]:
    """Forward values per-layer checkpointing keeps: everything outside the repeated layers,
    and of each layer the outputs read after it (its boundary); the rest is recomputed."""
    reps = find_repeats(
        graph, cost_rtol=None, periods=12
    )  # the default 6 misses the forward layers of a Llama
    fwd_runs = [r for r in reps.runs if not r.backward]
    if not fwd_runs:
        raise SystemExit(f"{graph.name}: no repeated forward layers found")
    inside: dict[int, tuple[int, int]] = {}
    for r in fwd_runs:
        for s, e in r.blocks:
            for v in range(s, e):
                inside[v] = (s, e)
    succ = graph.succs
    kept = []
    for v in range(graph.n):
        if graph.backward_mask[v]:
            continue
        blk = inside.get(v)
        if blk is None or any(w >= blk[1] and not graph.backward_mask[w] for w in succ[v]):
            kept.append(v)
    return kept


def plan(graph: Graph, time_limit: float, budgets_gib: list[float]) -> list[dict[str, Any]]:
    """One row per (budget, method): predicted peak, compute overhead, cost / lower bound."""
    base = graph.total_cost
    rows: list[dict[str, Any]] = []

    def row(
        budget: str, method: str, cost: float | None, peak: int | None, seconds: float, bound: float | None
    ) -> None:
        rows.append(
            {
                "budget": budget,
                "method": method,
                "peak_gib": None if peak is None else peak / GiB,
                "overhead": None if cost is None else cost / base - 1.0,
                "cost_over_bound": None if cost is None or not bound else cost / bound,
                "seconds": seconds,
            }
        )

    keep = keep_all_peak(graph)
    row("-", "no rematerialization", base, keep, 0.0, None)
    t0 = time.perf_counter()
    layer = simulate(graph, schedule_from_kept(graph, per_layer_kept(graph)))
    layer_s = time.perf_counter() - t0
    row("-", "per-layer checkpointing", layer.cost, layer.peak, layer_s, None)
    targets = [(f"{b:g} GiB", int(b * GiB)) for b in budgets_gib]
    targets.append((f"{layer.peak / GiB:.2f} GiB (per-layer's peak)", int(layer.peak)))
    for label, nbytes in targets:
        if nbytes >= keep:
            row(label, "auto", base, keep, 0.0, base)  # keep-all fits: nothing to plan
            continue
        bound = None
        for method in ("auto", "chen-sqrtn", "chen-greedy"):
            t0 = time.perf_counter()
            res = solve(graph, nbytes, method, time_limit=time_limit, raise_infeasible=False)
            secs = time.perf_counter() - t0
            if method == "auto":
                bound = _bound(graph, nbytes, res.lower_bound)
            fits = res.ok
            row(
                label,
                method if fits else f"{method} (no plan within budget)",
                res.cost if fits else None,
                res.peak if fits else None,
                secs,
                bound,
            )
            print(f"  {graph.name} {label} {method}: {rows[-1]}", flush=True)
    return rows


def _bound(graph: Graph, nbytes: int, solver_bound: float | None) -> float:
    """The larger of a strategy's proven lower bound and what the budget forces to be
    recomputed at one instant (:func:`solvers.cost_bounds.recompute_lower_bound`)."""
    forced = recompute_lower_bound(graph, nbytes)
    return max(solver_bound or graph.total_cost, forced or graph.total_cost)


def pareto(graph: Graph, points: int, time_limit: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``auto`` at ``points`` budgets evenly spaced from the keep-all peak down to the least
    peak found (the search seeded with per-layer checkpointing's schedule), one row each,
    and the two reference plans: (rows, {label: (peak GiB, cost / no-recompute cost)})."""
    from solvers.strategies.least_peak import least_peak

    base, keep = graph.total_cost, keep_all_peak(graph)
    layer_sched = schedule_from_kept(graph, per_layer_kept(graph))
    layer = simulate(graph, layer_sched)
    t0 = time.perf_counter()
    floor = least_peak(graph, time_limit=time_limit, exact=False, seeds=[layer_sched]).peak
    print(
        f"  {graph.name}: least peak found {floor / GiB:.2f} GiB ({time.perf_counter() - t0:.1f} s)",
        flush=True,
    )
    budgets = [int(keep - (keep - floor) * k / max(points - 1, 1)) for k in range(points)]
    rows = []
    for nbytes in budgets:
        t0 = time.perf_counter()
        if nbytes >= keep:
            cost, peak, bound, status = base, keep, base, "keep-all fits"
        else:
            res = solve(graph, nbytes, "auto", time_limit=time_limit, raise_infeasible=False)
            cost, peak, bound, status = (
                (res.cost if res.ok else None),
                res.peak,
                _bound(graph, nbytes, res.lower_bound),
                str(res.status),
            )
        rows.append(
            {
                "strategy": "auto",
                "budget_gib": nbytes / GiB,
                "budget_fraction": nbytes / keep,
                "status": status,
                "predicted_peak_gib": None if cost is None or peak is None else peak / GiB,
                "overhead": None if cost is None else cost / base,
                "cost_over_bound": None if cost is None or not bound else cost / bound,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(f"  {graph.name} pareto {rows[-1]}", flush=True)
    # the proven lower bound at each budget, drawn as a line of its own
    rows += [
        {
            "strategy": "lower bound (proven)",
            "budget_gib": r["budget_gib"],
            "budget_fraction": r["budget_fraction"],
            "status": "bound",
            "predicted_peak_gib": None,
            "overhead": _bound(graph, int(r["budget_gib"] * GiB), None) / base,
            "cost_over_bound": None,
            "seconds": 0.0,
        }
        for r in list(rows)
    ]
    marks = {
        "no rematerialization": (keep / GiB, 1.0),
        "per-layer checkpointing": (layer.peak / GiB, layer.cost / base),
    }
    return rows, marks


def write_pareto(name: str, rows: list[dict[str, Any]], marks: dict[str, Any], folder: Path) -> None:
    """``big_<name>_pareto.png`` and ``.csv`` in ``folder``."""
    import csv

    import benchmarks.big_models as bm
    from checkmate.plot import pareto_figure

    folder.mkdir(parents=True, exist_ok=True)
    csv_path = folder / f"big_{name}_pareto.csv"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        for label, (gib, over) in marks.items():
            writer.writerow(
                {"strategy": label, "budget_gib": gib, "predicted_peak_gib": gib, "overhead": over}
            )
    b, s = bm.BATCH[name]
    png = pareto_figure(
        rows,
        folder / f"big_{name}_pareto.png",
        title=f"{name}, batch {b} x {s}: predictions from the h100 profile (not measured)",
        x="budget_gib",
        xlabel="budget (GiB; activations, temporaries and gradients; parameters come on top)",
        ylabel="predicted step time / step without remat (h100 profile)",
        marks=[(label, gib, over) for label, (gib, over) in marks.items()],
    )
    print(f"wrote {png} and {csv_path}", flush=True)


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument(
        "--layers", type=int, default=None, help="build this many layers instead of the full depth"
    )
    ap.add_argument("--budgets", type=float, nargs="+", default=[80.0, 60.0, 40.0, 30.0, 20.0], help="GiB")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default="benchmarks/results/big.md")
    ap.add_argument("--keep-graphs", default=None, help="folder to keep the traced graphs in")
    ap.add_argument("--points", type=int, default=8, help="budgets on each model's Pareto curve (0: none)")
    ap.add_argument("--pareto-time-limit", type=float, default=25.0, help="auto's seconds per Pareto point")
    ap.add_argument("--pareto-only", action="store_true", help="trace and draw the Pareto curves only")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--graph", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.layers, Path(args.graph))
        return
    if args.points:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit(
                "the Pareto plot needs matplotlib: pip install 'checkmate-remat[plot]' (or --points 0)"
            ) from None
    folder = Path(args.keep_graphs or tempfile.mkdtemp(prefix="checkmate-big-"))
    folder.mkdir(parents=True, exist_ok=True)
    traced: dict[str, dict[str, Any]] = {}
    planned: dict[str, list[dict[str, Any]]] = {}
    for name in args.models:
        path = folder / f"{name}{'' if not args.layers else f'-{args.layers}l'}.json"
        traced[name] = trace(name, args.layers, path)
        graph = load_graph(path)
        traced[name]["nodes"] = graph.n
        print(
            f"{name}: traced {graph.n} nodes in {traced[name]['trace_s']:.1f} s, "
            f"RSS {traced[name]['rss'] / 2**20:.0f} MiB",
            flush=True,
        )
        if not args.pareto_only:
            planned[name] = plan(graph, args.time_limit, args.budgets)
        if args.points:
            t0 = time.perf_counter()
            rows, marks = pareto(graph, args.points, args.pareto_time_limit)
            print(f"{name}: Pareto curve planned in {time.perf_counter() - t0:.0f} s", flush=True)
            write_pareto(name, rows, marks, Path(args.out).parent)
    if not args.pareto_only:
        write(Path(args.out), args, traced, planned)


def write(
    out: Path,
    args: argparse.Namespace,
    traced: dict[str, dict[str, Any]],
    planned: dict[str, list[dict[str, Any]]],
) -> None:
    import benchmarks.big_models as bm

    lines = [
        "# Plan for a GPU you do not have: predictions from the h100 profile",
        "",
        "`make bench-big` (benchmarks/big.py): each model traced with `checkmate trace --fake "
        "--profile h100` in a child process (bf16, random init on fake tensors), then planned on "
        f"this machine (2 cores), `auto` with a {args.time_limit:.0f} s limit per budget. Peaks and "
        "step times are **predictions** (the h100 profile's roofline and the simulator), not "
        "measurements. Budgets cover what the plan controls (activations, temporaries, gradients); "
        "parameters and optimizer state come on top. Overhead: predicted step time over the step "
        "without rematerialization, minus 1. cost / bound: over the larger of `auto`'s proven lower "
        "bound (on these graphs only the trivial one, every op once) and "
        "`solvers.cost_bounds.recompute_lower_bound` (what the budget forces to be recomputed "
        "when one op runs: a fractional knapsack over the values live then), so it bounds the gap "
        "to the optimum from above.",
        "",
        "| model | batch | layers | params | nodes | trace (s) | child wall (s) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, t in traced.items():
        b, s = bm.BATCH[name]
        lines.append(
            f"| {name} | {b} x {s} | {args.layers or 'full'} | {t['params'] / 1e9:.2f} B "
            f"({t['param_bytes'] / GiB:.1f} GiB) | {t['nodes']} | {t['trace_s']:.1f} | {t['wall_s']:.1f} | "
            f"{t['rss'] / 2**20:.0f} |"
        )
    for name, rows in planned.items():
        lines += [
            "",
            f"## {name}",
            "",
            "| budget | method | predicted peak (GiB) | compute overhead | cost / bound | plan seconds |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r['budget']} | {r['method']} | {_fmt(r['peak_gib'], '.2f')} | "
                f"{_fmt(None if r['overhead'] is None else 100 * r['overhead'], '.1f')}% | "
                f"{_fmt(r['cost_over_bound'], '.3f')} | {r['seconds']:.1f} |"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
