"""Measured peak memory: exact on known allocations, views once, plausible on a training step."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

from checkmate.memory import MemoryTracker, Method, measure_peak

pytestmark = pytest.mark.torch

MB = 1 << 20
METHODS: list[Method] = ["allocator", "storages"]


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


@pytest.mark.parametrize("method", METHODS)
def test_known_allocations_give_the_exact_peak(method: Method) -> None:
    def step() -> None:
        a, b, c = _bytes(1 * MB), _bytes(2 * MB), _bytes(3 * MB)  # 6 MB live
        del b  # 4 MB
        d = _bytes(1 * MB)  # 5 MB
        e = _bytes(3 * MB)  # 8 MB: the peak
        del a, c, d, e
        f = _bytes(7 * MB)  # 7 MB, below the peak
        del f

    assert measure_peak(step, method=method) == 8 * MB


@pytest.mark.parametrize("method", METHODS)
def test_freed_memory_is_reused_in_the_count(method: Method) -> None:
    def step() -> None:
        for _ in range(5):
            x = torch.zeros(MB // 4)  # 1 MB, freed when rebound
            del x

    assert measure_peak(step, method=method) == MB


@pytest.mark.parametrize("method", METHODS)
def test_views_share_their_base_and_are_counted_once(method: Method) -> None:
    def step() -> list[torch.Tensor]:
        base = torch.zeros(256, 1024)  # 1 MB
        return [base.t(), base[3:], base.view(-1), base.unsqueeze(0), base.detach(), *base.split(64)]

    assert measure_peak(step, method=method) == MB


@pytest.mark.parametrize("method", METHODS)
def test_memory_live_before_is_not_counted(method: Method) -> None:
    w = torch.randn(512, 512)  # 1 MB that exists before

    def step() -> None:
        w.t()[1:].view(-1, 512)  # views of old memory: nothing new
        w.mul_(2.0)  # in place: nothing new
        w.add(1.0)  # 1 MB new, freed at once

    # The allocator also sees the 0-dim tensors Python scalars are wrapped in (a few bytes).
    assert MB <= measure_peak(step, method=method) <= MB + 64


@pytest.mark.parametrize("method", METHODS)
def test_the_context_manager_reports_peak_and_what_stays_live(method: Method) -> None:
    keep: list[torch.Tensor] = []
    with MemoryTracker(method) as t:
        keep.append(torch.ones(MB // 4))  # 1 MB kept
        tmp = torch.ones(MB // 2)  # 2 MB temporary
        del tmp
    assert t.peak == 3 * MB
    assert t.current == MB
    assert t.device == "cpu" and t.method == method


@pytest.mark.parametrize("method", METHODS)
def test_a_training_step_counts_saved_activations_and_gradients(method: Method) -> None:
    torch.manual_seed(0)
    batch, width, depth = 64, 256, 4
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)])
    x = torch.randn(batch, width)
    act = batch * width * 4  # one activation: 64 KB
    params = sum(p.numel() * 4 for p in model.parameters())

    def step() -> None:
        model(x).sum().backward()

    peak = measure_peak(step, method=method)
    # When the first layer's weight gradient is made, every gradient is live and so is the
    # gradient flowing into that layer (one activation); the 4 ReLU outputs saved by the forward
    # are all live at its end.
    assert peak >= params + act
    assert peak >= depth * act
    # Everything the step could hold at once: every gradient and two tensors per layer.
    assert peak <= params + 2 * depth * act

    # With gradients allocated, backward accumulates into them: one new weight gradient at a
    # time (it exists before being added), far less than all of them again.
    second = measure_peak(step, method=method)
    assert width * width * 4 <= second < peak


@pytest.mark.parametrize("method", METHODS)
def test_gradients_computed_in_backward_are_seen(method: Method) -> None:
    w = torch.randn(1024, 256, requires_grad=True)  # 1 MB parameter
    x = torch.randn(8, 1024)
    y = x @ w
    loss = y.square().sum()
    del y
    peak = measure_peak(loss.backward, method=method)
    assert w.grad is not None
    # the new gradient is counted, whatever the backward frees of memory from before
    assert peak >= w.numel() * 4
    assert peak <= w.numel() * 4 + 64 * 1024  # plus small temporaries only


@pytest.mark.parametrize("method", METHODS)
def test_a_collection_freeing_an_earlier_measurements_garbage_hides_nothing(method: Method) -> None:
    # The CPU allocator reports the free of every block it saw allocated under any profiler,
    # an earlier session's too: a garbage collection inside the window that frees an earlier
    # measurement's garbage once made a CI run's step measure a third of its peak.
    def leave_garbage() -> None:
        cycle: list[object] = [torch.ones(MB // 2)]  # 2 MB, freed only by the collector
        cycle.append(cycle)

    gc.collect()
    gc.disable()
    try:
        measure_peak(leave_garbage, method=method)

        def step() -> None:
            gc.collect()  # frees the 2 MB from the first window
            torch.ones(MB // 4)  # 1 MB, new

        peak = measure_peak(step, method=method)
    finally:
        gc.enable()
    assert MB <= peak <= MB + 64


@pytest.mark.parametrize("method", METHODS)
def test_exceptions_propagate_and_leave_no_mode_active(method: Method) -> None:
    def boom() -> None:
        torch.zeros(10)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        measure_peak(boom, method=method)
    # A mode left on the stack would count this allocation into a dead tracker; instead a fresh
    # measurement sees exactly its own bytes.
    assert measure_peak(lambda: torch.zeros(MB // 4), method=method) == MB


def test_allocator_sees_tensors_made_outside_the_dispatcher() -> None:
    # torch.tensor(data) copies Python data without an aten op producing new storage.
    peak = measure_peak(lambda: torch.tensor([1.0] * 1024), method="allocator")
    assert peak == 1024 * 4


def test_compiled_code_runs_compiled_under_the_default_tracker() -> None:
    # Dynamo compiles every torch.compile'd module through one wrapper frame, whose cache
    # holds 8 entries per process (config.recompile_limit); modules compiled by earlier
    # tests would make this one run eagerly, so it starts from a fresh Dynamo
    torch._dynamo.reset()
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        def run(*args: object) -> object:
            calls.append(1)
            return gm(*args)

        return run

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    compiled(x).sum().backward()
    calls.clear()
    with MemoryTracker() as t:
        compiled(x).sum().backward()
    assert t.method == "allocator"
    assert calls == [1]  # the compiled graph ran, not an eager fallback
    assert t.peak >= 32 * 64 * 4  # at least the hidden activation
    compiled(x).sum().backward()
    assert calls == [1, 1]  # and still runs compiled afterwards


def test_auto_falls_back_to_storages_inside_a_running_profiler() -> None:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]), MemoryTracker() as t:
        x = torch.zeros(MB // 4)
        del x
    assert t.method == "storages" and t.peak == MB


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="method must be"):
        MemoryTracker("magic")  # type: ignore[arg-type]


def test_compiled_code_runs_compiled_under_the_storages_tracker() -> None:
    """The storages mode ignores compile internals: Dynamo compiles and runs the compiled
    graph under it (not an eager fallback), compilation is not counted, and the graph's
    aten ops are still seen."""
    calls: list[int] = []

    def backend(gm: torch.fx.GraphModule, example: object) -> object:
        def run(*args: object) -> object:
            calls.append(1)
            return gm(*args)

        return run

    # nn.Sequential.forward is one code object for the whole process: the cache entries
    # earlier tests left on it (modules compiled after graph breaks) count against Dynamo's
    # limits, which would make this compile fall back to eager for reasons of its own
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(32, 64)
    with MemoryTracker(method="storages") as t:
        compiled(x).sum().backward()  # compiles inside the mode
    assert calls == [1], dict(torch._dynamo.utils.counters)
    assert t.peak >= 32 * 64 * 4  # at least the hidden activation
    with MemoryTracker(method="storages") as t2:
        compiled(x).sum().backward()
    assert calls == [1, 1]  # the compiled graph ran again, not an eager fallback
    assert t2.peak >= 32 * 64 * 4
    compiled(x).sum().backward()
    assert calls == [1, 1, 1]  # and still runs compiled afterwards


def test_the_peak_between_two_marks_is_measured_from_what_was_live_at_the_first() -> None:
    # the step check's bytes between the forward's return and the backward's start
    # (checkmate.stepcheck): the peak from the last mark of the first name before the first
    # mark of the second, counting what was live when it opened, and the peak outside it
    from checkmate.memory import _allocator_peaks

    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with prof:
        a = _bytes(1 * MB)
        with torch.profiler.record_function("open"):
            pass
        b = _bytes(8 * MB)  # before the last "open": not in the span
        del b
        with torch.profiler.record_function("open"):
            pass
        c = _bytes(2 * MB)  # 3 MB live: the span's peak
        del c
        with torch.profiler.record_function("shut"):
            pass
        d = _bytes(4 * MB)  # after the span: 5 MB live
        del a, d
    # outside the span: the 9 MB before it (1 + 8), the 5 MB after it
    assert _allocator_peaks(prof, between=("open", "shut")) == (9 * MB, 0, 3 * MB, 9 * MB)
    assert _allocator_peaks(prof, between=("open", "missing"))[2:] == (None, None)


def test_a_step_inside_measure_peak_is_counted_from_its_mark_as_if_a_profiler_started_there() -> None:
    # a step measured whole inside the caller's tracker (checkmate.stepcheck): what was
    # allocated before its start mark is not counted, nor its free; the tracker's own figure
    # is unchanged, and its riders get the stopped profiler when the block exits
    from checkmate.memory import MemoryTracker, _allocator_peaks, running_tracker

    got: list[tuple[int, int, int | None, int | None]] = []
    assert running_tracker() is None
    with MemoryTracker() as tracker:
        assert running_tracker() is tracker
        tracker.ride(lambda prof: got.append(_allocator_peaks(prof, until="end", since="start")))
        a = _bytes(6 * MB)  # before the step: the tracker's, not the step's
        with torch.profiler.record_function("start"):
            pass
        b = _bytes(2 * MB)
        del a  # allocated before the mark: no less than the step allocated
        c = _bytes(1 * MB)  # 3 MB live since the mark: the step's peak
        del b, c
        with torch.profiler.record_function("end"):
            pass
        d = _bytes(4 * MB)  # after the step's end
        del d
    assert running_tracker() is None
    assert tracker.peak == 8 * MB
    assert got == [(3 * MB, 0, None, None)]
