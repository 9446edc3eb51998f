"""One point of the sweep: a set of sessions against the server, with the server's
metrics scraped before and after and its KV memory and RSS sampled during the run (where
the load test can see them: a server it did not start has no RSS here, and one whose
metrics it is not given has no server figures)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import psutil

from loadtest.connection import ServerConnection
from loadtest.scrape import Snapshot, scrape, value
from loadtest.sessions import LoadRun, LoadSpec, run_sessions
from loadtest.summary import summarize
from loadtest.workers import ClientWorkers

SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True)
class ServerHandle:
    connection: ServerConnection
    pid: int | None  # None: a server on another machine (or one this load test did not start)
    metrics_url: str | None  # http://host:port/metrics; None: not read

    def snapshot(self) -> Snapshot:
        return scrape(self.metrics_url) if self.metrics_url else {}


@dataclass
class Peaks:
    kv_bytes: float | None = None
    rss_bytes: float | None = None
    samples: int = 0


def _higher(peak: float | None, seen: float | None) -> float | None:
    return peak if seen is None else max(peak or 0.0, seen)


async def _sample(server: ServerHandle, peaks: Peaks, stop: asyncio.Event) -> None:
    proc = psutil.Process(server.pid) if server.pid is not None else None
    while not stop.is_set():
        if server.metrics_url:
            snap: Snapshot = await asyncio.to_thread(scrape, server.metrics_url)
            peaks.kv_bytes = _higher(peaks.kv_bytes, value(snap, "specsplit_kv_cache_bytes") or 0.0)
        if proc is not None:
            peaks.rss_bytes = _higher(peaks.rss_bytes, proc.memory_info().rss)
        peaks.samples += 1
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
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


async def measure_point(server: ServerHandle, spec: LoadSpec, kinds: list[str],
                        workers: ClientWorkers | None = None) -> dict:
    """Run one session per entry of `kinds` (session i has kind kinds[i]); the point's summary."""
    sessions = list(enumerate(kinds))
    before = await asyncio.to_thread(server.snapshot)
    peaks, stop = Peaks(), asyncio.Event()
    sampler = asyncio.create_task(_sample(server, peaks, stop))
    try:
        if workers is None:
            run = await run_sessions(spec, sessions)
        else:
            run = _merge(await asyncio.to_thread(workers.run, spec, sessions))
    finally:
        stop.set()
        await sampler
    after = await asyncio.to_thread(server.snapshot)
    return summarize(run, spec, before, after, peaks.kv_bytes, peaks.rss_bytes,
                     client_procs=len(workers) if workers else 1)


def run_point(server: ServerHandle, spec: LoadSpec, kinds: list[str], workers: ClientWorkers | None = None) -> dict:
    return asyncio.run(measure_point(server, spec, kinds, workers))
