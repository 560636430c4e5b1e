"""Many models in one process: a deleted optimized module takes its plans with it.

Dynamo keeps every compile until ``torch._dynamo.reset()``; its cache entries held each
optimized module's planner (every record, graph and generated module) after the module was
deleted (:mod:`checkmate.release`). A sweep optimizing a model per trial grew without bound.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import checkmate
from checkmate.compiling import _compile_again
from checkmate.module_state import _STATE
from tests.integration import _models as M

pytestmark = pytest.mark.torch


def _sequential() -> nn.Module:
    # a torch class: Dynamo compiles its forward through a wrapper whose code every such
    # module shares, not through the module's own code
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)]
    return nn.Sequential(*blocks, nn.Linear(32, 4))


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize("kind", ["own class", "torch class", "compiled again"])
def test_a_deleted_optimized_module_frees_its_planner(kind: str) -> None:
    torch.manual_seed(0)
    model = _sequential() if kind == "torch class" else M.MLP(32, 4)
    opt = checkmate.optimize(model, 0.6)
    x = torch.randn(256, 32)
    _step(opt, x)
    state = opt.__dict__[_STATE]
    if kind == "compiled again":  # a second compile of the step: a region of its own
        _compile_again(state)
        _step(opt, x)
        assert len(state.planner.regions) == 2
    assert state.planner.records, "nothing was planned: the test would show nothing"
    planner = weakref.ref(state.planner)
    del state, opt, model
    gc.collect()
    gc.collect()  # the first collects the module, whose finalizer releases Dynamo's references
    assert planner() is None, "Dynamo still holds the deleted module's planner"


def test_deleting_one_optimized_module_leaves_another_of_its_class_compiled() -> None:
    torch.manual_seed(0)
    first, second = _sequential(), _sequential()
    twin = copy.deepcopy(second)
    a, b = checkmate.optimize(first, 0.6), checkmate.optimize(second, 0.6)
    x = torch.randn(256, 32)
    for _ in range(2):
        _step(a, x)
        _step(b, x)
    planner = b.__dict__[_STATE].planner
    made = len(planner.records)
    del a, first
    gc.collect()
    b.zero_grad()
    _step(b, x)
    _step(twin, x)
    assert len(planner.records) == made, "the other module's step was compiled again"
    for (name, p), q in zip(b.named_parameters(), twin.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
