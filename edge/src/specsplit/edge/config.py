"""What an edge generation runs with: its settings (EdgeConfig), how it reaches its servers
(ConnectOptions), and the checks that refuse, before any call, what no server would take."""
from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from specsplit.common.values import real as _real
from specsplit.common.values import whole as _whole
from specsplit.edge.drafter import BRANCHES as MAX_BRANCHES
from specsplit.protocol.messages import MAX_DIST_IDS, MAX_STOP_IDS, DraftMode, SamplingParams, VerificationMode

MODES = {"async": DraftMode.ASYNC, "sync": DraftMode.SYNC, "none": DraftMode.NONE}


class ConfigError(ValueError):
    """A setting no generation can run with; `field` names it (`EdgeConfig`, `ConnectOptions`;
    a sampling setting as `sampling.top_p`, say)."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name} {problem}")
        self.field = field_name
        self.problem = problem


# EdgeConfig's whole-number settings and their least values.
_AT_LEAST = {"window": 1, "k": 1, "branch_tokens": 0, "max_new_tokens": 1, "sparse_top_k": 1}


MAX_CONNECT_TIMEOUT_S = 3600.0  # gRPC takes it in whole milliseconds, as a C int


@dataclass(frozen=True)
class ConnectOptions:
    credentials: grpc.ChannelCredentials | None = None  # TLS (and mutual TLS) when set
    # The name the server's certificate must hold, where the address dialled is another (an IP address)
    tls_server_name: str | None = None
    token: str | None = None  # bearer token sent as `authorization` metadata
    # No message for this long: the stream is treated as dead (the first verdict, which waits on
    # the prompt's prefill, may take attempt.PREFILL_ALLOWANCE_S more per prompt token).
    stall_timeout_s: float | None = 60.0
    # A connection (TCP, TLS, HTTP/2 settings) not made in this long fails the attempt, which is
    # then retried. gRPC's own is 20 s: an address that takes TCP but never answers (a port of
    # something else, a black-holed path) cost 20 s an attempt, over 5 minutes at 12 retries.
    connect_timeout_s: float = 10.0
    # Re-opens in a row after a lost server or stream, cycling through the addresses given; an
    # attempt that committed tokens starts the count (and the backoff) over. Twelve wait 71.5 s
    # at the least: a restarted server's time to load the default target, with room to spare.
    retries: int = 12
    backoff_s: float = 0.5  # doubled after each failed attempt, up to retry.MAX_BACKOFF_S; back to this after progress
    # A failed call's details -> which setting to look at ("" for none), added to each retry's
    # warning: a TLS setting that does not match the server's fails as a lost server does
    # (the command line's TLS hint; the library knows no flags).
    hint: Callable[[str], str] | None = None

    def __post_init__(self) -> None:
        # gRPC metadata carries printable ASCII only; any other token fails every call with
        # INTERNAL, which would be retried as if the server were lost.
        if self.token is not None and not (self.token and self.token.isascii() and self.token.isprintable()):
            raise ConfigError("token", "must be printable ASCII, without line ends")
        if not _whole(self.retries) or self.retries < 0:
            raise ConfigError("retries", f"must be a whole number, 0 or more, got {self.retries!r}")
        if self.stall_timeout_s is not None and (not _real(self.stall_timeout_s)
                                                 or not 0 < self.stall_timeout_s < math.inf):
            raise ConfigError("stall_timeout_s", f"must be above 0, got {self.stall_timeout_s!r}")
        if not _real(self.connect_timeout_s) or not 0.1 <= self.connect_timeout_s <= MAX_CONNECT_TIMEOUT_S:
            raise ConfigError("connect_timeout_s", f"must be from 0.1 to {MAX_CONNECT_TIMEOUT_S:g} s, "
                              f"got {self.connect_timeout_s!r}")
        if not _real(self.backoff_s) or not 0 <= self.backoff_s < math.inf:
            raise ConfigError("backoff_s", f"must be 0 or more, got {self.backoff_s!r}")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call carries: the bearer token, where there is one."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def check_servers(self, servers: int) -> None:
        """ConfigError unless the attempts reach every one of `servers` failed over along."""
        if servers > self.retries + 1:
            raise ConfigError("retries", f"{self.retries} leaves no attempt for the last of the {servers} servers "
                              f"(a failover is a retry): give {servers - 1} or more")


@dataclass(frozen=True)
class EdgeConfig:
    mode: str = "async"
    window: int = 32  # async: how far ahead of the committed point to draft (with adaptive_window: at most)
    adaptive_window: bool = True  # async: size the lookahead from the acceptance seen so far (lookahead.py)
    k: int = 4  # sync: drafts per round
    branch_tokens: int = 8  # async, greedy: the longest branch drafted beside the main line (0: none)
    # async, greedy: how many branches may be open beside the main line at once. Two ran 1.012x
    # and 0.988x one in two side-by-side runs (docs/benchmarks.md): no gain for the edge's extra work.
    branches: int = 1
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    verification: VerificationMode | None = None
    sparse_top_k: int = 8
    stop_ids: tuple[int, ...] = ()
    timeline: bool = False  # record drafting, sends and verdicts with timestamps

    def __post_init__(self) -> None:
        """ConfigError, naming the field, for a value no generation can run with: found here
        rather than by the server, a round trip later, or deep in the encoding."""
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {sorted(MODES)}, got {self.mode!r}")
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            if not _whole(value) or value < least:
                raise ConfigError(name, f"must be a whole number of at least {least}, got {value!r}")
        if self.max_new_tokens >= 2**32:  # the protocol's uint32
            raise ConfigError("max_new_tokens", f"must be below 2**32, got {self.max_new_tokens}")
        if not _whole(self.branches) or not 0 <= self.branches <= MAX_BRANCHES:
            raise ConfigError("branches", f"must be 0 (none) to {MAX_BRANCHES}, the branches the drafter keeps "
                              f"caches for, got {self.branches!r}")
        try:
            token_ids(self.stop_ids, "stop_ids")
        except ValueError as exc:
            raise ConfigError("stop_ids", str(exc).removeprefix("stop_ids ")) from None
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ConfigError("stop_ids", f"may hold at most {MAX_STOP_IDS} ids, got {len(self.stop_ids)}")
        if self.sparse_top_k > MAX_DIST_IDS:
            raise ConfigError("sparse_top_k", f"must be at most {MAX_DIST_IDS}, got {self.sparse_top_k}")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError("sampling", f"must be a SamplingParams, got {self.sampling!r}")
        if problem := self.sampling.problem():  # the server's own rules
            raise ConfigError(f"sampling.{problem[0]}", problem[1])
        if self.verification is not None and not isinstance(self.verification, VerificationMode):
            raise ConfigError("verification", f"must be a VerificationMode or None, got {self.verification!r}")
        if self.verification is not None and (self.verification is VerificationMode.GREEDY) != self.sampling.greedy:
            name = self.verification.name.lower().replace("_", "-")
            raise ConfigError("verification", "greedy is for temperature 0; sampled output takes match or sparse-q"
                              if self.verification is VerificationMode.GREEDY
                              else f"{name} verifies sampled output: give a temperature above 0")



def token_ids(ids: Sequence[int], name: str) -> list[int]:
    """`ids` as a list of ints (a tokenizer's numpy integers too); ValueError naming `name`
    for anything that is not a token id, found before the protobuf encoding would be."""
    ids = list(ids)  # looked at twice below: an iterator would be spent by the first look
    try:
        out = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name} must be token ids (whole numbers), got {ids!r:.80}") from None
    if any(isinstance(t, bool) for t in ids):
        raise ValueError(f"{name} must be token ids (whole numbers), got a bool")
    if bad := [t for t in out if not 0 <= t < 2**32]:
        raise ValueError(f"{name} must be token ids (0 to 2**32 - 1), got {bad[0]}")
    return out
