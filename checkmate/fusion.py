"""Op costs of the step Inductor compiles: a fused op costs the memory it moves.

Checkmate's MILP (Jain et al., MLSys 2020) charges each recomputation the op's cost
``C_i``. Measured eagerly, every aten op is a kernel launch plus its arithmetic. Under
Inductor that holds only for the ops it hands to a library kernel (matrix products,
convolutions, attention: ``extern_kernels`` in its generated code) or to an eager fallback.
Every other op (pointwise arithmetic, reductions, the pieces of LayerNorm, softmax and
dropout after Inductor's decompositions) is generated code, fused with its neighbours into
one loop nest: its time is the bytes it moves through memory, and a recomputation fused
into its consumer's kernel costs about as much again. PyTorch's own partitioner reasons
the same way (``torch/_functorch/partitioners.py`` recomputes "fusible" ops freely and
never matrix products); here the distinction sets the costs the solver weighs instead of a
rule.

The model, per node of the joint graph Inductor gives its partitioner:

- a library or fallback kernel: the measured (or device-profile) cost, unchanged;
- a generated op: the bytes it moves through memory over the device's bandwidth (measured
  once per device, or the profile's): the inputs it reads from memory (the graph's inputs,
  library kernels' outputs) and, when a library kernel or the graph's output reads its
  result, writing that result (a kernel launch of its own too). A generated op whose
  consumers are all generated is fused into them: its result never reaches memory, and
  recomputing it inside its consumer's loop costs its reads from memory (none, inside a
  chain of generated ops: the chain reads its inputs once) plus ``FUSED_FLOOR`` of the write
  of its result, so that no recomputation is free. Views cost 0. To either is added the
  op's arithmetic: its eager cost less the bytes the eager op moves and a launch. Fusion
  saves memory traffic, not arithmetic; on a GPU the difference is about 0, on a CPU a
  ``tanh`` or ``exp`` is bound by its arithmetic (below).
- keeping a generated op's value for the backward: when the forward would not write it
  (no library kernel or output reads it), writing it there and reading it back in the
  backward (:func:`save_cost`), charged by the solvers where the plan hands it over; not
  charged by default (measured on CPU, see :func:`save_cost`).

Before the floor, a fused op was charged at least the whole write of its result, so a chain
of k fused ops recomputed was charged k writes where its kernel makes none: on CPU the plans
of a GPT-2 (4 layers, d=128) under Inductor were planned 2.5 to 4.6 points above the
overhead they measured.

Before the arithmetic term, the same GPT-2's plans were planned 3.6 to 6.2 points *below*
the overhead they measured on CPU. Inductor's kernel profile
(``torch._inductor.config.cpp.enable_kernel_profile``) showed why: the tanh-GELU recomputed
in the backward took 3.7 ms a call where its 4 MiB of reads were priced at 0.45 ms (9.4 GB/s
measured); the kernel is bound by ``tanh``, not by memory. With the arithmetic term, the
next run of the same benchmark planned those rows 0.8 to 3.2 points below what they measured.
"""

from __future__ import annotations

import functools
import operator
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from checkmate.eager import real_tensors
from checkmate.flops import _FLOPS, flat_tensors, op_cost_terms, tensor_span_bytes
from checkmate.ops import is_mutation, is_random_node, is_view, through_views, writes_input

__all__ = [
    "CHARGE_SAVES",
    "FUSED_FLOOR",
    "MIN_SHARE",
    "save_cost",
    "is_library_kernel",
    "fusible",
    "fused_costs",
    "device_speed",
]

#: the share of its result's write a fused op's recomputation is charged beyond its reads
FUSED_FLOOR = 0.05
#: whether ``compiler="inductor"`` charges :func:`save_cost` (off: see its docstring)
CHARGE_SAVES = False
#: no generated op costs less than this share of the graph's costliest op: the exact models
#: resolve costs within a span of 1e9 only (:mod:`solvers.scaling`), and a fused fill of a
#: few bytes came to 3.6e-12 s beside a 8.8e-3 s op (GPT-2: CP-SAT refused the graph)
MIN_SHARE = 1e-7


@functools.cache
def is_library_kernel(target: Any) -> bool:
    """True when Inductor runs ``target`` as a kernel of its own (a library call such as a
    matrix product or convolution, or an eager fallback), not as generated, fusible code."""
    heavy = _FLOPS.get(getattr(target, "overloadpacket", target))
    if heavy is not None and heavy[1]:
        return True
    from torch._inductor import lowering

    if target in lowering.fallbacks:
        return True
    packet = getattr(target, "overloadpacket", None)
    return target not in lowering.lowerings and packet not in lowering.lowerings


def fusible(node: fx.Node) -> bool:
    """Whether Inductor generates ``node``'s code and can fuse it into the kernel that reads
    its result: a ``call_function`` with one tensor output that is no view, no library
    kernel, draws no randomness and writes no input (the candidates
    :func:`checkmate.trace.build_graph` folds into their readers)."""
    if node.op != "call_function" or node.target is operator.getitem or is_view(node.target):
        return False
    target = node.target
    if is_library_kernel(target) or is_random_node(node) or is_mutation(target) or writes_input(target):
        return False
    return isinstance(node.meta.get("val"), torch.Tensor)


def _bytes(node: fx.Node) -> int:
    return sum(tensor_span_bytes(t) for t in flat_tensors(node.meta.get("val")))


def _materialized(node: fx.Node) -> bool:
    """Whether Inductor writes ``node``'s output to memory: a library kernel or the graph's
    output reads it (a generated consumer fuses it into its own loop instead)."""
    return any(
        u.op == "output" or (u.op == "call_function" and is_library_kernel(u.target))
        for u in through_views(node.users, lambda n: n.users)
    )


def _generated_cost(node: fx.Node, bandwidth: float, launch: float) -> float:
    """A generated op's seconds: reading the inputs that live in memory (inputs of the graph,
    library kernels' outputs) and, when its output is materialized, writing it in a kernel
    of its own."""
    producers = through_views(node.all_input_nodes, lambda n: n.all_input_nodes)
    reads = sum(
        _bytes(p)
        for p in producers
        if p.op == "placeholder" or (p.op == "call_function" and is_library_kernel(p.target))
    )
    write = _bytes(node) / bandwidth
    if _materialized(node):
        return reads / bandwidth + write + launch
    # fused: its reads, inside its reader's loop; never 0, or a solver may recompute it
    # without end
    return reads / bandwidth + FUSED_FLOOR * write


def fused_costs(
    nodes: Sequence[fx.Node], costs: Sequence[float], bandwidth: float, launch: float = 0.0
) -> list[float]:
    """The costs of ``nodes`` in the step Inductor compiles.

    Args:
        nodes: joint-graph nodes (``call_function`` nodes carry ``meta['val']``).
        costs: their costs as eager ops (measured or from a device profile), in order.
        bandwidth: device memory bytes/s.
        launch: seconds a generated kernel costs beyond its memory traffic.

    Returns:
        One cost per node: unchanged for library kernels; for generated ops, memory traffic
        plus the arithmetic part of the eager cost (never more than the eager cost, never
        less than ``MIN_SHARE`` of the largest).
    """
    out: list[float] = []
    floor = MIN_SHARE * max(costs, default=0.0)
    for node, cost in zip(nodes, costs, strict=True):
        if (
            node.op != "call_function"
            or cost == 0.0
            or is_view(node.target)
            or is_library_kernel(node.target)
        ):
            out.append(cost)
        else:
            generated = _generated_cost(node, bandwidth, launch) + _arithmetic(node, cost, bandwidth, launch)
            out.append(min(cost, max(floor, generated)))
    return out


def _arithmetic(node: fx.Node, cost: float, bandwidth: float, launch: float) -> float:
    """The part of ``node``'s eager cost that is neither moving its bytes nor a launch: its
    arithmetic, which fusion does not remove. About 0 where eager pointwise ops are bound by
    memory (a GPU; add, mul anywhere); most of the cost of ``tanh``, ``exp`` or ``erf`` on a
    CPU. The eager op reads every input from memory and writes its output: the bytes a
    device profile's roofline counts (:func:`checkmate.flops.op_cost_terms`), so that with a
    profile this is exactly its compute term's excess over its memory term."""
    terms = op_cost_terms(node)
    moved = terms.bytes if terms is not None else 0.0
    return max(0.0, cost - moved / bandwidth - launch)


def save_cost(node: fx.Node, bandwidth: float) -> float:
    """Seconds a compiled step spends only because the forward hands ``node``'s value to the
    backward (:attr:`solvers.graph.Node.save_cost`): for a generated op that no library
    kernel or output reads, Inductor fuses it into its readers and never writes it, unless
    it is saved; saved, the forward writes it and the backward reads it back (twice its
    bytes). 0 for every other op: its value is in memory anyway.

    A plan that keeps such a value where its inputs are kept pays this where recomputing it
    inside the backward's kernel would not: the log-softmax of a GPT-2's logits kept instead
    of the logits (the matrix product's output) made the compiled forward 4 ms slower and
    the backward 2 ms, 3% of the step, at the same saved bytes.

    Not charged by default (:data:`CHARGE_SAVES`): on CPU, plans made with it ran slower.
    Charged, the solvers recompute fused values to avoid it (at the fraction 1.0, a GPT-2's
    plan recomputed instead of keeping everything), and those plans measured +2 to +5%
    against plain ``torch.compile`` where the plans made without it measured -0.5 to +1.2%
    (a GPT-2 and a Llama-like model, 2-core CPU). The bytes model is wrong there the other
    way: the CPU's generated kernels are mostly bound by their arithmetic, and a store of a
    4 MiB intermediate hides under it; only the 16 MiB log-softmax did not. A GPU's fused
    kernels are bound by memory, where this model should hold: to be measured there.
    """
    if not fusible(node) or _materialized(node):
        return 0.0
    return 2 * _bytes(node) / bandwidth


def _timed(fn: Any, dev: torch.device, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def _device_key(device: torch.device | str) -> str:
    """``device`` as one string per physical device (``cuda`` is the current ``cuda:N``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return str(dev)


@functools.cache
def _measured_speed(device: str) -> tuple[float, float]:
    with real_tensors():  # called from inside the partitioner (checkmate.eager)
        return _speed(torch.device(device))


def _speed(dev: torch.device) -> tuple[float, float]:
    src = torch.ones((64 << 20) // 4, device=dev)  # 64 MiB of float32: well past the caches
    dst = torch.empty_like(src)
    bandwidth = 2 * src.nbytes / max(_timed(lambda: dst.copy_(src), dev), 1e-9)  # read + write
    tiny = torch.ones(1, device=dev)

    def launches() -> None:
        for _ in range(100):
            tiny.add_(1.0)

    return bandwidth, _timed(launches, dev) / 100


def device_speed(profile: str | None, device: torch.device | str) -> tuple[float, float]:
    """The device's memory bandwidth (bytes/s) and the seconds one kernel launch costs: the
    profile's, or measured once per process when planning with measured costs (a copy of
    64 MiB, read and write counted; a hundred one-element kernels back to back).

    The copy holds 128 MiB for a moment: :func:`checkmate.optimize` measures it as it is
    called, on the device of the model's parameters, so that no training step does (inside
    the step that plans, it stood 82x over a small model's budget of 1.6 MB)."""
    if profile is not None:
        from checkmate.profile import load_profile

        prof = load_profile(profile)
        return float(prof.memory_bandwidth), float(prof.launch_overhead)
    return _measured_speed(_device_key(device))
