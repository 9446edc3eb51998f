"""The soak's load (bench/soak.py): a server that dies ends the soak, failed, instead of
the edges retrying it in a busy loop."""
from __future__ import annotations

import asyncio

import psutil

import soak
from orchestrate import running_server


def test_a_server_that_exits_ends_the_soak_and_is_reported(tiny) -> None:
    """Killed 12 s into a soak, the server left the edges failing in a tight loop (35,471
    UNAVAILABLE in the rest of the run, a core burnt), and its zombie's memory read 0 MB."""
    with running_server(str(tiny.target_dir), None, dtype="fp32") as (address, server):
        server.kill()  # not reaped until the server's context ends: a zombie, as the driver saw it
        result = asyncio.run(soak.load(address, tiny.draft_dir, 2, 60.0, psutil.Process(server.pid)))
    assert result["server_exited"] is True
    assert sum(result["errors"].values()) < 100 and result["rss_samples"] == []
