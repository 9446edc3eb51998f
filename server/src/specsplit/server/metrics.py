"""Prometheus metrics of the server (prometheus-client), served on their own port."""
from __future__ import annotations

import errno
import socket

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from specsplit.common.address import bracketed
from specsplit.protocol import errors
from specsplit.protocol.messages import DoneReason
from specsplit.server.listeners import BindError, bind_addresses

# Label values known in advance start at 0, so that rate() and absence alerts see a series
# from the start rather than none until the first event.


def _statuses(cls: type[errors.ProtocolError]) -> set[str]:
    return {cls.status}.union(*(_statuses(sub) for sub in cls.__subclasses__()))


# The statuses the server ends calls with: the protocol's errors', the token check's, and a
# failed verification's.
ERROR_CODES = tuple(sorted(_statuses(errors.ProtocolError) | {"UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL"}))
# How sessions end: as their Done says, or without one (service.py).
END_REASONS = (*(r.name.lower() for r in DoneReason), "disconnected", "stalled", "shutdown", "error")
REFUSALS = ("full", "draining")
IDLE_ENDS = ("timeout", "limit")


class ServerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry or CollectorRegistry()
        self.registry = r
        if registry is None:  # the process' own series (memory, CPU, open files, start time, GC), as usual
            for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
                r.register(collector)
        self.sessions_active = Gauge("specsplit_sessions_active", "Sessions currently open", registry=r)
        self.sessions_total = Counter("specsplit_sessions", "Sessions opened", registry=r)
        self.sessions_limit = Gauge("specsplit_sessions_limit", "Sessions the server holds at most (--max-sessions)",
                                    registry=r)
        self.sessions_ended = Counter("specsplit_sessions_ended", "Sessions ended, by reason: how their Done said "
                                      "(eos, stop, length, context, cancelled), or disconnected (the edge went "
                                      "away), stalled (the edge stopped reading), shutdown (the drain's grace ran "
                                      "out), error", ["reason"], registry=r)
        self.sessions_refused = Counter("specsplit_sessions_refused", "Opens refused: the server held its limit "
                                        "(full) or was draining", ["reason"], registry=r)
        self.streams_idle = Gauge("specsplit_streams_idle", "Streams open between sessions, for their device's "
                                  "next generation", registry=r)
        self.idle_streams_ended = Counter("specsplit_idle_streams_ended", "Streams ended between sessions by the "
                                          "server: idle too long (timeout) or too many idle (limit)", ["reason"],
                                          registry=r)
        self.tokens_committed = Counter("specsplit_tokens_committed", "Tokens committed", registry=r)
        self.drafts_proposed = Counter("specsplit_drafts_proposed", "Drafts judged by verifications, as their "
                                       "verdicts count them (drafts past the generation's end are not)", registry=r)
        self.drafts_accepted = Counter("specsplit_drafts_accepted", "Drafts accepted", registry=r)
        self.branches_verified = Counter(
            "specsplit_branches_verified", "Edge branches verified in the same pass as the draft they replaced",
            registry=r,
        )
        self.sessions_paced = Counter(
            "specsplit_sessions_paced", "Places in a pass that sessions ahead of --pace-tokens-per-s gave up", registry=r
        )
        self.verify_seconds = Histogram(
            "specsplit_verification_seconds", "Target pass time, one observation per pass (however many sessions "
            "it verifies)", registry=r,
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10),
        )
        self.verify_drafts = Histogram(
            "specsplit_verification_drafts", "Drafts fed per session per pass", registry=r,
            buckets=(0, 1, 2, 4, 8, 16, 24, 32, 48, 64),
        )
        self.batch_sessions = Histogram(
            "specsplit_verification_batch_sessions", "Sessions per target pass", registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),  # a GPU server's passes hold hundreds
        )
        self.batch_tokens = Histogram(
            "specsplit_verification_batch_tokens",
            "Tokens per forward pass of the target, padding included (a batch fed as several passes, a long prompt "
            "ahead or a cache split, counts each)", registry=r,
            buckets=(1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
        )
        # Everything the server does for its streams waits in the event loop's queue: a late
        # loop is a late Open, draft and verdict alike (loop_lag.py).
        self.loop_lag = Histogram(
            "specsplit_event_loop_lag_seconds", "How late the event loop ran a timer that was due", registry=r,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
        )
        self.outbox_depth = Gauge("specsplit_outbox_depth", "Messages queued to edges, all sessions", registry=r)
        self.kv_bytes = Gauge("specsplit_kv_cache_bytes", "KV cache memory held by sessions", registry=r)
        self.prefix_cache_hits = Counter("specsplit_prefix_cache_hits", "Sessions started from the keys and values "
                                         "of a prompt prefix another prompt shares (--prefix-cache-mb)", registry=r)
        self.prefix_cache_tokens = Counter("specsplit_prefix_cache_tokens", "Prompt positions taken from the "
                                           "prefix cache instead of computed", registry=r)
        self.errors = Counter("specsplit_errors", "Calls ended with an error, by gRPC status (token refusals "
                              "included)", ["code"], registry=r)
        for counter, values in ((self.errors, ERROR_CODES), (self.sessions_ended, END_REASONS),
                                (self.sessions_refused, REFUSALS), (self.idle_streams_ended, IDLE_ENDS)):
            for value in values:
                counter.labels(value)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve the metrics on every address of `host` that can be bound, as gRPC serves: the
        HTTP server binds only the first (localhost: ::1 alone where that comes first, and a
        scraper of 127.0.0.1 found nothing)."""
        where = f"{bracketed(host)}:{port}"
        try:
            infos = bind_addresses(host, port)
        except socket.gaierror as exc:
            raise BindError(f"could not serve the metrics on {where}: {exc.strerror}") from None
        served, failed = 0, None
        for address in dict.fromkeys(info[4][0] for info in infos):
            try:
                start_http_server(port, addr=address, registry=self.registry)
                served += 1
            except OSError as exc:
                if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):  # a family this machine has off
                    # Taken since the start's check, say: a scraper of that address would find
                    # nothing, or another process's metrics.
                    raise BindError(f"could not serve the metrics on {bracketed(address)}:{port}: "
                                    f"{exc.strerror or exc}") from None
                failed = exc
        if not served:
            raise BindError(f"could not serve the metrics on {where}: {failed}")
