"""The state of :class:`checkmate.runtime.Planner`: its settings, the records of the graphs it
planned, and what it found the module's training steps to hold, shared by its layers
(:class:`~checkmate.planning.GraphPlanning`, :class:`~checkmate.step_budget.StepBudget`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from checkmate.planner_common import _Unsettled
from checkmate.records import PlanRecord
from checkmate.split import OutputWatch
from solvers.budget import Budget
from solvers.errors import InfeasibleBudgetError


@dataclass
class PlannerState:
    """What the planner has planned, measured and warned of: its settings, a record of every graph
    torch.compile gave it, and what the module's steps were found to hold.

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
        superseded: a structure -> indices of plans taken out of their family because the
            step is compiled again with other room beside its graphs (:meth:`_supersede`):
            not reused as they are, but kept where the new solve costs more, or finds none.
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
        saved_hooks: step signatures called under saved-tensor hooks
            (``torch.autograd.graph.saved_tensors_hooks``): what they pack for the backward is
            held in place of the values the plan counts, and a step measured over the budget
            names them.
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
    superseded: dict[Hashable, list[int]] = field(default_factory=dict, repr=False)
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
    saved_hooks: set[object] = field(default_factory=set, repr=False)
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
