"""The soak's load (bench/soak.py): a server that dies ends the soak, failed, instead of
the edges retrying it in a busy loop."""
from __future__ import annotations

import asyncio
import time

import psutil

import soak
from orchestrate import running_server


def test_a_server_that_exits_ends_the_soak_and_is_reported(tiny) -> None:
    """Killed 12 s into a soak, the server left the edges failing in a tight loop (35,471
    UNAVAILABLE in the rest of the run, a core burnt), and its zombie's memory read 0 MB."""
    with running_server(str(tiny.target_dir), None, dtype="fp32") as (address, server):
        server.kill()  # not reaped until the server's context ends: a zombie, as the driver saw it
        process = psutil.Process(server.pid)
        # SIGKILL takes a moment to land: sampled first, a live server's memory is a true sample.
        deadline = time.monotonic() + 10
        while process.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.01)
        result = asyncio.run(soak.load(address, tiny.draft_dir, 2, 60.0, process))
    assert result["server_exited"] is True
    assert sum(result["errors"].values()) < 100 and result["rss_samples"] == []


def test_a_server_still_ending_when_first_sampled_is_found_by_the_failures(tiny, monkeypatch) -> None:
    """A killed server's process takes a while to end (here: read as alive for its first
    second); sampled before that, it was looked at again only 5 s later, its edges failing
    about 200 calls meanwhile (186 in one run of the test above)."""
    real, t0 = soak.exited, time.monotonic()
    monkeypatch.setattr(soak, "exited", lambda pid: time.monotonic() - t0 > 1.0 and real(pid))
    with running_server(str(tiny.target_dir), None, dtype="fp32") as (address, server):
        server.kill()
        t0 = time.monotonic()
        result = asyncio.run(soak.load(address, tiny.draft_dir, 2, 60.0, psutil.Process(server.pid)))
    assert result["server_exited"] is True and sum(result["errors"].values()) < 100
