"""The op costs ``compiler="inductor"`` plans with (:func:`checkmate.fusion.fused_costs`): a
library kernel keeps its measured cost, a generated op costs the memory it moves plus its
arithmetic, and a chain of fused ops is charged the reads of its inputs once, not a write
per op."""

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


#: an eager pointwise op bound by memory (a GPU's): it reads its input, writes its output
#: and launches, and does no arithmetic worth its time
MEMORY_BOUND = 2 * BYTES / BANDWIDTH + LAUNCH


def _costs(pointwise: float = MEMORY_BOUND) -> list[tuple[str, float]]:
    """(op name, cost) of each op of ``_chain``, in order: mm, sin, cos, exp, mm, when the
    matrix products measured 1 s eagerly and each pointwise op ``pointwise`` seconds."""
    gm = make_fx(_chain, tracing_mode="fake")(torch.randn(N, N), torch.randn(N, N))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    eager = [1.0, pointwise, pointwise, pointwise, 1.0]
    costs = fused_costs(nodes, eager, BANDWIDTH, LAUNCH)
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


def test_a_fused_op_bound_by_its_arithmetic_keeps_the_arithmetic_part_of_its_eager_cost() -> None:
    # a CPU's tanh or exp: the eager op took 5 ms where moving its bytes takes 0.5 ms
    arithmetic = 5e-3
    got = dict(_costs(MEMORY_BOUND + arithmetic)[1:4])
    memory = dict(_costs()[1:4])
    for name in ("sin", "cos", "exp"):
        assert got[name] == pytest.approx(memory[name] + arithmetic)  # fusion saves bytes only
    # and never more than the eager op: an op cheaper eagerly than its model keeps that cost
    capped = dict(_costs(0.5 * BYTES / BANDWIDTH)[1:4])
    assert capped["exp"] == pytest.approx(0.5 * BYTES / BANDWIDTH)


def test_no_generated_op_costs_less_than_a_share_of_the_largest() -> None:
    from checkmate.fusion import MIN_SHARE

    gm = make_fx(_chain, tracing_mode="fake")(torch.randn(N, N), torch.randn(N, N))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    eager = [1e3, MEMORY_BOUND, MEMORY_BOUND, MEMORY_BOUND, 1e3]  # library kernels of 17 minutes
    costs = fused_costs(nodes, eager, BANDWIDTH, LAUNCH)
    assert FUSED_FLOOR * BYTES / BANDWIDTH < MIN_SHARE * 1e3 < MEMORY_BOUND  # cos falls to the floor
    assert min(costs) == pytest.approx(MIN_SHARE * 1e3)  # the exact models' cost span holds


def test_handing_over_a_fused_value_costs_its_write_and_its_read_back() -> None:
    from checkmate.fusion import save_cost

    gm = make_fx(_chain, tracing_mode="fake")(torch.randn(N, N), torch.randn(N, N))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    got = [save_cost(n, BANDWIDTH) for n in nodes]  # mm, sin, cos, exp, mm
    write = BYTES / BANDWIDTH
    # sin and cos are fused into exp's kernel: saved, they are written and read back
    assert got[1] == pytest.approx(2 * write) and got[2] == pytest.approx(2 * write)
    # the matrix products' results and exp (a matrix product reads it) are in memory anyway
    assert got[0] == got[3] == got[4] == 0.0


@pytest.mark.parametrize("charge", [False, True])
def test_the_inductor_graph_carries_save_costs_only_when_charged(
    monkeypatch: pytest.MonkeyPatch, charge: bool
) -> None:
    import warnings

    import checkmate
    from checkmate import fusion

    monkeypatch.setattr(fusion, "CHARGE_SAVES", charge)
    torch.manual_seed(0)
    gelu = lambda: torch.nn.GELU(approximate="tanh")  # noqa: E731
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), gelu(), torch.nn.Linear(256, 256), gelu(), torch.nn.Linear(256, 8)
    )
    x = torch.randn(256, 64)
    ref = [p.grad for p in _backward(model, x)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # check_peak=False warns that the compiled peak goes unchecked
        opt = checkmate.optimize(
            model, 0.8, compiler="inductor", profile="cpu", time_limit=5, check_peak=False
        )
        got = [p.grad for p in _backward(opt, x)]
    for a, b in zip(got, ref, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    (rec,) = checkmate.plans_of(opt)
    g = rec.joint.graph
    assert not g.save_cost[g.backward_mask].any()  # only forward values are handed over
    assert bool(g.save_cost.any()) == charge  # GELU's inner pointwise ops, fused into one kernel
    assert rec.recomputes > 0  # the budget made it plan


def _backward(model: torch.nn.Module, x: torch.Tensor) -> list[torch.nn.Parameter]:
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    return list(model.parameters())
