"""``checkmate.optimize`` across graph breaks (fraction budgets per captured graph) and with
nothing captured (a warning, once per module).

A fraction budget applies to each captured graph's own keep-all peak. A loss split off by
a graph break (Hugging Face models given ``labels``) is a graph whose largest op needs its
whole peak: it is planned at its own minimum with a warning when it is at most half the
step's largest graph, and the fraction still raises for a graph that sets the peak (when the
step goes on after it, once the step's forward has shown no graph twice its size).
A model Dynamo runs eagerly (``nn.LSTM``) plans nothing: its training step warns, once.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import warnings
import weakref
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.functional as F
from torch import nn

import checkmate
from checkmate.api import UnplannedWarning, plans_of
from checkmate.memory import measure_peak
from checkmate.runtime import BudgetWarning
from solvers.boundary import boundary_hold
from solvers.budget import format_bytes
from solvers.errors import InfeasibleBudgetError

pytestmark = pytest.mark.torch


class BodyThenLoss(nn.Module):
    """An MLP body, a graph break, then cross-entropy on its logits (a second graph)."""

    def __init__(self, width: int = 64, depth: int = 6) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(32, width)]
        for _ in range(depth):
            layers += [nn.Tanh(), nn.Linear(width, width)]
        self.body = nn.Sequential(*layers, nn.Tanh(), nn.Linear(width, 16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.body(x)
        torch._dynamo.graph_break()
        return F.cross_entropy(logits, y)


class LossThenBody(BodyThenLoss):
    """The loss graph first: no larger graph of the step is known when it is planned."""

    def forward(self, logits: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        aux = F.cross_entropy(logits, y)
        torch._dynamo.graph_break()
        return aux + self.body(x).pow(2).mean()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(1024, 32), torch.randint(0, 16, (1024,))


def test_fraction_infeasible_for_a_small_loss_graph_plans_it_at_its_minimum(
    caplog: pytest.LogCaptureFixture,
) -> None:
    torch.manual_seed(0)
    eager = BodyThenLoss()
    opt = checkmate.optimize(copy.deepcopy(eager), 0.5, profile="cpu", time_limit=3)
    x, y = _data()
    with pytest.warns(BudgetWarning, match=r"graph 1 .* at the 50% asked") as caught:
        loss = opt(x, y)
        loss.backward()
    eager(x, y).backward()
    for p, q in zip(opt.parameters(), eager.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)

    body, head = plans_of(opt)
    # the body sets the step's peak and is planned at the fraction asked
    assert body.asked_budget is None and body.recomputes > 0
    assert body.result.budget == math.floor(0.5 * body.reference_peak)
    # the loss graph is small and cannot be reduced to 50%: planned at more, recorded as such
    assert 2 * head.reference_peak <= body.reference_peak
    assert head.asked_budget == math.floor(0.5 * head.reference_peak)
    assert head.asked_budget < head.result.budget <= head.reference_peak
    for r in (body, head):
        assert r.result.peak is not None and r.result.peak <= r.result.budget
    assert "budget raised from" in head.summary() and "budget raised" not in body.summary()
    message = str(caught[0].message)
    assert format_bytes(head.result.budget) in message and format_bytes(head.asked_budget) in message

    # the plans are reused: no new plan, no new warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt(x, y).backward()
    assert len(plans_of(opt)) == 2

    # a larger batch (a loop whose batches vary) raises the loss graph's fraction again: said
    # in the log, not warned again at every new shape
    x2, y2 = torch.randn(1536, 32), torch.randint(0, 16, (1536,))
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="checkmate"):
        warnings.simplefilter("error", BudgetWarning)
        opt(x2, y2).backward()
    head2 = plans_of(opt)[-1]
    assert head2.reference_peak > head.reference_peak and "budget raised from" in head2.summary()
    said = [r.getMessage() for r in caplog.records if "has no schedule at" in r.getMessage()]
    assert len(said) == 1 and format_bytes(head2.result.budget) in said[0], said


class Aux(nn.Module):
    """Cross-entropy behind a graph break at its start: Dynamo compiles the rest of this
    forward as a frame of its own, which returns to the model's code still running (as a
    Hugging Face wav2vec2's feature encoder, which sets ``requires_grad``, does)."""

    def forward(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return F.cross_entropy(logits, y)


class NestedLossThenBody(BodyThenLoss):
    """The loss graph first, compiled from a submodule's frame; the step goes on after it."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = Aux()

    def forward(self, logits: torch.Tensor, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.aux(logits, y) + self.body(x).pow(2).mean()


@pytest.mark.parametrize("model", [LossThenBody, NestedLossThenBody], ids=["break", "nested-frame"])
def test_a_small_graph_before_the_one_that_sets_the_peak_is_planned_above_the_fraction(
    model: type[BodyThenLoss],
) -> None:
    # when the loss graph is planned, the body after it is not known yet: the fraction is
    # infeasible for the loss, which is planned at its minimum for now; the body, over twice
    # its size, then sets the step's peak. This raised before, though the step meets 50%
    torch.manual_seed(0)
    eager = model()
    opt = checkmate.optimize(copy.deepcopy(eager), 0.5, profile="cpu", time_limit=3)
    x, y = _data()
    logits = torch.randn(1024, 16, requires_grad=True)
    with pytest.warns(BudgetWarning, match=r"graph 0 .* at the 50% asked.* The step goes on after it"):
        opt(logits, y, x).backward()
    want = logits.grad
    logits.grad = None
    eager(logits, y, x).backward()
    assert want is not None and logits.grad is not None and torch.equal(want, logits.grad)
    for p, q in zip(opt.parameters(), eager.parameters()):
        assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    head, body = plans_of(opt)
    assert 2 * head.reference_peak <= body.reference_peak
    assert head.asked_budget == math.floor(0.5 * head.reference_peak) < head.result.budget
    assert body.asked_budget is None and body.result.budget == math.floor(0.5 * body.reference_peak)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt(logits, y, x).backward()  # the plans stand: no error, no new warning
    assert len(plans_of(opt)) == 2


def test_the_largest_graph_before_a_break_raises_when_no_larger_graph_follows() -> None:
    # the body is planned above the fraction while the graphs after it are unknown; the loss
    # after it is smaller, so the body sets the step's peak: the forward raises as it returns,
    # and so does every later call (the plan made does not meet the fraction)
    torch.manual_seed(0)
    opt = checkmate.optimize(BodyThenLoss(), 0.05, profile="cpu", time_limit=3)
    x, y = _data()
    for _ in range(2):
        with pytest.raises(InfeasibleBudgetError, match=r"5\.0% of the checkpoint-all peak") as caught:
            opt(x, y)
        assert any("none is twice its size" in n for n in caught.value.notes)
    body, head = plans_of(opt)
    assert 2 * head.reference_peak <= body.reference_peak


def test_fraction_infeasible_for_a_graph_that_sets_the_peak_raises_at_once() -> None:
    # one graph, the whole step: nothing can follow it, so the error comes as it is planned
    torch.manual_seed(0)
    opt = checkmate.optimize(BodyThenLoss().body, 0.05, profile="cpu", time_limit=3)
    x, _ = _data()
    with pytest.raises(InfeasibleBudgetError, match=r"5\.0% of the checkpoint-all peak"):
        opt(x)
    assert plans_of(opt) == []


# ------------------------------------------------------------------ nothing captured


class LSTMLM(nn.Module):
    """Embedding -> LSTM -> linear head -> cross-entropy (Dynamo runs nn.LSTM eagerly)."""

    def __init__(self, vocab: int = 32, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.rnn = nn.LSTM(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(idx))
        return F.cross_entropy(self.head(h).flatten(0, 1), target.flatten())


def _unplanned(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, UnplannedWarning)]


@pytest.mark.parametrize("budget", [0.5, 4096], ids=["fraction", "bytes"])
def test_a_step_with_nothing_planned_warns_once_per_module(budget: float) -> None:
    # under a byte budget too: its steps, measured over it, are not memory held outside the
    # module (eager steps ran at 1.67x one, warned twice as "held outside", and compiled again)
    torch.manual_seed(0)
    idx, target = torch.randint(0, 32, (4, 8)), torch.randint(0, 32, (4, 8))
    opt = checkmate.optimize(LSTMLM(), budget, profile="cpu", time_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt(idx, target).backward()
        opt.eval()
        with torch.no_grad():
            opt(idx, target)
    assert plans_of(opt) == []
    assert not [w for w in caught if issubclass(w.category, BudgetWarning)], [str(w.message) for w in caught]
    messages = _unplanned(caught)
    assert len(messages) == 1, messages
    assert (
        "LSTMLM.rnn is an nn.LSTM" in messages[0] and "torch._dynamo.config.allow_rnn = True" in messages[0]
    )
    assert "no memory bound" in messages[0]
    # once per module: another optimized copy warns on its own first step
    other = checkmate.optimize(LSTMLM(), 0.5, profile="cpu", time_limit=3)
    with pytest.warns(UnplannedWarning, match="allow_rnn"):
        other(idx, target).backward()


@pytest.mark.parametrize("budget", [1.0, 0.5])
def test_a_planned_model_does_not_warn(budget: float) -> None:
    torch.manual_seed(0)
    opt = checkmate.optimize(BodyThenLoss().body, budget, profile="cpu", time_limit=3)  # one graph
    x, _ = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # at 1.0 the second step takes the eager fast path
            opt(x).pow(2).mean().backward()
    assert plans_of(opt), "nothing was planned"
    assert _unplanned(caught) == []
    if budget == 1.0:
        assert all(r.is_eager for r in plans_of(opt))
    else:
        assert any(r.recomputes for r in plans_of(opt))


def test_a_schedule_not_found_in_time_raises_where_the_solve_runs_as_a_proven_one_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # both then take the small-graph fallback, and under torch.distributed rank 0 sends the
    # error itself to every rank (a result without a schedule made rank 0 raise
    # InfeasibleBudgetError while rank 1 raised CheckmateError, and their collectives parted)
    from checkmate.runtime import Planner
    from solvers import keep_all_peak, memory_lower_bound
    from solvers.budget import Budget
    from tests.graphs import chain

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    graph = chain(8, mem=10, training=True)
    nbytes = (memory_lower_bound(graph) + keep_all_peak(graph)) // 2  # above the proven bound
    planner = Planner(Budget(nbytes=nbytes), strategy="checkpoint-all")
    with pytest.raises(InfeasibleBudgetError, match=r"checkpoint-all: no_solution") as caught:
        planner._solved(graph, Budget(nbytes=nbytes), "cpu")
    assert not caught.value.proven and caught.value.minimum is not None


class BrokenInTheMiddle(nn.Module):
    """Two halves of an MLP with a graph break between them: two graphs of one step, the
    first holding what it saved for its backward while the second runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(5)])
        self.b = nn.Sequential(*[nn.Sequential(nn.Linear(128, 128), nn.GELU()) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        torch._dynamo.graph_break()
        return self.b(h)


def test_graphs_of_one_step_share_a_byte_budget_or_warn_with_the_estimate() -> None:
    # at the first call the second graph is not known yet: the first is planned with room
    # guessed for it at its forward/backward boundary (its own least peak: the rest of a
    # model split in two), then compared with what the second needs
    x = torch.randn(256, 128)
    torch.manual_seed(0)
    eager = measure_peak(lambda: BrokenInTheMiddle()(x).sum().backward())
    budget = int(0.5 * eager)
    torch.manual_seed(0)
    opt = checkmate.optimize(BrokenInTheMiddle(), budget, time_limit=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        first = measure_peak(lambda: opt(x).sum().backward())
        for _ in range(2):  # plans again where the guess was far off, runs
            opt.zero_grad()  # no gradients accumulated (a call finding them compiles again)
            opt(x).sum().backward()
        opt.zero_grad()
        measured = measure_peak(lambda: opt(x).sum().backward())
    plans = plans_of(opt)
    assert len(plans) in (2, 4)
    # the second graph is the rest of the forward after the break (Dynamo's resumption, the
    # frame's last act): nothing follows it, and it is planned without room for anything
    assert plans[1].result.info.get("boundary") is None
    bound = plans[-2].result.info.get("boundary")  # room made for the second graph
    assert bound is not None and boundary_hold(plans[-2].joint.graph, plans[-2].result.schedule) <= bound
    # 1.61x at the first call planned without room for the second graph, 1.68x at every
    # call with each graph at the whole budget
    assert first <= budget, f"the first call: {first / budget:.3f}x the budget"
    assert measured <= budget, f"{measured / budget:.3f}x the budget"

    # too little for both graphs at their least: the second call says what the step reaches
    # (at 0.33 they fit together, 0.88x, since the second graph's gradient of the first's
    # output counts once, as the first's tangent: counted twice, they did not, 1.22x)
    tight = int(0.24 * eager)
    torch.manual_seed(0)
    # one plan every run: the device profile's costs (not timings) and the LP's rounding (no
    # incumbent cut off by a time limit, which a loaded machine moves); measured 1.28x the
    # budget, estimated 1.44x (the step's output, dropped by .sum(), counted as held)
    low = checkmate.optimize(BrokenInTheMiddle(), tight, time_limit=20, profile="cpu", strategy="lp-rounding")
    # the first call finds the second graph as it runs, its first planned without it in view:
    # said before the step runs over (measured 1.28x, unwarned before)
    with pytest.warns(BudgetWarning, match="split this step into 2 graphs, found as it runs") as found:
        first = measure_peak(lambda: low(x).sum().backward())
    assert len([w for w in found if issubclass(w.category, BudgetWarning)]) == 1
    assert first > tight, f"warned of a first step within the budget: {first / tight:.3f}x"
    low.zero_grad()  # no gradients accumulated (a call finding them compiles again)
    with pytest.warns(BudgetWarning, match="graph breaks split this step into 2 graphs") as got:
        low(x).sum().backward()
    estimate = float(re.search(r"\(([\d.]+)x the ", str(got[0].message)).group(1))  # type: ignore[union-attr]
    low.zero_grad()
    over = measure_peak(lambda: low(x).sum().backward()) / tight
    assert over > 1.05  # what the warning is about
    assert abs(estimate - over) < 0.2, (estimate, over)
    low.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        low(x).sum().backward()  # once per module


def test_graphs_of_one_step_that_fit_no_plans_beside_accumulated_gradients_are_planned_without_and_warn() -> (
    None
):
    # at 0.4 of eager's peak over four micro-batches, the 645 KiB of gradients held (0.41 of
    # the budget) leave the two graphs no plans that fit together: planned as before they were
    # found (each call within the budget), and warned of once
    x = torch.randn(256, 128)
    torch.manual_seed(0)
    model = BrokenInTheMiddle()

    def accumulate(m: nn.Module) -> None:
        for _ in range(4):
            (m(x).sum() / 4).backward()

    accumulate(copy.deepcopy(model))
    budget = int(0.4 * measure_peak(lambda: accumulate(copy.deepcopy(model))))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            accumulate(opt)
            sgd.step()
            sgd.zero_grad()
        peak = measure_peak(lambda: opt(x).sum().backward())
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    # the first micro-batch may find its two graphs over the budget as it runs (estimated
    # 1.13x, measured 1.016x), then at the second, that no plans fit beside the gradients the
    # first left
    found = [m for m in said if "found as it runs" in m]
    said = [m for m in said if m not in found]
    assert len(found) <= 1, found
    assert len(said) == 1 and "645.00 KiB of gradients as the step started" in said[0], said
    assert opt.__dict__["_checkmate_state"].planner.held_grads == 0
    assert peak <= budget, f"{peak / budget:.3f}x the budget"


def _gpt2(width: int, vocab: int, positions: int) -> tuple[Any, Any]:
    """A 2-layer Hugging Face GPT-2 without dropout in training mode, and a copy of it."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=width, n_head=4, vocab_size=vocab, n_positions=positions,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).train()
    return ref, copy.deepcopy(ref)


def test_a_hugging_face_loss_split_off_by_a_graph_break_shares_a_byte_budget() -> None:
    # transformers computes the loss of labels= in a graph of its own: the model's graph
    # holds its saved activations while the loss graph runs (1.13x the budget measured when
    # each graph was planned at the whole budget; 1.34x at the first call, when the model's
    # graph was planned before the loss graph was known, without a guess at its room)
    ref, model = _gpt2(width=128, vocab=2000, positions=128)
    ids = torch.randint(0, 2000, (8, 128), generator=torch.Generator().manual_seed(0))
    budget = int(0.7 * measure_peak(lambda: ref(input_ids=ids, labels=ids).loss.backward()))
    opt = checkmate.optimize(model, budget, time_limit=5)
    dropped: list[bool] = []

    def first_step() -> None:  # plans
        out = opt(input_ids=ids, labels=ids)
        logits, loss = weakref.ref(out.logits), out.loss
        del out
        # the logits are freed with the output the loop dropped: compiling left Dynamo's tracer
        # holding them (in reference cycles), beside the loss graph's backward, until collected
        dropped.append(logits() is None)
        loss.backward()

    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        first = measure_peak(first_step)
        for _ in range(2):  # plans again with the loss graph in view where the guess was far off
            model.zero_grad(set_to_none=True)
            opt(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        peak = measure_peak(lambda: opt(input_ids=ids, labels=ids).loss.backward())
    records = plans_of(opt)
    assert len(records) in (2, 4)
    assert first <= budget, f"the first step: {first / budget:.3f}x the budget"
    assert dropped == [True]
    assert peak <= budget, f"{peak / budget:.3f}x the budget"
    # planned with room for the loss graph: the model's graph holds at most a bound at its
    # forward/backward boundary, where the loss graph runs (a peak budget alone is blind
    # to it: planned so, this test failed 2 runs in 14 under load)
    again = records[-2]
    bound = again.result.info["boundary"]
    assert boundary_hold(again.joint.graph, again.result.schedule) <= bound < again.result.budget
    ref.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name

    # an epoch's short last batch runs once per epoch: its first call must fit (planned
    # without the loss graph in view, it measured 1.17x)
    short = ids[:7]
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        peak = measure_peak(lambda: opt(input_ids=short, labels=short).loss.backward())
    assert peak <= budget, f"the short batch's first step: {peak / budget:.3f}x the budget"


class TinyLM(nn.Module):
    """An embedding, an MLP and a vocabulary head, then a graph break and cross-entropy on
    the logits (a loss graph of its own, as a Hugging Face language model given ``labels=``),
    returning both."""

    def __init__(self, vocab: int = 4096, width: int = 128) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, width)
        self.body = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(3)
            ]
        )
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.body(self.emb(ids)))
        torch._dynamo.graph_break()
        loss = F.cross_entropy(logits.view(-1, self.vocab), ids.view(-1))
        return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("loop", ["drops", "keeps"])
def test_logits_a_loop_drops_are_not_counted_through_the_loss_graphs_backward(loop: str) -> None:
    # the loss graph's backward needs 12 MiB (the log-softmax it saved, its gradient, the
    # logits'), beside what the model's graph saved and its 4 MiB of logits where the loop
    # still holds them: 16.13 MiB together, over 14 MiB; 12.71 MiB without the logits. A loop
    # dropping the model's output (`model(ids)["loss"].backward()`, as the Hugging Face
    # Trainer) was compiled again and warned that no plans fit (measured 0.87x the budget)
    # A loop holding the logits through the backward is warned of, once
    ids = torch.randint(0, 4096, (8, 32), generator=torch.Generator().manual_seed(0))
    budget = 14 * 2**20
    torch.manual_seed(0)
    opt = checkmate.optimize(TinyLM(), budget, time_limit=5, profile="cpu")

    def step() -> None:
        if loop == "keeps":
            out = opt(ids)
            out["loss"].backward()
        else:
            opt(ids)["loss"].backward()
        opt.zero_grad(set_to_none=True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            step()
        peak = measure_peak(step)
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    seen = opt.__dict__["_checkmate_state"].planner.__dict__.get("dropped_seen", {})
    if loop == "drops":
        assert not said, said
        assert len(plans_of(opt)) == 2  # not compiled again
        assert peak <= budget, f"{peak / budget:.3f}x the budget"
        assert list(seen.values()) == [4 * 2**20], (
            seen
        )  # the logits, gone as the loss graph's backward started
    else:  # held through it: no plans fit together, as the step measures (not memory outside the
        # module: taken for it, the step was planned again with 8 MiB of room, and warned twice)
        assert len(said) == 1 and "graph breaks split this step into 2 graphs" in said[0], said
        assert peak > budget
        assert list(seen.values()) == [0], seen


def test_a_loop_that_starts_holding_the_logits_has_the_step_judged_again() -> None:
    # planned without the logits through the loss graph's backward while the loop dropped
    # them; the first step that holds them runs over (no step before it could say), the next
    # is judged with them, compiled again, and warned of: no plans fit together
    ids = torch.randint(0, 4096, (8, 32), generator=torch.Generator().manual_seed(0))
    budget = 14 * 2**20
    torch.manual_seed(0)
    opt = checkmate.optimize(TinyLM(), budget, time_limit=5, profile="cpu")
    said: list[list[str]] = []
    for keep in (False, False, True, True, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = opt(ids)
            loss = out["loss"]
            if not keep:
                del out
            loss.backward()
            opt.zero_grad(set_to_none=True)
            del loss
            out = None
        said.append([str(w.message) for w in caught if issubclass(w.category, BudgetWarning)])
    assert said[:3] == [[], [], []], said
    assert len(said[3]) == 1 and "graph breaks split this step into 2 graphs" in said[3][0], said
    assert said[4] == [], said
    assert len(plans_of(opt)) == 4  # compiled once more


@pytest.mark.parametrize("budget", [0.8, 0.7], ids=["fraction", "bytes"])
def test_hugging_face_gradient_checkpointing_turned_on_after_optimize_is_planned_whole(budget: float) -> None:
    # as the Trainer's gradient_checkpointing=True turns it on, after the model was optimized.
    # Dynamo captures the checkpointed layers in the step's graphs (their ops tagged), planned
    # as the others: a byte budget holds, unwarned (it once warned that every layer was a graph
    # break, which it is not here: 0.86x the budget at 0.6 of eager's peak), and a fraction,
    # which is of the step keeping every value, is warned of once, saying how to turn it off
    ref, model = _gpt2(width=64, vocab=1000, positions=64)
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    nbytes = int(budget * measure_peak(lambda: ref(input_ids=ids, labels=ids).loss.backward()))
    ref.zero_grad(set_to_none=True)
    opt = checkmate.optimize(
        model, budget if budget == 0.8 else nbytes, time_limit=5
    )  # before, as the Trainer
    model.gradient_checkpointing_enable()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model.zero_grad(set_to_none=True)
            opt(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        peak = measure_peak(lambda: opt(input_ids=ids, labels=ids).loss.backward())
    said = [str(w.message) for w in caught if issubclass(w.category, BudgetWarning)]
    assert not [m for m in said if "gradient checkpointing on" in m], said
    regions = [m for m in said if "torch.utils.checkpoint" in m]
    if budget == 0.8:
        assert len(regions) == 1 and "gradient_checkpointing_disable()" in regions[0], said
    else:
        assert not said, said
        assert peak <= nbytes, f"{peak / nbytes:.3f}x the budget"
    assert any(r.joint.graph.n > 100 for r in plans_of(opt))  # the layers planned in one graph
    ref(input_ids=ids, labels=ids).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


class _BrokenLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        torch._dynamo.graph_break()  # inside a checkpointed layer: Dynamo cannot capture the region
        return x + self.b(h)


class _CheckpointedWithBreaks(nn.Module):
    """Layers checkpointed as a Hugging Face model does when its flag is on."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(64, 64), nn.Linear(64, 64)
        self.layers = nn.ModuleList(_BrokenLayer() for _ in range(2))
        self.gradient_checkpointing = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.inp(x))
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        return torch.tanh(self.out(x)).square().mean()


def test_hugging_face_gradient_checkpointing_dynamo_cannot_capture_is_named_in_the_unplanned_warning() -> (
    None
):
    # a graph break inside a checkpointed layer makes Dynamo run the whole forward eagerly
    # (torch 2.13): the one warning, unplanned, names the checkpointing and how to turn it off
    model = _CheckpointedWithBreaks()
    opt = checkmate.optimize(model, 8 << 20)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt(torch.randn(32, 64)).backward()
    said = [(w.category, str(w.message)) for w in caught if w.category.__module__.startswith("checkmate")]
    assert len(said) == 1 and said[0][0] is UnplannedWarning, said
    assert "gradient checkpointing is on (in _CheckpointedWithBreaks)" in said[0][1], said
    assert "gradient_checkpointing_disable()" in said[0][1]


def test_a_fraction_a_piece_around_uncaptured_hugging_face_checkpointing_cannot_meet_says_to_turn_it_off() -> (
    None
):
    # a Llama's checkpointed layers are not captured (Dynamo: "HOP: Unsafe side effect"; torch
    # 2.13, transformers 5.25), so the step is the pieces around them, and its loss graph, the
    # largest, cannot meet a fraction of 0.5: the error said to raise the budget, where turning
    # the checkpointing off (the Trainer's gradient_checkpointing=True) is what lets it plan
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ref = copy.deepcopy(model)
    # 0.7: the whole step's least peak is 65% of keeping every value, the loss graph's 99.5%
    opt = checkmate.optimize(model, 0.7, time_limit=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers renames it
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, 1000, (4, 64), generator=torch.Generator().manual_seed(0))
    try:
        opt(input_ids=ids, labels=ids).loss.backward()
    except InfeasibleBudgetError as exc:
        notes = exc.notes
        assert any("captured none of its checkpointed layers" in n for n in notes), notes
        assert any("gradient_checkpointing_disable()" in n for n in notes), notes
        with pytest.raises(InfeasibleBudgetError) as again:  # the same error at the next call, noted once
            opt(input_ids=ids, labels=ids)
        assert sum("captured none of its checkpointed layers" in n for n in again.value.notes) == 1
    else:  # Dynamo captured the layers (another torch or transformers), or every piece fitted
        pytest.skip("no piece of the step failed the fraction with this torch and transformers")
    model.gradient_checkpointing_disable()  # as the note says: the same step, captured and planned
    model.zero_grad(set_to_none=True)
    opt(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    assert any(r.joint.graph.n > 100 and r.recomputes > 0 for r in plans_of(opt))  # the layers planned
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name


class LossThenBreak(BodyThenLoss):
    """The whole step in one graph, then a graph break before the return (logging, a
    data-dependent check): the step goes on after the graph, with nothing to backpropagate."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.body(x), y)
        torch._dynamo.graph_break()
        return loss


def test_a_graph_break_after_the_loss_leaves_no_room_for_graphs_that_do_not_follow() -> None:
    # a graph after which the step goes on is planned with room for what follows at its
    # forward/backward boundary; after a scalar loss that is bookkeeping, not a model's
    # second half: guessed as large as the graph itself, its plan recomputed +58% and the
    # step was compiled again at the next call
    x, y = torch.randn(1024, 32), torch.randint(0, 16, (1024,))
    torch.manual_seed(0)
    eager = measure_peak(lambda: LossThenBreak(width=256)(x, y).backward())
    budget = int(0.7 * eager)
    torch.manual_seed(0)
    opt = checkmate.optimize(LossThenBreak(width=256), budget, time_limit=5, profile="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        for _ in range(3):
            opt.zero_grad()  # no gradients accumulated (a call finding them compiles again)
            opt(x, y).backward()
        opt.zero_grad()
        peak = measure_peak(lambda: opt(x, y).backward())
    (rec,) = plans_of(opt)  # not compiled again
    bound = rec.result.info.get("boundary")
    assert bound is None or bound >= (rec.result.budget or 0) - 64, (bound, rec.result.budget)
    assert peak <= budget, f"{peak / budget:.3f}x the budget"


class HookedInTheMiddle(nn.Module):
    """An MLP whose forward registers a gradient hook on its middle activation, as gradient
    reversal or logging of activations' gradients does; with ``log``, a lambda that appends
    to a list (a side effect Dynamo breaks the graph at, in a frame whose code holds a dict)."""

    def __init__(self, log: list[int] | None = None) -> None:
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(128, 128) for _ in range(3))
        self.second = nn.ModuleList(nn.Linear(128, 128) for _ in range(3))
        self.head = nn.Linear(128, 10)
        self.log = log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.first:
            x = F.gelu(layer(x))
        if x.requires_grad:
            log = self.log
            x.register_hook((lambda g: -g) if log is None else (lambda g: log.append(1) or -g))
        for layer in self.second:
            x = F.gelu(layer(x))
        return self.head(x)


@pytest.mark.parametrize("side_effect", [False, True], ids=["pure", "appends"])
def test_a_gradient_hook_registered_in_the_forward_is_planned_and_runs_once_per_step(
    side_effect: bool,
) -> None:
    # with a side effect, Dynamo breaks the graph at the hook, and the frame it then compiles
    # holds unhashable constants: reading its instructions raised a TraceError
    x = torch.randn(1024, 128)
    torch.manual_seed(0)
    eager = HookedInTheMiddle([] if side_effect else None)
    opt = checkmate.optimize(copy.deepcopy(eager), 0.7, time_limit=2.0)  # its own log
    for step in range(1, 3):
        for p, q in zip(opt.parameters(), eager.parameters(), strict=True):
            p.grad = q.grad = None
        eager(x).square().mean().backward()
        opt(x).square().mean().backward()
        assert opt.log == eager.log == ([1] * step if side_effect else None)
        for p, q in zip(opt.parameters(), eager.parameters(), strict=True):
            assert p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad)
    assert plans_of(opt)


def test_a_module_backward_hook_runs_the_step_eagerly_and_the_warning_names_its_module() -> None:
    # Dynamo traces no module backward hook without compiled autograd: the whole forward runs
    # eagerly, and the warning says which submodule has one, and what is planned instead
    calls: list[int] = []
    model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))
    model[2].register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(1))
    opt = checkmate.optimize(model, 0.5, time_limit=2.0)
    with pytest.warns(UnplannedWarning, match=r"Sequential\.2 has one \(register_full_backward_hook") as got:
        opt(torch.randn(8, 32)).sum().backward()
    assert got[0].filename == __file__
    assert calls == [1] and not plans_of(opt)


# ------------------------------------------------------------------ part of the step run eagerly


class PackedTagger(nn.Module):
    """A sequence tagger over padded batches: embedding and an MLP (captured, one graph),
    then ``pack_padded_sequence``, which Dynamo skips, so that the rest of the frame (the
    LSTM over the packed batch, and the head) runs eagerly, outside every graph."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(200, 64)
        self.pre = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(64, 64), nn.GELU())])
        self.lstm = nn.LSTM(64, 64, batch_first=True, bidirectional=True)
        self.head = nn.Sequential(
            *[m for _ in range(3) for m in (nn.Linear(128, 128), nn.GELU())], nn.Linear(128, 8)
        )

    def forward(self, tok: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        e = self.pre(self.emb(tok))
        packed = nn.utils.rnn.pack_padded_sequence(e, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tok.shape[1])
        return self.head(out)


def _tagger_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, 200, (16, 32), generator=g)
    lengths = torch.randint(4, 33, (16,), generator=g)
    return tok, lengths, torch.randint(0, 8, (16, 32), generator=g)


def _eager_saved(model: PackedTagger, tok: torch.Tensor, lengths: torch.Tensor) -> int:
    """The bytes of distinct storages the tagger's eager part (from the packing on) saves
    for its backward, seen by autograd's pack hook (not parameters)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            storages[ptr] = t.untyped_storage().nbytes()
        return t

    e = model.pre(model.emb(tok))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        packed = nn.utils.rnn.pack_padded_sequence(e, lengths, batch_first=True, enforce_sorted=False)
        out, _ = model.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=tok.shape[1])
        model.head(out)
    return sum(storages.values())


def _mib(message: str, before: str) -> float:
    """The MiB figure just before ``before`` in ``message``."""
    found = re.search(r"([\d.]+) (KiB|MiB) " + re.escape(before), message)
    assert found, message
    return float(found.group(1)) / (1024 if found.group(2) == "KiB" else 1)


def test_ops_run_outside_every_graph_are_warned_of_with_what_they_saved_and_why() -> None:
    # the tagger's LSTM and head ran eagerly after the skipped packing: at a byte budget of
    # 0.6 of eager's peak its steps measured 1.67x, then 1.35x the budget, with a warning
    # that blamed a loss outside the module (it has none) and advised computing it inside
    tok, lengths, y = _tagger_batch()
    torch.manual_seed(0)
    model = PackedTagger()
    reference = copy.deepcopy(model)

    def step(m: nn.Module) -> None:
        F.cross_entropy(m(tok, lengths).flatten(0, 1), y.flatten()).backward()

    eager = measure_peak(lambda: step(reference))
    expected = _eager_saved(reference, tok, lengths)
    opt = checkmate.optimize(model, int(0.6 * eager), profile="cpu", time_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            step(opt)
            for p in model.parameters():
                p.grad = None
    unplanned = _unplanned(caught)
    assert len(unplanned) == 1, unplanned  # once, though the step compiled again
    message = unplanned[0]
    assert "PackedTagger's forward ran" in message and "outside every graph torch.compile captured" in message
    assert "`pack_padded_sequence`" in message and "allow_rnn" in message
    # what it saved, as a pack hook on the eager part sees it (the walk dedupes storages as it does)
    assert _mib(message, "for the backward") == pytest.approx(expected / 2**20, rel=0.02, abs=0.01)
    # the step measured over the budget says where the excess is
    over = [
        str(w.message)
        for w in caught
        if issubclass(w.category, BudgetWarning) and "measured" in str(w.message)
    ]
    assert over, [str(w.message) for w in caught]
    assert "saved by ops its forward ran eagerly, outside every captured graph" in over[0]
    assert "compute the loss inside" not in over[0]
    assert plans_of(opt), "nothing was planned"


class _Spread(torch.autograd.Function):
    """Dynamo cannot trace it (a graph break inside), so it runs eagerly, forward and backward.
    It saves nothing; its backward allocates a temporary 32 times its gradient, as a reversible
    layer's backward recomputes its forward, which no plan bounds."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        spread = grad.unsqueeze(0).expand(32, *grad.shape).contiguous()
        return spread.mean(0) * 2


class _SpreadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
        self.head = nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_Spread.apply(self.body(x))).square().mean()  # the loss, inside


def test_a_step_over_the_budget_by_an_eager_autograd_functions_backward_names_it() -> None:
    # a Hugging Face Reformer's reversible layers (an autograd.Function that recomputes in its
    # backward, run eagerly) stepped at 1.43x a byte budget of 0.7 of eager's peak, and the
    # warning blamed "a loss computed on its outputs": its loss is computed inside
    torch.manual_seed(0)
    model, x = _SpreadNet(), torch.randn(512, 256)
    reference = copy.deepcopy(model)
    eager = measure_peak(lambda: reference(x).backward())
    opt = checkmate.optimize(model, int(0.6 * eager), profile="cpu", time_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            opt(x).backward()
            model.zero_grad(set_to_none=True)
    over = [
        str(w.message)
        for w in caught
        if issubclass(w.category, BudgetWarning) and "the training step measured" in str(w.message)
    ]
    assert over, [str(w.message) for w in caught]
    assert "likely allocated by the backward of `_Spread`, an autograd.Function" in over[0], over[0]
    assert "have Dynamo capture `_Spread`" in over[0], over[0]
    assert "a loss computed on its outputs" not in over[0], over[0]
    assert plans_of(opt), "nothing was planned"


def test_a_fraction_no_captured_graph_can_meet_says_the_step_ran_mostly_outside_them() -> None:
    # the captured graph (embedding, MLP) cannot meet 0.3 of its own peak, and the step's
    # peak is the eager part's: the error says so rather than only that the graph sets it
    tok, lengths, y = _tagger_batch()
    torch.manual_seed(0)
    opt = checkmate.optimize(PackedTagger(), 0.3, profile="cpu", time_limit=3)
    with pytest.raises(InfeasibleBudgetError) as caught:
        F.cross_entropy(opt(tok, lengths).flatten(0, 1), y.flatten()).backward()
    notes = caught.value.notes
    assert any(
        "outside every graph torch.compile captured" in n and "pack_padded_sequence" in n for n in notes
    ), notes


def test_a_graph_break_resumed_in_a_graph_is_not_taken_for_ops_run_outside() -> None:
    x, y = _data()
    torch.manual_seed(0)
    opt = checkmate.optimize(BodyThenLoss(), 0.5, profile="cpu", time_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt(x, y).backward()
    assert len(plans_of(opt)) == 2
    assert _unplanned(caught) == []


def test_an_autograd_graph_the_count_cannot_read_does_not_fail_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the count is a diagnosis: a node type it cannot read (a library's own autograd nodes)
    # leaves the step planned and run as before, unwarned
    import checkmate.call_checks as call_checks

    def unreadable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("an autograd node it cannot read")

    monkeypatch.setattr(call_checks, "uncaptured", unreadable)
    tok, lengths, y = _tagger_batch()
    torch.manual_seed(0)
    model = PackedTagger()
    reference = copy.deepcopy(model)
    opt = checkmate.optimize(model, 0.9, profile="cpu", time_limit=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        F.cross_entropy(opt(tok, lengths).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(reference(tok, lengths).flatten(0, 1), y.flatten()).backward()
    assert _unplanned(caught) == []
    assert plans_of(opt)
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad)


class BreaksAtFirstCall(nn.Module):
    """A narrow MLP, then a wide one, with a graph break between them at the first call only
    (as transformers installs its output hooks at a model's first call, under a lock Dynamo
    cannot trace): the first call's second graph needs more than the first left it room for,
    and the calls after it compile one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh())
        self.b = nn.Sequential(
            *[nn.Sequential(nn.Linear(128 if i == 0 else 512, 512), nn.GELU()) for i in range(4)]
        )
        self.ready = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if not self.ready:
            torch._dynamo.graph_break()
            self.ready = True
        return self.b(h)


def test_a_step_found_split_as_it_runs_over_the_budget_is_warned_of_and_its_later_graph_planned_at_its_least() -> (
    None
):
    # the first call plans the narrow graph first, leaving room guessed from its own size;
    # the wide graph after the break has no plan beside what the narrow one holds. That step
    # ran over the budget unwarned (each graph planned at the whole budget); now it is said
    # before it runs, and the wide graph is planned at its least peak, which exceeds it least
    x = torch.randn(2048, 64)
    torch.manual_seed(0)
    ref = BreaksAtFirstCall()
    model = copy.deepcopy(ref)
    ref(x).sum().backward()
    ref.zero_grad(set_to_none=True)
    eager = measure_peak(lambda: ref(x).sum().backward())
    budget = int(0.6 * eager)
    opt = checkmate.optimize(model, budget, time_limit=5, profile="cpu")
    with pytest.warns(BudgetWarning, match="split this step into 2 graphs, found as it runs") as found:
        opt(x).sum().backward()
    assert len([w for w in found if issubclass(w.category, BudgetWarning)]) == 1
    first = plans_of(opt)
    assert len(first) == 2, [p.summary() for p in first]
    # the later graph planned at its least peak found, not at the whole budget
    assert first[1].result.budget is not None and first[1].result.budget < budget
    with warnings.catch_warnings():
        warnings.simplefilter("error", BudgetWarning)
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            opt(x).sum().backward()
        model.zero_grad(set_to_none=True)
        peak = measure_peak(lambda: opt(x).sum().backward())
    assert len(plans_of(opt)) == 3  # one graph once the break is gone
    assert peak <= budget, f"{peak / budget:.3f}x the budget"
    ref.zero_grad(set_to_none=True)
    ref(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
