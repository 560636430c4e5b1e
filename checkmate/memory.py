"""Measured peak memory of a piece of code: what a budget is checked against.

The figure is the peak of bytes allocated while the code runs *beyond what was live before
it*: activations, temporaries, gradients, outputs. Memory live before (parameters, inputs,
optimizer state) is not counted, and on CPU neither is its release: a free counts only for
a block allocated during the run, so a garbage collection that happens to run inside the
window cannot hide what the code held. (On CUDA, the allocator's own figures, freeing old
memory lowers the count.)

Methods (``MemoryTracker(method=...)``):

- ``"allocator"`` (the default on CPU): the PyTorch profiler with ``profile_memory=True``
  reports every allocation and free of the CPU allocator, in time order; the peak is the
  maximum of their running sum, a free counted when its block was allocated in the run. Exact to the byte, and it sees everything: scratch space
  inside ops, ``torch.tensor(data)``, code compiled by ``torch.compile``. The profiler's
  first use in a process takes a second or two; it cannot be nested inside another running
  profiler (``"auto"`` then falls back to ``"storages"``). A training step of an optimized
  module that checkmate measures whole (:mod:`checkmate.stepcheck`) inside the block is
  marked in this profiler, and read from its events when the block exits. To keep each measurement from
  printing kineto's start/stop lines, ``KINETO_LOG_LEVEL`` is set to 6 unless already set.
- ``"storages"``: a TorchDispatchMode sees the outputs of every aten op. A storage that is
  not the storage of one of the op's tensor arguments is new: its bytes are added, and a
  weakref finalizer on the storage subtracts them when it is freed. Views share their base's
  storage, so they are never counted twice. Not seen: scratch space an op frees before it
  returns, storages made outside the dispatcher (``torch.tensor(data)``, Inductor kernels),
  frees of memory live before, Inductor's generated kernels. The mode declares
  ``ignore_compile_internals()``, so ``torch.compile``d code runs compiled under it (not
  eagerly) and compilation itself is not counted.
- CUDA, whichever method: when CUDA memory was allocated during the run, the figure is
  ``torch.cuda.max_memory_allocated()`` after ``reset_peak_memory_stats()``, minus the bytes
  allocated before (the caching allocator's own count, rounded to its 512-byte blocks).

``measure_peak(fn)`` is the one-call form.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal

import torch
from torch._C._profiler import _ExtraFields_Allocation
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "Method", "measure_peak"]

Method = Literal["auto", "allocator", "storages"]


class MemoryTracker:
    """Context manager measuring the peak bytes allocated inside the ``with`` block.

    Args:
        method: ``"allocator"``, ``"storages"`` or ``"auto"`` (the allocator unless a profiler
            is already running); see the module docstring.

    Attributes (set when the block exits):
        peak: the peak bytes allocated beyond what was live at entry (>= 0).
        current: bytes allocated in the block and still live at its end (on CUDA, net of
            memory from before that the block freed, so possibly negative).
        device: ``"cuda"`` when the CUDA allocator's figures were used, else ``"cpu"``.
        method: the method used (``"allocator"`` or ``"storages"``).

    Example:
        >>> with MemoryTracker() as t:  # doctest: +SKIP
        ...     model(x).sum().backward()
        >>> t.peak  # doctest: +SKIP
    """

    def __init__(self, method: Method = "auto") -> None:
        if method not in ("auto", "allocator", "storages"):
            raise ValueError(f"method must be 'auto', 'allocator' or 'storages', got {method!r}")
        self.requested: Method = method
        self.method: Method = method
        self.peak = 0
        self.current = 0
        self.device = "cpu"
        self._cuda_before: int | None = None
        self._profiler: torch.profiler.profile | None = None
        self._storages: _StorageCounter | None = None
        self._thread = threading.get_ident()
        self._riders: list[Callable[[torch.profiler.profile], None]] = []
        self._cuda_high = 0  # the CUDA peak statistic before a reset inside the block

    def __enter__(self) -> MemoryTracker:
        from checkmate.stepcheck import abort_windows

        abort_windows()  # a training step checkmate was measuring: this measurement comes first
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_before = torch.cuda.memory_allocated()
        if self.requested == "auto":
            self.method = "storages" if torch._C._autograd._profiler_enabled() else "allocator"
        if self.method == "allocator":
            # Set before kineto initializes (its first use), else every start/stop is logged.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
            self._profiler = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            self._profiler.__enter__()
            self._thread = threading.get_ident()
            _HOSTS.append(self)
        else:
            self._storages = _StorageCounter()
            self._storages.mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        riders: list[Callable[[torch.profiler.profile], None]] = []
        prof = self._profiler
        if prof is not None:
            self._profiler = None
            if self in _HOSTS:
                _HOSTS.remove(self)
            prof.__exit__(exc_type, exc, tb)
            self.peak, self.current = _allocator_peak(prof)
            riders, self._riders = self._riders, []
        elif self._storages is not None:
            self._storages.mode.__exit__(exc_type, exc, tb)
            self.peak, self.current = self._storages.peak, self._storages.current
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            # None: CUDA was first used inside the block, so none of its memory was live before.
            before = self._cuda_before or 0
            cuda_peak = max(torch.cuda.max_memory_allocated(), self._cuda_high) - before
            if cuda_peak > 0:
                self.peak = cuda_peak
                self.current = torch.cuda.memory_allocated() - before
                self.device = "cuda"
        failed: list[Exception] = []
        for rider in riders:  # after this tracker's own figures: a step measured inside it
            assert prof is not None  # riders ride an allocator tracker only
            try:
                rider(prof)  # its verdict may warn (an error under -W error)
            except Exception as error:  # every rider runs: each one's step waits for its figures
                failed.append(error)
        if failed and exc_type is None:  # not in place of the block's own exception
            raise failed[0]

    def reset_cuda_peak(self) -> None:
        """Reset CUDA's peak statistic inside the block (a training step measured whole
        inside it, on CUDA), keeping the peak seen so far for this tracker's own figure."""
        self._cuda_high = max(self._cuda_high, int(torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()

    def ride(self, rider: Callable[[torch.profiler.profile], None]) -> None:
        """Have ``rider(profiler)`` called when the block exits, with the stopped profiler
        whose events cover it: the training step checkmate measures whole
        (:mod:`checkmate.stepcheck`) inside this block reads its figures from them, since a
        second profiler cannot start inside this one."""
        self._riders.append(rider)


#: the trackers measuring by the allocator whose profiler runs, innermost last
_HOSTS: list[MemoryTracker] = []


def running_tracker() -> MemoryTracker | None:
    """The :class:`MemoryTracker` whose profiler is the one running on this thread (a
    training step inside :func:`measure_peak`), or None (no profiler runs, or one that no
    tracker started: the user's ``torch.profiler``, whose events only its owner reads)."""
    if not _HOSTS or not torch._C._autograd._profiler_enabled():
        return None
    host = _HOSTS[-1]
    return host if host._thread == threading.get_ident() else None


def _allocator_peak(prof: torch.profiler.profile, until: str | None = None) -> tuple[int, int]:
    """(peak, final) running sum of the CPU allocator's events the profiler recorded; with
    ``until``, of those before the first event of that name (a ``record_function`` mark).

    A free counts only when its block was allocated inside the session. The CPU allocator
    reports the free of any block it saw allocated while *some* profiler ran, earlier
    sessions included, so a garbage collection during the run that frees tensors from an
    earlier measurement would otherwise lower the count below what the code itself held
    (a CI run measured a step at a third of its true peak that way).
    """
    peak, final, _, _ = _allocator_peaks(prof, until)
    return peak, final


def _allocator_peaks(
    prof: torch.profiler.profile,
    until: str | None = None,
    between: tuple[str, str] | None = None,
    released: tuple[int, str, str] | None = None,
    since: str | None = None,
) -> tuple[int, int, int | None, int | None]:
    """:func:`_allocator_peak`; with ``between``, the peak of the running sum over the span
    from the last mark named ``between[0]`` before the first named ``between[1]`` to that
    one (counting what was live when it opened), and its peak outside that span (both None
    where either mark is missing). ``released``: bytes allocated before the profiler started
    and freed (the profiler reports no size for such a free), the name prefix of the event
    that frees them, and the mark by which they were freed at the latest: taken off the
    running sum from the first of those. ``since``: a mark from which to count, as if the
    profiler had started there (what was allocated before it is not counted, nor its free;
    nothing is counted where the mark is missing)."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    if results is None:
        return 0, 0, None, None
    events: list[tuple[int, int, int, int]] = []  # (time, order, ptr, bytes), CPU only
    marks: dict[str, list[int]] = {}
    names = {until, since, *(between or ()), released[2] if released else None} - {None}
    frees: list[int] = []  # when an event that frees the bytes released started
    stack = list(reversed(results.experimental_event_tree()))
    while stack:  # depth first, in the recorded order
        e = stack.pop()
        stack.extend(reversed(e.children))
        if e.name in names:
            marks.setdefault(e.name, []).append(e.start_time_ns)
        elif released and e.name.startswith(released[1]):
            frees.append(e.start_time_ns)
        fields = e.extra_fields
        if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu" and fields.alloc_size:
            events.append((e.start_time_ns, len(events), fields.ptr, fields.alloc_size))
    events.sort()
    if since is not None:
        if since not in marks:
            return 0, 0, None, None
        start = min(marks[since])
        events = [ev for ev in events if ev[0] >= start]
        frees = [t for t in frees if t >= start]
        marks = {name: [t for t in times if t >= start] for name, times in marks.items()}
        marks = {name: times for name, times in marks.items() if times}
    if until is not None and until in marks:
        end = min(marks[until])
        events = [ev for ev in events if ev[0] <= end]
    span: tuple[int, int] | None = None
    if between is not None and between[1] in marks:
        stop = min(marks[between[1]])
        starts = [t for t in marks.get(between[0], ()) if t <= stop]
        span = (max(starts), stop) if starts else None
    dropped, times = (released[0], frees + marks.get(released[2], [])) if released else (0, [])
    release = min(times) if dropped and times else None
    live: dict[int, int] = {}
    current = peak = apart = 0
    inside: int | None = None
    for at, _, ptr, nbytes in events:
        if release is not None and at >= release:
            current, release = current - dropped, None
        if span is not None and inside is None and at >= span[0]:
            inside = current  # live when the span opens
        if nbytes > 0:
            live[ptr] = live.get(ptr, 0) + nbytes
            current += nbytes
            peak = max(peak, current)
        elif ptr in live:
            current -= live.pop(ptr)
        if span is not None and span[0] <= at <= span[1]:
            inside = max(inside or 0, current)
        else:
            apart = max(apart, current)
    if span is None:
        return peak, current, None, None
    return peak, current, current if inside is None else inside, apart


class _StorageCounter:
    """Bytes of the storages created by aten ops while ``mode`` is active, and their peak."""

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self._live: dict[int, int] = {}
        self._lock = threading.RLock()  # a finalizer may run inside on_alloc (GC)
        self.mode = _StorageMode(self)

    def on_alloc(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = int(storage._cdata), storage.nbytes()
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        # Storages keep their Python object alive while the C++ storage lives (PyObject
        # preservation), so this fires exactly when the memory is released.
        weakref.finalize(storage, self._on_free, key)

    def _on_free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is not None:
                self.current -= nbytes


class _StorageMode(TorchDispatchMode):
    """Reports the new storages among each aten op's outputs to a _StorageCounter."""

    def __init__(self, counter: _StorageCounter) -> None:
        super().__init__()
        self.counter = counter

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this, Dynamo skips every frame while the mode is active and runs the
        # model eagerly (and keeps doing so afterwards): the step measured would not be the
        # compiled one. With it, compilation runs outside the mode and the compiled graph's
        # aten ops are still dispatched to it when they run.
        return True

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs:
            seen = {storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in outs:
                key = storage_key(t)
                if key is not None and key not in seen:
                    seen.add(key)
                    self.counter.on_alloc(t)
        return out


def storage_key(t: torch.Tensor) -> int | None:
    """Identity of the storage behind ``t`` (None for tensors without real storage)."""
    if t.device.type == "meta":
        return None
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):  # subclasses without a storage
        return None
    if storage.device.type == "meta" or storage.nbytes() == 0:  # fake tensors, empty tensors
        return None
    return int(storage._cdata)


def measure_peak(fn: Callable[[], Any], *, method: Method = "auto") -> int:
    """Peak bytes allocated while ``fn()`` runs, beyond what was live before it.

    Counts activations, temporaries, gradients and outputs created by ``fn``; see the
    module docstring for how (the CPU allocator's events, or a dispatch mode over storages;
    the allocator's statistics on CUDA).

    Args:
        fn: the code to measure, e.g. one training step.
        method: ``"auto"``, ``"allocator"`` or ``"storages"`` (see :class:`MemoryTracker`).

    Returns:
        The peak in bytes (>= 0).

    Example:
        >>> measure_peak(lambda: torch.empty(1024))  # doctest: +SKIP
        4096
    """
    with MemoryTracker(method) as tracker:
        fn()
    return tracker.peak
