"""The pass-split benchmark runs on CPU with a tiny random-weight target: a limit splits the
mixed batch's pass, holds less padded cache, and changes no session's greedy ids."""
from __future__ import annotations

import json

from pass_split import main


def test_a_limit_splits_the_mixed_pass_and_changes_no_ids(tmp_path) -> None:
    argv = ["--arch", "tiny", "--device", "cpu", "--long", "1200", "--short", "16", "--sessions", "6",
            "--drafts", "2", "--limits-mb", "1", "--repeats", "1", "--name", "ps", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "ps.json").read_text())
    whole, split, alone = report["rows"]
    # A tiny fp32 position is 512 bytes: 1 MiB holds the long session alone and the five short ones together.
    assert (whole["limit_mb"], whole["passes"], split["passes"]) == (0, 1, 2)
    assert whole["padded_positions"] == 6 * 1203 and split["padded_positions"] == 1203 + 5 * 19
    assert (alone["limit_mb"], alone["passes"], alone["padded_positions"]) == (None, 6, 1203 + 5 * 19)
    assert whole["sessions_differing"] == split["sessions_differing"] == alone["sessions_differing"] == 0
    assert str(tmp_path) not in report["rerun"] and "| 1 MiB | 2 |" in (tmp_path / "ps.md").read_text()
