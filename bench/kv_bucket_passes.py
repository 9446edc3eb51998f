"""Static engine passes attending over each session's whole slot, or over the pass's KV bucket
(`serve --kv-buckets`), side by side in one process on the same sessions.

Sessions hold --kv-len positions, as a load test's short generations do, in slots of each
--max-len; for every slot size the two ways alternate, twice each, and the report gives the
median pass time of each over both rounds. Random weights of a real-architecture config.
Writes NAME.json and NAME.md into --out-dir (bench/results).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from cli_types import int_list, out_dir, report_name
from gpu_passes import build_engine, pass_times
from loadtest.machine import machine_info
from loadtest.rerun import rerun_command
from loadtest.targets import ARCHS
from report_files import save_report
from specsplit.server.static_engine import StaticEngine, kv_buckets

HERE = Path(__file__).resolve().parent
WAYS = ("whole slot", "KV bucket")


def measure(engine: StaticEngine, batches: list[int], tokens: list[int], kv_len: int, repeats: int) -> list[dict]:
    rows = []
    for way in WAYS * 2:  # alternating, so that a drift of the machine shows in both
        engine.kv_buckets = kv_buckets(engine.max_len) if way == "KV bucket" else (engine.max_len,)
        print(f"  max_len {engine.max_len}, {way}", file=sys.stderr, flush=True)
        rows += [{**r, "max_len": engine.max_len, "attend": way}
                 for r in pass_times(engine, batches, tokens, kv_len, repeats)]
    return rows


def render(report: dict) -> str:
    m = report["machine"]
    lines = [f"# Static engine passes: whole slot vs KV bucket ({report['arch']}, {m.get('gpu') or m['cpu']})", "",
             f"- machine: {m['cpu']}, {m['cores']} cores; device {report['device']}"
             f"{' (' + m['gpu'] + ')' if m.get('gpu') else ''}; torch {report['torch']}, {report['dtype']}",
             f"- sessions of {report['kv_len']} cached positions each, random weights, greedy; the two ways "
             "alternate twice in one process; median pass time (the engine's whole verify_batch) over both rounds",
             f"- KV buckets: doublings from 128 up to the slot (`serve --kv-buckets`); rerun: `{report['rerun']}`",
             "", "| slot positions | sessions x tokens | whole slot ms | KV bucket ms | speed-up |",
             "| --- | --- | --- | --- | --- |"]
    cells: dict = {}
    for r in report["rows"]:
        cells.setdefault((r["max_len"], r["sessions"], r["tokens_per_session"]), {}).setdefault(
            r["attend"], []).append(r["ms_median"])
    for (max_len, b, n), ways in cells.items():
        whole, bucketed = (statistics.median(ways[w]) for w in WAYS)
        lines.append(f"| {max_len} | {b} x {n} | {whole:.1f} | {bucketed:.1f} | {whole / bucketed:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    # No abbreviated options: the rerun line hides --out-dir's path only as spelled out.
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--arch", choices=[*ARCHS, "tiny"], default="qwen2-7b")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--max-len", type=int_list, default="512,2048", help="slot sizes (positions), comma-separated")
    p.add_argument("--batches", type=int_list, default="64,192,256", help="sessions per pass, comma-separated")
    p.add_argument("--tokens", type=int_list, default="1,4,8", help="tokens per session per pass (drafts + 1)")
    p.add_argument("--kv-len", type=int, default=150, help="positions each session holds")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--name", type=report_name, default="kv-bucket-passes")
    p.add_argument("--out-dir", type=out_dir, default=HERE / "results", help="where NAME.json and NAME.md go")
    args = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    batches, tokens = list(args.batches), list(args.tokens)
    report: dict = {"machine": machine_info(args.device), "arch": args.arch, "device": args.device, "dtype": dtype,
                    "torch": torch.__version__, "kv_len": args.kv_len,
                    "rerun": rerun_command("bench/kv_bucket_passes.py", argv, {"--out-dir": "OUT_DIR"}), "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for max_len in args.max_len:
            if max_len < args.kv_len + 64:
                p.error(f"--max-len {max_len} leaves no room for {args.kv_len} positions and a pass")
            engine = build_engine(args.arch, args.device, dtype, Path(tmp), "static", max(batches), max_len)
            assert isinstance(engine, StaticEngine)
            report["rows"] += measure(engine, batches, tokens, args.kv_len, args.repeats)
            del engine
            if args.device == "cuda":
                torch.cuda.empty_cache()
    save_report(args.out_dir, args.name, report, render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
