"""Paging plans executed: saved values cross to the backward in host memory (CPU = host
here), gradients equal eager PyTorch."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd

from checkmate import paging
from checkmate.codegen import generate
from checkmate.paging import PagedModules, page_saved
from checkmate.trace import JointGraph, build_graph
from solvers import Schedule, memory_lower_bound, validate
from solvers.strategies.poet import page_all_schedule, poet

pytestmark = pytest.mark.torch

Planner = Callable[[JointGraph], Schedule]
BATCH = 64  # activations (BATCH x 32) outweigh the weight gradients: the plan must page them


def _model(kind: str = "mlp") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "dropout-norm":  # a random op (never recomputed) and a buffer mutation
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32),
            torch.nn.BatchNorm1d(32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.3),
            torch.nn.Linear(32, 32),
            torch.nn.LayerNorm(32),
            torch.nn.Tanh(),
            torch.nn.Linear(32, 4),
        )
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )


Step = tuple[torch.nn.Module, list[torch.Tensor | None], torch.Tensor]


def _run_paged(plan: Planner, kind: str = "mlp") -> tuple[list[PagedModules], Step]:
    records: list[PagedModules] = []

    def partition(
        joint: fx.GraphModule, _inputs: Sequence[Any], *, num_fwd_outputs: int, **_: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        jg = build_graph(joint, num_fwd_outputs, lambda nodes: [1.0] * len(nodes), name="paged")
        schedule = plan(jg)
        validate(jg.graph, schedule, memory_lower_bound(jg.graph))
        paged = page_saved(generate(joint, jg, schedule), jg, schedule)
        records.append(paged)
        return paged.modules.forward, paged.modules.backward

    def as_is(gm: fx.GraphModule, _inputs: Sequence[Any]) -> fx.GraphModule:
        return gm

    model = _model(kind)
    torch.manual_seed(1)
    x = torch.randn(BATCH, 16)
    compiled = torch.compile(
        model, backend=aot_autograd(fw_compiler=as_is, bw_compiler=as_is, partition_fn=partition)
    )
    loss = compiled(x).square().mean()
    loss.backward()
    return records, (model, [p.grad for p in model.parameters()], loss.detach())


def _eager(kind: str = "mlp") -> Step:
    model = _model(kind)
    torch.manual_seed(1)
    x = torch.randn(BATCH, 16)
    loss = model(x).square().mean()
    loss.backward()
    return model, [p.grad for p in model.parameters()], loss.detach()


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> None:
    torch._dynamo.reset()


def _count_page_outs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = paging.page_out

    def counted(t: torch.Tensor) -> torch.Tensor:
        calls.append(t.numel())
        host = real(t)
        assert host.data_ptr() != t.data_ptr()  # a real copy: the device value can die
        return host

    monkeypatch.setattr(paging, "page_out", counted)
    return calls


@pytest.mark.parametrize(
    ("which", "kind"),
    [
        ("page-everything", "mlp"),
        ("poet-free-link", "mlp"),
        ("poet-priced-link", "mlp"),
        ("page-everything", "dropout-norm"),
        ("poet-priced-link", "dropout-norm"),
    ],
)
def test_paged_step_matches_eager(which: str, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_page_outs(monkeypatch)

    def plan(jg: JointGraph) -> Schedule:
        g = jg.graph
        if which == "page-everything":
            return page_all_schedule(g)
        bw, lat = (math.inf, 0.0) if which == "poet-free-link" else (1e6, 0.01)
        res = poet(g, memory_lower_bound(g), time_limit=60, bandwidth=bw, latency=lat)
        assert res.ok and res.schedule is not None
        return res.schedule

    want_model, want_grads, want_loss = _eager(kind)
    records, (model, grads, loss) = _run_paged(plan, kind)
    assert len(records) == 1
    rec = records[0]
    assert rec.paged, "the plan pages nothing across the boundary: the test proves nothing"
    assert len(calls) == len(rec.paged)  # one page-out per paged value per step
    assert torch.equal(loss, want_loss)
    for got, want in zip(grads, want_grads, strict=True):
        assert got is not None and want is not None
        assert torch.equal(got, want)  # same ops, same order: bitwise on CPU
    for got, want in zip(model.buffers(), want_model.buffers(), strict=True):
        assert torch.equal(got, want)  # BatchNorm statistics updated once, as in eager


def test_rewritten_modules_copy_in_and_out() -> None:
    def plan(jg: JointGraph) -> Schedule:
        return page_all_schedule(jg.graph)

    records, _ = _run_paged(plan)
    rec = records[0]
    fw_targets = [n.target for n in rec.modules.forward.graph.nodes if n.op == "call_function"]
    bw_targets = [n.target for n in rec.modules.backward.graph.nodes if n.op == "call_function"]
    assert fw_targets.count(paging.page_out) == len(rec.paged)
    assert bw_targets.count(paging.page_in) == len(rec.paged)
    # each page-in comes right before the first reader of its value
    for n in rec.modules.backward.graph.nodes:
        if n.target is paging.page_in:
            assert n.next in n.users


def test_paging_state_is_read_from_the_schedule() -> None:
    seen: list[tuple[frozenset[int], frozenset[int]]] = []

    def plan(jg: JointGraph) -> Schedule:
        sched = page_all_schedule(jg.graph)
        across, paged = paging.paged_at_split(jg, sched)
        # every forward value the backward reads is on the host, off the device, at the split
        fwd = ~jg.graph.backward_mask
        readers = {i for i, j in jg.graph.edges if fwd[i] and not fwd[j]}
        assert frozenset(readers) <= across <= paged
        # without its page steps, the same plan keeps everything on the device
        plain = Schedule(tuple(s for s in sched.steps if s[0] in ("compute", "free")))
        seen.append(paging.paged_at_split(jg, plain))
        return sched

    _run_paged(plan)
    assert seen == [(frozenset(), frozenset())]
