"""The front end on a CUDA device: allocator-measured peak under the budget, gradients,
and no overhead at 100%. Skipped without CUDA."""

from __future__ import annotations

import copy
import statistics
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _gpt2() -> Any:
    pytest.importorskip("transformers")
    from tests.integration import _models as M

    return M.gpt2(n_layer=4, n_embd=256, dropout=0.1).cuda()


def _step(model: Any, idx: Any) -> Any:
    loss = model(idx).logits.float().mean()
    loss.backward()
    return loss.detach()


def _peak(fn: Any) -> int:
    from checkmate.memory import measure_peak

    torch.cuda.synchronize()
    return measure_peak(fn)


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_gpt2_on_cuda_fits_the_budget_with_equal_gradients(fraction: float) -> None:
    import checkmate

    torch.manual_seed(0)
    eager = _gpt2()
    idx = torch.randint(0, 128, (16, 64), device="cuda")
    _step(eager, idx)
    eager.zero_grad(set_to_none=True)
    peak = _peak(lambda: _step(eager, idx))
    eager.zero_grad(set_to_none=True)
    budget = int(fraction * peak)
    opt = checkmate.optimize(copy.deepcopy(eager), budget, time_limit=20)
    torch.manual_seed(1)
    loss = _step(opt, idx)
    torch.manual_seed(1)
    ref = _step(eager, idx)
    # cuBLAS may pick different kernels for the compiled and eager calls: tolerance, not bits
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(opt.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    opt.zero_grad(set_to_none=True)
    measured = _peak(lambda: _step(opt, idx))
    sims = [r.result.peak for r in checkmate.plans_of(opt)]
    print(
        f"\nGPU {fraction:.0%}: eager {peak:,} B, budget {budget:,} B, measured {measured:,} B, simulated {sims}"
    )
    assert measured <= 1.05 * budget


def test_full_budget_step_time_on_cuda() -> None:
    import checkmate

    torch.manual_seed(0)
    eager = _gpt2()
    idx = torch.randint(0, 128, (16, 64), device="cuda")
    opt = checkmate.optimize(eager, 1.0, (idx,), time_limit=10)

    def timed(m: Any) -> float:
        m.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(m, idx)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        timed(eager)
        timed(opt)
    pairs = [(timed(opt), timed(eager)) for _ in range(30)]
    ratio = statistics.median(a for a, _ in pairs) / statistics.median(b for _, b in pairs)
    print(f"\nGPU step time at 100%: {ratio:.3f} x eager")
    assert ratio <= 1.05
