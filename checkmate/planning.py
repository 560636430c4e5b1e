"""How the planner plans one graph: traced, its budget worked out with room for what the step holds
beside it (DDP's buckets, the graphs before it, the module's other calls, memory held outside the
module), then solved, a plan reused or made ahead for a family of sizes, or the least peak found;
under Inductor, checked compiled.

:class:`GraphPlanning` is a layer of :class:`checkmate.runtime.Planner`: its methods are the planner's
and its state the planner's (:class:`~checkmate.planner_state.PlannerState`). The Checkmate MILP
(Jain et al., MLSys 2020) and the other strategies are :mod:`solvers`'; this is what the planner
hands them and how it reads their answer.
"""

from __future__ import annotations

import functools
import logging
import math
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from checkmate.backends import NoCompiledFit, bw_donated, compile_half
from checkmate.cache import cached_solve, recall_least_peak, remember_least_peak
from checkmate.codegen import SplitModules
from checkmate.compiled import Calibration, CompileHalf
from checkmate.cse import merge_common_subexpressions
from checkmate.distributed import ddp_reserve, fsdp_reserve, plan_once
from checkmate.families import family_target, larger_shape_budget, plan_ahead, reuse
from checkmate.planner_common import (
    COSTLY,
    LATER_ROOM,
    LEAST_COSTLY,
    RETAINED_ADVICE,
    RETAINED_WHY,
    SCALAR_BYTES,
    BudgetWarning,
    _codegen,
    _held_bytes,
    _Unsettled,
)
from checkmate.planner_state import PlannerState
from checkmate.records import HELD_TO, KEEPS_ALL, PlanRecord, overhead
from checkmate.rng import replay_dropout_draws
from checkmate.scratch import flush_scratch, held_beyond, prefetch_scratch, scratch_bytes
from checkmate.split import gradient_bytes, largest_gradient, share_of, tangent_bytes
from checkmate.tangents import unread_tangents
from checkmate.timers import stage
from checkmate.trace import JointGraph, build_graph, correct_traced_dtypes, recompute_dropout_from_mask
from solvers.api import no_plan_error
from solvers.boundary import boundary_hold, forward_peak, retained_peaks, with_forward_hold, without_ballast
from solvers.bounds import memory_lower_bound
from solvers.budget import Budget, format_bytes
from solvers.errors import InfeasibleBudgetError
from solvers.graph import Graph
from solvers.resize import structure
from solvers.result import SolveResult, Status
from solvers.schedule import keep_all_peak, simulate
from solvers.strategies.baselines import checkpoint_all
from solvers.strategies.least_peak import known_least_peak

#: planning progress at INFO, on the logger the whole planner writes to
log = logging.getLogger("checkmate")


#: seconds for the least peak of a graph whose own least peak is the guess (a guess: the
#: first plan found is close enough)
GUESS_SECONDS = 2.0


#: a try with a fallback (room left beside a graph) below the least peak found for the graph
#: is searched for this share of the time limit (:meth:`Planner._solved`)
HEDGE_SHARE = 0.1


#: a step whose forward runs torch.utils.checkpoint regions, planned under a fraction
CHECKPOINTED = (
    "the step's forward runs torch.utils.checkpoint ({ops} ops in its regions): checkmate chooses what to "
    "recompute itself and does not follow the regions, so the budget's fraction ({fraction:g}) is of the "
    "step's peak keeping every value, the regions' included ({peak}), not of the checkpointed step's, and "
    "can allow more memory than the checkpoint calls held. Pass the budget in bytes (the checkpointed "
    "step's peak, measured with checkmate.memory.measure_peak, or less), or remove the checkpoint calls (a "
    "Hugging Face model: model.gradient_checkpointing_disable(); with its Trainer, leave gradient_checkpointing off)"
)


#: plans made at most for a step whose backward runs again through one forward's graph
RETAINED_TRIES = 4


#: Dynamo's reason for a graph break at a branch on a tensor (LayerDrop's ``if torch.rand([]) < p``)
_BRANCH_BREAK = "Data-dependent branching"


#: what a plan run by Inductor without the compiled check may hold (the warnings say it)
UNCHECKED = (
    "Inductor allocates its own buffers and fuses and reorders kernels, so the step's peak is not "
    "the plan's simulated one (0.78-1.035x the budget measured on CPU with auto's plans, 1.36x for "
    "one CP-SAT plan); leave headroom, or use compiler='aot', whose peak follows the plan"
)


#: a plan with its generated halves and the values it pages (see :func:`_codegen`)
_Plan = tuple[SolveResult, SplitModules, tuple[str, ...]]


#: what a byte budget's reserve beside a graph may hold, in words (:meth:`Planner._plan`)
_RESERVED = (
    "held beside this graph: DDP's gradient buckets, FSDP2's unsharded parameters, what graphs before it in "
    "the step keep for their backward, the module's other calls held at once"
)


#: the part of a reserve beyond :meth:`Planner._beside_parts`, in words
_EARLIER = "what graphs before it in the step keep for their backward"


#: the clause of :func:`_reserve_note` naming the byte budget that fits beside the reserve
#: (dropped where :meth:`Planner._note_outside` names one with room outside the module too)
_AT_LEAST = "; a budget of at least "


def _reserve_note(
    reserve: int,
    ref: int,
    fraction: float | None,
    minimum: float | None,
    what: str,
    asked: int | None = None,
    graph_bytes: int | None = None,
) -> str:
    """The note of an :class:`InfeasibleBudgetError` whose bytes were taken ``reserve`` off
    (:meth:`Planner._plan`), held by ``what``; the budget, in the user's terms, that leaves
    the graph ``minimum`` (the least peak found): under a fraction, of the graph's keep-all
    peak ``ref``; under a byte budget of ``asked`` bytes, of which the graph got
    ``graph_bytes``, in bytes (the error's own figures were the graph's: a user passing the
    least peak it named was refused again, the reserve taken off once more)."""
    note = f"{format_bytes(reserve)} of the budget asked is held beside this graph ({what}), and was taken off it"
    if minimum is None:
        return note
    if fraction is not None and ref > 0:
        note += (
            f"; as a fraction, at least {(minimum + reserve) / ref:.1%} of this graph's keep-all peak leaves it the "
            "least peak found"
        )
    elif asked is not None and graph_bytes is not None and asked > graph_bytes:
        fits = int(minimum) + asked - graph_bytes
        note += f"{_AT_LEAST}{format_bytes(fits)} ({fits:,} bytes) leaves it the least peak found"
    return note


def _logged_peak(
    plan: _Plan,
    num_fwd_outputs: int,
    compile_half: CompileHalf,
    inputs: Sequence[Any] | None,
    budget: int,
    index: int,
    dropped: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset(),
) -> int:
    """:func:`checkmate.compiled.compiled_peak` of ``plan``'s halves, logged (a compile and a
    step each: seconds); the outputs of a size and dtype in ``dropped`` are dropped when the
    backward starts."""
    from checkmate.compiled import compiled_peak

    log.info(
        "graph %d: compiling the plan at %s simulated with Inductor to measure it",
        index,
        format_bytes(plan[0].peak or 0),
    )
    got = compiled_peak(plan[1], num_fwd_outputs, compile_half, inputs, dropped=dropped)
    log.info(
        "graph %d: compiled step measured %s (%.2fx the budget %s)",
        index,
        format_bytes(got),
        got / max(budget, 1),
        format_bytes(budget),
    )
    return got


def _fold_nothing_else(node: fx.Node) -> bool:
    """The ``fuse`` predicate of :func:`checkmate.trace.build_graph` that folds only what
    Inductor is known to move: a matrix product into its addition."""
    return False


def _cache_status(res: SolveResult, plan_path: str | None) -> str:
    """How the plan was obtained: from a pinned file, the cache, a solve, or with no cache."""
    from checkmate.cache import cache_enabled

    hit = res.info.get("cache") == "hit"
    came_from = res.info.get("plan_path")
    if plan_path is not None and hit and came_from is not None and Path(came_from) == Path(plan_path):
        return "pinned"  # not when the user's file was rejected and the cache had the plan
    if hit:
        return "hit"
    return "miss" if cache_enabled() or plan_path is not None else "disabled"


class GraphPlanning(PlannerState):
    """The planner's methods that plan one graph (see the module)."""

    def _keep_every_value(self, indices: Sequence[int]) -> bool:
        """Whether the plans of these records all keep every value (recompute and page
        nothing): more room for them changes none of them."""
        return all(self.records[i].is_eager for i in indices)

    def _needs(self, profile_id: str, call: Sequence[int] | None = None) -> tuple[tuple[int, int], ...]:
        """Per graph of the current call, in call order, what it needs while the others run
        (``split``): the gradient bytes its backward leaves (held while an earlier graph's
        backward runs; each of its ``runs``' own), and its least peak (the room the earlier
        graphs must leave it; 0 for the first)."""
        graphs = [self.records[i].joint.graph for i in (self.call if call is None else call)]
        runs = [self._runs_of(graph) for graph in graphs]
        # a graph that runs r times (a layer loop's): each run's gradients its own, and beside
        # its least peak its other runs hold at least those
        return tuple(
            (
                gradient_bytes(graph) * r,
                self._least_peak(graph, profile_id) + (r - 1) * gradient_bytes(graph) if k else 0,
            )
            for k, (graph, r) in enumerate(zip(graphs, runs))
        )

    def _or_keep_all(
        self,
        joint: fx.GraphModule,
        jg: JointGraph,
        plan: _Plan,
        check: Calibration,
        measure: Callable[[_Plan], int],
        ref: int,
    ) -> tuple[_Plan, Calibration]:
        """When no plan measured fits, the plan that keeps every value, measured too: Inductor
        fuses a chain it need not keep into one kernel, and a recomputation in the backward
        can make it write a value the fused chain never held. Measured on CPU: a cross-entropy
        over a 4096-word vocabulary keeping every value stepped at 16.9 MiB, and the plan of
        the least simulated peak (48.00 MiB against 48.25, three recomputes) at 32.3 MiB."""
        from checkmate.compiled import Round

        res = checkpoint_all(jg.graph, ref)
        res = replace(res, info={**res.info, "chosen": res.strategy, "reference": ref})
        whole: _Plan = (res, *_codegen(joint, jg, res))
        try:
            got = measure(whole)
        except Exception:  # the plan measured before stands
            return plan, check
        rounds = (*check.rounds, Round(ref, int(res.peak or ref), got))
        if got >= (check.measured or 0):
            return plan, replace(check, rounds=rounds)
        return whole, replace(check, rounds=rounds, chosen=len(rounds) - 1)

    def _compiled_may_fit(self, compiler: str, exc: InfeasibleBudgetError) -> bool:
        """Whether a budget the graph model finds no schedule for is worth checking compiled:
        Inductor fuses chains of ops into kernels that never hold the values the model counts,
        so its step may hold far less than any plan simulates (a cross-entropy over a 4096-word
        vocabulary: no schedule under 48 MiB simulated, 18 MiB measured compiled keeping
        every value). Only where the plan is checked compiled, and a schedule was found."""
        return (
            compiler == "inductor"
            and self.check_compiled
            and self._unchecked_why() is None
            and exc.minimum is not None
            and exc.minimum > exc.budget
        )

    def _at_least_peak(self, jg: JointGraph, exc: InfeasibleBudgetError, profile_id: str) -> SolveResult:
        """The plan at the least simulated peak found (``exc.minimum``), held to the bytes
        asked (``exc.budget``) by the compiled check; where that plan's compute is more than
        :data:`COSTLY` over the graph's, the plan keeping every value instead. Near the least
        peak a plan recomputes much of the forward: long to compile, and slower than the
        graph's plan run uncompiled where one fits (:func:`checkmate.backends.uncompiled`). A Hugging Face Swin
        at 0.5 of eager's peak: the least-peak plan recomputed 5,180 values (+924%), a backward
        of 9,043 nodes that Inductor took 581 s to compile twice (with buffer reuse and
        without) on a 2-core CPU with empty caches, measured over the budget, and the graph
        then ran uncompiled at +15% planned compute. Keeping every value, Inductor may still
        fuse the step under the budget (:meth:`_or_keep_all`). Not with :attr:`fallback` off:
        the backend checks the costly plan compiled where no plan fits uncompiled either."""
        got = self._solved(jg.graph, Budget(nbytes=int(exc.minimum or 0)), profile_id)
        ref = keep_all_peak(jg.graph)
        costly = overhead(got, jg.graph)
        if self.fallback and costly > COSTLY:
            self.skipped_least = True
            got = checkpoint_all(jg.graph, ref)
            got = replace(got, info={**got.info, "chosen": got.strategy, LEAST_COSTLY: costly})
        return replace(got, info={**got.info, "reference": ref, HELD_TO: exc.budget})

    def _unchecked_why(self) -> str | None:
        """Why plans cannot be checked compiled here (None when they can): not for the
        least peak (no bytes to hold)."""
        if self.budget.least:
            return "budget='min' has no bytes to check against"
        return None

    def _can_check(self) -> bool:
        """Whether plans can be checked compiled here (:meth:`_unchecked_why`). When not,
        the first time, a :class:`BudgetWarning` says the plans run unchecked."""
        why = self._unchecked_why()
        if why is None:
            return True
        if not self.warned_unchecked:
            self.warned_unchecked = True
            warnings.warn(
                f"compiler='inductor': plans are not checked compiled ({why}); {UNCHECKED}",
                BudgetWarning,
                stacklevel=4,
            )
        return False

    def _checked(
        self,
        joint: fx.GraphModule,
        jg: JointGraph,
        first: _Plan,
        profile_id: str,
        *,
        quiet: bool = False,
        cheap: bool = False,
    ) -> tuple[_Plan, Calibration]:
        """The plan whose halves, compiled by Inductor, measure within the plan's budget
        and use most of it (:mod:`checkmate.compiled`), starting from ``first``; ``quiet``:
        no :class:`BudgetWarning` when none fits (the caller raises); ``cheap``: no plan
        replanned whose compute is more than :data:`COSTLY` over the graph's is compiled
        (:meth:`_at_least_peak`)."""
        from checkmate.compiled import calibrate, prior_ratio

        res = first[0]
        assert res.budget is not None
        ref = int(res.info["reference"])
        held = int(res.info.get(HELD_TO, res.budget))  # a family's plan may be made at more
        # a family's plan carried over was not made at a target: it stands at its own peak,
        # so that a plan leaving room at these sizes is replanned to use it
        start = int(res.peak or res.budget) if "reused_from" in res.info else int(res.budget)

        # a plan that holds at most so much at its forward/backward boundary (room for the graphs
        # or calls that run beside it) is replanned holding no more there
        boundary = res.info.get("boundary")

        def replan(target: int) -> _Plan | None:
            try:
                bound = None if boundary is None or boundary >= target else int(boundary)
                got = self._solved(jg.graph, Budget(nbytes=target, boundary=bound), profile_id)
            except InfeasibleBudgetError:
                return None
            if cheap and overhead(got, jg.graph) > COSTLY:
                return None
            got = replace(got, info={**got.info, "reference": ref})
            return (got, *_codegen(joint, jg, got))

        # Dynamo marks parameters and buffers static; AOTAutograd's compile passes their indices
        static = [
            k
            for k, x in enumerate(self.inputs or ())
            if isinstance(x, torch.Tensor) and getattr(x, "_dynamo_static_input_type", None)
        ]
        measured: dict[tuple[Any, ...], int] = {}  # a replan can return a schedule measured before
        from torch._inductor import config as inductor_config

        reuse = bool(inductor_config.allow_buffer_reuse)

        def measure(p: _Plan) -> int:
            assert p[0].schedule is not None
            key = (p[0].schedule.steps, reuse)
            if key not in measured:
                compile_one = functools.partial(
                    compile_half, static=static, donated=bw_donated(p[1], jg.num_fwd_outputs)
                )
                with inductor_config.patch(allow_buffer_reuse=reuse):
                    measured[key] = _logged_peak(
                        p, jg.num_fwd_outputs, compile_one, self.inputs, held, len(self.records), jg.dropped
                    )
            return measured[key]

        if reuse:
            # a buffer Inductor reuses stays allocated from its last use to its reuse, through any
            # peak between: the plan is checked, and compiled, without reuse where the first plan
            # measures over its budget with it (or cannot be measured), as if reuse were never on
            try:
                reuse = measure(first) <= held
            except Exception:  # calibrate measures it again, and says why it could not
                reuse = False
        self.reuse_refused = not reuse and bool(inductor_config.allow_buffer_reuse)

        # a plan of this graph's structure measured before (other sizes, another budget): its
        # measured-to-simulated ratio says where to start
        shape = structure(jg.graph)
        same = [self.records[i] for i in (*self.families.get(shape, ()), *self.superseded.get(shape, ()))]
        plan, check = calibrate(
            first,
            held,
            simulated=lambda p: int(p[0].peak),
            cost=lambda p: float(p[0].cost or 0.0),
            measure=measure,
            replan=replan,
            ceiling=ref,
            start=start,
            prior=prior_ratio(
                [r.compiled for r in sorted(same, key=lambda r: r.index) if r.compiled is not None]
            ),
        )
        if not check.fits and check.error is None and (plan[0].cost or 0.0) > jg.graph.total_cost:
            plan, check = self._or_keep_all(joint, jg, plan, check, measure, ref)
        where = f"graph {len(self.records)} ({jg.graph.n - 1} ops)"
        if check.error is not None:
            warnings.warn(
                f"{where}: its compiled step could not be measured ({check.error}); it runs the plan as "
                "simulated, and Inductor may hold more than the budget",
                BudgetWarning,
                stacklevel=3,
            )
        elif not check.fits and not quiet:
            tried = ", ".join(format_bytes(r.measured or 0) for r in check.rounds)
            over = (
                f"{where}: compiled by Inductor, its step measured {format_bytes(check.measured or 0)}, "
                f"over its budget of {format_bytes(check.budget)} ({(check.measured or 0) / check.budget:.3f}x); "
                f"plans measured: {tried}"
            )
            if self.fallback:  # the backend runs it uncompiled where a plan fits that way
                raise NoCompiledFit(over)
            if check.no_plan_below is not None:  # replanning for less found no plan
                what = (
                    f"no plan simulates under {format_bytes(check.no_plan_below)}: the budget is about the "
                    f"least this graph runs in. Raise the budget to at least {format_bytes(check.measured or 0)}"
                )
            else:
                what = "Lower the budget"
            warnings.warn(
                f"{over}; no plan run uncompiled fits either. {what}",
                BudgetWarning,
                stacklevel=3,
            )
        return plan, check

    def _trace(
        self,
        joint: fx.GraphModule,
        num_fwd_outputs: int,
        device: torch.device,
        compiler: str,
        spent: dict[str, float],
    ) -> JointGraph:
        """The graph model of ``joint``; op costs and scratch sizes are taken as it is
        built (the stages ``profile`` and ``scratch``, nested in ``trace``)."""
        # dropout's output is recomputed from its mask, scaled as the kernels that run it scale
        recompute_dropout_from_mask(joint, eager=compiler != "inductor")
        if compiler != "inductor":  # and its mask from the generator state it drew from
            replay_dropout_draws(joint)
        correct_traced_dtypes(joint)  # where a fake-tensor rule and its kernel disagree
        if compiler == "inductor":  # a backward formula's repeat of forward work runs once compiled
            merge_common_subexpressions(joint)

        from checkmate import fusion

        def costs(nodes: Sequence[fx.Node]) -> list[float]:
            from checkmate.profile import profile_costs

            with stage("profile", spent):
                costs = profile_costs(joint, list(nodes), profile=self.profile, device=device)
                if compiler == "inductor":  # the compiled step's: fused ops move bytes
                    costs = fusion.fused_costs(nodes, costs, *fusion.device_speed(self.profile, device))
                return costs

        # Inductor may run a convolution on channels-last inputs (checkmate.scratch)
        any_layout = compiler == "inductor"

        def scratch(node: fx.Node) -> int:
            with stage("scratch", spent):
                return scratch_bytes(node, any_layout=any_layout)

        def beyond(node: fx.Node) -> int:
            with stage("scratch", spent):
                return held_beyond(node, any_layout=any_layout)

        # Inductor runs a matrix product added to a tensor as one addmm where the sum is:
        # folded into the sum (checkmate.trace.into_addmm). Generated ops are not folded
        # (docs/compilers.md: it needs horizontal fusions that break the plan's peak)
        fuse = _fold_nothing_else if compiler == "inductor" else None
        saving: Callable[[fx.Node], float] | None = None
        if compiler == "inductor" and fusion.CHARGE_SAVES:  # a fused value written only to be saved
            bandwidth = fusion.device_speed(self.profile, device)[0]
            saving = lambda node: fusion.save_cost(node, bandwidth)  # noqa: E731
        with stage("scratch", spent):  # at once: in one worker process under a profiler
            prefetch_scratch(joint.graph.nodes, any_layout=any_layout)
        jg = build_graph(
            joint,
            num_fwd_outputs,
            costs,
            scratch=scratch,
            held_beyond=beyond,
            fuse=fuse,
            save_costs=saving,
            # Inductor's C++ code stores bools slowly: masks are computed in the backward
            late_masks=compiler == "inductor" and device.type == "cpu",
            # a loss returned beside outputs it was computed from: their gradients are expected not
            # to be given (the aot backward runs without them; Inductor's is given zeros)
            unread=unread_tangents(joint) if compiler == "aot" and self.plan_unread else frozenset(),
            # Inductor's backward is given zeros for them (MadeZeros), counted: the outputs beside
            # the loss are found all the same, for a loop seen dropping them (loop_drops)
            beside=unread_tangents(joint) if compiler == "inductor" else None,
            name=f"graph{len(self.records)}",
        )
        with stage("scratch", spent):
            flush_scratch()  # the new scratch measurements, for the next process
        return jg

    def _record(
        self,
        jg: JointGraph,
        res: SolveResult,
        modules: SplitModules,
        paged: tuple[str, ...],
        asked: int | None,
        reused: int | None,
        spent: dict[str, float],
        compiler: str,
        check: Calibration | None = None,
        handed: tuple[Mapping[tuple[tuple[int, ...], torch.dtype], int], int] = ({}, 0),
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """Record the plan of ``jg`` (in ``records``, its step and its family); its halves.
        ``handed``: its outputs a loop may drop, and its gradients of inputs an earlier
        graph made (:attr:`PlanRecord.loose`, :attr:`PlanRecord.input_grads`)."""
        index = len(self.records)
        self.records.append(
            PlanRecord(
                index=index,
                joint=jg,
                result=res,
                modules=modules,
                reference_peak=int(res.info["reference"]),
                stages=dict(spent),
                cache=_cache_status(res, self.plan_path),
                paged=paged,
                asked_budget=asked,
                step_budget=self.budget.nbytes,
                reused_from=reused,
                compiler=compiler,
                compiled=check,
                loose=handed[0],
                input_grads=handed[1],
            )
        )
        self.steps.setdefault(self.step, []).append(index)
        if reused is None and not res.info.get(KEEPS_ALL):
            self.families.setdefault(structure(jg.graph), []).append(index)
        return modules.forward, modules.backward

    def _solve_after_earlier(
        self, jg: JointGraph, profile_id: str, guess: int = 0, *, hedged: bool = False
    ) -> tuple[SolveResult, int | None, int | None]:
        """:meth:`_solve` under a byte budget less what the other graphs of this call hold
        while this one runs (graph breaks, and DDP's graph splits at its gradient buckets:
        their forwards run in order and their backwards in reverse): the graphs before it,
        what they saved; the graphs after it, the gradients they leave, and at this graph's
        forward/backward boundary, where they run, their least peaks (:meth:`_later_room`,
        :mod:`solvers.boundary`). Where that leaves no plan, a smaller room at the boundary,
        then none there, then the whole budget as before; :meth:`_check_split` then says
        what the step can reach. ``guess``: bytes to leave for a loss outside the module where
        no step was measured yet (:func:`_loss_room`), in place of the measured room.
        ``hedged``: the caller does otherwise where this finds no plan (:meth:`_solved`)."""
        before = self._held_before()
        if guess:  # no step measured yet: room for a loss outside, guessed
            self.loss_guess[self.step] = guess
        base = before + (self._outside_room(jg.graph) or guess)  # + code outside the module (check_step)
        at_boundary, beside = self._later_room(jg.graph, profile_id)
        runs = self._runs_of(jg.graph)
        if self.calls > 1 and self.budget.nbytes is not None:  # the module's other calls beside it
            return self._solve_beside_calls(jg, profile_id, base + beside, runs)
        if self.step in self.retained and runs == 1 and self.budget.nbytes is not None:
            try:
                return self._solve_retained(jg, profile_id, base + beside, self.retained[self.step])
            except InfeasibleBudgetError:  # planned as before, which was measured over: said now
                self._warn_retained()
        if runs > 1 and self.budget.nbytes is not None:  # the graph's other runs in the step
            try:
                return self._solve_beside_calls(jg, profile_id, base + beside, runs)
            except InfeasibleBudgetError as exc:
                # no plan fits beside its runs: planned as it was (each run alone), and warned of;
                # the step measured over the budget is then planned with room as for memory outside
                self._warn_runs(runs, exc)
        # room the boundary needs beyond what the whole run leaves: for the graphs after this
        # one, and for code outside the module (measured there: check_step)
        measured = self._outside_room(jg.graph, self.outside_boundary)
        extra = at_boundary - beside + measured
        tries: list[tuple[int, int | None]] = [(base + beside, extra)] if extra > 0 else []
        if measured:
            # room measured there: else left beside the whole run, which holds there too. A plan
            # leaving less runs over the budget by the difference: a TinyTransformer whose loss
            # outside held 1.99 MiB at its boundary, given that room back from the 3 MiB guessed,
            # where no plan with the room at the boundary was found in the time limit (a loaded
            # machine), was planned with none and stepped at 1.11x the budget; its guessed
            # room's plan had stepped at 0.67x
            tries.append((base + beside + extra, None))
        tries.append((base + beside, None))
        tried: set[tuple[int, int | None]] = set()
        at_least = 0  # the reserve leaving this graph its least peak found, where less than `before`
        while tries:
            reserve, room = tries.pop(0)
            if (reserve, room) in tried or (not reserve and room is None):
                continue  # the whole budget: below
            tried.add((reserve, room))
            try:
                solved = self._solve(jg, profile_id, reserve, room, hedged=True)
            except InfeasibleBudgetError as exc:
                # no plan leaves that much room: the least peak found with it, over the budget,
                # says by about how much less to leave (the ballast of solvers.boundary counted)
                over = int(exc.minimum or 0) - int(exc.budget or 0)
                if over <= 0:
                    continue
                if room is not None:
                    if room == extra and over < room:  # after the room left beside the whole run
                        tries.insert(1 if measured else 0, (reserve, room - over))
                elif reserve - over > before and (not tries or reserve - over > tries[0][0]):
                    tries.insert(0, (reserve - over, None))
                elif 0 < reserve - over <= before:
                    at_least = max(at_least, reserve - over)
            else:
                self._guess_left(guess, reserve - before - beside)
                return solved
        self._guess_left(guess, 0)
        if at_least:  # at most `before`: some graph before it in the call holds bytes
            # the graphs before it in the call hold more than its least peak leaves: no plan of
            # this step fits (_check_split says so, and plans it again with them in view). Planned
            # at its least peak, not at the whole budget, the step exceeds the budget the least: a
            # Hugging Face Segformer, split by transformers' first-call graph break (installing its
            # output hooks), at 0.5 of eager's peak, stepped at 1.46x the budget so, and at 1.28x so
            try:
                return self._solve(jg, profile_id, at_least, hedged=True)
            except InfeasibleBudgetError:
                pass  # the least peak found is not found again in the time limit
        return self._solve(jg, profile_id, hedged=hedged)

    def _note_outside(self, exc: InfeasibleBudgetError, graph: Graph, guess: int) -> None:
        """Under a byte budget, a note on ``exc`` (raised for ``graph``, planned at last with
        no room for memory outside the module) naming what the step holds outside the module
        (measured, else ``guess``ed for a loss on its outputs) and the budget that leaves the
        graph its least peak beside that and the rest set aside: the error's own figures are
        the graph's, and a Hugging Face GPT-2 whose cross-entropy is computed on its logits,
        optimized again at the least peak the error named, stepped at 1.43x it."""
        measured = self._outside_room(graph)
        room = measured or guess
        asked = self.budget.nbytes
        if asked is None or room <= 0 or exc.minimum is None:
            return
        fits = int(exc.minimum) + max(asked - exc.budget, 0) + room
        how = "measured" if measured else "guessed for a loss on its outputs until a step is measured"
        # the reserve's note named a budget without this room: one figure to pass, this one
        exc.revise_notes(lambda note: note.split(_AT_LEAST)[0])
        exc.add_note(
            f"the step also holds about {format_bytes(room)} outside the module between its forward and backward "
            f"({how}), beside which no plan fitted: in all, a budget of at least {format_bytes(fits)} ({fits:,} "
            "bytes) leaves this graph the least peak found beside it"
        )

    def _guess_left(self, guess: int, left: int) -> None:
        """Of the room ``guess``ed for a loss outside the module, what the plan made left it
        (``left``: less where no plan left all of it), for :meth:`check_step` to judge against
        what the step measured. Recorded as the whole guess where the plan's tries took room
        off it, the step was judged against room its plan never left (a Hugging Face GPT-2
        whose loss is outside it, at 0.7 of eager's peak: 13.22 MiB recorded for a 64-token
        step whose plan left 3.82 MiB)."""
        if not guess:
            return
        if min(guess, left) > 0:
            self.loss_guess[self.step] = min(guess, left)
        else:
            self.loss_guess.pop(self.step, None)

    def _solve_beside_calls(
        self, jg: JointGraph, profile_id: str, base: int, runs: int = 1
    ) -> tuple[SolveResult, int | None, int | None]:
        """:meth:`_solve` for one of ``calls`` calls of the module held at once (each made
        before the backward of the ones before it; their backwards run in reverse), beside
        ``base`` bytes (graphs before it in the call, room for code outside the module).

        Each call runs the same plan, which holds at most ``h`` bytes at its forward/backward
        boundary (what an earlier call keeps while a later one runs) and peaks at ``P``.
        While call ``j`` runs, the ``j - 1`` before it hold ``h`` each, and, for every call
        but the last (whose backward runs first), the gradients the later calls' backwards
        left, ``G`` (accumulated into one copy): ``P`` fits the budget less
        ``max((m - 2) h + G, (m - 1) h)``. As each backward but the first ends, whatever the
        plan, ``(m - 2) h + 2 G + s`` is held: its gradients, which a compiled backward returns
        all at once, the later calls', and the sum autograd makes of a gradient and theirs,
        out of place, beside both (its largest, ``s``); eager sums each gradient as its op
        makes it. Unplanned, a GAN's discriminator called on real and fake data at eager's
        peak stepped at 1.10x it, as ``torch.compile`` does, and a BudgetWarning blamed a
        loss outside the module; now that budget has no plan. ``h`` is half the most that
        leaves the graph's least peak room: halfway between recomputing to hold little at the
        boundary and recomputing to peak low. The call that found more calls held plans beside what the
        earlier ones hold (``pending_held``) too; where that leaves no plan, as the later
        calls are, with a :class:`BudgetWarning` that this step can exceed the budget.

        A graph that runs ``runs`` times in one call (a layer loop broken by a branch on a
        tensor: every layer's body is one graph) is planned so too, its ``m`` = calls x runs
        runs each holding ``h`` until its backward, but their gradients are each layer's own
        (not accumulated): while run ``j``'s backward runs, the ``j - 1`` before it hold ``h``
        and the ``m - j`` after it left ``G`` each, at most ``(m - 1) max(h, G)``."""
        m, asked = self.calls * runs, self.budget.nbytes or 0
        net = max(asked - self._beside() - base, 0)
        grads = gradient_bytes(jg.graph)
        # as each backward but the first ends: its gradients, the later calls' and a sum (s)
        ends = 2 * grads + largest_gradient(jg.graph) if self.calls > 1 and runs == 1 else 0
        if ends > net:  # whatever the plan: the calls' gradients alone do not fit
            unfit = InfeasibleBudgetError(
                net,
                ends,
                lower_bound=ends,
                detail="what the calls' backwards return and autograd's sums of them hold",
            )
            self._note_calls(unfit, asked, grads)
            raise unfit
        free = net - self._least_peak(jg.graph, profile_id)  # what the other calls may hold
        if runs > 1:
            most = free // (m - 1) if grads * (m - 1) <= free else 0
        else:
            most = free // (m - 1) if grads <= free else 0
            if m > 2:
                most = min(most, max(free - grads, 0) // (m - 2), (net - ends) // (m - 2))
        h = most // 2

        def others(held: int) -> int:
            if runs > 1:
                return (m - 1) * max(held, grads)
            return max((m - 2) * held + grads, (m - 1) * held)

        error: InfeasibleBudgetError | None = None
        tried: set[int] = set()
        for pending in (self.pending_held, 0):
            reserve = max(others(h), pending)
            if reserve in tried:
                continue
            tried.add(reserve)
            try:
                got = self._solve(jg, profile_id, base + reserve, max(net - reserve - h, 0))
            except InfeasibleBudgetError as exc:
                error = error or exc
                continue
            if reserve < self.pending_held:
                self._warn_calls(
                    f"no plan of this call fits beside the {format_bytes(self.pending_held)} they hold"
                )
            return got
        assert error is not None
        self._note_calls(error, asked, grads)
        raise error

    def _note_calls(self, error: InfeasibleBudgetError, asked: int, grads: int) -> None:
        """Say, on ``error`` (no plan of a call fits beside the module's other calls held at
        once), why, and the least budget it would take (``asked``: the budget)."""
        least = asked + int(error.minimum or 0) - int(error.budget or 0)  # the plan's least peak beside them
        error.add_note(
            f"The module is called {self.calls} times before a backward (two views of a batch, a GAN's discriminator on "
            "real and fake data, micro-batches summed into one loss): each call keeps what its backward needs "
            "while the later ones run, and each backward but the first runs beside the gradients the ones before "
            f"it left ({format_bytes(grads)}), and their sums with its own. Raise the budget (to at least about "
            f"{format_bytes(least)}), call the module once on the batches concatenated, or run each call's "
            "backward before the next call"
        )

    def _solve_retained(
        self, jg: JointGraph, profile_id: str, base: int, backwards: int
    ) -> tuple[SolveResult, int | None, int | None]:
        """:meth:`_solve` for a step of ``backwards`` backwards through the graph of one
        forward (``retain_graph=True`` on each but the last), beside ``base`` bytes: autograd
        holds every value the forward saved through each backward but the last, and each
        backward after the first runs beside the gradients the ones before it left (``G``,
        accumulated into one copy). Planned beside ``G`` first, the plan is simulated as that
        step runs it (:func:`solvers.boundary.retained_peaks`), and planned again, where its
        last backward exceeded, beside as much more, and where the others did, holding as
        much less at its forward/backward boundary, until it fits (:data:`RETAINED_TRIES`
        plans at most).

        Raises:
            InfeasibleBudgetError: no plan found fits so.
        """
        asked = self.budget.nbytes or 0
        net = max(asked - self._beside() - base, 0)
        grads = gradient_bytes(jg.graph)
        reserve, room = grads, None
        for _ in range(RETAINED_TRIES):
            got = self._solve(jg, profile_id, base + reserve, room)
            schedule = got[0].schedule
            if schedule is None:  # _solve returns plans only
                break
            held, last = retained_peaks(jg.graph, schedule, grads, backwards)
            log.info(
                "planned beside %s, the plan peaks at %s with what its forward saves held through the backwards, "
                "and %s in the last, of %s",
                format_bytes(reserve),
                format_bytes(held),
                format_bytes(last),
                format_bytes(net),
            )
            if max(held, last) <= net:
                return got
            if last > net:  # the last backward beside the gradients: a lower peak
                reserve += last - net
            if held > net:  # the others beside what the forward saved: less saved
                saved = boundary_hold(jg.graph, schedule) - (held - net)
                room = max(net - reserve - saved, 0)
        raise InfeasibleBudgetError(
            net, detail="no plan found holds what the forward saves through every backward"
        )

    def _warn_retained(self) -> None:
        """Once per step signature, the :class:`BudgetWarning` (``retained_warning``) that no
        plan holding what the forward saves through every backward fits: the step is planned
        as before, as the step measured over the budget was, and the calls that run it exceed
        (the warning of the step measured over said it was compiled again to fit: a transformer
        at 0.6 of eager's peak with two backwards, ``retain_graph=True`` on the first, ran two
        more steps at 1.15x and 1.10x before the next warning, which then gives the ratio measured)."""
        if self.step in self.warned_retained:
            return
        self.warned_retained.add(self.step)
        self.retained_warning = (
            f"no plan of this step fits its budget of {format_bytes(self.budget.nbytes or 0)} holding what its "
            f"forward saves through every backward ({RETAINED_WHY}) beside what it holds outside the module: it is "
            f"planned as before, and these steps can exceed the budget. To have it fit, {RETAINED_ADVICE}, or "
            "raise the budget"
        )

    def _warn_runs(self, runs: int, exc: InfeasibleBudgetError) -> None:
        """Once, the :class:`BudgetWarning` (``runs_warning``, for the caller to issue unless
        the step is compiled again with the needs of its graphs in view: :meth:`take_warnings`)
        that a graph that ran ``runs`` times in one step has no plan that fits the budget
        beside its other runs (``exc``): it is planned as one run, and its steps can exceed
        the budget."""
        self.runs_unfit.add(self.step)
        if self.warned_runs:
            return
        self.warned_runs = True
        cause, advice = self._repeats(self.step)
        self.runs_warning = (
            f"a graph of this step ran {runs} times in it ({cause}), each run keeping what its backward needs "
            f"while the later ones run, and no plan of it fits the budget of {format_bytes(self.budget.nbytes or 0)} "
            f"beside its other runs (its least peak found: {format_bytes(int(exc.minimum or 0))}): it is "
            f"planned as it was, and these steps can exceed the budget. Raise the budget, or {advice}"
        )

    def _repeats(self, step: object) -> tuple[str, str]:
        """Why a graph of the step of signature ``step`` runs several times in it, and what
        makes it run once: Dynamo's reasons for its graph breaks (``breaks``). A loop over
        layers broken inside its body runs the body's graph once per layer: at a branch on a
        tensor (LayerDrop's), or at code Dynamo cannot trace (a ``print``, a
        ``torch._dynamo.disable``'d function, the observers of eager-mode quantization-aware
        training)."""
        reasons = self.breaks.get(step, ())
        if not reasons or any(reason.startswith(_BRANCH_BREAK) for reason in reasons):
            return (
                "a loop over layers broken by a branch on a tensor, as LayerDrop's is, runs each layer's body "
                "as one graph",
                "set the layer dropping to 0 (Hugging Face: layerdrop), so that the loop is one graph planned whole",
            )
        return (
            "a loop over layers split by graph breaks runs each piece of a layer as one graph; Dynamo could not "
            f"trace: {'; '.join(reasons)}",
            "make that code traceable (TORCH_LOGS=graph_breaks lists where it is), so that the loop is one graph "
            "planned whole",
        )

    def _note_checkpointed(self, joint: fx.GraphModule, jg: JointGraph, index: int) -> None:
        """Ops of ``torch.utils.checkpoint`` regions in the joint graph (AOTAutograd tags them
        ``meta["recompute"]``): planned as any other (checkmate chooses what to recompute), so
        under a fraction, which is of the step's keep-all peak, the regions' memory saving
        is not kept: said once (``checkpoint_warning``); logged under bytes."""
        tagged = sum(1 for n in joint.graph.nodes if n.meta.get("recompute") is not None)
        if not tagged:
            return
        self.checkpointed += tagged
        log.info(
            "graph %d: %d ops in torch.utils.checkpoint regions, planned as the others (the regions are not followed)",
            index,
            tagged,
        )
        if self.budget.fraction is None or self.warned_checkpoint:
            return
        self.warned_checkpoint = True
        self.checkpoint_warning = CHECKPOINTED.format(
            ops=tagged, peak=format_bytes(keep_all_peak(jg.graph)), fraction=self.budget.fraction
        )

    def _warn_calls(self, why: str) -> None:
        """Once, the :class:`BudgetWarning` (``calls_warning``, for the caller to issue at the
        line that called the module) that the step in which the module was found called
        again before the earlier calls' backward can exceed the budget: they were planned
        to fit it alone."""
        if self.warned_calls:
            return
        self.warned_calls = True
        self.calls_warning = (
            f"the module was called again before the backward of {self.calls - 1} earlier call(s), planned to "
            f"fit the budget of {format_bytes(self.budget.nbytes or 0)} alone, and {why}: this step can exceed "
            "it. From the next call on, each call is planned to fit beside the others"
        )

    def _share_of_others(self) -> int:
        """Under a byte budget, what the module's other calls held at once (``calls``) get of
        what DDP's buckets and FSDP2's parameters leave, at an even share each."""
        net = max((self.budget.nbytes or 0) - self._beside(), 0)
        return net * (self.calls - 1) // self.calls

    def _beside_parts(self) -> tuple[tuple[str, int], ...]:
        """What is held beside every graph of the step that no plan holds, named, in bytes:
        DDP's gradient buckets, FSDP2's unsharded parameters, and the gradients the parameters
        already held when the call started (``held_grads``: the budget covers gradients, and
        those accumulated over earlier micro-batches stay through the step)."""
        return (
            ("DDP's buckets", ddp_reserve()),
            ("FSDP2's parameters", fsdp_reserve()),
            (self._grads_what(), self.held_grads),
        )

    def _grads_what(self) -> str:
        """The gradients held as a call starts, in words (:attr:`grads_late`)."""
        if self.grads_late:
            return "the last step's gradients held through the forward"
        if self.grads_zeroed:
            return "zero gradients kept by zero_grad(set_to_none=False)"
        return "gradients held from earlier micro-batches"

    def _beside(self) -> int:
        """The bytes of :meth:`_beside_parts`."""
        return sum(nbytes for _, nbytes in self._beside_parts())

    def _beside_what(self) -> str:
        """What :meth:`_beside_parts` holds now, in words."""
        return " and ".join(name for name, nbytes in self._beside_parts() if nbytes)

    def _reserve_what(self, reserve: int) -> str:
        """What ``reserve`` bytes set aside beside a graph hold, in words: the parts held now,
        and what the graphs before it keep where the reserve is more than those."""
        parts = [self._beside_what(), _EARLIER if reserve > self._beside() else ""]
        return " and ".join(p for p in parts if p) or _RESERVED.removeprefix("held beside this graph: ")

    def _outside_room(self, graph: Graph, held: dict[object, int] | None = None) -> int:
        """Under a byte budget, the bytes code outside the module held beside this step as
        measured (:meth:`check_step`; ``held``: another of its measures, ``outside`` by
        default); for a step not measured yet, that per byte of its outputs' gradients, at
        the most any step measured."""
        held = self.outside if held is None else held
        if self.budget.nbytes is None or not held:
            return 0
        if self.step in held:
            return held[self.step]
        rates = [
            room / grads
            for step, room in held.items()
            if (grads := sum(tangent_bytes(self.records[i].joint.graph) for i in self.latest.get(step, ())))
        ]
        return int(max(rates, default=0.0) * tangent_bytes(graph))

    def _later_room(self, graph: Graph, profile_id: str) -> tuple[int, int]:
        """Under a byte budget, what the graphs after this one in the call need beside it:
        at its forward/backward boundary, where they run, and beside its whole run. As a
        call before this one found them (``split``): the sum of their least peaks (room to
        run in beside what this one saves), and the gradients they leave (held while this
        one's backward runs). Else under DDP, which splits a step's graph at its buckets,
        the gradients of its parameters that no graph of this call so far computes, for
        both. Else, when the step goes on after this graph (a graph break), a guess: at the
        boundary, the more of :data:`LATER_ROOM` times its outputs' gradient bytes (a loss
        on them) and, unless its outputs are scalars (a loss: what follows is bookkeeping,
        such as the output object a Hugging Face model builds), its own least peak (the
        rest of a model split in two: about as large as this part), and those gradients
        beside the whole run. When the call's forward
        returns, :meth:`finish_call` compares the guess with the graphs that followed.
        Else nothing. A step of a new input shape whose graph in this position has the
        structure of one of a step already split takes that step's needs, scaled by the
        two graphs' keep-all peaks (:meth:`_split_of_another_shape`)."""
        if self.budget.nbytes is None:
            return 0, 0
        # this step's graphs as a call before this one compiled them, else another input
        # shape's (an epoch's short last batch runs once: it must fit at its first call)
        known = self.split.get(self.step) or self._split_of_another_shape(graph)
        if known is not None:
            later = known[len(self.call) + 1 :]
            dropped, handed = self._later_relief(graph)
            return sum(least for _, least in later) - dropped, sum(g for g, _ in later) - handed
        total = ddp_reserve()  # one copy of every gradient DDP reduces
        if total:
            # those of this graph and the ones before it, each run's own (a layer loop's graph)
            own = sum(
                gradient_bytes(g) * self._runs_of(g)
                for g in [graph, *(self.records[i].joint.graph for i in self.call)]
            )
            return max(total - own, 0), max(total - own, 0)
        if self.more_follows:  # a graph break: the step goes on, on what this graph returns
            tangents = [int(n.mem) for n in graph.nodes if n.op.startswith("tangents")]
            grads = sum(tangents)
            room = LATER_ROOM * grads
            if max(tangents, default=0) > SCALAR_BYTES:
                # outputs the rest of a model may go on from (a loss's scalar ends the model)
                room = max(room, self._least_peak(graph, profile_id, GUESS_SECONDS))
            self.guessed.setdefault(self.step, (profile_id, {}))[1][len(self.call)] = room
            return room, grads
        return 0, 0

    def _later_relief(self, graph: Graph) -> tuple[int, int]:
        """Of what the graphs after ``graph`` in a step planned before (``split``) need beside
        it (:meth:`_later_room`), what their graphs as planned then show it need not leave:
        at its boundary, the outputs the loop was seen to drop before the next graph's
        backward (:meth:`observe`; part of what this graph and the ones before it hold there,
        gone while that backward runs), where that graph's forward, which reads them, still
        fits; beside its whole run, the gradients they hand to the backwards before theirs
        (:attr:`PlanRecord.input_grads`), up to this graph's tangents (counted in its peak)."""
        position = len(self.call) + 1
        graphs = self.latest.get(self.step, ())
        known = self.split.get(self.step)
        if known is None or len(graphs) != len(known) or len(graphs) <= position:
            return 0, 0
        later = [self.records[i] for i in graphs[position:]]
        handed = min(tangent_bytes(graph), sum(r.input_grads for r in later))
        dropped = self.dropped_seen.get((self.step, position), 0)
        forward = share_of(later[0]).forward if dropped else 0
        return max(min(dropped, known[position][1] - forward), 0), handed

    def _split_of_another_shape(self, graph: Graph) -> tuple[tuple[int, int], ...] | None:
        """For a step not split before (a new input shape): the ``split`` of a step that was,
        whose graph in this graph's position in the call has its structure, each figure
        scaled by this graph's keep-all peak over that one's (the graphs after it are not
        compiled yet, and values scale with the batch); the nearest in size when several.
        Measured: a Hugging Face GPT-2 whose loss a graph break splits off, at batch 8 then
        7, ran the first batch-7 step at 1.17x the byte budget planned without it."""
        k = len(self.call)
        shape = structure(graph)
        ref = keep_all_peak(graph)
        best: tuple[float, tuple[tuple[int, int], ...]] | None = None
        for step, known in self.split.items():
            graphs = self.latest.get(step, [])
            if len(graphs) != len(known) or len(known) <= k + 1:
                continue
            there = self.records[graphs[k]]
            if structure(there.joint.graph) != shape or there.reference_peak <= 0:
                continue
            scale = ref / there.reference_peak
            if best is None or abs(math.log(scale)) < abs(math.log(best[0])):
                best = (scale, tuple((int(g * scale), int(least * scale)) for g, least in known))
        return None if best is None else best[1]

    def _least_peak(self, graph: Graph, profile_id: str, within: float = 10.0) -> int:
        """The least peak a schedule of ``graph`` found reaches (its keep-all peak when none
        is found), within at most ``within`` seconds."""
        ref = keep_all_peak(graph)
        least = Budget(least=True, reference=ref)
        limit = min(self.time_limit or within, within)
        solve = lambda _: self._cached(graph, least, profile_id, time_limit=limit)  # noqa: E731
        res = self._shared(graph, -1, solve, profile_id, limit)
        return int(res.peak or ref) if res.ok else ref

    def _shared(
        self,
        graph: Graph,
        nbytes: int,
        solve: Callable[[int], SolveResult],
        profile_id: str,
        time_limit: float | None = None,
        boundary: int | None = None,
    ) -> SolveResult:
        """``solve(nbytes)``, or under torch.distributed the plan another rank made of
        ``graph`` at ``nbytes`` (and ``boundary``) with these settings
        (:func:`checkmate.distributed.plan_once`)."""
        limit = time_limit or self.time_limit
        options = sorted(self.options.items())
        scope = f"{self.strategy}|{options!r}|{limit}|{profile_id}|{self.plan_path}|{boundary}"
        # a rank waits for the plan another is making: its time limit, and building the model
        wait = 4 * (limit or 30.0) + 120.0
        return plan_once(graph, nbytes, solve, scope=scope, wait_s=wait)

    def _held_before(self) -> int:
        """Under a byte budget, the simulated bytes the graphs compiled earlier in this call
        hold at their forward/backward boundary (0 for a fraction: each graph's own), each as
        many times as it runs in a step (``runs``: a BART's encoder layers, before its decoder's)."""
        if self.budget.nbytes is None or not self.call:
            return 0
        return sum(
            _held_bytes(self.records[i])[0] * self._runs_of(self.records[i].joint.graph) for i in self.call
        )

    def _runs_of(self, graph: Graph) -> int:
        """How many times a graph of ``graph``'s structure runs in a step, as measured (``runs``)."""
        return self.runs.get(structure(graph), 1) if self.runs else 1

    def _solve(
        self,
        jg: JointGraph,
        profile_id: str,
        earlier: int = 0,
        room: int | None = None,
        *,
        hedged: bool = False,
    ) -> tuple[SolveResult, int | None, int | None]:
        """The plan of ``jg``; when it was planned above the budget asked (see
        :meth:`partition`), the bytes asked; when it reuses the plan of another record
        (the same graph at other sizes), that record's index. ``earlier`` bytes of a byte
        budget are held beside the graph; ``room`` more are to be left free at its
        forward/backward boundary (:attr:`solvers.budget.Budget.boundary`). ``hedged``: the
        caller plans otherwise where this finds no plan (:meth:`_solved`).

        Gradients the loop frees between the forward and the backward (:attr:`grads_late`)
        are held through the forward only: where the module computes the loss (and its plans
        run uncompiled, ``compiler="aot"``), the graph is first planned with them held through
        its forward (:func:`~solvers.boundary.with_forward_hold`), its plan kept where the
        simulator finds its forward fits beside them (:func:`~solvers.boundary.forward_peak`;
        a family's plan is kept so too); else it is planned beside them through the whole
        step, as accumulated ones are. Measured: a 4-layer transformer computing its loss
        (27.7 MiB of gradients) at 0.8 of eager's peak, +11.8% of compute planned beside them
        throughout, +3.0% through its forward only; at 0.7, none fitted beside them throughout.

        Raises:
            InfeasibleBudgetError: no schedule fits the budget (or none was found in time).
        """
        # only where the module computes the loss: code outside it that runs before the loop frees
        # them (a loss on its outputs) holds more beside them than the plan's boundary shows (an MLP
        # whose cross-entropy is outside, at 0.85 of eager's peak, stepped at 1.03x the budget so)
        loss_inside = tangent_bytes(jg.graph) <= SCALAR_BYTES
        # not under Inductor, whose compiled check replans to its measured peak without them
        forward = (
            self.held_grads
            if self.grads_late and self.budget.nbytes is not None and loss_inside and self.compiler == "aot"
            else 0
        )
        if forward:
            try:
                got = self._solve_at(jg, profile_id, earlier, room, forward, hedged=True)
            except InfeasibleBudgetError:  # so is the whole step beside them: its error says by how much
                got = None
            if got is not None:
                return got
            log.info(
                "no plan found leaves %s of gradients room through the forward only: planning beside them "
                "through the whole step",
                format_bytes(forward),
            )
        self.late_throughout = self.late_throughout or bool(self.grads_late and self.held_grads)
        got = self._solve_at(jg, profile_id, earlier, room, hedged=hedged)
        assert got is not None  # only a plan beside what the forward alone holds can miss
        return got

    def _solve_at(
        self,
        jg: JointGraph,
        profile_id: str,
        earlier: int = 0,
        room: int | None = None,
        forward: int = 0,
        *,
        hedged: bool = False,
    ) -> tuple[SolveResult, int | None, int | None] | None:
        """:meth:`_solve`, ``forward`` bytes of what is held beside the graph (:meth:`_beside`)
        held through its forward only (its plan made with them held there, a family's checked
        so), and None where the plan's forward does not fit beside them."""
        graph = jg.graph
        ref = keep_all_peak(graph)  # what fractions refer to: simulated once per graph
        shape = structure(graph)
        family = self.families.get(shape, [])
        budget = self.budget
        # DDP's gradient buckets, FSDP2's unsharded parameters, gradients held: live beside the graph
        reserve = self._beside() - forward + earlier
        # bytes for the graph alone (a fraction without a family: resolved in _plan)
        target, nbytes = family_target(budget, ref, self.records, family, reserve)
        forward = 0 if nbytes is None else forward
        bound = (
            None
            if (room is None and not forward) or nbytes is None
            else max(nbytes - (room or 0) - forward, 0)
        )
        if bound is not None:
            target = replace(target, boundary=bound)

        def holds(res: SolveResult) -> bool:
            if res.schedule is None or (bound is not None and boundary_hold(graph, res.schedule) > bound):
                return False
            return not forward or forward_peak(graph, res.schedule) + forward <= (nbytes or 0)

        bounded = {} if bound is None else {"boundary": bound}  # for a replan (the compiled check)
        if family and nbytes is not None and ref <= nbytes:
            # keeping every value fits these sizes (a short last batch): no plan recomputes less
            res = checkpoint_all(graph, nbytes)
            if holds(res):
                info = {**res.info, "chosen": res.strategy, "reference": ref, KEEPS_ALL: True, **bounded}
                return replace(res, info=info), None, None
        if family and nbytes is not None:
            got = reuse(graph, ref, self.records, family, nbytes, holds)
            if got is not None:
                return replace(got[0], info={**got[0].info, **bounded}), None, got[1]
            if budget.nbytes is not None and bound is None:
                solve = lambda g, b: self._shared(  # noqa: E731
                    g, b.resolve(0), lambda _: self._solved(g, b, profile_id), profile_id
                )
                # what is held beside the graph grows with its shapes (a loss on its outputs, the
                # other graphs of the step), but for the gradients DDP reduces (its parameters')
                own = max(tangent_bytes(graph), 1)
                growing = max(earlier - ddp_reserve(), 0)
                at_size = lambda big: nbytes - int(growing * (tangent_bytes(big) / own - 1))  # noqa: E731
                ahead, self.ahead_ceiling[shape] = plan_ahead(
                    graph, ref, self.records, family, nbytes, solve, at_size, self.ahead_ceiling.get(shape)
                )
                if ahead is not None:
                    return ahead, None, None
        if forward:  # planned with them held through the forward (solvers.boundary), on the graph after
            held = with_forward_hold(graph, forward)
            at_boundary = None if room is None else max((nbytes or 0) - room, 0)  # the hold counts there
            res, asked = self._plan(
                held,
                keep_all_peak(held),
                profile_id,
                replace(target, boundary=at_boundary),
                reserve,
                hedged=hedged,
                like=graph,
            )
            if res.ok and res.schedule is not None:
                sim = simulate(graph, schedule := without_ballast(res.schedule, 0))
                res = replace(res, schedule=schedule, cost=sim.cost, peak=sim.peak)
        else:
            res, asked = self._plan(graph, ref, profile_id, target, reserve, hedged=hedged)
        found = res.ok and res.schedule is not None and (not forward or holds(res))
        kept = self._kept(graph, ref, shape, nbytes, holds, res if found and asked is None else None)
        if kept is not None:
            return replace(kept[0], info={**kept[0].info, **bounded}), None, kept[1]
        if not res.ok or res.schedule is None:
            # both numbers: the proven bound, and the least peak a schedule found reaches
            raise no_plan_error(graph, res, time_limit=self.time_limit)
        if not found:  # the simulator's check of what the strategy returned
            return None
        return replace(res, info={**res.info, "reference": ref}), asked, None  # a pinned plan may lack it

    def _supersede(self, index: int) -> None:
        """Take the plan of record ``index`` out of its family: the step is compiled again with
        other room beside its graphs, for which that plan was not made. It is kept
        (:attr:`superseded`) for :meth:`_kept`."""
        shape = structure(self.records[index].joint.graph)
        family = self.families.get(shape, [])
        if index in family:
            family.remove(index)
            self.superseded.setdefault(shape, []).append(index)

    def _kept(
        self,
        graph: Graph,
        ref: int,
        shape: Hashable,
        nbytes: int | None,
        holds: Callable[[SolveResult], bool],
        solved: SolveResult | None,
    ) -> tuple[SolveResult, int] | None:
        """A superseded plan of ``graph``'s structure (:meth:`_supersede`) that fits ``nbytes``
        (and ``holds``) and costs less than ``solved``, the plan solved anew (None: none was
        found, or none within the bytes asked), with its record's index; else None.

        The heuristics are not monotone in the budget: a Hugging Face Mamba (its reference
        scan, 582 ops) at 0.9 of eager's peak, compiled again with 5.9 MiB more for the graph
        once its step was measured, was planned at +25.5% of compute where its first plan,
        which fits those bytes too, cost +18.5%. More bytes never cost more compute so."""
        candidates = self.superseded.get(shape)
        if not candidates or nbytes is None:
            return None
        got = reuse(graph, ref, self.records, candidates, nbytes, holds)
        if got is None:
            return None
        if solved is not None and (solved.cost or 0.0) <= (got[0].cost or 0.0):
            return None
        log.info(
            "graph %d: the plan solved again %s; the plan of graph %d, which fits its budget too, is kept (%s)",
            len(self.records),
            "found none" if solved is None else f"costs more ({overhead(solved, graph):+.1%} of compute)",
            got[1],
            f"{overhead(got[0], graph):+.1%}",
        )
        return got

    def _solved(
        self,
        graph: Graph,
        budget: Budget,
        profile_id: str,
        *,
        hedged: bool = False,
        like: Graph | None = None,
    ) -> SolveResult:
        """:meth:`_cached`'s plan, or the :class:`InfeasibleBudgetError` naming the budget that
        has one. Raised where the solve runs: under torch.distributed the rank that planned
        sends it whole to the ranks waiting for its plan, so that all take the same fallback
        (a budget proven too small and one whose schedule was not found in time alike).

        ``hedged``: the caller plans otherwise where this finds no plan (with less room beside
        the graph). Then a budget below the least peak found for the graph (``like``'s where
        given: the graph without a hold added), in this process or recorded by an earlier one
        (:func:`checkmate.cache.recall_least_peak`), is searched briefly (:data:`HEDGE_SHARE`
        of the time limit): a retry at the minimum an :class:`InfeasibleBudgetError` named
        first leaves room for a loss outside the module, below that minimum, and spent the
        whole time limit there in vain (a two-headed MLP's retry took 31 s at a 30 s limit).
        The heuristics, whose schedules differ with the op costs measured, still run: a
        GPT-2's found one there. The least peak an error names is recorded for later
        processes (:func:`checkmate.cache.remember_least_peak`).

        A hedged budget below the graph's cheap bound (:func:`~solvers.bounds.memory_lower_bound`:
        some op's working set alone is more) has no plan: its error names the least peak the
        heuristics find (about a second), and the exact search is left to the caller's last
        try. A Qwen2 given labels, at a byte budget under that bound, searched the least peak
        twice in full (with and without the room at its boundary): 51 s to its error."""
        limit = None
        hedged = hedged and budget.nbytes is not None and not budget.least
        if hedged and (budget.nbytes or 0) < (floor := memory_lower_bound(graph)):
            log.info(
                "%s is below what one op needs (%s)", format_bytes(budget.nbytes or 0), format_bytes(floor)
            )
            below = SolveResult(
                self.strategy, Status.INFEASIBLE, budget.nbytes or 0, info={"min_budget": floor}
            )
            raise no_plan_error(graph, below, time_limit=self.time_limit, exact=False)
        if hedged and budget.nbytes is not None:
            found = known_least_peak(like or graph)
            peak = recall_least_peak(like or graph) if found is None else found.peak
            if peak is not None and budget.nbytes < peak:
                limit = max(HEDGE_SHARE * (self.time_limit or 30.0), 1.0)
                log.info(
                    "%s is below the least peak found for this graph (%s): searched for %.1f s",
                    format_bytes(budget.nbytes),
                    format_bytes(peak),
                    limit,
                )
        try:
            res = self._cached(graph, budget, profile_id, time_limit=limit)
            if not res.ok or res.schedule is None:
                error = no_plan_error(graph, res, time_limit=self.time_limit)
                # a schedule peaking within the bytes was found: the strategy did not search for it
                searchable = (
                    hedged and self.strategy != "auto" and (error.minimum or 0) <= (budget.nbytes or 0)
                )
                helped = self._with_auto(graph, budget, profile_id, limit) if searchable else None
                if helped is None:
                    raise error
                res = helped
        except InfeasibleBudgetError as exc:
            if exc.minimum is not None:  # for a later process's retry at it
                remember_least_peak(graph, exc.minimum)
            raise
        return res

    def _with_auto(
        self, graph: Graph, budget: Budget, profile_id: str, time_limit: float | None
    ) -> SolveResult | None:
        """Where the strategy asked for found no plan of ``graph`` within ``budget`` leaving room
        beside it (a hedged try: the caller plans at the whole budget otherwise, leaving none)
        though the least-peak search found a schedule peaking within those bytes, ``auto``'s
        plan, when it finds one; else None. A strategy that does not search the
        budget (``chen-sqrtn``'s plan is fixed; ``dtr`` evicts without seeing ahead) otherwise
        ends planned at the whole budget with no room for what the step holds beside the graph:
        an MLP whose cross-entropy on 4 MiB of logits runs outside it, at 0.7 of eager's peak,
        stepped at 1.19-1.43x the budget under ``dtr``, ``griewank``, ``mincut`` and
        ``chen-sqrtn`` (the last for good: its replan with the room measured kept every value)."""
        got = cached_solve(
            graph, budget, "auto", time_limit=time_limit or self.time_limit, profile_id=profile_id,
            plan_path=self.plan_path,
        )  # fmt: skip
        if not got.ok or got.schedule is None:
            return None
        log.info(
            "strategy %r found no plan within %s leaving room beside the graph: auto's plan (%s) is used",
            self.strategy,
            format_bytes(budget.nbytes or 0),
            got.info.get("chosen", got.strategy),
        )
        return got

    def _cached(
        self, graph: Graph, budget: Budget, profile_id: str, time_limit: float | None = None
    ) -> SolveResult:
        """The plan cache's plan of ``graph`` at ``budget``, with this planner's settings
        (``time_limit`` in place of its own, when given)."""
        return cached_solve(
            graph, budget, self.strategy, time_limit=time_limit or self.time_limit, options=self.options,
            profile_id=profile_id, plan_path=self.plan_path,
        )  # fmt: skip

    def _plan(
        self,
        graph: Graph,
        ref: int,
        profile_id: str,
        target: Budget,
        reserve: int,
        *,
        hedged: bool = False,
        like: Graph | None = None,
    ) -> tuple[SolveResult, int | None]:
        """Solve ``graph`` (keep-all peak ``ref``) at ``target``; see :meth:`partition` for
        a fraction infeasible for a small graph. Bytes are the graph's own; a fraction's
        bytes are taken ``reserve`` off. ``hedged``, ``like``: see :meth:`_solved`."""

        def run(budget: Budget) -> SolveResult:
            if budget.least:  # the least peak: nothing to reserve from
                least = replace(budget, reference=ref)
                return self._shared(graph, -1, lambda _: self._solved(graph, least, profile_id), profile_id)
            b = budget.for_graph(ref, reserve if budget.fraction is not None else 0)
            solve = lambda _: self._solved(graph, b, profile_id, hedged=hedged, like=like)  # noqa: E731
            return self._shared(graph, b.resolve(ref), solve, profile_id, boundary=b.boundary)

        try:
            return run(target), None
        except InfeasibleBudgetError as exc:
            fraction = self.budget.fraction
            larger = (
                None if fraction is None else larger_shape_budget(self.records, self.steps, self.step, ref)
            )
            if larger is not None and larger > exc.budget:
                # the same graph of a larger step planned at these bytes: a smaller batch
                # whose graph Dynamo specialized differently (a size of 1) gets them too
                return run(Budget(nbytes=larger)), exc.budget
            largest = max((self.records[i].reference_peak for i in self.steps.get(self.step, [])), default=0)
            # a graph ending at a graph break, the largest of its step so far: the graphs after
            # it may be larger (a feature extractor before its encoder), so it is planned above
            # the fraction now, and the error stands only if none of them is twice its size
            unsettled = fraction is not None and 2 * ref > largest and self.more_follows
            if reserve and (fraction is None or 2 * ref > largest):  # raised, now or when the step settles
                # the bytes in the message are the graph's own: say where the rest went
                what = self._reserve_what(reserve)
                exc.add_note(
                    _reserve_note(reserve, ref, fraction, exc.minimum, what, self.budget.nbytes, exc.budget)
                )
            if unsettled:
                exc.add_note(
                    f"graph {len(self.records)} of this step is followed by more of the step (a graph "
                    "break), so it was planned above the fraction in case a later graph set the step's "
                    "peak; none is twice its size, so it sets the step's peak"
                )
                pending = _Unsettled(len(self.records), ref, exc.with_traceback(None))
                self.unsettled.setdefault(self.step, []).append(pending)
            elif fraction is None or 2 * ref > largest:
                raise
            asked, minimum = exc.budget, exc.minimum
        res: SolveResult | None = None
        if minimum is not None and minimum < ref:
            try:
                res = run(Budget(nbytes=minimum))
            except InfeasibleBudgetError:  # run() returns plans only (see _solved)
                res = None
        if res is None:
            res = run(Budget(nbytes=ref))  # keep-all fits its own peak
        assert fraction is not None  # a byte budget raised above
        why = (
            "The step goes on after it (a graph break), and it is the largest graph of the step so "
            "far: unless a graph after it is twice its size, InfeasibleBudgetError is raised when "
            "the step's forward returns"
            if unsettled
            else f"It is at most half the largest graph of this step ({format_bytes(largest)}), which "
            "sets the step's peak; pass the budget in bytes to make this an error"
        )
        if asked > (fraction + 0.01) * ref:  # a larger shape's bytes raised it (partition)
            at = f"{format_bytes(asked)} ({asked / max(ref, 1):.0%} of its peak, raised for it above the {fraction:.0%} asked)"
        elif reserve and asked < fraction * ref:
            at = f"the {fraction:.0%} asked ({format_bytes(asked)}: its bytes less {format_bytes(reserve)} {_RESERVED})"
        else:
            at = f"the {fraction:.0%} asked ({format_bytes(asked)})"
        said = (
            f"graph {len(self.records)} ({graph.n - 1} ops, keep-all peak {format_bytes(ref)}) has no schedule at "
            f"{at}; it is planned at {format_bytes(res.budget)} ({res.budget / max(ref, 1):.0%} of its peak) "
            f"instead. {why}"
        )
        shape_free = (structure(graph), unsettled)
        if shape_free in self.warned_raised:  # the same graph at another input shape
            log.info("%s", said)
        else:
            self.warned_raised.add(shape_free)
            warnings.warn(said, BudgetWarning, stacklevel=2)
        return res, asked
