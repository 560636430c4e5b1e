"""What was planned for one compiled graph: :class:`PlanRecord`, for reports and tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from checkmate.codegen import SplitModules, run_seconds
from checkmate.compiled import Calibration
from checkmate.trace import JointGraph
from solvers.budget import format_bytes, format_change
from solvers.graph import Graph
from solvers.result import SolveResult

__all__ = ["HELD_TO", "KEEPS_ALL", "PlanRecord", "records_overhead"]

#: the ``SolveResult.info`` key of a graph of a family run keeping every value, because that
#: fits its sizes (a short last batch): not a plan made, and none for the family to reuse
#: (:mod:`checkmate.families`)
KEEPS_ALL = "keeps_all"
#: the ``SolveResult.info`` key of the bytes a plan's step must hold, where the plan was
#: made at more simulated bytes than that (a family plan carried over at the ratio its
#: compiled check found, :func:`checkmate.families.reuse`)
HELD_TO = "held_to"


def overhead(result: SolveResult, graph: Graph) -> float:
    """A plan's compute over ``graph``'s without recomputation, less one (0.25: +25%; 0 for
    a plan without a cost or a graph without compute)."""
    return (result.cost or 0.0) / graph.total_cost - 1.0 if graph.total_cost else 0.0


@dataclass(frozen=True)
class PlanRecord:
    """What was planned for one compiled graph (for reports and tests).

    Attributes:
        index: the graph's position among those compiled (0, 1, ...).
        joint: the graph model.
        result: the validated planner result.
        modules: the generated forward and backward.
        reference_peak: the graph's simulated peak without rematerialization (bytes).
        stages: seconds per stage of planning it (:func:`checkmate.timers.stage`):
            ``trace`` (building the graph model, ``profile`` and ``scratch`` included),
            ``profile`` (op costs), ``scratch`` (scratch-space sizes), ``plan`` (the plan
            cache lookup and, on a miss, the solve), ``codegen`` (the forward and backward,
            paged when the plan pages).
        cache: ``"hit"``, ``"miss"``, ``"disabled"`` (CHECKMATE_CACHE=0) or ``"pinned"``
            (a plan file given to ``optimize(plan=...)`` was used).
        paged: joint-graph names of saved values the forward hands to the backward on the
            host (paging plans only).
        asked_budget: the bytes the budget asked for this graph when it was planned at more
            (``result.budget``: a fraction infeasible for a small graph, see
            :meth:`checkmate.runtime.Planner.partition`); None when it was planned at the budget asked.
        step_budget: the byte budget given to ``optimize`` (None under a fraction): more than
            ``result.budget`` where the rest is left to what the step holds beside this
            graph (gradients, a loss, DDP's buckets, earlier graphs' saved values).
        reused_from: the index of the record whose plan this graph runs (the same graph
            at other tensor sizes, see :meth:`checkmate.runtime.Planner.partition`), or None when this graph
            was planned itself.
        compiler: what compiled its halves: ``"aot"`` or ``"inductor"``.
        compiled: with ``"inductor"``, the plans measured compiled and the one kept
            (:mod:`checkmate.compiled`); None when none was measured.
        loose: the outputs its backward does not read, which a loop may drop (a language
            model's logits handed to a loss after a graph break): size and dtype -> bytes
            (:func:`checkmate.split.loose_outputs`).
        input_grads: the bytes of its gradients of inputs an earlier graph of the step made,
            handed to that graph's backward (:func:`checkmate.split.input_gradients`).
    """

    index: int
    joint: JointGraph
    result: SolveResult
    modules: SplitModules
    reference_peak: int
    stages: Mapping[str, float] = field(default_factory=dict)
    cache: str = "disabled"
    paged: tuple[str, ...] = ()
    asked_budget: int | None = None
    step_budget: int | None = None
    reused_from: int | None = None
    compiler: str = "aot"
    compiled: Calibration | None = None
    loose: Mapping[tuple[tuple[int, ...], torch.dtype], int] = field(default_factory=dict)
    input_grads: int = 0

    @property
    def budget(self) -> int | None:
        """The bytes this graph's step must hold: ``result.budget``, except for a plan kept
        after the compiled check, which may be solved at more simulated bytes than that."""
        if self.compiled is not None:
            return self.compiled.budget
        return None if self.result.budget is None else int(self.result.budget)

    @property
    def seconds(self) -> float:
        """Wall time of trace + profile + plan + codegen."""
        return sum(self.stages.get(s, 0.0) for s in ("trace", "plan", "codegen", "check"))

    @property
    def trace_seconds(self) -> float:
        """Building the graph model, less profiling."""
        return self.stages.get("trace", 0.0) - self.profile_seconds

    @property
    def profile_seconds(self) -> float:
        """Op costs and scratch-space sizes (both measured once per op and cached)."""
        return self.stages.get("profile", 0.0) + self.scratch_seconds

    @property
    def scratch_seconds(self) -> float:
        """The scratch-space part of :attr:`profile_seconds`."""
        return self.stages.get("scratch", 0.0)

    @property
    def solve_seconds(self) -> float:
        """The plan cache lookup and, on a miss, the solve."""
        return self.stages.get("plan", 0.0)

    @property
    def codegen_seconds(self) -> float:
        """Generating the forward and backward (and paging them)."""
        return self.stages.get("codegen", 0.0)

    @property
    def recomputes(self) -> int:
        return self.modules.recomputes

    @property
    def is_eager(self) -> bool:
        """True when the plan runs what eager PyTorch runs: no recomputes, nothing paged."""
        return self.modules.recomputes == 0 and not self.paged

    @property
    def overhead(self) -> float:
        """The compute the step's recomputes add, by the cost model, over the step without
        them (0.25: +25%): the op runs the generated modules make over each op run once.

        Not the solver's ``result.cost`` over ``graph.total_cost``, which cost each output of
        a multi-output op as the whole op: on a ResNet-like CNN at half its peak that said
        +98% where the modules run +200% more by the same costs (+151% measured)."""
        return records_overhead([self])

    def __repr__(self) -> str:
        """The record in one line (:meth:`summary`): the dataclass's own repr printed the whole
        graph model, schedule and generated modules (``print(checkmate.plans_of(model))`` on a
        two-layer MLP: 3,501 characters)."""
        return f"<PlanRecord {self.summary()}>"

    def summary(self) -> str:
        """One line: graph size, budget, simulated peak, cost overhead, strategy."""
        res = self.result
        g = self.joint.graph
        chosen = res.info.get("chosen", res.strategy)
        gap = (
            f", gap to bound {format_change(res.gap).lstrip('+')}"
            if res.gap is not None and self.reused_from is None
            else ""
        )
        if self.reused_from is not None:
            gap += f", plan of graph {self.reused_from} reused at these sizes"
            if res.info.get("kept_resident"):
                gap += f" ({res.info['kept_resident']} of its recomputes kept resident there)"
        if res.info.get(KEEPS_ALL):
            gap += ", keeping every value fits these sizes"
        if res.info.get("planned_ahead"):
            gap += f", planned for shapes up to about {res.info['planned_ahead']:g}x these sizes"
        if self.asked_budget is not None:
            gap += (
                f", budget raised from {format_bytes(self.asked_budget)} "
                f"({self.asked_budget / max(self.reference_peak, 1):.0%}, infeasible for this graph)"
            )
        budget = res.budget
        check = self.compiled
        if check is not None:
            budget = check.budget
            if check.measured is None:
                gap += f", compiled peak not measured ({check.error})"
            else:
                gap += (
                    f", compiled peak {format_bytes(check.measured)} measured "
                    f"({check.measured / max(check.budget, 1):.2f}x the budget; "
                    f"{len(check.rounds)} plan(s) measured"
                    + (
                        f", kept the one solved at {format_bytes(res.budget)})"
                        if res.budget != budget
                        else ")"
                    )
                )
        # a byte budget's share for this graph read as the user's budget, cut without cause
        # ("budget 5.38 MiB" where 9.06 MiB were asked): say where the rest went
        beside = (
            self.step_budget is not None
            and budget is not None
            and format_bytes(self.step_budget) != format_bytes(budget)  # "2.45 MiB of the 2.45 MiB asked"
            and self.step_budget > budget
        )
        rest = (
            f" of the {format_bytes(self.step_budget or 0)} asked, the rest left beside it" if beside else ""
        )
        return (
            f"graph {self.index}: {g.n - 1} ops, budget {format_bytes(budget)}{rest} "
            f"({_share(budget, self.reference_peak)} of its keep-all {format_bytes(self.reference_peak)}), "
            f"simulated peak {format_bytes(res.peak or 0)}, {self.recomputes} recomputes, "
            f"{format_change(self.overhead)} compute, {chosen} ({res.status}){gap}"
        )


def _share(part: int, whole: int) -> str:
    """``part / whole`` as a percentage, to whole percent unless that reads as 100% for two
    different numbers ("budget 15.69 MiB (100% of its keep-all 15.63 MiB)"): then with the
    decimals that tell them apart."""
    ratio = part / max(whole, 1)
    for digits in range(3):
        text = f"{ratio:.{digits}%}"
        if part == whole or float(text.rstrip("%")) != 100:
            return text
    return text


def records_overhead(records: Sequence[PlanRecord]) -> float:
    """The compute the recomputes of ``records``' plans add over their graphs' (the graphs of
    one step: each plan's op runs, :attr:`SplitModules.seconds`, over each op run once,
    :func:`checkmate.codegen.run_seconds`), less one; by the solver's costs where the modules
    carry none."""
    base = sum(run_seconds(r.joint) for r in records)
    runs = sum(r.modules.seconds for r in records)
    if base > 0.0 and runs > 0.0:
        return runs / base - 1.0
    total = sum(r.joint.graph.total_cost for r in records)
    return sum(r.result.cost or 0.0 for r in records) / total - 1.0 if total else 0.0
