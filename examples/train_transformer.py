"""Train a small transformer under a memory budget with checkmate, and compare with eager.

    python examples/train_transformer.py              # 50% of the eager step's peak
    python examples/train_transformer.py --budget 0.3 --steps 10 --dropout 0.1

It measures one eager training step's peak memory, plans the same model for a fraction of
it (``checkmate.optimize``), checks that the gradients equal eager PyTorch's, then trains
both for a few steps and prints measured peak memory and median step time side by side.
Runs on CPU in well under a minute; on a GPU pass ``--device cuda``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import checkmate
from checkmate.memory import measure_peak
from solvers import format_bytes


class Block(nn.Module):
    """A pre-LN transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = self.drop(att.masked_fill(~mask, float("-inf")).softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A small decoder-only language model that returns its loss."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The demo's model and one batch, for ``checkmate trace examples/train_transformer.py:make_model``."""
    torch.manual_seed(0)
    data = torch.randint(0, 256, (8, 65))
    return TinyGPT(256, 64, 4, 4, 64, 0.0), data[:, :-1], data[:, 1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.5, help="fraction of the eager step's peak")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--time-limit", type=float, default=10.0, help="planner seconds")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)

    torch.manual_seed(0)
    eager = TinyGPT(256, args.width, args.layers, 4, args.seq, args.dropout).to(dev)
    model = copy.deepcopy(eager)
    data = torch.randint(0, 256, (args.batch, args.seq + 1), device=dev)
    idx, targets = data[:, :-1], data[:, 1:]

    def step(m: nn.Module) -> torch.Tensor:
        loss = m(idx, targets)
        loss.backward()
        return loss.detach()

    def zero(m: nn.Module) -> None:
        for p in m.parameters():
            p.grad = None

    step(eager)  # warm-up
    zero(eager)
    peak_eager = measure_peak(lambda: step(eager))
    zero(eager)
    # the budget in bytes, a fraction of what eager PyTorch measured (a fraction given to
    # optimize() would be of the compiled step's keep-all peak instead, a different base)
    budget = int(args.budget * peak_eager)
    print(
        f"eager step peak: {format_bytes(peak_eager)}; budget: {args.budget:.0%} of it = {format_bytes(budget)}"
    )

    t0 = time.perf_counter()
    opt = checkmate.optimize(
        model, budget, (idx, targets), strategy=args.strategy, profile=None, time_limit=args.time_limit
    )
    print(f"planned in {time.perf_counter() - t0:.1f} s")
    for k, rec in enumerate(checkmate.plans_of(opt)):
        res, g = rec.result, rec.joint.graph
        extra = (res.cost or 0.0) / g.total_cost - 1.0 if g.total_cost else 0.0
        print(
            f"  graph {k}: {g.n - 1} ops, simulated peak {format_bytes(res.peak or 0)} "
            f"({(res.peak or 0) / peak_eager:.0%} of eager's), {rec.recomputes} recomputes, "
            f"+{extra:.1%} compute, {res.info.get('chosen', res.strategy)} ({res.status})"
        )

    # gradients: one step from the same weights and the same random state
    torch.manual_seed(1)
    loss_opt = step(opt)
    torch.manual_seed(1)
    loss_eager = step(eager)
    diff = max((p.grad - q.grad).abs().max().item() for p, q in zip(opt.parameters(), eager.parameters()))
    print(f"loss {loss_opt.item():.6f} vs eager {loss_eager.item():.6f}; max gradient difference {diff:.3g}")
    zero(opt)
    zero(eager)
    peak_opt = measure_peak(lambda: step(opt))
    zero(opt)

    # a few training steps each, alternating so that both see the same machine load
    sgd_opt = torch.optim.AdamW(opt.parameters(), lr=1e-3)
    sgd_eager = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    times: dict[str, list[float]] = {"eager": [], "checkmate": []}
    for i in range(args.steps):
        for name, m, o in (("eager", eager, sgd_eager), ("checkmate", opt, sgd_opt)):
            o.zero_grad(set_to_none=True)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = step(m)
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t)
            o.step()
        print(f"step {i}: loss {loss.item():.4f}")
    t_e, t_c = statistics.median(times["eager"]), statistics.median(times["checkmate"])
    print()
    print(f"{'':>10} {'peak memory':>14} {'step time':>11}")
    print(f"{'eager':>10} {format_bytes(peak_eager):>14} {t_e * 1e3:>9.1f}ms")
    print(f"{'checkmate':>10} {format_bytes(peak_opt):>14} {t_c * 1e3:>9.1f}ms")
    print(
        f"measured peak {peak_opt / peak_eager:.3f} x eager (budget {args.budget:.2f}); "
        f"step time {t_c / t_e:.2f} x eager; gradients {'equal' if diff == 0 else f'differ by {diff:.3g}'}"
    )


if __name__ == "__main__":
    main()
