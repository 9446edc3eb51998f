"""The capacity result of a load test, in the short form the project tracks.

Reads a load-test report (bench/results/NAME.json from run.py) and writes OUT.json with
`device`, `target_config`, `alpha`, `slo_tokens_per_s`, `baseline_sessions_at_slo`,
`split_sessions_at_slo`, `ratio` and `errors`, plus OUT.md, a note that says how the run is
repeated (the project keeps the GPU's at bench/results/capacity-gpu). Where a sweep did not
find a mode's limit (its first point missed the SLO, or its last met it), `*_limit` says so
and the ratio is a bound, or unknown.

    python bench/loadtest/capacity.py bench/results/capacity-gpu-run.json --out bench/results/capacity-gpu
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if not __package__:
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # as run.py: import from bench/

from loadtest.report import limit_text  # noqa: E402
from loadtest.sweep import slo_limit  # noqa: E402

# What the ratio split / baseline is, by where each limit lies (sweep.slo_limit): exact where
# both were found; a bound where one lies beyond the sweep; unknown otherwise.
# A limit the load generator may have set ("client-bound") is a least count, as "beyond" is.
RATIO_KIND = {("found", "found"): "exact", ("found", "beyond"): "at least", ("beyond", "found"): "at most",
              ("found", "client-bound"): "at least", ("client-bound", "found"): "at most"}


def capacity(report: dict) -> dict:
    s, m = report["summary"], report["machine"]
    target = report["models"]["target"]
    base, split = s["baseline_sessions_at_slo"], s["split_sessions_at_slo"]
    results = report["results"]
    swept = {mode: count is not None and mode in results for mode, count in (("none", base), ("sim", split))}
    limits = {mode: slo_limit(results[mode]) if swept[mode] else None for mode in swept}
    ratio_kind = RATIO_KIND.get((limits["none"], limits["sim"]))
    return {
        # A server the load test did not start: its device is unknown here (the CPU is the load generator's).
        "device": None if m.get("device") == "remote" else m.get("gpu") or m["cpu"],
        "target_config": target.get("config"),  # None: a server the load test did not start
        "target": target["name"],
        "dtype": target.get("dtype"),
        "alpha": report["alpha"],
        "slo_tokens_per_s": report["slo"],
        "baseline_sessions_at_slo": base,
        "split_sessions_at_slo": split,
        # "found", "below" (under the fewest tried), "beyond" (the most tried, or more), "client-bound"
        # (found where the load generator was saturated: at least) or "unknown" (nothing served at the
        # first point); None: not swept
        "baseline_limit": limits["none"],
        "split_limit": limits["sim"],
        "ratio": split / base if ratio_kind else None,  # None: a mode not swept, or a limit not found
        "ratio_kind": ratio_kind,  # exact, "at least", "at most"
        "baseline_text": limit_text(report, "none") if swept["none"] else None,
        "split_text": limit_text(report, "sim") if swept["sim"] else None,
        "errors": s["errors"],
        "mismatched_outputs": s["mismatched_outputs"],
        "server_args": report.get("server_args"),
        "stopped": report.get("stopped"),  # a sweep that ended early (interrupted, nothing served)
        "full_report": report.get("name"),
        "rerun": report["rerun"],
    }


def render(c: dict, source: str, out: str = "bench/results/capacity-gpu") -> str:
    if c["ratio"] is None:
        ratio = "n/a (a limit the sweep did not find)" if c["baseline_text"] and c["split_text"] else "n/a"
    else:
        ratio = ("" if c["ratio_kind"] == "exact" else f"{c['ratio_kind']} ") + f"{c['ratio']:.2f}x"
    return "\n".join([
        f"# Capacity at {c['slo_tokens_per_s']:g} tokens/s per session "
        f"({c['device'] or 'a server the load test did not start'})", "",
        "| | sessions at the SLO |", "| --- | --- |",
        f"| server only (baseline) | {c['baseline_text'] or 'not swept'} |",
        f"| split, simulated edges at alpha {c['alpha']:g} | {c['split_text'] or 'not swept'} |",
        f"| ratio | {ratio} |", "",
        *([f"**Stopped early:** {c['stopped']}.", ""] if c["stopped"] else []),
        f"Errors: {c['errors']['total']}; outputs differing from the target's greedy continuation: "
        f"{c['mismatched_outputs']}. Target: {c['target']}. Full per-point tables: `{source}` "
        "(and its .md).", "",
        "To rerun, on a machine with the same device, from the repository root after `make venv` "
        "(or with the three packages on PYTHONPATH):", "",
        f"    {c['rerun']}",
        # The load test's rerun line writes its report to OUT_DIR.
        f"    python bench/loadtest/capacity.py OUT_DIR/{Path(source).name} --out {out}", "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path, help="a load-test report (JSON written by bench/loadtest/run.py)")
    p.add_argument("--out", type=Path, required=True, help="output path without suffix: writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        report.setdefault("name", args.report.name)
        c = capacity(report)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # unreadable, or not a load-test report
        p.error(f"cannot read a load-test report from {args.report}: {type(exc).__name__}: {exc}")
    json_path, md_path = (args.out.parent / f"{args.out.name}{suffix}" for suffix in (".json", ".md"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(c, indent=2) + "\n")
    # Named where the report is kept (bench/results/), not where this run read it from.
    note = render(c, f"bench/results/{args.report.name}", f"bench/results/{args.out.name}")
    md_path.write_text(note)
    print(note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
