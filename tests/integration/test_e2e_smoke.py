"""Smoke test of ``benchmarks.e2e``: a fresh process optimizes a small CNN with the plan cache
off, times the stages and measures one step against eager (timing targets are left to the
benchmark: this asserts only what must hold on any machine)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import e2e, tables
from tests.integration._models import SmallCNN


class _Loss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN(c=8, blocks=2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.net(x), y)


def small_cnn() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The factory the child process loads (``tests.integration.test_e2e_smoke:small_cnn``)."""
    torch.manual_seed(0)
    return _Loss(), torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))


def test_e2e_child_plans_and_matches_eager() -> None:
    (row,) = e2e.run(
        ["cnn"],
        budget=0.6,
        time_limit=5.0,
        factories={"cnn": "tests.integration.test_e2e_smoke:small_cnn"},
    )
    assert row.status == "ok", row.status
    assert row.graphs == 1 and row.nodes > 20
    # (the stages sum to total_s by construction: trace_s is the remainder; what can fail is a
    # stage counted twice, which makes the remainder negative)
    assert min(row.trace_s, row.profile_s, row.solve_s, row.codegen_s) >= 0.0
    assert row.wall_s > row.total_s  # the child's wall time includes imports and the steps
    assert row.recomputes > 0  # 60% of the no-remat peak needs rematerialization
    assert row.sim_peak <= row.budget_bytes < row.reference_peak
    assert row.measured_peak > 0 and row.eager_peak > row.measured_peak
    assert row.grad_err <= 1e-5 * max(row.grad_scale, 1.0)
    assert row.loss_err <= 1e-6
    line = tables.e2e_line(row)
    assert "trace + profile + solve + codegen" in line and ("met" in line or "missed" in line)
