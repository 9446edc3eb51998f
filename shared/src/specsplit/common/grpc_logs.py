"""gRPC's C core logs for the command lines."""
from __future__ import annotations

import os


def quiet_grpc_core() -> None:
    """Keep gRPC's C core to its errors on stderr, unless GRPC_VERBOSITY says otherwise: at
    INFO it writes lines of its own (a failed TLS handshake, a GOAWAY) beside the program's
    one-line messages. Call before grpc is first imported, which reads the setting then."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
