"""Checks of `serve`'s settings that need no model, made before it loads one.

Loading takes seconds on a CPU and minutes on a GPU (compiling, capturing graphs), and a
setting the server cannot run with, or runs refusing every session with, should show at once
as one line, not as a traceback after the wait.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from specsplit.common.tls import check_pem
from specsplit.server.auth import load_tokens
from specsplit.server.config import resolve_engine
from specsplit.server.listeners import MAX_MESSAGE_BYTES, check_port_free

AT_LEAST_ONE = ("listeners", "max_batch_sessions", "max_batch_tokens", "max_sessions", "max_lookahead",
                "max_new_tokens_limit", "max_message_bytes", "static_max_len", "max_verify_tokens")
NOT_NEGATIVE = ("threads", "max_idle_streams", "idle_wait_ms", "max_wait_ms", "grace", "pace_tokens_per_s")
POSITIVE = ("stalled_edge_timeout", "idle_stream_timeout", "gil_switch_ms")
# A slot keeps the widest pass (32 tokens) free past a session's end, and the start's
# warm-up passes (engine.warm_up) need 38 positions more; a shorter slot would not hold a
# chat prompt anyway. (A constant here, tested against warm_up: this module imports no torch.)
MIN_STATIC_LEN = 128


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_serve_args(args: argparse.Namespace) -> dict[str, str] | None:
    """Raise ValueError (or OSError, for files and ports) naming the first setting `serve`
    cannot run with. Returns the devices' tokens (token -> device id) where a --tokens-file
    is given: read here once, as a pipe can be read only once."""
    # Written so that NaN, which every comparison fails, fails them too.
    for name in AT_LEAST_ONE:
        if not getattr(args, name) >= 1:
            raise ValueError(f"{_flag(name)} must be at least 1, got {getattr(args, name)}")
    for name in NOT_NEGATIVE:
        if not 0 <= getattr(args, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be 0 or more, got {getattr(args, name)}")
    for name in POSITIVE:
        if not 0 < getattr(args, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be above 0, got {getattr(args, name)}")
    if args.max_message_bytes > MAX_MESSAGE_BYTES:
        raise ValueError(f"--max-message-bytes must be at most {MAX_MESSAGE_BYTES}, got {args.max_message_bytes}")
    static = resolve_engine(args.engine, args.device) == "static"
    if static and args.static_max_len < MIN_STATIC_LEN:
        raise ValueError(f"--static-max-len must be at least {MIN_STATIC_LEN}, got {args.static_max_len}")
    if args.max_context is not None and args.max_context < 1:
        raise ValueError(f"--max-context must be at least 1 (or left out: the target's), got {args.max_context}")
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise ValueError("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-client-ca", args.tls_client_ca), ("--tokens-file", args.tokens_file)):
        if path is not None and not Path(path).exists():
            raise OSError(f"{flag} {path}: no such file")
        if path is not None and Path(path).is_dir():
            raise OSError(f"{flag} {path} is a directory")
    if args.tls_cert:
        check_pem(args.tls_cert, args.tls_key, args.tls_client_ca, ca_flag="--tls-client-ca")
    tokens = load_tokens(Path(args.tokens_file)) if args.tokens_file is not None else None  # errors name the line
    check_port_free(args.host, args.port)
    if args.metrics_host is not None and args.metrics_port is None:
        raise ValueError("--metrics-host places the metrics: give their --metrics-port too")
    if args.metrics_port is not None:
        if args.metrics_port == args.port or not 1 <= args.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be a port from 1 to 65535 other than --port, got {args.metrics_port}")
        check_port_free(args.metrics_host or args.host, args.metrics_port)
    return tokens
