"""Small models shared by the front-end integration tests (CPU, seconds to trace)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        h += x  # in-place residual
        return h.relu_()


class SmallCNN(nn.Module):
    def __init__(self, c: int = 8, blocks: int = 2) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(*(ResBlock(c) for _ in range(blocks)))
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.stem(x)))
        h = self.blocks(h)
        return self.head(h.mean(dim=(2, 3)))


class Block(nn.Module):
    """Pre-LN transformer block: attention, LayerNorm, dropout, GELU."""

    def __init__(self, d: int = 64, heads: int = 4, p: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class MLPBlock(nn.Module):
    """A residual MLP block: x + down(gelu(up(x)))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class Skipping(nn.Module):
    """Blocks kept where ``keep`` says. The branch on a tensor breaks the loop, as LayerDrop's
    ``if torch.rand([]) < p`` does (a Hugging Face wav2vec2's), so Dynamo runs the loop eagerly
    and compiles the blocks' forward: one graph, run once per block kept (the first block's,
    whose input needs no gradient, is another)."""

    def __init__(self, blocks: int = 4, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if keep[i]:
                x = block(x)
        return nn.functional.cross_entropy(self.head(x), y)


#: what :func:`_log_norm` logged last (a user's metrics)
LOGGED: dict[str, float] = {}


@torch._dynamo.disable
def _log_norm(x: torch.Tensor) -> None:
    """A user's logging helper that Dynamo does not trace (``torch._dynamo.disable``, as a
    metrics library's call would be)."""
    LOGGED["norm"] = float(x.detach().norm())


class Logged(nn.Module):
    """Blocks whose loop logs each block's output with a helper Dynamo does not trace: as
    :class:`Skipping`'s branch does, the break has Dynamo run the loop eagerly and compile the
    blocks' forward, one graph run once per block (the first block's another)."""

    def __init__(self, blocks: int = 4, width: int = 256) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            _log_norm(x)
        return nn.functional.cross_entropy(self.head(x), y)


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 64, layers: int = 2, p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, p=p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


class MultiOut(nn.Module):
    """Several outputs (a dict and a tuple), non-tensor arguments, an in-place op."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor, *, mode: str = "sum", scale: float = 1.0) -> Any:
        h = self.a(x)
        h.mul_(scale)
        h = torch.relu_(h)
        out = self.b(h)
        other = (h * y).sum(dim=1) if mode == "sum" else (h * y).amax(dim=1)
        return {"out": out, "aux": (other, h.detach().mean())}


def gpt2(n_layer: int = 2, n_embd: int = 64, dropout: float = 0.0) -> nn.Module:
    """A Hugging Face GPT-2 with a tiny random config (no download)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        n_positions=64,
        vocab_size=128,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        use_cache=False,
    )
    return GPT2LMHeadModel(cfg)
