"""Fixtures shared by every tier."""

from __future__ import annotations

import pytest

from solvers import Graph
from tests import graphs


@pytest.fixture
def diamond() -> Graph:
    return graphs.diamond()


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never touch the user's cache directory from tests."""
    monkeypatch.setenv("CHECKMATE_CACHE_DIR", str(tmp_path_factory.mktemp("checkmate-cache")))
