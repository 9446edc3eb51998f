"""The benchmark's per-position acceptance: what a simulated edge's alpha stands for."""
from __future__ import annotations

import json
from pathlib import Path

from report import summarize

from specsplit.edge.stats import GenerationStats
from specsplit.protocol.messages import Verdict


def _verdict(accepted: int, proposed: int) -> Verdict:
    return Verdict(start=0, tokens=(1,) * (accepted + 1), accepted=accepted, proposed=proposed, candidate_tip=0,
                   rejected=int(accepted < proposed))


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
    assert "| 50 | none | 1 | 1.00 | 1.00x | – | –/– | – | – | – |" in md  # its acceptance columns blank
    assert "- every output identical to none: NO" in md


def test_wire_bytes_are_per_token_where_every_run_counted_them() -> None:
    counted = [{**_run(p, 3, 1), "wire_bytes_up": 400, "wire_bytes_down": 800} for p in "ab"]
    (row,) = summarize(counted)
    assert (row["wire_bytes_up_per_token"], row["wire_bytes_down_per_token"]) == (50.0, 100.0)  # 16 tokens
    (older,) = summarize([counted[0], _run("b", 3, 1)])  # a run from before they were counted
    assert older["wire_bytes_up_per_token"] is None


def test_a_figure_no_run_has_is_none_not_a_measured_zero() -> None:
    """The draft alone has no verdicts, and a run that committed nothing no first token: the
    JSON said 0 for the one, and summing the other raised TypeError, losing the run."""
    draft = {"mode": "draft", "rtt_ms": None, "prompt": "a", "tokens": 8, "tokens_per_s": 20.0, "token_ids": [1]}
    nothing = {**_run("a", 0, 0), "mode": "none", "ttft_s": None}
    rows = {r["mode"]: r for r in summarize([draft, nothing])}
    assert rows["draft"]["itl_p99_ms"] is None and rows["draft"]["server_idle_fraction"] is None
    assert rows["none"]["ttft_ms"] is None


def test_the_goal_says_how_each_ratio_is_taken() -> None:
    """Per prompt, async runs 2x and 4x none (mean of ratios 3x) and 1x and 4x sync-4."""
    from report import render_markdown

    def run(mode: str, prompt: str, tps: float) -> dict:
        return {**_run(prompt, 0, 0), "mode": mode, "tokens_per_s": tps}

    runs = [run("none", "a", 1.0), run("none", "b", 1.0), run("async", "a", 2.0), run("async", "b", 4.0),
            run("sync-4", "a", 2.0), run("sync-4", "b", 1.0)]
    committed = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "quick.json").read_text())
    md = render_markdown({**committed, "runs": runs, "summary": summarize(runs)})
    assert "- async vs none: 3.00x (goal 3.0x; the mean of per-prompt ratios; the ratio of mean tokens/s: 3.00x)" in md
    assert ("- async vs best sync (sync-4): 2.00x (goal 1.3x; the ratio of mean tokens/s; the mean of per-prompt "
            "ratios: 2.50x)") in md


def test_a_verdict_of_ten_tokens_or_more_is_not_drawn_as_nine() -> None:
    from report import timeline_chart

    chart, _ = timeline_chart({"timeline": [("verdict", 0.5, 0, 12, 11, 20.0, 11, 0), ("verdict", 1.0, 12, 3, 2, 20.0, 2, 0)]},
                              0.0)
    commits = next(line for line in chart.splitlines() if line.startswith("commits"))
    assert commits.split()[1:3] == ["+", "3"]


def test_the_server_alone_at_each_rtt_is_held_to_its_first_rtt_s_output() -> None:
    """Each none run was compared with itself: "identical" read yes whatever the server decoded."""
    none = {**_run("a", 0, 0), "mode": "none"}
    rows = {r["rtt_ms"]: r for r in summarize([{**none, "rtt_ms": 0}, {**none, "rtt_ms": 50, "token_ids": [2]}])}
    assert (rows[0]["identical"], rows[50]["identical"]) == (True, False)
