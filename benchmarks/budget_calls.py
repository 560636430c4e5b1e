"""What a budget costs the user in calls and seconds: ``make bench-budget``.

For models of different kinds (GPT-2 quick from transformers, a ResNet-like CNN with
BatchNorm, a two-output MLP, a DenseNet-like concatenating CNN, a TinyGPT with dropout)
at budgets 0.5, 0.7 and a byte budget (0.4 of eager's measured step peak), each in a
fresh ``optimize`` call with the plan cache off:

- calls: how many ``optimize`` calls it took to get a plan, retrying once at
  ``exc.minimum`` when the budget raised :class:`InfeasibleBudgetError` (target: 1 for a
  feasible budget, 2 for an infeasible one);
- seconds per call (wall, trace to codegen) and the solve's share;
- overrun: the largest solve time of a graph over the ``time_limit`` (target ≤ 1.10).

Writes ``benchmarks/results/budget_calls.md`` and ``budget_calls.csv``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.csvio import write_rows
from benchmarks.models import gpt2_workload, resnet_workload

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BUDGETS: tuple[str, ...] = ("0.5", "0.7", "bytes")
#: the byte budget, as a share of eager's measured step peak
BYTES_SHARE = 0.4


class TwoHeads(nn.Module):
    """An MLP trunk with a classifier and a regressor head."""

    def __init__(self, width: int = 512, depth: int = 6) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(64, width), nn.GELU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.trunk = nn.Sequential(*layers)
        self.cls = nn.Linear(width, 10)
        self.reg = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(F.relu(h))


class _DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], dim=1)


class DenseNetLike(nn.Module):
    """Two dense blocks of concatenating layers with a transition between them."""

    def __init__(self, growth: int = 12, layers: int = 6) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 24, 3, padding=1, bias=False)
        c = 24
        block1 = []
        for _ in range(layers):
            block1.append(_DenseLayer(c, growth))
            c += growth
        self.block1 = nn.Sequential(*block1)
        self.trans = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.Conv2d(c, c // 2, 1), nn.AvgPool2d(2))
        c //= 2
        block2 = []
        for _ in range(layers):
            block2.append(_DenseLayer(c, growth))
            c += growth
        self.block2 = nn.Sequential(*block2)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.trans(self.block1(self.stem(x))))
        return self.head(h.mean(dim=(2, 3)))


def _tinygpt() -> tuple[nn.Module, tuple[Any, ...]]:
    from examples.train_transformer import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(256, 64, 4, 4, 64, 0.1)
    data = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(1))
    return model, (data[:, :-1], data[:, 1:])


def _workload(which: str) -> tuple[nn.Module, tuple[Any, ...]]:
    w = gpt2_workload("quick") if which == "gpt2" else resnet_workload("quick")

    class WithLoss(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return w.criterion(self.inner(*xs), w.batch)

    return WithLoss(w.build(0.0)), w.inputs


#: name -> () -> (model whose output reduces to the loss, inputs)
MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[Any, ...]]]] = {
    "gpt2_quick": lambda: _workload("gpt2"),
    "resnet_bn": lambda: _workload("resnet"),
    "two_heads": lambda: (TwoHeads(), (torch.randn(512, 64, generator=torch.Generator().manual_seed(1)),)),
    "densenet_like": lambda: (
        DenseNetLike(),
        (torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(1)),),
    ),
    "tinygpt_dropout": _tinygpt,
}


@dataclass
class Row:
    model: str
    budget: str
    budget_bytes: int
    ops: int
    calls: int
    planned: bool
    call_seconds: str
    solve_seconds: float
    time_limit: float
    overrun: float
    strategy: str
    error: str


def _loss(out: Any) -> torch.Tensor:
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return torch.stack([x.float().pow(2).mean() if x.dim() else x for x in leaves]).sum()


def _eager_peak(model: nn.Module, inputs: tuple[Any, ...]) -> int:
    from checkmate.memory import measure_peak

    def step() -> None:
        for p in model.parameters():
            p.grad = None
        _loss(model(*inputs)).backward()

    step()
    return measure_peak(step)


def measure(name: str, budget: str, time_limit: float) -> Row:
    """Plan ``name`` at ``budget`` as a user would: one call, and one retry at the
    minimum the error states."""
    import checkmate
    from solvers.errors import CheckmateError, InfeasibleBudgetError

    model, inputs = MODELS[name]()
    spec: object = float(budget) if budget != "bytes" else int(BYTES_SHARE * _eager_peak(model, inputs))
    asked = spec
    seconds: list[float] = []
    error = ""
    opt = None
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            opt = checkmate.optimize(copy.deepcopy(model), spec, inputs, time_limit=time_limit)
        except InfeasibleBudgetError as exc:
            seconds.append(time.perf_counter() - t0)
            error = f"infeasible at {spec}: retried at minimum {exc.minimum:,}"
            if exc.minimum is None:
                break
            spec = exc.minimum
            continue
        except CheckmateError as exc:
            seconds.append(time.perf_counter() - t0)
            error = f"{type(exc).__name__}: {str(exc)[:160]}"
            break
        seconds.append(time.perf_counter() - t0)
        break
    plans = checkmate.plans_of(opt) if opt is not None else []
    solve = max((p.solve_seconds for p in plans), default=0.0)
    return Row(
        model=name,
        budget=budget,
        budget_bytes=int(spec) if isinstance(spec, int) else 0,
        ops=sum(p.joint.graph.n - 1 for p in plans),
        calls=len(seconds),
        planned=bool(plans),
        call_seconds=" / ".join(f"{s:.1f}" for s in seconds),
        solve_seconds=round(solve, 2),
        time_limit=time_limit,
        overrun=round(solve / time_limit, 3) if time_limit else 0.0,
        strategy=", ".join(str(p.result.info.get("chosen", p.result.strategy)) for p in plans),
        error=error if not plans or asked != spec else "",
    )


def render(rows: list[Row], seconds: float) -> str:
    per_call = [float(s) for r in rows for s in r.call_seconds.split(" / ") if s]
    lines = [
        "# What a budget costs in calls and seconds (`make bench-budget`)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}; "
        f"measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {seconds:.0f} s.",
        "",
        "Each row: fresh `checkmate.optimize(model, budget, inputs, time_limit=...)` calls with the plan "
        "cache off, retrying at `exc.minimum` after an `InfeasibleBudgetError`. Bytes = "
        f"{BYTES_SHARE} x eager's measured step peak. Overrun = the slowest graph's solve seconds / time_limit.",
        "",
        "| model | budget | ops | calls | planned | seconds per call | solve s | overrun | strategy | note |",
        "| --- | --- | ---: | ---: | --- | --- | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.budget} | {r.ops} | {r.calls} | {'yes' if r.planned else '**no**'} | "
            f"{r.call_seconds} | {r.solve_seconds:.1f} | {r.overrun:.2f} | {r.strategy} | {r.error} |"
        )
    if per_call:
        lines += [
            "",
            f"Median seconds per call: {statistics.median(per_call):.1f} (max {max(per_call):.1f}); "
            f"largest overrun {max(r.overrun for r in rows):.2f}; "
            f"rows planned {sum(r.planned for r in rows)} of {len(rows)}; "
            f"calls to a plan: max {max(r.calls for r in rows)}.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "budget_calls")
    args = ap.parse_args(argv)
    os.environ["CHECKMATE_CACHE"] = "0"
    torch.set_num_threads(1)
    names = [n for n in MODELS if not args.only or n in args.only.split(",")]
    start = time.perf_counter()
    rows: list[Row] = []
    for name in names:
        for budget in BUDGETS:
            row = measure(name, budget, args.time_limit)
            print(row, flush=True)
            rows.append(row)
    write_rows(rows, args.out.with_suffix(".csv"), Row)
    text = render(rows, time.perf_counter() - start)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
