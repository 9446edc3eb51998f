"""Lines about one failing client, at most one per interval, each saying how many were held."""
from __future__ import annotations

from specsplit.server import log_throttle
from specsplit.server.log_throttle import LogThrottle, client_of


def test_one_line_per_client_per_interval_with_the_count_held_back() -> None:
    now = [0.0]
    throttle = LogThrottle(every_s=10.0, clock=lambda: now[0])
    assert throttle.allow("a") == 0
    assert [throttle.allow("a") for _ in range(299)] == [None] * 299  # a flood: held back
    assert throttle.allow("b") == 0  # another client is not held back by the first
    now[0] = 10.0
    assert throttle.allow("a") == 299 and throttle.allow("a") is None
    now[0] = 25.0
    assert throttle.allow("a") == 1


def test_clients_are_told_apart_by_address_not_port() -> None:
    assert client_of("ipv4:10.0.0.7:52814") == client_of("ipv4:10.0.0.7:40000") == "ipv4:10.0.0.7"
    assert client_of("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert client_of("unix:/tmp/s") == "unix:/tmp/s"


def test_it_remembers_a_bounded_number_of_clients(monkeypatch) -> None:
    monkeypatch.setattr(log_throttle, "MAX_CLIENTS", 3)
    now = [0.0]
    throttle = LogThrottle(every_s=10.0, clock=lambda: now[0])
    for c in "abc":
        throttle.allow(c)
    now[0] = 5.0
    throttle.allow("d")  # all three recent: forgotten at once, rather than growing without end
    assert len(throttle._last) <= 3
