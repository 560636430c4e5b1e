"""``python -m benchmarks.run --resume``: a run cut short goes on from its CSV (graphs already
there in full are kept as they are, a graph cut short runs again)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from benchmarks import run
from solvers import save_graph
from tests.graphs import chain

ARGS = ["--no-traced", "--strategies", "checkpoint-all,chen-greedy", "--budgets", "0.9,0.6", "--out", "t"]


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_resume_keeps_finished_graphs_and_reruns_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    graphs = tmp_path / "graphs"
    graphs.mkdir()
    save_graph(chain(6, training=True), graphs / "a_chain6.json")
    save_graph(chain(9, training=True), graphs / "b_chain9.json")
    monkeypatch.setattr(run, "RESULTS_DIR", tmp_path)
    assert run.main(["--graphs-dir", str(graphs), *ARGS]) == 0
    first = _rows(tmp_path / "t.csv")
    assert len(first) == 2 * 2 * 2 and {r["graph"] for r in first} == {"a_chain6", "b_chain9"}

    # cut short: b_chain9 has one of its four rows
    kept = [r for r in first if r["graph"] == "a_chain6"]
    partial = [r for r in first if r["graph"] == "b_chain9"][:1]
    with (tmp_path / "t.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(first[0]))
        w.writeheader()
        w.writerows(kept + partial)
    capsys.readouterr()
    assert run.main(["--graphs-dir", str(graphs), "--resume", *ARGS]) == 0
    out = capsys.readouterr().out
    assert "a_chain6: kept from t.csv (--resume)" in out
    assert "b_chain9 @ 0.90" in out and "a_chain6 @" not in out
    again = _rows(tmp_path / "t.csv")
    assert [r for r in again if r["graph"] == "a_chain6"] == kept  # untouched, timings included
    assert sorted((r["budget_frac"], r["strategy"]) for r in again if r["graph"] == "b_chain9") == sorted(
        (r["budget_frac"], r["strategy"]) for r in first if r["graph"] == "b_chain9"
    )
    assert (tmp_path / "t_tables.md").is_file()
