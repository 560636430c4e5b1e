"""The solver workers never import code from the directory the user runs checkmate in.

A worker is ``python -c``, which would put the current directory first on ``sys.path``: a
``pickle.py`` or a ``solvers/`` folder there would be executed by the worker. Each test runs a
solve that starts a worker from a directory holding both, written to leave a marker file when
imported, and checks that no marker appears and that the plan was made.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from checkmate.cli import cli
from solvers import _highs_worker, highs, save_graph
from solvers.strategies import get_strategy
from tests.graphs import chain

_HOSTILE = 'import pathlib\npathlib.Path({marker!r}).write_text("executed")\n'


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A folder with a ``pickle.py`` and a ``solvers`` package that write markers when imported."""
    work = tmp_path / "work"
    (work / "solvers").mkdir(parents=True)
    (work / "pickle.py").write_text(_HOSTILE.format(marker=str(tmp_path / "MARKER-pickle")))
    (work / "solvers" / "__init__.py").write_text(_HOSTILE.format(marker=str(tmp_path / "MARKER-solvers")))
    save_graph(chain(6, training=True), work / "g.json")
    return work


def _markers(work: Path) -> list[str]:
    return sorted(p.name for p in work.parent.glob("MARKER-*"))


def _checkmate_script() -> str:
    """The installed console script (``python -m checkmate`` would itself put the current
    directory on ``sys.path``; the script does not, as for a user)."""
    found = Path(sys.executable).parent / "checkmate"
    return str(found) if found.exists() else shutil.which("checkmate") or ""


def test_cpsat_worker_ignores_the_current_directory(hostile: Path) -> None:
    try:
        get_strategy("cpsat")
    except Exception:
        pytest.skip("OR-Tools not installed")
    script = _checkmate_script()
    if not script:
        pytest.skip("no checkmate console script beside this interpreter")
    # a fresh process: OR-Tools is not loaded there, so CP-SAT runs in its worker
    proc = subprocess.run(
        [script, "solve", "g.json", "-b", "0.7", "-s", "cpsat", "-t", "20", "-o", "p.json", "-q"],
        cwd=hostile,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert _markers(hostile) == [], "the CP-SAT worker imported code from the current directory"
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((hostile / "p.json").read_text())
    assert doc["strategy"] == "cpsat" and doc["status"] in ("optimal", "feasible")


def test_highs_worker_in_auto_ignores_the_current_directory(
    hostile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    real = _highs_worker.solve_isolated

    def counted(*args: object, **kwargs: object) -> object:
        started.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(_highs_worker, "solve_isolated", counted)
    monkeypatch.setattr(highs, "ISOLATE_MIN_NNZ", 0)  # every MILP in a worker
    monkeypatch.setattr(highs, "ISOLATE_MIN_NNZ_LP", 0)
    monkeypatch.chdir(hostile)
    # 0.5 of the keep-all peak: no heuristic is known optimal there, so auto asks the MILP
    res = CliRunner().invoke(
        cli, ["solve", "g.json", "-b", "0.5", "-s", "auto", "-t", "20", "-o", "p.json", "-q"]
    )
    assert _markers(hostile) == [], "the HiGHS worker imported code from the current directory"
    assert res.exit_code == 0, res.output
    assert started, "auto never started a HiGHS worker: the test proves nothing"
    assert json.loads((hostile / "p.json").read_text())["status"] in ("optimal", "feasible")


def test_worker_command_is_isolated() -> None:
    from solvers._subprocess import worker_command

    argv, env = worker_command("pass")
    assert argv[1] == "-I" and not any(k.startswith("PYTHON") for k in env)
    subprocess.run(argv, check=True, env=env, timeout=60)


def test_worker_finds_what_the_parent_path_holds_but_not_the_current_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a solver installed outside site-packages (PYTHONPATH, pip install --target, a module
    # system) is on the parent's sys.path; -I alone would hide it from the worker
    from solvers._subprocess import worker_command

    lib, work = tmp_path / "lib", tmp_path / "work"
    lib.mkdir()
    work.mkdir()
    (lib / "probe_on_path.py").write_text("X = 'found'\n")
    (work / "probe_in_cwd.py").write_text("X = 'imported from the current directory'\n")
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", ["", str(work), str(lib), *sys.path])
    code = (
        "import importlib.util as u, probe_on_path; "
        "print(probe_on_path.X, u.find_spec('probe_in_cwd') is None)"
    )
    argv, env = worker_command(code)
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["found", "True"]


def test_cpsat_worker_options_match_the_model_and_do_not_load_ortools() -> None:
    """Checking cpsat's options must not import OR-Tools: once loaded here, CP-SAT runs in
    this process instead of its worker (whose reason is the libhighs clash with highspy)."""
    try:
        from solvers.strategies import cpsat_model
    except ImportError:
        pytest.skip("OR-Tools not installed")
    from solvers.strategies import _keyword_only
    from solvers.strategies.cpsat import WORKER_OPTIONS

    assert tuple(_keyword_only(cpsat_model.solve_in_process)) == WORKER_OPTIONS
    code = (
        "import sys; from solvers.strategies import get_strategy, strategy_options; "
        "get_strategy('cpsat'); strategy_options('cpsat'); "
        "print(any(m.startswith('ortools') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_auto_warns_when_a_solver_worker_dies_and_plans_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a worker that cannot run (a solver its interpreter cannot import, killed for memory)
    # used to leave auto's plan to the heuristics without a word
    from solvers import SolverWarning, solve
    from solvers._subprocess import worker_command

    def dying(code: str) -> tuple[list[str], dict[str, str]]:
        argv, env = worker_command("import sys; sys.exit(3)")
        return argv, env

    monkeypatch.setattr(_highs_worker, "worker_command", dying)
    monkeypatch.setattr(highs, "ISOLATE_MIN_NNZ", 0)  # every MILP in a worker
    monkeypatch.setattr(highs, "ISOLATE_MIN_NNZ_LP", 0)
    graph = chain(6, training=True)
    with pytest.warns(SolverWarning, match="could not run"):
        res = solve(graph, "50%", strategy="auto", time_limit=10)
    assert res.ok and res.schedule is not None
    failed = [k for k, v in res.info["candidates"].items() if str(v).startswith("error: the HiGHS worker")]
    assert failed, res.info["candidates"]
