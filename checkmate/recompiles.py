"""Warnings of a step compiled and planned again and again: the overhead a training loop
pays where Dynamo specializes what changes from call to call.

checkmate compiles the step with static shapes, as ``torch.compile(dynamic=False)`` does:
each new value of a Python number among the inputs (:func:`warn_if_numbers_vary`), each new
input shape (:func:`warn_if_shapes_vary`), and each change of something else the step reads
(a number kept on the module, a size that depends on tensor values after a graph break:
:func:`warn_if_recompiled`) traces, profiles and plans the step again. Each warns once, with
what changed and what to do, as a :class:`checkmate.OverheadWarning` pointing at the
user's line (:func:`caller_level`).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from checkmate.planner_common import OverheadWarning

if TYPE_CHECKING:
    from checkmate.module_state import CheckmateState


def caller_level() -> int:
    """The ``stacklevel`` at which a warning issued by this function's caller names the line
    that called the model: the first frame outside checkmate, ``torch.nn`` and Dynamo's
    wrappers (their depth differs between torch releases)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


_INTERNAL = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(nn.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch._dynamo.__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.optim.__file__)) + os.sep,  # a warning at the optimizer step
    os.path.dirname(os.path.abspath(torch.autograd.__file__)) + os.sep,  # one from a backward hook
    os.path.dirname(os.path.abspath(torch._functorch.__file__)) + os.sep,  # a call inside torch.func.grad
    os.path.abspath(contextlib.__file__),  # a warning from a context manager's set-up
)


#: values of a Python number among a module's inputs, at the same tensor shapes, from which
#: :func:`warn_if_numbers_vary` warns: each compiled the step and planned it again
NUMBER_VALUES = 4


def warn_if_numbers_vary(
    state: CheckmateState, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Once, an :class:`OverheadWarning` when a Python number (not a bool) among the module's
    inputs took :data:`NUMBER_VALUES` values at the same tensor shapes, each compiling the step
    (a step counter, a temperature, a schedule's rate; a number the forward does not read
    compiles nothing: Dynamo does not guard on it). Called after a new input signature's call
    made plans.

    The step is compiled with static shapes (``dynamic=False``), so Dynamo specializes every
    Python number: each value traces, profiles and plans the step again. A forward given
    ``step`` and ``temperature`` as Python numbers (an MLP, every call a new value) was
    compiled and planned at each of 25 calls, unwarned, up to the recompile limit checkmate
    sets (1,024), where the step raises."""
    scalars = [i for i, part in enumerate(key) if type(part) in (int, float, bool)]
    if not any(type(key[i]) is not bool for i in scalars):
        return
    masked = tuple(bool if i in scalars else part for i, part in enumerate(key))  # the tensors' part
    seen = state.numbers.setdefault(masked, set())
    seen.add(tuple(key[i] for i in scalars))
    varied = [
        i
        for k, i in enumerate(scalars)
        if type(key[i]) is not bool and len({values[k] for values in seen}) >= NUMBER_VALUES
    ]
    if not varied:
        return
    state.warned_numbers = True
    params = _positional_names(state)
    names = ", ".join(_input_name(args, kwargs, i - 1, params) for i in varied)  # key[0]: the pytree spec
    warnings.warn(
        f"a Python number among the module's inputs ({names}) took {NUMBER_VALUES} values at the same "
        "tensor shapes: checkmate compiles the step with static shapes, so each value traced, profiled and "
        "planned it again. Pass it as a tensor (torch.tensor(value)), or keep it out of the forward's "
        "arguments",
        OverheadWarning,
        stacklevel=caller_level(),
    )


#: input shapes of one input signature (its tensors' sizes aside), each planned, from which
#: :func:`warn_if_shapes_vary` warns
SHAPES_PLANNED = 8


def _is_tensor_part(part: Any) -> bool:
    """Whether ``part`` of an input signature (:func:`_inputs_signature`) is a tensor's."""
    return type(part) is tuple and len(part) == 4 and isinstance(part[1], torch.dtype)


def warn_if_shapes_vary(
    state: CheckmateState, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Once, an :class:`OverheadWarning` when the step was planned at
    :data:`SHAPES_PLANNED` input shapes of one signature (the same inputs, dtypes and ranks),
    naming the dimensions that varied and the seconds planning took. Called after a new
    input signature's call made plans.

    The step is compiled with static shapes, so each new shape traces, profiles and plans it
    again: a sequence length that varies from batch to batch (dynamic padding), or a count of
    boxes, is a compile and a plan per value (a Llama of 12 layers: 17.5 s each). Two or
    three shapes (a short last batch, a few buckets) are what a fraction budget and the plan
    cache are for, and are not warned of."""
    tensors = [i for i, part in enumerate(key) if _is_tensor_part(part)]
    if not tensors:
        return
    family = tuple(
        (len(part[0]), *part[1:]) if i in tensors else (type(part) if type(part) in (int, float) else part)
        for i, part in enumerate(key)
    )
    seen = state.shapes.setdefault(family, set())
    seen.add(tuple(key[i][0] for i in tensors))
    if len(seen) < SHAPES_PLANNED:
        return
    state.warned_shapes = True
    params = _positional_names(state)
    varied = []
    for k, i in enumerate(tensors):
        for d in range(family[i][0]):
            sizes = sorted({shapes[k][d] for shapes in seen})
            if len(sizes) > 1:
                name = _input_name(args, kwargs, i - 1, params)  # key[0]: the pytree spec
                varied.append(f"{name} dimension {d}: {len(sizes)} sizes, {sizes[0]} to {sizes[-1]}")
    records = state.planner.records
    seconds = sum(r.seconds for r in records)
    anew = sum(r.reused_from is None for r in records)
    warnings.warn(
        f"the step was compiled and planned at {len(seen)} input shapes ({'; '.join(varied)}): "
        f"{seconds:.1f} s of tracing, profiling and planning in all ({anew} of its {len(records)} graphs "
        "planned anew, the others fitted with an earlier plan). checkmate compiles the step with static "
        "shapes, as torch.compile(dynamic=False) does, so each new shape is traced, profiled and planned "
        "again; plans are cached on disk for the next run. Pad the inputs to a few sizes: a tokenizer's "
        "pad_to_multiple_of=64, batches bucketed by length, drop_last=True for a short last batch",
        OverheadWarning,
        stacklevel=caller_level(),
    )


#: calls of a known input signature that compiled the step again, from which
#: :func:`warn_if_recompiled` warns (as Dynamo's own recompile limit, which checkmate raises)
RECOMPILES_PLANNED = 8


def guard_failures() -> dict[Any, list[str]]:
    """Dynamo's record of why a compiled frame's guards failed: code object -> reasons, each
    ``"<compile id>: <guard>"`` (``torch._dynamo.utils.guard_failures``; empty where a torch
    release has no such record)."""
    return getattr(torch._dynamo.utils, "guard_failures", {})


def warn_if_recompiled(state: CheckmateState, seconds: float, *, again: bool, limit: int) -> None:
    """Once, an :class:`OverheadWarning` when :data:`RECOMPILES_PLANNED` calls of input
    signatures compiled before (``again``) compiled graphs of the step again, giving the guards
    Dynamo found failed; after ``limit`` compiles the call raises. Called after a call that made plans, which took ``seconds``.

    The inputs kept their sizes, yet something the step reads changed: a Python number kept
    on the module or a global (a step counter: Dynamo specializes integer attributes), or,
    after a graph break, a size that depends on tensor values (``x[mask]``, ``nonzero``).
    Each value compiles and plans the step again (seconds to a minute a graph), unwarned, until
    the compile limit raises. A parameter frozen or unfrozen compiles the step again too, and
    is not counted: the step trains other parameters, and needs a plan of its own."""
    failures = guard_failures()
    if again:
        # the forward's code is shared by every instance of its class: guards of other
        # modules' compiles (torch.compile'd, or optimized apart) fail at its calls too
        ours = state.planner.compile_ids
        new = [
            _guard_reason(code, reason)
            for code, reasons in failures.items()
            for reason in reasons[state.guard_marks.get(code, 0) :]
            if (of := _compile_of(reason)) is None or of in ours
        ]
        # a parameter frozen or unfrozen (gradual unfreezing, a layer per epoch) changes what
        # the step trains: a plan of its own each time, not a value to keep in a tensor
        wanted = [text for text in new if "requires_grad" not in text]
        if wanted or not new:
            for text in wanted:
                state.recompile_reasons[re.sub(r"\d+", "N", text)] = text
            state.recompiles += 1
            state.recompile_seconds += seconds
    state.guard_marks = {code: len(reasons) for code, reasons in failures.items()}
    if state.recompiles < RECOMPILES_PLANNED:
        return
    state.warned_recompiles = True
    reasons = list(state.recompile_reasons.values())[-3:]
    why = f" (Dynamo's guards that failed: {'; '.join(reasons)})" if reasons else ""
    # a list of metrics the forward appends to: its length is guarded, new at every call
    grows = (
        " A list or dict the forward appends to or fills (metrics collected in it) has its length guarded, "
        "and it grows at every call: collect them outside the optimized forward, or in a tensor updated in "
        "place."
        if any(text.startswith("len(") for text in reasons)
        else ""
    )
    warnings.warn(
        f"the step was compiled and planned again at {state.recompiles} calls whose inputs kept their "
        f"types and sizes{why}: {state.recompile_seconds:.1f} s in those calls, compiling and planning. "
        f"Something the step reads changed.{grows} A Python number kept on the module or in a global (a step "
        "counter, a schedule's factor) is specialized, as under torch.compile(dynamic=False): keep it in "
        "a tensor (a buffer updated in place) or pass it as one. A size that depends on tensor values "
        "(boolean-mask indexing x[mask], nonzero, unique) ends a graph, and the graph after it is "
        "compiled at each new size: compute on every position and mask the result instead "
        "(cross_entropy's ignore_index), or pad the selection to a fixed size. After "
        f"{limit} compiles the call raises",
        OverheadWarning,
        stacklevel=caller_level(),
    )


def _compile_of(reason: str) -> str | None:
    """The id of the compile (``"3/1"``) a guard-failure reason of Dynamo's names first; None
    where it names none."""
    match = re.match(r"\[?(!?[\d/]+)\]?:", reason)
    return match[1] if match else None


def _guard_reason(code: Any, reason: str) -> str:
    """One of Dynamo's guard-failure reasons for ``code``, short: its compile id and stack
    trace left out, and, for the code Dynamo resumes at after a graph break
    (``torch_dynamo_resume_in_forward_at_12``), where that break is."""
    text = " ".join(reason.split("\nUser stack trace")[0].split())
    text = re.sub(r"^\[?\d+/\d+\]?:\s*", "", text).split(" (HINT:")[0]
    if "#" in text:  # "<guard> # <source line> # <file>:<line> in <function>"
        parts = [part.strip() for part in text.split("#")]
        text = f"{parts[0]} ({os.path.basename(parts[-1])})" if parts[-1] else parts[0]
    where = re.fullmatch(r"torch_dynamo_resume_in_(.+)_at_(\d+)", getattr(code, "co_name", ""))
    if where:
        name = os.path.basename(getattr(code, "co_filename", "?"))
        text += f", in the graph after the graph break in {where[1]} at {name}:{where[2]}"
    return text[:300]


def _positional_names(state: CheckmateState) -> list[str]:
    """The names of the original forward's positional parameters, for :func:`_input_name`
    (none for a builtin or C forward: inputs are then named by position)."""
    try:
        return [
            p.name
            for p in inspect.signature(state.eager).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def _input_name(args: tuple[Any, ...], kwargs: dict[str, Any], leaf: int, params: list[str]) -> str:
    """The input that holds the ``leaf``-th leaf of ``(args, kwargs)``, by the forward's
    positional parameters ``params`` where they name it: ``step``, ``config['rate']``,
    ``argument 3``."""
    path = torch.utils._pytree.tree_flatten_with_path((args, kwargs))[0][leaf][0]
    rest = torch.utils._pytree.keystr(path[2:])
    if getattr(path[0], "idx", None) == 0:
        idx = getattr(path[1], "idx", -1)
        return f"{params[idx] if 0 <= idx < len(params) else f'argument {idx}'}{rest}"
    return f"{getattr(path[1], 'key', '?')}{rest}"
