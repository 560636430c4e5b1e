"""``checkmate trace``: a model factory -> a saved graph that ``checkmate solve`` plans."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("torch")

from checkmate.cli import cli
from solvers import load_graph, read_plan, validate

pytestmark = pytest.mark.torch

FACTORY = textwrap.dedent(
    """
    import torch

    def with_inputs():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
            torch.nn.Linear(64, 8),
        )
        return model, torch.randn(16, 32)

    def model_only():
        return torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    def not_a_model():
        return 42

    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(32, 16), torch.nn.Linear(16, 4)

        def forward(self, x):
            h = torch.relu(self.a(x))
            if h.sum().item() > -1e30:  # data-dependent Python branch: a graph break
                h = h * 2
            return self.b(h)

    def with_break():
        return Breaks(), torch.randn(8, 32)
    """
)


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def factory(tmp_path: Path) -> Path:
    path = tmp_path / "models.py"
    path.write_text(FACTORY)
    return path


def test_trace_then_solve(factory: Path, tmp_path: Path) -> None:
    gpath, plan = tmp_path / "g.json", tmp_path / "p.json"
    res = run("trace", f"{factory}:with_inputs", "--profile", "cpu", "-o", str(gpath))
    assert res.exit_code == 0, res.output
    g = load_graph(gpath)
    assert g.n >= 10 and g.backward_mask.any() and not g.backward_mask.all()
    assert g.total_cost > 0 and g.mem.sum() > 0
    meta = json.loads(gpath.read_text())["meta"]
    assert meta["factory"].endswith(":with_inputs") and meta["input_shapes"] == [[16, 32]]
    assert meta["profile"].startswith("profile:cpu")
    # the exact MILP decides, whatever the machine: below its keep-all peak this MLP has no
    # plan (its largest op needs nearly all of it; proven), at 1.0 it has one
    res = run("solve", str(gpath), "-b", "0.9", "-s", "ilp", "-o", str(plan), "-q")
    assert res.exit_code == 1 and "proven by ilp" in res.output, res.output
    assert not plan.exists()
    res = run("solve", str(gpath), "-b", "1.0", "-s", "ilp", "-o", str(plan), "-q")
    assert res.exit_code == 0, res.output
    doc = json.loads(plan.read_text())
    validate(g, read_plan(plan, g).schedule, doc["budget_bytes"])
    res = run("solve", str(gpath), "-b", "1.0", "-s", "checkpoint-all", "-o", str(plan), "-q")
    assert res.exit_code == 0, res.output


def test_trace_with_input_shape(factory: Path, tmp_path: Path) -> None:
    gpath = tmp_path / "g.json"
    res = run("trace", f"{factory}:model_only", "-o", str(gpath), "--profile", "cpu")
    assert res.exit_code == 2 and "--input-shape" in res.stderr
    assert not gpath.exists()
    res = run("trace", f"{factory}:model_only", "--input-shape", "8,32", "--profile", "cpu", "-o", str(gpath))
    assert res.exit_code == 0, res.output
    assert json.loads(gpath.read_text())["meta"]["input_shapes"] == [[8, 32]]


def test_a_model_whose_code_this_process_compiled_often_is_traced(factory: Path, tmp_path: Path) -> None:
    # Dynamo compiles every module through one wrapper of its own: past its recompile limit (8)
    # that code runs eagerly for good, and the trace captured nothing ("does any output
    # require grad?"), as when other tests had compiled modules in the process before
    import copy

    import torch
    from torch._dynamo.utils import counters

    # Dynamo's counters say whether a recompile limit was hit in this process (the unplanned
    # warning says so): restored after, so that later tests' messages do not change
    saved = copy.deepcopy(counters)
    torch._dynamo.reset()
    try:
        for width in range(1, torch._dynamo.config.recompile_limit + 3):
            torch.compile(torch.nn.Sequential(torch.nn.Linear(width, 2)), backend="eager")(
                torch.randn(1, width)
            )
        gpath = tmp_path / "g.json"
        res = run(
            "trace", f"{factory}:model_only", "--input-shape", "8,32", "--profile", "cpu", "-o", str(gpath)
        )
        assert res.exit_code == 0, res.output
        assert load_graph(gpath).backward_mask.any()
    finally:
        torch._dynamo.reset()
        counters.clear()
        counters.update(saved)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon", "MODULE:FACTORY"),
        ("no_such_module_xyz:f", "cannot import"),
        ("{factory}:missing", "no callable"),
        ("{factory}:not_a_model", "not a torch.nn.Module"),
    ],
)
def test_trace_bad_factories(spec: str, match: str, factory: Path, tmp_path: Path) -> None:
    gpath = tmp_path / "g.json"
    res = run("trace", spec.format(factory=factory), "--input-shape", "4,32", "-o", str(gpath))
    assert res.exit_code == 2, res.output
    assert match in res.stderr and "Traceback" not in res.output
    assert not gpath.exists()


def test_trace_bad_shape_and_profile(factory: Path, tmp_path: Path) -> None:
    gpath = tmp_path / "g.json"
    res = run("trace", f"{factory}:model_only", "--input-shape", "8,x", "-o", str(gpath))
    assert res.exit_code == 2 and "input-shape" in res.stderr
    res = run("trace", f"{factory}:with_inputs", "--profile", "no-such-device", "-o", str(gpath))
    assert res.exit_code == 2 and "no-such-device" in res.stderr
    assert not gpath.exists()


def test_trace_graph_break_writes_one_file_per_graph(factory: Path, tmp_path: Path) -> None:
    gpath = tmp_path / "g.json"
    res = run("trace", f"{factory}:with_break", "--profile", "cpu", "-o", str(gpath))
    assert res.exit_code == 0, res.output
    assert "graph breaks" in res.stderr
    files = sorted(tmp_path.glob("g.*.json"))
    assert [f.name for f in files] == ["g.0.json", "g.1.json"]
    for k, f in enumerate(files):
        g = load_graph(f)
        assert g.backward_mask.any()
        assert json.loads(f.read_text())["meta"]["graph_index"] == k


def test_offline_plan_is_used_by_optimize(factory: Path, tmp_path: Path) -> None:
    """trace -> solve offline -> optimize(..., plan=) loads that plan instead of planning."""
    import importlib.util

    import torch

    import checkmate

    gpath, plan = tmp_path / "g.json", tmp_path / "p.json"
    assert run("trace", f"{factory}:with_inputs", "--profile", "cpu", "-o", str(gpath)).exit_code == 0
    res = run("solve", str(gpath), "-b", "1.0", "-s", "checkpoint-all", "-o", str(plan), "-q")
    assert res.exit_code == 0, res.output
    spec = importlib.util.spec_from_file_location("models_for_optimize", factory)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, x = module.with_inputs()
    opt = checkmate.optimize(model, 1.0, (x,), strategy="checkpoint-all", profile="cpu", plan=str(plan))
    (record,) = checkmate.plans_of(opt)
    assert record.result.info.get("cache") == "hit", record.result.info
    opt(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert isinstance(model[0].weight.grad, torch.Tensor)
