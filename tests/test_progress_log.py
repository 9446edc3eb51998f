"""Start-up progress as log lines: every few seconds and at the end, not at every step."""
from __future__ import annotations

import logging

import pytest

from specsplit.server.progress_log import ProgressLog


def test_progress_is_logged_every_few_seconds_and_at_the_end(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    progress = ProgressLog(logging.getLogger("test.progress"), "captured CUDA graphs", every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for done in range(1, 101):
            now[0] += 0.3  # 30 s in all: lines at 10, 20 and 30 s, the last being the end
            progress(done, 100)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[-1] == "captured CUDA graphs: 100 of 100 (100%) in 30.0 s"
    assert len(lines) == 3
    assert lines[0].startswith("captured CUDA graphs: 34 of 100 (34%) in 10.")


def test_a_quick_start_logs_only_its_end(caplog: pytest.LogCaptureFixture) -> None:
    progress = ProgressLog(logging.getLogger("test.progress"), "captured", every_s=10, clock=lambda: 5.0)
    with caplog.at_level(logging.INFO, logger="test.progress"):
        for done in range(1, 4):
            progress(done, 3)
    assert [r.getMessage() for r in caplog.records] == ["captured: 3 of 3 (100%) in 0.0 s"]
