"""The benchmark's process pinning: children land on the cores asked for."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import orchestrate
from orchestrate import START_CORES, pin

needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(START_CORES) < 2,
                                     reason="needs at least two cores to pin to")


def child_cores(cores: list[int]) -> set[int]:
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         preexec_fn=pin(cores), capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@needs_two_cores
def test_a_child_gets_a_core_its_driver_gave_up() -> None:
    # The benchmark's driver pins itself to the edge's core, then starts the server on another:
    # the server must get that other core, not inherit the driver's.
    first, second = sorted(START_CORES)[:2]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {first})
    try:
        assert child_cores([second]) == {second}
        assert child_cores([first]) == {first}
    finally:
        os.sched_setaffinity(0, before)


@pytest.mark.parametrize(("have", "want"), [
    ({0, 1}, ([1], [0])),
    ({2, 3, 5}, ([5], [2])),  # a container's cpuset need not hold cores 0 and 1
    ({4}, (None, None)),  # one core: nothing to keep apart
])
def test_the_server_takes_the_last_core_and_the_edge_the_first(have, want, monkeypatch) -> None:
    monkeypatch.setattr(orchestrate, "START_CORES", frozenset(have))
    assert orchestrate.server_and_edge_cores() == want


def test_no_cores_means_no_pinning() -> None:
    assert pin(None) is None and pin([]) is None


@pytest.mark.skipif(not START_CORES, reason="the OS does not say which cores a process has")
def test_a_core_this_process_cannot_use_is_refused_not_dropped() -> None:
    """Dropped, the child ran unpinned while the report named the core."""
    with pytest.raises(ValueError, match="not available here"):
        pin([max(START_CORES) + 1000])


def test_a_driver_ended_by_sigterm_stops_its_server(tiny) -> None:
    """A plain `kill`, a job's timeout or systemd end the benchmark's driver alone: its server
    was left running, re-parented, holding its port and its pinned core."""
    import signal
    from pathlib import Path

    script = ("import sys, time\n"
              f"sys.path.insert(0, {str(Path(orchestrate.__file__).parent)!r})\n"
              "from orchestrate import running_server\n"
              "with running_server(sys.argv[1], None) as (address, server):\n"
              "    print(server.pid, flush=True)\n"
              # Short waits, as the drivers' own: a signal that lands on another of the process's
              # threads (gRPC's) is handled once the main thread is back in Python.
              "    for _ in range(1200):\n"
              "        time.sleep(0.1)\n")
    driver = subprocess.Popen([sys.executable, "-c", script, str(tiny.target_dir)], stdout=subprocess.PIPE, text=True)
    try:
        server = int(driver.stdout.readline())  # once the server answers its health check
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        driver.kill()
    assert not Path(f"/proc/{server}").exists()  # stopped and reaped by the driver on its way out
