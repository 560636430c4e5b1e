"""The command line: exit codes, one-line errors, no partial files, plans that replay.

Run in-process with click's CliRunner, and as a real subprocess where the exit status and
the absence of a traceback matter most.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from checkmate.cli import cli
from solvers import Graph, GraphError, read_plan, save_graph, validate
from solvers.api import resolve_budget
from tests.graphs import PUBLIC, chain

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def graph_file(tmp_path: Path) -> Path:
    path = tmp_path / "chain.json"
    save_graph(chain(8, training=True), path)
    return path


def _one_line_error(res: Result) -> str:
    assert "Traceback" not in res.output
    err = res.stderr.strip()
    assert err and "\n" not in err, f"expected one line on stderr, got {err!r}"
    return err


def test_import_does_not_load_torch() -> None:
    code = "import sys, checkmate, checkmate.cli, checkmate.cache; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_solve_writes_a_plan_that_replays(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    res = run("solve", str(graph_file), "--budget", "0.8", "--strategy", "chen-greedy", "-o", str(out), "-q")
    assert res.exit_code == 0, res.output
    for word in ("strategy", "status", "cost", "no recompute", "lower bound", "peak", "solve"):
        assert word in res.stdout
    doc = json.loads(out.read_text())
    assert doc["format"] == "checkmate-plan" and doc["version"] == 1 and doc["strategy"] == "chen-greedy"
    g = chain(8, training=True)
    budget, _ = resolve_budget(g, 0.8)
    assert doc["budget_bytes"] == budget
    sim = validate(g, read_plan(out, g).schedule, budget)
    assert sim.peak == doc["peak_memory"] <= budget
    assert sim.cost == doc["cost"] > g.total_cost  # it had to recompute
    assert f"{doc['cost'] / g.total_cost:.4f}x" in res.stdout


def test_solve_reports_progress_unless_quiet(graph_file: Path, tmp_path: Path) -> None:
    args = [
        "solve",
        str(graph_file),
        "--budget",
        "0.7",
        "-s",
        "auto",
        "-t",
        "10",
        "-o",
        str(tmp_path / "p.json"),
    ]
    loud = run(*args)
    assert loud.exit_code == 0, loud.output
    assert "auto:" in loud.stderr and "incumbent" in loud.stderr
    quiet = run(*args, "-q")
    assert quiet.exit_code == 0
    assert "incumbent" not in quiet.stderr


def test_infeasible_budget_exits_1_without_plan(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    res = run("solve", str(graph_file), "--budget", "0.2", "-s", "chen-greedy", "-o", str(out))
    assert res.exit_code == 1
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("infeasible:")]
    assert len(lines) == 1 and "raise the budget" in lines[0]
    assert not out.exists()


def test_no_solution_exits_1_without_plan(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    # checkpoint-all cannot go under the keep-all peak, yet 0.9 is above every op's working set
    res = run("solve", str(graph_file), "--budget", "0.9", "-s", "checkpoint-all", "-o", str(out))
    assert res.exit_code == 1, res.output
    assert "no plan" in res.stdout
    assert not out.exists()


def _bad_inputs(tmp: Path, good: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "malformed.json").write_text('{"format": "checkmate-graph", "nodes": [')
    cyclic = {
        "format": "checkmate-graph",
        "version": 1,
        "nodes": [{"id": k, "cost": 1, "mem": 1} for k in "abc"],
        "edges": [["a", "b"], ["b", "c"], ["c", "a"]],
    }
    (tmp / "cyclic.json").write_text(json.dumps(cyclic))
    out = str(tmp / "plan.json")
    return {
        "missing file": (["solve", str(tmp / "nope.json"), "-b", "0.9", "-o", out], "no such file"),
        "malformed JSON": (["solve", str(tmp / "malformed.json"), "-b", "0.9", "-o", out], "malformed JSON"),
        "cyclic graph": (["solve", str(tmp / "cyclic.json"), "-b", "0.9", "-o", out], "cycle"),
        "budget abc": (["solve", str(good), "-b", "abc", "-o", out], "not a size or a fraction"),
        "unknown strategy": (["solve", str(good), "-b", "0.9", "-s", "magic", "-o", out], "unknown strategy"),
        "no such folder": (
            ["solve", str(good), "-b", "0.9", "-o", str(tmp / "no" / "p.json")],
            "does not exist",
        ),
        "output is a folder": (["solve", str(good), "-b", "0.9", "-o", str(tmp)], "folder"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing file",
        "malformed JSON",
        "cyclic graph",
        "budget abc",
        "unknown strategy",
        "no such folder",
        "output is a folder",
    ],
)
def test_bad_inputs_exit_2_with_one_line(case: str, graph_file: Path, tmp_path: Path) -> None:
    args, match = _bad_inputs(tmp_path, graph_file)[case]
    res = run(*args)
    assert res.exit_code == 2, res.output
    assert match in _one_line_error(res)
    assert not (tmp_path / "plan.json").exists()
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_debug_shows_the_exception(tmp_path: Path) -> None:
    res = run("solve", str(tmp_path / "nope.json"), "-b", "0.9", "-o", str(tmp_path / "p.json"), "--debug")
    assert isinstance(res.exception, GraphError)
    res = run("--debug", "solve", str(tmp_path / "nope.json"), "-b", "0.9", "-o", str(tmp_path / "p.json"))
    assert isinstance(res.exception, GraphError)


def test_usage_error_exits_2() -> None:
    assert run("solve").exit_code == 2
    assert run("frobnicate").exit_code == 2


def test_subprocess_exit_codes_and_no_traceback(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    base = [sys.executable, "-m", "checkmate", "solve"]
    bad = subprocess.run(
        [*base, str(tmp_path / "missing.json"), "-b", "0.9", "-o", str(out)], capture_output=True, text=True
    )
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and bad.stderr.strip().count("\n") == 0
    infeasible = subprocess.run(
        [*base, str(graph_file), "-b", "0.2", "-s", "chen-greedy", "-o", str(out)],
        capture_output=True,
        text=True,
    )
    assert infeasible.returncode == 1, infeasible.stderr
    assert "infeasible:" in infeasible.stdout and "Traceback" not in infeasible.stderr
    assert not out.exists()
    ok = subprocess.run(
        [*base, str(graph_file), "-b", "1.0", "-s", "checkpoint-all", "-o", str(out), "-q"],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert out.exists() and not list(tmp_path.glob(".*.tmp"))


def _plan(graph_file: Path, tmp_path: Path, strategy: str, budget: str) -> Path:
    out = tmp_path / f"{strategy}-{budget}.json"
    res = run("solve", str(graph_file), "-b", budget, "-s", strategy, "-o", str(out), "-q")
    assert res.exit_code == 0, res.output
    return out


def test_show_lists_recomputed_ops(graph_file: Path, tmp_path: Path) -> None:
    plan = _plan(graph_file, tmp_path, "chen-greedy", "0.8")
    doc = json.loads(plan.read_text())
    again = sorted(d["name"] for d in doc["decisions"] if d["computes"] > 1)
    assert again
    res = run("show", str(plan), "--graph", str(graph_file))
    assert res.exit_code == 0, res.output
    assert "replay" in res.stdout and "valid" in res.stdout
    if importlib.util.find_spec("solvers.pool") is not None:
        assert "pool reserves" in res.stdout and "unavailable" not in res.stdout
    for name in again[:10]:
        assert name in res.stdout
    bare = run("show", str(plan))  # without the graph: from the plan's own decisions
    assert bare.exit_code == 0 and again[0] in bare.stdout


def test_show_rejects_foreign_and_edited_plans(graph_file: Path, tmp_path: Path) -> None:
    plan = _plan(graph_file, tmp_path, "checkpoint-all", "1.0")
    other = tmp_path / "other.json"
    save_graph(chain(5, training=True), other)
    res = run("show", str(plan), "--graph", str(other))
    assert res.exit_code == 2 and "another graph" in _one_line_error(res)
    doc = json.loads(plan.read_text())
    doc["cost"] = 0.5
    plan.write_text(json.dumps(doc))
    res = run("show", str(plan))
    assert res.exit_code == 2 and "modified" in _one_line_error(res)


def test_compare_side_by_side(graph_file: Path, tmp_path: Path) -> None:
    a = _plan(graph_file, tmp_path, "checkpoint-all", "1.0")
    b = _plan(graph_file, tmp_path, "chen-greedy", "0.8")
    res = run("compare", str(a), str(b))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert a.name in lines[0] and b.name in lines[0]
    row = next(ln for ln in lines if ln.startswith("overhead"))
    assert "1.0000x" in row and len(row.split()) == 3


def test_sweep_table_csv_and_plot(graph_file: Path, tmp_path: Path) -> None:
    table, fig = tmp_path / "t.csv", tmp_path / "p.png"
    res = run(
        "sweep", str(graph_file), "--budgets", "1.0,0.7,0.2", "--strategies", "checkpoint-all,chen-greedy",
        "-o", str(table), "--plot", str(fig), "-q",
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(table.open()))
    assert [(r["strategy"], r["budget"]) for r in rows] == [
        (s, b) for s in ("checkpoint-all", "chen-greedy") for b in ("1.0", "0.7", "0.2")
    ]
    status = {(r["strategy"], r["budget"]): r["status"] for r in rows}
    assert status[("checkpoint-all", "1.0")] == "optimal"
    assert status[("checkpoint-all", "0.7")] == "no_solution"
    assert status[("chen-greedy", "0.2")] == "infeasible"
    assert float(next(r for r in rows if r["status"] == "optimal")["overhead"]) == 1.0
    assert fig.stat().st_size > 5000
    assert "infeasible" in res.stdout


def test_strategies_lists_the_registry() -> None:
    res = run("strategies")
    assert res.exit_code == 0
    assert "checkpoint-all" in res.stdout and "ilp" in res.stdout


# ---------------------------------------------------------------- issue 2 acceptance
VGG16 = PUBLIC / "VGG16_b256_224x224.json"


def test_vgg16_ilp_acceptance(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    res = run(
        "solve",
        str(VGG16),
        "--budget",
        "0.9",
        "--strategy",
        "ilp",
        "--time-limit",
        "120",
        "-o",
        str(out),
        "-q",
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["status"] == "optimal"
    assert doc["cost"] / doc["total_cost"] == pytest.approx(1.0197, abs=5e-5)
    assert "1.0197x" in res.stdout
    from solvers import load_graph

    g = load_graph(VGG16)
    sim = validate(g, read_plan(out, g).schedule, doc["budget_bytes"])
    assert sim.peak <= doc["budget_bytes"]

    out8 = tmp_path / "p8.json"
    res = run(
        "solve", str(VGG16), "--budget", "0.8", "--strategy", "ilp", "--time-limit", "120", "-o", str(out8)
    )
    assert res.exit_code == 1
    assert res.stdout.count("infeasible:") == 1
    assert not out8.exists()


def test_sweep_without_any_schedule_exits_1(graph_file: Path) -> None:
    res = run("sweep", str(graph_file), "--budgets", "0.25,0.2", "--strategies", "chen-greedy", "-q")
    assert res.exit_code == 1
    assert res.stdout.count("infeasible") >= 2 and "no plan" in res.stdout


def test_strategy_options_reach_the_strategy(graph_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    res = run("solve", str(graph_file), "-b", "0.6", "-s", "dtr", "-O", "heuristic=lru", "-o", str(out), "-q")
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["info"].get("heuristic") == "lru"
    bad = run("solve", str(graph_file), "-b", "0.6", "-s", "ilp", "-O", "bogus=1", "-o", str(out) + "2")
    assert bad.exit_code == 2 and "has no option 'bogus'" in _one_line_error(bad)
    assert not Path(str(out) + "2").exists()
    malformed = run("solve", str(graph_file), "-b", "0.6", "-s", "dtr", "-O", "heuristic", "-o", str(out))
    assert malformed.exit_code == 2 and "KEY=VALUE" in _one_line_error(malformed)


def test_no_plan_names_the_closest_schedules_peak(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    graph = PUBLIC / "random_layered_n100.json"
    res = run("solve", str(graph), "--budget", "0.65", "-s", "peak-greedy", "-q", "-o", str(out))
    assert res.exit_code == 1, res.output
    line = res.stdout.strip().splitlines()[-1]
    assert line.startswith("no plan: peak-greedy") and "over the budget" in line, line
    assert (
        "the closest schedule found (peak-greedy) peaks at" in line and "% of the checkpoint-all peak" in line
    )
    assert not out.exists()


def test_solve_holds_a_boundary_asked(graph_file: Path, tmp_path: Path) -> None:
    # the 8-layer training chain within 7 bytes: the cheapest plan holds 6 at the boundary
    from solvers.boundary import boundary_hold

    out = tmp_path / "plan.json"
    res = run("solve", str(graph_file), "-b", "7", "--boundary", "4B", "-s", "ilp", "-o", str(out), "-q")
    assert res.exit_code == 0, res.output
    assert "holds 4 B (4 B) of the 4 B asked" in res.stdout
    g = chain(8, training=True)
    plan = read_plan(out, g)
    validate(g, plan.schedule, 7)
    assert boundary_hold(g, plan.schedule) == 4
    res = run("solve", str(graph_file), "-b", "min", "--boundary", "4B", "-o", str(out), "-q")
    assert "the boundary takes bytes or a fraction" in _one_line_error(res)
    res = run("solve", str(graph_file), "-b", "7", "--boundary", "0B", "-o", str(out), "-q")
    assert _one_line_error(res) == "error: --boundary: budget '0B' must be positive"


def test_a_boundary_no_plan_holds_is_named_on_one_line(tmp_path: Path) -> None:
    # the backward's first op reads a 5-byte forward value: nothing holds less than 5 there
    g = Graph.build(
        [{"key": "a", "mem": 5, "cost": 1.0}, {"key": "b", "mem": 1, "cost": 1.0, "backward": True}],
        [("a", "b")],
    )
    save_graph(g, tmp_path / "g.json")
    out = tmp_path / "plan.json"
    res = run("solve", str(tmp_path / "g.json"), "-b", "10B", "--boundary", "4B", "-s", "ilp", "-o", str(out))
    assert res.exit_code != 0 and not out.exists()
    line = res.output.splitlines()[-1]
    assert line.startswith(
        "infeasible: no schedule fits a budget of 10 B (10 bytes), 166.7% of the checkpoint-all"
    )
    assert "The plan was also to hold at most 4 B at its forward/backward boundary" in line
