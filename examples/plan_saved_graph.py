"""Plan a saved graph without torch: every strategy at a few budgets, one table.

    python examples/plan_saved_graph.py benchmarks/graphs/VGG16_b256_224x224.json
    python examples/plan_saved_graph.py my_model.json --budgets 0.8,0.6 --time-limit 30

A graph file comes from ``checkmate trace`` (a PyTorch model) or is one of the public
Checkmate / random layered graphs. Nothing here imports torch.
"""

from __future__ import annotations

import argparse

from solvers import InfeasibleBudgetError, load_graph, solve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("graph")
    ap.add_argument("--budgets", default="0.9,0.7,0.5")
    ap.add_argument("--strategies", default="auto,lp-rounding,dtr,chen-greedy,checkpoint-all")
    ap.add_argument("--time-limit", type=float, default=20.0)
    args = ap.parse_args()

    g = load_graph(args.graph)
    print(g.summary())
    print(f"{'budget':>7} {'strategy':<15} {'status':<12} {'overhead':>9} {'cost/bound':>10} {'seconds':>8}")
    for budget in args.budgets.split(","):
        for name in args.strategies.split(","):
            try:
                res = solve(g, budget, name, time_limit=args.time_limit)
            except InfeasibleBudgetError as exc:
                print(
                    f"{budget:>7} {name:<15} infeasible   (needs >= {exc.lower_bound or 0:,} bytes; "
                    f"a plan exists at {exc.minimum or 0:,})"
                )
                break
            over = f"{res.cost / g.total_cost:.4f}x" if res.ok and res.cost else "-"
            gap = f"{res.cost / res.lower_bound:.4f}" if res.ok and res.cost and res.lower_bound else "-"
            print(f"{budget:>7} {name:<15} {res.status!s:<12} {over:>9} {gap:>10} {res.solve_seconds:>8.2f}")


if __name__ == "__main__":
    main()
