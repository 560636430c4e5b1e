"""Strategy options are strict: an unknown key or a bad value raises OptionError, a
CheckmateError (never a bare ValueError that a front end would relabel)."""

from __future__ import annotations

import pytest

from solvers import keep_all_peak, solve
from solvers.errors import CheckmateError, OptionError
from solvers.strategies import COMMON_OPTIONS, get_strategy, strategy_names, strategy_options
from tests.graphs import chain


def test_unknown_option_raises_naming_the_valid_ones() -> None:
    g = chain(6)
    budget = keep_all_peak(g)
    with pytest.raises(
        OptionError, match=r"strategy 'dtr' has no option 'heuristc'; its options: .*heuristic"
    ):
        solve(g, budget, "dtr", heuristc="eq")
    with pytest.raises(OptionError, match=r"'auto' has no option 'mip_gap'.*milp_max_nodes"):
        solve(g, budget, "auto", time_limit=5, mip_gap=0.1)
    with pytest.raises(OptionError, match=r"'chen-sqrtn' has no option 'threads'.*mode"):
        get_strategy("chen-sqrtn")(g, budget, threads=2)
    assert issubclass(OptionError, CheckmateError)


def test_common_options_reach_only_strategies_that_take_them() -> None:
    g = chain(6)
    budget = keep_all_peak(g)
    seen: list[object] = []
    # chen-sqrtn has no progress callback: the keyword is accepted and dropped
    res = solve(g, budget, "chen-sqrtn", time_limit=5, progress=seen.append)
    assert res.ok and res.schedule is not None
    for name in strategy_names():
        try:
            opts = strategy_options(name)
        except CheckmateError:  # optional dependency missing
            continue
        assert opts[: len(COMMON_OPTIONS)] == COMMON_OPTIONS, name


def test_bad_option_value_raises_option_error() -> None:
    g = chain(6)
    budget = keep_all_peak(g)
    with pytest.raises(OptionError, match="heuristic="):
        solve(g, budget, "dtr", heuristic="nope")
    with pytest.raises(OptionError, match="support must be"):
        solve(g, budget, "ilp", time_limit=5, support="nope")


@pytest.mark.torch
def test_optimize_reports_a_bad_option_as_option_error_not_trace_error() -> None:
    """A misspelled option is an OptionError naming the valid ones, raised by optimize
    itself (before any tracing), not a TraceError from inside torch.compile."""
    torch = pytest.importorskip("torch")
    import checkmate

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with pytest.raises(OptionError, match=r"has no option 'heuristc'.*heuristic"):
        checkmate.optimize(model, 0.9, strategy="dtr", profile="cpu", options={"heuristc": "eq"})
