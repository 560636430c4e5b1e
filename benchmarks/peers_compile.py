"""``make bench-peers-compile``: checkmate with Inductor beside ``torch.compile``'s own budget.

Every method trains the same model (one ``state_dict`` copied into a fresh build per
method; the same batch) for one step = forward + loss + backward, in one run, per model:

1. ``compile``: ``torch.compile`` (Inductor, no budget) of the model and its loss. The first
   such build is the *reference* every row is timed and compared against; the ``compile``
   row is a second build timed against it, so its overhead is the run's noise floor.
2. ``pt-budget``: ``torch.compile`` (Inductor) with
   ``torch._functorch.config.activation_memory_budget`` at each of ``--budgets``; each
   compile starts from a reset Dynamo, with Inductor's FX-graph cache and AOTAutograd's
   cache off (see :func:`benchmarks.peer_methods.prepare_inductor`).
3. ``checkmate``: ``checkmate.optimize(..., compiler="inductor")`` at the measured peak
   (bytes) of each ``pt-budget`` row, and at the fraction 1.0: every PyTorch point has a
   checkmate row at the same memory.

Measured per row: the peak bytes allocated during a step beyond what was live before it
(:func:`checkmate.memory.measure_peak`: the CUDA caching allocator's peak on CUDA, the
profiler's allocator events on CPU); the step time as the median over ``--pairs`` steps
alternating with the reference (which one runs first alternates too); overhead = median of
the per-pair ratios - 1, so drifting load cancels (on CUDA wall time between synchronizes;
on CPU the process's CPU time with one torch thread, on a C heap that keeps what it
allocates, :mod:`benchmarks.heap`, unless ``--heap default``); for checkmate rows the planned
overhead = the plans' cost / the graphs' total cost - 1 (:func:`checkmate.plans_of`); and
the max abs gradient and buffer difference from the reference after one step from the same
state, relative to the reference's largest gradient, checked against ``--grad-tol``.

Verdicts (in the markdown): for each pt-budget point, whether checkmate planned at its
measured peak is faster at equal measured memory (its peak at most ``SAME_MEMORY`` times the
point's; faster by ``vs_point``, the median ratio of the two timed against each other in
alternating pairs: the point's build is kept, and checkmate's is made without resetting
Dynamo, so that the point's compiled graph stays the one that runs); and whether checkmate
at 1.0 is no slower than plain ``torch.compile`` (within the run's noise). A miss says which
condition failed.

Outputs under ``--out``: ``peers_compile.csv`` (every field), ``.json`` (command, machine,
config), ``.md`` and ``.png`` (step time against measured peak, one panel per model, one
series per method).

Usage::

    python -m benchmarks.peers_compile --device cuda          # the three models, GPU sizes
    python -m benchmarks.peers_compile --device cpu --quick --models resnet --budgets 0.4,1.0
    python -m benchmarks.peers_compile --render --out DIR     # redo .md/.png from .csv/.json
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import nn

from benchmarks.models import Workload, gpt2_workload, llama_workload, resnet_workload
from benchmarks.peer_methods import ReferenceLoss, Step, prepare_checkmate, prepare_inductor
from checkmate.memory import measure_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BUDGETS = (0.2, 0.4, 0.6, 0.8, 1.0)
MODELS = ("gpt2", "llama", "resnet")

T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    """What one run measures."""

    models: tuple[str, ...] = MODELS
    device: str = "cuda"
    size: str = "quick"  # quick: GPU sizes; tiny: a CPU check
    budgets: tuple[float, ...] = BUDGETS
    pairs: int = 20
    warmup: int = 2
    time_limit: float = 5.0
    strategy: str = "auto"
    grad_tol: float = 1e-3
    seed: int = 0


#: the default tolerance on CUDA: cuDNN runs convolutions in TF32 by default, so two builds that
#: pick different algorithms differ by about 1e-3 of the largest gradient (an H100, the ResNet-like
#: CNN: PyTorch's own budget 0.5 at 7.3e-4, checkmate's 1.0 at 1.0e-3)
CUDA_GRAD_TOL = 3e-3


@dataclass
class Row:
    """One method at one knob on one model; ``status`` is ``ok`` or says why not."""

    model: str
    method: str  # compile | pt-budget | checkmate
    knob: str
    target: str = ""  # checkmate: the point it is planned at ("pt 0.4", "1.0")
    status: str = "ok"
    budget: int | None = None  # checkmate: bytes asked (None for a fraction)
    peak: int | None = None
    peak_frac: float | None = None  # of the reference's peak
    step_s: float | None = None
    ref_s: float | None = None
    overhead: float | None = None
    spread: float | None = None  # half the interquartile range of the per-pair ratios
    planned: float | None = None  # checkmate: planned overhead
    vs_point: float | None = None  # checkmate at a pt point: median per-pair ratio to it - 1
    vs_spread: float | None = None  # half the interquartile range of those ratios
    grad_err: float | None = None
    grad_rel: float | None = None
    buffer_err: float | None = None
    grads_ok: bool | None = None
    graphs: int | None = None  # graphs Dynamo compiled (checkmate: plans)
    first_s: float | None = None
    note: str = ""

    @property
    def label(self) -> str:
        if self.method == "pt-budget":
            return f"pt {self.knob}"
        return f"checkmate {self.target}" if self.method == "checkmate" else self.method


@dataclass
class Reference:
    """The no-budget ``torch.compile`` build everything is timed and compared against."""

    state: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    model: nn.Module
    step: Step
    peak: int = 0
    scale: float = 1.0  # largest |gradient|
    first_s: float = 0.0
    graphs: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- measurement


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(model: nn.Module, step: Step, device: str) -> float:
    """Seconds of one step: wall between synchronizes on CUDA, process CPU time on CPU."""
    model.zero_grad(set_to_none=True)
    cuda = device.startswith("cuda")
    _sync(device)
    t0 = time.perf_counter() if cuda else time.process_time()
    step().backward()
    _sync(device)
    return (time.perf_counter() if cuda else time.process_time()) - t0


def alternating(mine: Callable[[], T], theirs: Callable[[], T], n: int) -> tuple[list[T], list[T]]:
    """``n`` results of each of ``mine()`` and ``theirs()``, called in pairs whose order
    alternates (so neither is always the one that runs after the other)."""
    a: list[T] = []
    b: list[T] = []
    for i in range(n):
        if i % 2:
            a.append(mine())
            b.append(theirs())
        else:
            b.append(theirs())
            a.append(mine())
    return a, b


def ratio_spread(mine: Sequence[float], theirs: Sequence[float]) -> tuple[float, float]:
    """(median per-pair ratio ``mine / theirs``, half the ratios' interquartile range)."""
    ratios = sorted(a / b for a, b in zip(mine, theirs, strict=True))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return statistics.median(ratios), (q[2] - q[0]) / 2


def _paired(
    model: nn.Module, step: Step, other: tuple[nn.Module, Step], n: int, device: str
) -> tuple[float, float, float, float]:
    """(median step s, median ``other`` s, median per-pair ratio, half the ratios' IQR)."""
    mine, theirs = alternating(lambda: _timed(model, step, device), lambda: _timed(*other, device), n)
    return statistics.median(mine), statistics.median(theirs), *ratio_spread(mine, theirs)


def _after_step(
    model: nn.Module, step: Step, state: dict[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], ...]:
    """(grads, buffers) after one step from ``state``."""
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    step().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    model.load_state_dict(state)
    return grads, buffers


def _max_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Max abs difference over every tensor of ``ref`` (inf when one is missing)."""
    worst = 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            return float("inf")
        worst = max(worst, float((g.double() - r.double()).abs().max())) if r.numel() else worst
    return worst


def _peak(model: nn.Module, step: Step) -> int:
    model.zero_grad(set_to_none=True)
    gc.collect()
    peak = measure_peak(lambda: step().backward())
    model.zero_grad(set_to_none=True)
    return peak


def _graphs() -> int:
    """Graphs Dynamo has captured in this process (a running count: take differences)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _fresh(wl: Workload, state: dict[str, torch.Tensor]) -> nn.Module:
    model = wl.build(0.0)
    model.load_state_dict(state)
    return model


def reference(wl: Workload, cfg: Config) -> Reference:
    """The reference: ``torch.compile`` with no budget, its gradients, buffers and peak."""
    torch._dynamo.reset()
    state = copy.deepcopy(wl.build(0.0).state_dict())
    model = _fresh(wl, state)
    t0, g0 = time.perf_counter(), _graphs()
    step = prepare_inductor(None, ReferenceLoss)(model, wl)  # its own graph after every reset
    first = time.perf_counter() - t0
    ref = Reference(state, {}, {}, model, step, first_s=first, graphs=_graphs() - g0)
    for _ in range(cfg.warmup):
        _timed(model, step, cfg.device)
    ref.grads, ref.buffers = _after_step(model, step, state)
    ref.scale = max((float(g.abs().max()) for g in ref.grads.values()), default=1.0) or 1.0
    ref.peak = _peak(model, step)
    return ref


def measure(
    wl: Workload,
    method: str,
    knob: str,
    prepare: Callable[[nn.Module, Workload], Step],
    ref: Reference,
    cfg: Config,
    *,
    target: str = "",
    budget: int | None = None,
    built: list[nn.Module] | None = None,
    notes: list[str] | None = None,
    keep: list[tuple[nn.Module, Step]] | None = None,
    versus: tuple[nn.Module, Step] | None = None,
) -> Row:
    """Build from a reset Dynamo, compile, check gradients, measure the peak, time against
    the reference (recompiled after the reset: a Dynamo trace, its Inductor artifact from the
    cache). A failure at any stage becomes the row's status.

    ``keep``: the build is appended to it instead of dropped. ``versus``: a build kept so (a
    pt-budget point) that this row is also timed against, in alternating pairs; Dynamo is then
    not reset first, or that build would recompile without its budget (checkmate's own
    backend keeps its graphs apart from Inductor's)."""
    row = Row(model=wl.name, method=method, knob=knob, target=target, budget=budget)
    try:
        if versus is None:
            torch._dynamo.reset()
        t0, g0 = time.perf_counter(), _graphs()
        model = _fresh(wl, ref.state)
        step = prepare(model, wl)
        row.first_s = time.perf_counter() - t0
        row.graphs = _graphs() - g0
        for _ in range(cfg.warmup):
            _timed(model, step, cfg.device)
        for _ in range(1 + cfg.warmup):  # the reference, recompiled after the reset
            _timed(ref.model, ref.step, cfg.device)
        grads, buffers = _after_step(model, step, ref.state)
        row.grad_err = _max_err(grads, ref.grads)
        row.grad_rel = row.grad_err / ref.scale
        row.buffer_err = _max_err(buffers, ref.buffers)
        row.grads_ok = row.grad_rel <= cfg.grad_tol
        row.peak = _peak(model, step)
        row.peak_frac = row.peak / ref.peak if ref.peak else None
        row.step_s, row.ref_s, ratio, row.spread = _paired(
            model, step, (ref.model, ref.step), cfg.pairs, cfg.device
        )
        row.overhead = ratio - 1.0
        if versus is not None:
            _, _, ratio, row.vs_spread = _paired(model, step, versus, cfg.pairs, cfg.device)
            row.vs_point = ratio - 1.0
        if built:
            from checkmate.api import plans_of
            from checkmate.records import records_overhead

            records = plans_of(built[-1])
            row.graphs = len(records)
            if records:
                row.planned = records_overhead(records)
        if keep is not None:
            keep.append((model, step))
        del model, step
    except Exception as exc:  # a method's failure is a row, not the end of the run
        from solvers.errors import CheckmateError

        kind = "no plan" if isinstance(exc, CheckmateError) else "failed"
        what = str(exc).splitlines()[0].split("; ")[0] if str(exc).strip() else ""
        row.status = f"{kind}: {type(exc).__name__}: {what[:240]}"
    if notes:
        row.note = "; ".join(dict.fromkeys(notes))
    if built:
        built.clear()
    gc.collect()
    return row


def run_model(
    wl: Workload, cfg: Config, log: Callable[[str], None], on_row: Callable[[Row], None] | None = None
) -> list[Row]:
    """compile, each pt-budget point followed by checkmate at its measured peak (timed against
    the reference and against that point), then checkmate at 1.0; rows in that order by method.
    ``on_row`` sees each row as it is measured."""
    t0 = time.perf_counter()
    ref = reference(wl, cfg)
    log(
        f"{wl.name}: {wl.shape}; reference torch.compile peak {_mib(ref.peak)} MiB, "
        f"{ref.graphs} graph(s), compiled in {ref.first_s:.0f} s ({time.perf_counter() - t0:.0f} s)"
    )
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        log(f"  {row.method:9s} {row.knob:11s} {row.target:9s} " + _brief(row))
        if on_row is not None:
            on_row(row)

    def planned_at(budget: int | float, label: str, versus: tuple[nn.Module, Step] | None = None) -> Row:
        notes: list[str] = []
        built: list[nn.Module] = []
        knob = f"{_mib(budget)} MiB" if isinstance(budget, int) else f"{budget:g}"
        prepare = prepare_checkmate(
            budget, cfg.strategy, cfg.time_limit, notes, compiler="inductor", built=built
        )
        return measure(
            wl,
            "checkmate",
            knob,
            prepare,
            ref,
            cfg,
            target=label,
            budget=budget if isinstance(budget, int) else None,
            built=built,
            notes=notes,
            versus=versus,
        )

    add(measure(wl, "compile", "", prepare_inductor(None), ref, cfg))
    for b in cfg.budgets:
        kept: list[tuple[nn.Module, Step]] = []
        point = measure(wl, "pt-budget", f"{b:g}", prepare_inductor(b), ref, cfg, keep=kept)
        add(point)
        if point.status == "ok" and point.peak:
            add(planned_at(point.peak, f"pt {point.knob}", versus=kept[0]))
        kept.clear()
    add(planned_at(1.0, "1.0"))
    torch._dynamo.reset()
    order = {"compile": 0, "pt-budget": 1, "checkmate": 2}
    return sorted(rows, key=lambda r: order.get(r.method, 3))  # stable: budgets stay in order


def _brief(r: Row) -> str:
    if r.status != "ok":
        return r.status
    planned = f" (planned {100 * r.planned:+.1f}%)" if r.planned is not None else ""
    over = f", {r.peak / r.budget:.3f}x budget" if r.budget and r.peak else ""
    return (
        f"peak {_mib(r.peak or 0)} MiB ({r.peak_frac or 0:.2f}{over}), {1e3 * (r.step_s or 0):.2f} ms, "
        f"{100 * (r.overhead or 0):+.1f}%{planned} ±{100 * (r.spread or 0):.1f}, grad rel err "
        f"{r.grad_rel or 0:.1e}{'' if r.grads_ok else ' OVER TOL'}, {r.graphs} graph(s), first {r.first_s:.0f} s"
    )


#: (gpt2 size, batch, seq), (llama size, batch, seq), (resnet size, batch) per --size
SIZES: dict[str, dict[str, tuple[Any, ...]]] = {
    "quick": {"gpt2": ("quick", 8, 256), "llama": ("quick", 4, 256), "resnet": ("quick", 64)},
    "tiny": {"gpt2": ("tiny", 2, 16), "llama": ("tiny", 2, 32), "resnet": ("tiny", 4)},
}


def workloads(cfg: Config) -> list[Workload]:
    """The configured workloads at the configured size, on the configured device."""
    sizes = SIZES[cfg.size]
    out: list[Workload] = []
    for name in cfg.models:
        if name == "gpt2":
            size, batch, seq = sizes["gpt2"]
            wl = gpt2_workload(size, batch=batch, seq=seq, seed=cfg.seed)
        elif name == "llama":
            size, batch, seq = sizes["llama"]
            wl = llama_workload(size, batch=batch, seq=seq, seed=cfg.seed)
        elif name == "resnet":
            size, batch = sizes["resnet"]
            wl = resnet_workload(size, batch=batch, seed=cfg.seed)
        else:
            raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
        out.append(wl.to(cfg.device))
    return out


def run(cfg: Config, log: Callable[[str], None] = print) -> list[Row]:
    """Every workload of ``cfg``; returns all rows (none dropped)."""
    rows: list[Row] = []
    for wl in workloads(cfg):
        rows.extend(run_model(wl, cfg, log))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument(
        "--budgets",
        default=",".join(f"{b:g}" for b in BUDGETS),
        help="activation_memory_budget values ('' for none: torch.compile and checkmate at 1.0 only)",
    )
    p.add_argument("--quick", action="store_true", help="tiny models, 3 pairs, 1 warm-up (a CPU check)")
    p.add_argument("--pairs", type=int, default=None, help="timed pairs per row (default 20; 3 with --quick)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per checkmate plan (default 5)")
    p.add_argument(
        "--grad-tol", type=float, default=None, help="max gradient error / max |gradient| (1e-3; CUDA 3e-3)"
    )
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU default 1: stable ratios)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--prefix", default="peers_compile")
    p.add_argument("--render", action="store_true", help="re-render .md/.png from the .csv/.json only")
    p.add_argument(
        "--charge-saves",
        action="store_true",
        help="plan with checkmate.fusion.save_cost charged (off by default: slower on CPU; to be measured on a GPU)",
    )
    p.add_argument(
        "--heap",
        choices=("fixed", "default"),
        default="fixed",
        help="CPU: time steps on a C heap that never returns memory to the system (fixed, the default: "
        "a step's time is its ops', see benchmarks.heap) or on glibc's defaults",
    )
    a = p.parse_args(argv)
    from benchmarks import peers_compile_report as report

    if a.device == "cpu" and a.heap == "fixed" and not a.render and argv is None:  # run as a program
        from benchmarks.heap import reexec_fixed

        reexec_fixed("benchmarks.peers_compile", sys.argv[1:])

    if a.render:
        paths = report.render(a.out, a.prefix)
        print("wrote " + ", ".join(str(x) for x in paths))
        return 0
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available here; pass --device cpu (with --quick)")
    if a.threads or a.device == "cpu":
        torch.set_num_threads(a.threads or 1)
    cfg = Config(
        models=tuple(a.models.split(",")),
        device=a.device,
        budgets=tuple(float(x) for x in a.budgets.split(",") if x.strip()),
    )
    if a.quick:
        cfg = replace(cfg, size="tiny", pairs=3, warmup=1, time_limit=5.0)
    if a.pairs:
        cfg = replace(cfg, pairs=a.pairs)
    if a.time_limit:
        cfg = replace(cfg, time_limit=a.time_limit)
    if a.grad_tol or a.device == "cuda":
        cfg = replace(cfg, grad_tol=a.grad_tol or CUDA_GRAD_TOL)
    if a.charge_saves:  # the command line, in the report, says so
        from checkmate import fusion

        fusion.CHARGE_SAVES = True
    t0 = time.perf_counter()
    rows: list[Row] = []
    log = lambda s: print(s, flush=True)  # noqa: E731
    paths: list[Path] = []

    def save(row: Row) -> None:  # after each row: a run cut off by a time limit keeps what it measured
        nonlocal paths
        rows.append(row)
        info = report.RunInfo.now(_command(argv), time.perf_counter() - t0, cfg.device)
        paths = list(report.write_all(rows, cfg, a.out, a.prefix, info))

    for wl in workloads(cfg):
        run_model(wl, cfg, log, on_row=save)
    print(f"wall {time.perf_counter() - t0:.0f} s; wrote " + ", ".join(str(x) for x in paths))
    return 0


def _command(argv: list[str] | None) -> str:
    return (
        "python -m benchmarks.peers_compile " + " ".join(argv if argv is not None else sys.argv[1:])
    ).strip()


if __name__ == "__main__":
    raise SystemExit(main())
