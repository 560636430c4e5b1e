"""Reports of :mod:`benchmarks.peers_compile`: CSV, markdown with verdicts, a plot.

Verdicts, per model:

- each ``pt-budget`` point against checkmate planned at that point's measured peak:
  **yes** when checkmate ran, its measured peak is at most ``SAME_MEMORY`` times the point's,
  and it is faster: its median per-pair step-time ratio to the point itself (the two timed in
  alternating pairs, ``Row.vs_point``) is below 1, or, for rows without that, its median
  ratio to the reference is below the point's; otherwise **no** with the reason (no plan,
  failed, more memory, slower; "within the pairs' spread" when the median ratio to the point
  is above 1 by no more than half the ratios' interquartile range: a miss that one run cannot
  tell from a tie);
- checkmate at 1.0 against plain ``torch.compile``: **yes** when its overhead is at most the
  run's noise (:func:`noise`: the larger of 2% and twice the ``compile`` row's |overhead| plus
  its spread; that row is a second plain build timed against the reference).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.csvio import read_rows, write_rows
from benchmarks.peers_report import machine

if TYPE_CHECKING:
    from benchmarks.peers_compile import Config, Row

__all__ = ["RunInfo", "agreement", "markdown", "noise", "plot", "render", "verdicts", "write_all"]

#: how much above the peer's measured peak checkmate's may be and still count as equal memory
SAME_MEMORY = 1.02
#: the least step-time difference counted as more than noise
MIN_NOISE = 0.02


@dataclass(frozen=True)
class RunInfo:
    """Where and how a run was measured (kept beside the CSV, so reports re-render)."""

    command: str
    wall_s: float
    machine: str
    measured_at: str

    @staticmethod
    def now(command: str, wall_s: float, device: str) -> RunInfo:
        where = machine()
        if device.startswith("cuda"):
            import torch

            where = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}); {where}"
        else:
            from benchmarks.heap import describe

            where = f"{where}; {describe()}"
        return RunInfo(command, wall_s, where, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))


def noise(rows: list[Row]) -> float:
    """The step-time noise of one model's run (see the module docstring)."""
    base = next((r for r in rows if r.method == "compile" and r.status == "ok"), None)
    spread = abs(base.spread or 0.0) + abs(base.overhead or 0.0) if base else 0.0
    return max(MIN_NOISE, 2 * spread)


def verdicts(rows: list[Row]) -> list[tuple[str, bool, str]]:
    """(point, met, one line) for each pt-budget point and for checkmate at 1.0."""
    out: list[tuple[str, bool, str]] = []
    cms = {r.target: r for r in rows if r.method == "checkmate"}
    for pt in (r for r in rows if r.method == "pt-budget"):
        head = f"pt {pt.knob}"
        if pt.status != "ok" or pt.peak is None:
            out.append((head, False, f"{head}: not measured ({pt.status})"))
            continue
        desc = f"{head} ({pt.peak / 2**20:.2f} MiB, {_pct(pt.overhead)})"
        cm = cms.get(head)
        if cm is None:
            out.append((head, False, f"{desc}: no checkmate row"))
            continue
        if cm.status != "ok" or cm.peak is None:
            out.append((head, False, f"{desc}: checkmate {cm.status}"))
            continue
        ratio = cm.peak / pt.peak
        same = ratio <= SAME_MEMORY
        if cm.vs_point is not None:
            faster = cm.vs_point < 0.0
            direct = f"; against the point directly {_pct(cm.vs_point)} ±{100 * (cm.vs_spread or 0):.1f}"
        else:
            faster = (cm.overhead or 0.0) < (pt.overhead or 0.0)
            direct = ""
        why = [] if same else [f"measured peak {ratio:.3f}x the point's"]
        if not faster:
            tie = cm.vs_point is not None and cm.vs_point - (cm.vs_spread or 0.0) <= 0.0
            why.append("slower, within the pairs' spread" if tie else "slower")
        line = f"{desc} vs checkmate ({cm.peak / 2**20:.2f} MiB = {ratio:.3f}x, {_pct(cm.overhead)}{direct})"
        out.append((head, same and faster, line + (f": {', '.join(why)}" if why else "")))
    one = cms.get("1.0")
    if one is not None:
        tol = noise(rows)
        if one.status != "ok":
            out.append(("1.0", False, f"checkmate 1.0: {one.status}"))
        else:
            ok = (one.overhead or 0.0) <= tol
            out.append(
                (
                    "1.0",
                    ok,
                    f"checkmate 1.0 vs plain torch.compile: {_pct(one.overhead)} (noise {100 * tol:.1f}%)"
                    + ("" if ok else ": slower"),
                )
            )
    return out


#: how far a checkmate row's planned overhead may be from its measured one and agree
AGREE = 0.03


def _at_one(rows: list[Row]) -> Row | None:
    """checkmate's row at the fraction 1.0, where it ran."""
    return next((r for r in rows if r.method == "checkmate" and r.target == "1.0" and r.status == "ok"), None)


def agreement(rows: list[Row]) -> tuple[int, int, list[str]]:
    """(rows agreeing, rows compared, one line each): each checkmate row's planned overhead
    against its step measured over checkmate's row at the fraction ``1.0`` (its keep-all plan,
    or the least recomputing one that fits), both taken relative to that row's: planned
    ``(1 + planned) / (1 + its planned) - 1``, measured ``(1 + overhead) / (1 + its overhead) - 1``,
    the overheads being the rows' paired medians against the reference.

    A plan's planned overhead is its cost over the graph's total cost, each op computed once:
    what the keep-all plan runs. Plain ``torch.compile`` is not that step: its partitioner
    recomputes fusible ops in the backward (a GPT-2's tanh-GELUs), so compared with the
    reference a plan's planned overhead is off by the keep-all plan's own. No such row:
    nothing compared."""
    base = _at_one(rows)
    if base is None or base.overhead is None or base.planned is None:
        return 0, 0, []
    met, lines = 0, []
    for r in rows:
        if (
            r is base
            or r.method != "checkmate"
            or r.status != "ok"
            or r.overhead is None
            or r.planned is None
        ):
            continue
        planned = (1 + r.planned) / (1 + base.planned) - 1
        measured = (1 + r.overhead) / (1 + base.overhead) - 1
        ok = abs(measured - planned) <= AGREE
        met += ok
        lines.append(
            f"- {r.target}: planned {_pct(planned)}, measured {_pct(measured)}"
            + ("" if ok else f" (**{100 * abs(measured - planned):.1f} points apart**)")
        )
    return met, len(lines), lines


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _err(x: float | None) -> str:
    return "-" if x is None else ("0" if x == 0 else f"{x:.1e}")


def _cells(r: Row, verdict: dict[str, bool]) -> list[str]:
    point = f"pt {r.knob}" if r.method == "pt-budget" else r.target
    mark = {True: "yes", False: "**no**"}.get(verdict.get(point), "") if r.method == "checkmate" else ""  # type: ignore[arg-type]
    if r.status != "ok":
        return [
            r.method,
            r.knob or "-",
            r.target or "-",
            r.status,
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            "",
            mark or "**no**",
        ]
    over_budget = f" ({r.peak / r.budget:.3f}x)" if r.budget and r.peak else ""
    return [
        r.method,
        r.knob or "-",
        r.target or "-",
        f"{(r.peak or 0) / 2**20:.2f}{over_budget}",
        f"{r.peak_frac:.2f}" if r.peak_frac is not None else "-",
        f"{1e3 * (r.step_s or 0):.2f}",
        f"{_pct(r.overhead)} ±{100 * (r.spread or 0):.1f}",
        f"{_pct(r.vs_point)} ±{100 * (r.vs_spread or 0):.1f}" if r.vs_point is not None else "-",
        _pct(r.planned),
        f"{_err(r.grad_rel)}" + ("" if r.grads_ok else " **over**"),
        _err(r.buffer_err),
        str(r.graphs if r.graphs is not None else "-"),
        f"{r.first_s:.1f}" if r.first_s is not None else "-",
        mark,
    ]


def markdown(rows: list[Row], cfg: Config, info: RunInfo) -> str:
    """The report: machine, settings, one table per model, its verdicts."""
    timing = (
        "wall time between `torch.cuda.synchronize()`s"
        if cfg.device.startswith("cuda")
        else "process CPU time (one torch thread)"
    )
    out = [
        "# checkmate + Inductor beside torch.compile's activation_memory_budget (measured)",
        "",
        f"Machine: {info.machine}. Measured {info.measured_at}, `{info.command}`, {info.wall_s / 60:.1f} min.",
        "",
        f"One training step = forward + loss + backward on {cfg.device}, the same weights and batch for every "
        "method; the loss is inside every compiled graph. Reference: `torch.compile` (Inductor, no budget). "
        "Peak = bytes allocated during the step beyond what was live before (`checkmate.memory.measure_peak`); "
        "'of ref' = over the reference's peak; for checkmate rows planned in bytes, the measured peak over "
        f"that budget in parentheses. Step = median {timing} over {cfg.pairs} steps alternating with the "
        "reference; overhead = median per-pair ratio - 1 (± half the ratios' interquartile range); the "
        "`compile` row is a second plain build, its overhead the noise floor. Vs point = for checkmate "
        "planned at a pt-budget point, the median per-pair ratio of its step to that point's - 1, the two "
        "timed in alternating pairs (same ±). Planned = checkmate's plans' "
        "cost / the graphs' total cost - 1 (each op once: what its keep-all plan runs; compared "
        "below over the 1.0 row, planned and measured). Grad err = max abs gradient difference from the reference after "
        f"one step from the same state / max |gradient| (tolerance {cfg.grad_tol:g}); buffer err = max abs "
        "difference of buffers (BatchNorm statistics). pt-budget = `torch._functorch.config."
        "activation_memory_budget`, compiled from a reset Dynamo with Inductor's FX-graph and AOTAutograd "
        f'caches off. checkmate: `compiler="inductor"`, strategy `{cfg.strategy}`, {cfg.time_limit:g} s per '
        "plan, budget = the named point's measured peak in bytes, or the fraction 1.0. First = build + "
        "compile (+ plan) + one step, s. Verdict (checkmate rows): faster than the point at "
        f"equal measured memory (≤ {SAME_MEMORY:g}x its peak), by `vs point`; at 1.0, no slower than plain torch.compile "
        "within the noise.",
        "",
    ]
    for model in dict.fromkeys(r.model for r in rows):
        mrows = [r for r in rows if r.model == model]
        vs = verdicts(mrows)
        verdict = {point: met for point, met, _ in vs}
        out += [f"## {model}", ""]
        out.append(
            "| method | knob | planned at | peak MiB | of ref | step ms | overhead | vs point | planned | "
            "grad err | buffer err | graphs | first s | verdict |"
        )
        out.append("|" + "---|" * 14)
        out += ["| " + " | ".join(_cells(r, verdict)) + " |" for r in mrows]
        ref_s = next((r.ref_s for r in mrows if r.ref_s), None)
        if ref_s:
            out += ["", f"Reference step: {1e3 * ref_s:.2f} ms (median)."]
        met = sum(m for _, m, _ in vs)
        out += ["", f"Verdicts: {met} of {len(vs)} met.", ""]
        out += [f"- {'yes' if m else '**no**'}: {line}" for _, m, line in vs]
        agree, compared, lines = agreement(mrows)
        if compared:
            base = _at_one(mrows)
            assert base is not None  # agreement compared rows over it
            out += [
                "",
                f"Planned vs measured, over checkmate at 1.0 (planned {_pct(base.planned)}, measured "
                f"{_pct(base.overhead)} against the reference): within {100 * AGREE:g} points at {agree} of "
                f"{compared}.",
                "",
                *lines,
            ]
        notes = [f"- {r.label} ({r.knob}): {r.note}" for r in mrows if r.note]
        if notes:
            out += ["", "checkmate plans:", "", *notes]
        out.append("")
    return "\n".join(out)


def plot(rows: list[Row], path: Path) -> None:
    """Step-time overhead against measured peak, one panel per model, one series per method.

    The overhead is each row's median ratio to plain ``torch.compile`` in alternating pairs,
    not its raw median: raw medians taken minutes apart drift with the machine's load (on the
    2-core CPU by up to 10% over a run), more than the differences plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(6.0 * len(models), 4.6), squeeze=False)
    styles = {
        "compile": ("k", "*", "torch.compile"),
        "pt-budget": ("tab:orange", "o", "torch.compile + activation_memory_budget"),
        "checkmate": ("tab:blue", "D", "checkmate (Inductor)"),
    }
    for ax, model in zip(axes[0], models, strict=True):
        mrows = [
            r for r in rows if r.model == model and r.status == "ok" and r.peak and r.overhead is not None
        ]
        for method, (color, marker, label) in styles.items():
            pts = sorted(
                (r.peak / 2**20, 100 * (r.overhead or 0.0), r.knob if method == "pt-budget" else r.target)
                for r in mrows
                if r.method == method
            )
            if not pts:
                continue
            xs, ys, _ = zip(*pts, strict=True)
            ax.plot(xs, ys, color=color, marker=marker, label=label, linestyle="-" if len(xs) > 1 else "")
            if method != "compile":
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.axhline(0.0, color="k", linewidth=0.8, linestyle=":", label="plain torch.compile (the reference)")
        failed = [r for r in rows if r.model == model and r.method == "checkmate" and r.status != "ok"]
        for r in failed:
            if r.budget:
                ax.axvline(r.budget / 2**20, color="tab:blue", linestyle=":", linewidth=1)
        if any(r.budget for r in failed):
            ax.plot([], [], color="tab:blue", linestyle=":", label="checkmate: no run at this budget")
        ax.set_title(model)
        ax.set_xlabel("measured peak (MiB)")
        ax.set_ylabel("step time over plain torch.compile (%, paired median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Step-time overhead against measured peak memory (lower left is better)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(rows: list[Row], cfg: Config, out: Path, prefix: str, info: RunInfo) -> list[Path]:
    """Write ``<prefix>.csv``, ``.json`` (run info and config), ``.md`` and ``.png`` under ``out``."""
    from benchmarks.peers_compile import Row

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{prefix}.{ext}" for ext in ("csv", "json", "md", "png")]
    write_rows(rows, paths[0], Row)
    paths[1].write_text(json.dumps({"run": asdict(info), "config": asdict(cfg)}, indent=1) + "\n")
    paths[2].write_text(markdown(rows, cfg, info))
    plot(rows, paths[3])
    return paths


def render(out: Path, prefix: str) -> list[Path]:
    """Re-render ``<prefix>.md`` and ``.png`` from a run's CSV and JSON (no measuring)."""
    from benchmarks.peers_compile import Config, Row

    missing = [p.name for p in (out / f"{prefix}.csv", out / f"{prefix}.json") if not p.exists()]
    if missing:
        raise SystemExit(f"cannot re-render: {', '.join(missing)} not in {out}; run the benchmark first")
    rows = read_rows(out / f"{prefix}.csv", Row)
    meta = json.loads((out / f"{prefix}.json").read_text())
    conf: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in meta["config"].items()}
    cfg = Config(**conf)
    info = RunInfo(**meta["run"])
    paths = [out / f"{prefix}.md", out / f"{prefix}.png"]
    paths[0].write_text(markdown(rows, cfg, info))
    plot(rows, paths[1])
    return paths
