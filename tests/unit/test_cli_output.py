"""What the command line leaves behind: no solver banner under -q, files with the user's umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from solvers import save_graph
from tests.graphs import chain


def _solve(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    graph = tmp_path / "chain.json"
    save_graph(chain(12, training=True), graph)
    code = "from checkmate.cli import main; main()"
    args = [sys.executable, "-c", code, "solve", str(graph), "--budget", "0.7", "-s", "ilp"]
    return subprocess.run(
        [*args, "-o", str(tmp_path / "p.json"), *extra], capture_output=True, text=True, timeout=120
    )


def test_quiet_solve_prints_no_highs_banner(tmp_path: Path) -> None:
    res = _solve(tmp_path, "-q")
    assert res.returncode == 0, res.stderr
    assert "HiGHS" not in res.stdout + res.stderr
    assert "status" in res.stdout  # the summary itself is still printed


def test_plan_file_takes_the_users_umask(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        res = _solve(tmp_path, "-q")
    finally:
        os.umask(old)
    assert res.returncode == 0, res.stderr
    assert stat.S_IMODE((tmp_path / "p.json").stat().st_mode) == 0o644
