"""What an optimized module carries: its :class:`CheckmateState` (the settings it was optimized
with, its :class:`~checkmate.runtime.Planner`, the bookkeeping of its training calls), and the
warning for steps that run unplanned."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from checkmate.runtime import Planner
from checkmate.stepcheck import StepWindow


class UnplannedWarning(UserWarning):
    """A training step ran with no captured graph planned (eagerly, with no memory bound), or
    with a large part of it run eagerly, outside every graph captured."""


_STATE = "_checkmate_state"


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
        warned_dynamic: an input marked dynamic was compiled at its static shape, and a
            warning said so (:func:`~checkmate.compiling._take_marks`).
        warned_captures: Dynamo's capture of data-dependent sizes was on, and is off for the
            step's compiles, and a warning said so (:func:`~checkmate.compiling._step_config`).
        warned_ddp_buckets: DDP's buckets were smaller than the first bucket torch.compile's DDP
            optimizer makes, so the step compiled as one graph, and a warning said so
            (:func:`~checkmate.compiling._step_config`).
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
    warned_dynamic: bool = False
    warned_captures: bool = False
    warned_ddp_buckets: bool = False
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
    #: a call ran inside a torch.func transform, unplanned, and a warning said so (:func:`_in_transform`)
    warned_transform: bool = False
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
