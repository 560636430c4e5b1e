"""The torch.compile backend that plans each joint graph and runs the plan.

Dynamo captures the model's forward (one or more graphs, one per graph break);
AOTAutograd traces each into a functionalized joint forward+backward graph and hands it to a
partition function. Ours is the whole pipeline for one graph, one call a line:

    joint fx graph -> solvers.Graph (trace) -> per-op costs (profile) -> plan (cache / solve)
    -> forward and backward GraphModules (codegen)

Two compilers run those modules (``Planner.compiler``):

- ``"aot"``: as they are (boxed fx modules, one aten op at a time): the step executes exactly
  the plan's ops in the plan's order.
- ``"inductor"``: Inductor compiles them (C++ on CPU, Triton on CUDA). The planner is then
  Inductor's partitioner (``torch._inductor.config.custom_partitioner_fn``): it receives the
  joint graph after Inductor's joint-graph passes, and Inductor fuses, reorders within its
  dependencies and reuses buffers in the two halves it returns. Costs are then those of the
  compiled step (:mod:`checkmate.fusion`): an op Inductor fuses into its consumer costs the
  memory it moves, not a kernel; a matrix product that an addition reads runs where the
  addition is, as Inductor's ``addmm`` does (:func:`checkmate.trace.into_addmm`). Inductor
  compiles the halves with buffer reuse off and horizontal fusion only where the budget has
  room for what the plan frees between the two kernels (:class:`checkmate.backends.PlanOrderChoices`). Since
  Inductor still does not hold exactly what the plan simulates, each plan is compiled and
  run once before it is returned, and replanned until its measured peak fits the budget
  (:mod:`checkmate.compiled`); the step then runs that compile, from Inductor's cache.

The two torch.compile backends are :mod:`checkmate.backends`; this module is the planner
they call, in layers, each a module: its state (:mod:`checkmate.planner_state`), how one graph
is planned (:mod:`checkmate.planning`), how a step is judged against the budget
(:mod:`checkmate.step_budget`), and here the backend's end, :class:`Planner`.

Either way AOTAutograd's runtime wraps the two halves in an autograd.Function, so
``loss.backward()``, optimizers and gradient accumulation work as usual, and it copies
mutated buffers (BatchNorm running statistics) back once per step.
"""

from __future__ import annotations

import dis
import functools
import logging
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx

from checkmate.backends import RECORD_KEY, Watch, aot_backend, flat_args, inductor_backend
from checkmate.codegen import SplitModules, generate
from checkmate.planner_common import (
    GUESS_SLACK,
    LATER_ROOM,
    LEAST_COSTLY,
    SCALAR_BYTES,
    BudgetWarning,
    OverheadWarning,
    _codegen,
    _held_bytes,
)
from checkmate.records import KEEPS_ALL, PlanRecord
from checkmate.split import OutputWatch, input_gradients, largest_gradient, loose_outputs
from checkmate.step_budget import StepBudget
from checkmate.stepcheck import abort_windows
from checkmate.tangents import compiled_nodes, grad_fns
from checkmate.timers import stage
from checkmate.trace import JointGraph, data_dependent_size, drop_outputs_beside_loss
from solvers.budget import format_bytes
from solvers.errors import HeldOutputsError, InfeasibleBudgetError, TraceError
from solvers.result import SolveResult

#: planning progress at INFO (one line per stage that takes seconds, one per plan); see README
log = logging.getLogger("checkmate")


__all__ = ["COMPILERS", "BudgetWarning", "OverheadWarning", "PlanRecord", "Planner"]


#: what compiles the planned forward and backward: ``"aot"`` runs them as fx modules,
#: ``"inductor"`` compiles them with Inductor (see the module docstring and
#: docs/compilers.md)
COMPILERS = ("aot", "inductor")


#: the dispatch key of an active FakeTensorMode (Dynamo propagating fake tensors)
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


#: a plan holding the outputs beside its loss through the backward (under Inductor, compiled),
#: whose compute exceeds its graph's by more than this, is planned again with them dropped
#: where the loop is seen dropping them (:meth:`Planner.first_backward`): a compile more, once
DROP_WORTH = 0.02


#: nor where those outputs are less than this share of the budget: their room buys little (a
#: Swin's 320 bytes of logits beside a 536 KiB budget)
DROP_SHARE = 0.05


def ends_at_graph_break(gm: fx.GraphModule) -> bool:
    """Whether Dynamo ended the graph ``gm`` at a graph break, rather than at its frame's
    return: the step goes on after it (in more graphs, or eagerly). Dynamo records why it
    compiled a graph on the module it hands the backend (``compile_subgraph_reason``);
    a graph without that record (traced some other way) counts as a whole step."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


def called_from_model_code() -> bool:
    """Whether the frame Dynamo is compiling was called by the model's code, still running:
    a graph break in a caller (a Hugging Face feature encoder setting ``requires_grad``)
    makes Dynamo run the callee as a frame of its own, and when it returns, the caller's
    step goes on. Read from the Python stack above the backend, up to checkmate's own call
    of the step: a frame of a ``forward``, of Dynamo's resumption of one, or of a module
    outside torch and the standard library is the model's, unless the call it is making
    is its last act (``return f(...)``: Dynamo's call of the part of a frame after a graph
    break, its resumption, is one), which makes it transparent: its caller decides."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module == "checkmate.api":
            return False  # checkmate's call of the step: the frame compiled is the step's own
        name, top = frame.f_code.co_name, module.partition(".")[0]
        if (
            top != "checkmate"
            and (
                name == "forward"
                or name.startswith("torch_dynamo_resume_in_")
                or (top != "torch" and top not in sys.stdlib_module_names)
            )
            and not _returns_next(frame)
        ):
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _returns_next(frame: types.FrameType) -> bool:
    """Whether the instruction after the one ``frame`` is executing (a call) returns."""
    after = [i for i in _instructions(frame.f_code) if i.offset > frame.f_lasti]
    return bool(after) and after[0].opname in ("RETURN_VALUE", "RETURN_CONST")


def _instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    """``code``'s instructions (a frame's code runs once per step: read once). Code that
    Dynamo generates can hold unhashable constants (a tensor hook registered in the forward:
    a dict), and is read each time."""
    try:
        return _cached_instructions(code)
    except TypeError:
        return tuple(dis.get_instructions(code))


@functools.lru_cache(maxsize=256)
def _cached_instructions(code: types.CodeType) -> tuple[dis.Instruction, ...]:
    return tuple(dis.get_instructions(code))


class Planner(StepBudget):
    """Plans every graph torch.compile gives it; holds the records.

    This layer is the torch.compile backend's end: the graphs of each call and step kept track
    of, each joint graph partitioned into its planned forward and backward (:meth:`partition`),
    and the backwards watched for what the loop holds. How a graph is planned is
    :class:`~checkmate.planning.GraphPlanning`; how a step is judged against the budget,
    :class:`~checkmate.step_budget.StepBudget`; their state, each attribute described,
    :class:`~checkmate.planner_state.PlannerState`.
    """

    @property
    def plans_made(self) -> int:
        """How many graphs were planned (cache hits included); the others reuse a plan
        or, at sizes where keeping every value fits the budget, keep every value."""
        return sum(1 for r in self.records if r.reused_from is None and not r.result.info.get(KEEPS_ALL))

    def begin_step(self, signature: object) -> None:
        """Graphs compiled from now on belong to the training step with this input
        signature (their sizes decide which graph sets the step's peak)."""
        self.step = signature
        self.call = []
        self.ran = []
        self.watch = OutputWatch()

    def settle(self) -> None:
        """At the end of a call's forward, when every graph of its step is compiled: raise
        the :class:`InfeasibleBudgetError` of a graph planned above the fraction asked while
        the graphs after it were unknown (see :meth:`partition`), when none of them was at
        least twice its size. It is raised at every later call of the step that runs that
        graph; a call that runs other graphs instead (the user changed the model, say turned
        its gradient checkpointing off as the error's note advises, and Dynamo compiled the
        step anew) is judged by those."""
        error = self.unsettled_error()
        if error is not None:
            raise error

    def unsettled_error(self) -> InfeasibleBudgetError | None:
        """The error :meth:`settle` raises at the end of this call, if any: that of the first
        graph of the step planned above the fraction asked, unsettled, that ran in the call."""
        pending = self.unsettled.get(self.step)
        if not pending:  # every call of every step asks: no set built for nothing
            return None
        ran = set(self.ran)
        return next((u.error for u in pending if u.index in ran), None)

    def finish_call(self) -> None:
        """When a call's forward has returned: a graph of it planned with a guessed room for
        the graphs after it (:meth:`_later_room`) that is more than :data:`GUESS_SLACK` of
        the budget above what they need (their least peaks; nothing, when no graph with a
        backward followed: a graph break before code that runs eagerly) has the step
        compiled again at the next call with their needs (``split``, ``replan_pending``)."""
        guess = self.guessed.pop(self.step, None)
        if guess is None or self.step in self.split or self.budget.nbytes is None:
            return
        if self._keep_every_value(self.call):
            return  # more room changes none of the plans
        profile_id, rooms = guess
        needs = self._needs(profile_id)
        spare = max(room - sum(least for _, least in needs[k + 1 :]) for k, room in rooms.items())
        asked = self.budget.nbytes
        if spare <= GUESS_SLACK * asked:
            return
        self.split[self.step] = needs
        self.replan_pending = True
        for k in rooms:  # planned for less than they may use: not a plan for the family to reuse
            self._supersede(self.call[k])
        log.info(
            "the step's graphs were planned with %s more room for the graphs after them than those "
            "need: compiling it again at the next call with their needs",
            format_bytes(spare),
        )

    def given(self, rec: PlanRecord, given: dict[str, int]) -> None:
        """A backward of ``rec``'s plan was given gradients (name -> bytes) it planned as no
        bytes (``plan_unread``): the step differentiates outputs beside its loss. From now on
        plans count them; where this plan's peak and those bytes exceed its budget, the step
        is compiled again at its next call (``recompile``), with a :class:`BudgetWarning`."""
        self.plan_unread = False
        extra = sum(given.values())
        peak, budget = int(rec.result.peak or 0), int(rec.result.budget)
        if peak + extra <= budget or rec.index in self.warned_given:
            return
        self.warned_given.add(rec.index)
        self.recompile = True
        warnings.warn(
            f"graph {rec.index} returns a loss and outputs it was computed from (a language model's logits), "
            "and was planned without gradients for those outputs, which a step that differentiates only the "
            f"loss never gives; this backward was given {len(given)} ({format_bytes(extra)}), so it can exceed "
            f"its budget of {format_bytes(budget)} by up to {format_bytes(peak + extra - budget)}. The step is "
            "compiled again at its next call, counting them",
            BudgetWarning,
            stacklevel=2,
        )

    def held_at_once(self, calls: int, pending: Sequence[object]) -> bool:
        """The module was called while ``calls - 1`` earlier calls of it (their step signatures
        ``pending``) had not run their backward: what each keeps for its backward is held
        beside the next one. True when that is more calls than its graphs were planned for
        under a byte budget: from now on each graph is planned to fit beside the other calls
        (:meth:`_solve_beside_calls`), and the graphs of this call compiled next also beside
        what the pending calls hold now (``pending_held``), so that this step fits too where
        the pending calls' backwards do (else a :class:`BudgetWarning`). The caller compiles
        the module again (every input signature is planned again)."""
        if self.budget.nbytes is None or calls <= self.calls:
            return False
        self.calls = calls
        records = [self.records[i] for step in pending for i in self.latest.get(step, ())]
        held = [_held_bytes(r) for r in records]
        self.pending_held = sum(s for s, _, _ in held)
        # this call runs beside what the earlier ones hold; the first call's backward runs
        # last, beside the gradients the later calls' left, and ends with its own beside them
        # and their sums (_solve_beside_calls). Counting the second only, a GAN's
        # discriminator warned of 81 KiB over, and its step ran 299 KiB over
        net = self.budget.nbytes - self._beside()
        over = max(
            (
                max(p + self.pending_held, p + g, 2 * g + largest_gradient(r.joint.graph) if g else 0) - net
                for (_, p, g), r in zip(held, records)
            ),
            default=0,
        )
        if over > 0:
            self._warn_calls(
                f"the step can exceed it by up to {format_bytes(over)}, this call running beside what the "
                "earlier ones hold, and their backwards beside the gradients the later calls' backwards leave"
            )
        log.info(
            "%d calls of the module are held at once before a backward (the earlier ones hold %s): "
            "compiling it again, each call planned to fit beside the others in the budget of %s",
            calls,
            format_bytes(self.pending_held),
            format_bytes(self.budget.nbytes),
        )
        return True

    def backend(self) -> Callable[..., Any]:
        """A torch.compile backend running this planner's plans with its compiler."""
        if self.compiler == "inductor":
            inner = inductor_backend(self)
        else:
            # its first backward shows whether the loop drops the outputs beside the loss: a
            # plan with them dropped may recompute less (first_backward)
            inner = aot_backend(self, observe=True)

        def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], **configs: Any) -> Any:
            compile_id = torch._guards.CompileContext.current_compile_id()
            if compile_id is not None:  # Dynamo's guard failures name the compiles they come from
                self.compile_ids.add(str(compile_id))
            self.more_follows = ends_at_graph_break(gm) or called_from_model_code()
            self.made_inputs = tuple(
                isinstance(x, torch.Tensor) and x.grad_fn is not None for x in example_inputs
            )
            if (where := data_dependent_size(gm)) is not None:
                raise TraceError(
                    f"the step's graph {len(self.records)} has a size that depends on tensor values, at "
                    f"{where}: checkmate plans sizes known before the step runs. A captured .item() used "
                    "as a size makes one: set torch._dynamo.config.capture_scalar_outputs = False (Dynamo "
                    "then breaks the graph at the .item(), and plans the graphs around it), or compute the "
                    "size without reading a tensor"
                )
            before = len(self.records)
            step = inner(gm, example_inputs, **configs)
            if len(self.records) == before:  # nothing planned (no backward): not counted
                return step
            index = len(self.records) - 1

            @functools.wraps(step)  # keeps a boxed call boxed (its _boxed_call attribute)
            def counted(*args: Any) -> Any:
                # not Dynamo's DDP optimizer passing fake tensors through a compiled part of the
                # step to compile the next: counted so, every graph of a compiling call under DDP
                # ran twice, and on the CPU (steps not measured) a recompile of the step (for
                # gradients held) planned every graph for two runs beside each other
                if torch._C._get_dispatch_mode(_FAKE_MODE) is not None:
                    return step(*args)
                self.ran.append(index)
                return step(*args) if self.budget.nbytes is None else self._watched(index, step, args)

            return counted

        self.backends.append(compile_graph)
        return compile_graph

    def _watched(self, index: int, step: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """``step(*args)``, record ``index``'s graph run in a call under a byte budget, its
        outputs' backward watched: where the graphs before it in the call handed on outputs
        their backwards do not read, its backward's start says how many bytes of them the
        loop dropped (:meth:`observe`; none where a graph ran twice in the call: its other
        runs hold them); its own such outputs are watched for the graphs after it."""
        graphs = self.latest.get(self.step, ())
        position = graphs.index(index) if index in graphs else 0
        earlier = self.watch.snapshot() if self.watch.refs and len(set(self.ran)) == len(self.ran) else None
        if position and earlier is None:
            self.observe(self.step, position, 0)
        loose = self.records[index].loose
        if earlier is None and not loose:
            return step(*args)
        # read before a boxed call clears them
        made = grad_fns(flat_args(args)) if earlier is not None else frozenset()
        out = step(*args)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        nodes = compiled_nodes(outs, made) if earlier is not None else []
        if earlier is not None and nodes:
            report = functools.partial(self.observe, self.step, position)
            nodes[0].register_prehook(lambda _: report(earlier.dropped()))
        elif position and earlier is not None:
            self.observe(self.step, position, 0)  # no backward to watch: counted as held
        if loose:
            self.watch.add(outs, loose)
        return out

    def partition(
        self,
        joint: fx.GraphModule,
        joint_inputs: Sequence[Any],
        *,
        num_fwd_outputs: int,
        compiler: str = "aot",
        **_: Any,
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd's partition hook: plan the joint graph and generate its two halves.

        ``compiler`` is what will compile the halves (Inductor passes ``"inductor"``): it
        decides the op costs (:mod:`checkmate.fusion`).

        A fraction budget applies to each graph's own keep-all peak. A graph for which that
        fraction is infeasible (the largest op of a loss graph split off by a graph break
        needs its whole peak) is planned at its own minimum, or keep-all when the minimum
        is not known to be below it, with a :class:`BudgetWarning` (once per graph; at another
        input shape it is logged), when its keep-all peak
        is at most half that of the largest graph compiled for the same step so far: it
        does not set the step's peak. So is a graph that is the largest so far but after
        which the step goes on (a graph break: a Hugging Face wav2vec2's feature encoder is
        compiled before its larger encoder), provisionally: unless a later graph of the step
        is at least twice its size, :meth:`settle` raises the error when the step's forward
        returns. Otherwise, and for byte budgets, the :class:`InfeasibleBudgetError` is
        raised. Under Inductor with the compiled check,
        a budget below every schedule the graph model finds is first tried compiled: the
        plan at the least simulated peak, held to the bytes asked, and the error is raised
        only when no plan's compiled step fits them. A graph of the same structure as one
        planned before runs that plan when it fits (:mod:`checkmate.families`).
        """
        abort_windows()  # a step being measured whole: planning is no part of it
        spent: dict[str, float] = {}  # stage -> seconds (checkmate.timers), for the record
        device = _device_of(joint)
        index = len(self.records)
        log.info(
            "graph %d: tracing and timing %d ops on %s (%s)", index, len(joint.graph.nodes), device, compiler
        )
        with stage("trace", spent):  # the graph model, profiled as it is built
            jg = self._trace(joint, num_fwd_outputs, device, compiler, spent)
        log.info(
            "graph %d: graph model built in %.1f s; planning for a budget of %s",
            index,
            spent["trace"],
            self.budget,
        )
        self._note_checkpointed(joint, jg, index)
        profile_id = self.profile_id = _profile_id(self.profile, device, compiler)
        # the first steps of a module run before any was measured whole: room for a loss on
        # the outputs of the graph that ends the forward (the step measured whole corrects it)
        guess = 0
        if self.budget.nbytes is not None and not self.outside and not self.more_follows:
            guess = _loss_room(joint, jg, self.input_shapes)
        if (
            self.budget.nbytes is not None
            and not self.more_follows
            and self.calls == 1
            and jg.read_outside  # a step returning no loss: none is beside_loss
        ):
            # read by a loss outside the module: a loop computing it inline drops them before
            # the backward. Not where the module is called again before its backward (two views
            # of a batch): the loss reads the earlier calls' outputs after the later calls ran
            jg = replace(jg, beside_loss=_read_outside(jg, self.input_shapes))
        if self.loop_drops and jg.beside_loss and self.budget.nbytes is not None:
            jg = drop_outputs_beside_loss(jg)  # as the loop was seen to (first_backward)
        beyond: InfeasibleBudgetError | None = None  # the graph model's verdict, overruled below
        with stage("plan", spent):  # reuse a plan of its family, else the plan cache or a solve
            try:
                try:
                    res, asked, reused = self._solve_after_earlier(jg, profile_id, guess)
                except InfeasibleBudgetError as exc:
                    if not self._without_held_grads(exc):
                        raise
                    res, asked, reused = self._solve_after_earlier(jg, profile_id, guess)
            except InfeasibleBudgetError as exc:
                dropping = self._dropping_outputs(joint, jg, exc, profile_id, compiler)
                if dropping is not None:
                    jg, (res, asked, reused) = dropping
                else:
                    if not self._compiled_may_fit(compiler, exc):
                        self._note_outside(exc, jg.graph, guess)
                        raise
                    try:
                        res = self._at_least_peak(jg, exc, profile_id)
                    except InfeasibleBudgetError:
                        raise exc from None
                    beyond, asked, reused = exc, None, None
        with stage("codegen", spent):
            modules, paged = _codegen(joint, jg, res)
        check = None
        if compiler == "inductor" and self.check_compiled and self._can_check():
            with stage("check", spent):  # Inductor compiles the halves; they run once
                (res, modules, paged), check = self._checked(
                    joint,
                    jg,
                    (res, modules, paged),
                    profile_id,
                    # a graph planned with room for what was measured outside it: the step,
                    # measured whole again, is what is judged (check_step)
                    quiet=beyond is not None or self._outside_room(jg.graph) > 0,
                    # below the least simulated peak, costly plans are left to the fallback
                    cheap=beyond is not None and self.fallback,
                )
            jg = _unsaved_dropped(jg, modules)
            if beyond is not None and not check.fits:
                if check.error is not None:
                    beyond.add_note(f"Its compiled step, which may fit, could not be measured: {check.error}")
                else:
                    tried = ", ".join(format_bytes(r.measured or 0) for r in check.rounds)
                    costly = res.info.get(LEAST_COSTLY)
                    at = (
                        "at the least peak the graph model found"
                        if costly is None
                        else f"keeping every value (the plan at the least peak found recomputes {costly:+.0%})"
                    )
                    beyond.add_note(
                        f"Compiled by Inductor {at}, the step measured "
                        f"{format_bytes(check.measured or 0)} (plans measured: {tried})"
                    )
                raise beyond
        else:  # an output the plan saves lives on whether the loop holds it or not: not watched
            jg = _unsaved_dropped(jg, modules)
        handed = (loose_outputs(joint, jg), input_gradients(joint, jg, self.made_inputs))  # checkmate.split
        out = self._record(jg, res, modules, paged, asked, reused, spent, compiler, check, handed)
        bw_out = next(n for n in reversed(self.records[-1].modules.backward.graph.nodes) if n.op == "output")
        bw_out.meta[RECORD_KEY] = len(self.records) - 1
        self.call.append(len(self.records) - 1)
        self.latest[self.step] = list(self.call)
        if self.step in self.unsettled:  # a graph twice their size sets the step's peak
            peak = self.records[-1].reference_peak
            self.unsettled[self.step] = [
                u for u in self.unsettled[self.step] if u.index == index or peak < 2 * u.peak
            ]
        if self.budget.nbytes is not None and len(self.call) > 1 and not self.warned_split:
            self._check_split(profile_id)
        self._warn_if_costly(self.records[-1])
        if log.isEnabledFor(logging.INFO):
            rec = self.records[-1]
            took = ", ".join(f"{k} {v:.1f} s" for k, v in spent.items())
            log.info("%s; plan cache %s; %s", rec.summary(), rec.cache, took)
        return out

    def _dropping_outputs(
        self,
        joint: fx.GraphModule,
        jg: JointGraph,
        exc: InfeasibleBudgetError,
        profile_id: str,
        compiler: str,
    ) -> tuple[JointGraph, tuple[SolveResult, int | None, int | None]] | None:
        """Where a byte budget has no plan holding the outputs beside the graph's loss to the
        end of its backward (a language model's logits, as a loop that keeps ``outputs =
        model(...)`` holds them): the graph with them dropped when its backward starts
        (:func:`checkmate.trace.drop_outputs_beside_loss`, what a loop keeping only the loss
        holds) and its plan, when that fits. Outputs the plan saves for the backward (an
        attention's keys and values) live on whether the loop holds them or not, so they are
        held, and it is planned again. Each backward then checks that the loop no longer
        holds those dropped (:meth:`held`). None otherwise, with ``exc`` noting why."""
        if compiler != "aot" or not jg.beside_loss or self.budget.nbytes is None:
            return None
        held = sum(int(jg.graph.mem[i]) for i in jg.beside_loss)
        what, loop = _outputs_words(jg)
        if not self.plan_dropped:
            exc.add_note(
                f"The plan holds {what} ({format_bytes(held)}) until the backward ends: an earlier step held "
                f"them there. A loop that drops them before `loss.backward()` (`del outputs`, or {loop}) may have "
                "a plan"
            )
            return None
        keep: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset()
        while True:
            dropped = drop_outputs_beside_loss(jg, keep)
            if not dropped.dropped:
                exc.add_note(
                    f"{what[0].upper()}{what[1:]} are saved for the backward: dropping them saves nothing"
                )
                return None
            try:  # hedged: where it has no plan, the error raised is exc, whose search was done
                got = self._solve_after_earlier(dropped, profile_id, hedged=True)
            except InfeasibleBudgetError:
                exc.add_note(
                    f"Neither does a plan dropping {what} ({format_bytes(held)}) when the backward starts, as "
                    f"a loop {loop} does"
                )
                return None
            assert got[0].schedule is not None
            saved = {dropped.group.get(n) for n in generate(joint, dropped, got[0].schedule).saved}
            kept = frozenset(key for i, key in jg.beside_loss.items() if i in saved) & dropped.dropped
            if not kept:
                break
            keep |= kept
        # without its traceback, whose frames would hold the call's outputs (a loop dropping them
        # would seem to hold them)
        self.dropped_errors[len(self.records)] = exc.with_traceback(None)
        exc.__context__ = exc.__cause__ = None
        log.info(
            "graph %d: no plan holding %s (%s) through the backward fits; planned with them dropped when the "
            "backward starts, as a loop %s holds them",
            len(self.records),
            what,
            format_bytes(
                sum(int(jg.graph.mem[i]) for i, key in jg.beside_loss.items() if key in dropped.dropped)
            ),
            loop,
        )
        return dropped, got

    def watch_loop(self, rec: PlanRecord) -> Callable[[], Watch | None]:
        """For a graph of the step planned holding the outputs beside its loss (or those a loss
        outside the module reads: :attr:`JointGraph.read_outside`), what its backwards watch
        until the loop's first (:meth:`first_backward`): those outputs, under a byte budget
        (under Inductor, where plans are checked compiled)."""
        # planned dropped already (no plan held them): under Inductor it ran uncompiled, and may compile so
        keys = (
            frozenset(rec.joint.beside_loss.values())
            if rec.compiler != self.compiler or not rec.joint.dropped
            else frozenset()
        )

        def watch() -> Watch | None:
            if self.loop_seen or not keys or self.budget.nbytes is None or not self.plan_dropped:
                return None
            if self.compiler == "inductor" and not self.check_compiled:
                return None  # a plan dropping them would run unmeasured
            return keys, functools.partial(self.first_backward, rec)

        return watch

    def first_backward(self, rec: PlanRecord, nbytes: int) -> None:
        """The loop's first backward through ``rec``, a graph of the step planned holding the
        outputs beside its loss, found ``nbytes`` of them still held. Where it dropped them
        all (``loss = model(**batch).loss``, the Hugging Face ``Trainer``, a loss outside the
        module computed inline: ``loss = criterion(model(x), y)``), a plan with them
        dropped uses their room: the step is compiled again at its next call, each such
        graph planned (under Inductor, and checked compiled) so (``loop_drops``), and its
        backwards watch that the loop keeps dropping them (:meth:`held`). Only where ``rec``
        recomputes more than :data:`DROP_WORTH` of the step's compute, or, under Inductor,
        ran uncompiled (no plan compiled holding them fitted), and the outputs are at least
        :data:`DROP_SHARE` of the budget: a compile more, once.
        Measured on CPU: a Llama given ``labels=`` at 0.6 of eager's peak (1 MiB of logits)
        ran uncompiled at 1.24x eager's step time, at 0.77x the budget; compiled with the
        logits dropped, at 0.72x eager's time, 0.99x the budget."""
        if self.loop_seen:
            return
        self.loop_seen = True
        if nbytes or not self.plan_dropped:
            return
        if (rec.compiler == "inductor" or self.compiler == "aot") and rec.overhead <= DROP_WORTH:
            return  # planned (and compiled) holding them at little cost: not worth a compile more
        outputs = sum(int(rec.joint.graph.mem[i]) for i in rec.joint.beside_loss)
        if outputs < DROP_SHARE * (self.budget.nbytes or 0):
            return
        self.loop_drops = self.recompile = True
        log.info(
            "graph %d: the loop dropped %s before the backward; the step is compiled again at its next call, "
            "each graph planned%s with them dropped",
            rec.index,
            _outputs_words(rec.joint)[0],
            " and checked compiled" if self.compiler == "inductor" else "",
        )

    def held(self, rec: PlanRecord, nbytes: int) -> None:
        """A backward of ``rec``'s plan, made with the outputs beside its loss dropped when the
        backward starts, found ``nbytes`` of them still held. From now on plans hold them.
        Where the plan's peak and those bytes exceed its budget, the step is compiled again
        at its next call (``recompile``), and the :class:`InfeasibleBudgetError` that no
        plan holding them fits is raised now, from the backward, before the backward
        exceeds the budget (what the plan holds up to there counts the outputs). Outputs a
        loss outside the module reads (:attr:`JointGraph.read_outside`) have their gradients
        made by the loss's backward before the module's starts: that step can exceed the
        budget by up to their bytes: a loop holding them is told one step late."""
        self.plan_dropped = False
        error = self.dropped_errors.pop(rec.index, None)
        if rec.compiled is not None or error is None:  # dropped as the loop was seen to
            self._held_seen(rec, nbytes)
            return
        peak, budget = int(rec.result.peak or 0), int(rec.result.budget)
        if peak + nbytes <= budget:
            return
        self.recompile = True
        what, loop = _outputs_words(rec.joint)
        error.add_note(
            f"It was planned with {what} dropped when the backward starts, as a loop {loop} does, but this "
            f"loop still held {format_bytes(nbytes)} of them at its backward, where the plan would exceed the budget by up to "
            f"{format_bytes(peak + nbytes - budget)}: drop them before `loss.backward()` (`del outputs`), or "
            "raise the budget"
        )
        self.abandoned = True
        raise error.with_traceback(None)

    def _held_seen(self, rec: PlanRecord, nbytes: int) -> None:
        """:meth:`held` for a plan made with the outputs beside its loss dropped, as the loop's
        first backward was seen to (:meth:`first_backward`; under Inductor, compiled and
        measured so). From now on plans hold them (``loop_drops`` off): the step is compiled
        again at its next call. Where the step's peak (measured compiled, else simulated) and
        those bytes exceed its budget, :class:`HeldOutputsError` is raised now, from the
        backward, before it exceeds it."""
        self.loop_drops = False
        self.recompile = True
        check = rec.compiled
        if check is not None:  # as simulated where its compiled step could not be measured
            peak = int(check.measured if check.measured is not None else rec.result.peak or 0)
            budget, how = check.budget, f"compiled by Inductor (measured {format_bytes(peak)})"
        else:
            peak, budget = int(rec.result.peak or 0), int(rec.result.budget)
            how = f"planned (simulated peak {format_bytes(peak)})"
        if peak + nbytes <= budget:
            log.info(
                "graph %d: the loop held %s of %s at the backward; within the budget, the step is compiled "
                "again at its next call holding them",
                rec.index,
                format_bytes(nbytes),
                _outputs_words(rec.joint)[0],
            )
            return
        self.abandoned = True
        raise HeldOutputsError(
            f"graph {rec.index} was {how} with {_outputs_words(rec.joint)[0]} dropped when the backward starts, "
            f"as this loop's first step dropped them, but this backward found {format_bytes(nbytes)} of them "
            f"still held, where the step could exceed the budget of {format_bytes(budget)} by up to "
            f"{format_bytes(peak + nbytes - budget)}. The backward did not run: drop the outputs before "
            "`loss.backward()` (`del outputs`), or call the step again, which plans it holding them"
            + (" (run uncompiled where no compiled plan fits so)" if check is not None else "")
        )

    def take_warnings(self) -> list[str]:
        """The :class:`BudgetWarning` messages for the caller to issue after a call (each once).
        That no plan of a graph fits beside its runs waits while the step is to be compiled
        again with its graphs' needs in view (``replan_pending``): planned so, the graphs
        before it leave it room (the layer-dropping blocks under DDP at 0.75 of eager DDP's
        peak: warned, then 0.68x the budget); said if the plans made then do not fit."""
        runs = None if self.replan_pending else self.runs_warning
        said = [
            m
            for m in (
                self.calls_warning,
                runs,
                self.grads_warning,
                self.checkpoint_warning,
                self.retained_warning,
            )
            if m
        ]
        if self.replan_pending and self.runs_warning:
            self.warned_runs = False  # judged again when planned with the needs in view
        self.calls_warning = self.runs_warning = self.grads_warning = self.checkpoint_warning = None
        self.retained_warning = None
        return said


def _read_outside(
    jg: JointGraph, inputs: frozenset[tuple[int, ...]]
) -> dict[int, tuple[tuple[int, ...], torch.dtype]]:
    """The outputs of ``jg`` a loss outside the module reads (:attr:`JointGraph.read_outside`)
    that a loop may drop before the backward starts: not those of the shape of one of the
    call's ``inputs`` (a block's output, which the next block reads; see :func:`_loss_room`)."""
    return {i: key for i, key in jg.read_outside.items() if key[0] not in inputs}


def _outputs_words(jg: JointGraph) -> tuple[str, str]:
    """How messages name the outputs a plan of ``jg`` may drop when the backward starts
    (:attr:`JointGraph.beside_loss`), and the loop that drops them."""
    if jg.read_outside:  # a step returning no loss, whose beside_loss are some of these
        return (
            "the outputs the loss outside the module reads",
            "computing the loss inline (`loss = criterion(model(x), y)`)",
        )
    return "the outputs beside the loss", "keeping only the loss (`loss = model(**batch).loss`)"


def _loss_room(
    joint: fx.GraphModule, jg: JointGraph, inputs: frozenset[tuple[int, ...]] = frozenset()
) -> int:
    """A guess at what a loss computed outside the module on a graph's outputs holds beside
    its step: :data:`LATER_ROOM` times the outputs' gradients, each element counted at 4
    bytes at least (a loss is computed in float32: a bfloat16 output under autocast is
    upcast first, and held twice its bytes). None where an output is a scalar (the module
    computes its loss) or none is differentiable; an output of the shape of one of the
    call's ``inputs`` is a block's (a transformer layer, one of the blocks a model optimized
    apart runs in turn: the next one reads it, it is not given to a loss), counted as none.
    Measured: an MLP with a 512-way head under CPU autocast, its cross-entropy computed on
    the bfloat16 logits outside it, stepped at 1.14x a byte budget of 0.6 of eager's peak at
    its first two calls planned without the room, 0.87x with it."""
    sizes = []
    for node in joint.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if (
            node.name.startswith("tangents")
            and node.name not in jg.unread
            and isinstance(val, torch.Tensor)
            and (val.is_floating_point() or val.is_complex())
            and tuple(val.shape) not in inputs
        ):
            sizes.append(val.numel() * max(val.element_size(), 4))
    if not sizes or min(sizes) <= SCALAR_BYTES:
        return 0
    return LATER_ROOM * sum(sizes)


def _unsaved_dropped(jg: JointGraph, modules: SplitModules) -> JointGraph:
    """``jg`` with the outputs it dropped when the backward starts that ``modules`` save for
    the backward no longer among them: they live on whether the loop holds them or not (an
    attention's keys and values), so that a backward finding them alive does not take them
    for held (:meth:`Planner.held`)."""
    if not jg.dropped:
        return jg
    saved = {jg.group.get(n) for n in modules.saved}
    kept = frozenset(key for i, key in jg.beside_loss.items() if i in saved)
    return replace(jg, dropped=jg.dropped - kept) if kept & jg.dropped else jg


def _device_of(gm: fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _profile_id(profile: str | None, device: torch.device, compiler: str) -> str:
    """The plan cache's key for the costs: the profile's, and the compiler's cost model."""
    from checkmate.profile import profile_id

    pid = profile_id(profile, device)
    return pid if compiler == "aot" else f"{pid}:{compiler}"
