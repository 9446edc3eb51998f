"""The edge's library entry point: `generate` runs one completion through a server, and
re-opens it, here or on the next server, after a lost server or stream (retry.py says when).
Each attempt drafts and streams on a call of its own or on a device's kept stream
(attempt.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import grpc

from specsplit.edge.attempt import Attempt, GenerationResult, Record
from specsplit.edge.config import MODES, ConfigError, ConnectOptions, EdgeConfig, token_ids
from specsplit.edge.drafter import Drafter
from specsplit.edge.failures import CallCancelled, OnCommitFailed, StreamEnded, StreamStalled
from specsplit.edge.retry import MAX_BACKOFF_S, describe, next_backoff, retry_delay, spread
from specsplit.edge.stats import GenerationStats
from specsplit.edge.stream import GenerateStream

# The library's names, importable from here as they always were.
__all__ = [
    "MODES", "CallCancelled", "ConfigError", "ConnectOptions", "EdgeConfig", "GenerationResult", "OnCommitFailed",
    "StreamEnded", "StreamStalled", "generate", "open_channel", "token_ids",
]

log = logging.getLogger(__name__)


def open_channel(address: str, connect: ConnectOptions) -> grpc.aio.Channel:
    options: list[tuple[str, int | str]] = [
        ("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000),
        # gRPC's minimum connect timeout (its MIN_CONNECT_TIMEOUT) goes by this name.
        ("grpc.min_reconnect_backoff_ms", round(connect.connect_timeout_s * 1000)),
        # gRPC waits between its own connection attempts (1 s growing to 120 s by default), and
        # a call made meanwhile fails at once: a retry at the edge's backoff would find the
        # server back up yet not try it. At half the edge's backoff, jitter and all, gRPC's
        # wait has ended when the edge retries.
        ("grpc.initial_reconnect_backoff_ms", max(1, round(connect.backoff_s * 500))),
        ("grpc.max_reconnect_backoff_ms", round(MAX_BACKOFF_S * 500)),
    ]
    if connect.tls_server_name:
        options.append(("grpc.ssl_target_name_override", connect.tls_server_name))
    if connect.credentials is not None:
        return grpc.aio.secure_channel(address, connect.credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


async def generate(
    via: str | Sequence[str] | grpc.aio.Channel | GenerateStream,
    prompt_ids: Sequence[int],
    cfg: EdgeConfig,
    drafter: Drafter | None = None,
    fingerprint: str = "",
    draft_model: str = "",
    committed_ids: Sequence[int] = (),
    on_commit: Callable[[list[int]], None] | None = None,
    connect: ConnectOptions = ConnectOptions(),
) -> GenerationResult:
    """Generate one completion of `prompt_ids` through a server. A lost server or stream
    costs only time: the generation is re-opened with everything committed so far, so the
    final text is the same.

    `via` says where: a server's host:port, or a list to fail over along, each attempt on a
    connection of its own; a channel, every attempt on a call of its own on it; or a device's
    kept GenerateStream (stream.py), which the generation runs on and leaves open for the
    device's next one, a retry going to the stream's next server; a stream carries one
    generation at a time. `committed_ids`: tokens already generated after the prompt (a
    generation resumed elsewhere), which the server takes as committed. `on_commit` gets
    the whole generated list after each verdict. A drafter may be shared by generations
    running at once: correct, but their drafting steps take turns and share its caches, so
    a drafter each is faster.

    Raises ValueError (ConfigError for settings) before any call for what no server would
    take; grpc.aio.AioRpcError with the server's status (refused, or the stream lost and the
    retries spent), StreamStalled (no message for the stall timeout, retries spent; its
    code() is UNAVAILABLE) or ConnectionError (the call ended before Done, retries spent);
    OnCommitFailed where `on_commit` raised; CallCancelled where the caller cancelled the call
    (GenerateStream.abort, its channel closed) while it ran; ProtocolError where the server
    broke the protocol; RuntimeError for a stream carrying another generation."""
    if isinstance(via, str):
        via = [via]
    if not isinstance(via, (grpc.aio.Channel, GenerateStream)) and not via:
        raise ValueError("generate needs a server address")
    prompt_ids, committed = token_ids(prompt_ids, "prompt_ids"), token_ids(committed_ids, "committed_ids")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: a generation needs a prompt")
    for name, value in (("draft_model", draft_model), ("fingerprint", fingerprint)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {value!r}")
    if isinstance(via, Sequence):
        connect.check_servers(len(via))
    servers = via.servers if isinstance(via, GenerateStream) else 1 if isinstance(via, grpc.aio.Channel) else len(via)
    record = Record(GenerationStats(mode=cfg.mode), resumed=len(committed))
    # --retries bounds the re-opens in a row that commit nothing, and the backoff starts over
    # after an attempt that committed something: a long generation over a link that drops
    # now and then must not run out of retries, nor wait 8 s after each drop, for the drops
    # it already came through. Each re-open that goes on commits a token, so this ends.
    backoff, failures, reopens = connect.backoff_s, 0, 0
    # A kept stream is the generation's from its first attempt to its last: another one
    # taking it during a retry's backoff would leave the retry nothing to re-open on.
    with via.carrying() if isinstance(via, GenerateStream) else contextlib.nullcontext():
        while True:
            gen = Attempt(drafter, prompt_ids, cfg, fingerprint, draft_model, committed, on_commit, record, connect)
            try:
                if isinstance(via, GenerateStream):
                    result = await gen.run(via)
                elif isinstance(via, grpc.aio.Channel):
                    result = await _on_own_call(gen, via)
                else:
                    async with open_channel(via[reopens % len(via)], connect) as ch:
                        result = await _on_own_call(gen, ch)
                result.stats.reconnects = reopens
                return result
            except (grpc.aio.AioRpcError, StreamStalled, ConnectionError) as exc:
                if gen.edge is not None and len(gen.edge.generated) > len(committed):
                    committed = gen.edge.generated  # includes what earlier attempts committed
                    backoff, failures = connect.backoff_s, 0
                least = retry_delay(exc, backoff, servers)
                if least is None or failures == connect.retries:
                    raise
                failures += 1
                reopens += 1
                delay = spread(least)
                if isinstance(via, GenerateStream):
                    via.fail_over()
                # A retry can take seconds (backoff doubles up to 8 s): say so, or a device looks hung.
                hint = connect.hint(exc.details() or "").strip() \
                    if connect.hint is not None and isinstance(exc, grpc.aio.AioRpcError) else ""
                log.warning("generation interrupted (%s); re-opening it in %.1f s (retry %d of %d in a row)%s",
                            describe(exc), delay, failures, connect.retries, f" {hint}" if hint else "")
                await asyncio.sleep(delay)
                backoff = next_backoff(backoff)


async def _on_own_call(gen: Attempt, channel: grpc.aio.Channel) -> GenerationResult:
    """A generation on a call that ends with it: half-closed after its Done."""
    stream = GenerateStream.on(channel)
    result = await gen.run(stream)
    stream.close()
    return result
