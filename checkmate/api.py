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

import atexit
import copy
import functools
import gc
import inspect
import itertools
import os
import random
import re
import threading
import time
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode

from checkmate.distributed import (
    active_ddp_module,
    check_fsdp_order,
    fsdp_gradients,
    fsdp_params_of,
    in_process_group,
)
from checkmate.planner_common import LATER_ROOM, BudgetWarning, OverheadWarning
from checkmate.planning import UNCHECKED
from checkmate.recompiles import (
    caller_level,
    warn_if_numbers_vary,
    warn_if_recompiled,
    warn_if_shapes_vary,
)
from checkmate.records import PlanRecord
from checkmate.release import release_compiled
from checkmate.runtime import COMPILERS, Planner, log
from checkmate.step_budget import LATE_ZERO, LATE_ZERO_ADVICE, SPLIT_SLACK, repeated
from checkmate.stepcheck import STEP_SLACK, StepWindow, abort_windows, open_window, users_profiler
from checkmate.uncaptured import break_reasons, dynamo_failures, uncaptured
from solvers.budget import BudgetSpec, format_bytes, parse_budget
from solvers.errors import CheckmateError, InfeasibleBudgetError, TraceError
from solvers.strategies import check_options

__all__ = ["optimize", "plans_of", "disabled", "CheckmateState", "UnplannedWarning"]


class UnplannedWarning(UserWarning):
    """A training step ran with no captured graph planned (eagerly, with no memory bound), or
    with a large part of it run eagerly, outside every graph captured."""


_STATE = "_checkmate_state"
_SUBCLASSES: dict[type, type] = {}


class _Pending:
    """A planned call whose backward has not run: it lives as long as the call's autograd graph
    (held in its output's ``grad_fn.metadata``), and ``done`` is set when the backward reaches it."""

    __slots__ = ("__weakref__", "done", "key")

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.done = False
        self.key = key  # the call's input signature (its plans: Planner.latest)


@dataclass(eq=False)  # identity: held in weak sets
class CheckmateState:
    """What an optimized module carries besides the original's state.

    Attributes:
        planner: the backend; its ``records`` hold one plan per compiled graph.
        eager: the original forward, bound to the optimized module.
        compiled: ``eager`` under torch.compile with the planner.
        eager_keys: input signature -> True when its plans recompute and page nothing.
        warned_unplanned: an :class:`UnplannedWarning` was issued (once per module).
        warned_skipped: a planned step ran eagerly, skipped by Dynamo, and an
            :class:`UnplannedWarning` said so (once per module, :func:`_rearm`).
        warned_eval: a step in ``eval()`` mode was backpropagated, and a warning said so.
        pending: the planned calls whose backward has not run yet, while their graphs live
            (:func:`_track_pending`).
        warned_reentry: under a fraction, a call started while an earlier one was pending,
            and a warning said so (under a byte budget the calls are planned together).
        warned_unmeasured: a step that cannot be measured whole had large outputs, and a
            warning said so (:func:`_warn_unmeasured`).
        warned_checkpointing: the module had Hugging Face gradient checkpointing on at a
            compile: its regions were captured in the step's graphs, or a warning said they
            were not (:func:`_warn_if_checkpointing`).
        warned_uncaptured: a compiled step ran a large part of its forward eagerly, outside
            every captured graph, and a warning said so (:func:`_check_uncaptured`).
        outside_ddp: input signatures compiled outside a DDP forward (planned without DDP's
            gradient buckets): run inside one, the step is compiled and planned again.
        settings: the arguments of the :func:`optimize` call (its budget among them).
        window: the training step being measured whole (:mod:`checkmate.stepcheck`), from
            its forward's start to the end of the backward that reaches it.
        window_key: the input signature of the step ``window`` measures.
        window_calls: the count of optimized modules' training calls (``_CALLS``) when it
            opened: another one inside the window (each block of a model optimized apart)
            makes the measurement no measure of this module's step.
        stepped: input signatures whose step was measured whole (byte budgets).
        step_calls: input signature -> its calls since its step was first measured whole,
            which measure it again at :func:`_due_again`'s counts.
        again: input signatures whose next step is measured again (:func:`_due_again`).
        window_path: how many times each graph's forward ran in a call of the step
            ``window`` measures (:attr:`~checkmate.runtime.Planner.ran`; the most of its calls).
        measured_paths: input signature -> ``window_path`` of each of its steps measured
            whole since the module was last compiled again.
        uncovered: input signature -> a step of it that ran some graph more often than any
            of its steps measured (:func:`_covered`): its next steps are measured until one
            covers it (:func:`_measure_paths`).
        path_tries: input signature -> how many more of its steps may be measured for that.
        unmeasurable: input signatures whose steps cannot be measured whole (on the CPU under
            torch.distributed; other optimized modules inside): a step of one that ran a graph
            more often than planned is compiled again, each run planned beside the others.
        recompile: a measured step exceeded the budget: the next call compiles it again.
        warned_outside: a step measured whole exceeded the budget after that, and a
            warning said so.
    """

    planner: Planner
    eager: Callable[..., Any]
    compiled: Callable[..., Any]
    eager_keys: dict[tuple[Any, ...], bool] = field(default_factory=dict)
    warned_unplanned: bool = False
    warned_skipped: bool = False
    warned_eval: bool = False
    pending: list[weakref.ref[_Pending]] = field(default_factory=list)
    outside_ddp: set[tuple[Any, ...]] = field(default_factory=set)
    warned_reentry: bool = False
    warned_unmeasured: bool = False
    warned_checkpointing: bool = False
    warned_uncaptured: bool = False
    window: StepWindow | None = None
    window_key: tuple[Any, ...] | None = None
    window_calls: int = 0
    stepped: set[tuple[Any, ...]] = field(default_factory=set)
    step_calls: Counter[tuple[Any, ...]] = field(default_factory=Counter, repr=False)
    again: set[tuple[Any, ...]] = field(default_factory=set, repr=False)
    window_path: Counter[int] = field(default_factory=Counter, repr=False)
    measured_paths: dict[tuple[Any, ...], list[Counter[int]]] = field(default_factory=dict, repr=False)
    uncovered: dict[tuple[Any, ...], Counter[int]] = field(default_factory=dict, repr=False)
    path_tries: dict[tuple[Any, ...], int] = field(default_factory=dict, repr=False)
    warned_paths: bool = field(default=False, repr=False)
    unmeasurable: set[tuple[Any, ...]] = field(default_factory=set, repr=False)
    recompile: bool = False
    #: the global module forward hooks at the last training call (:func:`_global_forward_hooks`)
    global_hooks: tuple[tuple[Any, ...], ...] | None = None
    warned_outside: bool = False
    #: a planned step was differentiated with create_graph=True, and a warning said so
    warned_double: bool = False
    #: input signature -> its calls in a row that a profiler of the user's kept from being
    #: measured whole (:func:`_profiled`), and whether a warning said that none could be
    profiled: Counter[tuple[Any, ...]] = field(default_factory=Counter, repr=False)
    warned_profiled: bool = False
    #: thread id -> depth of :func:`disabled` blocks: that thread's calls run the original forward
    disabled: dict[int, int] = field(default_factory=dict)
    #: the keyword arguments :func:`optimize` was called with (budget included): a copy or an
    #: unpickled module is optimized again with them
    settings: dict[str, Any] = field(default_factory=dict)
    #: a call of the module found gradients held with no optimizer step since its last call, or
    #: an optimizer step came after a call that found some: the loop accumulates them over
    #: micro-batches, and from then on gradients held count against a byte budget
    #: (:attr:`~checkmate.runtime.Planner.held_grads`)
    accumulates: bool = False
    #: at a call that found gradients held: a parameter's index and its gradient then, to tell
    #: at the optimizer step whether the loop freed that gradient since (zero_grad between the
    #: forward and the backward: :attr:`~checkmate.runtime.Planner.grads_late`) or added to it
    grad_probe: tuple[int, weakref.ref[torch.Tensor]] | None = field(default=None, repr=False)
    #: an OverheadWarning said that the plans leave room for gradients the loop frees late
    warned_late: bool = False
    #: the count of optimizer steps (``_OPT_STEPS``) at the module's last training call: a call
    #: finding gradients held with none since accumulates them (the earlier call's backward made them)
    steps_at_call: int = -1
    #: a step measured whole, with gradients held at its start that its plans were not made
    #: beside (found at a call after another model's optimizer step, before the module's own
    #: showed them accumulated): its peak with them, and them
    over_with_grads: tuple[int, int] | None = field(default=None, repr=False)
    #: a step measured over the budget was warned of before any optimizer step came: the first
    #: micro-batches' excess is not warned of again (:func:`_warn_first_micro_batches`)
    warned_first: bool = False
    #: under a byte budget, the module's parameters, found again at each new input signature: the
    #: gradients they hold as a training call starts count against it (:func:`_gradients_held`)
    params: tuple[nn.Parameter, ...] | None = field(default=None, repr=False)
    #: FSDP2's records of those parameters, sharded with the module or a unit around it, found
    #: with them: the gradients it keeps there count too (:func:`~checkmate.distributed.fsdp_gradients`)
    fsdp_params: tuple[Any, ...] = field(default=(), repr=False)
    #: an input signature with its Python numbers and bools left out -> those of each signature
    #: seen with it (:func:`warn_if_numbers_vary`)
    numbers: dict[tuple[Any, ...], set[tuple[Any, ...]]] = field(default_factory=dict, repr=False)
    warned_numbers: bool = False
    #: an input signature with its tensors' sizes and its numbers left out -> the sizes of each
    #: signature seen with it whose first call planned (:func:`warn_if_shapes_vary`)
    shapes: dict[tuple[Any, ...], set[tuple[Any, ...]]] = field(default_factory=dict, repr=False)
    warned_shapes: bool = False
    #: calls of an input signature compiled before that compiled graphs of the step again (a
    #: guard of Dynamo's failed; not one on a parameter's requires_grad), the seconds those
    #: calls took, and the reasons Dynamo recorded since the call before that compiled, by their
    #: text with digits masked -> the latest (:func:`warn_if_recompiled`)
    recompiles: int = 0
    recompile_seconds: float = 0.0
    recompile_reasons: dict[str, str] = field(default_factory=dict, repr=False)
    #: the number of guard failures Dynamo had recorded for each code object when the module
    #: last compiled (:func:`checkmate.recompiles.guard_failures`)
    guard_marks: dict[Any, int] = field(default_factory=dict, repr=False)
    warned_recompiles: bool = False
    #: a forward the model had set on itself (``model.forward = ...``), which ``eager`` runs:
    #: its function where it was a method of the model (rebound to a copy), else the callable
    own_forward: tuple[Callable[..., Any], bool] | None = None


def optimize(
    model: nn.Module,
    budget: BudgetSpec,
    example_inputs: tuple[Any, ...] | None = None,
    *,
    strategy: str = "auto",
    profile: str | None = None,
    time_limit: float | None = 30.0,
    plan: str | None = None,
    options: dict[str, Any] | None = None,
    fullgraph: bool = False,
    compiler: str = "aot",
    check_peak: bool = True,
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
        example_inputs: positional arguments of one training step, to plan now; without
            them the first training call plans.
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
            ``check_peak`` and the README, "Compilers").
        check_peak: with ``compiler="inductor"``, compile each plan's halves and run them
            once on the step's shapes before training, measure their peak with the allocator,
            and replan until it is within the budget and uses most of it (at most three
            plans measured; :mod:`checkmate.compiled`). Costs a compile per plan measured.
            When no plan measured fits, or the measurement fails, a
            :class:`~checkmate.BudgetWarning` says so. Off, the step may hold
            0.8-1.04x the budget (measured on CPU). Not done for ``budget="min"``; a
            ``BudgetWarning`` says so. Under torch.distributed each rank checks, and
            replans, on its own.

    A training call that plans nothing (Dynamo captured no graph, e.g. ``nn.LSTM`` without
    ``torch._dynamo.config.allow_rnn = True``) runs eagerly with no memory bound and issues
    one :class:`UnplannedWarning` per module.

    Returns:
        A module of the same class sharing ``model``'s parameters and buffers.

    Raises:
        BudgetError: the budget is not a size or a fraction (raised before any tracing).
        OptionError: ``options`` names an option the strategy does not take (before
            any tracing; the message lists its options).
        CheckmateError: ``strategy`` or ``compiler`` is not a known name (before any
            tracing; the message lists them).
        InfeasibleBudgetError: no plan was found within the budget: ``exc.lower_bound`` is
            what every schedule needs (proven), ``exc.minimum`` the peak of a schedule
            found (``optimize(model, exc.minimum)`` plans on the first try).
        TraceError: the model could not be traced (names the construct), or it is a
            ``DistributedDataParallel`` (optimize the module inside, then wrap it).
        CheckmateError: a step would run unplanned (Dynamo's recompile limit for this
            module, an FSDP2 order that cannot be planned).

    Example:
        >>> model = checkmate.optimize(model, 0.5)  # doctest: +SKIP
        >>> loss = model(x).sum(); loss.backward()  # doctest: +SKIP
    """
    # fail at the door, not after tracing and profiling every graph
    spec = parse_budget(budget)
    check_options(strategy, options or {})
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


#: each optimized module's compiled variants counted apart from those of every other module of
#: its class: Dynamo shares one recompile count among the compiles of equal code (copies of a
#: class's forward included), and a module past it ran its step eagerly, unplanned, saying
#: nothing (the ninth of nine optimized Sequentials, a parameter unfrozen mid-training)
_ISOLATED: dict[str, Any] = (
    {"isolate_recompiles": True}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)


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


def _own_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of the plain function ``fn`` with a code object of its own (``fn`` itself when
    it is not a plain Python function)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    own = types.FunctionType(code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__dict__.update(fn.__dict__)
    own.__qualname__, own.__doc__, own.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return own


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
    unmeasured = False  # a step that cannot be measured whole (below), warned of once
    grads_held = 0
    steps_before, state.steps_at_call = state.steps_at_call, _OPT_STEPS[0]
    if state.planner.budget.nbytes is not None:
        # gradients accumulated over earlier micro-batches stay through this step, and the budget
        # covers gradients: a Llama (3 layers) accumulating 4 micro-batches at 0.5 of eager's
        # peak over them stepped at 1.02x the budget, unwarned, its plans made beside none.
        # Counted from the first call that finds them where no optimizer step came since the
        # module's last call (that call's backward made them: the loop accumulates); found after
        # an optimizer step, they are counted once the next optimizer step shows the loop adding
        # to them, not freeing them before its backward (Lightning's order: grads_late)
        if state.params is None:
            state.params = tuple(self.parameters())
            state.fsdp_params = fsdp_params_of(self)
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
                    "zero gradients"
                    if state.planner.grads_zeroed
                    else "gradients from earlier micro-batches",
                )
                state.recompile = True
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
        # the step measured whole (checkmate.stepcheck); inside measure_peak, from its events; under
        # a profiler of the user's, at a later call. Each
        # rank of a distributed job measures and plans again on its own: no rank waits for another
        device = _device_of(self, args, kwargs)
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
    _track_pending(state, out, key)
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
        elif hooked := _backward_hooked(self):
            why = _backward_hook_why(hooked)
        elif checkpointing := _hf_checkpointing(self):
            why = (
                f"Hugging Face gradient checkpointing is on (in {type(checkpointing).__name__}), and Dynamo runs the "
                f"whole forward eagerly when it cannot capture a checkpointed layer (a graph break inside one). "
                f"{_CHECKPOINTING_OFF}"
            )
        elif rnn := _rnn_skipped(self):
            why = (
                f"{rnn}, which Dynamo runs eagerly unless torch._dynamo.config.allow_rnn = True. Set it "
                "before the first step: Dynamo then unrolls the RNN over its time steps (a graph that grows "
                "with the sequence length), and checkmate plans that step"
            )
        else:
            why = "Look for what makes Dynamo fall back (TORCH_LOGS=graph_breaks)"
        warnings.warn(
            f"checkmate planned nothing for {type(self).__name__}: torch.compile captured no graph "
            "with a backward (Dynamo ran the forward eagerly), so training steps run eagerly with no "
            f"memory bound. {why}",
            UnplannedWarning,
            stacklevel=caller_level(),
        )
    return out


def _rearm(state: CheckmateState) -> None:
    """Compile the step again at the next call, with a code object of its own
    (:func:`_compile_again`). A compile of the forward that failed (``WON'T CONVERT``: an
    exception raised inside it, ``if self.fail: raise``, or a construct Dynamo cannot trace
    at some inputs) marks its code skipped for every later call, its compiled variants
    included (torch 2.13's ``ConvertFrameReturn`` default; ``set_code_exec_strategy`` does
    not reach the variants of an ``isolate_recompiles`` compile), so every later step ran
    eagerly: a module whose forward raised once at its third step ran 1.11x its budget from
    then on, unwarned, as plain ``torch.compile`` runs it eagerly. Its plans are reused
    (their families, the plan cache); the graphs are traced again."""
    if not state.recompile:
        log.info(
            "Dynamo may skip the compiled step from now on (a compile of the forward failed): compiling it again"
        )
    state.recompile = True


def _eager_error(exc: torch._dynamo.exc.TorchRuntimeError) -> BaseException | None:
    """The error eager PyTorch raises where Dynamo wrapped it, or None to raise ``exc`` as it is.

    Dynamo runs each op on fake tensors as it traces the step, and an op that raises there (a
    ``BatchNorm1d`` given one sample in training: ``ValueError``) raises ``TorchRuntimeError``,
    a ``RuntimeError``: a loop that skips such batches with ``except ValueError`` broke under
    checkmate (and plain ``torch.compile``). The error at the end of its chain is the op's own;
    it is raised where its type is one eager raises (not an error of torch's tracing machinery)
    and the wrapper is not already of its type (a shape mismatch stays Dynamo's
    ``RuntimeError``, whose text names the line of the model), with a note of where it was."""
    outer: BaseException = exc
    inner: BaseException = exc
    seen = {id(exc)}
    while (nxt := inner.__cause__ or inner.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        outer, inner = inner, nxt
    module = type(inner).__module__
    if isinstance(exc, type(inner)) or isinstance(inner, CheckmateError) or module.startswith("torch"):
        return None
    outer.__cause__ = outer.__context__ = None  # raised in exc's handler, inner's context is exc: no cycle
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', str(exc))
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in frames if not f[0].startswith(torch_dir)] or frames  # the user's line, else torch's
    where = f" at {frames[-1][0]}:{frames[-1][1]} ({frames[-1][2].strip()})" if frames else ""
    inner.add_note(
        f"raised as Dynamo traced the optimized step{where}, running its ops on fake tensors: the error eager "
        f"PyTorch raises (torch.compile raises it as {type(exc).__name__})"
    )
    return inner


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

    Dynamo guards on none of them, even with its module hook guards on (:func:`_hook_guards`):
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


def _compile_step(forward: Callable[..., Any], planner: Planner, fullgraph: bool) -> Callable[..., Any]:
    """``torch.compile`` of an optimized module's forward: the planner its backend, shapes
    static, its variants counted apart from every other compile's (:data:`_ISOLATED`). The one
    place both the first compile and :func:`_compile_again` make it: the second, made without
    ``isolate_recompiles``, shared torch's one wrapper of its own module classes with every
    ``torch.compile``d module, and past Dynamo's limit ran its step eagerly, unplanned. Its
    region is noted on the planner, whose module releases it (:mod:`checkmate.release`)."""
    compiled = torch.compile(
        forward, backend=planner.backend(), dynamic=False, fullgraph=fullgraph, **_ISOLATED
    )
    planner.regions.append(getattr(compiled, "_isolate_recompiles_id", -1))
    return compiled


def _compile_again(state: CheckmateState) -> None:
    """A fresh torch.compile of the step (a code object of its own: Dynamo compiles it anew at
    the next call, and the planner plans it again), for a step planned outside DDP's forward
    (``example_inputs``, a step before wrapping: DDP's gradient buckets were left out of the
    budget, and it measured 1.05x it under DDP) and for the graphs of a step that exceeded a
    byte budget together (each is then planned with the others beside it)."""
    eager = state.eager
    fresh = _own_function(eager.__func__).__get__(eager.__self__)  # type: ignore[attr-defined]
    state.compiled = _compile_step(fresh, state.planner, bool(state.settings.get("fullgraph", False)))
    state.eager_keys.clear()
    state.outside_ddp.clear()
    # every input signature is planned again, each step is measured again: a short batch measured
    # within the budget, planned again after a longer one's step was measured over it, measured
    # 1.16x the budget at every later call, silently
    state.stepped.clear()
    state.step_calls.clear()
    state.again.clear()  # left, a first measure under a profiler of the user's was skipped as a measure again
    state.planner.fitted.clear()  # the plans measured within the budget are gone
    state.measured_paths.clear()  # of the plans compiled before
    state.uncovered.clear()
    state.path_tries.clear()


def _grad_leaves(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``out`` a backward can run through."""
    if type(out) is torch.Tensor:  # the common output: no pytree walk (every step passes here)
        leaves: list[Any] = [out]
    else:
        leaves = torch.utils._pytree.tree_leaves(out)
    return (t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)


def _track_pending(state: CheckmateState, out: Any, key: tuple[Any, ...]) -> None:
    """Record a planned call as pending until a backward reaches one of its outputs' nodes.

    The marker lives in those nodes' ``metadata``, so it dies with the call's autograd graph:
    a call whose outputs are dropped unbackpropagated holds no activations, and is not pending."""
    nodes = {id(n): n for t in _grad_leaves(out) if (n := t.grad_fn) is not None}
    if not nodes:
        return
    token = _Pending(key)
    ref = weakref.ref(token)
    for node in nodes.values():
        meta: dict[str, Any] = node.metadata  # type: ignore[assignment]  # a property; typed as a method
        meta["checkmate_pending"] = token
        node.register_prehook(functools.partial(_backward_reached, ref, weakref.ref(state)))
    state.pending.append(ref)


def _float_shapes(key: tuple[Any, ...]) -> frozenset[tuple[int, ...]]:
    """The shapes of a call's floating-point tensor inputs, read from its :func:`_signature`
    (every step passes here: no pytree walk)."""
    return frozenset(
        p[0]
        for p in key
        if type(p) is tuple and len(p) == 4 and isinstance(p[1], torch.dtype) and p[1].is_floating_point
    )


def _device_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device of a call's first tensor input, else of the module's first parameter."""
    for x in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    return next(module.parameters(), torch.empty(0)).device


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


def _backward_reached(
    ref: weakref.ref[_Pending], state_ref: weakref.ref[CheckmateState], grad_outputs: Any
) -> None:
    token = ref()
    if token is not None:
        token.done = True
    if torch.is_grad_enabled():  # a backward with create_graph=True: the engine runs it in grad mode
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


def _warn_calls(state: CheckmateState) -> None:
    """The planner's :class:`BudgetWarning` messages that this step can exceed the budget (it found
    the module called again before earlier calls' backward; no plan of a graph fits beside its
    runs); at the line that called it."""
    for message in state.planner.take_warnings():
        warnings.warn(message, BudgetWarning, stacklevel=caller_level())


def _recompile_limit_hit() -> bool:
    """Whether Dynamo gave up compiling some code in this process for its recompile limit
    (it counts each such give-up among its ``unimplemented`` graph breaks)."""
    from torch._dynamo.utils import counters

    return any("recompile limit" in str(reason) for reason in counters.get("unimplemented", {}))


def _needs_grad(out: object) -> bool:
    """True when some tensor in ``out`` has a backward to run."""
    leaves = torch.utils._pytree.tree_leaves(out)
    return any(isinstance(x, torch.Tensor) and x.requires_grad for x in leaves)


#: compiled variants one optimized forward may hold (one per input shape): far above what a
#: training loop's shapes need, while Dynamo's default (8) is reached by the ninth length
RECOMPILE_LIMIT = 1024


def _near_limit(state: CheckmateState) -> bool:
    """Whether one more compile of this module's step could reach Dynamo's own recompile
    limits: at least as many variants as those limits allow, less one, may have been compiled
    (every input signature seen, plus every graph planned, counts as one: more than Dynamo counts).

    Below that, a call of a known input signature runs without :func:`_recompile_limits`: its
    compiled code is found by its guards, and a guard that fails anyway (a parameter frozen, a
    global flag Dynamo guards on) compiles a variant that Dynamo's own limits still allow.
    Each write marks Dynamo's config hash stale: around a compiled call the writes cost about
    70 us a step on a 2-core CPU (31 us on their own; GPT-2 tiny), and nothing without them."""
    cfg = torch._dynamo.config
    return len(state.planner.records) + len(state.eager_keys) + 1 >= min(
        cfg.recompile_limit, cfg.accumulated_recompile_limit
    )


@contextmanager
def _recompile_limits() -> Iterator[None]:
    """Dynamo's recompile limits raised to :data:`RECOMPILE_LIMIT` and a hit made an error
    (past the limit Dynamo would run the step eagerly, unplanned), for one call.

    Plain attribute writes, restored after, and only of the values that differ
    (``torch._dynamo.config.patch`` costs about 75 us per call against about 25, measured on
    CPU); only the calls that may compile pass here (:func:`_near_limit`)."""
    cfg = torch._dynamo.config
    wanted = {
        "recompile_limit": max(cfg.recompile_limit, RECOMPILE_LIMIT),
        "accumulated_recompile_limit": max(cfg.accumulated_recompile_limit, RECOMPILE_LIMIT),
        "fail_on_recompile_limit_hit": True,
    }
    saved = {k: getattr(cfg, k) for k in wanted}
    changed = [k for k, v in wanted.items() if saved[k] != v]
    for k in changed:
        setattr(cfg, k, wanted[k])
    try:
        yield
    finally:
        for k in changed:
            setattr(cfg, k, saved[k])


@contextmanager
def _hook_guards() -> Iterator[None]:
    """Dynamo's guards on module hooks installed (``skip_nnmodule_hook_guards`` False), for one
    call of the step: every compile of it, whichever call makes it, checks the hooks it inlined.

    Dynamo skips those guards by default, so a hook registered on a submodule after the step
    was compiled, or one removed, is never seen: a forward hook zeroing a layer's output,
    registered after the first step, did not run, and the step's output and gradients were
    those without it (eager's run it). With the guards the step is compiled, and planned, again
    when its hooks change (a forward hook that only reads the output included); the same hook
    registered anew at every step compiles nothing again."""
    cfg = torch._dynamo.config
    if not cfg.skip_nnmodule_hook_guards:
        yield
        return
    cfg.skip_nnmodule_hook_guards = False
    try:
        yield
    finally:
        cfg.skip_nnmodule_hook_guards = True


# torch.compile(optimized) traces the frames _forward calls (its disable is not recursive, so that
# the eager path of an optimized module stays compilable): this one must run as written, or Dynamo
# inlines the planned step into the outer graph and the outer backend compiles it, unplanned
@torch._dynamo.disable
def _compiled_call(
    state: CheckmateState, args: tuple[Any, ...], kwargs: dict[str, Any], *, limits: bool = True
) -> Any:
    """``state.compiled(*args, **kwargs)``, under :func:`_recompile_limits` where ``limits``
    (a call that may compile: a new input signature, or :func:`_near_limit`), its failures
    as checkmate's errors."""
    try:
        with _hook_guards():
            if not limits:
                return state.compiled(*args, **kwargs)
            with _recompile_limits():
                return state.compiled(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        raise CheckmateError(
            f"torch.compile reached its recompile limit ({limit} variants) for this "
            "optimized module, so the step would run unplanned: too many distinct input shapes, "
            "argument values, or values the step reads (a module's integer attribute, a size after "
            "a graph break; the OverheadWarning before this named them); pad inputs to a few "
            "shapes, keep such values in tensors, or raise torch._dynamo.config.recompile_limit"
        ) from exc
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        inner = exc.inner_exception
        if isinstance(inner, CheckmateError):
            raise inner.with_traceback(None) from None
        raise TraceError(
            f"the joint graph could not be planned: {type(inner).__name__}: {inner}; "
            "report it with the model, or run the model without checkmate"
        ) from inner
    except torch._dynamo.exc.TorchRuntimeError as exc:
        eager = _eager_error(exc)
        if eager is None:
            raise
        raise eager from None
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"torch.compile cannot capture the model in one graph: {first}; rewrite that "
            "construct (data-dependent Python control flow, .item(), prints) or pass "
            "fullgraph=False to plan each captured piece separately"
        ) from exc


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


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable key of what makes torch.compile specialize: tensor shapes, dtypes,
    devices and requires_grad; other arguments by value (or type when unhashable); and
    ``torch.autocast``, under which the same inputs make another graph."""
    key = _inputs_signature(args, kwargs)
    if torch._C._is_any_autocast_enabled():
        amp = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
        key = (*key, ("autocast", amp))
    return key


def _inputs_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`_signature` of the inputs."""
    if not kwargs and all(type(a) is torch.Tensor or type(a) is nn.Parameter for a in args):
        # the common call, model(x) or model(x, y): no pytree walk (every step passes here)
        return ("tensors", *((tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args))
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [str(spec)]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        else:
            try:
                hash(x)
                parts.append(x)
            except TypeError:
                parts.append(type(x))
    return tuple(parts)


@contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Restore buffers and RNG states after a planning call (it must not change state)."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng = random.getstate()
    try:
        yield
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
