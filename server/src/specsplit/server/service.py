"""The grpc.aio service: moves messages between each stream and the protocol core."""
from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specsplit.protocol import codec, errors
from specsplit.protocol.messages import Done, OpenRequest, ServerLimits
from specsplit.protocol.server_session import ServerConnection
from specsplit.server.engine import TargetEngine
from specsplit.server.scheduler import SchedulerConfig, SessionHandle, VerificationWorker
from specsplit.v1 import specsplit_pb2 as pb
from specsplit.v1 import specsplit_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SpecSplit"].full_name


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    max_sessions: int = 64
    max_lookahead: int = 64
    max_chunk: int = 64
    max_context: int | None = None  # None: the target's position limit
    max_new_tokens: int = 4096
    max_message_bytes: int = 1 << 20
    grace_s: float = 10.0


def server_limits(engine: TargetEngine, cfg: ServeConfig) -> ServerLimits:
    loaded = engine.loaded
    return ServerLimits(
        vocab_size=engine.vocab_size,
        max_context=min(cfg.max_context or engine.max_context, engine.max_context),
        max_lookahead=cfg.max_lookahead,
        max_chunk=cfg.max_chunk,
        max_new_tokens=cfg.max_new_tokens,
        eos_ids=loaded.eos_ids,
        target_model=loaded.name,
        tokenizer_fingerprint=loaded.fingerprint,
    )


class SpecSplitService(pb_grpc.SpecSplitServicer):
    def __init__(self, worker: VerificationWorker, limits: ServerLimits, cfg: ServeConfig) -> None:
        self.worker = worker
        self.limits = limits
        self.cfg = cfg

    async def _read(
        self, requests: AsyncIterator[pb.EdgeMessage], conn: ServerConnection, outbox: asyncio.Queue
    ) -> None:
        """Feed the edge's messages to the core; errors go to the outbox as exceptions."""
        try:
            async for msg in requests:
                event = codec.edge_from_pb(msg)
                if isinstance(event, OpenRequest) and conn.session is None:
                    if len(self.worker.sessions) >= self.cfg.max_sessions:
                        raise errors.ServerBusy(
                            f"server holds its limit of {self.cfg.max_sessions} sessions; retry later"
                        )
                out = conn.receive(event)
                for item in out:
                    await outbox.put(item)
                if isinstance(event, OpenRequest) and conn.session.done is None:  # type: ignore[union-attr]
                    self.worker.add(SessionHandle(conn.session, outbox))  # type: ignore[arg-type]
                else:
                    self.worker.notify()
        except errors.ProtocolError as exc:
            await outbox.put(exc)

    async def Generate(self, request_iterator, context):  # type: ignore[no-untyped-def,override]
        conn = ServerConnection(self.limits, uuid.uuid4().hex[:12])
        outbox: asyncio.Queue = asyncio.Queue(maxsize=self.worker.config.outbox_size)
        reader = asyncio.create_task(self._read(request_iterator, conn, outbox))
        try:
            while True:
                item = await outbox.get()
                if isinstance(item, errors.ProtocolError):
                    log.info("session %s: %s: %s", conn.session_id, item.status, item.message)
                    await context.abort(grpc.StatusCode[item.status], item.message)
                if isinstance(item, Exception):
                    await context.abort(grpc.StatusCode.INTERNAL, f"verification failed: {item}")
                yield codec.server_to_pb(item)
                if isinstance(item, Done):
                    return
        finally:
            reader.cancel()
            self.worker.remove(conn.session_id)
            if conn.session is not None:
                conn.session.cancel()


async def serve(engine: TargetEngine, sched: SchedulerConfig, cfg: ServeConfig, ready: asyncio.Event | None = None) -> None:
    """Run until SIGTERM/SIGINT (or cancellation); then drain for up to the grace period."""
    worker = VerificationWorker(engine, sched)
    limits = server_limits(engine, cfg)
    options = [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    pb_grpc.add_SpecSplitServicer_to_server(SpecSplitService(worker, limits, cfg), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    address = f"{cfg.host}:{cfg.port}"
    if server.add_insecure_port(address) == 0:
        raise OSError(f"could not bind {address}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    worker_task = asyncio.create_task(worker.run())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    log.info(
        "serving %s on %s (vocab %d, context %d, tokenizer %s)",
        limits.target_model, address, limits.vocab_size, limits.max_context, limits.tokenizer_fingerprint,
    )
    if ready is not None:
        ready.set()
    try:
        await stop.wait()
    finally:
        log.info("shutting down: draining for up to %.0f s", cfg.grace_s)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(cfg.grace_s)
        worker_task.cancel()
        worker.close()
