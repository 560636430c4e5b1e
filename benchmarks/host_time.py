"""``make bench-host``: where a compiled step's host time goes, checkmate's against ``torch.compile``'s.

On a GPU a small model's training step is host-bound: the CPU enqueues kernels slower than the
GPU runs them, so a step's time is the Python and dispatcher work around the kernels. This
benchmark builds, per model, ``torch.compile`` (Inductor, no budget: the reference) and
``checkmate.optimize(..., 1.0, compiler="inductor")`` (keeps every value), plus the same
checkmate step called past the optimized module's own wrapper (``bypass``: the planned step
alone, without the per-call bookkeeping of :mod:`checkmate.api`), and measures:

- ``wall``: a step (forward, loss, backward) between two device synchronizes, median over
  ``--pairs`` alternating pairs with the reference, and the median per-pair ratio (the row
  ``compile`` times the reference against itself: the run's noise);
- ``enqueue``: the time until ``backward()`` returns, before the synchronize (the host's share);
- ``cProfile``: per step, the functions with the most own time, and those whose own time
  differs most between checkmate and the reference (``host_time_<model>.txt``);
- ``torch.profiler``: per step, the counts of the device runtime's calls (kernel launches,
  allocations, copies, synchronizes), which say whether the extra host time is more device work.

Usage::

    python -m benchmarks.host_time --device cuda
    python -m benchmarks.host_time --device cpu --size tiny --pairs 10   # a CPU check
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import functools
import io
import pstats
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.peer_methods import ReferenceLoss, prepare_checkmate, prepare_inductor
from benchmarks.peers_compile import Config, alternating, ratio_spread, workloads
from checkmate.memory import measure_peak

RESULTS_DIR = Path(__file__).resolve().parent / "results"

#: device runtime calls counted per step (CUDA's names; the CPU has none)
RUNTIME_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaMalloc",
    "cudaFree",
    "cudaMemcpyAsync",
    "cudaMemsetAsync",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventRecord",
    "cudaStreamIsCapturing",
)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(step: Callable[[], torch.Tensor], device: str) -> tuple[float, float]:
    """(wall, enqueue) seconds of one step: forward, loss and backward."""
    _sync(device)
    t0 = time.perf_counter()
    step().backward()
    t1 = time.perf_counter()
    _sync(device)
    return time.perf_counter() - t0, t1 - t0


def _pairs(
    ref: Callable[[], torch.Tensor], other: Callable[[], torch.Tensor], pairs: int, device: str
) -> dict[str, float]:
    """Medians over alternating pairs (which one runs first alternates too)."""
    mine, theirs = alternating(lambda: _timed(other, device), lambda: _timed(ref, device), pairs)
    walls = [wall for wall, _ in mine]
    ref_walls = [wall for wall, _ in theirs]
    return {
        "wall_ms": 1e3 * statistics.median(walls),
        "enqueue_ms": 1e3 * statistics.median(enq for _, enq in mine),
        "ref_ms": 1e3 * statistics.median(ref_walls),
        "ratio": ratio_spread(walls, ref_walls)[0],
    }


def _own_times(step: Callable[[], torch.Tensor], steps: int, device: str) -> dict[str, tuple[float, int]]:
    """cProfile's own time (seconds per step) and calls per step of each function."""
    prof = cProfile.Profile()
    _sync(device)
    prof.enable()
    for _ in range(steps):
        step().backward()
    _sync(device)
    prof.disable()
    stats = pstats.Stats(prof)
    out: dict[str, tuple[float, int]] = {}
    for (file, line, name), (_cc, ncalls, tottime, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        key = f"{Path(file).name}:{line}({name})"
        out[key] = (tottime / steps, round(ncalls / steps))
    return out


def _runtime_calls(step: Callable[[], torch.Tensor], steps: int, device: str) -> dict[str, float]:
    """Per step: the device runtime's calls counted by ``torch.profiler``, and kernel time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step().backward()
        _sync(device)
    counts: dict[str, float] = dict.fromkeys(RUNTIME_CALLS, 0.0)
    kernels = kernel_us = 0.0
    for ev in prof.key_averages():
        if ev.key in counts:
            counts[ev.key] += ev.count / steps
        dev_us = getattr(ev, "self_device_time_total", 0.0) or 0.0
        if dev_us and ev.key not in counts:
            kernels += ev.count / steps
            kernel_us += dev_us / steps
    counts["kernels"] = kernels
    counts["kernel_ms"] = kernel_us / 1e3
    return {k: v for k, v in counts.items() if v}


def _table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def _peak(step: Callable[[], torch.Tensor]) -> int:
    """The step's peak bytes allocated beyond what was live before it."""
    return measure_peak(lambda: step().backward())


def run(cfg: Config, pairs: int, profile_steps: int, out: Path, *, reuse: bool = False) -> str:
    """Measure every configured model; returns the summary (also written under ``out``).
    ``reuse``: a row for checkmate's plan compiled without Inductor's buffer reuse."""
    from checkmate import backends
    from checkmate.api import _STATE

    summary: list[str] = []
    for wl in workloads(cfg):
        torch.manual_seed(cfg.seed)
        base = wl.build(0.0)
        ref_model = copy.deepcopy(base)
        cm_model = copy.deepcopy(base)
        args = (*wl.inputs, *wl.batch)
        torch._dynamo.reset()
        ref = prepare_inductor(None, ReferenceLoss)(ref_model, wl)
        notes: list[str] = []
        built: list[torch.nn.Module] = []
        t0 = time.perf_counter()
        cm = prepare_checkmate(1.0, cfg.strategy, cfg.time_limit, notes, compiler="inductor", built=built)(
            cm_model, wl
        )
        for _ in range(cfg.warmup + 3):  # the first calls plan, compile and check the step
            cm().backward()
            ref().backward()
        first_s = time.perf_counter() - t0
        state = built[0].__dict__[_STATE]

        bypass = functools.partial(state.compiled, *args)

        for _ in range(3):
            bypass().backward()
        methods: dict[str, Callable[[], torch.Tensor]] = {"checkmate": cm, "bypass": bypass, "compile": ref}
        if reuse:  # the same plan with Inductor's buffer reuse off (on in checkmate's checked compiles)
            reuse_model = copy.deepcopy(base)
            backends.INDUCTOR_CONFIG["allow_buffer_reuse"] = False
            try:
                methods["cm-reuse"] = prepare_checkmate(
                    1.0, cfg.strategy, cfg.time_limit, notes, compiler="inductor"
                )(reuse_model, wl)
                for _ in range(cfg.warmup + 3):
                    methods["cm-reuse"]().backward()
            finally:
                del backends.INDUCTOR_CONFIG["allow_buffer_reuse"]
        peaks = {name: _peak(fn) for name, fn in methods.items()}
        timing = {name: _pairs(ref, fn, pairs, cfg.device) for name, fn in methods.items()}
        own = {name: _own_times(fn, profile_steps, cfg.device) for name, fn in methods.items()}
        calls = {name: _runtime_calls(fn, 5, cfg.device) for name, fn in methods.items()}

        rows = [("method", "wall ms", "enqueue ms", "ref ms", "ratio to compile", "peak MiB")]
        for name, t in timing.items():
            rows.append(
                (
                    name,
                    f"{t['wall_ms']:.3f}",
                    f"{t['enqueue_ms']:.3f}",
                    f"{t['ref_ms']:.3f}",
                    f"{t['ratio']:.3f}",
                    f"{peaks[name] / 2**20:.2f}",
                )
            )
        keys = sorted({k for c in calls.values() for k in c})
        call_rows = [("per step", *methods)]
        call_rows += [(k, *(f"{calls[m].get(k, 0):.1f}" for m in methods)) for k in keys]
        diff = sorted(
            set(own["checkmate"]) | set(own["compile"]),
            key=lambda k: own["checkmate"].get(k, (0.0, 0))[0] - own["compile"].get(k, (0.0, 0))[0],
            reverse=True,
        )
        diff_rows = [("function (own time per step)", "checkmate us", "calls", "compile us", "calls")]
        for k in diff[:25]:
            c, r = own["checkmate"].get(k, (0.0, 0)), own["compile"].get(k, (0.0, 0))
            diff_rows.append((k[:90], f"{1e6 * c[0]:.1f}", str(c[1]), f"{1e6 * r[0]:.1f}", str(r[1])))
        totals = {m: 1e3 * sum(v[0] for v in own[m].values()) for m in methods}
        text = "\n".join(
            [
                f"## {wl.name}: {wl.shape} ({cfg.device}, torch {torch.__version__})",
                f"checkmate's first calls (plan, compile, check) and warm-up: {first_s:.1f} s",
                *notes,
                "",
                _table(rows),
                "",
                "cProfile own time per step (ms): " + ", ".join(f"{m} {t:.3f}" for m, t in totals.items()),
                "",
                _table(call_rows),
                "",
                "functions by own time, checkmate minus compile:",
                _table(diff_rows),
                "",
            ]
        )
        detail = io.StringIO()
        for name in methods:
            detail.write(f"\n### {name}: top own time per step\n")
            top = sorted(own[name].items(), key=lambda kv: kv[1][0], reverse=True)[:40]
            detail.write(
                _table(
                    [("function", "us", "calls")]
                    + [(k[:100], f"{1e6 * v[0]:.1f}", str(v[1])) for k, v in top]
                )
            )
            detail.write("\n")
        out.mkdir(parents=True, exist_ok=True)
        (out / f"host_time_{wl.name}.txt").write_text(text + detail.getvalue())
        print(text, flush=True)
        summary.append(text)
        del cm, ref, bypass, built, state, methods
    return "\n".join(summary)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--models", default="gpt2,resnet")
    p.add_argument("--size", default="quick", choices=("quick", "tiny"))
    p.add_argument("--pairs", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=20)
    p.add_argument("--time-limit", type=float, default=5.0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR)
    p.add_argument(
        "--reuse", action="store_true", help="add checkmate compiled without Inductor's buffer reuse"
    )
    a = p.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(1)
    cfg = Config(models=tuple(a.models.split(",")), device=a.device, size=a.size, time_limit=a.time_limit)
    run(cfg, a.pairs, a.profile_steps, a.out, reuse=a.reuse)


if __name__ == "__main__":
    main()
