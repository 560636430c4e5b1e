"""What a training call did outside its plans, and the warnings that say so: ops Dynamo did not
capture (:mod:`checkmate.uncaptured`), Hugging Face gradient checkpointing, graphs Dynamo skipped,
backward hooks, calls whose backward never came, a module called again before its backward, and
graphs run more often than planned."""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import _get_current_dispatch_mode

from checkmate.compiling import _compile_again, _rearm, _recompile_limit_hit
from checkmate.measuring import _grad_leaves
from checkmate.module_state import CheckmateState, UnplannedWarning, _Pending
from checkmate.planner_common import BudgetWarning
from checkmate.recompiles import (
    caller_level,
)
from checkmate.runtime import log
from checkmate.step_budget import SPLIT_SLACK, repeated
from checkmate.uncaptured import break_reasons, uncaptured
from solvers.budget import format_bytes
from solvers.errors import InfeasibleBudgetError


def _warn_if_checkpointing(module: nn.Module, state: CheckmateState, captured: bool) -> None:
    """A :class:`BudgetWarning`, once, when Hugging Face gradient checkpointing is on in
    ``module`` (its submodules' ``gradient_checkpointing`` flag, which
    ``gradient_checkpointing_enable()`` and the ``Trainer``'s ``gradient_checkpointing=True``
    set) and the graphs just compiled hold none of its ``torch.utils.checkpoint`` regions
    (``captured`` False): Dynamo did not capture the checkpointed layers, so the step is
    planned as the pieces around them, and the layers are recomputed besides what the plan
    recomputes. Captured whole (a GPT-2's, torch 2.13 with transformers 5.25), the regions' ops are
    planned as the step's others, which the budget covers: nothing to say under a byte budget
    (a GPT-2 with it on, at 0.6 of eager's peak: 0.86x the budget), and under a fraction the
    planner's warning (:data:`checkmate.planning.CHECKPOINTED`) says what the fraction is of."""
    on = _hf_checkpointing(module)
    if on is None:
        return
    state.warned_checkpointing = True
    if captured:
        return
    warnings.warn(
        f"{_checkpointing_uncaptured(module, on)}: checkmate plans the pieces of the step around them, the "
        "pieces together may exceed the budget, and every layer is recomputed besides what the plan "
        f"recomputes. {_CHECKPOINTING_OFF}",
        BudgetWarning,
        stacklevel=caller_level(),
    )


def _note_if_checkpointing(
    module: nn.Module, state: CheckmateState, exc: BaseException, captured: bool
) -> None:
    """On an :class:`InfeasibleBudgetError` the step's compile raised: where Hugging Face
    gradient checkpointing is on in ``module`` and the graphs compiled hold none of its regions
    (``captured`` False), a note saying so. The layers ran eagerly, outside the plans, so the
    graph that could not meet the budget is one of the pieces around them (a Llama trained by
    the ``Trainer`` with ``gradient_checkpointing=True``, at a fraction of 0.5: its loss
    graph), and the fix is turning the checkpointing off, not raising the budget."""
    on = _hf_checkpointing(module)
    if captured or on is None or not isinstance(exc, InfeasibleBudgetError):
        return
    state.warned_checkpointing = True
    note = (
        f"{_checkpointing_uncaptured(module, on)}: they ran eagerly, outside every plan, and the graph that "
        f"cannot meet the budget is one of the pieces of the step around them. {_CHECKPOINTING_OFF}"
    )
    exc.add_note(note)


def _checkpointing_uncaptured(module: nn.Module, on: nn.Module) -> str:
    return (
        f"{type(module).__name__} has Hugging Face gradient checkpointing on (in {type(on).__name__}), "
        "and torch.compile captured none of its checkpointed layers in the step's graphs"
    )


#: what to do with Hugging Face gradient checkpointing, in words (the warnings that find it on)
_CHECKPOINTING_OFF = (
    "checkmate chooses what to recompute itself: call model.gradient_checkpointing_disable() (with the Trainer, "
    "leave gradient_checkpointing off)"
)


def _hf_checkpointing(module: nn.Module) -> nn.Module | None:
    """The submodule of ``module`` with Hugging Face gradient checkpointing on (its
    ``gradient_checkpointing`` flag), or None."""
    return next((m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is True), None)


@torch._dynamo.disable  # bookkeeping: run as written under an outer torch.compile
def _warn_if_backpropagated(module: nn.Module, state: CheckmateState, out: Any) -> None:
    """An :class:`UnplannedWarning`, once, when a backward runs through ``out``, the output of
    a step run in ``eval()`` mode with gradients enabled: only training-mode steps are planned,
    so that step had no memory bound (a validation pass that forgot ``torch.no_grad()`` is
    never backpropagated, and says nothing)."""
    first = next(_grad_leaves(out), None)
    if first is None:
        return
    name = type(module).__name__

    def hook(grad: torch.Tensor) -> None:
        if not state.warned_eval:
            state.warned_eval = True
            warnings.warn(
                f"{name} ran in eval() mode with gradients enabled and a backward went through it: "
                "checkmate plans training-mode steps only, so this one ran eagerly with no memory "
                "bound. To train with dropout off or BatchNorm statistics frozen, call eval() on "
                "those submodules and keep the model in train(); to evaluate, use torch.no_grad()",
                UnplannedWarning,
                stacklevel=caller_level(),
            )

    first.register_hook(hook)


def _skipped(self: nn.Module, state: CheckmateState, key: tuple[Any, ...], out: Any) -> None:
    """A training call of a module with plans ran no compiled graph and compiled none: Dynamo
    ran its forward eagerly, unplanned (its code marked skipped after a failed compile, a
    ``torch.compiler.set_stance("force_eager")``, a new input signature it captured nothing
    of). The step is compiled again at the next call (:func:`_rearm`), so that the
    signatures planned run their plans. Warned once (:class:`UnplannedWarning`)."""
    if not _needs_grad(out) or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
        return  # under a fake mode the graphs run uncounted (Planner.backend)
    planned = bool(state.planner.latest.get(key))
    mode = _get_current_dispatch_mode()
    if mode is None:  # under a dispatch mode Dynamo runs frames as written, marking nothing skipped:
        _rearm(state)  # compiled again after a FlopCounterMode's step, each plain step after one took 0.5 s
    if state.warned_skipped:
        return
    state.warned_skipped = True
    what = (
        "Dynamo skipped its compiled step (a compile of the forward that failed, at other inputs or "
        "after an exception raised inside it, marks the forward's code skipped for every later call)"
        if planned
        else "torch.compile captured no graph with a backward at these input shapes (Dynamo ran the forward "
        "eagerly)"
    )
    if hooked := _backward_hooked(self):  # registered after the step was planned
        what = _backward_hook_why(hooked)
    elif mode is not None:
        what = (
            f"a dispatch mode is active ({type(mode).__name__}: a FLOP counter, a debug mode), under which "
            "Dynamo runs the step as written"
        )
    then = (
        "The calls outside it run their plans"
        if mode is not None
        else "The step is compiled again at the next call, and the shapes planned before run their plans. Look "
        "for what makes Dynamo fall back (TORCH_LOGS=graph_breaks,recompiles)"
    )
    warnings.warn(
        f"a training step of {type(self).__name__} ran unplanned, with no memory bound: {what}. {then}",
        UnplannedWarning,
        stacklevel=caller_level(),
    )


#: ops run outside every captured graph that saved more than this share of the keep-all
#: peaks of the graphs compiled with them are warned of (:func:`_check_uncaptured`)
UNCAPTURED_SHARE = 0.1


def _plan_for_runs(state: CheckmateState, key: tuple[Any, ...], ran: Counter[int], why: str) -> None:
    """Where graphs of the step of signature ``key`` ran more times in a call (``ran``) than
    they were planned for (:meth:`~checkmate.runtime.Planner.ran_more` records the runs), the
    step is compiled again at the next call, each run planned beside the others; ``why``: what
    makes that the time to (the logger says it)."""
    if state.planner.ran_more(key, ran):
        log.info(
            "the training step ran graphs more times than they were planned for (%s), %s: compiling it again "
            "at the next call, each run planned beside the others",
            repeated(ran),
            why,
        )
        state.recompile = True


def _warn_runs_found(state: CheckmateState, ran: Counter[int]) -> None:
    """Once per planner, a :class:`BudgetWarning` where the graphs of the call that compiled
    them ran more times than they were planned for (``ran``) and, so planned, can together
    exceed the budget left to the graphs by more than :data:`~checkmate.step_budget.SPLIT_SLACK`:
    said as the forward returns, before the backward runs over (on a GPU, before an
    out-of-memory error). Unwarned, a Hugging Face Wav2Vec2 whose two encoder layers run one
    graph stepped its first call at 1.03x a budget of 0.5 of eager's peak, and blocks broken by a
    print at 0.6 of eager's peak at 1.21x (the warning's estimate: 1.23x)."""
    planner = state.planner
    if planner.warned_found:
        return
    reach, room = planner.runs_reach(ran)
    if reach <= SPLIT_SLACK * room:
        return
    planner.warned_found = True
    warnings.warn(
        f"graphs of this step ran more times in it than they were planned for ({repeated(ran)}), each run "
        f"planned as if alone: its backward can reach about {format_bytes(reach)} ({reach / room:.2f}x the "
        f"{format_bytes(room)} of the budget left to the graphs). The next call compiles the step again, each "
        "run planned beside the others",
        BudgetWarning,
        stacklevel=caller_level(),
    )


def _check_uncaptured(
    module: nn.Module,
    state: CheckmateState,
    key: tuple[Any, ...],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    out: Any,
    reasons: Sequence[str],
    before: int,
) -> None:
    """At a call that compiled the step of signature ``key`` (graphs ``before`` on): where the
    ops its forward ran outside every captured graph saved more than :data:`UNCAPTURED_SHARE`
    of what the graphs hold keeping every value (:mod:`checkmate.uncaptured`), an
    :class:`UnplannedWarning` naming what Dynamo could not trace (``reasons``: its graph
    breaks in the call, :func:`~checkmate.uncaptured.break_reasons`), or, where the step's
    plan raises at :meth:`~checkmate.runtime.Planner.settle`, a note on that error; the planner keeps the bytes for a step measured over its budget to say.
    Measured on an LSTM tagger, whose embedding and first layers were captured as one graph
    (11 MiB keeping every value) and whose LSTM and head ran eagerly: 27.6 MiB found, in 20 ms."""
    planned = sum(r.reference_peak for r in state.planner.records[before:])
    held = itertools.chain(
        (t for t in torch.utils._pytree.tree_leaves(call) if isinstance(t, torch.Tensor)),
        module.parameters(),
        module.buffers(),
    )
    try:
        found = uncaptured(_grad_leaves(out), held)
    except Exception as exc:  # a diagnosis: an autograd node it cannot read must not fail the step
        log.info("the ops run outside the captured graphs were not counted: %s: %s", type(exc).__name__, exc)
        return
    if found.functions:  # their backward runs eagerly: named if the step is measured over
        state.planner.eager_functions[key] = found.functions
    if found.saved <= UNCAPTURED_SHARE * planned:
        return
    state.planner.uncaptured[key] = found.saved
    cause = (
        f"Dynamo could not trace: {'; '.join(reasons)}"
        if reasons
        else "Look for why with TORCH_LOGS=graph_breaks"
    )
    if rnn := _rnn_skipped(module):
        cause += f". {rnn}, which Dynamo runs eagerly unless torch._dynamo.config.allow_rnn = True"
    what = (
        f"{type(module).__name__}'s forward ran {found.nodes} autograd ops outside every graph torch.compile "
        f"captured (mostly {', '.join(found.kinds[:3])}), and they saved {format_bytes(found.saved)} for "
        f"the backward, beside its plans (whose graphs hold {format_bytes(planned)} keeping every value) and "
        f"bounded by none of them"
    )
    pending = state.planner.unsettled_error()
    if pending is not None:  # the step raises (a graph that cannot meet the fraction): say what else it holds
        pending.add_note(f"{what}. {cause}")
        return
    if state.warned_uncaptured:
        return
    state.warned_uncaptured = True
    warnings.warn(
        f"{what}: the budget holds for the captured graphs only. {cause}. Make that code traceable "
        "(TORCH_LOGS=graph_breaks lists what Dynamo could not trace), or leave that much memory spare "
        "beside the budget",
        UnplannedWarning,
        stacklevel=caller_level(),
    )


def _submodule_name(module: nn.Module, name: str) -> str:
    """``"<Model>.<name>"`` for the submodule ``name`` of ``module`` (``"<Model>"`` for itself)."""
    return f"{type(module).__name__}.{name}" if name else type(module).__name__


def _rnn_skipped(module: nn.Module) -> str | None:
    """``"<Model>.<name> is an nn.<LSTM>"`` for the first RNN submodule of ``module`` (Dynamo
    runs them eagerly while ``torch._dynamo.config.allow_rnn`` is False), or None."""
    if torch._dynamo.config.allow_rnn:
        return None
    for name, sub in module.named_modules():
        if isinstance(sub, nn.RNNBase):
            return f"{_submodule_name(module, name)} is an nn.{type(sub).__name__}"
    return None


def _global_forward_hooks() -> tuple[tuple[Any, ...], ...]:
    """The global module forward hooks and pre-hooks (``torch.nn.modules.module.
    register_module_forward_hook``; a module tracker's), each by what its trace inlines
    (:func:`_hook_key`).

    Dynamo guards on none of them, even with its module hook guards on (:data:`~checkmate.compiling._STEP_CONFIG`):
    one registered after the step was compiled never ran (a hook halving every Tanh's output:
    the step's output and gradients were those without it), and one removed would run on. Where
    they changed since the last training call the step is compiled again."""
    return (
        tuple(map(_hook_key, nn_module._global_forward_pre_hooks.values())),
        tuple(map(_hook_key, nn_module._global_forward_hooks.values())),
    )


def _hook_key(hook: Any) -> tuple[Any, ...]:
    """A hook by its code, the object it is bound to and the objects its closure holds: the
    same hook registered anew at every step (a new lambda, a new handle) keeps its key, so the
    step is not compiled again for it."""
    func = getattr(hook, "__func__", hook)
    code = getattr(func, "__code__", None)
    if code is None:  # a callable object, a builtin
        return (id(hook),)
    cells = tuple(id(c.cell_contents) for c in getattr(func, "__closure__", None) or () if _filled(c))
    return (code, id(getattr(hook, "__self__", None)), cells)


def _filled(cell: Any) -> bool:
    """Whether a closure cell holds a value (one not yet assigned raises on reading)."""
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def _backward_hook_why(hooked: str) -> str:
    """Why a step ran unplanned where ``hooked`` (:func:`_backward_hooked`) has a module
    backward hook, in words."""
    return (
        f"Dynamo does not trace a module's backward hooks without compiled autograd, and {hooked} "
        "has one (register_full_backward_hook, register_full_backward_pre_hook or register_backward_hook). "
        "A hook on a tensor (`out.register_hook(fn)` in the forward) or on a parameter "
        "(`param.register_hook(fn)`, `register_post_accumulate_grad_hook`) is planned with the step"
    )


def _backward_hooked(module: nn.Module) -> str | None:
    """The name of a submodule of ``module`` (or ``"every module"``, for a global hook) with a
    module backward hook, which Dynamo does not trace, or None."""
    if nn_module._global_backward_hooks or nn_module._global_backward_pre_hooks:
        return "every module (a global backward hook)"
    for name, sub in module.named_modules():
        if sub._backward_hooks or sub._backward_pre_hooks:
            return _submodule_name(module, name)
    return None


def _track_pending(state: CheckmateState, out: Any, key: tuple[Any, ...], *, planned: bool = False) -> None:
    """Record a planned call as pending until a backward reaches one of its outputs' nodes.

    The marker lives in those nodes' ``metadata``, so it dies with the call's autograd graph:
    a call whose outputs are dropped unbackpropagated holds no activations, and is not pending.
    ``planned``: a planned graph ran in the call, whose backward cannot be differentiated again
    (warned of where it is). A call run eagerly can: ``torch.func.grad`` over an optimized
    module, which Dynamo runs eagerly, was warned of a double backward that never failed."""
    nodes = {id(n): n for t in _grad_leaves(out) if (n := t.grad_fn) is not None}
    if not nodes:
        return
    token = _Pending(key)
    ref = weakref.ref(token)
    for node in nodes.values():
        meta: dict[str, Any] = node.metadata  # type: ignore[assignment]  # a property; typed as a method
        meta["checkmate_pending"] = token
        node.register_prehook(functools.partial(_backward_reached, ref, weakref.ref(state), planned))
    state.pending.append(ref)


def _backward_reached(
    ref: weakref.ref[_Pending], state_ref: weakref.ref[CheckmateState], planned: bool, grad_outputs: Any
) -> None:
    token = ref()
    if token is not None:
        token.done = True
    # a backward with create_graph=True (the engine runs it in grad mode) through a planned graph
    if planned and torch.is_grad_enabled():
        state = state_ref()
        if state is not None and not state.warned_double:
            state.warned_double = True
            warnings.warn(
                "an optimized module's planned step is differentiated with create_graph=True (a gradient "
                "penalty, an R1 term, a Hessian-vector product): torch.compile's compiled step cannot be "
                'differentiated again, and a backward through this gradient raises "torch.compile with '
                'aot_autograd does not currently support double backward". Run the calls whose gradient is '
                "differentiated again under `with checkmate.disabled(model):` (the original forward, with "
                "no memory bound)",
                UnplannedWarning,
                stacklevel=caller_level(),
            )


def _check_reentry(module: nn.Module, state: CheckmateState) -> None:
    """``module`` is called for training while earlier calls' backward has not run (two views
    of a batch, a GAN's discriminator on real and fake data, losses summed over micro-batches
    before one backward): what those calls keep for their backward is held beside this one.

    Under a byte budget, when that is more calls than the module was planned for, it is
    compiled again, each call planned to fit beside the others, and this one also beside
    what the earlier calls hold (:meth:`Planner.held_at_once`). Under a fraction, each call
    is planned at the fraction of its own graph's peak: a :class:`BudgetWarning`, once."""
    live = [r for r in state.pending if (t := r()) is not None and not t.done]
    state.pending = live
    if not live:
        return
    if state.planner.budget.nbytes is not None:
        keys = [t.key for r in live if (t := r()) is not None]
        if state.planner.held_at_once(len(live) + 1, keys):
            _compile_again(state)
            _warn_calls(state)
        return
    if not state.warned_reentry:
        state.warned_reentry = True
        warnings.warn(
            f"{type(module).__name__} was called again before the backward of {len(live)} earlier "
            "call(s): each call is planned at the budget's fraction of its own graph's peak, and the "
            "activations an earlier call keeps for its backward stay allocated beside the next call's, "
            f"so this step can hold up to {len(live) + 1} times one call's budget. Pass the budget in bytes "
            "(each call is then planned to fit beside the others in it), optimize one module whose forward makes "
            "all the calls and computes the loss (its graph is then planned as one step), call the "
            "model once on the inputs concatenated, or, for micro-batches, run each one's backward "
            "before the next call (gradients accumulate)",
            BudgetWarning,
            stacklevel=caller_level(),
        )


def _warn_calls(state: CheckmateState) -> None:
    """The planner's :class:`BudgetWarning` messages that this step can exceed the budget (it found
    the module called again before earlier calls' backward; no plan of a graph fits beside its
    runs); at the line that called it."""
    for message in state.planner.take_warnings():
        warnings.warn(message, BudgetWarning, stacklevel=caller_level())


def _needs_grad(out: object) -> bool:
    """True when some tensor in ``out`` has a backward to run."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


def _warn_unplanned(
    module: nn.Module, state: CheckmateState, out: Any, failures: Mapping[str, int] | None = None
) -> None:
    """Once per module: an :class:`UnplannedWarning` where a training call planned nothing
    (Dynamo ran its forward eagerly) and its outputs need gradients, with the likeliest cause:
    Dynamo's recompile limit, a module backward hook, Hugging Face gradient checkpointing
    around a graph break, an RNN Dynamo does not capture, or else the reasons Dynamo gave in
    the call, counted since ``failures`` (:func:`~checkmate.uncaptured.break_reasons`; a graph
    break in a loop runs the whole frame eagerly)."""
    if not state.planner.records and not state.warned_unplanned and _needs_grad(out):
        state.warned_unplanned = True
        if _recompile_limit_hit():
            why = (
                "Dynamo hit its recompile limit in this process (torch._dynamo.config.recompile_limit = "
                f"{torch._dynamo.config.recompile_limit}), and other torch.compile'd code can use it up "
                "for this step too (about that many compiled modules, each with its own backend, are "
                "enough). Raise torch._dynamo.config.recompile_limit before compiling them, or call "
                "torch._dynamo.reset() before checkmate.optimize"
            )
        elif hooked := _backward_hooked(module):
            why = _backward_hook_why(hooked)
        elif checkpointing := _hf_checkpointing(module):
            why = (
                f"Hugging Face gradient checkpointing is on (in {type(checkpointing).__name__}), and Dynamo runs the "
                f"whole forward eagerly when it cannot capture a checkpointed layer (a graph break inside one). "
                f"{_CHECKPOINTING_OFF}"
            )
        elif rnn := _rnn_skipped(module):
            why = (
                f"{rnn}, which Dynamo runs eagerly unless torch._dynamo.config.allow_rnn = True. Set it "
                "before the first step: Dynamo then unrolls the RNN over its time steps (a graph that grows "
                "with the sequence length), and checkmate plans that step"
            )
        elif failures is not None and (reasons := break_reasons(failures)):
            why = (
                f"Dynamo gave up on it: {'; '.join(reasons)}. Rewrite what it names (TORCH_LOGS=graph_breaks "
                "shows where): a graph break inside a loop makes Dynamo run the whole function eagerly, where "
                "one outside a loop splits the step into graphs that are each planned"
            )
        else:
            why = "Look for what makes Dynamo fall back (TORCH_LOGS=graph_breaks)"
        warnings.warn(
            f"checkmate planned nothing for {type(module).__name__}: torch.compile captured no graph "
            "with a backward (Dynamo ran the forward eagerly), so training steps run eagerly with no "
            f"memory bound. {why}",
            UnplannedWarning,
            stacklevel=caller_level(),
        )


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (``torch.autograd.graph.saved_tensors_hooks``,
    ``save_on_cpu``): what their pack function returns for each value the backward reads is
    held in its place, outside every plan (a hook cloning on pack stepped at 1.80x a budget
    of 0.6 of eager's peak, warned of as "a loss computed on its outputs")."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    try:
        return top(False) is not None
    except Exception:  # a private hook registry that moved: nothing to name
        return False
