"""Test graphs: small hand-made ones and the public benchmark graphs (import from tests.graphs)."""

from __future__ import annotations

from pathlib import Path

from solvers import Graph, load_graph

REPO = Path(__file__).resolve().parents[1]
PUBLIC = REPO / "benchmarks" / "graphs"  # in the repository: see its README.md


def public_graph(name: str) -> Graph:
    """Load a public benchmark graph (benchmarks/graphs) by file name."""
    return load_graph(PUBLIC / name)


def zoo_masked() -> Graph:
    """A small traced joint graph (the zoo's masked model: 49 ops, 5 KiB tensors, every op
    at the cpu profile's 5 us floor) where the heuristics find nothing at 0.9 of its peak."""
    return load_graph(REPO / "tests" / "data" / "zoo_masked.json")


def mlp16() -> Graph:
    """A traced 16-layer MLP (Linear 64x64 + Tanh, a batch of 8192: 2 MiB activations, 16 KiB
    weights; 97 nodes, measured CPU times) where, at half its keep-all peak, the MILP finds no
    schedule in 90 s and LP rounding's costs 2.89x the step."""
    return load_graph(REPO / "tests" / "data" / "mlp16.json")


def dropout6() -> Graph:
    """A traced joint graph of six pre-norm MLP blocks (256-1024-256, dropout 0.1 with its
    masks replayable; 185 nodes, measured CPU times) on which the heuristics are not
    monotone in the budget: DTR without banishing fits 0.84 and 0.86 of 47.06 MiB and none
    fits 0.88-0.94."""
    return load_graph(REPO / "tests" / "data" / "dropout6.json")


def chain(n: int, *, cost: float = 1.0, mem: int = 1, training: bool = False) -> Graph:
    """A linear chain of n nodes; with ``training``, a mirrored backward chain of n more.

    The training chain: forward f0 -> ... -> f_{n-1}; backward b_{n-1} -> ... -> b_0 where
    b_i reads f_i (and b_{i+1}), as in the Checkmate paper's linear-network examples.
    """
    nodes = [{"key": i, "name": f"f{i}", "cost": cost, "mem": mem} for i in range(n)]
    edges = [(i, i + 1) for i in range(n - 1)]
    if training:
        for j in range(n):
            i = n - 1 - j
            key = n + j
            nodes.append({"key": key, "name": f"b{i}", "cost": cost, "mem": mem, "backward": True})
            edges.append((i, key))
            edges.append((key - 1, key))  # f_{n-1} -> b_{n-1}, then b_{i+1} -> b_i
    return Graph.build(nodes, sorted(set(edges)), name=f"chain{n}{'-train' if training else ''}")


def diamond() -> Graph:
    """a -> (b, c) -> d with sizes 4, 2, 3, 1 and costs 1, 2, 3, 4."""
    nodes = [
        {"key": "a", "cost": 1, "mem": 4},
        {"key": "b", "cost": 2, "mem": 2},
        {"key": "c", "cost": 3, "mem": 3},
        {"key": "d", "cost": 4, "mem": 1},
    ]
    return Graph.build(nodes, [("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], name="diamond")
