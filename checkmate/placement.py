"""Where the joint graph's ops run, and which gradient sums are done in place.

Passes over the ownership structure :func:`checkmate.trace.build_graph` derives from an
AOTAutograd joint graph (``owners``: the fx nodes that own an allocation, in fx order;
``inputs``: owner -> the owners it reads; ``backward``: the owners that depend on a
tangent). They decide the order of the graph's nodes, not their sizes or costs:

- :func:`backward_only`: forward ops that only the backward reads move to the backward,
  right before their first reader, as PyTorch's own partitioner does.
- :func:`deferrable`: backward ops larger than all their inputs run right before their
  first reader.
- :func:`lazy_order`: the backward order with those ops placed late.
- :func:`accumulates_into`: a gradient ``add`` of two backward values computed in place
  into one of them, as eager autograd accumulates a tied weight's gradient.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from checkmate.ops import writes_input

__all__ = ["backward_only", "deferrable", "lazy_order", "accumulates_into"]


def backward_only(
    owners: list[fx.Node],
    inputs: dict[fx.Node, set[fx.Node]],
    backward: set[fx.Node],
    pinned: set[fx.Node],
    mem: dict[fx.Node, int],
    *,
    late_masks: bool = False,
) -> set[fx.Node]:
    """Ops that do not depend on a tangent but that only the backward reads (e.g. GELU's
    derivative terms AOTAutograd writes with the forward values: ``3 * 0.044715 * x ** 2``).

    Left in the forward they would be computed at its end and held across the boundary;
    the backward computes them right before their first reader instead, as PyTorch's own
    partitioner does. An op moves when holding its inputs instead costs no more: each input
    is no larger than it (a reduction stays where it lets its input die) or is held into the
    backward anyway, read by another backward op (ReLU's mask ``x <= 0``, a quarter of ``x``
    that the next layer's weight gradient reads: computed in a forward kernel beside ReLU,
    Inductor's C++ code stored the mask at a tenth of the speed of ReLU alone, and a
    ResNet's step took 2.1x torch.compile's). Never outputs, random ops, mutations or one
    output of a multi-output op (``pinned``).

    With ``late_masks`` (Inductor's C++ code, on CPU), a boolean value moves whatever its
    inputs' bytes: Inductor's vectorized C++ stores a bool at about 11 ns an element (torch
    2.13, AVX2 and AVX-512 alike; 1.4 ms for the 131 thousand of a ResNet's last ReLU mask,
    where storing the float ReLU took 0.08 ms) and reads it back slowly too. A ResNet's last
    ReLU feeds only the average pool, so nothing else holds its output into the backward:
    its mask was computed in the forward and held, and the step ran 1.018x PyTorch's at
    ``activation_memory_budget=0.8``; computed in the backward, 0.991x (30 pairs). The
    backward then reads the ReLU's output (or the plan recomputes it): up to four times the
    mask's bytes, which the solver weighs like any other value.
    """
    readers: dict[fx.Node, list[fx.Node]] = {o: [] for o in owners}
    for o, ins in inputs.items():
        for b in ins:
            readers[b].append(o)
    sunk: set[fx.Node] = set()

    def crosses(b: fx.Node, o: fx.Node) -> bool:
        # another backward op reads b: it is held into the backward whether o moves or not
        return any(r is not o and (r in backward or r in sunk) for r in readers[b])

    for o in reversed(owners):  # readers before the values they read
        if o in backward or o in pinned or o.op != "call_function" or not readers[o]:
            continue
        if all(r in backward or r in sunk for r in readers[o]) and (
            (late_masks and _is_bool(o)) or all(mem[o] >= mem[b] or crosses(b, o) for b in inputs[o])
        ):
            sunk.add(o)
    return sunk


def _is_bool(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.bool


def deferrable(
    owners: list[fx.Node],
    inputs: dict[fx.Node, set[fx.Node]],
    backward: set[fx.Node],
    pinned: set[fx.Node],
    mem: dict[fx.Node, int],
) -> set[fx.Node]:
    """Backward ops larger than all their inputs together: computed right before their
    first reader instead of where AOTAutograd lists them.

    Holding such an op's output from where it is listed to its first reader costs more
    than holding its inputs over the same stretch, whatever else is live, so running it
    late never raises the peak of a schedule. The case that matters: a tied embedding's
    gradient (the LM head's ``mm``, vocabulary x width) that AOTAutograd computes first
    in the backward and adds to the embedding's gradient last.
    """
    return {
        o
        for o in owners
        if o in backward
        and o.op == "call_function"
        and o not in pinned
        and mem[o] > sum(mem[b] for b in inputs[o])
    }


def lazy_order(
    owners: list[fx.Node],
    inputs: dict[fx.Node, set[fx.Node]],
    backward: set[fx.Node],
    late: set[fx.Node],
) -> list[fx.Node]:
    """The backward ops in fx order, except that ``late`` ops are placed right before
    their first reader (depth first, inputs before readers); late ops nothing reads
    (outputs) come last."""
    rank = {o: i for i, o in enumerate(owners)}
    placed: set[fx.Node] = set()
    out: list[fx.Node] = []

    def place(o: fx.Node) -> None:
        stack: list[tuple[fx.Node, bool]] = [(o, False)]
        while stack:
            v, expanded = stack.pop()
            if v in placed:
                continue
            if expanded:
                placed.add(v)
                out.append(v)
                continue
            stack.append((v, True))
            for b in sorted(
                (b for b in inputs[v] if b in late and b not in placed), key=rank.__getitem__, reverse=True
            ):
                stack.append((b, False))

    for o in owners:
        if o in backward and o not in late:
            place(o)
    for o in owners:
        if o in late and o not in placed:
            place(o)
    return out


def accumulates_into(
    node: fx.Node,
    base: dict[fx.Node, fx.Node | None],
    backward: set[fx.Node],
    outputs: set[fx.Node],
    multi: set[fx.Node],
) -> fx.Node | None:
    """The addend ``node`` may be computed in place into, or None.

    ``node`` must be a backward ``aten.add.Tensor(a, b)`` (no ``alpha``) whose result is a
    gradient of the step; the addend (the later of the two in the graph) must be a backward
    op's own output (not a view, a placeholder or one output of a multi-output op) that
    nothing but ``node`` reads, with ``node``'s shape, strides and dtype. Then
    ``addend.add_(other)`` gives ``node``'s value bit for bit (addition commutes) in the
    addend's storage. Only gradients qualify: elsewhere the extra read could cost a plan
    more than the allocation it saves.
    """
    if node.target is not torch.ops.aten.add.Tensor or node.kwargs or len(node.args) != 2:
        return None
    if node not in backward or node not in outputs:
        return None
    a, b = node.args
    val = node.meta.get("val")
    if (
        not isinstance(a, fx.Node)
        or not isinstance(b, fx.Node)
        or a is b
        or not isinstance(val, torch.Tensor)
    ):
        return None
    for x in (b, a):  # args precede their users: the later addend is found by walking on
        other = a if x is b else b
        if x.op != "call_function" or base.get(x) is not x or x not in backward or len(x.users) != 1:
            continue
        if x.target is operator.getitem and isinstance(x.args[0], fx.Node) and x.args[0] in multi:
            continue
        xv = x.meta.get("val")
        if (
            not writes_input(x.target)
            and isinstance(xv, torch.Tensor)
            and xv.shape == val.shape
            and xv.stride() == val.stride()
            and xv.dtype == val.dtype
            and _later(x, other)
        ):
            return x
    return None


def _later(x: fx.Node, y: fx.Node) -> bool:
    """True when ``x`` comes after ``y`` in their graph."""
    n = y.next
    while n.op != "root":
        if n is x:
            return True
        n = n.next
    return False
