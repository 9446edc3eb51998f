"""Soak: many concurrent sessions against one server for minutes, with tiny models.

Real ONNX Runtime edges (one asyncio process, one drafter per concurrent session)
against a real server process; counts errors by status code and samples the server's
resident memory. Writes NAME.json and NAME.md (bench/results/soak.json and soak.md by
default).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import grpc
import psutil

from cli_types import at_least, out_dir, report_name
from loadtest.rerun import rerun_command
from orchestrate import exited, machine, running_server, server_and_edge_cores
from report_files import save_report
from tiny_models import build_tiny_pair

from specsplit.common.help_format import DefaultsHelpFormatter
from specsplit.edge.client import ConnectOptions, EdgeConfig, generate
from specsplit.edge.drafter import OnnxDrafter
from specsplit.edge.failures import GENERATION_FAILURES, status_name
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import EdgeTokenizer

HERE = Path(__file__).resolve().parent
WARM_UP_S = 60  # memory is judged from here on: the first minute fills caches and pools
ERROR_PAUSE_S = 0.05  # after a failed generation: a refused call must not become a busy loop
SAMPLE_S = 5.0  # how often the server's memory is sampled (and its being alive checked)
PROMPTS = ["def add(a, b):", "The quick brown fox", "for i in range(10):", "import numpy as np", "Hello, how are"]


async def load(address: str, draft_dir: Path, sessions: int, duration_s: float, proc: psutil.Process) -> dict:
    tok = EdgeTokenizer(draft_dir)
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]  # raw, as the edge sends them with --raw
    errors: collections.Counter = collections.Counter()
    done = tokens = 0
    memory: list[tuple[float, int]] = []
    deadline = time.monotonic() + duration_s
    lost = False  # the server exited: the soak ends there, failed
    start = time.monotonic()

    async def worker(i: int) -> None:
        nonlocal done, tokens, lost
        drafter = OnnxDrafter(draft_dir)
        modes = ["async", "sync", "none"]
        n = 0
        async with grpc.aio.insecure_channel(address) as channel:
            # Half the devices keep their stream between generations, half start a call for each.
            stream = GenerateStream.on(channel) if i % 2 == 0 else None
            while time.monotonic() < deadline and not lost:
                cfg = EdgeConfig(mode=modes[n % 3], max_new_tokens=16 + (i + n) % 48, window=8, k=4)
                try:
                    r = await generate(stream or channel, prompts[(i + n) % len(prompts)], cfg, drafter=drafter,
                                       fingerprint=tok.fingerprint, connect=ConnectOptions(retries=0))
                    done += 1
                    tokens += len(r.tokens)
                except GENERATION_FAILURES as exc:  # what a soak is for: counted, not raised
                    errors[status_name(exc)] += 1
                    # A failure may be the server gone. The sampler looks every SAMPLE_S, and a
                    # killed server that it found still tearing down failed 200 calls meanwhile.
                    lost = lost or exited(proc.pid)
                    await asyncio.sleep(ERROR_PAUSE_S)
                n += 1
            if stream is not None:
                stream.close()

    async def sample() -> None:
        nonlocal lost
        while time.monotonic() < deadline:
            try:
                if exited(proc.pid):
                    raise psutil.NoSuchProcess(proc.pid)
                memory.append((time.monotonic() - start, proc.memory_info().rss))
            except psutil.NoSuchProcess:
                lost = True
                return
            await asyncio.sleep(SAMPLE_S)

    await asyncio.gather(sample(), *(worker(i) for i in range(sessions)))
    return {"generations": done, "tokens": tokens, "errors": dict(errors), "rss_samples": memory,
            "server_exited": lost}


def main() -> int:
    # No abbreviated options: the rerun line hides --out-dir's path only as spelled out.
    p = argparse.ArgumentParser(description=__doc__, formatter_class=DefaultsHelpFormatter, allow_abbrev=False)
    p.add_argument("--sessions", type=at_least(1), default=64, help="concurrent sessions")
    p.add_argument("--minutes", type=at_least(0, float, above=True), default=5.0,
                   help="how long; memory is judged from minute 1 on where the run is longer than that")
    p.add_argument("--margin", type=at_least(0, float), default=0.10, help="allowed growth of server memory")
    p.add_argument("--name", type=report_name, default="soak", help="writes NAME.json and NAME.md in --out-dir")
    p.add_argument("--out-dir", type=out_dir, default=HERE / "results", help="where (default: bench/results)")
    args = p.parse_args()
    server_cores, _ = server_and_edge_cores()  # the edges run in this process, on whichever cores it has
    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_pair(Path(tmp))
        log = Path(tmp) / "server.log"
        with running_server(str(models.target_dir), server_cores, ["--max-sessions", str(args.sessions)], log,
                            dtype="fp32") as (address, server):
            result = asyncio.run(load(address, models.draft_dir, args.sessions, args.minutes * 60,
                                      psutil.Process(server.pid)))
    samples = result["rss_samples"]  # the first is taken at the start, so there is always one
    warm = [rss for t, rss in samples if t >= WARM_UP_S]
    judged_from = f"after {WARM_UP_S // 60} min warm-up" if warm else "at the start (the run is too short to leave out a warm-up)"
    warm = warm or [rss for _, rss in samples]
    growth = (warm[-1] - warm[0]) / warm[0]
    passed = not result["errors"] and not result["server_exited"] and growth <= args.margin
    report = {"sessions": args.sessions, "minutes": args.minutes, **result,
              "rss_after_warmup_mb": warm[0] / 2**20, "rss_end_mb": warm[-1] / 2**20, "rss_growth": growth,
              "margin": args.margin, "passed": passed,
              "setup": f"tiny random-weight qwen2 models; server {f'pinned to core {server_cores[0]}' if server_cores else 'not pinned'}; "
                       "edges in one process (mixed "
                       "async/sync/none sessions, 16-63 new tokens each, restarted back to back; half the edges keep "
                       "their stream between generations, half start a call for each)"}
    report["machine"] = machine()
    report["rerun"] = rerun_command("bench/soak.py", sys.argv[1:], {"--out-dir": "OUT_DIR"})
    note = (
        f"# Soak: {args.sessions} concurrent sessions for {args.minutes:g} min\n\n"
        f"- machine: {report['machine']['cpu']}, {report['machine']['cores']} cores\n- {report['setup']}\n- generations completed: {result['generations']}, tokens: {result['tokens']}\n"
        f"- errors by status: {result['errors'] or 'none'}\n"
        f"{'- the server exited during the soak, which ended there' + chr(10) if result['server_exited'] else ''}"
        f"- server RSS {judged_from} {report['rss_after_warmup_mb']:.0f} MB, at the end "
        f"{report['rss_end_mb']:.0f} MB ({growth:+.1%}; margin {args.margin:.0%})\n- result: "
        f"{'PASS' if passed else 'FAIL'}\n\nRerun: `{report['rerun']}`.\n")
    save_report(args.out_dir, args.name, report, note)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
