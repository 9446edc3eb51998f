"""What the dynamic engine's pass split (the server's --max-pass-cache-mb) saves and costs.

A pass pads every session's cache to its longest: one long context among short ones makes
every row as long. Over the limit the engine runs the pass as several (engine.pass_groups),
sessions of like length together. This times one verification step of such a batch (one
long context, many short ones, each with drafts) whole and under each limit given: the
forward passes it took, the padded cache positions they held, the memory the step took at
its peak on a GPU, and the sessions whose greedy ids differ from the whole pass's.

Runs on CPU too (`--arch tiny`), which is how its code is kept working without a GPU.
Writes NAME.json and .md into --out-dir (bench/results).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cli_types import START_CORES, int_list, out_dir, report_name
from gpu_passes import load_target, release, sync
from loadtest.machine import machine_info
from loadtest.rerun import rerun_command
from loadtest.targets import ARCHS
from report_files import save_report
from specsplit.server.engine import TargetEngine, VerifyItem
from specsplit.server.loading import LoadedModel

HERE = Path(__file__).resolve().parent
MIB = 1 << 20


def mixed_batch(engine: TargetEngine, long: int, short: int, sessions: int, drafts: int,
                rng: np.random.Generator) -> list[VerifyItem]:
    """One session with a `long` context and `sessions - 1` with `short` ones, each cached (fed
    alone, so that no limit changes their caches) and then verifying `drafts` random drafts."""
    vocab = engine.vocab_size
    items = []
    for n in (long, *[short] * (sessions - 1)):
        prefix = list(map(int, rng.integers(0, vocab, n + 1)))
        state = engine.new_state()
        engine.verify_batch([VerifyItem(state, prefix, [], greedy=True)])
        items.append(VerifyItem(state, prefix, list(map(int, rng.integers(0, vocab, drafts))), greedy=True))
    return items


def padded_positions(engine: TargetEngine, items: list[VerifyItem]) -> tuple[int, int]:
    """(passes, cache positions their padding holds) of the engine's verification of `items`."""
    past, feeds, groups = engine.pass_plan(items)
    return len(groups), sum(len(g) * (max(past[i] for i in g) + max(feeds[i] for i in g)) for g in groups)


def step(loaded: LoadedModel, limit_mb: int | None, args: argparse.Namespace) -> tuple[dict, list[np.ndarray]]:
    """One limit's row of the report, and each session's greedy ids; `limit_mb` None: every
    session in a pass of its own."""
    engine = TargetEngine(loaded, max_pass_cache_bytes=1 if limit_mb is None else limit_mb * MIB)
    items = mixed_batch(engine, args.long, args.short, args.sessions, args.drafts, np.random.default_rng(0))
    planned, positions = padded_positions(engine, items)
    engine.verify_batch(items)  # warm-up: each step re-crops every cache and feeds the same tokens
    cuda = engine.device.type == "cuda"
    times, peak = [], 0
    for _ in range(args.repeats):
        sync(engine)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
        before = engine.forward_passes
        t0 = time.perf_counter()
        ids = engine.verify_batch(items)
        sync(engine)
        times.append(time.perf_counter() - t0)
        assert engine.forward_passes - before == planned, "the engine ran other passes than it planned"
        if cuda:
            peak = max(peak, torch.cuda.max_memory_allocated() - held)
    release([it.kv for it in items])
    row = {"limit_mb": limit_mb, "passes": planned, "padded_positions": positions,
           "padded_cache_mib": positions * engine.position_bytes / MIB, "ms_median": 1000 * float(np.median(times)),
           "peak_mib": peak / MIB if cuda else None}
    print(f"  {_limit(limit_mb)}: {planned} pass(es), {row['ms_median']:.1f} ms", file=sys.stderr, flush=True)
    return row, ids


def _limit(limit_mb: int | None) -> str:
    return "each alone" if limit_mb is None else "whole" if limit_mb == 0 else f"{limit_mb} MiB"


def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"# The dynamic engine's pass split ({report['arch']}, {report['dtype']}, random weights)", "",
             f"Machine: {m.get('gpu') or m.get('cpu')}; torch {report['torch']}, {report['threads']} thread(s) on "
             f"cores {report['cores']}. One verification step of "
             f"{report['sessions']} sessions: one with {report['long']} cached positions, the rest {report['short']}, "
             f"each with {report['drafts']} drafts; median of {report['repeats']}. Whole: no limit, the reference "
             f"(a server given --max-pass-cache-mb 0 takes an eighth of the memory available). Sessions differing: "
             f"greedy ids unlike the whole pass's; each session alone is the control, what any other batch "
             f"does in this dtype on this device. Rerun: `{report['rerun']}`", "",
             "| limit | passes | padded cache MiB | step ms | peak MiB (GPU) | sessions differing |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["rows"]:
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {_limit(r['limit_mb'])} | {r['passes']} | {r['padded_cache_mib']:.1f} | {r['ms_median']:.1f} | "
                     f"{peak} | {r['sessions_differing']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    # No abbreviated options: the rerun line hides --out-dir's path only as spelled out.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--arch", choices=[*ARCHS, "tiny"], default="qwen2-7b")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--long", type=int, default=4096, help="cached positions of the one long session")
    p.add_argument("--short", type=int, default=256, help="cached positions of each other session")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--drafts", type=int, default=4, help="drafts each session verifies")
    p.add_argument("--limits-mb", type=int_list, default="1024,256",
                   help="--max-pass-cache-mb values, comma-separated; the whole pass, with no limit, runs first "
                   "as the reference the others are checked against, and each session alone last as a control")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--name", type=report_name, default="pass-split")
    p.add_argument("--out-dir", type=out_dir, default=HERE / "results", help="where NAME.json and NAME.md go "
                   "(default: bench/results)")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if min(args.long, args.short, args.sessions, args.repeats) < 1 or args.drafts < 0:
        p.error("--long, --short, --sessions and --repeats must be at least 1, --drafts at least 0")
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    limits: list[int | None] = [0, *[limit for limit in args.limits_mb if limit], None]
    report: dict = {"machine": machine_info(args.device), "arch": args.arch, "dtype": dtype, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cores": ",".join(map(str, sorted(START_CORES))) or "any",
                    "long": args.long, "short": args.short, "sessions": args.sessions, "drafts": args.drafts,
                    "repeats": args.repeats, "rerun": rerun_command("bench/pass_split.py", argv, {"--out-dir": "OUT_DIR"}),
                    "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"{args.arch}: loading ({dtype} on {args.device})", file=sys.stderr, flush=True)
        loaded = load_target(args.arch, args.device, dtype, Path(tmp))
        whole: list[np.ndarray] = []
        for limit in limits:
            row, ids = step(loaded, limit, args)
            whole = whole or ids
            row["sessions_differing"] = sum(not np.array_equal(a, b) for a, b in zip(whole, ids))
            report["rows"].append(row)
    save_report(args.out_dir, args.name, report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
