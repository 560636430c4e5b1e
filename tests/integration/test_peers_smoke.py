"""Smoke test of ``benchmarks.peers`` on a tiny CNN: every method runs, is measured, is reported;
the verdicts and reports of ``benchmarks.peers_compile`` on given rows, and its Llama workload."""

from __future__ import annotations

import csv
import math
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from benchmarks import peers, peers_compile, peers_compile_report, peers_report  # noqa: E402
from benchmarks.csvio import read_rows  # noqa: E402
from benchmarks.models import Workload, llama_workload  # noqa: E402
from benchmarks.peer_methods import prepare_inductor  # noqa: E402


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


# ---------------------------------------------------------------- bench-peers-compile (no compiles:
# its Inductor builds take minutes on CPU; the report's verdicts and the Llama workload are checked)


def _crow(method: str, knob: str = "", target: str = "", **kw: object) -> peers_compile.Row:
    base: dict[str, object] = {
        "peak": 100,
        "step_s": 0.01,
        "overhead": 0.0,
        "spread": 0.005,
        "grads_ok": True,
    }
    return peers_compile.Row(model="m", method=method, knob=knob, target=target, **{**base, **kw})  # type: ignore[arg-type]


def test_compile_verdicts_show_misses() -> None:
    rows = [
        _crow("compile", overhead=0.004),
        _crow("pt-budget", "0.4", peak=60, overhead=0.20),
        _crow("pt-budget", "0.6", peak=80, overhead=0.10),
        _crow("pt-budget", "0.8", peak=90, overhead=0.05),
        _crow("pt-budget", "1", peak=100, overhead=0.0),
        _crow("checkmate", "60 B", "pt 0.4", budget=60, peak=61, overhead=0.08, planned=0.07),  # yes
        _crow("checkmate", "80 B", "pt 0.6", budget=80, peak=90, overhead=0.05),  # more memory
        _crow("checkmate", "90 B", "pt 0.8", status="no plan: InfeasibleBudgetError: x"),
        _crow("checkmate", "100 B", "pt 1", budget=100, peak=100, overhead=0.03),  # slower
        _crow("checkmate", "1", "1.0", overhead=0.015),  # within the 2% noise floor
    ]
    got = {point: (met, line) for point, met, line in peers_compile_report.verdicts(rows)}
    assert [p for p in got] == ["pt 0.4", "pt 0.6", "pt 0.8", "pt 1", "1.0"]
    assert got["pt 0.4"][0] and got["1.0"][0]
    assert not got["pt 0.6"][0] and "1.125x" in got["pt 0.6"][1]
    assert not got["pt 0.8"][0] and "no plan" in got["pt 0.8"][1]
    assert not got["pt 1"][0] and got["pt 1"][1].endswith("slower")
    rows[-1] = _crow("checkmate", "1", "1.0", overhead=0.05)
    assert not dict((p, m) for p, m, _ in peers_compile_report.verdicts(rows))["1.0"]


def test_a_direct_comparison_with_the_point_decides_the_verdict() -> None:
    """Timed against the point itself (``vs_point``), that ratio decides, not the two ratios
    to the reference taken at different times."""
    rows = [
        _crow("compile"),
        _crow("pt-budget", "0.8", peak=90, overhead=-0.02),
        _crow("pt-budget", "0.5", peak=80, overhead=0.05),
        _crow("checkmate", "90 B", "pt 0.8", budget=90, peak=89, overhead=0.01, vs_point=-0.01),
        _crow("checkmate", "80 B", "pt 0.5", budget=80, peak=79, overhead=0.01, vs_point=0.004),
    ]
    got = {point: (met, line) for point, met, line in peers_compile_report.verdicts(rows)}
    assert got["pt 0.8"][0] and "against the point directly -1.0%" in got["pt 0.8"][1]
    assert not got["pt 0.5"][0] and got["pt 0.5"][1].endswith(": slower")
    # a median ratio above 1 by less than the pairs' spread is still a miss, said to be one
    rows[-1] = replace(rows[-1], vs_spread=0.01)
    got = {point: (met, line) for point, met, line in peers_compile_report.verdicts(rows)}
    assert not got["pt 0.5"][0] and got["pt 0.5"][1].endswith("slower, within the pairs' spread")


def test_planned_overhead_is_compared_over_the_row_at_1_0_not_the_reference() -> None:
    """A planned overhead is over the graph's ops run once (checkmate's keep-all step), which
    Inductor can run faster than plain torch.compile's: both are taken over checkmate at 1.0."""
    rows = [
        _crow("compile"),
        _crow("checkmate", "90 B", "pt 0.8", overhead=0.04, planned=0.09),  # +9.5% over keep-all
        _crow("checkmate", "80 B", "pt 0.5", overhead=0.10, planned=0.09),  # +15.8%: far off
        _crow("checkmate", "1", "1.0", overhead=-0.05, planned=0.0),
    ]
    met, compared, lines = peers_compile_report.agreement(rows)
    assert (met, compared) == (1, 2)
    assert lines[0] == "- pt 0.8: planned +9.0%, measured +9.5%"
    assert lines[1].endswith("(**6.8 points apart**)")
    # the row at 1.0 itself recomputing: each plan is compared relative to its plan
    rows[-1] = _crow("checkmate", "1", "1.0", overhead=0.0, planned=0.05)
    assert peers_compile_report.agreement(rows)[2][0] == "- pt 0.8: planned +3.8%, measured +4.0%"
    assert peers_compile_report.agreement(rows[:-1]) == (0, 0, [])  # nothing to compare over


def test_compile_report_round_trips(tmp_path: Path) -> None:
    rows = [
        _crow("compile"),
        _crow("pt-budget", "0.4", peak=60, overhead=0.2),
        _crow("checkmate", "60 B", "pt 0.4", budget=60, peak=66, overhead=0.1, planned=0.05),
        _crow("checkmate", "1", "1.0", status="failed: RuntimeError: boom", peak=None),
    ]
    cfg = peers_compile.Config(models=("resnet",), device="cpu", budgets=(0.4,))
    info = peers_compile_report.RunInfo.now("test", 1.0, "cpu")
    paths = peers_compile_report.write_all(rows, cfg, tmp_path, "pc", info)
    assert read_rows(paths[0], peers_compile.Row) == rows
    md = paths[2].read_text()
    assert md.count("| checkmate |") == 2
    assert "Verdicts: 0 of 2 met." in md and "(1.100x)" in md and "failed: RuntimeError: boom" in md
    assert paths[3].stat().st_size > 10_000
    assert peers_compile_report.render(tmp_path, "pc")[0].read_text() == md


def test_llama_workload_trains_on_a_device() -> None:
    wl = llama_workload("tiny", batch=2, seq=16).to("cpu")
    model = wl.build(0.0)
    loss = wl.loss(model)
    loss.backward()
    assert loss.item() > 0 and all(p.grad is not None for p in model.parameters() if p.requires_grad)
    assert len(wl.blocks(model)) == 2 and wl.inputs[0] is wl.batch[0]


def _mlp_workload() -> Workload:
    torch.manual_seed(0)
    x = torch.randn(2048, 64)  # activations, not weights, make the peak

    def build(dropout: float) -> torch.nn.Module:
        torch.manual_seed(0)
        layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(8)]
        return torch.nn.Sequential(*layers)

    return Workload(
        name="mlp",
        shape="2048x64",
        build=build,
        batch=(x,),
        inputs=(x,),
        criterion=lambda out, batch: out.square().mean(),
        blocks=lambda m: list(m),
    )


def test_the_compiled_reference_keeps_its_own_graph_across_resets() -> None:
    """A later build compiled under ``activation_memory_budget`` after ``torch._dynamo.reset()``
    must not serve the reference's calls (Dynamo keys its cache on the frame's code object)."""
    torch.set_num_threads(1)
    cfg = peers_compile.Config(models=(), device="cpu", pairs=1, warmup=0)
    wl = _mlp_workload()
    ref = peers_compile.reference(wl, cfg)
    torch._dynamo.reset()
    model = wl.build(0.0)
    step = prepare_inductor(0.5)(model, wl)
    assert peers_compile._peak(model, step) < ref.peak  # the budget changed the graph
    graphs = peers_compile._graphs()
    assert peers_compile._peak(ref.model, ref.step) == ref.peak
    assert peers_compile._graphs() == graphs + 1  # recompiled its own, not a cache hit on the other
    torch._dynamo.reset()
