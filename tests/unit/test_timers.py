"""Stage timers: seconds accumulate per stage and reach observers, also on errors."""

from __future__ import annotations

import pytest

from checkmate.timers import observe, stage


def test_stage_accumulates_and_reports_even_when_the_block_raises() -> None:
    spent: dict[str, float] = {}
    seen: list[str] = []
    with observe(lambda name, dt: seen.append(name)):
        with stage("solve", spent):
            pass
        with pytest.raises(RuntimeError), stage("solve", spent):
            raise RuntimeError("boom")
        with stage("profile"):
            pass
    with stage("after"):  # the observer is gone
        pass
    assert seen == ["solve", "solve", "profile"]
    assert set(spent) == {"solve"} and spent["solve"] >= 0.0
