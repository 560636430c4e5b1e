"""Helpers of the two-rank (gloo, CPU) tests: a free port, and training a planned model
beside its eager twin on the same batches."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
