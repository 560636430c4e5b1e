"""DDP around an optimized model, two CPU ranks over gloo.

For a transformer with dropout and a CNN with BatchNorm: ``DDP(checkmate.optimize(m,
budget))`` trains like ``DDP(m)`` (parameters after three AdamW steps equal bitwise: same
ops, same all-reduce), each rank's measured step peak stays within 5% of the per-rank
budget (DDP's gradient buckets included), each graph is planned by one rank and received by
the other through the process group's store, and both run the plan with the same hash.
Ranks whose batches have their own sequence lengths (dynamic padding) compile different
graphs at different steps, and train like eager DDP; ranks asking different budgets each
run a plan within their own.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration._dist import free_port, process_group, spawn, train_twins

pytestmark = [pytest.mark.torch, pytest.mark.skipif(sys.platform == "win32", reason="gloo on Linux/macOS")]

WORLD = 2
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
    with process_group(rank, port, WORLD):
        _train(rank, kind, out)


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
    # the ranks ask one budget: the smallest of those they measured
    asked = torch.tensor([int(SHARE[kind] * eager_peak)])
    torch.distributed.all_reduce(asked, torch.distributed.ReduceOp.MIN)
    budget = int(asked.item())
    try:  # the other order: DDP given whole runs eagerly, unplanned
        checkmate.optimize(eager, budget)
        wrapped_error = ""
    except checkmate.TraceError as exc:
        wrapped_error = str(exc)

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
        "wrapped_error": wrapped_error,
        "eager_peak": eager_peak,
        "peaks": peaks,
        "param_diff": diff,
        "buffer_diff": bdiff,
        "plans": len(recs),
        "recomputes": sum(r.recomputes for r in recs),
        "planned_at": [r.result.budget for r in recs],
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
    spawn(_worker, (kind, free_port(), str(tmp_path)), WORLD)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for r, doc in enumerate(ranks):
        assert doc["plans"] >= 1 and doc["recomputes"] > 0, f"rank {r}: nothing was recomputed"
        assert "model = DDP(checkmate.optimize(model, budget))" in doc["wrapped_error"], doc["wrapped_error"]
        assert doc["param_diff"] == 0.0, f"rank {r}: parameters differ from eager DDP by {doc['param_diff']}"
        assert doc["buffer_diff"] == 0.0, f"rank {r}: buffers differ by {doc['buffer_diff']}"
        worst = max(doc["peaks"]) / doc["budget"]
        assert worst <= 1.05, f"rank {r}: measured peak {worst:.3f}x the budget"
    # each graph planned by one rank, the other running its plan
    for k, pair in enumerate(zip(ranks[0]["cache"], ranks[1]["cache"])):
        assert pair in (("", "rank 0"), ("rank 1", "")), f"graph {k}: {pair}"
    assert ranks[0]["hashes"] == ranks[1]["hashes"] and ranks[0]["hashes"]
    assert (
        ranks[0]["planned_at"] == ranks[1]["planned_at"] and max(ranks[0]["planned_at"]) <= ranks[0]["budget"]
    )


def _counted(graph: Any, calls: list[int]) -> Callable[[int], Any]:
    """A solve of ``graph`` with the ILP that counts its calls in ``calls``."""
    from solvers import solve
    from solvers.budget import Budget

    def run(nbytes: int) -> Any:
        calls.append(nbytes)
        return solve(graph, Budget(nbytes=nbytes), "ilp")

    return run


def _store_worker(rank: int, port: int, out: str) -> None:
    """``plan_once`` as ranks out of step call it: graphs only one rank has, one graph both
    ask for, a budget no schedule fits, and ranks asking different budgets."""
    from checkmate.distributed import plan_hash, plan_once
    from solvers.errors import InfeasibleBudgetError
    from tests.graphs import chain

    doc: dict[str, Any] = {}
    with process_group(rank, port, WORLD):
        # a graph of this rank's own (its batch's length): planned here, nobody waits; rank 0
        # plans two while rank 1 plans one, then both ask for the same graph
        own = [chain(6 + rank + 2 * k, mem=10, training=True) for k in range(2 - rank)]
        calls: list[int] = []
        for graph in own:
            plan_once(graph, 1000, _counted(graph, calls))
        doc["own"] = len(calls)
        shared = chain(8, mem=10, training=True)
        calls = []
        res = plan_once(shared, 100, _counted(shared, calls))
        assert res.schedule is not None
        doc.update(
            shared_calls=len(calls), hash=plan_hash(shared, res.schedule), cache=res.info.get("cache", "")
        )
        # a budget no schedule fits: the rank that plans it raises, the other gets its error
        torch.distributed.barrier()  # both ask for it after rank 0 planned it
        calls = []
        if rank == 1:
            torch.distributed.barrier()
        try:
            plan_once(shared, 10, _counted(shared, calls))
            doc["error"] = "none"
        except InfeasibleBudgetError as exc:
            doc["error"] = f"InfeasibleBudgetError {exc.budget} {exc.lower_bound}"
        if rank == 0:
            torch.distributed.barrier()
        doc["error_calls"] = len(calls)
        # ranks asking different budgets: each plans its own
        calls = []
        res = plan_once(shared, ASKED[rank], _counted(shared, calls))
        doc.update(asked_calls=len(calls), asked_peak=res.peak, asked_budget=res.budget)
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


#: the two ranks' budgets for an 8-layer training chain of 10-byte tensors: apart by more
#: than one tensor, so rank 0's plan would not fit rank 1's budget
ASKED = (90, 60)


def test_ranks_out_of_step_share_plans_through_the_store_and_never_wait_for_each_other(
    tmp_path: Path,
) -> None:
    # collectives while planning needed every rank to compile the same graphs in the same
    # order: ranks with their own sequence lengths failed with a PlanError at the first step
    # where the shapes differed, and a rank compiling a shape the other had compiled before
    # would have waited for it in a collective it never joined
    from solvers import solve
    from solvers.budget import Budget
    from tests.graphs import chain

    graph = chain(8, mem=10, training=True)
    assert solve(graph, Budget(nbytes=ASKED[0]), "ilp").peak > ASKED[1], (
        "rank 0's plan would fit rank 1's budget"
    )
    spawn(_store_worker, (free_port(), str(tmp_path)), WORLD, deadline=120.0)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert [doc["own"] for doc in ranks] == [2, 1]  # each rank planned its own graphs
    assert sorted(doc["shared_calls"] for doc in ranks) == [0, 1]  # the shared one: planned once
    assert ranks[0]["hash"] == ranks[1]["hash"]
    receiver = 0 if ranks[0]["shared_calls"] == 0 else 1
    assert ranks[receiver]["cache"] == f"rank {1 - receiver}"
    for r, doc in enumerate(ranks):
        assert doc["error"].startswith("InfeasibleBudgetError 10 "), f"rank {r}: {doc['error']}"
        assert doc["asked_calls"] == 1 and doc["asked_budget"] == ASKED[r] and doc["asked_peak"] <= ASKED[r]
    assert [doc["error_calls"] for doc in ranks] == [1, 0]  # rank 1 got rank 0's error, unsolved


def _padded_worker(rank: int, port: int, out: str) -> None:
    """A transformer under DDP whose batches have each rank's own sequence length at each step
    (dynamic padding), beside eager DDP on the same batches."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak
    from tests.integration._models import TinyTransformer

    with process_group(rank, port, WORLD):
        torch.manual_seed(0)
        base = TinyTransformer(vocab=64, d=64, layers=2, p=0.0).train()
        eager = DDP(copy.deepcopy(base))
        x0 = torch.randint(0, 64, (8, max(max(s) for s in LENGTHS)))
        budget = int(0.8 * measure_peak(lambda: eager(x0).float().pow(2).mean().backward()))
        opt = checkmate.optimize(copy.deepcopy(base), budget, time_limit=5.0)
        planned = DDP(opt)
        diffs: list[float] = []
        peaks: list[int] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for k, length in enumerate(LENGTHS[rank]):
                x = torch.randint(0, 64, (8, length), generator=torch.Generator().manual_seed(10 * k + rank))
                for m in (eager, planned):
                    m.zero_grad(set_to_none=True)
                eager(x).float().pow(2).mean().backward()
                peaks.append(measure_peak(lambda x=x: planned(x).float().pow(2).mean().backward()))  # type: ignore[misc]
                diffs.append(
                    max(
                        (p.grad - q.grad).abs().max().item()
                        for p, q in zip(eager.module.parameters(), opt.parameters())
                    )
                )
        doc = {"budget": budget, "peaks": peaks, "diffs": diffs, "plans": len(checkmate.plans_of(opt))}
        Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


#: each rank's sequence lengths, step by step: different at the first step; at the third,
#: rank 0 runs a length it compiled before while rank 1 compiles a new one
LENGTHS = ((32, 40, 32, 24), (40, 32, 48, 24))


def test_ranks_with_their_own_sequence_lengths_train_like_eager_ddp_within_the_budget(tmp_path: Path) -> None:
    spawn(_padded_worker, (free_port(), str(tmp_path)), WORLD, deadline=240.0)
    for r in range(WORLD):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert doc["diffs"] == [0.0] * len(LENGTHS[r]), (
            f"rank {r}: gradients differ from eager DDP: {doc['diffs']}"
        )
        assert doc["plans"] >= len(set(LENGTHS[r])), f"rank {r}: {doc['plans']} plans"
        worst = max(doc["peaks"]) / doc["budget"]
        assert worst <= 1.05, f"rank {r}: measured peak {worst:.3f}x the budget"


class _WithLoss(torch.nn.Module):
    """``body`` and its loss (label smoothing, a z-loss), returned beside the logits, as a
    Hugging Face model given ``labels=`` does."""

    def __init__(self, body: torch.nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return _head_loss(logits, y), logits


def _head_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.1)
    return loss + 1e-4 * logits.logsumexp(-1).pow(2).mean()


def _outside_worker(rank: int, port: int, out: str, share: float, inside: bool) -> None:
    """An MLP ending in an 8192-way head whose loss (label smoothing, a z-loss) is computed
    outside the module (``inside``: by the module, returned beside its logits), under DDP at
    ``share`` of eager DDP's peak, in bytes."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak
    from checkmate.runtime import BudgetWarning

    with process_group(rank, port, WORLD):
        torch.manual_seed(0)
        base = nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(),
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Linear(256, 8192),
        )  # fmt: skip
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(256, 256, generator=g), torch.randint(0, 8192, (256,), generator=g)

        if inside:
            base = _WithLoss(base)

        def step(m: nn.Module) -> None:
            m.zero_grad(set_to_none=True)
            loss = m(x, y)[0] if inside else _head_loss(m(x), y)
            loss.backward()

        eager = DDP(copy.deepcopy(base))
        step(eager)
        budget = int(share * measure_peak(lambda: step(eager)))
        planned = DDP(checkmate.optimize(copy.deepcopy(base), budget, time_limit=5.0))
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always", BudgetWarning)
            step(planned)  # plans
            peak = max(measure_peak(lambda: step(planned)) for _ in range(3))
            step(planned)  # the first calls ran inside measure_peak's profiler
        said = [str(w.message) for w in got if issubclass(w.category, BudgetWarning)]
        Path(out, f"rank{rank}.json").write_text(
            json.dumps({"budget": budget, "peak": peak, "warnings": said})
        )


def test_a_large_output_of_a_step_not_measured_whole_under_ddp_on_the_cpu_warns_once(tmp_path: Path) -> None:
    # on the CPU under torch.distributed the step is not measured whole (its profiler beside
    # gloo's threads corrupted the heap), so a loss outside the module goes uncounted: the
    # 8192-way head's loss took this step to 1.25x a budget of 0.8 of eager DDP's peak, silently
    # the same loss computed by the module (returned beside its logits) is planned with the step
    for inside in (False, True):
        out = tmp_path / str(inside)
        out.mkdir()
        spawn(_outside_worker, (free_port(), str(out), 0.8, inside), WORLD)
        for r in range(WORLD):
            doc = json.loads((out / f"rank{r}.json").read_text())
            said = [
                w for w in doc["warnings"] if "not measured whole on the CPU under torch.distributed" in w
            ]
            if inside:
                assert not said, f"rank {r}: {said}"
            else:
                assert len(said) == 1 and "8.00 MiB of outputs" in said[0], f"rank {r}: {doc['warnings']}"


@contextlib.contextmanager
def _split_mlp(
    rank: int, port: int
) -> Iterator[tuple[Callable[[], Any], torch.Tensor, Callable[[Any], None]]]:
    """In a process group of ``WORLD`` ranks (:func:`process_group`): a builder of an MLP that DDP's graph
    splitting cuts in two at its first (1 MiB) gradient bucket (the same weights on every
    rank), this rank's batch, and a step (zeroed gradients, forward, backward) on it."""
    from torch import nn

    with process_group(rank, port, WORLD):

        def mlp() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(6)])

        x = torch.randn(256, 512, generator=torch.Generator().manual_seed(rank))

        def step(m: nn.Module) -> None:
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()

        yield mlp, x, step


def _split_worker(rank: int, port: int, out: str, share: float, example: bool) -> None:
    """The split MLP at ``share`` of eager DDP's peak, in bytes; planned at its first step,
    or on ``example`` inputs."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak
    from checkmate.runtime import BudgetWarning

    with _split_mlp(rank, port) as (mlp, x, step):
        eager = DDP(mlp())
        step(eager)
        budget = int(share * measure_peak(lambda: step(eager)))
        opt = checkmate.optimize(mlp(), budget, (x,) if example else None, time_limit=5.0)
        planned = DDP(opt)
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always", BudgetWarning)
            step(planned)  # plans
            # DDP rebuilds its buckets at its second step (eager DDP: 13.0 MiB there, 7.0 after),
            # where checkmate may also plan the step again with the other graph in view
            peak = max(measure_peak(lambda: step(planned)) for _ in range(3))
        said = [str(w.message) for w in got if issubclass(w.category, BudgetWarning)]
        doc = {"budget": budget, "peak": peak, "warnings": said, "plans": len(checkmate.plans_of(opt))}
        Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


def _apart_worker(rank: int, port: int, out: str) -> None:
    """The split MLP, each rank asking its own byte budget: 0.95x and 1.3x eager DDP's peak."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak

    with _split_mlp(rank, port) as (mlp, _, step):
        eager = DDP(mlp())
        step(eager)
        budget = int((0.95, 1.3)[rank] * measure_peak(lambda: step(eager)))
        opt = checkmate.optimize(mlp(), budget, time_limit=5.0)
        planned = DDP(opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(4):
                step(planned)
        Path(out, f"rank{rank}.json").write_text(json.dumps({"plans": len(checkmate.plans_of(opt))}))


def test_ranks_asking_different_byte_budgets_decide_apart_to_plan_a_split_step_again(tmp_path: Path) -> None:
    # whether the step's graphs together exceed the budget (and are compiled again) is each
    # rank's own decision, on its own bytes: the rank asking less plans the split again while
    # the other does not, and neither waits for the other (through collectives, with these
    # budgets, both ranks hung until killed)
    spawn(_apart_worker, (free_port(), str(tmp_path)), WORLD, deadline=150.0)
    plans = [json.loads((tmp_path / f"rank{r}.json").read_text())["plans"] for r in range(WORLD)]
    assert plans == [4, 2], plans  # the split's two graphs, planned again on rank 0 only


@pytest.mark.parametrize("example", [False, True], ids=["planned-inside-ddp", "example-inputs"])
def test_ddp_graph_splits_hold_a_byte_budget_or_say_they_cannot(
    tmp_path: Path, example: bool, capfd: pytest.CaptureFixture[str]
) -> None:
    # DDP's graph splitting runs a step as two graphs: the first holds what it saved while
    # the second runs, and the second's gradients while the first's backward runs. Where the
    # budget has room for that, each graph is planned with it (1.05x eager DDP's peak: within
    # it at every step); where it has not, a warning says so (0.95x: 1.012x the budget at
    # DDP's bucket-rebuilding second step, silently before). A plan made outside DDP
    # (example_inputs) is made again inside it, with DDP's gradient buckets (1.052x before)
    for share, fits in ((1.05, True), (0.95, False)):
        out = tmp_path / f"{share}"
        out.mkdir()
        try:
            spawn(_split_worker, (free_port(), str(out), share, example), WORLD)
        except pytest.fail.Exception as exc:
            # a rank still waiting at the deadline (CI, twice): ranks deciding apart on their own
            # budgets was one cause, fixed; a process group destroyed while gloo's threads
            # waited for the GIL (see _dist.settle) was the other, settled since. Should a rank
            # hang again: said, with its stacks, and run once more; every assertion below holds
            # for the run that finished
            if "still running" not in str(exc):
                raise
            err = capfd.readouterr().err
            stacks = err[err.find("Fatal Python error") :]  # where the killed ranks waited
            warnings.warn(
                f"DDP split workers hung and were run again: {exc}\n{stacks}", RuntimeWarning, stacklevel=1
            )
            spawn(_split_worker, (free_port(), str(out), share, example), WORLD)
        for r in range(WORLD):
            doc = json.loads((out / f"rank{r}.json").read_text())
            # the two graphs of the split, maybe twice (and the one graph planned before DDP)
            assert doc["plans"] in (2 + example, 4 + example), f"rank {r} at {share}: {doc['plans']} plans"
            if fits:
                assert doc["peak"] <= doc["budget"], (
                    f"rank {r}: {doc['peak'] / doc['budget']:.3f}x the budget"
                )
                assert not doc["warnings"], doc["warnings"]
            else:
                assert doc["peak"] > doc["budget"]  # what the warning is about
                assert any(
                    "DDP's gradient buckets split this step into 2 graphs" in w for w in doc["warnings"]
                )


def _skipping_worker(rank: int, port: int, out: str, split: bool, share: float) -> None:
    """Blocks kept where a mask says (LayerDrop's graph break: one graph run once per block
    kept), under DDP at ``share`` of eager DDP's peak: four steps keeping one block, five
    keeping all four, then two measured."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak
    from tests.integration._models import Skipping

    torch._dynamo.config.optimize_ddp = split  # this rank's process only
    with process_group(rank, port, WORLD):
        torch.manual_seed(0)
        model = Skipping()
        g = torch.Generator().manual_seed(rank)
        x, y = torch.randn(2048, 256, generator=g), torch.randint(0, 10, (2048,), generator=g)
        one, every = torch.tensor([True, False, False, False]), torch.ones(4, dtype=torch.bool)
        eager = DDP(copy.deepcopy(model), find_unused_parameters=True)
        eager(x, y, every).backward()
        eager.zero_grad(set_to_none=True)
        asked = torch.tensor([int(share * measure_peak(lambda: eager(x, y, every).backward()))])
        torch.distributed.all_reduce(asked, torch.distributed.ReduceOp.MIN)
        budget = int(asked.item())
        opt = checkmate.optimize(model, budget, time_limit=5.0)
        planned = DDP(opt, find_unused_parameters=True)
        sgd = torch.optim.SGD(planned.parameters(), lr=0.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for keep in [one] * 4 + [every] * 5:
                planned(x, y, keep).backward()
                sgd.step()
                sgd.zero_grad()
            peaks = [measure_peak(lambda: planned(x, y, every).backward()) for _ in range(2)]
        said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
        runs = sorted(opt.__dict__["_checkmate_state"].planner.runs.values())
    doc = {"budget": budget, "peak": max(peaks), "warnings": said, "runs": runs}
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


@pytest.mark.parametrize(("split", "share"), [(False, 0.7), (True, 0.8)], ids=["one-graph", "bucket-splits"])
def test_a_graph_run_more_often_than_planned_under_ddp_on_the_cpu_is_planned_for_its_runs(
    tmp_path: Path, split: bool, share: float
) -> None:
    # on the CPU under torch.distributed a step is not measured whole, so the step check never
    # saw the blocks' graph run three times where steps keeping one block ran it once: every
    # run kept all it saved, and steps ran at eager DDP's peak (1.43x a budget of 0.7 of it as
    # one graph, 1.25x of 0.8 split at DDP's buckets), silently. Now the runs counted say so.
    # As one graph (optimize_ddp = False) each run is planned beside the others, and the graph
    # before the loop leaves them room (planned alone, it kept all it saved and left the runs
    # none: 1.41x, warned): the step fits. Split at DDP's buckets, the halves' boundary values
    # cannot be recomputed, no plans fit together, and a BudgetWarning says so
    spawn(_skipping_worker, (free_port(), str(tmp_path), split, share), WORLD)
    for r in range(WORLD):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        ratio = doc["peak"] / doc["budget"]
        print(f"rank {r}: {ratio:.3f}x the budget, runs {doc['runs']}, {doc['warnings']}")
        # each graph ran three times (not counted again as Dynamo's DDP optimizer passes fake
        # tensors through the parts it compiled: [2, 2, 4, 4] where split)
        assert doc["runs"] == ([3, 3] if split else [3]), f"rank {r}: runs planned for {doc['runs']}"
        if not split:
            assert ratio <= 1.0, f"rank {r}: {ratio:.3f}x the budget"
            assert not doc["warnings"], doc["warnings"]
        else:
            assert ratio <= 1.0 or any(
                "DDP's gradient buckets split this step" in w for w in doc["warnings"]
            ), f"rank {r}: {ratio:.3f}x the budget, unwarned"


def _accumulating_worker(rank: int, port: int, out: str) -> None:
    """An MLP under DDP accumulating four micro-batches per optimizer step (``no_sync`` for the
    first three), at eager DDP's peak over them; four optimizer steps, each measured."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak
    from tests.integration.test_step_check import _head_model

    with process_group(rank, port, WORLD):
        model = _head_model(256)
        g = torch.Generator().manual_seed(rank)
        micro = [
            (torch.randn(1024, 256, generator=g), torch.randint(0, 256, (1024,), generator=g))
            for _ in range(4)
        ]

        def accumulate(m: Any) -> None:
            for i, (x, y) in enumerate(micro):
                with m.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                    (torch.nn.functional.cross_entropy(m(x), y) / len(micro)).backward()

        eager = DDP(copy.deepcopy(model))
        accumulate(eager)
        eager.zero_grad(set_to_none=True)
        asked = torch.tensor([measure_peak(lambda: accumulate(eager))])
        torch.distributed.all_reduce(asked, torch.distributed.ReduceOp.MIN)
        budget = int(asked.item())
        opt = checkmate.optimize(model, budget, time_limit=5.0)
        planned = DDP(opt)
        sgd = torch.optim.SGD(planned.parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peaks = []
            for _ in range(4):
                peaks.append(measure_peak(lambda: accumulate(planned)))
                sgd.step()
                sgd.zero_grad()
        planner = opt.__dict__["_checkmate_state"].planner
        doc = {
            "ratios": [p / budget for p in peaks],
            "warnings": [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)],
            "held": planner.held_grads,
            "late": planner.grads_late,
            "grads": sum(p.numel() * p.element_size() for p in model.parameters()),
            "runs": sorted(planner.runs.values()),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


def test_gradients_accumulated_under_no_sync_are_planned_beside_ddps_buckets(tmp_path: Path) -> None:
    # after the first optimizer step the plans are made beside the gradients held and DDP's
    # buckets; its graphs compiled again are not taken for graphs run twice (Dynamo's DDP
    # optimizer passes fake tensors through them, counted as runs: every graph planned beside
    # another run of itself, warned that none fits)
    spawn(_accumulating_worker, (free_port(), str(tmp_path)), WORLD)
    for r in range(WORLD):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        print(f"rank {r}: {[round(x, 3) for x in doc['ratios']]}x the budget, {doc['warnings']}")
        assert doc["held"] == doc["grads"], doc  # planned beside them
        assert not doc["late"], doc  # accumulated, not freed between the forward and the backward
        assert not doc["warnings"] and not doc["runs"], doc
        assert max(doc["ratios"]) <= 1.0, doc["ratios"]


def _small_buckets_worker(rank: int, port: int, out: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import checkmate
    from checkmate.memory import measure_peak

    with process_group(rank, port, WORLD):
        base, x0 = _model("transformer_dropout")
        x = torch.randint(0, 64, x0.shape, generator=torch.Generator().manual_seed(100 + rank))

        def step(m: torch.nn.Module, seed: int) -> None:
            torch.manual_seed(seed)
            m(x).float().pow(2).mean().backward()

        eager = DDP(copy.deepcopy(base), bucket_cap_mb=0.1)
        step(eager, 1)
        eager.zero_grad(set_to_none=True)
        asked = torch.tensor([int(0.6 * measure_peak(lambda: step(eager, 1)))])
        torch.distributed.all_reduce(asked, torch.distributed.ReduceOp.MIN)
        budget = int(asked.item())
        twin = DDP(copy.deepcopy(base), bucket_cap_mb=0.1)
        opt_model = checkmate.optimize(copy.deepcopy(base), budget, time_limit=5.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            peaks = train_twins(twin, DDP(opt_model, bucket_cap_mb=0.1), step, STEPS, rank)
        doc = {
            "budget": budget,
            "peaks": peaks,
            "param_diff": max(
                (p.detach() - q.detach()).abs().max().item()
                for p, q in zip(twin.module.parameters(), opt_model.parameters())
            ),
            "warnings": [str(w.message) for w in caught if "bucket_cap_mb" in str(w.message)],
            "graphs": len(checkmate.plans_of(opt_model)),
        }
    Path(out, f"rank{rank}.json").write_text(json.dumps(doc))


def test_ddp_buckets_smaller_than_dynamos_first_one_compile_one_graph_warned_once(tmp_path: Path) -> None:
    # DDP(bucket_cap_mb=0.1) around an optimized module raised Dynamo's DDP optimizer's
    # AssertionError ("First bucket should be smaller/equal to other buckets"), as it does
    # under a plain torch.compile: the step now compiles as one graph, said once
    spawn(_small_buckets_worker, (free_port(), str(tmp_path)), WORLD)
    for r in range(WORLD):
        doc = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert doc["param_diff"] == 0.0, f"rank {r}: parameters differ from eager DDP by {doc['param_diff']}"
        assert len(doc["warnings"]) == 1 and "one graph" in doc["warnings"][0], doc["warnings"]
        assert doc["graphs"] == 1, doc
        assert max(doc["peaks"]) <= 1.05 * doc["budget"], (doc["peaks"], doc["budget"])


def _asleep(rank: int) -> None:
    time.sleep(600)


def test_ranks_still_running_at_their_deadline_are_killed_and_fail_the_test(
    capfd: pytest.CaptureFixture[str],
) -> None:
    # what keeps a rank that never exits from hanging the suite (it did once, in CI), and
    # says where each waited
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"rank\(s\) \[0, 1\] of _asleep still running"):
        spawn(_asleep, (), 2, deadline=5.0)
    assert time.monotonic() - t0 < 60
    err = capfd.readouterr().err
    assert err.count("Fatal Python error: Aborted") == 2, err  # each rank's stacks
