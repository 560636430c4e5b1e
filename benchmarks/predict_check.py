"""Check a prediction against a measurement: a scaled-down Llama, predicted then run.

``make bench-predict`` (on a machine with a CUDA GPU; ``--device cpu`` does the same on
the CPU with the ``cpu`` profile and a tiny model). For a Llama built by
:func:`benchmarks.big_models.small_llama` (default on CUDA: hidden 512, 4 layers, 8 heads,
MLP 1376, vocab 8000, bf16, batch 4 x 512; its forward returns the cross-entropy loss, so
one joint graph holds the whole step):

1. Predict, as for a GPU one does not have: trace it with ``--fake`` and the device
   profile (``h100`` on CUDA), plan the graph with ``auto`` at each fraction of its
   keep-all peak (default 0.7 and 0.5) and without a budget, and record the simulated peak
   and compute overhead of each plan.
2. Measure: build the same model for real on the device, ``checkmate.optimize`` it at the
   same byte budgets with the same profile (so the plan is made from the same costs), and
   measure one step's peak with :func:`checkmate.memory.measure_peak` (on CUDA,
   ``max_memory_allocated`` beyond what was allocated before the step) and its time (the
   median of ``--steps`` steps after warm-up, the modules timed round-robin). "No budget" is the compiled step keeping
   every value (a byte budget of twice the predicted keep-all peak); plain eager PyTorch
   is listed beside it.

Writes a markdown table to ``--out`` (default ``benchmarks/results/predict_check.md``):
budget, predicted peak, the peak the plan actually run was simulated at, the measured
peak, measured / predicted, predicted overhead and measured time overhead over the
no-budget step. Exits with a message, not a traceback, without CUDA (unless ``--device
cpu``) or without transformers.

This script uses only long-standing torch APIs (``torch.cuda`` memory statistics,
``torch.device`` as a context manager), so that it runs on older torch builds too; whether
the library does is what it finds out.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.big_models import SMALL

GiB, MiB = 2**30, 2**20

#: per device: the model's shape, dtype and the profile planned with
PRESETS: dict[str, dict[str, Any]] = {
    "cuda": {**SMALL, "profile": "h100"},  # big_models.small_llama's defaults
    "cpu": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "intermediate": 344,
        "vocab": 1000,
        "batch": 2,
        "seq": 128,
        "dtype": "float32",
        "profile": "cpu",
    },
}
SHAPE = ("hidden", "layers", "heads", "intermediate", "vocab", "batch", "seq", "dtype")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    for key in SHAPE[:-1]:
        ap.add_argument(f"--{key}", type=int, default=None, help=f"default: {PRESETS['cuda'][key]} on cuda")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    ap.add_argument("--profile", default=None, help="device profile (default: h100 on cuda, cpu on cpu)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.7, 0.5], help="of the keep-all peak")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per budget (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=30.0, help="planning seconds per budget")
    ap.add_argument("--out", default="benchmarks/results/predict_check.md")
    args = ap.parse_args(argv)
    preset = PRESETS[args.device]
    for key in (*SHAPE, "profile"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    return args


def _fail(msg: str) -> None:
    print(f"predict_check: {msg}", file=sys.stderr)
    raise SystemExit(2)


def predict(args: argparse.Namespace) -> dict[str, Any]:
    """Trace on fake tensors with the profile and plan: keep-all peak, and per fraction the
    byte budget, the plan's simulated peak and its compute overhead."""
    from checkmate.cli_trace import trace_factory
    from solvers import keep_all_peak, solve

    t0 = time.perf_counter()
    graphs = trace_factory(
        "benchmarks.big_models:small_llama", profile=args.profile, device=args.device, fake=True
    )
    trace_s = time.perf_counter() - t0
    if len(graphs) != 1:
        _fail(f"the model traced into {len(graphs)} graphs (graph breaks); this check expects one")
    (g,) = graphs
    keep = keep_all_peak(g)
    plans = []
    for f in args.fractions:
        nbytes = int(f * keep)
        t0 = time.perf_counter()
        res = solve(g, nbytes, "auto", time_limit=args.time_limit, raise_infeasible=False)
        plans.append(
            {
                "fraction": f,
                "budget": nbytes,
                "peak": res.peak if res.ok else None,
                "overhead": res.cost / g.total_cost - 1.0 if res.ok and res.cost is not None else None,
                "status": str(res.status),
                "seconds": time.perf_counter() - t0,
            }
        )
    return {"nodes": g.n, "keep": keep, "trace_s": trace_s, "plans": plans}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _step(module: Any, ids: Any) -> None:
    module(ids).backward()


def _peak(module: Any, ids: Any, device: str) -> int:
    """Peak bytes of one step beyond what was live before it (the gradients are the
    step's: they are dropped before it, so that the peak counts them)."""
    from checkmate.memory import measure_peak

    module.zero_grad(set_to_none=True)
    _sync(device)
    peak = measure_peak(lambda: _step(module, ids))
    module.zero_grad(set_to_none=True)
    return peak


def _times(modules: list[Any], ids: Any, args: argparse.Namespace) -> list[float]:
    """Median step seconds of each module, timed round-robin (one step of each per round),
    so that a change of the machine's load falls on every module alike."""
    for m in modules:
        for _ in range(args.warmup):
            m.zero_grad(set_to_none=True)
            _step(m, ids)
    times: list[list[float]] = [[] for _ in modules]
    for _ in range(args.steps):
        for k, m in enumerate(modules):
            m.zero_grad(set_to_none=True)
            _sync(args.device)
            t0 = time.perf_counter()
            _step(m, ids)
            _sync(args.device)
            times[k].append(time.perf_counter() - t0)
    for m in modules:
        m.zero_grad(set_to_none=True)
    return [statistics.median(t) for t in times]


def measure(args: argparse.Namespace, predicted: dict[str, Any]) -> list[dict[str, Any]]:
    """Run the model for real: eager, the no-budget step and one step per predicted budget."""
    import torch

    import benchmarks.big_models as bm
    import checkmate

    with torch.device(args.device):
        model, ids = bm.small_llama()
    model.train()
    rows: list[dict[str, Any]] = [
        {
            "label": "eager PyTorch",
            "budget": None,
            "pred": None,
            "sim": None,
            "peak": _peak(model, ids, args.device),
        }
    ]
    modules = [model]
    budgets = [("no budget (compiled, keeps every value)", 2 * predicted["keep"], predicted["keep"], 0.0)]
    budgets += [
        (f"{p['fraction']:g} of keep-all", p["budget"], p["peak"], p["overhead"]) for p in predicted["plans"]
    ]
    for label, nbytes, pred, over in budgets:
        t0 = time.perf_counter()
        try:
            opt = checkmate.optimize(
                model,
                nbytes,
                (ids,),
                profile=args.profile,
                time_limit=args.time_limit,
                fullgraph=True,
                compiler="aot",  # the graph the fake trace predicts (Inductor's decomposes further)
            )
        except checkmate.CheckmateError as exc:
            rows.append(
                {"label": label, "budget": nbytes, "pred": pred, "pred_over": over, "error": str(exc)}
            )
            print(f"  {label}: {type(exc).__name__}: {exc}", flush=True)
            continue
        plan_s = time.perf_counter() - t0
        recs = checkmate.plans_of(opt)
        peak = _peak(opt, ids, args.device)
        rows.append(
            {
                "label": label,
                "budget": nbytes,
                "pred": pred,
                "pred_over": over,
                "sim": recs[-1].result.peak if recs else None,
                "real_keep": recs[-1].reference_peak if recs else None,
                "peak": peak,
                "plan_s": plan_s,
            }
        )
        modules.append(opt)
        print(f"  {label}: predicted {pred}, simulated {rows[-1]['sim']}, measured {peak} B", flush=True)
    timed = [r for r in rows if "error" not in r]
    for r, secs in zip(timed, _times(modules, ids, args)):
        r["s"] = secs
    return rows


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MiB:.1f}"


def markdown(
    args: argparse.Namespace, predicted: dict[str, Any], rows: list[dict[str, Any]], env: str
) -> str:
    base = next((r["s"] for r in rows if r["label"].startswith("no budget") and "s" in r), None)
    shape = ", ".join(f"{k} {getattr(args, k)}" for k in SHAPE)
    lines = [
        "# Predicted against measured: a scaled-down Llama",
        "",
        f"`python -m benchmarks.predict_check --device {args.device}` on {env}. Model: {shape}; "
        f"profile `{args.profile}`. Predicted: traced with `--fake` ({predicted['nodes']} nodes, "
        f"{predicted['trace_s']:.1f} s) and planned with `auto` ({args.time_limit:g} s limit); keep-all peak "
        f"{_mib(predicted['keep'])} MiB. Measured: `checkmate.optimize(model, budget, profile="
        f"'{args.profile}')` at the same bytes, one step's peak by `checkmate.memory.measure_peak` "
        f"(beyond parameters and inputs), time the median of {args.steps} steps after {args.warmup} "
        "warm-up steps (one step of each row per round). Simulated: the peak of the plan that ran (its own trace of the real model). "
        "Time overhead: over the no-budget compiled step.",
        "",
        "| budget | bytes (MiB) | predicted peak (MiB) | plan's simulated peak (MiB) | measured peak (MiB) "
        "| measured / predicted | predicted overhead | measured time (ms) | measured time overhead |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['label']} | {_mib(r['budget'])} | {_mib(r['pred'])} | error: {r['error']} |||||"
            )
            continue
        ratio = f"{r['peak'] / r['pred']:.3f}" if r.get("pred") else "-"
        over = r.get("pred_over")
        t_over = f"{100 * (r['s'] / base - 1):+.1f}%" if base and not r["label"].startswith("eager") else "-"
        lines.append(
            f"| {r['label']} | {_mib(r['budget'])} | {_mib(r['pred'])} | {_mib(r.get('sim'))} | "
            f"{_mib(r['peak'])} | {ratio} | {'-' if over is None else f'{100 * over:+.1f}%'} | "
            f"{1e3 * r['s']:.2f} | {t_over} |"
        )
    if args.device == "cpu":
        lines += [
            "",
            "On a CPU shared with other jobs the step times move by 2x from run to run: there the "
            "memory columns are the check, the time columns are not.",
        ]
    keeps = {r.get("real_keep") for r in rows if r.get("real_keep") is not None}
    if keeps:
        lines += [
            "",
            f"Keep-all peak of the real trace(s): {', '.join(_mib(k) for k in sorted(keeps))} MiB "
            f"(fake trace: {_mib(predicted['keep'])} MiB).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Predict, measure, write the table; returns (the prediction, the measured rows)."""
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError as exc:
        _fail(f"needs torch and transformers ({exc}); `make install` installs both")
    if args.device == "cuda" and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        _fail(
            f"CUDA is not available (torch {torch.__version__}, {build}); "
            "run on a machine with a GPU, or pass --device cpu for the same check on the CPU"
        )
    os.environ.setdefault("CHECKMATE_CACHE", "0")  # plan every budget afresh
    import benchmarks.big_models as bm

    bm.SMALL.update({k: getattr(args, k) for k in SHAPE})
    if args.device == "cuda":
        env = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, transformers {transformers.__version__})"
    else:
        env = f"CPU {platform.processor() or platform.machine()} (torch {torch.__version__})"
    print(f"predicting ({args.profile} profile, fake trace) ...", flush=True)
    predicted = predict(args)
    for p in predicted["plans"]:
        print(
            f"  {p['fraction']:g}: budget {p['budget']} B, predicted peak {p['peak']}, {p['status']}",
            flush=True,
        )
    print(f"measuring on {env} ...", flush=True)
    rows = measure(args, predicted)
    text = markdown(args, predicted, rows, env)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text)
    print(f"wrote {out}")
    return predicted, rows


if __name__ == "__main__":
    main()
