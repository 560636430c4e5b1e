"""Markdown for the benchmark results: the full table per graph and issue 5's targets."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["markdown", "targets", "e2e_line"]

TARGET_RATIO = 1.02
TARGET_SECONDS = 60.0
N1000_SECONDS = 300.0
INFEASIBLE_SECONDS = 5.0
E2E_SECONDS = 120.0
OK = ("optimal", "feasible")


def _f(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def _seconds(r: Any) -> float:
    """Seconds a strategy took: its own build + solve, or the wall time if larger."""
    own = (r.build_s or 0.0) + (r.solve_s or 0.0)
    return max(own, r.wall_s or 0.0)


def _run_time(seconds: float) -> str:
    return "" if seconds != seconds else f"; whole run {seconds / 60:.1f} min"  # NaN: unknown


def targets(rows: Sequence[Any], checkmate_graphs: Sequence[str]) -> list[str]:
    """Issue 5's targets, one markdown line each, met or missed with the measured figure."""
    by_inst: dict[tuple[str, float], list[Any]] = defaultdict(list)
    for r in rows:
        by_inst[(r.graph, r.budget_frac)].append(r)
    lines = [
        "| graph | budget | schedule exists | best within 60 s (strategy) | cost / best LB | seconds | target |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    met = missed = 0
    for (g, frac), inst in sorted(by_inst.items(), key=lambda kv: (kv[0][0], -kv[0][1])):
        if g not in checkmate_graphs:
            continue
        infeasible = [r for r in inst if r.status == "infeasible"]
        ok = [r for r in inst if r.status in OK and r.cost is not None]
        in_time = [r for r in ok if _seconds(r) <= TARGET_SECONDS]
        if infeasible and not ok:
            t = min(_seconds(r) for r in infeasible)
            lines.append(f"| {g} | {frac:.1f} | no (proven, {t:.2f} s) | | | | n/a |")
            continue
        if not ok:
            missed += 1
            lines.append(f"| {g} | {frac:.1f} | unknown | none found | | | **missed** |")
            continue
        best = min(in_time or ok, key=lambda r: (r.cost, _seconds(r)))
        proven = any(
            r.strategy == "ilp" and r.status == "optimal" and r.cost <= best.cost * (1 + 1e-9)
            for r in in_time
        )
        good = bool(in_time) and (
            (best.cost_over_lb is not None and best.cost_over_lb <= TARGET_RATIO) or proven
        )
        met += good
        missed += not good
        lines.append(
            f"| {g} | {frac:.1f} | yes | {best.overhead:.4f}x ({best.strategy}) | "
            f"{_f(best.cost_over_lb, '.4f')} | {_seconds(best):.1f} | {'met' if good else '**missed**'} |"
        )
    out = [
        f"Public Checkmate graphs: {met} instances met, {missed} missed "
        f"(a schedule within {TARGET_SECONDS:.0f} s at cost <= {TARGET_RATIO} x best LB, or proven optimal).",
        "",
        *lines,
        "",
    ]
    n1000 = [r for r in rows if r.graph == "random_layered_n1000" and abs(r.budget_frac - 0.8) < 1e-9]
    ok1000 = [r for r in n1000 if r.status in OK and _seconds(r) <= N1000_SECONDS]
    if n1000:
        if ok1000:
            b = min(ok1000, key=lambda r: r.cost)
            out.append(
                f"- random_layered_n1000 at 0.8: met, {b.strategy} {b.overhead:.4f}x in {_seconds(b):.1f} s."
            )
        else:
            out.append("- random_layered_n1000 at 0.8: **missed**, no schedule within 300 s.")
    else:
        out.append("- random_layered_n1000 at 0.8: not run.")
    inf = [r for r in rows if r.status == "infeasible"]
    if inf:
        worst = max(inf, key=_seconds)
        stated = all("min budget" in r.note for r in inf)
        verdict = "met" if _seconds(worst) <= INFEASIBLE_SECONDS and stated else "**missed**"
        out.append(
            f"- budgets below the minimum: {len(inf)} rows decided infeasible, slowest "
            f"{_seconds(worst):.2f} s ({worst.graph} at {worst.budget_frac}, {worst.strategy}); "
            f"minimum stated: {'yes' if stated else 'not always'}: {verdict}."
        )
    return out


def e2e_line(r: Any) -> str:
    """One end-to-end row (``benchmarks.e2e.Row``) as a targets line: the ``optimize``
    call's seconds per stage, met or missed, the measured peak over the budget."""
    budget = f"budget {r.budget_frac:g}, {r.time_limit:g} s per solve"
    if r.status != "ok":
        spent = ""
        if r.total_s == r.total_s:  # NaN: the call never ran
            spent = f" after {r.total_s:.1f} s"
            if r.solve_s == r.solve_s:
                spent += f" (trace {r.trace_s:.1f}, profile {r.profile_s:.1f}, solve {r.solve_s:.1f})"
        return f"{r.model} ({budget}): **missed**, no plan{spent}: {r.status}"
    verdict = "met" if r.total_s <= E2E_SECONDS else "**missed**"
    return (
        f"{r.model} ({r.nodes} nodes, {budget}): trace + profile + solve + codegen: "
        f"{r.total_s:.1f} s (trace {r.trace_s:.1f}, profile {r.profile_s:.1f}, solve {r.solve_s:.1f}, "
        f"codegen {r.codegen_s:.1f}): {verdict} (target {E2E_SECONDS:.0f} s); {r.strategy}, "
        f"measured peak / budget {r.peak_over_budget:.3f} (eager {r.eager_over_budget:.3f}), "
        f"gradient max abs error vs eager {r.grad_err:.1e}"
    )


def markdown(
    rows: Sequence[Any],
    notes: Sequence[str],
    time_limit: float,
    seconds: float,
    checkmate_graphs: Sequence[str],
    e2e_rows: Sequence[Any] = (),
) -> str:
    """The README tables: targets first, then one table per graph.

    Args:
        rows: the solver rows (``benchmarks.run.Row``).
        notes: lines listed under the header.
        time_limit: seconds per search.
        seconds: the whole run's seconds (NaN: unknown).
        checkmate_graphs: the public graphs the first target covers.
        e2e_rows: ``benchmarks.e2e.Row`` per traced model (none: the target is "not run").

    Returns:
        The markdown text.
    """
    out = [
        "<!-- generated by `make bench` (python -m benchmarks.run); do not edit by hand -->",
        f"Measured on this machine, {time_limit:.0f} s per search (300 s for random_layered_n1000 "
        f"at 0.8){_run_time(seconds)}. Overhead = cost / no-recompute cost; "
        "cost / LB = cost / the best lower bound proved at that instance (at least the "
        "no-recompute cost); seconds = build + solve.",
        "",
    ]
    out += [f"- {n}" for n in notes]
    out += ["", "### Targets (issue 5)", "", *targets(rows, checkmate_graphs)]
    if e2e_rows:
        out += [f"- {e2e_line(r)}." for r in e2e_rows]
    else:
        out.append("- traced GPT-2-small-like and ResNet-50-like models end to end: not run.")
    out.append("")
    graphs: dict[str, list[Any]] = defaultdict(list)
    for r in rows:
        graphs[r.graph].append(r)
    for g, grows in graphs.items():
        out += [
            f"### {g} ({grows[0].n} nodes)",
            "",
            "| budget | strategy | status | overhead | cost / LB | peak / budget | build s | solve s | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in grows:
            note = r.note.replace("|", "/")[:120]
            out.append(
                f"| {r.budget_frac:.1f} | {r.strategy} | {r.status} | {_f(r.overhead, '.4f')} | "
                f"{_f(r.cost_over_lb, '.4f')} | {_f(r.peak_over_budget, '.3f')} | "
                f"{_f(r.build_s, '.2f')} | {_f(r.solve_s, '.2f')} | {note} |"
            )
        out.append("")
    return "\n".join(out)
