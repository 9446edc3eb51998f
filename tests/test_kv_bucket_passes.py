"""The whole-slot vs KV-bucket pass benchmark runs on CPU with a tiny config."""
from __future__ import annotations

import json

from kv_bucket_passes import main


def test_both_ways_are_timed_alternately_for_every_slot_size(tmp_path) -> None:
    argv = ["--arch", "tiny", "--device", "cpu", "--max-len", "256,384", "--batches", "1,3", "--tokens", "1,4",
            "--kv-len", "150", "--repeats", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 0
    report = json.loads((tmp_path / "kv-bucket-passes.json").read_text())
    ways = [(r["max_len"], r["attend"]) for r in report["rows"][::4]]  # 2 batches x 2 token counts a round
    assert ways == [(m, w) for m in (256, 384) for w in ("whole slot", "KV bucket", "whole slot", "KV bucket")]
    table = (tmp_path / "kv-bucket-passes.md").read_text()
    assert table.count("| 384 | 3 x 4 |") == 1 and str(tmp_path) not in report["rerun"]
