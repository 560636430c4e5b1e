"""The built wheel works on its own: installed into a fresh virtual environment, it ships the
device profiles, plans with ``profile="h100"`` and installs the ``checkmate`` command."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

REPO = Path(__file__).resolve().parents[2]

# Run in the installed copy: both packages come from it, the profiles are its package data,
# and a model and a saved graph are planned with the H100 profile.
_CHILD = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch

    import checkmate, solvers
    from checkmate.api import plans_of
    from checkmate.profile import available_profiles, load_profile
    from solvers import Graph

    site = Path(sys.argv[1]).resolve()
    for mod in (checkmate, solvers):
        assert Path(mod.__file__).resolve().is_relative_to(site), mod.__file__
    assert {"a100", "cpu", "h100"} <= set(available_profiles()), available_profiles()
    assert load_profile("h100").name == "h100"

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )
    x = torch.randn(16, 32)
    opt = checkmate.optimize(model, 1.0, (x,), profile="h100", time_limit=5)
    opt(x).sum().backward()
    (rec,) = plans_of(opt)
    assert rec.result.ok, rec.summary()
    # estimated from the profile: no op is cheaper than its launch overhead
    cost = rec.joint.graph.cost
    assert cost.max() > 0 and cost[cost > 0].min() >= load_profile("h100").launch_overhead * (1 - 1e-9)

    # torch-free: the host link of a paging strategy from the shipped profile
    nodes = [{"key": i, "cost": 1.0, "mem": 4} for i in range(6)]
    g = Graph.build(nodes, [(i, i + 1) for i in range(5)], name="chain6")
    res = solvers.solve(g, 1.0, "poet", profile="h100", time_limit=10)
    assert res.ok, res
    solvers.save_graph(g, "chain.json")  # for the console script
    print("ok")
    """
)


def _run(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` without ``PYTHONPATH``: a checkout on it (and its ``*.egg-info``)
    would be imported in place of the installed copy, and pip would take the wheel as
    installed already."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(*args, env=env, **kwargs)  # type: ignore[call-overload,no-any-return]


def test_the_built_wheel_ships_the_profiles_and_plans_with_h100(tmp_path: Path) -> None:
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    # built from a copy: an in-tree build/ left by an earlier build could ship stale modules
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("checkmate", "solvers", "profiles"):
        shutil.copytree(REPO / name, src / name, symlinks=True, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(
        [*pip, "wheel", str(src), "--no-deps", "--no-build-isolation", "-w", str(wheels)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("checkmate_remat-*.whl")
    # a fresh venv (no pip of its own: this interpreter's pip installs into it); the
    # dependencies (torch, numpy, highspy, ...) come from this interpreter's site-packages
    # through a .pth file, which adds them to the path but not the editable install's finder
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site_dir = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site_dir / "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    # --ignore-installed: a copy installed where the .pth points (pip install ., not -e) is
    # not this venv's, and must not stop the wheel's install into it
    install = [*pip, "--python", str(python), "install", "--no-deps", "--ignore-installed", str(wheel)]
    _run(install, check=True, capture_output=True)
    assert (site_dir / "solvers" / "_profiles" / "h100.json").is_file()  # a copy, not the link
    assert not (site_dir / "solvers" / "_profiles").is_symlink()
    # run from an empty folder so the source tree is not importable
    work = tmp_path / "work"
    work.mkdir()
    out = _run(
        [str(python), "-c", _CHILD, str(site_dir)], cwd=work, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert out.stdout.strip().endswith("ok")

    # the console script of the installed copy plans a saved graph with the shipped profile
    graph = work / "chain.json"
    cli = [str(venv / "bin" / "checkmate"), "solve", str(graph), "-b", "1.0", "-s", "poet", "-q"]
    res = _run(
        [*cli, "-O", "profile=h100", "-o", str(work / "p.json")], cwd=work, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads((work / "p.json").read_text())["strategy"] == "poet"
