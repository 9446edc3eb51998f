"""Load-generator processes, for when one process cannot keep up.

One asyncio process drives the sessions on about one core (the GIL); with more client
cores, sessions are spread over worker processes, each pinned to one of them. The
workers live for the whole sweep so that their start-up is never timed, and every point's
sessions start at one moment in all of them: each worker builds its sessions, says so, and
is given the common start. Started as each received its share, the processes' windows
were staggered, and the ones that began late ran their last seconds beside a server the
others had already left, faster than the point's load allows.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait

from loadtest.sessions import LoadRun, LoadSpec, build_sessions, run_built

READY, CANCEL = "ready", "cancel"
# From the last worker's READY to the common start: time for the start to reach them all.
START_LEAD_S = 0.2


def _serve(conn: Connection, core: int | None, process: int) -> None:
    # Ctrl-C reaches the whole process group: the parent decides what it stops (close()).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if core is not None:
        os.sched_setaffinity(0, {core})
    while (job := conn.recv()) is not None:
        spec, sessions, total = job
        try:
            edges = build_sessions(spec, sessions, process)  # ONNX drafters take a while: before the start
        except Exception as exc:  # told to the parent, which calls the point off in every worker
            conn.send(f"could not build its sessions: {exc!r}")
            continue
        conn.send(READY)
        started = conn.recv()  # time.monotonic() is the machine's clock, one for every process
        if started != CANCEL:
            conn.send(asyncio.run(run_built(spec, edges, total, started)))


class ClientWorkers:
    def __init__(self, procs: int, cores: Sequence[int]) -> None:
        if procs < 2:
            raise ValueError("worker processes are for two or more; one runs in the main process")
        ctx = mp.get_context("spawn")  # no fork of a process holding gRPC and ONNX Runtime threads
        self._conns: list[Connection] = []
        self._procs = []
        for i in range(procs):
            parent, child = ctx.Pipe()
            core = cores[i % len(cores)] if cores else None
            proc = ctx.Process(target=_serve, args=(child, core, i), daemon=True, name=f"loadgen-{i}")
            proc.start()
            child.close()  # the worker's end: with it closed here, a dead worker reads as one
            self._conns.append(parent)
            self._procs.append(proc)

    def __len__(self) -> int:
        return len(self._procs)

    def _answer(self, i: int) -> object:
        """Worker i's next message; RuntimeError where the worker died instead."""
        conn, proc = self._conns[i], self._procs[i]
        wait([conn, proc.sentinel])
        if conn.poll():
            return conn.recv()
        raise RuntimeError(f"load-generator process {i} died (exit code {proc.exitcode})")

    def run(self, spec: LoadSpec, sessions: list[tuple[int, str]],
            on_start: Callable[[float], None] | None = None) -> list[LoadRun]:
        """Blocking: deal the sessions round-robin to the workers, start them all at once
        when all are built (`on_start` is told when), and wait for all of them. Raises
        RuntimeError, the point called off in every worker, where one could not build its
        sessions or died."""
        busy = []
        for i, conn in enumerate(self._conns):
            part = sessions[i :: len(self._conns)]
            if part:
                conn.send((spec, part, len(sessions)))
                busy.append(i)
        answers: dict[int, object] = {}
        problems = []
        for i in busy:
            try:
                answers[i] = self._answer(i)
            except RuntimeError as exc:
                problems.append(str(exc))
        problems += [f"load-generator process {i} {said}" for i, said in answers.items() if said != READY]
        if problems:
            for i, said in answers.items():
                if said == READY:
                    self._conns[i].send(CANCEL)
            raise RuntimeError("; ".join(problems))
        started = time.monotonic() + START_LEAD_S
        for i in busy:
            self._conns[i].send(started)
        if on_start is not None:
            on_start(started)
        return [self._answer(i) for i in busy]  # type: ignore[misc]

    def abort(self) -> None:
        """End the workers now, in the middle of a point (Ctrl-C): a run() waiting for them
        then raises RuntimeError instead of waiting for the point's end."""
        for proc in self._procs:
            proc.terminate()

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:  # a worker that died has no pipe left to tell
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
