"""Scratch space: the bytes an op allocates and frees while it runs, beyond its outputs.

Measured once per op signature and device by running the op on random inputs of its
traced shapes under :func:`checkmate.memory.measure_peak` (random and mutating ops: 0, they
must not run outside the step). Measurements persist like op times
(:mod:`checkmate.devcache`), in ``<cache dir>/scratch/<device tag>.json``;
:func:`flush_scratch` writes the new ones. Sizes are rounded, so that allocator noise
cannot change the graph (and with it the plan-cache key) from one process to the next.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from checkmate.devcache import DeviceTable
from checkmate.ops import is_mutation, is_random
from checkmate.timing import ProfileWarning, device_tag

__all__ = ["SCRATCH", "scratch_bytes", "flush_scratch"]

#: scratch below this many bytes is ignored (scalars wrapped into tensors, tiny reductions)
_SCRATCH_MIN = 4096
#: measured scratch is rounded up to this many bytes
_SCRATCH_ROUND = 4096

#: scratch bytes per op key, per device
SCRATCH = DeviceTable("scratch", "checkmate-scratch", 1, int, "scratch-space cache", ProfileWarning)
_TAGS: dict[str, str] = {}


def scratch_bytes(node: fx.Node) -> int:
    """Scratch bytes ``node`` allocates beyond its outputs (see the module docstring);
    measured on first sight of its signature on its device, from the cache after."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or is_mutation(target) or is_random(target):
        return 0
    vals = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    key = repr((node.target, torch.utils._pytree.tree_map(_describe, vals)))
    tag = _tag(vals)
    table = SCRATCH.table(tag)
    if key not in table:
        with unset_fake_temporarily():  # the partitioner runs under AOTAutograd's fake mode
            SCRATCH.add(tag, key, measure_scratch(node, vals))
    return table[key]


def flush_scratch() -> None:
    """Write the measurements made since the last flush to the cache dir."""
    SCRATCH.flush()


def _tag(vals: object) -> str:
    """The device tag of the first tensor in ``vals`` (cpu when there is none)."""
    devices = [x.device for x in torch.utils._pytree.tree_leaves(vals) if isinstance(x, torch.Tensor)]
    dev = str(devices[0]) if devices else "cpu"
    tag = _TAGS.get(dev)
    if tag is None:  # device_tag reads /proc/cpuinfo: once per device, not once per op
        tag = _TAGS[dev] = device_tag(dev)
    return tag


def measure_scratch(node: fx.Node, vals: object) -> int:
    """Run ``node``'s op once on random inputs shaped like ``vals`` (its traced args and
    kwargs): the bytes its peak exceeds its outputs by, rounded; 0 below ``_SCRATCH_MIN``."""
    from checkmate.memory import measure_peak

    def real(x: object) -> object:
        if isinstance(x, torch.Tensor):
            if x.dtype.is_floating_point:
                return torch.randn(x.shape, dtype=x.dtype, device=x.device)
            return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
        return x

    args, kwargs = torch.utils._pytree.tree_map(real, vals)
    out: list[object] = [None]

    def run() -> None:
        out[0] = node.target(*args, **kwargs)  # type: ignore[operator]

    peak = measure_peak(run)
    produced = sum(
        t.untyped_storage().nbytes()
        for t in torch.utils._pytree.tree_leaves(out[0])
        if isinstance(t, torch.Tensor)
    )
    extra = int(peak) - int(produced)
    if extra < _SCRATCH_MIN:
        return 0
    return -(-extra // _SCRATCH_ROUND) * _SCRATCH_ROUND


def _describe(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype), str(x.device))
    return x
