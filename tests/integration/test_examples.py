"""The README's example commands run as written, from a clone's root."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration._dist import free_port

pytestmark = [pytest.mark.torch, pytest.mark.skipif(sys.platform == "win32", reason="gloo on Linux/macOS")]

ROOT = Path(__file__).resolve().parents[2]


def test_the_ddp_example_runs_under_torchrun_as_the_readme_says() -> None:
    # `torchrun --nproc_per_node 2 examples/train_ddp.py`: run as a script, its own folder is
    # on sys.path, not the clone's root (it failed importing `examples`)
    env = {**os.environ, "CHECKMATE_CACHE": "0", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    port = str(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    proc = subprocess.run(
        [*cmd, "examples/train_ddp.py", "--steps", "2", "--time-limit", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # one report per rank; the two ranks' prints may share a line (a clean-clone run printed
    # "... max difference 0rank 0: eager DDP peak ...")
    done = re.findall(r"parameters vs eager DDP: max difference 0(?![.\d])", proc.stdout)
    assert len(done) == 2, proc.stdout[-3000:]
