"""Several gRPC servers sharing the port (`serve --listeners`): each listens on its own
socket, and sessions served through any of them are as lossless as through one."""
from __future__ import annotations

import asyncio

import grpc
import psutil
import pytest

from conftest import launch_server
from specsplit.edge.client import ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.server.service import ServeConfig
from test_end_to_end import reference

SESSIONS = 6
MAX_NEW = 12
# Each session on its own connection, as separate devices: the kernel deals connections among the listeners.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]


async def _sessions(address: str, tiny) -> list[list[int]]:
    tok = EdgeTokenizer(tiny.draft_dir)
    prompt = tok.encode("The quick brown fox")

    async def one(i: int) -> list[int]:
        mode = "none" if i % 2 else "async"
        drafter = None if mode == "none" else OnnxDrafter(tiny.draft_dir)
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            result = await generate(channel, prompt, EdgeConfig(mode=mode, max_new_tokens=MAX_NEW), drafter=drafter,
                                    fingerprint=tok.fingerprint, connect=ConnectOptions(retries=0))
        return result.tokens

    return [prompt, *await asyncio.gather(*(one(i) for i in range(SESSIONS)))]


def test_listeners_share_the_port_and_serve_losslessly(tiny, tmp_path) -> None:
    log = tmp_path / "server.log"
    with launch_server(tiny.target_dir, log, "--listeners", "3") as (address, proc):
        port = int(address.rsplit(":", 1)[1])
        listening = [c for c in psutil.Process(proc.pid).net_connections(kind="tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        assert len(listening) == 3, listening
        prompt, *outputs = asyncio.run(_sessions(address, tiny))
    want = reference(str(tiny.target_dir), prompt, MAX_NEW)
    assert all(out == want for out in outputs), outputs
    assert "(3 listeners)" in log.read_text()


def test_listeners_must_be_at_least_one() -> None:
    with pytest.raises(ValueError, match="listeners must be at least 1"):
        ServeConfig(listeners=0)
