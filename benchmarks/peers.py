"""``make bench-peers``: checkmate beside the rematerialization PyTorch users already have.

Every method trains the same model (same weights: one ``state_dict`` copied into a fresh
build per method; same batch) for one step = forward + loss + backward, on CPU, in one run:

1. ``eager``: no rematerialization. Its row is a second eager model timed against the
   reference one, so its "overhead" is the timing noise floor of the run.
2. ``checkpoint``: ``torch.utils.checkpoint(use_reentrant=False)`` around every block.
3. ``pt-budget``: PyTorch's min-cut partitioner with
   ``torch._functorch.config.activation_memory_budget`` at 1.0 ... 0.0, through
   ``torch.compile(backend=aot_autograd(fw/bw_compiler=boxed_nop,
   partition_fn=min_cut_rematerialization_partition))``, i.e. the ``aot_eager`` backend
   (no inductor; dynamo is reset before each build).
4. ``rockmate``: needs CUDA (rockmate 2.0.0 traces on ``torch.device("cuda")``); listed as
   not run on a machine without it.
5. ``checkmate``: ``checkmate.optimize(WithLoss(model), budget_bytes)`` at the measured peak
   of each other method (so points compare at the same memory) and at 0.7 / 0.5 of eager's
   peak; the wrapper's forward runs the model and the same criterion, so the plan covers the
   whole measured step (logits and loss included), as for a model that returns its loss.

Measured for each: the peak bytes allocated during a step beyond what was live before
(:func:`checkmate.memory.measure_peak`, the same tracker for every method); step time
as the process's CPU time (with one torch thread, the work itself: time the shared machine
gives to other processes is not counted; wall time is recorded too) over steps alternating
with the reference eager model, overhead = median of the per-pair ratios - 1, so load that
drifts during the run cancels; the max abs difference
of every parameter gradient and buffer from eager's after one step from the same state; and
with dropout p=0.1 (same seed before the step), whether the gradients still equal eager's.

Outputs: ``benchmarks/results/peers.csv``, ``peers.json``, ``peers.md`` (machine stated) and
``peers.png`` (overhead against measured peak, one curve per method). Nothing is dropped: a method that
fails or finds no plan is a row saying so.

Usage::

    python -m benchmarks.peers --quick   # GPT-2 (4 layers, d=128, batch 4 x 64) + ResNet
                                         # (width 16, batch 16 x 32x32), 9 timed pairs, 8 s
                                         # per plan: 4.5 min of CPU; 11.5 min wall measured
                                         # on 2 cores shared with other jobs (load ~6)
    python -m benchmarks.peers           # full: GPT-2 small (12 x 768, batch 2 x 128; eager
                                         # step ~5 s on one core) and ResNet-18 widths at
                                         # 64x64, batch 16; 20 timed pairs, 2 warm-up steps,
                                         # 60 s per plan: about 2-3 hours on 2 CPU cores
    python -m benchmarks.peers --models resnet --size tiny --steps 2   # a smoke run
    python -m benchmarks.peers --render  # redo peers.md / peers.png from peers.csv + .json

Every run writes ``<out>/<prefix>.csv`` (one row per method and knob, every field),
``.json`` (command, wall time, machine, config), ``.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.models import Workload, gpt2_workload, resnet_workload
from benchmarks.peer_methods import (
    Step,
    prepare_checkmate,
    prepare_checkpoint,
    prepare_eager,
    prepare_pt_budget,
    rockmate_status,
)
from checkmate.memory import measure_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PT_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
CM_FRACTIONS = (0.7, 0.5)


@dataclass(frozen=True)
class Config:
    """What one run measures (``--quick`` and the full run differ only here)."""

    models: tuple[str, ...] = ("gpt2", "resnet")
    size: str = "quick"
    pt_budgets: tuple[float, ...] = PT_BUDGETS
    cm_fractions: tuple[float, ...] = CM_FRACTIONS
    match_peers: bool = True
    steps: int = 7
    warmup: int = 1
    time_limit: float = 10.0
    strategy: str = "auto"
    dropout: float = 0.1
    seed: int = 0
    merge: float = 0.02  # checkmate targets closer than this (relative) are run once


@dataclass
class Row:
    """One method at one knob on one model; ``status`` is ``ok`` or says why not."""

    model: str
    method: str
    knob: str
    status: str = "ok"
    peak: int | None = None
    peak_frac: float | None = None
    step_s: float | None = None
    eager_s: float | None = None
    overhead: float | None = None
    wall_s: float | None = None
    eager_wall_s: float | None = None
    wall_overhead: float | None = None
    grad_err: float | None = None
    buffer_err: float | None = None
    dropout_err: float | None = None
    dropout_equal: bool | None = None
    first_s: float | None = None
    budget: int | None = None
    target: str = ""
    note: str = ""

    @property
    def label(self) -> str:
        """Short name of this point, as checkmate rows cite it (``pt 0.6``)."""
        if self.method == "pt-budget":
            return f"pt {self.knob}"
        return f"checkmate {self.knob}" if self.method == "checkmate" else self.method


@dataclass
class Reference:
    """Eager results everything is compared with."""

    state: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    drop_state: dict[str, torch.Tensor]
    drop_grads: dict[str, torch.Tensor]
    peak: int = 0
    drop_peak: int = 0
    model: nn.Module = field(default_factory=nn.Module)


# ---------------------------------------------------------------- measurement


def _mib(n: int | float) -> str:
    return f"{n / 2**20:.2f}"


def _fresh(wl: Workload, state: dict[str, torch.Tensor], dropout: float) -> nn.Module:
    model = wl.build(dropout)
    model.load_state_dict(state)
    return model


def _checked_step(model: nn.Module, step: Step, state: dict[str, torch.Tensor], seed: int) -> tuple[Any, ...]:
    """One step from ``state`` with the RNG seeded: (grads, buffers) after it."""
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    step().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.zero_grad(set_to_none=True)
    return grads, buffers


def _max_err(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """Max abs difference over every tensor of ``ref`` (inf when one is missing)."""
    worst = 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            return float("inf")
        if r.is_floating_point():
            worst = max(worst, float((g.double() - r.double()).abs().max()))
        elif not torch.equal(g, r):
            worst = max(worst, float((g - r).abs().max()))
    return worst


def _peak(model: nn.Module, step: Step) -> int:
    model.zero_grad(set_to_none=True)
    gc.collect()
    peak = measure_peak(lambda: step().backward())
    model.zero_grad(set_to_none=True)
    return peak


def _timed(model: nn.Module, step: Step) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one step."""
    model.zero_grad(set_to_none=True)
    c0, t0 = time.process_time(), time.perf_counter()
    step().backward()
    return time.process_time() - c0, time.perf_counter() - t0


@dataclass(frozen=True)
class Timing:
    """Medians of steps alternating with the reference eager model."""

    cpu_s: float
    eager_cpu_s: float
    ratio: float  # median of per-pair CPU-time ratios
    wall_s: float
    eager_wall_s: float
    wall_ratio: float


def _paired_times(model: nn.Module, step: Step, ref: nn.Module, ref_step: Step, n: int) -> Timing:
    """Time ``n`` pairs (method, eager), alternating which runs first."""
    mine: list[tuple[float, float]] = []
    theirs: list[tuple[float, float]] = []
    for i in range(n):
        if i % 2:
            mine.append(_timed(model, step))
            theirs.append(_timed(ref, ref_step))
        else:
            theirs.append(_timed(ref, ref_step))
            mine.append(_timed(model, step))
    med = statistics.median
    return Timing(
        cpu_s=med(a for a, _ in mine),
        eager_cpu_s=med(b for b, _ in theirs),
        ratio=med(a / b for (a, _), (b, _) in zip(mine, theirs, strict=True)),
        wall_s=med(w for _, w in mine),
        eager_wall_s=med(w for _, w in theirs),
        wall_ratio=med(a / b for (_, a), (_, b) in zip(mine, theirs, strict=True)),
    )


@contextlib.contextmanager
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def measure(
    wl: Workload,
    method: str,
    knob: str,
    prepare: Callable[[nn.Module, Workload], Step],
    ref: Reference,
    cfg: Config,
    *,
    budget: int | None = None,
    target: str = "",
    drop_prepare: Callable[[nn.Module, Workload], Step] | None = None,
    notes: list[str] | None = None,
) -> Row:
    """Build, warm up, check gradients, measure the peak and time one method.

    A failure at any stage becomes the row's status (the run goes on).
    """
    row = Row(model=wl.name, method=method, knob=knob, budget=budget, target=target)
    ref_step = prepare_eager(ref.model, wl)
    try:
        with _fresh_dynamo():
            t0 = time.perf_counter()
            model = _fresh(wl, ref.state, 0.0)
            step = prepare(model, wl)
            _timed(model, step)
            row.first_s = time.perf_counter() - t0
            for _ in range(cfg.warmup):
                _timed(model, step)
            grads, buffers = _checked_step(model, step, ref.state, cfg.seed)
            row.grad_err = _max_err(grads, ref.grads)
            row.buffer_err = _max_err(buffers, ref.buffers)
            row.peak = _peak(model, step)
            row.peak_frac = row.peak / ref.peak
            t = _paired_times(model, step, ref.model, ref_step, cfg.steps)
            row.step_s, row.eager_s, row.overhead = t.cpu_s, t.eager_cpu_s, t.ratio - 1.0
            row.wall_s, row.eager_wall_s, row.wall_overhead = t.wall_s, t.eager_wall_s, t.wall_ratio - 1.0
            del model, step
        if cfg.dropout > 0:
            with _fresh_dynamo():
                dmodel = _fresh(wl, ref.drop_state, cfg.dropout)
                dstep = (drop_prepare or prepare)(dmodel, wl)
                _timed(dmodel, dstep)
                dgrads, _ = _checked_step(dmodel, dstep, ref.drop_state, cfg.seed)
                row.dropout_err = _max_err(dgrads, ref.drop_grads)
                row.dropout_equal = row.dropout_err <= _equal_tol(row.grad_err, ref.drop_grads)
                del dmodel, dstep
    except Exception as exc:  # a method's failure is a row, not the end of the run
        from solvers.errors import CheckmateError

        kind = "no plan" if isinstance(exc, CheckmateError) else "failed"
        # the first clause says what happened; the advice after "; " is for users, not tables
        what = str(exc).splitlines()[0].split("; ")[0] if str(exc).strip() else ""
        row.status = f"{kind}: {type(exc).__name__}: {what[:200]}"
    if notes:
        row.note = "; ".join(dict.fromkeys(notes))
    return row


def _equal_tol(grad_err: float | None, ref: dict[str, torch.Tensor]) -> float:
    """Dropout gradients count as equal within the method's own no-dropout error (x4) or
    1e-6 of the largest gradient: rounding differences stay below it, a fresh dropout mask
    changes gradients by a sizeable fraction of their magnitude."""
    scale = max((float(g.abs().max()) for g in ref.values()), default=1.0)
    return max(4.0 * (grad_err or 0.0), 1e-6 * scale)


def reference(wl: Workload, cfg: Config) -> Reference:
    """Eager gradients, buffers and peaks (with and without dropout) from fresh builds."""
    base = wl.build(0.0)
    state = copy.deepcopy(base.state_dict())
    model = _fresh(wl, state, 0.0)
    step = prepare_eager(model, wl)
    _timed(model, step)
    grads, buffers = _checked_step(model, step, state, cfg.seed)
    ref = Reference(state, grads, buffers, {}, {}, model=model)
    ref.peak = _peak(model, step)
    if cfg.dropout > 0:
        dbase = wl.build(cfg.dropout)
        ref.drop_state = copy.deepcopy(dbase.state_dict())
        dstep = prepare_eager(dbase, wl)
        ref.drop_peak = _peak(dbase, dstep)
        ref.drop_grads, _ = _checked_step(dbase, dstep, ref.drop_state, cfg.seed)
    return ref


def checkmate_targets(rows: list[Row], ref: Reference, cfg: Config) -> list[tuple[int, str]]:
    """Budgets for checkmate: the other methods' measured peaks and fractions of eager's,
    merged when within ``cfg.merge`` of each other (labels joined), largest first."""
    wanted: list[tuple[int, str]] = []
    if cfg.match_peers:
        for r in rows:
            if r.status == "ok" and r.peak is not None and r.method != "eager":
                wanted.append((r.peak, r.label))
    for f in cfg.cm_fractions:
        wanted.append((int(f * ref.peak), f"{f:g} x eager"))
    merged: list[tuple[int, list[str]]] = []
    for budget, label in sorted(wanted, reverse=True):
        if merged and merged[-1][0] - budget <= cfg.merge * merged[-1][0]:
            merged[-1][1].append(label)
        else:
            merged.append((budget, [label]))
    return [(b, ", ".join(labels)) for b, labels in merged]


def run_model(wl: Workload, cfg: Config, log: Callable[[str], None]) -> list[Row]:
    """Every method on one workload, in a fixed order; checkmate last (it needs the peaks)."""
    t0 = time.perf_counter()
    ref = reference(wl, cfg)
    log(f"{wl.name}: {wl.shape}; eager peak {_mib(ref.peak)} MiB ({time.perf_counter() - t0:.0f} s)")
    rows: list[Row] = []

    def add(row: Row) -> None:
        rows.append(row)
        log(f"  {row.method:10s} {row.knob:10s} {row.target:24s} " + _brief(row))

    add(measure(wl, "eager", "", prepare_eager, ref, cfg))
    add(measure(wl, "checkpoint", "every block", prepare_checkpoint, ref, cfg))
    for b in cfg.pt_budgets:
        add(measure(wl, "pt-budget", f"{b:g}", prepare_pt_budget(b), ref, cfg))
    add(Row(model=wl.name, method="rockmate", knob="", status=rockmate_status()))
    drop_scale = ref.drop_peak / ref.peak if ref.peak else 1.0
    for budget, label in checkmate_targets(rows, ref, cfg):
        notes: list[str] = []
        # With dropout the graph holds masks too: the same fraction of its eager peak.
        add(
            measure(
                wl,
                "checkmate",
                f"{_mib(budget)} MiB",
                prepare_checkmate(budget, cfg.strategy, cfg.time_limit, notes),
                ref,
                cfg,
                budget=budget,
                target=label,
                drop_prepare=prepare_checkmate(int(budget * drop_scale), cfg.strategy, cfg.time_limit, []),
                notes=notes,
            )
        )
    return rows


def _brief(r: Row) -> str:
    if r.status != "ok":
        return r.status
    return (
        f"peak {_mib(r.peak or 0)} MiB ({r.peak_frac:.2f}), {100 * (r.overhead or 0):+.0f}% time, "
        f"grad err {r.grad_err:.1e}, dropout {'equal' if r.dropout_equal else 'DIFFERENT'} "
        f"({r.dropout_err:.1e}), first step {r.first_s:.1f} s"
    )


def workloads(cfg: Config) -> list[Workload]:
    """The configured workloads at the configured size."""
    out: list[Workload] = []
    for name in cfg.models:
        if name == "gpt2":
            gpt = {"small": ("small", 2, 128), "quick": ("quick", 4, 64), "tiny": ("tiny", 2, 16)}
            size, batch, seq = gpt.get(cfg.size, gpt["quick"])
            out.append(gpt2_workload(size, batch=batch, seq=seq, seed=cfg.seed))
        elif name == "resnet":
            res = {"small": ("full", 16), "quick": ("quick", 16), "tiny": ("tiny", 4)}
            rsize, rbatch = res.get(cfg.size, res["quick"])
            out.append(resnet_workload(rsize, batch=rbatch, seed=cfg.seed))
        else:
            raise SystemExit(f"unknown model {name!r}: choose from gpt2, resnet")
    return out


def run(cfg: Config, log: Callable[[str], None] = print) -> list[Row]:
    """Every workload of ``cfg``; returns all rows (none dropped)."""
    rows: list[Row] = []
    for wl in workloads(cfg):
        rows.extend(run_model(wl, cfg, log))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small models, few steps (~10 min on 2 cores)")
    p.add_argument("--models", default="gpt2,resnet")
    p.add_argument(
        "--size", default=None, help="tiny | quick | small (default: quick with --quick, else small)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed pairs per method")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per checkmate plan")
    p.add_argument("--pt-budgets", default=None, help="comma-separated activation_memory_budget values")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 keeps ratios stable under load)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument("--prefix", default="peers")
    p.add_argument("--render", action="store_true", help="re-render .md/.png from the .csv/.json only")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = Config(models=tuple(a.models.split(",")))
    cfg = (
        replace(cfg, size="quick", steps=9, time_limit=8.0, merge=0.03)
        if a.quick
        else replace(cfg, size="small", steps=20, warmup=2, time_limit=60.0)
    )
    if a.size:
        cfg = replace(cfg, size=a.size)
    if a.steps:
        cfg = replace(cfg, steps=a.steps)
    if a.time_limit:
        cfg = replace(cfg, time_limit=a.time_limit)
    if a.pt_budgets:
        cfg = replace(cfg, pt_budgets=tuple(float(x) for x in a.pt_budgets.split(",")))
    from benchmarks import peers_report

    if a.render:
        paths = peers_report.render(a.out, a.prefix)
        print("wrote " + ", ".join(str(x) for x in paths))
        return 0
    t0 = time.perf_counter()
    rows = run(cfg, lambda s: print(s, flush=True))
    command = "python -m benchmarks.peers " + " ".join(argv if argv is not None else sys.argv[1:])
    info = peers_report.RunInfo.now(command.strip(), time.perf_counter() - t0)
    paths = peers_report.write_all(rows, cfg, a.out, a.prefix, info)
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
