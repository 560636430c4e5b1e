"""What an aten op does to memory, read from its schema: the predicates every stage shares.

Tracing (which nodes become graph nodes), timing (which nodes cost nothing), scratch
measurement and codegen (which nodes must never run outside the step) all ask the same
questions of an op; they are answered here once, from the op's schema and tags.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

__all__ = [
    "is_view",
    "is_view_node",
    "through_views",
    "writes_input",
    "is_mutation",
    "is_random",
    "is_random_node",
    "host_arguments",
    "host_placed",
    "named_arguments",
    "output_mask",
]

#: ops that return an alias of their input (or take no new storage) whose schema does not say so
_EXTRA_VIEWS = {
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.lift_fresh.default,
}


def is_view(target: Any) -> bool:
    """True when the op returns aliases of its inputs without writing them (no new storage)."""
    if target in _EXTRA_VIEWS:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    infos = [r.alias_info for r in schema.returns]
    return all(info is not None and not info.is_write for info in infos)


def is_view_node(node: fx.Node) -> bool:
    """:func:`is_view` of a ``call_function`` node (other nodes are not views)."""
    return node.op == "call_function" and is_view(node.target)


def through_views(nodes: Iterable[fx.Node], step: Callable[[fx.Node], Iterable[fx.Node]]) -> list[fx.Node]:
    """The nodes reached from ``nodes`` that are not views or ``getitem``s, walking through
    those with ``step`` (a node's users to find what reads a value, its inputs to find what
    a value is made of)."""
    out, todo, seen = [], list(nodes), set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_view_node(n) or (n.op == "call_function" and n.target is operator.getitem):
            todo.extend(step(n))
        else:
            out.append(n)
    return out


def writes_input(target: Any) -> bool:
    """In-place ops return the input they wrote: they allocate nothing."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    info = schema.returns[0].alias_info
    return info is not None and info.is_write


def is_mutation(target: Any) -> bool:
    """True when the op writes one of its arguments (BatchNorm statistics, ``add_``, ``copy_``):
    it must run exactly once per step, never as a recompute or outside the step."""
    schema = getattr(target, "_schema", None)
    return schema is not None and bool(schema.is_mutable)


def named_arguments(
    target: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> list[tuple[str | None, Any]]:
    """The arguments of a call of ``target`` with their schema names (None for a positional
    argument the schema does not name, or for every argument of an op without a schema):
    positional ones first, then keyword ones as given."""
    schema = getattr(target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    out: list[tuple[str | None, Any]] = [
        (names[i] if i < len(names) else None, a) for i, a in enumerate(args)
    ]
    return out + list(kwargs.items())


def output_mask(target: Any) -> tuple[int, str] | None:
    """The position and name of ``target``'s argument that says which of its outputs to
    compute (a ``bool[]`` named ``output_mask``, ``grad_input_mask`` or ``mask``, one entry
    per output: ``convolution_backward``, ``native_batch_norm_backward``,
    ``native_layer_norm_backward``, memory-efficient attention's backward), or None for an
    op without one."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    for i, a in enumerate(schema.arguments):
        if (
            a.name.endswith("mask")
            and isinstance(a.type, torch.ListType)
            and a.type.getElementType() == torch.BoolType.get()
            and len(schema.returns) == a.N
        ):
            return i, a.name
    return None


#: the attention backward kernels that read the philox seed and offset on the host (flash and
#: memory-efficient attention keep them on the CPU); cuDNN attention reads them on the device
_HOST_PHILOX_OPS = frozenset(
    {
        "aten::_scaled_dot_product_flash_attention_backward",
        "aten::_scaled_dot_product_efficient_attention_backward",
        "aten::_efficient_attention_backward",
    }
)


def host_arguments(target: Any) -> frozenset[str]:
    """Names of the tensor arguments a CUDA kernel of ``target`` reads on the host, which must
    be CPU tensors when the op is run outside the step (op timing, scratch measurement): the
    philox seed and offset of flash and memory-efficient attention with dropout. Traced, their
    example values may name the GPU; given GPU tensors, those kernels segfault. cuDNN
    attention's backward is the opposite: it refuses CPU ones, so it gets none here."""
    schema = getattr(target, "_schema", None)
    if schema is None or schema.name not in _HOST_PHILOX_OPS:
        return frozenset()
    return frozenset(a.name for a in schema.arguments if a.name.startswith("philox_"))


def host_placed(
    target: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` for running ``target`` outside the step (op timing, scratch
    measurement), with each tensor its CUDA kernel reads on the host (:func:`host_arguments`)
    replaced by zeros on the CPU (a philox seed and offset: any value times alike)."""
    on_host = host_arguments(target)
    if not on_host:
        return args, kwargs
    named = [
        (k, torch.zeros(v.shape, dtype=v.dtype) if k in on_host and isinstance(v, torch.Tensor) else v)
        for k, v in named_arguments(target, args, kwargs)
    ]
    return tuple(v for _, v in named[: len(args)]), {str(k): v for k, v in named[len(args) :]}


def is_random(target: Any) -> bool:
    """True for ops whose output depends on the RNG state (dropout's ``bernoulli``, ``rand``):
    recomputing them would draw fresh randomness."""
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


#: the arguments by which an op tagged random draws randomness only when they are not 0
_DRAW_PROBABILITIES = ("dropout_p", "p")


def is_random_node(node: Any) -> bool:
    """:func:`is_random` for one call: an op that draws only through a dropout probability
    that is 0 here is deterministic, and so is one that replays a draw from the philox seed
    and offset it is passed (attention's backward). Every scaled-dot-product attention kernel is tagged
    random for its dropout, also at ``dropout_p=0.0`` (what transformers' models run
    without attention dropout): taken as random, each layer's attention output
    was held from the forward to the backward at any budget, and could not be recomputed."""
    target = getattr(node, "target", None)
    if not is_random(target):
        return False
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    if any(a.name.startswith("philox_") for a in schema.arguments):
        # an attention backward is tagged random too, but it replays the draw whose seed and
        # offset it is given: deterministic. Taken as random, its scratch went unmeasured, and
        # on an H100 memory-efficient attention's backward workspace (2 MiB on a small GPT-2)
        # put the step 1.02x over its budget
        return False
    given = dict(named_arguments(target, getattr(node, "args", ()), getattr(node, "kwargs", {})))
    for arg in schema.arguments:
        if arg.name in _DRAW_PROBABILITIES and isinstance(arg.type, torch.FloatType):
            value = given.get(arg.name, arg.default_value)
            return not (isinstance(value, int | float) and not isinstance(value, bool) and value == 0)
    return True
