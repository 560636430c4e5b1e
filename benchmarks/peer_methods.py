"""The methods :mod:`benchmarks.peers` compares: each turns a fresh model into a ``Step``
(a callable returning the loss of one training step; the caller calls ``backward``).

- eager: the model as it is;
- checkpoint: ``torch.utils.checkpoint(use_reentrant=False)`` around every block's forward
  (instance attribute, so ``state_dict`` keys are unchanged);
- pt-budget: ``torch.compile`` with PyTorch's min-cut partitioner and eager (boxed) compilers,
  i.e. the ``aot_eager`` backend, at ``torch._functorch.config.activation_memory_budget``;
- checkmate: ``checkmate.optimize`` at a budget in bytes, of a wrapper whose ``forward``
  runs the model and the workload's criterion (:class:`WithLoss`): the logits and the loss's
  temporaries are then inside the planned graph, as when a user optimizes a model that
  returns its loss; the step and the loss are the same as the other methods';
- rockmate: not run without CUDA (see :data:`ROCKMATE_REASON`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from benchmarks.models import Workload

__all__ = [
    "ROCKMATE_REASON",
    "Step",
    "WithLoss",
    "prepare_checkmate",
    "prepare_checkpoint",
    "prepare_eager",
    "prepare_pt_budget",
    "rockmate_status",
]

Step = Callable[[], torch.Tensor]

ROCKMATE_REASON = (
    "not run: needs CUDA (rockmate 2.0.0 builds its graphs on torch.device('cuda'); "
    "it also pins pulp==2.7.0, which conflicts with this project's pulp 3.3)"
)


def prepare_eager(model: nn.Module, wl: Workload) -> Step:
    return functools.partial(wl.loss, model)


def prepare_checkpoint(model: nn.Module, wl: Workload) -> Step:
    """Wrap every block's forward in non-reentrant activation checkpointing (keys unchanged)."""
    from torch.utils.checkpoint import checkpoint

    def wrapped(fwd: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(fwd, *args, use_reentrant=False, **kwargs)

    for block in wl.blocks(model):
        block.forward = functools.partial(wrapped, block.forward)  # type: ignore[method-assign]
    return functools.partial(wl.loss, model)


def prepare_pt_budget(budget: float) -> Callable[[nn.Module, Workload], Step]:
    """PyTorch's min-cut partitioner at ``activation_memory_budget=budget`` (aot_eager)."""

    def prepare(model: nn.Module, wl: Workload) -> Step:
        from functorch.compile import min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop

        backend = aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )
        compiled = cast(nn.Module, torch.compile(model, backend=backend, dynamic=False))

        def step() -> torch.Tensor:
            # The knob is read when the graph is partitioned (the first call); keeping it
            # set on every call makes a recompilation, if any, use it too.
            with torch._functorch.config.patch(activation_memory_budget=budget):
                return wl.loss(compiled)

        return step

    return prepare


class WithLoss(nn.Module):
    """``model`` and the workload's criterion in one ``forward`` returning the loss.

    It holds ``model`` as a submodule (parameters and buffers shared, not copied), so a
    step through it updates the same gradients and BatchNorm statistics as a step through
    ``model``; ``forward(*inputs, *batch)`` returns ``criterion(model(*inputs), batch)``,
    i.e. exactly ``wl.loss(model)``.
    """

    def __init__(self, model: nn.Module, wl: Workload) -> None:
        super().__init__()
        self.model = model
        self.criterion = wl.criterion
        self.n_inputs = len(wl.inputs)
        self.train(model.training)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        inputs, batch = tensors[: self.n_inputs], tensors[self.n_inputs :]
        return self.criterion(self.model(*inputs), batch)


def prepare_checkmate(
    budget: int, strategy: str, time_limit: float, notes: list[str]
) -> Callable[[nn.Module, Workload], Step]:
    """``checkmate.optimize`` of :class:`WithLoss` at ``budget`` bytes, planned on the
    step's inputs and batch, so the plan sees the whole step (model, loss, backward) the
    budget is measured on; a line per plan (strategy, simulated peak, recomputes, planned
    compute) is appended to ``notes``."""

    def prepare(model: nn.Module, wl: Workload) -> Step:
        from checkmate.api import optimize, plans_of

        args = (*wl.inputs, *wl.batch)
        opt = optimize(WithLoss(model, wl), budget, args, strategy=strategy, time_limit=time_limit)
        for rec in plans_of(opt):
            res = rec.result
            cost = (res.cost or 0.0) / rec.joint.graph.total_cost - 1.0 if rec.joint.graph.total_cost else 0.0
            notes.append(
                f"plan: {res.info.get('chosen', res.strategy)}, simulated peak {(res.peak or 0) / 2**20:.2f} MiB, "
                f"{rec.recomputes} recomputes, +{cost:.0%} planned compute"
            )
        return functools.partial(opt, *args)

    return prepare


def rockmate_status() -> str:
    """Why Rockmate has no measured row on this machine."""
    if not torch.cuda.is_available():
        return ROCKMATE_REASON
    return "not run: this script measures on CPU only (run rockmate's own GPU benchmark)"
