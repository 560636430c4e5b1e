"""``checkmate.uncaptured``: the ops a forward ran outside every compiled graph, and the
storages they saved for the backward, found by walking the autograd graph."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from checkmate.uncaptured import break_reasons, dynamo_failures, uncaptured

pytestmark = pytest.mark.torch


def _middle(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2.0


def test_saved_storages_of_eager_ops_before_and_after_a_compiled_graph_are_counted_once() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(_middle, backend="aot_eager")
    w = torch.randn(64, 64, requires_grad=True)  # a parameter: held before the call
    x = torch.randn(128, 64, requires_grad=True)  # an input
    h = torch.sigmoid(x @ w)  # eager: mm saves x and w (held), sigmoid its result
    out = compiled(h).exp()  # compiled (one node), then eager: exp saves its result
    both = out[:64] * out[:64]  # a view of out's storage, saved twice: counted once
    found = uncaptured([both], [w, x])
    assert found.saved == h.nbytes + out.nbytes
    assert set(found.kinds) == {
        "MmBackward0",
        "SigmoidBackward0",
        "ExpBackward0",
        "SliceBackward0",
        "MulBackward0",
    }
    assert found.nodes == 6  # out[:64] twice: two slices
    # from the compiled graph's output on, only its eager consumers
    assert uncaptured([compiled(h)], [w, x, h]).saved == 0
    # the walk stops at what was there before the call: an input made by an earlier op
    assert uncaptured([out], [w, x, h]).saved == out.nbytes


def test_nothing_is_read_under_saved_tensor_hooks() -> None:
    # reading a saved tensor would run the unpack hook: copy back what was offloaded
    w, x = torch.randn(32, 32, requires_grad=True), torch.randn(8, 32)
    with torch.autograd.graph.save_on_cpu():
        out = torch.sigmoid(x @ w)
        assert uncaptured([out], [w, x]).saved == 0
    assert uncaptured([out], [w, x]).saved == out.nbytes


def test_the_reasons_dynamo_counted_during_a_call_are_given_with_their_explanation() -> None:
    def skipped(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        return packed.data.sum()

    torch._dynamo.reset()
    before = dynamo_failures()
    torch.compile(skipped, backend="aot_eager")(torch.randn(4, 6, 3), torch.tensor([6, 3, 2, 1]))
    reasons = break_reasons(before)
    assert any("`pack_padded_sequence`" in r and "site-packages" not in r for r in reasons), reasons
    assert break_reasons(dynamo_failures()) == []


class _Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x * x
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return 2 * grad * y.sqrt()


def test_a_python_autograd_function_run_eagerly_is_counted_with_what_it_saved() -> None:
    w = torch.randn(32, 32, requires_grad=True)
    y = _Square.apply(w + 1)  # AddBackward0 saves nothing; the Function saves its output
    found = uncaptured([y], [w])
    assert found.saved == y.nbytes and found.nodes == 2
    assert found.functions == ("_Square",)  # its backward runs eagerly too: named, not AddBackward0


def test_torchs_own_autograd_functions_are_not_named() -> None:
    # DDP's _DDPSink and FSDP2's RegisterPostBackwardFunction run eagerly around every captured
    # step, and their backward allocates nothing of note: naming them as the cause of a step
    # over its budget would send the user after the wrong code
    from torch.utils.checkpoint import CheckpointFunction

    w = torch.randn(32, 32, requires_grad=True)
    y = CheckpointFunction.apply(lambda t: t * 2, True, w + 1)
    found = uncaptured([y], [w])
    assert "CheckpointFunctionBackward" in found.kinds  # walked, and counted as eager
    assert found.functions == ()
