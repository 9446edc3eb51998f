"""The shared-prefix cache: a session whose prompt begins as another prompt did starts from
that prompt's keys and values, and gets the rows (and the output) it gets computing them."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from specsplit.edge.client import EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.server.engine import TargetEngine, VerifyItem
from specsplit.server.loading import LoadedModel, cpu_has_fast_bf16, load_model
from specsplit.server.prefix_cache import MAX_ENTRIES, MIN_SHARED, PrefixCache
from specsplit.server.row_invariant import make_rows_invariant
from conftest import free_port, launch_server
from test_end_to_end import reference
from test_reliability import metric
from test_row_invariant import _model

SHARED = list(range(10, 30))  # 20 tokens, a system turn's worth
A, B = SHARED + [40, 41, 42], SHARED + [50, 51, 52, 53, 54]


def _kv(positions: int, fill: float) -> torch.Tensor:
    return torch.full((2, 2, 1, positions, 4), fill)


def test_a_prompt_takes_what_it_shares_with_another_prompt() -> None:
    cache = PrefixCache(max_bytes=1 << 20)
    cache.keep(A, torch.arange(len(A), dtype=torch.float32)[:, None].expand(2, 2, 1, len(A), 4).contiguous())
    shared, kv = cache.lookup(B)
    assert shared == len(SHARED) and kv is not None
    assert kv.shape[3] == len(SHARED) and kv[0, 0, 0, :, 0].tolist() == list(range(len(SHARED)))
    assert cache.lookup(A) == (0, None)  # its own keys: only what others share is taken
    assert cache.lookup(SHARED[: MIN_SHARED - 1] + [99] * 10) == (0, None)  # too little in common
    # A prompt that is all shared still feeds its last token: the row after it needs it fed.
    assert cache.lookup(SHARED)[0] == len(SHARED) - 1
    kv[:] = -1  # a copy: the session's cache is its own
    assert cache.lookup(B)[1][0, 0, 0, 0, 0] == 0  # type: ignore[index]


def test_the_cache_keeps_to_its_memory_and_drops_the_least_recently_used() -> None:
    one = _kv(len(A), 0.0).untyped_storage().nbytes()
    cache = PrefixCache(max_bytes=2 * one)
    cache.keep(A, _kv(len(A), 1.0))
    cache.keep([7] * len(A), _kv(len(A), 2.0))
    assert cache.lookup(B)[0] == len(SHARED)  # A is used: the other one is now the oldest
    cache.keep([8] * len(A), _kv(len(A), 3.0))
    assert cache.nbytes == 2 * one
    assert cache.lookup([7] * len(A) + [1])[0] == 0  # dropped
    assert cache.lookup(B)[0] == len(SHARED)
    cache.keep(A, _kv(len(A), 4.0))  # kept again: replaced, not counted twice
    assert cache.nbytes == 2 * one
    assert PrefixCache(max_bytes=one - 1).lookup(B) == (0, None)
    many = PrefixCache(max_bytes=1 << 30)
    for i in range(MAX_ENTRIES + 5):
        many.keep([1000 + i] * 10, _kv(10, 0.0))
    assert many.nbytes == MAX_ENTRIES * _kv(10, 0.0).untyped_storage().nbytes()


def _rows_for_b(engine: TargetEngine, drafts: list[int]) -> tuple[int, list[np.ndarray]]:
    """(positions B's session took from the cache, its rows over two passes) after A's prefill."""
    engine.verify_batch([VerifyItem(engine.new_state(A), A, [])])
    state = engine.new_state(B)
    seeded = len(state.tokens)
    first = engine.verify_batch([VerifyItem(state, B, drafts)])[0]
    second = engine.verify_batch([VerifyItem(state, B + drafts[:2], [61, 62])])[0]
    return seeded, [first, second]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@torch.inference_mode()
def test_a_session_from_a_shared_prefix_gets_the_rows_it_computes(tiny, dtype) -> None:
    """Row-invariant, as a CPU target is loaded: the same bits (fp32 on the tiny model, bf16 on
    a model as wide as the default target)."""
    if dtype == "bf16":
        if not cpu_has_fast_bf16():
            pytest.skip("the CPU has no native bf16")
        model = _model()
        make_rows_invariant(model)
        loaded = LoadedModel(model, None, "test")  # type: ignore[arg-type]
    else:
        loaded = load_model(str(tiny.target_dir))
    drafts = [70, 71, 72, 73]
    seeded, rows = _rows_for_b(TargetEngine(loaded, prefix_cache_bytes=1 << 26), drafts)
    assert seeded == len(SHARED)
    fresh = TargetEngine(loaded)
    state = fresh.new_state(B)
    assert not state.tokens  # no cache
    want = [fresh.verify_batch([VerifyItem(state, B, drafts)])[0],
            fresh.verify_batch([VerifyItem(state, B + drafts[:2], [61, 62])])[0]]
    for got, expected in zip(rows, want):
        assert np.array_equal(got, expected)


def test_sessions_through_a_server_start_from_the_prefix_they_share(tiny, tmp_path) -> None:
    """Prompts with a common beginning through a real server: each output is the target's
    own, and every session after the first takes the shared positions from the cache, a
    repeated prompt no more than that."""
    tok = EdgeTokenizer(tiny.draft_dir)
    system = tok.encode("You are a careful assistant. Answer briefly and exactly. ")
    prompts = [system + tok.encode(p) for p in ("def add(a, b):", "The quick brown fox", "def add(a, b):")]
    shared = len(system)
    assert shared >= MIN_SHARED
    mport = free_port()
    with launch_server(tiny.target_dir, tmp_path / "server.log", "--metrics-port", str(mport)) as (address, _):
        metrics, taken = f"127.0.0.1:{mport}", []
        for i, ids in enumerate(prompts):
            cfg = EdgeConfig(mode="async" if i % 2 == 0 else "none", max_new_tokens=12, window=8)
            drafter = OnnxDrafter(tiny.draft_dir) if cfg.mode != "none" else None
            result = asyncio.run(generate(address, ids, cfg, drafter=drafter, fingerprint=tok.fingerprint))
            assert result.tokens == reference(str(tiny.target_dir), ids, cfg.max_new_tokens), i
            taken.append(metric(metrics, "specsplit_prefix_cache_tokens_total"))
        assert taken == [0, shared, 2 * shared]
        assert metric(metrics, "specsplit_prefix_cache_hits_total") == 2
