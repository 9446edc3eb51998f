"""The benchmark scripts' command lines: a value no run could use is one usage line at once,
before models load or a sweep runs, never a traceback afterwards or a silent substitute."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

import cli_types
import run_bench
from loadtest import capacity
from loadtest import run as loadtest_run

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


@pytest.mark.parametrize(("parse", "text", "message"), [
    (cli_types.at_least(1), "0", "must be at least 1"),
    (cli_types.at_least(0, float, above=True), "0", "must be above 0"),
    (cli_types.at_least(1), "x", "not an integer"),
    (cli_types.fraction, "1.5", "from 0 to 1"),
    (cli_types.int_list, "1,x", "integers separated by commas"),
    (cli_types.int_list, ",", "at least one integer"),
    (cli_types.int_list, "-3", "integers separated by commas"),
    (cli_types.int_list, "1,7-4", "runs backwards"),  # it was read as 1 alone
    (cli_types.at_least(0, float), "nan", "not a number"),
    (cli_types.report_name, "sub/x", "without a directory"),
    (cli_types.report_name, "..", "without a directory"),
    (cli_types.host_port, "localhost", "HOST:PORT"),
    (cli_types.host_port, "localhost:70000", "HOST:PORT"),
    (cli_types.port, "99999", "from 0 to 65535"),
])
def test_a_value_no_run_could_use_is_refused(parse, text, message) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_values_a_run_can_use_are_taken() -> None:
    assert cli_types.at_least(1)("3") == 3 and cli_types.at_least(0, float)("0") == 0.0
    assert cli_types.fraction("0.85") == 0.85
    assert cli_types.int_list("1,4-6") == (1, 4, 5, 6)
    assert cli_types.host_port("[::1]:50051") == "[::1]:50051"
    assert cli_types.report_name("capacity-gpu-1.5b") == "capacity-gpu-1.5b"


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="the OS does not say which cores a process has")
def test_a_core_this_process_cannot_use_is_refused() -> None:
    """Pinning to it would fail, or leave the process unpinned while its report says otherwise."""
    have = sorted(os.sched_getaffinity(0))
    assert cli_types.cores(str(have[0])) == (have[0],)
    with pytest.raises(argparse.ArgumentTypeError, match="not available here"):
        cli_types.cores(str(max(have) + 1))


def test_a_draft_export_and_a_model_directory_must_be_what_they_say(tmp_path) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a specsplit draft export"):
        cli_types.draft_export(str(tmp_path))
    with pytest.raises(argparse.ArgumentTypeError, match="no config.json"):
        cli_types.model_dir(str(tmp_path))


@pytest.mark.parametrize(("extra", "message"), [
    (["--name", "sub/x"], "without a directory"),  # the sweep used to run, then fail to write
    (["--duration", "0"], "--duration: must be above 0"),  # it measured nothing and exited 0
    (["--generations", "0"], "at least 1"),
    (["--alpha", "1.5"], "from 0 to 1"),  # every generation failed, counted as errors
    (["--branch-coverage", "2"], "from 0 to 1"),
    (["--window", "0"], "at least 1"),
    (["--modes", ""], "at least one mode"),
    (["--modes", "sim,sim"], "given twice"),  # the second sweep overwrote the first
    (["--sessions", "2,2"], "given twice"),
    (["--slo", "-1"], "--slo: must be at least 0"),
    (["--client-procs", "0"], "at least 1"),  # one process ran; the report said 0
    (["--draft", "/nonexistent"], "not a specsplit draft export"),  # found only when the onnx sweep began
    (["--target", "/nonexistent"], "no config.json"),
    (["--sessions-for", "none=abc"], "MODE=COUNTS"),
    (["--branch-coverage", "0.3", "--draft-delay-ms", "5"], "--branch-coverage needs"),
    # A server already running: only the options that can reach it, and a draft for its tokenizer.
    (["--server", "localhost"], "give HOST:PORT"),
    (["--server", "localhost:5"], "--server needs --draft"),
    (["--server", "localhost:5", "--target-config", "qwen2-7b"], "--target-config is for the server the load test starts"),
    (["--server", "localhost:5", "--device", "cpu"], "--device is for the server the load test starts"),
    (["--server", "localhost:5", "--server-arg=--max-wait-ms=5"], "--server-arg is for the server"),
    (["--tls-ca", "ca.pem"], "--tls-ca needs --server"),
    (["--metrics-url", "http://h:9100/metrics"], "--metrics-url needs --server"),
    (["--server", "h:5", "--metrics-url", "h:9100"], "give an http:// or https:// URL"),
])
def test_the_load_test_refuses_settings_before_it_starts_anything(extra, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        loadtest_run.main(extra)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    assert err.startswith("usage: ")


def test_the_load_test_refuses_a_file_as_its_output_directory(tmp_path, capsys) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit):
        loadtest_run.main(["--out-dir", str(tmp_path / "f")])
    assert "is a file, not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a directory under a file cannot be made: found after the sweep
        loadtest_run.main(["--out-dir", str(tmp_path / "f" / "sub")])
    assert f"cannot be made: {tmp_path / 'f'} is a file" in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "message"), [
    ([], "required: --name"),  # a trial run wrote over the committed full.json
    (["--name", "x", "--prompts", "99"], "there are 12 prompts"),
    (["--name", "x", "--prompts", "-1"], "at least 0"),  # ran 11 prompts
    (["--name", "x", "--rtt-ms", "-50"], "at least 0"),  # ran without delay, recorded -50
    (["--name", "x", "--sync-k", "0"], "from 1 to 64"),  # found after the draft and HF runs
    (["--name", "x", "--sync-k", "100"], "from 1 to 64"),  # drafted as 64, labelled sync-100
    (["--name", "x", "--window", "0"], "a positive number or auto"),
    # The edge drafts no further than the server takes: run at 64 (or 4), labelled 100 (or sync-8)
    (["--name", "x", "--window", "100"], "--window 100 is past the server's --max-lookahead 64"),
    (["--name", "x", "--sync-k", "8", "--server-args=--max-lookahead 4"], "--sync-k 8 is past the server's --max-lookahead 4"),
    (["--name", "x", "--sync-k", "32"], "--sync-k 32 is past the server's --max-verify-tokens 24"),  # verified in parts
    # Found only when the server started, after the anchors had run for minutes.
    (["--name", "x", "--server-args=--bogus-flag"], "--server-args: unrecognized arguments: --bogus-flag"),
    (["--name", "x", "--server-args=--max-wait-ms soon"], "--server-args: argument --max-wait-ms"),
    (["--name", "x", "--server-args=--help"], "--help prints serve's help"),  # a traceback: help went to stdout
    (["--name", "x", "--server-args=--port 5"], "--port is the benchmark's to set"),
    # Abbreviated, as serve's argparse takes them: the report would have said 1 thread, bf16.
    (["--name", "x", "--server-args=--thread 4"], "--threads is the benchmark's to set"),
    (["--name", "x", "--server-args=--dty fp32"], "--dtype is the benchmark's to set"),
    # At serve's default value too: given after the benchmark's own, it would win.
    (["--name", "x", "--server-args=--port 50051"], "--port is the benchmark's to set"),
    (["--name", "x", "--server-args=--he"], "--help prints serve's help"),
    # The report's header would have said a CPU server on one core, and the real target.
    (["--name", "x", "--server-args=--device cuda"], "--device is the benchmark's to set"),
    (["--name", "x", "--server-args=--load-format dummy"], "--load-format is the benchmark's to set"),
])
def test_the_benchmark_refuses_settings_before_it_prepares_models(extra, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        run_bench.main(extra)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_capacity_keeps_a_dotted_output_name_and_takes_a_report_without_split(tmp_path, capsys) -> None:
    report = json.loads((RESULTS / "capacity-gpu-rerun-c.json").read_text())
    report["summary"]["split_sessions_at_slo"] = None  # swept none and onnx, say
    (tmp_path / "r.json").write_text(json.dumps(report))
    assert capacity.main([str(tmp_path / "r.json"), "--out", str(tmp_path / "out" / "capacity-gpu-1.5b")]) == 0
    written = json.loads((tmp_path / "out" / "capacity-gpu-1.5b.json").read_text())  # not capacity-gpu-1.json
    assert written["ratio"] is None and written["baseline_sessions_at_slo"] == 384
    note = capsys.readouterr().out
    assert "| split, simulated edges at alpha 0.85 | not swept |" in note
    assert "--out bench/results/capacity-gpu-1.5b" in note  # its rerun writes where this one did, not the headline


def test_capacity_says_so_when_its_input_is_not_a_load_test_report(tmp_path, capsys) -> None:
    (tmp_path / "r.json").write_text("{}")
    for path in (tmp_path / "r.json", tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exit_:
            capacity.main([str(path), "--out", str(tmp_path / "c")])
        assert exit_.value.code == 2 and "cannot read a load-test report" in capsys.readouterr().err


@pytest.mark.parametrize(("server_arg", "message"), [
    ("--bogus", "--server-arg: unrecognized arguments: --bogus"),  # found after the models were built
    ("--dtype=fp32", "--dtype is the benchmark's to set"),  # the report said bf16
    ("--thread=4", "--threads is the benchmark's to set"),  # abbreviated: the report said 1 torch thread
    ("--device=cuda", "--device is the benchmark's to set"),
    ("--device=cpu", "--device is the benchmark's to set"),  # the default, given after the load test's own
    # Refused by serve too, but only once it starts, after the models were built.
    ("--static-max-len=512", "--static-max-len sizes the static engine's slots; it needs --engine static"),
])
def test_the_load_test_refuses_server_args_before_it_builds_models(server_arg, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        loadtest_run.main([f"--server-arg={server_arg}"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_an_engine_s_own_server_arg_is_judged_on_the_load_test_s_device() -> None:
    """On a GPU serve's --engine auto is the static engine, whose slots --static-max-len sizes."""
    from serve_args import serve_args_problem

    assert serve_args_problem(["--static-max-len=512"], (), "cuda") is None
    assert "it needs --engine static" in serve_args_problem(["--static-max-len=512"], (), "cpu")
