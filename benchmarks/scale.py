"""Scale of the plumbing: ``checkmate solve`` on a 400,000-node chain with ``checkpoint-all``.

Reading the graph, planning, simulating, validating and writing the plan must stay
O(nodes + steps) in memory; the target is the plan written within 60 s and 2 GB of RSS.
Run with ``make bench-scale``; writes ``benchmarks/results/scale.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from solvers import save_graph
from tests.graphs import chain

TARGET_SECONDS = 60.0
TARGET_RSS = 2 * 2**30


def measure(nodes: int, folder: Path) -> dict[str, float | int | str]:
    """Write the chain of ``nodes`` nodes, plan it in a child process; seconds and peak RSS."""
    graph = folder / "chain.json"
    save_graph(chain(nodes // 2, training=True), graph)
    plan = folder / "plan.json"
    argv = [sys.executable, "-m", "checkmate", "solve", str(graph), "-b", "1.0", "-s", "checkpoint-all"]
    argv += ["-o", str(plan), "-q"]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=folder)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"checkmate solve failed (exit {proc.returncode}): {proc.stderr.strip()}")
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux: KiB
    steps = len(json.loads(plan.read_text())["schedule"])
    return {"nodes": nodes, "steps": steps, "seconds": wall, "rss": rss, "plan_bytes": plan.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=400_000)
    ap.add_argument("--out", default="benchmarks/results/scale.md")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(args.nodes, Path(tmp))
    ok = row["seconds"] <= TARGET_SECONDS and row["rss"] <= TARGET_RSS
    import solvers

    lines = [
        "# Scale: `checkmate solve -s checkpoint-all` on a long chain",
        "",
        f"`make bench-scale` (benchmarks/scale.py), checkmate {solvers.__version__}; target: plan written "
        f"within {TARGET_SECONDS:.0f} s and {TARGET_RSS / 2**30:.0f} GiB RSS. Wall time includes the "
        "interpreter start and reading the graph; RSS is the child's peak (ru_maxrss).",
        "",
        "| nodes | schedule steps | wall (s) | peak RSS (MiB) | plan file (MiB) | target met |",
        "|---:|---:|---:|---:|---:|:---:|",
        f"| {row['nodes']:,} | {row['steps']:,} | {row['seconds']:.1f} | {int(row['rss']) / 2**20:.0f} | "
        f"{int(row['plan_bytes']) / 2**20:.1f} | {'yes' if ok else 'no'} |",
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
