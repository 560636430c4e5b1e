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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import unset_fake_temporarily

from checkmate.cache import cached_solve
from checkmate.codegen import SplitModules, generate
from checkmate.trace import JointGraph, build_graph, recompute_dropout_from_mask
from solvers.errors import InfeasibleBudgetError, SolverError
from solvers.result import SolveResult, Status
from solvers.schedule import keep_all_peak

__all__ = ["PlanRecord", "Planner"]


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
    """

    index: int
    joint: JointGraph
    result: SolveResult
    modules: SplitModules
    reference_peak: int
    seconds: float

    @property
    def recomputes(self) -> int:
        return self.modules.recomputes

    def summary(self) -> str:
        """One line: graph size, budget, simulated peak, cost overhead, strategy."""
        from solvers.budget import format_bytes

        res = self.result
        g = self.joint.graph
        chosen = res.info.get("chosen", res.strategy)
        overhead = (res.cost or 0.0) / g.total_cost - 1.0 if g.total_cost else 0.0
        gap = f", gap to bound {res.gap:.1%}" if res.gap is not None else ""
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
    """

    budget: object
    strategy: str = "auto"
    profile: str | None = None
    time_limit: float | None = 30.0
    options: dict[str, Any] = field(default_factory=dict)
    plan_path: str | None = None
    records: list[PlanRecord] = field(default_factory=list)

    def backend(self) -> Callable[..., Any]:
        """A torch.compile backend running this planner's plans."""
        return aot_autograd(fw_compiler=_as_is, bw_compiler=_as_is, partition_fn=self.partition)  # type: ignore[no-any-return]

    def partition(
        self, joint: fx.GraphModule, joint_inputs: Sequence[Any], *, num_fwd_outputs: int, **_: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        """AOTAutograd's partition hook: plan the joint graph and generate its two halves."""
        start = time.perf_counter()
        device = _device_of(joint)
        recompute_dropout_from_mask(joint)
        jg = build_graph(
            joint,
            num_fwd_outputs,
            lambda nodes: _costs(joint, nodes, self.profile, device),
            scratch=_scratch_bytes,
            name=f"graph{len(self.records)}",
        )
        res = cached_solve(
            jg.graph,
            self.budget,
            self.strategy,
            time_limit=self.time_limit,
            options=self.options,
            profile_id=_profile_id(self.profile, device),
            plan_path=self.plan_path,
        )
        if not res.ok or res.schedule is None:
            if res.status == Status.INFEASIBLE:
                raise InfeasibleBudgetError(
                    res.budget, res.info.get("min_budget"), reference=res.info.get("reference")
                )
            raise SolverError(
                f"strategy {self.strategy!r} found no schedule within {res.budget:,} bytes for "
                f"{jg.graph.summary()} ({res.status}); raise the budget, give it more time "
                "(time_limit=...) or choose another strategy"
            )
        modules = generate(joint, jg, res.schedule)
        self.records.append(
            PlanRecord(
                index=len(self.records),
                joint=jg,
                result=res,
                modules=modules,
                reference_peak=int(res.info.get("reference") or keep_all_peak(jg.graph)),
                seconds=time.perf_counter() - start,
            )
        )
        return modules.forward, modules.backward


def _as_is(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """The compilers: run the generated modules unchanged (they use the boxed convention)."""
    return gm


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


_SCRATCH_CACHE: dict[str, int] = {}
#: scratch below this many bytes is ignored (scalars wrapped into tensors, tiny reductions)
_SCRATCH_MIN = 4096


def _scratch_bytes(node: fx.Node) -> int:
    """Scratch bytes ``node`` allocates beyond its outputs, measured once per signature by
    running the op on random inputs of its traced shapes (random and mutating ops: 0, they
    must not run outside the step)."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target._schema.is_mutable:
        return 0
    if torch.Tag.nondeterministic_seeded in target.tags:
        return 0
    vals = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    key = repr((node.target, torch.utils._pytree.tree_map(_describe, vals)))
    if key not in _SCRATCH_CACHE:
        with unset_fake_temporarily():  # the partitioner runs under AOTAutograd's fake mode
            _SCRATCH_CACHE[key] = _measure_scratch(node, vals)
    return _SCRATCH_CACHE[key]


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
    return extra if extra >= _SCRATCH_MIN else 0


def _describe(x: object) -> object:
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), str(x.dtype), str(x.device))
    return x


def _profile_id(profile: str | None, device: torch.device) -> str:
    from checkmate.profile import profile_id

    return profile_id(profile, device)
