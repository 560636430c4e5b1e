"""``checkmate trace``: a model factory -> a profiled joint graph saved for offline planning.

The only part of the command line that imports torch (lazily, from :mod:`checkmate.cli`).
The joint forward+backward graphs are captured as ``checkmate.optimize`` captures them
(``torch.compile`` with an AOTAutograd backend whose ``partition_fn`` sees each
functionalized joint graph and its number of forward outputs); each is modelled by
:func:`checkmate.trace.build_graph` with op costs from
:func:`checkmate.profile.profile_costs` (measured, or from a device profile).

With ``fake=True`` the factory runs under a
:class:`~torch._subclasses.fake_tensor.FakeTensorMode`: parameters and inputs are fake
tensors (shape, dtype and device, no storage), so a model far larger than this machine's
memory traces here. The capture is the same (Dynamo and AOTAutograd fakify every value
anyway), so the joint graph, its output bytes and its profile costs are those of the real
trace; only measuring ops (``profile=None``) needs real tensors, so a fake trace needs a
device profile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from solvers.errors import CheckmateError, TraceError
from solvers.graph import Graph

__all__ = ["capture_joint", "load_factory", "trace_factory"]


def load_factory(spec: str) -> Callable[[], Any]:
    """``module:function`` or ``path/to/file.py:function`` -> the function.

    Raises:
        CheckmateError: the spec is malformed, the module cannot be imported, or it has no
            such callable.
    """
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise CheckmateError(f"{spec!r} is not MODULE:FACTORY (e.g. mypkg.models:make_model)")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            # a name of its own, registered as imported: Dynamo imports the module of a function
            # it resumes after a graph break, and the file's stem may name another module
            name = f"_checkmate_factory_{path.stem}_{abs(hash(str(path.resolve()))):x}"
            mspec = importlib.util.spec_from_file_location(name, path)
            if mspec is None or mspec.loader is None or not path.is_file():
                raise CheckmateError(f"{module_name}: no such Python file")
            module = importlib.util.module_from_spec(mspec)
            sys.modules[name] = module
            try:
                mspec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            if str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` does: local modules resolve
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CheckmateError(f"cannot import {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CheckmateError(f"{module_name!r} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def capture_joint(model: torch.nn.Module, inputs: Sequence[Any]) -> list[tuple[torch.fx.GraphModule, int]]:
    """The functionalized joint graphs of one training step, with their forward-output counts.

    Captured as ``checkmate.optimize`` captures them: ``torch.compile`` (Dynamo, static
    shapes) with an AOTAutograd backend whose partition hook sees each joint graph. A model
    with graph breaks yields several graphs.

    Raises:
        TraceError: the model could not be traced, or no output requires grad.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    from checkmate.compiling import _own_function, _recompile_limits

    graphs: list[tuple[torch.fx.GraphModule, int]] = []

    def partition(gm: torch.fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int, **kw: Any) -> Any:
        graphs.append((gm, num_fwd_outputs))
        return default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kw)

    backend = aot_autograd(fw_compiler=_identity, bw_compiler=_identity, partition_fn=partition)

    def step(*args: Any) -> Any:
        return model(*args)

    # a function with a code object of its own, compiled afresh: Dynamo compiles every module
    # through one wrapper of its own (and every nn.Sequential through one forward), which past
    # its recompile limit runs eagerly for good: a model traced after eight others in one
    # process captured nothing
    compiled = torch.compile(_own_function(step), backend=backend, dynamic=False)
    model.train()
    try:
        with torch.enable_grad(), _recompile_limits():
            compiled(*inputs)
    except Exception as exc:
        inner = getattr(exc, "inner_exception", None) or exc
        raise TraceError(f"could not trace the model: {type(inner).__name__}: {inner}") from exc
    if not graphs:
        raise TraceError("the model produced no joint graph: does any output require grad?")
    return graphs


def _costs(
    gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], *, profile: str | None, device: torch.device
) -> list[float]:
    from checkmate.profile import profile_costs

    return profile_costs(gm, list(nodes), profile=profile, device=device)


def _identity(gm: torch.fx.GraphModule, _: Any) -> torch.fx.GraphModule:
    return gm


def trace_factory(
    spec: str,
    shapes: Sequence[tuple[int, ...]] = (),
    profile: str | None = None,
    device: str = "cpu",
    *,
    fake: bool = False,
) -> list[Graph]:
    """Build a model with its factory, trace one training step and profile its ops.

    Args:
        spec: ``module:function``; the function returns a model, or ``(model, inputs...)``.
        shapes: shapes of random float inputs (override the factory's inputs).
        profile: a device profile name or JSON file; None measures every op on ``device``.
        device: where the model runs while tracing and measuring (with ``fake``, the device
            the fake tensors claim to be on).
        fake: run the factory and the trace on fake tensors (no storage is allocated: a
            model larger than this machine's memory traces); needs ``profile``. A factory
            should then build the model in its dtype (``torch.set_default_dtype``, or
            ``dtype=`` for Hugging Face models) rather than convert it with ``.to(dtype)``,
            which PyTorch cannot do to fake parameters inside the fake mode.

    Returns:
        One graph per captured joint graph (several when the model has graph breaks), each
        with ``meta`` naming the factory, the input shapes, the profile and ``fake``.

    Raises:
        CheckmateError: a bad factory or inputs, or ``fake`` without a profile;
            TraceError when tracing fails.
    """
    from checkmate.profile import load_profile, profile_id
    from checkmate.trace import build_graph

    if fake and profile is None:
        raise CheckmateError(
            "a fake trace cannot measure op times (its tensors have no data): "
            "give a device profile (--profile h100, or a profile JSON file)"
        )
    if profile is not None:
        load_profile(profile)  # an unknown profile fails before the (slower) trace
    dev = torch.device(device)
    model, inputs = _build(spec, shapes, dev, fake=fake)
    name = spec.rpartition(":")[2]
    captured = capture_joint(model, inputs)
    out = []
    for k, (gm, num_fwd) in enumerate(captured):
        costs = functools.partial(_costs, gm, profile=profile, device=dev)
        jg = build_graph(gm, num_fwd, costs, name=name if len(captured) == 1 else f"{name}.graph{k}")
        meta = {
            **dict(jg.graph.meta),
            "factory": spec,
            "graph_index": k,
            "graphs": len(captured),
            "input_shapes": [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
            "profile": profile_id(profile, dev),
            "fake": fake,
            "torch": torch.__version__,
        }
        out.append(dataclasses.replace(jg.graph, meta=meta))
    return out


def _build(
    spec: str, shapes: Sequence[tuple[int, ...]], dev: torch.device, *, fake: bool
) -> tuple[torch.nn.Module, tuple[Any, ...]]:
    """The factory's model and inputs on ``dev`` (fake tensors when ``fake``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    factory = load_factory(spec)
    # non-fake inputs allowed: Dynamo lifts constants it folds (a RoPE's position table) into
    # the graph as real tensors, which the forward then combines with fake ones
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    # fake tensors are made on the device they claim: nothing is moved after
    where = contextlib.ExitStack()
    if mode is not None:
        where.enter_context(mode)
        where.enter_context(dev)
    with where:
        try:
            made = factory()
        except RuntimeError as exc:
            if mode is not None and "swap" in str(exc):
                raise CheckmateError(
                    f"{spec} converts its model (.to(dtype) or .to(device)) while building it, "
                    "which PyTorch cannot do to fake parameters: build it in its dtype instead "
                    "(torch.set_default_dtype, or dtype= for Hugging Face models)"
                ) from exc
            raise
        model, inputs = (made[0], tuple(made[1:])) if isinstance(made, tuple) else (made, ())
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        if not isinstance(model, torch.nn.Module):
            raise CheckmateError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
        if shapes:
            inputs = tuple(torch.randn(*s) for s in shapes)
        if not inputs:
            raise CheckmateError(
                f"{spec} returned a model without example inputs; give --input-shape (e.g. 8,3,32,32)"
            )
        if mode is not None:
            # a tensor made before the fake mode (a module-level constant) is faked too
            inputs = tuple(
                mode.from_tensor(x) if isinstance(x, torch.Tensor) and not _is_fake(x) else x for x in inputs
            )
    if mode is None:
        model = model.to(dev)
        inputs = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x for x in inputs)
    else:
        real = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not _is_fake(t)]
        if real:
            raise CheckmateError(
                f"{spec}: {len(real)} parameters or buffers of the model are real tensors under --fake "
                f"(e.g. {real[0]!r}): build every tensor of the model inside the factory"
            )
    return model, inputs


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
