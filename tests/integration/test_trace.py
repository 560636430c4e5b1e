"""Joint graph -> solvers.Graph: what becomes a node, what is folded, what is pinned."""

from __future__ import annotations

import copy
import operator
from collections import Counter
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch.fx as fx  # noqa: E402
from torch import nn  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch._aot_autograd.utils import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import default_partition  # noqa: E402

from checkmate.codegen import generate, run_seconds  # noqa: E402
from checkmate.memory import measure_peak  # noqa: E402
from checkmate.ops import is_view_node  # noqa: E402
from checkmate.rng import replay_dropout_draws, replay_native_dropout  # noqa: E402
from checkmate.trace import SINK, WORKSPACE, JointGraph, build_graph, recompute_dropout_from_mask  # noqa: E402
from solvers.errors import ScheduleError  # noqa: E402
from solvers.schedule import keep_all_peak, schedule_from_order, simulate  # noqa: E402
from tests.integration import _models as M  # noqa: E402

pytestmark = pytest.mark.torch


def _joint(model: Any, *inputs: Any, **build: Any) -> tuple[fx.GraphModule, JointGraph]:
    """Capture the joint graph AOTAutograd builds for one training step of ``model``
    (``build``: keywords of :func:`build_graph`)."""
    captured: dict[str, Any] = {}
    # the models are nn.Sequential: every test compiling one shares its forward's code object,
    # whose compiled variants (8) other test files may have used up, which runs it eagerly
    torch._dynamo.reset()

    def partition(joint: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> Any:
        captured["jg"] = build_graph(joint, num_fwd_outputs, lambda nodes: [1.0] * len(nodes), **build)
        captured["gm"] = copy.deepcopy(joint)
        captured["num_fwd_outputs"] = num_fwd_outputs
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    backend = aot_autograd(
        fw_compiler=lambda g, _: make_boxed_func(g),
        bw_compiler=lambda g, _: make_boxed_func(g),
        partition_fn=partition,
    )
    out = torch.compile(model, backend=backend, dynamic=False)(*inputs)
    first = out if isinstance(out, torch.Tensor) else out[0]
    first.sum().backward()
    gm = captured["gm"]
    gm.meta["num_fwd_outputs"] = captured["num_fwd_outputs"]
    return gm, captured["jg"]


def _num_fwd(gm: fx.GraphModule) -> int:
    return int(gm.meta["num_fwd_outputs"])


def test_views_are_folded_and_placeholders_are_not_nodes() -> None:
    gm, jg = _joint(M.MLP(16, 2), torch.randn(8, 16))
    keys = set(jg.graph.ext_ids())
    for n in gm.graph.nodes:
        if is_view_node(n):  # aten.t of the weights, views of activations: never nodes
            assert n.name not in keys
        if n.op == "placeholder" and n.name.startswith("primals"):
            assert n.name not in keys and n.name not in jg.group
    tangents = [n for n in jg.graph.nodes if n.name.startswith("tangents")]
    assert tangents and all(t.backward and not t.recomputable for t in tangents)
    assert jg.graph.nodes[jg.sink].key == SINK
    # every forward node precedes every backward node
    bwd = jg.graph.backward_mask
    assert not bwd[: int(bwd.argmax())].any() and bwd[int(bwd.argmax()) :].all()


def test_view_output_shares_the_bytes_of_its_base() -> None:
    class ViewOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, x: Any) -> Any:
            h = self.lin(x).relu()
            return h.view(-1) + 0, h.t()  # an output that is a view of an activation

    _, jg = _joint(ViewOut(), torch.randn(8, 16))
    relu = next(n for n in jg.graph.nodes if n.op == "aten.relu.default")
    assert relu.mem == 8 * 16 * 4  # counted once although it is also an output's base
    assert not relu.recomputable  # held by the caller: computed once
    assert relu.id in jg.graph.preds[jg.sink]


def test_dropout_outputs_are_separate_fixed_nodes_in_the_forward() -> None:
    _, jg = _joint(M.TinyTransformer(32, 32, 1, p=0.1), torch.randint(0, 32, (2, 8)))
    drop = [n for n in jg.graph.nodes if n.op == "aten.native_dropout.default"]
    assert drop, "native_dropout should be in the joint graph"
    # output and mask are separate nodes (they die at different times), neither recomputable
    assert len(drop) == 2 * 3 and all(not n.recomputable and not n.backward for n in drop)
    assert {n.id for n in drop} <= jg.forward_required
    sizes = {n.mem for n in drop}
    assert any(4 * m in sizes for m in sizes), "the bool mask is a quarter of the float output"


def test_batchnorm_running_stats_are_held_not_its_output() -> None:
    _, jg = _joint(M.SmallCNN(4, 1), torch.randn(2, 3, 8, 8))
    bn = [n for n in jg.graph.nodes if n.op.startswith("aten._native_batch_norm_legit_functional")]
    big = [n for n in bn if n.mem == 2 * 4 * 8 * 8 * 4]  # the normalized activations
    small = [n for n in bn if n.mem == 4 * 4]  # running mean/var updates (forward outputs)
    assert big and all(n.recomputable for n in big)
    assert small and any(not n.recomputable for n in small)
    assert jg.mutated, "the running statistics are inputs the step mutates"


@pytest.mark.parametrize("make", [lambda: M.MLP(64, 3), lambda: M.TinyTransformer(64, 64, 1)])
def test_keep_all_plan_simulates_what_the_generated_step_measures(make: Any) -> None:
    """The keep-all schedule's simulated peak equals the measured peak of the generated
    forward+backward modules run on real tensors (both without the caller's own code)."""
    torch.manual_seed(0)
    model = make()
    x = torch.randn(128, 64) if isinstance(model, M.MLP) else torch.randint(0, 64, (8, 32))
    gm, jg = _joint(model, x)
    sched = schedule_from_order(jg.graph, range(jg.graph.n))
    mods = generate(gm, jg, sched)
    assert mods.recomputes == 0

    def real(v: Any) -> Any:  # values do not matter for memory; shapes and dtypes do
        if v.dtype.is_floating_point:
            return torch.randn(v.shape, dtype=v.dtype)
        return torch.randint(0, 2, v.shape, dtype=v.dtype)

    phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    primals = [real(p.meta["val"]) for p in phs if p.name.startswith("primals")]
    tangents = [real(p.meta["val"]) for p in phs if p.name.startswith("tangents")]
    n_out = jg.num_fwd_outputs

    def step() -> None:
        with torch.no_grad():
            outs = list(mods.forward(list(primals)))
            held = outs[:n_out]  # the caller holds the outputs to the end, as the sink does
            args = outs[n_out:] + [t.clone() for t in tangents]
            del outs  # the backward's boxed call frees each saved value after its last use
            grads = mods.backward(args)
            del held, grads

    step()
    measured = measure_peak(step)
    simulated = simulate(jg.graph, sched).peak
    assert simulated == keep_all_peak(jg.graph)
    assert abs(measured - simulated) <= 0.05 * simulated, (measured, simulated)


def test_dropout_output_becomes_recomputable_from_its_mask() -> None:
    gm, _ = _joint(M.TinyTransformer(32, 32, 1, p=0.1), torch.randint(0, 32, (2, 8)))
    assert recompute_dropout_from_mask(gm) == 3
    jg = build_graph(gm, _num_fwd(gm), lambda nodes: [1.0] * len(nodes))
    drop = [n for n in jg.graph.nodes if n.op == "aten.native_dropout.default"]
    redo = [n for n in jg.graph.nodes if n.op == "aten.native_dropout_backward.default" and not n.backward]
    assert len(drop) == 3 and all(not n.recomputable for n in drop)  # the masks: kept
    assert len(redo) == 3 and all(n.recomputable for n in redo)  # the outputs: recomputable
    # native_dropout still makes its output beside the mask, dropped at once: the mask's scratch
    ids = {n.name: n.id for n in jg.graph.nodes}
    for mask, out in zip(drop, redo):
        ws = jg.graph.nodes[ids[f"{mask.name}{WORKSPACE}"]]
        assert ws.mem == out.mem == 4 * mask.mem and ws.recomputable
    x = torch.randn(64, 33)
    out, mask = torch.ops.aten.native_dropout(x, 0.1, True)
    assert torch.equal(torch.ops.aten.native_dropout_backward(x, mask, 1 / 0.9), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_dropout_recomputed_from_its_mask_equals_eager_dropout_in_every_dtype(
    dtype: torch.dtype, p: float
) -> None:
    # eager's CPU dropout multiplies by a noise of the input's dtype, 1 / (1 - p) rounded to it
    # (bfloat16 at 0.1: 1.109375), and so does its gradient: the output rewritten from the mask
    # and the gradient AOTAutograd traced (native_dropout_backward) must scale so too, or a step
    # under torch.autocast("cpu") differs from eager's
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(64, 65, dtype=dtype)
    grad = g.placeholder("grad")
    drop = g.call_function(torch.ops.aten.native_dropout.default, (x, p, True))
    drop.meta["val"] = (torch.empty(64, 65, dtype=dtype), torch.empty(64, 65, dtype=torch.bool))
    out = g.call_function(operator.getitem, (drop, 0))
    out.meta["val"] = torch.empty(64, 65, dtype=dtype)
    mask = g.call_function(operator.getitem, (drop, 1))
    back = g.call_function(torch.ops.aten.native_dropout_backward.default, (grad, mask, 1.0 / (1.0 - p)))
    g.output((out, back))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert recompute_dropout_from_mask(gm) == 1
    xs, gs = ((torch.randn(64, 65) * 3).to(dtype) for _ in range(2))
    torch.manual_seed(3)
    got, got_grad = gm(xs, gs)
    leaf = xs.clone().requires_grad_()
    torch.manual_seed(3)
    want = torch.nn.functional.dropout(leaf, p, True)
    want.backward(gs)
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()
    assert leaf.grad is not None and torch.equal(got_grad, leaf.grad)


def test_a_replayed_dropout_mask_reads_the_generator_state_taken_before_it() -> None:
    """With its draws replayable (checkmate.rng), a dropout's mask is a recomputable node of
    the forward that reads a small, fixed state node; without, the mask is fixed."""
    gm, _ = _joint(M.TinyTransformer(32, 32, 1, p=0.1), torch.randint(0, 32, (2, 8)))
    recompute_dropout_from_mask(gm)
    assert replay_dropout_draws(gm) == 3
    assert replay_dropout_draws(gm) == 0  # done once
    jg = build_graph(gm, _num_fwd(gm), lambda nodes: [1.0] * len(nodes))
    drop = [n for n in jg.graph.nodes if n.op == "aten.native_dropout.default"]
    states = [n for n in jg.graph.nodes if n.op == "checkmate.rng_state.default"]
    assert len(drop) == len(states) == 3 and len(jg.replayed) == 3
    assert all(n.recomputable and not n.backward for n in drop)
    assert {n.id for n in drop} <= jg.forward_required  # first computed in the forward
    state_bytes = torch.get_rng_state().numel()
    assert all(not s.recomputable and s.mem == state_bytes for s in states)
    ids = {n.name: n.id for n in jg.graph.nodes}
    for mask in drop:
        op = jg.calls[mask.name][0]
        assert ids[jg.replayed[op]] in jg.graph.preds[mask.id]
    # the state precedes its dropout, which precedes the next state: the draws keep their order
    order = sorted([(s.id, "s") for s in states] + [(d.id, "d") for d in drop])
    assert [k for _, k in order] == ["s", "d"] * 3


def test_a_replayed_dropout_draws_what_it_drew_and_leaves_the_generator_alone() -> None:
    x = torch.randn(64, 33)
    torch.manual_seed(5)
    state = torch.ops.checkmate.rng_state(x)
    out, mask = torch.ops.aten.native_dropout(x, 0.3, True)
    after = torch.get_rng_state()
    torch.manual_seed(9)
    now = torch.get_rng_state()
    again_out, again_mask = replay_native_dropout(x, 0.3, True, state)
    assert torch.equal(again_mask, mask) and torch.equal(again_out, out)
    assert torch.equal(torch.get_rng_state(), now) and not torch.equal(now, after)


def test_a_dropout_kept_whole_hands_on_its_own_output_and_takes_no_generator_state() -> None:
    """Planned keep-all, no dropout is recomputed: each output is the one its dropout made
    (no second pass from the mask), no generator state is taken (none is replayed), and the
    step still computes what the joint graph computes, bit for bit, under the same seed."""
    torch.manual_seed(0)
    gm, _ = _joint(M.TinyTransformer(32, 32, 1, p=0.1), torch.randint(0, 32, (2, 8)))
    recompute_dropout_from_mask(gm)
    replay_dropout_draws(gm)
    jg = build_graph(gm, _num_fwd(gm), lambda nodes: [1.0] * len(nodes))
    assert len(jg.from_mask) == 3 and len(jg.replayed) == 3
    mods = generate(gm, jg, schedule_from_order(jg.graph, range(jg.graph.n)))
    ops = Counter(n.target for n in mods.forward.graph.nodes if n.op == "call_function")
    assert ops[torch.ops.aten.native_dropout.default] == 3
    assert ops[torch.ops.aten.native_dropout_backward.default] == 0
    assert ops[torch.ops.checkmate.rng_state.default] == 0
    assert mods.seconds == run_seconds(jg)  # the ops eager runs, each once: no overhead
    phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    vals = [
        torch.randn(p.meta["val"].shape) if p.meta["val"].dtype.is_floating_point
        else torch.randint(0, 32, p.meta["val"].shape)
        for p in phs
    ]  # fmt: skip
    primals = [v for p, v in zip(phs, vals) if p.name.startswith("primals")]
    tangents = [v for p, v in zip(phs, vals) if p.name.startswith("tangents")]
    with torch.no_grad():
        torch.manual_seed(7)
        outputs, expected = gm(list(primals), list(tangents))
        torch.manual_seed(7)
        outs = list(mods.forward(list(primals)))
        grads = list(mods.backward(outs[jg.num_fwd_outputs :] + list(tangents)))
    for got, want in zip(outs[: jg.num_fwd_outputs] + grads, list(outputs) + list(expected), strict=True):
        assert (got is None) == (want is None)
        assert got is None or torch.equal(got, want)


class _TanhGelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))


def test_ops_only_the_backward_reads_move_to_the_backward() -> None:
    # GPT-2's GELU written out: the derivative terms (3 * 0.044715 * x ** 2, ...) read
    # forward values only; AOTAutograd lists them in the forward, where they would be held
    # across the boundary
    model = nn.Sequential(nn.Linear(16, 64), _TanhGelu(), nn.Linear(64, 16))
    _, jg = _joint(model, torch.randn(32, 16))
    g = jg.graph
    tangent_free = np.ones(g.n, dtype=bool)  # does not depend on a tangent
    for v in range(g.n):
        if g.nodes[v].key.startswith("tangents") or any(not tangent_free[p] for p in g.preds[v]):
            tangent_free[v] = False
    moved = [v for v in range(g.n) if g.nodes[v].backward and tangent_free[v] and v != jg.sink]
    assert moved, "no derivative term was moved"
    first_bwd = int(np.flatnonzero(g.backward_mask)[0])
    for v in moved:
        assert v > first_bwd and all(g.nodes[s].backward for s in g.succs[v])
    # what stays in the forward is read there, pinned, or smaller than an input it frees
    for v in np.flatnonzero(~g.backward_mask).tolist():
        fwd_readers = [s for s in g.succs[v] if not g.nodes[s].backward]
        small = any(g.mem[v] < g.mem[p] for p in g.preds[v])
        assert fwd_readers or not g.nodes[v].recomputable or small, g.nodes[v].name


class _MaskedRelu(torch.autograd.Function):
    """ReLU whose backward reads the mask ``y <= 0`` of its output, as Inductor's
    decomposition of ``threshold_backward`` does."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = x.clamp_min(0)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return torch.where(y <= 0, 0.0, grad)


class _MaskedReluModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaskedRelu.apply(x)


def test_a_mask_of_a_value_the_backward_reads_anyway_moves_to_the_backward() -> None:
    # the mask is a quarter of ReLU's output, but that output is held into the backward for
    # the next layer's weight gradient anyway: the mask is computed there, not held across
    # the boundary (in Inductor's forward kernel beside ReLU, storing it cost 10x ReLU alone)
    model = nn.Sequential(nn.Linear(16, 64), _MaskedReluModule(), nn.Linear(64, 16))
    _, jg = _joint(model, torch.randn(32, 16))
    g = jg.graph
    masks = [v for v in range(g.n) if g.nodes[v].op.startswith("aten.le")]
    assert masks, [g.nodes[v].op for v in range(g.n)]
    first_bwd = int(np.flatnonzero(g.backward_mask)[0])
    for v in masks:
        assert g.nodes[v].backward and v > first_bwd, "the mask is held across the boundary"
        (relu,) = g.preds[v]
        assert g.mem[v] < g.mem[relu]
        assert any(g.nodes[s].backward and s != v for s in g.succs[relu]), "ReLU's output crosses anyway"


class _ReluThenPool(nn.Module):
    """A CNN's last ReLU: only a mean reads its output, and a mean's backward reads no input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MaskedRelu.apply(self.fc(x)).mean(-1)


@pytest.mark.parametrize("late_masks", [False, True])
def test_a_mask_only_the_backward_reads_moves_there_for_inductors_cpu_code(late_masks: bool) -> None:
    # nothing else holds the ReLU's output into the backward: by bytes the mask (a quarter
    # of it) is held from the forward; Inductor's C++ code stores a bool 20x slower than a
    # float, so for it the mask is computed in the backward from the ReLU's output
    _, jg = _joint(_ReluThenPool(), torch.randn(32, 16), late_masks=late_masks)
    g = jg.graph
    (mask,) = [v for v in range(g.n) if g.nodes[v].op.startswith("aten.le")]
    (relu,) = g.preds[mask]
    assert g.mem[mask] < g.mem[relu]
    assert not any(g.nodes[s].backward and s != mask for s in g.succs[relu]), "the ReLU's output crosses"
    assert g.nodes[mask].backward is late_masks


class _TiedLM(nn.Module):
    """Embedding and LM head sharing one weight, as GPT-2 does."""

    def __init__(self, vocab: int = 512, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mid = nn.Linear(d, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.emb(idx)))
        return (h @ self.emb.weight.t()).logsumexp(-1)


def test_a_backward_op_larger_than_its_inputs_runs_right_before_its_reader() -> None:
    # the head's weight gradient (vocab x d) is listed first in the backward and read last
    # (added to the embedding's gradient): held in between, it would set the peak (with
    # fewer tokens than the width, it is larger than the logits' gradient it is made from)
    vocab, d = 512, 64
    _, jg = _joint(_TiedLM(vocab, d), torch.randint(0, vocab, (2, 4)))
    g = jg.graph
    grads = [v for v in range(g.n) if g.nodes[v].backward and g.mem[v] == vocab * d * 4 and g.preds[v]]
    head = next(v for v in grads if g.nodes[v].op.startswith("aten.mm"))
    reader = min(g.succs[head])
    ancestors = set()
    stack = [reader]
    while stack:
        for p in g.preds[stack.pop()]:
            if p not in ancestors:
                ancestors.add(p)
                stack.append(p)
    assert all(w in ancestors for w in range(head + 1, reader)), "unrelated ops run between"
    assert g.mem[head] > sum(g.mem[p] for p in g.preds[head])


def test_tied_weight_gradient_sum_is_added_in_place_bit_for_bit() -> None:
    # the embedding's gradient and the head's are summed last; the sum is done in place
    # into the embedding's (read by nothing else): two vocab x d tensors live, not three,
    # and every gradient equals the functional joint graph's bit for bit
    vocab, d = 512, 64
    torch.manual_seed(0)
    gm, jg = _joint(_TiedLM(vocab, d), torch.randint(0, vocab, (2, 4)))
    assert len(jg.inplace) == 1
    ((addend, add),) = jg.inplace.items()
    by_name = {n.name: n for n in gm.graph.nodes}
    assert by_name[addend].target is torch.ops.aten.embedding_dense_backward.default
    assert jg.group[add] == jg.group[addend]
    g = jg.graph
    big = [v for v in range(g.n) if g.mem[v] == vocab * d * 4]
    assert len(big) == 2, [g.nodes[v].name for v in big]  # head grad, embedding grad (+ sum)
    sched = schedule_from_order(g, range(g.n))
    assert simulate(g, sched).peak < 3 * vocab * d * 4
    mods = generate(gm, jg, sched)
    assert any(n.target is torch.ops.aten.add_.Tensor for n in mods.backward.graph.nodes)

    phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    vals = [
        torch.randn(p.meta["val"].shape) if p.meta["val"].dtype.is_floating_point
        else torch.randint(0, vocab, p.meta["val"].shape)
        for p in phs
    ]  # fmt: skip
    primals = [v for p, v in zip(phs, vals) if p.name.startswith("primals")]
    tangents = [v for p, v in zip(phs, vals) if p.name.startswith("tangents")]
    with torch.no_grad():
        _, expected = gm(list(primals), list(tangents))  # (forward outputs, gradients)
        outs = list(mods.forward(list(primals)))
        grads = list(mods.backward(outs[jg.num_fwd_outputs :] + list(tangents)))

        def step() -> None:
            o = list(mods.forward(list(primals)))
            held = o[: jg.num_fwd_outputs]
            args = o[jg.num_fwd_outputs :] + [t.clone() for t in tangents]
            del o
            res = mods.backward(args)
            del held, res

        measured = measure_peak(step)
    assert len(grads) == len(expected)
    for got, want in zip(grads, expected):
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got, want)
    simulated = simulate(g, sched).peak
    assert abs(measured - simulated) <= 0.05 * simulated, (measured, simulated)


def test_the_forward_saves_each_value_once_not_each_view_of_it() -> None:
    # BatchNorm's statistics reach its backward through unsqueeze views: the backward loads
    # each value once and recreates the views, as PyTorch's partitioner does
    torch.manual_seed(0)
    gm, jg = _joint(M.SmallCNN(4, 2), torch.randn(2, 3, 8, 8))
    mods = generate(gm, jg, schedule_from_order(jg.graph, range(jg.graph.n)))
    by_name = {n.name: n for n in gm.graph.nodes}
    views = [
        s
        for s in mods.saved
        if is_view_node(by_name[s]) and by_name[s].all_input_nodes[0].op != "placeholder"
    ]
    assert not views, views
    groups = [jg.group[s] for s in mods.saved if s in jg.group]
    assert len(groups) == len(set(groups)), "one saved tensor per stored value"
    assert any(is_view_node(n) for n in mods.backward.graph.nodes), "views are recreated in the backward"


def test_a_keep_all_plan_runs_each_forward_op_once() -> None:
    # BatchNorm's running statistics may be computed only once, so when the op runs the
    # forward takes all five of its outputs; its normalized output, scheduled right after the
    # statistics, ran the op a second time before: every BatchNorm twice, a ResNet-18-like
    # CNN's keep-all step 14% slower than aot_eager's (the plan counted one run)
    torch.manual_seed(0)
    gm, jg = _joint(M.SmallCNN(4, 2), torch.randn(2, 3, 8, 8))
    mods = generate(gm, jg, schedule_from_order(jg.graph, range(jg.graph.n)))

    def runs(graph: fx.Graph) -> Counter[str]:
        return Counter(
            str(n.target)
            for n in graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem and not is_view_node(n)
        )

    bn = "aten._native_batch_norm_legit_functional.default"
    joint = runs(gm.graph)
    assert joint[bn] >= 2, joint
    got = runs(mods.forward.graph)
    assert got[bn] == joint[bn], (got, joint)
    assert all(n <= joint[k] for k, n in got.items()), (got, joint)
    # the cost each plan reports (PlanRecord.overhead) is of these runs: every op once, where
    # the graph model costs a BatchNorm once per output (every node costs 1 here)
    assert mods.seconds == run_seconds(jg) < jg.graph.total_cost, (mods.seconds, jg.graph.total_cost)


def test_a_convolutions_gradients_each_cost_their_share_and_the_op_once_together() -> None:
    # a convolution_backward's input and weight gradients are two convolutions (measured on
    # CPU: the two asked alone took 0.81-1.05x the two asked together). Each output node costing
    # the whole op counted the op twice in the step, and a weight gradient recomputed alone
    # as a whole op
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1, bias=False),
        nn.ReLU(),
    )
    gm, jg = _joint(model, torch.randn(2, 3, 8, 8))  # every op costs 1
    g = jg.graph
    cb = "aten.convolution_backward.default"
    outs = [i for i, nd in enumerate(g.nodes) if nd.op == cb]
    shared = [i for i in outs if float(g.cost[i]) < 1.0]
    # the first convolution's input needs no gradient: its one output is the whole op; the
    # second's two gradients take half each (equal FLOPs)
    assert len(outs) == 3 and len(shared) == 2, [(g.nodes[i].name, float(g.cost[i])) for i in outs]
    assert [float(g.cost[i]) for i in shared] == [0.5, 0.5]
    assert len(jg.split) == 1
    keep_all = generate(gm, jg, schedule_from_order(g, range(g.n)))
    assert keep_all.seconds == run_seconds(jg) == g.total_cost - 1  # the ReLU's mask: 2 outputs of 1
    # the weight gradient made again alone, right before the step ends: half an op more, and
    # that run asks the op for the weight gradient only
    weight = next(i for i in shared if jg.calls[g.nodes[i].name][1] == 1)  # output 1: grad_weight
    again = generate(gm, jg, schedule_from_order(g, [*range(g.n - 1), weight, g.n - 1]))
    assert again.seconds == keep_all.seconds + 0.5
    masks = [
        [bool(m) for m in n.args[10]]
        for n in again.backward.graph.nodes
        if n.op == "call_function" and str(n.target) == cb
    ]
    assert sorted(masks) == sorted([[False, True, False], [True, True, False], [False, True, False]]), masks


class _Attention(nn.Module):
    """One scaled-dot-product attention between two projections (the kernel every
    transformers model runs by default)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.qkv = nn.Linear(32, 96)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(4, 16, 3, 2, 16).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(4, 16, 32))


@pytest.mark.parametrize("p", [0.0, 0.1])
def test_attention_without_dropout_may_be_recomputed(p: float) -> None:
    # its kernels are tagged random for their dropout, also at dropout_p=0.0: taken as random,
    # every attention output was held from the forward to the backward at any budget
    torch.manual_seed(0)
    _, jg = _joint(_Attention(p), torch.randn(4, 16, 32))
    ops = [(n.op, n.recomputable) for n in jg.graph.nodes if not n.backward]
    if p == 0.0:
        attn = [r for op, r in ops if "scaled_dot_product" in op]
        assert attn and all(attn), ops
    else:  # on the CPU attention with dropout runs as its math, whose draw stays random
        draws = [r for op, r in ops if "dropout" in op or "bernoulli" in op or "rand" in op]
        assert draws and not any(draws), ops


def test_a_random_op_is_deterministic_only_where_its_draw_probability_is_zero() -> None:
    from checkmate.ops import is_random, is_random_node

    aten = torch.ops.aten
    g = fx.Graph()
    x = g.placeholder("x")

    def call(target: Any, *args: Any, **kwargs: Any) -> bool:
        return is_random_node(g.call_function(target, (x, *args), kwargs))

    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert not call(sdpa, x, x)  # dropout_p left at its default, 0.0
    assert not call(sdpa, x, x, 0.0)
    assert call(sdpa, x, x, 0.1)
    assert call(sdpa, x, x, dropout_p=0.1)  # passed by name
    assert not call(aten.native_dropout.default, 0.0, True)
    assert call(aten.native_dropout.default, 0.5, True)
    assert call(aten.bernoulli.p, 0.5)
    assert call(aten.rand_like.default)  # no probability: random
    assert not call(aten.mul.Tensor, x)  # not tagged random
    # tagged random, but replays the draw named by the philox seed and offset it is passed
    assert is_random(aten._scaled_dot_product_efficient_attention_backward.default)
    assert not call(aten._scaled_dot_product_efficient_attention_backward.default, x, x, x, x, x, True, 0.1)
    assert not call(aten._scaled_dot_product_cudnn_attention_backward.default, x, x, x, x, x, x, x)


def test_only_flash_and_efficient_attention_read_their_philox_arguments_on_the_host() -> None:
    # flash and memory-efficient attention keep the philox seed and offset on the CPU (given GPU
    # tensors their CUDA backward segfaults); cuDNN attention's backward refuses CPU ones
    from checkmate.ops import host_arguments

    aten = torch.ops.aten
    philox = frozenset({"philox_seed", "philox_offset"})
    assert host_arguments(aten._scaled_dot_product_efficient_attention_backward.default) == philox
    assert host_arguments(aten._scaled_dot_product_flash_attention_backward.default) == philox
    assert host_arguments(aten._efficient_attention_backward.default) == philox
    assert host_arguments(aten._scaled_dot_product_cudnn_attention_backward.default) == frozenset()
    assert host_arguments(aten.mm.default) == frozenset()


@pytest.mark.parametrize("norm", ["layer", "batch", "group"])
def test_traced_norm_statistics_get_the_dtype_the_cpu_kernel_returns(norm: str) -> None:
    # under torch.autocast("cpu") a norm reads a bfloat16 input and float32 weights; its kernel
    # returns float32 statistics, which torch 2.13's fake-tensor rules trace as bfloat16
    from torch.fx.experimental.proxy_tensor import make_fx

    from checkmate.trace import correct_traced_dtypes

    aten = torch.ops.aten
    x, w, b = torch.randn(2, 4, 6, 6, dtype=torch.bfloat16), torch.ones(4), torch.zeros(4)

    def f(x: Any, w: Any, b: Any) -> Any:
        if norm == "layer":
            out, mean, rstd = aten.native_layer_norm(x, [6, 6], w.new_ones(6, 6), None, 1e-5)
        elif norm == "batch":
            out, mean, rstd = aten.native_batch_norm(x, w, b, None, None, True, 0.1, 1e-5)
        else:
            out, mean, rstd = aten.native_group_norm(x, w, b, 2, 4, 36, 2, 1e-5)
        return out, mean.detach(), rstd

    real = f(x, w, b)
    gm = make_fx(f, tracing_mode="fake")(x, w, b)
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert correct_traced_dtypes(gm) >= 2
    assert [o.meta["val"].dtype for o in outs] == [t.dtype for t in real]
    assert [o.meta["val"].shape for o in outs] == [t.shape for t in real]
    assert correct_traced_dtypes(gm) == 0  # nothing left to correct


class _TwoConvs(nn.Module):
    """Two convolutions with a ReLU between, and a 2x2 max-pool after it with ``pool``."""

    def __init__(self, mid: int, out: int, pool: bool = False) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, mid, 3, padding=1, bias=False)
        self.c2 = nn.Conv2d(mid, out, 3, padding=1, bias=False)
        self.pool = pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))
        return self.c2(nn.functional.max_pool2d(h, 2) if self.pool else h)


class _OutputBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The bytes of the tensors each call of ``op`` returns, in call order."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op
        self.runs: list[int] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is self.op:
            self.runs.append(sum(t.untyped_storage().nbytes() for t in out if t is not None))
        return out


def _run_joint(gm: fx.GraphModule, jg: JointGraph, order: list[int], op: Any) -> tuple[list[int], bool]:
    """Run the step ``order`` plans, from random inputs: the bytes each call of ``op`` in its
    backward returned, and whether its gradients equal the keep-all plan's bit for bit."""
    mods = generate(gm, jg, schedule_from_order(jg.graph, order))
    keep_all = generate(gm, jg, schedule_from_order(jg.graph, range(jg.graph.n)))
    phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    primals = [torch.randn(p.meta["val"].shape) for p in phs if p.name.startswith("primals")]
    tangents = [torch.randn(p.meta["val"].shape) for p in phs if p.name.startswith("tangents")]
    with torch.no_grad():
        expected = keep_all.backward(list(keep_all.forward(list(primals)))[jg.num_fwd_outputs :] + tangents)
        saved = list(mods.forward(list(primals)))[jg.num_fwd_outputs :]
        with _OutputBytes(op) as seen:
            grads = mods.backward(saved + tangents)
    same = len(grads) == len(expected) and all(
        (got is None and want is None) or (got is not None and want is not None and torch.equal(got, want))
        for got, want in zip(grads, expected)
    )
    return seen.runs, same


def test_an_output_recomputed_alone_allocates_only_what_the_plan_counts() -> None:
    # The second convolution's weight gradient is recomputed at the end, alone: each output
    # of convolution_backward is a node of its own, so the plan counts its 4.5 KB there. Run
    # with the traced output mask, that run also made the 512 KB input gradient the plan had
    # consumed already (a DenseNet-like CNN at its least peak measured 1.07x it that way).
    torch.manual_seed(0)
    gm, jg = _joint(_TwoConvs(32, 4), torch.randn(4, 3, 32, 32))
    g = jg.graph
    ids = {nd.name: nd.id for nd in g.nodes}
    conv2 = {name for name, (call, _) in jg.calls.items() if call == "convolution_backward"}
    (conv1,) = {name for name, (call, _) in jg.calls.items() if call == "convolution_backward_1"}
    grad_in, grad_w = sorted(conv2, key=lambda name: jg.calls[name][1])
    assert g.mem[ids[grad_in]] == 4 * 32 * 32 * 32 * 4 and g.mem[ids[grad_w]] == 4 * 32 * 3 * 3 * 4
    late = ids[grad_w]
    order = [i for i in range(g.n - 1) if i != late] + [late, g.n - 1]
    runs, same = _run_joint(gm, jg, order, torch.ops.aten.convolution_backward.default)
    # conv2 for the input gradient, conv1 for its weight's, conv2 again for its weight's
    assert runs == [g.mem[ids[grad_in]], g.mem[ids[conv1]], g.mem[late]]
    assert same


def _pooled_joint() -> tuple[fx.GraphModule, JointGraph, dict[str, int], str, str]:
    """The joint graph of two convolutions with a max-pool between, its node ids by name, and
    the names of the pool's output and indices nodes."""
    torch.manual_seed(0)
    gm, jg = _joint(_TwoConvs(8, 8, pool=True), torch.randn(4, 3, 32, 32))
    ids = {nd.name: nd.id for nd in jg.graph.nodes}
    (out, idx) = sorted(
        (name for name, (call, _) in jg.calls.items() if call == "max_pool2d_with_indices"),
        key=lambda name: jg.calls[name][1],
    )
    return gm, jg, ids, out, idx


def test_an_output_recomputed_alone_reads_the_outputs_its_run_makes_again() -> None:
    # The max-pool's indices, recomputed alone at the backward's start, come with the pool's
    # output made again. The indices read the output (an edge of the graph model only), so
    # the plan holds the output there and counts it once; codegen hands the run's copy to
    # the readers after it, and the copy the forward saved dies unread. Taken from the
    # traced run instead, the saved copy lived on beside the new one, which the plan did not
    # count.
    gm, jg, ids, out, idx = _pooled_joint()
    g = jg.graph
    assert ids[out] in g.preds[ids[idx]]
    start = next(i for i in range(g.n) if g.nodes[i].backward) + 1
    order = [*range(start), ids[idx], *range(start, g.n)]
    with pytest.raises(ScheduleError, match="not resident"):  # the output is read: held, or made first
        simulate(g, [("compute", i) for i in range(start) if i != ids[out]] + [("compute", ids[idx])])
    runs, same = _run_joint(gm, jg, order, torch.ops.aten.max_pool2d_with_indices.default)
    assert runs == [g.mem[ids[out]] + g.mem[ids[idx]]]
    assert same
    bwd = generate(gm, jg, schedule_from_order(g, order)).backward.graph
    pool = next(n for n in bwd.nodes if n.target is torch.ops.aten.max_pool2d_with_indices.default)
    conv = next(n for n in bwd.nodes if n.target is torch.ops.aten.convolution_backward.default)
    read = conv.args[1]  # the second convolution's input: the pool's output
    assert isinstance(read, fx.Node) and read.target is operator.getitem and read.args == (pool, 0)


def test_outputs_an_op_makes_beside_the_one_recomputed_count_as_its_scratch() -> None:
    # max_pool2d_with_indices has no output mask: recomputing its output for the backward
    # (its indices kept) makes the indices again, twice the output's bytes, dropped at once.
    # They are scratch of the output's node; computed together, each is counted once
    gm, jg, ids, out, idx = _pooled_joint()
    g = jg.graph
    ws = ids[f"{out}{WORKSPACE}"]
    assert g.mem[ws] == g.mem[ids[idx]] == 2 * g.mem[ids[out]]
    assert f"{idx}{WORKSPACE}" not in ids  # nothing after the indices
    # keep-all: the run's bytes are counted once, at its first output
    keep_all = schedule_from_order(g, range(g.n))
    timeline = simulate(g, keep_all).timeline
    step = {i: k for k, (op, i) in enumerate(keep_all.steps) if op == "compute"}
    assert timeline[step[ids[out]]] - timeline[step[ws] - 1] == g.mem[ids[out]] + g.mem[ids[idx]]
    assert timeline[step[ids[idx]]] <= timeline[step[ids[out]]]
    # the backward recomputes the output alone, right after its first node (the tangent)
    start = next(i for i in range(g.n) if g.nodes[i].backward) + 1
    order = [*range(start), ws, ids[out], *range(start, g.n)]
    runs, same = _run_joint(gm, jg, order, torch.ops.aten.max_pool2d_with_indices.default)
    assert runs == [g.mem[ids[out]] + g.mem[ws]]
    assert same
