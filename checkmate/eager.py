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

import torch
from torch._dispatch.python import no_python_dispatcher
from torch._subclasses.fake_tensor import unset_fake_temporarily

__all__ = ["real_tensors", "real_like"]


@contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made and ops run inside are real, dispatched as in eager mode, even when the
    caller is AOTAutograd's partitioner (a no-op elsewhere)."""
    with unset_fake_temporarily(), no_python_dispatcher():
        yield


def real_like(value: torch.Tensor, *, channels_last: bool = False) -> torch.Tensor:
    """A real tensor laid out as the traced ``value`` is: its shape, dtype, device and
    strides, over the least storage they span (an expanded value spans one row), random for
    floating dtypes and zeros otherwise. The strides matter to what an op allocates: a CPU
    matrix product copies an operand with no unit stride (a 512x512 slice of every other
    column took 1 MiB beside its output; contiguous, none). ``channels_last``: a 4-D tensor
    contiguous in that memory format instead of the traced strides. Call it under
    :func:`real_tensors` when planning."""
    shape = tuple(int(s) for s in value.shape)
    if channels_last:
        base = torch.empty(shape, dtype=value.dtype, device=value.device, memory_format=torch.channels_last)
        return base.normal_() if value.dtype.is_floating_point else base.zero_()
    stride = tuple(int(s) for s in value.stride())
    span = 0 if value.numel() == 0 else 1 + sum((n - 1) * abs(st) for n, st in zip(shape, stride))
    if value.dtype.is_floating_point:
        flat = torch.randn(span, dtype=value.dtype, device=value.device)
    else:
        flat = torch.zeros(span, dtype=value.dtype, device=value.device)
    return flat.as_strided(shape, stride)
