"""The edge client as a library: settings and token ids checked before any call, one drafter
shared by generations running at once, a kept stream that carries one generation at a time."""
from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys

import grpc
import numpy as np
import pytest

from specsplit.edge.client import ConfigError, ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.protocol import codec
from specsplit.protocol.messages import Done, DoneReason, Opened, SamplingParams, VerificationMode, Verdict
from specsplit.v1 import specsplit_pb2 as pb
from protocol_sim import VOCAB, target_next
from test_end_to_end import reference
from fake_server import fake_server

NOWHERE = "127.0.0.1:1"  # nothing listens: a check that waits for the network would fail there


@pytest.mark.parametrize(("kw", "field"), [
    ({"max_new_tokens": 0}, "max_new_tokens"),  # was: protobuf's "Value out of range", or the server's refusal
    ({"sparse_top_k": 0}, "sparse_top_k"),
    ({"window": 1.5}, "window"),  # was: taken, and run
    ({"window": True}, "window"),
    ({"stop_ids": (-1,)}, "stop_ids"),
    ({"sampling": SamplingParams(temperature=-1.0)}, "sampling.temperature"),
    ({"sampling": SamplingParams(top_k=1.5)}, "sampling.top_k"),  # was: a TypeError in the encoding
    ({"sampling": SamplingParams(temperature=True)}, "sampling.temperature"),
    ({"branches": 1.5}, "branches"),
    ({"stop_ids": (True,)}, "stop_ids"),
    ({"sampling": None}, "sampling"),
    ({"verification": "match"}, "verification"),
    ({"verification": VerificationMode.GREEDY, "sampling": SamplingParams(temperature=0.7)}, "verification"),
    ({"verification": VerificationMode.MATCH}, "verification"),  # sampled verification of greedy output
])
def test_an_edge_config_no_generation_can_run_with_is_refused(kw, field) -> None:
    with pytest.raises(ConfigError) as refused:
        EdgeConfig(**kw)
    assert refused.value.field == field


@pytest.mark.parametrize(("kw", "field"), [
    ({"retries": -1}, "retries"),  # was: AssertionError from an empty retry loop
    ({"stall_timeout_s": 0.0}, "stall_timeout_s"),  # was: every attempt stalled at once
    ({"backoff_s": float("nan")}, "backoff_s"),
    ({"token": ""}, "token"),  # was: no token sent, silently
    ({"backoff_s": None}, "backoff_s"),  # was: a TypeError
    ({"stall_timeout_s": True}, "stall_timeout_s"),
    ({"token": "secret\n"}, "token"),
])
def test_connect_options_no_call_can_use_are_refused(kw, field) -> None:
    with pytest.raises(ConfigError) as refused:
        ConnectOptions(**kw)
    assert refused.value.field == field


def test_the_default_retries_outlast_a_restart_of_the_default_target() -> None:
    """Loading the default target takes about 49 s on one core (the design's figure); the
    default of 5 retries gave up after 15.5 s of waits (16 to 23 s with the spread)."""
    from specsplit.edge.retry import retry_span

    assert retry_span(ConnectOptions.retries, ConnectOptions.backoff_s) >= 60
    assert retry_span(5, 0.5) == 0.5 + 1 + 2 + 4 + 8 and retry_span(0, 0.5) == 0


@pytest.mark.parametrize(("ids", "message"), [
    ([], "prompt_ids is empty"),
    ([1, -1], "prompt_ids must be token ids"),  # was: protobuf's "Value out of range"
    ([1, 2**33], "prompt_ids must be token ids"),
    ("hello", "prompt_ids must be token ids"),  # a string where ids belong
    ([1.5], "prompt_ids must be token ids"),
    ([1, True], "prompt_ids must be token ids"),
    ((t for t in [1, True]), "prompt_ids must be token ids"),  # an iterator, looked at once
])
def test_prompt_ids_that_are_no_token_ids_are_refused_before_any_call(ids, message) -> None:
    with pytest.raises(ValueError, match=message):
        asyncio.run(generate(NOWHERE, ids, EdgeConfig(mode="none"), connect=ConnectOptions(retries=0)))


def test_numpy_token_ids_generate_as_ints(tiny, server) -> None:
    """A tokenizer's numpy output opened a session, then failed in the trajectory hash."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")
    cfg = EdgeConfig(max_new_tokens=8)
    result = asyncio.run(generate(server, np.asarray(ids, dtype=np.int64), cfg, drafter=OnnxDrafter(tiny.draft_dir),
                                  fingerprint=tok.fingerprint))
    assert result.tokens == reference(str(tiny.target_dir), ids, 8)


def test_a_drafter_follows_any_sequence_of_trajectories(tiny) -> None:
    """Two caches holding the same tokens were compared as dataclasses, arrays and all: the
    fifth step below raised "The truth value of an array ... is ambiguous"."""
    drafter, fresh = OnnxDrafter(tiny.draft_dir), OnnxDrafter(tiny.draft_dir)
    prompt = list(range(3, 12))
    for trajectory in (prompt + [1], prompt, prompt + [1], prompt, prompt + [2]):
        fresh.reset()
        np.testing.assert_allclose(drafter.next_logits(trajectory), fresh.next_logits(trajectory), atol=1e-4)


def test_one_drafter_serves_generations_running_at_once(tiny, server) -> None:
    """Each generation drafts in a thread of its own: sharing one drafter failed 14 of 15."""
    tok = EdgeTokenizer(tiny.draft_dir)
    prompts = ["def add(a, b):", "The quick brown fox", "hello"]
    drafter = OnnxDrafter(tiny.draft_dir)

    async def all_at_once() -> list[list[int]]:
        async with grpc.aio.insecure_channel(server) as channel:
            results = await asyncio.gather(*(
                generate(GenerateStream.on(channel), tok.encode(p), EdgeConfig(max_new_tokens=12), drafter=drafter,
                         fingerprint=tok.fingerprint) for p in prompts))
        return [r.tokens for r in results]

    assert asyncio.run(all_at_once()) == [reference(str(tiny.target_dir), tok.encode(p), 12) for p in prompts]


def test_a_kept_stream_carries_one_generation_at_a_time(tiny, server) -> None:
    """A second generation at once sent its Open into the first's session (refused) and was
    then cancelled by the first's abort, though nobody had cancelled it."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")

    async def two_on_one_stream() -> tuple:
        async with grpc.aio.insecure_channel(server) as channel:
            stream = GenerateStream.on(channel)
            runs = [generate(stream, ids, EdgeConfig(mode="none", max_new_tokens=8), fingerprint=tok.fingerprint)
                    for _ in range(2)]
            first, second = await asyncio.gather(*runs, return_exceptions=True)
            again = await generate(stream, ids, EdgeConfig(mode="none", max_new_tokens=8), fingerprint=tok.fingerprint)
            stream.close()
            return first, second, again

    first, second, again = asyncio.run(two_on_one_stream())
    want = reference(str(tiny.target_dir), ids, 8)
    assert first.tokens == want and again.tokens == want
    assert isinstance(second, RuntimeError) and "carries another generation" in str(second)


def test_a_kept_stream_stays_with_its_generation_between_attempts(tiny, server) -> None:
    """While one generation waited out a retry's backoff, another could take its stream; the
    retry then found the stream taken and lost what it had."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")
    cfg = EdgeConfig(mode="none", max_new_tokens=8)

    async def second_in_the_gap() -> tuple:
        async with grpc.aio.insecure_channel(NOWHERE) as dead, grpc.aio.insecure_channel(server) as live:
            stream = GenerateStream.on(dead, live)
            first = asyncio.create_task(generate(stream, ids, cfg, fingerprint=tok.fingerprint,
                                                 connect=ConnectOptions(retries=1, backoff_s=1.0)))
            async def failed_over() -> None:  # the first attempt failed over: its backoff has begun
                while stream.server == 0:
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(failed_over(), 30)  # a regression fails rather than hangs
            try:
                await generate(stream, ids, cfg, fingerprint=tok.fingerprint)
                second: Exception | None = None
            except RuntimeError as exc:
                second = exc
            result = await first
            stream.close()
            return result, second

    result, second = asyncio.run(second_in_the_gap())
    assert result.tokens == reference(str(tiny.target_dir), ids, 8) and result.stats.reconnects == 1
    assert second is not None and "carries another generation" in str(second)


@pytest.fixture(scope="module")
def endless(tiny, tmp_path_factory):
    """A server whose target has no eos: its generations run to max_new_tokens."""
    import json
    import shutil

    from conftest import launch_server

    target = tmp_path_factory.mktemp("endless") / "target"
    shutil.copytree(tiny.target_dir, target)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((target / name).read_text())
        config["eos_token_id"] = None
        (target / name).write_text(json.dumps(config))
    with launch_server(target, target.parent / "server.log") as (address, _):
        yield address


@pytest.mark.parametrize("mode", ["none", "async"])
def test_a_cancelled_generation_stops(tiny, endless, mode) -> None:
    """Cancelled while its verdicts flow (a stop button, a timeout), it raises CancelledError:
    the stream's reads swallowed a cancellation that came as a message arrived, and most
    cancelled generations ran to their end."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")
    drafter = OnnxDrafter(tiny.draft_dir) if mode != "none" else None

    async def cancelled_mid_way(delay: float) -> bool | None:
        flowing = asyncio.Event()
        task = asyncio.create_task(generate(endless, ids, EdgeConfig(mode=mode, max_new_tokens=240), drafter=drafter,
                                            fingerprint=tok.fingerprint, on_commit=lambda _: flowing.set()))
        await flowing.wait()
        await asyncio.sleep(delay)  # from outside, while verdicts arrive
        if task.done():
            return None  # over before the cancellation (a fast machine): nothing to learn
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    kept = [asyncio.run(cancelled_mid_way(0.005 * i)) for i in range(10)]  # a whole one took 0.2 s or more
    assert False not in kept and True in kept, kept


class FailingDrafter(OnnxDrafter):
    """An ONNX Runtime step that fails on its third call."""

    calls = 0

    def next_logits(self, tokens):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the drafter's step failed")
        return super().next_logits(tokens)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_drafter_that_fails_ends_the_generation_with_its_error(tiny, endless, mode) -> None:
    """Sync: the server waited for drafts that never came, and the edge reported a stalled
    server after its stall timeouts and retries. Async: the server finished alone, and only
    then did the drafter's error come out."""
    tok = EdgeTokenizer(tiny.draft_dir)
    drafter = FailingDrafter(tiny.draft_dir)
    commits: list[int] = []
    cfg = EdgeConfig(mode=mode, max_new_tokens=240, branch_tokens=0)  # no branches: every step through next_logits
    with pytest.raises(RuntimeError, match="the drafter's step failed"):
        asyncio.run(generate(endless, tok.encode("def add(a, b):"), cfg, drafter=drafter, fingerprint=tok.fingerprint,
                             on_commit=lambda generated: commits.append(len(generated)),
                             connect=ConnectOptions(stall_timeout_s=30, retries=0)))
    assert drafter.calls == 3 and (not commits or commits[-1] < 240)


def test_a_resumed_generation_counts_only_what_it_generated(tiny, endless) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("def add(a, b):")
    result = asyncio.run(generate(endless, ids, EdgeConfig(mode="none", max_new_tokens=12), fingerprint=tok.fingerprint,
                                  committed_ids=[5, 6, 7, 8, 9]))
    assert result.tokens[:5] == [5, 6, 7, 8, 9] and len(result.tokens) == 12
    assert result.stats.tokens == len(result.commit_times) == 7  # was 12 tokens against 7 commit times


def test_library_inputs_the_protocol_cannot_carry_are_refused_before_any_call(tiny) -> None:
    tok = EdgeTokenizer(str(tiny.draft_dir))  # a str as well as a Path, as OnnxDrafter takes
    with pytest.raises(ConfigError, match="max_new_tokens must be below 2\\*\\*32"):
        EdgeConfig(max_new_tokens=2**33)  # was protobuf's error, after the call had begun
    with pytest.raises(ValueError, match="draft_model must be a str"):
        asyncio.run(generate(NOWHERE, [1, 2], EdgeConfig(mode="none"), draft_model=tiny.draft_dir))
    with pytest.raises(ValueError, match="retries 1 leaves no attempt for the last of the 3 servers"):
        asyncio.run(generate([NOWHERE] * 3, [1, 2], EdgeConfig(mode="none"), connect=ConnectOptions(retries=1)))
    assert tok.encode("hi")


def test_a_numpy_seed_samples_as_its_int(tiny, server) -> None:
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode("import numpy")
    results = [asyncio.run(generate(server, ids, EdgeConfig(mode="sync", max_new_tokens=6, sampling=SamplingParams(
        temperature=1.0, seed=seed)), drafter=OnnxDrafter(tiny.draft_dir), fingerprint=tok.fingerprint)).tokens
        for seed in (np.int64(2**62), 2**62)]  # the numpy one overflowed in the edge's own seed
    assert results[0] == results[1]


def test_the_drafters_logits_are_read_only_and_its_inputs_checked(tiny) -> None:
    drafter = OnnxDrafter(tiny.draft_dir)
    logits = drafter.next_logits([5, 6, 7])
    with pytest.raises(ValueError, match="read-only"):
        logits[:] = 0  # would have been what the next call for [5, 6, 7] returned
    assert drafter.next_logits([5, 6, 7]) is logits
    for bad, message in (([], "at least one token"), ([5, -1], "token id -1 is outside"),
                         ([5, 10**6], "token id 1000000 is outside")):
        with pytest.raises(ValueError, match=message):
            drafter.next_logits(bad)
        with pytest.raises(ValueError, match=message):
            drafter.next_logits_batch([[5, 6], bad])


def test_a_branch_never_grows_past_one_chunk() -> None:
    """With --branch-tokens and a server's lookahead both past the chunk limit, a branch
    (sent whole each time it grows) reached 70 tokens and the server refused the chunk,
    ending the generation."""
    from specsplit.edge.attempt import Attempt
    from specsplit.protocol.edge_session import EdgeSession
    from specsplit.protocol.messages import MAX_CHUNK

    gen = Attempt(None, [1, 2], EdgeConfig(mode="none", window=100, branch_tokens=100), "", "", [], None)
    gen.edge, gen._server_lookahead = EdgeSession([1, 2], 100), 128
    assert gen._branch_room(2) == MAX_CHUNK


@pytest.fixture(scope="module")
def other_vocab_drafts(tiny, tmp_path_factory) -> dict[int, OnnxDrafter]:
    """Drafts over the tiny pair's tokenizer with fewer (300) and more (400) vocabulary rows
    than the target's 320, as real pairs of one family differ (151,936 and 152,064 rows)."""
    from specsplit.server.export import export_draft
    from tiny_models import build_model, build_tokenizer, save

    root = tmp_path_factory.mktemp("vocab")
    drafts = {}
    for rows in (300, 400):
        hf = save(build_model(1, layers=1, vocab_size=rows, eos_id=tiny.eos_id), build_tokenizer(), root / f"hf-{rows}")
        export_draft(str(hf), root / f"draft-{rows}")
        drafts[rows] = OnnxDrafter(root / f"draft-{rows}")
    return drafts


VOCAB_PROMPT = "The quick brown fox"  # the target commits an id past 300; the 400-row draft prefers ids past 320


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_draft_with_more_vocabulary_rows_than_the_target_drafts_only_the_targets(
        tiny, server, other_vocab_drafts, mode) -> None:
    """Before, its draft of an id past the target's rows was refused (INVALID_ARGUMENT) and
    ended the generation."""
    tok, drafter = EdgeTokenizer(tiny.draft_dir), other_vocab_drafts[400]
    ids = tok.encode(VOCAB_PROMPT)
    want = reference(str(tiny.target_dir), ids, 40)
    assert any(int(np.argmax(drafter.next_logits(ids + want[:i]))) >= 320 for i in range(len(want)))
    result = asyncio.run(generate(server, ids, EdgeConfig(mode=mode, max_new_tokens=40), drafter=drafter,
                                  fingerprint=tok.fingerprint, connect=ConnectOptions(retries=0)))
    assert result.tokens == want and result.stats.drafts_made > 0  # (the server checks every draft it receives)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_token_the_draft_cannot_read_leaves_the_rest_to_the_server(tiny, server, other_vocab_drafts, caplog,
                                                                    mode) -> None:
    """The target (320 rows) commits an id the 300-row draft has no row for: the edge stops
    drafting and half-closes, and the server decodes the rest alone, sync sessions too
    (before: the drafter's ValueError ended the generation)."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = tok.encode(VOCAB_PROMPT)
    want = reference(str(tiny.target_dir), ids, 40)
    past = next(i for i, t in enumerate(want) if t >= 300)
    assert past < len(want) - 3  # tokens follow it
    after_ids = tok.encode("def add(a, b):")
    connect = ConnectOptions(retries=0, stall_timeout_s=20)

    async def main():  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(server) as channel:
            stream = GenerateStream.on(channel)  # kept: the half-closed call is not the next generation's
            cfg = EdgeConfig(mode=mode, max_new_tokens=40)
            first = await generate(stream, ids, cfg, drafter=other_vocab_drafts[300], fingerprint=tok.fingerprint,
                                   connect=connect)
            after = await generate(stream, after_ids, cfg, drafter=OnnxDrafter(tiny.draft_dir),
                                   fingerprint=tok.fingerprint, connect=connect)
            stream.close()
            return first, after

    with caplog.at_level("WARNING", logger="specsplit.edge.attempt"):
        result, after = asyncio.run(main())
    assert result.tokens == want and result.stats.reconnects == 0
    assert f"the target committed token id {want[past]}, past the draft's 300 ids" in caplog.text
    assert after.tokens == reference(str(tiny.target_dir), after_ids, 40) and after.stats.reconnects == 0


def test_a_prompt_holding_an_id_the_draft_cannot_read_is_left_to_the_server(tiny, server, other_vocab_drafts,
                                                                              caplog) -> None:
    """A conversation's prompt may hold an earlier answer's id past the draft's rows: the
    drafter's ValueError ended the generation, where one the target committed is left to the
    server to decode alone."""
    tok = EdgeTokenizer(tiny.draft_dir)
    ids = [*tok.encode("def add(a, b):"), 310]
    with caplog.at_level("WARNING", logger="specsplit.edge.attempt"):
        result = asyncio.run(generate(server, ids, EdgeConfig(mode="async", max_new_tokens=12),
                                      drafter=other_vocab_drafts[300], fingerprint=tok.fingerprint,
                                      connect=ConnectOptions(retries=0)))
    assert result.tokens == reference(str(tiny.target_dir), ids, 12)
    assert "the prompt holds token id 310, past the draft's 300 ids" in caplog.text


ORT_BUILT_FOR_NUMPY_1 = """
import sys
from importlib import metadata
real = metadata.version
metadata.version = lambda dist: "1.18.1" if dist == "onnxruntime" else real(dist)
sys.modules["onnxruntime"] = None  # its import fails, as a build for numpy 1 fails under numpy 2
import specsplit.edge.cli
"""


def test_an_onnx_runtime_built_for_numpy_1_is_named_with_its_fix() -> None:
    """The edge admits ONNX Runtime 1.17 and 1.18, which fail to import under numpy 2 with
    numpy's own message; the edge says which versions clash and what to install."""
    run = subprocess.run([sys.executable, "-c", ORT_BUILT_FOR_NUMPY_1], capture_output=True, text=True)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode != 0
    if np.__version__.startswith("1."):
        assert "ONNX Runtime 1.18.1" not in last  # numpy 1: not the clash, the error as it was
    else:
        assert last.startswith(f"ImportError: ONNX Runtime 1.18.1 cannot run with numpy {np.__version__}")
        assert "install 'numpy<2', or ONNX Runtime 1.19 or newer" in last


class _TargetPicker:
    """Picks the fake target's own next token, inline (a TokenPicker: it fills the window at once)."""

    def next_token(self, trajectory) -> int:  # type: ignore[no-untyped-def]
        return target_next(list(trajectory))


def test_drafts_a_verdict_left_unsent_go_out_though_the_window_is_full() -> None:
    """A verdict saying the server holds fewer drafts than it was sent (one was dropped) makes
    the edge send the rest again. At the draft end the window has no room: the edge waited
    for room that never came, and the server decoded the rest alone."""
    received: list = []

    async def handler(requests, context):  # type: ignore[no-untyped-def]
        requests = aiter(requests)

        async def read():  # type: ignore[no-untyped-def]
            return codec.edge_from_pb(pb.EdgeMessage.FromString(await anext(requests)))

        prompt = list((await read()).prompt_ids)
        yield codec.server_to_pb(Opened("s", "t", 4096, 8, VOCAB)).SerializeToString()
        received.append(await read())
        seq = [*prompt, target_next(prompt)]
        # It holds only the first of the chunk's drafts.
        yield codec.server_to_pb(Verdict(len(prompt), (seq[-1],), accepted=1, proposed=1, candidate_tip=len(seq),
                                         chunks_received=1)).SerializeToString()
        with contextlib.suppress(TimeoutError):
            received.append(await asyncio.wait_for(read(), 10))  # a hang guard: it comes at once
        start = len(seq)
        while len(seq) < len(prompt) + 5:
            seq.append(target_next(seq))
        yield codec.server_to_pb(Verdict(start, tuple(seq[start:]), accepted=3, proposed=3, candidate_tip=len(seq) - 1,
                                         chunks_received=2)).SerializeToString()
        yield codec.server_to_pb(Done(DoneReason.LENGTH, len(seq))).SerializeToString()

    async def main() -> list[int]:
        server, address = await fake_server(handler)
        try:
            result = await generate(address, [1, 2, 3], EdgeConfig(mode="async", max_new_tokens=5, window=8),
                                    drafter=_TargetPicker(), connect=ConnectOptions(retries=0))
        finally:
            await server.stop(None)
        return result.tokens

    tokens = asyncio.run(main())
    want = [1, 2, 3]
    for _ in range(5):
        want.append(target_next(want))
    assert tokens == want[3:]
    first, *again = received
    assert (first.start, first.tokens) == (3, tuple(want[3:7]))  # up to the draft end
    assert [(chunk.start, chunk.tokens) for chunk in again] == [(4, tuple(want[4:7]))]


def test_threads_0_is_one_per_core_the_process_may_run_on(tiny, monkeypatch) -> None:
    """ONNX Runtime's own default (0) starts a thread per core of the machine, however few the
    process may run on: two on one core under taskset, four in a one-CPU container on a Pi."""
    from specsplit.edge import drafter as drafter_mod

    monkeypatch.setattr(drafter_mod.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert OnnxDrafter(tiny.draft_dir, threads=0)._session.get_session_options().intra_op_num_threads == 1
    monkeypatch.setattr(drafter_mod.os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert OnnxDrafter(tiny.draft_dir, threads=0)._session.get_session_options().intra_op_num_threads == 3
    assert OnnxDrafter(tiny.draft_dir, threads=2)._session.get_session_options().intra_op_num_threads == 2


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_nothing_is_drafted_past_a_drafted_end_token(tiny, server, mode) -> None:
    """Past an end-of-sequence or stop id no draft is of use: accepted, the generation ends
    there; rejected, the line is cut before it. The edge drafted on to its window all the same,
    and the server verified those drafts. A sync round ends at it, short of k."""
    ids = EdgeTokenizer(tiny.draft_dir).encode("def add(a, b):")
    want = reference(str(tiny.target_dir), ids, 24)
    stop = next(t for t in range(300, 0, -1) if t not in want)  # never the target's: always rejected
    asked: list[list[int]] = []

    class EveryThirdStops:
        def next_token(self, trajectory) -> int:  # type: ignore[no-untyped-def]
            asked.append(list(trajectory))
            return stop if len(trajectory) % 3 == 0 else 7

    cfg = EdgeConfig(mode=mode, k=4, window=8, max_new_tokens=24, stop_ids=(stop,), branch_tokens=0)
    result = asyncio.run(generate(server, ids, cfg, drafter=EveryThirdStops(), connect=ConnectOptions(retries=0),
                                  fingerprint=EdgeTokenizer(tiny.draft_dir).fingerprint))
    assert result.tokens == want
    assert any(t[-1] == 7 for t in asked) and any(len(t) % 3 == 0 for t in asked)  # it drafted up to stops
    assert not [t for t in asked if t[-1] == stop], "drafted past a drafted stop id"
