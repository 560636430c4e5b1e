"""The torch.compile backend that plans each joint graph and runs the plan.

Dynamo captures the model's forward (one or more graphs, one per graph break);
AOTAutograd traces each into a functionalized joint forward+backward graph and hands it to a
partition function. Ours is the whole pipeline for one graph, one call a line:

    joint fx graph -> solvers.Graph (trace) -> per-op costs (profile) -> plan (cache / solve)
    -> forward and backward GraphModules (codegen)

The compilers then run those modules as they are (boxed, no inductor): the step executes
exactly the plan's ops in the plan's order. AOTAutograd's runtime wraps them in an
autograd.Function, so ``loss.backward()``, optimizers and gradient accumulation work as
usual, and it copies mutated buffers (BatchNorm running statistics) back once per step.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from checkmate.cache import cached_solve
from checkmate.codegen import SplitModules, generate
from checkmate.distributed import ddp_reserve, fsdp_reserve, plan_once
from checkmate.ops import is_mutation, is_random
from checkmate.timing import ProfileWarning
from checkmate.trace import JointGraph, build_graph, recompute_dropout_from_mask
from solvers.api import no_plan_error
from solvers.budget import format_bytes, parse_budget
from solvers.errors import CheckmateError, InfeasibleBudgetError
from solvers.plan import atomic_write_text
from solvers.resize import stretch, structure, transfer_and_check
from solvers.result import SolveResult, Status
from solvers.schedule import PAGEIN, PAGEOUT, keep_all_peak

__all__ = ["BudgetWarning", "PlanRecord", "Planner"]


class BudgetWarning(UserWarning):
    """A graph was planned above the fraction asked: the fraction is infeasible for it, and
    it is too small a part of its step to set the step's peak (see :meth:`Planner.partition`)."""


@dataclass(frozen=True)
class PlanRecord:
    """What was planned for one compiled graph (for reports and tests).

    Attributes:
        index: the graph's position among those compiled (0, 1, ...).
        joint: the graph model.
        result: the validated planner result.
        modules: the generated forward and backward.
        reference_peak: the graph's simulated peak without rematerialization (bytes).
        seconds: wall time of trace + profile + plan + codegen.
        trace_seconds: building the graph model, less profiling.
        profile_seconds: op timing and scratch-space measurement (both cached per op).
        scratch_seconds: the scratch-space part of ``profile_seconds``.
        solve_seconds: the plan cache lookup and, on a miss, the solve.
        codegen_seconds: generating the forward and backward (and paging them).
        cache: ``"hit"``, ``"miss"``, ``"disabled"`` (CHECKMATE_CACHE=0) or ``"pinned"``
            (a plan file given to ``optimize(plan=...)`` was used).
        paged: joint-graph names of saved values the forward hands to the backward on the
            host (paging plans only).
        asked_budget: the bytes the budget asked for this graph when it was planned at more
            (``result.budget``: a fraction infeasible for a small graph, see
            :meth:`Planner.partition`); None when it was planned at the budget asked.
        reused_from: the index of the record whose plan this graph runs (the same graph
            at other tensor sizes, see :meth:`Planner.partition`), or None when this graph
            was planned itself.
    """

    index: int
    joint: JointGraph
    result: SolveResult
    modules: SplitModules
    reference_peak: int
    seconds: float
    trace_seconds: float = 0.0
    profile_seconds: float = 0.0
    scratch_seconds: float = 0.0
    solve_seconds: float = 0.0
    codegen_seconds: float = 0.0
    cache: str = "disabled"
    paged: tuple[str, ...] = ()
    asked_budget: int | None = None
    reused_from: int | None = None

    @property
    def recomputes(self) -> int:
        return self.modules.recomputes

    @property
    def is_eager(self) -> bool:
        """True when the plan runs what eager PyTorch runs: no recomputes, nothing paged."""
        return self.modules.recomputes == 0 and not self.paged

    def summary(self) -> str:
        """One line: graph size, budget, simulated peak, cost overhead, strategy."""
        res = self.result
        g = self.joint.graph
        chosen = res.info.get("chosen", res.strategy)
        overhead = (res.cost or 0.0) / g.total_cost - 1.0 if g.total_cost else 0.0
        gap = f", gap to bound {res.gap:.1%}" if res.gap is not None and self.reused_from is None else ""
        if self.reused_from is not None:
            gap += f", plan of graph {self.reused_from} reused at these sizes"
        if res.info.get("planned_ahead"):
            gap += f", planned for shapes up to about {res.info['planned_ahead']:g}x these sizes"
        if self.asked_budget is not None:
            gap += (
                f", budget raised from {format_bytes(self.asked_budget)} "
                f"({self.asked_budget / max(self.reference_peak, 1):.0%}, infeasible for this graph)"
            )
        return (
            f"graph {self.index}: {g.n - 1} ops, budget {format_bytes(res.budget)} "
            f"({res.budget / max(self.reference_peak, 1):.0%} of {format_bytes(self.reference_peak)}), "
            f"simulated peak {format_bytes(res.peak or 0)}, {self.recomputes} recomputes, "
            f"+{overhead:.1%} compute, {chosen} ({res.status}){gap}"
        )


@dataclass
class Planner:
    """Plans every graph torch.compile gives it; holds the records.

    Attributes:
        budget: bytes or a fraction of each graph's simulated no-remat peak.
        strategy: a registered strategy name.
        profile: None to measure op times on the device, else a device profile name/path.
        time_limit: seconds per graph for searching strategies.
        options: strategy options.
        plan_path: a plan file to use instead of the cache.
        records: one per graph planned, in order.
        steps: training-step signature -> indices in ``records`` of the graphs compiled for
            it (the graphs of one step, recompilations included).
        step: the signature of the step being compiled (set by :meth:`begin_step`).
        families: a graph's structure (:func:`solvers.resize.structure`: its ops and
            edges, not its sizes) -> indices in ``records`` of the graphs of that structure
            that were planned (not reused).
    """

    budget: object
    strategy: str = "auto"
    profile: str | None = None
    time_limit: float | None = 30.0
    options: dict[str, Any] = field(default_factory=dict)
    plan_path: str | None = None
    records: list[PlanRecord] = field(default_factory=list)
    steps: dict[object, list[int]] = field(default_factory=dict)
    step: object = None
    families: dict[Hashable, list[int]] = field(default_factory=dict, repr=False)

    @property
    def plans_made(self) -> int:
        """How many graphs were planned (cache hits included); the others reuse a plan."""
        return sum(1 for r in self.records if r.reused_from is None)

    def begin_step(self, signature: object) -> None:
        """Graphs compiled from now on belong to the training step with this input
        signature (their sizes decide which graph sets the step's peak)."""
        self.step = signature

    def backend(self) -> Callable[..., Any]:
        """A torch.compile backend running this planner's plans."""
        return aot_autograd(fw_compiler=_as_is, bw_compiler=_as_is, partition_fn=self.partition)  # type: ignore[no-any-return]

    def partition(
        self, joint: fx.GraphModule, joint_inputs: Sequence[Any], *, num_fwd_outputs: int, **_: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd's partition hook: plan the joint graph and generate its two halves.

        A fraction budget applies to each graph's own keep-all peak. A graph for which that
        fraction is infeasible (the largest op of a loss graph split off by a graph break
        needs its whole peak) is planned at its own minimum, or keep-all when the minimum
        is not known to be below it, with a :class:`BudgetWarning`, when its keep-all peak
        is at most half that of the largest graph compiled for the same step so far: it
        does not set the step's peak. Otherwise, and for byte budgets, the
        :class:`InfeasibleBudgetError` is raised.
        """
        start = time.perf_counter()
        spent = {"profile": 0.0, "scratch": 0.0}

        def costs(nodes: Sequence[fx.Node]) -> list[float]:
            t0 = time.perf_counter()
            try:
                return _costs(joint, nodes, self.profile, device)
            finally:
                spent["profile"] += time.perf_counter() - t0

        def scratch(node: fx.Node) -> int:
            t0 = time.perf_counter()
            try:
                return _scratch_bytes(node)
            finally:
                spent["scratch"] += time.perf_counter() - t0

        device = _device_of(joint)
        recompute_dropout_from_mask(joint)
        jg = build_graph(joint, num_fwd_outputs, costs, scratch=scratch, name=f"graph{len(self.records)}")
        _flush_scratch()
        traced = time.perf_counter()
        res, asked, reused = self._solve(jg, _profile_id(self.profile, device))
        solved = time.perf_counter()
        if not res.ok or res.schedule is None:
            # both numbers: the proven bound, and the least peak a schedule found reaches
            raise no_plan_error(jg.graph, res, time_limit=self.time_limit)
        modules = generate(joint, jg, res.schedule)
        paged: tuple[str, ...] = ()
        if any(op in (PAGEOUT, PAGEIN) for op, _ in res.schedule.steps):
            # values the plan holds on the host across the forward/backward boundary
            from checkmate.paging import page_saved

            done = page_saved(modules, jg, res.schedule)
            modules, paged = done.modules, done.paged
        end = time.perf_counter()
        profile = spent["profile"] + spent["scratch"]
        self.records.append(
            PlanRecord(
                index=len(self.records),
                joint=jg,
                result=res,
                modules=modules,
                reference_peak=int(res.info.get("reference") or keep_all_peak(jg.graph)),
                seconds=end - start,
                trace_seconds=traced - start - profile,
                profile_seconds=profile,
                scratch_seconds=spent["scratch"],
                solve_seconds=solved - traced,
                codegen_seconds=end - solved,
                cache=_cache_status(res, self.plan_path),
                paged=paged,
                asked_budget=asked,
                reused_from=reused,
            )
        )
        self.steps.setdefault(self.step, []).append(len(self.records) - 1)
        if reused is None:
            self.families.setdefault(structure(jg.graph), []).append(len(self.records) - 1)
        return modules.forward, modules.backward

    def _target(self, graph: Any, family: Sequence[int]) -> tuple[object, int | None]:
        """The budget to plan ``graph`` at (the budget as given, or bytes) and, when the
        graph has a family (the same graph planned at other sizes), those bytes.

        A byte budget is itself. A fraction is of the graph's own keep-all peak, but never
        less than the bytes a larger graph of its family was planned at: the step's memory
        is then that of the family's largest planned shape, and a shorter batch always has
        a plan (the larger one's schedule fits it).
        """
        spec = parse_budget(self.budget)
        if spec.fraction is None:
            return self.budget, spec.nbytes
        if not family:
            return self.budget, None
        ref = keep_all_peak(graph)
        floor = max(self.records[i].result.budget for i in family)
        target = max(spec.resolve(ref), floor)
        return target, target

    def _reuse(self, jg: JointGraph, family: Sequence[int], target: int) -> tuple[SolveResult, int] | None:
        """The cheapest plan of ``family`` that, carried over to ``jg``'s sizes, fits
        ``target`` bytes (simulated), with the index of its record; None when none fits."""
        graph = jg.graph
        best: tuple[SolveResult, int] | None = None
        for i in family:
            rec = self.records[i]
            if rec.result.schedule is None:
                continue
            got = transfer_and_check(rec.joint.graph, rec.result.schedule, graph, target)
            if got is None:
                continue
            schedule, sim = got
            if best is not None and (best[0].cost or 0.0) <= sim.cost:
                continue
            info = {
                "chosen": rec.result.info.get("chosen", rec.result.strategy),
                "reference": keep_all_peak(graph),
                "reused_from": i,
            }
            res = replace(
                rec.result,
                status=Status.FEASIBLE,
                budget=target,
                schedule=schedule,
                cost=sim.cost,
                peak=sim.peak,
                lower_bound=None,
                build_seconds=0.0,
                solve_seconds=0.0,
                info=info,
            )
            best = (res, i)
        return best

    def _solve(self, jg: JointGraph, profile_id: str) -> tuple[SolveResult, int | None, int | None]:
        """The plan of ``jg``; when it was planned above the budget asked (see
        :meth:`partition`), the bytes asked; when it reuses the plan of another record
        (the same graph at other sizes), that record's index."""
        graph = jg.graph
        family = self.families.get(structure(graph), [])
        target, nbytes = self._target(graph, family)
        if family and nbytes is not None:
            reused = self._reuse(jg, family, nbytes)
            if reused is not None:
                return reused[0], None, reused[1]
        if family and nbytes is not None and parse_budget(self.budget).nbytes is not None:
            ahead = self._plan_ahead(jg, family, nbytes, profile_id)
            if ahead is not None:
                return ahead, None, None
        res, asked = self._plan(jg, profile_id, target)
        return res, asked, None

    def _plan_ahead(
        self, jg: JointGraph, family: Sequence[int], nbytes: int, profile_id: str
    ) -> SolveResult | None:
        """For a byte budget, a graph larger than every planned one of its family: its plan
        made on the graph stretched to about twice its size (:func:`solvers.resize.stretch`,
        extrapolating from the family's largest), so that the next larger shapes reuse it
        instead of planning again, when that plan fits the budget at the real sizes; None
        otherwise (then the graph is planned at its own sizes)."""
        graph = jg.graph
        old = max(family, key=lambda i: self.records[i].reference_peak)
        if keep_all_peak(graph) <= self.records[old].reference_peak:
            return None
        big = stretch(self.records[old].joint.graph, graph, _AHEAD)
        if big is None:
            return None
        try:
            res = cached_solve(
                big,
                nbytes,
                self.strategy,
                time_limit=self.time_limit,
                options=self.options,
                profile_id=profile_id,
                plan_path=self.plan_path,
            )
        except CheckmateError:
            return None
        if not res.ok or res.schedule is None:
            return None
        got = transfer_and_check(big, res.schedule, graph, nbytes)
        if got is None:
            return None
        schedule, sim = got
        info = {**res.info, "reference": keep_all_peak(graph), "planned_ahead": _AHEAD}
        return replace(res, schedule=schedule, cost=sim.cost, peak=sim.peak, lower_bound=None, info=info)

    def _larger_shape_budget(self, ref: int) -> int | None:
        """The most bytes a graph at this graph's position in another training step (its
        graphs in compile order) was planned at, among those whose keep-all peak is at
        least ``ref``; None when there is none."""
        pos = len(self.steps.get(self.step, []))
        got = [
            self.records[idx[pos]].result.budget
            for sig, idx in self.steps.items()
            if sig != self.step and len(idx) > pos and self.records[idx[pos]].reference_peak >= ref
        ]
        return max(got, default=None)

    def _plan(self, jg: JointGraph, profile_id: str, target: object) -> tuple[SolveResult, int | None]:
        """Solve ``jg`` at ``target``; see :meth:`partition` for a fraction infeasible
        for a small graph."""
        graph = jg.graph

        # DDP's gradient buckets, FSDP2's unsharded parameters: live beside the graph
        reserve = ddp_reserve() + fsdp_reserve()

        def run(budget: object) -> SolveResult:
            if parse_budget(budget).least:  # the least peak: nothing to reserve from
                return plan_once(graph, -1, lambda: cached_solve(
                    graph, budget, self.strategy, time_limit=self.time_limit, options=self.options,
                    profile_id=profile_id, plan_path=self.plan_path,
                ))  # fmt: skip
            nbytes = parse_budget(budget).resolve(keep_all_peak(graph)) - reserve
            return plan_once(
                graph,
                nbytes,
                lambda: cached_solve(
                    graph,
                    max(nbytes, 1),
                    self.strategy,
                    time_limit=self.time_limit,
                    options=self.options,
                    profile_id=profile_id,
                    plan_path=self.plan_path,
                ),
            )

        try:
            return run(target), None
        except InfeasibleBudgetError as exc:
            fraction = parse_budget(self.budget).fraction
            ref = exc.reference or keep_all_peak(graph)
            larger = self._larger_shape_budget(ref) if fraction is not None else None
            if larger is not None and larger > exc.budget:
                # the same graph of a larger step planned at these bytes: a smaller batch
                # whose graph Dynamo specialized differently (a size of 1) gets them too
                return run(larger), exc.budget
            largest = max((self.records[i].reference_peak for i in self.steps.get(self.step, [])), default=0)
            if fraction is None or 2 * ref > largest:
                raise
            asked, minimum = exc.budget, exc.minimum
        res: SolveResult | None = None
        if minimum is not None and minimum < ref:
            try:
                res = run(minimum)
            except InfeasibleBudgetError:
                res = None
            if res is not None and (not res.ok or res.schedule is None):
                res = None
        if res is None:
            res = run(ref)  # keep-all fits its own peak
        warnings.warn(
            f"graph {len(self.records)} ({graph.n - 1} ops, keep-all peak {format_bytes(ref)}) has no "
            f"schedule at the {fraction:.0%} asked ({format_bytes(asked)}); it is planned at "
            f"{format_bytes(res.budget)} ({res.budget / max(ref, 1):.0%} of its peak) instead. "
            f"It is at most half the largest graph of this step ({format_bytes(largest)}), which "
            "sets the step's peak; pass the budget in bytes to make this an error",
            BudgetWarning,
            stacklevel=2,
        )
        return res, asked


#: a byte budget's plan for a graph larger than the planned ones of its family is made for
#: shapes about this many times larger (see :meth:`Planner._plan_ahead`)
_AHEAD = 2.0


def _as_is(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The compilers: run the generated modules unchanged (they use the boxed convention)."""
    return gm


def _cache_status(res: SolveResult, plan_path: str | None) -> str:
    """How the plan was obtained: from a pinned file, the cache, a solve, or with no cache."""
    from checkmate.cache import cache_enabled

    hit = res.info.get("cache") == "hit"
    if plan_path is not None:
        return "pinned" if hit else "miss"
    if hit:
        return "hit"
    return "miss" if cache_enabled() else "disabled"


def _device_of(gm: fx.GraphModule) -> torch.device:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "placeholder" and isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


def _costs(
    gm: fx.GraphModule, nodes: Sequence[fx.Node], profile: str | None, device: torch.device
) -> list[float]:
    from checkmate.profile import profile_costs

    return profile_costs(gm, list(nodes), profile=profile, device=device)


#: scratch below this many bytes is ignored (scalars wrapped into tensors, tiny reductions)
_SCRATCH_MIN = 4096
#: measured scratch is rounded up to this many bytes, so that allocator noise cannot change
#: the graph (and with it the plan-cache key) from one process to the next
_SCRATCH_ROUND = 4096
_SCRATCH_FORMAT = "checkmate-scratch"
_SCRATCH_VERSION = 1
#: cache file (or device tag, with CHECKMATE_CACHE=0) -> {op key: bytes}
_SCRATCH_CACHE: dict[str, dict[str, int]] = {}
#: cache file -> (device tag, entries measured in this process and not yet written)
_SCRATCH_NEW: dict[str, tuple[str, dict[str, int]]] = {}
_TAGS: dict[str, str] = {}


def _scratch_bytes(node: fx.Node) -> int:
    """Scratch bytes ``node`` allocates beyond its outputs, measured once per signature and
    device by running the op on random inputs of its traced shapes (random and mutating
    ops: 0, they must not run outside the step). Measurements persist like op times, in
    ``<cache dir>/scratch/<device tag>.json`` (memory only with ``CHECKMATE_CACHE=0``);
    :func:`_flush_scratch` writes the new ones."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or is_mutation(target) or is_random(target):
        return 0
    vals = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    key = repr((node.target, torch.utils._pytree.tree_map(_describe, vals)))
    table, path, tag = _scratch_table(vals)
    if key not in table:
        with unset_fake_temporarily():  # the partitioner runs under AOTAutograd's fake mode
            table[key] = _measure_scratch(node, vals)
        if path is not None:
            _SCRATCH_NEW.setdefault(path, (tag, {}))[1][key] = table[key]
    return table[key]


def _scratch_table(vals: object) -> tuple[dict[str, int], str | None, str]:
    """The scratch table of the device of the first tensor in ``vals``; its file (None
    when the cache is disabled) and device tag."""
    from checkmate.cache import cache_dir, cache_enabled
    from checkmate.timing import device_tag

    devices = [x.device for x in torch.utils._pytree.tree_leaves(vals) if isinstance(x, torch.Tensor)]
    dev = str(devices[0]) if devices else "cpu"
    tag = _TAGS.get(dev)
    if tag is None:  # device_tag reads /proc/cpuinfo: once per device, not once per op
        tag = _TAGS[dev] = device_tag(dev)
    path = str(cache_dir() / "scratch" / f"{tag}.json") if cache_enabled() else None
    key = path or tag
    table = _SCRATCH_CACHE.get(key)
    if table is None:
        table = _read_scratch(Path(path)) if path is not None else {}
        _SCRATCH_CACHE[key] = table
    return table, path, tag


def _read_scratch(path: Path) -> dict[str, int]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring unreadable scratch-space cache {path}: {exc}", ProfileWarning, stacklevel=3)
        return {}
    if (
        not isinstance(doc, dict)
        or doc.get("format") != _SCRATCH_FORMAT
        or doc.get("version") != _SCRATCH_VERSION
    ):
        warnings.warn(
            f"ignoring scratch-space cache {path} of another format or version", ProfileWarning, stacklevel=3
        )
        return {}
    ops = doc.get("ops", {})
    if not isinstance(ops, dict):
        return {}
    return {str(k): int(v) for k, v in ops.items() if isinstance(v, int) and v >= 0}


def _flush_scratch() -> None:
    """Write the scratch measurements made since the last flush (merged with what other
    processes wrote meanwhile; atomic replace)."""
    while _SCRATCH_NEW:
        path, (tag, new) = _SCRATCH_NEW.popitem()
        merged = _read_scratch(Path(path))
        merged.update(new)
        doc = {"format": _SCRATCH_FORMAT, "version": _SCRATCH_VERSION, "device_tag": tag, "ops": merged}
        try:
            atomic_write_text(Path(path), json.dumps(doc, indent=0, sort_keys=True))
        except OSError as exc:
            warnings.warn(f"cannot write scratch-space cache {path}: {exc}", ProfileWarning, stacklevel=2)


def _measure_scratch(node: fx.Node, vals: object) -> int:
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


def _profile_id(profile: str | None, device: torch.device) -> str:
    from checkmate.profile import profile_id

    return profile_id(profile, device)
