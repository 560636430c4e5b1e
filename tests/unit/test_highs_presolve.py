"""An infeasibility claim of HiGHS's presolve is checked before it becomes a proof.

HiGHS 1.16's presolve proves this 9-node Checkmate MILP infeasible at exactly its keep-all
peak, where checkpoint-all fits (found by hypothesis in test_lp_rounding). The MILP must
plan it, and no budget with a schedule may be reported infeasible.
"""

from __future__ import annotations

from solvers import Graph
from solvers.graph import Node
from solvers.result import Status
from solvers.schedule import keep_all_peak
from solvers.strategies.ilp import ilp

EDGES = (
    (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 7), (0, 8), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6),
    (1, 7), (1, 8), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7), (2, 8), (3, 4), (3, 5), (3, 6), (4, 5),
    (5, 6), (5, 8), (6, 7), (7, 8),
)  # fmt: skip


def _graph() -> Graph:
    fixed = {1, 3, 4, 6, 8}
    mem = {4: 2, 6: 2}
    nodes = tuple(
        Node(id=i, name=str(i), cost=1.0, mem=mem.get(i, 1), recomputable=i not in fixed, key=i)
        for i in range(9)
    )
    return Graph(nodes, EDGES)


def test_milp_plans_at_the_keep_all_peak_where_presolve_claims_infeasibility() -> None:
    g = _graph()
    peak = keep_all_peak(g)
    res = ilp(g, peak, time_limit=30)
    assert res.status == Status.OPTIMAL, res.info
    assert res.peak is not None and res.peak <= peak
    assert res.cost == g.total_cost  # nothing needs recomputing at the keep-all peak
