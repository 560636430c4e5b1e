"""What the layers of :class:`checkmate.runtime.Planner` share: its warnings, the constants that
tune it, the texts its warnings are made of, and small helpers on its records."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from checkmate.codegen import SplitModules, generate
from checkmate.records import PlanRecord
from checkmate.split import gradient_bytes
from checkmate.trace import JointGraph
from solvers.errors import InfeasibleBudgetError
from solvers.result import SolveResult
from solvers.schedule import COMPUTE, FREE, PAGEIN, PAGEOUT, schedule_from_order, simulate

#: at its first call, a graph after which the step goes on (a graph break) is planned with
#: at least this many times the bytes of its outputs' gradients free at its forward/backward
#: boundary, for the graphs after it (:meth:`Planner._later_room`): a loss on the outputs
#: holds about three such values (its input, its log-softmax or difference, the gradient it
#: returns). Measured: a Hugging Face GPT-2 with labels= (the loss split off) planned
#: without room stepped at 1.34x a byte budget of 0.7 of eager's peak at its first call;
#: its loss graph's least peak is 3.0x its input's bytes
LATER_ROOM = 3


#: bytes of a scalar: a graph whose differentiable outputs are no larger computed a loss
SCALAR_BYTES = 8


#: a guessed room more than this share of the budget above what the graphs after it need
#: is replanned at the next call (:meth:`Planner.finish_call`)
GUESS_SLACK = 0.05


#: a step whose backward ran again through the graph of one forward (retain_graph=True), in
#: words; what makes it one backward; and the warning where its plans made so do not fit
RETAINED_WHY = (
    "a backward ran through the module's graph again (backward(retain_graph=True), then another backward "
    "through the same forward), and autograd holds every value the forward saved until the last backward, "
    "where the plans free each one at its last read"
)


RETAINED_ADVICE = (
    "sum the losses and call backward once ((loss1 + loss2).backward() accumulates the same gradients)"
)


class BudgetWarning(UserWarning):
    """The budget may not hold as asked: a graph was planned above the fraction asked (the
    fraction is infeasible for it, and it is too small a part of its step to set the step's
    peak, see :meth:`Planner.partition`), or ``compiler="inductor"`` runs the step with
    buffers of Inductor's own, whose peak the plan does not bound exactly. Or it did not hold:
    a training step measured whole exceeded it (memory held outside the module, a graph run
    more often than planned), and the module is compiled again with room for that
    (:meth:`Planner.check_step`), or no plan leaves that room. The warnings of this library
    each say which, by how much, and what to change."""


class OverheadWarning(UserWarning):
    """A plan more than doubles its graph's compute (:data:`COSTLY`): usually the budget is
    close to the least the graph runs in, where the cost of each byte saved climbs steeply (a Hugging
    Face MPNet's graph under ``compiler="inductor"``: +1,017% at 3.78 MiB, +38% at 4.06 MiB).
    Or a Python number among a module's inputs changes from call to call, and each value compiles
    and plans the step again (:func:`checkmate.recompiles.warn_if_numbers_vary`), or its inputs' shapes
    do (:func:`checkmate.recompiles.warn_if_shapes_vary`). The budget holds; the step is slow."""


#: a plan whose compute is more than this over its graph's, without recomputation, warns
#: (:class:`OverheadWarning`)
COSTLY = 1.0


#: ``SolveResult.info`` key of the plan keeping every value checked compiled in place of the plan
#: at the least simulated peak, whose compute overhead (a fraction) it holds (:meth:`Planner._at_least_peak`)
LEAST_COSTLY = "least_peak_overhead"


@dataclass(frozen=True)
class _Unsettled:
    """A graph planned above the fraction asked while the graphs after it in its step were
    unknown: its record's index, its keep-all peak, and the error that stands unless a
    later graph of the step is at least twice that peak."""

    index: int
    peak: int
    error: InfeasibleBudgetError


def _held_bytes(record: PlanRecord, *, as_run: bool = False) -> tuple[int, int, int]:
    """Of ``record``'s plan, simulated: the bytes held at its forward/backward boundary (what
    the forward hands to the backward, and its outputs), its peak, and the bytes its backward
    leaves (gradients).

    A schedule may keep values past their last read (a DTR-style one, which evicts only
    under pressure), which its simulation counts and the generated code does not: it drops
    each at its last read. ``as_run`` simulates the plan's computes so, as they run: what a
    step measured whole is compared with (:meth:`Planner.check_step`). Counted as the
    schedule keeps them, a TinyTransformer's plan at +397% compute held 23.1 MiB at its
    boundary where the step held about 12 MiB, so that the 11.9 MiB its loss outside held
    there were measured as 0.9 MiB, and the plan made with that room stepped at 1.12-1.22x
    the budget."""
    graph, schedule = record.joint.graph, record.result.schedule
    if schedule is None:
        return 0, int(record.result.peak or 0), 0
    if as_run and any(op != COMPUTE and op != FREE for op, _ in schedule.steps):
        as_run = False  # a paging plan's offloads are not among its computes
    sim = simulate(graph, schedule_from_order(graph, schedule.computes) if as_run else schedule)
    return sim.boundary, int(sim.peak), gradient_bytes(graph)


def _codegen(joint: fx.GraphModule, jg: JointGraph, res: SolveResult) -> tuple[SplitModules, tuple[str, ...]]:
    """The forward and backward running ``res``'s schedule; when it pages, the values it
    holds on the host across the forward/backward boundary."""
    assert res.schedule is not None
    modules = generate(joint, jg, res.schedule, res.budget)
    if not any(op in (PAGEOUT, PAGEIN) for op, _ in res.schedule.steps):
        return modules, ()
    from checkmate.paging import page_saved

    done = page_saved(modules, jg, res.schedule)
    return done.modules, done.paged
