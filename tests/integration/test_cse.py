"""Repeated computations of the joint graph merged (:mod:`checkmate.cse`): the joint graph
Inductor's partitioner is given recomputes a tanh-GELU's forward chain in its backward
formula; merged, it is computed once and the graph computes the same values. Random draws,
in-place writes and arguments that differ only in type are never merged."""

from __future__ import annotations

import operator

import pytest

torch = pytest.importorskip("torch")

import torch.fx as fx  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from checkmate.cse import merge_common_subexpressions  # noqa: E402

pytestmark = pytest.mark.torch

aten = torch.ops.aten


def _count(gm: fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target == target)


def _gelu_joint() -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """The joint forward+backward graph of Linear -> tanh-GELU -> Linear, decomposed as
    Inductor decomposes it, and real inputs for it (primals, then the tangent)."""
    from torch._functorch.aot_autograd import aot_function, make_boxed_func
    from torch._functorch.partitioners import default_partition
    from torch._inductor.decomposition import select_decomp_table

    torch.manual_seed(0)
    w1, b1, w2 = (
        torch.randn(32, 16, requires_grad=True),
        torch.randn(32, requires_grad=True),
        torch.randn(4, 32),
    )
    w2.requires_grad_(True)
    x = torch.randn(8, 16)
    captured: list[fx.GraphModule] = []

    def partition(joint: fx.GraphModule, joint_inputs: object, **kw: object) -> object:
        captured.append(joint)
        return default_partition(joint, joint_inputs, **kw)  # type: ignore[arg-type]

    def f(w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(torch.addmm(b1, x, w1.t()), approximate="tanh")
        return h @ w2.t()

    compiled = aot_function(
        f,
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition,
        decompositions=select_decomp_table(),
    )
    compiled(w1, b1, w2, x).sum().backward()
    (joint,) = captured
    inputs = [w1.detach(), b1.detach(), w2.detach(), x, torch.randn(8, 4)]
    return joint, inputs


def _run(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    out = gm(inputs[:-1], inputs[-1:])  # the joint graph takes (primals, tangents)
    return [o for o in fx.node.map_aggregate(out, lambda v: v) if isinstance(o, torch.Tensor)]  # type: ignore[union-attr]


def test_the_backward_repeat_of_a_gelu_is_merged_and_the_graph_computes_the_same_values() -> None:
    joint, inputs = _gelu_joint()
    assert _count(joint, aten.tanh.default) == 2  # the forward's, and the derivative's own
    before = _run(joint, [t.clone() for t in inputs])
    calls = sum(1 for n in joint.graph.nodes if n.op == "call_function")

    merged = merge_common_subexpressions(joint)

    assert _count(joint, aten.tanh.default) == 1
    assert merged >= 5  # x*x, *x, *0.044715, +x, *0.797, tanh at least
    assert sum(1 for n in joint.graph.nodes if n.op == "call_function") == calls - merged
    after = _run(joint, [t.clone() for t in inputs])
    assert len(after) == len(before)
    for a, b in zip(after, before, strict=True):
        assert torch.equal(a, b)
    assert merge_common_subexpressions(joint) == 0  # nothing repeats any more


def test_random_draws_and_in_place_writes_are_never_merged() -> None:
    def f(x: torch.Tensor, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.rand_like(x)
        b = torch.rand_like(x)
        buf.add_(1.0)
        buf.add_(1.0)
        return a, b, x.sin(), x.sin()

    gm = make_fx(f)(torch.randn(4), torch.zeros(4))
    merged = merge_common_subexpressions(gm)

    assert merged == 1  # only the second sin
    assert _count(gm, aten.rand_like.default) == 2
    assert _count(gm, aten.add_.Tensor) == 2
    assert _count(gm, aten.sin.default) == 1
    buf = torch.zeros(4)
    a, b, s1, s2 = gm(torch.randn(4), buf)
    assert not torch.equal(a, b)  # two draws still
    assert torch.equal(buf, torch.full((4,), 2.0))  # both writes still run
    assert s1 is s2


def test_arguments_equal_in_value_but_not_in_type_are_not_merged() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    outs = [
        graph.call_function(aten.mul.Tensor, (x, 2)),
        graph.call_function(aten.mul.Tensor, (x, 2.0)),
        graph.call_function(aten.mul.Tensor, (x, 0.0)),
        graph.call_function(aten.mul.Tensor, (x, -0.0)),
        graph.call_function(aten.sum.dim_IntList, (x, [0])),
        graph.call_function(aten.sum.dim_IntList, (x, [0]), {"keepdim": True}),
        graph.call_function(aten.sum.dim_IntList, (x, [0]), {"keepdim": True}),  # the one repeat
    ]
    graph.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), graph)

    assert merge_common_subexpressions(gm) == 1
    assert _count(gm, aten.mul.Tensor) == 4
    assert _count(gm, aten.sum.dim_IntList) == 2


def test_the_outputs_of_a_repeated_multi_output_op_are_merged_with_it() -> None:
    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        one = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
        two = aten.native_layer_norm.default(x, [8], w, b, 1e-5)
        return one[0] + two[0], one[1], two[2]

    gm = make_fx(f)(torch.randn(2, 8), torch.ones(8), torch.zeros(8))
    merged = merge_common_subexpressions(gm)

    assert _count(gm, aten.native_layer_norm.default) == 1
    getitems = [n for n in gm.graph.nodes if n.target is operator.getitem]
    assert len({(n.args[0], n.args[1]) for n in getitems}) == len(getitems)  # no getitem repeats
    assert merged >= 2
    x = torch.randn(2, 8)
    assert torch.equal(gm(x, torch.ones(8), torch.zeros(8))[0], f(x, torch.ones(8), torch.zeros(8))[0])
