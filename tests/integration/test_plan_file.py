"""``optimize(..., plan="p.json")`` with graph breaks: one file holds a plan per graph, a
second process reuses every one of them, and a plan it rejects is never overwritten."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.torch

_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    import torch.nn.functional as F
    from torch import nn
    import checkmate
    from checkmate.api import plans_of

    class TwoBreaks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh())
            self.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))

        def forward(self, x, y):
            h = self.a(x)
            torch._dynamo.graph_break()
            h = self.b(h)
            torch._dynamo.graph_break()
            return F.cross_entropy(h, y)

    torch.manual_seed(0)
    model = TwoBreaks()
    x, y = torch.randn(4, 16), torch.randint(0, 8, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = checkmate.optimize(
            model, 1.0, (x, y), strategy="checkpoint-all", profile="cpu", plan=sys.argv[1]
        )
        opt(x, y).backward()
    print(json.dumps({
        "cache": [r.cache for r in plans_of(opt)],
        "warnings": [str(w.message) for w in caught if "plan file" in str(w.message)],
    }))
    """
)


def _run(plan: Path, cache: Path) -> dict[str, list[str]]:
    env = {**os.environ, "CHECKMATE_CACHE_DIR": str(cache)}
    env.pop("CHECKMATE_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(plan)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, list[str]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_a_second_process_reuses_the_plan_of_every_graph(tmp_path: Path) -> None:
    plan, cache = tmp_path / "p.json", tmp_path / "cache"
    first = _run(plan, cache)
    assert first["cache"] == ["miss"] * 3, first  # two graph breaks: three graphs
    doc = json.loads(plan.read_text())
    assert doc["format"] == "checkmate-plans" and len(doc["plans"]) == 3
    assert len({e["graph_fingerprint"] for e in doc["plans"]}) == 3
    written = plan.read_bytes()

    second = _run(plan, cache)
    assert second["cache"] == ["pinned"] * 3 and second["warnings"] == [], second
    assert plan.read_bytes() == written
    assert not cache.exists() or list(cache.glob("*.json")) == []

    # a hand-edited entry: rejected with a warning, the file left byte for byte as it is,
    # that graph's new plan in the cache; the other two graphs still use the file
    doc["plans"][1]["schedule"] = doc["plans"][1]["schedule"][:-1]
    plan.write_text(json.dumps(doc))
    edited = plan.read_bytes()
    third = _run(plan, cache)
    assert third["cache"] == ["pinned", "miss", "pinned"], third
    assert len(third["warnings"]) == 1 and "left as it is" in third["warnings"][0], third
    assert plan.read_bytes() == edited
    assert len(list(cache.glob("*.json"))) == 1
