"""What the solver worker processes share (:mod:`solvers._highs_worker`, the CP-SAT worker of
:mod:`solvers.strategies.cpsat`): how the parent starts one and how the worker answers.

A worker is ``python -c "<code>"``, never a multiprocessing spawn: spawning re-runs the
caller's ``__main__`` (a training script without a ``__main__`` guard would train again in
the worker), and forking a process whose solver thread pools already run can deadlock.
Messages are pickled on the worker's stdout, so solver logs written to C stdout must go
elsewhere.

The worker runs isolated (``python -I``): the current directory is not on its ``sys.path``
(else a ``pickle.py`` or a ``solvers/`` folder where the user runs ``checkmate solve`` would be
imported and executed by the worker) and ``PYTHON*`` variables are ignored. Its ``sys.path``
is then the parent's, less the current directory: packages the parent finds through
``PYTHONPATH``, a user site folder or a ``sys.path`` entry its script added (HiGHS, OR-Tools
installed with ``pip install --target``, a cluster's module system) are found by the worker
too. The folder holding this very ``solvers`` package goes first, so the worker imports the
parent's copy of the package, installed or not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import IO

__all__ = ["worker_command", "claim_stdout"]


def worker_command(code: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run ``code`` in a fresh, isolated interpreter (``-I``)
    importing this very ``solvers`` package, with this process's ``sys.path`` less the
    current directory, whatever that directory holds."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    root = str(Path(__file__).resolve().parents[1])
    boot = f"import sys; sys.path[:] = {_search_path(root)!r}; "
    return [sys.executable, "-I", "-c", boot + code], env


def _search_path(root: str) -> list[str]:
    """``root``, then this process's ``sys.path`` without the entries that name the current
    directory (``''``, ``'.'``, or its absolute path) and without repeats."""
    cwd = os.path.realpath(os.getcwd())
    paths = [root]
    for entry in sys.path:
        if not isinstance(entry, str) or entry in ("", ".") or entry in paths:
            continue
        if os.path.realpath(entry) == cwd:
            continue
        paths.append(entry)
    return paths


def claim_stdout() -> IO[bytes]:
    """In a worker: the message pipe (the process's stdout, as a binary file), with C-level and
    Python stdout redirected to stderr so solver logs cannot corrupt the messages."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out
