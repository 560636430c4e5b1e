"""A step split into several graphs (graph breaks, DDP's gradient buckets): what each holds
while the others run, and which of the outputs it hands on the loop drops.

The graphs' forwards run in order and their backwards in reverse. While graph ``j``'s
forward runs, the graphs before it hold what their forwards handed to their backwards and
their outputs (``S``, the bytes at a graph's forward/backward boundary); the graphs after it
have not run. While its backward runs, the graphs after it have left their gradients
(``G``), less those of inputs an earlier graph made, which are graph ``j``'s own tangents
(counted in its peak) as it starts; and the outputs of the graphs before it that nothing
reads any more are gone. A Hugging Face language model given ``labels=`` is two graphs, the
model's and its loss's after a graph break: a loop that drops the model's output
(``model(**batch).loss.backward()``, the ``Trainer``) frees the logits once the loss
graph's forward has read them, where one keeping ``outputs`` holds them through the
backward. The runtime watches each backward's start for those outputs
(:class:`OutputWatch`) rather than guess which loop it runs in.

Simulated, the step's peak is ``max_j max(F_j, B_j)`` with::

    F_j = sum_{i<j} S_i + P^fwd_j
    B_j = sum_{i<j} S_i - dropped_j + P^bwd_j + sum_{k>j} G_k - min(T_j, sum_{k>j} A_k)

``P^fwd``/``P^bwd`` a graph's peak before and from its backward's start (its compiled peak
for both where Inductor's was measured), ``T`` the gradients its backward is given,
``A`` those of ``G`` handed to an earlier graph's backward, ``dropped_j`` the outputs of
the graphs before it found gone at its backward's start. A graph that runs ``r`` times in
the step counts ``r S``, ``r G`` and, beside its own peak, ``(r - 1) max(S, G)``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.fx as fx

from checkmate.records import PlanRecord
from checkmate.trace import JointGraph
from solvers.graph import Graph
from solvers.schedule import COMPUTE, Schedule, simulate

__all__ = [
    "OutputWatch",
    "Share",
    "could_drop",
    "input_gradients",
    "loose_outputs",
    "saved_inputs",
    "share_of",
    "step_estimates",
    "tangent_bytes",
]

#: a tensor's size and dtype
Key = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class Share:
    """One graph's part in its step's peak, simulated for one run of its plan.

    Attributes:
        held: bytes at its forward/backward boundary: what its forward hands to its
            backward, and its outputs (``S``).
        forward: its peak before its backward starts.
        backward: its peak from its backward's start (its tangents included).
        grads: the bytes its backward leaves (``G``: gradients of its inputs).
        input_grads: of ``grads``, those of inputs an earlier graph made, handed to that
            graph's backward as its tangents (``A``).
        tangents: the gradients of its outputs its backward is given (``T``).
    """

    held: int
    forward: int
    backward: int
    grads: int
    input_grads: int = 0
    tangents: int = 0

    @property
    def peak(self) -> int:
        """Its own peak, forward or backward."""
        return max(self.forward, self.backward)


def share_of(record: PlanRecord) -> Share:
    """``record``'s :class:`Share`, its plan simulated; its compiled step's measured peak as
    both its forward's and backward's where Inductor's was measured (fused kernels never
    hold much of what the graph model counts)."""
    graph, schedule = record.joint.graph, record.result.schedule
    grads = gradient_bytes(graph)
    tangents = tangent_bytes(graph)
    measured = None if record.compiled is None else record.compiled.measured
    if schedule is None:
        peak = int(measured if measured is not None else record.result.peak or 0)
        return Share(0, peak, peak, grads, record.input_grads, tangents)
    sim = simulate(graph, schedule)
    start = backward_start(graph, schedule)
    forward = int(sim.timeline[:start].max()) if start else 0
    backward = int(sim.timeline[start:].max()) if start < len(sim.timeline) else 0
    if measured is not None:
        forward = backward = int(measured)
    return Share(sim.boundary, forward, backward, grads, record.input_grads, tangents)


def backward_start(graph: Graph, schedule: Schedule) -> int:
    """The index of ``schedule``'s first step computing a backward node (its length when
    none does)."""
    backward = graph.backward_mask
    return next(
        (s for s, (op, i) in enumerate(schedule.steps) if op == COMPUTE and backward[i]), len(schedule.steps)
    )


def _gradient_sizes(graph: Graph) -> list[int]:
    """The bytes of each of ``graph``'s backward outputs (its gradients), which the sink reads."""
    backward = graph.backward_mask
    return [int(graph.mem[i]) for i in graph.preds[graph.n - 1] if backward[i]]


def gradient_bytes(graph: Graph) -> int:
    """The bytes of ``graph``'s backward outputs (its gradients), which the sink reads."""
    return sum(_gradient_sizes(graph))


def largest_gradient(graph: Graph) -> int:
    """The bytes of ``graph``'s largest backward output: where calls of it share one
    backward, autograd sums each gradient of theirs with the earlier ones' out of place, as a
    compiled backward returns them all at once, beside both (the first sum is the largest)."""
    return max(_gradient_sizes(graph), default=0)


def tangent_bytes(graph: Graph) -> int:
    """The bytes of the gradients of ``graph``'s outputs its backward is given."""
    return sum(n.mem for n in graph.nodes if n.op.startswith("tangents"))


def step_estimates(shares: Sequence[Share], runs: Sequence[int], dropped: Sequence[int]) -> list[int]:
    """The simulated peak of a step while each of its graphs runs (module docstring):
    ``shares`` in call order, each graph run ``runs`` times, ``dropped`` the bytes of the
    earlier graphs' outputs gone at each one's backward."""
    held = [s.held * r for s, r in zip(shares, runs)]
    before = [0, *accumulate(held)]
    grads = [s.grads * r for s, r in zip(shares, runs)]
    handed = [s.input_grads * r for s, r in zip(shares, runs)]
    after = [*accumulate(grads[::-1], initial=0)][::-1][1:]  # sum over k > j
    handed_after = [*accumulate(handed[::-1], initial=0)][::-1][1:]
    estimates = []
    for j, (s, r) in enumerate(zip(shares, runs)):
        own = (r - 1) * max(s.held, s.grads)  # its other runs in the step
        forward = before[j] + s.forward + own
        backward = before[j] - dropped[j] + s.backward + own + after[j] - min(s.tangents, handed_after[j])
        estimates.append(max(forward, backward))
    return estimates


def could_drop(records: Sequence[PlanRecord], runs: Sequence[int]) -> list[int]:
    """Per graph of a step (``records`` in call order, run ``runs`` times each), the most
    bytes of the earlier graphs' loose outputs (:attr:`PlanRecord.loose`) a loop can have
    dropped when its backward starts: not those of a size and dtype a graph after theirs,
    up to this one, saved for its backward (it holds them: a layer reading them keeps its
    input)."""
    saved = [saved_inputs(r) for r in records]
    got = []
    for j in range(len(records)):
        got.append(
            sum(
                b * runs[i]
                for i in range(j)
                for key, b in records[i].loose.items()
                if not any(key in saved[k] for k in range(i + 1, j + 1))
            )
        )
    return got


def saved_inputs(record: PlanRecord) -> frozenset[Key]:
    """The sizes and dtypes of the inputs ``record``'s forward saves for its backward."""
    names = set(record.modules.saved)
    return frozenset(
        (tuple(int(d) for d in n.meta["val"].shape), n.meta["val"].dtype)
        for n in record.modules.forward.graph.find_nodes(op="placeholder")
        if n.name in names and isinstance(n.meta.get("val"), torch.Tensor)
    )


def loose_outputs(joint: fx.GraphModule, jg: JointGraph) -> dict[Key, int]:
    """The outputs of ``jg``'s forward that its backward does not read (a language model's
    logits, handed to a loss after a graph break): size and dtype -> bytes. An output the
    backward reads, or one of a size and dtype another output shares, is not among them: a
    loop may drop these, and the others live on through the backward."""
    graph = jg.graph
    out = next(iter(joint.graph.find_nodes(op="output")))
    sink, backward = graph.n - 1, graph.backward_mask
    found: dict[Key, int] = {}
    shared: set[Key] = set()
    seen: set[int] = set()
    for node in out.args[0][: jg.num_fwd_outputs]:
        val = node.meta.get("val") if isinstance(node, fx.Node) else None
        i = jg.group.get(node.name) if isinstance(node, fx.Node) else None
        if not isinstance(val, torch.Tensor):
            continue
        key: Key = (tuple(int(d) for d in val.shape), val.dtype)
        if i is None or backward[i] or any(backward[v] and v != sink for v in graph.succs[i]) or key in found:
            shared.add(key)
        elif i not in seen:
            seen.add(i)
            found[key] = int(graph.mem[i])
    return {k: b for k, b in found.items() if k not in shared}


def input_gradients(joint: fx.GraphModule, jg: JointGraph, made: Sequence[bool]) -> int:
    """The bytes of ``jg``'s gradients of inputs autograd made (``made``, per primal: an
    earlier graph's outputs), which that graph's backward is handed as its tangents. 0
    where ``made`` does not match the primals."""
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if n.name.startswith("primals")]
    if len(primals) != len(made) or not any(made):
        return 0
    out = next(iter(joint.graph.find_nodes(op="output")))
    grads = out.args[0][jg.num_fwd_outputs :]
    graph, backward = jg.graph, jg.graph.backward_mask
    ids = {jg.group.get(g.name) for g, m in zip(grads, made) if m and isinstance(g, fx.Node)}
    return sum(int(graph.mem[i]) for i in ids if i is not None and backward[i])


class OutputWatch:
    """The outputs a call's graphs handed on that their backwards do not read
    (:func:`loose_outputs`), weakly, to find at each later graph's backward start how many
    bytes of them the loop dropped."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.loose = 0

    def add(self, outputs: Sequence[Any], loose: Mapping[Key, int]) -> None:
        """A graph's ``outputs``, of which those of a size and dtype in ``loose`` are watched."""
        found: set[Key] = set()
        for t in outputs:
            if not isinstance(t, torch.Tensor):
                continue
            key: Key = (tuple(t.shape), t.dtype)
            if key in loose and key not in found:
                found.add(key)
                self.refs.append(weakref.ref(t))
        self.loose += sum(loose[k] for k in found)

    def snapshot(self) -> OutputWatch:
        """The outputs watched so far (those of the graphs before the one that runs now)."""
        got = OutputWatch()
        got.refs, got.loose = list(self.refs), self.loose
        return got

    def dropped(self) -> int:
        """The bytes of the watched outputs no longer held (by the loop, or by a later graph
        that saved them for its backward): their graphs' loose bytes less those alive. A
        view the loop keeps of a dropped output is not seen (the step check measures it)."""
        alive: dict[int, int] = {}
        for ref in self.refs:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                alive[storage.data_ptr()] = storage.nbytes()
        return max(self.loose - sum(alive.values()), 0)
