"""Joint forward+backward fx graph -> :class:`solvers.Graph`, plus the way back.

AOTAutograd hands the partitioner a functionalized joint graph: placeholders ``primals_*``
(parameters, buffers, user inputs) and ``tangents_*`` (gradients of the outputs), then the
forward ops, then the backward ops, and one output node listing the forward outputs
(mutated buffers first) followed by the gradients of the primals.

Modelling choices (the simulator's memory must match what the runtime allocates):

- One graph node per op that allocates. Views and aliases (``view``, ``t``, ``expand``,
  ``detach``, ``_unsafe_view``, ...) share their base's storage: they are folded into the node
  that owns the base, so their bytes count once and a live view keeps its base alive. Views
  of placeholders belong to no node: they are free and recreated wherever they are read.
- A multi-output op (``native_layer_norm``, ``native_batch_norm``, ``native_dropout``) is
  one node per output it is read through (its ``getitem`` nodes), each holding that output's
  bytes, reading the op's inputs and costing the whole op: outputs die independently (a
  BatchNorm's small running statistics are held to the backward's start, its large output is
  not), and recomputing any one output runs the op again. Codegen runs the op once for
  outputs computed one after another. (The tuple is not a node: a plan could otherwise keep
  it resident and "recompute" an output from it for free, which the runtime cannot honour.)
  A run that gives fewer outputs than the op makes: an op with an output mask
  (``convolution_backward``, the norms' backwards) is asked for those only; for the others,
  each output reads the outputs listed before it (smallest first), which the run then makes
  again in their place (:func:`_sibling_reads`), and the outputs listed after it and those no
  node stands for (dropout's output) count as its scratch (:func:`_run_bytes`).
  Where a masked op's work separates by output (``convolution_backward``: its input and
  weight gradients are two convolutions), each output costs its share of the op instead
  (:func:`_cost_shares`): recomputing a weight gradient alone runs half the op, and the
  outputs computed together still cost the op once.
- Primals (parameters, buffers, inputs) and constants (``get_attr`` nodes) are not nodes:
  always resident, outside the budget. Tangents are: autograd allocates them when the backward starts; each is a
  zero-cost, non-recomputable backward node listed before the backward ops.
- Random ops and ops that mutate an input are not recomputable, but dropout's mask, whose
  draws are replayed from the generator state taken before it (:mod:`checkmate.rng`): its
  first computation is still in the forward, in order. Forward outputs are not
  recomputable either: they are computed once in the forward and held by the caller.
- An op that allocates scratch space while it runs (CPU convolutions need 1-3x their
  output) gets a zero-cost node of that size computed right before it and read by it.
- A final zero-cost sink node reads every output (forward outputs and gradients), so the
  simulator keeps them live until the step ends, as the caller does.
- A gradient that is the sum of two backward values (a tied weight: a language model's
  embedding and output head) is added in place into the addend listed last, when that
  addend is read by nothing else (:func:`checkmate.placement.accumulates_into`), as eager autograd
  accumulates it: the sum is folded into that addend's node, which reads the other addend
  too, so the step holds two vocabulary-sized tensors, not three. Addition commutes, so
  the sum is bitwise the one the functional graph computes.
- Fused ops (only when planning for Inductor, ``fuse``): Inductor compiles pointwise code
  into the kernel that reads it, so such an op's result never reaches memory, and a
  recompute costs its memory traffic inside the reader's loop. An op Inductor generates
  code for, read by at most four ops that are all generated code too (a library kernel
  such as a matrix product reads a buffer), that is not an output, reads no mutated state,
  and whose inputs hold no more bytes than its output, is therefore no node: like a view
  of a placeholder it is recreated inside every reader, which reads its inputs instead and
  pays its cost (the partitioner in ``torch/_functorch/partitioners.py`` likewise
  recomputes fusible ops rather than saving them). The plan cannot keep such an op, which
  costs no memory: keeping its inputs holds no more. A matrix product read only by an
  addition of a tensor of its dtype is folded into that addition as well: Inductor runs
  the two as one ``addmm`` where the addition is (:func:`into_addmm`), so the product's
  inputs live until then.
- Backward nodes are the ops that depend on a tangent, and the ops that only the backward
  reads (moved to right before their first reader; see :func:`checkmate.placement.backward_only`); node ids
  list every forward node before every backward node, so a schedule splits into a forward
  and a backward part at its first backward compute. Backward ops larger than their
  inputs also run right before their first reader (:func:`checkmate.placement.deferrable`).
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx

from checkmate.eager import real_like, real_tensors
from checkmate.flops import output_shares
from checkmate.ops import (
    is_mutation,
    is_random_node,
    is_view_node,
    output_mask,
    through_views,
    writes_input,
)
from checkmate.placement import accumulates_into, backward_only, deferrable, lazy_order
from checkmate.rng import RNG_STATE
from solvers.errors import TraceError
from solvers.graph import Graph

__all__ = [
    "JointGraph",
    "build_graph",
    "correct_traced_dtypes",
    "recompute_dropout_from_mask",
    "SINK",
    "WORKSPACE",
]

#: key of the sink node that reads every output of the step
SINK = "__outputs__"
#: suffix of the key of an op's scratch-space node
WORKSPACE = ".workspace"


@dataclass(frozen=True)
class JointGraph:
    """The planner's view of one joint graph, with the mapping back to its fx nodes.

    Attributes:
        graph: the frozen graph the strategies plan (node keys are fx node names; the last
            node is the sink :data:`SINK`).
        group: fx node name -> graph node id owning its storage (views included; absent for
            placeholders and views of placeholders).
        members: per graph node, the fx node names it computes (its op; views and
            ``getitem`` nodes are recreated on demand and not listed).
        forward_required: graph node ids that must run in the forward (outputs, mutations).
        num_fwd_outputs: how many of the joint graph's outputs belong to the forward.
        calls: for a node that is one output of a multi-output op, its ``getitem`` name ->
            (the op's fx node name, the output's index).
        mutated: names of the primals the step mutates (BatchNorm running statistics).
        inplace: fx node name of an addend -> the gradient ``add`` computed in place into it
            right after it (see :func:`checkmate.placement.accumulates_into`).
        folded: names of the fused ops folded into their readers, and of views of them
            (codegen recomputes them inside each reader, never keeps them).
        unread: names of the tangents planned as no bytes: gradients of outputs beside a
            loss, which the step is expected not to give (:mod:`checkmate.tangents`).
        beside_loss: graph id of the value of each of those outputs (a language model's
            logits) -> its size and dtype (to find it among a call's outputs). Each is read by
            the loss's gradient, so that it lives until the backward starts, and by the sink,
            as a loop holding its outputs through the backward holds them. The planner adds
            the outputs a loss outside the module reads (:attr:`read_outside`) where it may
            drop them: the machinery that drops and watches them is the same.
        read_outside: graph id of the value of each forward output whose gradient is read, in
            a step that returns no loss (a loss outside the module reads them: a classifier's
            or a language model's logits) -> its size and dtype. A loop computing that loss
            inline (``F.cross_entropy(model(x), y)``) drops them before the backward starts;
            the planner may count them among :attr:`beside_loss` (:meth:`Planner.plan`).
        dropped: the sizes and dtypes of those outputs that :func:`drop_outputs_beside_loss`
            dropped when the backward starts, as a loop that keeps only the loss does.
        replayed: fx name of each dropout whose mask may be recomputed -> the name of the
            ``checkmate::rng_state`` node it replays its draws from (:mod:`checkmate.rng`).
            Its first computation, in the forward, draws as eager does; each recompute
            replays the draw (:func:`checkmate.rng.replay_native_dropout`).
        split: fx names of the multi-output ops whose outputs each cost their share of the
            op (:func:`_cost_shares`), not the whole op: a run costs the outputs it makes.
        from_mask: fx name of each dropout output recomputed from its mask
            (:func:`recompute_dropout_from_mask`) -> the name of its dropout. Eager PyTorch
            never runs that op: a first
            computation right after its dropout takes the dropout's own output instead
            (:mod:`checkmate.codegen`), and :func:`checkmate.codegen.run_seconds` leaves it out.
    """

    graph: Graph
    group: dict[str, int]
    members: tuple[tuple[str, ...], ...]
    forward_required: frozenset[int]
    num_fwd_outputs: int
    calls: dict[str, tuple[str, Any]] = field(default_factory=dict)
    mutated: frozenset[str] = frozenset()
    inplace: dict[str, str] = field(default_factory=dict)
    folded: frozenset[str] = frozenset()
    unread: frozenset[str] = frozenset()
    beside_loss: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    read_outside: dict[int, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    dropped: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset()
    replayed: dict[str, str] = field(default_factory=dict)
    split: frozenset[str] = frozenset()
    from_mask: dict[str, str] = field(default_factory=dict)

    @property
    def sink(self) -> int:
        return self.graph.n - 1


def drop_outputs_beside_loss(
    jg: JointGraph, keep: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset()
) -> JointGraph:
    """``jg`` with the outputs beside its loss (:attr:`JointGraph.beside_loss`), but those of
    a size and dtype in ``keep``, dropped when the backward starts instead of held to its
    end: what a loop that keeps only the loss (``model(**batch).loss.backward()``) holds.
    Those a loss outside the module reads (:attr:`JointGraph.read_outside`) live to the
    forward's end, read by its last node: the loss that reads them is memory outside the
    module, at the forward/backward boundary (room guessed, then measured), and a loop
    computing it inline lets them go with it (a cross-entropy saves its log-softmax, not its
    input), before the backward makes their gradients."""
    drop = {i for i, key in jg.beside_loss.items() if key not in keep}
    g = jg.graph
    edges = tuple((u, v) for u, v in g.edges if not (v == g.n - 1 and u in drop))
    last, present = g.first_backward - 1, set(edges)
    edges += tuple(
        (i, last) for i in sorted(drop) if i in jg.read_outside and i < last and (i, last) not in present
    )
    graph = Graph(nodes=g.nodes, edges=edges, name=g.name, meta=g.meta)
    return replace(jg, graph=graph, dropped=frozenset(jg.beside_loss[i] for i in drop))


def _key(n: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """A traced value's size and dtype."""
    v = n.meta.get("val")
    return (tuple(int(d) for d in v.shape), v.dtype) if isinstance(v, torch.Tensor) else None


def _beside_loss(
    fwd_outputs: Sequence[fx.Node],
    tangents: Iterable[fx.Node],
    unread: frozenset[str],
    base: dict[fx.Node, Any],
) -> dict[fx.Node, tuple[tuple[int, ...], torch.dtype]]:
    """The owners of the forward outputs whose gradients are ``unread`` -> the output's size
    and dtype. Outputs and gradients are matched by size and dtype: a size and dtype that
    only unread gradients have, as many as the outputs of it. An owner another output shares
    (a view of it, or one of another size) is not one of them."""
    wanted: dict[Any, int] = {}
    counted: set[Any] = set()
    for t in tangents:
        if t.name in unread:
            wanted[_key(t)] = wanted.get(_key(t), 0) + 1
        else:
            counted.add(_key(t))
    by_key: dict[Any, list[fx.Node]] = {}
    for o in fwd_outputs:
        by_key.setdefault(_key(o), []).append(o)
    keys = {
        k for k, n in wanted.items() if k is not None and k not in counted and len(by_key.get(k, ())) == n
    }
    chosen = {o: k for k in keys for o in by_key[k]}
    owners: dict[fx.Node, Any] = {}
    for o in fwd_outputs:
        b = base.get(o)
        if b is None:
            continue
        if o not in chosen or owners.get(b, chosen[o]) != chosen[o]:
            owners[b] = None  # shared with an output that is not beside the loss, or of another size
        elif b not in owners:
            owners[b] = chosen[o]
    return {b: k for b, k in owners.items() if k is not None}


def _siblings_last(
    ordered: list[fx.Node], call_of: Mapping[fx.Node, fx.Node], mem: Mapping[fx.Node, int]
) -> list[fx.Node]:
    """``ordered`` with each block of consecutive outputs of one op sorted by size, the
    largest last (see :func:`_run_bytes`: an output recomputed alone counts those after it).
    They read the same inputs and not each other, so any order of a block is topological."""
    out = list(ordered)
    k = 0
    while k < len(out):
        call = call_of.get(out[k])
        end = k + 1
        while call is not None and end < len(out) and call_of.get(out[end]) is call:
            end += 1
        if end - k > 1:
            out[k:end] = sorted(out[k:end], key=lambda o: mem[o])
        k = end
    return out


def _cost_shares(ordered: Sequence[fx.Node], call_of: Mapping[fx.Node, fx.Node]) -> dict[fx.Node, float]:
    """Each output of a masked op whose work separates by output (:func:`checkmate.flops.output_shares`)
    -> its share of the op's cost. Codegen asks each run for the outputs the plan takes only
    (:meth:`checkmate.codegen._Emitter.finish`), so a run costs the shares of those: a weight
    gradient recomputed alone half a ``convolution_backward``, not all of it."""
    outs: dict[fx.Node, list[fx.Node]] = {}
    for o in ordered:
        call = call_of.get(o)
        if call is not None:
            outs.setdefault(call, []).append(o)
    shares: dict[fx.Node, float] = {}
    for call, taken in outs.items():
        found = output_mask(call.target)
        if found is None:
            continue
        got = output_shares(call, found[0], [int(o.args[1]) for o in taken])  # type: ignore[arg-type]
        if got is not None:
            shares.update({o: got[int(o.args[1])] for o in taken})  # type: ignore[arg-type]
    return shares


def _sibling_reads(
    ordered: Sequence[fx.Node], call_of: Mapping[fx.Node, fx.Node], fixed: Set[fx.Node]
) -> list[tuple[fx.Node, fx.Node]]:
    """Pairs ``(j, k)``: output ``k`` of an op without an output mask reads its sibling ``j``
    listed before it, where ``j`` may be recomputed (an edge of the graph model only).

    A run of such an op makes every output, whichever the plan asked for. Computed together,
    in order, its outputs are counted each as its own node; computed for ``k`` alone, the run
    makes ``j`` again beside the copy the plan may hold. With ``j`` an input of ``k``, a plan
    computes ``k`` only where ``j`` is resident, and codegen takes ``j`` from that run in place
    of the copy held (:meth:`checkmate.codegen._Emitter.compute`): bitwise the same value, and
    the older copy dies at its last read before the run. The run then allocates what the plan
    counts: ``j`` (resident), ``k``, and the outputs after ``k`` (its scratch, :func:`_run_bytes`).
    Outputs that may not be recomputed (an op's output the caller holds) are counted as
    scratch instead: an edge would hold them to every recompute of ``k``."""
    seen: dict[fx.Node, list[fx.Node]] = {}  # call -> its outputs listed so far
    pairs: list[tuple[fx.Node, fx.Node]] = []
    for o in ordered:
        call = call_of.get(o)
        if call is None or output_mask(call.target) is not None:
            continue
        before = seen.setdefault(call, [])
        pairs += [(j, o) for j in before if j not in fixed]
        before.append(o)
    return pairs


def _run_bytes(
    ordered: Sequence[fx.Node],
    call_of: Mapping[fx.Node, fx.Node],
    mem: Mapping[fx.Node, int],
    fixed: Set[fx.Node],
) -> dict[fx.Node, int]:
    """Bytes a run of each output's op allocates beside what the graph counts for it, for ops
    that make every output at each run (no output mask: :meth:`checkmate.codegen._Emitter.finish`
    asks the others for the outputs taken only): its outputs listed after it, its outputs
    no node stands for (dropout's output, which is recomputed from its mask), and the outputs
    listed before it that may not be recomputed.

    Each output is a node of its own, and a plan may recompute one alone (a BatchNorm's
    output without its statistics, a LayerNorm's statistics without its output): the op
    then makes the others too, dropped right after. Counted as scratch of the outputs before
    them, they are that run's bytes; computed together, in order, each output is counted
    once, as the node it is. The outputs before the one recomputed are its inputs
    (:func:`_sibling_reads`), resident when it runs, where they may be recomputed; the others
    are counted here. Each op's outputs are listed smallest first (:func:`_siblings_last`), so
    that what a run alone holds beside its output is the smaller ones (a normalization's
    statistics beside its output, a max-pool's output beside its indices)."""
    out: dict[fx.Node, int] = {}
    later: dict[fx.Node, int] = {}  # call -> bytes of its outputs listed after the current one
    for o in reversed(ordered):
        call = call_of.get(o)
        if call is None or output_mask(call.target) is not None:
            continue
        if call not in later:
            later[call] = _nodeless_bytes(call)
        out[o] = later[call]
        later[call] += int(mem[o])
    earlier: dict[fx.Node, int] = {}  # call -> bytes of its fixed outputs listed before
    for o in ordered:
        call = call_of.get(o)
        if o not in out or call is None:
            continue
        if o not in fixed:
            out[o] += earlier.get(call, 0)
        else:
            earlier[call] = earlier.get(call, 0) + int(mem[o])
    return {o: b for o, b in out.items() if b}


def _nodeless_bytes(call: fx.Node) -> int:
    """Bytes of the outputs of a multi-output op that no ``getitem`` reads (made and dropped
    at each run), not counting outputs that alias an input."""
    vals = call.meta.get("val")
    if not isinstance(vals, (tuple, list)):
        return 0
    read = {u.args[1] for u in call.users if u.target is operator.getitem}
    schema = getattr(call.target, "_schema", None)
    returns = list(schema.returns) if schema is not None else []
    total = 0
    for k, v in enumerate(vals):
        aliased = k < len(returns) and returns[k].alias_info is not None
        if k not in read and not aliased and isinstance(v, torch.Tensor):
            total += _tensor_bytes(v)
    return total


def recompute_dropout_from_mask(gm: fx.GraphModule, *, eager: bool = True) -> int:
    """Make dropout's output recomputable: ``out = native_dropout_backward(x, mask, scale)``.

    A random op runs exactly once (its randomness cannot be replayed), and so far its output
    could then only be kept, never recomputed, which pins everything downstream of every
    dropout. Here the op still runs once and its mask is kept, while its output becomes a
    deterministic op of the input and the mask (the very kernel that computes dropout's
    gradient; on CPU, with the scale dropout applies (:func:`_dropout_scale`), its result
    equals dropout's output bit for bit in every floating dtype, and the gradient's scale
    is set to it too; ``eager=False``: the exact scale, as Inductor's fused dropout applies
    it). Mutates ``gm``.

    Returns:
        The number of dropouts rewritten.
    """
    done = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.native_dropout.default:
            continue
        if len(node.args) < 3 or node.args[2] is not True:
            continue
        p = float(node.args[1])  # type: ignore[arg-type]
        outs = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if 0 not in outs or p >= 1.0:
            continue
        if 1 not in outs:
            with gm.graph.inserting_after(outs[0]):
                outs[1] = gm.graph.call_function(operator.getitem, (node, 1))
            outs[1].meta["val"] = node.meta["val"][1]
        scale = _dropout_scale(node.args[0], p) if eager else 1.0 / (1.0 - p)
        if eager:  # its gradient too, as eager's dropout (input times a noise of its dtype) has it
            for use in list(outs[1].users):
                if use.target is torch.ops.aten.native_dropout_backward.default:
                    use.args = (*use.args[:2], scale, *use.args[3:])
        with gm.graph.inserting_after(max(outs.values(), key=lambda u: _position(gm, u))):
            redo = gm.graph.call_function(
                torch.ops.aten.native_dropout_backward.default, (node.args[0], outs[1], scale)
            )
        redo.meta = dict(outs[0].meta)
        outs[0].replace_all_uses_with(redo)
        gm.graph.erase_node(outs[0])
        done += 1
    if done:
        gm.recompile()
    return done


def _dropout_from_mask(node: fx.Node) -> fx.Node | None:
    """The ``native_dropout`` whose output ``node`` computes again from the dropout's mask
    (``native_dropout_backward(x, mask, scale)``, :func:`recompute_dropout_from_mask`), or None
    where ``node`` is not such a computation (a dropout's gradient reads a gradient, not the
    dropout's input)."""
    if node.op != "call_function" or node.target is not torch.ops.aten.native_dropout_backward.default:
        return None
    x, mask = node.args[:2]
    if not (isinstance(mask, fx.Node) and mask.target is operator.getitem and mask.args[1] == 1):
        return None
    op = mask.args[0]
    if isinstance(op, fx.Node) and op.target is torch.ops.aten.native_dropout.default and op.args[0] is x:
        return op
    return None


def _dropout_scale(x: object, p: float) -> float:
    """The scale eager PyTorch applies to ``x``'s kept elements in training-mode dropout:
    ``1 / (1 - p)``, on the CPU rounded to ``x``'s dtype. There ``dropout`` multiplies the
    input by a noise tensor of its dtype (and its gradient by the same noise), and
    ``native_dropout``'s output agrees: in bfloat16 at p=0.1 the scale is 1.109375, not
    1.1111. ``native_dropout_backward`` given the exact scale, as AOTAutograd traces dropout's
    gradient, made a forward under ``torch.autocast("cpu")`` differ from eager's (a ViT's loss
    2.31711 against 2.31717) and its gradients too. With the rounded scale both agree bit for
    bit in float32, float64, bfloat16 and float16; CUDA's fused kernel scales in float, by
    the exact scale."""
    scale = 1.0 / (1.0 - p)
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    if isinstance(val, torch.Tensor) and val.device.type == "cpu" and val.dtype.is_floating_point:
        return float(torch.tensor(scale, dtype=val.dtype))
    return scale


def correct_traced_dtypes(gm: fx.GraphModule) -> int:
    """Give traced values the dtypes their kernels return where a fake-tensor rule disagrees.

    torch 2.13, on the CPU: ``native_layer_norm``, ``native_batch_norm`` and
    ``native_group_norm`` of a bfloat16 or float16 input with float32 weights (what
    ``torch.autocast("cpu")`` traces) return float32 statistics, traced in the input's dtype.
    An op's cost and scratch are measured on inputs made from the traced values, and the
    backward refused statistics its forward never gives it. Each CPU op that returns several
    tensors and reads floating-point tensors of more than one dtype runs once for real (once
    per signature in a process) and its outputs' traced dtypes follow the kernel's; a torch
    whose rules agree changes nothing. Mutates ``gm``'s node metadata.

    Returns:
        The number of values whose dtype changed.
    """
    done = 0
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        if node.op != "call_function" or not isinstance(vals, (tuple, list)):
            continue
        if not isinstance(node.target, torch._ops.OpOverload):
            continue
        ins = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        tensors = [t for t in torch.utils._pytree.tree_leaves(ins) if isinstance(t, torch.Tensor)]
        floats = {t.dtype for t in tensors if t.dtype.is_floating_point}
        if len(floats) < 2 or any(t.device.type != "cpu" for t in tensors):
            continue
        kernel = _kernel_dtypes(node.target, ins)
        if kernel is None or len(kernel) != len(vals):
            continue
        fixed = [
            _with_dtype(v, d) if isinstance(v, torch.Tensor) and d is not None and v.dtype != d else v
            for v, d in zip(vals, kernel)
        ]
        changed = {i for i, (v, f) in enumerate(zip(vals, fixed)) if f is not v}
        if not changed:
            continue
        node.meta["val"] = type(vals)(fixed)
        for user in node.users:
            if user.target is operator.getitem and user.args[1] in changed:
                _retype(user, fixed[int(user.args[1])])  # type: ignore[call-overload]
        done += len(changed)
    return done


def _retype(node: fx.Node, val: torch.Tensor) -> None:
    """``node``'s traced value becomes ``val``, and so do the dtypes of the views and
    aliases of it that kept its dtype (the backward reads saved statistics through
    ``detach``)."""
    old = node.meta.get("val")
    node.meta["val"] = val
    if not isinstance(old, torch.Tensor):
        return
    for user in node.users:
        mine = user.meta.get("val")
        if not isinstance(mine, torch.Tensor) or mine.dtype != old.dtype:
            continue
        if is_view_node(user) and user.args[:1] == (node,):
            _retype(user, _with_dtype(mine, val.dtype))


_KERNEL_DTYPES: dict[str, tuple[torch.dtype | None, ...] | None] = {}


def _kernel_dtypes(target: torch._ops.OpOverload, ins: Any) -> tuple[torch.dtype | None, ...] | None:
    """The dtypes of the outputs ``target`` returns when run for real on CPU tensors shaped
    like ``ins`` (its traced args and kwargs); None when it does not run."""
    key = repr((target, torch.utils._pytree.tree_map(_signature_of, ins)))
    if key not in _KERNEL_DTYPES:
        try:
            with real_tensors():
                args, kwargs = torch.utils._pytree.tree_map_only(torch.Tensor, real_like, ins)
                out = target(*args, **kwargs)
            _KERNEL_DTYPES[key] = tuple(o.dtype if isinstance(o, torch.Tensor) else None for o in out)
        except (RuntimeError, TypeError, ValueError):
            _KERNEL_DTYPES[key] = None
    return _KERNEL_DTYPES[key]


def _signature_of(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype))
    return x


def _with_dtype(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fake tensor like ``val`` (its shape, strides and device) of ``dtype``."""
    mode = getattr(val, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty_strided(val.shape, val.stride(), dtype=dtype, device=val.device)


def _position(gm: fx.GraphModule, node: fx.Node) -> int:
    for k, n in enumerate(gm.graph.nodes):
        if n is node:
            return k
    raise AssertionError(node)


def _mutated_inputs(placeholders: Sequence[fx.Node], out_node: fx.Node) -> set[fx.Node]:
    """Primals whose new value is a forward output (AOTAutograd's output descriptors)."""
    idx = set()
    for desc in out_node.meta.get("desc") or ():
        inp = getattr(desc, "mutated_input", None)
        if inp is not None and getattr(inp, "idx", None) is not None:
            idx.add(inp.idx)
    return {p for p in placeholders if getattr(p.meta.get("desc"), "idx", None) in idx}


def _mutation_outputs(outputs: Sequence[Any], out_node: fx.Node) -> set[fx.Node]:
    """The outputs that are a mutated input's new value (AOTAutograd's output descriptors;
    none where they are missing or do not line up with the outputs)."""
    descs = out_node.meta.get("desc") or ()
    if len(descs) != len(outputs):
        return set()
    return {
        o
        for o, d in zip(outputs, descs)
        if isinstance(o, fx.Node) and getattr(d, "mutated_input", None) is not None
    }


def _is_bn_training(node: fx.Node) -> bool:
    return (
        node.target is torch.ops.aten._native_batch_norm_legit_functional.default
        and len(node.args) > 5
        and node.args[5] is True
    )


def _root(node: fx.Node, base: dict[fx.Node, fx.Node | None]) -> fx.Node:
    """The placeholder a view chain starts from (or the node itself)."""
    while node.op == "call_function" and base.get(node) is None and node.args:
        first = node.args[0]
        if not isinstance(first, fx.Node):
            break
        node = first
    return node


#: a fused op read by more ops than this is kept as a node of its own (Inductor writes a
#: buffer read by many kernels rather than recomputing it in each)
_MAX_FOLDED_READERS = 4


def _read_by(outputs: Sequence[fx.Node]) -> set[fx.Node]:
    """``outputs`` and every node they alias (through views and ``getitem``)."""
    seen: set[fx.Node] = set()
    todo = list(outputs)
    while todo:
        o = todo.pop()
        if o in seen:
            continue
        seen.add(o)
        first = o.args[0] if o.op == "call_function" and o.args else None
        if isinstance(first, fx.Node) and (is_view_node(o) or o.target is operator.getitem):
            todo.append(first)
    return seen


def _users(n: fx.Node) -> Iterable[fx.Node]:
    return n.users


def into_addmm(n: fx.Node) -> bool:
    """Whether Inductor's post-grad pattern (``mm`` read only by an ``add`` of a tensor of its
    dtype becomes one ``addmm``) runs the matrix product ``n`` where the addition is, so
    that its inputs live until then (``torch/_inductor/fx_passes/post_grad.py``; on CUDA
    only when the sum feeds a non-pointwise op: assumed always, which over-counts)."""
    if n.op != "call_function" or n.target is not torch.ops.aten.mm.default or len(n.users) != 1:
        return False
    add = next(iter(n.users))
    if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return False
    other = add.args[1] if add.args[0] is n else add.args[0]
    if other is n or not isinstance(other, fx.Node):
        return False
    val, mine = other.meta.get("val"), n.meta.get("val")
    return (
        isinstance(val, torch.Tensor)
        and isinstance(mine, torch.Tensor)
        and val.dtype == mine.dtype
        and _expandable(tuple(val.shape), tuple(mine.shape))
    )


def _expandable(shape: tuple[int, ...], to: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``to`` (without changing ``to``)."""
    if len(shape) > len(to):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(to)))


def _touches(n: fx.Node, mutated: set[fx.Node], base: dict[fx.Node, fx.Node | None]) -> bool:
    """Whether ``n`` reads a mutated primal, directly or through nodes of no owner."""
    todo, seen = list(n.all_input_nodes), set()
    while todo:
        a = todo.pop()
        if a in seen:
            continue
        seen.add(a)
        if a in mutated:
            return True
        if a.op == "call_function" and base.get(a) is None:
            todo.extend(a.all_input_nodes)
    return False


def _folded_into(
    args: Sequence[fx.Node],
    inlined: set[fx.Node],
    base: dict[fx.Node, fx.Node | None],
    multi: set[fx.Node],
) -> set[fx.Node]:
    """The folded ops an op with inputs ``args`` runs (reached through views and other
    folded ops)."""
    out: set[fx.Node] = set()
    todo, seen = list(args), set()
    while todo:
        a = todo.pop()
        if a in seen or a.op != "call_function" or base.get(a) is not None or a in multi:
            continue
        seen.add(a)
        if a in inlined:
            out.add(a)
        todo.extend(a.all_input_nodes)
    return out


def _on_folded(n: fx.Node, inlined: set[fx.Node], base: dict[fx.Node, fx.Node | None]) -> bool:
    """Whether ``n`` (a node of no owner) is a folded op or a view of one."""
    while n not in inlined:
        first = n.args[0] if n.args else None
        if not isinstance(first, fx.Node) or first.op != "call_function" or base.get(first) is not None:
            return False
        n = first
    return True


def _tensor_bytes(val: object) -> int:
    """Bytes a traced value allocates: tensors (their storage) and tuples/lists of them."""
    if isinstance(val, torch.Tensor):
        if val.layout == torch.sparse_coo:  # an nn.Embedding(sparse=True) gradient: what it holds
            return sum(int(p.numel()) * p.element_size() for p in (val._indices(), val._values()))
        try:
            return int(val.untyped_storage().nbytes())
        except Exception:  # fake tensors without a storage: fall back to numel
            return int(val.numel()) * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_tensor_bytes(v) for v in val)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise TraceError(
            "the joint graph has symbolic shapes; checkmate plans static shapes only: "
            "compile with dynamic=False (checkmate.optimize does) and avoid mark_dynamic"
        )
    return 0


def data_dependent_size(gm: fx.GraphModule) -> str | None:
    """Where a Dynamo graph first holds a tensor whose size depends on tensor values (an
    unbacked symbol: a ``.item()`` Dynamo captured, ``capture_scalar_outputs``, used as a size),
    as the node and the user's line it was traced from; None where every size is known before
    the step runs, as a plan needs."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        val = n.meta.get("example_value", n.meta.get("val"))
        if isinstance(val, torch.Tensor) and free_unbacked_symbols(val):
            lines = [
                line.strip() for line in str(n.meta.get("stack_trace") or "").splitlines() if line.strip()
            ]
            at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("File ")), None)
            where = (
                "" if at is None else f" ({lines[at]}{': ' + lines[at + 1] if at + 1 < len(lines) else ''})"
            )
            return f"{n.name}{where}"
    return None


def build_graph(
    gm: fx.GraphModule,
    num_fwd_outputs: int,
    costs: Callable[[Sequence[fx.Node]], Sequence[float]],
    *,
    scratch: Callable[[fx.Node], int] | None = None,
    held_beyond: Callable[[fx.Node], int] | None = None,
    fuse: Callable[[fx.Node], bool] | None = None,
    save_costs: Callable[[fx.Node], float] | None = None,
    late_masks: bool = False,
    unread: frozenset[str] = frozenset(),
    beside: frozenset[str] | None = None,
    name: str = "",
) -> JointGraph:
    """Model the joint graph ``gm`` as a :class:`solvers.Graph`.

    Args:
        gm: the functionalized joint forward+backward graph from AOTAutograd.
        num_fwd_outputs: how many leading outputs are forward outputs (the rest are
            gradients), as the partitioner is told.
        costs: seconds per fx node for a list of compute nodes (e.g. a profiler).
        scratch: bytes of scratch space an op allocates and frees while it runs (beyond
            its outputs), or None to assume none.
        held_beyond: bytes an op's one output holds beyond its elements, for as long as it
            lives (:func:`checkmate.scratch.held_beyond`), or None to assume none.
        fuse: for a compiler that fuses generated code into its readers (Inductor): whether
            an op is such code (:func:`checkmate.fusion.fusible`). Those ops are folded into
            their readers (see "Fused ops" in the module docstring), and so is a matrix
            product into the one addition that reads it (:func:`into_addmm`), whatever
            ``fuse`` says of it; None folds nothing.
        save_costs: seconds the forward spends only to hand a value it computes to the
            backward (:func:`checkmate.fusion.save_cost`), asked of each forward value's
            node; None for none (:attr:`solvers.graph.Node.save_cost`).
        late_masks: a boolean value (a mask) only the backward reads is computed in the
            backward, not held from the forward, whatever its inputs' bytes: for Inductor's
            C++ code, which stores bools slowly (:func:`checkmate.placement.backward_only`).
        unread: tangents to count as no bytes: gradients the step is expected not to give
            (:func:`checkmate.tangents.unread_tangents`).
        beside: tangents a loss beside their outputs leaves unread, which find those outputs
            (:attr:`JointGraph.beside_loss`) whether or not the step gives them (Inductor's
            backward is given zeros for them, counted); ``unread`` when None.
        name: the graph's name.

    Returns:
        A :class:`JointGraph`.

    Raises:
        TraceError: the graph holds something checkmate cannot plan (symbolic shapes, an
            op outside call_function, an output that is not a traced value).
    """
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    tangents = {n for n in placeholders if n.name.startswith("tangents")}
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    outputs = list(fx.node.map_arg(out_node.args[0], lambda x: x))  # type: ignore[arg-type]
    flat_out = [o for o in outputs if isinstance(o, fx.Node)]
    fwd_outputs = [o for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]

    mutated = _mutated_inputs(placeholders, out_node)
    out_set = set(flat_out)
    inplace: dict[fx.Node, fx.Node] = {}  # addend -> the gradient add done in place into it
    backward: set[fx.Node] = set(tangents)
    base: dict[fx.Node, fx.Node | None] = {}  # fx node -> owner fx node (None: a placeholder's)
    owners: list[fx.Node] = []
    call_of: dict[fx.Node, fx.Node] = {}  # getitem owner -> its multi-output call
    multi: set[fx.Node] = set()
    inlined: set[fx.Node] = set()  # fused ops folded into their readers
    pinned = _read_by(flat_out)  # an output (or a view of one) is held: never folded
    sources: dict[fx.Node, frozenset[fx.Node]] = {}  # a node of no owner -> owners it reads

    def reads(a: fx.Node) -> frozenset[fx.Node]:
        """The owners whose values ``a`` is made of (``a`` itself when it owns storage)."""
        b = base.get(a)
        if b is not None:
            return frozenset((b,))
        if a.op != "call_function" or a in multi:
            return frozenset()
        got = sources.get(a)
        if got is None:
            got = sources[a] = frozenset().union(*(reads(x) for x in a.all_input_nodes))
        return got

    def folds(n: fx.Node) -> bool:
        """Whether ``n`` is fused code to fold into its readers: every reader is fused code
        too (a library kernel reads a buffer from memory), few read it (Inductor writes a
        buffer read many times), the owners it reads hold no more than its own output
        (keeping them instead of it costs no memory), it reads no state the step mutates (a
        reader after the mutation would see the new value), and it is no output. A matrix
        product whose one reader adds it to a tensor is folded into that addition too:
        Inductor runs the pair as one ``addmm`` where the addition is."""
        if fuse is None or n in pinned:
            return False
        if into_addmm(n):
            return not _touches(n, mutated, base)
        if len(n.users) > _MAX_FOLDED_READERS or not fuse(n) or any(map(into_addmm, n.all_input_nodes)):
            return False
        if _touches(n, mutated, base) or not all(fuse(u) for u in through_views(n.users, _users)):
            return False
        out = _tensor_bytes(n.meta.get("val"))
        held = sum(_tensor_bytes(b.meta.get("val")) for b in reads(n))
        return held <= out + out // 64

    for n in nodes:
        if n.op == "placeholder":
            # a tangent is allocated by autograd when the backward starts and dies at its
            # last read, like an op output: it is a (backward, fixed) node of its own
            base[n] = n if n in tangents else None
            if n in tangents:
                owners.append(n)
            continue
        if n.op == "output":
            continue
        if n.op == "get_attr":
            # a constant tensor lifted into the graph module (T5's and BART's attention
            # masks build one): resident like a parameter, outside the budget, no node
            base[n] = None
            continue
        if n.op != "call_function":
            raise TraceError(
                f"joint graph node {n.name!r} is a {n.op!r} ({n.target}); checkmate handles "
                "call_function nodes only: make the model traceable without it"
            )
        if any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        first = n.args[0] if n.args else None
        if n.target is operator.getitem and isinstance(first, fx.Node) and first in multi:
            base[n] = n  # one output of a multi-output op: a node of its own
            owners.append(n)
            call_of[n] = first
        elif (is_view_node(n) or n.target is operator.getitem) and isinstance(first, fx.Node):
            base[n] = base[first]  # an alias: shares its base's allocation
        elif (into := accumulates_into(n, base, backward, out_set, multi)) is not None:
            base[n] = into  # computed in place: part of the addend's node, reading both
            inplace[into] = n
        elif isinstance(n.meta.get("val"), (tuple, list)) and any(
            u.target is operator.getitem for u in n.users
        ):
            base[n] = None  # its outputs are the nodes (see the module docstring)
            multi.add(n)
        elif folds(n):
            base[n] = None  # recomputed inside each reader: no node, no storage
            inlined.add(n)
        else:
            base[n] = n
            owners.append(n)

    inputs: dict[fx.Node, set[fx.Node]] = {o: set() for o in owners}  # owner -> owners it reads
    folded: dict[fx.Node, set[fx.Node]] = {o: set() for o in owners}  # owner -> folded ops it runs
    for n in nodes:
        o = base.get(n)
        if n.op != "call_function" or o is None:
            continue
        args = call_of[n].all_input_nodes if n in call_of else n.all_input_nodes
        for a in args:
            inputs[o].update(b for b in reads(a) if b is not o)
        if inlined:
            folded[o].update(_folded_into(args, inlined, base, multi))

    held_owners = {b for o in fwd_outputs if (b := base.get(o)) is not None}
    # a dropout whose draws are replayed from the generator state taken before it
    # (checkmate.rng): its mask reads that state, and may be recomputed
    by_name = {n.name: n for n in nodes}
    replayed = {
        o: by_name[call_of[o].meta[RNG_STATE]]
        for o in owners
        if o in call_of and o not in backward and call_of[o].meta.get(RNG_STATE) in by_name
    }
    for o, state in replayed.items():
        inputs[o].add(state)
    # an op reading an input the step mutates would read the new value if recomputed after
    # the mutation: it runs once, in the forward (BatchNorm in training mode is the exception:
    # its batch statistics and output do not depend on the running statistics it updates)
    reads_mutated: set[fx.Node] = set()
    for o in owners:
        op = call_of.get(o, o)
        if not _is_bn_training(op) and any(_root(a, base) in mutated for a in op.all_input_nodes):
            reads_mutated.add(o)
    once = {
        o
        for o in owners
        if o not in backward
        and (is_mutation(call_of.get(o, o).target) or is_random_node(call_of.get(o, o)) or o in reads_mutated)
    }
    mem = {
        o: 0
        if writes_input(call_of.get(o, o).target) or o.name in unread
        else _tensor_bytes(o.meta.get("val"))
        for o in owners
    }
    if held_beyond is not None:  # a loss's scalar in the buffer of its elementwise losses
        for o in owners:
            if mem[o] and o.op == "call_function" and o not in call_of:
                mem[o] += held_beyond(o)
    sunk = backward_only(
        owners, inputs, backward, once | held_owners | set(call_of), mem, late_masks=late_masks
    )
    late = sunk | deferrable(owners, inputs, backward, once | set(call_of), mem)

    ordered = [o for o in owners if o not in backward and o not in sunk] + lazy_order(
        owners, inputs, backward, late
    )
    ordered = _siblings_last(ordered, call_of, mem)
    gid = {o: i for i, o in enumerate(ordered)}
    ops = [call_of.get(o, o) for o in ordered]
    fused = [o for o in ordered if o in inplace]
    folded_ops = [n for n in nodes if n in inlined]
    timed = list(costs(ops + [inplace[o] for o in fused] + folded_ops))
    seconds = dict(zip(ordered, timed[: len(ops)]))
    shares = _cost_shares(ordered, call_of)
    for o, share in shares.items():
        seconds[o] *= share
    for o, extra in zip(fused, timed[len(ops) : len(ops) + len(fused)]):
        seconds[o] += extra
    if folded_ops:
        each = dict(zip(folded_ops, timed[len(ops) + len(fused) :]))
        for o in ordered:  # a folded op runs again inside every reader
            seconds[o] = seconds.get(o, 0.0) + sum(each[x] for x in folded[o])
    preds: dict[fx.Node, set[int]] = {o: {gid[b] for b in inputs[o]} for o in ordered}
    held = {gid[b] for b in held_owners}
    forward_required = {gid[o] for o in once} | held
    fixed_set = {
        o
        for o in ordered
        if o.op == "placeholder"
        or is_mutation((op := call_of.get(o, o)).target)
        or (is_random_node(op) and o not in replayed)
        or gid[o] in held
        or o in reads_mutated
    }
    for j, k in _sibling_reads(ordered, call_of, fixed_set):
        preds[k].add(gid[j])

    graph_nodes = []
    for o in ordered:
        op = call_of.get(o, o)
        in_backward = o in backward or o in sunk
        graph_nodes.append(
            {
                "key": o.name,
                "name": o.name,
                "cost": max(float(seconds.get(o, 0.0)), 0.0),
                "mem": mem[o],
                "backward": in_backward,
                "recomputable": o not in fixed_set,
                "op": str(op.target),
                "save_cost": (
                    float(save_costs(o))
                    if save_costs is not None and o.op == "call_function" and not in_backward
                    else 0.0
                ),
            }
        )
    # an op's scratch space (e.g. CPU convolutions) is a node computed right before it,
    # read by it and dead right after: the simulator then counts it during the op only
    order: list[str] = []
    edges = [(ordered[p].name, o.name) for o in ordered for p in sorted(preds[o])]
    after = _run_bytes(ordered, call_of, mem, fixed_set)
    for o in ordered:
        extra = scratch(call_of.get(o, o)) if scratch is not None and o.op != "placeholder" else 0
        extra += after.get(o, 0)
        if extra > 0:
            w = f"{o.name}{WORKSPACE}"
            spec = graph_nodes[gid[o]]
            graph_nodes.append(
                {
                    "key": w,
                    "name": w,
                    "cost": 0.0,
                    "mem": int(extra),
                    "backward": spec["backward"],
                    # scratch, not a value: "recomputing" it runs nothing, even for an op
                    # that runs once (a planner holds a value that may not be recomputed)
                    "recomputable": True,
                    "op": "workspace",
                }
            )
            edges += [(ordered[p].name, w) for p in sorted(preds[o])] + [(w, o.name)]
            order.append(w)
        order.append(o.name)
    # a mutated input's new value is copied into the input by AOTAutograd's runtime wrapper
    # once the forward returns, and dropped there: it is read at the backward's start, not
    # held to the step's end (a MoCo key encoder updated in its forward held its parameters'
    # bytes through the backward, 17% over the measured peak)
    copied = _mutation_outputs(outputs, out_node)
    sink_reads = {gid[b] for o in flat_out if o not in copied and (b := base.get(o)) is not None}
    first_bwd = next((o for o in ordered if o in tangents), None)  # made as the backward starts, once
    copy_reads = {gid[b] for o in copied if (b := base.get(o)) is not None} - sink_reads
    if first_bwd is not None:
        edges += [(ordered[i].name, first_bwd.name) for i in sorted(copy_reads) if i < gid[first_bwd]]
        sink_reads |= {i for i in copy_reads if i >= gid[first_bwd]}
    else:
        sink_reads |= copy_reads
    # outputs a loss beside them was computed from: read by the loss's gradient too, so that a
    # plan dropping them at the backward's start (drop_outputs_beside_loss) holds them to there
    unread_by_loss = unread if beside is None else beside
    found = _beside_loss(fwd_outputs, tangents, unread_by_loss, base)
    losses = [
        t
        for t in tangents
        if t.name not in unread_by_loss
        and isinstance(v := t.meta.get("val"), torch.Tensor)
        and v.numel() == 1
    ]
    by_loss = {b: key for b, key in found.items() if b in gid} if losses else {}
    edges += [(b.name, t.name) for b in by_loss for t in losses]
    # no loss among the outputs: those whose gradients the backward reads feed a loss outside
    # the module, which a loop computing it inline drops before the backward starts
    read_outside: dict[fx.Node, tuple[tuple[int, ...], torch.dtype]] = {}
    if not losses and first_bwd is not None:
        read = frozenset(t.name for t in tangents if t.name not in unread_by_loss)
        read_outside = {
            b: key
            for b, key in _beside_loss(fwd_outputs, tangents, read, base).items()
            if b in gid and gid[b] < gid[first_bwd]
        }
    graph_nodes.append({"key": SINK, "name": SINK, "cost": 0.0, "mem": 0, "backward": True, "op": "output"})
    edges += [(ordered[i].name, SINK) for i in sorted(sink_reads)]
    order.append(SINK)
    graph = Graph.build(graph_nodes, edges, name=name, order=order)
    final = {k: i for i, k in enumerate(order)}
    fid = [final[o.name] for o in ordered]  # ordered position -> graph id
    group = {n.name: fid[gid[b]] for n, b in base.items() if b is not None}
    members = tuple((k,) if k in final and not k.endswith(WORKSPACE) and k != SINK else () for k in order)
    calls = {o.name: (c.name, o.args[1]) for o, c in call_of.items()}
    return JointGraph(
        graph=graph,
        group=group,
        members=members,
        forward_required=frozenset(fid[i] for i in forward_required),
        num_fwd_outputs=num_fwd_outputs,
        calls=calls,
        mutated=frozenset(p.name for p in mutated),
        inplace={x.name: a.name for x, a in inplace.items()},
        folded=frozenset(
            n.name
            for n in nodes
            if n.op == "call_function"
            and base.get(n) is None
            and n not in multi
            and _on_folded(n, inlined, base)
        ),
        unread=frozenset(t.name for t in tangents if t.name in unread),
        beside_loss={final[b.name]: key for b, key in by_loss.items()},
        read_outside={final[b.name]: key for b, key in read_outside.items()},
        replayed={call_of[o].name: state.name for o, state in replayed.items()},
        split=frozenset(call_of[o].name for o in shares),
        from_mask={n.name: d.name for n in nodes if (d := _dropout_from_mask(n)) is not None},
    )
