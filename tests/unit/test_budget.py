"""Budget parsing."""

from __future__ import annotations

import pytest

from solvers import Budget, BudgetError, format_bytes, parse_budget


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (1_000_000, Budget(nbytes=1_000_000)),
        ("16GB", Budget(nbytes=16 * 10**9)),
        ("12GiB", Budget(nbytes=12 * 2**30)),
        ("1.5 MiB", Budget(nbytes=3 * 2**19)),
        ("1500000000", Budget(nbytes=1_500_000_000)),
        (0.6, Budget(fraction=0.6)),
        ("0.6", Budget(fraction=0.6)),
        ("60%", Budget(fraction=0.6)),
        ("1", Budget(fraction=1.0)),
    ],
)
def test_parse(spec: object, expected: Budget) -> None:
    assert parse_budget(spec) == expected


@pytest.mark.parametrize(
    "spec",
    [
        *("abc", "", "-3GB", "0", "0%", "12 parsecs", 0, -1, 0.0, 7.5, True, None, [1], 1e400, float("nan")),
        *("1e400", "1e400GB", "1e308TB", "4.5", "1.5B", "1000000.5"),
    ],
)
def test_bad_budgets(spec: object) -> None:
    with pytest.raises(BudgetError):
        parse_budget(spec)


def test_the_rule_for_unitless_numbers() -> None:
    """A unit-less string is a fraction up to 4 and whole bytes above it; "4.5" is neither."""
    assert parse_budget("4") == Budget(fraction=4.0)
    assert parse_budget("4.0") == Budget(fraction=4.0)
    assert parse_budget("5") == Budget(nbytes=5)
    assert parse_budget("1e30") == Budget(nbytes=int(1e30))
    assert parse_budget("1.1 MiB") == Budget(nbytes=int(1.1 * 2**20))  # rounded down with a unit
    with pytest.raises(BudgetError, match="not a whole number"):
        parse_budget("4.5")
    with pytest.raises(BudgetError, match="too large"):
        parse_budget("1e400")


def test_resolve() -> None:
    assert parse_budget("50%").resolve(1001) == 500
    assert parse_budget("2KiB").resolve(10) == 2048


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"


@pytest.mark.parametrize("spec", ["min", " MIN ", Budget.least_peak()])
def test_min_is_the_least_peak_budget(spec: object) -> None:
    b = parse_budget(spec)
    assert b.least and b.nbytes is None and b.fraction is None
    assert str(b) == "min"
    with pytest.raises(BudgetError, match="no byte value before planning"):
        b.resolve(1000)


def test_a_budget_sets_exactly_one_kind() -> None:
    for bad in ({}, {"nbytes": 10, "fraction": 0.5}, {"fraction": 0.5, "least": True}):
        with pytest.raises(BudgetError, match="exactly one"):
            Budget(**bad)  # type: ignore[arg-type]


def test_a_parsed_budget_is_passed_through_and_resolves_once_per_graph() -> None:
    b = parse_budget("50%")
    assert parse_budget(b) is b
    on_graph = b.for_graph(1001, reserve=100)
    assert (on_graph.nbytes, on_graph.reference) == (400, 1001)
    assert b.for_graph(10, reserve=100).nbytes == 1  # never below one byte


def test_resolve_budget_trusts_the_reference_a_budget_carries() -> None:
    """The keep-all peak is simulated only when the budget does not carry it: the layers
    below the front door do not simulate it again."""
    from solvers.api import resolve_budget
    from solvers.schedule import keep_all_peak
    from tests.graphs import chain

    g = chain(5, training=True)
    ref = keep_all_peak(g)
    assert resolve_budget(g, 0.5) == (ref // 2, ref)
    # a made-up reference comes back as given: nothing re-simulated it
    assert resolve_budget(g, Budget(fraction=0.5, reference=4 * ref)) == (2 * ref, 4 * ref)


def test_a_relative_change_prints_its_sign_once_and_no_negative_zero() -> None:
    from solvers.budget import format_change

    assert format_change(0.1234) == "+12.3%" and format_change(-0.05) == "-5.0%"
    assert format_change(-1e-12) == "+0.0%"  # a float error printed "+-0.0%"
    assert format_change(-0.004, 0) == "+0%" and format_change(0.026, 0) == "+3%"
