"""Helpers of the two-rank (gloo, CPU) tests: a free port, ranks started with a deadline,
and training a planned model beside its eager twin on the same batches."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

#: seconds a test's ranks may run before they are killed and the test fails (each takes
#: 10-60 s on 2 cores; once, under load, one rank of a finished test never exited, and the
#: suite hung until the CI run was stopped)
RANKS_DEADLINE = 300.0


#: seconds :func:`settle` leaves the GIL free after its barrier
SETTLE_S = 0.2


def settle() -> None:
    """Call at the end of a rank's work, before its process group and DDP modules go: a
    barrier, then a moment without the GIL.

    Each ``backward()`` stashes a Python object (a ``contextvars.Context``) in the thread-local
    state that the collectives it launches carry to gloo's worker threads, so a worker thread
    that drops a finished collective takes the GIL. The process group's C++ destructor joins
    those threads while the GIL is held (pytorch/pytorch#56297): dropped with DDP's reducer at
    the worker's return, it waited forever on a thread waiting for the GIL (a rank of the DDP
    split test, in CI twice and once here; gdb: ``~Reducer`` -> ``~ProcessGroupGloo`` ->
    ``thread::join`` on one thread, ``~AsyncAllreduceWork`` -> ``~ThreadLocalState`` ->
    ``gil_scoped_acquire`` on another). The barrier is enqueued under the lock that thread
    holds, and the sleep lets it take the GIL and finish.
    """
    torch.distributed.barrier()
    time.sleep(SETTLE_S)


#: a collective waiting longer raises instead of hanging the test (gloo's default: 30 min);
#: under the ranks' deadline
COLLECTIVE_TIMEOUT = timedelta(seconds=180)


@contextlib.contextmanager
def process_group(rank: int, port: int, world: int) -> Iterator[None]:
    r"""A rank's gloo process group on the loopback at ``port``, one torch thread, checkmate's
    plan cache off; on success the rank :func:`settle`\ s before the group is destroyed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), CHECKMATE_CACHE="0")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    torch.set_num_threads(1)
    try:
        yield
        settle()
    finally:
        torch.distributed.destroy_process_group()


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(
    fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, deadline: float = RANKS_DEADLINE
) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, with ranks still running after
    ``deadline`` seconds killed and the test failed, naming them, instead of a hung suite. A
    rank that raised fails the test as under ``spawn``. A rank killed at the deadline first
    prints every thread's Python stack on its stderr (faulthandler, on SIGABRT), which the
    test's captured output shows: where it waited."""
    before = os.environ.get("PYTHONFAULTHANDLER")
    os.environ["PYTHONFAULTHANDLER"] = "1"  # inherited by the ranks: a stack dump on SIGABRT
    try:
        ctx = torch.multiprocessing.start_processes(
            fn, args=args, nprocs=nprocs, join=False, start_method="spawn"
        )
    finally:
        if before is None:
            del os.environ["PYTHONFAULTHANDLER"]
        else:
            os.environ["PYTHONFAULTHANDLER"] = before
    end = time.monotonic() + deadline
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            alive = [k for k, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGABRT)
                    p.join(timeout=5.0)  # its stacks written (one rank at a time: not interleaved)
                if p.is_alive():
                    p.kill()
            pytest.fail(f"rank(s) {alive} of {fn.__name__} still running after {deadline:.0f} s: killed")


def train_twins(
    twin: torch.nn.Module,
    planned: torch.nn.Module,
    step: Callable[[torch.nn.Module, int], None],
    steps: int,
    rank: int,
) -> list[int]:
    """``steps`` AdamW steps of ``twin`` and ``planned`` on the same batches (``step(model,
    seed)``); returns the measured peaks of ``planned``'s steps after the first (which plans)."""
    from checkmate.memory import measure_peak

    adam = {id(m): torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (twin, planned)}
    peaks: list[int] = []
    for k in range(steps):
        for m in (twin, planned):
            adam[id(m)].zero_grad(set_to_none=True)
            if m is planned and k > 0:
                peaks.append(measure_peak(lambda m=m, k=k: step(m, 10 * k + rank)))  # type: ignore[misc]
            else:
                step(m, 10 * k + rank)
            adam[id(m)].step()
    return peaks


def fake_ddp_reserve(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """Make the planner see ``nbytes`` of DDP gradient buckets beside every graph, without DDP:
    :func:`checkmate.distributed.ddp_reserve` replaced in both planner layers that read it."""
    import checkmate.planning
    import checkmate.step_budget

    for module in (checkmate.planning, checkmate.step_budget):
        monkeypatch.setattr(module, "ddp_reserve", lambda: nbytes)
