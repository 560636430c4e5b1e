"""The training step measured whole, per input signature, under a byte budget.

A plan bounds the optimized module's forward and backward. Code outside the module holds
memory between the two: a loss computed on the module's outputs keeps their float copy, a
softmax and its gradient, tensors kept for logging. For a language model whose logits leave
the module that is several logits-sized tensors beside every activation the plan kept: a
Hugging Face GPT-2 (2 layers, 2000-word vocabulary) with its cross-entropy outside, at 0.6
of eager's peak, measured 1.24x its byte budget, with no warning.

So the second call of each input signature (the first runs the compile) is measured from the
start of its forward to the end of its backward (the gradient of its last parameter
accumulated: the backward of modules before it, optimized apart, is theirs). On CUDA the end
reads ``max_memory_allocated`` (its peak statistics are reset at the start; inside
:func:`checkmate.memory.measure_peak` too, whose tracker keeps the peak it saw before). On the CPU only
the allocator's events see every allocation, and they come from a profiler: one is started
at the forward, the end of the backward is marked in it, and it is stopped at the next
optimizer step or call of an optimized module, whichever comes first, or at exit. (It cannot
be stopped inside the backward: autograd restores the profiler state it captured when the
backward started.) A call of the same module before the backward of its earlier calls (two
views of a batch, a GAN's discriminator on real and fake data) is part of the step: the
window stays open through it, to the end of their one backward. Planning and
:func:`checkmate.memory.measure_peak` first abort any window still open
(:func:`abort_windows`): they must not run inside a profiler they did not start, and the
step is measured at a later call instead. Profilers do not nest: a step that starts inside
:func:`checkmate.memory.measure_peak` (a loop or benchmark measuring each step) is marked in
that tracker's profiler instead, from a mark at its start, and its figures are read from its
events when its block exits (the verdict then waits for them); a step whose backward ends
after the block is measured at a later call. Inside a profiler the user started
(``torch.profiler``), whose events only its owner reads, the step is not measured: with a
``schedule``, at a step outside its warmup and active steps. A step over the budget has the
module planned again with the excess as room (:mod:`checkmate.api`), and warns when that
does not fit either. A signature measured within the budget is measured again at its 64th,
128th and 256th calls, then every 256 (:func:`checkmate.measuring._due_again`): what runs outside
the module can grow after its first measure (an auxiliary loss switched on after a warm-up,
which ran a language model at 1.22x its budget from then on, unwarned, while each signature
was measured once).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from checkmate.memory import MemoryTracker, _allocator_peaks, running_tracker

__all__ = ["STEP_SLACK", "StepWindow", "abort_windows", "open_window", "users_profiler"]

#: a measured step within this factor of the budget counts as within it (allocator rounding)
STEP_SLACK = 1.02

#: the name of the profiler mark at the start of a step measured in a profiler that was running
#: already (:func:`checkmate.memory.measure_peak`'s)
_START = "checkmate::step_start"
#: the name of the profiler mark at the end of the measured backward
_END = "checkmate::step_end"
#: the end of a backward run again through the same forward's graph (``retain_graph=True``)
_END_AGAIN = "checkmate::step_end_again"
#: the names of the marks around the step's forward/backward boundary: where the module's
#: forward returned (its last call's) and where the backward reached its outputs
_FORWARD_END = "checkmate::forward_end"
_BACKWARD_START = "checkmate::backward_start"
#: the start of the name of the profiler event of ``torch.optim.Optimizer.zero_grad``, which
#: frees the gradients a loop frees between the forward and the backward (``model.zero_grad()``
#: records none: they are then taken as freed at the backward's start)
_ZERO_GRAD = "Optimizer.zero_grad#"


@dataclass(eq=False)  # identity: held in a weak set
class StepWindow:
    """One training step being measured, from its forward's start to its backward's end."""

    device: str
    thread: int = field(default_factory=threading.get_ident)
    #: the bytes of gradients the module's parameters held at the start (accumulated over
    #: earlier micro-batches): not in the peak measured, but held through the step
    grads_held: int = 0
    #: of those, the bytes the loop freed before the backward reached the module (the last
    #: step's gradients, ``optimizer.zero_grad()`` between the forward and the backward): on
    #: the CPU, whose profiler reports no size for freeing a block allocated before it started,
    #: taken off the step's running sum from the optimizer's zero_grad, else from the
    #: backward's start (set before that mark)
    released: int = 0
    profiler: torch.profiler.profile | None = None
    cuda_before: int = 0
    cuda_peak: int | None = None
    #: the bytes live beyond the start's from the forward's return to the backward reaching the
    #: module's outputs, where code outside the module (a loss on its outputs) runs: on the
    #: CPU their peak there, on CUDA those live as the backward reaches the outputs (the peak
    #: statistics are not reset mid-step: a user's own reading of them stays the step's);
    #: set by :meth:`close`, None where the marks are missing
    boundary: int | None = None
    #: on the CPU, the step's peak outside that span, where the module's forward or backward
    #: runs (None on CUDA, or where the marks are missing); set by :meth:`close`
    apart: int | None = None
    started_backward: bool = False
    #: how many backwards reached the module's outputs through the graph of the same forward
    #: (``retain_graph=True`` on all but the last): autograd held every value the forward
    #: saved through all but the last, where the plans free each at its last read
    backwards: int = 0
    ended: bool = False
    queued: bool = False
    aborted: bool = False
    handles: list[Any] = field(default_factory=list)
    #: the caller's tracker whose profiler records this step (a step inside
    #: :func:`checkmate.memory.measure_peak`: profilers do not nest), None where the window
    #: runs a profiler of its own; its figures come when the tracker's block exits
    host: MemoryTracker | None = None
    #: the suffix of this window's mark names, unique among the windows of one host's profiler
    tag: str = ""
    #: the peak measured in the host's profiler, set (with ``hosted``) when its block exits
    hosted_peak: int | None = None
    hosted: bool = False
    #: called when the host's block exits, for a window closed before that (:meth:`waiting`)
    then: Callable[[StepWindow], None] | None = None

    def _mark(self, name: str) -> None:
        with torch.profiler.record_function(name + self.tag):
            pass

    def mark_forward_end(self) -> None:
        """The module's forward has returned (the last call's, when called again before the
        backward: a later mark replaces an earlier one)."""
        if self.started_backward or self.ended or self.device == "cuda":
            return
        self._mark(_FORWARD_END)

    def mark_backward_start(self) -> None:
        """The backward has reached the module's outputs (from an autograd pre-hook)."""
        if self.started_backward or self.ended:
            return
        self.started_backward = True
        if self.device == "cuda":
            self.boundary = int(torch.cuda.memory_allocated()) - self.cuda_before
        else:
            self._mark(_BACKWARD_START)

    def mark_end(self) -> None:
        """The backward that reaches the module has ended (from an autograd callback)."""
        if self.ended:
            return
        self.ended = True
        if self.device == "cuda":
            torch.cuda.synchronize()
            self.cuda_peak = int(torch.cuda.max_memory_allocated()) - self.cuda_before
        else:
            self._mark(_END_AGAIN if self.retained else _END)

    @property
    def retained(self) -> bool:
        """Whether a backward ran again through the same forward's graph."""
        return self.backwards > 1

    def run_again(self, backwards: int) -> None:
        """The ``backwards``-th backward reached the module's outputs through the same
        forward's graph (``retain_graph=True`` on the ones before): the step is measured to
        its end too."""
        self.backwards = max(self.backwards, backwards)
        self.ended = self.queued = False

    def closable(self) -> bool:
        """False on a thread other than the one that started its profiler, which only that
        one can stop."""
        return self.profiler is None or threading.get_ident() == self.thread

    def abort(self) -> None:
        """Stop measuring, with no measurement (where :meth:`closable`; not once a host's
        profiler has measured it)."""
        if self.closable() and not self.hosted:
            self.aborted = True
            self.close()

    def waiting(self) -> bool:
        """Whether the step's figures come later, when the host's block exits: the window is
        closed by handing :attr:`then` the verdict to take, not by :meth:`close`."""
        return self.host is not None and not self.hosted and not self.aborted

    def detach(self) -> None:
        """Remove the hooks on the parameters (the window stays measured by its host)."""
        for handle in self.handles:  # hooks of a backward that did not reach every parameter
            handle.remove()
        self.handles = []

    def take(self, prof: torch.profiler.profile) -> None:
        """The host's block has exited: read this step's figures from its profiler (none
        where the backward had not ended: it runs after the host, unmeasured), then hand the
        window to :attr:`then` where it was closed meanwhile."""
        self.hosted = True
        _OPEN.discard(self)
        if self.ended and not self.aborted:
            self.hosted_peak, self.boundary, self.apart = self._peaks(prof)
        else:
            self.aborted = True
        if self.then is not None:
            then, self.then = self.then, None
            then(self)

    def _peaks(self, prof: torch.profiler.profile) -> tuple[int, int | None, int | None]:
        """The step's peak, its peak between the forward's return and the backward's start,
        and outside that span, from ``prof``'s events (the marks of this window)."""
        tag = self.tag
        peak, _, boundary, apart = _allocator_peaks(
            prof,
            until=(_END_AGAIN if self.retained else _END) + tag,
            between=(_FORWARD_END + tag, _BACKWARD_START + tag),
            released=(self.released, _ZERO_GRAD, _BACKWARD_START + tag),
            since=_START + tag if self.host is not None else None,
        )
        return peak, boundary, apart

    def close(self) -> int | None:
        """Stop measuring (:meth:`closable` first): the step's peak bytes beyond what was
        live at its start, or None when its backward did not end (a step whose output was
        dropped) or it was aborted."""
        assert self.closable()
        prof, self.profiler = self.profiler, None
        _OPEN.discard(self)
        self.detach()
        if self.device == "cuda":
            return None if self.aborted else self.cuda_peak
        if self.host is not None:
            self.aborted = self.aborted or not self.hosted  # closed before its host's block ended
            return None if self.aborted else self.hosted_peak
        if prof is None:
            return None
        prof.__exit__(None, None, None)
        if not self.ended or self.aborted:
            return None
        peak, self.boundary, self.apart = self._peaks(prof)
        return peak


#: the windows open in this process, held here until closed: a profiler dropped unstopped
#: (its module garbage-collected) stays enabled, and every later check would find it running
_OPEN: set[StepWindow] = set()
#: the suffixes of hosted windows' mark names
_TAGS = itertools.count()


def abort_windows() -> None:
    """Stop every open window without a measurement, to be taken again at a later step:
    planning, or a measurement of the caller's (``measure_peak``), is about to run, and it
    must not run inside a profiler it did not start (it would plan unchecked, or measure
    with the wrong method)."""
    for window in list(_OPEN):
        window.abort()


def users_profiler() -> bool:
    """Whether a profiler runs that the user started: neither a window's own nor a
    :class:`~checkmate.memory.MemoryTracker`'s (another optimized module's step being
    measured is no profiler of theirs)."""
    if not torch._C._autograd._profiler_enabled() or running_tracker() is not None:
        return False
    return not any(window.profiler is not None for window in _OPEN)


def open_window(device: torch.device) -> StepWindow | None:
    """Start measuring a step on ``device``; None where it cannot be or should not be (a
    profiler runs already that no :class:`~checkmate.memory.MemoryTracker` of this thread
    started: profilers do not nest, only their owner reads their events; on CUDA, one may be
    measuring the step with the peak statistics this would reset). Inside a tracker, a CPU
    step is marked in its profiler, and on CUDA the tracker keeps the peak it saw before the
    statistics are reset."""
    profiled = torch._C._autograd._profiler_enabled()
    host = running_tracker() if profiled else None
    if profiled and host is None:  # a profiler of the user's, whose events only they read
        return None
    if host is not None and device.type == "cpu":
        window = StepWindow("cpu", host=host, tag=f"#{next(_TAGS)}")
        window._mark(_START)
        host.ride(window.take)
        _OPEN.add(window)
        return window
    if device.type == "cuda":
        torch.cuda.synchronize()
        if host is not None:
            host.reset_cuda_peak()  # the tracker keeps the peak it saw before
        else:
            torch.cuda.reset_peak_memory_stats()
        window = StepWindow("cuda", cuda_before=int(torch.cuda.memory_allocated()))
        _OPEN.add(window)
        return window
    if device.type != "cpu":
        return None
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # before kineto starts: no start/stop lines
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    prof.__enter__()
    window = StepWindow("cpu", profiler=prof)
    _OPEN.add(window)
    return window
