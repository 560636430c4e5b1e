"""Op costs of the step Inductor compiles: a fused op costs the memory it moves.

Checkmate's MILP (Jain et al., MLSys 2020) charges each recomputation the op's cost
``C_i``. Measured eagerly, every aten op is a kernel launch plus its arithmetic. Under
Inductor that holds only for the ops it hands to a library kernel (matrix products,
convolutions, attention: ``extern_kernels`` in its generated code) or to an eager fallback.
Every other op (pointwise arithmetic, reductions, the pieces of LayerNorm, softmax and
dropout after Inductor's decompositions) is generated code, fused with its neighbours into
one loop nest: its time is the bytes it moves through memory, and a recomputation fused
into its consumer's kernel costs about as much again. PyTorch's own partitioner reasons
the same way (``torch/_functorch/partitioners.py`` recomputes "fusible" ops freely and
never matrix products); here the distinction sets the costs the solver weighs instead of a
rule.

The model, per node of the joint graph Inductor gives its partitioner:

- a library or fallback kernel: the measured (or device-profile) cost, unchanged;
- a generated op: ``(bytes written + bytes read by a reduction) / bandwidth``, with the
  device's memory bandwidth (measured once per device, or the profile's). Views cost 0.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx

from checkmate.flops import _FLOPS, flat_tensors, tensor_span_bytes
from checkmate.ops import is_view

__all__ = ["is_library_kernel", "fused_costs", "memory_bandwidth"]


def is_library_kernel(target: Any) -> bool:
    """True when Inductor runs ``target`` as a kernel of its own (a library call such as a
    matrix product or convolution, or an eager fallback), not as generated, fusible code."""
    heavy = _FLOPS.get(target)
    if heavy is not None and heavy[1]:
        return True
    from torch._inductor import lowering

    if target in lowering.fallbacks:
        return True
    packet = getattr(target, "overloadpacket", None)
    return target not in lowering.lowerings and packet not in lowering.lowerings


def _traffic(node: fx.Node) -> int:
    """Bytes a generated op moves: its outputs, plus its largest input when it reduces."""
    outs = flat_tensors(node.meta.get("val"))
    written = sum(tensor_span_bytes(t) for t in outs)
    largest_in = max(
        (tensor_span_bytes(t) for a in node.all_input_nodes for t in flat_tensors(a.meta.get("val"))),
        default=0,
    )
    out_numel = sum(t.numel() for t in outs)
    in_numel = max(
        (t.numel() for a in node.all_input_nodes for t in flat_tensors(a.meta.get("val"))), default=0
    )
    return written + (largest_in if in_numel > out_numel else 0)


def fused_costs(nodes: Sequence[fx.Node], costs: Sequence[float], bandwidth: float) -> list[float]:
    """The costs of ``nodes`` in the step Inductor compiles.

    Args:
        nodes: joint-graph nodes (``call_function`` nodes carry ``meta['val']``).
        costs: their costs as eager ops (measured or from a device profile), in order.
        bandwidth: device memory bytes/s.

    Returns:
        One cost per node: unchanged for library kernels, memory traffic for generated ops.
    """
    out: list[float] = []
    for node, cost in zip(nodes, costs, strict=True):
        if node.op != "call_function" or cost == 0.0 or is_view(node.target):
            out.append(cost)
        elif is_library_kernel(node.target):
            out.append(cost)
        else:
            out.append(min(cost, _traffic(node) / bandwidth))
    return out


@functools.cache
def _measured_bandwidth(device: str) -> float:
    dev = torch.device(device)
    n = (64 << 20) // 4  # 64 MiB of float32: well past the caches
    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        dst.copy_(src)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / max(statistics.median(times[2:]), 1e-9)  # read + write


def memory_bandwidth(profile: str | None, device: torch.device | str) -> float:
    """Memory bytes/s of the device: the profile's, or measured once per process (a copy of
    64 MiB, read and write counted) when planning with measured costs."""
    if profile is not None:
        from checkmate.profile import load_profile

        return float(load_profile(profile).memory_bandwidth)
    return _measured_bandwidth(str(device))
