"""A training loop whose batches change shape: one plan serves the shapes of a graph.

Two epochs over batches of varying batch size and sequence length (lengths 1-5 and a short
last batch included), at a byte budget and at 0.5, on a TinyGPT-like transformer and a CNN
with BatchNorm: no step raises; every step of the second epoch (all compiled by then)
measures at most 1.05x the bytes its plan was made for; after every step the gradients,
parameters (SGD) and buffers equal those of an eager twin, bit for bit; and the number of
plans made stays small, the other shapes reusing a plan re-simulated at their sizes.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import checkmate
from checkmate.compiling import _signature
from checkmate.families import AHEAD_COST, FALLBACK, plan_ahead
from checkmate.memory import measure_peak
from checkmate.module_state import _STATE
from checkmate.runtime import Planner
from solvers.cost_bounds import recompute_lower_bound
from tests.integration import _models as M

pytestmark = pytest.mark.torch

#: (batch, sequence length): long batches, lengths 1-5, a short last batch
GPT_BATCHES = [(4, 48), (4, 40), (2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (3, 48)]
#: (batch, image side)
CNN_BATCHES = [(8, 16), (8, 12), (6, 16), (1, 16), (3, 12)]


def _gpt() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = M.TinyTransformer(64, 64, 2)
    return model, [torch.randint(0, 64, shape) for shape in GPT_BATCHES]


def _cnn() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = M.SmallCNN(8, 4)
    return model, [torch.randn(b, 3, s, s) for b, s in CNN_BATCHES]


MODELS: dict[str, Callable[[], tuple[nn.Module, list[torch.Tensor]]]] = {"gpt": _gpt, "cnn": _cnn}


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().square().mean().backward()


def _steps_as_twin(opt: nn.Module, twin: nn.Module, shapes: list[tuple[int, int]]) -> None:
    """One step of each on token batches of ``shapes``: the gradients are equal, bit for bit."""
    for shape in shapes:
        x = torch.randint(0, 64, shape)
        opt.zero_grad(set_to_none=True)
        twin.zero_grad(set_to_none=True)
        _step(opt, x)
        _step(twin, x)
        for p, q in zip(opt.parameters(), twin.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)


def _planner(model: nn.Module) -> Planner:
    return model.__dict__[_STATE].planner  # type: ignore[no-any-return]


def _step_budget(planner: Planner, x: torch.Tensor) -> int:
    """The bytes the plans of this input's step were made for (one graph per step here; its
    latest plan, where the step was compiled again)."""
    idx = planner.latest[_signature((x,), {})]
    return sum(planner.records[i].result.budget for i in idx)


def _byte_budget(model: nn.Module, x: torch.Tensor) -> int:
    """0.6x the eager step's measured peak at the largest batch: a budget every plan must
    recompute for at the largest shapes."""
    twin = copy.deepcopy(model)
    _step(twin, x)  # warm-up
    for p in twin.parameters():
        p.grad = None
    return int(0.6 * measure_peak(lambda: _step(twin, x)))


@pytest.mark.parametrize("budget_kind", ["bytes", "fraction"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_epoch_of_varying_shapes_plans_few_times_and_stays_in_budget(name: str, budget_kind: str) -> None:
    model, batches = MODELS[name]()
    budget: object = _byte_budget(model, batches[0]) if budget_kind == "bytes" else 0.5
    twin = copy.deepcopy(model)
    # one Dynamo entry per input shape, more than its default recompile limit (8):
    # optimize() gives its forward a limit of its own
    opt = checkmate.optimize(model, budget, profile="cpu", time_limit=2)
    sgd, twin_sgd = torch.optim.SGD(opt.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    lines = []
    for epoch in range(2):
        for x in batches:
            sgd.zero_grad(set_to_none=True)
            twin_sgd.zero_grad(set_to_none=True)
            if epoch == 0:
                _step(opt, x)
            else:
                measured = measure_peak(functools.partial(_step, opt, x))
                allowed = _step_budget(_planner(opt), x)
                lines.append(f"{tuple(x.shape)}: measured {measured:,} B, budget {allowed:,} B")
                assert measured <= 1.05 * allowed, lines[-1]
            _step(twin, x)
            for (k, p), q in zip(opt.named_parameters(), twin.parameters(), strict=True):
                assert p.grad is not None and q.grad is not None, k
                assert torch.equal(p.grad, q.grad), (tuple(x.shape), k)
            sgd.step()
            twin_sgd.step()
            for (k, b), c in zip(opt.named_buffers(), twin.buffers(), strict=True):
                assert torch.equal(b, c), (tuple(x.shape), k)
    planner = _planner(opt)
    shapes = len({tuple(x.shape) for x in batches})
    print(
        f"\n{name} at {budget}: {shapes} shapes, {len(planner.records)} graphs compiled, "
        f"{planner.plans_made} plans made\n  " + "\n  ".join(lines)
    )
    # every shape was compiled and planned (none eager); under a byte budget, the steps measured
    # (inside measure_peak) can have the module compiled again, once here: the room the first
    # plans left for a loss outside the module, where none is, given back
    assert all(_signature((x,), {}) in planner.latest for x in batches)
    assert shapes <= len(planner.records) <= (2 * shapes if budget_kind == "bytes" else shapes)
    assert planner.plans_made <= 3


def test_growing_shapes_under_a_byte_budget_plan_ahead() -> None:
    """Each length longer than every one before (the worst order for reuse): a byte budget's
    plan for a new largest shape is made for about twice its sizes (less where that does not
    fit the budget), so later lengths reuse it instead of planning once per length. The
    shorter lengths keep every value (no family plan): the first that recomputes is where
    planning ahead starts, and twice it is more than the budget holds.

    A plan made ahead is made for the bytes the budget leaves at the larger sizes (the room
    for a loss on the logits grows with the length), so each later length up to the stretch
    it was made for runs it; and it is not kept where it is dear at its own sizes (a graph
    stretched to near its least peak recomputes most values). Before, on torch 2.14.1 the
    plan made at length 40 for 1.5x was not reused at 60 (4 plans), and on 2.13 the plan
    made at 56 ran it, and 60 and 64, at +76% compute, where their own plans took +16%."""
    torch.manual_seed(0)
    model = M.TinyTransformer(64, 64, 2)
    lengths = list(range(12, 65, 4))  # 14 lengths, ascending
    twin = copy.deepcopy(model)
    big = torch.randint(0, 64, (4, lengths[-1]))
    budget = _byte_budget(twin, big)
    opt = checkmate.optimize(model, budget, profile="cpu", time_limit=2)
    _steps_as_twin(opt, twin, [(4, t) for t in lengths])
    planner = _planner(opt)
    print(f"\n{len(lengths)} ascending lengths at {budget:,} B: {planner.plans_made} plans made")
    for r in planner.records:
        assert r.result.peak is not None and r.result.peak <= budget  # simulated, at its sizes
    assert len(planner.records) == len(lengths)
    recomputing = [r for r in planner.records if r.recomputes]
    assert recomputing and planner.plans_made - 1 <= len(recomputing) // 2  # the first keeps all
    for i, r in enumerate(planner.records):
        factor = r.result.info.get("planned_ahead")
        if not factor:
            continue
        # it covers the later lengths it was made for
        covered = [j for j in range(i + 1, len(lengths)) if lengths[j] <= factor * lengths[i]]
        assert covered and all(planner.records[j].reused_from == i for j in covered), (i, factor)
        least = recompute_lower_bound(r.joint.graph, r.result.budget or budget)
        assert least is not None and (r.result.cost or 0) <= AHEAD_COST * least, r.summary()


def test_a_stretch_that_got_no_plan_ahead_is_not_solved_for_again_at_a_larger_graph() -> None:
    # each try of a stretch is a solve, up to the time limit where it has no plan: one that
    # got none at a graph is not tried at a larger one of the family, where it is larger still
    from types import SimpleNamespace

    from solvers.errors import CheckmateError
    from solvers.graph import Graph
    from solvers.schedule import keep_all_peak

    def sized(mem: int) -> Graph:
        nodes = [{"key": i, "name": f"f{i}", "cost": 1.0, "mem": mem} for i in range(6)]
        return Graph.build(nodes, [(i, i + 1) for i in range(5)])

    old, mid, large = sized(100), sized(120), sized(140)
    records = [SimpleNamespace(joint=SimpleNamespace(graph=old), reference_peak=keep_all_peak(old))]
    tried: list[int] = []

    def solve(graph: Graph, budget: object) -> object:
        tried.append(keep_all_peak(graph))
        raise CheckmateError("no schedule")

    got, ceiling = plan_ahead(mid, keep_all_peak(mid), records, [0], 10_000, solve)  # type: ignore[arg-type]
    assert got is None and len(tried) == 1 + len(FALLBACK)  # every stretch, each solved for
    assert ceiling == min(tried)
    tried.clear()
    got, again = plan_ahead(large, keep_all_peak(large), records, [0], 10_000, solve, ceiling=ceiling)  # type: ignore[arg-type]
    assert got is None and again == ceiling
    assert tried == []  # 1.1x of the larger graph is larger than 1.1x of the one before


def test_the_family_target_is_the_graphs_own_bytes_net_of_what_ddp_holds_beside_it() -> None:
    # reusing a family's plan at new sizes is checked against these bytes: with DDP's
    # gradient buckets left in, a reused plan could run over the per-rank budget by them
    from types import SimpleNamespace

    from checkmate.families import family_target
    from solvers.budget import Budget

    records = [SimpleNamespace(budget=700, result=SimpleNamespace(budget=700))]  # planned net of a reserve
    target, nbytes = family_target(Budget(nbytes=1000), 2000, records, [0], reserve=300)  # type: ignore[arg-type]
    assert nbytes == 700 and target.nbytes == 700
    # a fraction: its bytes less the reserve, never below what the family was planned at
    assert family_target(Budget(fraction=0.5), 2000, records, [0], reserve=200)[1] == 800  # type: ignore[arg-type]
    assert family_target(Budget(fraction=0.5), 1000, records, [0], reserve=200)[1] == 700  # type: ignore[arg-type]
    assert family_target(Budget(fraction=0.5), 2000, records, [], reserve=200) == (Budget(fraction=0.5), None)  # type: ignore[arg-type]
    assert family_target(Budget.least_peak(), 2000, records, [0], reserve=200)[1] is None  # type: ignore[arg-type]
    # a plan checked compiled was solved at 900 simulated bytes to hold 700 measured: the floor is 700
    checked = [SimpleNamespace(budget=700, result=SimpleNamespace(budget=900))]
    assert family_target(Budget(fraction=0.5), 1000, checked, [0], reserve=200)[1] == 700  # type: ignore[arg-type]


def test_a_short_batch_where_keeping_every_value_fits_recomputes_nothing() -> None:
    """A batch whose graph, keeping every value, fits the bytes its family was planned at
    runs without recomputation (no family plan recomputes less), is not counted as a plan
    made and leaves its gradients equal to eager's."""
    torch.manual_seed(0)
    model = M.TinyTransformer(64, 64, 2)
    twin = copy.deepcopy(model)
    opt = checkmate.optimize(model, 0.5, profile="cpu", time_limit=2)
    _steps_as_twin(opt, twin, [(4, 48), (4, 16)])
    planner = _planner(opt)
    full, short = planner.records
    assert full.recomputes > 0, full.summary()
    assert short.reference_peak <= (full.result.budget or 0), short.summary()  # keep-all fits
    assert short.recomputes == 0 and short.reused_from is None, short.summary()
    assert "keeping every value fits" in short.summary()
    assert " +0.0% compute" in short.summary(), short.summary()  # not "+-0.0%"
    assert planner.plans_made == 1


def test_a_plan_the_compiled_check_solved_at_more_bytes_carries_over_at_that_ratio() -> None:
    # Inductor's step held 0.8x what the kept plan simulates: at new sizes the family's plan
    # may simulate up to 1.25x the bytes asked, and the check then holds it to those bytes
    from types import SimpleNamespace

    from checkmate.compiled import Calibration, Round
    from checkmate.families import reuse
    from checkmate.records import HELD_TO
    from solvers.schedule import keep_all_peak
    from solvers.strategies.baselines import checkpoint_all
    from tests.graphs import chain

    big, small = chain(8, mem=4, training=True), chain(8, mem=3, training=True)
    solved = keep_all_peak(big)
    plan = checkpoint_all(big, solved)
    held = int(0.8 * solved)
    check = Calibration(0, (Round(solved, solved, held),), held)
    checked = SimpleNamespace(result=plan, joint=SimpleNamespace(graph=big), compiled=check, budget=held)
    target = int(keep_all_peak(small) / 1.1)  # under the plan's simulated peak at these sizes
    got = reuse(small, keep_all_peak(small), [checked], [0], target)  # type: ignore[list-item]
    assert got is not None and got[1] == 0
    assert got[0].info[HELD_TO] == target and got[0].budget == int(target * solved / held)
    assert got[0].peak is not None and target < got[0].peak <= got[0].budget
    # a plan not checked compiled (or that did not fit) carries over at the bytes asked only
    unchecked = SimpleNamespace(result=plan, joint=SimpleNamespace(graph=big), compiled=None, budget=solved)
    assert reuse(small, keep_all_peak(small), [unchecked], [0], target) is None  # type: ignore[list-item]
    over = SimpleNamespace(
        **{**vars(checked), "compiled": Calibration(0, (Round(solved, solved, solved),), held)}
    )
    assert reuse(small, keep_all_peak(small), [over], [0], target) is None  # type: ignore[list-item]


def test_a_family_plan_is_polished_at_new_sizes_and_planned_anew_where_it_stays_far_costlier() -> None:
    # a plan made for a longer sequence recomputes what a shorter one has room to keep: a
    # Hugging Face BERT's plan for 64 tokens ran its 40-token batch at +34.4% compute, at a
    # byte budget that batch nearly fitted whole. Polished there, it keeps those values; where
    # the caller refuses the polished plan, the plan as carried over is far costlier and the
    # graph is planned anew
    from types import SimpleNamespace

    from checkmate.families import REUSE_COST, reuse
    from solvers.api import solve
    from solvers.boundary import boundary_hold
    from solvers.budget import Budget
    from solvers.cost_bounds import recompute_lower_bound
    from solvers.resize import transfer_and_check
    from solvers.schedule import keep_all_peak, validate
    from tests.graphs import chain

    big, small = chain(16, mem=4, training=True), chain(16, mem=3, training=True)
    tight = int(0.4 * keep_all_peak(big))
    plan = solve(big, Budget(nbytes=tight), "auto", time_limit=5)
    assert plan.ok and plan.schedule is not None and plan.cost is not None
    rec = SimpleNamespace(result=plan, joint=SimpleNamespace(graph=big), compiled=None, budget=tight)
    # as tight at the new sizes: the plan carries over, within REUSE_COST of the least cost there
    got = reuse(small, keep_all_peak(small), [rec], [0], tight)  # type: ignore[list-item]
    least = recompute_lower_bound(small, tight)
    assert got is not None and least is not None and (got[0].cost or 0) <= REUSE_COST * least
    # nearly room for every value: the plan as carried over is far costlier than a fresh one...
    roomy = keep_all_peak(small) - 1
    carried = transfer_and_check(big, plan.schedule, small, roomy)
    assert carried is not None
    fresh = solve(small, Budget(nbytes=roomy), "auto", time_limit=5)
    assert fresh.ok and (fresh.cost or 0) * REUSE_COST < carried[1].cost, (fresh.cost, carried[1].cost)
    # ... and polished within the bytes it keeps what it recomputed, as cheap as the fresh plan
    polished = reuse(small, keep_all_peak(small), [rec], [0], roomy)  # type: ignore[list-item]
    assert polished is not None and polished[0].schedule is not None
    assert polished[0].info["kept_resident"] > 0
    assert (polished[0].cost or 0) <= REUSE_COST * (recompute_lower_bound(small, roomy) or 0)
    assert validate(small, polished[0].schedule, roomy).cost == polished[0].cost
    # refused (it holds more at the forward/backward boundary than the carried plan does):
    # the carried plan is far costlier than the new sizes need, and the graph is planned anew
    bound = boundary_hold(small, carried[0])
    assert boundary_hold(small, polished[0].schedule) > bound
    refused = reuse(
        small, keep_all_peak(small), [rec], [0], roomy, lambda r: boundary_hold(small, r.schedule) <= bound
    )  # type: ignore[list-item]
    assert refused is None


@pytest.mark.parametrize("start_frozen", [True, False], ids=["unfreeze", "freeze"])
def test_parameters_frozen_or_unfrozen_mid_training_are_planned_again_with_eager_gradients(
    start_frozen: bool,
) -> None:
    """Fine-tuning schedules change ``requires_grad`` between steps (a backbone frozen, then
    trained): the step is planned again, and the gradients equal eager's at every step; a
    parameter unfrozen gets its gradient, a frozen one none."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))
    twin = copy.deepcopy(model)
    for m in (model, twin):
        for p in m[0].parameters():  # type: ignore[index]
            p.requires_grad_(not start_frozen)
    opt = checkmate.optimize(model, 0.85, time_limit=3)
    x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
    for phase in range(2):
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(opt(x), y).backward()
        nn.functional.cross_entropy(twin(x), y).backward()
        trained = start_frozen == (phase == 1)
        assert all((p.grad is not None) == trained for p in model[0].parameters()), phase  # type: ignore[index]
        for p, q in zip(model.parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), phase
        for m in (model, twin):
            for p in m[0].parameters():  # type: ignore[index]
                p.requires_grad_(start_frozen)
    assert len(checkmate.plans_of(opt)) == 2


def test_a_module_unfrozen_after_eight_others_of_its_class_were_optimized_is_planned_again() -> None:
    """Dynamo counted the compiles of every optimized module of one class against one
    recompile limit (8): past it, a parameter unfrozen mid-training made the step run
    eagerly, unplanned, with nothing said. Each optimized module counts its own."""

    def mlp() -> nn.Sequential:
        return nn.Sequential(
            nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10)
        )

    x, y = torch.randn(1024, 64), torch.randint(0, 10, (1024,))
    torch.manual_seed(0)
    for _ in range(8):  # other models of the same class in the process (a sweep, EMA copies)
        other = checkmate.optimize(mlp(), 0.85, time_limit=3)
        nn.functional.cross_entropy(other(x), y).backward()
    model = mlp()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        for p in m[0].parameters():  # type: ignore[index]
            p.requires_grad_(False)
    opt = checkmate.optimize(model, 0.85, time_limit=3)
    for _ in range(2):
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(opt(x), y).backward()
        nn.functional.cross_entropy(twin(x), y).backward()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert (p.grad is None) == (q.grad is None)
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad)
        for m in (model, twin):
            for p in m[0].parameters():  # type: ignore[index]
                p.requires_grad_(True)
    assert len(checkmate.plans_of(opt)) == 2  # planned again once unfrozen, not run eagerly


class _Scheduled(nn.Module):
    """A forward given the step's number and a temperature as Python numbers, a flag, and an
    epoch it does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))

    def forward(
        self, x: torch.Tensor, step: object, temperature: object = 1.0, clip: bool = False, epoch: int = 0
    ) -> torch.Tensor:
        out = self.body(x) * (1.0 + 0.001 * step) / temperature  # type: ignore[operator]
        return out.clamp(-1, 1) if clip else out


def test_a_python_number_that_changes_at_every_call_warns_once_naming_it() -> None:
    # Dynamo specializes Python numbers under static shapes: each value compiles and plans the
    # step again (25 plans in 25 calls, unwarned, before); a tensor holding it compiles once, and
    # a number the forward does not read compiles nothing (no guard on it): no warning
    import warnings

    x = torch.randn(64, 32)
    opt = checkmate.optimize(_Scheduled(), 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):  # the flag takes two values: a flag, not a counter
            opt(x, step, temperature=2.0, clip=bool(step % 2)).sum().backward()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.OverheadWarning)]
    assert len(said) == 1 and "Python number among the module's inputs (step) took 4 values" in said[0], said
    assert len(checkmate.plans_of(opt)) == 6

    tensors = checkmate.optimize(_Scheduled(), 1.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(6):
            tensors(x, torch.tensor(step), temperature=torch.tensor(2.0 + step), epoch=step).sum().backward()
    assert not [w for w in caught if issubclass(w.category, checkmate.OverheadWarning)]
    assert len(checkmate.plans_of(tensors)) == 1


class _Tagger(nn.Module):
    """A token tagger given ids and a mask, of a batch's length."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 5))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(ids)) * mask.unsqueeze(-1)


def test_inputs_whose_sizes_change_from_batch_to_batch_warn_once_naming_the_dimension() -> None:
    # a length that varies from batch to batch (dynamic padding) compiles and plans the step at
    # each size, unwarned before (a 2-layer GPT-2 at lengths 32-128: 4-5 s a shape, 24 plans in 12
    # calls); a few buckets and a short last batch, repeated, are planned once each, unwarned
    import warnings

    from checkmate.recompiles import SHAPES_PLANNED

    opt = checkmate.optimize(_Tagger(), 1.0)
    g = torch.Generator().manual_seed(0)

    def call(rows: int, length: int) -> list[str]:
        ids = torch.randint(0, 100, (rows, length), generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt(ids, torch.ones(rows, length)).sum().backward()
        return [str(w.message) for w in caught if issubclass(w.category, checkmate.OverheadWarning)]

    for _ in range(3):  # three buckets and a short last batch, three epochs: 4 shapes in 12 calls
        for rows, length in [(4, 16), (4, 32), (4, 64), (3, 64)]:
            assert not call(rows, length)
    said = [m for length in range(8, 8 + SHAPES_PLANNED - 4) for m in call(4, length)]  # the 8th shape
    assert len(said) == 1, said
    assert f"planned at {SHAPES_PLANNED} input shapes" in said[0]
    assert "ids dimension 1: 7 sizes, 8 to 64" in said[0] and "mask dimension 1: 7 sizes, 8 to 64" in said[0]
    assert "ids dimension 0: 2 sizes, 3 to 4" in said[0] and "pad_to_multiple_of" in said[0]
    assert not call(4, 12) + call(4, 13)  # once
    assert len(checkmate.plans_of(opt)) == SHAPES_PLANNED + 2  # warned, each shape still planned


class _Counted(nn.Module):
    """A block that counts its calls in a Python int and scales its output by them (a warmup
    factor kept on the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(x).pow(2).mean() * min(1.0, self.calls / 100)


class _MaskedHead(nn.Module):
    """A masked-token model whose head runs on the masked positions only (``h[labels != -100]``):
    their count, a size that depends on the labels' values, ends a graph."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.head = nn.Linear(32, 100)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.body(self.embed(labels.clamp(min=0)) + x)
        picked = labels != -100
        return nn.functional.cross_entropy(self.head(h[picked]), labels[picked])


class _Metrics(nn.Module):
    """A block that keeps each call's mean activation in a list on the module (metrics logged
    later): Dynamo guards the list's length."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.means: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        self.means.append(h.detach().mean())
        return h.pow(2).mean()


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (_Counted, "self.calls == "),
        (_MaskedHead, "size mismatch at index 0"),
        (_Metrics, "A list or dict the forward appends to"),
    ],
    ids=["module-int-attribute", "masked-positions", "metrics-list"],
)
def test_a_step_compiled_again_at_the_same_input_sizes_warns_once_naming_the_guard(
    make: Callable[[], nn.Module], named: str
) -> None:
    # inputs of one shape, yet each call compiled and planned the step again, unwarned before:
    # a Python int on the module (Dynamo specializes it) or, after a graph break, a count of
    # masked positions (a masked-token model: a new size at almost every batch), until the
    # compile limit raised after 1,024 calls
    import warnings

    from checkmate.recompiles import RECOMPILES_PLANNED

    torch.manual_seed(0)
    opt = checkmate.optimize(make(), "1GiB")  # bytes: the step runs compiled, planned or not
    x = torch.randn(4, 16, 32)

    def call(masked: int) -> list[str]:
        opt.zero_grad()  # no gradients accumulated (a call finding them compiles again)
        labels = torch.full((4, 16), -100)
        labels.view(-1)[:masked] = torch.arange(masked) % 100  # a count of its own at each call
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt(x, labels).backward()
        return [str(w.message) for w in caught if issubclass(w.category, checkmate.OverheadWarning)]

    assert not call(10)
    said = [m for masked in range(11, 11 + RECOMPILES_PLANNED) for m in call(masked)]
    assert len(said) == 1, said  # at the last of them
    assert f"compiled and planned again at {RECOMPILES_PLANNED} calls whose inputs kept" in said[0]
    assert named in said[0] and "_training_loop.py" in said[0], said[0]
    assert "keep it in a tensor" in said[0] and "ignore_index" in said[0]
    assert ("A list or dict" in said[0]) == (make is _Metrics)  # said where a length was guarded
    assert not call(30) + call(31)  # once
    assert len(checkmate.plans_of(opt)) >= RECOMPILES_PLANNED + 3  # warned, each still planned


@pytest.mark.parametrize("others", [False, True])
def test_gradual_unfreezing_compiles_again_unwarned(others: bool) -> None:
    # a layer unfrozen at each call (ULMFiT-style gradual unfreezing): the step trains other
    # parameters each time and is planned again, as it must be, without the warning above,
    # whose advice (keep a number in a tensor, mask instead of selecting) does not apply.
    # (others) Modules of the same class torch.compile'd in the process share the forward's
    # code: the guards of their compiles fail at this module's calls too, and are not its
    # recompiles (counted, they warned at the 8th layer)
    import warnings

    from checkmate.recompiles import RECOMPILES_PLANNED

    if others:
        for width in (16, 24):
            other = torch.compile(nn.Sequential(nn.Linear(16, width), nn.ReLU()))
            other(torch.randn(8, 16)).sum().backward()
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(RECOMPILES_PLANNED + 2)]
    )
    model.requires_grad_(False)
    opt = checkmate.optimize(model, "1GiB")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in reversed(model):
            layer.requires_grad_(True)
            opt(torch.randn(64, 32)).pow(2).mean().backward()
    assert not [w for w in caught if issubclass(w.category, checkmate.OverheadWarning)], [
        str(w.message) for w in caught
    ]
    assert len(checkmate.plans_of(opt)) == len(model)  # each planned
    assert all(p.grad is not None for p in model.parameters())


class _Checkpointed(nn.Module):
    """Blocks run under torch.utils.checkpoint, as timm's set_grad_checkpointing() runs them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
            for _ in range(4)
        )
        self.head = nn.Linear(128, 10)

    def forward(self, x: Any) -> Any:
        for block in self.blocks:
            x = x + torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return self.head(x.mean(1))


def test_a_step_run_under_torch_utils_checkpoint_is_planned_whole_and_a_fraction_warned_of() -> None:
    # Dynamo captures the checkpointed blocks in the step's graph (their ops tagged): checkmate
    # plans what to recompute itself. A fraction is of the step keeping every value, which the
    # checkpoint calls would have lowered: warned once. A byte budget at the checkpointed eager
    # step's peak is met, with gradients equal to that step's
    import warnings

    x, y = torch.randn(8, 256, 128), torch.randint(0, 10, (8,))
    eager = _Checkpointed()

    def step(m: Any) -> None:
        nn.functional.cross_entropy(m(x), y).backward()

    step(eager)
    eager.zero_grad(set_to_none=True)
    checkpointed = measure_peak(lambda: step(eager))
    grads = [p.grad.clone() for p in eager.parameters()]
    for budget in (0.6, checkpointed):
        model = copy.deepcopy(eager)
        model.zero_grad(set_to_none=True)
        opt = checkmate.optimize(model, budget)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                step(opt)
        said = [str(w.message) for w in caught if "torch.utils.checkpoint" in str(w.message)]
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
        if isinstance(budget, float):
            assert len(said) == 1 and issubclass(caught[0].category, checkmate.BudgetWarning), said
            assert "fraction (0.6)" in said[0] and "in bytes" in said[0]
            assert checkmate.plans_of(opt)[0].result.peak > checkpointed  # more than the calls held
        else:
            assert not said
            model.zero_grad(set_to_none=True)
            measured = measure_peak(functools.partial(step, opt))
            print(f"\ncheckpointed eager {checkpointed:,} B, planned {measured:,} B")
            assert measured <= 1.02 * checkpointed


def test_a_batch_of_one_through_batchnorm_raises_eagers_value_error_and_the_next_batch_steps() -> None:
    # BatchNorm1d in training refuses one sample with ValueError; Dynamo, tracing the step on fake
    # tensors, wraps it in TorchRuntimeError. A loop that skips such a batch with
    # ``except ValueError`` must work under checkmate as in eager, and leave the model stepping
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(256, 512),
        nn.BatchNorm1d(512),
        nn.ReLU(),
        nn.Linear(512, 256),
        nn.Tanh(),
        nn.Linear(256, 256),
    )
    twin = copy.deepcopy(model)
    opt = checkmate.optimize(model, "min")
    x = torch.randn(512, 256)
    for m in (opt, twin):
        m(x).sum().backward()
    with pytest.raises(ValueError, match="more than 1 value per channel") as raised:
        opt(torch.randn(1, 256))
    assert type(raised.value) is ValueError
    assert any("Dynamo traced the optimized step" in n for n in getattr(raised.value, "__notes__", []))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        twin(torch.randn(1, 256))  # what eager raised, for comparison
    for m in (opt, twin):
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    assert torch.equal(model[1].running_mean, twin[1].running_mean)


def test_forward_hooks_registered_or_removed_between_steps_run_as_in_eager() -> None:
    """A forward hook registered on a submodule after the step was compiled (activation
    statistics, a feature tap, a hook that edits the output) runs as in eager, and one removed
    stops running: Dynamo skips guards on module hooks by default, and such a hook never ran.
    Every step's output and gradients equal an eager twin's that has the same hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    twin = copy.deepcopy(model)
    opt = checkmate.optimize(model, 0.9, time_limit=3)
    x = torch.randn(2048, 64)
    seen: list[str] = []
    handles: dict[str, list[Any]] = {"model": [], "twin": []}

    def scale(factor: float, name: str) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
            seen.append(name)
            return out * factor

        return hook

    def pre(module: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return (args[0].clamp(-0.5, 0.5),)

    # (what to do before the step, where): none, a hook added, removed, another added, a pre-hook
    phases: list[Callable[[nn.Module, str], None]] = [
        lambda m, k: None,
        lambda m, k: handles[k].append(m[2].register_forward_hook(scale(0.5, k))),
        lambda m, k: handles[k].pop().remove(),
        lambda m, k: handles[k].append(m[2].register_forward_hook(scale(-2.0, k))),
        lambda m, k: handles[k].append(m[3].register_forward_pre_hook(pre)),
        lambda m, k: [h.remove() for h in handles[k]],
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for phase, change in enumerate(phases):
            change(model, "model")
            change(twin, "twin")
            seen.clear()
            for m in (model, twin):
                m.zero_grad(set_to_none=True)
            got, want = opt(x), twin(x)
            got.square().mean().backward()
            want.square().mean().backward()
            assert seen.count("model") == seen.count("twin"), (phase, seen)
            assert torch.equal(got, want), phase
            for p, q in zip(model.parameters(), twin.parameters()):
                assert torch.equal(p.grad, q.grad), phase  # type: ignore[arg-type]
    # every step ran planned: the hooked ones compiled, and planned, again
    assert not [w for w in caught if issubclass(w.category, checkmate.UnplannedWarning)]
    plans = checkmate.plans_of(opt)
    assert len(plans) >= 3 and any(r.recomputes > 0 for r in plans), [r.recomputes for r in plans]
    # a module backward hook, which Dynamo does not trace: the step runs eagerly, warned, naming it
    ran: list[str] = []
    model[0].register_full_backward_hook(lambda m, gi, go: ran.append("hook"))  # type: ignore[index]
    with pytest.warns(checkmate.UnplannedWarning, match=r"Sequential\.0 has one"):
        opt(x).square().mean().backward()
    assert ran == ["hook"]


def test_global_forward_hooks_run_as_in_eager_and_a_flop_counted_step_compiles_nothing_again() -> None:
    """A global module forward hook (``register_module_forward_hook``) registered between steps
    runs, and stops running once removed: Dynamo guards on none, and it never ran. A step run
    under a ``FlopCounterMode`` (an MFU logged every few steps), which Dynamo runs as written,
    is warned of once, and the plain steps after it run their plan: each was compiled again."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 10))
    twin = copy.deepcopy(model)
    opt = checkmate.optimize(model, 0.9, time_limit=3)
    x = torch.randn(2048, 64)

    def halve(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * 0.5 if isinstance(module, nn.Tanh) else None

    def same_step() -> None:
        for m in (model, twin):
            m.zero_grad(set_to_none=True)
        got, want = opt(x), twin(x)
        got.square().mean().backward()
        want.square().mean().backward()
        assert torch.equal(got, want)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)  # type: ignore[arg-type]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same_step()
        handle = register_module_forward_hook(halve)
        try:
            same_step()  # the hook runs in both
        finally:
            handle.remove()
        same_step()  # and in neither
    # every step ran planned: the hooked one compiled, and planned, again
    assert not [w for w in caught if issubclass(w.category, checkmate.UnplannedWarning)]
    plans = checkmate.plans_of(opt)
    assert len(plans) >= 2 and any(r.recomputes > 0 for r in plans), [r.recomputes for r in plans]
    planned = len(plans)
    with pytest.warns(checkmate.UnplannedWarning, match="a dispatch mode is active"):
        for _ in range(3):
            with FlopCounterMode(display=False) as flops:
                opt(x).square().mean().backward()
            assert flops.get_total_flops() > 0
            same_step()
    assert len(checkmate.plans_of(opt)) == planned
