"""Pictures: the plan figure (R, S, memory) and the Pareto plot are real, non-trivial PNGs."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from checkmate.cli import cli
from checkmate.plot import pareto_figure, plan_figure
from solvers import save_graph
from solvers.schedule import schedule_from_order, schedule_from_rs
from tests.graphs import chain

pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install checkmate-remat[plot])")


def _check_png(path: Path, min_w: int = 600, min_h: int = 300) -> np.ndarray:
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    h, w = img.shape[:2]
    assert w >= min_w and h >= min_h, f"image too small: {w}x{h}"
    colours = np.unique(img[..., :3].reshape(-1, 3), axis=0)
    assert len(colours) > 20, "image is (nearly) one colour"
    assert img[..., :3].std() > 0.05
    return img


def test_plan_figure_from_steps(tmp_path: Path) -> None:
    g = chain(8, training=True)
    n = g.n // 2
    sched = schedule_from_order(g, [*range(n), *range(n - 1), *range(n, 2 * n)])
    out = plan_figure(g, sched, 20, tmp_path / "fig.png", title="chain")
    img = _check_png(out, min_w=1000)
    # three panels side by side: wider than tall
    assert img.shape[1] > 2 * img.shape[0]


def test_plan_figure_from_rs(tmp_path: Path) -> None:
    g = chain(6)
    R = np.eye(6, dtype=bool)
    S = np.tril(np.ones((6, 6), dtype=bool), -1)
    out = plan_figure(g, schedule_from_rs(g, R, S), None, tmp_path / "rs.png")
    _check_png(out)


def test_pareto_figure_marks_missing_points(tmp_path: Path) -> None:
    rows = [
        {"strategy": "a", "budget_fraction": 1.0, "status": "optimal", "overhead": 1.0},
        {"strategy": "a", "budget_fraction": 0.8, "status": "optimal", "overhead": 1.05},
        {"strategy": "a", "budget_fraction": 0.6, "status": "infeasible", "overhead": None},
        {"strategy": "b", "budget_fraction": 0.8, "status": "feasible", "overhead": 1.2},
        {"strategy": "b", "budget_fraction": 0.6, "status": "no_solution", "overhead": None},
    ]
    _check_png(pareto_figure(rows, tmp_path / "pareto.png"), min_w=500)


def test_pareto_figure_in_bytes_with_marked_plans(tmp_path: Path) -> None:
    rows = [
        {"strategy": "auto", "budget_gib": 48.0, "status": "keep-all fits", "overhead": 1.0},
        {"strategy": "auto", "budget_gib": 20.0, "status": "feasible", "overhead": 1.08},
    ]
    marks = [("no rematerialization", 48.0, 1.0), ("per-layer checkpointing", 13.8, 1.23)]
    out = pareto_figure(rows, tmp_path / "p.png", x="budget_gib", xlabel="GiB", marks=marks)
    img = _check_png(out, min_w=500)
    # the marked points are drawn in colours of their own (C1 orange, C2 green), not auto's C0
    rgb = img[..., :3]
    for colour in ((1.0, 0.498, 0.055), (0.173, 0.627, 0.173)):
        assert (np.abs(rgb - np.array(colour)).max(axis=-1) < 0.03).sum() > 20, colour


def test_cli_plot_writes_png(tmp_path: Path) -> None:
    gpath, plan, fig = tmp_path / "g.json", tmp_path / "p.json", tmp_path / "fig.png"
    save_graph(chain(10, training=True), gpath)
    runner = CliRunner()
    res = runner.invoke(cli, ["solve", str(gpath), "-b", "0.7", "-s", "chen-greedy", "-o", str(plan), "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["plot", str(plan), "--graph", str(gpath), "-o", str(fig)])
    assert res.exit_code == 0, res.output
    _check_png(fig, min_w=1000)


def test_png_takes_the_users_umask(tmp_path: Path) -> None:
    g = chain(6)
    old = os.umask(0o022)
    try:
        out = plan_figure(g, schedule_from_order(g, list(range(6))), None, tmp_path / "fig.png")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # not mkstemp's 0600


def test_cli_plot_needs_the_plans_graph(tmp_path: Path) -> None:
    gpath, other, plan = tmp_path / "g.json", tmp_path / "o.json", tmp_path / "p.json"
    save_graph(chain(10, training=True), gpath)
    save_graph(chain(9, training=True), other)
    runner = CliRunner()
    assert (
        runner.invoke(
            cli, ["solve", str(gpath), "-b", "1.0", "-s", "checkpoint-all", "-o", str(plan), "-q"]
        ).exit_code
        == 0
    )
    res = runner.invoke(cli, ["plot", str(plan), "--graph", str(other), "-o", str(tmp_path / "f.png")])
    assert res.exit_code == 2 and "another graph" in res.stderr
    assert not (tmp_path / "f.png").exists()
