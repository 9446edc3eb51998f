"""How the load generator reaches the server: its address, TLS files and bearer token.

Plain values, so that a point's spec can cross to worker processes: gRPC's credentials
cannot be pickled, so every process builds its own from the files."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import grpc

from specsplit.common.tls import client_credentials
from specsplit.edge.client import ConnectOptions

CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # gRPC shares connections between channels to one address; each edge is its own device.
    ("grpc.use_local_subchannel_pool", 1),
]


@functools.lru_cache(maxsize=None)
def _credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """Read and checked once per process, not once per session: a check builds SSL contexts,
    about a millisecond of the event loop that runs the sessions."""
    return client_credentials(ca, cert, key)


@dataclass(frozen=True)
class ServerEndpoint:
    address: str  # host:port
    tls_ca: str | None = None  # with it (or a client certificate): TLS, else plaintext
    tls_cert: str | None = None  # client certificate and key, for mutual TLS
    tls_key: str | None = None
    token: str | None = None  # bearer token, for servers started with --tokens-file

    def check(self) -> None:
        """ValueError naming the option (--tls-ca, ..., $SPECSPLIT_TOKEN) for settings no
        call could use: files that are missing or not PEM, a certificate without its key,
        a token gRPC cannot carry."""
        _credentials(self.tls_ca, self.tls_cert, self.tls_key)
        try:
            self.connect_options()
        except ValueError as exc:
            raise ValueError(f"$SPECSPLIT_TOKEN {getattr(exc, 'problem', exc)}") from None

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    def reachable(self, timeout_s: float) -> bool:
        """Whether a connection to the server (TCP, TLS and HTTP/2 set up) is made within
        `timeout_s`: no call is made, so a busy server still answers."""
        with self._dial(grpc) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=timeout_s)
            except grpc.FutureTimeoutError:
                return False
        return True

    def channel(self) -> grpc.aio.Channel:
        """A channel of its own (its own connection, as a separate device would have)."""
        return self._dial(grpc.aio)

    def _dial(self, api: Any) -> Any:
        """A channel from `api` (grpc, or grpc.aio: the same calls), plaintext or TLS as set."""
        credentials = _credentials(self.tls_ca, self.tls_cert, self.tls_key)
        if credentials is None:
            return api.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        return api.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)

    def connect_options(self) -> ConnectOptions:
        """No retries: a load test counts a failed generation instead of hiding it."""
        return ConnectOptions(token=self.token, retries=0)

    def describe(self) -> str:
        """For a report: how it was reached, never the files' paths or the token."""
        security = ("mutual TLS" if self.tls_cert else "TLS") if self.tls else "plaintext"
        return f"{self.address}, {security}" + (", bearer token" if self.token else "")
