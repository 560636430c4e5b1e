"""What a training call's forward ran outside every captured graph, and what that keeps.

Dynamo captures a module's forward as graphs, and checkmate plans each. Where it cannot
trace a construct it breaks the graph and resumes after it, in a new graph, or, where it
cannot trace the rest of a frame either (an ``nn.LSTM`` before torch 2.15, a module
under a function Dynamo skips, such as ``pack_padded_sequence``), runs that code eagerly.
Those ops keep what they save for the backward in autograd's graph, beside the plans and
bounded by none of them: an LSTM tagger whose embedding and first layers were captured
(one graph, 11 MiB planned) kept 27.6 MiB through its eager LSTM and head, and at a byte
budget of 0.6 of eager's peak its steps measured 1.67x the budget, then 1.35x with a
recomputing plan, warned as memory "held outside the module" by a loss.

:func:`uncaptured` walks the autograd graph a call's outputs hang from, back to its inputs
and parameters, and sums the storages saved by nodes that are not a compiled graph's
(``CompiledFunctionBackward``); :func:`break_reasons` names what Dynamo could not trace
in the meantime. Both run once per compiled input signature.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from checkmate.memory import storage_key

__all__ = ["Uncaptured", "break_reasons", "dynamo_failures", "uncaptured"]

#: the autograd node type of a graph AOTAutograd compiled (checkmate's plans, and any
#: ``torch.compile``'d code inside the module)
_COMPILED = "CompiledFunctionBackward"


@dataclass(frozen=True)
class Uncaptured:
    """The ops a forward ran outside every captured graph that autograd recorded."""

    #: the bytes of the distinct storages they saved for the backward (not parameters,
    #: buffers or the call's inputs)
    saved: int
    #: how many autograd nodes they made
    nodes: int
    #: their node types, most frequent first (``"AddmmBackward0"``)
    kinds: tuple[str, ...]
    #: the Python ``autograd.Function`` classes among them defined outside torch
    #: (``"_ReversibleFunction"``), whose backward runs eagerly too, allocating what no plan
    #: bounds, most frequent first (:func:`_library_function`)
    functions: tuple[str, ...] = ()


def uncaptured(outputs: Iterable[torch.Tensor], held: Iterable[torch.Tensor]) -> Uncaptured:
    """The eager part of the autograd graph that ``outputs`` hang from: every node reached
    from their ``grad_fn`` going back, up to the nodes of ``held`` (the call's inputs, the
    module's parameters and buffers: what was there before the call) and to leaves, that is
    not a compiled graph's. A graph compiled by AOTAutograd is one node, walked through: an
    eager op before it is reached too. Nothing is read (all zero) under saved-tensor hooks,
    whose unpacking would copy what was offloaded back."""
    if _saved_hooks_active():
        return Uncaptured(0, 0, ())
    keep_out: set[int] = set()
    stop: set[torch.autograd.graph.Node] = set()
    for t in held:
        if (key := storage_key(t)) is not None:
            keep_out.add(key)
        if t.grad_fn is not None:
            stop.add(t.grad_fn)
    seen: set[torch.autograd.graph.Node] = set()
    todo: list[torch.autograd.graph.Node | None] = [t.grad_fn for t in outputs if t.grad_fn is not None]
    storages: dict[int, int] = {}
    kinds: Counter[str] = Counter()
    functions: Counter[str] = Counter()
    while todo:
        node = todo.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)
        kind = type(node).__name__
        if kind == "AccumulateGrad":
            continue
        todo.extend(nxt for nxt, _ in node.next_functions)
        if kind == _COMPILED:
            continue
        kinds[kind] += 1
        if (function := _library_function(node)) is not None:
            functions[function] += 1
        for t in _saved_tensors(node):
            if (key := storage_key(t)) is not None and key not in keep_out:
                storages[key] = t.untyped_storage().nbytes()
    return Uncaptured(
        sum(storages.values()),
        sum(kinds.values()),
        tuple(k for k, _ in kinds.most_common()),
        tuple(k for k, _ in functions.most_common()),
    )


def _library_function(node: torch.autograd.graph.Node) -> str | None:
    """The name of the Python ``autograd.Function`` whose backward ``node`` is, where a model
    or library defines it (a reversible layer recomputing in its backward, a fused kernel's
    wrapper); None for other nodes and for torch's own (DDP's ``_DDPSink``, FSDP2's
    ``RegisterPostBackwardFunction`` on a block's inputs), whose backward allocates nothing
    of note."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return None
    cls = getattr(node, "_forward_cls", None)
    module = str(getattr(cls, "__module__", ""))
    if cls is None or module == "torch" or module.startswith("torch."):
        return None
    return str(cls.__name__)


def _saved_hooks_active() -> bool:
    """Whether saved-tensor hooks are on (``torch.autograd.graph.save_on_cpu``, an offloading
    context): reading a saved tensor then runs the unpack hook (a copy back to the device),
    so nothing is read."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True
    try:
        return top(False) is not None
    except (RuntimeError, TypeError):
        return True


def _saved_tensors(node: torch.autograd.graph.Node) -> list[torch.Tensor]:
    """The tensors an eager autograd node saved (its ``_saved_*`` attributes; a Python
    ``autograd.Function``'s ``saved_tensors``)."""
    found: list[torch.Tensor] = []
    for name in [n for n in dir(node) if n.startswith("_saved_")] + ["saved_tensors"]:
        try:
            value = getattr(node, name)
        except (AttributeError, RuntimeError):  # none, freed already, or not a tensor's to unpack
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, torch.Tensor) and v.layout is torch.strided and v.device.type != "meta":
                found.append(v)
    return found


def dynamo_failures() -> Counter[str]:
    """Dynamo's count of each reason it broke a graph or gave up on a frame, so far in
    this process (its ``graph_break`` and ``unimplemented`` counters)."""
    from torch._dynamo.utils import counters

    got: Counter[str] = Counter()
    for group in ("graph_break", "unimplemented"):
        got.update(counters.get(group, {}))
    return got


def break_reasons(before: Mapping[str, int], *, most: int = 3) -> list[str]:
    """The reasons counted by :func:`dynamo_failures` since it returned ``before``, each
    as its first line and, where Dynamo gives one, its explanation (``"Attempted to call
    function marked as skipped (... the function `pack_padded_sequence` ... should not be
    traced)"``), at most ``most`` of them."""
    now = dynamo_failures()
    reasons = []
    for reason, count in now.items():
        if count <= before.get(reason, 0):
            continue
        lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
        if not lines:
            continue
        why = next(
            (line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")),
            "",
        )
        why = re.sub(r" in file `[^`]*`", "", why)  # a path into site-packages
        why = re.sub(r"`<function (\S+) at 0x[0-9a-f]+>`", r"`\1`", why)  # an address, new each run
        text = f"{lines[0]} ({why})" if why else lines[0]
        if text not in reasons:  # one break is counted under both counters
            reasons.append(text)
    return reasons[:most]
