"""Gradients of outputs the loss does not read: None, as in eager PyTorch, not zeros.

A Hugging Face causal LM given ``labels=`` returns its loss *and* its logits; training calls
``out.loss.backward()``. Eager autograd never computes a gradient for the logits. The
function AOTAutograd compiles, an ``autograd.Function``, is given that gradient as undefined,
and autograd materializes it as a zero tensor the size of the logits before the compiled
backward starts (``materialize_grads``, on by default), which then adds it to the loss's own
gradient of the logits. A Llama with a 32,000-word vocabulary held a zero logits-sized
tensor beside its loss's backward: its least peak was 1.19-1.29x eager's measured step.

Here the compiled functions of checkmate's steps leave those gradients undefined
(:func:`release_unused`), and the backward module is run, for each pattern of undefined
gradients, as a variant in which they are zero values that never exist (:func:`fold_zeros`):

- an addition of a zero is its other operand (``add(0, g) = g``: the logits' gradient is the
  loss's gradient of the logits, as in eager);
- a view, a copy, a reduction, a scaling or a product of a zero is a zero;
- any other use of a zero gets a zero tensor made just before it (it dies after its last
  use, as any value of the module does).

The variant never holds more than the module it comes from at any point of its run: a
gradient autograd materialized lived from the backward's start to its last read; a zero made
here lives from its first read that cannot fold to its last, and a folded addition's result
is its operand's storage, folded only where that storage is no larger than the result the
addition would have allocated. So a plan simulated with every output's gradient given holds
when some are not (the plan is an upper bound). A graph that returns a loss beside outputs
it was computed from is planned without their gradients (:func:`unread_tangents`), which
:class:`NoneTangents` checks at each backward.

PyTorch's own fix (pytorch/pytorch#186355, a specialization of AOTAutograd's backward for
undefined output tangents) is not in the supported releases; this is written from the
behaviour, for the modules checkmate generates.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from checkmate.ops import is_view_node

__all__ = [
    "MadeZeros",
    "NoneTangents",
    "added_to_loss",
    "compiled_nodes",
    "fold_zeros",
    "grad_fns",
    "release_unused",
    "tangent_masks",
    "unread_tangents",
    "watch_held",
    "watch_outputs",
    "zeros_strided",
]

log = logging.getLogger("checkmate")

aten = torch.ops.aten

#: ops whose result is zero where their first argument is
_ZERO_FIRST = frozenset(
    {
        aten.clone.default,
        aten._to_copy.default,
        aten.neg.default,
        aten.sum.default,
        aten.sum.dim_IntList,
        aten.mean.dim,
        aten.mul.Scalar,
        aten.div.Scalar,
        aten.div.Tensor,
    }
)

#: ops whose result is zero where any tensor argument is
_ZERO_ANY = frozenset({aten.mul.Tensor, aten.mm.default, aten.bmm.default})

#: additions: ``add(a, b)`` is ``a`` where ``b`` is zero (and ``b`` where ``a`` is, for alpha 1)
_ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor})
_SUBS = frozenset({aten.sub.Tensor})

#: the name of an AOTAutograd compiled function's backward node (its ``grad_fn``)
_COMPILED = "CompiledFunctionBackward"


def zeros_strided(
    size: Sequence[int], stride: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A zero tensor of this size and stride (what a folded zero is where it cannot fold)."""
    return torch.empty_strided(tuple(size), tuple(stride), dtype=dtype, device=device).zero_()


def grad_fns(tensors: Iterable[Any]) -> frozenset[int]:
    """The ids of the autograd nodes that made ``tensors`` (ids only: the tensors may die)."""
    return frozenset(id(t.grad_fn) for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None)


def release_unused(outputs: Iterable[Any], skip: frozenset[int] = frozenset()) -> list[Any]:
    """Have the compiled functions that produced ``outputs`` pass an undefined gradient as
    None to their backward instead of a zero tensor autograd allocates
    (``set_materialize_grads(False)`` on their backward node). A node in ``skip`` (made
    before the call: :func:`grad_fns` of its inputs) is left as it is. Returns the nodes
    marked.

    An output that is a view AOTAutograd regenerates from an intermediate the function
    returns is followed one step, to that function's node.
    """
    marked = compiled_nodes(outputs, skip)
    for f in marked:
        f.set_materialize_grads(False)
    return marked


def compiled_nodes(outputs: Iterable[Any], skip: frozenset[int] = frozenset()) -> list[Any]:
    """The backward nodes of the compiled functions that produced ``outputs``, but those in
    ``skip`` (see :func:`release_unused`), each once."""
    found: list[Any] = []
    seen: set[int] = set()
    for out in outputs:
        fn = out.grad_fn if isinstance(out, torch.Tensor) else None
        if fn is None or id(fn) in skip:
            continue
        near = [fn] if type(fn).__name__ == _COMPILED else [f for f, _ in fn.next_functions if f is not None]
        for f in near:
            if type(f).__name__ == _COMPILED and id(f) not in skip and id(f) not in seen:
                seen.add(id(f))
                found.append(f)
    return found


def watch_held(
    nodes: Sequence[Any],
    outputs: Iterable[Any],
    keys: frozenset[tuple[tuple[int, ...], torch.dtype]],
    on_held: Callable[[int], None],
) -> None:
    """When the backward reaches the first of ``nodes`` (a compiled function's backward
    node), call ``on_held`` with the bytes of those of ``outputs`` of a size and dtype in
    ``keys`` that are still alive: held by the loop through the backward, where the plan
    dropped them when it starts. Only weak references are kept."""
    watch_outputs(nodes, outputs, keys, lambda nbytes: on_held(nbytes) if nbytes else None)


def watch_outputs(
    nodes: Sequence[Any],
    outputs: Iterable[Any],
    keys: frozenset[tuple[tuple[int, ...], torch.dtype]],
    on_backward: Callable[[int], None],
) -> None:
    """When the backward reaches the first of ``nodes``, call ``on_backward`` with the bytes
    of those of ``outputs`` of a size and dtype in ``keys`` still alive there (0 when the
    loop dropped them all). Only weak references are kept."""
    refs = [
        weakref.ref(t) for t in outputs if isinstance(t, torch.Tensor) and (tuple(t.shape), t.dtype) in keys
    ]
    if not nodes or not refs:
        return

    def reached(grad_outputs: Any) -> None:
        storages: dict[int, int] = {}
        for ref in refs:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        on_backward(sum(storages.values()))

    nodes[0].register_prehook(reached)


class NoneTangents:
    """A backward module (boxed: ``(*saved, *tangents)`` in a list) that takes None for any
    of its tangents, running the variant of itself in which those are zeros
    (:func:`fold_zeros`), made once per pattern.

    ``assumed`` names the tangents the plan counted as no bytes (:func:`unread_tangents`):
    when any of them is given, ``on_given`` is called with their names and bytes before the
    module runs (the plan's simulated peak did not count them).
    """

    def __init__(
        self,
        module: fx.GraphModule,
        assumed: frozenset[str] = frozenset(),
        on_given: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self.module = module
        # an instance attribute: torch._dynamo.disable wraps this object, copying its __dict__
        self._boxed_call = True
        phs = [n for n in module.graph.nodes if n.op == "placeholder"]
        self.tangents = [(k, n.name) for k, n in enumerate(phs) if n.name.startswith("tangents")]
        self.assumed = assumed
        self.on_given = on_given
        self.variants: dict[tuple[str, ...], fx.GraphModule] = {}

    def __call__(self, args: list[Any]) -> Any:
        none = tuple(name for k, name in self.tangents if args[k] is None)
        if self.assumed and self.on_given is not None:
            given = {
                name: args[k].untyped_storage().nbytes()
                for k, name in self.tangents
                if name in self.assumed and args[k] is not None
            }
            if given:
                self.on_given(given)
        if not none:
            return self.module(args)
        variant = self.variants.get(none)
        if variant is None:
            variant = self.variants[none] = fold_zeros(self.module, frozenset(none))
            log.debug("backward run without the gradients of %s", ", ".join(none))
        return variant(args)


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else None


def _same_tensor(a: Any, b: Any) -> bool:
    """Whether fake tensor ``a`` can stand for ``b``: same size, stride and dtype, on a storage
    no larger than ``b``'s bytes."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    try:
        small = a.untyped_storage().nbytes() <= b.numel() * b.element_size()
    except (NotImplementedError, RuntimeError):
        return False
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and small


def fold_zeros(module: fx.GraphModule, zero: frozenset[str]) -> fx.GraphModule:
    """The variant of ``module`` in which the placeholders named in ``zero`` are zero (their
    arguments are None): see the module docstring. Its calling convention is ``module``'s."""
    graph = fx.Graph()
    writers = _writers(module.graph.nodes)  # an alias of a storage written in place would see it
    reached = _reached(module.graph, zero, writers)
    env: dict[fx.Node, fx.Node] = {}
    zeros: dict[fx.Node, Any] = {}  # node of ``module`` whose value is zero -> its fake value
    made: dict[fx.Node, fx.Node] = {}  # such a node -> the zero tensor made for it

    def materialize(n: fx.Node) -> fx.Node:
        got = made.get(n)
        if got is None:
            val = zeros[n]
            got = graph.call_function(
                zeros_strided, (tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
            )
            got.meta["val"] = val
            made[n] = got
        return got

    def arg(a: Any) -> Any:
        if a in zeros:
            return materialize(a)
        return env[a]

    for n in module.graph.nodes:
        if n.op == "placeholder":
            env[n] = graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
            if n.name in zero:
                zeros[n] = n.meta.get("val")
            continue
        if n.op == "output":  # a gradient no given tangent reaches: None, as in eager autograd
            graph.output(fx.node.map_arg(n.args[0], lambda a: arg(a) if a in reached else None))
            continue
        rule = _rule(n, zeros.__contains__)
        if rule == ZERO:
            zeros[n] = n.meta["val"]
        elif isinstance(rule, fx.Node):  # the addition of a zero: its other operand
            out = n.meta["val"]
            if _same_tensor(_val(rule), out) and not any(
                w is not n for r in (_root(rule), n) for w in writers.get(r, ())
            ):
                env[n] = env[rule]
            else:  # another layout, a larger storage, or one written in place later: a copy
                env[n] = _copy_like(graph, env[rule], out)
        else:
            env[n] = graph.node_copy(n, arg)
    graph.set_codegen(_BoxedCodeGen())
    graph.eliminate_dead_code()
    graph.lint()
    return fx.GraphModule(module, graph)


def _reached(graph: fx.Graph, zero: frozenset[str], writers: dict[fx.Node, list[fx.Node]]) -> set[fx.Node]:
    """The nodes of a backward ``graph`` whose value depends on a tangent that is given (not
    named in ``zero``), through its inputs or an op writing its storage in place. A gradient
    is linear in the tangents: one that depends on none given is zero, and eager autograd,
    which never reaches its parameter from the loss, leaves it None (an optimizer then skips
    the parameter: AdamW's weight decay and moments included), where a zero tensor would
    have it stepped."""
    masks, names = tangent_masks(graph, writers)
    given = sum(1 << k for k, name in enumerate(names) if name not in zero)
    return {n for n, m in masks.items() if m & given}


def tangent_masks(
    graph: fx.Graph, writers: dict[fx.Node, list[fx.Node]] | None = None
) -> tuple[dict[fx.Node, int], list[str]]:
    """Which tangents each node of a backward ``graph`` depends on, through its inputs or an
    op writing its storage in place: a bit mask over the tangents (bit k: the k-th of the
    names returned, in placeholder order)."""
    if writers is None:
        writers = _writers(graph.nodes)
    names: list[str] = []
    masks: dict[fx.Node, int] = {}
    for n in graph.nodes:
        if n.op == "placeholder" and n.name.startswith("tangents"):
            masks[n] = 1 << len(names)
            names.append(n.name)
    changed = True
    while changed:  # an in-place write comes after the nodes that read its storage: again
        changed = False
        for n in graph.nodes:
            m = masks.get(n, 0)
            for a in n.all_input_nodes:
                m |= masks.get(a, 0)
            for w in writers.get(_root(n), ()):
                m |= masks.get(w, 0)
            if m != masks.get(n, 0):
                masks[n] = m
                changed = True
    return masks, names


class MadeZeros:
    """A backward Inductor compiled (boxed: ``(*saved, *tangents)`` in a list), taking None
    for any of its tangents, whose forward's node passes undefined gradients as None
    (:func:`release_unused`): it makes their zero tensors itself, as autograd would have
    (the same bytes, at the same point: the backward's start), and returns None for each
    gradient no given tangent reaches, as eager autograd leaves it (:func:`_reached`).

    Inductor's compiled code cannot be run as a variant (:func:`fold_zeros` rewrites the fx
    module before it is compiled), so the memory stays what ``torch.compile`` holds; the
    gradients become eager's. ``module`` is the backward graph before Inductor compiles it
    (its passes rewrite it in place), read here once; ``compiled`` is set to what Inductor
    compiled of it."""

    def __init__(self, module: fx.GraphModule) -> None:
        self.compiled: Callable[[list[Any]], Any] | None = None  # set once Inductor compiled it
        self._boxed_call = True
        masks, _ = tangent_masks(module.graph)
        phs = [n for n in module.graph.nodes if n.op == "placeholder"]
        self.tangents = [(k, masks[n], n.meta.get("val")) for k, n in enumerate(phs) if n in masks]
        self.every = sum(bit for _, bit, _ in self.tangents)  # every tangent given
        out = next(n for n in reversed(module.graph.nodes) if n.op == "output").args[0]
        outs = out if isinstance(out, (list, tuple)) else (out,)
        self.reached_by = [masks.get(a, 0) if isinstance(a, fx.Node) else 0 for a in outs]

    @staticmethod
    def can_make(module: fx.GraphModule) -> bool:
        """Whether every tangent of ``module`` has a known size and stride (no symbolic one)."""
        for n in module.graph.nodes:
            if n.op == "placeholder" and n.name.startswith("tangents"):
                val = n.meta.get("val")
                if not isinstance(val, torch.Tensor):
                    return False
                if not all(isinstance(d, int) for d in (*val.shape, *val.stride())):
                    return False
        return True

    def __call__(self, args: list[Any]) -> Any:
        assert self.compiled is not None, "MadeZeros called before its backward was compiled"
        given = 0
        for k, bit, val in self.tangents:
            if args[k] is not None:
                given |= bit
            else:
                args[k] = zeros_strided(tuple(val.shape), tuple(val.stride()), val.dtype, val.device)
        grads = self.compiled(args)
        if given == self.every:
            return grads
        kept = [g if reach & given else None for g, reach in zip(grads, self.reached_by, strict=True)]
        return type(grads)(kept) if isinstance(grads, tuple) else kept


def _root(n: fx.Node) -> fx.Node:
    """The node owning ``n``'s storage: ``n`` followed up through views."""
    while is_view_node(n) and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _writers(nodes: Iterable[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """The owners of storages ops of ``nodes`` write in place (the gradient sums
    :mod:`checkmate.codegen` emits as ``add_``) -> those ops."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        schema = getattr(n.target, "_schema", None)
        mutates = n.op == "call_function" and schema is not None and schema.is_mutable
        if mutates and n.args and isinstance(n.args[0], fx.Node):
            out.setdefault(_root(n.args[0]), []).append(n)
    return out


#: :func:`_rule`'s verdict on an op whose result is zero
ZERO = "zero"


def _rule(n: fx.Node, is_zero: Callable[[Any], bool]) -> str | fx.Node | None:
    """What an op reading zero values (``is_zero``) becomes: :data:`ZERO` when its result is
    zero, the operand it equals when it adds a zero to another tensor of its own size and
    dtype, or None when it must run on a zero tensor (or reads no zero)."""
    if n.op != "call_function" or not any(is_zero(a) for a in n.all_input_nodes):
        return None
    out = _val(n)
    if not isinstance(out, torch.Tensor):
        return None
    first = n.args[0] if n.args else None
    if n.target in _ADDS or n.target in _SUBS:
        a, b = n.args[0], n.args[1]
        if is_zero(a) and is_zero(b):
            return ZERO
        keep = a if is_zero(b) else b if n.target in _ADDS and n.kwargs.get("alpha", 1) == 1 else None
        val = _val(keep)
        same = isinstance(val, torch.Tensor) and val.shape == out.shape and val.dtype == out.dtype
        return keep if isinstance(keep, fx.Node) and same else None
    if is_zero(first) and (is_view_node(n) or n.target in _ZERO_FIRST):
        return ZERO
    if n.target in _ZERO_ANY:
        return ZERO
    return None


def added_to_loss(tangent: fx.Node, from_loss: set[fx.Node]) -> bool:
    """Whether ``tangent`` (or a view of it) is only ever added to a gradient computed from a
    loss's (a node of ``from_loss``): the gradient of an output the loss was computed from,
    such as a language model's logits beside its cross-entropy. Its zero then folds away in
    :func:`fold_zeros`: each such addition is its other operand, aliased or copied into a
    tensor of the addition's own size, which the plan counts; no zero of the tangent's
    storage is ever made, so a plan may count the tangent as no bytes."""
    todo, seen, added = [tangent], {tangent}, False
    while todo:
        z = todo.pop()
        for u in z.users:
            if is_view_node(u) and u.args and u.args[0] is z:
                if u not in seen:
                    seen.add(u)
                    todo.append(u)
                continue
            keep = _rule(u, seen.__contains__)
            adds = u.target in _ADDS or u.target in _SUBS
            if not adds or not isinstance(keep, fx.Node) or keep not in from_loss:
                return False
            added = True
    return added


def unread_tangents(joint: fx.GraphModule) -> frozenset[str]:
    """The tangents of ``joint`` a plan may count as no bytes: those of outputs a scalar
    output (a loss) was computed from, which a step differentiating the loss does not give
    (:func:`added_to_loss`): a Hugging Face model given ``labels=`` returns its logits and
    its attention's keys and values beside the loss computed from them. A step that
    differentiates them anyway is caught at its backward (:class:`NoneTangents`)."""
    tangents = [n for n in joint.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    sizes = {t: v.numel() if isinstance(v := t.meta.get("val"), torch.Tensor) else 0 for t in tangents}
    losses = [t for t in tangents if sizes[t] == 1]
    if not losses:
        return frozenset()
    from_loss: set[fx.Node] = set()
    todo = list(losses)
    while todo:  # what is computed from a loss's gradient
        n = todo.pop()
        for u in n.users:
            if u not in from_loss:
                from_loss.add(u)
                todo.append(u)
    return frozenset(t.name for t in tangents if sizes[t] > 1 and added_to_loss(t, from_loss))


def copy_strided(x: torch.Tensor, size: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """``x`` copied into a new tensor of this size and stride."""
    out = torch.empty_strided(tuple(size), tuple(stride), dtype=x.dtype, device=x.device)
    return out.copy_(x)


def _copy_like(graph: fx.Graph, x: fx.Node, out: torch.Tensor) -> fx.Node:
    """A node copying ``x`` into a tensor laid out as ``out`` (an addition of a zero whose
    other operand cannot stand for its result: another layout, or part of a larger storage)."""
    node = graph.call_function(copy_strided, (x, tuple(out.shape), tuple(out.stride())))
    node.meta["val"] = out
    return node
