"""Data-parallel training with checkmate: ``DDP(checkmate.optimize(model, budget))``.

    torchrun --nproc_per_node 2 examples/train_ddp.py            # CPU, gloo
    torchrun --nproc_per_node 2 examples/train_ddp.py --budget 0.4 --steps 20

Each rank measures one eager DDP step's peak, optimizes its model for a share of it (the
budget is per rank), wraps it in DDP and trains. Rank 0 plans and the other ranks receive
its plan (the output says so); DDP's gradient buckets are left out of the budget because
the plan is made inside DDP's forward (no ``example_inputs``). At the end every rank
prints its measured peak against the budget and checks its parameters against an eager
DDP twin trained on the same data.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import checkmate
from checkmate.memory import measure_peak
from solvers import format_bytes

try:
    from examples.train_transformer import TinyGPT
except ModuleNotFoundError:  # run as a script (torchrun examples/train_ddp.py): its own folder is on sys.path
    from train_transformer import TinyGPT  # type: ignore[no-redef]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=0.5, help="share of eager DDP's per-rank step peak")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--time-limit", type=float, default=10.0)
    args = ap.parse_args()

    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    rank = dist.get_rank()
    dev = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)  # the same weights on every rank
    base = TinyGPT(256, 64, 4, 4, 64, dropout=0.1).to(dev)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    data = torch.randint(0, 256, (8, 65), generator=gen).to(dev)
    idx, targets = data[:, :-1], data[:, 1:]

    def step(m: torch.nn.Module, seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        loss = m(idx, targets)
        loss.backward()
        return loss.detach()

    eager = DDP(copy.deepcopy(base))
    step(eager, 0)
    eager.zero_grad(set_to_none=True)
    peak_eager = measure_peak(lambda: step(eager, 0))
    budget = int(args.budget * peak_eager)

    model = checkmate.optimize(copy.deepcopy(base), budget, time_limit=args.time_limit)
    ddp = DDP(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, ddp)]
    peak = 0
    for k in range(args.steps):
        for m, opt in zip((eager, ddp), opts):
            opt.zero_grad(set_to_none=True)
            if m is ddp and k > 0:  # the first step plans
                peak = max(peak, measure_peak(lambda m=m, k=k: step(m, k)))  # type: ignore[misc]
            else:
                loss = step(m, k)
            opt.step()
        if rank == 0:
            print(f"step {k}: loss {loss.item():.4f}", flush=True)
    for rec in checkmate.plans_of(model):
        got = str(rec.result.info.get("cache", ""))
        source = f"received from {got}" if got.startswith("rank ") else "planned here"
        print(f"rank {rank}: {rec.summary()} [{source}]", flush=True)
    diff = max((p - q).abs().max().item() for p, q in zip(eager.module.parameters(), model.parameters()))
    print(
        f"rank {rank}: eager DDP peak {format_bytes(peak_eager)}, budget {format_bytes(budget)}, "
        f"measured {format_bytes(peak)} = {peak / budget:.3f}x the budget; "
        f"parameters vs eager DDP: max difference {diff:.3g}",
        flush=True,
    )
    # On gloo, let its threads finish with the backward's collectives before the DDP modules
    # and the group go: they take the GIL, which the group's destructor holds while it joins
    # them (pytorch/pytorch#56297; a rank then never exits, about one run in twenty under load)
    dist.barrier()
    time.sleep(0.2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
