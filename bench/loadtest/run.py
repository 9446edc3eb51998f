"""gRPC load test: N concurrent edge sessions against one server process, swept over N.

Modes: `none` (server-only decoding, the baseline), `sim` (async edges whose drafter
proposes the target's own greedy token with probability --alpha per position, at
almost no cost), `onnx` (async edges with the real ONNX Runtime draft model). Each
mode's sweep stops at its first session count where some session got less than
--slo tokens/s (or anything failed). The server is started once, pinned to its cores,
with Prometheus metrics on; every edge runs in this process (or --client-procs worker
processes), pinned to the other cores. Writes bench/results/NAME.json and NAME.md.
Exits 1 if any generation failed or differed from the target's own output, or the sweep
stopped at a point where none finished; 130 on Ctrl-C, after writing the points finished.

With --server, no server is started: the load goes to one already running (a site's
own deployment, over its TLS and with its bearer token), whose target must be the one
--draft was exported for (the draft's tokenizer encodes the prompts; the server checks
its fingerprint). Give --metrics-url for the server's figures (batch sizes, pass times,
KV memory). A target that decodes differently batched (bf16 on a GPU, say) can make a
few outputs differ from the reference, which the server decodes alone.

Run from the repository root: python bench/loadtest/run.py [options]
"""
from __future__ import annotations

import sys
from pathlib import Path

if not __package__:
    # Run as a script, this directory would come first on sys.path and its modules could
    # shadow top-level ones; the benchmark scripts import from bench/ instead.
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import os  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from cli_types import (START_CORES, at_least, cores, draft_export, fraction, host_port, int_list,  # noqa: E402
                       model_dir, out_dir, report_name)
from loadtest.endpoint import ServerEndpoint  # noqa: E402
from loadtest.harness import RunOptions, SetupError, execute  # noqa: E402
from loadtest.prompts import PROMPT_SETS  # noqa: E402
from loadtest.report import write_report  # noqa: E402
from loadtest.rerun import rerun_command  # noqa: E402
from loadtest.sessions import LoadSettings  # noqa: E402
from loadtest.sweep import INTERRUPTED, MODES, SweepConfig  # noqa: E402
from loadtest.shapes import ARCHS  # noqa: E402
from orchestrate import server_and_edge_cores  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
# Local paths, kept out of the reports' rerun line.
PATH_OPTIONS = {"--target": "TARGET_DIR", "--draft": "DRAFT_DIR", "--out-dir": "OUT_DIR", "--server-log": "LOG",
                "--tls-ca": "CA_FILE", "--tls-cert": "CERT_FILE", "--tls-key": "KEY_FILE",
                "--metrics-url": "METRICS_URL"}  # a URL may carry a secret (a query token, say)
# Options for the server the load test starts, meaningless with --server; with their defaults.
STARTED_SERVER_OPTIONS = {"target": None, "target_config": None, "device": None, "dtype": None, "server_arg": [],
                          "server_cores": None, "server_threads": None, "server_log": None}
# serve's options the load test sets and its report describes from its own (--dtype, --device,
# --server-threads, the target): given again in --server-arg, the report would describe another server.
OWN_SERVE_OPTIONS = ("--target", "--port", "--host", "--dtype", "--threads", "--device", "--metrics-port",
                     "--load-format")
# Options for a server given with --server.
GIVEN_SERVER_OPTIONS = ("tls_ca", "tls_cert", "tls_key", "metrics_url")


def split_cores(server: tuple[int, ...] | None, client: tuple[int, ...] | None,
                started: bool = True) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Server and load generator cores; by default the server gets the last core and the
    load generator the others (no pinning on a single core). A server not `started` here
    gets none, and the load generator is pinned only to cores given."""
    if not started:
        return (), client or ()
    if server is None:
        server = tuple(server_and_edge_cores()[0] or ())
    if client is None:
        client = tuple(c for c in sorted(START_CORES) if c not in server) if server else ()
    return server, client


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated options: the report's rerun line hides the values of the options it names
    # (paths, a metrics URL that may carry a token), and would miss them under another spelling.
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="With --server, a bearer token is read from $SPECSPLIT_TOKEN.",
                                allow_abbrev=False)
    target = p.add_mutually_exclusive_group()
    target.add_argument("--target", type=model_dir, help="target Hugging Face directory (default: the tiny test target, "
                        "built in a temporary directory, with its eos removed so generations run to the limit)")
    target.add_argument("--target-config", choices=sorted(ARCHS),
                        help="serve a target of this Qwen2.5 shape with random weights (config.json and the tiny "
                        "tokenizer only; passes --load-format dummy-echo to the server, so that its greedy output "
                        "does not depend on batching)")
    p.add_argument("--draft", type=draft_export, help="ONNX draft export for onnx edges (default: the tiny test "
                   "draft); with --server, its tokenizer also encodes the prompts")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where the server runs the target (default cpu)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], help="the target's dtype (default auto)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `specsplit-server serve`, repeatable (e.g. --server-arg=--max-wait-ms=50)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from none,sim,onnx (default: all)")
    p.add_argument("--sessions", type=int_list, default=(1, 2, 4, 8, 16, 32),
                   help="session counts, each once, swept in ascending order (default 1,2,4,8,16,32)")
    p.add_argument("--sessions-for", action="append", default=[], metavar="MODE=COUNTS",
                   help="session counts for one mode instead of --sessions, repeatable (e.g. sim=512,576,640)")
    p.add_argument("--repeats", type=at_least(1), default=1,
                   help="runs of each point; a point meets the SLO only if every run does, and reports a run "
                   "that missed it (the one with the slowest session among those), else the run with the slowest "
                   "session (default 1)")
    p.add_argument("--slo", type=at_least(0, float), default=20.0, help="tokens/s every session must get (default 20)")
    p.add_argument("--alpha", type=fraction, default=0.7, help="sim edges: per-position acceptance rate (default 0.7)")
    p.add_argument("--draft-delay-ms", type=at_least(0, float), default=0.0, help="sim edges: drafting time per token (default 0)")
    p.add_argument("--branch-coverage", type=fraction, default=0.0,
                   help="sim edges: chance that a wrong draft has a branch beside it from the right token, as a "
                   "real edge drafts one where its runner-up turns out right (default 0: no branches; the default "
                   "pair at RTT 50 ms: 0.39)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--duration", type=at_least(0, float, above=True), default=10.0, help="seconds per point (default 10)")
    length.add_argument("--generations", type=at_least(1),
                        help="instead of --duration: generations per session per point, failed ones included "
                        "(a server that refuses every one ends the point, not retried for good)")
    p.add_argument("--ramp", type=at_least(0, float), default=0.0,
                   help="seconds over which a point's sessions start, spread evenly, as devices arriving one after "
                   "another (default 0: all at once; of N sessions the last starts (N-1)/N of the way through); the "
                   "measured --duration begins when the ramp is over (with --generations, everything counts)")
    p.add_argument("--warmup", type=at_least(0, float), default=0.0,
                   help="seconds after the ramp before the measured window opens, so that the start-up's prefills "
                   "and waits are left out; needs --duration (default 0)")
    p.add_argument("--call-per-generation", action="store_true",
                   help="every generation on a new call, as edges did before they kept their stream for the next "
                   "generation (default: one stream per session, a new Open on it after each Done)")
    p.add_argument("--prompts", choices=list(PROMPT_SETS), default="stubs",
                   help="stubs: six short plain-text openings (default); benchmark: the benchmark's 12 prompts "
                   "under the target's chat template, for a trained --target")
    p.add_argument("--max-new-tokens", type=at_least(1), default=64, help="per generation (default 64)")
    p.add_argument("--window", type=at_least(1), default=16,
                   help="async edges' lookahead: the most drafts past the committed point; the edge adapts it "
                   "to the acceptance it sees, as real edges do by default (default 16)")
    p.add_argument("--fixed-window", action="store_true", help="async edges always draft --window ahead")
    p.add_argument("--seed", type=int, default=0, help="seed of the simulated drafters' draws")
    p.add_argument("--server-cores", type=cores, help="e.g. 1 or 4-7 (default: the last core)")
    p.add_argument("--server-threads", type=at_least(1), help="torch threads of the server (default: its core count, or 1)")
    p.add_argument("--client-cores", type=cores, help="load generator cores (default: all but the server's; with "
                   "--server, not pinned)")
    p.add_argument("--client-procs", type=at_least(1), default=1,
                   help="load generator processes; sessions are dealt round-robin, each process pinned to one "
                   "client core where there are any (default 1: everything in this process)")
    p.add_argument("--name", type=report_name, default="loadtest", help="writes NAME.json and NAME.md in --out-dir")
    p.add_argument("--out-dir", type=out_dir, default=RESULTS, help="where (default: bench/results)")
    p.add_argument("--server-log", type=Path,
                   help="keep the server's log here (default: not kept; its end is printed where a failed "
                   "point stops the sweep early)")
    given = p.add_argument_group("a server already running (none is started; the options for one do not apply)")
    given.add_argument("--server", type=host_port, metavar="HOST:PORT",
                       help="load this server; needs --draft, the export of a draft for its target")
    given.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server with: connect over TLS")
    given.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    given.add_argument("--tls-key", help="client private key (PEM) for mutual TLS")
    given.add_argument("--metrics-url", type=metrics_url, metavar="URL",
                       help="the server's Prometheus metrics (e.g. http://HOST:9100/metrics; default: not read, "
                       "and the report has no server figures)")
    return p


def metrics_url(text: str) -> str:
    url = urlparse(text)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise argparse.ArgumentTypeError(f"give an http:// or https:// URL, got {text!r}")
    return text


def check_server_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> ServerEndpoint | None:
    """The server given with --server, checked (None: the load test starts its own); usage
    errors for options that belong to the other kind of server."""
    if args.server is None:
        given = [name for name in GIVEN_SERVER_OPTIONS if getattr(args, name) is not None]
        if given:
            parser.error(f"--{given[0].replace('_', '-')} needs --server: the server the load test starts is "
                         "plaintext on loopback, its metrics read")
        return None
    started = [name for name, default in STARTED_SERVER_OPTIONS.items() if getattr(args, name) != default]
    if started:
        parser.error(f"--{started[0].replace('_', '-')} is for the server the load test starts, not one given "
                     "with --server")
    if args.draft is None:
        parser.error("--server needs --draft: its tokenizer encodes the prompts, and the server checks that it "
                     "is its target's")
    server = ServerEndpoint(args.server, args.tls_ca, args.tls_cert, args.tls_key,
                              os.environ.get("SPECSPLIT_TOKEN") or None)
    try:
        server.check()
    except ValueError as exc:
        parser.error(str(exc))
    return server


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.branch_coverage and args.draft_delay_ms:
        parser.error("--branch-coverage needs simulated edges that pick tokens at once (no --draft-delay-ms)")
    per_mode = {}
    for spec in args.sessions_for:
        mode, _, counts = spec.partition("=")
        try:
            parsed = int_list(counts)
        except argparse.ArgumentTypeError:
            parsed = ()
        if not parsed or mode in per_mode:
            parser.error(f"--sessions-for takes MODE=COUNTS once per mode (e.g. sim=512,576), got {spec!r}")
        per_mode[mode] = parsed
    try:
        cfg = SweepConfig(modes=tuple(filter(None, args.modes.split(","))), sessions=args.sessions, slo=args.slo,
                          per_mode=per_mode, repeats=args.repeats)
        settings = LoadSettings(max_new_tokens=args.max_new_tokens, window=args.window,
                                adaptive_window=not args.fixed_window, alpha=args.alpha,
                                draft_delay_ms=args.draft_delay_ms,
                                branch_coverage=args.branch_coverage, seed=args.seed,
                                duration_s=None if args.generations is not None else args.duration, generations=args.generations,
                                ramp_s=args.ramp, warmup_s=args.warmup,
                                call_per_generation=args.call_per_generation)
    except ValueError as exc:  # no modes or an unknown one, a count twice, alpha above 1, ...
        parser.error(str(exc))
    server = check_server_options(parser, args)
    if args.server_arg:  # serve's parser only where it is installed: a load generator for --server needs none
        from serve_args import serve_args_problem

        if problem := serve_args_problem(args.server_arg, OWN_SERVE_OPTIONS, args.device or "cpu"):
            parser.error(f"--server-arg: {problem}")
    server_cores, client_cores = split_cores(args.server_cores, args.client_cores, started=server is None)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    opts = RunOptions(
        target=args.target, target_config=args.target_config, draft=args.draft, device=args.device or "cpu",
        dtype=args.dtype or "auto", server_args=tuple(args.server_arg), server_cores=server_cores,
        server_threads=max(1, len(server_cores)) if args.server_threads is None else args.server_threads,
        client_cores=client_cores, client_procs=args.client_procs,
        server_log=args.server_log, prompt_set=args.prompts,
        rerun=rerun_command("bench/loadtest/run.py", argv, PATH_OPTIONS),
        server=server, metrics_url=args.metrics_url,
    )
    written: list[Path] = []

    def deliver(report: dict) -> None:
        if any(report["results"].values()):  # none: an earlier report of the name stays as it was
            written.extend(write_report(report, args.out_dir, args.name))
            print(written[1].read_text())
            log(f"wrote {written[0]} and {written[1]}")

    try:
        report = execute(opts, cfg, settings, deliver, log)
    except SetupError as exc:  # a server that refuses or fails us; prompts its tokenizer cannot make
        log(f"error: {exc}")
        return 1
    except KeyboardInterrupt:  # before the sweep, or while the server stopped after it
        log("interrupted while the server stopped" if written else
            "interrupted before any point finished: nothing to report")
        return 130
    if report["stopped"] == INTERRUPTED:
        if not written:
            log("interrupted before any point finished: nothing to report")
        return 130
    if not written:  # (the sweep has said why)
        log("no point finished: nothing to report")
        return 1
    summary = report["summary"]
    return 0 if summary["errors"]["total"] == 0 and summary["mismatched_outputs"] == 0 and not report["stopped"] else 1


if __name__ == "__main__":
    sys.exit(main())
