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
