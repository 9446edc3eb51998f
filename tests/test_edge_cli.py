"""The edge's command line: settings no generation could run with are refused up front as
one usage line, and the program ends cleanly on errors and on Ctrl-C."""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specsplit.edge.cli import main, server_list
from specsplit.edge.tokenizer import EdgeTokenizer


@pytest.mark.parametrize(("extra", "message"), [
    (["--server", "127.0.0.1:99999"], "with a port from 1 to 65535"),  # gRPC would wrap it around
    (["--server", "127.0.0.1"], "give HOST:PORT"),  # gRPC would take 443
    (["--server", "a:1,b"], "'b': give HOST:PORT"),
    (["--server", "::1"], "give HOST:PORT ([IPV6]:PORT)"),  # gRPC would read an address on 443
    # gRPC cannot parse these ("Unparsable name"): the edge retried them as a lost server, 70 s and more.
    (["--server", "[127.0.0.1]:50051"], "give HOST:PORT ([IPV6]:PORT)"),
    (["--server", "[]:50051"], "give HOST:PORT ([IPV6]:PORT)"),
    (["--server", "[::1]]:50051"], "give HOST:PORT ([IPV6]:PORT)"),
    (["--server", "127.0.0.1:５０"], "give HOST:PORT"),  # digits, but not ones a port is written in
    # gRPC fails these in each call, as it would a lost server, which the edge retried for a minute or more
    (["--server", "exa mple.com:80"], "give HOST:PORT"),
    (["--server", "unix:"], "give unix:PATH"),
    (["--draft", "dr\udce9ft"], "the path is not UTF-8 text"),  # was: taken for an unreadable tokenizer
    (["--retries", "-1"], "--retries must be a whole number, 0 or more"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be a whole number of at least 1"),
    (["--seed", "-5"], "--seed must fit in 64 unsigned bits"),
    (["--stall-timeout", "0"], "--stall-timeout must be above 0"),
    (["--connect-timeout", "0"], "--connect-timeout must be from 0.1 to 3600 s"),
    (["--connect-timeout", "nan"], "--connect-timeout must be from 0.1 to 3600 s"),
    (["--temperature", "0.8", "--verification", "greedy"], "--verification greedy is for temperature 0"),
    (["--verification", "sparse-q"], "give a temperature above 0"),  # it would run greedy without a word
    (["--temperature", "-1"], "--temperature must be in [0, 100]"),
    (["--top-k", "-1"], "--top-k must be in [0, 2**32)"),
    (["--temperature", "1", "--top-k", str(2**32)], "--top-k must be in [0, 2**32)"),  # protobuf's uint32 would refuse it mid-call
    (["--temperature", "1e-46"], "--temperature 1e-46 is 0 as a 32-bit float"),  # the server would run greedy
    (["--temperature", "1", "--top-p", "1e-46"], "--top-p 1e-46 is 0 as a 32-bit float"),  # the server would not cut
    (["--server", "a:1,b:2", "--retries", "0"], "leaves no attempt for the last of the 2 servers"),
    (["--timeline"], "--timeline is written to --stats-json"),
    (["--tls-server-name", "server.example"], "--tls-server-name is for TLS: give --tls or --tls-ca too"),
    (["--tls-ca", "/no/such/ca.pem"], "--tls-ca /no/such/ca.pem: no such file"),
    (["--tls-ca", ""], "--tls-ca is empty (an unset variable?)"),  # it talked plaintext without a word
    (["--tls-ca", __file__], f"--tls-ca {__file__} holds no PEM certificate"),  # gRPC would fail every handshake
    (["--tls-cert", __file__, "--tls-key", __file__], "are not a PEM certificate and its own unencrypted key"),
])
def test_settings_no_generation_can_run_with_are_refused(extra, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--server", "127.0.0.1:50051", "--draft", "unused", *extra, "hello"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err
    assert err.startswith("usage: specsplit-edge generate")  # the command's own usage


def test_an_empty_prompt_and_a_token_grpc_cannot_send_are_refused(capsys, monkeypatch) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--server", "127.0.0.1:50051", "--draft", "unused", "  "])
    assert "PROMPT is empty" in capsys.readouterr().err
    monkeypatch.setenv("SPECSPLIT_TOKEN", "secret\r")  # a line end copied from a file: every call INTERNAL
    with pytest.raises(SystemExit):
        main(["generate", "--server", "127.0.0.1:50051", "--draft", "unused", "hi"])
    assert "$SPECSPLIT_TOKEN must be printable ASCII" in capsys.readouterr().err


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


@pytest.mark.parametrize(("flag", "message"), [("--prompts-file", "No such file or directory"),
                                              ("--stats-json", "its directory does not exist")])
def test_files_are_checked_before_the_draft_loads_and_named_by_their_option(tmp_path, capsys, flag, message) -> None:
    extra = [flag, str(tmp_path / "no" / "such.txt")] + (["hi"] if flag == "--stats-json" else [])
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nowhere"), *extra]) == 2
    assert capsys.readouterr().err == f"error: {flag} {tmp_path / 'no' / 'such.txt'}: {message}\n"


def test_no_standard_input_to_read_prompts_from_is_named(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(sys, "stdin", None)  # started with stdin closed (<&-)
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path), "--prompts-file", "-"]) == 2
    assert "--prompts-file -: there is no standard input" in capsys.readouterr().err


def test_a_prompts_file_that_is_not_utf8_is_an_error(tiny, tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"hello\n\xff bad\n")
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny.draft_dir),
                 "--prompts-file", str(prompts)]) == 2  # was: a thread's traceback, nothing done, exit 0
    err = capsys.readouterr().err
    assert err.startswith(f"error: --prompts-file {prompts}: not UTF-8 text") and "Traceback" not in err


def _broken_export(tiny, tmp_path, name: str, damage) -> str:  # type: ignore[no-untyped-def]
    export = tmp_path / name
    shutil.copytree(tiny.draft_dir, export)
    damage(export)
    return str(export)


def _edit_meta(change):  # type: ignore[no-untyped-def]
    def damage(export) -> None:  # type: ignore[no-untyped-def]
        meta = json.loads((export / "specsplit.json").read_text())
        change(meta)
        (export / "specsplit.json").write_text(json.dumps(meta))
    return damage


@pytest.mark.parametrize(("name", "damage", "message"), [
    ("no-model", lambda e: (e / "model.onnx").unlink(), "has no model.onnx"),
    ("cut-model", lambda e: (e / "model.onnx").write_bytes((e / "model.onnx").read_bytes()[:1000]),
     "ONNX Runtime cannot load"),
    ("bad-tokenizer", lambda e: (e / "tokenizer.json").write_text('{"model": 1}'), "is not a tokenizer"),
    ("bad-meta-json", lambda e: (e / "specsplit.json").write_text("{"), "specsplit.json is not valid JSON"),
    ("meta-lacks", _edit_meta(lambda m: m.pop("eos_ids")), "specsplit.json lacks eos_ids"),
    ("meta-newer", _edit_meta(lambda m: m.update(new_field=1)), "fields this version does not know (new_field)"),
    ("bad-template", lambda e: (e / "chat_template.jinja").write_text("{% if %}"), "chat template in"),  # a chat prompt
    ("other-model", _edit_meta(lambda m: m.update(num_layers=m["num_layers"] + 1)), "does not take the inputs"),
    # The next four failed only at the first drafting step (a session open) or deep in loading, with a traceback.
    ("other-head-dim", _edit_meta(lambda m: m.update(head_dim=m["head_dim"] * 2)), "specsplit.json says head_dim"),
    ("other-kv-heads", _edit_meta(lambda m: m.update(num_kv_heads=m["num_kv_heads"] + 1)),
     "specsplit.json says num_kv_heads"),
    ("meta-text-number", _edit_meta(lambda m: m.update(num_layers=str(m["num_layers"]))),
     "num_layers must be a whole number of at least 1, got '"),
    ("meta-no-eos", _edit_meta(lambda m: m.update(eos_ids=None)), "eos_ids must be a list of token ids, got None"),
    ("config-not-object", lambda e: (e / "tokenizer_config.json").write_text("[]"), "holds no settings object"),
])
def test_a_damaged_draft_export_is_one_error_line(tiny, tmp_path, capsys, name, damage, message) -> None:
    export = _broken_export(tiny, tmp_path, name, damage)
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", export, "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_a_broken_chat_template_matters_only_to_chat_prompts(tiny, tmp_path) -> None:
    export = _broken_export(tiny, tmp_path, "bad-template", lambda e: (e / "chat_template.jinja").write_text("{% if %}"))
    tok = EdgeTokenizer(Path(export))
    assert tok.encode("hello") == EdgeTokenizer(tiny.draft_dir).encode("hello")  # raw prompts still go
    with pytest.raises(ValueError, match="does not parse"):
        tok.chat_prompt("hello")


# Loop controls, a {% generation %} block, tojson of non-ASCII text and strftime_now: what
# transformers gives chat templates beyond plain jinja2 (the first two did not parse here).
RICH_TEMPLATE = (
    "{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}<{{ m.role }}>{{ m.content | tojson }}{% endif %}{% endfor %}"
    "{{ {'naïve': 'café <b>'} | tojson(indent=1) }}{{ strftime_now('%Y') }}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
    # Undefined is not none: transformers passes tools and documents, as None where there are none.
    "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
)


def test_a_chat_template_given_as_a_list_renders_its_default(tiny, tmp_path) -> None:
    """transformers writes a model's several templates as a list of named ones; a one-turn
    chat takes "default" (before: a TypeError from jinja, even for raw prompts)."""
    def named(export: Path) -> None:
        (export / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((export / "tokenizer_config.json").read_text())
        config["chat_template"] = [{"name": "tool_use", "template": "tools"},
                                   {"name": "default", "template": "<u>{{ messages[0].content }}</u>"}]
        (export / "tokenizer_config.json").write_text(json.dumps(config))

    assert EdgeTokenizer(Path(_broken_export(tiny, tmp_path, "named", named))).chat_prompt("hi") == "<u>hi</u>"


def test_chat_templates_render_as_transformers_renders_them(tiny, tmp_path) -> None:
    from transformers import AutoTokenizer

    export = Path(_broken_export(tiny, tmp_path, "rich", lambda e: (e / "chat_template.jinja").write_text(RICH_TEMPLATE)))
    theirs = AutoTokenizer.from_pretrained(str(export)).apply_chat_template(
        [{"role": "user", "content": "héllo <x>"}], tokenize=False, add_generation_prompt=True)
    assert EdgeTokenizer(export).chat_prompt("héllo <x>") == theirs


def test_a_raw_prompt_gets_the_special_tokens_the_tokenizer_adds(tiny, tmp_path) -> None:
    """Many models' tokenizers put a BOS first, as transformers' tokenizer(text) does; a
    raw prompt without it reached the target unlike any prompt it was trained on."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    def with_bos(export: Path) -> None:
        tok = Tokenizer.from_file(str(export / "tokenizer.json"))
        bos = "<|im_start|>"
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
        tok.save(str(export / "tokenizer.json"))

    export = Path(_broken_export(tiny, tmp_path, "bos", with_bos))
    ours = EdgeTokenizer(export)
    want = AutoTokenizer.from_pretrained(str(export))("def add(a, b):").input_ids
    assert ours.encode("def add(a, b):", add_special_tokens=True) == want
    assert want[0] == ours.token_id("<|im_start|>") and ours.encode("def add(a, b):") == want[1:]


def test_a_stats_file_that_is_the_prompts_file_is_refused_before_it_erases_them(tmp_path, capsys) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one\ntwo\n")
    (tmp_path / "link.txt").symlink_to(prompts)
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nowhere"),
                 "--prompts-file", str(prompts), "--stats-json", str(tmp_path / "link.txt")]) == 2
    assert "is the --prompts-file" in capsys.readouterr().err
    assert prompts.read_text() == "one\ntwo\n"  # was: emptied, nothing generated, exit status 0


def test_standard_input_that_is_not_utf8_is_an_error(tiny, capsys, monkeypatch) -> None:
    """Under a C or UTF-8 locale, Python reads standard input's bytes that are no UTF-8 as lone
    surrogates, which the tokenizer then failed on with a traceback."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9\nhello\n"), errors="surrogateescape"))
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tiny.draft_dir), "--prompts-file", "-",
                 "--retries", "0", "--json"]) == 2
    err = capsys.readouterr().err
    assert "error: --prompts-file -: line 1 is not UTF-8 text" in err and "Traceback" not in err


def test_a_windows_line_end_on_standard_input_is_no_part_of_the_prompt() -> None:
    """A file opened by name loses its \r\n; standard input kept the \r in each prompt."""
    from specsplit.edge.cli import _prompts

    async def lines() -> list:
        args = argparse.Namespace(prompts_file="-", prompt=None)
        return [line async for line in _prompts(args, io.StringIO("hello\r\n\r\nworld\r\n"))]

    assert asyncio.run(lines()) == [(1, "hello"), (3, "world")]


def test_a_prompt_that_is_not_utf8_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:  # the command line's byte 0xff, as Python hands it over
        main(["generate", "--server", "127.0.0.1:50051", "--draft", "unused", "\udcff abc"])
    assert exit_.value.code == 2 and "PROMPT is not UTF-8 text" in capsys.readouterr().err  # was: a TypeError


def test_a_stats_file_keeps_its_content_when_the_draft_fails_to_load(tmp_path, capsys) -> None:
    stats = tmp_path / "stats.jsonl"
    stats.write_text("earlier run\n")
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nowhere"),
                 "--stats-json", str(stats), "hi"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err and stats.read_text() == "earlier run\n"
    fresh = tmp_path / "fresh.jsonl"
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", str(tmp_path / "nowhere"),
                 "--stats-json", str(fresh), "hi"]) == 2
    assert not fresh.exists()  # nor is an empty one left behind


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


@pytest.mark.parametrize(("server", "warned"), [("192.0.2.1:50051", True), ("server.example:50051", True),
                                                ("127.0.0.1:50051", False), ("[::1]:50051", False),
                                                ("localhost:50051", False), ("unix:/run/specsplit.sock", False)])
def test_a_token_sent_in_the_clear_is_warned_of(tmp_path, capsys, monkeypatch, server, warned) -> None:
    """Over plaintext anyone on the path reads the bearer token; on loopback nobody does."""
    monkeypatch.setenv("SPECSPLIT_TOKEN", "s3cret")
    assert main(["generate", "--server", server, "--draft", str(tmp_path / "nowhere"), "hi"]) == 2
    err = capsys.readouterr().err
    assert ("$SPECSPLIT_TOKEN goes to the server in the clear" in err) == warned, err
    assert "s3cret" not in err


def test_text_that_changes_under_what_was_printed_still_streams_to_the_end() -> None:
    """A byte-fallback tokenizer (Llama 2, Mistral, Gemma) decodes a run of byte tokens that
    proves not to be UTF-8 as replacement characters, one per byte, a character already
    printed among them: "a€" became "a����b", which does not start with it, and nothing more
    was printed, in the stream or at the end."""
    import io

    from specsplit.edge.cli import TextStream

    decoded = {1: "a€", 2: "a€\ufffd", 3: "a\ufffd\ufffd\ufffd\ufffdb", 4: "a\ufffd\ufffd\ufffd\ufffdb and the rest"}

    class ByteFallback:
        def decode(self, ids: list[int]) -> str:
            return decoded[len(ids)]

    out = io.StringIO()
    shown = TextStream(ByteFallback(), out)  # type: ignore[arg-type]
    for n in range(1, 5):
        shown([0] * n)
    assert out.getvalue() == "a€\ufffd\ufffd\ufffd\ufffdb and the rest"
    assert shown.unshown(decoded[4] + ".") == "."


def test_a_draft_model_deeper_than_its_metadata_says_is_one_error_line(tiny, tmp_path, capsys) -> None:
    """The model of a deeper export (the target's own) beside the draft's metadata: it loaded,
    and failed at the first draft step, once the server had opened the session."""
    deeper = _broken_export(tiny, tmp_path, "deeper-model",
                            lambda e: shutil.copy(tiny.same_dir / "model.onnx", e / "model.onnx"))
    assert json.loads((tiny.same_dir / "specsplit.json").read_text())["num_layers"] > \
        json.loads((tiny.draft_dir / "specsplit.json").read_text())["num_layers"]
    assert main(["generate", "--server", "127.0.0.1:1", "--draft", deeper, "hi"]) == 2
    err = capsys.readouterr().err
    assert "takes inputs its specsplit.json does not describe (past_key_values." in err and err.count("\n") == 1, err


def test_a_retry_after_a_closed_tls_connection_says_which_setting_to_look_at(tiny, tmp_path, capsys) -> None:
    """Against a mutual-TLS server an edge without a client certificate sees "Socket closed",
    as from a lost server, and retries it as one (71 s at the default --retries): the hint
    came only after the last retry. Each retry's warning now carries it."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from certs import make_pki

    pki = make_pki(tmp_path)
    crt, key, ca = (pki[r].with_suffix(s).read_bytes() for r, s in (("server", ".crt"), ("server", ".key"), ("ca", ".crt")))
    server = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, crt)], root_certificates=ca,
                                                                               require_client_auth=True))
    server.start()
    try:
        status = main(["generate", "--server", f"127.0.0.1:{port}", "--draft", str(tiny.draft_dir), "--tls-ca",
                       str(pki["ca"].with_suffix(".crt")), "--retries", "1", "hi"])
    finally:
        server.stop(None)
    err = capsys.readouterr().err
    assert status == 1
    retry = next(line for line in err.splitlines() if "re-opening it in" in line)
    assert "if it asks for client certificates, give --tls-cert and --tls-key" in retry, err
