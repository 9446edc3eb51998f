"""specsplit-edge: draft on this device, verify on a specsplit server."""
from __future__ import annotations

from specsplit.common.grpc_logs import quiet_grpc_core

quiet_grpc_core()  # before grpc is imported, below

import argparse  # noqa: E402
import asyncio
import contextlib
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TextIO

import grpc

from specsplit.common.address import check_host_port, check_unix, is_loopback
from specsplit.common.help_format import DefaultsHelpFormatter, installed_version
from specsplit.common.tls import client_credentials, tls_hint
from specsplit.edge.attempt import PREFILL_ALLOWANCE_S
from specsplit.edge.branching import MIN_CHANCE
from specsplit.edge.client import (
    MODES,
    ConfigError,
    ConnectOptions,
    EdgeConfig,
    GenerationResult,
    OnCommitFailed,
    StreamStalled,
    generate,
    open_channel,
)
from specsplit.edge.drafter import BRANCHES as MAX_BRANCHES, OnnxDrafter
from specsplit.edge.retry import MAX_BACKOFF_S, pushback_of, retry_span
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import TEMPLATE_FAILED, EdgeTokenizer
from specsplit.protocol.errors import ProtocolError, ServerBrokeProtocol
from specsplit.protocol.messages import MAX_CHUNK, MAX_DIST_IDS, MAX_STOP_IDS, SamplingParams, VerificationMode

VERIFICATION = {"greedy": VerificationMode.GREEDY, "match": VerificationMode.MATCH, "sparse-q": VerificationMode.SPARSE_Q}


class TextStream:
    """Prints the decoded text as it grows, holding back an incomplete UTF-8 tail."""

    def __init__(self, tokenizer: EdgeTokenizer, out: TextIO | None = None) -> None:
        self.tokenizer = tokenizer
        self.out = out or sys.stdout  # the one at the time: a test or a caller may have replaced it
        self.printed = ""
        self.mid_line = False

    def __call__(self, generated: list[int]) -> None:
        text = self.tokenizer.decode(generated)
        if text.endswith("\ufffd"):
            return
        if new := self.unshown(text):
            self.out.write(new)
            self.out.flush()
            self.printed = text
            self.mid_line = not text.endswith("\n")

    def unshown(self, text: str) -> str:
        """What of `text` has not been printed: what follows the part it shares with the text
        printed. That is all of it past the printed text, except where the text changed under
        it: a byte-fallback tokenizer decodes a run of bytes that proves not to be UTF-8 as
        replacement characters, one a character already printed. Then the rest follows from
        where they part (the changed character shows twice), rather than never."""
        return text[len(os.path.commonprefix([self.printed, text])) :]

    def end_line(self) -> None:
        """End the line of text shown so far, if one is open."""
        if self.mid_line:
            self.out.write("\n")
            self.out.flush()
            self.mid_line = False


class LogBesideText(logging.StreamHandler):  # type: ignore[type-arg]
    """Log lines (a retry's warning, say) go to stderr. Where stdout and stderr are one
    terminal, the text being streamed there is ended first, so a warning never lands in the
    middle of a sentence; text sent elsewhere (a file, a pipe) is never touched."""

    def __init__(self, shares_terminal: bool) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))  # the level first: WARNING: ...
        self.shares_terminal = shares_terminal
        self.shown: TextStream | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.shares_terminal and self.shown is not None:
            self.shown.end_line()
        super().emit(record)


async def _prompts(args: argparse.Namespace, source: TextIO | None) -> AsyncIterator[tuple[int | None, str]]:
    """(None, PROMPT), or the lines of --prompts-file (`source`, open) as they come (standard
    input for '-', so a person can type them one by one) with their line numbers, blank
    lines skipped."""
    if args.prompts_file is None:
        yield None, args.prompt
        return
    assert source is not None
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | Exception] = asyncio.Queue()

    def hand(line: str | Exception) -> None:
        try:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        except RuntimeError:  # the program has ended meanwhile
            pass

    def read() -> None:
        # The thread owns the file: closed from the loop's side, a close would wait for a
        # read blocked on a pipe that nobody writes to.
        try:
            while line := source.readline():
                hand(line)
        except Exception as exc:  # raised on the loop's side, where it ends the run
            hand(exc)
        finally:
            if source is not sys.stdin:
                source.close()
            hand("")

    # A thread of its own that nothing waits for at exit: a read blocked on a terminal would
    # otherwise keep Ctrl-C from ending the program until Enter was pressed.
    threading.Thread(target=read, daemon=True, name="prompts").start()
    number = 0
    while line := await lines.get():
        if isinstance(line, UnicodeDecodeError):
            raise ValueError(f"--prompts-file {args.prompts_file}: not UTF-8 text ({line})")
        if isinstance(line, Exception):
            raise OSError(f"--prompts-file {args.prompts_file}: {line}")
        number += 1
        # Standard input under a C or UTF-8 locale reads bytes that are no UTF-8 as lone
        # surrogates, not as an error; and it keeps a Windows line end, which a file loses.
        if not _utf8(line):
            raise ValueError(f"--prompts-file {args.prompts_file}: line {number} is not UTF-8 text")
        if line.strip():
            yield number, line.rstrip("\r\n")


def open_prompts(args: argparse.Namespace) -> TextIO | None:
    """--prompts-file, open (None for PROMPT), with --stats-json found writable, before the
    draft is loaded: a wrong path costs a second. OSError naming the option otherwise. (The
    stats file is only looked at here: a run that fails to load leaves it as it was.)"""
    if args.stats_json:
        stats = Path(args.stats_json)
        if stats.is_dir():
            raise OSError(f"--stats-json {stats} is a directory")
        if not stats.exists() and not stats.parent.is_dir():
            raise OSError(f"--stats-json {stats}: its directory does not exist")
        if not os.access(stats if stats.exists() else stats.parent, os.W_OK):
            raise OSError(f"--stats-json {stats} cannot be written here")
        # Opened for writing, it would be emptied before a line of it was read as a prompt.
        if args.prompts_file not in (None, "-") and stats.exists() and Path(args.prompts_file).exists() \
                and os.path.samefile(stats, args.prompts_file):
            raise OSError(f"--stats-json {stats} is the --prompts-file: writing the stats would erase the prompts")
    if args.prompts_file == "-":
        if sys.stdin is None:
            raise OSError("--prompts-file -: there is no standard input")
        return sys.stdin
    if args.prompts_file is None:
        return None
    try:
        return open(args.prompts_file, encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise OSError(f"--prompts-file {args.prompts_file}: {exc.strerror}") from None


async def _generate(args: argparse.Namespace, log_handler: LogBesideText, prompts: TextIO | None) -> int:
    directory = Path(args.draft)
    try:
        tokenizer = EdgeTokenizer(directory)
        drafter = None if args.mode == "none" else OnnxDrafter(directory, threads=args.threads)
        try:
            stats_file = open(args.stats_json, "w", encoding="utf-8") if args.stats_json else None  # noqa: SIM115
        except OSError as exc:
            raise OSError(f"--stats-json {args.stats_json}: {exc.strerror}") from None
    except BaseException:
        if prompts is not None and prompts is not sys.stdin:
            prompts.close()  # not yet handed to its reading thread, which would close it
        raise
    cfg, connect = args.config, args.connect
    # Every prompt's generation on one kept stream (a new Open after each Done, no new call),
    # which moves to the next server only when its own fails.
    channels = [open_channel(server, connect) for server in args.servers]
    stream = GenerateStream.on(*channels)
    failed = 0
    try:
        async for line, prompt in _prompts(args, prompts):
            shown = log_handler.shown = None if args.json else TextStream(tokenizer)
            try:
                ids = tokenizer.encode(prompt, add_special_tokens=True) if args.raw else \
                    tokenizer.encode(tokenizer.chat_prompt(prompt))
                result = await generate(stream, ids, cfg, drafter=drafter,
                                        fingerprint=tokenizer.fingerprint, draft_model=str(directory),
                                        on_commit=shown, connect=connect)
            except BaseException as exc:
                if shown is not None:  # the error or the next prompt follows on a line of its own
                    with contextlib.suppress(OSError, UnicodeEncodeError):  # unless stdout is what failed
                        shown.end_line()
                if line is None or not (problem := _prompts_own(exc)):
                    raise
                failed += 1  # this prompt's fault: the next may go
                _report_refusal(line, prompt, problem, args, stats_file)
                continue
            _report(result, line, prompt, tokenizer, args, shown, stats_file)
            log_handler.shown = None  # the report ended its line; a warning before the next is on its own
    finally:
        stream.close()
        for channel in channels:
            await channel.close(grace=1.0)  # time for the server to end the half-closed call
        if stats_file is not None:
            stats_file.close()
    if failed:
        print(f"error: {failed} of the prompts failed (their lines say why)", file=sys.stderr)
    return 1 if failed else 0


# What the server refuses in one prompt rather than in every one: OUT_OF_RANGE (too long for
# its context), and a RESOURCE_EXHAUSTED without pushback (a message past its size limit: the
# Open, which carries the prompt, where a draft chunk holds at most MAX_CHUNK tokens; a full
# server's carries pushback). Its INVALID_ARGUMENTs (a token outside the vocabulary,
# max_new_tokens over its limit) come from the edge's settings or its draft, and would come
# again for every prompt.
def _refuses_prompt(exc: grpc.aio.AioRpcError) -> bool:
    return exc.code() == grpc.StatusCode.OUT_OF_RANGE or (
        exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and pushback_of(exc) is None)


def _prompts_own(exc: BaseException) -> str | None:
    """What went wrong with one prompt of many, where that is the prompt's own fault, not the
    run's: the server refused it, or the chat template failed on it."""
    if isinstance(exc, grpc.aio.AioRpcError) and _refuses_prompt(exc):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, ValueError) and str(exc).startswith(TEMPLATE_FAILED):
        return str(exc)
    return None


def _report_refusal(line: int, prompt: str, problem: str, args: argparse.Namespace,
                    stats_file: TextIO | None) -> None:
    """A prompt that failed on its own: an error line, and a JSON line in its place."""
    print(f"error: line {line}: {problem}", file=sys.stderr, flush=True)
    record = json.dumps({"line": line, "prompt": prompt, "error": problem})
    if stats_file is not None:
        stats_file.write(record + "\n")
        stats_file.flush()
    if args.json:
        print(record, flush=True)


def _report(result: GenerationResult, line: int | None, prompt: str, tokenizer: EdgeTokenizer,
            args: argparse.Namespace, shown: TextStream | None, stats_file: TextIO | None) -> None:
    """One generation's output: its text and stats line, or one JSON object (a line each)."""
    final = tokenizer.decode(result.tokens)
    record = {"line": line, "prompt": prompt, **result.stats.as_dict(),
              "session_id": result.opened.session_id if result.opened else None,
              "text": final, "token_ids": result.tokens}
    if stats_file is not None:
        stats_file.write(json.dumps({**record, "commit_times": result.commit_times, "timeline": result.timeline}) + "\n")
        stats_file.flush()
    try:
        if args.json:
            print(json.dumps(record), flush=True)
        else:
            if shown is not None:
                sys.stdout.write(shown.unshown(final))
            print(flush=True)
    except (OSError, UnicodeEncodeError) as exc:
        raise StdoutFailed() from exc
    if not args.json:  # beside the text, not in it: `generate ... > answer.txt` keeps the answer alone
        print(result.stats.line(), file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specsplit-edge", description=__doc__)
    p.add_argument("--version", action="version", version=f"%(prog)s {installed_version('specsplit-edge')}")
    sub = p.add_subparsers(dest="command", required=True,
                           parser_class=functools.partial(argparse.ArgumentParser, formatter_class=DefaultsHelpFormatter))
    g = sub.add_parser("generate", help="generate a completion of PROMPT (or of each line of --prompts-file)",
                       epilog="A bearer token for servers that require one is read from $SPECSPLIT_TOKEN. Exit "
                       "status: 0 done; 1 the server refused the generation, or lost it with the retries spent, or "
                       "prompts of --prompts-file failed, or writing the answer failed; 2 bad arguments, files or "
                       "draft export, or a server that broke the protocol; 130 interrupted; 141 the reader of "
                       "standard output went away.")
    g.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt (or give --prompts-file)")
    g.add_argument("--prompts-file", metavar="FILE",
                   help="instead of PROMPT: generate for each line of FILE in turn ('-': standard input, a line "
                   "at a time as it is typed), all on one kept stream; --json and --stats-json then give a "
                   "JSON line per prompt, with its line number. A prompt the server refuses as too long (for its "
                   "context or its message size limit), or the chat template refuses, "
                   "gets an error line (and a JSON line with its error) and the rest go on; the exit status "
                   "is then 1")
    g.add_argument("--server", required=True,
                   help="HOST:PORT of the specsplit server; a comma-separated list fails over in order (the stream "
                   "stays on the server it failed over to)")
    g.add_argument("--draft", required=True, help="draft export directory (specsplit-server export-draft)")
    g.add_argument("--mode", choices=sorted(MODES), default=EdgeConfig.mode, help="async (default), sync or none")
    g.add_argument("--max-new-tokens", type=int, default=EdgeConfig.max_new_tokens, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=SamplingParams.temperature, help="0 (default) is greedy")
    g.add_argument("--top-p", type=float, default=SamplingParams.top_p,
                   help="sample among the likeliest tokens that make up this much probability (0 or 1: all)")
    g.add_argument("--top-k", type=int, default=SamplingParams.top_k, help="sample among this many likeliest tokens (0: all)")
    g.add_argument("--seed", type=int, default=SamplingParams.seed, help="seed of the sampled draws: with match verification (the default) the same text for "
                   "the same seed in every mode, up to the target's rounding (on a GPU, its batching); "
                   "with sparse-q the same distribution (default %(default)s)")
    g.add_argument("--verification", choices=sorted(VERIFICATION), default=None,
                   help="greedy (the default at temperature 0); sampled: match (the default above it) or sparse-q")
    g.add_argument("--sparse-top-k", type=int, default=EdgeConfig.sparse_top_k, help=f"draft distribution size in sparse-q mode (at most {MAX_DIST_IDS})")
    g.add_argument("--window", type=int, default=EdgeConfig.window,
                   help="async: drafts allowed ahead of the committed point; with the adaptive window, at most this many")
    g.add_argument("--adaptive-window", action=argparse.BooleanOptionalAction, default=EdgeConfig.adaptive_window,
                   help="async: draft ahead as far as the acceptance seen so far makes worthwhile (two expected "
                   "runs of accepted drafts, at least 4, at most --window); --no-adaptive-window drafts --window "
                   "ahead always")
    g.add_argument("--k", type=int, default=EdgeConfig.k, help="sync: drafts per round (at most the server's lookahead "
                   f"and {MAX_CHUNK}: more are drafted as that many)")
    g.add_argument("--branch-tokens", type=int, default=EdgeConfig.branch_tokens,
                   help="async, greedy: beside its drafts, draft branches of up to this many tokens from the "
                   f"drafter's runner-up where rejections are likeliest (if that chance is at least {MIN_CHANCE}), "
                   "in the same batched steps as the drafts; the server verifies a branch in the pass that "
                   f"verifies the draft beside it (at most {MAX_CHUNK}: longer ones are drafted as that long; "
                   "default %(default)s; 0: no branches)")
    g.add_argument("--branches", type=int, choices=range(MAX_BRANCHES + 1), default=EdgeConfig.branches,
                   help="async, greedy: how many branches may be open beside the drafts at once "
                   "(default %(default)s; 0: none)")
    g.add_argument("--threads", type=int, default=1,
                   help="ONNX Runtime threads for the drafter (0: one per core this process may run on, as "
                        "taskset or a container's cpuset allow; default %(default)s)")
    g.add_argument("--stop-id", type=int, action="append", default=[],
                   help=f"extra stop token id (repeatable, at most {MAX_STOP_IDS})")
    g.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    g.add_argument("--tls", action="store_true",
                   help="connect over TLS, trusting gRPC's default public CAs (--tls-ca names a CA of your own)")
    g.add_argument("--tls-ca", help="CA certificate (PEM) to verify the server with: connect over TLS")
    g.add_argument("--tls-server-name", metavar="NAME",
                   help="the name the server's certificate holds, where --server dials it by another (an IP address)")
    g.add_argument("--tls-cert", help="client certificate (PEM) for mutual TLS")
    g.add_argument("--tls-key", help="client private key (PEM) for mutual TLS")
    g.add_argument("--retries", type=int, default=ConnectOptions.retries, help="re-opens in a row after a lost server or stream, or a full one that says when "
                   "to try again (resumes, on the next --server if there are several: a failover is a retry, so give "
                   "at least one fewer than the servers); an attempt that committed tokens starts the count and "
                   f"the backoff over. The waits between them double from {ConnectOptions.backoff_s:g} s up to "
                   f"{MAX_BACKOFF_S:g} s: the default, %(default)s, rides out "
                   f"about {retry_span(ConnectOptions.retries, ConnectOptions.backoff_s):.0f} s or more of a server that is down (a restart of "
                   "the default target takes about a minute)")
    g.add_argument("--stall-timeout", type=float, default=ConnectOptions.stall_timeout_s,
                   help="seconds without a message from the server before the stream counts as lost; a "
                   f"generation's first verdict, which waits on the prompt's prefill, may take {PREFILL_ALLOWANCE_S:g} s "
                   "more per prompt token")
    g.add_argument("--connect-timeout", type=float, default=ConnectOptions.connect_timeout_s,
                   help="seconds a connection to the server (TCP, TLS, HTTP/2) may take before the attempt fails "
                   "and is retried; an address that takes TCP but never answers costs this much an attempt")
    g.add_argument("--json", action="store_true", help="print only one JSON object: stats, text and token ids")
    g.add_argument("--stats-json", metavar="FILE", help="also write stats, text, token ids and commit times to FILE")
    g.add_argument("--timeline", action="store_true", help="record a drafting/sending/verdict timeline in --stats-json")
    g.set_defaults(command_parser=g)  # for errors that give the command's own usage
    return p


def server_list(servers: str) -> list[str]:
    """The comma-separated --server entries; ValueError unless each is HOST:PORT
    (`check_host_port`) or a unix: socket."""
    entries = [s.strip() for s in servers.split(",") if s.strip()]
    if not entries:
        raise ValueError("--server: give HOST:PORT")
    for server in entries:
        try:
            (check_unix if server.startswith(("unix:", "unix-abstract:")) else check_host_port)(server)
        except ValueError as exc:
            raise ValueError(f"--server {server!r}: {exc}") from None
    return entries


# Where ConfigError's fields come from on this command line; others are --FIELD-NAME.
FLAGS = {"stop_ids": "--stop-id", "stall_timeout_s": "--stall-timeout", "connect_timeout_s": "--connect-timeout",
         "token": "$SPECSPLIT_TOKEN"}


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the first setting that no generation can run with. Keeps what
    it built on `args`: `servers`, `config` (EdgeConfig) and `connect` (ConnectOptions),
    whose own checks name their fields, here turned into flags."""
    args.servers = server_list(args.server)
    if args.threads < 0:
        raise ValueError(f"--threads must be at least 0, got {args.threads}")
    if args.timeline and not args.stats_json:
        raise ValueError("--timeline is written to --stats-json: give that too")
    if args.prompt is not None and not args.prompt.strip():
        raise ValueError("PROMPT is empty")
    if args.prompt is not None and not _utf8(args.prompt):
        raise ValueError("PROMPT is not UTF-8 text")
    if not _utf8(args.draft):  # the Open names the draft, in UTF-8
        raise ValueError(f"--draft {args.draft!r}: the path is not UTF-8 text; rename it")
    if args.tls_server_name is not None and not (args.tls or args.tls_ca or args.tls_cert):
        raise ValueError("--tls-server-name is for TLS: give --tls or --tls-ca too")
    try:
        args.config = EdgeConfig(
            mode=args.mode, window=args.window, adaptive_window=args.adaptive_window, k=args.k,
            branch_tokens=args.branch_tokens, branches=args.branches, max_new_tokens=args.max_new_tokens,
            sampling=SamplingParams(args.temperature, args.top_p, args.top_k, args.seed),
            verification=VERIFICATION[args.verification] if args.verification else None,
            sparse_top_k=args.sparse_top_k, stop_ids=tuple(args.stop_id), timeline=args.timeline,
        )
        args.connect = ConnectOptions(
            credentials=client_credentials(args.tls_ca, args.tls_cert, args.tls_key, args.tls),
            tls_server_name=args.tls_server_name,
            token=os.environ.get("SPECSPLIT_TOKEN") or None, stall_timeout_s=args.stall_timeout, retries=args.retries,
            connect_timeout_s=args.connect_timeout, hint=lambda details: _hint(details, args),
        )
        args.connect.check_servers(len(args.servers))
    except ConfigError as exc:
        field = exc.field.removeprefix("sampling.")  # sampling.top_p: --top-p
        raise ValueError(f"{FLAGS.get(field, '--' + field.replace('_', '-'))} {exc.problem}") from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.prompt is None) == (args.prompts_file is None):
        args.command_parser.error("give either PROMPT or --prompts-file")
    try:
        check_args(args)
    except ValueError as exc:
        args.command_parser.error(str(exc))
    if args.connect.token and args.connect.credentials is None and not all(map(_loopback, args.servers)):
        print("warning: $SPECSPLIT_TOKEN goes to the server in the clear: without --tls or --tls-ca the connection is "
              "plaintext, and anyone on the path can read the token and use it", file=sys.stderr)
    try:
        prompts = open_prompts(args)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log_handler = LogBesideText(sys.stdout.isatty() and sys.stderr.isatty())
    logger = logging.getLogger("specsplit")
    logger.addHandler(log_handler)
    try:
        return asyncio.run(_generate(args, log_handler, prompts))
    except (OnCommitFailed, StdoutFailed) as exc:  # OnCommitFailed: the streamed text's writer raised
        if isinstance(exc.__cause__, (OSError, UnicodeEncodeError)):
            return _stdout_failed(exc.__cause__)
        raise
    except BrokenPipeError:  # the stats line's reader has gone (`2>&1 | head`)
        return _stdout_failed(BrokenPipeError())
    except (grpc.aio.AioRpcError, StreamStalled) as exc:
        print(f"error: {exc.code().name}: {exc.details()}{_hint(exc.details() or '', args)}", file=sys.stderr)
        return 1
    # The stream ended before its Done, retries spent (an OSError: caught first); or the server
    # broke the protocol: the server's failure, as a lost one is, not a setting of the user's.
    except (ConnectionError, ServerBrokeProtocol) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError, ProtocolError) as exc:  # files, the draft export, settings the server's rules refuse
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130  # as a shell reports a program ended by SIGINT
    finally:
        logger.removeHandler(log_handler)


class StdoutFailed(Exception):
    """Writing the answer to standard output failed; the cause says how."""


def _hint(details: str, args: argparse.Namespace) -> str:
    return tls_hint(details, tls=args.connect.credentials is not None, client_cert=bool(args.tls_cert),
                    address_flag="--server")


def _utf8(text: str) -> bool:
    """Whether `text` holds no lone surrogates: the command line's bytes that were no UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _loopback(server: str) -> bool:
    """Whether `server` is on this machine: a loopback address or a unix socket."""
    return server.startswith(("unix:", "unix-abstract:")) or is_loopback(server.rpartition(":")[0])


def _stdout_failed(cause: BaseException) -> int:
    """Where the reader of stdout has gone, stop quietly, as a program killed by SIGPIPE
    would; say what else failed (a full disk, an encoding without the text's characters).
    stdout goes to devnull so that the interpreter's last flush does not fail on it too."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if isinstance(cause, BrokenPipeError):
        return 141
    print(f"error: writing the answer to standard output failed: {cause}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
