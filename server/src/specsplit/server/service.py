"""The grpc.aio service: moves messages between each stream and the protocol core."""
from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import NamedTuple

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.common.address import bracketed, is_loopback
from specsplit.common.aio import within
from specsplit.protocol import codec, errors
from specsplit.protocol.messages import Close, Done, Opened, OpenRequest, ServerLimits, Verdict
from specsplit.protocol.server_session import ServerConnection, ServerSession
from specsplit.server.auth import BearerTokenInterceptor, bearer_token
from specsplit.server.config import OUTBOX_ROOM, SchedulerConfig, ServeConfig
from specsplit.server.engine import Engine
from specsplit.server.idle_streams import GRACE_S, Evicted, IdleStreams, TrimTimer
from specsplit.server.listeners import MAX_MESSAGE_BYTES, BindError, bind_listeners
from specsplit.server.log_throttle import LogThrottle, client_of
from specsplit.server.loop_lag import watch_loop_lag
from specsplit.server.metrics import ServerMetrics
from specsplit.server.pace import PaceLog
from specsplit.server.scheduler import SessionHandle, VerificationWorker
from specsplit.server.sources import served_name
from specsplit.server.write_watch import WriteWatch
from specsplit.v1 import specsplit_pb2 as pb

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpecSplit"].full_name
HALF_CLOSED = object()  # put in a stream's outbox once the edge sends nothing more


def server_limits(engine: Engine, cfg: ServeConfig) -> ServerLimits:
    loaded = engine.loaded
    return ServerLimits(
        vocab_size=engine.vocab_size,
        max_context=min(cfg.max_context or engine.max_context, engine.max_context),
        max_lookahead=cfg.max_lookahead,
        max_new_tokens=cfg.max_new_tokens,
        eos_ids=loaded.eos_ids,
        target_model=cfg.model_name or served_name(loaded.name),
        tokenizer_fingerprint=loaded.fingerprint,
    )


class _Opening(NamedTuple):
    """An Opened in a stream's outbox, with its session: by the time it goes out the stream's
    next session may be open (an edge that sends Close and its next Open at once), and the
    log line and counts of the one it opens are that one's."""
    opened: Opened
    session: ServerSession


class _ReaderFault(Exception):
    """The server's own failure on a message its stream's reader took in; any other exception
    in an outbox is the verification worker's (its target failed the session)."""


class SpecSplitService:
    def __init__(
        self, worker: VerificationWorker, limits: ServerLimits, cfg: ServeConfig, metrics: ServerMetrics
    ) -> None:
        self.worker = worker
        self.limits = limits
        self.cfg = cfg
        self.metrics = metrics
        self.draining = False
        # Sessions admitted whose Opened waits for room in their outbox (an edge not reading),
        # not yet in the worker: their places under --max-sessions are taken all the same.
        self.admitting = 0
        # Set once the drain ends the sessions left: an edge that goes away before then went
        # away (and is logged so), not cut off by the shutdown.
        self.cutting = False
        self.throttle = LogThrottle()
        metrics.sessions_limit.set(cfg.max_sessions)
        # Half the timeout where that is shorter than the grace: the timeout ends streams anyway.
        self.idle = IdleStreams(cfg.max_idle_streams, min(GRACE_S, cfg.idle_stream_s / 2))
        metrics.streams_idle.set_function(lambda: len(self.idle))
        self.trimmer = TrimTimer(self.idle)
        self.writes = WriteWatch(worker.config.stalled_edge_s)

    async def _read(
        self, requests: AsyncIterator[bytes], conn: ServerConnection, outbox: asyncio.Queue, stream_task: asyncio.Task
    ) -> None:
        """Feed the edge's messages to the core; errors go to the outbox as exceptions, and
        HALF_CLOSED once the edge sends nothing more.

        Requests arrive as raw bytes so that a message that does not parse is answered
        with INVALID_ARGUMENT instead of the framework's INTERNAL."""
        pace: PaceLog | None = None  # the device's, carried from one generation on the stream to the next
        try:
            async for raw in requests:
                if len(raw) > self.cfg.max_message_bytes:
                    raise errors.MessageTooLarge(f"message of {len(raw)} bytes exceeds this server's limit of "
                                                 f"{self.cfg.max_message_bytes} bytes")
                try:
                    msg = pb.EdgeMessage.FromString(raw)
                except DecodeError:
                    raise errors.MalformedMessage("message does not parse as a specsplit.v1.EdgeMessage") from None
                event = codec.edge_from_pb(msg)
                opening = isinstance(event, OpenRequest) and conn.idle
                previous = conn.session
                # An Open is validated here, before admission: a malformed one is refused as
                # such, full server or not, not with a status the edge would retry.
                out = conn.receive(event)
                if previous is not None and conn.session is not previous:
                    # The stream's last session is done, but the worker may hold it still
                    # (its last delivery found a full outbox). It goes before admission counts
                    # places, and before any wait: a refused or cut-off Open must not leave
                    # it held, nor its place taken from this very Open. A stalled one (its
                    # Done found no room) is left to its servicer, which the stall is ending
                    # and which counts and logs the end so.
                    handle = self.worker.sessions.get(previous.session_id)
                    if handle is None or not handle.stalled:
                        self.worker.remove(previous.session_id)
                # A resumed generation that is already over (its Done was lost) is answered
                # here and now: it takes no cache and no place, so a full or draining server
                # need not send it away to retry for nothing.
                admitted = opening and not conn.idle
                if admitted:
                    if self.draining:
                        self.metrics.sessions_refused.labels("draining").inc()
                        raise errors.ServerDraining("server is shutting down; open the session on another server")
                    if self.worker.held() + self.admitting >= self.cfg.max_sessions:
                        self.metrics.sessions_refused.labels("full").inc()
                        raise errors.ServerBusy(
                            f"server holds its limit of {self.cfg.max_sessions} sessions; retry later"
                        )
                    self.admitting += 1
                try:
                    for item in out:
                        await outbox.put(_Opening(item, conn.session) if isinstance(item, Opened) else item)
                finally:
                    if admitted:
                        self.admitting -= 1
                if isinstance(event, OpenRequest) and not conn.idle:
                    assert conn.session is not None
                    pace = PaceLog.for_next(pace, time.monotonic())
                    kv = self.worker.engine.new_state(conn.session.request.prompt_ids)
                    if kv.tokens:
                        self.metrics.prefix_cache_hits.inc()
                        self.metrics.prefix_cache_tokens.inc(len(kv.tokens))
                    self.worker.add(SessionHandle(conn.session, outbox, kv=kv, stream_task=stream_task, pace=pace))
                elif isinstance(event, Close) and conn.session is not None:
                    # Cancelled: its cache and its place under --max-sessions go now (a kept
                    # stream's next Open would otherwise leave them held for good).
                    self.worker.remove(conn.session.session_id)
                else:
                    self.worker.notify()
            if conn.session is None:
                raise errors.ClosedBeforeOpen("the stream was half-closed before an Open message")
            handle = self.worker.sessions.get(conn.session.session_id)
            if handle is not None:  # the edge sends nothing more: the server decodes the rest itself
                handle.sending = False
                self.worker.notify()
            await outbox.put(HALF_CLOSED)
        except errors.ProtocolError as exc:
            await outbox.put(exc)
        except Exception as exc:  # the server's own fault: the call fails with it rather than wait on the outbox
            log.exception("stream %s: the server failed on one of its messages", conn.stream_id)
            await outbox.put(_ReaderFault(f"failed on a message of the stream ({exc!r})"))

    async def Generate(  # noqa: N802 (gRPC's method name)
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ServerMessage]:
        """One stream: its sessions one after another. It ends once the edge has half-closed
        and no session is open, or when it has stayed idle after a Done for idle_stream_s or
        is the longest idle of more than max_idle_streams. A stream whose Open does not come
        within idle_stream_s ends with DEADLINE_EXCEEDED."""
        conn = ServerConnection(self.limits, uuid.uuid4().hex[:12])
        stream_task = asyncio.current_task()
        assert stream_task is not None
        peer = context.peer()
        device = self._device(context)
        outbox: asyncio.Queue = asyncio.Queue(maxsize=self.worker.config.outbox_size)
        reader = asyncio.create_task(self._read(request_iterator, conn, outbox, stream_task))
        session: str | None = None  # the open session's id, from its Opened to its Done
        current: ServerSession | None = None  # and the session
        opened_len = resumed = 0  # the open session's, so that its log lines count the tokens it generated
        half_closed = False
        reason = "disconnected"
        try:
            while True:
                if session is None:  # before the first Open, or between sessions
                    try:
                        item = await within(outbox.get(), self.cfg.idle_stream_s)
                    except asyncio.TimeoutError:
                        if not outbox.empty():
                            continue  # an Open was read as the wait ran out
                        if conn.session is not None:
                            self.metrics.idle_streams_ended.labels("timeout").inc()
                            return
                        item = errors.OpenTimeout(f"no Open message within {self.cfg.idle_stream_s:g} s")
                    if isinstance(item, Evicted) and item.opens == conn.opens:
                        self.metrics.idle_streams_ended.labels("limit").inc()
                        return
                    self.idle.discard(conn.stream_id)
                else:
                    item = await outbox.get()
                    if outbox.qsize() == outbox.maxsize - OUTBOX_ROOM:
                        # Room again: the worker, which passes over a session whose outbox is
                        # full, may take it now rather than when it would look again (after
                        # --stalled-edge-timeout, for a session no drafts wake it for).
                        self.worker.notify()
                if isinstance(item, Evicted):
                    continue  # told to end before its latest Open: that idle spell is over
                if item is HALF_CLOSED:
                    if session is None:
                        return
                    half_closed = True
                    continue  # the session goes on without drafts; its Done follows
                if isinstance(item, errors.ProtocolError):
                    reason = "error"
                    self.metrics.errors.labels(item.status).inc()
                    # Before an Opened there is no session: the stream is what failed.
                    what = f"session {session}" if session else f"stream {conn.stream_id}"
                    self._client_failed(peer, item.status, f"{what}: {item.status}: {item.message}", session, device)
                    pushback = () if item.retry_after_s is None else \
                        ((errors.PUSHBACK_METADATA, str(round(item.retry_after_s * 1000))),)
                    await context.abort(grpc.StatusCode[item.status], item.message, pushback)
                if isinstance(item, Exception):
                    reason = "error"
                    self.metrics.errors.labels("INTERNAL").inc()
                    what = errors.SERVER_FAULT if isinstance(item, _ReaderFault) else errors.VERIFICATION_FAILED
                    await context.abort(grpc.StatusCode.INTERNAL, f"{what}: {item}")
                if isinstance(item, _Opening):
                    current, item = item.session, item.opened
                    session = item.session_id
                    opened_len, resumed = current.floor, current.floor - current.prompt_len
                    req = current.request
                    log.info("session %s from %s: opened (%s, a prompt of %d tokens, up to %d new%s)", session,
                             _client(peer, device), req.draft_mode.name.lower(), len(req.prompt_ids),
                             req.max_new_tokens, f", resumed after {resumed}" if resumed else "",
                             extra={"session": session, "device": device})
                    # Counted as its Opened goes out, where it is also counted active, so that
                    # every session counted opened is counted ended (one whose Opened never went
                    # out, its stream gone, is neither).
                    self.metrics.sessions_total.inc()
                    self.metrics.sessions_active.inc()
                elif isinstance(item, Verdict):
                    self.metrics.tokens_committed.inc(len(item.tokens))
                    self.metrics.drafts_proposed.inc(item.proposed)
                    self.metrics.drafts_accepted.inc(item.accepted)
                self.writes.begin(stream_task)
                yield codec.server_to_pb(item)
                self.writes.done(stream_task)
                if isinstance(item, Done):
                    log.info("session %s from %s: done (%s): %s", session, _client(peer, device),
                             item.reason.name.lower(), _new_tokens(item.committed_length - opened_len, resumed),
                             extra={"session": session, "device": device})
                    self._ended(item.reason.name.lower())
                    session = current = None
                    if half_closed:
                        return
                    self.trimmer.after(self.idle.add(conn.stream_id, outbox, conn.opens, time.monotonic()))
        finally:
            reader.cancel()
            self.idle.discard(conn.stream_id)
            if self.writes.forget(stream_task):  # only a session's messages are written
                reason = "stalled"
            # The session whose Opened went out (a stalled one the reader left, its next Open
            # read), and the one the reader took in last (its Opened may not have gone out: an
            # Open read as the stream ended): the worker may hold either, or both be one.
            for held in (current, conn.session):
                if held is None:
                    continue
                handle = self.worker.sessions.get(held.session_id)
                if handle is not None and handle.stalled:
                    reason = "stalled"
                self.worker.remove(held.session_id)
            if conn.session is not None:
                conn.session.cancel()
            if session is not None:
                if reason == "disconnected" and self.cutting:
                    reason = "shutdown"  # ended by the drain, which has logged it
                elif reason in ("disconnected", "stalled") and current is not None:  # (errors are logged)
                    why = "the edge went away" if reason == "disconnected" else "the edge stopped reading"
                    log.info("session %s from %s: ended (%s) after %s", session, _client(peer, device), why,
                             _new_tokens(current.committed_len - opened_len, resumed),
                             extra={"session": session, "device": device})
                self._ended(reason)

    def _device(self, context: grpc.aio.ServicerContext) -> str | None:
        """The device whose token the call carries (auth checked it), where tokens are asked."""
        token = None if self.cfg.tokens is None else bearer_token(context.invocation_metadata())
        return None if token is None else self.cfg.tokens.get(token)

    def _client_failed(self, peer: str, status: str, what: str, session: str | None = None,
                       device: str | None = None) -> None:
        """One line for a client's failed call, at most one per client and status in
        LogThrottle's interval."""
        held = self.throttle.allow(f"{client_of(peer)} {status}")
        if held is not None:
            more = f" ({held} like it not logged since)" if held else ""
            log.info("%s (from %s)%s", what, _client(peer, device), more, extra={"session": session, "device": device})

    def refused(self, code: grpc.StatusCode, peer: str, message: str) -> None:
        """A call the token check refused (auth.OnRefusal)."""
        self.metrics.errors.labels(code.name).inc()
        self._client_failed(peer, code.name, f"call refused: {code.name}: {message}")

    def _ended(self, reason: str) -> None:
        self.metrics.sessions_active.dec()
        self.metrics.sessions_ended.labels(reason).inc()


def _security(cfg: ServeConfig) -> str:
    """What the startup line says of who may connect: the log shows the setup it serves with."""
    tls = "" if cfg.tls is None else " with mutual TLS" if cfg.tls.client_ca else " with TLS"
    if cfg.tokens is None:
        return tls
    devices = len(set(cfg.tokens.values()))
    return f"{tls}{' and' if tls else ' with'} the tokens of {devices} device{'s' if devices != 1 else ''}"


def _client(peer: str, device: str | None) -> str:
    return peer if device is None else f"{peer}, device {device}"


def _new_tokens(generated: int, resumed: int) -> str:
    """What a session's log line counts: the tokens this server generated, apart from those a
    resumed session brought with it (which its max_new_tokens counts too)."""
    return f"{generated} new tokens" + (f" (resumed after {resumed})" if resumed else "")


def _generic_handler(service: SpecSplitService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Generate": grpc.stream_stream_rpc_method_handler(
                service.Generate,
                request_deserializer=None,  # raw bytes: parsed in _read
                response_serializer=pb.ServerMessage.SerializeToString,
            )
        },
    )


async def serve(
    engine: Engine, sched: SchedulerConfig, cfg: ServeConfig, ready: asyncio.Event | None = None
) -> None:
    """Run until SIGTERM/SIGINT (or cancellation). Then report NOT_SERVING, refuse new
    sessions, and give open ones up to the grace period to finish."""
    metrics = ServerMetrics()
    worker = VerificationWorker(engine, sched, metrics)
    limits = server_limits(engine, cfg)
    options = [
        # gRPC's own limit ends a call silently for the handler (its stream just ends, as at a
        # half-close), so the server would blame the wrong cause: up to twice the limit a
        # message reaches _read, which refuses it with its size, counted and logged.
        ("grpc.max_receive_message_length", min(2 * cfg.max_message_bytes, MAX_MESSAGE_BYTES)),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
    service = SpecSplitService(worker, limits, cfg, metrics)
    interceptors = [BearerTokenInterceptor(cfg.tokens, service.refused)] if cfg.tokens is not None else []
    health_servicer = health.aio.HealthServicer()

    def register(server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((_generic_handler(service),))
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)

    try:  # read again now, after the model's load: a file moved or made unreadable meanwhile
        credentials = cfg.tls.credentials() if cfg.tls else None
    except OSError as exc:
        raise BindError(f"cannot read the TLS files to serve with: {exc}") from None
    servers, port = bind_listeners(cfg.listeners, cfg.host, cfg.port, register, options, interceptors, credentials)
    address = f"{bracketed(cfg.host)}:{port}"
    metrics_host = cfg.metrics_host or cfg.host
    if cfg.metrics_port is not None:
        metrics.serve(cfg.metrics_port, metrics_host)
    for server in servers:
        await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    worker_task = asyncio.create_task(worker.run())
    lag_task = asyncio.create_task(watch_loop_lag(metrics.loop_lag))
    watch_task = asyncio.create_task(service.writes.run())
    stop = asyncio.Event()

    def worker_ended(task: asyncio.Task) -> None:  # type: ignore[type-arg]
        # Without its worker the server would accept sessions and never answer them.
        if not task.cancelled() and task.exception() is not None:
            log.critical("the verification worker failed; shutting down", exc_info=task.exception())
            stop.set()

    worker_task.add_done_callback(worker_ended)
    loop = asyncio.get_running_loop()
    hurry = asyncio.Event()  # a second signal: the operator will not wait out the grace

    def on_signal() -> None:
        if stop.is_set():
            log.warning("a second signal: ending the drain now")
            hurry.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, on_signal)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    log.info(
        "serving %s%s on %s%s%s (vocab %d, context %d, tokenizer %s)%s",
        engine.loaded.name, f" as {limits.target_model}" if limits.target_model != engine.loaded.name else "", address,
        _security(cfg),
        f" ({cfg.listeners} listeners)" if cfg.listeners > 1 else "", limits.vocab_size, limits.max_context,
        limits.tokenizer_fingerprint,
        f"; metrics on http://{bracketed(metrics_host)}:{cfg.metrics_port}/metrics"
        if cfg.metrics_port is not None else "",
    )
    if cfg.tokens is not None and cfg.tls is None and not is_loopback(cfg.host):
        # The edge warns of the same; a load generator or library client does not.
        log.warning("device tokens cross the network in the clear: %s serves without TLS, so anyone on the path "
                    "can read a token and use it (give --tls-cert and --tls-key)", address)
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("shutting down: NOT_SERVING, refusing new sessions, draining for up to %.0f s", cfg.grace_s)
        service.draining = True
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = loop.time() + cfg.grace_s
        while worker.sessions and loop.time() < deadline and not worker_task.done() and not hurry.is_set():
            await asyncio.sleep(0.1)  # (no session ends without the worker)
        if worker.sessions:
            why = "at a second signal" if hurry.is_set() else "as the worker failed" if worker_task.done() \
                else "after the grace"
            log.warning("sessions still open %s: %d (%s); ending them (their edges re-open elsewhere)",
                        why, len(worker.sessions), ", ".join(sorted(worker.sessions)))
        service.cutting = True
        await asyncio.gather(*(server.stop(1.0) for server in servers))
        service.trimmer.cancel()
        worker_task.cancel()
        lag_task.cancel()
        watch_task.cancel()
        worker.close()
        log.info("stopped")
    if worker_task.done() and not worker_task.cancelled() and worker_task.exception() is not None:
        raise RuntimeError("the verification worker failed") from worker_task.exception()
