"""One point of the sweep: a set of sessions against the server, with the server's
metrics scraped before and after and its KV memory and RSS sampled during the run."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import psutil

from loadtest.scrape import Snapshot, scrape, value
from loadtest.sessions import LoadRun, LoadSpec, run_sessions
from loadtest.summary import summarize
from loadtest.workers import ClientWorkers

SAMPLE_EVERY_S = 0.5


@dataclass(frozen=True)
class ServerHandle:
    address: str  # host:port of the gRPC service
    pid: int
    metrics_url: str  # http://host:port/metrics


@dataclass
class Peaks:
    kv_bytes: float = 0.0
    rss_bytes: float = 0.0
    samples: int = 0


async def _sample(server: ServerHandle, peaks: Peaks, stop: asyncio.Event) -> None:
    proc = psutil.Process(server.pid)
    while not stop.is_set():
        snap: Snapshot = await asyncio.to_thread(scrape, server.metrics_url)
        peaks.kv_bytes = max(peaks.kv_bytes, value(snap, "specsplit_kv_cache_bytes") or 0.0)
        peaks.rss_bytes = max(peaks.rss_bytes, proc.memory_info().rss)
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
    before = await asyncio.to_thread(scrape, server.metrics_url)
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
    after = await asyncio.to_thread(scrape, server.metrics_url)
    return summarize(run, spec, before, after, peaks.kv_bytes, peaks.rss_bytes,
                     client_procs=len(workers) if workers else 1)


def run_point(server: ServerHandle, spec: LoadSpec, kinds: list[str], workers: ClientWorkers | None = None) -> dict:
    return asyncio.run(measure_point(server, spec, kinds, workers))
