"""The compiled step's own peak: measure a plan's halves as Inductor compiles them.

Inductor fuses, reorders and allocates its own buffers, so a plan's compiled step does not
hold what the plan's simulation says it holds. Measured on CPU with the per-op graph model:
GPT-2 at 0.78-0.83x its budget (a fused chain of pointwise ops never materializes the
values the model counts, so the plan recomputed more than the budget needed), a ResNet at
up to 1.035x (Inductor runs convolutions channels-last and reorders kernels). Neither
direction is fixed by a better static model alone: the excess depends on the schedule.

So with ``compiler="inductor"`` the planner checks each plan the way the step will run it
(:meth:`checkmate.runtime.Planner.partition`): Inductor compiles the forward and backward
the plan generated, and they run (a first forward shows the strides of the values it saves,
for which the backward is compiled; one whole step unmeasured, since a compiled half's first
call allocates what later calls do not; then forward and backward on the values it saved, in
one memory window, as AOTAutograd's runtime runs them) on the step's own parameters and inputs
where the graph only reads them and on copies where it writes them (BatchNorm's running
statistics), with the caller's random state restored afterwards, and
:func:`checkmate.memory.measure_peak`'s allocator count gives the compiled step's peak.
:func:`calibrate` then replans at the simulated target that the measured-to-simulated ratio
points to, until the measured peak is within the budget and uses most of it. The plans
themselves are Checkmate's (Jain et al., MLSys 2020); this module only measures them
compiled and picks one.
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from checkmate.codegen import SplitModules
from checkmate.eager import real_tensors
from checkmate.memory import MemoryTracker
from checkmate.tangents import zeros_strided

__all__ = [
    "Calibration",
    "ProfilerRunning",
    "Round",
    "calibrate",
    "compiled_peak",
    "prior_ratio",
    "profiler_hides",
]

#: what compiles one half: ``(module, example inputs, is_backward) -> callable(list)``
CompileHalf = Callable[[fx.GraphModule, list[Any], bool], Callable[[list[Any]], Any]]

#: a plan whose measured peak is at least this share of the budget is kept as it is: below,
#: it recomputes values the budget had room for
USE = 0.97
#: replans after the first measurement, at most
ROUNDS = 2
#: more replans when those end between a plan measured over the budget and one under it
#: that uses less than USE of it: the interpolation between the two is then the best guess
#: (on GPT-2 at 78 MiB the ratio step and one interpolation both went over, and the plan
#: kept held 0.79x the budget)
BRACKETED = 1
#: more replans while every plan measured is over the budget: the budget is the promise, a
#: round one compile (a small T5 at 0.6x its eager peak: the measured-to-simulated ratio rose
#: from 1.13 to 1.22 as the target fell, and the third plan measured 1.001x the budget)
UNFIT = 2
#: aim this far under the budget when replanning from a measured ratio (it is not exact)
AIM = 0.99


@dataclass(frozen=True)
class Round:
    """One measured plan: solved at ``target`` simulated bytes, simulated ``simulated``,
    measured ``measured`` compiled (None when measuring it failed)."""

    target: int
    simulated: int
    measured: int | None


@dataclass(frozen=True)
class Calibration:
    """The plan kept and how it was chosen.

    Attributes:
        chosen: index in ``rounds`` of the plan kept.
        rounds: every plan measured, in order.
        budget: the bytes the compiled step must fit.
        error: why measuring failed (then ``rounds`` holds the unmeasured first plan).
        no_plan_below: the simulated target at which replanning for less memory found no
            plan (the graph's least peak was reached), if it did.
    """

    chosen: int
    rounds: tuple[Round, ...]
    budget: int
    error: str | None = None
    no_plan_below: int | None = None

    @property
    def measured(self) -> int | None:
        """The kept plan's measured compiled peak."""
        return self.rounds[self.chosen].measured

    @property
    def fits(self) -> bool:
        m = self.measured
        return m is not None and m <= self.budget


def calibrate(
    first: Any,
    budget: int,
    *,
    simulated: Callable[[Any], int],
    cost: Callable[[Any], float],
    measure: Callable[[Any], int],
    replan: Callable[[int], Any | None],
    ceiling: int,
    start: int,
    prior: float | None = None,
) -> tuple[Any, Calibration]:
    """Choose among plans by their measured peaks.

    Args:
        first: the plan made at ``start`` simulated bytes (any object the callables take).
        budget: the bytes the measured peak must not exceed.
        simulated: a plan's simulated peak.
        cost: a plan's compute cost (the cheapest plan that fits is kept).
        measure: a plan's measured compiled peak (may raise: the plan is then kept unmeasured).
        replan: the plan at a simulated target, or None when there is none.
        ceiling: the simulated peak of keeping everything (no target above it helps).
        start: the target ``first`` was made at.
        prior: the measured-to-simulated ratio of a plan of the same graph at other sizes or
            another budget, measured before (:func:`prior_ratio`). Where it says ``first``
            would measure outside the window (under ``USE`` of the budget, or over it), the
            plan at the target it points to is measured first, and ``first`` only where no
            plan measured fits: a GPT-2 solved again at a budget 4 MiB lower measured four
            plans, the first at 0.75x its budget, where its plan before had measured 0.82x
            what it simulated.

    Returns:
        The plan kept (the cheapest measured within ``budget``; when none fits, the one
        measured least) and the record of the rounds.
    """
    rounds: list[Round] = []
    floor: int | None = None
    skipped = _ahead(first, budget, simulated, replan, ceiling, start, prior)
    plan, target = skipped or (first, start)
    plans = [plan]
    for k in range(ROUNDS + max(BRACKETED, UNFIT) + 1):
        try:
            got = measure(plan)
        except Exception as exc:  # never lose the plan to a failed measurement
            if not rounds:
                # the plan made at the budget, not one the prior put above it: it runs unmeasured
                why = str(exc) if isinstance(exc, ProfilerRunning) else repr(exc)[:300]
                return first, Calibration(0, (Round(start, simulated(first), None),), budget, why)
            break
        rounds.append(Round(target, simulated(plan), got))
        if USE * budget <= got <= budget:
            break
        if k >= ROUNDS + _extra(rounds, budget):
            break
        if got < budget and target >= ceiling:
            break  # it keeps everything already
        new = min(_next_target(rounds, budget), ceiling)
        if got > budget:
            new = min(new, target - 1)  # strictly less memory
        elif new <= target:
            break
        if any(r.target == new for r in rounds):
            break
        nxt = replan(new)
        if nxt is None:
            floor = new if got > budget else None
            break
        plan, target = nxt, new
        plans.append(plan)
    fitting = [k for k, r in enumerate(rounds) if r.measured is not None and r.measured <= budget]
    if not fitting and skipped is not None:  # the plan the prior passed over, measured after all
        late: int | None
        try:
            late = measure(first)
        except Exception:
            late = None
        if late is not None:
            rounds.append(Round(start, simulated(first), late))
            plans.append(first)
            if late <= budget:
                fitting = [len(rounds) - 1]
    if fitting:
        chosen = min(fitting, key=lambda k: (cost(plans[k]), k))
    else:
        chosen = min(range(len(rounds)), key=lambda k: rounds[k].measured or 0)
    return plans[chosen], Calibration(chosen, tuple(rounds), budget, no_plan_below=floor)


def _ahead(
    first: Any,
    budget: int,
    simulated: Callable[[Any], int],
    replan: Callable[[int], Any | None],
    ceiling: int,
    start: int,
    prior: float | None,
) -> tuple[Any, int] | None:
    """The plan to measure before ``first``, with its target: where ``prior`` predicts
    ``first`` measures outside ``[USE * budget, budget]``, the plan at the simulated target
    the prior points to (``AIM * budget`` measured); None where ``first`` is measured first."""
    if prior is None or not prior > 0:
        return None
    predicted = simulated(first) * prior
    if USE * budget <= predicted <= budget:
        return None
    target = min(int(AIM * budget / prior), ceiling)
    if target == start or (predicted < budget) != (target > start):  # the other way: no help
        return None
    got = replan(target)
    return None if got is None else (got, target)


def prior_ratio(checks: Sequence[Calibration]) -> float | None:
    """The measured-to-simulated ratio of the plan kept by the latest of ``checks`` (earlier
    checks of the same graph's structure) that measured a plan within its budget; None when
    none did."""
    for check in reversed(checks):
        kept = check.rounds[check.chosen]
        if check.fits and kept.measured and kept.simulated > 0:
            return kept.measured / kept.simulated
    return None


def _extra(rounds: list[Round], budget: int) -> int:
    """Replans allowed beyond ROUNDS: BRACKETED between a plan measured over ``budget`` and
    one under it, UNFIT while every plan measured was over it."""
    if _bracketed(rounds, budget):
        return BRACKETED
    if all(r.measured is not None and r.measured > budget for r in rounds):
        return UNFIT
    return 0


def _bracketed(rounds: list[Round], budget: int) -> bool:
    """Whether plans were measured both over and under ``budget``."""
    got = [r.measured for r in rounds if r.measured is not None]
    return any(m > budget for m in got) and any(m <= budget for m in got)


def _next_target(rounds: list[Round], budget: int) -> int:
    """The simulated target to plan at next, aiming the measured peak at ``AIM * budget``:
    when there are plans measured under and over the budget, interpolated between the
    fullest plan under it and the plan over it nearest above in target (the halfway target
    when that one was tried already); else the last plan's target scaled by its
    measured-to-simulated ratio.

    Measured peaks need not grow with the target (another strategy may win at a nearby
    target): on GPT-2 at 73 MiB a plan solved below one measured 76.9 MiB measured 81.0 MiB,
    and interpolating again towards the 76.9 MiB plan gave back the target just tried."""
    goal = AIM * budget
    under = [r for r in rounds if r.measured is not None and r.measured <= budget]
    over = [r for r in rounds if r.measured is not None and r.measured > budget]
    if under and over:
        lo = max(under, key=lambda r: r.measured or 0)
        above = [r for r in over if r.target > lo.target]
        hi = min(above, key=lambda r: r.target) if above else min(over, key=lambda r: r.measured or 0)
        if hi.measured != lo.measured and hi.target != lo.target:
            share = (goal - (lo.measured or 0)) / ((hi.measured or 0) - (lo.measured or 0))
            new = int(lo.target + share * (hi.target - lo.target))
            if any(r.target == new for r in rounds):
                new = (lo.target + hi.target) // 2
            return new
    last = rounds[-1]
    return int(goal * max(last.simulated, 1) / max(last.measured or 1, 1))


class ProfilerRunning(RuntimeError):
    """The compiled step cannot be measured on the CPU while a profiler runs."""


def profiler_hides(devices: Iterable[torch.device]) -> bool:
    """Whether a compiled step on ``devices`` cannot be measured now: a profiler runs and
    none is CUDA (on the CPU only the profiler sees the allocator, one profiler at a time;
    CUDA's own statistics measure beside one)."""
    return torch._C._autograd._profiler_enabled() and not any(d.type == "cuda" for d in devices)


def compiled_peak(
    modules: SplitModules,
    num_fwd_outputs: int,
    compile_half: CompileHalf,
    real_inputs: Sequence[Any] | None = None,
    *,
    dropped: frozenset[tuple[tuple[int, ...], torch.dtype]] = frozenset(),
) -> int:
    """The peak bytes of ``modules``' forward and backward compiled by ``compile_half``,
    run in one memory window (see the module docstring).

    Args:
        modules: the plan's halves (left unchanged: copies are compiled).
        num_fwd_outputs: how many of the forward's outputs are the model's (the rest are
            the values it saves for the backward).
        compile_half: what compiles a half (Inductor's ``compile_fx_inner``).
        real_inputs: the step's own tensors, in the forward's input order (torch.compile
            hands them to the backend); an input they lack, or whose shape, dtype or device
            differs, is made up as op timing makes its inputs (random floats, zero
            integers and booleans, the example value's strides).
        dropped: the sizes and dtypes of the model's outputs the loop drops when the backward
            starts (:func:`checkmate.trace.drop_outputs_beside_loss`); the others are held to
            the backward's end, as a loop keeping ``outputs = model(...)`` holds them.
    """
    with real_tensors():  # a constant the graph holds (DeBERTa's) is real: copied outside the fake mode
        fw, bw = copy.deepcopy(modules.forward), copy.deepcopy(modules.backward)
    fw_ph = [n for n in fw.graph.nodes if n.op == "placeholder"]
    bw_ph = [n for n in bw.graph.nodes if n.op == "placeholder"]
    tangent_ph = [n for n in bw_ph if n.name.startswith("tangents")]
    written = _written_inputs(modules.forward)
    devices = {v.device for n in fw_ph + bw_ph if isinstance(v := n.meta.get("val"), torch.Tensor)}
    if profiler_hides(devices):
        # only the profiler sees the CPU allocator, one profiler at a time; the count left
        # (storages made through the dispatcher) misses every buffer of Inductor's kernels:
        # a Llama-like step planned inside torch.profiler measured 3.0 MiB here and then
        # stepped at 12.8 MiB against a budget of 7.6 MiB
        raise ProfilerRunning(
            "a profiler is running (the step that plans was called inside torch.profiler or "
            "checkmate.memory.measure_peak), and on the CPU only the profiler sees what "
            "Inductor's kernels allocate; run the first step of each input shape outside the "
            "profiler, or pass example_inputs to checkmate.optimize"
        )
    with real_tensors(), torch.no_grad():
        fw_fn = compile_half(fw, [n.meta.get("val") for n in fw_ph], False)
        with torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"]):
            # a first forward shows the strides Inductor gives the saved values (channels-last
            # convolutions): the backward is compiled for those, as AOTAutograd compiles it
            outs = list(fw_fn(_inputs(fw_ph, real_inputs, written)))
            bw_example = [
                _like(v, o) for v, o in zip((n.meta.get("val") for n in bw_ph), outs[num_fwd_outputs:])
            ]
            bw_example += [n.meta.get("val") for n in bw_ph[len(bw_example) :]]
            del outs
            bw_fn = compile_half(bw, bw_example, True)

            def step(args: list[Any]) -> None:
                outs = list(fw_fn(args))
                kept, saved = outs[:num_fwd_outputs], outs[num_fwd_outputs:]
                del outs
                if dropped:  # before the backward makes the gradients, as the loop drops them
                    kept = [o for o in kept if not isinstance(o, torch.Tensor) or _key(o) not in dropped]
                # the outputs' gradients, made between the halves as autograd (or MadeZeros, for
                # those the loss leaves unread) makes them: one tensor each, of the example's
                # strides. Made from op timing's pool, each was a clone of a buffer as large,
                # both live at the boundary: a Llama's 1 MiB logits made the check measure its
                # step 0.88 MiB over what the step then measured
                vals = [n.meta.get("val") for n in tangent_ph]
                tangents = [
                    zeros_strided(tuple(v.shape), tuple(v.stride()), v.dtype, v.device)
                    if isinstance(v, torch.Tensor)
                    else v
                    for v in vals
                ]
                bw_args = saved + tangents
                del saved, tangents
                grads = bw_fn(bw_args)
                del grads, kept, bw_args

            # a first whole step unmeasured: a compiled half's first call can allocate what
            # later calls do not (Triton's autotuning runs kernels' configurations on copies of
            # their arguments). Measured with the first call, a GPT-2's plan on an H100 checked
            # at 1.5x its budget, and the plan that replaced it stepped at 0.76x
            step(_inputs(fw_ph, real_inputs, written))
            args = _inputs(fw_ph, real_inputs, written)
            gc.collect()
            with MemoryTracker() as tracker:
                step(args)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    return tracker.peak


def _inputs(placeholders: list[fx.Node], real: Sequence[Any] | None, written: set[str]) -> list[Any]:
    """The forward's inputs (see :func:`_input`)."""
    return [_input(n.meta.get("val"), real, k, copy=n.name in written) for k, n in enumerate(placeholders)]


def _key(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """A tensor's size and dtype (how the outputs beside a loss are named)."""
    return tuple(int(d) for d in t.shape), t.dtype


def _like(val: Any, got: Any) -> Any:
    """The example value ``val`` (a fake tensor) with the strides of ``got``, the tensor the
    compiled forward returned for it."""
    if not isinstance(val, torch.Tensor) or not isinstance(got, torch.Tensor) or got.stride() == val.stride():
        return val
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([val])
    if mode is None:
        return val
    with mode:
        return torch.empty_strided(tuple(val.shape), got.stride(), dtype=val.dtype, device=val.device)


def _written_inputs(gm: fx.GraphModule) -> set[str]:
    """Placeholders an op of ``gm`` writes (``copy_`` of BatchNorm's running statistics)."""
    out: set[str] = set()
    for n in gm.graph.nodes:
        schema = getattr(n.target, "_schema", None)
        if n.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, spec in zip(n.args, schema.arguments):
            write = spec.alias_info is not None and spec.alias_info.is_write
            if write and isinstance(arg, fx.Node) and arg.op == "placeholder":
                out.add(arg.name)
    return out


def _input(val: Any, real: Sequence[Any] | None, k: int, *, copy: bool) -> Any:
    """The tensor a placeholder with example value ``val`` gets: the caller's ``real[k]``
    when it matches (a copy when the graph writes it), else a made-up one."""
    if not isinstance(val, torch.Tensor):
        return val
    if real is not None and k < len(real):
        r = real[k]
        if (
            isinstance(r, torch.Tensor)
            and tuple(r.shape) == tuple(val.shape)
            and r.dtype == val.dtype
            and r.device == val.device
            and r.stride() == val.stride()
        ):
            return r.detach().clone() if copy else r.detach()
    from checkmate.timing import _Pool  # how op timing makes an input from an example value

    return _Pool(val.device).tensor(val, own=True)
