"""Hypothesis-generated streams (valid, invalid and random bytes) against a running server:
it never crashes, never hangs a stream, never leaks a session, and a well-behaved session
still gets the target's output afterwards."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import free_port, launch_server
from specsplit.edge.client import EdgeConfig
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.protocol.hashing import HashedSequence
from specsplit.v1 import specsplit_pb2 as pb
from test_end_to_end import reference
from test_reliability import FINGERPRINT, metric, raw_stream, run_edge, wait_for

ALLOWED = {None, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
           grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED}
ids = st.lists(st.integers(0, 400), min_size=0, max_size=12)

opens = st.builds(
    lambda p, n, t, top_p, k, mode, v, stop, fp: pb.EdgeMessage(open=pb.Open(
        prompt_ids=p, max_new_tokens=n, sampling=pb.Sampling(temperature=t, top_p=top_p, top_k=k, seed=3),
        draft_mode=mode, verification=v, stop_ids=stop, tokenizer_fingerprint=fp)).SerializeToString(),
    ids, st.integers(0, 12), st.sampled_from([0.0, 0.7, 1.0, -1.0, 1e9, float("nan")]),
    st.sampled_from([0.0, 0.5, 1.0, 2.0]), st.integers(0, 50), st.integers(0, 4), st.integers(0, 4),
    st.lists(st.integers(0, 400), max_size=2), st.sampled_from([FINGERPRINT, FINGERPRINT, "", "f" * 16]),
)
drafts = st.builds(
    lambda start, toks, h, q: pb.EdgeMessage(draft=pb.Draft(start=start, tokens=toks, parent_hash=h, dists=[
        pb.DraftDistribution(ids=[t], probs=[q]) for t in toks] if q else [])).SerializeToString(),
    st.integers(0, 80), ids, st.integers(0, 2**64 - 1), st.sampled_from([0.0, 0.5, 1.0, 7.0]),
)
messages = st.one_of(opens, drafts, st.just(pb.EdgeMessage(close=pb.Close()).SerializeToString()),
                     st.just(b""), st.binary(max_size=40))


@st.composite
def opened_streams(draw: st.DrawFn) -> list[bytes]:
    """An Open the server accepts, then fuzzed messages: drafts that follow the prompt (their
    hash right), drafts anywhere, closes, second Opens, bytes. Random Opens are nearly all
    refused (60 examples opened no session), so a live session's paths went untried."""
    prompt = draw(st.lists(st.integers(1, 299), min_size=1, max_size=12))
    temperature = draw(st.sampled_from([0.0, 0.7]))
    first = pb.EdgeMessage(open=pb.Open(
        prompt_ids=prompt, max_new_tokens=draw(st.integers(1, 12)), tokenizer_fingerprint=FINGERPRINT,
        sampling=pb.Sampling(temperature=temperature, top_p=draw(st.sampled_from([1.0, 0.5])), seed=3),
        draft_mode=draw(st.integers(0, 3)), stop_ids=draw(st.lists(st.integers(1, 299), max_size=2))))
    following = st.builds(
        lambda toks: pb.EdgeMessage(draft=pb.Draft(start=len(prompt), tokens=toks, parent_hash=HashedSequence(
            tuple(prompt)).hash_before(len(prompt)))).SerializeToString(),
        st.lists(st.integers(0, 319), min_size=1, max_size=8))
    rest = draw(st.lists(st.one_of(following, messages), max_size=5))
    return [first.SerializeToString(), *rest]


streams = st.one_of(st.lists(messages, max_size=6), opened_streams())


@pytest.fixture(scope="module")
def fuzz_server(tiny, tmp_path_factory):
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path_factory.mktemp("fuzz") / "server.log",
                       "--metrics-port", str(mport)) as (address, proc):
        yield address, f"127.0.0.1:{mport}", proc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=streams)
def _survives(fuzz_server, stream) -> None:
    address, _, proc = fuzz_server
    code, _ = raw_stream(address, stream, read=40, timeout=20)
    assert code in ALLOWED, code
    assert proc.poll() is None, "the server died"


def test_fuzzed_streams_neither_end_the_server_nor_leak_sessions(tiny, fuzz_server) -> None:
    address, metrics, _ = fuzz_server
    _survives(fuzz_server)
    assert metric(metrics, "specsplit_sessions_total") > 0  # the fuzzing reached live sessions
    assert wait_for(lambda: metric(metrics, "specsplit_sessions_active") == 0)
    assert metric(metrics, "specsplit_kv_cache_bytes") == 0
    prompt = EdgeTokenizer(tiny.draft_dir).encode("def add(a, b):")
    assert run_edge(address, tiny, prompt, EdgeConfig(max_new_tokens=30)).tokens == reference(
        str(tiny.target_dir), prompt, 30)
