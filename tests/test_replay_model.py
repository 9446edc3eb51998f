"""The replay model (bench/replay_model.py) and its report's pieces (bench/replay.py)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import replay
import replay_model as rm
from hypothesis import given, settings
from hypothesis import strategies as st
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer

BENCH = Path(__file__).resolve().parent.parent / "bench"

COSTS = rm.PassCosts(((1, 500.0), (2, 550.0), (4, 650.0), (8, 900.0)))
LINK = rm.Link(draft_ms=60.0, one_way_ms=25.0)


def test_pass_costs_interpolate_between_sizes_and_hold_past_the_largest() -> None:
    assert COSTS.ms(1) == 500.0
    assert COSTS.ms(3) == 600.0
    assert COSTS.ms(6) == 775.0
    assert COSTS.ms(20) == 900.0
    assert COSTS.flat().ms(20) == 500.0
    with pytest.raises(ValueError):
        rm.PassCosts(((0, 10.0),))


def test_none_takes_one_pass_per_token() -> None:
    d = rm.none([True] * 11, COSTS)
    assert (d.ms, d.tokens, d.passes) == (5000.0, 10, 10)


def test_sync_with_a_draft_that_always_agrees_commits_k_plus_one_per_round() -> None:
    d = rm.sync([True] * 16, COSTS, LINK, k=4)  # 15 tokens after the first: 5 + 5 + 5
    assert d.passes == 3
    assert d.ms == pytest.approx(3 * (4 * 60 + 50 + COSTS.ms(5)))  # k drafts and the last committed token
    assert d.server_idle_ms == pytest.approx(3 * (4 * 60 + 50))


def test_sync_with_a_draft_that_never_agrees_commits_one_per_round() -> None:
    assert rm.sync([False] * 9, COSTS, LINK, k=4).passes == 8


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=40))
def test_every_mode_commits_the_whole_continuation_and_no_pass_is_free(agree: list[bool]) -> None:
    for d in (rm.none(agree, COSTS), rm.sync(agree, COSTS, LINK, 3), rm.asynchronous(agree, COSTS, LINK)):
        assert d.tokens == len(agree) - 1
        assert d.passes >= math.ceil(d.tokens / 25)  # at most 24 drafts and the target's own token a pass
        assert d.ms >= d.passes * COSTS.ms(1)


def test_async_beats_sync_when_the_draft_agrees_and_drafting_is_slow_against_the_link() -> None:
    agree = [True] * 64
    best_sync = min(rm.sync(agree, COSTS, LINK, k).ms for k in (2, 4, 6, 8))
    assert rm.asynchronous(agree, COSTS, LINK).ms < best_sync


def test_async_recovers_after_a_rejection() -> None:
    """A single disagreement costs the edge its line past it; drafting restarts from the
    corrected token, so it costs about one extra pass, not a run of one-token steps."""
    clean = rm.asynchronous([True] * 60, COSTS, LINK)
    one_miss = rm.asynchronous([True] * 20 + [False] + [True] * 39, COSTS, LINK)
    assert one_miss.passes <= clean.passes + 2
    assert one_miss.server_idle_ms > 0  # waiting for the new line's drafts


class _NextTokenDrafter:
    """Predicts the last token plus one."""

    def next_logits(self, trajectory: list[int]) -> np.ndarray:
        logits = np.zeros(16, dtype=np.float32)
        logits[trajectory[-1] + 1] = 1.0
        return logits


def test_agreement_is_teacher_forced() -> None:
    # After 4 it predicts 5 (right), after 5 predicts 6 (right), after 6 predicts 7 (the target said 9),
    # and after the target's 9 it predicts 10 (right, though its own previous guess was wrong).
    assert replay.agreement(_NextTokenDrafter(), [4], [5, 6, 9, 10]) == [True, True, False, True]


def test_measured_speedups_leave_the_first_token_out() -> None:
    runs = [
        {"mode": "none", "rtt_ms": 50.0, "prompt": "p", "tokens": 11, "elapsed_s": 12.0, "ttft_s": 2.0},
        {"mode": "async", "rtt_ms": 50.0, "prompt": "p", "tokens": 11, "elapsed_s": 7.0, "ttft_s": 2.0},
        {"mode": "async", "rtt_ms": 20.0, "prompt": "p", "tokens": 11, "elapsed_s": 3.0, "ttft_s": 2.0},
    ]
    assert replay.measured_speedups(runs, 50.0) == {"none": 1.0, "async": 2.0}


def test_half_the_misses_fixed_keeps_every_agreement_and_every_odd_miss() -> None:
    assert replay._fix_half([True, False, False, True, False, False]) == [True, False, True, True, False, True]


def test_the_replay_report_end_to_end_with_a_real_onnx_draft(tiny, tmp_path: Path) -> None:
    """The draft replayed over its own greedy continuation agrees everywhere, so the model's
    figures equal the always-agreeing what-if's; measured figures come from the run."""
    text = next(q["text"] for q in json.loads((BENCH / "prompts.json").read_text())["prompts"] if q["id"] == "code-fib")
    tokenizer, drafter = EdgeTokenizer(tiny.draft_dir), OnnxDrafter(tiny.draft_dir)
    seq = tokenizer.encode(tokenizer.chat_prompt(text))
    continuation = []
    for _ in range(12):
        continuation.append(int(np.argmax(drafter.next_logits(seq + continuation))))
    run = {"rtt_ms": 50.0, "prompt": "code-fib", "tokens": 12, "ttft_s": 1.0, "token_ids": continuation}
    bench = {"machine": {"cpu": "test", "cores": 2}, "network": {"rtt_ms": [50.0]},
             "models": {"draft": tiny.draft_dir.resolve().name}, "runs": [
        {**run, "mode": "none", "elapsed_s": 12.0},
        {**run, "mode": "sync-4", "elapsed_s": 6.5},
        {"mode": "draft", "rtt_ms": None, "prompt": "code-fib", "tokens": 12, "tokens_per_s": 20.0},
    ]}
    passes = {"archs": {"tiny": {"passes": [{"sessions": 1, "tokens_per_session": t, "ms_median": ms}
                                            for t, ms in ((1, 500.0), (4, 600.0), (8, 800.0))]}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "passes.json").write_text(json.dumps(passes))
    subprocess.run([sys.executable, str(BENCH / "replay.py"), "--bench", str(tmp_path / "bench.json"),
                    "--pass-costs", str(tmp_path / "passes.json"), "--draft", str(tiny.draft_dir),
                    "--sync-k", "4", "--out", str(tmp_path), "--name", "r"], check=True, timeout=300)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["agreement"] == {"code-fib": "1" * 12}
    assert result["measured"] == {"none": 1.0, "sync-4": pytest.approx(2.0)}
    assert set(result["scenarios"]["model"]) == {"none", "sync-4", "async"}
    assert result["scenarios"]["model"] == result["scenarios"]["draft_always_right"]
    assert result["scenarios"]["model"]["async"]["speedup"] > 1.0
    # Without the link's delay a sync round no longer waits for it.
    assert result["scenarios"]["no_delay"]["sync-4"]["speedup"] > result["scenarios"]["model"]["sync-4"]["speedup"]
    assert "| sync-4 | 2.00x |" in (tmp_path / "r.md").read_text()
    # Another draft than the run's (the default pair's, where --draft is not given) models another run.
    bench["models"]["draft"] = "another-draft-int8-onnx"
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    refused = subprocess.run([sys.executable, str(BENCH / "replay.py"), "--bench", str(tmp_path / "bench.json"),
                              "--pass-costs", str(tmp_path / "passes.json"), "--draft", str(tiny.draft_dir),
                              "--out", str(tmp_path), "--name", "r2"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "ran the draft another-draft-int8-onnx, not" in refused.stderr


def test_a_draft_that_never_agrees_makes_async_as_slow_as_the_server_alone_at_any_pass_time() -> None:
    """The model's clock stepped a whole millisecond: every event waited for the next one, so a
    20.1 ms pass took 21 and a 25.4 ms draft 26, and async came out 4.6% slower than the
    server alone (1345 against 1286 ms), where a 20.0 ms pass gave 1281 against 1280."""
    link = rm.Link(draft_ms=25.4, one_way_ms=25.0)
    for pass_ms in (20.0, 20.1, 20.7):
        costs = rm.PassCosts(((1, pass_ms),))
        agree = [False] * 65
        assert rm.asynchronous(agree, costs, link).ms == pytest.approx(rm.none(agree, costs).ms)


def test_a_draft_that_always_agrees_leaves_the_server_idle_only_until_the_first_drafts_come() -> None:
    """Near the end the model planned with the whole --max-verify-tokens, and where only the
    last token (the target's own) was left it waited up to --max-wait-ms for drafts the edge
    never drafts there (the server plans within the generation's room): 500 ms more idle for
    97 tokens, none for 40 or 60."""
    costs, link = rm.PassCosts(((1, 200.0), (8, 300.0))), rm.Link(draft_ms=42.2, one_way_ms=25.0)
    idle = {n: rm.asynchronous([True] * n, costs, link).server_idle_ms for n in (40, 60, 97)}
    assert len(set(idle.values())) == 1, idle


@pytest.mark.parametrize(("settings", "said"), [
    ({"window": "8"}, "ran async with a fixed window of 8"),
    ({"server_args": "--max-wait-ms 50"}, "ran the server with `--max-wait-ms 50`"),
])
def test_a_run_of_other_settings_than_the_model_s_is_refused(tmp_path, settings, said) -> None:
    """Replayed with the edge's and the server's defaults whatever the run had used, the model
    stood in the report beside figures measured of something else."""
    bench = {"machine": {"cpu": "test", "cores": 2}, "network": {"rtt_ms": [50.0]}, "runs": [],
             "settings": {"window": "auto", "server_args": "", **settings}}
    passes = {"archs": {"tiny": {"passes": [{"sessions": 1, "tokens_per_session": 1, "ms_median": 500.0}]}}}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "passes.json").write_text(json.dumps(passes))
    proc = subprocess.run([sys.executable, str(BENCH / "replay.py"), "--bench", str(tmp_path / "bench.json"),
                           "--pass-costs", str(tmp_path / "passes.json"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and said in proc.stderr
