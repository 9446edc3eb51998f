"""bench/accept_rate.py: the server's listeners taking calls while its loop is busy (no timing asserted)."""
from __future__ import annotations

import pytest

import accept_rate


def test_the_accept_rate_bench_measures_each_listener_count(tmp_path) -> None:
    settings = accept_rate.Settings(listeners=(1, 3), callers=4, duration_s=0.5, turn_ms=0.5)
    report = accept_rate.measure(settings, log=lambda _: None)
    assert [r["listeners"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        assert row["errors"] == 0 and row["calls"] > 0, row
        assert row["calls_per_s"] == pytest.approx(row["calls"] / settings.duration_s)
        assert 0 < row["latency_ms"]["p50"] < 30_000  # a call's own time: not 0, not past its timeout
    text = accept_rate.render(report, "t")
    assert "| listeners | calls/s |" in text and "0.5 ms of other work in every turn" in text
    for row in report["rows"]:  # each row as measured
        assert f"| {row['listeners']} | {row['calls_per_s']:.0f} |" in text


def test_the_accept_rate_bench_refuses_bad_settings(capsys) -> None:
    with pytest.raises(SystemExit):
        accept_rate.main(["--listeners", "0"])
    assert "at least 1" in capsys.readouterr().err
