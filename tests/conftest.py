"""Session fixtures: tiny models built here, exported through the real exporter, and a
real server process on a loopback port."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest

from orchestrate import free_port, running_server
from tiny_models import PROBE_PROMPT, TinyModels, build_tiny_pair

__all__ = ["PROBE_PROMPT", "free_port", "launch_server"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyModels:
    return build_tiny_pair(tmp_path_factory.mktemp("models"))


@contextmanager
def launch_server(target: Path, log: Path, *extra: str, healthy: bool = True):
    """A real server process (fp32, unpinned) on a free loopback port; yields (address, process)."""
    try:
        with running_server(target, None, ["--max-lookahead", "32", *extra], log, dtype="fp32", ready_timeout=60,
                            wait=healthy) as (address, proc):
            yield address, proc
    finally:
        print(log.read_text()[-3000:])


@pytest.fixture(scope="session")
def server(tiny: TinyModels, tmp_path_factory):
    with launch_server(tiny.target_dir, tmp_path_factory.mktemp("server") / "server.log") as (address, _):
        yield address
