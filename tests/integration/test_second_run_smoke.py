"""Smoke test of ``benchmarks.second_run``: a second process making the same ``optimize``
call finds the first one's plan in the cache and re-validates it (timing is left to the
benchmark: this asserts only what must hold on any machine)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from benchmarks import second_run


def test_second_process_hits_the_cache() -> None:
    row, first, second = second_run.run_pair("mlp", "auto", budget=0.7, time_limit=10.0, timeout=120.0)
    assert first.cache and all(c == "miss" for c in first.cache), first.cache
    assert first.validations == 0  # nothing on disk to re-validate in a cold cache
    assert second.hit, second.cache
    assert second.validations >= len(second.cache)  # the stored plan was replayed
    assert row.revalidated and row.same_plan
    assert second.doc["recomputes"] == first.doc["recomputes"]
    assert first.doc["recomputes"][0] > 0  # 70% of the peak needs rematerialization
