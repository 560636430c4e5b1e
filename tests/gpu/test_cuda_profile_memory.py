"""CUDA paths of profiling and memory measurement (skipped without CUDA)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from checkmate.memory import MemoryTracker, measure_peak
from checkmate.profile import profile_costs
from checkmate.timing import ProfileWarning, is_free, time_callable

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MB = 1 << 20


def test_cuda_peak_uses_the_allocator_statistics() -> None:
    torch.empty(1, device="cuda")  # initialize CUDA outside the measurement

    def step() -> None:
        a = torch.empty(4 * MB, dtype=torch.uint8, device="cuda")
        b = torch.empty(2 * MB, dtype=torch.uint8, device="cuda")
        del a, b
        c = torch.empty(1 * MB, dtype=torch.uint8, device="cuda")
        del c

    with MemoryTracker() as t:
        step()
    assert t.device == "cuda"
    assert t.peak == 6 * MB  # MB multiples are whole allocator blocks
    assert measure_peak(step, method="storages") == 6 * MB


def test_memory_live_before_is_not_counted_on_cuda() -> None:
    w = torch.randn(512, 512, device="cuda")
    assert measure_peak(lambda: w.add(1.0)) == MB


def test_cuda_events_time_a_matmul_plausibly() -> None:
    a = torch.randn(4096, 4096, device="cuda")
    seconds = time_callable(lambda: a @ a, "cuda")
    flops = 2 * 4096**3
    # Between 1 PFLOP/s (faster than any GPU in fp32) and 1 TFLOP/s (slower than any current one).
    assert flops / 1e15 < seconds < flops / 1e12


def test_measured_costs_on_cuda() -> None:
    gm = make_fx(lambda x, w: torch.relu(x @ w), tracing_mode="fake")(
        torch.randn(256, 512, device="cuda"), torch.randn(512, 512, device="cuda")
    )
    nodes = list(gm.graph.nodes)
    torch.manual_seed(0)
    expected = torch.rand(4, device="cuda")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileWarning)
        costs = profile_costs(gm, nodes, profile=None, device="cuda")
    assert torch.equal(torch.rand(4, device="cuda"), expected)  # the CUDA RNG was restored
    for node, cost in zip(nodes, costs):
        assert (cost > 0) != is_free(node)
    # A GPU is within 100x of the H100 roofline on these ops.
    est = profile_costs(gm, nodes, profile="h100", device="cuda")
    for m, e in zip(costs, est):
        if e:
            assert e / 100 < m < e * 100
