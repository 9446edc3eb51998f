"""Log lines about failing clients, at most one per client and kind of failure per interval,
and a bounded number in all.

One client that sends garbage, or guesses tokens, as fast as it can would otherwise write a
line per call (300 in 0.7 s in a test) and bury everything else; so would many clients at
once (addresses are cheap). Each line that does go out says how many were held back since
the last one."""
from __future__ import annotations

import time
from collections.abc import Callable

EVERY_S = 10.0
MAX_LINES = 50  # lines per interval, all clients together
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
        self._last: dict[str, float] = {}  # key -> when its last line went out
        self._held: dict[str, int] = {}  # key -> lines held back since then (keys of _last only)
        self._others = 0  # lines held back whose key is not remembered (too many at once)
        self._window = -float("inf")  # when the current interval of the overall cap began
        self._lines = 0  # lines that went out in it

    def allow(self, key: str) -> int | None:
        """None: hold this line back. Otherwise log it, with how many were held back before it
        (its key's, and any not remembered). `key`: what a line is held back by (a client's
        address and its failure's status)."""
        now = self._clock()
        if now - self._window >= self.every_s:
            self._window, self._lines = now, 0
        if key not in self._last and len(self._last) >= MAX_CLIENTS:
            self._forget(now)
        last = self._last.get(key)
        if key not in self._last and len(self._last) >= MAX_CLIENTS:
            self._others += 1  # all remembered clients are recent: this one cannot be told apart
            return None
        if (last is not None and now - last < self.every_s) or self._lines >= MAX_LINES:
            if last is not None:
                self._held[key] = self._held.get(key, 0) + 1
            else:
                self._others += 1
            return None
        self._last[key] = now
        self._lines += 1
        held, self._others = self._held.pop(key, 0) + self._others, 0
        return held

    def _forget(self, now: float) -> None:
        for key in [k for k, t in self._last.items() if now - t >= self.every_s]:
            del self._last[key]
            self._others += self._held.pop(key, 0)
