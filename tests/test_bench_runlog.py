"""A stopped benchmark sweep keeps what it measured and resumes with only the missing runs."""
from __future__ import annotations

import json

import pytest

from report import render_markdown, summarize
from runlog import RunLog, SettingsMismatch

HEADER = {
    "name": "t",
    "machine": {"cpu": "test cpu", "cores": 2, "machine": "x86_64", "python": "3", "native_bf16": False},
    "pinning": "server on core 1; edge on core 0",
    "models": {"target": "t", "target_dtype": "fp32", "draft": "d", "draft_quantization": "int8"},
    "network": {"rtt_ms": [50], "rate_mbit": None, "how": "proxy"},
    "settings": {"max_new_tokens": 4, "window": 16, "sync_k": [8], "temperature": 0, "server_args": "",
                 "prompts": ["a", "b"], "hf_assisted": False},
}


def _run(mode: str, prompt: str, tps: float, ids: list[int]) -> dict:
    return {"mode": mode, "rtt_ms": 50, "prompt": prompt, "tokens": len(ids), "tokens_per_s": tps,
            "elapsed_s": len(ids) / tps, "token_ids": ids}


def _log(path, resume: bool, header: dict = HEADER) -> RunLog:
    return RunLog(path, header, render_markdown, summarize, resume)


def test_a_stopped_sweep_resumes_with_only_the_missing_runs(tmp_path):
    path = tmp_path / "t.json"
    keys = [(m, 50, p) for p in ("a", "b") for m in ("none", "sync-8", "async")]
    first = _log(path, resume=False)
    assert first.missing(keys) == keys
    first.add(_run("none", "a", 1.0, [1, 2, 3, 4]))
    first.add(_run("sync-8", "a", 2.0, [1, 2, 3, 4]))
    # The process stops here: the saved result is whole, marked incomplete, with a report beside it.
    partial = tmp_path / "t.partial.json"
    saved = json.loads(partial.read_text())
    assert saved["complete"] is False and len(saved["runs"]) == 2
    assert "| 50 | sync-8 | 1 | 2.00 | 2.00x" in partial.with_suffix(".md").read_text()

    second = _log(path, resume=True)
    assert second.missing(keys) == keys[2:]
    second.add(_run("async", "a", 3.0, [1, 2, 3, 5]))
    second.save(complete=True)
    final = json.loads(path.read_text())
    assert final["complete"] is True and len(final["invocations"]) == 2
    assert not partial.exists() and not partial.with_suffix(".md").exists()
    by_mode = {s["mode"]: s for s in final["summary"]}
    assert by_mode["async"]["speedup_vs_none"] == pytest.approx(3.0)
    assert by_mode["async"]["identical"] is False  # compared with the first invocation's `none`


def test_an_earlier_result_stays_whole_until_the_new_sweep_is_complete(tmp_path):
    """`make bench-quick` again, stopped after its first run, replaced the committed result
    with that one run, marked incomplete."""
    path = tmp_path / "t.json"
    earlier = _log(path, resume=False)
    earlier.add(_run("none", "a", 1.0, [1]))
    earlier.save(complete=True)
    kept = path.read_text(), path.with_suffix(".md").read_text()
    again = _log(path, resume=False)
    again.add(_run("none", "a", 2.0, [1]))  # ... and it stops here
    assert (path.read_text(), path.with_suffix(".md").read_text()) == kept
    again.save(complete=True)
    assert json.loads(path.read_text())["runs"][0]["tokens_per_s"] == 2.0


def test_without_resume_the_earlier_runs_are_dropped(tmp_path):
    path = tmp_path / "t.json"
    _log(path, resume=False).add(_run("none", "a", 1.0, [1]))
    assert _log(path, resume=False).missing([("none", 50, "a")]) == [("none", 50, "a")]


def test_a_run_measured_again_replaces_the_earlier_one(tmp_path):
    log = _log(tmp_path / "t.json", resume=False)
    log.add(_run("none", "a", 1.0, [1]))
    log.add(_run("none", "a", 2.0, [1]))
    assert [r["tokens_per_s"] for r in log.result["runs"]] == [2.0]


def test_resume_under_other_settings_is_refused(tmp_path):
    path = tmp_path / "t.json"
    _log(path, resume=False).add(_run("none", "a", 1.0, [1]))
    other = {**HEADER, "settings": {**HEADER["settings"], "max_new_tokens": 8}}
    with pytest.raises(SettingsMismatch, match="max_new_tokens"):
        _log(path, resume=True, header=other)
    unpinned = {**HEADER, "pinning": "not pinned (fewer than two cores); one thread each"}
    with pytest.raises(SettingsMismatch, match="measured with other pinning"):
        _log(path, resume=True, header=unpinned)
    newer_python = {**HEADER, "machine": {**HEADER["machine"], "python": "3.99"}}
    _log(path, resume=True, header=newer_python)  # the same machine, its Python upgraded


def test_resume_refuses_what_it_cannot_add_to(tmp_path):
    path = tmp_path / "t.json"
    for text in ("not json", "[1, 2]", "{}"):
        path.write_text(text)
        with pytest.raises(SettingsMismatch, match="is not a benchmark result to resume"):
            _log(path, resume=True)
    _log(path, resume=False).add(_run("none", "a", 1.0, [1]))
    other = {**HEADER, "machine": {**HEADER["machine"], "cpu": "another cpu"}}
    with pytest.raises(SettingsMismatch, match="other machine"):  # one machine's line over two machines' runs
        _log(path, resume=True, header=other)
    newer_python = {**HEADER, "machine": {**HEADER["machine"], "python": "3.99"}}
    _log(path, resume=True, header=newer_python)  # the same machine, its Python upgraded


def test_the_report_orders_any_sync_k_and_gives_the_cap_its_unit(tmp_path):
    path = tmp_path / "t.json"
    header = {**HEADER, "network": {**HEADER["network"], "rate_mbit": 10.0}}
    log = _log(path, resume=False, header=header)
    for mode in ("async", "sync-3", "sync-12", "none"):
        log.add(_run(mode, "a", 1.0, [1]))
    assert [s["mode"] for s in log.result["summary"]] == ["none", "sync-3", "sync-12", "async"]
    log.add({**_run("draft", "a", 9.0, [2]), "rtt_ms": None, "drafts_wasted": 0, "server_idle_fraction": 0.0})
    md = log.path.with_suffix(".md").read_text()  # the partial result's report, until complete
    assert "bandwidth cap 10 Mbit/s each way" in md
    draft_row = next(line for line in md.splitlines() if line.startswith("| n/a | draft |"))
    assert draft_row.endswith("| –/– |" + " – |" * 11)  # no 0% for what it has not


def test_a_report_that_fails_mid_write_leaves_the_previous_one_whole(tmp_path) -> None:
    """The Markdown was written in place: a stop (here, text that cannot be written) left it
    cut, beside a JSON of another run."""
    from report_files import save_report

    save_report(tmp_path, "r", {"a": 1}, "old table\n")
    with pytest.raises(UnicodeEncodeError):
        save_report(tmp_path, "r", {"a": 2}, "new table \udcff\n")
    assert (tmp_path / "r.md").read_text() == "old table\n"
