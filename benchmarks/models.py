"""Models the benchmarks train: a GPT-2-like transformer and a ResNet-like CNN (CPU sized).

Each :class:`Workload` builds its model from a seed (random weights, nothing downloaded),
its input batch, the loss of one training step, and the list of blocks that per-layer
activation checkpointing wraps. Models are built fresh for every method under test and
given the reference model's ``state_dict``, so every method trains the same weights.

- ``gpt2``: Hugging Face ``transformers``' ``GPT2LMHeadModel`` from a ``GPT2Config`` with
  random weights (``use_cache=False``), loss = next-token cross-entropy of its logits.
  ``small`` is the GPT-2-small shape (12 layers, 768 wide, 12 heads, 50257 tokens).
- ``llama``: ``transformers``' ``LlamaForCausalLM`` from a ``LlamaConfig`` with random weights
  (RMSNorm, rotary embeddings, SwiGLU MLP; ``sdpa`` attention), loss as for ``gpt2``.
- ``resnet``: a ResNet-like CNN written here (torchvision is not a dependency): a conv +
  BatchNorm stem, four stages of two basic blocks (conv-BN-ReLU-conv-BN plus a shortcut,
  strided 1x1 conv + BN where the shape changes), global average pooling and a linear head;
  loss = cross-entropy. ``dropout`` > 0 adds a dropout after each block's first ReLU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Workload", "gpt2_workload", "llama_workload", "resnet_workload", "ResNet", "BasicBlock"]


@dataclass(frozen=True)
class Workload:
    """One model at one training shape.

    Attributes:
        name: short name used in tables (``gpt2``, ``resnet``).
        shape: a human-readable description of size and batch.
        build: ``build(dropout) -> model`` with deterministic random weights.
        batch: the step's data (made once, shared by every method).
        inputs: the model's positional arguments, taken from ``batch``.
        criterion: ``criterion(output, batch) -> scalar`` (outside the model).
        blocks: ``blocks(model) -> modules`` that per-layer checkpointing wraps.
    """

    name: str
    shape: str
    build: Callable[[float], nn.Module]
    batch: tuple[torch.Tensor, ...]
    inputs: tuple[torch.Tensor, ...]
    criterion: Callable[[Any, tuple[torch.Tensor, ...]], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]

    def loss(self, model: nn.Module) -> torch.Tensor:
        """The forward of one training step: the model on ``inputs``, then the criterion."""
        return self.criterion(model(*self.inputs), self.batch)

    def to(self, device: str | torch.device) -> Workload:
        """This workload with its batch on ``device`` and its models built there."""
        moved = {id(t): t.to(device) for t in self.batch}
        build = self.build

        def build_on(dropout: float) -> nn.Module:
            return build(dropout).to(device)

        return replace(
            self,
            build=build_on,
            batch=tuple(moved[id(t)] for t in self.batch),
            inputs=tuple(moved[id(t)] if id(t) in moved else t.to(device) for t in self.inputs),
        )


# ---------------------------------------------------------------- GPT-2 (transformers)

GPT2_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256},
    "quick": {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 2048},
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257},
}


def gpt2_workload(size: str = "quick", batch: int = 4, seq: int = 64, seed: int = 0) -> Workload:
    """A GPT-2-like language model with random weights (``transformers``' GPT2LMHeadModel).

    Args:
        size: a key of ``GPT2_SIZES`` (``small`` is GPT-2 small).
        batch: sequences per step.
        seq: tokens per sequence.
        seed: seed of the weights and of the token ids.

    Returns:
        The workload; its loss is next-token cross-entropy over the batch.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    dims = GPT2_SIZES[size]

    def build(dropout: float) -> nn.Module:
        config = GPT2Config(
            n_layer=dims["n_layer"],
            n_embd=dims["n_embd"],
            n_head=dims["n_head"],
            vocab_size=dims["vocab_size"],
            n_positions=max(seq, 64),
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
        )
        torch.manual_seed(seed)
        return GPT2LMHeadModel(config).train()

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, dims["vocab_size"], (batch, seq), generator=gen)

    def criterion(out: Any, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        # The loss is taken outside the model: the model's own ``labels=`` path breaks the
        # torch.compile graph at its loss function (one graph, not two, per method).
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), b[0][:, 1:].flatten())

    def blocks(model: nn.Module) -> list[nn.Module]:
        return list(model.transformer.h)  # type: ignore[union-attr, arg-type]

    return Workload(
        name="gpt2",
        shape=f"GPT-2 {size} ({dims['n_layer']} layers, d={dims['n_embd']}, vocab {dims['vocab_size']}), "
        f"batch {batch} x {seq} tokens",
        build=build,
        batch=(ids,),
        inputs=(ids,),
        criterion=criterion,
        blocks=blocks,
    )


# ---------------------------------------------------------------- Llama (transformers)

LLAMA_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "hidden": 64, "heads": 2, "intermediate": 172, "vocab": 256},
    "quick": {"layers": 4, "hidden": 256, "heads": 4, "intermediate": 688, "vocab": 1000},
}


def llama_workload(
    size: str = "quick", batch: int = 4, seq: int = 256, seed: int = 0, attn: str = "sdpa"
) -> Workload:
    """A Llama-like language model with random weights (``transformers``' LlamaForCausalLM).

    Args:
        size: a key of ``LLAMA_SIZES``.
        batch: sequences per step.
        seq: tokens per sequence.
        seed: seed of the weights and of the token ids.
        attn: the config's ``attn_implementation`` (``sdpa`` or ``eager``).

    Returns:
        The workload; its loss is next-token cross-entropy over the batch.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = LLAMA_SIZES[size]

    def build(dropout: float) -> nn.Module:
        config = LlamaConfig(
            hidden_size=dims["hidden"],
            num_hidden_layers=dims["layers"],
            num_attention_heads=dims["heads"],
            num_key_value_heads=dims["heads"],
            intermediate_size=dims["intermediate"],
            vocab_size=dims["vocab"],
            max_position_embeddings=max(seq, 64),
            attention_dropout=dropout,
            use_cache=False,
            attn_implementation=attn,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).train()

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, dims["vocab"], (batch, seq), generator=gen)

    def criterion(out: Any, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), b[0][:, 1:].flatten())

    def blocks(model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)  # type: ignore[union-attr, arg-type]

    return Workload(
        name="llama",
        shape=f"Llama-like {size} ({dims['layers']} layers, d={dims['hidden']}, {dims['heads']} heads, "
        f"MLP {dims['intermediate']}, vocab {dims['vocab']}, {attn} attention), batch {batch} x {seq} tokens",
        build=build,
        batch=(ids,),
        inputs=(ids,),
        criterion=criterion,
        blocks=blocks,
    )


# ---------------------------------------------------------------- ResNet-like CNN


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU(-dropout)-conv3x3-BN, plus the (projected) input, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.drop = nn.Dropout(dropout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.relu(self.bn1(self.conv1(x))))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    """ResNet-18-like: stem, four stages of ``depth`` basic blocks, pooling, linear head."""

    def __init__(self, width: int = 16, depth: int = 2, classes: int = 10, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        cin = width
        for stage in range(4):
            cout = width * 2**stage
            for i in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if (i == 0 and stage > 0) else 1, dropout))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


RESNET_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"width": 4, "depth": 1, "image": 16},
    "quick": {"width": 16, "depth": 2, "image": 32},
    "full": {"width": 64, "depth": 2, "image": 64},
}


def resnet_workload(size: str = "quick", batch: int = 16, seed: int = 0) -> Workload:
    """A ResNet-like CNN with BatchNorm on random images.

    Args:
        size: a key of ``RESNET_SIZES`` (``full`` is ResNet-18's widths at 64x64 images).
        batch: images per step.
        seed: seed of the weights, images and labels.

    Returns:
        The workload; its loss is cross-entropy over 10 classes.
    """
    dims = RESNET_SIZES[size]

    def build(dropout: float) -> nn.Module:
        torch.manual_seed(seed)
        return ResNet(width=dims["width"], depth=dims["depth"], dropout=dropout).train()

    gen = torch.Generator().manual_seed(seed + 1)
    image = dims["image"]
    x = torch.randn(batch, 3, image, image, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)

    def criterion(out: Any, b: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return F.cross_entropy(out, b[1])

    def blocks(model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)  # type: ignore[union-attr, arg-type]

    return Workload(
        name="resnet",
        shape=f"ResNet-like (width {dims['width']}, {4 * dims['depth']} blocks), batch {batch} x 3x{image}x{image}",
        build=build,
        batch=(x, y),
        inputs=(x,),
        criterion=criterion,
        blocks=blocks,
    )
