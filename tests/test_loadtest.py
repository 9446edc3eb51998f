"""The load test's short form: a few sessions of every kind against a real server
process with the tiny models, for correctness only (no timing is asserted)."""
from __future__ import annotations

import asyncio
import http.server
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM

from certs import make_pki
from conftest import free_port, launch_server
from loadtest import run as loadtest_run
from loadtest.capacity import capacity
from loadtest.capacity import render as capacity_render
from loadtest.endpoint import ServerEndpoint
from loadtest.harness import RunOptions, started, sweep_and_report
from loadtest import point as point_module
from loadtest.point import ServerHandle, run_point
from loadtest.prompts import load_prompts
from loadtest.report import _lag, _window, limit_text, render_markdown, write_report
from loadtest.sessions import (GenerationRecord, LoadRun, LoadSettings, LoadSpec, SessionLog, _Session,
                               committed_between, run_sessions)
from loadtest.simdraft import PacedSimulatedDrafter, SimulatedDrafter
from loadtest.summary import by_process, server_figures, session_speeds, summarize
from loadtest import sweep as sweep_module
from loadtest.sweep import (INTERRUPTED, SweepConfig, reference_continuations, repeated_point, sessions_at_slo,
                            slo_limit)
from loadtest.targets import ARCHS, describe_target, write_config_target
from loadtest.timeline import Acceptance
from loadtest.workers import ClientWorkers
from prompt_set import benchmark_prompts
from specsplit.edge.client import ConnectOptions, EdgeConfig, StreamEnded, StreamStalled, generate
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.server import cli as server_cli

MAX_NEW = 24


@pytest.fixture(scope="module")
def running(tiny, tmp_path_factory):
    """One server (metrics on) for the module, started as the load test starts it."""
    log = tmp_path_factory.mktemp("loadtest") / "server.log"
    opts = RunOptions(target=tiny.target_dir, draft=tiny.draft_dir, dtype="fp32", server_log=log,
                      rerun="python bench/loadtest/run.py")
    with started(opts, SweepConfig(sessions=(8,)), log=lambda _: None) as r:
        yield opts, r


@pytest.fixture(scope="module")
def references(running):
    _, r = running
    return reference_continuations(r.server.endpoint, r.prompts, MAX_NEW)


def test_references_are_the_targets_greedy_continuations(tiny, running, references) -> None:
    prompts = running[1].prompts
    model = AutoModelForCausalLM.from_pretrained(str(tiny.target_dir)).eval()
    for ids, ref in zip(prompts.ids, references):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False)
        assert ref == tuple(out[0, len(ids) :].tolist())


def test_mixed_sessions_are_lossless_and_hit_alpha(tiny, running, references) -> None:
    server, prompts = running[1].server, running[1].prompts
    settings = LoadSettings(max_new_tokens=MAX_NEW, window=8, alpha=0.7, seed=7, duration_s=None, generations=3)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings, str(tiny.draft_dir))
    point = run_point(server, spec, ["sim"] * 4 + ["onnx"] * 2 + ["none"] * 2)
    assert point["errors"] == {"total": 0, "by_code": {}}
    assert point["generations"] == 8 * 3 and point["sessions_without_output"] == 0
    assert point["mismatched_outputs"] == 0  # every output is the target's greedy continuation
    sim = point["acceptance"]["sim"]
    assert sim["drafts_accepted"] + sim["rejections"] >= 20, sim  # enough judged drafts for the estimate
    assert 0.3 <= sim["alpha_measured"] <= 0.95, sim
    server_side = point["server"]
    assert server_side["tokens_committed"] == point["tokens"]
    assert server_side["passes"] > 0 and server_side["batch_sessions_mean"] >= 1
    assert point["verdict_latency_ms"]["count"] > 0 and point["itl_ms"]["count"] > 0


def test_ramped_sessions_arrive_one_after_another_and_are_measured_after_the_warm_up(tiny, running,
                                                                                       references) -> None:
    server, prompts = running[1].server, running[1].prompts
    settings = LoadSettings(max_new_tokens=MAX_NEW, window=8, alpha=0.7, duration_s=0.5, ramp_s=0.6, warmup_s=0.3)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings)
    run = asyncio.run(run_sessions(spec, [(i, "sim") for i in range(4)]))
    assert run.deadline - run.started == pytest.approx(0.6 + 0.3 + 0.5)  # the ramp, the warm-up, the window
    for session in run.sessions:
        assert not session.errors and session.records
        assert session.window_s == pytest.approx(0.5)  # every one started before the window opened
        assert all(r.matches_reference for r in session.records)
    # Generations are started until the deadline, so the run cannot end before it.
    assert run.finished >= run.deadline
    # Sessions of one point in several processes share one ramp: session 3 of 8 starts 3/8 in.
    counted = replace(spec, settings=LoadSettings(max_new_tokens=4, duration_s=None, generations=1, ramp_s=0.8))
    late = asyncio.run(run_sessions(counted, [(6, "none")], total=8))
    assert late.finished - late.started >= 0.6
    # Counted generations count whole: a window opening after the ramp left this one's tokens out.
    record = late.sessions[0].records[0]
    assert record.tokens_in_window == record.tokens == 4


def test_the_server_figures_cover_the_measured_window(tiny, running, references) -> None:
    """They came from the metrics at the point's start and end: its last generations, run on
    past the window with ever fewer sessions, lowered the batch sizes and pass rates given."""
    server, prompts = running[1].server, running[1].prompts
    settings = LoadSettings(max_new_tokens=MAX_NEW, window=8, duration_s=1.0, warmup_s=0.3)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings)
    workers = ClientWorkers(2, ())
    try:
        for by in (None, workers):  # this process's sessions, and worker processes'
            point = run_point(server, spec, ["sim", "none"], by)
            assert point["server"]["covers"] == "the measured window"
            assert point["server"]["passes_per_s"] == pytest.approx(point["server"]["passes"] / 1.0)  # over 1 s
    finally:
        workers.close()
    counted = run_point(server, replace(spec, settings=LoadSettings(max_new_tokens=4, duration_s=None,
                                                                    generations=1)), ["none"])
    assert counted["server"]["covers"] == "the whole point"


def test_load_generator_processes_start_a_points_sessions_at_one_moment(tiny, running, references) -> None:
    """Each process used to start its share as it received it: the windows were staggered, and
    the late processes' sessions ran their last seconds beside a server the others had left."""
    server, prompts = running[1].server, running[1].prompts
    settings = LoadSettings(max_new_tokens=4, duration_s=None, generations=1)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings)
    workers = ClientWorkers(2, ())
    try:
        runs = workers.run(spec, [(i, "none") for i in range(4)])
        # A worker that cannot build its share (onnx sessions without a draft) calls the point
        # off, named, in every worker, and the workers serve the next point.
        with pytest.raises(RuntimeError, match="process 1 could not build its sessions.*need a draft directory"):
            workers.run(spec, [(0, "none"), (1, "onnx")])
        again = workers.run(spec, [(i, "none") for i in range(2)])
    finally:
        workers.close()
    assert len(runs) == 2 and runs[0].started == runs[1].started
    assert [[(s.index, s.process) for s in run.sessions] for run in runs] == [[(0, 0), (2, 0)], [(1, 1), (3, 1)]]
    for run in (*runs, *again):
        assert all(not s.errors and s.records for s in run.sessions)
        assert all(s.records[0].started_at >= run.started for s in run.sessions)  # none began before the start


@given(st.floats(0, 100), st.lists(st.floats(0, 50), max_size=20), st.floats(0, 150), st.floats(0, 150))
def test_committed_between_counts_what_came_inside_the_window(started, times, opens, closes) -> None:
    inside = committed_between(started, times, opens, closes)
    assert inside == sum(opens <= started + t <= closes for t in times)
    assert committed_between(started, times, float("-inf"), None) == len(times)
    assert committed_between(started, times, opens, None) >= inside


def test_ramp_and_warm_up_are_checked() -> None:
    with pytest.raises(ValueError, match="must be 0 or more"):
        LoadSettings(ramp_s=-1)
    with pytest.raises(ValueError, match="must be 0 or more"):
        LoadSettings(warmup_s=float("nan"))  # every comparison with NaN fails
    with pytest.raises(ValueError, match="warm-up needs a duration"):
        LoadSettings(duration_s=None, generations=2, warmup_s=1)
    LoadSettings(duration_s=None, generations=2, ramp_s=1)  # a ramp serves counted generations too


def test_load_generator_processes_do_not_each_get_one_first_prompt() -> None:
    """Sessions are dealt round-robin: with 12 processes and 12 prompts, process p holds
    sessions p, p + 12, ...; their first prompts must differ, or a slow process and a slow
    prompt could not be told apart."""
    prompts = tuple((i,) for i in range(12))
    spec = LoadSpec(ServerEndpoint("localhost:1"), prompts, prompts, "", 10, LoadSettings(duration_s=None, generations=1))
    for proc in range(12):
        firsts = {_Session(spec, proc + 12 * j, "sim")._prompt(0) for j in range(12)}
        assert len(firsts) == 12, (proc, firsts)
    session = _Session(spec, 5, "sim")
    assert [session._prompt(n) for n in range(12)] == [(5 + n) % 12 for n in range(12)]  # it cycles through all


def test_simulated_edges_branch_beside_wrong_drafts_losslessly(tiny, running, references) -> None:
    server, prompts = running[1].server, running[1].prompts
    settings = LoadSettings(max_new_tokens=MAX_NEW, window=8, alpha=0.6, branch_coverage=1.0, seed=3,
                            duration_s=None, generations=3)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings, str(tiny.draft_dir))
    point = run_point(server, spec, ["sim"] * 4)
    assert point["errors"] == {"total": 0, "by_code": {}} and point["mismatched_outputs"] == 0
    sim = point["acceptance"]["sim"]
    assert sim["rejections"] > 0 and sim["branches_taken"] > 0, sim


def test_the_benchmark_prompts_are_sent_as_its_edges_send_them_and_served_losslessly(tiny, running) -> None:
    server = running[1].server
    prompts = load_prompts(tiny.target_dir, "benchmark")
    edge = EdgeTokenizer(tiny.draft_dir)
    texts = [p["text"] for p in benchmark_prompts()]
    assert len(prompts.ids) == len(texts) == 12
    assert prompts.ids == tuple(tuple(edge.encode(edge.chat_prompt(t))) for t in texts)
    assert prompts.fingerprint == load_prompts(tiny.target_dir).fingerprint  # the server accepts the edges
    references = reference_continuations(server.endpoint, prompts, MAX_NEW)
    settings = LoadSettings(max_new_tokens=MAX_NEW, window=8, alpha=0.7, seed=3, duration_s=None, generations=2)
    spec = LoadSpec(server.endpoint, prompts.ids, references, prompts.fingerprint, running[1].opened.vocab_size,
                    settings, str(tiny.draft_dir))
    point = run_point(server, spec, ["sim"] * 2 + ["onnx", "none"])
    assert point["errors"]["total"] == 0 and point["generations"] == 4 * 2
    assert point["mismatched_outputs"] == 0


def test_a_prompt_set_that_cannot_be_made_is_refused(tiny, tmp_path) -> None:
    with pytest.raises(ValueError, match="prompt set must be one of"):
        load_prompts(tiny.target_dir, "chat")
    shutil.copy(tiny.target_dir / "tokenizer.json", tmp_path / "tokenizer.json")  # no template beside it
    with pytest.raises(ValueError, match="chat template"):
        load_prompts(tmp_path, "benchmark")


def test_no_branches_means_none_from_a_drafter_that_offers_its_own(running, references) -> None:
    """--branches 0 turned off only the branches the edge drafts itself: a drafter that offers
    its own (the simulated edges) still sent them."""
    r = running[1]
    taken = {}
    for branches in (1, 0):
        results = [asyncio.run(generate(
            r.server.endpoint.address, ids,
            EdgeConfig(mode="async", max_new_tokens=MAX_NEW, window=8, branches=branches),
            drafter=SimulatedDrafter(len(ids), ref, r.opened.vocab_size, 0.6, random.Random(3), 1.0, random.Random(4)),
            fingerprint=r.prompts.fingerprint, connect=ConnectOptions(retries=0)))
            for ids, ref in zip(r.prompts.ids, references)]
        assert [tuple(res.tokens) for res in results] == list(references)
        taken[branches] = sum(res.stats.branches_taken + res.stats.branch_drafted for res in results)
    assert taken[1] > 0 and taken[0] == 0, taken


def test_simulated_drafter_offers_a_branch_only_beside_a_wrong_draft_once() -> None:
    reference = list(range(10, 60))
    drafter = SimulatedDrafter(3, reference, 100, 0.5, random.Random(1), 1.0, random.Random(2))
    for i in range(40):
        pick = drafter.choose(i)
        branch = drafter.branch_beside(3 + i, pick, 4)
        if pick == reference[i]:
            assert branch is None
        else:
            assert branch is not None and len(branch) == 4 and branch[0] == reference[i]
            assert drafter.branch_beside(3 + i, pick, 4) == ()  # decided once
    never = SimulatedDrafter(3, reference, 100, 0.0, random.Random(1))
    assert never.branch_beside(3, 99, 4) == () and never.branch_beside(3, reference[0], 4) is None
    # Branches do not move the line's own draws.
    picks = []
    for coverage in (0.0, 1.0):
        d = SimulatedDrafter(3, reference, 100, 0.7, random.Random(5), coverage, random.Random(6))
        drawn = []
        for i in range(30):
            drawn.append(d.choose(i))
            d.branch_beside(3 + i, drawn[-1], 4)
        picks.append(drawn)
    assert picks[0] == picks[1]


def test_simulated_drafter_proposes_right_token_at_alpha() -> None:
    reference = list(range(10, 60))
    drafter = SimulatedDrafter(3, reference, 100, 0.7, random.Random(0))
    picks = [drafter.choose(i % 50) for i in range(4000)]
    right = sum(p == reference[i % 50] for i, p in enumerate(picks))
    assert 0.65 < right / 4000 < 0.75
    assert all(0 <= p < 100 for p in picks)
    logits = PacedSimulatedDrafter(drafter, 0.001).next_logits([0, 1, 2, 5])  # position 1 of the continuation
    assert logits.shape == (100,) and logits.sum() == 1.0
    assert 0 <= drafter.choose(50) < 100  # past the continuation: any valid token


def test_sweep_report_has_the_required_fields(running, tmp_path) -> None:
    opts, r = running
    # SLO 0: met by any point without errors, so nothing here depends on speed.
    cfg = SweepConfig(modes=("none", "sim", "onnx"), sessions=(1, 2), slo=0.0, per_mode={"onnx": (2,)})
    settings = LoadSettings(max_new_tokens=12, window=8, duration_s=None, generations=1)
    report = sweep_and_report(r, opts, cfg, settings, log=lambda _: None)
    json_path, md_path = write_report(report, tmp_path, "t")
    got = json.loads(json_path.read_text())
    for key in ("machine", "pinning", "models", "network", "alpha", "slo", "settings", "results", "summary", "rerun"):
        assert key in got, key
    assert got["machine"]["cores"] >= 1 and got["models"]["target"]["config"]["vocab_size"] == 320
    summary = got["summary"]
    assert summary["errors"] == {"total": 0, "by_code": {}} and summary["mismatched_outputs"] == 0
    assert summary["baseline_sessions_at_slo"] == summary["split_sessions_at_slo"] == 2
    # Each met the SLO at its last point: the limit is that many or more, which the JSON says too.
    assert summary["baseline_limit"] == summary["split_limit"] == summary["onnx_limit"] == "beyond"
    for mode in ("none", "sim", "onnx"):
        point = got["results"][mode][-1]
        for key in ("session_tok_s", "server_tok_s", "ttft_ms", "itl_ms", "verdict_latency_ms", "errors", "server",
                    "client"):
            assert key in point, (mode, key)
        assert {"kv_peak_mb", "batch_sessions_mean", "passes_per_s", "mean_pass_ms"} <= set(point["server"])
        assert {"loop_lag_mean_ms", "loop_lag_p99_below_ms"} <= set(point["server"])
    # A point shorter than the lag's 50 ms tick has no figure; the sweep as a whole has some.
    lags = [p["server"]["loop_lag_p99_below_ms"] for points in got["results"].values() for p in points]
    assert any(lag is not None and lag >= 1 for lag in lags), lags
    assert [p["sessions"] for p in got["results"]["onnx"]] == [2]  # its own counts
    assert got["settings"]["sessions"] == {"none": [1, 2], "sim": [1, 2], "onnx": [2]}
    assert "| N | session tok/s min | p50 | server tok/s | TTFT p50 / p90 ms (to Opened) |" in md_path.read_text()
    for mode in ("none", "sim", "onnx"):  # the wait for Opened is part of the wait for the first token
        point = got["results"][mode][-1]
        assert 0 < point["opened_ms"]["p50"] <= point["ttft_ms"]["p50"], (mode, point["opened_ms"])  # each below its own
        assert point["opened_ms"]["count"] == point["ttft_ms"]["count"] == point["generations"]
    assert got["prompt_set"] == "stubs" and "6 prompts cycled (short plain-text openings)" in md_path.read_text()
    assert "all sessions start at once" in md_path.read_text() and got["settings"]["ramp_s"] == 0.0
    short = capacity(got)  # the form bench/results/capacity-gpu.json takes
    for key in ("device", "target_config", "alpha", "slo_tokens_per_s", "baseline_sessions_at_slo",
                "split_sessions_at_slo", "errors"):
        assert key in short, key
    assert short["split_sessions_at_slo"] == 2 and short["errors"]["total"] == 0


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_config_target_has_the_published_shape_and_no_eos(tiny, tmp_path, arch) -> None:
    out = write_config_target(tmp_path / arch, arch)
    config = AutoConfig.from_pretrained(str(out))
    assert config.eos_token_id is None and config.num_hidden_layers == 28  # generations run to max_new_tokens
    assert describe_target(out)["vocab_size"] == ARCHS[arch]["vocab_size"]
    # The tiny ONNX draft's tokenizer: real edges can be pointed at such a target.
    assert load_prompts(out).fingerprint == EdgeTokenizer(tiny.draft_dir).fingerprint


def _generation(tokens: int, elapsed_s: float, in_window: int) -> GenerationRecord:
    return GenerationRecord(tokens, elapsed_s, in_window, True, 0.1, [], [], [], Acceptance(), 0, 0)


def test_session_speed_counts_only_what_ran_under_the_points_load() -> None:
    """Past the deadline the last generations run with ever fewer sessions beside them: a
    session whose last generation ran mostly then must not look faster for it."""
    steady = SessionLog(0, "sim", [_generation(100, 5.0, 100), _generation(100, 5.0, 100)], window_s=10.0)
    late = SessionLog(1, "sim", [_generation(100, 5.0, 100), _generation(100, 2.0, 30)], window_s=10.0)
    started_late = SessionLog(2, "sim", [_generation(100, 4.0, 100), _generation(100, 4.0, 100)], window_s=8.0)
    assert session_speeds([steady, late, started_late]) == [20.0, 13.0, 25.0]
    assert late.tokens_per_s > steady.tokens_per_s  # what the whole generations would have said
    steady.window_s = late.window_s = None  # a set number of generations, no deadline
    assert session_speeds([steady, late]) == [steady.tokens_per_s, late.tokens_per_s]


def test_server_speed_is_over_the_set_window_though_processes_start_apart() -> None:
    """Each load-generator process measures its own window of --duration; merged, the span
    from the first opening to the last end is longer, and no rate."""
    settings = LoadSettings(duration_s=10.0)
    spec = LoadSpec(ServerEndpoint("localhost:1"), ((1,),), ((2,),), "", 10, settings)
    sessions = [SessionLog(i, "none", [_generation(100, 5.0, 100), _generation(100, 5.0, 100)], window_s=10.0)
                for i in range(3)]
    # Two processes' runs merged: the second began 4 s after the first.
    run = LoadRun(sessions, started=0.0, deadline=14.0, finished=17.0, cpu_s=1.0)
    point = summarize(run, spec, {}, {}, 0.0, 0.0, client_procs=2)
    assert point["server_tok_s"] == pytest.approx(3 * 200 / 10.0)
    assert point["session_tok_s"]["min"] == point["session_tok_s"]["p50"] == pytest.approx(20.0)


def test_sessions_are_also_summed_up_by_the_load_generator_process_that_ran_them() -> None:
    """Even sessions ran in the first of two processes. There they generated the whole window at 20 tokens/s; in the second, at 20 tokens/s while
    generating but for only half the window (waiting between generations)."""
    def generations(tokens: int, elapsed_s: float, second_at: float) -> list[GenerationRecord]:
        return [_generation(tokens, elapsed_s, tokens),
                replace(_generation(tokens, elapsed_s, tokens), started_at=second_at)]

    sessions = [SessionLog(i, "none", generations(100, 5.0, 5.0) if i % 2 == 0 else generations(50, 2.5, 7.5),
                           window_s=10.0, process=i % 2) for i in range(4)]
    first, second = by_process(sessions, 2)
    assert (first["sessions"], second["sessions"]) == (2, 2)
    assert (first["tok_s_mean"], second["tok_s_mean"]) == (pytest.approx(20.0), pytest.approx(10.0))
    assert (first["generating_share"], second["generating_share"]) == (pytest.approx(1.0), pytest.approx(0.5))
    assert first["ttft_ms"]["count"] == 4 and first["ttft_ms"]["p50"] == pytest.approx(100.0)
    # Processes without a session are left out, not counted at 0 tokens/s.
    moved = [replace(s, process=3 * s.process) for s in sessions]
    assert [(p["process"], p["sessions"]) for p in by_process(moved, 6)] == [(0, 2), (3, 2)]


@pytest.mark.parametrize("adaptive", [True, False])
def test_load_test_edges_adapt_their_lookahead_unless_told_not_to(adaptive) -> None:
    settings = LoadSettings(window=12, adaptive_window=adaptive, duration_s=None, generations=1)
    spec = LoadSpec(ServerEndpoint("localhost:1"), ((1, 2),), ((3,),), "", 10, settings)
    assert _Session(spec, 0, "sim").cfg.adaptive_window is adaptive
    assert _window({"window": 12, "adaptive_window": adaptive}) == ("adaptive, at most 12" if adaptive else "12, fixed")


def test_paced_simulated_edges_weigh_no_branches() -> None:
    """Their one-hot logits never offer a runner-up worth a branch, and weighing one over the
    vocabulary at every draft loaded the load generator; unpaced ones branch as edges do."""
    def branches(delay_ms: float, kind: str = "sim") -> int:
        settings = LoadSettings(draft_delay_ms=delay_ms, duration_s=None, generations=1)
        return _Session(LoadSpec(ServerEndpoint("localhost:1"), ((1, 2),), ((3,),), "", 10, settings), 0, kind).cfg.branches

    assert branches(5.0) == 0
    assert branches(0.0) == branches(5.0, "none") == EdgeConfig().branches > 0


def test_a_repeated_point_meets_the_slo_only_if_every_run_does() -> None:
    def run(slowest: float, errors: dict[str, int]) -> dict:
        return {"session_tok_s": {"min": slowest, "p50": slowest + 3}, "server_tok_s": 100 * slowest,
                "errors": {"total": sum(errors.values()), "by_code": errors}, "sessions_without_output": 0,
                "mismatched_outputs": 0}

    point = repeated_point([run(22.0, {}), run(19.0, {}), run(21.0, {})], slo=20.0)
    assert not point["meets_slo"] and point["session_tok_s"]["min"] == 19.0  # the slowest run's figures
    assert [r["meets_slo"] for r in point["runs"]] == [True, False, True]
    assert repeated_point([run(22.0, {}), run(21.0, {})], slo=20.0)["meets_slo"]
    failed = repeated_point([run(30.0, {"UNAVAILABLE": 1}), run(25.0, {}), run(26.0, {"INTERNAL": 2})], slo=20.0)
    assert not failed["meets_slo"] and failed["session_tok_s"]["min"] == 26.0  # the slowest of the failing runs
    assert failed["errors"] == {"total": 3, "by_code": {"UNAVAILABLE": 1, "INTERNAL": 2}}


def _wait_serving(address: str, tls: list[str], deadline_s: float = 60.0) -> None:
    deadline = time.monotonic() + deadline_s
    while server_cli.main(["health", "--address", address, "--timeout", "2", *tls]) != 0:
        assert time.monotonic() < deadline, "the TLS server did not come up"
        time.sleep(0.5)


class _NotSpecsplit(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"# TYPE other_total counter\nother_total 1\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_server_already_running_is_loaded_over_its_mutual_tls_with_its_token(tiny, tmp_path, monkeypatch,
                                                                                 capsys) -> None:
    """A site's own server (TLS with client certificates, bearer tokens, metrics on their own
    port): nothing is started, the worker processes build their own credentials, and the
    report names neither the files nor the token. Lost in the middle of a sweep, the server
    costs the points not yet run, not the report."""
    pki = make_pki(tmp_path)
    token = "0123456789abcdef0123"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"load-test {token}\n")
    metrics = free_port()
    ca, cert, key = (str(pki["ca"].with_suffix(".crt")), str(pki["client"].with_suffix(".crt")),
                     str(pki["client"].with_suffix(".key")))
    tls = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotSpecsplit)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--tls-cert", str(pki["server"].with_suffix(".crt")),
                       "--tls-key", str(pki["server"].with_suffix(".key")), "--tls-client-ca", ca,
                       "--tokens-file", str(tokens), "--metrics-port", str(metrics), healthy=False) as (address, proc):
        _wait_serving(address, tls)
        reach = ["--server", address, *tls, "--draft", str(tiny.draft_dir), "--slo", "0", "--max-new-tokens", "8",
                 "--window", "8", "--out-dir", str(tmp_path / "out")]
        run = [*reach, "--modes", "none,sim,onnx", "--sessions", "2", "--generations", "1", "--client-procs", "2"]
        with pytest.raises(SystemExit) as usage:  # checked before anything is sent
            loadtest_run.main([*run, "--tls-ca", str(tokens), "--name", "x"])
        assert usage.value.code == 2 and f"--tls-ca {tokens} holds no PEM certificate" in capsys.readouterr().err
        for url, said in ((f"http://{address}/metrics", "cannot be read"),  # the gRPC port
                          (f"http://127.0.0.1:{other.server_port}/metrics", "has no specsplit metrics")):
            assert loadtest_run.main([*run, "--metrics-url", url, "--name", "x"]) == 1
            assert said in capsys.readouterr().err
        monkeypatch.setenv("SPECSPLIT_TOKEN", "not-a-registered-token")
        assert loadtest_run.main([*run, "--name", "refused"]) == 1
        assert "failed the warm-up generation: PERMISSION_DENIED" in capsys.readouterr().err
        monkeypatch.delenv("SPECSPLIT_TOKEN")
        assert loadtest_run.main([*run, "--name", "unread"]) == 1  # no token: refused at the warm-up
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("SPECSPLIT_TOKEN", token)
        metrics_url = ["--metrics-url", f"http://127.0.0.1:{metrics}/metrics"]
        assert loadtest_run.main([*run, *metrics_url, "--name", "ext"]) == 0

        def kill_in_first_point(message: str) -> None:  # the server lost while the first point runs
            if message.startswith("[1/"):
                threading.Timer(1.0, proc.kill).start()
        monkeypatch.setattr(loadtest_run, "log", kill_in_first_point)
        monkeypatch.setattr(point_module, "LOST_AFTER_S", 1.0)  # how long a lost server is tried
        lost = [*reach, *metrics_url, "--modes", "none,sim", "--sessions", "1,2", "--duration", "3"]
        assert loadtest_run.main([*lost, "--name", "lost"]) == 1
    text = (tmp_path / "out" / "ext.json").read_text()
    got = json.loads(text)
    assert got["summary"]["errors"]["total"] == 0 and got["summary"]["mismatched_outputs"] == 0
    assert got["summary"]["baseline_sessions_at_slo"] == got["summary"]["split_sessions_at_slo"] == 2
    assert got["models"]["target"] == {"name": tiny.target_dir.name, "vocab_size": 320}  # never its path
    assert got["models"]["draft"]["vocab_size"] == 320 and got["stopped"] is None
    for mode in ("none", "sim", "onnx"):
        point = got["results"][mode][-1]
        assert point["generations"] == 2 and point["server"]["passes"] > 0, mode  # the metrics were read
        assert point["server"]["metrics"] == "read" and point["server"]["kv_peak_mb"] is not None, mode
        assert point["server"]["rss_peak_mb"] is None, mode  # another machine's process, for all we know
        assert {p["process"] for p in point["by_process"]} == {0, 1}, mode
    assert got["server"] == {"connection": f"{address}, mutual TLS, bearer token", "metrics": "read"}
    md = (tmp_path / "out" / "ext.md").read_text()
    assert f"- server: already running, at {address}, mutual TLS, bearer token; no RSS figures" in md
    assert "server not started by the load test" in md and "- load generator: " in md
    for secret in (token, str(tmp_path)):
        assert secret not in text and secret not in md
    assert "--metrics-url METRICS_URL" in got["rerun"]  # a URL may carry a secret
    assert capacity(got)["device"] is None  # the machine described is the load generator's
    # The lost server: the point it died in has errors, the next finished nothing and ended the sweep.
    lost_report = json.loads((tmp_path / "out" / "lost.json").read_text())
    first, = lost_report["results"]["none"]
    assert first["errors"]["total"] > 0 and not first["meets_slo"]
    assert "read(s) failed" in first["server"]["metrics"]
    # The sweep stopped there, and the point is no measure of capacity (before, it read as
    # the baseline's limit, "fewer than 1", and the next mode's point ran against nothing).
    assert first["server_lost"] == "took no connection for 1 s" and "sim" not in lost_report["results"]
    assert lost_report["stopped"].startswith("the server took no connection for 1 s during none with 1 session(s)")
    assert capacity(lost_report)["stopped"] and capacity(lost_report)["baseline_limit"] == "unknown"
    md = (tmp_path / "out" / "lost.md").read_text()
    assert "**Stopped early:** the server took no connection for 1 s during none" in md
    assert "| unknown (the server took no connection for 1 s during the first point, of 1 session) |" in md
    other.shutdown()


def test_a_loop_lag_past_the_last_bucket_is_written_as_json_can_read_it() -> None:
    """A p99 in the +Inf bucket was written as its bound: Infinity, which is not JSON."""
    name = "specsplit_event_loop_lag_seconds"

    def snap(count: float, per_bucket: dict[str, float]) -> dict:
        out, seen = {(f"{name}_count", ()): count, (f"{name}_sum", ()): count * 6.0}, 0.0
        for le, n in per_bucket.items():
            seen += n
            out[(f"{name}_bucket", (("le", le),))] = seen
        return out
    before = snap(0, {"0.05": 0, "5.0": 0, "+Inf": 0})
    late = server_figures(before, snap(100, {"0.05": 0, "5.0": 0, "+Inf": 100}), 1.0, None, None)
    json.dumps(late, allow_nan=False)
    assert (late["loop_lag_p99_below_ms"], late["loop_lag_p99_above_ms"]) == (None, 5000.0)
    assert _lag(late) == "6000.0 / > 5000"
    prompt = server_figures(before, snap(100, {"0.05": 99, "5.0": 1, "+Inf": 0}), 1.0, None, None)
    assert (prompt["loop_lag_p99_below_ms"], prompt["loop_lag_p99_above_ms"]) == (50.0, None)
    assert _lag(prompt) == "6000.0 / ≤ 50"


def test_a_sweep_that_fails_reports_the_points_that_finished(running, monkeypatch) -> None:
    """A load generator that fails partway (a worker process gone, say) lost every point
    finished before, hours of them on a GPU sweep."""
    opts, r = running
    real, calls = sweep_module.run_point, []

    def failing_second(*args: object) -> dict:
        calls.append(args)
        if len(calls) == 2:
            raise RuntimeError("load generator worker 3 exited")
        return real(*args)
    monkeypatch.setattr(sweep_module, "run_point", failing_second)
    cfg = SweepConfig(modes=("none", "sim"), sessions=(1, 2), slo=0.0)
    report = sweep_and_report(r, opts, cfg, LoadSettings(max_new_tokens=4, duration_s=None, generations=1),
                              log=lambda _: None)
    assert "none with 2 session(s) failed (RuntimeError: load generator worker 3 exited)" in report["stopped"]
    assert [p["sessions"] for p in report["results"]["none"]] == [1]


def test_a_server_that_dies_during_a_point_stops_the_sweep_and_is_no_capacity_limit(tiny, tmp_path,
                                                                                     monkeypatch) -> None:
    """Before, a point whose server died partway was taken for the mode's limit: its errors
    missed the SLO, and a first point's read "fewer than N" as if capacity had been measured."""
    opts = RunOptions(target=tiny.target_dir, draft=tiny.draft_dir, dtype="fp32", server_log=tmp_path / "server.log",
                      rerun="python bench/loadtest/run.py")
    real, calls = sweep_module.run_point, []

    def dying_second(server, *args: object) -> dict:
        calls.append(args)
        if len(calls) == 2:  # the server is killed while the point's sessions run
            threading.Timer(0.7, os.kill, (server.pid, signal.SIGKILL)).start()
        return real(server, *args)
    monkeypatch.setattr(sweep_module, "run_point", dying_second)
    cfg = SweepConfig(modes=("none", "sim"), sessions=(1, 2), slo=0.0)
    with started(opts, cfg, log=lambda _: None) as r:
        report = sweep_and_report(r, opts, cfg, LoadSettings(max_new_tokens=4, duration_s=2.0), log=lambda _: None)
    assert report["stopped"].startswith("the server exited during none with 2 session(s)")
    points = report["results"]["none"]
    assert [p["sessions"] for p in points] == [1, 2] and points[1]["server_lost"] == "exited"
    assert "sim" not in report["results"]
    assert limit_text(report, "none") == "1 or more (the most tried before the sweep stopped)"
    assert "| no measure (the server exited) |" in render_markdown(report, "x")


def test_a_server_elsewhere_is_lost_when_it_takes_no_connection(server, monkeypatch) -> None:
    monkeypatch.setattr(point_module, "LOST_AFTER_S", 0.5)
    assert ServerHandle(ServerEndpoint(server), None, None).lost() is None
    assert ServerHandle(ServerEndpoint(f"127.0.0.1:{free_port()}"), None, None).lost() == "took no connection for 0.5 s"
    first = {"sessions": 4, "meets_slo": False, "generations": 3, "server_lost": "exited"}
    assert slo_limit([first]) == "unknown"
    assert limit_text(_report([first], [first]), "none") == "unknown (the server exited during the first point, of 4 sessions)"


def test_a_generation_failure_is_counted_by_its_status_and_a_load_generator_fault_raised(monkeypatch) -> None:
    from loadtest import sessions as sessions_module

    spec = LoadSpec(ServerEndpoint("localhost:1"), ((1, 2),), ((3,),), "", 10,
                    LoadSettings(duration_s=None, generations=1))
    for failure, counted in ((StreamStalled("no message for 60 s"), {"UNAVAILABLE": 1}),
                             (StreamEnded("ended before Done"), {"StreamEnded": 1})):
        async def fail(*args: object, failure: Exception = failure, **kwargs: object) -> None:
            raise failure
        monkeypatch.setattr(sessions_module, "generate", fail)
        session = _Session(spec, 0, "none")
        asyncio.run(session.run(time.monotonic(), time.monotonic(), None))
        assert dict(session.log.errors) == counted

    async def broken(*args: object, **kwargs: object) -> None:
        raise IndexError("the load generator's own bug")
    monkeypatch.setattr(sessions_module, "generate", broken)
    with pytest.raises(IndexError):
        asyncio.run(_Session(spec, 0, "none").run(time.monotonic(), time.monotonic(), None))


def _points(*met: bool | None, first: int = 4, saturated: bool = False) -> list[dict]:
    """Points of doubling session counts: True met the SLO, False missed it, None served nothing;
    `saturated`: the load generator's cores were, at every point."""
    return [{"sessions": first * 2**i, "meets_slo": bool(m), "generations": 0 if m is None else 10,
             "client": {"saturated": saturated}} for i, m in enumerate(met)]


def _report(none: list[dict], sim: list[dict], stopped: str | None = None) -> dict:
    return {"summary": {"baseline_sessions_at_slo": sessions_at_slo(none), "split_sessions_at_slo": sessions_at_slo(sim),
                        "errors": {"total": 0, "by_code": {}}, "mismatched_outputs": 0},
            "machine": {"cpu": "c"}, "models": {"target": {"name": "t"}}, "alpha": 0.85, "slo": 20.0,
            "results": {"none": none, "sim": sim}, "rerun": "r", "stopped": stopped}


def test_a_limit_the_sweep_did_not_find_is_said_so_and_the_ratio_is_a_bound_or_unknown() -> None:
    def limit(points: list[dict]) -> tuple[str, str]:
        return slo_limit(points), limit_text(_report(points, points), "none")

    assert limit(_points(True, False)) == ("found", "4")
    assert limit(_points(False)) == ("below", "fewer than 4 (the fewest tried missed it)")
    assert limit(_points(True, True)) == ("beyond", "8 or more (the most tried)")
    # A point that served nothing (the server gone) ends the sweep but is no miss.
    assert limit(_points(True, None)) == ("beyond", "4 or more (the most tried)")
    assert limit(_points(None))[0] == "unknown"
    # "Stopped" is said of the mode whose sweep stopped, not of one that ran to its end; reports
    # from before "stopped_in" take the last mode swept.
    stopped = _report(_points(True, True), _points(True, True), stopped="interrupted")
    assert (limit_text(stopped, "none"), limit_text(stopped, "sim")) == (
        "8 or more (the most tried)", "8 or more (the most tried before the sweep stopped)")
    # A sweep stopped at sim's first point: none ran to its end (before, its last point read as
    # the most tried before the stop, since sim had no point to take the blame).
    at_first = {**_report(_points(True, True), [], stopped="sim with 4 session(s) failed"), "stopped_in": "sim"}
    del at_first["results"]["sim"]
    assert limit_text(at_first, "none") == "8 or more (the most tried)"
    found = capacity(_report(_points(True, False), _points(True, True, False)))
    assert (found["ratio"], found["ratio_kind"]) == (2.0, "exact")
    beyond = capacity(_report(_points(True, False), _points(True, True, True)))
    assert (beyond["ratio"], beyond["ratio_kind"], beyond["split_limit"]) == (4.0, "at least", "beyond")
    assert "| ratio | at least 4.00x |" in capacity_render(beyond, "x.json")
    assert capacity(_report(_points(True, True), _points(True, False)))["ratio_kind"] == "at most"
    both_beyond = capacity(_report(_points(True, True), _points(True, True)))
    assert both_beyond["ratio"] is None and "n/a (a limit the sweep did not find)" in capacity_render(both_beyond, "x")
    below = capacity(_report(_points(False), _points(True, False)))
    assert below["ratio"] is None and "fewer than 4" in capacity_render(below, "x")
    # A miss where the load generator ran out of cores was taken for the server's limit.
    assert limit(_points(True, False, saturated=True)) == (
        "client-bound", "4 or more (the next point missed the SLO with the load generator saturated: it, not the "
        "server, may have been the limit; more --client-procs on more --client-cores would tell)")
    bound = capacity(_report(_points(True, False), _points(True, True, False, saturated=True)))
    assert (bound["ratio"], bound["ratio_kind"], bound["split_limit"]) == (2.0, "at least", "client-bound")


@pytest.mark.parametrize("args", [["--duration", "nan"], ["--duration", "inf"], ["--slo", "nan"], ["--ramp", "nan"],
                                  ["--warmup", "inf"], ["--draft-delay-ms", "nan"], ["--alpha", "1.5"],
                                  ["--max-new-tokens", "0"]])
def test_a_number_no_run_could_use_is_refused_while_parsing(args, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        loadtest_run.build_parser().parse_args(args)
    assert exited.value.code == 2 and args[0] in capsys.readouterr().err


def test_an_interrupted_sweep_reports_the_points_that_finished(running, monkeypatch) -> None:
    opts, r = running
    real, calls = sweep_module.run_point, []

    def interrupted_third(*args: object) -> dict:
        calls.append(args)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(sweep_module, "run_point", interrupted_third)
    cfg = SweepConfig(modes=("none", "sim"), sessions=(1, 2), slo=0.0)
    report = sweep_and_report(r, opts, cfg, LoadSettings(max_new_tokens=4, duration_s=None, generations=1),
                              log=lambda _: None)
    assert report["stopped"] == INTERRUPTED and [p["sessions"] for p in report["results"]["none"]] == [1, 2]
    assert "sim" not in report["results"] and report["summary"]["split_sessions_at_slo"] is None
    # Cut short in sim, before any point of it: not in none, the last mode with points.
    assert report["stopped_in"] == "sim"


def test_a_sigterm_mid_sweep_reports_the_points_that_finished(running, monkeypatch) -> None:
    """A job's timeout or `kill` (SIGTERM, raised as SystemExit while the load test runs its
    server) escaped the sweep, and every point finished was lost with it."""
    opts, r = running
    real, calls = sweep_module.run_point, []

    def terminated_second(*args: object) -> dict:
        calls.append(args)
        if len(calls) == 2:
            raise SystemExit(128 + signal.SIGTERM)
        return real(*args)
    monkeypatch.setattr(sweep_module, "run_point", terminated_second)
    cfg = SweepConfig(modes=("none",), sessions=(1, 2), slo=0.0)
    report = sweep_and_report(r, opts, cfg, LoadSettings(max_new_tokens=4, duration_s=None, generations=1),
                              log=lambda _: None)
    assert report["stopped"] == INTERRUPTED and [p["sessions"] for p in report["results"]["none"]] == [1]


def _run_against(server: str, tiny, out: Path, *extra: str) -> int:
    return loadtest_run.main(["--server", server, "--draft", str(tiny.draft_dir), "--modes", "none", "--sessions", "1",
                              "--generations", "1", "--max-new-tokens", "4", "--slo", "0", "--out-dir", str(out),
                              "--name", "t", *extra])


def test_the_report_is_written_before_the_server_stops(tiny, server, tmp_path, monkeypatch) -> None:
    """Written once the server had stopped (its drain takes seconds): a second Ctrl-C then, or
    a SIGTERM, lost every point, and the run said none had finished."""
    from contextlib import contextmanager

    from loadtest import harness

    real = harness.started

    @contextmanager
    def stopped_by_a_second_ctrl_c(*args, **kwargs):  # type: ignore[no-untyped-def]
        with real(*args, **kwargs) as running:
            yield running
        raise KeyboardInterrupt  # as the server stops

    monkeypatch.setattr(harness, "started", stopped_by_a_second_ctrl_c)
    assert _run_against(server, tiny, tmp_path) == 130
    assert [p["sessions"] for p in json.loads((tmp_path / "t.json").read_text())["results"]["none"]] == [1]


def test_a_run_interrupted_before_any_point_finished_leaves_an_earlier_report_as_it_was(
        tiny, server, tmp_path, monkeypatch) -> None:
    """It was replaced by a report of no points."""
    for name in ("t.json", "t.md"):
        (tmp_path / name).write_text("an earlier run's")

    def interrupted(*args: object) -> dict:
        raise KeyboardInterrupt
    monkeypatch.setattr(sweep_module, "run_point", interrupted)
    assert _run_against(server, tiny, tmp_path) == 130
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == dict.fromkeys(("t.json", "t.md"), "an earlier run's")


def test_options_are_not_taken_abbreviated(capsys) -> None:
    """The rerun line hides the values of the options it names (a metrics URL may carry a
    token); an abbreviation of one went into the report as given."""
    with pytest.raises(SystemExit) as refused:
        loadtest_run.build_parser().parse_args(["--metrics", "http://h/metrics?token=SECRET"])
    assert refused.value.code == 2 and "unrecognized arguments: --metrics" in capsys.readouterr().err


def test_an_out_dir_that_cannot_be_written_is_refused_while_parsing(tmp_path, monkeypatch, capsys) -> None:
    """Found only when the report was written, at the end of the sweep."""
    closed = tmp_path / "closed"
    closed.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == closed else real(path, mode))
    with pytest.raises(SystemExit):
        loadtest_run.build_parser().parse_args(["--out-dir", str(closed / "results")])
    assert f"{closed}/results cannot be written: {closed} is not writable here" in capsys.readouterr().err


LIGHT_LOAD_GENERATOR = """
import importlib.abc, runpy, sys
HEAVY = ('torch', 'transformers', 'psutil', 'prometheus_client', 'grpc_health')
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in HEAVY:
            raise ImportError(f'{name} is not installed on this load generator')
sys.meta_path.insert(0, Block())
sys.argv = ['bench/loadtest/run.py', *sys.argv[1:]]
runpy.run_path('bench/loadtest/run.py', run_name='__main__')
"""


def test_a_load_generator_for_a_running_server_needs_only_the_edge_packages(tiny, server, tmp_path) -> None:
    """A site's load generator is another machine, often a small one: with --server it imports
    neither torch nor transformers (nor the server's metrics and health libraries, without
    --metrics-url), and real ONNX edges run on it as on a device."""
    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_LOAD_GENERATOR, "--server", server, "--draft", str(tiny.draft_dir),
         "--modes", "none,sim,onnx", "--sessions", "1", "--generations", "1", "--max-new-tokens", "8", "--slo", "0",
         "--out-dir", str(tmp_path), "--name", "light"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "light.json").read_text())
    assert report["summary"]["errors"]["total"] == 0 and report["summary"]["mismatched_outputs"] == 0
    assert [len(report["results"][m]) for m in ("none", "sim", "onnx")] == [1, 1, 1]


def test_latencies_and_acceptance_are_sampled_within_the_measured_window() -> None:
    """Tokens were counted in the window, their latencies over whole generations: the drain
    after the deadline (a third of a point's tokens, with ever fewer sessions beside them)
    and a warm-up's burst made the percentiles and alpha of another load."""
    from specsplit.edge.client import GenerationResult
    from specsplit.edge.stats import GenerationStats
    from loadtest.sessions import _record

    times = [0.5, 1.2, 1.5, 2.5, 3.5]  # seconds after the generation's start, 100; the window is 101 to 103
    timeline = [("verdict", t, i, 1, accepted, 1.0, 2, int(accepted < 2))
                for i, (t, accepted) in enumerate(zip(times, [2, 2, 1, 0, 2]))]
    result = GenerationResult([1] * 5, GenerationStats(mode="async", ttft_s=0.5, opened_s=0.3), None, times, timeline)
    record = _record(result, (1,) * 5, started=100.0, opens=101.0, deadline=103.0)
    assert record.itl_ms == pytest.approx([700.0, 300.0, 1000.0])  # the gaps that end at 1.2, 1.5 and 2.5
    assert record.verdict_interval_ms == pytest.approx([700.0, 300.0, 1000.0])
    assert (record.acceptance.accepted, record.acceptance.proposed, record.acceptance.rejections) == (3, 6, 2)
    assert record.ttft_s is None and record.opened_s is None  # before the window opened
    assert record.tokens_in_window == 3


def test_a_chunk_a_rejection_cut_off_has_no_verdict_latency() -> None:
    """Chunk A (positions 10 to 13) and chunk B (14 to 17) go out; A's verdict commits 10 and a
    correction at 11, so the server drops B; chunk C, drafted again from 12, is verified with
    position 14. B got no verdict: before, it was counted as waiting 190 ms for C's."""
    from loadtest.timeline import verdict_latency_ms

    timeline = [("send", 0.0, 10, 4), ("send", 0.01, 14, 4),
                ("verdict", 0.10, 10, 2, 1, 5.0, 4, 1), ("send", 0.10, 12, 4),
                ("verdict", 0.20, 12, 4, 4, 5.0, 4, 0)]
    assert verdict_latency_ms(timeline) == pytest.approx([100.0, 100.0])
    # Without the rejection (the verdict accepted 10 and 11), B is waiting for the verdict on 14.
    accepted = [("send", 0.0, 10, 4), ("send", 0.01, 14, 4),
                ("verdict", 0.10, 10, 4, 4, 5.0, 4, 0), ("verdict", 0.20, 14, 4, 4, 5.0, 4, 0)]
    assert verdict_latency_ms(accepted) == pytest.approx([100.0, 190.0])


def test_a_histogram_bucket_whose_bound_is_no_number_is_left_out() -> None:
    """One odd line (another exporter behind the URL, a proxy) raised ValueError in the point's
    summary, outside the reads that tolerate unreadable metrics: the sweep stopped, the point lost."""
    from loadtest.scrape import histogram_delta

    def snap(count: float) -> dict:
        return {("h_count", ()): count, ("h_sum", ()): count * 2, ("h_bucket", (("le", "1.0"),)): count,
                ("h_bucket", (("le", "abc"),)): count, ("h_bucket", (("le", "+Inf"),)): count,
                ("h_bucket", (("other", "x"),)): count}

    assert histogram_delta(snap(1), snap(5), "h") == {"count": 4, "sum": 8, "mean": 2.0,
                                                      "buckets": {"1.0": 4, "+Inf": 0}}
