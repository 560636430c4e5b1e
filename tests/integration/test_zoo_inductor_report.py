"""The verdicts of ``make bench-zoo-inductor`` (:mod:`benchmarks.zoo_inductor`), without models."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks.zoo_inductor import GRAD_TOL, Row, render, status

pytestmark = pytest.mark.torch


def test_a_row_is_ok_only_within_the_budget_and_the_gradient_tolerance() -> None:
    ok = Row("m", budget=100, peak=99, short_peak=100, grad_err=GRAD_TOL / 2)
    assert status(ok) == "ok"
    # the short last batch over the budget fails the row, and says whether a warning said so
    assert status(Row("m", budget=100, peak=99, short_peak=101, grad_err=0.0)) == "over the budget, unwarned"
    warned = Row("m", budget=100, peak=101, short_peak=90, grad_err=0.0, warned="graph 0: over")
    assert status(warned) == "over the budget, warned"
    assert status(Row("m", budget=100, peak=99, short_peak=99, grad_err=2 * GRAD_TOL)).startswith(
        "gradients differ"
    )
    assert status(Row("m", budget=100, peak=99, short_peak=99)) == "gradients differ"  # never compared


def test_the_report_counts_the_rows_that_held_and_quotes_the_warnings() -> None:
    rows = [
        Row(
            "a",
            budget=2**20,
            eager_peak=2**21,
            peak=2**20 - 1,
            short_peak=2**19,
            grad_err=1e-7,
            first_s=3.0,
            plans=2,
            compiled=1,
        ),
        Row(
            "b",
            status="over the budget, warned",
            budget=2**20,
            peak=2**20 + 1,
            warned="graph 0: over its budget",
        ),
    ]
    rows[0].status = status(rows[0])
    text = render(rows, 0.6, 60.0, "python -m benchmarks.zoo_inductor")
    assert "| a | 2.00 | 1.00 | 1.000x | 0.500x | 1.0e-07 | 3 | - | 1 of 2 | ok |" in text
    assert "| b | - | 1.00 | 1.000x | - | - | - | - | - | over the budget, warned |" in text
    assert "- b: graph 0: over its budget" in text
    # a plan that fell back uncompiled is said, though the row held its budget
    assert "1 of 2 models held the budget with eager's gradients; 0 of 2 ran every plan compiled" in text
