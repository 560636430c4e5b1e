"""Joint graphs the project traces itself, for ``make bench``: a 12-layer GPT-2-small-like
transformer and a ResNet-50-like CNN, captured by the PyTorch front end
(:func:`checkmate.cli_trace.trace_factory`: torch.compile + AOTAutograd joint graph, op costs
from the ``cpu`` device profile) and saved as graph JSON for the solver benchmark.

Run as ``python -m benchmarks.traced OUT_DIR`` (``benchmarks.run`` does, in a subprocess, so
the benchmark process itself never imports torch). Batch sizes are CPU-sized: tracing runs
one real training step on this machine.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["gpt2_small", "resnet50_like", "main"]

FACTORIES = {
    "gpt2_small": "benchmarks.traced:gpt2_small",
    "resnet50_like": "benchmarks.traced:resnet50_like",
}

#: GPT-2-small-like training batch: sequences x tokens per sequence. 1,024 tokens: the
#: activations (keep-all peak about 1.6 GB) outweigh the 495 MB of parameter gradients the
#: step holds to its end, so half the keep-all peak admits a plan; at 2 x 128 the gradients
#: were 80% of that peak. One eager step takes about 20 s on a 2-core CPU.
GPT2_BATCH = 8
GPT2_SEQ = 128


class _LossOf(nn.Module):
    """``model`` followed by its training loss, so the traced step ends in one scalar."""

    def __init__(self, model: nn.Module, loss: str) -> None:
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        if self.loss == "lm":
            logits = out.logits[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        return F.cross_entropy(out, y)


def gpt2_small(batch: int = GPT2_BATCH, seq: int = GPT2_SEQ) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """GPT-2 small's shape (12 layers, d=768, 12 heads, vocab 50257), ``batch`` x ``seq`` tokens."""
    from benchmarks.models import gpt2_workload

    w = gpt2_workload("small", batch=batch, seq=seq)
    ids = w.inputs[0]
    return _LossOf(w.build(0.0), "lm"), ids, ids


class _Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def _resnet50(classes: int = 1000) -> nn.Module:
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
    ]  # fmt: skip
    cin = 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers.append(_Bottleneck(cin, width, stride if b == 0 else 1))
            cin = 4 * width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet50_like() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """ResNet-50's layout (bottlenecks 3-4-6-3, BatchNorm), batch 4 x 3x224x224."""
    torch.manual_seed(0)
    return _LossOf(_resnet50(), "ce"), torch.randn(4, 3, 224, 224), torch.randint(0, 1000, (4,))


def main(argv: list[str] | None = None) -> int:
    """Trace every factory into OUT_DIR/<name>.json; print one JSON line per model."""
    from checkmate.cli_trace import trace_factory
    from solvers.io import save_graph

    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "benchmarks/results/graphs")
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in FACTORIES.items():
        t0 = time.perf_counter()
        try:
            graphs = trace_factory(spec, profile="cpu")
        except Exception as exc:  # one model's failure is a note, not the end of the run
            print(json.dumps({"name": name, "error": f"{type(exc).__name__}: {exc}"[:300]}), flush=True)
            continue
        seconds = time.perf_counter() - t0
        for k, g in enumerate(graphs):
            stem = name if len(graphs) == 1 else f"{name}.{k}"
            save_graph(g, out / f"traced_{stem}.json")
        print(
            json.dumps(
                {
                    "name": name,
                    "graphs": len(graphs),
                    "nodes": [g.n for g in graphs],
                    "trace_seconds": round(seconds, 1),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
