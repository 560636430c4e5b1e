"""A loss computed outside the module, inline: the outputs it reads are dropped before the backward.

``F.cross_entropy(model(x)[mask], y)`` keeps no reference to the module's outputs: the loss
reads them and they are gone before the module's backward starts (a cross-entropy saves its
log-softmax, not its input). A plan holding them to the backward's end, as a loop keeping
``out = model(x)`` does, counts them beside their gradients. Where no such plan fits, the
step is planned with them dropped when the forward ends, and each backward checks the loop
did drop them (:meth:`checkmate.runtime.Planner.held`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import checkmate
from checkmate.api import plans_of
from checkmate.memory import MemoryTracker, measure_peak
from checkmate.stepcheck import STEP_SLACK
from tests.integration._models import TinyTransformer

pytestmark = pytest.mark.torch

VOCAB, LENGTH = 2048, 128


def _masked_lm() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    # 8 MiB of logits, a loss on 15% of their positions
    torch.manual_seed(0)
    model = TinyTransformer(VOCAB, 64, 2)
    x = torch.randint(0, VOCAB, (8, LENGTH))
    mask = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.15
    return model, x, mask


def _inline(model: Any, x: torch.Tensor, mask: torch.Tensor) -> None:
    F.cross_entropy(model(x)[mask], x[mask]).backward()


def _held(model: Any, x: torch.Tensor, mask: torch.Tensor) -> None:
    out = model(x)  # held through the backward
    F.cross_entropy(out[mask], x[mask]).backward()


def _budget(model: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor, fraction: float) -> int:
    eager = copy.deepcopy(model)
    _inline(eager, x, mask)
    eager.zero_grad(set_to_none=True)
    return int(fraction * measure_peak(lambda: _inline(eager, x, mask)))


def test_a_loss_computed_inline_is_planned_with_the_outputs_it_reads_dropped_where_no_plan_holding_them_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # at 0.7 of eager's peak, no plan holding the logits to the backward's end fits (the least
    # such peak was 18.04 MiB, 0.83 of eager's): before, InfeasibleBudgetError at the first call
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    model, x, mask = _masked_lm()
    ref = copy.deepcopy(model)
    budget = _budget(model, x, mask, 0.7)
    opt = checkmate.optimize(model, budget, time_limit=4)
    peaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", checkmate.BudgetWarning)  # the steps before a measure
        for _ in range(5):
            model.zero_grad(set_to_none=True)
            peaks.append(measure_peak(lambda: _inline(opt, x, mask)))
    print(f"budget {budget:,}; measured {[round(p / budget, 3) for p in peaks]}x")
    plans = plans_of(opt)
    assert plans and all(p.joint.dropped for p in plans)
    assert all(p <= STEP_SLACK * budget for p in peaks[2:]), [p / budget for p in peaks]
    _inline(ref, x, mask)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_loop_holding_the_outputs_where_only_a_plan_dropping_them_fits_is_told_from_its_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the same step with the logits kept in a local: the budget the inline loss fits in is
    # refused, from the module's backward, and at the calls after it. That step exceeds the
    # budget by up to the logits' bytes: the loss's backward made their gradient beside them
    # before the module's backward could see them held
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    model, x, mask = _masked_lm()
    budget = _budget(model, x, mask, 0.7)
    opt = checkmate.optimize(model, budget, time_limit=4)
    with MemoryTracker() as tracker, pytest.raises(checkmate.InfeasibleBudgetError) as err:
        _held(opt, x, mask)
    (rec,) = plans_of(opt)
    assert rec.joint.dropped, "planned holding the logits: nothing to test"
    said = " ".join(err.value.notes)
    assert "still held" in said and "the loss outside the module reads" in said and "inline" in said, said
    logits = 8 * LENGTH * VOCAB * 4
    assert tracker.peak > budget, "the held step fitted: nothing to test"
    assert tracker.peak <= STEP_SLACK * budget + logits, (
        f"measured {tracker.peak:,} of a budget of {budget:,}"
    )
    with warnings.catch_warnings(), pytest.raises(checkmate.InfeasibleBudgetError) as err:
        warnings.simplefilter("ignore", checkmate.BudgetWarning)
        _held(opt, x, mask)
    assert any("an earlier step held them there" in note for note in err.value.notes), err.value.notes
