"""Outputs beside a loss that the step does not differentiate: their gradients stay None.

A model that returns its loss first and its logits beside it (as Hugging Face models given
``labels=`` do) is trained with ``loss.backward()``. Eager autograd computes no gradient for
the logits; AOTAutograd's compiled function had autograd allocate a logits-sized zero one
before its backward. checkmate's backward runs without it (:mod:`checkmate.tangents`), and
its plans count it as no bytes, and a step that differentiates the logits anyway is caught
at its backward: a warning where the budget may be exceeded, and the step planned again.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.graph import _BoxedCodeGen

import checkmate
from checkmate.memory import MemoryTracker, measure_peak
from checkmate.module_state import _STATE
from checkmate.tangents import fold_zeros, unread_tangents

pytestmark = pytest.mark.torch

VOCAB, WIDTH, BATCH, LENGTH = 2048, 256, 4, 64


class LossFirst(nn.Module):
    """A language-model head returning its loss, then its logits."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(self.emb(x)))
        return F.cross_entropy(logits.view(-1, VOCAB), y.view(-1)), logits


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, LENGTH), generator=g),) * 2


def _loss_only(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    out = model(x, y)  # held until the backward is done, as a training loop holds its outputs
    out[0].backward()


def _loss_kept(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model(x, y)[0].backward()  # the outputs beside the loss are dropped before the backward


def _both(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    loss, logits = model(x, y)
    (loss + logits.mean()).backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _setup(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    eager = LossFirst()
    return eager, copy.deepcopy(eager)


def _steps_within(
    step, opt: nn.Module, model: nn.Module, x, y, budget: int, calls: int, slack: int = 0
) -> None:  # type: ignore[no-untyped-def]
    """``calls`` steps of ``opt``, each measured within ``budget`` (and ``slack`` bytes), with
    no :class:`checkmate.BudgetWarning`."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(calls):
            model.zero_grad(set_to_none=True)
            peak = measure_peak(lambda: step(opt, x, y))
            assert peak <= budget + slack, f"measured {peak:,} of a budget of {budget:,}"


def _eager_step(step, batch: int):  # type: ignore[no-untyped-def]
    """A model, its twin, a batch, the twin's eager ``step`` peak on it, and its gradients."""
    eager, model = _setup()
    x, y = _batch(batch)
    step(eager, x, y)
    eager.zero_grad(set_to_none=True)
    peak = measure_peak(lambda: step(eager, x, y))
    return model, x, y, peak, _grads(eager)


def test_a_loss_returned_first_runs_within_eagers_own_peak_with_eagers_gradients() -> None:
    model, x, y, eager_peak, want = _eager_step(_loss_only, 1)
    # at eager's own peak, nothing is recomputed: counting a zero logits gradient beside every
    # value kept, the plan's keep-all peak was 1.19x eager's, and it recomputed to fit
    opt = checkmate.optimize(model, eager_peak, (x, y), time_limit=10)
    (rec,) = checkmate.plans_of(opt)
    assert rec.joint.unread  # the logits' gradient: planned as no bytes
    assert rec.modules.recomputes == 0 and rec.reference_peak <= eager_peak
    _steps_within(_loss_only, opt, model, x, y, eager_peak, calls=2)
    got = _grads(model)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_step_differentiating_the_outputs_beside_the_loss_is_warned_and_planned_again() -> None:
    eager, model = _setup()
    x, y = _batch(2)
    _both(eager, x, y)
    eager.zero_grad(set_to_none=True)
    # below the plan that keeps every value (planned without the logits' gradient) and that
    # gradient together; the plan counting it recomputes
    budget = int(0.9 * measure_peak(lambda: _both(eager, x, y)))
    opt = checkmate.optimize(model, budget, time_limit=10)
    with pytest.warns(checkmate.BudgetWarning, match="planned without gradients for those outputs"):
        _both(opt, x, y)
    (first,) = checkmate.plans_of(opt)
    assert first.joint.unread
    # compiled again at the next call, counting the logits' gradient; beside the step, the
    # loop's scalars (the mean, the sum)
    _steps_within(_both, opt, model, x, y, budget, calls=3, slack=64)
    records = checkmate.plans_of(opt)
    assert len(records) == 2 and not records[-1].joint.unread
    eager.zero_grad(set_to_none=True)
    _both(eager, x, y)
    got, want = _grads(model), _grads(eager)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def _name(gm: torch.fx.GraphModule, *names: str) -> None:
    for n, name in zip([n for n in gm.graph.nodes if n.op == "placeholder"], names):
        n._rename(name)
        n.target = name


def test_a_budget_that_fits_only_without_the_outputs_held_plans_them_dropped_and_checks_the_loop() -> None:
    model, x, y, eager_peak, want = _eager_step(_loss_kept, 3)
    # below what any plan holding the logits to the end of the backward reaches
    budget = int(0.9 * eager_peak)
    held = checkmate.optimize(copy.deepcopy(model), budget, time_limit=10)
    held.__dict__[_STATE].planner.plan_dropped = False
    with pytest.raises(checkmate.InfeasibleBudgetError):
        _loss_kept(held, x, y)
    opt = checkmate.optimize(model, budget, time_limit=10)
    _steps_within(_loss_kept, opt, model, x, y, budget, calls=3)
    (rec,) = checkmate.plans_of(opt)
    assert rec.joint.dropped
    got = _grads(model)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # a loop holding its outputs through the backward: the error is raised from its backward,
    # before the backward exceeds the budget; the step, compiled again holding them, has no plan
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as tracker, pytest.raises(checkmate.InfeasibleBudgetError) as err:
        _loss_only(opt, x, y)
    assert any("still held" in note for note in err.value.notes)
    assert tracker.peak <= budget, f"measured {tracker.peak:,} of a budget of {budget:,}"
    with warnings.catch_warnings(), pytest.raises(checkmate.InfeasibleBudgetError) as err:
        warnings.simplefilter("ignore", checkmate.BudgetWarning)  # the call whose backward raised
        _loss_only(opt, x, y)
    assert any("an earlier step held them" in note and "del outputs" in note for note in err.value.notes)


def test_a_loop_seen_dropping_the_logits_is_planned_again_with_them_dropped() -> None:
    # ``model(**batch).loss.backward()`` (the Hugging Face Trainer's loop) drops the logits
    # before the backward; planned holding them to its end, the plan recomputed for room the
    # step never used: at 1.05x the dropping loop's eager peak, at least +8.0% compute where
    # keeping every value fits. Op costs from the cpu device profile, not timed: with timed
    # costs the plan holding them cost +8.1% in one run and +0.5% in another (under DROP_WORTH)
    from checkmate.runtime import DROP_WORTH

    model, x, y, eager_peak, want = _eager_step(_loss_kept, 3)
    budget = int(1.05 * eager_peak)
    opt = checkmate.optimize(model, budget, time_limit=10, profile="cpu")
    model.zero_grad(set_to_none=True)
    _loss_kept(opt, x, y)  # its first backward finds the logits dropped: the next call plans again
    (held,) = checkmate.plans_of(opt)
    assert not held.joint.dropped and held.overhead > DROP_WORTH, held.summary()
    _steps_within(_loss_kept, opt, model, x, y, budget, calls=3)
    latest = checkmate.plans_of(opt)[-1]
    assert latest.index == 1 and latest.joint.dropped, latest.summary()
    assert latest.overhead < held.overhead, (held.summary(), latest.summary())
    got = _grads(model)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    # a loop holding them from now on: raised from its backward, before that runs over; the
    # next call plans the step holding them, within the budget
    model.zero_grad(set_to_none=True)
    with MemoryTracker() as tracker, pytest.raises(checkmate.HeldOutputsError, match="still held"):
        _loss_only(opt, x, y)
    assert tracker.peak <= budget, f"measured {tracker.peak:,} of a budget of {budget:,}"
    _steps_within(_loss_only, opt, model, x, y, budget, calls=3)
    assert len(checkmate.plans_of(opt)) == 3 and not checkmate.plans_of(opt)[-1].joint.dropped


def _traced(fn, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    """``fn`` traced to aten ops with fake values, with the boxed calling convention."""
    gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    _name(gm, "saved_x", *(f"tangents_{k}" for k in range(1, len(shapes))))  # the backward's naming
    gm.graph.set_codegen(_BoxedCodeGen())
    gm.recompile()
    return gm


def test_a_zero_gradient_folds_into_an_addition_and_is_made_where_it_cannot() -> None:
    x, u = torch.randn(4, 8), torch.randn(4, 8)

    def add_then_scale(
        saved_x: torch.Tensor, t: torch.Tensor, u: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = t + saved_x * u  # folds: the gradient is the other operand
        # exp of a zero: a zero tensor is made for it; the last, which no given tangent
        # reaches, is None (a gradient is linear in the tangents: eager would not compute it)
        return g.sum(0), (t * 3).exp() * u, t * saved_x

    gm = _traced(add_then_scale, (4, 8), (4, 8), (4, 8))
    folded = fold_zeros(gm, frozenset({"tangents_1"}))
    got = folded([x, None, u])
    assert torch.equal(got[0], (x * u).sum(0)) and torch.equal(got[1], u) and got[2] is None
    code = folded.code
    assert "aten.add" not in code and "zeros_strided" in code

    def broadcast(saved_x: torch.Tensor, t: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor]:
        return (t + saved_x * u[0],)  # the zero is larger than the other operand: made, then added

    gm = _traced(broadcast, (8,), (4, 8), (4, 8))
    (got,) = fold_zeros(gm, frozenset({"tangents_1"}))([x[0], None, u])
    assert torch.equal(got, (x[0] * u[0]).expand(4, 8))


def _joint(fn, *shapes: tuple[int, ...]) -> torch.fx.GraphModule:
    gm = make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))
    _name(gm, "primals_1", "tangents_1", "tangents_2")
    return gm


def test_only_the_gradients_of_outputs_a_loss_was_computed_from_are_planned_unread() -> None:
    def logits(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor]:
        return ((t2 + x * t1).sum(0),)  # the loss's gradient of x, and the output x's: added

    def aux(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor]:
        return ((t2 + x).sum(0) * t1,)  # added to what no loss's gradient flows into

    def scaled(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor]:
        return ((t2 * 2 + x * t1).sum(0),)  # read by more than an addition

    def broadcast(x: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor) -> tuple[torch.Tensor]:
        return (t2 + (x * t1).sum(0),)  # added to a smaller tensor: its zero would be made

    assert unread_tangents(_joint(logits, (4, 8), (), (4, 8))) == {"tangents_2"}
    for fn in (aux, scaled, broadcast):
        assert unread_tangents(_joint(fn, (4, 8), (), (4, 8))) == frozenset(), fn.__name__
    # no loss (no gradient of one element): every gradient is counted
    assert unread_tangents(_joint(logits, (4, 8), (4, 8), (4, 8))) == frozenset()


class PooledTwice(nn.Module):
    """An encoder returning its hidden states and a pooled summary of them through a head of
    its own (a Hugging Face ``BertModel``'s ``pooler_output``), which a loss may leave unread."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(32, 32), nn.GELU())))
        self.pooler = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.body(x)
        return hidden, torch.tanh(self.pooler(hidden[:, 0]))


def test_parameters_only_an_unread_output_depends_on_get_no_gradient_as_in_eager() -> None:
    # a zero gradient would have AdamW step them (its weight decay and moments): eager leaves
    # them None, and the optimizer skips them. The pooler's gradients were zeros before
    torch.manual_seed(0)
    eager = PooledTwice()
    opt = checkmate.optimize(copy.deepcopy(eager), 0.7, time_limit=2.0)
    optims = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (eager, opt)]
    for _ in range(2):
        x = torch.randn(64, 16, 32)
        for model, optim in zip((eager, opt), optims, strict=True):
            optim.zero_grad(set_to_none=True)
            model(x)[0].square().mean().backward()
        assert opt.pooler.weight.grad is None and opt.pooler.bias.grad is None
        for p, q in zip(opt.parameters(), eager.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None)
            assert p.grad is None or q.grad is None or torch.equal(p.grad, q.grad)
        for optim in optims:
            optim.step()
        for p, q in zip(opt.parameters(), eager.parameters(), strict=True):
            assert torch.equal(p, q)
    # read, the pooled output gives its head gradients
    opt(torch.randn(64, 16, 32))[1].sum().backward()
    assert opt.pooler.weight.grad is not None


def test_a_backward_start_reports_the_bytes_of_the_watched_outputs_the_loop_still_holds() -> None:
    from checkmate.tangents import watch_held, watch_outputs

    w = torch.randn(8, 8, requires_grad=True)
    scale = torch.randn(4, 8)
    logits_key = frozenset({((4, 8), torch.float32)})
    seen: list[int] = []
    held: list[int] = []

    def step(hold: bool) -> None:
        logits = torch.randn(4, 8) @ w
        loss = (logits * scale).sum()  # saves scale, not the logits
        watch_outputs([loss.grad_fn], [loss, logits], logits_key, seen.append)
        watch_held([loss.grad_fn], [loss, logits], logits_key, held.append)
        if not hold:
            del logits  # as `model(**batch).loss.backward()` drops them
        loss.backward()

    step(hold=True)
    step(hold=False)
    assert seen == [4 * 8 * 4, 0]
    assert held == [4 * 8 * 4]  # only outputs still held are reported as held
