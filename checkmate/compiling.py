"""A training call through ``torch.compile``: the step compiled with the planner as its backend,
compiled again when the planner asks, Dynamo's recompile limits raised for checkmate's own calls
and an error where they are hit (an eager step is an unplanned one), and the input signature
that names a step."""

from __future__ import annotations

import inspect
import os
import random
import re
import types
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from checkmate.module_state import CheckmateState
from checkmate.planner_common import OverheadWarning
from checkmate.recompiles import caller_level
from checkmate.runtime import Planner, log
from solvers.budget import format_bytes
from solvers.errors import CheckmateError, TraceError

#: each optimized module's compiled variants counted apart from those of every other module of
#: its class: Dynamo shares one recompile count among the compiles of equal code (copies of a
#: class's forward included), and a module past it ran its step eagerly, unplanned, saying
#: nothing (the ninth of nine optimized Sequentials, a parameter unfrozen mid-training)
_ISOLATED: dict[str, Any] = (
    {"isolate_recompiles": True}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters
    else {}
)


def _own_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of the plain function ``fn`` with a code object of its own (``fn`` itself when
    it is not a plain Python function)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or code is None:
        return fn
    own = types.FunctionType(code.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    own.__dict__.update(fn.__dict__)
    own.__qualname__, own.__doc__, own.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return own


def _rearm(state: CheckmateState) -> None:
    """Compile the step again at the next call, with a code object of its own
    (:func:`_compile_again`). A compile of the forward that failed (``WON'T CONVERT``: an
    exception raised inside it, ``if self.fail: raise``, or a construct Dynamo cannot trace
    at some inputs) marks its code skipped for every later call, its compiled variants
    included (torch 2.13's ``ConvertFrameReturn`` default; ``set_code_exec_strategy`` does
    not reach the variants of an ``isolate_recompiles`` compile), so every later step ran
    eagerly: a module whose forward raised once at its third step ran 1.11x its budget from
    then on, unwarned, as plain ``torch.compile`` runs it eagerly. Its plans are reused
    (their families, the plan cache); the graphs are traced again."""
    if not state.recompile:
        log.info(
            "Dynamo may skip the compiled step from now on (a compile of the forward failed): compiling it again"
        )
    state.recompile = True


def _eager_error(exc: torch._dynamo.exc.TorchRuntimeError) -> BaseException | None:
    """The error eager PyTorch raises where Dynamo wrapped it, or None to raise ``exc`` as it is.

    Dynamo runs each op on fake tensors as it traces the step, and an op that raises there (a
    ``BatchNorm1d`` given one sample in training: ``ValueError``) raises ``TorchRuntimeError``,
    a ``RuntimeError``: a loop that skips such batches with ``except ValueError`` broke under
    checkmate (and plain ``torch.compile``). The error at the end of its chain is the op's own;
    it is raised where its type is one eager raises (not an error of torch's tracing machinery)
    and the wrapper is not already of its type (a shape mismatch stays Dynamo's
    ``RuntimeError``, whose text names the line of the model), with a note of where it was."""
    outer: BaseException = exc
    inner: BaseException = exc
    seen = {id(exc)}
    while (nxt := inner.__cause__ or inner.__context__) is not None and id(nxt) not in seen:
        seen.add(id(nxt))
        outer, inner = inner, nxt
    module = type(inner).__module__
    if isinstance(exc, type(inner)) or isinstance(inner, CheckmateError) or module.startswith("torch"):
        return None
    outer.__cause__ = outer.__context__ = None  # raised in exc's handler, inner's context is exc: no cycle
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s+(.+)', str(exc))
    torch_dir = os.path.dirname(torch.__file__)
    frames = [f for f in frames if not f[0].startswith(torch_dir)] or frames  # the user's line, else torch's
    where = f" at {frames[-1][0]}:{frames[-1][1]} ({frames[-1][2].strip()})" if frames else ""
    inner.add_note(
        f"raised as Dynamo traced the optimized step{where}, running its ops on fake tensors: the error eager "
        f"PyTorch raises (torch.compile raises it as {type(exc).__name__})"
    )
    return inner


def _compile_step(forward: Callable[..., Any], planner: Planner, fullgraph: bool) -> Callable[..., Any]:
    """``torch.compile`` of an optimized module's forward: the planner its backend, shapes
    static, its variants counted apart from every other compile's (:data:`_ISOLATED`). The one
    place both the first compile and :func:`_compile_again` make it: the second, made without
    ``isolate_recompiles``, shared torch's one wrapper of its own module classes with every
    ``torch.compile``d module, and past Dynamo's limit ran its step eagerly, unplanned. Its
    region is noted on the planner, whose module releases it (:mod:`checkmate.release`)."""
    compiled = torch.compile(
        forward, backend=planner.backend(), dynamic=False, fullgraph=fullgraph, **_ISOLATED
    )
    planner.regions.append(getattr(compiled, "_isolate_recompiles_id", -1))
    return compiled


def _compile_again(state: CheckmateState) -> None:
    """A fresh torch.compile of the step (a code object of its own: Dynamo compiles it anew at
    the next call, and the planner plans it again), for a step planned outside DDP's forward
    (``example_inputs``, a step before wrapping: DDP's gradient buckets were left out of the
    budget, and it measured 1.05x it under DDP) and for the graphs of a step that exceeded a
    byte budget together (each is then planned with the others beside it)."""
    eager = state.eager
    fresh = _own_function(eager.__func__).__get__(eager.__self__)  # type: ignore[attr-defined]
    state.compiled = _compile_step(fresh, state.planner, bool(state.settings.get("fullgraph", False)))
    state.eager_keys.clear()
    state.outside_ddp.clear()
    # every input signature is planned again, each step is measured again: a short batch measured
    # within the budget, planned again after a longer one's step was measured over it, measured
    # 1.16x the budget at every later call, silently
    state.stepped.clear()
    state.step_calls.clear()
    state.again.clear()  # left, a first measure under a profiler of the user's was skipped as a measure again
    state.planner.fitted.clear()  # the plans measured within the budget are gone
    state.measured_paths.clear()  # of the plans compiled before
    state.uncovered.clear()
    state.path_tries.clear()


def _float_shapes(key: tuple[Any, ...]) -> frozenset[tuple[int, ...]]:
    """The shapes of a call's floating-point tensor inputs, read from its :func:`_signature`
    (every step passes here: no pytree walk)."""
    return frozenset(
        p[0]
        for p in key
        if type(p) is tuple and len(p) == 4 and isinstance(p[1], torch.dtype) and p[1].is_floating_point
    )


def _device_of(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """The device of a call's first tensor input, else of the module's first parameter."""
    for x in torch.utils._pytree.tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            return x.device
    return next(module.parameters(), torch.empty(0)).device


def _recompile_limit_hit() -> bool:
    """Whether Dynamo gave up compiling some code in this process for its recompile limit
    (it counts each such give-up among its ``unimplemented`` graph breaks)."""
    from torch._dynamo.utils import counters

    return any("recompile limit" in str(reason) for reason in counters.get("unimplemented", {}))


#: compiled variants one optimized forward may hold (one per input shape): far above what a
#: training loop's shapes need, while Dynamo's default (8) is reached by the ninth length
RECOMPILE_LIMIT = 1024


def _near_limit(state: CheckmateState) -> bool:
    """Whether one more compile of this module's step could reach Dynamo's own recompile
    limits: at least as many variants as those limits allow, less one, may have been compiled
    (every input signature seen, plus every graph planned, counts as one: more than Dynamo counts).

    Below that, a call of a known input signature runs without :func:`_recompile_limits`: its
    compiled code is found by its guards, and a guard that fails anyway (a parameter frozen, a
    global flag Dynamo guards on) compiles a variant that Dynamo's own limits still allow.
    Each write marks Dynamo's config hash stale: around a compiled call the writes cost about
    70 us a step on a 2-core CPU (31 us on their own; GPT-2 tiny), and nothing without them."""
    cfg = torch._dynamo.config
    return len(state.planner.records) + len(state.eager_keys) + 1 >= min(
        cfg.recompile_limit, cfg.accumulated_recompile_limit
    )


@contextmanager
def _recompile_limits() -> Iterator[None]:
    """Dynamo's recompile limits raised to :data:`RECOMPILE_LIMIT` and a hit made an error
    (past the limit Dynamo would run the step eagerly, unplanned), for one call.

    Plain attribute writes, restored after, and only of the values that differ
    (``torch._dynamo.config.patch`` costs about 75 us per call against about 25, measured on
    CPU); only the calls that may compile pass here (:func:`_near_limit`)."""
    cfg = torch._dynamo.config
    wanted = {
        "recompile_limit": max(cfg.recompile_limit, RECOMPILE_LIMIT),
        "accumulated_recompile_limit": max(cfg.accumulated_recompile_limit, RECOMPILE_LIMIT),
        "fail_on_recompile_limit_hit": True,
    }
    saved = {k: getattr(cfg, k) for k in wanted}
    changed = [k for k, v in wanted.items() if saved[k] != v]
    for k in changed:
        setattr(cfg, k, wanted[k])
    try:
        yield
    finally:
        for k in changed:
            setattr(cfg, k, saved[k])


#: Dynamo's settings for every compile of a planned step, whichever call makes it; each is
#: written only where it differs, and put back after the call (see :func:`_step_config`)
_STEP_CONFIG = {
    # Dynamo skips its guards on module hooks by default, so a hook registered on a submodule
    # after the step was compiled, or one removed, is never seen: a forward hook zeroing a
    # layer's output, registered after the first step, did not run, and the step's output and
    # gradients were those without it (eager's run it). With the guards the step is compiled,
    # and planned, again when its hooks change (a forward hook that only reads the output
    # included); the same hook registered anew at every step compiles nothing again
    "skip_nnmodule_hook_guards": False,
    # sizes that depend on a tensor's values (nonzero, a boolean mask's selection): captured,
    # they are unbacked symbols no plan can be made for (a mixture of experts routing with
    # nonzero, captured so, raised from the planner at its first step); not captured, Dynamo
    # breaks the graph at the op and each graph around it is planned. (A captured .item(),
    # capture_scalar_outputs, is planned: a number the step computes with, not a size.)
    "capture_dynamic_output_shape_ops": False,
}

#: the settings of :data:`_STEP_CONFIG` a user may have turned on for their own compiles
_CAPTURES = ("capture_dynamic_output_shape_ops",)


def _ddp_small_buckets() -> tuple[int, int] | None:
    """(bucket size, first bucket size) in bytes, where the buckets of the DDP module whose
    forward is running are smaller than the first bucket torch.compile's DDP optimizer makes
    (``_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB), which that optimizer refuses ("First bucket
    should be smaller/equal to other buckets", an ``AssertionError``, under a plain
    ``torch.compile`` too); else None."""
    from checkmate.distributed import active_ddp_module

    ddp = active_ddp_module()
    cap = getattr(ddp, "bucket_bytes_cap", None)
    first = getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    if not isinstance(cap, int) or not isinstance(first, int) or cap >= first:
        return None
    try:
        mode = torch._dynamo.utils.get_optimize_ddp_mode()
    except Exception:  # a torch that reads the setting elsewhere: the optimizer decides
        return None
    return (cap, first) if mode == "ddp_optimizer" else None


@contextmanager
def _step_config(state: CheckmateState) -> Iterator[None]:
    """:data:`_STEP_CONFIG` for one call of the step: plain attribute writes of the values
    that differ, restored after; the first call that finds one of :data:`_CAPTURES` on (set
    for the user's own compiles) warns once, an :class:`~checkmate.OverheadWarning`. Under a
    DDP whose buckets are smaller than the DDP optimizer's first one
    (:func:`_ddp_small_buckets`), the step compiles as one graph (``optimize_ddp`` off for
    it), warned of once: DDP then reduces the gradients after the backward."""
    cfg = torch._dynamo.config
    wanted: dict[str, Any] = dict(_STEP_CONFIG)
    buckets = _ddp_small_buckets()
    if buckets is not None:
        small, first = buckets
        wanted["optimize_ddp"] = False
        if not state.warned_ddp_buckets:
            state.warned_ddp_buckets = True
            warnings.warn(
                f"DDP's buckets ({format_bytes(small)}, bucket_cap_mb) are smaller than the first bucket "
                f"torch.compile's DDP optimizer makes ({format_bytes(first)}), which it refuses, so this optimized "
                "module's step compiles as one graph (torch._dynamo.config.optimize_ddp off for it): DDP "
                "reduces the gradients after the backward instead of during it. bucket_cap_mb >= 1 "
                "keeps that overlap",
                OverheadWarning,
                stacklevel=caller_level(),
            )
    changed = {k: getattr(cfg, k) for k, v in wanted.items() if getattr(cfg, k) != v}
    if not changed:
        yield
        return
    captures = [k for k in _CAPTURES if k in changed]
    if captures and not state.warned_captures:
        state.warned_captures = True
        warnings.warn(
            f"torch._dynamo.config.{' and '.join(captures)} is on: checkmate plans sizes known before a "
            "step runs, so this optimized module's step compiles with it off. Dynamo breaks the graph at "
            "an op whose output size depends on tensor values (nonzero, a boolean mask's selection), and "
            "the graphs around it are planned; the op runs eagerly between them",
            OverheadWarning,
            stacklevel=caller_level(),
        )
    for k in changed:
        setattr(cfg, k, wanted[k])
    try:
        yield
    finally:
        for k, v in changed.items():
            setattr(cfg, k, v)


# torch.compile(optimized) traces the frames _forward calls (its disable is not recursive, so that
# the eager path of an optimized module stays compilable): this one must run as written, or Dynamo
# inlines the planned step into the outer graph and the outer backend compiles it, unplanned
@torch._dynamo.disable
def _compiled_call(
    state: CheckmateState, args: tuple[Any, ...], kwargs: dict[str, Any], *, limits: bool = True
) -> Any:
    """``state.compiled(*args, **kwargs)``, under :func:`_recompile_limits` where ``limits``
    (a call that may compile: a new input signature, or :func:`_near_limit`), its failures
    as checkmate's errors."""
    marks = _take_marks(state, args, kwargs)
    try:
        with _step_config(state):
            if not limits:
                return state.compiled(*args, **kwargs)
            with _recompile_limits():
                return state.compiled(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as exc:
        limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        raise CheckmateError(
            f"torch.compile reached its recompile limit ({limit} variants) for this "
            "optimized module, so the step would run unplanned: too many distinct input shapes, "
            "argument values, or values the step reads (a module's integer attribute, a size after "
            "a graph break; the OverheadWarning before this named them); pad inputs to a few "
            "shapes, keep such values in tensors, or raise torch._dynamo.config.recompile_limit"
        ) from exc
    except torch._dynamo.exc.BackendCompilerFailed as exc:
        inner = exc.inner_exception
        if isinstance(inner, CheckmateError):
            raise inner.with_traceback(None) from None
        raise TraceError(
            f"the joint graph could not be planned: {type(inner).__name__}: {inner}; "
            "report it with the model, or run the model without checkmate"
        ) from inner
    except torch._dynamo.exc.TorchRuntimeError as exc:
        eager = _eager_error(exc)
        if eager is None:
            raise
        raise eager from None
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.UserError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"torch.compile cannot capture the model in one graph: {first}; rewrite that "
            "construct (data-dependent Python control flow, .item(), prints) or pass "
            "fullgraph=False to plan each captured piece separately"
        ) from exc
    finally:
        _put_marks(marks)


#: what ``torch._dynamo.mark_dynamic`` and its kin set on a tensor, and Dynamo guards on: the
#: marks that make a dimension dynamic first (a static compile of them raises), then those that
#: do not (``maybe_mark_dynamic``, ``mark_static``), then their companions and the flag that
#: says a tensor has any
_DYNAMIC_MARKS = ("_dynamo_dynamic_indices", "_dynamo_unbacked_indices", "_dynamo_strict_unbacked_indices")
_DIM_MARKS = (
    *_DYNAMIC_MARKS,
    "_dynamo_weak_dynamic_indices",
    "_dynamo_static_indices",
    "_dynamo_dynamic_range",
    "_dynamo_unbacked_bounds",
    "_dynamo_shape_ids",
    "_dynamo_hint_overrides",
    "_has_dynamo_dim_marking",
)


def _take_marks(state: CheckmateState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Take the dimension marks of ``torch._dynamo.mark_dynamic`` and its kin off the call's
    input tensors, for :func:`_put_marks` to put back after the call; the first time one marks
    a dimension dynamic, an :class:`~checkmate.OverheadWarning`. checkmate compiles every
    input shape statically (``dynamic=False``; a new shape runs a plan made for another where
    it fits): a dimension marked dynamic and specialized so made Dynamo raise
    ``ConstraintViolationError`` at every call, after the step's graphs were planned (an MLP
    given batches marked dynamic in dimension 0: three shapes planned, none run)."""
    taken: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for leaf in _input_tensors(args, kwargs):
        if hasattr(leaf, "_has_dynamo_dim_marking") or any(hasattr(leaf, m) for m in _DYNAMIC_MARKS):
            marks = {m: getattr(leaf, m) for m in _DIM_MARKS if hasattr(leaf, m)}
            for m in marks:
                delattr(leaf, m)
            taken.append((leaf, marks))
    dims = sorted({d for _, marks in taken for m in _DYNAMIC_MARKS for d in marks.get(m, ())})
    if dims and not state.warned_dynamic:
        state.warned_dynamic = True
        warnings.warn(
            f"inputs of this optimized module are marked dynamic (torch._dynamo.mark_dynamic, dimension(s) "
            f"{', '.join(map(str, dims))}): checkmate compiles and plans each input shape statically, a new "
            "shape reusing a plan made for another where it fits, so the marks are ignored for its calls. Pad "
            "inputs to a few shapes to keep the compiles few",
            OverheadWarning,
            stacklevel=caller_level(),
        )
    return taken


def _input_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among the call's inputs and inside their lists, tuples and dicts: what
    :func:`_take_marks` looks at every call, walked without pytree (0.6 us for one tensor, where
    pytree took 4.9 us, on a 2-core CPU)."""
    stack: list[Any] = [*args, *kwargs.values()]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())


def _put_marks(taken: list[Any]) -> None:
    """Put back the marks :func:`_take_marks` took."""
    for leaf, marks in taken:
        for m, value in marks.items():
            setattr(leaf, m, value)


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """A hashable key of what makes torch.compile specialize: tensor shapes, dtypes,
    devices and requires_grad; other arguments by value (or type when unhashable); and
    ``torch.autocast``, under which the same inputs make another graph."""
    key = _inputs_signature(args, kwargs)
    if torch._C._is_any_autocast_enabled():
        amp = tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
        key = (*key, ("autocast", amp))
    return key


def _inputs_signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """:func:`_signature` of the inputs."""
    if not kwargs and all(type(a) is torch.Tensor or type(a) is nn.Parameter for a in args):
        # the common call, model(x) or model(x, y): no pytree walk (every step passes here)
        return ("tensors", *((tuple(a.shape), a.dtype, a.device, a.requires_grad) for a in args))
    flat, spec = torch.utils._pytree.tree_flatten((args, kwargs))
    parts: list[Any] = [str(spec)]
    for x in flat:
        if isinstance(x, torch.Tensor):
            parts.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        else:
            try:
                hash(x)
                parts.append(x)
            except TypeError:
                parts.append(type(x))
    return tuple(parts)


@contextmanager
def _untouched(module: nn.Module) -> Iterator[None]:
    """Restore buffers and RNG states after a planning call (it must not change state)."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    py_rng = random.getstate()
    try:
        yield
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                if k in buffers:
                    b.copy_(buffers[k])
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
