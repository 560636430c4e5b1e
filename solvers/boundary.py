"""A bound on what a plan holds at its forward/backward boundary, beside its peak.

A step split into several graphs (graph breaks, DDP's gradient buckets) runs their
forwards in order and their backwards in reverse: while a later graph runs, an earlier one
holds what its forward handed to its backward. The step then fits a budget ``B`` only if
each graph's own peak fits beside what the others hold *and* its boundary hold leaves room
for the graphs that run between its forward and its backward. A peak budget alone is blind
to the second: two plans of equal peak can hold very different amounts at the boundary.

The bound is planned by every strategy unchanged, through the graph: a zero-cost
*ballast* node of about ``peak - boundary`` bytes is inserted right before the first
backward node and read by it, as :mod:`checkmate.trace` models an
op's scratch space (:func:`with_ballast`). Any schedule of that graph within ``peak`` bytes
holds at most ``boundary`` bytes when the backward starts, and is a schedule of the
original graph once the ballast's steps are dropped (:func:`without_ballast`); the one
simulator then checks it on the original graph (:func:`solvers.api.solve`).

A backward run again through the graph of one forward (``retain_graph=True`` on the
backwards before the last) holds every value the forward handed to the backward until the
last one, where a plan frees each at its last read, and runs beside the gradients the
backwards before it left: :func:`retained_peaks` simulates that step.

Memory held beside the forward only, and freed as the backward starts (the last step's
gradients, where a training loop calls ``zero_grad`` between the forward and the backward),
is planned the same way: a node of those bytes made first, not recomputable, and read by
the first backward node (:func:`with_forward_hold`); :func:`forward_peak` checks a plan's
forward beside them.
"""

from __future__ import annotations

from dataclasses import replace

from solvers.graph import Graph, Node
from solvers.schedule import COMPUTE, FREE, Schedule, simulate

__all__ = [
    "BALLAST",
    "HOLD",
    "boundary_hold",
    "forward_peak",
    "retained_peaks",
    "with_ballast",
    "with_forward_hold",
    "without_ballast",
]

#: name of the ballast node (see the module docstring)
BALLAST = "__boundary_ballast__"
#: name of the node that holds memory through the forward only (:func:`with_forward_hold`)
HOLD = "__forward_hold__"


def boundary_hold(graph: Graph, schedule: Schedule) -> int:
    """Bytes resident right before ``schedule``'s first compute of a backward node (what the
    forward hands to the backward, and its outputs): :attr:`SimResult.boundary`, which a
    caller that has simulated the schedule reads instead."""
    return simulate(graph, schedule).boundary


def forward_peak(graph: Graph, schedule: Schedule) -> int:
    """The most bytes ``schedule`` holds before its first compute of a backward node (its
    forward, up to the forward/backward boundary): what must fit beside memory held through
    the forward only, such as the gradients of the last step that a training loop frees
    between the forward and the backward (``optimizer.zero_grad()`` after the loss). A plan
    whose boundary is bounded (:func:`with_ballast`) can still hold more while its forward
    runs (a large value computed and dropped before the boundary): the caller checks this."""
    timeline = simulate(graph, schedule).timeline
    bwd = graph.backward_mask
    steps = schedule.steps
    start = next((s for s, (op, i) in enumerate(steps) if op == COMPUTE and bwd[i]), len(steps))
    return int(timeline[:start].max()) if start else 0


def retained_peaks(graph: Graph, schedule: Schedule, grads: int, backwards: int = 2) -> tuple[int, int]:
    """The peaks of ``schedule`` run as a step of ``backwards`` backwards through the graph of
    one forward (``retain_graph=True`` on each but the last): ``(held, last)``, that of its
    forward and of the backwards holding what the forward saved, and that of its last one.
    Autograd holds what the forward saved through each backward but the last (the simulator
    frees each saved value at its last read; a value the backward frees unread, to recompute
    it, is not saved); the last frees them as the plan does. Each backward after the first runs beside ``grads`` bytes:
    the gradients the ones before it left, accumulated into one copy. A copy recomputed in
    the backward counts beside the held one, as it runs. Schedules with steps other than
    computes and frees (paging) are bounded by their peak, their boundary and ``grads``
    together."""
    sim = simulate(graph, schedule)
    steps = schedule.steps
    bwd = graph.backward_mask
    start = next((s for s, (op, i) in enumerate(steps) if op == COMPUTE and bwd[i]), len(steps))
    if start == len(steps) or backwards < 2:
        return sim.peak, sim.peak
    if any(op not in (COMPUTE, FREE) for op, _ in steps):
        return sim.peak + sim.boundary + grads, sim.peak + grads
    resident: set[int] = set()
    for op, i in steps[:start]:
        if op == COMPUTE:
            resident.add(i)
        else:
            resident.discard(i)
    forward = {i for i in resident if not bwd[i]}
    preds = graph.preds
    saved: set[int] = set()
    mem = graph.mem
    held = 0  # bytes of saved values the simulator freed by now
    before = int(sim.timeline[:start].max()) if start else 0
    kept = 0  # the peak of a backward holding what the forward saved
    for s in range(start, len(steps)):
        op, i = steps[s]
        if op == COMPUTE:
            saved.update(j for j in preds[i] if j in forward)
        elif i in forward:
            forward.discard(i)
            if i in saved:
                held += int(mem[i])
        kept = max(kept, int(sim.timeline[s]) + held)
    last = int(sim.timeline[start:].max()) + grads
    return max(before, kept + (grads if backwards > 2 else 0)), last


def with_forward_hold(graph: Graph, nbytes: int) -> Graph:
    """``graph`` with a node of ``nbytes`` inserted first (every id moves up by one), made
    once (not recomputable) and read by the first backward node: memory held beside the
    whole forward and freed as the backward starts, such as the gradients of the last step
    that a training loop frees between the forward and the backward. Any schedule of the
    result within a budget fits beside them through its forward and within the budget after;
    :func:`without_ballast` (at 0) gives the schedule of ``graph``.

    Raises:
        ValueError: the graph has no backward node, or ``nbytes`` is negative.
    """
    at = graph.first_backward
    if at >= graph.n:
        raise ValueError(
            f"graph {graph.name!r} has no backward node: nothing is held through its forward only"
        )
    if nbytes < 0:
        raise ValueError(f"a hold of {nbytes} bytes: it must be >= 0")
    nodes = [replace(nd, id=nd.id + 1) for nd in graph.nodes]
    nodes.insert(0, Node(id=0, name=HOLD, cost=0.0, mem=nbytes, recomputable=False, key=HOLD))
    edges = [(u + 1, v + 1) for u, v in graph.edges] + [(0, at + 1)]
    return Graph(tuple(nodes), tuple(sorted(edges)), name=graph.name, meta=graph.meta)


def with_ballast(graph: Graph, peak: int, boundary: int) -> tuple[Graph, int]:
    """``graph`` with a zero-cost *ballast* node inserted right before its first backward
    node and read by it (nodes from there on move up by one), and the ballast's id.

    The ballast holds ``peak - boundary`` bytes less that node's output. Every strategy
    computes nodes for the first time in id order (each is checked: :func:`solvers.api.solve`
    measures the bound on the plan it returns), so that node is the first backward op a
    schedule runs; the ballast is resident beside it then, and any schedule of the result
    within ``peak`` bytes holds at most ``boundary`` bytes right before its backward starts.
    The ballast is freed once that node has run: the rest of the backward does not carry it.

    Raises:
        ValueError: the graph has no backward node, or ``boundary`` is negative.
    """
    at = graph.first_backward
    if at >= graph.n:
        raise ValueError(f"graph {graph.name!r} has no backward node: it has no forward/backward boundary")
    if boundary < 0:
        raise ValueError(f"a boundary of {boundary} bytes: it must be >= 0")
    ballast = max(peak - boundary - int(graph.mem[at]), 0)
    shift = lambda i: i + 1 if i >= at else i  # noqa: E731
    nodes = [replace(nd, id=shift(nd.id)) for nd in graph.nodes]
    nodes.insert(at, Node(id=at, name=BALLAST, cost=0.0, mem=ballast, backward=True, key=BALLAST))
    edges = [(shift(u), shift(v)) for u, v in graph.edges] + [(at, at + 1)]
    return Graph(tuple(nodes), tuple(sorted(edges)), name=graph.name, meta=graph.meta), at


def without_ballast(schedule: Schedule, at: int) -> Schedule:
    """The schedule of the original graph: ``schedule`` (of :func:`with_ballast`'s graph,
    ballast ``at``) without the ballast's steps, the ids after it moved back down. Its stage
    matrices are dropped (the ballast's stage has no counterpart)."""
    steps = tuple((op, i - 1 if i > at else i) for op, i in schedule.steps if i != at)
    return Schedule(steps)
