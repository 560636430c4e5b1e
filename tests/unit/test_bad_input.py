"""Bad input never becomes an internal error.

From Python, reading a graph or a plan raises a ``CheckmateError`` subclass (``GraphError``,
``PlanError``) or succeeds; from the command line, bad input exits 2 with one line on stderr
and never 3 ("internal error"). One test per known case, then a hypothesis fuzz that mutates
graph and plan documents (types, NaN/inf, huge numbers, ids, nesting, truncation, bytes).

The fuzz runs ``FUZZ_EXAMPLES`` cases per document kind (default 1500; set the environment
variable ``CHECKMATE_FUZZ_EXAMPLES`` for a longer run), derandomized so CI is deterministic
(``CHECKMATE_FUZZ_RANDOM=1`` draws fresh cases instead).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkmate import cli_report
from checkmate.cli import cli
from solvers import (
    BudgetError,
    Graph,
    GraphError,
    PlanError,
    SolveResult,
    Status,
    load_graph,
    read_plan,
    save_graph,
    validate,
)
from solvers.api import solve
from solvers.errors import CheckmateError
from solvers.graph import MAX_NODE_BYTES, MAX_TOTAL_BYTES
from solvers.io import graph_from_dict, graph_to_dict
from solvers.plan import document_checksum, plan_to_dict, read_plan_document, write_plan
from solvers.scaling import MAX_COST_SPAN
from solvers.schedule import schedule_from_order, simulate
from solvers.strategies import get_strategy
from tests.graphs import chain

FUZZ_EXAMPLES = int(os.environ.get("CHECKMATE_FUZZ_EXAMPLES", "1500"))
CLI_FUZZ_EXAMPLES = max(40, FUZZ_EXAMPLES // 20)


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


def _one_line_exit_2(res: Result) -> str:
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert "Traceback" not in res.output and "internal error" not in res.output
    err = res.stderr.strip()
    assert err and "\n" not in err, f"expected one line on stderr, got {err!r}"
    return err


# ---------------------------------------------------------------- documents
def _own_doc() -> dict[str, Any]:
    return graph_to_dict(chain(3, training=True))


def _node_link_checkmate() -> dict[str, Any]:
    nodes = [
        {"id": i, "name": f"op{i}", "cost_cpu": 1.0 + i, "cost_ram": 4, "backward": i > 1} for i in range(4)
    ]
    links = [{"source": i, "target": i + 1} for i in range(3)]
    return {"directed": True, "graph": {"name": "nl"}, "nodes": nodes, "links": links}


def _node_link_layered() -> dict[str, Any]:
    nodes = [{"name": f"n{i}", "out_cost": 2 + i, "duration": 1.5} for i in range(4)]
    links = [{"0": f"n{i}", "1": f"n{i + 1}"} for i in range(3)]
    return {"graph": {"order": [f"n{i}" for i in range(4)]}, "nodes": nodes, "links": links}


def _with(doc: dict[str, Any], edit: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    edit(doc)
    return doc


def _node(doc: dict[str, Any], **fields: Any) -> None:
    doc["nodes"][1].update(fields)


GRAPH_CASES: dict[str, tuple[Any, str]] = {
    # name: (the document, or bytes / text for the file; what the message says)
    "NaN mem": (_with(_own_doc(), lambda d: _node(d, mem=math.nan)), "mem must be a finite number"),
    "NaN cost": (_with(_own_doc(), lambda d: _node(d, cost=math.nan)), "cost must be a finite number"),
    "infinite cost": (_with(_own_doc(), lambda d: _node(d, cost=math.inf)), "cost must be a finite number"),
    "cost beyond float": (
        _with(_own_doc(), lambda d: _node(d, cost=10**400)),
        "cost must be a finite number",
    ),
    "mem 1e30": (_with(_own_doc(), lambda d: _node(d, mem=1e30)), "sizes must be below 2**53"),
    "mem 10**29 integer": (_with(_own_doc(), lambda d: _node(d, mem=10**29)), "sizes must be below 2**53"),
    "mem 2**63": (_with(_own_doc(), lambda d: _node(d, mem=2**63)), "sizes must be below 2**53"),
    "mem fractional": (_with(_own_doc(), lambda d: _node(d, mem=1.5)), "whole numbers of bytes"),
    "mem a string": (_with(_own_doc(), lambda d: _node(d, mem="4")), "mem must be a number"),
    "mem true": (_with(_own_doc(), lambda d: _node(d, mem=True)), "mem must be a number"),
    "sizes sum above int64": (
        {
            "format": "checkmate-graph",
            "version": 1,
            "nodes": [{"id": i, "cost": 1, "mem": MAX_NODE_BYTES - 1} for i in range(513)],
            "edges": [],
        },
        "the node sizes sum to",
    ),
    "negative mem": (_with(_own_doc(), lambda d: _node(d, mem=-1)), "mem must be a finite number >= 0"),
    "negative cost": (_with(_own_doc(), lambda d: _node(d, cost=-2.0)), "cost must be a finite number >= 0"),
    "id a list": (_with(_own_doc(), lambda d: _node(d, id=[1])), "must be a string or an integer"),
    "id an object": (_with(_own_doc(), lambda d: _node(d, id={"a": 1})), "must be a string or an integer"),
    "id null": (_with(_own_doc(), lambda d: _node(d, id=None)), "must be a string or an integer"),
    "id a float": (_with(_own_doc(), lambda d: _node(d, id=1.5)), "must be a string or an integer"),
    "edge end a list": (
        _with(_own_doc(), lambda d: d["edges"].append([[0], 1])),
        "must be a string or an integer",
    ),
    "edge not a pair": (_with(_own_doc(), lambda d: d["edges"].append([0, 1, 2])), "[source, target] pair"),
    "missing mem": (_with(_own_doc(), lambda d: d["nodes"][1].pop("mem")), "lacks field(s) mem"),
    "missing nodes": (_with(_own_doc(), lambda d: d.pop("nodes")), "'nodes' must be a list"),
    "no nodes": (_with(_own_doc(), lambda d: d.update(nodes=[], edges=[])), "no nodes"),
    "node not an object": (_with(_own_doc(), lambda d: d["nodes"].append(7)), "must be a JSON object"),
    "duplicate ids": (_with(_own_doc(), lambda d: _node(d, id=d["nodes"][0]["id"])), "duplicate node id"),
    "dangling edge": (_with(_own_doc(), lambda d: d["edges"].append([0, "ghost"])), "dangling edge"),
    "cycle": (_with(_own_doc(), lambda d: d["edges"].append([d["nodes"][-1]["id"], 0])), "cycle"),
    "backward a string": (_with(_own_doc(), lambda d: _node(d, backward="yes")), "must be true or false"),
    "name a list": (_with(_own_doc(), lambda d: _node(d, name=[1])), "name must be a string"),
    "meta a list": (_with(_own_doc(), lambda d: d.update(meta=[1, 2])), "'meta' must be a JSON object"),
    "unknown version": (_with(_own_doc(), lambda d: d.update(version=2)), "unknown graph format version"),
    "not an object": ([1, 2, 3], "expected a JSON object"),
    "node-link graph a list": (
        _with(_node_link_checkmate(), lambda d: d.update(graph=[1])),
        "'graph' must be",
    ),
    "node-link id a list": (
        _with(_node_link_checkmate(), lambda d: d["nodes"][2].update(id=[2])),
        "must be a string or an integer",
    ),
    "node-link link an int": (_with(_node_link_layered(), lambda d: d.update(links=[5])), "lacks"),
    "node-link order an int": (_with(_node_link_layered(), lambda d: d["graph"].update(order=3)), "order"),
    "node-link order of lists": (
        _with(_node_link_layered(), lambda d: d["graph"].update(order=[[1]] * 4)),
        "must be a string or an integer",
    ),
    "random bytes": (bytes(range(256)) * 4, "JSON"),
    "not UTF-8": (b'{"format": "checkmate-graph", "name": "\xff\xfe\x80"}', "not JSON text"),
    "100k-deep nesting": ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    "100k-deep nesting in a field": (
        json.dumps(_own_doc()).replace('"meta": {}', '"meta": ' + "[" * 100_000 + "]" * 100_000),
        "nested too deeply",
    ),
    "5000-digit integer": (
        '{"format": "checkmate-graph", "version": 1, "nodes": [{"mem": 1' + "0" * 5000 + "}]}",
        "JSON",
    ),
    "truncated": (json.dumps(_own_doc())[:-40], "malformed JSON"),
    "empty file": ("", "malformed JSON"),
}


def _write_case(path: Path, content: Any) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    else:
        path.write_text(json.dumps(content))
    return path


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_bad_graph_raises_graph_error(case: str, tmp_path: Path) -> None:
    content, match = GRAPH_CASES[case]
    path = _write_case(tmp_path / "g.json", content)
    with pytest.raises(GraphError, match=_re(match)) as info:
        load_graph(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_bad_graph_exits_2_from_the_cli(case: str, tmp_path: Path) -> None:
    content, match = GRAPH_CASES[case]
    path = _write_case(tmp_path / "g.json", content)
    out = tmp_path / "plan.json"
    err = _one_line_exit_2(run("solve", str(path), "-b", "0.9", "-s", "chen-greedy", "-o", str(out), "-q"))
    assert match in err
    assert not out.exists()


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_limits_are_inclusive_where_documented() -> None:
    """The largest size and a total just below 2**62 are accepted, and their arrays are exact."""
    nodes = [{"key": i, "cost": 1.0, "mem": MAX_NODE_BYTES - 1} for i in range(511)]
    g = Graph.build(nodes, [(i, i + 1) for i in range(510)])
    assert int(g.mem.sum()) == 511 * (MAX_NODE_BYTES - 1) < MAX_TOTAL_BYTES
    assert g.mem.dtype.name == "int64" and int(g.mem[0]) == MAX_NODE_BYTES - 1
    assert Graph.build([{"key": "a", "cost": 1, "mem": 8.0}], []).nodes[0].mem == 8  # 8.0 is whole


@pytest.mark.parametrize(
    ("nodes", "edges", "match"),
    [
        ([{"cost": 1, "mem": 1}], [], "'key'"),
        ([7], [], "'key'"),
        ([{"key": [1], "cost": 1, "mem": 1}], [], "ids must be strings or integers"),
        ([{"key": math.nan, "cost": 1, "mem": 1}], [], "ids must be strings or integers"),
        ([{"key": "a", "cost": 1, "mem": 1}], [(["a"], "a")], "string or integer ids"),
        ([{"key": "a", "cost": math.nan, "mem": 1}], [], "finite"),
        ([{"key": "a", "cost": "1", "mem": 1}], [], "costs must be numbers"),
        ([{"key": "a", "cost": 1, "mem": None}], [], "sizes must be integers"),
        ([{"key": "a", "cost": 1, "mem": math.inf}], [], "whole numbers"),
        ([{"key": "a", "cost": 1, "mem": 1e30}], [], "below 2**53"),
        ([{"key": "a", "cost": 1, "mem": 1}], [], None),
    ],
)
def test_graph_build_from_python_raises_graph_error(nodes: Any, edges: Any, match: str | None) -> None:
    if match is None:
        assert Graph.build(nodes, edges).n == 1
        with pytest.raises(GraphError, match="order must be a list of node ids"):
            Graph.build(nodes, edges, order=[["a"]])
        return
    with pytest.raises(GraphError, match=_re(match)):
        Graph.build(nodes, edges)


def test_cost_sum_beyond_float_is_rejected() -> None:
    nodes = [{"key": i, "cost": 1e308, "mem": 1} for i in range(3)]
    with pytest.raises(GraphError, match="costs sum"):
        Graph.build(nodes, [])


# ---------------------------------------------------------------- huge costs and sizes in the models
def _with_costs(graph: Graph, costs: dict[int, float] | None = None, factor: float = 1.0) -> Graph:
    nodes = [
        {
            "key": nd.ext,
            "name": nd.name,
            "cost": (costs or {}).get(nd.id, nd.cost) * factor,
            "mem": nd.mem,
            "backward": nd.backward,
        }
        for nd in graph.nodes
    ]
    return Graph.build(nodes, [(graph.nodes[u].ext, graph.nodes[v].ext) for u, v in graph.edges])


def _varied(n: int = 6) -> Graph:
    g = chain(n, training=True)
    return _with_costs(g, {i: 1.0 + (i % 3) for i in range(g.n)})


def _exact_strategies() -> list[str]:
    names = ["ilp", "lp-rounding", "poet"]
    try:
        get_strategy("cpsat")
        names.append("cpsat")
    except CheckmateError:
        pass
    return names


@pytest.mark.parametrize("strategy", _exact_strategies())
def test_costs_beyond_the_span_are_rejected_by_the_exact_models(strategy: str) -> None:
    g = _with_costs(_varied(), {3: 1e30})
    with pytest.raises(GraphError, match=r"node 3 \('f3'\) costs 1e\+30.*within a ratio of 1e\+09"):
        solve(g, 0.6, strategy, time_limit=20)


def test_costs_beyond_the_span_exit_2_from_the_cli(tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    save_graph(_with_costs(_varied(), {3: 1e30}), path)
    out = tmp_path / "p.json"
    err = _one_line_exit_2(run("solve", str(path), "-b", "0.6", "-s", "ilp", "-o", str(out), "-q"))
    assert "node 3 ('f3') costs 1e+30" in err and "within a ratio of 1e+09" in err
    assert not out.exists()


def test_costs_at_the_span_limit_are_taken() -> None:
    g = _with_costs(_varied(), {3: MAX_COST_SPAN})  # the cheapest positive cost is 1
    res = solve(g, 0.6, "ilp", time_limit=30)
    assert res.ok and res.schedule is not None
    assert res.schedule.compute_counts(g.n)[3] == 1  # the expensive node is never recomputed


@pytest.mark.parametrize(("big", "fraction"), [(1e10, 0.5), (1e30, 0.6)])
def test_auto_plans_a_graph_whose_costs_span_too_much(big: float, fraction: float) -> None:
    """auto records the exact models' GraphError and keeps the heuristics' plan."""
    g = _with_costs(_varied(), {3: big})
    res = solve(g, fraction, "auto", time_limit=20)
    assert res.ok and res.schedule is not None
    validate(g, res.schedule, res.budget)
    if big == 1e30:  # 1e30 + the heuristics' recomputes == 1e30 == the bound: auto stops early
        assert res.schedule.compute_counts(g.n)[3] == 1  # the expensive node is never recomputed
    else:  # at 0.5 the heuristics' plans cost more than the bound: auto tries the MILP
        errors = [str(v) for v in res.info["candidates"].values() if str(v).startswith("error:")]
        assert errors and all("within a ratio of 1e+09" in e for e in errors)


@pytest.mark.parametrize("strategy", [s for s in _exact_strategies() if s != "poet"])
def test_uniformly_scaled_costs_give_identical_plans(strategy: str) -> None:
    """Costs x 2**100 (the largest ~2.5e30) give the same model, so the same plan, as costs x 1.

    (Not POET: its transfer times do not scale with the costs, so the trade-off changes.)
    """
    g = _varied(5)
    big = _with_costs(g, factor=2.0**100)
    assert max(nd.cost for nd in big.nodes) > 1e30
    a = solve(g, 0.6, strategy, time_limit=30)
    b = solve(big, 0.6, strategy, time_limit=30)
    assert a.ok and b.ok and a.schedule is not None and b.schedule is not None
    assert simulate(g, a.schedule).cost > g.total_cost  # the budget forces recomputation
    assert a.schedule.steps == b.schedule.steps
    assert b.cost == pytest.approx(a.cost * 2.0**100, rel=1e-12)


@pytest.mark.parametrize("budget", ["1e400", "1e400GB", "4.5", "nan", "inf"])
def test_bad_budgets_exit_2_from_the_cli_and_raise_budget_error(budget: str, tmp_path: Path) -> None:
    path = tmp_path / "g.json"
    save_graph(chain(4, training=True), path)
    out = str(tmp_path / "p.json")
    err = _one_line_exit_2(run("solve", str(path), "-b", budget, "-s", "checkpoint-all", "-o", out, "-q"))
    assert "budget" in err
    with pytest.raises(BudgetError):
        solve(chain(4, training=True), budget, "checkpoint-all")


def test_budget_1e400_float_from_python() -> None:
    with pytest.raises(BudgetError):
        solve(chain(4, training=True), 1e400, "checkpoint-all")


def test_cpsat_takes_a_budget_of_1e30_bytes() -> None:
    try:
        cpsat = get_strategy("cpsat")
    except CheckmateError:
        pytest.skip("OR-Tools not installed")
    g = chain(4, training=True)
    res = cpsat(g, 10**30, time_limit=20)
    assert res.status == Status.OPTIMAL and res.schedule is not None
    assert simulate(g, res.schedule).cost == g.total_cost


@pytest.mark.parametrize(
    "strategy", ["chen-greedy", "ilp", *(["cpsat"] if "cpsat" in _exact_strategies() else [])]
)
def test_sizes_near_2_53_plan_exactly(strategy: str) -> None:
    """Sizes just below the 2**53 limit with gcd 1: the models' memory stays exact."""
    g0 = chain(4, training=True)
    nodes = [
        {
            "key": nd.ext,
            "name": nd.name,
            "cost": 1.0,
            "mem": MAX_NODE_BYTES - 1 - 7 * nd.id,
            "backward": nd.backward,
        }
        for nd in g0.nodes
    ]
    g = Graph.build(nodes, [(g0.nodes[u].ext, g0.nodes[v].ext) for u, v in g0.edges])
    res = solve(g, 0.8, strategy, time_limit=30)
    assert res.ok and res.schedule is not None
    sim = validate(g, res.schedule, res.budget)
    assert sim.peak == res.peak <= res.budget


# ---------------------------------------------------------------- plans
def _plan_graph() -> Graph:
    return chain(4, training=True)


def _plan_doc() -> dict[str, Any]:
    g = _plan_graph()
    n = g.n // 2
    sched = schedule_from_order(g, list(range(n)) + list(range(n - 1)) + list(range(n, 2 * n)))
    sim = simulate(g, sched)
    res = SolveResult("test", Status.FEASIBLE, sim.peak, sched, sim.cost, sim.peak, lower_bound=None)
    return json.loads(json.dumps(plan_to_dict(g, res)))


PLAN_CASES: dict[str, tuple[Callable[[dict[str, Any]], Any], str]] = {
    "budget a string": (lambda d: d.update(budget_bytes="abc"), "'budget_bytes' must be an integer"),
    "budget a float": (lambda d: d.update(budget_bytes=1.5), "'budget_bytes' must be an integer"),
    "budget negative": (lambda d: d.update(budget_bytes=-1), "'budget_bytes' must be an integer"),
    "budget 400 digits": (lambda d: d.update(budget_bytes=10**400), "'budget_bytes' must be an integer"),
    "strategy a list": (lambda d: d.update(strategy=["x"]), "'strategy' must be a string"),
    "cost a string": (lambda d: d.update(cost="cheap"), "'cost' must be a number or null"),
    "cost true": (lambda d: d.update(cost=True), "'cost' must be a number or null"),
    "peak a dict": (lambda d: d.update(peak_memory={}), "'peak_memory' must be"),
    "info a list": (lambda d: d.update(info=[1]), "'info' must be a JSON object"),
    "info null": (lambda d: d.update(info=None), "'info' must be a JSON object"),
    "schedule a dict": (lambda d: d.update(schedule={}), "'schedule' must be a list"),
    "step not a pair": (lambda d: d["schedule"].append(["compute"]), "schedule step"),
    "step unknown op": (lambda d: d["schedule"].insert(0, ["explode", 0]), "schedule step 0"),
    "step op a list": (lambda d: d["schedule"].insert(0, [["compute"], 0]), "schedule step 0"),
    "step node a list": (lambda d: d["schedule"].insert(0, ["compute", [0]]), "schedule step 0"),
    "step node unknown": (lambda d: d["schedule"].insert(0, ["compute", "ghost"]), "not in the graph"),
    "decision computes a string": (lambda d: d["decisions"][0].update(computes="2"), "decision 0"),
    "decision not an object": (lambda d: d["decisions"].append(3), "decision 8"),
    "stages a list": (lambda d: d.update(stages=[1]), "'stages' must be a JSON object"),
    "unknown version 2": (lambda d: d.update(version=2), "version 2 is not supported"),
    "version true": (lambda d: d.update(version=True), "is not supported"),
    "version a string": (lambda d: d.update(version="1"), "is not supported"),
    "version 1.0": (lambda d: d.update(version=1.0), "is not supported"),
    "missing status": (lambda d: d.pop("status"), "lacks field 'status'"),
    "not a plan": (lambda d: d.pop("format"), "not a checkmate plan"),
}


def _write_plan_case(path: Path, case: str) -> Path:
    edit, _ = PLAN_CASES[case]
    doc = _plan_doc()
    edit(doc)
    return write_plan(path, doc)  # re-sealed: only the edit itself is wrong


@pytest.mark.parametrize("case", list(PLAN_CASES))
def test_bad_plan_raises_plan_error(case: str, tmp_path: Path) -> None:
    path = _write_plan_case(tmp_path / "p.json", case)
    match = PLAN_CASES[case][1]
    with pytest.raises(PlanError, match=_re(match)):
        read_plan(path, _plan_graph())
    if "not in the graph" not in match:  # the only check that needs the graph
        with pytest.raises(PlanError, match=_re(match)):
            read_plan_document(path)


@pytest.mark.parametrize("case", list(PLAN_CASES))
@pytest.mark.parametrize("command", ["show", "compare", "plot"])
def test_bad_plan_exits_2_from_the_cli(case: str, command: str, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib") if command == "plot" else None
    path = _write_plan_case(tmp_path / "p.json", case)
    graph = tmp_path / "g.json"
    save_graph(_plan_graph(), graph)
    args = {
        "show": ["show", str(path), "-g", str(graph)],
        "compare": ["compare", str(path), str(path)],
        "plot": ["plot", str(path), "-g", str(graph), "-o", str(tmp_path / "p.png")],
    }[command]
    if command == "compare" and "not in the graph" in PLAN_CASES[case][1]:
        assert run(*args).exit_code == 0  # without a graph, any string id is fine
        return
    _one_line_exit_2(run(*args))


@pytest.mark.parametrize("cut", [1, 10, 100, 1000])
def test_truncated_plans(cut: int, tmp_path: Path) -> None:
    text = write_plan(tmp_path / "p.json", _plan_doc()).read_text()
    path = tmp_path / "t.json"
    path.write_text(text[: max(0, len(text) - cut)])
    with pytest.raises(PlanError, match="truncated"):
        read_plan(path, _plan_graph())
    _one_line_exit_2(run("show", str(path)))


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00garbage", bytes(range(256)), b"[" * 100_000 + b"]" * 100_000, b"1" * 5000]
)
def test_unreadable_plans(content: bytes, tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(PlanError):
        read_plan(path, _plan_graph())
    _one_line_exit_2(run("show", str(path)))


# ---------------------------------------------------------------- plot without the [plot] extra
@pytest.mark.parametrize("command", ["plot", "sweep"])
def test_plot_without_matplotlib_names_the_extra(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    graph = tmp_path / "g.json"
    save_graph(_plan_graph(), graph)
    plan = write_plan(tmp_path / "p.json", _plan_doc())
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    args = {
        "plot": ["plot", str(plan), "-g", str(graph), "-o", str(tmp_path / "p.png")],
        "sweep": [
            "sweep",
            str(graph),
            "--budgets",
            "0.9",
            "-s",
            "chen-greedy",
            "--plot",
            str(tmp_path / "s.png"),
        ],
    }[command]
    err = _one_line_exit_2(run(*args))
    assert "pip install 'checkmate-remat[plot]'" in err
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "s.png").exists()


# ---------------------------------------------------------------- the fuzz
_SPECIAL = [
    math.nan,
    math.inf,
    -math.inf,
    1e30,
    -1e30,
    1e308,
    10**29,
    2**53,
    2**62,
    2**63,
    2**64,
    -1,
    0,
    -0.0,
    0.5,
    "",
    "0",
    "compute",
    "__DEEP__",
]
_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.sampled_from(_SPECIAL),
)
_values = st.recursive(
    _leaf,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, (*prefix, i))
    return out


@st.composite
def _mutated(draw: st.DrawFn, base: Any) -> bytes:
    """``base`` with 1-3 edits (replace, delete, duplicate, wrap), then maybe truncated or
    spoilt byte-wise; ``"__DEEP__"`` values become nesting up to 100k deep."""
    doc = json.loads(json.dumps(base))
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        if not path:
            doc = draw(_values) if draw(st.integers(0, 9)) == 0 else doc
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        action = draw(st.sampled_from(["replace", "replace", "delete", "duplicate", "wrap"]))
        if action == "replace":
            parent[key] = draw(_values)
        elif action == "delete":
            del parent[key]
        elif action == "duplicate" and isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
        elif action == "wrap":
            parent[key] = [parent[key]] if draw(st.booleans()) else {"x": parent[key]}
    text = json.dumps(doc).encode()
    depth = draw(st.sampled_from([3, 900, 5000, 100_000]))
    text = text.replace(b'"__DEEP__"', b"[" * depth + b"]" * depth)
    spoil = draw(st.sampled_from(["none", "none", "none", "truncate", "bytes", "random"]))
    if spoil == "truncate":
        text = text[: draw(st.integers(0, max(0, len(text) - 1)))]
    elif spoil == "bytes" and text:
        pos = draw(st.integers(0, len(text) - 1))
        text = text[:pos] + draw(st.binary(min_size=1, max_size=4)) + text[pos + 1 :]
    elif spoil == "random":
        text = draw(st.binary(max_size=64))
    return text


def _graph_bases() -> list[dict[str, Any]]:
    return [_own_doc(), _node_link_checkmate(), _node_link_layered()]


def _use_graph(g: Graph) -> None:
    """What the CLI does next with a graph: arrays, fingerprints, a plan."""
    from solvers.plan import cost_fingerprint, graph_fingerprint

    assert g.mem.dtype.name == "int64" and g.cost.dtype.name == "float64"
    assert math.isfinite(g.total_cost)
    graph_fingerprint(g), cost_fingerprint(g), g.summary()
    res = solve(g, 1.0, "checkpoint-all")
    if res.schedule is not None:
        plan_to_dict(g, res)


_FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("CHECKMATE_FUZZ_RANDOM"),  # deterministic in CI
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@_FUZZ
@given(data=st.data())
def test_fuzz_graph_documents(data: st.DataObject, fuzz_dir: Path) -> None:
    base = data.draw(st.sampled_from(_graph_bases()))
    text = data.draw(_mutated(base))
    path = fuzz_dir / "g.json"
    path.write_bytes(text)
    try:
        g = load_graph(path)
    except GraphError:
        return
    with contextlib.suppress(CheckmateError):
        _use_graph(g)
    doc = json.loads(text)  # it loaded from the file, so it parses
    with contextlib.suppress(GraphError):  # the same document through the dict entry point
        graph_from_dict(doc)


def _use_plan(doc: dict[str, Any], g: Graph) -> None:
    cli_report.summary_rows(doc)
    cli_report.recomputed_rows(doc, g, 10)
    cli_report.recomputed_rows(doc, None, 10)


@_FUZZ
@given(data=st.data())
def test_fuzz_plan_documents(data: st.DataObject, fuzz_dir: Path) -> None:
    g = _plan_graph()
    text = data.draw(_mutated(_plan_doc()))
    if data.draw(st.booleans()):  # re-seal, so that the checksum does not catch the edit
        try:
            doc = json.loads(text)
            if isinstance(doc, dict):
                doc["checksum"] = document_checksum(doc)
                text = json.dumps(doc).encode()
        except (ValueError, RecursionError):
            pass
    path = fuzz_dir / "p.json"
    path.write_bytes(text)
    with contextlib.suppress(PlanError):
        read_plan_document(path)
    try:
        plan = read_plan(path, g)
    except PlanError:
        return
    try:
        validate(g, plan.schedule, plan.budget_bytes)
        _use_plan(dict(plan.doc), g)
    except CheckmateError:
        pass


_CLI_FUZZ = settings(_FUZZ, max_examples=CLI_FUZZ_EXAMPLES)


@_CLI_FUZZ
@given(data=st.data())
def test_fuzz_cli_graphs(data: st.DataObject, fuzz_dir: Path) -> None:
    path = fuzz_dir / "cli-g.json"
    path.write_bytes(data.draw(_mutated(data.draw(st.sampled_from(_graph_bases())))))
    strategy = data.draw(st.sampled_from(["checkpoint-all", "chen-greedy"]))
    res = run("solve", str(path), "-b", "0.9", "-s", strategy, "-o", str(fuzz_dir / "cli-p.json"), "-q")
    assert res.exit_code in (0, 1, 2), res.output
    if res.exit_code == 2:
        _one_line_exit_2(res)


@_CLI_FUZZ
@given(data=st.data())
def test_fuzz_cli_plans(data: st.DataObject, fuzz_dir: Path) -> None:
    graph = fuzz_dir / "cli-plan-g.json"
    if not graph.exists():
        save_graph(_plan_graph(), graph)
    text = data.draw(_mutated(_plan_doc()))
    try:
        doc = json.loads(text)
        if isinstance(doc, dict):
            doc["checksum"] = document_checksum(doc)
            text = json.dumps(doc).encode()
    except (ValueError, RecursionError):
        pass
    path = fuzz_dir / "cli-p.json"
    path.write_bytes(text)
    args = data.draw(
        st.sampled_from([["show", str(path), "-g", str(graph)], ["show", str(path)], ["compare", str(path)]])
    )
    res = run(*args)
    assert res.exit_code in (0, 2), res.output
    if res.exit_code == 2:
        _one_line_exit_2(res)


def test_an_infeasible_budget_error_pickles_with_its_fields() -> None:
    """It crosses processes whole (rank 0's error raised on every rank, a worker's error)."""
    import pickle

    from solvers.errors import InfeasibleBudgetError

    exc = InfeasibleBudgetError(100, 200, lower_bound=150, reference=400, detail="a graph")
    exc.add_note("planned on rank 0")
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is InfeasibleBudgetError and str(back) == str(exc)
    assert str(exc).endswith("\nplanned on rank 0")  # the note is in the message a log shows
    exc.add_note("planned on rank 0")  # a layer the error passes through again
    assert exc.notes == ("planned on rank 0",)
    assert "\n" not in exc.one_line() and exc.one_line().endswith(" planned on rank 0")
    fields = ("budget", "minimum", "lower_bound", "reference", "exact", "notes", "tradeoffs")
    assert [getattr(back, f) for f in fields] == [getattr(exc, f) for f in fields]
    traded = InfeasibleBudgetError(100, 200, reference=400, tradeoffs=[(200, 3.0), (300, 0.2)])
    assert pickle.loads(pickle.dumps(traded)).tradeoffs == ((200, 3.0), (300, 0.2))


def test_an_infeasible_budget_error_says_what_its_least_peak_costs_and_what_more_memory_buys() -> None:
    """At its least peak a graph may be planned at several times its compute: the message
    gives that, and the lowest budget found within each level of extra compute, so that a
    user raising the budget picks one knowingly (and not keep-all, which needs no plan)."""
    from solvers.errors import InfeasibleBudgetError

    found = [
        (120_000, 7.0),
        (130_000, 2.5),
        (150_000, 0.5),
        (300_000, 0.2),
        (600_000, 0.05),
        (1_000_000, 0.0),
    ]
    msg = str(
        InfeasibleBudgetError(100_000, 120_000, lower_bound=50_000, reference=1_000_000, tradeoffs=found)
    )
    assert "the least peak found is 117.19 KiB" in msg and "(its schedule: +700% compute)" in msg
    # the lowest within +100%, +30%, +10%: neither the costlier 130,000 nor keep-all
    assert (
        "cost less: 146.48 KiB (15.0%) at +50%, 292.97 KiB (30.0%) at +20%, 585.94 KiB (60.0%) at +5%;" in msg
    )
    assert "126.95 KiB" not in msg and "976.56 KiB" not in msg
    # a least peak already within a level names only the levels below it
    cheap = str(InfeasibleBudgetError(100_000, 150_000, reference=1_000_000, tradeoffs=found[2:]))
    assert (
        "(its schedule: +50% compute)" in cheap and "cost less: 292.97 KiB (30.0%) at +20%, 585.94" in cheap
    )
    # an exact least peak says it too; nothing searched, nothing said
    exact = str(InfeasibleBudgetError(100_000, 150_000, lower_bound=150_000, tradeoffs=found[2:]))
    assert "the least budget any schedule needs is 146.48 KiB" in exact and "+50% compute" in exact
    assert "compute" not in str(InfeasibleBudgetError(100_000, 150_000, reference=1_000_000))
    # a point a few bytes above the least peak is given in bytes, not as the same KiB again
    close = str(
        InfeasibleBudgetError(
            100_000, 120_000, reference=1_000_000, tradeoffs=[(120_000, 7.0), (120_004, 0.5)]
        )
    )
    assert "cost less: 120,004 bytes (12.0%) at +50%" in close


def test_an_infeasible_budget_error_whose_least_peak_fits_names_auto_not_a_larger_budget() -> None:
    """A strategy asked by name missed a schedule that the least-peak search found within the
    budget: raising the budget is not what to do."""
    from solvers.errors import InfeasibleBudgetError

    fits = str(InfeasibleBudgetError(100, 90, lower_bound=50, detail="peak-greedy: no_solution"))
    assert "strategy='auto'" in fits and "raise the budget" not in fits
    over = str(InfeasibleBudgetError(100, 120, lower_bound=50))
    assert "raise the budget" in over and "strategy='auto'" not in over


def test_an_infeasible_budget_error_names_a_bound_only_when_it_says_more_than_the_proof() -> None:
    """A solver that proves a budget infeasible proves only "one byte more": the message said
    "no schedule fits 566.40 KiB ... every schedule needs at least 566.40 KiB"."""
    from solvers.errors import InfeasibleBudgetError

    proof = str(InfeasibleBudgetError(100_000, 120_000, lower_bound=100_001, detail="proven by ilp"))
    assert proof.startswith("no schedule fits") and "needs at least" not in proof
    assert "the least peak found is 117.19 KiB" in proof
    bound = str(InfeasibleBudgetError(100_000, 120_000, lower_bound=110_000))
    assert bound.startswith("no schedule fits") and "needs at least 107.42 KiB" in bound
