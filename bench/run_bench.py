"""Benchmark: server-only, synchronous and asynchronous speculative decoding over an
emulated network, plus the draft alone and Hugging Face assisted generation.

Everything runs side by side in one run on the same prompts: the server pinned to one
core, edges (and this driver, and the network proxy) on the other, one thread each.
Writes <out>/<name>.json (--out: bench/results by default), a Markdown table beside it, and
the server's log as <out>/<name>-server.log.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from tqdm import tqdm

from cli_types import at_least, between, out_dir, report_name
from netem_proxy import LinkConfig, NetemProxy
from orchestrate import machine, pin, run_edge, running_server, server_and_edge_cores
from prepared_pair import prepared_pair
from prompt_set import benchmark_prompts
from report import render_markdown, summarize
from runlog import RunLog, SettingsMismatch
from serve_args import serve_args_problem, serve_settings

from specsplit.common.export_meta import DraftExportMeta
from specsplit.common.help_format import DefaultsHelpFormatter
from specsplit.common.signals import exit_on_sigterm
from specsplit.protocol.messages import MAX_CHUNK
from specsplit.server import models
from specsplit.server.loading import resolve_dtype

HERE = Path(__file__).resolve().parent


class ProxyThread:
    """The netem proxy on its own event loop in a background thread."""

    def __init__(self, target: str, delay_s: float, rate_bps: float) -> None:
        host, port = target.rsplit(":", 1)
        self.loop = asyncio.new_event_loop()
        self.proxy = NetemProxy(host, int(port), LinkConfig(delay_s, rate_bps))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def run_script(script: str, args: list[str], cores: list[int] | None) -> list[dict]:
    proc = subprocess.run([sys.executable, str(HERE / script), *args], capture_output=True, text=True,
                          preexec_fn=pin(cores), env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{script} failed: {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _window(text: str) -> str:
    async_window(text)  # refuses what it cannot take; the report keeps the text
    return text


def async_window(window: str) -> list[str]:
    """The edge's lookahead options for the benchmark's --window."""
    if window == "auto":
        return ["--adaptive-window", "--window", "32"]  # the edge's default
    if not window.isdigit() or int(window) < 1:
        raise argparse.ArgumentTypeError(f"give a positive number or auto, not {window!r}")
    return ["--no-adaptive-window", "--window", window]


# Set by the benchmark itself: given again in --server-args, they would break the run or make
# its header describe another server.
# Set by the benchmark, or stated by its report's header (a CPU server on one core, the real
# target by its name): given through --server-args the header would say what the run did not do.
OWN_SERVE_OPTIONS = ("--target", "--port", "--host", "--dtype", "--threads", "--device", "--load-format",
                     "--model-name")


def main(argv: list[str] | None = None) -> int:
    all_prompts = benchmark_prompts()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter)
    p.add_argument("--name", type=report_name, required=True,
                   help="writes NAME.json and NAME.md in --out (the make targets use full, quick and rtt50)")
    p.add_argument("--rtt-ms", type=at_least(0, float), nargs="+", default=[50, 0, 20, 100],
                   help="RTTs to sweep, in the order measured (the goal's 50 ms first)")
    p.add_argument("--prompts", type=at_least(0), default=0,
                   help=f"use the first N of the {len(all_prompts)} prompts (default 0: all)")
    p.add_argument("--max-new-tokens", type=at_least(1), default=128, help="per generation")
    # An edge drafts at most MAX_CHUNK a round: a larger k would run, and be labelled, as what it is not.
    p.add_argument("--sync-k", type=between(1, MAX_CHUNK), nargs="+", default=[2, 4, 6, 8],
                   help=f"drafts per round of sync (1 to {MAX_CHUNK})")
    p.add_argument("--window", type=_window, default="auto",
                   help="async lookahead: auto (default, the edge's default: sized from the acceptance seen, at most "
                   "32), or a fixed number of drafts (the edge's --no-adaptive-window)")
    p.add_argument("--rate-mbit", type=at_least(0, float), default=0.0, help="bandwidth cap per direction (0: none)")
    p.add_argument("--no-hf", action="store_true", help="skip Hugging Face assisted generation")
    p.add_argument("--async-no-branches", action="store_true",
                   help="also measure async with the edge drafting no branches (mode async-no-branches)")
    p.add_argument("--server-args", type=shlex.split, default=[],
                   help="extra arguments for specsplit-server serve, as one string (shell quoting applies); "
                   "give it with = where it starts with a dash: --server-args='--max-wait-ms 50 --max-verify-tokens 8'")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs already in <out>/<name>.partial.json, a stopped sweep's (or in <out>/<name>.json; "
                   "same settings) and measure only the missing ones. Without it an earlier <name>.json stays as it "
                   "is until the new sweep completes")
    p.add_argument("--out", type=out_dir, default=HERE / "results", help="where (default: bench/results)")
    args = p.parse_args(argv)
    if args.prompts > len(all_prompts):
        p.error(f"--prompts: there are {len(all_prompts)} prompts, not {args.prompts}")
    if problem := serve_args_problem(args.server_args, OWN_SERVE_OPTIONS):
        p.error(f"--server-args: {problem}")
    # The edge drafts no further than the server takes, whatever it is told: a run past that
    # would be labelled as what it did not run. Nor does the server verify more at once than its
    # --max-verify-tokens: a sync round past that is verified in parts, the next sent before
    # the last is settled, which is not the classic scheme.
    serve = serve_settings(args.server_args)
    lookahead = serve.max_lookahead
    for limit, flag in ((lookahead, "--max-lookahead"), (serve.max_verify_tokens, "--max-verify-tokens")):
        if max(args.sync_k) > limit:
            p.error(f"--sync-k {max(args.sync_k)} is past the server's {flag} {limit}")
    if args.window != "auto" and int(args.window) > lookahead:
        p.error(f"--window {args.window} is past the server's --max-lookahead {lookahead}")
    args.rtt_ms = list(dict.fromkeys(args.rtt_ms))  # an RTT given twice is one group of runs
    args.sync_k = list(dict.fromkeys(args.sync_k))  # and a k given twice one mode
    async_args = async_window(args.window)

    server_cores, edge_cores = server_and_edge_cores()
    if edge_cores:
        os.sched_setaffinity(0, edge_cores)  # the driver and the proxy stay off the server's core
    prompts = all_prompts
    prompts = prompts[: args.prompts] if args.prompts else prompts
    pair = prepared_pair()
    header = {
        "name": args.name,
        "machine": machine(),
        "pinning": (f"server on core {server_cores[0]}; edge, proxy and driver on core {edge_cores[0]}; one thread each"
                    if server_cores and edge_cores else "not pinned (fewer than two cores); one thread each"),
        "models": {"target": str(pair.target_dir.name), "target_dtype": resolve_dtype("auto", "cpu"),
                   "draft": str(pair.draft_dir.name), "draft_quantization": DraftExportMeta.load(pair.draft_dir).weights},
        "network": {"rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit or None,
                    "how": "user-space TCP proxy adding rtt/2 one-way delay in each direction and "
                            "a TCP handshake to each new connection (its first bytes a round trip later)"},
        "settings": {"max_new_tokens": args.max_new_tokens, "window": int(args.window) if args.window.isdigit() else args.window, "sync_k": args.sync_k,
                     "temperature": 0, "server_args": shlex.join(args.server_args), "prompts": [pr["id"] for pr in prompts],
                     "hf_assisted": not args.no_hf,
                     **({"async_no_branches": True} if args.async_no_branches else {})},
    }
    try:
        log = RunLog(Path(args.out) / f"{args.name}.json", header, render_markdown, summarize, args.resume)
    except SettingsMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    modes = [("none", "none", []), *[(f"sync-{k}", "sync", ["--k", str(k)]) for k in args.sync_k],
             *([("async-no-branches", "async", [*async_args, "--branch-tokens", "0"])] if args.async_no_branches else []),
             ("async", "async", [*async_args, "--timeline"])]
    anchors = ["draft", *([] if args.no_hf else ["hf-assisted"])]
    todo = set(log.missing([(a, None, pr["id"]) for a in anchors for pr in prompts]
                           + [(m, rtt, pr["id"]) for rtt in args.rtt_ms for pr in prompts for m, _, _ in modes]))
    # A (prompt, RTT) group with any run missing is measured whole (below).
    groups = {(rtt, pid) for m, rtt, pid in todo if rtt is not None}
    count = sum(rtt is None for _, rtt, _ in todo) + len(groups) * len(modes)
    print(f"{count} runs to measure ({len(log.done)} already in {log.path})", flush=True)
    progress = tqdm(total=count, unit="run", desc=args.name)
    n = str(args.max_new_tokens)

    def record(mode: str, rtt, prompt_id: str, stats: dict) -> None:
        log.add({**stats, "mode": mode, "rtt_ms": rtt, "prompt": prompt_id})
        progress.write(f"  {mode:>11} rtt={rtt} {prompt_id}: {stats['tokens']} tokens, {stats['tokens_per_s']:.2f} tok/s")
        progress.update()

    def anchor(mode: str, title: str, script: str, script_args, cores: list[int] | None) -> None:  # type: ignore[no-untyped-def]
        """Measure the prompts still missing for a network-free mode; script_args is called
        only then (the HF anchor needs the GGUF draft, checked on disk by models.pull)."""
        wanted = [pr for pr in prompts if (mode, None, pr["id"]) in todo]
        if not wanted:
            return
        progress.write(f"== {title}")
        texts = [w["text"] for w in wanted]
        for pr, r in zip(wanted, run_script(script, [*script_args(), "--max-new-tokens", n, *texts], cores)):
            record(mode, None, pr["id"], r)

    server_log = Path(args.out) / f"{args.name}-server.log"
    server_started = False  # (a log from an earlier run may lie there until then)
    try:
        weights = DraftExportMeta.load(pair.draft_dir).quantization
        anchor("draft", f"draft alone (ONNX {weights}, one core, one thread)", "draft_alone.py",
               lambda: ["--draft", str(pair.draft_dir)], edge_cores)
        anchor("hf-assisted", f"Hugging Face assisted generation (both models {resolve_dtype('auto', 'cpu')}, one process, one core)",
               "hf_assisted.py", lambda: ["--target", str(pair.target_dir), "--draft", str(models.pull()["draft"])],
               server_cores)

        if groups:
            server_started = True
            with running_server(str(pair.target_dir), server_cores, extra=args.server_args,
                                log_path=server_log) as (addr, _):
                for rtt in args.rtt_ms:
                    wanted = [pr for pr in prompts if (rtt, pr["id"]) in groups]
                    if not wanted:
                        continue
                    proxy = ProxyThread(addr, rtt / 2000, args.rate_mbit * 1e6)
                    progress.write(f"== RTT {rtt:g} ms through the proxy")
                    try:
                        for pr in wanted:
                            # A (prompt, RTT) group is measured whole, so its modes stay side by side in one
                            # server's lifetime even when an earlier invocation measured part of it.
                            for name, edge_mode, extra in modes:
                                up, down = proxy.proxy.bytes_up, proxy.proxy.bytes_down
                                stats = run_edge(proxy.address, str(pair.draft_dir), pr["text"], edge_mode, edge_cores,
                                                 ["--max-new-tokens", n, *extra])
                                # What crossed the link for the run: HTTP/2 and TLS framing, pings and
                                # window updates too, besides the messages (stats' bytes_up/down).
                                record(name, rtt, pr["id"], {**stats, "wire_bytes_up": proxy.proxy.bytes_up - up,
                                                             "wire_bytes_down": proxy.proxy.bytes_down - down})
                    finally:
                        proxy.close()
    except KeyboardInterrupt:
        progress.close()
        print(f"interrupted: {len(log.done)} runs kept in {log.path}; the same command with --resume measures "
              "the rest", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as exc:  # a script or an edge failed, the server did not come up
        progress.close()
        where = f"; the server's log: {server_log}" if server_started else ""
        print(f"error: {exc}{where} (the runs measured are kept: --resume)", file=sys.stderr)
        return 1
    progress.close()
    log.save(complete=True)
    print(log.path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    # SIGTERM (a job's timeout, `kill`) as SystemExit from the start, not only while the server
    # runs: during the anchors it ended this driver alone, and the child it waited on (the
    # Hugging Face anchor, minutes) ran on, pinned to the server's core.
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    sys.exit(main())
