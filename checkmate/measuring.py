"""Measuring an optimized module's training steps whole (:mod:`checkmate.stepcheck`'s windows):
which calls are measured, when a window closes (the next optimizer step, the next call, the
process's exit), how what it measured is judged against the budget
(:meth:`~checkmate.step_budget.StepBudget.check_step`), and when a step is measured again; the
gradients a step starts with, which the budget covers."""

from __future__ import annotations

import atexit
import itertools
import warnings
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from checkmate.compiling import _device_of
from checkmate.distributed import (
    active_ddp_module,
    fsdp_gradients,
    fsdp_params_of,
    in_process_group,
)
from checkmate.module_state import CheckmateState
from checkmate.planner_common import LATER_ROOM, BudgetWarning, OverheadWarning
from checkmate.recompiles import (
    caller_level,
)
from checkmate.runtime import log
from checkmate.step_budget import LATE_ZERO, LATE_ZERO_ADVICE
from checkmate.stepcheck import STEP_SLACK, StepWindow, abort_windows, open_window, users_profiler
from solvers.budget import format_bytes


def _gradients_held(grads: Iterable[torch.Tensor | None]) -> int:
    """The bytes of ``grads`` (the parameters' ``.grad``, and those FSDP2 keeps apart,
    :func:`~checkmate.distributed.fsdp_gradients`): accumulated over earlier micro-batches before
    one optimizer step, or kept as zeros by ``zero_grad(set_to_none=False)``. None under DDP with
    ``gradient_as_bucket_view=True``: they are its buckets, reserved already
    (:func:`~checkmate.distributed.ddp_reserve`). Every training call under a byte budget
    reads it: 30-40 us for 300 parameters without gradients (measured on a 2-core CPU)."""
    ddp = active_ddp_module()
    if ddp is not None and getattr(ddp, "gradient_as_bucket_view", False):
        return 0
    total = 0
    for grad in _local(grads):
        if grad.layout is torch.strided:
            total += grad.nbytes
        else:  # nn.Embedding(sparse=True)
            total += grad._values().nbytes + grad._indices().nbytes
    return total


def _local(grads: Iterable[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    """The gradients of ``grads`` held, FSDP2's DTensors as this rank's shards."""
    for grad in grads:
        if grad is not None:
            yield getattr(grad, "_local_tensor", grad)


def _all_zeros(grads: Iterable[torch.Tensor | None]) -> bool:
    """Whether every gradient of ``grads`` held is zeros, and some is: kept by
    ``zero_grad(set_to_none=False)``, which the step adds to in place. The last step's
    gradients (a loop that zeroes them between the forward and the backward, or one calling
    backward again) are not, and the first of them read says so: one reduction and one sync
    on a GPU. A sparse gradient (``nn.Embedding(sparse=True)``) counts as not zeros."""
    held = False
    for grad in _local(grads):
        if grad.layout is not torch.strided or bool(grad.any()):
            return False
        held = True
    return held


def _held_at_call(module: nn.Module, state: CheckmateState, steps_before: int) -> int:
    """Under a byte budget, the bytes of gradients the module's parameters hold as a training
    call starts (:func:`_gradients_held`), and what they say of the loop: a second micro-batch
    (accumulating: the step is compiled again, each graph planned beside them), zeros kept by
    ``zero_grad(set_to_none=False)``, or gradients found after an optimizer step, judged at the
    next one (``_HOLDING``). ``steps_before``: the optimizer steps counted at the module's
    previous call."""
    # gradients accumulated over earlier micro-batches stay through this step, and the budget
    # covers gradients: a Llama (3 layers) accumulating 4 micro-batches at 0.5 of eager's
    # peak over them stepped at 1.02x the budget, unwarned, its plans made beside none.
    # Counted from the first call that finds them where no optimizer step came since the
    # module's last call (that call's backward made them: the loop accumulates); found after
    # an optimizer step, they are counted once the next optimizer step shows the loop adding
    # to them, not freeing them before its backward (Lightning's order: grads_late)
    if state.params is None:
        state.params = tuple(module.parameters())
        state.fsdp_params = fsdp_params_of(module)
    grads = [*(p.grad for p in state.params), *fsdp_gradients(state.fsdp_params)]
    grads_held = _gradients_held(grads)
    if grads_held > state.planner.grads_seen and not state.accumulates:
        if _all_zeros(grads):
            # zeros kept by zero_grad(set_to_none=False): held through this step and every one
            # after, added to in place (an MLP's step after the first optimizer step ran 1.12x
            # its budget at 0.6 of eager's peak, unwarned, counted from the next step only)
            state.accumulates = state.planner.grads_zeroed = True
        elif steps_before == _OPT_STEPS[0]:
            # a second micro-batch: its predecessor's gradients held through it (a Hugging Face
            # GPT-2 accumulating two micro-batches at 0.6 of eager's peak ran its first window
            # at 1.11x the budget, unwarned, counted from the first optimizer step on)
            state.accumulates = True
    if grads_held > state.planner.grads_seen and not state.accumulates:
        _HOLDING.add(state)  # accumulating, if an optimizer step comes next
        state.grad_probe = next(
            ((i, weakref.ref(p.grad)) for i, p in enumerate(state.params) if p.grad is not None), None
        )
    elif grads_held > state.planner.grads_seen:
        state.planner.grads_seen = state.planner.held_grads = grads_held
        if state.planner.records:
            log.info(
                "the module's parameters hold %s of %s as this step starts: compiling it again, each "
                "graph planned beside them",
                format_bytes(grads_held),
                "zero gradients" if state.planner.grads_zeroed else "gradients from earlier micro-batches",
            )
            state.recompile = True
    return grads_held


def _grad_leaves(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``out`` a backward can run through."""
    if type(out) is torch.Tensor:  # the common output: no pytree walk (every step passes here)
        leaves: list[Any] = [out]
    else:
        leaves = torch.utils._pytree.tree_leaves(out)
    return (t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)


def _warn_unmeasured(module: nn.Module, state: CheckmateState, out: Any) -> None:
    """A :class:`BudgetWarning`, once, where a step cannot be measured whole (the CPU under
    torch.distributed) and a loss computed on the module's outputs outside it could take a
    large share of the byte budget (:data:`~checkmate.planner_common.LATER_ROOM` times their bytes,
    the planner's guess at what a loss on outputs holds: an HF GPT-2's cross-entropy with
    label smoothing held 2.86 times its logits); not where the module returns a scalar
    beside them (its own loss)."""
    nbytes = state.planner.budget.nbytes
    leaves = list(_grad_leaves(out))
    if nbytes is None or any(t.numel() == 1 for t in leaves):
        return  # the module computes its loss (a Hugging Face model given labels=)
    outputs = sum(t.numel() * t.element_size() for t in leaves)
    if LATER_ROOM * outputs <= UNMEASURED_SHARE * nbytes:
        return
    state.warned_unmeasured = True
    warnings.warn(
        f"{type(module).__name__}'s training step is not measured whole on the CPU under torch.distributed "
        f"(its measurement, a profiler, is unsafe beside gloo's threads), so memory held outside the module "
        f"between its forward and backward is only guessed at: a loss computed on its "
        f"{format_bytes(outputs)} of outputs can hold about {LATER_ROOM} times that beside the plan (room the "
        "plan leaves where it can, and a loss may hold more). Compute the loss inside the optimized module's "
        "forward (it is then planned with the step), or leave that much of the budget free",
        BudgetWarning,
        stacklevel=caller_level(),
    )


#: a share of the byte budget above which a loss outside an unmeasured step is warned of
UNMEASURED_SHARE = 0.2


def _measure_until_backward(module: nn.Module, state: CheckmateState, key: tuple[Any, ...], out: Any) -> None:
    """Mark in ``state.window`` the end of this call's backward: when the gradient of the
    module's last trainable parameter is accumulated (a backward through modules before it,
    optimized apart, is theirs), else at the end of the backward that reached its outputs.
    The window is closed, and the planner's verdict taken, at the next optimizer step or
    call of the module (:func:`_close_window`). A later call of the same step (called before
    the earlier calls' backward: :func:`_called_again_inside`) keeps the first call's key and
    hooks, which mark the end of their one backward."""
    window = state.window
    nodes = {id(n): n for t in _grad_leaves(out) if (n := t.grad_fn) is not None}
    if window is None or not window.handles:  # else a later call of the step: it keeps the first's key
        state.window_key = key
    if window is None or not nodes:
        _close_window(state)
        return
    window.mark_forward_end()  # from here to the backward's start, code outside the module runs
    params = [p for p in module.parameters() if p.requires_grad] if not window.handles else []
    handles: list[Any] = []  # a later call of the step (calls held at once): the first's hooks end it
    left = [len(params)]

    def accumulated(param: Any) -> None:
        left[0] -= 1
        if left[0] == 0:
            window.mark_end()
            for h in handles:
                h.remove()

    handles.extend(p.register_post_accumulate_grad_hook(accumulated) for p in params)
    window.handles = window.handles or handles

    seen: Counter[int] = Counter()  # how many backwards reached each output node

    def reached(node: int) -> None:  # a parameter without a gradient: the backward's end
        seen[node] += 1
        if seen[node] > 1:  # another backward through the same forward's graph: measured to its end
            window.run_again(seen[node])
        if not window.started_backward and window.grads_held and state.planner.grads_late:
            # the loop freed the last step's gradients after the forward (zero_grad): not held here
            now = _gradients_held(
                itertools.chain((p.grad for p in state.params or ()), fsdp_gradients(state.fsdp_params))
            )
            window.released = max(window.grads_held - now, 0)
        window.mark_backward_start()
        if not window.ended and not window.queued:
            window.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(window.mark_end)

    for key_, node in nodes.items():
        node.register_prehook(lambda grad_outputs, key_=key_: reached(key_))


#: the states whose window is open: closed at the next optimizer step
_OPEN: weakref.WeakSet[CheckmateState] = weakref.WeakSet()


#: training calls of optimized modules in this process (one counter, in a list)
_CALLS = [0]


#: a training call of an optimized module raised (:func:`_training_call`): the frames it left
#: in reference cycles may hold outputs an earlier call handed on, whose backward never runs
_RAISED = [False]


#: calls in a row of an input signature, each inside a profiler of the user's, after which a
#: warning says that its steps are not measured whole
_PROFILED_CALLS = 16


def _profiled(state: CheckmateState, key: tuple[Any, ...]) -> None:
    """A step of ``key`` due to be measured whole ran inside a profiler of the user's (whose
    events only its owner reads; on CUDA, one measuring with the peak statistics the
    measurement resets): measured at a later call. Said at the first such call; after
    :data:`_PROFILED_CALLS` of them in a row (a profiler around the whole loop), a
    :class:`BudgetWarning` says that memory held outside the module goes unchecked."""
    state.profiled[key] += 1
    if sum(state.profiled.values()) == 1:
        log.info(
            "the training step ran inside a profiler (torch.profiler), beside which it cannot be measured "
            "whole: it is measured at a later call outside one"
        )
    if state.profiled[key] < _PROFILED_CALLS or state.warned_profiled:
        return
    state.warned_profiled = True
    warnings.warn(
        f"the module's last {_PROFILED_CALLS} training steps of these input sizes all ran inside a profiler "
        "(torch.profiler), beside which checkmate cannot measure a step whole: what your code holds outside the "
        "module between its forward and backward (a loss on its outputs) is not checked against the byte budget. "
        "Run some steps outside the profiler, or profile with a schedule "
        "(torch.profiler.schedule): steps outside its warmup and active steps are measured",
        BudgetWarning,
        stacklevel=caller_level(),
    )


def _open_measurement(
    module: nn.Module,
    state: CheckmateState,
    key: tuple[Any, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    grads_held: int,
) -> bool:
    """Open the window that measures the call of signature ``key`` whole, to the end of its
    backward (:func:`~checkmate.stepcheck.open_window`), where it can be: not on the CPU
    under ``torch.distributed`` (then True: the step goes unmeasured, and the caller warns
    where its outputs are large), and not inside a profiler of the user's (measured at a
    later call). ``grads_held``: the gradients held as it starts, beside its plans."""
    unmeasured = False
    # the step measured whole (checkmate.stepcheck); inside measure_peak, from its events; under
    # a profiler of the user's, at a later call. Each
    # rank of a distributed job measures and plans again on its own: no rank waits for another
    device = _device_of(module, args, kwargs)
    if device.type == "cpu" and in_process_group():
        # the CPU's measurement is a profiler, and the collectives a backward launches carry its
        # thread-local state to gloo's threads, which report to it after it stopped: a DDP loop
        # on one rank died of heap corruption ("free(): invalid next size") in 2 runs of 6
        state.stepped.add(key)
        state.unmeasurable.add(key)
        unmeasured = not state.warned_unmeasured
    else:
        state.window = open_window(device)
        state.window_calls = _CALLS[0]
        if state.window is None and key in state.again:
            state.stepped.add(key)  # measured again at its next count, not under a profiler of the user's
        elif state.window is None and users_profiler():
            _profiled(state, key)
        state.again.discard(key)
        if state.window is not None:
            state.profiled.pop(key, None)
            state.window.grads_held = grads_held
            _OPEN.add(state)
            weakref.finalize(state, state.window.abort)  # a module dropped mid-measurement
    return unmeasured


def _close_window(state: CheckmateState, *, called: bool = False) -> None:
    """Close ``state.window``; a step measured over the byte budget has the module compiled
    again at its next call with room for what was held outside it (warned of once: the steps
    before it ran over too), once, and warns after where that room does not fit. ``called``:
    closed by a training call of an optimized module, inside the step where its backward has
    not ended (blocks optimized apart: an encoder's step holds its head's)."""
    window, key = state.window, state.window_key
    if window is not None and not window.closable():  # its profiler's thread closes it
        return
    state.window = None
    _OPEN.discard(state)
    if window is None:
        return
    # an encoder measured inside a loop's measure_peak took its head's step, run inside its own,
    # for memory held outside it: warned at 1.08x its budget, and compiled again at +16.9%
    whole = _CALLS[0] == state.window_calls and not (called and not window.ended)
    path = state.window_path
    if window.waiting() and key is not None:
        # measured in the caller's measure_peak, whose profiler's events come when it ends: the
        # verdict is taken then (a step of the same inputs is not measured meanwhile). A loop
        # measuring every step so ran a language model whose loss holds 26 MiB outside it at
        # 1.06x its budget, unwarned, at every step: only the steps outside were measured
        window.detach()
        state.stepped.add(key)
        window.then = lambda w: _judge_window(state, w, key, w.hosted_peak, whole, path)
        return
    _judge_window(state, window, key, window.close(), whole, path)


def _judge_window(
    state: CheckmateState,
    window: StepWindow,
    key: tuple[Any, ...] | None,
    peak: int | None,
    whole: bool,
    path: Counter[int],
) -> None:
    """The verdict on a step of ``key`` measured whole at ``peak`` (None where its backward
    did not come): ``whole`` where no other optimized module was called inside it, ``path``
    how often its graphs ran (``state.window_path`` then)."""
    if key is None or window.aborted:  # planning or a measurement of the caller's came first
        if key is not None:
            state.stepped.discard(key)  # measured at a later call
        return
    state.stepped.add(key)  # measured once (not again where the backward never came)
    if peak is None:  # the backward never came
        return
    if not whole:  # another optimized module ran inside: its memory is not outside
        log.info("the training step was not measured whole: other optimized modules run inside it")
        state.unmeasurable.add(key)
        if state.planner.unmeasured(key):  # no loss is computed on its outputs: the next module is
            state.stepped.discard(key)
            state.recompile = True
        return
    state.measured_paths.setdefault(key, []).append(path)
    unplanned = window.grads_held - min(window.grads_held, state.planner.held_grads)
    budget = state.planner.budget.nbytes
    if (
        unplanned
        and budget is not None
        and not state.accumulates  # after it, gradients no plan fits beside were warned of
        and not state.warned_first
        and peak <= STEP_SLACK * budget < peak + unplanned
    ):
        # over the budget only with the gradients held beside it, which its plans were not made beside
        # (one over it alone is judged below): warned of at the optimizer step that shows the loop
        # accumulating them (_close_windows_before_step)
        state.over_with_grads = max(state.over_with_grads or (0, 0), (peak + unplanned, unplanned))
        _OVER.add(state)
    verdict = state.planner.check_step(
        key,
        peak,
        window.boundary,
        window.apart,
        path,
        grads_held=window.grads_held,
        retained=max(window.backwards, 1),
    )
    if verdict == "replan":
        state.stepped.discard(key)
        state.recompile = True
        message, state.planner.overrun_warning = state.planner.overrun_warning, None
        if message:
            state.warned_first = True
            warnings.warn(message, BudgetWarning, stacklevel=caller_level())
        return
    if verdict is not None and not state.warned_outside:
        state.warned_outside = state.warned_first = True
        warnings.warn(verdict, BudgetWarning, stacklevel=caller_level())
    _measure_paths(state, key)


#: a step of input sizes measured whole is measured again at its ``2**k``-th call from this one,
#: then every :data:`REMEASURE_EVERY` calls (:func:`_due_again`)
REMEASURE_FROM = 64


REMEASURE_EVERY = 256


def _due_again(calls: int) -> bool:
    """Whether a step of input sizes measured whole is measured again at its ``calls``-th
    call since: what runs outside the module can change after the first measure (an
    auxiliary loss switched on after a warm-up, a regularizer computed every so many steps),
    and a budget that held then would stop holding, silently. A measure costs a synchronize
    on CUDA and one profiled step on the CPU, so they thin out: at powers of two from
    :data:`REMEASURE_FROM`, then every :data:`REMEASURE_EVERY` calls."""
    if calls < REMEASURE_FROM:
        return False
    return calls & (calls - 1) == 0 or calls % REMEASURE_EVERY == 0


#: how many steps of an input signature may be measured whole, once a step of it ran its graphs
#: more often than any measured, to meet steps that cover those (:func:`_measure_paths`)
_PATH_TRIES = 16


def _covered(ran: Counter[int], measured: list[Counter[int]] | None) -> bool:
    """Whether a step that ran each graph's forward as often as ``ran`` says is covered by
    a step measured whole: one that ran every graph at least as often (it held at least as
    much; True when none was measured, as where a step cannot be)."""
    if measured is None:
        return True
    return any(all(m[g] >= n for g, n in ran.items()) for m in measured)


def _measure_paths(state: CheckmateState, key: tuple[Any, ...]) -> None:
    """After a step of ``key`` was measured whole within its budget: where a step of it ran
    its graphs more often than any measured (``state.uncovered``), the next call is measured
    too, until one covers it; when :data:`_PATH_TRIES` steps were measured so, a
    :class:`BudgetWarning` says that such steps' peaks are unchecked, and no more are."""
    ran = state.uncovered.pop(key, None)
    if ran is None:
        return
    tries = state.path_tries[key] = state.path_tries.get(key, _PATH_TRIES) - 1
    if _covered(ran, state.measured_paths.get(key)):
        return
    if tries > 0:
        state.uncovered[key] = ran
        state.stepped.discard(key)
        return
    if not state.warned_paths:
        state.warned_paths = True
        warnings.warn(
            f"steps of the same input sizes ran the module's graphs a varying number of times (a branch on "
            f"a tensor decides how many: LayerDrop, say), and after {_PATH_TRIES} steps measured whole, one "
            "that ran them more often than any measured is left unmeasured: its peak is unchecked against "
            "the budget. Set the model's layer dropping to 0 (Hugging Face: layerdrop) or leave room in the "
            "budget",
            BudgetWarning,
            stacklevel=caller_level(),
        )


#: optimizer steps taken in the process (counted by :func:`_close_windows_before_step`)
_OPT_STEPS = [0]


#: the states whose module found gradients held at a call since the last optimizer step
_HOLDING: weakref.WeakSet[CheckmateState] = weakref.WeakSet()


#: the states with a step measured over the budget with gradients its plans were not made beside
#: (``over_with_grads``), warned of at the step of an optimizer over their parameters
_OVER: weakref.WeakSet[CheckmateState] = weakref.WeakSet()


def _close_windows_before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """A global optimizer step pre-hook: the measured steps' backwards are over, and a module
    that found gradients held at a call since the last one accumulates them for this step."""
    # counted before the step: PyTorch Lightning's optimizer.step(closure) runs a forward after
    # the pre-hooks, so under accumulate_grad_batches the next window's first call finds gradients
    # held with no step counted since, and the loop is taken as accumulating: planned beside them
    # through the whole step, as its later micro-batches hold them (taken for a loop freeing them
    # late at every call, planned beside the forward only, those ran 1.18x the budget)
    _OPT_STEPS[0] += 1
    for state in list(_OPEN):
        if state.window is not None and state.window.ended:
            _close_window(state)
    for state in list(_HOLDING):
        # not for a loop found accumulating since (a call finding them with no step between):
        # under Lightning's accumulate_grad_batches the window's first micro-batch frees them
        # late and the later ones hold them through; read as late, the plans made after it (a
        # new shape) left them room through the forward only, and the later micro-batches
        # stepped at 1.11x the budget
        if state.grad_probe is not None and state.params is not None and not state.accumulates:
            # a gradient the loop freed (set to None) after the call began, and the backward made
            # again: it frees them between the forward and the backward (accumulated gradients are
            # added to in place, and a loop that frees them before the forward holds none)
            i, grad = state.grad_probe
            state.planner.grads_late = state.params[i].grad is not grad()
        state.accumulates = True
        state.grad_probe = None
    _HOLDING.clear()
    owned: set[int] | None = None
    for state in list(_OVER):
        if owned is None:
            owned = {id(p) for group in getattr(optimizer, "param_groups", ()) for p in group["params"]}
        # at the module's own optimizer's step: not at another model's (an earlier one's in the
        # process, a GAN's other half), which steps none of the gradients it held
        if any(id(p) in owned for p in state.params or ()):
            _OVER.discard(state)
            _warn_first_micro_batches(state)


def _warn_first_micro_batches(state: CheckmateState) -> None:
    """Once, the :class:`BudgetWarning` that a step measured before the loop's first optimizer
    step exceeded the byte budget with the gradients held at its start, which its plans were
    not made beside: found at a call that came after an optimizer step (another model's), they
    could have been freed before the backward, as a loop calling ``zero_grad`` between the
    forward and the backward frees them. Not for such a loop (``grads_late``): its steps hold
    them through the forward only."""
    over, state.over_with_grads = state.over_with_grads, None
    budget = state.planner.budget.nbytes
    if over is None or budget is None or state.planner.grads_late or state.warned_first:
        return
    state.warned_first = True
    peak, held = over
    warnings.warn(
        f"a training step before this first optimizer step measured {format_bytes(peak)}, {peak / budget:.2f}x "
        f"the budget of {format_bytes(budget)}, with the {format_bytes(held)} of gradients that earlier "
        "micro-batches left, which its plans were not made beside: found after another optimizer's step, "
        "they could have been freed before the backward (zero_grad between the forward and the backward). "
        "From the next call on, each graph is planned beside them",
        BudgetWarning,
        stacklevel=caller_level(),
    )


def _close_windows_at_exit() -> None:
    """A profiler still running when the interpreter exits crashes it (torch 2.13)."""
    for state in list(_OPEN):
        state.window_key = None
        _close_window(state)
    abort_windows()  # those of modules garbage-collected meanwhile


register_optimizer_step_pre_hook(_close_windows_before_step)


atexit.register(_close_windows_at_exit)


def _called_again_inside(state: CheckmateState) -> bool:
    """Whether this training call of the module comes before the backward of its earlier
    calls, inside the window measuring their step (:mod:`checkmate.stepcheck`), with no other
    optimized module called since: the step is all the calls and their one backward, measured
    whole, its window open until that backward ends."""
    window = state.window
    return (
        window is not None
        and not window.ended
        and state.window_calls == _CALLS[0]
        and any((t := r()) is not None and not t.done for r in state.pending)
    )


#: gradients a loop frees only after the forward, planned beside, that take more than this
#: share of a byte budget from plans that then recompute are warned of (:func:`_warn_if_zeroed_late`)
LATE_ZERO_SHARE = 0.1


def _warn_if_zeroed_late(state: CheckmateState, before: int) -> None:
    """Once, an :class:`OverheadWarning` where a plan compiled in this call (``before`` on)
    was made beside gradients the loop frees only between the forward and the backward
    (:attr:`~checkmate.runtime.Planner.grads_late`) through the whole step (the loss computed
    outside the module, or no plan's forward fitting beside them:
    :attr:`~checkmate.runtime.Planner.late_throughout`), they are at least
    :data:`LATE_ZERO_SHARE` of the budget, and the plans recompute: freed before the forward,
    they would leave the plans that room. Where no plan fits beside them the BudgetWarning of
    :meth:`~checkmate.runtime.Planner._without_held_grads` says so."""
    planner = state.planner
    held, budget = planner.held_grads, planner.budget.nbytes or 0
    fresh = planner.records[before:]
    if (
        not planner.late_throughout
        or held < LATE_ZERO_SHARE * budget
        or not any(r.overhead > 0 for r in fresh)
    ):
        return
    state.warned_late = True
    warnings.warn(
        f"the parameters hold {format_bytes(held)} of gradients as each step starts: {LATE_ZERO}. The "
        f"budget of {format_bytes(budget)} covers them, and the plans leave them room through the whole step and "
        f"recompute more ({max(r.overhead for r in fresh):+.1%} of the step's compute). {LATE_ZERO_ADVICE} "
        "to give the plans that room",
        OverheadWarning,
        stacklevel=caller_level(),
    )
