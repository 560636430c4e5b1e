"""``checkmate.optimize(model, budget)``: the one-line front door.

The returned module is a drop-in for ``model``: a shallow copy of it (same class, via a
thin subclass) that shares its parameters, buffers, submodules and hooks, so
``state_dict()`` keys, optimizers, ``train()``/``eval()`` and gradient accumulation work
as before. Only its ``forward`` differs, and only in training with gradients enabled: the
step then goes through ``torch.compile`` with :class:`checkmate.runtime.Planner` as the
backend. Dynamo compiles each captured graph once per input shape; a graph seen at new
sizes runs a plan already made for the same graph when that plan, re-simulated at the new
sizes, fits the budget (a smaller batch always does), and is planned again only when none
fits. A training loop whose batches vary in shape makes a few plans, not one per shape.

Evaluation (``eval()`` or ``torch.no_grad()``) runs the original forward (a backward through
a step run in ``eval()`` mode: unplanned, with one :class:`UnplannedWarning`). So does a
training step whose plans recompute and page nothing under a fraction budget (at or above
the no-remat peak): the plan then equals what eager PyTorch does, and running eager avoids
the compiled path's own overhead. Under a byte budget such a step runs compiled: eager
autograd can hold more than the compiled step keeping every value (1.4x on MobileNetV3),
and only the compiled step's peak was checked against the bytes. With
``compiler="inductor"`` it always runs compiled: Inductor's kernels are faster than eager.
"""

from __future__ import annotations

import copy
import gc
import inspect
import math
import numbers
import threading
import time
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from checkmate.call_checks import (
    _check_reentry,
    _check_uncaptured,
    _global_forward_hooks,
    _note_if_checkpointing,
    _plan_for_runs,
    _skipped,
    _track_pending,
    _warn_calls,
    _warn_if_backpropagated,
    _warn_if_checkpointing,
    _warn_runs_found,
    _warn_unplanned,
    saved_tensor_hooks_active,
)
from checkmate.compiling import (
    RECOMPILE_LIMIT,
    _compile_again,
    _compile_step,
    _compiled_call,
    _device_of,
    _float_shapes,
    _near_limit,
    _own_function,
    _rearm,
    _signature,
    _untouched,
)
from checkmate.distributed import (
    active_ddp_module,
    check_fsdp_order,
)
from checkmate.measuring import (
    _CALLS,
    _OPEN,
    _OPT_STEPS,
    _PATH_TRIES,
    _RAISED,
    _called_again_inside,
    _close_window,
    _covered,
    _due_again,
    _held_at_call,
    _measure_until_backward,
    _open_measurement,
    _warn_if_zeroed_late,
    _warn_unmeasured,
)
from checkmate.module_state import _STATE, CheckmateState, UnplannedWarning
from checkmate.planner_common import BudgetWarning
from checkmate.planning import UNCHECKED
from checkmate.profile import load_profile
from checkmate.recompiles import (
    caller_level,
    warn_if_numbers_vary,
    warn_if_recompiled,
    warn_if_shapes_vary,
)
from checkmate.records import PlanRecord
from checkmate.release import release_compiled
from checkmate.runtime import COMPILERS, Planner, log
from checkmate.uncaptured import break_reasons, dynamo_failures
from solvers.budget import BudgetSpec, parse_budget
from solvers.errors import CheckmateError, OptionError, TraceError
from solvers.strategies import check_options

__all__ = ["optimize", "plans_of", "disabled", "CheckmateState", "UnplannedWarning"]


_SUBCLASSES: dict[type, type] = {}


def optimize(
    model: nn.Module,
    budget: BudgetSpec,
    example_inputs: tuple[Any, ...] | torch.Tensor | None = None,
    *,
    strategy: str = "auto",
    profile: str | None = None,
    time_limit: float | None = 30.0,
    plan: str | None = None,
    options: dict[str, Any] | None = None,
    fullgraph: bool = False,
    compiler: str = "aot",
    check_peak: bool = True,
    calls: int = 1,
) -> nn.Module:
    """Return ``model`` training within ``budget``, with the same gradients.

    Args:
        model: the module to optimize (left unchanged; the result shares its parameters).
        budget: bytes (``int``, ``"12GB"``), a fraction of each graph's simulated peak
            without rematerialization (``0.5``, ``"50%"``), or ``"min"`` (the least peak a
            schedule found within the time limit reaches); applied to every captured graph.
            It is parsed here, before anything is traced (see :func:`solvers.parse_budget`).
            A byte budget holds for every input shape. A fraction is of the graph's
            keep-all peak at the shape being compiled (the compiled step keeping every
            value; eager PyTorch can hold more, see the README), but never fewer bytes than
            a larger shape of the same graph was planned at: the loop's memory is that of
            its largest step, and a smaller batch (an epoch's short last batch, a short
            sequence) never raises once a larger one planned.
            With graph breaks the activations an earlier graph saves stay alive while the
            later ones run, so the budget then bounds each graph, not the whole step: pass
            ``fullgraph=True`` to make sure it bounds the step. A fraction that no schedule
            of a graph meets raises :class:`InfeasibleBudgetError`, except for a graph whose
            keep-all peak is at most half that of the step's largest graph compiled before
            it (a loss split off by a graph break, as in Hugging Face models given
            ``labels``): it does not set the step's peak, so it is planned at its own
            minimum (keep-all when that is not known to be lower) with a
            :class:`~checkmate.BudgetWarning` naming the graph, the fraction and
            the bytes it got; its :class:`PlanRecord` holds the budget it was planned at
            (``result.budget``) and the one asked (``asked_budget``). Byte budgets apply
            to every graph as given.
        example_inputs: positional arguments of one training step (a tuple; a lone tensor
            is one argument), to plan now; without them the first training call plans.
        strategy: a strategy name from ``solvers.strategies.STRATEGIES`` (default ``auto``).
        profile: None to time each op on the model's device, or a device profile name or
            path (``"h100"``, ``"cpu"``) to plan with estimated costs.
        time_limit: seconds per graph for searching strategies.
        plan: a plan file to use instead of the plan cache.
        options: strategy options.
        fullgraph: require one graph (a graph break raises :class:`TraceError`).
        compiler: what runs the planned step: ``"aot"`` (the plan's aten ops one at a time,
            exactly in the plan's order), ``"inductor"`` (Inductor compiles the planned
            forward and backward into fused kernels: faster steps, longer compiles, gradients
            equal to ``torch.compile``'s within rounding and dropout drawing Inductor's
            random numbers; the plan is made with the compiled step's costs). ``"aot"`` is
            the default because its measured peak follows the plan, with no compile to wait
            for; under Inductor the plan's simulated peak is not the step's (see
            ``check_peak`` and docs/compilers.md).
        check_peak: with ``compiler="inductor"``, compile each plan's halves and run them
            once on the step's shapes before training, measure their peak with the allocator,
            and replan until it is within the budget and uses most of it (at most three
            plans measured; :mod:`checkmate.compiled`). Costs a compile per plan measured.
            When no plan measured fits, or the measurement fails, a
            :class:`~checkmate.BudgetWarning` says so. Off, the step may hold
            0.8-1.04x the budget (measured on CPU). Not done for ``budget="min"``; a
            ``BudgetWarning`` says so. Under torch.distributed each rank checks, and
            replans, on its own.
        calls: how many times a training step calls the module before its backward (two
            views of a batch: 2; a GAN's discriminator on real and fake data: 2), under a byte
            budget: each call is planned from the first step to fit beside the others. Without
            it the first step that makes more calls finds them, can exceed the budget (a
            :class:`~checkmate.BudgetWarning` says by how much), and the module is planned
            again for them from the next call.

    A training call that plans nothing (Dynamo captured no graph, e.g. ``nn.LSTM`` without
    ``torch._dynamo.config.allow_rnn = True``) runs eagerly with no memory bound and issues
    one :class:`UnplannedWarning` per module.

    Returns:
        A module of the same class sharing ``model``'s parameters and buffers.

    Raises:
        BudgetError: the budget is not a size or a fraction (raised before any tracing).
        OptionError: ``options`` names an option the strategy does not take (before
            any tracing; the message lists its options).
        CheckmateError: ``model`` is no ``nn.Module``, or ``strategy`` or ``compiler`` is not
            a known name (before any tracing; the message lists them).
        OptionError: ``time_limit`` is not a positive number of seconds or None, or
            ``calls`` is not a positive integer, or is more than 1 with a budget not in bytes.
        ProfileError: ``profile`` names no shipped profile, or its file cannot be read.
        InfeasibleBudgetError: no plan was found within the budget: ``exc.lower_bound`` is
            what every schedule needs (proven), ``exc.minimum`` the peak of a schedule
            found (``optimize(model, exc.minimum)`` plans on the first try), ``exc.tradeoffs``
            ``(bytes, extra compute)`` of the schedules found above it.
        TraceError: the model could not be traced (names the construct), or it is a
            ``DistributedDataParallel`` (optimize the module inside, then wrap it).
        CheckmateError: a step would run unplanned (Dynamo's recompile limit for this
            module, an FSDP2 order that cannot be planned).

    Example:
        >>> model = checkmate.optimize(model, 0.5)  # doctest: +SKIP
        >>> loss = model(x).sum(); loss.backward()  # doctest: +SKIP
    """
    # fail at the door, not after tracing and profiling every graph
    if not isinstance(model, nn.Module):
        raise CheckmateError(
            f"checkmate.optimize takes a torch.nn.Module, and was given a {type(model).__name__}: wrap the "
            "computation in an nn.Module whose forward makes it"
        )
    spec = parse_budget(budget)
    check_options(strategy, options or {})
    if time_limit is not None and (
        isinstance(time_limit, bool)
        or not isinstance(time_limit, numbers.Real)  # numpy's numbers too
        or not 0 < time_limit < math.inf
    ):
        raise OptionError(
            f"time_limit={time_limit!r}: give the seconds each graph's search may take, a positive number "
            "(default 30), or None for no limit"
        )
    if profile is not None:
        load_profile(profile)  # an unknown name or a bad file raises ProfileError now, not at the first step
    if isinstance(calls, bool) or not isinstance(calls, numbers.Integral) or calls < 1:
        raise OptionError(
            f"calls={calls!r}: give how many times a step calls the module before its backward (1 or more)"
        )
    if calls > 1 and spec.nbytes is None:
        raise OptionError(
            f"calls={calls} plans each call to fit beside the others in a budget in bytes; under {budget!r} each "
            "call is planned at its own graph's share. Pass the budget in bytes (e.g. '12GiB')"
        )
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)  # one input: unpacked, a batch of 512 rows was 512 arguments
    elif example_inputs is not None and not isinstance(example_inputs, tuple | list):
        raise CheckmateError(
            f"example_inputs is a {type(example_inputs).__name__}: give the positional arguments of one "
            "training call as a tuple, e.g. example_inputs=(x,) for model(x)"
        )
    if compiler not in COMPILERS:
        raise CheckmateError(f"compiler={compiler!r} is not one of {', '.join(map(repr, COMPILERS))}")
    if compiler == "inductor" and not check_peak:
        warnings.warn(
            f"compiler='inductor' with check_peak=False: plans are not checked compiled; {UNCHECKED}",
            BudgetWarning,
            stacklevel=2,
        )
    check_fsdp_order(model, optimizing=True)  # FSDP2: only optimize-then-shard, per block
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # Dynamo runs DDP given whole eagerly: nothing was planned, with a warning that did not say
        # why (an MLP, one gloo rank)
        raise TraceError(
            "checkmate.optimize was given a DistributedDataParallel, whose forward torch.compile does not "
            "capture as a training step: nothing would be planned. Optimize the module it wraps, then wrap "
            "the result: model = DDP(checkmate.optimize(model, budget))"
        )
    if compiler == "inductor" and profile is None:
        _measure_device_speed(model)
    model, base = _original(model)
    planner = Planner(
        spec,
        strategy,
        profile=profile,
        time_limit=time_limit,
        options=dict(options or {}),
        plan_path=plan,
        compiler=compiler,
        check_compiled=check_peak,
    )
    planner.calls = int(calls)  # held at once from the first step (Planner.held_at_once)
    settings = {
        "budget": budget,
        "strategy": strategy,
        "profile": profile,
        "time_limit": time_limit,
        "plan": plan,
        "options": options,
        "fullgraph": fullgraph,
        "compiler": compiler,
        "check_peak": check_peak,
        "calls": calls,
    }
    new = _plain(model, base)
    # a forward set on the instance (Accelerate's mixed-precision wrapper, a user's) would
    # shadow checkmate's: the step ran it unplanned, saying nothing. It is what gets planned
    own = new.__dict__.pop("forward", None)
    new.__class__ = _subclass(base)
    # a forward of its own: Dynamo keeps its compiled variants (and counts recompilations)
    # per code object, and every module of a class shares the class's
    eager: Callable[..., Any]
    own_forward: tuple[Callable[..., Any], bool] | None = None
    if own is None:
        eager = _own_function(base.forward).__get__(new)
    elif isinstance(own, types.MethodType) and own.__self__ is model:
        eager = _own_function(own.__func__).__get__(new)
        own_forward = (own.__func__, True)
    else:
        eager, own_forward = own, (own, False)
    compiled = _compile_step(eager, planner, fullgraph)
    new.__dict__[_STATE] = state = CheckmateState(
        planner=planner, eager=eager, compiled=compiled, settings=settings, own_forward=own_forward
    )
    # Dynamo's references to the planner go when the module does (the finalizer holds the
    # lists of its compiles, not the planner)
    weakref.finalize(
        state, release_compiled, planner.regions, planner.backends
    ).atexit = False  # nothing to free then
    if example_inputs is not None:
        with _untouched(new), torch.enable_grad():
            was = new.training
            new.train()
            try:
                new(*example_inputs)
            finally:
                new.train(was)
                _forget_planning_call(new.__dict__[_STATE])
    return new


def _measure_device_speed(model: nn.Module) -> None:
    """The memory bandwidth and launch cost that ``compiler="inductor"`` prices fused ops
    with (:func:`checkmate.fusion.device_speed`), measured now on the device of ``model``'s
    parameters: its copy holds 128 MiB, which a step that plans would hold beside its own
    values, over a small budget. A model moved to another device after this is measured
    there in the step that plans."""
    from checkmate import fusion

    device = _device_of(model, (), {})
    if device.type in ("cpu", "cuda"):  # not a model on the meta device
        fusion.device_speed(None, device)


def _forget_planning_call(state: CheckmateState) -> None:
    """Drop what the planning call of :func:`optimize` left: its output is never
    backpropagated, so it is no call pending its backward, and its activations are freed now.

    The output can outlive the call in a reference cycle (a hook's, the compile's), collected
    whenever the garbage collector next runs: until then its autograd graph, and the
    activations saved in it, stay allocated, and the first training step found it pending,
    was planned again to fit beside it (a BudgetWarning saying the step could exceed the
    budget) and kept that tighter, slower plan: a test measured a first step at 421 KiB against
    its plan's 552 KiB, or not, depending on what had run before it in the process."""
    _stop_waiting(state)
    gc.collect()


def _stop_waiting(state: CheckmateState) -> None:
    """Count none of the module's calls as pending their backward any more (their backward
    will not run: it raised, or the call's output was dropped)."""
    for ref in state.pending:
        if (token := ref()) is not None:
            token.done = True
    state.pending.clear()


def _original(model: nn.Module) -> tuple[nn.Module, type[nn.Module]]:
    """The module to optimize and its own class: a ``torch.compile``d module is unwrapped
    (its compiled forward would replace the plan: checkmate's compile runs instead), and an
    optimized module is optimized again from its original class (the new budget and
    options replace the old; parameters stay shared)."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        warnings.warn(
            "checkmate.optimize was given a torch.compile'd module: it plans the original module "
            "(model._orig_mod) and runs its own compiled step instead of torch.compile's",
            UserWarning,
            stacklevel=3,
        )
        model = model._orig_mod
    if model.__dict__.get("_compiled_call_impl") is not None:
        # nn.Module.compile(): the module's __call__ runs torch.compile of the original forward,
        # which would replace the plan and run with no memory bound, saying nothing
        warnings.warn(
            f"checkmate.optimize was given a module compiled in place ({type(model).__name__}.compile()): "
            "it plans the module's forward and runs its own compiled step instead of torch.compile's",
            UserWarning,
            stacklevel=3,
        )
    cls = type(model)
    if _STATE in model.__dict__:
        cls = _base_of(cls)
    return model, cls


def _plain(module: nn.Module, cls: type[nn.Module]) -> nn.Module:
    """A shallow copy of ``module`` as an instance of ``cls`` (its original class), without
    checkmate's state: the same parameters, buffers and submodules."""
    plain = cls.__new__(cls)
    plain.__dict__.update(module.__dict__)
    state = plain.__dict__.pop(_STATE, None)
    plain.__dict__.pop("_compiled_call_impl", None)  # nn.Module.compile()'s, see _original
    if state is not None and state.own_forward is not None:  # the forward it had set on itself
        fn, method = state.own_forward
        plain.__dict__["forward"] = types.MethodType(fn, plain) if method else fn
    return plain


def _optimized_again(module: nn.Module, settings: dict[str, Any]) -> nn.Module:
    """``module`` optimized with ``settings``: how a copied or unpickled optimized module is
    rebuilt (see :func:`_subclass`)."""
    return optimize(module, **settings)


def _copy(self: nn.Module) -> nn.Module:
    return _optimized_again(_plain(self, _copyable_base(self, "copied")), self.__dict__[_STATE].settings)


def _deepcopy(self: nn.Module, memo: dict[int, Any]) -> nn.Module:
    plain = copy.deepcopy(_plain(self, _copyable_base(self, "deep-copied")), memo)
    new = _optimized_again(plain, copy.deepcopy(self.__dict__[_STATE].settings, memo))
    memo[id(self)] = new
    return new


def _reduce_ex(self: nn.Module, protocol: int) -> tuple[Any, ...]:
    return (_optimized_again, (_plain(self, _copyable_base(self, "pickled")), self.__dict__[_STATE].settings))


def _copyable_base(module: nn.Module, how: str) -> type[nn.Module]:
    """The original class of an optimized ``module`` that can be rebuilt from it; a class
    made on top of checkmate's (FSDP2's ``fully_shard`` makes one) cannot: CheckmateError."""
    if type(module) not in _SUBCLASSES.values():
        raise CheckmateError(
            f"an optimized module whose class was changed after checkmate.optimize ({type(module).__name__}, "
            f"e.g. by FSDP's fully_shard) cannot be {how}: save or copy its state_dict, or the model "
            "before it was optimized and wrapped"
        )
    return _base_of(type(module))


def _base_of(cls: type) -> type[nn.Module]:
    """The original class of checkmate's subclass ``cls`` or of a class made on top of it."""
    for sub in cls.__mro__:
        for base, made in _SUBCLASSES.items():
            if made is sub:
                return base
    raise CheckmateError(f"{cls.__name__} is not a class checkmate.optimize made")


def plans_of(module: nn.Module) -> list[PlanRecord]:
    """The plans made so far for an optimized module, one per compiled graph.

    ``module`` is what :func:`optimize` returned, or that module inside the wrappers a
    training script puts around it: ``torch.compile`` (its ``_orig_mod``), DDP and
    ``DataParallel`` (their ``module``).

    Raises:
        CheckmateError: ``module`` is no optimized module, nor wraps one.
    """
    return list(_state_of(module, "plans_of").planner.records)


@contextmanager
def disabled(module: nn.Module) -> Iterator[None]:
    """Calls of an optimized module inside the block run its original forward, unplanned:
    eager PyTorch, with no memory bound (what they keep for their backward is held beside
    the planned calls' too). For a call whose gradient is differentiated again (a gradient
    penalty or R1 term computed with ``torch.autograd.grad(..., create_graph=True)``, a
    Hessian-vector product), which torch.compile's compiled step cannot be::

        with checkmate.disabled(critic):
            penalty = gradient_penalty(critic, real, fake)

    ``module`` as for :func:`plans_of`. Blocks nest, and other threads' calls are not
    affected.

    Raises:
        CheckmateError: ``module`` is no optimized module, nor wraps one.
    """
    state = _state_of(module, "disabled")
    thread = threading.get_ident()
    state.disabled[thread] = state.disabled.get(thread, 0) + 1
    try:
        yield
    finally:
        state.disabled[thread] -= 1
        if not state.disabled[thread]:
            del state.disabled[thread]


def _state_of(module: nn.Module, caller: str) -> CheckmateState:
    """The state of the optimized module ``module`` is or wraps (see :func:`plans_of`)."""
    seen = module
    for _ in range(8):  # wrappers of wrappers: compile(DDP(optimized)), ...
        state = seen.__dict__.get(_STATE)
        if state is not None:
            return state  # type: ignore[no-any-return]
        inner = getattr(seen, "_orig_mod", None)
        if inner is None and isinstance(seen, nn.parallel.DistributedDataParallel | nn.DataParallel):
            inner = seen.module
        if not isinstance(inner, nn.Module):
            break
        seen = inner
    raise CheckmateError(
        f"{caller}: this {type(module).__name__} was not returned by checkmate.optimize, nor wraps a "
        "module that was (torch.compile, DDP and DataParallel are looked through); pass the module "
        "optimize returned"
    )


#: the innermost torch.func transform running, or None (looked up once: every training call asks)
_PEEK_TRANSFORM = getattr(torch._C._functorch, "peek_interpreter_stack", None)


def _in_transform() -> bool:
    """Whether this call runs inside a ``torch.func`` transform (``grad``, ``vmap``, ``jacrev``,
    per-sample gradients, meta-learning's inner steps): Dynamo gives up on a frame it meets
    there and marks its code skipped, so that a module whose first call ran inside one ran
    every later step eagerly, unplanned and unwarned."""
    return _PEEK_TRANSFORM is not None and _PEEK_TRANSFORM() is not None


def _warn_transform(module: nn.Module, state: CheckmateState) -> None:
    """Once per module: its calls inside a ``torch.func`` transform run unplanned."""
    if state.warned_transform:
        return
    state.warned_transform = True
    warnings.warn(
        f"a call of the optimized {type(module).__name__} inside a torch.func transform (grad, vmap, jacrev) "
        "runs its original forward, with no memory bound: torch.compile cannot compile the planned step "
        "there. Calls outside the transform are planned",
        UnplannedWarning,
        stacklevel=caller_level(),
    )


def _forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: CheckmateState = self.__dict__[_STATE]
    if state.disabled and state.disabled.get(threading.get_ident()):
        return state.eager(*args, **kwargs)  # checkmate.disabled
    if not (self.training and torch.is_grad_enabled()):
        out = state.eager(*args, **kwargs)  # an outer torch.compile compiles it
        if torch.is_grad_enabled() and not state.warned_eval:
            _warn_if_backpropagated(self, state, out)
        return out
    return _training_call(self, state, args, kwargs)


# torch.compile(optimized) traces the frames _forward calls (its disable is not recursive, so that
# the eager path of an optimized module stays compilable): a training call's bookkeeping must run
# as written (traced, its weak references came back as the objects they referred to, and the
# second call raised a TypeError), and the planned step must not be inlined into the outer graph
@torch._dynamo.disable
def _training_call(
    self: nn.Module, state: CheckmateState, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if _in_transform():
        _warn_transform(self, state)
        return state.eager(*args, **kwargs)
    key = _signature(args, kwargs)
    again = _called_again_inside(state)  # its step measured whole stays open: this call is in it
    for st in list(_OPEN):  # measured steps: over, never backpropagated, or this call is inside
        if not (again and st is state):
            _close_window(st, called=True)
    _CALLS[0] += 1
    if again:
        state.window_calls = _CALLS[0]
    if state.planner.abandoned:  # a backward raised before it ran: its calls are not waited for
        state.planner.abandoned = False
        _stop_waiting(state)
    if state.pending and _RAISED[0]:
        # an encoder's call whose head raised (its budget infeasible, a bad batch) stayed pending
        # in the cycles the error left: every later call of the encoder was taken for a second
        # call before one backward, planned beside it, and raised InfeasibleBudgetError for good
        _RAISED[0] = False
        gc.collect()
    if state.pending:
        _check_reentry(self, state)
    if state.outside_ddp and key in state.outside_ddp and active_ddp_module() is not None:
        log.info("the step was planned outside DDP's forward: planning it again inside, with DDP's buckets")
        _compile_again(state)
    new_signature = key not in state.eager_keys
    if new_signature:  # not every step: a module walk
        state.params = None  # found again where a byte budget reads their gradients (below)
        check_fsdp_order(self)  # FSDP2: a sharded submodule would run outside the plan
        if active_ddp_module() is None:
            state.outside_ddp.add(key)
    elif state.eager_keys[key]:
        out = state.eager(*args, **kwargs)
        _track_pending(state, out, key)
        return out
    if state.planner.budget.nbytes is not None and saved_tensor_hooks_active():
        state.planner.saved_hooks.add(key)  # named if the step is measured over its budget
    unmeasured = False  # a step that cannot be measured whole (below), warned of once
    grads_held = 0
    steps_before, state.steps_at_call = state.steps_at_call, _OPT_STEPS[0]
    if state.planner.budget.nbytes is not None:
        grads_held = _held_at_call(self, state, steps_before)
    # under a dispatch mode (a FlopCounterMode, whose module tracker's global hooks live as long
    # as it) Dynamo runs the step eagerly: those hooks are not the step's, and the next call's
    # are compared with the ones before (an MFU logged every few steps compiled it again each time)
    if _get_current_dispatch_mode() is None and (hooks := _global_forward_hooks()) != state.global_hooks:
        if state.global_hooks is not None and state.planner.records:
            log.info("a global module forward hook was registered or removed: compiling the step again")
            state.recompile = True
        state.global_hooks = hooks
    if state.planner.unobserved:  # graphs that fit together where the loop drops what they hand on
        state.planner.judge_split()
    if (
        key in state.stepped
        and not again
        and key not in state.unmeasurable
        and state.planner.budget.nbytes is not None
    ):
        state.step_calls[key] += 1
        if _due_again(state.step_calls[key]):
            state.stepped.discard(key)  # measured again: what runs outside the module may have changed
            state.again.add(key)
    replanned = state.recompile or state.planner.recompile  # compiled again by checkmate: not counted
    if replanned:
        # a step measured whole exceeded the budget (room for what is outside), or a backward
        # was given gradients its plan counted as no bytes
        state.recompile = state.planner.recompile = False
        _compile_again(state)
    elif (
        state.planner.budget.nbytes is not None
        and key in state.eager_keys
        and key not in state.stepped
        and state.window is None
        and not state.pending  # a later call of a step: measured from its first call only
        # a plan to hold it: a step Dynamo ran eagerly whole (warned: UnplannedWarning) has none
        # to plan again, nor memory outside its plans to find (an nn.LSTM's eager steps, measured,
        # were warned of twice as memory held outside the module, and compiled again)
        and state.planner.latest.get(key)
    ):
        unmeasured = _open_measurement(self, state, key, args, kwargs, grads_held)
    before, checkpointed = len(state.planner.records), state.planner.checkpointed
    failures = dynamo_failures() if new_signature else None
    start = time.perf_counter()
    state.planner.begin_step(key)
    state.planner.input_shapes = _float_shapes(key)
    try:
        out = _compiled_call(state, args, kwargs, limits=key not in state.eager_keys or _near_limit(state))
        if failures is not None and len(state.planner.records) > before:
            # why Dynamo broke the step's graphs: what its warnings name as the cause
            state.planner.breaks[key] = tuple(break_reasons(failures))
            _check_uncaptured(self, state, key, (args, kwargs), out, state.planner.breaks[key], before)
        state.planner.settle()  # every graph of the step is compiled: a fraction it cannot meet raises
        state.planner.finish_call()  # a room guessed for graphs after a graph break, judged
    except BaseException as exc:
        _RAISED[0] = True
        state.window_key = None
        _close_window(state)
        _note_if_checkpointing(self, state, exc, captured=state.planner.checkpointed > checkpointed)
        # raised by the forward before a planned step's graph ran: Dynamo traced it anew, and gave
        # up on it (checkmate's own errors come from its backend, which Dynamo does not suppress)
        if (
            not isinstance(exc, CheckmateError)
            and not state.planner.ran
            and (state.planner.latest.get(key) or not state.planner.records)
        ):
            _rearm(state)
        raise
    finally:
        state.planner.pending_held = 0  # only the call that found more calls held plans beside them
    if len(state.planner.records) > before:
        # the call compiled: inputs, or values the step reads, that take a new value at every
        # call compile at each
        if new_signature and not state.warned_numbers:
            warn_if_numbers_vary(state, key, args, kwargs)
        if new_signature and not state.warned_shapes:
            warn_if_shapes_vary(state, key, args, kwargs)
        if not state.warned_recompiles:
            warn_if_recompiled(
                state,
                time.perf_counter() - start,
                again=not (new_signature or replanned),
                limit=RECOMPILE_LIMIT,
            )
        if not state.warned_checkpointing:
            _warn_if_checkpointing(self, state, captured=state.planner.checkpointed > checkpointed)
    ran = Counter(state.planner.ran)
    if state.window is not None:
        # per call: the module's calls held at once are planned as such (Planner.calls)
        state.window_path = state.window_path | ran if again else ran
    elif key in state.unmeasurable and state.planner.budget.nbytes is not None:
        # no measured step can say whether the runs fit: planned for them, as a step measured
        # over the budget is. The layer-dropping blocks under DDP (two gloo ranks) at 0.9 of
        # eager DDP's peak stepped at 1.11x the budget, unwarned: each run kept all it saved
        _plan_for_runs(state, key, ran, "and its steps are not measured whole")
    elif (
        key in state.stepped
        and state.path_tries.get(key, _PATH_TRIES) > 0
        and not _covered(ran, state.measured_paths.get(key))
    ):
        # its graphs ran more often than in any step of these sizes measured (LayerDrop kept
        # more layers): its peak is not what was measured. A Hugging Face wav2vec2 (LayerDrop
        # 0.3, four layers) at 0.6 of eager's peak stepped at 1.11x and 1.41x its byte budget,
        # unwarned, after a step keeping fewer layers measured 0.82x
        log.info(
            "the training step ran its graphs more often than any step of these sizes measured whole "
            "(a branch decides how many times: LayerDrop, say): measuring it again"
        )
        state.uncovered[key] = ran
        state.stepped.discard(key)
    if (
        state.window is None
        and key not in state.unmeasurable
        and len(state.planner.records) > before
        and state.planner.budget.nbytes is not None
        and any(n > 1 for n in ran.values())  # else nothing ran again: no plan simulated
        and not state.planner.runs_fit(ran)
    ):
        # a graph compiled in this call ran again in it (a loop over layers broken inside its body:
        # LayerDrop's branch, a print): planned for one run, its runs are planned beside each other
        # from the next call, not after a step measured over the budget (where its runs do not fit
        # as planned: a budget far above the step's needs compiles nothing again). Blocks broken by
        # a print at 0.5 of eager's peak stepped at 2.00x the budget until the third call, measured,
        # said so
        _plan_for_runs(state, key, ran, "in the call that compiled them, which may have exceeded the budget")
        _warn_runs_found(state, ran)
    _warn_calls(state)
    if state.planner.grads_late and not state.warned_late and len(state.planner.records) > before:
        _warn_if_zeroed_late(state, before)
    if len(state.planner.records) > before:
        # compiling leaves reference cycles (Dynamo's tracer, its frames) that hold real tensors
        # of the call, such as the output object built after a graph break, or the output itself
        # (compile_wrapper's frame, and this one's, held by a cycle): collected now, not when the
        # loss and the backward already run beside them, nor found held by a loop that dropped
        # them (a Hugging Face GPT-2 whose loss is outside it, at 0.7 of eager's peak, held its
        # logits through the loss and backward of each call that compiled: 1.07x the budget,
        # unwarned, at a call compiled again; a full collection takes a tenth of a second or
        # more, a call that compiles seconds)
        gc.collect()
    _track_pending(state, out, key, planned=bool(state.planner.ran))
    if state.window is not None and len(state.planner.records) > before:
        state.window_key = None  # it compiled (a guard Dynamo keys on, e.g. autocast): no measure
        _close_window(state)
    if state.window is not None:
        _measure_until_backward(self, state, key, out)
    if unmeasured:
        _warn_unmeasured(self, state, out)
    if state.planner.replan_pending:  # its graphs (graph breaks) exceeded the budget together
        state.planner.replan_pending = False
        _compile_again(state)
        return out
    if key not in state.eager_keys:
        fresh = state.planner.records[before:]
        # eager PyTorch can hold more than the compiled step keeping every value (autograd
        # keeps what the compiled backward frees early): under a byte budget the compiled
        # keep-all step is what was checked against the budget, so it runs
        # compiled, so eager is then the slower way to run the same plan
        by_bytes = state.planner.budget.nbytes is not None
        inductor = any(r.compiler != "aot" for r in fresh)
        state.eager_keys[key] = bool(fresh) and all(r.is_eager for r in fresh) and not (by_bytes or inductor)
    if state.planner.records and not state.planner.ran and len(state.planner.records) == before:
        _skipped(self, state, key, out)
    _warn_unplanned(self, state, out, failures)
    return out


def _subclass(cls: type) -> type:
    """``cls`` with checkmate's forward; one subclass per class."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # torch.compile(optimized) must not trace into the planned step (its backend would
        # compile the model anew, unplanned): Dynamo skips this frame, not those it calls
        fwd = torch._dynamo.disable(_forward, recursive=False)
        # the original forward's signature and docstring: libraries read them (Hugging Face's
        # Trainer keeps only the dataset columns forward names: with (*args, **kwargs) it drops
        # every input column and refuses to train)
        original = getattr(cls, "forward", None)
        with suppress(TypeError, ValueError):  # a builtin or C forward has no signature to give
            fwd.__signature__ = inspect.signature(original)  # type: ignore[attr-defined,arg-type]
        fwd.__doc__ = getattr(original, "__doc__", None)
        # a copy (copy.copy, copy.deepcopy: an EMA model, a frozen reference) and an unpickled
        # module (torch.save of the whole model) are the original class's module optimized
        # again with the same budget: the compiled step of the copied one would run the
        # original's parameters, and the subclass cannot be pickled by name
        methods = {
            "forward": fwd,
            "__module__": cls.__module__,
            "__copy__": _copy,
            "__deepcopy__": _deepcopy,
            "__reduce_ex__": _reduce_ex,
        }
        sub = type(cls.__name__, (cls,), methods)
        sub.__qualname__ = cls.__qualname__
        _SUBCLASSES[cls] = sub
    return sub
