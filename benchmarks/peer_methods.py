"""The methods :mod:`benchmarks.peers` compares: each turns a fresh model into a ``Step``
(a callable returning the loss of one training step; the caller calls ``backward``).

- eager: the model as it is;
- checkpoint: ``torch.utils.checkpoint(use_reentrant=False)`` around every block's forward
  (instance attribute, so ``state_dict`` keys are unchanged);
- pt-budget: ``torch.compile`` with PyTorch's min-cut partitioner and eager (boxed) compilers,
  i.e. the ``aot_eager`` backend, at ``torch._functorch.config.activation_memory_budget``;
- compile / pt-budget with Inductor (:func:`prepare_inductor`): ``torch.compile`` of
  :class:`WithLoss` with the default (Inductor) backend, with or without an
  ``activation_memory_budget``; those with a budget compile with Inductor's FX-graph cache and
  AOTAutograd's cache off, so no budget's compile is served another's artifact;
- checkmate: ``checkmate.optimize`` at a budget in bytes, of a wrapper whose ``forward``
  runs the model and the workload's criterion (:class:`WithLoss`): the logits and the loss's
  temporaries are then inside the planned graph, as when a user optimizes a model that
  returns its loss; the step and the loss are the same as the other methods';
- rockmate: not run without CUDA (see :data:`ROCKMATE_REASON`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from benchmarks.models import Workload
from solvers.budget import format_change

__all__ = [
    "ROCKMATE_REASON",
    "Step",
    "WithLoss",
    "prepare_checkmate",
    "prepare_checkpoint",
    "prepare_eager",
    "prepare_inductor",
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


def prepare_inductor(
    budget: float | None, wrapper: type[WithLoss] | None = None
) -> Callable[[nn.Module, Workload], Step]:
    """``torch.compile`` (Inductor) of :class:`WithLoss` (or ``wrapper``), at PyTorch's
    ``activation_memory_budget=budget`` (None: no budget, the config as it is).

    The returned step has run once (forward and backward: Inductor compiles the backward at
    its first call) under the budget's config, so both halves are compiled; later calls run
    without patching the config (no per-step cost). With a budget, Inductor's FX-graph cache
    and AOTAutograd's cache are off for that first call: neither is read nor written, so a
    budget's compile is never another budget's cached artifact. The caller resets Dynamo
    before (a fresh model of the same class would otherwise reuse a graph compiled for
    another budget: the budget is not part of Dynamo's guards). A build that must keep its
    own graph across such resets passes a ``wrapper`` with a ``forward`` of its own
    (:class:`ReferenceLoss`).
    """

    def prepare(model: nn.Module, wl: Workload) -> Step:
        args = (*wl.inputs, *wl.batch)
        compiled = cast(nn.Module, torch.compile((wrapper or WithLoss)(model, wl), dynamic=False))
        patches: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if budget is not None:
            stack = contextlib.ExitStack()
            stack.enter_context(
                torch._functorch.config.patch(activation_memory_budget=budget, enable_autograd_cache=False)
            )
            stack.enter_context(torch._inductor.config.patch(fx_graph_cache=False))
            patches = stack
        with patches:
            model.zero_grad(set_to_none=True)
            compiled(*args).backward()
            model.zero_grad(set_to_none=True)
        return functools.partial(compiled, *args)

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


class ReferenceLoss(WithLoss):
    """:class:`WithLoss` under a ``forward`` code object of its own.

    Dynamo keeps compiled graphs on the code object of the frame it compiles, and its guards
    do not tell two :class:`WithLoss` instances of the same shapes apart. A reference built as
    a plain :class:`WithLoss` and called again after ``torch._dynamo.reset()`` would therefore
    run whatever :class:`WithLoss` was compiled since (e.g. one under
    ``activation_memory_budget``), and a row timed against it would be timed against itself.
    """

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return super().forward(*tensors)


def prepare_checkmate(
    budget: int | float,
    strategy: str,
    time_limit: float,
    notes: list[str],
    *,
    compiler: str = "aot",
    built: list[nn.Module] | None = None,
) -> Callable[[nn.Module, Workload], Step]:
    """``checkmate.optimize`` of :class:`WithLoss` at ``budget`` (bytes, or a fraction),
    planned on the step's inputs and batch, so the plan sees the whole step (model, loss,
    backward) the budget is measured on; a line per plan (strategy, simulated peak,
    recomputes, planned compute) is appended to ``notes``; the optimized module is appended
    to ``built`` (for :func:`checkmate.plans_of` after it has run)."""

    def prepare(model: nn.Module, wl: Workload) -> Step:
        from checkmate.api import optimize, plans_of

        args = (*wl.inputs, *wl.batch)
        opt = optimize(
            WithLoss(model, wl), budget, args, strategy=strategy, time_limit=time_limit, compiler=compiler
        )
        if built is not None:
            built.append(opt)
        for rec in plans_of(opt):
            res = rec.result
            cost = rec.overhead
            check = ""
            if rec.compiled is not None and rec.compiled.measured is not None:
                tried = ", ".join(f"{(r.measured or 0) / 2**20:.2f}" for r in rec.compiled.rounds)
                check = (
                    f"; checked compiled: {rec.compiled.measured / 2**20:.2f} MiB of "
                    f"{rec.compiled.budget / 2**20:.2f} MiB (plans measured: {tried} MiB)"
                )
            notes.append(
                f"plan: {res.info.get('chosen', res.strategy)}, simulated peak {(res.peak or 0) / 2**20:.2f} MiB, "
                f"{rec.recomputes} recomputes, {format_change(cost, 0)} planned compute{check}"
            )
        return functools.partial(opt, *args)

    return prepare


def rockmate_status() -> str:
    """Why Rockmate has no measured row on this machine."""
    if not torch.cuda.is_available():
        return ROCKMATE_REASON
    return "not run: this script measures on CPU only (run rockmate's own GPU benchmark)"
