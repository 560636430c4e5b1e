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
they call. Either way AOTAutograd's runtime wraps the two halves in an autograd.Function, so
``loss.backward()``, optimizers and gradient accumulation work as usual, and it copies
mutated buffers (BatchNorm running statistics) back once per step.
"""

from __future__ import annotations

import dis
import functools
import logging
import math
import sys
import types
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from checkmate.backends import (
    RECORD_KEY,
    NoCompiledFit,
    Watch,
    aot_backend,
    bw_donated,
    compile_half,
    flat_args,
    inductor_backend,
)
from checkmate.cache import cached_solve, recall_least_peak, remember_least_peak
from checkmate.codegen import SplitModules, generate
from checkmate.compiled import Calibration, CompileHalf
from checkmate.distributed import ddp_reserve, fsdp_reserve, plan_once
from checkmate.families import family_target, larger_shape_budget, plan_ahead, reuse
from checkmate.records import HELD_TO, KEEPS_ALL, PlanRecord, overhead
from checkmate.rng import replay_dropout_draws
from checkmate.scratch import flush_scratch, held_beyond, prefetch_scratch, scratch_bytes
from checkmate.split import (
    OutputWatch,
    Share,
    could_drop,
    gradient_bytes,
    input_gradients,
    largest_gradient,
    loose_outputs,
    share_of,
    step_estimates,
    tangent_bytes,
)
from checkmate.stepcheck import STEP_SLACK, abort_windows
from checkmate.tangents import (
    compiled_nodes,
    grad_fns,
    unread_tangents,
)
from checkmate.timers import stage
from checkmate.trace import (
    JointGraph,
    build_graph,
    correct_traced_dtypes,
    drop_outputs_beside_loss,
    recompute_dropout_from_mask,
)
from solvers.api import no_plan_error
from solvers.boundary import boundary_hold, forward_peak, retained_peaks, with_forward_hold, without_ballast
from solvers.bounds import memory_lower_bound
from solvers.budget import Budget, format_bytes
from solvers.errors import HeldOutputsError, InfeasibleBudgetError
from solvers.graph import Graph
from solvers.resize import structure
from solvers.result import SolveResult, Status
from solvers.schedule import COMPUTE, FREE, PAGEIN, PAGEOUT, keep_all_peak, schedule_from_order, simulate
from solvers.strategies.baselines import checkpoint_all
from solvers.strategies.least_peak import known_least_peak

#: planning progress at INFO (one line per stage that takes seconds, one per plan); see README
log = logging.getLogger("checkmate")

__all__ = ["COMPILERS", "BudgetWarning", "OverheadWarning", "PlanRecord", "Planner"]

#: graphs of one step planned with one another in view whose simulated peak together is at
#: most this share of a byte budget are not warned about: the simulation of a step's graphs
#: is not exact (a Hugging Face GPT-2 with labels: 1.002x simulated, 0.79x measured)
SPLIT_SLACK = 1.02

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
#: seconds for the least peak of a graph whose own least peak is the guess (a guess: the
#: first plan found is close enough)
GUESS_SECONDS = 2.0
#: a guessed room more than this share of the budget above what the graphs after it need
#: is replanned at the next call (:meth:`Planner.finish_call`)
GUESS_SLACK = 0.05
#: a try with a fallback (room left beside a graph) below the least peak found for the graph
#: is searched for this share of the time limit (:meth:`Planner._solved`)
HEDGE_SHARE = 0.1
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
RETAINED = (
    "the training step measured {peak}, {ratio:.2f}x {of}: " + RETAINED_WHY + ", and no plan holding what "
    "the forward saves through every backward fits. To have it fit, "
    + RETAINED_ADVICE
    + ", or raise the budget"
)
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

#: what compiles the planned forward and backward: ``"aot"`` runs them as fx modules,
#: ``"inductor"`` compiles them with Inductor (see the module docstring and the README,
#: "Compilers")
COMPILERS = ("aot", "inductor")


#: the dispatch key of an active FakeTensorMode (Dynamo propagating fake tensors)
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


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

#: a plan holding the outputs beside its loss through the backward (under Inductor, compiled),
#: whose compute exceeds its graph's by more than this, is planned again with them dropped
#: where the loop is seen dropping them (:meth:`Planner.first_backward`): a compile more, once
DROP_WORTH = 0.02
#: nor where those outputs are less than this share of the budget: their room buys little (a
#: Swin's 320 bytes of logits beside a 536 KiB budget)
DROP_SHARE = 0.05


@dataclass(frozen=True)
class _Unsettled:
    """A graph planned above the fraction asked while the graphs after it in its step were
    unknown: its record's index, its keep-all peak, and the error that stands unless a
    later graph of the step is at least twice that peak."""

    index: int
    peak: int
    error: InfeasibleBudgetError


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


@dataclass
class Planner:
    """Plans every graph torch.compile gives it; holds the records.

    Attributes:
        budget: the parsed budget: bytes or a fraction of each graph's simulated no-remat peak.
        strategy: a registered strategy name.
        profile: None to measure op times on the device, else a device profile name/path.
        time_limit: seconds per graph for searching strategies.
        options: strategy options.
        plan_path: a plan file to use instead of the cache.
        compiler: one of :data:`COMPILERS`.
        records: one per graph planned, in order.
        steps: training-step signature -> indices in ``records`` of the graphs compiled for
            it (the graphs of one step, recompilations included).
        step: the signature of the step being compiled (set by :meth:`begin_step`).
        call: indices in ``records`` of the graphs compiled in the current call (graph
            breaks: they run in one step, each holding what it saved while the next runs).
        ran: indices in ``records`` of the graphs whose forward ran in the current call, in
            order. A graph compiled once can run many times in one call, or not at all: the
            body of a layer loop broken by a branch on a tensor (LayerDrop's ``if
            torch.rand([]) < p``) runs once per layer kept, so steps of one input signature
            can hold different amounts (the caller measures a step that ran them more).
        runs: a graph's structure -> the most times a graph of it ran in one step measured
            whole (:meth:`check_step`), where more than once: each run holds what it saved
            while the next ones run, and each is planned beside the others
            (:meth:`_solve_beside_calls`; where no plan fits so, as one run, with a
            :class:`BudgetWarning`: :meth:`_warn_runs`).
        split: step signature -> per graph of a call of that step, in call order, the
            gradient bytes it left and its least peak, where those graphs together exceeded a
            byte budget: the step is compiled again (``replan_pending``, for the caller) and
            each graph planned with room for the graphs after it (:meth:`_later_gradients`).
        families: a graph's structure (:func:`solvers.resize.structure`: its ops and
            edges, not its sizes) -> indices in ``records`` of the graphs of that structure
            that were planned (not reused); see :mod:`checkmate.families`.
        ahead_ceiling: a structure -> the least keep-all peak of a graph stretched to plan
            ahead (:func:`checkmate.families.plan_ahead`) that got no plan to keep: larger
            stretches are not tried again (forgotten with the plans of a step compiled again).
        check_compiled: with ``"inductor"``, measure each plan compiled and replan to fit
            (:mod:`checkmate.compiled`).
        inputs: while the backend compiles, the step's tensors it was given.
        latest: step signature -> indices in ``records`` of the graphs its latest compile
            made, in call order.
        outside: step signature -> bytes the step measured beyond its plans, held by code
            outside the module between its forward and backward (:meth:`check_step`); each
            graph of the step is planned with that much room beside it, and a step not
            measured yet with as much per byte of its outputs' gradients as the most any
            step measured.
        outside_boundary: step signature -> bytes more than ``outside`` that code outside the
            module held at the step's forward/backward boundary, where it runs (a loss on the
            outputs), as measured; each graph of the step is planned holding that much less
            there (:attr:`solvers.budget.Budget.boundary`), scaled for steps not measured yet
            as ``outside`` is.
        uncaptured: step signature -> the bytes ops its forward ran outside every captured
            graph saved for the backward (:mod:`checkmate.uncaptured`), where they were a large
            share of its plans': a step measured over the budget says they are held beside them.
        eager_functions: step signature -> the Python ``autograd.Function`` classes its forward
            ran eagerly, outside every captured graph (:mod:`checkmate.uncaptured`): their
            backward runs eagerly too, and a step measured over the budget names them.
        breaks: step signature -> why Dynamo broke its graphs, as :func:`~checkmate.uncaptured.break_reasons`
            gave them when the step was first compiled: what a graph run several times in the
            step is said to come from (:meth:`_repeats`).
        runs_unfit: step signatures with a graph that no plan fits beside its other runs in the
            step (:meth:`_warn_runs`): measured over the budget, they are not planned again with
            room for memory outside the module.
        loss_guess: step signature -> the room its last graph was planned with, before any
            step of the module was measured whole, for a loss computed on its outputs outside
            the module (:func:`_loss_room`), until :meth:`check_step` measures what is held.
        given_back: step signatures planned again with less room than guessed, as measured:
            measured over the budget after, they are planned again once more.
        fitted: step signatures measured whole within the budget since they were compiled:
            measured over it again later (what runs outside the module changed: an auxiliary
            loss switched on after a warm-up), they are planned again with room for the excess.
        compile_ids: Dynamo's ids of the compiles that called this planner's backend
            (``"3/1"``): its guard failures name the compile whose guards failed, and the
            forward's code, shared by every instance of a module class, has others' too.
        backends: the torch.compile backends this planner made (:meth:`backend`).
        regions: the ``isolate_recompiles`` regions of the module's compiles: their cache
            entries with these backends are released with the module (:mod:`checkmate.release`).
        retained: step signature -> how many backwards ran through the graph of one forward
            (``retain_graph=True`` on all but the last) in a step of it measured over the
            budget: planned with what the forward saves held through them
            (:meth:`_solve_retained`).
        input_shapes: the shapes of the floating-point tensors the call being compiled was
            given: an output of one of them is a block's (the next block reads it), no room is
            guessed for a loss on it.
        more_follows: whether more of the step runs after the graph being compiled
            (:func:`ends_at_graph_break`, :func:`called_from_model_code`).
        unsettled: step signature -> the graphs of it planned above an infeasible fraction
            before the graphs after them were seen (see :meth:`partition`): :meth:`settle`
            raises the error of one that no graph at least twice its size followed.
        guessed: step signature -> (profile id, position in the call -> the room a graph
            there was planned with for the graphs after it, guessed: :meth:`_later_room`),
            until :meth:`finish_call` compares it with theirs.
        fallback: under Inductor, a graph no plan's compiled step fits raises
            :class:`NoCompiledFit`, for the backend to run it uncompiled; off, its plan
            measured least runs compiled, with a :class:`BudgetWarning`; and a plan at the least
            simulated peak is checked compiled even where it is costly (:meth:`_at_least_peak`).
        skipped_least: the graph being compiled had its costly plan at the least simulated peak
            replaced by the plan keeping every value (:meth:`_at_least_peak`).
        plan_unread: plan the gradients of outputs a loss returned beside them was computed from
            as not given (:func:`checkmate.tangents.unread_tangents`); off once a backward was
            given one.
        plan_dropped: where a byte budget has no plan otherwise, plan with the outputs beside a
            loss dropped when the backward starts (:meth:`_dropping_outputs`); off once a
            backward found them held.
        dropped_errors: record index -> the error of a graph planned so: raised by
            :meth:`held` when a backward finds the outputs held.
        loop_drops: the loop was seen dropping the outputs beside a loss before its backward
            (:meth:`first_backward`): each graph with such outputs is planned (under Inductor,
            and checked compiled) with them dropped when the backward starts, and its
            backwards watch that they are (:meth:`held`).
        loop_seen: the loop's first backward through a graph planned holding the outputs
            beside its loss was watched for them (:meth:`watch_loop`).
        abandoned: :meth:`held` raised from a backward before it ran: the calls it was the
            backward of are not pending (the caller forgets them at its next call).
        recompile: a backward was given gradients its plan counted as no bytes, or found
            outputs held that its plan dropped, beyond its budget: the caller compiles the step
            again at its next call.
        calls: the most calls of the module seen held at once, each called before the
            backward of the ones before it (two views of a batch, a GAN's discriminator on
            real and fake data, micro-batches whose losses are summed before one backward),
            as the caller found (:meth:`held_at_once`). Under a byte budget each graph is
            planned to fit beside the other calls (:meth:`_solve_beside_calls`).
        grads_seen: under a byte budget, the most bytes of gradients the module's parameters
            held when a training call started (accumulated over micro-batches before one
            optimizer step, or kept by ``zero_grad(set_to_none=False)``), as the caller found.
        held_grads: the bytes of those the plans are made beside, as DDP's buckets are
            (:meth:`_beside`): ``grads_seen``, or 0 where no plan fits beside them
            (:meth:`_without_held_grads`).
        grads_late: the loop frees the gradients only between the forward and the backward
            (``optimizer.zero_grad()`` after the loss, as PyTorch Lightning's loop calls it),
            as the caller found: those held as a call starts are the last step's, held
            through the forward beside what it saves: where the module computes its loss,
            planned beside its forward only (:meth:`_solve`), and named so in the warnings.
        grads_zeroed: the gradients held as a call started were all zeros, as the caller found:
            kept by ``zero_grad(set_to_none=False)``, held through every step, and named so in
            the warnings.
        late_throughout: a plan was made beside those through the whole step (the loss is
            computed outside the module, or no plan found has a forward that fits beside them).
        checkpoint_warning: a :class:`BudgetWarning` for the caller to issue, once: under a
            fraction, the step runs ``torch.utils.checkpoint`` regions, which checkmate does not
            follow (:data:`CHECKPOINTED`).
        checkpointed: ops of ``torch.utils.checkpoint`` regions in the graphs compiled so far
            (captured whole by Dynamo, planned as any other op).
        grads_warning: a :class:`BudgetWarning` for the caller to issue, once: no plan fits
            beside the gradients held (:meth:`_without_held_grads`).
        pending_held: while the call that found more calls held at once compiles, what the
            calls before it hold, simulated: its graphs are planned to fit beside that too.
        calls_warning: a :class:`BudgetWarning` for the caller to issue, once: the step that
            found more calls held at once can exceed the budget (:meth:`_warn_calls`).
        runs_warning: the same, that no plan of a graph fits beside its runs (:meth:`_warn_runs`).
        retained_warning: the same, that no plan of a step whose backward ran again through its
            forward's graph fits holding what the forward saves (:meth:`_warn_retained`).
        overrun_warning: a :class:`BudgetWarning` for the caller to issue, once: a step measured
            whole exceeded the budget, and the module is compiled again with room for what it
            found (:meth:`_overran`); the steps before that one ran over the budget, unwarned.
        profile_id: the cost profile of the graph planned last (what :meth:`ran_more` plans with).
        made_inputs: per input of the graph being compiled, whether autograd made it (an
            earlier graph's output): its gradient is handed to that graph's backward.
        watch: the outputs this call's graphs handed on that their backwards do not read
            (:class:`checkmate.split.OutputWatch`), watched at the later graphs' backwards.
        dropped_seen: (step signature, position of a graph in its call) -> the least bytes of
            those found gone as that graph's backward started (:meth:`observe`).
        unobserved: step signature -> the profile id of a step whose graphs fit together only
            where the loop drops those outputs, until its backward says (:meth:`judge_split`).
    """

    budget: Budget
    strategy: str = "auto"
    profile: str | None = None
    time_limit: float | None = 30.0
    options: dict[str, Any] = field(default_factory=dict)
    plan_path: str | None = None
    compiler: str = "aot"
    records: list[PlanRecord] = field(default_factory=list)
    steps: dict[object, list[int]] = field(default_factory=dict)
    step: object = None
    families: dict[Hashable, list[int]] = field(default_factory=dict, repr=False)
    ahead_ceiling: dict[Hashable, int | None] = field(default_factory=dict, repr=False)
    check_compiled: bool = True
    warned_unchecked: bool = field(default=False, repr=False)
    call: list[int] = field(default_factory=list, repr=False)
    ran: list[int] = field(default_factory=list, repr=False)
    runs: dict[Hashable, int] = field(default_factory=dict, repr=False)
    warned_split: bool = field(default=False, repr=False)
    #: a step found split as it ran, over the budget, was warned of (:meth:`_check_split`)
    warned_found: bool = field(default=False, repr=False)
    warned_costly: bool = field(default=False, repr=False)
    split: dict[object, tuple[tuple[int, int], ...]] = field(default_factory=dict, repr=False)
    replan_pending: bool = field(default=False, repr=False)
    inputs: Sequence[Any] | None = field(default=None, repr=False)
    latest: dict[object, list[int]] = field(default_factory=dict, repr=False)
    outside: dict[object, int] = field(default_factory=dict, repr=False)
    outside_boundary: dict[object, int] = field(default_factory=dict, repr=False)
    loss_guess: dict[object, int] = field(default_factory=dict, repr=False)
    uncaptured: dict[object, int] = field(default_factory=dict, repr=False)
    eager_functions: dict[object, tuple[str, ...]] = field(default_factory=dict, repr=False)
    breaks: dict[object, tuple[str, ...]] = field(default_factory=dict, repr=False)
    runs_unfit: set[object] = field(default_factory=set, repr=False)
    given_back: set[object] = field(default_factory=set, repr=False)
    fitted: set[object] = field(default_factory=set, repr=False)
    retained: dict[object, int] = field(default_factory=dict, repr=False)
    compile_ids: set[str] = field(default_factory=set, repr=False)
    backends: list[Callable[..., Any]] = field(default_factory=list, repr=False)
    regions: list[int] = field(default_factory=list, repr=False)
    input_shapes: frozenset[tuple[int, ...]] = field(default=frozenset(), repr=False)
    more_follows: bool = field(default=False, repr=False)
    unsettled: dict[object, list[_Unsettled]] = field(default_factory=dict, repr=False)
    fallback: bool = field(default=True, repr=False)
    skipped_least: bool = field(default=False, repr=False)
    guessed: dict[object, tuple[str, dict[int, int]]] = field(default_factory=dict, repr=False)
    plan_unread: bool = field(default=True, repr=False)
    plan_dropped: bool = field(default=True, repr=False)
    dropped_errors: dict[int, InfeasibleBudgetError] = field(default_factory=dict, repr=False)
    loop_drops: bool = field(default=False, repr=False)
    loop_seen: bool = field(default=False, repr=False)
    abandoned: bool = field(default=False, repr=False)
    recompile: bool = field(default=False, repr=False)
    warned_given: set[int] = field(default_factory=set, repr=False)
    calls: int = field(default=1, repr=False)
    pending_held: int = field(default=0, repr=False)
    grads_seen: int = field(default=0, repr=False)
    held_grads: int = field(default=0, repr=False)
    grads_late: bool = field(default=False, repr=False)
    grads_zeroed: bool = field(default=False, repr=False)
    late_throughout: bool = field(default=False, repr=False)
    grads_warning: str | None = field(default=None, repr=False)
    checkpoint_warning: str | None = field(default=None, repr=False)
    warned_checkpoint: bool = field(default=False, repr=False)
    checkpointed: int = field(default=0, repr=False)
    warned_grads: bool = field(default=False, repr=False)
    warned_calls: bool = field(default=False, repr=False)
    warned_runs: bool = field(default=False, repr=False)
    calls_warning: str | None = field(default=None, repr=False)
    runs_warning: str | None = field(default=None, repr=False)
    retained_warning: str | None = field(default=None, repr=False)
    warned_retained: set[object] = field(default_factory=set, repr=False)
    overrun_warning: str | None = field(default=None, repr=False)
    warned_overrun: bool = field(default=False, repr=False)
    #: structures of the graphs whose fraction was raised for them (:meth:`_plan`): warned
    #: once each, then logged (a loss graph split off raises it at every new input shape)
    warned_raised: set[tuple[Hashable, ...]] = field(default_factory=set, repr=False)
    profile_id: str | None = field(default=None, repr=False)
    made_inputs: tuple[bool, ...] = field(default=(), repr=False)
    watch: OutputWatch = field(default_factory=OutputWatch, repr=False)
    dropped_seen: dict[tuple[object, int], int] = field(default_factory=dict, repr=False)
    unobserved: dict[object, str] = field(default_factory=dict, repr=False)
    #: record index -> its graph's structure, for :meth:`ran_more` (called after every call
    #: where steps are not measured whole)
    _structures: dict[int, Hashable] = field(default_factory=dict, repr=False)
    #: the last graph's plan was checked, and is to be compiled, without Inductor's buffer reuse
    reuse_refused: bool = field(default=False, repr=False)

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
        self.settle()  # a step whose plan does not meet the fraction asked raises at every call

    def settle(self) -> None:
        """At the end of a call's forward, when every graph of its step is compiled: raise
        the :class:`InfeasibleBudgetError` of a graph planned above the fraction asked while
        the graphs after it were unknown (see :meth:`partition`), when none of them was at
        least twice its size. It is raised at every later call of the step too."""
        pending = self.unsettled.get(self.step)
        if pending:
            raise pending[0].error

    def _keep_every_value(self, indices: Sequence[int]) -> bool:
        """Whether the plans of these records all keep every value (recompute and page
        nothing): more room for them changes none of them."""
        return all(self.records[i].is_eager for i in indices)

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
            index = self.call[k]
            members = self.families.get(structure(self.records[index].joint.graph), [])
            if index in members:
                members.remove(index)
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
        from checkmate.compiled import calibrate

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

        plan, check = calibrate(
            first,
            held,
            simulated=lambda p: int(p[0].peak),
            cost=lambda p: float(p[0].cost or 0.0),
            measure=measure,
            replan=replan,
            ceiling=ref,
            start=start,
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
        # (README, "Compilers": it needs horizontal fusions that break the plan's peak)
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
            family = self.families.get(structure(self.records[i].joint.graph), [])
            if i in family:
                family.remove(i)

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
            got = reuse(graph, ref, self.records, family, nbytes)
            if got is not None and holds(got[0]):
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
        if not res.ok or res.schedule is None:
            # both numbers: the proven bound, and the least peak a schedule found reaches
            raise no_plan_error(graph, res, time_limit=self.time_limit)
        if forward and not holds(res):  # the simulator's check of what the strategy returned
            return None
        return replace(res, info={**res.info, "reference": ref}), asked, None  # a pinned plan may lack it

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
                raise no_plan_error(graph, res, time_limit=self.time_limit)
        except InfeasibleBudgetError as exc:
            if exc.minimum is not None:  # for a later process's retry at it
                remember_least_peak(graph, exc.minimum)
            raise
        return res

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


def _fold_nothing_else(node: fx.Node) -> bool:
    """The ``fuse`` predicate of :func:`checkmate.trace.build_graph` that folds only what
    Inductor is known to move: a matrix product into its addition."""
    return False


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
