"""End to end: ``checkmate.optimize`` on the traced GPT-2-small-like and ResNet-50-like models.

Issue 5's target: trace + profile + solve + codegen within 120 s per model on this machine.
For each model (the factories of :mod:`benchmarks.traced`) a FRESH Python process, with the
plan cache off (``CHECKMATE_CACHE=0``: no plan, op time or scratch size from an earlier
run), times the whole call ::

    checkmate.optimize(model, budget, (x, y), profile="cpu", time_limit=time_limit)

which plans at ``optimize`` time because example inputs are given. ``profile="cpu"`` takes
op costs from the CPU device profile (no op is timed); scratch space is still measured per
op. The stage seconds come from the planner's records (:class:`checkmate.runtime.PlanRecord`),
or, for a plan that fails before its record exists, from :func:`checkmate.timers.observe`:

- ``trace_s``: the call's wall time outside the partitioner (Dynamo capture, AOTAutograd's
  joint trace, the planning call's forward) plus building the graph model;
- ``profile_s``: op costs and scratch-space measurement (``scratch_s`` of it);
- ``solve_s``: the strategy (``auto`` by default) within ``time_limit`` per graph;
- ``codegen_s``: generating the rematerialized forward and backward.

Then the same process runs ONE training step of the eager model and one of the optimized
module (they share parameters; buffers are restored in between), each under
:func:`checkmate.memory.measure_peak`, and reports the measured peaks over the budget and
the largest absolute gradient difference from eager.

Outputs: ``benchmarks/results/e2e.csv`` and ``e2e.md``; one ``E2E_JSON`` line per model on
stdout (``benchmarks.run`` reads them).

Usage::

    python -m benchmarks.e2e                                   # both models, budget 0.5, 60 s
    python -m benchmarks.e2e --models resnet50_like --budget 0.7 --time-limit 30
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.csvio import coerce, read_rows, write_rows
from benchmarks.tables import E2E_SECONDS

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "benchmarks" / "results"
MARKER = "E2E_JSON "
#: model name -> factory ("module:function" returning (model, x, y); the model's
#: ``forward(x, y)`` returns the loss)
FACTORIES = {
    "gpt2_small": "benchmarks.traced:gpt2_small",
    "resnet50_like": "benchmarks.traced:resnet50_like",
}
TARGET_SECONDS = E2E_SECONDS
BUDGET = 0.5
TIME_LIMIT = 60.0
CHILD_TIMEOUT = 1200.0

__all__ = [
    "Row",
    "measure",
    "run_child",
    "run",
    "summary",
    "row_from_json",
    "markdown",
    "write_csv",
    "read_csv",
    "main",
]


@dataclass
class Row:
    """One model's end-to-end figures (seconds, bytes); NaN / empty where not measured."""

    model: str
    status: str  # "ok" or "error: ..."
    budget_frac: float
    time_limit: float
    graphs: int = 0
    nodes: int = 0
    total_s: float = float("nan")
    trace_s: float = float("nan")
    profile_s: float = float("nan")
    scratch_s: float = float("nan")
    solve_s: float = float("nan")
    codegen_s: float = float("nan")
    strategy: str = ""
    solve_status: str = ""
    overhead: float = float("nan")
    budget_bytes: int = 0
    reference_peak: int = 0
    sim_peak: int = 0
    recomputes: int = 0
    measured_peak: int = 0
    eager_peak: int = 0
    peak_over_budget: float = float("nan")
    eager_over_budget: float = float("nan")
    grad_err: float = float("nan")
    grad_scale: float = float("nan")
    loss_err: float = float("nan")
    step_s: float = float("nan")
    eager_step_s: float = float("nan")
    wall_s: float = float("nan")

    @property
    def met(self) -> bool:
        """Issue 5's target: planned within ``TARGET_SECONDS``."""
        return self.status == "ok" and self.total_s <= TARGET_SECONDS


# ---------------------------------------------------------------- in the child process


def _load(spec: str) -> Callable[[], tuple[Any, Any, Any]]:
    module, func = spec.split(":")
    fn: Callable[[], tuple[Any, Any, Any]] = getattr(importlib.import_module(module), func)
    return fn


def measure(
    name: str,
    factory: Callable[[], tuple[Any, Any, Any]],
    *,
    budget: float = BUDGET,
    time_limit: float = TIME_LIMIT,
    strategy: str = "auto",
) -> Row:
    """Optimize one model in this process and measure one training step (the child's work).

    The caller disables the plan cache (``CHECKMATE_CACHE=0``) for cold figures.

    Args:
        name: the model's name in the row.
        factory: returns ``(model, x, y)``; ``model(x, y)`` returns the training loss.
        budget: the budget fraction of each graph's no-remat peak.
        time_limit: seconds per graph for the strategy.
        strategy: the strategy passed to ``optimize``.

    Returns:
        The row (status ``error: ...`` when ``optimize`` or the step raised).
    """
    import torch

    import checkmate
    from checkmate.memory import measure_peak
    from checkmate.records import records_overhead
    from checkmate.timers import observe

    model, x, y = factory()
    model.train()
    row = Row(name, "ok", budget, time_limit)
    spent: dict[str, float] = {}
    start = time.perf_counter()
    try:
        with observe(lambda name, dt: spent.__setitem__(name, spent.get(name, 0.0) + dt)):
            opt = checkmate.optimize(
                model, budget, (x, y), profile="cpu", time_limit=time_limit, strategy=strategy
            )
    except Exception as exc:  # the failure is the figure: report it with the time spent
        # no PlanRecord is made for a failed plan: the stages come from the timers
        row.total_s = time.perf_counter() - start
        row.status = f"error: {type(exc).__name__}: {exc}"[:400]
        row.profile_s = spent.get("profile", 0.0) + spent.get("scratch", 0.0)
        row.scratch_s = spent.get("scratch", 0.0)
        row.solve_s = spent.get("plan", 0.0)
        row.trace_s = row.total_s - row.profile_s - row.solve_s
        return row
    row.total_s = time.perf_counter() - start
    records = checkmate.plans_of(opt)
    partition = sum(r.seconds for r in records)
    row.graphs = len(records)
    row.nodes = sum(r.joint.graph.n for r in records)
    row.trace_s = (row.total_s - partition) + sum(r.trace_seconds for r in records)
    row.profile_s = sum(r.profile_seconds for r in records)
    row.scratch_s = sum(r.scratch_seconds for r in records)
    row.solve_s = sum(r.solve_seconds for r in records)
    row.codegen_s = sum(r.codegen_seconds for r in records)
    row.strategy = "+".join(str(r.result.info.get("chosen", r.result.strategy)) for r in records)
    row.solve_status = "+".join(str(r.result.status) for r in records)
    row.overhead = 1.0 + records_overhead(records) if records else float("nan")
    # with graph breaks the budget bounds each graph; the step holds them all at most
    row.budget_bytes = sum(int(r.result.budget) for r in records)
    row.reference_peak = sum(r.reference_peak for r in records)
    row.sim_peak = sum(int(r.result.peak or 0) for r in records)
    row.recomputes = sum(r.recomputes for r in records)

    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}

    def step(module: Any) -> tuple[int, float, float, dict[str, Any]]:
        """(peak, seconds, loss, grads) of one step from the saved buffers."""
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
        model.zero_grad(set_to_none=True)
        gc.collect()
        loss: list[float] = []

        def run() -> None:
            out = module(x, y)
            out.backward()
            loss.append(float(out.detach()))

        t0 = time.perf_counter()
        peak = measure_peak(run)
        seconds = time.perf_counter() - t0
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return peak, seconds, loss[0], grads

    try:
        row.eager_peak, row.eager_step_s, eager_loss, eager_grads = step(model)
        row.measured_peak, row.step_s, loss, grads = step(opt)
    except Exception as exc:
        row.status = f"error in the step: {type(exc).__name__}: {exc}"[:400]
        return row
    row.loss_err = abs(loss - eager_loss)
    row.grad_err = max(
        (float((grads[n].double() - g.double()).abs().max()) if n in grads else float("inf"))
        for n, g in eager_grads.items()
    )
    row.grad_scale = max(float(g.abs().max()) for g in eager_grads.values())
    if row.budget_bytes:
        row.peak_over_budget = row.measured_peak / row.budget_bytes
        row.eager_over_budget = row.eager_peak / row.budget_bytes
    return row


# ---------------------------------------------------------------- the parent


def run_child(
    name: str,
    spec: str,
    *,
    budget: float = BUDGET,
    time_limit: float = TIME_LIMIT,
    strategy: str = "auto",
    timeout: float = CHILD_TIMEOUT,
) -> Row:
    """:func:`measure` in a fresh interpreter with the plan cache off.

    Args:
        name: the model's name.
        spec: its factory, ``"module:function"``.
        budget: the budget fraction.
        time_limit: seconds per graph for the strategy.
        strategy: the strategy passed to ``optimize``.
        timeout: seconds the child may take.

    Returns:
        The child's row, or an ``error`` row (the child's last output line) when it died,
        timed out or printed no result.
    """
    env = dict(os.environ, CHECKMATE_CACHE="0")
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "benchmarks.e2e", "--child", name, "--factory", spec]
    cmd += ["--budget", str(budget), "--time-limit", str(time_limit), "--strategy", strategy]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:
        row = Row(name, f"error: the child took more than {timeout:.0f} s", budget, time_limit)
        row.wall_s = time.perf_counter() - t0
        return row
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if not lines:
        tail = [ln for ln in (proc.stdout + proc.stderr).strip().splitlines() if ln.strip()]
        why = tail[-1] if tail else f"exit code {proc.returncode}"
        row = Row(name, f"error: child exited {proc.returncode}: {why}"[:400], budget, time_limit)
        row.wall_s = wall
        return row
    row = row_from_json(lines[-1][len(MARKER) :])
    row.wall_s = wall
    return row


def row_from_json(text: str) -> Row:
    """A row back from the JSON after :data:`MARKER` on a child's or ``main``'s stdout."""
    return _row(json.loads(text))


def _row(doc: dict[str, Any]) -> Row:
    return coerce(doc, Row)


def run(
    models: Sequence[str],
    *,
    budget: float = BUDGET,
    time_limit: float = TIME_LIMIT,
    strategy: str = "auto",
    factories: dict[str, str] | None = None,
    log: Any = sys.stderr,
) -> list[Row]:
    """Each model in its own fresh child, one after the other.

    Args:
        models: names (keys of ``factories``).
        budget: the budget fraction.
        time_limit: seconds per graph for the strategy.
        strategy: the strategy passed to ``optimize``.
        factories: name -> ``"module:function"`` (default :data:`FACTORIES`).
        log: where progress goes.

    Returns:
        One row per model.

    Raises:
        SystemExit: an unknown model name.
    """
    table = FACTORIES if factories is None else factories
    rows = []
    for name in models:
        if name not in table:
            raise SystemExit(f"unknown model {name!r}; choose from {', '.join(table)}")
        row = run_child(name, table[name], budget=budget, time_limit=time_limit, strategy=strategy)
        print(f"  {summary(row)}", file=log, flush=True)
        rows.append(row)
    return rows


def summary(row: Row) -> str:
    """One line: the stage seconds and the verdict, or the error (as in the README)."""
    from benchmarks.tables import e2e_line

    return e2e_line(row)


def write_csv(rows: Sequence[Row], path: Path) -> None:
    """The rows as CSV."""
    write_rows(rows, path, Row)


def read_csv(path: Path) -> list[Row]:
    """Rows back from :func:`write_csv`'s file."""
    return read_rows(path, Row)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


def markdown(rows: Sequence[Row], *, wall_s: float) -> str:
    """The report: settings, the stage table, the memory and gradient table."""
    out = [
        "# End to end: `checkmate.optimize` on the traced models (issue 5)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared with other jobs), Python "
        f"{platform.python_version()}. Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"in {wall_s:.0f} s (`python -m benchmarks.e2e`).",
        "",
        "Each model runs in a fresh process with the plan cache off (`CHECKMATE_CACHE=0`): "
        '`checkmate.optimize(model, budget, (x, y), profile="cpu", time_limit=...)`, strategy '
        "`auto`. Trace = the call's time outside the partitioner (Dynamo, AOTAutograd, the "
        "planning call's forward) plus building the graph model; profile = op costs from the "
        "`cpu` device profile plus scratch-space measurement; solve and codegen from the "
        "planner's records. Target: the whole call within "
        f"{TARGET_SECONDS:.0f} s.",
        "",
        "| model | nodes | budget | time limit | optimize s | trace s | profile s (scratch) | solve s "
        "| codegen s | target |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.status != "ok":
            out.append(
                f"| {r.model} | {r.nodes or ''} | {r.budget_frac:g} | {r.time_limit:g} | "
                f"{'' if r.total_s != r.total_s else f'{r.total_s:.1f}'} | | | | | **missed**: "
                f"{r.status.replace('|', '/')[:200]} |"
            )
            continue
        out.append(
            f"| {r.model} | {r.nodes} | {r.budget_frac:g} | {r.time_limit:g} | {r.total_s:.1f} | "
            f"{r.trace_s:.1f} | {r.profile_s:.1f} ({r.scratch_s:.1f}) | {r.solve_s:.1f} | "
            f"{r.codegen_s:.1f} | {'met' if r.met else '**missed**'} |"
        )
    out += [
        "",
        "One training step each (eager, then the optimized module; same weights and buffers), "
        "peaks measured by `checkmate.memory.measure_peak` (bytes allocated beyond what was live "
        "before the step). Budget = the plan's budget in bytes (sum over graphs); simulated = the "
        "plan's peak in the simulator; overhead = plan cost / no-recompute cost.",
        "",
        "| model | strategy (status) | overhead | recomputes | budget MiB | no-remat sim. MiB "
        "| simulated MiB | measured MiB | measured / budget | eager MiB (/ budget) | grad max abs err "
        "(max abs grad) | step s (eager s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        if r.status != "ok":
            continue
        out.append(
            f"| {r.model} | {r.strategy} ({r.solve_status}) | {r.overhead:.4f}x | {r.recomputes} | "
            f"{_mib(r.budget_bytes)} | {_mib(r.reference_peak)} | {_mib(r.sim_peak)} | "
            f"{_mib(r.measured_peak)} | {r.peak_over_budget:.3f} | {_mib(r.eager_peak)} "
            f"({r.eager_over_budget:.3f}) | {r.grad_err:.2e} ({r.grad_scale:.2e}) | "
            f"{r.step_s:.1f} ({r.eager_step_s:.1f}) |"
        )
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m benchmarks.e2e``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(FACTORIES), help="comma-separated model names")
    ap.add_argument("--budget", type=float, default=BUDGET, help="fraction of the no-remat peak")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per graph for the solver")
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for e2e.csv and e2e.md")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--factory", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one model, in this (fresh) process
        row = measure(
            args.child,
            _load(args.factory),
            budget=args.budget,
            time_limit=args.time_limit,
            strategy=args.strategy,
        )
        print(MARKER + json.dumps(asdict(row)), flush=True)
        return 0
    models = [m for m in args.models.split(",") if m]
    t0 = time.perf_counter()
    rows = run(models, budget=args.budget, time_limit=args.time_limit, strategy=args.strategy)
    write_csv(rows, args.out / "e2e.csv")
    (args.out / "e2e.md").write_text(markdown(rows, wall_s=time.perf_counter() - t0))
    for r in rows:
        print(MARKER + json.dumps(asdict(r)), flush=True)
    print(f"wrote {args.out / 'e2e.csv'} and e2e.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
