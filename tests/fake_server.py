"""A gRPC server whose Generate is a test's own handler: for edge behaviour against a server
that answers late, drops calls or breaks the protocol, which the real server never does."""
from __future__ import annotations

import grpc


async def fake_server(generate_handler) -> tuple[grpc.aio.Server, str]:  # type: ignore[no-untyped-def]
    """A started server whose Generate is `generate_handler` (raw bytes in and out), and its address."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("specsplit.v1.SpecSplit", {
        "Generate": grpc.stream_stream_rpc_method_handler(generate_handler)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
