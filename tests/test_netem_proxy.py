"""The benchmark's network emulator delays, preserves bytes, and can stall."""
from __future__ import annotations

import asyncio
import socket
import struct
import time

import pytest

import netem_proxy
from netem_proxy import LinkConfig, NetemProxy


async def echo_server() -> tuple[asyncio.base_events.Server, int]:
    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while data := await r.read(65536):
            w.write(data)
            await w.drain()
        w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_round_trip_is_delayed_and_intact() -> None:
    async def main() -> None:
        server, port = await echo_server()
        proxy = NetemProxy("127.0.0.1", port, LinkConfig(delay_s=0.05))
        r, w = await asyncio.open_connection("127.0.0.1", await proxy.start())
        payload = bytes(range(256)) * 400
        t0 = time.monotonic()
        w.write(payload)
        got = await r.readexactly(len(payload))
        assert got == payload
        assert time.monotonic() - t0 >= 0.1  # one delay each way
        assert proxy.bytes_up == proxy.bytes_down == len(payload)
        # Paused, nothing gets through; resumed, everything does.
        proxy.pause()
        w.write(b"ping")
        try:
            await asyncio.wait_for(r.readexactly(4), 0.3)
            raise AssertionError("data crossed a paused link")
        except asyncio.TimeoutError:
            pass
        proxy.resume()
        assert await asyncio.wait_for(r.readexactly(4), 5) == b"ping"
        w.close()
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_a_new_connection_pays_its_handshake() -> None:
    """Over a real path the client sends from one RTT after it connects, and a server's first
    bytes reach it two RTTs after: a first exchange takes 2 RTTs, the next ones 1. The proxy
    connected at once, so each benchmark run's first call (a new edge process) was about
    1.5 RTTs early."""
    async def main() -> None:
        server, port = await echo_server()
        proxy = NetemProxy("127.0.0.1", port, LinkConfig(delay_s=0.05))  # RTT 100 ms
        listen = await proxy.start()
        t0 = time.monotonic()
        r, w = await asyncio.open_connection("127.0.0.1", listen)
        w.write(b"ping")
        assert await r.readexactly(4) == b"ping"
        assert time.monotonic() - t0 >= 0.2  # 2 RTTs
        w.close()
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_bandwidth_cap_spaces_out_bytes() -> None:
    async def main() -> None:
        server, port = await echo_server()
        proxy = NetemProxy("127.0.0.1", port, LinkConfig(rate_bps=8e6))  # 1 MB/s each way
        r, w = await asyncio.open_connection("127.0.0.1", await proxy.start())
        t0 = time.monotonic()
        w.write(b"x" * 200_000)
        await r.readexactly(200_000)
        assert time.monotonic() - t0 >= 0.2  # 200 kB at 1 MB/s, at least once
        w.close()
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_connections_share_each_directions_bandwidth() -> None:
    """One network path: two connections at once get the cap between them, not each (each
    had a link of its own, and two transfers took the time of one)."""
    async def main() -> None:
        server, port = await echo_server()
        proxy = NetemProxy("127.0.0.1", port, LinkConfig(rate_bps=8e6))  # 1 MB/s each way
        listen = await proxy.start()

        async def transfer() -> None:
            r, w = await asyncio.open_connection("127.0.0.1", listen)
            w.write(b"x" * 200_000)
            await r.readexactly(200_000)
            w.close()

        t0 = time.monotonic()
        await asyncio.gather(transfer(), transfer())
        assert time.monotonic() - t0 >= 0.4  # 400 kB at 1 MB/s, each way
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_a_half_close_delivers_everything_sent_before_it() -> None:
    """A client that sends its request and half-closes still gets the whole answer (the end of
    one direction used to cancel the other, losing what was in flight)."""
    async def main() -> None:
        server, port = await echo_server()
        proxy = NetemProxy("127.0.0.1", port, LinkConfig(delay_s=0.05))
        r, w = await asyncio.open_connection("127.0.0.1", await proxy.start())
        w.write(b"y" * 1000)
        w.write_eof()
        assert await asyncio.wait_for(r.read(), 5) == b"y" * 1000  # all of it, then the end
        w.close()
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_a_reset_arrives_after_what_its_side_sent_before_it() -> None:
    """A server that answers and resets: the answer still crosses the link, on schedule, and
    the reset after it. Before, the reset cancelled both directions at once: the answer still
    waiting out its delay was dropped and the client saw the end at once, with nothing."""
    async def main() -> None:
        async def answer_and_reset(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await r.readexactly(4)
            w.write(b"z" * 3000)
            await w.drain()
            sock = w.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()

        server = await asyncio.start_server(answer_and_reset, "127.0.0.1", 0)
        proxy = NetemProxy("127.0.0.1", server.sockets[0].getsockname()[1], LinkConfig(delay_s=0.1))
        r, w = await asyncio.open_connection("127.0.0.1", await proxy.start())
        t0 = time.monotonic()
        w.write(b"ping")
        got = b""
        with pytest.raises(ConnectionResetError):  # passed on as a reset, not a clean end
            while data := await asyncio.wait_for(r.read(65536), 5):
                got += data
        assert got == b"z" * 3000
        assert time.monotonic() - t0 >= 0.2  # the answer, then the reset, a delay each way
        w.close()
        await proxy.close()
        server.close()

    asyncio.run(main())


def test_chunks_are_booked_on_the_shared_link_as_they_are_read(monkeypatch) -> None:
    """Each chunk's arrival is fixed when it is read: its direction's link sends what it holds
    first (every connection's), then this chunk, and the delay follows. Booked only once the
    connection's previous chunk had been delivered, a chunk could land behind another
    connection's later one, a whole delay late."""
    now = [0.0]
    monkeypatch.setattr(netem_proxy.time, "monotonic", lambda: now[0])
    proxy = NetemProxy("127.0.0.1", 1, LinkConfig(delay_s=0.2, rate_bps=8e6))  # 1000 bytes: 1 ms
    assert proxy._arrival("up", 1000) == pytest.approx(0.201)
    assert proxy._arrival("up", 1000) == pytest.approx(0.202)  # another connection's, behind it on the link
    assert proxy._arrival("down", 1000) == pytest.approx(0.201)  # the other direction is its own link
    now[0] = 0.5
    assert proxy._arrival("up", 1000) == pytest.approx(0.701)  # an idle link sends at once
    free = NetemProxy("127.0.0.1", 1, LinkConfig(delay_s=0.2))  # no cap: the delay alone, whatever else is sent
    assert free._arrival("up", 10**9) == free._arrival("up", 1) == pytest.approx(0.7)


def test_the_command_line_proxy_reaches_an_ipv6_target() -> None:
    """--target [::1]:PORT, as its own check advertises: the brackets went to the connection
    as part of the host, and every connection was closed without a word."""
    import subprocess
    import sys
    from pathlib import Path

    async def main() -> bytes:
        async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(await r.read(100))
            await w.drain()
            w.close()

        server = await asyncio.start_server(handle, "::1", 0)
        port = server.sockets[0].getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Path(netem_proxy.__file__)), "--target", f"[::1]:{port}", "--port", "0",
            "--delay-ms", "1", stdout=subprocess.PIPE)
        try:
            banner = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()  # proxy HOST:PORT -> ...
            listen = int(banner.split(" ", 2)[1].rsplit(":", 1)[1])
            r, w = await asyncio.open_connection("127.0.0.1", listen)
            w.write(b"hello")
            return await asyncio.wait_for(r.read(100), 10)
        finally:
            proc.kill()
            await proc.wait()
            server.close()

    assert asyncio.run(main()) == b"hello"


def test_a_capped_link_delivers_a_chunk_a_packet_at_a_time(monkeypatch) -> None:
    """A chunk of 64 KiB read at once went out whole, after its whole transmission time: a
    small message at its end came no sooner than the bulk before it, where a real link would
    have carried the bulk's first packets on their way long before."""
    now = [0.0]
    monkeypatch.setattr(netem_proxy.time, "monotonic", lambda: now[0])
    proxy = NetemProxy("127.0.0.1", 1, LinkConfig(delay_s=0.1, rate_bps=8e6))  # 1500 bytes: 1.5 ms
    segments = proxy._segments(b"x" * 4000)
    assert [len(s) for s in segments] == [1500, 1500, 1000]
    arrivals = [proxy._arrival("up", len(s)) for s in segments]
    assert arrivals == pytest.approx([0.1015, 0.103, 0.104])  # the first packet is not held for the last
    assert NetemProxy("127.0.0.1", 1, LinkConfig(delay_s=0.1))._segments(b"x" * 4000) == [b"x" * 4000]


def test_a_connection_held_by_its_handshake_does_not_hold_the_shared_link(monkeypatch) -> None:
    """A new connection's first chunk, held for its handshake, booked the link until then: every
    other connection's traffic waited behind a link that sat idle (a chunk of a streaming
    connection 91 ms late at 50 ms delay). Held chunks still leave one after another."""
    now = [0.0]
    monkeypatch.setattr(netem_proxy.time, "monotonic", lambda: now[0])
    proxy = NetemProxy("127.0.0.1", 1, LinkConfig(delay_s=0.05, rate_bps=8e6))  # 1000 bytes: 1 ms
    new, streaming = [0.1], [0.0]  # when each may next send: the new one after its handshake
    assert proxy._arrival("up", 1000, new) == pytest.approx(0.151)
    assert proxy._arrival("up", 1000, new) == pytest.approx(0.152)  # behind the first, on its connection
    assert proxy._arrival("up", 1000, streaming) == pytest.approx(0.053)  # behind the two on the link only


def test_a_half_close_reaches_the_other_side_a_delay_after_it_was_sent() -> None:
    """The end went through at once, ahead of the delay (and through a paused proxy)."""
    async def main() -> float:
        ended = asyncio.get_running_loop().create_future()

        async def read_to_the_end(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            while await r.read(100):
                pass
            ended.set_result(time.monotonic())
            w.close()

        server = await asyncio.start_server(read_to_the_end, "127.0.0.1", 0)
        proxy = NetemProxy("127.0.0.1", server.sockets[0].getsockname()[1], LinkConfig(delay_s=0.2))
        r, w = await asyncio.open_connection("127.0.0.1", await proxy.start())
        w.write(b"x")
        await asyncio.sleep(0.8)  # past the handshake and the byte's delay
        sent = time.monotonic()
        w.write_eof()
        took = await asyncio.wait_for(ended, 5) - sent
        w.close()
        await proxy.close()
        server.close()
        return took

    assert asyncio.run(main()) >= 0.2
