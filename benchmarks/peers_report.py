"""Reports of :mod:`benchmarks.peers`: CSV, a markdown table with the machine, a Pareto plot.

The markdown closes each model with a comparison at equal memory: for every other method's
point, the checkmate run planned at that point's measured peak, and whether checkmate is
ahead there (its measured peak no higher than 2% above, and less extra time). Points where
it is not ahead are listed like the others.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.csvio import read_rows, write_rows

if TYPE_CHECKING:
    from benchmarks.peers import Config, Row

__all__ = ["RunInfo", "machine", "markdown", "plot", "read_csv", "render", "write_all", "write_csv"]

#: how much higher than the peer's peak checkmate's measured peak may be and still count
#: as "the same memory" (the tracker and the planner round differently)
SAME_MEMORY = 1.02


def machine() -> str:
    """CPU model, core count, torch version: what the figures were measured on."""
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    try:
        import transformers

        tf = f", transformers {transformers.__version__}"
    except ImportError:
        tf = ""
    return (
        f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s); "
        f"torch {torch.__version__}{tf}; Python {platform.python_version()}"
    )


def write_csv(rows: list[Row], path: Path) -> None:
    """One line per row, every field."""
    from benchmarks.peers import Row

    write_rows(rows, path, Row)


def _fmt_err(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.1e}"


def _cells(r: Row) -> list[str]:
    if r.status != "ok":
        return [r.method, r.knob or "-", r.target or "-", r.status, "", "", "", "", "", ""]
    drop = "-" if r.dropout_equal is None else ("yes" if r.dropout_equal else "**no**")
    if r.dropout_err is not None:
        drop += f" ({_fmt_err(r.dropout_err)})"
    return [
        r.method,
        r.knob or "-",
        r.target or "-",
        f"{(r.peak or 0) / 2**20:.2f}",
        f"{r.peak_frac:.2f}",
        f"{100 * (r.overhead or 0):+.1f}% ({100 * (r.wall_overhead or 0):+.0f}%)",
        _fmt_err(r.grad_err),
        _fmt_err(r.buffer_err),
        drop,
        f"{r.first_s:.1f}" if r.first_s is not None else "-",
    ]


def _comparison(rows: list[Row]) -> list[str]:
    """Checkmate against each peer point at that point's measured peak."""
    cms = [r for r in rows if r.method == "checkmate"]
    lines = []
    for peer in rows:
        if peer.method in ("eager", "checkmate", "rockmate") or peer.status != "ok" or peer.peak is None:
            continue
        label = peer.label
        cm = next((c for c in cms if label in c.target.split(", ")), None)
        head = f"- {label}: {peer.peak / 2**20:.2f} MiB, {100 * (peer.overhead or 0):+.1f}% time"
        if cm is None:
            lines.append(head + " -> no checkmate run at this peak")
            continue
        if cm.status != "ok" or cm.peak is None:
            lines.append(head + f" -> checkmate: {cm.status.split(':')[0]}. **Not ahead.**")
            continue
        same_mem = cm.peak <= SAME_MEMORY * peer.peak
        faster = (cm.overhead or 0) < (peer.overhead or 0)
        verdict = "ahead" if same_mem and faster else "**not ahead**"
        why = []
        ratio = cm.peak / peer.peak
        if not same_mem:
            why.append(f"measured peak {ratio:.2f}x the peer's")
        if not faster:
            why.append("slower" + (f", at {ratio:.2f}x the peer's memory" if same_mem else ""))
        lines.append(
            head + f" -> checkmate {cm.peak / 2**20:.2f} MiB, {100 * (cm.overhead or 0):+.1f}% time: "
            f"{verdict}" + (f" ({', '.join(why)})" if why else "")
        )
    return lines


@dataclass(frozen=True)
class RunInfo:
    """Where and how a run was measured (kept beside the CSV, so reports re-render)."""

    command: str
    wall_s: float
    machine: str
    measured_at: str

    @staticmethod
    def now(command: str, wall_s: float) -> RunInfo:
        return RunInfo(command, wall_s, machine(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def markdown(rows: list[Row], cfg: Config, info: RunInfo) -> str:
    """The report: machine, settings, one table per model, the equal-memory comparison."""
    from benchmarks.peers import workloads

    shapes = {wl.name: wl.shape for wl in workloads(cfg)}
    out = [
        "# checkmate beside its peers (measured)",
        "",
        f"Machine: {info.machine}. Measured {info.measured_at}, `{info.command}`, {info.wall_s / 60:.1f} min.",
        "",
        "One training step = forward + loss + backward on CPU, same weights and batch for every method. "
        "Peak = bytes allocated during the step beyond what was live before it "
        "(`checkmate.memory.measure_peak`, the same dispatch-mode tracker for every method). "
        f"Step-time overhead = median over {cfg.steps} steps alternating with the reference eager model "
        "of the per-pair ratio of CPU time (process time: with one torch thread this is the step's own "
        "work, not the time the shared machine gave to other processes), minus 1; wall-clock in "
        "parentheses. The eager row times a second eager model, so its overhead is the noise floor "
        "of this run. Errors are the max abs "
        "difference from eager after one step from the same state (gradients; buffers = BatchNorm "
        f"running statistics). Dropout: every dropout at p={cfg.dropout}, the same seed before the "
        "step; 'yes' = gradients equal eager's within rounding (the number is the max abs difference). "
        f"checkmate: strategy `{cfg.strategy}`, {cfg.time_limit:g} s per plan, budget in bytes = the "
        "measured peak of the method named (with dropout, the same fraction of eager's dropout peak). "
        "Knob: pt-budget = `torch._functorch.config.activation_memory_budget`; checkmate = its budget in bytes. "
        "First step = build + compile/plan + one step (checkmate's plan cache may shorten it on a rerun).",
        "",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        mrows = [r for r in rows if r.model == model]
        out += [f"## {model}: {shapes.get(model, '')}", ""]
        out.append(
            "| method | knob | budget = peak of | peak MiB | of eager | step-time overhead | max grad err | "
            "max buffer err | dropout grads equal | first step s |"
        )
        out.append("|" + "---|" * 10)
        out += ["| " + " | ".join(_cells(r)) + " |" for r in mrows]
        eager = next((r for r in mrows if r.method == "eager" and r.step_s), None)
        if eager is not None:
            out += ["", f"Eager step: {eager.eager_s:.3f} s CPU, {eager.eager_wall_s:.3f} s wall (medians)."]
        notes = [
            f"- {r.knob} (= {r.target}): {r.note}"
            + (f"; measured peak {r.peak / r.budget:.3f}x the budget" if r.peak and r.budget else "")
            for r in mrows
            if r.note
        ]
        if notes:
            out += ["", "checkmate plans:", "", *notes]
        differ = [r.label for r in mrows if r.dropout_equal is False]
        same = [r.label for r in mrows if r.dropout_equal is True]
        if differ or same:
            out += [
                "",
                "Dropout: gradients equal eager's for "
                + (", ".join(same) or "none")
                + "; **differ** for "
                + (", ".join(differ) or "none")
                + ".",
            ]
        comp = _comparison(mrows)
        if comp:
            out += ["", "At equal memory (checkmate planned at each point's measured peak):", "", *comp]
        out.append("")
    return "\n".join(out)


def plot(rows: list[Row], path: Path) -> None:
    """Overhead against measured peak (fraction of eager), one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    styles = {
        "eager": ("k", "*"),
        "checkpoint": ("tab:green", "s"),
        "pt-budget": ("tab:orange", "o"),
        "checkmate": ("tab:blue", "D"),
    }
    for ax, model in zip(axes[0], models, strict=True):
        mrows = [r for r in rows if r.model == model]
        for method, (color, marker) in styles.items():
            # in knob order (budget falling), so a curve that turns back shows as one
            pts = [
                (r.peak_frac, 100 * r.overhead, r.knob)
                for r in mrows
                if r.method == method
                and r.status == "ok"
                and r.peak_frac is not None
                and r.overhead is not None
            ]
            if pts:
                xs, ys, _ = zip(*pts, strict=True)
                ax.plot(
                    xs, ys, color=color, marker=marker, label=method, linestyle="-" if len(xs) > 1 else ""
                )
            if method == "pt-budget":
                for x, y, knob in pts:
                    ax.annotate(knob, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        failed = [r for r in mrows if r.method == "checkmate" and r.status != "ok" and r.budget]
        eager_peak = next((r.peak / r.peak_frac for r in mrows if r.peak and r.peak_frac), None)
        for r in failed:
            if eager_peak:
                ax.axvline((r.budget or 0) / eager_peak, color="tab:blue", linestyle=":", linewidth=1)
        if failed:
            ax.plot([], [], color="tab:blue", linestyle=":", label="checkmate: no plan at this budget")
        ax.set_title(model)
        ax.set_xlabel("measured peak / eager peak")
        ax.set_ylabel("step-time overhead vs eager (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Extra step time against measured peak memory (lower left is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(rows: list[Row], cfg: Config, out: Path, prefix: str, info: RunInfo) -> list[Path]:
    """Write ``<prefix>.csv``, ``.json`` (run info and config), ``.md`` and ``.png`` under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{prefix}.{ext}" for ext in ("csv", "json", "md", "png")]
    write_csv(rows, paths[0])
    paths[1].write_text(json.dumps({"run": asdict(info), "config": asdict(cfg)}, indent=1) + "\n")
    paths[2].write_text(markdown(rows, cfg, info))
    plot(rows, paths[3])
    return paths


def read_csv(path: Path) -> list[Row]:
    """Rows back from :func:`write_csv` (types from the dataclass's annotations)."""
    from benchmarks.peers import Row

    return read_rows(path, Row)


def render(out: Path, prefix: str) -> list[Path]:
    """Re-render ``<prefix>.md`` and ``.png`` from a run's CSV and JSON (no measuring)."""
    from benchmarks.peers import Config

    missing = [p.name for p in (out / f"{prefix}.csv", out / f"{prefix}.json") if not p.exists()]
    if missing:
        raise SystemExit(f"cannot re-render: {', '.join(missing)} not in {out}; run the benchmark first")
    rows = read_csv(out / f"{prefix}.csv")
    meta = json.loads((out / f"{prefix}.json").read_text())
    conf: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
    cfg = Config(**conf)
    info = RunInfo(**meta["run"])
    paths = [out / f"{prefix}.md", out / f"{prefix}.png"]
    paths[0].write_text(markdown(rows, cfg, info))
    plot(rows, paths[1])
    return paths
