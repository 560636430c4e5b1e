"""The planner's records and caches: eager fast path after ``example_inputs``, per-stage
timings and cache status on :class:`checkmate.runtime.PlanRecord`, scratch space persisted
across processes, and paging plans executed by ``optimize(strategy="poet")``."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import checkmate  # noqa: E402
from checkmate.api import plans_of  # noqa: E402
from checkmate.memory import measure_peak  # noqa: E402
from checkmate.paging import page_out  # noqa: E402
from solvers.budget import format_bytes  # noqa: E402
from tests.integration import _models as M  # noqa: E402
from tests.integration._dist import fake_ddp_reserve  # noqa: E402

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parents[2]


def _step(model: Any, x: Any) -> None:
    model(x).mean().backward()


def _zero(model: Any) -> None:
    for p in model.parameters():
        p.grad = None


def test_full_budget_with_example_inputs_trains_with_the_original_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A budget above the no-remat peak, planned at optimize() time: nothing is recomputed,
    so the training step runs the original forward (the compiled one is never called) and
    its measured peak is eager's."""
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    torch.manual_seed(0)
    model = M.SmallCNN(16, 2)
    x = torch.randn(8, 3, 16, 16)
    _step(model, x)  # warm-up
    _zero(model)
    eager = measure_peak(lambda: _step(model, x))
    _zero(model)
    opt = checkmate.optimize(model, 1.0, (x,), profile="cpu", time_limit=3)
    assert [r.is_eager for r in plans_of(opt)] == [True]
    state = opt.__dict__["_checkmate_state"]

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the compiled forward ran although the plan recomputes nothing")

    state.compiled = refuse
    measured = measure_peak(lambda: _step(opt, x))
    print(f"\neager {eager:,} B, optimized at 100% with example inputs {measured:,} B")
    assert abs(measured - eager) <= 0.03 * eager


def test_records_carry_stage_timings_and_cache_status(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("CHECKMATE_CACHE", raising=False)
    torch.manual_seed(0)
    model = M.MLP(32, 2)
    x = torch.randn(64, 32)

    def plan(**kw: Any) -> Any:
        return plans_of(checkmate.optimize(model, 0.8, (x,), profile="cpu", time_limit=2, **kw))[0]

    first = plan()
    second = plan()
    assert (first.cache, second.cache) == ("miss", "hit")
    for r in (first, second):
        stages = (r.trace_seconds, r.profile_seconds, r.solve_seconds, r.codegen_seconds)
        # the stages sum to r.seconds by construction (trace is the remainder): what can fail
        # is a stage counted twice, which makes the remainder negative
        assert all(s >= 0 for s in stages) and 0 <= r.scratch_seconds <= r.profile_seconds
    pinned = plan(plan=second.result.info["plan_path"])
    assert pinned.cache == "pinned"
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    assert plan().cache == "disabled"
    # printed, a record is its summary line, not its graph, schedule and modules (3,501 characters
    # for a two-layer MLP's)
    assert repr(first) == str(first) == f"<PlanRecord {first.summary()}>"
    assert "\n" not in repr(first) and len(repr(first)) < 400, repr(first)


_CHILD = """
import json, sys, torch, checkmate
import checkmate.scratch as sc
from checkmate.api import plans_of
from solvers.plan import graph_fingerprint
from tests.integration import _models as M
measured = []
original = sc.measure_scratch
sc.measure_scratch = lambda node, vals, **kw: measured.append(str(node.target)) or original(node, vals, **kw)
torch.manual_seed(0)
opt = checkmate.optimize(M.SmallCNN(16, 2), 0.7, (torch.randn(8, 3, 16, 16),), profile="cpu", time_limit=3)
r = plans_of(opt)[0]
print(json.dumps({"measured": len(measured), "fingerprint": graph_fingerprint(r.joint.graph),
                  "cache": r.cache, "scratch": int(sum(1 for n in r.joint.graph.nodes if n.key.endswith(".workspace")))}))
"""


def test_scratch_space_is_measured_once_across_processes(tmp_path: Path) -> None:
    """The second process reads every op's scratch space from the cache dir: it measures
    none, builds the identical graph, and so hits the plan cache."""
    env = {**os.environ, "CHECKMATE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    env.pop("CHECKMATE_CACHE", None)
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first, second = runs
    print(f"\nscratch: first process {first}, second {second}")
    assert first["measured"] > 0 and second["measured"] == 0
    assert first["fingerprint"] == second["fingerprint"]
    assert (first["cache"], second["cache"]) == ("miss", "hit")
    files = list((tmp_path / "cache" / "scratch").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["ops"]


def test_poet_plan_pages_saved_values_and_keeps_eager_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """optimize(strategy="poet") at a tight budget: the plan pages, the generated step
    hands the paged values to the backward on the host (on CPU the host and the device are
    one memory), and the gradients equal eager's."""
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    torch.manual_seed(0)
    model = M.MLP(64, 4)
    x = torch.randn(256, 64)
    _step(model, x)
    expected = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    _zero(model)
    opt = checkmate.optimize(copy.copy(model), 0.4, (x,), strategy="poet", profile="cpu", time_limit=10)
    (record,) = plans_of(opt)
    assert record.result.schedule is not None
    assert any(op == "pageout" for op, _ in record.result.schedule.steps)
    assert record.paged and not record.is_eager
    assert any(n.target is page_out for n in record.modules.forward.graph.nodes)
    for _ in range(2):  # the second step must not fall back to the original forward
        _zero(model)
        _step(opt, x)
        for p, g in zip(model.parameters(), expected, strict=True):
            assert p.grad is not None
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
    assert not any(opt.__dict__["_checkmate_state"].eager_keys.values())


def test_cache_status_says_pinned_only_for_a_plan_from_the_users_file(tmp_path: Path) -> None:
    from checkmate.planning import _cache_status
    from solvers.result import SolveResult, Status

    mine = tmp_path / "p.json"

    def res(cache: str, where: Path | None) -> SolveResult:
        info = {"cache": cache} | ({} if where is None else {"plan_path": str(where)})
        return SolveResult("auto", Status.FEASIBLE, 1, info=info)

    assert _cache_status(res("hit", mine), f"{tmp_path}/./p.json") == "pinned"
    # the user's file was rejected and the plan cache had the plan
    assert _cache_status(res("hit", tmp_path / "cache" / "k.json"), str(mine)) == "hit"
    assert _cache_status(res("miss", mine), str(mine)) == "miss"


def test_a_graphs_share_of_a_byte_budget_says_what_was_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph planned at less than the byte budget given (the rest left to what the step holds
    beside it: here DDP's buckets) says so: its line read as the user's budget, cut for no
    reason ("budget 37.00 MiB" where 40 MiB were asked). Under a fraction it names none."""

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    fake_ddp_reserve(monkeypatch, 3 << 20)
    torch.manual_seed(0)
    x = torch.randn(64, 128)
    opt = checkmate.optimize(M.MLP(128, 4).train(), 40 << 20, time_limit=5)
    _step(opt, x)
    (rec,) = plans_of(opt)
    assert rec.budget is not None and rec.budget <= 37 << 20 and rec.step_budget == 40 << 20
    share = f"budget {format_bytes(rec.budget)} of the 40.00 MiB asked, the rest left beside it ("
    assert share in rec.summary(), rec.summary()
    fake_ddp_reserve(monkeypatch, 0)
    frac = checkmate.optimize(M.MLP(128, 4).train(), 1.0, time_limit=5)
    _step(frac, x)
    (rec,) = plans_of(frac)
    assert rec.step_budget is None and "asked" not in rec.summary(), rec.summary()


def test_a_budget_just_above_the_keep_all_peak_does_not_read_as_equal_to_it() -> None:
    """A line read "budget 15.69 MiB (100% of its keep-all 15.63 MiB)": the share shows the
    decimals that tell two numbers apart."""
    torch.manual_seed(0)
    opt = checkmate.optimize(M.MLP(128, 4).train(), 1.004, time_limit=5)
    _step(opt, torch.randn(64, 128))
    (rec,) = plans_of(opt)
    assert "(100.4% of its keep-all" in rec.summary(), rec.summary()
