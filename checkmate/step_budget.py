"""How the planner judges a training step against its byte budget: a step measured whole
(:meth:`StepBudget.check_step`: what it held beyond its plans, and where, and whether to compile it
again with room for that), the graphs of a split step found to exceed the budget together, a graph
run more often than planned, and the warnings that say so.

:class:`StepBudget` is a layer of :class:`checkmate.runtime.Planner`: its methods are the planner's
and its state the planner's (:class:`~checkmate.planner_state.PlannerState`).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence

from checkmate.distributed import ddp_reserve
from checkmate.planner_common import (
    COSTLY,
    GUESS_SLACK,
    RETAINED_ADVICE,
    RETAINED_WHY,
    BudgetWarning,
    OverheadWarning,
    _held_bytes,
)
from checkmate.planning import GraphPlanning
from checkmate.records import PlanRecord
from checkmate.split import Share, could_drop, share_of, step_estimates
from checkmate.stepcheck import STEP_SLACK
from solvers.budget import format_bytes
from solvers.errors import InfeasibleBudgetError
from solvers.resize import structure

#: planning progress at INFO, on the logger the whole planner writes to
log = logging.getLogger("checkmate")


#: graphs of one step planned with one another in view whose simulated peak together is at
#: most this share of a byte budget are not warned about: the simulation of a step's graphs
#: is not exact (a Hugging Face GPT-2 with labels: 1.002x simulated, 0.79x measured)
SPLIT_SLACK = 1.02


#: what makes a step's ops that ran outside every captured graph planned (a step measured
#: over its byte budget because of them says it)
_UNCAPTURED_ADVICE = (
    "make the code Dynamo could not trace traceable (TORCH_LOGS=graph_breaks lists it; the "
    "UnplannedWarning at the step's first call named it)"
)


#: a loop that frees the gradients only between the forward and the backward, in words, and
#: what gives its plans their room back (the warnings about gradients held say it)
LATE_ZERO = (
    "the last step's, which the loop frees only between the forward and the backward "
    "(optimizer.zero_grad() after the loss is computed, as PyTorch Lightning's loop calls it)"
)


LATE_ZERO_ADVICE = (
    "Free them before the forward: optimizer.zero_grad() right after optimizer.step() (with "
    "Lightning, override the LightningModule's optimizer_step to call "
    "optimizer.step(closure=optimizer_closure) and then optimizer.zero_grad())"
)


RETAINED = (
    "the training step measured {peak}, {ratio:.2f}x {of}: " + RETAINED_WHY + ", and no plan holding what "
    "the forward saves through every backward fits. To have it fit, "
    + RETAINED_ADVICE
    + ", or raise the budget"
)


def _measured_alone(records: Sequence[PlanRecord]) -> int | None:
    """The compiled peak the one graph of a step measured alone (:mod:`checkmate.compiled`),
    or None: for steps of several graphs (each measured without the others' held bytes)
    and graphs not measured compiled."""
    return _measured(records[0]) if len(records) == 1 else None


def _measured(record: PlanRecord) -> int | None:
    """The peak ``record``'s compiled step measured alone (:mod:`checkmate.compiled`), or None."""
    return None if record.compiled is None else record.compiled.measured


def repeated(ran: Mapping[int, int]) -> str:
    """The graphs that ran more than once in a step (``ran``: record index -> runs), in words:
    ``"graph 2 4 times, graph 3 4 times"``."""
    return ", ".join(f"graph {i} {n} times" for i, n in sorted(ran.items()) if n > 1)


class StepBudget(GraphPlanning):
    """The planner's methods that judge a step against the budget (see the module)."""

    def _warn_if_costly(self, rec: PlanRecord) -> None:
        """An :class:`OverheadWarning`, once per planner, for a plan whose compute exceeds
        its graph's by more than :data:`COSTLY`."""
        if self.warned_costly or rec.result.cost is None or rec.overhead <= COSTLY:
            return
        if self.replan_pending and self.step in self.split:
            return  # a plan for this step only (_check_split): the next call compiles it again
        self.warned_costly = True
        chosen = rec.result.info.get("chosen", rec.result.strategy)
        warnings.warn(
            f"graph {rec.index} ({rec.joint.graph.n - 1} ops): the plan for a budget of "
            f"{format_bytes(rec.budget or 0)} recomputes {rec.recomputes:,} values, {rec.overhead:+.0%} of "
            f"the step's compute (chosen by {chosen}). Either the budget is close to the least this graph "
            "runs in, where each byte saved costs much more compute, or the solvers found no cheaper plan "
            "in time: a slightly larger budget can cost a fraction of this, and a "
            "longer time_limit lets the solvers search further (`checkmate sweep` on the graph saved "
            "by `checkmate trace` shows the cost at each budget)",
            OverheadWarning,
            stacklevel=3,
        )

    def _check_split(self, profile_id: str, step: object = None, call: Sequence[int] | None = None) -> None:
        """When the graphs of one call (split by graph breaks, or by DDP at its gradient
        buckets) can together exceed a byte budget that each meets alone: the step is
        compiled again at the next call, each graph then planned with what the others hold
        beside it (``split``); where that does not hold either, a :class:`BudgetWarning`, once.
        ``step`` and ``call``: the step's signature and its graphs (the current call's).

        What each graph holds while the others run is :mod:`checkmate.split`'s model. The
        outputs a graph hands on that its backward does not read (a language model's logits,
        handed to its loss after a graph break) live through the later graphs' backwards
        only where the loop holds them: until a backward was watched (:meth:`observe`), a
        step that fits without them is judged at the next call (``unobserved``,
        :meth:`judge_split`), and a loop holding them counts them."""
        running = step is None  # as the step runs (partition), not judged after it ran (judge_split)
        step = self.step if step is None else step
        call = self.call if call is None else call
        buckets = ddp_reserve()
        splitters = "DDP's gradient buckets" if buckets else "graph breaks"
        beside = self._beside()  # DDP's buckets, FSDP2's parameters, gradients held: beside every graph
        nbytes = self._graphs_room()
        records, runs, shares, seen = self._split_parts(step, call)
        estimates = step_estimates(shares, runs, [d or 0 for d in seen])
        worst = max(range(len(shares)), key=lambda j: estimates[j])
        if estimates[worst] <= nbytes:
            return  # a guessed room is judged when the call's forward returns (finish_call)
        if step in self.split and estimates[worst] <= SPLIT_SLACK * nbytes:
            return  # planned with the others in view, and over by less than the model's accuracy
        unseen = step not in self.split and any(d is None for d in seen[1:])
        if unseen and max(step_estimates(shares, runs, could_drop(records, runs))) <= nbytes:
            self.unobserved[step] = profile_id  # fits where the loop drops them: its backward says
            return
        if step not in self.split:  # not planned with the later graphs in view yet
            # what each graph leaves while an earlier one's backward runs, and at least holds
            # while it runs itself (its least peak: the room the earlier ones must leave it)
            self.split[step] = self._needs(profile_id, call)  # finish_call drops a guess then
            self.replan_pending = True
            log.info(
                "the step's %d graphs can together reach %s, over the %s of the budget left to them: "
                "compiling it again at the next call, each graph planned with the others beside it",
                len(shares),
                format_bytes(estimates[worst]),
                format_bytes(nbytes),
            )
            if running and estimates[worst] > SPLIT_SLACK * nbytes and not self.warned_found:
                # this step runs over: said before it does (on a GPU, before an out-of-memory
                # error). Unwarned, a Hugging Face Segformer split by transformers' first-call
                # graph break (its output hooks installed) stepped at 1.46x the budget
                self.warned_found = True
                warnings.warn(
                    f"{splitters} split this step into {len(shares)} graphs, found as it runs: this step, "
                    f"its earlier graphs planned before the later ones were known, can reach about "
                    f"{format_bytes(estimates[worst])} ({estimates[worst] / nbytes:.2f}x the "
                    f"{format_bytes(nbytes)} of the budget left to the graphs). The next call compiles the "
                    "step again, each graph planned with the others beside it; a break seen at the first "
                    "call only (a library's one-time set-up) then leaves one graph",
                    BudgetWarning,
                    stacklevel=2,
                )
            return
        if self._without_held_grads():  # planned again as if none were held, and warned of
            self.replan_pending = True
            return
        self.warned_split = True
        held = sum(s.held * r for s, r in zip(shares[:worst], runs[:worst]))
        remedy = (
            "torch._dynamo.config.optimize_ddp = False makes it one graph (DDP then reduces the "
            "gradients after the backward instead of during it)"
            if buckets
            else "remove the graph break (TORCH_LOGS=graph_breaks names it; fullgraph=True makes it an error)"
        )
        warnings.warn(
            f"{splitters} split this step into {len(shares)} graphs, and no plans of them fit a byte budget together: while "
            f"graph {call[worst]} runs (its own peak {format_bytes(shares[worst].peak)}"
            + (f", beside its {runs[worst] - 1} other runs in the step" if runs[worst] > 1 else "")
            + "), the graphs "
            f"before it hold {format_bytes(held)} for their backward and those after it the gradients "
            f"they left, so the step can reach about {format_bytes(estimates[worst])} "
            f"({estimates[worst] / nbytes:.2f}x the {format_bytes(nbytes)} of the budget left to the graphs"
            + (f" beside {format_bytes(beside)} of {self._beside_what()}" if beside else "")
            + f"). To hold it, {remedy}, or pass a larger budget",
            BudgetWarning,
            stacklevel=2,
        )

    def _split_parts(
        self, step: object, call: Sequence[int]
    ) -> tuple[list[PlanRecord], list[int], list[Share], list[int | None]]:
        """Of ``step``'s graphs (``call``, record indices in call order): their records, runs,
        their shares (:class:`~checkmate.split.Share`), and the bytes of what the earlier ones handed on
        found gone at each one's backward (None: not watched yet)."""
        records = [self.records[i] for i in call]
        runs = [self._runs_of(r.joint.graph) for r in records]
        seen = [self.dropped_seen.get((step, j)) for j in range(len(records))]
        return records, runs, [share_of(r) for r in records], seen

    def _split_peak(self, step: object) -> int:
        """The simulated peak of ``step``'s graphs together (:func:`checkmate.split.step_estimates`),
        as its backwards found the loop dropping what they hand on."""
        _, runs, shares, seen = self._split_parts(step, self.latest.get(step, []))
        return max(step_estimates(shares, runs, [d or 0 for d in seen]), default=0)

    def judge_split(self) -> None:
        """As a call starts: a step whose graphs fit together only where the loop drops the
        outputs they hand on (``unobserved``), its backward watched since (:meth:`observe`),
        judged as :meth:`_check_split` does: compiled again now (``recompile``), each graph
        planned with the others beside it, where the loop holds them."""
        for step in [s for s in self.unobserved if s in self.latest]:
            call = self.latest[step]
            if any((step, j) not in self.dropped_seen for j in range(1, len(call))):
                continue  # no backward of it ran yet
            profile_id = self.unobserved.pop(step)
            self._check_split(profile_id, step, call)
            if self.replan_pending:
                self.replan_pending, self.recompile = False, True

    def observe(self, step: object, position: int, dropped: int) -> None:
        """The backward of the graph at ``position`` in a call of ``step`` started with
        ``dropped`` bytes of the outputs the graphs before it handed on gone
        (:class:`checkmate.split.OutputWatch`). The least seen counts; where it is less than
        what the step was judged with, it is judged again at the next call, or, planned with
        its graphs in view (``split``), with room for them, compiled again then."""
        key = (step, position)
        before = self.dropped_seen.get(key)
        if before is not None and dropped >= before:
            return
        self.dropped_seen[key] = dropped
        if before is None:
            return
        log.info(
            "the loop held %s more of what the step's graphs hand on through a backward than before: "
            "judging the step again at its next call",
            format_bytes(before - dropped),
        )
        if step in self.split:
            self.recompile = True  # each graph planned again with room for them (_later_relief)
        elif self.profile_id is not None:
            self.unobserved.setdefault(step, self.profile_id)

    def _graphs_room(self) -> int:
        """Under a byte budget, what it leaves the graphs of one call: less what is held beside
        every graph (DDP's buckets, FSDP2's parameters, gradients held) and the module's other
        calls' share."""
        asked = self.budget.nbytes
        assert asked is not None
        return max(asked - self._beside() - self._share_of_others(), 1)

    def runs_fit(self, ran: Mapping[int, int]) -> bool:
        """Whether the graphs a call ran (``ran``: record index -> runs, in the order they first
        ran), as planned, fit the byte budget run so many times each, as :meth:`_check_split`
        estimates: a graph planned for fewer runs that still fits needs no plan for them."""
        reach, room = self.runs_reach(ran)
        return reach <= room

    def runs_reach(self, ran: Mapping[int, int]) -> tuple[int, int]:
        """What the graphs a call ran (``ran``, as :meth:`runs_fit`), as planned, can reach
        together run so many times each, as :meth:`_check_split` estimates, and the bytes of
        the budget left to the graphs."""
        if not ran:
            return 0, self._graphs_room()
        records = [self.records[i] for i in ran]
        runs = [max(n, self._runs_of(r.joint.graph)) for r, n in zip(records, ran.values())]
        reach = max(step_estimates([share_of(r) for r in records], runs, [0] * len(runs)))
        return reach, self._graphs_room()

    def _without_held_grads(self, exc: InfeasibleBudgetError | None = None) -> bool:
        """Where plans were made beside gradients held (``held_grads``) and none fits (``exc``,
        or the graphs of a step together): plan as if none were held, as before they were
        found, with a :class:`BudgetWarning` (``grads_warning``, once) that the step can exceed
        the budget by them. True where there were some."""
        held = self.held_grads
        if not held:
            return False
        beside, what = self._beside(), self._beside_what()  # the gradients, and DDP's or FSDP2's reserve
        self.held_grads = 0
        least = (
            ""
            if exc is None or exc.minimum is None
            else f" (a graph's least peak found, {format_bytes(int(exc.minimum))}, reaches "
            f"{format_bytes(int(exc.minimum) + beside)} beside {what})"
        )
        log.info(
            "no plan fits beside the %s of gradients held: planning as if none were held", format_bytes(held)
        )
        if self.grads_warning is None and not self.warned_grads:
            self.warned_grads = True
            said = f"the parameters held {format_bytes(held)} of gradients as the step started"
            budget = format_bytes(self.budget.nbytes or 0)
            if self.grads_late:
                said += f": {LATE_ZERO}, so they are held through the forward beside what it saves. The budget of "
                said += f"{budget} covers them"
                advice = LATE_ZERO_ADVICE
            elif self.grads_zeroed:
                said += f" (zeros kept by zero_grad(set_to_none=False)), which the budget of {budget} covers"
                advice = "Free them instead: zero_grad() with set_to_none=True, its default"
            else:
                said += " (accumulated over earlier micro-batches, or zeros kept by zero_grad(set_to_none=False)), "
                said += f"which the budget of {budget} covers"
                advice = "Where gradients are not accumulated on purpose, zero them before each step (optimizer.zero_grad())"
            self.grads_warning = (
                f"{said}, and no plan fits beside them{least}: planned as if none were held, these steps can exceed "
                f"the budget by up to {format_bytes(held)}. {advice}; else raise the budget"
            )
        return True

    def check_step(
        self,
        step: object,
        peak: int,
        boundary: int | None = None,
        apart: int | None = None,
        ran: Mapping[int, int] | None = None,
        grads_held: int = 0,
        retained: int = 1,
    ) -> str | None:
        """The verdict on a training step measured whole (:mod:`checkmate.stepcheck`) at
        ``peak`` bytes beyond what was live at its start (``boundary``: its peak from the
        forward's return to the backward's start, where a loss outside the module runs, and
        ``apart``, its peak outside that span, where the module runs, when measured; ``grads_held``:
        the bytes of gradients the parameters held at its start, which the budget covers
        too): None when it is within
        the byte budget, or when it measured what its one graph measured compiled alone
        (over the budget by the plan's own excess, which the compiled check warned of:
        nothing is held outside); ``"replan"`` when it is not, the first time for this step
        or the first time one of its graphs ran more than once (``ran``: record index -> how
        many times its forward ran in the step; each run is then planned beside the others:
        ``runs``):
        the bytes beyond what its plans hold at their forward/backward boundary are held
        outside the module (``outside``), and the step is to be compiled again with that
        room; else the warning to give. A step planned with a guessed room for a loss that
        measured well within the budget is compiled again with the room measured: beside
        the whole step, what was held beside its plans' peak while the module ran
        (``apart``); at its boundary, what was held there (``outside_boundary``). A step of
        ``retained`` backwards through one forward's graph (``retain_graph=True`` on all but
        the last), measured over the budget, is compiled again with what its forward saves
        held through them (``retained``), then, over it again, warned of: autograd held what
        the forward saved through every backward but the last, which is no memory outside
        the module."""
        budget = self.budget.nbytes
        # gradients accumulated before the step stay through it: the step has the rest (of
        # those its plans were made beside; the others were warned of). Those of a loop that
        # accumulates them, at its first micro-batch too, which holds none yet: its plans run
        # at the next ones beside them (a micro-batch measured within the whole budget so, its
        # plan given less room than the loss outside it measured, stepped the others at 1.15x)
        grads_held = min(grads_held, self.held_grads) if self.grads_late else self.held_grads
        asked = None if budget is None else max(budget - grads_held, 1)
        graphs = self.latest.get(step, [])
        of = (  # what the step is measured against, in words
            f"the {format_bytes(asked or 0)} its budget of {format_bytes(budget or 0)} leaves beside "
            f"{format_bytes(grads_held)} of {self._grads_what().removeprefix('the ')}"
            if grads_held
            else f"its budget of {format_bytes(asked or 0)}"
        )
        if retained > 1 and asked is not None and peak > STEP_SLACK * asked:
            # what the forward saved, held through every backward: no memory outside the module
            log.info(
                "the training step measured %s, over its budget of %s, with a backward run again through its "
                "forward's graph (retain_graph=True)%s",
                format_bytes(peak),
                format_bytes(asked),
                ""
                if step in self.retained
                else ": compiling it again, what its forward saves held through them",
            )
            if self.retained.get(step, 0) >= retained:
                return RETAINED.format(peak=format_bytes(peak), ratio=peak / asked, of=of)
            self.retained[step] = retained
            self._forget_plans(step)
            self._overran(
                peak,
                asked,
                of,
                RETAINED_WHY,
                "with what its forward saves held through every backward",
                RETAINED_ADVICE,
            )
            return "replan"
        if asked is not None and peak <= STEP_SLACK * asked and step in self.loss_guess:
            # planned with a guessed room for a loss outside: what is held there now, measured
            # at the least, what the step measured beyond its plans' simulated peak (the loss
            # held beside it); measured over the budget after, it is planned again once more
            guess = self.loss_guess.pop(step)
            # beside the module's run (the loss's bytes at the boundary are not: below)
            self.outside[step] = self._beside_run(graphs, peak, apart)
            if boundary is not None and self.calls == 1:
                # what it held between the forward and the backward (where the loss runs) beyond
                # the plans' boundary: room there only. Planned again without it, a TinyTransformer
                # whose loss is outside, at 0.6 of eager's peak (0 B beside its plan's peak, 1.0
                # MiB at its boundary), stepped at 1.021x the budget
                held = sum(_held_bytes(self.records[i], as_run=True)[0] for i in graphs)
                self.outside_boundary[step] = max(boundary - held - self.outside[step], 0)
            if guess - self.outside[step] > GUESS_SLACK * asked:
                self.given_back.add(step)  # measured over the budget after, planned again once more
                # every plan keeps every value, which less room changes in none of them.
                # Compiled again anyway, a loop over 4 shapes of a language model whose loss is
                # outside it compiled 13 graphs, the plans the same as before
                keeps_all = self._keep_every_value(graphs)
                log.info(
                    "the training step measured %s of its budget of %s, planned with %s of room for a loss "
                    "outside the module, where it held about %s while the module ran and %s between its "
                    "forward and backward: %s",
                    format_bytes(peak),
                    format_bytes(asked),
                    format_bytes(guess),
                    format_bytes(self.outside[step]),
                    format_bytes(self.outside[step] + self.outside_boundary.get(step, 0)),
                    "its plans keep every value, as they would with less room"
                    if keeps_all
                    else "compiling it again at the next call with that room",
                )
                if keeps_all:
                    return None
                self._forget_plans(step)
                return "replan"
        if asked is None or peak <= STEP_SLACK * asked:
            if asked is not None:
                self.fitted.add(step)
            log.info(
                "the training step measured %s of its budget of %s%s",
                format_bytes(peak),
                format_bytes(asked or 0),
                "" if boundary is None else f" ({format_bytes(boundary)} between its forward and backward)",
            )
            return None
        if self.ran_more(step, ran or {}):
            # a graph ran more often than it was planned for: what the runs before its backward
            # held is no memory outside. Planned for them first; measured over again after, the
            # rest is held outside (below)
            times = repeated(ran or {})
            log.info(
                "the training step measured %s, over its budget of %s, running graphs more times than "
                "they were planned for (%s): compiling it again, each run planned beside the others",
                format_bytes(peak),
                format_bytes(asked),
                times,
            )
            cause, advice = self._repeats(step)
            self._overran(
                peak,
                asked,
                of,
                f"its graphs ran more times than they were planned for ({times}: {cause}), each run keeping what "
                "its backward needs while the later ones ran",
                "with each run planned beside the others",
                advice=advice,
            )
            return "replan"
        if step in self.runs_unfit:
            # a graph of it has no plan that fits beside its other runs, planned as one run: said
            # (_warn_runs), and not memory held outside the module, which room for would not fix
            log.info(
                "the training step measured %s, over its budget of %s, a graph of it running more times than "
                "any plan of it fits beside",
                format_bytes(peak),
                format_bytes(asked),
            )
            return None
        if (
            self.warned_split
            and step in self.split
            and self.calls == 1
            and peak <= STEP_SLACK * self._split_peak(step)
        ):
            # its graphs reach that together, as the warning that no plans of them fit said: no
            # memory outside the module. Taken for it, a small language model's loss graph behind
            # a graph break (16.13 MiB measured, as estimated) was planned with 8 MiB of room
            log.info(
                "the training step measured %s, over its budget of %s, as its graphs' plans together reach",
                format_bytes(peak),
                format_bytes(asked),
            )
            return None
        alone = _measured_alone([self.records[i] for i in graphs]) if self.calls == 1 else None
        if not self.outside and alone is not None and peak <= STEP_SLACK * alone:
            # what its graph measured compiled, alone: its plan's own excess, which the compiled
            # check warned of (no room was planned for anything outside, so it was not quiet),
            # and nothing held outside: room for it would only starve the plan
            log.info(
                "the training step measured %s, over its budget of %s, as its compiled graph did alone: "
                "nothing is held outside the module",
                format_bytes(peak),
                format_bytes(asked),
            )
            return None
        held = sum(_held_bytes(self.records[i], as_run=True)[0] for i in graphs)
        beyond = peak - asked + self.outside.get(step, self.loss_guess.pop(step, 0))
        if self.calls == 1:  # else the earlier calls hold more than this one's boundary
            beyond = max(peak - held, beyond)
        # what is held beyond the plans: ops the forward ran eagerly, where it found them large,
        # else code outside the module (a loss on its outputs)
        eager = self.uncaptured.get(step, 0)
        functions = self.eager_functions.get(step, ())
        saved = (
            f"{format_bytes(eager)} of it saved by ops its forward ran eagerly, outside every captured graph"
        )
        if functions:
            # its backward runs eagerly and allocates what it will: a Hugging Face Reformer's
            # reversible layers (an autograd.Function recomputing in its backward) stepped at
            # 1.43x a budget of 0.7 of eager's peak, said to be "a loss computed on its outputs"
            named = ", ".join(f"`{f}`" for f in functions[:3])
            what, advice = (
                (
                    f"{saved}, and the rest likely allocated by the backward of {named}, an autograd.Function run "
                    "so: no plan bounds either"
                    if eager
                    else f"likely allocated by the backward of {named}, an autograd.Function its forward ran "
                    "eagerly, outside every captured graph, which no plan bounds"
                ),
                f"have Dynamo capture {named} (TORCH_LOGS=graph_breaks says why it did not; an autograd.Function "
                "whose forward and backward are traceable PyTorch code is captured with the step)",
            )
        elif eager:
            what, advice = f"{saved}, which no plan bounds", _UNCAPTURED_ADVICE
        elif step in self.saved_hooks:
            what, advice = (
                "likely what saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) active "
                "around its forward packed for the backward, held in place of the values its plans count",
                (
                    "leave saved-tensor hooks off around the optimized module (its plan decides what the "
                    "backward keeps), or give the budget room for what they hold"
                ),
            )
        else:
            what, advice = (
                "a loss computed on its outputs, tensors kept from them, another model's step",
                (
                    "compute the loss inside the optimized module's forward (it is then planned with the step from "
                    "the first call)"
                ),
            )
        # measured within the budget before, over it now: what runs outside the module grew since
        # (a loss switched from a mean of the logits to a cross-entropy with a z-loss ran a
        # language model at 1.49x its budget from then on, unwarned: its step was measured once)
        grew = step in self.fitted
        self.fitted.discard(step)
        if step not in self.outside or step in self.given_back or grew:
            self.given_back.discard(step)
            if apart is not None and boundary is not None and self.calls == 1:
                # measured apart: what was held beside the module while it ran is room beside the
                # whole step, the rest only at its boundary, where the loss runs. All of it beside
                # the whole step, a segmentation net whose loss outside held 22.53 MiB at its
                # boundary, at 0.8 of eager's peak, had no plan (below what one op needs) and stepped
                # at 1.10x the budget, where plans holding less at the boundary fit (0.99x)
                self.outside[step] = self._beside_run(graphs, peak, apart)
                self.outside_boundary[step] = max(beyond - self.outside[step], 0)
            else:
                self.outside[step] = beyond  # at least what it held at the boundary, beyond the plans'
                self.outside_boundary.pop(step, None)
            log.info(
                "the training step measured %s, over its budget of %s: about %s is held outside the "
                "module between its forward and backward; compiling it again at the next call with that room",
                format_bytes(peak),
                format_bytes(asked),
                format_bytes(beyond),
            )
            if grew:
                self.warned_overrun = False  # a change in the loop, after the step fitted: said again
            self._overran(
                peak,
                asked,
                of,
                f"about {format_bytes(beyond)} is held outside the module between its forward and backward "
                f"({what}), more than its plans left room for"
                + (
                    ", and more than when a step of these input sizes was measured within the budget"
                    if grew
                    else ""
                ),
                "with room for it",
                advice=advice,
            )
            return "replan"
        return (
            f"the training step measured {format_bytes(peak)}, {peak / asked:.2f}x {of}: the module's plans "
            f"hold {format_bytes(held)} at the end of its forward, "
            f"and about {format_bytes(max(peak - held, 0))} more is held outside it between its forward and "
            f"backward ({what}), which planning with room for it could not make fit. To have it fit, {advice}, "
            f"or raise the budget to {format_bytes(peak + grads_held)}"
        )

    def _beside_run(self, graphs: Sequence[int], peak: int, apart: int | None) -> int:
        """Of a step measured whole (:meth:`check_step`) at ``peak``, the bytes held beside the
        module while it ran: its peak outside the forward/backward boundary (``apart``, where
        measured for a module called once; else the step's peak) beyond the plans' own (one
        call's simulated peak, beside what its earlier calls hold at their boundaries)."""
        planned = max(
            (
                p + (self.calls - 1) * b
                for b, p, _ in (_held_bytes(self.records[i], as_run=True) for i in graphs)
            ),
            default=0,
        )
        running = apart if apart is not None and self.calls == 1 else peak
        return max(running - planned, 0)

    def _overran(self, peak: int, asked: int, of: str, why: str, room: str, advice: str) -> None:
        """Once, the :class:`BudgetWarning` (``overrun_warning``, for the caller to issue) that
        a step measured whole at ``peak`` bytes exceeded the ``asked`` budget (``of``: it in
        words) because ``why``, and is compiled again at the next call (``room``: what the
        new plans leave room for; ``advice``: what makes the budget hold from the first
        step, beside leaving the excess spare). The steps of its input shape before it ran over the
        budget as this one did: the first calls are planned before a step can be measured,
        and a budget that nearly fills a GPU's memory can run out there (an MLP whose 8192-way
        loss, with label smoothing and a z-loss, is computed outside it, at 0.8 of eager's
        peak: 1.04x the budget measured, only logged, before it was planned again; at 0.6 of
        a 4096-way one, 1.22x)."""
        if self.warned_overrun:
            return
        self.warned_overrun = True
        self.overrun_warning = (
            f"the training step measured {format_bytes(peak)}, {peak / asked:.2f}x {of}: {why}. The module "
            f"is compiled again at its next call, {room}; steps like this one before then ran over the "
            f"budget as it did. To have the budget hold from the first step, {advice}, or leave "
            f"{format_bytes(peak - asked)} more memory spare than the budget"
        )

    def ran_more(self, step: object, ran: Mapping[int, int]) -> bool:
        """Record in ``runs`` the graphs that ran more than once in a step of signature
        ``step`` (``ran``: record index -> runs, in the order they first ran; a step measured
        whole over the budget, or one that cannot be measured), more times than their
        structure was planned for: True when there is one (the step is to be planned again).
        Under a byte budget, a step of several graphs is then planned with each graph's needs
        in view (``split``, runs counted): the graphs before a repeated one leave room for all
        its runs. Planned alone, a graph before the loop kept all it saved and left the runs
        none (the blocks under Inductor at 0.6 of eager's peak: 1.09x the budget, warned)."""
        more = False
        for i, n in ran.items():
            if n <= 1:  # the usual graph (this runs after every call where steps are not measured)
                continue
            shape = self._structures.get(i)
            if shape is None:
                shape = self._structures[i] = structure(self.records[i].joint.graph)
            if n > self.runs.get(shape, 1):
                self.runs[shape] = n
                more = True
        graphs = list(ran)  # every graph the step ran, in the order each first ran (its forwards')
        if more and len(graphs) > 1 and self.budget.nbytes is not None and self.profile_id is not None:
            self.split[step] = self._needs(self.profile_id, graphs)
        return more

    def unmeasured(self, step: object) -> bool:
        """A step that cannot be measured whole (other optimized modules run inside it: the
        blocks of a model optimized apart, whose outputs the next block reads, not a loss):
        True where it was planned with a guessed room for a loss outside, now dropped, so
        that the caller compiles it again."""
        if self.loss_guess.pop(step, None) is None:
            return False
        self.outside[step] = 0
        self.outside_boundary.pop(step, None)
        self._forget_plans(step)
        return True

    def _forget_plans(self, step: object) -> None:
        """Take the plans of ``step``'s latest compile out of their families: made with a room
        that was not needed, they are not to be reused when it is compiled again; the rooms
        change, and with them which stretches have a plan ahead."""
        self.ahead_ceiling.clear()
        for i in self.latest.get(step, []):
            self._supersede(i)
