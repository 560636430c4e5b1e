"""Schedule -> forward and backward fx GraphModules that execute it.

The schedule's compute steps are split at its first backward compute. The forward module
replays the steps before it (a recompute is a second copy of the node, or for a dropout a
replay of its draw: :mod:`checkmate.rng`); it returns the
forward outputs and then every value the backward reads from it (the checkpoints the plan
keeps across the boundary). The backward module takes those saved values and the tangents
and replays the remaining steps in the plan's order, recomputes included.

Memory follows the plan because fx's Python codegen drops each local right after its last
use (``x = None``), and both modules use the boxed calling convention (they clear their
argument list), so a saved value dies at its last read in the backward, not at the end.
A view or ``getitem`` is recreated on demand from the current copy of its base: it costs
nothing and allocates nothing. A fused op folded into its readers (planning for Inductor,
see :mod:`checkmate.trace`) is recreated the same way inside each reader, and forgotten
after it, so Inductor fuses every copy into its reader's kernel.

The layout is the one AOTAutograd's partitioners produce: forward ``(primals...) ->
(*forward_outputs, *saved)``, backward ``(*saved, *tangents) -> (*gradients)``.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from checkmate.ops import is_view_node, output_mask
from checkmate.rng import replay_native_dropout, take_state
from checkmate.trace import JointGraph
from solvers.errors import PlanError, TraceError
from solvers.schedule import COMPUTE, Schedule, simulate

__all__ = ["SplitModules", "generate", "run_seconds", "split_point"]


@dataclass(frozen=True)
class SplitModules:
    """The generated step.

    Attributes:
        forward: ``(primals...) -> (*forward_outputs, *saved)``.
        backward: ``(*saved, *tangents) -> (*gradients)``.
        saved: names of the joint-graph values passed from forward to backward.
        recomputes: compute steps beyond the first of each node.
        seconds: the cost model's seconds of the op runs the two modules make. Outputs of
            one op computed one after another share a run, which the graph model, costing
            each output as the whole op, counts once per output (:func:`run_seconds`).
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: tuple[str, ...]
    recomputes: int
    seconds: float = 0.0


def split_point(jg: JointGraph, schedule: Schedule) -> int:
    """Index into ``schedule.computes`` of its first backward compute.

    Raises:
        PlanError: a node that must run in the forward (an output, a random op, a mutation)
            is first computed after it, or random ops are reordered.
    """
    computes = schedule.computes
    bwd = jg.graph.backward_mask
    split = next((k for k, i in enumerate(computes) if bwd[i]), len(computes))
    head = computes[:split]
    missing = jg.forward_required - set(head)
    if missing:
        node = jg.graph.nodes[min(missing)]
        raise PlanError(
            f"the plan computes {node.name!r} ({node.op}) after the backward has started; "
            "outputs, random ops and mutations must run in the forward. Re-plan with another "
            "strategy or report this plan"
        )
    replayed = {
        k for k, names in enumerate(jg.members) if names and jg.calls.get(names[0], ("",))[0] in jg.replayed
    }
    firsts = dict.fromkeys(i for i in head if not jg.graph.nodes[i].recomputable or i in replayed)
    rand = list(firsts)  # a replayed dropout's first computation draws: it keeps its place too
    if rand != sorted(rand):
        raise PlanError(
            "the plan reorders ops that may not be recomputed (random ops draw in a different "
            "order than in eager mode); re-plan with another strategy"
        )
    return split


class _Emitter:
    """Copies joint-graph nodes into ``graph``, one generation of each value at a time."""

    def __init__(
        self,
        jg: JointGraph,
        by_name: dict[str, fx.Node],
        graph: fx.Graph,
        env: dict[fx.Node, fx.Node],
        load: Callable[[fx.Node], fx.Node] | None,
    ) -> None:
        self.jg = jg
        self.by_name = by_name
        self.graph = graph
        self.env = env
        self.load = load  # backward: fetch a value computed in the forward
        self.computed: set[int] = set()
        # the multi-output op run last: (joint op, its copy, outputs taken from the copy)
        self.last: tuple[fx.Node, fx.Node, set[str]] | None = None
        self.runs: list[tuple[fx.Node, set[str]]] = []  # every multi-output op run, and what it gave
        # outputs of the last run taken early, when a sibling that may run only once ran,
        # and not yet computed by the schedule
        self.ahead: set[str] = set()
        self.inplace_adds = frozenset(jg.inplace.values())
        self.group_nodes: dict[int, list[fx.Node]] = {}
        for name, g in jg.group.items():
            self.group_nodes.setdefault(g, []).append(by_name[name])
        self.folded = frozenset(by_name[name] for name in jg.folded)
        self.scoped: list[fx.Node] = []  # folded values made for the node being emitted
        self.seconds = 0.0  # the graph model's cost of the op runs emitted
        # each generator state taken (checkmate::rng_state) -> its cost: one no replay reads
        # is dropped (:meth:`settle_states`)
        self.states: dict[fx.Node, float] = {}

    def compute(self, i: int) -> None:
        """Emit graph node ``i`` (a fresh copy: earlier copies' views become stale)."""
        for x in self.scoped:  # folded ops are recomputed inside each reader, never kept
            self.env.pop(x, None)
        self.scoped.clear()
        again = i in self.computed or self.load is not None  # the backward only recomputes
        self.computed.add(i)
        if not self.jg.members[i]:  # scratch space or the sink: nothing to run
            return
        name = self.jg.members[i][0]
        owner = self.by_name[name]
        if owner.op == "placeholder":  # a tangent: an input of the backward module
            return
        call = self.jg.calls.get(name)
        if call is not None and owner in self.env and not self.jg.graph.nodes[i].recomputable:
            return  # extracted when its random/mutating op ran (the op runs exactly once)
        if name in self.ahead:
            # taken from the op's latest run when a sibling that runs once did, and no other
            # op has run since (``ahead`` is emptied whenever ``last`` changes): this compute
            # is that run's (a BatchNorm's output, scheduled after its running statistics, ran
            # the op a second time before)
            self.ahead.discard(name)
            return
        for x in self.group_nodes.get(i, ()):
            self.env.pop(x, None)
        if call is None:
            run = self._dropout_run(owner)
            if run is not None:  # the dropout just ran: its output is this value
                node = self.graph.call_function(operator.getitem, (run, 0))
                node.meta = dict(owner.meta)
                self.env[owner] = node
            else:
                self.env[owner] = self.graph.node_copy(owner, self.get)
                self.seconds += float(self.jg.graph.cost[i])
                if owner.target is torch.ops.checkmate.rng_state.default:
                    self.states[self.env[owner]] = float(self.jg.graph.cost[i])
            self.last = None
            self.ahead.clear()
            acc = self.jg.inplace.get(name)
            if acc is not None:  # a gradient sum done in place into this addend
                add = self.by_name[acc]
                other = next(a for a in add.all_input_nodes if a is not owner)
                node = self.graph.call_function(
                    torch.ops.aten.add_.Tensor, (self.env[owner], self.get(other))
                )
                node.meta = dict(add.meta)
                self.env[add] = node
            return
        op = self.by_name[call[0]]
        if self.last is None or self.last[0] is not op or name in self.last[2]:
            # run the op; outputs computed right after this one reuse the same run
            run = self._replay(op) if again and op.name in self.jg.replayed else None
            self.last = (op, run or self.graph.node_copy(op, self.get), set())
            if op.name not in self.jg.split:  # else each output taken costs its share (_take)
                self.seconds += float(self.jg.graph.cost[i])
            self.runs.append((self.last[1], self.last[2]))
            self.ahead.clear()
        _, run, taken = self.last
        self._take(run, name, taken)
        self._take_siblings_read(i, call[0], run, taken)
        if not self.jg.graph.nodes[i].recomputable:
            # an op that may run only once: take every output now (later computes of its
            # siblings find them in env)
            for sib, (c, _) in self.jg.calls.items():
                if c == call[0] and sib not in taken:
                    self._take(run, sib, taken)
                    if self.jg.group.get(sib) not in self.computed:
                        self.ahead.add(sib)

    def _dropout_run(self, node: fx.Node) -> fx.Node | None:
        """The run of the dropout whose output ``node`` computes again from its mask
        (:attr:`JointGraph.from_mask`), when that run is the op emitted last, else None.

        The run made the output already, as eager's forward does (a replay too), and the
        same bits: taking it saves an elementwise pass over the activation per dropout (13
        passes of a 4-layer GPT-2's step) and costs no memory, since the run allocated it
        anyway. A value folded into its readers (Inductor) is left to them."""
        dropout = self.jg.from_mask.get(node.name)
        if dropout is None or node in self.folded or self.last is None:
            return None
        op, run, _ = self.last
        return run if op.name == dropout else None

    def settle_states(self) -> None:
        """Remove each generator state taken (``checkmate::rng_state``) that no replay of a
        dropout reads: the plan recomputes that dropout's output from its kept mask, never
        its mask, and reading the generator's state changes nothing (on the CPU a 5 KB copy
        through the custom op's dispatch, about 23 us, 13 of them in a 4-layer GPT-2's
        step). The others take the state by a plain call (:func:`checkmate.rng.take_state`)."""
        for node, cost in self.states.items():
            if not node.users:
                self.graph.erase_node(node)
                self.seconds -= cost
            else:
                node.target = take_state
        self.states.clear()

    def _replay(self, op: fx.Node) -> fx.Node:
        """A recompute of dropout ``op``: the same draw, from the generator state taken
        before it first ran (:func:`checkmate.rng.replay_native_dropout`)."""
        x, p, train = op.args[:3]
        state = self.get(self.by_name[self.jg.replayed[op.name]])
        run = self.graph.call_function(replay_native_dropout, (self.get(x), p, train, state))  # type: ignore[arg-type]
        run.meta = dict(op.meta)
        return run

    def _take(self, run: fx.Node, name: str, taken: set[str]) -> None:
        """Make output ``name`` of the op run ``run`` the current copy of that joint node."""
        node = self.graph.call_function(operator.getitem, (run, self.jg.calls[name][1]))
        node.meta = dict(self.by_name[name].meta)
        self.env[self.by_name[name]] = node
        if self.jg.calls[name][0] in self.jg.split and name not in taken:
            self.seconds += float(self.jg.graph.cost[self.jg.group[name]])
        taken.add(name)

    def _take_siblings_read(self, i: int, op: str, run: fx.Node, taken: set[str]) -> None:
        """Take from ``run`` the outputs of its op that graph node ``i`` reads (its siblings
        listed before it, :func:`checkmate.trace._sibling_reads`) and this run has not given
        yet: the run made them again, and the plan counts one copy of each, the one resident.
        Bitwise the same values; readers after this take the new copy (views of the older one
        are made again from it), and the older one dies at its last read before the run."""
        for p in self.jg.graph.preds[i]:
            names = self.jg.members[p]
            if not names or names[0] in taken or self.jg.calls.get(names[0], ("",))[0] != op:
                continue
            for x in self.group_nodes.get(int(p), ()):
                self.env.pop(x, None)
            self._take(run, names[0], taken)

    def finish(self) -> None:
        """Ask each run of an op with an output mask (``convolution_backward``,
        ``native_batch_norm_backward``, ...) for the outputs the plan takes from it only.

        The graph model gives each output of a multi-output op a node of its own, so a plan
        may recompute one of them alone (a weight gradient, without the input gradient the
        same ``convolution_backward`` makes). Run with the traced mask, the op would allocate
        the others too, beside the ones the plan counted: a DenseNet-like CNN planned at its
        least peak measured 1.07x it that way. Masked off, an output is not computed at all;
        the ones computed are bitwise the same."""
        for run, taken in self.runs:
            found = output_mask(run.target)
            if found is None:
                continue
            at, name = found
            positional = at < len(run.args)
            mask = run.args[at] if positional else run.kwargs.get(name)
            if not isinstance(mask, (list, tuple)):
                continue
            keep = {self.jg.calls[n][1] for n in taken}
            trimmed = [bool(m) and k in keep for k, m in enumerate(mask)]
            if trimmed == [bool(m) for m in mask]:
                continue
            if positional:
                run.args = (*run.args[:at], trimmed, *run.args[at + 1 :])
            else:
                run.kwargs = {**run.kwargs, name: trimmed}
            val = run.meta.get("val")
            if isinstance(val, (list, tuple)):
                run.meta["val"] = type(val)(v if k in keep else None for k, v in enumerate(val))

    def _view_in_group(self, n: fx.Node, g: int) -> bool:
        """Whether ``n`` is a view of a value of group ``g``: the backward loads that value
        once and recreates the view from it, as PyTorch's partitioner does, instead of
        taking each view the backward reads as a value of its own from the forward (a
        ResNet's BatchNorm statistics were saved once per ``unsqueeze``: 38 more saved
        tensors than PyTorch's for the same values)."""
        return is_view_node(n) and any(self.jg.group.get(a.name) == g for a in n.all_input_nodes)

    def get(self, n: fx.Node) -> fx.Node:
        """The current copy of joint node ``n``, recreating views on demand."""
        v = self.env.get(n)
        if v is not None:
            return v
        g = self.jg.group.get(n.name)
        if n.op == "placeholder":
            if self.load is None:
                raise AssertionError(f"placeholder {n.name} missing from the forward")
            v = self.load(n)
        elif (
            self.load is not None
            and g is not None
            and g not in self.computed
            and isinstance(n.meta.get("val"), torch.Tensor)
            and not self._view_in_group(n, g)
        ):
            v = self.load(n)
        else:
            if g is not None and (self.jg.members[g] == (n.name,) or n.name in self.inplace_adds):
                raise AssertionError(f"the plan reads {n.name}, which is not resident")
            v = self.graph.node_copy(n, self.get)
            if n in self.folded:
                self.scoped.append(n)
        self.env[n] = v
        return v


def generate(
    gm: fx.GraphModule, jg: JointGraph, schedule: Schedule, budget: int | None = None
) -> SplitModules:
    """Build the forward and backward modules that execute ``schedule``.

    Args:
        gm: the joint graph ``jg`` was built from.
        jg: its model (see :func:`checkmate.trace.build_graph`).
        schedule: a schedule the simulator validated on ``jg.graph``.
        budget: the bytes it was planned for (default: its simulated peak).

    Returns:
        The two modules and what passes between them.

    Raises:
        PlanError: the schedule cannot be split into a forward and a backward.
        TraceError: the joint graph has inputs other than primals and tangents.
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    primals = [p for p in placeholders if p.name.startswith("primals")]
    tangents = [p for p in placeholders if p.name.startswith("tangents")]
    if len(primals) + len(tangents) != len(placeholders):
        odd = [p.name for p in placeholders if p not in primals and p not in tangents]
        raise TraceError(
            f"the joint graph has inputs {odd} that are neither primals nor tangents "
            "(functionalized RNG or backward state?); checkmate does not handle them: "
            "leave torch._functorch.config.functionalize_rng_ops off"
        )
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    outputs = list(out_node.args[0])  # type: ignore[arg-type]
    computes = schedule.computes
    split = split_point(jg, schedule)
    # the simulated bytes in use after each compute, and the plan's budget, on the nodes each
    # compute emits (``meta["checkmate_memory"]``): Inductor's fusion heuristics read them
    # (checkmate.backends.PlanOrderChoices)
    timeline = simulate(jg.graph, schedule).timeline
    after = [int(timeline[s]) for s, (op, _) in enumerate(schedule.steps) if op == COMPUTE]
    ceiling = int(budget) if budget is not None else int(timeline.max(initial=0))

    # forward
    fw = fx.Graph()
    fenv: dict[fx.Node, fx.Node] = {}
    for p in primals:
        fenv[p] = fw.placeholder(p.name)
        fenv[p].meta = dict(p.meta)
    femit = _Emitter(jg, by_name, fw, fenv, load=None)
    for k, i in enumerate(computes[:split]):
        _annotate(femit, i, (after[k], ceiling))
    fw_outs = [femit.get(o) if isinstance(o, fx.Node) else o for o in outputs[: jg.num_fwd_outputs]]

    # backward: values from the forward become placeholders ahead of the tangents
    bw = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    tangent_phs = []
    for t in tangents:
        benv[t] = bw.placeholder(t.name)
        benv[t].meta = dict(t.meta)
        tangent_phs.append(benv[t])
    saved: list[fx.Node] = []
    saved_phs: list[fx.Node] = []

    def load(n: fx.Node) -> fx.Node:
        if saved_phs:
            ctx = bw.inserting_after(saved_phs[-1])
        elif tangent_phs:
            ctx = bw.inserting_before(tangent_phs[0])
        else:
            ctx = bw.inserting_before(next(iter(bw.nodes), None))  # type: ignore[arg-type]
        with ctx:
            ph = bw.placeholder(f"saved_{n.name}")
        ph.meta = dict(n.meta)
        saved.append(n)
        saved_phs.append(ph)
        return ph

    bemit = _Emitter(jg, by_name, bw, benv, load=load)
    for k, i in enumerate(computes[split:], start=split):
        _annotate(bemit, i, (after[k], ceiling))
    bw_outs = [bemit.get(o) if isinstance(o, fx.Node) else o for o in outputs[jg.num_fwd_outputs :]]
    bw.output(tuple(bw_outs))
    # mutated inputs (BatchNorm running statistics) are saved without AOTAutograd's version
    # check, which would fail after the copy-back of their new value: such values go last
    late = [k for k, n in enumerate(saved) if n.name in jg.mutated]
    if late:
        keep = [k for k in range(len(saved)) if k not in late] + late
        saved = [saved[k] for k in keep]
        saved_phs = [saved_phs[k] for k in keep]
        anchor = tangent_phs[0] if tangent_phs else next(n for n in bw.nodes if n.op != "placeholder")
        for ph in saved_phs:
            anchor.prepend(ph)

    saved_fw = [femit.get(n) for n in saved]
    for n, v in zip(saved, saved_fw):
        if n.name in jg.mutated:
            v.meta["saved_tensor_with_no_vc_check"] = True
    femit.finish()
    bemit.finish()
    fw.output(tuple(fw_outs + saved_fw))
    femit.settle_states()
    bemit.settle_states()
    counts = schedule.compute_counts(jg.graph.n)
    return SplitModules(
        forward=_module(gm, fw),
        backward=_module(gm, bw),
        saved=tuple(n.name for n in saved),
        recomputes=int((counts - 1).clip(min=0).sum()),
        seconds=femit.seconds + bemit.seconds,
    )


def run_seconds(jg: JointGraph) -> float:
    """The cost model's seconds of running each op of ``jg`` once, as eager PyTorch does.

    The graph model gives each output of a multi-output op a node costing the whole op
    (recomputing any one output runs it again), so ``jg.graph.total_cost`` counts a BatchNorm
    once per output it is read through: a ResNet-like CNN's 123 ms where its ops take 63 ms.
    Here each op counts once (the outputs of an op whose cost is split among them,
    :attr:`JointGraph.split`, add up to it); the plan's :attr:`SplitModules.seconds` over this,
    less one, is the compute its recomputes add. Eager PyTorch takes no generator states and
    has its dropouts' outputs from the dropouts: those ops (:mod:`checkmate.rng`,
    :attr:`JointGraph.from_mask`) count only where a plan runs them."""
    cost = jg.graph.cost
    ops: dict[str, float] = {}
    total = 0.0
    not_eager = set(jg.from_mask) | set(jg.replayed.values())
    for i, names in enumerate(jg.members):
        if not names or names[0].startswith("tangents"):  # scratch, the sink, a step input
            continue
        if names[0] in not_eager:
            continue
        call = jg.calls.get(names[0])
        if call is None:
            total += float(cost[i])
        elif call[0] in jg.split:
            ops[call[0]] = ops.get(call[0], 0.0) + float(cost[i])
        else:
            ops[call[0]] = max(ops.get(call[0], 0.0), float(cost[i]))
    return total + sum(ops.values())


def _annotate(emitter: _Emitter, i: int, memory: tuple[int, int]) -> None:
    """Emit graph node ``i`` and mark the nodes it appended with ``memory``."""
    root = emitter.graph._root  # the sentinel of fx's node list: its prev is the last node
    last = root.prev
    emitter.compute(i)
    node = last.next
    while node is not root:
        if node.op == "call_function":
            node.meta["checkmate_memory"] = memory
        node = node.next


def _module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule with the boxed calling convention (it clears its argument list, so
    each input can die at its last use)."""
    graph.set_codegen(_BoxedCodeGen())
    graph.lint()
    mod = fx.GraphModule(root, graph)
    assert mod._boxed_call  # GraphModule derives it from the codegen
    return mod
