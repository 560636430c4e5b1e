"""Execute paging plans (POET): saved values the plan holds on the host cross the
forward/backward boundary in host memory.

A paging schedule (:mod:`solvers.strategies.poet`) pages values out to the host and back
in. :func:`checkmate.codegen.generate` executes only its computes, so a value computed in
the forward and read in the backward becomes a saved tensor that stays on the device in
between. :func:`page_saved` rewrites the two generated modules for the values the plan
keeps on the host (not on the device) when the backward starts:

- forward: right after computing such a value, copy it into (pinned, on CUDA) host memory
  with a non-blocking copy, and return the host copy instead of the value, so the device
  copy dies at its last forward read;
- backward: copy it back with a non-blocking copy right before its first reader, so the
  device copy lives from there to its last read, as the plan's page-in does (just in time:
  never earlier than the plan, so never more memory).

Both copies are issued on the current stream, so they are ordered with the kernels around
them. On a CPU-only machine the host and the device are the same memory: the page-out is a
real copy (the device value still dies), the page-in reuses it, and gradients are those of
eager mode. Page-outs and page-ins within one phase (both in the forward or both in the
backward) are not executed: such values stay on the device (correct, more memory than the
plan); :class:`PagedModules` lists what was paged and what was not. Values that are views
of another value's storage stay on the device too (a copy would lose their aliasing).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from checkmate.codegen import SplitModules, split_point
from checkmate.trace import JointGraph
from solvers.schedule import COMPUTE, FREE, PAGEIN, PAGEOUT, Schedule

__all__ = ["PagedModules", "paged_at_split", "page_saved", "page_out", "page_in"]


@dataclass(frozen=True)
class PagedModules:
    """The generated step with paging.

    Attributes:
        modules: the forward and backward modules (as :func:`checkmate.codegen.generate`
            returns them, rewritten).
        paged: joint-graph names of the saved values that cross to the backward on the host.
        unpaged: graph node ids the plan pages but that stay on the device (paged within
            one phase, or views).
    """

    modules: SplitModules
    paged: tuple[str, ...]
    unpaged: frozenset[int]


def page_out(x: torch.Tensor) -> torch.Tensor:
    """A host copy of ``x`` (pinned and non-blocking when ``x`` is on an accelerator)."""
    pin = x.device.type == "cuda"
    host = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="cpu", pin_memory=pin)
    host.copy_(x, non_blocking=pin)
    return host


def page_in(x: torch.Tensor, device: str) -> torch.Tensor:
    """``x`` on ``device`` (a non-blocking copy from pinned memory; ``x`` itself when it is
    already there)."""
    return x.to(device, non_blocking=True)


def paged_at_split(jg: JointGraph, schedule: Schedule) -> tuple[frozenset[int], frozenset[int]]:
    """Which graph nodes the plan holds on the host, not on the device, when the backward
    starts; and which others it pages at all.

    Returns:
        ``(across, paged)``: ``across`` are on the host and off the device at the first
        backward compute; ``paged`` are all nodes with a page-out step.
    """
    split = split_point(jg, schedule)
    seen = 0
    resident: set[int] = set()
    on_host: set[int] = set()
    across: frozenset[int] | None = None
    for op, i in schedule.steps:
        if op == COMPUTE:
            if seen == split and across is None:
                across = frozenset(on_host - resident)
            seen += 1
            resident.add(i)
        elif op == FREE:
            resident.discard(i)
        elif op == PAGEOUT:
            on_host.add(i)
        elif op == PAGEIN:
            resident.add(i)
    paged = frozenset(i for op, i in schedule.steps if op == PAGEOUT)
    return (across if across is not None else frozenset(on_host - resident)), paged


def page_saved(modules: SplitModules, jg: JointGraph, schedule: Schedule) -> PagedModules:
    """Rewrite generated modules so that the values the plan holds on the host at the
    forward/backward boundary travel there (see the module doc).

    Args:
        modules: :func:`checkmate.codegen.generate`'s output for ``schedule``.
        jg: the joint graph model.
        schedule: the (paging) schedule the modules were generated from.

    Returns:
        The rewritten modules and what was paged.
    """
    across, paged = paged_at_split(jg, schedule)
    names = [
        name
        for name in modules.saved
        if (g := jg.group.get(name)) is not None and g in across and jg.members[g][0] == name
    ]
    if not names:
        return PagedModules(modules, (), paged)
    chosen = set(names)
    fw = modules.forward.graph
    out = next(n for n in reversed(fw.nodes) if n.op == "output")
    outs = list(out.args[0])  # type: ignore[arg-type]
    first_saved = len(outs) - len(modules.saved)
    for k, name in enumerate(modules.saved):
        if name not in chosen:
            continue
        v = outs[first_saved + k]
        assert isinstance(v, fx.Node)
        with fw.inserting_after(v):
            host = fw.call_function(page_out, (v,))
        host.meta = dict(v.meta)
        outs[first_saved + k] = host
    out.args = (tuple(outs),)

    bw = modules.backward.graph
    order = {n: k for k, n in enumerate(bw.nodes)}
    placeholders = [n for n in bw.nodes if n.op == "placeholder"][: len(modules.saved)]
    for name, ph in zip(modules.saved, placeholders, strict=True):
        if name not in chosen or not ph.users:
            continue
        val = ph.meta.get("val")
        device = str(val.device) if isinstance(val, torch.Tensor) else "cpu"
        first = min(ph.users, key=order.__getitem__)
        with bw.inserting_before(first):
            dev = bw.call_function(page_in, (ph, device))
        dev.meta = dict(ph.meta)
        ph.replace_all_uses_with(dev)
        dev.update_arg(0, ph)  # the page-in itself still reads the host copy
    rewritten = dataclasses.replace(
        modules,
        forward=_rebuild(modules.forward, fw),
        backward=_rebuild(modules.backward, bw),
    )
    unpaged = frozenset(paged - {jg.group[n] for n in names})
    return PagedModules(rewritten, tuple(names), unpaged)


def _rebuild(old: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    graph.lint()
    mod = fx.GraphModule(old, graph)  # keeps the boxed codegen set on the graph
    assert mod._boxed_call
    return mod
