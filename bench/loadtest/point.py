"""One point of the sweep: a set of sessions against the server, with the server's
metrics scraped as its measured window opens and closes (before and after the whole point,
for a point of counted generations, which has no window) and its KV memory and RSS sampled
during the run (where the load test can see them: a server it did not start has no RSS
here, and one whose metrics it is not given has no server figures)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loadtest.endpoint import ServerEndpoint
from loadtest.scrape import UNREADABLE, Snapshot, scrape, value
from loadtest.sessions import LoadRun, LoadSpec, measured_window, run_sessions
from loadtest.summary import summarize
from loadtest.workers import ClientWorkers
from orchestrate import exited
from specsplit.common.aio import within

SAMPLE_EVERY_S = 0.5
LOST_AFTER_S = 10.0  # a server elsewhere that takes no connection for this long is taken for gone


@dataclass(frozen=True)
class ServerHandle:
    endpoint: ServerEndpoint
    pid: int | None  # None: a server on another machine (or one this load test did not start)
    metrics_url: str | None  # http://host:port/metrics; None: not read

    def snapshot(self) -> Snapshot | None:
        """The server's metrics now: {} where none are read, None where reading them failed
        (a busy or lost server: the point goes on, without the figures that needed them)."""
        if not self.metrics_url:
            return {}
        try:
            return scrape(self.metrics_url)
        except UNREADABLE:
            return None

    def lost(self) -> str | None:
        """How the server is gone, None where it is not: a process this load test started
        that has exited, or a server elsewhere that takes no connection within LOST_AFTER_S."""
        if self.pid is not None:
            return "exited" if exited(self.pid) else None
        if self.endpoint.reachable(LOST_AFTER_S):
            return None
        return f"took no connection for {LOST_AFTER_S:g} s"


@dataclass
class Peaks:
    kv_bytes: float | None = None
    rss_bytes: float | None = None
    failed_reads: int = 0


def _higher(peak: float | None, seen: float | None) -> float | None:
    return peak if seen is None else max(peak or 0.0, seen)


async def _sample(server: ServerHandle, peaks: Peaks, stop: asyncio.Event) -> None:
    proc = None
    if server.pid is not None:  # a server this load test started (one elsewhere has no pid here)
        import psutil

        proc = psutil.Process(server.pid)
    while not stop.is_set():
        if server.metrics_url:
            snap = await asyncio.to_thread(server.snapshot)
            if snap is None:
                peaks.failed_reads += 1
            else:
                peaks.kv_bytes = _higher(peaks.kv_bytes, value(snap, "specsplit_kv_cache_bytes"))
        if proc is not None:
            try:
                peaks.rss_bytes = _higher(peaks.rss_bytes, proc.memory_info().rss)
            except psutil.Error:  # the server is gone: the sessions' errors will say so
                proc = None
        try:
            await within(stop.wait(), SAMPLE_EVERY_S)
        except asyncio.TimeoutError:
            pass


def _merge(runs: list[LoadRun]) -> LoadRun:
    deadlines = [r.deadline for r in runs if r.deadline is not None]
    return LoadRun(
        sessions=sorted((s for r in runs for s in r.sessions), key=lambda s: s.index),
        started=min(r.started for r in runs),
        deadline=max(deadlines) if deadlines else None,
        finished=max(r.finished for r in runs),
        cpu_s=sum(r.cpu_s for r in runs),
    )


async def _snapshot_at(server: ServerHandle, when: float) -> Snapshot | None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))
    return await asyncio.to_thread(server.snapshot)


async def measure_point(server: ServerHandle, spec: LoadSpec, kinds: list[str],
                        workers: ClientWorkers | None = None) -> dict:
    """Run one session per entry of `kinds` (session i has kind kinds[i]); the point's summary."""
    sessions = list(enumerate(kinds))
    window_s = spec.settings.duration_s  # None: counted generations, no measured window
    # Over the measured window, its server figures are read as it opens and closes (told when
    # the sessions start); without one, at the point's start and end.
    before = None if window_s is not None else await asyncio.to_thread(server.snapshot)
    peaks, stop = Peaks(), asyncio.Event()
    sampler = asyncio.create_task(_sample(server, peaks, stop))
    loop = asyncio.get_running_loop()
    window: list[asyncio.Task] = []  # the server's metrics as the measured window opens and closes

    def read_the_window(*edges: float) -> None:
        window.extend(loop.create_task(_snapshot_at(server, when)) for when in edges)

    def on_start(started: float) -> None:  # from the workers' thread, or this one
        loop.call_soon_threadsafe(read_the_window, *measured_window(spec.settings, started))

    told = on_start if window_s is not None else None
    try:
        if workers is None:
            run = await run_sessions(spec, sessions, on_start=told)
        else:
            try:
                run = _merge(await asyncio.to_thread(workers.run, spec, sessions, told))
            except asyncio.CancelledError:  # Ctrl-C: asyncio.run would wait for the thread, and so for the point
                workers.abort()
                raise
        if window_s is not None:
            before, after = await asyncio.gather(*window)
    finally:
        stop.set()
        await sampler
        for task in window:
            task.cancel()
    if window_s is None:
        after = await asyncio.to_thread(server.snapshot)
    if before is None or after is None:  # no counts over the point: none of its server figures
        before = after = {}
        peaks.failed_reads += 1
    point = summarize(run, spec, before, after, peaks.kv_bytes, peaks.rss_bytes,
                      client_procs=len(workers) if workers else 1, server_span_s=window_s)
    point["server"]["metrics"] = ("not read" if not server.metrics_url else
                                  f"{peaks.failed_reads} read(s) failed" if peaks.failed_reads else "read")
    return point


def run_point(server: ServerHandle, spec: LoadSpec, kinds: list[str], workers: ClientWorkers | None = None) -> dict:
    return asyncio.run(measure_point(server, spec, kinds, workers))
