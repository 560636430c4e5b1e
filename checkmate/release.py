"""What Dynamo keeps of an optimized module's compiles, released when the module is gone.

Dynamo keeps what it compiled until ``torch._dynamo.reset()``, which drops every other
compile of the process too: each cache entry holds the backend it was compiled with (its
code object's entries outlive the function, their transformed code being referenced from
Dynamo's own maps), the transformed code keeps the compiled graph's function as a global
(``__compiled_fn_<n>_<uuid>``), and ``torch._dynamo.eval_frame.cached_backends`` keeps every
backend. Through them an optimized module that was deleted kept its planner alive, with
every plan record, graph and generated module: a sweep optimizing a two-layer transformer
per trial in one process grew by 9.6 MiB of host memory and 10,700 objects per trial.

:func:`release_compiled` runs when the module's state is collected
(:func:`checkmate.api.optimize` registers it). It invalidates the cache entries of the
module's own ``isolate_recompiles`` regions compiled with its planner's backends, as Dynamo
does for an entry whose guarded object was deallocated (the global then goes with the
transformed code), and drops the backends from ``cached_backends``: no memory and about 650
objects per trial remain. Dynamo's internals move between releases: where one is not found, that part
is skipped and the module's compiles stay until ``torch._dynamo.reset()``, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["release_compiled"]

log = logging.getLogger(__name__)


def release_compiled(regions: Sequence[int], backends: Sequence[Callable[..., Any]]) -> None:
    """Invalidate the cache entries of the ``isolate_recompiles`` ``regions`` compiled with
    one of ``backends`` (the torch.compile backends a planner made), and drop ``backends``
    from Dynamo's ``cached_backends``. Only those: another compile's entries and backends are
    never touched."""
    if not backends:
        return
    try:
        from torch._dynamo import convert_frame, eval_frame
        from torch._dynamo.guards import DeletedGuardManagerWrapper
    except ImportError:  # another torch's layout: kept until torch._dynamo.reset()
        return
    try:
        for region in regions:
            _invalidate(region, backends, convert_frame, eval_frame, DeletedGuardManagerWrapper)
    except Exception as exc:  # a finalizer must not raise: Dynamo's internals moved
        log.debug("checkmate: Dynamo's cache entries of a deleted module kept (%s)", exc)
    cached = getattr(eval_frame, "cached_backends", None)
    if isinstance(cached, dict):
        for key, backend in list(cached.items()):
            if _ours(backend, backends):
                cached.pop(key, None)


def _invalidate(
    region: int, backends: Sequence[Callable[..., Any]], convert_frame: Any, eval_frame: Any, deleted: Any
) -> None:
    """Invalidate region ``region``'s cache entries compiled with ``backends``, in every code
    object Dynamo compiled."""
    if region < 0:  # no region of its own (a torch without isolate_recompiles): shared entries
        return
    for ref in list(convert_frame.input_codes.seen):
        code = ref()
        if code is None:
            continue
        for entry in eval_frame._get_cache_entries_for_region(code, region):
            if not _ours(entry.backend, backends):
                continue
            manager = entry.guard_manager
            state, own = getattr(manager, "extra_state", None), getattr(manager, "cache_entry", None)
            if state is not None and own is not None:
                state.invalidate(own, deleted("the optimized module was deleted"))


def _ours(backend: object, backends: Sequence[Callable[..., Any]]) -> bool:
    """Whether ``backend`` (as Dynamo keeps it: maybe wrapped) is one of ``backends``."""
    inner = getattr(backend, "compiler_fn", backend)
    return any(inner is own or backend is own for own in backends)
