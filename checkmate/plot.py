"""Pictures of plans: the R and S matrices with memory over the schedule, and Pareto curves.

The matrix view follows the Checkmate paper (Jain et al., MLSys 2020, Fig. 1 and 5): rows
are stages, columns are nodes in topological order; ``R[t, i]`` marks node i computed in
stage t (the diagonal is the frontier, entries left of it are recomputations), ``S[t, i]``
marks node i's output held in memory when stage t starts. matplotlib is imported here only,
with the non-interactive Agg backend, so neither the CLI nor ``solvers`` needs it to start.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from solvers.budget import format_bytes
from solvers.graph import Graph
from solvers.plan import stage_matrices
from solvers.schedule import Schedule, simulate

__all__ = ["plan_figure", "pareto_figure"]

_DPI = 120


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _unit(max_bytes: float) -> tuple[float, str]:
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if max_bytes >= scale:
            return float(scale), name
    return 1.0, "B"


def plan_figure(
    graph: Graph,
    schedule: Schedule,
    budget: int | None,
    path: str | os.PathLike[str],
    *,
    title: str = "",
) -> Path:
    """Draw R, S and the memory timeline of ``schedule`` into one PNG.

    Args:
        graph: the graph the schedule runs on.
        schedule: the schedule; its (R, S) when it has them, else stages derived from its
            steps (see :func:`solvers.plan.stage_matrices`).
        budget: bytes, drawn as a horizontal line (None: no line).
        path: the PNG to write (atomically).
        title: the figure's title.

    Returns:
        The path written.

    Raises:
        ScheduleError: the schedule does not replay on ``graph``.
    """
    plt = _pyplot()
    sim = simulate(graph, schedule)
    R, S = stage_matrices(graph, schedule)
    fig = plt.figure(figsize=(13, 4.6))
    grid = fig.add_gridspec(1, 3, width_ratios=[1, 1, 1.5], wspace=0.28)
    axes = [fig.add_subplot(grid[0, k]) for k in range(3)]
    for ax, M, name, cmap in (
        (axes[0], R, "R: computed in stage", "Blues"),
        (axes[1], S, "S: held at stage start", "Oranges"),
    ):
        ax.imshow(M.astype(np.float32), cmap=cmap, vmin=0, vmax=1.15, interpolation="nearest", aspect="auto")
        ax.set_title(f"{name} ({int(M.sum())} entries)", fontsize=10)
        ax.set_xlabel("node (topological order)")
        ax.set_ylabel("stage")
        nb = int(graph.backward_mask.sum())
        if 0 < nb < graph.n:  # the forward / backward boundary
            ax.axvline(graph.n - nb - 0.5, color="0.6", lw=0.8, ls=":")
    ax = axes[2]
    steps = np.arange(len(sim.timeline))
    top = max(int(sim.timeline.max(initial=0)), budget or 0, 1)
    scale, unit = _unit(top)
    ax.fill_between(steps, sim.timeline / scale, step="post", color="tab:blue", alpha=0.35, lw=0)
    ax.step(steps, sim.timeline / scale, where="post", color="tab:blue", lw=1.0, label="memory in use")
    if budget:
        ax.axhline(budget / scale, color="tab:red", ls="--", lw=1.2, label=f"budget {format_bytes(budget)}")
    if sim.peak_step >= 0:
        ax.plot(
            [sim.peak_step],
            [sim.peak / scale],
            "v",
            color="black",
            ms=7,
            label=f"peak {format_bytes(sim.peak)}",
        )
    ax.set_xlabel("schedule step")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_ylim(0, top / scale * 1.1)
    ax.set_title(
        f"memory over the schedule: cost {sim.cost / graph.total_cost:.4f}x, {sim.recomputes} recomputes"
        if graph.total_cost
        else "memory over the schedule",
        fontsize=10,
    )
    ax.legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def pareto_figure(
    rows: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    title: str = "",
    x: str = "budget_fraction",
    xlabel: str = "budget (fraction of the checkpoint-all peak)",
    ylabel: str = "overhead (cost / no-recompute cost)",
    marks: Sequence[tuple[str, float, float]] = (),
) -> Path:
    """Overhead (cost / no-recompute cost) against budget, one line per strategy.

    Args:
        rows: sweep rows with keys ``strategy``, ``status``, ``overhead`` (None without a
            schedule) and the budget under the key ``x``.
        path: the PNG to write (atomically).
        title: the figure's title.
        x: the rows' key of the budget axis (``budget_fraction``, or e.g. GiB).
        xlabel: the budget axis' label.
        ylabel: the overhead axis' label.
        marks: single plans drawn as labelled points, ``(label, x, overhead)`` (e.g. no
            rematerialization and per-layer checkpointing on the same graph).

    Returns:
        The path written. Budgets without a schedule are drawn as crosses on the
        axis, labelled with their status.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    strategies = list(dict.fromkeys(str(r["strategy"]) for r in rows))
    markers = "osD^v<>ph*"
    ok_y = [float(r["overhead"]) for r in rows if r.get("overhead") is not None]
    ok_y += [float(m[2]) for m in marks]
    lo, hi = min([1.0, *ok_y]), max([1.0, *ok_y])
    # budgets without a schedule sit on a line of their own, below every real point
    fail_y = lo - 0.08 * max(hi - lo, 0.02)
    failed_any = False
    for k, name in enumerate(strategies):
        color = f"C{k % 10}"
        mine = [r for r in rows if r["strategy"] == name]
        pts = sorted((float(r[x]), float(r["overhead"])) for r in mine if r.get("overhead") is not None)
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker=markers[k % len(markers)], color=color, lw=1.3, label=name)
        bad = [float(r[x]) for r in mine if r.get("overhead") is None]
        if bad:
            failed_any = True
            ax.scatter(
                bad, [fail_y] * len(bad), marker="x", s=55, color=color, zorder=5, label=None if pts else name
            )
    if failed_any:
        ax.axhline(fail_y, color="0.7", lw=0.6, ls=":")
        statuses = sorted({str(r["status"]) for r in rows if r.get("overhead") is None})
        ax.annotate(
            "x: no schedule (" + ", ".join(statuses) + ")",
            (0.01, fail_y),
            xycoords=("axes fraction", "data"),
            xytext=(0, 4),
            textcoords="offset points",
            fontsize=8,
            color="0.3",
        )
    for j, (label, mx, my) in enumerate(marks):
        color = f"C{(len(strategies) + j) % 10}"
        ax.scatter(
            [mx], [my], marker="*^sD"[j % 4], s=130, color=color, edgecolor="black", zorder=6, label=label
        )
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.invert_xaxis()  # tighter budgets to the right
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "overhead against budget", fontsize=11)
    return _save(fig, path)


def _save(fig: Any, path: str | os.PathLike[str]) -> Path:
    import io

    plt = _pyplot()
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    finally:
        plt.close(fig)
    out = Path(path)
    _atomic_write_bytes(out, buf.getvalue())
    return out


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    # atomic_write_text's temp+rename, for bytes: a reader never sees half a PNG.
    import tempfile

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)  # mkstemp makes 0600; users expect their umask
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
