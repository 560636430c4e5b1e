"""``CHECKMATE_LOG``: planning progress on stderr when asked, nothing configured otherwise."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

import checkmate


@pytest.fixture
def logger() -> Iterator[logging.Logger]:
    log = logging.getLogger("checkmate")
    handlers, level = list(log.handlers), log.level
    yield log
    log.handlers[:] = handlers
    log.setLevel(level)


def test_no_variable_leaves_the_logger_to_the_application(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CHECKMATE_LOG", raising=False)
    before = list(logger.handlers)
    checkmate._log_from_environment()
    assert logger.handlers == before


def test_a_level_adds_one_stderr_handler_however_often_it_is_read(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CHECKMATE_LOG", "info")
    checkmate._log_from_environment()
    checkmate._log_from_environment()
    ours = [h for h in logger.handlers if getattr(h, "_checkmate", False)]
    assert len(ours) == 1 and logger.level == logging.INFO
    logger.info("graph 0: planning")
    assert "checkmate: graph 0: planning" in capsys.readouterr().err


def test_an_unknown_level_is_named_and_ignored(
    logger: logging.Logger, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CHECKMATE_LOG", "loud")
    before = list(logger.handlers)
    with caplog.at_level(logging.WARNING, logger="checkmate"):
        checkmate._log_from_environment()
    assert "'loud' is not a logging level" in caplog.text
    assert logger.handlers == before
