"""The MILP through PuLP: files for other solvers, and PuLP's bundled CBC agreeing with HiGHS."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from solvers import Status, keep_all_peak, validate
from solvers.formulation import formulate
from solvers.pulp_export import solve_pulp, to_pulp, write_lp, write_mps
from solvers.strategies.ilp import ilp
from tests.graphs import chain
from tests.unit.test_ilp import sched, training_chain3

pulp = pytest.importorskip("pulp")


def _cbc() -> object:
    with warnings.catch_warnings():
        # PuLP 3.3 deprecates PULP_CBC_CMD (its bundled CBC) in favour of a separate install
        warnings.simplefilter("ignore", DeprecationWarning)
        if "PULP_CBC_CMD" not in pulp.listSolvers(onlyAvailable=True):
            pytest.skip("PuLP's bundled CBC is not available here")
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=60)


def test_pulp_model_mirrors_the_sparse_model() -> None:
    g = chain(4, training=True)
    budget = keep_all_peak(g)
    model = formulate(g, budget)
    prob = to_pulp(g, budget)
    assert prob.numVariables() == model.num_vars
    # equality rows are one constraint each, one-sided rows one each
    assert prob.numConstraints() == model.num_constraints
    assert sum(v.cat == pulp.LpInteger for v in prob.variables()) == model.num_binaries


def test_cbc_matches_highs_on_a_small_instance() -> None:
    g = chain(6, training=True)
    budget = int(0.6 * keep_all_peak(g))
    ref = ilp(g, budget, time_limit=60)
    res = solve_pulp(g, budget, _cbc())
    assert ref.status == Status.OPTIMAL and res.status == Status.OPTIMAL
    assert res.cost == pytest.approx(ref.cost)
    validate(g, sched(res), budget)


def test_default_solver_and_infeasible() -> None:
    g = training_chain3(nonrec=(0,))
    res = solve_pulp(g, 3, time_limit=60)  # the MILP proves it (above the cheap bound)
    assert res.status == Status.INFEASIBLE
    res = solve_pulp(training_chain3(), 3, time_limit=60)
    assert res.status == Status.OPTIMAL and res.cost == 7


def test_write_mps_and_lp_round_trip(tmp_path: Path) -> None:
    g = chain(4, training=True)
    budget = int(0.7 * keep_all_peak(g))
    mps = write_mps(g, budget, tmp_path / "m.mps")
    lp = write_lp(g, budget, tmp_path / "m.lp")
    assert "R_0_0" in mps.read_text()
    assert lp.read_text().splitlines()[1] == "Minimize"
    # the MPS file read back by PuLP solves to the same optimum as the direct model
    _, prob = pulp.LpProblem.fromMPS(str(mps))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        prob.solve(_cbc())
    ref = ilp(g, budget, time_limit=60)
    model = formulate(g, budget)
    assert pulp.value(prob.objective) * model.cost_unit == pytest.approx(ref.cost)
