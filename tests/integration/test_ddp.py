"""DDP around an optimized model, two CPU ranks over gloo.

For a transformer with dropout and a CNN with BatchNorm: ``DDP(checkmate.optimize(m,
budget))`` trains like ``DDP(m)`` (parameters after three AdamW steps equal bitwise: same
ops, same all-reduce), each rank's measured step peak stays within 5% of the per-rank
budget (DDP's gradient buckets included), rank 0 plans and rank 1 receives its plan, and
both run the plan with the same hash.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration._dist import free_port, train_twins

pytestmark = [pytest.mark.torch, pytest.mark.skipif(sys.platform == "win32", reason="gloo on Linux/macOS")]

WORLD = 2
#: a collective waiting longer fails the test instead of hanging it (gloo's default: 30 min)
TIMEOUT = timedelta(seconds=180)
STEPS = 3
#: per-rank budget as a share of eager DDP's measured step peak
SHARE = {"transformer_dropout": 0.5, "cnn_batchnorm": 0.7}


def _model(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    from tests.integration._models import SmallCNN, TinyTransformer

    torch.manual_seed(0)
    if kind == "transformer_dropout":
        return TinyTransformer(vocab=64, d=64, layers=2, p=0.1).train(), torch.randint(0, 64, (8, 32))
    return SmallCNN(8, 2).train(), torch.randn(16, 3, 16, 16)


def _worker(rank: int, kind: str, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CHECKMATE_CACHE="0")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=TIMEOUT)
    torch.set_num_threads(1)
    try:
        _train(rank, kind, out)
    finally:
        torch.distributed.destroy_process_group()


def _train(rank: int, kind: str, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.distributed import plan_hash
    from checkmate.memory import measure_peak

    base, x0 = _model(kind)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    if x0.is_floating_point():
        x = torch.randn(x0.shape, generator=g)
    else:
        x = torch.randint(0, 64, x0.shape, generator=g)

    def step(m: torch.nn.Module, seed: int) -> None:
        torch.manual_seed(seed)
        m(x).float().pow(2).mean().backward()

    eager = DDP(copy.deepcopy(base))
    step(eager, 1)
    eager.zero_grad(set_to_none=True)
    eager_peak = measure_peak(lambda: step(eager, 1))
    budget = int(SHARE[kind] * eager_peak)

    twin = DDP(copy.deepcopy(base))
    opt_model = checkmate.optimize(copy.deepcopy(base), budget, time_limit=5.0)
    planned = DDP(opt_model)
    peaks = train_twins(twin, planned, step, STEPS, rank)
    diff = max(
        (p.detach() - q.detach()).abs().max().item()
        for p, q in zip(twin.module.parameters(), opt_model.parameters())
    )
    bdiff = max(
        (
            (a - b).abs().max().item()
            for a, b in zip(twin.module.buffers(), opt_model.buffers())
            if a.is_floating_point()
        ),
        default=0.0,
    )
    recs = checkmate.plans_of(opt_model)
    doc: dict[str, Any] = {
        "budget": budget,
        "eager_peak": eager_peak,
        "peaks": peaks,
        "param_diff": diff,
        "buffer_diff": bdiff,
        "plans": len(recs),
        "recomputes": sum(r.recomputes for r in recs),
        "cache": [str(r.result.info.get("cache", "")) for r in recs],
        "hashes": [
            plan_hash(r.joint.graph, r.result.schedule) for r in recs if r.result.schedule is not None
        ],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize("kind", ["transformer_dropout", "cnn_batchnorm"])
def test_ddp_around_an_optimized_model_trains_like_eager_ddp_within_the_budget(
    kind: str, tmp_path: Path
) -> None:
    torch.multiprocessing.spawn(_worker, args=(kind, free_port(), str(tmp_path)), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, doc in enumerate(ranks):
        assert doc["plans"] >= 1 and doc["recomputes"] > 0, f"rank {r}: nothing was recomputed"
        assert doc["param_diff"] == 0.0, f"rank {r}: parameters differ from eager DDP by {doc['param_diff']}"
        assert doc["buffer_diff"] == 0.0, f"rank {r}: buffers differ by {doc['buffer_diff']}"
        worst = max(doc["peaks"]) / doc["budget"]
        assert worst <= 1.05, f"rank {r}: measured peak {worst:.3f}x the budget"
    assert all(c != "rank 0" for c in ranks[0]["cache"])
    assert ranks[1]["cache"] == ["rank 0"] * len(ranks[1]["cache"]), "rank 1 planned on its own"
    assert ranks[0]["hashes"] == ranks[1]["hashes"] and ranks[0]["hashes"]


def _mismatch_worker(rank: int, port: int, out: str) -> None:
    from checkmate.distributed import plan_once
    from solvers import solve
    from solvers.budget import Budget
    from solvers.errors import PlanError
    from tests.graphs import chain

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # a short timeout: a rank left waiting in a collective fails the test instead of hanging it
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    graph = chain(6, mem=1 + rank)  # rank 1 traced another graph (other sizes)
    try:
        plan_once(graph, 10**6, lambda: solve(graph, Budget(nbytes=10**6), "checkpoint-all"))
        text = "no error"
    except PlanError as exc:
        text = str(exc)
    finally:
        torch.distributed.destroy_process_group()
    Path(out, f"rank{rank}.txt").write_text(text)


def test_a_rank_that_cannot_use_rank_0s_plan_fails_every_rank_at_once(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_mismatch_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    for r in range(WORLD):
        text = (tmp_path / f"rank{r}.txt").read_text()
        assert "rank 1: PlanError" in text and "fingerprint mismatch" in text, f"rank {r}: {text}"
