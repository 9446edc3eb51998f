"""Several gRPC servers sharing the port (`serve --listeners`): each listens on its own
socket, and sessions served through any of them are as lossless as through one."""
from __future__ import annotations

import asyncio
import socket
import urllib.request

import grpc
import psutil
import pytest

from conftest import free_port, launch_server
from specsplit.edge.client import ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.tokenizer import EdgeTokenizer
from specsplit.server.listeners import BindError, bind_listeners, check_port_free
from specsplit.server.config import ServeConfig
from specsplit.server.metrics import ServerMetrics
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


# (its address, ours): the same; or ours IPv4's wildcard, which gRPC binds as IPv6's, both families
# at once, so that a server on [::1] alone holds the port for it too (the probe of 0.0.0.0 alone
# passed, and the listeners bound beside it, taking a share of the IPv6 loopback's connections).
@pytest.mark.parametrize(("theirs", "ours"), [("127.0.0.1", "127.0.0.1"), ("[::1]", "0.0.0.0")])
def test_a_port_another_server_listens_on_is_refused_not_shared(theirs: str, ours: str) -> None:
    """gRPC binds with SO_REUSEPORT, with which a second server could take a share of the
    first one's connections without a word; binding must fail instead."""
    async def main() -> None:
        other = grpc.aio.server(options=[("grpc.so_reuseport", 1)])
        port = other.add_insecure_port(f"{theirs}:0")
        await other.start()
        try:
            # BindError, which serve answers with one line: taken since the start's check, as
            # the model loaded, it was a traceback.
            with pytest.raises(BindError, match="already in use"):
                bind_listeners(1, ours, port, lambda server: None)
        finally:
            await other.stop(None)
        servers, bound = bind_listeners(2, ours, port, lambda server: None)  # free again
        assert bound == port and len(servers) == 2

    asyncio.run(main())


@pytest.mark.parametrize("port", [-1, 65536])
def test_a_port_out_of_range_is_refused(port: int) -> None:
    with pytest.raises(OSError, match="out of range"):
        check_port_free("127.0.0.1", port)


def test_any_free_port_still_has_its_host_checked() -> None:
    """With --port 0 the host went unchecked: a mistyped one failed only once the model had
    loaded (minutes on a GPU)."""
    check_port_free("127.0.0.1", 0)
    with pytest.raises(OSError, match="cannot bind no-such-host.invalid:0"):
        check_port_free("no-such-host.invalid", 0)
    with pytest.raises(OSError, match="no address of 192.0.2.1 is on this machine"):  # (a documentation address)
        check_port_free("192.0.2.1", 0)


def test_ipv6_hosts_are_probed_as_grpc_writes_them() -> None:
    """gRPC takes IPv6 addresses in brackets ([::1]:PORT); the probe must too."""
    with pytest.raises(OSError, match=r"cannot bind \[1::2\]:5: no address of 1::2 is on this machine"):
        check_port_free("[1::2]", 5)
    try:
        listener = socket.socket(socket.AF_INET6)
        listener.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with listener:
        port = listener.getsockname()[1]
        listener.listen()
        with pytest.raises(OSError, match=rf"\[::1\]:{port} is already in use"):
            check_port_free("[::1]", port)


@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_is_served_bare_or_bracketed_with_its_metrics(host: str) -> None:
    """The probe took both forms; the bind then gave gRPC `::1:PORT` (refused) and the metrics
    server `[::1]` (no such name), after the model had loaded."""
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")

    async def main() -> None:
        servers, port = bind_listeners(1, host, 0, lambda server: None)
        await servers[0].start()
        try:
            assert port > 0
        finally:
            await servers[0].stop(None)

    asyncio.run(main())
    metrics_port = free_port()
    ServerMetrics().serve(metrics_port, host)
    with urllib.request.urlopen(f"http://[::1]:{metrics_port}/metrics", timeout=5) as reply:
        assert b"specsplit_" in reply.read()


def name_of_addresses(monkeypatch, name: str, *addresses: str) -> None:  # type: ignore[no-untyped-def]
    """Make `name` resolve to `addresses`, in that order, as a name with several would."""
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # type: ignore[no-untyped-def]
        if host == name:
            return [info for address in addresses for info in real(address, *args, **kwargs)]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def test_metrics_are_served_on_every_address_of_their_host(monkeypatch) -> None:
    """A name with two addresses (localhost where /etc/hosts gives ::1 first): the HTTP server
    bound only the first, and a scraper of the other found nothing, while gRPC served both."""
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    name_of_addresses(monkeypatch, "dual.test", "::1", "127.0.0.1")
    port = free_port()
    ServerMetrics().serve(port, "dual.test")
    for url in (f"http://[::1]:{port}/metrics", f"http://127.0.0.1:{port}/metrics"):
        with urllib.request.urlopen(url, timeout=5) as reply:
            assert b"specsplit_" in reply.read(), url
    with pytest.raises(BindError, match="could not serve the metrics on no-such-host.invalid"):
        ServerMetrics().serve(free_port(), "no-such-host.invalid")


def test_metrics_refuse_an_address_of_their_host_that_another_process_holds(monkeypatch) -> None:
    """An address of the host taken since the start's check was passed over where another
    address could be served: a scraper of it found nothing, or another process's metrics."""
    name_of_addresses(monkeypatch, "two.test", "127.0.0.1", "127.0.0.2")
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.2", port))
        taken.listen()
        with pytest.raises(BindError, match=f"could not serve the metrics on 127.0.0.2:{port}: Address already in use"):
            ServerMetrics().serve(port, "two.test")
