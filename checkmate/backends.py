"""The torch.compile backends that run :class:`checkmate.runtime.Planner`'s plans.

- :func:`aot_backend` (``compiler="aot"``): AOTAutograd with the planner as its partition
  function, the generated forward and backward run as they are (boxed fx modules, one aten op
  at a time).
- :func:`inductor_backend` (``compiler="inductor"``): Inductor with the planner as its
  partitioner (``torch._inductor.config.custom_partitioner_fn``, :class:`_Partitioner`),
  compiling the two halves with buffer reuse only where the compiled check measured it, and
  horizontal fusion only where the budget has room for it (:class:`PlanOrderChoices`). A
  graph no compiled plan fits runs its plan uncompiled (:func:`uncompiled`), as does a graph
  first called inside a profiler until a call outside one compiles it (:func:`deferred`).

Both wrap each compiled forward (:func:`_releasing`) so that the gradients of outputs the loss
leaves unread stay undefined, as in eager, and the outputs a plan drops at the backward's start
are watched (:mod:`checkmate.tangents`).
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from checkmate.codegen import SplitModules
from checkmate.tangents import (
    MadeZeros,
    NoneTangents,
    compiled_nodes,
    grad_fns,
    release_unused,
    watch_held,
    watch_outputs,
)
from solvers.errors import InfeasibleBudgetError

if TYPE_CHECKING:
    from checkmate.runtime import Planner


#: the meta key, on a generated backward's output node, of the index of its plan's record
RECORD_KEY = "checkmate_record"


class CompilerFallbackWarning(UserWarning):
    """Under ``compiler="inductor"``, a graph whose compiled step no plan fits within the
    budget runs its plan uncompiled, as ``compiler="aot"`` does, where one fits: the budget
    holds; that graph is not compiled. Measured: a Hugging Face Swin at 0.5 of eager's peak
    (536.34 KiB), whose Inductor step measured 1.10 MiB keeping every value (712.50 KiB at the
    least peak the graph model found); planned as aot traces it, it steps within the budget.
    A Hugging Face Segformer at 0.5, whose compiled plans all measured 1.08-1.14x the budget:
    uncompiled, 0.96x."""


class NoCompiledFit(Exception):
    """Under Inductor with the compiled check, no plan's compiled step measured within the
    budget (the message says what was measured): the backend runs the graph uncompiled where
    a plan fits that way (:func:`uncompiled`), else compiles it again with
    :attr:`Planner.fallback` off, to run the plan measured least with a
    :class:`BudgetWarning`."""


#: Inductor's config for checkmate's compiles (beside the partitioner and buffer reuse)
INDUCTOR_CONFIG: dict[str, Any] = {"fx_graph_cache": True}


def inductor_backend(planner: Planner) -> Callable[..., Any]:
    """A torch.compile backend: Inductor, with ``planner`` as its partitioner.

    AOTAutograd's cache is off for these compiles: a cached artifact would skip the
    partitioner, so the step would run a plan made for another budget (or none), and the
    planner would hold no record of it. Inductor's FX-graph cache (one entry per compiled
    half) is on, with the plan's memory annotations in its key (:class:`_Partitioner`): the
    compile that :mod:`checkmate.compiled` measured is the one the step runs, read back from
    the cache, and a later process compiles a plan it measured before from the cache too.
    """
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.virtualized import V

    partitioner = _Partitioner(planner)
    patches = {
        "custom_partitioner_fn": partitioner,
        # a buffer Inductor reuses stays allocated from its last use until it is reused, through
        # whatever peak lies between, where the plan frees each value at its last use. Reuse saves
        # an allocation each (on an H200, torch 2.11, 104 of a ResNet-like CNN's 257 a step; its
        # step, host-bound, 1.046x torch.compile's without and 1.002x with, at the same peak): on
        # where the compiled check measures each plan's step with it (and turns it off for a
        # graph whose first plan measures over the budget with it: Planner._checked), off where
        # nothing measures it
        "allow_buffer_reuse": planner.check_compiled and not planner.budget.least,
        **INDUCTOR_CONFIG,
    }

    def inner(gm: fx.GraphModule, *args: Any, **kwargs: Any) -> Any:
        # the forward's and the backward's compile (the backward's runs later, at the first
        # backward call, outside the backend's call)
        partitioner.digest = _memory_digest(gm)
        reuse = bool(inductor_config.allow_buffer_reuse) and partitioner.digest not in partitioner.no_reuse
        made = MadeZeros(gm) if kwargs.get("is_backward") and MadeZeros.can_make(gm) else None
        with (
            inductor_config.patch(allow_buffer_reuse=reuse),
            V.set_choices_handler(PlanOrderChoices(V.choices)),
        ):
            out = compile_fx_inner(gm, *args, **kwargs)
        if made is not None:  # read before Inductor's passes rewrite gm
            made.compiled = out
            return made
        return out

    def compiled(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        before = len(planner.records)
        with torch._functorch.config.patch(enable_autograd_cache=False):
            step: Callable[..., Any] = compile_fx(  # type: ignore[assignment]
                gm, list(example_inputs), inner_compile=inner, config_patches=patches
            )
        rec = planner.records[-1] if len(planner.records) > before else None
        if rec is not None and rec.joint.dropped:  # planned as the loop was seen: watched
            return _releasing(
                step,
                example_inputs,
                rec.joint.dropped,
                functools.partial(planner.held, rec),
                release=partitioner.zeros_made,
            )
        if rec is not None and rec.joint.beside_loss:  # does the loop drop them? (first_backward)
            return _releasing(
                step, example_inputs, release=partitioner.zeros_made, loop=planner.watch_loop(rec)
            )
        # the gradients of outputs the loss leaves unread stay undefined: MadeZeros makes
        # their zeros in the backward, and leaves the gradients only they reach None
        return _releasing(step, example_inputs) if partitioner.zeros_made else step

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        with _compiling(planner, example_inputs):
            return choose(gm, example_inputs)

    def choose(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        start = time.perf_counter()

        def without_fallback(note: str | None = None) -> Any:
            """Compiled again with :attr:`Planner.fallback` off, after no plan fit uncompiled
            (``note`` says so on the error, where it raises)."""
            planner.fallback = False
            try:
                return compiled(gm, example_inputs)
            except InfeasibleBudgetError as last:
                if note is None:
                    raise
                last.add_note(note)
                raise last from None
            finally:
                planner.fallback = True

        if _unmeasurable(planner, example_inputs):
            try:
                return deferred(planner, gm, example_inputs, compiled)
            except InfeasibleBudgetError:  # no plan fits uncompiled: compiled and run unchecked, warned
                pass
        try:
            return compiled(gm, example_inputs)
        except InfeasibleBudgetError as exc:  # no schedule the graph model finds, nor compiled
            try:
                return uncompiled(planner, gm, example_inputs, str(exc), time.perf_counter() - start)
            except InfeasibleBudgetError as again:
                either = f"Run uncompiled (compiler='aot'), no plan of it fits either: {again}"
                if not planner.skipped_least:
                    exc.add_note(either)
                    raise exc from None
                return without_fallback(either)  # the costly plan at the least peak, compiled, may fit
        except NoCompiledFit as over:  # plans compiled, each measured over the budget
            try:
                return uncompiled(planner, gm, example_inputs, str(over), time.perf_counter() - start)
            except InfeasibleBudgetError:  # the plan measured least, compiled, with a warning
                return without_fallback()

    return backend


@contextlib.contextmanager
def _compiling(planner: Planner, inputs: Sequence[Any]) -> Iterator[None]:
    """The step's tensors held by ``planner`` while a graph of them compiles (for checking
    plans compiled), and the least-peak fallback's mark cleared."""
    planner.inputs = inputs
    planner.skipped_least = False
    try:
        yield
    finally:
        planner.inputs = None


def uncompiled(
    planner: Planner, gm: fx.GraphModule, example_inputs: Sequence[Any], why: str, tried: float
) -> Any:
    """The graph no plan's Inductor step fits (``why``), planned for and run as
    ``compiler="aot"`` runs it (the aot graph is not decomposed as Inductor's is, and its
    plan runs as planned), with a :class:`CompilerFallbackWarning` that gives the seconds
    the compiled attempts took (``tried``), which ``compiler="aot"`` skips (a Hugging Face
    Swin at 0.5 of eager's peak: 87 s of its first call's 99 s with empty Inductor caches on
    a 2-core CPU, where ``compiler="aot"`` took 12 s; 581 s of 627 s when the costly plan at
    its least simulated peak was compiled too, see :meth:`Planner._at_least_peak`).

    Raises:
        InfeasibleBudgetError: no plan fits that way either.
    """
    index = len(planner.records)
    # its first backward shows whether the loop drops the outputs beside the loss: a plan
    # compiled with them dropped may fit (Planner.first_backward)
    out = aot_backend(planner, observe=True)(gm, list(example_inputs))
    warnings.warn(
        f"graph {index}: no plan's step compiled by Inductor fits the budget of {planner.budget} ({why}); "
        "the graph runs its plan uncompiled, as compiler='aot' does, within the budget. A larger budget "
        f"lets Inductor compile it; compiler='aot' plans it without the compiled attempts, which took "
        f"{tried:.0f} s here",
        CompilerFallbackWarning,
        stacklevel=2,
    )
    return out


def _unmeasurable(planner: Planner, example_inputs: Sequence[Any]) -> bool:
    """Whether the plan of a graph of ``example_inputs`` would be checked compiled, but a
    profiler runs beside which its step cannot be measured (:func:`checkmate.compiled.profiler_hides`),
    and the graph can be compiled again later for tensors of the same sizes (none symbolic)."""
    from checkmate.compiled import profiler_hides

    if not (planner.check_compiled and planner.fallback and planner._unchecked_why() is None):
        return False
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    symbolic = any(
        isinstance(x, torch.SymInt) for x in (*example_inputs, *(d for t in tensors for d in t.shape))
    )
    return not symbolic and profiler_hides({t.device for t in tensors})


def deferred(
    planner: Planner,
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    compile_graph: Callable[[fx.GraphModule, Sequence[Any]], Any],
) -> Callable[..., Any]:
    """A graph first called inside a profiler (:func:`_unmeasurable`): its plan runs
    uncompiled, as ``compiler="aot"`` runs it, within the budget, while a profiler runs; its
    first call outside one compiles it with Inductor (``compile_graph``, with the plan
    checked compiled on that call's tensors) and the calls after run that. Where no compiled
    plan fits then, it goes on uncompiled. A :class:`CompilerFallbackWarning` says so.

    Before, such a plan was compiled unchecked and ran as simulated: since repeated
    computations are merged (:mod:`checkmate.cse`) the graph model simulates Inductor's peak
    closely, so an unchecked plan lands near its budget on either side (an MLP's first step
    measured 1.051x its budget in one CI run of four).

    Raises:
        InfeasibleBudgetError: no plan fits uncompiled (the caller compiles it unchecked).
    """
    import copy

    # its graph as Dynamo gave it, for the compile to come; its parameters and constants
    # shared, not copied (a module whose parameters the graph holds trains those)
    saved = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    saved.meta.update(gm.meta)
    index = len(planner.records)
    now = aot_backend(planner, observe=True)(gm, list(example_inputs))
    warnings.warn(
        f"graph {index}: a profiler is running (the step was called inside torch.profiler or "
        "checkmate.memory.measure_peak), beside which the step Inductor compiles cannot be measured on "
        "the CPU (only the profiler sees what its kernels allocate): the graph runs its plan uncompiled, as "
        "compiler='aot' does, within the budget, until its first call outside a profiler compiles it with "
        "Inductor and checks it. Run the first step of each input shape outside the profiler, or pass "
        "example_inputs to checkmate.optimize, to compile it at once",
        CompilerFallbackWarning,
        stacklevel=2,
    )
    chosen: list[Callable[..., Any]] = []

    def later(args: list[Any]) -> Callable[..., Any]:
        try:
            with _compiling(planner, args):
                return compile_graph(saved, list(args))
        except Exception as exc:  # the plan running holds the budget: never lose it to the compile
            why = (
                f"no plan's step fits the budget of {planner.budget}"
                if isinstance(exc, (InfeasibleBudgetError, NoCompiledFit))
                else "the compile failed"
            )
            warnings.warn(
                f"graph {index}: compiled by Inductor at its first call outside a profiler, {why} "
                f"({str(exc)[:500]}); the graph goes on running its plan uncompiled, within the budget",
                CompilerFallbackWarning,
                stacklevel=3,
            )
            return now

    @functools.wraps(now)  # keeps a boxed call boxed (its _boxed_call attribute)
    def run(*args: Any) -> Any:
        if not chosen and not torch._C._autograd._profiler_enabled():
            chosen.append(later(list(flat_args(args))))
        return (chosen[0] if chosen else now)(*args)

    return run


class _Partitioner(CustomPartitionerFn):
    """checkmate's planner as Inductor's partitioner (``custom_partitioner_fn``).

    Its uuid is part of the key of Inductor's FX-graph cache for each half compiled: it
    names the plan's memory annotations of the half being compiled (``digest``, set before
    each compile), on which :class:`PlanOrderChoices` decides fusions, so that halves with
    equal code but another budget are not one cache entry. ``VERSION`` is in it too: bumped
    when what checkmate's compiles hand Inductor changes outside the graph (version 2: the
    backward's donated inputs, :func:`bw_donated`, which the cache key does not hold;
    version 3: vertical fusions refused by :class:`PlanOrderChoices`), so that an artifact
    compiled by an older checkmate is not read back."""

    VERSION = 3

    def __init__(self, planner: Planner) -> None:
        self.planner = planner
        self.digest = ""
        self.zeros_made = False
        #: the digests of halves to compile without buffer reuse (:attr:`Planner.reuse_refused`)
        self.no_reuse: set[str] = set()

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        self.planner.reuse_refused = False
        fw, bw = self.planner.partition(gm, joint_inputs, **kwargs)
        self.zeros_made = MadeZeros.can_make(bw)  # its backward will make undefined tangents' zeros
        if self.planner.reuse_refused:  # compiled as checked (the backward's compile comes later)
            self.no_reuse.update((_memory_digest(fw), _memory_digest(bw)))
        return fw, bw

    def uuid(self) -> str:
        return f"checkmate-partitioner-{self.VERSION}:{self.digest}"

    def __reduce__(self) -> tuple[Any, ...]:
        # Inductor pickles its config into the cache key (and may keep the pickle while the
        # config is unchanged): a constant stands for the planner; the digest is in uuid()
        return (str, (f"checkmate-partitioner-{self.VERSION}",))


def _memory_digest(gm: fx.GraphModule) -> str:
    """A digest of the plan's memory annotations on ``gm``'s nodes (see :class:`_Partitioner`)."""
    import hashlib

    marks = [(n.name, n.meta.get("checkmate_memory")) for n in gm.graph.nodes if n.op == "call_function"]
    return hashlib.sha256(repr(marks).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class _DonatedOnly:
    """What Inductor reads of AOTAutograd's metadata while it compiles a backward
    (``torch._inductor.utils.get_donated_idxs``): the inputs it may overwrite."""

    bw_donated_idxs: list[int]


def bw_donated(modules: SplitModules, num_fwd_outputs: int) -> list[int] | None:
    """The backward inputs AOTAutograd will donate to Inductor's compile of ``modules``'
    backward (``collect_bw_donated_buffer_idxs``): the saved values that alias no forward
    input, forward output or gradient, which the backward may overwrite in place once read
    (AOTAutograd frees them as the backward starts). None when it donates none (its
    ``donated_buffer`` config off, a value it cannot judge, another torch release).

    The compiled check must compile the backward as the step will: on torch 2.14 (CPU) a
    backward compiled without them wrote the gradient of a 4096-word cross-entropy into a
    buffer of its own beside the saved log-softmax, 32.3 MiB where the step compiled by
    AOTAutograd holds 16.9 MiB, and the check, whose compile the step then reads from
    Inductor's cache, refused a budget that torch.compile's step meets. An H100 with torch
    2.11 measured the same 32 MiB before this, and torch.compile's own peak after it."""
    try:
        from torch._functorch._aot_autograd.graph_compile import (
            collect_fw_donated_buffer_idxs,
            contain_metadata_mutation_ops,
        )
    except ImportError:
        return None
    if not torch._functorch.config.donated_buffer:
        return None
    fw, bw = modules.forward, modules.backward
    if contain_metadata_mutation_ops(fw) or contain_metadata_mutation_ops(bw):
        return []

    def vals(nodes: Sequence[Any]) -> list[Any]:
        return [n.meta.get("val") if isinstance(n, fx.Node) else None for n in nodes]

    fw_outs = list(fw.graph.find_nodes(op="output"))[-1].args[0]
    bw_outs = list(bw.graph.find_nodes(op="output"))[-1].args[0]
    saved = vals(fw_outs[num_fwd_outputs:])
    if not all(isinstance(v, torch.Tensor) for v in saved):  # symbolic sizes saved: not judged here
        return None
    return list(
        collect_fw_donated_buffer_idxs(
            vals(fw.graph.find_nodes(op="placeholder")), vals(fw_outs[:num_fwd_outputs]), vals(bw_outs), saved
        )
    )


def compile_half(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    is_backward: bool,
    *,
    static: list[int],
    donated: list[int] | None = None,
) -> Callable[[list[Any]], Any]:
    """Inductor's compile of one half of a plan, as :func:`inductor_backend` will compile it
    once the partitioner returns, so that the FX-graph cache holds the artifact for that
    compile: the same annotations in the key, and the arguments Inductor's own forward and
    backward compilers pass (those not known here are left out, which only costs a cache
    miss); ``static``: the forward's inputs Dynamo marked static (parameters and buffers,
    as AOTAutograd's metadata lists them); ``donated``: the backward's inputs AOTAutograd
    donates (:func:`bw_donated`). In a tracing context of its own, so that what it records
    (output strides) is not taken for the real compile's."""
    from torch._guards import TracingContext, detect_fake_mode, tracing
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    kwargs: dict[str, Any] = {"is_backward": is_backward}
    try:
        from torch._inductor.compile_fx import count_tangents
        from torch._inductor.cudagraph_utils import BoxedDeviceIndex
        from torch._inductor.decomposition import select_decomp_table
        from torch._inductor.utils import BoxedBool

        kwargs.update(
            static_input_idxs=list(range(count_tangents(gm))) if is_backward else static,
            cudagraphs=BoxedBool(bool(config.triton.cudagraphs)),
            boxed_forward_device_index=BoxedDeviceIndex(None),
            get_decomp_fn=select_decomp_table,
        )
        if not is_backward:
            kwargs["is_inference"] = False
    except (ImportError, AttributeError, TypeError):  # another release: a cache miss, no more
        kwargs = {"is_backward": is_backward}
    partitioner = config.custom_partitioner_fn
    if isinstance(partitioner, _Partitioner):
        partitioner.digest = _memory_digest(gm)
    context = TracingContext(detect_fake_mode(example_inputs))  # the fake mode: its shape env
    if is_backward and donated is not None:  # the saved values it may overwrite (bw_donated)
        context.fw_metadata = _DonatedOnly(donated)  # type: ignore[assignment]
    with tracing(context), V.set_choices_handler(PlanOrderChoices(V.choices)):
        return compile_fx_inner(gm, example_inputs, **kwargs)  # type: ignore[no-any-return]


class PlanOrderChoices:
    """Inductor's heuristics (``torch._inductor.choices.InductorChoices``, those in force
    when the compile starts) for a plan's halves, except that a horizontal fusion (of two
    kernels neither of which reads the other, fused because they read the same buffers)
    that could take the step over its budget is refused.

    Fused, the later kernel runs early (or the earlier one late): its result is allocated
    while what the plan frees between the two is still held, so the step may hold up to
    those bytes more than the plan anywhere between them. The fusion is made only when the
    plan's simulated memory there (``meta["checkmate_memory"]`` on the nodes codegen emits)
    plus the bytes freed between (last reads of Inductor's buffers and inputs, from the
    earlier kernel on) stays within the plan's budget; with nothing freed between, fusing
    moves no peak. Inductor's own rule allows any two kernels up to 64 scheduler nodes
    apart. Measured on CPU with fused ops folded (:mod:`checkmate.trace`): on a GPT-2 (4
    layers, d=128, 8 x 256 tokens) at 50 MiB, one layer's recomputed attention fused into
    the next layer's softmax backward measured 1.26x the simulated peak, and a Llama-like
    model at 40 MiB 1.10x its budget; with this rule both measured at most the simulated
    peak. A vertical fusion (a producer into a consumer that does not follow it at once) is
    made by the same rule: Inductor places a fused kernel where its first member was and
    runs what it needs before it, so the consumer's result, and what was computed between
    for it, are allocated while what the plan frees between the two is still held. Left to
    Inductor, a Hugging Face ALBERT planned at 2.50 MiB measured 2.83 MiB compiled (2.24 MiB
    with the rule), and one plan of a GPT-2 (4 layers, d=128, 8 x 256 tokens) at 71.80 MiB
    measured 74.37 MiB (56.87 MiB: the compiled check then plans higher). Neighbours (what
    :mod:`checkmate.fusion` models) are left to Inductor.
    """

    def __init__(self, prior: Any) -> None:
        self._prior = prior
        self._scheduler: int | None = None  # id of the scheduler the tables below are for
        self._frees: list[tuple[int, int]] = []  # (position, bytes) of last reads, sorted
        self._memory: dict[int, tuple[int, int]] = {}  # position -> (simulated bytes, budget)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._prior, name)

    def _tables(self, scheduler: Any) -> None:
        """Where buffers and graph inputs are read for the last time (outputs are never
        freed) and their bytes; the plan's simulated memory at each scheduler position."""
        if self._scheduler == id(scheduler):
            return
        from torch._inductor.virtualized import V

        last: dict[str, int] = {}
        for snode in scheduler.nodes:
            for dep in snode.read_writes.reads:
                last[dep.name] = max(last.get(dep.name, -1), snode.max_order)
            for sub in snode.get_nodes():
                marks = [
                    m
                    for o in getattr(sub.node, "origins", ()) or ()
                    if (m := o.meta.get("checkmate_memory")) is not None
                ]
                if marks:
                    self._memory[sub.min_order] = max(marks)
        outputs = set(V.graph.get_output_names())
        self._frees = sorted(
            (p, _buffer_bytes(scheduler, name)) for name, p in last.items() if name not in outputs
        )
        self._scheduler = id(scheduler)

    def can_fuse_horizontal(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        # Inductor's own heuristics first: they refuse kernels far apart, which bounds the
        # scan below to the pairs they would fuse
        if not self._prior.can_fuse_horizontal(scheduler, node1, node2, shared_data_score):
            return False
        if node1.max_order < node2.min_order:
            lo, hi = node1.max_order, node2.min_order
        else:
            lo, hi = node2.max_order, node1.min_order
        # run together, the two hold at most what the plan frees between them on top of the
        # plan's memory there
        return self._fits(scheduler, min(node1.min_order, node2.min_order), hi, (lo, hi))

    def can_fuse_vertical(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        if not self._prior.can_fuse_vertical(scheduler, node1, node2, shared_data_score):
            return False
        if node1.max_order + 1 >= node2.min_order:  # neighbours: nothing runs in between
            return True
        # the consumer runs where its producer is, with what it needs: what runs between them
        # and is freed there may be held at once (only what the producer reads last: ALBERT
        # still measured 2.81 MiB of 2.50)
        return self._fits(scheduler, node1.min_order, node2.min_order, (node1.max_order, node2.min_order))

    def _fits(self, scheduler: Any, start: int, end: int, held: tuple[int, int]) -> bool:
        """Whether the plan's memory at scheduler positions ``start..end``, plus the bytes
        of the buffers last read at positions ``held`` (a half-open range), stays within
        the plan's budget (always, when those bytes are none; never, where the plan's memory
        there is not known)."""
        self._tables(scheduler)
        k = bisect.bisect_left(self._frees, (held[0], -1))
        extra = 0
        while k < len(self._frees) and self._frees[k][0] < held[1]:
            extra += self._frees[k][1]
            k += 1
        if not extra:
            return True
        known = [self._memory[p] for p in range(start, end + 1) if p in self._memory]
        return bool(known) and max(m for m, _ in known) + extra <= min(b for _, b in known)


def _buffer_bytes(scheduler: Any, name: str) -> int:
    """Bytes of an Inductor buffer or graph input (0 when unknown)."""
    from torch._inductor.virtualized import V

    buf = scheduler.name_to_buf.get(name)
    node = buf.node if buf is not None else V.graph.graph_inputs.get(name)
    if node is None:
        return 0
    try:
        numel = 1
        for d in node.get_size():
            numel *= V.graph.sizevars.optimization_hint(d, fallback=1)
        return int(numel) * node.get_dtype().itemsize
    except (AttributeError, TypeError, NotImplementedError):
        return 0


def _as_is(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The forward's compiler: run the generated module unchanged (it uses the boxed convention)."""
    return gm


def aot_backend(planner: Planner, *, observe: bool = False) -> Callable[..., Any]:
    """AOTAutograd with ``planner`` as its partitioner, running the generated modules as they
    are; the gradients of outputs the loss does not read stay undefined, as in eager, and the
    backward runs without them (:mod:`checkmate.tangents`). ``observe``: the first backward
    is watched for the outputs beside the loss (:meth:`Planner.watch_loop`)."""

    def backward(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> NoneTangents:
        # AOTAutograd compiles a copy of the module the partitioner made: its record is named
        # in the output node's meta, which copies keep
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        index = out.meta.get(RECORD_KEY)
        if index is None or not planner.records[index].joint.unread:
            return NoneTangents(gm)
        rec = planner.records[index]
        return NoneTangents(gm, rec.joint.unread, functools.partial(planner.given, rec))

    aot = aot_autograd(fw_compiler=_as_is, bw_compiler=backward, partition_fn=planner.partition)

    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any], **configs: Any) -> Any:
        before = len(planner.records)
        compiled = aot(gm, example_inputs, **configs)
        rec = planner.records[-1] if len(planner.records) > before else None
        dropped = rec.joint.dropped if rec is not None else frozenset()  # outputs planned dropped
        on_held = functools.partial(planner.held, rec) if rec is not None else None
        loop = planner.watch_loop(rec) if observe and rec is not None else None
        return _releasing(compiled, example_inputs, dropped, on_held, loop=loop)

    return compile_graph


#: outputs of a size and dtype in the keys, and what to call with their bytes alive when the
#: backward starts (:func:`checkmate.tangents.watch_outputs`)
Watch = tuple[frozenset[tuple[tuple[int, ...], torch.dtype]], Callable[[int], None]]


def _releasing(
    step: Callable[..., Any],
    example_inputs: Sequence[Any],
    dropped: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset(),
    on_held: Callable[..., Any] | None = None,
    *,
    release: bool = True,
    loop: Callable[[], Watch | None] | None = None,
) -> Callable[..., Any]:
    """``step`` (a compiled forward's function, compiled for ``example_inputs``), after which
    the outputs' gradients the loss leaves unread stay undefined
    (:func:`checkmate.tangents.release_unused`; not where ``release`` is off: Inductor's
    backward is given zeros for them), and outputs planned ``dropped`` at the backward's
    start are watched (``on_held`` when one is still held there,
    :func:`checkmate.tangents.watch_held`). ``loop``, at each call, says which outputs to
    watch at this backward's start, if any (:meth:`Planner.watch_loop`)."""
    # the inputs autograd may have made: not the parameters (leaves, and Dynamo's guards hold
    # each to its type), most of a step's inputs, each read at every step otherwise
    # (positions only: the closure must not hold the compile's example inputs, the first call's
    # tensors, which a loss graph's include the logits)
    made = [i for i, x in enumerate(example_inputs) if not isinstance(x, torch.nn.Parameter)]
    n_inputs = len(example_inputs)

    @functools.wraps(step)
    def run(*args: Any) -> Any:
        flat = flat_args(args)  # read before the call: a boxed call clears its argument list
        made_before = grad_fns([flat[i] for i in made] if len(flat) == n_inputs else flat)
        out = step(*args)
        outs = out if isinstance(out, (list, tuple)) else (out,)
        watch = loop() if loop is not None else None
        held = on_held if dropped else None
        if release:
            nodes = release_unused(outs, made_before)
        elif held is not None or watch is not None:  # Inductor's: nodes only where something is watched
            nodes = compiled_nodes(outs, made_before)
        else:
            return out
        if held is not None:
            watch_held(nodes, outs, dropped, held)
        if watch is not None:
            watch_outputs(nodes, outs, *watch)
        return out

    return run


def flat_args(args: tuple[Any, ...]) -> Sequence[Any]:
    """A compiled graph's arguments, whether passed boxed (one list) or as they are (no copy:
    read before the call, which may clear a boxed list)."""
    return args[0] if len(args) == 1 and isinstance(args[0], list) else args
