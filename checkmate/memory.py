"""Measured peak memory of a piece of code: what a budget is checked against.

The figure is the peak of bytes allocated while the code runs *beyond what was live before
it*: activations, temporaries, gradients, outputs. Memory that was live before (parameters,
inputs, optimizer state) is not counted.

- CPU (and any device without allocator statistics): a TorchDispatchMode sees the outputs of
  every aten op. A storage that is not the storage of one of the op's tensor arguments is
  new: its bytes are added, and a weakref finalizer on the storage subtracts them when the
  storage is freed. Views share their base's storage, so they are never counted twice.
  Not seen: scratch space an op frees before it returns, storages made without going
  through the dispatcher (``torch.tensor(data)``, ``torch.from_numpy``, Inductor-compiled
  kernels), and frees of storages that were live before (which can only lower the peak).
- CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the
  bytes allocated before; this is the caching allocator's own count (block-rounded).

``measure_peak`` picks CUDA's figure when CUDA memory was allocated during the call and the
dispatch-mode figure otherwise; ``MemoryTracker`` is the context-manager form.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["MemoryTracker", "measure_peak"]


class _StorageMode(TorchDispatchMode):
    """Counts the bytes of storages created by aten ops while the mode is active."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if outs:
            seen = {_storage_key(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in outs:
                key = _storage_key(t)
                if key is not None and key not in seen:
                    seen.add(key)
                    self.tracker._on_alloc(t)
        return out


def _storage_key(t: torch.Tensor) -> int | None:
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


class MemoryTracker:
    """Context manager measuring the peak bytes allocated inside the ``with`` block.

    Attributes (valid during and after the block):
        peak: the peak bytes beyond what was live at entry.
        current: bytes allocated in the block and still live (CPU tracking).
        device: ``"cuda"`` when the CUDA allocator's figure was used, else ``"cpu"``.

    Example:
        >>> with MemoryTracker() as t:  # doctest: +SKIP
        ...     loss = model(x).sum(); loss.backward()
        >>> t.peak  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.peak = 0
        self.current = 0
        self.device = "cpu"
        self._cpu_peak = 0
        self._live: dict[int, int] = {}
        self._lock = threading.RLock()  # a finalizer may run inside _on_alloc (GC)
        self._mode = _StorageMode(self)
        self._cuda_before: int | None = None
        self._cuda_seen = False

    def _on_alloc(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, nbytes = storage._cdata, storage.nbytes()
        if t.device.type == "cuda":
            self._cuda_seen = True
        with self._lock:
            if key in self._live:
                return
            self._live[key] = nbytes
            self.current += nbytes
            self._cpu_peak = max(self._cpu_peak, self.current)
            self.peak = max(self.peak, self._cpu_peak)
        # Storages keep their Python object alive while the C++ storage lives (PyObject
        # preservation), so this fires exactly when the memory is released.
        weakref.finalize(storage, self._on_free, key)

    def _on_free(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, None)
            if nbytes is not None:
                self.current -= nbytes

    def __enter__(self) -> MemoryTracker:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._cuda_before = torch.cuda.memory_allocated()
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._mode.__exit__(exc_type, exc, tb)
        if self._cuda_seen and torch.cuda.is_available():
            torch.cuda.synchronize()
            # None: CUDA was first used inside the block, so none of its memory was live before.
            before = self._cuda_before or 0
            self.peak = max(0, torch.cuda.max_memory_allocated() - before)
            self.device = "cuda"


def measure_peak(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated while ``fn()`` runs, beyond what was live before it.

    Counts activations, temporaries, gradients and outputs created by ``fn``; see the
    module docstring for how (a dispatch mode over storages on CPU, the allocator's
    statistics on CUDA) and what is not seen.

    Args:
        fn: the code to measure, e.g. one training step.

    Returns:
        The peak in bytes (>= 0).

    Example:
        >>> measure_peak(lambda: torch.empty(1024))  # doctest: +SKIP
        4096
    """
    with MemoryTracker() as tracker:
        fn()
    return tracker.peak
