"""HiGHS in a worker process, stopped by force at its time limit (see :mod:`solvers.highs`).

HiGHS 1.15 runs phases that ignore ``time_limit`` and fire no callback (the MIP root's
analytic-centre IPM, its setup after presolve), so the only way to keep a user's time
limit is to run the solve where it can be killed. The parent starts
``python -c "...; main()"`` (not multiprocessing: spawning would re-run the caller's
``__main__``, and forking a process whose HiGHS thread pool already runs would deadlock),
sends the problem on stdin and reads messages from stdout: progress, each improving MIP
incumbent with its column vector, and the final :class:`~solvers.highs.HighsResult` (for
an LP with its row duals). When ``time_limit + kill_grace(time_limit)`` has passed without
a result, the worker is killed and the best incumbent so far is the answer (for an LP,
which has none, NO_SOLUTION).

Messages are pickled: both ends are this module of the same installation, and nothing is
stored (plans are JSON; this is a pipe between two copies of one program).
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

import numpy as np

from solvers._subprocess import claim_stdout, worker_command
from solvers.errors import SolverError, WorkerError
from solvers.highs import (
    FloatArray,
    HighsProblem,
    HighsResult,
    ProgressHook,
    _Settings,
    kill_grace,
    solve_here,
)
from solvers.result import Status

__all__ = ["solve_isolated", "main"]

_WORKER = "from solvers._highs_worker import main; main()"
#: progress messages from the worker at least this often (they carry the dual bound)
_STREAM_INTERVAL = 1.0


def solve_isolated(
    problem: HighsProblem,
    settings: _Settings,
    progress: ProgressHook | None,
    progress_interval: float,
) -> HighsResult:
    """Solve in a worker process; kill it ``kill_grace`` seconds after the time limit.

    Args:
        problem: the problem.
        settings: HiGHS settings; ``time_limit`` must be set.
        progress: the caller's progress hook, called here (in the caller's thread).
        progress_interval: seconds between periodic progress calls.

    Returns:
        The worker's result, or, if it was killed, one built from the best incumbent (or
        the start vector) and the last dual bound it reported: for an LP, or a MIP
        without an incumbent, status NO_SOLUTION with model status ``kTimeLimit``.

    Raises:
        SolverError: HiGHS failed in the worker, or the worker died without an answer.
    """
    assert settings.time_limit is not None
    with tempfile.TemporaryFile() as log_file:  # the worker's stderr, for error messages
        return _run(problem, settings, progress, progress_interval, None if settings.log else log_file)


def _run(
    problem: HighsProblem,
    settings: _Settings,
    progress: ProgressHook | None,
    progress_interval: float,
    err: IO[bytes] | None,
) -> HighsResult:
    assert settings.time_limit is not None
    t0 = time.perf_counter()
    limit = settings.time_limit
    kill_at = t0 + limit + kill_grace(limit)
    best_x = settings.start
    best_obj = None if best_x is None else float(problem.cost @ best_x) + problem.offset
    bound: float | None = None
    last_report = -np.inf
    argv, env = worker_command(_WORKER)
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=err,
        env=env,
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        threading.Thread(target=_read, args=(proc.stdout, inbox), daemon=True).start()
        deadline = time.time() + limit - (time.perf_counter() - t0)
        payload = (problem, dataclasses.replace(settings, wall_deadline=deadline), progress_interval)
        try:
            pickle.dump(payload, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
            proc.stdin.close()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerError(f"the HiGHS worker process did not start: {_tail(err, proc)}") from exc
        while True:
            wait = kill_at - time.perf_counter()
            if wait <= 0:
                break
            try:
                msg = inbox.get(timeout=wait)
            except queue.Empty:
                break
            kind = msg[0]
            if kind == "progress":
                _, _, inc, bd, phase = msg
                bound = bd if bd is not None else bound
                now = time.perf_counter() - t0
                if progress is not None and (phase == "incumbent" or now - last_report >= progress_interval):
                    last_report = now
                    progress(now, inc, bd, phase)
            elif kind == "incumbent":
                _, x, obj, bd = msg
                bound = bd if bd is not None else bound
                if best_obj is None or obj < best_obj:
                    best_x, best_obj = x, obj
            elif kind == "result":
                res: HighsResult = msg[1]
                return dataclasses.replace(res, seconds=time.perf_counter() - t0)
            elif kind == "error":
                _, name, text = msg
                if name in ("ImportError", "ModuleNotFoundError"):
                    raise WorkerError(f"the HiGHS worker process could not import its solver: {name}: {text}")
                raise SolverError(text if name == "SolverError" else f"HiGHS failed: {name}: {text}")
            else:  # the worker's stdout closed without an answer
                proc.wait(5)
                raise WorkerError(
                    f"the HiGHS worker process exited with code {proc.returncode} without an "
                    f"answer: {_tail(err, proc)}"
                )
        return _killed(best_x, best_obj, bound, time.perf_counter() - t0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def _killed(x: FloatArray | None, obj: float | None, bound: float | None, seconds: float) -> HighsResult:
    gap = None
    if obj is not None and bound is not None:
        gap = max(obj - bound, 0.0) / max(abs(obj), 1e-9)
    stats = {"simplex_iterations": -1, "ipm_iterations": -1, "mip_nodes": -1, "killed": True}
    status = Status.FEASIBLE if x is not None else Status.NO_SOLUTION
    return HighsResult(status, x, obj, bound, gap, "kTimeLimit", seconds, stats)


def _read(stream: IO[bytes], inbox: queue.Queue[tuple[Any, ...]]) -> None:
    try:
        while True:
            inbox.put(pickle.load(stream))
    except (EOFError, OSError, pickle.UnpicklingError, ValueError):
        inbox.put(("eof",))


def _tail(err: IO[bytes] | None, proc: subprocess.Popen[bytes]) -> str:
    if err is None:
        return "see its log above"
    try:
        proc.wait(5)
        err.seek(0)
        text = err.read().decode(errors="replace").strip()
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    return text[-800:] or "no output"


def main() -> None:
    """The worker: read (problem, settings, interval) on stdin, stream messages on stdout."""
    out = claim_stdout()  # HiGHS logs to C stdout: keep it out of the message pipe
    lock = threading.Lock()

    def send(*msg: Any) -> None:
        with lock:
            pickle.dump(msg, out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()

    problem, settings, interval = pickle.load(sys.stdin.buffer)

    def progress(elapsed: float, inc: float | None, bound: float | None, phase: str) -> None:
        send("progress", elapsed, inc, bound, phase)

    def incumbent(x: FloatArray, obj: float, bound: float | None) -> None:
        send("incumbent", np.asarray(x, dtype=np.float64), obj, bound)

    try:
        res = solve_here(problem, settings, progress, min(interval, _STREAM_INTERVAL), incumbent)
        send("result", res)
    except BaseException as exc:  # the parent turns it into SolverError
        send("error", type(exc).__name__, str(exc))
    out.close()
