"""Lines about failing clients: one per client and failure per interval, a bounded number in
all, each saying how many were held back."""
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


def test_many_clients_at_once_get_a_bounded_number_of_lines(monkeypatch) -> None:
    """Clients rotating through thousands of addresses, round after round."""
    monkeypatch.setattr(log_throttle, "MAX_CLIENTS", 100)
    monkeypatch.setattr(log_throttle, "MAX_LINES", 20)
    now = [0.0]
    throttle = LogThrottle(every_s=10.0, clock=lambda: now[0])
    logged, reported = 0, 0
    for round_ in range(5):
        now[0] = round_ * 3.0
        for i in range(5000):
            held = throttle.allow(f"ipv6:[2001:db8::{i:x}]")
            if held is not None:
                logged, reported = logged + 1, reported + held
        assert len(throttle._last) <= 100 and set(throttle._held) <= set(throttle._last)
    assert logged <= 20 * 2  # two intervals began in 12 s
    now[0] = 100.0
    reported += throttle.allow("x")
    assert reported == 25_000 - logged  # every line held back is counted on a line that went out
