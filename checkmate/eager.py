"""Real tensors at eager speed from inside a compile.

AOTAutograd calls its partition function (checkmate's planner) under its ``FakeTensorMode``
and with the Python dispatcher on. What the planner runs for real from there (timing ops,
measuring scratch space and memory bandwidth, collectives) must leave both: under the fake
mode an op "runs" on fake tensors in the ~0.2 ms of a fake dispatch whatever its size (a
268 MFLOP matrix product measured as long as a 4-element addition, and a copy of 64 MiB at
1.5 TB/s), and the dispatcher adds Python to every op.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["real_tensors"]


@contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made and ops run inside are real, dispatched as in eager mode, even when the
    caller is AOTAutograd's partitioner (a no-op elsewhere)."""
    with unset_fake_temporarily(), no_python_dispatcher():
        yield
