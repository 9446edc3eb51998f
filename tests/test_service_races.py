"""The stream handler where its reader and its own waits cross: a session the reader opened
is served or forgotten, never left in the worker (where it would hold a KV slot and count
against --max-sessions for good)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import grpc
import pytest

from specsplit.protocol.messages import ServerLimits, Verdict
from specsplit.protocol.server_session import ServerConnection
from specsplit.edge.retry import retry_delay
from specsplit.server import service
from specsplit.server.config import ServeConfig
from specsplit.server.engine import KVState
from specsplit.server.metrics import ServerMetrics
from specsplit.v1 import specsplit_pb2 as pb

OPEN = pb.EdgeMessage(open=pb.Open(prompt_ids=[1, 2], max_new_tokens=4)).SerializeToString()


class Worker:
    """What the handler asks of the verification worker; it never verifies."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(outbox_size=64, stalled_edge_s=30.0)
        self.engine = SimpleNamespace(new_state=lambda prompt: KVState())
        self.sessions: dict = {}
        self.notified = 0

    def held(self) -> int:
        return len(self.sessions)

    def add(self, handle) -> None:  # type: ignore[no-untyped-def]
        self.sessions[handle.session.session_id] = handle

    def remove(self, session_id: str) -> None:
        self.sessions.pop(session_id, None)

    def notify(self) -> None:
        self.notified += 1


def _service(worker: Worker) -> service.SpecSplitService:
    return service.SpecSplitService(worker, ServerLimits(vocab_size=100, max_context=100),  # type: ignore[arg-type]
                                    ServeConfig(idle_stream_s=0.1), ServerMetrics())


class _Context:
    """What the servicer asks of gRPC's context on these paths: the client's address."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:50000"


def test_an_open_read_as_the_wait_for_it_runs_out_is_served(monkeypatch) -> None:
    """The timed wait gives up, and before the handler sees it the reader takes the Open (the
    window between a timeout and its cancelled get): the session is served, not dropped."""
    arrived = asyncio.Event()
    real_within = service.within

    async def within_then_open(fut, timeout):  # type: ignore[no-untyped-def]
        try:
            return await real_within(fut, timeout)
        except asyncio.TimeoutError:
            arrived.set()
            for _ in range(5):
                await asyncio.sleep(0)  # the reader runs
            raise

    async def requests():  # type: ignore[no-untyped-def]
        await arrived.wait()
        yield OPEN
        await asyncio.sleep(60)

    async def main() -> tuple[str, int]:
        worker = Worker()
        stream = _service(worker).Generate(requests(), _Context())
        first = await stream.__anext__()
        await stream.aclose()  # the edge goes away
        return pb.ServerMessage.FromString(first.SerializeToString()).WhichOneof("kind"), len(worker.sessions)

    monkeypatch.setattr(service, "within", within_then_open)
    assert asyncio.run(main()) == ("opened", 0)


def test_a_session_opened_as_its_stream_goes_is_forgotten() -> None:
    """The edge goes away just after sending its next Open: the reader has opened the session,
    whose Opened the handler never sent. The worker forgets it with the stream."""
    finished = pb.EdgeMessage(open=pb.Open(prompt_ids=[1, 2], committed_ids=[3, 4], max_new_tokens=2))

    async def requests():  # type: ignore[no-untyped-def]
        yield finished.SerializeToString()  # done as it opens: Opened and Done at once
        yield OPEN
        await asyncio.sleep(60)

    async def main() -> tuple[list[str], int, float, float]:
        worker = Worker()
        svc = _service(worker)
        stream = svc.Generate(requests(), _Context())
        kinds = [(await stream.__anext__()).WhichOneof("kind") for _ in range(2)]
        while not worker.sessions:  # the second Open is read, its session opened
            await asyncio.sleep(0)
        await stream.aclose()
        ended = sum(svc.metrics.sessions_ended.labels(r)._value.get() for r in ("disconnected", "length"))
        return kinds, len(worker.sessions), svc.metrics.sessions_total._value.get(), ended

    # Counted opened as many times as ended: the second, whose Opened never went out, neither
    # (before: counted opened as the reader read it, and never ended).
    assert asyncio.run(main()) == (["opened", "done"], 0, 1, 1)


def test_an_outbox_that_gets_room_again_wakes_the_worker() -> None:
    """A session whose outbox is full is passed over, and looked at again only after the
    stall timeout; a session no drafts wake the worker for (mode none) sat that long idle
    once its edge had read the outbox down."""
    verdict = Verdict(start=2, tokens=(5,), accepted=0, proposed=0, candidate_tip=3)

    class FillingWorker(Worker):
        def add(self, handle) -> None:  # type: ignore[no-untyped-def]
            super().add(handle)
            while not handle.outbox.full():  # the verdicts of passes its edge has not read yet
                handle.outbox.put_nowait(verdict)

    async def requests():  # type: ignore[no-untyped-def]
        yield OPEN
        await asyncio.sleep(60)

    async def main() -> list[int]:
        worker = FillingWorker()
        worker.config.outbox_size = 8
        stream = _service(worker).Generate(requests(), _Context())
        notified = []
        for _ in range(8):  # its Opened, then the seven verdicts that filled the outbox, one by one
            await asyncio.wait_for(stream.__anext__(), 10)
            notified.append(worker.notified)
        await stream.aclose()
        return notified

    notified = asyncio.run(main())
    # Woken once, as the outbox falls to OUTBOX_ROOM free places, where the worker takes the session again.
    assert notified[-1] == 1 and notified[0] == 0, notified


@contextlib.contextmanager
def _service_log() -> Iterator[list[str]]:
    """The service's log lines (INFO and up) while the block runs."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("specsplit.server.service")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def _open_twice(next_open: asyncio.Event):  # type: ignore[no-untyped-def]
    """An edge's messages: an Open, and once `next_open` is set the next one; then nothing."""
    yield OPEN
    await next_open.wait()
    yield OPEN
    await asyncio.sleep(60)


def _ended_after_opened(mark: str) -> tuple[dict[str, float], list[str]]:
    """A session opened, then its stream ended by `mark`: the scheduler's stall (its handle
    marked, its task cancelled; also once it is done and the edge's next Open was read), the
    edge gone (during a drain too), or the drain's end."""
    next_open = asyncio.Event()

    async def main() -> service.SpecSplitService:
        worker = Worker()
        svc = _service(worker)
        stream = svc.Generate(_open_twice(next_open), _Context())
        assert (await stream.__anext__()).WhichOneof("kind") == "opened"
        if mark.startswith("stalled"):
            handle = next(iter(worker.sessions.values()))
            handle.stalled = True
            if mark == "stalled, then the next Open":
                handle.session.cancel()  # done as a Done that found no room leaves it
                next_open.set()
                for _ in range(1000):
                    if len(worker.sessions) == 2:
                        break
                    await asyncio.sleep(0)
        svc.draining = mark in ("shutdown", "gone while draining")
        svc.cutting = mark == "shutdown"  # the drain, at its end
        await stream.aclose()
        assert not worker.sessions, mark  # every session it took in (both, after the next Open)
        return svc

    with _service_log() as records:
        svc = asyncio.run(main())
    ended = {r: svc.metrics.sessions_ended.labels(r)._value.get() for r in ("stalled", "disconnected", "shutdown")}
    return ended, records


def test_how_a_session_without_its_done_ended_is_counted_and_logged_with_its_client() -> None:
    for mark in ("stalled", "stalled, then the next Open"):
        # The next Open's reader removed the stalled session: its end was counted as the edge gone.
        ended, lines = _ended_after_opened(mark)
        assert ended == {"stalled": 1, "disconnected": 0, "shutdown": 0}, mark
        assert any("from ipv4:127.0.0.1:50000: ended (the edge stopped reading)" in line for line in lines), lines
    ended, lines = _ended_after_opened("disconnected")
    assert ended == {"stalled": 0, "disconnected": 1, "shutdown": 0}
    assert any("from ipv4:127.0.0.1:50000: ended (the edge went away) after 0 new tokens" in line for line in lines)
    ended, lines = _ended_after_opened("gone while draining")  # left during the grace: gone, and logged so
    assert ended == {"stalled": 0, "disconnected": 1, "shutdown": 0}
    assert any("ended (the edge went away)" in line for line in lines)
    ended, lines = _ended_after_opened("shutdown")  # the drain's own warning names it
    assert ended == {"stalled": 0, "disconnected": 0, "shutdown": 1} and not any("ended (" in line for line in lines)


def test_a_closed_session_leaves_the_worker_at_once() -> None:
    """Open, Close, Open, Close ... on one kept stream: each closed session stayed in the
    worker, holding its KV cache and its place under --max-sessions, until every place was
    taken and the server refused everyone."""
    close = pb.EdgeMessage(close=pb.Close()).SerializeToString()
    sent: asyncio.Queue = asyncio.Queue()

    async def requests():  # type: ignore[no-untyped-def]
        while (message := await sent.get()) is not None:
            yield message

    async def main() -> list[int]:
        worker = Worker()
        stream = _service(worker).Generate(requests(), _Context())
        held = []
        for _ in range(3):
            await sent.put(OPEN)
            assert (await stream.__anext__()).WhichOneof("kind") == "opened"
            await sent.put(close)
            assert (await stream.__anext__()).WhichOneof("kind") == "done"
            held.append(worker.held())
        await stream.aclose()
        return held

    assert asyncio.run(main()) == [0, 0, 0]


def _reopen_over_a_finished_session(max_sessions: int, outbox: asyncio.Queue) -> list[str]:
    """A kept stream's session done as a delivery that found its outbox full leaves it (still
    in the worker), then the edge's next Open; what the worker holds once the stream is cut."""
    next_open = asyncio.Event()

    async def main() -> list[str]:
        worker = Worker()
        svc = service.SpecSplitService(worker, ServerLimits(vocab_size=100, max_context=100),  # type: ignore[arg-type]
                                       ServeConfig(max_sessions=max_sessions), ServerMetrics())
        conn = ServerConnection(svc.limits, "s")
        reader = asyncio.create_task(svc._read(_open_twice(next_open), conn, outbox, asyncio.current_task()))
        for _ in range(1000):
            if worker.sessions:
                break
            await asyncio.sleep(0)
        worker.sessions["s"].session.cancel()  # done as a delivery leaves it: still in the worker
        while outbox.maxsize and not outbox.full():
            outbox.put_nowait("unread")  # a bounded outbox: the edge no longer reads
        next_open.set()
        for _ in range(1000):
            if "s.2" in worker.sessions or reader.done():
                break
            await asyncio.sleep(0)
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        return sorted(worker.sessions)

    return asyncio.run(main())


@pytest.mark.parametrize("max_sessions", [1, 64])
def test_a_finished_session_the_worker_still_holds_leaves_it_at_the_next_open(max_sessions: int) -> None:
    """The edge's next Open came in the same loop turn as a full outbox left its finished
    session in the worker: the servicer removed only the session then open, and the finished
    one held its KV cache and its place under --max-sessions for good; at a limit of one, it
    also took the place of that very Open, which was refused as a full server's."""
    assert _reopen_over_a_finished_session(max_sessions, asyncio.Queue()) == ["s.2"]


def test_a_finished_session_leaves_the_worker_even_if_the_next_open_never_gets_out() -> None:
    """The next Open's Opened waited for room in an outbox its edge no longer read, and the
    stream was cut meanwhile: the finished session, removed only after that wait, stayed."""
    assert _reopen_over_a_finished_session(64, asyncio.Queue(maxsize=4)) == []


def test_close_then_open_at_once_logs_each_session_with_its_own_request() -> None:
    """Close and the next Open sent together: the reader had opened the next session before the
    handler sent the first's Opened, and the first's "opened" line told of the next one's
    prompt; if the edge then went away, the first's end was counted with the next's tokens."""
    second = pb.EdgeMessage(open=pb.Open(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=9)).SerializeToString()
    close = pb.EdgeMessage(close=pb.Close()).SerializeToString()

    async def requests():  # type: ignore[no-untyped-def]
        for message in (OPEN, close, second):
            yield message
        await asyncio.sleep(60)


    async def main() -> list[str]:
        stream = _service(Worker()).Generate(requests(), _Context())
        kinds = [(await asyncio.wait_for(stream.__anext__(), 10)).WhichOneof("kind") for _ in range(3)]
        await stream.aclose()
        return kinds

    with _service_log() as records:
        assert asyncio.run(main()) == ["opened", "done", "opened"]
    opened = [line for line in records if ": opened (" in line]
    assert len(opened) == 2, records
    assert "a prompt of 2 tokens, up to 4 new" in opened[0] and "a prompt of 5 tokens, up to 9 new" in opened[1]


class _AbortingContext(_Context):
    """gRPC's context as far as an abort: it ends the handler, as grpc.aio's does."""

    async def abort(self, code, details, trailing_metadata=()):  # type: ignore[no-untyped-def]
        raise _Aborted(code, details)


class _Aborted(Exception):
    def __init__(self, code, details) -> None:  # type: ignore[no-untyped-def]
        super().__init__(code, details)
        self.code, self.details = code, details


def test_a_fault_of_the_server_reading_the_stream_fails_the_call() -> None:
    """The server's own error while it takes in a message (here the engine's, as the session
    opens) ends the call with INTERNAL; before, the reader died and the call waited for good."""

    def broken(prompt):  # type: ignore[no-untyped-def]
        raise TypeError("a bug in the engine")

    async def requests():  # type: ignore[no-untyped-def]
        yield OPEN
        await asyncio.sleep(60)

    async def main() -> _Aborted:
        worker = Worker()
        worker.engine = SimpleNamespace(new_state=broken)
        stream = _service(worker).Generate(requests(), _AbortingContext())
        try:
            for _ in range(3):  # its Opened went out before the engine was asked
                await asyncio.wait_for(stream.__anext__(), 10)
        except _Aborted as exc:
            return exc
        raise AssertionError("the call went on")

    aborted = asyncio.run(main())
    assert aborted.code.name == "INTERNAL"
    # Said to be the server's own fault, not its target's (which it was worded as before); an
    # edge retries neither.
    assert aborted.details.startswith("server fault: ") and "a bug in the engine" in aborted.details
    assert retry_delay(grpc.aio.AioRpcError(aborted.code, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                            aborted.details), 1.0) is None


def test_a_finished_resume_is_answered_by_a_full_or_draining_server() -> None:
    """A generation whose Done was lost re-opens with committed ids that end it (here in EOS):
    it needs no cache, no pass and no place. A full server refused it (RESOURCE_EXHAUSTED), a
    draining one sent it elsewhere, and an edge of a server that stayed full spent its retries
    on a generation that had every token."""
    resumed = pb.EdgeMessage(open=pb.Open(prompt_ids=[1, 2], max_new_tokens=8, committed_ids=[5, 0]))

    async def requests():  # type: ignore[no-untyped-def]
        yield resumed.SerializeToString()
        await asyncio.sleep(60)

    async def answers(draining: bool) -> list[str]:
        worker = Worker()
        worker.sessions["another"] = object()  # the server holds its limit: one session
        svc = service.SpecSplitService(worker, ServerLimits(vocab_size=100, max_context=100, eos_ids=(0,)),  # type: ignore[arg-type]
                                       ServeConfig(max_sessions=1), ServerMetrics())
        svc.draining = draining
        stream = svc.Generate(requests(), _AbortingContext())
        got = [(await asyncio.wait_for(stream.__anext__(), 10)).WhichOneof("kind") for _ in range(2)]
        await stream.aclose()
        return got

    assert asyncio.run(answers(draining=False)) == ["opened", "done"]
    assert asyncio.run(answers(draining=True)) == ["opened", "done"]


def test_a_session_whose_opened_waits_for_room_holds_its_place() -> None:
    """The limit was checked before the Opened went into the outbox and the session into the
    worker after: an edge that did not read held its Open's place nowhere while that put
    waited, and another Open took it too, one more session than the server's caches."""
    async def main() -> list:
        worker = Worker()
        svc = service.SpecSplitService(worker, ServerLimits(vocab_size=100, max_context=100),  # type: ignore[arg-type]
                                       ServeConfig(max_sessions=1), ServerMetrics())

        async def one_open():  # type: ignore[no-untyped-def]
            yield OPEN
            await asyncio.sleep(60)

        full: asyncio.Queue = asyncio.Queue(maxsize=1)
        full.put_nowait("an earlier generation's Done, unread")
        stalled = asyncio.create_task(svc._read(one_open(), service.ServerConnection(svc.limits, "a"), full,
                                                asyncio.current_task()))  # type: ignore[arg-type]
        for _ in range(5):
            await asyncio.sleep(0)  # it waits to put its Opened
        outbox: asyncio.Queue = asyncio.Queue()
        second = asyncio.create_task(svc._read(one_open(), service.ServerConnection(svc.limits, "b"), outbox,
                                               asyncio.current_task()))  # type: ignore[arg-type]
        first = await asyncio.wait_for(outbox.get(), 5)
        full.get_nowait()  # the first edge reads again: its session goes into the worker
        for _ in range(5):
            await asyncio.sleep(0)
        for task in (stalled, second):
            task.cancel()
        return [type(first).__name__, len(worker.sessions)]

    assert asyncio.run(main()) == ["ServerBusy", 1]
