"""Log lines about failing clients, at most one per client and kind of failure per interval.

One client that sends garbage, or guesses tokens, as fast as it can would otherwise write a
line per call (300 in 0.7 s in a test) and bury everything else; each line that does go out
says how many were held back before it."""
from __future__ import annotations

import time
from collections.abc import Callable

EVERY_S = 10.0
MAX_CLIENTS = 4096  # clients remembered at once; past it the quiet ones are forgotten


def client_of(peer: str) -> str:
    """The client's address without its port (gRPC's peer string, `ipv4:10.0.0.7:52814`):
    a client that reconnects for every call is still one client."""
    address, sep, port = peer.rpartition(":")
    return address if sep and port.isdigit() else peer


class LogThrottle:
    def __init__(self, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last: dict[str, float] = {}  # client -> when its last line went out
        self._held: dict[str, int] = {}  # client -> lines held back since then

    def allow(self, client: str) -> int | None:
        """None: hold this line back. Otherwise log it, with how many were held back before it.
        `client`: whatever a line is held back by (a client's address and its failure's status)."""
        now = self._clock()
        last = self._last.get(client)
        if last is not None and now - last < self.every_s:
            self._held[client] = self._held.get(client, 0) + 1
            return None
        if len(self._last) >= MAX_CLIENTS:
            self._forget(now)
            if len(self._last) >= MAX_CLIENTS:  # that many failing at once: start counting afresh
                self._last.clear()
                self._held.clear()
        self._last[client] = now
        return self._held.pop(client, 0)

    def _forget(self, now: float) -> None:
        for client in [c for c, t in self._last.items() if now - t >= self.every_s]:
            del self._last[client]
            self._held.pop(client, None)
