"""The host-cost benchmark runs and reports every part for both kinds of session."""
from __future__ import annotations

import json

from host_cost import PARTS, main


def test_host_cost_reports_every_part_for_both_modes(tmp_path) -> None:
    assert main(["--sessions", "3", "--passes", "2", "--repeats", "1", "--out", str(tmp_path / "hc")]) == 0
    report = json.loads((tmp_path / "hc.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["none", "async"]
    for r in report["results"]:
        assert set(r["us_per_row"]) == set(PARTS) and r["us_per_row_total"] > 0
    assert report["results"][1]["drafts_per_row"] > 0  # async sessions verified drafts
    assert "| async |" in (tmp_path / "hc.md").read_text()
