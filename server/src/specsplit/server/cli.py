"""specsplit-server: serve a target model, or export a draft model for the edge."""
from __future__ import annotations

from specsplit.common.grpc_logs import quiet_grpc_core

quiet_grpc_core()  # before grpc is imported, by what this module imports or runs

import argparse  # noqa: E402
import asyncio
import functools
import gc
import logging
import signal
import sys
import time
from pathlib import Path

from specsplit.common.address import check_host_port
from specsplit.common.export_meta import INT4_BLOCK_SIZE, INT4_BLOCK_SIZES
from specsplit.common.help_format import DefaultsHelpFormatter, installed_version
from specsplit.common.signals import exit_on_sigterm
from specsplit.server.config import IDLE_POLICIES, MIN_MESSAGE_BYTES, SchedulerConfig, ServeConfig, resolve_engine
from specsplit.server.policy import WAIT_STEP_S

# Not __name__: under `python -m` that is __main__, outside the "specsplit" logger whose level main() sets.
log = logging.getLogger("specsplit.server.cli")
MAX_HEALTH_TIMEOUT_S = 86_400.0
GC_YOUNG_THRESHOLD = 20_000  # allocations between young collections while serving (Python's default: 700)
PASS_CACHE_SHARE = 8  # --max-pass-cache-mb 0: this share of the memory available once the target is loaded


def _pass_cache_bytes(given_mb: float, device: str) -> int:
    """The dynamic engine's limit on a pass's padded KV cache: `given_mb`, or where 0 an eighth
    of the memory available now (the target loaded) on the device. A pass holds its padded
    cache twice over at its peak (the padded copy and the model's with the new positions, or
    that and the stack the sessions' are cut from), beside the sessions' own caches, which
    grow as they generate."""
    return int(given_mb * 2**20) if given_mb else _memory_available(device) // PASS_CACHE_SHARE


def _memory_available(device: str) -> int:
    """Bytes free on `device` now: the GPU's, or the machine's on CPU."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil

    return psutil.virtual_memory().available


def settle_heap() -> None:
    """Tune the garbage collector for serving, once everything long-lived is loaded.

    The model, the libraries and the captured graphs (some 400 thousand objects) live as
    long as the server: frozen, no full collection walks them again (each took about 0.1 s
    with the GIL held, stalling the event loop and the target alike). Serving's own objects
    die by reference count; at the default threshold the collector still ran about 30 times
    a second to find almost nothing, some 4% of the event loop's time."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD)


def _refuse(args: argparse.Namespace, message: str) -> int:
    """serve's one line for what it cannot serve with (exit 2): a JSON line under --log-format json."""
    if args.log_format == "json":
        log.error("error: %s", message)
    else:
        print(f"error: {message}", file=sys.stderr)
    return 2


def _libraries_log_json() -> None:
    """transformers' and huggingface_hub's lines as JSON lines too: both log through handlers of
    their own (plain text; the hub's lines then came twice), and transformers draws progress bars."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.disable_default_handler()  # (each sets its handler up first where it has not)
    transformers_logging.enable_propagation()
    hub = hub_logging.get_logger()
    for handler in list(hub.handlers):
        hub.removeHandler(handler)
    hub.propagate = True
    logging.captureWarnings(True)  # warnings.warn too


def _serve(args: argparse.Namespace) -> int:
    from specsplit.server.serve_checks import check_serve_args

    try:
        sched, cfg = check_serve_args(args)
    except (ValueError, OSError) as exc:
        return _refuse(args, str(exc))
    import torch

    from specsplit.server.engine import TargetEngine, attends_in_windows, warm_up
    from specsplit.server.kvcache import position_bytes
    from specsplit.server.listeners import BindError
    from specsplit.server.loading import load_model
    from specsplit.server.progress_log import ProgressLog
    from specsplit.server.service import serve

    if args.device == "cuda" and not torch.cuda.is_available():
        return _refuse(args, "--device cuda but no CUDA device is available")
    if args.log_format == "json":
        _libraries_log_json()
    from specsplit.server.static_engine import SESSION_BUCKETS, TOKEN_BUCKETS, StaticEngine, kv_buckets_by_default

    args.engine = resolve_engine(args.engine, args.device)
    if args.engine == "static" and (args.max_verify_tokens >= TOKEN_BUCKETS[-1]
                                    or args.max_batch_sessions > SESSION_BUCKETS[-1]):
        return _refuse(args, f"the static engine verifies at most {TOKEN_BUCKETS[-1] - 1} drafts at a time "
                       f"(--max-verify-tokens) and {SESSION_BUCKETS[-1]} sessions per pass (--max-batch-sessions); "
                       "--engine dynamic takes more")
    if args.kv_buckets is None:
        args.kv_buckets = args.engine == "static" and kv_buckets_by_default(args.static_max_len)
    # The target thread lets go of the GIL in every torch call and must get it back from the
    # event loop, which under load is always busy with messages: at Python's default of 5 ms
    # per hand-over, a GPU pass stretched well past its GPU time.
    sys.setswitchinterval(args.gil_switch_ms / 1000)
    if args.threads:
        torch.set_num_threads(args.threads)
    from specsplit.server.loading import MissingWeights, UnreadableModel, load_config, resolve_dtype

    dtype = resolve_dtype(args.dtype, args.device)
    if args.cpu_linear == "onnxruntime" and (args.device != "cpu" or dtype != "fp32"):
        return _refuse(args, f"--cpu-linear onnxruntime takes the linear layers of an fp32 target on a CPU, and this "
                             f"server would run {dtype} on {args.device}"
                             f"{' (--dtype auto on a CPU with native bf16)' if args.dtype == 'auto' else ''}: "
                             "serve with --device cpu --dtype fp32, or leave --cpu-linear at auto")
    if args.engine == "static":  # refused from its config, before minutes of loading
        try:
            windowed = attends_in_windows(load_config(args.target))
        except (OSError, UnreadableModel) as exc:
            return _refuse(args, f"cannot load the target {args.target}: {exc}")
        if windowed:
            return _refuse(args, f"the static engine has no sliding-window attention, which {args.target} uses: "
                                 "serve it with --engine dynamic")
    log.info("loading target %s (%s on %s, %s engine)", args.target, dtype, args.device, args.engine)
    try:
        loaded = load_model(args.target, dtype=dtype, device=args.device, load_format=args.load_format,
                            onnxruntime_linears=args.cpu_linear != "default")  # it takes fp32 on CPU only
    # No such path, a hub id that cannot be fetched, a partial checkpoint, a file that is no model.
    except (OSError, MissingWeights, UnreadableModel) as exc:
        return _refuse(args, f"cannot load the target {args.target}: {exc}")
    if args.device == "cpu" and (args.engine == "static" or dtype == "fp16"):
        log.warning("on CPU, %s: a session's tokens may then depend on what else its passes hold; --engine dynamic "
                    "in bf16 or fp32 keeps them exact", "the static engine's attention is not made batch-invariant"
                    if args.engine == "static" else "fp16's layers are not made batch-invariant")
    if args.engine == "static":
        slots = args.max_sessions + 1  # and one for the warm-up
        need = position_bytes(loaded.model) * slots * args.static_max_len
        # Allocated at once: past what is free it failed with the allocator's traceback.
        if need > (free := _memory_available(args.device)):
            return _refuse(args, f"the static engine's KV cache, {slots} slots of {args.static_max_len} positions, "
                                 f"would take {need / 1e9:.1f} GB, and {free / 1e9:.1f} GB is free on {args.device} "
                                 "with the target loaded: lower --max-sessions or --static-max-len")
        t0 = time.monotonic()
        engine = StaticEngine(loaded, slots=args.max_sessions, max_len=args.static_max_len, fuse=args.fuse,
                              bucket_kv=args.kv_buckets)
        if engine.fused:
            log.info("compiled %d norm and MLP modules (torch.compile) in %.1f s", engine.fused, time.monotonic() - t0)
        log.info("static KV cache: %d slots x %d positions, %.1f GB; passes attend over %s", args.max_sessions,
                 args.static_max_len, engine.cache.bytes_per_slot * (args.max_sessions + 1) / 1e9,
                 f"KV buckets of {', '.join(map(str, engine.kv_buckets))} positions" if args.kv_buckets
                 else "whole slots")
        if engine.graphs:
            log.info("capturing CUDA graphs for every pass shape up to %d sessions and %d tokens ...",
                     args.max_batch_sessions, args.max_batch_tokens)
            # Thousands of graphs at large limits take minutes: a line every 10 s, and the total at the end.
            engine.capture_graphs(args.max_batch_sessions, args.max_batch_tokens,
                                  progress=ProgressLog(log, "captured CUDA graphs"))
    else:
        pass_cache = _pass_cache_bytes(args.max_pass_cache_mb, args.device)
        engine = TargetEngine(loaded, prefix_cache_bytes=int(args.prefix_cache_mb * 2**20),
                              max_pass_cache_bytes=pass_cache)
        log.info("a pass's padded KV cache takes at most %.1f GB (%s); a pass that would take more goes as several",
                 pass_cache / 1e9, "--max-pass-cache-mb" if args.max_pass_cache_mb else
                 "an eighth of the memory available once the target is loaded")
        if not engine.verifies_branches:
            log.info("the target attends over sliding windows: edges' branches are left unverified")
    t0 = time.monotonic()
    warm_up(engine)
    log.info("warmed up in %.1f s", time.monotonic() - t0)
    settle_heap()
    try:
        asyncio.run(serve(engine, sched, cfg))
    except BindError as exc:
        return _refuse(args, str(exc))
    return 0


def _export(args: argparse.Namespace) -> int:
    from specsplit.server.export import ExportParityError, export_draft
    from specsplit.server.loading import MissingWeights, UnreadableModel

    try:
        meta = export_draft(args.model, Path(args.out), quantize=args.quantize, tolerance=args.tolerance,
                            int4_block_size=args.int4_block_size or INT4_BLOCK_SIZE)
    except ExportParityError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    # A model that is not there, not whole or no model at all, an --out that may not be replaced.
    except (OSError, MissingWeights, UnreadableModel) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"wrote {args.out}: {meta.num_layers} layers, vocab {meta.vocab_size}, {meta.weights} weights, "
        f"max |logit diff| vs torch {meta.max_abs_logit_diff:.2e} (tolerance {args.tolerance:.1e})"
    )
    return 0


def _models(args: argparse.Namespace) -> int:
    import json

    from specsplit.server import models

    root = Path(args.cache_dir) if args.cache_dir else models.cache_dir()
    try:
        if args.action == "pull":
            result = {role: str(p) for role, p in models.pull(args.pair, root).items()}
        else:
            pair = models.prepare(args.pair, root, target_source=args.target, draft_source=args.draft,
                                  draft_quantize=args.draft_quantize)
            result = {"target": str(pair.target_dir.resolve()), "draft": str(pair.draft_dir.resolve())}
    except Exception as exc:
        if (code := models.failure_exit_code(exc)) is None:
            raise  # a fault of ours, shown as one
        print(f"error: {exc}", file=sys.stderr)
        return code
    if args.json:
        print(json.dumps(result))
    else:
        for role, path in result.items():
            print(f"{role}: {path}")
    return 0


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specsplit.common.tls import client_credentials, tls_hint

    try:
        credentials = client_credentials(args.tls_ca, args.tls_cert, args.tls_key, args.tls)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    channel = grpc.secure_channel(args.address, credentials, options) if credentials \
        else grpc.insecure_channel(args.address)
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
        except grpc.RpcError as exc:  # the details tell a refused connection from a TLS or DNS failure
            details = exc.details() or ""
            hint = tls_hint(details, tls=credentials is not None, client_cert=bool(args.tls_cert),
                            address_flag="--address")
            print(f"{args.address}: {exc.code().name}: {details}{hint}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def build_parser() -> argparse.ArgumentParser:
    from specsplit.server.models import DEFAULT_PAIR, PAIRS  # light: the pairs' file lists

    p = argparse.ArgumentParser(prog="specsplit-server", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version('specsplit-server')}")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    # Also accepted after the command (`serve -v`), where users put it; SUPPRESS keeps the
    # command's parser from resetting a -v given before the command. The top level keeps its
    # own flag: commands share their parent's action objects, so a default set there for the
    # top level would reset -v in every command.
    after = argparse.ArgumentParser(add_help=False)
    after.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="debug logging")
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=DefaultsHelpFormatter))

    s = sub.add_parser("serve", help="serve a target model over gRPC", parents=[after])
    s.add_argument("--target", required=True, help="Hugging Face directory, .gguf file or hub id")
    s.add_argument("--host", default=ServeConfig.host, help="address to bind (0.0.0.0 for other machines)")
    s.add_argument("--port", type=int, default=ServeConfig.port, help="port to listen on")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the target runs")
    s.add_argument("--model-name", help="the name edges are told the target by (default: a hub id as given, a "
                   "local directory or file by its own name, never its path)")
    s.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="auto (default): bf16 on GPU and on CPUs with native bf16 (AVX512-BF16, AMX), where a pass over 8 "
        "tokens costs little more than one over 1; fp32 on other CPUs. On CPU, bf16 and fp32 run attention in "
        "windows of keys and linear layers in pieces of rows, so that a row's logits do not depend on its "
        "pass's size and greedy verification stays exact (with --engine dynamic; the static engine's "
        "attention is not made so)",
    )
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    s.add_argument(
        "--engine",
        choices=["auto", "dynamic", "static"],
        default="auto",
        help="auto (default): static on a GPU, dynamic on a CPU. dynamic: a growing KV cache per session, "
        "sessions padded into each pass (on a CPU exact, see --dtype); static: one "
        "preallocated KV cache with a slot per session (--max-sessions x --static-max-len positions, allocated at "
        "start) and, on a GPU, CUDA graphs, one per batch shape that --max-batch-sessions and "
        "--max-batch-tokens allow, all captured before serving starts; they remove the eager forward's "
        "launch overhead",
    )
    s.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="static engine: compile the target's norms and MLPs with torch.compile, so that their "
                   "elementwise work is one kernel each (default: on a GPU, where it cut 7B passes by 8 to 13%%; "
                   "compiling adds seconds to the start and needs a C compiler; where it fails, the server warns "
                   "and runs them as they are, as on a CPU, whose row-invariant linear layers cannot be compiled)")
    s.add_argument("--prefix-cache-mb", type=float, default=None,
                   help="dynamic engine: memory for recent prompts' keys and values (default 256 MB; 0: none). A "
                   "session whose prompt begins as another prompt did (a chat template's system turn, at least 8 "
                   "tokens) starts from those positions instead of computing them: over the benchmark's prompts on one "
                   "core of an Intel Xeon, server-only time to first token 518 ms against 884. A prompt takes only what it "
                   "shares with other prompts, not its own earlier keys; the same bits on a CPU, on a GPU up to "
                   "rounding, as in a batch")
    s.add_argument("--max-pass-cache-mb", type=float, default=0,
                   help="dynamic engine: the most memory one pass's KV cache may take (default 0: an eighth of the "
                   "memory available once the target is loaded). A pass pads every session's cache to its longest, "
                   "so one long context among many short ones would make every row as long; a pass over this goes "
                   "as several, sessions of like length together (each more reads the weights again; the same bits "
                   "on a CPU, on a GPU up to rounding, as in a batch)")
    s.add_argument("--static-max-len", type=int, default=None,
                   help="static engine: KV positions per session (default 2048); a session's context (prompt + output) is this less the "
                   "widest feed of a pass, which stays free past its last token (edges see it in Opened.max_context)")
    s.add_argument("--kv-buckets", action=argparse.BooleanOptionalAction, default=None,
                   help="static engine: a pass attends over its rows' positions rounded up to the next of 128, 256, "
                   "512, ... or the whole slot (a CUDA graph for each), not every session's whole slot (default: on "
                   "for slots of more than 512 positions, so with the default --static-max-len). 7B shape on an "
                   "H200: passes of short sessions 1.4 to 2.6x faster with 2048-position slots, and in a load test "
                   "there the server committed 40%% more tokens/s for server-only sessions; with 512 passes 3 to 27%% "
                   "faster, but the load test's server-only sessions fared better or worse by machine "
                   "(docs/capacity.md), and new sessions waited longer for their Opened. Graph capture takes as many times "
                   "longer as there are buckets")
    s.add_argument(
        "--load-format",
        choices=["auto", "dummy", "dummy-echo"],
        default="auto",
        help="auto (default): the target's own weights. For benchmarks and load tests, random weights from the "
        "target's config.json (meaningless text): "
        "dummy as initialised; dummy-echo with every layer's output projections zeroed and the input embeddings "
        "as output head, so that the greedy output (the last prompt token, repeated) is the same in any batch",
    )
    s.add_argument(
        "--cpu-linear",
        choices=["auto", "onnxruntime", "default"],
        default="auto",
        help="auto (default): ONNX Runtime's GEMM for the large linear layers when serving fp32 on CPU (against "
        "PyTorch's plain GEMM, a pass over 2 to 16 tokens took about half the time, a one-token step up to a "
        "third less; holds a packed copy of the weights), for each layer shape where a probe at load finds it "
        "keeps a row's bits over as many rows as PyTorch's kernel does; onnxruntime: the same, and refused where "
        "the server would not serve fp32 on CPU; default: PyTorch's (oneDNN)",
    )
    s.add_argument(
        "--idle-policy",
        choices=IDLE_POLICIES,
        default=SchedulerConfig.idle_policy,
        help="an async session short of drafts: adaptive (default) waits for drafts on their way when that "
        "yields more tokens per second (up to --max-wait-ms); ar verifies what it has, or takes an "
        "autoregressive step, at once; wait waits --idle-wait-ms when it has none",
    )
    s.add_argument("--idle-wait-ms", type=float, default=SchedulerConfig.idle_wait_s * 1000, help="wait: how long a session without drafts waits")
    s.add_argument("--gil-switch-ms", type=float, default=0.5,
                   help="longest the target thread waits for the event loop to hand it the GIL (Python's "
                   "switch interval; default 0.5, Python's own is 5)")
    s.add_argument("--max-wait-ms", type=float, default=SchedulerConfig.max_wait_s * 1000, help="adaptive: longest wait for drafts, in steps of "
                   f"{WAIT_STEP_S * 1000:g} ms (below one step: it never waits)")
    s.add_argument("--max-verify-tokens", type=int, default=SchedulerConfig.max_verify_tokens, help="most drafts one verification may take")
    s.add_argument(
        "--fixed-verify",
        action="store_true",
        help="always verify every candidate up to --max-verify-tokens (default: choose the number that maximizes "
        "expected tokens per second from the session's acceptance and measured pass times)",
    )
    s.add_argument("--max-batch-sessions", type=int, default=SchedulerConfig.max_batch_sessions, help="most sessions one target pass verifies (with the static engine, rows: a prompt split over rows takes several)")
    s.add_argument("--pace-tokens-per-s", type=float, default=SchedulerConfig.pace_tokens_per_s,
                   help="the tokens/s each device should get (an SLO): when a session ready for a pass has "
                   "committed slower than this over the last 2 s, the ready sessions more than 10%% faster sit that "
                   "pass out, so that a smaller pass comes round sooner for those behind. A device's generations on "
                   "one stream, each opened within 1 s of the last one's end, share one pace (default 0: no pacing)")
    s.add_argument(
        "--max-batch-tokens",
        type=int,
        default=SchedulerConfig.max_batch_tokens,
        help="token budget of one target pass, padding included (rows x the widest row); when more sessions "
        "are ready, each verifies at most its share of drafts; a prompt over the budget by itself runs alone "
        "(with the static engine, a prompt longer than its widest row takes several rows of the pass's width "
        "instead of widening every row); within it, a batch's feeds are cut to the width that commits the most "
        "tokens per second of measured pass time",
    )
    s.add_argument("--max-sessions", type=int, default=ServeConfig.max_sessions, help="beyond this, Open gets RESOURCE_EXHAUSTED")
    s.add_argument("--max-lookahead", type=int, default=ServeConfig.max_lookahead, help="how far past the committed point drafts may reach")
    s.add_argument("--max-context", type=int, default=None,
                   help="context limit (prompt + output), at least 2 (default: the target's positions; the static "
                   "engine's slots hold --static-max-len less 32, and a larger value is refused)")
    s.add_argument("--max-new-tokens-limit", type=int, default=ServeConfig.max_new_tokens, help="largest max_new_tokens a session may ask")
    s.add_argument("--max-message-bytes", type=int, default=ServeConfig.max_message_bytes, help="larger messages get RESOURCE_EXHAUSTED; the server's own messages are held to it too "
                   f"(at least {MIN_MESSAGE_BYTES})")
    s.add_argument("--grace", type=float, default=ServeConfig.grace_s, help="seconds open sessions get to finish on SIGTERM")
    s.add_argument("--stalled-edge-timeout", type=float, default=SchedulerConfig.stalled_edge_s,
                   help="seconds an edge may leave its verdicts unread before its session is ended (a full "
                   "outbox), or a write to it may wait before its stream is ended")
    s.add_argument("--sync-draft-timeout", type=float, default=SchedulerConfig.sync_draft_timeout_s,
                   help="seconds a sync session's edge may send no drafts (after its Open or its last verdict) "
                   "before the session ends with DEADLINE_EXCEEDED: its server takes no step without them")
    s.add_argument("--idle-stream-timeout", type=float, default=ServeConfig.idle_stream_s,
                   help="seconds a stream stays open after a session's Done, for the device's next generation "
                   "(a new Open on the same stream, without a new call) or its half-close; also how long a new "
                   "stream may take to send its Open (else DEADLINE_EXCEEDED)")
    s.add_argument("--max-idle-streams", type=int, default=ServeConfig.max_idle_streams,
                   help="streams kept open between sessions at once; past it the longest idle one is ended as the "
                   "timeout would end it, once it has idled for 5 s or half the timeout (its device starts a new "
                   "call for its next generation)")
    s.add_argument("--listeners", type=int, default=ServeConfig.listeners,
                   help="gRPC servers sharing the port (SO_REUSEPORT, Linux), each taking new calls on its own: "
                   "one takes them one at a time, which under hundreds of devices keeps calls waiting; 1 where "
                   "the platform cannot share a port")
    s.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (the serving "
                   "port too, where --metrics-host is another address than --host and neither is a wildcard)")
    s.add_argument("--metrics-host", help="address the metrics bind (default: --host); plain HTTP, without TLS or "
                   "tokens, so keep it private, e.g. 127.0.0.1 while --host is 0.0.0.0")
    s.add_argument("--tls-cert", help="server certificate (PEM): serve TLS")
    s.add_argument("--tls-key", help="server private key (PEM)")
    s.add_argument("--tls-client-ca", help="CA (PEM) that signed client certificates: require mutual TLS")
    s.add_argument("--tokens-file", help="per-device bearer tokens, one 'DEVICE_ID TOKEN' per line (tokens "
                   "of 16 or more printable ASCII characters; lines starting with # are comments)")
    s.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: one JSON object per line, with the session id as a field")
    s.set_defaults(func=_serve, command_parser=s)

    e = sub.add_parser("export-draft", help="export a draft model to ONNX with KV cache for the edge",
                       parents=[after])
    e.add_argument("--model", required=True, help="Hugging Face directory, .gguf file or hub id")
    e.add_argument("--out", required=True, help="output directory: new, empty, or an earlier export, which is "
                   "replaced (a directory holding other files is refused)")
    e.add_argument("--quantize", choices=["none", "int8", "int4"], default="none",
                   help="int8: weights to int8, one scale per output channel; int4: weight matrices to 4 bits "
                   "in blocks (--int4-block-size) with a scale and zero point each, the embedding table to "
                   "int8 (the activations are quantized on the fly in both)")
    e.add_argument("--int4-block-size", type=int, choices=INT4_BLOCK_SIZES, default=None,
                   help=f"with --quantize int4: inputs per int4 block (default {INT4_BLOCK_SIZE}): larger blocks store fewer scales, so a "
                   "draft step reads fewer bytes, at some cost in agreement with the target")
    e.add_argument(
        "--tolerance", type=float, default=5e-3, help="max |logit difference| ONNX Runtime vs torch (fp32 graph)"
    )
    e.set_defaults(func=_export, command_parser=e)

    m = sub.add_parser(
        "models",
        parents=[after],
        help="fetch and prepare the default model pair",
        description="pull: download the default pair's GGUF files into the cache and verify their sha256 "
        "(idempotent, resumes). prepare: pull, then convert the target to a bf16 Hugging Face directory and "
        "export the draft to quantized ONNX (int4 unless --draft-quantize says otherwise), both cached. "
        "--target/--draft take any local Hugging Face directory, "
        "GGUF file or hub id instead of the defaults.",
    )
    m.add_argument("action", choices=["pull", "prepare"])
    m.add_argument("pair", nargs="?", default=DEFAULT_PAIR, choices=sorted(PAIRS), help="model pair")
    m.add_argument("--cache-dir", default=None, help="default: $SPECSPLIT_CACHE, else $XDG_CACHE_HOME/specsplit, else ~/.cache/specsplit")
    m.add_argument("--target", default=None, help="prepare: use this target instead of the default")
    m.add_argument("--draft", default=None, help="prepare: use this draft instead of the default")
    m.add_argument("--draft-quantize", choices=["int8", "int4"], default="int4",
                   help="prepare: the draft's weights (default int4; see export-draft --quantize)")
    m.add_argument("--json", action="store_true", help="print the resulting paths as JSON")
    m.set_defaults(func=_models, command_parser=m)

    h = sub.add_parser("health", help="check a server with gRPC health checking (exit 0 if SERVING)",
                       parents=[after])
    h.add_argument("--address", default=f"localhost:{ServeConfig.port}", help="HOST:PORT of the server")
    h.add_argument("--service", default="", help="service name (default: the whole server)")
    h.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for its answer")
    h.add_argument("--tls", action="store_true",
                   help="check over TLS, trusting gRPC's default public CAs (--tls-ca names a CA of your own)")
    h.add_argument("--tls-ca", help="check over TLS, trusting this CA certificate (PEM; default with --tls or "
                   "--tls-cert: gRPC's default public CAs)")
    h.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the server's certificate holds, where --address dials it by another (localhost, "
                   "an IP address)")
    h.add_argument("--tls-cert", help="this client's certificate (PEM), for a server that asks for one (mutual TLS)")
    h.add_argument("--tls-key", help="this client's private key (PEM), with --tls-cert")
    h.set_defaults(func=_health, command_parser=h)
    return p


def _usage_problem(args: argparse.Namespace) -> str | None:
    """What argparse cannot see in export-draft's, models' and health's settings; serve's are
    checked by serve_checks, some of them against files and ports."""
    if args.func is _models and args.action == "pull" and (args.target or args.draft or args.draft_quantize != "int4"):
        return "--target, --draft and --draft-quantize are for prepare; pull fetches the default pair only"
    if args.func is _export and args.int4_block_size is not None and args.quantize != "int4":
        return "--int4-block-size is for --quantize int4"
    if args.func is _export and not args.tolerance >= 0:
        return f"--tolerance must be 0 or more, got {args.tolerance}"
    if args.func is _health:
        if args.tls_server_name is not None and not (args.tls or args.tls_ca or args.tls_cert):
            return "--tls-server-name is for TLS: give --tls or --tls-ca too"
        if not 0 < args.timeout <= MAX_HEALTH_TIMEOUT_S:  # gRPC takes a far deadline for one long past
            return f"--timeout must be above 0 and at most {MAX_HEALTH_TIMEOUT_S:g} s, got {args.timeout}"
        try:
            check_host_port(args.address)
        except ValueError as exc:
            return f"--address: {exc}, got {args.address!r}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if problem := _usage_problem(args):
        args.command_parser.error(problem)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if getattr(args, "log_format", "text") == "json":
        from specsplit.server.logfmt import JsonFormatter

        for handler in logging.getLogger().handlers:
            handler.setFormatter(JsonFormatter())
    logging.getLogger("specsplit").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    if args.func in (_export, _models):
        # Ended as an exception, so that what they write beside the result (a temporary
        # export of the draft's fp32 graph, about 2 GB) is removed on the way out.
        signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        return args.func(args)
    except KeyboardInterrupt:  # while loading, say: serving itself drains on SIGINT and returns
        return 130


if __name__ == "__main__":
    sys.exit(main())
