"""A device's generations one after another on one stream: each as on a call of its own,
and a stream the server ended for idling replaced without the caller noticing."""
from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from conftest import free_port, launch_server
from fake_server import fake_server
from specsplit.edge.client import CallCancelled, ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.protocol import codec, errors
from specsplit.protocol.messages import Done, DoneReason, Opened, Verdict
from specsplit.v1 import specsplit_pb2 as pb
from protocol_sim import VOCAB, target_next
from test_end_to_end import reference
from test_reliability import metric, wait_for

PROMPTS = ["def add(a, b):", "The weather today", "for i in range(10):"]
CONFIGS = [EdgeConfig(mode="async", max_new_tokens=24), EdgeConfig(mode="none", max_new_tokens=12),
           EdgeConfig(mode="sync", k=3, max_new_tokens=20)]


def test_generations_share_a_stream_until_it_idles_out(tiny, tmp_path) -> None:
    """(The idle timeout must outlast the gap between one generation's Done and the next
    Open on a loaded machine: at 0.5 s, a slow gap would have ended the stream mid-test.)"""
    tokenizer = EdgeTokenizer(tiny.draft_dir)
    drafter = OnnxDrafter(tiny.draft_dir)
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--metrics-port", str(mport),
                       "--idle-stream-timeout", "1.5") as (address, _):
        metrics = f"127.0.0.1:{mport}"

        async def main() -> list:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = GenerateStream.on(channel)
                results = []
                for prompt, cfg in zip(PROMPTS, CONFIGS):
                    results.append(await generate(stream, tokenizer.encode(prompt), cfg, drafter=drafter,
                                                  fingerprint=tokenizer.fingerprint))
                await asyncio.sleep(3.5)  # past the idle timeout: the server ends the call
                results.append(await generate(stream, tokenizer.encode(PROMPTS[0]), CONFIGS[0], drafter=drafter,
                                              fingerprint=tokenizer.fingerprint))
                stream.close()
                return results

        results = asyncio.run(main())
        for result, prompt, cfg in zip(results, [*PROMPTS, PROMPTS[0]], [*CONFIGS, CONFIGS[0]]):
            assert result.tokens == reference(str(tiny.target_dir), tokenizer.encode(prompt), cfg.max_new_tokens)
            assert result.stats.reconnects == 0
        first = results[0].opened.session_id
        # The next two opened on the first one's stream; the last on a new call.
        assert [r.opened.session_id for r in results[1:3]] == [f"{first}.2", f"{first}.3"]
        assert "." not in results[3].opened.session_id and results[3].opened.session_id != first
        assert metric(metrics, "specsplit_sessions_total") == 4
        assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)
        ended = metric(metrics, "specsplit_sessions_ended_total")
        assert ended == 4, ended
        assert metric(metrics, 'specsplit_idle_streams_ended_total{reason="timeout"}') == 1


def test_an_idle_stream_ends_with_an_ok_status(tiny, tmp_path) -> None:
    """The server ends a stream that stays idle after a Done, cleanly: the edge sees the
    end of the stream, not an error."""
    tokenizer = EdgeTokenizer(tiny.draft_dir)
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--idle-stream-timeout", "0.3") as (address, _):

        async def main() -> tuple[grpc.StatusCode, float]:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = GenerateStream.on(channel)
                await generate(stream, tokenizer.encode(PROMPTS[1]), CONFIGS[1], fingerprint=tokenizer.fingerprint)
                done = time.monotonic()
                assert await stream.call.read() is grpc.aio.EOF
                return await stream.call.code(), time.monotonic() - done

        code, idle = asyncio.run(main())
        assert code == grpc.StatusCode.OK and idle >= 0.2


class _Call:
    """A scripted call: its messages, then the end of the stream or an error."""

    def __init__(self, script: list, error: grpc.StatusCode | None,
                 trailers: grpc.aio.Metadata = grpc.aio.Metadata()) -> None:  # noqa: B008 (never changed)
        self.script = [codec.server_to_pb(m) for m in script]
        self.error = error
        self.trailers = trailers
        self.cancelled = False

    def done(self) -> bool:
        return False  # as a call looks before its status has come

    def cancel(self) -> None:
        self.cancelled = True

    async def read(self):  # type: ignore[no-untyped-def]
        if self.script:
            return self.script.pop(0)
        if self.error is not None:
            raise grpc.aio.AioRpcError(self.error, grpc.aio.Metadata(), self.trailers, "gone")
        await asyncio.sleep(3600)


class _Stub:
    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls
        self.started = 0

    def Generate(self, requests, metadata=None):  # type: ignore[no-untyped-def]  # noqa: N802 (gRPC's name)
        self.started += 1
        return self.calls[self.started - 1]


def _generation(session: str) -> list:
    return [Opened(session, "t", 4096, 32, 64), Verdict(3, (9, 9), 0, 0, 5), Done(DoneReason.LENGTH, 5)]


def test_a_kept_call_that_failed_while_idle_is_replaced() -> None:
    """A kept call whose failure shows only when the next Open is read (cancelled meanwhile,
    say; not a refusal of the whole server, below) costs the generation nothing: it goes out
    again on a new call."""
    dead = _Call(_generation("a"), grpc.StatusCode.CANCELLED)
    stub = _Stub([dead, _Call(_generation("b"), None)])
    cfg = EdgeConfig(mode="none", max_new_tokens=2)

    async def main() -> list:
        stream = GenerateStream(stub)  # type: ignore[arg-type]
        return [await generate(stream, [1, 2, 3], cfg) for _ in range(2)]

    first, second = asyncio.run(main())
    assert (first.opened.session_id, second.opened.session_id) == ("a", "b")
    assert second.tokens == [9, 9] and second.stats.reconnects == 0
    assert stub.started == 2 and dead.cancelled


@pytest.mark.parametrize("refusal", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_a_kept_call_refused_by_its_server_moves_to_the_next_without_asking_it_again(refusal, caplog) -> None:
    """A draining (UNAVAILABLE) or full (RESOURCE_EXHAUSTED, with its pushback) server
    answers the Open on a kept call: a new call to it would be refused alike, so the
    generation goes to the stream's next server, and the first is called only once."""
    pushback = grpc.aio.Metadata(("grpc-retry-pushback-ms", "0"))
    refused = _Call(_generation("a"), refusal, trailers=pushback)
    first, second = _Stub([refused]), _Stub([_Call(_generation("b"), None)])
    cfg = EdgeConfig(mode="none", max_new_tokens=2)

    async def main() -> list:
        stream = GenerateStream(first, second)  # type: ignore[arg-type]
        return [await generate(stream, [1, 2, 3], cfg,
                               connect=ConnectOptions(backoff_s=0.01)) for _ in range(2)]

    one, two = asyncio.run(main())
    assert (one.opened.session_id, two.opened.session_id) == ("a", "b")
    assert two.tokens == [9, 9] and two.stats.reconnects == 1
    assert (first.started, second.started) == (1, 1) and refused.cancelled
    # The wait before the retry is said, so that a device does not look hung.
    assert f"generation interrupted ({refusal.name}" in caplog.text and f"retry 1 of {ConnectOptions.retries}" in caplog.text


def test_past_the_idle_limit_the_longest_idle_stream_ends_and_its_device_carries_on(tiny, tmp_path) -> None:
    """With room for one idle stream, a second device going idle ends the first one's stream,
    idle for longer than the grace (3 s: half the timeout); OK, counted by reason. The first
    device's next generation goes out on a new call, and the second keeps its stream."""
    tokenizer = EdgeTokenizer(tiny.draft_dir)
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--metrics-port", str(mport),
                       "--max-idle-streams", "1", "--idle-stream-timeout", "6") as (address, _):
        metrics = f"127.0.0.1:{mport}"

        async def run(stream: GenerateStream, prompt: str):  # type: ignore[no-untyped-def]
            return await generate(stream, tokenizer.encode(prompt), CONFIGS[1], fingerprint=tokenizer.fingerprint)

        async def main() -> tuple[list, grpc.StatusCode]:
            async with grpc.aio.insecure_channel(address) as channel:
                first, second = GenerateStream.on(channel), GenerateStream.on(channel)
                results = [await run(first, PROMPTS[0])]
                assert wait_for(lambda: metric(metrics, "specsplit_streams_idle") == 1)
                await asyncio.sleep(3.5)
                results.append(await run(second, PROMPTS[1]))
                assert await first.call.read() is grpc.aio.EOF  # told to end: the longest idle
                code = await first.call.code()
                results += [await run(second, PROMPTS[2]), await run(first, PROMPTS[0])]
                first.close()
                second.close()
                return results, code

        results, code = asyncio.run(main())
        assert code == grpc.StatusCode.OK
        for result, prompt in zip(results, [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]):
            assert result.tokens == reference(str(tiny.target_dir), tokenizer.encode(prompt), CONFIGS[1].max_new_tokens)
            assert result.stats.reconnects == 0
        ids = [r.opened.session_id for r in results]
        assert ids[2] == f"{ids[1]}.2"  # the second device kept its stream
        assert "." not in ids[3] and ids[3] != ids[0]  # the first started a new call
        # Only the first: the second had idled for less than the grace when the first device's
        # new stream went idle.
        assert metric(metrics, 'specsplit_idle_streams_ended_total{reason="limit"}') == 1
        assert metric(metrics, 'specsplit_idle_streams_ended_total{reason="timeout"}') == 0


def test_devices_going_idle_together_past_the_limit_are_trimmed_once_the_grace_runs_out(tiny, tmp_path) -> None:
    """Two devices' streams go idle within the grace of each other, with room for one, and
    nothing goes idle after them: the older is ended for the limit once it has idled for the
    grace (3 s), not left to its timeout (6 s)."""
    tokenizer = EdgeTokenizer(tiny.draft_dir)
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--metrics-port", str(mport),
                       "--max-idle-streams", "1", "--idle-stream-timeout", "6") as (address, _):
        metrics = f"127.0.0.1:{mport}"

        async def main() -> list[bool]:
            async with grpc.aio.insecure_channel(address) as channel:
                streams = [GenerateStream.on(channel), GenerateStream.on(channel)]
                await asyncio.gather(*(
                    generate(stream, tokenizer.encode(prompt), CONFIGS[1], fingerprint=tokenizer.fingerprint)
                    for stream, prompt in zip(streams, PROMPTS)))
                seen = [wait_for(lambda: metric(metrics, "specsplit_streams_idle") == 2)]
                seen.append(wait_for(
                    lambda: metric(metrics, 'specsplit_idle_streams_ended_total{reason="limit"}') == 1, timeout=20))
                seen.append(metric(metrics, 'specsplit_idle_streams_ended_total{reason="timeout"}') == 0)
                seen.append(metric(metrics, "specsplit_streams_idle") == 1)
                for stream in streams:
                    stream.close()
                return seen

        assert asyncio.run(main()) == [True, True, True, True]


def test_a_call_that_sends_no_open_ends_with_deadline_exceeded(tiny, tmp_path) -> None:
    """A call that holds a stream and never opens a session is not kept for ever."""
    with launch_server(tiny.target_dir, tmp_path / "s.log", "--idle-stream-timeout", "0.3") as (address, _):

        async def main() -> tuple[grpc.StatusCode, str]:
            async with grpc.aio.insecure_channel(address) as channel:
                stream = GenerateStream.on(channel)
                stream.begin()
                await stream.call.wait_for_connection()
                return await stream.call.code(), await stream.call.details()

        code, details = asyncio.run(asyncio.wait_for(main(), 30))
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "no Open message within 0.3 s" in details


class _TargetDrafter:
    """Drafts the fake target's own next token (no model)."""

    def next_logits(self, trajectory):  # type: ignore[no-untyped-def]
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[target_next(list(trajectory))] = 1.0
        return logits


def _opened_then_a_token_a_verdict(pause_s: float, tokens: int | None = None):  # type: ignore[no-untyped-def]
    """A server's Generate: Opened, then the target's next token in a verdict every `pause_s`,
    drafts or not; after `tokens` of them, Done, and the call idles until the client goes."""
    async def handler(requests, context):  # type: ignore[no-untyped-def]
        prompt = list(codec.edge_from_pb(pb.EdgeMessage.FromString(await anext(aiter(requests)))).prompt_ids)
        yield codec.server_to_pb(Opened("s", "t", 4096, 8, VOCAB)).SerializeToString()
        seq = list(prompt)
        while tokens is None or len(seq) - len(prompt) < tokens:
            await asyncio.sleep(pause_s)
            seq.append(target_next(seq))
            yield codec.server_to_pb(Verdict(len(seq) - 1, (seq[-1],), 0, 0, len(seq))).SerializeToString()
        yield codec.server_to_pb(Done(DoneReason.LENGTH, len(seq))).SerializeToString()
        await asyncio.sleep(0.05)  # then the server ends the idle call (its idle timeout, shortened)
    return handler


@pytest.mark.parametrize(("mode", "how"), [("none", "abort"), ("async", "abort"), ("sync", "abort"),
                                           ("async", "close the channel")])
def test_a_call_its_caller_cancels_ends_the_generation(mode, how) -> None:
    """gRPC ends a read of a call cancelled on the client's side with CancelledError: the
    generation took it for its own cancellation and waited for good for a Done (async, sync),
    or raised CancelledError though nobody had cancelled it (none)."""
    async def main() -> None:
        server, address = await fake_server(_opened_then_a_token_a_verdict(0.05))
        channel = grpc.aio.insecure_channel(address)
        stream = GenerateStream.on(channel)
        committed = asyncio.Event()
        generation = asyncio.create_task(generate(
            stream, [1, 2, 3], EdgeConfig(mode=mode, max_new_tokens=2000, window=4),
            drafter=None if mode == "none" else _TargetDrafter(), on_commit=lambda _: committed.set()))
        await asyncio.wait_for(committed.wait(), 10)
        if how == "abort":
            stream.abort()
        else:
            await channel.close()
        try:
            with pytest.raises(CallCancelled):
                await asyncio.wait_for(generation, 10)  # a hang guard: it ends at once
        finally:
            await channel.close()
            await server.stop(None)

    asyncio.run(main())


def test_a_kept_call_the_server_ended_leaves_no_request_task_behind() -> None:
    """Each generation on a kept stream whose call the server had ended while idle left the
    old call's request task waiting on its queue for good: one more per generation."""
    async def main() -> list[int]:
        server, address = await fake_server(_opened_then_a_token_a_verdict(0.0, tokens=1))
        waiting = []
        async with grpc.aio.insecure_channel(address) as channel:
            stream = GenerateStream.on(channel)
            for _ in range(4):
                await generate(stream, [1, 2, 3], EdgeConfig(mode="none", max_new_tokens=1))
                await asyncio.sleep(0.3)  # the server ends the idle call
                # gRPC's task that sends a call's requests (the latest call's is still there)
                waiting.append(sum("consume_request_iterator" in repr(t) for t in asyncio.all_tasks()))
            stream.close()
        await server.stop(None)
        return waiting

    assert asyncio.run(main()) == [1, 1, 1, 1]


def test_a_server_that_does_not_open_first_is_not_retried() -> None:
    """A server whose first message is not the session's Opened breaks the protocol, and would
    again: it was retried as a lost server, every retry (71.5 s and more by default)."""
    calls = []

    async def verdict_first(requests, context):  # type: ignore[no-untyped-def]
        calls.append(await anext(aiter(requests)))
        yield codec.server_to_pb(Verdict(3, (5,), 0, 0, 4)).SerializeToString()

    async def main() -> None:
        server, address = await fake_server(verdict_first)
        try:
            with pytest.raises(errors.NotOpenedFirst, match="first message was Verdict, not Opened"):
                await generate(address, [1, 2, 3], EdgeConfig(mode="none", max_new_tokens=4),
                               connect=ConnectOptions(retries=3, backoff_s=0.01))
        finally:
            await server.stop(None)

    asyncio.run(main())
    assert len(calls) == 1
