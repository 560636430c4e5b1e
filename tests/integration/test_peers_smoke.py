"""Smoke test of ``benchmarks.peers`` on a tiny CNN: every method runs, is measured, is reported."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks import peers, peers_report  # noqa: E402


@pytest.fixture(scope="module")
def rows() -> list[peers.Row]:
    torch.set_num_threads(1)
    cfg = peers.Config(
        models=("resnet",),
        size="tiny",
        pt_budgets=(1.0, 0.0),
        cm_fractions=(0.9,),
        match_peers=False,
        steps=2,
        warmup=0,
        time_limit=5.0,
    )
    return peers.run(cfg, log=lambda _: None)


def _one(rows: list[peers.Row], method: str, knob: str = "") -> peers.Row:
    found = [r for r in rows if r.method == method and (not knob or r.knob == knob)]
    assert len(found) == 1, f"expected one {method} {knob} row, got {len(found)}"
    return found[0]


def test_every_method_has_a_row(rows: list[peers.Row]) -> None:
    assert [r.method for r in rows] == [
        "eager",
        "checkpoint",
        "pt-budget",
        "pt-budget",
        "rockmate",
        "checkmate",
    ]
    assert [r.knob for r in rows if r.method == "pt-budget"] == ["1", "0"]
    if not torch.cuda.is_available():
        assert _one(rows, "rockmate").status.startswith("not run: needs CUDA")


def test_eager_is_its_own_reference(rows: list[peers.Row]) -> None:
    eager = _one(rows, "eager")
    assert eager.status == "ok"
    assert eager.grad_err == 0.0 and eager.buffer_err == 0.0
    assert eager.dropout_err == 0.0 and eager.dropout_equal is True
    assert eager.peak_frac is not None and abs(eager.peak_frac - 1.0) < 0.05


def test_peers_are_measured(rows: list[peers.Row]) -> None:
    for r in rows:
        if r.method in ("rockmate", "checkmate"):
            continue
        assert r.status == "ok", f"{r.method} {r.knob}: {r.status}"
        assert r.peak is not None and r.peak > 0
        assert r.step_s is not None and r.step_s > 0 and r.overhead is not None
        assert r.grad_err is not None and r.grad_err < 1e-4, f"{r.method} {r.knob}: {r.grad_err}"
        assert r.dropout_err is not None and math.isfinite(r.dropout_err)
    # checkpointing replays the RNG state: the same masks, the same gradients
    assert _one(rows, "checkpoint").dropout_equal is True


def test_checkmate_row_is_measured_or_says_why(rows: list[peers.Row]) -> None:
    cm = _one(rows, "checkmate")
    assert cm.target == "0.9 x eager" and cm.budget is not None
    assert cm.status == "ok", cm.status  # 0.9 x eager fits the tiny ResNet
    assert cm.peak is not None and cm.budget is not None and cm.peak <= cm.budget * 1.05
    assert cm.grad_err is not None and cm.grad_err < 1e-5
    assert cm.dropout_equal is True, f"checkmate dropout gradients differ by {cm.dropout_err}"


def test_reports(rows: list[peers.Row], tmp_path: Path) -> None:
    cfg = peers.Config(models=("resnet",), size="tiny")
    info = peers_report.RunInfo.now("test", 1.0)
    paths = peers_report.write_all(rows, cfg, tmp_path, "p", info)
    with paths[0].open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and table[0]["method"] == "eager"
    assert peers_report.read_csv(paths[0]) == rows  # the CSV round-trips every field
    md = paths[2].read_text()
    assert "torch " + torch.__version__ in md
    assert md.count("| pt-budget |") == 2 and "| rockmate |" in md
    assert paths[3].stat().st_size > 10_000  # a rendered PNG
    assert peers_report.render(tmp_path, "p")[0].read_text() == md
