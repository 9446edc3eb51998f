"""The server's settings, as serve takes them: no torch, so that the command line can take its
defaults from here and check them before a model loads."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.server.listeners import MAX_MESSAGE_BYTES, WILDCARD_HOSTS

IDLE_POLICIES = ("adaptive", "ar", "wait")
# Free places a session's outbox needs before a pass takes it: the pass's Verdict and Done,
# and one more the stream's reader may queue meanwhile (its half-close, or an error).
OUTBOX_ROOM = 3
# The least --max-message-bytes: an Open of a short prompt and the server's Opened fit well within it.
MIN_MESSAGE_BYTES = 1024


class ConfigError(ValueError):
    """A setting the server cannot run with; `field` names it (a field of SchedulerConfig or
    ServeConfig), `problem` says what it must be, `value` is what it was."""

    def __init__(self, field_name: str, problem: str, value: object) -> None:
        super().__init__(f"{field_name} {problem}, got {value!r}")
        self.field = field_name
        self.problem = problem
        self.value = value


def _check_ranges(cfg: object, at_least_one: tuple[str, ...] = (), not_negative: tuple[str, ...] = (),
                  positive: tuple[str, ...] = ()) -> None:
    """ConfigError for the first of these fields out of its range. Written so that NaN, which
    every comparison fails, fails them too (a NaN switch interval aborted Python)."""
    for names, ok, problem in ((at_least_one, lambda v: v >= 1, "must be at least 1"),
                               (not_negative, lambda v: 0 <= v < math.inf, "must be 0 or more"),
                               (positive, lambda v: 0 < v < math.inf, "must be above 0")):
        for name in names:
            value = getattr(cfg, name)
            if not ok(value):
                raise ConfigError(name, "must be finite" if value == math.inf else problem, value)


@dataclass(frozen=True)
class SchedulerConfig:
    max_verify_tokens: int = 24  # drafts one verification may take from a session
    max_batch_sessions: int = 32  # sessions one target pass may verify (rows, where feeds are split)
    max_batch_tokens: int = 512  # padded tokens one pass may take (a longer prefill runs alone)
    adaptive: bool = True  # pick how many drafts to verify from acceptance and measured pass times
    # Async sessions short of candidates: "adaptive" waits for drafts on their way when that
    # pays (up to max_wait_s), "ar" verifies or steps at once, "wait" waits idle_wait_s first.
    idle_policy: str = "adaptive"
    idle_wait_s: float = 0.02
    max_wait_s: float = 0.5
    # An edge that stops reading fills its outbox; after this long it is cut off and its
    # session and KV cache are freed.
    stalled_edge_s: float = 30.0
    # A sync session's server waits for its drafts and steps alone never: one whose edge sends
    # none for this long after its Open or last verdict is ended (DEADLINE_EXCEEDED), or it
    # would hold its place under --max-sessions for good. Long: a slow device's first drafts
    # follow its own pass over a long prompt.
    sync_draft_timeout_s: float = 300.0
    outbox_size: int = 64
    # Tokens/s each session should get (an SLO; 0: no pacing). While some session with a full
    # window of history commits slower than this, those ahead of it sit passes out (_pace).
    pace_tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        _check_ranges(self, at_least_one=("max_verify_tokens", "max_batch_sessions", "max_batch_tokens"),
                      not_negative=("idle_wait_s", "max_wait_s", "pace_tokens_per_s"), positive=("stalled_edge_s", "sync_draft_timeout_s"))
        if self.idle_policy not in IDLE_POLICIES:
            raise ConfigError("idle_policy", f"must be one of {IDLE_POLICIES}", self.idle_policy)
        if not self.outbox_size > OUTBOX_ROOM:  # no session would ever be verified (0 is no bound at all)
            raise ConfigError("outbox_size", f"must be above {OUTBOX_ROOM}", self.outbox_size)


@dataclass(frozen=True)
class TLSConfig:
    cert: Path
    key: Path
    client_ca: Path | None = None  # set: mutual TLS, clients must present a certificate it signed

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca else None,
            require_client_auth=self.client_ca is not None,
        )


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_sessions: int = 64
    max_lookahead: int = 64
    max_context: int | None = None  # None: the target's position limit
    max_new_tokens: int = 4096
    max_message_bytes: int = 1 << 20
    grace_s: float = 10.0
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: the serving host
    tls: TLSConfig | None = None
    tokens: dict[str, str] | None = None  # token -> device id (auth.load_tokens); None: no tokens asked
    # Keepalive: a vanished edge is noticed within about keepalive_s + keepalive_timeout_s.
    keepalive_s: float = 20.0
    keepalive_timeout_s: float = 10.0
    # After a session's Done, how long the stream stays open for the device's next Open (its next
    # generation, without a new call) or its half-close; and how long a new stream may take to
    # send its first Open. Ending it sooner while the edge still
    # writes its last drafts would fail those writes and, with them, the call at the edge: a busy
    # edge (a load generator of many sessions on one core) took more than 5 s to read its Done.
    idle_stream_s: float = 30.0
    # Streams idle between sessions held at once; past it the longest idle is ended (idle_streams.py).
    max_idle_streams: int = 1024
    # gRPC servers on the port (listeners.py): with 384 devices starting generations on one GPU
    # server, a call waited 1.4 s (p90) for its Opened with one, 0.26 s with four
    # (docs/capacity.md). Every server shares the one worker.
    listeners: int = 4
    model_name: str | None = None  # what edges see in Opened; None: the target's own name (sources.served_name)

    def __post_init__(self) -> None:
        """Checked here, where serve's command line builds this before the model loads: a
        setting the server cannot run with, or runs refusing every session with, shows at once."""
        _check_ranges(self, at_least_one=("max_sessions", "max_lookahead", "max_new_tokens", "listeners"),
                      not_negative=("grace_s", "max_idle_streams"),
                      positive=("keepalive_s", "keepalive_timeout_s", "idle_stream_s"))
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", "must be 0 (any free port) to 65535", self.port)
        if self.max_context is not None and not self.max_context >= 2:  # below, no prompt leaves room for a token
            raise ConfigError("max_context", "must be at least 2, a one-token prompt and one new token (or unset: "
                              "the target's)", self.max_context)
        # gRPC's limits are C ints; below the floor not even a short Open or its Opened would fit.
        if not MIN_MESSAGE_BYTES <= self.max_message_bytes <= MAX_MESSAGE_BYTES:
            raise ConfigError("max_message_bytes", f"must be {MIN_MESSAGE_BYTES} to {MAX_MESSAGE_BYTES}",
                              self.max_message_bytes)
        if self.metrics_host is not None and self.metrics_port is None:
            raise ConfigError("metrics_host", "places the metrics: give a metrics port too", self.metrics_host)
        if self.metrics_port is not None and not 1 <= self.metrics_port <= 65535:
            raise ConfigError("metrics_port", "must be a port from 1 to 65535", self.metrics_port)
        if self.metrics_port == self.port and self._metrics_share_an_address():
            raise ConfigError("metrics_port", "must be other than the serving port where the metrics bind the "
                              "serving host (or either host is a wildcard)", self.metrics_port)

    def _metrics_share_an_address(self) -> bool:
        """Whether the metrics' host and the serving host may bind one address: the same name, or
        either a wildcard. Two names of one address (localhost and 127.0.0.1) pass here and fail
        at the bind, in a line of its own."""
        if self.metrics_host is None:
            return True
        hosts = {self.host.strip("[]"), self.metrics_host.strip("[]")}
        return len(hosts) == 1 or bool(hosts & WILDCARD_HOSTS)


def resolve_engine(engine: str, device: str) -> str:
    """`--engine auto` as serve takes it: CUDA graphs need the static engine; on a CPU only the
    dynamic one is exact."""
    if engine != "auto":
        return engine
    return "static" if device == "cuda" else "dynamic"
