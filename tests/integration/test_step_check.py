"""The training step measured whole under a byte budget: memory held outside the module.

A loss computed on the module's outputs holds logits-sized tensors between its forward and
backward, beside every activation the plan kept (:mod:`checkmate.stepcheck`).
"""

from __future__ import annotations

import copy
import functools
import itertools
import re
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

import checkmate  # noqa: E402
from checkmate.api import plans_of  # noqa: E402
from checkmate.measuring import _PATH_TRIES, _PROFILED_CALLS  # noqa: E402
from checkmate.memory import measure_peak  # noqa: E402
from checkmate.planner_common import OverheadWarning, _held_bytes  # noqa: E402
from checkmate.stepcheck import STEP_SLACK  # noqa: E402
from solvers import Graph, Schedule  # noqa: E402
from solvers.boundary import boundary_hold  # noqa: E402
from tests.integration._models import Logged, Skipping, TinyTransformer  # noqa: E402

pytestmark = pytest.mark.torch


def _head_model(vocab: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(),
        nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Linear(256, vocab),
    )  # fmt: skip


def _batch(vocab: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(256, 256, generator=g), torch.randint(0, vocab, (256,), generator=g)


def _step(model: Any, x: Any, y: Any, heavy: int = 1) -> None:
    # the loss outside the module: label smoothing and a z-loss hold logits-sized tensors, and
    # (heavy) a penalty on the sigmoids more than the room the first plan leaves for a loss
    # (three times the logits' bytes) before any step was measured, (heavy=2) and on entropy
    _loss(model(x), y, heavy).backward()


def _loss(out: Any, y: Any, heavy: int = 1) -> Any:
    loss = nn.functional.cross_entropy(out, y, label_smoothing=0.1) + 1e-4 * out.logsumexp(-1).pow(2).mean()
    if heavy:
        loss = loss + 1e-3 * out.sigmoid().pow(2).mean()
    if heavy > 1:
        logp = out.log_softmax(-1)
        loss = loss + 1e-2 * (logp.exp() * logp).sum(-1).mean()
    return loss


def _optimized(vocab: int, fraction: float) -> tuple[Any, Any, nn.Module, int, nn.Module]:
    """The batch, the model, a byte budget of ``fraction`` of its eager step's peak (its loss
    outside it), and the model optimized at it."""
    x, y = _batch(vocab)
    model = _head_model(vocab)
    budget = int(fraction * measure_peak(lambda: _step(copy.deepcopy(model), x, y)))
    return x, y, model, budget, checkmate.optimize(model, budget, time_limit=5)


def _ratio(message: str) -> float:
    """The ratio to the budget a warning that a step was measured over it gives."""
    match = re.search(r"measured [^,]*, ([0-9.]+)x", message)
    assert match, message
    return float(match.group(1))


def _drops(plans: list[Any]) -> int:
    """How many of ``plans`` were made again with the outputs dropped, after one holding them."""
    return sum(1 for a, b in itertools.pairwise(plans) if b.joint.dropped and not a.joint.dropped)


def _train(opt: Any, model: nn.Module, x: Any, y: Any, steps: int) -> list[warnings.WarningMessage]:
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes the measurement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            _step(opt, x, y)
            sgd.step()
            sgd.zero_grad()
    return caught


def test_a_loss_outside_the_module_is_measured_and_planned_around() -> None:
    x, y, model, budget, opt = _optimized(8192, 0.8)
    ref = copy.deepcopy(model)
    _step(opt, x, y)  # compiles and plans; the first plan guesses at the loss, too little
    model.zero_grad()
    first = measure_peak(lambda: _step(opt, x, y))
    model.zero_grad()  # the loop below accumulates no gradients
    assert first > STEP_SLACK * budget  # what the check is for: the loss holds the rest
    caught = _train(opt, model, x, y, 4)  # measured whole, compiled again with room, measured again
    # the step measured over the budget says so, once: the steps before it ran over, as `first` did
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert len(said) == 1 and "held outside the module" in said[0], said
    assert "inside the optimized module's forward" in said[0]
    assert _ratio(said[0]) >= STEP_SLACK
    records = plans_of(opt)
    assert len(records) == 2
    assert records[1].result.peak < records[0].result.peak  # the room came off the plan
    model.zero_grad()
    peak = measure_peak(lambda: _step(opt, x, y))
    print(f"measured {first / budget:.3f}x the budget before, {peak / budget:.3f}x after")
    assert peak <= STEP_SLACK * budget
    model.zero_grad()
    _step(opt, x, y)
    _step(ref, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_loss_outside_the_module_that_no_plan_leaves_room_for_warns_once_of_each() -> None:
    vocab = 4096
    x, y = _batch(vocab)
    model = _head_model(vocab)
    budget = int(0.6 * measure_peak(lambda: _step(copy.deepcopy(model), x, y)))
    opt = checkmate.optimize(model, budget, time_limit=5)
    caught = _train(opt, model, x, y, 6)
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    # that the steps ran over the budget before it was planned with room, then that no plan fits
    assert len(said) == 2, said
    assert "The module is compiled again at its next call" in said[0] and _ratio(said[0]) >= STEP_SLACK
    assert "could not make fit" in said[1] and "inside the optimized module" in said[1]
    # planned again once with the room it could leave; before, where the plan holding the logits
    # recomputed more than DROP_WORTH (its op timings say), once with them dropped before the
    # backward, as the loop computing its loss inline was seen to
    plans = plans_of(opt)
    assert len(plans) - _drops(plans) == 2, plans


class _Segmenter(nn.Module):
    """A small U-Net: per-pixel logits (32 classes), whose loss outside holds more than its
    first plan leaves room for at its forward/backward boundary."""

    def __init__(self, w: int = 16) -> None:
        super().__init__()

        def cbr(i: int, o: int, stride: int = 1) -> nn.Module:
            return nn.Sequential(nn.Conv2d(i, o, 3, stride, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

        self.e1, self.e2, self.e3 = cbr(3, w), cbr(w, 2 * w, 2), cbr(2 * w, 4 * w, 2)
        self.d2, self.d1 = cbr(6 * w, 2 * w), cbr(3 * w, w)
        self.out = nn.Conv2d(w, 32, 1)

    def forward(self, x: Any) -> Any:
        up = lambda t: nn.functional.interpolate(t, scale_factor=2, mode="bilinear")  # noqa: E731
        a = self.e1(x)
        b = self.e2(a)
        d = self.d2(torch.cat([up(self.e3(b)), b], 1))
        return self.out(self.d1(torch.cat([up(d), a], 1)))


def _segmentation_loss(out: Any, y: Any) -> Any:
    # cross-entropy with label smoothing and a Dice term: softmax and one-hot maps, held
    # between the forward and the backward, freed as the backward goes through them
    p, t = out.softmax(1), nn.functional.one_hot(y, 32).permute(0, 3, 1, 2).float()
    dice = 1 - (2 * (p * t).sum((0, 2, 3)) + 1) / (p.sum((0, 2, 3)) + t.sum((0, 2, 3)) + 1)
    return nn.functional.cross_entropy(out, y, label_smoothing=0.1) + dice.mean()


def _segmentation_step(model: Any, x: Any, y: Any) -> None:
    _segmentation_loss(model(x), y).backward()


def test_a_loss_outside_held_only_at_the_boundary_is_planned_as_room_there() -> None:
    # a step measured over its budget whose module, running, held no more than its plan: what
    # was held beyond is room at the forward/backward boundary only, where the loss runs. As
    # room beside the whole step, a segmentation net whose loss held 22.53 MiB there, at 0.8
    # of eager's peak, had no plan (below what one op needs) and stepped at 1.10x the budget,
    # warned twice; a plan holding less at its boundary measured 0.99x
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, 48, 48, generator=g), torch.randint(0, 32, (16, 48, 48), generator=g)
    torch.manual_seed(0)
    model = _Segmenter()
    ref = copy.deepcopy(model)
    whole = checkmate.optimize(copy.deepcopy(model), 1.0, profile="cpu")
    _segmentation_step(whole, x, y)
    budget = int(0.8 * plans_of(whole)[0].reference_peak)  # the costs: the bundled profile's
    opt = checkmate.optimize(model, budget, strategy="gap-cover", profile="cpu", time_limit=5)
    _segmentation_step(opt, x, y)
    (first,) = plans_of(opt)
    held, ran, _ = _held_bytes(first, as_run=True)  # each value dropped at its last read, as it runs
    planner = opt._checkmate_state.planner
    (step,) = planner.latest
    # measured (as stepcheck does): the module ran at its simulated peak, the loss held more than
    # the plan leaves at its boundary
    room = budget - held + (4 << 20)
    peak = held + room
    assert planner.check_step(step, peak, boundary=peak, apart=ran) == "replan"
    assert planner.outside[step] == 0  # nothing beside the module while it ran
    assert planner.outside_boundary[step] == room
    opt._checkmate_state.recompile = True  # as the step check asks
    model.zero_grad()
    _segmentation_step(opt, x, y)
    again = plans_of(opt)[-1]
    assert again is not first
    assert boundary_hold(again.joint.graph, again.result.schedule) <= budget - room
    assert (again.result.peak or 0) <= budget
    model.zero_grad()
    _segmentation_step(opt, x, y)
    ref.zero_grad()
    _segmentation_step(ref, x, y)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_every_shape_is_measured_again_after_the_module_is_compiled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a step compiled again (another shape measured over the budget) plans every shape anew: a
    # shape measured within the budget before is measured again, with the plan it now runs
    # (under DDP a short batch measured within it, planned again, ran 1.16x it unmeasured)
    vocab = 8192
    x, y = _batch(vocab)
    model = _head_model(vocab)
    budget = int(0.8 * measure_peak(lambda: _step(copy.deepcopy(model), x, y, heavy=2)))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes the measurement
    short, long = (x[:96], y[:96]), (x, y)
    events: list[str] = []
    with caplog.at_level("INFO", logger="checkmate"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for batch in [short] * 3 + [long] * 4 + [short] * 3:
            caplog.clear()
            _step(opt, *batch, heavy=2 if batch is long else 0)  # the long one's loss holds more per byte
            sgd.step()
            sgd.zero_grad()
            said = " ".join(r.getMessage() for r in caplog.records)
            if "the training step measured" in said:
                events.append(f"{len(batch[0])} measured {'over' if 'over its budget' in said else 'within'}")
            if "compiling it again" in said:
                events.append("compiled again")
    # the short batch within (maybe compiled again with less room than its first plan guessed
    # for the loss); the long one over, compiled again, within; the short one measured again
    assert events[0] == "96 measured within", events
    assert "256 measured over" in events, events
    over = events.index("256 measured over")
    assert set(events[1:over]) <= {"compiled again"}, events
    assert events[over:] == [
        "256 measured over",
        "compiled again",
        "256 measured within",
        "96 measured within",
    ], events


@pytest.mark.parametrize("optimizer", ["inside", "outside"])
def test_steps_each_measured_by_measure_peak_are_measured_whole_and_planned_around(optimizer: str) -> None:
    # a loop (or a benchmark) that measures every step with measure_peak: the step's own
    # profiler cannot start inside it, so the step is measured from the caller's events when
    # its block exits. Before, none was measured: every step ran 1.04x the budget, unwarned.
    # With the optimizer step inside the block the verdict comes at the block's exit; outside
    # it, at the optimizer step, after the block's events were read
    x, y, model, budget, opt = _optimized(8192, 0.8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)

    def step() -> None:
        _step(opt, x, y)
        if optimizer == "inside":
            sgd.step()
            sgd.zero_grad()

    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            peaks.append(measure_peak(step))
            if optimizer == "outside":
                sgd.step()
                sgd.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    print(" ".join(f"{p / budget:.3f}x" for p in peaks))
    assert peaks[1] > STEP_SLACK * budget  # the first plan's room for the loss is too little
    assert len(said) == 1 and "held outside the module" in said[0], said
    assert abs(_ratio(said[0]) - peaks[1] / budget) < 0.01  # the step measured is the caller's
    assert len(plans_of(opt)) == 2  # compiled again once, with room for the loss
    assert max(peaks[2:]) <= STEP_SLACK * budget


def test_a_step_whose_backward_runs_after_measure_peak_is_measured_at_a_later_call() -> None:
    # the caller's block ended before the backward: its events hold no whole step, which is
    # measured at the next call instead (not taken for measured, nor for a step without backward)
    x, y, model, _, opt = _optimized(8192, 0.8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    _step(opt, x, y)
    sgd.zero_grad()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            held: list[Any] = []
            measure_peak(functools.partial(lambda out: out.append(opt(x)), held))  # the forward alone
            _loss(held[0], y).backward()
            sgd.step()
            sgd.zero_grad()
    assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]  # none measured
    said = [
        str(w.message) for w in _train(opt, model, x, y, 2) if issubclass(w.category, checkmate.BudgetWarning)
    ]
    assert len(said) == 1 and "held outside the module" in said[0], said
    assert len(plans_of(opt)) == 2


@pytest.mark.parametrize("measured", [False, True])
def test_modules_optimized_apart_are_not_measured_as_each_others_outside(measured: bool) -> None:
    # two blocks optimized apart, each with its own budget (as FSDP2 wants): the first
    # block's step contains the second's, which is no memory outside the first. Each step run
    # inside the loop's measure_peak, the first block's verdict waited for its events, and
    # took the second's step for memory held outside (warned at 1.08x, compiled again)
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(2)]
    x = torch.randn(256, 256)
    per_block = int(0.7 * measure_peak(lambda: copy.deepcopy(blocks[0])(x).pow(2).sum().backward()))
    opts = [checkmate.optimize(b, per_block, time_limit=5) for b in blocks]
    sgd = torch.optim.SGD([p for b in blocks for p in b.parameters()], lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            step = lambda: opts[1](opts[0](x)).pow(2).sum().backward()  # noqa: E731
            peak = measure_peak(step) if measured else step()
            sgd.step()
            sgd.zero_grad()
            if measured:
                assert peak <= 2 * per_block, f"measured {peak:,} of budgets of {per_block:,} each"
    assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    if not measured:
        assert [len(plans_of(o)) for o in opts] == [1, 1]  # neither compiled again


def test_a_step_left_measured_does_not_leave_a_profiler_running_under_a_later_plan_or_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a loop without an optimizer step leaves the window open after the backward: planning
    # another model, or measure_peak, must not run inside that profiler (Inductor's compiled
    # check cannot measure inside one, and measure_peak would fall back to another method)
    from checkmate.memory import MemoryTracker
    from checkmate.runtime import Planner

    torch.manual_seed(0)
    x = torch.randn(64, 32)
    first = checkmate.optimize(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), 10**6)
    for _ in range(2):
        first.zero_grad()  # no gradients accumulated (a call finding them compiles again)
        first(x).pow(2).sum().backward()
    assert torch._C._autograd._profiler_enabled()  # the second call is being measured
    with MemoryTracker() as tracker:
        pass
    assert tracker.method == "allocator" and not torch._C._autograd._profiler_enabled()
    first.zero_grad()
    first(x).pow(2).sum().backward()  # measured at this call instead
    assert torch._C._autograd._profiler_enabled()
    seen: list[bool] = []
    original = Planner._trace

    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(torch._C._autograd._profiler_enabled())  # while the graph is timed
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Planner, "_trace", trace)
    second = checkmate.optimize(nn.Sequential(nn.Linear(32, 32), nn.GELU()), 10**6)
    second(x).sum().backward()
    assert seen == [False]


def test_a_module_dropped_while_its_step_is_measured_stops_the_profiler() -> None:
    # a module garbage-collected with its window open (a test's, a notebook cell's) must not
    # leave the profiler enabled: Inductor's compiled check cannot measure inside one
    import gc

    x = torch.randn(64, 32)

    def train() -> None:
        opt = checkmate.optimize(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), 10**6)
        for _ in range(2):
            opt.zero_grad()  # no gradients accumulated (a call finding them compiles again)
            opt(x).pow(2).sum().backward()
        assert torch._C._autograd._profiler_enabled()  # its second call is being measured

    train()
    gc.collect()
    assert not torch._C._autograd._profiler_enabled()


def test_a_step_measuring_what_its_compiled_graph_did_alone_is_not_planned_again_with_room() -> None:
    # Inductor's best plan of a Hugging Face ALBERT at 0.6 of eager's peak measured 2.76 MiB
    # against 2.68 (a BudgetWarning said so), and the step measured whole the same 2.76 MiB.
    # Taken for 0.6 MiB held outside the module, that room starved the plan made again: its
    # compiled step measured 13 MiB, keeping every value 4.00 MiB, and the step ran 1.49x
    from types import SimpleNamespace

    from checkmate.compiled import Calibration, Round
    from checkmate.runtime import Planner
    from solvers.budget import Budget
    from solvers.schedule import keep_all_peak
    from solvers.strategies.baselines import checkpoint_all
    from tests.graphs import chain

    graph = chain(8, mem=1 << 20, training=True)
    solved = keep_all_peak(graph)
    budget = int(0.9 * solved)
    alone = int(1.05 * budget)  # over the budget, past the step check's slack
    assert alone > STEP_SLACK * budget
    check = Calibration(0, (Round(solved, solved, alone),), budget)
    record = SimpleNamespace(
        result=checkpoint_all(graph, solved), joint=SimpleNamespace(graph=graph), compiled=check
    )
    planner = Planner(Budget(nbytes=budget), compiler="inductor")
    planner.records.append(record)  # type: ignore[arg-type]
    planner.latest["step"] = [0]
    assert planner.check_step("step", alone) is None
    assert not planner.outside
    # more than the graph measured alone is held outside it: planned again with room for that
    assert planner.check_step("step", int(1.2 * alone)) == "replan"
    assert planner.outside["step"] > 0


def test_the_first_calls_leave_room_for_a_float32_loss_on_bfloat16_outputs() -> None:
    # before any step is measured, the graph ending the forward is planned with room for a loss
    # on its outputs, counted in float32: under autocast the outputs are bfloat16 and the loss
    # upcasts them (planned without that room, the first two calls ran 1.14x the budget)
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 512, (1024,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)) for _ in range(4)]
    model = nn.Sequential(*blocks, nn.Linear(256, 512))  # a head: its outputs go to a loss
    ref = copy.deepcopy(model)

    def step(m: nn.Module) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x)
        nn.functional.cross_entropy(out.float(), y).backward()

    budget = int(0.6 * measure_peak(lambda: step(copy.deepcopy(model))))
    opt = checkmate.optimize(model, budget, time_limit=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        first = measure_peak(lambda: step(opt))  # plans; inside a profiler: not measured whole
        second = measure_peak(lambda: step(opt))
    print(f"first call {first / budget:.3f}x the budget, second {second / budget:.3f}x")
    assert plans_of(opt)[0].recomputes > 0
    assert max(first, second) <= STEP_SLACK * budget
    model.zero_grad()
    ref.zero_grad()
    step(opt)
    step(ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_room_guessed_for_a_loss_is_given_back_when_the_step_measures_less() -> None:
    # a loss that holds little beside large outputs: the room the first plan left for it is
    # measured, and the step compiled again with what was held, recomputing less
    vocab = 8192
    x, _ = _batch(vocab)
    model = _head_model(vocab)

    def step(m: Any, *_: Any) -> None:
        m(x).mean().backward()

    budget = int(0.8 * measure_peak(lambda: step(copy.deepcopy(model))))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(4):
            step(opt)
            sgd.step()
            sgd.zero_grad()
        model.zero_grad()
        peak = measure_peak(lambda: step(opt))
    # where the plan holding the logits recomputed more than DROP_WORTH (its op timings say), it
    # was planned again with them dropped, as the loop computing its loss inline was seen to
    plans = plans_of(opt)
    assert len(plans) - _drops(plans) == 2, plans
    first, last = plans[-2:]
    assert bool(first.joint.dropped) == bool(last.joint.dropped)
    print(
        f"simulated {first.result.peak:,} then {last.result.peak:,}; measured {peak / budget:.3f}x the budget"
    )
    assert last.result.peak > first.result.peak and last.recomputes < first.recomputes
    assert peak <= STEP_SLACK * budget


def test_room_guessed_for_a_loss_is_not_given_back_by_compiling_plans_that_keep_every_value() -> None:
    # at twice eager's peak every plan keeps every value, room for a loss or not: giving back
    # the room guessed for one, measured as nearly nothing (a mean), compiled the module again
    # at each shape's next call, the plans the same as before
    vocab = 8192
    model = _head_model(vocab)
    batches = [torch.randn(n, 256, generator=torch.Generator().manual_seed(n)) for n in (256, 192)]

    def step(m: Any, x: Any) -> None:
        m(x).mean().backward()

    budget = int(2.0 * measure_peak(lambda: step(copy.deepcopy(model), batches[0])))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    peaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(3):
            for x in batches:
                peaks.append(measure_peak(lambda x=x: step(opt, x)))
                sgd.step()
                sgd.zero_grad()
    planner = opt.__dict__["_checkmate_state"].planner
    print(f"{len(planner.records)} graphs; measured {[round(p / budget, 3) for p in peaks]}x the budget")
    assert planner.loss_guess == {} and planner.given_back, (
        "no room was guessed and measured: nothing to test"
    )
    assert all(r.is_eager for r in planner.records)
    assert len(planner.records) == len(batches)
    assert max(peaks) <= STEP_SLACK * budget


def test_steps_all_inside_a_profiler_of_the_users_warn_that_they_are_not_measured() -> None:
    # a torch.profiler around the whole loop: no step can be measured whole beside it (only
    # its owner reads its events), so the loss outside the module went unchecked, silently
    x, y, model, _, opt = _optimized(1024, 0.8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    state = opt.__dict__["_checkmate_state"]
    key = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
            for call in range(_PROFILED_CALLS + 3):
                _step(opt, x, y)
                sgd.step()
                sgd.zero_grad()
                key = key or next(iter(state.planner.latest))
                said = [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
                # the first call plans; from the second, each is due to be measured
                assert len(said) == (call >= _PROFILED_CALLS), (call, [str(w.message) for w in said])
        assert key not in state.stepped
        assert "ran inside a profiler" in str(said[0].message)
        _step(opt, x, y)  # outside it: measured whole at its optimizer step
        sgd.step()
    assert key in state.stepped and not state.profiled


def test_only_a_profiler_the_user_started_counts_as_theirs() -> None:
    # a step due to be measured inside another optimized module's measurement (a GAN's
    # discriminator inside its generator's step), or inside measure_peak, runs in no profiler of
    # the user's: only theirs keeps steps unmeasured, and warns after _PROFILED_CALLS calls
    from checkmate.memory import MemoryTracker
    from checkmate.stepcheck import open_window, users_profiler

    assert not users_profiler()
    window = open_window(torch.device("cpu"))
    assert window is not None and window.profiler is not None  # a window of checkmate's own
    try:
        assert torch._C._autograd._profiler_enabled() and not users_profiler()
    finally:
        window.abort()
    with MemoryTracker() as tracker:
        assert not users_profiler()
    assert tracker.method == "allocator"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert users_profiler()


def test_room_given_back_stays_at_the_boundary_where_the_loss_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # the loss (a square of the logits) holds 4 MiB between the forward and the backward, none
    # beside the first plan's peak (in its backward): given all its room back, the next plan
    # held more at its boundary and stepped at 1.058x the budget (then, planned again with room
    # for the excess, at +33.8% compute where the first plan cost +11.1%). Measured there, the
    # room given back stays at the boundary: the steps all fit, and the plan recomputes less
    from checkmate.runtime import Planner
    from tests.integration._models import TinyTransformer

    measured: list[int] = []
    check_step = Planner.check_step

    def spy(self: Planner, step: object, peak: int, *rest: Any, **kwargs: Any) -> str | None:
        measured.append(peak)  # each step the step check measures
        return check_step(self, step, peak, *rest, **kwargs)

    monkeypatch.setattr(Planner, "check_step", spy)
    torch.manual_seed(0)
    model = TinyTransformer(vocab=256, d=64, layers=2, p=0.1).train()
    x = torch.randint(0, 256, (16, 64))  # the budget: eager's embedding backward depends on the tokens

    def step(m: Any) -> None:
        m(x).float().pow(2).mean().backward()

    eager = copy.deepcopy(model)
    step(eager)  # its second step: the first allocates once what later ones reuse
    eager.zero_grad(set_to_none=True)
    budget = int(0.6 * measure_peak(lambda: step(eager)))
    # LP rounding: one schedule per budget (auto's portfolio may find one whose peak is at
    # the boundary, where the loss's bytes show in the step's peak), from the LP at the budget
    # alone, solved well within the limit: its default sweep over five tighter budgets took 21 s
    # here, so a 10 s limit cut it where the machine's load had it, and under the load of four
    # test workers the replan it cut short did not fit
    opt = checkmate.optimize(
        model,
        budget,
        strategy="lp-rounding",
        options={"budget_factors": (1.0,)},
        time_limit=60,
        profile="cpu",
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes the measurement
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(8):
            step(opt)
            sgd.step()
            sgd.zero_grad()
    print(
        f"budget {budget:,}; measured {[round(p / budget, 3) for p in measured]}x; {[f'+{r.overhead:.1%}' for r in plans_of(opt)]}"
    )
    assert len(measured) >= 2, "the room was not given back: nothing to test"
    first, *_, last = plans_of(opt)
    assert all(p <= STEP_SLACK * budget for p in measured), [p / budget for p in measured]
    assert last.overhead < first.overhead


def test_room_given_back_where_no_plan_leaves_it_at_the_boundary_is_left_beside_the_whole_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the room guessed for a cross-entropy outside the module (3 MiB) measured 1.99 MiB, all of
    # it at the boundary. Where no plan leaving it there is found (a solver cut short by its time
    # limit on a loaded machine: made so here, the solves with a boundary room refused), the
    # room was dropped, the plan held the whole budget at its boundary and stepped at 1.11x it,
    # where the guessed room's plan had stepped at 0.67x. The room is left beside the whole run
    # instead: every step fits, with no warning
    from checkmate.runtime import Planner
    from solvers.errors import InfeasibleBudgetError

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    refused: list[int] = []
    solve = Planner._solve

    def cut_short(
        self: Planner, jg: Any, profile_id: str, earlier: int = 0, room: int | None = None, **kw: Any
    ) -> Any:
        if room and self.outside_boundary and self.budget.nbytes is not None:
            refused.append(room)  # what a solver that found nothing in its time limit says
            raise InfeasibleBudgetError(self.budget.nbytes - room, self.budget.nbytes - room + (1 << 19))
        return solve(self, jg, profile_id, earlier, room, **kw)

    monkeypatch.setattr(Planner, "_solve", cut_short)
    torch.manual_seed(0)
    base = TinyTransformer(512, 64, 2)
    x = torch.randint(0, 512, (8, 64))

    def step(m: Any) -> None:
        nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()

    eager = copy.deepcopy(base)
    step(eager)
    eager.zero_grad(set_to_none=True)
    budget = int(0.78 * measure_peak(lambda: step(eager)))
    opt = checkmate.optimize(base, budget, time_limit=4)
    peaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(5):
            peaks.append(measure_peak(lambda: step(opt)))
            opt.zero_grad(set_to_none=True)
    print(f"budget {budget:,}; refused rooms {refused}; measured {[round(p / budget, 3) for p in peaks]}x")
    assert refused, "no room was given back at the boundary: nothing to test"
    assert len(plans_of(opt)) >= 2
    assert all(p <= STEP_SLACK * budget for p in peaks), [p / budget for p in peaks]


def test_steps_measured_again_thin_out() -> None:
    # at powers of two from REMEASURE_FROM, then every REMEASURE_EVERY calls: a few measures
    # early, where loops change (a warm-up ends), and one per REMEASURE_EVERY steps after
    from checkmate.measuring import REMEASURE_EVERY, REMEASURE_FROM, _due_again

    due = [n for n in range(1, 3 * REMEASURE_EVERY + 1) if _due_again(n)]
    doublings = (REMEASURE_EVERY // REMEASURE_FROM).bit_length()
    assert due[:doublings] == [REMEASURE_FROM << k for k in range(doublings)]
    assert due[doublings - 1 :] == [REMEASURE_EVERY, 2 * REMEASURE_EVERY, 3 * REMEASURE_EVERY]


def test_a_step_due_to_be_measured_again_inside_a_profiler_of_the_users_waits_without_a_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a loop that profiles a stretch of steps after the first measure (torch.profiler around
    # steps 4-40): the measures due in it (at calls 4, 8, 16 and 32 here) are skipped to their
    # next count, not taken for steps no profiler-free call measures, which warn after 16 calls
    import checkmate.measuring
    from checkmate.runtime import Planner

    measured: list[int] = []
    check_step = Planner.check_step

    def spy(self: Planner, step: object, peak: int, *rest: Any, **kwargs: Any) -> str | None:
        measured.append(peak)
        return check_step(self, step, peak, *rest, **kwargs)

    monkeypatch.setattr(Planner, "check_step", spy)
    monkeypatch.setattr(checkmate.measuring, "REMEASURE_FROM", 4)
    x, y, model, _, opt = _optimized(1024, 0.8)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    state = opt.__dict__["_checkmate_state"]

    def step() -> None:
        _step(opt, x, y)
        sgd.step()
        sgd.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error", checkmate.BudgetWarning)
        for _ in range(3):
            step()
        key = next(iter(state.planner.latest))
        assert key in state.stepped and state.planner.records, (
            "the first measure did not come: nothing to test"
        )
        before = len(measured)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            for _ in range(checkmate.measuring._PROFILED_CALLS + 21):
                step()
        assert len(measured) == before and key in state.stepped and not state.again and not state.profiled
        while not checkmate.measuring._due_again(state.step_calls[key] + 1):
            step()
        step()  # due: measured, outside the profiler
    assert len(measured) == before + 1 and key in state.stepped and state.planner.fitted == {key}


def test_a_step_measured_within_the_budget_is_measured_again_and_planned_for_a_loss_that_grew(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a loop whose loss outside the module changes after a warm-up (a mean of the logits, then a
    # cross-entropy with label smoothing and a z-loss: 16 MiB held between the forward and the
    # backward). Its step was measured once, within the budget, and from the change on it ran at
    # 1.22x the budget, unwarned. Measured again (at the 4th call, 8th, ... here), the step over
    # it is warned of and compiled again with room for the loss, and the steps after fit
    import checkmate.measuring

    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    monkeypatch.setattr(checkmate.measuring, "REMEASURE_FROM", 4)
    torch.manual_seed(0)
    base = TinyTransformer(2048, 64, 2)
    x = torch.randint(0, 2048, (8, 64))

    def light(m: Any) -> None:
        m(x).float().mean().backward()

    def heavy_loss(logits: torch.Tensor) -> torch.Tensor:
        z = torch.logsumexp(logits, -1).pow(2).mean()
        return nn.functional.cross_entropy(logits, x.flatten(), label_smoothing=0.1) + 1e-4 * z

    def heavy(m: Any) -> None:
        # computed inline, as the light loss is: the logits are dropped before the backward
        # (held, the plans made with them dropped would be made again holding them)
        heavy_loss(m(x).flatten(0, 1)).backward()

    eager = copy.deepcopy(base)
    light(eager)
    eager.zero_grad(set_to_none=True)
    budget = int(0.85 * measure_peak(lambda: heavy(eager)))
    opt = checkmate.optimize(base, budget, time_limit=4)
    sgd = torch.optim.SGD(opt.parameters(), lr=0.0)
    peaks = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(12):
            loss = light if i < 6 else heavy
            peaks.append(measure_peak(lambda loss=loss: loss(opt)))
            sgd.step()
            sgd.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    print(f"budget {budget:,}; measured {[round(p / budget, 3) for p in peaks]}x; {said}")
    assert all(p <= STEP_SLACK * budget for p in peaks[:6]), "the light loss's steps: nothing to test"
    assert max(peaks[6:]) > STEP_SLACK * budget, "the heavy loss fitted the first plans: nothing to test"
    assert len(said) == 1 and "measured within the budget" in said[0], said
    assert all(p <= STEP_SLACK * budget for p in peaks[-3:]), [p / budget for p in peaks]


@pytest.fixture
def fresh_dynamo() -> Any:
    """Dynamo's caches reset around the test: the blocks' forward is one code object across
    tests, each compile of it a cache entry, and eight (Dynamo's recompile limit) would have
    the second test's blocks run eagerly."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _skipping(
    fraction: float = 0.6, compiler: str = "aot"
) -> tuple[nn.Module, nn.Module, int, tuple[Any, Any], tuple[Any, Any]]:
    """The model, it optimized at ``fraction`` of eager's peak for a step keeping every block
    (with ``compiler``), that budget, a batch, and the masks keeping the first two blocks (each
    block's graph compiled, run once) and every block."""
    torch.manual_seed(0)
    model = Skipping()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)
    two, every = torch.tensor([True, True, False, False]), torch.ones(4, dtype=torch.bool)
    budget = int(fraction * measure_peak(lambda: copy.deepcopy(model)(x, y, every).backward()))
    opt = checkmate.optimize(model, budget, time_limit=5, compiler=compiler)
    return model, opt, budget, (x, y), (two, every)


def _logged(fraction: float) -> tuple[nn.Module, nn.Module, int, tuple[Any, Any], tuple[None, None]]:
    """As :func:`_skipping`, for :class:`Logged` blocks (no masks)."""
    torch.manual_seed(0)
    model = Logged()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(512, 256, generator=g), torch.randint(0, 10, (512,), generator=g)
    budget = int(fraction * measure_peak(lambda: copy.deepcopy(model)(x, y).backward()))
    return model, checkmate.optimize(model, budget, time_limit=5), budget, (x, y), (None, None)


def _blocks(name: str, fraction: float) -> tuple[nn.Module, nn.Module, int, tuple[Any, ...]]:
    """:class:`Skipping` (keeping every block) or :class:`Logged` blocks as :func:`_skipping`
    and :func:`_logged` optimize them, and the arguments of a step."""
    if name == "Skipping":
        model, opt, budget, (x, y), (_, every) = _skipping(fraction)
        return model, opt, budget, (x, y, every)
    model, opt, budget, (x, y), _ = _logged(fraction)
    return model, opt, budget, (x, y)


def _budget_warnings(model: nn.Module, opt: nn.Module, args: tuple[Any, ...], steps: int) -> list[str]:
    """The :class:`checkmate.BudgetWarning` messages of ``steps`` training steps of ``opt``
    (``model`` optimized) on ``args``, each closed by an optimizer step (which closes a step's
    measurement)."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt(*args).backward()
            sgd.step()
            sgd.zero_grad()
    return [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(("compiler", "fraction"), [("aot", 0.6), ("aot", 0.5), ("inductor", 0.6)])
def test_a_step_running_its_graphs_more_often_than_any_measured_is_measured_and_planned_for(
    compiler: str, fraction: float
) -> None:
    # steps of one input signature keeping two blocks, measured whole within the budget, then
    # steps keeping all four: the second block's graph runs three times, each run holding what
    # it saved, and no call compiles. Unchecked, they stepped at 1.21x the budget, silently.
    # Planned again with the runs taken for memory held outside the module, they stepped at
    # 1.15x, with a BudgetWarning. The first block's graph (its input needs no gradient) runs
    # before the three runs: planned alone when the step was planned again for them, it kept
    # all it saved and left them no plan (aot at 0.5 of eager's peak: 1.38x the budget;
    # inductor at 0.6: 1.09x; both warned); now every graph of the step is planned with the
    # others' needs in view, each run's counted
    model, opt, budget, (x, y), (two, every) = _skipping(fraction, compiler)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes the measurement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for keep in [two] * 4 + [every] * 8:
            opt(x, y, keep).backward()
            sgd.step()
            sgd.zero_grad()
        peaks = []
        for _ in range(2):
            peaks.append(measure_peak(lambda: opt(x, y, every).backward()))
            model.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    print(f"measured {[round(p / budget, 3) for p in peaks]}x the budget", said)
    # the step that ran the graphs more often than planned ran over the budget: said once, then no more
    assert len(said) == 1 and "ran more times than they were planned for" in said[0], said
    assert "layerdrop" in said[0]  # Dynamo's reason for the break: a branch on a tensor
    assert _ratio(said[0]) >= STEP_SLACK
    assert max(peaks) <= STEP_SLACK * budget
    planner = opt.__dict__["_checkmate_state"].planner
    assert sorted(planner.runs.values()) == [3]  # the blocks' graph, planned for its three runs


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("model_name", ["Skipping", "Logged"])
def test_a_graph_run_again_in_the_call_that_compiled_it_is_planned_for_its_runs_from_the_next_call(
    model_name: str,
) -> None:
    # a loop over blocks broken inside (LayerDrop's branch on a tensor; a logging helper Dynamo
    # does not trace) runs one graph per block: the call that compiled it planned it for one run.
    # Its runs were found only when a step was measured whole, the third call: the two before
    # it and it ran over (0.6 of eager's peak: 1.21x the budget, both models), warned after. Now
    # the next call is planned for the runs, and the call that compiled them, which runs over,
    # is warned of as its forward returns (before its backward runs over)
    model, opt, budget, args = _blocks(model_name, 0.6)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = measure_peak(lambda: opt(*args).backward())  # the call that compiled the blocks
        model.zero_grad()
        found = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
        caught.clear()
        said = _budget_warnings(model, opt, args, 1)  # the one that compiles them for their runs
        peak = measure_peak(lambda: opt(*args).backward())
        model.zero_grad()
    said += [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    print(f"measured {first / budget:.3f}x, then {peak / budget:.3f}x the budget", found, said)
    assert len(found) == 1 and "ran more times in it than they were planned for" in found[0], found
    estimate = float(re.search(r"\(([\d.]+)x the ", found[0]).group(1))  # type: ignore[union-attr]
    assert first > STEP_SLACK * budget, f"warned of a step at {first / budget:.3f}x the budget"
    assert abs(estimate - first / budget) < 0.2, (estimate, first / budget)
    assert peak <= STEP_SLACK * budget, f"{peak / budget:.3f}x the budget"
    assert not said
    planner = opt.__dict__["_checkmate_state"].planner
    assert sorted(planner.runs.values()) == [3]


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_graph_run_again_that_fits_the_budget_as_planned_is_not_compiled_again() -> None:
    # at twice eager's peak the Logged blocks' runs fit as planned for one run, and every plan
    # keeps every value: compiling the step again, for their runs or to give back the room
    # guessed for the graphs after the first, cost a compile and changed nothing
    _, opt, _, (x, y), _ = _logged(2.0)
    for _ in range(3):
        opt.zero_grad()  # no gradients accumulated (a call finding them compiles again)
        opt(x, y).backward()
    planner = opt.__dict__["_checkmate_state"].planner
    assert len(planner.records) == 2  # the first block's graph and the others', compiled once
    assert not planner.runs
    assert all(not r.recomputes for r in planner.records)


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_step_running_its_graphs_more_often_that_never_comes_back_to_be_measured_warns_once() -> None:
    # after a step keeping every block, the steps measured to meet another keep two blocks each:
    # none covers it, and after _PATH_TRIES of them a BudgetWarning says its peak is unchecked
    model, opt, _, (x, y), (two, every) = _skipping()
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    state = opt.__dict__["_checkmate_state"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for keep in [two] * 3 + [every] + [two] * (_PATH_TRIES + 4):
            opt(x, y, keep).backward()
            sgd.step()
            sgd.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    measured = [len(paths) for paths in state.measured_paths.values()]
    print(said, measured)
    assert len(said) == 1 and "ran the module's graphs a varying number of times" in said[0]
    assert measured == [1 + _PATH_TRIES]  # the first step measured, then as many more, and no more


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("model_name", ["Skipping", "Logged"])
def test_a_graph_whose_runs_no_plan_fits_beside_each_other_is_planned_as_one_run_and_warned_of(
    model_name: str,
) -> None:
    # at 0.45 of eager's peak the blocks' graph (least peak 7.00 MiB, 2.50 MiB of gradients a
    # run) has no plan beside its two other runs: planned as it was, the steps go on, warned of,
    # with what broke the loop: a branch on a tensor (LayerDrop's), or the helper Dynamo skips
    # (said to be LayerDrop's before)
    model, opt, _, args = _blocks(model_name, 0.45)
    said = _budget_warnings(model, opt, args, 6)
    runs = [m for m in said if "ran 3 times in it" in m and "no plan of it fits the budget" in m]
    assert len(runs) == 1, said
    if model_name == "Skipping":
        assert "layerdrop" in runs[0] and "Data-dependent branching" not in runs[0]
    else:
        assert "layerdrop" not in runs[0] and "make that code traceable" in runs[0]
        assert "Dynamo could not trace: " in runs[0] and "`_log_norm`" in runs[0]  # its name, no address
    # the steps measured over the budget are not taken for memory held outside (a loss)
    assert not any("held outside" in m for m in said), said


#: how the warning that the micro-batches before the first optimizer step exceeded the budget
#: with the gradients held begins
FIRST_MICRO_BATCHES = "a training step before this first optimizer step measured"


def _accumulate(model: Any, micro: list[tuple[Any, Any]]) -> None:
    for x, y in micro:  # one optimizer step's micro-batches: their gradients add up in .grad
        (nn.functional.cross_entropy(model(x), y) / len(micro)).backward()


def _micro_batches(vocab: int, k: int = 4) -> list[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(1024, 256, generator=g), torch.randint(0, vocab, (1024,), generator=g)) for _ in range(k)
    ]


def test_gradients_accumulated_over_micro_batches_are_planned_beside() -> None:
    # the gradients of the first micro-batch stay through the others: planned beside none, the
    # accumulation measured 1.03x its budget (1.15x at 0.6, 1.06x at 0.8), unwarned. Counted
    # from the loop's first optimizer step on, the first window still ran 1.03x (warned at that
    # step). Now the second micro-batch, finding gradients with no optimizer step since the
    # first, is planned beside them: every window within the budget, the first included
    vocab = 256
    micro = _micro_batches(vocab)
    model = _head_model(vocab)
    ref = copy.deepcopy(model)
    _accumulate(copy.deepcopy(model), micro)
    budget = int(0.7 * measure_peak(lambda: _accumulate(copy.deepcopy(model), micro)))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd, sgd_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            peak = measure_peak(lambda: _accumulate(opt, micro))
            assert peak <= STEP_SLACK * budget, f"step {step}: {peak / budget:.3f}x the budget"
            _accumulate(ref, micro)
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
            for o in (sgd, sgd_ref):
                o.step()
                o.zero_grad()
    assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    planner = opt.__dict__["_checkmate_state"].planner
    assert planner.held_grads == grads  # planned beside them
    assert not planner.grads_late  # added to in place, not freed
    assert len(plans_of(opt)) == 2  # the first micro-batch's plan, then one beside its gradients


@pytest.mark.parametrize("share", [0.85, 0.7])
def test_zeros_kept_by_zero_grad_set_to_none_false_are_planned_beside_from_the_first_call_holding_them(
    share: float,
) -> None:
    # the step after the first optimizer step already holds them: planned beside none (they were
    # counted from the next optimizer step on), it ran 1.09x its budget at 0.85, unwarned. At 0.7
    # no plan fits beside them (least peak 16.01 MiB + 4.26 MiB of zeros, of 19.96 MiB): warned
    # once, naming them and how to free them
    vocab = 256
    x, y = _micro_batches(vocab, k=1)[0]
    model = _head_model(vocab)
    ref = copy.deepcopy(model)
    budget = int(share * measure_peak(lambda: _accumulate(copy.deepcopy(model), [(x, y)])))
    opt = checkmate.optimize(model, budget, time_limit=5)
    planner = opt.__dict__["_checkmate_state"].planner
    sgd, sgd_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())

    def measured_step() -> None:
        for p in model.parameters():  # the zeros held at its start, allocated in the measurement
            p.grad = p.grad.clone()  # (its profiler sees no free of a block allocated before it)
        _accumulate(opt, [(x, y)])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            if step:
                assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
                peak = measure_peak(measured_step)
                if share == 0.85:
                    assert peak <= STEP_SLACK * budget, f"step {step}: {peak / budget:.3f}x the budget"
            else:
                _accumulate(opt, [(x, y)])
            _accumulate(ref, [(x, y)])
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p.grad, q.grad)
            for o in (sgd, sgd_ref):
                o.step()
                o.zero_grad(set_to_none=False)
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert planner.grads_zeroed and not planner.grads_late
    if share == 0.85:
        assert not said, said
        assert planner.held_grads == grads
        return
    assert len(said) == 1 and "(zeros kept by zero_grad(set_to_none=False))" in said[0], said
    assert "can exceed the budget by up to 4.26 MiB" in said[0] and "set_to_none=True" in said[0]
    assert planner.held_grads == 0  # planned without them


def test_gradients_accumulated_that_leave_no_plan_room_are_warned_of_once_and_planned_without() -> None:
    # the least peak found beside them is 1.05x the budget: planned as before they were found
    vocab = 256
    micro = _micro_batches(vocab)
    model = _head_model(vocab)
    _accumulate(copy.deepcopy(model), micro)
    budget = int(0.6 * measure_peak(lambda: _accumulate(copy.deepcopy(model), micro)))
    opt = checkmate.optimize(model, budget, time_limit=5)
    planner = opt.__dict__["_checkmate_state"].planner
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = micro[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            _accumulate(opt, micro)
            sgd.step()
            sgd.zero_grad()
        peak = measure_peak(lambda: nn.functional.cross_entropy(opt(x), y).backward())
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    # at the second micro-batch, that no plan fits beside the gradients the first left
    assert len(said) == 1 and "of gradients as the step started" in said[0], said
    assert "can exceed the budget by up to 4.26 MiB" in said[0]
    assert planner.grads_seen == sum(p.grad.nbytes for p in model.parameters())
    assert planner.held_grads == 0  # planned without them
    assert peak <= STEP_SLACK * budget  # the plan's own bytes, as before


class _LossInside(nn.Module):
    """A small language model that computes its cross-entropy: the backward, holding the
    logits' gradient and the head's, peaks above the forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = TinyTransformer(vocab=4000, d=128, layers=2)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.lm(idx).flatten(0, 1), target.flatten())


def _zeroed_late(model: Any, optimizer: Any, x: Any, y: Any, closure: bool) -> None:
    def forward_and_backward() -> Any:
        loss = model(x, y) if isinstance(model, _LossInside) else nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()  # between the forward and the backward, as PyTorch Lightning's loop calls it
        loss.backward()
        return loss

    if closure:  # Lightning's order: the optimizer step's pre-hooks run before the forward
        optimizer.step(forward_and_backward)
    else:
        forward_and_backward()
        optimizer.step()


@pytest.mark.parametrize(
    ("loss", "share", "closure"),
    [("inside", 0.9, False), ("outside", 0.85, False), ("outside", 0.85, True), ("outside", 0.7, False)],
)
def test_gradients_a_loop_frees_between_the_forward_and_the_backward_are_planned_beside_its_forward(
    loss: str, share: float, closure: bool
) -> None:
    # the last step's gradients are held through the forward, and freed before the backward.
    # Where the module computes the loss they are planned beside its forward only (at 0.9 no plan
    # fitted beside them through the whole step: planned beside none, warned that the steps could
    # exceed the budget by them); with the loss outside (which runs beside them too), through the
    # whole step, as accumulated ones are, with an OverheadWarning naming the loop's order and how
    # to free them earlier (a BudgetWarning that blamed accumulation before), and the BudgetWarning
    # that says so where no plan fits beside them (0.7)
    if loss == "inside":
        model: nn.Module = _LossInside()
        g = torch.Generator().manual_seed(0)
        x, y = (torch.randint(0, 4000, (8, 64), generator=g) for _ in range(2))
    else:
        model = _head_model(256)
        x, y = _micro_batches(256, k=1)[0]
    ref, eager = copy.deepcopy(model), copy.deepcopy(model)
    budget = int(
        share * measure_peak(lambda: _zeroed_late(eager, torch.optim.SGD(eager.parameters()), x, y, False))
    )
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd, sgd_ref = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())

    def measured_step() -> None:
        for p in model.parameters():  # the gradients held at its start, allocated in the measurement
            p.grad = p.grad.clone()  # (its profiler sees no free of a block allocated before it)
        _zeroed_late(opt, sgd, x, y, closure)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            _zeroed_late(opt, sgd, x, y, closure)
            _zeroed_late(ref, sgd_ref, x, y, closure)
            for p, q in zip(model.parameters(), ref.parameters()):
                assert torch.equal(p, q)
        peak = measure_peak(measured_step)  # over memory without the gradients
    planner = opt.__dict__["_checkmate_state"].planner
    assert planner.grads_late
    said = [
        str(w.message) for w in caught if issubclass(w.category, (checkmate.BudgetWarning, OverheadWarning))
    ]
    if loss == "inside":
        assert not said, said
        assert planner.held_grads == grads and not planner.late_throughout
        assert peak <= STEP_SLACK * budget, f"{peak / budget:.3f}x the budget"
        return
    assert len(said) == 1, said
    assert "frees only between the forward and the backward" in said[0] and "accumulated" not in said[0]
    assert "optimizer.zero_grad() right after optimizer.step()" in said[0] and "optimizer_step" in said[0]
    if share == 0.85:
        assert caught[[str(w.message) for w in caught].index(said[0])].category is OverheadWarning
        assert planner.held_grads == grads and planner.late_throughout
        assert peak <= STEP_SLACK * budget, f"{peak / budget:.3f}x the budget"
    else:
        assert "can exceed the budget by up to 4.26 MiB" in said[0]
        assert planner.held_grads == 0


def test_lightnings_accumulation_order_is_planned_beside_the_gradients_through_the_whole_step() -> None:
    # accumulate_grad_batches=2 in PyTorch Lightning's order: a window's first micro-batch zeroes
    # the gradients between its forward and its backward, the second runs inside
    # optimizer.step(closure), after the step's pre-hooks, holding the first's gradients through
    # its whole step. Taken for a loop freeing them late at every call (planned beside its
    # forward only), the second micro-batches measured 1.18x the budget, unwarned; found
    # accumulating but still read as late, a new input shape's plans (48 tokens, then 64) were
    # made so, and its second micro-batches measured 1.11x (warned)
    torch.manual_seed(0)
    model = _LossInside()
    g = torch.Generator().manual_seed(0)
    short, long = (
        [tuple(torch.randint(0, 4000, (8, n), generator=g) for _ in range(2)) for _ in range(8)]
        for n in (48, 64)
    )
    grads = sum(p.numel() * p.element_size() for p in model.parameters())

    def window(m: Any, sgd: Any, micro: list[Any], measure: bool = False) -> int:
        loss = m(*micro[0])
        sgd.zero_grad()
        (loss / 2).backward()

        def closure() -> Any:
            loss = m(*micro[1])
            (loss / 2).backward()
            return loss

        if measure:  # the first micro-batch's gradients held at its start: not in the peak measured
            return measure_peak(lambda: sgd.step(closure)) + grads
        sgd.step(closure)
        return 0

    eager = copy.deepcopy(model)
    sgd_eager = torch.optim.SGD(eager.parameters(), lr=0.0)
    window(eager, sgd_eager, long[:2])
    budget = int(0.8 * window(eager, sgd_eager, long[2:4], measure=True))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaks = [window(opt, sgd, short[2 * w : 2 * w + 2], measure=w == 3) for w in range(4)]
        peaks += [window(opt, sgd, long[2 * w : 2 * w + 2], measure=w >= 2) for w in range(4)]
    assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    planner = opt.__dict__["_checkmate_state"].planner
    assert planner.held_grads == grads and not planner.grads_late
    ratios = [round(p / budget, 3) for p in peaks if p]
    assert max(ratios) <= STEP_SLACK, f"{ratios}x the budget"


def test_a_loop_calling_backward_again_with_no_optimizer_step_is_planned_beside_its_gradients() -> None:
    # gradients held at a call with no optimizer step since the module's last one: its backward
    # left them, and they stay through this step. Planned beside none (counted only once an
    # optimizer step came), each step after the first measured 1.09x the budget, unwarned
    vocab = 256
    x, y = _micro_batches(vocab, k=1)[0]
    model = _head_model(vocab)
    budget = int(0.85 * measure_peak(lambda: _accumulate(copy.deepcopy(model), [(x, y)])))
    opt = checkmate.optimize(model, budget, time_limit=5)
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            nn.functional.cross_entropy(opt(x), y).backward()
        peak = measure_peak(lambda: nn.functional.cross_entropy(opt(x), y).backward())
    assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    # the gradients held at the measured step's start are counted in its peak: it started
    # with them, and the peak is measured beyond what was live then
    assert peak + grads <= STEP_SLACK * budget, f"{(peak + grads) / budget:.3f}x the budget"
    assert len(plans_of(opt)) == 2  # compiled again once, at the second call
    assert opt.__dict__["_checkmate_state"].planner.held_grads == grads


def test_another_modules_optimizer_step_reports_no_excess_of_a_module_it_does_not_step() -> None:
    # a module's second micro-batch comes after another model's optimizer step: the gradients it
    # holds are not yet known to be accumulated for its own (at 0.6 it measured 0.89x the budget
    # alone, 1.14x with them: near the least peak, any plan is over with them, where at 0.7 a
    # plan found under load could fit). Another model's optimizer step does not report that
    # excess (it fired there, naming the first module's budget, in a later test of the suite);
    # the module's own does
    vocab = 256
    x, y = _micro_batches(vocab, k=1)[0]
    model = _head_model(vocab)
    opt = checkmate.optimize(
        model, int(0.6 * measure_peak(lambda: _accumulate(copy.deepcopy(model), [(x, y)]))), time_limit=5
    )
    other = nn.Linear(4, 4)
    other_sgd = torch.optim.SGD(other.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            nn.functional.cross_entropy(opt(x), y).backward()
            other(torch.randn(2, 4)).sum().backward()
            other_sgd.step()  # closes the second call's measurement
        state = opt.__dict__["_checkmate_state"]
        assert state.over_with_grads is not None  # the excess was measured, for its own optimizer
        assert not [w for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
        torch.optim.SGD(model.parameters(), lr=0.0).step()  # its own: said now
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert len(said) == 1 and said[0].startswith(FIRST_MICRO_BATCHES), said


def _accumulate_heavy(model: Any, micro: list[tuple[Any, Any]]) -> None:
    for x, y in micro:  # the loss outside the module, several logits-sized tensors (_step)
        _step(model, x, y)


@pytest.mark.parametrize("share", [0.8, 0.7])
def test_a_loss_outside_beside_accumulated_gradients_is_measured_against_the_rest_of_the_budget(
    share: float,
) -> None:
    # each micro-batch's step is measured from its forward's start, past the gradients held from
    # the earlier ones: it has the budget less those. At 0.7 the loss alone holds more than that
    # rest (48 MiB beside 12 MiB of gradients, of 59 MiB), measured 1.15x over each optimizer step
    vocab = 8192
    g = torch.Generator().manual_seed(0)
    micro = [
        (torch.randn(256, 256, generator=g), torch.randint(0, vocab, (256,), generator=g)) for _ in range(4)
    ]
    model = _head_model(vocab)
    _accumulate_heavy(copy.deepcopy(model), micro)
    budget = int(share * measure_peak(lambda: _accumulate_heavy(copy.deepcopy(model), micro)))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes each measurement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):  # found accumulating, planned beside them, measured, planned with room
            _accumulate_heavy(opt, micro)
            sgd.step()
            sgd.zero_grad()
        peak = measure_peak(lambda: _accumulate_heavy(opt, micro))
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert opt.__dict__["_checkmate_state"].planner.held_grads == sum(p.nbytes for p in model.parameters())
    if share == 0.8:
        # the second micro-batch, planned beside the gradients with room guessed for the loss,
        # measured over (1.09x): said once, and planned with the room measured
        assert len(said) == 1 and "held outside the module" in said[0], said
        assert "beside 12.04 MiB of gradients held from earlier micro-batches" in said[0], said
        assert peak <= STEP_SLACK * budget, f"{peak / budget:.3f}x the budget"
    else:
        # the first optimizer step's micro-batches, planned beside no gradients, ran over: said once;
        # then that no plan fits beside the loss and the gradients
        assert len(said) == 2 and "The module is compiled again at its next call" in said[0], said
        assert "beside 12.04 MiB of gradients held from earlier micro-batches" in said[1], said


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.GELU(),
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256),
        )  # fmt: skip
        self.cls, self.reg = nn.Linear(256, 10), nn.Linear(256, 1)

    def forward(self, x: Any) -> tuple[Any, Any]:
        h = self.body(x)
        return self.cls(h), self.reg(h)


def _two_backwards(model: Any, x: Any, y: Any, t: Any) -> None:
    # a loss per head, each with its own backward through the one forward's graph
    a, b = model(x)
    nn.functional.cross_entropy(a, y).backward(retain_graph=True)
    nn.functional.mse_loss(b, t).backward()


def _two_heads_batch() -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randn(512, 256, generator=g),
        torch.randint(0, 10, (512,), generator=g),
        torch.randn(512, 1, generator=g),
    )


def _two_heads_at(fraction: float, x: Any, y: Any, t: Any) -> tuple[Any, Any, int]:
    """An eager two-headed model (its gradients zero), a copy to optimize, and the budget
    ``fraction`` of the eager step's peak."""
    eager = _TwoHeads()
    model = copy.deepcopy(eager)
    _two_backwards(eager, x, y, t)
    eager.zero_grad(set_to_none=True)
    budget = int(fraction * measure_peak(lambda: _two_backwards(eager, x, y, t)))
    eager.zero_grad(set_to_none=True)
    return eager, model, budget


@pytest.mark.parametrize("fraction", [0.85, 0.6])
def test_a_backward_run_again_through_one_forward_is_planned_with_what_it_saved_held(fraction: float) -> None:
    """``backward(retain_graph=True)`` then a second backward: autograd holds what the forward
    saved until the last backward, beside the first backward's gradients. Measured over the
    budget, the step is said to be that (not memory held outside the module) and planned
    again holding it, within the budget where a plan fits; where none does, warned so."""
    x, y, t = _two_heads_batch()
    eager, model, budget = _two_heads_at(fraction, x, y, t)
    opt = checkmate.optimize(model, budget, time_limit=4)
    sgd = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            for m, o in zip((opt, eager), sgd):
                _two_backwards(m, x, y, t)
                o.step()
                o.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), eager.parameters()))
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert said and all("retain_graph=True" in m and "held outside" not in m for m in said), said
    assert "compiled again" in said[0], said
    state = opt.__dict__["_checkmate_state"]
    assert state.planner.retained
    measured = measure_peak(lambda: _two_backwards(opt, x, y, t))
    print(f"\nretain_graph at {fraction}: budget {budget:,} B, measured {measured:,} B, {said}")
    if fraction == 0.85:  # a plan holding what the forward saved fits
        assert len(said) == 1, said
        assert plans_of(opt)[-1].recomputes > 0
        assert measured <= budget
    else:  # the first backward's gradients and the second's alone exceed it
        # said when planned as before, then with the ratio the step measured
        assert len(said) in (2, 3) and "no plan of this step fits" in said[1], said
        assert all("no plan" in m for m in said[1:]), said
        assert measured > budget


def test_a_step_run_again_through_one_forward_that_no_plan_fits_is_warned_of_before_it_exceeds() -> None:
    """The step measured over the budget is warned of as compiled again to fit; where no plan
    holding what the forward saves through both backwards fits, the step planned as before ran
    over the budget again, said only by the warning after the next step measured (a transformer
    at 0.6 of eager's peak: two more steps at 1.15x and 1.10x). Said when it is planned so."""
    x, y, t = _two_heads_batch()
    _, model, budget = _two_heads_at(0.6, x, y, t)
    opt = checkmate.optimize(model, budget, time_limit=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(5):
            peak = measure_peak(lambda: _two_backwards(opt, x, y, t))
            opt.zero_grad(set_to_none=True)
            said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
            if step >= 2 and peak > STEP_SLACK * budget:  # the third step on: planned as measured
                assert any("can exceed" in m or "no plan" in m for m in said), (step, peak / budget, said)
    assert said and all("compiled again" not in m for m in said[1:]), said


def test_a_plan_is_compared_with_its_measured_step_as_it_runs_each_value_dropped_at_its_last_read() -> None:
    # a -> b -> c -> d (d the backward's first node), a schedule freeing nothing: its simulation
    # holds a and b at the boundary, which the generated code drops at their last reads. Held
    # as simulated, the room measured beside a plan that keeps values so (a DTR-style one) was
    # too small by them, and the next plan stepped at 1.12-1.22x the budget
    nodes = [{"key": k, "name": k, "cost": 1.0, "mem": m} for k, m in (("a", 4), ("b", 2), ("c", 1))]
    nodes.append({"key": "d", "name": "d", "cost": 1.0, "mem": 1, "backward": True})
    graph = Graph.build(nodes, [("a", "b"), ("b", "c"), ("c", "d")], order=["a", "b", "c", "d"])
    lazy = Schedule(tuple(("compute", i) for i in range(4)))
    rec: Any = SimpleNamespace(
        joint=SimpleNamespace(graph=graph), result=SimpleNamespace(schedule=lazy, peak=8)
    )
    assert _held_bytes(rec)[:2] == (7, 8)
    assert _held_bytes(rec, as_run=True)[:2] == (1, 6)


class _WithLoss(nn.Module):
    """A model whose forward returns its loss: nothing is held outside it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()


def test_saved_tensor_hooks_holding_more_are_named_when_the_step_is_over() -> None:
    # a hook cloning each saved value on pack holds a second copy of what the plan keeps: the
    # step stepped at 1.80x a budget of 0.6 of eager's peak and was warned of as "a loss computed
    # on its outputs, tensors kept from them, another model's step"
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    model = _WithLoss()
    budget = int(0.6 * measure_peak(lambda: copy.deepcopy(model)(x).backward()))
    opt = checkmate.optimize(model, budget, time_limit=5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)  # its step closes the measurement
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
                loss = opt(x)
            loss.backward()
            sgd.step()
            sgd.zero_grad()
    said = [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    assert said and all(_ratio(s) > STEP_SLACK for s in said), said
    assert all("saved-tensor hooks" in s and "a loss computed on its outputs" not in s for s in said), said
