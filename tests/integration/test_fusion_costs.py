"""The op costs ``compiler="inductor"`` plans with (:func:`checkmate.fusion.fused_costs`): a
library kernel keeps its measured cost, a generated op costs the memory it moves, and a
chain of fused ops is charged the reads of its inputs once, not a write per op."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from checkmate.fusion import FUSED_FLOOR, fused_costs  # noqa: E402

pytestmark = pytest.mark.torch

N = 256
BYTES = N * N * 4  # every value below: an N x N float32
BANDWIDTH = 1e9
LAUNCH = 1e-6


def _chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(torch.mm(x, w).sin().cos().exp(), w)


def _costs() -> list[tuple[str, float]]:
    """(op name, cost) of each op of ``_chain``, in order: mm, sin, cos, exp, mm."""
    gm = make_fx(_chain, tracing_mode="fake")(torch.randn(N, N), torch.randn(N, N))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    costs = fused_costs(nodes, [1.0] * len(nodes), BANDWIDTH, LAUNCH)
    return [(n.target.overloadpacket.__name__, c) for n, c in zip(nodes, costs, strict=True)]  # type: ignore[union-attr]


def test_library_kernels_keep_their_measured_cost() -> None:
    got = _costs()
    assert [name for name, _ in got] == ["mm", "sin", "cos", "exp", "mm"]
    assert got[0][1] == 1.0 and got[-1][1] == 1.0


def test_a_fused_chain_reads_its_input_once_and_writes_only_what_a_library_kernel_reads() -> None:
    got = dict(_costs()[1:4])
    write = BYTES / BANDWIDTH
    assert got["sin"] == pytest.approx(write + FUSED_FLOOR * write)  # reads the mm's output
    assert got["cos"] == pytest.approx(FUSED_FLOOR * write)  # inside the chain: nothing from memory
    assert got["exp"] == pytest.approx(write + LAUNCH)  # the mm reads it: written, a kernel of its own
    # recomputing the chain costs about one read and one write, not a write per op
    assert got["sin"] + got["cos"] + got["exp"] < 2.2 * write + LAUNCH
    assert min(got.values()) > 0  # no recomputation is free
