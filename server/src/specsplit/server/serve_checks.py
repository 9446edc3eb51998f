"""Checks of `serve`'s settings that need no model, made before it loads one.

Loading takes seconds on a CPU and minutes on a GPU (compiling, capturing graphs), and a
setting the server cannot run with, or runs refusing every session with, should show at once
as one line, not as a traceback after the wait.
"""
from __future__ import annotations

import argparse
import math
from datetime import datetime, timezone
from pathlib import Path

from specsplit.common.tls import check_given, check_pem
from specsplit.server.auth import load_tokens
from specsplit.server.config import ConfigError, SchedulerConfig, ServeConfig, TLSConfig, resolve_engine
from specsplit.server.listeners import check_port_free

# serve's own settings, which no config holds (the configs check theirs: config.py).
NOT_NEGATIVE = ("threads", "prefix_cache_mb", "max_pass_cache_mb")
POSITIVE = ("gil_switch_ms",)
# The flags of the config fields named otherwise (in other units, some).
FLAG_OF = {"max_new_tokens": "max_new_tokens_limit", "grace_s": "grace", "stalled_edge_s": "stalled_edge_timeout",
           "sync_draft_timeout_s": "sync_draft_timeout",
           "idle_stream_s": "idle_stream_timeout", "idle_wait_s": "idle_wait_ms", "max_wait_s": "max_wait_ms"}
# A slot keeps the widest pass (32 tokens) free past a session's end, and the start's
# warm-up passes (engine.warm_up) need 38 positions more; a shorter slot would not hold a
# chat prompt anyway. (A constant here, tested against warm_up: this module imports no torch.)
MIN_STATIC_LEN = 128
# Each engine's own settings, and what they do: given (as anything but off) with the other
# engine, they would be ignored without a word. Those with a value to fill in default to None.
ENGINE_OWN = {
    "static_max_len": ("static", "sizes the static engine's slots"),
    "kv_buckets": ("static", "sizes the static engine's passes"),
    "fuse": ("static", "compiles the static engine's modules"),
    "prefix_cache_mb": ("dynamic", "keeps recent prompts' keys and values for the dynamic engine (the static "
                                   "engine's slots hold only each session's own)"),
    "max_pass_cache_mb": ("dynamic", "limits the dynamic engine's passes (the static engine's cache is allocated "
                                     "at start)"),
}
ENGINE_DEFAULTS = {"static_max_len": 2048, "prefix_cache_mb": 256.0}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _configs(args: argparse.Namespace, tls: TLSConfig | None,
             tokens: dict[str, str] | None) -> tuple[SchedulerConfig, ServeConfig]:
    """The configs serve's flags ask for; ValueError naming the flag of a field they refuse."""
    try:
        sched = SchedulerConfig(
            max_verify_tokens=args.max_verify_tokens,
            max_batch_sessions=args.max_batch_sessions,
            max_batch_tokens=args.max_batch_tokens,
            adaptive=not args.fixed_verify,
            idle_policy=args.idle_policy,
            idle_wait_s=args.idle_wait_ms / 1000,
            max_wait_s=args.max_wait_ms / 1000,
            stalled_edge_s=args.stalled_edge_timeout,
            sync_draft_timeout_s=args.sync_draft_timeout,
            pace_tokens_per_s=args.pace_tokens_per_s,
        )
        cfg = ServeConfig(
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            max_lookahead=args.max_lookahead,
            max_context=args.max_context,
            max_new_tokens=args.max_new_tokens_limit,
            max_message_bytes=args.max_message_bytes,
            grace_s=args.grace,
            idle_stream_s=args.idle_stream_timeout,
            max_idle_streams=args.max_idle_streams,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            tls=tls,
            tokens=tokens,
            listeners=args.listeners,
            model_name=args.model_name,
        )
    except ConfigError as exc:
        dest = FLAG_OF.get(exc.field, exc.field)
        raise ValueError(f"{_flag(dest)} {exc.problem}, got {getattr(args, dest)}") from None
    return sched, cfg


def check_dates(cert: str) -> None:
    """ValueError unless the --tls-cert certificate is within its dates by this machine's
    clock. OpenSSL loads one outside them without a word, and then every client's handshake
    fails, with nothing in the server's log. (A file that is not a regular file is left to
    gRPC, as check_pem leaves it: it can be read only once.)"""
    if not Path(cert).is_file():
        return
    from cryptography import x509

    certificate = x509.load_pem_x509_certificate(Path(cert).read_bytes())  # the first: the server's own
    now = datetime.now(timezone.utc)
    if now > certificate.not_valid_after_utc:
        raise ValueError(f"--tls-cert {cert} expired on {certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC: "
                         "every client's handshake would fail; give a current certificate")
    if now < certificate.not_valid_before_utc:
        raise ValueError(f"--tls-cert {cert} is valid only from {certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC "
                         f"(this machine's clock says {now:%Y-%m-%d %H:%M} UTC): clients would refuse it until then")


def engine_setting_problem(args: argparse.Namespace) -> str | None:
    """The first of one engine's own settings that `args` give with the other engine (which
    would ignore it without a word), as serve's refusal says it; None if none."""
    engine = resolve_engine(args.engine, args.device)
    for name, (own, what) in ENGINE_OWN.items():
        if getattr(args, name) and engine != own:
            return f"{_flag(name)} {what}; it needs --engine {own}"
    return None


def check_serve_args(args: argparse.Namespace) -> tuple[SchedulerConfig, ServeConfig]:
    """The configs `serve` runs with; ValueError (or OSError, for files and ports) naming the
    first setting it cannot run with. A --tokens-file is read here, once: a pipe can be read
    only once."""
    if problem := engine_setting_problem(args):
        raise ValueError(problem)
    engine = resolve_engine(args.engine, args.device)
    for name, default in ENGINE_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in NOT_NEGATIVE:
        if not 0 <= getattr(args, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be 0 or more, got {getattr(args, name)}")
    for name in POSITIVE:
        if not 0 < getattr(args, name) < math.inf:
            raise ValueError(f"{_flag(name)} must be above 0 and finite, got {getattr(args, name)}")
    static = engine == "static"
    if static and not args.static_max_len >= MIN_STATIC_LEN:
        raise ValueError(f"--static-max-len must be at least {MIN_STATIC_LEN}, got {args.static_max_len}")
    if static and args.max_context is not None:
        from specsplit.server.static_engine import TOKEN_BUCKETS

        # Taken as is, it was cut to what a slot holds without a word, and every Open longer refused.
        if args.max_context > (room := args.static_max_len - TOKEN_BUCKETS[-1]):
            raise ValueError(f"--max-context {args.max_context} is more than the static engine's slots hold: "
                             f"{room} (--static-max-len {args.static_max_len} less the widest feed of a pass, "
                             f"{TOKEN_BUCKETS[-1]}); raise --static-max-len, or serve with --engine dynamic")
    check_given(("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key), ("--tls-client-ca", args.tls_client_ca),
                ("--tokens-file", args.tokens_file))
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise ValueError("--tls-cert and --tls-key go together (and --tls-client-ca needs both)")
    for flag, path in (("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-client-ca", args.tls_client_ca), ("--tokens-file", args.tokens_file)):
        if path is not None and not Path(path).exists():
            raise OSError(f"{flag} {path}: no such file")
        if path is not None and Path(path).is_dir():
            raise OSError(f"{flag} {path} is a directory")
    tls = None
    if args.tls_cert:
        check_pem(args.tls_cert, args.tls_key, args.tls_client_ca, ca_flag="--tls-client-ca")
        check_dates(args.tls_cert)
        tls = TLSConfig(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_client_ca) if args.tls_client_ca else None)
    tokens = load_tokens(Path(args.tokens_file)) if args.tokens_file is not None else None  # errors name the line
    sched, cfg = _configs(args, tls, tokens)
    check_port_free(cfg.host, cfg.port)
    if cfg.metrics_port is not None:
        check_port_free(cfg.metrics_host or cfg.host, cfg.metrics_port)
    return sched, cfg
