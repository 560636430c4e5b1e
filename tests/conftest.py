"""Fixtures shared by every tier."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from solvers import Graph
from tests import graphs

# Property tests draw the same examples on every run (CI must not depend on luck); set
# HYPOTHESIS_PROFILE=explore to search with fresh randomness.
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def diamond() -> Graph:
    return graphs.diamond()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the user's cache directory from tests."""
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(tmp_path_factory.mktemp("checkmate-cache")))


@pytest.fixture(autouse=True)
def _fresh_least_peak_memo() -> None:
    """Each test starts without least-peak results memoized by earlier ones (what a test
    asserts about a search must not depend on which tests ran before it)."""
    from solvers.strategies import least_peak

    least_peak._MEMO.clear()


@pytest.fixture(autouse=True)
def _no_step_measured_across_tests() -> Iterator[None]:
    """A training step a test left being measured whole (no optimizer step or later call
    closed its window: checkmate.stepcheck) is dropped unjudged when the test ends: its
    verdict, and a profiler it runs, must not land in the next test."""
    yield
    measuring = sys.modules.get("checkmate.measuring")
    if measuring is not None:
        measuring._close_windows_at_exit()
