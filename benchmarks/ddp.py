"""Two-process data-parallel training with checkmate against eager: step time and peak.

Two CPU ranks over gloo (``torch.multiprocessing.spawn``) train the example transformer
(``examples/train_transformer.py``'s ``TinyGPT``, dropout 0.1, returning its loss), each
rank on its own batch:

- DDP: ``DDP(model)`` against ``DDP(checkmate.optimize(model, budget))``, the per-rank budget
  ``--ddp-share`` (0.5) of eager DDP's measured step peak;
- FSDP2: every block and the root ``fully_shard``ed, eagerly against the supported order
  (each block ``optimize``d before sharding, at an equal share of a per-rank step budget of
  ``--fsdp-share`` of eager FSDP2's measured step peak).

The budget is the same on both ranks (the smaller rank's measured eager peak times the
share). The first step plans; one step's peak is measured (``checkmate.memory``); then
``--steps`` steps of each model are timed in alternation (forward + backward + AdamW, with a
barrier before each), and each rank reports the median step time and its measured peak.

Outputs: ``benchmarks/results/ddp.md`` (machine stated).

Usage::

    python -m benchmarks.ddp                    # ~2 min on 2 cores
    python -m benchmarks.ddp --steps 20 --ddp-share 0.4
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS_DIR = Path(__file__).resolve().parent / "results"
WORLD = 2

__all__ = ["main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _model() -> nn.Module:
    from examples.train_transformer import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(256, 64, 4, 4, 64, dropout=0.1).train()


def _shard(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block)
    fully_shard(model)
    return model


def _eager_peak(rank: int, model: nn.Module) -> int:
    """The measured peak of one training step of ``model`` (after a warm-up step)."""
    from checkmate.memory import measure_peak

    step = _step_fn(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt, 0)
    return measure_peak(lambda: step(model, opt, 0))


def _same_budget(peak: int, share: float) -> int:
    t = torch.tensor(peak)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(share * int(t))


def _worker(rank: int, port: int, args: dict[str, Any], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CHECKMATE_CACHE="0")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        rows = _ddp(rank, args) + _fsdp(rank, args)
        Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
        # before the group goes, gloo's threads drop the backward's collectives, which need
        # the GIL its destructor holds (tests/integration/_dist.py, settle)
        torch.distributed.barrier()
        time.sleep(0.2)
    finally:
        torch.distributed.destroy_process_group()


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(100 + rank))
    return data[:, :-1], data[:, 1:]


def _step_fn(rank: int) -> Callable[[nn.Module, torch.optim.Optimizer, int], None]:
    idx, targets = _data(rank)

    def step(m: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
        torch.manual_seed(seed)
        opt.zero_grad(set_to_none=True)
        m(idx, targets).backward()
        opt.step()

    return step


def _compare(
    rank: int,
    kind: str,
    share: float,
    budget: int,
    models: dict[str, nn.Module],
    steps: int,
    planned: list[nn.Module],
) -> list[dict[str, Any]]:
    """Plan (step 0), measure one step's peak, time ``steps`` steps of each model in turn."""
    import checkmate
    from checkmate.memory import measure_peak

    step = _step_fn(rank)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    times: dict[str, list[float]] = {name: [] for name in models}
    peaks: dict[str, int] = {}
    for name, m in models.items():
        step(m, opts[name], rank)  # plans (checkmate) / warms up (eager)
        peaks[name] = measure_peak(lambda m=m, name=name: step(m, opts[name], 1 + rank))  # type: ignore[misc]
    for k in range(steps):
        for name, m in models.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            step(m, opts[name], 2 + k + rank)
            times[name].append(time.perf_counter() - t0)
    recs = [r for p in planned for r in checkmate.plans_of(p)]
    return [
        {
            "rank": rank,
            "kind": kind,
            "method": name,
            "share": share if name == "checkmate" else None,
            "budget": budget if name == "checkmate" else None,
            "median_s": statistics.median(times[name]),
            "peak": peaks[name],
            "graphs": len(recs) if name == "checkmate" else 0,
            "recomputes": sum(r.recomputes for r in recs) if name == "checkmate" else 0,
            "received": sum(str(r.result.info.get("cache", "")).startswith("rank ") for r in recs)
            if name == "checkmate"
            else 0,
        }
        for name in models
    ]


def _ddp(rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate

    base = _model()
    budget = _same_budget(_eager_peak(rank, DDP(copy.deepcopy(base))), args["ddp_share"])
    opt_model = checkmate.optimize(copy.deepcopy(base), budget, time_limit=args["time_limit"])
    models = {"eager": DDP(copy.deepcopy(base)), "checkmate": DDP(opt_model)}
    return _compare(rank, "DDP", args["ddp_share"], budget, models, args["steps"], [opt_model])


def _fsdp(rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    import checkmate

    base = _model()
    budget = _same_budget(_eager_peak(rank, _shard(copy.deepcopy(base))), args["fsdp_share"])
    planned = copy.deepcopy(base)
    blocks = planned.blocks
    n = len(blocks)  # type: ignore[arg-type]
    for i in range(n):
        blocks[i] = checkmate.optimize(blocks[i], budget // n, time_limit=args["time_limit"])  # type: ignore[index]
    models = {"eager": _shard(copy.deepcopy(base)), "checkmate": _shard(planned)}
    return _compare(rank, "FSDP2 per block", args["fsdp_share"], budget, models, args["steps"], list(blocks))


def markdown(rows: list[dict[str, Any]], steps: int) -> str:
    from solvers.budget import format_bytes

    lines = [
        "# Two-process data parallelism: checkmate against eager",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, 2 CPU ranks "
        f"(gloo, one torch thread each). Model: TinyGPT (4 blocks, d=64, seq 64, batch 8 per rank, "
        f"dropout 0.1). Step = forward + backward + AdamW; median of {steps} steps per rank. "
        "Budgets are per rank, a share of the eager run's measured step peak (FSDP2: split evenly "
        "over the blocks, each planned with FSDP2's unsharded parameters reserved).",
        "",
        "| setup | method | rank | budget | step (median) | measured peak | peak / budget | graphs | recomputes | plans received |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        budget = "-" if r["budget"] is None else f"{r['share']:.2f} = {format_bytes(r['budget'])}"
        ratio = "-" if r["budget"] is None else f"{r['peak'] / r['budget']:.3f}"
        lines.append(
            f"| {r['kind']} | {r['method']} | {r['rank']} | {budget} | {1000 * r['median_s']:.1f} ms | "
            f"{format_bytes(r['peak'])} | {ratio} | {r['graphs']} | {r['recomputes']} | {r['received']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per model")
    ap.add_argument("--ddp-share", type=float, default=0.5)
    ap.add_argument("--fsdp-share", type=float, default=0.75)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "ddp.md")
    ns = ap.parse_args(argv)
    args = {
        "steps": ns.steps,
        "ddp_share": ns.ddp_share,
        "fsdp_share": ns.fsdp_share,
        "time_limit": ns.time_limit,
    }
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_worker, args=(_free_port(), args, tmp), nprocs=WORLD)
        rows = [row for r in range(WORLD) for row in json.loads(Path(tmp, f"rank{r}.json").read_text())]
    rows.sort(key=lambda r: (r["kind"], r["method"] != "eager", r["rank"]))
    text = markdown(rows, ns.steps)
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
