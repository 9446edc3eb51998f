"""The server's settings refuse, by field, what no server can run with (config.py): for a
library user building them as for serve's command line, which names the flag instead."""
from __future__ import annotations

import math

import pytest

from specsplit.server.config import OUTBOX_ROOM, ConfigError, SchedulerConfig, ServeConfig


@pytest.mark.parametrize(
    ("make", "field", "problem"),
    [
        (lambda: SchedulerConfig(max_verify_tokens=0), "max_verify_tokens", "must be at least 1"),
        (lambda: SchedulerConfig(max_batch_tokens=0), "max_batch_tokens", "must be at least 1"),
        (lambda: SchedulerConfig(idle_wait_s=-0.01), "idle_wait_s", "must be 0 or more"),
        (lambda: SchedulerConfig(max_wait_s=math.inf), "max_wait_s", "must be finite"),
        (lambda: SchedulerConfig(stalled_edge_s=math.nan), "stalled_edge_s", "must be above 0"),
        (lambda: SchedulerConfig(pace_tokens_per_s=-1), "pace_tokens_per_s", "must be 0 or more"),
        (lambda: SchedulerConfig(idle_policy="never"), "idle_policy", "must be one of"),
        (lambda: SchedulerConfig(outbox_size=OUTBOX_ROOM), "outbox_size", f"must be above {OUTBOX_ROOM}"),
        (lambda: ServeConfig(max_sessions=0), "max_sessions", "must be at least 1"),
        (lambda: ServeConfig(max_new_tokens=0), "max_new_tokens", "must be at least 1"),
        (lambda: ServeConfig(max_message_bytes=2**31), "max_message_bytes", "must be 1024 to"),
        (lambda: ServeConfig(max_context=0), "max_context", "must be at least 2"),
        (lambda: ServeConfig(grace_s=math.nan), "grace_s", "must be 0 or more"),
        (lambda: ServeConfig(keepalive_s=0), "keepalive_s", "must be above 0"),
        (lambda: ServeConfig(port=65536), "port", "must be 0"),
        (lambda: ServeConfig(metrics_host="127.0.0.2"), "metrics_host", "give a metrics port"),
        (lambda: ServeConfig(port=9000, metrics_port=9000), "metrics_port", "other than the serving port"),
        (lambda: ServeConfig(port=9000, metrics_port=9000, metrics_host="127.0.0.1"), "metrics_port", "other than"),
        (lambda: ServeConfig(host="0.0.0.0", port=9000, metrics_port=9000, metrics_host="127.0.0.2"), "metrics_port",
         "either host is a wildcard"),
        (lambda: ServeConfig(port=9000, metrics_port=9000, metrics_host="[::]"), "metrics_port", "other than"),
    ],
)
def test_a_setting_no_server_runs_with_is_refused_by_its_field(make, field: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        make()
    assert caught.value.field == field and problem in caught.value.problem


def test_the_defaults_and_the_edges_of_the_ranges_are_taken() -> None:
    SchedulerConfig(idle_wait_s=0, max_wait_s=0, pace_tokens_per_s=0, outbox_size=OUTBOX_ROOM + 1)
    ServeConfig(port=0, max_context=2, max_message_bytes=1024, grace_s=0, max_idle_streams=0, metrics_port=9091)
    # Two addresses of one machine each take the port apart.
    ServeConfig(host="127.0.0.1", port=9000, metrics_host="127.0.0.2", metrics_port=9000)
