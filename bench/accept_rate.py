"""How fast a server takes new gRPC calls while its event loop is busy, by listener count.

The server's own listener code (specsplit.server.listeners) serves one trivial method,
and every turn of its event loop carries --turn-ms of other work, as a loop busy with
hundreds of streams' messages and a verification worker's passes does. Callers, each on
its own connection as separate devices are, make one call after another. A busy loop caps
the calls per second a server starts; the report shows by how much, and how much more
listeners (each taking calls on its own) lift that cap. The server runs in its own process,
pinned to one core, the callers in this one on another.

Writes bench/results/NAME.json and NAME.md. Run from the repository root:
python bench/accept_rate.py [options]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from cli_types import at_least, core, int_list, out_dir, report_name
from orchestrate import free_port, machine, pin, server_and_edge_cores
from report_files import save_report
from specsplit.server.listeners import bind_listeners

RESULTS = Path(__file__).resolve().parent / "results"
METHOD = "/specsplit.bench.Accept/Ping"
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
ERROR_PAUSE_S = 0.05  # after a failed call


@dataclass(frozen=True)
class Settings:
    listeners: tuple[int, ...] = (1, 2, 4, 8)
    callers: int = 64
    duration_s: float = 5.0
    turn_ms: float = 2.0  # other work in every turn of the server's event loop
    server_core: int | None = None
    client_core: int | None = None


async def _serve(listeners: int, port: int, turn_s: float) -> None:
    async def ping(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b""

    handler = grpc.method_handlers_generic_handler(
        "specsplit.bench.Accept", {"Ping": grpc.unary_unary_rpc_method_handler(ping)})
    servers, _ = bind_listeners(listeners, "127.0.0.1", port, lambda s: s.add_generic_rpc_handlers((handler,)))
    for server in servers:
        await server.start()
    loop = asyncio.get_running_loop()

    def other_work() -> None:  # scheduled anew in each turn, so it runs in every next one
        time.sleep(turn_s)
        loop.call_soon(other_work)

    if turn_s:
        loop.call_soon(other_work)
    print("ready", flush=True)
    await asyncio.Event().wait()


@contextmanager
def _server(listeners: int, s: Settings):  # type: ignore[no-untyped-def]
    port = free_port()
    cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--listeners", str(listeners),
           "--turn-ms", str(s.turn_ms)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            preexec_fn=pin([s.server_core] if s.server_core is not None else None))
    try:
        if proc.stdout is None or proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the server did not start (status {proc.poll()})")
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


async def _call_back_to_back(address: str, callers: int, duration_s: float) -> tuple[list[float], int]:
    deadline = time.monotonic() + duration_s
    latencies: list[float] = []
    errors = 0

    async def caller() -> None:
        nonlocal errors
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            ping = channel.unary_unary(METHOD)
            await ping(b"")  # connected before the clock matters
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    await ping(b"", timeout=30)
                except grpc.aio.AioRpcError:
                    errors += 1
                    await asyncio.sleep(ERROR_PAUSE_S)  # a server refusing at once must not become a busy loop
                    continue
                latencies.append((time.monotonic() - t0) * 1000)

    await asyncio.gather(*(caller() for _ in range(callers)))
    return latencies, errors


def measure(s: Settings, log=print) -> dict:  # type: ignore[no-untyped-def]
    """One row per listener count: calls started per second and their latency."""
    if s.client_core is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {s.client_core})
    rows = []
    for n in s.listeners:
        with _server(n, s) as address:
            latencies, errors = asyncio.run(_call_back_to_back(address, s.callers, s.duration_s))
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99]) if latencies else (None,) * 3
        rows.append({"listeners": n, "calls": len(latencies), "calls_per_s": len(latencies) / s.duration_s,
                     "latency_ms": {"p50": p50, "p90": p90, "p99": p99}, "errors": errors})
        log(f"{n} listener(s): {rows[-1]['calls_per_s']:.0f} calls/s, p90 "
            + ("–" if p90 is None else f"{p90:.1f} ms") + f", errors {errors}")
    return {"machine": machine(), "settings": asdict(s), "rows": rows}


def render(report: dict, name: str) -> str:
    s, m = report["settings"], report["machine"]

    def ms(x: float | None) -> str:
        return "–" if x is None else f"{x:.1f}"

    lines = [
        f"# New gRPC calls taken under a busy event loop: {name}",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores",
        f"- pinning: server on core {s['server_core']}, callers on core {s['client_core']} (one process each)",
        f"- server: the project's listeners (`specsplit.server.listeners`), one trivial unary method; "
        f"{s['turn_ms']:g} ms of other work in every turn of its event loop",
        f"- callers: {s['callers']}, each on its own connection, calling back to back for {s['duration_s']:g} s; "
        "loopback, no added delay",
        "",
        "| listeners | calls/s | latency p50 / p90 / p99 ms | errors |",
        "| --- | --- | --- | --- |",
        *(f"| {r['listeners']} | {r['calls_per_s']:.0f} | {ms(r['latency_ms']['p50'])} / {ms(r['latency_ms']['p90'])} "
          f"/ {ms(r['latency_ms']['p99'])} | {r['errors']} |" for r in report["rows"]),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--listeners", type=int_list, default="1,2,4,8", help="listener counts to compare, comma-separated (default 1,2,4,8)")
    p.add_argument("--callers", type=at_least(1), default=64, help="concurrent callers, each on its own connection (default 64)")
    p.add_argument("--duration", type=at_least(0, float, above=True), default=5.0, help="seconds per listener count (default 5)")
    p.add_argument("--turn-ms", type=at_least(0, float), default=2.0,
                   help="other work in every turn of the server's event loop, in ms (default 2)")
    p.add_argument("--server-core", type=core, help="pin the server to this core (default: the last)")
    p.add_argument("--client-core", type=core, help="pin the callers to this core (default: the first)")
    p.add_argument("--name", type=report_name, default="accept-rate", help="writes NAME.json and NAME.md (default accept-rate)")
    p.add_argument("--out-dir", type=out_dir, default=RESULTS, help="where (default: bench/results)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server process itself
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    listeners = args.listeners
    if args.serve:
        asyncio.run(_serve(listeners[0], args.port, args.turn_ms / 1000))
        return 0
    if min(listeners) < 1:
        p.error("--listeners: listener counts must be at least 1")
    server_cores, client_cores = server_and_edge_cores()
    if args.server_core is None and server_cores:
        args.server_core = server_cores[0]
    if args.client_core is None and client_cores:
        args.client_core = client_cores[0]
    settings = Settings(listeners, args.callers, args.duration, args.turn_ms, args.server_core, args.client_core)
    report = measure(settings, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    save_report(args.out_dir, args.name, report, render(report, args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
