"""One Generate call that carries a device's generations one after another.

A new call waits in the server's queue of calls not yet taken, which under hundreds of
devices took longer than the first verification (docs/capacity.md); a message on a call the
server already serves does not. So a device keeps its call between generations and sends its
next Open on it (the protocol allows a new Open once the last session is Done), and starts a
new call only when it has none, after a failure, or once the server has ended an idle one.
Given several servers it keeps to the one that served it last, and moves on to the next
only after a failure (a generation's retry, client.generate).
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import grpc

from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc


class GenerateStream:
    """A device's Generate call, kept for its generations one after another (client.generate),
    on the first of its servers (stubs) until fail_over."""

    def __init__(self, *stubs: pb_grpc.SpecSplitStub) -> None:
        if not stubs:
            raise ValueError("a stream needs a server")
        self._stubs = stubs
        self.server = 0  # index of the server (stub) that the next call goes to
        self._call: grpc.aio.StreamStreamCall | None = None
        self._outgoing: asyncio.Queue[pb.EdgeMessage | None] = asyncio.Queue()
        self._carrying = False
        self._writing_done = False  # the call is half-closed: read to its end, never sent on again

    @property
    def servers(self) -> int:
        """How many servers the stream fails over along."""
        return len(self._stubs)

    @classmethod
    def on(cls, *channels: grpc.aio.Channel) -> GenerateStream:
        return cls(*(pb_grpc.SpecSplitStub(channel) for channel in channels))

    @contextlib.contextmanager
    def carrying(self) -> Iterator[None]:
        """Held by the generation on the stream. Its sessions follow one another: a second
        generation at once would send its Open into the first's session (refused), and the
        first's failure would cancel the second's call."""
        if self._carrying:
            raise RuntimeError("this GenerateStream carries another generation: it takes one at a time "
                               "(give each concurrent generation a stream of its own)")
        self._carrying = True
        try:
            yield
        finally:
            self._carrying = False

    @property
    def call(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            raise RuntimeError("no call: begin() first")
        return self._call

    def begin(self, metadata: tuple[tuple[str, str], ...] = ()) -> bool:
        """Make sure a call is open for the next generation; True if this started a new one."""
        if self._call is not None and not self._call.done() and not self._writing_done:
            return False
        if self._call is not None and not self._writing_done:
            # The call ended (the server's idle timeout, say) with its request stream open:
            # gRPC's task sending it waits on its queue until it ends, one task per call.
            self._outgoing.put_nowait(None)
        self._outgoing, self._writing_done = asyncio.Queue(), False
        self._call = self._stubs[self.server].Generate(self._requests(self._outgoing), metadata=metadata or None)
        return True

    @staticmethod
    async def _requests(outgoing: asyncio.Queue[pb.EdgeMessage | None]) -> AsyncIterator[pb.EdgeMessage]:
        """The request stream. gRPC's own task sends it, so a message still queued when the
        server ends the call is dropped quietly instead of failing the call (a direct write
        racing the server's final status turns that status into INTERNAL)."""
        while (msg := await outgoing.get()) is not None:
            yield msg

    def send(self, msg: pb.EdgeMessage) -> None:
        self._outgoing.put_nowait(msg)

    def finish_writing(self) -> None:
        """Half-close the call but keep it, to read to its end and to cancel on a failure:
        the server finishes the open session without drafts, then ends the call; the next
        generation begins a new one."""
        if self._call is not None and not self._writing_done:
            self._outgoing.put_nowait(None)
            self._writing_done = True

    def close(self) -> None:
        """Half-close: the server finishes the open session, if any, and ends the call."""
        if self._call is not None:
            self._outgoing.put_nowait(None)
            self._call = None

    def fail_over(self) -> None:
        """After a failed call: the next goes to the next server, or, with one, to the same
        (its channel reconnects by itself)."""
        self.abort()
        self.server = (self.server + 1) % len(self._stubs)

    def abort(self) -> None:
        """Cancel the call (after a failure, or a generation given up); the next begins anew."""
        if self._call is not None:
            self._call.cancel()
            self.close()
