"""A TCP proxy that adds one-way delay and a bandwidth cap in both directions.

User-space stand-in for netem: every chunk read from one side is delivered to the
other `delay` seconds later, and no faster than `rate` allows (a chunk occupies the
link for len * 8 / rate seconds, in order). Each direction is one link, shared by every
connection through the proxy, as one network path is. A side that half-closes has all it
sent delivered before the other side sees the end; one that resets, all it sent before the
reset (what was on its way to it is dropped, as a reset host drops it). A new connection
pays its TCP handshake: the client's first bytes leave one RTT after it connected, and the
server's first bytes (an HTTP/2 server's settings, which a gRPC client waits for) reach the
client two RTTs after, as over a real path (a gRPC call's first message reaches the server
2.5 RTTs after the connect there, not 1). The proxy can also be paused, to stall the network
without closing connections, or cut, to close them all.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from cli_types import at_least, host_port, port
from specsplit.common.address import bracketed


SEGMENT_BYTES = 1500  # what a capped link sends at a time: an Ethernet frame's payload


@dataclass
class LinkConfig:
    delay_s: float = 0.0  # one way
    rate_bps: float = 0.0  # bits per second each way; 0: unlimited


class NetemProxy:
    def __init__(self, target_host: str, target_port: int, link: LinkConfig) -> None:
        self.target = (target_host, target_port)
        self.link = link
        self.bytes_up = 0  # client -> target
        self.bytes_down = 0
        self._running = asyncio.Event()
        self._running.set()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._link_free = {"up": 0.0, "down": 0.0}  # when each direction's link has sent what it holds

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def cut(self) -> None:
        """Close every connection through the proxy at once, as a lost link ends them; the proxy
        still takes new ones."""
        for t in list(self._tasks):
            t.cancel()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            target_r, target_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        # The handshake (SYN, SYN-ACK, ACK) took place here at once; on the emulated path
        # the client may send from one RTT on, and the server from 1.5 RTTs (on the ACK).
        connected = time.monotonic()
        # Per direction: when this connection may next send (Line).
        lines = {"up": [connected + 2 * self.link.delay_s], "down": [connected + 3 * self.link.delay_s]}
        pumps: dict[str, asyncio.Task] = {}

        def gone(toward: str) -> None:
            # A side that reset takes nothing more: what is on its way to it is dropped. What
            # it sent before still reaches the other side on schedule, and the reset after it.
            pumps[toward].cancel()
        pumps["up"] = asyncio.create_task(self._pump(client_r, target_w, "up", lines["up"], lambda: gone("down")))
        pumps["down"] = asyncio.create_task(self._pump(target_r, client_w, "down", lines["down"], lambda: gone("up")))
        tasks = set(pumps.values())
        self._tasks |= tasks
        # Each direction runs to its own end: a half-close ends one, not the other, and a
        # side that cannot be written to any more is read until it ends too.
        await asyncio.gather(*tasks, return_exceptions=True)  # (a reset is no error of the proxy's)
        for w in (client_w, target_w):
            w.close()
        self._tasks -= tasks

    def _arrival(self, direction: str, size: int, line: list[float] | None = None) -> float:
        """When a chunk read now reaches the other side: after the chunks already on its
        direction's link (all connections') have gone out, its own transmission, and the
        delay. Booked on the link as it is read, so the link serves chunks in the order they
        came. `line`: its connection's [when it may next send]: the handshake's end, then its
        last chunk's leaving; a chunk held by the handshake leaves then, after the chunks held
        before it, without holding the link idle for the other connections meanwhile. (It is
        booked on the link as read, not as it leaves: for a handshake's span a cap can let
        a held chunk and others' traffic through together, where a real link would queue them.)"""
        now = time.monotonic()
        transmit = size * 8 / self.link.rate_bps if self.link.rate_bps > 0 else 0.0
        sent = max(now, self._link_free[direction]) + transmit
        if self.link.rate_bps > 0:
            self._link_free[direction] = sent
        if line is None:
            return sent + self.link.delay_s
        line[0] = max(sent, line[0] + transmit)
        return line[0] + self.link.delay_s

    def _segments(self, data: bytes) -> list[bytes]:
        """A chunk as the capped link carries it, a packet at a time: a small message read
        together with bulk data arrives with its own packet, not once the whole chunk has
        been sent (a 4-byte reply behind 64 KiB at 8 Mbit/s was 65 ms late). Without a cap
        every byte arrives after the delay alone, so the chunk goes whole."""
        if self.link.rate_bps <= 0:
            return [data]
        return [data[i : i + SEGMENT_BYTES] for i in range(0, len(data), SEGMENT_BYTES)]

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str,
                    line: list[float], on_reset: Callable[[], None]) -> None:
        """Carry one direction: what is read goes out at its arrival time. The end of the
        reader's side goes after what it sent, as an end (a half-close) or a reset, which
        also calls `on_reset`, each a delay after it came (and not while the proxy is
        paused). A failed write ends the direction at once."""
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await self._running.wait()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                if data is RESET:
                    _reset(writer)
                    return
                writer.write(data)
                await writer.drain()
                if direction == "up":
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)

        sender = asyncio.create_task(deliver())
        try:
            while True:
                read = asyncio.ensure_future(reader.read(65536))
                await asyncio.wait({read, sender}, return_when=asyncio.FIRST_COMPLETED)
                if sender.done():  # its side failed (deliver returns on its own only after the end)
                    read.cancel()
                    sender.result()
                    return
                try:
                    data = read.result()
                except ConnectionError:  # the reader's side reset
                    on_reset()
                    queue.put_nowait((self._arrival(direction, 0, line), RESET))
                    break
                if not data:
                    queue.put_nowait((self._arrival(direction, 0, line), None))
                    break
                for segment in self._segments(data):
                    queue.put_nowait((self._arrival(direction, len(segment), line), segment))
            await sender
        finally:
            sender.cancel()


RESET = object()  # queued after a side's last chunk: the reset that ended it


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (RST), not an end (FIN): lingering for 0 s drops what is unsent."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def _main(args: argparse.Namespace) -> None:
    host, port = args.target.rsplit(":", 1)
    # [::1]:PORT: the address without its brackets, which the connection would take for a name.
    proxy = NetemProxy(host.strip("[]"), int(port), LinkConfig(args.delay_ms / 1000, args.rate_mbit * 1e6))
    listen = await proxy.start(args.host, args.port)
    rate = f"{args.rate_mbit:g} Mbit/s each way" if args.rate_mbit else "no bandwidth cap"
    print(f"proxy {bracketed(args.host)}:{listen} -> {args.target}, one-way delay {args.delay_ms:g} ms, {rate}",
          flush=True)
    await asyncio.Event().wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=host_port, required=True, help="HOST:PORT to forward to")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port, default=0, help="port to listen on (0: any free one)")
    p.add_argument("--delay-ms", type=at_least(0, float), default=0.0, help="one-way delay, each direction")
    p.add_argument("--rate-mbit", type=at_least(0, float), default=0.0,
                   help="bandwidth cap per direction, shared by all connections (0: none)")
    args = p.parse_args()
    try:
        asyncio.run(_main(args))
    except OSError as exc:  # the port in use, a host that does not resolve
        print(f"error: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
