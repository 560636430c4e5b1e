"""A budget that cannot be met costs one call: the error's ``minimum`` plans on the first try.

For models of different kinds (a CNN with BatchNorm, a transformers model, a two-output
MLP, a DenseNet-like concatenating CNN, a transformer block with dropout), a fraction far
below what any schedule needs raises :class:`InfeasibleBudgetError` whose ``minimum`` is
the peak of a schedule actually found; ``optimize(model, exc.minimum)`` then plans on the
first call and the step's measured peak stays within 5% of it. ``budget="min"`` plans at
the least peak found, in one call.
"""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import checkmate
from checkmate.memory import measure_peak
from checkmate.stepcheck import STEP_SLACK
from solvers.errors import InfeasibleBudgetError
from tests.integration._dist import fake_ddp_reserve
from tests.integration._models import Block, SmallCNN, TinyTransformer, gpt2

pytestmark = pytest.mark.torch

TIME_LIMIT = 5.0


class TwoHeads(nn.Module):
    """An MLP trunk with two output heads (a classifier and a regressor)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU())
        self.cls = nn.Linear(256, 10)
        self.reg = nn.Linear(256, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.cls(h), self.reg(F.relu(h))


class DenseLayer(nn.Module):
    def __init__(self, c_in: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, growth, 3, padding=1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.conv(F.relu(self.bn(x)))], dim=1)


class DenseNetLike(nn.Module):
    """Dense blocks: each layer concatenates its output to everything before it."""

    def __init__(self, growth: int = 8, layers: int = 4) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.layers = nn.Sequential(*(DenseLayer(16 + k * growth, growth) for k in range(layers)))
        self.head = nn.Linear(16 + layers * growth, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.stem(x)).mean(dim=(2, 3)))


class DropoutBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block(64, p=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class GPT2Loss(nn.Module):
    """A transformers GPT-2 whose forward ends in the loss. Memory the caller's own code
    allocates outside the optimized module (a loss over 64 KiB of logits) is not part of
    the plan: at a budget of 1.2 MB it alone is 5% of it."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt2 = gpt2(n_layer=2, n_embd=64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.gpt2(ids).logits.float().pow(2).mean()


def _hf_gpt2() -> nn.Module:
    return GPT2Loss()


#: name -> (model factory, inputs)
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]] = {
    "cnn_batchnorm": (lambda: SmallCNN(8, 2), lambda: (torch.randn(8, 3, 16, 16),)),
    "hf_gpt2": (_hf_gpt2, lambda: (torch.randint(0, 128, (4, 32)),)),
    "two_heads": (TwoHeads, lambda: (torch.randn(256, 64),)),
    "densenet_like": (DenseNetLike, lambda: (torch.randn(4, 3, 16, 16),)),
    "dropout_block": (DropoutBlock, lambda: (torch.randn(4, 32, 64),)),
}


def _loss(out: Any) -> torch.Tensor:
    if hasattr(out, "logits"):
        out = out.logits
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    return torch.stack([x.float().pow(2).mean() for x in leaves]).sum()


def _step(model: nn.Module, inputs: tuple[Any, ...]) -> None:
    for p in model.parameters():
        p.grad = None
    _loss(model(*inputs)).backward()


def _fresh(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    make, inputs = MODELS[name]
    torch.manual_seed(0)
    return make().train(), inputs()


def _spy_searches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int | None, float | None]]:
    """Records, per plan search the planner starts, its budget's bytes and its time limit."""
    import checkmate.planning

    searched: list[tuple[int | None, float | None]] = []
    solve = checkmate.planning.cached_solve

    def spy(graph: Any, budget: Any, *args: Any, **kwargs: Any) -> Any:
        searched.append((budget.nbytes, kwargs.get("time_limit")))
        return solve(graph, budget, *args, **kwargs)

    monkeypatch.setattr(checkmate.planning, "cached_solve", spy)
    return searched


@pytest.mark.parametrize("name", list(MODELS))
def test_the_minimum_of_an_infeasible_budget_plans_on_the_first_try(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, inputs = _fresh(name)
    with pytest.raises(InfeasibleBudgetError) as info:
        checkmate.optimize(copy.deepcopy(model), 0.02, inputs, time_limit=TIME_LIMIT)
    exc = info.value
    assert exc.lower_bound is not None and exc.minimum is not None
    assert exc.budget < exc.lower_bound <= exc.minimum
    # what more memory buys: the schedules the search found, the least peak first, each one
    # higher than the one before and cheaper, up to keep-all at no extra compute
    assert exc.tradeoffs and exc.tradeoffs[0][0] == exc.minimum, exc.tradeoffs
    assert all(p1 < p2 and c1 > c2 for (p1, c1), (p2, c2) in itertools.pairwise(exc.tradeoffs))
    assert exc.tradeoffs[-1][1] == pytest.approx(0.0, abs=1e-9)
    assert "compute" in str(exc)

    # the retry searches below the minimum briefly if at all: its first try leaves room for a
    # loss outside the module, below the least peak found, and spent the whole time limit
    # there in vain (a two-headed MLP's retry took 31 s at a 30 s limit, 2 s now)
    searched = _spy_searches(monkeypatch)
    opt = checkmate.optimize(copy.deepcopy(model), exc.minimum, inputs, time_limit=TIME_LIMIT)
    below = [limit for nbytes, limit in searched if nbytes is not None and nbytes < exc.minimum]
    assert searched and all(limit is not None and limit < TIME_LIMIT / 2 for limit in below), searched
    plans = checkmate.plans_of(opt)
    assert plans, "nothing was planned"
    assert all(p.result.ok and p.result.peak is not None and p.result.peak <= exc.minimum for p in plans)
    _step(opt, inputs)  # warm-up: the first call planned
    peak = measure_peak(lambda: _step(opt, inputs))
    assert peak <= 1.05 * exc.minimum, f"measured {peak:,} bytes for a budget of {exc.minimum:,}"


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "cache-off"])
def test_a_retry_in_a_new_process_searches_briefly_below_the_minimum_recorded(
    recorded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the usual retry: the script stops at the error and runs again with exc.minimum. The
    # least peak found is recorded beside the plan cache; the new process (no search
    # memoized) reads it, and its first try, below the minimum, is searched briefly
    from solvers.strategies import least_peak

    if not recorded:
        monkeypatch.setenv("CHECKMATE_CACHE", "0")
    model, inputs = _fresh("two_heads")
    with pytest.raises(InfeasibleBudgetError) as info:
        checkmate.optimize(copy.deepcopy(model), 0.02, inputs, time_limit=TIME_LIMIT)
    minimum = info.value.minimum
    assert minimum is not None
    least_peak._MEMO.clear()  # a new process
    searched = _spy_searches(monkeypatch)
    opt = checkmate.optimize(copy.deepcopy(model), minimum, inputs, time_limit=TIME_LIMIT)
    assert checkmate.plans_of(opt)
    below = [limit for nbytes, limit in searched if nbytes is not None and nbytes < minimum]
    assert below, f"no try below the minimum: nothing to test ({searched})"
    # with the cache off nothing was recorded: the whole time limit, as before the record
    assert all((limit is not None and limit < TIME_LIMIT / 2) == recorded for limit in below), searched


@pytest.mark.parametrize("name", ["cnn_batchnorm", "two_heads", "densenet_like"])
def test_budget_min_plans_in_one_call(name: str) -> None:
    model, inputs = _fresh(name)
    opt = checkmate.optimize(model, "min", inputs, time_limit=TIME_LIMIT)
    plans = checkmate.plans_of(opt)
    assert plans and all(p.result.ok for p in plans)
    # the least peak found is below what keeping everything needs (something was dropped)
    assert all(p.result.peak is not None and p.result.peak < p.reference_peak for p in plans)
    assert sum(p.recomputes for p in plans) > 0


def test_an_infeasible_budget_says_what_was_held_beside_the_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    # inside DDP's forward the gradient buckets are taken off the budget: the bytes the error
    # names are the graph's own, and a note says where the rest of the budget went

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    fake_ddp_reserve(monkeypatch, 3 << 20)
    torch.manual_seed(0)
    opt = checkmate.optimize(SmallCNN(8, 2).train(), 0.6, time_limit=2)
    with pytest.raises(InfeasibleBudgetError) as caught:
        opt(torch.randn(8, 3, 16, 16)).sum().backward()
    assert any("3.00 MiB of the budget asked is held beside this graph" in n for n in caught.value.notes)
    # in the message itself, which a loop that logs str(exc) shows (a traceback's notes it does not)
    assert "\n3.00 MiB of the budget asked is held beside this graph" in str(caught.value)


def test_an_infeasible_byte_budget_names_the_budget_that_fits_in_the_users_terms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the error's figures are the graph's own bytes, the reserve beside it taken off: a user
    # passing the least peak it named was refused again. The note names the budget to pass,
    # and what was held (only what was: not FSDP2's parameters in a DDP run)

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    fake_ddp_reserve(monkeypatch, 3 << 20)
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    opt = checkmate.optimize(SmallCNN(8, 2).train(), (3 << 20) + (40 << 10), time_limit=2)
    with pytest.raises(InfeasibleBudgetError) as caught:
        opt(x).sum().backward()
    notes = "\n".join(caught.value.notes)
    assert "held beside this graph (DDP's buckets)" in notes, notes
    found = re.search(
        r"a budget of at least [0-9.]+ [KMG]?i?B \(([0-9,]+) bytes\) leaves (it|this graph) the least peak",
        notes,
    )
    assert found, notes
    fits = int(found.group(1).replace(",", ""))
    assert caught.value.minimum is not None and fits > caught.value.minimum + (3 << 20) - 1
    torch.manual_seed(0)
    again = checkmate.optimize(SmallCNN(8, 2).train(), fits, time_limit=2)
    again(x).sum().backward()  # the budget named fits
    assert checkmate.plans_of(again)


def test_an_infeasible_byte_budget_with_a_loss_outside_names_the_budget_with_room_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the error's least peak is the graph's own: a language model whose cross-entropy is
    # computed on its logits, optimized again at it, stepped at 1.43x it (a Hugging Face
    # GPT-2). The note names the budget with room for the loss, and steps fit it
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    torch.manual_seed(0)
    base = TinyTransformer(512, 64, 2)
    x = torch.randint(0, 512, (8, 64))

    def step(m: nn.Module) -> None:
        F.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()

    eager = copy.deepcopy(base)
    step(eager)
    eager.zero_grad(set_to_none=True)
    peak = measure_peak(lambda: step(eager))
    opt = checkmate.optimize(copy.deepcopy(base), int(0.3 * peak), time_limit=4)
    with pytest.raises(InfeasibleBudgetError) as caught:
        step(opt)
    notes = "\n".join(caught.value.notes)
    found = re.search(r"in all, a budget of at least [0-9.]+ [KMG]?i?B \(([0-9,]+) bytes\)", notes)
    assert found and "outside the module" in notes, str(caught.value)
    fits = int(found.group(1).replace(",", ""))
    assert caught.value.minimum is not None and fits > caught.value.minimum
    again = checkmate.optimize(copy.deepcopy(base), fits, time_limit=4)
    peaks = []
    for _ in range(4):
        peaks.append(measure_peak(lambda: step(again)))
        again.zero_grad(set_to_none=True)
    assert all(p <= STEP_SLACK * fits for p in peaks[2:]), [p / fits for p in peaks]


def test_an_infeasible_byte_budget_with_a_reserve_and_a_loss_outside_names_one_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # both notes named a budget to pass: the reserve's without room for the loss, then the
    # one in all. Only the one in all is left, and it counts the reserve

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    fake_ddp_reserve(monkeypatch, 1 << 20)
    torch.manual_seed(0)
    base = TinyTransformer(512, 64, 2)
    x = torch.randint(0, 512, (8, 64))
    opt = checkmate.optimize(base, 3 << 20, time_limit=4)
    with pytest.raises(InfeasibleBudgetError) as caught:
        F.cross_entropy(opt(x).flatten(0, 1), x.flatten()).backward()
    notes = "\n".join(caught.value.notes)
    assert "1.00 MiB of the budget asked is held beside this graph (DDP's buckets)" in notes, notes
    assert notes.count("a budget of at least") == 1, notes
    found = re.search(r"in all, a budget of at least [0-9.]+ [KMG]?i?B \(([0-9,]+) bytes\)", notes)
    assert found and "outside the module" in notes, notes
    assert caught.value.minimum is not None
    assert int(found.group(1).replace(",", "")) > caught.value.minimum + (1 << 20)


class _BrokenCNN(nn.Module):
    """A CNN whose head runs after a graph break: its body's plan is settled with the step."""

    def __init__(self) -> None:
        super().__init__()
        self.body = SmallCNN(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        torch._dynamo.graph_break()
        return h.square()


def test_an_infeasible_fraction_settled_with_the_step_says_what_was_held_and_the_fraction_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # raised when the step's forward returns (a graph break followed the graph): the note on
    # what was held beside it was missing, and the least peak's fraction it named (of the
    # graph's keep-all peak) failed again, DDP's buckets taken off it once more

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    fake_ddp_reserve(monkeypatch, 1 << 20)
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    opt = checkmate.optimize(_BrokenCNN().train(), 0.6, time_limit=2)
    with pytest.raises(InfeasibleBudgetError) as caught:
        opt(x).sum().backward()
    notes = "\n".join(caught.value.notes)
    assert "1.00 MiB of the budget asked is held beside this graph" in notes, notes
    assert "followed by more of the step" in notes
    found = re.search(r"as a fraction, at least ([0-9.]+)% of this graph's keep-all peak", notes)
    assert found, notes
    fits = float(found.group(1)) / 100 + 0.005
    torch.manual_seed(0)
    again = checkmate.optimize(_BrokenCNN().train(), fits, time_limit=2)
    again(x).sum().backward()  # the fraction named fits
    assert checkmate.plans_of(again)


class LossAndLogits(nn.Module):
    """A language-model head returning its loss beside its logits, as Hugging Face models
    given ``labels`` do: a plan may drop the logits when the backward starts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        self.head = nn.Linear(64, 128)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.mlp(self.emb(ids)))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten()), logits


def test_a_byte_budget_below_what_one_op_needs_is_searched_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # below the cheap bound no schedule exists, with the logits held or dropped: the error's
    # least peak is searched in full once (for the plan holding them, whose error is raised),
    # where the plan dropping them searched it again (a Qwen2: 51 s to the error, 35 s now)
    from solvers.strategies import least_peak

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    least_peak._MEMO.clear()
    exact: list[int] = []
    bisect = least_peak._bisect_exact

    def spy(graph: Any, *args: Any) -> Any:
        exact.append(graph.n)
        return bisect(graph, *args)

    monkeypatch.setattr(least_peak, "_bisect_exact", spy)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (8, 32))
    opt = checkmate.optimize(LossAndLogits().train(), 4096, time_limit=TIME_LIMIT)
    with pytest.raises(InfeasibleBudgetError) as caught:
        opt(ids)[0].backward()
    exc = caught.value
    assert exc.lower_bound is not None and exc.minimum is not None and exc.budget < exc.lower_bound
    assert any("dropping the outputs beside the loss" in n for n in exc.notes), exc
    assert len(exact) == 1, exact
    # the minimum it names plans
    least_peak._MEMO.clear()
    opt = checkmate.optimize(LossAndLogits().train(), exc.minimum, time_limit=TIME_LIMIT)
    opt(ids)[0].backward()
    assert checkmate.plans_of(opt) and all(p.result.ok for p in checkmate.plans_of(opt))
