"""A custom op (``torch.library.custom_op``) defined in a library module, as a model's own
library defines one (Hugging Face's ``transformers::grouped_mm_fallback`` for its MoE experts):
a fresh interpreter knows it only after importing this module."""

from __future__ import annotations

import torch


@torch.library.custom_op("checkmate_tests::doubled_sum", mutates_args=())
def doubled_sum(x: torch.Tensor) -> torch.Tensor:
    """``(2 * x).sum(0)``: the doubled copy is a temporary as large as ``x`` (scratch)."""
    return (x * 2).sum(dim=0)


@doubled_sum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[1:])
