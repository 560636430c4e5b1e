"""Smoke test of ``benchmarks.predict_check`` on the CPU: the peak a fake trace predicts is
the peak the optimized step measures (memory only: no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import benchmarks.big_models as bm
from benchmarks import predict_check

pytestmark = pytest.mark.torch

TINY = [
    "--hidden",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--intermediate",
    "96",
    "--vocab",
    "64",
    "--batch",
    "2",
    "--seq",
    "64",
]


def test_predicted_peak_is_the_measured_peak_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm, "SMALL", dict(bm.SMALL))
    monkeypatch.setenv("CHECKMATE_CACHE", "0")
    out = tmp_path / "check.md"
    argv = ["--device", "cpu", *TINY, "--fractions", "0.6", "--steps", "1", "--warmup", "1"]
    predicted, rows = predict_check.main([*argv, "--time-limit", "5", "--out", str(out)])
    (plan,) = predicted["plans"]
    assert plan["peak"] is not None and plan["peak"] <= plan["budget"]
    assert plan["overhead"] > 0  # 0.6 of keep-all cannot be met without recomputing
    measured = {r["label"]: r for r in rows}
    assert "error" not in measured["0.6 of keep-all"], measured["0.6 of keep-all"]
    for label in ("no budget (compiled, keeps every value)", "0.6 of keep-all"):
        r = measured[label]
        # the CPU allocator's count is exact: only a few bytes of bookkeeping may differ
        assert abs(r["peak"] - r["pred"]) <= 0.01 * r["pred"], (label, r)
    assert (
        measured["0.6 of keep-all"]["peak"]
        < 0.7 * measured["no budget (compiled, keeps every value)"]["peak"]
    )
    assert "| 0.6 of keep-all |" in out.read_text()
