"""The edge's command line: settings no generation could run with are refused up front as
one usage line, and the program ends cleanly on errors and on Ctrl-C."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from specsplit.edge.cli import main, server_list


@pytest.mark.parametrize(("extra", "message"), [
    (["--server", "127.0.0.1:99999"], "with a port from 1 to 65535"),  # gRPC would wrap it around
    (["--server", "127.0.0.1"], "give HOST:PORT"),  # gRPC would take 443
    (["--server", "a:1,b"], "'b': give HOST:PORT"),
    (["--server", "::1"], "give HOST:PORT ([IPV6]:PORT)"),  # gRPC would read an address on 443
    (["--server", "127.0.0.1:５０"], "give HOST:PORT"),  # digits, but not ones a port is written in
    (["--retries", "-1"], "--retries must be at least 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--seed", "-5"], "--seed must be at least 0"),
    (["--stall-timeout", "0"], "--stall-timeout must be above 0"),
    (["--temperature", "0.8", "--verification", "greedy"], "--verification greedy is for --temperature 0"),
    (["--verification", "sparse-q"], "give --temperature above 0"),  # it would run greedy without a word
    (["--temperature", "-1"], "temperature must be in [0, 100]"),
    (["--top-k", "-1"], "top_k must be >= 0"),
])
def test_settings_no_generation_can_run_with_are_refused(extra, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--server", "127.0.0.1:50051", "--draft", "unused", *extra, "hello"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    assert err.startswith("usage: specsplit-edge generate")  # the command's own usage


def test_top_p_zero_is_taken_as_the_protocol_takes_it() -> None:
    """0, like 1, turns nucleus sampling off (SamplingParams); the checks must not refuse it."""
    from specsplit.edge.cli import build_parser, check_args

    check_args(build_parser().parse_args(["generate", "--server", "h:1", "--draft", "d", "--temperature", "0.7",
                                          "--top-p", "0", "hi"]))


@pytest.mark.parametrize("servers", ["[::1]:50051", "unix:/run/specsplit.sock", "a:1,b:2,", "h:65535"])
def test_server_lists_grpc_can_dial_are_taken(servers) -> None:
    assert server_list(servers)


def test_a_prompts_file_that_cannot_be_read_is_an_error_line(tiny, tmp_path, capsys) -> None:
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny.draft_dir),
                 "--prompts-file", str(tmp_path)]) == 2
    assert "Is a directory" in capsys.readouterr().err
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err


def test_ctrl_c_at_an_interactive_prompt_ends_the_program(tiny) -> None:
    """A read of standard input blocked on a terminal must not hold the program up."""
    proc = subprocess.Popen([sys.executable, "-m", "specsplit.edge.cli", "generate", "--server", "127.0.0.1:1",
                             "--draft", str(tiny.draft_dir), "--prompts-file", "-"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(5)  # loaded, and waiting for a line that does not come
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=10)
    finally:
        proc.kill()
        stderr = proc.stderr.read() if proc.stderr else ""
    assert code == 130 and "Traceback" not in stderr, stderr


def test_both_commands_say_their_version(capsys) -> None:
    from specsplit.server.cli import main as server_main

    for command, name in ((main, "specsplit-edge"), (server_main, "specsplit-server")):
        with pytest.raises(SystemExit) as exit_:
            command(["--version"])
        assert exit_.value.code == 0 and capsys.readouterr().out.startswith(f"{name} 0.")


class _Chars:
    """A tokenizer whose tokens are character codes."""

    def decode(self, ids: list[int]) -> str:
        return "".join(map(chr, ids))


@pytest.mark.parametrize("shares_terminal", [True, False])
def test_a_warning_while_text_streams_lands_on_a_line_of_its_own_only_on_a_shared_terminal(
        shares_terminal, capsys) -> None:
    import io
    import logging

    from specsplit.edge.cli import LogBesideText, TextStream

    out = io.StringIO()
    shown = TextStream(_Chars(), out)  # type: ignore[arg-type]
    handler = LogBesideText(shares_terminal)
    handler.shown = shown
    shown([ord(c) for c in "Hello"])
    handler.handle(logging.makeLogRecord({"msg": "retrying", "levelno": logging.WARNING, "levelname": "WARNING"}))
    shown([ord(c) for c in "Hello world\n"])
    handler.handle(logging.makeLogRecord({"msg": "again", "levelno": logging.WARNING, "levelname": "WARNING"}))
    # Text going to a file or a pipe is never touched; on one terminal the open line is ended,
    # once, and a line already ended is left alone.
    assert out.getvalue() == ("Hello\n world\n" if shares_terminal else "Hello world\n")
    assert capsys.readouterr().err == "WARNING: retrying\nWARNING: again\n"
