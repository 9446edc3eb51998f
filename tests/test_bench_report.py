"""The benchmark's per-position acceptance: what a simulated edge's alpha stands for."""
from __future__ import annotations

import json
from pathlib import Path

from report import summarize

from specsplit.edge.stats import GenerationStats
from specsplit.protocol.messages import Verdict


def _verdict(accepted: int, proposed: int) -> Verdict:
    return Verdict(start=0, tokens=(1,) * (accepted + 1), accepted=accepted, proposed=proposed, candidate_tip=0)


def test_the_edge_counts_verifications_that_stopped_at_a_rejection() -> None:
    stats = GenerationStats(mode="async")
    for accepted, proposed in [(4, 4), (2, 6), (0, 3), (1, 1)]:
        stats.add_verdict(_verdict(accepted, proposed), 0.0)
    assert stats.rejections == 2
    stats.finish(0, 1.0, [])
    # 7 drafts accepted; 2 rejected where the one before was right. Per proposed draft it is 7/14.
    assert stats.acceptance_per_position == 7 / 9 and stats.acceptance_rate == 0.5


def _run(prompt: str, accepted: int, rejections: int | None) -> dict:
    run = {"mode": "async", "rtt_ms": 50, "prompt": prompt, "tokens": 8, "tokens_per_s": 1.0, "token_ids": [1],
           "drafts_accepted": accepted}
    if rejections is not None:
        run["rejections"] = rejections
    return run


def test_the_report_pools_per_position_acceptance_over_prompts() -> None:
    (row,) = summarize([_run("a", 9, 1), _run("b", 1, 1)])
    assert row["acceptance_per_position"] == 10 / 12  # pooled, not the mean of 0.9 and 0.5
    (older,) = summarize([_run("a", 9, 1), _run("b", 1, None)])
    assert older["acceptance_per_position"] is None  # a run from before edges counted rejections


def test_none_drafts_nothing_and_a_row_without_a_comparison_is_no_evidence() -> None:
    from report import render_markdown

    none = {**_run("a", 0, 0), "mode": "none", "acceptance_rate": 0.0, "mean_accepted": 0.0}
    runs = [none, {**_run("a", 3, 1), "mode": "sync-4"}, _run("b", 3, 1)]  # async's prompt b: no none run for it
    rows = {r["mode"]: r for r in summarize(runs)}
    assert rows["none"]["acceptance_rate"] is None and rows["none"]["mean_accepted"] is None
    assert rows["sync-4"]["identical"] is True and rows["async"]["identical"] is None
    committed = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "quick.json").read_text())
    md = render_markdown({**committed, "runs": runs, "summary": list(rows.values())})
    assert "| 50 | none | 1 | 1.00 | 1.00x | 0 | 0/0 | – | – | – |" in md  # its acceptance columns blank
    assert "- every output identical to none: NO" in md


def test_wire_bytes_are_per_token_where_every_run_counted_them() -> None:
    counted = [{**_run(p, 3, 1), "wire_bytes_up": 400, "wire_bytes_down": 800} for p in "ab"]
    (row,) = summarize(counted)
    assert (row["wire_bytes_up_per_token"], row["wire_bytes_down_per_token"]) == (50.0, 100.0)  # 16 tokens
    (older,) = summarize([counted[0], _run("b", 3, 1)])  # a run from before they were counted
    assert older["wire_bytes_up_per_token"] is None
