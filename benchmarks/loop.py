"""A training loop whose input shapes change: how often checkmate plans, and for how long.

``make bench-loop`` (``python -m benchmarks.loop``) trains a TinyGPT-like transformer over
30 distinct sequence lengths (1-72, shuffled, batch 4) and a CNN with BatchNorm over 30
distinct (batch, image side) shapes, at 0.5, 0.7 and a byte budget (0.6x the eager step's
measured peak at the largest shape), one optimized module per budget, and prints per run:
shapes seen, graphs compiled (one Dynamo entry per shape), plans made (solves; the other
shapes reuse a plan re-simulated at their sizes), planning seconds per new shape (median
and total), the worst measured step peak over its budget (each shape measured on its
second occurrence, after it was compiled) and the exceptions raised (should be none).
``--ascending`` orders the shapes by size, each larger than every one before (the worst case
for reusing a plan); without it, each model's byte-budget run is also made in ascending order,
where plans made ahead for larger shapes decide what every later shape runs (the planned
compute column: median and worst over the graphs run).

Each shape is a Dynamo cache entry of the model's ``forward``, more than Dynamo's default
recompile limit (8): ``checkmate.optimize`` gives its forward a limit of its own, so the
script leaves Dynamo's configuration as a user's loop would. The lines are also written to
``benchmarks/results/loop.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import checkmate
from checkmate.api import _STATE, _signature
from checkmate.memory import measure_peak
from checkmate.runtime import Planner
from tests.integration import _models as M

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()


def _gpt(n: int, seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    lengths = random.Random(seed).sample(range(1, 73), n)
    return M.TinyTransformer(64, 64, 2), [torch.randint(0, 64, (4, t)) for t in lengths]


def _cnn(n: int, seed: int) -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(seed)
    shapes = random.Random(seed).sample([(b, s) for b in range(1, 9) for s in range(8, 18)], n)
    return M.SmallCNN(8, 4), [torch.randn(b, 3, s, s) for b, s in shapes]


MODELS: dict[str, Callable[[int, int], tuple[nn.Module, list[torch.Tensor]]]] = {"gpt": _gpt, "cnn": _cnn}


def run(name: str, budget_name: str, n: int, seed: int, time_limit: float, ascending: bool = False) -> str:
    model, batches = MODELS[name](n, seed)
    if ascending:  # each shape larger than every one before: the worst case for reuse
        batches.sort(key=lambda x: x.numel())
    largest = max(batches, key=lambda x: x.numel())
    if budget_name == "bytes":
        twin = copy.deepcopy(model)
        _step(twin, largest)
        twin.zero_grad(set_to_none=True)
        budget: object = int(0.6 * measure_peak(functools.partial(_step, twin, largest)))
    else:
        budget = float(budget_name)
    opt = checkmate.optimize(model, budget, profile="cpu", time_limit=time_limit)
    planner = opt.__dict__[_STATE].planner
    errors: list[str] = []
    seconds: list[float] = []
    worst = 0.0
    for epoch in range(2):
        for x in batches:
            opt.zero_grad(set_to_none=True)
            before = len(planner.records)
            t0 = time.perf_counter()
            try:
                if epoch == 0:
                    _step(opt, x)
                else:
                    peak = measure_peak(functools.partial(_step, opt, x))
                    allowed = sum(
                        planner.records[i].result.budget for i in planner.steps[_signature((x,), {})]
                    )
                    worst = max(worst, peak / allowed)
            except Exception as exc:  # counted and reported
                errors.append(f"{tuple(x.shape)}: {type(exc).__name__}")
                continue
            if len(planner.records) > before:
                seconds.append(time.perf_counter() - t0)
    shapes = len({tuple(x.shape) for x in batches})
    med = statistics.median(seconds) if seconds else 0.0
    return (
        f"{name:4s} {budget_name:>8s}: {shapes} shapes, {len(planner.records)} graphs, "
        f"{planner.plans_made} plans made, new-shape call {med:.2f} s median / {sum(seconds):.1f} s total, "
        f"worst measured/budget {worst:.3f}, planned compute {_overheads(planner)}, errors {len(errors)} {errors[:3]}"
    )


def _overheads(planner: Planner) -> str:
    """The planned recompute overhead of the graphs run, median and worst, in percent of
    each graph's compute (a plan reused at many shapes runs at each: a cheap first call can
    buy a dear step)."""
    over = sorted(100.0 * r.overhead for r in planner.records)
    return f"+{statistics.median(over):.1f}% median / +{over[-1]:.1f}% worst" if over else "-"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--budgets", default="0.5,0.7,bytes")
    ap.add_argument("--ascending", action="store_true", help="shapes in increasing size")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "loop.md")
    args = ap.parse_args(argv)
    names = [m for m in args.only.split(",") if m] or list(MODELS)
    lines = []
    budgets = args.budgets.split(",")
    runs = [(name, b, args.ascending) for name in names for b in budgets]
    if not args.ascending and "bytes" in budgets:  # where planning ahead matters: each shape larger
        runs += [(name, "bytes", True) for name in names]
    for name, b, ascending in runs:
        line = run(name, b, args.shapes, args.seed, args.time_limit, ascending)
        lines.append(f"{line}{', ascending' if ascending and not args.ascending else ''}")
        print(lines[-1], flush=True)
    order = "ascending sizes" if args.ascending else "shuffled, and ascending where marked"
    head = (
        "# A training loop whose shapes change (`make bench-loop`)\n\n"
        f"{platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; {args.shapes} shapes per "
        f"run ({order}), time_limit {args.time_limit:g} s; measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n"
    )
    args.out.write_text(head + "```\n" + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
