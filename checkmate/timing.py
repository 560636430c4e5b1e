"""Measured per-op runtimes: run each op of a traced graph on the device and time it.

Inputs are materialized from the FakeTensor metadata with the recorded shapes, strides and
dtypes: floating tensors are views of one buffer of uniform values in [0.5, 1.5) (no NaN or
Inf from log/sqrt/division, which could hit slow paths), integer and bool tensors are zeros
(so that indices stay valid). Ops that write to an input get their own copies.

Timing: on CPU, ``time.perf_counter`` around batches of calls (batches of ~0.2 ms, so that
microsecond ops are not drowned in timer noise), two warm-up calls, the median of a few
batches; ops slower than 20 ms are timed once after the warm-up call. On CUDA the same with CUDA
events. The global RNG state is restored afterwards, so profiling does not change the
random numbers a model draws later.

Times are cached by op signature (:func:`op_signature`) per device (:func:`device_tag`):
in memory, and in ``<cache dir>/op_times/<tag>.json`` (cache dir: ``$CHECKMATE_CACHE_DIR``,
else ``$XDG_CACHE_HOME/checkmate``, else ``~/.cache/checkmate``; ``CHECKMATE_CACHE=0``
keeps them in memory only). An op that cannot be run (an unsupported construct) gets the
roofline estimate of the shipped profile for its device kind, with a ProfileWarning.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx

from checkmate.devcache import DeviceTable
from checkmate.eager import real_tensors
from checkmate.flops import flat_tensors
from checkmate.ops import host_placed, is_mutation, is_view

__all__ = [
    "ProfileWarning",
    "device_tag",
    "is_free",
    "measure_costs",
    "measure_ops",
    "op_signature",
    "time_callable",
]

_BATCH_SECONDS = 2e-4
_SLOW_SECONDS = 2e-2
_REPEATS = 5


class ProfileWarning(UserWarning):
    """Some ops could not be measured (estimated instead) or the time cache was unusable."""


#: measured seconds per op signature, per device (see :mod:`checkmate.devcache`)
OP_TIMES = DeviceTable("op_times", "checkmate-op-times", 2, float, "op-time cache", ProfileWarning)


# --- which nodes cost nothing ----------------------------------------------------------


_FREE_TARGETS = {operator.getitem, torch.ops.aten._unsafe_view.default}


def is_free(node: torch.fx.Node) -> bool:
    """True for nodes that do no work: placeholders, outputs, constants, ``getitem``,
    views (ops whose outputs alias an input without writing), and ops on sizes only."""
    if node.op in ("placeholder", "output", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in _FREE_TARGETS or is_view(target):
        return True
    if not isinstance(target, torch._ops.OpOverload | torch._ops.HigherOrderOperator):
        return True  # python builtins on SymInts (operator.mul, ...)
    val = node.meta.get("val")
    return val is not None and not flat_tensors(val)


# --- signatures ------------------------------------------------------------------------


def _get_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj


def _fmt(value: Any) -> str:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if val is not None:
            return _fmt(val)
        if value.op == "get_attr" and value.graph.owning_module is not None:
            attr = _get_attr(value.graph.owning_module, str(value.target))
            if isinstance(attr, torch.fx.GraphModule):
                # Subgraphs of higher-order ops: same name in two graphs need not mean same code.
                return "graph:" + hashlib.sha256(attr.code.encode()).hexdigest()[:12]
            return _fmt(attr)
        return f"%{value.name}"
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        shape = ",".join(str(int(s)) for s in value.shape)
        text = f"{dtype}[{shape}]"
        if value.numel() > 1 and not value.is_contiguous():
            text += "{" + ",".join(str(int(s)) for s in value.stride()) + "}"
        return text
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, torch.device):
        return "device"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return str(value)
    return repr(value)


def op_signature(node: torch.fx.Node) -> str:
    """The op and its arguments, device-independent: the key of measured op times.

    Example: ``aten.mm.default(float32[64,128], float32[128,256]{1,128})`` (strides are
    shown for non-contiguous tensors only).
    """
    parts = [_fmt(a) for a in node.args]
    parts += [f"{k}={_fmt(v)}" for k, v in node.kwargs.items()]
    return f"{node.target}({', '.join(parts)})"


def device_tag(device: torch.device | str) -> str:
    """Identifies what a measured time depends on: device model (on the CPU with its feature
    flags), threads, torch version."""
    dev = torch.device(device)
    if dev.type == "cuda":
        desc = f"cuda:{torch.cuda.get_device_name(dev)}:cuda{torch.version.cuda}"
    else:
        desc = f"{dev.type}:{_this_cpu()}:{os.cpu_count()}cpus:{torch.get_num_threads()}threads"
    desc += f":torch{torch.__version__}"
    return hashlib.sha256(desc.encode()).hexdigest()[:16] + "-" + dev.type


@functools.cache
def _this_cpu() -> str:
    """:func:`_cpu_model` of this machine's ``/proc/cpuinfo`` (read once per process)."""
    try:
        return _cpu_model(Path("/proc/cpuinfo").read_text())
    except OSError:
        return _cpu_model("")


def _cpu_model(cpuinfo: str) -> str:
    """The CPU's model name and a digest of its feature flags, from ``cpuinfo`` (the text of
    ``/proc/cpuinfo``; without a model name, the platform's).

    One name can cover CPUs that run other kernels: "AMD EPYC" can name machines with and
    without ``avx512_bf16``, on which oneDNN's bfloat16 convolutions take other times and
    other scratch. A cache folder shared between such machines (a cluster's home directory)
    must keep their measurements apart.
    """
    model = flags = ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = " ".join(sorted(value.split()))
    model = model or platform.processor() or platform.machine()
    return f"{model}:{hashlib.sha256(flags.encode()).hexdigest()[:12]}" if flags else model


# --- materializing inputs --------------------------------------------------------------


class _Pool:
    """One flat buffer per (dtype, device), grown on demand; inputs are strided views of it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def buffer(self, dtype: torch.dtype, numel: int, device: torch.device | None = None) -> torch.Tensor:
        dev = device or self.device
        buf = self.buffers.get((dtype, dev))
        if buf is None or buf.numel() < numel:
            size = max(numel, 2 * buf.numel() if buf is not None else 0)
            if dtype.is_floating_point or dtype.is_complex:
                buf = torch.rand(size, dtype=dtype, device=dev).add_(0.5)
            else:
                buf = torch.zeros(size, dtype=dtype, device=dev)
            self.buffers[(dtype, dev)] = buf
        return buf

    def tensor(self, fake: torch.Tensor, own: bool, *, keep_cpu: bool = False) -> torch.Tensor:
        """A tensor like ``fake`` on the pool's device; ``keep_cpu``: on the CPU where
        ``fake`` is (see :func:`_measure_node`)."""
        dev = fake.device if keep_cpu and fake.device.type == "cpu" else self.device
        shape = [int(s) for s in fake.shape]
        stride = [int(s) for s in fake.stride()]
        if fake.numel() == 0:
            return torch.empty_strided(shape, stride, dtype=fake.dtype, device=dev)
        span = 1 + sum((s - 1) * abs(st) for s, st in zip(shape, stride))
        view = self.buffer(fake.dtype, span, dev).as_strided(shape, stride, 0)
        return view.clone() if own else view


def _materialize(value: Any, gm: torch.fx.GraphModule, pool: _Pool, own: bool, keep_cpu: bool = False) -> Any:
    if isinstance(value, torch.fx.Node):
        if value.op == "get_attr":
            obj = _get_attr(gm, str(value.target))
            if not isinstance(obj, torch.Tensor) or (keep_cpu and obj.device.type == "cpu"):
                return obj
            return obj.to(pool.device)
        val = value.meta.get("val")
        if val is None:
            raise LookupError(f"node {value.name} has no meta['val']")
        return _materialize(val, gm, pool, own, keep_cpu)
    if isinstance(value, torch.Tensor):
        return pool.tensor(value, own, keep_cpu=keep_cpu)
    if isinstance(value, list | tuple):
        return type(value)(_materialize(v, gm, pool, own, keep_cpu) for v in value)
    if isinstance(value, torch.device):
        return pool.device
    if isinstance(value, torch.SymInt):
        return int(value)
    if isinstance(value, torch.SymFloat):
        return float(value)
    return value


# --- timing ----------------------------------------------------------------------------


def time_callable(fn: Callable[[], Any], device: torch.device | str) -> float:
    """Median seconds one call of ``fn`` takes on ``device`` (warm-up included, not counted).

    Args:
        fn: runs the op once.
        device: where ``fn`` runs; CUDA devices are timed with CUDA events.
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        return _time_cuda(fn, dev)
    fn()
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    if once > _SLOW_SECONDS:  # long enough to time once: repeats would cost seconds per op
        return once
    inner = max(1, min(200, int(_BATCH_SECONDS / max(once, 1e-7))))
    repeats = _REPEATS if once < _SLOW_SECONDS / 4 else 3
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _time_cuda(fn: Callable[[], Any], dev: torch.device) -> float:
    with torch.cuda.device(dev):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        once = start.elapsed_time(end) / 1e3
        if once > _SLOW_SECONDS:
            return once
        inner = max(1, min(200, int(_BATCH_SECONDS / max(once, 1e-7))))
        samples = []
        for _ in range(_REPEATS):
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        return statistics.median(samples)


# --- measuring a graph -----------------------------------------------------------------


def measure_costs(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    *,
    device: torch.device | str,
) -> list[float]:
    """Run and time each node's op on ``device``; seconds per node (0.0 for free nodes).

    Each distinct op signature is timed once; times are cached in memory and on disk (see
    the module docstring). Ops that fail to run are estimated with the shipped profile of
    the device kind and reported in one ProfileWarning.

    Args:
        gm: the graph module the nodes belong to (for ``get_attr`` constants).
        nodes: fx nodes of a functionalized aten graph with ``meta['val']``.
        device: the device to measure on.

    Returns:
        One cost per node, in order.
    """
    dev = torch.device(device)
    table = measure_ops(gm, nodes, device=dev)
    costs = []
    for node in nodes:
        if is_free(node):
            costs.append(0.0)
            continue
        sig = op_signature(node)
        costs.append(table[sig] if sig in table else _fallback_estimate(node, dev))
    return costs


def measure_ops(
    gm: torch.fx.GraphModule,
    nodes: Sequence[torch.fx.Node],
    *,
    device: torch.device | str,
) -> dict[str, float]:
    """Measured seconds per op signature of the nodes that do work (the ``ops`` table format).

    Args:
        gm: the graph module the nodes belong to (for ``get_attr`` constants).
        nodes: fx nodes of a functionalized aten graph with ``meta['val']``.
        device: the device to measure on.

    Returns:
        ``{op_signature(node): seconds}`` for every non-free node whose op could be run;
        the others are left out and named in one ProfileWarning.
    """
    dev = torch.device(device)
    tag = device_tag(dev)
    known = OP_TIMES.table(tag)
    table: dict[str, float] = {}
    failed: dict[str, str] = {}
    pool = _Pool(dev)
    rng_devices = [dev] if dev.type == "cuda" else []
    # real tensors: AOTAutograd calls the planner under its fake mode (checkmate.eager)
    with real_tensors(), torch.random.fork_rng(devices=rng_devices), torch.no_grad():
        for node in nodes:
            if is_free(node):
                continue
            sig = op_signature(node)
            if sig in table or sig in failed:
                continue
            seconds = known.get(sig)
            if seconds is None:
                try:
                    seconds = _measure_node(gm, node, pool)
                except Exception as exc:  # any op failure: reported below, estimated by the caller
                    failed[sig] = f"{node.target} ({type(exc).__name__}: {exc}"[:200] + ")"
                    continue
                OP_TIMES.add(tag, sig, seconds)
            table[sig] = seconds
    OP_TIMES.flush()
    if failed:
        warnings.warn(
            f"{len(failed)} op(s) could not be run on {dev}; their costs are estimated from a device "
            f"profile instead: {'; '.join(failed.values())}",
            ProfileWarning,
            stacklevel=3,
        )
    return table


def _measure_node(gm: torch.fx.GraphModule, node: torch.fx.Node, pool: _Pool) -> float:
    target = node.target
    assert callable(target)
    own = is_mutation(target)
    # what a CUDA kernel reads on the host is made on the CPU (checkmate.ops.host_placed:
    # timed on GPU copies of its philox seed and offset, an attention backward with dropout
    # segfaulted on an H100, torch 2.11). More generally, an op whose example inputs mix
    # devices gets them mixed; a graph wholly on the CPU timed on another device is moved
    # there whole.
    vals = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    kinds = {t.device.type for t in flat_tensors(vals)}
    keep_cpu = "cpu" in kinds and len(kinds) > 1
    args = tuple(_materialize(v, gm, pool, own, keep_cpu) for v in node.args)
    kwargs = {k: _materialize(v, gm, pool, own, keep_cpu) for k, v in node.kwargs.items()}
    args, kwargs = host_placed(target, args, kwargs)
    return time_callable(lambda: target(*args, **kwargs), pool.device)


def _fallback_estimate(node: torch.fx.Node, dev: torch.device) -> float:
    from checkmate.profile import load_profile

    return load_profile("h100" if dev.type == "cuda" else "cpu").estimate(node)
